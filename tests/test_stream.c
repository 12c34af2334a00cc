/* Calls ordered on a caller's CUDA stream (forkattn_ctx_set_stream).
 *
 * Everywhere: the API's errors (no context, a CPU context). [device only]
 * parts skip on a CPU context: queued tensor-core calls, with the host far
 * behind the GPU's work and alternating layouts (so every call's plan lands
 * in pool blocks the previous calls' kernels read), give bitwise the results
 * of the same calls made synchronously; a copy, and a call that runs
 * synchronously (the FP32 kernels), wait for the queued work they read; a
 * stream of another CUDA context is refused. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device_problem.h"
#include "test_common.h"

Test(stream, errors_without_a_gpu_context) {
  cr_assert_eq(forkattn_ctx_set_stream(NULL, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_eq(forkattn_ctx_clear_stream(NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_eq(forkattn_ctx_synchronize(NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU; /* explicit: FORKATTN_BACKEND (the GPU suite's gpu) does not apply */
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

/* forkattn_ctx_set_stream, or skip where this runtime's launches cannot be routed (UNSUPPORTED: the
 * launch forwarder could not be installed, offload/gpu_team_memory.h). */
static void set_stream_or_skip(forkattn_ctx *ctx, void *stream, const char *name) {
  const forkattn_status st = forkattn_ctx_set_stream(ctx, stream);
  if (st == FORKATTN_ERR_UNSUPPORTED) cr_skip_test("%s: %s", name, forkattn_ctx_last_error(ctx));
  cr_assert_eq(st, FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
}

Test(stream, queued_calls_match_synchronous_calls_bitwise) {
  dp_duo d;
  dp_duo_init(&d, "stream/queued");
  void *stream = new_stream(NULL);
  set_stream_or_skip(d.ctx, stream, "stream/queued");
  dp_queue_prologue(&d.pq, &d.a);
  const double t0 = tc_now();
  for (int i = 0; i < DP_SETS; i++) { /* alternating layouts: each call's plan differs from the last one's */
    dp_fwd(&d.pq, i % 2 ? &d.b : &d.a, &d.pq.set[i]);
    dp_bwd(&d.pq, i % 2 ? &d.b : &d.a, &d.pq.set[i]);
  }
  const double queued = tc_now() - t0;
  for (int i = 0; i < DP_SETS; i++) {
    dp_fwd(&d.ps, i % 2 ? &d.b : &d.a, &d.ps.set[i]);
    dp_bwd(&d.ps, i % 2 ? &d.b : &d.a, &d.ps.set[i]);
  }
  /* the last set first, without forkattn_ctx_synchronize: the copy itself waits for the stream */
  for (int i = DP_SETS - 1; i >= 0; i--)
    dp_assert_same(&d, i, i % 2 ? &d.b : &d.a, "queued results differ from synchronous ones");
  cr_log_info("stream/queued: %d forward+backward calls queued in %.3f ms of host time", DP_SETS, queued * 1e3);
  cr_assert_eq(forkattn_ctx_synchronize(d.ctx), FORKATTN_OK);
  cr_assert_eq(forkattn_ctx_clear_stream(d.ctx), FORKATTN_OK);
  destroy_stream(stream);
  dp_duo_free(&d);
}

/* A call that cannot be queued (here the FP32 backward, on a context created with
 * FORKATTN_GPU_KERNELS=fp32 and the same stream) waits for the queued forward whose o and lse it
 * reads; on CUDA's legacy default stream (NULL). */
Test(stream, a_synchronous_call_waits_for_the_queued_work_it_reads) {
  dp_duo d;
  dp_duo_init(&d, "stream/wait");
  set_stream_or_skip(d.ctx, NULL, "stream/wait");
  setenv("FORKATTN_GPU_KERNELS", "fp32", 1);
  forkattn_ctx *fp32 = tc_gpu_ctx_or_skip("stream/wait");
  unsetenv("FORKATTN_GPU_KERNELS");
  set_stream_or_skip(fp32, NULL, "stream/wait");
  dp_queue_prologue(&d.pq, &d.a);
  dp_fwd(&d.pq, &d.a, &d.pq.set[0]);
  dp_fwd(&d.ps, &d.a, &d.ps.set[0]);
  forkattn_ctx *const queued = d.pq.ctx, *const sync = d.ps.ctx;
  d.pq.ctx = d.ps.ctx = fp32; /* both backwards on the FP32 kernels, the first behind the queued forward */
  dp_bwd(&d.pq, &d.a, &d.pq.set[0]);
  dp_bwd(&d.ps, &d.a, &d.ps.set[0]);
  d.pq.ctx = queued, d.ps.ctx = sync;
  cr_assert_eq(forkattn_ctx_clear_stream(fp32), FORKATTN_OK);
  forkattn_ctx_destroy(fp32);
  cr_assert_eq(forkattn_ctx_clear_stream(d.ctx), FORKATTN_OK);
  dp_assert_same(&d, 0, &d.a, "the FP32 backward read the queued forward's o and lse too early");
  dp_duo_free(&d);
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

