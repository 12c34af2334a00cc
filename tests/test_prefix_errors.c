/*
 * test_prefix_errors.c - argument checking of forkattn_prefix_fwd/bwd and the
 * context API.
 *
 * Every bad call must return FORKATTN_ERR_INVALID_ARGUMENT (a few accept
 * FORKATTN_ERR_UNSUPPORTED, noted), leave a non-empty message in
 * forkattn_ctx_last_error() that names the offending argument, and leave all
 * buffers (outputs and inputs, guards included) byte-for-byte unchanged.
 * Pointers not aligned to their elements are among the bad arguments.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <criterion/criterion.h>
#include <limits.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "forkattn_experimental.h"
#include "reference.h"
#include "test_common.h"

/* ---- fixture: a small valid problem --------------------------------------- */

#define FX_P 5
#define FX_N 2
#define FX_T 10 /* P + 3 + 2 */
#define FX_HQ 4
#define FX_HKV 2
#define FX_D 16
#define FX_DMAX 320 /* buffers are large enough for head_dim 300 */
#define FX_NBUF 9

enum { BQ, BK, BV, BO, BLSE, BDO, BDQ, BDK, BDV };
static const char *const buf_names[FX_NBUF] = {"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv"};

typedef struct fixture {
  forkattn_ctx *ctx;
  int64_t off[FX_N + 1];
  forkattn_prefix_layout lay;
  tc_buf buf[FX_NBUF];
  forkattn_tensor q, k, v, o, dout, dq, dk, dv;
  float *lse;
  float scale;
} fixture;

static fixture fx;

static forkattn_tensor view(tc_buf *b, int64_t heads) {
  return tc_buf_view(b, 0, FX_T, heads, FX_D, heads * FX_D, FX_D);
}

static void fx_setup(void) {
  memset(&fx, 0, sizeof fx);
  unsetenv("FORKATTN_BACKEND");
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  forkattn_status st = forkattn_ctx_create(&fx.ctx, &opt);
  cr_assert_eq(st, FORKATTN_OK, "forkattn_ctx_create: %s", forkattn_status_string(st));
  fx.off[0] = 0;
  fx.off[1] = 3;
  fx.off[2] = 5;
  fx.lay.prompt_len = FX_P;
  fx.lay.num_responses = FX_N;
  fx.lay.response_offsets = fx.off;
  fx.lay.mask = FORKATTN_MASK_CAUSAL;
  fx.scale = 0.25f;
  const int64_t heads[FX_NBUF] = {FX_HQ, FX_HKV, FX_HKV, FX_HQ, FX_HQ, FX_HQ, FX_HQ, FX_HKV, FX_HKV};
  for (int i = 0; i < FX_NBUF; i++) {
    size_t n = (size_t)(FX_T * heads[i] * (i == BLSE ? 1 : FX_DMAX));
    cr_assert_eq(tc_buf_alloc(&fx.buf[i], n, FORKATTN_DTYPE_F32), 0);
  }
  fx.q = view(&fx.buf[BQ], FX_HQ);
  fx.k = view(&fx.buf[BK], FX_HKV);
  fx.v = view(&fx.buf[BV], FX_HKV);
  fx.o = view(&fx.buf[BO], FX_HQ);
  fx.dout = view(&fx.buf[BDO], FX_HQ);
  fx.dq = view(&fx.buf[BDQ], FX_HQ);
  fx.dk = view(&fx.buf[BDK], FX_HKV);
  fx.dv = view(&fx.buf[BDV], FX_HKV);
  fx.lse = fx.buf[BLSE].data;
  tc_rng rng;
  tc_rng_init(&rng, 12345);
  tc_fill_tensor(&rng, &fx.q, -1, 1);
  tc_fill_tensor(&rng, &fx.k, -1, 1);
  tc_fill_tensor(&rng, &fx.v, -1, 1);
  tc_fill_tensor(&rng, &fx.dout, -1, 1);
  /* o and lse must be plausible inputs of the backward: fill them from the
   * reference so a backward that does run sees consistent data. */
  double *q = malloc(sizeof(double) * FX_T * FX_HQ * FX_D);
  double *k = malloc(sizeof(double) * FX_T * FX_HKV * FX_D);
  double *v = malloc(sizeof(double) * FX_T * FX_HKV * FX_D);
  double *o = malloc(sizeof(double) * FX_T * FX_HQ * FX_D);
  double *lse = malloc(sizeof(double) * FX_T * FX_HQ);
  cr_assert(q && k && v && o && lse);
  ref_tensor_read(&fx.q, q);
  ref_tensor_read(&fx.k, k);
  ref_tensor_read(&fx.v, v);
  ref_prefix_args a = {&fx.lay, FX_HQ, FX_HKV, FX_D, fx.scale, q, k, v, NULL};
  ref_prefix_out out = {o, lse, NULL, NULL, NULL};
  cr_assert_eq(ref_prefix(&a, &out), 0);
  ref_tensor_write(&fx.o, o);
  for (int i = 0; i < FX_T * FX_HQ; i++)
    fx.lse[i] = (float)lse[i];
  free(q);
  free(k);
  free(v);
  free(o);
  free(lse);
  /* Outputs of the backward hold a recognisable pattern. */
  tc_fill_tensor(&rng, &fx.dq, 7, 8);
  tc_fill_tensor(&rng, &fx.dk, 7, 8);
  tc_fill_tensor(&rng, &fx.dv, 7, 8);
  for (int i = 0; i < FX_NBUF; i++)
    tc_buf_snapshot(&fx.buf[i]);
}

static void fx_teardown(void) {
  for (int i = 0; i < FX_NBUF; i++)
    tc_buf_free(&fx.buf[i]);
  forkattn_ctx_destroy(fx.ctx);
}

/* ---- helpers -------------------------------------------------------------- */

/* Case-insensitive: does @p msg mention @p word? Words of one or two letters
 * ("q", "dk") must stand alone (not inside another word). */
static int mentions_word(const char *msg, const char *word) {
  const size_t n = strlen(word), m = strlen(msg);
  for (size_t i = 0; i + n <= m; i++) {
    size_t j = 0;
    while (j < n && tolower((unsigned char)msg[i + j]) == tolower((unsigned char)word[j]))
      j++;
    if (j < n)
      continue;
    if (n > 2)
      return 1;
    const int left_ok = i == 0 || !isalnum((unsigned char)msg[i - 1]);
    const int right_ok = i + n == m || !isalnum((unsigned char)msg[i + n]);
    if (left_ok && right_ok)
      return 1;
  }
  return 0;
}

/* NULL-terminated list of acceptable words. */
static int mentions_any(const char *msg, const char *const *words) {
  for (; *words; words++)
    if (mentions_word(msg, *words))
      return 1;
  return 0;
}

static void expect_untouched(const char *what) {
  for (int i = 0; i < FX_NBUF; i++) {
    size_t changed = tc_buf_changed_bytes(&fx.buf[i]);
    cr_expect_eq(changed, 0, "%s: buffer %s changed (%zu bytes) by a failing call", what,
                 buf_names[i], changed);
  }
}

#define WORDS(...) ((const char *const[]){__VA_ARGS__, NULL})

/* Status must be @p want (or @p alt when alt != FORKATTN_OK). */
static void expect_error(forkattn_status st, forkattn_status want, forkattn_status alt,
                         const char *what, const char *const *words) {
  const char *msg = forkattn_ctx_last_error(fx.ctx);
  fprintf(stderr, "  %-44s -> %d (%s): \"%s\"\n", what, (int)st, forkattn_status_string(st),
          msg ? msg : "(null)");
  cr_expect(st == want || (alt != FORKATTN_OK && st == alt),
            "%s: returned %d (%s), want %d (%s); message \"%s\"", what, (int)st,
            forkattn_status_string(st), (int)want, forkattn_status_string(want),
            msg ? msg : "(null)");
  cr_expect(msg != NULL && msg[0] != '\0', "%s: empty error message", what);
  if (msg && words && msg[0])
    cr_expect(mentions_any(msg, words), "%s: message \"%s\" does not name the argument (%s...)",
              what, msg, words[0]);
  expect_untouched(what);
}

