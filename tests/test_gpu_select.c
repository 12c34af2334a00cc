/* The GPU kernel decision table (offload/gpu_select.h) on the host: the
 * default kernel of every pass per shape, the fallbacks when the build, team
 * memory, tensor maps or the call's shape rule a family out, the knobs, and
 * their reading from options and the environment. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "gpu_finite_check_policy.h"
#include "gpu_persist.h"
#include "gpu_select.h"

#define KB ((size_t)1024)

/* An sm_90a build on an H100-like device: 227 KB of team memory, 132 SMs; each wgmma kernel's
 * team memory is a stand-in below that (the real sizes come from the team headers). */
static fa_gpu_caps h100(void) {
  fa_gpu_caps c = {.wgmma = 1, .team_memory = 227 * KB, .sms = 132};
  const fa_gpu_pass wg[3] = {FA_PASS_FWD, FA_PASS_DQ, FA_PASS_DKV};
  for (int i = 0; i < 3; i++) {
    c.wg_smem[wg[i]][0] = 100 * KB;
    c.wg_smem[wg[i]][1] = 200 * KB;
  }
  c.split_smem[FA_PASS_FWD][0] = 72 * KB, c.split_smem[FA_PASS_FWD][1] = 68 * KB;
  c.split_smem[FA_PASS_KL_FWD][0] = 100 * KB, c.split_smem[FA_PASS_KL_FWD][1] = 120 * KB;
  c.split_smem[FA_PASS_DQ][0] = 108 * KB, c.split_smem[FA_PASS_DQ][1] = 153 * KB;
  c.split_smem[FA_PASS_DKV][0] = 109 * KB, c.split_smem[FA_PASS_DKV][1] = 154 * KB;
  c.split_smem[FA_PASS_KL_BWD][0] = 110 * KB, c.split_smem[FA_PASS_KL_BWD][1] = 155 * KB;
  return c;
}

static const fa_gpu_knobs auto_knobs = {.kernels = FORKATTN_GPU_KERNELS_AUTO, .persist = -1};

/* A bf16/f16 call with aligned rows at head_dim d whose maps encode. */
static fa_gpu_call half_call(int64_t d) {
  return (fa_gpu_call){.half = 1, .d = d, .rows16 = 1, .same_d = 1, .same_kv_heads = 1, .tma = 1};
}

static fa_gpu_kernel sel(const fa_gpu_caps *c, const fa_gpu_knobs *k, fa_gpu_pass p, fa_gpu_call call) {
  return fa_gpu_select(c, k, p, &call);
}

/* Every pass of call on (c, k) gives want[pass]. */
static void expect_all(const fa_gpu_caps *c, const fa_gpu_knobs *k, fa_gpu_call call, const fa_gpu_kernel *want,
                       const char *what) {
  for (int p = 0; p < FA_PASSES; p++)
    cr_expect_eq(sel(c, k, (fa_gpu_pass)p, call), want[p], "%s, d=%lld: pass %d runs %s, want %s", what,
                 (long long)call.d, p, fa_gpu_kernel_name((fa_gpu_pass)p, sel(c, k, (fa_gpu_pass)p, call)),
                 fa_gpu_kernel_name((fa_gpu_pass)p, want[p]));
}

Test(gpu_select, defaults_per_head_dim_on_an_sm90a_build) {
  const fa_gpu_caps c = h100();
  const fa_gpu_kernel d64[FA_PASSES] = {FA_KERNEL_WG_PAIR, FA_KERNEL_WG_PAIR, FA_KERNEL_WG_KEY_MAJOR, FA_KERNEL_MMA,
                                        FA_KERNEL_MMA};
  const fa_gpu_kernel d128[FA_PASSES] = {FA_KERNEL_WG_PAIR, FA_KERNEL_WG_PAIR, FA_KERNEL_WG_PAIR, FA_KERNEL_MMA,
                                         FA_KERNEL_MMA};
  expect_all(&c, &auto_knobs, half_call(64), d64, "default");
  expect_all(&c, &auto_knobs, half_call(128), d128, "default");
}

