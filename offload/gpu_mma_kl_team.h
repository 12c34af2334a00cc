/* The tensor-core StreamKL forward's team function (one 64-row query block x
 * one query head), in a header so the host tests can run it under the SIMT
 * emulation of gpu_mma.h (tests/test_mma_emulated.c). Launched by
 * gpu_mma_kl.c; semantics of gpu_kl.c's FP32 forward without a kept set.
 *
 * 4 warps x 16 query rows; the teacher's and the student's Q fragments stay in
 * registers, their K tiles stream through two team-memory buffers by
 * cp.async. S_t = Q_t K_t^T and S_s = Q_s K_s^T on mma.sync; each lane folds
 * its accumulator elements (2 rows x BK/4 keys per tile) into a per-row
 * online KL state (online_kl.h), and the quad of lanes that shares a row
 * merges its 4 states in a fixed order at the end. No score reaches memory;
 * no product multiplies a masked key, so NaN containment needs no scan. */
#ifndef FORKATTN_GPU_MMA_KL_TEAM_H
#define FORKATTN_GPU_MMA_KL_TEAM_H
#include <math.h>
#include <stdint.h>

#include "gpu_kl.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_products.h"
#include "online_kl.h"

#pragma omp declare target
/* The state of lane ^ mask (a row's states are spread over a quad). */
static inline fa_kl_state fa_mma_kl_shfl(fa_kl_state s, int mask) { return FA_KL_STATE_SHFL(s, fa_mma_shfl_xor, mask); }

/* Both sides' A fragments of a warp's 16 rows (Q_t and Q_s, or K_t and
 * K_s), and both sides' scores of those rows against a key tile (by value,
 * see gpu_mma.h; the forward's and the backward's teams share them). */
typedef struct fa_mma_kl_frags {
  fa_u4 t[FA_MMA_MAX_D / 16], s[FA_MMA_MAX_D / 16];
} fa_mma_kl_frags;
typedef struct fa_mma_kl_sc {
  fa_f4 t[FA_MMA_MAX_BK / 8], s[FA_MMA_MAX_BK / 8];
} fa_mma_kl_sc;

/* Rows [blk.start, + blk.len) of the teacher's tensor ta (head ht) and the
 * student's ts (head hs) through team memory into each warp's A fragments.
 * Contains barriers: call from every thread. */
static inline fa_mma_kl_frags fa_mma_kl_load_frags(fa_smem sm, int P, int D, fa_dev_tensor ta, int64_t ht,
                                                   fa_dev_tensor ts, int64_t hs, fa_block blk, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  fa_mma_load_rows(sm, 0, P, FA_MMA_ROWS, D, ta, blk.start, blk.len, ht, tid);
  fa_mma_load_rows(sm, FA_MMA_ROWS * P, P, FA_MMA_ROWS, D, ts, blk.start, blk.len, hs, tid);
  fa_cp_async_commit();
  fa_cp_async_wait(0);
  ompx_sync_block_acq_rel();
  fa_mma_kl_frags f;
  const int r = warp * 16 + fa_ldsm_a_row(lane), c = fa_ldsm_a_col(lane);
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
    f.t[ks] = fa_ldmatrix_x4(sm, r * P + ks * 16 + c, 0);
    f.s[ks] = fa_ldmatrix_x4(sm, (FA_MMA_ROWS + r) * P + ks * 16 + c, 0);
  }
  ompx_sync_block_acq_rel();
  return f;
}

/* S_t = Q_t K_t^T and S_s = Q_s K_s^T, raw, against the BK-key tiles of K_t
 * at element kt and K_s at kst of team memory. */
static inline fa_mma_kl_sc fa_mma_kl_scores(fa_smem sm, int kt, int kst, int P, int D, int BK, fa_mma_kl_frags q,
                                            int f16, int lane) {
  fa_mma_kl_sc sc;
#pragma unroll
  for (int n = 0; n < BK / 8; n++) sc.t[n] = fa_f4_zero(), sc.s[n] = fa_f4_zero();
  const int kl = fa_ldsm_b_row(lane) * P + fa_ldsm_b_col(lane); /* constant offsets from here fold */
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
    for (int np = 0; np < BK / 16; np++) {
      const fa_u4 bt = fa_ldmatrix_x4(sm, kt + kl + np * 16 * P + ks * 16, 0);
      const fa_u4 bs = fa_ldmatrix_x4(sm, kst + kl + np * 16 * P + ks * 16, 0);
      sc.t[2 * np] = fa_mma_16816(sc.t[2 * np], q.t[ks], bt.x, bt.y, f16);
      sc.t[2 * np + 1] = fa_mma_16816(sc.t[2 * np + 1], q.t[ks], bt.z, bt.w, f16);
      sc.s[2 * np] = fa_mma_16816(sc.s[2 * np], q.s[ks], bs.x, bs.y, f16);
      sc.s[2 * np + 1] = fa_mma_16816(sc.s[2 * np + 1], q.s[ks], bs.z, bs.w, f16);
    }
  return sc;
}

