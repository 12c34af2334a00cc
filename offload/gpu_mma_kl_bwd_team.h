/* The tensor-core StreamKL backward's team functions, in a header so the host
 * tests can run them under the SIMT emulation of gpu_mma.h
 * (tests/test_mma_emulated.c). Launched by gpu_mma_kl.c; semantics of
 * gpu_kl.c's FP32 backward without a kept set, for calls whose teacher and
 * student share head_dim and KV heads (the call's same_d and same_kv_heads,
 * gpu_select.h).
 *
 * Both recompute the two sides' scores per tile (S_t = Q_t K_t^T, S_s =
 * Q_s K_s^T) and turn them into one side's score gradient with the row
 * statistics of the forward (fa_kl_elem_grad, shared with every backend), C =
 * g dKL/dscore; then dQ += C K (a team per 64 query rows and query head) or
 * dK += C^T Q (a team per 64-key unit and KV head, over the unit's readers and
 * the group's query heads), one side per launch. As in the attention kernels,
 * a masked tile zeroes and flags the non-finite rows of the tile the product
 * multiplies (0 * Inf would leak into rows that cannot see them), and the rows
 * or keys that do see one are set to NaN. */
#ifndef FORKATTN_GPU_MMA_KL_BWD_TEAM_H
#define FORKATTN_GPU_MMA_KL_BWD_TEAM_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"
#include "gpu_kl.h"
#include "gpu_mma.h"
#include "gpu_mma_kl_team.h"
#include "gpu_mma_tiles.h"
#include "gpu_products.h"
#include "streamkl.h"

#pragma omp declare target

/* g dKL/dscore of side `teacher` for one visible (row, key): scores t, s
 * already scaled, st4 the row's FORKATTN_KL_STATS, gr its upstream gradient
 * times the loss multiplier. A row with gr == 0 (loss-masked) contributes an
 * exact 0, whatever its scores. */
static inline float fa_mma_kl_coef(float t, float s, const float *st4, float gr, int reverse, int teacher) {
  if (gr == 0.0f) return 0.0f;
  float gt, gs;
  fa_kl_elem_grad(t, s, 1, 1, st4, reverse, &gt, &gs);
  return gr * (teacher ? gt : gs);
}

/* ---- dQ ------------------------------------------------------------------ */

/* C in place of a warp's teacher scores ct (16 rows x BK keys; cs the student's, both raw): rows r0
 * (x, y) and r0 + 8 (z, w) see keys [0, lim0) and [0, lim1) of the tile, their statistics st0, st1
 * and upstream gradients g0, g1; a key a row cannot see gets an exact 0 (a select). kflags: the
 * tile's non-finite K rows of the side (zeroed), which flag the rows that see them. */
static inline __attribute__((always_inline)) void fa_mma_kl_dq_coefs(fa_f4 *ct, const fa_f4 *cs, int BK, int c0,
                                                                      int lim0, int lim1, unsigned long long kflags,
                                                                      const float *st0, const float *st1, float g0,
                                                                      float g1, const fa_gpu_kl *b, int teacher,
                                                                      int *bad0, int *bad1) {
#pragma unroll
  for (int n = 0; n < BK / 8; n++) {
    const int key = n * 8 + c0;
    if (kflags) {
      *bad0 |= (key < lim0 && (kflags >> key & 1u)) || (key + 1 < lim0 && (kflags >> (key + 1) & 1u));
      *bad1 |= (key < lim1 && (kflags >> key & 1u)) || (key + 1 < lim1 && (kflags >> (key + 1) & 1u));
    }
    ct[n].x = key < lim0 ? fa_mma_kl_coef(ct[n].x * b->st, cs[n].x * b->ss, st0, g0, b->reverse, teacher) : 0.0f;
    ct[n].y = key + 1 < lim0 ? fa_mma_kl_coef(ct[n].y * b->st, cs[n].y * b->ss, st0, g0, b->reverse, teacher) : 0.0f;
    ct[n].z = key < lim1 ? fa_mma_kl_coef(ct[n].z * b->st, cs[n].z * b->ss, st1, g1, b->reverse, teacher) : 0.0f;
    ct[n].w = key + 1 < lim1 ? fa_mma_kl_coef(ct[n].w * b->st, cs[n].w * b->ss, st1, g1, b->reverse, teacher) : 0.0f;
  }
}

