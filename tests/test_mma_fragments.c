/* Host check of the tensor-core kernel's fragment logic (offload/gpu_mma.h):
 * the lane maps that address ldmatrix, the accumulator element map the
 * masks use, and the P fragment built from two accumulators. A 32-lane
 * model of ldmatrix.x4 (.trans) and mma.m16n8k16, written from the PTX ISA's
 * fragment tables independently of the kernel, runs the kernel's sequence
 * for one warp (Q fragments, S = Q K^T, P = f(S), O = P V) on random bf16
 * and f16 tiles and compares every element with a direct float64 product.
 * A wrong map scrambles rows or keys: errors of O(1), against 1e-6 here.
 * [ran on host: the GPU kernel itself runs in the GPU suite] */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gpu_mma.h"
#include "test_common.h"

#define LANES 32

static float to_f32(uint16_t h, int f16) { return f16 ? fa_f16_to_f32(h) : fa_bf16_to_f32(h); }
static uint16_t from_f32(float x, int f16) { return f16 ? fa_f32_to_f16(x) : fa_f32_to_bf16(x); }
static float lo_of(uint32_t r, int f16) { return to_f32((uint16_t)(r & 0xffffu), f16); }
static float hi_of(uint32_t r, int f16) { return to_f32((uint16_t)(r >> 16), f16); }

/* ldmatrix.sync.aligned.m8n8.x4[.trans].b16: lane 8i+j gives the address of
 * row j of matrix i (8 consecutive b16). Without .trans lane L receives
 * M_i[L/4][2(L%4)], M_i[L/4][2(L%4)+1]; with .trans M_i[2(L%4)][L/4],
 * M_i[2(L%4)+1][L/4] (low half first). */
static void ldsm_x4(const uint16_t *tile, int pitch, const int row[LANES], const int col[LANES], int trans,
                    fa_u4 out[LANES]) {
  for (int L = 0; L < LANES; L++) {
    uint32_t r[4];
    for (int i = 0; i < 4; i++) {
      int mr0, mc0, mr1, mc1; /* the two elements' (row, col) in matrix i */
      if (!trans) mr0 = mr1 = L / 4, mc0 = 2 * (L % 4), mc1 = mc0 + 1;
      else mc0 = mc1 = L / 4, mr0 = 2 * (L % 4), mr1 = mr0 + 1;
      const uint16_t *row0 = tile + row[8 * i + mr0] * pitch + col[8 * i + mr0];
      const uint16_t *row1 = tile + row[8 * i + mr1] * pitch + col[8 * i + mr1];
      r[i] = (uint32_t)row0[mc0] | (uint32_t)row1[mc1] << 16;
    }
    out[L] = (fa_u4){r[0], r[1], r[2], r[3]};
  }
}

/* mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: g = L/4, t = L%4.
 * A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..).
 * B: b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g). C/D: (g, 2t), (g, 2t+1),
 * (g+8, 2t), (g+8, 2t+1). */
static void mma(fa_f4 c[LANES], const fa_u4 a[LANES], const uint32_t b0[LANES], const uint32_t b1[LANES], int f16) {
  double A[16][16], B[16][8], C[16][8];
  for (int L = 0; L < LANES; L++) {
    const int g = L / 4, t = L % 4;
    const uint32_t ar[4] = {a[L].x, a[L].y, a[L].z, a[L].w};
    for (int i = 0; i < 4; i++) {
      const int r = g + 8 * (i % 2), k = 2 * t + 8 * (i / 2);
      A[r][k] = lo_of(ar[i], f16), A[r][k + 1] = hi_of(ar[i], f16);
    }
    B[2 * t][g] = lo_of(b0[L], f16), B[2 * t + 1][g] = hi_of(b0[L], f16);
    B[2 * t + 8][g] = lo_of(b1[L], f16), B[2 * t + 9][g] = hi_of(b1[L], f16);
    C[g][2 * t] = c[L].x, C[g][2 * t + 1] = c[L].y, C[g + 8][2 * t] = c[L].z, C[g + 8][2 * t + 1] = c[L].w;
  }
  for (int r = 0; r < 16; r++)
    for (int n = 0; n < 8; n++)
      for (int k = 0; k < 16; k++) C[r][n] += A[r][k] * B[k][n];
  for (int L = 0; L < LANES; L++) {
    const int g = L / 4, t = L % 4;
    c[L] = (fa_f4){(float)C[g][2 * t], (float)C[g][2 * t + 1], (float)C[g + 8][2 * t], (float)C[g + 8][2 * t + 1]};
  }
}