/* Fold one accumulator element into a row's state when the key is visible. */
static inline void fa_mma_kl_fold(fa_kl_state *st, float t, float s, int key, int lim, float sct, float scs) {
  if (key < lim) fa_kl_add(st, t * sct, s * scs);
}

/* Tile w's rows of both sides' K, NP pieces each, into the buffer at buf: K_t's pieces, then K_s's, BK * P
 * elements apart. */
static inline __attribute__((always_inline)) void fa_mma_kl_load_pieces(fa_smem sm, int buf, int P, int BK, int D,
                                                                        int NP, const fa_gpu_kl *b, int64_t gt,
                                                                        int64_t gs, fa_tile_walk w, int tid) {
  fa_mma_load_kv_pieces(sm, buf, P, BK, D, b->kt, b->pstride[1], gt, NP, b->ks, b->pstride[3], gs, NP, w, tid);
}

/* The forward team of NP pieces a score input (1: bf16/f16; f32 split into 3 at HIGH precision, 2 at
 * MEDIUM, lib/core/split_bf16.h). Split, each buffer holds K_t's pieces then K_s's, both sides' Q pieces
 * 1 and 2 stay in team memory past the buffers (FA_MMA_KL_FWD_Q1) and the scores take the products of
 * fa_mma_qk_split_rest too. */
