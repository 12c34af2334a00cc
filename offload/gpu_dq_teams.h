/* The dQ team functions (one query block x one query head), in a header so
 * the host tests can run them under the SIMT emulation of gpu_mma.h
 * (tests/test_mma_emulated.c); launched by gpu_tc_bwd_launch.c. Each composes
 * the K/V loads (gpu_mma_tiles.h, or the tile ring of gpu_tile_ring.h),
 * S and dP products, the gradient steps of gpu_grad_step.h, dQ += dS K and
 * a store (gpu_epilogue.h):
 *   fa_mma_dq_team  mma.sync, 64 rows, K/V double-buffered by cp.async
 *   fa_mma_dq_split_team  the same of f32 inputs split into bf16 pieces
 *   fa_wg_pair_dq_team  two warpgroups, 128 rows, 128-key tiles by bulk copies */
#ifndef FORKATTN_GPU_DQ_TEAMS_H
#define FORKATTN_GPU_DQ_TEAMS_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"
#include "gpu_bwd.h"
#include "gpu_epilogue.h"
#include "gpu_grad_step.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_products.h"
#include "gpu_tile_ring.h"
#include "gpu_timeline.h"
#include "gpu_tma.h"
#include "gpu_wg_pair_team.h"
#include "gpu_wgmma.h"
#include "gpu_work_scheduler.h"

#pragma omp declare target
/* The mma.sync dQ (any sm_80+ build). One team: FA_MMA_ROWS query rows of
 * block blk, query head h, KV head g; K and V tiles double-buffered by
 * cp.async into padded rows, read by ldmatrix. */
