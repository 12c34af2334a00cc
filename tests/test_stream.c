/* Calls ordered on a caller's CUDA stream (forkattn_ctx_set_stream).
 *
 * Everywhere: the API's errors (no context, a CPU context). [device only]
 * parts skip on a CPU context: queued tensor-core calls, with the host far
 * behind the GPU's work and alternating layouts (so every call's plan lands
 * in pool blocks the previous calls' kernels read), give bitwise the results
 * of the same calls made synchronously; a copy, and a call that runs
 * synchronously (the FP32 kernels), wait for the queued work they read; a
 * stream of another CUDA context is refused, and so is any stream where the
 * launch forwarder is not installed. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_common.h"

Test(stream, errors_without_a_gpu_context) {
  cr_assert_eq(forkattn_ctx_set_stream(NULL, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_eq(forkattn_ctx_clear_stream(NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_eq(forkattn_ctx_synchronize(NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  unsetenv("FORKATTN_BACKEND"); /* the GPU suite sets it, and it overrides the option */
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK);
  cr_assert_eq(forkattn_ctx_set_stream(ctx, NULL), FORKATTN_ERR_BACKEND_UNAVAILABLE);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "CPU context has no stream"), "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_ctx_synchronize(ctx), FORKATTN_OK, "nothing queued: returns at once");
  cr_assert_eq(forkattn_ctx_clear_stream(ctx), FORKATTN_OK, "no stream: left as it is");
  forkattn_ctx_destroy(ctx);
}

/* ---- the CUDA driver, for the caller's side of the stream ---- */

typedef int (*cu_device_get)(int *dev, int ordinal);
typedef int (*cu_primary_retain)(void **ctx, int dev);
typedef int (*cu_ctx_create)(void **ctx, unsigned flags, int dev);
typedef int (*cu_ctx_destroy)(void *ctx);
typedef int (*cu_ctx_push)(void *ctx);
typedef int (*cu_ctx_pop)(void **ctx);
typedef int (*cu_stream_create)(void **stream, unsigned flags);
typedef int (*cu_stream_destroy)(void *stream);

static void *cuda_sym(const char *name) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD); /* the offload runtime loaded it */
  cr_assert_not_null(cuda, "a GPU context without the CUDA driver loaded");
  void *f = dlsym(cuda, name);
  dlclose(cuda);
  return f;
}

/* A new non-blocking stream of `cu_ctx` (NULL: device 0's primary context, the runtime's). */
static void *new_stream(void *cu_ctx) {
  void *pctx = cu_ctx, *was = NULL, *s = NULL;
  if (!pctx) {
    int dev = 0;
    cr_assert_eq(((cu_device_get)cuda_sym("cuDeviceGet"))(&dev, 0), 0);
    cr_assert_eq(((cu_primary_retain)cuda_sym("cuDevicePrimaryCtxRetain"))(&pctx, dev), 0);
  }
  cr_assert_eq(((cu_ctx_push)cuda_sym("cuCtxPushCurrent_v2"))(pctx), 0);
  cr_assert_eq(((cu_stream_create)cuda_sym("cuStreamCreate"))(&s, 1 /* CU_STREAM_NON_BLOCKING */), 0);
  ((cu_ctx_pop)cuda_sym("cuCtxPopCurrent_v2"))(&was);
  return s;
}

static void destroy_stream(void *s) { cr_assert_eq(((cu_stream_destroy)cuda_sym("cuStreamDestroy_v2"))(s), 0); }

/* ---- one GRPO-like problem in device memory ---- */

#define HQ 16
#define HKV 4
#define D 128
#define SETS 4 /* output sets: the queued calls' */

typedef struct lay {
  int64_t off[9];
  forkattn_prefix_layout l;
  int64_t T;
} lay;

/* A: a 1536-row prompt, 8 responses of 128; B: 1024 and 5 responses of mixed lengths (one empty). */
static void make_lays(lay *a, lay *b) {
  const int64_t la[8] = {128, 128, 128, 128, 128, 128, 128, 128}, lb[5] = {64, 200, 0, 128, 96};
  a->off[0] = b->off[0] = 0;
  for (int i = 0; i < 8; i++) a->off[i + 1] = a->off[i] + la[i];
  for (int i = 0; i < 5; i++) b->off[i + 1] = b->off[i] + lb[i];
  a->l = (forkattn_prefix_layout){1536, 8, a->off, FORKATTN_MASK_CAUSAL};
  b->l = (forkattn_prefix_layout){1024, 5, b->off, FORKATTN_MASK_CAUSAL};
  a->T = 1536 + a->off[8];
  b->T = 1024 + b->off[5];
}

typedef struct outs {
  void *o, *lse, *dq, *dk, *dv;
} outs;

