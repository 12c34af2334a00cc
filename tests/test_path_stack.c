/*
 * test_path_stack.c - DFS execution with the path stack equals tree attention.
 *
 * A random RL trie is walked depth-first the way a segment-by-segment trainer
 * walks it: push the node's KV, attend its queries, visit the children, pop.
 * Forward outputs must equal forkattn_tree_fwd on the packed tree; in the
 * backward walk, dq of each node and the dk/dv handed back at each pop must
 * equal forkattn_tree_bwd (a node's dk/dv = its own rows' share + every
 * descendant's). Peak memory is measured on a tree whose total size is far
 * larger than its deepest path. Inputs are fresh random values
 * (FORKATTN_TEST_SEED reproduces them); tolerances: f32 1e-5 relative (same
 * math, different key tiling), bf16 1e-2 (one bf16 rounding of outputs).
 */
#define _DEFAULT_SOURCE /* mmap MAP_ANONYMOUS */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "reference.h"
#include "test_common.h"
#include "tree_builder.h"

#define F32 FORKATTN_DTYPE_F32
#define BF16 FORKATTN_DTYPE_BF16

typedef struct {
  int64_t T, hq, hkv, d;
  forkattn_dtype dt;
  void *q, *k, *v, *dout;           /* inputs [T, H, d] contiguous */
  void *o, *dq, *dk, *dv;           /* outputs */
  float *lse;
} pt_bufs;

static void *pt_alloc(int64_t elems, forkattn_dtype dt) {
  void *p = malloc((size_t)elems * ref_dtype_size(dt) + 1);
  cr_assert(p);
  return p;
}

