/* The teams' epilogues: the forward's O / l and lse (fa_fwd_finish_rows,
 * fa_fwd_finish), the dK/dV teams' dK and dV or their units' partial sums
 * (fa_mma_dkv_store), and a warpgroup's rows staged through team memory
 * for whole-line stores (fa_wg_store_rows_staged: the two-warpgroup
 * forward's O and dQ's dQ). A row that saw a non-finite value is written
 * NaN. */
#ifndef FORKATTN_GPU_EPILOGUE_H
#define FORKATTN_GPU_EPILOGUE_H
#include <math.h>
#include <stdint.h>

#include "gpu_bwd.h"
#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_wgmma.h"

#pragma omp declare target
/* The end of a lane's two rows (row0, row0 + 8): their sums over the quad,
 * lse written (by the lanes of column 0), and O's factors: 1 / l (0 for an
 * empty row) in i[0], i[1], the flags OR-ed over the quad in bad[0], bad[1]. */
static inline __attribute__((always_inline)) void fa_fwd_finish_rows(const fa_gpu_fwd_args ga, int64_t row0,
                                                                      int64_t h, int c0, int lane, int ok0, int ok1,
                                                                      float m0, float m1, float l0, float l1,
                                                                      float i[2], int bad[2]) {
  l0 += fa_mma_shfl_xor(l0, 1);
  l0 += fa_mma_shfl_xor(l0, 2);
  l1 += fa_mma_shfl_xor(l1, 1);
  l1 += fa_mma_shfl_xor(l1, 2);
  bad[0] = fa_mma_quad_any(bad[0], lane), bad[1] = fa_mma_quad_any(bad[1], lane);
  i[0] = l0 > 0.0f ? fa_mma_rcp(l0) : 0.0f, i[1] = l1 > 0.0f ? fa_mma_rcp(l1) : 0.0f;
  if (ga.lse && c0 == 0) {
    if (ok0) ga.lse[row0 * ga.hq + h] = l0 > 0.0f ? (m0 + log2f(l0)) * FA_LN2 : -INFINITY;
    if (ok1) ga.lse[(row0 + 8) * ga.hq + h] = l1 > 0.0f ? (m1 + log2f(l1)) * FA_LN2 : -INFINITY;
  }
}

/* A warp's output rows row0 and row0 + 8 (ok0, ok1: inside the block):
 * O / l (NaN where bad) and lse = (m + log2 l) ln 2. */
static inline __attribute__((always_inline)) void fa_fwd_finish(const fa_gpu_fwd_args ga, const fa_f4 *o, int D,
                                                                 int64_t row0, int64_t h, int c0, int lane, int ok0,
                                                                 int ok1, float m0, float m1, float l0, float l1,
                                                                 int bad0, int bad1) {
  float i[2];
  int bad[2] = {bad0, bad1};
  fa_fwd_finish_rows(ga, row0, h, c0, lane, ok0, ok1, m0, m1, l0, l1, i, bad);
  fa_mma_store_rows(ga.o, row0, h, o, D, c0, ok0, ok1, i[0], i[1], bad[0], bad[1]);
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

/* A warpgroup's 64 output rows (each warp's 16-row accumulator fragments,
 * times m0 / m1, NaN where flagged) to rows [row0, row0 + nrows) of t (b16,
 * head `head`; nrows may exceed 64 or be <= 0), through 64 x D b16 of free
 * team memory at `stage` (the warpgroup's own query tile after its last
 * product: 1024-byte aligned). The fragments go in as b16 pairs, 16-byte
 * chunk c of row r at c ^ r % 8 (the eight rows of a store instruction hit
 * distinct banks); then each thread copies 16-byte chunks, consecutive
 * threads along a row, so a warp's store covers whole lines. A fragment's
 * own stores (fa_mma_store_rows) touch eight lines with 16 bytes each: in
 * the forward's epilogue ~4000 cycles a team (in-kernel timeline). t needs
 * 16-byte rows (fa_gpu_mma_out_ok). Named barrier `bar` of the warpgroup's
 * 128 threads between the halves; every thread of it calls this. */
static inline __attribute__((always_inline)) void fa_wg_store_rows_staged(fa_dev_tensor t, int64_t row0,
                                                                          int64_t nrows, int64_t head,
                                                                          const fa_f4 *acc, int D,
                                                                          unsigned short *stage, int wt, float m0,
                                                                          float m1, int bad0, int bad1, int bar) {
  const int r = (wt / 32) * 16 + fa_acc_row(wt % 32, 0), q = fa_acc_col(wt % 32, 0) / 2;
  const int f16 = t.dtype == FORKATTN_DTYPE_F16;
  const float s0 = bad0 ? NAN : m0, s1 = bad1 ? NAN : m1; /* NaN times anything is NaN */
  uint32_t *w0 = (uint32_t *)stage + r * (D / 2) + q, *w1 = w0 + 8 * (D / 2); /* rows r and r + 8: same r % 8 */
#pragma unroll
  for (int n = 0; n < D / 8; n++) {
    const int c = (n ^ (r & 7)) * 4;
    w0[c] = fa_mma_pack(s0 * acc[n].x, s0 * acc[n].y, f16);
    w1[c] = fa_mma_pack(s1 * acc[n].z, s1 * acc[n].w, f16);
  }
  fa_wg_bar_sync(bar, 128);
  const int cpr = D / 8; /* 16-byte chunks a row */
  unsigned short *out = (unsigned short *)t.data + row0 * t.rs + head * t.hs;
#pragma unroll
  for (int i = 0; i < 64 * (D / 8) / 128; i++) {
    const int c = wt + 128 * i, row = c / cpr, cc = c % cpr;
    if (row < nrows) fa_store_u4(out + row * t.rs + cc * 8, fa_load_u4(stage + row * D + ((cc ^ (row & 7)) * 8)));
  }
}
#pragma omp end declare target

#endif
