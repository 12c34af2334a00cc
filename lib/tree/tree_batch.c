/* Batch plan: the root trees of a forest packed first-fit-decreasing (by
 * predicted cost) into batches of at most max_batch_rows rows, and per batch
 * the choice between tree attention and plain causal attention over every
 * root-to-leaf sequence, whichever the cost model predicts cheaper. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "tree_model.h"
#include "validate.h"

#define FA_REASON_LEN 192

struct forkattn_batch_plan {
  int64_t count;
  fa_subforest *batch;
  forkattn_exec_mode *mode;
  char (*reason)[FA_REASON_LEN];
};

typedef struct {
  const double *cost;
} fa_by_cost;

static int fa_costlier(const void *arg, int64_t a, int64_t b) {
  const double *c = ((const fa_by_cost *)arg)->cost;
  return c[a] > c[b] || (c[a] == c[b] && a < b);
}

/* Max segment tree over batches' free rows (-1: no batch yet or a full
 * oversized one): the leftmost batch with room is found in O(log). */
static void fa_seg_set(int64_t *seg, int64_t size, int64_t i, int64_t v) {
  i += size;
  seg[i] = v;
  for (i /= 2; i >= 1; i /= 2) seg[i] = seg[2 * i] > seg[2 * i + 1] ? seg[2 * i] : seg[2 * i + 1];
}

static int64_t fa_seg_first_fit(const int64_t *seg, int64_t size, int64_t need) {
  if (seg[1] < need) return -1;
  int64_t i = 1;
  while (i < size) i = seg[2 * i] >= need ? 2 * i : 2 * i + 1;
  return i - size;
}

static void fa_format_seconds(char *buf, size_t size, double s) {
  if (s >= 1)
    snprintf(buf, size, "%.2f s", s);
  else if (s >= 1e-3)
    snprintf(buf, size, "%.2f ms", s * 1e3);
  else if (s >= 1e-6)
    snprintf(buf, size, "%.2f us", s * 1e6);
  else
    snprintf(buf, size, "%.2f ns", s * 1e9);
}

void forkattn_batch_plan_free(forkattn_batch_plan *plan) {
  if (!plan) return;
  for (int64_t b = 0; b < plan->count; b++) fa_subforest_free(&plan->batch[b]);
  fa_free(plan->batch);
  fa_free(plan->mode);
  fa_free(plan->reason);
  fa_free(plan);
}

/* Decide a batch's mode from its exact tree counts and the replicated counts
 * (each root-to-leaf path as its own causal sequence: one pair each). */
static void fa_decide(forkattn_batch_plan *plan, int64_t b, const int64_t *nodes, const int64_t *prow,
                      const unsigned char *has_child, int64_t *cwork, const forkattn_tree_cost_model *m) {
  fa_subforest *s = &plan->batch[b];
  fa_tree_counts tc;
  fa_tree_count(s->n, s->off, s->par, cwork, &tc, NULL, NULL);
  const double tree_s = fa_model_seconds(m, tc.macs, (double)tc.rows, (double)tc.pairs);
  double rep_macs = 0, rep_rows = 0, rep_seqs = 0;
  for (int64_t j = 0; j < s->n; j++) {
    const int64_t x = nodes[j];
    if (has_child[x] || prow[x] == 0) continue;
    const double L = (double)prow[x];
    rep_macs += 0.5 * L * (L + 1), rep_rows += L, rep_seqs += 1;
  }
  const double rep_s = fa_model_seconds(m, rep_macs, rep_rows, rep_seqs);
  const double dedup = tc.rows > 0 ? rep_rows / (double)tc.rows : 1.0;
  char ts[32], rs[32];
  fa_format_seconds(ts, sizeof ts, tree_s);
  fa_format_seconds(rs, sizeof rs, rep_s);
  plan->mode[b] = tree_s > rep_s ? FORKATTN_EXEC_REPLICATED : FORKATTN_EXEC_TREE;
  s->cost = tree_s > rep_s ? rep_s : tree_s;
  if (plan->mode[b] == FORKATTN_EXEC_TREE)
    snprintf(plan->reason[b], FA_REASON_LEN, "tree: predicted %s vs replicated %s, dedup %.2fx", ts, rs, dedup);
  else if (dedup < 1.5)
    snprintf(plan->reason[b], FA_REASON_LEN,
             "replicated: predicted %s vs tree %s (dedup %.2fx: too little shared prefix)", rs, ts, dedup);
  else
    snprintf(plan->reason[b], FA_REASON_LEN,
             "replicated: predicted %s vs tree %s (dedup %.2fx, but %lld key-segment pairs for %.0f "
             "sequences: segments too small)",
             rs, ts, dedup, (long long)tc.pairs, rep_seqs);
}

