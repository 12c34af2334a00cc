/* The tensor-core kernels' team functions (offload/gpu_fwd_teams.h,
 * offload/gpu_bwd_teams.h) run on the host under the SIMT emulation of
 * offload/gpu_mma.h: each team is a 128-thread `omp parallel` region, every
 * warp-collective (ldmatrix, mma, shuffle, ballot) is computed from its
 * warp's operands as the PTX ISA defines it. That checks everything but the
 * hardware itself: the walk over pairs and tiles, the double-buffer order,
 * the lane maps, masks, online softmax, P and dS packing, the backward's key
 * units and their in-order reduce, and the NaN containment of masked tiles,
 * against the float64 reference on prefix and tree layouts in bf16 and f16;
 * and the StreamKL forward and backward (offload/gpu_mma_kl_team.h,
 * offload/gpu_mma_kl_bwd_team.h) against a direct float64 KL of the
 * materialized distributions and its gradients.
 * The forward, dQ and dK/dV run twice (the wgmma forward also as one and as two stream teams,
 * offload/gpu_fwd_stream_team.h, over every item): the warpgroup (wgmma) kernels of sm_90a
 * builds (offload/gpu_wgmma.h: the swizzled layout its descriptors read, as
 * the ISA defines it) with their bulk tensor copies emulated
 * (offload/gpu_tma.h: K and V tiles, Q and dO tiles), and the mma.sync ones.
 * Tolerances are those of the 16-bit GPU tests (prefix_harness.c: 1e-2
 * relative for o and the gradients, 1e-3 absolute for lse): P and dS are
 * rounded to 16 bits before their products. [ran on host: emulation; the
 * kernels themselves run in the GPU suite, where they are the default]
 * Clang only (the host side of ompx.h). */
#define FORKATTN_MMA_EMULATE 1

#include <criterion/criterion.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_bwd_teams.h"
#include "gpu_finite_check.h"
#include "gpu_fwd_stream_team.h"
#include "gpu_fwd_teams.h"
#include "gpu_mma_kl_bwd_team.h"
#include "gpu_mma_kl_team.h"
#include "reference.h"
#include "segment_plan.h"
#include "emulation.h"
#include "test_common.h"

typedef struct emu_case {
  int64_t P, N, lens[4];  /* prefix layout, or tree when nodes > 0 */
  int64_t nodes, node_len[6], parents[6];
  int causal, hq, hkv, d, f16;
  int64_t nan_v_row; /* >= 0: V of this row (KV head 0, column 0) is NaN */
} emu_case;

typedef struct emu_bufs {
  uint16_t *q, *k, *v, *o, *dout, *dq, *dk, *dv;
  double *rq, *rk, *rv, *rdout; /* the rounded inputs, float64 */
  float *lse, *dsum;
} emu_bufs;

static uint16_t to16(double x, int f16) { return f16 ? fa_f32_to_f16((float)x) : fa_f32_to_bf16((float)x); }
static double from16(uint16_t h, int f16) { return f16 ? fa_f16_to_f32(h) : fa_bf16_to_f32(h); }

static double rel_err(const uint16_t *got, const double *ref, int64_t n, int f16, int64_t *nonfinite) {
  double e = 0, m = 0;
  for (int64_t i = 0; i < n; i++) {
    const double g = from16(got[i], f16);
    if (!isfinite(g)) ++*nonfinite;
    e = fmax(e, fabs(g - ref[i]));
    m = fmax(m, fabs(ref[i]));
  }
  return e / (m > 0 ? m : 1);
}

