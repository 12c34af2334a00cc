/* prefix_harness.c - see prefix_harness.h. */
#include "prefix_harness.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

/*
 * Tolerances. Errors are max |got - ref| over a tensor divided by max |ref|
 * of that tensor (lse: absolute).
 *
 * f32 inputs (compute and outputs f32, unit roundoff u = 6e-8):
 *  - o: each output is a convex combination of up to ~2500 value rows
 *    (P = 2048 plus a response), accumulated in f32 with online-softmax
 *    rescaling (every rescale multiplies the accumulator by an f32 exp()).
 *    Tiled summation gives errors of a few u * sqrt(#keys) ~ 1e-6 typically;
 *    the bound 2e-5 leaves a ~10x margin for rescaling and exp() error but
 *    is far below anything a wrong mask or a wrong key would give (~1e-1).
 *  - lse = m + log(l): |lse| <= ~10 here, so f32 rounding is ~1e-6 absolute;
 *    1e-4 absolute.
 *  - gradients: dS = P * (dP - D) subtracts D = rowsum(dO * O) (computed
 *    from the f32 forward output) from dP, losing a few digits to
 *    cancellation, and the prompt's dk/dv accumulate over every query row of
 *    the prompt and of all N responses (thousands of terms): 1e-4.
 * bf16 / f16 inputs: the reference runs on the same rounded inputs, so only
 * compute and output rounding count. Outputs are stored in 16 bits (bf16:
 * 2^-8 = 3.9e-3 relative spacing, rounding error up to 2^-9; f16: 2^-11), and
 * a tensor-core path may also round P (forward) and dS (backward) to 16 bits
 * before their products: 1e-2 relative. lse stays an f32 output but scores
 * may be accumulated from 16-bit products in a different order: 1e-3 absolute.
 */
ph_tol ph_default_tol(forkattn_dtype dtype) {
  ph_tol t;
  if (dtype == FORKATTN_DTYPE_F32) {
    t.o_rel = 2e-5;
    t.lse_abs = 1e-4;
    t.grad_rel = 1e-4;
  } else {
    t.o_rel = 1e-2;
    t.lse_abs = 1e-3;
    t.grad_rel = 1e-2;
  }
  return t;
}

void ph_describe(const ph_case *c, char *buf, size_t size) {
  int64_t total = 0, mn = INT64_MAX, mx = 0, zeros = 0;
  for (int64_t i = 0; i < c->N; i++) {
    total += c->lens[i];
    mn = c->lens[i] < mn ? c->lens[i] : mn;
    mx = c->lens[i] > mx ? c->lens[i] : mx;
    zeros += c->lens[i] == 0;
  }
  if (c->N == 0)
    mn = 0;
  snprintf(buf, size,
           "P=%" PRId64 " N=%" PRId64 " R[sum=%" PRId64 " min=%" PRId64 " max=%" PRId64
           " zeros=%" PRId64 "] heads=%" PRId64 "/%" PRId64 " d=%" PRId64 " %s %s",
           c->P, c->N, total, mn, mx, zeros, c->hq, c->hkv, c->d,
           c->mask == FORKATTN_MASK_CAUSAL ? "causal" : "bidirectional",
           ref_dtype_name(c->dtype));
}

static double *alloc_doubles(int64_t n) {
  double *p = malloc((size_t)(n + 1) * sizeof *p); /* +1: n may be 0 */
  cr_assert(p, "out of memory (%" PRId64 " doubles)", n);
  return p;
}

/* q, k, v, dout of in->T rows, rounded to the dtype. */
static void draw_tensors(ph_inputs *in, double q_amp, int zero_q, tc_rng *rng) {
  const double qa = q_amp > 0 ? q_amp : 4.0;
  const int64_t nq = in->T * in->hq * in->d, nk = in->T * in->hkv * in->d;
  in->q = alloc_doubles(nq);
  in->k = alloc_doubles(nk);
  in->v = alloc_doubles(nk);
  in->dout = alloc_doubles(nq);
  /* Scores q.k * scale have std ~ q_amp/3 (1.3 by default): peaked enough
   * that a wrong max or a wrong key shows, flat enough to mix many keys. */
  for (int64_t i = 0; i < nq; i++)
    in->q[i] = zero_q ? 0.0 : ref_round_to_dtype(tc_uniform(rng, -qa, qa), in->dtype);
  for (int64_t i = 0; i < nk; i++) {
    in->k[i] = ref_round_to_dtype(tc_uniform(rng, -1.0, 1.0), in->dtype);
    in->v[i] = ref_round_to_dtype(tc_uniform(rng, -1.0, 1.0), in->dtype);
  }
  for (int64_t i = 0; i < nq; i++)
    in->dout[i] = ref_round_to_dtype(tc_uniform(rng, -1.0, 1.0), in->dtype);
}

