/* forkattn_kv_similarity(): argument checks, the empty case, the choice of
 * backend, and the CPU kernel (row rule and fixed-order sums: kv_similarity.h).
 *
 * Where it runs: tensors in device memory (FORKATTN_MEMORY_DEVICE, GPU backend
 * only) are read on the GPU (offload/gpu_similarity.c); tensors in host memory
 * are read on the CPU whatever the backend. The call is one streaming pass with
 * a few flops per element, so staging both tensors to the device would cost
 * more than the pass itself.
 *
 * CPU: chunks of rows (at least FA_SIM_MIN_ELEMS elements each, at most
 * FA_SIM_MAX_CHUNKS of them; sizes from the shape only) are spread over the
 * context's threads; a chunk walks its rows in order, converting each head's
 * two vectors to f32 (no copy for f32) and summing products in double in 8
 * fixed lanes (vectorizes; 1.3x faster than 4 lanes, 16 are no better). Then
 * the chunks' per-head sums are added in chunk order. */
#include "kv_similarity.h"

#include "alloc.h"
#include "segment_attn.h"
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

static forkattn_status fa_sim_check(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                    const float *sim, forkattn_memory memory) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_status st;
  if ((st = fa_check_memory(ctx, memory))) return st;
  if (!a) return fa_fail(ctx, bad, "a: tensor descriptor is NULL");
  if (!b) return fa_fail(ctx, bad, "b: tensor descriptor is NULL");
  if ((st = fa_check_tensor(ctx, "a", a, a->dtype, a->rows, a->heads, a->head_dim))) return st;
  if (a->head_dim > FA_MAX_HEAD_DIM)
    return fa_fail(ctx, bad, "a: head_dim %lld outside the supported 1..%d", (long long)a->head_dim, FA_MAX_HEAD_DIM);
  if (b->rows != a->rows || b->heads != a->heads || b->head_dim != a->head_dim)
    return fa_fail(ctx, bad, "b: shape [%lld rows, %lld heads, %lld dims] differs from a's [%lld, %lld, %lld]",
                   (long long)b->rows, (long long)b->heads, (long long)b->head_dim, (long long)a->rows,
                   (long long)a->heads, (long long)a->head_dim);
  if ((st = fa_check_tensor(ctx, "b", b, b->dtype, a->rows, a->heads, a->head_dim))) return st;
  if (!sim) return fa_fail(ctx, bad, "sim: is NULL (needs %lld floats, one per head)", (long long)a->heads);
  return fa_check_aligned(ctx, "sim", sim, sizeof *sim);
}

forkattn_status forkattn_kv_similarity(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                       float *sim, float *mean, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  forkattn_status st = fa_sim_check(ctx, a, b, sim, memory);
  if (st || (st = fa_check_aligned(ctx, "mean", mean, sizeof *mean))) return st;
  const int64_t rows = a->rows, heads = a->heads;
  if (rows == 0) { /* no rows: nothing drifted */
    for (int64_t h = 0; h < heads; h++) sim[h] = 1.0f;
    if (mean) *mean = 1.0f;
    return FORKATTN_OK;
  }
  const size_t bytes = sizeof(double) * (size_t)heads;
  double *sum = fa_malloc_array(heads, sizeof(double)); /* heads up to 2^63 / rows / d: checked */
  if (!sum) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kv_similarity: cannot allocate %zu bytes", bytes);
#ifdef FORKATTN_HAVE_OFFLOAD
  if (memory == FORKATTN_MEMORY_DEVICE)
    st = (st = fa_ctx_wait_stream(ctx, "kv_similarity")) ? st : fa_gpu_kv_similarity(ctx, a, b, sum);
  else
#endif
    st = fa_cpu_kv_similarity(ctx, a, b, sum);
  if (!st) {
    double all = 0.0;
    for (int64_t h = 0; h < heads; h++) {
      const double m = sum[h] / (double)rows;
      sim[h] = (float)m;
      all += m;
    }
    if (mean) *mean = (float)(all / (double)heads);
  }
  fa_free(sum);
  return st;
}