static inline __attribute__((always_inline)) void fa_mma_dq_team(const int D, const int BK, const int f16,
                                                                  const fa_gpu_bwd b, fa_block blk, int64_t h,
                                                                  int64_t g, unsigned short *smem) {
  const int P = D + 8;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets; each: K [BK][P], V [BK][P] */
  const int buf0 = 0, buf1 = buf0 + 2 * BK * P;
  unsigned *kbad = (unsigned *)(smem + buf0 + 4 * BK * P);
  const fa_range *seg = b.seg;
  const fa_pair *pair = b.pair;
  const int64_t qshift = b.qshift;
  const float mul = b.scale * FA_LOG2E;

  /* Q and dO (64 rows each) fill the team memory first; the walk starts after. */
  fa_mma_load_rows(sm, 0, P, FA_MMA_ROWS, D, b.q, blk.start, blk.len, h, tid);
  fa_mma_load_rows(sm, FA_MMA_ROWS * P, P, FA_MMA_ROWS, D, b.dout, blk.start, blk.len, h, tid);
  fa_cp_async_commit();
  fa_cp_async_wait(0);
  ompx_sync_block_acq_rel();
  fa_u4 qf[FA_MMA_MAX_D / 16], of[FA_MMA_MAX_D / 16];
  {
    const int r = warp * 16 + fa_ldsm_a_row(lane), c = fa_ldsm_a_col(lane);
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
      qf[ks] = fa_ldmatrix_x4(sm, r * P + ks * 16 + c, 0);
      of[ks] = fa_ldmatrix_x4(sm, (FA_MMA_ROWS + r) * P + ks * 16 + c, 0);
    }
  }
  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  float dd0, dd1;
  fa_dq_rowsum(b, blk, 0, h, smem + FA_MMA_ROWS * P, P, D, f16, warp, lane, &dd0, &dd1);
  ompx_sync_block_acq_rel();

  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int64_t row0 = blk.start + r0;
  const int qfirst = (int)(blk.start + qshift); /* key-frame position of the block's first row */
  const int q_pos0 = qfirst + r0, q_pos1 = q_pos0 + 8;
  const float lse0 = fa_row_lse_log2(&b, ok0, row0, h), lse1 = fa_row_lse_log2(&b, ok1, row0 + 8, h);
  fa_f4 dq[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;

  fa_tile_walk w = fa_walk_first(b.qoff, seg, pair, blk, qshift);
  if (w.pi < w.pend) fa_mma_load_kv(sm, buf0, P, BK, D, b.k, g, b.v, g, w, tid);
  fa_cp_async_commit();
  int cur = 0;
  /* The walk runs a tile ahead of the loads: tile j + 1's position (nx) is
   * known when iteration j starts, and tile j + 2's is computed after tile
   * j's S and dP are issued, so the plan reads it takes (global memory) do
   * not stall the copies in front of the products (ncu; dQ -6 % at case 2).
   * Issuing the copies after the products instead, as the dK/dV team does,
   * is slower here. */
  fa_tile_walk nx = fa_walk_next(w, BK, seg, pair, blk, qshift);
  while (w.pi < w.pend) {
    const int kt = cur ? buf1 : buf0; /* K [BK][P], then V */
    /* Tile j landed and every warp is done with iteration j - 1 (its products
     * waited for), so tile j + 1 may stream into that buffer: one barrier a
     * tile. */
    fa_mma_tile_ready(0, 0);
    if (nx.pi < nx.pend) fa_mma_load_kv(sm, cur ? buf0 : buf1, P, BK, D, b.k, g, b.v, g, nx, tid);
    fa_cp_async_commit();
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, q_pos0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, q_pos1, w.kb, nk);
    /* dQ += dS K multiplies masked keys' rows by dS = 0: non-finite K rows of a
     * tile that hides keys from some rows are zeroed and flagged (fa_mma_scan_rows). */
    const int masked = fa_tile_hides_keys(w, BK, qfirst);
    const unsigned long long kflags = masked ? fa_mma_scan_rows(smem + kt, P, BK, D, f16, kbad, tid) : 0;

    fa_f4 s[FA_MMA_MAX_BK / 8], dp[FA_MMA_MAX_BK / 8];
    fa_mma_sdp(s, dp, qf, of, sm, kt, P, BK, D, f16, lane);
    const fa_tile_walk nx2 = fa_walk_next(nx, BK, seg, pair, blk, qshift);
    /* P = exp2(S - lse), then dS = P (dP - D), where visible; an exact 0
     * elsewhere (a select, not a product; vis0 / vis1: bit 2n + i for column
     * 8n + c0 + i of rows r0, r0 + 8). A tile whose keys every row of this
     * warp sees (warp-uniform, as in the forward) skips the masks. */
    unsigned vis0, vis1;
    fa_dq_tile_p(s, BK, fa_tile_all_visible(w, nk, BK, qfirst + warp * 16), kflags, c0, lim0, lim1, mul, lse0, lse1,
                 &vis0, &vis1, &bad0, &bad1);
    fa_dq_tile_ds(s, dp, 0, BK / 8, vis0, vis1, dd0, dd1);
    fa_mma_acc_ab(dq, s, sm, kt, P, BK, D, f16, lane); /* dQ += dS K, K of [key][dim] */
    cur ^= 1;
    w = nx;
    nx = nx2;
  }
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  fa_mma_store_rows(b.dq, row0, h, dq, D, c0, ok0, ok1, b.scale, b.scale, bad0, bad1);
}

/* The mma.sync dQ of f32 inputs split into NP bf16 pieces (lib/core/split_bf16.h; b.pieces and the
 * views b.pq, b.pk, b.pv, b.pdo): fa_mma_dq_team's walk with S = Q K^T and dP = dO V^T multiplied from
 * the pieces (Q's piece 0 in registers, and dO's at head_dim 64; the others read from team memory a
 * k-step at a time: fa_mma_qk_split_rest, fa_mma_abt_pieces_sa), dQ += dS K with dS split in registers (fa_mma_pv_pieces), D given
 * (dsum_ready: the f32 rowsum ran before the launch) and dQ stored in f32. BK: FA_MMA_SPLIT_BK(D).
 * Team memory (FA_MMA_DQ_SPLIT_SMEM): Q's NP pieces [64][P], dO's, two buffers of K's NP pieces
 * [BK][P] then V's, the scan flags. Only piece 0 of a non-finite value is non-finite, so a masked
 * tile's scan reads K's piece 0 alone. */