static void run_case(const char *name, const emu_case *c) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  const int f16 = c->f16, dt = f16 ? FORKATTN_DTYPE_F16 : FORKATTN_DTYPE_BF16;
  const int64_t hq = c->hq, hkv = c->hkv, d = c->d, group = hq / hkv;
  const int bk = FA_MMA_BK(d);
  fa_plan plan;
  int64_t T, off[8];
  if (c->nodes) {
    off[0] = 0;
    for (int64_t i = 0; i < c->nodes; i++) off[i + 1] = off[i] + c->node_len[i];
    T = off[c->nodes];
    cr_assert_eq(fa_plan_tree(&plan, c->nodes, off, c->parents, c->causal), 0);
  } else {
    off[0] = 0;
    for (int64_t i = 0; i < c->N; i++) off[i + 1] = off[i] + c->lens[i];
    T = c->P + off[c->N];
    cr_assert_eq(fa_plan_prefix(&plan, c->P, c->N, off, c->causal), 0);
  }
  const int64_t nq = T * hq * d, nk = T * hkv * d;
  emu_bufs b;
  memset(&b, 0, sizeof b);
  uint16_t **b16[] = {&b.q, &b.dout, &b.o, &b.dq, &b.k, &b.v, &b.dk, &b.dv};
  for (int i = 0; i < 8; i++) *b16[i] = malloc(sizeof(uint16_t) * (size_t)(i < 4 ? nq : nk));
  b.rq = malloc(sizeof(double) * (size_t)nq), b.rdout = malloc(sizeof(double) * (size_t)nq);
  b.rk = malloc(sizeof(double) * (size_t)nk), b.rv = malloc(sizeof(double) * (size_t)nk);
  b.lse = malloc(sizeof(float) * (size_t)(T * hq)), b.dsum = malloc(sizeof(float) * (size_t)(T * hq));
  for (int64_t i = 0; i < nq; i++) {
    b.q[i] = to16(tc_uniform(&rng, -2, 2), f16), b.rq[i] = from16(b.q[i], f16);
    b.dout[i] = to16(tc_uniform(&rng, -1, 1), f16), b.rdout[i] = from16(b.dout[i], f16);
  }
  for (int64_t i = 0; i < nk; i++) {
    b.k[i] = to16(tc_uniform(&rng, -2, 2), f16), b.rk[i] = from16(b.k[i], f16);
    b.v[i] = to16(tc_uniform(&rng, -1, 1), f16), b.rv[i] = from16(b.v[i], f16);
  }
  const double scale = 1.0 / sqrt((double)d);

  /* float64 reference on the rounded inputs */
  double *ro = malloc(sizeof(double) * (size_t)nq), *rlse = malloc(sizeof(double) * (size_t)(T * hq));
  double *rdq = malloc(sizeof(double) * (size_t)nq), *rdk = malloc(sizeof(double) * (size_t)nk),
         *rdv = malloc(sizeof(double) * (size_t)nk);
  const ref_prefix_out out = {ro, rlse, rdq, rdk, rdv};
  const forkattn_mask mask = c->causal ? FORKATTN_MASK_CAUSAL : FORKATTN_MASK_BIDIRECTIONAL;
  if (c->nodes) {
    const forkattn_tree_layout tree = {c->nodes, off, c->parents};
    const ref_tree_args ra = {&tree, hq, hkv, d, scale, b.rq, b.rk, b.rv, b.rdout};
    cr_assert_eq(ref_tree(&ra, &out), 0);
  } else {
    const forkattn_prefix_layout lay = {c->P, c->N, off, mask};
    const ref_prefix_args ra = {&lay, hq, hkv, d, scale, b.rq, b.rk, b.rv, b.rdout};
    cr_assert_eq(ref_prefix(&ra, &out), 0);
  }
  if (c->nan_v_row >= 0) b.v[c->nan_v_row * hkv * d] = to16(NAN, f16);

  /* forward: one team per (64-row query block, query head) */
  static _Alignas(16) unsigned short smem[2 * 64 * 128 + 4 * 64 * (128 + 8) + 1024];
  cr_assert_geq(sizeof smem, FA_MMA_DKV_SMEM(d));
  cr_assert_geq(sizeof smem, FA_MMA_FWD_SMEM(d, 1, 1));
  cr_assert_geq(sizeof smem, FA_WG_DKV_SMEM(d));
  fa_block *qb;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb);
  cr_assert(nqb > 0);
  fa_gpu_fwd_args ga = {emu_view(b.q, dt, hq, d), emu_view(b.k, dt, hkv, d), emu_view(b.v, dt, hkv, d), emu_view(b.o, dt, hq, d),
                        b.lse, plan.seg, plan.pair, plan.q_pair_off, qb, nqb, hq, hkv, d, plan.qshift,
                        (float)scale, {0}, 0, 0, NULL, 0, NULL, 1, 1, {0, 0, 0}, NULL, NULL, 0, T};
  /* the two-warpgroup forward (128-row blocks, bulk copies only), then the mma.sync one, whose o
   * and lse the backward reads */
  int64_t nonfinite = 0;
  fa_block *qb2;
  const int64_t nqb2 = fa_plan_blocks(&plan, FA_WG_PAIR_ROWS, 0, &qb2);
  cr_assert(nqb2 > 0);
  static _Alignas(16) unsigned short smem2[(FA_WG_PAIR_ROWS + 2 * FA_WG_PAIR_FWD_STAGES(128) * FA_WG_PAIR_BK) * 128 + 2048];
  cr_assert_geq(sizeof smem2, FA_WG_PAIR_FWD_SMEM(d));
  cr_assert_geq(sizeof smem2, FA_FWD_STREAM_SMEM(FA_WG_PAIR_FWD_SMEM(d)));
  /* the stream teams' blocks, kept with the plan, and their items */
  const fa_block *qbm;
  const fa_block_item *items;
  cr_assert_eq(fa_plan_blocks_memo(&plan, FA_WG_PAIR_ROWS, 0, &qbm), nqb2);
  int see_keys = 0;
  cr_assert_eq(fa_plan_block_items_memo(&plan, qbm, nqb2, &items, &see_keys), nqb2);
  cr_assert(see_keys, "the stream teams need every item to see a key");
  fa_tma_map maps2[2]; /* its tiles are 128 keys */
  fa_tma_emulated_map(&maps2[0], b.k, T, hkv, d, hkv * d, d, FA_WG_PAIR_BK);
  fa_tma_emulated_map(&maps2[1], b.v, T, hkv, d, hkv * d, d, FA_WG_PAIR_BK);
  for (int pass = 3; pass >= 0; pass--) {
    const char *kernel = pass == 3   ? "two-warpgroup wgmma forward, 2 stream teams, V checked"
                         : pass == 2 ? "two-warpgroup wgmma forward, 1 stream team"
                         : pass      ? "two-warpgroup wgmma forward, V checked"
                                     : "mma forward";
    ga.tma = pass ? maps2 : NULL;
    /* passes 3 and 1: V's check first (two teams), whose flag tells the kernel whether to scan */
    int v_nonfinite = 0;
    ga.v_nonfinite = pass == 3 || pass == 1 ? &v_nonfinite : NULL;
    if (ga.v_nonfinite) {
      for (int team = 0; team < 2; team++)
        EMU_TEAM_OF(FA_FINITE_CHECK_THREADS, fa_finite_check_team(ga.v, T, hkv, (int)d, f16, &v_nonfinite, team, 2,
                                                                  omp_get_thread_num()));
      cr_assert_eq(v_nonfinite, c->nan_v_row >= 0, "%s: V's check found %d", name, v_nonfinite);
    }
    ga.blocks = pass >= 2 ? qbm : qb, ga.nblocks = pass >= 2 ? nqb2 : nqb, ga.items = items;
    for (int64_t i = 0; i < nq; i++) b.o[i] = 0x7fc1; /* poison: NaN in both dtypes */
    for (int64_t i = 0; i < T * hq; i++) b.lse[i] = NAN;
    if (pass >= 2) { /* stream teams: each runs items team, team + teams, ... through one ring */
      const int teams = pass - 1;
      for (int team = 0; team < teams; team++)
        EMU_TEAM_OF(FA_WG_PAIR_THREADS, fa_wg_pair_fwd_stream_team((int)d, FA_WG_PAIR_BK, f16, ga, team, teams, smem2));
    } else if (pass)
      EMU_QUERY_TEAMS(FA_WG_PAIR_THREADS, nqb2, hq,
                      fa_wg_pair_fwd_team((int)d, FA_WG_PAIR_BK, f16, ga, qb2[blk], h, h / group, smem2));
    else
      EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq, fa_mma_fwd_team((int)d, bk, f16, ga, qb[blk], h, h / group, smem));
    if (c->nan_v_row < 0) {
      const double eo = rel_err(b.o, ro, nq, f16, &nonfinite);
      double el = 0;
      for (int64_t i = 0; i < T * hq; i++) el = fmax(el, fabs(b.lse[i] - rlse[i]));
      cr_assert_eq(nonfinite, 0, "%s %s: %lld non-finite (or unwritten) o", name, kernel, (long long)nonfinite);
      cr_assert_leq(eo, 1e-2, "%s %s: o relative error %.3g", name, kernel, eo);
      cr_assert_leq(el, 1e-3, "%s %s: lse error %.3g", name, kernel, el);
    } else { /* rows that see the NaN key are NaN, all others match the reference */
      for (int64_t r = 0; r < T; r++)
        for (int64_t h = 0; h < group; h++) { /* query heads of KV head 0 */
          const int sees = !c->causal || r >= c->nan_v_row; /* a prefix case, the NaN row in the prompt */
          const double g = from16(b.o[(r * hq + h) * d], f16), want = ro[(r * hq + h) * d];
          if (sees) cr_assert(isnan(g), "%s %s: o[%lld, %lld] should be NaN", name, kernel, (long long)r, (long long)h);
          else
            cr_assert(fabs(g - want) <= 2e-2, "%s %s: o[%lld, %lld] = %g, want %g", name, kernel, (long long)r,
                      (long long)h, g, want);
        }
    }
  }
  if (c->nan_v_row >= 0) goto done;

  /* backward: dQ teams (which also compute D from the stored o), dK/dV teams
   * over key units (units of 64 reader rows: several per block, so partial
   * sums and the in-order reduce run too), then the reduce */
  for (int64_t i = 0; i < T * hq; i++) b.dsum[i] = NAN; /* poison: the dQ teams write D */
  fa_block *kb;
  fa_key_unit *units;
  int64_t *unit_off;
  const int64_t nkb = fa_plan_blocks(&plan, FA_MMA_ROWS, 1, &kb);
  const int64_t nunits = fa_plan_key_units(&plan, kb, nkb, 64, &units, &unit_off);
  cr_assert(nkb > 0 && nunits >= nkb);
  float *part_k = NULL, *part_v = NULL;
  if (nunits > nkb) {
    part_k = malloc(sizeof(float) * (size_t)(nunits * hkv * FA_MMA_ROWS * d));
    part_v = malloc(sizeof(float) * (size_t)(nunits * hkv * FA_MMA_ROWS * d));
  }
  for (int64_t i = 0; i < nq; i++) b.dq[i] = 0x7fc1;
  for (int64_t i = 0; i < nk; i++) b.dk[i] = b.dv[i] = 0x7fc1;
  fa_gpu_bwd gb = {emu_view(b.q, dt, hq, d), emu_view(b.k, dt, hkv, d), emu_view(b.v, dt, hkv, d), emu_view(b.o, dt, hq, d),
                   emu_view(b.dout, dt, hq, d), emu_view(b.dq, dt, hq, d), emu_view(b.dk, dt, hkv, d),
                   emu_view(b.dv, dt, hkv, d), b.lse, b.dsum, plan.seg, plan.pair, plan.q_pair_off,
                   plan.k_pair_idx, qb, kb, units, unit_off, part_k, part_v, nqb, nkb, nunits, T,
                   plan.qshift, hq, hkv, d, FA_MMA_ROWS, (float)scale, {0}, 0, 0, NULL, NULL, 0, 0, NULL, 0,
                   0, {0}, {0}, {0}, {0}, {0}};
  double edq = 0;
  static unsigned short smem_dq2[(2 * FA_WG_PAIR_ROWS + 2 * FA_WG_PAIR_DQ_STAGES(128) * FA_WG_PAIR_BK) * 128 + 2048];
  cr_assert_geq(sizeof smem_dq2, FA_WG_PAIR_DQ_SMEM(d));
  gb.kv_tma = maps2; /* K's and V's 128-key tiles (the two-warpgroup forward's maps) */
  /* the two-warpgroup dQ (128-row blocks), then the mma.sync one (its D feeds dK/dV);
   * each again with D given (dsum_ready, as when some blocks take D from the inputs): with O
   * zeroed it must read D, not compute it, and give the same bits */
  uint16_t *dq_first = malloc(sizeof(uint16_t) * (size_t)nq), *o_saved = malloc(sizeof(uint16_t) * (size_t)nq);
  cr_assert(dq_first && o_saved);
  for (int pass = 1; pass >= 0; pass--)
  for (int ready = 0; ready < 2; ready++) {
    const char *kernel = pass ? "two-warpgroup wgmma dQ" : "mma dQ";
    gb.dsum_ready = ready;
    if (ready) {
      memcpy(o_saved, b.o, sizeof(uint16_t) * (size_t)nq);
      memset(b.o, 0, sizeof(uint16_t) * (size_t)nq);
    } else {
      for (int64_t i = 0; i < T * hq; i++) b.dsum[i] = NAN;
    }
    for (int64_t i = 0; i < nq; i++) b.dq[i] = 0x7fc1;
    if (pass)
      EMU_QUERY_TEAMS(FA_WG_PAIR_THREADS, nqb2, hq,
                      fa_wg_pair_dq_team((int)d, FA_WG_PAIR_BK, f16, gb, qb2[blk], h, h / group, smem_dq2));
    else
      EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, hq, fa_mma_dq_team((int)d, bk, f16, gb, qb[blk], h, h / group, smem));
    if (ready) {
      memcpy(b.o, o_saved, sizeof(uint16_t) * (size_t)nq);
      cr_assert(memcmp(b.dq, dq_first, sizeof(uint16_t) * (size_t)nq) == 0,
                "%s %s with D given: dq differs from the run that computed D", name, kernel);
      continue;
    }
    for (int64_t r = 0; r < T; r++) /* D against float64 (every row here is a query row) */
      for (int64_t h = 0; h < hq; h++) {
        double s = 0, mag = 0;
        for (int64_t x = 0; x < d; x++) {
          const double t = from16(b.o[(r * hq + h) * d + x], f16) * b.rdout[(r * hq + h) * d + x];
          s += t, mag += fabs(t);
        }
        /* float32 sums of d products: within d ulps of the sum of magnitudes */
        cr_assert(fabs(b.dsum[r * hq + h] - s) <= 1e-6 * (double)d * mag + 1e-30,
                  "%s %s: D[%lld, %lld] = %g, want %g", name, kernel, (long long)r, (long long)h,
                  (double)b.dsum[r * hq + h], s);
      }
    edq = rel_err(b.dq, rdq, nq, f16, &nonfinite);
    cr_assert_eq(nonfinite, 0, "%s %s: %lld non-finite (or unwritten) dq elements", name, kernel, (long long)nonfinite);
    cr_assert_leq(edq, 1e-2, "%s %s: dq relative error %.3g", name, kernel, edq);
    memcpy(dq_first, b.dq, sizeof(uint16_t) * (size_t)nq);
  }
  gb.dsum_ready = 0;
  free(dq_first);
  free(o_saved);
  double edk = 0, edv = 0;
  /* the wgmma dK/dV (the two-warpgroup query-major one at head_dim 128, the key-major one at 64) with
   * Q's and dO's full tiles by (emulated) bulk tensor copies, then the mma.sync one */
  fa_tma_map qmaps[2];
  const int qbox = d == 128 ? FA_DKV_QUERY_MAJOR_BQ : FA_WG_DKV_BQ;
  fa_tma_emulated_map(&qmaps[0], b.q, T, hq, d, hq * d, d, qbox);
  fa_tma_emulated_map(&qmaps[1], b.dout, T, hq, d, hq * d, d, qbox);
  /* the two-warpgroup query-major dK/dV (head_dim 128): 128-row key blocks and their own units (64 reader
   * rows each, so partial sums of 128 rows and the reduce run too); bulk copies only */
  fa_block *kb2 = NULL;
  fa_key_unit *units2 = NULL;
  int64_t *unit_off2 = NULL, nkb2 = 0, nunits2 = 0;
  float *part_k2 = NULL, *part_v2 = NULL;
  static unsigned short smem_dkv2[(4 * 64 * 128 + 4 * 64 * 64 + 6 * 64 * 128) + 2048];
  if (d == 128) {
    cr_assert_geq(sizeof smem_dkv2, FA_WG_PAIR_DKV_SMEM(d));
    nkb2 = fa_plan_blocks(&plan, FA_WG_PAIR_ROWS, 1, &kb2);
    nunits2 = fa_plan_key_units(&plan, kb2, nkb2, 64, &units2, &unit_off2);
    cr_assert(nkb2 > 0 && nunits2 >= nkb2);
    if (nunits2 > nkb2) {
      part_k2 = malloc(sizeof(float) * (size_t)(nunits2 * hkv * FA_WG_PAIR_ROWS * d));
      part_v2 = malloc(sizeof(float) * (size_t)(nunits2 * hkv * FA_WG_PAIR_ROWS * d));
    }
  }
  /* pass 1: the wgmma dK/dV; 0: mma.sync */
  for (int pass = 1; pass >= 0; pass--) {
    const int wg_pair = pass && d == 128;
    const char *kernel = wg_pair ? "two-warpgroup query-major wgmma dK/dV"
                         : pass  ? "key-major wgmma dK/dV"
                                 : "mma dK/dV";
    fa_gpu_bwd gk = gb;
    gk.tma = pass ? qmaps : NULL;
    if (wg_pair) {
      gk.kblocks = kb2, gk.units = units2, gk.unit_off = unit_off2, gk.part_k = part_k2, gk.part_v = part_v2;
      gk.nkb = nkb2, gk.nunits = nunits2, gk.krows = FA_WG_PAIR_ROWS, gk.dkv_wg_pair = 1;
    }
    for (int64_t i = 0; i < nk; i++) b.dk[i] = b.dv[i] = 0x7fc1;
    for (int64_t u = 0; u < gk.nunits; u++) /* head_dim 128: V in team memory */
      for (int64_t g = 0; g < hkv; g++) {
        if (wg_pair) EMU_TEAM_OF(FA_WG_PAIR_THREADS, fa_wg_pair_dkv_query_major_team((int)d, f16, gk, u, g, smem_dkv2));
        else if (pass) EMU_TEAM(fa_wg_dkv_team((int)d, f16, gk, u, g, smem));
        else EMU_TEAM(fa_mma_dkv_team((int)d, f16, gk, u, g, smem));
      }
    if (gk.part_k) /* as fa_gpu_dkv_reduce: each block's units in order */
      for (int64_t blk = 0; blk < gk.nkb; blk++)
        for (int64_t g = 0; g < hkv; g++)
          for (int64_t row = 0; row < gk.kblocks[blk].len; row++)
            for (int64_t x = 0; x < d; x++) {
              const int64_t e = ((gk.kblocks[blk].start + row) * hkv + g) * d + x;
              b.dk[e] = to16(emu_unit_sum(gk.part_k, gk.unit_off, blk, hkv, g, gk.krows, row, d, x), f16);
              b.dv[e] = to16(emu_unit_sum(gk.part_v, gk.unit_off, blk, hkv, g, gk.krows, row, d, x), f16);
            }
    edk = rel_err(b.dk, rdk, nk, f16, &nonfinite), edv = rel_err(b.dv, rdv, nk, f16, &nonfinite);
    cr_assert_eq(nonfinite, 0, "%s %s: %lld non-finite (or unwritten) dk/dv elements", name, kernel,
                 (long long)nonfinite);
    cr_assert_leq(edk, 1e-2, "%s %s: dk relative error %.3g", name, kernel, edk);
    cr_assert_leq(edv, 1e-2, "%s %s: dv relative error %.3g", name, kernel, edv);
  }
  free(part_k2);
  free(part_v2);
  free(kb2);
  free(units2);
  free(unit_off2);
  cr_log_info("%s: units %lld over %lld key blocks; dq %.2g dk %.2g dv %.2g", name, (long long)nunits,
              (long long)nkb, edq, edk, edv);
  free(part_k);
  free(part_v);
  free(kb);
  free(units);
  free(unit_off);
