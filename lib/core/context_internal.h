/* Internal view of a context and the error-reporting helpers every entry uses. */
#ifndef FORKATTN_CONTEXT_INTERNAL_H
#define FORKATTN_CONTEXT_INTERNAL_H
#include "forkattn.h"

#define FA_MSG_LEN 512

typedef struct fa_gpu_pool fa_gpu_pool;
struct fa_backend;
struct fa_plan_cache;
struct forkattn_ctx {
  forkattn_backend backend;      /* CPU or GPU, never AUTO */
  const struct fa_backend *ops;  /* that backend's operations (backend.h) */
  int device;               /* OpenMP device number (GPU backend) */
  int threads;              /* CPU worker threads */
  int bind_threads;         /* pin CPU workers with hwloc */
  int verbose;
  size_t peak_workspace;     /* bytes, see forkattn_ctx_peak_workspace() */
  char reason[FA_MSG_LEN];     /* why this backend */
  char last_error[FA_MSG_LEN]; /* message of the last failed call */
  struct fa_gpu_pool *gpu_pool; /* GPU backend's cached device blocks (offload/gpu_pool.h) */
  int stream_set;               /* calls are ordered on `stream` (forkattn_ctx_set_stream) */
  void *stream;                 /* the caller's CUDA stream (offload/gpu_stream.h) */
  struct fa_gpu_choice *gpu;    /* GPU backend's kernel choice, fixed at creation (offload/gpu_select.h) */
  char kernels[384];            /* the kernels its calls use, in words (forkattn_ctx_gpu_kernels) */
  int plan_cache_on;            /* reuse segment plans across calls (FORKATTN_PLAN_CACHE, lib/layout/plan_cache.h) */
  struct fa_plan_cache *plan_cache; /* made on first use */
};

/* Record a failure on ctx (may be NULL) and return status, printf-style. */
forkattn_status fa_fail(forkattn_ctx *ctx, forkattn_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Record that a call used `bytes` of scratch memory. */
void fa_note_workspace(forkattn_ctx *ctx, size_t bytes);

/* Before device work that cannot be ordered on the context's stream (copies,
 * frees, synchronous kernels): wait for the stream. OK at once without one;
 * FORKATTN_ERR_DEVICE (recorded as `what`'s failure) when the wait failed. */
forkattn_status fa_ctx_wait_stream(forkattn_ctx *ctx, const char *what);

/* Clear the last error at the start of a call. */
void fa_clear_error(forkattn_ctx *ctx);

#endif