Test(gpu_select, other_shapes_run_the_fp32_kernels) {
  const fa_gpu_caps c = h100();
  const fa_gpu_kernel fp32[FA_PASSES] = {FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32,
                                         FA_KERNEL_FP32};
  const int64_t dims[] = {32, 80, 96, 256};
  for (size_t i = 0; i < sizeof dims / sizeof *dims; i++) expect_all(&c, &auto_knobs, half_call(dims[i]), fp32, "head_dim");
  for (int64_t d = 64; d <= 128; d += 64) {
    fa_gpu_call f32 = half_call(d), kept = half_call(d), rows = half_call(d);
    f32.half = 0; /* f32, or mixed dtypes */
    kept.kept = 1;
    rows.rows16 = 0; /* a device tensor's rows not 16-byte aligned, or positions past 32 bits */
    expect_all(&c, &auto_knobs, f32, fp32, "f32");
    expect_all(&c, &auto_knobs, kept, fp32, "kept set");
    expect_all(&c, &auto_knobs, rows, fp32, "unaligned rows");
  }
}

Test(gpu_select, streamkl_needs_one_head_dim_and_the_backward_one_kv_head_count) {
  const fa_gpu_caps c = h100();
  fa_gpu_call two_d = half_call(128), two_kv = half_call(128);
  two_d.same_d = 0;
  two_kv.same_kv_heads = 0;
  cr_expect_eq(sel(&c, &auto_knobs, FA_PASS_KL_FWD, two_d), FA_KERNEL_FP32);
  cr_expect_eq(sel(&c, &auto_knobs, FA_PASS_KL_BWD, two_d), FA_KERNEL_FP32);
  cr_expect_eq(sel(&c, &auto_knobs, FA_PASS_KL_FWD, two_kv), FA_KERNEL_MMA);
  cr_expect_eq(sel(&c, &auto_knobs, FA_PASS_KL_BWD, two_kv), FA_KERNEL_FP32);
}

/* Without wgmma in the build, without the team memory or without the maps, mma.sync. */
Test(gpu_select, wgmma_falls_back_to_mma_sync) {
  const fa_gpu_kernel mma[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA};
  fa_gpu_caps portable = h100(), small = h100();
  portable.wgmma = 0;
  small.team_memory = 48 * KB; /* the runtime's default: the launch forwarder was not installed */
  for (int64_t d = 64; d <= 128; d += 64) {
    expect_all(&portable, &auto_knobs, half_call(d), mma, "no wgmma in the build");
    expect_all(&small, &auto_knobs, half_call(d), mma, "48 KB of team memory");
    fa_gpu_call no_maps = half_call(d);
    no_maps.tma = 0;
    const fa_gpu_caps c = h100();
    expect_all(&c, &auto_knobs, no_maps, mma, "maps refused");
  }
  /* the team memory a kernel needs, exactly, is enough; a byte less is not */
  fa_gpu_caps edge = h100();
  edge.team_memory = edge.wg_smem[FA_PASS_DKV][1];
  cr_expect_eq(sel(&edge, &auto_knobs, FA_PASS_DKV, half_call(128)), FA_KERNEL_WG_PAIR);
  edge.team_memory--;
  cr_expect_eq(sel(&edge, &auto_knobs, FA_PASS_DKV, half_call(128)), FA_KERNEL_MMA);
  cr_expect_eq(sel(&edge, &auto_knobs, FA_PASS_DKV, half_call(64)), FA_KERNEL_WG_KEY_MAJOR, "its own size at 64");
  /* a pass without a wgmma kernel in the image */
  fa_gpu_caps none = h100();
  none.wg_smem[FA_PASS_DQ][1] = 0;
  cr_expect_eq(sel(&none, &auto_knobs, FA_PASS_DQ, half_call(128)), FA_KERNEL_MMA);
}

Test(gpu_select, the_kernel_family_knob_caps_the_choice) {
  const fa_gpu_caps c = h100();
  const fa_gpu_knobs mma_k = {.kernels = FORKATTN_GPU_KERNELS_MMA, .persist = -1};
  const fa_gpu_knobs fp32_k = {.kernels = FORKATTN_GPU_KERNELS_FP32, .persist = -1};
  const fa_gpu_kernel mma[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA};
  const fa_gpu_kernel fp32[FA_PASSES] = {FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32,
                                         FA_KERNEL_FP32};
  for (int64_t d = 64; d <= 128; d += 64) {
    expect_all(&c, &mma_k, half_call(d), mma, "kernels=mma");
    expect_all(&c, &fp32_k, half_call(d), fp32, "kernels=fp32");
  }
  fa_gpu_call f32 = half_call(128);
  f32.half = 0;
  expect_all(&c, &mma_k, f32, fp32, "kernels=mma, f32");
}

