/* Online-softmax and mask math shared by the CPU and GPU kernels.
 * Header-only, `declare target` so the same definitions compile for the device.
 * Contract: scores are already scaled; natural log; an empty set gives
 * (o = 0, lse = -inf) and never NaN. */
#ifndef FORKATTN_ONLINE_SOFTMAX_H
#define FORKATTN_ONLINE_SOFTMAX_H
#include <math.h>
#include <stdint.h>

#pragma omp declare target

/* Key at key-frame row k_pos is visible to the query at key-frame row q_pos
 * (its row + the plan's qshift): always for a full pair, k_pos <= q_pos for a
 * causal one. */
static inline int fa_visible(int causal, int64_t q_pos, int64_t k_pos) {
  return !causal || k_pos <= q_pos;
}

/* Factor rescaling (l, o) when the running max moves m_old -> m_new (m_new >= m_old).
 * m_old = -inf means nothing was accumulated yet: 0 avoids exp(-inf - -inf) = NaN. */
static inline float fa_rescale(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
}

/* Unnormalised probability of score s under running max m; masked (-inf) gives 0
 * even when m is -inf too. */
static inline float fa_prob(float s, float m) {
  return s == -INFINITY ? 0.0f : expf(s - m);
}

/* Normalised probability recomputed in backward from the saved log-sum-exp. */
static inline float fa_prob_lse(float s, float lse) {
  return (s == -INFINITY || lse == -INFINITY) ? 0.0f : expf(s - lse);
}

/* Final (1/l, lse) of a row; l = 0 (empty set) gives inv = 0 so o = 0, lse = -inf. */
static inline void fa_finish(float m, float l, float *inv_l, float *lse) {
  if (l > 0.0f) {
    *inv_l = 1.0f / l;
    *lse = m + logf(l);
  } else {
    *inv_l = 0.0f;
    *lse = -INFINITY;
  }
}

#pragma omp end declare target
#endif