done:
  free(qb), free(qb2);
  for (int i = 0; i < 8; i++) free(*b16[i]);
  free(b.rq), free(b.rk), free(b.rv), free(b.rdout), free(b.lse), free(b.dsum);
  free(ro), free(rlse), free(rdq), free(rdk), free(rdv);
  fa_plan_free(&plan);
}

#define EMU_CASE(tname, ...)                                                                                    \
  Test(mma_emulated, tname, .timeout = 600) { run_case("mma_emulated/" #tname, &(const emu_case){__VA_ARGS__}); }

/* A GRPO group: the prompt's query block crosses the causal diagonal, the
 * responses read the prompt (full pair) then themselves; GQA 4/2. */
EMU_CASE(prefix_causal_bf16_d64, .P = 70, .N = 3, .lens = {40, 1, 23}, .causal = 1, .hq = 4, .hkv = 2, .d = 64,
         .nan_v_row = -1)
EMU_CASE(prefix_bidir_f16_d64, .P = 45, .N = 2, .lens = {30, 17}, .causal = 0, .hq = 2, .hkv = 1, .d = 64, .f16 = 1,
         .nan_v_row = -1)
/* head_dim 128: 32-key tiles, the mma.sync dK/dV with V in team memory */
EMU_CASE(prefix_causal_bf16_d128, .P = 50, .N = 2, .lens = {20, 9}, .causal = 1, .hq = 2, .hkv = 1, .d = 128,
         .nan_v_row = -1)
/* longer rows: the two-warpgroup kernels' 128-key tiles full and in both
 * 64-key halves (the cases above fit a tile's first half) */
EMU_CASE(prefix_causal_long_bf16_d128, .P = 200, .N = 2, .lens = {150, 70}, .causal = 1, .hq = 2, .hkv = 1,
         .d = 128, .nan_v_row = -1)
/* head_dim 128, bidirectional, GQA 4/2: every tile unmasked but the short ones */
EMU_CASE(prefix_bidir_f16_d128, .P = 140, .N = 3, .lens = {70, 3, 64}, .causal = 0, .hq = 4, .hkv = 2, .d = 128,
         .f16 = 1, .nan_v_row = -1)
/* a trie at head_dim 128 */
EMU_CASE(tree_causal_bf16_d128, .nodes = 6, .node_len = {90, 20, 0, 17, 70, 5}, .parents = {-1, 0, 1, 1, 0, 4},
         .causal = 1, .hq = 2, .hkv = 1, .d = 128, .nan_v_row = -1)
/* a trie: chains, siblings, an empty node */
EMU_CASE(tree_causal_f16_d64, .nodes = 6, .node_len = {33, 20, 0, 17, 40, 5}, .parents = {-1, 0, 1, 1, 0, 4},
         .causal = 1, .hq = 2, .hkv = 1, .d = 64, .f16 = 1, .nan_v_row = -1)
/* a NaN value row inside the prompt's diagonal tile reaches exactly the rows
 * that see it (0 * NaN of masked keys must not leak) */
EMU_CASE(prefix_causal_nan_v_bf16_d64, .P = 70, .N = 1, .lens = {10}, .causal = 1, .hq = 2, .hkv = 1, .d = 64,
         .nan_v_row = 37)
/* the same for a row in the second half of an accumulator's rows (row 9: the
 * z/w elements, lanes 4-7 of the quad test) */
EMU_CASE(prefix_causal_nan_v9_bf16_d64, .P = 20, .N = 1, .lens = {10}, .causal = 1, .hq = 2, .hkv = 1, .d = 64,
         .nan_v_row = 9)
/* a NaN value row in the second half of a 128-key tile (its second flag word) */
EMU_CASE(prefix_causal_nan_v100_bf16_d64, .P = 150, .N = 1, .lens = {10}, .causal = 1, .hq = 2, .hkv = 1, .d = 64,
         .nan_v_row = 100)
/* d = 128 (32-key tiles): keys 0-31 cross the team's first diagonal, yet
 * warps 2 and 3 (rows 32-63) see all of them and take the unmasked path */
EMU_CASE(prefix_causal_nan_v_f16_d128, .P = 70, .N = 1, .lens = {10}, .causal = 1, .hq = 2, .hkv = 1, .d = 128,
         .f16 = 1, .nan_v_row = 5)

/* ---- StreamKL forward ------------------------------------------------------ */

/* Key j visible to row i in a prefix layout (prompt P, responses at off). */
static int prefix_sees(int causal, int64_t P, const int64_t *off, int64_t N, int64_t i, int64_t j) {
  if (causal && j > i) return 0;
  if (i < P) return j < P;
  if (j < P) return 1;
  int64_t r = 0;
  while (r + 1 < N && i - P >= off[r + 1]) r++;
  return j - P >= off[r] && j - P < off[r + 1];
}

/* Both sides' scaled scores of the keys row i (query head h) sees in a prefix
 * layout, into t and s (other entries untouched), and their maxima: from the
 * rounded inputs rx (q_t, k_t, q_s, k_s) in float64. */
typedef struct kl_ref_shape {
  int64_t P, N, H, hkv_t, hkv_s, d, T;
  const int64_t *off;
  int causal;
  double sct, scs;
} kl_ref_shape;

static void kl_ref_scores(const kl_ref_shape *c, double *const rx[4], int64_t i, int64_t h, double *t, double *s,
                          double *mt, double *ms) {
  const int64_t gt = h / (c->H / c->hkv_t), gs = h / (c->H / c->hkv_s), d = c->d;
  *mt = *ms = -INFINITY;
  for (int64_t j = 0; j < c->T; j++) {
    if (!prefix_sees(c->causal, c->P, c->off, c->N, i, j)) continue;
    double a = 0, b = 0;
    for (int64_t e = 0; e < d; e++) {
      a += rx[0][(i * c->H + h) * d + e] * rx[1][(j * c->hkv_t + gt) * d + e];
      b += rx[2][(i * c->H + h) * d + e] * rx[3][(j * c->hkv_s + gs) * d + e];
    }
    t[j] = a * c->sct, s[j] = b * c->scs, *mt = fmax(*mt, t[j]), *ms = fmax(*ms, s[j]);
  }
}

static void kl_case(const char *name, int64_t P, int64_t N, const int64_t *lens, int causal, int64_t H, int64_t hkv_t,
                    int64_t hkv_s, int64_t d, int f16, int reverse) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  const int dt = f16 ? FORKATTN_DTYPE_F16 : FORKATTN_DTYPE_BF16;
  int64_t off[8] = {0};
  fa_plan plan;
  const int64_t T = emu_prefix_plan(&plan, P, N, lens, causal, off);
  const int64_t sizes[4] = {T * H * d, T * hkv_t * d, T * H * d, T * hkv_s * d};
  uint16_t *x[4];
  double *rx[4];
  for (int i = 0; i < 4; i++) {
    x[i] = malloc(sizeof(uint16_t) * (size_t)sizes[i]), rx[i] = malloc(sizeof(double) * (size_t)sizes[i]);
    for (int64_t e = 0; e < sizes[i]; e++) x[i][e] = to16(tc_uniform(&rng, -2, 2), f16), rx[i][e] = from16(x[i][e], f16);
  }
  float *kl = malloc(sizeof(float) * (size_t)(T * H)), *stats = malloc(sizeof(float) * (size_t)(T * H * 4));
  float *outside = malloc(sizeof(float) * (size_t)(T * H));
  for (int64_t i = 0; i < T * H; i++) kl[i] = outside[i] = NAN;
  for (int64_t i = 0; i < T * H * 4; i++) stats[i] = NAN;
  fa_block *qb;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb);
  const float sct = (float)(0.9 / sqrt((double)d)), scs = (float)(1.1 / sqrt((double)d));
  fa_gpu_kl b;
  memset(&b, 0, sizeof b);
  b.qt = emu_view(x[0], dt, H, d), b.kt = emu_view(x[1], dt, hkv_t, d), b.qs = emu_view(x[2], dt, H, d);
  b.ks = emu_view(x[3], dt, hkv_s, d);
  b.seg = plan.seg, b.pair = plan.pair, b.qoff = plan.q_pair_off, b.qblocks = qb;
  b.kl = kl, b.stats = stats, b.outside = outside;
  b.reverse = reverse, b.nqb = nqb, b.h = H, b.hkv_t = hkv_t, b.hkv_s = hkv_s, b.dt = b.ds = d;
  b.st = sct, b.ss = scs, b.loss_mul = 1.0f;
  static _Alignas(16) unsigned short smem[4 * 64 * (128 + 8)];
  const int bk = FA_MMA_BK(d);
  EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_fwd_team((int)d, bk, f16, b, qb[blk], h, smem));
  double worst = 0;
  double *t = malloc(sizeof(double) * (size_t)T), *sv = malloc(sizeof(double) * (size_t)T);
  const kl_ref_shape shape = {P, N, H, hkv_t, hkv_s, d, T, off, causal, sct, scs};
  for (int64_t i = 0; i < T; i++)
    for (int64_t h = 0; h < H; h++) {
      double mt, ms, zt = 0, zs = 0, L = 0, mag = 0;
      kl_ref_scores(&shape, rx, i, h, t, sv, &mt, &ms);
      for (int64_t j = 0; j < T; j++)
        if (prefix_sees(causal, P, off, N, i, j)) zt += exp(t[j] - mt), zs += exp(sv[j] - ms);
      const double lt = mt + log(zt), ls = ms + log(zs);
      for (int64_t j = 0; j < T; j++) {
        if (!prefix_sees(causal, P, off, N, i, j)) continue;
        const double pt = exp(t[j] - lt), ps = exp(sv[j] - ls), lr = (t[j] - lt) - (sv[j] - ls);
        L += reverse ? -ps * lr : pt * lr;
        mag += (reverse ? ps : pt) * fabs(lr);
      }
      const double got = kl[i * H + h];
      cr_assert(isfinite(got), "%s: kl[%lld, %lld] = %g", name, (long long)i, (long long)h, got);
      /* float32 state over f32 scores: a few ulps of the terms' magnitude */
      const double err = fabs(got - L) / (1e-6 + mag);
      worst = fmax(worst, err);
      cr_assert_leq(err, 1e-4, "%s: kl[%lld, %lld] = %.9g, float64 %.9g", name, (long long)i, (long long)h, got, L);
      cr_assert_leq(fabs(stats[(i * H + h) * 4 + FA_KL_LSE_T] - lt), 1e-4 * (1 + fabs(lt)), "%s: lse_t", name);
      cr_assert_leq(fabs(stats[(i * H + h) * 4 + FA_KL_LSE_S] - ls), 1e-4 * (1 + fabs(ls)), "%s: lse_s", name);
      cr_assert(outside[i * H + h] == 0.0f, "%s: outside mass without a kept set", name);
    }
  cr_log_info("%s: worst |kl - float64| / sum |terms| = %.2g", name, worst);
  free(t), free(sv), free(qb), free(kl), free(stats), free(outside);
  for (int i = 0; i < 4; i++) free(x[i]), free(rx[i]);
  fa_plan_free(&plan);
}

