/*
 * test_plan_cache.c - the context's plan cache (lib/layout/plan_cache.h) never
 * changes a result: every call on a caching context gives bitwise the outputs
 * of a fresh context planning alone (FORKATTN_PLAN_CACHE=0), f32 on the CPU.
 *
 *  prefix, varlen, tree:  forward and backward, twice each (the second a hit).
 *  splits:                equal row counts, different splits, called A B A B.
 *  in place:              the caller rewrites its offsets (or parents) between calls.
 *  eviction:              more layouts than entries, twice round.
 *  masks, kinds:          causal vs bidirectional of one offsets array; a tree
 *                         and a prefix layout over the same array.
 *  cached prefix, KL:     the other planners on the cache, block sizes apart.
 *  log:                   a verbose context's hits, misses and evictions (LRU).
 *
 * Outputs are poisoned (NaN) before each call and every element must be
 * written, guards untouched. FORKATTN_TEST_SEED=<n> reproduces the data.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "forkattn.h"
#include "test_common.h"
#include "tree_builder.h"

enum { HQ = 4, HKV = 2, D = 16, MAXN = 32 };
#define SCALE 0.25f

/* A call's layout: the caller's arrays, read at each call. block > 0 or
 * cached: forkattn_prefix_cached(_block); kl: StreamKL over the layout. */
typedef struct pc_layout {
  const forkattn_prefix_layout *prefix;
  const forkattn_tree_layout *tree;
  int cached, kl;
  int64_t block;
} pc_layout;

/* Inputs and poisoned outputs of one call; q rows tq, key rows tk. */
enum { IN_Q, IN_K, IN_V, IN_DOUT, OUT_O, OUT_LSE, OUT_DQ, OUT_DK, OUT_DV, NBUF };
typedef struct pc_call {
  tc_buf b[NBUF];
  forkattn_tensor t[NBUF]; /* lse: its data only */
  int64_t tq, tk;
} pc_call;

static void pc_rows(const pc_layout *l, int64_t *tq, int64_t *tk) {
  if (l->tree) {
    *tq = *tk = l->tree->num_nodes ? l->tree->node_offsets[l->tree->num_nodes] : 0;
    return;
  }
  const int64_t n = l->prefix->num_responses, r = n ? l->prefix->response_offsets[n] : 0;
  *tk = l->prefix->prompt_len + r;
  *tq = l->cached ? r : *tk;
}

static void pc_call_init(pc_call *c, const pc_layout *l, uint64_t seed) {
  memset(c, 0, sizeof *c);
  pc_rows(l, &c->tq, &c->tk);
  const int64_t rows[NBUF] = {c->tq, c->tk, c->tk, c->tq, c->tq, c->tq, c->tq, c->tk, c->tk};
  const int64_t heads[NBUF] = {HQ, HKV, HKV, HQ, HQ, HQ, HQ, HKV, HKV};
  tc_rng rng;
  tc_rng_init(&rng, seed);
  for (int i = 0; i < NBUF; i++) {
    c->t[i] = tc_buf_contiguous(&c->b[i], FORKATTN_DTYPE_F32, rows[i], heads[i], i == OUT_LSE ? 1 : D);
    cr_assert(c->b[i].alloc, "out of memory");
    if (i < OUT_O) tc_fill_tensor(&rng, &c->t[i], -1.0, 1.0);
    else tc_buf_poison(&c->b[i]);
  }
}

static void pc_call_free(pc_call *c) {
  for (int i = 0; i < NBUF; i++) tc_buf_free(&c->b[i]);
}

/* StreamKL: teacher (q, k), student (dout as queries, v as keys); kl into lse,
 * the backward's student gradients into dq and dk. */
static forkattn_status pc_kl(forkattn_ctx *ctx, const pc_layout *l, pc_call *c, int bwd) {
  const forkattn_layout lay = {l->prefix, l->tree};
  forkattn_tensor *t = c->t;
  float *stats = calloc((size_t)(c->tq * HQ * FORKATTN_KL_STATS), sizeof *stats);
  float *dkl = malloc(sizeof *dkl * (size_t)(c->tq * HQ));
  for (int64_t i = 0; i < c->tq * HQ; i++) dkl[i] = 1.0f / (float)(1 + i % 5);
  forkattn_status st = forkattn_kl_fwd(ctx, &lay, &t[IN_Q], &t[IN_K], &t[IN_DOUT], &t[IN_V], NULL, NULL,
                                       t[OUT_LSE].data, stats, NULL, FORKATTN_MEMORY_HOST);
  if (!st && bwd)
    st = forkattn_kl_bwd(ctx, &lay, &t[IN_Q], &t[IN_K], &t[IN_DOUT], &t[IN_V], NULL, NULL, stats, dkl, &t[OUT_DQ],
                         &t[OUT_DK], NULL, NULL, FORKATTN_MEMORY_HOST);
  free(stats);
  free(dkl);
  return st;
}

