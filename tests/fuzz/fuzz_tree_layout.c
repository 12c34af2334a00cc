/* Fuzz target: forkattn_tree_fwd / forkattn_tree_bwd with tree layouts derived
 * from the input (node count, offsets, parents: valid, non-monotonic, huge,
 * forward or self parents, NULL arrays, NULL layout), on a CPU context with
 * contiguous f32 tensors of the rows the input claims (which may disagree
 * with the layout).
 *
 * Checks: the status is documented and equals an independent oracle written
 * from include/forkattn.h (node_offsets[0] = 0, non-decreasing, parents[i] in
 * [-1, i), rows = node_offsets[n] = the tensors' rows); on an error a message
 * is set and no output changed; on success every output is finite and, for
 * small problems, o and lse equal a float64 computation straight from the
 * tree mask (a row sees its ancestors' rows and its own node causally).
 *
 * Input format (missing bytes read as 0; 0 is always a valid choice):
 *   flags   bit0 layout NULL  bit1 node_offsets NULL  bit2 parents NULL
 *           bit3 offsets raw (else non-negative deltas)  bit4 parents raw (else i-1-k)
 *   n       fz_int(0, 9)                   nodes (arrays exist for 0 <= n <= 64)
 *   offsets raw: n+1 x fz_int(0, 40); deltas: n x fz_int(0, 12)
 *   parents raw: n x fz_int(-1, 12); else per node k = byte, parent = k % (i+1) - 1
 *   rows    fz_field(node_offsets[n])      rows of every tensor
 *   hkv fz_int(1, 2), group fz_int(1, 3), d fz_int(1, 24), seed byte */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define TL_MAX 64
#define TL_CAP_ROWS 512

static int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }

/* The documented verdict for the layout and the tensors' rows. */
static int tl_valid(int layout_null, int64_t n, const int64_t *off, const int64_t *par, int64_t rows) {
  if (layout_null || n < 0) return 0;
  if (n == 0) return rows == 0;
  if (!off || !par || off[0] != 0) return 0;
  for (int64_t i = 0; i < n; i++)
    if (off[i + 1] < off[i] || par[i] < -1 || par[i] >= i) return 0;
  return rows == off[n];
}