/* f32 inputs at d 64 / 128: every pass on mma.sync with bf16 pieces (3 for the score inputs at HIGH, 2
 * at MEDIUM; every input of the attention passes, StreamKL's four score inputs), HIGHEST on the FP32
 * kernels; the shape rules, each pass's team memory and the family knob hold as for bf16. */
Test(gpu_select, f32_forward_runs_split_on_mma_sync) {
  const fa_gpu_caps c = h100();
  const fa_gpu_knobs medium = {.persist = -1, .f32 = FORKATTN_F32_PRECISION_MEDIUM};
  const fa_gpu_knobs highest = {.persist = -1, .f32 = FORKATTN_F32_PRECISION_HIGHEST};
  const fa_gpu_knobs mma_k = {.kernels = FORKATTN_GPU_KERNELS_MMA, .persist = -1};
  const fa_gpu_knobs fp32_k = {.kernels = FORKATTN_GPU_KERNELS_FP32, .persist = -1};
  const fa_gpu_kernel split[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA,
                                          FA_KERNEL_MMA};
  const fa_gpu_kernel forwards[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_MMA,
                                             FA_KERNEL_FP32};
  const fa_gpu_kernel no_dkv[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_FP32, FA_KERNEL_MMA,
                                           FA_KERNEL_FP32};
  const fa_gpu_kernel no_kl_bwd[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA, FA_KERNEL_MMA,
                                              FA_KERNEL_FP32};
  const fa_gpu_kernel fwd_only[FA_PASSES] = {FA_KERNEL_MMA, FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32,
                                             FA_KERNEL_FP32};
  const fa_gpu_kernel fp32[FA_PASSES] = {FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32, FA_KERNEL_FP32,
                                         FA_KERNEL_FP32};
  for (int64_t d = 64; d <= 128; d += 64) {
    fa_gpu_call f32 = half_call(d);
    f32.half = 0, f32.f32 = 1;
    expect_all(&c, &auto_knobs, f32, split, "f32, HIGH");
    expect_all(&c, &medium, f32, split, "f32, MEDIUM");
    expect_all(&c, &mma_k, f32, split, "f32, kernels=mma");
    expect_all(&c, &highest, f32, fp32, "f32, HIGHEST");
    expect_all(&c, &fp32_k, f32, fp32, "f32, kernels=fp32");
    fa_gpu_call kept = f32, rows = f32;
    kept.kept = 1, rows.rows16 = 0;
    expect_all(&c, &auto_knobs, kept, fp32, "f32, kept set");
    expect_all(&c, &auto_knobs, rows, fp32, "f32, unaligned rows");
    fa_gpu_caps small = c;
    small.team_memory = c.split_smem[FA_PASS_FWD][d == 128] - 1;
    expect_all(&small, &auto_knobs, f32, fp32, "f32, team memory a byte short");
    small.team_memory++;
    expect_all(&small, &auto_knobs, f32, fwd_only, "f32, the forward's team memory exactly");
    small.team_memory = c.split_smem[FA_PASS_KL_FWD][d == 128];
    expect_all(&small, &auto_knobs, f32, forwards, "f32, StreamKL's team memory exactly");
    small.team_memory = c.split_smem[FA_PASS_DQ][d == 128];
    expect_all(&small, &auto_knobs, f32, no_dkv, "f32, the dQ's team memory exactly");
    small.team_memory = c.split_smem[FA_PASS_DKV][d == 128];
    expect_all(&small, &auto_knobs, f32, no_kl_bwd, "f32, the dK/dV's team memory exactly");
    small.team_memory = c.split_smem[FA_PASS_KL_BWD][d == 128];
    expect_all(&small, &auto_knobs, f32, split, "f32, the StreamKL backward's team memory exactly");
    fa_gpu_call two_kv = f32;
    two_kv.same_kv_heads = 0;
    cr_expect_eq(sel(&c, &auto_knobs, FA_PASS_KL_BWD, two_kv), FA_KERNEL_FP32, "StreamKL sides of two KV head counts");
    fa_gpu_call two_d = f32;
    two_d.same_d = 0;
    cr_expect_eq(sel(&c, &auto_knobs, FA_PASS_KL_FWD, two_d), FA_KERNEL_FP32, "StreamKL sides of two head_dims");
    int qk, v;
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_FWD, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 3 && v == 3, "HIGH: %d, %d", qk, v);
    fa_gpu_select_pieces(&medium, FA_PASS_FWD, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 2 && v == 2, "MEDIUM: %d, %d", qk, v);
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_FWD, FA_KERNEL_FP32, &f32, &qk, &v);
    cr_expect(qk == 0 && v == 0, "FP32 kernel");
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_DQ, FA_KERNEL_FP32, &f32, &qk, &v);
    cr_expect(qk == 0 && v == 0, "dQ, FP32 kernel");
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_DQ, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 3 && v == 3, "dQ, HIGH: %d, %d", qk, v);
    fa_gpu_select_pieces(&medium, FA_PASS_DKV, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 2 && v == 2, "dK/dV, MEDIUM: %d, %d", qk, v);
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_KL_BWD, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 3 && v == 0, "StreamKL backward, HIGH: %d, %d", qk, v);
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_KL_FWD, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 3 && v == 0, "StreamKL, HIGH: %d, %d", qk, v);
    fa_gpu_select_pieces(&medium, FA_PASS_KL_FWD, FA_KERNEL_MMA, &f32, &qk, &v);
    cr_expect(qk == 2 && v == 0, "StreamKL, MEDIUM: %d, %d", qk, v);
    const fa_gpu_call bf16 = half_call(d);
    fa_gpu_select_pieces(&auto_knobs, FA_PASS_FWD, FA_KERNEL_MMA, &bf16, &qk, &v);
    cr_expect(qk == 0 && v == 0, "bf16 stays whole");
  }
  fa_gpu_call f32_96 = half_call(96);
  f32_96.half = 0, f32_96.f32 = 1;
  expect_all(&c, &auto_knobs, f32_96, fp32, "f32, head_dim 96");
  char buf[384];
  fa_gpu_select_describe(&c, &auto_knobs, buf, sizeof buf);
  const char *all = "; f32 as bf16x6 on mma.sync: forward, dQ, dK/dV, StreamKL forward, StreamKL backward; other "
                    "calls fp32";
  cr_expect(strstr(buf, all), "%s", buf);
  fa_gpu_select_describe(&c, &medium, buf, sizeof buf);
  cr_expect(strstr(buf, "; f32 as bf16x3 on mma.sync: forward, dQ,"), "%s", buf);
  fa_gpu_caps caps_no_dkv = c;
  caps_no_dkv.split_smem[FA_PASS_DKV][1] = 0;
  fa_gpu_select_describe(&caps_no_dkv, &auto_knobs, buf, sizeof buf);
  cr_expect(strstr(buf, "on mma.sync: forward, dQ, StreamKL forward, StreamKL backward; other calls fp32"), "%s", buf);
  fa_gpu_select_describe(&c, &highest, buf, sizeof buf);
  cr_expect(!strstr(buf, "f32 as") && strstr(buf, "other calls fp32"), "%s", buf);
}

