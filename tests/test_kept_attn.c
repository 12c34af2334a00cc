/*
 * test_kept_attn.c - kept-set attention (forkattn_kept_fwd / forkattn_kept_bwd:
 * the compressed rollout's attention, a row sees the keys its layout shows it
 * AND its kept set keeps) against the float64 reference refkept_run() of
 * tests/reference_kl.c (dense mask vis(i,j) AND kept(h,i,j), materialized
 * softmax).
 *
 * Every run: seeded inputs rounded to the dtype (FORKATTN_TEST_SEED=<n>
 * reproduces it), poisoned outputs with guards, all elements written, inputs
 * (and o, lse in the backward) unchanged, no NaN anywhere; fully masked rows
 * have o = 0, lse = -inf and dq = 0 exactly; o/lse/dq/dk/dv within the
 * tolerances of tests/prefix_harness.c (ph_default_tol: f32 o 2e-5, lse 1e-4
 * abs, gradients 1e-4 tensor-relative; bf16 1e-2, 1e-3, 1e-2), which apply
 * unchanged: a kept set only removes keys from a row's softmax, it does not
 * add terms or change their magnitude.
 *
 * Cases: random block masks (half the 64x64 blocks, diagonal kept or not),
 * rows whose block row keeps only the diagonal, fully masked rows (the first
 * row too), CSR kept lists with query_start and compressed_rows (alone and
 * with a block mask), prefix (causal, bidirectional) and tree layouts, f32
 * and bf16, strided tensors; kept == NULL is bitwise forkattn_prefix_fwd/bwd
 * and forkattn_tree_fwd/bwd; argument errors on the kept set.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefix_harness.h"
#include "reference.h"
#include "reference_kl.h"
#include "test_common.h"
#include "tree_builder.h"

#define F32 FORKATTN_DTYPE_F32
#define BF16 FORKATTN_DTYPE_BF16
#define CAUSAL FORKATTN_MASK_CAUSAL
#define BIDIR FORKATTN_MASK_BIDIRECTIONAL

typedef struct pfx {
  int64_t off[8];
  forkattn_prefix_layout p;
  forkattn_layout l;
} pfx;

static void pfx_make(pfx *x, int64_t P, int n, const int64_t *lens, forkattn_mask mask) {
  memset(x, 0, sizeof *x);
  cr_assert(n < 8);
  for (int i = 0; i < n; i++)
    x->off[i + 1] = x->off[i] + lens[i];
  x->p = (forkattn_prefix_layout){P, n, n ? x->off : NULL, mask};
  x->l = (forkattn_layout){&x->p, NULL};
}

static unsigned char *random_blocks(tc_rng *rng, int64_t heads, int64_t nb, int diag) {
  unsigned char *m = malloc((size_t)(heads * nb * nb) + 1);
  cr_assert(m);
  for (int64_t h = 0; h < heads; h++)
    for (int64_t i = 0; i < nb; i++)
      for (int64_t j = 0; j < nb; j++)
        m[(h * nb + i) * nb + j] = (diag && i == j) ? 1 : (unsigned char)tc_randint(rng, 0, 1);
  return m;
}

/* padded rows and heads / head-major with padding (as tests/prefix_harness.c) */
static forkattn_tensor mk(tc_buf *b, forkattn_dtype dt, int64_t T, int64_t H, int64_t d, int strided, int hm) {
  if (!strided)
    return tc_buf_contiguous(b, dt, T, H, d);
  if (hm) {
    const int64_t rs = d + 2, hs = T * rs + 7;
    cr_assert_eq(tc_buf_alloc(b, (size_t)(H * hs + 4), dt), 0);
    return tc_buf_view(b, 1, T, H, d, rs, hs);
  }
  const int64_t hs = d + 3, rs = H * hs + 5;
  cr_assert_eq(tc_buf_alloc(b, (size_t)(T * rs + 8), dt), 0);
  return tc_buf_view(b, 2, T, H, d, rs, hs);
}

static void expect_written(const tc_buf *b, const char *label, const char *what) {
  tc_write_check w = tc_buf_check(b);
  cr_expect_eq(w.guard_bad, 0, "%s: %s: %zu guard/gap bytes overwritten", label, what, w.guard_bad);
  cr_expect_eq(w.unwritten, 0, "%s: %s: %zu elements never written (first %zu)", label, what, w.unwritten,
               w.first_unwritten);
}

