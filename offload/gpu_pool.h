/* A context's cache of device blocks. The GPU backend takes every call's
 * device scratch (plan arrays, row sums, partial dK/dV, staged host tensors)
 * from it and gives it back at the end of the call, so a training loop's
 * repeated calls allocate nothing after the first: omp_target_alloc and
 * omp_target_free cost tens of microseconds each, and a free synchronizes
 * the device. Blocks stay cached until forkattn_ctx_destroy(); when an
 * allocation fails, the unused cached blocks are freed and it is tried again.
 * Not thread-safe, like its context. */
#ifndef FORKATTN_GPU_POOL_H
#define FORKATTN_GPU_POOL_H
#include <stddef.h>

#include "context_internal.h"

/* A device block of at least `bytes` (NULL when the device is out of memory
 * or FORKATTN_ALLOC_FAIL injects a failure). */
void *fa_gpu_pool_get(forkattn_ctx *ctx, size_t bytes);
/* Give back a block from fa_gpu_pool_get (NULL is ignored). */
void fa_gpu_pool_put(forkattn_ctx *ctx, void *p);
/* A new device block of at least `bytes` that stays allocated until the
 * context is destroyed, for a call recorded into a CUDA graph: the graph's
 * kernels read and write it at every replay (NULL when out of memory). */
void *fa_gpu_pool_keep(forkattn_ctx *ctx, size_t bytes);
/* Bytes of the blocks fa_gpu_pool_keep gave out. */
size_t fa_gpu_pool_kept_bytes(const forkattn_ctx *ctx);
/* The context's page-locked host buffer of at least `bytes`, for the plan
 * copies a call's launch carries (gpu_stage.c): from page-locked memory the
 * driver's asynchronous copy is a DMA queued behind the launch, where from
 * ordinary memory it first copies into a staging buffer and waits. NULL
 * when it is taken (until fa_gpu_pool_unpin) or the runtime has no
 * page-locked allocator: the caller packs into ordinary memory. */
void *fa_gpu_pool_pinned(forkattn_ctx *ctx, size_t bytes);
/* Give the page-locked buffer back (its copies have completed). */
void fa_gpu_pool_unpin(forkattn_ctx *ctx);
/* Free every block and the page-locked buffer (all must have been given back). */
void fa_gpu_pool_destroy(forkattn_ctx *ctx);

#endif
