/* The tensor-core backward's team functions: dQ (one query block x one
 * query head) and dK/dV (one key unit x one KV head), in a header so the host
 * tests can run them under the SIMT emulation of gpu_mma.h
 * (tests/test_mma_emulated.c). Launched by gpu_mma_bwd.c. */
#ifndef FORKATTN_GPU_MMA_BWD_TEAM_H
#define FORKATTN_GPU_MMA_BWD_TEAM_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"
#include "gpu_bwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_timeline.h"
#include "gpu_tma.h"
#include "gpu_wg2.h"
#include "gpu_wgmma.h"

#define FA_MMA_BQ 32 /* reader queries per dK/dV tile (16 with V in team memory) */
#define FA_WG_DQ_BK 64 /* keys per tile of the wgmma dQ (S and dP m64n64 products) */
#define FA_WG_DQ_KP 32 /* keys a part of the wgmma dQ's dS K (fa_dq_team) */

#pragma omp declare target

/* ---- dQ ------------------------------------------------------------------ */

/* D = rowsum(dO * O) of this warp's 16 rows of a 64-row dO tile (team
 * memory at dot, pitch P; P == D: the wgmma layout) whose first row is row
 * trow0 of block blk, here instead of in a kernel of its own (a launch
 * costs tens of microseconds). Lanes 2i and 2i + 1 take the halves of row
 * i; O's 16-byte chunks are all requested before the first use (loaded one
 * element at a time, their latency stalled the team: ncu, v1.8). Stored for
 * the dK/dV pass, which runs after this kernel; returned in dd0, dd1 for
 * the lane's accumulator rows lane / 4 and + 8. */
typedef struct fa_dq_orow {
  fa_u4 v[FA_MMA_MAX_D / 16];
} fa_dq_orow;

/* fa_dq_rowsum's loads of O (half a row a lane), apart so that a team can
 * issue them before it waits for its own copies: their latency then
 * overlaps the copies' instead of following it (in-kernel timeline: ~4700
 * cycles from the two-warpgroup dQ's prologue barrier to its first tile). */
static inline __attribute__((always_inline)) fa_dq_orow fa_dq_rowsum_load(const fa_gpu_bwd b, fa_block blk, int trow0,
                                                                         int64_t h, int D, int warp, int lane) {
  const int rr = warp * 16 + lane / 2, half = (lane & 1) * (D / 2), in = trow0 + rr < blk.len;
  const unsigned short *orow =
      (const unsigned short *)b.o.data + (blk.start + (in ? trow0 + rr : 0)) * b.o.rs + h * b.o.hs + half;
  fa_dq_orow o;
#pragma unroll
  for (int i = 0; i < D / 16; i++) o.v[i] = fa_load_u4(orow + 8 * i);
  return o;
}

static inline __attribute__((always_inline)) void fa_dq_rowsum_of(const fa_gpu_bwd b, fa_block blk, int trow0,
                                                                  int64_t h, const fa_dq_orow *ov,
                                                                  const unsigned short *dot, int P, int D, int f16,
                                                                  int warp, int lane, float *dd0, float *dd1) {
  const int rr = warp * 16 + lane / 2, half = (lane & 1) * (D / 2), in = trow0 + rr < blk.len;
  float sum;
  if (b.dsum_ready) { /* D computed before the launch (lib/core/rowsum_exact.h) */
    sum = in ? b.dsum[(blk.start + trow0 + rr) * b.hq + h] : 0.0f;
  } else {
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 16; i++) {
      const fa_u4 dv = fa_load_u4(dot + (P == D ? fa_wg_elem(rr, half + 8 * i, FA_MMA_ROWS) : rr * P + half + 8 * i));
      s0 += fa_dot_b16x2(dv.x, ov->v[i].x, f16) + fa_dot_b16x2(dv.y, ov->v[i].y, f16);
      s1 += fa_dot_b16x2(dv.z, ov->v[i].z, f16) + fa_dot_b16x2(dv.w, ov->v[i].w, f16);
    }
    sum = in ? s0 + s1 : 0.0f;
    sum += fa_mma_shfl_xor(sum, 1);
    if (!(lane & 1) && in) b.dsum[(blk.start + trow0 + rr) * b.hq + h] = sum;
  }
  *dd0 = fa_mma_shfl_idx(sum, 2 * (lane / 4)); /* accumulator rows lane / 4 and + 8 */
  *dd1 = fa_mma_shfl_idx(sum, 2 * (lane / 4) + 16);
}

static inline __attribute__((always_inline)) void fa_dq_rowsum(const fa_gpu_bwd b, fa_block blk, int trow0, int64_t h,
                                                               const unsigned short *dot, int P, int D, int f16,
                                                               int warp, int lane, float *dd0, float *dd1) {
  const fa_dq_orow ov = fa_dq_rowsum_load(b, blk, trow0, h, D, warp, lane);
  fa_dq_rowsum_of(b, blk, trow0, h, &ov, dot, P, D, f16, warp, lane, dd0, dd1);
}

/* P = exp2(S - lse) of a warp's 16 rows x BK keys of S in s, where visible;
 * an exact 0 elsewhere (a select, not a product; vis0 / vis1: bit 2n + i for
 * column 8n + c0 + i of rows r0, r0 + 8). all: every row of the warp sees
 * every key (warp-uniform, as in the forward), so the masks are skipped.
 * kflags: the tile's non-finite K rows (fa_mma_scan_rows_by, zeroed); a row
 * that sees one is marked bad. */
static inline __attribute__((always_inline)) void fa_dq_tile_p(fa_f4 *s, int BK, int all, unsigned long long kflags,
                                                               int c0, int lim0, int lim1, float mul, float lse0,
                                                               float lse1, unsigned *vis0, unsigned *vis1, int *bad0,
                                                               int *bad1) {
  if (all) {
    *vis0 = *vis1 = ~0u;
    if (kflags) *bad0 = *bad1 = 1; /* every row of the warp sees the tile's non-finite K row */
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
      s[n].x = fa_mma_exp2(fmaf(s[n].x, mul, -lse0)), s[n].y = fa_mma_exp2(fmaf(s[n].y, mul, -lse0));
      s[n].z = fa_mma_exp2(fmaf(s[n].z, mul, -lse1)), s[n].w = fa_mma_exp2(fmaf(s[n].w, mul, -lse1));
    }
    return;
  }
  unsigned v0 = 0, v1 = 0;
  /* keys relative to the lane's first column c0: the comparisons and bit
   * tests take constants, and no per-key value stays live across the walk */
  const int e0 = lim0 - c0, e1 = lim1 - c0;
  const unsigned long long kf = kflags >> c0;
#pragma unroll
  for (int n = 0; n < BK / 8; n++) {
    const int key = n * 8; /* relative to c0 */
    const float t0 = fa_mma_score(s[n].x, mul, key, e0), t1 = fa_mma_score(s[n].y, mul, key + 1, e0);
    const float t2 = fa_mma_score(s[n].z, mul, key, e1), t3 = fa_mma_score(s[n].w, mul, key + 1, e1);
    if (kflags) {
      *bad0 |= (t0 != -INFINITY && (kf >> key & 1u)) || (t1 != -INFINITY && (kf >> (key + 1) & 1u));
      *bad1 |= (t2 != -INFINITY && (kf >> key & 1u)) || (t3 != -INFINITY && (kf >> (key + 1) & 1u));
    }
    v0 |= (unsigned)(t0 != -INFINITY) << 2 * n | (unsigned)(t1 != -INFINITY) << (2 * n + 1);
    v1 |= (unsigned)(t2 != -INFINITY) << 2 * n | (unsigned)(t3 != -INFINITY) << (2 * n + 1);
    s[n].x = t0 == -INFINITY ? 0.0f : fa_mma_exp2(t0 - lse0);
    s[n].y = t1 == -INFINITY ? 0.0f : fa_mma_exp2(t1 - lse0);
    s[n].z = t2 == -INFINITY ? 0.0f : fa_mma_exp2(t2 - lse1);
    s[n].w = t3 == -INFINITY ? 0.0f : fa_mma_exp2(t3 - lse1);
  }
  *vis0 = v0, *vis1 = v1;
}

