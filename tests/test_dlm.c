/*
 * test_dlm.c - the BiCache demo model (examples/dlm/dlm_model.c, dlm_prefix.c,
 * dlm_serve.c) on a tiny synthetic transformer (3 layers, width 64):
 * reuse depth 0 is bitwise the uncached forward, also through the serving
 * loop and the cache; per-request depths batched in one forward equal each
 * request run alone; when the prefix rows cannot see the request (the
 * test-only prefix_blind model) reuse at every depth, deep-layer refresh and
 * the calibrated profile all equal recomputation up to float rounding;
 * forkattn_prefix_cached_fwd equals forkattn_prefix_fwd's response rows on
 * the same K/V; layer 0's K/V never drift; bad inputs get clear errors and
 * leave the outputs untouched. FORKATTN_TEST_SEED=<n> reproduces a run.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlm_serve.h"
#include "test_common.h"

#define BAD FORKATTN_ERR_INVALID_ARGUMENT

static forkattn_ctx *td_ctx(void) {
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co); /* auto: FORKATTN_BACKEND picks it (the GPU suite sets gpu) */
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &co), FORKATTN_OK);
  return ctx;
}

static dlm_config td_config(int blind) {
  dlm_config c = dlm_config_default();
  c.layers = 3;
  c.width = 64;
  c.heads = 4;
  c.vocab = 97;
  c.max_pos = 512;
  c.seed = 77;
  c.qk_gain = 2.0f; /* strong context dependence: the non-blind model must drift */
  c.prefix_blind = blind;
  return c;
}

static void td_model(dlm_model *m, int blind) {
  char err[256];
  const dlm_config c = td_config(blind);
  cr_assert_eq(dlm_model_init(m, &c, err, sizeof err), FORKATTN_OK, "%s", err);
}

/* n requests sharing a prefix of P random tokens, own lengths in [1, 24]. */
typedef struct td_batch {
  dlm_batch b;
  int64_t off[9];
  int32_t tok[8 * 64];
  int64_t R;
} td_batch;

static void td_make(td_batch *t, tc_rng *rng, int64_t n, int64_t P, int64_t vocab) {
  cr_assert(n <= 8 && P <= 40);
  t->off[0] = 0;
  for (int64_t j = 0; j < P; j++) t->tok[j] = (int32_t)tc_randint(rng, 0, vocab - 1);
  t->R = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t own = tc_randint(rng, 1, 24);
    t->off[i + 1] = t->off[i] + P + own;
    memcpy(t->tok + t->off[i], t->tok, sizeof(int32_t) * (size_t)P);
    for (int64_t j = P; j < P + own; j++) t->tok[t->off[i] + j] = (int32_t)tc_randint(rng, 0, vocab - 1);
    t->R += own;
  }
  t->b = (dlm_batch){n, t->off, t->tok, P};
}

static double td_max_rel(const float *a, const float *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num = fmax(num, fabs((double)a[i] - b[i]));
    den = fmax(den, fabs((double)b[i]));
  }
  return num / (den > 0 ? den : 1);
}

/* Uncached forward (depth 0) and cached at `depth` of the same batch. */
static void td_pair(forkattn_ctx *ctx, const dlm_model *m, const td_batch *t, int64_t depth, float *hu, float *hc) {
  char err[256];
  dlm_alone a;
  cr_assert_eq(dlm_alone_compute(ctx, m, t->tok, t->b.prefix, &a, err, sizeof err), FORKATTN_OK, "%s", err);
  dlm_prefix pre;
  dlm_alone_prefix(m, &a, &pre);
  const dlm_run ru = {.batch = &t->b, .hidden = hu};
  const dlm_run rc = {.batch = &t->b, .depth = depth, .prefix = &pre, .hidden = hc};
  cr_assert_eq(dlm_forward(ctx, m, &ru, err, sizeof err), FORKATTN_OK, "%s", err);
  cr_assert_eq(dlm_forward(ctx, m, &rc, err, sizeof err), FORKATTN_OK, "%s", err);
  dlm_alone_free(&a);
}