static forkattn_status fwd(const forkattn_prefix_layout *lay, const forkattn_tensor *q,
                           const forkattn_tensor *k, const forkattn_tensor *v,
                           const forkattn_tensor *o, float *lse, float scale,
                           forkattn_memory mem) {
  return forkattn_prefix_fwd(fx.ctx, lay, q, k, v, o, lse, scale, mem);
}

/* Forward with one tensor replaced. */
typedef enum { T_Q, T_K, T_V, T_O } which_t;

static forkattn_status fwd_with(which_t w, const forkattn_tensor *t) {
  return fwd(&fx.lay, w == T_Q ? t : &fx.q, w == T_K ? t : &fx.k, w == T_V ? t : &fx.v,
             w == T_O ? t : &fx.o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
}

static forkattn_status fwd_layout(const forkattn_prefix_layout *lay) {
  return fwd(lay, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
}

static forkattn_status bwd(const forkattn_tensor *dout, const float *lse,
                           const forkattn_tensor *dq, const forkattn_tensor *dk,
                           const forkattn_tensor *dv) {
  return forkattn_prefix_bwd(fx.ctx, &fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, dout, lse, dq, dk, dv,
                             fx.scale, FORKATTN_MEMORY_HOST);
}

#define INVALID FORKATTN_ERR_INVALID_ARGUMENT
#define NO_ALT FORKATTN_OK

TestSuite(args, .init = fx_setup, .fini = fx_teardown, .timeout = 60.0);

/* ---- positive controls (the fixture itself is valid) ---------------------- */

Test(args, valid_call_succeeds) {
  /* Forward into scratch outputs (the fixture's must stay as they are). */
  tc_buf bo, bl;
  forkattn_tensor o = tc_buf_contiguous(&bo, FORKATTN_DTYPE_F32, FX_T, FX_HQ, FX_D);
  float *lse = tc_buf_f32(&bl, FX_T * FX_HQ);
  forkattn_status st =
      fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &o, lse, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_OK, "valid forward failed: %s: %s", forkattn_status_string(st),
               forkattn_ctx_last_error(fx.ctx));
  st = fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &o, NULL, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_OK, "forward without lse failed: %s: %s", forkattn_status_string(st),
               forkattn_ctx_last_error(fx.ctx));
  tc_buf_free(&bo);
  tc_buf_free(&bl);
  st = bwd(&fx.dout, fx.lse, &fx.dq, &fx.dk, &fx.dv);
  cr_expect_eq(st, FORKATTN_OK, "valid backward failed: %s: %s", forkattn_status_string(st),
               forkattn_ctx_last_error(fx.ctx));
}

Test(args, accepts_head_major_layout) {
  /* row_stride < heads * head_dim is allowed when rows do not overlap. */
  tc_buf b;
  cr_assert_eq(tc_buf_alloc(&b, (size_t)(FX_T * FX_HQ * FX_D), FORKATTN_DTYPE_F32), 0);
  forkattn_tensor o = tc_buf_view(&b, 0, FX_T, FX_HQ, FX_D, FX_D, FX_T * FX_D);
  forkattn_status st =
      fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &o, NULL, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_OK, "head-major o refused: %s: %s", forkattn_status_string(st),
               forkattn_ctx_last_error(fx.ctx));
  tc_buf_free(&b);
}

/* ---- NULL arguments ------------------------------------------------------- */

Test(args, null_ctx) {
  forkattn_status st = forkattn_prefix_fwd(NULL, &fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse,
                                           fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, INVALID, "fwd(NULL ctx) returned %d", (int)st);
  st = forkattn_prefix_bwd(NULL, &fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, &fx.dout, fx.lse, &fx.dq,
                           &fx.dk, &fx.dv, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, INVALID, "bwd(NULL ctx) returned %d", (int)st);
  expect_untouched("NULL ctx");
}

Test(args, null_layout) {
  expect_error(fwd_layout(NULL), INVALID, NO_ALT, "fwd: NULL layout", WORDS("layout"));
  forkattn_status st = forkattn_prefix_bwd(fx.ctx, NULL, &fx.q, &fx.k, &fx.v, &fx.o, &fx.dout,
                                           fx.lse, &fx.dq, &fx.dk, &fx.dv, fx.scale,
                                           FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "bwd: NULL layout", WORDS("layout"));
}

Test(args, null_tensors) {
  expect_error(fwd_with(T_Q, NULL), INVALID, NO_ALT, "fwd: q = NULL", WORDS("q", "query"));
  expect_error(fwd_with(T_K, NULL), INVALID, NO_ALT, "fwd: k = NULL", WORDS("k", "key"));
  expect_error(fwd_with(T_V, NULL), INVALID, NO_ALT, "fwd: v = NULL", WORDS("v", "value"));
  expect_error(fwd_with(T_O, NULL), INVALID, NO_ALT, "fwd: o = NULL", WORDS("o", "out"));
}

Test(args, null_data) {
  const which_t ws[4] = {T_Q, T_K, T_V, T_O};
  const forkattn_tensor *ts[4] = {&fx.q, &fx.k, &fx.v, &fx.o};
  const char *const *words[4] = {WORDS("q", "query"), WORDS("k", "key"), WORDS("v", "value"),
                                 WORDS("o", "out")};
  for (int i = 0; i < 4; i++) {
    forkattn_tensor t = *ts[i];
    t.data = NULL;
    char what[64];
    snprintf(what, sizeof what, "fwd: %s.data = NULL", buf_names[i]);
    expect_error(fwd_with(ws[i], &t), INVALID, NO_ALT, what, words[i]);
  }
}

Test(args, bwd_null_arguments) {
  expect_error(bwd(&fx.dout, NULL, &fx.dq, &fx.dk, &fx.dv), INVALID, NO_ALT, "bwd: lse = NULL",
               WORDS("lse"));
  expect_error(bwd(NULL, fx.lse, &fx.dq, &fx.dk, &fx.dv), INVALID, NO_ALT, "bwd: dout = NULL",
               WORDS("dout", "do", "grad"));
  expect_error(bwd(&fx.dout, fx.lse, NULL, &fx.dk, &fx.dv), INVALID, NO_ALT, "bwd: dq = NULL",
               WORDS("dq"));
  expect_error(bwd(&fx.dout, fx.lse, &fx.dq, NULL, &fx.dv), INVALID, NO_ALT, "bwd: dk = NULL",
               WORDS("dk"));
  expect_error(bwd(&fx.dout, fx.lse, &fx.dq, &fx.dk, NULL), INVALID, NO_ALT, "bwd: dv = NULL",
               WORDS("dv"));
  forkattn_tensor t = fx.dk;
  t.data = NULL;
  expect_error(bwd(&fx.dout, fx.lse, &fx.dq, &t, &fx.dv), INVALID, NO_ALT, "bwd: dk.data = NULL",
               WORDS("dk"));
  t = fx.dout;
  t.data = NULL;
  expect_error(bwd(&t, fx.lse, &fx.dq, &fx.dk, &fx.dv), INVALID, NO_ALT, "bwd: dout.data = NULL",
               WORDS("dout", "do", "grad"));
  /* o is an input of the backward. */
  forkattn_status st = forkattn_prefix_bwd(fx.ctx, &fx.lay, &fx.q, &fx.k, &fx.v, NULL, &fx.dout,
                                           fx.lse, &fx.dq, &fx.dk, &fx.dv, fx.scale,
                                           FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "bwd: o = NULL", WORDS("o", "out"));
}

/* ---- sizes ---------------------------------------------------------------- */

Test(args, negative_sizes) {
  forkattn_prefix_layout lay = fx.lay;
  lay.prompt_len = -1;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "prompt_len = -1", WORDS("prompt"));
  lay = fx.lay;
  lay.num_responses = -1;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "num_responses = -1", WORDS("response"));
  forkattn_tensor t = fx.q;
  t.rows = -1;
  expect_error(fwd_with(T_Q, &t), INVALID, NO_ALT, "q.rows = -1", WORDS("rows", "q"));
  t = fx.k;
  t.heads = -2;
  expect_error(fwd_with(T_K, &t), INVALID, NO_ALT, "k.heads = -2", WORDS("heads", "k"));
  t = fx.v;
  t.head_dim = -16;
  expect_error(fwd_with(T_V, &t), INVALID, NO_ALT, "v.head_dim = -16",
               WORDS("head_dim", "dim", "v"));
}

