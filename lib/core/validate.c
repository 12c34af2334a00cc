/* Argument checks at the API boundary. */
#include "validate.h"

#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"

static int fa_mul_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_mul_overflow(a, b, r); }
static int fa_add_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_add_overflow(a, b, r); }

int64_t fa_tensor_span(const forkattn_tensor *t) {
  if (t->rows == 0) return 0;
  return (t->rows - 1) * t->row_stride + (t->heads - 1) * t->head_stride + t->head_dim;
}

forkattn_status fa_check_tensor(forkattn_ctx *ctx, const char *name, const forkattn_tensor *t,
                                forkattn_dtype dtype, int64_t rows, int64_t heads,
                                int64_t head_dim) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!t) return fa_fail(ctx, bad, "%s: tensor descriptor is NULL", name);
  if (t->dtype != FORKATTN_DTYPE_F32 && t->dtype != FORKATTN_DTYPE_BF16 &&
      t->dtype != FORKATTN_DTYPE_F16)
    return fa_fail(ctx, bad, "%s: unknown dtype %d", name, (int)t->dtype);
  if (t->dtype != dtype)
    return fa_fail(ctx, bad, "%s: dtype %d differs from q's dtype %d (all tensors of a call share one dtype)",
                   name, (int)t->dtype, (int)dtype);
  if (t->rows < 0 || t->heads <= 0 || t->head_dim <= 0)
    return fa_fail(ctx, bad, "%s: sizes must be rows >= 0, heads > 0, head_dim > 0 (got %lld, %lld, %lld)",
                   name, (long long)t->rows, (long long)t->heads, (long long)t->head_dim);
  if (t->rows != rows)
    return fa_fail(ctx, bad, "%s: has %lld rows, the layout needs %lld", name, (long long)t->rows,
                   (long long)rows);
  if (t->heads != heads || t->head_dim != head_dim)
    return fa_fail(ctx, bad, "%s: shape [%lld heads, %lld dims] differs from the expected [%lld, %lld]",
                   name, (long long)t->heads, (long long)t->head_dim, (long long)heads,
                   (long long)head_dim);
  if (t->row_stride <= 0 || t->head_stride <= 0)
    return fa_fail(ctx, bad, "%s: strides must be positive (row_stride %lld, head_stride %lld)", name,
                   (long long)t->row_stride, (long long)t->head_stride);
  int64_t n, head_span, row_span, span;
  if (!fa_mul_ok(rows, heads, &n) || !fa_mul_ok(n, head_dim, &n))
    return fa_fail(ctx, bad, "%s: rows*heads*head_dim overflows int64", name);
  if (!fa_mul_ok(heads - 1, t->head_stride, &head_span) ||
      !fa_add_ok(head_span, head_dim, &head_span) ||
      !fa_mul_ok(rows > 0 ? rows - 1 : 0, t->row_stride, &row_span) ||
      !fa_add_ok(row_span, head_dim, &row_span) || !fa_add_ok(row_span, head_span, &span))
    return fa_fail(ctx, bad, "%s: strides make the tensor's extent overflow int64", name);
  /* Vectors (r, h) of head_dim elements must not overlap: either heads inside rows
   * (row-major) or rows inside heads (head-major). */
  int heads_inner = (heads == 1 || t->head_stride >= head_dim) &&
                    (rows <= 1 || t->row_stride >= head_span);
  int rows_inner = (rows <= 1 || t->row_stride >= head_dim) &&
                   (heads == 1 || t->head_stride >= row_span);
  if (!heads_inner && !rows_inner)
    return fa_fail(ctx, bad,
                   "%s: row_stride %lld / head_stride %lld make rows or heads overlap "
                   "(a row needs %lld elements with this head_stride)",
                   name, (long long)t->row_stride, (long long)t->head_stride, (long long)head_span);
  if (!t->data && n > 0) return fa_fail(ctx, bad, "%s: data pointer is NULL", name);
  return fa_check_aligned(ctx, name, t->data, fa_esize((int)t->dtype));
}

forkattn_status fa_check_aligned(forkattn_ctx *ctx, const char *name, const void *ptr, size_t align) {
  if (align > 1 && (uintptr_t)ptr % align)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT,
                   "%s: pointer %p is not aligned to its %zu-byte elements (misaligned by %zu bytes)", name, ptr,
                   align, (size_t)((uintptr_t)ptr % align));
  return FORKATTN_OK;
}

forkattn_status fa_check_qk(forkattn_ctx *ctx, const char *qn, const char *kn, const forkattn_tensor *q,
                            const forkattn_tensor *k, int64_t q_rows, int64_t k_rows, int64_t *hq, int64_t *hkv,
                            int64_t *d) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!q) return fa_fail(ctx, bad, "%s: tensor descriptor is NULL", qn);
  if (!k) return fa_fail(ctx, bad, "%s: tensor descriptor is NULL", kn);
  if (q->heads <= 0 || k->heads <= 0)
    return fa_fail(ctx, bad, "%s/%s: heads must be positive (%s %lld, %s %lld)", qn, kn, qn, (long long)q->heads, kn,
                   (long long)k->heads);
  if (q->heads % k->heads)
    return fa_fail(ctx, bad, "%s/%s: query heads %lld are not a multiple of KV heads %lld (GQA)", qn, kn,
                   (long long)q->heads, (long long)k->heads);
  if (q->head_dim <= 0 || q->head_dim > FA_MAX_HEAD_DIM)
    return fa_fail(ctx, bad, "%s: head_dim %lld outside the supported 1..%d", qn, (long long)q->head_dim,
                   FA_MAX_HEAD_DIM);
  forkattn_status st;
  if ((st = fa_check_tensor(ctx, qn, q, q->dtype, q_rows, q->heads, q->head_dim))) return st;
  if ((st = fa_check_tensor(ctx, kn, k, q->dtype, k_rows, k->heads, q->head_dim))) return st;
  *hq = q->heads;
  *hkv = k->heads;
  *d = q->head_dim;
  return FORKATTN_OK;
}

forkattn_status fa_check_qkv(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k,
                             const forkattn_tensor *v, int64_t rows, int64_t *hq, int64_t *hkv,
                             int64_t *d) {
  if (!v) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "v: tensor descriptor is NULL");
  forkattn_status st = fa_check_qk(ctx, "q", "k", q, k, rows, rows, hq, hkv, d);
  return st ? st : fa_check_tensor(ctx, "v", v, q->dtype, rows, *hkv, *d);
}

forkattn_status fa_check_scale(forkattn_ctx *ctx, float scale) {
  if (!(isfinite(scale) && scale > 0.0f))
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "scale: %g must be finite and > 0",
                   (double)scale);
  return FORKATTN_OK;
}
