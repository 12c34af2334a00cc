/* Radix index of the KV cache: chained block hashes of token prefixes, the
 * hash multimaps that hold entries and block-boundary nodes, and the
 * longest-prefix walk (kv_cache_internal.h explains the scheme). */
#include <string.h>

#include "alloc.h"
#include "kv_cache_internal.h"

/* ---- hashing ------------------------------------------------------------------ */

#define FA_KV_SEED 0x6a09e667f3bcc908ull

static uint64_t fa_kv_fmix(uint64_t x) { /* MurmurHash3's 64-bit finalizer */
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* One token into the running state of a block (a bijection of the state). */
static inline uint64_t fa_kv_absorb(uint64_t s, int32_t token) {
  s = (s ^ (uint64_t)(uint32_t)token) * 0x9e3779b97f4a7c15ull;
  return s ^ (s >> 29);
}

/* Hash of a block of r tokens from its running state. */
static inline uint64_t fa_kv_finish(uint64_t s, int64_t r, uint64_t mask) {
  return fa_kv_fmix(s ^ ((uint64_t)r * 0xc2b2ae3d27d4eb4full)) & mask;
}

void fa_kv_hash_entry(forkattn_kv_entry *e, int64_t block, uint64_t mask) {
  const int32_t *tokens = e->tokens;
  const int64_t n = e->n;
  uint64_t state = FA_KV_SEED;
  for (int64_t start = 0, j = 0;; start += block) {
    const int64_t end = n - start < block ? n : start + block;
    uint64_t s = state;
    for (int64_t m = start; m < end; m++) s = fa_kv_absorb(s, tokens[m]);
    const uint64_t h = fa_kv_finish(s, end - start, mask);
    if (end == n) {
      e->key.hash = h;
      e->key.len = n;
      return;
    }
    /* H of the block-aligned prefix [0, end), which the entry extends beyond */
    e->nodes[j].hash = h;
    e->nodes[j++].len = end;
    state = h;
  }
}

/* ---- multimap ------------------------------------------------------------------ */

static size_t fa_kv_bucket(const fa_kv_map *m, uint64_t hash, int64_t len) {
  return (size_t)(fa_kv_fmix(hash ^ ((uint64_t)len * 0x9e3779b97f4a7c15ull)) & (m->nbuckets - 1));
}

int fa_kv_map_init(fa_kv_map *m, size_t nbuckets) {
  m->buckets = fa_calloc(nbuckets, sizeof *m->buckets);
  m->nbuckets = nbuckets;
  m->heads = 0;
  return m->buckets ? 0 : -1;
}

void fa_kv_map_free(fa_kv_map *m) {
  fa_free(m->buckets);
  m->buckets = NULL;
  m->nbuckets = m->heads = 0;
}

fa_kv_link *fa_kv_map_find(const fa_kv_map *m, uint64_t hash, int64_t len) {
  for (fa_kv_link *l = m->buckets[fa_kv_bucket(m, hash, len)]; l; l = l->next)
    if (l->hash == hash && l->len == len) return l;
  return NULL;
}

static void fa_kv_chain(fa_kv_link **b, fa_kv_link *l) {
  l->next = *b;
  if (*b) (*b)->pprev = &l->next;
  l->pprev = b;
  *b = l;
}

/* Double the bucket array when the heads outnumber the buckets; keep the
 * current one if the allocation fails (lookups stay correct, only slower). */
static void fa_kv_map_grow(fa_kv_map *m) {
  if (m->heads <= m->nbuckets || m->nbuckets > ((size_t)-1 / 2) / sizeof *m->buckets) return;
  fa_kv_map g = {fa_calloc(2 * m->nbuckets, sizeof *m->buckets), 2 * m->nbuckets, m->heads};
  if (!g.buckets) return;
  for (size_t i = 0; i < m->nbuckets; i++) {
    for (fa_kv_link *l = m->buckets[i], *next; l; l = next) {
      next = l->next;
      fa_kv_chain(&g.buckets[fa_kv_bucket(&g, l->hash, l->len)], l);
    }
  }
  fa_free(m->buckets);
  *m = g;
}

void fa_kv_map_add(fa_kv_map *m, fa_kv_link *l) {
  fa_kv_link *h = fa_kv_map_find(m, l->hash, l->len);
  if (h) { /* same key: join the head's list, right after it */
    l->head = 0;
    l->next = NULL;
    l->pprev = NULL;
    l->dup_prev = h;
    l->dup_next = h->dup_next;
    if (h->dup_next) h->dup_next->dup_prev = l;
    h->dup_next = l;
    return;
  }
  l->head = 1;
  l->dup_next = l->dup_prev = NULL;
  fa_kv_chain(&m->buckets[fa_kv_bucket(m, l->hash, l->len)], l);
  m->heads++;
  fa_kv_map_grow(m);
}

void fa_kv_map_remove(fa_kv_map *m, fa_kv_link *l) {
  if (!l->head) {
    l->dup_prev->dup_next = l->dup_next;
    if (l->dup_next) l->dup_next->dup_prev = l->dup_prev;
    return;
  }
  fa_kv_link *d = l->dup_next;
  if (d) { /* the next link of the key takes the head's place in the chain */
    d->head = 1;
    d->dup_prev = NULL;
    d->next = l->next;
    d->pprev = l->pprev;
    *l->pprev = d;
    if (l->next) l->next->pprev = &d->next;
    return;
  }
  *l->pprev = l->next;
  if (l->next) l->next->pprev = l->pprev;
  m->heads--;
}

/* ---- entries --------------------------------------------------------------------- */

static forkattn_kv_entry *fa_kv_entry_of(fa_kv_link *l) {
  return (forkattn_kv_entry *)(void *)((char *)l - offsetof(forkattn_kv_entry, key));
}

void fa_kv_index_link(forkattn_kv_cache *c, forkattn_kv_entry *e) {
  fa_kv_map_add(&c->entries, &e->key);
  for (int64_t j = 0; j < e->num_nodes; j++) fa_kv_map_add(&c->nodes, &e->nodes[j]);
}

void fa_kv_index_unlink(forkattn_kv_cache *c, forkattn_kv_entry *e) {
  fa_kv_map_remove(&c->entries, &e->key);
  for (int64_t j = 0; j < e->num_nodes; j++) fa_kv_map_remove(&c->nodes, &e->nodes[j]);
}

/* The entry of key (hash, n) whose tokens equal tokens[0..n), or NULL. */
static forkattn_kv_entry *fa_kv_verify(const forkattn_kv_cache *c, const int32_t *tokens, int64_t n, uint64_t hash) {
  for (fa_kv_link *l = fa_kv_map_find(&c->entries, hash, n); l; l = l->dup_next) {
    forkattn_kv_entry *e = fa_kv_entry_of(l);
    if (!memcmp(e->tokens, tokens, (size_t)n * sizeof *tokens)) return e;
  }
  return NULL;
}

forkattn_kv_entry *fa_kv_index_exact(const forkattn_kv_cache *c, const int32_t *tokens, int64_t n, uint64_t key) {
  return fa_kv_verify(c, tokens, n, key);
}

forkattn_kv_entry *fa_kv_index_take_all(forkattn_kv_cache *c) {
  forkattn_kv_entry *all = NULL;
  for (size_t i = 0; i < c->entries.nbuckets; i++) {
    for (fa_kv_link *l = c->entries.buckets[i], *next; l; l = next) {
      next = l->next;
      for (fa_kv_link *d = l, *dn; d; d = dn) { /* the head, then the rest of its key */
        dn = d->dup_next;
        forkattn_kv_entry *e = fa_kv_entry_of(d);
        e->free_next = all;
        all = e;
      }
    }
    c->entries.buckets[i] = NULL;
  }
  c->entries.heads = 0;
  for (size_t i = 0; i < c->nodes.nbuckets; i++) c->nodes.buckets[i] = NULL;
  c->nodes.heads = 0;
  return all;
}

forkattn_kv_entry *fa_kv_index_longest(const forkattn_kv_cache *c, const int32_t *tokens, int64_t n) {
  const int64_t B = c->opt.block_tokens;
  const uint64_t mask = c->hash_mask;
  if (!c->entries.heads) return NULL;
  /* Each pass finds the longest length <= limit whose hash is a key; only a
   * collision (no entry of that key has these tokens) makes another pass, below it. */
  for (int64_t limit = n; limit > 0;) {
    int64_t best = 0;
    uint64_t best_hash = 0, state = FA_KV_SEED;
    for (int64_t start = 0; start < limit; start += B) {
      /* past the root, go on only while some entry extends beyond this boundary */
      if (start > 0 && !fa_kv_map_find(&c->nodes, state, start)) break;
      const int64_t end = limit - start < B ? limit : start + B;
      uint64_t s = state, h = 0;
      for (int64_t m = start + 1; m <= end; m++) {
        s = fa_kv_absorb(s, tokens[m - 1]);
        h = fa_kv_finish(s, m - start, mask);
        if (fa_kv_map_find(&c->entries, h, m)) best = m, best_hash = h;
      }
      state = h; /* H of the block-aligned prefix [0, end) when the block was full */
    }
    if (!best) return NULL;
    forkattn_kv_entry *e = fa_kv_verify(c, tokens, best, best_hash);
    if (e) return e;
    limit = best - 1;
  }
  return NULL;
}
