/* Partition search internals shared by tree_partition.c (set-up, exact
 * scoring, the API) and tree_partition_search.c (the candidate searches). */
#ifndef FORKATTN_TREE_PARTITION_H
#define FORKATTN_TREE_PARTITION_H
#include "tree_model.h"

#define FA_CNT_CAP ((int64_t)1 << 22)  /* parts x nodes counters for (b), (c) */
#define FA_STEP_BUDGET ((int64_t)4e7) /* node visits of (b) + (c) */

/* Working state of one forkattn_tree_partition() call (n nodes, K parts, L leaves). */
typedef struct fa_pwork {
  int64_t n, K, L;
  const int64_t *off, *par;
  double *c, *C;       /* node cost, root-path cost [n] */
  int64_t *leaf;       /* [L] leaves in DFS order */
  int64_t *first_leaf; /* [n] DFS index of the first leaf under each node */
  double *PC, *PS;     /* [L+1] prefix sums of path costs / of neighbours' LCA path costs */
  int64_t *list, *mark, *g2l, *loc_off, *loc_par, *cwork, *order; /* exact evaluation */
  int64_t stamp;
  int32_t *cnt;        /* [K*n] leaves of a part under each node ((b), (c)) */
  int64_t *mark_a, *mark_b, sstamp; /* [n] swap evaluation stamps */
  double *load;        /* [K] */
  int64_t steps;
} fa_pwork;

/* Ranges of leaves [l, r) and a max-heap of them by cost: [K] arrays. */
typedef struct {
  int64_t *l, *r, *heap, size;
} fa_ranges;

/* (a): contiguous ranges of leaves in DFS order, min-max split; K < L. */
void fa_contiguous(fa_pwork *w, fa_ranges *rg, int64_t *assign);
/* (b): LPT. Returns 0, or -1 when the step budget ran out (candidate dropped). */
int fa_lpt(fa_pwork *w, int64_t *assign);
/* (c): single-leaf moves and swaps out of the costliest part, in place. */
void fa_improve(fa_pwork *w, int64_t *assign);

#endif