static float elem(fa_f4 v, int e) { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; }

/* One warp of the forward: 16 query rows, bk keys, head_dim d, pitch d + 8. */
static void warp_tile(int d, int bk, int f16, tc_rng *rng) {
  enum { MAXD = 128, MAXK = 64 };
  const int P = d + 8;
  static uint16_t q[16 * (MAXD + 8)], k[MAXK * (MAXD + 8)], v[MAXK * (MAXD + 8)];
  for (int i = 0; i < 16 * P; i++) q[i] = from_f32((float)tc_uniform(rng, -1, 1), f16);
  for (int i = 0; i < bk * P; i++) k[i] = from_f32((float)tc_uniform(rng, -1, 1), f16);
  for (int i = 0; i < bk * P; i++) v[i] = from_f32((float)tc_uniform(rng, -1, 1), f16);
  int row[LANES], col[LANES];
  static fa_u4 qf[MAXD / 16][LANES], b[LANES];
  static fa_f4 s[MAXK / 8][LANES], o[MAXD / 8][LANES];
  uint32_t b0[LANES], b1[LANES];
  for (int ks = 0; ks < d / 16; ks++) {
    for (int L = 0; L < LANES; L++) row[L] = fa_ldsm_a_row(L), col[L] = ks * 16 + fa_ldsm_a_col(L);
    ldsm_x4(q, P, row, col, 0, qf[ks]);
  }
  memset(s, 0, sizeof s);
  for (int ks = 0; ks < d / 16; ks++)
    for (int np = 0; np < bk / 16; np++) {
      for (int L = 0; L < LANES; L++) row[L] = np * 16 + fa_ldsm_b_row(L), col[L] = ks * 16 + fa_ldsm_b_col(L);
      ldsm_x4(k, P, row, col, 0, b);
      for (int L = 0; L < LANES; L++) b0[L] = b[L].x, b1[L] = b[L].y;
      mma(s[2 * np], qf[ks], b0, b1, f16);
      for (int L = 0; L < LANES; L++) b0[L] = b[L].z, b1[L] = b[L].w;
      mma(s[2 * np + 1], qf[ks], b0, b1, f16);
    }
  /* S through the accumulator map against Q K^T */
  static double p[16][MAXK];
  for (int n = 0; n < bk / 8; n++)
    for (int L = 0; L < LANES; L++)
      for (int e = 0; e < 4; e++) {
        const int r = fa_acc_row(L, e), key = n * 8 + fa_acc_col(L, e);
        double want = 0;
        for (int c = 0; c < d; c++) want += (double)to_f32(q[r * P + c], f16) * to_f32(k[key * P + c], f16);
        const float got = elem(s[n][L], e);
        cr_assert_leq(fabs(got - want), 1e-5 * (1 + fabs(want)), "d %d bk %d f16 %d: S[%d][%d] = %g, want %g", d, bk,
                      f16, r, key, (double)got, want);
        const float pe = expf(0.25f * got); /* any values: what the kernel feeds P V */
        if (e == 0) s[n][L].x = pe;
        if (e == 1) s[n][L].y = pe;
        if (e == 2) s[n][L].z = pe;
        if (e == 3) s[n][L].w = pe;
        p[r][key] = to_f32(from_f32(pe, f16), f16); /* P is rounded to 16 bits for the product */
      }
  memset(o, 0, sizeof o);
  for (int kk = 0; kk < bk / 16; kk++) {
    fa_u4 pa[LANES];
    for (int L = 0; L < LANES; L++) pa[L] = fa_mma_p_frag(s[2 * kk][L], s[2 * kk + 1][L], f16);
    for (int np = 0; np < d / 16; np++) {
      for (int L = 0; L < LANES; L++) row[L] = kk * 16 + fa_ldsm_a_row(L), col[L] = np * 16 + fa_ldsm_a_col(L);
      ldsm_x4(v, P, row, col, 1, b);
      for (int L = 0; L < LANES; L++) b0[L] = b[L].x, b1[L] = b[L].y;
      mma(o[2 * np], pa, b0, b1, f16);
      for (int L = 0; L < LANES; L++) b0[L] = b[L].z, b1[L] = b[L].w;
      mma(o[2 * np + 1], pa, b0, b1, f16);
    }
  }
  for (int n = 0; n < d / 8; n++)
    for (int L = 0; L < LANES; L++)
      for (int e = 0; e < 4; e++) {
        const int r = fa_acc_row(L, e), c = n * 8 + fa_acc_col(L, e);
        double want = 0;
        for (int key = 0; key < bk; key++) want += p[r][key] * to_f32(v[key * P + c], f16);
        const float got = elem(o[n][L], e);
        cr_assert_leq(fabs(got - want), 1e-5 * (1 + fabs(want)), "d %d bk %d f16 %d: O[%d][%d] = %g, want %g", d, bk,
                      f16, r, c, (double)got, want);
      }
}

