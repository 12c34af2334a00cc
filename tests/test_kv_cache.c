/*
 * test_kv_cache.c - the shared-prefix KV cache (forkattn_kv_cache_*).
 *
 * Every entry's K/V are deterministic bit patterns of (its tokens, a version,
 * layer, K or V, row, head, column), so any returned entry can be checked
 * bit for bit against what was inserted for exactly its prefix: a wrong
 * entry, a wrong length, a stale or torn copy all show. Checked: the longest
 * cached prefix wins (nested prefixes, divergence inside a block, exact
 * length, no longer entry serving a shorter prefix); collisions forced by a
 * 2-bit hash (the cache's hash mask, set through kv_cache_internal.h) never
 * return a wrong entry; LRU order and recency bumps; the byte budget after
 * every operation of long random sequences run against a model
 * implementation; held entries survive eviction pressure intact; refresh; rejection; f32/bf16/f16; strided inputs;
 * 8 threads at once; every bad argument; allocation failures
 * (FORKATTN_ALLOC_TEST builds); device memory (GPU backend; skips on the CPU).
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cache_internal.h" /* white box: the index's hash mask */
#include "test_common.h"

/* Exported by FORKATTN_ALLOC_TEST builds of the library only (lib/core/alloc.c). */
extern int64_t forkattn_test_fail_alloc_after(int64_t n) __attribute__((weak));

#define MAXL 4     /* layers of the test caches */
#define MAXN 128   /* longest token sequence of the tests */
#define NDOCS 10   /* documents of the random tests */

/* ---- deterministic K/V -------------------------------------------------------- */

static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Identity of the K/V of tokens[0..n) at `version`: depends on every token. */
static uint64_t prefix_key(const int32_t *tok, int64_t n, uint64_t version) {
  uint64_t h = mix64(0x5eedull ^ version);
  for (int64_t i = 0; i < n; i++) h = mix64(h ^ (uint32_t)tok[i]);
  return mix64(h ^ (uint64_t)n);
}

static size_t esize(forkattn_dtype dt) { return dt == FORKATTN_DTYPE_F32 ? 4 : 2; }

/* Bits of element (r, h, c) of layer l's K (which 0) or V (1) of an n-token prefix. */
static uint32_t elem_bits(uint64_t key, const forkattn_kv_cache_options *o, int64_t n, int64_t l, int which,
                          int64_t r, int64_t h, int64_t c) {
  const uint64_t idx = ((((uint64_t)l * 2 + (uint64_t)which) * (uint64_t)n + (uint64_t)r) * (uint64_t)o->kv_heads +
                        (uint64_t)h) * (uint64_t)o->head_dim + (uint64_t)c;
  return (uint32_t)mix64(key + idx * 0xd6e8feb86659fd93ull);
}

static void put_bits(void *p, forkattn_dtype dt, uint32_t bits) {
  if (dt == FORKATTN_DTYPE_F32) memcpy(p, &bits, 4);
  else {
    uint16_t b = (uint16_t)bits;
    memcpy(p, &b, 2);
  }
}

static uint32_t get_bits(const void *p, forkattn_dtype dt) {
  if (dt == FORKATTN_DTYPE_F32) {
    uint32_t b;
    memcpy(&b, p, 4);
    return b;
  }
  uint16_t b;
  memcpy(&b, p, 2);
  return b;
}

static uint32_t want_bits(forkattn_dtype dt, uint32_t bits) { return dt == FORKATTN_DTYPE_F32 ? bits : (uint16_t)bits; }

/* Input tensors of one insert. mode 0: contiguous; 1: padded row-major
 * (gaps between heads and rows); 2: head-major (rows inside heads). Gaps hold
 * 0xEE bytes, which must never reach the cache. */
typedef struct kvin {
  int64_t layers;
  forkattn_tensor k[MAXL], v[MAXL];
  unsigned char *mem[2 * MAXL];
} kvin;

static void kv_make(kvin *in, const forkattn_kv_cache_options *o, const int32_t *tok, int64_t n, uint64_t version,
                    int mode) {
  const int64_t H = o->kv_heads, d = o->head_dim;
  const size_t es = esize(o->dtype);
  const uint64_t key = prefix_key(tok, n, version);
  in->layers = o->layers;
  for (int64_t l = 0; l < o->layers; l++) {
    for (int which = 0; which < 2; which++) {
      int64_t rs = H * d, hs = d;
      if (mode == 1) hs = d + 3, rs = H * hs + 5;
      if (mode == 2) rs = d + 2, hs = n * rs + 7;
      const int64_t span = (n - 1) * rs + (H - 1) * hs + d;
      unsigned char *m = malloc((size_t)span * es);
      cr_assert_not_null(m, "test: out of memory");
      memset(m, 0xEE, (size_t)span * es);
      for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < H; h++)
          for (int64_t c = 0; c < d; c++)
            put_bits(m + (size_t)(r * rs + h * hs + c) * es, o->dtype, elem_bits(key, o, n, l, which, r, h, c));
      in->mem[2 * l + which] = m;
      forkattn_tensor t = {m, o->dtype, n, H, d, rs, hs};
      if (which) in->v[l] = t;
      else in->k[l] = t;
    }
  }
}

static void kv_free(kvin *in) {
  for (int64_t i = 0; i < 2 * in->layers; i++) free(in->mem[i]);
}

/* Number of problems of a held entry against the K/V of tok[0..m) at
 * `version` (0: all good); the first one described in why. Host entries. */
static int64_t kv_check_entry(const forkattn_kv_cache_options *o, const forkattn_kv_entry *e, const int32_t *tok,
                              int64_t m, uint64_t version, char *why, size_t len) {
  const uint64_t key = prefix_key(tok, m, version);
  const size_t es = esize(o->dtype);
  int64_t bad = 0;
  for (int64_t l = 0; l < o->layers; l++) {
    for (int which = 0; which < 2; which++) {
      forkattn_tensor t;
      const forkattn_status vs = which ? forkattn_kv_entry_v(e, l, &t) : forkattn_kv_entry_k(e, l, &t);
      cr_assert_eq(vs, FORKATTN_OK);
      if (!t.data || t.dtype != o->dtype || t.rows != m || t.heads != o->kv_heads || t.head_dim != o->head_dim ||
          t.head_stride != o->head_dim || t.row_stride != o->kv_heads * o->head_dim) {
        if (!bad++)
          snprintf(why, len, "%s[%lld]: view data %p dtype %d shape [%lld, %lld, %lld] strides (%lld, %lld), want %lld rows contiguous",
                   which ? "v" : "k", (long long)l, t.data, (int)t.dtype, (long long)t.rows, (long long)t.heads,
                   (long long)t.head_dim, (long long)t.row_stride, (long long)t.head_stride, (long long)m);
        continue;
      }
      for (int64_t r = 0; r < m; r++)
        for (int64_t h = 0; h < o->kv_heads; h++)
          for (int64_t c = 0; c < o->head_dim; c++) {
            const uint32_t got = get_bits((const char *)t.data + (size_t)((r * o->kv_heads + h) * o->head_dim + c) * es,
                                          o->dtype);
            const uint32_t want = want_bits(o->dtype, elem_bits(key, o, m, l, which, r, h, c));
            if (got != want && !bad++)
              snprintf(why, len, "%s[%lld] element (%lld, %lld, %lld) = 0x%x, want 0x%x (prefix of %lld tokens, version %llu)",
                       which ? "v" : "k", (long long)l, (long long)r, (long long)h, (long long)c, got, want,
                       (long long)m, (unsigned long long)version);
          }
    }
  }
  return bad;
}