/* Forward then backward of l on ctx into a fresh pc_call; every output element must be written. */
static void pc_run(forkattn_ctx *ctx, const pc_layout *l, uint64_t seed, pc_call *c) {
  pc_call_init(c, l, seed);
  forkattn_tensor *t = c->t;
  float *lse = t[OUT_LSE].data;
  forkattn_status st;
  if (l->kl) {
    st = pc_kl(ctx, l, c, 1);
  } else if (l->tree) {
    st = forkattn_tree_fwd(ctx, l->tree, &t[IN_Q], &t[IN_K], &t[IN_V], &t[OUT_O], lse, SCALE, FORKATTN_MEMORY_HOST);
    if (!st)
      st = forkattn_tree_bwd(ctx, l->tree, &t[IN_Q], &t[IN_K], &t[IN_V], &t[OUT_O], &t[IN_DOUT], lse, &t[OUT_DQ],
                             &t[OUT_DK], &t[OUT_DV], SCALE, FORKATTN_MEMORY_HOST);
  } else if (l->cached) {
    st = forkattn_prefix_cached_block_fwd(ctx, l->prefix, l->block, &t[IN_Q], &t[IN_K], &t[IN_V], &t[OUT_O], lse,
                                          SCALE, FORKATTN_MEMORY_HOST);
    if (!st)
      st = forkattn_prefix_cached_block_bwd(ctx, l->prefix, l->block, &t[IN_Q], &t[IN_K], &t[IN_V], &t[OUT_O],
                                            &t[IN_DOUT], lse, &t[OUT_DQ], &t[OUT_DK], &t[OUT_DV], SCALE,
                                            FORKATTN_MEMORY_HOST);
  } else {
    st = forkattn_prefix_fwd(ctx, l->prefix, &t[IN_Q], &t[IN_K], &t[IN_V], &t[OUT_O], lse, SCALE,
                             FORKATTN_MEMORY_HOST);
    if (!st)
      st = forkattn_prefix_bwd(ctx, l->prefix, &t[IN_Q], &t[IN_K], &t[IN_V], &t[OUT_O], &t[IN_DOUT], lse, &t[OUT_DQ],
                               &t[OUT_DK], &t[OUT_DV], SCALE, FORKATTN_MEMORY_HOST);
  }
  cr_assert_eq(st, FORKATTN_OK, "call failed: %s", forkattn_ctx_last_error(ctx));
  for (int i = OUT_O; i < NBUF; i++) {
    if (l->kl && (i == OUT_O || i == OUT_DV)) continue; /* StreamKL writes neither */
    const tc_write_check w = tc_buf_check(&c->b[i]);
    cr_assert(w.unwritten == 0 && w.guard_bad == 0, "output %d: %zu elements unwritten (first %zu), %zu guard bytes", i,
              w.unwritten, w.first_unwritten, w.guard_bad);
  }
}

static forkattn_ctx *pc_ctx(int cache, int verbose) {
  setenv("FORKATTN_PLAN_CACHE", cache ? "1" : "0", 1); /* read by forkattn_ctx_create */
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.verbose = verbose;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK, "%s", forkattn_ctx_create_error());
  return ctx;
}

static int pc_same(const pc_call *a, const pc_call *b) {
  for (int i = OUT_O; i < NBUF; i++)
    if (a->b[i].elems != b->b[i].elems || memcmp(a->b[i].data, b->b[i].data, a->b[i].elems * sizeof(float)))
      return 0;
  return 1;
}

/* l on ctx equals l on a fresh context without the cache, bit for bit. */
static void pc_check(forkattn_ctx *ctx, const pc_layout *l, uint64_t seed, const char *what) {
  pc_call got, want;
  forkattn_ctx *fresh = pc_ctx(0, 0);
  pc_run(fresh, l, seed, &want);
  forkattn_ctx_destroy(fresh);
  pc_run(ctx, l, seed, &got);
  cr_assert(pc_same(&got, &want), "%s: cached results differ from a fresh uncached context", what);
  pc_call_free(&got);
  pc_call_free(&want);
}

/* Random responses: offsets of n lengths in [lo, hi]. */
static void pc_offsets(tc_rng *rng, int64_t *off, int64_t n, int64_t lo, int64_t hi) {
  off[0] = 0;
  for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(rng, lo, hi);
}

/* Every test: a caching context and its own random stream. */
static forkattn_ctx *ctx;
static tc_rng rng;

static void pc_setup(void) {
  ctx = pc_ctx(1, 0);
  rng = tc_rng_for(criterion_current_test->name);
}

