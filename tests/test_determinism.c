/*
 * test_determinism.c - the shared-prompt and tree forward and backward are
 * bitwise reproducible.
 *
 *  repeat:    forkattn_prefix_bwd (and fwd) rerun 1000 times on the same inputs
 *             with the same context give bitwise the same dq/dk/dv (o/lse):
 *             outputs are poisoned before every call, so an element that is not
 *             rewritten shows up as a mismatch too.
 *  (tree:     the same for forkattn_tree_fwd/bwd on a binary tree under the prompt.)
 *  streamkl:  forkattn_kl_fwd/bwd (sparse student, teacher gradients) rerun
 *             1000 times and with 1, 2, 3, 5 threads: the same kl, stats and
 *             dq_s/dk_s/dq_t/dk_t bits.
 *  threads:   the CPU backend gives bitwise the same o/lse/dq/dk/dv whatever
 *             forkattn_ctx_options.threads (1, 2, 3, 5: more threads than work
 *             items and than cores included) and bind_threads are.
 *
 * The CPU backward owns every dK/dV key block by one thread and sums the
 * responses that read a prompt block in a fixed order (cpu/cpu_segment_bwd.c),
 * so none of these may differ even in the last bit.
 *
 * FORKATTN_TEST_SEED=<n> reproduces the data (the seed is printed);
 * FORKATTN_DETERMINISM_REPS=<n> changes the 1000 repetitions (sanitizer builds).
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forkattn.h"
#include "reference.h"
#include "test_common.h"

#include "test_runner.h"

#define DT_MAXN 8
#define DT_TIMEOUT 300.0

/* ---- one problem and its outputs ------------------------------------------ */

typedef struct dt_shape {
  int64_t P, N;
  int64_t lens[DT_MAXN];
  int64_t hq, hkv, d;
  forkattn_mask mask;
  forkattn_dtype dtype;
  int packed; /* q|k|v in one [T, Hq+2Hkv, d] buffer, dq|dk|dv likewise */
  int tree;   /* tree attention: node 0 = the P prompt rows, node i+1 = lens[i] rows under node i/2 */
} dt_shape;

typedef struct dt_problem {
  dt_shape s;
  int64_t off[DT_MAXN + 1], T;
  forkattn_prefix_layout layout;
  forkattn_tree_layout tree;
  int64_t node_off[DT_MAXN + 2], parents[DT_MAXN + 1];
  float scale;
  tc_buf bq, bk, bv, bdo;
  forkattn_tensor q, k, v, dout;
} dt_problem;

static void dt_describe(const dt_shape *s, char *buf, size_t size) {
  int n = snprintf(buf, size, "P=%" PRId64 " N=%" PRId64 " lens={", s->P, s->N);
  for (int64_t i = 0; i < s->N && n > 0 && (size_t)n < size; i++)
    n += snprintf(buf + n, size - (size_t)n, "%s%" PRId64, i ? "," : "", s->lens[i]);
  if (n > 0 && (size_t)n < size)
    snprintf(buf + n, size - (size_t)n, "} heads=%" PRId64 "/%" PRId64 " d=%" PRId64 " %s %s%s%s", s->hq,
             s->hkv, s->d, s->mask == FORKATTN_MASK_CAUSAL ? "causal" : "bidirectional",
             ref_dtype_name(s->dtype), s->packed ? " qkv-packed" : "", s->tree ? " tree" : "");
}

