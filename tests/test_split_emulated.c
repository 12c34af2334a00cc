/* f32 inputs on the tensor cores: the split into bf16 pieces
 * (lib/core/split_bf16.h) and the mma.sync forward team that multiplies the
 * pieces (offload/gpu_fwd_teams.h, fa_mma_fwd_team_f32_high / _medium), run
 * on the host under the SIMT emulation of offload/gpu_mma.h (as
 * test_mma_emulated), against the float64 reference of the f32 inputs.
 * HIGH precision is held to the f32 tolerances of the attention tests
 * (tests/prefix_harness.c: o 2e-5 relative, lse 1e-4; large logits 1e-4 and
 * 1e-3, tests/test_prefix.c), MEDIUM to its documented bound
 * (docs/numerics.md "f32 on tensor cores"). The StreamKL forward team
 * (offload/gpu_mma_kl_team.h, fa_mma_kl_fwd_team_f32_high / _medium) the
 * same way, against tests/reference_kl.c with the StreamKL tests' f32
 * tolerance. Every output element starts poisoned. [ran on host: emulation; the kernel runs on the GPU in
 * test_prefix_device's f32 cases] Clang only (the host side of ompx.h). */
#define FORKATTN_MMA_EMULATE 1

#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_dkv_teams.h"
#include "gpu_dq_teams.h"
#include "gpu_fwd_teams.h"
#include "gpu_mma_kl_bwd_team.h"
#include "gpu_mma_kl_team.h"
#include "reference_kl.h"
#include "reference.h"
#include "segment_plan.h"
#include "split_bf16.h"
#include "emulation.h"
#include "test_common.h"

/* ---- the split itself ------------------------------------------------------ */

static double piece_sum(const uint16_t *p, int np) {
  double s = 0;
  for (int i = 0; i < np; i++) s += fa_bf16_to_f32(p[i]);
  return s;
}

Test(split_bf16, pieces_sum_to_the_value_within_their_bounds) {
  tc_rng rng = tc_rng_for("split_bf16/bounds");
  double worst[4] = {0, 0, 0, 0};
  for (int i = 0; i < 200000; i++) {
    /* magnitudes 2^-100 .. 2^100 (every piece a normal bf16), both signs */
    const double m = tc_uniform(&rng, 0.5, 1.0) * (tc_uniform(&rng, 0, 1) < 0.5 ? -1 : 1);
    const float x = (float)ldexp(m, (int)tc_uniform(&rng, -100, 100));
    for (int np = 1; np <= FA_SPLIT_MAX; np++) {
      uint16_t p[FA_SPLIT_MAX];
      fa_split_bf16(x, np, p, 1);
      const double err = x ? fabs(piece_sum(p, np) - x) / fabs(x) : fabs(piece_sum(p, np));
      worst[np] = fmax(worst[np], err);
      /* each piece is the bf16 nearest what the pieces before it leave */
      double rest = x;
      for (int k = 0; k < np; k++) {
        cr_assert_eq(p[k], fa_f32_to_bf16((float)rest), "x=%a piece %d", x, k);
        rest -= fa_bf16_to_f32(p[k]);
      }
    }
  }
  cr_log_info("relative error of 1, 2, 3 pieces: %.3g %.3g %.3g", worst[1], worst[2], worst[3]);
  cr_expect_leq(worst[1], ldexp(1, -8), "one piece: %g", worst[1]);
  cr_expect_leq(worst[2], ldexp(1, -16), "two pieces: %g", worst[2]);
  cr_expect_leq(worst[3], ldexp(1, -24), "three pieces: %g", worst[3]);
  cr_expect_gt(worst[2], ldexp(1, -18), "the bounds are nearly attained");
  cr_expect_gt(worst[1], ldexp(1, -10), "the bounds are nearly attained");
}

Test(split_bf16, non_finite_values_stay_in_piece_zero) {
  const float xs[] = {INFINITY, -INFINITY, NAN, FLT_MAX, -FLT_MAX, 0.0f, -0.0f};
  for (size_t i = 0; i < sizeof xs / sizeof *xs; i++) {
    uint16_t p[3] = {0x1234, 0x1234, 0x1234};
    fa_split_bf16(xs[i], 3, p, 1);
    const float p0 = fa_bf16_to_f32(p[0]);
    if (isnan(xs[i])) cr_expect(isnan(p0), "NaN stays NaN");
    else if (isinf(xs[i]) || fabsf(xs[i]) == FLT_MAX) cr_expect(isinf(p0) && signbit(p0) == signbit(xs[i]), "%a", xs[i]);
    else cr_expect(p0 == 0.0f && signbit(p0) == signbit(xs[i]), "zero keeps its sign");
    cr_expect(p[1] == 0 && p[2] == 0, "x=%a: pieces 1, 2 are %#x %#x", xs[i], p[1], p[2]);
  }
  uint16_t strided[7] = {0};
  fa_split_bf16(1.0f + ldexp(1.0f, -12), 3, strided, 3); /* pieces 3 apart */
  cr_expect(fa_bf16_to_f32(strided[0]) == 1.0f && fa_bf16_to_f32(strided[3]) == ldexpf(1.0f, -12) && strided[6] == 0);
  cr_expect(strided[1] == 0 && strided[2] == 0 && strided[4] == 0 && strided[5] == 0, "nothing between the pieces");
}

/* ---- the forward team ---------------------------------------------------- */

