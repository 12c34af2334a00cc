/* The two-warpgroup forward over a stream of items: one team an SM runs
 * items (query block x query head) team, team + G, team + 2G, ... (G teams)
 * through one ring whose bulk copies run on from an item's last key tile
 * into the next item's first ones, so a short item (a sequence of a few key
 * tiles) no longer waits at its start for its keys and values, the ring's
 * set-up and a new team: the latency that made a team an item of one to
 * four tiles spend most of its time waiting (in-kernel timeline,
 * docs/gpu-kernels.md). Composed of the parts of fa_wg_pair_fwd_team
 * (gpu_fwd_teams.h), whose loop it keeps; what differs:
 *  - the tile count j, the ring's buffers b, bp, bpp (tiles j, j - 1, j - 2)
 *    and the producers' walk wl run across items; thread 0 of each
 *    warpgroup moves wl to the team's next item when an item's tiles are
 *    all copied (fa_fwd_stream_release);
 *  - an item's first iteration multiplies P(-1) = 0 by its own tile's V
 *    (instead of a buffer of zeros): that V was scanned if the tile hides
 *    keys from some row, so a non-finite V row is zero there, and otherwise
 *    every row of the item sees it and is NaN anyway;
 *  - the next item's query rows are copied (cp.async) into the warpgroup's
 *    Q tile right after the item's O left through it.
 * Items are assigned statically (no counter): this team serves launches of
 * many short, alike items (gpu_persist.h), where a static share balances. */
#ifndef FORKATTN_GPU_FWD_STREAM_TEAM_H
#define FORKATTN_GPU_FWD_STREAM_TEAM_H
#include <math.h>
#include <stdint.h>

#include "gpu_fwd_teams.h"

#pragma omp declare target
/* The items of a stream team: item i is query block i / hq, query head i % hq, KV head
 * (i % hq) / (hq / hkv); the team's items are first, first + step, ... below n. */
typedef struct fa_fwd_stream {
  const fa_block *blocks;
  int hq, group, n, step;
} fa_fwd_stream;

static inline __attribute__((always_inline)) fa_block fa_fwd_stream_block(const fa_fwd_stream *s, int i) {
  return s->blocks[i / s->hq];
}

static inline __attribute__((always_inline)) int64_t fa_fwd_stream_kv_head(const fa_fwd_stream *s, int i) {
  return (int64_t)(i % s->hq / s->group);
}

/* The producer walk (kp, its item *pi) at the first tile of the first item from *pi on that has
 * one (kp's block and KV head set to that item's); past the team's last item: an ended walk. */
static inline __attribute__((always_inline)) fa_tile_walk fa_fwd_stream_seek(const fa_fwd_stream *s,
                                                                             fa_wg_pair_walk *kp, int *pi,
                                                                             fa_tile_walk wl) {
  while (wl.pi >= wl.pend && *pi + s->step < s->n) {
    *pi += s->step;
    kp->blk = fa_fwd_stream_block(s, *pi);
    kp->g = fa_fwd_stream_kv_head(s, *pi);
    wl = fa_wg_pair_first(kp);
  }
  return wl;
}

/* Thread 0 of each warpgroup, its products reading buffer b retired: the second of the two copies
 * tile wl into it; returns the next tile to copy, in the next item when wl was its item's last. */
static inline __attribute__((always_inline)) fa_tile_walk fa_fwd_stream_release(const fa_fwd_stream *s,
                                                                               fa_wg_pair_walk *kp, int *pi,
                                                                               fa_smem sm, int b, fa_tile_walk wl) {
  if (wl.pi >= wl.pend) return wl;
  if (fa_tile_ring_second(kp->rg, b)) fa_tile_ring_copy(sm, kp->rg, b, kp->tma, (int)kp->g, wl.kb, kp->BK, kp->D);
  return fa_fwd_stream_seek(s, kp, pi, fa_wg_pair_next(kp, wl));
}

/* By every thread: the ring's start with tiles 0 .. n - 1 of the stream (thread 0 copies them);
 * returns, to thread 0 of each warpgroup, the next tile to copy. */