static void dt_problem_init(dt_problem *p, const dt_shape *s, tc_rng *rng) {
  memset(p, 0, sizeof *p);
  p->s = *s;
  cr_assert(s->N <= DT_MAXN, "too many responses");
  p->off[0] = 0;
  for (int64_t i = 0; i < s->N; i++) p->off[i + 1] = p->off[i] + s->lens[i];
  p->T = s->P + p->off[s->N];
  p->layout.prompt_len = s->P;
  p->layout.num_responses = s->N;
  p->layout.response_offsets = p->off;
  p->layout.mask = s->mask;
  p->node_off[0] = 0;
  p->parents[0] = -1;
  for (int64_t i = 0; i <= s->N; i++) p->node_off[i + 1] = s->P + p->off[i];
  for (int64_t i = 0; i < s->N; i++) p->parents[i + 1] = i / 2; /* a binary tree under the prompt */
  p->tree = (forkattn_tree_layout){s->N + 1, p->node_off, p->parents};
  p->scale = (float)(1.0 / sqrt((double)s->d));
  if (s->packed) {
    const int64_t W = (s->hq + 2 * s->hkv) * s->d;
    cr_assert_eq(tc_buf_alloc(&p->bq, (size_t)(p->T * W), s->dtype), 0, "out of memory");
    p->q = tc_buf_view(&p->bq, 0, p->T, s->hq, s->d, W, s->d);
    p->k = tc_buf_view(&p->bq, s->hq * s->d, p->T, s->hkv, s->d, W, s->d);
    p->v = tc_buf_view(&p->bq, (s->hq + s->hkv) * s->d, p->T, s->hkv, s->d, W, s->d);
  } else {
    p->q = tc_buf_contiguous(&p->bq, s->dtype, p->T, s->hq, s->d);
    p->k = tc_buf_contiguous(&p->bk, s->dtype, p->T, s->hkv, s->d);
    p->v = tc_buf_contiguous(&p->bv, s->dtype, p->T, s->hkv, s->d);
  }
  p->dout = tc_buf_contiguous(&p->bdo, s->dtype, p->T, s->hq, s->d);
  cr_assert(p->q.data && p->k.data && p->v.data && p->dout.data, "out of memory");
  tc_fill_tensor(rng, &p->q, -2.0, 2.0);
  tc_fill_tensor(rng, &p->k, -1.0, 1.0);
  tc_fill_tensor(rng, &p->v, -1.0, 1.0);
  tc_fill_tensor(rng, &p->dout, -1.0, 1.0);
}

static void dt_problem_free(dt_problem *p) {
  tc_buf_free(&p->bq);
  tc_buf_free(&p->bk);
  tc_buf_free(&p->bv);
  tc_buf_free(&p->bdo);
}

static void dt_out_init(tc_attn_out *o, const dt_problem *p) {
  const dt_shape *s = &p->s;
  if (!s->packed) {
    cr_assert_eq(tc_attn_out_init(o, s->dtype, p->T, s->hq, s->hkv, s->d), 0, "out of memory");
    return;
  }
  /* dq, dk, dv interleaved in buf[TC_OUT_DQ]; buf[TC_OUT_DK], buf[TC_OUT_DV] stay empty */
  memset(o, 0, sizeof *o);
  o->o = tc_buf_contiguous(&o->buf[TC_OUT_O], s->dtype, p->T, s->hq, s->d);
  o->lse = tc_buf_f32(&o->buf[TC_OUT_LSE], p->T * s->hq);
  const int64_t W = (s->hq + 2 * s->hkv) * s->d;
  cr_assert_eq(tc_buf_alloc(&o->buf[TC_OUT_DQ], (size_t)(p->T * W), s->dtype), 0, "out of memory");
  o->dq = tc_buf_view(&o->buf[TC_OUT_DQ], 0, p->T, s->hq, s->d, W, s->d);
  o->dk = tc_buf_view(&o->buf[TC_OUT_DQ], s->hq * s->d, p->T, s->hkv, s->d, W, s->d);
  o->dv = tc_buf_view(&o->buf[TC_OUT_DQ], (s->hq + s->hkv) * s->d, p->T, s->hkv, s->d, W, s->d);
  cr_assert(o->o.data && o->lse && o->dq.data && o->dk.data && o->dv.data, "out of memory");
}

static void dt_out_poison(tc_attn_out *o) {
  for (int i = 0; i < TC_NOUT; i++)
    if (o->buf[i].alloc) tc_buf_poison(&o->buf[i]);
}

/* Forward into o/lse of @p out. */
static forkattn_status dt_fwd(forkattn_ctx *ctx, const dt_problem *p, tc_attn_out *out) {
  if (p->s.tree)
    return forkattn_tree_fwd(ctx, &p->tree, &p->q, &p->k, &p->v, &out->o, out->lse, p->scale, FORKATTN_MEMORY_HOST);
  return forkattn_prefix_fwd(ctx, &p->layout, &p->q, &p->k, &p->v, &out->o, out->lse, p->scale,
                             FORKATTN_MEMORY_HOST);
}

