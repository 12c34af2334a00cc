/* Team-level pieces of the tensor-core kernels (forward, dQ, dK/dV): the walk
 * over a query block's key tiles across its pairs, cp.async tile loads, the
 * masked score, and the scan that keeps 0 * NaN of a masked row out of the
 * tensor-core products. Everything by value (see gpu_mma.h). Tiles start at
 * the team's dynamic memory (16-byte aligned: DynamicSharedBuffer in LLVM
 * 19's device runtime) and rows are (D + 8) * 2 bytes apart, a multiple of
 * 16, as cp.async and ldmatrix require. */
#ifndef FORKATTN_GPU_MMA_TILES_H
#define FORKATTN_GPU_MMA_TILES_H
#include <math.h>
#include <stdint.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_mma.h"
#include "gpu_stage.h"
#include "segment_plan.h"

#define FA_MMA_THREADS 128 /* 4 warps */
#define FA_MMA_MAX_D 128   /* head_dims 64 and 128 */
#define FA_MMA_MAX_BK 64   /* keys per tile: 64 at head_dim 64, 32 at 128 */
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
/* Rows (plus qshift) and pair indices of a plan the kernels take: their walks
 * keep positions in 32 bits, with room for a tile past the end. */
#define FA_MMA_MAX_POS (INT32_MAX - 1024)

/* 1 when plan p fits the kernels' 32-bit walks (FA_MMA_MAX_POS); 2^31 rows of
 * head_dim 64 in 16 bits would take 256 GiB. */
static inline int fa_mma_plan_fits(const fa_plan *p) {
  return p->qshift >= 0 && p->rows + p->qshift < FA_MMA_MAX_POS && p->npairs < FA_MMA_MAX_POS;
}

#pragma omp declare target
/* A team's walk over key tiles: pair pi (up to pend), tile [kb, kb + BK) of
 * the pair's visible keys [.., kend). 32-bit (FA_MMA_MAX_POS): registers and
 * instructions in the hot loop. Passed by value (see gpu_mma.h). */
typedef struct fa_tile_walk {
  int pi, pend, kb, kend, causal;
} fa_tile_walk;

/* First tile at or after pair w.pi whose pair sees keys (w.pi == w.pend: done). */
static inline fa_tile_walk fa_walk_seek(fa_tile_walk w, const fa_range *seg, const fa_pair *pair, fa_block blk,
                                        int64_t qshift) {
  for (; w.pi < w.pend; w.pi++) {
    const fa_range k = fa_pair_keys(seg, pair[w.pi], blk.start, blk.len, qshift);
    if (k.len > 0) {
      w.kb = (int)k.start;
      w.kend = (int)(k.start + k.len);
      w.causal = pair[w.pi].causal != 0;
      return w;
    }
  }
  return w;
}

/* The walk of query block blk over its segment's pairs, at its first tile. */
static inline fa_tile_walk fa_walk_first(const int64_t *qoff, const fa_range *seg, const fa_pair *pair, fa_block blk,
                                         int64_t qshift) {
  const fa_tile_walk w = {(int)qoff[blk.seg], (int)qoff[blk.seg + 1], 0, 0, 0};
  return fa_walk_seek(w, seg, pair, blk, qshift);
}

static inline fa_tile_walk fa_walk_next(fa_tile_walk w, int bk, const fa_range *seg, const fa_pair *pair,
                                        fa_block blk, int64_t qshift) {
  w.kb += bk;
  if (w.kb < w.kend) return w;
  w.pi++;
  return fa_walk_seek(w, seg, pair, blk, qshift);
}

/* A key-side team's walk (attention dK/dV, StreamKL dK) over its unit's
 * reader queries: reader j (k_pair_idx index kidx, up to j1), query head hh
 * of the group, tile [qb, qb + BQ) of the reader's queries [.., qend). By
 * value (see gpu_mma.h). */
typedef struct fa_query_walk {
  int j, hh, qb, q0, qend, causal; /* 32-bit: FA_MMA_MAX_POS */
} fa_query_walk;

/* First tile at or after (w.j, w.hh) with queries; w.j > u.j1 when done. */
static inline fa_query_walk fa_qwalk_seek(fa_query_walk w, const fa_range *seg, const fa_pair *pair,
                                          const int64_t *kidx, int64_t qshift, fa_key_unit u, fa_block blk,
                                          int64_t group) {
  for (; w.j <= u.j1; w.j++, w.hh = 0) {
    const fa_pair pr = pair[kidx[w.j]];
    const fa_range qs = fa_pair_queries(seg, pr, blk.start, qshift);
    const int64_t lo = w.j == u.j0 ? u.lo : 0, hi = w.j == u.j1 ? u.hi : qs.len;
    if (hi > lo && w.hh < group) {
      w.q0 = w.qb = (int)(qs.start + lo);
      w.qend = (int)(qs.start + hi);
      w.causal = pr.causal != 0;
      return w;
    }
  }
  return w;
}

