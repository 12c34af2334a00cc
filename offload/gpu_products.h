/* Product steps the teams compose, on top of the mma.sync primitives of
 * gpu_mma.h / gpu_mma_tiles.h and the wgmma ones of gpu_wgmma.h: the
 * forward's S = Q K^T (fa_mma_qk), the key-major dK/dV's S^T = K Q^T and
 * dP^T = V dO^T (fa_mma_dkv_scores), the query-major dK/dV's S = Q K^T and
 * dP = dO V^T by wgmma (fa_dkv_query_major_sdp), and a warp's P or dS tile stored
 * for the MN-major products that read it (fa_wg_store_tile). */
#ifndef FORKATTN_GPU_PRODUCTS_H
#define FORKATTN_GPU_PRODUCTS_H
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_wgmma.h"

#pragma omp declare target
/* s (16 rows x BK keys of one warp) = Q K^T: Q's A fragments qf, K the
 * tile at element kt of team memory, [BK][P] rows through ldmatrix. */
static inline __attribute__((always_inline)) void fa_mma_qk(fa_f4 *s, const fa_u4 *qf, fa_smem sm, int kt, int P,
                                                            int BK, int D, int f16, int lane) {
#pragma unroll
  for (int n = 0; n < BK / 8; n++) s[n] = fa_f4_zero();
  fa_mma_acc_abt(s, qf, sm, kt, P, BK, D, f16, lane);
}

/* fa_mma_qk of inputs split into NP bf16 pieces (lib/core/split_bf16.h):
 * Q's pieces 0 and 1 in fragments qf[p], piece 2 in team memory at this
 * lane's A address q2 (fa_mma_acc_abt_sa: 32 registers fewer, which the
 * head_dim 128 team spilled), K's pieces BK * P elements apart from kt.
 * NP 1: Q K^T; 2: Q0 K0 + Q0 K1 + Q1 K0 (bf16x3); 3: those and Q0 K2 +
 * Q2 K0 + Q1 K1 (bf16x6). */
static inline __attribute__((always_inline)) void fa_mma_qk_pieces(fa_f4 *s, const fa_u4 (*qf)[FA_MMA_MAX_D / 16],
                                                                   int q2, int NP, fa_smem sm, int kt, int P, int BK,
                                                                   int D, int f16, int lane) {
  fa_mma_qk(s, qf[0], sm, kt, P, BK, D, f16, lane);
  if (NP > 1) {
    fa_mma_acc_abt(s, qf[0], sm, kt + BK * P, P, BK, D, f16, lane);
    fa_mma_acc_abt(s, qf[1], sm, kt, P, BK, D, f16, lane);
  }
  if (NP > 2) {
    fa_mma_acc_abt(s, qf[0], sm, kt + 2 * BK * P, P, BK, D, f16, lane);
    fa_mma_acc_abt_sa(s, sm, q2, kt, P, BK, D, f16, lane);
    fa_mma_acc_abt(s, qf[1], sm, kt + BK * P, P, BK, D, f16, lane);
  }
}

/* The products of a split Q K^T (fa_mma_qk_pieces) past Q0 K0, for a team
 * that keeps only Q's piece 0 in registers (q0) and its pieces 1 and 2 in
 * team memory at this lane's A addresses q1, q2 (fa_mma_acc_abt_sa): acc +=
 * Q0 K1 + Q1 K0, and at NP 3 Q0 K2 + Q2 K0 + Q1 K1; K's pieces BK * P
 * elements apart from kt. The StreamKL forward, whose two sides' Q would
 * not fit registers twice over. */
static inline __attribute__((always_inline)) void fa_mma_qk_split_rest(fa_f4 *acc, const fa_u4 *q0, int q1, int q2,
                                                                       int NP, fa_smem sm, int kt, int P, int BK,
                                                                       int D, int lane) {
  fa_mma_acc_abt(acc, q0, sm, kt + BK * P, P, BK, D, 0, lane);
  fa_mma_acc_abt_sa(acc, sm, q1, kt, P, BK, D, 0, lane);
  if (NP > 2) {
    fa_mma_acc_abt(acc, q0, sm, kt + 2 * BK * P, P, BK, D, 0, lane);
    fa_mma_acc_abt_sa(acc, sm, q2, kt, P, BK, D, 0, lane);
    fa_mma_acc_abt_sa(acc, sm, q1, kt + BK * P, P, BK, D, 0, lane);
  }
}

/* acc = A B^T of inputs split into NP bf16 pieces with every A piece read from team memory
 * (fa_mma_acc_abt_sa: no fragments held in registers), piece p at this lane's A address
 * a0 + p * astep, B's pieces BK * P elements apart from bt; the products of fa_mma_qk_pieces. */
