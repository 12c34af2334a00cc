/* NaN/Inf in inputs (documented in docs/reliability.md): a non-finite value
 * in q, k, v or dout reaches only the outputs that depend on it through
 * visible (query, key) pairs; every other output stays finite and equal (to
 * 1e-5 relative) to the run without it. In particular nothing leaks across
 * responses, from the responses into the prompt, or backwards in time through
 * a causal mask (0 * NaN in a masked part of a tile). [host or device] */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "test_common.h"

/* head_dim 128 so bf16/f16 calls take the GPU's tensor-core kernels, whose
 * products would turn 0 * NaN of a masked key into NaN (offload/gpu_tc_fwd_launch.c),
 * and a 70-row prompt so their tiles include the case where a tile crosses
 * the team's first diagonal yet a warp sees all of it (its unmasked path). */
enum { P = 70, N = 3, HQ = 4, HKV = 2, D = 128, G = HQ / HKV };
static const int64_t lens[N] = {13, 0, 17};
#define T (P + 30)

typedef struct {
  double q[T * HQ * D], k[T * HKV * D], v[T * HKV * D], dout[T * HQ * D];
} inputs;
typedef struct {
  double o[T * HQ * D], lse[T * HQ], dq[T * HQ * D], dk[T * HKV * D], dv[T * HKV * D];
} outputs;

static int64_t off[N + 1];

/* Row i sees key row j under the prefix mask. */
static int sees(int causal, int64_t i, int64_t j) {
  if (i < P) return j < P && (!causal || j <= i);
  int64_t r = 0;
  while (!(i - P >= off[r] && i - P < off[r + 1])) r++;
  if (j < P) return 1;
  return j >= P + off[r] && j < P + off[r + 1] && (!causal || j <= i);
}

