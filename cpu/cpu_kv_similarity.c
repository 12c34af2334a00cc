/* CPU per-head cosine similarity of two K/V tensors in host memory
 * (fa_backend.kv_similarity; the row rule: kv_similarity.h).
 *
 * Chunks of rows (at least FA_SIM_MIN_ELEMS elements each, at most
 * FA_SIM_MAX_CHUNKS of them; sizes from the shape only) are spread over the
 * context's threads; a chunk walks its rows in order, converting each head's
 * two vectors to f32 (no copy for f32) and summing products in double in 8
 * fixed lanes (vectorizes; fewer lanes are slower, more are no faster). Then
 * the chunks' per-head sums are added in chunk order. */
#include "alloc.h"
#include "cpu_backend.h"
#include "kv_similarity.h"
#include "validate.h"

#define FA_SIM_MIN_ELEMS 32768
#define FA_SIM_MAX_CHUNKS 4096

/* Row r, head h of t as f32: a pointer into t (f32) or into buf (converted). */
static const float *fa_sim_vec(const forkattn_tensor *t, int64_t r, int64_t h, float *buf) {
  const int64_t off = r * t->row_stride + h * t->head_stride, d = t->head_dim;
  if (t->dtype == FORKATTN_DTYPE_F32) return (const float *)t->data + off;
  const uint16_t *p = (const uint16_t *)t->data + off;
  if (t->dtype == FORKATTN_DTYPE_BF16)
    for (int64_t c = 0; c < d; c++) buf[c] = fa_bf16_to_f32(p[c]);
  else
    for (int64_t c = 0; c < d; c++) buf[c] = fa_f16_to_f32(p[c]);
  return buf;
}

/* Sums in double over FA_SIM_LANES fixed lanes (c mod FA_SIM_LANES), combined
 * in a fixed tree. */
#define FA_SIM_LANES 8
static double fa_sim_cpu_row(const float *x, const float *y, int64_t d) {
  double ab[FA_SIM_LANES] = {0}, aa[FA_SIM_LANES] = {0}, bb[FA_SIM_LANES] = {0};
  int64_t c = 0;
  for (; c + FA_SIM_LANES <= d; c += FA_SIM_LANES)
    for (int l = 0; l < FA_SIM_LANES; l++) {
      const double u = (double)x[c + l], v = (double)y[c + l];
      ab[l] += u * v;
      aa[l] += u * u;
      bb[l] += v * v;
    }
  for (int l = 0; c < d; c++, l++) {
    const double u = (double)x[c], v = (double)y[c];
    ab[l] += u * v;
    aa[l] += u * u;
    bb[l] += v * v;
  }
  for (int w = FA_SIM_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) {
      ab[l] += ab[l + w];
      aa[l] += aa[l + w];
      bb[l] += bb[l + w];
    }
  return fa_sim_finish(ab[0], aa[0], bb[0]);
}

forkattn_status fa_cpu_kv_similarity(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                     double *sum) {
  const int64_t rows = a->rows, heads = a->heads, d = a->head_dim, hd = heads * d;
  const int64_t rpc = fa_sim_chunk_rows(rows, hd >= FA_SIM_MIN_ELEMS ? 1 : (FA_SIM_MIN_ELEMS + hd - 1) / hd,
                                        FA_SIM_MAX_CHUNKS);
  const int64_t nchunks = (rows + rpc - 1) / rpc;
  const size_t bytes = sizeof(double) * (size_t)(nchunks * heads); /* nchunks <= rows */
  double *part = fa_malloc_array(nchunks * heads, sizeof(double));
  if (!part)
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kv_similarity: cannot allocate %zu bytes of partial sums", bytes);
  fa_note_workspace(ctx, bytes);
#pragma omp parallel for num_threads(ctx->threads) schedule(static) if (nchunks > 1)
  for (int64_t ch = 0; ch < nchunks; ch++) {
    float xa[FA_MAX_HEAD_DIM], xb[FA_MAX_HEAD_DIM];
    double *p = part + ch * heads;
    const int64_t r1 = rows - ch * rpc < rpc ? rows : (ch + 1) * rpc;
    for (int64_t h = 0; h < heads; h++) p[h] = 0.0;
    for (int64_t r = ch * rpc; r < r1; r++)
      for (int64_t h = 0; h < heads; h++) p[h] += fa_sim_cpu_row(fa_sim_vec(a, r, h, xa), fa_sim_vec(b, r, h, xb), d);
  }
  for (int64_t h = 0; h < heads; h++) {
    double s = 0.0;
    for (int64_t ch = 0; ch < nchunks; ch++) s += part[ch * heads + h];
    sum[h] = s;
  }
  fa_free(part);
  return FORKATTN_OK;
}
