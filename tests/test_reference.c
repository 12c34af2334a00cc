/*
 * test_reference.c - validates the float64 reference (and the test helpers)
 * without calling the library: 16-bit conversions, visible sets, a
 * hand-computed case, an independent packed-mask forward, gradients against
 * central finite differences, and the prompt's independence of the responses.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "test_common.h"

/* ---- 16-bit conversions --------------------------------------------------- */

Test(conversions, bf16_round_trip_all_patterns) {
  for (uint32_t b = 0; b < 65536; b++) {
    float f = ref_bf16_to_float((uint16_t)b);
    cr_assert_eq(ref_float_bits(f) >> 16, b, "bf16 0x%04x does not decode to its upper half", b);
    if (isnan(f))
      cr_assert(isnan(ref_bf16_to_float(ref_float_to_bf16(f))));
    else
      cr_assert_eq(ref_float_to_bf16(f), b, "bf16 0x%04x does not round-trip", b);
  }
}

Test(conversions, f16_round_trip_all_patterns) {
  for (uint32_t b = 0; b < 65536; b++) {
    float f = ref_f16_to_float((uint16_t)b);
    if (isnan(f))
      cr_assert(isnan(ref_f16_to_float(ref_float_to_f16(f))), "f16 NaN 0x%04x lost", b);
    else
      cr_assert_eq(ref_float_to_f16(f), b, "f16 0x%04x -> %a does not round-trip", b,
                   (double)f);
  }
  cr_assert_eq(ref_f16_to_float(0x3C00), 1.0f);
  cr_assert_eq(ref_f16_to_float(0x7BFF), 65504.0f);
  cr_assert_eq(ref_f16_to_float(0x0001), 0x1p-24f);
  cr_assert_eq(ref_f16_to_float(0x0400), 0x1p-14f);
  cr_assert_eq(ref_f16_to_float(0xC000), -2.0f);
}