static void run(forkattn_ctx *ctx, int causal, forkattn_dtype dt, const inputs *in, outputs *out) {
  forkattn_prefix_layout lay = {P, N, off, causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL};
  static float buf[8][T * HQ * D], lse[T * HQ];
  const int64_t heads[8] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  forkattn_tensor t[8];
  for (int i = 0; i < 8; i++) t[i] = forkattn_tensor_contiguous(buf[i], dt, T, heads[i], D);
  ref_tensor_write(&t[0], in->q);
  ref_tensor_write(&t[1], in->k);
  ref_tensor_write(&t[2], in->v);
  ref_tensor_write(&t[4], in->dout);
  cr_assert_eq(forkattn_prefix_fwd(ctx, &lay, &t[0], &t[1], &t[2], &t[3], lse, 0.25f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert_eq(forkattn_prefix_bwd(ctx, &lay, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], 0.25f,
                                   FORKATTN_MEMORY_HOST),
               FORKATTN_OK);
  ref_tensor_read(&t[3], out->o);
  ref_tensor_read(&t[5], out->dq);
  ref_tensor_read(&t[6], out->dk);
  ref_tensor_read(&t[7], out->dv);
  for (int i = 0; i < T * HQ; i++) out->lse[i] = lse[i];
}

/* Which outputs may be affected by a bad value at (tensor, row r, head h)
 * (tensor 0 q, 1 k, 2 v, 3 dout): flags per (row, q-head) and (row, kv-head). */
typedef struct {
  char o[T][HQ], dq[T][HQ], dkv[T][HKV];
} reach;

static void compute_reach(int causal, int tensor, int64_t r, int64_t h, reach *x) {
  memset(x, 0, sizeof *x);
  char rowbad[T][HQ]; /* query rows whose P, o, lse or dout is bad */
  memset(rowbad, 0, sizeof rowbad);
  if (tensor == 0) rowbad[r][h] = 1, x->o[r][h] = 1;
  if (tensor == 1 || tensor == 2)
    for (int64_t i = 0; i < T; i++)
      for (int hh = 0; hh < G; hh++)
        if (sees(causal, i, r)) rowbad[i][h * G + hh] = 1, x->o[i][h * G + hh] = 1;
  if (tensor == 3) rowbad[r][h] = 1;
  for (int64_t i = 0; i < T; i++)
    for (int qh = 0; qh < HQ; qh++) {
      if (!rowbad[i][qh]) continue;
      x->dq[i][qh] = 1;
      for (int64_t j = 0; j < T; j++)
        if (sees(causal, i, j)) x->dkv[j][qh / G] = 1; /* keys the bad row reads */
    }
  if (tensor == 1 || tensor == 2) {
    x->dkv[r][h] = 1;
    for (int64_t i = 0; i < T; i++) /* dq of rows reading the bad key */
      for (int hh = 0; hh < G; hh++)
        if (sees(causal, i, r)) x->dq[i][h * G + hh] = 1;
  }
}

/* "Unchanged" is to 1e-5 of the tensor's largest value in f32. With bf16/f16
 * outputs, add one rounding step of the dtype (2^-7 / 2^-10) of that value: a
 * tile holding the non-finite value takes an element-wise path instead of the
 * GEMM (cpu_segment_fwd.c: 0 * inf must not reach a product), which sums in
 * another order, so a 1e-8 change in f32 can flip the 16-bit rounding of o in
 * rows that never see the value, and the backward reads that o in
 * D = rowsum(dO * O), moving those rows' gradients by about one step of the
 * largest gradient (seen: 1.5e-5 on a bf16 dq of 6e-4). A leak gives inf or
 * NaN (checked first) or an O(1) change. */
static void expect(const char *what, const double *got, const double *base, int64_t rows, int64_t heads, int64_t d,
                   const char *bad, forkattn_dtype dt, const char *label) {
  const double step = dt == FORKATTN_DTYPE_BF16 ? 0x1p-7 : dt == FORKATTN_DTYPE_F16 ? 0x1p-10 : 0.0;
  double ref = 0;
  for (int64_t i = 0; i < rows * heads * d; i++) ref = fmax(ref, fabs(base[i]));
  for (int64_t i = 0; i < rows; i++)
    for (int64_t h = 0; h < heads; h++) {
      if (bad[i * heads + h]) continue;
      for (int64_t c = 0; c < d; c++) {
        double g = got[(i * heads + h) * d + c], b = base[(i * heads + h) * d + c];
        cr_assert(isfinite(g), "%s: %s[%lld, %lld] became %g but does not depend on the bad value", label, what,
                  (long long)i, (long long)h, g);
        cr_assert(fabs(g - b) <= (1e-5 + step) * ref, "%s: %s[%lld, %lld] changed (%g vs %g)", label, what,
                  (long long)i, (long long)h, g, b);
      }
    }
}

/* The other half of the contract, for a NaN in v or dout: every output that
 * depends on it shows it (a NaN somewhere in its row), so a kernel that
 * contains 0 * NaN of masked keys by zeroing a row must still flag the rows
 * that do see it. The reach is exact there (a NaN value row makes o, dP and D
 * of every reading row NaN; a NaN dout row its dP, D and dV terms); dv does
 * not depend on v. A NaN in q or k makes the reading rows' lse NaN, and the
 * backward gives such rows no gradient (they are not asked here). */
static void expect_shows(const char *what, const double *got, int64_t rows, int64_t heads, int64_t d,
                         const char *bad, const char *label) {
  for (int64_t i = 0; i < rows; i++)
    for (int64_t h = 0; h < heads; h++) {
      if (!bad[i * heads + h]) continue;
      int shows = 0;
      for (int64_t c = 0; c < d && !shows; c++) shows = isnan(got[(i * heads + h) * d + c]);
      cr_assert(shows, "%s: %s[%lld, %lld] depends on the NaN but has none", label, what, (long long)i,
                (long long)h);
    }
}

static void nonfinite_case(int causal, double bad_value, forkattn_dtype dt, const char *label) {
  forkattn_ctx *ctx = tc_ctx_default(label);
  cr_assert_not_null(ctx);
  off[0] = 0;
  for (int i = 0; i < N; i++) off[i + 1] = off[i] + lens[i];
  tc_rng rng = tc_rng_for(label);
  static inputs in, bad;
  static outputs base, got;
  for (int i = 0; i < T * HQ * D; i++) in.q[i] = tc_uniform(&rng, -1, 1), in.dout[i] = tc_uniform(&rng, -1, 1);
  for (int i = 0; i < T * HKV * D; i++) in.k[i] = tc_uniform(&rng, -1, 1), in.v[i] = tc_uniform(&rng, -1, 1);
  run(ctx, causal, dt, &in, &base);
  /* rows: prompt start/middle (40: in a query tile that crosses the diagonal of
   * the prompt's first key block, whose keys 0-31 it sees whole), first and
   * middle rows of response 0, last row of response 2 */
  const int64_t rows[] = {0, 9, 40, P, P + 6, T - 1};
  for (int tensor = 0; tensor < 4; tensor++)
    for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
      const int64_t r = rows[ri], heads = (tensor == 1 || tensor == 2) ? HKV : HQ, h = r % heads;
      bad = in;
      double *arr = tensor == 0 ? bad.q : tensor == 1 ? bad.k : tensor == 2 ? bad.v : bad.dout;
      arr[(r * heads + h) * D + (r % D)] = bad_value;
      run(ctx, causal, dt, &bad, &got);
      reach x;
      compute_reach(causal, tensor, r, h, &x);
      char where[160];
      static const char *const names[4] = {"q", "k", "v", "dout"};
      snprintf(where, sizeof where, "%s: %s bad at row %lld head %lld", label, names[tensor],
               (long long)r, (long long)h);
      expect("o", got.o, base.o, T, HQ, D, &x.o[0][0], dt, where);
      expect("lse", got.lse, base.lse, T, HQ, 1, &x.o[0][0], dt, where);
      expect("dq", got.dq, base.dq, T, HQ, D, &x.dq[0][0], dt, where);
      expect("dk", got.dk, base.dk, T, HKV, D, &x.dkv[0][0], dt, where);
      expect("dv", got.dv, base.dv, T, HKV, D, &x.dkv[0][0], dt, where);
      /* and a NaN does reach what depends on it (an inf may act as a -inf
       * score, i.e. a masked key, so only NaN is checked) */
      if (isnan(bad_value) && tensor >= 2) {
        if (tensor == 2) expect_shows("o", got.o, T, HQ, D, &x.o[0][0], where);
        expect_shows("dq", got.dq, T, HQ, D, &x.dq[0][0], where);
        expect_shows("dk", got.dk, T, HKV, D, &x.dkv[0][0], where);
        if (tensor == 3) expect_shows("dv", got.dv, T, HKV, D, &x.dkv[0][0], where);
      }
      if (isnan(bad_value) && (tensor == 0 || tensor == 2)) {
        const int64_t qh = tensor == 0 ? h : h * G;
        cr_assert(isnan(got.o[(r * HQ + qh) * D + (r % D)]), "%s: o of the row itself should be NaN", where);
      }
      if (isnan(bad_value) && tensor == 3)
        cr_assert(isnan(got.dq[(r * HQ + h) * D]), "%s: dq of the row itself should be NaN", where);
    }
  forkattn_ctx_destroy(ctx);
}