static inline fa_query_walk fa_qwalk_next(fa_query_walk w, int bq, const fa_range *seg, const fa_pair *pair,
                                          const int64_t *kidx, int64_t qshift, fa_key_unit u, fa_block blk,
                                          int64_t group) {
  w.qb += bq;
  if (w.qb < w.qend) return w;
  if (++w.hh < group) {
    w.qb = w.q0;
    return w;
  }
  w.j++;
  w.hh = 0;
  return fa_qwalk_seek(w, seg, pair, kidx, qshift, u, blk, group);
}

/* Element offset of (row r, column c) of an R-row tile in the wgmma layout
 * (gpu_wgmma.h), from a 1024-byte aligned base: 64-column slabs of R rows,
 * 128 bytes a row, and in each 8-row block the 16-byte chunks of row r
 * permuted by XOR with r % 8 (the hardware's 128-byte swizzle). */
static inline int fa_wg_elem(int r, int c, int R) {
  return (c >> 6) * R * 64 + (r >> 3) * 512 + (r & 7) * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

/* Team-cooperative cp.async of rows [row0, row0 + n) of head `head` of t
 * (n <= cap) into a cap x D tile of pitch P elements at element dst of team
 * memory m (P == D: the wgmma layout, fa_wg_elem); rows n..cap-1 are
 * zero-filled (masked lanes then multiply finite zeros). */
static inline __attribute__((always_inline)) void fa_mma_load_rows(fa_smem m, int dst, int P, int cap, int D,
                                                                   fa_dev_tensor t, int64_t row0, int64_t n,
                                                                   int64_t head, int tid) {
  const int wg = P == D; /* unpadded: the wgmma layout (fa_wg_elem of a cap-row tile) */
  /* Thread tid copies chunk tid % chunks of rows tid / chunks + i * step: a
   * trip count known at compile time (cap is a multiple of step for every
   * tile shape), so the loop unrolls without remainder code and the row
   * addresses advance by one 64-bit add each (a multiply-add chain per row
   * before). A full tile skips the bounds selects. */
  const int chunks = D / 8, step = FA_MMA_THREADS / chunks; /* 16-byte chunks per row; rows per pass */
  const int r0 = tid / chunks, col = (tid % chunks) * 8;
  const unsigned short *base = (const unsigned short *)t.data + head * t.hs + col;
  const unsigned short *src = base + (row0 + r0) * t.rs, *first = base + row0 * t.rs;
  const int64_t stride = (int64_t)step * t.rs;
  if (n >= cap) {
#pragma unroll
    for (int i = 0; i < cap / step; i++, src += stride)
      fa_cp_async16(m, dst + (wg ? fa_wg_elem(r0 + i * step, col, cap) : (r0 + i * step) * P + col), src, 16);
  } else {
#pragma unroll
    for (int i = 0; i < cap / step; i++, src += stride) {
      const int in = r0 + i * step < n; /* a row past n copies nothing (zero-fill) from row0, which exists */
      fa_cp_async16(m, dst + (wg ? fa_wg_elem(r0 + i * step, col, cap) : (r0 + i * step) * P + col), in ? src : first,
                    in ? 16 : 0);
    }
  }
}


/* Keys of tile w (at most bk). */
static inline int fa_walk_keys(fa_tile_walk w, int bk) { return w.kend - w.kb < bk ? w.kend - w.kb : bk; }

/* cp.async of tile w's rows of two tensors into the buffer at element buf
 * of m: a (head ga) [BK][P], then b (head gb) [BK][P]. Attention: K and V of
 * one KV head; StreamKL: the teacher's and the student's K. */
static inline void fa_mma_load_kv(fa_smem m, int buf, int P, int BK, int D, fa_dev_tensor a, int64_t ga,
                                  fa_dev_tensor b, int64_t gb, fa_tile_walk w, int tid) {
  const int nk = fa_walk_keys(w, BK);
  fa_mma_load_rows(m, buf, P, BK, D, a, w.kb, nk, ga, tid);
  fa_mma_load_rows(m, buf + BK * P, P, BK, D, b, w.kb, nk, gb, tid);
}

/* A double-buffered walk's wait, after the next tile's copies were issued
 * (issued != 0: they form the newest group) or not (the last tile): this
 * thread's copies of the current tile land, then the team's, so the current
 * buffer is complete and visible (wg: to wgmma's async-proxy reads too). */
static inline void fa_mma_tile_ready(int issued, int wg) {
  if (issued) {
    fa_cp_async_commit();
    fa_cp_async_wait(1);
  } else {
    fa_cp_async_wait(0);
  }
  if (wg) fa_fence_proxy_async();
  ompx_sync_block_acq_rel();
}

/* The key walk's step: start tile nx (if any) into `next`, then
 * fa_mma_tile_ready (P == D: the wgmma layout). */
static inline void fa_mma_kv_step(fa_smem m, int next, int P, int BK, int D, fa_dev_tensor a, int64_t ga,
                                  fa_dev_tensor b, int64_t gb, fa_tile_walk nx, int tid) {
  if (nx.pi < nx.pend) fa_mma_load_kv(m, next, P, BK, D, a, ga, b, gb, nx, tid);
  fa_mma_tile_ready(nx.pi < nx.pend, P == D);
}

/* Tile w (BK keys a full tile) hides keys from some rows of a team whose
 * first row sits at key-frame position first: causal, and crossing that
 * row's diagonal. */
static inline __attribute__((always_inline)) int fa_tile_hides_keys(fa_tile_walk w, int BK, int first) {
  return w.causal && w.kb + BK - 1 > first;
}

/* Every row from key-frame position first on sees every one of tile w's nk
 * keys (a full tile not crossing that row's diagonal); with a warp's first
 * row, warp-uniform: its masks can be skipped. */
static inline __attribute__((always_inline)) int fa_tile_all_visible(fa_tile_walk w, int nk, int BK, int first) {
  return nk == BK && (!w.causal || w.kb + BK - 1 <= first);
}

/* Queries of tile w (at most bq). */
static inline __attribute__((always_inline)) int fa_qwalk_rows(fa_query_walk w, int bq) {
  return w.qend - w.qb < bq ? w.qend - w.qb : bq;
}

/* Keys [0, n) of a tile (kb, nk) that a query row at key-frame position
 * q_pos sees: all nk, or for a causal pair those up to its diagonal; 0 for
 * a row outside the block. Computed once per tile so the per-element test
 * is one 32-bit compare. */
static inline int fa_mma_row_keys(int row_ok, int causal, int q_pos, int kb, int nk) {
  if (!row_ok) return 0;
  if (!causal) return nk;
  const int n = q_pos - kb + 1;
  return n < 0 ? 0 : n > nk ? nk : n;
}

/* First query of a tile (first at key-frame position q_first, nq queries)
 * that sees key row k_pos: 0, or for a causal pair the query on its
 * diagonal; nq (none) for a key outside the block. Queries [lo, nq) see it. */
static inline int fa_mma_key_first_query(int key_ok, int causal, int k_pos, int q_first, int nq) {
  if (!key_ok) return nq;
  if (!causal) return 0;
  const int n = k_pos - q_first;
  return n < 0 ? 0 : n > nq ? nq : n;
}

/* Scaled score in log2 units where key < lim (fa_mma_row_keys), else -inf. */
static inline float fa_mma_score(float s, float mul, int key, int lim) { return key < lim ? s * mul : -INFINITY; }

/* The raw score where key < lim (fa_mma_row_keys), else -inf. */
static inline float fa_mma_mask(float s, int key, int lim) { return key < lim ? s : -INFINITY; }


/* acc (16 rows x D) += A B for one warp: A (16 x K) packed from the
 * accumulators a (two n-tiles a k-step: P, dS or a StreamKL score gradient),
 * B (K x D) the tile at element `tile` of team memory, [K][P] rows through
 * ldmatrix.trans. The forward's P V, dQ's dS K, dK's dS^T Q and StreamKL's
 * C K and C^T Q. Pointers to the caller's register arrays: always inlined,
 * they stay registers. */
static inline __attribute__((always_inline)) void fa_mma_acc_ab(fa_f4 *acc, const fa_f4 *a, fa_smem sm, int tile,
                                                                int P, int K, int D, int f16, int lane) {
  const int bl = tile + fa_ldsm_a_row(lane) * P + fa_ldsm_a_col(lane); /* constant offsets from here fold */
#pragma unroll
  for (int kk = 0; kk < K / 16; kk++) {
    const fa_u4 pa = fa_mma_p_frag(a[2 * kk], a[2 * kk + 1], f16);
#pragma unroll
    for (int np = 0; np < D / 16; np++) {
      const fa_u4 b = fa_ldmatrix_x4(sm, bl + kk * 16 * P + np * 16, 1);
      acc[2 * np] = fa_mma_16816(acc[2 * np], pa, b.x, b.y, f16);
      acc[2 * np + 1] = fa_mma_16816(acc[2 * np + 1], pa, b.z, b.w, f16);
    }
  }
}

/* acc (16 rows x N) += A B^T for one warp: A (16 x D) the register
 * fragments a (one a k-step), B (N x D) the tile at element `tile` of team
 * memory, [N][P] rows through ldmatrix. The forward's S = Q K^T, dK/dV's
 * S^T = K Q^T and dP^T = V dO^T (dQ keeps its S and dP in one loop). */
static inline __attribute__((always_inline)) void fa_mma_acc_abt(fa_f4 *acc, const fa_u4 *a, fa_smem sm, int tile,
                                                                 int P, int N, int D, int f16, int lane) {
  const int bl = tile + fa_ldsm_b_row(lane) * P + fa_ldsm_b_col(lane); /* constant offsets from here fold */
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
    for (int np = 0; np < N / 16; np++) {
      const fa_u4 b = fa_ldmatrix_x4(sm, bl + np * 16 * P + ks * 16, 0);
      acc[2 * np] = fa_mma_16816(acc[2 * np], a[ks], b.x, b.y, f16);
      acc[2 * np + 1] = fa_mma_16816(acc[2 * np + 1], a[ks], b.z, b.w, f16);
    }
}

/* Piece p of a b16 tensor split into planes `stride` elements apart (the bf16 pieces of f32 inputs,
 * lib/core/split_bf16.h; p 0: t itself). */
static inline __attribute__((always_inline)) fa_dev_tensor fa_dev_piece(fa_dev_tensor t, int64_t stride, int p) {
  if (p) t.data = (unsigned short *)t.data + p * stride;
  return t;
}

/* Rows [row0, row0 + n) of head `head` of t's NP pieces (planes `stride` elements apart, fa_dev_piece)
 * by cp.async into NP [cap][P] tiles of team memory, `step` elements apart from element dst. */
static inline __attribute__((always_inline)) void fa_mma_load_pieces(fa_smem m, int dst, int step, int NP, int P,
                                                                     int cap, int D, fa_dev_tensor t,
                                                                     int64_t stride, int64_t row0, int64_t n,
                                                                     int64_t head, int tid) {
#pragma unroll
  for (int p = 0; p < NP; p++) fa_mma_load_rows(m, dst + p * step, P, cap, D, fa_dev_piece(t, stride, p), row0, n, head, tid);
}

/* fa_mma_load_kv of split tensors: tile w's rows of a's NA pieces (planes as apart, head ga), then of
 * b's NB pieces (bs, gb), [BK][P] tiles BK * P elements apart from element buf. Attention: K and V;
 * StreamKL: the teacher's and the student's K. */
static inline __attribute__((always_inline)) void fa_mma_load_kv_pieces(fa_smem m, int buf, int P, int BK, int D,
                                                                        fa_dev_tensor a, int64_t as, int64_t ga,
                                                                        int NA, fa_dev_tensor b, int64_t bs,
                                                                        int64_t gb, int NB, fa_tile_walk w,
                                                                        int tid) {
  const int nk = fa_walk_keys(w, BK);
  fa_mma_load_pieces(m, buf, BK * P, NA, P, BK, D, a, as, w.kb, nk, ga, tid);
  fa_mma_load_pieces(m, buf + NA * BK * P, BK * P, NB, P, BK, D, b, bs, w.kb, nk, gb, tid);
}

/* fa_mma_acc_abt with A read from team memory a k-step at a time (ldmatrix
 * at al: this lane's A address in a [16][P] tile, the rows' element plus
 * fa_ldsm_a_row * P + fa_ldsm_a_col): an operand kept out of registers (the
 * third piece of a split f32 Q). */
static inline __attribute__((always_inline)) void fa_mma_acc_abt_sa(fa_f4 *acc, fa_smem sm, int al, int tile, int P,
                                                                    int N, int D, int f16, int lane) {
  const int bl = tile + fa_ldsm_b_row(lane) * P + fa_ldsm_b_col(lane);
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
    const fa_u4 a = fa_ldmatrix_x4(sm, al + ks * 16, 0);
#pragma unroll
    for (int np = 0; np < N / 16; np++) {
      const fa_u4 b = fa_ldmatrix_x4(sm, bl + np * 16 * P + ks * 16, 0);
      acc[2 * np] = fa_mma_16816(acc[2 * np], a, b.x, b.y, f16);
      acc[2 * np + 1] = fa_mma_16816(acc[2 * np + 1], a, b.z, b.w, f16);
    }
  }
}

