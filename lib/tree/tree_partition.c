/* Partition of a tree's leaves (root-to-leaf paths) into parts of balanced
 * predicted cost. A part is the union of its leaves' paths; shared ancestors
 * are duplicated and owned by the part of their first leaf in DFS order.
 *
 * Balancing works on per-node costs (fa_tree_count's node_cost: exact mac and
 * row terms, pair term as in the whole tree, never below the sub-forest's),
 * where a leaf set costs the sum over the union of its paths. Candidates:
 *  (a) contiguous ranges of leaves in DFS order; the union of the paths of
 *      consecutive DFS leaves costs sum(path) - sum(path of LCA of neighbours),
 *      so any range costs O(1) from prefix sums and a bisection on the bound
 *      with a greedy sweep finds the min-max split in O(L log);
 *  (b) LPT: leaves by decreasing path cost, each to the part it leaves least
 *      loaded (a part already holding its ancestors pays only the rest);
 *  (c) moves and swaps of single leaves out of the most loaded part, from (a)
 *      and from (b).
 * (b) and (c) keep per-part node counts and a step budget, so they run only on
 * moderate sizes. Every candidate is repacked and counted exactly; the one
 * with the cheapest largest part wins (then the lower imbalance, then the
 * earlier one): deterministic. */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "tree_partition.h"
#include "validate.h"

struct forkattn_partition {
  int64_t nparts;
  fa_subforest *part;
  double imbalance;
};

/* ---- exact evaluation and the parts ---------------------------------------- */

/* Nodes of part p (ascending) into w->list; returns the count. Leaves are
 * grouped by part in w->order, pstart: [K+1] offsets into it. */
static int64_t fa_part_nodes(fa_pwork *w, const int64_t *pstart, int64_t p) {
  int64_t count = 0;
  const int64_t stamp = w->stamp++;
  for (int64_t i = pstart[p]; i < pstart[p + 1]; i++)
    for (int64_t x = w->leaf[w->order[i]]; x >= 0 && w->mark[x] != stamp; x = w->par[x]) {
      w->mark[x] = stamp;
      w->list[count++] = x;
    }
  fa_sort_i64(w->list, count);
  return count;
}

/* Group leaves by part into w->order (stable), offsets into pstart[K+1]. */
static void fa_group(fa_pwork *w, const int64_t *assign, int64_t *pstart) {
  for (int64_t p = 0; p <= w->K; p++) pstart[p] = 0;
  for (int64_t j = 0; j < w->L; j++) pstart[assign[j] + 1]++;
  for (int64_t p = 0; p < w->K; p++) pstart[p + 1] += pstart[p];
  for (int64_t j = 0; j < w->L; j++) w->order[pstart[assign[j]]++] = j;
  for (int64_t p = w->K; p > 0; p--) pstart[p] = pstart[p - 1];
  pstart[0] = 0;
}

static double fa_imbalance(const double *cost, int64_t K) {
  double mx = 0, sum = 0;
  for (int64_t p = 0; p < K; p++) mx = fmax(mx, cost[p]), sum += cost[p];
  return sum > 0 ? mx / (sum / (double)K) : 1.0;
}

/* Exact score of an assignment (every part repacked and counted): the largest
 * part's cost and the imbalance. */
typedef struct {
  double max, imbalance;
} fa_score;

static fa_score fa_exact_score(fa_pwork *w, const int64_t *assign, int64_t *pstart, double *cost,
                               const forkattn_tree_cost_model *m) {
  fa_group(w, assign, pstart);
  fa_score sc = {0, 0};
  for (int64_t p = 0; p < w->K; p++) {
    const int64_t cn = fa_part_nodes(w, pstart, p);
    fa_subset_local(w->off, w->par, w->list, cn, w->g2l, w->loc_off, w->loc_par);
    fa_tree_counts tc;
    fa_tree_count(cn, w->loc_off, w->loc_par, w->cwork, &tc, NULL, NULL);
    cost[p] = fa_model_seconds(m, tc.macs, (double)tc.rows, (double)tc.pairs);
    sc.max = fmax(sc.max, cost[p]);
  }
  sc.imbalance = fa_imbalance(cost, w->K);
  return sc;
}

