/* Fuzz target: forkattn_prefix_fwd / forkattn_prefix_bwd on a CPU context with
 * layouts, shapes, strides, dtypes, masks, scales and memory kinds derived from
 * the input (fuzz_common.h says what is checked).
 *
 * Input format (missing bytes read as 0; 0 is always a valid choice):
 *   flags    bit0 forward lse NULL      bit1 backward lse NULL
 *            bit2 response_offsets NULL bit3 offsets raw (else non-negative deltas)
 *            bit4 layout NULL
 *   seed     data values
 *   P        fz_int(0, 72)             prompt_len
 *   N        fz_int(0, 7)              num_responses
 *   offsets  if 0 <= N <= 64: raw: N+1 x fz_int(0, 200); deltas: N x fz_int(0, 48)
 *            (offsets[0] = 0, offsets[i+1] = offsets[i] + delta, wrapping)
 *   mask     fz_enum(2)
 *   hkv      fz_int(1, 4)   group fz_int(1, 4)   (Hq = Hkv * group, wrapping)
 *   d        fz_int(1, 48)
 *   dtype    fz_enum(3)
 *   memory   byte < 0xE0: host, < 0xF0: device, else (int)fz_field(2) (invalid values)
 *   scale    fz_scale(d)
 *   8 x tensor (q, k, v, o, dout, dq, dk, dv): kind = byte % 12
 *     0..5 contiguous            6 head-major, pads (byte % 4, byte % 4)
 *     7 padded row-major, pads   8 raw strides: fz_int(1, 64), fz_int(1, 64)
 *     9 one field mutated: byte % 7 selects rows, heads, head_dim, row_stride,
 *       head_stride, dtype (fz_enum_field) or data NULL; value fz_field(nominal)
 *     10 NULL descriptor         11 contiguous, then 2 fields mutated as in 9
 */
#include <string.h>

#include "fuzz_common.h"

static int64_t wrap_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
static int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }

static void mutate_field(fz_reader *r, fz_case *c, int i) {
  forkattn_tensor *t = &c->t[i];
  switch (fz_u8(r) % 7) {
  case 0: t->rows = fz_field(r, t->rows); break;
  case 1: t->heads = fz_field(r, t->heads); break;
  case 2: t->head_dim = fz_field(r, t->head_dim); break;
  case 3: t->row_stride = fz_field(r, t->row_stride); break;
  case 4: t->head_stride = fz_field(r, t->head_stride); break;
  case 5: t->dtype = (forkattn_dtype)fz_enum_field(r, (int)t->dtype); break;
  default: c->t_data[i] = FZ_DATA_NULL; break;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_reader rd = {data, size, 0}, *r = &rd;
  static fz_case c;
  memset(&c, 0, sizeof c);

  const uint8_t flags = fz_u8(r);
  c.fwd_lse_null = flags & 1;
  c.bwd_lse_null = (flags >> 1) & 1;
  c.offsets_null = (flags >> 2) & 1;
  const int raw_offsets = (flags >> 3) & 1;
  c.layout_null = (flags >> 4) & 1;
  c.seed = fz_u8(r);

  c.prompt_len = fz_int(r, 0, 72);
  c.num_responses = fz_int(r, 0, 7);
  int64_t rows = c.prompt_len;
  if (c.num_responses >= 0 && c.num_responses <= 64) {
    const int64_t n = c.num_responses;
    c.noff = n + 1;
    c.offsets[0] = raw_offsets ? fz_int(r, 0, 200) : 0;
    for (int64_t i = 0; i < n; i++)
      c.offsets[i + 1] = raw_offsets ? fz_int(r, 0, 200) : wrap_add(c.offsets[i], fz_int(r, 0, 48));
    rows = wrap_add(c.prompt_len, c.offsets[n]);
  }
  c.mask = fz_enum(r, 2);
  const int64_t hkv = fz_int(r, 1, 4), hq = wrap_mul(hkv, fz_int(r, 1, 4)), d = fz_int(r, 1, 48);
  const int dtype = fz_enum(r, 3);
  const uint8_t mem = fz_u8(r);
  c.memory = mem < 0xE0 ? FORKATTN_MEMORY_HOST : mem < 0xF0 ? FORKATTN_MEMORY_DEVICE : (int)fz_field(r, 2);
  c.scale = fz_scale(r, d);

  for (int i = 0; i < FZ_NT; i++) {
    forkattn_tensor *t = &c.t[i];
    const int64_t heads = i == FZ_K || i == FZ_V || i == FZ_DK || i == FZ_DV ? hkv : hq;
    fz_contiguous(t, dtype, rows, heads, d);
    const int kind = fz_u8(r) % 12;
    if (kind == 6) { /* head-major: rows inside heads */
      t->row_stride = wrap_add(d, fz_u8(r) % 4);
      t->head_stride = wrap_add(wrap_add(wrap_mul(rows > 0 ? rows - 1 : 0, t->row_stride), d), fz_u8(r) % 4);
    } else if (kind == 7) { /* row-major with padding */
      t->head_stride = wrap_add(d, fz_u8(r) % 4);
      t->row_stride = wrap_add(wrap_add(wrap_mul(wrap_add(heads, -1), t->head_stride), d), fz_u8(r) % 4);
    } else if (kind == 8) {
      t->row_stride = fz_int(r, 1, 64);
      t->head_stride = fz_int(r, 1, 64);
    } else if (kind == 9) {
      mutate_field(r, &c, i);
    } else if (kind == 10) {
      c.t_null[i] = 1;
    } else if (kind == 11) {
      mutate_field(r, &c, i);
      mutate_field(r, &c, i);
    }
  }
  fz_case_run(fz_cpu_ctx(), &c);
  return 0;
}