/* teacher 4 query / 2 KV heads, student 4 / 1; forward and reverse KL */
/* The kernels keep positions and pair indices in 32 bits; larger plans go to
 * the FP32 kernels (fa_gpu_call_of, offload/gpu_select.h). */
/* The masked tiles' scan (fa_mma_scan_rows) zeroes exactly the non-finite halves of a b16x2 word: every
 * bf16 and f16 bit pattern, in either half, next to a finite and a non-finite neighbour. */
Test(mma_emulated, b16x2_finite_zeroes_exactly_the_non_finite_halves) {
  for (int f16 = 0; f16 <= 1; f16++) {
    const uint32_t fin = f16 ? 0x3c00u : 0x3f80u, inf = f16 ? 0x7c00u : 0x7f80u; /* 1.0 and +inf */
    for (uint32_t h = 0; h <= 0xffffu; h++) {
      const float x = f16 ? fa_f16_to_f32((uint16_t)h) : fa_bf16_to_f32((uint16_t)h);
      const uint32_t keep = isfinite(x) ? h : 0u;
      for (int other = 0; other < 2; other++) {
        const uint32_t o = other ? inf : fin, ko = other ? 0u : fin;
        cr_assert_eq(fa_b16x2_finite(h | o << 16, f16), keep | ko << 16, "f16=%d lo=%04x hi=%04x", f16, h, o);
        cr_assert_eq(fa_b16x2_finite(o | h << 16, f16), ko | keep << 16, "f16=%d lo=%04x hi=%04x", f16, o, h);
      }
    }
  }
}