static void fa_pwork_free(fa_pwork *w) {
  fa_free(w->c), fa_free(w->C), fa_free(w->leaf), fa_free(w->first_leaf), fa_free(w->PC), fa_free(w->PS);
  fa_free(w->list), fa_free(w->mark), fa_free(w->g2l), fa_free(w->loc_off), fa_free(w->loc_par);
  fa_free(w->cwork), fa_free(w->order), fa_free(w->cnt), fa_free(w->load), fa_free(w->mark_a), fa_free(w->mark_b);
}

/* Node costs, DFS leaf order, prefix sums, first leaves. Returns 0 or -1 (OOM). */
static int fa_pwork_init(fa_pwork *w, const forkattn_tree_layout *t, int64_t K,
                         const forkattn_tree_cost_model *m) {
  const int64_t n = t->num_nodes;
  memset(w, 0, sizeof *w);
  w->n = n, w->K = K, w->off = t->node_offsets, w->par = t->parents;
  /* n entries of the caller's arrays were read by the check: n + 1 and 4n fit int64 */
  w->c = fa_malloc_array(n, sizeof(double)), w->C = fa_malloc_array(n, sizeof(double));
  w->leaf = fa_malloc_array(n, sizeof(int64_t)), w->first_leaf = fa_malloc_array(n, sizeof(int64_t));
  w->PC = fa_malloc_array(n + 1, sizeof(double)), w->PS = fa_malloc_array(n + 1, sizeof(double));
  w->list = fa_malloc_array(n, sizeof(int64_t)), w->mark = fa_malloc_array(n, sizeof(int64_t));
  w->g2l = fa_malloc_array(n, sizeof(int64_t)), w->loc_off = fa_malloc_array(n + 1, sizeof(int64_t));
  w->loc_par = fa_malloc_array(n, sizeof(int64_t)), w->order = fa_malloc_array(n, sizeof(int64_t));
  w->cwork = fa_malloc_array(FA_TREE_COUNT_WORK(n), sizeof(int64_t));
  w->load = fa_malloc_array(K, sizeof(double));
  if (!w->c || !w->C || !w->leaf || !w->first_leaf || !w->PC || !w->PS || !w->list || !w->mark ||
      !w->g2l || !w->loc_off || !w->loc_par || !w->order || !w->cwork || !w->load)
    return -1;
  fa_tree_counts tc;
  fa_tree_count(n, w->off, w->par, w->cwork, &tc, m, w->c);
  /* children in CSR (increasing index) for an iterative preorder; list = heads,
   * loc_par = children, g2l = fill cursor, mark = stack, loc_off = preorder */
  int64_t *cstart = w->list, *kids = w->loc_par, *cur = w->g2l, *stack = w->mark, *pre = w->loc_off;
  for (int64_t i = 0; i < n; i++) cstart[i] = 0;
  for (int64_t i = 0; i < n; i++) {
    w->C[i] = (w->par[i] < 0 ? 0 : w->C[w->par[i]]) + w->c[i];
    if (w->par[i] >= 0) cstart[w->par[i]]++;
  }
  for (int64_t i = 0, s = 0; i < n; i++) { /* cstart[i] = first child slot; cur = next free */
    const int64_t k = cstart[i];
    cstart[i] = cur[i] = s;
    s += k;
  }
  for (int64_t i = 0; i < n; i++)
    if (w->par[i] >= 0) kids[cur[w->par[i]]++] = i;
  /* after the fill cur[i] is the end of i's children */
  int64_t top = 0, k = 0;
  for (int64_t r = n - 1; r >= 0; r--)
    if (w->par[r] < 0) stack[top++] = r;
  while (top > 0) {
    const int64_t x = stack[--top];
    pre[k++] = x;
    for (int64_t e = cur[x] - 1; e >= cstart[x]; e--) stack[top++] = kids[e];
  }
  /* leaves in preorder; the node right after leaf j-1 in preorder starts the
   * branch of leaf j, so its parent is LCA(leaf j-1, leaf j) */
  w->L = 0;
  w->PC[0] = w->PS[0] = w->PS[1] = 0;
  for (int64_t i = 0, prev = -1; i < n; i++) {
    const int64_t x = pre[i];
    w->first_leaf[x] = n;
    if (cur[x] != cstart[x]) continue;
    const int64_t j = w->L++;
    w->leaf[j] = x;
    w->first_leaf[x] = j;
    w->PC[j + 1] = w->PC[j] + w->C[x];
    if (j > 0) {
      const int64_t lca = w->par[pre[prev + 1]];
      w->PS[j + 1] = w->PS[j] + (lca >= 0 ? w->C[lca] : 0);
    }
    prev = i;
  }
  for (int64_t i = n - 1; i >= 0; i--) {
    const int64_t p = w->par[i];
    if (p >= 0 && w->first_leaf[i] < w->first_leaf[p]) w->first_leaf[p] = w->first_leaf[i];
  }
  for (int64_t i = 0; i < n; i++) w->mark[i] = -1;
  w->stamp = 0;
  return 0;
}

