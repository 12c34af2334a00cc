/*
 * test_reuse_profile.c - forkattn_kv_similarity() and the reuse-depth profile
 * (forkattn_reuse_profile_*; docs/dlm-cache.md "Reuse-depth profile").
 *
 * Similarity: random tensors of every dtype pair and three layouts (dense,
 * padded row-major, head-major), 1 to many heads, against a long-double
 * computation of the documented rule (zero rows included); identical tensors
 * give exactly 1, negated ones exactly -1; no rows gives 1; NaN reaches only
 * its head; results are bitwise the same for any thread count; inputs are never
 * written; bad arguments fail with a message and leave the outputs alone. The
 * device-memory test compares the GPU path with the host path (skips on the
 * CPU backend).
 *
 * Profile: synthetic measurements whose similarity decays with depth and grows
 * with the prefix ratio give hand-computed depths; a non-monotone profile gives
 * the documented conservative depths; random noisy profiles are monotone over
 * all 101 bins and equal a brute-force evaluation of the rule; save/load
 * round-trips bit for bit (depths, files, later adds), also under a comma
 * locale; malformed files (every truncation, bad header, NaN, wrong counts...)
 * are refused with a message naming the line; bad arguments are refused.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "forkattn_experimental.h"
#include "reference.h"
#include "test_common.h"

#define NBINS 101

static forkattn_ctx *ctx_threads(int threads) {
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.threads = threads;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK);
  return ctx;
}

/* ======================================================================== */
/* similarity                                                               */
/* ======================================================================== */

enum { DENSE, PADDED, HEAD_MAJOR };

/* A [rows, heads, d] view over a new buffer in one of three layouts. */
static forkattn_tensor make_view(tc_buf *b, forkattn_dtype dt, int64_t rows, int64_t heads, int64_t d, int layout) {
  int64_t off = 0, rs = heads * d, hs = d;
  if (layout == PADDED) {
    off = 3;
    hs = d + 2;
    rs = heads * hs + 5;
  } else if (layout == HEAD_MAJOR) {
    off = 1;
    rs = d + 1;
    hs = rows * rs + 7;
  }
  const int64_t span = rows ? (rows - 1) * rs + (heads - 1) * hs + d : 0;
  cr_assert_eq(tc_buf_alloc(b, (size_t)(off + span + 8), dt), 0);
  return tc_buf_view(b, off, rows, heads, d, rs, hs);
}

/* The documented rule in long double from the stored values. */
static void ref_similarity(const forkattn_tensor *a, const forkattn_tensor *b, double *sim, double *mean) {
  double all = 0.0;
  for (int64_t h = 0; h < a->heads; h++) {
    long double s = 0.0L;
    for (int64_t r = 0; r < a->rows; r++) {
      long double ab = 0.0L, aa = 0.0L, bb = 0.0L;
      for (int64_t c = 0; c < a->head_dim; c++) {
        const long double x = ref_tensor_get(a, r, h, c), y = ref_tensor_get(b, r, h, c);
        ab += x * y;
        aa += x * x;
        bb += y * y;
      }
      long double cs;
      if (isnan((double)(aa + bb)) || isinf((double)(aa + bb)))
        cs = NAN;
      else if (aa == 0.0L || bb == 0.0L)
        cs = aa == bb ? 1.0L : 0.0L;
      else
        cs = fminl(1.0L, fmaxl(-1.0L, ab / sqrtl(aa * bb)));
      s += cs;
    }
    sim[h] = a->rows ? (double)(s / (long double)a->rows) : 1.0;
    all += sim[h];
  }
  *mean = all / (double)a->heads;
}

/* b = alpha * a + noise * U(-1, 1), element by element (rounded to b's dtype). */
static void fill_related(tc_rng *rng, const forkattn_tensor *a, const forkattn_tensor *b, double alpha, double noise) {
  for (int64_t r = 0; r < a->rows; r++)
    for (int64_t h = 0; h < a->heads; h++)
      for (int64_t c = 0; c < a->head_dim; c++)
        ref_tensor_set(b, r, h, c, alpha * ref_tensor_get(a, r, h, c) + noise * tc_uniform(rng, -1.0, 1.0));
}

static void zero_vec(const forkattn_tensor *t, int64_t r, int64_t h) {
  for (int64_t c = 0; c < t->head_dim; c++) ref_tensor_set(t, r, h, c, 0.0);
}

typedef struct sim_case {
  int64_t rows, heads, d;
  forkattn_dtype da, db;
  int layout_a, layout_b;
  double alpha, noise; /* b = alpha a + noise */
  int zeros;           /* sprinkle zero vectors */
} sim_case;

static void run_case(forkattn_ctx *ctx, tc_rng *rng, const sim_case *k, int idx) {
  tc_buf ba, bb;
  forkattn_tensor a = make_view(&ba, k->da, k->rows, k->heads, k->d, k->layout_a);
  forkattn_tensor b = make_view(&bb, k->db, k->rows, k->heads, k->d, k->layout_b);
  tc_fill_tensor(rng, &a, -2.0, 2.0);
  fill_related(rng, &a, &b, k->alpha, k->noise);
  if (k->zeros)
    for (int64_t r = 0; r < k->rows; r++)
      for (int64_t h = 0; h < k->heads; h++) {
        const int64_t u = tc_randint(rng, 0, 9);
        if (u == 0) zero_vec(&a, r, h);
        if (u == 1) zero_vec(&b, r, h);
        if (u == 2) {
          zero_vec(&a, r, h);
          zero_vec(&b, r, h);
        }
      }
  tc_buf_snapshot(&ba);
  tc_buf_snapshot(&bb);
  float *sim = malloc(sizeof(float) * (size_t)k->heads), mean = -5.0f;
  double *want = malloc(sizeof(double) * (size_t)k->heads), wmean;
  cr_assert(sim && want);
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK, "case %d: %s", idx,
               forkattn_ctx_last_error(ctx));
  ref_similarity(&a, &b, want, &wmean);
  for (int64_t h = 0; h < k->heads; h++)
    cr_assert(fabs((double)sim[h] - want[h]) <= 1e-6,
              "case %d (rows %lld heads %lld d %lld %s/%s layouts %d/%d): sim[%lld] = %.9g, float64 %.9g", idx,
              (long long)k->rows, (long long)k->heads, (long long)k->d, ref_dtype_name(k->da), ref_dtype_name(k->db),
              k->layout_a, k->layout_b, (long long)h, (double)sim[h], want[h]);
  cr_assert(fabs((double)mean - wmean) <= 1e-6, "case %d: mean %.9g, float64 %.9g", idx, (double)mean, wmean);
  cr_assert_eq(tc_buf_changed_bytes(&ba), 0, "case %d: a was written", idx);
  cr_assert_eq(tc_buf_changed_bytes(&bb), 0, "case %d: b was written", idx);
  free(sim);
  free(want);
  tc_buf_free(&ba);
  tc_buf_free(&bb);
}

