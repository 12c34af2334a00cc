/* One GRPO-like problem in device memory for the GPU tests (device_problem.h). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "device_problem.h"
#include "test_common.h"

/* A: a 1536-row prompt, 8 responses of 128; B: 1024 and 5 responses of mixed lengths (one empty). */
void dp_make_lays(dp_lay *a, dp_lay *b) {
  const int64_t la[8] = {128, 128, 128, 128, 128, 128, 128, 128}, lb[5] = {64, 200, 0, 128, 96};
  a->off[0] = b->off[0] = 0;
  for (int i = 0; i < 8; i++) a->off[i + 1] = a->off[i] + la[i];
  for (int i = 0; i < 5; i++) b->off[i + 1] = b->off[i] + lb[i];
  a->l = (forkattn_prefix_layout){1536, 8, a->off, FORKATTN_MASK_CAUSAL};
  b->l = (forkattn_prefix_layout){1024, 5, b->off, FORKATTN_MASK_CAUSAL};
  a->T = 1536 + a->off[8];
  b->T = 1024 + b->off[5];
}

static size_t dp_rows_bytes(int64_t T, int64_t heads) { return (size_t)(T * heads * DP_D) * 2; }

static void *dp_dev_buf(forkattn_ctx *ctx, size_t bytes, const void *host) {
  void *p = NULL;
  cr_assert_eq(forkattn_device_malloc(ctx, bytes, &p), FORKATTN_OK);
  cr_assert_eq(forkattn_memcpy(ctx, p, FORKATTN_MEMORY_DEVICE, host, FORKATTN_MEMORY_HOST, bytes), FORKATTN_OK);
  return p;
}

/* Outputs poisoned with all-ones bytes (NaN in bf16 and f32): an element left unwritten shows. */
static void dp_alloc_outs(forkattn_ctx *ctx, dp_outs *s, int64_t T, const void *poison) {
  s->o = dp_dev_buf(ctx, dp_rows_bytes(T, DP_HQ), poison);
  s->lse = dp_dev_buf(ctx, sizeof(float) * (size_t)(T * DP_HQ), poison);
  s->dq = dp_dev_buf(ctx, dp_rows_bytes(T, DP_HQ), poison);
  s->dk = dp_dev_buf(ctx, dp_rows_bytes(T, DP_HKV), poison);
  s->dv = dp_dev_buf(ctx, dp_rows_bytes(T, DP_HKV), poison);
}

void dp_problem_init(dp_problem *p, forkattn_ctx *ctx, int64_t T, const char *name) {
  p->ctx = ctx, p->T = T;
  tc_rng rng = tc_rng_for(name);
  tc_buf in;
  forkattn_tensor t = tc_buf_contiguous(&in, FORKATTN_DTYPE_BF16, T, DP_HQ, DP_D);
  unsigned char *poison = malloc(dp_rows_bytes(T, DP_HQ));
  cr_assert_not_null(poison);
  memset(poison, 0xff, dp_rows_bytes(T, DP_HQ));
  void **inputs[4] = {&p->q, &p->k, &p->v, &p->dout};
  const int64_t heads[4] = {DP_HQ, DP_HKV, DP_HKV, DP_HQ};
  for (int i = 0; i < 4; i++) {
    t.heads = heads[i], t.row_stride = heads[i] * DP_D;
    tc_fill_tensor(&rng, &t, -1.0, 1.0);
    *inputs[i] = dp_dev_buf(ctx, dp_rows_bytes(T, heads[i]), in.data);
  }
  for (int i = 0; i < DP_SETS; i++) dp_alloc_outs(ctx, &p->set[i], T, poison);
  dp_alloc_outs(ctx, &p->scratch, T, poison);
  free(poison);
  tc_buf_free(&in);
}

static void dp_free_outs(forkattn_ctx *ctx, dp_outs *s) {
  void *b[5] = {s->o, s->lse, s->dq, s->dk, s->dv};
  for (int i = 0; i < 5; i++) cr_assert_eq(forkattn_device_free(ctx, b[i]), FORKATTN_OK);
}

void dp_problem_free(dp_problem *p) {
  void *b[4] = {p->q, p->k, p->v, p->dout};
  for (int i = 0; i < 4; i++) cr_assert_eq(forkattn_device_free(p->ctx, b[i]), FORKATTN_OK);
  for (int i = 0; i < DP_SETS; i++) dp_free_outs(p->ctx, &p->set[i]);
  dp_free_outs(p->ctx, &p->scratch);
}

static forkattn_tensor dp_tn(void *data, int64_t T, int64_t heads) {
  return forkattn_tensor_contiguous(data, FORKATTN_DTYPE_BF16, T, heads, DP_D);
}