typedef struct split_case {
  int64_t P, N, lens[4];                           /* prefix layout, or a tree when nodes > 0 */
  int64_t nodes, node_len[6], parents[6];
  int causal, hq, hkv, d;
  double scale;       /* 0: 1/sqrt(d) */
  double o_tol, lse_tol; /* HIGH's; MEDIUM's are the documented bound */
  int64_t nan_v_row;  /* >= 0: V of this row (KV head 0, column 0) is NaN */
} split_case;

/* The case's plan; off[] receives the layout's offsets. Returns T. */
static int64_t case_plan(const split_case *c, fa_plan *plan, int64_t *off) {
  off[0] = 0;
  if (c->nodes) {
    for (int64_t i = 0; i < c->nodes; i++) off[i + 1] = off[i] + c->node_len[i];
    cr_assert_eq(fa_plan_tree(plan, c->nodes, off, c->parents, c->causal), 0);
    return off[c->nodes];
  }
  return emu_prefix_plan(plan, c->P, c->N, c->lens, c->causal, off);
}

/* x[n] f32 as np planes of n bf16 pieces. */
static uint16_t *split_all(const float *x, int64_t n, int np) {
  uint16_t *p = malloc(sizeof(uint16_t) * (size_t)(n * np));
  cr_assert(p);
  for (int64_t i = 0; i < n; i++) fa_split_bf16(x[i], np, p + i, n);
  return p;
}

/* Run the split forward at precision qk pieces (3 HIGH, 2 MEDIUM); errors of o (relative to its largest
 * reference value) and lse (absolute) against the float64 reference, or, with a NaN V row, check that
 * exactly the rows that see it are NaN. */
static void split_run(const char *name, const split_case *c, int qk, double o_tol, double lse_tol) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  const int64_t hq = c->hq, hkv = c->hkv, d = c->d, group = hq / hkv;
  fa_plan plan;
  int64_t off[8];
  const int64_t T = case_plan(c, &plan, off), nq = T * hq * d, nk = T * hkv * d;
  float *q = malloc(sizeof(float) * (size_t)nq), *k = malloc(sizeof(float) * (size_t)nk),
        *v = malloc(sizeof(float) * (size_t)nk), *o = malloc(sizeof(float) * (size_t)nq),
        *lse = malloc(sizeof(float) * (size_t)(T * hq));
  double *rq = malloc(sizeof(double) * (size_t)nq), *rk = malloc(sizeof(double) * (size_t)nk),
         *rv = malloc(sizeof(double) * (size_t)nk), *ro = malloc(sizeof(double) * (size_t)nq),
         *rlse = malloc(sizeof(double) * (size_t)(T * hq));
  /* the attention tests' f32 inputs (prefix_harness.c): q in [-4, 4], k and v in [-1, 1] */
  for (int64_t i = 0; i < nq; i++) rq[i] = q[i] = (float)tc_uniform(&rng, -4, 4);
  for (int64_t i = 0; i < nk; i++) rk[i] = k[i] = (float)tc_uniform(&rng, -1, 1);
  for (int64_t i = 0; i < nk; i++) rv[i] = v[i] = (float)tc_uniform(&rng, -1, 1);
  const double scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)d);
  const ref_prefix_out out = {ro, rlse, NULL, NULL, NULL};
  if (c->nodes) {
    const forkattn_tree_layout tree = {c->nodes, off, c->parents};
    const ref_tree_args ra = {&tree, hq, hkv, d, scale, rq, rk, rv, NULL};
    cr_assert_eq(ref_tree(&ra, &out), 0);
  } else {
    const forkattn_prefix_layout lay = {c->P, c->N, off, c->causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL};
    const ref_prefix_args ra = {&lay, hq, hkv, d, scale, rq, rk, rv, NULL};
    cr_assert_eq(ref_prefix(&ra, &out), 0);
  }
  if (c->nan_v_row >= 0) v[c->nan_v_row * hkv * d] = NAN;
  uint16_t *pq = split_all(q, nq, qk), *pk = split_all(k, nk, qk), *pv = split_all(v, nk, qk);

  fa_block *qb;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb);
  cr_assert(nqb > 0);
  const fa_gpu_fwd_args ga = {emu_view(pq, FORKATTN_DTYPE_BF16, hq, d), emu_view(pk, FORKATTN_DTYPE_BF16, hkv, d),
                              emu_view(pv, FORKATTN_DTYPE_BF16, hkv, d), emu_view(o, FORKATTN_DTYPE_F32, hq, d),
                              lse, plan.seg, plan.pair, plan.q_pair_off, qb, nqb, hq, hkv, d, plan.qshift,
                              (float)scale, {0}, 0, 0, NULL, 0, NULL, qk, qk, {nq, nk, nk}, NULL, NULL, 0, 0};
  static unsigned short smem[FA_MMA_FWD_SMEM(128, 3, 3) / 2 + FA_MMA_FWD_SMEM(64, 3, 3) / 2];
  cr_assert_geq(sizeof smem, FA_MMA_FWD_SMEM(d, qk, qk));
  for (int64_t i = 0; i < nq; i++) o[i] = NAN; /* poison */
  for (int64_t i = 0; i < T * hq; i++) lse[i] = NAN;
  const int bk = FA_MMA_SPLIT_BK(d);
  if (qk == 3)
    EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq, fa_mma_fwd_team_f32_high((int)d, bk, 0, ga, qb[blk], h, h / group, smem));
  else
    EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq,
                    fa_mma_fwd_team_f32_medium((int)d, bk, 0, ga, qb[blk], h, h / group, smem));

  if (c->nan_v_row < 0) {
    double eo = 0, mo = 0, el = 0;
    int64_t nonfinite = 0;
    for (int64_t i = 0; i < nq; i++) {
      nonfinite += !isfinite(o[i]);
      eo = fmax(eo, fabs(o[i] - ro[i]));
      mo = fmax(mo, fabs(ro[i]));
    }
    for (int64_t i = 0; i < T * hq; i++) {
      nonfinite += !isfinite(lse[i]);
      el = fmax(el, fabs(lse[i] - rlse[i]));
    }
    eo /= mo > 0 ? mo : 1;
    cr_log_info("%s, %s: o %.3g (limit %.1g), lse %.3g (limit %.1g)", name, qk == 3 ? "HIGH" : "MEDIUM", eo, o_tol,
                el, lse_tol);
    cr_expect_eq(nonfinite, 0, "%s: %lld non-finite (or unwritten) outputs", name, (long long)nonfinite);
    cr_expect_leq(eo, o_tol, "%s qk pieces %d: o relative error %.3g", name, qk, eo);
    cr_expect_leq(el, lse_tol, "%s qk pieces %d: lse error %.3g", name, qk, el);
  } else { /* the rows that see the NaN key are NaN, all others match the reference */
    for (int64_t r = 0; r < T; r++)
      for (int64_t h = 0; h < group; h++) { /* query heads of KV head 0 */
        const int sees = !c->causal || r >= c->nan_v_row; /* a prefix case, the NaN row in the prompt */
        const double g = o[(r * hq + h) * d], want = ro[(r * hq + h) * d];
        if (sees) cr_expect(isnan(g), "%s: o[%lld, %lld] should be NaN", name, (long long)r, (long long)h);
        else cr_expect(fabs(g - want) <= o_tol, "%s: o[%lld, %lld] = %g, want %g", name, (long long)r, (long long)h, g, want);
      }
  }
  free(qb);
  free(pq), free(pk), free(pv);
  free(q), free(k), free(v), free(o), free(lse), free(rq), free(rk), free(rv), free(ro), free(rlse);
  fa_plan_free(&plan);
}