/* A dQ team's rows r0, r0 + 8 (ok0, ok1: they exist; row0 the first's index): their statistics into
 * st0, st1 and their upstream gradients times the loss multiplier, 0 for a missing row (returned in
 * g[0], g[1]). */
static inline __attribute__((always_inline)) void fa_mma_kl_dq_rows(const fa_gpu_kl *b, int64_t row0, int64_t h,
                                                                     int ok0, int ok1, float *st0, float *st1,
                                                                     float *g) {
  g[0] = ok0 ? b->dkl[row0 * b->h + h] * b->loss_mul : 0.0f;
  g[1] = ok1 ? b->dkl[(row0 + 8) * b->h + h] * b->loss_mul : 0.0f;
  for (int s = 0; s < FORKATTN_KL_STATS; s++) st0[s] = st1[s] = 0.0f; /* then loads: the order ptxas scheduled best */
  for (int s = 0; s < FORKATTN_KL_STATS; s++) {
    if (ok0) st0[s] = b->stats_in[(row0 * b->h + h) * FORKATTN_KL_STATS + s];
    if (ok1) st1[s] = b->stats_in[((row0 + 8) * b->h + h) * FORKATTN_KL_STATS + s];
  }
}

/* Team memory: two buffers of K_t [BK][P], K_s [BK][P] (as the forward), then
 * 4 flag words. */
#define FA_MMA_KL_DQ_SMEM(d, bk) ((size_t)(4 * (bk) * ((d) + 8)) * 2 + 4 * sizeof(unsigned))

static inline __attribute__((always_inline)) void fa_mma_kl_dq_team(const int D, const int BK, const int f16,
                                                                     const fa_gpu_kl b, fa_block blk, int64_t h,
                                                                     int teacher, unsigned short *smem) {
  const int P = D + 8;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_smem sm = fa_smem_of(smem);
  const int buf0 = 0, buf1 = 2 * BK * P; /* element offsets; each: K_t [BK][P], K_s [BK][P] */
  unsigned *kbad = (unsigned *)(smem + 4 * BK * P);
  const int64_t g = h / (b.h / b.hkv_t); /* the students' KV head is the same (same_kv_heads) */

  const fa_mma_kl_frags q = fa_mma_kl_load_frags(sm, P, D, b.qt, h, b.qs, h, blk, tid);

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int64_t row0 = blk.start + r0; /* StreamKL plans have qshift 0 */
  const int qfirst = (int)blk.start;
  float st0[FORKATTN_KL_STATS], st1[FORKATTN_KL_STATS], gr[2];
  fa_mma_kl_dq_rows(&b, row0, h, ok0, ok1, st0, st1, gr);
  fa_f4 dq[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;

  fa_tile_walk w = fa_walk_first(b.qoff, b.seg, b.pair, blk, 0);
  if (w.pi < w.pend) fa_mma_load_kv(sm, buf0, P, BK, D, b.kt, g, b.ks, g, w, tid);
  fa_cp_async_commit();
  int cur = 0;
  while (w.pi < w.pend) {
    const fa_tile_walk nx = fa_walk_next(w, BK, b.seg, b.pair, blk, 0);
    const int kt = cur ? buf1 : buf0, kst = kt + BK * P, kside = teacher ? kt : kst;
    fa_mma_kv_step(sm, cur ? buf0 : buf1, P, BK, D, b.kt, g, b.ks, g, nx, tid);
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, (int)row0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, (int)row0 + 8, w.kb, nk);
    const int masked = w.causal && w.kb + BK - 1 > qfirst;
    const unsigned long long kflags = masked ? fa_mma_scan_rows(smem + kside, P, BK, D, f16, kbad, tid) : 0;

    fa_mma_kl_sc sc = fa_mma_kl_scores(sm, kt, kst, P, D, BK, q, f16, lane);
    fa_f4 *ct = sc.t, *cs = sc.s;
    fa_mma_kl_dq_coefs(ct, cs, BK, c0, lim0, lim1, kflags, st0, st1, gr[0], gr[1], &b, teacher, &bad0, &bad1);
    fa_mma_acc_ab(dq, ct, sm, kside, P, BK, D, f16, lane); /* dQ += C K of the side, K of [key][dim] */
    ompx_sync_block_acq_rel();
    cur ^= 1;
    w = nx;
  }
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  const float scale = teacher ? b.st : b.ss;
  fa_mma_store_rows(teacher ? b.dqt : b.dqs, row0, h, dq, D, c0, ok0, ok1, scale, scale, bad0, bad1);
}

