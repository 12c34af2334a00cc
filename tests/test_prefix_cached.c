/* forkattn_prefix_cached_fwd/bwd: responses attending to a cached
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

/* ---- block-causal (forkattn_prefix_cached_block_fwd/bwd) --------------------------- */

/* Rows [r0, r0+n) of a contiguous f32 tensor copied into dst (contiguous). */
static void bc_copy_rows(const forkattn_tensor *t, int64_t r0, int64_t n, float *dst) {
  memcpy(dst, (const float *)t->data + r0 * t->row_stride, sizeof(float) * (size_t)(n * t->row_stride));
}

/* Forward against a float64 computation straight from the block-causal mask;
 * backward against the definition: block j of response i is a bidirectional
 * cached call whose prefix is [prefix ; blocks 0..j-1], and the key gradients
 * of all those calls add up (f32 sums in another order: 1e-5 relative). */
static void bc_run(const char *name, int64_t P, int64_t n, const int64_t *lens, int64_t block, int64_t hq,
                   int64_t hkv, int64_t d) {
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  int64_t off[5] = {0};
  for (int i = 0; i < n; i++) off[i + 1] = off[i] + lens[i];
  const int64_t R = off[n], T = P + R;
  const forkattn_prefix_layout lay = {P, n, off, FORKATTN_MASK_BIDIRECTIONAL};
  const float scale = 1.0f / sqrtf((float)d);
  tc_buf b[9];
  const int64_t rows[9] = {R, T, T, R, R, R, T, T, R}, heads[9] = {hq, hkv, hkv, hq, hq, hq, hkv, hkv, hq};
  forkattn_tensor t[9]; /* q k v o dout dq dk dv, [8] scratch */
  for (int i = 0; i < 9; i++) t[i] = tc_buf_contiguous(&b[i], FORKATTN_DTYPE_F32, rows[i], heads[i], d);
  for (int i = 0; i < 5; i++) tc_fill_tensor(&rng, &t[i], -1.5, 1.5);
  float *lse = malloc(sizeof(float) * (size_t)(R * hq + 1));
  for (int i = 3; i < 8; i++)
    if (i != 4) tc_buf_poison(&b[i]);
  cr_assert_eq(forkattn_prefix_cached_block_fwd(ctx, &lay, block, &t[0], &t[1], &t[2], &t[3], lse, scale,
                                                FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s: %s", name, forkattn_ctx_last_error(ctx));
  /* float64 forward */
  const float *q = t[0].data, *k = t[1].data, *v = t[2].data, *o = t[3].data;
  double worst = 0.0, worst_lse = 0.0;
  for (int64_t i = 0; i < n; i++)
    for (int64_t r = off[i]; r < off[i + 1]; r++)
      for (int64_t h = 0; h < hq; h++) {
        const int64_t g = h / (hq / hkv), qb = (r - off[i]) / block;
        double m = -INFINITY, l = 0.0, acc[256] = {0};
        for (int64_t key = 0; key < T; key++) {
          const int own = key >= P + off[i] && key < P + off[i + 1];
          if (!(key < P || (own && (key - P - off[i]) / block <= qb))) continue;
          double s = 0.0;
          for (int64_t c = 0; c < d; c++) s += (double)q[(r * hq + h) * d + c] * k[(key * hkv + g) * d + c];
          s *= scale;
          const double m2 = fmax(m, s), a = exp(m - m2), p = exp(s - m2);
          l = l * a + p;
          for (int64_t c = 0; c < d; c++) acc[c] = acc[c] * a + p * v[(key * hkv + g) * d + c];
          m = m2;
        }
        for (int64_t c = 0; c < d; c++) worst = fmax(worst, fabs(o[(r * hq + h) * d + c] - acc[c] / l));
        worst_lse = fmax(worst_lse, fabs(lse[r * hq + h] - (m + log(l))));
      }
  cr_assert(worst <= 1e-5 && worst_lse <= 1e-4, "%s: o off by %g, lse by %g against float64", name, worst, worst_lse);

  cr_assert_eq(forkattn_prefix_cached_block_bwd(ctx, &lay, block, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6],
                                                &t[7], scale, FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s: %s", name, forkattn_ctx_last_error(ctx));
  for (int i = 5; i < 8; i++) {
    tc_write_check wc = tc_buf_check(&b[i]);
    cr_assert(wc.guard_bad == 0 && wc.unwritten == 0, "%s: gradient %d: %zu guard bytes, %zu unwritten", name, i,
              wc.guard_bad, wc.unwritten);
  }
  /* the definition, block by block */
  double *dk = calloc((size_t)(T * hkv * d), sizeof(double)), *dv = calloc((size_t)(T * hkv * d), sizeof(double));
  float *kb = malloc(sizeof(float) * (size_t)(T * hkv * d)), *vb = malloc(sizeof(float) * (size_t)(T * hkv * d));
  float *qb = malloc(sizeof(float) * (size_t)(block * hq * d)), *ob = malloc(sizeof(float) * (size_t)(block * hq * d));
  float *db = malloc(sizeof(float) * (size_t)(block * hq * d)), *dqb = malloc(sizeof(float) * (size_t)(block * hq * d));
  float *dkb = malloc(sizeof(float) * (size_t)(T * hkv * d)), *dvb = malloc(sizeof(float) * (size_t)(T * hkv * d));
  float *lb = malloc(sizeof(float) * (size_t)(block * hq));
  double worst_dq = 0.0, max_dq = 0.0;
  const float *dqlib = t[5].data;
  for (int64_t i = 0; i < n; i++)
    for (int64_t r0 = off[i]; r0 < off[i + 1]; r0 += block) {
      const int64_t nb = off[i + 1] - r0 < block ? off[i + 1] - r0 : block, pre = P + (r0 - off[i]);
      bc_copy_rows(&t[1], 0, P, kb); /* keys: prefix, the response's earlier blocks, this block */
      bc_copy_rows(&t[1], P + off[i], r0 - off[i] + nb, kb + P * hkv * d);
      bc_copy_rows(&t[2], 0, P, vb);
      bc_copy_rows(&t[2], P + off[i], r0 - off[i] + nb, vb + P * hkv * d);
      bc_copy_rows(&t[0], r0, nb, qb);
      bc_copy_rows(&t[4], r0, nb, db);
      int64_t boff[2] = {0, nb};
      const forkattn_prefix_layout bl = {pre, 1, boff, FORKATTN_MASK_BIDIRECTIONAL};
      forkattn_tensor tq = forkattn_tensor_contiguous(qb, FORKATTN_DTYPE_F32, nb, hq, d);
      forkattn_tensor tk = forkattn_tensor_contiguous(kb, FORKATTN_DTYPE_F32, pre + nb, hkv, d);
      forkattn_tensor tv = forkattn_tensor_contiguous(vb, FORKATTN_DTYPE_F32, pre + nb, hkv, d);
      forkattn_tensor to = forkattn_tensor_contiguous(ob, FORKATTN_DTYPE_F32, nb, hq, d);
      forkattn_tensor tdo = forkattn_tensor_contiguous(db, FORKATTN_DTYPE_F32, nb, hq, d);
      forkattn_tensor tdq = forkattn_tensor_contiguous(dqb, FORKATTN_DTYPE_F32, nb, hq, d);
      forkattn_tensor tdk = forkattn_tensor_contiguous(dkb, FORKATTN_DTYPE_F32, pre + nb, hkv, d);
      forkattn_tensor tdv = forkattn_tensor_contiguous(dvb, FORKATTN_DTYPE_F32, pre + nb, hkv, d);
      cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &bl, &tq, &tk, &tv, &to, lb, scale, FORKATTN_MEMORY_HOST), 0);
      cr_assert_eq(forkattn_prefix_cached_bwd(ctx, &bl, &tq, &tk, &tv, &to, &tdo, lb, &tdq, &tdk, &tdv, scale,
                                              FORKATTN_MEMORY_HOST), 0);
      for (int64_t x = 0; x < nb * hq * d; x++) {
        worst_dq = fmax(worst_dq, fabs(dqlib[r0 * hq * d + x] - dqb[x]));
        max_dq = fmax(max_dq, fabs(dqb[x]));
      }
      for (int64_t row = 0; row < pre + nb; row++) { /* scatter back to packed key rows */
        const int64_t dst = row < P ? row : P + off[i] + (row - P);
        for (int64_t x = 0; x < hkv * d; x++) {
          dk[dst * hkv * d + x] += dkb[row * hkv * d + x];
          dv[dst * hkv * d + x] += dvb[row * hkv * d + x];
        }
      }
    }
  cr_assert(worst_dq <= 1e-5 * (1.0 + max_dq), "%s: dq differs from the per-block definition by %g", name, worst_dq);
  tc_err ek = tc_compare_tensor(&t[6], dk), ev = tc_compare_tensor(&t[7], dv);
  cr_assert(ek.rel <= 1e-5 && ev.rel <= 1e-5, "%s: dk rel %g, dv rel %g against the per-block definition", name,
            ek.rel, ev.rel);
  fprintf(stderr, "%s: P=%lld R=%lld block %lld: o/lse vs float64 %.1e/%.1e, dq/dk/dv vs per-block calls %.1e/%.1e/%.1e\n",
          name, (long long)P, (long long)R, (long long)block, worst, worst_lse, worst_dq, ek.rel, ev.rel);
  free(dk); free(dv); free(kb); free(vb); free(qb); free(ob); free(db); free(dqb); free(dkb); free(dvb); free(lb);
  free(lse);
  for (int i = 0; i < 9; i++) tc_buf_free(&b[i]);
  forkattn_ctx_destroy(ctx);
}

Test(block_causal, group_blocks_of_32) {
  const int64_t lens[3] = {100, 0, 64};
  bc_run("block_causal/group_blocks_of_32", 150, 3, lens, 32, 4, 2, 32);
}
Test(block_causal, blocks_of_one_and_no_prefix) {
  const int64_t lens[2] = {17, 9};
  bc_run("block_causal/blocks_of_one", 0, 2, lens, 1, 2, 1, 16);
}
Test(block_causal, one_block_is_bidirectional) {
  const int64_t lens[2] = {40, 23};
  bc_run("block_causal/one_block", 70, 2, lens, 64, 2, 2, 24);
}
/* The block call against the plain cached call with `mask` on the same data:
 * o, lse, dq, dk and dv bitwise equal (the same plan, the same kernels). */
static void bc_same(const char *name, int64_t P, int64_t n, const int64_t *lens, int64_t block, forkattn_mask mask) {
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  const int64_t hq = 4, hkv = 2, d = 32;
  int64_t off[5] = {0};
  for (int i = 0; i < n; i++) off[i + 1] = off[i] + lens[i];
  const int64_t R = off[n], T = P + R;
  const forkattn_prefix_layout blay = {P, n, off, FORKATTN_MASK_BIDIRECTIONAL}, lay = {P, n, off, mask};
  const float scale = 1.0f / sqrtf((float)d);
  tc_buf b[12];
  const int key[12] = {0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1}; /* over the key rows T, or the query rows R */
  forkattn_tensor t[12]; /* q k v dout, then o dq dk dv of the block call [4..7] and of the plain call [8..11] */
  for (int i = 0; i < 12; i++)
    t[i] = tc_buf_contiguous(&b[i], FORKATTN_DTYPE_F32, key[i] ? T : R, key[i] ? hkv : hq, d);
  for (int i = 0; i < 4; i++) tc_fill_tensor(&rng, &t[i], -1.5, 1.5);
  float *lse = malloc(sizeof(float) * (size_t)(2 * R * hq + 1)), *lse2 = lse + R * hq;
  cr_assert_eq(forkattn_prefix_cached_block_fwd(ctx, &blay, block, &t[0], &t[1], &t[2], &t[4], lse, scale,
                                                FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s: block %lld: %s", name, (long long)block, forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_prefix_cached_block_bwd(ctx, &blay, block, &t[0], &t[1], &t[2], &t[4], &t[3], lse, &t[5],
                                                &t[6], &t[7], scale, FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s: block %lld: %s", name, (long long)block, forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &lay, &t[0], &t[1], &t[2], &t[8], lse2, scale, FORKATTN_MEMORY_HOST),
               FORKATTN_OK);
  cr_assert_eq(forkattn_prefix_cached_bwd(ctx, &lay, &t[0], &t[1], &t[2], &t[8], &t[3], lse2, &t[9], &t[10], &t[11],
                                          scale, FORKATTN_MEMORY_HOST),
               FORKATTN_OK);
  const char *what[4] = {"o", "dq", "dk", "dv"};
  for (int i = 0; i < 4; i++)
    cr_assert(!memcmp(t[4 + i].data, t[8 + i].data, sizeof(float) * (size_t)(t[4 + i].rows * t[4 + i].row_stride)),
              "%s: block %lld: %s differs from the %s call", name, (long long)block, what[i],
              mask == FORKATTN_MASK_CAUSAL ? "causal" : "bidirectional");
  cr_assert(!memcmp(lse, lse2, sizeof(float) * (size_t)(R * hq)), "%s: block %lld: lse differs", name,
            (long long)block);
  free(lse);
  for (int i = 0; i < 12; i++) tc_buf_free(&b[i]);
  forkattn_ctx_destroy(ctx);
}

/* Any block_size >= 1 works: one at least as long as every response (up to
 * INT64_MAX, where counting blocks used to overflow) is the bidirectional
 * call; one shorter than a response is checked against float64. */
Test(block_causal, huge_block_sizes_are_bidirectional) {
  const int64_t lens[3] = {40, 0, 23}, R = 63;
  const int64_t same[7] = {INT64_MAX, INT64_MAX - 1, (int64_t)1 << 62, R - 1, R, R + 1, 40};
  for (int i = 0; i < 7; i++) bc_same("block_causal/huge", 70, 3, lens, same[i], FORKATTN_MASK_BIDIRECTIONAL);
  const int64_t one[1] = {50};
  bc_same("block_causal/huge_one", 30, 1, one, INT64_MAX, FORKATTN_MASK_BIDIRECTIONAL);
  bc_same("block_causal/huge_one", 30, 1, one, 50, FORKATTN_MASK_BIDIRECTIONAL);
  bc_same("block_causal/huge_one", 30, 1, one, 51, FORKATTN_MASK_BIDIRECTIONAL);
  bc_run("block_causal/rows_minus_one", 30, 1, one, 49, 4, 2, 32); /* blocks of 49 and 1 */
  bc_run("block_causal/longest_minus_one", 70, 3, lens, 39, 4, 2, 32);
}

/* block_size 1 is the causal call, bitwise (the same plan). */
Test(block_causal, blocks_of_one_are_the_causal_call) {
  const int64_t lens[3] = {33, 0, 70};
  bc_same("block_causal/one_is_causal", 40, 3, lens, 1, FORKATTN_MASK_CAUSAL);
  bc_same("block_causal/one_is_causal_no_prefix", 0, 3, lens, 1, FORKATTN_MASK_CAUSAL);
}

Test(block_causal, bad_block_size) {
  forkattn_ctx *ctx = tc_ctx_default("block_causal/bad_block_size");
  int64_t off[2] = {0, 4};
  const forkattn_prefix_layout lay = {4, 1, off, FORKATTN_MASK_BIDIRECTIONAL};
  float x[8 * 4] = {0};
  forkattn_tensor q = forkattn_tensor_contiguous(x, FORKATTN_DTYPE_F32, 4, 1, 4);
  forkattn_tensor k = forkattn_tensor_contiguous(x, FORKATTN_DTYPE_F32, 8, 1, 4);
  cr_assert_eq(forkattn_prefix_cached_block_fwd(ctx, &lay, 0, &q, &k, &k, &q, NULL, 1.0f, FORKATTN_MEMORY_HOST),
               FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "block_size"), "%s", forkattn_ctx_last_error(ctx));
  forkattn_ctx_destroy(ctx);
}