Test(args, size_overflow) {
  /* rows * row_stride overflows int64 (2^61 rows of 64 elements). */
  const int64_t huge = (int64_t)1 << 61;
  forkattn_prefix_layout lay = {huge, 0, NULL, FORKATTN_MASK_CAUSAL};
  forkattn_tensor q = fx.q, k = fx.k, v = fx.v, o = fx.o;
  q.rows = k.rows = v.rows = o.rows = huge;
  forkattn_status st = fwd(&lay, &q, &k, &v, &o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "rows = 2^61 (extent overflows)",
               WORDS("overflow", "rows", "stride", "size", "large", "extent"));
  /* a stride whose product with the row count overflows */
  q = fx.q;
  q.row_stride = INT64_MAX / 4;
  expect_error(fwd_with(T_Q, &q), INVALID, NO_ALT, "q.row_stride = INT64_MAX/4",
               WORDS("overflow", "stride", "size", "large", "extent", "q"));
  q = fx.q;
  q.head_stride = INT64_MAX / 2; /* (heads - 1) * head_stride = 3 * 2^62 */
  expect_error(fwd_with(T_Q, &q), INVALID, NO_ALT, "q.head_stride = INT64_MAX/2",
               WORDS("overflow", "stride", "size", "large", "extent", "q"));
  /* prompt_len + offsets[N] overflows */
  const int64_t off[2] = {0, INT64_MAX - 2};
  forkattn_prefix_layout lay2 = {16, 1, off, FORKATTN_MASK_CAUSAL};
  expect_error(fwd_layout(&lay2), INVALID, NO_ALT, "prompt_len + offsets[N] overflows",
               WORDS("overflow", "rows", "offset", "prompt", "large"));
}

/* An absurd GQA group (2^62 query heads on one KV head, one row, head_dim 1:
 * the descriptors' extents fit int64) makes the CPU kernels' tile sizes
 * (group x query block x ...) overflow int64. The call must be refused with a
 * status before any byte of the tensors is read: they lie on inaccessible
 * pages, so a read crashes the test. */
Test(sizes, absurd_gqa_group_is_refused_before_any_read, .timeout = 30) {
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = 1;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK);
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  char *none = mmap(NULL, 12 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  cr_assert(none != MAP_FAILED);
  const int64_t hq = (int64_t)1 << 62;
  const forkattn_dtype F = FORKATTN_DTYPE_F32;
  forkattn_tensor q = forkattn_tensor_contiguous(none, F, 1, hq, 1), o = forkattn_tensor_contiguous(none + page, F, 1, hq, 1);
  forkattn_tensor k = forkattn_tensor_contiguous(none + 2 * page, F, 1, 1, 1);
  forkattn_tensor v = forkattn_tensor_contiguous(none + 3 * page, F, 1, 1, 1);
  forkattn_tensor dout = forkattn_tensor_contiguous(none + 4 * page, F, 1, hq, 1);
  forkattn_tensor dq = forkattn_tensor_contiguous(none + 5 * page, F, 1, hq, 1);
  forkattn_tensor dk = forkattn_tensor_contiguous(none + 6 * page, F, 1, 1, 1);
  forkattn_tensor dv = forkattn_tensor_contiguous(none + 7 * page, F, 1, 1, 1);
  float *lse = (float *)(void *)(none + 8 * page);
  forkattn_prefix_layout lay = {1, 0, NULL, FORKATTN_MASK_CAUSAL};
  forkattn_status st = forkattn_prefix_fwd(ctx, &lay, &q, &k, &v, &o, lse, 1.0f, FORKATTN_MEMORY_HOST);
  cr_expect(st == FORKATTN_ERR_OUT_OF_MEMORY || st == FORKATTN_ERR_INVALID_ARGUMENT, "fwd: %s",
            forkattn_status_string(st));
  cr_expect(forkattn_ctx_last_error(ctx)[0], "fwd refused without a message");
  st = forkattn_prefix_bwd(ctx, &lay, &q, &k, &v, &o, &dout, lse, &dq, &dk, &dv, 1.0f, FORKATTN_MEMORY_HOST);
  cr_expect(st == FORKATTN_ERR_OUT_OF_MEMORY || st == FORKATTN_ERR_INVALID_ARGUMENT, "bwd: %s",
            forkattn_status_string(st));
  cr_expect(forkattn_ctx_last_error(ctx)[0], "bwd refused without a message");
  munmap(none, 12 * page);
  forkattn_ctx_destroy(ctx);
}

Test(args, bad_offsets) {
  forkattn_prefix_layout lay = fx.lay;
  const int64_t decreasing[3] = {0, 4, 3};
  lay.response_offsets = decreasing;
  lay.prompt_len = FX_T - 3;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "offsets not monotonic", WORDS("offset"));
  const int64_t nonzero[3] = {1, 3, 5};
  lay.response_offsets = nonzero;
  lay.prompt_len = FX_P;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "offsets[0] = 1", WORDS("offset"));
  const int64_t negative[3] = {0, -2, 5};
  lay.response_offsets = negative;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "offsets with a negative entry",
               WORDS("offset"));
  lay.response_offsets = NULL;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "offsets = NULL with N = 2", WORDS("offset"));
}

Test(args, rows_mismatch) {
  forkattn_prefix_layout lay = fx.lay;
  lay.prompt_len = FX_P + 1; /* P + offsets[N] = T + 1 */
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "layout rows = T + 1",
               WORDS("rows", "row", "prompt", "offset"));
  forkattn_tensor t = fx.q;
  t.rows = FX_T - 1;
  expect_error(fwd_with(T_Q, &t), INVALID, NO_ALT, "q.rows = T - 1", WORDS("rows", "q"));
  t = fx.v;
  t.rows = FX_T - 1;
  expect_error(fwd_with(T_V, &t), INVALID, NO_ALT, "v.rows = T - 1", WORDS("rows", "v"));
  t = fx.o;
  t.rows = FX_T - 1;
  expect_error(fwd_with(T_O, &t), INVALID, NO_ALT, "o.rows = T - 1", WORDS("rows", "o"));
  t = fx.dk;
  t.rows = FX_T - 1;
  expect_error(bwd(&fx.dout, fx.lse, &fx.dq, &t, &fx.dv), INVALID, NO_ALT, "bwd: dk.rows = T - 1",
               WORDS("rows", "dk"));
}

Test(args, heads) {
  forkattn_tensor k = fx.k, v = fx.v;
  k.heads = v.heads = 3; /* 4 % 3 != 0 */
  k.row_stride = v.row_stride = 3 * FX_D;
  forkattn_status st =
      fwd(&fx.lay, &fx.q, &k, &v, &fx.o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "Hq % Hkv != 0 (4 / 3)", WORDS("head"));
  v = fx.v;
  v.heads = 1;
  v.row_stride = FX_D;
  expect_error(fwd_with(T_V, &v), INVALID, NO_ALT, "k.heads != v.heads", WORDS("head"));
  forkattn_tensor o = fx.o;
  o.heads = 2;
  o.row_stride = 2 * FX_D;
  expect_error(fwd_with(T_O, &o), INVALID, NO_ALT, "o.heads != q.heads", WORDS("head"));
  forkattn_tensor dk = fx.dk;
  dk.heads = 1;
  dk.row_stride = FX_D;
  expect_error(bwd(&fx.dout, fx.lse, &fx.dq, &dk, &fx.dv), INVALID, NO_ALT,
               "bwd: dk.heads != k.heads", WORDS("head", "dk"));
  forkattn_tensor q = fx.q;
  q.heads = 0;
  expect_error(fwd_with(T_Q, &q), INVALID, NO_ALT, "q.heads = 0", WORDS("head", "q"));
}