/* Key block partial sums of one (unit, KV head) slot, [64 rows][d] f32, as a
 * tensor of one head: the dK/dV teams store them like their gradients. */
static inline fa_dev_tensor fa_mma_part_view(float *slot, int64_t d) {
  const fa_dev_tensor t = {slot, FORKATTN_DTYPE_F32, d, 0};
  return t;
}

/* A warp's 16 x D accumulator rows to t: the lane's rows `row` (x, y) and
 * row + 8 (z, w), head `head`, columns from c0; each row times its factor
 * (m0, m1), NaN where flagged (bad0, bad1), nothing for a row outside its
 * block (ok0, ok1). A lane's two columns go out as one store: an f32 pair,
 * or a b16 pair packed by the hardware conversion (round to nearest even,
 * as fa_store). One element at a time, with fa_store's dtype test and
 * software rounding, the forward's epilogue took ~9300 cycles a team
 * (in-kernel timeline). Needs t's data 8-byte
 * (f32) or 4-byte (b16) aligned and even strides (fa_gpu_mma_out_ok asks
 * more). */
typedef struct fa_f2 {
  float x, y;
} __attribute__((aligned(8))) fa_f2;

static inline __attribute__((always_inline)) void fa_mma_store_rows(fa_dev_tensor t, int64_t row, int64_t head,
                                                                    const fa_f4 *acc, int D, int c0, int ok0,
                                                                    int ok1, float m0, float m1, int bad0,
                                                                    int bad1) {
  const int64_t e0 = row * t.rs + head * t.hs + c0, e1 = e0 + 8 * t.rs;
  const float s0 = bad0 ? NAN : m0, s1 = bad1 ? NAN : m1; /* NaN times anything is NaN */
  if (t.dtype == FORKATTN_DTYPE_F32) {
    fa_f2 *p0 = (fa_f2 *)((float *)t.data + e0), *p1 = (fa_f2 *)((float *)t.data + e1);
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      const fa_f2 v0 = {s0 * acc[n].x, s0 * acc[n].y}, v1 = {s1 * acc[n].z, s1 * acc[n].w};
      if (ok0) p0[n * 4] = v0;
      if (ok1) p1[n * 4] = v1;
    }
    return;
  }
  const int f16 = t.dtype == FORKATTN_DTYPE_F16;
  uint32_t *p0 = (uint32_t *)((uint16_t *)t.data + e0), *p1 = (uint32_t *)((uint16_t *)t.data + e1);
