/*
 * test_tree.c - forkattn_tree_fwd / forkattn_tree_bwd against the float64
 * reference (ref_tree: every node's root path run as its own causal sequence,
 * so every root-to-leaf path equals causal attention on that path and a
 * node's dk/dv is summed over all its descendants).
 *
 * Shapes: a chain of 1024 one-token nodes (also checked against the
 * library's plain causal attention); a star (256-token root, 64 one-token
 * leaves); a 63-node speculative-decoding tree of depth 4 under a 512-token
 * prompt; a random RL trie (1024-token prompt, 16 leaves, random branch
 * points, segments 1..512 tokens) in DFS order and in BFS order (same
 * per-sequence results); a deep tree of 3000 small nodes (no recursion);
 * forests and empty nodes; the depth-one tree equals the shared-prompt call.
 * Every case: poisoned outputs, guards, all elements written, inputs
 * unchanged, no NaN (no row is fully masked: each sees itself), o/lse/dq/dk/dv
 * within the dtype tolerances of prefix_harness.c.
 * FORKATTN_TEST_SEED=<n> reproduces a run's data.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefix_harness.h"
#include "reference.h"
#include "test_common.h"
#include "tree_builder.h"

#define F32 FORKATTN_DTYPE_F32
#define BF16 FORKATTN_DTYPE_BF16
#define NOTOL ((ph_tol){0, 0, 0})

/* ---- trees ---------------------------------------------------------------- */

/* Run one tree through fwd+bwd in a memory layout and compare with the reference. */
static void tt_check(const char *name, const forkattn_tree_layout *tree, int64_t hq, int64_t hkv,
                     int64_t d, forkattn_dtype dtype, ph_layout lay, ph_outputs *keep) {
  fprintf(stderr, "[case] %s: %lld nodes, %lld rows, heads %lld/%lld, d %lld, %s\n", name,
          (long long)tree->num_nodes, (long long)tree->node_offsets[tree->num_nodes], (long long)hq,
          (long long)hkv, (long long)d, ref_dtype_name(dtype));
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert(ctx);
  ph_inputs in;
  ph_make_tree_inputs(&in, tree, hq, hkv, d, dtype, 0.0, &rng);
  ph_outputs ref, got;
  ph_reference(&ref, &in);
  ph_run(&got, &in, lay, 1, ctx, name);
  ph_check(&got, &ref, &in, NOTOL, name);
  if (keep)
    *keep = got;
  else
    ph_free_outputs(&got);
  ph_free_outputs(&ref);
  ph_free_inputs(&in);
  forkattn_ctx_destroy(ctx);
}

/* ---- shapes --------------------------------------------------------------- */

