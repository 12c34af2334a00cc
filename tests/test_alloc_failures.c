/* Allocation-failure sweep (FORKATTN_ALLOC_TEST builds): fail the Nth library
 * allocation for N = 0, 1, 2, ... until the call succeeds, for context
 * creation, prefix and tree forward and backward, kept-set attention and
 * StreamKL (sparse student) forward and backward, H2O key selection, and a DFS path-stack walk
 * (the trie and partition builders sweep theirs in their own tests). Every failure must return
 * FORKATTN_ERR_OUT_OF_MEMORY (never crash), the next call on the same context
 * must work and give the same bits as an undisturbed run, and nothing may leak
 * (the ASan build's LeakSanitizer checks at exit). The same with the plan cache off, and
 * the plan cache's allocations on a miss. [host or device] */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_common.h"

/* Exported by the library in FORKATTN_ALLOC_TEST builds only (lib/core/alloc.c). */
FORKATTN_API int64_t forkattn_test_fail_alloc_after(int64_t n);

#define NT 8
enum { P = 40, N = 3, HQ = 4, HKV = 2, D = 16 };

/* The same rows as a tree: prompt (40), a 11-row child with a 10-row grandchild,
 * and a 9-row child (70 rows = P + 30). */
static const int64_t tree_off[5] = {0, P, P + 11, P + 21, P + 30}, tree_par[4] = {-1, 0, 1, 0};

enum { PREFIX_FWD, PREFIX_BWD, TREE_FWD, TREE_BWD, KEPT_FWD, KEPT_BWD, KL_FWD, KL_BWD, KV_SELECT, PATH_WALK, NOPS };
static const char *const op_names[NOPS] = {"prefix forward", "prefix backward", "tree forward", "tree backward",
                                           "kept forward", "kept backward", "kl forward", "kl backward",
                                           "kv select (H2O)", "path walk"};

/* Kept set over the 70 rows (2 blocks per side): per KV head, CSR lists over
 * the prompt for the responses' queries and a block mask. */
static const int64_t kept_off[3] = {0, 3, 5}, kept_idx[5] = {0, 7, 30, 2, 39};
static const unsigned char kept_blocks[8] = {1, 0, 1, 1, 1, 1, 0, 1};
static const forkattn_kept_set kept = {HKV, P, P, kept_off, kept_idx, kept_blocks};

typedef struct {
  forkattn_prefix_layout lay;
  forkattn_tree_layout tree;
  int64_t off[N + 1];
  tc_buf buf[NT];
  forkattn_tensor t[NT]; /* q k v o dout dq dk dv */
  float lse[(P + 30) * HQ];
  float kl[(P + 30) * HQ], stats[(P + 30) * HQ * FORKATTN_KL_STATS], dkl[(P + 30) * HQ];
  int64_t sel_off[HKV + 1], sel_idx[HKV * 16];
} problem;

static void problem_init(problem *p, forkattn_dtype dt, const char *name) {
  tc_rng rng = tc_rng_for(name);
  const int64_t lens[N] = {11, 0, 19};
  p->off[0] = 0;
  for (int i = 0; i < N; i++) p->off[i + 1] = p->off[i] + lens[i];
  p->lay = (forkattn_prefix_layout){P, N, p->off, FORKATTN_MASK_CAUSAL};
  p->tree = (forkattn_tree_layout){4, tree_off, tree_par};
  const int64_t T = P + p->off[N], heads[NT] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  for (int i = 0; i < NT; i++) {
    p->t[i] = tc_buf_contiguous(&p->buf[i], dt, T, heads[i], D);
    tc_fill_tensor(&rng, &p->t[i], -1.0, 1.0);
  }
  for (int64_t i = 0; i < T * HQ; i++) p->dkl[i] = 1.0f / (float)(1 + i % 7);
}

static void problem_free(problem *p) {
  for (int i = 0; i < NT; i++) tc_buf_free(&p->buf[i]);
}

/* Rows [r0, r0+n) of tensor i. */
static forkattn_tensor rows_of(const problem *p, int i, int64_t r0, int64_t n) {
  forkattn_tensor t = p->t[i];
  t.data = (char *)t.data + (size_t)(r0 * t.row_stride) * (t.dtype ? 2 : 4);
  t.rows = n;
  return t;
}

/* Push the root and its first child, attend both (fwd, then bwd of the child), pop. */
static forkattn_status path_walk(forkattn_ctx *ctx, problem *p) {
  forkattn_path *path;
  forkattn_status st = forkattn_path_create(ctx, p->t[0].dtype, HQ, HKV, D, &path);
  for (int node = 0; node < 2 && !st; node++) {
    const int64_t r0 = tree_off[node], n = tree_off[node + 1] - r0;
    forkattn_tensor k = rows_of(p, 1, r0, n), v = rows_of(p, 2, r0, n), q = rows_of(p, 0, r0, n);
    forkattn_tensor o = rows_of(p, 3, r0, n), dout = rows_of(p, 4, r0, n), dq = rows_of(p, 5, r0, n);
    if (!(st = forkattn_path_push(path, &k, &v)) && !(st = forkattn_path_attend_fwd(path, &q, &o, p->lse + r0 * HQ, 0.25f)))
      st = forkattn_path_attend_bwd(path, &q, &o, &dout, p->lse + r0 * HQ, &dq, 0.25f);
  }
  while (!st && forkattn_path_depth(path) > 0) st = forkattn_path_pop(path, NULL, NULL);
  forkattn_path_destroy(path);
  return st;
}

