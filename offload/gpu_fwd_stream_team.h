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
 *    keys from some row (or V is finite: gpu_finite_check.h), so a
 *    non-finite V row is zero there, and otherwise every row of the item
 *    sees it and is NaN anyway;
 *  - the next item's query rows are copied (cp.async) into the warpgroup's
 *    Q tile as soon as the item's last S retired, and O leaves through the
 *    last tile's K rows instead (after a team barrier);
 *  - an item's block and first key tile come in one record per query block
 *    (fa_block_item, made on the host with the plan's blocks): the
 *    consumers' by cp.async with the item's Q rows, the producers' read
 *    while the team waits for those rows; walking the plan to them took
 *    four dependent loads, on the team's critical path at every item.
 * Items are assigned statically (no counter): this team serves launches of
 * many short, alike items (gpu_persist.h), where a static share balances.
 * Every item must see a key (the caller checks, fa_block_items_see_keys):
 * the producers take each next item's first tile as it is, and an item
 * without one would copy the next item's record over its own slot with no
 * product between its warps' reads of it and that copy. */
#ifndef FORKATTN_GPU_FWD_STREAM_TEAM_H
#define FORKATTN_GPU_FWD_STREAM_TEAM_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu_fwd_teams.h"

#pragma omp declare target
/* The items of a stream team: item i is query block i / hq, query head i % hq, KV head
 * (i % hq) / (hq / hkv); the team's items are first, first + step, ... below n. */
typedef struct fa_fwd_stream {
  const fa_block_item *items; /* a query block's item: its block and first keys (segment_plan.h) */
  int hq, group, n, step;
} fa_fwd_stream;

static inline __attribute__((always_inline)) fa_block fa_fwd_stream_block_of(const fa_block_item *it) {
  const fa_block b = {it->seg, it->start, it->len};
  return b;
}

static inline __attribute__((always_inline)) fa_tile_walk fa_fwd_stream_walk_of(const fa_block_item *it) {
  const fa_tile_walk w = {it->pi, it->pend, it->kb, it->kend, it->causal};
  return w;
}

/* By one thread: item record *it into team memory at element rec, by cp.async (the caller commits). */
static inline __attribute__((always_inline)) void fa_fwd_stream_copy_item(fa_smem sm, int rec,
                                                                          const fa_block_item *it) {
  fa_cp_async16(sm, rec, it, 16);
  fa_cp_async16(sm, rec + 8, (const char *)it + 16, 16);
}

static inline __attribute__((always_inline)) int64_t fa_fwd_stream_kv_head(const fa_fwd_stream *s, int i) {
  return (int64_t)(i % s->hq / s->group);
}

/* The next item's record as a producer read it ahead (fa_fwd_stream_prepare): in team memory, a
 * slot for each warpgroup's thread 0, so that it holds no registers across the loop. */
typedef struct fa_fwd_stream_next {
  fa_block_item it;
  int ready;
} fa_fwd_stream_next;

/* A stream team's slots in team memory past its SMEM: each warpgroup's next item record, copied
 * with the item's Q rows by 16-byte cp.async (so first, 16-byte aligned), and the producers' next
 * items. */
typedef struct fa_fwd_stream_slots {
  fa_block_item item[2];
  fa_fwd_stream_next next[2];
} fa_fwd_stream_slots;
_Static_assert(offsetof(fa_fwd_stream_slots, item) % 16 == 0 && sizeof(fa_block_item) % 16 == 0,
               "item records are cp.async destinations");
#define FA_FWD_STREAM_SLOTS_AT(SMEM) (((SMEM) + 15) / 16 * 16)
#define FA_FWD_STREAM_SMEM(SMEM) (FA_FWD_STREAM_SLOTS_AT(SMEM) + sizeof(fa_fwd_stream_slots))

/* The producers' side (thread 0 of each warpgroup): the walk wl of item pi, whose block and KV head
 * are kp's, and its slot nx. The next item's first tile is read while the team waits for an
 * item's Q rows (fa_fwd_stream_prepare), not when the walk crosses into it, where the whole team
 * would wait for the load at the next tile's scan. */
typedef struct fa_fwd_stream_producer {
  fa_wg_pair_walk kp;
  fa_tile_walk wl;
  int pi;
  fa_fwd_stream_next *nx;
} fa_fwd_stream_producer;

static inline __attribute__((always_inline)) void fa_fwd_stream_prepare(const fa_fwd_stream *s,
                                                                        fa_fwd_stream_producer *p) {
  if (p->nx->ready) return;
  if (p->pi + s->step < s->n) p->nx->it = s->items[(p->pi + s->step) / s->hq];
  p->nx->ready = 1;
}

/* Onto the next item's first tile (when the team has a next item). */
static inline __attribute__((always_inline)) void fa_fwd_stream_cross(const fa_fwd_stream *s,
                                                                      fa_fwd_stream_producer *p) {
  fa_fwd_stream_prepare(s, p);
  if (p->pi + s->step < s->n) {
    p->pi += s->step;
    p->kp.blk = fa_fwd_stream_block_of(&p->nx->it);
    p->kp.g = fa_fwd_stream_kv_head(s, p->pi);
    p->wl = fa_fwd_stream_walk_of(&p->nx->it);
  }
  p->nx->ready = 0;
}

/* The walk one tile on: into the next item when wl was its item's last. */
static inline __attribute__((always_inline)) void fa_fwd_stream_advance(const fa_fwd_stream *s,
                                                                        fa_fwd_stream_producer *p) {
  p->wl = fa_wg_pair_next(&p->kp, p->wl);
  if (p->wl.pi >= p->wl.pend) fa_fwd_stream_cross(s, p);
}

/* Thread 0 of each warpgroup, its products reading buffer b retired: the second of the two copies
 * the next tile into it. */
static inline __attribute__((always_inline)) void fa_fwd_stream_release(const fa_fwd_stream *s,
                                                                        fa_fwd_stream_producer *p, fa_smem sm,
                                                                        int b) {
  if (p->wl.pi >= p->wl.pend) return;
  if (fa_tile_ring_second(p->kp.rg, b))
    fa_tile_ring_copy(sm, p->kp.rg, b, p->kp.tma, (int)p->kp.g, p->wl.kb, p->kp.BK, p->kp.D);
  fa_fwd_stream_advance(s, p);
}

/* By every thread: the ring's start with the stream's first n tiles (thread 0 copies them). */
static inline __attribute__((always_inline)) void fa_fwd_stream_start(const fa_fwd_stream *s,
                                                                      fa_fwd_stream_producer *p, fa_smem sm, int n,
                                                                      int tid) {
  if (tid % 128 == 0) p->nx->ready = 0;
  fa_tile_ring_init(sm, p->kp.rg, tid);
  const fa_block_item it = s->items[p->pi / s->hq];
  p->wl = fa_fwd_stream_walk_of(&it);
  if (tid % 128 == 0)
    for (int b = 0; b < n && p->wl.pi < p->wl.pend; b++) {
      if (tid == 0) fa_tile_ring_copy(sm, p->kp.rg, b, p->kp.tma, (int)p->kp.g, p->wl.kb, p->kp.BK, p->kp.D);
      fa_fwd_stream_advance(s, p);
    }
}

/* Team `team` of `teams`: its items in order (see the top of this file). Team memory:
 * FA_FWD_STREAM_SMEM(FA_WG_PAIR_FWD_SMEM(D)), fa_wg_pair_fwd_team's and the producers' slots. */
static inline __attribute__((always_inline)) void fa_wg_pair_fwd_stream_team(const int D, const int BK, const int f16,
                                                                             const fa_gpu_fwd_args ga, int team,
                                                                             int teams, unsigned short *smem) {
  fa_fwd_stream_slots *slots = (fa_fwd_stream_slots *)((char *)smem + FA_FWD_STREAM_SLOTS_AT(FA_WG_PAIR_FWD_SMEM(D)));
  const int S = FA_WG_PAIR_FWD_STAGES(D);
  fa_wg_pair_rows t = fa_wg_pair_rows_of();
  const int tid = t.tid, wg = t.wg, wt = t.wt, lane = t.lane;
  smem += fa_wg_align(fa_smem_of(smem));
  const fa_smem sm = fa_smem_of(smem);
  const int qt = wg * FA_MMA_ROWS * D; /* element offset of this warpgroup's Q tile */
  /* element offset of this warpgroup's item record: its 32 bytes come by cp.async with the Q rows */
  const int rec = (int)(((char *)&slots->item[wg] - (char *)smem) / 2);
  const fa_tile_ring rg = fa_wg_pair_fwd_ring(D, BK, smem);
  const int hq = (int)ga.hq;
  const fa_fwd_stream s = {ga.items, hq, hq / (int)ga.hkv, (int)ga.nblocks * hq, teams};
  const float mul = ga.scale * FA_LOG2E;
  const int vscan = ga.v_nonfinite ? *ga.v_nonfinite : 1;
  int item = team;
  if (item >= s.n) return;
  fa_block blk = fa_fwd_stream_block_of(&s.items[item / hq]);
  const fa_wg_pair_walk k0 = {rg, ga.tma, ga.qoff, ga.seg, ga.pair, blk, ga.qshift, fa_fwd_stream_kv_head(&s, item),
                              BK, D};
  fa_fwd_stream_producer pr = {k0, {0, 0, 0, 0, 0}, item, &slots->next[wg]};
  FA_TL_DECL;
  FA_TL(FA_TL_START);
  FA_TL(FA_TL_BEGIN);
  fa_wg_pair_load_rows(sm, &t, qt, D, &ga.q, &blk, fa_wg_pair_nq(&t, blk), item % hq);
  if (wt == 0) fa_fwd_stream_copy_item(sm, rec, &s.items[item / hq]);
  fa_cp_async_commit();
  /* tiles 0 .. S - 2 (buffer S - 1 is "tile -1", released at tile 1) */
  fa_fwd_stream_start(&s, &pr, sm, S - 1, tid);
  int j = 0, b = 0, bp = S - 1, bpp = S - 1; /* tile j's buffer, tile j - 1's, tile j - 2's: across items */
  const fa_u4 z4 = {0, 0, 0, 0};

  for (; item < s.n; item += s.step) {
    if (wt == 0) fa_fwd_stream_prepare(&s, &pr); /* its load runs under the wait for Q */
    /* this item's Q rows and record (copied at the previous item's end, or above) in place */
    fa_cp_async_wait(0);
    fa_fence_proxy_async();
    fa_wg_bar_sync(1 + wg, 128);
    const fa_block_item it = slots->item[wg];
    blk = fa_fwd_stream_block_of(&it);
    fa_tile_walk w = fa_fwd_stream_walk_of(&it);
    const int64_t h = item % hq;
    const fa_wg_pair_walk k = {rg, ga.tma, ga.qoff, ga.seg, ga.pair, blk, ga.qshift, fa_fwd_stream_kv_head(&s, item),
                               BK, D};
    const int64_t qrows = fa_wg_pair_qrows(&t, blk);
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
    int first = 1; /* the item's first tile: P(j - 1) is the zeros */

    while (w.pi < w.pend) {
      const int kt = fa_tile_ring_buf(rg, b);
      FA_TL(FA_TL_TILE);
      fa_wg_pair_wait(&k, sm, b, j);
      FA_TL(FA_TL_ARRIVED);
      /* tile j - 2's buffer is free for this warpgroup (fa_wg_pair_fwd_team) */
      if (wt == 0 && j > 0) fa_fwd_stream_release(&s, &pr, sm, bpp);
      fa_wg_pair_fwd_tile(D, BK, f16, smem, sm, rg, &t, w, kt, first ? b : bp, qt, vscan, mul, sc, o, pa, &m0, &m1, &l0, &l1,
                          &bad0, &bad1, FA_TL_REF);
      w = fa_wg_pair_next(&k, w);
      first = 0;
      bpp = bp;
      bp = b;
      b = fa_wg_pair_next_buf(&k, b);
      j++;
      FA_TL(FA_TL_NEXT);
    }
    /* the warpgroup's S products retired: the next item's Q rows into its tile, under the last P V and
     * the epilogue */
    if (item + s.step < s.n) {
      const fa_block_item *ni = &s.items[(item + s.step) / hq];
      const fa_block nb = fa_fwd_stream_block_of(ni);
      fa_wg_pair_load_rows(sm, &t, qt, D, &ga.q, &nb, fa_wg_pair_nq(&t, nb), (item + s.step) % hq);
      if (wt == 0) fa_fwd_stream_copy_item(sm, rec, ni);
      fa_cp_async_commit();
    }
    /* P V of the item's last tile */
    fa_wg_acc_ab(o, pa, sm, fa_tile_ring_buf(rg, bp) + BK * D, BK, BK, D, f16);
    fa_wg_commit();
    fa_wg_wait(0);
    fa_wg_pin(o, D / 8);
    FA_TL(FA_TL_PV);
    float inv[2];
    int bad[2] = {bad0, bad1};
    fa_fwd_finish_rows(ga, blk.start + r0, h, c0, lane, ok0, ok1, m0, m1, l0, l1, inv, bad);
    /* O through the last tile's K rows (64 a warpgroup), free once both warpgroups' products of it
     * retired; the buffer's next copy is issued after both released it, past this */
    ompx_sync_block_acq_rel();
    fa_wg_store_rows_staged(ga.o, blk.start + wg * FA_MMA_ROWS, qrows, h, o, D,
                            smem + fa_tile_ring_buf(rg, bp) + wg * FA_MMA_ROWS * D, wt, inv[0], inv[1], bad[0], bad[1],
                            1 + wg);
    fa_fence_proxy_async(); /* the staged rows before the buffer's next bulk copy */
    FA_TL(FA_TL_FINISH);
  }
  FA_TL(FA_TL_END);
}
#pragma omp end declare target

#endif