Test(conversions, ties_to_even) {
  /* bf16 keeps 7 mantissa bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7. */
  cr_assert_eq(ref_float_to_bf16(1.0f + 0x1p-8f), 0x3F80);
  cr_assert_eq(ref_float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);
  cr_assert_eq(ref_float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  cr_assert_eq(ref_float_to_bf16(-(1.0f + 0x1p-8f)), 0xBF80);
  cr_assert_eq(ref_float_to_bf16(INFINITY), 0x7F80);
  cr_assert_eq(ref_float_to_bf16(3.4028235e38f), 0x7F80); /* max float rounds up to inf */
  /* f16 keeps 10 mantissa bits. */
  cr_assert_eq(ref_float_to_f16(1.0f + 0x1p-11f), 0x3C00);
  cr_assert_eq(ref_float_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);
  cr_assert_eq(ref_float_to_f16(65504.0f), 0x7BFF);
  cr_assert_eq(ref_float_to_f16(65519.996f), 0x7BFF);
  cr_assert_eq(ref_float_to_f16(65520.0f), 0x7C00);
  cr_assert_eq(ref_float_to_f16(-1e9f), 0xFC00);
  cr_assert_eq(ref_float_to_f16(0x1p-24f), 0x0001);
  cr_assert_eq(ref_float_to_f16(0x1p-25f), 0x0000);            /* tie -> even (0) */
  cr_assert_eq(ref_float_to_f16(0x1p-25f * 1.0000001f), 0x0001); /* just above the tie */
  cr_assert_eq(ref_float_to_f16(3 * 0x1p-25f), 0x0002);         /* tie -> even (2) */
  cr_assert_eq(ref_float_to_f16(0x1p-14f - 0x1p-26f), 0x0400);  /* rounds up to normal */
  cr_assert_eq(ref_float_to_f16(-0.0f), 0x8000);
}

/* For random floats, the conversion result must be one of the two
 * neighbouring representable values, the nearer one, and the even one on a tie. */
static void check_nearest(float f, uint16_t got, float (*dec)(uint16_t), const char *what) {
  double x = (double)f, g = (double)dec(got);
  if (!isfinite(g))
    return; /* overflow cases are covered by ties_to_even */
  double err = fabs(g - x);
  const uint16_t neigh[2] = {(uint16_t)(got - 1), (uint16_t)(got + 1)};
  for (int i = 0; i < 2; i++) {
    if ((neigh[i] & 0x7FFF) == 0x7FFF || ((got ^ neigh[i]) & 0x8000))
      continue; /* wrapped or crossed the sign */
    double n = (double)dec(neigh[i]);
    if (!isfinite(n))
      continue;
    double en = fabs(n - x);
    cr_assert(err < en || (err == en && (got & 1) == 0),
              "%s(%a) = 0x%04x (%a) but 0x%04x (%a) is nearer or the even tie", what, x,
              got, g, neigh[i], n);
  }
}

Test(conversions, nearest_on_random_floats) {
  tc_rng rng = tc_rng_for("conversions/nearest_on_random_floats");
  for (int i = 0; i < 200000; i++) {
    /* Exponents spanning f16 subnormals to bf16's range. */
    uint32_t u = (uint32_t)tc_next(&rng);
    uint32_t e = (uint32_t)tc_randint(&rng, 127 - 30, 127 + 20);
    float f = ref_bits_float((u & 0x807FFFFFu) | (e << 23));
    check_nearest(f, ref_float_to_f16(f), ref_f16_to_float, "f16");
    check_nearest(f, ref_float_to_bf16(f), ref_bf16_to_float, "bf16");
#if defined(__FLT16_MANT_DIG__) && (defined(__x86_64__) || defined(__aarch64__))
    _Float16 h = (_Float16)f;
    uint16_t hb;
    memcpy(&hb, &h, sizeof hb);
    cr_assert_eq(ref_float_to_f16(f), hb, "f16(%a): ours 0x%04x, compiler 0x%04x", (double)f,
                 ref_float_to_f16(f), hb);
#endif
  }
}

/* ---- tensors and helpers -------------------------------------------------- */

Test(helpers, strided_read_write_and_guards) {
  /* q, k, v interleaved in one bf16 buffer: row = [q heads | k heads | v heads]. */
  const int64_t T = 5, hq = 4, hkv = 2, d = 3, w = (hq + 2 * hkv) * d;
  tc_buf b;
  cr_assert_eq(tc_buf_alloc(&b, (size_t)(T * w), FORKATTN_DTYPE_BF16), 0);
  forkattn_tensor q = tc_buf_view(&b, 0, T, hq, d, w, d);
  forkattn_tensor k = tc_buf_view(&b, hq * d, T, hkv, d, w, d);
  double in[5 * 4 * 3], out[5 * 4 * 3];
  for (int i = 0; i < T * hq * d; i++)
    in[i] = ref_round_to_dtype(0.37 * i - 3.0, FORKATTN_DTYPE_BF16);
  ref_tensor_write(&q, in);
  ref_tensor_read(&q, out);
  cr_assert_arr_eq(in, out, sizeof in);
  cr_assert_eq(ref_tensor_get(&q, 2, 1, 2), in[(2 * hq + 1) * d + 2]);

  /* Guards: a poisoned buffer reads as fully unwritten; one write into the
   * unmarked v part (a gap) and one into the trailing guard are detected. */
  tc_buf_poison(&b);
  tc_write_check c = tc_buf_check(&b);
  cr_assert_eq(c.guard_bad, 0);
  cr_assert_eq(c.unwritten, (size_t)(T * (hq + hkv) * d));
  ref_tensor_write(&q, in);
  ref_tensor_set(&k, 0, 0, 0, 1.0);
  c = tc_buf_check(&b);
  cr_assert_eq(c.unwritten, (size_t)(T * hkv * d - 1));
  ((uint16_t *)b.data)[(hq + hkv) * d] = 0; /* first v element: not a view element */
  ((unsigned char *)b.data)[(size_t)(T * w) * 2 + 7] = 0; /* trailing guard */
  c = tc_buf_check(&b);
  cr_assert_eq(c.guard_bad, 3, "guard_bad = %zu", c.guard_bad);
  tc_buf_free(&b);
}

Test(helpers, metrics) {
  float got[4] = {1.0f, -2.5f, -INFINITY, 0.5f};
  double want[4] = {1.0, -2.0, -INFINITY, 0.25};
  tc_err e = tc_compare_f32(got, want, 4);
  cr_assert_eq(e.max_abs, 0.5);
  cr_assert_eq(e.max_ref, 2.0);
  cr_assert_eq(e.rel, 0.25);
  cr_assert_eq(e.worst, 1);
  cr_assert_eq(e.nonfinite, 0);
  got[0] = NAN;
  e = tc_compare_f32(got, want, 4);
  cr_assert_eq(e.nonfinite, 1);
  cr_assert(isinf(e.max_abs));
  got[0] = 1.0f;
  got[2] = 0.0f; /* want -inf: a finite value is a mismatch */
  e = tc_compare_f32(got, want, 4);
  cr_assert_eq(e.nonfinite, 1);
}

Test(helpers, seed_reproducible) {
  tc_rng a, b;
  tc_rng_init(&a, 42);
  tc_rng_init(&b, 42);
  for (int i = 0; i < 100; i++)
    cr_assert_eq(tc_next(&a), tc_next(&b));
  for (int i = 0; i < 1000; i++) {
    double u = tc_uniform(&a, -2.0, 3.0);
    cr_assert(u >= -2.0 && u < 3.0);
    int64_t k = tc_randint(&a, 3, 7);
    cr_assert(k >= 3 && k <= 7);
  }
}

/* ---- attention ------------------------------------------------------------ */

typedef struct problem {
  forkattn_prefix_layout lay;
  int64_t off[32];
  int64_t T, hq, hkv, d;
  double scale;
  double *q, *k, *v, *dout;
} problem;

static void problem_init(problem *p, int64_t P, int64_t N, const int64_t *lens, forkattn_mask mask,
                         int64_t hq, int64_t hkv, int64_t d, tc_rng *rng) {
  memset(p, 0, sizeof *p);
  p->off[0] = 0;
  for (int64_t i = 0; i < N; i++)
    p->off[i + 1] = p->off[i] + lens[i];
  p->lay.prompt_len = P;
  p->lay.num_responses = N;
  p->lay.response_offsets = N > 0 ? p->off : NULL;
  p->lay.mask = mask;
  p->T = ref_prefix_rows(&p->lay);
  cr_assert(p->T >= 0);
  p->hq = hq;
  p->hkv = hkv;
  p->d = d;
  p->scale = 1.0 / sqrt((double)d);
  size_t nq = (size_t)(p->T * hq * d) + 1, nk = (size_t)(p->T * hkv * d) + 1;
  p->q = malloc(nq * sizeof(double));
  p->dout = malloc(nq * sizeof(double));
  p->k = malloc(nk * sizeof(double));
  p->v = malloc(nk * sizeof(double));
  cr_assert(p->q && p->k && p->v && p->dout);
  for (size_t i = 0; i < nq; i++) {
    p->q[i] = tc_uniform(rng, -3.0, 3.0);
    p->dout[i] = tc_uniform(rng, -1.0, 1.0);
  }
  for (size_t i = 0; i < nk; i++) {
    p->k[i] = tc_uniform(rng, -1.0, 1.0);
    p->v[i] = tc_uniform(rng, -1.0, 1.0);
  }
}

static void problem_free(problem *p) {
  free(p->q);
  free(p->k);
  free(p->v);
  free(p->dout);
}

static ref_prefix_args problem_args(const problem *p, int bwd) {
  ref_prefix_args a = {&p->lay, p->hq, p->hkv, p->d, p->scale, p->q, p->k, p->v,
                       bwd ? p->dout : NULL};
  return a;
}

/* Which packed rows packed row r may see, straight from the header's words. */
static int sees(const forkattn_prefix_layout *lay, int64_t r, int64_t c) {
  const int64_t P = lay->prompt_len;
  const int causal = lay->mask == FORKATTN_MASK_CAUSAL;
  if (r < P) /* prompt row: the prompt, causally or whole */
    return c < P && (!causal || c <= r);
  if (c < P) /* responses see the whole prompt */
    return 1;
  int64_t i = 0; /* response of row r */
  while (P + lay->response_offsets[i + 1] <= r)
    i++;
  const int64_t b = P + lay->response_offsets[i], e = P + lay->response_offsets[i + 1];
  return c >= b && c < e && (!causal || c <= r);
}

/* Independent forward on packed rows with an explicit mask (no replication). */
static void packed_forward(const problem *p, double *o, double *lse) {
  const int64_t group = p->hq / p->hkv;
  double *s = malloc((size_t)p->T * sizeof *s);
  cr_assert(s);
  for (int64_t r = 0; r < p->T; r++)
    for (int64_t h = 0; h < p->hq; h++) {
      const int64_t g = h / group;
      double m = -INFINITY, sum = 0.0;
      for (int64_t c = 0; c < p->T; c++) {
        s[c] = -INFINITY;
        if (!sees(&p->lay, r, c))
          continue;
        double x = 0.0;
        for (int64_t e = 0; e < p->d; e++)
          x += p->q[(r * p->hq + h) * p->d + e] * p->k[(c * p->hkv + g) * p->d + e];
        s[c] = p->scale * x;
        m = fmax(m, s[c]);
      }
      double *orow = o + (r * p->hq + h) * p->d;
      memset(orow, 0, (size_t)p->d * sizeof *orow);
      for (int64_t c = 0; c < p->T; c++) {
        if (s[c] == -INFINITY)
          continue;
        double w = exp(s[c] - m);
        sum += w;
        for (int64_t e = 0; e < p->d; e++)
          orow[e] += w * p->v[(c * p->hkv + g) * p->d + e];
      }
      for (int64_t e = 0; e < p->d; e++)
        orow[e] /= sum;
      lse[r * p->hq + h] = m + log(sum);
    }
  free(s);
}

static double max_abs_diff(const double *a, const double *b, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; i++)
    m = fmax(m, fabs(a[i] - b[i]));
  return m;
}

