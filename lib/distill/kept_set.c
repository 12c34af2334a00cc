/* Kept sets: validate the public description and build the kernels' form
 * (a per-head key-keep byte map; the block mask is used as given). */
#include <string.h>

#include "alloc.h"
#include "context_internal.h"
#include "kept_mask.h"
#include "validate.h"

int64_t fa_kept_keep_bytes(const fa_kept *k) {
  return k && k->key_keep ? k->heads * k->compressed_rows : 0;
}

int64_t fa_kept_block_bytes(const fa_kept *k) { return k && k->block ? k->heads * k->nb * k->nb : 0; }

static forkattn_status fa_kept_check_lists(forkattn_ctx *ctx, const forkattn_kept_set *s) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  const int64_t *off = s->offsets;
  if (off[0] != 0) return fa_fail(ctx, bad, "kept: offsets[0] is %lld, must be 0", (long long)off[0]);
  for (int64_t h = 0; h < s->heads; h++) {
    if (off[h + 1] < off[h])
      return fa_fail(ctx, bad, "kept: offsets not monotonic at head %lld (%lld > %lld)", (long long)h,
                     (long long)off[h], (long long)off[h + 1]);
    if (off[h + 1] - off[h] > s->compressed_rows)
      return fa_fail(ctx, bad, "kept: head %lld lists %lld keys, more than compressed_rows %lld", (long long)h,
                     (long long)(off[h + 1] - off[h]), (long long)s->compressed_rows);
    for (int64_t i = off[h]; i < off[h + 1]; i++) {
      const int64_t r = s->index[i];
      if (r < 0 || r >= s->compressed_rows)
        return fa_fail(ctx, bad, "kept: head %lld index[%lld] = %lld outside [0, compressed_rows %lld)",
                       (long long)h, (long long)i, (long long)r, (long long)s->compressed_rows);
      if (i > off[h] && r <= s->index[i - 1])
        return fa_fail(ctx, bad, "kept: head %lld index not strictly increasing at [%lld] (%lld after %lld)",
                       (long long)h, (long long)i, (long long)r, (long long)s->index[i - 1]);
    }
  }
  return FORKATTN_OK;
}

forkattn_status fa_kept_build(forkattn_ctx *ctx, const forkattn_kept_set *kept, int64_t rows, int64_t hq,
                              fa_kept *out, unsigned char **owned) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  memset(out, 0, sizeof *out);
  *owned = NULL;
  out->heads = 1;
  out->heads_div = hq > 0 ? hq : 1;
  if (!kept) return FORKATTN_OK;
  if (kept->heads < 1 || kept->heads > hq || hq % kept->heads)
    return fa_fail(ctx, bad, "kept: heads %lld must be >= 1 and divide the query heads %lld", (long long)kept->heads,
                   (long long)hq);
  if (!kept->offsets != !kept->index)
    return fa_fail(ctx, bad, "kept: offsets and index must both be set or both NULL");
  if (kept->offsets) {
    forkattn_status st;
    if ((st = fa_check_aligned(ctx, "kept: offsets", kept->offsets, sizeof *kept->offsets)) ||
        (st = fa_check_aligned(ctx, "kept: index", kept->index, sizeof *kept->index)))
      return st;
    if (kept->compressed_rows < 0 || kept->compressed_rows > rows)
      return fa_fail(ctx, bad, "kept: compressed_rows %lld outside [0, rows %lld]", (long long)kept->compressed_rows,
                     (long long)rows);
    if (kept->query_start < 0)
      return fa_fail(ctx, bad, "kept: query_start %lld is negative", (long long)kept->query_start);
    if ((st = fa_kept_check_lists(ctx, kept))) return st;
  }
  const int64_t nb = (rows + FORKATTN_KEPT_BLOCK - 1) / FORKATTN_KEPT_BLOCK;
  if (kept->block_mask) {
    const int64_t n = kept->heads * nb * nb;
    for (int64_t i = 0; i < n; i++)
      if (kept->block_mask[i] > 1)
        return fa_fail(ctx, bad, "kept: block_mask[%lld] = %d, must be 0 or 1", (long long)i, kept->block_mask[i]);
  }
  out->heads = kept->heads;
  out->heads_div = hq / kept->heads;
  out->nb = nb;
  out->block = kept->block_mask;
  out->query_start = kept->query_start;
  if (kept->offsets && kept->compressed_rows > 0 && rows > 0) {
    const int64_t cr = kept->compressed_rows;
    unsigned char *keep = fa_malloc((size_t)(kept->heads * cr));
    if (!keep) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kept: cannot allocate the key map");
    memset(keep, 0, (size_t)(kept->heads * cr));
    for (int64_t h = 0; h < kept->heads; h++)
      for (int64_t i = kept->offsets[h]; i < kept->offsets[h + 1]; i++) keep[h * cr + kept->index[i]] = 1;
    out->key_keep = keep;
    out->compressed_rows = cr;
    *owned = keep;
  }
  return FORKATTN_OK;
}