Test(similarity, matches_float64) {
  forkattn_ctx *ctx = tc_ctx_default("similarity/matches_float64");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("similarity/matches_float64");
  const forkattn_dtype F = FORKATTN_DTYPE_F32, B = FORKATTN_DTYPE_BF16, H = FORKATTN_DTYPE_F16;
  const sim_case cases[] = {
      {1, 1, 1, F, F, DENSE, DENSE, 1.0, 0.5, 0},
      {7, 1, 3, F, F, PADDED, DENSE, 0.0, 1.0, 0},           /* independent: ~0 */
      {64, 1, 128, B, F, DENSE, HEAD_MAJOR, 1.0, 0.05, 1},   /* near 1, bf16 vs f32 */
      {33, 40, 16, F, B, HEAD_MAJOR, PADDED, 1.0, 0.3, 1},   /* many heads */
      {300, 8, 64, B, B, PADDED, PADDED, -1.0, 0.2, 1},      /* near -1 */
      {1000, 2, 256, H, F, DENSE, PADDED, 0.5, 0.5, 0},
      {129, 3, 5, H, B, HEAD_MAJOR, HEAD_MAJOR, 1.0, 0.01, 1},
      {5000, 8, 64, F, F, DENSE, DENSE, 1.0, 0.2, 1},        /* several CPU chunks */
      {20000, 1, 4, B, F, PADDED, DENSE, 1.0, 0.1, 0},       /* 1 head, many rows */
      {3, 64, 32, F, H, DENSE, HEAD_MAJOR, 0.3, 1.0, 1},
  };
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) run_case(ctx, &rng, &cases[i], i);
  for (int i = 0; i < 12; i++) { /* random shapes */
    const forkattn_dtype dts[3] = {F, B, H};
    sim_case k = {tc_randint(&rng, 1, 400), tc_randint(&rng, 1, 12), tc_randint(&rng, 1, 256),
                  dts[tc_randint(&rng, 0, 2)], dts[tc_randint(&rng, 0, 2)], (int)tc_randint(&rng, 0, 2),
                  (int)tc_randint(&rng, 0, 2), tc_uniform(&rng, -1.0, 1.0), tc_uniform(&rng, 0.0, 1.0),
                  (int)tc_randint(&rng, 0, 1)};
    run_case(ctx, &rng, &k, 100 + i);
  }
  forkattn_ctx_destroy(ctx);
}

/* Identical vectors give exactly 1 (also across dtypes holding the same
 * values), negated ones exactly -1; all-zero pairs 1, zero vs non-zero 0. */
Test(similarity, exact_cases) {
  forkattn_ctx *ctx = tc_ctx_default("similarity/exact_cases");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("similarity/exact_cases");
  const int64_t rows = 517, heads = 5, d = 96;
  tc_buf ba, bb, bn, bz;
  forkattn_tensor a = make_view(&ba, FORKATTN_DTYPE_BF16, rows, heads, d, PADDED);
  forkattn_tensor b = make_view(&bb, FORKATTN_DTYPE_F32, rows, heads, d, HEAD_MAJOR);
  forkattn_tensor n = make_view(&bn, FORKATTN_DTYPE_BF16, rows, heads, d, DENSE);
  forkattn_tensor z = make_view(&bz, FORKATTN_DTYPE_F16, rows, heads, d, DENSE);
  tc_fill_tensor(&rng, &a, -3.0, 3.0);
  fill_related(&rng, &a, &b, 1.0, 0.0);  /* the same values in f32 */
  fill_related(&rng, &a, &n, -1.0, 0.0); /* negated */
  fill_related(&rng, &a, &z, 0.0, 0.0);  /* zeros */
  float sim[5], mean;
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &a, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  for (int h = 0; h < heads; h++) cr_assert_eq(sim[h], 1.0f, "a vs a: sim[%d] = %.9g", h, (double)sim[h]);
  cr_assert_eq(mean, 1.0f);
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  for (int h = 0; h < heads; h++) cr_assert_eq(sim[h], 1.0f, "bf16 vs f32 copy: sim[%d] = %.9g", h, (double)sim[h]);
  cr_assert_eq(forkattn_kv_similarity(ctx, &b, &n, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  for (int h = 0; h < heads; h++) cr_assert_eq(sim[h], -1.0f, "negated: sim[%d] = %.9g", h, (double)sim[h]);
  cr_assert_eq(mean, -1.0f);
  cr_assert_eq(forkattn_kv_similarity(ctx, &z, &z, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  for (int h = 0; h < heads; h++) cr_assert_eq(sim[h], 1.0f, "zero vs zero: sim[%d] = %.9g", h, (double)sim[h]);
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &z, sim, NULL, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  for (int h = 0; h < heads; h++) cr_assert_eq(sim[h], 0.0f, "a vs zero: sim[%d] = %.9g", h, (double)sim[h]);
  /* Half the rows of head 2 zero on both sides, the rest negated: (k*1 + (rows-k)*(-1)) / rows. */
  int64_t k = 0;
  for (int64_t r = 0; r < rows; r += 2, k++) {
    zero_vec(&b, r, 2);
    zero_vec(&n, r, 2);
  }
  cr_assert_eq(forkattn_kv_similarity(ctx, &b, &n, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert(fabs((double)sim[2] - (double)(2 * k - rows) / (double)rows) <= 1e-7, "half zero: %.9g", (double)sim[2]);
  cr_assert_eq(sim[1], -1.0f);
  tc_buf_free(&ba);
  tc_buf_free(&bb);
  tc_buf_free(&bn);
  tc_buf_free(&bz);
  forkattn_ctx_destroy(ctx);
}

/* rows = 0: nothing drifted, every head 1 (documented choice). */
Test(similarity, no_rows_is_one) {
  forkattn_ctx *ctx = tc_ctx_default("similarity/no_rows");
  cr_assert_not_null(ctx);
  float x = 0.0f;
  forkattn_tensor a = forkattn_tensor_contiguous(NULL, FORKATTN_DTYPE_F32, 0, 3, 8);
  forkattn_tensor b = forkattn_tensor_contiguous(&x, FORKATTN_DTYPE_BF16, 0, 3, 8);
  float sim[3] = {-7.0f, -7.0f, -7.0f}, mean = -7.0f;
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK, "%s",
               forkattn_ctx_last_error(ctx));
  for (int h = 0; h < 3; h++) cr_assert_eq(sim[h], 1.0f);
  cr_assert_eq(mean, 1.0f);
  forkattn_ctx_destroy(ctx);
}

/* A NaN or an infinity reaches only its own head (and the mean). */
Test(similarity, nonfinite_stays_in_its_head) {
  forkattn_ctx *ctx = tc_ctx_default("similarity/nonfinite");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("similarity/nonfinite");
  tc_buf ba, bb;
  forkattn_tensor a = make_view(&ba, FORKATTN_DTYPE_F32, 50, 4, 16, DENSE);
  forkattn_tensor b = make_view(&bb, FORKATTN_DTYPE_BF16, 50, 4, 16, PADDED);
  tc_fill_tensor(&rng, &a, -1.0, 1.0);
  fill_related(&rng, &a, &b, 1.0, 0.1);
  ref_tensor_set(&a, 17, 1, 3, NAN);
  ref_tensor_set(&b, 40, 3, 0, INFINITY);
  float sim[4], mean;
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, sim, &mean, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert(isnan(sim[1]) && isnan(sim[3]) && isnan(mean));
  cr_assert(isfinite(sim[0]) && isfinite(sim[2]) && sim[0] > 0.9f && sim[2] > 0.9f);
  tc_buf_free(&ba);
  tc_buf_free(&bb);
  forkattn_ctx_destroy(ctx);
}

/* Bitwise the same for 1, 2 and 3 threads (fixed chunks, fixed-order sums). */
Test(similarity, deterministic_across_threads) {
  tc_rng rng = tc_rng_for("similarity/deterministic");
  tc_buf ba, bb;
  const int64_t rows = 3001, heads = 6, d = 80;
  forkattn_tensor a = make_view(&ba, FORKATTN_DTYPE_BF16, rows, heads, d, DENSE);
  forkattn_tensor b = make_view(&bb, FORKATTN_DTYPE_F32, rows, heads, d, HEAD_MAJOR);
  tc_fill_tensor(&rng, &a, -1.0, 1.0);
  fill_related(&rng, &a, &b, 0.9, 0.3);
  float first[6], sim[6], m0 = 0.0f, m;
  for (int t = 1; t <= 3; t++) {
    forkattn_ctx *ctx = ctx_threads(t);
    for (int rep = 0; rep < 3; rep++) {
      cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, t == 1 && rep == 0 ? first : sim,
                                          t == 1 && rep == 0 ? &m0 : &m, FORKATTN_MEMORY_HOST),
                   FORKATTN_OK);
      if (t == 1 && rep == 0) continue;
      cr_assert(memcmp(first, sim, sizeof sim) == 0 && memcmp(&m0, &m, sizeof m) == 0,
                "threads %d run %d differs from 1 thread", t, rep);
    }
    forkattn_ctx_destroy(ctx);
  }
  tc_buf_free(&ba);
  tc_buf_free(&bb);
}

#define EXPECT_BAD(call, needle)                                                                                   \
  do {                                                                                                             \
    forkattn_status st_ = (call);                                                                                  \
    cr_assert_eq(st_, FORKATTN_ERR_INVALID_ARGUMENT, "%s: got status %d", #call, (int)st_);                       \
    cr_assert(strstr(forkattn_ctx_last_error(ctx), needle), "%s: message '%s' lacks '%s'", #call,                 \
              forkattn_ctx_last_error(ctx), needle);                                                               \
  } while (0)

Test(similarity, bad_arguments) {
  forkattn_ctx *ctx = tc_ctx_default("similarity/bad_arguments");
  cr_assert_not_null(ctx);
  float da[4 * 2 * 8] = {0}, db[4 * 2 * 8] = {0};
  forkattn_tensor a = forkattn_tensor_contiguous(da, FORKATTN_DTYPE_F32, 4, 2, 8);
  forkattn_tensor b = forkattn_tensor_contiguous(db, FORKATTN_DTYPE_F32, 4, 2, 8);
  float sim[2] = {42.0f, 42.0f}, mean = 42.0f;
  const forkattn_memory HOST = FORKATTN_MEMORY_HOST;
  cr_assert_eq(forkattn_kv_similarity(NULL, &a, &b, sim, &mean, HOST), FORKATTN_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(forkattn_kv_similarity(ctx, NULL, &b, sim, &mean, HOST), "a:");
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, NULL, sim, &mean, HOST), "b:");
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &b, NULL, &mean, HOST), "sim:");
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &b, sim, &mean, (forkattn_memory)7), "memory");
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU)
    EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &b, sim, &mean, FORKATTN_MEMORY_DEVICE), "memory");
  forkattn_tensor t = b;
  t.rows = 3;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &t, sim, &mean, HOST), "differs from a's");
  t = b;
  t.heads = 1;
  t.row_stride = 8;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &t, sim, &mean, HOST), "differs from a's");
  t = b;
  t.head_dim = 4;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &t, sim, &mean, HOST), "differs from a's");
  t = a;
  t.dtype = (forkattn_dtype)9;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &t, &b, sim, &mean, HOST), "a: unknown dtype");
  t = b;
  t.head_stride = 4; /* heads overlap */
  EXPECT_BAD(forkattn_kv_similarity(ctx, &a, &t, sim, &mean, HOST), "b:");
  t = a;
  t.data = NULL;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &t, &b, sim, &mean, HOST), "a: data pointer is NULL");
  t = a;
  t.rows = -1;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &t, &b, sim, &mean, HOST), "a:");
  t = a;
  t.heads = 0;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &t, &b, sim, &mean, HOST), "a:");
  forkattn_tensor wide_a = forkattn_tensor_contiguous(da, FORKATTN_DTYPE_F32, 0, 1, 257);
  forkattn_tensor wide_b = wide_a;
  EXPECT_BAD(forkattn_kv_similarity(ctx, &wide_a, &wide_b, sim, &mean, HOST), "head_dim 257");
  cr_assert(sim[0] == 42.0f && sim[1] == 42.0f && mean == 42.0f, "outputs written on an argument error");
  forkattn_ctx_destroy(ctx);
}

