/* The forward's team functions (one query block x one query head), in a
 * header so the host tests can run them under the SIMT emulation of
 * gpu_mma.h (tests/test_mma_emulated.c); launched by gpu_tc_fwd_launch.c. Each
 * composes K/V loads, S = Q K^T, the online-softmax step of
 * gpu_softmax_step.h, O += P V and the epilogue of gpu_epilogue.h:
 *   fa_mma_fwd_team  mma.sync, 64 rows, K/V double-buffered by cp.async
 *   fa_wg_pair_fwd_team  two warpgroups, 128 rows, 128-key tiles through the
 *                    ring of gpu_tile_ring.h (bulk tensor copies) */
#ifndef FORKATTN_GPU_FWD_TEAMS_H
#define FORKATTN_GPU_FWD_TEAMS_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"
#include "gpu_epilogue.h"
#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_products.h"
#include "gpu_softmax_step.h"
#include "gpu_tile_ring.h"
#include "gpu_timeline.h"
#include "gpu_tma.h"
#include "gpu_wg_pair_team.h"
#include "gpu_wgmma.h"
#include "gpu_work_scheduler.h"
#include "split_bf16.h"

#pragma omp declare target
/* The NP pieces of tile w's rows of input x (1 K, 2 V), head g, to element
 * at and on, BK * P elements apart. */
static inline __attribute__((always_inline)) void fa_fwd_load_pieces(fa_smem sm, int at, int P, int BK, int D, int NP,
                                                                     const fa_gpu_fwd_args *ga, int x, int64_t g,
                                                                     fa_tile_walk w, int tid) {
  fa_mma_load_pieces(sm, at, BK * P, NP, P, BK, D, x == 1 ? ga->k : ga->v, ga->pstride[x], w.kb, fa_walk_keys(w, BK),
                     g, tid);
}

/* Tile w's K (NQK pieces) and then V (NV pieces) into the buffer at buf. */
static inline __attribute__((always_inline)) void fa_fwd_load_tile(fa_smem sm, int buf, int P, int BK, int D, int NQK,
                                                                   int NV, const fa_gpu_fwd_args *ga, int64_t g,
                                                                   fa_tile_walk w, int tid) {
  fa_mma_load_kv_pieces(sm, buf, P, BK, D, ga->k, ga->pstride[1], g, NQK, ga->v, ga->pstride[2], g, NV, w, tid);
}

/* The forward's copies in iteration j: K of tile j + 2 (walk w2) into the
 * buffer at element kt, V of tile j + 1 (w1) to element vt (NQK and NV
 * pieces), one copy group committed. */
static inline __attribute__((always_inline)) void fa_fwd_load_next(fa_smem sm, int kt, int vt, int P, int BK, int D,
                                                                   int NQK, int NV, const fa_gpu_fwd_args *ga,
                                                                   int64_t g, fa_tile_walk w1, fa_tile_walk w2,
                                                                   int tid) {
  if (w2.pi < w2.pend) fa_fwd_load_pieces(sm, kt, P, BK, D, NQK, ga, 1, g, w2, tid);
  if (w1.pi < w1.pend) fa_fwd_load_pieces(sm, vt, P, BK, D, NV, ga, 2, g, w1, tid);
  fa_cp_async_commit();
}

/* The mma.sync forward (any sm_80+ build). One team: FA_MMA_ROWS query rows
 * of block blk, query head h, KV head g. D, BK, NQK and NV are compile-time
 * constants after inlining (register arrays); K and V tiles double-buffered
 * by cp.async into padded rows, read by ldmatrix.
 * NQK, NV: the pieces of Q and K, and of V (lib/core/split_bf16.h): 1 and 1
 * for bf16/f16 inputs; for f32 inputs 3 and 3 (f32 precision HIGH: bf16x6
 * scores and P V) or 2 and 2 (MEDIUM: bf16x3), the products of
 * gpu_products.h. A buffer holds K's pieces then V's. One Q piece streams
 * into buffer 1 while tile 0 streams into buffer 0; Q's first two pieces of
 * a split call fill the buffers from 0 on, and tile 0 follows them; its
 * third piece stays in team memory past the buffers and their flags
 * (FA_MMA_FWD_Q2). Only piece 0 of a non-finite value is non-finite, so
 * only V's piece 0 is scanned. */
