/* A caller's CUDA stream for a context's calls (gpu_stream.h), through the
 * CUDA driver the offload runtime already loaded (dlopen with RTLD_NOLOAD:
 * no new dependency). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>

#include "gpu_launch_copy.h"
#include "gpu_launch_direct.h"
#include "gpu_select.h"
#include "gpu_stream.h"
#include "gpu_team_memory.h"

#define FA_CUDA_ERROR_NOT_READY 600
/* CUDA's default-stream handles: 0 and CU_STREAM_LEGACY (the legacy stream), CU_STREAM_PER_THREAD */
#define FA_CU_STREAM_SPECIAL(s) ((uintptr_t)(s) <= 2)

typedef int (*fa_cu_device_get)(int *dev, int ordinal);
typedef int (*fa_cu_primary_retain)(void **ctx, int dev);
typedef int (*fa_cu_primary_release)(int dev);
typedef int (*fa_cu_ctx_push)(void *ctx);
typedef int (*fa_cu_ctx_pop)(void **ctx);
typedef int (*fa_cu_stream)(void *stream);
typedef int (*fa_cu_stream_ctx)(void *stream, void **ctx);
typedef int (*fa_cu_is_capturing)(void *stream, int *status);
typedef int (*fa_cu_capture_mode)(int *mode);

#define FA_CU_CAPTURE_ACTIVE 1
#define FA_CU_CAPTURE_MODE_RELAXED 2

static struct {
  fa_cu_device_get device_get;
  fa_cu_primary_retain retain;
  fa_cu_primary_release release;
  fa_cu_ctx_push push;
  fa_cu_ctx_pop pop;
  fa_cu_stream query, sync;
  fa_cu_stream_ctx stream_ctx;
  fa_cu_is_capturing is_capturing; /* NULL on drivers before CUDA 10: no capture to see */
  fa_cu_capture_mode exchange_mode;
} fa_cu;
static pthread_once_t fa_cu_once = PTHREAD_ONCE_INIT;
#define FA_STREAM_DEVICES 64
static _Atomic(void *) fa_cu_pctx[FA_STREAM_DEVICES]; /* retained once per device, kept for the process */

static void fa_cu_load(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) return;
  fa_cu.device_get = (fa_cu_device_get)dlsym(cuda, "cuDeviceGet");
  fa_cu.retain = (fa_cu_primary_retain)dlsym(cuda, "cuDevicePrimaryCtxRetain");
  fa_cu.release = (fa_cu_primary_release)dlsym(cuda, "cuDevicePrimaryCtxRelease_v2");
  fa_cu.push = (fa_cu_ctx_push)dlsym(cuda, "cuCtxPushCurrent_v2");
  fa_cu.pop = (fa_cu_ctx_pop)dlsym(cuda, "cuCtxPopCurrent_v2");
  fa_cu.query = (fa_cu_stream)dlsym(cuda, "cuStreamQuery");
  fa_cu.sync = (fa_cu_stream)dlsym(cuda, "cuStreamSynchronize");
  fa_cu.stream_ctx = (fa_cu_stream_ctx)dlsym(cuda, "cuStreamGetCtx");
  fa_cu.is_capturing = (fa_cu_is_capturing)dlsym(cuda, "cuStreamIsCapturing");
  fa_cu.exchange_mode = (fa_cu_capture_mode)dlsym(cuda, "cuThreadExchangeStreamCaptureMode");
  dlclose(cuda); /* the runtime keeps the driver loaded */
}

/* The device's primary context (the runtime's), retained once for the process: -1 without a driver. */
static int fa_cu_primary(int device, void **pctx) {
  pthread_once(&fa_cu_once, fa_cu_load);
  if (device < 0 || device >= FA_STREAM_DEVICES || !fa_cu.device_get || !fa_cu.retain || !fa_cu.release ||
      !fa_cu.push || !fa_cu.pop || !fa_cu.query || !fa_cu.sync || !fa_cu.stream_ctx)
    return -1;
  if ((*pctx = atomic_load(&fa_cu_pctx[device]))) return 0;
  int dev = 0;
  void *mine = NULL, *none = NULL;
  if (fa_cu.device_get(&dev, device) || fa_cu.retain(&mine, dev)) return -1;
  if (!atomic_compare_exchange_strong(&fa_cu_pctx[device], &none, mine)) fa_cu.release(dev); /* another thread's */
  *pctx = atomic_load(&fa_cu_pctx[device]);
  return 0;
}

/* (*f)(stream) with the device's primary context current (a default-stream handle means that
 * context's); f points into fa_cu, read once the driver's functions are loaded. */
static int fa_cu_on_stream(int device, const fa_cu_stream *f, void *stream) {
  void *pctx = NULL, *was = NULL;
  if (fa_cu_primary(device, &pctx)) return -1;
  if (fa_cu.push(pctx)) return -1;
  const int rc = (*f)(stream);
  fa_cu.pop(&was);
  return rc;
}

static _Thread_local int fa_capture_on;   /* this thread's call is being recorded into a CUDA graph */
static _Thread_local int fa_capture_mode; /* the thread's capture mode before the call relaxed it */