Test(args, head_dim) {
  forkattn_tensor q = fx.q, k = fx.k, v = fx.v, o = fx.o;
  q.head_dim = k.head_dim = v.head_dim = o.head_dim = 0;
  forkattn_status st = fwd(&fx.lay, &q, &k, &v, &o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "head_dim = 0", WORDS("head_dim", "dim"));
  /* 300 > 256: invalid or unsupported; buffers are large enough either way. */
  q.head_dim = k.head_dim = v.head_dim = o.head_dim = 300;
  q.head_stride = k.head_stride = v.head_stride = o.head_stride = 300;
  q.row_stride = o.row_stride = FX_HQ * 300;
  k.row_stride = v.row_stride = FX_HKV * 300;
  st = fwd(&fx.lay, &q, &k, &v, &o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, FORKATTN_ERR_UNSUPPORTED, "head_dim = 300", WORDS("head_dim", "dim"));
  k = fx.k;
  k.head_dim = FX_D / 2;
  expect_error(fwd_with(T_K, &k), INVALID, NO_ALT, "k.head_dim != q.head_dim",
               WORDS("head_dim", "dim"));
}

/* ---- dtypes --------------------------------------------------------------- */

Test(args, dtypes) {
  forkattn_tensor k = fx.k;
  k.dtype = FORKATTN_DTYPE_BF16;
  expect_error(fwd_with(T_K, &k), INVALID, NO_ALT, "k bf16, q f32", WORDS("dtype", "type"));
  forkattn_tensor o = fx.o;
  o.dtype = FORKATTN_DTYPE_F16;
  expect_error(fwd_with(T_O, &o), INVALID, NO_ALT, "o f16, q f32", WORDS("dtype", "type"));
  forkattn_tensor q = fx.q;
  q.dtype = (forkattn_dtype)7;
  expect_error(fwd_with(T_Q, &q), INVALID, NO_ALT, "q.dtype = 7", WORDS("dtype", "type"));
  forkattn_tensor dq = fx.dq;
  dq.dtype = FORKATTN_DTYPE_BF16;
  expect_error(bwd(&fx.dout, fx.lse, &dq, &fx.dk, &fx.dv), INVALID, NO_ALT, "bwd: dq bf16",
               WORDS("dtype", "type"));
}

/* ---- strides -------------------------------------------------------------- */

Test(args, overlapping_strides) {
  const char *const *w = WORDS("stride", "overlap");
  forkattn_tensor q = fx.q;
  q.row_stride = FX_HQ * FX_D - 1;
  expect_error(fwd_with(T_Q, &q), INVALID, NO_ALT, "q.row_stride = Hq*d - 1 (rows overlap)", w);
  q = fx.q;
  q.head_stride = FX_D - 1;
  q.row_stride = FX_HQ * FX_D;
  expect_error(fwd_with(T_Q, &q), INVALID, NO_ALT, "q.head_stride = d - 1 (heads overlap)", w);
  forkattn_tensor o = fx.o;
  o.row_stride = FX_D; /* head-major strides that overlap: head h row r == head h+1 row r-1 */
  o.head_stride = FX_D;
  expect_error(fwd_with(T_O, &o), INVALID, NO_ALT, "o: row_stride = head_stride = d", w);
  forkattn_tensor k = fx.k;
  k.row_stride = 0;
  expect_error(fwd_with(T_K, &k), INVALID, NO_ALT, "k.row_stride = 0", w);
  k = fx.k;
  k.row_stride = -FX_HKV * FX_D;
  expect_error(fwd_with(T_K, &k), INVALID, NO_ALT, "k.row_stride < 0", w);
  forkattn_tensor v = fx.v;
  v.head_stride = 0;
  expect_error(fwd_with(T_V, &v), INVALID, NO_ALT, "v.head_stride = 0", w);
  forkattn_tensor dv = fx.dv;
  dv.row_stride = FX_D;
  expect_error(bwd(&fx.dout, fx.lse, &fx.dq, &fx.dk, &dv), INVALID, NO_ALT,
               "bwd: dv.row_stride = d (rows overlap)", w);
}

/* ---- scalars and enums ---------------------------------------------------- */

Test(args, scale) {
  const float bad[5] = {0.0f, -0.125f, NAN, INFINITY, -INFINITY};
  const char *names[5] = {"scale = 0", "scale < 0", "scale = NaN", "scale = inf", "scale = -inf"};
  for (int i = 0; i < 5; i++) {
    forkattn_status st =
        fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, bad[i], FORKATTN_MEMORY_HOST);
    expect_error(st, INVALID, NO_ALT, names[i], WORDS("scale"));
  }
  forkattn_status st = forkattn_prefix_bwd(fx.ctx, &fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, &fx.dout,
                                           fx.lse, &fx.dq, &fx.dk, &fx.dv, NAN,
                                           FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "bwd: scale = NaN", WORDS("scale"));
}

Test(args, mask_enum) {
  forkattn_prefix_layout lay = fx.lay;
  lay.mask = (forkattn_mask)5;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "mask = 5", WORDS("mask"));
  lay.mask = (forkattn_mask)-1;
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "mask = -1", WORDS("mask"));
}

Test(args, memory_enum) {
  forkattn_status st = fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale,
                           (forkattn_memory)7);
  expect_error(st, INVALID, NO_ALT, "memory = 7", WORDS("memory"));
}

Test(args, device_memory_on_cpu_context) {
  forkattn_ctx_destroy(fx.ctx);
  fx.ctx = NULL;
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  cr_assert_eq(forkattn_ctx_create(&fx.ctx, &opt), FORKATTN_OK);
  cr_assert_eq(forkattn_ctx_backend(fx.ctx), FORKATTN_BACKEND_CPU);
  /* The host pointers must not be dereferenced as device pointers (or vice
   * versa): an argument error, or "unsupported" on this backend. */
  forkattn_status st = fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale,
                           FORKATTN_MEMORY_DEVICE);
  expect_error(st, INVALID, FORKATTN_ERR_UNSUPPORTED, "fwd: memory = DEVICE on a CPU context",
               WORDS("memory", "device", "gpu", "backend", "host", "cpu"));
  st = forkattn_prefix_bwd(fx.ctx, &fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, &fx.dout, fx.lse, &fx.dq,
                           &fx.dk, &fx.dv, fx.scale, FORKATTN_MEMORY_DEVICE);
  expect_error(st, INVALID, FORKATTN_ERR_UNSUPPORTED, "bwd: memory = DEVICE on a CPU context",
               WORDS("memory", "device", "gpu", "backend", "host", "cpu"));
}

Test(args, error_then_success) {
  /* A failing call does not poison the context: the next valid call works. */
  forkattn_prefix_layout lay = fx.lay;
  lay.mask = (forkattn_mask)9;
  cr_expect_eq(fwd_layout(&lay), INVALID);
  cr_expect_neq(forkattn_ctx_last_error(fx.ctx)[0], '\0');
  tc_buf bo;
  forkattn_tensor o = tc_buf_contiguous(&bo, FORKATTN_DTYPE_F32, FX_T, FX_HQ, FX_D);
  forkattn_status st =
      fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &o, NULL, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_OK, "%s: %s", forkattn_status_string(st),
               forkattn_ctx_last_error(fx.ctx));
  tc_buf_free(&bo);
}

/* ---- alignment ------------------------------------------------------------ */

/* A tensor @p bytes past the start of @p t's data: same shape and strides. */
static forkattn_tensor shifted(const forkattn_tensor *t, size_t bytes) {
  forkattn_tensor s = *t;
  s.data = (unsigned char *)t->data + bytes;
  return s;
}