Test(dlm, depth0_is_bitwise_uncached) {
  forkattn_ctx *ctx = td_ctx();
  dlm_model m;
  td_model(&m, 0);
  tc_rng rng = tc_rng_for("dlm/depth0_is_bitwise_uncached");
  td_batch t;
  td_make(&t, &rng, 4, 17, m.c.vocab);
  const size_t n = (size_t)(t.R * m.c.width);
  float *hu = malloc(n * sizeof(float)), *hc = malloc(n * sizeof(float));
  td_pair(ctx, &m, &t, 0, hu, hc);
  cr_expect(!memcmp(hu, hc, n * sizeof(float)), "depth 0 differs from the uncached forward");
  /* and the non-blind model really depends on the request: depth 3 drifts */
  td_pair(ctx, &m, &t, 3, hu, hc);
  cr_expect(td_max_rel(hc, hu, (int64_t)n) > 1e-3, "full reuse should drift in a bidirectional model");
  free(hu);
  free(hc);
  dlm_model_free(&m);
  forkattn_ctx_destroy(ctx);
}

Test(dlm, blind_prefix_reuse_is_exact_at_every_depth) {
  forkattn_ctx *ctx = td_ctx();
  dlm_model m;
  td_model(&m, 1);
  tc_rng rng = tc_rng_for("dlm/blind_prefix_reuse_is_exact_at_every_depth");
  for (int trial = 0; trial < 3; trial++) {
    td_batch t;
    td_make(&t, &rng, 1 + trial * 2, 5 + 13 * trial, m.c.vocab);
    const size_t n = (size_t)(t.R * m.c.width);
    float *hu = malloc(n * sizeof(float)), *hc = malloc(n * sizeof(float));
    for (int64_t b = 0; b <= m.c.layers; b++) {
      td_pair(ctx, &m, &t, b, hu, hc);
      const double e = td_max_rel(hc, hu, (int64_t)n);
      cr_expect(e < 1e-5, "trial %d depth %lld: relative error %.3e", trial, (long long)b, e);
    }
    free(hu);
    free(hc);
  }
  dlm_model_free(&m);
  forkattn_ctx_destroy(ctx);
}

/* Per-request depths in one batch equal each request run alone at its depth. */
Test(dlm, mixed_depths_batch_equals_single_runs) {
  forkattn_ctx *ctx = td_ctx();
  dlm_model m;
  td_model(&m, 0);
  tc_rng rng = tc_rng_for("dlm/mixed_depths_batch_equals_single_runs");
  td_batch t;
  td_make(&t, &rng, 5, 14, m.c.vocab);
  char err[256];
  dlm_alone a;
  cr_assert_eq(dlm_alone_compute(ctx, &m, t.tok, t.b.prefix, &a, err, sizeof err), FORKATTN_OK, "%s", err);
  dlm_prefix pre;
  dlm_alone_prefix(&m, &a, &pre);
  const int64_t depths[5] = {3, 2, 2, 1, 0}, W = m.c.width;
  float *hb = malloc(sizeof(float) * (size_t)(t.R * W)), *hs = malloc(sizeof(float) * (size_t)(t.R * W));
  const dlm_run rb = {.batch = &t.b, .depths = depths, .prefix = &pre, .hidden = hb};
  cr_assert_eq(dlm_forward(ctx, &m, &rb, err, sizeof err), FORKATTN_OK, "%s", err);
  for (int64_t i = 0, r = 0; i < 5; r += t.off[i + 1] - t.off[i] - t.b.prefix, i++) {
    const int64_t off1[2] = {0, t.off[i + 1] - t.off[i]};
    const dlm_batch one = {1, off1, t.tok + t.off[i], t.b.prefix};
    const dlm_run rs = {.batch = &one, .depth = depths[i], .prefix = &pre, .hidden = hs + r * W};
    cr_assert_eq(dlm_forward(ctx, &m, &rs, err, sizeof err), FORKATTN_OK, "%s", err);
  }
  const double e = td_max_rel(hb, hs, t.R * W);
  cr_expect(e < 1e-5, "batched per-request depths vs single runs: %.3e", e);
  free(hb);
  free(hs);
  dlm_alone_free(&a);
  dlm_model_free(&m);
  forkattn_ctx_destroy(ctx);
}