static inline __attribute__((always_inline)) fa_tile_walk fa_fwd_stream_start(const fa_fwd_stream *s,
                                                                             fa_wg_pair_walk *kp, int *pi,
                                                                             fa_smem sm, int n, int tid) {
  fa_tile_ring_init(sm, kp->rg, tid);
  fa_tile_walk wl = fa_fwd_stream_seek(s, kp, pi, fa_wg_pair_first(kp));
  if (tid % 128 == 0)
    for (int b = 0; b < n; b++) {
      if (tid == 0 && wl.pi < wl.pend) fa_tile_ring_copy(sm, kp->rg, b, kp->tma, (int)kp->g, wl.kb, kp->BK, kp->D);
      if (wl.pi < wl.pend) wl = fa_fwd_stream_seek(s, kp, pi, fa_wg_pair_next(kp, wl));
    }
  return wl;
}

/* Team `team` of `teams`: its items in order (see the top of this file). Team memory as
 * fa_wg_pair_fwd_team's (FA_WG_PAIR_FWD_SMEM). */
static inline __attribute__((always_inline)) void fa_wg_pair_fwd_stream_team(const int D, const int BK, const int f16,
                                                                             const fa_gpu_fwd_args ga, int team,
                                                                             int teams, unsigned short *smem) {
  const int S = FA_WG_PAIR_FWD_STAGES(D);
  fa_wg_pair_rows t = fa_wg_pair_rows_of();
  const int tid = t.tid, wg = t.wg, wt = t.wt, lane = t.lane;
  smem += fa_wg_align(fa_smem_of(smem));
  const fa_smem sm = fa_smem_of(smem);
  const int qt = wg * FA_MMA_ROWS * D; /* element offset of this warpgroup's Q tile */
  const fa_tile_ring rg = fa_wg_pair_fwd_ring(D, BK, smem);
  const int hq = (int)ga.hq;
  const fa_fwd_stream s = {ga.blocks, hq, hq / (int)ga.hkv, (int)ga.nblocks * hq, teams};
  const float mul = ga.scale * FA_LOG2E;
  int item = team;
  if (item >= s.n) return;
  /* the producers' walk: item pitem's tiles (thread 0 of each warpgroup) */
  int pitem = item;
  fa_wg_pair_walk kp = {rg, ga.tma, ga.qoff, ga.seg, ga.pair, fa_fwd_stream_block(&s, item), ga.qshift,
                        fa_fwd_stream_kv_head(&s, item), BK, D};
  FA_TL_DECL;
  FA_TL(FA_TL_START);
  FA_TL(FA_TL_BEGIN);
  {
    const fa_block b0 = fa_fwd_stream_block(&s, item);
    fa_wg_pair_load_rows(sm, &t, qt, D, &ga.q, &b0, fa_wg_pair_nq(&t, b0), item % hq);
    fa_cp_async_commit();
  }
  /* tiles 0 .. S - 2 (buffer S - 1 is "tile -1", released at tile 1) */
  fa_tile_walk wl = fa_fwd_stream_start(&s, &kp, &pitem, sm, S - 1, tid);
  int j = 0, b = 0, bp = S - 1, bpp = S - 1; /* tile j's buffer, tile j - 1's, tile j - 2's: across items */
  const fa_u4 z4 = {0, 0, 0, 0};

  for (; item < s.n; item += s.step) {
    const fa_block blk = fa_fwd_stream_block(&s, item);
    const int64_t h = item % hq;
    const fa_wg_pair_walk k = {rg, ga.tma, ga.qoff, ga.seg, ga.pair, blk, ga.qshift, fa_fwd_stream_kv_head(&s, item),
                               BK, D};
    const int64_t qrows = fa_wg_pair_qrows(&t, blk);
    fa_tile_walk w = fa_wg_pair_first(&k);
    /* this item's Q rows (copied at the previous item's end, or above) in place for the tensor cores */
    fa_cp_async_wait(0);
    fa_fence_proxy_async();
    fa_wg_bar_sync(1 + wg, 128);
    FA_TL(FA_TL_READY);

    fa_f4 sc[FA_WG_PAIR_BK / 8], o[FA_MMA_MAX_D / 8];
    fa_u4 pa[FA_WG_PAIR_BK / 16]; /* P(j - 1), packed */
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n] = fa_f4_zero();
#pragma unroll
    for (int n = 0; n < BK / 16; n++) pa[n] = z4;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    fa_wg_pair_lane_rows(&t, blk);
    const int r0 = t.r0, c0 = t.c0, ok0 = t.ok0, ok1 = t.ok1;
    int bad0 = 0, bad1 = 0;
    fa_wg_pair_positions(&t, blk, ga.qshift);
    const int qfirst = t.qfirst, wfirst = t.wfirst;
    int first = 1; /* the item's first tile: P(j - 1) is the zeros */

    while (w.pi < w.pend) {
      const int kt = fa_tile_ring_buf(rg, b);
      FA_TL(FA_TL_TILE);
      fa_wg_pair_wait(&k, sm, b, j);
      FA_TL(FA_TL_ARRIVED);
      /* tile j - 2's buffer is free for this warpgroup (fa_wg_pair_fwd_team) */
      if (wt == 0 && j > 0) wl = fa_fwd_stream_release(&s, &kp, &pitem, sm, bpp, wl);
      const int nk = fa_walk_keys(w, BK);
      unsigned long long vf[2] = {0, 0}; /* bit r: V row r (64 + r) of tile j was non-finite (zeroed) */
      if (nk < BK || (w.causal && w.kb + BK - 1 > qfirst)) fa_tile_ring_scan(smem + kt + BK * D, BK, D, f16, rg, tid, vf);
      const fa_wg_pair_lims lim = fa_wg_pair_row_keys(&t, w, nk);
      const int lim0 = lim.lim0, lim1 = lim.lim1;

      fa_wg_acc_abt(sc, qt, sm, kt, BK, D, f16);
      fa_wg_commit();
      FA_TL(FA_TL_ISSUED_S);
      fa_wg_acc_ab(o, pa, sm, (first ? kt : fa_tile_ring_buf(rg, bp)) + BK * D, BK, BK, D, f16);
      fa_wg_commit();
      FA_TL(FA_TL_ISSUED);
      fa_wg_wait(1); /* S(j); P(j-1) V(j-1) runs on under the softmax */
      fa_wg_pin(sc, BK / 8);
      FA_TL(FA_TL_S);

      float mx0 = -INFINITY, mx1 = -INFINITY, a0, a1;
      fa_fwd_tile_max(sc, BK, nk == BK && (!w.causal || w.kb + BK - 1 <= wfirst), c0, lim0, lim1, vf[0], vf[1], &mx0,
                      &mx1, &bad0, &bad1);
      FA_TL(FA_TL_MAX);
      fa_fwd_tile_exp(sc, BK, mx0, mx1, mul, &m0, &m1, &l0, &l1, &a0, &a1);
      FA_TL(FA_TL_EXP);
      fa_wg_wait(0);
      fa_wg_pin(o, D / 8);
      fa_wg_pin_u4(pa, BK / 16);
      FA_TL(FA_TL_PV);
      fa_fwd_rescale(o, D, a0, a1);
      fa_wg_pack(pa, sc, BK, f16);
      w = fa_wg_pair_next(&k, w);
      first = 0;
      bpp = bp;
      bp = b;
      b = fa_wg_pair_next_buf(&k, b);
      j++;
      FA_TL(FA_TL_NEXT);
    }
    /* P V of the item's last tile (an item without tiles: P = 0 and O is cleared below) */
    fa_wg_acc_ab(o, pa, sm, fa_tile_ring_buf(rg, bp) + BK * D, BK, BK, D, f16);
    fa_wg_commit();
    fa_wg_wait(0);
    fa_wg_pin(o, D / 8);
    FA_TL(FA_TL_PV);
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n] = first ? fa_f4_zero() : o[n];
    float inv[2];
    int bad[2] = {bad0, bad1};
    fa_fwd_finish_rows(ga, blk.start + r0, h, c0, lane, ok0, ok1, m0, m1, l0, l1, inv, bad);
    /* O through this warpgroup's Q tile (its last reader, S of the item's last tile, retired) */
    fa_wg_store_rows_staged(ga.o, blk.start + wg * FA_MMA_ROWS, qrows, h, o, D, smem + qt, wt, inv[0], inv[1], bad[0],
                            bad[1], 1 + wg);
    FA_TL(FA_TL_FINISH);
    /* every thread of the warpgroup read its staged rows: the next item's Q rows into the tile */
    fa_wg_bar_sync(1 + wg, 128);
    if (item + s.step < s.n) {
      const fa_block nb = fa_fwd_stream_block(&s, item + s.step);
      fa_wg_pair_load_rows(sm, &t, qt, D, &ga.q, &nb, fa_wg_pair_nq(&t, nb), (item + s.step) % hq);
      fa_cp_async_commit();
    }
  }
  FA_TL(FA_TL_END);
}
#pragma omp end declare target

#endif