static void pc_teardown(void) { forkattn_ctx_destroy(ctx); }

TestSuite(plan_cache, .init = pc_setup, .fini = pc_teardown);

/* A prefix layout of P prompt rows and n responses of lo..hi rows, twice on ctx (the second a hit). */
static void pc_check_prefix_twice(int64_t P, int64_t n, int64_t lo, int64_t hi,
                                  forkattn_mask mask, const char *what) {
  int64_t off[MAXN + 1];
  pc_offsets(&rng, off, n, lo, hi);
  const forkattn_prefix_layout lay = {P, n, off, mask};
  const pc_layout l = {.prefix = &lay};
  for (int rep = 0; rep < 2; rep++) pc_check(ctx, &l, tc_next(&rng), what);
}

Test(plan_cache, prefix_bitwise) {
  for (int causal = 0; causal < 2; causal++) {
    const int64_t P = tc_randint(&rng, 1, 40), n = tc_randint(&rng, 1, 6);
    pc_check_prefix_twice(P, n, 0, 30, causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL,
                          "prefix"); /* empty responses too */
  }
}

Test(plan_cache, varlen_bitwise) {
  pc_check_prefix_twice(0, 20, 1, 12, FORKATTN_MASK_CAUSAL, "varlen");
}

Test(plan_cache, tree_bitwise) {
  tt_tree t;
  tt_random_trie(&t, &rng, 16, 6, 12);
  tt_packed p;
  tt_pack(&p, &t, 0);
  const pc_layout l = {.tree = &p.layout};
  for (int rep = 0; rep < 2; rep++) pc_check(ctx, &l, tc_next(&rng), "tree");
  tt_packed_free(&p);
  tt_free(&t);
}

Test(plan_cache, equal_rows_different_splits) {
  const int64_t off_a[4] = {0, 10, 30, 40}, off_b[4] = {0, 20, 25, 40};
  const forkattn_prefix_layout a = {8, 3, off_a, FORKATTN_MASK_CAUSAL}, b = {8, 3, off_b, FORKATTN_MASK_CAUSAL};
  const pc_layout la = {.prefix = &a}, lb = {.prefix = &b};
  const uint64_t seed = tc_next(&rng);
  for (int rep = 0; rep < 2; rep++) {
    pc_check(ctx, &la, seed, "split A");
    pc_check(ctx, &lb, seed, "split B");
  }
  pc_call x, y; /* the two splits do give different results on the same inputs */
  pc_run(ctx, &la, seed, &x);
  pc_run(ctx, &lb, seed, &y);
  cr_assert(!pc_same(&x, &y), "splits A and B should differ");
  pc_call_free(&x);
  pc_call_free(&y);
}

Test(plan_cache, arrays_changed_in_place) {
  int64_t off[5] = {0, 7, 19, 20, 33};
  const forkattn_prefix_layout lay = {5, 4, off, FORKATTN_MASK_CAUSAL};
  const pc_layout l = {.prefix = &lay};
  pc_check(ctx, &l, tc_next(&rng), "offsets before");
  off[1] = 12, off[2] = 13, off[3] = 30; /* same responses and rows, other split */
  pc_check(ctx, &l, tc_next(&rng), "offsets rewritten");
  int64_t node_off[5] = {0, 9, 15, 22, 30}, par[4] = {-1, 0, 1, 1};
  const forkattn_tree_layout tree = {4, node_off, par};
  const pc_layout lt = {.tree = &tree};
  pc_check(ctx, &lt, tc_next(&rng), "parents before");
  par[3] = 0; /* same offsets, another tree */
  pc_check(ctx, &lt, tc_next(&rng), "parents rewritten");
}

Test(plan_cache, eviction) {
  enum { NL = 12 }; /* more than the cache's entries */
  int64_t off[NL][5];
  forkattn_prefix_layout lay[NL];
  for (int i = 0; i < NL; i++) {
    pc_offsets(&rng, off[i], 4, 1, 9);
    lay[i] = (forkattn_prefix_layout){i % 3, 4, off[i], i % 2 ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL};
  }
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < NL; i++) {
      const pc_layout l = {.prefix = &lay[i]};
      pc_check(ctx, &l, tc_next(&rng), "eviction");
    }
}

Test(plan_cache, causal_vs_bidirectional) {
  int64_t off[4];
  pc_offsets(&rng, off, 3, 4, 20);
  const forkattn_prefix_layout c = {6, 3, off, FORKATTN_MASK_CAUSAL}, b = {6, 3, off, FORKATTN_MASK_BIDIRECTIONAL};
  const pc_layout lc = {.prefix = &c}, lb = {.prefix = &b};
  for (int rep = 0; rep < 2; rep++) {
    pc_check(ctx, &lc, tc_next(&rng), "causal");
    pc_check(ctx, &lb, tc_next(&rng), "bidirectional");
  }
}

