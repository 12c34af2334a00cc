/* plan_cost: what planning costs a call on the host, and what the context's
 * plan cache (lib/layout/plan_cache.h) saves of it.
 *
 * A tiny CPU forward and backward (one head, head_dim 8, one thread, a few
 * rows a segment: little arithmetic, though the kernels' cost per block
 * remains) on varlen batches of 1, 256 and 4096 sequences and on random trees
 * of 64, 512 and 4096 nodes, on a context with FORKATTN_PLAN_CACHE=0 (every
 * call plans its layout; the backward splits key blocks too) and on one with
 * the cache (every call after the first finds its plan and blocks), alternating.
 * Each figure is the median over `reps` calls after 3 warm-ups, in
 * microseconds; "saved" the median of the paired differences.
 * Usage: plan_cost [reps] (default 101). Results: bench/RESULTS.md. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "forkattn.h"

enum { SEQ_ROWS = 4, NODE_ROWS = 2, D = 8 };

static double pc_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e6 * (double)ts.tv_sec + 1e-3 * (double)ts.tv_nsec;
}

static int pc_cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static forkattn_ctx *pc_ctx(const char *cache) {
  setenv("FORKATTN_PLAN_CACHE", cache, 1); /* read at creation */
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = 1;
  forkattn_ctx *ctx = NULL;
  if (forkattn_ctx_create(&ctx, &opt)) {
    fprintf(stderr, "plan_cost: %s\n", forkattn_ctx_create_error());
    exit(1);
  }
  return ctx;
}

/* A problem's tensors over one buffer: t (queries, keys, values and dout at once), o, dq, dk, dv. */
typedef struct pc_problem {
  float *buf, *lse;
  forkattn_tensor t, o, dq, dk, dv;
} pc_problem;

static void pc_problem_init(pc_problem *p, int64_t rows) {
  p->buf = calloc((size_t)(5 * rows * D), sizeof *p->buf);
  p->lse = calloc((size_t)rows, sizeof *p->lse);
  if (!p->buf || !p->lse) exit(1);
  for (int64_t i = 0; i < rows * D; i++) p->buf[i] = (float)((i * 7919) % 17) / 17.0f - 0.5f;
  forkattn_tensor *t[5] = {&p->t, &p->o, &p->dq, &p->dk, &p->dv};
  for (int i = 0; i < 5; i++) *t[i] = forkattn_tensor_contiguous(p->buf + i * rows * D, FORKATTN_DTYPE_F32, rows, 1, D);
}

/* One forward (bwd = 0) or backward of `layout` on ctx (forkattn_kept_fwd/bwd
 * without a kept set: the prefix or tree call, whichever the layout holds). */
static forkattn_status pc_call(forkattn_ctx *ctx, const forkattn_layout *layout, pc_problem *p, int bwd) {
  const forkattn_memory host = FORKATTN_MEMORY_HOST;
  return bwd ? forkattn_kept_bwd(ctx, layout, NULL, &p->t, &p->t, &p->t, &p->o, &p->t, p->lse, &p->dq, &p->dk, &p->dv,
                                 0.35f, host)
             : forkattn_kept_fwd(ctx, layout, NULL, &p->t, &p->t, &p->t, &p->o, p->lse, 0.35f, host);
}

static double pc_call_us(forkattn_ctx *ctx, const forkattn_layout *layout, pc_problem *p, int bwd) {
  const double t0 = pc_now_us();
  if (pc_call(ctx, layout, p, bwd)) {
    fprintf(stderr, "plan_cost: %s\n", forkattn_ctx_last_error(ctx));
    exit(1);
  }
  return pc_now_us() - t0;
}

static double pc_median(double *x, int n) {
  qsort(x, (size_t)n, sizeof *x, pc_cmp);
  return x[n / 2];
}

/* The calls without and with the cache alternate, so that drift on a shared
 * machine hits both; saved is the median of the pairs' differences. */
static void pc_report(const char *what, const forkattn_layout *layout, int64_t rows, int reps, forkattn_ctx *off,
                      forkattn_ctx *on) {
  pc_problem p;
  pc_problem_init(&p, rows);
  double *us = malloc(sizeof *us * 3 * (size_t)reps);
  if (!us) exit(1);
  printf("%-18s %6lld", what, (long long)rows);
  for (int bwd = 0; bwd < 2; bwd++) {
    for (int r = -3; r < reps; r++) { /* 3 warm-ups */
      const double a = pc_call_us(off, layout, &p, bwd), b = pc_call_us(on, layout, &p, bwd);
      if (r < 0) continue;
      us[r] = a, us[reps + r] = b, us[2 * reps + r] = a - b;
    }
    printf(" %10.1f %10.1f %8.1f", pc_median(us, reps), pc_median(us + reps, reps), pc_median(us + 2 * reps, reps));
  }
  printf("\n");
  free(us);
  free(p.buf);
  free(p.lse);
}

int main(int argc, char **argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 101;
  if (reps < 1) return fprintf(stderr, "usage: plan_cost [reps >= 1]\n"), 2;
  forkattn_ctx *off = pc_ctx("0"), *on = pc_ctx("1");
  printf("# per-call host time on the CPU, median of %d calls, us (1 head, d=%d, 1 thread)\n", reps, D);
  printf("%-18s %6s %10s %10s %8s %10s %10s %8s\n", "layout", "rows", "fwd", "fwd cached", "saved", "bwd",
         "bwd cached", "saved");
  const int64_t seqs[3] = {1, 256, 4096}, nodes[3] = {64, 512, 4096};
  for (int i = 0; i < 3; i++) { /* varlen: no prompt, sequences of SEQ_ROWS rows */
    const int64_t n = seqs[i];
    int64_t *off_rows = malloc(sizeof *off_rows * (size_t)(n + 1));
    for (int64_t s = 0; s <= n; s++) off_rows[s] = s * SEQ_ROWS;
    const forkattn_prefix_layout pre = {0, n, off_rows, FORKATTN_MASK_CAUSAL};
    const forkattn_layout layout = {&pre, NULL};
    char what[64];
    snprintf(what, sizeof what, "varlen %lld seqs", (long long)n);
    pc_report(what, &layout, n * SEQ_ROWS, reps, off, on);
    free(off_rows);
  }
  for (int i = 0; i < 3; i++) { /* random recursive trees: each node's parent drawn among the earlier ones */
    const int64_t n = nodes[i];
    int64_t *node_off = malloc(sizeof *node_off * (size_t)(n + 1)), *par = malloc(sizeof *par * (size_t)n);
    uint64_t x = 0x9E3779B97F4A7C15u;
    for (int64_t v = 0; v < n; v++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      par[v] = v ? (int64_t)(x % (uint64_t)v) : -1;
      node_off[v] = v * NODE_ROWS;
    }
    node_off[n] = n * NODE_ROWS;
    const forkattn_tree_layout tree = {n, node_off, par};
    const forkattn_layout layout = {NULL, &tree};
    char what[64];
    snprintf(what, sizeof what, "tree %lld nodes", (long long)n);
    pc_report(what, &layout, n * NODE_ROWS, reps, off, on);
    free(node_off);
    free(par);
  }
  forkattn_ctx_destroy(off);
  forkattn_ctx_destroy(on);
  return 0;
}