/* ---- dK ------------------------------------------------------------------ */

/* Queries per dK tile: 16 at head_dim 128 (K_t and K_s fragments, 64
 * registers, sit next to the 64 of the accumulator), 32 at 64. */
#define FA_MMA_KL_BQ(d) ((d) == 128 ? 16 : 32)
/* Team memory: the two sides' 64 key rows at the start (staged into
 * registers), after that two query buffers (Q_t [BQ][P], Q_s [BQ][P]) and
 * their row data (5 floats a query: the statistics, then g); then 4 flag
 * words. */
#define FA_MMA_KL_DK_BUFS(d) (4 * FA_MMA_KL_BQ(d) * ((d) + 8) + 2 * 10 * FA_MMA_KL_BQ(d))
#define FA_MMA_KL_DK_SMEM(d)                                                                                    \
  ((size_t)(FA_MMA_KL_DK_BUFS(d) > 2 * FA_MMA_ROWS * ((d) + 8) ? FA_MMA_KL_DK_BUFS(d)                           \
                                                                : 2 * FA_MMA_ROWS * ((d) + 8)) *                \
       2 +                                                                                                    \
   4 * sizeof(unsigned))

/* Queries of tile w: both sides' Q rows, NP pieces each (1: the inputs as
 * they are; b->pstride), into buffer `at` (Q_t's pieces, then Q_s's, BQ * P
 * elements apart) and the rows' statistics and upstream gradient (floats
 * [5][BQ], zero past the tile) at element `rd`, by cp.async in the caller's
 * copy group. */
static inline void fa_mma_kl_load_queries(fa_smem m, int at, int rd, int P, int D, int BQ, int NP, const fa_gpu_kl *b,
                                          fa_query_walk w, int64_t h, int tid) {
  const int nq = fa_qwalk_rows(w, BQ);
  fa_mma_load_pieces(m, at, BQ * P, NP, P, BQ, D, b->qt, b->pstride[0], w.qb, nq, h, tid);
  fa_mma_load_pieces(m, at + NP * BQ * P, BQ * P, NP, P, BQ, D, b->qs, b->pstride[2], w.qb, nq, h, tid);
  for (int e = tid; e < (FORKATTN_KL_STATS + 1) * BQ; e += FA_MMA_THREADS) {
    const int s = e / BQ, i = e % BQ, in = i < nq;
    const int64_t x = ((int64_t)w.qb + (in ? i : 0)) * b->h + h;
    const float *src = s < FORKATTN_KL_STATS ? b->stats_in + x * FORKATTN_KL_STATS + s : b->dkl + x;
    fa_cp_async4(m, rd + 2 * e, src, in ? 4 : 0);
  }
}

/* C^T in place of a warp's teacher scores ct (16 keys x BQ queries; cs the student's, both raw): keys
 * k_pos0 (x, y) and k_pos1 (z, w) are seen by queries [lo0, nq) and [lo1, nq) of the tile, whose
 * statistics and upstream gradients are the floats at rd (fa_mma_kl_load_queries). qflags: the
 * tile's non-finite Q rows of the side (zeroed), which flag the keys they see. */
