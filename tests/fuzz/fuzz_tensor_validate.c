/* Fuzz target: forkattn_tensor descriptor validation through the public API.
 * Tiny fixed layouts; every field of every tensor argument (q, k, v, o, dout,
 * dq, dk, dv) is fuzzed, int64 extremes included, so signed overflow in size and
 * extent computations traps under UBSan. Descriptors are also built with
 * forkattn_tensor_contiguous() from fuzzed sizes. Each call goes through
 * fz_case_run() (fuzz_common.h): status vs. the header's rules, message,
 * untouched buffers, and results when the call is valid.
 *
 * Input format (missing bytes read as 0; 0 is always the nominal valid choice):
 *   flags   bit0 forward lse NULL   bit1 backward lse NULL   bit2 memory fuzzed
 *   layout  byte % 4: P=2 + responses {1,2} causal (T=5) | empty (T=0) |
 *                     P=3 bidirectional (T=3) | one response of 1 row (T=1)
 *   shape   byte % 4: (Hq, Hkv, d) = (2,1,4) | (1,1,1) | (4,2,8) | (3,3,2)
 *   dtype   byte % 3
 *   seed    data values
 *   scale   fz_scale(d)
 *   memory  fz_enum(2) when flags bit2
 *   8 x tensor: mode byte (0xFF: NULL descriptor; else mode & 3: 0/1 explicit
 *     fields, 2 forkattn_tensor_contiguous(), 3 explicit fields with data NULL),
 *     then dtype fz_enum_field, rows, heads, head_dim fz_field(nominal), and for
 *     explicit fields row_stride, head_stride fz_field(contiguous strides).
 */
#include <string.h>

#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const struct {
    int64_t P, N, off[3];
    int mask;
  } layouts[4] = {{2, 2, {0, 1, 3}, FORKATTN_MASK_CAUSAL},
                  {0, 0, {0, 0, 0}, FORKATTN_MASK_CAUSAL},
                  {3, 0, {0, 0, 0}, FORKATTN_MASK_BIDIRECTIONAL},
                  {0, 1, {0, 1, 0}, FORKATTN_MASK_CAUSAL}};
  static const int64_t shapes[4][3] = {{2, 1, 4}, {1, 1, 1}, {4, 2, 8}, {3, 3, 2}};
  fz_reader rd = {data, size, 0}, *r = &rd;
  static fz_case c;
  memset(&c, 0, sizeof c);

  const uint8_t flags = fz_u8(r);
  c.fwd_lse_null = flags & 1;
  c.bwd_lse_null = (flags >> 1) & 1;
  const int li = fz_u8(r) % 4, si = fz_u8(r) % 4, dtype = fz_u8(r) % 3;
  c.seed = fz_u8(r);
  c.prompt_len = layouts[li].P;
  c.num_responses = layouts[li].N;
  c.noff = c.num_responses + 1;
  memcpy(c.offsets, layouts[li].off, sizeof layouts[li].off);
  c.mask = layouts[li].mask;
  const int64_t T = c.prompt_len + c.offsets[c.num_responses];
  const int64_t hq = shapes[si][0], hkv = shapes[si][1], d = shapes[si][2];
  c.scale = fz_scale(r, d);
  c.memory = (flags >> 2) & 1 ? fz_enum(r, 2) : FORKATTN_MEMORY_HOST;

  for (int i = 0; i < FZ_NT; i++) {
    forkattn_tensor *t = &c.t[i];
    const int64_t H = i == FZ_K || i == FZ_V || i == FZ_DK || i == FZ_DV ? hkv : hq;
    const uint8_t mode = fz_u8(r);
    if (mode == 0xFF) {
      c.t_null[i] = 1;
      fz_contiguous(t, dtype, T, H, d);
      continue;
    }
    const int dt = fz_enum_field(r, dtype);
    const int64_t rows = fz_field(r, T), heads = fz_field(r, H), head_dim = fz_field(r, d);
    if ((mode & 3) == 2) {
      *t = forkattn_tensor_contiguous(NULL, (forkattn_dtype)dt, rows, heads, head_dim);
      FZ_CHECK(t->data == NULL && (int)t->dtype == dt && t->rows == rows && t->heads == heads &&
                   t->head_dim == head_dim && t->head_stride == head_dim,
               "forkattn_tensor_contiguous(%d, %lld, %lld, %lld) did not copy its arguments", dt,
               (long long)rows, (long long)heads, (long long)head_dim);
      int64_t rs;
      if (__builtin_mul_overflow(heads, head_dim, &rs)) rs = 0; /* documented: refused later */
      FZ_CHECK(t->row_stride == rs, "forkattn_tensor_contiguous: row_stride %lld, want %lld",
               (long long)t->row_stride, (long long)rs);
    } else {
      fz_contiguous(t, dt, rows, heads, head_dim);
      t->row_stride = fz_field(r, H * d);
      t->head_stride = fz_field(r, d);
      if ((mode & 3) == 3) c.t_data[i] = FZ_DATA_NULL;
    }
  }
  fz_case_run(fz_cpu_ctx(), &c);
  return 0;
}