/* MEDIUM's documented bound (docs/numerics.md): 8x HIGH's limits. */
#define SPLIT_CASE(tname, ...)                                                                                  \
  Test(split_emulated, tname, .timeout = 600) {                                                                \
    const split_case c = {__VA_ARGS__};                                                                         \
    split_run("split_emulated/" #tname, &c, 3, c.o_tol, c.lse_tol);                                            \
    split_run("split_emulated/" #tname, &c, 2, 8 * c.o_tol, 8 * c.lse_tol);                                    \
  }

/* A GRPO group, GQA 4/2, 64-key tiles; the prompt's block crosses the diagonal. */
SPLIT_CASE(prefix_causal_d64, .P = 70, .N = 3, .lens = {40, 1, 23}, .causal = 1, .hq = 4, .hkv = 2, .d = 64,
           .o_tol = 2e-5, .lse_tol = 1e-4, .nan_v_row = -1)
/* head_dim 128 (32-key tiles: Q's three pieces span both buffers), bidirectional */
SPLIT_CASE(prefix_bidir_d128, .P = 90, .N = 2, .lens = {30, 17}, .causal = 0, .hq = 2, .hkv = 1, .d = 128,
           .o_tol = 2e-5, .lse_tol = 1e-4, .nan_v_row = -1)
/* a trie at head_dim 128 */
SPLIT_CASE(tree_causal_d128, .nodes = 6, .node_len = {70, 20, 0, 17, 40, 5}, .parents = {-1, 0, 1, 1, 0, 4},
           .causal = 1, .hq = 2, .hkv = 1, .d = 128, .o_tol = 2e-5, .lse_tol = 1e-4, .nan_v_row = -1)
/* large logits (tests/test_prefix.c numerics/large_logits_f32: scale 4, d 64, scores ~40, maxima > 100) */
SPLIT_CASE(large_logits_d64, .P = 113, .N = 2, .lens = {57, 29}, .causal = 1, .hq = 2, .hkv = 1, .d = 64,
           .scale = 4.0, .o_tol = 1e-4, .lse_tol = 1e-3, .nan_v_row = -1)
/* a NaN value row in the prompt's diagonal tile reaches exactly the rows that see it */
SPLIT_CASE(prefix_causal_nan_v_d64, .P = 70, .N = 1, .lens = {10}, .causal = 1, .hq = 2, .hkv = 1, .d = 64,
           .o_tol = 2e-5, .lse_tol = 1e-4, .nan_v_row = 37)
/* head_dim 128 (16-key tiles, the scan of a 16-row V tile): a NaN value row in the prompt's diagonal tile */
SPLIT_CASE(prefix_causal_nan_v_d128, .P = 40, .N = 1, .lens = {10}, .causal = 1, .hq = 2, .hkv = 1, .d = 128,
           .o_tol = 2e-5, .lse_tol = 1e-4, .nan_v_row = 21)

/* ---- the backward teams ------------------------------------------------------ */

/* The largest |got - ref| over n elements relative to the largest |ref|; non-finite (or unwritten) ones
 * counted in *nonfinite. */
static double split_rel_err(const float *got, const double *ref, int64_t n, int64_t *nonfinite) {
  double e = 0, m = 0;
  for (int64_t i = 0; i < n; i++) {
    *nonfinite += !isfinite(got[i]);
    e = fmax(e, fabs(got[i] - ref[i]));
    m = fmax(m, fabs(ref[i]));
  }
  return e / (m > 0 ? m : 1);
}

/* The split backward at np pieces: the split forward team's o and lse, D = rowsum(dO * O) in f32 (as
 * the GPU's rowsum kernel before the launch), then the split dQ teams and the split dK/dV teams over key
 * units of 48 reader rows (several a block: partial sums and their in-order reduce), against the float64
 * gradients; every gradient starts poisoned. */
static void split_bwd_run(const char *name, const split_case *c, int np, double grad_tol) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  const int64_t hq = c->hq, hkv = c->hkv, d = c->d, group = hq / hkv;
  fa_plan plan;
  int64_t off[8];
  const int64_t T = case_plan(c, &plan, off), nq = T * hq * d, nk = T * hkv * d;
  float *x[9];
  const int64_t sizes[9] = {nq, nk, nk, nq, nq, nq, nk, nk, T * hq}; /* q k v dout o dq dk dv lse */
  for (int i = 0; i < 9; i++) cr_assert(x[i] = malloc(sizeof(float) * (size_t)sizes[i]));
  float *q = x[0], *k = x[1], *v = x[2], *dout = x[3], *o = x[4], *dq = x[5], *dk = x[6], *dv = x[7], *lse = x[8];
  double *r[9];
  for (int i = 0; i < 9; i++) cr_assert(r[i] = malloc(sizeof(double) * (size_t)sizes[i]));
  for (int i = 0; i < 4; i++) /* q in [-4, 4], k, v, dout in [-1, 1] */
    for (int64_t e = 0; e < sizes[i]; e++) r[i][e] = x[i][e] = (float)tc_uniform(&rng, i ? -1 : -4, i ? 1 : 4);
  const double scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)d);
  const ref_prefix_out out = {r[4], r[8], r[5], r[6], r[7]};
  if (c->nodes) {
    const forkattn_tree_layout tree = {c->nodes, off, c->parents};
    const ref_tree_args ra = {&tree, hq, hkv, d, scale, r[0], r[1], r[2], r[3]};
    cr_assert_eq(ref_tree(&ra, &out), 0);
  } else {
    const forkattn_prefix_layout lay = {c->P, c->N, off, c->causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL};
    const ref_prefix_args ra = {&lay, hq, hkv, d, scale, r[0], r[1], r[2], r[3]};
    cr_assert_eq(ref_prefix(&ra, &out), 0);
  }
  uint16_t *pq = split_all(q, nq, np), *pk = split_all(k, nk, np), *pv = split_all(v, nk, np),
           *pdo = split_all(dout, nq, np);
  fa_block *qb, *kb;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb), nkb = fa_plan_blocks(&plan, FA_MMA_ROWS, 1, &kb);
  cr_assert(nqb > 0 && nkb > 0);
  static _Alignas(16) unsigned short
      smem[(FA_MMA_DQ_SPLIT_SMEM(128, 3) > FA_MMA_DKV_SPLIT_SMEM(128, 3) ? FA_MMA_DQ_SPLIT_SMEM(128, 3)
                                                                             : FA_MMA_DKV_SPLIT_SMEM(128, 3)) / 2];
  cr_assert_geq(sizeof smem, FA_MMA_FWD_SMEM(d, np, np));
  cr_assert_geq(sizeof smem, FA_MMA_DQ_SPLIT_SMEM(d, np));
  cr_assert_geq(sizeof smem, FA_MMA_DKV_SPLIT_SMEM(d, np));
  const int bk = FA_MMA_SPLIT_BK(d);

  /* the forward's o and lse */
  const fa_gpu_fwd_args ga = {emu_view(pq, FORKATTN_DTYPE_BF16, hq, d), emu_view(pk, FORKATTN_DTYPE_BF16, hkv, d),
                              emu_view(pv, FORKATTN_DTYPE_BF16, hkv, d), emu_view(o, FORKATTN_DTYPE_F32, hq, d),
                              lse, plan.seg, plan.pair, plan.q_pair_off, qb, nqb, hq, hkv, d, plan.qshift,
                              (float)scale, {0}, 0, 0, NULL, 0, NULL, np, np, {nq, nk, nk}, NULL, NULL, 0, 0};
  if (np == 3)
    EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq, fa_mma_fwd_team_f32_high((int)d, bk, 0, ga, qb[blk], h, h / group, smem));
  else
    EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq, fa_mma_fwd_team_f32_medium((int)d, bk, 0, ga, qb[blk], h, h / group, smem));
  float *dsum = malloc(sizeof(float) * (size_t)(T * hq));
  for (int64_t i = 0; i < T * hq; i++) {
    float sum = 0.0f;
    for (int64_t e = 0; e < d; e++) sum += o[i * d + e] * dout[i * d + e];
    dsum[i] = sum;
  }

  fa_key_unit *units;
  int64_t *unit_off;
  const int64_t nunits = fa_plan_key_units(&plan, kb, nkb, 48, &units, &unit_off);
  cr_assert(nunits > nkb, "the case has several units a key block");
  float *part_k = malloc(sizeof(float) * (size_t)(nunits * hkv * FA_MMA_ROWS * d));
  float *part_v = malloc(sizeof(float) * (size_t)(nunits * hkv * FA_MMA_ROWS * d));
  fa_gpu_bwd gb;
  memset(&gb, 0, sizeof gb);
  gb.q = emu_view(q, FORKATTN_DTYPE_F32, hq, d), gb.k = emu_view(k, FORKATTN_DTYPE_F32, hkv, d);
  gb.v = emu_view(v, FORKATTN_DTYPE_F32, hkv, d), gb.o = emu_view(o, FORKATTN_DTYPE_F32, hq, d);
  gb.dout = emu_view(dout, FORKATTN_DTYPE_F32, hq, d), gb.dq = emu_view(dq, FORKATTN_DTYPE_F32, hq, d);
  gb.dk = emu_view(dk, FORKATTN_DTYPE_F32, hkv, d), gb.dv = emu_view(dv, FORKATTN_DTYPE_F32, hkv, d);
  gb.lse = lse, gb.dsum = dsum, gb.dsum_ready = 1;
  gb.seg = plan.seg, gb.pair = plan.pair, gb.qoff = plan.q_pair_off, gb.kidx = plan.k_pair_idx;
  gb.qblocks = qb, gb.kblocks = kb, gb.units = units, gb.unit_off = unit_off, gb.part_k = part_k, gb.part_v = part_v;
  gb.nqb = nqb, gb.nkb = nkb, gb.nunits = nunits, gb.rows = T, gb.qshift = plan.qshift;
  gb.hq = hq, gb.hkv = hkv, gb.d = d, gb.krows = FA_MMA_ROWS, gb.scale = (float)scale;
  gb.pieces = np;
  gb.pq = emu_view(pq, FORKATTN_DTYPE_BF16, hq, d), gb.pk = emu_view(pk, FORKATTN_DTYPE_BF16, hkv, d);
  gb.pv = emu_view(pv, FORKATTN_DTYPE_BF16, hkv, d), gb.pdo = emu_view(pdo, FORKATTN_DTYPE_BF16, hq, d);
  gb.pstride[0] = nq, gb.pstride[1] = nk, gb.pstride[2] = nk, gb.pstride[3] = nq;
  for (int64_t i = 0; i < nq; i++) dq[i] = NAN; /* poison */
  for (int64_t i = 0; i < nk; i++) dk[i] = dv[i] = NAN;
  for (int64_t i = 0; i < nunits * hkv * FA_MMA_ROWS * d; i++) part_k[i] = part_v[i] = NAN;
  EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq, fa_mma_dq_split_team((int)d, bk, np, gb, qb[blk], h, h / group, smem));
  for (int64_t u = 0; u < nunits; u++)
    for (int64_t g = 0; g < hkv; g++) EMU_TEAM_OF(FA_MMA_DKV_SPLIT_THREADS, fa_mma_dkv_split_team((int)d, np, gb, u, g, smem));
  for (int64_t blk = 0; blk < nkb; blk++) /* as fa_gpu_dkv_reduce: each block's units in order */
    for (int64_t g = 0; g < hkv; g++)
      for (int64_t row = 0; row < kb[blk].len; row++)
        for (int64_t e = 0; e < d; e++) {
          const int64_t at = ((kb[blk].start + row) * hkv + g) * d + e;
          dk[at] = emu_unit_sum(part_k, unit_off, blk, hkv, g, FA_MMA_ROWS, row, d, e);
          dv[at] = emu_unit_sum(part_v, unit_off, blk, hkv, g, FA_MMA_ROWS, row, d, e);
        }
  int64_t nonfinite = 0;
  const double edq = split_rel_err(dq, r[5], nq, &nonfinite), edk = split_rel_err(dk, r[6], nk, &nonfinite),
               edv = split_rel_err(dv, r[7], nk, &nonfinite);
  cr_log_info("%s, %s backward: dq %.3g, dk %.3g, dv %.3g (limit %.1g)", name, np == 3 ? "HIGH" : "MEDIUM", edq, edk,
              edv, grad_tol);
  cr_expect_eq(nonfinite, 0, "%s: %lld non-finite (or unwritten) gradients", name, (long long)nonfinite);
  cr_expect_leq(edq, grad_tol, "%s pieces %d: dq relative error %.3g", name, np, edq);
  cr_expect_leq(edk, grad_tol, "%s pieces %d: dk relative error %.3g", name, np, edk);
  cr_expect_leq(edv, grad_tol, "%s pieces %d: dv relative error %.3g", name, np, edv);
  free(units), free(unit_off), free(part_k), free(part_v), free(dsum), free(qb), free(kb);
  free(pq), free(pk), free(pv), free(pdo);
  for (int i = 0; i < 9; i++) free(x[i]), free(r[i]);
  fa_plan_free(&plan);
}

