/* The dK/dV team functions (one key unit x one KV head), in a header so the
 * host tests can run them under the SIMT emulation of gpu_mma.h
 * (tests/test_mma_emulated.c); launched by gpu_tc_bwd_launch.c. Each composes
 * its K/V tile loads, the query-tile producer of gpu_dkv_loads.h, the
 * score products (gpu_products.h), the gradient steps of gpu_grad_step.h,
 * dV += P^T dO, dK += dS^T Q and the store of gpu_epilogue.h:
 *   fa_mma_dkv_team     mma.sync, key-major (S^T = K Q^T), 64 keys
 *   fa_mma_dkv_split_team  the same of f32 inputs split into bf16 pieces, two warp sets
 *   fa_wg_dkv_team      wgmma, key-major, 64 keys (head_dim 64, bulk copies)
 *   fa_wg_pair_dkv_query_major_team  two warpgroups, query-major (S = Q K^T), 128 keys,
 *                       query tiles through the ring of gpu_tile_ring.h */
#ifndef FORKATTN_GPU_DKV_TEAMS_H
#define FORKATTN_GPU_DKV_TEAMS_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"
#include "gpu_bwd.h"
#include "gpu_dkv_loads.h"
#include "gpu_epilogue.h"
#include "gpu_grad_step.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_products.h"
#include "gpu_tile_ring.h"
#include "gpu_timeline.h"
#include "gpu_tma.h"
#include "gpu_wgmma.h"
#include "gpu_work_scheduler.h"

#define FA_MMA_BQ 32 /* reader queries per dK/dV tile (16 with V in team memory) */

#pragma omp declare target
/* A dK/dV team accumulates dK and dV together. At head_dim 64 the K and V
 * fragments both live in registers (32-query tiles); at 128 (FA_MMA_DKV_V_IN_SMEM) V's tile
 * stays in team memory and its A fragments are read per 16-query tile: K and
 * V fragments in registers next to 64 + 64 accumulators spilled (ptxas: 160
 * local loads/stores per tile), and a dV pass plus a dK pass (5 products per
 * tile instead of 4) is slower.
 * Team memory at head_dim d: [V tile, vsm only] | three query buffers
 * (Q [BQ][P], dO [BQ][P]) | lse, D of each | scan flags. */
#define FA_MMA_DKV_V_IN_SMEM(d) ((d) == 128)
#define FA_MMA_DKV_BQ_OF(d) (FA_MMA_DKV_V_IN_SMEM(d) ? 16 : FA_MMA_BQ) /* queries a tile at head_dim d */
#define FA_MMA_DKV_SMEM(d)                                                                                      \
  ((size_t)((FA_MMA_DKV_V_IN_SMEM(d) ? FA_MMA_ROWS : 0) + 6 * FA_MMA_DKV_BQ_OF(d)) * ((d) + 8) * 2 +              \
   6 * FA_MMA_DKV_BQ_OF(d) * sizeof(float) + 4 * sizeof(unsigned))