static int tl_sees(const int64_t *node_of, const int64_t *par, int64_t q, int64_t k) {
  if (node_of[q] == node_of[k]) return k <= q;
  for (int64_t a = par[node_of[q]]; a >= 0; a = par[a])
    if (a == node_of[k]) return 1;
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_reader rd = {data, size, 0}, *r = &rd;
  const uint8_t flags = fz_u8(r);
  const int64_t n = fz_int(r, 0, 9);
  static int64_t off[TL_MAX + 1], par[TL_MAX];
  const int arrays = n >= 0 && n <= TL_MAX;
  if (arrays) {
    off[0] = (flags & 8) ? fz_int(r, 0, 40) : 0;
    for (int64_t i = 0; i < n; i++) off[i + 1] = (flags & 8) ? fz_int(r, 0, 40) : wrap_add(off[i], fz_int(r, 0, 12));
    for (int64_t i = 0; i < n; i++) par[i] = (flags & 16) ? fz_int(r, -1, 12) : (int64_t)(fz_u8(r) % (i + 1)) - 1;
  }
  const int64_t *offp = (flags & 2) || !arrays ? NULL : off, *parp = (flags & 4) || !arrays ? NULL : par;
  const int64_t rows = fz_field(r, arrays && n > 0 ? off[n] : 0);
  const int64_t hkv = fz_int(r, 1, 2), group = fz_int(r, 1, 3), d = fz_int(r, 1, 24);
  uint64_t seed = fz_u8(r);
  forkattn_tree_layout lay = {n, offp, parp};
  const int layout_null = flags & 1;
  /* tensor descriptors are fuzz_tensor_validate's subject: here only shapes we can back */
  if (rows < 0 || rows > TL_CAP_ROWS || hkv < 1 || hkv > 4 || group < 1 || group > 4 || d < 1 || d > 24) return 0;
  const int64_t hq = hkv * group;

  /* q k v dout as inputs, o dq dk dv outputs, lse: contiguous f32 */
  const int64_t wq = hq * d, wk = hkv * d;
  float *buf = malloc(sizeof(float) * (size_t)(rows * (4 * wq + 4 * wk + hq)) + 16);
  float *snap = malloc(sizeof(float) * (size_t)(rows * (4 * wq + 4 * wk + hq)) + 16);
  FZ_CHECK(buf && snap, "out of memory");
  float *q = buf, *k = q + rows * wq, *v = k + rows * wk, *dout = v + rows * wk, *o = dout + rows * wq;
  float *dq = o + rows * wq, *dk = dq + rows * wq, *dv = dk + rows * wk, *lse = dv + rows * wk;
  const size_t total = (size_t)(rows * (4 * wq + 4 * wk + hq));
  for (size_t i = 0; i < total; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    buf[i] = (float)((seed >> 40) % 2001) / 1000.0f - 1.0f;
  }
  memcpy(snap, buf, sizeof(float) * total);
  forkattn_tensor tq = forkattn_tensor_contiguous(q, FORKATTN_DTYPE_F32, rows, hq, d);
  forkattn_tensor tk = forkattn_tensor_contiguous(k, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tdo = forkattn_tensor_contiguous(dout, FORKATTN_DTYPE_F32, rows, hq, d);
  forkattn_tensor to = forkattn_tensor_contiguous(o, FORKATTN_DTYPE_F32, rows, hq, d);
  forkattn_tensor tdq = forkattn_tensor_contiguous(dq, FORKATTN_DTYPE_F32, rows, hq, d);
  forkattn_tensor tdk = forkattn_tensor_contiguous(dk, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tdv = forkattn_tensor_contiguous(dv, FORKATTN_DTYPE_F32, rows, hkv, d);
  const float scale = 1.0f / sqrtf((float)d);
  forkattn_ctx *ctx = fz_cpu_ctx();
  const int valid = tl_valid(layout_null, n, offp, parp, rows);

  forkattn_status st = forkattn_tree_fwd(ctx, layout_null ? NULL : &lay, &tq, &tk, &tv, &to, lse, scale,
                                         FORKATTN_MEMORY_HOST);
  FZ_CHECK(st == (valid ? FORKATTN_OK : FORKATTN_ERR_INVALID_ARGUMENT), "forward: status %d, oracle says %s (%s)",
           (int)st, valid ? "valid" : "invalid", forkattn_ctx_last_error(ctx));
  if (!valid) {
    FZ_CHECK(forkattn_ctx_last_error(ctx)[0] != '\0', "forward: an error without a message");
    FZ_CHECK(!memcmp(buf, snap, sizeof(float) * total), "forward: a buffer changed on an error");
  }
  st = forkattn_tree_bwd(ctx, layout_null ? NULL : &lay, &tq, &tk, &tv, &to, &tdo, lse, &tdq, &tdk, &tdv, scale,
                         FORKATTN_MEMORY_HOST);
  FZ_CHECK(st == (valid ? FORKATTN_OK : FORKATTN_ERR_INVALID_ARGUMENT), "backward: status %d, oracle says %s (%s)",
           (int)st, valid ? "valid" : "invalid", forkattn_ctx_last_error(ctx));
  if (!valid) FZ_CHECK(!memcmp(buf, snap, sizeof(float) * total), "backward: a buffer changed on an error");

  if (valid && rows > 0) {
    for (size_t i = (size_t)(o - buf); i < total; i++) FZ_CHECK(isfinite(buf[i]), "non-finite output element %zu", i);
    int64_t node_of[TL_CAP_ROWS];
    for (int64_t x = 0; x < n; x++)
      for (int64_t rr = off[x]; rr < off[x + 1]; rr++) node_of[rr] = x;
    for (int64_t qr = 0; qr < rows; qr++)
      for (int64_t h = 0; h < hq; h++) {
        const int64_t g = h / (hq / hkv);
        double m = -INFINITY, l = 0, acc[24] = {0};
        for (int64_t kr = 0; kr <= qr; kr++) {
          if (!tl_sees(node_of, par, qr, kr)) continue;
          double s = 0;
          for (int64_t c = 0; c < d; c++) s += (double)q[qr * wq + h * d + c] * k[kr * wk + g * d + c];
          s *= scale;
          const double m2 = fmax(m, s), a = exp(m - m2), p = exp(s - m2);
          l = l * a + p;
          for (int64_t c = 0; c < d; c++) acc[c] = acc[c] * a + p * v[kr * wk + g * d + c];
          m = m2;
        }
        FZ_CHECK(fabs(lse[qr * hq + h] - (m + log(l))) <= 1e-4 * (1 + fabs(m)), "lse row %lld head %lld: %g vs %g",
                 (long long)qr, (long long)h, (double)lse[qr * hq + h], m + log(l));
        for (int64_t c = 0; c < d; c++)
          FZ_CHECK(fabs(o[qr * wq + h * d + c] - acc[c] / l) <= 1e-4, "o row %lld head %lld col %lld: %g vs %g",
                   (long long)qr, (long long)h, (long long)c, (double)o[qr * wq + h * d + c], acc[c] / l);
      }
  }
  free(buf);
  free(snap);
  return 0;
}
