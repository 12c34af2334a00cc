/* GPU backend (OpenMP offload, LLVM/Clang): its table (backend.h) and the
 * entry points it holds. Only compiled in offload builds
 * (FORKATTN_HAVE_OFFLOAD). Never relies on the OpenMP host fallback: without
 * a usable device the context picks the CPU backend. */
#ifndef FORKATTN_GPU_BACKEND_H
#define FORKATTN_GPU_BACKEND_H
#include <stddef.h>

#include "backend.h"
#include "segment_attn.h"

extern const fa_backend fa_gpu_backend;

/* 1 when OpenMP device `device` exists and a probe kernel from our device
 * image really ran on it; *why says what was found either way. */
int fa_gpu_probe(int device, char *why, size_t len);

void *fa_gpu_malloc(int device, size_t bytes);
void fa_gpu_free(int device, void *p);
/* Copy bytes; *_dev says whether each side is device memory. 0 on success. */
int fa_gpu_memcpy(int device, void *dst, int dst_dev, const void *src, int src_dev, size_t bytes);

/* Reader rows per unit when heavily read key blocks are split over the dK/dV
 * teams (fa_plan_key_units, fa_plan_key_chunk) of the FP32 kernels (mma 0),
 * the tensor-core ones (1) or the two-warpgroup dK/dV (2): INT64_MAX when no
 * block needs it. Shared by the
 * attention and StreamKL dK passes (gpu_segment_bwd.c). */
int64_t fa_gpu_dkv_chunk(const fa_plan *p, const fa_block *kb, int64_t nkb, int64_t hkv, int mma);

forkattn_status fa_gpu_attn_fwd(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory);
forkattn_status fa_gpu_attn_bwd(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory);
forkattn_status fa_gpu_kl_fwd(forkattn_ctx *ctx, const struct fa_kl_call *c, forkattn_memory memory);
forkattn_status fa_gpu_kl_bwd(forkattn_ctx *ctx, const struct fa_kl_call *c, forkattn_memory memory);
/* Tensors in device memory of ctx->device (gpu_similarity.c). */
forkattn_status fa_gpu_kv_similarity(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                     double *sum);

#endif
