/* Staging of host tensors to dense device buffers and back. */
#include "alloc.h"
#include "dtype_convert.h"
#include "gpu_launch_copy.h"
#include "gpu_pool.h"
#include "gpu_stage.h"
#include "gpu_stream.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>


static int fa_dense(const forkattn_tensor *t) {
  return t->head_stride == t->head_dim && t->row_stride == t->heads * t->head_dim;
}

void fa_stage_init(fa_stage *s, forkattn_ctx *ctx, int host) {
  memset(s, 0, sizeof *s);
  s->ctx = ctx;
  s->device = ctx->device;
  s->host = host;
}

void *fa_stage_scratch(fa_stage *s, size_t bytes) {
  if (s->n == FA_STAGE_MAX) return NULL;
  /* a captured call's kernels run at every replay of its graph: their memory stays theirs */
  void *p = fa_gpu_capturing() ? fa_gpu_pool_keep(s->ctx, bytes) : fa_gpu_pool_get(s->ctx, bytes);
  if (p) {
    s->dev[s->n++] = p;
    s->bytes += bytes;
  }
  return p;
}

static int fa_put(fa_stage *s, void *dev, const void *host, size_t bytes) {
  if (bytes && omp_target_memcpy(dev, host, bytes, 0, 0, s->device, omp_get_initial_device())) {
    s->copy_failed = 1;
    return -1;
  }
  return 0;
}

static int fa_get(fa_stage *s, void *host, const void *dev, size_t bytes) {
  if (bytes && omp_target_memcpy(host, dev, bytes, 0, 0, omp_get_initial_device(), s->device)) {
    s->copy_failed = 1;
    return -1;
  }
  return 0;
}

forkattn_status fa_stage_status(const fa_stage *s) {
  return s->copy_failed ? FORKATTN_ERR_DEVICE : FORKATTN_ERR_OUT_OF_MEMORY;
}

void *fa_stage_array(fa_stage *s, const void *host, size_t bytes) {
  void *d = NULL;
  return fa_stage_arrays(s, 1, &host, &bytes, &d) ? NULL : d;
}

/* Host memory for a packed copy a launch carries: a slice of the context's page-locked buffer
 * (taken on the stage's first copy, FA_STAGE_CARRY_MAX bytes), else ordinary memory; *pinned says which.
 * A routed call packs into ordinary memory: the driver has read it when the launch returns, where the
 * page-locked buffer would be read when the stream gets there, after the next call rewrote it. */
static char *fa_stage_pack_buffer(fa_stage *s, size_t bytes, int *pinned) {
  if (!s->pinned && s->pinned_at == 0 && !fa_gpu_launch_routed()) {
    s->pinned = fa_gpu_pool_pinned(s->ctx, FA_STAGE_CARRY_MAX);
    if (!s->pinned) s->pinned_at = FA_STAGE_CARRY_MAX; /* taken or unavailable: not asked again */
  }
  *pinned = s->pinned && bytes <= FA_STAGE_CARRY_MAX - s->pinned_at;
  if (*pinned) {
    char *p = s->pinned + s->pinned_at;
    s->pinned_at += (bytes + 63) & ~(size_t)63;
    memset(p, 0, bytes);
    return p;
  }
  return fa_calloc(1, bytes ? bytes : 1);
}

static size_t fa_stage_block_bytes(int n, const size_t *bytes) {
  size_t total = 0;
  for (int i = 0; i < n; i++) total += (bytes[i] + 15) & ~(size_t)15;
  return total;
}

int fa_stage_reserve(fa_stage *s, int n, const size_t *bytes, void **dev) {
  char *d = fa_stage_scratch(s, fa_stage_block_bytes(n, bytes));
  if (!d) return -1;
  size_t at = 0;
  for (int i = 0; i < n; i++) {
    dev[i] = d + at;
    at += (bytes[i] + 15) & ~(size_t)15;
  }
  return 0;
}

int fa_stage_upload(fa_stage *s, int n, const void *const *host, const size_t *bytes, void *const *dev) {
  const size_t total = fa_stage_block_bytes(n, bytes);
  char *d = dev[0];
  /* carried by the next launch when it will take the copy; otherwise copied now, as without the queue.
   * A captured call copies now: its graph then holds only kernels, which read the same plan at every replay. */
  const int captured = fa_gpu_capturing();
  const int carry = !captured && total <= FA_STAGE_CARRY_MAX && s->ncarried < FA_STAGE_MAX && fa_gpu_launch_copy_room();
  /* A routed call's block may still be read by the stream's earlier kernels: a copy made now waits for them
   * (a captured call's block is new: nothing reads it yet). */
  if (!carry && !captured && fa_gpu_launch_routed() && fa_gpu_stream_wait(s->ctx)) {
    s->copy_failed = 1;
    return -1;
  }
  if (n == 1 && !carry) return fa_put(s, d, host[0], bytes[0]);
  int pinned = 0;
  char *pack = carry ? fa_stage_pack_buffer(s, total, &pinned) : fa_calloc(1, total ? total : 1);
  if (!pack) return -1; /* one host-to-device copy instead of n */
  for (int i = 0; i < n; i++)
    if (bytes[i]) memcpy(pack + ((char *)dev[i] - d), host[i], bytes[i]);
  if (carry && fa_gpu_launch_copy(d, pack, total)) { /* the launch's stream copies it: no wait of its own */
    s->in_pinned[s->ncarried] = (unsigned char)pinned;
    s->carried[s->ncarried++] = pack;
    return 0;
  }
  const int rc = fa_put(s, d, pack, total);
  if (!pinned) fa_free(pack);
  return rc;
}