static inline __attribute__((always_inline)) void fa_mma_dkv_team(const int D, const int f16, const fa_gpu_bwd b,
                                                                   int64_t ui, int64_t g, unsigned short *smem) {
  const int vsm = FA_MMA_DKV_V_IN_SMEM(D), P = D + 8, BQ = vsm ? 16 : FA_MMA_BQ;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = b.hq / b.hkv, qshift = b.qshift;
  const float mul = b.scale * FA_LOG2E;
  /* team memory (FA_MMA_DKV_SMEM), element offsets */
  const fa_smem sm = fa_smem_of(smem);
  const int vtile = 0, qbuf0 = vsm ? FA_MMA_ROWS * P : 0, qbuf1 = qbuf0 + 2 * BQ * P;
  const int ld0 = qbuf0 + 6 * BQ * P; /* per buffer i: [BQ] lse, [BQ] D as floats at ld0 + 4 BQ i */
  unsigned *qbad = (unsigned *)(smem + ld0 + 12 * BQ);

  /* K goes through the query buffers (4 BQ = 64 rows with V in team memory,
   * 2 BQ otherwise) into registers: each warp's 16 keys as A fragments of
   * K Q^T; V likewise (A of V dO^T) unless it stays in team memory. */
  _Static_assert(2 * FA_MMA_BQ == FA_MMA_ROWS && 4 * 16 == FA_MMA_ROWS, "the query buffers hold one key block");
  const int kstage = qbuf0, vstage = vsm ? vtile : qbuf1;
  fa_mma_load_rows(sm, kstage, P, FA_MMA_ROWS, D, b.k, blk.start, blk.len, g, tid);
  fa_mma_load_rows(sm, vstage, P, FA_MMA_ROWS, D, b.v, blk.start, blk.len, g, tid);
  fa_cp_async_commit();
  fa_cp_async_wait(0);
  ompx_sync_block_acq_rel();
  fa_u4 kf[FA_MMA_MAX_D / 16], vf[FA_MMA_MAX_D / 16];
  const int ar = fa_ldsm_a_row(lane), ac = fa_ldsm_a_col(lane);
  const int vl = vstage + (warp * 16 + ar) * P + ac; /* this lane's row of the warp's V A fragments */
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
    kf[ks] = fa_ldmatrix_x4(sm, kstage + (warp * 16 + ar) * P + ks * 16 + ac, 0);
    if (!vsm) vf[ks] = fa_ldmatrix_x4(sm, vl + ks * 16, 0);
  }
  ompx_sync_block_acq_rel();

  fa_dkv_lane kl;
  fa_dkv_lane_of(&kl, tid, lane, blk, qshift);
  const int r0 = kl.r0, c0 = kl.c0, ok0 = kl.ok0, ok1 = kl.ok1, kfirst = kl.kfirst, qsh = kl.qsh;
  const int k_pos0 = kl.k_pos0, k_pos1 = kl.k_pos1;
  fa_f4 dk[FA_MMA_MAX_D / 8], dv[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dk[n] = fa_f4_zero(), dv[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;

  /* Software pipeline over three query buffers: S^T and dP^T of tile j + 1
   * (dependent chains of D / 16 products) are multiplied in the block that
   * holds tile j's dV and dK products, so the two overlap. Iteration j reads
   * buffers j (Q, dO of dV, dK) and j + 1 (S^T, dP^T) while j + 2 streams in. */
  const int qstep = 2 * BQ * P;
  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b.seg, b.pair, b.kidx, qshift, u, blk, group);
  if (w.j <= u.j1) fa_mma_load_queries(sm, qbuf0, ld0, P, D, BQ, &b, w, g * group + w.hh, tid);
  fa_cp_async_commit();
  fa_query_walk w1 = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
  if (w1.j <= u.j1) fa_mma_load_queries(sm, qbuf1, ld0 + 4 * BQ, P, D, BQ, &b, w1, g * group + w1.hh, tid);
  fa_cp_async_commit();
  fa_cp_async_wait(1);
  ompx_sync_block_acq_rel();
  fa_f4 s[FA_MMA_BQ / 8], dp[FA_MMA_BQ / 8]; /* 16 keys x BQ queries */
  if (w.j <= u.j1) fa_mma_dkv_scores(s, dp, kf, vf, vsm, vl, sm, qbuf0, P, BQ, D, f16, lane);
  int cb = 0; /* tile j's buffer; j + 1 is cb + 1 mod 3 */
  while (w.j <= u.j1) {
    fa_cp_async_wait(0); /* tile j + 1 */
    ompx_sync_block_acq_rel(); /* ... visible, and iteration j - 1's reads of buffer j + 2 done */
    const int nb = cb == 2 ? 0 : cb + 1, fb = nb == 2 ? 0 : nb + 1;
    const int qt = qbuf0 + cb * qstep, ot = qt + BQ * P;
    const float *ld = (const float *)(smem + ld0 + 4 * BQ * cb);
    const fa_query_walk w2 = fa_qwalk_next(w1, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    if (w2.j <= u.j1)
      fa_mma_load_queries(sm, qbuf0 + fb * qstep, ld0 + 4 * BQ * fb, P, D, BQ, &b, w2, g * group + w2.hh, tid);
    fa_cp_async_commit();
    int nq, lo0, lo1;
    const unsigned long long qflags = fa_dkv_tile_masks(smem, qt, ot, P, BQ, D, f16, qbad, w, qsh, kfirst, (int)blk.len,
                                                        ok0, ok1, k_pos0, k_pos1, tid, &nq, &lo0, &lo1);

    float lq[FA_MMA_BQ / 4], dd[FA_MMA_BQ / 4];
    fa_mma_dkv_rows(lq, dd, ld, BQ, c0);
    fa_mma_dkv_grads(s, dp, lq, dd, mul, nq, BQ, nq == BQ && (!w.causal || kfirst + warp * 16 + 15 <= w.qb + qsh),
                     lo0, lo1, c0, qflags, &bad0, &bad1);
    /* Tile j + 1's scores (after the last tile: tile j's rows again, discarded). */
    fa_f4 sn[FA_MMA_BQ / 8], dpn[FA_MMA_BQ / 8];
    fa_mma_dkv_scores(sn, dpn, kf, vf, vsm, vl, sm, w1.j <= u.j1 ? qbuf0 + nb * qstep : qt, P, BQ, D, f16, lane);
    fa_mma_dkv_acc(dv, dk, s, dp, sm, qt + ar * P + ac, P, BQ, D, f16);
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) s[n] = sn[n], dp[n] = dpn[n];
    cb = nb;
    w = w1;
    w1 = w2;
  }
  fa_mma_dkv_store(&b, ui, g, dk, dv, D, r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
}

/* The mma.sync key-major dK/dV of f32 inputs split into NP bf16 pieces (lib/core/split_bf16.h;
 * b.pieces and the views b.pq, b.pk, b.pv, b.pdo): fa_mma_dkv_team's unit walk, masks and gradient
 * steps on a team of two warp sets (FA_MMA_DKV_SPLIT_THREADS): warp w of set 0 multiplies S^T = K Q^T
 * for keys 16 w .. 16 w + 15 of the block and accumulates dV += P^T dO, its partner in set 1
 * dP^T = V dO^T and dK += dS^T Q. The partners exchange S^T and dP^T through team memory and both
 * form P^T and dS^T (elementwise, cheap), so each warp holds one 16 x D accumulator: one team of four
 * warps holding dK and dV spilled 450 bytes a thread at head_dim 128 (ptxas). Every A and B piece is
 * read from team memory a k-step at a time (fa_mma_abt_pieces_sa); P^T and dS^T are split in
 * registers for the products over dO's and Q's pieces (fa_mma_pv_pieces). Query tiles of
 * FA_MMA_DKV_BQ_OF(D) rows, double-buffered; set 0 copies Q's pieces and the rows' lse and D, set 1
 * dO's pieces. dK and dV (or the unit's partial sums) are stored in f32. Team memory
 * (FA_MMA_DKV_SPLIT_SMEM): K's NP pieces [64][P], V's, two buffers of Q's NP pieces [BQ][P] then
 * dO's, each buffer's lse and D, the exchange (both sets' accumulators), the scan flags. Only piece 0
 * of a non-finite value is non-finite, so a masked tile's scan reads Q's and dO's piece 0 alone. */
#define FA_MMA_DKV_SPLIT_THREADS (2 * FA_MMA_THREADS)
#define FA_MMA_DKV_SPLIT_SMEM(D, NP)                                                                            \
  ((size_t)(2 * (NP) * FA_MMA_ROWS + 4 * (NP) * FA_MMA_DKV_BQ_OF(D)) * ((D) + 8) * 2 +                          \
   4 * FA_MMA_DKV_BQ_OF(D) * sizeof(float) + 2 * FA_MMA_ROWS * FA_MMA_DKV_BQ_OF(D) * sizeof(float) +             \
   8 * sizeof(unsigned))

static inline __attribute__((always_inline)) void fa_mma_dkv_split_team(const int D, const int NP,
                                                                         const fa_gpu_bwd b, int64_t ui, int64_t g,
                                                                         unsigned short *smem) {
  const int P = D + 8, BQ = FA_MMA_DKV_BQ_OF(D), RP = FA_MMA_ROWS * P, TP = BQ * P, NT = FA_MMA_DKV_SPLIT_THREADS;
  const int tid = ompx_thread_id_x(), set = tid / FA_MMA_THREADS, stid = tid % FA_MMA_THREADS;
  const int warp = stid / 32, lane = tid % 32; /* warp: the 16 keys of the block this warp takes */
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = b.hq / b.hkv, qshift = b.qshift;
  const float mul = b.scale * FA_LOG2E;
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets: K's pieces, V's, the two query buffers (Q's pieces, then dO's), their lse and D,
   * the exchange ([set][warp][BQ / 8][lane] float4) */
  const int kt = 0, vt = NP * RP, qbuf0 = 2 * NP * RP, qstep = 2 * NP * TP;
  const int ld0 = qbuf0 + 2 * qstep; /* per buffer i: [BQ] lse, [BQ] D as floats at ld0 + 4 BQ i */
  fa_f4 *xch = (fa_f4 *)(smem + ld0 + 8 * BQ);
  unsigned *qbad = (unsigned *)(smem + ld0 + 8 * BQ + 4 * FA_MMA_ROWS * BQ);
  /* this set's half of a query tile's copies: Q's pieces and the rows' lse and D, or dO's pieces */
#define FA_DKV_SPLIT_LOAD(AT, LD, W)                                                                            \
  do {                                                                                                         \
    const int nq_ = fa_qwalk_rows((W), BQ);                                                                    \
    const int64_t h_ = g * group + (W).hh;                                                                     \
    if (set == 0) {                                                                                            \
      fa_mma_load_pieces(sm, (AT), TP, NP, P, BQ, D, b.pq, b.pstride[0], (W).qb, nq_, h_, stid);               \
      fa_mma_load_query_stats(sm, (LD), BQ, &b, (W), h_, stid);                                                \
    } else {                                                                                                   \
      fa_mma_load_pieces(sm, (AT) + NP * TP, TP, NP, P, BQ, D, b.pdo, b.pstride[3], (W).qb, nq_, h_, stid);    \
    }                                                                                                          \
  } while (0)

  if (set == 0) fa_mma_load_pieces(sm, kt, RP, NP, P, FA_MMA_ROWS, D, b.pk, b.pstride[1], blk.start, blk.len, g, stid);
  else fa_mma_load_pieces(sm, vt, RP, NP, P, FA_MMA_ROWS, D, b.pv, b.pstride[2], blk.start, blk.len, g, stid);
  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b.seg, b.pair, b.kidx, qshift, u, blk, group);
  if (w.j <= u.j1) FA_DKV_SPLIT_LOAD(qbuf0, ld0, w);
  fa_cp_async_commit();
  /* this lane's A address in a 64-row tile (its warp's 16 keys) */
  const int al = (warp * 16 + fa_ldsm_a_row(lane)) * P + fa_ldsm_a_col(lane);

  fa_dkv_lane kl;
  fa_dkv_lane_of(&kl, stid, lane, blk, qshift);
  const int r0 = kl.r0, c0 = kl.c0, ok0 = kl.ok0, ok1 = kl.ok1, kfirst = kl.kfirst, qsh = kl.qsh;
  const int k_pos0 = kl.k_pos0, k_pos1 = kl.k_pos1;
  fa_f4 acc[FA_MMA_MAX_D / 8]; /* set 0: dV; set 1: dK */
#pragma unroll
  for (int n = 0; n < D / 8; n++) acc[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, cb = 0;
  while (w.j <= u.j1) {
    const int qt = qbuf0 + cb * qstep, ot = qt + NP * TP;
    const float *ld = (const float *)(smem + ld0 + 4 * BQ * cb);
    fa_cp_async_wait(0);
    ompx_sync_block_acq_rel(); /* tile j landed; iteration j - 1 is done with the other buffer */
    const fa_query_walk w1 = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    if (w1.j <= u.j1) FA_DKV_SPLIT_LOAD(qbuf0 + (cb ^ 1) * qstep, ld0 + 4 * BQ * (cb ^ 1), w1);
    fa_cp_async_commit();
    /* the masks (fa_dkv_tile_masks, by the whole team of both sets) */
    const int nq = fa_qwalk_rows(w, BQ);
    const int lo0 = fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, nq);
    const int lo1 = fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, nq);
    const unsigned long long qflags =
        w.causal && w.qb + qsh < kfirst + (int)blk.len - 1
            ? fa_mma_scan_rows_by(smem + qt, P, BQ, 0, BQ, D, 0, qbad, tid, NT) |
                  fa_mma_scan_rows_by(smem + ot, P, BQ, 0, BQ, D, 0, qbad, tid, NT)
            : 0;
    /* set 0: S^T = K Q^T; set 1: dP^T = V dO^T; exchanged */
    fa_f4 x[FA_MMA_BQ / 8], s[FA_MMA_BQ / 8], dp[FA_MMA_BQ / 8];
    fa_mma_abt_pieces_sa(x, sm, (set ? vt : kt) + al, RP, NP, set ? ot : qt, P, BQ, D, lane);
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) xch[((set * 4 + warp) * (BQ / 8) + n) * 32 + lane] = x[n];
    ompx_sync_block_acq_rel();
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) {
      const fa_f4 y = xch[(((set ^ 1) * 4 + warp) * (BQ / 8) + n) * 32 + lane];
      s[n] = set ? y : x[n];
      dp[n] = set ? x[n] : y;
    }
    float lq[FA_MMA_BQ / 4], dd[FA_MMA_BQ / 4];
    fa_mma_dkv_rows(lq, dd, ld, BQ, c0);
    fa_mma_dkv_grads(s, dp, lq, dd, mul, nq, BQ, nq == BQ && (!w.causal || kfirst + warp * 16 + 15 <= w.qb + qsh),
                     lo0, lo1, c0, qflags, &bad0, &bad1);
    /* set 0: dV += P^T dO; set 1: dK += dS^T Q */
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) x[n] = set ? dp[n] : s[n];
    fa_mma_pv_pieces_rn(acc, x, NP, sm, set ? qt : ot, P, BQ, D, lane);
    cb ^= 1;
    w = w1;
  }