Test(gpu_select, the_wgmma_kernels_load_by_bulk_copies) {
  cr_expect(fa_gpu_select_needs_tma(FA_KERNEL_WG_PAIR));
  cr_expect(fa_gpu_select_needs_tma(FA_KERNEL_WG_KEY_MAJOR));
  cr_expect(!fa_gpu_select_needs_tma(FA_KERNEL_MMA));
  cr_expect(!fa_gpu_select_needs_tma(FA_KERNEL_FP32));
}

Test(gpu_select, persistent_teams_only_for_the_two_warpgroup_forward_and_dq) {
  const fa_gpu_caps c = h100();
  const int64_t many = (int64_t)FA_PERSIST_MIN_ITEMS_PER_SM * c.sms, few = many - 1;
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_WG_PAIR, many, 4600), c.sms);
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_DQ, FA_KERNEL_WG_PAIR, many, 4600), c.sms);
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_WG_PAIR, few, 4600), 0, "auto: too few items");
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_DQ, FA_KERNEL_WG_PAIR, many, 320), 0, "auto: short items");
  /* short items: the forward streams them (grid < 0) from two items an SM */
  const int64_t two = (int64_t)FA_STREAM_MIN_ITEMS_PER_SM * c.sms;
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_WG_PAIR, many, 320), -c.sms);
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_WG_PAIR, two, 320), -c.sms, "the threshold");
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_WG_PAIR, two - 1, 320), 0, "just below it");
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_WG_PAIR, two, FA_PERSIST_MIN_KEYS_PER_ITEM),
               0, "long items, too few for persistent teams: a team an item");
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_MMA, many, 320), 0, "mma.sync never");
  const fa_gpu_knobs stream = {.persist = FA_PERSIST_STREAM};
  cr_expect_eq(fa_gpu_select_grid(&c, &stream, FA_PASS_FWD, FA_KERNEL_WG_PAIR, many, 4600), -c.sms, "forced");
  cr_expect_eq(fa_gpu_select_grid(&c, &stream, FA_PASS_FWD, FA_KERNEL_WG_PAIR, 40, 4600), -40, "one team an item at most");
  cr_expect_eq(fa_gpu_select_grid(&c, &stream, FA_PASS_DQ, FA_KERNEL_WG_PAIR, many, 320), 0, "the dQ has none");
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_DKV, FA_KERNEL_WG_PAIR, many, 4600), 0, "the dK/dV never");
  cr_expect_eq(fa_gpu_select_grid(&c, &auto_knobs, FA_PASS_FWD, FA_KERNEL_MMA, many, 4600), 0, "mma.sync never");
  const fa_gpu_knobs never = {.persist = 0}, always = {.persist = 1}, three = {.persist = 3};
  cr_expect_eq(fa_gpu_select_grid(&c, &never, FA_PASS_FWD, FA_KERNEL_WG_PAIR, many, 4600), 0);
  cr_expect_eq(fa_gpu_select_grid(&c, &always, FA_PASS_FWD, FA_KERNEL_WG_PAIR, 40, 4600), 40, "at most one team an item");
  cr_expect_eq(fa_gpu_select_grid(&c, &always, FA_PASS_DQ, FA_KERNEL_WG_PAIR, many, 4600), c.sms);
  cr_expect_eq(fa_gpu_select_grid(&c, &three, FA_PASS_FWD, FA_KERNEL_WG_PAIR, 40, 4600), 3);
  fa_gpu_caps unknown = c;
  unknown.sms = 0;
  cr_expect_eq(fa_gpu_select_grid(&unknown, &always, FA_PASS_FWD, FA_KERNEL_WG_PAIR, many, 4600), 0, "SMs unknown");
}