static inline __attribute__((always_inline)) void fa_mma_kl_dk_coefs(fa_f4 *ct, const fa_f4 *cs, int BQ, int c0,
                                                                      int lo0, int lo1, int nq,
                                                                      unsigned long long qflags, const float *rd,
                                                                      const fa_gpu_kl *b, int teacher, int *bad0,
                                                                      int *bad1) {
#pragma unroll
  for (int n = 0; n < BQ / 8; n++) {
    const int qi = n * 8 + c0;
    const int v00 = qi >= lo0 && qi < nq, v01 = qi + 1 >= lo0 && qi + 1 < nq;
    const int v10 = qi >= lo1 && qi < nq, v11 = qi + 1 >= lo1 && qi + 1 < nq;
    if (qflags) {
      *bad0 |= (v00 && (qflags >> qi & 1u)) || (v01 && (qflags >> (qi + 1) & 1u));
      *bad1 |= (v10 && (qflags >> qi & 1u)) || (v11 && (qflags >> (qi + 1) & 1u));
    }
    float sq0[FORKATTN_KL_STATS], sq1[FORKATTN_KL_STATS]; /* queries qi and qi + 1 */
    for (int s = 0; s < FORKATTN_KL_STATS; s++) sq0[s] = rd[s * BQ + qi], sq1[s] = rd[s * BQ + qi + 1];
    const float gq0 = rd[FORKATTN_KL_STATS * BQ + qi] * b->loss_mul;
    const float gq1 = rd[FORKATTN_KL_STATS * BQ + qi + 1] * b->loss_mul;
    ct[n].x = v00 ? fa_mma_kl_coef(ct[n].x * b->st, cs[n].x * b->ss, sq0, gq0, b->reverse, teacher) : 0.0f;
    ct[n].y = v01 ? fa_mma_kl_coef(ct[n].y * b->st, cs[n].y * b->ss, sq1, gq1, b->reverse, teacher) : 0.0f;
    ct[n].z = v10 ? fa_mma_kl_coef(ct[n].z * b->st, cs[n].z * b->ss, sq0, gq0, b->reverse, teacher) : 0.0f;
    ct[n].w = v11 ? fa_mma_kl_coef(ct[n].w * b->st, cs[n].w * b->ss, sq1, gq1, b->reverse, teacher) : 0.0f;
  }
}

/* A dK team's end: the lane's rows r0, r0 + 8 (key positions k_pos0 on) of side `teacher`'s gradient,
 * or of this unit's partial sums [units, hkv, 64, d] (reduced in unit order), times the side's scale,
 * NaN where the quad's flags say a row saw a non-finite value. */
static inline __attribute__((always_inline)) void fa_mma_kl_dk_store(const fa_gpu_kl *b, int64_t ui, int64_t g,
                                                                      int teacher, const fa_f4 *acc, int D, int r0,
                                                                      int k_pos0, int c0, int ok0, int ok1, int bad0,
                                                                      int bad1, int lane) {
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  const float scale = teacher ? b->st : b->ss;
  const int64_t slot = (ui * b->hkv_t + g) * FA_MMA_ROWS * D, row = b->part ? r0 : k_pos0, head = b->part ? 0 : g;
  const fa_dev_tensor t = b->part ? fa_mma_part_view(b->part + slot, D) : teacher ? b->dkt : b->dks;
  fa_mma_store_rows(t, row, head, acc, D, c0, ok0, ok1, scale, scale, bad0, bad1);
}