Test(tree, chain_of_1024_equals_causal_attention, .timeout = 300) {
  tt_tree t;
  tt_init(&t, 1024);
  for (int64_t i = 0; i < 1024; i++) tt_add(&t, i - 1, 1);
  tt_packed p;
  tt_pack(&p, &t, 0);
  tt_check("tree/chain_1024", &p.layout, 4, 2, 64, F32, PH_CONTIGUOUS, NULL);

  /* and the library's own causal attention (one sequence) on the same data */
  tc_rng rng = tc_rng_for("tree/chain_vs_causal");
  forkattn_ctx *ctx = tc_ctx_default("tree/chain_vs_causal");
  const int64_t T = 1024, hq = 4, hkv = 2, d = 64;
  float *q = malloc(sizeof(float) * (size_t)(T * hq * d)), *k = malloc(sizeof(float) * (size_t)(T * hkv * d));
  float *v = malloc(sizeof(float) * (size_t)(T * hkv * d)), *o1 = malloc(sizeof(float) * (size_t)(T * hq * d));
  float *o2 = malloc(sizeof(float) * (size_t)(T * hq * d)), *l1 = malloc(sizeof(float) * (size_t)(T * hq));
  float *l2 = malloc(sizeof(float) * (size_t)(T * hq));
  cr_assert(ctx && q && k && v && o1 && o2 && l1 && l2);
  forkattn_tensor tq = forkattn_tensor_contiguous(q, F32, T, hq, d), tk = forkattn_tensor_contiguous(k, F32, T, hkv, d);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, F32, T, hkv, d);
  forkattn_tensor to1 = forkattn_tensor_contiguous(o1, F32, T, hq, d), to2 = forkattn_tensor_contiguous(o2, F32, T, hq, d);
  tc_fill_tensor(&rng, &tq, -4, 4);
  tc_fill_tensor(&rng, &tk, -1, 1);
  tc_fill_tensor(&rng, &tv, -1, 1);
  const int64_t off[2] = {0, T};
  const forkattn_prefix_layout seq = {0, 1, off, FORKATTN_MASK_CAUSAL};
  cr_assert_eq(forkattn_tree_fwd(ctx, &p.layout, &tq, &tk, &tv, &to1, l1, 0.125f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert_eq(forkattn_prefix_fwd(ctx, &seq, &tq, &tk, &tv, &to2, l2, 0.125f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  double worst = 0;
  for (int64_t i = 0; i < T * hq * d; i++) worst = fmax(worst, fabs((double)o1[i] - o2[i]));
  for (int64_t i = 0; i < T * hq; i++) worst = fmax(worst, fabs((double)l1[i] - l2[i]));
  /* same keys, same scores; only the tiling of the online softmax may differ */
  cr_expect_leq(worst, 1e-5, "chain vs causal attention: max difference %.3e", worst);
  free(q), free(k), free(v), free(o1), free(o2), free(l1), free(l2);
  forkattn_ctx_destroy(ctx);
  tt_packed_free(&p);
  tt_free(&t);
}

Test(tree, star_256_root_64_leaves, .timeout = 300) {
  tt_tree t;
  tt_init(&t, 65);
  tt_add(&t, -1, 256);
  for (int i = 0; i < 64; i++) tt_add(&t, 0, 1);
  tt_packed p;
  tt_pack(&p, &t, 0);
  tt_check("tree/star_f32", &p.layout, 8, 2, 64, F32, PH_CONTIGUOUS, NULL);
  tt_check("tree/star_bf16_strided", &p.layout, 8, 2, 64, BF16, PH_STRIDED, NULL);
  tt_packed_free(&p);
  tt_free(&t);
}

Test(tree, speculative_63_nodes_depth_4_under_512_prompt, .timeout = 300) {
  tc_rng rng = tc_rng_for("tree/speculative.shape");
  tt_tree t;
  tt_init(&t, 64);
  tt_add(&t, -1, 512);
  /* 62 draft nodes of 1..3 tokens, depths 1..4: levels of 4, 10, 20, 28 nodes */
  const int64_t level_size[4] = {4, 10, 20, 28};
  int64_t prev0 = 0, prevn = 1;
  for (int l = 0; l < 4; l++) {
    const int64_t start = t.n;
    for (int64_t i = 0; i < level_size[l]; i++)
      tt_add(&t, prev0 + tc_randint(&rng, 0, prevn - 1), tc_randint(&rng, 1, 3));
    prev0 = start;
    prevn = level_size[l];
  }
  cr_assert_eq(t.n, 63);
  tt_packed p;
  tt_pack(&p, &t, 0);
  tt_check("tree/speculative_f32", &p.layout, 6, 2, 128, F32, PH_CONTIGUOUS, NULL);
  tt_check("tree/speculative_bf16_packed", &p.layout, 6, 2, 128, BF16, PH_QKV_PACKED, NULL);
  tt_packed_free(&p);
  tt_free(&t);
}

/* DFS and BFS packings of one random RL trie: same results row for row. */
Test(tree, random_rl_trie_dfs_and_bfs_packing_agree, .timeout = 600) {
  tc_rng rng = tc_rng_for("tree/rl_trie.shape");
  tt_tree t;
  tt_random_trie(&t, &rng, 1024, 16, 512);
  tt_packed dfs, bfs;
  tt_pack(&dfs, &t, 0);
  tt_pack(&bfs, &t, 1);
  ph_outputs a;
  const int64_t hq = 4, hkv = 1, d = 64;
  tt_check("tree/rl_trie_dfs", &dfs.layout, hq, hkv, d, F32, PH_CONTIGUOUS, &a);
  /* the BFS run draws its own data: compare it with the reference, then compare
   * the two packings on the same data through the row maps below */
  ph_free_outputs(&a);
  tt_check("tree/rl_trie_bfs", &bfs.layout, hq, hkv, d, F32, PH_CONTIGUOUS, NULL);

  /* same data in both packings: permute q/k/v rows, compare o and lse per node row */
  const int64_t T = dfs.off[t.n];
  tc_rng r2 = tc_rng_for("tree/rl_trie.same_data");
  forkattn_ctx *ctx = tc_ctx_default("tree/rl_trie.same_data");
  float *q[2], *k[2], *v[2], *o[2], *l[2];
  for (int s = 0; s < 2; s++) {
    q[s] = malloc(sizeof(float) * (size_t)(T * hq * d));
    o[s] = malloc(sizeof(float) * (size_t)(T * hq * d));
    k[s] = malloc(sizeof(float) * (size_t)(T * hkv * d));
    v[s] = malloc(sizeof(float) * (size_t)(T * hkv * d));
    l[s] = malloc(sizeof(float) * (size_t)(T * hq));
    cr_assert(q[s] && o[s] && k[s] && v[s] && l[s]);
  }
  for (int64_t i = 0; i < T * hq * d; i++) q[0][i] = (float)tc_uniform(&r2, -4, 4);
  for (int64_t i = 0; i < T * hkv * d; i++) {
    k[0][i] = (float)tc_uniform(&r2, -1, 1);
    v[0][i] = (float)tc_uniform(&r2, -1, 1);
  }
  for (int64_t x = 0; x < t.n; x++) /* node x's rows: dfs.row_of_node[x].. -> bfs.row_of_node[x].. */
    for (int64_t j = 0; j < t.len[x]; j++) {
      const int64_t r0 = dfs.row_of_node[x] + j, r1 = bfs.row_of_node[x] + j;
      memcpy(q[1] + r1 * hq * d, q[0] + r0 * hq * d, sizeof(float) * (size_t)(hq * d));
      memcpy(k[1] + r1 * hkv * d, k[0] + r0 * hkv * d, sizeof(float) * (size_t)(hkv * d));
      memcpy(v[1] + r1 * hkv * d, v[0] + r0 * hkv * d, sizeof(float) * (size_t)(hkv * d));
    }
  const forkattn_tree_layout *lay[2] = {&dfs.layout, &bfs.layout};
  for (int s = 0; s < 2; s++) {
    forkattn_tensor tq = forkattn_tensor_contiguous(q[s], F32, T, hq, d), tk = forkattn_tensor_contiguous(k[s], F32, T, hkv, d);
    forkattn_tensor tv = forkattn_tensor_contiguous(v[s], F32, T, hkv, d), to = forkattn_tensor_contiguous(o[s], F32, T, hq, d);
    cr_assert_eq(forkattn_tree_fwd(ctx, lay[s], &tq, &tk, &tv, &to, l[s], 0.125f, FORKATTN_MEMORY_HOST), FORKATTN_OK,
                 "%s", forkattn_ctx_last_error(ctx));
  }
  double worst = 0;
  for (int64_t x = 0; x < t.n; x++)
    for (int64_t j = 0; j < t.len[x]; j++) {
      const int64_t r0 = dfs.row_of_node[x] + j, r1 = bfs.row_of_node[x] + j;
      for (int64_t c = 0; c < hq * d; c++) worst = fmax(worst, fabs((double)o[0][r0 * hq * d + c] - o[1][r1 * hq * d + c]));
      for (int64_t h = 0; h < hq; h++) worst = fmax(worst, fabs((double)l[0][r0 * hq + h] - l[1][r1 * hq + h]));
    }
  /* BFS splits merged chains into more key segments: summation order may differ */
  cr_expect_leq(worst, 1e-5, "DFS vs BFS packing: max difference %.3e", worst);
  for (int s = 0; s < 2; s++) free(q[s]), free(k[s]), free(v[s]), free(o[s]), free(l[s]);
  forkattn_ctx_destroy(ctx);
  tt_packed_free(&dfs);
  tt_packed_free(&bfs);
  tt_free(&t);
}

Test(tree, random_rl_trie_bf16_gqa, .timeout = 600) {
  tc_rng rng = tc_rng_for("tree/rl_trie_bf16.shape");
  tt_tree t;
  tt_random_trie(&t, &rng, 1024, 16, 512);
  tt_packed p;
  tt_pack(&p, &t, 0);
  /* GQA 4/2 at d=64: the float64 reference of this trie dominates the ASan run */
  tt_check("tree/rl_trie_bf16", &p.layout, 4, 2, 64, BF16, PH_CONTIGUOUS, NULL);
  tt_packed_free(&p);
  tt_free(&t);
}

/* Thousands of small nodes: a long chain with side branches (no recursion anywhere). */
Test(tree, deep_tree_3000_nodes, .timeout = 600) {
  tc_rng rng = tc_rng_for("tree/deep.shape");
  tt_tree t;
  tt_init(&t, 3000);
  int64_t spine = tt_add(&t, -1, 2);
  while (t.n < 3000) {
    if (tc_randint(&rng, 0, 9) == 0)
      tt_add(&t, spine, tc_randint(&rng, 1, 3)); /* a side leaf */
    else
      spine = tt_add(&t, spine, tc_randint(&rng, 1, 2));
  }
  tt_packed p;
  tt_pack(&p, &t, 0);
  tt_check("tree/deep_3000", &p.layout, 2, 1, 16, F32, PH_CONTIGUOUS, NULL);
  tt_packed_free(&p);
  tt_free(&t);
}

/* Several roots, empty nodes (children see through them), odd head_dim. */
Test(tree, forest_with_empty_nodes, .timeout = 300) {
  tt_tree t;
  tt_init(&t, 16);
  tt_add(&t, -1, 40);  /* 0 */
  tt_add(&t, 0, 0);    /* 1: empty, its children read node 0 */
  tt_add(&t, 1, 17);   /* 2 */
  tt_add(&t, 1, 5);    /* 3 */
  tt_add(&t, -1, 0);   /* 4: an empty root */
  tt_add(&t, 4, 9);    /* 5: a root in effect */
  tt_add(&t, 5, 1);    /* 6 */
  tt_add(&t, -1, 33);  /* 7 */
  tt_add(&t, 7, 12);   /* 8: only child, contiguous: shares 7's key segment */
  tt_add(&t, 8, 3);    /* 9 */
  tt_add(&t, 8, 0);    /* 10: empty leaf */
  tt_packed p;
  tt_pack(&p, &t, 0);
  tt_check("tree/forest_f32_d33", &p.layout, 3, 3, 33, F32, PH_STRIDED, NULL);
  tt_packed_free(&p);
  tt_free(&t);
}

/* The shared-prompt layout is the depth-one tree: same results from both calls. */
Test(tree, depth_one_tree_equals_prefix_call) {
  tc_rng rng = tc_rng_for("tree/depth_one");
  forkattn_ctx *ctx = tc_ctx_default("tree/depth_one");
  const int64_t P = 77, n = 5, hq = 4, hkv = 2, d = 32;
  int64_t roff[6] = {0}, node_off[7] = {0}, par[6] = {-1, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i++) roff[i + 1] = roff[i] + tc_randint(&rng, 1, 40);
  for (int64_t i = 0; i <= n; i++) node_off[i + 1] = P + roff[i];
  const int64_t T = P + roff[n];
  const forkattn_prefix_layout pl = {P, n, roff, FORKATTN_MASK_CAUSAL};
  const forkattn_tree_layout tl = {n + 1, node_off, par};
  float *buf = malloc(sizeof(float) * (size_t)(T * (6 * hq + 6 * hkv) * d + 2 * T * hq));
  cr_assert(ctx && buf);
  float *p = buf;
  forkattn_tensor q = forkattn_tensor_contiguous(p, F32, T, hq, d), k = forkattn_tensor_contiguous(p += T * hq * d, F32, T, hkv, d);
  forkattn_tensor v = forkattn_tensor_contiguous(p += T * hkv * d, F32, T, hkv, d);
  forkattn_tensor dout = forkattn_tensor_contiguous(p += T * hkv * d, F32, T, hq, d);
  forkattn_tensor o[2], dq[2], dk[2], dv[2];
  float *lse[2];
  p += T * hq * d;
  for (int s = 0; s < 2; s++) {
    o[s] = forkattn_tensor_contiguous(p, F32, T, hq, d);
    dq[s] = forkattn_tensor_contiguous(p += T * hq * d, F32, T, hq, d);
    dk[s] = forkattn_tensor_contiguous(p += T * hq * d, F32, T, hkv, d);
    dv[s] = forkattn_tensor_contiguous(p += T * hkv * d, F32, T, hkv, d);
    lse[s] = (p += T * hkv * d);
    p += T * hq;
  }
  tc_fill_tensor(&rng, &q, -4, 4);
  tc_fill_tensor(&rng, &k, -1, 1);
  tc_fill_tensor(&rng, &v, -1, 1);
  tc_fill_tensor(&rng, &dout, -1, 1);
  cr_assert_eq(forkattn_prefix_fwd(ctx, &pl, &q, &k, &v, &o[0], lse[0], 0.2f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert_eq(forkattn_tree_fwd(ctx, &tl, &q, &k, &v, &o[1], lse[1], 0.2f, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert_eq(forkattn_prefix_bwd(ctx, &pl, &q, &k, &v, &o[0], &dout, lse[0], &dq[0], &dk[0], &dv[0], 0.2f,
                                   FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_assert_eq(forkattn_tree_bwd(ctx, &tl, &q, &k, &v, &o[1], &dout, lse[1], &dq[1], &dk[1], &dv[1], 0.2f,
                                 FORKATTN_MEMORY_HOST), FORKATTN_OK);
  /* the same plan runs in both: bitwise equal */
  cr_expect_eq(memcmp(o[0].data, o[1].data, sizeof(float) * (size_t)(T * hq * d)), 0);
  cr_expect_eq(memcmp(lse[0], lse[1], sizeof(float) * (size_t)(T * hq)), 0);
  cr_expect_eq(memcmp(dq[0].data, dq[1].data, sizeof(float) * (size_t)(T * hq * d)), 0);
  cr_expect_eq(memcmp(dk[0].data, dk[1].data, sizeof(float) * (size_t)(T * hkv * d)), 0);
  cr_expect_eq(memcmp(dv[0].data, dv[1].data, sizeof(float) * (size_t)(T * hkv * d)), 0);
  free(buf);
  forkattn_ctx_destroy(ctx);
}

/* ---- bad layouts ---------------------------------------------------------- */

static void expect_layout_error(forkattn_ctx *ctx, const forkattn_tree_layout *tl, const char *needle) {
  const int64_t T = 8, h = 1, d = 4;
  float q[8 * 4], k[8 * 4], v[8 * 4], o[8 * 4], lse[8];
  for (int i = 0; i < 32; i++) q[i] = k[i] = v[i] = (float)(i % 7) * 0.1f;
  for (int i = 0; i < 32; i++) o[i] = 12345.0f;
  for (int i = 0; i < 8; i++) lse[i] = 12345.0f;
  forkattn_tensor tq = forkattn_tensor_contiguous(q, F32, T, h, d), tk = forkattn_tensor_contiguous(k, F32, T, h, d);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, F32, T, h, d), to = forkattn_tensor_contiguous(o, F32, T, h, d);
  forkattn_status st = forkattn_tree_fwd(ctx, tl, &tq, &tk, &tv, &to, lse, 0.5f, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "expected an error mentioning '%s'", needle);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), needle), "message '%s' lacks '%s'", forkattn_ctx_last_error(ctx), needle);
  for (int i = 0; i < 32; i++) cr_expect_eq(o[i], 12345.0f, "o written on error");
  for (int i = 0; i < 8; i++) cr_expect_eq(lse[i], 12345.0f, "lse written on error");
}

Test(tree_errors, bad_layouts_get_clear_errors_and_nothing_is_written) {
  forkattn_ctx *ctx = tc_ctx_default("tree_errors");
  cr_assert(ctx);
  int64_t off[4] = {0, 3, 6, 8}, par[3] = {-1, 0, 1};
  expect_layout_error(ctx, NULL, "layout is NULL");
  expect_layout_error(ctx, &(forkattn_tree_layout){-1, off, par}, "num_nodes -1");
  expect_layout_error(ctx, &(forkattn_tree_layout){3, NULL, par}, "node_offsets is NULL");
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off, NULL}, "parents is NULL");
  int64_t off_bad0[4] = {1, 3, 6, 8};
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off_bad0, par}, "node_offsets[0]");
  int64_t off_dec[4] = {0, 5, 4, 8};
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off_dec, par}, "not monotonic");
  int64_t par_fwd[3] = {-1, 2, 0}; /* parent after its child (or a cycle) */
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off, par_fwd}, "parents[1] = 2");
  int64_t par_self[3] = {-1, 1, 0};
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off, par_self}, "parents[1] = 1");
  int64_t par_neg[3] = {-1, -2, 0};
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off, par_neg}, "parents[1] = -2");
  int64_t off_short[4] = {0, 3, 6, 7}; /* 7 rows, tensors have 8 */
  expect_layout_error(ctx, &(forkattn_tree_layout){3, off_short, par}, "rows");
  forkattn_ctx_destroy(ctx);
}