Test(reference, hand_computed) {
  /* P = 2, one response of 1 row, 1 head, d = 1, scale 0.5.
   * q = [1, 2, -1], k = [3, 4, 1], v = [5, 6, 7]. */
  const int64_t off[2] = {0, 1};
  forkattn_prefix_layout lay = {2, 1, off, FORKATTN_MASK_CAUSAL};
  double q[3] = {1, 2, -1}, k[3] = {3, 4, 1}, v[3] = {5, 6, 7}, o[3], lse[3];
  ref_prefix_args a = {&lay, 1, 1, 1, 0.5, q, k, v, NULL};
  ref_prefix_out out = {o, lse, NULL, NULL, NULL};
  cr_assert_eq(ref_prefix(&a, &out), 0);
  /* causal: row 0 sees key 0 (s = 1.5); row 1 keys 0,1 (s = 3, 4);
   * row 2 (response) sees keys 0,1,2 (s = -1.5, -2, -0.5). */
  const double e34 = exp(3.0) + exp(4.0);
  const double e2 = exp(-1.5) + exp(-2.0) + exp(-0.5);
  cr_assert_float_eq(o[0], 5.0, 1e-15);
  cr_assert_float_eq(lse[0], 1.5, 1e-15);
  cr_assert_float_eq(o[1], (5 * exp(3.0) + 6 * exp(4.0)) / e34, 1e-14);
  cr_assert_float_eq(lse[1], log(e34), 1e-14);
  cr_assert_float_eq(o[2], (5 * exp(-1.5) + 6 * exp(-2.0) + 7 * exp(-0.5)) / e2, 1e-14);
  cr_assert_float_eq(lse[2], log(e2), 1e-14);
  /* bidirectional: row 0 now sees the whole prompt (keys 0,1: s = 1.5, 2). */
  lay.mask = FORKATTN_MASK_BIDIRECTIONAL;
  cr_assert_eq(ref_prefix(&a, &out), 0);
  const double e0 = exp(1.5) + exp(2.0);
  cr_assert_float_eq(o[0], (5 * exp(1.5) + 6 * exp(2.0)) / e0, 1e-14);
  cr_assert_float_eq(lse[0], log(e0), 1e-14);
  cr_assert_float_eq(o[1], (5 * exp(3.0) + 6 * exp(4.0)) / e34, 1e-14);
  cr_assert_float_eq(o[2], (5 * exp(-1.5) + 6 * exp(-2.0) + 7 * exp(-0.5)) / e2, 1e-14);
}