static inline __attribute__((always_inline)) void fa_mma_kl_dk_team(const int D, const int f16, const fa_gpu_kl b,
                                                                     int64_t ui, int64_t g, int teacher,
                                                                     unsigned short *smem) {
  const int P = D + 8, BQ = FA_MMA_KL_BQ(D);
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = b.h / b.hkv_t;
  const fa_smem sm = fa_smem_of(smem);
  const int qbuf0 = 0, qbuf1 = 2 * BQ * P, rd0 = 4 * BQ * P, rd1 = rd0 + 10 * BQ;
  unsigned *qbad = (unsigned *)(smem + (FA_MMA_KL_DK_SMEM(D) - 4 * sizeof(unsigned)) / 2);

  /* K_t's and K_s's 64 rows into registers: each warp's 16 keys as A
   * fragments of K Q^T. */
  const fa_mma_kl_frags k = fa_mma_kl_load_frags(sm, P, D, b.kt, g, b.ks, g, blk, tid);

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int kfirst = (int)blk.start, k_pos0 = kfirst + r0, k_pos1 = k_pos0 + 8;
  fa_f4 acc[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) acc[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0;

  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b.seg, b.pair, b.kidx, 0, u, blk, group);
  if (w.j <= u.j1) fa_mma_kl_load_queries(sm, qbuf0, rd0, P, D, BQ, 1, &b, w, g * group + w.hh, tid);
  fa_cp_async_commit();
  int cur = 0;
  while (w.j <= u.j1) {
    const fa_query_walk nx = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, 0, u, blk, group);
    const int qt = cur ? qbuf1 : qbuf0, qst = qt + BQ * P, qside = teacher ? qt : qst;
    const float *rd = (const float *)(smem + (cur ? rd1 : rd0));
    if (nx.j <= u.j1)
      fa_mma_kl_load_queries(sm, cur ? qbuf0 : qbuf1, cur ? rd0 : rd1, P, D, BQ, 1, &b, nx, g * group + nx.hh, tid);
    fa_mma_tile_ready(nx.j <= u.j1, 0);
    const int nq = fa_qwalk_rows(w, BQ);
    const int lo0 = fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb, nq);
    const int lo1 = fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb, nq);
    const int masked = w.causal && w.qb < kfirst + (int)blk.len - 1;
    const unsigned long long qflags = masked ? fa_mma_scan_rows(smem + qside, P, BQ, D, f16, qbad, tid) : 0;

    fa_f4 ct[FA_MMA_KL_BQ(64) / 8], cs[FA_MMA_KL_BQ(64) / 8]; /* 16 keys x BQ queries */
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) ct[n] = cs[n] = fa_f4_zero();
    {
      const int bl = fa_ldsm_b_row(lane) * P + fa_ldsm_b_col(lane); /* constant offsets from here fold */
#pragma unroll
      for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
        for (int np = 0; np < BQ / 16; np++) {
          const fa_u4 bt = fa_ldmatrix_x4(sm, qt + bl + np * 16 * P + ks * 16, 0);
          const fa_u4 bs = fa_ldmatrix_x4(sm, qst + bl + np * 16 * P + ks * 16, 0);
          ct[2 * np] = fa_mma_16816(ct[2 * np], k.t[ks], bt.x, bt.y, f16);
          ct[2 * np + 1] = fa_mma_16816(ct[2 * np + 1], k.t[ks], bt.z, bt.w, f16);
          cs[2 * np] = fa_mma_16816(cs[2 * np], k.s[ks], bs.x, bs.y, f16);
          cs[2 * np + 1] = fa_mma_16816(cs[2 * np + 1], k.s[ks], bs.z, bs.w, f16);
        }
    }
    fa_mma_kl_dk_coefs(ct, cs, BQ, c0, lo0, lo1, nq, qflags, rd, &b, teacher, &bad0, &bad1);
    fa_mma_acc_ab(acc, ct, sm, qside, P, BQ, D, f16, lane); /* dK += C^T Q of the side, Q of [query][dim] */
    ompx_sync_block_acq_rel();
    cur ^= 1;
    w = nx;
  }
  fa_mma_kl_dk_store(&b, ui, g, teacher, acc, D, r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
}
/* ---- f32 inputs split into bf16 pieces ------------------------------------ */

/* The dQ and dK teams of f32 inputs split into NP bf16 pieces (lib/core/split_bf16.h; b.pieces, piece p
 * of input x p * b.pstride[x] elements past the views b.qt, b.kt, b.qs, b.ks): the walks, coefficients,
 * masks and stores of the teams above, with both sides' scores multiplied from the pieces, every A
 * piece read from team memory a k-step at a time (fa_mma_abt_pieces_sa: the gradient's accumulators
 * keep the registers), and dQ += C K, dK += C^T Q with C split in registers (fa_mma_pv_pieces) over the
 * side's pieces. Gradients in f32. Only piece 0 of a non-finite value is non-finite, so the scans
 * read piece 0 alone.
 * dQ team memory (FA_MMA_KL_DQ_SPLIT_SMEM): Q_t's NP pieces [64][P], Q_s's, two buffers of K_t's NP
 * pieces [BK][P] then K_s's (BK: FA_MMA_SPLIT_BK), the flags. dK team memory: K_t's and K_s's pieces
 * [64][P], two query buffers of Q_t's then Q_s's pieces [BQ][P], each buffer's row data, the flags. */
