/* Segment plans kept per context, keyed by the layout's content.
 *
 * A trainer calls with the same layout for every layer, forward and backward,
 * and planning it (with its block lists, memoized on the plan) costs from
 * microseconds to milliseconds a call for thousands of sequences or tree
 * nodes. The key is a copy of what defines the plan, compared in full on
 * lookup: the library keeps no pointer to caller data, and the caller may
 * change its arrays between calls. A context runs one call at a time, so
 * there is no locking; a call looks up once, at its start, and its plan is
 * then the most recently used entry, so only a later lookup could evict it.
 * FORKATTN_PLAN_CACHE=0 (read at context creation) plans every call afresh. */
#ifndef FORKATTN_PLAN_CACHE_H
#define FORKATTN_PLAN_CACHE_H
#include <stdint.h>

#include "context_internal.h"
#include "segment_plan.h"

/* Layout kinds, the first word of a key: plans of different builders never
 * match, whatever their arrays. */
enum { FA_PLAN_KEY_PREFIX = 1, FA_PLAN_KEY_TREE, FA_PLAN_KEY_PREFIX_CACHED };

/* What defines a plan: the kind and its builder's scalars (unused words 0),
 * and up to two arrays in the caller's memory, copied into the cache on a
 * miss and never kept. */
typedef struct fa_plan_key {
  int64_t head[5];
  const int64_t *part[2]; /* may be NULL when its len is 0 */
  int64_t len[2];         /* elements */
} fa_plan_key;

/* Build the plan of arg; 0, or -1 on allocation failure. */
typedef int (*fa_plan_builder)(const void *arg, fa_plan *plan);

/* The plan a call runs: the context's cached plan for key (built by build(arg)
 * and kept on a miss), or, with the cache off or out of memory, one built into
 * *own. *plan points at one of them; the caller does fa_plan_free(own) when
 * done (own is zeroed when unused). Fails (FORKATTN_ERR_OUT_OF_MEMORY, with a
 * message) only when the plan itself cannot be built: the cache's own
 * allocations never fail a call. */
forkattn_status fa_plan_for_call(forkattn_ctx *ctx, const fa_plan_key *key, fa_plan_builder build, const void *arg,
                                 fa_plan *own, const fa_plan **plan);

/* Free a context's cache and its plans (NULL: nothing). */
void fa_plan_cache_free(struct fa_plan_cache *cache);

/* Read FORKATTN_PLAN_CACHE: 1 (on: unset, empty or "1"), 0 ("0") or -1 (any
 * other value). */
int fa_plan_cache_env(void);

#endif