/* q = 0: every row averages exactly the v rows it sees; lse = log(count). */
Test(reference, zero_query_counts_visible_keys) {
  tc_rng rng = tc_rng_for("reference/zero_query_counts_visible_keys");
  const int64_t lens[4] = {2, 0, 3, 1};
  for (int m = 0; m < 2; m++) {
    problem p;
    problem_init(&p, 3, 4, lens, (forkattn_mask)m, 4, 2, 3, &rng);
    memset(p.q, 0, (size_t)(p.T * p.hq * p.d) * sizeof(double));
    double *o = calloc((size_t)(p.T * p.hq * p.d), sizeof *o);
    double *lse = calloc((size_t)(p.T * p.hq), sizeof *lse);
    ref_prefix_args a = problem_args(&p, 0);
    ref_prefix_out out = {o, lse, NULL, NULL, NULL};
    cr_assert_eq(ref_prefix(&a, &out), 0);
    for (int64_t r = 0; r < p.T; r++)
      for (int64_t h = 0; h < p.hq; h++) {
        const int64_t g = h / (p.hq / p.hkv);
        int64_t n = 0;
        double mean[3] = {0, 0, 0};
        for (int64_t c = 0; c < p.T; c++)
          if (sees(&p.lay, r, c)) {
            n++;
            for (int e = 0; e < 3; e++)
              mean[e] += p.v[(c * p.hkv + g) * 3 + e];
          }
        cr_assert_float_eq(lse[r * p.hq + h], log((double)n), 1e-14, "mask %d row %ld", m,
                           (long)r);
        for (int e = 0; e < 3; e++)
          cr_assert_float_eq(o[(r * p.hq + h) * 3 + e], mean[e] / (double)n, 1e-14);
      }
    free(o);
    free(lse);
    problem_free(&p);
  }
}

