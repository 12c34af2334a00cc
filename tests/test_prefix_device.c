/* Device pointers (FORKATTN_MEMORY_DEVICE) give bitwise the same results as
 * host pointers on the GPU backend, for f32 and bf16, forward and backward.
 * Skipped (and says so) when the context's backend is the CPU: device memory
 * needs the GPU backend, which test_prefix_errors checks. [device only] */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "test_common.h"

#define NT 8 /* q, k, v, o, dout, dq, dk, dv */

static void device_matches_host(const char *name, forkattn_dtype dt) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip(name);
  tc_rng rng = tc_rng_for(name);
  const int64_t P = 77, N = 3, hq = 6, hkv = 2, d = 64;
  int64_t off[4] = {0, 31, 31, 90}; /* an empty response in the middle */
  const int64_t T = P + off[N];
  forkattn_prefix_layout lay = {P, N, off, FORKATTN_MASK_CAUSAL};
  const size_t es = dt == FORKATTN_DTYPE_F32 ? 4 : 2;
  const int64_t heads[NT] = {hq, hkv, hkv, hq, hq, hq, hkv, hkv};
  tc_buf host[NT], back[NT];
  forkattn_tensor th[NT], td[NT];
  void *dev[NT];
  size_t bytes[NT];
  for (int i = 0; i < NT; i++) {
    th[i] = tc_buf_contiguous(&host[i], dt, T, heads[i], d);
    tc_buf_contiguous(&back[i], dt, T, heads[i], d);
    if (i < 3 || i == 4) tc_fill_tensor(&rng, &th[i], -1.0, 1.0);
    bytes[i] = (size_t)(T * heads[i] * d) * es;
    cr_assert_eq(forkattn_device_malloc(ctx, bytes[i], &dev[i]), FORKATTN_OK);
    cr_assert_eq(forkattn_memcpy(ctx, dev[i], FORKATTN_MEMORY_DEVICE, host[i].data, FORKATTN_MEMORY_HOST, bytes[i]),
                 FORKATTN_OK);
    td[i] = forkattn_tensor_contiguous(dev[i], dt, T, heads[i], d);
  }
  float lse_h[T * 6], lse_b[T * 6];
  void *lse_d;
  cr_assert_eq(forkattn_device_malloc(ctx, sizeof lse_h, &lse_d), FORKATTN_OK);
  const float scale = 0.125f;
  cr_assert_eq(forkattn_prefix_fwd(ctx, &lay, &th[0], &th[1], &th[2], &th[3], lse_h, scale, FORKATTN_MEMORY_HOST),
               FORKATTN_OK);
  cr_assert_eq(forkattn_prefix_bwd(ctx, &lay, &th[0], &th[1], &th[2], &th[3], &th[4], lse_h, &th[5], &th[6], &th[7],
                                   scale, FORKATTN_MEMORY_HOST),
               FORKATTN_OK);
  cr_assert_eq(forkattn_prefix_fwd(ctx, &lay, &td[0], &td[1], &td[2], &td[3], lse_d, scale, FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_prefix_bwd(ctx, &lay, &td[0], &td[1], &td[2], &td[3], &td[4], lse_d, &td[5], &td[6], &td[7],
                                   scale, FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  for (int i = 3; i < NT; i++) {
    if (i == 4) continue;
    cr_assert_eq(forkattn_memcpy(ctx, back[i].data, FORKATTN_MEMORY_HOST, dev[i], FORKATTN_MEMORY_DEVICE, bytes[i]),
                 FORKATTN_OK);
    cr_assert(memcmp(back[i].data, host[i].data, bytes[i]) == 0, "%s: tensor %d differs between device and host memory",
              name, i);
  }
  cr_assert_eq(forkattn_memcpy(ctx, lse_b, FORKATTN_MEMORY_HOST, lse_d, FORKATTN_MEMORY_DEVICE, sizeof lse_b), FORKATTN_OK);
  cr_assert(memcmp(lse_b, lse_h, sizeof lse_b) == 0, "%s: lse differs", name);
  for (int i = 0; i < NT; i++) {
    forkattn_device_free(ctx, dev[i]);
    tc_buf_free(&host[i]);
    tc_buf_free(&back[i]);
  }
  forkattn_device_free(ctx, lse_d);
  forkattn_ctx_destroy(ctx);
}

Test(memory, device_pointers_match_host_f32) { device_matches_host("memory/device_f32", FORKATTN_DTYPE_F32); }
Test(memory, device_pointers_match_host_bf16) { device_matches_host("memory/device_bf16", FORKATTN_DTYPE_BF16); }

/* The GPU backend unlocks team memory past CUDA's 48 KB default under LLVM
 * 19's runtime (offload/gpu_team_memory.c) and checks it with a kernel that
 * uses 64 KB; the backend reason reports the result. Every device the
 * offload build targets (sm_90) allows more than 48 KB, so anything else
 * means the unlock or its check failed. [device only] */
Test(memory, team_memory_past_48kb) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip("memory/team_memory");
  const char *why = forkattn_ctx_backend_reason(ctx), *at = strstr(why, "team memory up to ");
  cr_assert_not_null(at, "backend reason without team memory: %s", why);
  const long kb = strtol(at + strlen("team memory up to "), NULL, 10);
  const char *e = getenv("FORKATTN_GPU_TEAM_MEMORY");
  if (e && !strcmp(e, "runtime"))
    cr_assert_eq(kb, 48, "%s", why);
  else
    cr_assert_gt(kb, 48, "team memory not unlocked: %s", why);
  forkattn_ctx_destroy(ctx);
}
