/* K/V buffers of the KV cache's entries: allocation in the cache's memory and
 * copies of (possibly strided) host or device tensors into them. No lock, no
 * context messages: concurrent inserts call these at the same time. Device
 * memory goes through the backend's allocator and copies directly rather than
 * forkattn_device_malloc()/forkattn_memcpy(), which clear the context's
 * message (a write other threads' cache calls would race with). Device work
 * waits for the context's stream first: queued kernels may write what it
 * copies or read what it frees. Device caches exist on the GPU backend only. */
#include <string.h>

#include "alloc.h"
#include "backend.h"
#include "dtype_convert.h"
#include "kv_cache_internal.h"

void *fa_kv_data_alloc(const forkattn_kv_cache *c, size_t bytes) {
  if (c->opt.memory == FORKATTN_MEMORY_HOST) return fa_aligned_alloc(bytes);
  return c->ctx->ops->mem_alloc(c->ctx->device, bytes);
}

void fa_kv_data_free(const forkattn_kv_cache *c, void *data) {
  if (!data) return;
  if (c->opt.memory == FORKATTN_MEMORY_HOST) {
    fa_free(data);
    return;
  }
  const fa_backend *ops = c->ctx->ops;
  ops->stream_wait_quiet(c->ctx); /* a failed wait: the device is lost, the free goes ahead */
  ops->mem_free(c->ctx->device, data);
}

/* bytes from src to dst, each side host or device; 0 or -1. */
static int fa_kv_move(const forkattn_kv_cache *c, void *dst, int dst_dev, const void *src, int src_dev, size_t bytes) {
  if (!dst_dev && !src_dev) {
    memcpy(dst, src, bytes);
    return 0;
  }
  const fa_backend *ops = c->ctx->ops;
  return ops->stream_wait_quiet(c->ctx) || ops->mem_copy(c->ctx->device, dst, dst_dev, src, src_dev, bytes) ? -1 : 0;
}

/* Copy t into dst ([rows, heads, d] contiguous) in the fewest pieces its
 * strides allow: all at once, a row at a time, or a head vector at a time. */
static int fa_kv_gather(const forkattn_kv_cache *c, void *dst, int dst_dev, const forkattn_tensor *t, int src_dev) {
  const size_t es = fa_esize(t->dtype), vec = (size_t)t->head_dim * es, row = (size_t)t->heads * vec;
  const int64_t n = t->rows, H = t->heads, d = t->head_dim;
  const int heads_packed = H == 1 || t->head_stride == d;
  const int rows_packed = heads_packed && (n == 1 || t->row_stride == H * d);
  const char *src = t->data;
  char *out = dst;
  if (rows_packed) return fa_kv_move(c, out, dst_dev, src, src_dev, (size_t)n * row);
  for (int64_t r = 0; r < n; r++) {
    if (heads_packed) {
      if (fa_kv_move(c, out + (size_t)r * row, dst_dev, src + (size_t)(r * t->row_stride) * es, src_dev, row))
        return -1;
      continue;
    }
    for (int64_t h = 0; h < H; h++)
      if (fa_kv_move(c, out + (size_t)r * row + (size_t)h * vec, dst_dev,
                     src + (size_t)(r * t->row_stride + h * t->head_stride) * es, src_dev, vec))
        return -1;
  }
  return 0;
}

forkattn_status fa_kv_copy_in(const forkattn_kv_cache *c, void *dst, const forkattn_tensor *t,
                              forkattn_memory memory) {
  const int dst_dev = c->opt.memory == FORKATTN_MEMORY_DEVICE, src_dev = memory == FORKATTN_MEMORY_DEVICE;
  const int64_t H = t->heads, d = t->head_dim;
  const int contiguous = (H == 1 || t->head_stride == d) && (t->rows == 1 || t->row_stride == H * d);
  if (dst_dev && !src_dev && !contiguous) {
    /* strided host rows into device memory: pack on the host, then one copy */
    const size_t bytes = (size_t)(t->rows * H * d) * fa_esize(t->dtype);
    void *stage = fa_malloc(bytes);
    if (!stage) return FORKATTN_ERR_OUT_OF_MEMORY;
    int bad = fa_kv_gather(c, stage, 0, t, 0) || fa_kv_move(c, dst, 1, stage, 0, bytes);
    fa_free(stage);
    return bad ? FORKATTN_ERR_DEVICE : FORKATTN_OK;
  }
  return fa_kv_gather(c, dst, dst_dev, t, src_dev) ? FORKATTN_ERR_DEVICE : FORKATTN_OK;
}
