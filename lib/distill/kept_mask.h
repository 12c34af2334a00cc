/* Kept-set mask (KV compression, shadow mask) in the form kernels read: a
 * per-head key-keep byte map over the compressed rows and an optional 64x64
 * block mask, both combined with the layout's own mask. Shared by the CPU and
 * GPU kernels (declare target), built from forkattn_kept_set by kept_set.c. */
#ifndef FORKATTN_KEPT_MASK_H
#define FORKATTN_KEPT_MASK_H
#include <stdint.h>

#include "forkattn.h"

typedef struct fa_kept {
  int64_t heads;                 /* kept heads */
  int64_t heads_div;             /* query head h reads kept head h / heads_div */
  int64_t compressed_rows;       /* key_keep covers key rows [0, compressed_rows) */
  int64_t query_start;           /* key_keep filters query rows >= query_start */
  int64_t nb;                    /* blocks per side of the block mask */
  const unsigned char *key_keep; /* [kept heads, compressed_rows] or NULL */
  const unsigned char *block;    /* [kept heads, nb, nb] or NULL */
} fa_kept;

#pragma omp declare target
/* Does query head h at packed row qrow keep key row krow? (The layout's mask
 * is applied separately.) k NULL keeps everything. */
static inline int fa_kept_visible(const fa_kept *k, int64_t h, int64_t qrow, int64_t krow) {
  if (!k) return 1;
  const int64_t kh = h / k->heads_div;
  if (k->block && !k->block[(kh * k->nb + qrow / FORKATTN_KEPT_BLOCK) * k->nb + krow / FORKATTN_KEPT_BLOCK])
    return 0;
  if (k->key_keep && qrow >= k->query_start && krow < k->compressed_rows &&
      !k->key_keep[kh * k->compressed_rows + krow])
    return 0;
  return 1;
}

/* 1 when the block mask alone drops every (query, key) of the tile rows
 * [q0, q0+qn) x keys [k0, k0+kn) for query heads [h0, h1): the tile can be
 * skipped without computing scores. */
static inline int fa_kept_tile_dropped(const fa_kept *k, int64_t h0, int64_t h1, int64_t q0, int64_t qn,
                                       int64_t k0, int64_t kn) {
  if (!k || !k->block || qn <= 0 || kn <= 0) return 0;
  const int64_t B = FORKATTN_KEPT_BLOCK;
  for (int64_t h = h0; h < h1; h++) {
    const int64_t kh = h / k->heads_div;
    for (int64_t i = q0 / B; i <= (q0 + qn - 1) / B; i++)
      for (int64_t j = k0 / B; j <= (k0 + kn - 1) / B; j++)
        if (k->block[(kh * k->nb + i) * k->nb + j]) return 0;
  }
  return 1;
}
#pragma omp end declare target

/* Validate a public kept set for a layout of `rows` packed rows and `hq`
 * query heads, and build the kernel form in host memory (*owned: the
 * key-keep map to fa_free()). kept NULL gives *out = no mask (returns OK with
 * out->key_keep = out->block = NULL and heads_div = hq). */
forkattn_status fa_kept_build(forkattn_ctx *ctx, const forkattn_kept_set *kept, int64_t rows, int64_t hq,
                              fa_kept *out, unsigned char **owned);

/* Bytes of the key-keep map and of the block mask (for device staging). */
int64_t fa_kept_keep_bytes(const fa_kept *k);
int64_t fa_kept_block_bytes(const fa_kept *k);

#endif
