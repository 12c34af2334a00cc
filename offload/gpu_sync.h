/* How the host thread waits for the GPU. LLVM 19's CUDA plugin sets an
 * inactive primary context to CU_CTX_SCHED_BLOCKING_SYNC, so every
 * synchronous offload call sleeps until the GPU's completion interrupt wakes
 * it: tens of microseconds per kernel or copy on the H200 this was measured on
 * (docs/gpu-kernels.md), where CUDA's default (CU_CTX_SCHED_AUTO: spin while
 * there are fewer contexts than cores) answers in a few. FORKATTN_GPU_SYNC
 * picks the policy: auto (the default: a blocking-sync context becomes auto,
 * other flags a caller set are kept), spin, yield, blocking, or runtime
 * (leave the context as the runtime set it). */
#ifndef FORKATTN_GPU_SYNC_H
#define FORKATTN_GPU_SYNC_H

/* Apply the policy to OpenMP device `device` (its CUDA ordinal), once per
 * process and device; after the runtime has initialized the device. Does
 * nothing when the process has no CUDA driver loaded. */
void fa_gpu_sync_policy(int device);

#endif
