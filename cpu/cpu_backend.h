/* The CPU backend: its kernels' entry points and its table (backend.h).
 * Host pointers only: the API admits device memory on the GPU backend only,
 * so `memory` is always FORKATTN_MEMORY_HOST here. */
#ifndef FORKATTN_CPU_BACKEND_H
#define FORKATTN_CPU_BACKEND_H
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

extern const fa_backend fa_cpu_backend;

forkattn_status fa_cpu_attn_fwd(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory);
forkattn_status fa_cpu_attn_bwd(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory);
forkattn_status fa_cpu_kl_fwd(forkattn_ctx *ctx, const struct fa_kl_call *c, forkattn_memory memory);
forkattn_status fa_cpu_kl_bwd(forkattn_ctx *ctx, const struct fa_kl_call *c, forkattn_memory memory);

/* fa_backend.kv_scores (cpu_kv_score.c): two passes over f32 tiles on
 * OpenBLAS, each row's lse by an online softmax over key tiles, then P
 * recomputed tile by tile and summed per key in a fixed order. Extra memory:
 * (L - qlo) * Hq floats plus per-thread tiles. */
forkattn_status fa_cpu_kv_scores(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k, float scale,
                                 int64_t qlo, int64_t kend, double *score, size_t extra_bytes);

/* fa_backend.kv_similarity (cpu_kv_similarity.c): FORKATTN_OK or
 * OUT_OF_MEMORY (message recorded). */
forkattn_status fa_cpu_kv_similarity(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                     double *sum);

#endif
