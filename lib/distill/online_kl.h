/* Online (streaming) KL divergence between two attention distributions over
 * the same keys: teacher T = softmax(t), student S = softmax(s), one pass over
 * the keys in tiles, O(1) state per row (StreamKL). Header-only and
 * `declare target`, like online_softmax.h, so CPU and GPU kernels share it.
 * Derivation and error analysis: docs/numerics.md, "Online KL divergence".
 *
 * State per row, relative to the running maxima m_t, m_s:
 *   lt = sum_j exp(t_j - m_t)        ls = sum_j exp(s_j - m_s)
 *   a  = sum_j exp(t_j - m_t) * d_j  b  = sum_j exp(s_j - m_s) * (-d_j)
 * with d_j = (t_j - m_t) - (s_j - m_s): centring both scores on their own
 * maxima keeps the terms the size of the score spread, not of the scores, so
 * KL(T||S) = a/lt - log lt + log ls does not cancel two large numbers when T
 * and S are close. Masked keys (-inf in both) are skipped. */
#ifndef FORKATTN_ONLINE_KL_H
#define FORKATTN_ONLINE_KL_H
#include <math.h>

#pragma omp declare target

typedef struct fa_kl_state {
  float mt, lt, ms, ls, a, b;
} fa_kl_state;

static inline fa_kl_state fa_kl_init(void) {
  fa_kl_state st = {-INFINITY, 0.0f, -INFINITY, 0.0f, 0.0f, 0.0f};
  return st;
}

/* Move the maxima to (mt2, ms2) >= the current ones, rescaling every sum.
 * Each centred difference d shifts by (ms2 - ms) - (mt2 - mt). */
static inline void fa_kl_rebase(fa_kl_state *st, float mt2, float ms2) {
  if (st->mt == -INFINITY) { /* nothing accumulated yet */
    st->mt = mt2;
    st->ms = ms2;
    return;
  }
  const float dt = mt2 - st->mt, ds = ms2 - st->ms, shift = ds - dt;
  const float at = expf(-dt), as = expf(-ds);
  st->a = at * (st->a + st->lt * shift);
  st->b = as * (st->b - st->ls * shift);
  st->lt *= at;
  st->ls *= as;
  st->mt = mt2;
  st->ms = ms2;
}

/* Add a tile of n visible keys: scores t[j], s[j] (already scaled and divided
 * by the temperature). Both must be finite for a visible key. */
static inline void fa_kl_tile(fa_kl_state *st, const float *t, const float *s, int n) {
  if (n <= 0) return;
  float mt = st->mt, ms = st->ms;
  for (int j = 0; j < n; j++) {
    mt = fmaxf(mt, t[j]);
    ms = fmaxf(ms, s[j]);
  }
  fa_kl_rebase(st, mt, ms);
  for (int j = 0; j < n; j++) {
    const float ct = t[j] - st->mt, cs = s[j] - st->ms, d = ct - cs;
    const float pt = expf(ct), ps = expf(cs);
    st->lt += pt;
    st->ls += ps;
    st->a += pt * d;
    st->b -= ps * d;
  }
}

/* fa_kl_tile for a single key (the GPU kernels fold keys one at a time);
 * rebasing only when a maximum grows gives the same values (a rebase by zero
 * is the identity) at half the exps. */
static inline void fa_kl_add(fa_kl_state *st, float t, float s) {
  const float mt = fmaxf(st->mt, t), ms = fmaxf(st->ms, s);
  if (mt != st->mt || ms != st->ms) fa_kl_rebase(st, mt, ms);
  const float ct = t - st->mt, cs = s - st->ms, d = ct - cs;
  const float pt = expf(ct), ps = expf(cs);
  st->lt += pt;
  st->ls += ps;
  st->a += pt * d;
  st->b -= ps * d;
}

/* Merge two states of the same row (keys split between them, e.g. by segment
 * or by lane); y is rebased in place. Pointers, not a by-value y: in an
 * `ompx_bare` kernel taking a local's address moves it to the runtime's
 * shared stack, which this runtime cannot provide (the kernel silently stops). */
static inline void fa_kl_merge(fa_kl_state *x, fa_kl_state *y) {
  if (y->mt == -INFINITY) return;
  if (x->mt == -INFINITY) {
    *x = *y;
    return;
  }
  const float mt = fmaxf(x->mt, y->mt), ms = fmaxf(x->ms, y->ms);
  fa_kl_rebase(x, mt, ms);
  fa_kl_rebase(y, mt, ms);
  x->lt += y->lt;
  x->ls += y->ls;
  x->a += y->a;
  x->b += y->b;
}

/* Final per-row results. An empty row (no visible key) gives KL 0 and
 * log-sum-exps -inf. The KLs are clamped at 0 (they are >= 0 exactly; rounding
 * can leave a few ulps below). lse_* are the natural-log normalisers the
 * backward recomputes T and S from. */
static inline void fa_kl_finish(fa_kl_state st, float *kl_fwd, float *kl_rev, float *lse_t, float *lse_s) {
  if (!(st.lt > 0.0f)) {
    *kl_fwd = *kl_rev = 0.0f;
    *lse_t = *lse_s = -INFINITY;
    return;
  }
  const float log_ratio = logf(st.lt) - logf(st.ls);
  const float f = st.a / st.lt - log_ratio, r = st.b / st.ls + log_ratio;
  *kl_fwd = f > 0.0f ? f : 0.0f;
  *kl_rev = r > 0.0f ? r : 0.0f;
  *lse_t = st.mt + logf(st.lt);
  *lse_s = st.ms + logf(st.ls);
}

/* Gradients of one key's scores from the saved row statistics (backward):
 * KL(T||S):  dKL/ds_j = S_j - T_j,   dKL/dt_j = T_j (t_j - s_j - (KL + lse_t - lse_s));
 * KL(S||T):  dKL/dt_j = T_j - S_j,   dKL/ds_j = S_j (s_j - t_j - (KL_rev + lse_s - lse_t)).
 * reverse = 0 for KL(T||S). */
static inline void fa_kl_grad(float t, float s, float lse_t, float lse_s, float kl, int reverse, float *g_t,
                              float *g_s) {
  const float pt = expf(t - lse_t), ps = expf(s - lse_s);
  if (!reverse) {
    *g_s = ps - pt;
    *g_t = pt * ((t - s) - (kl + lse_t - lse_s));
  } else {
    *g_t = pt - ps;
    *g_s = ps * ((s - t) - (kl + lse_s - lse_t));
  }
}

#pragma omp end declare target
#endif