/* dS = P (dP - D) in s for the fragments [n0, n1) (fa_dq_tile_p's P and vis). */
static inline __attribute__((always_inline)) void fa_dq_tile_ds(fa_f4 *s, const fa_f4 *dp, int n0, int n1,
                                                                unsigned vis0, unsigned vis1, float dd0, float dd1) {
#pragma unroll
  for (int n = n0; n < n1; n++) {
    s[n].x = vis0 >> 2 * n & 1u ? s[n].x * (dp[n].x - dd0) : 0.0f;
    s[n].y = vis0 >> (2 * n + 1) & 1u ? s[n].y * (dp[n].y - dd0) : 0.0f;
    s[n].z = vis1 >> 2 * n & 1u ? s[n].z * (dp[n].z - dd1) : 0.0f;
    s[n].w = vis1 >> (2 * n + 1) & 1u ? s[n].w * (dp[n].w - dd1) : 0.0f;
  }
}

/* One dQ team: FA_MMA_ROWS query rows of block blk, query head h, KV head g.
 * WG: S, dP and dQ += dS K by wgmma (gpu_wgmma.h; pitch P = D selects its
 * tile layout in the loads and the scan), else mma.sync. */
static inline __attribute__((always_inline)) void fa_dq_team(const int D, const int BK, const int f16, const int WG,
                                                              const fa_gpu_bwd b, fa_block blk, int64_t h, int64_t g,
                                                              unsigned short *smem) {
  const int P = WG ? D : D + 8;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  if (WG) smem += fa_wg_align(fa_smem_of(smem)); /* swizzled tiles start 1024-byte aligned */
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets; each: K [BK][P], V [BK][P]. WG keeps Q's and dO's tiles in front of them. */
  const int buf0 = WG ? 2 * FA_MMA_ROWS * P : 0, buf1 = buf0 + 2 * BK * P;
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
  if (WG) fa_fence_proxy_async(); /* the products read Q and dO from their tiles */
  ompx_sync_block_acq_rel();
  fa_u4 qf[FA_MMA_MAX_D / 16], of[FA_MMA_MAX_D / 16];
  if (!WG) {
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
  const float lse0 = ok0 ? b.lse[row0 * b.hq + h] * FA_LOG2E : 0.0f;
  const float lse1 = ok1 ? b.lse[(row0 + 8) * b.hq + h] * FA_LOG2E : 0.0f;
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
   * was slower here (+10 %, bench/NOTES-gpu.md v2.13). */
  fa_tile_walk nx = fa_walk_next(w, BK, seg, pair, blk, qshift);
  while (w.pi < w.pend) {
    const int kt = cur ? buf1 : buf0; /* K [BK][P], then V */
    /* Tile j landed and every warp is done with iteration j - 1 (its products
     * waited for), so tile j + 1 may stream into that buffer: one barrier a
     * tile (-3 % at case 1, bench/NOTES-gpu.md v2.14). */
    fa_mma_tile_ready(0, WG);
    if (nx.pi < nx.pend) fa_mma_load_kv(sm, cur ? buf0 : buf1, P, BK, D, b.k, g, b.v, g, nx, tid);
    fa_cp_async_commit();
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, q_pos0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, q_pos1, w.kb, nk);
    /* dQ += dS K multiplies masked keys' rows by dS = 0: non-finite K rows of a
     * tile that hides keys from some rows are zeroed and flagged (fa_mma_scan_rows). */
    const int masked = w.causal && w.kb + BK - 1 > qfirst;
    const unsigned long long kflags = masked ? fa_mma_scan_rows(smem + kt, P, BK, D, f16, kbad, tid) : 0;

    fa_f4 s[FA_MMA_MAX_BK / 8], dp[FA_MMA_MAX_BK / 8];
    if (WG) { /* the first k-step of each ignores the accumulator's old value; two groups, so P is
               * formed while dP still multiplies */
      fa_wg_acc_abt(s, 0, sm, kt, BK, D, f16);
      fa_wg_commit();
      fa_wg_acc_abt(dp, FA_MMA_ROWS * P, sm, kt + BK * P, BK, D, f16);
      fa_wg_commit();
      fa_wg_wait(1);
      fa_wg_pin(s, BK / 8);
    } else { /* S = Q K^T and dP = dO V^T in one loop: as two fa_mma_acc_abt calls, ptxas orders the loads
       * differently and dQ ran 3-4 % slower on the H200 (bench/logs/gpu_ab_refactor_abt_h200.txt) */
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
    const fa_tile_walk nx2 = fa_walk_next(nx, BK, seg, pair, blk, qshift);
    /* P = exp2(S - lse), then dS = P (dP - D), where visible; an exact 0
     * elsewhere (a select, not a product; vis0 / vis1: bit 2n + i for column
     * 8n + c0 + i of rows r0, r0 + 8). A tile whose keys every row of this
     * warp sees (warp-uniform, as in the forward) skips the masks. With
     * wgmma, dQ += dS K in KP-key parts: part c's product runs while part
     * c + 1's dS is formed. */
    unsigned vis0, vis1;
    fa_dq_tile_p(s, BK, nk == BK && (!w.causal || w.kb + BK - 1 <= qfirst + warp * 16), kflags, c0, lim0, lim1, mul,
                 lse0, lse1, &vis0, &vis1, &bad0, &bad1);
    if (WG) {
      fa_wg_wait(0);
      fa_wg_pin(dp, BK / 8);
    }
    const int KP = WG ? FA_WG_DQ_KP : BK;
    fa_u4 pa[FA_MMA_MAX_BK / 16];
#pragma unroll
    for (int k0 = 0; k0 < BK; k0 += KP) {
      fa_dq_tile_ds(s, dp, k0 / 8, (k0 + KP) / 8, vis0, vis1, dd0, dd1);
      if (WG) { /* dQ += dS K, K of [key][dim] read N-major */
        fa_wg_pack(pa + k0 / 16, s + k0 / 8, KP, f16);
        fa_wg_acc_ab(dq, pa + k0 / 16, sm, kt + k0 * 64, KP, BK, D, f16);
        fa_wg_commit();
      }
    }
    if (WG) {
      fa_wg_wait(0);
      fa_wg_pin(dq, D / 8);
      fa_wg_pin_u4(pa, BK / 16);
    } else {
      fa_mma_acc_ab(dq, s, sm, kt, P, BK, D, f16, lane); /* dQ += dS K, K of [key][dim] */
    }
    cur ^= 1;
    w = nx;
    nx = nx2;
  }
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  fa_mma_store_rows(b.dq, row0, h, dq, D, c0, ok0, ok1, b.scale, b.scale, bad0, bad1);
}

static inline __attribute__((always_inline)) void fa_mma_dq_team(const int D, const int BK, const int f16,
                                                                  const fa_gpu_bwd b, fa_block blk, int64_t h,
                                                                  int64_t g, unsigned short *smem) {
  fa_dq_team(D, BK, f16, 0, b, blk, h, g, smem);
}

/* The wgmma dQ (sm_90a builds; host tests under the emulation). */
static inline __attribute__((always_inline)) void fa_wg_dq_team(const int D, const int BK, const int f16,
                                                                 const fa_gpu_bwd b, fa_block blk, int64_t h,
                                                                 int64_t g, unsigned short *smem) {
  fa_dq_team(D, BK, f16, 1, b, blk, h, g, smem);
}

/* The two-warpgroup wgmma dQ (sm_90a, bulk tensor copies required; the
 * team shape of gpu_wg2.h). One team: FA_WG2_ROWS query rows of block blk,
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
#define FA_WG2_DQ_STAGES(D) ((D) == 128 ? 2 : 5)
/* Team memory: the Q and dO tiles of both warpgroups, the ring (gpu_wg2.h), alignment room. */
#define FA_WG2_DQ_SMEM(D)                                                                                          \
  ((size_t)(2 * FA_WG2_ROWS + 2 * FA_WG2_DQ_STAGES(D) * FA_WG2_BK) * (D) * 2 +                                      \
   FA_WG2_RING_BYTES(FA_WG2_DQ_STAGES(D)) + FA_WG_BLOCK_BYTES)

/* The dQ team's ring in its (aligned) team memory. */
static inline fa_wg2_ring fa_wg2_dq_ring(const int D, const int BK, unsigned short *smem) {
  return fa_wg2_ring_at(smem, 2 * FA_WG2_ROWS * D, 2 * BK * D, FA_WG2_DQ_STAGES(D));
}

static inline __attribute__((always_inline)) void fa_wg2_dq_team(const int D, const int BK, const int f16,
                                                                  const fa_gpu_bwd b, fa_block blk, int64_t h,
                                                                  int64_t g, unsigned short *smem) {
  const int S = FA_WG2_DQ_STAGES(D), KP = FA_WG_DQ_KP, HK = 64; /* keys a half */
  const int tid = ompx_thread_id_x(), wg = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  smem += fa_wg_align(fa_smem_of(smem));
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets of this warpgroup's Q and dO tiles; the ring follows both warpgroups' */
  const int qt = wg * FA_MMA_ROWS * D, ot = (2 + wg) * FA_MMA_ROWS * D;
  const fa_wg2_ring rg = fa_wg2_dq_ring(D, BK, smem);
  const fa_tma_map *tma = b.kv_tma;
  const fa_range *seg = b.seg;
  const fa_pair *pair = b.pair;
  const int64_t qshift = b.qshift;
  const float mul = b.scale * FA_LOG2E;
  const int64_t qrows = blk.len - wg * FA_MMA_ROWS, nq = qrows < 0 ? 0 : qrows > FA_MMA_ROWS ? FA_MMA_ROWS : qrows;
  FA_TL_DECL;
  FA_TL(FA_TL_START);
  FA_TL(FA_TL_BEGIN);

  fa_mma_load_rows(sm, qt, D, FA_MMA_ROWS, D, b.q, blk.start + wg * FA_MMA_ROWS, nq, h, wt);
  fa_mma_load_rows(sm, ot, D, FA_MMA_ROWS, D, b.dout, blk.start + wg * FA_MMA_ROWS, nq, h, wt);
  fa_cp_async_commit();
  fa_tile_walk w = fa_walk_first(b.qoff, seg, pair, blk, qshift);
  /* tiles 0 .. S - 1; wl: thread 0 of each warpgroup's next tile to copy (tile j + S after iteration j) */
  fa_tile_walk wl = fa_wg2_ring_start(sm, rg, S, tma, g, w, BK, D, seg, pair, blk, qshift);
  /* O's rows for D and the rows' lse: loads in flight while the copies land */
  const fa_dq_orow ov = fa_dq_rowsum_load(b, blk, wg * FA_MMA_ROWS, h, D, warp, lane);
  const int r0 = wg * FA_MMA_ROWS + warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int64_t row0 = blk.start + r0;
  const float lse0 = ok0 ? b.lse[row0 * b.hq + h] * FA_LOG2E : 0.0f;
  const float lse1 = ok1 ? b.lse[(row0 + 8) * b.hq + h] * FA_LOG2E : 0.0f;
  fa_cp_async_wait(0);
  fa_fence_proxy_async(); /* Q and dO for the tensor cores' reads */
  ompx_sync_block_acq_rel();
  FA_TL(FA_TL_READY);

  float dd0, dd1;
  fa_dq_rowsum_of(b, blk, wg * FA_MMA_ROWS, h, &ov, smem + ot, D, D, f16, warp, lane, &dd0, &dd1);
  const int qfirst = (int)(blk.start + qshift); /* key-frame position of the team's first row */
  const int q_pos0 = qfirst + r0, q_pos1 = q_pos0 + 8, wfirst = qfirst + wg * FA_MMA_ROWS + warp * 16;
  fa_f4 dq[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, j = 0, bi = 0; /* tile j, in buffer bi */

  while (w.pi < w.pend) {
    const int kt = fa_wg2_buf(rg, bi), vt = kt + BK * D;
    FA_TL(FA_TL_TILE);
    fa_mbar_wait(sm, rg.full + 4 * bi, (j / S) & 1);
    FA_TL(FA_TL_ARRIVED);
    const int nk = fa_walk_keys(w, BK);
    unsigned long long kf[2] = {0, 0}; /* bit r: K row 64 h + r of tile j was non-finite (zeroed) */
    if (nk < BK || (w.causal && w.kb + BK - 1 > qfirst)) fa_wg2_scan(smem + kt, BK, D, f16, rg, tid, kf);
    const int all = nk == BK && (!w.causal || w.kb + BK - 1 <= wfirst);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, q_pos0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, q_pos1, w.kb, nk);
    fa_u4 pa[FA_WG_DQ_BK / 16];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      fa_f4 s[FA_WG_DQ_BK / 8], dp[FA_WG_DQ_BK / 8];
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
       * loop's back-edge (v2.16). hh is a constant after unrolling, so no
       * wait sits under a branch (C7518). */
      if (hh == 1) {
        fa_wg_wait(0);
        fa_wg_pin(dq, D / 8);
        fa_wg_pin_u4(pa, HK / 16);
      }
    }
    /* tile j's buffer is free for this warpgroup; the second to say so copies tile j + S into it */
    if (wt == 0) wl = fa_wg2_release(sm, rg, bi, tma, g, wl, BK, D, seg, pair, blk, qshift);
    w = fa_walk_next(w, BK, seg, pair, blk, qshift);
    bi = bi == S - 1 ? 0 : bi + 1;
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

/* ---- dK/dV --------------------------------------------------------------- */

/* Queries of tile w (BQ of them): fa_mma_load_queries copies Q, dO rows and
 * their lse and D into buffer `at` (Q [BQ][P], dO [BQ][P]) and the float
 * pair at element `ld` ([BQ] lse, [BQ] D), fa_mma_load_query_stats only lse
 * and D (the rows come by bulk tensor copies), all by cp.async in the
 * caller's copy group: a plain load there stalled its warp for a memory
 * latency per tile, and the team with it at the next barrier (ncu: a fifth
 * of the kernel's samples). lse stays in natural-log units; the reader
 * scales it. */
static inline void fa_mma_load_query_stats(fa_smem m, int ld, int BQ, const fa_gpu_bwd *b, fa_query_walk w,
                                           int64_t h, int tid) {
  const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
  if (tid < 2 * BQ) { /* visible to the team after the wait and barrier that precede its use */
    const int i = tid % BQ, in = i < nq;
    const float *src = (tid < BQ ? b->lse : b->dsum) + ((int64_t)w.qb + (in ? i : 0)) * b->hq + h;
    fa_cp_async4(m, ld + 2 * tid, src, in ? 4 : 0); /* zero-filled past the tile's queries */
  }
}

static inline void fa_mma_load_queries(fa_smem m, int at, int ld, int P, int D, int BQ, const fa_gpu_bwd *b,
                                       fa_query_walk w, int64_t h, int tid) {
  const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
  fa_mma_load_rows(m, at, P, BQ, D, b->q, w.qb, nq, h, tid);
  fa_mma_load_rows(m, at + BQ * P, P, BQ, D, b->dout, w.qb, nq, h, tid);
  fa_mma_load_query_stats(m, ld, BQ, b, w, h, tid);
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

/* This lane's queries' lse (times log2 e) and D of a tile, from its floats
 * at ld ([BQ] lse in natural log, [BQ] D): lq[2n], lq[2n + 1] for queries
 * n * 8 + c0 and + 1, dd likewise. Read apart from fa_mma_dkv_grads so the
 * wgmma team issues them while its S^T and dP^T products run (ncu: their
 * latency stalled the first use right after the wait). */
static inline __attribute__((always_inline)) void fa_mma_dkv_rows(float *lq, float *dd, const float *ld, int BQ,
                                                                   int c0) {
#pragma unroll
  for (int n = 0; n < BQ / 8; n++) {
    const int qi = n * 8 + c0;
    lq[2 * n] = ld[qi] * FA_LOG2E, lq[2 * n + 1] = ld[qi + 1] * FA_LOG2E;
    dd[2 * n] = ld[BQ + qi], dd[2 * n + 1] = ld[BQ + qi + 1];
  }
}

/* P = exp2(S mul - lse) and dS = P (dP - D) of one accumulator quad in
 * place (s: x, y, z, w; dp likewise), each element with its own lse (lx..lw,
 * log2 units) and D (dx..dw); an entry whose v is 0 (not visible) becomes 0
 * in both, whatever S and dP hold there. */
static inline __attribute__((always_inline)) void fa_mma_pds_masked(fa_f4 *s, fa_f4 *dp, float mul, float lx,
                                                                     float ly, float lz, float lw, float dx, float dy,
                                                                     float dz, float dw, int vx, int vy, int vz,
                                                                     int vw) {
  s->x = vx ? fa_mma_exp2(s->x * mul - lx) : 0.0f;
  s->y = vy ? fa_mma_exp2(s->y * mul - ly) : 0.0f;
  s->z = vz ? fa_mma_exp2(s->z * mul - lz) : 0.0f;
  s->w = vw ? fa_mma_exp2(s->w * mul - lw) : 0.0f;
  dp->x = vx ? s->x * (dp->x - dx) : 0.0f;
  dp->y = vy ? s->y * (dp->y - dy) : 0.0f;
  dp->z = vz ? s->z * (dp->z - dz) : 0.0f;
  dp->w = vw ? s->w * (dp->w - dw) : 0.0f;
}

/* P^T and dS^T of one warp's 16 keys x BQ queries in place of S^T (s) and
 * dP^T (dp): lq, dd the lane's lse and D (fa_mma_dkv_rows). A tile whose
 * queries all see every key of the warp (all, warp-uniform) skips the
 * masks; otherwise query qi sees the lane's keys from lo0 / lo1 on, below
 * nq. qflags: the tile's non-finite Q/dO rows (fa_mma_scan_rows), which flag
 * the keys that see them (bad0, bad1). */
static inline __attribute__((always_inline)) void fa_mma_dkv_grads(fa_f4 *s, fa_f4 *dp, const float *lq,
                                                                    const float *dd, float mul, int nq, int BQ,
                                                                    int all, int lo0, int lo1, int c0,
                                                                    unsigned long long qflags, int *bad0, int *bad1) {
  if (all) {
    if (qflags) *bad0 = *bad1 = 1; /* every key of the warp is seen by the tile's non-finite row */
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) {
      const float l0 = lq[2 * n], l1 = lq[2 * n + 1], d0 = dd[2 * n], d1 = dd[2 * n + 1];
      s[n].x = fa_mma_exp2(fmaf(s[n].x, mul, -l0)), s[n].y = fa_mma_exp2(fmaf(s[n].y, mul, -l1));
      s[n].z = fa_mma_exp2(fmaf(s[n].z, mul, -l0)), s[n].w = fa_mma_exp2(fmaf(s[n].w, mul, -l1));
      dp[n].x = s[n].x * (dp[n].x - d0), dp[n].y = s[n].y * (dp[n].y - d1);
      dp[n].z = s[n].z * (dp[n].z - d0), dp[n].w = s[n].w * (dp[n].w - d1);
    }
  } else {
    /* queries relative to the lane's first column c0: the comparisons and
     * bit tests take constants (as in fa_dq_tile_p) */
    const int e0 = lo0 - c0, e1 = lo1 - c0, en = nq - c0;
    const unsigned long long qf = qflags >> c0;
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) {
      const int qi = n * 8; /* columns c0 + qi, + 1; rows k_pos0 (x, y), k_pos1 (z, w) */
      const int v00 = qi >= e0 && qi < en, v01 = qi + 1 >= e0 && qi + 1 < en;
      const int v10 = qi >= e1 && qi < en, v11 = qi + 1 >= e1 && qi + 1 < en;
      if (qflags) {
        *bad0 |= (v00 && (qf >> qi & 1u)) || (v01 && (qf >> (qi + 1) & 1u));
        *bad1 |= (v10 && (qf >> qi & 1u)) || (v11 && (qf >> (qi + 1) & 1u));
      }
      const float l0 = lq[2 * n], l1 = lq[2 * n + 1], d0 = dd[2 * n], d1 = dd[2 * n + 1];
      fa_mma_pds_masked(&s[n], &dp[n], mul, l0, l1, l0, l1, d0, d1, d0, d1, v00, v01, v10, v11);
    }
  }
}

/* A dK/dV team's dK (times the scale) and dV of its 16 keys a warp (r0: the
 * lane's row in the key block), or its unit's partial sums [units, hkv,
 * krows, d] when the unit's block is split (reduced in unit order by
 * fa_gpu_dkv_reduce). */
static inline __attribute__((always_inline)) void fa_mma_dkv_store(const fa_gpu_bwd *b, int64_t ui, int64_t g,
                                                                    const fa_f4 *dk, const fa_f4 *dv, int D, int r0,
                                                                    int k_pos0, int c0, int ok0, int ok1, int bad0,
                                                                    int bad1, int lane) {
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  const int part = b->part_k != NULL;
  const int64_t slot = (ui * b->hkv + g) * b->krows * b->d, row = part ? r0 : k_pos0, head = part ? 0 : g;
  const fa_dev_tensor tk = part ? fa_mma_part_view(b->part_k + slot, b->d) : b->dk;
  const fa_dev_tensor tv = part ? fa_mma_part_view(b->part_v + slot, b->d) : b->dv;
  fa_mma_store_rows(tk, row, head, dk, D, c0, ok0, ok1, b->scale, b->scale, bad0, bad1);
  fa_mma_store_rows(tv, row, head, dv, D, c0, ok0, ok1, 1.0f, 1.0f, bad0, bad1);
}

/* A dK/dV team accumulates dK and dV together. At head_dim 64 the K and V
 * fragments both live in registers (32-query tiles); at 128 (FA_MMA_DKV_VSM) V's tile
 * stays in team memory and its A fragments are read per 16-query tile: K and
 * V fragments in registers next to 64 + 64 accumulators spilled (ptxas: 160
 * local loads/stores per tile), and a dV pass plus a dK pass (5 products per
 * tile instead of 4) measured slower (bench/NOTES-gpu.md, v1.7).
 * Team memory at head_dim d: [V tile, vsm only] | three query buffers
 * (Q [BQ][P], dO [BQ][P]) | lse, D of each | scan flags. */
#define FA_MMA_DKV_VSM(d) ((d) == 128)
#define FA_MMA_DKV_SMEM(d)                                                                                      \
  ((size_t)((FA_MMA_DKV_VSM(d) ? FA_MMA_ROWS : 0) + 6 * (FA_MMA_DKV_VSM(d) ? 16 : FA_MMA_BQ)) * ((d) + 8) * 2 + \
   6 * (FA_MMA_DKV_VSM(d) ? 16 : FA_MMA_BQ) * sizeof(float) + 4 * sizeof(unsigned))

static inline __attribute__((always_inline)) void fa_mma_dkv_team(const int D, const int f16, const fa_gpu_bwd b,
                                                                   int64_t ui, int64_t g, unsigned short *smem) {
  const int vsm = FA_MMA_DKV_VSM(D), P = D + 8, BQ = vsm ? 16 : FA_MMA_BQ;
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

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int kfirst = (int)blk.start, qsh = (int)qshift; /* keys are rows of the key frame */
  const int k_pos0 = kfirst + r0, k_pos1 = k_pos0 + 8;
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
    const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
    const int lo0 = fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, nq);
    const int lo1 = fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, nq);
    /* dV += P^T dO and dK += dS^T Q multiply hidden queries' rows by 0: in a
     * tile where some query cannot see some key, non-finite Q/dO rows are
     * zeroed and flagged. S^T and dP^T, computed from the rows before the
     * scan, see such a row only where the masks below select it away, or in a
     * row that is flagged. */
    const int masked = w.causal && w.qb + qsh < kfirst + (int)blk.len - 1;
    const unsigned long long qflags =
        masked ? fa_mma_scan_rows(smem + qt, P, BQ, D, f16, qbad, tid) | fa_mma_scan_rows(smem + ot, P, BQ, D, f16, qbad, tid)
               : 0;

    float lq[FA_MMA_BQ / 4], dd[FA_MMA_BQ / 4];
    fa_mma_dkv_rows(lq, dd, ld, BQ, c0);
    fa_mma_dkv_grads(s, dp, lq, dd, mul, nq, BQ, nq == BQ && (!w.causal || kfirst + warp * 16 + 15 <= w.qb + qsh),
                     lo0, lo1, c0, qflags, &bad0, &bad1);
    /* Tile j + 1's scores (after the last tile: tile j's rows again, discarded). */
    fa_f4 sn[FA_MMA_BQ / 8], dpn[FA_MMA_BQ / 8];
    fa_mma_dkv_scores(sn, dpn, kf, vf, vsm, vl, sm, w1.j <= u.j1 ? qbuf0 + nb * qstep : qt, P, BQ, D, f16, lane);
    const int al = qt + ar * P + ac; /* .trans: B of [query][dim]; constant offsets from here fold */
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) { /* 16 queries: the k-step of dV and dK */
      const fa_u4 pa = fa_mma_p_frag(s[2 * kk], s[2 * kk + 1], f16), da = fa_mma_p_frag(dp[2 * kk], dp[2 * kk + 1], f16);
#pragma unroll
      for (int np = 0; np < D / 16; np++) { /* .trans: B of [query][dim] */
        const fa_u4 bo = fa_ldmatrix_x4(sm, al + BQ * P + kk * 16 * P + np * 16, 1);
        dv[2 * np] = fa_mma_16816(dv[2 * np], pa, bo.x, bo.y, f16);
        dv[2 * np + 1] = fa_mma_16816(dv[2 * np + 1], pa, bo.z, bo.w, f16);
        const fa_u4 bq = fa_ldmatrix_x4(sm, al + kk * 16 * P + np * 16, 1);
        dk[2 * np] = fa_mma_16816(dk[2 * np], da, bq.x, bq.y, f16);
        dk[2 * np + 1] = fa_mma_16816(dk[2 * np + 1], da, bq.z, bq.w, f16);
      }
    }
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) s[n] = sn[n], dp[n] = dpn[n];
    cb = nb;
    w = w1;
    w1 = w2;
  }
  fa_mma_dkv_store(&b, ui, g, dk, dv, D, r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
}