void ph_make_inputs(ph_inputs *in, const ph_case *c, tc_rng *rng) {
  memset(in, 0, sizeof *in);
  cr_assert(c->N >= 0 && c->N <= PH_MAX_RESPONSES);
  in->off[0] = 0;
  for (int64_t i = 0; i < c->N; i++)
    in->off[i + 1] = in->off[i] + c->lens[i];
  in->layout.prompt_len = c->P;
  in->layout.num_responses = c->N;
  in->layout.response_offsets = c->N > 0 ? in->off : NULL;
  in->layout.mask = c->mask;
  in->T = ref_prefix_rows(&in->layout);
  cr_assert(in->T >= 0);
  in->hq = c->hq;
  in->hkv = c->hkv;
  in->d = c->d;
  in->dtype = c->dtype;
  in->scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)c->d);
  draw_tensors(in, c->q_amp, c->zero_q, rng);
}

void ph_make_tree_inputs(ph_inputs *in, const forkattn_tree_layout *tree, int64_t hq, int64_t hkv,
                         int64_t d, forkattn_dtype dtype, double q_amp, tc_rng *rng) {
  memset(in, 0, sizeof *in);
  in->tree = tree;
  in->T = tree->num_nodes ? tree->node_offsets[tree->num_nodes] : 0;
  in->hq = hq;
  in->hkv = hkv;
  in->d = d;
  in->dtype = dtype;
  in->scale = 1.0 / sqrt((double)d);
  draw_tensors(in, q_amp, 0, rng);
}

void ph_free_inputs(ph_inputs *in) {
  free(in->q);
  free(in->k);
  free(in->v);
  free(in->dout);
  memset(in, 0, sizeof *in);
}

void ph_free_outputs(ph_outputs *o) {
  free(o->o);
  free(o->lse);
  free(o->dq);
  free(o->dk);
  free(o->dv);
  memset(o, 0, sizeof *o);
}

void ph_reference(ph_outputs *ref, const ph_inputs *in) {
  const int64_t nq = in->T * in->hq * in->d, nk = in->T * in->hkv * in->d;
  ref->o = alloc_doubles(nq);
  ref->lse = alloc_doubles(in->T * in->hq);
  ref->dq = alloc_doubles(nq);
  ref->dk = alloc_doubles(nk);
  ref->dv = alloc_doubles(nk);
  ref_prefix_out out = {ref->o, ref->lse, ref->dq, ref->dk, ref->dv};
  const double t0 = tc_now();
  if (in->tree) {
    ref_tree_args a = {in->tree, in->hq, in->hkv, in->d, in->scale, in->q, in->k, in->v, in->dout};
    cr_assert_eq(ref_tree(&a, &out), 0, "tree reference failed");
  } else {
    ref_prefix_args a = {&in->layout, in->hq, in->hkv, in->d, in->scale,
                         in->q,       in->k,  in->v,   in->dout};
    cr_assert_eq(ref_prefix(&a, &out), 0, "reference failed");
  }
  fprintf(stderr, "[time] float64 reference fwd+bwd: %.3f s\n", tc_now() - t0);
}

/* ---- layouts -------------------------------------------------------------- */

typedef struct lay_bufs {
  tc_buf in[4];  /* q k v dout (q holds k and v too when packed) */
  tc_buf out[5]; /* o lse dq dk dv (dq holds dk and dv too when packed) */
  forkattn_tensor q, k, v, dout, o, dq, dk, dv;
  float *lse;
} lay_bufs;

