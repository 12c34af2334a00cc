/* Tree attention: validate the packed tree layout and compile it to a segment
 * plan (fa_plan_tree); layout_attn.c runs it with the shared kernels. */
#include "layout_attn.h"
#include "validate.h"

/* Check the layout; on success *rows = node_offsets[n]. O(n), no recursion:
 * parents[i] < i rules out cycles. Shared with the cost model (validate.h). */
forkattn_status fa_check_tree_layout(forkattn_ctx *ctx, const void *layout, int64_t *rows) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  const forkattn_tree_layout *t = layout;
  if (!t) return fa_fail(ctx, bad, "tree: layout is NULL");
  const int64_t n = t->num_nodes;
  if (n < 0) return fa_fail(ctx, bad, "tree: num_nodes %lld is negative", (long long)n);
  *rows = 0;
  if (n == 0) return FORKATTN_OK;
  const int64_t *off = t->node_offsets, *par = t->parents;
  if (!off) return fa_fail(ctx, bad, "tree: node_offsets is NULL with %lld nodes", (long long)n);
  if (!par) return fa_fail(ctx, bad, "tree: parents is NULL with %lld nodes", (long long)n);
  forkattn_status st;
  if ((st = fa_check_aligned(ctx, "tree: node_offsets", off, sizeof *off)) ||
      (st = fa_check_aligned(ctx, "tree: parents", par, sizeof *par)))
    return st;
  if (off[0] != 0) return fa_fail(ctx, bad, "tree: node_offsets[0] is %lld, must be 0", (long long)off[0]);
  for (int64_t i = 0; i < n; i++) {
    if (off[i + 1] < off[i])
      return fa_fail(ctx, bad, "tree: node_offsets not monotonic: [%lld] = %lld > [%lld] = %lld",
                     (long long)i, (long long)off[i], (long long)(i + 1), (long long)off[i + 1]);
    if (par[i] < -1 || par[i] >= i)
      return fa_fail(ctx, bad,
                     "tree: parents[%lld] = %lld: must be -1 or a node packed before it (0..%lld)",
                     (long long)i, (long long)par[i], (long long)(i - 1));
  }
  *rows = off[n];
  return FORKATTN_OK;
}

static int fa_tree_plan(const void *layout, fa_plan *plan) {
  const forkattn_tree_layout *t = layout;
  return fa_plan_tree(plan, t->num_nodes, t->node_offsets, t->parents, 1);
}

static void fa_tree_key(const void *layout, fa_plan_key *key) {
  const forkattn_tree_layout *t = layout;
  const int64_t n = t->num_nodes;
  *key = (fa_plan_key){{FA_PLAN_KEY_TREE, 1, n}, {t->node_offsets, t->parents}, {n ? n + 1 : 0, n}};
}

const fa_layout_ops fa_tree_ops = {fa_check_tree_layout, fa_tree_plan, fa_tree_key};

forkattn_status forkattn_tree_fwd(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                  const forkattn_tensor *q, const forkattn_tensor *k,
                                  const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                                  float scale, forkattn_memory memory) {
  return fa_layout_fwd(ctx, &fa_tree_ops, tree, NULL, q, k, v, o, lse, scale, memory);
}

forkattn_status forkattn_tree_bwd(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                  const forkattn_tensor *q, const forkattn_tensor *k,
                                  const forkattn_tensor *v, const forkattn_tensor *o,
                                  const forkattn_tensor *dout, const float *lse,
                                  const forkattn_tensor *dq, const forkattn_tensor *dk,
                                  const forkattn_tensor *dv, float scale, forkattn_memory memory) {
  return fa_layout_bwd(ctx, &fa_tree_ops, tree, NULL, q, k, v, o, dout, lse, dq, dk, dv, scale, memory);
}
