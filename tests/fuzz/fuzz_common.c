/* Shared pieces of the forkattn fuzz targets: see fuzz_common.h. */
#define _POSIX_C_SOURCE 200809L
#include "fuzz_common.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fz_stats fz_stat;

static const fz_case *fz_current; /* the case fz_case_run is checking, for messages */

static void fz_case_dump(const fz_case *c, FILE *f) {
  fprintf(f, "case: layout%s P=%lld N=%lld offsets%s [", c->layout_null ? " NULL" : "",
          (long long)c->prompt_len, (long long)c->num_responses, c->offsets_null ? " NULL" : "");
  for (int64_t i = 0; !c->offsets_null && i < c->noff; i++)
    fprintf(f, "%s%lld", i ? " " : "", (long long)c->offsets[i]);
  fprintf(f, "] mask %d, memory %d, scale %.9g, lse NULL fwd %d bwd %d\n", c->mask, c->memory,
          (double)c->scale, c->fwd_lse_null, c->bwd_lse_null);
  for (int i = 0; i < FZ_NT; i++) {
    const forkattn_tensor *t = &c->t[i];
    if (c->t_null[i]) {
      fprintf(f, "  %-4s NULL\n", fz_tensor_names[i]);
      continue;
    }
    fprintf(f, "  %-4s dtype %d rows %lld heads %lld head_dim %lld row_stride %lld head_stride %lld%s\n",
            fz_tensor_names[i], (int)t->dtype, (long long)t->rows, (long long)t->heads,
            (long long)t->head_dim, (long long)t->row_stride, (long long)t->head_stride,
            c->t_data[i] == FZ_DATA_NULL ? " data NULL" : "");
  }
}

void fz_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "\nFUZZ CHECK FAILED at %s:%d: %s\n  ", file, line, cond);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  if (fz_current) fz_case_dump(fz_current, stderr);
  fflush(stderr);
  abort();
}


/* ---- bytes to values ------------------------------------------------------ */

const int64_t fz_extremes[FZ_NEXTREMES] = {
    0,
    1,
    -1,
    2,
    INT64_MIN,
    INT64_MAX,
    INT64_MIN + 1,
    INT64_MAX - 1,
    INT32_MAX,
    INT32_MIN,
    (int64_t)INT32_MAX + 1,
    (int64_t)UINT32_MAX,
    (int64_t)1 << 32,
    -((int64_t)1 << 32),
    (int64_t)1 << 62,
    -((int64_t)1 << 62),
    ((int64_t)1 << 62) + 1,
    INT64_MAX / 2,
    INT64_MAX / 2 + 1,
    INT64_MAX / 3,
    3037000499, /* floor(sqrt(INT64_MAX)) */
    3037000500,
    (int64_t)1 << 31,
    (int64_t)1 << 40,
    255,
    256,
    257,
    4096,
    65536,
    -256,
    INT64_MIN / 2,
    ((int64_t)1 << 53) + 1,
};

uint8_t fz_u8(fz_reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }

uint32_t fz_u32(fz_reader *r) {
  uint32_t v = 0;
  for (int b = 0; b < 4; b++)
    v |= (uint32_t)fz_u8(r) << (8 * b);
  return v;
}

uint64_t fz_u64(fz_reader *r) {
  uint64_t v = 0;
  for (int b = 0; b < 8; b++)
    v |= (uint64_t)fz_u8(r) << (8 * b);
  return v;
}

static int64_t fz_wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }

int64_t fz_int(fz_reader *r, int64_t base, int64_t range) {
  uint8_t tag = fz_u8(r);
  if (tag < 0xC0) return fz_wrap_add(base, range > 0 ? tag % range : 0);
  if (tag < 0xE0) return fz_extremes[tag - 0xC0];
  if (tag < 0xF0) return (int64_t)(tag & 15) - 8;
  return (int64_t)fz_u64(r);
}

int64_t fz_field(fz_reader *r, int64_t nominal) {
  uint8_t tag = fz_u8(r);
  if (tag < 0x80) return nominal;
  if (tag < 0xC0) return tag - 0x80;
  if (tag < 0xE0) return fz_extremes[tag - 0xC0];
  if (tag < 0xF0) return fz_wrap_add(nominal, (int64_t)(tag & 15) - 8);
  return (int64_t)fz_u64(r);
}

static const int fz_bad_enums[16] = {-1, INT_MIN, INT_MAX, 3,           4,           255,        256, 0x7fff,
                                     -2, 0x10000, 100,     INT_MIN + 1, INT_MAX - 1, 0x40000000, 7,   -256};

int fz_enum(fz_reader *r, int nvalid) {
  uint8_t tag = fz_u8(r);
  if (tag < 0xF0) return tag % nvalid;
  int v = fz_bad_enums[tag & 15];
  return v == 3 || v == 4 ? nvalid + (v - 3) : v; /* the first values past the valid ones */
}

int fz_enum_field(fz_reader *r, int nominal) {
  uint8_t tag = fz_u8(r);
  if (tag < 0x80) return nominal;
  if (tag < 0xC0) return tag & 7; /* 0..7: valid ones and the first invalid ones */
  if (tag < 0xE0) return fz_bad_enums[tag & 15];
  return (int)fz_u32(r);
}

