/* The context's device-block cache (gpu_pool.h). */
#include <omp.h>
#include <stdint.h>

#include "alloc.h"
#include "context_internal.h"
#include "gpu_pool.h"
#include "gpu_stream.h"

#define FA_POOL_MAX 64 /* blocks; one call stages at most FA_STAGE_MAX */

typedef struct fa_pool_block {
  void *p;
  size_t bytes;
  int used;
} fa_pool_block;

struct fa_gpu_pool { /* typedef in context_internal.h */
  int n;
  fa_pool_block b[FA_POOL_MAX];
  void *pinned; /* page-locked host buffer (fa_gpu_pool_pinned) */
  size_t pinned_bytes;
  int pinned_used;
  void **kept; /* blocks of captured calls (fa_gpu_pool_keep), freed with the context */
  int nkept, kept_cap;
  size_t kept_bytes;
};

/* LLVM's offload runtime's page-locked host allocator (weak: other OpenMP
 * runtimes, such as GCC's for the host-only tests, lack it). */
void *llvm_omp_target_alloc_host(size_t size, int device_num) __attribute__((weak));
void llvm_omp_target_free_host(void *ptr, int device_num) __attribute__((weak));

/* The context's pool, made on first use (NULL when that allocation fails). */
static fa_gpu_pool *fa_pool_of(forkattn_ctx *ctx) {
  if (!ctx->gpu_pool) ctx->gpu_pool = fa_calloc(1, sizeof *ctx->gpu_pool);
  return ctx->gpu_pool;
}

static void fa_pool_drop(forkattn_ctx *ctx, int i) {
  fa_gpu_pool *pool = ctx->gpu_pool;
  omp_target_free(pool->b[i].p, ctx->device);
  pool->b[i] = pool->b[--pool->n];
}

/* Free the unused blocks (all of them, or the largest only). Unused is not idle while the
 * context's stream may still run kernels that read them: those finish first. */
static int fa_pool_trim(forkattn_ctx *ctx, int all) {
  fa_gpu_pool *pool = ctx->gpu_pool;
  int freed = 0;
  if (fa_gpu_stream_wait(ctx)) return 0;
  for (;;) {
    int pick = -1;
    for (int i = 0; i < pool->n; i++)
      if (!pool->b[i].used && (pick < 0 || pool->b[i].bytes > pool->b[pick].bytes)) pick = i;
    if (pick < 0) return freed;
    fa_pool_drop(ctx, pick);
    freed = 1;
    if (!all) return freed;
  }
}

void *fa_gpu_pool_get(forkattn_ctx *ctx, size_t bytes) {
  if (fa_alloc_inject_failure()) return NULL;
  if (!bytes) bytes = 1;
  fa_gpu_pool *pool = fa_pool_of(ctx);
  if (!pool) return NULL;
  /* best fit among unused blocks no more than twice (plus 64 KiB) too large */
  int pick = -1;
  for (int i = 0; i < pool->n; i++) {
    const fa_pool_block *b = &pool->b[i];
    if (!b->used && b->bytes >= bytes && b->bytes - bytes <= bytes + 65536 &&
        (pick < 0 || b->bytes < pool->b[pick].bytes))
      pick = i;
  }
  if (pick >= 0) {
    pool->b[pick].used = 1;
    return pool->b[pick].p;
  }
  if (pool->n == FA_POOL_MAX && !fa_pool_trim(ctx, 0)) return NULL;
  void *p = omp_target_alloc(bytes, ctx->device);
  if (!p && fa_pool_trim(ctx, 1)) p = omp_target_alloc(bytes, ctx->device);
  if (!p) return NULL;
  pool->b[pool->n++] = (fa_pool_block){p, bytes, 1};
  return p;
}

void fa_gpu_pool_put(forkattn_ctx *ctx, void *p) {
  fa_gpu_pool *pool = ctx->gpu_pool;
  if (!p || !pool) return;
  for (int i = 0; i < pool->n; i++)
    if (pool->b[i].p == p) {
      pool->b[i].used = 0;
      return;
    }
}

void *fa_gpu_pool_keep(forkattn_ctx *ctx, size_t bytes) {
  if (fa_alloc_inject_failure()) return NULL;
  if (!bytes) bytes = 1;
  fa_gpu_pool *pool = fa_pool_of(ctx);
  if (!pool) return NULL;
  if (pool->nkept == pool->kept_cap) {
    const int cap = pool->kept_cap ? 2 * pool->kept_cap : 16;
    void **grown = fa_malloc_array(cap, sizeof *grown);
    if (!grown) return NULL;
    for (int i = 0; i < pool->nkept; i++) grown[i] = pool->kept[i];
    fa_free(pool->kept);
    pool->kept = grown;
    pool->kept_cap = cap;
  }
  void *p = omp_target_alloc(bytes, ctx->device); /* new: no earlier kernel can still read it */
  if (!p) return NULL;
  pool->kept[pool->nkept++] = p;
  pool->kept_bytes += bytes;
  return p;
}

size_t fa_gpu_pool_kept_bytes(const forkattn_ctx *ctx) { return ctx->gpu_pool ? ctx->gpu_pool->kept_bytes : 0; }

void *fa_gpu_pool_pinned(forkattn_ctx *ctx, size_t bytes) {
  if (!llvm_omp_target_alloc_host || !llvm_omp_target_free_host) return NULL;
  fa_gpu_pool *pool = fa_pool_of(ctx);
  if (!pool) return NULL;
  if (pool->pinned_used) return NULL;
  if (pool->pinned_bytes < bytes) {
    if (pool->pinned) llvm_omp_target_free_host(pool->pinned, ctx->device);
    pool->pinned = llvm_omp_target_alloc_host(bytes, ctx->device);
    pool->pinned_bytes = pool->pinned ? bytes : 0;
    if (!pool->pinned) return NULL;
  }
  pool->pinned_used = 1;
  return pool->pinned;
}

void fa_gpu_pool_unpin(forkattn_ctx *ctx) {
  if (ctx->gpu_pool) ctx->gpu_pool->pinned_used = 0;
}

void fa_gpu_pool_destroy(forkattn_ctx *ctx) {
  if (!ctx->gpu_pool) return;
  if (ctx->gpu_pool->pinned) llvm_omp_target_free_host(ctx->gpu_pool->pinned, ctx->device);
  while (ctx->gpu_pool->n) fa_pool_drop(ctx, 0);
  for (int i = 0; i < ctx->gpu_pool->nkept; i++) omp_target_free(ctx->gpu_pool->kept[i], ctx->device);
  fa_free(ctx->gpu_pool->kept);
  fa_free(ctx->gpu_pool);
  ctx->gpu_pool = NULL;
}