Test(nonfinite, nan_causal) { nonfinite_case(1, NAN, FORKATTN_DTYPE_F32, "nonfinite/nan_causal"); }
Test(nonfinite, nan_bidirectional) { nonfinite_case(0, NAN, FORKATTN_DTYPE_F32, "nonfinite/nan_bidirectional"); }
Test(nonfinite, inf_causal) { nonfinite_case(1, INFINITY, FORKATTN_DTYPE_F32, "nonfinite/inf_causal"); }
Test(nonfinite, nan_causal_bf16) { nonfinite_case(1, NAN, FORKATTN_DTYPE_BF16, "nonfinite/nan_causal_bf16"); }
Test(nonfinite, inf_causal_f16) { nonfinite_case(1, INFINITY, FORKATTN_DTYPE_F16, "nonfinite/inf_causal_f16"); }
Test(nonfinite, nan_bidirectional_bf16) {
  nonfinite_case(0, NAN, FORKATTN_DTYPE_BF16, "nonfinite/nan_bidirectional_bf16");
}

/* A NaN in v on a launch of many items (65 query blocks x 16 query heads, over 4 items an SM on a
 * 132-SM GPU), where the GPU forward checks V before its kernel (offload/gpu_finite_check_policy.h)
 * and its teams, told V holds one, scan the tiles that hide keys: the NaN reaches exactly the rows
 * of its response at or after it, in its KV head's query heads, in its column (a tile's scan flags
 * such rows whole: NaN in every column, docs/reliability.md); nothing else changes, lse nowhere.
 * [host or device] */
enum { MP = 128, MN = 64, MR = 120, MT = MP + MN * MR, MHQ = 16, MHKV = 2 };