#define FA_MMA_FWD_Q2(BK, P, NQK, NV) (2 * ((NQK) + (NV)) * (BK) * (P) + 16) /* element of Q's piece 2 */
/* Team memory of the forward team with NQK and NV pieces (1 and 1: bf16/f16, BK FA_MMA_BK; else
 * FA_MMA_SPLIT_BK) */
#define FA_MMA_FWD_SMEM(D, NQK, NV)                                                                                \
  ((NQK) > 2   ? (size_t)(FA_MMA_FWD_Q2(FA_MMA_SPLIT_BK(D), (D) + 8, NQK, NV) + FA_MMA_ROWS * ((D) + 8)) * 2      \
   : (NQK) > 1 ? (size_t)(2 * ((NQK) + (NV)) * FA_MMA_SPLIT_BK(D) * ((D) + 8)) * 2 + 4 * sizeof(unsigned)      \
               : (size_t)(2 * ((NQK) + (NV)) * FA_MMA_BK(D) * ((D) + 8)) * 2 + 4 * sizeof(unsigned))
static inline __attribute__((always_inline)) void fa_mma_fwd_team_of(const int D, const int BK, const int f16,
                                                                      const int NQK, const int NV,
                                                                      const fa_gpu_fwd_args ga, fa_block blk,
                                                                      int64_t h, int64_t g, unsigned short *smem) {
  const int P = D + 8; /* pitch: rows 16 bytes apart modulo 128, so ldmatrix is conflict-free */
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_smem sm = fa_smem_of(smem);
  const int buf0 = 0, buf1 = buf0 + (NQK + NV) * BK * P; /* element offsets of the two K/V buffers */
  unsigned *vbad = (unsigned *)(smem + buf0 + 2 * (NQK + NV) * BK * P); /* per-warp flags of non-finite V rows */
  const fa_range *seg = ga.seg;
  const fa_pair *pair = ga.pair;
  const int64_t qshift = ga.qshift;
  const float mul = ga.scale * FA_LOG2E;

  /* Q (64 rows a piece): into buffer 1 while tile 0 streams into buffer 0, or, split, from buffer 0 on */
  const int qat = NQK == 1 ? buf1 : buf0, q2at = FA_MMA_FWD_Q2(BK, P, NQK, NV);
  if (NQK == 1) fa_mma_load_rows(sm, qat, P, FA_MMA_ROWS, D, ga.q, blk.start, blk.len, h, tid);
#pragma unroll
  for (int p = 0; p < (NQK > 1 ? NQK : 0); p++)
    fa_mma_load_rows(sm, p < 2 ? qat + p * FA_MMA_ROWS * P : q2at, P, FA_MMA_ROWS, D, fa_dev_piece(ga.q, ga.pstride[0], p),
                     blk.start, blk.len, h, tid);
  fa_cp_async_commit();
  fa_tile_walk w = fa_walk_first(ga.qoff, seg, pair, blk, qshift);
  if (NQK == 1 && w.pi < w.pend) fa_fwd_load_tile(sm, buf0, P, BK, D, NQK, NV, &ga, g, w, tid);
  fa_cp_async_commit();
  fa_cp_async_wait(0);
  ompx_sync_block_acq_rel();
  fa_u4 qf[2][FA_MMA_MAX_D / 16]; /* fixed sizes: a VLA would be globalized (gpu_mma.h) */
  const int q2 = q2at + (warp * 16 + fa_ldsm_a_row(lane)) * P + fa_ldsm_a_col(lane); /* this lane's piece 2 */
  {
    const int r = warp * 16 + fa_ldsm_a_row(lane), c = fa_ldsm_a_col(lane);
#pragma unroll
    for (int p = 0; p < (NQK < 2 ? NQK : 2); p++)
#pragma unroll
      for (int ks = 0; ks < D / 16; ks++)
        qf[p][ks] = fa_ldmatrix_x4(sm, qat + p * FA_MMA_ROWS * P + r * P + ks * 16 + c, 0);
    ompx_sync_block_acq_rel(); /* Q's buffers are free for tile 1's K (and, split, tile 0) */
  }
  if (NQK > 1) {
    if (w.pi < w.pend) fa_fwd_load_tile(sm, buf0, P, BK, D, NQK, NV, &ga, g, w, tid);
    fa_cp_async_commit();
  }

  /* Software pipeline: K runs one tile ahead of V, so S of tile j + 1 is
   * multiplied while tile j's softmax and P V run; the two chains are
   * independent and their instructions interleave (2 warps a scheduler
   * cannot hide the softmax's latency alone). Buffer i holds K then V:
   * in iteration j, K(j+1) and V(j) are read, K(j+2) and V(j+1) stream in. */
  fa_tile_walk w1 = fa_walk_next(w, BK, seg, pair, blk, qshift);
  if (w1.pi < w1.pend) fa_fwd_load_pieces(sm, buf1, P, BK, D, NQK, &ga, 1, g, w1, tid);
  fa_cp_async_commit();
  if (NQK > 1) { /* tile 0 (the group before tile 1's K) landed */
    fa_cp_async_wait(1);
    ompx_sync_block_acq_rel();
  }
  fa_f4 s[FA_MMA_MAX_BK / 8], sn[FA_MMA_MAX_BK / 8];
  if (w.pi < w.pend) fa_mma_qk_pieces(s, qf, q2, NQK, sm, buf0, P, BK, D, f16, lane);

  fa_f4 o[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) o[n] = fa_f4_zero();
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0); /* elements x; z is 8 rows down */
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  int bad0 = 0, bad1 = 0; /* the row sees a non-finite V row of a masked tile */
  const int qfirst = (int)(blk.start + qshift); /* key-frame position of the block's first row */
  const int q_pos0 = qfirst + r0, q_pos1 = q_pos0 + 8;
  int cur = 0; /* tile j's buffer */

  while (w.pi < w.pend) {
    fa_cp_async_wait(0); /* K(j+1), V(j) */
    ompx_sync_block_acq_rel(); /* ... visible, and iteration j - 1's reads of K(j), V(j-1) done */
    const int kt = cur ? buf1 : buf0, kn = cur ? buf0 : buf1, vt = kt + NQK * BK * P;
    const fa_tile_walk w2 = fa_walk_next(w1, BK, seg, pair, blk, qshift);
    fa_fwd_load_next(sm, kt, kn + NQK * BK * P, P, BK, D, NQK, NV, &ga, g, w1, w2, tid);
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, q_pos0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, q_pos1, w.kb, nk);
    /* Only a causal tile crossing the team's first diagonal hides keys from
     * some rows; there 0 * NaN in P V would leak a non-finite V row into rows
     * that cannot see it, so its non-finite V rows are flagged and zeroed. */
    const int masked = fa_tile_hides_keys(w, BK, qfirst);
    unsigned long long vflags = 0; /* bit j: V row j of the tile was non-finite */
    if (masked) vflags = fa_mma_scan_rows(smem + vt, P, BK, D, f16, vbad, tid);

    float mx0 = -INFINITY, mx1 = -INFINITY;
    fa_fwd_tile_max(s, BK, fa_tile_all_visible(w, nk, BK, qfirst + warp * 16), c0, lim0, lim1, vflags, 0, &mx0, &mx1,
                    &bad0, &bad1);
    /* S of tile j + 1 (after the last tile: tile j's K again, discarded, so
     * no branch splits this block from the softmax it overlaps) */
    fa_mma_qk_pieces(sn, qf, q2, NQK, sm, w1.pi < w1.pend ? kn : kt, P, BK, D, f16, lane);
    float a0, a1;
    fa_fwd_tile_exp(s, BK, mx0, mx1, mul, &m0, &m1, &l0, &l1, &a0, &a1);
    fa_fwd_rescale(o, D, a0, a1);

    /* O += P V: P from the S accumulators (two n-tiles make one A fragment). */
    fa_mma_pv_pieces(o, s, NV, sm, vt, P, BK, D, f16, lane);
