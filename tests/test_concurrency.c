/*
 * test_concurrency.c - many contexts used from many threads at once.
 *
 *  contexts/pthreads     8 POSIX threads, each with its own context (threads
 *                        option 1 or 2, bind_threads on for half of them) and
 *                        its own random problem, run forward + backward 20
 *                        times at once; every run must give bitwise what one
 *                        context computed for that problem beforehand, serially.
 *  contexts/omp_region   the same from inside an OpenMP parallel region of 8
 *                        threads (the library's own region is then nested).
 *  contexts/create_destroy  contexts created and destroyed concurrently.
 *  blas/threads_restored two threads whose calls overlap share the library's
 *                        save/restore of OpenBLAS's process-wide thread count
 *                        (cpu/cpu_tile.c): afterwards openblas_get_num_threads()
 *                        is what it was before.
 *
 * Worker threads never call Criterion: they record the first mismatch and the
 * main thread asserts after joining them.
 * FORKATTN_TEST_SEED=<n> reproduces the data (the seed is printed).
 * FORKATTN_CONCURRENCY_ITERS=<n> changes the 20 iterations per thread.
 */
#define _POSIX_C_SOURCE 200809L
#include <cblas.h>
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forkattn.h"
#include "reference.h"
#include "test_common.h"

#include "test_runner.h"

#define CC_MAXN 6
#define CC_THREADS 8
#define CC_TIMEOUT 300.0

/* ---- one problem and its outputs ------------------------------------------ */

typedef struct cc_problem {
  int64_t P, N, lens[CC_MAXN], hq, hkv, d;
  forkattn_mask mask;
  forkattn_dtype dtype;
  int64_t off[CC_MAXN + 1], T;
  forkattn_prefix_layout layout;
  float scale;
  tc_buf bq, bk, bv, bdo;
  forkattn_tensor q, k, v, dout;
} cc_problem;

/* A random small problem (drawn on the main thread: tc_rng_for is not thread-safe). */
static void cc_problem_random(cc_problem *p, tc_rng *rng) {
  static const int64_t heads[][2] = {{4, 2}, {4, 1}, {2, 2}, {6, 3}, {8, 2}};
  static const int64_t dims[] = {16, 32, 48, 64};
  memset(p, 0, sizeof *p);
  p->P = tc_randint(rng, 0, 160);
  p->N = tc_randint(rng, 1, CC_MAXN);
  for (int64_t i = 0; i < p->N; i++) p->lens[i] = tc_randint(rng, 0, 70);
  const int64_t hi = tc_randint(rng, 0, 4);
  p->hq = heads[hi][0];
  p->hkv = heads[hi][1];
  p->d = dims[tc_randint(rng, 0, 3)];
  p->mask = tc_randint(rng, 0, 1) ? FORKATTN_MASK_BIDIRECTIONAL : FORKATTN_MASK_CAUSAL;
  p->dtype = tc_randint(rng, 0, 1) ? FORKATTN_DTYPE_BF16 : FORKATTN_DTYPE_F32;
  p->off[0] = 0;
  for (int64_t i = 0; i < p->N; i++) p->off[i + 1] = p->off[i] + p->lens[i];
  p->T = p->P + p->off[p->N];
  if (p->T == 0) { /* keep at least one row */
    p->P = 1;
    p->T = 1;
  }
  p->layout.prompt_len = p->P;
  p->layout.num_responses = p->N;
  p->layout.response_offsets = p->off;
  p->layout.mask = p->mask;
  p->scale = (float)(1.0 / sqrt((double)p->d));
  p->q = tc_buf_contiguous(&p->bq, p->dtype, p->T, p->hq, p->d);
  p->k = tc_buf_contiguous(&p->bk, p->dtype, p->T, p->hkv, p->d);
  p->v = tc_buf_contiguous(&p->bv, p->dtype, p->T, p->hkv, p->d);
  p->dout = tc_buf_contiguous(&p->bdo, p->dtype, p->T, p->hq, p->d);
  cr_assert(p->q.data && p->k.data && p->v.data && p->dout.data, "out of memory");
  tc_fill_tensor(rng, &p->q, -2.0, 2.0);
  tc_fill_tensor(rng, &p->k, -1.0, 1.0);
  tc_fill_tensor(rng, &p->v, -1.0, 1.0);
  tc_fill_tensor(rng, &p->dout, -1.0, 1.0);
}