#define FA_MMA_DQ_SPLIT_SMEM(D, NP)                                                                             \
  ((size_t)(2 * (NP) * FA_MMA_ROWS + 4 * (NP) * FA_MMA_SPLIT_BK(D)) * ((D) + 8) * 2 + 4 * sizeof(unsigned))

static inline __attribute__((always_inline)) void fa_mma_dq_split_team(const int D, const int BK, const int NP,
                                                                        const fa_gpu_bwd b, fa_block blk, int64_t h,
                                                                        int64_t g, unsigned short *smem) {
  const int P = D + 8, RP = FA_MMA_ROWS * P, TP = BK * P;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets: Q's pieces, dO's, the two K/V buffers */
  const int qt = 0, ot = NP * RP, buf0 = 2 * NP * RP, buf1 = buf0 + 2 * NP * TP;
  unsigned *kbad = (unsigned *)(smem + buf1 + 2 * NP * TP);
  const fa_range *seg = b.seg;
  const fa_pair *pair = b.pair;
  const int64_t qshift = b.qshift;
  const float mul = b.scale * FA_LOG2E;

  fa_mma_load_pieces(sm, qt, RP, NP, P, FA_MMA_ROWS, D, b.pq, b.pstride[0], blk.start, blk.len, h, tid);
  fa_mma_load_pieces(sm, ot, RP, NP, P, FA_MMA_ROWS, D, b.pdo, b.pstride[3], blk.start, blk.len, h, tid);
  fa_tile_walk w = fa_walk_first(b.qoff, seg, pair, blk, qshift);
  if (w.pi < w.pend) fa_mma_load_kv_pieces(sm, buf0, P, BK, D, b.pk, b.pstride[1], g, NP, b.pv, b.pstride[2], g, NP, w, tid);
  fa_cp_async_commit();
  fa_cp_async_wait(0);
  ompx_sync_block_acq_rel();
  /* this lane's A address in a 64-row tile; piece 0 of Q and (head_dim 64) of dO as fragments: at 128
   * dO's beside dQ's accumulators spilled */
  const int al = (warp * 16 + fa_ldsm_a_row(lane)) * P + fa_ldsm_a_col(lane), oreg = D < 128;
  fa_u4 qf[FA_MMA_MAX_D / 16], of[FA_MMA_MAX_D / 16];
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
    qf[ks] = fa_ldmatrix_x4(sm, qt + al + ks * 16, 0);
    if (oreg) of[ks] = fa_ldmatrix_x4(sm, ot + al + ks * 16, 0);
  }
  const int q1 = qt + RP + al, q2 = qt + 2 * RP + al, o1 = ot + RP + al, o2 = ot + 2 * RP + al;

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int64_t row0 = blk.start + r0;
  const int qfirst = (int)(blk.start + qshift); /* key-frame position of the block's first row */
  const int q_pos0 = qfirst + r0, q_pos1 = q_pos0 + 8;
  const float lse0 = fa_row_lse_log2(&b, ok0, row0, h), lse1 = fa_row_lse_log2(&b, ok1, row0 + 8, h);
  const float dd0 = fa_row_d(&b, ok0, row0, h), dd1 = fa_row_d(&b, ok1, row0 + 8, h);
  fa_f4 dq[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, cur = 0;

  fa_tile_walk nx = fa_walk_next(w, BK, seg, pair, blk, qshift);
  while (w.pi < w.pend) {
    const int kt = cur ? buf1 : buf0, vt = kt + NP * TP; /* K's pieces, then V's */
    fa_mma_tile_ready(0, 0); /* tile j landed; iteration j - 1 is done with the other buffer */
    if (nx.pi < nx.pend)
      fa_mma_load_kv_pieces(sm, cur ? buf0 : buf1, P, BK, D, b.pk, b.pstride[1], g, NP, b.pv, b.pstride[2], g, NP, nx, tid);
    fa_cp_async_commit();
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, q_pos0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, q_pos1, w.kb, nk);
    const unsigned long long kflags = fa_tile_hides_keys(w, BK, qfirst) ? fa_mma_scan_rows(smem + kt, P, BK, D, 0, kbad, tid) : 0;

    fa_f4 s[FA_MMA_MAX_BK / 8], dp[FA_MMA_MAX_BK / 8];
    fa_mma_qk(s, qf, sm, kt, P, BK, D, 0, lane);
    fa_mma_qk_split_rest(s, qf, q1, q2, NP, sm, kt, P, BK, D, lane);
    if (oreg) {
      fa_mma_qk(dp, of, sm, vt, P, BK, D, 0, lane);
      fa_mma_qk_split_rest(dp, of, o1, o2, NP, sm, vt, P, BK, D, lane);
    } else {
      fa_mma_abt_pieces_sa(dp, sm, ot + al, RP, NP, vt, P, BK, D, lane);
    }
    const fa_tile_walk nx2 = fa_walk_next(nx, BK, seg, pair, blk, qshift);
    unsigned vis0, vis1;
    fa_dq_tile_p(s, BK, fa_tile_all_visible(w, nk, BK, qfirst + warp * 16), kflags, c0, lim0, lim1, mul, lse0, lse1,
                 &vis0, &vis1, &bad0, &bad1);
    fa_dq_tile_ds(s, dp, 0, BK / 8, vis0, vis1, dd0, dd1);
    fa_mma_pv_pieces_rn(dq, s, NP, sm, kt, P, BK, D, lane); /* dQ += dS K, K's pieces of [key][dim] */
    cur ^= 1;
    w = nx;
    nx = nx2;
  }
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  fa_mma_store_rows(b.dq, row0, h, dq, D, c0, ok0, ok1, b.scale, b.scale, bad0, bad1);
}