#pragma unroll
    for (int n = 0; n < BK / 8; n++) s[n] = sn[n];
    cur ^= 1;
    w = w1;
    w1 = w2;
  }

  fa_fwd_finish(ga, o, D, blk.start + r0, h, c0, lane, ok0, ok1, m0, m1, l0, l1, bad0, bad1);
}

/* The mma.sync forward of bf16/f16 inputs, and of f32 inputs split at HIGH (3 pieces each) and MEDIUM (2)
 * precision. */
static inline __attribute__((always_inline)) void fa_mma_fwd_team(const int D, const int BK, const int f16,
                                                                   const fa_gpu_fwd_args ga, fa_block blk,
                                                                   int64_t h, int64_t g, unsigned short *smem) {
  fa_mma_fwd_team_of(D, BK, f16, 1, 1, ga, blk, h, g, smem);
}
static inline __attribute__((always_inline)) void fa_mma_fwd_team_f32_high(const int D, const int BK, const int f16,
                                                                            const fa_gpu_fwd_args ga, fa_block blk,
                                                                            int64_t h, int64_t g,
                                                                            unsigned short *smem) {
  fa_mma_fwd_team_of(D, BK, f16, 3, 3, ga, blk, h, g, smem);
}
static inline __attribute__((always_inline)) void fa_mma_fwd_team_f32_medium(const int D, const int BK,
                                                                              const int f16,
                                                                              const fa_gpu_fwd_args ga,
                                                                              fa_block blk, int64_t h, int64_t g,
                                                                              unsigned short *smem) {
  fa_mma_fwd_team_of(D, BK, f16, 2, 2, ga, blk, h, g, smem);
}

