/*
 * test_mpi_errors.c - forkattn_partition_allreduce when one rank cannot take
 * part (run under mpirun -np 2 and -np 3; built with -DFORKATTN_MPI=ON).
 *
 * For each rank R in turn, R alone passes bad arguments (a tensor with one
 * extra row, one tensor fewer, a different heads/head_dim split of the same
 * data) or, with --oom (a -DFORKATTN_ALLOC_TEST=ON build), has its shared-row
 * list or its reduction buffer allocation fail. Every rank must return the same
 * status (nobody may wait for R in the reduction), name rank R in its message,
 * and leave its tensors untouched. After each refused call a correct call must
 * sum the shared rows exactly (small integers in f32). Each rank exits through
 * alarm() if a call hangs, so a regression fails instead of blocking CI.
 */
#define _POSIX_C_SOURCE 200809L /* alarm() */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "forkattn.h"
#include "forkattn_mpi.h"
#include "tree_builder.h"

/* the library's allocation-failure hook, exported only by FORKATTN_ALLOC_TEST builds */
extern int64_t forkattn_test_fail_alloc_after(int64_t n) __attribute__((weak));

#define HQ 2
#define HKV 1
#define D 8

static int g_rank, g_size;
static long long g_failures;

static void fail(const char *fmt, const char *what, int bad_rank, const char *detail) {
  fprintf(stderr, "FAIL rank %d (%s, bad rank %d): ", g_rank, what, bad_rank);
  fprintf(stderr, fmt, detail);
  fputc('\n', stderr);
  g_failures++;
}

/* the value rank p holds for global row g, column c: small integers, so sums are exact */
static float value(int p, int64_t g, int64_t c) { return (float)((p + 1) * (g % 7 + 1) + c % 3); }

typedef struct {
  int64_t n;                /* this rank's rows */
  const int64_t *rows;      /* their global indices */
  float *dq, *dk, *dv;      /* [n (+1), heads, D] */
  int64_t width[3];         /* heads*D of each */
} part_data;

static void fill(part_data *p) {
  float *t[3] = {p->dq, p->dk, p->dv};
  for (int i = 0; i < 3; i++)
    for (int64_t r = 0; r <= p->n; r++) /* the spare row too */
      for (int64_t c = 0; c < p->width[i]; c++) t[i][r * p->width[i] + c] = value(g_rank, r < p->n ? p->rows[r] : -1, c);
}

static int untouched(const part_data *p) {
  const float *t[3] = {p->dq, p->dk, p->dv};
  for (int i = 0; i < 3; i++)
    for (int64_t r = 0; r <= p->n; r++)
      for (int64_t c = 0; c < p->width[i]; c++)
        if (t[i][r * p->width[i] + c] != value(g_rank, r < p->n ? p->rows[r] : -1, c)) return 0;
  return 1;
}

/* The failing case `what` on rank `bad`; expect `want` on every rank. */
static void refused(forkattn_ctx *ctx, const forkattn_partition *part, part_data *p, const char *what, int bad,
                    forkattn_status want) {
  fill(p);
  forkattn_tensor t[3] = {forkattn_tensor_contiguous(p->dq, FORKATTN_DTYPE_F32, p->n, HQ, D),
                          forkattn_tensor_contiguous(p->dk, FORKATTN_DTYPE_F32, p->n, HKV, D),
                          forkattn_tensor_contiguous(p->dv, FORKATTN_DTYPE_F32, p->n, HKV, D)};
  int count = 3;
  if (g_rank == bad) {
    if (!strcmp(what, "extra-row")) t[1].rows++;
    else if (!strcmp(what, "count")) count = 2;
    else if (!strcmp(what, "shape")) t[0] = forkattn_tensor_contiguous(p->dq, FORKATTN_DTYPE_F32, p->n, 2 * HQ, D / 2);
    else if (!strcmp(what, "oom-list")) forkattn_test_fail_alloc_after(0);
    else if (!strcmp(what, "oom-buffer")) forkattn_test_fail_alloc_after(2);
  }
  const forkattn_tensor *tp[3] = {&t[0], &t[1], &t[2]};
  alarm(30);
  forkattn_status st = forkattn_partition_allreduce(ctx, MPI_COMM_WORLD, part, tp, count);
  alarm(0);
  if (forkattn_test_fail_alloc_after) forkattn_test_fail_alloc_after(-1);
  const char *msg = forkattn_ctx_last_error(ctx);
  if (st != want) fail("status %s", what, bad, forkattn_status_string(st));
  /* mismatches are found by comparing ranks: no single rank is to blame */
  char who[32];
  snprintf(who, sizeof who, "rank %d of", bad);
  const int blames = strcmp(what, "count") && strcmp(what, "shape");
  if (blames ? !strstr(msg, who) : !strstr(msg, "ranks pass different")) fail("message \"%s\"", what, bad, msg);
  if (!untouched(p)) fail("%s", what, bad, "tensors were modified");
  if (g_rank == 0 && bad == 0) fprintf(stderr, "[%s] %s\n", what, msg);
}

