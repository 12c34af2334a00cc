/* `forkattn check`: run problems (shared-prompt or tree attention) against
 * the float64 reference (benchdnn style). One problem from the command line, or many with --batch FILE (one
 * problem per line, same options, '#' starts a comment). Each case prints
 * PASSED / FAILED / UNTRUSTED with its error figures; every failure prints the
 * one command line that reproduces it. Exit status 0 only if all passed.
 *
 * Input distributions (--dist):
 *   normal    q, k, v, dout ~ U(-1, 1), scale 1/sqrt(d)
 *   large     scaled scores in [88, 90] (near f32 exp overflow)
 *   negative  scores in [-60, -40] (all-negative rows)
 *   tiny      scores near -1.2e5 (no "finite minus-infinity" sentinel may zero them)
 *   peaked    integer scores spread over [-40, 40]: rows dominated by one key
 * The non-normal distributions use integer-valued q and k with scale 1, so
 * every score is exact in f32 whatever the summation order: a wrong answer is
 * the kernel's, not the conditioning's, and the normal tolerances apply. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "forkattn.h"
#include "options.h"
#include "reference.h"

#define CHECK_MAX_N 4096

typedef enum { DIST_NORMAL, DIST_LARGE, DIST_NEGATIVE, DIST_TINY, DIST_PEAKED } check_dist;
static const char *const dist_names[] = {"normal", "large", "negative", "tiny", "peaked"};

typedef struct check_problem {
  int tree;                              /* operation: 0 prefix, 1 tree (lens = node lengths) */
  int64_t parents[CHECK_MAX_N], nparents; /* tree: parent of each node (-1 root, < index) */
  int64_t p, n, lens[CHECK_MAX_N];
  int64_t hq, hkv, d;
  forkattn_dtype dtype;
  forkattn_mask mask;
  forkattn_backend backend;
  check_dist dist;
  unsigned long long seed;
} check_problem;

/* The command line that reproduces p. */
static void repro(const check_problem *p, char *buf, size_t len) {
  int o = p->tree ? snprintf(buf, len, "forkattn check tree --lens ")
                  : snprintf(buf, len, "forkattn check --p %lld --lens ", (long long)p->p);
  for (int64_t i = 0; i < p->n && o < (int)len; i++)
    o += snprintf(buf + o, len - (size_t)o, "%s%lld", i ? "," : "", (long long)p->lens[i]);
  if (p->n == 0 && o < (int)len) o += snprintf(buf + o, len - (size_t)o, "none");
  if (p->tree && o < (int)len) o += snprintf(buf + o, len - (size_t)o, " --parents ");
  for (int64_t i = 0; p->tree && i < p->nparents && o < (int)len; i++)
    o += snprintf(buf + o, len - (size_t)o, "%s%lld", i ? "," : "", (long long)p->parents[i]);
  if (p->tree && p->nparents == 0 && o < (int)len) o += snprintf(buf + o, len - (size_t)o, "none");
  if (o < (int)len)
    snprintf(buf + o, len - (size_t)o, " --hq %lld --hkv %lld --d %lld --dtype %s --mask %s --dist %s --backend %s --seed %llu",
             (long long)p->hq, (long long)p->hkv, (long long)p->d, tool_dtype_name(p->dtype),
             tool_mask_name(p->mask), dist_names[p->dist],
             forkattn_backend_name(p->backend), p->seed);
}

/* A comma list of int64 in [lo, hi] ("none": empty) into out[CHECK_MAX_N]; 0 ok. */
static int parse_list(const char *v, int64_t lo, int64_t hi, int64_t *out, int64_t *n) {
  *n = 0;
  if (!strcmp(v, "none")) return 0;
  char tmp[8192];
  snprintf(tmp, sizeof tmp, "%s", v);
  int bad = 0;
  for (char *tok = strtok(tmp, ","); tok && !bad; tok = strtok(NULL, ",")) {
    if (*n == CHECK_MAX_N) return 1;
    bad = tool_parse_i64(tok, lo, hi, &out[(*n)++]);
  }
  return bad;
}