static inline __attribute__((always_inline)) void fa_mma_abt_pieces_sa(fa_f4 *acc, fa_smem sm, int a0, int astep,
                                                                       int NP, int bt, int P, int BK, int D,
                                                                       int lane) {
#pragma unroll
  for (int n = 0; n < BK / 8; n++) acc[n] = fa_f4_zero();
  fa_mma_acc_abt_sa(acc, sm, a0, bt, P, BK, D, 0, lane);
  if (NP > 1) {
    fa_mma_acc_abt_sa(acc, sm, a0, bt + BK * P, P, BK, D, 0, lane);
    fa_mma_acc_abt_sa(acc, sm, a0 + astep, bt, P, BK, D, 0, lane);
  }
  if (NP > 2) {
    fa_mma_acc_abt_sa(acc, sm, a0, bt + 2 * BK * P, P, BK, D, 0, lane);
    fa_mma_acc_abt_sa(acc, sm, a0 + 2 * astep, bt, P, BK, D, 0, lane);
    fa_mma_acc_abt_sa(acc, sm, a0 + astep, bt + BK * P, P, BK, D, 0, lane);
  }
}

/* O += P V with V split into NP pieces BK * P elements apart from vt: P's
 * accumulators s are packed to bf16 (fa_mma_acc_ab) as its piece 0, and
 * replaced by what each packing left for the next piece (s is consumed).
 * NP 2: P0 V0 + P0 V1 + P1 V0 (bf16x3); 3: P0 (V0 + V1 + V2) + P1 (V0 + V1)
 * + P2 V0 (bf16x6). */
static inline __attribute__((always_inline)) void fa_mma_pv_pieces(fa_f4 *o, fa_f4 *s, int NP, fa_smem sm, int vt,
                                                                   int P, int BK, int D, int f16, int lane) {
  fa_mma_acc_ab(o, s, sm, vt, P, BK, D, f16, lane);
  if (NP > 1) fa_mma_acc_ab(o, s, sm, vt + BK * P, P, BK, D, f16, lane);
  if (NP > 2) fa_mma_acc_ab(o, s, sm, vt + 2 * BK * P, P, BK, D, f16, lane);
  if (NP > 1) {
    fa_mma_split_rest(s, BK / 8);
    fa_mma_acc_ab(o, s, sm, vt, P, BK, D, f16, lane);
  }
  if (NP > 2) {
    fa_mma_acc_ab(o, s, sm, vt + BK * P, P, BK, D, f16, lane);
    fa_mma_split_rest(s, BK / 8);
    fa_mma_acc_ab(o, s, sm, vt, P, BK, D, f16, lane);
  }
}

/* fa_mma_pv_pieces into a zeroed tile accumulator that is then added to acc by float32 adds. The
 * tensor cores' accumulation truncates the aligned products toward zero, so a sum over thousands of
 * tiles in one accumulator drifts: the split dK of a 16384-row StreamKL call erred by 1e-4 of its
 * largest value, the float32 CUDA-core kernels by 1e-6 (H100). A tile's own sum is short; the long
 * one rounds to nearest. For the sums over a key's readers (dK, dV), where every query adds a
 * comparable term. */
static inline __attribute__((always_inline)) void fa_mma_pv_pieces_rn(fa_f4 *acc, fa_f4 *s, int NP, fa_smem sm, int vt,
                                                                      int P, int BK, int D, int lane) {
  fa_f4 t[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) t[n] = fa_f4_zero();
  fa_mma_pv_pieces(t, s, NP, sm, vt, P, BK, D, 0, lane);
#pragma unroll
  for (int n = 0; n < D / 8; n++)
    acc[n].x += t[n].x, acc[n].y += t[n].y, acc[n].z += t[n].z, acc[n].w += t[n].w;
}

/* S = Q K^T and dP = dO V^T of a warp's 16 rows x BK keys (the dQ teams):
 * Q's and dO's A fragments qf, of; K then V, [BK][P] each, at element kt.
 * One loop for both: as two fa_mma_acc_abt calls, ptxas orders the loads
 * differently and dQ runs slower. */
static inline __attribute__((always_inline)) void fa_mma_sdp(fa_f4 *s, fa_f4 *dp, const fa_u4 *qf, const fa_u4 *of,
                                                             fa_smem sm, int kt, int P, int BK, int D, int f16,
                                                             int lane) {
  const int kl = kt + fa_ldsm_b_row(lane) * P + fa_ldsm_b_col(lane); /* constant offsets from here fold */
#pragma unroll
  for (int n = 0; n < BK / 8; n++) s[n] = fa_f4_zero(), dp[n] = fa_f4_zero();
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
    for (int np = 0; np < BK / 16; np++) {
      const fa_u4 bk = fa_ldmatrix_x4(sm, kl + np * 16 * P + ks * 16, 0);
      const fa_u4 bv = fa_ldmatrix_x4(sm, kl + BK * P + np * 16 * P + ks * 16, 0);
      s[2 * np] = fa_mma_16816(s[2 * np], qf[ks], bk.x, bk.y, f16);
      s[2 * np + 1] = fa_mma_16816(s[2 * np + 1], qf[ks], bk.z, bk.w, f16);
      dp[2 * np] = fa_mma_16816(dp[2 * np], of[ks], bv.x, bv.y, f16);
      dp[2 * np + 1] = fa_mma_16816(dp[2 * np + 1], of[ks], bv.z, bv.w, f16);
    }
}

