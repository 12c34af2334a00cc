/* test_common.c - see test_common.h. */
#define _POSIX_C_SOURCE 200809L
#include "test_common.h"
#include <criterion/criterion.h>

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "reference.h"

/* ---- random numbers ------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t tc_seed(void) {
  static int have = 0;
  static uint64_t seed = 0;
  if (have)
    return seed;
  const char *env = getenv("FORKATTN_TEST_SEED");
  if (env && *env) {
    char *end = NULL;
    seed = (uint64_t)strtoull(env, &end, 0);
    if (!end || *end != '\0')
      fprintf(stderr,
              "[seed] warning: FORKATTN_TEST_SEED=\"%s\" is not a number; using %" PRIu64 "\n",
              env, seed);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^
                 ((uint64_t)getpid() << 32);
    seed = splitmix64(&x) % 1000000000000ull; /* short enough to retype */
  }
  have = 1;
  return seed;
}

void tc_rng_init(tc_rng *rng, uint64_t seed) {
  uint64_t x = seed;
  for (int i = 0; i < 4; i++)
    rng->s[i] = splitmix64(&x);
}

tc_rng tc_rng_for(const char *test_name) {
  uint64_t seed = tc_seed();
  uint64_t h = 1469598103934665603ull; /* FNV-1a of the name */
  for (const char *p = test_name ? test_name : ""; *p; p++)
    h = (h ^ (unsigned char)*p) * 1099511628211ull;
  fprintf(stderr, "[seed] FORKATTN_TEST_SEED=%" PRIu64 " (%s)\n", seed,
          test_name ? test_name : "?");
  tc_rng rng;
  tc_rng_init(&rng, seed ^ h);
  return rng;
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tc_next(tc_rng *rng) {
  uint64_t *s = rng->s;
  const uint64_t result = rotl(s[1] * 5, 7) * 9;
  const uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

double tc_uniform(tc_rng *rng, double lo, double hi) {
  return lo + (hi - lo) * ((double)(tc_next(rng) >> 11) * 0x1.0p-53);
}

int64_t tc_randint(tc_rng *rng, int64_t lo, int64_t hi) {
  if (hi <= lo)
    return lo;
  return lo + (int64_t)(tc_next(rng) % (uint64_t)(hi - lo + 1));
}

void tc_fill_tensor(tc_rng *rng, const forkattn_tensor *t, double lo, double hi) {
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      for (int64_t c = 0; c < t->head_dim; c++)
        ref_tensor_set(t, r, h, c, tc_uniform(rng, lo, hi));
}

/* ---- buffers -------------------------------------------------------------- */

int tc_buf_alloc(tc_buf *b, size_t elems, forkattn_dtype dtype) {
  memset(b, 0, sizeof *b);
  size_t es = ref_dtype_size(dtype);
  if (es == 0)
    return -1;
  b->dtype = dtype;
  b->elems = elems;
  b->alloc_bytes = 2 * (size_t)TC_GUARD_BYTES + elems * es;
  b->alloc = malloc(b->alloc_bytes);
  b->mark = calloc(elems + 1, 1);
  if (!b->alloc || !b->mark) {
    tc_buf_free(b);
    return -1;
  }
  memset(b->alloc, TC_GUARD_BYTE, b->alloc_bytes);
  b->data = b->alloc + TC_GUARD_BYTES;
  return 0;
}

void tc_buf_free(tc_buf *b) {
  free(b->alloc);
  free(b->mark);
  free(b->snapshot);
  memset(b, 0, sizeof *b);
}

const char *const tc_out_names[TC_NOUT] = {"o", "lse", "dq", "dk", "dv"};

int tc_attn_out_init(tc_attn_out *o, forkattn_dtype dtype, int64_t T, int64_t hq, int64_t hkv, int64_t head_dim) {
  memset(o, 0, sizeof *o);
  o->o = tc_buf_contiguous(&o->buf[TC_OUT_O], dtype, T, hq, head_dim);
  o->lse = tc_buf_f32(&o->buf[TC_OUT_LSE], T * hq);
  o->dq = tc_buf_contiguous(&o->buf[TC_OUT_DQ], dtype, T, hq, head_dim);
  o->dk = tc_buf_contiguous(&o->buf[TC_OUT_DK], dtype, T, hkv, head_dim);
  o->dv = tc_buf_contiguous(&o->buf[TC_OUT_DV], dtype, T, hkv, head_dim);
  return o->o.data && o->lse && o->dq.data && o->dk.data && o->dv.data ? 0 : -1;
}

void tc_attn_out_free(tc_attn_out *o) {
  for (int i = 0; i < TC_NOUT; i++) tc_buf_free(&o->buf[i]);
}

forkattn_tensor tc_buf_view(tc_buf *b, int64_t offset, int64_t rows, int64_t heads,
                            int64_t head_dim, int64_t row_stride, int64_t head_stride) {
  forkattn_tensor t;
  t.data = (unsigned char *)b->data + (size_t)offset * ref_dtype_size(b->dtype);
  t.dtype = b->dtype;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  t.row_stride = row_stride;
  t.head_stride = head_stride;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++)
      for (int64_t c = 0; c < head_dim; c++)
        b->mark[offset + ref_tensor_offset(&t, r, h, c)] = 1;
  return t;
}

forkattn_tensor tc_buf_contiguous(tc_buf *b, forkattn_dtype dtype, int64_t rows, int64_t heads,
                                  int64_t head_dim) {
  forkattn_tensor t;
  memset(&t, 0, sizeof t);
  if (tc_buf_alloc(b, (size_t)(rows * heads * head_dim), dtype) != 0)
    return t;
  return tc_buf_view(b, 0, rows, heads, head_dim, heads * head_dim, head_dim);
}

float *tc_buf_f32(tc_buf *b, int64_t n) {
  if (tc_buf_alloc(b, (size_t)n, FORKATTN_DTYPE_F32) != 0)
    return NULL;
  memset(b->mark, 1, (size_t)n);
  return b->data;
}

static void poison_elem(tc_buf *b, size_t i) {
  if (b->dtype == FORKATTN_DTYPE_F32) {
    uint32_t p = TC_POISON_F32;
    memcpy((unsigned char *)b->data + 4 * i, &p, 4);
  } else {
    uint16_t p = b->dtype == FORKATTN_DTYPE_BF16 ? TC_POISON_BF16 : TC_POISON_F16;
    memcpy((unsigned char *)b->data + 2 * i, &p, 2);
  }
}

static int is_poison(const tc_buf *b, size_t i) {
  if (b->dtype == FORKATTN_DTYPE_F32) {
    uint32_t x;
    memcpy(&x, (const unsigned char *)b->data + 4 * i, 4);
    return x == TC_POISON_F32;
  }
  uint16_t x, p = b->dtype == FORKATTN_DTYPE_BF16 ? TC_POISON_BF16 : TC_POISON_F16;
  memcpy(&x, (const unsigned char *)b->data + 2 * i, 2);
  return x == p;
}

void tc_buf_poison(tc_buf *b) {
  memset(b->alloc, TC_GUARD_BYTE, b->alloc_bytes);
  for (size_t i = 0; i < b->elems; i++)
    if (b->mark[i])
      poison_elem(b, i);
}

void tc_buf_snapshot(tc_buf *b) {
  if (!b->snapshot)
    b->snapshot = malloc(b->alloc_bytes);
  if (b->snapshot)
    memcpy(b->snapshot, b->alloc, b->alloc_bytes);
}

size_t tc_buf_changed_bytes(const tc_buf *b) {
  if (!b->snapshot)
    return (size_t)-1;
  size_t n = 0;
  for (size_t i = 0; i < b->alloc_bytes; i++)
    n += b->alloc[i] != b->snapshot[i];
  return n;
}

tc_write_check tc_buf_check(const tc_buf *b) {
  tc_write_check c = {0, 0, (size_t)-1, (size_t)-1};
  const size_t es = ref_dtype_size(b->dtype);
  for (size_t i = 0; i < b->alloc_bytes; i++) {
    int in_data = i >= TC_GUARD_BYTES && i < TC_GUARD_BYTES + b->elems * es;
    if (in_data && b->mark[(i - TC_GUARD_BYTES) / es])
      continue;
    if (b->alloc[i] != TC_GUARD_BYTE) {
      if (c.guard_bad == 0)
        c.first_guard = i;
      c.guard_bad++;
    }
  }
  for (size_t i = 0; i < b->elems; i++)
    if (b->mark[i] && is_poison(b, i)) {
      if (c.unwritten == 0)
        c.first_unwritten = i;
      c.unwritten++;
    }
  return c;
}

/* ---- error metrics -------------------------------------------------------- */

static void err_add(tc_err *e, double got, double want, int64_t idx) {
  e->count++;
  double diff;
  if (isfinite(want)) {
    if (fabs(want) > e->max_ref)
      e->max_ref = fabs(want);
    if (!isfinite(got)) {
      e->nonfinite++;
      diff = INFINITY;
    } else {
      diff = fabs(got - want);
    }
  } else if (got == want) { /* same infinity */
    diff = 0.0;
  } else {
    e->nonfinite++;
    diff = INFINITY;
  }
  if (e->worst < 0 || diff > e->max_abs) {
    if (diff > e->max_abs)
      e->max_abs = diff;
    e->worst = idx;
    e->got = got;
    e->want = want;
  }
}

static void err_finish(tc_err *e) {
  e->rel = e->max_ref > 0.0 ? e->max_abs / e->max_ref : e->max_abs;
}

static tc_err err_init(void) {
  tc_err e;
  memset(&e, 0, sizeof e);
  e.worst = -1;
  return e;
}

tc_err tc_compare_tensor(const forkattn_tensor *got, const double *want) {
  tc_err e = err_init();
  int64_t idx = 0;
  for (int64_t r = 0; r < got->rows; r++)
    for (int64_t h = 0; h < got->heads; h++)
      for (int64_t c = 0; c < got->head_dim; c++, idx++)
        err_add(&e, ref_tensor_get(got, r, h, c), want[idx], idx);
  err_finish(&e);
  return e;
}

tc_err tc_compare_f32(const float *got, const double *want, int64_t n) {
  tc_err e = err_init();
  for (int64_t i = 0; i < n; i++)
    err_add(&e, (double)got[i], want[i], i);
  err_finish(&e);
  return e;
}

tc_err tc_compare_f64(const double *got, const double *want, int64_t n) {
  tc_err e = err_init();
  for (int64_t i = 0; i < n; i++)
    err_add(&e, got[i], want[i], i);
  err_finish(&e);
  return e;
}

int64_t tc_count_nonfinite_tensor(const forkattn_tensor *t) {
  int64_t n = 0;
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      for (int64_t c = 0; c < t->head_dim; c++)
        n += !isfinite(ref_tensor_get(t, r, h, c));
  return n;
}

int64_t tc_count_nonfinite_f32(const float *x, int64_t n) {
  int64_t k = 0;
  for (int64_t i = 0; i < n; i++)
    k += !isfinite(x[i]);
  return k;
}

void tc_err_format(char *buf, size_t size, const char *name, const tc_err *e, int64_t heads,
                   int64_t head_dim) {
  int64_t w = e->worst < 0 ? 0 : e->worst;
  int64_t c = w % head_dim, h = (w / head_dim) % heads, r = w / head_dim / heads;
  snprintf(buf, size,
           "%-3s max_abs=%.3e max_ref=%.3e rel=%.3e nonfinite=%" PRId64 " worst=[%" PRId64
           ",%" PRId64 ",%" PRId64 "] got=%.9g want=%.9g",
           name, e->max_abs, e->max_ref, e->rel, e->nonfinite, r, h, c, e->got, e->want);
}

/* ---- context and misc ----------------------------------------------------- */

void tc_print_where(const forkattn_ctx *ctx, const char *test_name) {
  const int gpu = forkattn_ctx_backend(ctx) == FORKATTN_BACKEND_GPU;
  const char *reason = forkattn_ctx_backend_reason(ctx);
  fprintf(stderr, "%s %s: backend %s (%s)\n", gpu ? "[ran on device]" : "[ran on host]",
          test_name ? test_name : "", forkattn_backend_name(forkattn_ctx_backend(ctx)),
          reason ? reason : "(no reason given)");
}

forkattn_ctx *tc_ctx_default(const char *test_name) {
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  forkattn_ctx *ctx = NULL;
  forkattn_status st = forkattn_ctx_create(&ctx, &opt);
  if (st != FORKATTN_OK || !ctx) {
    fprintf(stderr, "%s: forkattn_ctx_create failed: %s\n", test_name ? test_name : "",
            forkattn_status_string(st));
    return NULL;
  }
  tc_print_where(ctx, test_name);
  return ctx;
}

forkattn_ctx *tc_gpu_ctx_or_skip(const char *test_name) {
  forkattn_ctx *ctx = tc_ctx_default(test_name);
  cr_assert_not_null(ctx, "%s: no context", test_name);
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU) {
    forkattn_ctx_destroy(ctx);
    cr_skip_test("%s: needs the gpu backend (this context runs on the host)", test_name);
  }
  return ctx;
}

double tc_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- layouts of tries, partitions and batch plans ------------------------- */

forkattn_tree_layout tc_trie_layout(const forkattn_trie *trie) {
  forkattn_tree_layout l;
  cr_assert_eq(forkattn_trie_layout(trie, &l), FORKATTN_OK, "forkattn_trie_layout failed");
  return l;
}

forkattn_tree_layout tc_partition_layout(const forkattn_partition *partition, int64_t part) {
  forkattn_tree_layout l;
  cr_assert_eq(forkattn_partition_layout(partition, part, &l), FORKATTN_OK, "forkattn_partition_layout(part %lld)",
               (long long)part);
  return l;
}

forkattn_tree_layout tc_batch_plan_layout(const forkattn_batch_plan *plan, int64_t batch) {
  forkattn_tree_layout l;
  cr_assert_eq(forkattn_batch_plan_layout(plan, batch, &l), FORKATTN_OK, "forkattn_batch_plan_layout(batch %lld)",
               (long long)batch);
  return l;
}