typedef struct problem {
  forkattn_ctx *ctx;
  int64_t T; /* rows allocated: the larger layout's */
  void *q, *k, *v, *dout;
  outs set[SETS], scratch;
} problem;

static size_t rows_bytes(int64_t T, int64_t heads) { return (size_t)(T * heads * D) * 2; }

static void *dev_buf(forkattn_ctx *ctx, size_t bytes, const void *host) {
  void *p = NULL;
  cr_assert_eq(forkattn_device_malloc(ctx, bytes, &p), FORKATTN_OK);
  cr_assert_eq(forkattn_memcpy(ctx, p, FORKATTN_MEMORY_DEVICE, host, FORKATTN_MEMORY_HOST, bytes), FORKATTN_OK);
  return p;
}

/* Outputs poisoned with all-ones bytes (NaN in bf16 and f32): an element left unwritten shows. */
static void alloc_outs(forkattn_ctx *ctx, outs *s, int64_t T, const void *poison) {
  s->o = dev_buf(ctx, rows_bytes(T, HQ), poison);
  s->lse = dev_buf(ctx, sizeof(float) * (size_t)(T * HQ), poison);
  s->dq = dev_buf(ctx, rows_bytes(T, HQ), poison);
  s->dk = dev_buf(ctx, rows_bytes(T, HKV), poison);
  s->dv = dev_buf(ctx, rows_bytes(T, HKV), poison);
}

static void problem_init(problem *p, forkattn_ctx *ctx, int64_t T, const char *name) {
  p->ctx = ctx, p->T = T;
  tc_rng rng = tc_rng_for(name);
  tc_buf in;
  forkattn_tensor t = tc_buf_contiguous(&in, FORKATTN_DTYPE_BF16, T, HQ, D);
  unsigned char *poison = malloc(rows_bytes(T, HQ));
  cr_assert_not_null(poison);
  memset(poison, 0xff, rows_bytes(T, HQ));
  void **inputs[4] = {&p->q, &p->k, &p->v, &p->dout};
  const int64_t heads[4] = {HQ, HKV, HKV, HQ};
  for (int i = 0; i < 4; i++) {
    t.heads = heads[i], t.row_stride = heads[i] * D;
    tc_fill_tensor(&rng, &t, -1.0, 1.0);
    *inputs[i] = dev_buf(ctx, rows_bytes(T, heads[i]), in.data);
  }
  for (int i = 0; i < SETS; i++) alloc_outs(ctx, &p->set[i], T, poison);
  alloc_outs(ctx, &p->scratch, T, poison);
  free(poison);
  tc_buf_free(&in);
}

static void free_outs(forkattn_ctx *ctx, outs *s) {
  void *b[5] = {s->o, s->lse, s->dq, s->dk, s->dv};
  for (int i = 0; i < 5; i++) cr_assert_eq(forkattn_device_free(ctx, b[i]), FORKATTN_OK);
}

static void problem_free(problem *p) {
  void *b[4] = {p->q, p->k, p->v, p->dout};
  for (int i = 0; i < 4; i++) cr_assert_eq(forkattn_device_free(p->ctx, b[i]), FORKATTN_OK);
  for (int i = 0; i < SETS; i++) free_outs(p->ctx, &p->set[i]);
  free_outs(p->ctx, &p->scratch);
}

static forkattn_tensor tn(void *data, int64_t T, int64_t heads) {
  return forkattn_tensor_contiguous(data, FORKATTN_DTYPE_BF16, T, heads, D);
}