Test(args, misaligned_tensors) {
  /* Data must be a multiple of the element size (4 bytes for f32): 2 bytes off
   * is refused before anything is read or written, naming the tensor. */
  const which_t ws[4] = {T_Q, T_K, T_V, T_O};
  const forkattn_tensor *ts[4] = {&fx.q, &fx.k, &fx.v, &fx.o};
  for (int i = 0; i < 4; i++)
    for (size_t off = 1; off < 4; off++) {
      forkattn_tensor t = shifted(ts[i], off);
      char what[64];
      snprintf(what, sizeof what, "fwd: %s.data %zu bytes off", buf_names[i], off);
      expect_error(fwd_with(ws[i], &t), INVALID, NO_ALT, what, WORDS(buf_names[i]));
    }
  const forkattn_tensor *bt[4] = {&fx.dout, &fx.dq, &fx.dk, &fx.dv};
  const char *bn[4] = {"dout", "dq", "dk", "dv"};
  for (int i = 0; i < 4; i++) {
    forkattn_tensor t[4] = {fx.dout, fx.dq, fx.dk, fx.dv};
    t[i] = shifted(bt[i], 2);
    char what[64];
    snprintf(what, sizeof what, "bwd: %s.data 2 bytes off", bn[i]);
    expect_error(bwd(&t[0], fx.lse, &t[1], &t[2], &t[3]), INVALID, NO_ALT, what, WORDS(bn[i]));
  }
  forkattn_tensor o = shifted(&fx.o, 2);
  forkattn_status st = forkattn_prefix_bwd(fx.ctx, &fx.lay, &fx.q, &fx.k, &fx.v, &o, &fx.dout, fx.lse, &fx.dq,
                                           &fx.dk, &fx.dv, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "bwd: o.data 2 bytes off", WORDS("o"));
}

Test(args, misaligned_half_tensors) {
  /* bf16/f16 elements are 2 bytes: 1 byte off is refused, 2 bytes off is fine. */
  const forkattn_dtype dts[2] = {FORKATTN_DTYPE_BF16, FORKATTN_DTYPE_F16};
  for (int j = 0; j < 2; j++) {
    forkattn_tensor q = fx.q, k = fx.k, v = fx.v, o = fx.o;
    q.dtype = k.dtype = v.dtype = o.dtype = dts[j];
    forkattn_tensor bad = shifted(&k, 1);
    forkattn_status st = forkattn_prefix_fwd(fx.ctx, &fx.lay, &q, &bad, &v, &o, fx.lse, fx.scale,
                                             FORKATTN_MEMORY_HOST);
    expect_error(st, INVALID, NO_ALT, j ? "fwd f16: k.data 1 byte off" : "fwd bf16: k.data 1 byte off",
                 WORDS("k"));
  }
  /* positive control into scratch outputs: f16 views 2 bytes into their buffers */
  tc_buf bo;
  forkattn_tensor o = tc_buf_contiguous(&bo, FORKATTN_DTYPE_F16, FX_T + 1, FX_HQ, FX_D);
  o.rows = FX_T;
  o = shifted(&o, 2);
  forkattn_tensor q = shifted(&fx.q, 2), k = shifted(&fx.k, 2), v = shifted(&fx.v, 2);
  q.dtype = k.dtype = v.dtype = FORKATTN_DTYPE_F16;
  forkattn_status st = forkattn_prefix_fwd(fx.ctx, &fx.lay, &q, &k, &v, &o, NULL, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_OK, "f16 tensors 2 bytes into their buffers refused: %s",
               forkattn_ctx_last_error(fx.ctx));
  tc_buf_free(&bo);
}

Test(args, element_aligned_f32_accepted) {
  /* Only element alignment is required: f32 data 4 bytes past a 16-byte boundary works. */
  tc_buf bo, bl;
  forkattn_tensor o = tc_buf_contiguous(&bo, FORKATTN_DTYPE_F32, FX_T + 1, FX_HQ, FX_D);
  o.rows = FX_T;
  o = shifted(&o, 4);
  float *lse = tc_buf_f32(&bl, FX_T * FX_HQ + 1) + 1;
  forkattn_tensor q = shifted(&fx.q, 4), k = shifted(&fx.k, 4), v = shifted(&fx.v, 4);
  forkattn_status st = fwd(&fx.lay, &q, &k, &v, &o, lse, fx.scale, FORKATTN_MEMORY_HOST);
  cr_expect_eq(st, FORKATTN_OK, "f32 tensors 4 bytes into their buffers refused: %s", forkattn_ctx_last_error(fx.ctx));
  tc_buf_free(&bo);
  tc_buf_free(&bl);
}

Test(args, misaligned_arrays) {
  /* lse (float) and the layout's int64 offsets must be aligned to their elements too. */
  float *lse = (float *)((unsigned char *)fx.lse + 2);
  expect_error(fwd(&fx.lay, &fx.q, &fx.k, &fx.v, &fx.o, lse, fx.scale, FORKATTN_MEMORY_HOST), INVALID, NO_ALT,
               "fwd: lse 2 bytes off", WORDS("lse"));
  expect_error(bwd(&fx.dout, lse, &fx.dq, &fx.dk, &fx.dv), INVALID, NO_ALT, "bwd: lse 2 bytes off", WORDS("lse"));
  _Alignas(8) unsigned char raw[sizeof fx.off + 8];
  memcpy(raw + 4, fx.off, sizeof fx.off);
  forkattn_prefix_layout lay = fx.lay;
  lay.response_offsets = (const int64_t *)(void *)(raw + 4);
  expect_error(fwd_layout(&lay), INVALID, NO_ALT, "fwd: response_offsets 4 bytes off", WORDS("response_offsets"));
  /* tree layout and kept set arrays: one node holding every row */
  _Alignas(8) unsigned char node[3 * sizeof(int64_t) + 8];
  const int64_t tree_off[2] = {0, FX_T}, tree_par[1] = {-1};
  forkattn_tree_layout tree = {1, tree_off, tree_par};
  memcpy(node + 4, tree_off, sizeof tree_off);
  tree.node_offsets = (const int64_t *)(void *)(node + 4);
  forkattn_status st = forkattn_tree_fwd(fx.ctx, &tree, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale,
                                         FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "tree_fwd: node_offsets 4 bytes off", WORDS("node_offsets"));
  tree.node_offsets = tree_off;
  memcpy(node + 4, tree_par, sizeof tree_par);
  tree.parents = (const int64_t *)(void *)(node + 4);
  st = forkattn_tree_fwd(fx.ctx, &tree, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "tree_fwd: parents 4 bytes off", WORDS("parents"));
  const int64_t koff[2] = {0, 1}, kidx[1] = {0};
  memcpy(node + 4, koff, sizeof koff);
  forkattn_kept_set kept = {1, FX_T, 0, (const int64_t *)(void *)(node + 4), kidx, NULL};
  forkattn_layout any = {&fx.lay, NULL};
  st = forkattn_kept_fwd(fx.ctx, &any, &kept, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "kept_fwd: offsets 4 bytes off", WORDS("offsets"));
  kept.offsets = koff;
  memcpy(node + 4, kidx, sizeof kidx);
  kept.index = (const int64_t *)(void *)(node + 4);
  st = forkattn_kept_fwd(fx.ctx, &any, &kept, &fx.q, &fx.k, &fx.v, &fx.o, fx.lse, fx.scale, FORKATTN_MEMORY_HOST);
  expect_error(st, INVALID, NO_ALT, "kept_fwd: index 4 bytes off", WORDS("index"));
}

/* A byte buffer whose bytes all hold one pattern; unchanged() says whether they still do. */
#define RAW_BYTES 512
typedef struct {
  _Alignas(16) unsigned char b[RAW_BYTES];
} raw_buf;
static void raw_fill(raw_buf *r) { memset(r->b, 0x5a, sizeof r->b); }
static int raw_unchanged(const raw_buf *r) {
  for (size_t i = 0; i < sizeof r->b; i++)
    if (r->b[i] != 0x5a) return 0;
  return 1;
}

/* The other entry points: each typed output or input array a few bytes off its
 * element alignment is refused, naming it, and nothing is written. */