/* Device memory (GPU backend): the GPU path equals the host path to rounding
 * and the float64 rule; strided device views, mixed dtypes. */
Test(similarity, device_memory) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip("similarity/device_memory");
  tc_rng rng = tc_rng_for("similarity/device_memory");
  const int64_t shapes[][3] = {{1, 1, 1}, {777, 8, 128}, {40000, 2, 64}, {5, 70, 3}};
  for (int s = 0; s < 4; s++) {
    const int64_t rows = shapes[s][0], heads = shapes[s][1], d = shapes[s][2];
    tc_buf ba, bb;
    forkattn_tensor a = make_view(&ba, FORKATTN_DTYPE_BF16, rows, heads, d, s % 2 ? PADDED : DENSE);
    forkattn_tensor b = make_view(&bb, s % 2 ? FORKATTN_DTYPE_F32 : FORKATTN_DTYPE_F16, rows, heads, d, HEAD_MAJOR);
    tc_fill_tensor(&rng, &a, -1.0, 1.0);
    fill_related(&rng, &a, &b, 1.0, 0.2);
    if (rows > 3) {
      zero_vec(&a, 2, 0);
      zero_vec(&b, 2, 0);
      zero_vec(&b, 3, 0);
    }
    const size_t bytes_a = ba.elems * ref_dtype_size(ba.dtype), bytes_b = bb.elems * ref_dtype_size(bb.dtype);
    void *pa, *pb;
    cr_assert_eq(forkattn_device_malloc(ctx, bytes_a, &pa), FORKATTN_OK);
    cr_assert_eq(forkattn_device_malloc(ctx, bytes_b, &pb), FORKATTN_OK);
    cr_assert_eq(forkattn_memcpy(ctx, pa, FORKATTN_MEMORY_DEVICE, ba.data, FORKATTN_MEMORY_HOST, bytes_a), FORKATTN_OK);
    cr_assert_eq(forkattn_memcpy(ctx, pb, FORKATTN_MEMORY_DEVICE, bb.data, FORKATTN_MEMORY_HOST, bytes_b), FORKATTN_OK);
    forkattn_tensor da = a, db = b;
    da.data = (char *)pa + ((char *)a.data - (char *)ba.data);
    db.data = (char *)pb + ((char *)b.data - (char *)bb.data);
    float *sh = malloc(sizeof(float) * (size_t)heads), *sd = malloc(sizeof(float) * (size_t)heads), mh, md, md2;
    double *want = malloc(sizeof(double) * (size_t)heads), wm;
    cr_assert(sh && sd && want);
    cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, sh, &mh, FORKATTN_MEMORY_HOST), FORKATTN_OK);
    cr_assert_eq(forkattn_kv_similarity(ctx, &da, &db, sd, &md, FORKATTN_MEMORY_DEVICE), FORKATTN_OK, "%s",
                 forkattn_ctx_last_error(ctx));
    ref_similarity(&a, &b, want, &wm);
    for (int64_t h = 0; h < heads; h++) {
      cr_assert(fabs((double)sd[h] - want[h]) <= 1e-6, "shape %d: device sim[%lld] = %.9g, float64 %.9g", s,
                (long long)h, (double)sd[h], want[h]);
      cr_assert(fabs((double)sd[h] - (double)sh[h]) <= 1e-6, "shape %d: device %.9g, host %.9g", s, (double)sd[h],
                (double)sh[h]);
    }
    cr_assert(fabs((double)md - wm) <= 1e-6);
    cr_assert_eq(forkattn_kv_similarity(ctx, &da, &da, sd, &md2, FORKATTN_MEMORY_DEVICE), FORKATTN_OK);
    for (int64_t h = 0; h < heads; h++) cr_assert_eq(sd[h], 1.0f, "device a vs a: sim[%lld] = %.9g", (long long)h,
                                                     (double)sd[h]);
    free(sh);
    free(sd);
    free(want);
    forkattn_device_free(ctx, pa);
    forkattn_device_free(ctx, pb);
    tc_buf_free(&ba);
    tc_buf_free(&bb);
  }
  forkattn_ctx_destroy(ctx);
}