/* Backward from o/lse of @p fwd into dq/dk/dv of @p out. */
static forkattn_status dt_bwd(forkattn_ctx *ctx, const dt_problem *p, const tc_attn_out *fwd, tc_attn_out *out) {
  if (p->s.tree)
    return forkattn_tree_bwd(ctx, &p->tree, &p->q, &p->k, &p->v, &fwd->o, &p->dout, fwd->lse, &out->dq, &out->dk,
                             &out->dv, p->scale, FORKATTN_MEMORY_HOST);
  return forkattn_prefix_bwd(ctx, &p->layout, &p->q, &p->k, &p->v, &fwd->o, &p->dout, fwd->lse,
                             &out->dq, &out->dk, &out->dv, p->scale, FORKATTN_MEMORY_HOST);
}

/* Value of element @p i of a buffer (for messages). */
static double dt_value(const tc_buf *b, size_t i) {
  if (b->dtype == FORKATTN_DTYPE_F32) return ((const float *)b->data)[i];
  const uint16_t h = ((const uint16_t *)b->data)[i];
  return b->dtype == FORKATTN_DTYPE_BF16 ? ref_bf16_to_float(h) : ref_f16_to_float(h);
}

/* Bitwise comparison of output buffer @p which (guards included). Returns 1
 * when equal; otherwise describes the first differing element in @p msg. */
static int dt_same(const tc_attn_out *a, const tc_attn_out *b, int which, char *msg, size_t size) {
  const tc_buf *x = &a->buf[which], *y = &b->buf[which];
  if (x->alloc_bytes == y->alloc_bytes && (x->alloc_bytes == 0 || memcmp(x->alloc, y->alloc, x->alloc_bytes) == 0))
    return 1;
  if (x->alloc_bytes != y->alloc_bytes) {
    snprintf(msg, size, "%s: buffers of different sizes", tc_out_names[which]);
    return 0;
  }
  const size_t es = ref_dtype_size(x->dtype);
  const unsigned char *px = x->data, *py = y->data;
  size_t first = x->elems, ndiff = 0;
  for (size_t j = 0; j < x->elems; j++)
    if (memcmp(px + j * es, py + j * es, es) != 0) {
      if (first == x->elems) first = j;
      ndiff++;
    }
  if (first == x->elems) {
    snprintf(msg, size, "%s: guard bytes differ", tc_out_names[which]);
    return 0;
  }
  uint32_t bx = 0, by = 0;
  memcpy(&bx, px + first * es, es);
  memcpy(&by, py + first * es, es);
  snprintf(msg, size,
           "%s: %zu of %zu elements differ; first at buffer element %zu: 0x%0*" PRIx32 " (%.9g) vs 0x%0*" PRIx32
           " (%.9g)",
           tc_out_names[which], ndiff, x->elems, first, (int)(2 * es), bx, dt_value(x, first), (int)(2 * es), by,
           dt_value(y, first));
  return 0;
}

static forkattn_ctx *dt_ctx(int threads, int bind, const char *name) {
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  opt.threads = threads;
  opt.bind_threads = bind;
  forkattn_ctx *ctx = NULL;
  forkattn_status st = forkattn_ctx_create(&ctx, &opt);
  cr_assert_eq(st, FORKATTN_OK, "%s: forkattn_ctx_create: %s (%s)", name, forkattn_status_string(st),
               forkattn_ctx_create_error());
  tc_print_where(ctx, name);
  return ctx;
}

static int dt_reps(void) {
  const char *e = getenv("FORKATTN_DETERMINISM_REPS");
  int n = e && *e ? atoi(e) : 1000;
  return n > 0 ? n : 1000;
}

/* ---- repeat: 1000 calls, one context, same bits ----------------------------- */

