/* Attention-mass scores of the KV-cache policies (kv_policy.c), streamed over
 * f32 tiles on OpenBLAS: no rows x keys buffer. */
#ifndef FORKATTN_KV_SCORE_H
#define FORKATTN_KV_SCORE_H
#include <stddef.h>
#include <stdint.h>

#include "context_internal.h"

/* For KV head g and key j < kend (kend <= L = q->rows):
 *   score[g * kend + j] = sum over query rows i in [max(qlo, j), L) and the
 *                         query heads h of g of P_h(i, j),
 * P_h(i, .) = softmax over the keys 0..i of scale * q[i, h] . k[., g] (the
 * row's ordinary causal softmax). Two passes: each row's lse by an online
 * softmax over key tiles, then P recomputed tile by tile from it and summed
 * per key in a fixed order (bitwise the same for any thread count). Extra
 * memory: (L - qlo) * Hq floats plus per-thread tiles.
 * q, k: validated host tensors; score: [Hkv * kend], overwritten.
 * extra_bytes: the caller's scratch, recorded with ours as the workspace.
 * Returns FORKATTN_OK or FORKATTN_ERR_OUT_OF_MEMORY (message recorded). */
forkattn_status fa_kv_scores(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k,
                             float scale, int64_t qlo, int64_t kend, double *score, size_t extra_bytes);

/* out[j] = sum of a[j'] over |j' - j| <= kernel / 2 and 0 <= j' < n (kernel
 * odd >= 1). scratch: n + 1 doubles (prefix sums for wide kernels). Windows
 * clamped to the same range give bitwise equal sums. */
void fa_kv_pool(const double *a, int64_t n, int64_t kernel, double *out, double *scratch);

#endif
