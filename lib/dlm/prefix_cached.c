/* Attention of new rows against a cached shared prefix: the
 * responses' queries only, keys = [prefix ; responses]. The same segment
 * primitive with queries in their own row space (segment_plan.h, qshift). */
#include <string.h>

#include "alloc.h"
#include "backend.h"
#include "layout_attn.h"
#include "validate.h"

/* Layout, shapes and scale; *r = response rows, *t = P + r key rows. */
static forkattn_status fa_cached_begin(forkattn_ctx *ctx, const forkattn_prefix_layout *l, const forkattn_tensor *q,
                                       const forkattn_tensor *k, const forkattn_tensor *v, float scale,
                                       forkattn_memory memory, int64_t *r, int64_t *hq, int64_t *hkv, int64_t *d) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_status st;
  int64_t total;
  if ((st = fa_check_memory(ctx, memory)) || (st = fa_prefix_ops.check(ctx, l, &total))) return st;
  *r = total - l->prompt_len;
  if (!v) return fa_fail(ctx, bad, "v: tensor descriptor is NULL");
  if ((st = fa_check_qk(ctx, "q", "k", q, k, *r, total, hq, hkv, d)) ||
      (st = fa_check_tensor(ctx, "v", v, q->dtype, total, *hkv, *d)))
    return st;
  return fa_check_scale(ctx, scale);
}

/* Zero every element of t (key rows no response reads: their gradient is 0). */
static forkattn_status fa_tensor_zero(forkattn_ctx *ctx, const forkattn_tensor *t, forkattn_memory memory) {
  const size_t es = t->dtype == FORKATTN_DTYPE_F32 ? 4 : 2, bytes = es * (size_t)t->head_dim;
  const forkattn_status st =
      memory == FORKATTN_MEMORY_DEVICE ? fa_ctx_wait_stream(ctx, "prefix_cached_bwd") : FORKATTN_OK;
  if (st) return st;
  void *zero = memory == FORKATTN_MEMORY_DEVICE ? fa_calloc(1, bytes) : NULL;
  if (memory == FORKATTN_MEMORY_DEVICE && !zero)
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "prefix_cached_bwd: cannot allocate a zero row");
  int failed = 0;
  for (int64_t r = 0; r < t->rows && !failed; r++)
    for (int64_t h = 0; h < t->heads && !failed; h++) {
      char *dst = (char *)t->data + es * (size_t)(r * t->row_stride + h * t->head_stride);
      if (memory == FORKATTN_MEMORY_HOST)
        memset(dst, 0, bytes);
      else
        failed = ctx->ops->mem_copy(ctx->device, dst, 1, zero, 0, bytes) != 0;
    }
  fa_free(zero);
  return failed ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "prefix_cached_bwd: zeroing dk/dv failed") : FORKATTN_OK;
}

/* A layout and its block: 0 for the layout's mask, > 0 block-causal over
 * blocks of that many rows. */
typedef struct {
  const forkattn_prefix_layout *l;
  int64_t block;
} fa_cached_layout;

static int fa_cached_build(const void *arg, fa_plan *plan) {
  const fa_cached_layout *c = arg;
  const forkattn_prefix_layout *l = c->l;
  return c->block > 0
             ? fa_plan_prefix_cached_blocks(plan, l->prompt_len, l->num_responses, l->response_offsets, c->block)
             : fa_plan_prefix_cached(plan, l->prompt_len, l->num_responses, l->response_offsets,
                                     l->mask == FORKATTN_MASK_CAUSAL);
}

/* The call's plan, from the context's plan cache or built into *own. */
static forkattn_status fa_cached_plan(forkattn_ctx *ctx, const forkattn_prefix_layout *l, int64_t block, fa_plan *own,
                                      const fa_plan **plan) {
  const fa_cached_layout arg = {l, block};
  const int64_t n = l->num_responses;
  const fa_plan_key key = {{FA_PLAN_KEY_PREFIX_CACHED, block > 0 ? 0 : l->mask == FORKATTN_MASK_CAUSAL, block,
                            l->prompt_len, n},
                           {l->response_offsets},
                           {n ? n + 1 : 0}};
  return fa_plan_for_call(ctx, &key, fa_cached_build, &arg, own, plan);
}

static forkattn_status fa_check_block(forkattn_ctx *ctx, int64_t block) {
  if (block < 1)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "block_size: %lld must be >= 1", (long long)block);
  return FORKATTN_OK;
}