/* fa_mma_store_rows stores a lane's two columns as one f32 or b16 pair: the
 * same bits as fa_store one element at a time (round to nearest even; NaN
 * where flagged), every element of the lane's two rows written, nothing else
 * touched (the buffer is poisoned), rows outside the block (ok = 0) left alone.
 * Values include overflow to infinity, f16 subnormals and NaN inputs. */
Test(mma_emulated, store_rows_pairs_match_elementwise_stores) {
  tc_rng rng = tc_rng_for("mma_emulated.store_rows");
  const int dtypes[3] = {FORKATTN_DTYPE_F32, FORKATTN_DTYPE_BF16, FORKATTN_DTYPE_F16};
  for (int trial = 0; trial < 240; trial++) {
    const int dt = dtypes[trial % 3], D = trial % 2 ? 128 : 64, es = dt == FORKATTN_DTYPE_F32 ? 4 : 2;
    const int heads = 3, head = (int)tc_randint(&rng, 0, heads - 1), row = (int)tc_randint(&rng, 0, 5);
    const int64_t hs = D + 2 * tc_randint(&rng, 0, 3), rs = heads * hs + 2 * tc_randint(&rng, 0, 3);
    const int64_t n = (row + 9) * rs;
    const int c0 = 2 * (int)tc_randint(&rng, 0, 3), ok0 = trial % 7 != 3, ok1 = trial % 5 != 2;
    const int bad0 = trial % 11 == 4, bad1 = trial % 13 == 6;
    const float m0 = (float)tc_uniform(&rng, -2, 2), m1 = (float)tc_uniform(&rng, -2, 2);
    fa_f4 acc[16];
    float *v = (float *)acc;
    for (int i = 0; i < D / 2; i++) {
      const int kind = (int)tc_randint(&rng, 0, 9);
      v[i] = kind == 0   ? (float)tc_uniform(&rng, -1e-6, 1e-6)        /* f16 subnormals */
             : kind == 1 ? (float)tc_uniform(&rng, 6e4, 3.4e38) /* f16 (and some bf16) overflow */
             : kind == 2 ? NAN
                         : (float)tc_uniform(&rng, -100, 100);
    }
    unsigned char *got = malloc((size_t)n * es), *want = malloc((size_t)n * es);
    memset(got, 0xa5, (size_t)n * es);
    memset(want, 0xa5, (size_t)n * es);
    const fa_dev_tensor t = {got, dt, rs, hs};
    fa_mma_store_rows(t, row, head, acc, D, c0, ok0, ok1, m0, m1, bad0, bad1);
    for (int nn = 0; nn < D / 8; nn++)
      for (int k = 0; k < 4; k++) {
        const int r = k < 2 ? row : row + 8, ok = k < 2 ? ok0 : ok1, bad = k < 2 ? bad0 : bad1;
        const float x = (k < 2 ? m0 : m1) * (&acc[nn].x)[k];
        if (ok) fa_store(want, dt, r * rs + head * hs + nn * 8 + c0 + k % 2, bad ? NAN : x);
      }
    for (int64_t i = 0; i < n; i++) {
      const float g = fa_load(got, dt, i), w = fa_load(want, dt, i);
      if (isnan(w)) cr_assert(isnan(g), "trial %d (dtype %d, D %d): element %lld %g, want NaN", trial, dt, D,
                              (long long)i, (double)g);
      else cr_assert(memcmp(got + i * es, want + i * es, (size_t)es) == 0,
                     "trial %d (dtype %d, D %d): element %lld %g, want %g", trial, dt, D, (long long)i, (double)g,
                     (double)w);
    }
    free(got);
    free(want);
  }
}