int fa_gpu_stream_capturing(int device, void *stream) {
  void *pctx = NULL, *was = NULL;
  int status = 0;
  if (fa_cu_primary(device, &pctx) || !fa_cu.is_capturing || fa_cu.push(pctx)) return 0;
  const int rc = fa_cu.is_capturing(stream, &status);
  fa_cu.pop(&was);
  return !rc && status == FA_CU_CAPTURE_ACTIVE;
}

int fa_gpu_capturing(void) { return fa_capture_on; }

/* Relaxed capture mode for this thread (the runtime's own synchronous copies, allocations and
 * stream waits are not part of the graph, and the global mode would refuse them); returns the
 * mode to restore, or -1 when the driver has no modes. */
static int fa_capture_relax(void) {
  int mode = FA_CU_CAPTURE_MODE_RELAXED;
  return fa_cu.exchange_mode && !fa_cu.exchange_mode(&mode) ? mode : -1;
}

static void fa_capture_restore(int mode) {
  if (mode >= 0 && fa_cu.exchange_mode) fa_cu.exchange_mode(&mode);
}

int fa_gpu_stream_check(int device, void *stream, int *invalid, char *why, size_t len) {
  void *pctx = NULL, *sctx = NULL;
  *invalid = 0;
  if (!fa_gpu_launch_forwarded()) {
    snprintf(why, len, "this offload runtime's launches cannot be routed (no cuLaunchKernel forwarder: "
                       "the runtime's driver table was not found)");
    return -1;
  }
  if (fa_cu_primary(device, &pctx)) {
    snprintf(why, len, "the CUDA driver's stream functions are unavailable");
    return -1;
  }
  *invalid = 1;
  /* a query would end a capture in progress (the graph then fails): a capturing stream is live */
  const int q = fa_gpu_stream_capturing(device, stream) ? 0 : fa_cu_on_stream(device, &fa_cu.query, stream);
  if (q && q != FA_CUDA_ERROR_NOT_READY) {
    snprintf(why, len, "%p is not a live CUDA stream (cuStreamQuery: error %d)", stream, q);
    return -1;
  }
  if (!FA_CU_STREAM_SPECIAL(stream) && (fa_cu.stream_ctx(stream, &sctx) || sctx != pctx)) {
    snprintf(why, len, "stream %p belongs to another CUDA context than device %d's primary context, "
                       "which the offload runtime launches in", stream, device);
    return -1;
  }
  *invalid = 0;
  return 0;
}

int fa_gpu_stream_sync(int device, void *stream) {
  /* nothing recorded in a capture runs before its graph is launched: there is nothing to wait for */
  if (fa_gpu_stream_capturing(device, stream)) return 0;
  const int mode = fa_capture_relax(); /* another stream of this thread may be capturing */
  const int rc = fa_cu_on_stream(device, &fa_cu.sync, stream);
  fa_capture_restore(mode);
  return rc;
}

forkattn_status fa_gpu_stream_enter(forkattn_ctx *ctx, int routable, const char *what) {
  if (!ctx->stream_set) return FORKATTN_OK;
#ifdef FA_GPU_TIMELINE
  routable = 0; /* the timeline's own regions, on the runtime's stream, read its buffer after each kernel */
#endif
  if (fa_gpu_stream_capturing(ctx->device, ctx->stream)) {
    if (!routable)
      return fa_fail(ctx, FORKATTN_ERR_UNSUPPORTED,
                     "%s: cannot be recorded in a CUDA graph: only the tensor-core attention kernels on device "
                     "memory are queued on the caller's stream (this call runs on the library's own stream)",
                     what);
    fa_capture_mode = fa_capture_relax();
    fa_capture_on = 1;
  }
  if (routable) {
    fa_gpu_launch_route(ctx->stream);
    fa_gpu_direct_enable(ctx->gpu && ctx->gpu->knobs.direct);
    return FORKATTN_OK;
  }
  const int rc = fa_gpu_stream_wait(ctx);
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "%s: waiting for the context's stream failed (CUDA error %d, "
                                                "an earlier call's kernel or the caller's own work)",
                      what, rc)
            : FORKATTN_OK;
}

void fa_gpu_stream_leave(void) {
  fa_gpu_launch_unroute();
  fa_gpu_direct_enable(0);
  if (fa_capture_on) fa_capture_restore(fa_capture_mode);
  fa_capture_on = 0;
}

forkattn_status fa_gpu_stream_run(forkattn_ctx *ctx, fa_gpu_stream_call run, const void *args, forkattn_memory memory,
                                  int mma, const char *what) {
  forkattn_status st = fa_gpu_stream_enter(ctx, mma && memory == FORKATTN_MEMORY_DEVICE, what);
  if (st) return st;
  st = run(ctx, args, memory, mma);
  fa_gpu_stream_leave();
  const int rc = fa_gpu_direct_error_take();
  if (rc && !st)
    st = fa_fail(ctx, FORKATTN_ERR_DEVICE, "%s: launching a kernel on the context's stream failed (CUDA error %d)",
                 what, rc);
  return st;
}