static void cmp(const char *label, const char *what, const double *got, const double *want, int64_t n, int64_t heads,
                int64_t d, double tol, int relative) {
  tc_err e = tc_compare_f64(got, want, n);
  char line[320];
  tc_err_format(line, sizeof line, what, &e, heads, d);
  const double metric = relative ? e.rel : e.max_abs;
  const int ok = e.nonfinite == 0 && metric <= tol;
  fprintf(stderr, "  %s %s  [%s %.1e] %s\n", ok ? "ok  " : "FAIL", line, relative ? "rel <=" : "abs <=", tol, label);
  cr_expect(ok, "%s: %s error %.3e exceeds %.1e (%s)", label, what, metric, tol, line);
}

typedef struct ka_case {
  const char *name;
  forkattn_layout layout;
  const forkattn_kept_set *kept;
  int64_t H, hkv, d;
  forkattn_dtype dtype;
  int strided;
  double q_amp; /* 0: 4 */
} ka_case;

/* Returns the number of fully masked (row, head) pairs of the reference. */
static int64_t ka_run(const ka_case *c) {
  const char *label = c->name;
  const int64_t T = refkl_layout_rows(&c->layout), H = c->H, hkv = c->hkv, d = c->d;
  cr_assert(T >= 0);
  fprintf(stderr, "[case] %s: T=%" PRId64 " heads %" PRId64 "/%" PRId64 " d=%" PRId64 " %s%s%s\n", label, T, H, hkv,
          d, ref_dtype_name(c->dtype), c->kept ? " kept" : "", c->strided ? " strided" : "");
  tc_rng rng = tc_rng_for(label);
  forkattn_ctx *ctx = tc_ctx_default(label);
  cr_assert(ctx);
  const int64_t nq = T * H * d, nk = T * hkv * d;
  double *q = malloc(sizeof(double) * (size_t)(nq + 1)), *k = malloc(sizeof(double) * (size_t)(nk + 1));
  double *v = malloc(sizeof(double) * (size_t)(nk + 1)), *dout = malloc(sizeof(double) * (size_t)(nq + 1));
  cr_assert(q && k && v && dout);
  const double qa = c->q_amp > 0 ? c->q_amp : 4.0;
  for (int64_t i = 0; i < nq; i++) {
    q[i] = ref_round_to_dtype(tc_uniform(&rng, -qa, qa), c->dtype);
    dout[i] = ref_round_to_dtype(tc_uniform(&rng, -1, 1), c->dtype);
  }
  for (int64_t i = 0; i < nk; i++) {
    k[i] = ref_round_to_dtype(tc_uniform(&rng, -1, 1), c->dtype);
    v[i] = ref_round_to_dtype(tc_uniform(&rng, -1, 1), c->dtype);
  }
  const double scale = 1.0 / sqrt((double)d);
  /* reference */
  double *ro = malloc(sizeof(double) * (size_t)(nq + 1)), *rl = malloc(sizeof(double) * (size_t)(T * H + 1));
  double *rdq = malloc(sizeof(double) * (size_t)(nq + 1)), *rdk = malloc(sizeof(double) * (size_t)(nk + 1));
  double *rdv = malloc(sizeof(double) * (size_t)(nk + 1));
  cr_assert(ro && rl && rdq && rdk && rdv);
  refkept_args ra = {&c->layout, c->kept, H, hkv, d, (double)(float)scale, q, k, v, dout};
  refkept_out rout = {ro, rl, rdq, rdk, rdv};
  double t0 = tc_now();
  cr_assert_eq(refkept_run(&ra, &rout), 0, "%s: reference failed", label);
  fprintf(stderr, "[time] %s: float64 reference %.3f s\n", label, tc_now() - t0);

  /* library */
  tc_buf bq, bk, bv, bdo, bo, bl, bdq, bdk, bdv;
  forkattn_tensor tq = mk(&bq, c->dtype, T, H, d, c->strided, 0), tk = mk(&bk, c->dtype, T, hkv, d, c->strided, 1);
  forkattn_tensor tv = mk(&bv, c->dtype, T, hkv, d, c->strided, 0), tdo = mk(&bdo, c->dtype, T, H, d, c->strided, 1);
  forkattn_tensor to = mk(&bo, c->dtype, T, H, d, c->strided, 1);
  float *lse = tc_buf_f32(&bl, T * H);
  ref_tensor_write(&tq, q);
  ref_tensor_write(&tk, k);
  ref_tensor_write(&tv, v);
  ref_tensor_write(&tdo, dout);
  tc_buf *ins[4] = {&bq, &bk, &bv, &bdo};
  for (int i = 0; i < 4; i++)
    tc_buf_snapshot(ins[i]);
  tc_buf_poison(&bo);
  tc_buf_poison(&bl);
  t0 = tc_now();
  forkattn_status st = forkattn_kept_fwd(ctx, &c->layout, c->kept, &tq, &tk, &tv, &to, lse, (float)scale,
                                         FORKATTN_MEMORY_HOST);
  const double tf = tc_now() - t0;
  cr_assert_eq(st, FORKATTN_OK, "%s: forkattn_kept_fwd: %s: %s", label, forkattn_status_string(st),
               forkattn_ctx_last_error(ctx));
  for (int i = 0; i < 4; i++)
    cr_expect_eq(tc_buf_changed_bytes(ins[i]), 0, "%s: forward modified input %d", label, i);
  expect_written(&bo, label, "o");
  expect_written(&bl, label, "lse");
  cr_expect_eq(tc_count_nonfinite_tensor(&to), 0, "%s: o has NaN/inf", label);

  tc_buf_snapshot(&bo);
  tc_buf_snapshot(&bl);
  forkattn_tensor tdq = mk(&bdq, c->dtype, T, H, d, c->strided, 1), tdk = mk(&bdk, c->dtype, T, hkv, d, c->strided, 0);
  forkattn_tensor tdv = mk(&bdv, c->dtype, T, hkv, d, c->strided, 1);
  tc_buf_poison(&bdq);
  tc_buf_poison(&bdk);
  tc_buf_poison(&bdv);
  t0 = tc_now();
  st = forkattn_kept_bwd(ctx, &c->layout, c->kept, &tq, &tk, &tv, &to, &tdo, lse, &tdq, &tdk, &tdv, (float)scale,
                         FORKATTN_MEMORY_HOST);
  const double tb = tc_now() - t0;
  cr_assert_eq(st, FORKATTN_OK, "%s: forkattn_kept_bwd: %s: %s", label, forkattn_status_string(st),
               forkattn_ctx_last_error(ctx));
  fprintf(stderr, "[time] %s: library fwd %.4f s, bwd %.4f s\n", label, tf, tb);
  for (int i = 0; i < 4; i++)
    cr_expect_eq(tc_buf_changed_bytes(ins[i]), 0, "%s: backward modified input %d", label, i);
  cr_expect_eq(tc_buf_changed_bytes(&bo), 0, "%s: backward modified o", label);
  cr_expect_eq(tc_buf_changed_bytes(&bl), 0, "%s: backward modified lse", label);
  expect_written(&bdq, label, "dq");
  expect_written(&bdk, label, "dk");
  expect_written(&bdv, label, "dv");
  cr_expect_eq(tc_count_nonfinite_tensor(&tdq), 0, "%s: dq has NaN/inf", label);
  cr_expect_eq(tc_count_nonfinite_tensor(&tdk), 0, "%s: dk has NaN/inf", label);
  cr_expect_eq(tc_count_nonfinite_tensor(&tdv), 0, "%s: dv has NaN/inf", label);

  /* fully masked rows: exact zeros and -inf */
  int64_t masked = 0, bad_masked = 0, first_bad = -1;
  for (int64_t x = 0; x < T * H; x++) {
    if (rl[x] != -INFINITY) {
      if (!isfinite(lse[x]) && bad_masked++ == 0)
        first_bad = x;
      continue;
    }
    masked++;
    int ok = lse[x] == -INFINITY;
    for (int64_t e = 0; e < d; e++)
      ok &= ref_tensor_get(&to, x / H, x % H, e) == 0.0 && ref_tensor_get(&tdq, x / H, x % H, e) == 0.0;
    if (!ok && bad_masked++ == 0)
      first_bad = x;
  }
  cr_expect_eq(bad_masked, 0,
               "%s: %" PRId64 " (row, head) pairs break the empty-row contract (o = 0, lse = -inf, dq = 0 when "
               "fully masked; finite lse otherwise); first [row %" PRId64 ", head %" PRId64 "] lse %g (ref %g)",
               label, bad_masked, first_bad / H, first_bad % H, first_bad >= 0 ? (double)lse[first_bad] : 0.0,
               first_bad >= 0 ? rl[first_bad] : 0.0);
  fprintf(stderr, "  [info] %s: %" PRId64 " of %" PRId64 " (row, head) pairs fully masked\n", label, masked, T * H);

  const ph_tol tol = ph_default_tol(c->dtype);
  double *g = malloc(sizeof(double) * (size_t)(nq + 1)), *gl = malloc(sizeof(double) * (size_t)(T * H + 1));
  cr_assert(g && gl);
  ref_tensor_read(&to, g);
  cmp(label, "o", g, ro, nq, H, d, tol.o_rel, 1);
  for (int64_t x = 0; x < T * H; x++)
    gl[x] = lse[x];
  cmp(label, "lse", gl, rl, T * H, H, 1, tol.lse_abs, 0);
  ref_tensor_read(&tdq, g);
  cmp(label, "dq", g, rdq, nq, H, d, tol.grad_rel, 1);
  ref_tensor_read(&tdk, g);
  cmp(label, "dk", g, rdk, nk, hkv, d, tol.grad_rel, 1);
  ref_tensor_read(&tdv, g);
  cmp(label, "dv", g, rdv, nk, hkv, d, tol.grad_rel, 1);

  free(g), free(gl), free(q), free(k), free(v), free(dout), free(ro), free(rl), free(rdq), free(rdk), free(rdv);
  tc_buf *all[9] = {&bq, &bk, &bv, &bdo, &bo, &bl, &bdq, &bdk, &bdv};
  for (int i = 0; i < 9; i++)
    tc_buf_free(all[i]);
  forkattn_ctx_destroy(ctx);
  return masked;
}

