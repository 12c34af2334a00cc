/* Shared-prefix KV cache (forkattn_kv_cache_*, see forkattn.h and
 * docs/dlm-cache.md): argument checks, insert / lookup / release under one
 * mutex, LRU eviction of unheld entries within the byte budget, statistics.
 * The index is lib/dlm/kv_cache_index.c, the K/V copies lib/kv_cache_copy.c.
 *
 * Messages: the cache's calls may run on many threads at once, so they write
 * failures to the cache's context only under the cache's lock, and do not
 * clear its message on success (forkattn_kv_cache_create() does, as every
 * call that takes a context). Argument checks run once without a context to
 * decide, and again under the lock to write the message. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "context_internal.h"
#include "dtype_convert.h"
#include "kv_cache_internal.h"
#include "struct_size.h"
#include "validate.h"

#define FA_BAD FORKATTN_ERR_INVALID_ARGUMENT
#define FA_KV_DEFAULT_BLOCK 16
#define FA_KV_INITIAL_BUCKETS 64

static const char *fa_kv_dtype_name(forkattn_dtype dt) {
  switch (dt) {
    case FORKATTN_DTYPE_F32: return "f32";
    case FORKATTN_DTYPE_BF16: return "bf16";
    case FORKATTN_DTYPE_F16: return "f16";
  }
  return "unknown";
}

/* Record a failure on the cache's context under its lock. */
static forkattn_status fa_kv_fail(forkattn_kv_cache *c, forkattn_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static forkattn_status fa_kv_fail(forkattn_kv_cache *c, forkattn_status st, const char *fmt, ...) {
  char msg[FA_MSG_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&c->lock);
  fa_fail(c->ctx, st, "%s", msg);
  pthread_mutex_unlock(&c->lock);
  return st;
}

/* ---- LRU list of unheld entries (lock held) --------------------------------------- */

static void fa_kv_lru_remove(forkattn_kv_cache *c, forkattn_kv_entry *e) {
  if (e->lru_prev) e->lru_prev->lru_next = e->lru_next;
  else c->lru_head = e->lru_next;
  if (e->lru_next) e->lru_next->lru_prev = e->lru_prev;
  else c->lru_tail = e->lru_prev;
  e->lru_prev = e->lru_next = NULL;
}

static void fa_kv_lru_push_front(forkattn_kv_cache *c, forkattn_kv_entry *e) {
  e->lru_prev = NULL;
  e->lru_next = c->lru_head;
  if (c->lru_head) c->lru_head->lru_prev = e;
  else c->lru_tail = e;
  c->lru_head = e;
}

/* ---- create / destroy -------------------------------------------------------------- */

static void fa_kv_free_entries(const forkattn_kv_cache *c, forkattn_kv_entry *list) {
  for (forkattn_kv_entry *e = list, *next; e; e = next) {
    next = e->free_next;
    fa_kv_data_free(c, e->data);
    fa_free(e);
  }
}

/* The shape options of a cache; fills *row_bytes = kv_heads * head_dim * element size. */
static forkattn_status fa_kv_check_options(forkattn_ctx *ctx, const forkattn_kv_cache_options *o, size_t *row_bytes) {
  if (o->capacity_bytes == 0)
    return fa_fail(ctx, FA_BAD, "opt.capacity_bytes: 0, the cache needs a budget of at least one byte");
  if (o->block_tokens < 0)
    return fa_fail(ctx, FA_BAD, "opt.block_tokens: %lld must be >= 0 (0 picks %d)", (long long)o->block_tokens,
                   FA_KV_DEFAULT_BLOCK);
  if (o->layers < 1) return fa_fail(ctx, FA_BAD, "opt.layers: %lld must be >= 1", (long long)o->layers);
  if (o->kv_heads < 1) return fa_fail(ctx, FA_BAD, "opt.kv_heads: %lld must be >= 1", (long long)o->kv_heads);
  if (o->head_dim < 1 || o->head_dim > FA_MAX_HEAD_DIM)
    return fa_fail(ctx, FA_BAD, "opt.head_dim: %lld outside the supported 1..%d", (long long)o->head_dim,
                   FA_MAX_HEAD_DIM);
  if (o->dtype != FORKATTN_DTYPE_F32 && o->dtype != FORKATTN_DTYPE_BF16 && o->dtype != FORKATTN_DTYPE_F16)
    return fa_fail(ctx, FA_BAD, "opt.dtype: unknown dtype %d", (int)o->dtype);
  if (o->memory != FORKATTN_MEMORY_HOST && o->memory != FORKATTN_MEMORY_DEVICE)
    return fa_fail(ctx, FA_BAD, "opt.memory: unknown value %d", (int)o->memory);
  if (o->memory == FORKATTN_MEMORY_DEVICE && ctx->backend != FORKATTN_BACKEND_GPU)
    return fa_fail(ctx, FA_BAD, "opt.memory: device entries need the gpu backend, this context uses %s",
                   forkattn_backend_name(ctx->backend));
  int64_t row, layer_row;
  if (__builtin_mul_overflow(o->kv_heads, o->head_dim, &row) ||
      __builtin_mul_overflow(row, (int64_t)fa_esize(o->dtype), &row) ||
      __builtin_mul_overflow(row, o->layers, &layer_row) || __builtin_mul_overflow(layer_row, 2, &layer_row) ||
      (uint64_t)layer_row > (uint64_t)SIZE_MAX)
    return fa_fail(ctx, FA_BAD, "opt: 2 * layers %lld * kv_heads %lld * head_dim %lld elements per token overflow",
                   (long long)o->layers, (long long)o->kv_heads, (long long)o->head_dim);
  *row_bytes = (size_t)row;
  return FORKATTN_OK;
}

void forkattn_kv_cache_options_init(forkattn_kv_cache_options *opt) {
  if (!opt) return;
  memset(opt, 0, sizeof *opt);
  opt->struct_size = sizeof *opt;
  opt->dtype = FORKATTN_DTYPE_F32;
  opt->memory = FORKATTN_MEMORY_HOST;
}

forkattn_status forkattn_kv_cache_create(forkattn_ctx *ctx, const forkattn_kv_cache_options *opt,
                                         forkattn_kv_cache **cache) {
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!cache) return fa_fail(ctx, FA_BAD, "cache: the output pointer is NULL");
  *cache = NULL;
  if (!opt) return fa_fail(ctx, FA_BAD, "opt: NULL (fill one with forkattn_kv_cache_options_init())");
  size_t row_bytes = 0;
  forkattn_status st = FA_CHECK_STRUCT_SIZE(ctx, "opt", opt, "forkattn_kv_cache_options");
  if (!st) st = fa_kv_check_options(ctx, opt, &row_bytes);
  if (st) return st;
  forkattn_kv_cache *c = fa_calloc(1, sizeof *c);
  if (!c) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "cache: out of memory");
  c->ctx = ctx;
  c->opt = *opt;
  if (!c->opt.block_tokens) c->opt.block_tokens = FA_KV_DEFAULT_BLOCK;
  c->row_bytes = row_bytes;
  c->hash_mask = ~0ull;
  if (fa_kv_map_init(&c->entries, FA_KV_INITIAL_BUCKETS) || fa_kv_map_init(&c->nodes, FA_KV_INITIAL_BUCKETS)) {
    fa_kv_map_free(&c->entries);
    fa_kv_map_free(&c->nodes);
    fa_free(c);
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "cache: out of memory");
  }
  if (pthread_mutex_init(&c->lock, NULL)) {
    fa_kv_map_free(&c->entries);
    fa_kv_map_free(&c->nodes);
    fa_free(c);
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "cache: cannot create its mutex");
  }
  *cache = c;
  return FORKATTN_OK;
}