/* StreamKL: teacher (q, k), student (o as queries, v as keys); backward
 * writes the student's gradients to dq, dk and the teacher's to dout, dv. */
static forkattn_status run(forkattn_ctx *ctx, problem *p, int op) {
  forkattn_tensor *t = p->t;
  const forkattn_layout lay = {&p->lay, NULL};
  switch (op) {
  case KEPT_FWD:
    return forkattn_kept_fwd(ctx, &lay, &kept, &t[0], &t[1], &t[2], &t[3], p->lse, 0.25f, FORKATTN_MEMORY_HOST);
  case KEPT_BWD:
    return forkattn_kept_bwd(ctx, &lay, &kept, &t[0], &t[1], &t[2], &t[3], &t[4], p->lse, &t[5], &t[6], &t[7], 0.25f,
                             FORKATTN_MEMORY_HOST);
  case KL_FWD:
    return forkattn_kl_fwd(ctx, &lay, &t[0], &t[1], &t[3], &t[2], &kept, NULL, p->kl, p->stats, NULL,
                           FORKATTN_MEMORY_HOST);
  case KV_SELECT: {
    forkattn_kv_policy pol;
    forkattn_kv_policy_init(&pol, FORKATTN_KV_H2O, 16);
    return forkattn_kv_select(ctx, &pol, &t[0], &t[1], p->sel_off, p->sel_idx, FORKATTN_MEMORY_HOST);
  }
  case KL_BWD:
    return forkattn_kl_bwd(ctx, &lay, &t[0], &t[1], &t[3], &t[2], &kept, NULL, p->stats, p->dkl, &t[5], &t[6], &t[4],
                           &t[7], FORKATTN_MEMORY_HOST);
  case PREFIX_FWD:
    return forkattn_prefix_fwd(ctx, &p->lay, &t[0], &t[1], &t[2], &t[3], p->lse, 0.25f, FORKATTN_MEMORY_HOST);
  case PREFIX_BWD:
    return forkattn_prefix_bwd(ctx, &p->lay, &t[0], &t[1], &t[2], &t[3], &t[4], p->lse, &t[5], &t[6], &t[7], 0.25f,
                               FORKATTN_MEMORY_HOST);
  case TREE_FWD:
    return forkattn_tree_fwd(ctx, &p->tree, &t[0], &t[1], &t[2], &t[3], p->lse, 0.25f, FORKATTN_MEMORY_HOST);
  case TREE_BWD:
    return forkattn_tree_bwd(ctx, &p->tree, &t[0], &t[1], &t[2], &t[3], &t[4], p->lse, &t[5], &t[6], &t[7], 0.25f,
                             FORKATTN_MEMORY_HOST);
  default:
    return path_walk(ctx, p);
  }
}

/* p's outputs of op equal want's, bit for bit. */
static void expect_same(const problem *p, const problem *want, int op, const char *name) {
  if (op == PATH_WALK) return; /* its outputs are compared in test_path_stack */
  if (op == KV_SELECT) {
    cr_assert(memcmp(p->sel_off, want->sel_off, sizeof p->sel_off) == 0 &&
                  memcmp(p->sel_idx, want->sel_idx, sizeof p->sel_idx) == 0,
              "%s: kept keys differ from an undisturbed run", name);
    return;
  }
  if (op == KL_FWD) {
    cr_assert(memcmp(p->kl, want->kl, sizeof p->kl) == 0 && memcmp(p->stats, want->stats, sizeof p->stats) == 0,
              "%s: kl or stats differ from an undisturbed run", name);
    return;
  }
  const int bwd = op == PREFIX_BWD || op == TREE_BWD || op == KEPT_BWD || op == KL_BWD;
  const int first = op == KL_BWD ? 4 : bwd ? 5 : 3, last = bwd ? 7 : 3;
  for (int i = first; i <= last; i++)
    cr_assert(memcmp(p->buf[i].data, want->buf[i].data, p->buf[i].elems * (p->t[i].dtype ? 2 : 4)) == 0,
              "%s: tensor %d differs from an undisturbed run", name, i);
}