/* The grid's shapes on an H100 (132 SMs): items = 128-row query blocks x query heads. */
Test(gpu_select, v_is_checked_only_on_launches_of_many_items) {
  const int sms = h100().sms;
  cr_expect(!fa_v_check_pays(sms, 1 * 8), "a tiny call: one block, 8 heads");
  cr_expect(!fa_v_check_pays(sms, 8 * 16), "a GRPO group of 4 x 128 under 512: 8 blocks, 16 heads");
  cr_expect(!fa_v_check_pays(sms, 24 * 8), "a GRPO group of 8 x 256 under 1024: 24 blocks, 8 heads");
  cr_expect(fa_v_check_pays(sms, 32 * 32), "one sequence of 4096 rows, 32 heads");
  cr_expect(fa_v_check_pays(sms, 256 * 14), "256 sequences of 128 rows, 14 heads");
  const int64_t at = (int64_t)FA_V_CHECK_MIN_ITEMS_PER_SM * sms;
  cr_expect(fa_v_check_pays(sms, at) && !fa_v_check_pays(sms, at - 1), "the threshold");
  cr_expect(!fa_v_check_pays(0, 1 << 20), "SMs unknown: the kernel scans");
}

/* The reason a verbose context logs for grid = fa_gpu_select_grid's answer on the same inputs. */
static void expect_reason(const fa_gpu_knobs *k, int64_t nteams, int64_t keys, const char *want) {
  const fa_gpu_caps c = h100();
  char why[160];
  const int grid = fa_gpu_select_grid(&c, k, FA_PASS_FWD, FA_KERNEL_WG_PAIR, nteams, keys);
  fa_gpu_grid_reason(&c, k, nteams, keys, grid, why, sizeof why);
  cr_expect(strstr(why, want), "%lld items, %lld keys: '%s' lacks '%s'", (long long)nteams, (long long)keys, why,
            want);
}

