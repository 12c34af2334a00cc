/* Allocation-failure sweep (FORKATTN_ALLOC_TEST builds): fail the Nth library
 * allocation for N = 0, 1, 2, ... until the call succeeds, for context
 * creation, forward and backward. Every failure must return
 * FORKATTN_ERR_OUT_OF_MEMORY (never crash), the next call on the same context
 * must work and give the same bits as an undisturbed run, and nothing may leak
 * (the ASan build's LeakSanitizer checks at exit). [host or device] */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "test_common.h"

/* Exported by the library in FORKATTN_ALLOC_TEST builds only (lib/alloc.c). */
FORKATTN_API int64_t forkattn_test_fail_alloc_after(int64_t n);

#define NT 8
enum { P = 40, N = 3, HQ = 4, HKV = 2, D = 16 };

typedef struct {
  forkattn_prefix_layout lay;
  int64_t off[N + 1];
  tc_buf buf[NT];
  forkattn_tensor t[NT]; /* q k v o dout dq dk dv */
  float lse[(P + 30) * HQ];
} problem;

static void problem_init(problem *p, forkattn_dtype dt, const char *name) {
  tc_rng rng = tc_rng_for(name);
  const int64_t lens[N] = {11, 0, 19};
  p->off[0] = 0;
  for (int i = 0; i < N; i++) p->off[i + 1] = p->off[i] + lens[i];
  p->lay = (forkattn_prefix_layout){P, N, p->off, FORKATTN_MASK_CAUSAL};
  const int64_t T = P + p->off[N], heads[NT] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  for (int i = 0; i < NT; i++) {
    p->t[i] = tc_buf_contiguous(&p->buf[i], dt, T, heads[i], D);
    tc_fill_tensor(&rng, &p->t[i], -1.0, 1.0);
  }
}

static void problem_free(problem *p) {
  for (int i = 0; i < NT; i++) tc_buf_free(&p->buf[i]);
}

static forkattn_status run(forkattn_ctx *ctx, problem *p, int bwd) {
  forkattn_tensor *t = p->t;
  if (!bwd) return forkattn_prefix_fwd(ctx, &p->lay, &t[0], &t[1], &t[2], &t[3], p->lse, 0.25f, FORKATTN_MEMORY_HOST);
  return forkattn_prefix_bwd(ctx, &p->lay, &t[0], &t[1], &t[2], &t[3], &t[4], p->lse, &t[5], &t[6], &t[7], 0.25f,
                             FORKATTN_MEMORY_HOST);
}

/* Sweep one operation; returns the number of failure points exercised. */
static int sweep(forkattn_ctx *ctx, problem *p, problem *want, int bwd, const char *name) {
  int n = 0;
  for (;; n++) {
    cr_assert_lt(n, 10000, "%s: never succeeded", name);
    forkattn_test_fail_alloc_after(n);
    forkattn_status st = run(ctx, p, bwd);
    forkattn_test_fail_alloc_after(-1);
    if (st == FORKATTN_OK) break;
    cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "%s: allocation %d failed with status %s (%s)", name, n,
                 forkattn_status_string(st), forkattn_ctx_last_error(ctx));
    cr_assert_neq(forkattn_ctx_last_error(ctx)[0], '\0', "%s: no message after failure %d", name, n);
    /* the very next call on the same context works */
    cr_assert_eq(run(ctx, p, bwd), FORKATTN_OK, "%s: call after failure %d: %s", name, n, forkattn_ctx_last_error(ctx));
  }
  int first = bwd ? 5 : 3, last = bwd ? 7 : 3;
  for (int i = first; i <= last; i++)
    cr_assert(memcmp(p->buf[i].data, want->buf[i].data, p->buf[i].elems * (p->t[i].dtype ? 2 : 4)) == 0,
              "%s: tensor %d differs from an undisturbed run", name, i);
  return n;
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
  cr_assert_eq(run(ctx, &want, 0), FORKATTN_OK);
  cr_assert_eq(run(ctx, &want, 1), FORKATTN_OK);
  int nf = sweep(ctx, &p, &want, 0, name);
  int nb = sweep(ctx, &p, &want, 1, name);
  fprintf(stderr, "%s: ctx_create %d, forward %d, backward %d failure points, each OUT_OF_MEMORY then recovered\n",
          name, created_after, nf, nb);
  cr_assert_gt(nf, 0);
  cr_assert_gt(nb, 0);
  problem_free(&want);
  problem_free(&p);
  forkattn_ctx_destroy(ctx);
}

Test(alloc_failures, sweep_f32) { sweep_all(FORKATTN_DTYPE_F32, "alloc_failures/f32"); }
Test(alloc_failures, sweep_bf16) { sweep_all(FORKATTN_DTYPE_BF16, "alloc_failures/bf16"); }