/* Parse options into p (defaults already set). 0 ok, -1 error (message printed). */
static int parse_problem(int argc, char **argv, check_problem *p) {
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "prefix") || !strcmp(a, "tree")) {
      p->tree = !strcmp(a, "tree");
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "check: %s needs a value\n", a);
      return -1;
    }
    const char *v = argv[++i];
    int64_t x = 0;
    int bad = 0;
    if (!strcmp(a, "--p")) bad = tool_parse_i64(v, 0, 1 << 20, &p->p);
    else if (!strcmp(a, "--hq")) bad = tool_parse_i64(v, 1, 1024, &p->hq);
    else if (!strcmp(a, "--hkv")) bad = tool_parse_i64(v, 1, 1024, &p->hkv);
    else if (!strcmp(a, "--d")) bad = tool_parse_i64(v, 1, 4096, &p->d);
    else if (!strcmp(a, "--seed")) { bad = tool_parse_i64(v, 0, (long long)1 << 62, &x); p->seed = (unsigned long long)x; }
    else if (!strcmp(a, "--lens")) bad = parse_list(v, 0, 1 << 20, p->lens, &p->n);
    else if (!strcmp(a, "--parents")) bad = parse_list(v, -1, CHECK_MAX_N, p->parents, &p->nparents);
    else if (!strcmp(a, "--dtype")) bad = tool_parse_dtype(v, &p->dtype);
    else if (!strcmp(a, "--mask")) bad = tool_parse_mask(v, &p->mask);
    else if (!strcmp(a, "--backend")) bad = tool_parse_backend(v, &p->backend);
    else if (!strcmp(a, "--dist")) {
      bad = 1;
      for (int k = 0; k < 5; k++)
        if (!strcmp(v, dist_names[k])) p->dist = (check_dist)k, bad = 0;
    } else {
      fprintf(stderr, "check: unknown option %s\n", a);
      return -1;
    }
    if (bad) {
      fprintf(stderr, "check: bad value '%s' for %s\n", v, a);
      return -1;
    }
  }
  return 0;
}

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }
static double rng_int(uint64_t *s, int lo, int hi) { return lo + (int)(rng_next(s) % (uint64_t)(hi - lo + 1)); }

/* q, k, v, dout of the problem as doubles already rounded to its dtype.
 * Integer distributions: k[:, 0] = 1 (2 for tiny) and q[:, 0] = base (the score offset),
 * other components small integers, so s = base + sum of small integer
 * products, exact in f32 (and bf16/f16 hold the integers exactly). */
static double check_inputs(const check_problem *p, int64_t T, double *q, double *k, double *v, double *dout) {
  uint64_t s = p->seed * 0x9e3779b97f4a7c15ull + 12345;
  const int64_t d = p->d;
  double base = 0;
  int spread = 0; /* integer component range [-spread, spread] */
  switch (p->dist) {
  case DIST_LARGE: base = 89; spread = 1; break;
  case DIST_NEGATIVE: base = -50; spread = 2; break;
  case DIST_TINY: base = -60000; spread = 2; break; /* times k[:, 0] = 2: about -1.2e5, and f16 holds it */
  case DIST_PEAKED: base = 0; spread = 4; break;
  default: break;
  }
  /* spread the free components over few dims so |score - base| stays small */
  int64_t free_dims = p->dist == DIST_LARGE ? 1 : (d - 1 < 4 ? d - 1 : 4);
  if (p->dist == DIST_PEAKED) free_dims = d - 1 < 5 ? d - 1 : 5;
  for (int64_t r = 0; r < T; r++) {
    for (int64_t h = 0; h < p->hq; h++)
      for (int64_t c = 0; c < d; c++) {
        double x;
        if (p->dist == DIST_NORMAL) x = 2 * rng_unit(&s) - 1;
        else if (c == 0) x = base;
        else x = c <= free_dims ? rng_int(&s, -spread, spread) : 0;
        q[(r * p->hq + h) * d + c] = ref_round_to_dtype(x, p->dtype);
        dout[(r * p->hq + h) * d + c] = ref_round_to_dtype(2 * rng_unit(&s) - 1, p->dtype);
      }
    for (int64_t h = 0; h < p->hkv; h++)
      for (int64_t c = 0; c < d; c++) {
        double x;
        if (p->dist == DIST_NORMAL) x = 2 * rng_unit(&s) - 1;
        else if (c == 0) x = p->dist == DIST_TINY ? 2 : 1;
        else x = c <= free_dims ? rng_int(&s, -spread, spread) : 0;
        k[(r * p->hkv + h) * d + c] = ref_round_to_dtype(x, p->dtype);
        v[(r * p->hkv + h) * d + c] = ref_round_to_dtype(2 * rng_unit(&s) - 1, p->dtype);
      }
  }
  return p->dist == DIST_NORMAL ? 1.0 / sqrt((double)d) : 1.0;
}