static void expect_refused(forkattn_status st, const char *what, const char *word, const raw_buf *r) {
  const char *msg = forkattn_ctx_last_error(fx.ctx);
  fprintf(stderr, "  %-44s -> %d (%s): \"%s\"\n", what, (int)st, forkattn_status_string(st), msg);
  cr_expect_eq(st, INVALID, "%s: returned %s; message \"%s\"", what, forkattn_status_string(st), msg);
  cr_expect(mentions_word(msg, word) && strstr(msg, "aligned"), "%s: message \"%s\" does not name %s", what, msg,
            word);
  cr_expect(raw_unchanged(r), "%s: the misaligned array was written", what);
  expect_untouched(what);
}

Test(args, misaligned_arrays_other_apis) {
  raw_buf r, r2;
  raw_fill(&r);
  raw_fill(&r2);
  forkattn_layout any = {&fx.lay, NULL};
  float *f_off = (float *)(void *)(r.b + 2), *f_ok = (float *)(void *)r2.b;
  /* StreamKL forward: kl, stats, outside_mass (r2 is large enough for the aligned ones: T*H = 40 floats) */
  expect_refused(forkattn_kl_fwd(fx.ctx, &any, &fx.q, &fx.k, &fx.q, &fx.k, NULL, NULL, f_off, NULL, NULL,
                                 FORKATTN_MEMORY_HOST), "kl_fwd: kl 2 bytes off", "kl", &r);
  expect_refused(forkattn_kl_fwd(fx.ctx, &any, &fx.q, &fx.k, &fx.q, &fx.k, NULL, NULL, f_ok, NULL, f_off,
                                 FORKATTN_MEMORY_HOST), "kl_fwd: outside_mass 2 bytes off", "outside_mass", &r);
  raw_fill(&r2);
  /* rows_mean: x (input) and mean (double output) */
  double mean = 0;
  expect_refused(forkattn_rows_mean(fx.ctx, f_off, 4, 2, NULL, &mean, FORKATTN_MEMORY_HOST), "rows_mean: x 2 bytes off",
                 "x", &r);
  expect_refused(forkattn_rows_mean(fx.ctx, fx.lse, 4, 2, NULL, (double *)(void *)(r.b + 4), FORKATTN_MEMORY_HOST),
                 "rows_mean: mean 4 bytes off", "mean", &r);
  /* KV selection: int64 offsets and index outputs */
  forkattn_kv_policy pol;
  forkattn_kv_policy_init(&pol, FORKATTN_KV_STREAMING_LLM, 4);
  int64_t *i_off = (int64_t *)(void *)(r.b + 4), *i_ok = (int64_t *)(void *)r2.b;
  expect_refused(forkattn_kv_select(fx.ctx, &pol, &fx.q, &fx.k, i_off, i_ok + 8, FORKATTN_MEMORY_HOST),
                 "kv_select: offsets 4 bytes off", "offsets", &r);
  expect_refused(forkattn_kv_select(fx.ctx, &pol, &fx.q, &fx.k, i_ok, i_off, FORKATTN_MEMORY_HOST),
                 "kv_select: index 4 bytes off", "index", &r);
  raw_fill(&r2);
  /* K/V similarity: sim output */
  expect_refused(forkattn_kv_similarity(fx.ctx, &fx.k, &fx.k, f_off, NULL, FORKATTN_MEMORY_HOST),
                 "kv_similarity: sim 2 bytes off", "sim", &r);
  /* reuse profile: sim input, depth output */
  forkattn_reuse_profile *prof = NULL;
  cr_assert_eq(forkattn_reuse_profile_create(fx.ctx, 2, 0.95f, &prof), FORKATTN_OK);
  expect_refused(forkattn_reuse_profile_add(fx.ctx, prof, 0.5, f_off), "reuse_profile_add: sim 2 bytes off", "sim", &r);
  expect_refused(forkattn_reuse_profile_depth(fx.ctx, prof, 0.5, i_off), "reuse_profile_depth: depth 4 bytes off",
                 "depth", &r);
  forkattn_reuse_profile_free(prof);
  /* tree cost: seconds output */
  const int64_t tree_off[2] = {0, FX_T}, tree_par[1] = {-1};
  const forkattn_tree_layout tree = {1, tree_off, tree_par};
  const forkattn_tree_cost_model model = {FX_HQ, FX_D, 1e-10, 1e-8, 1e-6};
  expect_refused(forkattn_tree_cost(fx.ctx, &tree, &model, (double *)(void *)(r.b + 4)),
                 "tree_cost: seconds 4 bytes off", "seconds", &r);
  /* KV cache: int32 tokens on insert */
  forkattn_kv_cache_options co;
  forkattn_kv_cache_options_init(&co);
  co.capacity_bytes = 1 << 20;
  co.layers = 1;
  co.kv_heads = FX_HKV;
  co.head_dim = FX_D;
  forkattn_kv_cache *cache = NULL;
  cr_assert_eq(forkattn_kv_cache_create(fx.ctx, &co, &cache), FORKATTN_OK, "%s", forkattn_ctx_last_error(fx.ctx));
  memset(r.b, 0, 64);
  const int32_t *t_off = (const int32_t *)(void *)(r.b + 2);
  raw_buf snap = r;
  expect_error(forkattn_kv_cache_insert(cache, t_off, FX_T, &fx.k, &fx.v, FORKATTN_MEMORY_HOST, NULL), INVALID,
               NO_ALT, "kv_cache_insert: tokens 2 bytes off", WORDS("tokens"));
  cr_expect(memcmp(snap.b, r.b, sizeof r.b) == 0, "kv_cache_insert changed the tokens");
  /* and on lookup: tokens, and the int64 matched output */
  forkattn_kv_entry *entry = NULL;
  int64_t matched = 0;
  expect_error(forkattn_kv_cache_lookup(cache, t_off, FX_T, &entry, &matched), INVALID, NO_ALT,
               "kv_cache_lookup: tokens 2 bytes off", WORDS("tokens"));
  const int32_t *t_ok = (const int32_t *)(void *)r.b;
  expect_error(forkattn_kv_cache_lookup(cache, t_ok, FX_T, &entry, (int64_t *)(void *)(r2.b + 4)), INVALID, NO_ALT,
               "kv_cache_lookup: matched 4 bytes off", WORDS("matched"));
  cr_expect(entry == NULL && raw_unchanged(&r2), "kv_cache_lookup wrote its outputs on error");
  forkattn_kv_cache_destroy(cache);
}

/* lse of the entries without a layout argument (path stack, cached prefix: checked where every
 * attention call is dispatched) and the trie builders' int64 arrays. */
Test(args, misaligned_lse_of_path_and_cached_prefix_and_trie_arrays) {
  raw_buf r;
  raw_fill(&r);
  float *f_off = (float *)(void *)(r.b + 2);
  forkattn_path *path = NULL;
  cr_assert_eq(forkattn_path_create(fx.ctx, FORKATTN_DTYPE_F32, FX_HQ, FX_HKV, FX_D, &path), FORKATTN_OK);
  cr_assert_eq(forkattn_path_push(path, &fx.k, &fx.v), FORKATTN_OK, "%s", forkattn_ctx_last_error(fx.ctx));
  expect_refused(forkattn_path_attend_fwd(path, &fx.q, &fx.o, f_off, fx.scale), "path_attend_fwd: lse 2 bytes off",
                 "lse", &r);
  expect_refused(forkattn_path_attend_bwd(path, &fx.q, &fx.o, &fx.dout, f_off, &fx.dq, fx.scale),
                 "path_attend_bwd: lse 2 bytes off", "lse", &r);
  forkattn_path_destroy(path);
  /* cached prefix: queries are the responses' rows, keys the prompt's and theirs */
  const int64_t rr = FX_T - FX_P;
  const forkattn_tensor q = tc_buf_view(&fx.buf[BQ], 0, rr, FX_HQ, FX_D, FX_HQ * FX_D, FX_D);
  const forkattn_tensor o = tc_buf_view(&fx.buf[BO], 0, rr, FX_HQ, FX_D, FX_HQ * FX_D, FX_D);
  expect_refused(forkattn_prefix_cached_fwd(fx.ctx, &fx.lay, &q, &fx.k, &fx.v, &o, f_off, fx.scale,
                                            FORKATTN_MEMORY_HOST),
                 "prefix_cached_fwd: lse 2 bytes off", "lse", &r);
  /* tries: every int64 array */
  const int64_t *i_off = (const int64_t *)(const void *)(r.b + 4);
  static const int64_t seq_off[2] = {0, 3}, tokens[3] = {1, 2, 3}, parents[1] = {-1}, lengths[1] = {3};
  forkattn_trie *trie = NULL;
  expect_refused(forkattn_trie_from_sequences(fx.ctx, 1, i_off, tokens, 0, &trie),
                 "trie_from_sequences: seq_offsets 4 bytes off", "seq_offsets", &r);
  expect_refused(forkattn_trie_from_sequences(fx.ctx, 1, seq_off, i_off, 0, &trie),
                 "trie_from_sequences: tokens 4 bytes off", "tokens", &r);
  expect_refused(forkattn_trie_from_parents(fx.ctx, 1, i_off, lengths, 0, &trie),
                 "trie_from_parents: parents 4 bytes off", "parents", &r);
  expect_refused(forkattn_trie_from_parents(fx.ctx, 1, parents, i_off, 0, &trie),
                 "trie_from_parents: node_lengths 4 bytes off", "node_lengths", &r);
  expect_refused(forkattn_trie_from_token_parents(fx.ctx, 1, i_off, 0, &trie),
                 "trie_from_token_parents: token_parents 4 bytes off", "token_parents", &r);
  cr_expect(trie == NULL, "a refused trie builder returned a trie");
}