/* The two-warpgroup wgmma forward (sm_90a, bulk tensor copies required).
 * One team of FA_WG_PAIR_THREADS: FA_WG_PAIR_ROWS query rows of block blk,
 * warpgroup wg owning rows [64 wg, 64 wg + 64) with its own Q tile; the
 * two share every K/V tile, so each tile is copied once for 128 rows, and
 * tiles are FA_WG_PAIR_BK keys: twice a 64-key tile, halving the per-tile
 * work (waits, walk, reductions, release) per key.
 *
 * Tiles stream through S = FA_WG_PAIR_FWD_STAGES(D) buffers (K then V of one tile
 * each), tile t in buffer t % S, arriving on that buffer's mbarrier `full`.
 * In iteration j a warpgroup releases tile j - 2's buffer (the second
 * warpgroup to release it, by a counter in team memory, issues tile
 * j - 2 + S's copies into it, so no thread ever waits for the other
 * warpgroup to let a copy start), issues S(j) = Q K(j)^T and
 * O += P(j-1) V(j-1) together, waits for S(j), runs tile j's softmax while
 * P V runs, then waits for P V and rescales O. No product group is left pending across
 * the loop's back-edge, and iteration 0 multiplies P(-1) = 0 by
 * zeros (buffer S - 1's V, "tile -1", released like any tile): a product
 * or a wait under a branch makes ptxas serialize every wgmma of the kernel
 * (C7518). FlashAttention-3's ping-pong (the warpgroups taking turns to
 * issue their products, by named barriers) does not pay here: the softmax
 * outlasts the other warpgroup's products, and the turns only add waits.
 *
 * A tile that hides keys from some of the team's rows (causal, crossing the
 * team's first diagonal) or holds fewer than BK keys (the copy brings the
 * rows after the pair's keys, or zeros past the tensor) is scanned by the
 * whole team (fa_mma_scan_rows_by, 64 rows at a time) before either
 * warpgroup's P V reads it: its non-finite V rows are zeroed and flagged,
 * so 0 * NaN cannot reach a row that does not see them. K rows past a
 * tile's keys are masked. */
/* Buffers: as many as fit beside the Q tiles in the H100/H200's 227 KB of team memory. */
#define FA_WG_PAIR_FWD_STAGES(D) ((D) == 128 ? 3 : 5)
/* Team memory: two 64-row Q tiles, the ring (gpu_tile_ring.h), room to align the tiles. */
#define FA_WG_PAIR_FWD_SMEM(D)                                                                                         \
  ((size_t)(FA_WG_PAIR_ROWS + 2 * FA_WG_PAIR_FWD_STAGES(D) * FA_WG_PAIR_BK) * (D) * 2 +                         \
   FA_TILE_RING_BYTES(FA_WG_PAIR_FWD_STAGES(D)) +                                                               \
   FA_WG_BLOCK_BYTES)

/* The forward team's ring in its (aligned) team memory. */
static inline fa_tile_ring fa_wg_pair_fwd_ring(const int D, const int BK, unsigned short *smem) {
  return fa_tile_ring_at(smem, FA_WG_PAIR_ROWS * D, 2 * BK * D, FA_WG_PAIR_FWD_STAGES(D));
}

