/* Teams of two warpgroups (sm_90a): the wgmma forward (gpu_mma_fwd_team.h)
 * and dQ (gpu_mma_bwd_team.h). FA_WG2_THREADS threads, FA_WG2_ROWS query
 * rows a team (64 a warpgroup, each with its own query tiles), and K/V tiles
 * of FA_WG2_BK keys that both warpgroups read, copied once by bulk tensor
 * copies (gpu_tma.h) into a ring of buffers: tile t in buffer t % S, its
 * arrival on that buffer's mbarrier `full`.
 *
 * A buffer is refilled by the second warpgroup to release it (a counter in
 * team memory, one word per buffer): no thread waits for the other
 * warpgroup before a copy starts, and the copy starts as soon as both are
 * done with the buffer. Both warpgroups' thread 0 walk the tiles to copy. */
#ifndef FORKATTN_GPU_WG2_H
#define FORKATTN_GPU_WG2_H
#include <stdint.h>
#include <ompx.h>

#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_tma.h"

#define FA_WG2_THREADS 256
#define FA_WG2_BK 128

#pragma omp declare target
/* Thread 0 of a warpgroup: K's and V's rows of tile w (KV head g) into the
 * buffer at dst (K, then V BK rows later), completing on the mbarrier at full. */
static inline __attribute__((always_inline)) void fa_wg2_copy(fa_smem sm, int dst, int full, const fa_tma_map *tma,
                                                              int64_t g, fa_tile_walk w, int BK, int D) {
  fa_mbar_expect_tx(sm, full, 2 * BK * D * 2);
  fa_tma_tile(sm, dst, tma, (int)g, w.kb, BK, D, full);
  fa_tma_tile(sm, dst + BK * D, tma + 1, (int)g, w.kb, BK, D, full);
}

/* The ring's start, by every thread of the team: thread 0 initializes the
 * S buffers' mbarriers (at full, 4 elements apart) and release counters
 * (released[2 b]), a team barrier makes them visible before any use, then
 * thread 0 copies tiles 0 .. n - 1 of walk w into buffers 0 .. n - 1 (st0,
 * stage elements apart). Returns, to both warpgroups' thread 0, the walk
 * past those tiles: the next tile to copy. */
static inline __attribute__((always_inline)) fa_tile_walk fa_wg2_ring_start(fa_smem sm, int *released, int full,
                                                                            int st0, int stage, int S, int n,
                                                                            const fa_tma_map *tma, int64_t g,
                                                                            fa_tile_walk w, int BK, int D,
                                                                            const fa_range *seg,
                                                                            const fa_pair *pair, fa_block blk,
                                                                            int64_t qshift) {
  const int tid = ompx_thread_id_x();
  if (tid == 0)
    for (int b = 0; b < S; b++) fa_mbar_init(sm, full + 4 * b, 1), released[2 * b] = 0;
  ompx_sync_block_acq_rel(); /* the barriers initialized before any use (gpu_tma.h) */
  if (tid % 128 == 0)
    for (int b = 0; b < n; b++) {
      if (tid == 0 && w.pi < w.pend) fa_wg2_copy(sm, st0 + b * stage, full + 4 * b, tma, g, w, BK, D);
      if (w.pi < w.pend) w = fa_walk_next(w, BK, seg, pair, blk, qshift);
    }
  return w;
}

/* Thread 0 of each warpgroup, once its products reading the buffer at dst
 * (mbarrier full, counter *released) retired: the second of the two to
 * call copies tile wl (if any) into it. Returns the walk one tile on. */
static inline __attribute__((always_inline)) fa_tile_walk fa_wg2_release(fa_smem sm, int *released, int dst, int full,
                                                                         const fa_tma_map *tma, int64_t g,
                                                                         fa_tile_walk wl, int BK, int D,
                                                                         const fa_range *seg, const fa_pair *pair,
                                                                         fa_block blk, int64_t qshift) {
  if (wl.pi >= wl.pend) return wl;
  if (__atomic_fetch_add(released, 1, __ATOMIC_ACQ_REL) == 1) {
    *released = 0; /* its next release comes after this copy lands and is read */
    fa_wg2_copy(sm, dst, full, tma, g, wl, BK, D);
  }
  return fa_walk_next(wl, BK, seg, pair, blk, qshift);
}
#pragma omp end declare target

#endif
