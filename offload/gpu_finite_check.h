/* Whether a b16 tensor holds a non-finite element, before the kernels that
 * would otherwise scan its tiles.
 *
 * The two-warpgroup forward scans V's tile wherever the tile hides keys
 * from some of the team's rows (the causal diagonal) or holds fewer keys
 * than its size: 0 * NaN in P V would leak a non-finite V row into rows
 * that cannot see it (gpu_fwd_teams.h). That scan, a team-wide pass over
 * the tile with barriers, sits on every item's critical path: on short
 * sequences most tiles are such tiles. One pass over V before the forward
 * (memory-bound, a few microseconds) tells whether any scan can find
 * anything; when V is finite everywhere the forward skips them all. Run on launches of many
 * items only (gpu_finite_check_policy.h): on a few it costs more than the scans. */
#ifndef FORKATTN_GPU_FINITE_CHECK_H
#define FORKATTN_GPU_FINITE_CHECK_H
#include <stdint.h>

#include "gpu_mma.h"
#include "gpu_stage.h"

/* Threads of a team of the check. */
#define FA_FINITE_CHECK_THREADS 256

#pragma omp declare target
/* Team `team` of `teams` (FA_FINITE_CHECK_THREADS threads; tid this thread) of the check of t: rows x
 * heads rows of d b16 elements (d a multiple of 8 up to 128, IEEE halves when f16, else bf16;
 * 16-byte aligned rows: fa_gpu_mma_rows16). A thread that finds a non-finite element sets *flag to 1;
 * nothing clears it. */
static inline void fa_finite_check_team(const fa_dev_tensor t, int64_t rows, int64_t heads, int d, int f16,
                                        int *flag, int team, int teams, int tid) {
  const int per = d / 8;                          /* 16-byte chunks a (row, head) */
  const int64_t step = (int64_t)teams * (FA_FINITE_CHECK_THREADS / per);
  const unsigned short *base = (const unsigned short *)t.data;
  int bad = 0;
  for (int64_t p = (int64_t)team * (FA_FINITE_CHECK_THREADS / per) + tid / per; p < rows * heads; p += step) {
    const int64_t r = p / heads, h = p - r * heads;
    const fa_u4 v = fa_load_u4(base + r * t.rs + h * t.hs + (tid % per) * 8);
    const uint32_t zeroed = (fa_b16x2_finite(v.x, f16) ^ v.x) | (fa_b16x2_finite(v.y, f16) ^ v.y) |
                            (fa_b16x2_finite(v.z, f16) ^ v.z) | (fa_b16x2_finite(v.w, f16) ^ v.w);
    bad |= zeroed != 0;
  }
  if (bad) __atomic_store_n(flag, 1, __ATOMIC_RELAXED);
}
#pragma omp end declare target

#endif
