/* CPU tile helpers: gather/scatter with dtype conversion, vectorized exp, masks. */
#include "cpu_tile.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "dtype_convert.h"
#include "online_softmax.h"

void fa_cpu_gather(const forkattn_tensor *t, int64_t row0, int64_t nrows, int64_t head, float mul,
                   float *dst, int64_t ld) {
  const int64_t d = t->head_dim;
  for (int64_t r = 0; r < nrows; r++) {
    int64_t base = (row0 + r) * t->row_stride + head * t->head_stride;
    float *out = dst + r * ld;
    if (t->dtype == FORKATTN_DTYPE_F32) {
      const float *in = (const float *)t->data + base;
#pragma omp simd
      for (int64_t c = 0; c < d; c++) out[c] = mul * in[c];
    } else if (t->dtype == FORKATTN_DTYPE_BF16) {
      const uint16_t *in = (const uint16_t *)t->data + base;
#pragma omp simd
      for (int64_t c = 0; c < d; c++) out[c] = mul * fa_bf16_to_f32(in[c]);
    } else {
      const uint16_t *in = (const uint16_t *)t->data + base;
      for (int64_t c = 0; c < d; c++) out[c] = mul * fa_f16_to_f32(in[c]);
    }
  }
}

void fa_cpu_scatter(const forkattn_tensor *t, int64_t row0, int64_t nrows, int64_t head,
                    const float *src, int64_t ld) {
  const int64_t d = t->head_dim;
  for (int64_t r = 0; r < nrows; r++) {
    int64_t base = (row0 + r) * t->row_stride + head * t->head_stride;
    const float *in = src + r * ld;
    if (t->dtype == FORKATTN_DTYPE_F32) {
      memcpy((float *)t->data + base, in, sizeof(float) * (size_t)d);
    } else {
      for (int64_t c = 0; c < d; c++) fa_store(t->data, (int)t->dtype, base + c, in[c]);
    }
  }
}

const float *fa_cpu_rows_view(const forkattn_tensor *t, int64_t row0, int64_t nrows, int64_t head,
                              float *buf, int64_t *ld) {
  /* BLAS takes an int leading dimension of at least head_dim */
  if (t->dtype == FORKATTN_DTYPE_F32 && t->row_stride >= t->head_dim && t->row_stride <= INT_MAX) {
    *ld = t->row_stride;
    return (const float *)t->data + row0 * t->row_stride + head * t->head_stride;
  }
  fa_cpu_gather(t, row0, nrows, head, 1.0f, buf, t->head_dim);
  *ld = t->head_dim;
  return buf;
}

/* exp(x) for x <= ~88 by 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2]; relative
 * error ~2 ulp. Inputs below -87 (masked -inf included) give 0. Branch-free so
 * the loop vectorizes. */
void fa_cpu_exp_sub(float *x, int64_t n, float sub) {
  const float log2e = 1.44269504088896341f, ln2_hi = 0.693145751953125f,
              ln2_lo = 1.428606765330187045e-06f;
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    const float s = x[i], v = s - sub;
    float vc = v > -87.0f ? (v < 88.0f ? v : 88.0f) : -87.0f; /* NaN -> -87: no NaN-to-int conversion */
    /* round to nearest with the 1.5*2^23 trick: floorf does not vectorize under trapping-math */
    float k = (vc * log2e + 12582912.0f) - 12582912.0f;
    float r = vc - k * ln2_hi - k * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    float e = p * two_k;
    /* masked stays 0 even if sub is NaN; otherwise a NaN (inf - inf from
     * overflowing scores) propagates */
    x[i] = s == -INFINITY ? 0.0f : (v != v ? v : (v < -87.0f ? 0.0f : e));
  }
}

float fa_cpu_row_max(const float *x, int64_t n) {
  /* 16 independent lanes: an element-wise select vectorizes without fast-math,
   * a scalar max reduction does not under clang. */
  float lane[16];
  for (int t = 0; t < 16; t++) lane[t] = -INFINITY;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int t = 0; t < 16; t++) lane[t] = x[j + t] > lane[t] ? x[j + t] : lane[t];
  float m = -INFINITY;
  for (; j < n; j++) m = x[j] > m ? x[j] : m;
  for (int t = 0; t < 16; t++) m = lane[t] > m ? lane[t] : m;
  return m;
}

int fa_cpu_any_nan(const float *x, int64_t n) {
  for (int64_t j = 0; j < n; j++)
    if (x[j] != x[j]) return 1;
  return 0;
}

void fa_cpu_mask_causal(float *s, int64_t ld, int64_t group, int64_t qn, int64_t q_pos0,
                        int64_t nk, int64_t k_pos0) {
  for (int64_t g = 0; g < group; g++)
    for (int64_t r = 0; r < qn; r++) {
      float *row = s + (g * qn + r) * ld;
      int64_t q_pos = q_pos0 + r;
      int64_t first_hidden = q_pos - k_pos0 + 1; /* keys j >= this are in the future */
      for (int64_t j = first_hidden < 0 ? 0 : first_hidden; j < nk; j++)
        if (!fa_visible(1, q_pos, k_pos0 + j)) row[j] = -INFINITY;
    }
}