/* S^T (16 keys x BQ queries of one warp) = K Q^T and dP^T = V dO^T for the
 * query buffer at element qt (Q [BQ][P], then dO): K's A fragments kf, V's
 * vf or, when vsm, read from team memory at this lane's row vl. */
static inline __attribute__((always_inline)) void fa_mma_dkv_scores(fa_f4 *s, fa_f4 *dp, const fa_u4 *kf,
                                                                     const fa_u4 *vf, int vsm, int vl, fa_smem sm,
                                                                     int qt, int P, int BQ, int D, int f16,
                                                                     int lane) {
#pragma unroll
  for (int n = 0; n < BQ / 8; n++) s[n] = dp[n] = fa_f4_zero();
  fa_mma_acc_abt(s, kf, sm, qt, P, BQ, D, f16, lane); /* S^T = K Q^T */
  fa_u4 va[FA_MMA_MAX_D / 16];
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) va[ks] = vsm ? fa_ldmatrix_x4(sm, vl + ks * 16, 0) : vf[ks];
  fa_mma_acc_abt(dp, va, sm, qt + BQ * P, P, BQ, D, f16, lane); /* dP^T = V dO^T */
}

/* dV += P^T dO and dK += dS^T Q of a warp's 16 keys, P^T and dS^T in the
 * accumulators s and dp (16 keys x BQ queries), Q then dO [BQ][P] read
 * through ldmatrix .trans (B of [query][dim]) from al: the tile's element
 * plus this lane's ldmatrix row and column, so constant offsets fold. */
static inline __attribute__((always_inline)) void fa_mma_dkv_acc(fa_f4 *dv, fa_f4 *dk, const fa_f4 *s, const fa_f4 *dp,
                                                                 fa_smem sm, int al, int P, int BQ, int D, int f16) {
#pragma unroll
  for (int kk = 0; kk < BQ / 16; kk++) { /* 16 queries: the k-step of dV and dK */
    const fa_u4 pa = fa_mma_p_frag(s[2 * kk], s[2 * kk + 1], f16), da = fa_mma_p_frag(dp[2 * kk], dp[2 * kk + 1], f16);
#pragma unroll
    for (int np = 0; np < D / 16; np++) {
      const fa_u4 bo = fa_ldmatrix_x4(sm, al + BQ * P + kk * 16 * P + np * 16, 1);
      dv[2 * np] = fa_mma_16816(dv[2 * np], pa, bo.x, bo.y, f16);
      dv[2 * np + 1] = fa_mma_16816(dv[2 * np + 1], pa, bo.z, bo.w, f16);
      const fa_u4 bq = fa_ldmatrix_x4(sm, al + kk * 16 * P + np * 16, 1);
      dk[2 * np] = fa_mma_16816(dk[2 * np], da, bq.x, bq.y, f16);
      dk[2 * np + 1] = fa_mma_16816(dk[2 * np + 1], da, bq.z, bq.w, f16);
    }
  }
}

/* S = Q K^T and dP = dO V^T of the (Q, dO) tile at element qt (issued, not
 * committed). Each operand is taken through its own view of the team memory
 * (fa_wg_opaque_at): a product group's descriptors are then one base and
 * constant k-step offsets, where offsets from the team memory's base cost
 * ptxas ~8 instructions a product and spill. */
static inline __attribute__((always_inline)) void fa_dkv_query_major_sdp(fa_f4 *s, fa_f4 *dp, fa_smem sm, int qt,
                                                                         int ktile, int vtile, int BQ, int D, int f16) {
  fa_wg_acc_abt_v(s, fa_wg_opaque_at(sm, qt), 0, fa_wg_opaque_at(sm, ktile), 0, 64, 64, D, f16);           /* S */
  fa_wg_acc_abt_v(dp, fa_wg_opaque_at(sm, qt + BQ * D), 0, fa_wg_opaque_at(sm, vtile), 0, 64, 64, D, f16); /* dP */
}

/* One warp's 16 x 64 accumulators a, in the input type, into its 16 rows of
 * the [64][64] wgmma-layout tile at element tile, by four stmatrix: lane L
 * addresses row L % 8 (+ 8 for matrices 1, 3) of chunk 2i (+ 1 for matrices
 * 2, 3), swizzled by the row (16 scattered 4-byte stores a lane kept 16
 * addresses live and spilled). */
static inline __attribute__((always_inline)) void fa_wg_store_tile(fa_smem sm, int tile, const fa_f4 *a, int warp,
                                                                    int lane, int f16) {
  const int j = lane >> 3, row = warp * 16 + (lane & 7) + 8 * (j & 1), t = (j >> 1) ^ (lane & 7);
  const int base = tile + row * 64;
#pragma unroll
  for (int i = 0; i < 4; i++) fa_stmatrix_x4(sm, base + (((2 * i) ^ t) << 3), fa_mma_p_frag(a[2 * i], a[2 * i + 1], f16));
}
#pragma omp end declare target

#endif
