/* The split pass (gpu_split.h): teams over rows, threads along a row; memory
 * bound (4 bytes in, 2 per piece out). */
#include "gpu_split.h"

#include <limits.h>
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
      __builtin_mul_overflow(n, (int64_t)(2 * np), &bytes) || row_elems > INT_MAX)
    return -1;
  uint16_t *dst = n ? fa_stage_scratch(st, (size_t)bytes) : NULL;
  if (n && !dst) return -1;
  /* scalars and device pointers only: a routed call's kernels may not read a firstprivate struct
   * (the runtime frees its copy before they run, gpu_stream.h) */
  const float *in = (const float *)x->data;
  const int64_t rs = x->rs, hs = x->hs;
  /* a team a row at a time, threads along the row: 32-bit index math (a 64-bit division is a
   * subroutine call) */
  const int nteams = (int)(rows < FA_SPLIT_MAX_TEAMS ? rows : FA_SPLIT_MAX_TEAMS), dev = st->device;
  const int re = (int)row_elems, dd = (int)d;
  if (n) {
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_SPLIT_THREADS) device(dev) is_device_ptr(in, dst)
    {
      for (int64_t r = ompx_block_id_x(); r < rows; r += nteams)
        for (int e = ompx_thread_id_x(); e < re; e += FA_SPLIT_THREADS) {
          const int h = e / dd, c = e - h * dd;
          fa_split_bf16(in[r * rs + h * hs + c], np, dst + r * re + e, n);
        }
    }
  }
  const fa_dev_tensor v = {dst, FORKATTN_DTYPE_BF16, row_elems, d};
  *out = v;
  *plane = n;
  return 0;
}