/* Frees every entry, held ones included: holders must have released them
 * (a view read after destroy is a use after free). */
void forkattn_kv_cache_destroy(forkattn_kv_cache *cache) {
  if (!cache) return;
  fa_kv_free_entries(cache, fa_kv_index_take_all(cache));
  fa_kv_map_free(&cache->entries);
  fa_kv_map_free(&cache->nodes);
  pthread_mutex_destroy(&cache->lock);
  fa_free(cache);
}

/* ---- insert --------------------------------------------------------------------------- */

static forkattn_status fa_kv_check_tensors(forkattn_ctx *ctx, const forkattn_kv_cache *c, const char *name,
                                           const forkattn_tensor *arr, int64_t n) {
  const forkattn_kv_cache_options *o = &c->opt;
  for (int64_t l = 0; l < o->layers; l++) {
    const forkattn_tensor *t = &arr[l];
    char tn[48];
    snprintf(tn, sizeof tn, "%s[%lld]", name, (long long)l);
    if (t->dtype != o->dtype)
      return fa_fail(ctx, FA_BAD, "%s: dtype %s (%d) differs from the cache's %s", tn, fa_kv_dtype_name(t->dtype),
                     (int)t->dtype, fa_kv_dtype_name(o->dtype));
    if (t->rows != n)
      return fa_fail(ctx, FA_BAD, "%s: has %lld rows, n is %lld (one row per token)", tn, (long long)t->rows,
                     (long long)n);
    if (t->heads != o->kv_heads || t->head_dim != o->head_dim)
      return fa_fail(ctx, FA_BAD, "%s: shape [%lld heads, %lld dims] differs from the cache's [%lld, %lld]", tn,
                     (long long)t->heads, (long long)t->head_dim, (long long)o->kv_heads, (long long)o->head_dim);
    forkattn_status st = fa_check_tensor(ctx, tn, t, o->dtype, n, o->kv_heads, o->head_dim);
    if (st) return st;
  }
  return FORKATTN_OK;
}

