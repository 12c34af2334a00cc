/* forkattn_kv_similarity(): argument checks, the empty case and the choice of
 * backend (row rule and fixed-order sums: kv_similarity.h).
 *
 * Where it runs: tensors in device memory (FORKATTN_MEMORY_DEVICE, GPU backend
 * only) are read by the GPU backend; tensors in host memory by the CPU backend
 * whatever the context's. The call is one streaming pass with a few flops per
 * element, so staging both tensors to the device would cost more than the
 * pass itself. */
#include "kv_similarity.h"

#include "alloc.h"
#include "backend.h"
#include "validate.h"

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
  if (memory == FORKATTN_MEMORY_DEVICE)
    st = (st = fa_ctx_wait_stream(ctx, "kv_similarity")) ? st : ctx->ops->kv_similarity(ctx, a, b, sum);
  else
    st = fa_backend_get(FORKATTN_BACKEND_CPU)->kv_similarity(ctx, a, b, sum);
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
