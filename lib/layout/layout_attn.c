/* Shared call flow of the layout entry points (prefix, tree). */
#include "layout_attn.h"
#include "alloc.h"
#include "validate.h"

/* Checks both directions share: memory, layout, q/k/v, scale. */
static forkattn_status fa_layout_begin(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                                       const forkattn_tensor *q, const forkattn_tensor *k,
                                       const forkattn_tensor *v, float scale, int64_t *rows,
                                       int64_t *hq, int64_t *hkv, int64_t *d, forkattn_memory memory) {
  forkattn_status st;
  if ((st = fa_check_memory(ctx, memory))) return st;
  if ((st = ops->check(ctx, layout, rows))) return st;
  if ((st = fa_check_qkv(ctx, q, k, v, *rows, hq, hkv, d))) return st;
  return fa_check_scale(ctx, scale);
}

forkattn_status fa_layout_plan(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout, fa_plan *own,
                               const fa_plan **plan) {
  fa_plan_key key;
  ops->key(layout, &key);
  return fa_plan_for_call(ctx, &key, ops->plan, layout, own, plan);
}

forkattn_status fa_layout_pick(forkattn_ctx *ctx, const forkattn_layout *layout, const fa_layout_ops **ops,
                               const void **l) {
  if (!layout) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "layout: is NULL");
  if (!layout->prefix == !layout->tree)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "layout: set exactly one of prefix and tree (got %s)",
                   layout->prefix ? "both" : "neither");
  *ops = layout->prefix ? &fa_prefix_ops : &fa_tree_ops;
  *l = layout->prefix ? (const void *)layout->prefix : (const void *)layout->tree;
  return FORKATTN_OK;
}

forkattn_status fa_layout_fwd(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                              const forkattn_kept_set *kept, const forkattn_tensor *q, const forkattn_tensor *k,
                              const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                              float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  int64_t rows, hq, hkv, d;
  forkattn_status st = fa_layout_begin(ctx, ops, layout, q, k, v, scale, &rows, &hq, &hkv, &d, memory);
  if (st) return st;
  if ((st = fa_check_tensor(ctx, "o", o, q->dtype, rows, hq, d))) return st;
  if ((st = fa_check_aligned(ctx, "lse", lse, sizeof *lse))) return st;
  fa_kept km;
  unsigned char *owned = NULL;
  if ((st = fa_kept_build(ctx, kept, rows, hq, &km, &owned))) return st;
  if (rows == 0) return FORKATTN_OK;
  fa_plan own;
  const fa_plan *plan;
  if ((st = fa_layout_plan(ctx, ops, layout, &own, &plan))) {
    fa_free(owned);
    return st;
  }
  fa_attn_fwd a = {plan, *q, *k, *v, *o, lse, scale, hq, hkv, d, kept ? &km : NULL};
  st = fa_attn_fwd_run(ctx, &a, memory);
  fa_plan_free(&own);
  fa_free(owned);
  return st;
}

forkattn_status fa_layout_bwd(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                              const forkattn_kept_set *kept, const forkattn_tensor *q, const forkattn_tensor *k,
                              const forkattn_tensor *v, const forkattn_tensor *o,
                              const forkattn_tensor *dout, const float *lse,
                              const forkattn_tensor *dq, const forkattn_tensor *dk,
                              const forkattn_tensor *dv, float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  int64_t rows, hq, hkv, d;
  forkattn_status st = fa_layout_begin(ctx, ops, layout, q, k, v, scale, &rows, &hq, &hkv, &d, memory);
  if (st) return st;
  if ((st = fa_check_tensor(ctx, "o", o, q->dtype, rows, hq, d))) return st;
  if ((st = fa_check_tensor(ctx, "dout", dout, q->dtype, rows, hq, d))) return st;
  if ((st = fa_check_tensor(ctx, "dq", dq, q->dtype, rows, hq, d))) return st;
  if ((st = fa_check_tensor(ctx, "dk", dk, q->dtype, rows, hkv, d))) return st;
  if ((st = fa_check_tensor(ctx, "dv", dv, q->dtype, rows, hkv, d))) return st;
  if (!lse && rows > 0)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "lse: is NULL (the forward's log-sum-exp is required)");
  if ((st = fa_check_aligned(ctx, "lse", lse, sizeof *lse))) return st;
  fa_kept km;
  unsigned char *owned = NULL;
  if ((st = fa_kept_build(ctx, kept, rows, hq, &km, &owned))) return st;
  if (rows == 0) return FORKATTN_OK;
  fa_plan own;
  const fa_plan *plan;
  if ((st = fa_layout_plan(ctx, ops, layout, &own, &plan))) {
    fa_free(owned);
    return st;
  }
  fa_attn_bwd a = {plan, *q, *k, *v, *o, *dout, *dq, *dk, *dv, lse, scale, hq, hkv, d, kept ? &km : NULL};
  st = fa_attn_bwd_run(ctx, &a, memory);
  fa_plan_free(&own);
  fa_free(owned);
  return st;
}

forkattn_status forkattn_kept_fwd(forkattn_ctx *ctx, const forkattn_layout *layout,
                                  const forkattn_kept_set *kept, const forkattn_tensor *q,
                                  const forkattn_tensor *k, const forkattn_tensor *v,
                                  const forkattn_tensor *o, float *lse, float scale,
                                  forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const fa_layout_ops *ops = NULL;
  const void *l = NULL;
  forkattn_status st = fa_layout_pick(ctx, layout, &ops, &l);
  return st ? st : fa_layout_fwd(ctx, ops, l, kept, q, k, v, o, lse, scale, memory);
}

forkattn_status forkattn_kept_bwd(forkattn_ctx *ctx, const forkattn_layout *layout,
                                  const forkattn_kept_set *kept, const forkattn_tensor *q,
                                  const forkattn_tensor *k, const forkattn_tensor *v,
                                  const forkattn_tensor *o, const forkattn_tensor *dout,
                                  const float *lse, const forkattn_tensor *dq,
                                  const forkattn_tensor *dk, const forkattn_tensor *dv,
                                  float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const fa_layout_ops *ops = NULL;
  const void *l = NULL;
  forkattn_status st = fa_layout_pick(ctx, layout, &ops, &l);
  return st ? st : fa_layout_bwd(ctx, ops, l, kept, q, k, v, o, dout, lse, dq, dk, dv, scale, memory);
}
