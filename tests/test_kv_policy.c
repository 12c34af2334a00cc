/*
 * test_kv_policy.c - forkattn_kv_select (StreamingLLM, H2O, SnapKV) against a
 * float64 brute force written here: the causal softmax of every row is
 * materialised in double, per-key scores are summed as the header defines
 * them, SnapKV pools them, and a stable top-k (score descending, earlier key
 * first) picks the kept keys.
 *
 * Matrix: H2O and SnapKV, L = 1, 7, 100, 333, 1000, budgets below and above
 * L, GQA 4/2 and MHA 2/2, head_dim 16, 64, 33, f32 and bf16, contiguous,
 * row-padded and head-major strides. Plus: StreamingLLM exact sets, L <=
 * budget keeps everything, outputs ascending with min(budget, L) per head,
 * invalid arguments leave the outputs untouched, exact ties go to the earlier
 * key, peaked scores (q x 30),
 * wide SnapKV pooling, thread-count independence, and L = 20000 without an
 * L x L buffer (peak workspace). FORKATTN_TEST_SEED=<n> reproduces a run.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "test_common.h"

#define F32 FORKATTN_DTYPE_F32
#define BF16 FORKATTN_DTYPE_BF16
#define HOST FORKATTN_MEMORY_HOST
#define BAD FORKATTN_ERR_INVALID_ARGUMENT

/* ---- inputs ---------------------------------------------------------------- */

enum { KP_CONTIG = 0, KP_ROWPAD = 1, KP_HEADMAJOR = 2 };

typedef struct kp_inputs {
  void *qbuf, *kbuf;
  forkattn_tensor q, k;
  int64_t L, hq, hkv, d;
} kp_inputs;

static forkattn_tensor kp_tensor(void **buf, forkattn_dtype dt, int64_t L, int64_t h, int64_t d, int layout) {
  int64_t rs = h * d, hs = d, n = L * h * d;
  if (layout == KP_ROWPAD) {
    rs = h * d + 3;
    n = L * rs;
  } else if (layout == KP_HEADMAJOR) {
    rs = d;
    hs = (L > 0 ? L : 1) * d;
  }
  const size_t es = dt == F32 ? 4 : 2;
  *buf = calloc((size_t)(n > 0 ? n : 1), es);
  cr_assert_not_null(*buf);
  forkattn_tensor t = {*buf, dt, L, h, d, rs, hs};
  return t;
}

/* q in [-qmax, qmax], k in [-1, 1], rounded to the dtype. */
static void kp_make(kp_inputs *in, tc_rng *rng, int64_t L, int64_t hq, int64_t hkv, int64_t d, forkattn_dtype dt,
                    int layout, double qmax) {
  in->L = L, in->hq = hq, in->hkv = hkv, in->d = d;
  in->q = kp_tensor(&in->qbuf, dt, L, hq, d, layout);
  in->k = kp_tensor(&in->kbuf, dt, L, hkv, d, layout);
  tc_fill_tensor(rng, &in->q, -qmax, qmax);
  tc_fill_tensor(rng, &in->k, -1.0, 1.0);
}

static void kp_free(kp_inputs *in) {
  free(in->qbuf);
  free(in->kbuf);
}

/* ---- float64 brute force ----------------------------------------------------- */

typedef struct kp_rank {
  double s;
  int64_t j;
} kp_rank;

static int kp_rank_cmp(const void *a, const void *b) {
  const kp_rank *x = a, *y = b;
  if (x->s != y->s) return x->s > y->s ? -1 : 1;
  return (x->j > y->j) - (x->j < y->j);
}

/* Per KV head g, the float64 ranking scores of the candidate keys [0, kend)
 * (pooled for SnapKV): score[g * kend + j]. Returns kend. */