/* ======================================================================== */
/* profile                                                                  */
/* ======================================================================== */

static forkattn_reuse_profile *new_profile(forkattn_ctx *ctx, int64_t layers, float thr) {
  forkattn_reuse_profile *p = NULL;
  cr_assert_eq(forkattn_reuse_profile_create(ctx, layers, thr, &p), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_assert_not_null(p);
  return p;
}

static int64_t depth_at(forkattn_ctx *ctx, const forkattn_reuse_profile *p, double r) {
  int64_t d = -1;
  cr_assert_eq(forkattn_reuse_profile_depth(ctx, p, r, &d), FORKATTN_OK, "r = %g: %s", r, forkattn_ctx_last_error(ctx));
  return d;
}

static void all_depths(forkattn_ctx *ctx, const forkattn_reuse_profile *p, int64_t *out) {
  for (int k = 0; k < NBINS; k++) out[k] = depth_at(ctx, p, k / 100.0);
}

/* sim_l(r) = 1 - 0.035 l (1.5 - r): decays with depth, grows with r. With
 * threshold 0.9 the leading layers that stay >= 0.9 (margin >= 0.002 to it) are
 * r = 0.1: 3 (0.902 / 0.853), 0.3: 3, 0.5: 3, 0.7: 4, 0.9: 5, 1.0: 6. */
Test(profile, synthetic_depths) {
  forkattn_ctx *ctx = tc_ctx_default("profile/synthetic");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("profile/synthetic");
  const int64_t L = 10;
  forkattn_reuse_profile *p = new_profile(ctx, L, 0.9f);
  for (int k = 0; k < NBINS; k++) cr_assert_eq(depth_at(ctx, p, k / 100.0), 0, "empty profile");
  const double ratios[6] = {0.1, 0.3, 0.5, 0.7, 0.9, 1.0};
  const int64_t want[6] = {3, 3, 3, 4, 5, 6};
  for (int i = 0; i < 6; i++)
    for (int rep = 0; rep < 20; rep++) { /* pairs of +-e noise: the means stay within 1e-12 of the formula */
      const double e = tc_uniform(&rng, 0.0, 0.0015), jitter = tc_uniform(&rng, 0.0, 0.0099);
      for (int sgn = -1; sgn <= 1; sgn += 2) {
        float sim[10];
        for (int64_t l = 0; l < L; l++) sim[l] = (float)fmin(1.0, 1.0 - 0.035 * (double)l * (1.5 - ratios[i]) + sgn * e);
        /* any ratio of the bin: [r, r + 0.01) (r = 1 is its own bin) */
        cr_assert_eq(forkattn_reuse_profile_add(ctx, p, ratios[i] < 1.0 ? ratios[i] + jitter : 1.0, sim), FORKATTN_OK,
                     "%s", forkattn_ctx_last_error(ctx));
      }
    }
  for (int k = 0; k < NBINS; k++) {
    const double r = k / 100.0;
    int64_t w = 0;
    for (int i = 0; i < 6; i++)
      if (r >= ratios[i] - 1e-12) w = want[i];
    cr_assert_eq(depth_at(ctx, p, r), w, "bin %d: depth %lld, want %lld", k, (long long)depth_at(ctx, p, r),
                 (long long)w);
  }
  cr_assert_eq(depth_at(ctx, p, 0.0999), 0);
  cr_assert_eq(depth_at(ctx, p, 0.1), 3);
  cr_assert_eq(depth_at(ctx, p, 0.999999), 5);
  cr_assert_eq(depth_at(ctx, p, 1.0), 6);
  forkattn_reuse_profile_free(p);
  forkattn_ctx_destroy(ctx);
}

/* One measurement whose first `depth` layers are 1 and the rest 0. */
static void add_raw(forkattn_ctx *ctx, forkattn_reuse_profile *p, int64_t L, double r, int64_t depth) {
  float sim[64];
  for (int64_t l = 0; l < L; l++) sim[l] = l < depth ? 1.0f : 0.0f;
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, r, sim), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
}

/* Raw depths 4, 6, 2, 5 at bins 20, 40, 60, 80: conservative monotone depths
 * 2, 2, 2, 5; gaps take the lower bin's, below bin 20 nothing (0). */
Test(profile, conservative_monotone_rule) {
  forkattn_ctx *ctx = tc_ctx_default("profile/conservative");
  cr_assert_not_null(ctx);
  const int64_t L = 8;
  forkattn_reuse_profile *p = new_profile(ctx, L, 0.95f);
  add_raw(ctx, p, L, 0.20, 4);
  add_raw(ctx, p, L, 0.40, 6);
  add_raw(ctx, p, L, 0.60, 2);
  add_raw(ctx, p, L, 0.80, 5);
  int64_t d[NBINS];
  all_depths(ctx, p, d);
  for (int k = 0; k < NBINS; k++) {
    const int64_t w = k < 20 ? 0 : (k < 80 ? 2 : 5);
    cr_assert_eq(d[k], w, "bin %d: %lld, want %lld", k, (long long)d[k], (long long)w);
  }
  /* A bin averages its measurements: bin 60 with a second measurement of depth
   * 8 averages layers 2..7 to 0.5 (< 0.95): still 2. */
  add_raw(ctx, p, L, 0.605, 8);
  cr_assert_eq(depth_at(ctx, p, 0.6), 2);
  /* Bin boundaries: 0.29 is bin 29 (not 28 despite 0.29 * 100 < 29 in binary). */
  forkattn_reuse_profile *q = new_profile(ctx, L, 0.5f);
  add_raw(ctx, q, L, 0.29, 7);
  cr_assert_eq(depth_at(ctx, q, 0.29), 7);
  cr_assert_eq(depth_at(ctx, q, 0.2899), 0);
  cr_assert_eq(depth_at(ctx, q, 0.2999), 7);
  cr_assert_eq(depth_at(ctx, q, 1.0), 7);
  add_raw(ctx, q, L, 1.0, 1); /* r = 1 is bin 100 alone, and now caps bin 29 */
  cr_assert_eq(depth_at(ctx, q, 1.0), 1);
  cr_assert_eq(depth_at(ctx, q, 0.999), 1);
  cr_assert_eq(depth_at(ctx, q, 0.29), 1);
  /* The threshold is inclusive; layers after the first failure never count. */
  forkattn_reuse_profile *t = new_profile(ctx, 4, 0.5f);
  const float sim[4] = {0.5f, 0.5f, 0.25f, 1.0f};
  cr_assert_eq(forkattn_reuse_profile_add(ctx, t, 0.5, sim), FORKATTN_OK);
  cr_assert_eq(depth_at(ctx, t, 0.5), 2);
  forkattn_reuse_profile_free(p);
  forkattn_reuse_profile_free(q);
  forkattn_reuse_profile_free(t);
  forkattn_ctx_destroy(ctx);
}

/* ---- brute-force model of the documented rule ----------------------------- */

typedef struct model {
  int64_t L;
  double thr;
  int64_t count[NBINS];
  double mean[NBINS][48];
} model;

static int bin_of(double r) {
  const int k = (int)floor(r * 100.0 + 1e-9);
  return k > 100 ? 100 : k;
}

static void model_add(model *m, double r, const float *sim) {
  const int k = bin_of(r);
  const int64_t n = ++m->count[k];
  for (int64_t l = 0; l < m->L; l++) {
    const double x = fmin(1.0, fmax(-1.0, (double)sim[l]));
    m->mean[k][l] = fmin(1.0, fmax(-1.0, m->mean[k][l] + (x - m->mean[k][l]) / (double)n));
  }
}