static void dt_repeat(const char *name, const dt_shape *s) {
  char desc[256];
  dt_describe(s, desc, sizeof desc);
  tc_rng rng = tc_rng_for(name);
  dt_problem p;
  dt_problem_init(&p, s, &rng);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert_not_null(ctx, "%s: no context", name);

  tc_attn_out ref, cur;
  dt_out_init(&ref, &p);
  dt_out_init(&cur, &p);
  dt_out_poison(&ref);
  forkattn_status st = dt_fwd(ctx, &p, &ref);
  cr_assert_eq(st, FORKATTN_OK, "%s: fwd: %s", name, forkattn_ctx_last_error(ctx));
  st = dt_bwd(ctx, &p, &ref, &ref);
  cr_assert_eq(st, FORKATTN_OK, "%s: bwd: %s", name, forkattn_ctx_last_error(ctx));
  for (int w = 0; w < TC_NOUT; w++) {
    if (!ref.buf[w].alloc) continue;
    tc_write_check wc = tc_buf_check(&ref.buf[w]);
    cr_assert(wc.guard_bad == 0 && wc.unwritten == 0, "%s: %s: %zu guard bytes changed, %zu elements unwritten",
              name, tc_out_names[w], wc.guard_bad, wc.unwritten);
  }

  const int reps = dt_reps();
  char msg[320];
  double t0 = tc_now(), t_bwd = 0.0;
  for (int it = 0; it < reps; it++) {
    dt_out_poison(&cur);
    st = dt_fwd(ctx, &p, &cur);
    cr_assert_eq(st, FORKATTN_OK, "%s: fwd #%d: %s", name, it, forkattn_ctx_last_error(ctx));
    double tb = tc_now();
    /* backward always from the first run's o/lse: only the backward varies */
    st = dt_bwd(ctx, &p, &ref, &cur);
    t_bwd += tc_now() - tb;
    cr_assert_eq(st, FORKATTN_OK, "%s: bwd #%d: %s", name, it, forkattn_ctx_last_error(ctx));
    for (int w = 0; w < TC_NOUT; w++)
      cr_assert(dt_same(&cur, &ref, w, msg, sizeof msg), "%s [%s]: run %d of %d differs from run 0: %s", name,
                desc, it + 1, reps, msg);
  }
  char where[32];
  if (forkattn_ctx_backend(ctx) == FORKATTN_BACKEND_CPU)
    snprintf(where, sizeof where, "cpu, %d threads", forkattn_ctx_threads(ctx));
  else
    snprintf(where, sizeof where, "%s", forkattn_backend_name(forkattn_ctx_backend(ctx)));
  fprintf(stderr, "%s [%s]: %d fwd+bwd runs bitwise identical (%.2f s, bwd %.1f us/call, %s)\n", name, desc,
          reps, tc_now() - t0, 1e6 * t_bwd / reps, where);
  tc_attn_out_free(&ref);
  tc_attn_out_free(&cur);
  forkattn_ctx_destroy(ctx);
  dt_problem_free(&p);
}

#define SMALL(mask_, dtype_)                                                                        \
  .P = 64, .N = 4, .lens = {16, 40, 23, 31}, .hq = 4, .hkv = 2, .d = 32, .mask = (mask_), .dtype = (dtype_)

Test(repeat, bwd_1000_causal_f32, .timeout = DT_TIMEOUT) {
  dt_repeat("repeat/bwd_1000_causal_f32", &(const dt_shape){SMALL(FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_F32)});
}

Test(repeat, bwd_1000_causal_bf16, .timeout = DT_TIMEOUT) {
  dt_repeat("repeat/bwd_1000_causal_bf16", &(const dt_shape){SMALL(FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_BF16)});
}

Test(repeat, bwd_1000_bidir_f32, .timeout = DT_TIMEOUT) {
  dt_repeat("repeat/bwd_1000_bidir_f32",
            &(const dt_shape){SMALL(FORKATTN_MASK_BIDIRECTIONAL, FORKATTN_DTYPE_F32)});
}

Test(repeat, bwd_1000_tree_f32, .timeout = DT_TIMEOUT) {
  dt_repeat("repeat/bwd_1000_tree_f32",
            &(const dt_shape){SMALL(FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_F32), .tree = 1});
}

/* ---- threads: thread count and binding change no bit ------------------------- */

typedef struct dt_config {
  int threads, bind;
} dt_config;

