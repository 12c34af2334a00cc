/* CPU tile helpers shared by the forward and backward kernels: gather rows of
 * one head into f32 tiles, scatter back, vectorized exp, causal masking,
 * and single-threaded OpenBLAS inside our OpenMP workers. */
#ifndef FORKATTN_CPU_TILE_H
#define FORKATTN_CPU_TILE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "forkattn.h"
#include "kept_mask.h"
#include "online_softmax.h"
#include "segment_plan.h"

/* dst[r*ld + c] = mul * t[row0 + r, head, c] for r < nrows, c < d. */
void fa_cpu_gather(const forkattn_tensor *t, int64_t row0, int64_t nrows, int64_t head, float mul,
                   float *dst, int64_t ld);
/* t[row0 + r, head, c] = src[r*ld + c] (converted to t's dtype). */
void fa_cpu_scatter(const forkattn_tensor *t, int64_t row0, int64_t nrows, int64_t head,
                    const float *src, int64_t ld);

/* A [nrows x d] f32 view of rows of one head: the tensor itself when it is
 * f32 with a usable row stride, otherwise gathered into buf. *ld receives the stride. */
const float *fa_cpu_rows_view(const forkattn_tensor *t, int64_t row0, int64_t nrows, int64_t head,
                              float *buf, int64_t *ld);

/* x[i] = exp(x[i] - sub) in place, vectorized; -inf (masked) gives exactly 0. */
void fa_cpu_exp_sub(float *x, int64_t n, float sub);

/* max of x[0..n) (-inf for n = 0), ignoring NaNs (they reach the row through
 * exp(NaN - m) in the sum; a row of only NaN and -inf gives -inf: check it
 * with fa_cpu_any_nan). */
float fa_cpu_row_max(const float *x, int64_t n);
/* Non-zero when x[0..n) holds a NaN. */
int fa_cpu_any_nan(const float *x, int64_t n);

/* One score row's step of the online softmax over a key tile: the running
 * (*m, *l) absorb srow[0..n), which becomes exp(srow - new max), and *alpha
 * receives the factor the row's earlier accumulations take (fa_rescale).
 * Returns 0, with the row zeroed and nothing else touched, while nothing is
 * visible yet. Only NaN and masked scores make a NaN row (a NaN query must
 * not give an empty one). */
static inline int fa_cpu_online_row(float *srow, int64_t n, float *m, float *l, float *alpha) {
  const float mx = fa_cpu_row_max(srow, n);
  float m_new = mx > *m ? mx : *m;
  if (m_new == -INFINITY && fa_cpu_any_nan(srow, n)) m_new = NAN;
  if (m_new == -INFINITY) {
    memset(srow, 0, sizeof(float) * (size_t)n);
    return 0;
  }
  *alpha = fa_rescale(*m, m_new);
  fa_cpu_exp_sub(srow, n, m_new);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += srow[j];
  *l = *l * *alpha + sum;
  *m = m_new;
  return 1;
}

/* Causal mask of a tile whose rows are `group` stacked copies of the query rows
 * q_pos0 .. q_pos0+qn-1 (key-frame rows, see segment_plan.h) against keys
 * k_pos0 .. k_pos0+nk-1: S = -inf where k_pos > q_pos. */
void fa_cpu_mask_causal(float *s, int64_t ld, int64_t group, int64_t qn, int64_t q_pos0,
                        int64_t nk, int64_t k_pos0);

/* Non-zero when every element of the rows x cols block (row stride ld) is finite. */
int fa_cpu_all_finite(const float *x, int64_t rows, int64_t cols, int64_t ld);

/* Products restricted to the visible part of a tile that crosses the causal
 * diagonal (rows: `group` stacked copies of query rows q_pos0.., columns: keys
 * k_pos0..k_pos0+nk-1; key j visible to query row r iff k_pos0 + j <= q_pos0 + r).
 * A GEMM over the whole tile multiplies masked zeros by the other operand, and
 * 0 * NaN = NaN would carry a non-finite key, value, query or dout into rows
 * that never see it; the kernels call these instead when an operand is not
 * all finite.
 *   fa_cpu_causal_ab:  C[i, :] += alpha * sum_{visible j} A[i, j] * B[j, :]
 *   fa_cpu_causal_atb: C[j, :] += sum_{visible i} A[i, j] * B[i, :] */
void fa_cpu_causal_ab(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                      int64_t group, int64_t qn, int64_t q_pos0, int64_t nk, int64_t k_pos0, int64_t d,
                      float alpha);
void fa_cpu_causal_atb(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                       int64_t group, int64_t qn, int64_t q_pos0, int64_t nk, int64_t k_pos0, int64_t d);

/* Kept-set mask of a tile whose rows are `group` stacked copies of query rows
 * q0 .. q0+qn-1 of query heads g*group .. g*group+group-1 against key rows
 * k0 .. k0+nk-1: S = -inf where the kept set drops the key. */
void fa_cpu_mask_kept(float *s, int64_t ld, const fa_kept *kept, int64_t g, int64_t group, int64_t qn, int64_t q0,
                      int64_t nk, int64_t k0);

/* Products over a tile's non-zero A entries when the other operand is not all
 * finite (A is a probability or gradient tile, exactly 0 on keys a row does
 * not see, so 0 * NaN must not happen); plain GEMMs otherwise.
 *   fa_cpu_sparse_ab:  C[i, :] += alpha * sum_{j: A[i,j] != 0} A[i, j] * B[j, :]   (A: m x k)
 *   fa_cpu_sparse_atb: C[j, :] += sum_{i: A[i,j] != 0} A[i, j] * B[i, :]           (A: m x k) */
void fa_cpu_sparse_ab(const float *A, int64_t lda, int64_t m, int64_t k, const float *B, int64_t ldb, int64_t n,
                      float alpha, float *C, int64_t ldc);
void fa_cpu_sparse_atb(const float *A, int64_t lda, int64_t m, int64_t k, const float *B, int64_t ldb, int64_t n,
                       float *C, int64_t ldc);

/* Make OpenBLAS single-threaded while our OpenMP workers call it (its setting
 * is process-wide; nested and concurrent calls are counted), then restore it. */
void fa_cpu_blas_single(void);
void fa_cpu_blas_restore(void);

/* Tile sizes: query rows per block (all heads of a GQA group are stacked on
 * top of it) and keys per block. */
int64_t fa_cpu_query_block(int64_t group);
#define FA_CPU_KEY_BLOCK 128

#endif