/* Sweep one operation; returns the number of failure points exercised. */
static int sweep(forkattn_ctx *ctx, problem *p, problem *want, int op, const char *name) {
  int n = 0;
  for (;; n++) {
    cr_assert_lt(n, 10000, "%s: never succeeded", name);
    forkattn_test_fail_alloc_after(n);
    forkattn_status st = run(ctx, p, op);
    forkattn_test_fail_alloc_after(-1);
    if (st == FORKATTN_OK) break;
    cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "%s: allocation %d failed with status %s (%s)", name, n,
                 forkattn_status_string(st), forkattn_ctx_last_error(ctx));
    cr_assert_neq(forkattn_ctx_last_error(ctx)[0], '\0', "%s: no message after failure %d", name, n);
    /* the very next call on the same context works */
    cr_assert_eq(run(ctx, p, op), FORKATTN_OK, "%s: call after failure %d: %s", name, n, forkattn_ctx_last_error(ctx));
  }
  expect_same(p, want, op, name);
  return n;
}

/* The plan cache's own allocations on a miss (a fresh context each time): a failure
 * there plans the call without the cache, so each failure point gives OUT_OF_MEMORY
 * or the undisturbed bits, and the next call works. */
static void sweep_plan_cache_miss(problem *p, problem *want, int op, const char *name) {
  forkattn_ctx *ctx = tc_ctx_default(name);
  forkattn_test_fail_alloc_after(-1);
  cr_assert_eq(run(ctx, want, op), FORKATTN_OK, "%s: %s", name, op_names[op]);
  const int64_t allocs = forkattn_test_fail_alloc_after(-1);
  forkattn_ctx_destroy(ctx);
  for (int64_t n = 0; n < allocs; n++) {
    cr_assert_eq(forkattn_ctx_create(&ctx, NULL), FORKATTN_OK);
    forkattn_test_fail_alloc_after(n);
    forkattn_status st = run(ctx, p, op);
    forkattn_test_fail_alloc_after(-1);
    cr_assert(st == FORKATTN_OK || st == FORKATTN_ERR_OUT_OF_MEMORY, "%s: allocation %lld failed with status %s",
              name, (long long)n, forkattn_status_string(st));
    if (st) cr_assert_eq(run(ctx, p, op), FORKATTN_OK, "%s: call after failure %lld", name, (long long)n);
    expect_same(p, want, op, name);
    forkattn_ctx_destroy(ctx);
  }
}

static void sweep_all(forkattn_dtype dt, const char *name) {
  /* context creation */
  int created_after = -1;
  for (int n = 0; n < 1000; n++) {
    forkattn_ctx *c = NULL;
    forkattn_test_fail_alloc_after(n);
    forkattn_status st = forkattn_ctx_create(&c, NULL);
    forkattn_test_fail_alloc_after(-1);
    if (st == FORKATTN_OK) {
      forkattn_ctx_destroy(c);
      created_after = n;
      break;
    }
    cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "ctx_create failure %d: %s", n, forkattn_status_string(st));
    cr_assert_null(c);
  }
  cr_assert_geq(created_after, 1, "ctx_create allocates at least once");

  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert_not_null(ctx);
  problem want, p;
  problem_init(&want, dt, name);
  problem_init(&p, dt, name);
  int npoints[NOPS];
  for (int op = 0; op < NOPS; op++) {
    /* forward then backward on `want` first, so both problems see the same inputs */
    if (op != PATH_WALK) cr_assert_eq(run(ctx, &want, op), FORKATTN_OK, "%s: %s", name, op_names[op]);
    npoints[op] = sweep(ctx, &p, &want, op, name);
    cr_assert_gt(npoints[op], 0, "%s: %s allocates nothing?", name, op_names[op]);
  }
  fprintf(stderr, "%s: ctx_create %d", name, created_after);
  for (int op = 0; op < NOPS; op++) fprintf(stderr, ", %s %d", op_names[op], npoints[op]);
  fprintf(stderr, " failure points, each OUT_OF_MEMORY then recovered\n");
  problem_free(&want);
  problem_free(&p);
  forkattn_ctx_destroy(ctx);
}

Test(alloc_failures, sweep_f32) { sweep_all(FORKATTN_DTYPE_F32, "alloc_failures/f32"); }
/* The sweeps above run on cached plans after their first call; planning every call
 * sweeps the plan builders' allocations too. */
Test(alloc_failures, sweep_f32_uncached) {
  setenv("FORKATTN_PLAN_CACHE", "0", 1);
  sweep_all(FORKATTN_DTYPE_F32, "alloc_failures/f32_uncached");
}
Test(alloc_failures, plan_cache_miss) {
  problem want, p;
  problem_init(&want, FORKATTN_DTYPE_F32, "alloc_failures/plan_cache_miss");
  problem_init(&p, FORKATTN_DTYPE_F32, "alloc_failures/plan_cache_miss");
  const int ops[3] = {PREFIX_FWD, TREE_FWD, KL_FWD};
  for (int i = 0; i < 3; i++) sweep_plan_cache_miss(&p, &want, ops[i], op_names[ops[i]]);
  problem_free(&want);
  problem_free(&p);
}
Test(alloc_failures, sweep_bf16) { sweep_all(FORKATTN_DTYPE_BF16, "alloc_failures/bf16"); }
