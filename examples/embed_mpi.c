/* embed_mpi.c - multi-rank tree attention from C through the installed package
 * (built with -DFORKATTN_MPI=ON).
 *
 *   cmake:      find_package(forkattn 0.1 REQUIRED) + target_link_libraries(app forkattn::forkattn)
 *   pkg-config: mpicc embed_mpi.c $(pkg-config --cflags --libs forkattn) -lm
 *   run:        mpirun -np 2 ./embed_mpi
 *
 * Every rank builds the same trie from six token sequences (a shared prompt,
 * branches at two depths), partitions it over the ranks, runs tree attention
 * forward and backward on its own part (dout = 0 on rows another rank owns),
 * and sums the duplicated rows' gradients with forkattn_partition_allreduce.
 * As a check each rank also runs the whole tree alone: o on owned rows and
 * dq/dk/dv on every row of its part must agree. Exit status 0 when they do. */
#include <forkattn.h>
#include <forkattn_mpi.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { HQ = 4, HKV = 2, D = 32, WQ = HQ * D, WK = HKV * D };

static float frand(unsigned *s) {
  *s = *s * 1664525u + 1013904223u;
  return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

#define CHECK(call)                                                                              \
  do {                                                                                           \
    forkattn_status st_ = (call);                                                                \
    if (st_) {                                                                                   \
      fprintf(stderr, "embed_mpi: %s: %s (%s)\n", #call, forkattn_status_string(st_),         \
              forkattn_ctx_last_error(ctx));                                                     \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
    }                                                                                            \
  } while (0)

/* Tree fwd+bwd over n rows held in b = {q, k, v, o, dout, dq, dk, dv}. */
static void run(forkattn_ctx *ctx, const forkattn_tree_layout *tree, int64_t n, float *b[8], float *lse) {
  const int64_t heads[8] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  forkattn_tensor t[8];
  for (int i = 0; i < 8; i++) t[i] = forkattn_tensor_contiguous(b[i], FORKATTN_DTYPE_F32, n, heads[i], D);
  const float scale = 1.0f / sqrtf((float)D);
  CHECK(forkattn_tree_fwd(ctx, tree, &t[0], &t[1], &t[2], &t[3], lse, scale, FORKATTN_MEMORY_HOST));
  CHECK(forkattn_tree_bwd(ctx, tree, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], scale,
                          FORKATTN_MEMORY_HOST));
}

static void alloc8(float *b[8], int64_t n) {
  const int64_t width[8] = {WQ, WK, WK, WQ, WQ, WQ, WK, WK};
  for (int i = 0; i < 8; i++) {
    b[i] = calloc((size_t)(n * width[i]) + 1, sizeof(float));
    if (!b[i]) MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  forkattn_ctx *ctx;
  if (forkattn_ctx_create(&ctx, NULL)) {
    fprintf(stderr, "embed_mpi: %s\n", forkattn_ctx_create_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  /* six rollouts: prompt 1..40, two first turns, then branches of each */
  enum { NSEQ = 6 };
  int64_t off[NSEQ + 1] = {0}, tokens[NSEQ * 200];
  unsigned seed = 7;
  for (int s = 0; s < NSEQ; s++) {
    int64_t len = 0, *t = tokens + off[s];
    for (int i = 0; i < 40; i++) t[len++] = 1 + i;                  /* shared prompt */
    for (int i = 0; i < 20; i++) t[len++] = 100 + (s % 2) * 50 + i; /* turn 1: two variants */
    const int extra = 5 + 13 * s;                                    /* turn 2: every rollout its own */
    for (int i = 0; i < extra; i++) t[len++] = 1000 + 100 * s + i;
    off[s + 1] = off[s] + len;
  }
  forkattn_trie *trie;
  CHECK(forkattn_trie_from_sequences(ctx, NSEQ, off, tokens, FORKATTN_TRIE_SINGLE_ROOT, &trie));
  forkattn_tree_layout tree;
  CHECK(forkattn_trie_layout(trie, &tree));
  const int64_t T = forkattn_trie_num_rows(trie);

  /* the same random q, k, v, dout on every rank (same seed) */
  float *whole[8], lse_whole[1024 * HQ];
  alloc8(whole, T);
  const int64_t width[8] = {WQ, WK, WK, WQ, WQ, WQ, WK, WK};
  for (int i = 0; i < 5; i++)
    if (i != 3)
      for (int64_t j = 0; j < T * width[i]; j++) whole[i][j] = frand(&seed);
  run(ctx, &tree, T, whole, lse_whole);

  /* this rank's part; every rank builds the same partition from the same model */
  const forkattn_tree_cost_model model = {HQ, D, 1e-10, 1e-8, 1e-6};
  forkattn_partition *pt;
  CHECK(forkattn_tree_partition(ctx, &tree, size, &model, &pt));
  int64_t n;
  const int64_t *rows = forkattn_partition_rows(pt, rank, &n);
  const unsigned char *own = forkattn_partition_owned(pt, rank);
  forkattn_tree_layout mine;
  CHECK(forkattn_partition_layout(pt, rank, &mine));
  float *part[8], lse_part[1024 * HQ];
  alloc8(part, n);
  for (int64_t r = 0; r < n; r++)
    for (int i = 0; i < 5; i++)
      if (i != 3 && (i != 4 || own[r]))
        memcpy(part[i] + r * width[i], whole[i] + rows[r] * width[i], sizeof(float) * (size_t)width[i]);
  if (n > 0) run(ctx, &mine, n, part, lse_part);
  forkattn_tensor g[3] = {forkattn_tensor_contiguous(part[5], FORKATTN_DTYPE_F32, n, HQ, D),
                          forkattn_tensor_contiguous(part[6], FORKATTN_DTYPE_F32, n, HKV, D),
                          forkattn_tensor_contiguous(part[7], FORKATTN_DTYPE_F32, n, HKV, D)};
  const forkattn_tensor *gp[3] = {&g[0], &g[1], &g[2]};
  CHECK(forkattn_partition_allreduce(ctx, MPI_COMM_WORLD, pt, gp, 3));

  double worst = 0;
  for (int64_t r = 0; r < n; r++)
    for (int i = 3; i < 8; i++) {
      if (i == 4 || (i == 3 && !own[r])) continue; /* o on owned rows, all gradients */
      for (int64_t c = 0; c < width[i]; c++)
        worst = fmax(worst, fabs((double)part[i][r * width[i] + c] - whole[i][rows[r] * width[i] + c]));
    }
  double all = worst;
  MPI_Allreduce(&worst, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    printf("embed_mpi: %d ranks, %lld sequences -> %lld nodes, %lld rows (dedup %.2fx), partition imbalance %.3f, "
           "max |difference| vs one process %.2e: %s\n", size, (long long)NSEQ, (long long)tree.num_nodes,
           (long long)T, forkattn_trie_dedup_ratio(trie), forkattn_partition_imbalance(pt), all,
           all <= 1e-5 ? "ok" : "MISMATCH");
  for (int i = 0; i < 8; i++) free(whole[i]), free(part[i]);
  forkattn_partition_free(pt);
  forkattn_trie_free(trie);
  forkattn_ctx_destroy(ctx);
  MPI_Finalize();
  return all <= 1e-5 ? 0 : 1;
}