static int64_t model_raw(const model *m, int k) {
  int64_t d = 0;
  while (d < m->L && m->mean[k][d] >= m->thr) d++;
  return d;
}

static int64_t model_depth(const model *m, int k) {
  if (!m->count[k]) { /* nearest lower bin with data */
    for (int j = k - 1; j >= 0; j--)
      if (m->count[j]) return model_depth(m, j);
    return 0;
  }
  int64_t d = m->L;
  for (int j = k; j < NBINS; j++)
    if (m->count[j] && model_raw(m, j) < d) d = model_raw(m, j);
  return d;
}

/* A random profile: sims around a decaying, ratio-increasing curve with noise
 * (so raw depths are not monotone), occasional outliers, empty stretches. */
static void random_profile(tc_rng *rng, forkattn_ctx *ctx, forkattn_reuse_profile **out, model *m) {
  memset(m, 0, sizeof *m);
  m->L = tc_randint(rng, 1, 48);
  const float thr = (float)tc_uniform(rng, 0.5, 1.0);
  m->thr = (double)thr;
  *out = new_profile(ctx, m->L, thr);
  const int64_t n = tc_randint(rng, 0, 300);
  const double lo = tc_uniform(rng, 0.0, 1.0), hi = tc_uniform(rng, lo, 1.0);
  for (int64_t i = 0; i < n; i++) {
    const double r = tc_randint(rng, 0, 9) == 0 ? 1.0 : tc_uniform(rng, lo, hi);
    float sim[48];
    const double decay = tc_uniform(rng, 0.0, 0.05);
    for (int64_t l = 0; l < m->L; l++) {
      double x = 1.0 - decay * (double)l * (1.2 - r) + tc_uniform(rng, -0.05, 0.05);
      if (tc_randint(rng, 0, 30) == 0) x = tc_uniform(rng, -1.0, 1.0);
      sim[l] = (float)fmin(1.0, fmax(-1.0, x));
    }
    cr_assert_eq(forkattn_reuse_profile_add(ctx, *out, r, sim), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    model_add(m, r, sim);
  }
}

Test(profile, monotone_property) {
  forkattn_ctx *ctx = tc_ctx_default("profile/monotone");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("profile/monotone");
  model *m = malloc(sizeof *m);
  cr_assert_not_null(m);
  for (int it = 0; it < 200; it++) {
    forkattn_reuse_profile *p;
    random_profile(&rng, ctx, &p, m);
    int64_t d[NBINS];
    all_depths(ctx, p, d);
    for (int k = 0; k < NBINS; k++) {
      cr_assert(d[k] >= 0 && d[k] <= m->L, "iteration %d: depth %lld outside 0..%lld", it, (long long)d[k],
                (long long)m->L);
      if (k) cr_assert(d[k] >= d[k - 1], "iteration %d: depth drops from %lld (bin %d) to %lld (bin %d)", it,
                       (long long)d[k - 1], k - 1, (long long)d[k], k);
      cr_assert_eq(d[k], model_depth(m, k), "iteration %d bin %d: %lld, brute force %lld", it, k, (long long)d[k],
                   (long long)model_depth(m, k));
    }
    double prev_r = 0.0;
    int64_t prev_d = d[0];
    for (int j = 0; j < 50; j++) { /* random ratios in increasing order */
      const double r = prev_r + tc_uniform(&rng, 0.0, (1.0 - prev_r) / 4.0);
      const int64_t x = depth_at(ctx, p, r);
      cr_assert(x >= prev_d, "iteration %d: depth(%.17g) = %lld < depth(%.17g) = %lld", it, r, (long long)x, prev_r,
                (long long)prev_d);
      cr_assert_eq(x, d[bin_of(r)]);
      prev_r = r;
      prev_d = x;
    }
    forkattn_reuse_profile_free(p);
  }
  free(m);
  forkattn_ctx_destroy(ctx);
}

/* ---- files ----------------------------------------------------------------- */

typedef struct tmpdir {
  char dir[64];
  char path[128];
} tmpdir;

static void tmp_open(tmpdir *t) {
  snprintf(t->dir, sizeof t->dir, "/tmp/forkattn_profile_XXXXXX");
  cr_assert_not_null(mkdtemp(t->dir));
  snprintf(t->path, sizeof t->path, "%s/p.txt", t->dir);
}

static void tmp_close(tmpdir *t) {
  unlink(t->path);
  rmdir(t->dir);
}

static char *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  cr_assert_not_null(f, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  const long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = malloc((size_t)n + 1);
  cr_assert_not_null(s);
  cr_assert_eq(fread(s, 1, (size_t)n, f), (size_t)n);
  s[n] = '\0';
  fclose(f);
  if (len) *len = (size_t)n;
  return s;
}

static void spit(const char *path, const char *s, size_t n) {
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f);
  cr_assert_eq(fwrite(s, 1, n, f), n);
  fclose(f);
}

static void assert_same_depths(forkattn_ctx *ctx, const forkattn_reuse_profile *p, const forkattn_reuse_profile *q,
                               tc_rng *rng) {
  for (int k = 0; k < NBINS; k++)
    cr_assert_eq(depth_at(ctx, p, k / 100.0), depth_at(ctx, q, k / 100.0), "bin %d differs after load", k);
  for (int j = 0; j < 100; j++) {
    const double r = tc_uniform(rng, 0.0, 1.0);
    cr_assert_eq(depth_at(ctx, p, r), depth_at(ctx, q, r));
  }
}

