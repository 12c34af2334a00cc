/* Calls ordered on a caller's CUDA stream (forkattn_ctx_set_stream).
 *
 * The offload runtime launches each target region on a stream of its own
 * and waits for it. With a stream set, the tensor-core attention calls on
 * device memory route their launches, and the plan copies those carry
 * (gpu_launch_copy.h), onto the caller's stream instead: the cuLaunchKernel
 * forwarder (gpu_team_memory.c) swaps the stream, the runtime then waits on
 * its own stream, which holds nothing, and the call returns while its
 * kernels are queued. Everything else a context does on the device (host
 * memory, the FP32 kernels, StreamKL, copies, frees, trimming the pool)
 * first waits for the caller's stream and then runs synchronously as
 * before, so its work stays in the stream's order.
 *
 * Routed kernels may not read anything the runtime copies for them
 * (firstprivate structs): the runtime frees that memory when its own stream
 * is done, before a routed kernel runs. They take their arguments from a
 * copy staged with the plan (is_device_ptr), and the plan's host pack is
 * pageable memory (the driver stages it before cuMemcpyHtoDAsync returns),
 * never the context's page-locked buffer the next call would overwrite.
 *
 * A routed call on a stream that is being captured (CUDA graphs) records
 * only its kernels: see fa_gpu_capturing(). The other calls refuse to be
 * captured with FORKATTN_ERR_UNSUPPORTED. */
#ifndef FORKATTN_GPU_STREAM_H
#define FORKATTN_GPU_STREAM_H
#include <stddef.h>

#include "context_internal.h"

/* 0 when launches can be routed to `stream` on OpenMP device `device` (the
 * forwarder is installed, the handle is a live stream of the device's
 * primary context, or one of CUDA's default-stream handles); else -1 and
 * *why says why, *invalid 1 for a bad handle (0: routing unavailable). */
int fa_gpu_stream_check(int device, void *stream, int *invalid, char *why, size_t len);

/* Wait for everything queued on `stream` of `device`: 0, or the driver's
 * error (an earlier routed kernel's fault shows here). A stream being
 * captured into a CUDA graph has nothing to wait for: 0 at once. */
int fa_gpu_stream_sync(int device, void *stream);

/* 1 when `stream` is recording into a CUDA graph (stream capture). */
int fa_gpu_stream_capturing(int device, void *stream);
/* 1 while this thread's call is being recorded into a CUDA graph (between
 * fa_gpu_stream_enter and _leave). Such a call's kernels run again at every
 * replay, long after it returned: its device memory is its own for the
 * context's life (gpu_stage.c), its plan is uploaded at once, and nothing a
 * kernel changes may need resetting between runs (no persistent grid). */
int fa_gpu_capturing(void);

/* Wait for ctx's stream when one is set (0 at once without): 0, or the driver's error. No message:
 * for callers that report it themselves, or cannot (the KV cache's concurrent inserts). */
static inline int fa_gpu_stream_wait(const forkattn_ctx *ctx) {
  return ctx->stream_set ? fa_gpu_stream_sync(ctx->device, ctx->stream) : 0;
}

/* At a call's start: route this thread's launches to ctx's stream when the
 * call can (`routable`: device memory, tensor-core kernels only), else wait
 * for ctx's stream. A call without a stream set does nothing. OK, or
 * FORKATTN_ERR_DEVICE (recorded on ctx) when the wait failed. */
forkattn_status fa_gpu_stream_enter(forkattn_ctx *ctx, int routable, const char *what);
/* At the call's end: stop routing. */
void fa_gpu_stream_leave(void);

/* run(ctx, args, memory, mma) between fa_gpu_stream_enter and _leave, routed when the call runs the
 * tensor-core kernels (mma) on device memory: those read nothing the runtime copies for them. */
typedef forkattn_status (*fa_gpu_stream_call)(forkattn_ctx *ctx, const void *args, forkattn_memory memory, int mma);
forkattn_status fa_gpu_stream_run(forkattn_ctx *ctx, fa_gpu_stream_call run, const void *args, forkattn_memory memory,
                                  int mma, const char *what);

#endif