/* Tensor-core outputs in device memory need 16-byte rows, like the inputs
 * (fa_wg_store_rows_staged's chunks); host tensors are staged dense. */
Test(mma_emulated, outputs_need_16_byte_rows) {
  static _Alignas(16) uint16_t buf[256];
  forkattn_tensor a = {buf, FORKATTN_DTYPE_BF16, 4, 2, 8, 64, 16}, b = a;
  const forkattn_tensor *t[2] = {&a, &b};
  cr_assert(fa_gpu_mma_out_ok(t, 2, FORKATTN_MEMORY_DEVICE));
  b.data = buf + 2;
  cr_assert(!fa_gpu_mma_out_ok(t, 2, FORKATTN_MEMORY_DEVICE), "4-byte aligned data");
  cr_assert(fa_gpu_mma_out_ok(t, 2, FORKATTN_MEMORY_HOST), "host tensors are staged");
  b.data = buf, b.row_stride = 60;
  cr_assert(!fa_gpu_mma_out_ok(t, 2, FORKATTN_MEMORY_DEVICE), "row stride not a multiple of 8");
  b.row_stride = 64, b.head_stride = 20;
  cr_assert(!fa_gpu_mma_out_ok(t, 2, FORKATTN_MEMORY_DEVICE), "head stride not a multiple of 8");
  b.data = NULL;
  cr_assert(fa_gpu_mma_out_ok(t, 2, FORKATTN_MEMORY_DEVICE), "an output the call does not write");
}