/* HIGH at the f32 gradient tolerance of the attention tests (tests/prefix_harness.c: 1e-4 relative),
 * and, with `medium` set, MEDIUM at 8x it (docs/numerics.md): one case a head_dim, the emulation being
 * slow (the teams are the same code at either precision) */
#define SPLIT_BWD_CASE(tname, medium, ...)                                                                      \
  Test(split_emulated, tname, .timeout = 900) {                                                                \
    const split_case c = {__VA_ARGS__};                                                                         \
    split_bwd_run("split_emulated/" #tname, &c, 3, 1e-4);                                                       \
    if (medium) split_bwd_run("split_emulated/" #tname, &c, 2, 8e-4);                                           \
  }

/* a GRPO group, GQA 4/2, causal: the prompt's key blocks read by every response */
SPLIT_BWD_CASE(bwd_prefix_causal_d64, 1, .P = 70, .N = 3, .lens = {40, 1, 23}, .causal = 1, .hq = 4, .hkv = 2, .d = 64,
               .nan_v_row = -1)
/* head_dim 128 (16-query tiles), bidirectional */
SPLIT_BWD_CASE(bwd_prefix_bidir_d128, 0, .P = 90, .N = 2, .lens = {30, 17}, .causal = 0, .hq = 2, .hkv = 1, .d = 128,
               .nan_v_row = -1)
/* a trie at head_dim 128 */
SPLIT_BWD_CASE(bwd_tree_causal_d128, 1, .nodes = 6, .node_len = {70, 20, 0, 17, 40, 5}, .parents = {-1, 0, 1, 1, 0, 4},
               .causal = 1, .hq = 2, .hkv = 1, .d = 128, .nan_v_row = -1)

/* ---- the StreamKL forward team --------------------------------------------- */

/* A prefix layout's StreamKL forward from f32 inputs split into np pieces, against refkl_run: per (row,
 * head) |kl - ref| <= c (1 + R + cond + |kl|) as tests/reference_kl.h derives it (c 1e-5 for f32; the
 * log-sum-exps c (1 + R)), c scaled by `mult` for MEDIUM. */
static void kl_split_case(const char *name, int64_t P, int64_t N, const int64_t *lens, int causal, int64_t H,
                          int64_t hkv_t, int64_t hkv_s, int64_t d, int reverse, int np, double mult) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  int64_t off[8] = {0};
  fa_plan plan;
  const int64_t T = emu_prefix_plan(&plan, P, N, lens, causal, off);
  const int64_t sizes[4] = {T * H * d, T * hkv_t * d, T * H * d, T * hkv_s * d};
  float *x[4];
  double *rx[4];
  uint16_t *pc[4];
  for (int i = 0; i < 4; i++) {
    x[i] = malloc(sizeof(float) * (size_t)sizes[i]), rx[i] = malloc(sizeof(double) * (size_t)sizes[i]);
    for (int64_t e = 0; e < sizes[i]; e++) rx[i][e] = x[i][e] = (float)tc_uniform(&rng, i % 2 ? -1 : -2, i % 2 ? 1 : 2);
    pc[i] = split_all(x[i], sizes[i], np);
  }
  const double sct = 0.9 / sqrt((double)d), scs = 1.1 / sqrt((double)d);
  forkattn_prefix_layout lay = {P, N, off, causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL};
  forkattn_layout layout = {.prefix = &lay};
  double *rkl = malloc(sizeof(double) * (size_t)(T * H)), *rstats = malloc(sizeof(double) * (size_t)(T * H * 4));
  double *rscale = malloc(sizeof(double) * (size_t)(T * H)), *cond = malloc(sizeof(double) * (size_t)(T * H));
  const refkl_args ra = {&layout, NULL, H, hkv_t, hkv_s, d, d, sct, scs, 1.0, reverse, 0, rx[0], rx[1], rx[2], rx[3],
                         NULL};
  const refkl_out ro = {.kl = rkl, .stats = rstats, .rscale = rscale, .cond = cond};
  cr_assert_eq(refkl_run(&ra, &ro), 0);

  float *kl = malloc(sizeof(float) * (size_t)(T * H)), *stats = malloc(sizeof(float) * (size_t)(T * H * 4));
  float *outside = malloc(sizeof(float) * (size_t)(T * H));
  for (int64_t i = 0; i < T * H; i++) kl[i] = outside[i] = NAN;
  for (int64_t i = 0; i < T * H * 4; i++) stats[i] = NAN;
  fa_block *qb;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb);
  fa_gpu_kl b;
  memset(&b, 0, sizeof b);
  b.qt = emu_view(pc[0], FORKATTN_DTYPE_BF16, H, d), b.kt = emu_view(pc[1], FORKATTN_DTYPE_BF16, hkv_t, d);
  b.qs = emu_view(pc[2], FORKATTN_DTYPE_BF16, H, d), b.ks = emu_view(pc[3], FORKATTN_DTYPE_BF16, hkv_s, d);
  b.pieces = np;
  for (int i = 0; i < 4; i++) b.pstride[i] = sizes[i];
  b.seg = plan.seg, b.pair = plan.pair, b.qoff = plan.q_pair_off, b.qblocks = qb;
  b.kl = kl, b.stats = stats, b.outside = outside;
  b.reverse = reverse, b.nqb = nqb, b.h = H, b.hkv_t = hkv_t, b.hkv_s = hkv_s, b.dt = b.ds = d;
  b.st = (float)sct, b.ss = (float)scs, b.loss_mul = 1.0f;
  static unsigned short smem[FA_MMA_KL_FWD_SMEM(128, FA_MMA_SPLIT_BK(128), 3) / 2];
  cr_assert_geq(sizeof smem, FA_MMA_KL_FWD_SMEM(d, FA_MMA_SPLIT_BK(d), np));
  const int bk = FA_MMA_SPLIT_BK(d);
  if (np == 3) EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_fwd_team_f32_high((int)d, bk, 0, b, qb[blk], h, smem));
  else EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_fwd_team_f32_medium((int)d, bk, 0, b, qb[blk], h, smem));
  const double c = 1e-5 * mult;
  double worst = 0, worst_lse = 0;
  for (int64_t i = 0; i < T * H; i++) {
    const double R = rscale[i], want = rkl[i], got = kl[i];
    cr_assert(isfinite(got) && isfinite(stats[i * 4]) && isfinite(stats[i * 4 + 1]), "%s: [%lld] unwritten or NaN",
              name, (long long)i);
    const double lim = c * (1 + R + cond[i] + fabs(want));
    worst = fmax(worst, fabs(got - want) / lim);
    cr_expect_leq(fabs(got - want), lim, "%s: kl[%lld] = %.9g, float64 %.9g", name, (long long)i, got, want);
    for (int s = 0; s < 2; s++) {
      const double e = fabs(stats[i * 4 + s] - rstats[i * 4 + s]) / (c * (1 + R));
      worst_lse = fmax(worst_lse, e);
      cr_expect_leq(e, 1.0, "%s: lse %d of [%lld]: %.9g, float64 %.9g", name, s, (long long)i, stats[i * 4 + s],
                    rstats[i * 4 + s]);
    }
    cr_expect(outside[i] == 0.0f, "%s: outside mass without a kept set", name);
  }
  cr_log_info("%s, %d pieces: worst kl error %.2g and lse error %.2g of their limits", name, np, worst, worst_lse);
  free(qb), free(kl), free(stats), free(outside), free(rkl), free(rstats), free(rscale), free(cond);
  for (int i = 0; i < 4; i++) free(x[i]), free(rx[i]), free(pc[i]);
  fa_plan_free(&plan);
}

