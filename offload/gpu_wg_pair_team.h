/* The frame the two-warpgroup query teams share (the wgmma forward of
 * gpu_fwd_teams.h, the dQ of gpu_dq_teams.h): the threads' roles and rows
 * (fa_wg_pair_rows), the query tiles' readiness, and the walk of the
 * block's key tiles through the ring of gpu_tile_ring.h (fa_wg_pair_walk:
 * first tile, the ring's start, arrival, the rows' key limits, release,
 * next tile and buffer). Always inlined with their structs by pointer, so
 * the structs live in registers; each team's SASS is what it was written
 * out. Helpers for the tile's scan and a warp's all-visible test (and,
 * in the dQ, the query rows' cp.async and the release) changed some
 * kernel's schedule or registers (the inliner and ptxas follow the code's
 * shape), so those steps stay in the teams. */
#ifndef FORKATTN_GPU_WG_PAIR_TEAM_H
#define FORKATTN_GPU_WG_PAIR_TEAM_H
#include <stdint.h>
#include <ompx.h>

#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_tile_ring.h"
#include "gpu_tma.h"
#include "gpu_wgmma.h"

#pragma omp declare target
/* A thread of a two-warpgroup team of block blk: warpgroup wg owns rows
 * [64 wg, 64 wg + 64). Filled in steps, each where the team needs it (the
 * order of the code decides the kernels' schedule): the thread's roles
 * (fa_wg_pair_rows_of), the lane's rows r0 and r0 + 8 of the block (ok0,
 * ok1: they exist) and first fragment column c0 (fa_wg_pair_lane_rows),
 * then the key-frame positions of the team's first row (qfirst), the
 * lane's rows (q_pos0, q_pos1) and its warp's first row (wfirst;
 * fa_wg_pair_positions). */
typedef struct fa_wg_pair_rows {
  int tid, wg, wt, warp, lane; /* wt: the thread in its warpgroup, warp: the warp in it */
  int r0, c0, ok0, ok1;
  int qfirst, q_pos0, q_pos1, wfirst;
} fa_wg_pair_rows;

static inline __attribute__((always_inline)) fa_wg_pair_rows fa_wg_pair_rows_of(void) {
  const int tid = ompx_thread_id_x();
  const fa_wg_pair_rows t = {.tid = tid, .wg = tid / 128, .wt = tid % 128, .warp = tid % 128 / 32, .lane = tid % 32};
  return t;
}

static inline __attribute__((always_inline)) void fa_wg_pair_lane_rows(fa_wg_pair_rows *t, fa_block blk) {
  t->r0 = t->wg * FA_MMA_ROWS + t->warp * 16 + fa_acc_row(t->lane, 0), t->c0 = fa_acc_col(t->lane, 0);
  t->ok0 = t->r0 < blk.len, t->ok1 = t->r0 + 8 < blk.len;
}

static inline __attribute__((always_inline)) void fa_wg_pair_positions(fa_wg_pair_rows *t, fa_block blk,
                                                                       int64_t qshift) {
  t->qfirst = (int)(blk.start + qshift);
  t->q_pos0 = t->qfirst + t->r0, t->q_pos1 = t->q_pos0 + 8, t->wfirst = t->qfirst + t->wg * FA_MMA_ROWS + t->warp * 16;
}

/* The warpgroup's rows of block blk: as is (<= 0 or past 64 too), and in [0, 64]. */
static inline __attribute__((always_inline)) int64_t fa_wg_pair_qrows(const fa_wg_pair_rows *t, fa_block blk) {
  return blk.len - t->wg * FA_MMA_ROWS;
}

static inline __attribute__((always_inline)) int64_t fa_wg_pair_nq(const fa_wg_pair_rows *t, fa_block blk) {
  const int64_t qrows = fa_wg_pair_qrows(t, blk);
  return qrows < 0 ? 0 : qrows > FA_MMA_ROWS ? FA_MMA_ROWS : qrows;
}

/* By each warpgroup: its nq rows (fa_wg_pair_nq) of tensor x (head h)
 * into its 64 x D tile at element `at` of team memory, by cp.async (the
 * caller commits). */