void dp_fwd(dp_problem *p, const dp_lay *L, dp_outs *s) {
  const forkattn_tensor q = dp_tn(p->q, L->T, DP_HQ), k = dp_tn(p->k, L->T, DP_HKV), v = dp_tn(p->v, L->T, DP_HKV),
                        o = dp_tn(s->o, L->T, DP_HQ);
  cr_assert_eq(forkattn_prefix_fwd(p->ctx, &L->l, &q, &k, &v, &o, s->lse, 0.08838835f, FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(p->ctx));
}

void dp_bwd(dp_problem *p, const dp_lay *L, dp_outs *s) {
  const forkattn_tensor q = dp_tn(p->q, L->T, DP_HQ), k = dp_tn(p->k, L->T, DP_HKV), v = dp_tn(p->v, L->T, DP_HKV),
                        o = dp_tn(s->o, L->T, DP_HQ), dout = dp_tn(p->dout, L->T, DP_HQ), dq = dp_tn(s->dq, L->T, DP_HQ),
                        dk = dp_tn(s->dk, L->T, DP_HKV), dv = dp_tn(s->dv, L->T, DP_HKV);
  cr_assert_eq(forkattn_prefix_bwd(p->ctx, &L->l, &q, &k, &v, &o, &dout, s->lse, &dq, &dk, &dv, 0.08838835f,
                                   FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(p->ctx));
}

/* Set i's outputs of layout L on the host, in one block: o, lse, dq, dk, dv. */
static unsigned char *dp_read_outs(dp_problem *p, const dp_outs *s, const dp_lay *L, size_t *bytes) {
  const size_t n[5] = {dp_rows_bytes(L->T, DP_HQ), sizeof(float) * (size_t)(L->T * DP_HQ), dp_rows_bytes(L->T, DP_HQ),
                       dp_rows_bytes(L->T, DP_HKV), dp_rows_bytes(L->T, DP_HKV)};
  const void *src[5] = {s->o, s->lse, s->dq, s->dk, s->dv};
  *bytes = n[0] + n[1] + n[2] + n[3] + n[4];
  unsigned char *h = malloc(*bytes), *at = h;
  cr_assert_not_null(h);
  for (int i = 0; i < 5; i++, at += n[i - 1])
    cr_assert_eq(forkattn_memcpy(p->ctx, at, FORKATTN_MEMORY_HOST, src[i], FORKATTN_MEMORY_DEVICE, n[i]), FORKATTN_OK,
                 "%s", forkattn_ctx_last_error(p->ctx));
  return h;
}

/* No all-ones 16-bit word (the poison; NaN in bf16) in o, dq, dk, dv of read_outs' block: every element
 * was written. (lse is f32: two of its bytes may be all ones.) */
static void dp_assert_written(const unsigned char *h, const dp_lay *L, const char *what) {
  const size_t n[5] = {dp_rows_bytes(L->T, DP_HQ), sizeof(float) * (size_t)(L->T * DP_HQ), dp_rows_bytes(L->T, DP_HQ),
                       dp_rows_bytes(L->T, DP_HKV), dp_rows_bytes(L->T, DP_HKV)};
  const char *name[5] = {"o", "lse", "dq", "dk", "dv"};
  const int64_t heads[5] = {DP_HQ, DP_HQ, DP_HQ, DP_HKV, DP_HKV};
  for (int t = 0; t < 5; h += n[t], t++) {
    if (t == 1) continue;
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < n[t]; i += 2)
      if (h[i] == 0xff && h[i + 1] == 0xff) bad++, first = first < 0 ? (int64_t)i / 2 : first;
    cr_assert_eq(bad, 0, "%s: %lld elements of %s unwritten, the first at row %lld head %lld col %lld", what,
                 (long long)bad, name[t], (long long)(first / (heads[t] * DP_D)), (long long)(first / DP_D % heads[t]),
                 (long long)(first % DP_D));
  }
}

/* The context's calls queued behind 10 forwards of layout A, so the host runs far ahead of the GPU. */
void dp_queue_prologue(dp_problem *p, const dp_lay *a) {
  for (int i = 0; i < 10; i++) dp_fwd(p, a, &p->scratch);
}

static forkattn_ctx *dp_gpu_ctx_with_mma(const char *name) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip(name);
  if (strstr(forkattn_ctx_gpu_kernels(ctx), "forward fp32")) {
    forkattn_ctx_destroy(ctx);
    cr_skip_test("%s: FORKATTN_GPU_KERNELS=fp32: no tensor-core call to compare", name);
  }
  return ctx;
}

void dp_duo_init_env(dp_duo *d, const char *name, const char *var, const char *ref_value, const char *value) {
  if (var) setenv(var, ref_value, 1);
  d->sync_ctx = dp_gpu_ctx_with_mma(name);
  if (var) setenv(var, value, 1);
  d->ctx = tc_gpu_ctx_or_skip(name);
  if (var) unsetenv(var);
  dp_make_lays(&d->a, &d->b);
  dp_problem_init(&d->ps, d->sync_ctx, d->a.T, name);
  dp_problem_init(&d->pq, d->ctx, d->a.T, name); /* the same seed: the same inputs */
}

void dp_duo_init(dp_duo *d, const char *name) { dp_duo_init_env(d, name, NULL, NULL, NULL); }

void dp_duo_free(dp_duo *d) {
  dp_problem_free(&d->pq);
  dp_problem_free(&d->ps);
  forkattn_ctx_destroy(d->ctx);
  forkattn_ctx_destroy(d->sync_ctx);
}

/* Output set i of layout L: the synchronous context's all written, the other's bitwise the same. */
void dp_assert_same(dp_duo *d, int i, const dp_lay *L, const char *what) {
  size_t n1, n2;
  unsigned char *want = dp_read_outs(&d->ps, &d->ps.set[i], L, &n1), *got = dp_read_outs(&d->pq, &d->pq.set[i], L, &n2);
  dp_assert_written(want, L, L == &d->a ? "synchronous results, layout A" : "synchronous results, layout B");
  cr_assert(n1 == n2 && memcmp(want, got, n1) == 0, "set %d: %s", i, what);
  free(want);
  free(got);
}
