/* The backward's per-tile gradient steps on accumulator fragments:
 * D = rowsum(dO * O) of a query tile (fa_dq_rowsum*), P = exp2(S - lse)
 * under the masks and dS = P (dP - D) for the dQ teams (fa_dq_tile_p,
 * fa_dq_tile_ds) and for the dK/dV teams, key-major (fa_mma_dkv_rows,
 * fa_mma_dkv_grads) or query-major (fa_dkv_query_major_grads), and the
 * non-finite-row flags they raise. lse arrives in natural log; every step
 * works in log2 units (exp2, the scale times log2 e in `mul`). */
#ifndef FORKATTN_GPU_GRAD_STEP_H
#define FORKATTN_GPU_GRAD_STEP_H
#include <math.h>
#include <stdint.h>

#include "gpu_bwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_wgmma.h"

#pragma omp declare target
/* D = rowsum(dO * O) of this warp's 16 rows of a 64-row dO tile (team
 * memory at dot, pitch P; P == D: the wgmma layout) whose first row is row
 * trow0 of block blk, here instead of in a kernel of its own (a launch
 * costs tens of microseconds). Lanes 2i and 2i + 1 take the halves of row
 * i; O's 16-byte chunks are all requested before the first use (loaded one
 * element at a time, their latency stalls the team). Stored for
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

/* The lse of query row `row` (head h) in log2 units, 0 for a row outside
 * the block (ok == 0). */
static inline __attribute__((always_inline)) float fa_row_lse_log2(const fa_gpu_bwd *b, int ok, int64_t row,
                                                                    int64_t h) {
  return ok ? b->lse[row * b->hq + h] * FA_LOG2E : 0.0f;
}

/* D of query row `row` (head h) computed before the launch (dsum_ready), 0 for a row outside the block. */
static inline __attribute__((always_inline)) float fa_row_d(const fa_gpu_bwd *b, int ok, int64_t row, int64_t h) {
  return ok ? b->dsum[row * b->hq + h] : 0.0f;
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

/* Thread tid (lane: tid % 32, the team's own) of a key-major dK/dV team
 * (FA_MMA_ROWS keys of block blk, 16 a warp): its keys r0 and r0 + 8 of the
 * block (ok0, ok1: they exist) and first fragment column c0; in the key
 * frame, the block's first key (kfirst), the lane's keys (k_pos0, k_pos1)
 * and the queries' shift (qsh). The lane comes from the team and the warp
 * is derived here: the other ways round changed the teams' SASS. */
typedef struct fa_dkv_lane {
  int r0, c0, ok0, ok1, kfirst, qsh, k_pos0, k_pos1;
} fa_dkv_lane;

static inline __attribute__((always_inline)) void fa_dkv_lane_of(fa_dkv_lane *l, int tid, int lane, fa_block blk,
                                                                 int64_t qshift) {
  const int warp = tid / 32;
  l->r0 = warp * 16 + fa_acc_row(lane, 0), l->c0 = fa_acc_col(lane, 0);
  l->ok0 = l->r0 < blk.len, l->ok1 = l->r0 + 8 < blk.len;
  l->kfirst = (int)blk.start, l->qsh = (int)qshift;
  l->k_pos0 = l->kfirst + l->r0, l->k_pos1 = l->k_pos0 + 8;
}

/* A key-major dK/dV tile's masks: its nq queries, the first query each of
 * the lane's keys k_pos0, k_pos1 sees (lo0, lo1: fa_mma_key_first_query),
 * and, where some key of the block (kfirst, klen) cannot see some query of
 * the tile, its non-finite Q and dO rows (at elements qt, ot) zeroed and
 * flagged: the returned flags (fa_mma_scan_rows; team-uniform, barriers).
 * dV += P^T dO and dK += dS^T Q multiply hidden queries' rows by 0; S^T and
 * dP^T, computed from the rows before the scan, see such a row only where
 * the masks select it away, or in a row that is flagged. */
static inline __attribute__((always_inline)) unsigned long long
fa_dkv_tile_masks(unsigned short *smem, int qt, int ot, int P, int BQ, int D, int f16, unsigned *qbad, fa_query_walk w,
                  int qsh, int kfirst, int klen, int ok0, int ok1, int k_pos0, int k_pos1, int tid, int *nq, int *lo0,
                  int *lo1) {
  *nq = fa_qwalk_rows(w, BQ);
  *lo0 = fa_mma_key_first_query(ok0, w.causal, k_pos0, w.qb + qsh, *nq);
  *lo1 = fa_mma_key_first_query(ok1, w.causal, k_pos1, w.qb + qsh, *nq);
  const int masked = w.causal && w.qb + qsh < kfirst + klen - 1;
  return masked ? fa_mma_scan_rows(smem + qt, P, BQ, D, f16, qbad, tid) |
                      fa_mma_scan_rows(smem + ot, P, BQ, D, f16, qbad, tid)
                : 0;
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

/* P and dS of one warp's 16 queries x 64 keys in place of S (s) and dP
 * (dp): l0, l1 the lane's two rows' lse (log2 units), d0, d1 their D.
 * all (warp-uniform): every query of the warp sees every key; otherwise
 * query qi sees key column kc when qi < nq and, causal, kc + kq0 <= qi
 * (kq0: the block's first key minus the tile's first query, key frame). */
static inline __attribute__((always_inline)) void fa_dkv_query_major_grads(fa_f4 *s, fa_f4 *dp, float l0, float l1,
                                                                           float d0, float d1, float mul, int all,
                                                                           int qi0, int nq, int causal, int kq0,
                                                                           int c0) {
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

/* A non-finite query row in [lo, nq) of the tile's flags: the key that sees
 * from query lo on sees it. */
static inline int fa_wg_flag_from(unsigned long long qflags, int lo, int nq) {
  return lo < nq && (qflags >> lo) != 0;
}
#pragma omp end declare target

#endif
