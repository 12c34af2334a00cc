/* Prefixes computed alone, and where the demo keeps them: K/V in a
 * forkattn_kv_cache (layers = model layers), the hidden state entering each
 * layer in a side table next to it. Layers >= b recompute every row, so the
 * prefix rows need their hidden state at layer b again; the cache holds K/V
 * only, and recomputing the prefix alone up to layer b would cost b layers of
 * prefix rows per batch (the very work reuse saves), so the side table keeps
 * it: +50% over the K/V bytes, no compute (docs/dlm-cache.md). */
#ifndef FORKATTN_TOOLS_DLM_PREFIX_H
#define FORKATTN_TOOLS_DLM_PREFIX_H
#include "dlm_model.h"

/* K, V and hidden state entering layer l of a prefix computed alone, each
 * [layers][len, width] in one allocation. */
typedef struct dlm_alone {
  int64_t len;
  float *k, *v, *hidden;
} dlm_alone;

/* Run the prefix tokens[0..len) alone through the model and keep its states. */
forkattn_status dlm_alone_compute(forkattn_ctx *ctx, const dlm_model *m, const int32_t *tokens, int64_t len,
                                  dlm_alone *a, char *err, size_t errlen);
void dlm_alone_free(dlm_alone *a);
/* Views of a's states as a dlm_prefix. */
void dlm_alone_prefix(const dlm_model *m, const dlm_alone *a, dlm_prefix *p);

typedef struct dlm_side dlm_side; /* one side-table entry */

typedef struct dlm_store {
  forkattn_kv_cache *cache;
  dlm_side *side;
  int64_t nside, cap_side; /* oldest dropped beyond cap_side */
  int64_t layers, width, heads;
  uint64_t side_misses;    /* cache hits without hidden states: served as misses */
} dlm_store;

/* A cached prefix held for one request: the cache entry (NULL on a miss) and
 * the prefix's K/V views (the entry's) and hidden states (the side table's). */
typedef struct dlm_held {
  forkattn_kv_entry *entry;
  int64_t len;
  dlm_prefix prefix;
} dlm_held;

/* A store with a cache of capacity_bytes of f32 K/V on the host. */
forkattn_status dlm_store_create(dlm_store *s, forkattn_ctx *ctx, const dlm_model *m, size_t capacity_bytes,
                                 char *err, size_t errlen);
void dlm_store_destroy(dlm_store *s);
/* Insert a prefix computed alone: K/V into the cache, hidden states copied
 * into the side table (which may drop its oldest entry: insert while no
 * dlm_held is live). *stored: the cache's verdict. */
forkattn_status dlm_store_insert(dlm_store *s, forkattn_ctx *ctx, const int32_t *tokens, const dlm_alone *a,
                                 int *stored, char *err, size_t errlen);
/* Longest cached prefix of tokens[0..n), held; h->len = 0 on a miss. */
forkattn_status dlm_store_lookup(dlm_store *s, forkattn_ctx *ctx, const int32_t *tokens, int64_t n, dlm_held *h,
                                 char *err, size_t errlen);
void dlm_store_release(dlm_store *s, dlm_held *h);
/* Bytes of hidden states in the side table. */
double dlm_store_side_bytes(const dlm_store *s);
#endif