/* The split dQ at HIGH (3 pieces) and MEDIUM (2) precision, with a query team's signature. */
static inline __attribute__((always_inline)) void fa_mma_dq_team_f32_high(const int D, const int BK, const int f16,
                                                                           const fa_gpu_bwd b, fa_block blk,
                                                                           int64_t h, int64_t g,
                                                                           unsigned short *smem) {
  (void)f16;
  fa_mma_dq_split_team(D, BK, 3, b, blk, h, g, smem);
}
static inline __attribute__((always_inline)) void fa_mma_dq_team_f32_medium(const int D, const int BK, const int f16,
                                                                             const fa_gpu_bwd b, fa_block blk,
                                                                             int64_t h, int64_t g,
                                                                             unsigned short *smem) {
  (void)f16;
  fa_mma_dq_split_team(D, BK, 2, b, blk, h, g, smem);
}

/* The two-warpgroup wgmma dQ (sm_90a, bulk tensor copies required; the
 * team shape of gpu_tile_ring.h). One team: FA_WG_PAIR_ROWS query rows of block blk,
 * warpgroup wg owning rows [64 wg, 64 wg + 64) with its own Q and dO
 * tiles; both read every 128-key K/V tile. A tile is taken in two 64-key
 * halves (S, dP and their dS of 128 keys at once would not fit the
 * registers beside dQ's accumulator): S_h and dP_h issued together, P_h
 * formed while dP_h runs, then dQ += dS_h K_h in 32-key parts, each part's
 * product running while the next part's dS is formed. Every group is
 * retired before the next half's products are issued (a wgmma issued while
 * others that followed non-wgmma writes to its registers are in flight
 * makes ptxas serialize them) and before the loop's back-edge. A tile that
 * hides keys from some of the team's rows, or holds fewer than BK keys,
 * has its non-finite K rows zeroed and flagged by the whole team first
 * (dS = 0 times such a row would be NaN). */