static forkattn_status fa_kv_check_insert(forkattn_ctx *ctx, const forkattn_kv_cache *c, const int32_t *tokens,
                                          int64_t n, const forkattn_tensor *k, const forkattn_tensor *v,
                                          forkattn_memory memory) {
  if (n < 1) return fa_fail(ctx, FA_BAD, "n: %lld, an entry holds n >= 1 tokens", (long long)n);
  if (!tokens) return fa_fail(ctx, FA_BAD, "tokens: NULL with n = %lld", (long long)n);
  forkattn_status st = fa_check_aligned(ctx, "tokens", tokens, sizeof *tokens);
  if (st) return st;
  if (!k) return fa_fail(ctx, FA_BAD, "k: the array of %lld per-layer key tensors is NULL", (long long)c->opt.layers);
  if (!v)
    return fa_fail(ctx, FA_BAD, "v: the array of %lld per-layer value tensors is NULL", (long long)c->opt.layers);
  if (memory != FORKATTN_MEMORY_HOST && memory != FORKATTN_MEMORY_DEVICE)
    return fa_fail(ctx, FA_BAD, "memory: unknown value %d", (int)memory);
  if (memory == FORKATTN_MEMORY_DEVICE && c->ctx->backend != FORKATTN_BACKEND_GPU)
    return fa_fail(ctx, FA_BAD, "memory: device tensors need the gpu backend, the cache's context uses %s",
                   forkattn_backend_name(c->ctx->backend));
  st = fa_kv_check_tensors(ctx, c, "k", k, n);
  return st ? st : fa_kv_check_tensors(ctx, c, "v", v, n);
}

/* Link e (its K/V copied, keys hashed) or refresh the equal entry; lock held.
 * Returns 1 when the prefix is cached now (stored or refreshed), 0 when
 * rejected. Whatever must be freed afterwards is chained on *garbage
 * (entries) or left in *garbage_data. */
static int fa_kv_link_locked(forkattn_kv_cache *c, forkattn_kv_entry *e, forkattn_kv_entry **garbage,
                             void **garbage_data) {
  forkattn_kv_entry *old = fa_kv_index_exact(c, e->tokens, e->n, e->key.hash);
  if (old) { /* refresh: new K/V unless someone holds the old ones (then they stay) */
    if (old->refs == 0) {
      *garbage_data = old->data;
      old->data = e->data;
      fa_kv_lru_remove(c, old);
      fa_kv_lru_push_front(c, old);
    } else {
      *garbage_data = e->data; /* held: out of the LRU list; most recent once released */
    }
    c->stats.insertions++;
    e->data = NULL;
    e->free_next = *garbage;
    *garbage = e;
    return 1;
  }
  const size_t cap = c->opt.capacity_bytes;
  if (c->held_bytes + e->bytes > cap) { /* evicting every unheld entry would not make room */
    c->stats.rejected++;
    e->free_next = *garbage;
    *garbage = e;
    return 0;
  }
  while (c->stats.bytes + e->bytes > cap) { /* held_bytes + e->bytes <= cap: the LRU list suffices */
    forkattn_kv_entry *victim = c->lru_tail;
    fa_kv_lru_remove(c, victim);
    fa_kv_index_unlink(c, victim);
    c->stats.bytes -= victim->bytes;
    c->stats.entries--;
    c->stats.evictions++;
    victim->free_next = *garbage;
    *garbage = victim;
  }
  fa_kv_index_link(c, e);
  fa_kv_lru_push_front(c, e);
  c->stats.bytes += e->bytes;
  c->stats.entries++;
  c->stats.insertions++;
  return 1;
}