static void cc_describe(const cc_problem *p, char *buf, size_t size) {
  int n = snprintf(buf, size, "P=%" PRId64 " N=%" PRId64 " lens={", p->P, p->N);
  for (int64_t i = 0; i < p->N && n > 0 && (size_t)n < size; i++)
    n += snprintf(buf + n, size - (size_t)n, "%s%" PRId64, i ? "," : "", p->lens[i]);
  if (n > 0 && (size_t)n < size)
    snprintf(buf + n, size - (size_t)n, "} heads=%" PRId64 "/%" PRId64 " d=%" PRId64 " %s %s", p->hq, p->hkv,
             p->d, p->mask == FORKATTN_MASK_CAUSAL ? "causal" : "bidir", ref_dtype_name(p->dtype));
}

static void cc_problem_free(cc_problem *p) {
  tc_buf_free(&p->bq);
  tc_buf_free(&p->bk);
  tc_buf_free(&p->bv);
  tc_buf_free(&p->bdo);
}

/* Returns 0, or -1 when out of memory (callable from any thread). */
static int cc_out_init(tc_attn_out *o, const cc_problem *p) {
  return tc_attn_out_init(o, p->dtype, p->T, p->hq, p->hkv, p->d);
}

/* Poison, forward, backward (from this run's o/lse). Returns the first failing status. */
static forkattn_status cc_run(forkattn_ctx *ctx, const cc_problem *p, tc_attn_out *o) {
  for (int i = 0; i < TC_NOUT; i++) tc_buf_poison(&o->buf[i]);
  forkattn_status st = forkattn_prefix_fwd(ctx, &p->layout, &p->q, &p->k, &p->v, &o->o, o->lse, p->scale,
                                           FORKATTN_MEMORY_HOST);
  if (st != FORKATTN_OK) return st;
  return forkattn_prefix_bwd(ctx, &p->layout, &p->q, &p->k, &p->v, &o->o, &p->dout, o->lse, &o->dq, &o->dk,
                             &o->dv, p->scale, FORKATTN_MEMORY_HOST);
}

/* Index of the first output that differs bitwise (guards included), or -1. */
static int cc_first_diff(const tc_attn_out *a, const tc_attn_out *b, size_t *elem) {
  for (int w = 0; w < TC_NOUT; w++) {
    const tc_buf *x = &a->buf[w], *y = &b->buf[w];
    if (memcmp(x->alloc, y->alloc, x->alloc_bytes) == 0) continue;
    const size_t es = ref_dtype_size(x->dtype);
    size_t i = 0;
    while (i < x->elems && memcmp((const char *)x->data + i * es, (const char *)y->data + i * es, es) == 0) i++;
    *elem = i; /* == elems: a guard byte differs */
    return w;
  }
  return -1;
}

static int cc_iters(void) {
  const char *e = getenv("FORKATTN_CONCURRENCY_ITERS");
  int n = e && *e ? atoi(e) : 20;
  return n > 0 ? n : 20;
}

/* ---- many contexts, many threads ------------------------------------------- */

typedef struct cc_worker {
  int index, threads, bind, iters;
  const cc_problem *p;
  const tc_attn_out *want;
  pthread_barrier_t *start; /* NULL in the OpenMP variant */
  /* results */
  forkattn_backend backend;
  forkattn_status status;
  int bad_iter, bad_out, runs;
  size_t bad_elem;
  char err[256];
} cc_worker;

static void cc_worker_run(cc_worker *w) {
  w->bad_iter = -1;
  w->bad_out = -1;
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.threads = w->threads;
  opt.bind_threads = w->bind;
  forkattn_ctx *ctx = NULL;
  if (w->start) pthread_barrier_wait(w->start); /* creation overlaps too */
  w->status = forkattn_ctx_create(&ctx, &opt);
  if (w->status != FORKATTN_OK) {
    snprintf(w->err, sizeof w->err, "ctx_create: %s", forkattn_ctx_create_error());
    return;
  }
  w->backend = forkattn_ctx_backend(ctx);
  tc_attn_out got;
  if (cc_out_init(&got, w->p)) {
    w->status = FORKATTN_ERR_OUT_OF_MEMORY;
    snprintf(w->err, sizeof w->err, "test buffers: out of memory");
    forkattn_ctx_destroy(ctx);
    return;
  }
  for (int it = 0; it < w->iters; it++) {
    w->status = cc_run(ctx, w->p, &got);
    if (w->status != FORKATTN_OK) {
      snprintf(w->err, sizeof w->err, "iteration %d: %s", it, forkattn_ctx_last_error(ctx));
      break;
    }
    w->runs++;
    int d = cc_first_diff(&got, w->want, &w->bad_elem);
    if (d >= 0) {
      w->bad_iter = it;
      w->bad_out = d;
      break;
    }
  }
  tc_attn_out_free(&got);
  forkattn_ctx_destroy(ctx);
}

