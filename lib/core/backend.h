/* The backend interface: every operation lib/ asks of a compute backend, as
 * one table of function pointers. cpu/ (cpu_backend.c) and offload/
 * (gpu_backend.c) each fill one in; lib/ calls the tables only, through the
 * context (ctx->ops, chosen once by forkattn_ctx_create) or fa_backend_get().
 * backend.c is the one place that knows which tables this build has.
 *
 * Arguments reach a backend validated: shapes, strides, alignment and the
 * memory kind are checked by the API in lib/. A NULL entry means the backend
 * has no such operation; lib/ never calls it there (device memory, streams
 * and the teardown exist on the GPU backend only, KV scoring on the CPU). */
#ifndef FORKATTN_BACKEND_H
#define FORKATTN_BACKEND_H
#include <stddef.h>
#include <stdint.h>

#include "context_internal.h"
#include "segment_attn.h"

struct fa_kl_call; /* streamkl.h */

typedef struct fa_backend {
  forkattn_backend kind; /* CPU or GPU */

  /* 1 when the backend can run on OpenMP device `device`; *why says what was
   * found either way. NULL: always usable. */
  int (*probe)(int device, char *why, size_t len);

  /* Segment attention (segment_attn.h), also restricted to a kept set;
   * memory says where the tensors live. */
  forkattn_status (*attn_fwd)(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory);
  forkattn_status (*attn_bwd)(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory);

  /* StreamKL forward and backward of one resolved call (streamkl.h). */
  forkattn_status (*kl_fwd)(forkattn_ctx *ctx, const struct fa_kl_call *c, forkattn_memory memory);
  forkattn_status (*kl_bwd)(forkattn_ctx *ctx, const struct fa_kl_call *c, forkattn_memory memory);

  /* Attention-mass scores of the KV-cache policies, host tensors. For KV
   * head g and key j < kend (kend <= L = q->rows):
   *   score[g * kend + j] = sum over query rows i in [max(qlo, j), L) and the
   *                         query heads h of g of P_h(i, j),
   * P_h(i, .) = softmax over the keys 0..i of scale * q[i, h] . k[., g]. The
   * same for any thread count. score: [Hkv * kend], overwritten.
   * extra_bytes: the caller's scratch, recorded with the backend's as the
   * workspace. FORKATTN_OK or OUT_OF_MEMORY (message recorded). */
  forkattn_status (*kv_scores)(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k, float scale,
                               int64_t qlo, int64_t kend, double *score, size_t extra_bytes);

  /* sum[h] = sum over rows of the cosine of a[r, h] and b[r, h]
   * (kv_similarity.h) for validated, non-empty tensors of one shape in this
   * backend's memory. Bitwise reproducible on a backend. FORKATTN_OK,
   * OUT_OF_MEMORY or DEVICE (message recorded). */
  forkattn_status (*kv_similarity)(forkattn_ctx *ctx, const forkattn_tensor *a, const forkattn_tensor *b,
                                   double *sum);

  /* Device memory of OpenMP device `device`. mem_copy: *_dev says whether
   * each side is device memory; 0 on success. No context message: callers
   * from several threads at once use them. */
  void *(*mem_alloc)(int device, size_t bytes);
  void (*mem_free)(int device, void *p);
  int (*mem_copy)(int device, void *dst, int dst_dev, const void *src, int src_dev, size_t bytes);

  /* The caller's stream (forkattn_ctx_set_stream). stream_check: 0 when
   * `stream` can order the device's work, else *invalid (not a stream of the
   * device) and *why. stream_wait: wait for ctx's stream when one is set,
   * before work the library then does on its own stream, recording `what`'s
   * failure as FORKATTN_ERR_DEVICE; refused (FORKATTN_ERR_UNSUPPORTED) while
   * the stream records a CUDA graph, which that work would not be part of.
   * stream_wait_quiet: only the wait (nothing to wait for while the stream
   * records a graph), without a message (concurrent callers); non-zero on
   * failure. */
  int (*stream_check)(int device, void *stream, int *invalid, char *why, size_t len);
  forkattn_status (*stream_wait)(forkattn_ctx *ctx, const char *what);
  int (*stream_wait_quiet)(const forkattn_ctx *ctx);

  /* Set up a new context's backend state from its options (NULL: nothing to set up);
   * FORKATTN_OK, or a status with the reason in err. */
  forkattn_status (*ctx_init)(forkattn_ctx *ctx, const forkattn_ctx_options *o, char *err, size_t len);
  /* Release what the backend cached on ctx (after its stream was waited for); also after a
   * failed ctx_init. */
  void (*ctx_teardown)(forkattn_ctx *ctx);
} fa_backend;

/* The table of backend `kind` (CPU or GPU), or NULL when this build lacks it. */
const fa_backend *fa_backend_get(forkattn_backend kind);

#endif