forkattn_status forkattn_tree_plan_batches(forkattn_ctx *ctx, const forkattn_tree_layout *forest,
                                           int64_t max_batch_rows, const forkattn_tree_cost_model *model,
                                           forkattn_batch_plan **plan) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (plan) *plan = NULL;
  if (!ctx) return bad;
  fa_clear_error(ctx);
  if (!plan) return fa_fail(ctx, bad, "plan_batches: plan (the output) is NULL");
  if (!forest) return fa_fail(ctx, bad, "plan_batches: forest is NULL");
  int64_t rows;
  forkattn_status st = fa_check_tree_layout(ctx, forest, &rows);
  if (st) return st;
  if (max_batch_rows < 1)
    return fa_fail(ctx, bad, "plan_batches: max_batch_rows %lld must be >= 1", (long long)max_batch_rows);
  if ((st = fa_check_cost_model(ctx, "plan_batches", model))) return st;

  const int64_t n = forest->num_nodes, *off = forest->node_offsets, *par = forest->parents;
  forkattn_batch_plan *pl = fa_calloc(1, sizeof *pl);
  if (!pl) goto oom_early;
  if (n == 0) {
    *plan = pl;
    return FORKATTN_OK;
  }
  /* n entries of the caller's arrays were read by the check: n + 1 and 4n fit int64 */
  int64_t *tid = fa_malloc_array(n, sizeof(int64_t)), *tstart = fa_malloc_array(n + 1, sizeof(int64_t));
  int64_t *tnodes = fa_malloc_array(n, sizeof(int64_t)), *trows = fa_malloc_array(n, sizeof(int64_t));
  int64_t *torder = fa_malloc_array(n, sizeof(int64_t)), *tbatch = fa_malloc_array(n, sizeof(int64_t));
  int64_t *g2l = fa_malloc_array(n, sizeof(int64_t)), *loc_off = fa_malloc_array(n + 1, sizeof(int64_t));
  int64_t *loc_par = fa_malloc_array(n, sizeof(int64_t)), *prow = fa_malloc_array(n, sizeof(int64_t));
  int64_t *cwork = fa_malloc_array(FA_TREE_COUNT_WORK(n), sizeof(int64_t));
  double *tcost = fa_malloc_array(n, sizeof(double));
  unsigned char *has_child = fa_calloc((size_t)n, 1);
  int64_t *seg = NULL, size = 1;
  if (!tid || !tstart || !tnodes || !trows || !torder || !tbatch || !g2l || !loc_off || !loc_par || !prow ||
      !cwork || !tcost || !has_child)
    goto oom;
  /* root trees by root (not by range: any packing order works) */
  int64_t R = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = par[i];
    tid[i] = p < 0 ? R++ : tid[p];
    prow[i] = (p < 0 ? 0 : prow[p]) + (off[i + 1] - off[i]);
    if (p >= 0) has_child[p] = 1;
  }
  for (int64_t t = 0; t <= R; t++) tstart[t] = 0;
  for (int64_t i = 0; i < n; i++) tstart[tid[i] + 1]++;
  for (int64_t t = 0; t < R; t++) tstart[t + 1] += tstart[t];
  for (int64_t i = 0; i < n; i++) tnodes[tstart[tid[i]]++] = i; /* ascending within a tree */
  for (int64_t t = R; t > 0; t--) tstart[t] = tstart[t - 1];
  tstart[0] = 0;
  for (int64_t t = 0; t < R; t++) {
    const int64_t cn = tstart[t + 1] - tstart[t];
    fa_subset_local(off, par, tnodes + tstart[t], cn, g2l, loc_off, loc_par);
    fa_tree_counts tc;
    fa_tree_count(cn, loc_off, loc_par, cwork, &tc, NULL, NULL);
    tcost[t] = fa_model_seconds(model, tc.macs, (double)tc.rows, (double)tc.pairs);
    trows[t] = tc.rows;
    torder[t] = t;
  }
  const fa_by_cost by = {tcost};
  fa_sort_idx(torder, R, fa_costlier, &by);
  while (size < R) size *= 2;
  if (!(seg = fa_malloc_array(2 * size, sizeof *seg))) goto oom; /* size < 2R <= 2n */
  for (int64_t i = 0; i < 2 * size; i++) seg[i] = -1;
  int64_t nb = 0;
  for (int64_t k = 0; k < R; k++) { /* first fit, costliest first; oversized trees alone */
    const int64_t t = torder[k], need = trows[t];
    int64_t b = need > max_batch_rows ? -1 : fa_seg_first_fit(seg, size, need);
    if (b < 0) {
      b = nb++;
      if (need <= max_batch_rows) fa_seg_set(seg, size, b, max_batch_rows - need);
    } else {
      fa_seg_set(seg, size, b, seg[size + b] - need);
    }
    tbatch[t] = b;
  }
  /* nodes of each batch in the forest's order: counting sort by batch */
  int64_t *bstart = tstart; /* reuse: nb <= R */
  for (int64_t b = 0; b <= nb; b++) bstart[b] = 0;
  for (int64_t i = 0; i < n; i++) bstart[tbatch[tid[i]] + 1]++;
  for (int64_t b = 0; b < nb; b++) bstart[b + 1] += bstart[b];
  for (int64_t i = 0; i < n; i++) tnodes[bstart[tbatch[tid[i]]]++] = i;
  for (int64_t b = nb; b > 0; b--) bstart[b] = bstart[b - 1];
  bstart[0] = 0;
  pl->batch = fa_calloc((size_t)nb, sizeof *pl->batch);
  pl->mode = fa_calloc((size_t)nb, sizeof *pl->mode);
  pl->reason = fa_calloc((size_t)nb, sizeof *pl->reason);
  if (!pl->batch || !pl->mode || !pl->reason) goto oom;
  pl->count = nb;
  for (int64_t b = 0; b < nb; b++) {
    const int64_t *nodes = tnodes + bstart[b];
    if (fa_subforest_build(&pl->batch[b], off, par, nodes, bstart[b + 1] - bstart[b], g2l)) goto oom;
    fa_decide(pl, b, nodes, prow, has_child, cwork, model);
  }
  fa_free(tid), fa_free(tstart), fa_free(tnodes), fa_free(trows), fa_free(torder), fa_free(tbatch);
  fa_free(g2l), fa_free(loc_off), fa_free(loc_par), fa_free(prow), fa_free(cwork), fa_free(tcost);
  fa_free(has_child), fa_free(seg);
  *plan = pl;
  return FORKATTN_OK;