static void *cc_worker_main(void *arg) {
  cc_worker_run(arg);
  return NULL;
}

typedef struct cc_setup {
  cc_problem p[CC_THREADS];
  tc_attn_out want[CC_THREADS];
  cc_worker w[CC_THREADS];
} cc_setup;

/* Draw the problems and compute the expected results serially with one
 * context of default options; then fill the worker descriptions. */
static void cc_prepare(cc_setup *s, const char *name) {
  memset(s, 0, sizeof *s);
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert_not_null(ctx, "%s: no context", name);
  char desc[256];
  for (int i = 0; i < CC_THREADS; i++) {
    cc_problem_random(&s->p[i], &rng);
    cr_assert_eq(cc_out_init(&s->want[i], &s->p[i]), 0, "out of memory");
    forkattn_status st = cc_run(ctx, &s->p[i], &s->want[i]);
    cr_assert_eq(st, FORKATTN_OK, "%s: serial run %d: %s", name, i, forkattn_ctx_last_error(ctx));
    for (int o = 0; o < TC_NOUT; o++) {
      tc_write_check wc = tc_buf_check(&s->want[i].buf[o]);
      cr_assert(wc.guard_bad == 0 && wc.unwritten == 0, "%s: serial run %d: %s: %zu guard bytes, %zu unwritten",
                name, i, tc_out_names[o], wc.guard_bad, wc.unwritten);
    }
    cc_describe(&s->p[i], desc, sizeof desc);
    s->w[i].index = i;
    s->w[i].threads = 1 + (i & 1);  /* 1, 2, 1, 2, ... */
    s->w[i].bind = (i >> 1) & 1;    /* 0, 0, 1, 1, 0, 0, 1, 1 */
    s->w[i].iters = cc_iters();
    s->w[i].p = &s->p[i];
    s->w[i].want = &s->want[i];
    fprintf(stderr, "%s: thread %d: threads=%d bind=%d %s\n", name, i, s->w[i].threads, s->w[i].bind, desc);
  }
  s->w[0].backend = forkattn_ctx_backend(ctx);
  forkattn_ctx_destroy(ctx);
}

static void cc_check(cc_setup *s, const char *name, forkattn_backend serial_backend, double seconds) {
  int runs = 0;
  for (int i = 0; i < CC_THREADS; i++) {
    const cc_worker *w = &s->w[i];
    cr_expect_eq(w->status, FORKATTN_OK, "%s: thread %d: %s: %s", name, i, forkattn_status_string(w->status),
                 w->err);
    cr_expect_eq(w->backend, serial_backend, "%s: thread %d ran on %s, the serial reference on %s", name, i,
                 forkattn_backend_name(w->backend), forkattn_backend_name(serial_backend));
    cr_expect(w->bad_iter < 0, "%s: thread %d (threads=%d bind=%d): iteration %d: %s differs from the serial result "
              "at element %zu%s", name, i, w->threads, w->bind, w->bad_iter, w->bad_out >= 0 ? tc_out_names[w->bad_out] : "?",
              w->bad_elem, w->bad_out >= 0 && w->bad_elem == s->want[i].buf[w->bad_out].elems ? " (guard)" : "");
    runs += w->runs;
  }
  fprintf(stderr, "%s: %d threads x %d iterations: %d fwd+bwd runs bitwise equal to the serial results (%.2f s)\n",
          name, CC_THREADS, s->w[0].iters, runs, seconds);
  for (int i = 0; i < CC_THREADS; i++) {
    tc_attn_out_free(&s->want[i]);
    cc_problem_free(&s->p[i]);
  }
}