/* ---- context API ---------------------------------------------------------- */

TestSuite(context, .timeout = 60.0);

static forkattn_status create_with_env(const char *env, forkattn_backend requested,
                                       forkattn_ctx **ctx) {
  if (env)
    setenv("FORKATTN_BACKEND", env, 1);
  else
    unsetenv("FORKATTN_BACKEND");
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = requested;
  *ctx = (forkattn_ctx *)(uintptr_t)1; /* must be overwritten */
  return forkattn_ctx_create(ctx, &opt);
}

Test(context, default_context_reports_backend) {
  unsetenv("FORKATTN_BACKEND");
  forkattn_ctx *ctx = tc_ctx_default("context/default_context_reports_backend");
  cr_assert(ctx);
  const forkattn_backend b = forkattn_ctx_backend(ctx);
  cr_expect(b == FORKATTN_BACKEND_CPU || b == FORKATTN_BACKEND_GPU, "backend %d", (int)b);
  const char *reason = forkattn_ctx_backend_reason(ctx);
  cr_expect(reason && reason[0], "empty backend reason");
  cr_expect_str_eq(forkattn_ctx_last_error(ctx), "", "fresh context has an error message");
  cr_expect_geq(forkattn_ctx_threads(ctx), 1);
  if (!forkattn_build_has_offload())
    cr_expect_eq(b, FORKATTN_BACKEND_CPU, "a build without offload chose %d", (int)b);
  forkattn_ctx_destroy(ctx);
}

Test(context, env_cpu_gives_cpu) {
  forkattn_ctx *ctx;
  forkattn_status st = create_with_env("cpu", FORKATTN_BACKEND_AUTO, &ctx);
  cr_assert_eq(st, FORKATTN_OK, "%s", forkattn_status_string(st));
  cr_expect_eq(forkattn_ctx_backend(ctx), FORKATTN_BACKEND_CPU);
  const char *reason = forkattn_ctx_backend_reason(ctx);
  cr_expect(reason && reason[0]);
  fprintf(stderr, "  FORKATTN_BACKEND=cpu: %s\n", reason ? reason : "(null)");
  forkattn_ctx_destroy(ctx);
}

/* FORKATTN_BACKEND applies only to contexts whose options ask for auto: a
 * backend the caller chose explicitly stands, whatever the environment says. */
Test(context, env_applies_to_auto_only) {
  forkattn_ctx *ctx;
  forkattn_status st = create_with_env("gpu", FORKATTN_BACKEND_CPU, &ctx);
  cr_assert_eq(st, FORKATTN_OK, "FORKATTN_BACKEND=gpu with opt cpu: %s (%s)", forkattn_status_string(st),
               forkattn_ctx_create_error());
  cr_expect_eq(forkattn_ctx_backend(ctx), FORKATTN_BACKEND_CPU);
  cr_expect(strstr(forkattn_ctx_backend_reason(ctx), "requested by options"), "reason: %s",
            forkattn_ctx_backend_reason(ctx));
  forkattn_ctx_destroy(ctx);
  /* an explicit gpu request is not turned into cpu either */
  st = create_with_env(NULL, FORKATTN_BACKEND_GPU, &ctx);
  const forkattn_status want_gpu = st;
  if (st == FORKATTN_OK) forkattn_ctx_destroy(ctx);
  st = create_with_env("cpu", FORKATTN_BACKEND_GPU, &ctx);
  cr_expect_eq(st, want_gpu, "FORKATTN_BACKEND=cpu with opt gpu: %s, without the variable %s",
               forkattn_status_string(st), forkattn_status_string(want_gpu));
  if (st == FORKATTN_OK) {
    cr_expect_eq(forkattn_ctx_backend(ctx), FORKATTN_BACKEND_GPU);
    forkattn_ctx_destroy(ctx);
  }
  /* an unknown value is not read for an explicit backend */
  st = create_with_env("banana", FORKATTN_BACKEND_CPU, &ctx);
  cr_expect_eq(st, FORKATTN_OK, "FORKATTN_BACKEND=banana with opt cpu: %s", forkattn_status_string(st));
  if (st == FORKATTN_OK) forkattn_ctx_destroy(ctx);
}

Test(context, env_auto) {
  forkattn_ctx *ctx;
  forkattn_status st = create_with_env("auto", FORKATTN_BACKEND_AUTO, &ctx);
  cr_assert_eq(st, FORKATTN_OK, "%s", forkattn_status_string(st));
  const forkattn_backend b = forkattn_ctx_backend(ctx);
  cr_expect(b == FORKATTN_BACKEND_CPU || b == FORKATTN_BACKEND_GPU);
  forkattn_ctx_destroy(ctx);
}

Test(context, env_invalid_is_an_error) {
  const char *bad[3] = {"banana", "", "cpu,gpu"};
  for (int i = 0; i < 3; i++) {
    forkattn_ctx *ctx;
    forkattn_status st = create_with_env(bad[i], FORKATTN_BACKEND_AUTO, &ctx);
    fprintf(stderr, "  FORKATTN_BACKEND=\"%s\" -> %d (%s)\n", bad[i], (int)st,
            forkattn_status_string(st));
    if (bad[i][0] == '\0' && st == FORKATTN_OK) {
      /* An empty value may reasonably mean "unset". */
      forkattn_ctx_destroy(ctx);
      continue;
    }
    cr_expect(st == FORKATTN_ERR_INVALID_ARGUMENT || st == FORKATTN_ERR_BACKEND_UNAVAILABLE,
              "FORKATTN_BACKEND=\"%s\": status %d (%s)", bad[i], (int)st,
              forkattn_status_string(st));
    cr_expect_null(ctx, "FORKATTN_BACKEND=\"%s\": *ctx not set to NULL on failure", bad[i]);
    if (st == FORKATTN_OK)
      forkattn_ctx_destroy(ctx);
  }
}

Test(context, gpu_request_when_unavailable) {
  forkattn_ctx *ctx;
  forkattn_status st = create_with_env(NULL, FORKATTN_BACKEND_AUTO, &ctx);
  cr_assert_eq(st, FORKATTN_OK);
  const forkattn_backend auto_choice = forkattn_ctx_backend(ctx);
  forkattn_ctx_destroy(ctx);
  st = create_with_env(NULL, FORKATTN_BACKEND_GPU, &ctx);
  if (auto_choice == FORKATTN_BACKEND_CPU) {
    /* auto found no usable device, so an explicit gpu request must fail */
    cr_expect_eq(st, FORKATTN_ERR_BACKEND_UNAVAILABLE, "gpu request: %s",
                 forkattn_status_string(st));
    cr_expect_null(ctx);
  } else {
    cr_expect_eq(st, FORKATTN_OK);
    cr_expect_eq(forkattn_ctx_backend(ctx), FORKATTN_BACKEND_GPU);
  }
  if (st == FORKATTN_OK)
    forkattn_ctx_destroy(ctx);
  st = create_with_env("gpu", FORKATTN_BACKEND_AUTO, &ctx);
  if (auto_choice == FORKATTN_BACKEND_CPU) {
    cr_expect_eq(st, FORKATTN_ERR_BACKEND_UNAVAILABLE, "FORKATTN_BACKEND=gpu: %s",
                 forkattn_status_string(st));
    cr_expect_null(ctx);
  }
  if (st == FORKATTN_OK)
    forkattn_ctx_destroy(ctx);
}

