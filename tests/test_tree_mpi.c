/*
 * test_tree_mpi.c - multi-rank tree attention equals the single-process call
 * (run under mpirun -np 2 and -np 3; built with -DFORKATTN_MPI=ON).
 *
 * Every rank draws the same random RL trie and data (rank 0's seed is
 * broadcast; FORKATTN_TEST_SEED reproduces it), computes the whole tree in one
 * process as the expected result, then runs only its part of a
 * forkattn_tree_partition (shared ancestors duplicated, dout = 0 on rows it
 * does not own) and sums the duplicated rows' gradients with
 * forkattn_partition_allreduce. Checks: every global row is owned by exactly
 * one rank and held by at least one; o and lse of owned rows and dq/dk/dv of
 * every held row equal the single-process values (f32, 1e-5 relative to the
 * largest magnitude: the same scores and sums, split differently).
 *
 * With --bench (and optionally --prompt P --leaves L --max-seg S --hq H
 * --hkv G --d D) it also times the part's forward+backward against the whole
 * tree's on this rank's device (FORKATTN_BACKEND / the per-rank GPU: device =
 * local rank; each timed on its second run, the first warms up) and prints
 * both, plus the partition's predicted imbalance.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forkattn.h"
#include "forkattn_mpi.h"
#include "test_common.h"
#include "tree_builder.h"

typedef struct {
  int64_t prompt, leaves, max_seg, hq, hkv, d;
  int bench;
} mt_opts;

static double mt_now(void) { return MPI_Wtime(); }

static float *mt_alloc(int64_t n) {
  float *p = calloc((size_t)n + 1, sizeof *p);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return p;
}

static void mt_check_status(forkattn_status st, forkattn_ctx *ctx, const char *what) {
  if (st == FORKATTN_OK) return;
  fprintf(stderr, "%s failed: %s: %s\n", what, forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Whole-tree forward + backward. */
static double mt_run(forkattn_ctx *ctx, const forkattn_tree_layout *lay, int64_t T, const mt_opts *o, float *q,
                     float *k, float *v, float *dout, float *out, float *lse, float *dq, float *dk, float *dv,
                     float scale) {
  forkattn_tensor tq = forkattn_tensor_contiguous(q, FORKATTN_DTYPE_F32, T, o->hq, o->d);
  forkattn_tensor tk = forkattn_tensor_contiguous(k, FORKATTN_DTYPE_F32, T, o->hkv, o->d);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, FORKATTN_DTYPE_F32, T, o->hkv, o->d);
  forkattn_tensor tdo = forkattn_tensor_contiguous(dout, FORKATTN_DTYPE_F32, T, o->hq, o->d);
  forkattn_tensor to = forkattn_tensor_contiguous(out, FORKATTN_DTYPE_F32, T, o->hq, o->d);
  forkattn_tensor tdq = forkattn_tensor_contiguous(dq, FORKATTN_DTYPE_F32, T, o->hq, o->d);
  forkattn_tensor tdk = forkattn_tensor_contiguous(dk, FORKATTN_DTYPE_F32, T, o->hkv, o->d);
  forkattn_tensor tdv = forkattn_tensor_contiguous(dv, FORKATTN_DTYPE_F32, T, o->hkv, o->d);
  const double t0 = mt_now();
  mt_check_status(forkattn_tree_fwd(ctx, lay, &tq, &tk, &tv, &to, lse, scale, FORKATTN_MEMORY_HOST), ctx, "tree_fwd");
  mt_check_status(forkattn_tree_bwd(ctx, lay, &tq, &tk, &tv, &to, &tdo, lse, &tdq, &tdk, &tdv, scale,
                                    FORKATTN_MEMORY_HOST), ctx, "tree_bwd");
  return mt_now() - t0;
}