Test(dlm, cached_attention_equals_recompute_on_equal_kv) {
  forkattn_ctx *ctx = td_ctx();
  tc_rng rng = tc_rng_for("dlm/cached_attention_equals_recompute_on_equal_kv");
  const int64_t P = 37, Hq = 4, Hkv = 2, d = 24, off[4] = {0, 5, 5, 19}, R = off[3], T = P + R;
  float *q = malloc(sizeof(float) * (size_t)(T * Hq * d)), *k = malloc(sizeof(float) * (size_t)(T * Hkv * d)),
        *v = malloc(sizeof(float) * (size_t)(T * Hkv * d)), *o = malloc(sizeof(float) * (size_t)(T * Hq * d)),
        *oc = malloc(sizeof(float) * (size_t)(R * Hq * d));
  const forkattn_tensor tq = forkattn_tensor_contiguous(q, FORKATTN_DTYPE_F32, T, Hq, d),
                        tk = forkattn_tensor_contiguous(k, FORKATTN_DTYPE_F32, T, Hkv, d),
                        tv = forkattn_tensor_contiguous(v, FORKATTN_DTYPE_F32, T, Hkv, d),
                        to = forkattn_tensor_contiguous(o, FORKATTN_DTYPE_F32, T, Hq, d),
                        tqr = forkattn_tensor_contiguous(q + P * Hq * d, FORKATTN_DTYPE_F32, R, Hq, d),
                        toc = forkattn_tensor_contiguous(oc, FORKATTN_DTYPE_F32, R, Hq, d);
  tc_fill_tensor(&rng, &tq, -2, 2);
  tc_fill_tensor(&rng, &tk, -2, 2);
  tc_fill_tensor(&rng, &tv, -1, 1);
  const forkattn_prefix_layout lay = {P, 3, off, FORKATTN_MASK_BIDIRECTIONAL};
  cr_assert_eq(forkattn_prefix_fwd(ctx, &lay, &tq, &tk, &tv, &to, NULL, 0.2f, FORKATTN_MEMORY_HOST), FORKATTN_OK, "%s",
               forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_prefix_cached_fwd(ctx, &lay, &tqr, &tk, &tv, &toc, NULL, 0.2f, FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  const double e = td_max_rel(oc, o + P * Hq * d, R * Hq * d);
  cr_expect(e < 1e-6, "cached vs recomputed response rows: %.3e", e);
  free(q);
  free(k);
  free(v);
  free(o);
  free(oc);
  forkattn_ctx_destroy(ctx);
}

/* Calibration: layer 0's K/V depend on the token and position only. */
Test(dlm, calibration_layer0_exact_blind_all_exact) {
  forkattn_ctx *ctx = td_ctx();
  for (int blind = 0; blind <= 1; blind++) {
    dlm_model m;
    td_model(&m, blind);
    forkattn_reuse_profile *prof = NULL;
    cr_assert_eq(forkattn_reuse_profile_create(ctx, m.c.layers, 0.95f, &prof), FORKATTN_OK);
    const double ratios[3] = {0.2, 0.5, 0.8};
    dlm_calib cal;
    char err[256];
    cr_assert_eq(dlm_calibrate(ctx, &m, 60, ratios, 3, 5, prof, &cal, err, sizeof err), FORKATTN_OK, "%s", err);
    for (int k = 0; k < 3; k++) {
      cr_expect(cal.sim[k][0] > 0.99999f, "blind %d r %.1f: layer 0 similarity %.7f", blind, ratios[k], cal.sim[k][0]);
      for (int64_t l = 1; blind && l < m.c.layers; l++)
        cr_expect(cal.sim[k][l] > 0.99999f, "blind r %.1f: layer %lld similarity %.7f", ratios[k], (long long)l,
                  cal.sim[k][l]);
    }
    int64_t b = -1;
    cr_assert_eq(forkattn_reuse_profile_depth(ctx, prof, 0.5, &b), FORKATTN_OK);
    if (blind) cr_expect_eq(b, m.c.layers, "blind model: depth %lld", (long long)b);
    else cr_expect(b >= 1, "layer 0 is always reusable: depth %lld", (long long)b);
    forkattn_reuse_profile_free(prof);
    dlm_model_free(&m);
  }
  forkattn_ctx_destroy(ctx);
}

static dlm_serve_result td_serve(forkattn_ctx *ctx, const dlm_model *m, const forkattn_reuse_profile *prof,
                                 int64_t fixed, int64_t steps, int64_t refresh, int warm) {
  const dlm_workload_opts wo = {3, 10, 8, 30, 0.2, 0.9, 1, 60, 99};
  dlm_workload w;
  char err[256];
  cr_assert_eq(dlm_workload_make(&w, &wo, m, err, sizeof err), 0, "%s", err);
  const dlm_serve_opts so = {.batch = 4, .steps = steps, .refresh = refresh, .fixed_depth = fixed,
                            .cache_bytes = (size_t)64 << 20, .warm = warm, .compare = 1};
  dlm_serve_result r;
  cr_assert_eq(dlm_serve(ctx, m, &w, prof, &so, &r, err, sizeof err), FORKATTN_OK, "%s", err);
  dlm_workload_free(&w);
  cr_expect_eq(r.requests, 10);
  cr_expect_eq(r.cache.hits + r.cache.misses, 10, "one lookup per request");
  cr_expect(r.cache.insertions >= 1 && r.cache.insertions <= 3, "insertions %llu",
            (unsigned long long)r.cache.insertions);
  if (warm) cr_expect_eq(r.cache.misses, 0, "warm cache: %llu misses", (unsigned long long)r.cache.misses);
  return r;
}

Test(dlm, serving_depth0_bitwise_and_blind_exact) {
  forkattn_ctx *ctx = td_ctx();
  dlm_model m;
  td_model(&m, 0);
  dlm_serve_result r = td_serve(ctx, &m, NULL, 0, 1, 0, 0);
  cr_expect(r.hid_max == 0 && r.logit_max == 0 && r.top1_agree == r.rows, "depth 0 served: drift %.3e", r.hid_max);
  cr_expect_eq(r.depth_used[0], 10);
  r = td_serve(ctx, &m, NULL, 0, 3, 2, 1); /* steps, deep-layer K/V captured and reused */
  cr_expect(r.rows > 0 && r.hid_max > 0, "stale deep-layer K/V must drift in the non-blind model");
  dlm_model_free(&m);
  td_model(&m, 1);
  forkattn_reuse_profile *prof = NULL;
  cr_assert_eq(forkattn_reuse_profile_create(ctx, m.c.layers, 0.95f, &prof), FORKATTN_OK);
  const double ratios[2] = {0.1, 0.5};
  dlm_calib cal;
  char err[256];
  cr_assert_eq(dlm_calibrate(ctx, &m, 40, ratios, 2, 5, prof, &cal, err, sizeof err), FORKATTN_OK, "%s", err);
  r = td_serve(ctx, &m, prof, -1, 1, 0, 0);
  cr_expect(r.hid_max < 1e-5, "blind, profile depths: drift %.3e", r.hid_max);
  cr_expect(r.depth_used[m.c.layers] > 0, "the blind profile reuses every layer");
  r = td_serve(ctx, &m, NULL, 1, 4, 3, 1); /* depth 1, deep layers refreshed every 3 steps */
  cr_expect(r.hid_max < 1e-5, "blind, deep refresh: drift %.3e", r.hid_max);
  forkattn_reuse_profile_free(prof);
  dlm_model_free(&m);
  forkattn_ctx_destroy(ctx);
}

/* ---- bad inputs ------------------------------------------------------------------- */

static void td_expect_bad(forkattn_ctx *ctx, const dlm_model *m, const dlm_run *run, const char *needle) {
  char err[512] = "";
  const int64_t rows = 256 * m->c.width;
  float *h = run->hidden;
  for (int64_t i = 0; h && i < rows; i++) h[i] = 12345.0f;
  cr_expect_eq(dlm_forward(ctx, m, run, err, sizeof err), BAD, "expected an error containing '%s'", needle);
  cr_expect(strstr(err, needle), "message '%s' lacks '%s'", err, needle);
  for (int64_t i = 0; h && i < rows; i++)
    if (h[i] != 12345.0f) {
      cr_expect(0, "output written on error ('%s')", needle);
      break;
    }
}

Test(dlm, bad_inputs) {
  forkattn_ctx *ctx = td_ctx();
  dlm_model m;
  char err[256];
  dlm_config c = td_config(0);
  c.width = 66;
  cr_expect_eq(dlm_model_init(&m, &c, err, sizeof err), BAD);
  cr_expect(strstr(err, "head_dim"), "%s", err);
  c = td_config(0);
  c.layers = 0;
  cr_expect_eq(dlm_model_init(&m, &c, err, sizeof err), BAD);
  cr_expect(strstr(err, "layers"), "%s", err);
  td_model(&m, 0);
  tc_rng rng = tc_rng_for("dlm/bad_inputs");
  td_batch t;
  td_make(&t, &rng, 3, 9, m.c.vocab);
  float *h = malloc(sizeof(float) * (size_t)(256 * m.c.width));
  dlm_alone a;
  cr_assert_eq(dlm_alone_compute(ctx, &m, t.tok, 9, &a, err, sizeof err), FORKATTN_OK);
  dlm_prefix pre;
  dlm_alone_prefix(&m, &a, &pre);
  dlm_run r = {.batch = &t.b, .depth = 4, .prefix = &pre, .hidden = h};
  td_expect_bad(ctx, &m, &r, "reuse depth 4 of request 0 not in 0..3");
  r.depth = 2;
  r.prefix = NULL;
  td_expect_bad(ctx, &m, &r, "needs the prefix computed alone");
  r.prefix = &pre;
  pre.len = 8;
  td_expect_bad(ctx, &m, &r, "the cached prefix has 8 rows");
  pre.len = 9;
  pre.hidden[2] = NULL;
  td_expect_bad(ctx, &m, &r, "hidden state entering layer 2");
  dlm_alone_prefix(&m, &a, &pre);
  pre.k[1].dtype = FORKATTN_DTYPE_BF16;
  td_expect_bad(ctx, &m, &r, "cached K/V of layer 1");
  dlm_alone_prefix(&m, &a, &pre);
  const int32_t kept_tok = t.tok[t.off[1] + 3]; /* another valid token: request 1 no longer starts with */
  t.tok[t.off[1] + 3] = (kept_tok + 1) % (int32_t)m.c.vocab; /* the prefix (^ 1 could leave the vocabulary) */
  td_expect_bad(ctx, &m, &r, "does not start with");
  t.tok[t.off[1] + 3] = kept_tok;
  t.tok[t.off[3] - 1] = (int32_t)m.c.vocab; /* request 2's last own token (it may have only one) */
  td_expect_bad(ctx, &m, &r, "outside the vocabulary");
  t.tok[t.off[3] - 1] = 0;
  dlm_batch b2 = t.b;
  b2.prefix = t.off[1]; /* request 0 has no own token */
  r.batch = &b2;
  td_expect_bad(ctx, &m, &r, "needs more than the");
  r.batch = &t.b;
  dlm_record rec = {.rows = t.off[3] + 1};
  r.record = &rec;
  td_expect_bad(ctx, &m, &r, "record rows");
  r.record = NULL;
  const int64_t up[3] = {1, 2, 2};
  r.depths = up;
  td_expect_bad(ctx, &m, &r, "must not increase");
  r.depths = NULL;
  dlm_deep deep = {0};
  r.deep = &deep;
  td_expect_bad(ctx, &m, &r, "buffers of layer 2 are missing");
  r.deep = NULL;
  cr_expect_eq(dlm_forward(ctx, &m, &r, err, sizeof err), FORKATTN_OK, "%s", err); /* and the fixed run works */
  /* serving and workload options */
  dlm_workload w;
  dlm_workload_opts wo = {2, 4, 8, 30, 0.2, 0.9, 1, 600, 1};
  cr_expect_eq(dlm_workload_make(&w, &wo, &m, err, sizeof err), -1);
  cr_expect(strstr(err, "positions"), "%s", err);
  wo.own_max = 60;
  wo.ratio_max = 1.0;
  cr_expect_eq(dlm_workload_make(&w, &wo, &m, err, sizeof err), -1);
  wo.ratio_max = 0.9;
  cr_assert_eq(dlm_workload_make(&w, &wo, &m, err, sizeof err), 0, "%s", err);
  dlm_serve_opts so = {.batch = 4, .steps = 1, .fixed_depth = -1, .cache_bytes = (size_t)1 << 20, .compare = 1};
  dlm_serve_result res;
  cr_expect_eq(dlm_serve(ctx, &m, &w, NULL, &so, &res, err, sizeof err), BAD);
  cr_expect(strstr(err, "profile or a fixed depth"), "%s", err);
  so.fixed_depth = 0;
  so.cache_bytes = 0;
  cr_expect_eq(dlm_serve(ctx, &m, &w, NULL, &so, &res, err, sizeof err), BAD, "a cache of 0 bytes");
  cr_expect(strstr(err, "forkattn_kv_cache_create"), "%s", err);
  dlm_workload_free(&w);
  dlm_alone_free(&a);
  free(h);
  dlm_model_free(&m);
  forkattn_ctx_destroy(ctx);
}