/* ---- block masks ------------------------------------------------------------ */

Test(blocks, half_of_blocks_diagonal_kept, .timeout = 300) {
  tc_rng rng = tc_rng_for("blocks/diag.shape");
  pfx x;
  const int64_t lens[2] = {150, 111};
  pfx_make(&x, 190, 2, lens, CAUSAL); /* T = 451: 8 blocks, the last partial */
  unsigned char *bm = random_blocks(&rng, 2, 8, 1);
  for (int64_t j = 0; j < 8; j++) /* kept head 1, block row 4: only the diagonal block */
    bm[(1 * 8 + 4) * 8 + j] = j == 4;
  const forkattn_kept_set ks = {2, 0, 0, NULL, NULL, bm};
  ka_case c = {"blocks/diag_kept_f32", x.l, &ks, 4, 2, 64, F32, 0, 0};
  cr_expect_eq(ka_run(&c), 0, "diagonal blocks kept: every causal row sees itself");
  free(bm);
}

Test(blocks, half_of_blocks_diagonal_random_fully_masked_rows, .timeout = 300) {
  tc_rng rng = tc_rng_for("blocks/random.shape");
  pfx x;
  const int64_t lens[3] = {100, 0, 77};
  pfx_make(&x, 210, 3, lens, CAUSAL); /* T = 387: 7 blocks */
  unsigned char *bm = random_blocks(&rng, 4, 7, 0);
  bm[0] = 0; /* kept head 0, block (0,0): rows 0..63 (the first row too) see nothing */
  const forkattn_kept_set ks = {4, 0, 0, NULL, NULL, bm};
  ka_case c = {"blocks/diag_random_f32", x.l, &ks, 4, 4, 32, F32, 0, 0};
  cr_expect_geq(ka_run(&c), 64, "rows 0..63 of head 0 are fully masked");
  c.name = "blocks/diag_random_bf16_strided";
  c.dtype = BF16;
  c.strided = 1;
  c.H = 8; /* kept heads 4 of 8 query heads, GQA 8/4 */
  cr_expect_geq(ka_run(&c), 128);
  pfx_make(&x, 210, 3, lens, BIDIR);
  c.layout = x.l;
  c.name = "blocks/diag_random_bidir";
  c.dtype = F32;
  c.strided = 0;
  ka_run(&c);
  /* one KV head shared by 4 query heads with 4 different masks: dk/dv sum
   * contributions made under different masks */
  pfx_make(&x, 210, 3, lens, CAUSAL);
  c.layout = x.l;
  c.name = "blocks/kept_heads_finer_than_kv";
  c.H = 4;
  c.hkv = 1;
  cr_expect_geq(ka_run(&c), 64);
  free(bm);
}