Test(profile, save_load_round_trip) {
  forkattn_ctx *ctx = tc_ctx_default("profile/round_trip");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("profile/round_trip");
  tmpdir td;
  tmp_open(&td);
  char second[160];
  snprintf(second, sizeof second, "%s/q.txt", td.dir);
  model *m = malloc(sizeof *m);
  cr_assert_not_null(m);
  for (int it = 0; it < 60; it++) {
    forkattn_reuse_profile *p, *q = NULL;
    random_profile(&rng, ctx, &p, m);
    cr_assert_eq(forkattn_reuse_profile_save(ctx, p, td.path), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    cr_assert_eq(forkattn_reuse_profile_load(ctx, td.path, &q), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    cr_assert_not_null(q);
    assert_same_depths(ctx, p, q, &rng);
    /* The loaded profile is the saved one: same file, and later adds continue identically. */
    float sim[48];
    for (int64_t l = 0; l < m->L; l++) sim[l] = (float)tc_uniform(&rng, 0.6, 1.0);
    const double r = tc_uniform(&rng, 0.0, 1.0);
    cr_assert_eq(forkattn_reuse_profile_add(ctx, p, r, sim), FORKATTN_OK);
    cr_assert_eq(forkattn_reuse_profile_add(ctx, q, r, sim), FORKATTN_OK);
    cr_assert_eq(forkattn_reuse_profile_save(ctx, p, td.path), FORKATTN_OK);
    cr_assert_eq(forkattn_reuse_profile_save(ctx, q, second), FORKATTN_OK);
    char *a = slurp(td.path, NULL), *b = slurp(second, NULL);
    cr_assert_str_eq(a, b, "iteration %d: saved files differ", it);
    free(a);
    free(b);
    assert_same_depths(ctx, p, q, &rng);
    forkattn_reuse_profile_free(p);
    forkattn_reuse_profile_free(q);
  }
  /* The layout of a small file, literally. */
  forkattn_reuse_profile *p = new_profile(ctx, 2, 0.95f), *q = NULL;
  const float s1[2] = {1.0f, 0.5f}, s2[2] = {0.75f, -0.25f};
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, 0.5, s1), FORKATTN_OK);
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, 0.5, s2), FORKATTN_OK);
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, 1.0, s1), FORKATTN_OK);
  cr_assert_eq(forkattn_reuse_profile_save(ctx, p, td.path), FORKATTN_OK);
  char *text = slurp(td.path, NULL);
  cr_assert_str_eq(text, "forkattn-reuse-profile 1\nlayers 2\nthreshold 0.949999988\nbins 2\n"
                         "50 2 0.875 0.125\n100 1 1 0.5\nend\n");
  free(text);
  /* Under a locale whose decimal point is a comma the file is the same. */
  const char *comma[] = {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "fr_FR.utf8", "de_DE", NULL};
  int switched = 0;
  for (int i = 0; comma[i] && !switched; i++) switched = setlocale(LC_NUMERIC, comma[i]) != NULL;
  if (switched && strcmp(localeconv()->decimal_point, ",") == 0) {
    cr_assert_eq(forkattn_reuse_profile_save(ctx, p, second), FORKATTN_OK);
    cr_assert_eq(forkattn_reuse_profile_load(ctx, td.path, &q), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    setlocale(LC_NUMERIC, "C");
    char *a = slurp(td.path, NULL), *b = slurp(second, NULL);
    cr_assert_str_eq(a, b, "a comma locale changed the file");
    free(a);
    free(b);
    assert_same_depths(ctx, p, q, &rng);
    forkattn_reuse_profile_free(q);
  } else {
    setlocale(LC_NUMERIC, "C");
    fprintf(stderr, "profile/round_trip: no comma locale installed, locale check skipped\n");
  }
  /* An empty profile round-trips too. */
  forkattn_reuse_profile *e = new_profile(ctx, 3, 0.0f);
  cr_assert_eq(forkattn_reuse_profile_save(ctx, e, td.path), FORKATTN_OK);
  cr_assert_eq(forkattn_reuse_profile_load(ctx, td.path, &q), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  for (int k = 0; k < NBINS; k++) cr_assert_eq(depth_at(ctx, q, k / 100.0), 0);
  forkattn_reuse_profile_free(q);
  forkattn_reuse_profile_free(e);
  forkattn_reuse_profile_free(p);
  unlink(second);
  free(m);
  tmp_close(&td);
  forkattn_ctx_destroy(ctx);
}

/* Load `text`: must fail with INVALID_ARGUMENT, a message containing `needle`,
 * and *profile reset to NULL. */
static void expect_refused(forkattn_ctx *ctx, const char *path, const char *text, size_t n, const char *needle) {
  spit(path, text, n);
  forkattn_reuse_profile *p = (forkattn_reuse_profile *)(void *)&p; /* non-NULL sentinel */
  const forkattn_status st = forkattn_reuse_profile_load(ctx, path, &p);
  cr_assert_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "accepted (status %d):\n%.*s", (int)st, (int)n, text);
  cr_assert_null(p, "*profile not reset on failure");
  cr_assert(strstr(forkattn_ctx_last_error(ctx), needle), "message '%s' lacks '%s' for:\n%.*s",
            forkattn_ctx_last_error(ctx), needle, (int)n, text);
}

static void expect_refused_str(forkattn_ctx *ctx, const char *path, const char *text, const char *needle) {
  expect_refused(ctx, path, text, strlen(text), needle);
}

Test(profile, malformed_files) {
  forkattn_ctx *ctx = tc_ctx_default("profile/malformed");
  cr_assert_not_null(ctx);
  tmpdir td;
  tmp_open(&td);
  const char *P = td.path;
  const char *good = "forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 2\n3 4 0.9 0.1\n97 1 1 -1\nend\n";
  forkattn_reuse_profile *p = NULL;
  spit(P, good, strlen(good));
  cr_assert_eq(forkattn_reuse_profile_load(ctx, P, &p), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(depth_at(ctx, p, 0.03), 1);
  cr_assert_eq(depth_at(ctx, p, 0.98), 1);
  cr_assert_eq(depth_at(ctx, p, 0.02), 0);
  forkattn_reuse_profile_free(p);
  /* Accepted variations: CRLF line ends, extra spaces, blank lines after end, no final newline. */
  const char *ok[] = {
      "forkattn-reuse-profile 1\r\nlayers 2\r\nthreshold 0.5\r\nbins 1\r\n3 4 0.9 0.1\r\nend\r\n",
      "forkattn-reuse-profile  1\nlayers\t2\nthreshold 5e-1\nbins 1\n 3 4  0.9 0.1 \nend\n\n\n",
      "forkattn-reuse-profile 1\nlayers 2\nthreshold 1\nbins 0\nend",
  };
  for (int i = 0; i < 3; i++) {
    spit(P, ok[i], strlen(ok[i]));
    p = NULL;
    cr_assert_eq(forkattn_reuse_profile_load(ctx, P, &p), FORKATTN_OK, "variant %d: %s", i,
                 forkattn_ctx_last_error(ctx));
    forkattn_reuse_profile_free(p);
  }
  /* Every truncation of the good file (short of dropping only its final newline) is refused. */
  const size_t n = strlen(good);
  for (size_t cut = 0; cut + 1 < n; cut++) expect_refused(ctx, P, good, cut, P);
  struct {
    const char *text, *needle;
  } bad[] = {
      {"", "is empty"},
      {"forkattn-reuse-profil 1\n", "not a reuse-depth profile"},
      {"forkattn-reuse-profile\n", "not a reuse-depth profile"},
      {"forkattn-reuse-profile 2\nlayers 2\n", "version '2' is not supported"},
      {"forkattn-reuse-profile 1 x\n", "not a reuse-depth profile"},
      {"forkattn-reuse-profile 1\nlayer 2\n", "line 2: expected 'layers <integer>'"},
      {"forkattn-reuse-profile 1\nlayers 0\n", "line 2: layers '0' must be an integer in 1..65536"},
      {"forkattn-reuse-profile 1\nlayers 65537\n", "layers '65537'"},
      {"forkattn-reuse-profile 1\nlayers 2x\n", "layers '2x'"},
      /* strtoll/strtod would skip a carriage return (or \v, \f) before the digits */
      {"forkattn-reuse-profile 1\nlayers \r2\n", "line 2: layers '\r2'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold \v0.5\n", "line 3: threshold '\v0.5'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 \f4 0.9 0.1\nend\n", "count '\f4'"},
      {"forkattn-reuse-profile 1\nlayers 99999999999999999999\n", "layers '99999999999999999999'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold nan\n", "line 3: threshold 'nan'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 1.5\n", "threshold '1.5'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold -0.1\n", "threshold '-0.1'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold inf\n", "threshold 'inf'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold\n", "expected 'threshold <value>'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 102\n", "line 4: bins '102'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins -1\n", "bins '-1'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4 nan 0.1\nend\n", "line 5: mean 0 of bin 3, 'nan'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4 0.9 -inf\nend\n", "mean 1 of bin 3, '-inf'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4 0.9 1.5\nend\n", "outside [-1, 1]"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4 0.9 0.x\nend\n", "'0.x', is not a finite"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4 0.9\nend\n", "bin 3 has 1 means, the profile has 2"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4 0.9 0.1 0.2\nend\n", "bin 3 has 3 means"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3\nend\n", "expected '<bin> <count>'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 0 0.9 0.1\nend\n", "count '0' of bin 3"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 -2 0.9 0.1\nend\n", "count '-2'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n101 1 0.9 0.1\nend\n", "bin '101' must be"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n-1 1 0.9 0.1\nend\n", "bin '-1' must be"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 2\n5 1 0.9 0.1\n4 1 0.9 0.1\nend\n",
       "line 6: bin 4 follows bin 5"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 2\n5 1 0.9 0.1\n5 1 0.9 0.1\nend\n", "bin 5 follows bin 5"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 2\n5 1 0.9 0.1\nend\n", "line 6: 'end' after 1 of 2 bin lines"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n5 1 0.9 0.1\n6 1 0.9 0.1\nend\n",
       "line 6: expected 'end' after 1 bin lines"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n5 1 0.9 0.1\nend\nmore\n",
       "line 7: unexpected content after 'end'"},
      {"forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 0\nend now\n", "expected 'end'"},
  };
  for (int i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) expect_refused_str(ctx, P, bad[i].text, bad[i].needle);
  const char nul[] = "forkattn-reuse-profile 1\nlayers 2\nthr\0shold 0.5\n";
  expect_refused(ctx, P, nul, sizeof nul - 1, "line 3: contains a NUL byte");
  /* Missing files, bad arguments. */
  p = (forkattn_reuse_profile *)(void *)&p;
  char missing[160];
  snprintf(missing, sizeof missing, "%s/none.txt", td.dir);
  cr_assert_eq(forkattn_reuse_profile_load(ctx, missing, &p), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(p);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "cannot open") && strstr(forkattn_ctx_last_error(ctx), "none.txt"),
            "%s", forkattn_ctx_last_error(ctx));
  EXPECT_BAD(forkattn_reuse_profile_load(ctx, td.dir, &p), "path:"); /* a directory */
  EXPECT_BAD(forkattn_reuse_profile_load(ctx, NULL, &p), "path:");
  EXPECT_BAD(forkattn_reuse_profile_load(ctx, "", &p), "path:");
  EXPECT_BAD(forkattn_reuse_profile_load(ctx, P, NULL), "profile:");
  cr_assert_eq(forkattn_reuse_profile_load(NULL, P, &p), FORKATTN_ERR_INVALID_ARGUMENT);
  tmp_close(&td);
  forkattn_ctx_destroy(ctx);
}

