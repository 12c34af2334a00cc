/* forkattn_prefix_cached_fwd/bwd (issue 6): responses attending to a cached
 * prefix's K/V, checked against the float64 shared-prompt reference run on
 * the full packed rows [prefix ; responses] with the prefix rows' dout = 0
 * (so the prefix's own queries contribute nothing, as in the cached call).
 * Tolerances as the attention tests (docs/numerics.md): f32 1e-5 on o and lse,
 * 1e-4 on gradients (relative to the tensor's largest value); bf16 2e-2.
 * Outputs are poisoned first: every element must be written, guards intact. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "test_common.h"

typedef struct pc_case {
  int64_t P, n, lens[4], hq, hkv, d;
  forkattn_mask mask;
  forkattn_dtype dtype;
} pc_case;

static void pc_check(const char *name, const char *what, const forkattn_tensor *t, tc_buf *b, const double *want,
                     double tol) {
  tc_write_check wc = tc_buf_check(b);
  cr_assert(wc.guard_bad == 0 && wc.unwritten == 0, "%s: %s: %zu guard bytes changed, %zu elements unwritten", name,
            what, wc.guard_bad, wc.unwritten);
  tc_err e = tc_compare_tensor(t, want);
  char msg[256];
  tc_err_format(msg, sizeof msg, what, &e, t->heads, t->head_dim);
  cr_assert(e.nonfinite == 0 && e.rel <= tol, "%s: %s (tol %g)", name, msg, tol);
}

static void pc_run(const char *name, const pc_case *c) {
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert(ctx);
  int64_t off[5] = {0};
  for (int i = 0; i < c->n; i++) off[i + 1] = off[i] + c->lens[i];
  const int64_t R = off[c->n], T = c->P + R, hq = c->hq, hkv = c->hkv, d = c->d;
  const forkattn_prefix_layout lay = {c->P, c->n, off, c->mask};
  const float scale = 1.0f / sqrtf((float)d);
  /* library tensors: q/o/dout/dq over the responses only, k/v/dk/dv over all rows */
  tc_buf bq, bk, bv, bo, bdo, bdq, bdk, bdv, blse;
  forkattn_tensor q = tc_buf_contiguous(&bq, c->dtype, R, hq, d), k = tc_buf_contiguous(&bk, c->dtype, T, hkv, d);
  forkattn_tensor v = tc_buf_contiguous(&bv, c->dtype, T, hkv, d), o = tc_buf_contiguous(&bo, c->dtype, R, hq, d);
  forkattn_tensor dout = tc_buf_contiguous(&bdo, c->dtype, R, hq, d), dq = tc_buf_contiguous(&bdq, c->dtype, R, hq, d);
  forkattn_tensor dk = tc_buf_contiguous(&bdk, c->dtype, T, hkv, d), dv = tc_buf_contiguous(&bdv, c->dtype, T, hkv, d);
  float *lse = tc_buf_f32(&blse, R * hq);
  tc_fill_tensor(&rng, &q, -1.5, 1.5);
  tc_fill_tensor(&rng, &k, -1.5, 1.5);
  tc_fill_tensor(&rng, &v, -1.0, 1.0);
  tc_fill_tensor(&rng, &dout, -1.0, 1.0);
  /* float64 reference on the full rows: prefix queries random, their dout 0 */
  double *fq = calloc((size_t)(T * hq * d), sizeof(double)), *fk = malloc(sizeof(double) * (size_t)(T * hkv * d));
  double *fv = malloc(sizeof(double) * (size_t)(T * hkv * d)), *fdo = calloc((size_t)(T * hq * d), sizeof(double));
  double *ro = malloc(sizeof(double) * (size_t)(T * hq * d + 1)), *rlse = malloc(sizeof(double) * (size_t)(T * hq + 1));
  double *rdq = malloc(sizeof(double) * (size_t)(T * hq * d + 1)), *rdk = malloc(sizeof(double) * (size_t)(T * hkv * d + 1));
  double *rdv = malloc(sizeof(double) * (size_t)(T * hkv * d + 1));
  cr_assert(fq && fk && fv && fdo && ro && rlse && rdq && rdk && rdv);
  for (int64_t i = 0; i < c->P * hq * d; i++) fq[i] = tc_uniform(&rng, -1.5, 1.5);
  ref_tensor_read(&q, fq + c->P * hq * d);
  ref_tensor_read(&dout, fdo + c->P * hq * d);
  ref_tensor_read(&k, fk);
  ref_tensor_read(&v, fv);
  const ref_prefix_args args = {&lay, hq, hkv, d, scale, fq, fk, fv, fdo};
  const ref_prefix_out out = {ro, rlse, rdq, rdk, rdv};
  cr_assert_eq(ref_prefix(&args, &out), 0);

  const double tol = c->dtype == FORKATTN_DTYPE_F32 ? 1e-5 : 2e-2, gtol = c->dtype == FORKATTN_DTYPE_F32 ? 1e-4 : 2e-2;
  tc_buf_poison(&bo);
  tc_buf_poison(&blse);
  cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &lay, &q, &k, &v, &o, lse, scale, FORKATTN_MEMORY_HOST), FORKATTN_OK,
               "%s: %s", name, forkattn_ctx_last_error(ctx));
  if (R > 0) {
    pc_check(name, "o", &o, &bo, ro + c->P * hq * d, tol);
    tc_err e = tc_compare_f32(lse, rlse + c->P * hq, R * hq);
    cr_assert(e.nonfinite == 0 && e.max_abs <= 1e-4 * (1.0 + e.max_ref), "%s: lse max_abs %g", name, e.max_abs);
  }
  tc_buf_poison(&bdq);
  tc_buf_poison(&bdk);
  tc_buf_poison(&bdv);
  cr_assert_eq(forkattn_prefix_cached_bwd(ctx, &lay, &q, &k, &v, &o, &dout, lse, &dq, &dk, &dv, scale,
                                          FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s: %s", name, forkattn_ctx_last_error(ctx));
  if (R > 0) pc_check(name, "dq", &dq, &bdq, rdq + c->P * hq * d, gtol);
  if (R == 0) /* nothing reads the prefix: its gradients are exactly 0 */
    for (int64_t i = 0; i < T * hkv * d; i++) rdk[i] = rdv[i] = 0.0;
  pc_check(name, "dk", &dk, &bdk, rdk, gtol);
  pc_check(name, "dv", &dv, &bdv, rdv, gtol);
  fprintf(stderr, "%s: P=%lld R=%lld heads %lld/%lld d=%lld %s %s: o, lse, dq, dk, dv within tolerance\n", name,
          (long long)c->P, (long long)R, (long long)hq, (long long)hkv, (long long)d, ref_dtype_name(c->dtype),
          c->mask == FORKATTN_MASK_CAUSAL ? "causal" : "bidirectional");
  free(fq); free(fk); free(fv); free(fdo); free(ro); free(rlse); free(rdq); free(rdk); free(rdv);
  tc_buf_free(&bq); tc_buf_free(&bk); tc_buf_free(&bv); tc_buf_free(&bo); tc_buf_free(&bdo);
  tc_buf_free(&bdq); tc_buf_free(&bdk); tc_buf_free(&bdv); tc_buf_free(&blse);
  forkattn_ctx_destroy(ctx);
}

Test(cached, bidirectional_group_f32) {
  pc_run("cached/bidirectional_group_f32",
         &(pc_case){300, 4, {37, 0, 130, 64}, 8, 2, 64, FORKATTN_MASK_BIDIRECTIONAL, FORKATTN_DTYPE_F32});
}
Test(cached, causal_group_f32) {
  pc_run("cached/causal_group_f32", &(pc_case){257, 3, {129, 1, 70}, 4, 4, 33, FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_F32});
}
Test(cached, bidirectional_bf16) {
  pc_run("cached/bidirectional_bf16",
         &(pc_case){128, 2, {50, 77}, 6, 3, 128, FORKATTN_MASK_BIDIRECTIONAL, FORKATTN_DTYPE_BF16});
}
Test(cached, no_prefix_rows) {
  pc_run("cached/no_prefix_rows", &(pc_case){0, 2, {20, 9}, 2, 1, 16, FORKATTN_MASK_BIDIRECTIONAL, FORKATTN_DTYPE_F32});
}
Test(cached, no_response_rows) { /* dk/dv of an unread prefix: zeros */
  pc_run("cached/no_response_rows", &(pc_case){40, 2, {0, 0}, 2, 2, 8, FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_F32});
}

/* Wrong row counts are refused with the tensor named, outputs untouched. */
Test(cached, bad_shapes) {
  forkattn_ctx *ctx = tc_ctx_default("cached/bad_shapes");
  int64_t off[3] = {0, 5, 9};
  const forkattn_prefix_layout lay = {10, 2, off, FORKATTN_MASK_BIDIRECTIONAL};
  float q[19 * 8], k[19 * 8], v[19 * 8], o[19 * 8], lse[19];
  for (int i = 0; i < 19 * 8; i++) q[i] = k[i] = v[i] = (float)(i % 7) * 0.1f;
  memset(o, 0x5a, sizeof o);
  forkattn_tensor tq = forkattn_tensor_contiguous(q, FORKATTN_DTYPE_F32, 19, 1, 8); /* should be 9 rows */
  forkattn_tensor tk = forkattn_tensor_contiguous(k, FORKATTN_DTYPE_F32, 19, 1, 8);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, FORKATTN_DTYPE_F32, 19, 1, 8);
  forkattn_tensor to = forkattn_tensor_contiguous(o, FORKATTN_DTYPE_F32, 9, 1, 8);
  cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, 0.3f, FORKATTN_MEMORY_HOST),
               FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "q:"), "%s", forkattn_ctx_last_error(ctx));
  tq.rows = 9;
  tk.rows = 9; /* keys need P + R = 19 rows */
  cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, 0.3f, FORKATTN_MEMORY_HOST),
               FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "k:"), "%s", forkattn_ctx_last_error(ctx));
  unsigned char want[sizeof o];
  memset(want, 0x5a, sizeof want);
  cr_assert(memcmp(o, want, sizeof o) == 0, "o changed on an error");
  tk.rows = 19;
  cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, 0.3f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  forkattn_ctx_destroy(ctx);
}
