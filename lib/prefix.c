/* Shared-prompt attention (DualKV): validate the packed layout, compile it to a
 * segment plan (a tree of depth one) and run segment attention. */
#include <stdlib.h>

#include "segment_attn.h"
#include "validate.h"

/* Check the layout; on success *rows = P + offsets[N]. */
static forkattn_status fa_check_prefix_layout(forkattn_ctx *ctx, const forkattn_prefix_layout *l,
                                              int64_t *rows) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!l) return fa_fail(ctx, bad, "layout: is NULL");
  if (l->prompt_len < 0)
    return fa_fail(ctx, bad, "layout: prompt_len %lld is negative", (long long)l->prompt_len);
  if (l->num_responses < 0)
    return fa_fail(ctx, bad, "layout: num_responses %lld is negative", (long long)l->num_responses);
  if (l->mask != FORKATTN_MASK_CAUSAL && l->mask != FORKATTN_MASK_BIDIRECTIONAL)
    return fa_fail(ctx, bad, "layout: mask %d is neither causal nor bidirectional", (int)l->mask);
  int64_t n = l->num_responses, total = 0;
  if (n > 0) {
    const int64_t *off = l->response_offsets;
    if (!off) return fa_fail(ctx, bad, "layout: response_offsets is NULL with %lld responses", (long long)n);
    if (off[0] != 0)
      return fa_fail(ctx, bad, "layout: response_offsets[0] is %lld, must be 0", (long long)off[0]);
    for (int64_t i = 0; i < n; i++)
      if (off[i + 1] < off[i])
        return fa_fail(ctx, bad, "layout: response_offsets not monotonic: [%lld] = %lld > [%lld] = %lld",
                       (long long)i, (long long)off[i], (long long)(i + 1), (long long)off[i + 1]);
    total = off[n];
  }
  if (__builtin_add_overflow(l->prompt_len, total, rows))
    return fa_fail(ctx, bad, "layout: prompt_len + response rows overflows int64");
  return FORKATTN_OK;
}

/* Checks both directions share: memory, layout, q/k/v, scale. */
static forkattn_status fa_prefix_begin(forkattn_ctx *ctx, const forkattn_prefix_layout *l,
                                       const forkattn_tensor *q, const forkattn_tensor *k,
                                       const forkattn_tensor *v, float scale, int64_t *rows,
                                       int64_t *hq, int64_t *hkv, int64_t *d,
                                       forkattn_memory memory) {
  forkattn_status st;
  if ((st = fa_check_memory(ctx, memory))) return st;
  if ((st = fa_check_prefix_layout(ctx, l, rows))) return st;
  if ((st = fa_check_qkv(ctx, q, k, v, *rows, hq, hkv, d))) return st;
  return fa_check_scale(ctx, scale);
}

static forkattn_status fa_prefix_plan(forkattn_ctx *ctx, const forkattn_prefix_layout *l,
                                      fa_plan *plan) {
  if (fa_plan_prefix(plan, l->prompt_len, l->num_responses, l->response_offsets,
                     l->mask == FORKATTN_MASK_CAUSAL))
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "prefix: cannot allocate the segment plan");
  return FORKATTN_OK;
}

forkattn_status forkattn_prefix_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                    const forkattn_tensor *q, const forkattn_tensor *k,
                                    const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                                    float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  int64_t rows, hq, hkv, d;
  forkattn_status st = fa_prefix_begin(ctx, layout, q, k, v, scale, &rows, &hq, &hkv, &d, memory);
  if (st) return st;
  if ((st = fa_check_tensor(ctx, "o", o, q->dtype, rows, hq, d))) return st;
  if (rows == 0) return FORKATTN_OK;
  fa_plan plan;
  if ((st = fa_prefix_plan(ctx, layout, &plan))) return st;
  fa_attn_fwd a = {&plan, *q, *k, *v, *o, lse, scale, hq, hkv, d};
  st = fa_attn_fwd_run(ctx, &a, memory);
  fa_plan_free(&plan);
  return st;
}

forkattn_status forkattn_prefix_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                    const forkattn_tensor *q, const forkattn_tensor *k,
                                    const forkattn_tensor *v, const forkattn_tensor *o,
                                    const forkattn_tensor *dout, const float *lse,
                                    const forkattn_tensor *dq, const forkattn_tensor *dk,
                                    const forkattn_tensor *dv, float scale,
                                    forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  int64_t rows, hq, hkv, d;
  forkattn_status st = fa_prefix_begin(ctx, layout, q, k, v, scale, &rows, &hq, &hkv, &d, memory);
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
  if ((st = fa_prefix_plan(ctx, layout, &plan))) return st;
  fa_attn_bwd a = {&plan, *q, *k, *v, *o, *dout, *dq, *dk, *dv, lse, scale, hq, hkv, d};
  st = fa_attn_bwd_run(ctx, &a, memory);
  fa_plan_free(&plan);
  return st;
}