/* best = cand when cand's largest part is cheaper (the parts run in parallel:
 * that is the step time), or as cheap and better balanced. Not the imbalance
 * alone: duplicating more ancestors raises the mean and would "balance" a
 * slower partition. */
static void fa_keep_better(fa_pwork *w, const int64_t *cand, int64_t *best, fa_score *bs, int64_t *pstart,
                           double *cost, const forkattn_tree_cost_model *m) {
  const fa_score cs = fa_exact_score(w, cand, pstart, cost, m);
  const double tie = 1e-9 * bs->max;
  if (cs.max < bs->max - tie || (cs.max <= bs->max + tie && cs.imbalance < bs->imbalance)) {
    *bs = cs;
    memcpy(best, cand, sizeof *best * (size_t)w->L);
  }
}

/* ---- API ------------------------------------------------------------------- */

void forkattn_partition_free(forkattn_partition *pt) {
  if (!pt) return;
  for (int64_t p = 0; p < pt->nparts; p++) fa_subforest_free(&pt->part[p]);
  fa_free(pt->part);
  fa_free(pt);
}

/* Repack every part of the chosen assignment, with ownership and exact costs. */
static int fa_build_parts(fa_pwork *w, const int64_t *assign, int64_t *pstart,
                          const forkattn_tree_cost_model *m, forkattn_partition *pt) {
  fa_group(w, assign, pstart);
  for (int64_t p = 0; p < w->K; p++) {
    fa_subforest *s = &pt->part[p];
    const int64_t cn = fa_part_nodes(w, pstart, p);
    if (fa_subforest_build(s, w->off, w->par, w->list, cn, w->g2l)) return -1;
    if (s->rows > 0) {
      if (!(s->owned = fa_malloc((size_t)s->rows))) return -1;
      for (int64_t j = 0; j < cn; j++) {
        const unsigned char own = assign[w->first_leaf[w->list[j]]] == p;
        memset(s->owned + s->off[j], own, (size_t)(s->off[j + 1] - s->off[j]));
      }
    }
    fa_tree_counts tc;
    fa_tree_count(cn, s->off, s->par, w->cwork, &tc, NULL, NULL);
    s->cost = fa_model_seconds(m, tc.macs, (double)tc.rows, (double)tc.pairs);
  }
  return 0;
}