static void dt_threads(const char *name, const dt_shape *s) {
  static const dt_config cfg[] = {{1, 0}, {2, 0}, {3, 0}, {5, 0}, {1, 1}, {2, 1}, {3, 1}, {5, 1}};
  const int ncfg = (int)(sizeof cfg / sizeof cfg[0]);
  char desc[256];
  dt_describe(s, desc, sizeof desc);
  tc_rng rng = tc_rng_for(name);
  dt_problem p;
  dt_problem_init(&p, s, &rng);

  tc_attn_out ref, cur;
  dt_out_init(&ref, &p);
  dt_out_init(&cur, &p);
  char msg[320], label[320];
  for (int c = 0; c < ncfg; c++) {
    snprintf(label, sizeof label, "%s threads=%d bind=%d", name, cfg[c].threads, cfg[c].bind);
    forkattn_ctx *ctx = dt_ctx(cfg[c].threads, cfg[c].bind, label);
    cr_assert_eq(forkattn_ctx_backend(ctx), FORKATTN_BACKEND_CPU, "%s: %s", label,
                 forkattn_ctx_backend_reason(ctx));
    cr_assert_eq(forkattn_ctx_threads(ctx), cfg[c].threads, "%s: ctx threads", label);
    tc_attn_out *out = c == 0 ? &ref : &cur;
    dt_out_poison(out);
    for (int rep = 0; rep < 3; rep++) { /* a few calls: pinning is undone and redone each time */
      forkattn_status st = dt_fwd(ctx, &p, out);
      cr_assert_eq(st, FORKATTN_OK, "%s: fwd: %s", label, forkattn_ctx_last_error(ctx));
      st = dt_bwd(ctx, &p, out, out);
      cr_assert_eq(st, FORKATTN_OK, "%s: bwd: %s", label, forkattn_ctx_last_error(ctx));
    }
    forkattn_ctx_destroy(ctx);
    if (c == 0) {
      for (int w = 0; w < TC_NOUT; w++) {
        if (!ref.buf[w].alloc) continue;
        tc_write_check wc = tc_buf_check(&ref.buf[w]);
        cr_assert(wc.guard_bad == 0 && wc.unwritten == 0, "%s: %s: %zu guard bytes changed, %zu unwritten", label,
                  tc_out_names[w], wc.guard_bad, wc.unwritten);
      }
      continue;
    }
    for (int w = 0; w < TC_NOUT; w++)
      cr_expect(dt_same(&cur, &ref, w, msg, sizeof msg), "%s [%s]: differs from threads=1: %s", label, desc, msg);
  }
  fprintf(stderr, "%s [%s]: o/lse/dq/dk/dv bitwise identical for threads 1,2,3,5 x bind 0,1\n", name, desc);
  tc_attn_out_free(&ref);
  tc_attn_out_free(&cur);
  dt_problem_free(&p);
}

Test(threads, small_causal_f32, .timeout = DT_TIMEOUT) {
  dt_threads("threads/small_causal_f32", &(const dt_shape){SMALL(FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_F32)});
}

Test(threads, small_causal_bf16, .timeout = DT_TIMEOUT) {
  dt_threads("threads/small_causal_bf16", &(const dt_shape){SMALL(FORKATTN_MASK_CAUSAL, FORKATTN_DTYPE_BF16)});
}

/* Several key blocks in the prompt (FA_CPU_KEY_BLOCK = 128) read by many
 * responses, several query blocks per segment, GQA group 4: pass 2's per-block
 * sum over readers and pass 1's blocks are spread over the threads. */
Test(threads, multiblock_causal_f32, .timeout = DT_TIMEOUT) {
  dt_threads("threads/multiblock_causal_f32",
             &(const dt_shape){.P = 300, .N = 6, .lens = {130, 0, 7, 200, 1, 64}, .hq = 8, .hkv = 2, .d = 64,
                               .mask = FORKATTN_MASK_CAUSAL, .dtype = FORKATTN_DTYPE_F32});
}

Test(threads, multiblock_tree_f32, .timeout = DT_TIMEOUT) {
  dt_threads("threads/multiblock_tree_f32",
             &(const dt_shape){.P = 300, .N = 6, .lens = {130, 0, 7, 200, 1, 64}, .hq = 8, .hkv = 2, .d = 64,
                               .mask = FORKATTN_MASK_CAUSAL, .dtype = FORKATTN_DTYPE_F32, .tree = 1});
}