/* A padded [T, H, d] view: gaps between heads and between rows. */
static forkattn_tensor padded(tc_buf *b, forkattn_dtype dt, int64_t T, int64_t H, int64_t d) {
  const int64_t hs = d + 3, rs = H * hs + 5;
  cr_assert_eq(tc_buf_alloc(b, (size_t)(T * rs + 8), dt), 0);
  return tc_buf_view(b, 2, T, H, d, rs, hs);
}

/* A head-major [H][T][d] view with padding: row_stride < heads * head_dim. */
static forkattn_tensor head_major(tc_buf *b, forkattn_dtype dt, int64_t T, int64_t H,
                                  int64_t d) {
  const int64_t rs = d + 2, hs = T * rs + 7;
  cr_assert_eq(tc_buf_alloc(b, (size_t)(H * hs + 4), dt), 0);
  return tc_buf_view(b, 1, T, H, d, rs, hs);
}

static void make_layout(lay_bufs *L, const ph_inputs *in, ph_layout lay, int do_bwd) {
  memset(L, 0, sizeof *L);
  const int64_t T = in->T, hq = in->hq, hkv = in->hkv, d = in->d;
  const forkattn_dtype dt = in->dtype;
  switch (lay) {
  case PH_CONTIGUOUS:
    L->q = tc_buf_contiguous(&L->in[0], dt, T, hq, d);
    L->k = tc_buf_contiguous(&L->in[1], dt, T, hkv, d);
    L->v = tc_buf_contiguous(&L->in[2], dt, T, hkv, d);
    L->dout = tc_buf_contiguous(&L->in[3], dt, T, hq, d);
    L->o = tc_buf_contiguous(&L->out[0], dt, T, hq, d);
    if (do_bwd) {
      L->dq = tc_buf_contiguous(&L->out[2], dt, T, hq, d);
      L->dk = tc_buf_contiguous(&L->out[3], dt, T, hkv, d);
      L->dv = tc_buf_contiguous(&L->out[4], dt, T, hkv, d);
    }
    break;
  case PH_QKV_PACKED: {
    const int64_t W = (hq + 2 * hkv) * d;
    cr_assert_eq(tc_buf_alloc(&L->in[0], (size_t)(T * W), dt), 0);
    L->q = tc_buf_view(&L->in[0], 0, T, hq, d, W, d);
    L->k = tc_buf_view(&L->in[0], hq * d, T, hkv, d, W, d);
    L->v = tc_buf_view(&L->in[0], (hq + hkv) * d, T, hkv, d, W, d);
    L->dout = tc_buf_contiguous(&L->in[3], dt, T, hq, d);
    L->o = tc_buf_contiguous(&L->out[0], dt, T, hq, d);
    if (do_bwd) {
      cr_assert_eq(tc_buf_alloc(&L->out[2], (size_t)(T * W), dt), 0);
      L->dq = tc_buf_view(&L->out[2], 0, T, hq, d, W, d);
      L->dk = tc_buf_view(&L->out[2], hq * d, T, hkv, d, W, d);
      L->dv = tc_buf_view(&L->out[2], (hq + hkv) * d, T, hkv, d, W, d);
    }
    break;
  }
  case PH_STRIDED:
    L->q = padded(&L->in[0], dt, T, hq, d);
    L->k = head_major(&L->in[1], dt, T, hkv, d);
    L->v = padded(&L->in[2], dt, T, hkv, d);
    L->dout = head_major(&L->in[3], dt, T, hq, d);
    L->o = head_major(&L->out[0], dt, T, hq, d);
    if (do_bwd) {
      L->dq = head_major(&L->out[2], dt, T, hq, d);
      L->dk = padded(&L->out[3], dt, T, hkv, d);
      L->dv = head_major(&L->out[4], dt, T, hkv, d);
    }
    break;
  }
  L->lse = tc_buf_f32(&L->out[1], T * hq);
  cr_assert(L->lse);
  ref_tensor_write(&L->q, in->q);
  ref_tensor_write(&L->k, in->k);
  ref_tensor_write(&L->v, in->v);
  ref_tensor_write(&L->dout, in->dout);
}

static void free_layout(lay_bufs *L) {
  for (int i = 0; i < 4; i++)
    if (L->in[i].alloc)
      tc_buf_free(&L->in[i]);
  for (int i = 0; i < 5; i++)
    if (L->out[i].alloc)
      tc_buf_free(&L->out[i]);
}