#pragma unroll
  for (int n = 0; n < D / 8; n++) {
    if (ok0) p0[n * 4] = fa_mma_pack(s0 * acc[n].x, s0 * acc[n].y, f16);
    if (ok1) p1[n * 4] = fa_mma_pack(s1 * acc[n].z, s1 * acc[n].w, f16);
  }
}

/* 1 when t has 16-byte rows for the tensor-core kernels' 16-byte loads and
 * stores: data 16-byte aligned and both strides multiples of 8 elements, or
 * host memory (host tensors are staged dense, omp_target_alloc-aligned). */
static inline int fa_gpu_mma_rows16(const forkattn_tensor *t, forkattn_memory memory) {
  return memory == FORKATTN_MEMORY_HOST || !((uintptr_t)t->data % 16 || t->row_stride % 8 || t->head_stride % 8);
}

/* 1 when a tensor-core call's outputs t[0..n) suit its stores
 * (fa_mma_store_rows' pairs, the two-warpgroup kernels' 16-byte chunks in
 * fa_wg_store_rows_staged): 16-byte rows, like the inputs (fa_gpu_mma_rows16).
 * A tensor without data (an output the call does not write) passes. */
static inline int fa_gpu_mma_out_ok(const forkattn_tensor *const *t, int n, forkattn_memory memory) {
  for (int i = 0; i < n; i++)
    if (t[i]->data && !fa_gpu_mma_rows16(t[i], memory)) return 0;
  return 1;
}