/* The forward of the many-item layout; o's buffer poisoned with the bf16 `poison` first. */
static void forward_many(forkattn_ctx *ctx, const int64_t *moff, const double *q, const double *k, const double *v,
                         uint16_t poison, double *o, float *lse) {
  const forkattn_prefix_layout lay = {MP, MN, moff, FORKATTN_MASK_CAUSAL};
  float *buf[4];
  for (int i = 0; i < 4; i++) cr_assert_not_null(buf[i] = malloc(sizeof(float) * (size_t)MT * MHQ * D));
  const forkattn_tensor tq = forkattn_tensor_contiguous(buf[0], FORKATTN_DTYPE_BF16, MT, MHQ, D),
                        tk = forkattn_tensor_contiguous(buf[1], FORKATTN_DTYPE_BF16, MT, MHKV, D),
                        tv = forkattn_tensor_contiguous(buf[2], FORKATTN_DTYPE_BF16, MT, MHKV, D),
                        to = forkattn_tensor_contiguous(buf[3], FORKATTN_DTYPE_BF16, MT, MHQ, D);
  ref_tensor_write(&tq, q);
  ref_tensor_write(&tk, k);
  ref_tensor_write(&tv, v);
  for (size_t i = 0; i < (size_t)MT * MHQ * D; i++) ((uint16_t *)buf[3])[i] = poison;
  cr_assert_eq(forkattn_prefix_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, 0.125f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  ref_tensor_read(&to, o);
  for (int i = 0; i < 4; i++) free(buf[i]);
}

Test(nonfinite, nan_in_v_of_a_launch_of_many_items_bf16, .timeout = 300) {
  const char *label = "nonfinite/nan_in_v_of_a_launch_of_many_items_bf16";
  forkattn_ctx *ctx = tc_ctx_default(label);
  cr_assert_not_null(ctx);
  int64_t moff[MN + 1];
  for (int i = 0; i <= MN; i++) moff[i] = (int64_t)i * MR;
  const size_t nq = (size_t)MT * MHQ * D, nkv = (size_t)MT * MHKV * D;
  double *q = malloc(sizeof(double) * nq), *k = malloc(sizeof(double) * nkv), *v = malloc(sizeof(double) * nkv);
  double *base = malloc(sizeof(double) * nq), *got = malloc(sizeof(double) * nq);
  float *lse_base = malloc(sizeof(float) * (size_t)MT * MHQ), *lse_got = malloc(sizeof(float) * (size_t)MT * MHQ);
  cr_assert(q && k && v && base && got && lse_base && lse_got);
  tc_rng rng = tc_rng_for(label);
  for (size_t i = 0; i < nq; i++) q[i] = tc_uniform(&rng, -1, 1);
  for (size_t i = 0; i < nkv; i++) k[i] = tc_uniform(&rng, -1, 1), v[i] = tc_uniform(&rng, -1, 1);
  /* o poisoned: NaN where the run must be finite, a finite 0x1.fcp+127 where it must show the NaN */
  forward_many(ctx, moff, q, k, v, 0x7fc1, base, lse_base);
  /* row 7 of response 5, KV head 1, column 3 */
  const int64_t resp = 5, at = 7, row = MP + resp * MR + at, head = 1, col = 3;
  v[((size_t)row * MHKV + head) * D + col] = NAN;
  forward_many(ctx, moff, q, k, v, 0x7f7e, got, lse_got);
  double ref = 0;
  for (size_t i = 0; i < nq; i++) {
    cr_assert(isfinite(base[i]), "%s: the finite run's o[%zu] is %g", label, i, base[i]);
    ref = fmax(ref, fabs(base[i]));
  }
  const double step = 0x1p-7; /* one bf16 step, as expect() */
  for (int64_t i = 0; i < MT; i++)
    for (int64_t h = 0; h < MHQ; h++) {
      const float lb = lse_base[i * MHQ + h], lg = lse_got[i * MHQ + h];
      cr_assert(isfinite(lg) && fabs(lg - lb) <= 1e-5 * fabs(lb) + 1e-6, "%s: lse[%lld, %lld] %g, was %g", label,
                (long long)i, (long long)h, lg, lb);
      const int sees = i >= row && i < MP + (resp + 1) * MR && h / (MHQ / MHKV) == head;
      for (int64_t c = 0; c < D; c++) {
        const double g = got[(i * MHQ + h) * D + c], b = base[(i * MHQ + h) * D + c];
        if (sees && c == col)
          cr_assert(isnan(g), "%s: o[%lld, %lld, %lld] reads the NaN but is %g", label, (long long)i, (long long)h,
                    (long long)c, g);
        else if (!(sees && isnan(g))) /* a row that reads it may be NaN in every column (the flag) */
          cr_assert(isfinite(g) && fabs(g - b) <= (1e-5 + step) * ref, "%s: o[%lld, %lld, %lld] %g, was %g", label,
                    (long long)i, (long long)h, (long long)c, g, b);
      }
    }
  free(q), free(k), free(v), free(base), free(got), free(lse_base), free(lse_got);
  forkattn_ctx_destroy(ctx);
}