Test(mma_emulated, plans_beyond_32_bit_positions_are_refused) {
  fa_plan p;
  int64_t off[2] = {0, 100};
  cr_assert_eq(fa_plan_prefix(&p, 4096, 1, off, 1), 0);
  cr_assert(fa_mma_plan_fits(&p));
  fa_plan_free(&p);
  cr_assert_eq(fa_plan_prefix(&p, FA_MMA_MAX_POS - 100, 1, off, 1), 0);
  cr_assert(!fa_mma_plan_fits(&p), "%lld rows", (long long)p.rows);
  fa_plan_free(&p);
  cr_assert_eq(fa_plan_prefix(&p, FA_MMA_MAX_POS - 101, 1, off, 1), 0);
  cr_assert(fa_mma_plan_fits(&p), "%lld rows: the last that fits", (long long)p.rows);
  fa_plan_free(&p);
}

Test(mma_emulated, kl_prefix_causal_bf16_d64, .timeout = 600) {
  const int64_t lens[3] = {40, 1, 23};
  kl_case("mma_emulated/kl_prefix_causal_bf16_d64", 70, 3, lens, 1, 4, 2, 1, 64, 0, 0);
}
Test(mma_emulated, kl_prefix_bidir_reverse_f16_d128, .timeout = 600) {
  const int64_t lens[2] = {30, 9};
  kl_case("mma_emulated/kl_prefix_bidir_reverse_f16_d128", 45, 2, lens, 0, 2, 1, 2, 128, 1, 1);
}

/* ---- StreamKL backward ------------------------------------------------------ */

/* The forward's teams give the row statistics; then both sides' dQ teams and
 * dK teams (key units cut at `chunk` reader rows: partial sums, reduced in
 * unit order, as fa_gpu_kl_dk_reduce) against the float64 gradients of
 * sum(g kl), written from the definitions (reference_kl.h's formulas, no
 * kept set): forward KL dL/ds_j = g (S_j - T_j), dL/dt_j = g T_j ((t_j - s_j)
 * - E_T[t - s]); reverse dL/dt_j = g (T_j - S_j), dL/ds_j = g S_j ((s_j - t_j)
 * - E_S[s - t]). g is random with every 5th row 0 (loss-masked). Tolerance:
 * 1e-2 of the largest gradient, as the attention gradients (the score
 * gradients are rounded to 16 bits before their products). */