/* Cooperative scan, by threads [0, nth) of the team (nth 128 or 256, all
 * of it), of rows [r0, r0 + n) of an R-row b16 tile (n = 16, 32 or 64;
 * pitch P): non-finite elements are zeroed, and bit r of the result says
 * row r0 + r had one. flags: nth / 32 words of team memory. Contains team
 * barriers: call from every thread of the team. A masked tile's product
 * multiplies such a row by an exact 0 for the rows or keys that cannot see
 * it; zeroing keeps that 0, and the caller marks NaN the outputs that do
 * see the row. P == D means the tile is in the wgmma layout (the padded
 * layouts have P = D + 8). */
static inline unsigned long long fa_mma_scan_rows_by(unsigned short *t, int P, int R, int r0, int n, int D, int f16,
                                                     unsigned *flags, int tid, int nth) {
  const int tpr = nth / n, r = r0 + tid / tpr, part = tid % tpr, span = D / tpr, lane = tid % 32;
  const int wg = P == D; /* unpadded: the wgmma layout (fa_wg_elem), whose readers need the proxy fence */
  int bad = 0;
  /* 16-byte chunks (span is a multiple of 8; a chunk stays whole under the swizzle): one load and a few
   * integer tests per 8 elements, where one element at a time cost as much as a tile's products (ncu) */
  for (int c = part * span; c < (part + 1) * span; c += 8) {
    unsigned short *e = t + (wg ? fa_wg_elem(r, c, R) : r * P + c);
    const fa_u4 v = fa_load_u4(e);
    const fa_u4 f = {fa_b16x2_finite(v.x, f16), fa_b16x2_finite(v.y, f16), fa_b16x2_finite(v.z, f16),
                     fa_b16x2_finite(v.w, f16)};
    if (f.x != v.x || f.y != v.y || f.z != v.z || f.w != v.w) bad = 1, fa_store_u4(e, f);
  }
  if (wg) fa_fence_proxy_async();
  const unsigned b = fa_mma_ballot(bad); /* lanes [i*tpr, (i+1)*tpr) own row (warp)*32/tpr + i */
  if (lane == 0) {
    unsigned f = 0;
    for (int i = 0; i < 32 / tpr; i++) f |= ((b >> (i * tpr)) & ((1u << tpr) - 1u)) ? 1u << i : 0u;
    flags[tid / 32] = f;
  }
  ompx_sync_block_acq_rel();
  unsigned long long rows = 0;
  for (int w = 0; w < nth / 32; w++) rows |= (unsigned long long)flags[w] << (w * (32 / tpr));
  ompx_sync_block_acq_rel(); /* flags may be rewritten by the next scan */
  return rows;
}