/* ---- kept lists -------------------------------------------------------------- */

Test(lists, csr_query_start_compressed_rows, .timeout = 300) {
  tc_rng rng = tc_rng_for("lists.shape");
  pfx x;
  const int64_t lens[2] = {90, 70};
  pfx_make(&x, 150, 2, lens, CAUSAL); /* T = 310 */
  const int64_t cr = 200;
  int64_t off[3] = {0, 0, 0}, *idx = malloc(sizeof(int64_t) * 2 * (size_t)cr);
  cr_assert(idx);
  int64_t n = 0;
  for (int64_t j = 0; j < cr; j++) /* head 0: ~half of [0, 200), not key 0 */
    if (j > 0 && tc_uniform(&rng, 0, 1) < 0.5)
      idx[n++] = j;
  off[1] = n;
  for (int64_t j = 0; j < cr; j += 7) /* head 1: every 7th key */
    idx[n++] = j;
  off[2] = n;
  const forkattn_kept_set ks = {2, cr, 150, off, idx, NULL};
  ka_case c = {"lists/query_start_150", x.l, &ks, 4, 2, 64, F32, 0, 0};
  ka_run(&c);
  /* query_start 0: the first row sees only key 0, which head 0 drops */
  const forkattn_kept_set k0 = {2, cr, 0, off, idx, NULL};
  c.kept = &k0;
  c.name = "lists/query_start_0_first_row_masked";
  cr_expect_geq(ka_run(&c), 2, "row 0 of query heads 0, 1 is fully masked");
  /* lists AND a block mask, bf16 */
  unsigned char *bm = random_blocks(&rng, 2, 5, 1);
  const forkattn_kept_set kb = {2, cr, 100, off, idx, bm};
  c.kept = &kb;
  c.name = "lists/with_blocks_bf16";
  c.dtype = BF16;
  ka_run(&c);
  free(bm);
  free(idx);
}

