/*
 * test_prefix_slow.c - shared-prompt attention at training sizes against the
 * float64 reference. Not part of CI (CTest label "slow"): the reference alone
 * needs ~1e12 double flops per case, minutes on a small machine.
 *
 *   ctest --test-dir build -L slow --output-on-failure
 *
 * Same checks and tolerances as test_prefix.c (see prefix_harness.c).
 */
#include <criterion/criterion.h>

#include "prefix_harness.h"

#define SLOW_TIMEOUT 3600.0

#define R16(x) x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x

/* The GRPO group of the design's benchmark (N = 16, P = 4096, R = 1024, d = 128). */
Test(slow, grpo_p4096_n16_r1024_causal_f32_h8x2_d128, .timeout = SLOW_TIMEOUT) {
  const ph_case c = {.P = 4096, .N = 16, .lens = {R16(1024)}, .hq = 8, .hkv = 2, .d = 128,
                     .mask = FORKATTN_MASK_CAUSAL, .dtype = FORKATTN_DTYPE_F32};
  ph_run_case("slow/grpo_p4096_n16_r1024_causal_f32_h8x2_d128", &c, (ph_tol){0, 0, 0});
}

Test(slow, p4096_n16_r1024_bidir_f32_h4x1_d256, .timeout = SLOW_TIMEOUT) {
  const ph_case c = {.P = 4096, .N = 16, .lens = {R16(1024)}, .hq = 4, .hkv = 1, .d = 256,
                     .mask = FORKATTN_MASK_BIDIRECTIONAL, .dtype = FORKATTN_DTYPE_F32};
  ph_run_case("slow/p4096_n16_r1024_bidir_f32_h4x1_d256", &c, (ph_tol){0, 0, 0});
}

/* Ragged responses (empty ones included) at size, bf16. */
Test(slow, p4096_n16_ragged_causal_bf16_h16x2_d128, .timeout = SLOW_TIMEOUT) {
  const ph_case c = {.P = 4096, .N = 16,
                     .lens = {1023, 0, 2047, 1, 511, 1537, 0, 255, 1999, 777, 3, 1025, 0, 1301,
                              63, 2047},
                     .hq = 16, .hkv = 2, .d = 128, .mask = FORKATTN_MASK_CAUSAL,
                     .dtype = FORKATTN_DTYPE_BF16};
  ph_run_case("slow/p4096_n16_ragged_causal_bf16_h16x2_d128", &c, (ph_tol){0, 0, 0});
}

/* A long prompt alone (N = 0), f32, d = 256. */
Test(slow, p8192_prompt_alone_causal_f32_h6x2_d256, .timeout = SLOW_TIMEOUT) {
  const ph_case c = {.P = 8192, .N = 0, .hq = 6, .hkv = 2, .d = 256,
                     .mask = FORKATTN_MASK_CAUSAL, .dtype = FORKATTN_DTYPE_F32};
  ph_run_case("slow/p8192_prompt_alone_causal_f32_h6x2_d256", &c, (ph_tol){0, 0, 0});
}