typedef struct { double err, ref; } check_metric;

/* max |got - want| / max |want| (absolute when absolute != 0); NaN/inf mismatches give inf. */
static check_metric metric(const double *got, const double *want, int64_t n, int absolute) {
  check_metric m = {0, 0};
  for (int64_t i = 0; i < n; i++) {
    double e = (isinf(want[i]) && got[i] == want[i]) ? 0 : fabs(got[i] - want[i]);
    if (!(e <= m.err)) m.err = isnan(e) ? INFINITY : e;
    if (isfinite(want[i]) && fabs(want[i]) > m.ref) m.ref = fabs(want[i]);
  }
  if (!absolute && m.ref > 0) m.err /= m.ref;
  return m;
}

/* Poison bit patterns (NaNs no computation produces): every output element must be overwritten. */
static void poison(void *p, forkattn_dtype t, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (t == FORKATTN_DTYPE_F32) ((uint32_t *)p)[i] = 0x7FBADBADu;
    else ((uint16_t *)p)[i] = 0x7FBDu;
  }
}
static int64_t unwritten(const void *p, forkattn_dtype t, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; i++)
    c += t == FORKATTN_DTYPE_F32 ? ((const uint32_t *)p)[i] == 0x7FBADBADu : ((const uint16_t *)p)[i] == 0x7FBDu;
  return c;
}