Test(reference, matches_independent_packed_forward) {
  tc_rng rng = tc_rng_for("reference/matches_independent_packed_forward");
  const int64_t lens[5] = {0, 4, 1, 0, 6};
  const struct {
    int64_t P, N;
  } shapes[] = {{5, 5}, {0, 5}, {7, 0}, {1, 3}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int m = 0; m < 2; m++) {
      problem p;
      problem_init(&p, shapes[s].P, shapes[s].N, lens, (forkattn_mask)m, 6, 2, 5, &rng);
      const int64_t no = p.T * p.hq * p.d, nl = p.T * p.hq;
      double *o1 = malloc((size_t)(no + 1) * sizeof(double));
      double *o2 = malloc((size_t)(no + 1) * sizeof(double));
      double *l1 = malloc((size_t)(nl + 1) * sizeof(double));
      double *l2 = malloc((size_t)(nl + 1) * sizeof(double));
      ref_prefix_args a = problem_args(&p, 0);
      ref_prefix_out out = {o1, l1, NULL, NULL, NULL};
      cr_assert_eq(ref_prefix(&a, &out), 0);
      packed_forward(&p, o2, l2);
      cr_assert_leq(max_abs_diff(o1, o2, no), 1e-13, "shape %zu mask %d", s, m);
      cr_assert_leq(max_abs_diff(l1, l2, nl), 1e-13, "shape %zu mask %d", s, m);
      free(o1);
      free(o2);
      free(l1);
      free(l2);
      problem_free(&p);
    }
}

/* f = sum(o * dout) for the current inputs. */
static double objective(const problem *p, double *o) {
  ref_prefix_args a = problem_args(p, 0);
  ref_prefix_out out = {o, NULL, NULL, NULL, NULL};
  cr_assert_eq(ref_prefix(&a, &out), 0);
  double f = 0.0;
  for (int64_t i = 0; i < p->T * p->hq * p->d; i++)
    f += o[i] * p->dout[i];
  return f;
}