forkattn_status forkattn_kv_cache_insert(forkattn_kv_cache *cache, const int32_t *tokens, int64_t n,
                                         const forkattn_tensor *k, const forkattn_tensor *v, forkattn_memory memory,
                                         int *stored) {
  forkattn_kv_cache *c = cache;
  if (!c) return FA_BAD;
  if (fa_kv_check_insert(NULL, c, tokens, n, k, v, memory)) {
    pthread_mutex_lock(&c->lock);
    forkattn_status st = fa_kv_check_insert(c->ctx, c, tokens, n, k, v, memory);
    pthread_mutex_unlock(&c->lock);
    return st;
  }
  const int64_t layers = c->opt.layers;
  size_t plane, bytes;
  if (__builtin_mul_overflow(c->row_bytes, (size_t)n, &plane) ||
      __builtin_mul_overflow(plane, (size_t)(2 * layers), &bytes) || bytes > c->opt.capacity_bytes) {
    pthread_mutex_lock(&c->lock); /* can never fit */
    c->stats.rejected++;
    pthread_mutex_unlock(&c->lock);
    if (stored) *stored = 0;
    return FORKATTN_OK;
  }
  /* The entry: struct, node links and tokens in one allocation, K/V in another;
   * both filled before taking the lock. (bytes <= capacity bounds n.) */
  const int64_t num_nodes = (n - 1) / c->opt.block_tokens;
  size_t head = sizeof(forkattn_kv_entry), links, toks;
  if (__builtin_mul_overflow((size_t)num_nodes, sizeof(fa_kv_link), &links) ||
      __builtin_mul_overflow((size_t)n, sizeof(int32_t), &toks) || __builtin_add_overflow(head, links, &head) ||
      __builtin_add_overflow(head, toks, &head))
    return fa_kv_fail(c, FORKATTN_ERR_OUT_OF_MEMORY, "n: %lld tokens: the entry's index overflows size_t",
                      (long long)n);
  forkattn_kv_entry *e = fa_malloc(head);
  if (!e)
    return fa_kv_fail(c, FORKATTN_ERR_OUT_OF_MEMORY, "cache: out of memory for an entry of %lld tokens",
                      (long long)n);
  memset(e, 0, sizeof *e);
  e->cache = c;
  e->n = n;
  e->num_nodes = num_nodes;
  e->nodes = (fa_kv_link *)(void *)(e + 1);
  e->tokens = (int32_t *)(void *)(e->nodes + num_nodes);
  memcpy(e->tokens, tokens, toks);
  e->bytes = bytes;
  e->data = fa_kv_data_alloc(c, bytes);
  if (!e->data) {
    fa_free(e);
    return fa_kv_fail(c, FORKATTN_ERR_OUT_OF_MEMORY, "cache: out of %s memory for %zu bytes of K/V",
                      c->opt.memory == FORKATTN_MEMORY_DEVICE ? "device" : "host", bytes);
  }
  for (int64_t l = 0; l < 2 * layers; l++) {
    const forkattn_tensor *t = l % 2 ? &v[l / 2] : &k[l / 2];
    forkattn_status st = fa_kv_copy_in(c, (char *)e->data + (size_t)l * plane, t, memory);
    if (st) {
      fa_kv_data_free(c, e->data);
      fa_free(e);
      return fa_kv_fail(c, st, "%s[%lld]: copying into the cache failed (%s)", l % 2 ? "v" : "k",
                        (long long)(l / 2), st == FORKATTN_ERR_OUT_OF_MEMORY ? "out of memory" : "device copy");
    }
  }
  fa_kv_hash_entry(e, c->opt.block_tokens, c->hash_mask);

  forkattn_kv_entry *garbage = NULL;
  void *garbage_data = NULL;
  pthread_mutex_lock(&c->lock);
  const int ok = fa_kv_link_locked(c, e, &garbage, &garbage_data);
  pthread_mutex_unlock(&c->lock);
  fa_kv_free_entries(c, garbage);
  fa_kv_data_free(c, garbage_data);
  if (stored) *stored = ok;
  return FORKATTN_OK;
}