/* Run one problem; prints its line. Returns 0 passed, 1 failed, 2 untrusted, -1 setup error. */
static int check_one(const check_problem *p) {
  char cmd[2048];
  repro(p, cmd, sizeof cmd);
  int64_t off[CHECK_MAX_N + 1];
  off[0] = 0;
  for (int64_t i = 0; i < p->n; i++) off[i + 1] = off[i] + p->lens[i];
  const int64_t T = (p->tree ? 0 : p->p) + off[p->n], hq = p->hq, hkv = p->hkv, d = p->d;
  forkattn_prefix_layout lay = {p->p, p->n, off, p->mask};
  forkattn_tree_layout tl = {p->n, off, p->parents}; /* node i owns rows off[i].. */
  if (p->tree && p->nparents != p->n) {
    fprintf(stderr, "check: tree: %lld parents for %lld nodes\n", (long long)p->nparents, (long long)p->n);
    return -1;
  }
  for (int64_t i = 0; p->tree && i < p->n; i++)
    if (p->parents[i] >= i) {
      fprintf(stderr, "check: tree: parents[%lld] = %lld must be -1 or an earlier node\n", (long long)i,
              (long long)p->parents[i]);
      return -1;
    }
  const size_t nq = (size_t)(T * hq * d), nk = (size_t)(T * hkv * d), es = ref_dtype_size(p->dtype);
  double *in = malloc(sizeof(double) * (2 * nq + 2 * nk)), *ref = malloc(sizeof(double) * (2 * nq + 2 * nk + T * hq));
  double *got = malloc(sizeof(double) * (2 * nq + 2 * nk + T * hq));
  void *buf[8];
  const size_t cnt[8] = {nq, nk, nk, nq, nq, nq, nk, nk}; /* q k v o dout dq dk dv */
  for (int i = 0; i < 8; i++) buf[i] = malloc(cnt[i] * es + 1);
  float *lse = malloc(sizeof(float) * (size_t)(T * hq) + 1);
  int rc = -1;
  forkattn_ctx *ctx = NULL;
  if (!in || !ref || !got || !lse) goto done;
  for (int i = 0; i < 8; i++)
    if (!buf[i]) goto done;
  double *q = in, *k = q + nq, *v = k + nk, *dout = v + nk;
  double scale = check_inputs(p, T, q, k, v, dout);
  forkattn_tensor t[8];
  const int64_t heads[8] = {hq, hkv, hkv, hq, hq, hq, hkv, hkv};
  for (int i = 0; i < 8; i++) t[i] = forkattn_tensor_contiguous(buf[i], p->dtype, T, heads[i], d);
  ref_tensor_write(&t[0], q);
  ref_tensor_write(&t[1], k);
  ref_tensor_write(&t[2], v);
  ref_tensor_write(&t[4], dout);
  for (int i = 3; i < 8; i++)
    if (i != 4) poison(buf[i], p->dtype, (int64_t)cnt[i]);
  poison(lse, FORKATTN_DTYPE_F32, T * hq);
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co);
  co.backend = p->backend;
  if (forkattn_ctx_create(&ctx, &co)) {
    printf("FAILED   %s: cannot create the context: %s\n", cmd, forkattn_ctx_create_error());
    rc = 1;
    goto done;
  }
  forkattn_status st =
      p->tree ? forkattn_tree_fwd(ctx, &tl, &t[0], &t[1], &t[2], &t[3], lse, (float)scale, FORKATTN_MEMORY_HOST)
              : forkattn_prefix_fwd(ctx, &lay, &t[0], &t[1], &t[2], &t[3], lse, (float)scale, FORKATTN_MEMORY_HOST);
  if (!st && p->tree)
    st = forkattn_tree_bwd(ctx, &tl, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], (float)scale,
                           FORKATTN_MEMORY_HOST);
  else if (!st)
    st = forkattn_prefix_bwd(ctx, &lay, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], (float)scale,
                             FORKATTN_MEMORY_HOST);
  const char *where = forkattn_ctx_backend(ctx) == FORKATTN_BACKEND_GPU ? "device" : "host";
  if (st) {
    printf("FAILED   [%s] %s: %s\n  repro: %s\n", where, forkattn_status_string(st), forkattn_ctx_last_error(ctx), cmd);
    rc = 1;
    goto done;
  }
  /* the reference after the library: a problem the library refuses is reported
   * with the library's own message above, not as a reference failure */
  double *ro = ref, *rdq = ro + nq, *rdk = rdq + nq, *rdv = rdk + nk, *rlse = rdv + nk;
  ref_prefix_args ra = {&lay, hq, hkv, d, scale, q, k, v, dout};
  ref_tree_args rt = {&tl, hq, hkv, d, scale, q, k, v, dout};
  ref_prefix_out rout = {ro, rlse, rdq, rdk, rdv};
  if (T > 0 && (p->tree ? ref_tree(&rt, &rout) : ref_prefix(&ra, &rout))) {
    fprintf(stderr, "check: the float64 reference failed on a problem the library accepted\n");
    goto done;
  }
  /* what the output dtype can hold: an f16 gradient beyond 65504 is inf */
  for (size_t i = 0; i < 2 * nq + 2 * nk; i++) ref[i] = ref_round_to_dtype(ref[i], p->dtype);
  int64_t missing = unwritten(lse, FORKATTN_DTYPE_F32, T * hq);
  for (int i = 3; i < 8; i++)
    if (i != 4) missing += unwritten(buf[i], p->dtype, (int64_t)cnt[i]);
  double *go = got, *gdq = go + nq, *gdk = gdq + nq, *gdv = gdk + nk, *glse = gdv + nk;
  ref_tensor_read(&t[3], go);
  ref_tensor_read(&t[5], gdq);
  ref_tensor_read(&t[6], gdk);
  ref_tensor_read(&t[7], gdv);
  for (int64_t i = 0; i < T * hq; i++) glse[i] = lse[i];
  check_metric mo = metric(go, ro, (int64_t)nq, 0), ml = metric(glse, rlse, T * hq, 1),
               mq = metric(gdq, rdq, (int64_t)nq, 0), mk = metric(gdk, rdk, (int64_t)nk, 0),
               mv = metric(gdv, rdv, (int64_t)nk, 0);
  /* Tolerances as in tests/prefix_harness.c (justified in docs/numerics.md),
   * plus the representation error of the f32 lse output: |lse| * 2^-24 (half
   * an ulp). Backward recomputes P = exp(s - lse) from that stored lse, so P,
   * and with it every gradient, carries the same relative error: at scores
   * near -1e5 (--dist tiny) that is 6e-3, inherent to an f32 lse. */
  const int f32 = p->dtype == FORKATTN_DTYPE_F32;
  const double lse_rep = ml.ref * 0x1.0p-24;
  const double tol_o = f32 ? 2e-5 : 1e-2, tol_g = (f32 ? 1e-4 : 2e-2) + 2 * lse_rep;
  const double tol_l = (f32 ? 1e-4 : 1e-3) + 2 * lse_rep;
  int64_t zeros = 0;
  for (size_t i = 0; i < nq; i++) zeros += fabs(ro[i]) < 1e-30;
  const int untrusted = T > 0 && (mo.ref == 0 || zeros * 2 > (int64_t)nq);
  const int ok = missing == 0 && mo.err <= tol_o && ml.err <= tol_l && mq.err <= tol_g && mk.err <= tol_g &&
                 mv.err <= tol_g;
  rc = !ok ? 1 : untrusted ? 2 : 0;
  printf("%-9s [%s] o %.1e lse %.1e dq %.1e dk %.1e dv %.1e (tol %.0e/%.0e/%.0e)%s  %s\n",
         rc == 0 ? "PASSED" : rc == 1 ? "FAILED" : "UNTRUSTED", where, mo.err, ml.err, mq.err, mk.err, mv.err, tol_o,
         tol_l, tol_g, missing ? " UNWRITTEN ELEMENTS" : "", cmd + strlen("forkattn check "));
  if (rc == 1) printf("  repro: %s\n", cmd);
  if (rc == 2) printf("  not trustworthy: reference outputs are mostly zero\n");
