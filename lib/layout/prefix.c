/* Shared-prompt attention (DualKV): validate the packed layout and compile it
 * to a segment plan (a tree of depth one); layout_attn.c runs it. */
#include <stdlib.h>

#include "layout_attn.h"
#include "validate.h"

/* Check the layout; on success *rows = P + offsets[N]. */
static forkattn_status fa_check_prefix_layout(forkattn_ctx *ctx, const void *layout, int64_t *rows) {
  const forkattn_prefix_layout *l = layout;
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
    forkattn_status st = fa_check_aligned(ctx, "layout: response_offsets", off, sizeof *off);
    if (st) return st;
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

static int fa_prefix_plan(const void *layout, fa_plan *plan) {
  const forkattn_prefix_layout *l = layout;
  return fa_plan_prefix(plan, l->prompt_len, l->num_responses, l->response_offsets,
                        l->mask == FORKATTN_MASK_CAUSAL);
}

static void fa_prefix_key(const void *layout, fa_plan_key *key) {
  const forkattn_prefix_layout *l = layout;
  const int64_t n = l->num_responses;
  *key = (fa_plan_key){{FA_PLAN_KEY_PREFIX, l->mask == FORKATTN_MASK_CAUSAL, l->prompt_len, n},
                       {l->response_offsets},
                       {n ? n + 1 : 0}};
}

const fa_layout_ops fa_prefix_ops = {fa_check_prefix_layout, fa_prefix_plan, fa_prefix_key};

forkattn_status forkattn_prefix_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                    const forkattn_tensor *q, const forkattn_tensor *k,
                                    const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                                    float scale, forkattn_memory memory) {
  return fa_layout_fwd(ctx, &fa_prefix_ops, layout, NULL, q, k, v, o, lse, scale, memory);
}

forkattn_status forkattn_prefix_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                    const forkattn_tensor *q, const forkattn_tensor *k,
                                    const forkattn_tensor *v, const forkattn_tensor *o,
                                    const forkattn_tensor *dout, const float *lse,
                                    const forkattn_tensor *dq, const forkattn_tensor *dk,
                                    const forkattn_tensor *dv, float scale,
                                    forkattn_memory memory) {
  return fa_layout_bwd(ctx, &fa_prefix_ops, layout, NULL, q, k, v, o, dout, lse, dq, dk, dv, scale, memory);
}