static int64_t kp_ref_scores(const kp_inputs *in, const forkattn_kv_policy *p, double **out) {
  const int64_t L = in->L, hq = in->hq, hkv = in->hkv, d = in->d, group = hq / hkv;
  const int64_t w = p->window, kend = L - w, qlo = p->kind == FORKATTN_KV_SNAPKV ? L - w : 0;
  /* the library's scale is the float 1/sqrtf(d) */
  const double scale = p->scale > 0 ? (double)p->scale : (double)(1.0f / sqrtf((float)d));
  double *q = malloc(sizeof(double) * (size_t)(L * hq * d + 1));
  double *k = malloc(sizeof(double) * (size_t)(L * hkv * d + 1));
  double *raw = calloc((size_t)(hkv * kend + 1), sizeof(double));
  double *s = malloc(sizeof(double) * (size_t)(L + 1));
  cr_assert(q && k && raw && s);
  ref_tensor_read(&in->q, q);
  ref_tensor_read(&in->k, k);
  for (int64_t h = 0; h < hq; h++) {
    const int64_t g = h / group;
    for (int64_t i = qlo; i < L; i++) {
      double m = -INFINITY, l = 0.0;
      for (int64_t j = 0; j <= i; j++) {
        double dot = 0.0;
        for (int64_t c = 0; c < d; c++) dot += q[(i * hq + h) * d + c] * k[(j * hkv + g) * d + c];
        s[j] = scale * dot;
        if (s[j] > m) m = s[j];
      }
      for (int64_t j = 0; j <= i; j++) l += exp(s[j] - m);
      for (int64_t j = 0; j <= i && j < kend; j++) raw[g * kend + j] += exp(s[j] - m) / l;
    }
  }
  if (p->kind == FORKATTN_KV_SNAPKV) {
    double *pooled = calloc((size_t)(hkv * kend + 1), sizeof(double));
    cr_assert_not_null(pooled);
    const int64_t r = p->pool_kernel / 2;
    for (int64_t g = 0; g < hkv; g++)
      for (int64_t j = 0; j < kend; j++)
        for (int64_t x = j - r; x <= j + r; x++)
          if (x >= 0 && x < kend) pooled[g * kend + j] += raw[g * kend + x];
    free(raw);
    raw = pooled;
  }
  free(q), free(k), free(s);
  *out = raw;
  return kend;
}

/* Kept keys of head g (ascending) from float64 scores: top budget - window of
 * [0, kend), then the window [kend, L). Returns the boundary score (the
 * lowest kept candidate's, +inf when none is kept). */
static double kp_ref_select(const double *score, int64_t kend, int64_t L, const forkattn_kv_policy *p,
                            int64_t *out) {
  const int64_t keep = p->budget - p->window;
  kp_rank *r = malloc(sizeof(kp_rank) * (size_t)(kend + 1));
  cr_assert_not_null(r);
  for (int64_t j = 0; j < kend; j++) r[j] = (kp_rank){score[j], j};
  qsort(r, (size_t)kend, sizeof *r, kp_rank_cmp);
  unsigned char *mark = calloc((size_t)L + 1, 1);
  cr_assert_not_null(mark);
  for (int64_t t = 0; t < keep; t++) mark[r[t].j] = 1;
  for (int64_t j = kend; j < L; j++) mark[j] = 1;
  int64_t n = 0;
  for (int64_t j = 0; j < L; j++)
    if (mark[j]) out[n++] = j;
  const double boundary = keep > 0 ? r[keep - 1].s : INFINITY;
  free(r), free(mark);
  return boundary;
}

/* ---- checks ------------------------------------------------------------------ */

/* offsets[g] = g * min(budget, L) and each head's keys strictly ascending in [0, L). */
static void kp_check_shape(const char *name, const int64_t *off, const int64_t *idx, int64_t hkv, int64_t L,
                           int64_t budget) {
  const int64_t n = budget < L ? budget : L;
  for (int64_t g = 0; g <= hkv; g++)
    cr_assert_eq(off[g], g * n, "%s: offsets[%lld] = %lld, want %lld", name, (long long)g, (long long)off[g],
                 (long long)(g * n));
  for (int64_t g = 0; g < hkv; g++)
    for (int64_t t = 0; t < n; t++) {
      const int64_t x = idx[g * n + t];
      cr_assert(x >= 0 && x < L, "%s: head %lld key %lld out of range", name, (long long)g, (long long)x);
      if (t) cr_assert_gt(x, idx[g * n + t - 1], "%s: head %lld not ascending at %lld", name, (long long)g, (long long)t);
    }
}

/* Robust set comparison. float32 scores (the library) and float64 scores (the
 * brute force) may order two keys differently when their scores differ by
 * less than the float32 rounding of the sums (about 1e-6 relative), so a
 * key may swap in or out at the selection boundary. Sets therefore match if
 * they are equal, or if every candidate key present in one and not the other
 * has a float64 score within rel_tol (relative) + abs_tol of the boundary
 * score (the lowest score the float64 selection keeps): those keys are
 * genuinely tied at float32 precision. Window keys (>= kend) carry no score
 * and must always match. Returns 1 for an exact match, 0 for a tolerated one;
 * fails the test otherwise. */