static void snapshot_all(tc_buf *b, int n) {
  for (int i = 0; i < n; i++)
    if (b[i].alloc)
      tc_buf_snapshot(&b[i]);
}

static void expect_unchanged(const tc_buf *b, int n, const char *label, const char *when,
                             const char *const *names) {
  for (int i = 0; i < n; i++)
    if (b[i].alloc) {
      size_t changed = tc_buf_changed_bytes(&b[i]);
      cr_expect_eq(changed, 0, "%s: %s modified %zu bytes of input buffer %s", label, when,
                   changed, names[i]);
    }
}

static void expect_written(const tc_buf *b, const char *label, const char *what) {
  tc_write_check c = tc_buf_check(b);
  cr_expect_eq(c.guard_bad, 0,
               "%s: %s: %zu guard/gap bytes overwritten (first at byte %zu of the allocation, "
               "guard is %d bytes)",
               label, what, c.guard_bad, c.first_guard, TC_GUARD_BYTES);
  cr_expect_eq(c.unwritten, 0, "%s: %s: %zu elements never written (first: element %zu)", label,
               what, c.unwritten, c.first_unwritten);
}

static double *tensor_to_doubles(const forkattn_tensor *t) {
  double *p = alloc_doubles(t->rows * t->heads * t->head_dim);
  ref_tensor_read(t, p);
  return p;
}

