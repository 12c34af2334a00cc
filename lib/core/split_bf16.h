/* f32 values as sums of bf16 pieces, so that tensor cores multiply f32
 * inputs at f32-class accuracy: piece 0 is the bf16 nearest x, each next
 * piece the bf16 nearest what the pieces before leave (exact in f32), so
 * x = p0 + r with |r| <= 2^-8 |x| (bf16's unit roundoff), p0 + p1 + r with
 * |r| <= 2^-16 |x|, and with a third piece |r| <= 2^-24 |x| (normal bf16
 * pieces: |x| >= 2^-110). A product x y is then a few bf16 products summed in f32:
 * p0 q0 + p0 q1 + p1 q0 ("bf16x3", dropping terms below ~2^-16 |x y|) or,
 * from three pieces, those plus p0 q2 + p2 q0 + p1 q1 ("bf16x6", below
 * ~2^-24). docs/numerics.md "f32 on tensor cores" has the bounds and the
 * measurements. Header-only and `declare target`: the GPU's split pass and
 * the host tests share it. */
#ifndef FORKATTN_SPLIT_BF16_H
#define FORKATTN_SPLIT_BF16_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"

#pragma omp declare target
/* Pieces a split f32 tensor has at most. */
#define FA_SPLIT_MAX 3

/* x as np (1 to FA_SPLIT_MAX) bf16 pieces, p[0], p[stride], p[2 * stride].
 * A non-finite piece 0 (x infinite or NaN, or rounded past bf16's largest
 * value) leaves the other pieces zero, so piece 0 alone carries it. */
static inline void fa_split_bf16(float x, int np, uint16_t *p, int64_t stride) {
  const uint16_t hi = fa_f32_to_bf16(x);
  p[0] = hi;
  float rest = x - fa_bf16_to_f32(hi);
  const int finite = isfinite(fa_bf16_to_f32(hi));
  for (int i = 1; i < np; i++) {
    const uint16_t piece = finite ? fa_f32_to_bf16(rest) : (uint16_t)0;
    p[i * stride] = piece;
    rest -= fa_bf16_to_f32(piece);
  }
}
#pragma omp end declare target

#endif