/* ---- helpers -------------------------------------------------------------------- */

static forkattn_kv_cache_options opts(size_t capacity, int64_t block, int64_t layers, int64_t heads, int64_t d,
                                      forkattn_dtype dt) {
  forkattn_kv_cache_options o;
  forkattn_kv_cache_options_init(&o);
  o.capacity_bytes = capacity;
  o.block_tokens = block;
  o.layers = layers;
  o.kv_heads = heads;
  o.head_dim = d;
  o.dtype = dt;
  o.memory = FORKATTN_MEMORY_HOST;
  return o;
}

/* K+V bytes of an n-token entry. */
static size_t entry_bytes(const forkattn_kv_cache_options *o, int64_t n) {
  return (size_t)(2 * o->layers * n * o->kv_heads * o->head_dim) * esize(o->dtype);
}

static forkattn_ctx *cpu_ctx(const char *name) {
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert_not_null(ctx, "%s: cannot create a context", name);
  return ctx;
}

static forkattn_kv_cache *make_cache(forkattn_ctx *ctx, const forkattn_kv_cache_options *o) {
  forkattn_kv_cache *c = NULL;
  cr_assert_eq(forkattn_kv_cache_create(ctx, o, &c), FORKATTN_OK, "kv_cache_create: %s", forkattn_ctx_last_error(ctx));
  cr_assert_not_null(c);
  return c;
}

/* Insert tok[0..n) at `version` (input layout `mode`); returns *stored. */
static int insert(forkattn_ctx *ctx, forkattn_kv_cache *c, const forkattn_kv_cache_options *o, const int32_t *tok,
                  int64_t n, uint64_t version, int mode) {
  kvin in;
  kv_make(&in, o, tok, n, version, mode);
  int stored = -1;
  forkattn_status st = forkattn_kv_cache_insert(c, tok, n, in.k, in.v, FORKATTN_MEMORY_HOST, &stored);
  kv_free(&in);
  cr_assert_eq(st, FORKATTN_OK, "insert of %lld tokens: %s (%s)", (long long)n, forkattn_status_string(st),
               forkattn_ctx_last_error(ctx));
  cr_assert(stored == 0 || stored == 1, "insert: *stored = %d", stored);
  return stored;
}

/* Look tok[0..n) up; expect a hit of `want` tokens at `version` (0 tokens: a
 * miss) and release it. */
static void expect_lookup(forkattn_ctx *ctx, forkattn_kv_cache *c, const forkattn_kv_cache_options *o,
                          const int32_t *tok, int64_t n, int64_t want, uint64_t version, const char *what) {
  forkattn_kv_entry *e = NULL;
  int64_t m = -1;
  cr_assert_eq(forkattn_kv_cache_lookup(c, tok, n, &e, &m), FORKATTN_OK, "%s: lookup: %s", what,
               forkattn_ctx_last_error(ctx));
  cr_assert_eq(m, want, "%s: request of %lld tokens matched %lld, want %lld", what, (long long)n, (long long)m,
               (long long)want);
  if (!want) {
    cr_assert_null(e, "%s: a miss must give entry NULL", what);
    return;
  }
  cr_assert_not_null(e, "%s: a hit must give an entry", what);
  char why[512] = "";
  int64_t bad = kv_check_entry(o, e, tok, m, version, why, sizeof why);
  forkattn_kv_cache_release(c, e);
  cr_assert_eq(bad, 0, "%s: %lld wrong elements: %s", what, (long long)bad, why);
}

static forkattn_kv_cache_stats stats_of(forkattn_kv_cache *c) {
  forkattn_kv_cache_stats s;
  cr_assert_eq(forkattn_kv_cache_get_stats(c, &s), FORKATTN_OK);
  return s;
}

static void fill_random(tc_rng *rng, int32_t *tok, int64_t n, int64_t alphabet) {
  for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)tc_randint(rng, 0, alphabet - 1);
}

/* Documents sharing prefixes: each copies an earlier one up to a random
 * point, then goes on at random over a small alphabet. */
static void make_docs(tc_rng *rng, int32_t docs[NDOCS][MAXN], int64_t len, int64_t alphabet) {
  for (int i = 0; i < NDOCS; i++) {
    int64_t keep = 0;
    if (i > 0 && tc_uniform(rng, 0, 1) < 0.8) {
      keep = tc_randint(rng, 0, len - 1);
      memcpy(docs[i], docs[tc_randint(rng, 0, i - 1)], (size_t)keep * sizeof(int32_t));
    }
    fill_random(rng, docs[i] + keep, len - keep, alphabet);
  }
}

/* ---- longest prefix ----------------------------------------------------------------- */

