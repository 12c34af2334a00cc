/* Host-to-device copies that ride on the next kernel launch.
 *
 * A call's plan (segments, pairs, blocks, tensor maps) through
 * omp_target_memcpy would be one synchronous copy, whose wait costs about as
 * much as a whole empty launch (bench/launch_cost.c). Instead the stage
 * queues the copy here, and the cuLaunchKernel forwarder of
 * gpu_team_memory.c issues it with cuMemcpyHtoDAsync on the launch's own
 * stream just before the kernel: stream order puts the data in place before
 * the kernel starts, and the launch's synchronization covers the copy.
 *
 * The queue is per thread: the offload runtime launches a synchronous
 * target region from the thread that encounters it, so the next launch on
 * this thread is the calling library function's own. The host bytes must
 * stay valid and unchanged until that launch returns (gpu_stage.c holds a
 * packed copy until the call ends). Copies still queued when a call ends
 * (it launched nothing) are dropped: no kernel reads them. */
#ifndef FORKATTN_GPU_LAUNCH_COPY_H
#define FORKATTN_GPU_LAUNCH_COPY_H
#include <stddef.h>

/* Copies one launch may carry; a further one is refused (copied at once). */
#define FA_LAUNCH_COPIES 8

/* Once, from the forwarder's installation: the driver's cuMemcpyHtoDAsync
 * (NULL: queuing stays off). */
void fa_gpu_launch_copy_init(void *cu_memcpy_htod_async);

/* 1 when fa_gpu_launch_copy would queue a copy now (on, queue not full). */
int fa_gpu_launch_copy_room(void);

/* Queue bytes from host to dev for this thread's next launch: 1 queued,
 * 0 refused (off, or the queue is full): the caller copies itself. */
int fa_gpu_launch_copy(void *dev, const void *host, size_t bytes);

/* From the forwarder, before the kernel: issue this thread's queued copies
 * on `stream` and empty the queue. 0, or the driver's error of the first
 * copy that failed (the launch then reports it instead of starting). */
int fa_gpu_launch_copies_issue(void *stream);

/* Route this thread's launches, and the copies they carry, to `stream` (a
 * caller's CUDA stream, gpu_stream.h) until fa_gpu_launch_unroute. */
void fa_gpu_launch_route(void *stream);
void fa_gpu_launch_unroute(void);
/* 1 while this thread's launches are routed. */
int fa_gpu_launch_routed(void);
/* From the forwarder: the stream a launch the runtime put on `runtime_stream` goes to. */
void *fa_gpu_launch_stream(void *runtime_stream);

/* Drop the queued copies whose host bytes are among hosts[0..n) (an ended
 * call's that no launch took; another call's stay queued). */
void fa_gpu_launch_copies_drop(const void *const *hosts, int n);

#endif
