/* The forward's online-softmax step on a warp's mma accumulator fragments
 * (16 rows x BK keys; the same layout from mma.sync and wgmma): the tile's
 * row maxima under the masks (fa_fwd_tile_max), the running maxima and
 * sums moved to them in log2 units with the scores turned into P
 * (fa_fwd_tile_exp), and O's rescale (fa_fwd_rescale). Composed by every
 * forward team (gpu_fwd_teams.h). */
#ifndef FORKATTN_GPU_SOFTMAX_STEP_H
#define FORKATTN_GPU_SOFTMAX_STEP_H
#include <math.h>

#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_tile_ring.h"

#pragma omp declare target
/* The maximum of this lane's BK / 4 scores of one of its two rows (hi: the
 * row 8 down, elements z, w) as a pairwise tree: log2(BK / 4) dependent
 * steps instead of BK / 4, the row maxima being on the softmax's latency
 * path. fmaxf is exact and skips NaN, so the
 * order does not change the result. BK / 8: a power of two, at most 16. */
static inline __attribute__((always_inline)) float fa_fwd_lane_max(const fa_f4 *s, int BK, int hi) {
  float t[FA_WG_PAIR_BK / 8];
#pragma unroll
  for (int n = 0; n < BK / 8; n++) t[n] = hi ? fmaxf(s[n].z, s[n].w) : fmaxf(s[n].x, s[n].y);
#pragma unroll
  for (int w = BK / 16; w > 0; w /= 2)
#pragma unroll
    for (int i = 0; i < w; i++) t[i] = fmaxf(t[i], t[i + w]);
  return t[0];
}

/* Tile j's raw scores s (this warp's 16 rows x BK keys) masked to the keys
 * each row sees (lim0, lim1: fa_mma_row_keys), and this lane's share of the
 * row maxima folded into mx0, mx1. unmasked: every row of the warp sees
 * every key (warp-uniform), so the masks are skipped. vlo, vhi: the tile's
 * non-finite V rows 0-63 and 64-127 (fa_mma_scan_rows_by, zeroed there); a
 * row that sees one is marked bad. Raw scores: the scale (> 0, validated)
 * is applied in the exponent's fma, so it commutes with the max. */
static inline __attribute__((always_inline)) void fa_fwd_tile_max(fa_f4 *s, int BK, int unmasked, int c0, int lim0,
                                                                   int lim1, unsigned long long vlo,
                                                                   unsigned long long vhi, float *mx0, float *mx1,
                                                                   int *bad0, int *bad1) {
  if (unmasked) {
    *mx0 = fmaxf(*mx0, fa_fwd_lane_max(s, BK, 0));
    *mx1 = fmaxf(*mx1, fa_fwd_lane_max(s, BK, 1));
    if (vlo | vhi) *bad0 = *bad1 = 1; /* every row of the warp sees the tile's non-finite V row */
    return;
  }
  /* keys relative to the lane's first column: the comparisons and bit tests
   * below take constants, so no per-key value is kept live across the walk */
  const int e0 = lim0 - c0, e1 = lim1 - c0;
#pragma unroll
  for (int n = 0; n < BK / 8; n++) {
    s[n].x = fa_mma_mask(s[n].x, n * 8, e0), s[n].y = fa_mma_mask(s[n].y, n * 8 + 1, e0);
    s[n].z = fa_mma_mask(s[n].z, n * 8, e1), s[n].w = fa_mma_mask(s[n].w, n * 8 + 1, e1);
  }
  *mx0 = fmaxf(*mx0, fa_fwd_lane_max(s, BK, 0));
  *mx1 = fmaxf(*mx1, fa_fwd_lane_max(s, BK, 1));
  if (vlo | vhi) {
    const unsigned long long v0 = vlo >> c0, v1 = vhi >> c0;
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
      const unsigned long long v = n < 8 ? v0 : v1; /* n is a constant after unrolling */
      const int key = (n % 8) * 8;
      *bad0 |= (s[n].x != -INFINITY && (v >> key & 1u)) || (s[n].y != -INFINITY && (v >> (key + 1) & 1u));
      *bad1 |= (s[n].z != -INFINITY && (v >> key & 1u)) || (s[n].w != -INFINITY && (v >> (key + 1) & 1u));
    }
  }
}

/* The online-softmax step of a tile after fa_fwd_tile_max: the row maxima
 * reduced over the quad, the running maxima m (log2 units) and sums l
 * moved to them, s turned into P = exp2(s * mul - m), and O's rescale
 * factors returned in a0, a1 (1 where a row's maximum did not move). */
static inline __attribute__((always_inline)) void fa_fwd_tile_exp(fa_f4 *s, int BK, float mx0, float mx1, float mul,
                                                                   float *m0, float *m1, float *l0, float *l1,
                                                                   float *a0, float *a1) {
  mx0 = fmaxf(mx0, fa_mma_shfl_xor(mx0, 1));
  mx0 = fmaxf(mx0, fa_mma_shfl_xor(mx0, 2));
  mx1 = fmaxf(mx1, fa_mma_shfl_xor(mx1, 1));
  mx1 = fmaxf(mx1, fa_mma_shfl_xor(mx1, 2));
  const float n0 = fmaxf(*m0, mx0 * mul), n1 = fmaxf(*m1, mx1 * mul); /* log2 units */
  const float u0 = n0 == -INFINITY ? 0.0f : n0, u1 = n1 == -INFINITY ? 0.0f : n1; /* empty so far */
  *a0 = fa_mma_exp2(*m0 - u0), *a1 = fa_mma_exp2(*m1 - u1);
  float r0 = *l0 * *a0, r1 = *l1 * *a1;
#pragma unroll
  for (int n = 0; n < BK / 8; n++) { /* a masked -inf stays -inf: exp2 gives 0 */
    s[n].x = fa_mma_exp2(fmaf(s[n].x, mul, -u0)), s[n].y = fa_mma_exp2(fmaf(s[n].y, mul, -u0));
    s[n].z = fa_mma_exp2(fmaf(s[n].z, mul, -u1)), s[n].w = fa_mma_exp2(fmaf(s[n].w, mul, -u1));
    r0 += s[n].x + s[n].y;
    r1 += s[n].z + s[n].w;
  }
  *l0 = r0, *l1 = r1, *m0 = n0, *m1 = n1;
}

/* O *= a per row, skipped warp-uniformly when no row maximum of the warp moved (most tiles, once they settle). */
static inline __attribute__((always_inline)) void fa_fwd_rescale(fa_f4 *o, int D, float a0, float a1) {
  if (fa_mma_ballot(a0 != 1.0f || a1 != 1.0f))
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n].x *= a0, o[n].y *= a0, o[n].z *= a1, o[n].w *= a1;
}
#pragma omp end declare target

#endif