Test(threads, multiblock_bidir_bf16, .timeout = DT_TIMEOUT) {
  dt_threads("threads/multiblock_bidir_bf16",
             &(const dt_shape){.P = 257, .N = 5, .lens = {129, 33, 0, 190, 5}, .hq = 6, .hkv = 3, .d = 48,
                               .mask = FORKATTN_MASK_BIDIRECTIONAL, .dtype = FORKATTN_DTYPE_BF16});
}

/* q|k|v and dq|dk|dv interleaved in one buffer each: the threads write dq,
 * dk and dv rows that sit next to each other (the TSan run checks that no two
 * threads touch the same bytes). */
Test(threads, packed_causal_bf16, .timeout = DT_TIMEOUT) {
  dt_threads("threads/packed_causal_bf16",
             &(const dt_shape){.P = 200, .N = 4, .lens = {150, 3, 0, 77}, .hq = 8, .hkv = 2, .d = 32,
                               .mask = FORKATTN_MASK_CAUSAL, .dtype = FORKATTN_DTYPE_BF16, .packed = 1});
}

Test(threads, packed_bidir_f32, .timeout = DT_TIMEOUT) {
  dt_threads("threads/packed_bidir_f32",
             &(const dt_shape){.P = 131, .N = 3, .lens = {64, 129, 1}, .hq = 4, .hkv = 4, .d = 64,
                               .mask = FORKATTN_MASK_BIDIRECTIONAL, .dtype = FORKATTN_DTYPE_F32, .packed = 1});
}

/* ---- StreamKL: backward reruns and thread counts, sparse student --------------- */

/* Teacher 4/2 heads d=32, student 4/1 heads d=16, a GRPO group (prompt 200,
 * responses 150, 0, 77), a kept set (prompt lists per kept head + a block
 * mask), teacher gradients on: dq_s, dk_s, dq_t, dk_t and kl/stats compared
 * bitwise. */
enum { KL_P = 200, KL_T = 427, KL_H = 4 };
typedef struct kl_problem {
  int64_t off[4];
  forkattn_prefix_layout pl;
  forkattn_layout layout;
  int64_t kept_off[3], kept_idx[2 * KL_P];
  unsigned char blocks[2 * 7 * 7];
  forkattn_kept_set kept;
  tc_buf in[4];                 /* q_t k_t q_s k_s */
  forkattn_tensor t[4];
  float dkl[KL_T * KL_H];
} kl_problem;

typedef struct kl_out {
  tc_buf g[4]; /* dq_s dk_s dq_t dk_t */
  forkattn_tensor t[4];
  float kl[KL_T * KL_H], stats[KL_T * KL_H * FORKATTN_KL_STATS];
} kl_out;

static void kl_problem_init(kl_problem *p, tc_rng *rng) {
  const int64_t lens[3] = {150, 0, 77}, heads[4] = {KL_H, 2, KL_H, 1}, dims[4] = {32, 32, 16, 16};
  p->off[0] = 0;
  for (int i = 0; i < 3; i++) p->off[i + 1] = p->off[i] + lens[i];
  p->pl = (forkattn_prefix_layout){KL_P, 3, p->off, FORKATTN_MASK_CAUSAL};
  p->layout = (forkattn_layout){&p->pl, NULL};
  int64_t n = 0;
  p->kept_off[0] = 0;
  for (int h = 0; h < 2; h++) {
    for (int64_t r = 0; r < KL_P; r++)
      if (tc_uniform(rng, 0.0, 1.0) < 0.4) p->kept_idx[n++] = r;
    p->kept_off[h + 1] = n;
  }
  for (int i = 0; i < 2 * 7 * 7; i++) p->blocks[i] = (i % 7 == (i / 7) % 7) || tc_uniform(rng, 0.0, 1.0) < 0.6;
  p->kept = (forkattn_kept_set){2, KL_P, KL_P, p->kept_off, p->kept_idx, p->blocks};
  for (int i = 0; i < 4; i++) {
    p->t[i] = tc_buf_contiguous(&p->in[i], FORKATTN_DTYPE_F32, KL_T, heads[i], dims[i]);
    tc_fill_tensor(rng, &p->t[i], -1.5, 1.5);
  }
  for (int i = 0; i < KL_T * KL_H; i++) p->dkl[i] = (float)tc_uniform(rng, 0.0, 1.0);
}

