/* Shared-prefix KV cache (BiCache, forkattn_kv_cache_*): the object and the
 * pieces its files share.
 *   lib/dlm/kv_cache.c        API: validation, insert/lookup/release, LRU, refcounts
 *   lib/dlm/kv_cache_index.c  chained block hashes, hash multimaps, longest-prefix walk
 *   lib/dlm/kv_cache_copy.c   entry K/V buffers: allocation and copies (host/device, strided)
 *
 * Index. Tokens are hashed in blocks of B = block_tokens: the hash of block j
 * starts from the hash of the block-aligned prefix tokens[0..jB) (H_0 is a
 * seed), absorbs the block's tokens one by one, and is finished with the
 * block's length, so a partial block (an entry of any length n) has a hash
 * too and H_{j+1} is that of the full block. Two multimaps index it:
 *   entries: key (hash of tokens[0..n), n), one per entry;
 *   nodes:   key (H_j, jB) for j = 1..floor((n-1)/B), one link per entry per
 *            block boundary it extends beyond: the radix tree's inner nodes
 *            (a key is present while any entry passes through it).
 * A lookup walks the request block by block, probing `entries` at every
 * length and stopping at the first block boundary no entry passes: O(n)
 * expected. Hashes only propose; tokens are compared exactly before an entry
 * is returned (a colliding candidate is skipped and the walk redone below it).
 *
 * Locking: cache->lock guards the maps, the LRU list, refcounts, statistics
 * and every message written to cache->ctx. An entry's K/V are written before
 * it is linked (or, on a refresh, only while nobody holds it), so a holder
 * reads them without the lock. */
#ifndef FORKATTN_KV_CACHE_INTERNAL_H
#define FORKATTN_KV_CACHE_INTERNAL_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

/* ---- hash multimap ----------------------------------------------------------
 * Intrusive chained hash table with duplicate keys. Each bucket chains the
 * first link of each distinct key (its "head"); the other links with the same
 * key hang off the head in a doubly linked list, so presence is O(1) however
 * many links share a key and every add/remove is O(1) (plus finding the head). */
typedef struct fa_kv_link fa_kv_link;
struct fa_kv_link {
  uint64_t hash;                   /* key: hash ... */
  int64_t len;                     /* ... and token length */
  fa_kv_link *next, **pprev;       /* bucket chain (heads only) */
  fa_kv_link *dup_next, *dup_prev; /* same-key list: head, then the others */
  int head;                        /* 1 for the chained link of its key */
};

typedef struct fa_kv_map {
  fa_kv_link **buckets;
  size_t nbuckets; /* a power of two */
  size_t heads;    /* distinct keys */
} fa_kv_map;

/* 0, or -1 when the bucket array cannot be allocated. */
int fa_kv_map_init(fa_kv_map *m, size_t nbuckets);
void fa_kv_map_free(fa_kv_map *m);
/* The head link of key (hash, len) (iterate its key through dup_next), or NULL. */
fa_kv_link *fa_kv_map_find(const fa_kv_map *m, uint64_t hash, int64_t len);
/* Link l (key already set). Grows the table when it gets full; a failed
 * growth only leaves the chains longer. */
void fa_kv_map_add(fa_kv_map *m, fa_kv_link *l);
void fa_kv_map_remove(fa_kv_map *m, fa_kv_link *l);

/* ---- the cache ---------------------------------------------------------------- */

struct forkattn_kv_entry {
  forkattn_kv_cache *cache;
  fa_kv_link key;      /* in cache->entries: (hash of tokens[0..n), n) */
  fa_kv_link *nodes;   /* [num_nodes] in cache->nodes: (H_j, jB), j = 1..num_nodes */
  int64_t num_nodes;   /* floor((n - 1) / B) */
  int64_t n;           /* tokens */
  int32_t *tokens;     /* [n], stored after the nodes in the entry's allocation */
  void *data;          /* layers x {K, V} x [n, kv_heads, head_dim], cache dtype and memory */
  size_t bytes;        /* K/V bytes of data */
  int64_t refs;        /* holders (lookups not yet released) */
  forkattn_kv_entry *lru_prev, *lru_next; /* unheld entries only, most recent first */
  forkattn_kv_entry *free_next;           /* unlinked, to free after unlocking */
};

struct forkattn_kv_cache {
  forkattn_ctx *ctx;
  forkattn_kv_cache_options opt; /* block_tokens resolved (> 0) */
  size_t row_bytes;              /* kv_heads * head_dim * element size */
  uint64_t hash_mask;            /* all ones; white-box tests narrow it to force collisions */
  pthread_mutex_t lock;
  fa_kv_map entries, nodes;
  forkattn_kv_entry *lru_head, *lru_tail; /* unheld entries: head most recently used */
  size_t held_bytes;                      /* K/V bytes of held entries */
  forkattn_kv_cache_stats stats;
};

/* Set the keys of e (tokens, n, nodes and num_nodes filled in): its key to
 * (hash of tokens[0..n), n), nodes[j-1] to (H_j, jB) for j = 1..num_nodes. */
void fa_kv_hash_entry(forkattn_kv_entry *e, int64_t block, uint64_t mask);
/* The entry whose tokens equal tokens[0..m) for the largest m <= n, or NULL.
 * Caller holds the lock. */
forkattn_kv_entry *fa_kv_index_longest(const forkattn_kv_cache *c, const int32_t *tokens, int64_t n);
/* The entry whose tokens equal tokens[0..n) exactly (key = their hash), or NULL. Caller holds the lock. */
forkattn_kv_entry *fa_kv_index_exact(const forkattn_kv_cache *c, const int32_t *tokens, int64_t n, uint64_t key);
/* Link / unlink an entry's key and nodes. Caller holds the lock. */
void fa_kv_index_link(forkattn_kv_cache *c, forkattn_kv_entry *e);
void fa_kv_index_unlink(forkattn_kv_cache *c, forkattn_kv_entry *e);
/* Every linked entry, chained through free_next, the maps left empty (destroy). */
forkattn_kv_entry *fa_kv_index_take_all(forkattn_kv_cache *c);

/* K/V buffer of `bytes` in the cache's memory (NULL when out of memory), and its release. */
void *fa_kv_data_alloc(const forkattn_kv_cache *c, size_t bytes);
void fa_kv_data_free(const forkattn_kv_cache *c, void *data);
/* Copy the validated tensor t ([rows, kv_heads, head_dim], any strides, in
 * `memory`) into dst, contiguous, in the cache's memory. Uses no lock and
 * writes no message: returns FORKATTN_OK, OUT_OF_MEMORY (staging) or DEVICE. */
forkattn_status fa_kv_copy_in(const forkattn_kv_cache *c, void *dst, const forkattn_tensor *t,
                              forkattn_memory memory);

#endif
