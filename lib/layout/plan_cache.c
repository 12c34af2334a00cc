/* The context's plan cache (plan_cache.h): a few entries, least recently
 * used evicted, each a plan with the full copy of its key. */
#include "plan_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"

/* Layouts a trainer alternates between (a group's prefix layout, its tree,
 * a cached-prefix step) fit with room to spare; a miss costs one plan. */
#define FA_PLAN_CACHE_ENTRIES 8

typedef struct fa_plan_entry {
  uint64_t used; /* tick of the last lookup that returned it; 0: empty */
  int64_t head[5], len[2];
  int64_t *words; /* the key's arrays, back to back */
  fa_plan plan;
} fa_plan_entry;

struct fa_plan_cache {
  uint64_t tick;
  fa_plan_entry entry[FA_PLAN_CACHE_ENTRIES];
};

int fa_plan_cache_env(void) {
  const char *e = getenv("FORKATTN_PLAN_CACHE");
  if (!e || !*e || !strcmp(e, "1")) return 1;
  return strcmp(e, "0") ? -1 : 0;
}

static void fa_plan_entry_clear(fa_plan_entry *e) {
  fa_plan_free(&e->plan);
  fa_free(e->words);
  memset(e, 0, sizeof *e);
}

void fa_plan_cache_free(struct fa_plan_cache *cache) {
  if (!cache) return;
  for (int i = 0; i < FA_PLAN_CACHE_ENTRIES; i++) fa_plan_entry_clear(&cache->entry[i]);
  fa_free(cache);
}

static int fa_plan_key_matches(const fa_plan_entry *e, const fa_plan_key *key) {
  if (!e->used || memcmp(e->head, key->head, sizeof e->head) || e->len[0] != key->len[0] || e->len[1] != key->len[1])
    return 0;
  const int64_t *w = e->words;
  for (int i = 0; i < 2; w += key->len[i++])
    if (key->len[i] && memcmp(w, key->part[i], sizeof *w * (size_t)key->len[i])) return 0;
  return 1;
}

/* A copy of the key's arrays, or NULL (allocation failure, or a size that
 * overflows). */
static int64_t *fa_plan_key_copy(const fa_plan_key *key) {
  int64_t words;
  if (__builtin_add_overflow(key->len[0], key->len[1], &words)) return NULL;
  int64_t *w = fa_malloc_array(words, sizeof *w);
  if (!w) return NULL;
  if (key->len[0]) memcpy(w, key->part[0], sizeof *w * (size_t)key->len[0]);
  if (key->len[1]) memcpy(w + key->len[0], key->part[1], sizeof *w * (size_t)key->len[1]);
  return w;
}

static void fa_plan_cache_log(const forkattn_ctx *ctx, const fa_plan_key *key, const char *what) {
  static const char *const kind[] = {"?", "prefix", "tree", "cached prefix"};
  if (ctx->verbose)
    fprintf(stderr, "forkattn: plan cache %s (%s layout, %lld words)\n", what,
            kind[key->head[0] >= 1 && key->head[0] <= 3 ? key->head[0] : 0],
            (long long)(key->len[0] + key->len[1]));
}

/* The cached plan of key, built and inserted on a miss; NULL when the cache
 * cannot hold it (then the caller plans without it), *failed = 1 when the
 * plan itself could not be built. */
static const fa_plan *fa_plan_cache_get(forkattn_ctx *ctx, const fa_plan_key *key, fa_plan_builder build,
                                        const void *arg, int *failed) {
  struct fa_plan_cache *c = ctx->plan_cache;
  fa_plan_entry *victim = &c->entry[0];
  for (int i = 0; i < FA_PLAN_CACHE_ENTRIES; i++) {
    fa_plan_entry *e = &c->entry[i];
    if (fa_plan_key_matches(e, key)) {
      e->used = ++c->tick;
      fa_plan_cache_log(ctx, key, "hit");
      return &e->plan;
    }
    if (e->used < victim->used) victim = e; /* an empty slot (0) first, else the least recently used */
  }
  int64_t *words = fa_plan_key_copy(key);
  if (!words) return NULL;
  fa_plan plan;
  if (build(arg, &plan)) { /* the plan itself: uncached, it would fail the same way */
    fa_free(words);
    *failed = 1;
    return NULL;
  }
  fa_plan_cache_log(ctx, key, victim->used ? "miss, evicting the least recently used plan" : "miss");
  fa_plan_entry_clear(victim);
  victim->used = ++c->tick;
  memcpy(victim->head, key->head, sizeof victim->head);
  memcpy(victim->len, key->len, sizeof victim->len);
  victim->words = words;
  victim->plan = plan;
  return &victim->plan;
}

forkattn_status fa_plan_for_call(forkattn_ctx *ctx, const fa_plan_key *key, fa_plan_builder build, const void *arg,
                                 fa_plan *own, const fa_plan **plan) {
  memset(own, 0, sizeof *own);
  *plan = NULL;
  int failed = 0;
  if (ctx->plan_cache_on && !ctx->plan_cache) ctx->plan_cache = fa_calloc(1, sizeof *ctx->plan_cache);
  if (ctx->plan_cache_on && ctx->plan_cache) *plan = fa_plan_cache_get(ctx, key, build, arg, &failed);
  if (!*plan && !failed) {
    if (ctx->plan_cache_on) fa_plan_cache_log(ctx, key, "cannot allocate: planning this call alone");
    failed = build(arg, own) != 0;
    *plan = own;
  }
  return failed ? fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "layout: cannot allocate the segment plan") : FORKATTN_OK;
}