/* ---- lookup / release / views / stats ------------------------------------------------ */

forkattn_status forkattn_kv_cache_lookup(forkattn_kv_cache *cache, const int32_t *tokens, int64_t n,
                                         forkattn_kv_entry **entry, int64_t *matched) {
  forkattn_kv_cache *c = cache;
  if (!c) return FA_BAD;
  if (n < 0) return fa_kv_fail(c, FA_BAD, "n: %lld must be >= 0", (long long)n);
  if (!tokens && n > 0) return fa_kv_fail(c, FA_BAD, "tokens: NULL with n = %lld", (long long)n);
  if ((uintptr_t)tokens % sizeof *tokens)
    return fa_kv_fail(c, FA_BAD, "tokens: pointer %p is not aligned to its 4-byte elements", (const void *)tokens);
  if ((uintptr_t)matched % sizeof *matched)
    return fa_kv_fail(c, FA_BAD, "matched: pointer %p is not aligned to its 8-byte elements", (void *)matched);
  if (!entry) return fa_kv_fail(c, FA_BAD, "entry: the output pointer is NULL");
  pthread_mutex_lock(&c->lock);
  forkattn_kv_entry *e = n > 0 ? fa_kv_index_longest(c, tokens, n) : NULL;
  if (e) {
    if (e->refs++ == 0) { /* held: out of the LRU list, out of eviction's reach */
      fa_kv_lru_remove(c, e);
      c->held_bytes += e->bytes;
    }
    c->stats.hits++;
  } else {
    c->stats.misses++;
  }
  pthread_mutex_unlock(&c->lock);
  *entry = e;
  if (matched) *matched = e ? e->n : 0;
  return FORKATTN_OK;
}

void forkattn_kv_cache_release(forkattn_kv_cache *cache, forkattn_kv_entry *entry) {
  if (!cache || !entry || entry->cache != cache) return;
  pthread_mutex_lock(&cache->lock);
  if (entry->refs > 0 && --entry->refs == 0) { /* the last holder: most recently used */
    cache->held_bytes -= entry->bytes;
    fa_kv_lru_push_front(cache, entry);
  }
  pthread_mutex_unlock(&cache->lock);
}

static forkattn_status fa_kv_view(const forkattn_kv_entry *e, int64_t layer, int which, forkattn_tensor *t) {
  if (!t) return FA_BAD;
  memset(t, 0, sizeof *t);
  if (!e) return FA_BAD;
  const forkattn_kv_cache_options *o = &e->cache->opt;
  *t = forkattn_tensor_contiguous(NULL, o->dtype, e->n, o->kv_heads, o->head_dim);
  if (layer < 0 || layer >= o->layers)
    return fa_kv_fail(e->cache, FA_BAD, "layer: %lld outside 0..%lld", (long long)layer, (long long)o->layers - 1);
  t->data = (char *)e->data + (size_t)(2 * layer + which) * (e->bytes / (size_t)(2 * o->layers));
  return FORKATTN_OK;
}

forkattn_status forkattn_kv_entry_k(const forkattn_kv_entry *entry, int64_t layer, forkattn_tensor *view) {
  return fa_kv_view(entry, layer, 0, view);
}

forkattn_status forkattn_kv_entry_v(const forkattn_kv_entry *entry, int64_t layer, forkattn_tensor *view) {
  return fa_kv_view(entry, layer, 1, view);
}

forkattn_status forkattn_kv_cache_get_stats(forkattn_kv_cache *cache, forkattn_kv_cache_stats *stats) {
  if (!cache) return FA_BAD;
  if (!stats) return fa_kv_fail(cache, FA_BAD, "stats: the output pointer is NULL");
  pthread_mutex_lock(&cache->lock);
  *stats = cache->stats;
  pthread_mutex_unlock(&cache->lock);
  return FORKATTN_OK;
}