static void pt_make(pt_bufs *b, int64_t T, int64_t hq, int64_t hkv, int64_t d, forkattn_dtype dt) {
  *b = (pt_bufs){T, hq, hkv, d, dt, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
  b->q = pt_alloc(T * hq * d, dt), b->dout = pt_alloc(T * hq * d, dt), b->o = pt_alloc(T * hq * d, dt);
  b->dq = pt_alloc(T * hq * d, dt), b->k = pt_alloc(T * hkv * d, dt), b->v = pt_alloc(T * hkv * d, dt);
  b->dk = pt_alloc(T * hkv * d, dt), b->dv = pt_alloc(T * hkv * d, dt);
  b->lse = malloc(sizeof(float) * (size_t)(T * hq) + 1);
  cr_assert(b->lse);
}

static void pt_free(pt_bufs *b) {
  free(b->q), free(b->k), free(b->v), free(b->dout), free(b->o), free(b->dq), free(b->dk), free(b->dv);
  free(b->lse);
}

/* Rows [r0, r0+n) of a [T, H, d] buffer as a tensor. */
static forkattn_tensor pt_rows(const pt_bufs *b, void *data, int64_t H, int64_t r0, int64_t n) {
  forkattn_tensor t = forkattn_tensor_contiguous((char *)data + (size_t)(r0 * H * b->d) * ref_dtype_size(b->dt),
                                                 b->dt, n, H, b->d);
  return t;
}

static double pt_max_rel(const pt_bufs *a, const pt_bufs *b, void *x, void *y, int64_t H) {
  const forkattn_tensor tx = pt_rows(a, x, H, 0, a->T), ty = pt_rows(b, y, H, 0, b->T);
  double worst = 0, scale = 1e-30;
  for (int64_t r = 0; r < a->T; r++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t c = 0; c < a->d; c++) {
        const double u = ref_tensor_get(&tx, r, h, c), w = ref_tensor_get(&ty, r, h, c);
        worst = fmax(worst, fabs(u - w));
        scale = fmax(scale, fabs(w));
        cr_assert(isfinite(u), "non-finite output at row %lld", (long long)r);
      }
  return worst / scale;
}

/* The DFS walk over a DFS-packed tree: forward (bwd = 0) or backward. */
static void pt_walk(forkattn_ctx *ctx, const tt_packed *p, pt_bufs *b, int bwd, float scale, size_t *peak) {
  forkattn_path *path;
  cr_assert_eq(forkattn_path_create(ctx, b->dt, b->hq, b->hkv, b->d, &path), FORKATTN_OK, "%s",
               forkattn_ctx_last_error(ctx));
  const int64_t n = p->layout.num_nodes;
  int64_t *open = malloc(sizeof(int64_t) * (size_t)(n + 1)), depth = 0;
  cr_assert(open);
  for (int64_t j = 0; j <= n; j++) {
    /* close the nodes that are not ancestors of node j (all of them at the end) */
    while (depth > 0 && (j == n || open[depth - 1] != p->par[j])) {
      const int64_t x = open[--depth], r0 = p->off[x], len = p->off[x + 1] - r0;
      forkattn_tensor dk = pt_rows(b, b->dk, b->hkv, r0, len), dv = pt_rows(b, b->dv, b->hkv, r0, len);
      cr_assert_eq(forkattn_path_pop(path, bwd ? &dk : NULL, bwd ? &dv : NULL), FORKATTN_OK, "%s",
                   forkattn_ctx_last_error(ctx));
    }
    if (j == n) break;
    const int64_t r0 = p->off[j], len = p->off[j + 1] - r0;
    forkattn_tensor k = pt_rows(b, b->k, b->hkv, r0, len), v = pt_rows(b, b->v, b->hkv, r0, len);
    forkattn_tensor q = pt_rows(b, b->q, b->hq, r0, len), o = pt_rows(b, b->o, b->hq, r0, len);
    cr_assert_eq(forkattn_path_push(path, &k, &v), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    open[depth++] = j;
    cr_assert_eq(forkattn_path_depth(path), depth);
    if (!bwd) {
      cr_assert_eq(forkattn_path_attend_fwd(path, &q, &o, b->lse + r0 * b->hq, scale), FORKATTN_OK, "%s",
                   forkattn_ctx_last_error(ctx));
    } else {
      forkattn_tensor dout = pt_rows(b, b->dout, b->hq, r0, len), dq = pt_rows(b, b->dq, b->hq, r0, len);
      cr_assert_eq(forkattn_path_attend_bwd(path, &q, &o, &dout, b->lse + r0 * b->hq, &dq, scale), FORKATTN_OK,
                   "%s", forkattn_ctx_last_error(ctx));
    }
  }
  cr_assert_eq(forkattn_path_depth(path), 0);
  cr_assert_eq(forkattn_path_rows(path), 0);
  if (peak) *peak = forkattn_path_peak_bytes(path);
  free(open);
  forkattn_path_destroy(path);
}

static void pt_poison(pt_bufs *b) {
  memset(b->o, 0xff, (size_t)(b->T * b->hq * b->d) * ref_dtype_size(b->dt)); /* NaN in every dtype */
  memset(b->dq, 0xff, (size_t)(b->T * b->hq * b->d) * ref_dtype_size(b->dt));
  memset(b->dk, 0xff, (size_t)(b->T * b->hkv * b->d) * ref_dtype_size(b->dt));
  memset(b->dv, 0xff, (size_t)(b->T * b->hkv * b->d) * ref_dtype_size(b->dt));
  memset(b->lse, 0xff, sizeof(float) * (size_t)(b->T * b->hq));
}

static void pt_compare_with_tree(const char *name, forkattn_dtype dt, double tol) {
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert(ctx);
  tt_tree t;
  tt_random_trie(&t, &rng, 256, 8, 128);
  tt_packed p;
  tt_pack(&p, &t, 0);
  const int64_t T = p.off[t.n], hq = 4, hkv = 2, d = 32;
  const float scale = 0.2f;
  pt_bufs dfs, whole;
  pt_make(&dfs, T, hq, hkv, d, dt);
  pt_make(&whole, T, hq, hkv, d, dt);
  forkattn_tensor q = pt_rows(&whole, whole.q, hq, 0, T), k = pt_rows(&whole, whole.k, hkv, 0, T);
  forkattn_tensor v = pt_rows(&whole, whole.v, hkv, 0, T), dout = pt_rows(&whole, whole.dout, hq, 0, T);
  tc_fill_tensor(&rng, &q, -4, 4);
  tc_fill_tensor(&rng, &k, -1, 1);
  tc_fill_tensor(&rng, &v, -1, 1);
  tc_fill_tensor(&rng, &dout, -1, 1);
  const size_t qb = (size_t)(T * hq * d) * ref_dtype_size(dt), kb = (size_t)(T * hkv * d) * ref_dtype_size(dt);
  memcpy(dfs.q, whole.q, qb), memcpy(dfs.dout, whole.dout, qb), memcpy(dfs.k, whole.k, kb), memcpy(dfs.v, whole.v, kb);
  pt_poison(&whole);
  pt_poison(&dfs);

  forkattn_tensor o = pt_rows(&whole, whole.o, hq, 0, T), dq = pt_rows(&whole, whole.dq, hq, 0, T);
  forkattn_tensor dk = pt_rows(&whole, whole.dk, hkv, 0, T), dv = pt_rows(&whole, whole.dv, hkv, 0, T);
  cr_assert_eq(forkattn_tree_fwd(ctx, &p.layout, &q, &k, &v, &o, whole.lse, scale, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert_eq(forkattn_tree_bwd(ctx, &p.layout, &q, &k, &v, &o, &dout, whole.lse, &dq, &dk, &dv, scale,
                                 FORKATTN_MEMORY_HOST), FORKATTN_OK);
  pt_walk(ctx, &p, &dfs, 0, scale, NULL);
  pt_walk(ctx, &p, &dfs, 1, scale, NULL);

  double lse_err = 0;
  for (int64_t i = 0; i < T * hq; i++) {
    cr_assert(isfinite(dfs.lse[i]), "lse row %lld not written", (long long)(i / hq));
    lse_err = fmax(lse_err, fabs((double)dfs.lse[i] - whole.lse[i]));
  }
  const double eo = pt_max_rel(&dfs, &whole, dfs.o, whole.o, hq), edq = pt_max_rel(&dfs, &whole, dfs.dq, whole.dq, hq);
  const double edk = pt_max_rel(&dfs, &whole, dfs.dk, whole.dk, hkv), edv = pt_max_rel(&dfs, &whole, dfs.dv, whole.dv, hkv);
  fprintf(stderr, "[path] %s: %lld nodes, %lld rows: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e (tol %.0e)\n", name,
          (long long)t.n, (long long)T, eo, lse_err, edq, edk, edv, tol);
  cr_expect_leq(eo, tol, "o differs: %.3e", eo);
  cr_expect_leq(lse_err, 1e-4, "lse differs: %.3e", lse_err);
  cr_expect_leq(edq, tol, "dq differs: %.3e", edq);
  cr_expect_leq(edk, tol, "dk differs: %.3e", edk);
  cr_expect_leq(edv, tol, "dv differs: %.3e", edv);
  pt_free(&dfs);
  pt_free(&whole);
  tt_packed_free(&p);
  tt_free(&t);
  forkattn_ctx_destroy(ctx);
}

Test(path_stack, dfs_walk_equals_tree_attention_f32, .timeout = 300) {
  pt_compare_with_tree("path/dfs_f32", F32, 1e-5);
}

Test(path_stack, dfs_walk_equals_tree_attention_bf16, .timeout = 300) {
  /* outputs are rounded to bf16 once on both sides; accumulation order differs */
  pt_compare_with_tree("path/dfs_bf16", BF16, 1e-2);
}

/* 200 children of 64 rows under a 64-row root: 12864 rows in all, paths of 128. */
Test(path_stack, peak_memory_follows_the_deepest_path, .timeout = 300) {
  tc_rng rng = tc_rng_for("path/peak");
  forkattn_ctx *ctx = tc_ctx_default("path/peak");
  cr_assert(ctx);
  tt_tree t;
  tt_init(&t, 201);
  tt_add(&t, -1, 64);
  for (int i = 0; i < 200; i++) tt_add(&t, 0, 64);
  tt_packed p;
  tt_pack(&p, &t, 0);
  const int64_t T = p.off[t.n], hq = 4, hkv = 2, d = 32, deepest = 128;
  pt_bufs b;
  pt_make(&b, T, hq, hkv, d, F32);
  forkattn_tensor q = pt_rows(&b, b.q, hq, 0, T), k = pt_rows(&b, b.k, hkv, 0, T);
  forkattn_tensor v = pt_rows(&b, b.v, hkv, 0, T), dout = pt_rows(&b, b.dout, hq, 0, T);
  tc_fill_tensor(&rng, &q, -4, 4);
  tc_fill_tensor(&rng, &k, -1, 1);
  tc_fill_tensor(&rng, &v, -1, 1);
  tc_fill_tensor(&rng, &dout, -1, 1);
  pt_poison(&b);
  size_t peak_fwd, peak_bwd;
  pt_walk(ctx, &p, &b, 0, 0.2f, &peak_fwd);
  pt_walk(ctx, &p, &b, 1, 0.2f, &peak_bwd);
  /* K, V and four f32 [rows, hkv, d] buffers per stack row; capacity doubles */
  const size_t row_bytes = (size_t)(hkv * d) * (2 * 4 + 4 * 4);
  const size_t path_bound = 2 * (size_t)deepest * row_bytes + 4096, tree_bytes = (size_t)T * row_bytes;
  fprintf(stderr, "[path] peak stack bytes: fwd %zu, bwd %zu; bound for a %lld-row path %zu; whole tree %zu; "
          "kernel workspace peak %zu\n", peak_fwd, peak_bwd, (long long)deepest, path_bound, tree_bytes,
          forkattn_ctx_peak_workspace(ctx));
  cr_expect_leq(peak_bwd, path_bound, "stack peak %zu exceeds twice the deepest path (%zu)", peak_bwd, path_bound);
  cr_expect_leq(peak_fwd, path_bound);
  cr_expect_lt(peak_bwd * 20, tree_bytes, "peak should be a small fraction of the tree");
  /* kernel scratch follows the call's rows too (at most one node + its stack) */
  cr_expect_lt(forkattn_ctx_peak_workspace(ctx) * 10, tree_bytes, "kernel workspace %zu", forkattn_ctx_peak_workspace(ctx));
  /* and every output was written */
  for (int64_t i = 0; i < T * hq * d; i++) cr_assert(isfinite(((float *)b.dq)[i]) && isfinite(((float *)b.o)[i]));
  for (int64_t i = 0; i < T * hkv * d; i++) cr_assert(isfinite(((float *)b.dk)[i]) && isfinite(((float *)b.dv)[i]));
  pt_free(&b);
  tt_packed_free(&p);
  tt_free(&t);
  forkattn_ctx_destroy(ctx);
}

Test(path_stack, misuse_gets_clear_errors) {
  forkattn_ctx *ctx = tc_ctx_default("path/errors");
  cr_assert(ctx);
  forkattn_path *path = (forkattn_path *)0x1;
  cr_expect_eq(forkattn_path_create(ctx, F32, 3, 2, 16, &path), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_null(path);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "heads_q 3"));
  cr_expect_eq(forkattn_path_create(ctx, F32, 2, 2, 300, &path), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "head_dim 300"));
  cr_expect_eq(forkattn_path_create(ctx, (forkattn_dtype)9, 2, 2, 16, &path), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_eq(forkattn_path_create(ctx, F32, 2, 1, 4, &path), FORKATTN_OK);
  float q[8 * 2 * 4], kv[8 * 4], o[8 * 2 * 4], lse[16];
  for (int i = 0; i < 64; i++) q[i] = 0.1f * (float)(i % 5), o[i] = 0;
  for (int i = 0; i < 32; i++) kv[i] = 0.2f * (float)(i % 3);
  forkattn_tensor tq = forkattn_tensor_contiguous(q, F32, 3, 2, 4), to = forkattn_tensor_contiguous(o, F32, 3, 2, 4);
  forkattn_tensor tk = forkattn_tensor_contiguous(kv, F32, 3, 1, 4), t0 = forkattn_tensor_contiguous(kv, F32, 0, 1, 4);
  cr_expect_eq(forkattn_path_attend_fwd(path, &tq, &to, lse, 0.5f), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "empty"));
  cr_expect_eq(forkattn_path_pop(path, NULL, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_eq(forkattn_path_push(path, &t0, &t0), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "rows >= 1"));
  forkattn_tensor tbf = tk;
  tbf.dtype = BF16;
  cr_expect_eq(forkattn_path_push(path, &tbf, &tbf), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_eq(forkattn_path_push(path, &tk, &tk), FORKATTN_OK);
  forkattn_tensor q2 = forkattn_tensor_contiguous(q, F32, 2, 2, 4); /* top node has 3 rows */
  cr_expect_eq(forkattn_path_attend_fwd(path, &q2, &to, lse, 0.5f), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "rows"));
  cr_expect_eq(forkattn_path_attend_fwd(path, &tq, &to, lse, -1.0f), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_eq(forkattn_path_attend_bwd(path, &tq, &to, &tq, NULL, &tq, 0.5f), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "lse"));
  cr_expect_eq(forkattn_path_attend_fwd(path, &tq, &to, lse, 0.5f), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  forkattn_tensor bad_dk = forkattn_tensor_contiguous(kv, F32, 2, 1, 4);
  cr_expect_eq(forkattn_path_pop(path, &bad_dk, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_eq(forkattn_path_depth(path), 1, "a failed pop pops nothing");
  cr_expect_eq(forkattn_path_pop(path, NULL, NULL), FORKATTN_OK);
  cr_expect_eq(forkattn_path_push(NULL, &tk, &tk), FORKATTN_ERR_INVALID_ARGUMENT);
  forkattn_path_destroy(path);
  forkattn_path_destroy(NULL);
  forkattn_ctx_destroy(ctx);
}

/* A node descriptor claiming 2^61+1 or 2^62+1 rows (or enough to overflow the
 * stack's byte count) must be refused while the stack grows, before push reads
 * a byte of it: its data is an inaccessible page, so any read crashes the test,
 * and a capacity loop that never ends times it out. The stack stays usable. */
Test(path_stack, huge_nodes_are_refused_before_any_read, .timeout = 20) {
  forkattn_ctx *ctx = tc_ctx_default("path/huge");
  cr_assert(ctx);
  const long page = sysconf(_SC_PAGESIZE);
  void *noread = mmap(NULL, (size_t)page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  cr_assert(noread != MAP_FAILED);
  const struct {
    int64_t rows, hkv, d;
    forkattn_dtype dt;
  } cases[] = {
      {((int64_t)1 << 61) + 1, 1, 1, F32},  /* byte count wraps to 0 at the doubled capacity */
      {((int64_t)1 << 62) + 1, 1, 1, F32},  /* doubling the capacity overflows int64 */
      {INT64_MAX, 1, 1, BF16},
      {((int64_t)1 << 52) + 1, 4, 64, F32}, /* rows x width fits int64, the bytes do not fit size_t */
  };
  float kv[2 * 4 * 64] = {0};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    forkattn_path *path = NULL;
    cr_assert_eq(forkattn_path_create(ctx, cases[i].dt, cases[i].hkv, cases[i].hkv, cases[i].d, &path), FORKATTN_OK);
    for (int pre = 0; pre < 2; pre++) { /* on an empty stack, then on top of a small node */
      forkattn_tensor huge = forkattn_tensor_contiguous(noread, cases[i].dt, cases[i].rows, cases[i].hkv, cases[i].d);
      if (huge.row_stride == 0) continue; /* the descriptor itself overflows: not this test's case */
      const forkattn_status st = forkattn_path_push(path, &huge, &huge);
      cr_expect(st == FORKATTN_ERR_INVALID_ARGUMENT || st == FORKATTN_ERR_OUT_OF_MEMORY,
                "case %zu (pre %d): push of %lld rows gave %s", i, pre, (long long)cases[i].rows,
                forkattn_status_string(st));
      cr_expect(forkattn_ctx_last_error(ctx)[0], "case %zu: refused without a message", i);
      cr_expect_eq(forkattn_path_depth(path), pre, "case %zu: a refused push changed the depth", i);
      cr_expect_eq(forkattn_path_rows(path), 2 * pre, "case %zu: a refused push changed the rows", i);
      forkattn_tensor small = forkattn_tensor_contiguous(kv, cases[i].dt, 2, cases[i].hkv, cases[i].d);
      cr_expect_eq(forkattn_path_push(path, &small, &small), FORKATTN_OK, "case %zu: %s", i,
                   forkattn_ctx_last_error(ctx));
    }
    forkattn_path_destroy(path);
  }
  /* heads_q x head_dim must fit int64 for the query and stack rows to be addressable */
  forkattn_path *path = (forkattn_path *)0x1;
  cr_expect_eq(forkattn_path_create(ctx, F32, (int64_t)1 << 60, (int64_t)1 << 60, 256, &path),
               FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_null(path);
  munmap(noread, (size_t)page);
  forkattn_ctx_destroy(ctx);
}
