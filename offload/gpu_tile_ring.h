/* The producer of the warpgroup-pair teams (sm_90a): the wgmma forward
 * (gpu_fwd_teams.h), dQ and dK/dV (gpu_bwd_teams.h). A team is
 * FA_WG_PAIR_THREADS threads, FA_WG_PAIR_ROWS query rows (64 a warpgroup,
 * each with its own query tiles); the K/V tiles of FA_WG_PAIR_BK keys that
 * both warpgroups read are copied once by bulk tensor copies (gpu_tma.h)
 * into a ring of S team-memory buffers: tile t in buffer t % S, its arrival
 * on that buffer's mbarrier `full`. The dK/dV turns it around:
 * FA_WG_PAIR_ROWS keys a team, and the ring carries the query tiles (Q, dO).
 *
 * A buffer is refilled by the second warpgroup to release it (a counter in
 * team memory, one word per buffer): no thread waits for the other
 * warpgroup before a copy starts, and the copy starts as soon as both are
 * done with the buffer. Both warpgroups' thread 0 walk the tiles to copy. */
#ifndef FORKATTN_GPU_TILE_RING_H
#define FORKATTN_GPU_TILE_RING_H
#include <stdint.h>
#include <ompx.h>

#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_tma.h"
#include "gpu_wgmma.h"

#define FA_WG_PAIR_THREADS 256
#define FA_WG_PAIR_BK 128
/* FA_WG_PAIR_ROWS (gpu_fwd.h): the block rows the plan cuts for these teams */

/* Team memory after a ring of S buffers: 8 flag words (the tiles' scans),
 * then a full mbarrier (8 bytes) and a release counter (4 bytes, padded to
 * 8) per buffer. */
#define FA_TILE_RING_BYTES(S) (8 * sizeof(unsigned) + 16 * (size_t)(S))

#pragma omp declare target
/* The warpgroup of thread tid (0 or 1), through a shuffle from lane 0:
 * ptxas then knows it is warp-uniform and keeps the tile offsets derived
 * from it in uniform registers (built per product from tid / 128 they
 * cost ~40 R2UR a tile in the dK/dV, and 5 % of its time). The forward and
 * dQ keep tid / 128: there it saved 7 of ~150 R2UR a tile and made the
 * forward spill. */
static inline int fa_warpgroup_of(int tid) { return (int)fa_mma_shfl_idx((float)(tid / 128), 0); }

/* A ring of S buffers of `stage` 16-bit elements from element st0 of the
 * team memory (buffer b: K at buf(b), V BK rows later), and its
 * bookkeeping (FA_TILE_RING_BYTES): the scans' flag words, buffer b's full
 * mbarrier at element full + 4 b, its release counter released[2 b]. */
typedef struct fa_tile_ring {
  int st0, stage, S, full;
  unsigned *flags;
  int *released;
} fa_tile_ring;

static inline fa_tile_ring fa_tile_ring_at(unsigned short *smem, int st0, int stage, int S) {
  const int flags = st0 + S * stage, full = flags + 16; /* 8 words = 16 elements */
  const fa_tile_ring r = {st0, stage, S, full, (unsigned *)(smem + flags), (int *)(smem + full + 4 * S)};
  return r;
}

/* Thread 0, every use of the ring's mbarriers over (a team barrier since):
 * invalidate them before the ring is initialised again (a persistent
 * team's next item; PTX leaves mbarrier.init on a live one undefined). */
static inline void fa_tile_ring_inval(fa_smem sm, fa_tile_ring r) {
  for (int b = 0; b < r.S; b++) fa_mbar_inval(sm, r.full + 4 * b);
}

/* Element offset of buffer b. */
static inline int fa_tile_ring_buf(fa_tile_ring r, int b) { return r.st0 + b * r.stage; }

/* Thread 0 of a warpgroup: rows [row, row + R) of head `head` of the two
 * tensors of maps tma[0], tma[1] (K and V; the dK/dV's Q and dO) into buffer
 * b (the second R rows later), completing on its full barrier. */