static int kp_compare(const char *name, const int64_t *got, const int64_t *want, int64_t n, int64_t L,
                      int64_t kend, const double *score, double boundary, double rel_tol, double abs_tol) {
  unsigned char *in_got = calloc((size_t)L + 1, 1), *in_want = calloc((size_t)L + 1, 1);
  cr_assert(in_got && in_want);
  for (int64_t t = 0; t < n; t++) in_got[got[t]] = 1, in_want[want[t]] = 1;
  int exact = 1;
  for (int64_t j = 0; j < L; j++) {
    if (in_got[j] == in_want[j]) continue;
    exact = 0;
    cr_assert_lt(j, kend, "%s: window key %lld %s", name, (long long)j, in_got[j] ? "kept but not expected" : "missing");
    const double gap = fabs(score[j] - boundary), tol = rel_tol * fabs(boundary) + abs_tol;
    cr_assert_leq(gap, tol,
                  "%s: key %lld %s with float64 score %.9g, boundary %.9g (gap %.3g > tolerance %.3g)", name,
                  (long long)j, in_got[j] ? "kept but not expected" : "missing", score[j], boundary, gap, tol);
  }
  free(in_got), free(in_want);
  return exact;
}

typedef struct kp_tally {
  int64_t cases, exact;
} kp_tally;

/* Run one policy on one input and compare with the brute force. */
static void kp_run_case(forkattn_ctx *ctx, const char *name, const kp_inputs *in, const forkattn_kv_policy *p,
                        double rel_tol, double abs_tol, kp_tally *tally) {
  const int64_t L = in->L, hkv = in->hkv, n = p->budget < L ? p->budget : L;
  int64_t *off = malloc(sizeof(int64_t) * (size_t)(hkv + 1)), *idx = malloc(sizeof(int64_t) * (size_t)(hkv * n + 1));
  int64_t *want = malloc(sizeof(int64_t) * (size_t)(n + 1));
  cr_assert(off && idx && want);
  forkattn_status st = forkattn_kv_select(ctx, p, &in->q, &in->k, off, idx, HOST);
  cr_assert_eq(st, FORKATTN_OK, "%s: %s", name, forkattn_ctx_last_error(ctx));
  kp_check_shape(name, off, idx, hkv, L, p->budget);
  int exact = 1;
  if (L <= p->budget) {
    for (int64_t g = 0; g < hkv; g++)
      for (int64_t t = 0; t < L; t++) cr_assert_eq(idx[g * n + t], t, "%s: L <= budget must keep every key", name);
  } else {
    double *score;
    const int64_t kend = kp_ref_scores(in, p, &score);
    for (int64_t g = 0; g < hkv; g++) {
      const double b = kp_ref_select(score + g * kend, kend, L, p, want);
      char hn[256];
      snprintf(hn, sizeof hn, "%s head %lld", name, (long long)g);
      exact &= kp_compare(hn, idx + g * n, want, n, L, kend, score + g * kend, b, rel_tol, abs_tol);
    }
    free(score);
  }
  if (tally && L > p->budget) tally->cases++, tally->exact += exact; /* ranked cases only */
  free(off), free(idx), free(want);
}

static forkattn_ctx *kp_ctx_threads(const char *name, int threads) {
  forkattn_ctx_options o;
  forkattn_ctx_options_init(&o);
  o.backend = FORKATTN_BACKEND_CPU;
  o.threads = threads;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &o), FORKATTN_OK);
  tc_print_where(ctx, name);
  return ctx;
}

/* ---- the matrix ------------------------------------------------------------------ */

Test(kv_policy, h2o_and_snapkv_match_float64_brute_force, .timeout = 280) {
  tc_rng rng = tc_rng_for("kv_policy/matrix");
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/matrix");
  cr_assert_not_null(ctx);
  const int64_t Ls[] = {1, 7, 100, 333, 1000};
  const int64_t heads[][2] = {{4, 2}, {2, 2}};
  const int64_t dims[] = {16, 64, 33};
  const forkattn_dtype dts[] = {F32, BF16};
  const forkattn_kv_policy_kind kinds[] = {FORKATTN_KV_H2O, FORKATTN_KV_SNAPKV};
  kp_tally tally = {0, 0};
  int64_t case_no = 0;
  for (int li = 0; li < 5; li++)
    for (int hi = 0; hi < 2; hi++)
      for (int di = 0; di < 3; di++)
        for (int ti = 0; ti < 2; ti++) {
          const int64_t L = Ls[li], d = dims[di];
          const int layout = (int)(case_no++ % 3);
          kp_inputs in;
          kp_make(&in, &rng, L, heads[hi][0], heads[hi][1], d, dts[ti], layout, 1.0);
          const int64_t budgets[3] = {L / 3 + 1, L / 10 + 2, L + 3};
          for (int ki = 0; ki < 2; ki++)
            for (int bi = 0; bi < 3; bi++) {
              forkattn_kv_policy p;
              forkattn_kv_policy_init(&p, kinds[ki], budgets[bi]);
              /* vary window, pooling and scale around the defaults */
              const int64_t v = tc_randint(&rng, 0, 3);
              if (v == 1) p.window = p.budget / 4;
              if (v == 2) p.window = tc_randint(&rng, 0, p.budget);
              if (kinds[ki] == FORKATTN_KV_SNAPKV) p.pool_kernel = 2 * tc_randint(&rng, 0, 4) + 1;
              if (tc_randint(&rng, 0, 3) == 0) p.scale = 0.3f;
              char name[256];
              snprintf(name, sizeof name, "%s L=%lld budget=%lld window=%lld pool=%lld scale=%g heads %lld/%lld d=%lld %s layout %d",
                       kinds[ki] == FORKATTN_KV_H2O ? "h2o" : "snapkv", (long long)L, (long long)p.budget,
                       (long long)p.window, (long long)p.pool_kernel, (double)p.scale, (long long)in.hq,
                       (long long)in.hkv, (long long)d, ref_dtype_name(dts[ti]), layout);
              kp_run_case(ctx, name, &in, &p, 1e-4, 0.0, &tally);
            }
          kp_free(&in);
        }
  fprintf(stderr, "[kv_policy] %lld of %lld cases matched the float64 selection exactly\n", (long long)tally.exact,
          (long long)tally.cases);
  cr_assert_geq(tally.exact * 10, tally.cases * 9, "only %lld of %lld cases matched exactly", (long long)tally.exact,
                (long long)tally.cases);
  forkattn_ctx_destroy(ctx);
}