#undef FA_DKV_SPLIT_LOAD
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  /* set 0 stores dV, set 1 dK (the unit's partial sums when its block has several units) */
  const int part = b.part_k != NULL;
  const int64_t slot = (ui * b.hkv + g) * b.krows * b.d, row = part ? r0 : k_pos0, head = part ? 0 : g;
  const fa_dev_tensor t = part ? fa_mma_part_view((set ? b.part_k : b.part_v) + slot, b.d) : set ? b.dk : b.dv;
  const float m = set ? b.scale : 1.0f;
  fa_mma_store_rows(t, row, head, acc, D, c0, ok0, ok1, m, m, bad0, bad1);
}

/* The split dK/dV at HIGH (3 pieces) and MEDIUM (2) precision, with a dK/dV team's signature. */
static inline __attribute__((always_inline)) void fa_mma_dkv_team_f32_high(const int D, const int f16,
                                                                            const fa_gpu_bwd b, int64_t ui,
                                                                            int64_t g, unsigned short *smem) {
  (void)f16;
  fa_mma_dkv_split_team(D, 3, b, ui, g, smem);
}
static inline __attribute__((always_inline)) void fa_mma_dkv_team_f32_medium(const int D, const int f16,
                                                                              const fa_gpu_bwd b, int64_t ui,
                                                                              int64_t g, unsigned short *smem) {
  (void)f16;
  fa_mma_dkv_split_team(D, 2, b, ui, g, smem);
}