/* Reading is bounded: an overlong line, an endless stream (/dev/zero: NUL bytes,
 * never a newline) or endless blank lines after "end" are refused after a
 * bounded read instead of buffering until memory runs out; the bounds leave
 * room for every file save() writes. */
Test(profile, bounded_reading, .timeout = 30) {
  forkattn_ctx *ctx = tc_ctx_default("profile/bounded");
  cr_assert_not_null(ctx);
  tmpdir td;
  tmp_open(&td);
  const char *P = td.path;
  const size_t big = (size_t)4 << 20;
  char *text = malloc(big + 256);
  cr_assert_not_null(text);
  /* an overlong first line (a header line holds at most 256 bytes) */
  memset(text, 'x', big);
  expect_refused(ctx, P, text, big, "line 1: is longer than 256 bytes");
  /* a bin line with far too many means: 2 layers allow 64 + 40 x 2 bytes */
  const char *head = "forkattn-reuse-profile 1\nlayers 2\nthreshold 0.5\nbins 1\n3 4";
  size_t n = strlen(head);
  memcpy(text, head, n);
  while (n < big) memcpy(text + n, " 0.5", 4), n += 4;
  memcpy(text + n, "\nend\n", 5);
  expect_refused(ctx, P, text, n + 5, "line 5: is longer than 144 bytes");
  /* an endless stream of NUL bytes */
  forkattn_reuse_profile *p = (forkattn_reuse_profile *)(void *)&p;
  if (access("/dev/zero", R_OK) == 0) {
    cr_expect_eq(forkattn_reuse_profile_load(ctx, "/dev/zero", &p), FORKATTN_ERR_INVALID_ARGUMENT, "%s",
                 forkattn_ctx_last_error(ctx));
    cr_expect_null(p);
    cr_expect(strstr(forkattn_ctx_last_error(ctx), "line 1: contains a NUL byte"), "%s", forkattn_ctx_last_error(ctx));
  }
  /* blank lines after "end": 1024 are fine, 1025 are not */
  const char *small = "forkattn-reuse-profile 1\nlayers 1\nthreshold 0.5\nbins 0\nend\n";
  n = strlen(small);
  memcpy(text, small, n);
  memset(text + n, '\n', 1025);
  expect_refused(ctx, P, text, n + 1025, "line 1030: more than 1024 blank lines after 'end'");
  spit(P, text, n + 1024);
  p = NULL;
  cr_expect_eq(forkattn_reuse_profile_load(ctx, P, &p), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  forkattn_reuse_profile_free(p);
  /* the longest means save() writes (%.17g of a tiny negative float: 23 characters) still load */
  const int64_t L = 3000;
  float *sim = malloc(sizeof *sim * (size_t)L);
  cr_assert_not_null(sim);
  for (int64_t l = 0; l < L; l++) sim[l] = -1.17549435e-38f * (float)(1 + l % 7);
  forkattn_reuse_profile *w = new_profile(ctx, L, 0.5f), *q = NULL;
  for (int b = 0; b < 101; b++) cr_assert_eq(forkattn_reuse_profile_add(ctx, w, b / 100.0, sim), FORKATTN_OK);
  cr_assert_eq(forkattn_reuse_profile_save(ctx, w, P), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_expect_eq(forkattn_reuse_profile_load(ctx, P, &q), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  forkattn_reuse_profile_free(q);
  forkattn_reuse_profile_free(w);
  free(sim);
  free(text);
  tmp_close(&td);
  forkattn_ctx_destroy(ctx);
}

Test(profile, bad_arguments) {
  forkattn_ctx *ctx = tc_ctx_default("profile/bad_arguments");
  cr_assert_not_null(ctx);
  const forkattn_status BAD = FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_reuse_profile *p = (forkattn_reuse_profile *)(void *)&p;
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 0, 0.9f, &p), "layers: 0");
  cr_assert_null(p, "*profile not reset");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, -3, 0.9f, &p), "layers: -3");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 65537, 0.9f, &p), "layers: 65537");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 4, NAN, &p), "threshold:");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 4, INFINITY, &p), "threshold:");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 4, -0.01f, &p), "threshold:");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 4, 1.01f, &p), "threshold:");
  EXPECT_BAD(forkattn_reuse_profile_create(ctx, 4, 0.9f, NULL), "profile:");
  cr_assert_eq(forkattn_reuse_profile_create(NULL, 4, 0.9f, &p), BAD);
  forkattn_reuse_profile_free(NULL);
  p = new_profile(ctx, 4, 0.9f);
  float sim[4] = {1.0f, 0.95f, 0.92f, 0.5f};
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, 0.42, sim), FORKATTN_OK);
  cr_assert_eq(depth_at(ctx, p, 0.42), 3);
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, NAN, sim), "ratio:");
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, -0.001, sim), "ratio:");
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, 1.001, sim), "ratio:");
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, INFINITY, sim), "ratio:");
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, 0.5, NULL), "sim:");
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, NULL, 0.5, sim), "profile:");
  cr_assert_eq(forkattn_reuse_profile_add(NULL, p, 0.5, sim), BAD);
  const float bad_sims[][4] = {{1.0f, NAN, 1.0f, 1.0f},
                               {1.0f, 1.0f, 1.0f, INFINITY},
                               {1.0f, 1.0f, 1.0f, -INFINITY},
                               {1.00001f, 1.0f, 1.0f, 1.0f},
                               {1.0f, 1.0f, -1.00001f, 1.0f}};
  const char *needles[] = {"sim[1]", "sim[3]", "sim[3]", "sim[0]", "sim[2]"};
  for (int i = 0; i < 5; i++) EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, 0.42, bad_sims[i]), needles[i]);
  /* A refused add changes nothing (bin 42 still has one measurement: a second
   * of all-zeros would halve its means). */
  const float zeros[4] = {0, 0, 0, 0};
  cr_assert_eq(depth_at(ctx, p, 0.42), 3);
  EXPECT_BAD(forkattn_reuse_profile_add(ctx, p, 0.42, bad_sims[0]), "sim[1]");
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, 0.43, zeros), FORKATTN_OK);
  cr_assert_eq(depth_at(ctx, p, 0.42), 0, "bin 43 with depth 0 caps bin 42");
  /* Rounding just above 1 is clamped, not refused. */
  const float round_up[4] = {1.0000005f, -1.0000005f, 1.0f, 1.0f};
  cr_assert_eq(forkattn_reuse_profile_add(ctx, p, 1.0, round_up), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(depth_at(ctx, p, 1.0), 1);
  int64_t d = 77;
  EXPECT_BAD(forkattn_reuse_profile_depth(ctx, p, -0.5, &d), "ratio:");
  EXPECT_BAD(forkattn_reuse_profile_depth(ctx, p, NAN, &d), "ratio:");
  EXPECT_BAD(forkattn_reuse_profile_depth(ctx, p, 0.5, NULL), "depth:");
  EXPECT_BAD(forkattn_reuse_profile_depth(ctx, NULL, 0.5, &d), "profile:");
  cr_assert_eq(forkattn_reuse_profile_depth(NULL, p, 0.5, &d), BAD);
  cr_assert_eq(d, 77, "depth written on an error");
  EXPECT_BAD(forkattn_reuse_profile_save(ctx, NULL, "/tmp/x"), "profile:");
  EXPECT_BAD(forkattn_reuse_profile_save(ctx, p, NULL), "path:");
  EXPECT_BAD(forkattn_reuse_profile_save(ctx, p, ""), "path:");
  EXPECT_BAD(forkattn_reuse_profile_save(ctx, p, "/nonexistent-dir-forkattn/p.txt"), "cannot open");
  cr_assert_eq(forkattn_reuse_profile_save(NULL, p, "/tmp/x"), BAD);
  if (access("/dev/full", W_OK) == 0) /* every write fails with ENOSPC */
    EXPECT_BAD(forkattn_reuse_profile_save(ctx, p, "/dev/full"), "no space left");
  forkattn_reuse_profile_free(p);
  forkattn_ctx_destroy(ctx);
}

