/* Device memory entry points, on the context's backend (backend.h). */
#include <string.h>

#include "backend.h"

static forkattn_status fa_need_gpu(forkattn_ctx *ctx, const char *fn) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  if (ctx->backend != FORKATTN_BACKEND_GPU)
    return fa_fail(ctx, FORKATTN_ERR_BACKEND_UNAVAILABLE, "%s: needs the gpu backend, this context uses %s",
                   fn, forkattn_backend_name(ctx->backend));
  return FORKATTN_OK;
}

forkattn_status forkattn_device_malloc(forkattn_ctx *ctx, size_t bytes, void **ptr) {
  forkattn_status st = fa_need_gpu(ctx, "device_malloc");
  if (st) return st;
  if (!ptr) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "device_malloc: ptr is NULL");
  *ptr = ctx->ops->mem_alloc(ctx->device, bytes ? bytes : 1);
  return *ptr ? FORKATTN_OK
              : fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "device_malloc: %zu bytes failed", bytes);
}

forkattn_status forkattn_device_free(forkattn_ctx *ctx, void *ptr) {
  forkattn_status st = fa_need_gpu(ctx, "device_free");
  if (st || !ptr) return st;
  if ((st = fa_ctx_wait_stream(ctx, "device_free"))) return st; /* queued kernels may still read it */
  ctx->ops->mem_free(ctx->device, ptr);
  return FORKATTN_OK;
}

forkattn_status forkattn_memcpy(forkattn_ctx *ctx, void *dst, forkattn_memory dst_memory,
                                const void *src, forkattn_memory src_memory, size_t bytes) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  if ((!dst || !src) && bytes)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "memcpy: %s is NULL", dst ? "src" : "dst");
  int dev_dst = dst_memory == FORKATTN_MEMORY_DEVICE, dev_src = src_memory == FORKATTN_MEMORY_DEVICE;
  if ((dst_memory != FORKATTN_MEMORY_HOST && !dev_dst) || (src_memory != FORKATTN_MEMORY_HOST && !dev_src))
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "memcpy: unknown memory kind");
  if (!dev_dst && !dev_src) {
    if (bytes) memmove(dst, src, bytes);
    return FORKATTN_OK;
  }
  forkattn_status st = fa_need_gpu(ctx, "memcpy");
  if (st) return st;
  if (bytes && (st = fa_ctx_wait_stream(ctx, "memcpy"))) return st;
  if (ctx->ops->mem_copy(ctx->device, dst, dev_dst, src, dev_src, bytes))
    return fa_fail(ctx, FORKATTN_ERR_DEVICE, "memcpy: device copy of %zu bytes failed", bytes);
  return FORKATTN_OK;
}