static inline __attribute__((always_inline)) void fa_wg_pair_load_rows(fa_smem sm, const fa_wg_pair_rows *t, int at,
                                                                       int D, const fa_dev_tensor *x,
                                                                       const fa_block *blk, int64_t nq, int64_t h) {
  fa_mma_load_rows(sm, at, D, FA_MMA_ROWS, D, *x, blk->start + t->wg * FA_MMA_ROWS, nq, h, t->wt);
}

/* The team's cp.async copies (its query tiles) landed and, with its other
 * writes to team memory, are visible to every thread and the tensor cores. */
static inline __attribute__((always_inline)) void fa_wg_pair_tiles_ready(void) {
  fa_cp_async_wait(0);
  fa_fence_proxy_async();
  ompx_sync_block_acq_rel();
}

/* What the walk of block blk's key tiles through the ring takes, fixed for
 * the team: ring rg of S buffers (K then V of BK keys a tile, copied from
 * head g of the maps tma[0], tma[1]) and the plan (qoff, seg, pair,
 * qshift). The walk's state stays in the team's own variables: tile j
 * (walk w) in buffer b, and wl, at thread 0 of each warpgroup, the next
 * tile to copy; kept out of the struct, they keep the order of the
 * kernel's code and so its schedule. */
typedef struct fa_wg_pair_walk {
  fa_tile_ring rg;
  const fa_tma_map *tma;
  const int64_t *qoff;
  const fa_range *seg;
  const fa_pair *pair;
  fa_block blk;
  int64_t qshift, g;
  int BK, D;
} fa_wg_pair_walk;

/* The block's first tile. */
static inline __attribute__((always_inline)) fa_tile_walk fa_wg_pair_first(const fa_wg_pair_walk *k) {
  return fa_walk_first(k->qoff, k->seg, k->pair, k->blk, k->qshift);
}

/* By every thread of the team: the ring's start with tiles 0 .. n - 1 from
 * w on (fa_tile_ring_start); returns wl, the next tile to copy. */
static inline __attribute__((always_inline)) fa_tile_walk fa_wg_pair_ring_start(const fa_wg_pair_walk *k, fa_smem sm,
                                                                                int n, fa_tile_walk w) {
  return fa_tile_ring_start(sm, k->rg, n, k->tma, k->g, w, k->BK, k->D, k->seg, k->pair, k->blk, k->qshift);
}

/* Tile j's copies have landed in buffer b (its mbarrier, phase j / S). */
static inline __attribute__((always_inline)) void fa_wg_pair_wait(const fa_wg_pair_walk *k, fa_smem sm, int b,
                                                                  int j) {
  fa_mbar_wait(sm, k->rg.full + 4 * b, (j / k->rg.S) & 1);
}

/* The keys of tile w (nk of them) that the lane's rows see: keys [0, lim0)
 * and [0, lim1) (fa_mma_row_keys). */
typedef struct fa_wg_pair_lims {
  int lim0, lim1;
} fa_wg_pair_lims;

static inline __attribute__((always_inline)) fa_wg_pair_lims fa_wg_pair_row_keys(const fa_wg_pair_rows *t,
                                                                                 fa_tile_walk w, int nk) {
  const fa_wg_pair_lims l = {fa_mma_row_keys(t->ok0, w.causal, t->q_pos0, w.kb, nk),
                             fa_mma_row_keys(t->ok1, w.causal, t->q_pos1, w.kb, nk)};
  return l;
}

/* Thread 0 of each warpgroup, its products reading buffer b retired: the
 * second of the two copies tile wl into it (fa_tile_ring_release). Returns
 * the next tile to copy. */
static inline __attribute__((always_inline)) fa_tile_walk fa_wg_pair_release(const fa_wg_pair_walk *k, fa_smem sm,
                                                                             int b, const fa_tile_walk *wl) {
  return fa_tile_ring_release(sm, k->rg, b, k->tma, k->g, *wl, k->BK, k->D, k->seg, k->pair, k->blk, k->qshift);
}

/* The tile after w. */
static inline __attribute__((always_inline)) fa_tile_walk fa_wg_pair_next(const fa_wg_pair_walk *k, fa_tile_walk w) {
  return fa_walk_next(w, k->BK, k->seg, k->pair, k->blk, k->qshift);
}

/* The buffer after b. */
static inline __attribute__((always_inline)) int fa_wg_pair_next_buf(const fa_wg_pair_walk *k, int b) {
  return b == k->rg.S - 1 ? 0 : b + 1;
}
#pragma omp end declare target

#endif