Test(tree_errors, empty_tree_is_a_no_op) {
  forkattn_ctx *ctx = tc_ctx_default("tree_errors.empty");
  cr_assert(ctx);
  float sentinel = 7.0f;
  forkattn_tensor t = forkattn_tensor_contiguous(&sentinel, F32, 0, 1, 4);
  const forkattn_tree_layout empty = {0, NULL, NULL};
  cr_expect_eq(forkattn_tree_fwd(ctx, &empty, &t, &t, &t, &t, NULL, 0.5f, FORKATTN_MEMORY_HOST), FORKATTN_OK,
               "%s", forkattn_ctx_last_error(ctx));
  cr_expect_eq(forkattn_tree_bwd(ctx, &empty, &t, &t, &t, &t, &t, NULL, &t, &t, &t, 0.5f, FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  int64_t zoff[3] = {0, 0, 0}, zpar[2] = {-1, 0}; /* nodes with no rows */
  const forkattn_tree_layout hollow = {2, zoff, zpar};
  cr_expect_eq(forkattn_tree_fwd(ctx, &hollow, &t, &t, &t, &t, NULL, 0.5f, FORKATTN_MEMORY_HOST), FORKATTN_OK,
               "%s", forkattn_ctx_last_error(ctx));
  cr_expect_eq(sentinel, 7.0f);
  forkattn_ctx_destroy(ctx);
}