Test(mma_fragments, one_warp_qk_and_pv_match_direct_products) {
  tc_rng rng = tc_rng_for("mma_fragments.warp");
  for (int f16 = 0; f16 < 2; f16++) {
    warp_tile(128, 32, f16, &rng); /* the kernel's two shapes */
    warp_tile(64, 64, f16, &rng);
    warp_tile(16, 16, f16, &rng); /* smallest: one k-step, one n-tile pair */
  }
}

/* Lane maps cover each (row, column) of their tiles exactly once. */
Test(mma_fragments, lane_maps_are_bijections) {
  int seen_a[16][16] = {{0}}, seen_b[16][16] = {{0}}, seen_c[16][8] = {{0}};
  for (int L = 0; L < LANES; L++) {
    for (int c = 0; c < 8; c++) {
      seen_a[fa_ldsm_a_row(L)][fa_ldsm_a_col(L) + c]++;
      seen_b[fa_ldsm_b_row(L)][fa_ldsm_b_col(L) + c]++;
    }
    for (int e = 0; e < 4; e++) seen_c[fa_acc_row(L, e)][fa_acc_col(L, e)]++;
  }
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) {
      cr_assert_eq(seen_a[r][c], 1, "A map: (%d, %d) loaded %d times", r, c, seen_a[r][c]);
      cr_assert_eq(seen_b[r][c], 1, "B map: (%d, %d) loaded %d times", r, c, seen_b[r][c]);
      if (c < 8) cr_assert_eq(seen_c[r][c], 1, "accumulator map: (%d, %d) held %d times", r, c, seen_c[r][c]);
    }
}

/* The per-element bases the kernel also has in PTX: packing rounds to
 * nearest even like cvt.rn.{bf16,f16}x2.f32, low half first. */
Test(mma_fragments, pack_rounds_to_nearest_even_low_half_first) {
  tc_rng rng = tc_rng_for("mma_fragments.pack");
  for (int i = 0; i < 10000; i++) {
    const float lo = (float)tc_uniform(&rng, -300, 300), hi = (float)tc_uniform(&rng, -1e-3, 1e-3);
    for (int f16 = 0; f16 < 2; f16++) {
      const uint32_t r = fa_mma_pack(lo, hi, f16);
      cr_assert_eq(r & 0xffffu, from_f32(lo, f16));
      cr_assert_eq(r >> 16, from_f32(hi, f16));
      const double ulp = f16 ? ldexp(1.0, (int)floor(log2(fabs(lo))) - 10) : ldexp(1.0, (int)floor(log2(fabs(lo))) - 7);
      cr_assert_leq(fabs(lo_of(r, f16) - lo), 0.5 * ulp, "lo %.9g packed to %.9g", (double)lo, (double)lo_of(r, f16));
    }
  }
  cr_assert_eq(fa_mma_exp2(-INFINITY), 0.0f, "a masked score gives probability 0");
}