Test(gpu_select, the_verbose_log_says_why_a_launch_is_persistent_or_not) {
  const fa_gpu_caps c = h100();
  const int64_t many = (int64_t)FA_PERSIST_MIN_ITEMS_PER_SM * c.sms;
  char n[64];
  snprintf(n, sizeof n, "%d persistent teams", c.sms);
  expect_reason(&auto_knobs, many, 4600, n);
  expect_reason(&auto_knobs, many, 4600, "8.0 an SM, 4600 keys an item");
  expect_reason(&auto_knobs, many - 1, 4600, "a team an item (persistent from 8 items an SM)");
  snprintf(n, sizeof n, "%d stream teams (short items)", c.sms);
  expect_reason(&auto_knobs, 4096, 320, n);
  expect_reason(&auto_knobs, 2 * c.sms - 1, 320, "a team an item (short items: the forward's stream teams from 2");
  const fa_gpu_knobs stream = {.persist = FA_PERSIST_STREAM};
  expect_reason(&stream, 40, 4600, "40 stream teams (gpu_persist = stream)");
  const fa_gpu_knobs never = {.persist = 0}, three = {.persist = 3};
  expect_reason(&never, many, 4600, "a team an item (gpu_persist = 0)");
  expect_reason(&three, 40, 300, "3 persistent teams (gpu_persist = 3)");
  char tiny[24];
  fa_gpu_grid_reason(&c, &auto_knobs, many, 4600, c.sms, tiny, sizeof tiny);
  cr_expect_lt(strlen(tiny), sizeof tiny, "truncated, terminated");
}

Test(gpu_select, the_summary_names_each_pass) {
  const fa_gpu_caps c = h100();
  char buf[384];
  fa_gpu_select_describe(&c, &auto_knobs, buf, sizeof buf);
  cr_expect(strstr(buf, "forward wgmma two-warpgroup;"), "%s", buf);
  cr_expect(strstr(buf, "dK/dV wgmma key-major (d=64), wgmma two-warpgroup query-major (d=128)"), "%s", buf);
  cr_expect(strstr(buf, "StreamKL backward mma.sync"), "%s", buf);
  cr_expect(strstr(buf, "persistent teams from 8 items an SM, forward stream teams for short items"), "%s", buf);
  char tiny[40];
  fa_gpu_select_describe(&c, &auto_knobs, tiny, sizeof tiny);
  cr_expect_lt(strlen(tiny), sizeof tiny, "truncated, terminated");
}

static void clear_env(void) {
  unsetenv("FORKATTN_GPU_KERNELS");
  unsetenv("FORKATTN_GPU_PERSIST");
  unsetenv("FORKATTN_GPU_TRACE");
  unsetenv("FORKATTN_F32_PRECISION");
  unsetenv("FORKATTN_GPU_DIRECT_LAUNCH");
}

