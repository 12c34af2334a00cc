/* Team shape and team-shared tile sizes of the GPU segment-attention kernels.
 * 128 threads per team; 8 threads share one query (or key) row, each owning
 * the head_dim columns lane, lane+8, ...; tiles live in dynamic team memory,
 * padded to a pitch of head_dim+1 floats so the 8 rows a warp reads at one
 * column fall in different banks. LLVM 19 caps team memory at 48 KB. */
#ifndef FORKATTN_GPU_TILES_H
#define FORKATTN_GPU_TILES_H
#include <stdint.h>

#include "dtype_convert.h"
#include "gpu_stage.h"

#define FA_GPU_THREADS 128
#define FA_GPU_LANES 8
#define FA_GPU_ROWS (FA_GPU_THREADS / FA_GPU_LANES) /* 16 rows per team */
#define FA_GPU_MAX_COLS 32                          /* 256 / FA_GPU_LANES columns per thread */
#define FA_GPU_SMEM_FLOATS (46 * 1024 / 4)

/* Largest power of two n <= 64 with fixed + n * per_n floats within the budget. */
static inline int64_t fa_gpu_fit(int64_t fixed, int64_t per_n) {
  int64_t n = 64;
  while (n > 1 && fixed + n * per_n > FA_GPU_SMEM_FLOATS) n /= 2;
  return n;
}

/* Forward / dQ: FA_GPU_ROWS query rows (Q, and dO for dQ) + bk keys of K and V
 * + the score tile. */
static inline int64_t fa_gpu_key_tile(int64_t d, int with_dout) {
  int64_t p = d + 1, rows = FA_GPU_ROWS * (with_dout ? 2 : 1);
  return fa_gpu_fit(rows * p, 2 * p + FA_GPU_ROWS + 1);
}

/* dK/dV: FA_GPU_ROWS keys of K and V + bq query rows of Q and dO, the P and dS
 * tiles and per-row lse and D. */
static inline int64_t fa_gpu_query_tile(int64_t d) {
  int64_t p = d + 1;
  return fa_gpu_fit(2 * FA_GPU_ROWS * p + 2 * FA_GPU_ROWS, 2 * p + 2 * FA_GPU_ROWS + 2);
}

#pragma omp declare target
/* Team-cooperative load of rows [row0, row0+n) of head `head` of t into a
 * tile of `cap` rows (pitch floats apart), times mul; rows n..cap-1 are zeroed
 * so masked lanes read finite values. Call from every thread of the team. */
static inline void fa_gpu_load_tile(float *dst, int64_t pitch, int64_t cap, fa_dev_tensor t,
                                    int64_t row0, int64_t n, int64_t head, int64_t d, float mul,
                                    int tid) {
  for (int64_t e = tid; e < cap * d; e += FA_GPU_THREADS) {
    int64_t r = e / d, c = e % d;
    dst[r * pitch + c] = r < n ? mul * fa_load(t.data, t.dtype, (row0 + r) * t.rs + head * t.hs + c) : 0.0f;
  }
}
#pragma omp end declare target

#endif