Test(plan_cache, tree_and_prefix_same_array) {
  const int64_t arr[5] = {0, 5, 9, 14, 20}, chain[4] = {-1, 0, 1, 2};
  const forkattn_prefix_layout pre = {0, 4, arr, FORKATTN_MASK_CAUSAL}; /* four sequences */
  const forkattn_tree_layout tree = {4, arr, chain};                     /* one sequence of 20 rows */
  const pc_layout lp = {.prefix = &pre}, lt = {.tree = &tree};
  const uint64_t seed = tc_next(&rng);
  for (int rep = 0; rep < 2; rep++) {
    pc_check(ctx, &lp, seed, "prefix over the array");
    pc_check(ctx, &lt, seed, "tree over the array");
  }
}

Test(plan_cache, cached_prefix_and_kl) {
  int64_t off[4];
  pc_offsets(&rng, off, 3, 5, 17);
  const forkattn_prefix_layout lay = {12, 3, off, FORKATTN_MASK_CAUSAL};
  const int64_t blocks[5] = {2, 3, 2, 1, INT64_MAX}; /* block-causal, causal, bidirectional */
  for (int rep = 0; rep < 2; rep++) {
    for (int i = 0; i < 5; i++) {
      const pc_layout l = {.prefix = &lay, .cached = 1, .block = blocks[i]};
      pc_check(ctx, &l, tc_next(&rng), "cached prefix");
    }
    const pc_layout kl = {.prefix = &lay, .kl = 1};
    pc_check(ctx, &kl, tc_next(&rng), "StreamKL");
  }
}

/* Lines containing `what` that a verbose context logs while it runs `calls`. */
static int pc_count_log(forkattn_ctx *vctx, const pc_layout *const *calls, int ncalls, const char *what) {
  char path[] = "/tmp/test_plan_cache_XXXXXX";
  const int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  for (int i = 0; i < ncalls; i++) {
    pc_call c;
    pc_run(vctx, calls[i], 1, &c);
    pc_call_free(&c);
  }
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  FILE *f = fdopen(fd, "r");
  rewind(f);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f))
    n += strstr(line, what) != NULL;
  fclose(f);
  unlink(path);
  return n;
}

Test(plan_cache, verbose_log_hits_misses_lru) {
  forkattn_ctx *verbose = pc_ctx(1, 1);
  enum { NL = 9 }; /* one more than the entries */
  int64_t off[NL][3];
  forkattn_prefix_layout lay[NL];
  pc_layout l[NL];
  for (int i = 0; i < NL; i++) {
    off[i][0] = 0, off[i][1] = 1 + i, off[i][2] = 12;
    lay[i] = (forkattn_prefix_layout){4, 2, off[i], FORKATTN_MASK_CAUSAL};
    l[i] = (pc_layout){.prefix = &lay[i]};
  }
  /* each call: forward (a miss the first time) and backward (a hit) */
  const pc_layout *fill[8] = {&l[0], &l[1], &l[2], &l[3], &l[4], &l[5], &l[6], &l[7]};
  cr_assert_eq(pc_count_log(verbose, fill, 8, "plan cache miss"), 8);
  /* l0 used again, so l8 evicts l1, the least recently used; l0 still hits, l1 misses */
  const pc_layout *next[4] = {&l[0], &l[8], &l[0], &l[1]};
  cr_assert_eq(pc_count_log(verbose, next, 4, "evicting"), 2, "l8 and then l1 evict one plan each");
  const pc_layout *last[2] = {&l[8], &l[1]};
  cr_assert_eq(pc_count_log(verbose, last, 2, "plan cache hit"), 4, "l8 and l1 are both cached");
  forkattn_ctx_destroy(verbose);
  forkattn_ctx *off_ctx = pc_ctx(0, 1);
  cr_assert_eq(pc_count_log(off_ctx, last, 2, "plan cache"), 0, "FORKATTN_PLAN_CACHE=0 has no cache");
  forkattn_ctx_destroy(off_ctx);
}

Test(plan_cache, env_switch) {
  setenv("FORKATTN_PLAN_CACHE", "yes", 1);
  forkattn_ctx *c = NULL;
  cr_assert_eq(forkattn_ctx_create(&c, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(c);
  cr_assert(strstr(forkattn_ctx_create_error(), "FORKATTN_PLAN_CACHE"), "%s", forkattn_ctx_create_error());
  setenv("FORKATTN_PLAN_CACHE", "", 1); /* empty: the default */
  cr_assert_eq(forkattn_ctx_create(&c, NULL), FORKATTN_OK);
  forkattn_ctx_destroy(c);
}