#define FA_MMA_KL_DQ_SPLIT_SMEM(D, NP)                                                                          \
  ((size_t)(2 * (NP) * FA_MMA_ROWS + 4 * (NP) * FA_MMA_SPLIT_BK(D)) * ((D) + 8) * 2 + 4 * sizeof(unsigned))
#define FA_MMA_KL_DK_SPLIT_SMEM(D, NP)                                                                          \
  ((size_t)(2 * (NP) * FA_MMA_ROWS + 4 * (NP) * FA_MMA_KL_BQ(D)) * ((D) + 8) * 2 +                              \
   2 * (FORKATTN_KL_STATS + 1) * FA_MMA_KL_BQ(D) * sizeof(float) + 4 * sizeof(unsigned))

/* NP pieces of x (input xi: 0 q_t, 1 k_t, 2 q_s, 3 k_s) of `rows` rows from row0 (n of them) into tiles
 * `step` elements apart from element at. */
static inline __attribute__((always_inline)) void fa_mma_kl_load_side(fa_smem sm, int at, int step, int NP, int P,
                                                                      int rows, int D, const fa_gpu_kl *b, int xi,
                                                                      int64_t row0, int64_t n, int64_t head,
                                                                      int tid) {
  const fa_dev_tensor x = xi == 0 ? b->qt : xi == 1 ? b->kt : xi == 2 ? b->qs : b->ks;
  fa_mma_load_pieces(sm, at, step, NP, P, rows, D, x, b->pstride[xi], row0, n, head, tid);
}