static void fwd(problem *p, const lay *L, outs *s) {
  const forkattn_tensor q = tn(p->q, L->T, HQ), k = tn(p->k, L->T, HKV), v = tn(p->v, L->T, HKV), o = tn(s->o, L->T, HQ);
  cr_assert_eq(forkattn_prefix_fwd(p->ctx, &L->l, &q, &k, &v, &o, s->lse, 0.08838835f, FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(p->ctx));
}

static void bwd(problem *p, const lay *L, outs *s) {
  const forkattn_tensor q = tn(p->q, L->T, HQ), k = tn(p->k, L->T, HKV), v = tn(p->v, L->T, HKV), o = tn(s->o, L->T, HQ),
                        dout = tn(p->dout, L->T, HQ), dq = tn(s->dq, L->T, HQ), dk = tn(s->dk, L->T, HKV),
                        dv = tn(s->dv, L->T, HKV);
  cr_assert_eq(forkattn_prefix_bwd(p->ctx, &L->l, &q, &k, &v, &o, &dout, s->lse, &dq, &dk, &dv, 0.08838835f,
                                   FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(p->ctx));
}

/* Set i's outputs of layout L on the host, in one block: o, lse, dq, dk, dv. */
static unsigned char *read_outs(problem *p, const outs *s, const lay *L, size_t *bytes) {
  const size_t n[5] = {rows_bytes(L->T, HQ), sizeof(float) * (size_t)(L->T * HQ), rows_bytes(L->T, HQ),
                       rows_bytes(L->T, HKV), rows_bytes(L->T, HKV)};
  const void *src[5] = {s->o, s->lse, s->dq, s->dk, s->dv};
  *bytes = n[0] + n[1] + n[2] + n[3] + n[4];
  unsigned char *h = malloc(*bytes), *at = h;
  cr_assert_not_null(h);
  for (int i = 0; i < 5; i++, at += n[i - 1])
    cr_assert_eq(forkattn_memcpy(p->ctx, at, FORKATTN_MEMORY_HOST, src[i], FORKATTN_MEMORY_DEVICE, n[i]), FORKATTN_OK,
                 "%s", forkattn_ctx_last_error(p->ctx));
  return h;
}

/* No all-ones 16-bit word (the poison; NaN in bf16) in o, dq, dk, dv of read_outs' block: every element
 * was written. (lse is f32: two of its bytes may be all ones.) */
static void assert_written(const unsigned char *h, const lay *L, const char *what) {
  const size_t n[5] = {rows_bytes(L->T, HQ), sizeof(float) * (size_t)(L->T * HQ), rows_bytes(L->T, HQ),
                       rows_bytes(L->T, HKV), rows_bytes(L->T, HKV)};
  const char *name[5] = {"o", "lse", "dq", "dk", "dv"};
  const int64_t heads[5] = {HQ, HQ, HQ, HKV, HKV};
  for (int t = 0; t < 5; h += n[t], t++) {
    if (t == 1) continue;
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < n[t]; i += 2)
      if (h[i] == 0xff && h[i + 1] == 0xff) bad++, first = first < 0 ? (int64_t)i / 2 : first;
    cr_assert_eq(bad, 0, "%s: %lld elements of %s unwritten, the first at row %lld head %lld col %lld", what,
                 (long long)bad, name[t], (long long)(first / (heads[t] * D)), (long long)(first / D % heads[t]),
                 (long long)(first % D));
  }
}

/* The context's calls queued behind 10 forwards of layout A, so the host runs far ahead of the GPU. */
static void queue_prologue(problem *p, const lay *a) {
  for (int i = 0; i < 10; i++) fwd(p, a, &p->scratch);
}

static forkattn_ctx *gpu_ctx_with_mma(const char *name) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip(name);
  const char *e = getenv("FORKATTN_GPU_MMA");
  if (e && !strcmp(e, "0")) {
    forkattn_ctx_destroy(ctx);
    cr_skip_test("%s: FORKATTN_GPU_MMA=0: no call can be queued", name);
  }
  return ctx;
}

/* forkattn_ctx_set_stream, or skip where this runtime's launches cannot be routed (UNSUPPORTED, e.g.
 * FORKATTN_GPU_TEAM_MEMORY=runtime: the test below checks that case). */