#define FA_WG_PAIR_DQ_STAGES(D) ((D) == 128 ? 2 : 5)
#define FA_WG_PAIR_DQ_HALF 64 /* keys a half tile (its S and dP: m64n64 products) */
#define FA_WG_PAIR_DQ_PART 32 /* keys a part of a half's dQ += dS K */
/* Team memory: the Q and dO tiles of both warpgroups, the ring (gpu_tile_ring.h), alignment room. */
#define FA_WG_PAIR_DQ_SMEM(D)                                                                                          \
  ((size_t)(2 * FA_WG_PAIR_ROWS + 2 * FA_WG_PAIR_DQ_STAGES(D) * FA_WG_PAIR_BK) * (D) * 2 +                      \
   FA_TILE_RING_BYTES(FA_WG_PAIR_DQ_STAGES(D)) + FA_WG_BLOCK_BYTES)

/* The dQ team's ring in its (aligned) team memory. */
static inline fa_tile_ring fa_wg_pair_dq_ring(const int D, const int BK, unsigned short *smem) {
  return fa_tile_ring_at(smem, 2 * FA_WG_PAIR_ROWS * D, 2 * BK * D, FA_WG_PAIR_DQ_STAGES(D));
}

static inline __attribute__((always_inline)) void fa_wg_pair_dq_team(const int D, const int BK, const int f16,
                                                                     const fa_gpu_bwd b, fa_block blk, int64_t h,
                                                                     int64_t g, unsigned short *smem) {
  const int S = FA_WG_PAIR_DQ_STAGES(D), KP = FA_WG_PAIR_DQ_PART, HK = FA_WG_PAIR_DQ_HALF;
  fa_wg_pair_rows t = fa_wg_pair_rows_of();
  const int tid = t.tid, wg = t.wg, wt = t.wt, warp = t.warp, lane = t.lane;
  smem += fa_wg_align(fa_smem_of(smem));
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets of this warpgroup's Q and dO tiles; the ring follows both warpgroups' */
  const int qt = wg * FA_MMA_ROWS * D, ot = (2 + wg) * FA_MMA_ROWS * D;
  const fa_tile_ring rg = fa_wg_pair_dq_ring(D, BK, smem);
  const fa_tma_map *tma = b.kv_tma;
  const fa_range *seg = b.seg;
  const fa_pair *pair = b.pair;
  const int64_t qshift = b.qshift;
  const fa_wg_pair_walk k = {rg, tma, b.qoff, seg, pair, blk, qshift, g, BK, D};
  const float mul = b.scale * FA_LOG2E;
  const int64_t nq = fa_wg_pair_nq(&t, blk);
  FA_TL_DECL;
  FA_TL(FA_TL_START);
  FA_TL(FA_TL_BEGIN);

  fa_mma_load_rows(sm, qt, D, FA_MMA_ROWS, D, b.q, blk.start + wg * FA_MMA_ROWS, nq, h, wt);
  fa_mma_load_rows(sm, ot, D, FA_MMA_ROWS, D, b.dout, blk.start + wg * FA_MMA_ROWS, nq, h, wt);
  fa_cp_async_commit();
  fa_tile_walk w = fa_wg_pair_first(&k);
  /* tiles 0 .. S - 1; wl: thread 0 of each warpgroup's next tile to copy (tile j + S after iteration j) */
  fa_tile_walk wl = fa_wg_pair_ring_start(&k, sm, S, w);
  /* O's rows for D and the rows' lse: loads in flight while the copies land */
  const fa_dq_orow ov = fa_dq_rowsum_load(b, blk, wg * FA_MMA_ROWS, h, D, warp, lane);
  fa_wg_pair_lane_rows(&t, blk);
  const int r0 = t.r0, c0 = t.c0, ok0 = t.ok0, ok1 = t.ok1;
  const int64_t row0 = blk.start + r0;
  const float lse0 = fa_row_lse_log2(&b, ok0, row0, h), lse1 = fa_row_lse_log2(&b, ok1, row0 + 8, h);
  fa_wg_pair_tiles_ready(); /* Q and dO */
  FA_TL(FA_TL_READY);

  float dd0, dd1;
  fa_dq_rowsum_of(b, blk, wg * FA_MMA_ROWS, h, &ov, smem + ot, D, D, f16, warp, lane, &dd0, &dd1);
  fa_wg_pair_positions(&t, blk, qshift);
  const int qfirst = t.qfirst, wfirst = t.wfirst;
  fa_f4 dq[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, j = 0, bi = 0; /* tile j, in buffer bi */

  while (w.pi < w.pend) {
    const int kt = fa_tile_ring_buf(rg, bi), vt = kt + BK * D;
    FA_TL(FA_TL_TILE);
    fa_wg_pair_wait(&k, sm, bi, j);
    FA_TL(FA_TL_ARRIVED);
    const int nk = fa_walk_keys(w, BK);
    unsigned long long kf[2] = {0, 0}; /* bit r: K row 64 h + r of tile j was non-finite (zeroed) */
    if (nk < BK || (w.causal && w.kb + BK - 1 > qfirst)) fa_tile_ring_scan(smem + kt, BK, D, f16, rg, tid, kf);
    const int all = nk == BK && (!w.causal || w.kb + BK - 1 <= wfirst);
    const fa_wg_pair_lims lim = fa_wg_pair_row_keys(&t, w, nk);
    const int lim0 = lim.lim0, lim1 = lim.lim1;
    fa_u4 pa[FA_WG_PAIR_DQ_HALF / 16];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      fa_f4 s[FA_WG_PAIR_DQ_HALF / 8], dp[FA_WG_PAIR_DQ_HALF / 8];
      fa_wg_acc_abt_of(s, qt, sm, kt + hh * HK * 64, HK, BK, D, f16);
      fa_wg_commit();
      fa_wg_acc_abt_of(dp, ot, sm, vt + hh * HK * 64, HK, BK, D, f16);
      fa_wg_commit();
      FA_TL(FA_TL_ISSUED);
      fa_wg_wait(1);
      fa_wg_pin(s, HK / 8);
      FA_TL(FA_TL_S);
      unsigned vis0, vis1;
      fa_dq_tile_p(s, HK, all, kf[hh], c0, lim0 - hh * HK, lim1 - hh * HK, mul, lse0, lse1, &vis0, &vis1, &bad0,
                   &bad1);
      fa_wg_wait(0);
      fa_wg_pin(dp, HK / 8);
      FA_TL(FA_TL_PV);
#pragma unroll
      for (int k0 = 0; k0 < HK; k0 += KP) {
        fa_dq_tile_ds(s, dp, k0 / 8, (k0 + KP) / 8, vis0, vis1, dd0, dd1);
        fa_wg_pack(pa + k0 / 16, s + k0 / 8, KP, f16);
        fa_wg_acc_ab(dq, pa + k0 / 16, sm, kt + (hh * HK + k0) * 64, KP, BK, D, f16); /* K read N-major */
        fa_wg_commit();
      }
      /* The first half's dS K runs on under the second half's S and dP (its
       * wait(1) retires it, the groups retiring in order); only the second
       * half's is waited for here, none being left pending across the
       * loop's back-edge. hh is a constant after unrolling, so no
       * wait sits under a branch (C7518). */
      if (hh == 1) {
        fa_wg_wait(0);
        fa_wg_pin(dq, D / 8);
        fa_wg_pin_u4(pa, HK / 16);
      }
    }
    /* tile j's buffer is free for this warpgroup; the second to say so copies tile j + S into it */
    if (wt == 0) wl = fa_tile_ring_release(sm, rg, bi, tma, g, wl, BK, D, seg, pair, blk, qshift);
    w = fa_wg_pair_next(&k, w);
    bi = fa_wg_pair_next_buf(&k, bi);
    j++;
    FA_TL(FA_TL_NEXT);
  }
  FA_TL(FA_TL_FINISH);
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  /* dQ through this warpgroup's Q tile: its last reader, S of the last tile, has retired */
  fa_wg_store_rows_staged(b.dq, blk.start + wg * FA_MMA_ROWS, nq, h, dq, D, smem + qt, wt, b.scale, b.scale, bad0, bad1,
                          1 + wg);
  FA_TL(FA_TL_END);
}
#pragma omp end declare target

#endif