#define FA_MMA_KL_FWD_Q1(BK, P, NP) (4 * (NP) * (BK) * (P)) /* element of Q_t's piece 1 */
#define FA_MMA_KL_FWD_SMEM(D, BK, NP) ((size_t)(FA_MMA_KL_FWD_Q1(BK, (D) + 8, NP) + 2 * ((NP) - 1) * FA_MMA_ROWS * ((D) + 8)) * 2)
static inline __attribute__((always_inline)) void fa_mma_kl_fwd_team_of(const int D, const int BK, const int f16,
                                                                         const int NP, const fa_gpu_kl b,
                                                                         fa_block blk, int64_t h,
                                                                         unsigned short *smem) {
  const int P = D + 8;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_smem sm = fa_smem_of(smem);
  const int buf0 = 0, buf1 = 2 * NP * BK * P; /* element offsets; each: K_t [BK][P], K_s [BK][P] (NP pieces each) */
  const int64_t gt = h / (b.h / b.hkv_t), gs = h / (b.h / b.hkv_s);
  /* this lane's A addresses of Q_t's pieces 1, 2 and Q_s's (split inputs) */
  const int q1t = FA_MMA_KL_FWD_Q1(BK, P, NP) + (warp * 16 + fa_ldsm_a_row(lane)) * P + fa_ldsm_a_col(lane);
  const int q1s = q1t + (NP - 1) * FA_MMA_ROWS * P;

  /* Q_t and Q_s (64 rows each) fill the team memory first; the walk starts after. Their pieces 1, 2 go
   * past the buffers in the same copy group. */
#pragma unroll
  for (int p = 1; p < NP; p++) {
    const int at = FA_MMA_KL_FWD_Q1(BK, P, NP) + (p - 1) * FA_MMA_ROWS * P;
    fa_mma_load_rows(sm, at, P, FA_MMA_ROWS, D, fa_dev_piece(b.qt, b.pstride[0], p), blk.start, blk.len, h, tid);
    fa_mma_load_rows(sm, at + (NP - 1) * FA_MMA_ROWS * P, P, FA_MMA_ROWS, D, fa_dev_piece(b.qs, b.pstride[2], p),
                     blk.start, blk.len, h, tid);
  }
  const fa_mma_kl_frags q = fa_mma_kl_load_frags(sm, P, D, b.qt, h, b.qs, h, blk, tid);

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int64_t row0 = blk.start + r0; /* StreamKL plans have qshift 0 */
  fa_kl_state acc0 = fa_kl_init(), acc1 = fa_kl_init();

  fa_tile_walk w = fa_walk_first(b.qoff, b.seg, b.pair, blk, 0);
  if (w.pi < w.pend) {
    if (NP == 1) fa_mma_load_kv(sm, buf0, P, BK, D, b.kt, gt, b.ks, gs, w, tid);
    else fa_mma_kl_load_pieces(sm, buf0, P, BK, D, NP, &b, gt, gs, w, tid);
  }
  fa_cp_async_commit();
  int cur = 0;
  while (w.pi < w.pend) {
    const fa_tile_walk nx = fa_walk_next(w, BK, b.seg, b.pair, blk, 0);
    const int kt = cur ? buf1 : buf0, kst = kt + NP * BK * P;
    if (NP == 1) {
      fa_mma_kv_step(sm, cur ? buf0 : buf1, P, BK, D, b.kt, gt, b.ks, gs, nx, tid);
    } else {
      if (nx.pi < nx.pend) fa_mma_kl_load_pieces(sm, cur ? buf0 : buf1, P, BK, D, NP, &b, gt, gs, nx, tid);
      fa_mma_tile_ready(nx.pi < nx.pend, 0);
    }
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, (int)row0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, (int)row0 + 8, w.kb, nk);
    fa_mma_kl_sc sc = fa_mma_kl_scores(sm, kt, kst, P, D, BK, q, f16, lane);
    if (NP > 1) {
      fa_mma_qk_split_rest(sc.t, q.t, q1t, q1t + FA_MMA_ROWS * P, NP, sm, kt, P, BK, D, lane);
      fa_mma_qk_split_rest(sc.s, q.s, q1s, q1s + FA_MMA_ROWS * P, NP, sm, kst, P, BK, D, lane);
    }
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
      const int key = n * 8 + c0;
      fa_mma_kl_fold(&acc0, sc.t[n].x, sc.s[n].x, key, lim0, b.st, b.ss);
      fa_mma_kl_fold(&acc0, sc.t[n].y, sc.s[n].y, key + 1, lim0, b.st, b.ss);
      fa_mma_kl_fold(&acc1, sc.t[n].z, sc.s[n].z, key, lim1, b.st, b.ss);
      fa_mma_kl_fold(&acc1, sc.t[n].w, sc.s[n].w, key + 1, lim1, b.st, b.ss);
    }
    ompx_sync_block_acq_rel(); /* every warp is done with this buffer before it is refilled */
    cur ^= 1;
    w = nx;
  }
  /* the quad's 4 states: lane ^ 1, then lane ^ 2 (the writing lane's order is fixed) */
  for (int m = 1; m <= 2; m *= 2) {
    fa_kl_state o0 = fa_mma_kl_shfl(acc0, m), o1 = fa_mma_kl_shfl(acc1, m);
    fa_kl_merge(&acc0, &o0);
    fa_kl_merge(&acc1, &o1);
  }
  if (c0 != 0) return;
  for (int half = 0; half < 2; half++) {
    if (!(half ? ok1 : ok0)) continue;
    float stats4[FORKATTN_KL_STATS], out;
    const float div = fa_kl_row_finish(half ? acc1 : acc0, -INFINITY, 0.0f, b.reverse, stats4, &out);
    const int64_t i = (row0 + 8 * half) * b.h + h;
    b.kl[i] = div * b.loss_mul;
    if (b.stats)
      for (int s = 0; s < FORKATTN_KL_STATS; s++) b.stats[i * FORKATTN_KL_STATS + s] = stats4[s];
    if (b.outside) b.outside[i] = out;
  }
}

/* The forward of bf16/f16 inputs, and of f32 inputs split at HIGH (3 pieces) and MEDIUM (2) precision. */
static inline __attribute__((always_inline)) void fa_mma_kl_fwd_team(const int D, const int BK, const int f16,
                                                                      const fa_gpu_kl b, fa_block blk, int64_t h,
                                                                      unsigned short *smem) {
  fa_mma_kl_fwd_team_of(D, BK, f16, 1, b, blk, h, smem);
}
static inline __attribute__((always_inline)) void fa_mma_kl_fwd_team_f32_high(const int D, const int BK,
                                                                               const int f16, const fa_gpu_kl b,
                                                                               fa_block blk, int64_t h,
                                                                               unsigned short *smem) {
  fa_mma_kl_fwd_team_of(D, BK, f16, 3, b, blk, h, smem);
}
static inline __attribute__((always_inline)) void fa_mma_kl_fwd_team_f32_medium(const int D, const int BK,
                                                                                 const int f16, const fa_gpu_kl b,
                                                                                 fa_block blk, int64_t h,
                                                                                 unsigned short *smem) {
  fa_mma_kl_fwd_team_of(D, BK, f16, 2, b, blk, h, smem);
}
#pragma omp end declare target

#endif