/* fa_mma_scan_rows_by for a team of FA_MMA_THREADS (4 flag words). */
static inline unsigned long long fa_mma_scan_rows(unsigned short *t, int P, int n, int D, int f16,
                                                  unsigned *flags, int tid) {
  return fa_mma_scan_rows_by(t, P, n, 0, n, D, f16, flags, tid, FA_MMA_THREADS);
}
#pragma omp end declare target

/* Team memory of a query-side team: two K/V tile buffers of BK rows of
 * PITCH elements (D + 8 padded for ldmatrix, D in the wgmma layout) and 4
 * flag words. */
#define FA_MMA_QUERY_SMEM(BK, PITCH) ((size_t)(4 * (BK) * (PITCH)) * 2 + 4 * sizeof(unsigned))


/* L(D, F16) for the call's head_dim (64 or 128) and dtype: one kernel per
 * pair, so register arrays have fixed sizes and no dtype branch runs in the
 * loop. Every tensor-core launch dispatches through it. */
#define FA_MMA_BY_HEAD_DIM(L, d, f16)                                                                           \
  do {                                                                                                        \
    if ((d) == 128 && (f16)) L(128, 1);                                                                       \
    else if ((d) == 128) L(128, 0);                                                                           \
    else if (f16) L(64, 1);                                                                                   \
    else L(64, 0);                                                                                            \
  } while (0)

/* Keys per tile of the mma.sync query-side kernels (forward, dQ, StreamKL):
 * 32 at head_dim 128 (registers), 64 at 64. */
#define FA_MMA_BK(D) ((D) == 128 ? 32 : 64)
/* Keys per tile of the teams that multiply f32 inputs as bf16 pieces (the forward and the StreamKL
 * forward): half the bf16 teams', so that S, its successor and the register pieces of Q fit without
 * spilling, and the pieces' buffers in team memory */
#define FA_MMA_SPLIT_BK(D) (FA_MMA_BK(D) / 2)

#endif