oom:
  fa_free(tid), fa_free(tstart), fa_free(tnodes), fa_free(trows), fa_free(torder), fa_free(tbatch);
  fa_free(g2l), fa_free(loc_off), fa_free(loc_par), fa_free(prow), fa_free(cwork), fa_free(tcost);
  fa_free(has_child), fa_free(seg);
  forkattn_batch_plan_free(pl);
oom_early:
  return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "plan_batches: out of memory (%lld nodes)", (long long)n);
}

static int fa_batch_ok(const forkattn_batch_plan *plan, int64_t b) { return plan && b >= 0 && b < plan->count; }

int64_t forkattn_batch_plan_count(const forkattn_batch_plan *plan) { return plan ? plan->count : 0; }

forkattn_status forkattn_batch_plan_layout(const forkattn_batch_plan *plan, int64_t batch,
                                           forkattn_tree_layout *layout) {
  if (!layout) return FORKATTN_ERR_INVALID_ARGUMENT;
  const int ok = fa_batch_ok(plan, batch);
  *layout = ok ? fa_subforest_layout(&plan->batch[batch]) : (forkattn_tree_layout){0, NULL, NULL};
  return ok ? FORKATTN_OK : FORKATTN_ERR_INVALID_ARGUMENT;
}

const int64_t *forkattn_batch_plan_rows(const forkattn_batch_plan *plan, int64_t batch, int64_t *num_rows) {
  const int ok = fa_batch_ok(plan, batch);
  if (num_rows) *num_rows = ok ? plan->batch[batch].rows : 0;
  return ok ? plan->batch[batch].row_map : NULL;
}

forkattn_exec_mode forkattn_batch_plan_mode(const forkattn_batch_plan *plan, int64_t batch) {
  return fa_batch_ok(plan, batch) ? plan->mode[batch] : FORKATTN_EXEC_TREE;
}

const char *forkattn_batch_plan_reason(const forkattn_batch_plan *plan, int64_t batch) {
  return fa_batch_ok(plan, batch) ? plan->reason[batch] : "";
}