int fa_cpu_all_finite(const float *x, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; r++) {
    float acc = 0.0f; /* x * 0 is 0 for finite x, NaN for NaN and inf */
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < cols; c++) acc += x[r * ld + c] * 0.0f;
    if (acc != 0.0f) return 0;
  }
  return 1;
}

/* Keys of a crossing tile visible to stacked row i. */
static int64_t fa_visible_keys(int64_t i, int64_t qn, int64_t q_pos0, int64_t nk, int64_t k_pos0) {
  int64_t v = q_pos0 + i % qn - k_pos0 + 1;
  return v < 0 ? 0 : (v > nk ? nk : v);
}

void fa_cpu_causal_ab(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                      int64_t group, int64_t qn, int64_t q_pos0, int64_t nk, int64_t k_pos0, int64_t d,
                      float alpha) {
  for (int64_t i = 0; i < group * qn; i++) {
    const int64_t vis = fa_visible_keys(i, qn, q_pos0, nk, k_pos0);
    float *crow = C + i * ldc;
    for (int64_t j = 0; j < vis; j++) {
      const float a = alpha * A[i * lda + j];
      const float *brow = B + j * ldb;
#pragma omp simd
      for (int64_t c = 0; c < d; c++) crow[c] += a * brow[c];
    }
  }
}

void fa_cpu_causal_atb(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                       int64_t group, int64_t qn, int64_t q_pos0, int64_t nk, int64_t k_pos0, int64_t d) {
  for (int64_t i = 0; i < group * qn; i++) {
    const int64_t vis = fa_visible_keys(i, qn, q_pos0, nk, k_pos0);
    const float *brow = B + i * ldb;
    for (int64_t j = 0; j < vis; j++) {
      const float a = A[i * lda + j];
      float *crow = C + j * ldc;
#pragma omp simd
      for (int64_t c = 0; c < d; c++) crow[c] += a * brow[c];
    }
  }
}

/* OpenBLAS's thread count is process-wide: the first concurrent CPU call saves
 * it and sets 1, the last one restores it, under one lock for all contexts. */
static int fa_blas_users, fa_blas_saved = 1;
static pthread_mutex_t fa_blas_lock = PTHREAD_MUTEX_INITIALIZER; /* not omp critical: see hostinfo.c */

void fa_cpu_blas_single(void) {
  pthread_mutex_lock(&fa_blas_lock);
  if (fa_blas_users++ == 0) {
    fa_blas_saved = openblas_get_num_threads();
    if (fa_blas_saved != 1) openblas_set_num_threads(1);
  }
  pthread_mutex_unlock(&fa_blas_lock);
}

void fa_cpu_blas_restore(void) {
  pthread_mutex_lock(&fa_blas_lock);
  if (--fa_blas_users == 0 && fa_blas_saved != 1) openblas_set_num_threads(fa_blas_saved);
  pthread_mutex_unlock(&fa_blas_lock);
}

int64_t fa_cpu_query_block(int64_t group) {
  int64_t b = 128 / group;
  if (b < 32) b = 32;
  return b;
}

void fa_cpu_mask_kept(float *s, int64_t ld, const fa_kept *kept, int64_t g, int64_t group, int64_t qn, int64_t q0,
                      int64_t nk, int64_t k0) {
  for (int64_t hh = 0; hh < group; hh++)
    for (int64_t r = 0; r < qn; r++) {
      float *row = s + (hh * qn + r) * ld;
      for (int64_t j = 0; j < nk; j++)
        if (!fa_kept_visible(kept, g * group + hh, q0 + r, k0 + j)) row[j] = -INFINITY;
    }
}

void fa_cpu_sparse_ab(const float *A, int64_t lda, int64_t m, int64_t k, const float *B, int64_t ldb, int64_t n,
                      float alpha, float *C, int64_t ldc) {
  if (fa_cpu_all_finite(B, k, n, ldb)) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, alpha, A, (int)lda, B, (int)ldb,
                1.0f, C, (int)ldc);
    return;
  }
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < k; j++) {
      const float a = A[i * lda + j] * alpha;
      if (A[i * lda + j] == 0.0f) continue;
      for (int64_t e = 0; e < n; e++) C[i * ldc + e] += a * B[j * ldb + e];
    }
}

void fa_cpu_sparse_atb(const float *A, int64_t lda, int64_t m, int64_t k, const float *B, int64_t ldb, int64_t n,
                       float *C, int64_t ldc) {
  if (fa_cpu_all_finite(B, m, n, ldb)) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)k, (int)n, (int)m, 1.0f, A, (int)lda, B, (int)ldb, 1.0f,
                C, (int)ldc);
    return;
  }
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < k; j++) {
      const float a = A[i * lda + j];
      if (a == 0.0f) continue;
      for (int64_t e = 0; e < n; e++) C[j * ldc + e] += a * B[i * ldb + e];
    }
}
