/* Shared call flow of the layout entry points (prefix, tree). */
#include "layout_attn.h"
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

static forkattn_status fa_layout_plan(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                                      fa_plan *plan) {
  if (ops->plan(layout, plan))
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "layout: cannot allocate the segment plan");
  return FORKATTN_OK;
}

forkattn_status fa_layout_fwd(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                              const forkattn_tensor *q, const forkattn_tensor *k,
                              const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                              float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  int64_t rows, hq, hkv, d;
  forkattn_status st = fa_layout_begin(ctx, ops, layout, q, k, v, scale, &rows, &hq, &hkv, &d, memory);
  if (st) return st;
  if ((st = fa_check_tensor(ctx, "o", o, q->dtype, rows, hq, d))) return st;
  if (rows == 0) return FORKATTN_OK;
  fa_plan plan;
  if ((st = fa_layout_plan(ctx, ops, layout, &plan))) return st;
  fa_attn_fwd a = {&plan, *q, *k, *v, *o, lse, scale, hq, hkv, d};
  st = fa_attn_fwd_run(ctx, &a, memory);
  fa_plan_free(&plan);
  return st;
}

forkattn_status fa_layout_bwd(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                              const forkattn_tensor *q, const forkattn_tensor *k,
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
  if (rows == 0) return FORKATTN_OK;
  fa_plan plan;
  if ((st = fa_layout_plan(ctx, ops, layout, &plan))) return st;
  fa_attn_bwd a = {&plan, *q, *k, *v, *o, *dout, *dq, *dk, *dv, lse, scale, hq, hkv, d};
  st = fa_attn_bwd_run(ctx, &a, memory);
  fa_plan_free(&plan);
  return st;
}