static void set_stream_or_skip(forkattn_ctx *ctx, void *stream, const char *name) {
  const forkattn_status st = forkattn_ctx_set_stream(ctx, stream);
  if (st == FORKATTN_ERR_UNSUPPORTED) cr_skip_test("%s: %s", name, forkattn_ctx_last_error(ctx));
  cr_assert_eq(st, FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
}

/* Two GPU contexts on the same inputs: one with synchronous calls (the reference), one to queue on a
 * stream. */
typedef struct duo {
  forkattn_ctx *sync_ctx, *ctx;
  lay a, b;
  problem ps, pq;
} duo;

static void duo_init(duo *d, const char *name) {
  d->sync_ctx = gpu_ctx_with_mma(name);
  d->ctx = tc_gpu_ctx_or_skip(name);
  make_lays(&d->a, &d->b);
  problem_init(&d->ps, d->sync_ctx, d->a.T, name);
  problem_init(&d->pq, d->ctx, d->a.T, name); /* the same seed: the same inputs */
}

static void duo_free(duo *d) {
  problem_free(&d->pq);
  problem_free(&d->ps);
  forkattn_ctx_destroy(d->ctx);
  forkattn_ctx_destroy(d->sync_ctx);
}

/* Output set i of layout L: the synchronous context's all written, the other's bitwise the same. */
static void assert_same(duo *d, int i, const lay *L, const char *what) {
  size_t n1, n2;
  unsigned char *want = read_outs(&d->ps, &d->ps.set[i], L, &n1), *got = read_outs(&d->pq, &d->pq.set[i], L, &n2);
  assert_written(want, L, L == &d->a ? "synchronous results, layout A" : "synchronous results, layout B");
  cr_assert(n1 == n2 && memcmp(want, got, n1) == 0, "set %d: %s", i, what);
  free(want);
  free(got);
}

Test(stream, queued_calls_match_synchronous_calls_bitwise) {
  duo d;
  duo_init(&d, "stream/queued");
  void *stream = new_stream(NULL);
  set_stream_or_skip(d.ctx, stream, "stream/queued");
  queue_prologue(&d.pq, &d.a);
  const double t0 = tc_now();
  for (int i = 0; i < SETS; i++) { /* alternating layouts: each call's plan differs from the last one's */
    fwd(&d.pq, i % 2 ? &d.b : &d.a, &d.pq.set[i]);
    bwd(&d.pq, i % 2 ? &d.b : &d.a, &d.pq.set[i]);
  }
  const double queued = tc_now() - t0;
  for (int i = 0; i < SETS; i++) {
    fwd(&d.ps, i % 2 ? &d.b : &d.a, &d.ps.set[i]);
    bwd(&d.ps, i % 2 ? &d.b : &d.a, &d.ps.set[i]);
  }
  /* the last set first, without forkattn_ctx_synchronize: the copy itself waits for the stream */
  for (int i = SETS - 1; i >= 0; i--) assert_same(&d, i, i % 2 ? &d.b : &d.a, "queued results differ from synchronous ones");
  cr_log_info("stream/queued: %d forward+backward calls queued in %.3f ms of host time", SETS, queued * 1e3);
  cr_assert_eq(forkattn_ctx_synchronize(d.ctx), FORKATTN_OK);
  cr_assert_eq(forkattn_ctx_clear_stream(d.ctx), FORKATTN_OK);
  destroy_stream(stream);
  duo_free(&d);
}

/* A call that cannot be queued (here the FP32 backward, FORKATTN_GPU_MMA=0) waits for the queued forward
 * whose o and lse it reads; on CUDA's legacy default stream (NULL). */
Test(stream, a_synchronous_call_waits_for_the_queued_work_it_reads) {
  duo d;
  duo_init(&d, "stream/wait");
  set_stream_or_skip(d.ctx, NULL, "stream/wait");
  queue_prologue(&d.pq, &d.a);
  fwd(&d.pq, &d.a, &d.pq.set[0]);
  fwd(&d.ps, &d.a, &d.ps.set[0]);
  setenv("FORKATTN_GPU_MMA", "0", 1);
  bwd(&d.pq, &d.a, &d.pq.set[0]);
  bwd(&d.ps, &d.a, &d.ps.set[0]);
  unsetenv("FORKATTN_GPU_MMA");
  cr_assert_eq(forkattn_ctx_clear_stream(d.ctx), FORKATTN_OK);
  assert_same(&d, 0, &d.a, "the FP32 backward read the queued forward's o and lse too early");
  duo_free(&d);
}

Test(stream, a_stream_of_another_cuda_context_is_refused) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip("stream/other_context");
  set_stream_or_skip(ctx, NULL, "stream/other_context"); /* streams can be set here at all */
  cr_assert_eq(forkattn_ctx_clear_stream(ctx), FORKATTN_OK);
  cu_ctx_create create = (cu_ctx_create)cuda_sym("cuCtxCreate_v2");
  if (!create) {
    forkattn_ctx_destroy(ctx);
    cr_skip_test("this CUDA driver has no cuCtxCreate_v2");
  }
  int dev = 0;
  void *other = NULL, *was = NULL;
  cr_assert_eq(((cu_device_get)cuda_sym("cuDeviceGet"))(&dev, 0), 0);
  cr_assert_eq(create(&other, 0, dev), 0);
  ((cu_ctx_pop)cuda_sym("cuCtxPopCurrent_v2"))(&was); /* cuCtxCreate made it current */
  void *s = new_stream(other);
  cr_assert_eq(forkattn_ctx_set_stream(ctx, s), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "another CUDA context"), "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_ctx_synchronize(ctx), FORKATTN_OK, "the refused stream was not taken");
  destroy_stream(s);
  cr_assert_eq(((cu_ctx_destroy)cuda_sym("cuCtxDestroy_v2"))(other), 0);
  forkattn_ctx_destroy(ctx);
}

/* Without the launch forwarder (the runtime's driver table left alone) nothing can move a launch to
 * another stream: set_stream says so, and the context stays synchronous. [device only] */
Test(stream, without_the_launch_forwarder_a_stream_is_unsupported) {
  setenv("FORKATTN_GPU_TEAM_MEMORY", "runtime", 1); /* before this process's first probe */
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip("stream/no_forwarder");
  cr_assert_eq(forkattn_ctx_set_stream(ctx, NULL), FORKATTN_ERR_UNSUPPORTED);
  cr_assert(strstr(forkattn_ctx_last_error(ctx), "cannot be routed"), "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_ctx_synchronize(ctx), FORKATTN_OK, "no stream was set");
  forkattn_ctx_destroy(ctx);
}