/* teacher 4 query / 2 KV heads, student 4 / 1; forward and reverse KL; MEDIUM at 8x the limits */
Test(split_emulated, kl_prefix_causal_d64, .timeout = 600) {
  const int64_t lens[2] = {40, 23};
  kl_split_case("split_emulated/kl_prefix_causal_d64", 70, 2, lens, 1, 4, 2, 1, 64, 0, 3, 1);
  kl_split_case("split_emulated/kl_prefix_causal_d64", 70, 2, lens, 1, 4, 2, 1, 64, 0, 2, 8);
}

Test(split_emulated, kl_prefix_bidir_reverse_d128, .timeout = 600) {
  const int64_t lens[2] = {30, 9};
  kl_split_case("split_emulated/kl_prefix_bidir_reverse_d128", 50, 2, lens, 0, 2, 1, 2, 128, 1, 3, 1);
  kl_split_case("split_emulated/kl_prefix_bidir_reverse_d128", 50, 2, lens, 0, 2, 1, 2, 128, 1, 2, 8);
}

/* The StreamKL backward from f32 inputs split into np pieces: the split forward team's statistics, then
 * both sides' split dQ and dK teams (key units of 24 reader rows: partial sums reduced in unit order, as
 * fa_gpu_kl_dk_reduce) against refkl_run's float64 gradients of sum(g kl) (g random, every 5th row 0:
 * loss-masked); every gradient starts poisoned. Tolerance: 1e-5 of each gradient's largest value (the
 * StreamKL tests' f32 gradient limit), times `mult` for MEDIUM. The teams need one KV head count on
 * both sides (same_kv_heads). */
