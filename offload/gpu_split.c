/* The split pass (gpu_split.h): one thread an element, grid-stride; memory
 * bound (4 bytes in, 2 per piece out). */
#include "gpu_split.h"

#include <omp.h>
#include <ompx.h>

#include "forkattn.h"
#include "split_bf16.h"

#define FA_SPLIT_THREADS 256
#define FA_SPLIT_MAX_TEAMS 65536

int fa_gpu_split_pieces(fa_stage *st, fa_dev_tensor *out, int64_t *plane, const fa_dev_tensor *x, int64_t rows,
                        int64_t heads, int64_t d, int np) {
  int64_t row_elems, n, bytes;
  if (__builtin_mul_overflow(heads, d, &row_elems) || __builtin_mul_overflow(rows, row_elems, &n) ||
      __builtin_mul_overflow(n, (int64_t)(2 * np), &bytes))
    return -1;
  uint16_t *dst = n ? fa_stage_scratch(st, (size_t)bytes) : NULL;
  if (n && !dst) return -1;
  const fa_dev_tensor src = *x;
  const int64_t teams64 = (n + FA_SPLIT_THREADS - 1) / FA_SPLIT_THREADS;
  const int nteams = (int)(teams64 < FA_SPLIT_MAX_TEAMS ? teams64 : FA_SPLIT_MAX_TEAMS), dev = st->device;
  if (n) {
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_SPLIT_THREADS) device(dev) firstprivate(src) \
    is_device_ptr(dst)
    {
      const int64_t step = (int64_t)nteams * FA_SPLIT_THREADS;
      for (int64_t i = (int64_t)ompx_block_id_x() * FA_SPLIT_THREADS + ompx_thread_id_x(); i < n; i += step) {
        const int64_t r = i / row_elems, h = i % row_elems / d, c = i % d;
        fa_split_bf16(((const float *)src.data)[r * src.rs + h * src.hs + c], np, dst + i, n);
      }
    }
  }
  const fa_dev_tensor v = {dst, FORKATTN_DTYPE_BF16, row_elems, d};
  *out = v;
  *plane = n;
  return 0;
}