static forkattn_status fa_cached_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout, int64_t block,
                                     const forkattn_tensor *q, const forkattn_tensor *k, const forkattn_tensor *v,
                                     const forkattn_tensor *o, float *lse, float scale, forkattn_memory memory) {
  int64_t r = 0, hq = 0, hkv = 0, d = 0;
  forkattn_status st = fa_cached_begin(ctx, layout, q, k, v, scale, memory, &r, &hq, &hkv, &d);
  if (st || (st = fa_check_tensor(ctx, "o", o, q->dtype, r, hq, d))) return st;
  if (r == 0) return FORKATTN_OK;
  fa_plan own;
  const fa_plan *plan;
  if ((st = fa_cached_plan(ctx, layout, block, &own, &plan))) return st;
  fa_attn_fwd a = {plan, *q, *k, *v, *o, lse, scale, hq, hkv, d, NULL};
  st = fa_attn_fwd_run(ctx, &a, memory);
  fa_plan_free(&own);
  return st;
}

static forkattn_status fa_cached_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout, int64_t block,
                                     const forkattn_tensor *q, const forkattn_tensor *k, const forkattn_tensor *v,
                                     const forkattn_tensor *o, const forkattn_tensor *dout, const float *lse,
                                     const forkattn_tensor *dq, const forkattn_tensor *dk, const forkattn_tensor *dv,
                                     float scale, forkattn_memory memory) {
  int64_t r = 0, hq = 0, hkv = 0, d = 0;
  forkattn_status st = fa_cached_begin(ctx, layout, q, k, v, scale, memory, &r, &hq, &hkv, &d);
  if (st || (st = fa_check_tensor(ctx, "o", o, q->dtype, r, hq, d)) ||
      (st = fa_check_tensor(ctx, "dout", dout, q->dtype, r, hq, d)) ||
      (st = fa_check_tensor(ctx, "dq", dq, q->dtype, r, hq, d)) ||
      (st = fa_check_tensor(ctx, "dk", dk, q->dtype, k->rows, hkv, d)) ||
      (st = fa_check_tensor(ctx, "dv", dv, q->dtype, k->rows, hkv, d)))
    return st;
  if (!lse && r > 0)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "lse: is NULL (the forward's log-sum-exp is required)");
  if (r == 0) { /* nothing reads the prefix */
    if ((st = fa_tensor_zero(ctx, dk, memory))) return st;
    return fa_tensor_zero(ctx, dv, memory);
  }
  fa_plan own;
  const fa_plan *plan;
  if ((st = fa_cached_plan(ctx, layout, block, &own, &plan))) return st;
  fa_attn_bwd a = {plan, *q, *k, *v, *o, *dout, *dq, *dk, *dv, lse, scale, hq, hkv, d, NULL};
  st = fa_attn_bwd_run(ctx, &a, memory);
  fa_plan_free(&own);
  return st;
}

forkattn_status forkattn_prefix_cached_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                           const forkattn_tensor *q, const forkattn_tensor *k,
                                           const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                                           float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  return fa_cached_fwd(ctx, layout, 0, q, k, v, o, lse, scale, memory);
}

forkattn_status forkattn_prefix_cached_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                           const forkattn_tensor *q, const forkattn_tensor *k,
                                           const forkattn_tensor *v, const forkattn_tensor *o,
                                           const forkattn_tensor *dout, const float *lse,
                                           const forkattn_tensor *dq, const forkattn_tensor *dk,
                                           const forkattn_tensor *dv, float scale, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  return fa_cached_bwd(ctx, layout, 0, q, k, v, o, dout, lse, dq, dk, dv, scale, memory);
}

forkattn_status forkattn_prefix_cached_block_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                                 int64_t block_size, const forkattn_tensor *q,
                                                 const forkattn_tensor *k, const forkattn_tensor *v,
                                                 const forkattn_tensor *o, float *lse, float scale,
                                                 forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  forkattn_status st = fa_check_block(ctx, block_size);
  return st ? st : fa_cached_fwd(ctx, layout, block_size, q, k, v, o, lse, scale, memory);
}

forkattn_status forkattn_prefix_cached_block_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                                 int64_t block_size, const forkattn_tensor *q,
                                                 const forkattn_tensor *k, const forkattn_tensor *v,
                                                 const forkattn_tensor *o, const forkattn_tensor *dout,
                                                 const float *lse, const forkattn_tensor *dq,
                                                 const forkattn_tensor *dk, const forkattn_tensor *dv, float scale,
                                                 forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  forkattn_status st = fa_check_block(ctx, block_size);
  return st ? st : fa_cached_bwd(ctx, layout, block_size, q, k, v, o, dout, lse, dq, dk, dv, scale, memory);
}