/* A wgmma dK/dV team's start: its unit's K and V tiles (64 rows, the wgmma
 * layout, at elements ktile and vtile) and its first query tile (buffer
 * qbuf0, lse and D at ld0) by cp.async in one committed group; returns the
 * walk at that tile (w.j > u.j1: the unit has none). */
static inline __attribute__((always_inline)) fa_query_walk fa_wg_dkv_start(fa_smem sm, int ktile, int vtile, int qbuf0,
                                                                           int ld0, int D, int BQ, const fa_gpu_bwd *b,
                                                                           fa_key_unit u, fa_block blk, int64_t g,
                                                                           int64_t group, int tid) {
  fa_mma_load_rows(sm, ktile, D, FA_MMA_ROWS, D, b->k, blk.start, blk.len, g, tid);
  fa_mma_load_rows(sm, vtile, D, FA_MMA_ROWS, D, b->v, blk.start, blk.len, g, tid);
  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b->seg, b->pair, b->kidx, b->qshift, u, blk, group);
  if (w.j <= u.j1) fa_mma_load_queries(sm, qbuf0, ld0, D, D, BQ, b, w, g * group + w.hh, tid);
  fa_cp_async_commit();
  return w;
}

/* The wgmma dK/dV team (sm_90a builds; host tests under the emulation): the
 * same unit walk, masks, flags and stores as fa_mma_dkv_team, with K's and
 * V's 64-key tiles kept in team memory as the A operands of S^T = K Q^T and
 * dP^T = V dO^T (read through descriptors: register A fragments that outlive
 * a wgmma are not safe, fa_wg_acc_abt), and dV += P^T dO, dK += dS^T Q with
 * P^T and dS^T packed from registers, in two parts of CQ queries: part
 * c's dV and dK products (one group) run while part c + 1's P^T and dS^T
 * are formed, then one wait. Query tiles of
 * FA_WG_DKV_BQ(D) rows, double-buffered (the next tile streams in during this
 * one); each product group is waited before registers it reads are
 * rewritten. Tried and dropped (v2.4, bench/NOTES-gpu.md): three buffers with
 * tile j + 1's S^T and dP^T issued with tile j's dV and dK, so tile j + 1's
 * dS^T overlaps them: correct, but 29 % (case 1) to 52 % (case 2) slower. Team memory
 * (FA_WG_DKV_SMEM, elements from a 1024-byte aligned base): K | V | two
 * (Q, dO) buffers | lse, D of each | scan flags. */
