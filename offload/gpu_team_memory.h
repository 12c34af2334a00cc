/* Team memory past 48 KB under LLVM 19's offload runtime.
 *
 * A CUDA kernel may use more than 48 KB of dynamic shared memory only after
 * cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) raised its limit; LLVM
 * 19's CUDA plugin never does (newer LLVM does), so an `ompx_dyn_cgroup_mem`
 * above 48 KB fails at launch (design.md). The plugin calls the driver
 * through a table of pointers it filled with dlsym; fa_gpu_team_memory_init
 * replaces its cuLaunchKernel entry with a forwarder that first raises the
 * launched kernel's limit to the bytes it asks for, then checks the result
 * with a kernel that fills and reads back more than 48 KB of team memory.
 * The forwarder also issues the copies the calling thread queued for its
 * next launch (gpu_launch_copy.h) on the launch's stream, before the kernel,
 * and moves a routed call's launches to the caller's stream (gpu_stream.h).
 * A table it cannot find leaves the 48 KB limit (the kernels keep their
 * 48 KB shapes) and the copies synchronous; a failed check, the limit. */
#ifndef FORKATTN_GPU_TEAM_MEMORY_H
#define FORKATTN_GPU_TEAM_MEMORY_H
#include <stddef.h>

/* What every CUDA launch allows without the attribute. */
#define FA_GPU_TEAM_MEMORY_DEFAULT ((size_t)48 * 1024)

/* Once per process and device, after the runtime has initialized OpenMP
 * device `device` (its CUDA ordinal): install the forwarder and check it.
 * Returns the bytes of team memory a launch on the device may ask for. */
size_t fa_gpu_team_memory_init(int device);

/* The bytes fa_gpu_team_memory_init found for `device` (the 48 KB default
 * before it ran, or for a device it did not run on). */
size_t fa_gpu_team_memory(int device);

/* 1 once the forwarder sits in the runtime's table (launches can carry
 * copies and be routed to a caller's stream). */
int fa_gpu_launch_forwarded(void);

/* cuLaunchKernel of f (a kernel the runtime loaded: gpu_launch_direct.h) with `grid` teams of
 * `threads`, `smem` bytes of team memory and kernel parameters `params`, on `stream`, as the forwarder
 * makes the runtime's launches: this thread's queued copies first (gpu_launch_copy.h), the kernel's
 * team memory limit raised. 0, or the driver's error. */
int fa_gpu_launch_driver(void *f, unsigned grid, unsigned threads, unsigned smem, void *stream, void **params);

/* The device's multiprocessors, found with its team memory (0: unknown). */
int fa_gpu_sms(int device);

#endif