/* Tile j of walk w (its K in the buffer at element kt) for one warpgroup of a two-warpgroup forward
 * team (fa_wg_pair_fwd_team, and its stream team in gpu_fwd_stream_team.h), its copies landed and
 * its buffer's release done: the team's scan of V where the tile hides keys from some row (unless
 * vscan is 0: V's check found it finite, gpu_finite_check.h), S(j) and
 * P(j - 1) V(j - 1) (V in ring buffer vb) issued together, the online-softmax step on S(j) while P V
 * runs, O rescaled and P(j) packed into pa. The lane's rows' state in m0 .. bad1. */
static inline __attribute__((always_inline)) void fa_wg_pair_fwd_tile(
    const int D, const int BK, const int f16, unsigned short *smem, fa_smem sm, fa_tile_ring rg,
    const fa_wg_pair_rows *t, fa_tile_walk w, int kt, int vb, int qt, int vscan, float mul, fa_f4 *s, fa_f4 *o, fa_u4 *pa,
    float *m0, float *m1, float *l0, float *l1, int *bad0, int *bad1, int *tl) {
  const int nk = fa_walk_keys(w, BK);
  unsigned long long vf[2] = {0, 0}; /* bit r: V row r (64 + r) of tile j was non-finite (zeroed) */
  if (vscan && (nk < BK || (w.causal && w.kb + BK - 1 > t->qfirst)))
    fa_tile_ring_scan(smem + kt + BK * D, BK, D, f16, rg, t->tid, vf);
  const fa_wg_pair_lims lim = fa_wg_pair_row_keys(t, w, nk);
  const int lim0 = lim.lim0, lim1 = lim.lim1;

  fa_wg_acc_abt(s, qt, sm, kt, BK, D, f16);
  fa_wg_commit();
  FA_TL_AT(tl, FA_TL_ISSUED_S);
  fa_wg_acc_ab(o, pa, sm, fa_tile_ring_buf(rg, vb) + BK * D, BK, BK, D, f16);
  fa_wg_commit();
  FA_TL_AT(tl, FA_TL_ISSUED);
  fa_wg_wait(1); /* S(j); P(j-1) V(j-1) runs on under the softmax */
  fa_wg_pin(s, BK / 8);
  FA_TL_AT(tl, FA_TL_S);

  float mx0 = -INFINITY, mx1 = -INFINITY, a0, a1;
  fa_fwd_tile_max(s, BK, nk == BK && (!w.causal || w.kb + BK - 1 <= t->wfirst), t->c0, lim0, lim1, vf[0], vf[1], &mx0,
                  &mx1, bad0, bad1);
  FA_TL_AT(tl, FA_TL_MAX);
  fa_fwd_tile_exp(s, BK, mx0, mx1, mul, m0, m1, l0, l1, &a0, &a1);
  FA_TL_AT(tl, FA_TL_EXP);
  fa_wg_wait(0);
  fa_wg_pin(o, D / 8);
  fa_wg_pin_u4(pa, BK / 16);
  FA_TL_AT(tl, FA_TL_PV);
  fa_fwd_rescale(o, D, a0, a1);
  fa_wg_pack(pa, s, BK, f16);
}

