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
/* Per-row results from the kept-support state and the online (m, l) of the
 * teacher's scores on the keys the kept set drops (-inf, 0 without a kept
 * set). The full-support lse is their log-add; the outside mass is taken from
 * the dropped keys' own sum, so it is exactly 0 when nothing is dropped and
 * relatively accurate when small. Writes the 4 statistics and the outside
 * mass, returns the divergence before tau^2. Writes through the caller's
 * pointers only (no locals' addresses: see fa_kl_merge on `ompx_bare`). */
static inline float fa_kl_row_finish(fa_kl_state st, float m_drop, float l_drop, int reverse, float *stats4,
                                     float *outside) {
  fa_kl_finish(st, stats4 + FA_KL_DIV, outside, stats4 + FA_KL_LSE_T, stats4 + FA_KL_LSE_S);
  const float kf = stats4[FA_KL_DIV], kr = *outside, lse_t = stats4[FA_KL_LSE_T], lse_s = stats4[FA_KL_LSE_S];
  const float lse_drop = l_drop > 0.0f ? m_drop + logf(l_drop) : (l_drop == l_drop ? -INFINITY : NAN);
  float lse_tf = lse_t, out = 0.0f, gap = 0.0f; /* gap = lse_tf - lse_t = -log(1 - outside) */
  if (lse_drop != -INFINITY) {
    if (lse_t == -INFINITY) {
      lse_tf = lse_drop;
      out = 1.0f;
    } else {
      const float x = lse_drop - lse_t; /* log(dropped / kept) */
      gap = x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x));
      lse_tf = lse_t + gap;
      /* dropped / (kept + dropped) as a logistic of x: in [0, 1] by
       * construction (exp(lse_drop - lse_tf) rounds above 1 when the dropped
       * keys dominate) and relatively accurate when small. */
      const float e = expf(-fabsf(x));
      out = x > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    }
  }
  float div = reverse ? kr : kf;
  /* reverse KL against the full teacher: KL(S||T') - log(teacher mass kept) */
  if (reverse && lse_s != -INFINITY) div += gap;
  if (lse_s == -INFINITY) div = 0.0f;
  stats4[FA_KL_DIV] = div;
  stats4[FA_KL_LSE_TF] = lse_tf;
  *outside = out;
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

#endif