static inline __attribute__((always_inline)) void fa_mma_kl_dq_split_team(const int D, const int BK, const int NP,
                                                                           const fa_gpu_kl b, fa_block blk,
                                                                           int64_t h, int teacher,
                                                                           unsigned short *smem) {
  const int P = D + 8, RP = FA_MMA_ROWS * P, TP = BK * P;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets: Q_t's pieces, Q_s's, the two buffers (K_t's pieces, then K_s's) */
  const int qtt = 0, qst = NP * RP, buf0 = 2 * NP * RP, buf1 = buf0 + 2 * NP * TP;
  unsigned *kbad = (unsigned *)(smem + buf1 + 2 * NP * TP);
  const int64_t g = h / (b.h / b.hkv_t); /* the students' KV head is the same (same_kv_heads) */

  fa_mma_kl_load_side(sm, qtt, RP, NP, P, FA_MMA_ROWS, D, &b, 0, blk.start, blk.len, h, tid);
  fa_mma_kl_load_side(sm, qst, RP, NP, P, FA_MMA_ROWS, D, &b, 2, blk.start, blk.len, h, tid);
  fa_tile_walk w = fa_walk_first(b.qoff, b.seg, b.pair, blk, 0);
  if (w.pi < w.pend) fa_mma_kl_load_pieces(sm, buf0, P, BK, D, NP, &b, g, g, w, tid);
  fa_cp_async_commit();
  const int al = (warp * 16 + fa_ldsm_a_row(lane)) * P + fa_ldsm_a_col(lane); /* this lane's A address */

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int64_t row0 = blk.start + r0; /* StreamKL plans have qshift 0 */
  const int qfirst = (int)blk.start;
  float st0[FORKATTN_KL_STATS], st1[FORKATTN_KL_STATS], gr[2];
  fa_mma_kl_dq_rows(&b, row0, h, ok0, ok1, st0, st1, gr);
  fa_f4 dq[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, cur = 0;
  while (w.pi < w.pend) {
    const fa_tile_walk nx = fa_walk_next(w, BK, b.seg, b.pair, blk, 0);
    const int kt = cur ? buf1 : buf0, kst = kt + NP * TP, kside = teacher ? kt : kst;
    fa_mma_tile_ready(0, 0); /* tile j (and Q's pieces) landed; iteration j - 1 is done with the other buffer */
    if (nx.pi < nx.pend) fa_mma_kl_load_pieces(sm, cur ? buf0 : buf1, P, BK, D, NP, &b, g, g, nx, tid);
    fa_cp_async_commit();
    const int nk = fa_walk_keys(w, BK);
    const int lim0 = fa_mma_row_keys(ok0, w.causal, (int)row0, w.kb, nk);
    const int lim1 = fa_mma_row_keys(ok1, w.causal, (int)row0 + 8, w.kb, nk);
    const int masked = w.causal && w.kb + BK - 1 > qfirst;
    const unsigned long long kflags = masked ? fa_mma_scan_rows(smem + kside, P, BK, D, 0, kbad, tid) : 0;

    fa_f4 ct[FA_MMA_MAX_BK / 8], cs[FA_MMA_MAX_BK / 8];
    fa_mma_abt_pieces_sa(ct, sm, qtt + al, RP, NP, kt, P, BK, D, lane);  /* S_t = Q_t K_t^T */
    fa_mma_abt_pieces_sa(cs, sm, qst + al, RP, NP, kst, P, BK, D, lane); /* S_s = Q_s K_s^T */
    fa_mma_kl_dq_coefs(ct, cs, BK, c0, lim0, lim1, kflags, st0, st1, gr[0], gr[1], &b, teacher, &bad0, &bad1);
    fa_mma_pv_pieces_rn(dq, ct, NP, sm, kside, P, BK, D, lane); /* dQ += C K of the side, its pieces */
    cur ^= 1;
    w = nx;
  }
  bad0 = fa_mma_quad_any(bad0, lane), bad1 = fa_mma_quad_any(bad1, lane);
  const float scale = teacher ? b.st : b.ss;
  fa_mma_store_rows(teacher ? b.dqt : b.dqs, row0, h, dq, D, c0, ok0, ok1, scale, scale, bad0, bad1);
}

static inline __attribute__((always_inline)) void fa_mma_kl_dk_split_team(const int D, const int NP,
                                                                           const fa_gpu_kl b, int64_t ui, int64_t g,
                                                                           int teacher, unsigned short *smem) {
  const int P = D + 8, BQ = FA_MMA_KL_BQ(D), RP = FA_MMA_ROWS * P, TP = BQ * P;
  const int tid = ompx_thread_id_x(), warp = tid / 32, lane = tid % 32;
  const fa_key_unit u = b.units[ui];
  const fa_block blk = b.kblocks[u.block];
  const int64_t group = b.h / b.hkv_t;
  const fa_smem sm = fa_smem_of(smem);
  /* element offsets: K_t's pieces, K_s's, two query buffers (Q_t's pieces, then Q_s's), their row data */
  const int ktt = 0, kst = NP * RP, qbuf0 = 2 * NP * RP, qstep = 2 * NP * TP, rd0 = qbuf0 + 2 * qstep;
  const int rdstep = 2 * (FORKATTN_KL_STATS + 1) * BQ; /* elements of one buffer's row data */
  unsigned *qbad = (unsigned *)(smem + rd0 + 2 * rdstep);

  fa_mma_kl_load_side(sm, ktt, RP, NP, P, FA_MMA_ROWS, D, &b, 1, blk.start, blk.len, g, tid);
  fa_mma_kl_load_side(sm, kst, RP, NP, P, FA_MMA_ROWS, D, &b, 3, blk.start, blk.len, g, tid);
  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b.seg, b.pair, b.kidx, 0, u, blk, group);
  if (w.j <= u.j1) fa_mma_kl_load_queries(sm, qbuf0, rd0, P, D, BQ, NP, &b, w, g * group + w.hh, tid);
  fa_cp_async_commit();
  const int al = (warp * 16 + fa_ldsm_a_row(lane)) * P + fa_ldsm_a_col(lane); /* this lane's A address */

  const int r0 = warp * 16 + fa_acc_row(lane, 0), c0 = fa_acc_col(lane, 0);
  const int ok0 = r0 < blk.len, ok1 = r0 + 8 < blk.len;
  const int kfirst = (int)blk.start, k_pos0 = kfirst + r0, k_pos1 = k_pos0 + 8;
  fa_f4 acc[FA_MMA_MAX_D / 8];
#pragma unroll
  for (int n = 0; n < D / 8; n++) acc[n] = fa_f4_zero();
  int bad0 = 0, bad1 = 0, cur = 0;
  while (w.j <= u.j1) {
    const fa_query_walk nx = fa_qwalk_next(w, BQ, b.seg, b.pair, b.kidx, 0, u, blk, group);
    const int qt = qbuf0 + cur * qstep, qs = qt + NP * TP, qside = teacher ? qt : qs;
    const float *rd = (const float *)(smem + rd0 + cur * rdstep);
    fa_mma_tile_ready(0, 0); /* tile j (and K's pieces) landed; iteration j - 1 is done with the other buffer */
    if (nx.j <= u.j1)
      fa_mma_kl_load_queries(sm, qbuf0 + (cur ^ 1) * qstep, rd0 + (cur ^ 1) * rdstep, P, D, BQ, NP, &b, nx,
                             g * group + nx.hh, tid);
    fa_cp_async_commit();
    const int nq = fa_qwalk_rows(w, BQ);
    const int lo0 = fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb, nq);
    const int lo1 = fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb, nq);
    const int masked = w.causal && w.qb < kfirst + (int)blk.len - 1;
    const unsigned long long qflags = masked ? fa_mma_scan_rows(smem + qside, P, BQ, D, 0, qbad, tid) : 0;

    fa_f4 ct[FA_MMA_KL_BQ(64) / 8], cs[FA_MMA_KL_BQ(64) / 8]; /* 16 keys x BQ queries */
    fa_mma_abt_pieces_sa(ct, sm, ktt + al, RP, NP, qt, P, BQ, D, lane); /* S_t^T = K_t Q_t^T */
    fa_mma_abt_pieces_sa(cs, sm, kst + al, RP, NP, qs, P, BQ, D, lane); /* S_s^T = K_s Q_s^T */
    fa_mma_kl_dk_coefs(ct, cs, BQ, c0, lo0, lo1, nq, qflags, rd, &b, teacher, &bad0, &bad1);
    fa_mma_pv_pieces_rn(acc, ct, NP, sm, qside, P, BQ, D, lane); /* dK += C^T Q of the side, its pieces */
    cur ^= 1;
    w = nx;
  }
  fa_mma_kl_dk_store(&b, ui, g, teacher, acc, D, r0, k_pos0, c0, ok0, ok1, bad0, bad1, lane);
}

