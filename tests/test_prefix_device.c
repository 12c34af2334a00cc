/* Device pointers (FORKATTN_MEMORY_DEVICE) give bitwise the same results as
 * host pointers on the GPU backend, for f32 and bf16, forward and backward;
 * bf16 outputs too misaligned for the tensor-core stores take the FP32
 * kernels and match the float64 reference. Skipped (and says so) when the context's backend is the CPU: device memory
 * needs the GPU backend, which test_prefix_errors checks. [device only] */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "prefix_harness.h"
#include "reference.h"
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
  cr_assert_gt(kb, 48, "team memory not unlocked: %s", why);
  forkattn_ctx_destroy(ctx);
}

/* A bf16 [T, H, d] tensor in device memory whose rows are `pad` elements longer than H * d, poisoned
 * (all-ones bytes, the padding included) on the host and copied up; `host` keeps the image. */
typedef struct padded {
  uint16_t *host;
  void *dev;
  size_t bytes;
  forkattn_tensor t; /* over dev */
} padded;

static void padded_init(padded *x, forkattn_ctx *ctx, int64_t T, int64_t H, int64_t d, int64_t pad,
                        const double *values) {
  const int64_t rs = H * d + pad;
  x->bytes = sizeof(uint16_t) * (size_t)(T * rs);
  x->host = malloc(x->bytes);
  cr_assert_not_null(x->host);
  memset(x->host, 0xff, x->bytes);
  forkattn_tensor h = {x->host, FORKATTN_DTYPE_BF16, T, H, d, rs, d};
  if (values)
    for (int64_t r = 0; r < T; r++)
      for (int64_t k = 0; k < H; k++)
        for (int64_t c = 0; c < d; c++) ref_tensor_set(&h, r, k, c, values[(r * H + k) * d + c]);
  cr_assert_eq(forkattn_device_malloc(ctx, x->bytes, &x->dev), FORKATTN_OK);
  cr_assert_eq(forkattn_memcpy(ctx, x->dev, FORKATTN_MEMORY_DEVICE, x->host, FORKATTN_MEMORY_HOST, x->bytes),
               FORKATTN_OK);
  x->t = h;
  x->t.data = x->dev;
}

/* Copy x back, check its padding still holds the poison and every element was written, and return
 * its elements as contiguous doubles. */
static double *padded_result(padded *x, forkattn_ctx *ctx, const char *name) {
  cr_assert_eq(forkattn_memcpy(ctx, x->host, FORKATTN_MEMORY_HOST, x->dev, FORKATTN_MEMORY_DEVICE, x->bytes),
               FORKATTN_OK);
  forkattn_tensor h = x->t;
  h.data = x->host;
  const int64_t T = h.rows, H = h.heads, d = h.head_dim;
  double *out = malloc(sizeof(double) * (size_t)(T * H * d));
  cr_assert_not_null(out);
  for (int64_t r = 0; r < T; r++) {
    for (int64_t e = H * d; e < h.row_stride; e++)
      cr_assert_eq(x->host[r * h.row_stride + e], 0xffff, "%s: row %lld's padding was written", name, (long long)r);
    for (int64_t e = 0; e < H * d; e++)
      cr_assert_neq(x->host[r * h.row_stride + e], 0xffff, "%s: row %lld element %lld unwritten", name, (long long)r,
                    (long long)e);
    for (int64_t k = 0; k < H; k++)
      for (int64_t c = 0; c < d; c++) out[(r * H + k) * d + c] = ref_tensor_get(&h, r, k, c);
  }
  return out;
}

static void padded_free(padded *x, forkattn_ctx *ctx) {
  forkattn_device_free(ctx, x->dev);
  free(x->host);
}

/* bf16 outputs in device memory whose rows are not 16-byte aligned (row strides H * d + 4: 8-byte
 * steps) cannot take the tensor-core kernels' 16-byte stores: the call runs the FP32 kernels
 * (fa_gpu_mma_out_ok, unit-tested on the host in test_mma_emulated) on the tensor-core-shaped
 * inputs. Checked against the float64 reference at bf16's tolerances, every element written, the
 * padding between rows untouched. [device only] */
Test(memory, misaligned_device_outputs_fall_back_to_the_fp32_kernels) {
  forkattn_ctx *ctx = tc_gpu_ctx_or_skip("memory/misaligned_outputs");
  tc_rng rng = tc_rng_for("memory/misaligned_outputs");
  const ph_case c = {.P = 96, .N = 2, .lens = {40, 57}, .hq = 4, .hkv = 2, .d = 64, .mask = FORKATTN_MASK_CAUSAL,
                     .dtype = FORKATTN_DTYPE_BF16};
  ph_inputs in;
  ph_make_inputs(&in, &c, &rng);
  ph_outputs ref;
  ph_reference(&ref, &in);
  const int64_t T = in.T, hq = in.hq, hkv = in.hkv, d = in.d;
  padded q, k, v, dout, o, dq, dk, dv; /* inputs dense (pad 0, 16-byte rows), outputs padded by 4 */
  padded_init(&q, ctx, T, hq, d, 0, in.q);
  padded_init(&k, ctx, T, hkv, d, 0, in.k);
  padded_init(&v, ctx, T, hkv, d, 0, in.v);
  padded_init(&dout, ctx, T, hq, d, 0, in.dout);
  padded_init(&o, ctx, T, hq, d, 4, NULL);
  padded_init(&dq, ctx, T, hq, d, 4, NULL);
  padded_init(&dk, ctx, T, hkv, d, 4, NULL);
  padded_init(&dv, ctx, T, hkv, d, 4, NULL);
  float *lse_h = malloc(sizeof(float) * (size_t)(T * hq));
  void *lse_d = NULL;
  cr_assert_eq(forkattn_device_malloc(ctx, sizeof(float) * (size_t)(T * hq), &lse_d), FORKATTN_OK);
  const float scale = (float)in.scale;
  cr_assert_eq(forkattn_prefix_fwd(ctx, &in.layout, &q.t, &k.t, &v.t, &o.t, lse_d, scale, FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_prefix_bwd(ctx, &in.layout, &q.t, &k.t, &v.t, &o.t, &dout.t, lse_d, &dq.t, &dk.t, &dv.t, scale,
                                   FORKATTN_MEMORY_DEVICE),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  cr_assert_eq(forkattn_memcpy(ctx, lse_h, FORKATTN_MEMORY_HOST, lse_d, FORKATTN_MEMORY_DEVICE,
                               sizeof(float) * (size_t)(T * hq)),
               FORKATTN_OK);
  ph_outputs got = {padded_result(&o, ctx, "o"), malloc(sizeof(double) * (size_t)(T * hq)),
                    padded_result(&dq, ctx, "dq"), padded_result(&dk, ctx, "dk"), padded_result(&dv, ctx, "dv")};
  cr_assert_not_null(got.lse);
  for (int64_t i = 0; i < T * hq; i++) got.lse[i] = lse_h[i];
  ph_check(&got, &ref, &in, (ph_tol){0, 0, 0}, "memory/misaligned_outputs");
  padded *all[8] = {&q, &k, &v, &dout, &o, &dq, &dk, &dv};
  for (int i = 0; i < 8; i++) padded_free(all[i], ctx);
  forkattn_device_free(ctx, lse_d);
  free(lse_h);
  ph_free_outputs(&got);
  ph_free_outputs(&ref);
  ph_free_inputs(&in);
  forkattn_ctx_destroy(ctx);
}