done:
  forkattn_ctx_destroy(ctx);
  for (int i = 0; i < 8; i++) free(buf[i]);
  free(in);
  free(ref);
  free(got);
  free(lse);
  return rc;
}

static void check_defaults(check_problem *p) {
  memset(p, 0, sizeof *p);
  p->p = 64;
  p->n = 3;
  p->lens[0] = 17, p->lens[1] = 0, p->lens[2] = 33;
  p->hq = 4, p->hkv = 2, p->d = 32;
  p->dtype = FORKATTN_DTYPE_F32;
  p->mask = FORKATTN_MASK_CAUSAL;
  p->backend = FORKATTN_BACKEND_AUTO;
  p->dist = DIST_NORMAL;
  p->seed = 1;
}

static int check_batch(const char *path, const check_problem *base) {
  FILE *f = strcmp(path, "-") ? fopen(path, "r") : stdin;
  if (!f) {
    fprintf(stderr, "check: cannot open %s\n", path);
    return 2;
  }
  char line[8192];
  int counts[3] = {0, 0, 0}, lineno = 0, errors = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char *argv[256];
    int argc = 0;
    for (char *tok = strtok(line, " \t\r\n"); tok && argc < 256; tok = strtok(NULL, " \t\r\n")) argv[argc++] = tok;
    if (!argc) continue;
    check_problem p = *base; /* base carries --backend / --seed given with --batch */
    if (parse_problem(argc, argv, &p)) {
      fprintf(stderr, "check: %s:%d: bad problem line\n", path, lineno);
      errors++;
      continue;
    }
    int rc = check_one(&p);
    if (rc < 0) errors++;
    else counts[rc]++;
  }
  if (f != stdin) fclose(f);
  printf("check: %d passed, %d failed, %d untrusted, %d errors\n", counts[0], counts[1], counts[2], errors);
  return counts[1] || counts[2] || errors ? 1 : 0;
}

int cmd_check(int argc, char **argv) {
  check_problem p;
  check_defaults(&p);
  const char *batch = NULL;
  int rest = 0;
  char *args[256];
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      printf("usage: forkattn check [prefix] [--p P] [--lens a,b,...|none] [--hq H] [--hkv H] [--d D]\n"
             "                      [--dtype f32|bf16|f16] [--mask causal|bidirectional]\n"
             "                      [--dist normal|large|negative|tiny|peaked] [--backend auto|cpu|gpu] [--seed S]\n"
             "       forkattn check tree --lens a,b,... --parents -1,0,... [--hq ... same options]\n"
             "                      (node i has lens[i] rows and parent parents[i]: -1 or an earlier node)\n"
             "       forkattn check --batch FILE [--backend B] [--seed S]   (one problem per line)\n"
             "Runs forward and backward against the float64 reference; prints PASSED, FAILED (with\n"
             "a reproducing command) or UNTRUSTED (reference outputs mostly zero) per problem.\n");
      return 0;
    }
    if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = argv[++i];
    else if (rest < 256) args[rest++] = argv[i];
  }
  if (parse_problem(rest, args, &p)) return 2;
  if (batch) return check_batch(batch, &p);
  int rc = check_one(&p);
  return rc == 0 ? 0 : rc < 0 ? 2 : 1;
}