int fa_stage_arrays(fa_stage *s, int n, const void *const *host, const size_t *bytes, void **dev) {
  return fa_stage_reserve(s, n, bytes, dev) || fa_stage_upload(s, n, host, bytes, dev) ? -1 : 0;
}

/* Copy between a strided host tensor and a dense host buffer. */
static void fa_pack(const forkattn_tensor *t, void *dense, int to_dense) {
  size_t es = fa_esize(t->dtype), vec = (size_t)t->head_dim * es;
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++) {
      char *strided = (char *)t->data + (size_t)(r * t->row_stride + h * t->head_stride) * es;
      char *packed = (char *)dense + (size_t)((r * t->heads + h) * t->head_dim) * es;
      if (to_dense) memcpy(packed, strided, vec);
      else memcpy(strided, packed, vec);
    }
}

int fa_stage_tensor(fa_stage *s, const forkattn_tensor *t, int copy, fa_dev_tensor *out) {
  out->dtype = (int)t->dtype;
  if (!s->host) {
    out->data = t->data;
    out->rs = t->row_stride;
    out->hs = t->head_stride;
    return 0;
  }
  size_t bytes; /* the element count fits int64 (t was validated), its bytes need not fit size_t */
  if (__builtin_mul_overflow((size_t)(t->rows * t->heads * t->head_dim), fa_esize(t->dtype), &bytes)) return -1;
  out->rs = t->heads * t->head_dim;
  out->hs = t->head_dim;
  out->data = fa_stage_scratch(s, bytes);
  if (!out->data) return -1;
  if (!copy) return 0;
  if (fa_dense(t)) return fa_put(s, out->data, t->data, bytes);
  void *tmp = fa_malloc(bytes);
  if (!tmp) return -1;
  fa_pack(t, tmp, 1);
  int rc = fa_put(s, out->data, tmp, bytes);
  fa_free(tmp);
  return rc;
}

int fa_stage_tensor_back(fa_stage *s, const forkattn_tensor *t, const fa_dev_tensor *dev) {
  if (!s->host) return 0;
  size_t bytes = (size_t)(t->rows * t->heads * t->head_dim) * fa_esize(t->dtype);
  if (fa_dense(t)) return fa_get(s, t->data, dev->data, bytes);
  void *tmp = fa_malloc(bytes);
  if (!tmp) return -1;
  int rc = fa_get(s, tmp, dev->data, bytes);
  if (!rc) fa_pack(t, tmp, 0);
  fa_free(tmp);
  return rc;
}

float *fa_stage_floats(fa_stage *s, float *p, size_t n, int copy) {
  if (!s->host) return p;
  size_t bytes;
  if (__builtin_mul_overflow(n, sizeof(float), &bytes)) return NULL;
  float *d = fa_stage_scratch(s, bytes);
  if (d && copy && fa_put(s, d, p, n * sizeof(float))) return NULL;
  return d;
}

int fa_stage_floats_back(fa_stage *s, float *host, const float *dev, size_t n) {
  return s->host ? fa_get(s, host, dev, n * sizeof(float)) : 0;
}

void fa_stage_free(fa_stage *s) {
  fa_gpu_launch_copies_drop((const void *const *)s->carried, s->ncarried); /* none, once a kernel launched */
  for (int i = 0; i < s->ncarried; i++)
    if (!s->in_pinned[i]) fa_free(s->carried[i]);
  s->ncarried = 0;
  if (s->pinned) fa_gpu_pool_unpin(s->ctx);
  s->pinned = NULL;
  s->pinned_at = 0;
  for (int i = 0; i < s->n; i++) fa_gpu_pool_put(s->ctx, s->dev[i]); /* kept blocks are not the pool's: ignored */
  s->n = 0;
}

/* Device copy of a kept mask: its byte maps staged, the struct's pointers
 * swapped for the device copies (pass it to kernels by value). host NULL
 * gives an all-zero *dev. 0, or -1 when staging failed. */
int fa_gpu_stage_kept(fa_stage *s, const fa_kept *host, fa_kept *dev) {
  memset(dev, 0, sizeof *dev);
  if (!host) return 0;
  *dev = *host;
  const int64_t keep = fa_kept_keep_bytes(host), block = fa_kept_block_bytes(host);
  dev->key_keep = keep > 0 ? fa_stage_array(s, host->key_keep, (size_t)keep) : NULL;
  dev->block = block > 0 ? fa_stage_array(s, host->block, (size_t)block) : NULL;
  return (keep > 0 && !dev->key_keep) || (block > 0 && !dev->block) ? -1 : 0;
}