static inline __attribute__((always_inline)) void fa_tile_ring_copy(fa_smem sm, fa_tile_ring r, int b,
                                                                    const fa_tma_map *tma, int head, int row, int R,
                                                                    int D) {
  const int dst = fa_tile_ring_buf(r, b), full = r.full + 4 * b;
  fa_mbar_expect_tx(sm, full, 2 * R * D * 2);
  fa_tma_tile(sm, dst, tma, head, row, R, D, full);
  fa_tma_tile(sm, dst + R * D, tma + 1, head, row, R, D, full);
}

/* By every thread of the team: thread 0 initializes the buffers' mbarriers
 * and release counters, and a team barrier makes them visible before any
 * use (gpu_tma.h). */
static inline __attribute__((always_inline)) void fa_tile_ring_init(fa_smem sm, fa_tile_ring r, int tid) {
  if (tid == 0)
    for (int b = 0; b < r.S; b++) fa_mbar_init(sm, r.full + 4 * b, 1), r.released[2 * b] = 0;
  ompx_sync_block_acq_rel();
}

/* Thread 0 of a warpgroup, its products reading buffer b retired: 1 for
 * the second of the two warpgroups to release b, which then refills it. */
static inline __attribute__((always_inline)) int fa_tile_ring_second(fa_tile_ring r, int b) {
  if (__atomic_fetch_add(&r.released[2 * b], 1, __ATOMIC_ACQ_REL) != 1) return 0;
  r.released[2 * b] = 0; /* its next release comes after this copy lands and is read */
  return 1;
}

/* The ring's start, by every thread of the team (fa_tile_ring_init), then
 * thread 0 copies tiles 0 .. n - 1 of walk w into buffers 0 .. n - 1.
 * Returns, to both warpgroups' thread 0, the walk past those tiles: the
 * next tile to copy. */
static inline __attribute__((always_inline)) fa_tile_walk fa_tile_ring_start(fa_smem sm, fa_tile_ring r, int n,
                                                                             const fa_tma_map *tma, int64_t g,
                                                                             fa_tile_walk w, int BK, int D,
                                                                             const fa_range *seg,
                                                                             const fa_pair *pair, fa_block blk,
                                                                             int64_t qshift) {
  const int tid = ompx_thread_id_x();
  fa_tile_ring_init(sm, r, tid);
  if (tid % 128 == 0)
    for (int b = 0; b < n; b++) {
      if (tid == 0 && w.pi < w.pend) fa_tile_ring_copy(sm, r, b, tma, (int)g, w.kb, BK, D);
      if (w.pi < w.pend) w = fa_walk_next(w, BK, seg, pair, blk, qshift);
    }
  return w;
}

/* Thread 0 of each warpgroup, once its products reading buffer b retired:
 * the second of the two to call copies tile wl (if any) into it. Returns
 * the walk one tile on. */
static inline __attribute__((always_inline)) fa_tile_walk fa_tile_ring_release(fa_smem sm, fa_tile_ring r, int b,
                                                                               const fa_tma_map *tma, int64_t g,
                                                                               fa_tile_walk wl, int BK, int D,
                                                                               const fa_range *seg, const fa_pair *pair,
                                                                               fa_block blk, int64_t qshift) {
  if (wl.pi >= wl.pend) return wl;
  if (fa_tile_ring_second(r, b)) fa_tile_ring_copy(sm, r, b, tma, (int)g, wl.kb, BK, D);
  return fa_walk_next(wl, BK, seg, pair, blk, qshift);
}

/* The whole team's scan (fa_mma_scan_rows_by) of the BK-row tile at t (64
 * or 128 rows) in 64-row parts, with the ring's flag words: f[0], f[1] flag
 * rows 0-63 and 64-127 (0 when absent). Contains team barriers. */
static inline void fa_tile_ring_scan(unsigned short *t, int BK, int D, int f16, fa_tile_ring r, int tid,
                                     unsigned long long f[2]) {
  f[0] = fa_mma_scan_rows_by(t, D, BK, 0, 64, D, f16, r.flags, tid, FA_WG_PAIR_THREADS);
  f[1] = BK > 64 ? fa_mma_scan_rows_by(t, D, BK, 64, 64, D, f16, r.flags, tid, FA_WG_PAIR_THREADS) : 0;
}

#pragma omp end declare target


#endif