static void mt_parse(mt_opts *o, int argc, char **argv) {
  *o = (mt_opts){256, 8, 128, 4, 2, 32, 0};
  for (int i = 1; i < argc; i++) {
    int64_t *dst = NULL;
    if (!strcmp(argv[i], "--bench")) o->bench = 1;
    else if (!strcmp(argv[i], "--prompt")) dst = &o->prompt;
    else if (!strcmp(argv[i], "--leaves")) dst = &o->leaves;
    else if (!strcmp(argv[i], "--max-seg")) dst = &o->max_seg;
    else if (!strcmp(argv[i], "--hq")) dst = &o->hq;
    else if (!strcmp(argv[i], "--hkv")) dst = &o->hkv;
    else if (!strcmp(argv[i], "--d")) dst = &o->d;
    else {
      fprintf(stderr, "unknown option %s\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (dst) {
      if (i + 1 >= argc) MPI_Abort(MPI_COMM_WORLD, 2);
      *dst = strtoll(argv[++i], NULL, 10);
    }
  }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  mt_opts opt;
  mt_parse(&opt, argc, argv);

  /* one GPU per rank on a node: device = local rank (ignored by the CPU backend) */
  MPI_Comm node;
  int local_rank = 0;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co);
  co.device = local_rank;
  forkattn_ctx *ctx = NULL;
  if (forkattn_ctx_create(&ctx, &co) != FORKATTN_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, forkattn_ctx_create_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  uint64_t seed = tc_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  if (rank == 0) fprintf(stderr, "[seed] FORKATTN_TEST_SEED=%llu (test_tree_mpi, %d ranks)\n", (unsigned long long)seed, size);
  tc_rng rng;
  tc_rng_init(&rng, seed);
  tt_tree tree;
  tt_random_trie(&tree, &rng, opt.prompt, opt.leaves, opt.max_seg);
  tt_packed pk;
  tt_pack(&pk, &tree, 0);
  const int64_t T = pk.off[tree.n], hq = opt.hq, hkv = opt.hkv, d = opt.d, wq = hq * d, wk = hkv * d;
  const float scale = 1.0f / sqrtf((float)d);
  float *q = mt_alloc(T * wq), *k = mt_alloc(T * wk), *v = mt_alloc(T * wk), *dout = mt_alloc(T * wq);
  for (int64_t i = 0; i < T * wq; i++) q[i] = (float)tc_uniform(&rng, -4, 4), dout[i] = (float)tc_uniform(&rng, -1, 1);
  for (int64_t i = 0; i < T * wk; i++) k[i] = (float)tc_uniform(&rng, -1, 1), v[i] = (float)tc_uniform(&rng, -1, 1);

  /* expected: the whole tree in this process */
  float *o = mt_alloc(T * wq), *lse = mt_alloc(T * hq), *dq = mt_alloc(T * wq), *dk = mt_alloc(T * wk), *dv = mt_alloc(T * wk);
  double t_whole = mt_run(ctx, &pk.layout, T, &opt, q, k, v, dout, o, lse, dq, dk, dv, scale);
  if (opt.bench) t_whole = mt_run(ctx, &pk.layout, T, &opt, q, k, v, dout, o, lse, dq, dk, dv, scale); /* warm */

  /* every rank builds the same partition: a fixed model (calibration would differ per rank) */
  const forkattn_tree_cost_model model = {hq, d, 1e-10, 1e-8, 1e-6};
  forkattn_partition *part = NULL;
  mt_check_status(forkattn_tree_partition(ctx, &pk.layout, size, &model, &part), ctx, "tree_partition");
  int64_t n = 0;
  const int64_t *rows = forkattn_partition_rows(part, rank, &n);
  const unsigned char *owned = forkattn_partition_owned(part, rank);
  const forkattn_tree_layout lay = tc_partition_layout(part, rank);

  /* this rank's rows: gather inputs, no loss on rows owned elsewhere */
  float *pq = mt_alloc(n * wq), *pk_ = mt_alloc(n * wk), *pv = mt_alloc(n * wk), *pdo = mt_alloc(n * wq);
  float *po = mt_alloc(n * wq), *plse = mt_alloc(n * hq), *pdq = mt_alloc(n * wq), *pdk = mt_alloc(n * wk), *pdv = mt_alloc(n * wk);
  for (int64_t r = 0; r < n; r++) {
    memcpy(pq + r * wq, q + rows[r] * wq, sizeof(float) * (size_t)wq);
    memcpy(pk_ + r * wk, k + rows[r] * wk, sizeof(float) * (size_t)wk);
    memcpy(pv + r * wk, v + rows[r] * wk, sizeof(float) * (size_t)wk);
    if (owned[r]) memcpy(pdo + r * wq, dout + rows[r] * wq, sizeof(float) * (size_t)wq);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  double t_part = 0, t_reduce = 0;
  if (n > 0) t_part = mt_run(ctx, &lay, n, &opt, pq, pk_, pv, pdo, po, plse, pdq, pdk, pdv, scale);
  if (n > 0 && opt.bench) t_part = mt_run(ctx, &lay, n, &opt, pq, pk_, pv, pdo, po, plse, pdq, pdk, pdv, scale);
  const double t1 = mt_now();
  forkattn_tensor g[3] = {forkattn_tensor_contiguous(pdq, FORKATTN_DTYPE_F32, n, hq, d),
                          forkattn_tensor_contiguous(pdk, FORKATTN_DTYPE_F32, n, hkv, d),
                          forkattn_tensor_contiguous(pdv, FORKATTN_DTYPE_F32, n, hkv, d)};
  const forkattn_tensor *gp[3] = {&g[0], &g[1], &g[2]};
  mt_check_status(forkattn_partition_allreduce(ctx, MPI_COMM_WORLD, part, gp, 3), ctx, "partition_allreduce");
  t_reduce = mt_now() - t1;

  /* checks */
  long long failures = 0;
  int *own_count = calloc((size_t)T + 1, sizeof *own_count), *held = calloc((size_t)T + 1, sizeof *held);
  if (!own_count || !held) MPI_Abort(MPI_COMM_WORLD, 2);
  double mo = 1e-30, mg = 1e-30, eo = 0, el = 0, eg = 0;
  for (int64_t i = 0; i < T * wq; i++) mo = fmax(mo, fabs(o[i])), mg = fmax(mg, fabs(dq[i]));
  for (int64_t i = 0; i < T * wk; i++) mg = fmax(mg, fmax(fabs(dk[i]), fabs(dv[i])));
  int64_t n_owned = 0;
  for (int64_t r = 0; r < n; r++) {
    const int64_t gr = rows[r];
    held[gr] = 1;
    n_owned += owned[r];
    own_count[gr] += owned[r];
    if (owned[r]) {
      for (int64_t c = 0; c < wq; c++) eo = fmax(eo, fabs((double)po[r * wq + c] - o[gr * wq + c]));
      for (int64_t h = 0; h < hq; h++) el = fmax(el, fabs((double)plse[r * hq + h] - lse[gr * hq + h]));
    }
    for (int64_t c = 0; c < wq; c++) eg = fmax(eg, fabs((double)pdq[r * wq + c] - dq[gr * wq + c]));
    for (int64_t c = 0; c < wk; c++)
      eg = fmax(eg, fmax(fabs((double)pdk[r * wk + c] - dk[gr * wk + c]), fabs((double)pdv[r * wk + c] - dv[gr * wk + c])));
  }
  MPI_Allreduce(MPI_IN_PLACE, own_count, (int)T, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, held, (int)T, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  for (int64_t r = 0; r < T; r++) failures += own_count[r] != 1 || held[r] != 1;
  if (failures && rank == 0) fprintf(stderr, "FAIL: %lld rows not owned exactly once\n", failures);
  const double rel_o = eo / mo, rel_g = eg / mg;
  if (rel_o > 1e-5 || el > 1e-4 || rel_g > 1e-5) {
    fprintf(stderr, "FAIL rank %d: o %.3e lse %.3e grads %.3e (relative to the largest magnitude)\n", rank, rel_o, el, rel_g);
    failures++;
  }
  fprintf(stderr, "[rank %d/%d] %lld of %lld rows (%lld owned), part cost %.3g s predicted; errors o %.2e lse %.2e "
          "grads %.2e; time part fwd+bwd %.4f s, allreduce %.4f s, whole tree %.4f s; backend %s device %d\n",
          rank, size, (long long)n, (long long)T, (long long)n_owned, forkattn_partition_cost(part, rank), rel_o, el, rel_g,
          t_part, t_reduce, t_whole, forkattn_backend_name(forkattn_ctx_backend(ctx)), local_rank);
  double t_max = t_part + t_reduce;
  MPI_Allreduce(MPI_IN_PLACE, &t_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("test_tree_mpi: %d ranks, %lld nodes, %lld rows, imbalance %.3f (predicted), %s\n", size, (long long)tree.n,
           (long long)T, forkattn_partition_imbalance(part), failures ? "FAILED" : "PASSED");
    if (opt.bench)
      printf("bench: whole tree on one rank %.4f s; slowest rank (part + allreduce) %.4f s; speedup %.2fx\n", t_whole,
             t_max, t_whole / t_max);
  }
  free(own_count), free(held);
  free(q), free(k), free(v), free(dout), free(o), free(lse), free(dq), free(dk), free(dv);
  free(pq), free(pk_), free(pv), free(pdo), free(po), free(plse), free(pdq), free(pdk), free(pdv);
  forkattn_partition_free(part);
  tt_packed_free(&pk);
  tt_free(&tree);
  forkattn_ctx_destroy(ctx);
  MPI_Finalize();
  return failures ? 1 : 0;
}