void ph_run(ph_outputs *got, const ph_inputs *in, ph_layout lay, int do_bwd, forkattn_ctx *ctx,
            const char *label) {
  static const char *const in_names[4] = {"q(/qkv)", "k", "v", "dout"};
  static const char *const out_names[5] = {"o", "lse", "dq(/dqkv)", "dk", "dv"};
  memset(got, 0, sizeof *got);
  lay_bufs L;
  make_layout(&L, in, lay, do_bwd);
  snapshot_all(L.in, 4);
  tc_buf_poison(&L.out[0]);
  tc_buf_poison(&L.out[1]);

  double t0 = tc_now();
  forkattn_status st =
      in->tree ? forkattn_tree_fwd(ctx, in->tree, &L.q, &L.k, &L.v, &L.o, L.lse, (float)in->scale,
                                   FORKATTN_MEMORY_HOST)
               : forkattn_prefix_fwd(ctx, &in->layout, &L.q, &L.k, &L.v, &L.o, L.lse,
                                     (float)in->scale, FORKATTN_MEMORY_HOST);
  const double t_fwd = tc_now() - t0;
  cr_assert_eq(st, FORKATTN_OK, "%s: forward returned %d (%s): %s", label, (int)st,
               forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  expect_unchanged(L.in, 4, label, "forward", in_names);
  expect_written(&L.out[0], label, "forward o");
  expect_written(&L.out[1], label, "forward lse");
  const int64_t bad_o = tc_count_nonfinite_tensor(&L.o);
  const int64_t bad_lse = tc_count_nonfinite_f32(L.lse, in->T * in->hq);
  cr_expect_eq(bad_o, 0, "%s: o has %" PRId64 " NaN/inf elements", label, bad_o);
  cr_expect_eq(bad_lse, 0,
               "%s: lse has %" PRId64 " non-finite entries (no row is fully masked)", label,
               bad_lse);
  got->o = tensor_to_doubles(&L.o);
  got->lse = alloc_doubles(in->T * in->hq);
  for (int64_t i = 0; i < in->T * in->hq; i++)
    got->lse[i] = (double)L.lse[i];

  double t_bwd = 0.0;
  if (do_bwd) {
    /* o and lse are inputs of the backward: they must not change either. */
    tc_buf_snapshot(&L.out[0]);
    tc_buf_snapshot(&L.out[1]);
    for (int i = 2; i < 5; i++)
      if (L.out[i].alloc)
        tc_buf_poison(&L.out[i]);
    t0 = tc_now();
    st = in->tree ? forkattn_tree_bwd(ctx, in->tree, &L.q, &L.k, &L.v, &L.o, &L.dout, L.lse, &L.dq,
                                      &L.dk, &L.dv, (float)in->scale, FORKATTN_MEMORY_HOST)
                  : forkattn_prefix_bwd(ctx, &in->layout, &L.q, &L.k, &L.v, &L.o, &L.dout, L.lse,
                                        &L.dq, &L.dk, &L.dv, (float)in->scale, FORKATTN_MEMORY_HOST);
    t_bwd = tc_now() - t0;
    cr_assert_eq(st, FORKATTN_OK, "%s: backward returned %d (%s): %s", label, (int)st,
                 forkattn_status_string(st), forkattn_ctx_last_error(ctx));
    expect_unchanged(L.in, 4, label, "backward", in_names);
    expect_unchanged(L.out, 2, label, "backward", out_names);
    for (int i = 2; i < 5; i++)
      if (L.out[i].alloc)
        expect_written(&L.out[i], label, out_names[i]);
    const forkattn_tensor *g[3] = {&L.dq, &L.dk, &L.dv};
    for (int i = 0; i < 3; i++) {
      const int64_t bad = tc_count_nonfinite_tensor(g[i]);
      cr_expect_eq(bad, 0, "%s: %s has %" PRId64 " NaN/inf elements", label, out_names[2 + i],
                   bad);
    }
    got->dq = tensor_to_doubles(&L.dq);
    got->dk = tensor_to_doubles(&L.dk);
    got->dv = tensor_to_doubles(&L.dv);
  }
  fprintf(stderr, "[time] %s: library fwd %.4f s, bwd %.4f s\n", label, t_fwd, t_bwd);
  free_layout(&L);
}

static void check_one(const char *label, const char *name, const double *got, const double *want,
                      int64_t n, int64_t heads, int64_t d, double tol, int relative) {
  if (!got || !want)
    return;
  tc_err e = tc_compare_f64(got, want, n);
  char line[320];
  tc_err_format(line, sizeof line, name, &e, heads, d);
  const double metric = relative ? e.rel : e.max_abs;
  const int ok = e.nonfinite == 0 && metric <= tol;
  fprintf(stderr, "  %s %s  [%s %.1e] %s\n", ok ? "ok  " : "FAIL", line,
          relative ? "rel <=" : "abs <=", tol, label);
  cr_expect(ok, "%s: %s %s error %.3e exceeds %.1e (%s)", label, name,
            relative ? "relative" : "absolute", metric, tol, line);
}

void ph_check(const ph_outputs *got, const ph_outputs *ref, const ph_inputs *in, ph_tol tol,
              const char *label) {
  const ph_tol def = ph_default_tol(in->dtype);
  if (tol.o_rel <= 0)
    tol.o_rel = def.o_rel;
  if (tol.lse_abs <= 0)
    tol.lse_abs = def.lse_abs;
  if (tol.grad_rel <= 0)
    tol.grad_rel = def.grad_rel;
  const int64_t nq = in->T * in->hq * in->d, nk = in->T * in->hkv * in->d;
  check_one(label, "o", got->o, ref->o, nq, in->hq, in->d, tol.o_rel, 1);
  check_one(label, "lse", got->lse, ref->lse, in->T * in->hq, in->hq, 1, tol.lse_abs, 0);
  check_one(label, "dq", got->dq, ref->dq, nq, in->hq, in->d, tol.grad_rel, 1);
  check_one(label, "dk", got->dk, ref->dk, nk, in->hkv, in->d, tol.grad_rel, 1);
  check_one(label, "dv", got->dv, ref->dv, nk, in->hkv, in->d, tol.grad_rel, 1);
}

void ph_run_case(const char *name, const ph_case *c, ph_tol tol) {
  char desc[256];
  ph_describe(c, desc, sizeof desc);
  fprintf(stderr, "[case] %s: %s\n", name, desc);
  tc_rng rng = tc_rng_for(name);
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert(ctx, "%s: cannot create a context", name);
  ph_inputs in;
  ph_make_inputs(&in, c, &rng);
  ph_outputs ref, got;
  ph_reference(&ref, &in);
  ph_run(&got, &in, PH_CONTIGUOUS, 1, ctx, name);
  ph_check(&got, &ref, &in, tol, name);
  ph_free_outputs(&got);
  ph_free_outputs(&ref);
  ph_free_inputs(&in);
  forkattn_ctx_destroy(ctx);
}