Test(gpu_select, knobs_from_options_then_the_environment, .init = clear_env, .fini = clear_env) {
  forkattn_ctx_options o;
  memset(&o, 0, sizeof o);
  o.gpu_kernels = FORKATTN_GPU_KERNELS_MMA;
  o.gpu_persist = 3;
  fa_gpu_knobs k;
  char err[128];
  cr_assert_eq(fa_gpu_knobs_read(NULL, &k, err, sizeof err), 0);
  cr_expect(k.kernels == FORKATTN_GPU_KERNELS_AUTO && k.persist == -1 && !k.trace && k.direct, "defaults");
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect(k.kernels == FORKATTN_GPU_KERNELS_MMA && k.persist == 3, "options");
  setenv("FORKATTN_GPU_KERNELS", "fp32", 1);
  setenv("FORKATTN_GPU_PERSIST", "0", 1);
  setenv("FORKATTN_GPU_TRACE", "1", 1);
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect(k.kernels == FORKATTN_GPU_KERNELS_FP32 && k.persist == 0 && k.trace, "the environment wins");
  setenv("FORKATTN_GPU_KERNELS", "AUTO", 1);
  setenv("FORKATTN_GPU_PERSIST", "auto", 1);
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect(k.kernels == FORKATTN_GPU_KERNELS_AUTO && k.persist == -1);
  setenv("FORKATTN_GPU_KERNELS", "wgmma2", 1);
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1);
  cr_expect(strstr(err, "FORKATTN_GPU_KERNELS='wgmma2'"), "%s", err);
  unsetenv("FORKATTN_GPU_KERNELS");
  const char *bad_persist[] = {"-1", "x", "2000000", "1.5"};
  for (int i = 0; i < 4; i++) {
    setenv("FORKATTN_GPU_PERSIST", bad_persist[i], 1);
    cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1, "FORKATTN_GPU_PERSIST=%s", bad_persist[i]);
  }
  unsetenv("FORKATTN_GPU_PERSIST");
  o.gpu_kernels = (forkattn_gpu_kernels)7;
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1, "gpu_kernels out of range");
  o.gpu_kernels = FORKATTN_GPU_KERNELS_AUTO;
  o.gpu_persist = FA_PERSIST_STREAM;
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0, "gpu_persist -2: stream teams");
  setenv("FORKATTN_GPU_PERSIST", "Stream", 1);
  o.gpu_persist = 3;
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect_eq(k.persist, FA_PERSIST_STREAM, "FORKATTN_GPU_PERSIST=stream");
  unsetenv("FORKATTN_GPU_PERSIST");
  o.gpu_persist = -3;
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1, "gpu_persist out of range");
  o.gpu_persist = -1;
  setenv("FORKATTN_GPU_DIRECT_LAUNCH", "0", 1);
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect_eq(k.direct, 0, "FORKATTN_GPU_DIRECT_LAUNCH=0: every launch through the offload runtime");
  setenv("FORKATTN_GPU_DIRECT_LAUNCH", "1", 1);
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect_eq(k.direct, 1);
  setenv("FORKATTN_GPU_DIRECT_LAUNCH", "yes", 1);
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1);
  cr_expect(strstr(err, "FORKATTN_GPU_DIRECT_LAUNCH='yes'"), "%s", err);
}

Test(gpu_select, f32_precision_from_options_then_the_environment, .init = clear_env, .fini = clear_env) {
  forkattn_ctx_options o;
  memset(&o, 0, sizeof o);
  fa_gpu_knobs k;
  char err[128];
  cr_assert_eq(fa_gpu_knobs_read(NULL, &k, err, sizeof err), 0);
  cr_expect_eq(k.f32, FORKATTN_F32_PRECISION_HIGH, "default");
  o.f32_precision = FORKATTN_F32_PRECISION_MEDIUM;
  cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
  cr_expect_eq(k.f32, FORKATTN_F32_PRECISION_MEDIUM, "options");
  const char *names[] = {"high", "HIGHEST", "Medium"};
  const int want[] = {FORKATTN_F32_PRECISION_HIGH, FORKATTN_F32_PRECISION_HIGHEST, FORKATTN_F32_PRECISION_MEDIUM};
  for (int i = 0; i < 3; i++) {
    setenv("FORKATTN_F32_PRECISION", names[i], 1);
    cr_assert_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), 0);
    cr_expect_eq(k.f32, want[i], "FORKATTN_F32_PRECISION=%s wins", names[i]);
  }
  setenv("FORKATTN_F32_PRECISION", "tf32", 1);
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1);
  cr_expect(strstr(err, "FORKATTN_F32_PRECISION='tf32'"), "%s", err);
  unsetenv("FORKATTN_F32_PRECISION");
  o.f32_precision = (forkattn_f32_precision)3;
  cr_expect_eq(fa_gpu_knobs_read(&o, &k, err, sizeof err), -1, "f32_precision out of range");
  cr_expect(strstr(err, "f32_precision (3)"), "%s", err);
}