float fz_special(fz_reader *r, uint8_t tag, int n) {
  static const float special[13] = {0.0f,    -0.0f,  -1.0f, NAN,    INFINITY, -INFINITY, FLT_MAX,
                                    FLT_MIN, 1e-45f, 1e30f, 1e-30f, 100.0f,   -NAN}; /* 1e-45: a denormal */
  const int i = tag & 15;
  if (i < n && i < 13) return special[i];
  uint32_t u = fz_u32(r);
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

float fz_scale(fz_reader *r, int64_t d) {
  uint8_t tag = fz_u8(r);
  double dd = d > 0 && d <= 4096 ? (double)d : 64.0;
  if (tag < 0xE0) return (float)((0.25 + (tag % 32) / 8.0) / sqrt(dd));
  return fz_special(r, tag, 11);
}

/* ---- context -------------------------------------------------------------- */

forkattn_ctx *fz_cpu_ctx(void) {
  static forkattn_ctx *ctx;
  if (!ctx) {
    unsetenv("FORKATTN_BACKEND");
    forkattn_ctx_options opt;
    forkattn_ctx_options_init(&opt);
    opt.backend = FORKATTN_BACKEND_CPU;
    opt.threads = 1;
    forkattn_status st = forkattn_ctx_create(&ctx, &opt);
    FZ_CHECK(st == FORKATTN_OK && ctx, "cannot create a CPU context: %s (%s)", forkattn_status_string(st),
             forkattn_ctx_create_error());
  }
  return ctx;
}

/* ---- element storage ------------------------------------------------------ */

static int64_t fz_elem_size(int dtype) {
  return dtype == FORKATTN_DTYPE_F32 ? 4 : dtype == 1 || dtype == 2 ? 2 : 4;
}

static float fz_f16_to_f32(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  float v;
  if (exp == 31)
    v = man ? NAN : INFINITY;
  else if (exp == 0)
    v = ldexpf((float)man, -24);
  else
    v = ldexpf((float)(man | 1024), exp - 25);
  return sign ? -v : v;
}

/* Exact f16 encoding of v = k/64, |k| <= 64 (always a normal f16 or zero). */
static uint16_t fz_exact_f16(float v) {
  if (v == 0.0f) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  int e;
  float m = frexpf(fabsf(v), &e); /* |v| = m * 2^e, m in [0.5, 1) */
  uint16_t man = (uint16_t)((m * 2.0f - 1.0f) * 1024.0f);
  return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) | man);
}