/* The key-major wgmma dK/dV team (sm_90a builds, head_dim 64, Q's and dO's
 * tensor maps; host tests under the emulation): the
 * same unit walk, masks, flags and stores as fa_mma_dkv_team, with K's and
 * V's 64-key tiles kept in team memory as the A operands of S^T = K Q^T and
 * dP^T = V dO^T (read through descriptors: register A fragments that outlive
 * a wgmma are not safe, fa_wg_acc_abt), and dV += P^T dO, dK += dS^T Q with
 * P^T and dS^T packed from registers, in two parts of CQ queries: part
 * c's dV and dK products (one group) run while part c + 1's P^T and dS^T
 * are formed, then one wait. Query tiles of
 * FA_WG_DKV_BQ rows, double-buffered (the next tile streams in during this
 * one); each product group is waited before registers it reads are
 * rewritten. Three buffers with tile j + 1's S^T and dP^T issued with tile
 * j's dV and dK (so tile j + 1's dS^T overlaps them) are correct but a third
 * to a half slower. Team memory
 * (FA_WG_DKV_SMEM, elements from a 1024-byte aligned base): K | V | two
 * (Q, dO) buffers | lse, D of each | scan flags. */
#define FA_WG_DKV_BQ 64                 /* queries a tile */
#define FA_WG_DKV_CQ (FA_WG_DKV_BQ / 2) /* queries a part of the dV and dK products */
#define FA_WG_DKV_SMEM(d)                                                                                       \
  ((size_t)(2 * FA_MMA_ROWS + 4 * FA_WG_DKV_BQ) * (d) * 2 + 4 * FA_WG_DKV_BQ * sizeof(float) +                  \
   4 * sizeof(unsigned) + 16 + FA_WG_BLOCK_BYTES)