Test(contexts, pthreads, .timeout = CC_TIMEOUT) {
  const char *name = "contexts/pthreads";
  static cc_setup s;
  cc_prepare(&s, name);
  const forkattn_backend serial = s.w[0].backend;
  pthread_barrier_t start;
  cr_assert_eq(pthread_barrier_init(&start, NULL, CC_THREADS), 0, "pthread_barrier_init");
  pthread_t tid[CC_THREADS];
  double t0 = tc_now();
  for (int i = 0; i < CC_THREADS; i++) {
    s.w[i].start = &start;
    cr_assert_eq(pthread_create(&tid[i], NULL, cc_worker_main, &s.w[i]), 0, "pthread_create");
  }
  for (int i = 0; i < CC_THREADS; i++) pthread_join(tid[i], NULL);
  double t = tc_now() - t0;
  pthread_barrier_destroy(&start);
  cc_check(&s, name, serial, t);
}

/* The library called from inside the user's own parallel region: its region
 * is nested (one thread unless nested parallelism is enabled), the results
 * must not change. */
Test(contexts, omp_region, .timeout = CC_TIMEOUT) {
  const char *name = "contexts/omp_region";
  static cc_setup s;
  cc_prepare(&s, name);
  const forkattn_backend serial = s.w[0].backend;
  double t0 = tc_now();
  int team = 0;
#pragma omp parallel num_threads(CC_THREADS)
  {
#pragma omp single
    team = omp_get_num_threads();
#pragma omp for schedule(static, 1)
    for (int i = 0; i < CC_THREADS; i++) cc_worker_run(&s.w[i]);
  }
  double t = tc_now() - t0;
  fprintf(stderr, "%s: outer team of %d threads, max active levels %d\n", name, team, omp_get_max_active_levels());
  cc_check(&s, name, serial, t);
}

/* Context creation/destruction from many threads at once (hwloc topology
 * loaded once, thread-local create errors). */
typedef struct cc_create_arg {
  pthread_barrier_t *start;
  int fails;
} cc_create_arg;

static void *cc_create_main(void *arg) {
  cc_create_arg *a = arg;
  pthread_barrier_wait(a->start);
  for (int it = 0; it < 50; it++) {
    forkattn_ctx_options opt;
    forkattn_ctx_options_init(&opt);
    opt.threads = it % 3; /* 0: one per physical core, from hwloc */
    opt.bind_threads = it & 1;
    forkattn_ctx *ctx = NULL;
    if (forkattn_ctx_create(&ctx, &opt) != FORKATTN_OK || forkattn_ctx_threads(ctx) < 1 ||
        forkattn_ctx_create_error()[0] != '\0')
      a->fails++;
    forkattn_ctx_destroy(ctx);
    opt.threads = -1; /* an error: its message is thread-local */
    if (forkattn_ctx_create(&ctx, &opt) != FORKATTN_ERR_INVALID_ARGUMENT || ctx != NULL ||
        strstr(forkattn_ctx_create_error(), "threads") == NULL)
      a->fails++;
  }
  return NULL;
}

Test(contexts, create_destroy, .timeout = CC_TIMEOUT) {
  /* Register this (main) thread with the OpenMP runtime before the workers do.
   * Otherwise the first worker becomes libomp's thread 0 and, when it exits,
   * LLVM's libomp with an OMPT tool attached (Archer, in the TSan run) crashes
   * in __kmpc_end_critical, which reads __kmp_threads[0] (a hard-coded gtid 0
   * in OMPT_LOAD_RETURN_ADDRESS(0); LLVM 19). Not a forkattn bug: see
   * docs/reliability.md, "Concurrency". */
  (void)omp_get_max_threads();
  pthread_barrier_t start;
  cc_create_arg arg[CC_THREADS];
  pthread_t tid[CC_THREADS];
  cr_assert_eq(pthread_barrier_init(&start, NULL, CC_THREADS), 0, "pthread_barrier_init");
  for (int i = 0; i < CC_THREADS; i++) {
    arg[i].start = &start;
    arg[i].fails = 0;
    cr_assert_eq(pthread_create(&tid[i], NULL, cc_create_main, &arg[i]), 0, "pthread_create");
  }
  for (int i = 0; i < CC_THREADS; i++) pthread_join(tid[i], NULL);
  pthread_barrier_destroy(&start);
  for (int i = 0; i < CC_THREADS; i++)
    cr_expect_eq(arg[i].fails, 0, "contexts/create_destroy: thread %d: %d unexpected create results", i,
                 arg[i].fails);
}