Test(kv_cache, longest_prefix) {
  const char *name = "kv_cache/longest_prefix";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(1 << 22, 4, 2, 2, 8, FORKATTN_DTYPE_F32);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t doc[40], req[40];
  fill_random(&rng, doc, 40, 1000);
  const int64_t lens[] = {3, 4, 8, 13, 21};
  for (int i = 0; i < 5; i++) cr_assert_eq(insert(ctx, c, &o, doc, lens[i], 0, 0), 1);
  expect_lookup(ctx, c, &o, doc, 40, 21, 0, "full document");
  expect_lookup(ctx, c, &o, doc, 21, 21, 0, "exact length 21");
  expect_lookup(ctx, c, &o, doc, 20, 13, 0, "20 tokens: no longer entry serves a shorter prefix");
  expect_lookup(ctx, c, &o, doc, 12, 8, 0, "12 tokens");
  expect_lookup(ctx, c, &o, doc, 8, 8, 0, "exact length 8 (block-aligned)");
  expect_lookup(ctx, c, &o, doc, 7, 4, 0, "7 tokens");
  expect_lookup(ctx, c, &o, doc, 4, 4, 0, "exact length 4");
  expect_lookup(ctx, c, &o, doc, 3, 3, 0, "exact length 3");
  expect_lookup(ctx, c, &o, doc, 2, 0, 0, "shorter than every entry");
  expect_lookup(ctx, c, &o, doc, 0, 0, 0, "empty request");
  /* divergence inside a block: position 15 (block [12, 16)) keeps 13, position 10 keeps 8 */
  memcpy(req, doc, sizeof req);
  req[15] ^= 1;
  expect_lookup(ctx, c, &o, req, 40, 13, 0, "diverges at 15");
  memcpy(req, doc, sizeof req);
  req[10] ^= 1;
  expect_lookup(ctx, c, &o, req, 40, 8, 0, "diverges at 10");
  memcpy(req, doc, sizeof req);
  req[12] ^= 1;
  expect_lookup(ctx, c, &o, req, 40, 8, 0, "diverges at 12 (first token of a block)");
  memcpy(req, doc, sizeof req);
  req[0] ^= 1;
  expect_lookup(ctx, c, &o, req, 40, 0, 0, "diverges at 0");
  /* a sibling branch diverging inside a block is a separate entry */
  memcpy(req, doc, sizeof req);
  req[18] ^= 1;
  cr_assert_eq(insert(ctx, c, &o, req, 30, 0, 0), 1);
  expect_lookup(ctx, c, &o, req, 40, 30, 0, "sibling branch");
  expect_lookup(ctx, c, &o, doc, 40, 21, 0, "full document after the sibling");
  req[25] ^= 1;
  expect_lookup(ctx, c, &o, req, 40, 13, 0, "sibling diverging again");
  forkattn_kv_cache_stats s = stats_of(c);
  cr_assert_eq(s.entries, 6, "entries %lld, want 6", (long long)s.entries);
  cr_assert_eq(s.bytes, entry_bytes(&o, 3 + 4 + 8 + 13 + 21 + 30), "bytes %zu", s.bytes);
  cr_assert_eq(s.hits, 14, "hits %llu", (unsigned long long)s.hits);
  cr_assert_eq(s.misses, 3, "misses %llu", (unsigned long long)s.misses);
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

/* Brute-force longest cached prefix among the inserted ones. */
static int64_t brute_longest(const int32_t (*ins)[MAXN], const int64_t *ins_len, int nins, const int32_t *req,
                             int64_t n) {
  int64_t best = 0;
  for (int i = 0; i < nins; i++)
    if (ins_len[i] <= n && ins_len[i] > best && !memcmp(ins[i], req, (size_t)ins_len[i] * sizeof(int32_t)))
      best = ins_len[i];
  return best;
}

/* Many similar prefixes over a 2-letter alphabet, random lookups; block size
 * and hash width as given (bits 0: the full hash). */
static void similar_prefixes(const char *name, int64_t block, int bits) {
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts((size_t)1 << 26, block, 1, 1, 4, FORKATTN_DTYPE_BF16);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  if (bits) c->hash_mask = ((uint64_t)1 << bits) - 1; /* before the first insert: every key hashes narrow */
  enum { NINS = 300 };
  static int32_t ins[NINS][MAXN];
  int64_t ins_len[NINS];
  int nins = 0;
  for (int i = 0; i < NINS; i++) {
    ins_len[i] = tc_randint(&rng, 1, 14);
    fill_random(&rng, ins[i], ins_len[i], 2);
    if (brute_longest(ins, ins_len, nins, ins[i], ins_len[i]) == ins_len[i]) { /* already there */
      expect_lookup(ctx, c, &o, ins[i], ins_len[i], ins_len[i], 0, "re-inserted prefix");
      continue;
    }
    cr_assert_eq(insert(ctx, c, &o, ins[i], ins_len[i], 0, 0), 1);
    memcpy(ins[nins], ins[i], sizeof ins[i]);
    ins_len[nins++] = ins_len[i];
  }
  forkattn_kv_cache_stats s = stats_of(c);
  cr_assert_eq(s.entries, nins, "%s: entries %lld, want %d", name, (long long)s.entries, nins);
  for (size_t bk = 0; bk < c->entries.nbuckets; bk++) /* the keys were hashed under the mask */
    for (const fa_kv_link *l = c->entries.buckets[bk]; l; l = l->next)
      cr_assert_leq(l->hash, c->hash_mask, "%s: key hash %llx outside the mask", name, (unsigned long long)l->hash);
  int32_t req[MAXN];
  for (int q = 0; q < 3000; q++) {
    const int64_t n = tc_randint(&rng, 0, 18);
    fill_random(&rng, req, n, 2);
    char what[96];
    snprintf(what, sizeof what, "%s: lookup %d", name, q);
    expect_lookup(ctx, c, &o, req, n, brute_longest(ins, ins_len, nins, req, n), 0, what);
  }
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

Test(kv_cache, collisions_two_bit_hash_block1) { similar_prefixes("kv_cache/collisions_b1", 1, 2); }
Test(kv_cache, collisions_two_bit_hash_block3) { similar_prefixes("kv_cache/collisions_b3", 3, 2); }
Test(kv_cache, collisions_one_bit_hash_block2) { similar_prefixes("kv_cache/collisions_1bit", 2, 1); }
Test(kv_cache, similar_prefixes_full_hash) { similar_prefixes("kv_cache/similar_full_hash", 2, 0); }

/* ---- LRU, budget, held entries, refresh, rejection -------------------------------- */

Test(kv_cache, lru_order) {
  const char *name = "kv_cache/lru_order";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(0, 0, 2, 1, 4, FORKATTN_DTYPE_F32);
  o.capacity_bytes = 3 * entry_bytes(&o, 8); /* three 8-token entries */
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[6][8];
  for (int i = 0; i < 6; i++) {
    fill_random(&rng, t[i], 8, 50000);
    t[i][0] = i; /* distinct */
  }
  for (int i = 0; i < 3; i++) cr_assert_eq(insert(ctx, c, &o, t[i], 8, 0, 0), 1);
  expect_lookup(ctx, c, &o, t[0], 8, 8, 0, "A (bumps it)"); /* order, oldest first: B C A */
  cr_assert_eq(insert(ctx, c, &o, t[3], 8, 0, 0), 1);        /* evicts B: C A D */
  forkattn_kv_cache_stats s = stats_of(c);
  cr_assert_eq(s.evictions, 1, "evictions %llu", (unsigned long long)s.evictions);
  cr_assert_eq(s.entries, 3);
  expect_lookup(ctx, c, &o, t[1], 8, 0, 0, "B evicted (least recently used)");
  expect_lookup(ctx, c, &o, t[2], 8, 8, 0, "C survives"); /* A D C */
  cr_assert_eq(insert(ctx, c, &o, t[4], 8, 0, 0), 1);     /* evicts A: D C E */
  expect_lookup(ctx, c, &o, t[0], 8, 0, 0, "A evicted after C's bump");
  cr_assert_eq(insert(ctx, c, &o, t[3], 8, 0, 0), 1); /* refresh bumps D: C E D */
  cr_assert_eq(insert(ctx, c, &o, t[5], 8, 0, 0), 1); /* evicts C: E D F */
  expect_lookup(ctx, c, &o, t[2], 8, 0, 0, "C evicted after D's refresh");
  expect_lookup(ctx, c, &o, t[3], 8, 8, 0, "D survives");
  expect_lookup(ctx, c, &o, t[4], 8, 8, 0, "E survives");
  expect_lookup(ctx, c, &o, t[5], 8, 8, 0, "F survives");
  /* one entry twice as large evicts the two least recent (D, E) */
  int32_t big[16];
  fill_random(&rng, big, 16, 50000);
  big[0] = 99;
  cr_assert_eq(insert(ctx, c, &o, big, 16, 0, 0), 1);
  expect_lookup(ctx, c, &o, t[5], 8, 8, 0, "F survives the large entry");
  expect_lookup(ctx, c, &o, big, 16, 16, 0, "the large entry");
  expect_lookup(ctx, c, &o, t[3], 8, 0, 0, "D evicted by the large entry");
  expect_lookup(ctx, c, &o, t[4], 8, 0, 0, "E evicted by the large entry");
  s = stats_of(c);
  cr_assert_eq(s.evictions, 5, "evictions %llu, want 5", (unsigned long long)s.evictions);
  cr_assert_eq(s.bytes, entry_bytes(&o, 24), "bytes %zu", s.bytes);
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

Test(kv_cache, held_entries_survive_pressure) {
  const char *name = "kv_cache/held_entries";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(0, 4, 3, 2, 16, FORKATTN_DTYPE_BF16);
  o.capacity_bytes = 2 * entry_bytes(&o, 10);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t a[10], x[10];
  fill_random(&rng, a, 10, 1000);
  cr_assert_eq(insert(ctx, c, &o, a, 10, 7, 1), 1);
  forkattn_kv_entry *held = NULL;
  int64_t m = 0;
  cr_assert_eq(forkattn_kv_cache_lookup(c, a, 10, &held, &m), FORKATTN_OK);
  cr_assert_eq(m, 10);
  char why[512];
  for (int i = 0; i < 200; i++) { /* each insert evicts the previous unheld one, never a */
    fill_random(&rng, x, 10, 1000);
    x[0] = 1000 + i;
    cr_assert_eq(insert(ctx, c, &o, x, 10, 0, i % 3), 1, "insert %d next to the held entry", i);
    int64_t bad = kv_check_entry(&o, held, a, 10, 7, why, sizeof why);
    cr_assert_eq(bad, 0, "held entry corrupted after insert %d: %s", i, why);
    forkattn_kv_cache_stats s = stats_of(c);
    cr_assert(s.bytes <= o.capacity_bytes);
    cr_assert_eq(s.entries, 2);
  }
  /* a 20-token entry would need the held one's room: rejected, nothing evicted */
  int32_t big[20];
  fill_random(&rng, big, 20, 1000);
  big[0] = -5;
  forkattn_kv_cache_stats before = stats_of(c);
  cr_assert_eq(insert(ctx, c, &o, big, 20, 0, 0), 0, "an entry that only fits by evicting a held one is rejected");
  forkattn_kv_cache_stats after = stats_of(c);
  cr_assert_eq(after.rejected, before.rejected + 1);
  cr_assert_eq(after.entries, before.entries, "a rejected insert evicts nothing");
  cr_assert_eq(after.evictions, before.evictions);
  /* refresh of a held entry keeps the old K/V (version 7), counts as stored */
  cr_assert_eq(insert(ctx, c, &o, a, 10, 8, 2), 1);
  cr_assert_eq(kv_check_entry(&o, held, a, 10, 7, why, sizeof why), 0, "held entry changed by a refresh: %s", why);
  forkattn_kv_entry *again = NULL;
  cr_assert_eq(forkattn_kv_cache_lookup(c, a, 10, &again, &m), FORKATTN_OK);
  cr_assert_eq(again, held, "a second holder gets the same entry");
  forkattn_kv_cache_release(c, again);
  forkattn_kv_cache_release(c, held); /* now unheld: the large entry fits by evicting */
  /* releasing NULL, an unheld entry again, or through another cache: ignored */
  forkattn_kv_cache *other = make_cache(ctx, &o);
  forkattn_kv_cache_release(c, NULL);
  forkattn_kv_cache_release(NULL, held);
  forkattn_kv_cache_release(c, held);
  forkattn_kv_cache_release(other, held);
  forkattn_kv_cache_destroy(other);
  expect_lookup(ctx, c, &o, a, 10, 10, 7, "old K/V kept by the held refresh");
  cr_assert_eq(insert(ctx, c, &o, a, 10, 9, 0), 1);
  expect_lookup(ctx, c, &o, a, 10, 10, 9, "unheld refresh replaces the K/V");
  cr_assert_eq(insert(ctx, c, &o, big, 20, 0, 0), 1);
  forkattn_kv_cache_stats s = stats_of(c);
  cr_assert_eq(s.entries, 1);
  cr_assert_eq(s.bytes, o.capacity_bytes);
  expect_lookup(ctx, c, &o, big, 20, 20, 0, "the large entry");
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

Test(kv_cache, rejects_oversized) {
  const char *name = "kv_cache/rejects_oversized";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(0, 0, 1, 1, 8, FORKATTN_DTYPE_F32);
  o.capacity_bytes = entry_bytes(&o, 10) + 5; /* 10 tokens fit, 11 do not */
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[16];
  fill_random(&rng, t, 16, 100);
  cr_assert_eq(insert(ctx, c, &o, t, 4, 0, 0), 1);
  cr_assert_eq(insert(ctx, c, &o, t, 11, 0, 0), 0, "11 tokens exceed the capacity");
  forkattn_kv_cache_stats s = stats_of(c);
  cr_assert_eq(s.rejected, 1);
  cr_assert_eq(s.entries, 1, "rejection must not evict");
  cr_assert_eq(s.evictions, 0);
  cr_assert_eq(s.insertions, 1);
  expect_lookup(ctx, c, &o, t, 16, 4, 0, "the small entry stays");
  cr_assert_eq(insert(ctx, c, &o, t, 10, 0, 0), 1, "exactly the capacity minus 5 fits");
  s = stats_of(c);
  cr_assert_eq(s.evictions, 1);
  cr_assert_eq(s.bytes, entry_bytes(&o, 10));
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

/* ---- random operations against a model -------------------------------------------- */

typedef struct mentry {
  int32_t tok[MAXN];
  int64_t n, refs;
  uint64_t version, ts;
  size_t bytes;
  int live;
} mentry;

typedef struct model {
  mentry e[512];
  int count;
  size_t cap, held_bytes;
  uint64_t now;
  forkattn_kv_cache_stats s;
} model;

static int model_find(const model *md, const int32_t *tok, int64_t n) {
  for (int i = 0; i < md->count; i++)
    if (md->e[i].live && md->e[i].n == n && !memcmp(md->e[i].tok, tok, (size_t)n * sizeof(int32_t))) return i;
  return -1;
}

static int model_insert(model *md, const int32_t *tok, int64_t n, size_t bytes, uint64_t version) {
  md->now++;
  int i = model_find(md, tok, n);
  if (i >= 0) {
    if (!md->e[i].refs) md->e[i].version = version, md->e[i].ts = md->now;
    md->s.insertions++;
    return 1;
  }
  if (bytes > md->cap || md->held_bytes + bytes > md->cap) {
    md->s.rejected++;
    return 0;
  }
  while (md->s.bytes + bytes > md->cap) {
    int v = -1;
    for (int j = 0; j < md->count; j++)
      if (md->e[j].live && !md->e[j].refs && (v < 0 || md->e[j].ts < md->e[v].ts)) v = j;
    cr_assert(v >= 0, "model: nothing to evict");
    md->e[v].live = 0;
    md->s.bytes -= md->e[v].bytes;
    md->s.entries--;
    md->s.evictions++;
  }
  for (i = 0; i < md->count && md->e[i].live; i++) {
  }
  if (i == md->count) {
    cr_assert(md->count < 512, "model: too many entries");
    md->count++;
  }
  mentry *e = &md->e[i];
  memcpy(e->tok, tok, (size_t)n * sizeof(int32_t));
  e->n = n, e->refs = 0, e->version = version, e->ts = md->now, e->bytes = bytes, e->live = 1;
  md->s.bytes += bytes;
  md->s.entries++;
  md->s.insertions++;
  return 1;
}

static int model_lookup(model *md, const int32_t *tok, int64_t n) {
  md->now++;
  int best = -1;
  for (int i = 0; i < md->count; i++) {
    const mentry *e = &md->e[i];
    if (e->live && e->n <= n && (best < 0 || e->n > md->e[best].n) && !memcmp(e->tok, tok, (size_t)e->n * sizeof(int32_t)))
      best = i;
  }
  if (best < 0) {
    md->s.misses++;
    return -1;
  }
  if (!md->e[best].refs++) md->held_bytes += md->e[best].bytes;
  md->s.hits++;
  return best;
}

static void model_release(model *md, int i) {
  md->now++;
  if (!--md->e[i].refs) {
    md->held_bytes -= md->e[i].bytes;
    md->e[i].ts = md->now;
  }
}

static void expect_stats(forkattn_kv_cache *c, const model *md, int64_t op) {
  forkattn_kv_cache_stats s = stats_of(c);
  cr_assert(s.bytes <= md->cap, "op %lld: bytes %zu exceed the capacity %zu", (long long)op, s.bytes, md->cap);
  cr_assert(s.hits == md->s.hits && s.misses == md->s.misses && s.insertions == md->s.insertions &&
                s.evictions == md->s.evictions && s.rejected == md->s.rejected && s.bytes == md->s.bytes &&
                s.entries == md->s.entries,
            "op %lld: stats hits %llu misses %llu insertions %llu evictions %llu rejected %llu bytes %zu entries %lld; "
            "model %llu %llu %llu %llu %llu %zu %lld",
            (long long)op, (unsigned long long)s.hits, (unsigned long long)s.misses,
            (unsigned long long)s.insertions, (unsigned long long)s.evictions, (unsigned long long)s.rejected,
            s.bytes, (long long)s.entries, (unsigned long long)md->s.hits, (unsigned long long)md->s.misses,
            (unsigned long long)md->s.insertions, (unsigned long long)md->s.evictions,
            (unsigned long long)md->s.rejected, md->s.bytes, (long long)md->s.entries);
}

typedef struct handle {
  forkattn_kv_entry *e;
  int mi; /* model entry */
} handle;

static void random_ops(const char *name, int64_t block, forkattn_dtype dt, int64_t ops) {
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(0, block, 2, 2, 4, dt);
  o.capacity_bytes = entry_bytes(&o, 60) + (size_t)tc_randint(&rng, 0, 100);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  static model md;
  memset(&md, 0, sizeof md);
  md.cap = o.capacity_bytes;
  static int32_t docs[NDOCS][MAXN];
  const int64_t len = 80; /* > 60: some inserts can never fit */
  make_docs(&rng, docs, len, 3);
  handle held[6];
  int nheld = 0;
  char why[512];
  for (int64_t op = 0; op < ops; op++) {
    const double u = tc_uniform(&rng, 0, 1);
    const int32_t *doc = docs[tc_randint(&rng, 0, NDOCS - 1)];
    if (u < 0.4) {
      const int64_t n = tc_uniform(&rng, 0, 1) < 0.05 ? tc_randint(&rng, 61, len) : tc_randint(&rng, 1, 50);
      const uint64_t version = (uint64_t)tc_randint(&rng, 0, 3);
      const int want = model_insert(&md, doc, n, entry_bytes(&o, n), version);
      const int got = insert(ctx, c, &o, doc, n, version, (int)tc_randint(&rng, 0, 2));
      cr_assert_eq(got, want, "op %lld: insert of %lld tokens stored %d, model %d", (long long)op, (long long)n, got, want);
    } else if (u < 0.85 || (nheld == 0 && u < 0.95)) {
      const int64_t n = tc_randint(&rng, 0, len);
      const int mi = model_lookup(&md, doc, n);
      forkattn_kv_entry *e = NULL;
      int64_t m = -1;
      cr_assert_eq(forkattn_kv_cache_lookup(c, doc, n, &e, &m), FORKATTN_OK);
      const int64_t want = mi < 0 ? 0 : md.e[mi].n;
      cr_assert_eq(m, want, "op %lld: lookup of %lld tokens matched %lld, model %lld", (long long)op, (long long)n,
                   (long long)m, (long long)want);
      if (mi >= 0) {
        int64_t bad = kv_check_entry(&o, e, doc, m, md.e[mi].version, why, sizeof why);
        cr_assert_eq(bad, 0, "op %lld: entry of %lld tokens: %s", (long long)op, (long long)m, why);
        if (nheld < 6 && tc_uniform(&rng, 0, 1) < 0.3) {
          held[nheld++] = (handle){e, mi};
        } else {
          forkattn_kv_cache_release(c, e);
          model_release(&md, mi);
        }
      }
    } else if (nheld > 0) {
      const int h = (int)tc_randint(&rng, 0, nheld - 1);
      const mentry *me = &md.e[held[h].mi];
      int64_t bad = kv_check_entry(&o, held[h].e, me->tok, me->n, me->version, why, sizeof why);
      cr_assert_eq(bad, 0, "op %lld: held entry of %lld tokens changed: %s", (long long)op, (long long)me->n, why);
      forkattn_kv_cache_release(c, held[h].e);
      model_release(&md, held[h].mi);
      held[h] = held[--nheld];
    } else {
      forkattn_kv_cache_stats s = stats_of(c); /* nothing held: an empty-budget check */
      cr_assert_eq(s.entries, md.s.entries);
    }
    expect_stats(c, &md, op);
  }
  while (nheld > 0) {
    forkattn_kv_cache_release(c, held[nheld - 1].e);
    model_release(&md, held[--nheld].mi);
  }
  /* every live model entry is there with its K/V */
  for (int i = 0; i < md.count; i++)
    if (md.e[i].live) {
      char what[64];
      snprintf(what, sizeof what, "final entry %d", i);
      expect_lookup(ctx, c, &o, md.e[i].tok, md.e[i].n, md.e[i].n, md.e[i].version, what);
    }
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

Test(kv_cache, random_ops_f32_block4, .timeout = 120) { random_ops("kv_cache/random_f32_b4", 4, FORKATTN_DTYPE_F32, 6000); }
Test(kv_cache, random_ops_bf16_block1, .timeout = 120) { random_ops("kv_cache/random_bf16_b1", 1, FORKATTN_DTYPE_BF16, 4000); }
Test(kv_cache, random_ops_f16_block16, .timeout = 120) { random_ops("kv_cache/random_f16_b16", 16, FORKATTN_DTYPE_F16, 4000); }
Test(kv_cache, random_ops_f32_block7, .timeout = 120) { random_ops("kv_cache/random_f32_b7", 7, FORKATTN_DTYPE_F32, 4000); }

/* ---- dtypes and strided inputs ------------------------------------------------------- */

static void dtypes_and_strides(const char *name, forkattn_dtype dt) {
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(1 << 24, 0, 3, 3, 24, dt);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[3][40];
  for (int mode = 0; mode < 3; mode++) {
    fill_random(&rng, t[mode], 40, 1 << 30);
    t[mode][0] = mode;
    const int64_t n = mode == 0 ? 40 : mode == 1 ? 17 : 1;
    cr_assert_eq(insert(ctx, c, &o, t[mode], n, 3, mode), 1);
    char what[64];
    snprintf(what, sizeof what, "%s input layout %d", name, mode);
    expect_lookup(ctx, c, &o, t[mode], 40, n, 3, what);
  }
  /* head-major input of several rows too */
  cr_assert_eq(insert(ctx, c, &o, t[2], 33, 4, 2), 1);
  expect_lookup(ctx, c, &o, t[2], 40, 33, 4, "head-major, 33 rows");
  /* views: bad layers give data NULL, a NULL entry too */
  forkattn_kv_entry *e = NULL;
  int64_t m;
  cr_assert_eq(forkattn_kv_cache_lookup(c, t[0], 40, &e, &m), FORKATTN_OK);
  cr_assert_not_null(e);
  forkattn_tensor view;
  cr_assert_eq(forkattn_kv_entry_k(e, -1, &view), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(view.data);
  cr_assert_eq(forkattn_kv_entry_v(e, 3, &view), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(view.data);
  cr_assert_eq(forkattn_kv_entry_v(e, 2, &view), FORKATTN_OK);
  cr_assert_not_null(view.data);
  cr_assert_eq(forkattn_kv_entry_k(NULL, 0, &view), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(view.data);
  cr_assert_eq(forkattn_kv_entry_k(e, 0, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  forkattn_kv_cache_release(c, e);
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

Test(kv_cache, f32_strided_inputs) { dtypes_and_strides("kv_cache/f32_strided", FORKATTN_DTYPE_F32); }
Test(kv_cache, bf16_strided_inputs) { dtypes_and_strides("kv_cache/bf16_strided", FORKATTN_DTYPE_BF16); }
Test(kv_cache, f16_strided_inputs) { dtypes_and_strides("kv_cache/f16_strided", FORKATTN_DTYPE_F16); }

/* ---- many threads ------------------------------------------------------------------------- */

#define NTHREADS 8

typedef struct shared {
  forkattn_kv_cache *cache;
  forkattn_kv_cache_options o;
  int32_t docs[NDOCS][MAXN];
  int64_t len, ops;
  uint64_t seed;
} shared;

typedef struct worker {
  const shared *sh;
  int id;
  uint64_t lookups, hits, stored, rejected, failures, bad_entries, budget_violations;
  char why[512];
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  const shared *sh = w->sh;
  const forkattn_kv_cache_options *o = &sh->o;
  tc_rng rng;
  tc_rng_init(&rng, sh->seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(w->id + 1)));
  forkattn_kv_entry *held[3];
  int64_t held_len[3];
  const int32_t *held_doc[3];
  int nheld = 0;
  char why[512];
  for (int64_t op = 0; op < sh->ops; op++) {
    const double u = tc_uniform(&rng, 0, 1);
    const int32_t *doc = sh->docs[tc_randint(&rng, 0, NDOCS - 1)];
    if (u < 0.4) {
      const int64_t n = tc_randint(&rng, 1, sh->len);
      kvin in;
      kv_make(&in, o, doc, n, 0, (int)tc_randint(&rng, 0, 2));
      int stored = -1;
      if (forkattn_kv_cache_insert(sh->cache, doc, n, in.k, in.v, FORKATTN_MEMORY_HOST, &stored) != FORKATTN_OK)
        w->failures++;
      kv_free(&in);
      if (stored == 1) w->stored++;
      else if (stored == 0) w->rejected++;
      else w->failures++;
    } else if (u < 0.9) {
      const int64_t n = tc_randint(&rng, 0, sh->len);
      forkattn_kv_entry *e = NULL;
      int64_t m = -1;
      w->lookups++;
      if (forkattn_kv_cache_lookup(sh->cache, doc, n, &e, &m) != FORKATTN_OK || m < 0 || m > n || (m > 0) != !!e) {
        w->failures++;
        continue;
      }
      if (!e) continue;
      w->hits++;
      if (kv_check_entry(o, e, doc, m, 0, why, sizeof why) && !w->bad_entries++) memcpy(w->why, why, sizeof why);
      if (nheld < 3 && tc_uniform(&rng, 0, 1) < 0.5) {
        held[nheld] = e, held_len[nheld] = m, held_doc[nheld++] = doc;
      } else {
        forkattn_kv_cache_release(sh->cache, e);
      }
    } else if (nheld > 0) {
      const int h = (int)tc_randint(&rng, 0, nheld - 1);
      if (kv_check_entry(o, held[h], held_doc[h], held_len[h], 0, why, sizeof why) && !w->bad_entries++)
        memcpy(w->why, why, sizeof why);
      forkattn_kv_cache_release(sh->cache, held[h]);
      nheld--;
      held[h] = held[nheld], held_len[h] = held_len[nheld], held_doc[h] = held_doc[nheld];
    } else {
      forkattn_kv_cache_stats s;
      if (forkattn_kv_cache_get_stats(sh->cache, &s) != FORKATTN_OK) w->failures++;
      else if (s.bytes > o->capacity_bytes) w->budget_violations++;
    }
  }
  while (nheld > 0) {
    nheld--;
    if (kv_check_entry(o, held[nheld], held_doc[nheld], held_len[nheld], 0, why, sizeof why) && !w->bad_entries++)
      memcpy(w->why, why, sizeof why);
    forkattn_kv_cache_release(sh->cache, held[nheld]);
  }
  return NULL;
}

Test(kv_cache, many_threads, .timeout = 240) {
  const char *name = "kv_cache/many_threads";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  static shared sh;
  sh.o = opts(0, 4, 2, 2, 8, FORKATTN_DTYPE_F32);
  sh.o.capacity_bytes = entry_bytes(&sh.o, 200);
  sh.cache = make_cache(ctx, &sh.o);
  sh.len = 64;
  sh.ops = 4000;
  sh.seed = tc_next(&rng);
  make_docs(&rng, sh.docs, sh.len, 3);
  static worker w[NTHREADS];
  pthread_t tid[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].sh = &sh;
    w[i].id = i;
    cr_assert_eq(pthread_create(&tid[i], NULL, worker_main, &w[i]), 0, "pthread_create");
  }
  uint64_t lookups = 0, hits = 0, stored = 0, rejected = 0;
  for (int i = 0; i < NTHREADS; i++) {
    cr_assert_eq(pthread_join(tid[i], NULL), 0);
    cr_assert_eq(w[i].failures, 0, "thread %d: %llu calls failed", i, (unsigned long long)w[i].failures);
    cr_assert_eq(w[i].bad_entries, 0, "thread %d: %llu entries with wrong K/V, first: %s", i,
                 (unsigned long long)w[i].bad_entries, w[i].why);
    cr_assert_eq(w[i].budget_violations, 0, "thread %d saw bytes above the capacity", i);
    lookups += w[i].lookups, hits += w[i].hits, stored += w[i].stored, rejected += w[i].rejected;
  }
  forkattn_kv_cache_stats s = stats_of(sh.cache);
  cr_assert_eq(s.hits, hits, "stats.hits %llu, threads saw %llu", (unsigned long long)s.hits, (unsigned long long)hits);
  cr_assert_eq(s.misses, lookups - hits, "stats.misses %llu, threads saw %llu", (unsigned long long)s.misses,
               (unsigned long long)(lookups - hits));
  cr_assert_eq(s.insertions, stored, "stats.insertions %llu, threads stored %llu", (unsigned long long)s.insertions,
               (unsigned long long)stored);
  cr_assert_eq(s.rejected, rejected, "stats.rejected %llu, threads saw %llu", (unsigned long long)s.rejected,
               (unsigned long long)rejected);
  cr_assert(s.bytes <= sh.o.capacity_bytes, "bytes %zu above the capacity", s.bytes);
  cr_assert(s.evictions > 0 && hits > 0, "the test should exercise eviction and hits (evictions %llu, hits %llu)",
            (unsigned long long)s.evictions, (unsigned long long)hits);
  /* Every entry is a document prefix: find them all (exact-length lookups),
   * check their K/V, and that they account for stats.entries and stats.bytes. */
  forkattn_kv_entry *found[NDOCS * MAXN];
  int nfound = 0;
  size_t bytes = 0;
  char why[512];
  for (int d = 0; d < NDOCS; d++)
    for (int64_t n = 1; n <= sh.len; n++) {
      forkattn_kv_entry *e = NULL;
      int64_t m = 0;
      cr_assert_eq(forkattn_kv_cache_lookup(sh.cache, sh.docs[d], n, &e, &m), FORKATTN_OK);
      if (m != n) {
        forkattn_kv_cache_release(sh.cache, e);
        continue;
      }
      cr_assert_eq(kv_check_entry(&sh.o, e, sh.docs[d], n, 0, why, sizeof why), 0, "final entry of doc %d, %lld tokens: %s",
                   d, (long long)n, why);
      int dup = 0;
      for (int i = 0; i < nfound; i++) dup |= found[i] == e;
      if (!dup) {
        found[nfound++] = e;
        bytes += entry_bytes(&sh.o, n);
      } else {
        forkattn_kv_cache_release(sh.cache, e);
      }
    }
  cr_assert_eq(nfound, s.entries, "found %d entries, stats say %lld", nfound, (long long)s.entries);
  cr_assert_eq(bytes, s.bytes, "found entries hold %zu bytes, stats say %zu", bytes, s.bytes);
  for (int i = 0; i < nfound; i++) forkattn_kv_cache_release(sh.cache, found[i]);
  forkattn_kv_cache_destroy(sh.cache);
  forkattn_ctx_destroy(ctx);
}

/* ---- bad arguments ---------------------------------------------------------------------- */

static void expect_bad(forkattn_ctx *ctx, forkattn_status st, const char *arg, const char *what) {
  cr_assert_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "%s: got %s, want invalid argument", what,
               forkattn_status_string(st));
  const char *msg = forkattn_ctx_last_error(ctx);
  cr_assert(strstr(msg, arg) != NULL, "%s: message \"%s\" does not name %s", what, msg, arg);
}

Test(kv_cache, bad_create) {
  const char *name = "kv_cache/bad_create";
  forkattn_ctx *ctx = cpu_ctx(name);
  const forkattn_kv_cache_options good = opts(1 << 20, 0, 2, 2, 8, FORKATTN_DTYPE_F32);
  static char sentinel;
  forkattn_kv_cache *c = (forkattn_kv_cache *)(void *)&sentinel;
  forkattn_kv_cache_options o;
#define BAD_OPT(field, value, arg)                                                               \
  do {                                                                                           \
    o = good;                                                                                    \
    o.field = value;                                                                             \
    c = (forkattn_kv_cache *)(void *)&sentinel;                                                  \
    expect_bad(ctx, forkattn_kv_cache_create(ctx, &o, &c), arg, #field " = " #value);            \
    cr_assert_null(c, "%s: *cache must be NULL after a failed create", #field " = " #value);     \
  } while (0)
  BAD_OPT(capacity_bytes, 0, "capacity_bytes");
  BAD_OPT(block_tokens, -1, "block_tokens");
  BAD_OPT(layers, 0, "layers");
  BAD_OPT(layers, -3, "layers");
  BAD_OPT(kv_heads, 0, "kv_heads");
  BAD_OPT(head_dim, 0, "head_dim");
  BAD_OPT(head_dim, 257, "head_dim");
  BAD_OPT(dtype, (forkattn_dtype)7, "dtype");
  BAD_OPT(memory, (forkattn_memory)5, "memory");
  BAD_OPT(kv_heads, INT64_MAX / 2, "opt");
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU) BAD_OPT(memory, FORKATTN_MEMORY_DEVICE, "memory");
#undef BAD_OPT
  expect_bad(ctx, forkattn_kv_cache_create(ctx, NULL, &c), "opt", "opt NULL");
  expect_bad(ctx, forkattn_kv_cache_create(ctx, &good, NULL), "cache", "cache NULL");
  cr_assert_eq(forkattn_kv_cache_create(NULL, &good, &c), FORKATTN_ERR_INVALID_ARGUMENT, "ctx NULL");
  forkattn_kv_cache_destroy(NULL);
  forkattn_ctx_destroy(ctx);
}

Test(kv_cache, bad_calls_change_nothing) {
  const char *name = "kv_cache/bad_calls";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(1 << 20, 4, 2, 2, 8, FORKATTN_DTYPE_BF16);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[12];
  fill_random(&rng, t, 12, 100);
  cr_assert_eq(insert(ctx, c, &o, t, 5, 1, 0), 1);
  expect_lookup(ctx, c, &o, t, 12, 5, 1, "before");
  const forkattn_kv_cache_stats before = stats_of(c);
  kvin in;
  kv_make(&in, &o, t, 9, 2, 1);
  forkattn_tensor k[2], v[2];
  int stored = 77;
#define BAD_INSERT(tok, n, kk, vv, mem, arg, what)                                                  \
  do {                                                                                              \
    expect_bad(ctx, forkattn_kv_cache_insert(c, tok, n, kk, vv, mem, &stored), arg, what);          \
    cr_assert_eq(stored, 77, "%s: *stored written on an error", what);                             \
  } while (0)
#define RESET() (memcpy(k, in.k, sizeof k), memcpy(v, in.v, sizeof v))
  RESET();
  BAD_INSERT(t, 0, k, v, FORKATTN_MEMORY_HOST, "n", "n = 0");
  BAD_INSERT(t, -2, k, v, FORKATTN_MEMORY_HOST, "n", "n = -2");
  BAD_INSERT(NULL, 9, k, v, FORKATTN_MEMORY_HOST, "tokens", "tokens NULL");
  BAD_INSERT(t, 9, NULL, v, FORKATTN_MEMORY_HOST, "k", "k NULL");
  BAD_INSERT(t, 9, k, NULL, FORKATTN_MEMORY_HOST, "v", "v NULL");
  BAD_INSERT(t, 9, k, v, (forkattn_memory)3, "memory", "memory 3");
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU)
    BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_DEVICE, "memory", "device memory on the cpu backend");
  BAD_INSERT(t, 8, k, v, FORKATTN_MEMORY_HOST, "k[0]", "rows != n");
  RESET(), k[1].dtype = FORKATTN_DTYPE_F32;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "k[1]", "wrong dtype");
  RESET(), v[1].rows = 8;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "v[1]", "v rows != n");
  RESET(), v[0].heads = 1;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "v[0]", "wrong heads");
  RESET(), k[0].head_dim = 4;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "k[0]", "wrong head_dim");
  RESET(), k[1].row_stride = 0;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "k[1]", "row_stride 0");
  RESET(), v[1].head_stride = 3, v[1].row_stride = 5;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "v[1]", "overlapping strides");
  RESET(), v[0].data = NULL;
  BAD_INSERT(t, 9, k, v, FORKATTN_MEMORY_HOST, "v[0]", "data NULL");
  RESET();
  cr_assert_eq(forkattn_kv_cache_insert(NULL, t, 9, k, v, FORKATTN_MEMORY_HOST, &stored), FORKATTN_ERR_INVALID_ARGUMENT);
#undef BAD_INSERT
#undef RESET
  static char sentinel;
  forkattn_kv_entry *e = (forkattn_kv_entry *)(void *)&sentinel;
  int64_t m = 55;
  expect_bad(ctx, forkattn_kv_cache_lookup(c, t, -1, &e, &m), "n", "lookup n = -1");
  expect_bad(ctx, forkattn_kv_cache_lookup(c, NULL, 3, &e, &m), "tokens", "lookup tokens NULL");
  expect_bad(ctx, forkattn_kv_cache_lookup(c, t, 3, NULL, &m), "entry", "lookup entry NULL");
  cr_assert(e == (forkattn_kv_entry *)(void *)&sentinel && m == 55, "lookup outputs written on an error");
  cr_assert_eq(forkattn_kv_cache_lookup(NULL, t, 3, &e, &m), FORKATTN_ERR_INVALID_ARGUMENT);
  expect_bad(ctx, forkattn_kv_cache_get_stats(c, NULL), "stats", "stats NULL");
  cr_assert_eq(forkattn_kv_cache_get_stats(NULL, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  const forkattn_kv_cache_stats after = stats_of(c);
  cr_assert(!memcmp(&before, &after, sizeof before), "bad calls changed the statistics");
  expect_lookup(ctx, c, &o, t, 12, 5, 1, "after");
  /* valid edge cases: n = 0 with tokens NULL is a miss; matched may be NULL */
  cr_assert_eq(forkattn_kv_cache_lookup(c, NULL, 0, &e, &m), FORKATTN_OK);
  cr_assert(e == NULL && m == 0);
  cr_assert_eq(forkattn_kv_cache_lookup(c, t, 6, &e, NULL), FORKATTN_OK);
  cr_assert_not_null(e);
  forkattn_kv_cache_release(c, e);
  kv_free(&in);
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

/* Destroy with an entry still held frees everything (the holder must not use
 * it afterwards): nothing leaks (LeakSanitizer builds). */
Test(kv_cache, destroy_frees_everything) {
  const char *name = "kv_cache/destroy";
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(1 << 20, 2, 1, 1, 8, FORKATTN_DTYPE_F32);
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[40];
  fill_random(&rng, t, 40, 5);
  for (int64_t n = 1; n <= 40; n++) insert(ctx, c, &o, t, n, 0, 0);
  forkattn_kv_entry *e;
  int64_t m;
  cr_assert_eq(forkattn_kv_cache_lookup(c, t, 40, &e, &m), FORKATTN_OK);
  cr_assert_eq(m, 40);
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

/* ---- allocation failures (FORKATTN_ALLOC_TEST builds) ----------------------------------- */

Test(kv_cache, allocation_failures) {
  const char *name = "kv_cache/allocation_failures";
  if (!forkattn_test_fail_alloc_after) cr_skip_test("%s: needs a -DFORKATTN_ALLOC_TEST=ON build", name);
  forkattn_ctx *ctx = cpu_ctx(name);
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(1 << 20, 2, 2, 1, 8, FORKATTN_DTYPE_F32);
  for (int64_t k = 0;; k++) { /* fail the k-th allocation of create */
    forkattn_kv_cache *c = NULL;
    forkattn_test_fail_alloc_after(k);
    forkattn_status st = forkattn_kv_cache_create(ctx, &o, &c);
    forkattn_test_fail_alloc_after(-1);
    if (st == FORKATTN_OK) {
      forkattn_kv_cache_destroy(c);
      break;
    }
    cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "create, allocation %lld failing: %s", (long long)k,
                 forkattn_status_string(st));
    cr_assert_null(c);
  }
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[300][24];
  int64_t ok = 0, failed = 0;
  for (int i = 0; i < 300; i++) { /* the 0th, 1st, 2nd ... allocation of inserts fails in turn */
    fill_random(&rng, t[i], 24, 1 << 20);
    const int64_t n = tc_randint(&rng, 1, 24);
    kvin in;
    kv_make(&in, &o, t[i], n, 0, (int)tc_randint(&rng, 0, 2));
    const forkattn_kv_cache_stats before = stats_of(c);
    int stored = -1;
    forkattn_test_fail_alloc_after(i % 4);
    forkattn_status st = forkattn_kv_cache_insert(c, t[i], n, in.k, in.v, FORKATTN_MEMORY_HOST, &stored);
    forkattn_test_fail_alloc_after(-1);
    kv_free(&in);
    if (st == FORKATTN_OK) {
      ok++;
      cr_assert_eq(stored, 1);
      expect_lookup(ctx, c, &o, t[i], n, n, 0, "stored despite a failing allocation (growth)");
    } else {
      cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "insert %d: %s", i, forkattn_status_string(st));
      failed++;
      const forkattn_kv_cache_stats after = stats_of(c);
      cr_assert(!memcmp(&before, &after, sizeof before), "insert %d: a failed insert changed the cache", i);
    }
  }
  cr_assert(ok > 0 && failed > 0, "%lld inserts succeeded, %lld failed: both should happen", (long long)ok,
            (long long)failed);
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}

/* ---- device memory (GPU backend) ------------------------------------------------------------ */

Test(kv_cache, device_memory) {
  const char *name = "kv_cache/device_memory";
  forkattn_ctx *ctx = cpu_ctx(name);
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU) {
    forkattn_ctx_destroy(ctx);
    cr_skip_test("%s: needs the gpu backend (this context runs on the host)", name);
  }
  tc_rng rng = tc_rng_for(name);
  forkattn_kv_cache_options o = opts(1 << 24, 4, 2, 2, 16, FORKATTN_DTYPE_BF16);
  o.memory = FORKATTN_MEMORY_DEVICE;
  forkattn_kv_cache *c = make_cache(ctx, &o);
  int32_t t[3][30];
  for (int mode = 0; mode < 3; mode++) {
    fill_random(&rng, t[mode], 30, 1000);
    t[mode][0] = mode;
    const int64_t n = 10 + 7 * mode;
    kvin in;
    kv_make(&in, &o, t[mode], n, 5, mode);
    forkattn_memory src = mode == 1 ? FORKATTN_MEMORY_HOST : FORKATTN_MEMORY_DEVICE;
    void *dev[2 * MAXL] = {0};
    forkattn_tensor k[MAXL], v[MAXL];
    memcpy(k, in.k, sizeof k);
    memcpy(v, in.v, sizeof v);
    if (src == FORKATTN_MEMORY_DEVICE) /* same strides, device copies of the whole spans */
      for (int64_t i = 0; i < 2 * o.layers; i++) {
        forkattn_tensor *tt = i % 2 ? &v[i / 2] : &k[i / 2];
        const size_t span = (size_t)((n - 1) * tt->row_stride + (tt->heads - 1) * tt->head_stride + tt->head_dim) * 2;
        cr_assert_eq(forkattn_device_malloc(ctx, span, &dev[i]), FORKATTN_OK);
        cr_assert_eq(forkattn_memcpy(ctx, dev[i], FORKATTN_MEMORY_DEVICE, tt->data, FORKATTN_MEMORY_HOST, span), FORKATTN_OK);
        tt->data = dev[i];
      }
    int stored = -1;
    cr_assert_eq(forkattn_kv_cache_insert(c, t[mode], n, k, v, src, &stored), FORKATTN_OK, "%s",
                 forkattn_ctx_last_error(ctx));
    cr_assert_eq(stored, 1);
    for (int64_t i = 0; i < 2 * o.layers; i++) forkattn_device_free(ctx, dev[i]);
    kv_free(&in);
    forkattn_kv_entry *e = NULL;
    int64_t m = 0;
    cr_assert_eq(forkattn_kv_cache_lookup(c, t[mode], 30, &e, &m), FORKATTN_OK);
    cr_assert_eq(m, n);
    /* copy the device views back and compare with the expected bits */
    const uint64_t key = prefix_key(t[mode], n, 5);
    for (int64_t l = 0; l < o.layers; l++)
      for (int which = 0; which < 2; which++) {
        forkattn_tensor tv;
        cr_assert_eq(which ? forkattn_kv_entry_v(e, l, &tv) : forkattn_kv_entry_k(e, l, &tv), FORKATTN_OK);
        const size_t bytes = (size_t)(n * o.kv_heads * o.head_dim) * 2;
        uint16_t *host = malloc(bytes);
        cr_assert_eq(forkattn_memcpy(ctx, host, FORKATTN_MEMORY_HOST, tv.data, FORKATTN_MEMORY_DEVICE, bytes), FORKATTN_OK);
        for (int64_t r = 0; r < n; r++)
          for (int64_t h = 0; h < o.kv_heads; h++)
            for (int64_t cc = 0; cc < o.head_dim; cc++)
              cr_assert_eq(host[(r * o.kv_heads + h) * o.head_dim + cc], (uint16_t)elem_bits(key, &o, n, l, which, r, h, cc),
                           "mode %d layer %lld %s element (%lld, %lld, %lld)", mode, (long long)l, which ? "v" : "k",
                           (long long)r, (long long)h, (long long)cc);
        free(host);
      }
    forkattn_kv_cache_release(c, e);
  }
  forkattn_kv_cache_destroy(c);
  forkattn_ctx_destroy(ctx);
}
