/* Segment attention: the one primitive behind every attention layout.
 * A layout compiles to an fa_plan; backends run the plan. Every row of the
 * plan's range must belong to exactly one segment that has pairs, so every
 * output element is written. */
#ifndef FORKATTN_SEGMENT_ATTN_H
#define FORKATTN_SEGMENT_ATTN_H
#include "context_internal.h"
#include "kept_mask.h"
#include "segment_plan.h"

typedef struct fa_attn_fwd {
  const fa_plan *plan;
  forkattn_tensor q, k, v, o; /* q, o: [rows, hq, d]; k, v: [rows, hkv, d] */
  float *lse;                 /* [rows, hq] or NULL */
  float scale;
  int64_t hq, hkv, d;
  const fa_kept *kept; /* kept-set mask (host copy; GPU kernels stage it) or NULL */
} fa_attn_fwd;

typedef struct fa_attn_bwd {
  const fa_plan *plan;
  forkattn_tensor q, k, v, o, dout, dq, dk, dv;
  const float *lse; /* [rows, hq] from the forward */
  float scale;
  int64_t hq, hkv, d;
  const fa_kept *kept; /* as in fa_attn_fwd */
} fa_attn_bwd;

/* memory must be a known value, and DEVICE needs the GPU backend. */
forkattn_status fa_check_memory(forkattn_ctx *ctx, forkattn_memory memory);

/* Run on the context's backend; memory says where the tensors live. */
forkattn_status fa_attn_fwd_run(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory);
forkattn_status fa_attn_bwd_run(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory);

#endif
