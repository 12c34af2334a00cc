/* Argument checks at the API boundary. Each returns FORKATTN_OK or records a
 * message naming the offending argument and returns INVALID_ARGUMENT. */
#ifndef FORKATTN_VALIDATE_H
#define FORKATTN_VALIDATE_H
#include "context_internal.h"

#define FA_MAX_HEAD_DIM 256

/* t must be non-NULL with data aligned to its element size, a known dtype, the
 * given shape (rows, heads, head_dim) and strides that neither overlap nor
 * overflow int64. */
forkattn_status fa_check_tensor(forkattn_ctx *ctx, const char *name, const forkattn_tensor *t,
                                forkattn_dtype dtype, int64_t rows, int64_t heads,
                                int64_t head_dim);

/* q [q_rows, Hq, d] and k [k_rows, Hkv, d] of one attention side: non-NULL,
 * positive heads, Hq % Hkv == 0, 1 <= d <= 256, k in q's dtype; qn/kn name
 * them in messages. Fills *hq, *hkv, *d. */
forkattn_status fa_check_qk(forkattn_ctx *ctx, const char *qn, const char *kn, const forkattn_tensor *q,
                            const forkattn_tensor *k, int64_t q_rows, int64_t k_rows, int64_t *hq, int64_t *hkv,
                            int64_t *d);

/* q/k/v shapes of an attention call: positive heads, Hq % Hkv == 0, 1 <= d <= 256,
 * same dtype, rows given. Fills *hq, *hkv, *d. */
forkattn_status fa_check_qkv(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k,
                             const forkattn_tensor *v, int64_t rows, int64_t *hq, int64_t *hkv,
                             int64_t *d);

/* ptr (NULL passes: callers check presence) must be a multiple of align, the
 * size of the elements read or written through it: a misaligned load is
 * undefined behaviour in C and faults on some targets. */
forkattn_status fa_check_aligned(forkattn_ctx *ctx, const char *name, const void *ptr, size_t align);

/* scale must be finite and > 0. */
forkattn_status fa_check_scale(forkattn_ctx *ctx, float scale);

/* A forkattn_tree_layout (passed as void* to fit fa_layout_ops): offsets
 * non-decreasing from 0, parents -1 or < index. On success *rows = T. (tree.c) */
forkattn_status fa_check_tree_layout(forkattn_ctx *ctx, const void *layout, int64_t *rows);

/* Number of elements spanned by t (max offset + 1); t already checked. */
int64_t fa_tensor_span(const forkattn_tensor *t);

#endif