/* Central differences of every input element against the analytic gradient. */
static void check_fd(const problem *p, const char *what) {
  const int64_t nq = p->T * p->hq * p->d, nk = p->T * p->hkv * p->d;
  double *o = malloc((size_t)(nq + 1) * sizeof *o);
  double *dq = malloc((size_t)(nq + 1) * sizeof *dq);
  double *dk = malloc((size_t)(nk + 1) * sizeof *dk);
  double *dv = malloc((size_t)(nk + 1) * sizeof *dv);
  cr_assert(o && dq && dk && dv);
  ref_prefix_args a = problem_args(p, 1);
  ref_prefix_out out = {o, NULL, dq, dk, dv};
  cr_assert_eq(ref_prefix(&a, &out), 0);
  struct {
    double *x;
    const double *g;
    int64_t n;
    const char *name;
  } ins[3] = {{p->q, dq, nq, "dq"}, {p->k, dk, nk, "dk"}, {p->v, dv, nk, "dv"}};
  const double eps = 1e-5;
  double worst = 0.0;
  for (int t = 0; t < 3; t++)
    for (int64_t i = 0; i < ins[t].n; i++) {
      const double x0 = ins[t].x[i];
      ins[t].x[i] = x0 + eps;
      const double fp = objective(p, o);
      ins[t].x[i] = x0 - eps;
      const double fm = objective(p, o);
      ins[t].x[i] = x0;
      const double fd = (fp - fm) / (2 * eps);
      const double err = fabs(fd - ins[t].g[i]);
      worst = fmax(worst, err);
      /* Truncation error O(eps^2 * f''') ~ 1e-10, rounding ~ 1e-16 / eps. */
      cr_assert_leq(err, 1e-8 + 1e-7 * fabs(fd), "%s: %s[%ld]: analytic %.12g fd %.12g", what,
                    ins[t].name, (long)i, ins[t].g[i], fd);
    }
  cr_log_info("%s: worst |fd - analytic| = %.3e", what, worst);
  free(o);
  free(dq);
  free(dk);
  free(dv);
}