Test(context, bad_create_arguments) {
  unsetenv("FORKATTN_BACKEND");
  cr_expect_eq(forkattn_ctx_create(NULL, NULL), FORKATTN_ERR_INVALID_ARGUMENT);
  forkattn_ctx *ctx = NULL;
  cr_expect_eq(forkattn_ctx_create(&ctx, NULL), FORKATTN_OK, "NULL options mean defaults");
  forkattn_ctx_destroy(ctx);
  forkattn_ctx_destroy(NULL);
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = (forkattn_backend)9;
  ctx = (forkattn_ctx *)(uintptr_t)1;
  forkattn_status st = forkattn_ctx_create(&ctx, &opt);
  cr_expect_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "backend = 9: %s", forkattn_status_string(st));
  cr_expect_null(ctx);
  if (st == FORKATTN_OK)
    forkattn_ctx_destroy(ctx);
  forkattn_ctx_options_init(&opt);
  opt.threads = -3;
  ctx = (forkattn_ctx *)(uintptr_t)1;
  st = forkattn_ctx_create(&ctx, &opt);
  cr_expect_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "threads = -3: %s", forkattn_status_string(st));
  cr_expect_null(ctx);
  if (st == FORKATTN_OK)
    forkattn_ctx_destroy(ctx);
}

/* Every CPU call opens an OpenMP team of forkattn_ctx_threads() threads, and the
 * OpenMP runtime ends the process when it cannot allocate or start one (INT_MAX
 * threads: libgomp "Out of memory allocating 481036338272 bytes", then exit;
 * 100000000: SIGSEGV inside libgomp). Such counts must be refused at create
 * time with a message naming the limit; the limit itself must work. */
Test(context, absurd_thread_counts_are_refused, .timeout = 60) {
  unsetenv("FORKATTN_BACKEND");
  const int limit = forkattn_max_threads();
  cr_assert_geq(limit, 64, "forkattn_max_threads() = %d", limit);
  char want[32];
  snprintf(want, sizeof want, "limit %d", limit);
  const int bad[] = {INT_MAX, 100000000, limit + 1, limit > 2000 ? limit + 2000 : 2000};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    forkattn_ctx_options opt;
    forkattn_ctx_options_init(&opt);
    opt.backend = FORKATTN_BACKEND_CPU;
    opt.threads = bad[i];
    forkattn_ctx *ctx = (forkattn_ctx *)(uintptr_t)1;
    const forkattn_status st = forkattn_ctx_create(&ctx, &opt);
    cr_expect_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "threads = %d: %s", bad[i], forkattn_status_string(st));
    cr_expect_null(ctx, "threads = %d: *ctx not NULL", bad[i]);
    cr_expect(strstr(forkattn_ctx_create_error(), want), "threads = %d: message '%s' does not name the %s",
              bad[i], forkattn_ctx_create_error(), want);
    if (st == FORKATTN_OK) forkattn_ctx_destroy(ctx); /* never call into it: the runtime may abort */
  }
  /* the limit is accepted and a call on it runs */
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = limit;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK, "threads = limit %d: %s", limit,
               forkattn_ctx_create_error());
  cr_expect_eq(forkattn_ctx_threads(ctx), limit);
  float q[2 * 4] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f}, k[2 * 4] = {1, 0, 0, 0, 0, 1, 0, 0};
  float v[2 * 4] = {1, 2, 3, 4, 5, 6, 7, 8}, o[2 * 4] = {0}, lse[2];
  forkattn_prefix_layout lay = {2, 0, NULL, FORKATTN_MASK_CAUSAL};
  forkattn_tensor tq = forkattn_tensor_contiguous(q, FORKATTN_DTYPE_F32, 2, 1, 4);
  forkattn_tensor tk = forkattn_tensor_contiguous(k, FORKATTN_DTYPE_F32, 2, 1, 4);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, FORKATTN_DTYPE_F32, 2, 1, 4);
  forkattn_tensor to = forkattn_tensor_contiguous(o, FORKATTN_DTYPE_F32, 2, 1, 4);
  cr_expect_eq(forkattn_prefix_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, 0.5f, FORKATTN_MEMORY_HOST), FORKATTN_OK,
               "%s", forkattn_ctx_last_error(ctx));
  for (int c = 0; c < 4; c++) /* row 0 sees key 0 only */
    cr_expect_float_eq(o[c], v[c], 1e-6f, "o[0,%d] = %g", c, (double)o[c]);
  forkattn_ctx_destroy(ctx);
}

Test(context, options_and_threads) {
  unsetenv("FORKATTN_BACKEND");
  forkattn_ctx_options opt;
  memset(&opt, 0x5A, sizeof opt);
  forkattn_ctx_options_init(&opt);
  cr_expect_eq(opt.backend, FORKATTN_BACKEND_AUTO);
  cr_expect_eq(opt.device, 0);
  cr_expect_eq(opt.threads, 0);
  cr_expect_eq(opt.bind_threads, 0);
  cr_expect_eq(opt.verbose, 0);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = 1;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK);
  cr_expect_eq(forkattn_ctx_threads(ctx), 1);
  forkattn_ctx_destroy(ctx);
}

Test(context, status_strings) {
  const char *s[7];
  for (int i = 0; i <= 6; i++) {
    s[i] = forkattn_status_string((forkattn_status)i);
    cr_assert_not_null(s[i], "status %d has no string", i);
    cr_expect(s[i][0] != '\0', "status %d has an empty string", i);
    for (int j = 0; j < i; j++)
      cr_expect_str_neq(s[i], s[j], "status %d and %d share the string \"%s\"", i, j, s[i]);
  }
  cr_expect_not_null(forkattn_status_string((forkattn_status)99));
  cr_expect_not_null(forkattn_status_string((forkattn_status)-1));
  cr_expect_str_eq(forkattn_backend_name(FORKATTN_BACKEND_AUTO), "auto");
  cr_expect_str_eq(forkattn_backend_name(FORKATTN_BACKEND_CPU), "cpu");
  cr_expect_str_eq(forkattn_backend_name(FORKATTN_BACKEND_GPU), "gpu");
  cr_expect_not_null(forkattn_backend_name((forkattn_backend)42));
}

Test(context, version) {
  cr_expect_eq(forkattn_version_number(), (unsigned)FORKATTN_VERSION_NUMBER);
  cr_expect_eq(FORKATTN_VERSION_NUMBER, FORKATTN_VERSION_MAJOR * 10000 +
                                            FORKATTN_VERSION_MINOR * 100 +
                                            FORKATTN_VERSION_PATCH);
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", FORKATTN_VERSION_MAJOR, FORKATTN_VERSION_MINOR,
           FORKATTN_VERSION_PATCH);
  cr_assert_not_null(forkattn_version_string());
  cr_expect_str_eq(forkattn_version_string(), want);
}

Test(context, tensor_contiguous) {
  float x;
  forkattn_tensor t = forkattn_tensor_contiguous(&x, FORKATTN_DTYPE_BF16, 7, 3, 64);
  cr_expect_eq(t.data, (void *)&x);
  cr_expect_eq(t.dtype, FORKATTN_DTYPE_BF16);
  cr_expect_eq(t.rows, 7);
  cr_expect_eq(t.heads, 3);
  cr_expect_eq(t.head_dim, 64);
  cr_expect_eq(t.row_stride, 192);
  cr_expect_eq(t.head_stride, 64);
}
