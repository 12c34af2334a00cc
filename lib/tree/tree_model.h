/* Tree cost model internals shared by the cost, partition and batch-plan code:
 * what a tree costs (counts of the linear model), and sub-forests (a subset of
 * a tree's nodes repacked in their own rows, with the map back to global rows). */
#ifndef FORKATTN_TREE_MODEL_H
#define FORKATTN_TREE_MODEL_H
#include "context_internal.h"
#include "forkattn_experimental.h"

/* The three quantities the linear model multiplies. */
typedef struct fa_tree_counts {
  double macs;   /* M: sum over rows of the keys each row sees */
  int64_t rows;  /* T */
  int64_t pairs; /* (node, key segment) pairs, as fa_plan_tree builds them */
} fa_tree_counts;

/* Scratch int64 entries fa_tree_count needs for n nodes. */
#define FA_TREE_COUNT_WORK(n) (4 * (n))

/* Model argument check; fn names the caller in the message. */
forkattn_status fa_check_cost_model(forkattn_ctx *ctx, const char *fn,
                                    const forkattn_tree_cost_model *m);

/* Predicted seconds of the given counts. */
double fa_model_seconds(const forkattn_tree_cost_model *m, double macs, double rows, double pairs);

/* Counts of a validated tree (n >= 0). work: FA_TREE_COUNT_WORK(n) int64s.
 * When model and node_cost are non-NULL, node_cost[i] receives node i's share:
 * its mac and row terms (exact: they depend only on its ancestors) and its
 * pairs in this tree (a node keeps or loses its merge into the parent's key
 * segment in a sub-forest, so sub-forest pair counts are at most these). */
void fa_tree_count(int64_t n, const int64_t *off, const int64_t *par, int64_t *work,
                   fa_tree_counts *c, const forkattn_tree_cost_model *m, double *node_cost);

/* A subset of a tree's nodes (closed under ancestors) in the tree's packed order,
 * repacked in its own rows. */
typedef struct fa_subforest {
  int64_t n, rows;
  int64_t *off;         /* [n+1], NULL when n = 0 */
  int64_t *par;         /* [n], NULL when n = 0 */
  int64_t *row_map;     /* [rows] global row of each local row; NULL when rows = 0 */
  unsigned char *owned; /* [rows] or NULL (partitions only) */
  double cost;          /* predicted seconds */
} fa_subforest;

/* Local layout of nodes[0..count) (ascending global indices, closed under
 * ancestors) into loc_off[count+1] / loc_par[count]; g2l is [N] scratch of
 * which only the listed entries are written. */
void fa_subset_local(const int64_t *off, const int64_t *par, const int64_t *nodes, int64_t count,
                     int64_t *g2l, int64_t *loc_off, int64_t *loc_par);

/* Build s from nodes as above (owned not allocated). Returns 0, or -1 on
 * allocation failure with s emptied. */
int fa_subforest_build(fa_subforest *s, const int64_t *off, const int64_t *par, const int64_t *nodes,
                       int64_t count, int64_t *g2l);
void fa_subforest_free(fa_subforest *s);

/* Public view of a sub-forest. */
forkattn_tree_layout fa_subforest_layout(const fa_subforest *s);

/* Strict order for fa_sort_idx: non-zero when a goes before b. */
typedef int (*fa_before_fn)(const void *arg, int64_t a, int64_t b);
/* Sort n int64 (usually indices) in place by before() (heap sort: no recursion,
 * no allocation; make before() a total order for a deterministic result). */
void fa_sort_idx(int64_t *a, int64_t n, fa_before_fn before, const void *arg);
/* Sort ascending. */
void fa_sort_i64(int64_t *a, int64_t n);

#endif
