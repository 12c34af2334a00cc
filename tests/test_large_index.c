/* Index math in 64 bits: tensors whose elements lie more than 2^31 (and 2^32)
 * elements apart give the same results as contiguous copies. The strided
 * tensors live in sparse anonymous mappings (MAP_NORESERVE): only the touched
 * pages are backed, so a span of ~2^33 elements costs a few pages. [host or device] */
#define _DEFAULT_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>

#include "reference.h"
#include "test_common.h"

enum { P = 2, N = 1, R = 2, T = P + R, HQ = 4, HKV = 2, D = 24 };

static void *sparse(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void large_strides(int64_t row_stride, int64_t head_stride, const char *name) {
  forkattn_ctx *ctx = tc_ctx_default(name);
  cr_assert_not_null(ctx);
  tc_rng rng = tc_rng_for(name);
  int64_t off[2] = {0, R};
  forkattn_prefix_layout lay = {P, N, off, FORKATTN_MASK_CAUSAL};
  const int64_t heads[8] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  static float dense[8][T * HQ * D];
  float *big[8];
  size_t bytes[8];
  forkattn_tensor td[8], tb[8];
  for (int i = 0; i < 8; i++) {
    td[i] = forkattn_tensor_contiguous(dense[i], FORKATTN_DTYPE_F32, T, heads[i], D);
    int64_t span = (T - 1) * row_stride + (heads[i] - 1) * head_stride + D;
    cr_assert_gt(span, (int64_t)1 << 31, "the test must exceed 2^31 elements");
    bytes[i] = (size_t)span * sizeof(float);
    big[i] = sparse(bytes[i]);
    cr_assert_not_null(big[i], "mmap of %zu bytes (MAP_NORESERVE) failed", bytes[i]);
    tb[i] = (forkattn_tensor){big[i], FORKATTN_DTYPE_F32, T, heads[i], D, row_stride, head_stride};
    if (i < 3 || i == 4) {
      tc_fill_tensor(&rng, &td[i], -1.0, 1.0);
      double tmp[T * HQ * D];
      ref_tensor_read(&td[i], tmp);
      ref_tensor_write(&tb[i], tmp);
    }
  }
  float lse_d[T * HQ], lse_b[T * HQ];
  for (int pass = 0; pass < 2; pass++) {
    forkattn_tensor *t = pass ? tb : td;
    float *lse = pass ? lse_b : lse_d;
    cr_assert_eq(forkattn_prefix_fwd(ctx, &lay, &t[0], &t[1], &t[2], &t[3], lse, 0.2f, FORKATTN_MEMORY_HOST),
                 FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    cr_assert_eq(forkattn_prefix_bwd(ctx, &lay, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], 0.2f,
                                     FORKATTN_MEMORY_HOST),
                 FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  }
  for (int i = 3; i < 8; i++) {
    if (i == 4) continue;
    double a[T * HQ * D], b[T * HQ * D];
    ref_tensor_read(&td[i], a);
    ref_tensor_read(&tb[i], b);
    for (int64_t e = 0; e < T * heads[i] * D; e++)
      cr_assert(fabs(a[e] - b[e]) <= 1e-6 * (1 + fabs(a[e])), "%s: tensor %d element %lld: %g vs %g", name, i,
                (long long)e, a[e], b[e]);
  }
  for (int i = 0; i < T * HQ; i++) cr_assert(fabs(lse_d[i] - lse_b[i]) <= 1e-6 * (1 + fabs(lse_d[i])));
  for (int i = 0; i < 8; i++) munmap(big[i], bytes[i]);
  forkattn_ctx_destroy(ctx);
}

/* rows 2^31 + 17 elements apart (row offsets overflow int32 from row 1 on) */
Test(large_index, row_stride_above_2_31) { large_strides(((int64_t)1 << 31) + 17, D, "large_index/row_stride"); }
/* head-major: heads 2^32 + 5 elements apart, rows contiguous inside a head */
Test(large_index, head_stride_above_2_32) {
  large_strides(D, ((int64_t)1 << 32) + 5, "large_index/head_stride");
}
