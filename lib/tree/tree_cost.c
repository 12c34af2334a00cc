/* Tree cost model: the counts it multiplies (M, T, pairs) and the prediction. */
#include <math.h>

#include "alloc.h"
#include "segment_plan.h"
#include "tree_model.h"
#include "validate.h"

forkattn_status fa_check_cost_model(forkattn_ctx *ctx, const char *fn,
                                    const forkattn_tree_cost_model *m) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!m) return fa_fail(ctx, bad, "%s: model is NULL", fn);
  if (m->heads_q < 1) return fa_fail(ctx, bad, "%s: model->heads_q %lld must be >= 1", fn, (long long)m->heads_q);
  if (m->head_dim < 1)
    return fa_fail(ctx, bad, "%s: model->head_dim %lld must be >= 1", fn, (long long)m->head_dim);
  const double coef[3] = {m->sec_per_mac, m->sec_per_row, m->sec_per_pair};
  static const char *const name[3] = {"sec_per_mac", "sec_per_row", "sec_per_pair"};
  for (int i = 0; i < 3; i++)
    if (!isfinite(coef[i]) || coef[i] < 0)
      return fa_fail(ctx, bad, "%s: model->%s %g must be finite and >= 0", fn, name[i], coef[i]);
  return FORKATTN_OK;
}

double fa_model_seconds(const forkattn_tree_cost_model *m, double macs, double rows, double pairs) {
  const double hq = (double)m->heads_q;
  return m->sec_per_mac * hq * (double)m->head_dim * macs + m->sec_per_row * hq * rows +
         m->sec_per_pair * pairs;
}

/* One pair per key segment on a node's root path, key segments as fa_plan_tree
 * (causal) builds them: fa_tree_chains says which nodes continue their nearest
 * non-empty ancestor's segment. Parents precede children: forward passes. */
void fa_tree_count(int64_t n, const int64_t *off, const int64_t *par, int64_t *work,
                   fa_tree_counts *c, const forkattn_tree_cost_model *m, double *node_cost) {
  int64_t *anc = work, *ne = work + n, *kids = work + 2 * n, *kd = work + 3 * n;
  c->macs = 0;
  c->rows = n ? off[n] : 0;
  c->pairs = 0;
  fa_tree_chains(n, off, par, 1, ne, kids, kd);
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = par[i], len = off[i + 1] - off[i], a = ne[i];
    anc[i] = p < 0 ? 0 : anc[p] + (off[p + 1] - off[p]);
    /* kd[i] holds "continues" until rewritten here as key segments on the root path */
    kd[i] = len > 0 ? (a >= 0 ? kd[a] : 0) + !kd[i] : 0;
    /* each row sees all ancestor rows and itself plus the earlier rows of its node */
    const double macs = (double)len * (double)anc[i] + 0.5 * (double)len * ((double)len + 1);
    c->macs += macs;
    c->pairs += kd[i];
    if (m && node_cost) node_cost[i] = fa_model_seconds(m, macs, (double)len, (double)kd[i]);
  }
}

forkattn_status forkattn_tree_cost(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                   const forkattn_tree_cost_model *model, double *seconds) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!ctx) return bad;
  fa_clear_error(ctx);
  int64_t rows;
  if (!tree) return fa_fail(ctx, bad, "tree_cost: tree is NULL");
  forkattn_status st = fa_check_tree_layout(ctx, tree, &rows);
  if (st) return st;
  if ((st = fa_check_cost_model(ctx, "tree_cost", model))) return st;
  if (!seconds) return fa_fail(ctx, bad, "tree_cost: seconds is NULL");
  if ((st = fa_check_aligned(ctx, "tree_cost: seconds", seconds, sizeof *seconds))) return st;
  const int64_t n = tree->num_nodes;
  int64_t *work = fa_malloc_array(FA_TREE_COUNT_WORK(n), sizeof *work);
  if (!work) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "tree_cost: out of memory (%lld nodes)", (long long)n);
  fa_tree_counts c;
  fa_tree_count(n, tree->node_offsets, tree->parents, work, &c, NULL, NULL);
  fa_free(work);
  *seconds = fa_model_seconds(model, c.macs, (double)c.rows, (double)c.pairs);
  return FORKATTN_OK;
}