static void kl_out_init(kl_out *o, const kl_problem *p) {
  for (int i = 0; i < 4; i++) {
    const forkattn_tensor *x = &p->t[i < 2 ? i + 2 : i - 2];
    o->t[i] = tc_buf_contiguous(&o->g[i], FORKATTN_DTYPE_F32, KL_T, x->heads, x->head_dim);
    tc_buf_poison(&o->g[i]);
  }
}

static forkattn_status kl_run(forkattn_ctx *ctx, kl_problem *p, kl_out *o) {
  forkattn_kl_options opt;
  forkattn_kl_options_init(&opt);
  opt.direction = FORKATTN_KL_REVERSE; /* teacher gradients over the full support too */
  for (int i = 0; i < 4; i++) tc_buf_poison(&o->g[i]);
  forkattn_status st = forkattn_kl_fwd(ctx, &p->layout, &p->t[0], &p->t[1], &p->t[2], &p->t[3], &p->kept, &opt,
                                       o->kl, o->stats, NULL, FORKATTN_MEMORY_HOST);
  if (st) return st;
  return forkattn_kl_bwd(ctx, &p->layout, &p->t[0], &p->t[1], &p->t[2], &p->t[3], &p->kept, &opt, o->stats, p->dkl,
                         &o->t[0], &o->t[1], &o->t[2], &o->t[3], FORKATTN_MEMORY_HOST);
}

static void kl_same(const kl_out *a, const kl_out *b, const char *name, int run) {
  static const char *const gn[4] = {"dq_s", "dk_s", "dq_t", "dk_t"};
  cr_assert(memcmp(a->kl, b->kl, sizeof a->kl) == 0 && memcmp(a->stats, b->stats, sizeof a->stats) == 0,
            "%s: run %d: kl/stats differ", name, run);
  for (int i = 0; i < 4; i++)
    cr_assert(memcmp(a->g[i].data, b->g[i].data, a->g[i].elems * 4) == 0, "%s: run %d: %s differs", name, run, gn[i]);
}

Test(streamkl, bwd_1000_and_threads, .timeout = DT_TIMEOUT) {
  const char *name = "streamkl/bwd_1000_and_threads";
  tc_rng rng = tc_rng_for(name);
  kl_problem p;
  kl_problem_init(&p, &rng);
  kl_out ref, cur;
  kl_out_init(&ref, &p);
  kl_out_init(&cur, &p);
  forkattn_ctx *ctx = dt_ctx(0, 0, name);
  cr_assert_eq(kl_run(ctx, &p, &ref), FORKATTN_OK, "%s: %s", name, forkattn_ctx_last_error(ctx));
  for (int i = 0; i < 4; i++) {
    tc_write_check wc = tc_buf_check(&ref.g[i]);
    cr_assert(wc.guard_bad == 0 && wc.unwritten == 0, "%s: gradient %d: %zu guard bytes changed, %zu unwritten", name,
              i, wc.guard_bad, wc.unwritten);
  }
  const int reps = dt_reps();
  for (int it = 0; it < reps; it++) {
    cr_assert_eq(kl_run(ctx, &p, &cur), FORKATTN_OK, "%s: run %d: %s", name, it + 1, forkattn_ctx_last_error(ctx));
    kl_same(&cur, &ref, name, it + 1);
  }
  forkattn_ctx_destroy(ctx);
  const int threads[4] = {1, 2, 3, 5};
  for (int k = 0; k < 4; k++) {
    forkattn_ctx *c = dt_ctx(threads[k], k % 2, name);
    cr_assert_eq(kl_run(c, &p, &cur), FORKATTN_OK, "%s: %d threads: %s", name, threads[k], forkattn_ctx_last_error(c));
    kl_same(&cur, &ref, name, -threads[k]);
    forkattn_ctx_destroy(c);
  }
  fprintf(stderr, "%s: %d StreamKL fwd+bwd runs and threads 1/2/3/5 bitwise identical\n", name, reps);
  for (int i = 0; i < 4; i++) {
    tc_buf_free(&ref.g[i]);
    tc_buf_free(&cur.g[i]);
    tc_buf_free(&p.in[i]);
  }
}