Test(reference, gradients_match_finite_differences) {
  tc_rng rng = tc_rng_for("reference/gradients_match_finite_differences");
  const int64_t lens[4] = {2, 0, 3, 1};
  const struct {
    int64_t P, N, hq, hkv, d;
    const char *name;
  } cases[] = {
      {3, 4, 4, 2, 3, "P=3 N=4 GQA 4/2"},
      {0, 4, 2, 2, 4, "P=0 (varlen)"},
      {5, 0, 3, 1, 2, "N=0 (prompt alone)"},
      {1, 3, 2, 1, 3, "P=1 N=3"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (int m = 0; m < 2; m++) {
      problem p;
      problem_init(&p, cases[c].P, cases[c].N, lens, (forkattn_mask)m, cases[c].hq, cases[c].hkv,
                   cases[c].d, &rng);
      char what[96];
      snprintf(what, sizeof what, "%s %s", cases[c].name, m ? "bidirectional" : "causal");
      check_fd(&p, what);
      problem_free(&p);
    }
}

/* The prompt's o, lse, dq do not depend on the responses; its dk/dv do. */
Test(reference, prompt_independent_of_responses) {
  tc_rng rng = tc_rng_for("reference/prompt_independent_of_responses");
  const int64_t lens_a[3] = {4, 1, 3}, lens_b[5] = {2, 7, 0, 1, 5};
  for (int m = 0; m < 2; m++) {
    problem a, b;
    const int64_t P = 6, hq = 4, hkv = 2, d = 5;
    problem_init(&a, P, 3, lens_a, (forkattn_mask)m, hq, hkv, d, &rng);
    problem_init(&b, P, 5, lens_b, (forkattn_mask)m, hq, hkv, d, &rng);
    /* Same prompt rows (q, k, v, dout); different responses. */
    memcpy(b.q, a.q, (size_t)(P * hq * d) * sizeof(double));
    memcpy(b.dout, a.dout, (size_t)(P * hq * d) * sizeof(double));
    memcpy(b.k, a.k, (size_t)(P * hkv * d) * sizeof(double));
    memcpy(b.v, a.v, (size_t)(P * hkv * d) * sizeof(double));
    double *res[2][5];
    problem *ps[2] = {&a, &b};
    for (int s = 0; s < 2; s++) {
      const problem *p = ps[s];
      for (int t = 0; t < 5; t++)
        res[s][t] = malloc((size_t)(p->T * hq * d + 1) * sizeof(double));
      ref_prefix_args args = problem_args(p, 1);
      ref_prefix_out out = {res[s][0], res[s][1], res[s][2], res[s][3], res[s][4]};
      cr_assert_eq(ref_prefix(&args, &out), 0);
    }
    cr_assert_arr_eq(res[0][0], res[1][0], (size_t)(P * hq * d) * sizeof(double), "o");
    cr_assert_arr_eq(res[0][1], res[1][1], (size_t)(P * hq) * sizeof(double), "lse");
    cr_assert_arr_eq(res[0][2], res[1][2], (size_t)(P * hq * d) * sizeof(double), "dq");
    cr_assert_gt(max_abs_diff(res[0][3], res[1][3], P * hkv * d), 1e-6, "prompt dk must change");
    cr_assert_gt(max_abs_diff(res[0][4], res[1][4], P * hkv * d), 1e-6, "prompt dv must change");

    /* Inside one replicated sequence [prompt ; response], the prompt rows give
     * the prompt-alone result: the mask keeps the prompt blind to responses. */
    const int64_t L = P + lens_a[0];
    double *o = malloc((size_t)(L * hq * d) * sizeof(double));
    double *lse = malloc((size_t)(L * hq) * sizeof(double));
    cr_assert_eq(ref_attention_dense(L, P, 0, (forkattn_mask)m, hq, hkv, d, a.scale, a.q, a.k,
                                     a.v, NULL, o, lse, NULL, NULL, NULL),
                 0);
    cr_assert_leq(max_abs_diff(o, res[0][0], P * hq * d), 1e-15);
    cr_assert_leq(max_abs_diff(lse, res[0][1], P * hq), 1e-15);
    free(o);
    free(lse);
    for (int s = 0; s < 2; s++)
      for (int t = 0; t < 5; t++)
        free(res[s][t]);
    problem_free(&a);
    problem_free(&b);
  }
}

Test(reference, prompt_grad_is_own_part_plus_copies) {
  /* dk/dv of the prompt with N responses = prompt alone + sum over the N
   * single-response problems' prompt dk/dv minus the N extra own parts. */
  tc_rng rng = tc_rng_for("reference/prompt_grad_is_own_part_plus_copies");
  const int64_t lens[3] = {3, 0, 4};
  const int64_t P = 4, hq = 2, hkv = 1, d = 3;
  problem p;
  problem_init(&p, P, 3, lens, FORKATTN_MASK_CAUSAL, hq, hkv, d, &rng);
  const int64_t nk = p.T * hkv * d, nq = p.T * hq * d;
  double *dq = malloc((size_t)nq * sizeof(double)), *dk = malloc((size_t)nk * sizeof(double));
  double *dv = malloc((size_t)nk * sizeof(double));
  ref_prefix_args a = problem_args(&p, 1);
  ref_prefix_out out = {NULL, NULL, dq, dk, dv};
  cr_assert_eq(ref_prefix(&a, &out), 0);

  double sum_k[4 * 3] = {0}, sum_v[4 * 3] = {0};
  double own_k[4 * 3], own_v[4 * 3], tq[4 * 2 * 3];
  forkattn_prefix_layout alone = {P, 0, NULL, FORKATTN_MASK_CAUSAL};
  ref_prefix_args aa = {&alone, hq, hkv, d, p.scale, p.q, p.k, p.v, p.dout};
  ref_prefix_out ao = {NULL, NULL, tq, own_k, own_v};
  cr_assert_eq(ref_prefix(&aa, &ao), 0);
  for (int64_t i = 0; i < 3; i++) {
    /* single response i: rows = prompt + response i, packed contiguously */
    const int64_t R = lens[i], T1 = P + R, r0 = P + p.off[i];
    double *q1 = malloc((size_t)(T1 * hq * d + 1) * sizeof(double));
    double *do1 = malloc((size_t)(T1 * hq * d + 1) * sizeof(double));
    double *k1 = malloc((size_t)(T1 * hkv * d + 1) * sizeof(double));
    double *v1 = malloc((size_t)(T1 * hkv * d + 1) * sizeof(double));
    double *dq1 = malloc((size_t)(T1 * hq * d + 1) * sizeof(double));
    double *dk1 = malloc((size_t)(T1 * hkv * d + 1) * sizeof(double));
    double *dv1 = malloc((size_t)(T1 * hkv * d + 1) * sizeof(double));
    memcpy(q1, p.q, (size_t)(P * hq * d) * sizeof(double));
    memcpy(do1, p.dout, (size_t)(P * hq * d) * sizeof(double));
    memcpy(k1, p.k, (size_t)(P * hkv * d) * sizeof(double));
    memcpy(v1, p.v, (size_t)(P * hkv * d) * sizeof(double));
    memcpy(q1 + P * hq * d, p.q + r0 * hq * d, (size_t)(R * hq * d) * sizeof(double));
    memcpy(do1 + P * hq * d, p.dout + r0 * hq * d, (size_t)(R * hq * d) * sizeof(double));
    memcpy(k1 + P * hkv * d, p.k + r0 * hkv * d, (size_t)(R * hkv * d) * sizeof(double));
    memcpy(v1 + P * hkv * d, p.v + r0 * hkv * d, (size_t)(R * hkv * d) * sizeof(double));
    const int64_t off1[2] = {0, R};
    forkattn_prefix_layout l1 = {P, 1, off1, FORKATTN_MASK_CAUSAL};
    ref_prefix_args a1 = {&l1, hq, hkv, d, p.scale, q1, k1, v1, do1};
    ref_prefix_out o1 = {NULL, NULL, dq1, dk1, dv1};
    cr_assert_eq(ref_prefix(&a1, &o1), 0);
    for (int64_t x = 0; x < P * hkv * d; x++) {
      sum_k[x] += dk1[x] - own_k[x];
      sum_v[x] += dv1[x] - own_v[x];
    }
    /* the response rows' gradients equal those of the single-response problem */
    cr_assert_leq(max_abs_diff(dk1 + P * hkv * d, dk + r0 * hkv * d, R * hkv * d), 1e-14);
    cr_assert_leq(max_abs_diff(dq1 + P * hq * d, dq + r0 * hq * d, R * hq * d), 1e-14);
    free(q1);
    free(do1);
    free(k1);
    free(v1);
    free(dq1);
    free(dk1);
    free(dv1);
  }
  for (int64_t x = 0; x < P * hkv * d; x++) {
    cr_assert_float_eq(dk[x], own_k[x] + sum_k[x], 1e-13);
    cr_assert_float_eq(dv[x], own_v[x] + sum_v[x], 1e-13);
  }
  free(dq);
  free(dk);
  free(dv);
  problem_free(&p);
}

Test(reference, layouts) {
  const int64_t good[4] = {0, 2, 2, 5}, bad_start[3] = {1, 2, 3}, bad_order[3] = {0, 3, 2};
  forkattn_prefix_layout l = {4, 3, good, FORKATTN_MASK_CAUSAL};
  cr_assert_eq(ref_prefix_rows(&l), 9);
  l.response_offsets = bad_start;
  l.num_responses = 2;
  cr_assert_eq(ref_prefix_rows(&l), -1);
  l.response_offsets = bad_order;
  cr_assert_eq(ref_prefix_rows(&l), -1);
  l.num_responses = 0;
  l.response_offsets = NULL;
  cr_assert_eq(ref_prefix_rows(&l), 4);
  l.prompt_len = -1;
  cr_assert_eq(ref_prefix_rows(&l), -1);
  /* P = 0, N = 0: no rows at all, nothing to compute, success. */
  forkattn_prefix_layout empty = {0, 0, NULL, FORKATTN_MASK_BIDIRECTIONAL};
  double dummy = 0.0;
  ref_prefix_args a = {&empty, 2, 1, 4, 0.5, &dummy, &dummy, &dummy, &dummy};
  ref_prefix_out out = {&dummy, &dummy, &dummy, &dummy, &dummy};
  cr_assert_eq(ref_prefix(&a, &out), 0);
  cr_assert_eq(dummy, 0.0);
}
