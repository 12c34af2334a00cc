/* GPU per-head cosine similarity of two K/V tensors in device memory
 * (forkattn_kv_similarity(); the row rule: lib/distill/kv_similarity.h).
 *
 * Plain `target teams distribute parallel for` loops (no ompx_bare, no team
 * memory): the pass is memory-bound.
 *  1. One iteration per (row chunk, head), head fastest so that neighbouring
 *     threads read neighbouring heads of the same rows: the sum in double of
 *     the chunk's row cosines, in row order, into a device scratch of
 *     chunks * heads doubles. Chunk sizes depend on the shape only (at most
 *     FA_GPU_SIM_ITEMS iterations).
 *  2. One iteration per head: the chunks' sums added in chunk order.
 * The per-head sums (heads doubles) come back to the host, which divides by
 * the row count. Bitwise reproducible; not bitwise equal to the CPU path
 * (different chunks and lane order), equal to it to rounding. */
#include <omp.h>

#include "gpu_backend.h"
#include "gpu_stage.h"
#include "kv_similarity.h"

#define FA_GPU_SIM_ITEMS (1 << 18) /* (chunk, head) iterations of pass 1 at most */

static void fa_gpu_sim_chunks(fa_dev_tensor a, fa_dev_tensor b, int64_t rows, int64_t heads, int64_t d, int64_t rpc,
                              int64_t nchunks, double *part, int dev) {
  const int64_t n = nchunks * heads;
#pragma omp target teams distribute parallel for device(dev) firstprivate(a, b) is_device_ptr(part)
  for (int64_t i = 0; i < n; i++) {
    const int64_t ch = i / heads, h = i % heads, r0 = ch * rpc;
    const int64_t r1 = rows - r0 < rpc ? rows : r0 + rpc;
    double s = 0.0;
    for (int64_t r = r0; r < r1; r++)
      s += fa_sim_row(a.data, a.dtype, r * a.rs + h * a.hs, b.data, b.dtype, r * b.rs + h * b.hs, d);
    part[i] = s;
  }
}

static void fa_gpu_sim_reduce(const double *part, int64_t heads, int64_t nchunks, double *sum, int dev) {
#pragma omp target teams distribute parallel for device(dev) is_device_ptr(part, sum)
  for (int64_t h = 0; h < heads; h++) {
    double s = 0.0;
    for (int64_t ch = 0; ch < nchunks; ch++) s += part[ch * heads + h];
    sum[h] = s;
  }
}

forkattn_status fa_gpu_kv_similarity(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                     double *sum) {
  const int64_t rows = a->rows, heads = a->heads, d = a->head_dim;
  const int64_t rpc = fa_sim_chunk_rows(rows, 1, FA_GPU_SIM_ITEMS / heads);
  const int64_t nchunks = (rows + rpc - 1) / rpc;
  fa_stage st;
  fa_stage_init(&st, ctx, 0); /* device memory: views of the caller's pointers */
  fa_dev_tensor da, db;
  fa_stage_tensor(&st, a, 0, &da);
  fa_stage_tensor(&st, b, 0, &db);
  double *part = fa_stage_scratch(&st, sizeof(double) * (size_t)(nchunks * heads));
  double *dsum = fa_stage_scratch(&st, sizeof(double) * (size_t)heads);
  if (!part || !dsum) {
    fa_stage_free(&st);
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "gpu kv_similarity: cannot allocate %zu bytes of device scratch",
                   sizeof(double) * (size_t)((nchunks + 1) * heads));
  }
  fa_note_workspace(ctx, st.bytes);
  fa_gpu_sim_chunks(da, db, rows, heads, d, rpc, nchunks, part, ctx->device);
  fa_gpu_sim_reduce(part, heads, nchunks, dsum, ctx->device);
  const int rc = fa_gpu_memcpy(ctx->device, sum, 0, dsum, 1, sizeof(double) * (size_t)heads);
  fa_stage_free(&st);
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "gpu kv_similarity: copying the sums back failed") : FORKATTN_OK;
}