static void kl_bwd_case(const char *name, int64_t P, int64_t N, const int64_t *lens, int causal, int64_t H,
                        int64_t hkv, int64_t d, int f16, int reverse, int64_t chunk) {
  omp_set_dynamic(0);
  tc_rng rng = tc_rng_for(name);
  const int dt = f16 ? FORKATTN_DTYPE_F16 : FORKATTN_DTYPE_BF16, bk = FA_MMA_BK(d);
  int64_t off[8] = {0};
  fa_plan plan;
  const int64_t T = emu_prefix_plan(&plan, P, N, lens, causal, off), nq = T * H * d, nk = T * hkv * d,
                group = H / hkv;
  const int64_t sizes[4] = {nq, nk, nq, nk}; /* q_t, k_t, q_s, k_s */
  uint16_t *x[4], *grad[4];                  /* grad: dq_t, dk_t, dq_s, dk_s */
  double *rx[4], *rg[4];
  for (int i = 0; i < 4; i++) {
    x[i] = malloc(sizeof(uint16_t) * (size_t)sizes[i]), rx[i] = malloc(sizeof(double) * (size_t)sizes[i]);
    grad[i] = malloc(sizeof(uint16_t) * (size_t)sizes[i]), rg[i] = calloc((size_t)sizes[i], sizeof(double));
    for (int64_t e = 0; e < sizes[i]; e++) {
      x[i][e] = to16(tc_uniform(&rng, -2, 2), f16), rx[i][e] = from16(x[i][e], f16);
      grad[i][e] = to16(NAN, f16); /* poisoned: every element must be written */
    }
  }
  float *kl = malloc(sizeof(float) * (size_t)(T * H)), *stats = malloc(sizeof(float) * (size_t)(T * H * 4));
  float *outside = malloc(sizeof(float) * (size_t)(T * H)), *dkl = malloc(sizeof(float) * (size_t)(T * H));
  for (int64_t i = 0; i < T * H; i++) dkl[i] = i % 5 == 2 ? 0.0f : (float)tc_uniform(&rng, -1, 1);
  fa_block *qb, *kb;
  fa_key_unit *units;
  int64_t *unit_off;
  const int64_t nqb = fa_plan_blocks(&plan, FA_MMA_ROWS, 0, &qb), nkb = fa_plan_blocks(&plan, FA_MMA_ROWS, 1, &kb);
  const int64_t nunits = fa_plan_key_units(&plan, kb, nkb, chunk, &units, &unit_off);
  cr_assert(nqb > 0 && nkb > 0 && nunits >= nkb);
  float *part = nunits > nkb ? malloc(sizeof(float) * (size_t)(nunits * hkv * FA_MMA_ROWS * d)) : NULL;
  const float sct = (float)(0.9 / sqrt((double)d)), scs = (float)(1.1 / sqrt((double)d));
  fa_gpu_kl b;
  memset(&b, 0, sizeof b);
  b.qt = emu_view(x[0], dt, H, d), b.kt = emu_view(x[1], dt, hkv, d), b.qs = emu_view(x[2], dt, H, d);
  b.ks = emu_view(x[3], dt, hkv, d);
  b.dqt = emu_view(grad[0], dt, H, d), b.dkt = emu_view(grad[1], dt, hkv, d), b.dqs = emu_view(grad[2], dt, H, d);
  b.dks = emu_view(grad[3], dt, hkv, d);
  b.seg = plan.seg, b.pair = plan.pair, b.qoff = plan.q_pair_off, b.kidx = plan.k_pair_idx;
  b.qblocks = qb, b.kblocks = kb, b.units = units, b.unit_off = unit_off, b.part = part;
  b.kl = kl, b.stats = stats, b.outside = outside, b.stats_in = stats, b.dkl = dkl;
  b.reverse = reverse, b.teacher_grad = 1, b.nqb = nqb, b.nkb = nkb, b.nunits = nunits, b.krows = FA_MMA_ROWS;
  b.h = H, b.hkv_t = b.hkv_s = hkv, b.dt = b.ds = d, b.st = sct, b.ss = scs, b.loss_mul = 1.0f;
  static _Alignas(16) unsigned short smem[4 * 64 * (128 + 8) + 64];
  cr_assert_geq(sizeof smem, FA_MMA_KL_DQ_SMEM(128, 32));
  cr_assert_geq(sizeof smem, FA_MMA_KL_DK_SMEM(128));
  EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_fwd_team((int)d, bk, f16, b, qb[blk], h, smem));
  for (int teacher = 0; teacher < 2; teacher++) {
    EMU_QUERY_TEAMS(FA_MMA_THREADS, nqb, H, fa_mma_kl_dq_team((int)d, bk, f16, b, qb[blk], h, teacher, smem));
    for (int64_t u = 0; u < nunits; u++)
      for (int64_t g = 0; g < hkv; g++) EMU_TEAM(fa_mma_kl_dk_team((int)d, f16, b, u, g, teacher, smem));
    if (part) /* as fa_gpu_kl_dk_reduce: each block's units in order */
      for (int64_t blk = 0; blk < nkb; blk++)
        for (int64_t g = 0; g < hkv; g++)
          for (int64_t row = 0; row < kb[blk].len; row++)
            for (int64_t e = 0; e < d; e++)
              grad[teacher ? 1 : 3][((kb[blk].start + row) * hkv + g) * d + e] =
                  to16(emu_unit_sum(part, unit_off, blk, hkv, g, FA_MMA_ROWS, row, d, e), f16);
  }
  double *t = malloc(sizeof(double) * (size_t)T), *sv = malloc(sizeof(double) * (size_t)T);
  const kl_ref_shape shape = {P, N, H, hkv, hkv, d, T, off, causal, sct, scs};
  for (int64_t i = 0; i < T; i++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t g = h / group;
      double mt, ms, zt = 0, zs = 0, E = 0;
      kl_ref_scores(&shape, rx, i, h, t, sv, &mt, &ms);
      for (int64_t j = 0; j < T; j++)
        if (prefix_sees(causal, P, off, N, i, j)) zt += exp(t[j] - mt), zs += exp(sv[j] - ms);
      for (int64_t j = 0; j < T; j++)
        if (prefix_sees(causal, P, off, N, i, j)) {
          const double pt = exp(t[j] - mt) / zt, ps = exp(sv[j] - ms) / zs;
          E += reverse ? ps * (sv[j] - t[j]) : pt * (t[j] - sv[j]);
        }
      const double gr = dkl[i * H + h];
      for (int64_t j = 0; j < T; j++) {
        if (!prefix_sees(causal, P, off, N, i, j)) continue;
        const double pt = exp(t[j] - mt) / zt, ps = exp(sv[j] - ms) / zs;
        const double dts = reverse ? gr * (pt - ps) : gr * pt * ((t[j] - sv[j]) - E);
        const double dss = reverse ? gr * ps * ((sv[j] - t[j]) - E) : gr * (ps - pt);
        for (int64_t e = 0; e < d; e++) {
          rg[0][(i * H + h) * d + e] += dts * sct * rx[1][(j * hkv + g) * d + e];
          rg[1][(j * hkv + g) * d + e] += dts * sct * rx[0][(i * H + h) * d + e];
          rg[2][(i * H + h) * d + e] += dss * scs * rx[3][(j * hkv + g) * d + e];
          rg[3][(j * hkv + g) * d + e] += dss * scs * rx[2][(i * H + h) * d + e];
        }
      }
    }
  const char *what[4] = {"dq_t", "dk_t", "dq_s", "dk_s"};
  for (int i = 0; i < 4; i++) {
    int64_t nonfinite = 0;
    const double err = rel_err(grad[i], rg[i], sizes[i], f16, &nonfinite);
    cr_assert_eq(nonfinite, 0, "%s: %lld non-finite (or unwritten) %s elements", name, (long long)nonfinite, what[i]);
    cr_assert_leq(err, 1e-2, "%s: %s relative error %.3g", name, what[i], err);
    cr_log_info("%s: %s relative error %.2g", name, what[i], err);
  }
  free(t), free(sv), free(qb), free(kb), free(units), free(unit_off), free(part);
  free(kl), free(stats), free(outside), free(dkl);
  for (int i = 0; i < 4; i++) free(x[i]), free(rx[i]), free(grad[i]), free(rg[i]);
  fa_plan_free(&plan);
}

/* 4 query / 2 KV heads, forward KL, no split key block */
Test(mma_emulated, kl_bwd_prefix_causal_bf16_d64, .timeout = 600) {
  const int64_t lens[3] = {30, 1, 13};
  kl_bwd_case("mma_emulated/kl_bwd_prefix_causal_bf16_d64", 40, 3, lens, 1, 4, 2, 64, 0, 0, INT64_MAX);
}
/* reverse KL, head_dim 128 (16-query dK tiles), the prompt's key blocks cut into units of 24 reader rows */
Test(mma_emulated, kl_bwd_prefix_causal_reverse_f16_d128, .timeout = 600) {
  const int64_t lens[2] = {20, 31};
  kl_bwd_case("mma_emulated/kl_bwd_prefix_causal_reverse_f16_d128", 80, 2, lens, 1, 2, 1, 128, 1, 1, 24);
}
/* bidirectional, forward KL, head_dim 128 in bf16 */
Test(mma_emulated, kl_bwd_prefix_bidir_bf16_d128, .timeout = 600) {
  const int64_t lens[2] = {17, 30};
  kl_bwd_case("mma_emulated/kl_bwd_prefix_bidir_bf16_d128", 40, 2, lens, 0, 2, 1, 128, 0, 0, INT64_MAX);
}