forkattn_status forkattn_tree_partition(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                        int64_t num_parts, const forkattn_tree_cost_model *model,
                                        forkattn_partition **partition) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (partition) *partition = NULL;
  if (!ctx) return bad;
  fa_clear_error(ctx);
  if (!partition) return fa_fail(ctx, bad, "partition: partition (the output) is NULL");
  if (!tree) return fa_fail(ctx, bad, "partition: tree is NULL");
  int64_t rows;
  forkattn_status st = fa_check_tree_layout(ctx, tree, &rows);
  if (st) return st;
  if (num_parts < 1) return fa_fail(ctx, bad, "partition: num_parts %lld must be >= 1", (long long)num_parts);
  if ((st = fa_check_cost_model(ctx, "partition", model))) return st;

  const int64_t n = tree->num_nodes, K = num_parts;
  forkattn_partition *pt = fa_calloc(1, sizeof *pt);
  fa_pwork w;
  memset(&w, 0, sizeof w);
  int64_t *best = NULL, *cand = NULL, *pstart = NULL;
  fa_ranges rg = {NULL, NULL, NULL, 0};
  double *cost = NULL;
  if (!pt || !(pt->part = fa_calloc((size_t)K, sizeof *pt->part))) goto oom;
  pt->nparts = K;
  pt->imbalance = 1.0;
  if (n == 0) {
    *partition = pt;
    return FORKATTN_OK;
  }
  /* K is the caller's number: K + 1 and the byte counts are checked */
  pstart = K < INT64_MAX ? fa_malloc_array(K + 1, sizeof *pstart) : NULL;
  cost = fa_malloc_array(K, sizeof *cost);
  if (!pstart || !cost || fa_pwork_init(&w, tree, K, model)) goto oom;
  best = fa_malloc_array(w.L, sizeof *best);
  cand = fa_malloc_array(w.L, sizeof *cand);
  if (!best || !cand) goto oom;

  if (K >= w.L) { /* a leaf per part: the largest part is the costliest path, a lower bound */
    for (int64_t j = 0; j < w.L; j++) best[j] = j;
  } else {
    rg.l = fa_malloc_array(K, sizeof *rg.l);
    rg.r = fa_malloc_array(K, sizeof *rg.r);
    rg.heap = fa_malloc_array(K, sizeof *rg.heap);
    if (!rg.l || !rg.r || !rg.heap) goto oom;
    fa_contiguous(&w, &rg, best);
  }
  if (K > 1 && w.L > K && K <= FA_CNT_CAP / n) {
    fa_score bs = fa_exact_score(&w, best, pstart, cost, model);
    w.cnt = fa_malloc_array(K * n, sizeof *w.cnt); /* K * n <= FA_CNT_CAP */
    w.mark_a = fa_malloc_array(n, sizeof *w.mark_a);
    w.mark_b = fa_malloc_array(n, sizeof *w.mark_b);
    if (!w.cnt || !w.mark_a || !w.mark_b) goto oom;
    for (int64_t i = 0; i < n; i++) w.mark_a[i] = w.mark_b[i] = -1;
    memcpy(cand, best, sizeof *cand * (size_t)w.L); /* (a) + (c) */
    fa_improve(&w, cand);
    fa_keep_better(&w, cand, best, &bs, pstart, cost, model);
    if (fa_lpt(&w, cand) == 0) { /* (b), then (b) + (c) */
      fa_keep_better(&w, cand, best, &bs, pstart, cost, model);
      fa_improve(&w, cand);
      fa_keep_better(&w, cand, best, &bs, pstart, cost, model);
    }
  }
  if (fa_build_parts(&w, best, pstart, model, pt)) goto oom;
  for (int64_t p = 0; p < K; p++) cost[p] = pt->part[p].cost;
  pt->imbalance = fa_imbalance(cost, K);
  fa_pwork_free(&w);
  fa_free(best), fa_free(cand), fa_free(pstart), fa_free(cost), fa_free(rg.l), fa_free(rg.r), fa_free(rg.heap);
  *partition = pt;
  return FORKATTN_OK;
oom:
  fa_pwork_free(&w);
  fa_free(best), fa_free(cand), fa_free(pstart), fa_free(cost), fa_free(rg.l), fa_free(rg.r), fa_free(rg.heap);
  forkattn_partition_free(pt);
  return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "partition: out of memory (%lld nodes, %lld parts)",
                 (long long)n, (long long)K);
}

int64_t forkattn_partition_num_parts(const forkattn_partition *pt) { return pt ? pt->nparts : 0; }

static const fa_subforest *fa_part(const forkattn_partition *pt, int64_t part) {
  return pt && part >= 0 && part < pt->nparts ? &pt->part[part] : NULL;
}

forkattn_status forkattn_partition_layout(const forkattn_partition *pt, int64_t part, forkattn_tree_layout *layout) {
  if (!layout) return FORKATTN_ERR_INVALID_ARGUMENT;
  const fa_subforest *s = fa_part(pt, part);
  *layout = s ? fa_subforest_layout(s) : (forkattn_tree_layout){0, NULL, NULL};
  return s ? FORKATTN_OK : FORKATTN_ERR_INVALID_ARGUMENT;
}

const int64_t *forkattn_partition_rows(const forkattn_partition *pt, int64_t part, int64_t *num_rows) {
  const fa_subforest *s = fa_part(pt, part);
  if (num_rows) *num_rows = s ? s->rows : 0;
  return s ? s->row_map : NULL;
}

const unsigned char *forkattn_partition_owned(const forkattn_partition *pt, int64_t part) {
  const fa_subforest *s = fa_part(pt, part);
  return s ? s->owned : NULL;
}

double forkattn_partition_cost(const forkattn_partition *pt, int64_t part) {
  const fa_subforest *s = fa_part(pt, part);
  return s ? s->cost : 0.0;
}

double forkattn_partition_imbalance(const forkattn_partition *pt) { return pt ? pt->imbalance : 0.0; }