static float fz_load(const void *p, int dtype, int64_t i) {
  if (dtype == FORKATTN_DTYPE_F32) {
    float f;
    memcpy(&f, (const char *)p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, (const char *)p + 2 * i, 2);
  if (dtype == FORKATTN_DTYPE_BF16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  return fz_f16_to_f32(h);
}

/* Store v, exactly representable in every dtype (k/64 with |k| <= 64). */
static void fz_store_exact(void *p, int dtype, int64_t i, float v) {
  if (dtype == FORKATTN_DTYPE_BF16 || dtype == FORKATTN_DTYPE_F16) {
    uint16_t h;
    if (dtype == FORKATTN_DTYPE_BF16) {
      uint32_t u;
      memcpy(&u, &v, 4);
      h = (uint16_t)(u >> 16);
    } else {
      h = fz_exact_f16(v);
    }
    memcpy((char *)p + 2 * i, &h, 2);
  } else {
    memcpy((char *)p + 4 * i, &v, 4);
  }
}

static uint64_t fz_rng(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void fz_fill(void *p, int dtype, int64_t n, uint64_t *s) {
  for (int64_t i = 0; i < n; i++)
    fz_store_exact(p, dtype, i, (float)((int)(fz_rng(s) % 129) - 64) / 64.0f);
}

void fz_contiguous(forkattn_tensor *t, int dtype, int64_t rows, int64_t heads, int64_t d) {
  t->data = NULL;
  t->dtype = (forkattn_dtype)dtype;
  t->rows = rows;
  t->heads = heads;
  t->head_dim = d;
  t->row_stride = (int64_t)((uint64_t)heads * (uint64_t)d);
  t->head_stride = d;
}

/* ---- the oracle: what include/forkattn.h says the call must return --------- */

enum { FZ_ACCEPT = 0, FZ_EITHER = 1, FZ_REJECT = 2 };
static int fz_max(int a, int b) { return a > b ? a : b; }

const char *const fz_tensor_names[FZ_NT] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};

static int fz_cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Do the head vectors (r, h) of t overlap? 1 yes, 0 no, -1 too many to tell.
 * Sizes positive and the extent fits int64. */
static int fz_overlaps(const forkattn_tensor *t) {
  const int64_t rows = t->rows, heads = t->heads, d = t->head_dim;
  if (rows > ((int64_t)1 << 18) / heads) return -1;
  int64_t n = rows * heads, *off = malloc(sizeof *off * (size_t)n);
  FZ_CHECK(off, "out of memory");
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++)
      off[r * heads + h] = r * t->row_stride + h * t->head_stride;
  qsort(off, (size_t)n, sizeof *off, fz_cmp_i64);
  int over = 0;
  for (int64_t i = 1; i < n && !over; i++)
    over = off[i] - off[i - 1] < d;
  free(off);
  return over;
}

/* Extent of t in elements ((rows-1)*row_stride + (heads-1)*head_stride + head_dim,
 * 0 without rows) computed exactly; 0 if it is not sane (non-positive sizes or
 * strides) or exceeds INT64_MAX. */
static int fz_extent(const forkattn_tensor *t, __int128 *ext) {
  if (t->rows < 0 || t->heads <= 0 || t->head_dim <= 0 || t->row_stride <= 0 || t->head_stride <= 0) return 0;
  if (t->rows == 0) {
    *ext = 0;
    return 1;
  }
  *ext = (__int128)(t->rows - 1) * t->row_stride + (__int128)(t->heads - 1) * t->head_stride + t->head_dim;
  return *ext <= INT64_MAX;
}

/* Verdict for one descriptor against the shape the call needs. */
static int fz_oracle_tensor(const forkattn_tensor *t, int is_null, int qdtype, int64_t rows, int64_t heads,
                            int64_t d) {
  if (is_null) return FZ_REJECT;
  if (t->dtype != FORKATTN_DTYPE_F32 && t->dtype != FORKATTN_DTYPE_BF16 && t->dtype != FORKATTN_DTYPE_F16)
    return FZ_REJECT;
  if ((int)t->dtype != qdtype) return FZ_REJECT;
  if (t->rows < 0 || t->heads <= 0 || t->head_dim <= 0) return FZ_REJECT;
  if (t->rows != rows || t->heads != heads || t->head_dim != d) return FZ_REJECT;
  if (t->row_stride <= 0 || t->head_stride <= 0) return FZ_REJECT;
  int64_t n;
  __int128 ext;
  if (__builtin_mul_overflow(rows, heads, &n) || __builtin_mul_overflow(n, d, &n)) return FZ_REJECT;
  if (!fz_extent(t, &ext)) return FZ_REJECT; /* extent overflows int64 */
  int v = FZ_ACCEPT;
  /* The library sums row and head extents (extent + head_dim, and for no rows
   * still (heads-1)*head_stride): allowed to refuse near the int64 limit. */
  if ((__int128)(rows > 0 ? rows - 1 : 0) * t->row_stride + (__int128)(heads - 1) * t->head_stride +
          2 * (__int128)d >
      INT64_MAX)
    v = FZ_EITHER;
  if (rows > 1 && heads > 1) {
    /* Row-major (heads inside rows) and head-major (rows inside heads) never overlap. */
    __int128 head_span = (__int128)(heads - 1) * t->head_stride + d;
    __int128 row_span = (__int128)(rows - 1) * t->row_stride + d;
    int heads_inner = t->head_stride >= d && t->row_stride >= head_span;
    int rows_inner = t->row_stride >= d && t->head_stride >= row_span;
    if (!heads_inner && !rows_inner) {
      int o = fz_overlaps(t);
      if (o == 1) return FZ_REJECT;
      v = FZ_EITHER; /* interleaved without overlap: the header allows it, the library may refuse */
    }
  } else if ((rows > 1 && t->row_stride < d) || (heads > 1 && t->head_stride < d)) {
    if (rows > 0) return FZ_REJECT; /* two vectors overlap */
    v = FZ_EITHER;                  /* no rows, nothing overlaps: the library may still refuse */
  }
  if (!t->data && n > 0) return FZ_REJECT;
  return v;
}

/* ---- running a case ------------------------------------------------------- */

typedef struct fz_buf {
  void *p;
  size_t bytes;
  void *snap;
  int backed;
} fz_buf;

static void fz_buf_snap(fz_buf *b) {
  free(b->snap);
  b->snap = NULL;
  if (!b->p) return;
  b->snap = malloc(b->bytes ? b->bytes : 1);
  FZ_CHECK(b->snap, "out of memory");
  if (b->bytes) memcpy(b->snap, b->p, b->bytes);
}

static int fz_buf_same(const fz_buf *b) { return !b->p || !b->bytes || !memcmp(b->p, b->snap, b->bytes); }

static void fz_buf_free(fz_buf *b) {
  free(b->p);
  free(b->snap);
  memset(b, 0, sizeof *b);
}

/* Index of element (r, h, c) of a checked descriptor. */
static int64_t fz_at(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c) {
  return r * t->row_stride + h * t->head_stride + c;
}

/* Output gaps (span elements that are no element of t) must keep their bytes. */
static void fz_check_gaps(const char *what, const char *name, const forkattn_tensor *t, const fz_buf *b) {
  const int64_t es = fz_elem_size((int)t->dtype), span = (int64_t)b->bytes / es;
  if (!span) return;
  unsigned char *mark = calloc((size_t)span, 1);
  FZ_CHECK(mark, "out of memory");
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      memset(mark + fz_at(t, r, h, 0), 1, (size_t)t->head_dim);
  for (int64_t i = 0; i < span; i++)
    if (!mark[i])
      FZ_CHECK(!memcmp((char *)b->p + i * es, (char *)b->snap + i * es, (size_t)es),
               "%s: %s element %lld is a gap between strided elements but was written", what, name,
               (long long)i);
  free(mark);
}

/* Keys of row i: [0, *a_end) and [*b0, *b_end). */
static void fz_visible(const fz_case *c, const int64_t *off, int64_t i, int64_t *a_end, int64_t *b0,
                       int64_t *b_end) {
  const int64_t P = c->prompt_len;
  const int causal = c->mask == FORKATTN_MASK_CAUSAL;
  *b0 = *b_end = 0;
  if (i < P) {
    *a_end = causal ? i + 1 : P;
    return;
  }
  *a_end = P;
  int64_t s = 0;
  while (!(P + off[s] <= i && i < P + off[s + 1]))
    s++;
  *b0 = P + off[s];
  *b_end = causal ? i + 1 : P + off[s + 1];
}

/* |got - want| <= rtol * (|want| + max|want|) + atol (+ slack[element] when slack is given) element-wise. */
static void fz_compare_slack(const char *what, const char *name, const double *want, const double *slack,
                             const forkattn_tensor *t, int64_t T, int64_t H, int64_t d, double rtol, double atol) {
  double mx = 0.0;
  for (int64_t i = 0; i < T * H * d; i++)
    mx = fmax(mx, fabs(want[i]));
  for (int64_t r = 0; r < T; r++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t x = 0; x < d; x++) {
        double w = want[(r * H + h) * d + x], g = fz_load(t->data, (int)t->dtype, fz_at(t, r, h, x));
        FZ_CHECK(
            fabs(g - w) <= rtol * (fabs(w) + mx) + atol + (slack ? slack[(r * H + h) * d + x] : 0.0),
            "%s: %s[%lld, %lld, %lld] = %.9g, float64 reference %.9g (max |ref| %.3g, atol %.3g, dtype %d)",
            what, name, (long long)r, (long long)h, (long long)x, g, w, mx, atol, (int)t->dtype);
      }
}

static void fz_compare(const char *what, const char *name, const double *want, const forkattn_tensor *t,
                       int64_t T, int64_t H, int64_t d, double rtol, double atol) {
  fz_compare_slack(what, name, want, NULL, t, T, H, d, rtol, atol);
}

static double fz_rtol(int dtype) {
  return dtype == FORKATTN_DTYPE_F32 ? 2e-3 : dtype == FORKATTN_DTYPE_BF16 ? 2e-2 : 4e-3;
}

static double fz_dot(const forkattn_tensor *a, int64_t ra, int64_t ha, const forkattn_tensor *b, int64_t rb,
                     int64_t hb, int64_t d) {
  double s = 0.0;
  for (int64_t x = 0; x < d; x++)
    s += (double)fz_load(a->data, (int)a->dtype, fz_at(a, ra, ha, x)) *
         (double)fz_load(b->data, (int)b->dtype, fz_at(b, rb, hb, x));
  return s;
}

/* Forward in float64 from the inputs as stored: o and lse vs the library. */
static void fz_ref_fwd(const fz_case *c, const int64_t *off, int64_t T, int64_t hq, int64_t hkv, int64_t d,
                       const float *lse) {
  const forkattn_tensor *q = &c->t[FZ_Q], *k = &c->t[FZ_K], *v = &c->t[FZ_V], *o = &c->t[FZ_O];
  const int64_t group = hq / hkv;
  double *ow = calloc((size_t)(T * hq * d), sizeof *ow), *s = malloc(sizeof *s * (size_t)T), smax = 0.0;
  FZ_CHECK(ow && s, "out of memory");
  for (int64_t i = 0; i < T; i++)
    for (int64_t h = 0; h < hq; h++) {
      const int64_t g = h / group;
      int64_t a_end, b0, b_end;
      fz_visible(c, off, i, &a_end, &b0, &b_end);
      double m = -INFINITY, l = 0.0;
      for (int64_t j = 0; j < T; j++) {
        s[j] = -INFINITY;
        if (j < a_end || (j >= b0 && j < b_end)) {
          s[j] = c->scale * fz_dot(q, i, h, k, j, g, d);
          smax = fmax(smax, fabs(s[j]));
        }
        m = fmax(m, s[j]);
      }
      for (int64_t j = 0; j < T; j++)
        if (s[j] > -INFINITY) {
          double p = exp(s[j] - m);
          l += p;
          for (int64_t x = 0; x < d; x++)
            ow[(i * hq + h) * d + x] += p * fz_load(v->data, (int)v->dtype, fz_at(v, j, g, x));
        }
      for (int64_t x = 0; x < d; x++)
        ow[(i * hq + h) * d + x] /= l;
      if (lse) {
        double want = m + log(l), got = lse[i * hq + h];
        FZ_CHECK(fabs(got - want) <= 1e-3 * (1.0 + fabs(want)),
                 "forward: lse[%lld, %lld] = %.9g, float64 reference %.9g", (long long)i, (long long)h, got,
                 want);
      }
    }
  /* f32 scores carry a relative error ~1e-7: probabilities ~1e-7 * |s| (|v| <= 1) */
  fz_compare("forward", "o", ow, o, T, hq, d, fz_rtol((int)o->dtype), 1e-6 * (1.0 + smax));
  free(ow);
  free(s);
}

/* Backward in float64 from the inputs as given (o and lse included). With a 16-bit o the library
 * may take a row's D from the inputs (sum_j p_j dp_j) instead of dout . o (forkattn.h,
 * forkattn_prefix_bwd): the difference |D_x - D_o| of the two, carried through dS to dq and dk,
 * is allowed on top of the tolerance (slack). */
static void fz_ref_bwd(const fz_case *c, const int64_t *off, int64_t T, int64_t hq, int64_t hkv, int64_t d,
                       const float *lse) {
  const forkattn_tensor *q = &c->t[FZ_Q], *k = &c->t[FZ_K], *v = &c->t[FZ_V], *o = &c->t[FZ_O],
                        *dout = &c->t[FZ_DOUT];
  const int64_t group = hq / hkv;
  double *dq = calloc((size_t)(T * hq * d), sizeof *dq), *dk = calloc((size_t)(T * hkv * d), sizeof *dk),
         *dv = calloc((size_t)(T * hkv * d), sizeof *dv);
  /* magnitudes: sums of |terms| of each element, for the cancellation error */
  double *mq = calloc((size_t)(T * hq * d), sizeof *mq), *mk = calloc((size_t)(T * hkv * d), sizeof *mk),
         *mv = calloc((size_t)(T * hkv * d), sizeof *mv), smax = 0.0;
  double *sq = calloc((size_t)(T * hq * d), sizeof *sq), *sk = calloc((size_t)(T * hkv * d), sizeof *sk);
  FZ_CHECK(dq && dk && dv && mq && mk && mv && sq && sk, "out of memory");
  const int either_d = o->dtype != FORKATTN_DTYPE_F32;
  for (int64_t i = 0; i < T; i++)
    for (int64_t h = 0; h < hq; h++) {
      const int64_t g = h / group;
      int64_t a_end, b0, b_end;
      fz_visible(c, off, i, &a_end, &b0, &b_end);
      const double D = fz_dot(dout, i, h, o, i, h, d), L = lse[i * hq + h];
      double dx = 0.0; /* D from the inputs */
      for (int64_t j = 0; either_d && j < T; j++)
        if (j < a_end || (j >= b0 && j < b_end))
          dx += exp(c->scale * fz_dot(q, i, h, k, j, g, d) - L) * fz_dot(dout, i, h, v, j, g, d);
      const double dd = either_d ? fabs(dx - D) : 0.0;
      for (int64_t j = 0; j < T; j++) {
        if (!(j < a_end || (j >= b0 && j < b_end))) continue;
        const double sc = c->scale * fz_dot(q, i, h, k, j, g, d), p = exp(sc - L);
        const double dp = fz_dot(dout, i, h, v, j, g, d), ds = p * (dp - D), as = p * (fabs(dp) + fabs(D));
        smax = fmax(smax, fabs(sc));
        for (int64_t x = 0; x < d; x++) {
          const double kx = fz_load(k->data, (int)k->dtype, fz_at(k, j, g, x)),
                       qx = fz_load(q->data, (int)q->dtype, fz_at(q, i, h, x)),
                       ox = fz_load(dout->data, (int)dout->dtype, fz_at(dout, i, h, x));
          dq[(i * hq + h) * d + x] += c->scale * ds * kx;
          dk[(j * hkv + g) * d + x] += c->scale * ds * qx;
          dv[(j * hkv + g) * d + x] += p * ox;
          mq[(i * hq + h) * d + x] += c->scale * as * fabs(kx);
          mk[(j * hkv + g) * d + x] += c->scale * as * fabs(qx);
          mv[(j * hkv + g) * d + x] += p * fabs(ox);
          sq[(i * hq + h) * d + x] += c->scale * p * dd * fabs(kx);
          sk[(j * hkv + g) * d + x] += c->scale * p * dd * fabs(qx);
        }
      }
    }
  const double rtol = fz_rtol((int)q->dtype), e = 4e-6 * (1.0 + smax);
  double aq = 0.0, ak = 0.0, av = 0.0;
  for (int64_t i = 0; i < T * hq * d; i++)
    aq = fmax(aq, mq[i]);
  for (int64_t i = 0; i < T * hkv * d; i++) {
    ak = fmax(ak, mk[i]);
    av = fmax(av, mv[i]);
  }
  fz_compare_slack("backward", "dq", dq, sq, &c->t[FZ_DQ], T, hq, d, rtol, e * aq + 1e-7);
  fz_compare_slack("backward", "dk", dk, sk, &c->t[FZ_DK], T, hkv, d, rtol, e * ak + 1e-7);
  fz_compare("backward", "dv", dv, &c->t[FZ_DV], T, hkv, d, rtol, e * av + 1e-7);
  free(dq);
  free(dk);
  free(dv);
  free(mq);
  free(mk);
  free(mv);
  free(sq);
  free(sk);
}

static void fz_check_finite(const char *what, const char *name, const forkattn_tensor *t) {
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      for (int64_t x = 0; x < t->head_dim; x++) {
        float f = fz_load(t->data, (int)t->dtype, fz_at(t, r, h, x));
        FZ_CHECK(isfinite(f), "%s: %s[%lld, %lld, %lld] = %g is not finite (inputs are)", what, name,
                 (long long)r, (long long)h, (long long)x, (double)f);
      }
}

static int fz_documented(forkattn_status st) { return st >= FORKATTN_OK && st <= FORKATTN_ERR_INTERNAL; }

/* Status against the verdict, the message, untouched buffers on error. */
static void fz_check_call(forkattn_ctx *ctx, const char *what, forkattn_status st, int verdict, fz_buf *bufs,
                          int nbufs) {
  fz_stat.calls++;
  if (getenv("FORKATTN_FUZZ_VERBOSE"))
    fprintf(stderr, "  %s: %s (expected %s) %s\n", what, forkattn_status_string(st),
            verdict == FZ_REJECT   ? "invalid argument"
            : verdict == FZ_ACCEPT ? "ok"
                                   : "ok or invalid argument",
            forkattn_ctx_last_error(ctx));
  FZ_CHECK(fz_documented(st), "%s: undocumented status %d", what, (int)st);
  if (st == FORKATTN_OK)
    fz_stat.ok++;
  else if (st == FORKATTN_ERR_INVALID_ARGUMENT)
    fz_stat.invalid++;
  else
    fz_stat.other++;
  if (verdict == FZ_REJECT)
    FZ_CHECK(st == FORKATTN_ERR_INVALID_ARGUMENT,
             "%s: returned %s for a call include/forkattn.h makes invalid (last error: '%s')", what,
             forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  else if (verdict == FZ_ACCEPT)
    FZ_CHECK(st == FORKATTN_OK, "%s: returned %s (last error: '%s') for a valid call", what,
             forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  else
    FZ_CHECK(st == FORKATTN_OK || st == FORKATTN_ERR_INVALID_ARGUMENT, "%s: returned %s (last error: '%s')",
             what, forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  if (st != FORKATTN_OK) {
    const char *msg = forkattn_ctx_last_error(ctx);
    FZ_CHECK(msg && msg[0], "%s: %s without a message in forkattn_ctx_last_error()", what,
             forkattn_status_string(st));
    for (int i = 0; i < nbufs; i++)
      FZ_CHECK(fz_buf_same(&bufs[i]), "%s: returned %s ('%s') but buffer %d changed", what,
               forkattn_status_string(st), msg, i);
  }
}

void fz_case_run(forkattn_ctx *ctx, fz_case *c) {
  uint64_t rng = 0x5eed0000ull + c->seed;
  FZ_CHECK(forkattn_ctx_backend(ctx) == FORKATTN_BACKEND_CPU, "fz_case_run needs a CPU context");
  fz_current = c;
  if (getenv("FORKATTN_FUZZ_VERBOSE")) fz_case_dump(c, stderr);

  /* ---- layout ---- */
  forkattn_prefix_layout lay;
  lay.prompt_len = c->prompt_len;
  lay.num_responses = c->num_responses;
  lay.mask = (forkattn_mask)c->mask;
  int64_t *off = NULL;
  if (c->num_responses > 0 && (c->num_responses >= FZ_MAX_OFFSETS || c->noff != c->num_responses + 1))
    c->offsets_null = 1; /* cannot back it */
  if (!c->offsets_null) {
    off = malloc(c->noff ? sizeof *off * (size_t)c->noff : 1);
    FZ_CHECK(off, "out of memory");
    if (c->noff) memcpy(off, c->offsets, sizeof *off * (size_t)c->noff);
  }
  lay.response_offsets = off;

  int lay_v = FZ_ACCEPT;
  int64_t T = 0;
  if (c->layout_null || c->prompt_len < 0 || c->num_responses < 0 ||
      (c->mask != FORKATTN_MASK_CAUSAL && c->mask != FORKATTN_MASK_BIDIRECTIONAL)) {
    lay_v = FZ_REJECT;
  } else if (c->num_responses > 0) {
    if (!off || off[0] != 0) lay_v = FZ_REJECT;
    for (int64_t i = 0; lay_v == FZ_ACCEPT && i < c->num_responses; i++)
      if (off[i + 1] < off[i]) lay_v = FZ_REJECT;
    if (lay_v == FZ_ACCEPT && __builtin_add_overflow(c->prompt_len, off[c->num_responses], &T))
      lay_v = FZ_REJECT;
  } else {
    T = c->prompt_len;
  }

  /* ---- q/k/v heads and head_dim, memory, scale ---- */
  forkattn_tensor *t = c->t;
  int pre_v = FZ_ACCEPT;
  if (c->t_null[FZ_Q] || c->t_null[FZ_K] || c->t_null[FZ_V]) pre_v = FZ_REJECT;
  const int64_t hq = t[FZ_Q].heads, hkv = t[FZ_K].heads, d = t[FZ_Q].head_dim;
  if (pre_v == FZ_ACCEPT && (hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || d > 256)) pre_v = FZ_REJECT;
  if (c->memory != FORKATTN_MEMORY_HOST && c->memory != FORKATTN_MEMORY_DEVICE) pre_v = FZ_REJECT;
  if (c->memory == FORKATTN_MEMORY_DEVICE) pre_v = FZ_REJECT; /* device pointers need the gpu backend */
  const int scale_ok = isfinite(c->scale) && c->scale > 0.0f;

  /* ---- buffers: exactly the claimed span, or a 16-byte decoy ---- */
  fz_buf buf[FZ_NT + 1];
  memset(buf, 0, sizeof buf);
  int all_backed = 1;
  for (int i = 0; i < FZ_NT; i++) {
    __int128 ext;
    const int64_t es = fz_elem_size((int)t[i].dtype);
    if (c->t_null[i]) continue;
    if (c->t_data[i] == FZ_DATA_NULL) {
      t[i].data = NULL;
      buf[i].backed = t[i].rows == 0; /* nothing to read */
    } else if (fz_extent(&t[i], &ext) && ext * es <= FZ_CAP_BYTES) {
      buf[i].bytes = (size_t)(ext * es);
      buf[i].p = malloc(buf[i].bytes ? buf[i].bytes : 1);
      FZ_CHECK(buf[i].p, "out of memory");
      buf[i].backed = 1;
      fz_fill(buf[i].p, (int)t[i].dtype, (int64_t)ext, &rng);
      t[i].data = buf[i].p;
    } else {
      buf[i].bytes = 16; /* a decoy: the call must be refused before anything reads it */
      buf[i].p = malloc(16);
      FZ_CHECK(buf[i].p, "out of memory");
      memset(buf[i].p, 0x3c, 16);
      t[i].data = buf[i].p;
    }
    if (!buf[i].backed) all_backed = 0;
  }
  /* lse: [T, hq] float32 */
  fz_buf *lb = &buf[FZ_NT];
  if (lay_v == FZ_ACCEPT && T >= 0 && hq > 0 && T <= FZ_CAP_BYTES / 4 / hq) {
    lb->bytes = sizeof(float) * (size_t)(T * hq);
    lb->backed = 1;
  } else {
    lb->bytes = 16;
  }
  lb->p = malloc(lb->bytes ? lb->bytes : 1);
  FZ_CHECK(lb->p, "out of memory");
  float *lse = lb->p;
  for (size_t i = 0; i < lb->bytes / sizeof(float); i++)
    lse[i] = 100.0f; /* exp(s - 100) ~ 0: finite */

  /* ---- verdicts ---- */
  int common_v = fz_max(lay_v, pre_v);
  const int qdt = c->t_null[FZ_Q] ? -1 : (int)t[FZ_Q].dtype;
  int tv[FZ_NT];
  for (int i = 0; i < FZ_NT; i++) {
    const int64_t heads = i == FZ_K || i == FZ_V || i == FZ_DK || i == FZ_DV ? hkv : hq;
    tv[i] = fz_oracle_tensor(&t[i], c->t_null[i], qdt, T, heads, d);
  }
  int fwd_v = fz_max(common_v, scale_ok ? FZ_ACCEPT : FZ_REJECT);
  for (int i = FZ_Q; i <= FZ_O; i++)
    fwd_v = fz_max(fwd_v, tv[i]);
  int bwd_v = fwd_v;
  for (int i = FZ_DOUT; i <= FZ_DV; i++)
    bwd_v = fz_max(bwd_v, tv[i]);
  if (c->bwd_lse_null && T > 0) bwd_v = FZ_REJECT;

  /* Descriptors the library might accept but we cannot back: poison the call with
   * an argument error it must detect first (the header: all argument errors are
   * detected before computation starts, outputs untouched). */
  /* Valid calls too large to compute quickly are poisoned the same way. */
  const double work =
      (double)T * (double)T * (double)(hq > 0 ? hq : 1) * (double)(d > 0 && d < 4096 ? d + 16 : 1);
  if (work > FZ_MAX_WORK) all_backed = lb->backed = 0;
  float fwd_scale = c->scale;
  int fwd_backed = lb->backed || c->fwd_lse_null;
  for (int i = FZ_Q; i <= FZ_O; i++)
    fwd_backed &= c->t_null[i] || buf[i].backed;
  if (work > FZ_MAX_WORK) fwd_backed = 0;
  if (fwd_v != FZ_REJECT && !fwd_backed) {
    fwd_scale = NAN;
    fwd_v = FZ_REJECT;
    fz_stat.poisoned++;
  }
  int bwd_lse_null = c->bwd_lse_null;
  if (bwd_v != FZ_REJECT && !(all_backed && lb->backed)) {
    FZ_CHECK(T > 0, "unbacked descriptor of a call with no rows");
    bwd_lse_null = 1;
    bwd_v = FZ_REJECT;
    fz_stat.poisoned++;
  }

  const int sane = isfinite(c->scale) && c->scale > 0.0f && d > 0 && c->scale * sqrt((double)d) <= 64.0;
  const int dtype = qdt;
  const int64_t group = hq > 0 && hkv > 0 ? hq / hkv : 1;
  /* f16 outputs can overflow to inf for large problems: bound of |dk| */
  const double bound =
      (double)c->scale * 2.0 * (double)d * (double)T * (double)group + (double)T * (double)group;
  const int values_ok = sane && (dtype != FORKATTN_DTYPE_F16 || bound < 6e4);
  const int ref_ok = values_ok && T > 0 && (double)T * (double)T * (double)hq * (double)d <= 2.5e5;

  /* ---- forward ---- */
  const forkattn_prefix_layout *lp = c->layout_null ? NULL : &lay;
  const forkattn_tensor *tp[FZ_NT];
  for (int i = 0; i < FZ_NT; i++)
    tp[i] = c->t_null[i] ? NULL : &t[i];
  for (int i = 0; i <= FZ_NT; i++)
    fz_buf_snap(&buf[i]);
  forkattn_status st =
      forkattn_prefix_fwd(ctx, lp, tp[FZ_Q], tp[FZ_K], tp[FZ_V], tp[FZ_O], c->fwd_lse_null ? NULL : lse,
                          fwd_scale, (forkattn_memory)c->memory);
  fz_check_call(ctx, "forward", st, fwd_v, buf, FZ_NT + 1);
  int have_fwd = 0;
  if (st == FORKATTN_OK) {
    for (int i = FZ_Q; i <= FZ_V; i++)
      FZ_CHECK(fz_buf_same(&buf[i]), "forward: input %s changed", fz_tensor_names[i]);
    for (int i = FZ_DOUT; i <= FZ_DV; i++)
      FZ_CHECK(fz_buf_same(&buf[i]), "forward: %s (not an argument) changed", fz_tensor_names[i]);
    if (c->fwd_lse_null) FZ_CHECK(fz_buf_same(lb), "forward: lse was NULL but the lse buffer changed");
    if (T > 0) fz_check_gaps("forward", "o", &t[FZ_O], &buf[FZ_O]);
    if (T > 0 && c->fwd_lse_null && lb->backed) { /* once more, with lse, for the backward */
      fz_buf_snap(&buf[FZ_O]);
      st = forkattn_prefix_fwd(ctx, lp, tp[FZ_Q], tp[FZ_K], tp[FZ_V], tp[FZ_O], lse, fwd_scale,
                               (forkattn_memory)c->memory);
      fz_check_call(ctx, "forward (with lse)", st, fwd_v, buf, 0);
      FZ_CHECK(st != FORKATTN_OK || fz_buf_same(&buf[FZ_O]),
               "forward: o differs between runs with and without lse");
    }
    have_fwd = T > 0 && st == FORKATTN_OK;
    if (have_fwd && values_ok) {
      fz_check_finite("forward", "o", &t[FZ_O]);
      for (int64_t i = 0; i < T * hq; i++)
        FZ_CHECK(isfinite(lse[i]), "forward: lse[%lld] = %g is not finite (every row sees a key)",
                 (long long)i, (double)lse[i]);
    }
    if (have_fwd && ref_ok) {
      fz_ref_fwd(c, off, T, hq, hkv, d, lse);
      fz_stat.ref_checked++;
    }
  }

  /* ---- backward ---- */
  for (int i = 0; i <= FZ_NT; i++)
    fz_buf_snap(&buf[i]);
  st = forkattn_prefix_bwd(ctx, lp, tp[FZ_Q], tp[FZ_K], tp[FZ_V], tp[FZ_O], tp[FZ_DOUT],
                           bwd_lse_null ? NULL : lse, tp[FZ_DQ], tp[FZ_DK], tp[FZ_DV], c->scale,
                           (forkattn_memory)c->memory);
  fz_check_call(ctx, "backward", st, bwd_v, buf, FZ_NT + 1);
  if (st == FORKATTN_OK) {
    for (int i = FZ_Q; i <= FZ_DOUT; i++)
      FZ_CHECK(fz_buf_same(&buf[i]), "backward: input %s changed", fz_tensor_names[i]);
    FZ_CHECK(fz_buf_same(lb), "backward: input lse changed");
    if (T > 0)
      for (int i = FZ_DQ; i <= FZ_DV; i++)
        fz_check_gaps("backward", fz_tensor_names[i], &t[i], &buf[i]);
    if (T > 0 && values_ok && have_fwd)
      for (int i = FZ_DQ; i <= FZ_DV; i++)
        fz_check_finite("backward", fz_tensor_names[i], &t[i]);
    if (T > 0 && ref_ok && have_fwd) {
      fz_ref_bwd(c, off, T, hq, hkv, d, lse);
      fz_stat.ref_checked++;
    }
  }

  for (int i = 0; i <= FZ_NT; i++)
    fz_buf_free(&buf[i]);
  free(off);
  fz_current = NULL;
}