/* ---- OpenBLAS thread count: saved and restored across overlapping calls ------ */

typedef struct cc_blas_worker {
  const cc_problem *p;
  const tc_attn_out *want;
  pthread_barrier_t *start;
  int iters, threads, bad, failed;
} cc_blas_worker;

static void *cc_blas_main(void *arg) {
  cc_blas_worker *w = arg;
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = w->threads;
  forkattn_ctx *ctx = NULL;
  tc_attn_out got;
  pthread_barrier_wait(w->start);
  if (forkattn_ctx_create(&ctx, &opt) != FORKATTN_OK || cc_out_init(&got, w->p)) {
    w->failed = 1;
    forkattn_ctx_destroy(ctx);
    return NULL;
  }
  size_t elem;
  for (int it = 0; it < w->iters; it++) {
    if (cc_run(ctx, w->p, &got) != FORKATTN_OK) w->failed++;
    else if (cc_first_diff(&got, w->want, &elem) >= 0) w->bad++;
  }
  tc_attn_out_free(&got);
  forkattn_ctx_destroy(ctx);
  return NULL;
}

Test(blas, threads_restored, .timeout = CC_TIMEOUT) {
  const char *name = "blas/threads_restored";
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = 1;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK, "%s: %s", name, forkattn_ctx_create_error());
  tc_print_where(ctx, name);
  cr_assert_eq(forkattn_ctx_backend(ctx), FORKATTN_BACKEND_CPU, "%s: %s", name, forkattn_ctx_backend_reason(ctx));

  cc_problem p[2];
  tc_attn_out want[2];
  for (int i = 0; i < 2; i++) {
    cc_problem_random(&p[i], &rng);
    cr_assert_eq(cc_out_init(&want[i], &p[i]), 0, "out of memory");
    cr_assert_eq(cc_run(ctx, &p[i], &want[i]), FORKATTN_OK, "%s: %s", name, forkattn_ctx_last_error(ctx));
  }
  forkattn_ctx_destroy(ctx);

  /* a thread count other than 1, so that the library has something to save */
  openblas_set_num_threads(2);
  const int before = openblas_get_num_threads();
  fprintf(stderr, "%s: openblas_get_num_threads() = %d before\n", name, before);

  for (int round = 0; round < 3; round++) {
    pthread_barrier_t start;
    cr_assert_eq(pthread_barrier_init(&start, NULL, 2), 0, "pthread_barrier_init");
    /* round 0: equal lengths; 1, 2: one thread runs many more calls, so the
     * other's first/last call happens in the middle of its sequence */
    cc_blas_worker w[2] = {
        {&p[0], &want[0], &start, round == 1 ? 60 : 30, 1 + round % 2, 0, 0},
        {&p[1], &want[1], &start, round == 2 ? 60 : 30, 2 - round % 2, 0, 0},
    };
    pthread_t tid[2];
    for (int i = 0; i < 2; i++) cr_assert_eq(pthread_create(&tid[i], NULL, cc_blas_main, &w[i]), 0, "pthread_create");
    for (int i = 0; i < 2; i++) pthread_join(tid[i], NULL);
    pthread_barrier_destroy(&start);
    for (int i = 0; i < 2; i++) {
      cr_expect_eq(w[i].failed, 0, "%s: round %d thread %d: %d failed calls", name, round, i, w[i].failed);
      cr_expect_eq(w[i].bad, 0, "%s: round %d thread %d: %d runs differ from the serial result", name, round, i,
                   w[i].bad);
    }
    const int after = openblas_get_num_threads();
    cr_expect_eq(after, before, "%s: round %d: openblas_get_num_threads() = %d after, %d before", name, round,
                 after, before);
  }
  fprintf(stderr, "%s: openblas_get_num_threads() = %d after 3 rounds of overlapping calls\n", name,
          openblas_get_num_threads());
  for (int i = 0; i < 2; i++) {
    tc_attn_out_free(&want[i]);
    cc_problem_free(&p[i]);
  }
}