#define FA_WG_DKV_BQ(d) ((d) == 128 ? 32 : 64) /* 64 at d=128 spilled: 9.56 vs 8.18 ms at case 2 (v2.3) */
#define FA_WG_DKV_CQ(d) (FA_WG_DKV_BQ(d) / 2) /* queries a part of the dV and dK products */
#define FA_WG_DKV_SMEM(d)                                                                                       \
  ((size_t)(2 * FA_MMA_ROWS + 4 * FA_WG_DKV_BQ(d)) * (d) * 2 + 4 * FA_WG_DKV_BQ(d) * sizeof(float) +            \
   4 * sizeof(unsigned) + 16 + FA_WG_BLOCK_BYTES)

static inline __attribute__((always_inline)) void fa_wg_dkv_team(const int D, const int f16, const fa_gpu_bwd b,
                                                                  int64_t ui, int64_t g, unsigned short *smem) {
  const int P = D, BQ = FA_WG_DKV_BQ(D), CQ = FA_WG_DKV_CQ(D); /* P == D: the wgmma layout in the loads and the scans */
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
  /* With tensor maps (b.tma: Q's, dO's), a tile of BQ queries comes by bulk
   * tensor copies that thread 0 issues, completing on the mbarrier after the
   * flags; a shorter tile (its rows past the queries must be zeros: 0 * NaN
   * in dV and dK) and every tile's lse and D still come by cp.async. */
  const fa_tma_map *tma = b.tma;
  const int mbar = ld0 + 8 * BQ + 8;
  int phase = 0; /* the mbarrier's phase of this iteration's bulk copies */
  if (tma && tid == 0) fa_mbar_init(sm, mbar, 1); /* visible after the first iteration's barrier */

  fa_query_walk w = fa_wg_dkv_start(sm, ktile, vtile, qbuf0, ld0, D, BQ, &b, u, blk, g, group, tid);

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int kfirst = (int)blk.start, qsh = (int)qshift; /* keys are rows of the key frame */
  const int k_pos0 = kfirst + r0, k_pos1 = k_pos0 + 8;
  fa_f4 dk[FA_MMA_MAX_D / 8], dv[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dk[n] = fa_f4_zero(), dv[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;
  int cb = 0;
  while (w.j <= u.j1) {
    fa_cp_async_wait(0); /* tile j (and at first K, V) */
    if (tma && phase) fa_mbar_wait(sm, mbar, (phase - 1) & 1); /* ... those that came by bulk copies */
    fa_fence_proxy_async();
    ompx_sync_block_acq_rel(); /* ... visible, and iteration j - 1's reads of the other buffer done */
    const int qt = qbuf0 + cb * qstep, ot = qt + BQ * P;
    const float *ld = (const float *)(smem + ld0 + 4 * BQ * cb);
    const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
    const int lo0 = fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, nq);
    const int lo1 = fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, nq);
    const int masked = w.causal && w.qb + qsh < kfirst + (int)blk.len - 1; /* as fa_mma_dkv_team */
    const unsigned long long qflags = masked ? fa_mma_scan_rows(smem + qt, P, BQ, D, f16, qbad, tid) |
                                                   fa_mma_scan_rows(smem + ot, P, BQ, D, f16, qbad, tid)
                                             : 0;
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
    if (tma) {
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
    } else if (w1.j <= u.j1) { /* one call with the branch above: 8 spill stores, not 3 */
      fa_mma_load_queries(sm, nxt, nld, P, D, BQ, &b, w1, h1, tid);
    }
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

/* The query-major wgmma dK/dV team (FlashAttention-3's layout): the same
 * unit walk, masks, flags and stores as fa_wg_dkv_team, but 64-query tiles
 * with the queries as the products' rows: S = Q K^T and dP = dO V^T are
 * 64 x 64 (N = 64, the tensor cores' full rate, where S^T's N = 32 ran at
 * two thirds of it, bench/wgmma_rate.c) with each lane's lse and D two
 * rows' values (the key-major form needs 16 queries' a lane); P and dS go
 * to team memory as [query][key] tiles, read transposed by dV += P^T dO and
 * dK += dS^T Q (both operands MN-major). P and dS share one tile (two teams
 * an SM fit only so): dS is stored once dV's products have read P. Team
 * memory (FA_WG_DKV_QM_SMEM, elements from a 1024-byte aligned base):
 * K | V | two (Q, dO) buffers | P/dS | lse, D of each buffer | scan flags |
 * mbarrier. */
#define FA_WG_DKV_QM_BQ 64
#define FA_WG_DKV_QM_SMEM(d)                                                                                    \
  ((size_t)(6 * FA_MMA_ROWS * (d) + FA_WG_DKV_QM_BQ * 64) * 2 + 4 * FA_WG_DKV_QM_BQ * sizeof(float) +          \
   4 * sizeof(unsigned) + 16 + FA_WG_BLOCK_BYTES)

/* Tile w's Q and dO rows into the buffer at element `at` and its lse and D
 * into the floats at `ld`: bulk tensor copies (tma: Q's, dO's maps) of a
 * full tile that thread 0 issues on the mbarrier at `mbar`, or cp.async
 * (then zero-filled past the tile's queries); lse and D by cp.async. One
 * copy group committed. Returns the mbarrier phases used (1 with tma). */
static inline int fa_wg_dkv_qm_copy(fa_smem m, int at, int ld, int BQ, int D, const fa_gpu_bwd *b,
                                    const fa_tma_map *tma, int mbar, fa_query_walk w, int64_t h, int tid) {
  const int bulk = tma && w.qend - w.qb >= BQ;
  if (tma && tid == 0) {
    fa_mbar_expect_tx(m, mbar, bulk * 2 * BQ * D * 2); /* 0 bytes: completes at once */
    if (bulk) {
      fa_tma_tile(m, at, tma, (int)h, w.qb, BQ, D, mbar);
      fa_tma_tile(m, at + BQ * D, tma + 1, (int)h, w.qb, BQ, D, mbar);
    }
  }
  if (bulk) fa_mma_load_query_stats(m, ld, BQ, b, w, h, tid);
  else fa_mma_load_queries(m, at, ld, D, D, BQ, b, w, h, tid);
  fa_cp_async_commit();
  return tma != NULL;
}

/* Issue S = Q K^T and dP = dO V^T (one group, not waited) for tile w in the
 * buffer at element qt, after zeroing and flagging its non-finite Q/dO rows
 * (scan, team-uniform) when some key of the block cannot see some query
 * (fa_mma_scan_rows): returns the flags. */
static inline __attribute__((always_inline)) unsigned long long
fa_wg_dkv_qm_scores(fa_f4 *s, fa_f4 *dp, unsigned short *smem, int qt, int ktile, int vtile, unsigned *qbad, int BQ,
                    int D, int f16, fa_query_walk w, int scan, int kfirst, int klen, int qsh, int tid) {
  const int ot = qt + BQ * D, masked = scan && w.causal && w.qb + qsh < kfirst + klen - 1;
  const unsigned long long qflags =
      masked ? fa_mma_scan_rows(smem + qt, D, BQ, D, f16, qbad, tid) | fa_mma_scan_rows(smem + ot, D, BQ, D, f16, qbad, tid)
             : 0;
  /* fa_wg_opaque: each product's descriptors built where it is issued (kept
   * from the loop's entry, 16 of them spilled to local memory, which the L1
   * left beside 221 KB of team memory does not hold: ncu) */
  const fa_smem sm = fa_wg_opaque(fa_smem_of(smem));
  fa_wg_acc_abt(s, qt, sm, ktile, 64, D, f16);  /* S = Q K^T */
  fa_wg_acc_abt(dp, ot, sm, vtile, 64, D, f16); /* dP = dO V^T */
  fa_wg_commit();
  return qflags;
}

/* P and dS of one warp's 16 queries x 64 keys in place of S (s) and dP
 * (dp): l0, l1 the lane's two rows' lse (log2 units), d0, d1 their D.
 * all (warp-uniform): every query of the warp sees every key; otherwise
 * query qi sees key column kc when qi < nq and, causal, kc + kq0 <= qi
 * (kq0: the block's first key minus the tile's first query, key frame). */
static inline __attribute__((always_inline)) void fa_wg_dkv_qm_grads(fa_f4 *s, fa_f4 *dp, float l0, float l1,
                                                                      float d0, float d1, float mul, int all,
                                                                      int qi0, int nq, int causal, int kq0, int c0) {
  if (all) {
#pragma unroll
    for (int n = 0; n < 8; n++) {
      s[n].x = fa_mma_exp2(fmaf(s[n].x, mul, -l0)), s[n].y = fa_mma_exp2(fmaf(s[n].y, mul, -l0));
      s[n].z = fa_mma_exp2(fmaf(s[n].z, mul, -l1)), s[n].w = fa_mma_exp2(fmaf(s[n].w, mul, -l1));
      dp[n].x = s[n].x * (dp[n].x - d0), dp[n].y = s[n].y * (dp[n].y - d0);
      dp[n].z = s[n].z * (dp[n].z - d1), dp[n].w = s[n].w * (dp[n].w - d1);
    }
  } else {
    const int qi1 = qi0 + 8;
    /* keys a row sees: all (non-causal), or columns up to qi - kq0 */
    const int lim0 = qi0 >= nq ? -1 : causal ? qi0 - kq0 : 64, lim1 = qi1 >= nq ? -1 : causal ? qi1 - kq0 : 64;
    /* relative to the lane's first column c0: the comparisons take
     * constants, and no per-column value stays live across the walk */
    const int e0 = lim0 - c0, e1 = lim1 - c0;
#pragma unroll
    for (int n = 0; n < 8; n++) { /* columns n * 8 + c0 (+ 1); rows qi0 (x, y), qi1 (z, w) */
      fa_mma_pds_masked(&s[n], &dp[n], mul, l0, l0, l1, l1, d0, d0, d1, d1, n * 8 <= e0, n * 8 + 1 <= e0, n * 8 <= e1,
                        n * 8 + 1 <= e1);
    }
  }
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

/* A non-finite query row in [lo, nq) of the tile's flags: the key that sees
 * from query lo on sees it. */
static inline int fa_wg_flag_from(unsigned long long qflags, int lo, int nq) {
  return lo < nq && (qflags >> lo) != 0;
}

static inline __attribute__((always_inline)) void fa_wg_dkv_qm_team(const int D, const int f16, const fa_gpu_bwd b,
                                                                     int64_t ui, int64_t g, unsigned short *smem) {
  const int P = D, BQ = FA_WG_DKV_QM_BQ;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = (int)b.hq / (int)b.hkv, qshift = b.qshift; /* 32-bit: a 64-bit division is a call (C7509) */
  const float mul = b.scale * FA_LOG2E;
  smem += fa_wg_align(fa_smem_of(smem));
  const fa_smem sm = fa_smem_of(smem);
  const int ktile = 0, vtile = FA_MMA_ROWS * P, qbuf0 = 2 * FA_MMA_ROWS * P, qstep = 2 * BQ * P;
  const int ptile = qbuf0 + 2 * qstep, ld0 = ptile + BQ * 64; /* per buffer i: [BQ] lse, [BQ] D at ld0 + 4 BQ i */
  unsigned *qbad = (unsigned *)(smem + ld0 + 8 * BQ);
  const fa_tma_map *tma = b.tma;
  const int mbar = ld0 + 8 * BQ + 8;
  int phase = 0; /* bulk copies issued: the mbarrier's phases */
  if (tma && tid == 0) fa_mbar_init(sm, mbar, 1);

  fa_query_walk w = fa_wg_dkv_start(sm, ktile, vtile, qbuf0, ld0, D, BQ, &b, u, blk, g, group, tid);
  fa_query_walk w1 = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
  fa_cp_async_wait(0);
  fa_fence_proxy_async();
  ompx_sync_block_acq_rel(); /* K, V, tile 0 and the mbarrier's init visible */
  if (w1.j <= u.j1) phase += fa_wg_dkv_qm_copy(sm, qbuf0 + qstep, ld0 + 4 * BQ, BQ, D, &b, tma, mbar, w1,
                                              g * group + w1.hh, tid);

  /* lanes' rows: of dK/dV (keys) and of S, dP (queries), the same positions */
  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int kfirst = (int)blk.start, qsh = (int)qshift;
  const int k_pos0 = kfirst + r0, k_pos1 = k_pos0 + 8;
  fa_f4 dk[FA_MMA_MAX_D / 8], dv[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dk[n] = fa_f4_zero(), dv[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;
  fa_f4 s[8], dp[8]; /* 16 queries x 64 keys: S and dP of tile j, multiplied in iteration j - 1 */
  unsigned long long qflags = 0; /* tile j's non-finite Q/dO rows */
  /* no wgmma under a branch: ptxas then serializes every one of the kernel
   * (C7518, v2.18); a unit without tiles multiplies what the buffer holds */
  qflags = fa_wg_dkv_qm_scores(s, dp, smem, qbuf0, ktile, vtile, qbad, BQ, D, f16, w, w.j <= u.j1, kfirst,
                               (int)blk.len, qsh, tid);
  fa_wg_wait(0);
  int cb = 0;
  while (w.j <= u.j1) {
    fa_wg_pin(s, 8);
    fa_wg_pin(dp, 8);
    const int qt = qbuf0 + cb * qstep, ot = qt + BQ * P;
    const float *ld = (const float *)(smem + ld0 + 4 * BQ * cb);
    const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
    const float l0 = ld[r0] * FA_LOG2E, l1 = ld[r0 + 8] * FA_LOG2E, d0 = ld[BQ + r0], d1 = ld[BQ + r0 + 8];
    const int kq0 = kfirst - (w.qb + qsh);
    const int all = warp * 16 + 15 < nq && (!w.causal || (int)blk.len - 1 + kq0 <= warp * 16);
    if (qflags) { /* the keys that see a non-finite row get NaN gradients */
      bad0 |= fa_wg_flag_from(qflags, fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, nq), nq);
      bad1 |= fa_wg_flag_from(qflags, fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, nq), nq);
    }
    fa_wg_dkv_qm_grads(s, dp, l0, l1, d0, d1, mul, all, r0, nq, w.causal, kq0, c0);
    fa_wg_store_tile(fa_wg_opaque(sm), ptile, s, warp, lane, f16); /* P */
    fa_fence_proxy_async();
    ompx_sync_block_acq_rel();
    fa_wg_acc_atb(dv, fa_wg_opaque(sm), ptile, ot, BQ, BQ, D, f16); /* dV += P^T dO */
    fa_wg_commit();
    fa_wg_wait(0);
    fa_wg_pin(dv, D / 8);
    ompx_sync_block_acq_rel(); /* every warp's dV products read P */
    fa_wg_store_tile(fa_wg_opaque(sm), ptile, dp, warp, lane, f16); /* dS */
    fa_fence_proxy_async();
    ompx_sync_block_acq_rel();
    fa_wg_acc_atb(dk, fa_wg_opaque(sm), ptile, qt, BQ, BQ, D, f16); /* dK += dS^T Q */
    fa_wg_commit();
    /* While dK's products run: tile j + 2's position, tile j + 1's copies
     * waited for, its S and dP issued behind dK's (the tensor cores go from
     * one to the other without this team's wait, barrier and walk between) */
    const fa_query_walk w2 = fa_qwalk_next(w1, BQ, b.seg, b.pair, b.kidx, qshift, u, blk, group);
    const int more = w1.j <= u.j1; /* else tile j's rows again, discarded (no wgmma under a branch) */
    if (more) {
      fa_cp_async_wait(0);
      if (tma) fa_mbar_wait(sm, mbar, (phase - 1) & 1);
      if (!tma || w1.qend - w1.qb < BQ) fa_fence_proxy_async(); /* rows by cp.async, for the tensor cores */
      ompx_sync_block_acq_rel(); /* tile j + 1 visible */
    }
    qflags = fa_wg_dkv_qm_scores(s, dp, smem, more ? qbuf0 + (cb ^ 1) * qstep : qt, ktile, vtile, qbad, BQ, D, f16, w1,
                                 more, kfirst, (int)blk.len, qsh, tid);
    fa_wg_wait(0);
    fa_wg_pin(dk, D / 8);
    ompx_sync_block_acq_rel(); /* every warp's reads of tile j's buffer and of P/dS done */
    if (w2.j <= u.j1)
      phase += fa_wg_dkv_qm_copy(sm, qt, ld0 + 4 * BQ * cb, BQ, D, &b, tma, mbar, w2, g * group + w2.hh, tid);
    cb ^= 1;
    w = w1;
    w1 = w2;
  }
  fa_mma_dkv_store(&b, ui, g, dk, dv, D, r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
}

/* The two-warpgroup query-major dK/dV (sm_90a; Q's and dO's tiles by bulk
 * copies only): fa_wg_dkv_qm_team's products, masks and flags in a team of
 * FA_WG2_THREADS per (unit of a key block of FA_WG2_ROWS keys, KV head).
 * Warpgroup wg owns keys [64 wg, 64 wg + 64) with its own K, V, P and dS
 * tiles; the (Q, dO) tiles both read come once a team into a ring of
 * FA_WG2_DKV_STAGES buffers (gpu_wg2.h: the second warpgroup to release a
 * buffer refills it). Per tile and warpgroup: P and dS stored (stmatrix),
 * one proxy fence and one barrier of the warpgroup, the next tile waited
 * for and scanned, then in the warpgroup's turn (FlashAttention-3's
 * ping-pong: one warpgroup's P and dS are formed while the other's products
 * run) dV and dK issued together with the next tile's S and dP behind
 * them, one wait, and a second barrier of the warpgroup (every warp's
 * products retired before P, dS and the buffer are rewritten). The
 * one-warpgroup team needs three fences, four team barriers and two waits a
 * tile: its P and dS share a tile, so dS waits for dV's products. lse and D come from global memory
 * into registers a tile ahead (two rows a lane). No team barrier but in
 * the scans: a tile with queries that some of the block's keys do not see,
 * or with fewer than 64 queries (its rows past them are the tensor's next
 * rows, or zeros past its end), has its non-finite Q and dO rows zeroed and
 * flagged by the whole team first. Team memory (FA_WG2_DKV_SMEM, elements
 * from a 1024-byte aligned base): K (two 64-row tiles) | V (two) | P, dS of
 * warpgroup 0, then of 1 | the ring. */
#ifndef FA_WG2_DKV_STAGES /* a build may set 2 (161 KB) or 4 (225 KB of the H200's 227) */
#define FA_WG2_DKV_STAGES 3
#endif
#define FA_WG2_DKV_SMEM(d)                                                                                      \
  ((size_t)(4 * FA_MMA_ROWS * (d) + 4 * FA_WG_DKV_QM_BQ * 64 + 2 * FA_WG2_DKV_STAGES * FA_WG_DKV_QM_BQ * (d)) * \
       2 +                                                                                                      \
   FA_WG2_RING_BYTES(FA_WG2_DKV_STAGES) + FA_WG_BLOCK_BYTES)

/* The lane's lse (natural log) and D of tile w's rows r0 and r0 + 8 (query
 * head h) from global memory: st[0], st[1] lse, st[2], st[3] D. A row past
 * the tile's queries reads its first (masked where used). */
static inline __attribute__((always_inline)) void fa_wg2_dkv_stats(float *st, const fa_gpu_bwd *b, fa_query_walk w,
                                                                   int h, int r0) {
  const int nq = w.qend - w.qb;
  const int64_t i0 = (int64_t)(w.qb + (r0 < nq ? r0 : 0)) * b->hq + h;
  const int64_t i1 = (int64_t)(w.qb + (r0 + 8 < nq ? r0 + 8 : 0)) * b->hq + h;
  st[0] = b->lse[i0], st[1] = b->lse[i1], st[2] = b->dsum[i0], st[3] = b->dsum[i1];
}

/* The whole team's scan of tile w's Q and dO rows in the buffer at element
 * qt when it needs one (above; team-uniform): the non-finite rows among the
 * tile's queries. */
static inline unsigned long long fa_wg2_dkv_scan(unsigned short *smem, int qt, int BQ, int D, int f16,
                                                 fa_wg2_ring rg, fa_query_walk w, fa_block blk, int qsh, int tid) {
  const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
  if (nq == BQ && !(w.causal && w.qb + qsh < (int)(blk.start + blk.len) - 1)) return 0;
  const unsigned long long f = fa_mma_scan_rows_by(smem + qt, D, BQ, 0, BQ, D, f16, rg.flags, tid, FA_WG2_THREADS) |
                               fa_mma_scan_rows_by(smem + qt + BQ * D, D, BQ, 0, BQ, D, f16, rg.flags, tid,
                                                   FA_WG2_THREADS);
  return nq < 64 ? f & ((1ull << nq) - 1) : f;
}

/* Tile t = w of the two-warpgroup dK/dV, in buffer i: its lse and D into st
 * (fa_wg2_dkv_stats), its arrival waited for, its scan (fa_wg2_dkv_scan,
 * the whole team). Returns the scan's flags. */
static inline __attribute__((always_inline)) unsigned long long
fa_wg2_dkv_next(float *st, const fa_gpu_bwd *b, fa_query_walk w, int h, int r0, fa_smem sm, unsigned short *smem,
                fa_wg2_ring rg, int i, int t, int BQ, int D, int f16, fa_block blk, int qsh, int tid) {
  fa_wg2_dkv_stats(st, b, w, h, r0);
  fa_mbar_wait(sm, rg.full + 4 * i, (t / rg.S) & 1);
  return fa_wg2_dkv_scan(smem, fa_wg2_buf(rg, i), BQ, D, f16, rg, w, blk, qsh, tid);
}

/* S = Q K^T and dP = dO V^T of the (Q, dO) tile at element qt (issued, not
 * committed). Each operand is taken through its own view of the team memory
 * (fa_wg_opaque_at): a product group's descriptors are then one base and
 * constant k-step offsets, where offsets from the team memory's base cost
 * ptxas ~8 instructions a product and spilled (v2.30). */
static inline __attribute__((always_inline)) void fa_wg2_dkv_sdp(fa_f4 *s, fa_f4 *dp, fa_smem sm, int qt, int ktile,
                                                                  int vtile, int BQ, int D, int f16) {
  fa_wg_acc_abt_v(s, fa_wg_opaque_at(sm, qt), 0, fa_wg_opaque_at(sm, ktile), 0, 64, 64, D, f16);           /* S */
  fa_wg_acc_abt_v(dp, fa_wg_opaque_at(sm, qt + BQ * D), 0, fa_wg_opaque_at(sm, vtile), 0, 64, 64, D, f16); /* dP */
}

static inline __attribute__((always_inline)) void fa_wg2_dkv_qm_team(const int D, const int f16, const fa_gpu_bwd b,
                                                                      int64_t ui, int64_t g, unsigned short *smem) {
  const int S = FA_WG2_DKV_STAGES, BQ = FA_WG_DKV_QM_BQ;
  const int tid = ompx_thread_id_x(), wg = fa_wg2_index(tid), wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = (int)b.hq / (int)b.hkv, qshift = b.qshift; /* 32-bit: a 64-bit division is a call (C7509) */
  const float mul = b.scale * FA_LOG2E;
  smem += fa_wg_align(fa_smem_of(smem)); /* swizzled tiles start 1024-byte aligned */
  const fa_smem sm = fa_smem_of(smem);
  const int ktile = wg * FA_MMA_ROWS * D, vtile = (2 + wg) * FA_MMA_ROWS * D;
  const int ptile = 4 * FA_MMA_ROWS * D + wg * 2 * BQ * 64, dstile = ptile + BQ * 64;
  const fa_wg2_ring rg = fa_wg2_ring_at(smem, 4 * FA_MMA_ROWS * D + 4 * BQ * 64, 2 * BQ * D, S);
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
  fa_wg2_ring_init(sm, rg, tid);
  /* tiles 0 .. S - 1; wl: thread 0 of each warpgroup's next tile to copy (tile j + S after iteration j) */
  fa_query_walk wl = w;
  if (wt == 0)
    for (int i = 0; i < S && wl.j <= u.j1; i++) {
      if (tid == 0) fa_wg2_copy(sm, rg, i, tma, hg + wl.hh, wl.qb, BQ, D);
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
  float st[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* tile j's lse and D (fa_wg2_dkv_stats) */
  unsigned long long qflags = 0;          /* tile j's non-finite Q/dO rows */
  if (w.j <= u.j1) {
    qflags = fa_wg2_dkv_next(st, &b, w, hg + w.hh, r0, sm, smem, rg, 0, 0, BQ, D, f16, blk, qsh, tid);
    if (wg == 1) fa_wg_turn_pass(3); /* warpgroup 0 takes the first turn */
  }
  /* no wgmma under a branch: ptxas then serializes every one of the kernel
   * (C7518, v2.18); a unit without tiles multiplies what the buffer holds */
  fa_wg2_dkv_sdp(s, dp, sm, fa_wg2_buf(rg, 0), ktile, vtile, BQ, D, f16);
  fa_wg_commit();
  fa_wg_wait(0);
  while (w.j <= u.j1) {
    fa_wg_pin(s, 8);
    fa_wg_pin(dp, 8);
    FA_TL(FA_TL_TILE);
    const int qt = fa_wg2_buf(rg, bi), ot = qt + BQ * D;
    const int nq = w.qend - w.qb < BQ ? w.qend - w.qb : BQ;
    const int kq0 = kfirst - (w.qb + qsh);
    const int all = warp * 16 + 15 < nq && (!w.causal || klast + kq0 <= warp * 16);
    if (qflags) { /* the keys that see a non-finite row get NaN gradients */
      bad0 |= fa_wg_flag_from(qflags, fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, nq), nq);
      bad1 |= fa_wg_flag_from(qflags, fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, nq), nq);
    }
    fa_wg_dkv_qm_grads(s, dp, st[0] * FA_LOG2E, st[1] * FA_LOG2E, st[2], st[3], mul, all, r0, nq, w.causal, kq0,
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
    qflags = more ? fa_wg2_dkv_next(st, &b, w1, hg + w1.hh, r0, sm, smem, rg, b1, j + 1, BQ, D, f16, blk, qsh, tid)
                  : 0;
    FA_TL(FA_TL_NEXTQ);
    fa_wg_turn_wait(3 + wg);
    FA_TL(FA_TL_TURN);
    fa_wg_acc_atb_v(dv, fa_wg_opaque_at(sm, ptile), 0, fa_wg_opaque_at(sm, ot), 0, BQ, BQ, D, f16);  /* dV += P^T dO */
    fa_wg_acc_atb_v(dk, fa_wg_opaque_at(sm, dstile), 0, fa_wg_opaque_at(sm, qt), 0, BQ, BQ, D, f16); /* dK += dS^T Q */
    fa_wg_commit();
    /* tile j + 1's S and dP behind dV's and dK's products */
    const int nt = more ? fa_wg2_buf(rg, b1) : qt; /* else tile j's rows again, discarded */
    fa_wg2_dkv_sdp(s, dp, sm, nt, ktile, vtile, BQ, D, f16);
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
      if (fa_wg2_second(rg, bi)) fa_wg2_copy(sm, rg, bi, tma, hg + wl.hh, wl.qb, BQ, D);
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
