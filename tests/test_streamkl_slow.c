/*
 * test_streamkl_slow.c - StreamKL at training shapes (label slow, not in CI):
 * the same checks as test_streamkl.c (klh_run: poisoned outputs, guards,
 * every element written, inputs untouched, kl >= -1e-6, kl / stats /
 * outside_mass / gradients against the float64 reference within the
 * tolerances derived in reference_kl.c) on shapes whose float64 reference
 * takes seconds to minutes:
 *  - a dense causal sequence of S = 2048 rows at head_dim 128;
 *  - 3 x 423 rows (a 423-row prompt and two 423-row responses) with the
 *    teacher's 32 query / 8 KV heads at d 64 against the student's 32 / 4 at
 *    d 32, both directions, teacher gradients;
 *  - peaked rows (q x30) and tau = 2 with tau^2 at 3 x 423;
 *  - a 50% block mask and kept lists at S = 2048.
 * FORKATTN_TEST_SEED=<n> reproduces a run.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference_kl.h"
#include "test_common.h"

#define F32 FORKATTN_DTYPE_F32
#define BF16 FORKATTN_DTYPE_BF16

Test(slow, dense_causal_2048_d128, .timeout = 3600) {
  const forkattn_prefix_layout p = {2048, 0, NULL, FORKATTN_MASK_CAUSAL};
  klh_case c = {.layout = {&p, NULL}, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 128, .ds = 128, .dtype_t = F32,
                .dtype_s = F32, .noise = 0.3, .teacher_grad = 1};
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "slow/dense2048_d128_forward", "slow/dense2048_d128_reverse", NULL, NULL);
  c.dtype_t = c.dtype_s = BF16;
  c.noise = 0;
  klh_run_both(c, "slow/dense2048_d128_bf16_forward", "slow/dense2048_d128_bf16_reverse", NULL, NULL);
}

static const int64_t off3[3] = {0, 423, 846};

Test(slow, gqa_32_8_d64_vs_32_4_d32_3x423, .timeout = 3600) {
  const forkattn_prefix_layout p = {423, 2, off3, FORKATTN_MASK_CAUSAL};
  klh_case c = {.layout = {&p, NULL}, .H = 32, .hkv_t = 8, .hkv_s = 4, .dt = 64, .ds = 32, .dtype_t = F32,
                .dtype_s = F32, .teacher_grad = 1};
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "slow/gqa_3x423_forward", "slow/gqa_3x423_reverse", NULL, NULL);
}

Test(slow, peaked_and_tau_3x423, .timeout = 3600) {
  const forkattn_prefix_layout p = {423, 2, off3, FORKATTN_MASK_CAUSAL};
  klh_case c = {.layout = {&p, NULL}, .H = 4, .hkv_t = 2, .hkv_s = 1, .dt = 64, .ds = 64, .dtype_t = F32,
                .dtype_s = F32, .qamp_t = 30.0, .qamp_s = 30.0, .teacher_grad = 1};
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "slow/peaked30_3x423_forward", "slow/peaked30_3x423_reverse", NULL, NULL);
  c.qamp_t = c.qamp_s = 10.0;
  c.opt = klh_options(0, 2.0f, 1);
  klh_run_both(c, "slow/peaked10_tau2_3x423_forward", "slow/peaked10_tau2_3x423_reverse", NULL, NULL);
  const forkattn_prefix_layout b = {423, 2, off3, FORKATTN_MASK_BIDIRECTIONAL};
  c.layout = (forkattn_layout){&b, NULL};
  c.qamp_t = c.qamp_s = 0;
  c.strided = 1;
  klh_run_both(c, "slow/bidir_tau2_strided_3x423_forward", "slow/bidir_tau2_strided_3x423_reverse", NULL, NULL);
}

Test(slow, sparse_2048, .timeout = 3600) {
  tc_rng rng = tc_rng_for("slow/sparse_2048.shape");
  const int64_t T = 2048, nb = 32, heads = 2, cr = 1536;
  const forkattn_prefix_layout p = {T, 0, NULL, FORKATTN_MASK_CAUSAL};
  unsigned char *bm = malloc((size_t)(heads * nb * nb));
  int64_t off[3] = {0, 0, 0}, *idx = malloc(sizeof(int64_t) * (size_t)(heads * cr));
  cr_assert(bm && idx);
  for (int64_t h = 0; h < heads; h++)
    for (int64_t i = 0; i < nb; i++)
      for (int64_t j = 0; j < nb; j++)
        bm[(h * nb + i) * nb + j] = (h == 0 && i == j) ? 1 : (unsigned char)tc_randint(&rng, 0, 1);
  int64_t n = 0;
  for (int64_t h = 0; h < heads; h++) {
    for (int64_t j = 0; j < cr; j++)
      if (j < 4 || tc_uniform(&rng, 0, 1) < 0.25) /* 4 sinks + a quarter of the rest */
        idx[n++] = j;
    off[h + 1] = n;
  }
  const forkattn_kept_set kb = {heads, 0, 0, NULL, NULL, bm};
  klh_case c = {.layout = {&p, NULL}, .kept = &kb, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 64, .ds = 64,
                .dtype_t = F32, .dtype_s = F32, .noise = 0.3, .teacher_grad = 1};
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "slow/blocks2048_forward", "slow/blocks2048_reverse", NULL, NULL);
  const forkattn_kept_set kl = {heads, cr, 1024, off, idx, NULL};
  c.kept = &kl;
  klh_run_both(c, "slow/lists2048_forward", "slow/lists2048_reverse", NULL, NULL);
  free(bm);
  free(idx);
}