Test(lists, tree_layout, .timeout = 300) {
  tc_rng rng = tc_rng_for("lists/tree.shape");
  tt_tree t;
  tt_random_trie(&t, &rng, 120, 5, 60);
  tt_packed p;
  tt_pack(&p, &t, 0);
  const int64_t T = p.off[t.n], cr = 120, nb = (T + 63) / 64;
  int64_t off[2] = {0, 0}, *idx = malloc(sizeof(int64_t) * (size_t)cr);
  cr_assert(idx);
  for (int64_t j = 0; j < cr; j++)
    if (tc_uniform(&rng, 0, 1) < 0.3)
      idx[off[1]++] = j;
  unsigned char *bm = random_blocks(&rng, 1, nb, 0);
  const forkattn_kept_set ks = {1, cr, 60, off, idx, bm};
  ka_case c = {"lists/tree_f32", {NULL, &p.layout}, &ks, 2, 1, 48, F32, 0, 0};
  ka_run(&c);
  free(bm);
  free(idx);
  tt_packed_free(&p);
  tt_free(&t);
}

/* ---- kept == NULL is the plain layout call ------------------------------------ */

static void same_as_plain(const char *name, const forkattn_layout *lay) {
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert(ctx);
  const int64_t T = refkl_layout_rows(lay), H = 4, hkv = 2, d = 40;
  const int64_t nq = T * H * d, nk = T * hkv * d;
  float *buf = malloc(sizeof(float) * (size_t)(2 * nq + 2 * nk + 2 * (2 * nq + 2 * nk + T * H)));
  cr_assert(buf);
  float *p = buf;
  forkattn_tensor q = forkattn_tensor_contiguous(p, F32, T, H, d), k = forkattn_tensor_contiguous(p += nq, F32, T, hkv, d);
  forkattn_tensor v = forkattn_tensor_contiguous(p += nk, F32, T, hkv, d), dout = forkattn_tensor_contiguous(p += nk, F32, T, H, d);
  p += nq;
  forkattn_tensor o[2], dq[2], dk[2], dv[2];
  float *lse[2];
  for (int s = 0; s < 2; s++) {
    o[s] = forkattn_tensor_contiguous(p, F32, T, H, d);
    dq[s] = forkattn_tensor_contiguous(p += nq, F32, T, H, d);
    dk[s] = forkattn_tensor_contiguous(p += nq, F32, T, hkv, d);
    dv[s] = forkattn_tensor_contiguous(p += nk, F32, T, hkv, d);
    lse[s] = (p += nk);
    p += T * H;
  }
  tc_fill_tensor(&rng, &q, -4, 4);
  tc_fill_tensor(&rng, &k, -1, 1);
  tc_fill_tensor(&rng, &v, -1, 1);
  tc_fill_tensor(&rng, &dout, -1, 1);
  const float sc = 0.17f;
  const forkattn_memory M = FORKATTN_MEMORY_HOST;
  if (lay->prefix) {
    cr_assert_eq(forkattn_prefix_fwd(ctx, lay->prefix, &q, &k, &v, &o[0], lse[0], sc, M), FORKATTN_OK);
    cr_assert_eq(forkattn_prefix_bwd(ctx, lay->prefix, &q, &k, &v, &o[0], &dout, lse[0], &dq[0], &dk[0], &dv[0], sc, M),
                 FORKATTN_OK);
  } else {
    cr_assert_eq(forkattn_tree_fwd(ctx, lay->tree, &q, &k, &v, &o[0], lse[0], sc, M), FORKATTN_OK);
    cr_assert_eq(forkattn_tree_bwd(ctx, lay->tree, &q, &k, &v, &o[0], &dout, lse[0], &dq[0], &dk[0], &dv[0], sc, M),
                 FORKATTN_OK);
  }
  cr_assert_eq(forkattn_kept_fwd(ctx, lay, NULL, &q, &k, &v, &o[1], lse[1], sc, M), FORKATTN_OK, "%s",
               forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_kept_bwd(ctx, lay, NULL, &q, &k, &v, &o[1], &dout, lse[1], &dq[1], &dk[1], &dv[1], sc, M),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  const size_t bq = sizeof(float) * (size_t)nq, bk = sizeof(float) * (size_t)nk;
  cr_expect_eq(memcmp(o[0].data, o[1].data, bq), 0, "%s: o differs from the plain call", name);
  cr_expect_eq(memcmp(lse[0], lse[1], sizeof(float) * (size_t)(T * H)), 0, "%s: lse differs", name);
  cr_expect_eq(memcmp(dq[0].data, dq[1].data, bq), 0, "%s: dq differs", name);
  cr_expect_eq(memcmp(dk[0].data, dk[1].data, bk), 0, "%s: dk differs", name);
  cr_expect_eq(memcmp(dv[0].data, dv[1].data, bk), 0, "%s: dv differs", name);
  /* a kept set that keeps everything: same values (tiling may differ: 1e-6) */
  const int64_t nb = (T + 63) / 64;
  unsigned char *ones = malloc((size_t)(nb * nb));
  cr_assert(ones);
  memset(ones, 1, (size_t)(nb * nb));
  int64_t koff[2] = {0, T}, *kidx = malloc(sizeof(int64_t) * (size_t)T);
  cr_assert(kidx);
  for (int64_t j = 0; j < T; j++)
    kidx[j] = j;
  const forkattn_kept_set all = {1, T, 0, koff, kidx, ones};
  cr_assert_eq(forkattn_kept_fwd(ctx, lay, &all, &q, &k, &v, &o[1], lse[1], sc, M), FORKATTN_OK);
  double worst = 0.0;
  for (int64_t i = 0; i < nq; i++)
    worst = fmax(worst, fabs((double)((float *)o[0].data)[i] - ((float *)o[1].data)[i]));
  for (int64_t i = 0; i < T * H; i++)
    worst = fmax(worst, fabs((double)lse[0][i] - lse[1][i]));
  cr_expect_leq(worst, 1e-6, "%s: a keep-everything kept set differs from no kept set by %.3e", name, worst);
  free(ones);
  free(kidx);
  free(buf);
  forkattn_ctx_destroy(ctx);
}

Test(plain, kept_null_is_bitwise_the_layout_call, .timeout = 300) {
  pfx x;
  const int64_t lens[3] = {33, 0, 71};
  pfx_make(&x, 129, 3, lens, CAUSAL);
  same_as_plain("plain/prefix_causal", &x.l);
  pfx_make(&x, 129, 3, lens, BIDIR);
  same_as_plain("plain/prefix_bidir", &x.l);
  tc_rng rng = tc_rng_for("plain/tree.shape");
  tt_tree t;
  tt_random_trie(&t, &rng, 100, 6, 40);
  tt_packed p;
  tt_pack(&p, &t, 0);
  const forkattn_layout tl = {NULL, &p.layout};
  same_as_plain("plain/tree", &tl);
  tt_packed_free(&p);
  tt_free(&t);
}

/* ---- argument errors on the kept set ------------------------------------------ */

Test(errors, bad_kept_sets_refused_outputs_untouched) {
  forkattn_ctx *ctx = tc_ctx_default("kept/errors");
  cr_assert(ctx);
  const int64_t T = 10, H = 4, hkv = 2, d = 8;
  tc_buf bq, bk, bv, bo, bl;
  forkattn_tensor q = tc_buf_contiguous(&bq, F32, T, H, d), k = tc_buf_contiguous(&bk, F32, T, hkv, d);
  forkattn_tensor v = tc_buf_contiguous(&bv, F32, T, hkv, d), o = tc_buf_contiguous(&bo, F32, T, H, d);
  float *lse = tc_buf_f32(&bl, T * H);
  tc_rng rng = tc_rng_for("kept/errors");
  tc_fill_tensor(&rng, &q, -1, 1);
  tc_fill_tensor(&rng, &k, -1, 1);
  tc_fill_tensor(&rng, &v, -1, 1);
  tc_buf_poison(&bo);
  tc_buf_poison(&bl);
  tc_buf *all[5] = {&bq, &bk, &bv, &bo, &bl};
  for (int i = 0; i < 5; i++)
    tc_buf_snapshot(all[i]);
  const forkattn_prefix_layout pl = {T, 0, NULL, CAUSAL};
  const forkattn_layout lay = {&pl, NULL};
  const int64_t off[3] = {0, 2, 4}, good[4] = {0, 3, 1, 2}, unsorted[4] = {3, 0, 1, 2}, range[4] = {0, 6, 1, 2};
  const unsigned char bm2[2] = {1, 2};
  struct {
    forkattn_kept_set ks;
    const char *what, *needle;
  } bad[] = {
      {{3, 6, 0, off, good, NULL}, "heads 3 of 4", "heads"},
      {{0, 6, 0, off, good, NULL}, "heads 0", "heads"},
      {{2, 6, 0, off, unsorted, NULL}, "unsorted index", "index"},
      {{2, 6, 0, off, range, NULL}, "index >= compressed_rows", "index"},
      {{2, 6, 0, off, NULL, NULL}, "offsets without index", "index"},
      {{2, 6, 0, NULL, NULL, bm2}, "block_mask value 2", "block_mask"},
      {{2, 11, 0, off, good, NULL}, "compressed_rows > rows", "compressed_rows"},
      {{2, 6, -1, off, good, NULL}, "query_start negative", "query_start"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    forkattn_status st = forkattn_kept_fwd(ctx, &lay, &bad[i].ks, &q, &k, &v, &o, lse, 0.3f, FORKATTN_MEMORY_HOST);
    const char *msg = forkattn_ctx_last_error(ctx);
    fprintf(stderr, "  kept/errors %s: status %d, \"%s\"\n", bad[i].what, (int)st, msg);
    cr_expect_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "%s: status %d", bad[i].what, (int)st);
    cr_expect(strstr(msg, bad[i].needle), "%s: message \"%s\" lacks \"%s\"", bad[i].what, msg, bad[i].needle);
    for (int b = 0; b < 5; b++)
      cr_expect_eq(tc_buf_changed_bytes(all[b]), 0, "%s: buffer %d changed", bad[i].what, b);
  }
  const forkattn_layout both = {&pl, &(forkattn_tree_layout){1, (const int64_t[]){0, 10}, (const int64_t[]){-1}}};
  cr_expect_eq(forkattn_kept_fwd(ctx, &both, NULL, &q, &k, &v, &o, lse, 0.3f, FORKATTN_MEMORY_HOST),
               FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "layout"));
  cr_expect_eq(forkattn_kept_fwd(ctx, NULL, NULL, &q, &k, &v, &o, lse, 0.3f, FORKATTN_MEMORY_HOST),
               FORKATTN_ERR_INVALID_ARGUMENT);
  for (int b = 0; b < 5; b++)
    cr_expect_eq(tc_buf_changed_bytes(all[b]), 0, "layout errors: buffer %d changed", b);
  for (int b = 0; b < 5; b++)
    tc_buf_free(all[b]);
  forkattn_ctx_destroy(ctx);
}