static inline __attribute__((always_inline)) void fa_wg_dkv_team(const int D, const int f16, const fa_gpu_bwd b,
                                                                  int64_t ui, int64_t g, unsigned short *smem) {
  const int P = D, BQ = FA_WG_DKV_BQ, CQ = FA_WG_DKV_CQ; /* P == D: the wgmma layout in the loads and the scans */
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = (int)b.hq / (int)b.hkv, qshift = b.qshift; /* 32-bit: a 64-bit division is a call (C7509) */
  const float mul = b.scale * FA_LOG2E;
  smem += fa_wg_align(fa_smem_of(smem)); /* swizzled tiles start 1024-byte aligned */
  const fa_smem sm = fa_smem_of(smem);
  const int ktile = 0, vtile = FA_MMA_ROWS * P, qbuf0 = 2 * FA_MMA_ROWS * P, qstep = 2 * BQ * P;
  const int ld0 = qbuf0 + 2 * qstep; /* per buffer i: [BQ] lse, [BQ] D as floats at ld0 + 4 BQ i */
  unsigned *qbad = (unsigned *)(smem + ld0 + 8 * BQ);
  /* A tile of BQ queries comes by bulk tensor copies (b.tma: Q's, dO's maps)
   * that thread 0 issues, completing on the mbarrier after the flags; a
   * shorter tile (its rows past the queries must be zeros: 0 * NaN in dV and
   * dK) and every tile's lse and D come by cp.async. */
  const fa_tma_map *tma = b.tma;
  const int mbar = ld0 + 8 * BQ + 8;
  int phase = 0; /* the mbarrier's phase of this iteration's bulk copies */
  if (tid == 0) fa_mbar_init(sm, mbar, 1); /* visible after the first iteration's barrier */

  fa_query_walk w = fa_wg_dkv_start(sm, ktile, vtile, qbuf0, ld0, D, BQ, &b, u, blk, g, group, tid);

  fa_dkv_lane kl;
  fa_dkv_lane_of(&kl, tid, lane, blk, qshift);
  const int r0 = kl.r0, c0 = kl.c0, ok0 = kl.ok0, ok1 = kl.ok1, kfirst = kl.kfirst, qsh = kl.qsh;
  const int k_pos0 = kl.k_pos0, k_pos1 = kl.k_pos1;
  fa_f4 dk[FA_MMA_MAX_D / 8], dv[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dk[n] = fa_f4_zero(), dv[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;
  int cb = 0;
  while (w.j <= u.j1) {
    fa_cp_async_wait(0); /* tile j (and at first K, V) */
    if (phase) fa_mbar_wait(sm, mbar, (phase - 1) & 1); /* ... those that came by bulk copies */
    fa_fence_proxy_async();
    ompx_sync_block_acq_rel(); /* ... visible, and iteration j - 1's reads of the other buffer done */
    const int qt = qbuf0 + cb * qstep, ot = qt + BQ * P;
    const float *ld = (const float *)(smem + ld0 + 4 * BQ * cb);
    int nq, lo0, lo1;
    const unsigned long long qflags = fa_dkv_tile_masks(smem, qt, ot, P, BQ, D, f16, qbad, w, qsh, kfirst, (int)blk.len,
                                                        ok0, ok1, k_pos0, k_pos1, tid, &nq, &lo0, &lo1);
    fa_f4 s[FA_MMA_MAX_BK / 8], dp[FA_MMA_MAX_BK / 8]; /* 16 keys x BQ queries */
    const int all = nq == BQ && (!w.causal || kfirst + warp * 16 + 15 <= w.qb + qsh);
    float lq[FA_MMA_MAX_BK / 4], dd[FA_MMA_MAX_BK / 4];
    fa_u4 pa[FA_MMA_MAX_BK / 16], da[FA_MMA_MAX_BK / 16];
    fa_wg_acc_abt(s, ktile, sm, qt, BQ, D, f16);  /* S^T = K Q^T */
    fa_wg_acc_abt(dp, vtile, sm, ot, BQ, D, f16); /* dP^T = V dO^T */
    fa_wg_commit();
    /* While the products run: tile j + 1's position (plan reads from global
     * memory: issued before the products, their latency stalled the address
     * arithmetic in front of S^T and dP^T, ncu), its copies into the buffer
     * iteration j - 1 read, this tile's lse and D. */
    const fa_query_walk w1 = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    const int nxt = qbuf0 + (cb ^ 1) * qstep, nld = ld0 + 4 * BQ * (cb ^ 1), h1 = (int)(g * group) + w1.hh;
    const int bulk = w1.j <= u.j1 && w1.qend - w1.qb >= BQ;
    if (tid == 0) {
      fa_mbar_expect_tx(sm, mbar, bulk * 2 * BQ * D * 2); /* 0 bytes: completes at once */
      if (bulk) {
        fa_tma_tile(sm, nxt, tma, h1, w1.qb, BQ, D, mbar);
        fa_tma_tile(sm, nxt + BQ * P, tma + 1, h1, w1.qb, BQ, D, mbar);
      }
    }
    if (bulk) fa_mma_load_query_stats(sm, nld, BQ, &b, w1, h1, tid);
    else if (w1.j <= u.j1) fa_mma_load_queries(sm, nxt, nld, P, D, BQ, &b, w1, h1, tid);
    phase++;
    fa_cp_async_commit();
    fa_mma_dkv_rows(lq, dd, ld, BQ, c0);
    fa_wg_wait(0);
    fa_wg_pin(s, BQ / 8);
    fa_wg_pin(dp, BQ / 8);
    /* In CQ-query parts: part c's dV and dK products run while part c + 1's
     * P^T and dS^T are formed (its own registers: a group's A stays intact
     * until the wait). */
#pragma unroll
    for (int c = 0; c < BQ / CQ; c++) {
      const int q0 = c * CQ;
      fa_mma_dkv_grads(s + q0 / 8, dp + q0 / 8, lq + q0 / 4, dd + q0 / 4, mul, nq - q0, CQ, all, lo0 - q0, lo1 - q0,
                       c0, qflags >> q0, &bad0, &bad1);
      fa_wg_pack(pa + q0 / 16, s + q0 / 8, CQ, f16); /* P^T */
      fa_wg_pack(da + q0 / 16, dp + q0 / 8, CQ, f16); /* dS^T */
      fa_wg_acc_ab(dv, pa + q0 / 16, sm, ot + q0 * 64, CQ, BQ, D, f16); /* dV += P^T dO, dO of [query][dim] N-major */
      fa_wg_acc_ab(dk, da + q0 / 16, sm, qt + q0 * 64, CQ, BQ, D, f16); /* dK += dS^T Q */
      fa_wg_commit();
    }
    fa_wg_wait(0);
    fa_wg_pin(dv, D / 8);
    fa_wg_pin(dk, D / 8);
    fa_wg_pin_u4(pa, BQ / 16);
    fa_wg_pin_u4(da, BQ / 16);
    cb ^= 1;
    w = w1;
  }
  fa_mma_dkv_store(&b, ui, g, dk, dv, D, r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
}

/* Queries a tile of the query-major dK/dV (the queries as the products' rows). */
#define FA_DKV_QUERY_MAJOR_BQ 64

/* The two-warpgroup query-major dK/dV (sm_90a, head_dim 128; Q's and dO's
 * tiles by bulk copies only; FlashAttention-3's layout): the same unit walk,
 * masks, flags and stores as fa_mma_dkv_team, but 64-query tiles with the
 * queries as the products' rows: S = Q K^T and dP = dO V^T are 64 x 64
 * (N = 64, the tensor cores' full rate) with each lane's lse and D two
 * rows' values; P and dS go to team memory as [query][key] tiles, read
 * transposed by dV += P^T dO and dK += dS^T Q (both operands MN-major). A
 * team of FA_WG_PAIR_THREADS per (unit of a key block of FA_WG_PAIR_ROWS
 * keys, KV head).
 * Warpgroup wg owns keys [64 wg, 64 wg + 64) with its own K, V, P and dS
 * tiles; the (Q, dO) tiles both read come once a team into a ring of
 * FA_WG_PAIR_DKV_STAGES buffers (gpu_tile_ring.h: the second warpgroup to release a
 * buffer refills it). Per tile and warpgroup: P and dS stored (stmatrix),
 * one proxy fence and one barrier of the warpgroup, the next tile waited
 * for and scanned, then in the warpgroup's turn (FlashAttention-3's
 * ping-pong: one warpgroup's P and dS are formed while the other's products
 * run) dV and dK issued together with the next tile's S and dP behind
 * them, one wait, and a second barrier of the warpgroup (every warp's
 * products retired before P, dS and the buffer are rewritten). P and dS
 * have a tile each, so dS does not wait for dV's products. lse and D come from global memory
 * into registers a tile ahead (two rows a lane). No team barrier but in
 * the scans: a tile with queries that some of the block's keys do not see,
 * or with fewer than 64 queries (its rows past them are the tensor's next
 * rows, or zeros past its end), has its non-finite Q and dO rows zeroed and
 * flagged by the whole team first. Team memory (FA_WG_PAIR_DKV_SMEM, elements
 * from a 1024-byte aligned base): K (two 64-row tiles) | V (two) | P, dS of
 * warpgroup 0, then of 1 | the ring. */
#ifndef FA_WG_PAIR_DKV_STAGES /* a build may set 2 (161 KB) or 4 (225 KB of the H200's 227) */
#define FA_WG_PAIR_DKV_STAGES 3
#endif
#define FA_WG_PAIR_DKV_SMEM(d)                                                                                      \
  ((size_t)(4 * FA_MMA_ROWS * (d) + 4 * FA_DKV_QUERY_MAJOR_BQ * 64 +                                             \
            2 * FA_WG_PAIR_DKV_STAGES * FA_DKV_QUERY_MAJOR_BQ * (d)) *                                          \
       2 +                                                                                                      \
   FA_TILE_RING_BYTES(FA_WG_PAIR_DKV_STAGES) + FA_WG_BLOCK_BYTES)

static inline __attribute__((always_inline)) void fa_wg_pair_dkv_query_major_team(const int D, const int f16,
                                                                                  const fa_gpu_bwd b, int64_t ui,
                                                                                  int64_t g, unsigned short *smem) {
  const int S = FA_WG_PAIR_DKV_STAGES, BQ = FA_DKV_QUERY_MAJOR_BQ;
  const int tid = ompx_thread_id_x(), wg = fa_warpgroup_of(tid), wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = (int)b.hq / (int)b.hkv, qshift = b.qshift; /* 32-bit: a 64-bit division is a call (C7509) */
  const float mul = b.scale * FA_LOG2E;
  smem += fa_wg_align(fa_smem_of(smem)); /* swizzled tiles start 1024-byte aligned */
  const fa_smem sm = fa_smem_of(smem);
  const int ktile = wg * FA_MMA_ROWS * D, vtile = (2 + wg) * FA_MMA_ROWS * D;
  const int ptile = 4 * FA_MMA_ROWS * D + wg * 2 * BQ * 64, dstile = ptile + BQ * 64;
  const fa_tile_ring rg = fa_tile_ring_at(smem, 4 * FA_MMA_ROWS * D + 4 * BQ * 64, 2 * BQ * D, S);
  const fa_tma_map *tma = b.tma;
  const int hg = (int)(g * group), qsh = (int)qshift;
  FA_TL_DECL;
  FA_TL(FA_TL_START);
  FA_TL(FA_TL_BEGIN);

  /* this warpgroup's keys; one with none loads zeros (from the block's first row, which exists) */
  const int64_t krest = blk.len - wg * FA_MMA_ROWS, nk = krest < 0 ? 0 : krest;
  const int64_t krow0 = nk ? blk.start + wg * FA_MMA_ROWS : blk.start;
  fa_mma_load_rows(sm, ktile, D, FA_MMA_ROWS, D, b.k, krow0, nk, g, wt);
  fa_mma_load_rows(sm, vtile, D, FA_MMA_ROWS, D, b.v, krow0, nk, g, wt);
  fa_cp_async_commit();
  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b.seg, b.pair, b.kidx, qshift, u, blk, group);
  fa_tile_ring_init(sm, rg, tid);
  /* tiles 0 .. S - 1; wl: thread 0 of each warpgroup's next tile to copy (tile j + S after iteration j) */
  fa_query_walk wl = w;
  if (wt == 0)
    for (int i = 0; i < S && wl.j <= u.j1; i++) {
      if (tid == 0) fa_tile_ring_copy(sm, rg, i, tma, hg + wl.hh, wl.qb, BQ, D);
      wl = fa_qwalk_next(wl, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    }
  fa_cp_async_wait(0);
  fa_fence_proxy_async(); /* K and V for the tensor cores' reads */
  ompx_sync_block_acq_rel();
  FA_TL(FA_TL_READY);

  /* lanes' rows: of S, dP (queries) and of this warpgroup's dK/dV (keys) */
  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int kfirst = (int)blk.start + wg * FA_MMA_ROWS; /* this warpgroup's first key (key frame) */
  const int ok0 = wg * FA_MMA_ROWS + r0 < blk.len, ok1 = wg * FA_MMA_ROWS + r0 + 8 < blk.len;
  const int k_pos0 = kfirst + r0, k_pos1 = k_pos0 + 8;
  const int klast = nk > FA_MMA_ROWS ? FA_MMA_ROWS - 1 : (int)nk - 1; /* its last key, of 0 .. 63 */
  fa_f4 dk[FA_MMA_MAX_D / 8], dv[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dk[n] = fa_f4_zero(), dv[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, j = 0, bi = 0; /* tile j, in buffer bi */
  fa_f4 s[8], dp[8]; /* 16 queries x 64 keys: S and dP of tile j, multiplied in iteration j - 1 */
  float st[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* tile j's lse and D (fa_wg_pair_dkv_stats) */
  unsigned long long qflags = 0;          /* tile j's non-finite Q/dO rows */
  if (w.j <= u.j1) {
    qflags = fa_wg_pair_dkv_next(st, &b, w, hg + w.hh, r0, sm, smem, rg, 0, 0, BQ, D, f16, blk, qsh, tid);
    if (wg == 1) fa_wg_turn_pass(3); /* warpgroup 0 takes the first turn */
  }
  /* no wgmma under a branch: ptxas then serializes every one of the kernel
   * (C7518); a unit without tiles multiplies what the buffer holds */
  fa_dkv_query_major_sdp(s, dp, sm, fa_tile_ring_buf(rg, 0), ktile, vtile, BQ, D, f16);
  fa_wg_commit();
  fa_wg_wait(0);
  while (w.j <= u.j1) {
    fa_wg_pin(s, 8);
    fa_wg_pin(dp, 8);
    FA_TL(FA_TL_TILE);
    const int qt = fa_tile_ring_buf(rg, bi), ot = qt + BQ * D;
    const int nq = fa_qwalk_rows(w, BQ);
    const int kq0 = kfirst - (w.qb + qsh);
    const int all = warp * 16 + 15 < nq && (!w.causal || klast + kq0 <= warp * 16);
    if (qflags) { /* the keys that see a non-finite row get NaN gradients */
      bad0 |= fa_wg_flag_from(qflags, fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, nq), nq);
      bad1 |= fa_wg_flag_from(qflags, fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, nq), nq);
    }
    fa_dkv_query_major_grads(s, dp, st[0] * FA_LOG2E, st[1] * FA_LOG2E, st[2], st[3], mul, all, r0, nq, w.causal, kq0,
                       c0);
    FA_TL(FA_TL_COMPUTED);
    fa_wg_store_tile(fa_wg_opaque(sm), ptile, s, warp, lane, f16);   /* P */
    fa_wg_store_tile(fa_wg_opaque(sm), dstile, dp, warp, lane, f16); /* dS */
    fa_fence_proxy_async();
    FA_TL(FA_TL_STORED);
    fa_wg_bar_sync(1 + wg, 128); /* the warpgroup's P and dS for its products */
    FA_TL(FA_TL_GRADS);
    const fa_query_walk w1 = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    const int more = w1.j <= u.j1, b1 = bi == S - 1 ? 0 : bi + 1;
    /* tile j + 1's lse and D (global loads, used next iteration), its buffer
     * waited for and scanned, before the turn: the scan's team barriers
     * cannot sit inside one */
    qflags = more ? fa_wg_pair_dkv_next(st, &b, w1, hg + w1.hh, r0, sm, smem, rg, b1, j + 1, BQ, D, f16, blk, qsh, tid)
                  : 0;
    FA_TL(FA_TL_NEXTQ);
    fa_wg_turn_wait(3 + wg);
    FA_TL(FA_TL_TURN);
    fa_wg_acc_atb_v(dv, fa_wg_opaque_at(sm, ptile), 0, fa_wg_opaque_at(sm, ot), 0, BQ, BQ, D, f16);  /* dV += P^T dO */
    fa_wg_acc_atb_v(dk, fa_wg_opaque_at(sm, dstile), 0, fa_wg_opaque_at(sm, qt), 0, BQ, BQ, D, f16); /* dK += dS^T Q */
    fa_wg_commit();
    /* tile j + 1's S and dP behind dV's and dK's products */
    const int nt = more ? fa_tile_ring_buf(rg, b1) : qt; /* else tile j's rows again, discarded */
    fa_dkv_query_major_sdp(s, dp, sm, nt, ktile, vtile, BQ, D, f16);
    fa_wg_commit();
    if (wg == 0 || more) fa_wg_turn_pass(4 - wg); /* warpgroup 1's last: none to take */
    FA_TL(FA_TL_ISSUED);
    fa_wg_wait(0);
    fa_wg_pin(dv, D / 8);
    fa_wg_pin(dk, D / 8);
    FA_TL(FA_TL_PV);
    fa_wg_bar_sync(1 + wg, 128); /* every warp's products retired: P, dS and buffer bi free */
    /* buffer bi is free for this warpgroup; the second to say so copies tile j + S into it */
    if (wt == 0 && wl.j <= u.j1) {
      if (fa_tile_ring_second(rg, bi)) fa_tile_ring_copy(sm, rg, bi, tma, hg + wl.hh, wl.qb, BQ, D);
      wl = fa_qwalk_next(wl, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    }
    w = w1;
    bi = b1;
    j++;
    FA_TL(FA_TL_NEXT);
  }
  FA_TL(FA_TL_FINISH);
  fa_mma_dkv_store(&b, ui, g, dk, dv, D, wg * FA_MMA_ROWS + r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
  FA_TL(FA_TL_END);
}
#pragma omp end declare target

#endif
