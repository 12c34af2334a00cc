/* StreamKL: one call's resolved arguments, shared by the API (streamkl.c)
 * and the CPU and GPU kernels. Statistics per (row, head), FORKATTN_KL_STATS
 * floats: the teacher's lse on the student's support (kept keys), the
 * student's lse, the divergence (before tau^2) and the teacher's lse on its
 * full support. Math: docs/numerics.md, docs/distillation.md. */
#ifndef FORKATTN_STREAMKL_H
#define FORKATTN_STREAMKL_H
#include <math.h>

#include "context_internal.h"
#include "kept_mask.h"
#include "online_kl.h"
#include "segment_plan.h"

enum { FA_KL_LSE_T = 0, FA_KL_LSE_S = 1, FA_KL_DIV = 2, FA_KL_LSE_TF = 3 };

typedef struct fa_kl_call {
  const fa_plan *plan;
  forkattn_tensor qt, kt, qs, ks;  /* teacher [T,H,dt]/[T,hkv_t,dt], student [T,H,ds]/[T,hkv_s,ds] */
  int64_t h, hkv_t, hkv_s, dt, ds;
  float st, ss;                    /* scale / tau of teacher and student scores */
  float loss_mul;                  /* tau^2 or 1 */
  int reverse;                     /* KL(S||T) */
  const fa_kept *kept;             /* student's kept set or NULL (host copy; kernels stage it) */
  /* forward outputs */
  float *kl, *stats, *outside;     /* [T,H], [T,H,4] or NULL, [T,H] or NULL */
  /* backward inputs and outputs */
  const float *stats_in, *dkl;     /* [T,H,4], [T,H] */
  forkattn_tensor dqs, dks, dqt, dkt;
  int teacher_grad;                /* dqt/dkt requested */
} fa_kl_call;

#pragma omp declare target
/* Per-row results from the kept-support state and the teacher's full-support
 * (m, l) (equal to the kept state's teacher part without a kept set).
 * Writes the 4 statistics and returns the divergence before tau^2. */
static inline float fa_kl_row_finish(fa_kl_state st, float mtf, float ltf, int reverse, float *stats4,
                                     float *outside) {
  float kf, kr, lse_t, lse_s;
  fa_kl_finish(st, &kf, &kr, &lse_t, &lse_s);
  const float lse_tf = ltf > 0.0f ? mtf + logf(ltf) : -INFINITY;
  float div = reverse ? kr : kf;
  /* reverse KL against the full teacher: KL(S||T') - log(teacher mass kept) */
  if (reverse && lse_s != -INFINITY) div += lse_tf - lse_t;
  if (lse_s == -INFINITY) div = 0.0f;
  stats4[FA_KL_LSE_T] = lse_t;
  stats4[FA_KL_LSE_S] = lse_s;
  stats4[FA_KL_DIV] = div;
  stats4[FA_KL_LSE_TF] = lse_tf;
  /* clamped: rounding can put the kept lse a few ulps above the full one */
  const float out = lse_tf == -INFINITY ? 0.0f : (lse_t == -INFINITY ? 1.0f : -expm1f(lse_t - lse_tf));
  *outside = out > 0.0f ? out : 0.0f;
  return div;
}

/* Gradients of a row's divergence (before tau^2) with respect to the scores
 * t_j, s_j of one key. vt: the teacher sees the key (layout mask), vs: the
 * student does too (kept). A row that keeps no key has a constant divergence. */
static inline void fa_kl_elem_grad(float t, float s, int vt, int vs, const float *stats4, int reverse,
                                   float *gt, float *gs) {
  *gt = *gs = 0.0f;
  const float lse_s = stats4[FA_KL_LSE_S];
  if (!vt || lse_s == -INFINITY) return;
  const float kl = stats4[FA_KL_DIV];
  if (!reverse) {
    if (vs) fa_kl_grad(t, s, stats4[FA_KL_LSE_T], lse_s, kl, 0, gt, gs);
  } else if (vs) {
    fa_kl_grad(t, s, stats4[FA_KL_LSE_TF], lse_s, kl, 1, gt, gs);
  } else {
    *gt = expf(t - stats4[FA_KL_LSE_TF]); /* T_j - S_j with S_j = 0 */
  }
}
#pragma omp end declare target

forkattn_status fa_cpu_kl_fwd(forkattn_ctx *ctx, const fa_kl_call *c);
forkattn_status fa_cpu_kl_bwd(forkattn_ctx *ctx, const fa_kl_call *c);
#ifdef FORKATTN_HAVE_OFFLOAD
forkattn_status fa_gpu_kl_fwd(forkattn_ctx *ctx, const fa_kl_call *c, forkattn_memory memory);
forkattn_status fa_gpu_kl_bwd(forkattn_ctx *ctx, const fa_kl_call *c, forkattn_memory memory);
#endif

#endif
