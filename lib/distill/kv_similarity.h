/* Fused per-head cosine similarity of two K/V tensors
 * (forkattn_kv_similarity(), kv_similarity.c): the row rule and the chunking
 * the CPU and GPU kernels (fa_backend.kv_similarity) share.
 *
 * Both backends cut the rows into chunks whose size depends only on the shape
 * (never on the thread count), sum each (chunk, head)'s row cosines in double
 * in row order, then add the chunks' sums per head in chunk order: the result
 * is bitwise reproducible on a given backend. */
#ifndef FORKATTN_KV_SIMILARITY_H
#define FORKATTN_KV_SIMILARITY_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"

#pragma omp declare target
/* The cosine of one row of one head from its sums in double: ab = a.b,
 * aa = |a|^2, bb = |b|^2 (double sums of f32 values neither underflow nor
 * overflow, so "all zero" is exact):
 *  - any non-finite element (aa or bb not finite): NaN;
 *  - either vector all zero (+-0): 1 when both are, else 0;
 *  - otherwise ab / sqrt(aa * bb), clamped to [-1, 1] (identical vectors give
 *    exactly 1, negated ones exactly -1: ab is then exactly +-aa = +-bb). */
static inline double fa_sim_finish(double ab, double aa, double bb) {
  if (!isfinite(aa + bb)) return NAN;
  if (aa == 0.0 || bb == 0.0) return aa == bb ? 1.0 : 0.0;
  const double cs = ab / sqrt(aa * bb);
  return cs > 1.0 ? 1.0 : (cs < -1.0 ? -1.0 : cs);
}

/* fa_sim_finish of a[ao + 0..d) and b[bo + 0..d) of the given dtypes, loaded
 * one element at a time (the GPU's form). */
static inline double fa_sim_row(const void *a, int adt, int64_t ao, const void *b, int bdt, int64_t bo, int64_t d) {
  double ab = 0.0, aa = 0.0, bb = 0.0;
  for (int64_t c = 0; c < d; c++) {
    const double x = (double)fa_load(a, adt, ao + c), y = (double)fa_load(b, bdt, bo + c);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
  return fa_sim_finish(ab, aa, bb);
}
#pragma omp end declare target

/* Rows per chunk: at least min_rows, few enough for at most max_chunks
 * chunks, at most rows. rows >= 1. */
static inline int64_t fa_sim_chunk_rows(int64_t rows, int64_t min_rows, int64_t max_chunks) {
  if (max_chunks < 1) max_chunks = 1;
  int64_t rpc = rows / max_chunks + (rows % max_chunks != 0);
  if (rpc < min_rows) rpc = min_rows;
  return rpc < rows ? rpc : rows;
}

#endif