/* End to end: per-layer K similarity of "prefix alone" vs "prefix in context"
 * tensors feeds the profile. */
Test(profile, from_similarity) {
  forkattn_ctx *ctx = tc_ctx_default("profile/from_similarity");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("profile/from_similarity");
  const int64_t L = 6, rows = 40, heads = 4, d = 32;
  forkattn_reuse_profile *p = new_profile(ctx, L, 0.95f);
  tc_buf ba, bb;
  forkattn_tensor a = make_view(&ba, FORKATTN_DTYPE_BF16, rows, heads, d, DENSE);
  forkattn_tensor b = make_view(&bb, FORKATTN_DTYPE_BF16, rows, heads, d, DENSE);
  for (int i = 0; i < 4; i++) {
    const double r = 0.2 + 0.2 * i;
    float sims[6];
    for (int64_t l = 0; l < L; l++) { /* drift grows with depth, shrinks with r */
      tc_fill_tensor(&rng, &a, -1.0, 1.0);
      fill_related(&rng, &a, &b, 1.0, 0.02 + 0.12 * (double)l * (1.0 - r));
      float per_head[4];
      cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, per_head, &sims[l], FORKATTN_MEMORY_HOST), FORKATTN_OK);
    }
    cr_assert_eq(forkattn_reuse_profile_add(ctx, p, r, sims), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  }
  int64_t prev = -1;
  for (int i = 0; i < 4; i++) {
    const int64_t x = depth_at(ctx, p, 0.2 + 0.2 * i);
    cr_assert(x >= prev && x >= 1 && x <= L, "r = %.1f: depth %lld", 0.2 + 0.2 * i, (long long)x);
    prev = x;
  }
  cr_assert(prev > depth_at(ctx, p, 0.2), "deeper reuse at higher ratios");
  tc_buf_free(&ba);
  tc_buf_free(&bb);
  forkattn_reuse_profile_free(p);
  forkattn_ctx_destroy(ctx);
}

/* ---- allocation failures (FORKATTN_ALLOC_TEST builds) ------------------------ */

/* Exported by FORKATTN_ALLOC_TEST builds of the library only (lib/core/alloc.c). */
extern int64_t forkattn_test_fail_alloc_after(int64_t n) __attribute__((weak));

/* Every allocation of create, load and similarity fails in turn: OUT_OF_MEMORY
 * with a message, *profile NULL, outputs untouched; then the call succeeds with
 * the usual result (leaks: the ASan CI build). */
Test(profile, allocation_failures) {
  if (!forkattn_test_fail_alloc_after) cr_skip_test("needs a FORKATTN_ALLOC_TEST build of the library");
  forkattn_ctx *ctx = tc_ctx_default("profile/allocation_failures");
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for("profile/allocation_failures");
  tmpdir td;
  tmp_open(&td);
  model *m = malloc(sizeof *m);
  cr_assert_not_null(m);
  forkattn_reuse_profile *want;
  for (random_profile(&rng, ctx, &want, m); m->L < 3; random_profile(&rng, ctx, &want, m))
    forkattn_reuse_profile_free(want);
  cr_assert_eq(forkattn_reuse_profile_save(ctx, want, td.path), FORKATTN_OK);
  for (int which = 0; which < 2; which++)
    for (int64_t k = 0;; k++) {
      cr_assert_lt(k, 1000, "call %d never succeeded", which);
      forkattn_reuse_profile *p = (forkattn_reuse_profile *)(void *)&p;
      forkattn_test_fail_alloc_after(k);
      const forkattn_status st = which == 0 ? forkattn_reuse_profile_create(ctx, m->L, 0.9f, &p)
                                            : forkattn_reuse_profile_load(ctx, td.path, &p);
      forkattn_test_fail_alloc_after(-1);
      if (st == FORKATTN_OK) {
        if (which == 1) assert_same_depths(ctx, want, p, &rng);
        forkattn_reuse_profile_free(p);
        break;
      }
      cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "call %d, allocation %lld: %s", which, (long long)k,
                   forkattn_status_string(st));
      cr_assert_null(p, "call %d, allocation %lld: *profile not NULL", which, (long long)k);
      cr_assert_str_not_empty(forkattn_ctx_last_error(ctx));
    }
  tc_buf ba, bb;
  forkattn_tensor a = make_view(&ba, FORKATTN_DTYPE_BF16, 300, 3, 16, DENSE);
  forkattn_tensor b = make_view(&bb, FORKATTN_DTYPE_F32, 300, 3, 16, PADDED);
  tc_fill_tensor(&rng, &a, -1.0, 1.0);
  fill_related(&rng, &a, &b, 1.0, 0.3);
  float ref[3], sim[3], mref, mean;
  cr_assert_eq(forkattn_kv_similarity(ctx, &a, &b, ref, &mref, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  for (int64_t k = 0;; k++) {
    cr_assert_lt(k, 1000, "similarity never succeeded");
    sim[0] = sim[1] = sim[2] = mean = 42.0f;
    forkattn_test_fail_alloc_after(k);
    const forkattn_status st = forkattn_kv_similarity(ctx, &a, &b, sim, &mean, FORKATTN_MEMORY_HOST);
    forkattn_test_fail_alloc_after(-1);
    if (st == FORKATTN_OK) {
      cr_assert(!memcmp(sim, ref, sizeof sim) && mean == mref);
      break;
    }
    cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "allocation %lld: %s", (long long)k, forkattn_status_string(st));
    cr_assert(sim[0] == 42.0f && sim[1] == 42.0f && sim[2] == 42.0f && mean == 42.0f, "outputs written on failure");
    cr_assert_str_not_empty(forkattn_ctx_last_error(ctx));
  }
  tc_buf_free(&ba);
  tc_buf_free(&bb);
  forkattn_reuse_profile_free(want);
  free(m);
  tmp_close(&td);
  forkattn_ctx_destroy(ctx);
}