/* A correct call: shared rows hold the sum over the parts that hold them. */
static void reduced(forkattn_ctx *ctx, const forkattn_partition *part, part_data *p, const int64_t *holders,
                    const unsigned char *const *held_by, const char *after, int bad) {
  fill(p);
  forkattn_tensor t[3] = {forkattn_tensor_contiguous(p->dq, FORKATTN_DTYPE_F32, p->n, HQ, D),
                          forkattn_tensor_contiguous(p->dk, FORKATTN_DTYPE_F32, p->n, HKV, D),
                          forkattn_tensor_contiguous(p->dv, FORKATTN_DTYPE_F32, p->n, HKV, D)};
  const forkattn_tensor *tp[3] = {&t[0], &t[1], &t[2]};
  alarm(30);
  forkattn_status st = forkattn_partition_allreduce(ctx, MPI_COMM_WORLD, part, tp, 3);
  alarm(0);
  if (st != FORKATTN_OK) {
    fail("correct call failed: %s", after, bad, forkattn_ctx_last_error(ctx));
    return;
  }
  const float *d[3] = {p->dq, p->dk, p->dv};
  for (int i = 0; i < 3; i++)
    for (int64_t r = 0; r < p->n; r++) {
      const int64_t g = p->rows[r];
      for (int64_t c = 0; c < p->width[i]; c++) {
        float want = value(g_rank, g, c);
        if (holders[g] > 1) {
          want = 0;
          for (int q = 0; q < g_size; q++)
            if (held_by[q][g]) want += value(q, g, c);
        }
        if (d[i][r * p->width[i] + c] != want) {
          fail("%s", after, bad, "wrong sum after a refused call");
          return;
        }
      }
    }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const int oom = argc > 1 && !strcmp(argv[1], "--oom");
  if (oom && !forkattn_test_fail_alloc_after) {
    fprintf(stderr, "--oom needs a -DFORKATTN_ALLOC_TEST=ON build\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  forkattn_ctx *ctx = NULL;
  if (forkattn_ctx_create(&ctx, NULL) != FORKATTN_OK) MPI_Abort(MPI_COMM_WORLD, 2);

  /* a prompt shared by every part, a few branches and leaves */
  tt_tree tree;
  tt_init(&tree, 16);
  const int64_t root = tt_add(&tree, -1, 24);
  for (int b = 0; b < 3; b++) {
    const int64_t mid = tt_add(&tree, root, 5 + b);
    for (int l = 0; l < 2; l++) tt_add(&tree, mid, 3 + l + b);
  }
  tt_packed pk;
  tt_pack(&pk, &tree, 0);
  const int64_t T = pk.off[tree.n];
  const forkattn_tree_cost_model model = {HQ, D, 1e-10, 1e-8, 1e-6};
  forkattn_partition *part = NULL;
  if (forkattn_tree_partition(ctx, &pk.layout, g_size, &model, &part) != FORKATTN_OK) MPI_Abort(MPI_COMM_WORLD, 2);

  /* which parts hold each global row (every rank derives the same) */
  int64_t *holders = calloc((size_t)T, sizeof *holders), shared = 0;
  unsigned char **held_by = calloc((size_t)g_size, sizeof *held_by);
  if (!holders || !held_by) MPI_Abort(MPI_COMM_WORLD, 2);
  for (int q = 0; q < g_size; q++) {
    int64_t n = 0;
    const int64_t *rows = forkattn_partition_rows(part, q, &n);
    if (!(held_by[q] = calloc((size_t)T, 1))) MPI_Abort(MPI_COMM_WORLD, 2);
    for (int64_t r = 0; r < n; r++) holders[rows[r]]++, held_by[q][rows[r]] = 1;
  }
  for (int64_t g = 0; g < T; g++) shared += holders[g] > 1;
  if (shared == 0) {
    fprintf(stderr, "the partition shares no rows: the test checks nothing\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }

  part_data p = {0};
  p.rows = forkattn_partition_rows(part, g_rank, &p.n);
  p.width[0] = HQ * D, p.width[1] = HKV * D, p.width[2] = HKV * D;
  p.dq = calloc((size_t)(p.n + 1) * HQ * D, sizeof(float)); /* + 1 row: the extra-row case reads it */
  p.dk = calloc((size_t)(p.n + 1) * HKV * D, sizeof(float));
  p.dv = calloc((size_t)(p.n + 1) * HKV * D, sizeof(float));
  if (!p.dq || !p.dk || !p.dv) MPI_Abort(MPI_COMM_WORLD, 2);

  const char *cases[] = {"extra-row", "count", "shape", "oom-list", "oom-buffer"};
  const int ncases = oom ? 5 : 3;
  reduced(ctx, part, &p, holders, (const unsigned char *const *)held_by, "first call", -1);
  for (int c = 0; c < ncases; c++)
    for (int bad = 0; bad < g_size; bad++) {
      const forkattn_status want = c < 3 ? FORKATTN_ERR_INVALID_ARGUMENT : FORKATTN_ERR_OUT_OF_MEMORY;
      refused(ctx, part, &p, cases[c], bad, want);
      reduced(ctx, part, &p, holders, (const unsigned char *const *)held_by, cases[c], bad);
    }

  MPI_Allreduce(MPI_IN_PLACE, &g_failures, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    printf("test_mpi_errors: %d ranks, %lld of %lld rows shared, %d cases on each rank: %s\n", g_size,
           (long long)shared, (long long)T, ncases, g_failures ? "FAILED" : "PASSED");
  for (int q = 0; q < g_size; q++) free(held_by[q]);
  free(held_by), free(holders), free(p.dq), free(p.dk), free(p.dv);
  forkattn_partition_free(part);
  tt_packed_free(&pk);
  tt_free(&tree);
  forkattn_ctx_destroy(ctx);
  MPI_Finalize();
  return g_failures ? 1 : 0;
}