/* Wide SnapKV pooling (the prefix-sum path, kernels wider than the sequence)
 * and budgets that keep only the window or only heavy hitters. */
Test(kv_policy, snapkv_wide_pooling_and_edge_windows, .timeout = 120) {
  tc_rng rng = tc_rng_for("kv_policy/snapkv_edges");
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/snapkv_edges");
  kp_inputs in;
  kp_make(&in, &rng, 500, 4, 2, 32, F32, KP_CONTIG, 1.0);
  const int64_t cfg[][3] = {/* budget, window, pool_kernel */
                            {50, 8, 67},  {50, 8, 1001}, {50, 8, 2001}, {50, 50, 5},
                            {50, 0, 5},   {40, 1, 3},    {499, 16, 5},  {1, 1, 1}, {1, 0, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    forkattn_kv_policy p;
    forkattn_kv_policy_init(&p, FORKATTN_KV_SNAPKV, cfg[c][0]);
    p.window = cfg[c][1];
    p.pool_kernel = cfg[c][2];
    char name[128];
    snprintf(name, sizeof name, "snapkv budget=%lld window=%lld pool=%lld", (long long)cfg[c][0], (long long)cfg[c][1],
             (long long)cfg[c][2]);
    kp_run_case(ctx, name, &in, &p, 1e-4, 0.0, NULL);
  }
  forkattn_kv_policy h;
  forkattn_kv_policy_init(&h, FORKATTN_KV_H2O, 64);
  const int64_t windows[] = {0, 1, 64};
  for (int i = 0; i < 3; i++) {
    h.window = windows[i];
    char name[128];
    snprintf(name, sizeof name, "h2o budget=64 window=%lld", (long long)windows[i]);
    kp_run_case(ctx, name, &in, &h, 1e-4, 0.0, NULL);
  }
  kp_free(&in);
  forkattn_ctx_destroy(ctx);
}

/* Scores of q x 30: rows put nearly all their mass on a few keys. The online
 * softmax must stay finite, and the selection must still match. Far-below-
 * boundary keys have probabilities that float32 flushes to 0 (exp below
 * -87) while float64 keeps them distinct, so keys whose float64 scores are
 * all below 1e-30 count as tied; the relative tolerance is 1e-3 because
 * peaked scores are large (|s| ~ 10-100) and their float32 rounding moves
 * exp(s - lse) by |s| * 2^-24 * sqrt(d) relative. */
Test(kv_policy, peaked_scores_stay_finite_and_correct, .timeout = 120) {
  tc_rng rng = tc_rng_for("kv_policy/peaked");
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/peaked");
  const forkattn_dtype dts[] = {F32, BF16};
  for (int ti = 0; ti < 2; ti++) {
    kp_inputs in;
    kp_make(&in, &rng, 400, 4, 2, 64, dts[ti], KP_CONTIG, 30.0);
    const forkattn_kv_policy_kind kinds[] = {FORKATTN_KV_H2O, FORKATTN_KV_SNAPKV};
    for (int ki = 0; ki < 2; ki++) {
      forkattn_kv_policy p;
      forkattn_kv_policy_init(&p, kinds[ki], 64);
      char name[128];
      snprintf(name, sizeof name, "peaked %s %s", ki ? "snapkv" : "h2o", ref_dtype_name(dts[ti]));
      kp_run_case(ctx, name, &in, &p, 1e-3, 1e-30, NULL);
    }
    kp_free(&in);
  }
  forkattn_ctx_destroy(ctx);
}

/* Exact ties: with q = 0 every row's softmax is uniform, so every SnapKV key
 * before the window receives bitwise the same mass (the robust comparison
 * would tolerate any tie order, hence explicit sets): the earlier keys win.
 * Pooling over 5 gives the 2 keys at each end fewer terms (lower scores). */
Test(kv_policy, ties_go_to_the_earlier_key) {
  tc_rng rng = tc_rng_for("kv_policy/ties");
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/ties");
  kp_inputs in;
  kp_make(&in, &rng, 300, 4, 2, 16, BF16, KP_CONTIG, 0.0);
  const int64_t budget = 40, w = 8, first[2] = {0, 2};
  for (int c = 0; c < 2; c++) {
    forkattn_kv_policy p;
    forkattn_kv_policy_init(&p, FORKATTN_KV_SNAPKV, budget);
    p.window = w;
    p.pool_kernel = c ? 5 : 1;
    int64_t off[3], idx[2 * 40];
    cr_assert_eq(forkattn_kv_select(ctx, &p, &in.q, &in.k, off, idx, HOST), FORKATTN_OK);
    for (int64_t g = 0; g < 2; g++)
      for (int64_t t = 0; t < budget; t++) {
        const int64_t want = t < budget - w ? first[c] + t : 300 - w + (t - (budget - w));
        cr_assert_eq(idx[g * budget + t], want, "pool %lld head %lld slot %lld: %lld, want %lld",
                     (long long)p.pool_kernel, (long long)g, (long long)t, (long long)idx[g * budget + t],
                     (long long)want);
      }
  }
  kp_free(&in);
  forkattn_ctx_destroy(ctx);
}

/* ---- StreamingLLM and keep-all ------------------------------------------------------ */

Test(kv_policy, streaming_llm_exact_sets) {
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/streaming");
  tc_rng rng = tc_rng_for("kv_policy/streaming");
  const int64_t cfg[][3] = {/* L, budget, sinks */
                            {100, 10, 4}, {100, 10, 0}, {100, 10, 10}, {11, 10, 4}, {10, 10, 4},
                            {5, 10, 4},   {1, 1, 1},    {1000, 1, 0},  {1000, 1, 1}, {0, 3, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    const int64_t L = cfg[c][0], budget = cfg[c][1], sinks = cfg[c][2], hkv = 3, n = budget < L ? budget : L;
    kp_inputs in;
    kp_make(&in, &rng, L, 6, hkv, 8, BF16, KP_ROWPAD, 1.0);
    forkattn_kv_policy p;
    forkattn_kv_policy_init(&p, FORKATTN_KV_STREAMING_LLM, budget);
    p.sinks = sinks;
    int64_t off[4], idx[3 * 1000];
    cr_assert_eq(forkattn_kv_select(ctx, &p, &in.q, &in.k, off, idx, HOST), FORKATTN_OK, "%s",
                 forkattn_ctx_last_error(ctx));
    char name[96];
    snprintf(name, sizeof name, "streaming L=%lld budget=%lld sinks=%lld", (long long)L, (long long)budget,
             (long long)sinks);
    kp_check_shape(name, off, idx, hkv, L, budget);
    for (int64_t g = 0; g < hkv; g++)
      for (int64_t t = 0; t < n; t++) {
        const int64_t want = L <= budget ? t : (t < sinks ? t : L - (budget - sinks) + (t - sinks));
        cr_assert_eq(idx[g * n + t], want, "%s: head %lld slot %lld is %lld, want %lld", name, (long long)g,
                     (long long)t, (long long)idx[g * n + t], (long long)want);
      }
    kp_free(&in);
  }
  forkattn_ctx_destroy(ctx);
}

Test(kv_policy, short_sequences_keep_everything) {
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/keep_all");
  tc_rng rng = tc_rng_for("kv_policy/keep_all");
  const forkattn_kv_policy_kind kinds[] = {FORKATTN_KV_STREAMING_LLM, FORKATTN_KV_H2O, FORKATTN_KV_SNAPKV};
  const int64_t Ls[] = {0, 1, 17, 64};
  for (int ki = 0; ki < 3; ki++)
    for (int li = 0; li < 4; li++) {
      kp_inputs in;
      kp_make(&in, &rng, Ls[li], 4, 1, 16, F32, KP_HEADMAJOR, 1.0);
      forkattn_kv_policy p;
      forkattn_kv_policy_init(&p, kinds[ki], 64);
      kp_run_case(ctx, "keep_all", &in, &p, 0, 0, NULL);
      kp_free(&in);
    }
  forkattn_ctx_destroy(ctx);
}

Test(kv_policy, policy_init_defaults) {
  forkattn_kv_policy p;
  forkattn_kv_policy_init(&p, FORKATTN_KV_H2O, 100);
  cr_expect(p.kind == FORKATTN_KV_H2O && p.budget == 100 && p.sinks == 4 && p.window == 50 && p.pool_kernel == 5 &&
            p.scale == 0.0f);
  forkattn_kv_policy_init(&p, FORKATTN_KV_SNAPKV, 100);
  cr_expect(p.window == 32 && p.pool_kernel == 5 && p.sinks == 4);
  forkattn_kv_policy_init(&p, FORKATTN_KV_SNAPKV, 3);
  cr_expect(p.window == 3 && p.pool_kernel == 3 && p.sinks == 3, "clamped to the budget (pool_kernel stays odd)");
  forkattn_kv_policy_init(&p, FORKATTN_KV_STREAMING_LLM, 2);
  cr_expect(p.sinks == 2 && p.pool_kernel == 1);
  forkattn_kv_policy_init(&p, FORKATTN_KV_H2O, 1);
  cr_expect(p.window == 0 && p.sinks == 1);
  forkattn_kv_policy_init(NULL, FORKATTN_KV_H2O, 1); /* no-op */
}

/* ---- invalid arguments --------------------------------------------------------------- */

Test(kv_policy, invalid_arguments_leave_outputs_untouched) {
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/errors");
  tc_rng rng = tc_rng_for("kv_policy/errors");
  kp_inputs in, in3;
  kp_make(&in, &rng, 50, 4, 2, 16, F32, KP_CONTIG, 1.0);
  kp_make(&in3, &rng, 50, 3, 3, 16, BF16, KP_CONTIG, 1.0);
  int64_t off[3], idx[2 * 50];
  const int64_t sentinel = 0x5A5A5A5A5A5A5A5Bll;
  forkattn_kv_policy h2o, snap, stream;
  forkattn_kv_policy_init(&h2o, FORKATTN_KV_H2O, 10);
  forkattn_kv_policy_init(&snap, FORKATTN_KV_SNAPKV, 10);
  forkattn_kv_policy_init(&stream, FORKATTN_KV_STREAMING_LLM, 10);

#define KP_EXPECT_BAD(what, pol, qq, kk, o, ix, mem)                                                            \
  do {                                                                                                        \
    for (int i_ = 0; i_ < 3; i_++) off[i_] = sentinel;                                                        \
    for (int i_ = 0; i_ < 100; i_++) idx[i_] = sentinel;                                                      \
    forkattn_status st_ = forkattn_kv_select(ctx, pol, qq, kk, o, ix, mem);                                    \
    cr_expect_eq(st_, BAD, "%s: status %d, want INVALID_ARGUMENT", what, (int)st_);                            \
    cr_expect(strlen(forkattn_ctx_last_error(ctx)) > 0, "%s: no message", what);                              \
    fprintf(stderr, "[error] %s -> %s\n", what, forkattn_ctx_last_error(ctx));                                \
    int same_ = 1;                                                                                            \
    for (int i_ = 0; i_ < 3; i_++) same_ &= off[i_] == sentinel;                                              \
    for (int i_ = 0; i_ < 100; i_++) same_ &= idx[i_] == sentinel;                                            \
    cr_expect(same_, "%s: outputs were written", what);                                                       \
  } while (0)

  forkattn_kv_policy p;
  cr_expect_eq(forkattn_kv_select(NULL, &h2o, &in.q, &in.k, off, idx, HOST), BAD);
  KP_EXPECT_BAD("policy NULL", NULL, &in.q, &in.k, off, idx, HOST);
  p = h2o, p.kind = (forkattn_kv_policy_kind)7;
  KP_EXPECT_BAD("unknown kind", &p, &in.q, &in.k, off, idx, HOST);
  p = h2o, p.budget = 0;
  KP_EXPECT_BAD("budget 0", &p, &in.q, &in.k, off, idx, HOST);
  p = stream, p.budget = -5;
  KP_EXPECT_BAD("budget -5", &p, &in.q, &in.k, off, idx, HOST);
  p = stream, p.sinks = -1;
  KP_EXPECT_BAD("sinks -1", &p, &in.q, &in.k, off, idx, HOST);
  p = stream, p.sinks = 11;
  KP_EXPECT_BAD("sinks > budget", &p, &in.q, &in.k, off, idx, HOST);
  p = h2o, p.window = -1;
  KP_EXPECT_BAD("h2o window -1", &p, &in.q, &in.k, off, idx, HOST);
  p = h2o, p.window = 11;
  KP_EXPECT_BAD("h2o window > budget", &p, &in.q, &in.k, off, idx, HOST);
  p = snap, p.window = 11;
  KP_EXPECT_BAD("snapkv window > budget", &p, &in.q, &in.k, off, idx, HOST);
  p = snap, p.pool_kernel = 0;
  KP_EXPECT_BAD("pool_kernel 0", &p, &in.q, &in.k, off, idx, HOST);
  p = snap, p.pool_kernel = 4;
  KP_EXPECT_BAD("pool_kernel even", &p, &in.q, &in.k, off, idx, HOST);
  p = snap, p.pool_kernel = -3;
  KP_EXPECT_BAD("pool_kernel negative", &p, &in.q, &in.k, off, idx, HOST);
  p = h2o, p.scale = -0.5f;
  KP_EXPECT_BAD("scale negative", &p, &in.q, &in.k, off, idx, HOST);
  p = snap, p.scale = NAN;
  KP_EXPECT_BAD("scale NaN", &p, &in.q, &in.k, off, idx, HOST);
  p = h2o, p.scale = INFINITY;
  KP_EXPECT_BAD("scale inf", &p, &in.q, &in.k, off, idx, HOST);
  KP_EXPECT_BAD("memory unknown", &h2o, &in.q, &in.k, off, idx, (forkattn_memory)9);
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU)
    KP_EXPECT_BAD("device memory on a cpu context", &h2o, &in.q, &in.k, off, idx, FORKATTN_MEMORY_DEVICE);
  KP_EXPECT_BAD("q NULL", &h2o, NULL, &in.k, off, idx, HOST);
  KP_EXPECT_BAD("k NULL", &h2o, &in.q, NULL, off, idx, HOST);
  KP_EXPECT_BAD("q NULL (streaming)", &stream, NULL, &in.k, off, idx, HOST);
  KP_EXPECT_BAD("offsets NULL", &h2o, &in.q, &in.k, NULL, idx, HOST);
  KP_EXPECT_BAD("index NULL", &h2o, &in.q, &in.k, off, NULL, HOST);
  KP_EXPECT_BAD("Hq % Hkv", &h2o, &in.q, &in3.q, off, idx, HOST); /* 4 query heads, 3 KV heads */
  forkattn_tensor t = in.k;
  t.dtype = BF16;
  KP_EXPECT_BAD("k dtype differs", &h2o, &in.q, &t, off, idx, HOST);
  t = in.k, t.rows = 49;
  KP_EXPECT_BAD("k rows differ", &h2o, &in.q, &t, off, idx, HOST);
  t = in.k, t.head_dim = 8;
  KP_EXPECT_BAD("k head_dim differs", &h2o, &in.q, &t, off, idx, HOST);
  t = in.q, t.head_dim = 0;
  KP_EXPECT_BAD("q head_dim 0", &h2o, &t, &in.k, off, idx, HOST);
  t = in.q, t.head_dim = 257;
  KP_EXPECT_BAD("q head_dim 257", &h2o, &t, &in.k, off, idx, HOST);
  t = in.q, t.data = NULL;
  KP_EXPECT_BAD("q data NULL", &h2o, &t, &in.k, off, idx, HOST);
  t = in.k, t.row_stride = -1;
  KP_EXPECT_BAD("k negative stride", &h2o, &in.q, &t, off, idx, HOST);
  t = in.q, t.rows = -1;
  KP_EXPECT_BAD("q rows -1", &h2o, &t, &in.k, off, idx, HOST);
  t = in.q, t.dtype = (forkattn_dtype)17;
  KP_EXPECT_BAD("q unknown dtype", &h2o, &t, &in.k, off, idx, HOST);
  kp_free(&in);
  kp_free(&in3);
  forkattn_ctx_destroy(ctx);
}

/* ---- determinism, memory ------------------------------------------------------------- */

/* Scores are summed per key in a fixed order: 1, 2 and 3 threads give the same sets. */
Test(kv_policy, same_result_for_any_thread_count, .timeout = 120) {
  tc_rng rng = tc_rng_for("kv_policy/threads");
  kp_inputs in;
  kp_make(&in, &rng, 777, 8, 2, 64, BF16, KP_ROWPAD, 1.0);
  const forkattn_kv_policy_kind kinds[] = {FORKATTN_KV_H2O, FORKATTN_KV_SNAPKV};
  for (int ki = 0; ki < 2; ki++) {
    forkattn_kv_policy p;
    forkattn_kv_policy_init(&p, kinds[ki], 100);
    int64_t off[3][3], idx[3][200];
    for (int t = 0; t < 3; t++) {
      forkattn_ctx *ctx = kp_ctx_threads("kv_policy/threads", t + 1);
      cr_assert_eq(forkattn_kv_select(ctx, &p, &in.q, &in.k, off[t], idx[t], HOST), FORKATTN_OK);
      forkattn_ctx_destroy(ctx);
    }
    cr_expect(memcmp(idx[0], idx[1], sizeof idx[0]) == 0 && memcmp(idx[0], idx[2], sizeof idx[0]) == 0,
              "kind %d: the kept sets depend on the thread count", (int)kinds[ki]);
  }
  kp_free(&in);
}

/* L = 20000: an L x L float buffer would be 1.6 GB; the recorded scratch
 * (per-row lse, per-key scores, per-thread tiles) must stay far below it.
 * SnapKV at this length is also checked against the brute force (its
 * window rows make that cheap). */
Test(kv_policy, long_sequence_streams_without_an_LxL_buffer, .timeout = 200) {
  tc_rng rng = tc_rng_for("kv_policy/long");
  forkattn_ctx *ctx = tc_ctx_default("kv_policy/long");
  const int64_t L = 20000;
  kp_inputs in;
  kp_make(&in, &rng, L, 1, 1, 32, F32, KP_CONTIG, 1.0);
  forkattn_kv_policy p;
  forkattn_kv_policy_init(&p, FORKATTN_KV_H2O, 256);
  int64_t off[2], *idx = malloc(sizeof(int64_t) * 256);
  cr_assert_not_null(idx);
  const double t0 = tc_now();
  cr_assert_eq(forkattn_kv_select(ctx, &p, &in.q, &in.k, off, idx, HOST), FORKATTN_OK, "%s",
               forkattn_ctx_last_error(ctx));
  const double secs = tc_now() - t0;
  const size_t peak = forkattn_ctx_peak_workspace(ctx), lxl = (size_t)L * (size_t)L * 4;
  fprintf(stderr, "[kv_policy] H2O L=%lld: %.2f s, peak workspace %zu bytes (L x L floats: %zu)\n", (long long)L,
          secs, peak, lxl);
  cr_expect_gt(peak, 0, "the call records its workspace");
  cr_expect_lt(peak, lxl / 10, "peak workspace %zu bytes is not far below an L x L buffer", peak);
  kp_check_shape("h2o long", off, idx, 1, L, 256);
  for (int64_t t = 0; t < 128; t++) cr_assert_eq(idx[128 + t], L - 128 + t, "the recent window is kept");
  free(idx);
  forkattn_kv_policy_init(&p, FORKATTN_KV_SNAPKV, 256);
  kp_tally tally = {0, 0};
  kp_run_case(ctx, "snapkv long", &in, &p, 1e-4, 0.0, &tally);
  kp_free(&in);
  forkattn_ctx_destroy(ctx);
}

/* Device tensors are staged to the host: same sets as host tensors. [GPU only] */
Test(kv_policy, device_tensors_match_host) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip("kv_policy/device");
  tc_rng rng = tc_rng_for("kv_policy/device");
  kp_inputs in;
  kp_make(&in, &rng, 300, 4, 2, 64, BF16, KP_ROWPAD, 1.0);
  const size_t qb = (size_t)(300 * in.q.row_stride) * 2, kb = (size_t)(300 * in.k.row_stride) * 2;
  void *qd, *kd;
  cr_assert_eq(forkattn_device_malloc(ctx, qb, &qd), FORKATTN_OK);
  cr_assert_eq(forkattn_device_malloc(ctx, kb, &kd), FORKATTN_OK);
  cr_assert_eq(forkattn_memcpy(ctx, qd, FORKATTN_MEMORY_DEVICE, in.qbuf, HOST, qb), FORKATTN_OK);
  cr_assert_eq(forkattn_memcpy(ctx, kd, FORKATTN_MEMORY_DEVICE, in.kbuf, HOST, kb), FORKATTN_OK);
  forkattn_tensor tq = in.q, tk = in.k;
  tq.data = qd, tk.data = kd;
  const forkattn_kv_policy_kind kinds[] = {FORKATTN_KV_H2O, FORKATTN_KV_SNAPKV, FORKATTN_KV_STREAMING_LLM};
  for (int ki = 0; ki < 3; ki++) {
    forkattn_kv_policy p;
    forkattn_kv_policy_init(&p, kinds[ki], 50);
    int64_t oh[3], od[3], ih[100], id[100];
    cr_assert_eq(forkattn_kv_select(ctx, &p, &in.q, &in.k, oh, ih, HOST), FORKATTN_OK);
    cr_assert_eq(forkattn_kv_select(ctx, &p, &tq, &tk, od, id, FORKATTN_MEMORY_DEVICE), FORKATTN_OK, "%s",
                 forkattn_ctx_last_error(ctx));
    cr_expect(memcmp(oh, od, sizeof oh) == 0 && memcmp(ih, id, sizeof ih) == 0, "kind %d: device != host",
              (int)kinds[ki]);
  }
  forkattn_device_free(ctx, qd);
  forkattn_device_free(ctx, kd);
  kp_free(&in);
  forkattn_ctx_destroy(ctx);
}