/* The split teams at HIGH (3 pieces) and MEDIUM (2) precision. */
static inline __attribute__((always_inline)) void fa_mma_kl_dq_team_f32_high(const int D, const int BK,
                                                                              const fa_gpu_kl b, fa_block blk,
                                                                              int64_t h, int teacher,
                                                                              unsigned short *smem) {
  fa_mma_kl_dq_split_team(D, BK, 3, b, blk, h, teacher, smem);
}
static inline __attribute__((always_inline)) void fa_mma_kl_dq_team_f32_medium(const int D, const int BK,
                                                                                const fa_gpu_kl b, fa_block blk,
                                                                                int64_t h, int teacher,
                                                                                unsigned short *smem) {
  fa_mma_kl_dq_split_team(D, BK, 2, b, blk, h, teacher, smem);
}
static inline __attribute__((always_inline)) void fa_mma_kl_dk_team_f32_high(const int D, const fa_gpu_kl b,
                                                                              int64_t ui, int64_t g, int teacher,
                                                                              unsigned short *smem) {
  fa_mma_kl_dk_split_team(D, 3, b, ui, g, teacher, smem);
}
static inline __attribute__((always_inline)) void fa_mma_kl_dk_team_f32_medium(const int D, const fa_gpu_kl b,
                                                                                int64_t ui, int64_t g, int teacher,
                                                                                unsigned short *smem) {
  fa_mma_kl_dk_split_team(D, 2, b, ui, g, teacher, smem);
}
#pragma omp end declare target

#endif