static void kl_split_bwd_case(const char *name, int64_t P, int64_t N, const int64_t *lens, int causal, int64_t H,
                              int64_t hkv, int64_t d, int reverse, int np, double mult) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  int64_t off[8] = {0};
  fa_plan plan;
  const int64_t T = emu_prefix_plan(&plan, P, N, lens, causal, off);
  const int64_t sizes[4] = {T * H * d, T * hkv * d, T * H * d, T * hkv * d}; /* q_t, k_t, q_s, k_s */
  float *x[4], *grad[4];                                                      /* grad: dq_t, dk_t, dq_s, dk_s */
  double *rx[4], *rg[4];
  uint16_t *pc[4];
  for (int i = 0; i < 4; i++) {
    x[i] = malloc(sizeof(float) * (size_t)sizes[i]), rx[i] = malloc(sizeof(double) * (size_t)sizes[i]);
    grad[i] = malloc(sizeof(float) * (size_t)sizes[i]), rg[i] = malloc(sizeof(double) * (size_t)sizes[i]);
    for (int64_t e = 0; e < sizes[i]; e++) rx[i][e] = x[i][e] = (float)tc_uniform(&rng, i % 2 ? -1 : -2, i % 2 ? 1 : 2);
    for (int64_t e = 0; e < sizes[i]; e++) grad[i][e] = NAN; /* poison */
    pc[i] = split_all(x[i], sizes[i], np);
  }
  float *dkl = malloc(sizeof(float) * (size_t)(T * H));
  double *rdkl = malloc(sizeof(double) * (size_t)(T * H));
  for (int64_t i = 0; i < T * H; i++) rdkl[i] = dkl[i] = i % 5 == 2 ? 0.0f : (float)tc_uniform(&rng, -1, 1);
  const double sct = 0.9 / sqrt((double)d), scs = 1.1 / sqrt((double)d);
  forkattn_prefix_layout lay = {P, N, off, causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL};
  forkattn_layout layout = {.prefix = &lay};
  const refkl_args ra = {&layout, NULL, H, hkv, hkv, d, d, sct, scs, 1.0, reverse, 0, rx[0], rx[1], rx[2], rx[3],
                         rdkl};
  const refkl_out ro = {.dqs = rg[2], .dks = rg[3], .dqt = rg[0], .dkt = rg[1]};
  cr_assert_eq(refkl_run(&ra, &ro), 0);

  float *kl = malloc(sizeof(float) * (size_t)(T * H)), *stats = malloc(sizeof(float) * (size_t)(T * H * 4));
  float *outside = malloc(sizeof(float) * (size_t)(T * H));
  fa_block *qb, *kb;
  fa_key_unit *units;
  int64_t *unit_off;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb), nkb = fa_plan_blocks(&plan, FA_MMA_ROWS, 1, &kb);
  const int64_t nunits = fa_plan_key_units(&plan, kb, nkb, 24, &units, &unit_off);
  cr_assert(nqb > 0 && nunits > nkb, "the case has several units a key block");
  float *part = malloc(sizeof(float) * (size_t)(nunits * hkv * FA_MMA_ROWS * d));
  fa_gpu_kl b;
  memset(&b, 0, sizeof b);
  b.qt = emu_view(pc[0], FORKATTN_DTYPE_BF16, H, d), b.kt = emu_view(pc[1], FORKATTN_DTYPE_BF16, hkv, d);
  b.qs = emu_view(pc[2], FORKATTN_DTYPE_BF16, H, d), b.ks = emu_view(pc[3], FORKATTN_DTYPE_BF16, hkv, d);
  b.dqt = emu_view(grad[0], FORKATTN_DTYPE_F32, H, d), b.dkt = emu_view(grad[1], FORKATTN_DTYPE_F32, hkv, d);
  b.dqs = emu_view(grad[2], FORKATTN_DTYPE_F32, H, d), b.dks = emu_view(grad[3], FORKATTN_DTYPE_F32, hkv, d);
  b.pieces = np;
  for (int i = 0; i < 4; i++) b.pstride[i] = sizes[i];
  b.seg = plan.seg, b.pair = plan.pair, b.qoff = plan.q_pair_off, b.kidx = plan.k_pair_idx;
  b.qblocks = qb, b.kblocks = kb, b.units = units, b.unit_off = unit_off, b.part = part;
  b.kl = kl, b.stats = stats, b.outside = outside, b.stats_in = stats, b.dkl = dkl;
  b.reverse = reverse, b.teacher_grad = 1, b.nqb = nqb, b.nkb = nkb, b.nunits = nunits, b.krows = FA_MMA_ROWS;
  b.h = H, b.hkv_t = b.hkv_s = hkv, b.dt = b.ds = d, b.st = (float)sct, b.ss = (float)scs, b.loss_mul = 1.0f;
  static unsigned short smem[(FA_MMA_KL_DK_SPLIT_SMEM(128, 3) > FA_MMA_KL_DQ_SPLIT_SMEM(128, 3)
                                  ? FA_MMA_KL_DK_SPLIT_SMEM(128, 3)
                                  : FA_MMA_KL_DQ_SPLIT_SMEM(128, 3)) / 2];
  cr_assert_geq(sizeof smem, FA_MMA_KL_FWD_SMEM(d, FA_MMA_SPLIT_BK(d), np));
  cr_assert_geq(sizeof smem, FA_MMA_KL_DQ_SPLIT_SMEM(d, np));
  cr_assert_geq(sizeof smem, FA_MMA_KL_DK_SPLIT_SMEM(d, np));
  const int bk = FA_MMA_SPLIT_BK(d);
  if (np == 3) EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_fwd_team_f32_high((int)d, bk, 0, b, qb[blk], h, smem));
  else EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_fwd_team_f32_medium((int)d, bk, 0, b, qb[blk], h, smem));
  for (int teacher = 0; teacher < 2; teacher++) {
    for (int64_t i = 0; i < nunits * hkv * FA_MMA_ROWS * d; i++) part[i] = NAN;
    if (np == 3) {
      EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_dq_team_f32_high((int)d, bk, b, qb[blk], h, teacher, smem));
      for (int64_t u = 0; u < nunits; u++)
        for (int64_t g = 0; g < hkv; g++) EMU_TEAM(fa_mma_kl_dk_team_f32_high((int)d, b, u, g, teacher, smem));
    } else {
      EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_dq_team_f32_medium((int)d, bk, b, qb[blk], h, teacher, smem));
      for (int64_t u = 0; u < nunits; u++)
        for (int64_t g = 0; g < hkv; g++) EMU_TEAM(fa_mma_kl_dk_team_f32_medium((int)d, b, u, g, teacher, smem));
    }
    for (int64_t blk = 0; blk < nkb; blk++) /* each block's units in order */
      for (int64_t g = 0; g < hkv; g++)
        for (int64_t row = 0; row < kb[blk].len; row++)
          for (int64_t e = 0; e < d; e++)
            grad[teacher ? 1 : 3][((kb[blk].start + row) * hkv + g) * d + e] =
                emu_unit_sum(part, unit_off, blk, hkv, g, FA_MMA_ROWS, row, d, e);
  }
  const char *what[4] = {"dq_t", "dk_t", "dq_s", "dk_s"};
  double worst = 0;
  for (int i = 0; i < 4; i++) {
    int64_t nonfinite = 0;
    const double err = split_rel_err(grad[i], rg[i], sizes[i], &nonfinite);
    worst = fmax(worst, err);
    cr_expect_eq(nonfinite, 0, "%s: %lld non-finite (or unwritten) %s elements", name, (long long)nonfinite, what[i]);
    cr_expect_leq(err, 1e-5 * mult, "%s, %d pieces: %s relative error %.3g", name, np, what[i], err);
  }
  cr_log_info("%s, %d pieces: worst gradient error %.2g (limit %.1g)", name, np, worst, 1e-5 * mult);
  free(qb), free(kb), free(units), free(unit_off), free(part), free(kl), free(stats), free(outside), free(dkl),
      free(rdkl);
  for (int i = 0; i < 4; i++) free(x[i]), free(rx[i]), free(grad[i]), free(rg[i]), free(pc[i]);
  fa_plan_free(&plan);
}

/* 4 query / 2 KV heads on both sides, forward KL, d 64, HIGH */
Test(split_emulated, kl_bwd_prefix_causal_d64, .timeout = 900) {
  const int64_t lens[3] = {30, 1, 13};
  kl_split_bwd_case("split_emulated/kl_bwd_prefix_causal_d64", 40, 3, lens, 1, 4, 2, 64, 0, 3, 1);
}

/* reverse KL, bidirectional, d 128 (16-query dK tiles); HIGH, and MEDIUM at 8x the limit */
Test(split_emulated, kl_bwd_prefix_bidir_reverse_d128, .timeout = 900) {
  const int64_t lens[2] = {30, 9};
  kl_split_bwd_case("split_emulated/kl_bwd_prefix_bidir_reverse_d128", 50, 2, lens, 0, 2, 1, 128, 1, 3, 1);
  kl_split_bwd_case("split_emulated/kl_bwd_prefix_bidir_reverse_d128", 50, 2, lens, 0, 2, 1, 128, 1, 2, 8);
}