static inline __attribute__((always_inline)) void fa_wg_pair_fwd_team(const int D, const int BK, const int f16,
                                                                      const fa_gpu_fwd_args ga, fa_block blk,
                                                                      int64_t h, int64_t g, unsigned short *smem) {
  const int S = FA_WG_PAIR_FWD_STAGES(D);
  fa_wg_pair_rows t = fa_wg_pair_rows_of();
  const int tid = t.tid, wg = t.wg, wt = t.wt, lane = t.lane;
  smem += fa_wg_align(fa_smem_of(smem));
  const fa_smem sm = fa_smem_of(smem);
  const int qt = wg * FA_MMA_ROWS * D; /* element offset of this warpgroup's Q tile; the ring follows both */
  const fa_tile_ring rg = fa_wg_pair_fwd_ring(D, BK, smem);
  const fa_tma_map *tma = ga.tma;
  const fa_range *seg = ga.seg;
  const fa_pair *pair = ga.pair;
  const int64_t qshift = ga.qshift;
  const fa_wg_pair_walk k = {rg, tma, ga.qoff, seg, pair, blk, qshift, g, BK, D};
  const float mul = ga.scale * FA_LOG2E;
  const int vscan = ga.v_nonfinite ? *ga.v_nonfinite : 1;
  const int64_t qrows = fa_wg_pair_qrows(&t, blk); /* may be <= 0 or past 64 */
  FA_TL_DECL;
  FA_TL(FA_TL_START);
  FA_TL(FA_TL_BEGIN);

  fa_wg_pair_load_rows(sm, &t, qt, D, &ga.q, &blk, fa_wg_pair_nq(&t, blk), h);
  fa_cp_async_commit();
  fa_tile_walk w = fa_wg_pair_first(&k);
  /* tiles 0 .. S - 2 (buffer S - 1 holds "tile -1"); wl: thread 0 of each warpgroup's next tile to copy
   * (tile j - 1 + S in iteration j) */
  fa_tile_walk wl = fa_wg_pair_ring_start(&k, sm, S - 1, w);
  const int zt = fa_tile_ring_buf(rg, S - 1) + BK * D; /* V of buffer S - 1: zeros, "tile -1" */
  const fa_u4 z4 = {0, 0, 0, 0};
  for (int e = tid * 8; e < BK * D; e += FA_WG_PAIR_THREADS * 8) fa_store_u4(smem + zt + e, z4);
  fa_wg_pair_tiles_ready(); /* Q and the zeros */
  FA_TL(FA_TL_READY);

  fa_f4 s[FA_WG_PAIR_BK / 8], o[FA_MMA_MAX_D / 8];
  fa_u4 pa[FA_WG_PAIR_BK / 16]; /* P(j - 1), packed */
#pragma unroll
  for (int n = 0; n < D / 8; n++) o[n] = fa_f4_zero();
#pragma unroll
  for (int n = 0; n < BK / 16; n++) pa[n] = z4;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  fa_wg_pair_lane_rows(&t, blk);
  const int r0 = t.r0, c0 = t.c0, ok0 = t.ok0, ok1 = t.ok1;
  int bad0 = 0, bad1 = 0;
  fa_wg_pair_positions(&t, blk, qshift);
  int j = 0, b = 0, bp = S - 1, bpp = S - 1; /* tile j's buffer, tile j - 1's, tile j - 2's */

  while (w.pi < w.pend) {
    const int kt = fa_tile_ring_buf(rg, b);
    FA_TL(FA_TL_TILE);
    fa_wg_pair_wait(&k, sm, b, j);
    FA_TL(FA_TL_ARRIVED);
    /* tile j - 2's buffer (its P V waited for in iteration j - 1) is free for this warpgroup; the second to
     * say so copies tile j - 2 + S into it. Here warp 0's release work (~500 cycles, which the other warps
     * waited for at the products' issue when it followed P V's wait) falls in the time the products wait
     * for the other warpgroup's anyway (in-kernel timeline) */
    if (wt == 0 && j > 0) wl = fa_wg_pair_release(&k, sm, bpp, &wl);
    fa_wg_pair_fwd_tile(D, BK, f16, smem, sm, rg, &t, w, kt, bp, qt, vscan, mul, s, o, pa, &m0, &m1, &l0, &l1, &bad0, &bad1,
                        FA_TL_REF);
    w = fa_wg_pair_next(&k, w);
    bpp = bp;
    bp = b;
    b = fa_wg_pair_next_buf(&k, b);
    j++;
    FA_TL(FA_TL_NEXT);
  }
  /* P V of the last tile (no tile: P(-1) = 0 times the zeros) */
  fa_wg_acc_ab(o, pa, sm, fa_tile_ring_buf(rg, bp) + BK * D, BK, BK, D, f16);
  fa_wg_commit();
  fa_wg_wait(0);
  fa_wg_pin(o, D / 8);
  FA_TL(FA_TL_PV);
  float inv[2];
  int bad[2] = {bad0, bad1};
  fa_fwd_finish_rows(ga, blk.start + r0, h, c0, lane, ok0, ok1, m0, m1, l0, l1, inv, bad);
  /* O through this warpgroup's Q tile: its last reader, S of the last tile, has retired */
  fa_wg_store_rows_staged(ga.o, blk.start + wg * FA_MMA_ROWS, qrows, h, o, D, smem + qt, wt, inv[0], inv[1], bad[0],
                          bad[1], 1 + wg);
  FA_TL(FA_TL_FINISH);
  FA_TL(FA_TL_END);
}
#pragma omp end declare target

#endif
