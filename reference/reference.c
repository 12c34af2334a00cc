/*
 * reference.c - float64 reference of shared-prompt attention (tests only).
 * See reference.h for the formulation.
 */
#include "reference.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#define REF_PRAGMA(x) _Pragma(#x)
#else
#define REF_PRAGMA(x)
#endif

/* ---- 16-bit conversions --------------------------------------------------- */

uint32_t ref_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

float ref_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

float ref_bf16_to_float(uint16_t h) { return ref_bits_float((uint32_t)h << 16); }

uint16_t ref_float_to_bf16(float f) {
  uint32_t u = ref_float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: keep sign and payload top, force quiet */
    return (uint16_t)((u >> 16) | 0x0040u);
  /* Round to nearest even: add 0x7FFF plus the lowest kept bit. Overflow
   * correctly carries into the exponent (up to inf). */
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float ref_f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float */
    float x = ldexpf((float)m, -24);
    return sign ? -x : x;
  }
  if (e == 31) /* inf or NaN */
    return ref_bits_float(sign | 0x7F800000u | (m << 13));
  return ref_bits_float(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

uint16_t ref_float_to_f16(float f) {
  uint32_t x = ref_float_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) /* NaN */
    return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  /* 65520 = 0x477FF000 is halfway between 65504 (odd mantissa) and 65536:
   * ties-to-even goes up, so everything >= it becomes inf. */
  if (ax >= 0x477FF000u)
    return (uint16_t)(sign | 0x7C00u);
  if (ax < 0x38800000u) { /* below 2^-14: result is subnormal (or zero) */
    uint32_t e = ax >> 23;
    if (e < 102) /* < 2^-25: rounds to zero (2^-25 itself is handled below) */
      return sign;
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u; /* value = m * 2^(e-150) */
    uint32_t shift = 126u - e;                 /* to units of 2^-24: 14..24 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
      r++; /* may become 0x400: the smallest normal, correctly encoded */
    return (uint16_t)(sign | r);
  }
  uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | ((ax >> 13) & 0x3FFu);
  uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
    h++; /* carry into the exponent is the correct result */
  return (uint16_t)(sign | h);
}

double ref_round_to_dtype(double x, forkattn_dtype dtype) {
  switch (dtype) {
  case FORKATTN_DTYPE_F32: return (double)(float)x;
  case FORKATTN_DTYPE_BF16: return (double)ref_bf16_to_float(ref_float_to_bf16((float)x));
  case FORKATTN_DTYPE_F16: return (double)ref_f16_to_float(ref_float_to_f16((float)x));
  }
  return NAN;
}

size_t ref_dtype_size(forkattn_dtype dtype) {
  switch (dtype) {
  case FORKATTN_DTYPE_F32: return 4;
  case FORKATTN_DTYPE_BF16: return 2;
  case FORKATTN_DTYPE_F16: return 2;
  }
  return 0;
}

const char *ref_dtype_name(forkattn_dtype dtype) {
  switch (dtype) {
  case FORKATTN_DTYPE_F32: return "f32";
  case FORKATTN_DTYPE_BF16: return "bf16";
  case FORKATTN_DTYPE_F16: return "f16";
  }
  return "?";
}

/* ---- strided tensors ------------------------------------------------------ */

int64_t ref_tensor_offset(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c) {
  return r * t->row_stride + h * t->head_stride + c;
}

double ref_tensor_get(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c) {
  int64_t i = ref_tensor_offset(t, r, h, c);
  switch (t->dtype) {
  case FORKATTN_DTYPE_F32: return (double)((const float *)t->data)[i];
  case FORKATTN_DTYPE_BF16: return (double)ref_bf16_to_float(((const uint16_t *)t->data)[i]);
  case FORKATTN_DTYPE_F16: return (double)ref_f16_to_float(((const uint16_t *)t->data)[i]);
  }
  return NAN;
}

void ref_tensor_set(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c, double x) {
  int64_t i = ref_tensor_offset(t, r, h, c);
  switch (t->dtype) {
  case FORKATTN_DTYPE_F32: ((float *)t->data)[i] = (float)x; break;
  case FORKATTN_DTYPE_BF16: ((uint16_t *)t->data)[i] = ref_float_to_bf16((float)x); break;
  case FORKATTN_DTYPE_F16: ((uint16_t *)t->data)[i] = ref_float_to_f16((float)x); break;
  }
}

void ref_tensor_read(const forkattn_tensor *t, double *out) {
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      for (int64_t c = 0; c < t->head_dim; c++)
        *out++ = ref_tensor_get(t, r, h, c);
}

void ref_tensor_write(const forkattn_tensor *t, const double *in) {
  for (int64_t r = 0; r < t->rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      for (int64_t c = 0; c < t->head_dim; c++)
        ref_tensor_set(t, r, h, c, *in++);
}

/* ---- attention ------------------------------------------------------------ */

int64_t ref_prefix_rows(const forkattn_prefix_layout *layout) {
  if (!layout || layout->prompt_len < 0 || layout->num_responses < 0)
    return -1;
  if (layout->num_responses == 0)
    return layout->prompt_len;
  const int64_t *off = layout->response_offsets;
  if (!off || off[0] != 0)
    return -1;
  for (int64_t i = 0; i < layout->num_responses; i++)
    if (off[i + 1] < off[i])
      return -1;
  return layout->prompt_len + off[layout->num_responses];
}

static double dot(const double *a, const double *b, int64_t n) {
  double s = 0.0;
  for (int64_t c = 0; c < n; c++)
    s += a[c] * b[c];
  return s;
}

static void axpy(double *y, double a, const double *x, int64_t n) {
  for (int64_t c = 0; c < n; c++)
    y[c] += a * x[c];
}

/* Number of keys row i of a sequence may see (keys [0, end)). */
static int64_t visible_end(int64_t i, int64_t len, int64_t prompt_len, forkattn_mask mask) {
  if (mask == FORKATTN_MASK_CAUSAL)
    return i + 1;
  return i < prompt_len ? prompt_len : len;
}

int ref_attention_dense(int64_t len, int64_t prompt_len, int64_t q_begin, forkattn_mask mask,
                        int64_t hq, int64_t hkv, int64_t d, double scale, const double *q,
                        const double *k, const double *v, const double *dout, double *o,
                        double *lse, double *dq, double *dk, double *dv) {
  if (len < 0 || prompt_len < 0 || prompt_len > len || q_begin < 0 || q_begin > len ||
      hq <= 0 || hkv <= 0 || hq % hkv != 0 || d <= 0)
    return -1;
  if (mask != FORKATTN_MASK_CAUSAL && mask != FORKATTN_MASK_BIDIRECTIONAL)
    return -1;
  if (dout && (!dq || !dk || !dv))
    return -1;
  if (dout) {
    memset(dk, 0, (size_t)(len * hkv * d) * sizeof *dk);
    memset(dv, 0, (size_t)(len * hkv * d) * sizeof *dv);
  }
  if (len == 0)
    return 0;

  const int64_t group = hq / hkv;
  const size_t ld = (size_t)(len * d);
  double *kg = malloc(ld * sizeof *kg);
  double *vg = malloc(ld * sizeof *vg);
  /* Per query head of the group: private dk/dv (summed afterwards in a fixed
   * order) and scratch for the scores/probabilities and dp of one row. */
  double *dkh = dout ? calloc((size_t)group * ld, sizeof *dkh) : NULL;
  double *dvh = dout ? calloc((size_t)group * ld, sizeof *dvh) : NULL;
  double *pbuf = malloc((size_t)(group * len) * sizeof *pbuf);
  double *dpbuf = malloc((size_t)(group * len) * sizeof *dpbuf);
  double *obuf = malloc((size_t)(group * d) * sizeof *obuf);
  double *dqbuf = malloc((size_t)(group * d) * sizeof *dqbuf);
  int ok = kg && vg && pbuf && dpbuf && obuf && dqbuf && (!dout || (dkh && dvh));
  if (!ok)
    goto done;

  for (int64_t g = 0; g < hkv; g++) {
    for (int64_t j = 0; j < len; j++) {
      memcpy(kg + j * d, k + (j * hkv + g) * d, (size_t)d * sizeof *kg);
      memcpy(vg + j * d, v + (j * hkv + g) * d, (size_t)d * sizeof *vg);
    }
    if (dout) {
      memset(dkh, 0, (size_t)group * ld * sizeof *dkh);
      memset(dvh, 0, (size_t)group * ld * sizeof *dvh);
    }
    REF_PRAGMA(omp parallel for schedule(dynamic, 1))
    for (int64_t hh = 0; hh < group; hh++) {
      const int64_t h = g * group + hh;
      double *p = pbuf + hh * len, *dp = dpbuf + hh * len;
      double *oi = obuf + hh * d, *dqi = dqbuf + hh * d;
      double *dkp = dout ? dkh + (size_t)hh * ld : NULL;
      double *dvp = dout ? dvh + (size_t)hh * ld : NULL;
      for (int64_t i = q_begin; i < len; i++) {
        const int64_t end = visible_end(i, len, prompt_len, mask);
        const double *qi = q + (i * hq + h) * d;
        memset(oi, 0, (size_t)d * sizeof *oi);
        if (end == 0) { /* empty set: o = 0, lse = -inf, no gradient */
          if (o)
            memset(o + (i * hq + h) * d, 0, (size_t)d * sizeof *o);
          if (lse)
            lse[i * hq + h] = -INFINITY;
          if (dout)
            memset(dq + (i * hq + h) * d, 0, (size_t)d * sizeof *dq);
          continue;
        }
        double m = -INFINITY;
        for (int64_t j = 0; j < end; j++) {
          p[j] = scale * dot(qi, kg + j * d, d);
          if (p[j] > m)
            m = p[j];
        }
        double sum = 0.0;
        for (int64_t j = 0; j < end; j++) {
          p[j] = exp(p[j] - m);
          sum += p[j];
        }
        for (int64_t j = 0; j < end; j++) {
          p[j] /= sum;
          axpy(oi, p[j], vg + j * d, d);
        }
        if (o)
          memcpy(o + (i * hq + h) * d, oi, (size_t)d * sizeof *o);
        if (lse)
          lse[i * hq + h] = m + log(sum);
        if (!dout)
          continue;
        const double *doi = dout + (i * hq + h) * d;
        double D = 0.0; /* rowsum(dO * O) = sum_j p_j dp_j */
        for (int64_t j = 0; j < end; j++) {
          dp[j] = dot(doi, vg + j * d, d);
          D += p[j] * dp[j];
        }
        memset(dqi, 0, (size_t)d * sizeof *dqi);
        for (int64_t j = 0; j < end; j++) {
          const double ds = p[j] * (dp[j] - D);
          axpy(dqi, scale * ds, kg + j * d, d);
          axpy(dkp + j * d, scale * ds, qi, d);
          axpy(dvp + j * d, p[j], doi, d);
        }
        memcpy(dq + (i * hq + h) * d, dqi, (size_t)d * sizeof *dq);
      }
    }
    if (dout) {
      for (int64_t hh = 0; hh < group; hh++)
        for (int64_t j = 0; j < len; j++) {
          axpy(dk + (j * hkv + g) * d, 1.0, dkh + (size_t)hh * ld + j * d, d);
          axpy(dv + (j * hkv + g) * d, 1.0, dvh + (size_t)hh * ld + j * d, d);
        }
    }
  }

done:
  free(kg);
  free(vg);
  free(dkh);
  free(dvh);
  free(pbuf);
  free(dpbuf);
  free(obuf);
  free(dqbuf);
  return ok ? 0 : -1;
}

/* Copy @p n rows of @p width doubles from src row @p s to dst row @p t. */
static void copy_rows(double *dst, int64_t t, const double *src, int64_t s, int64_t n,
                      int64_t width) {
  if (n > 0)
    memcpy(dst + t * width, src + s * width, (size_t)(n * width) * sizeof *dst);
}

/* Per-path scratch of ref_prefix and ref_tree, slices of one allocation: q/o/dout/dq of
 * max_len * wq doubles, k/v/dk/dv of max_len * wk, lse of max_len * hq (one more each, so that
 * no size is 0); the gradient slices (NULL otherwise) only for a backward. */
typedef struct ref_scratch {
  double *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv;
} ref_scratch;

static void scratch_free(ref_scratch *s) {
  free(s->q);
  memset(s, 0, sizeof *s);
}

/* 0, or -1 (nothing allocated) when memory runs out. */
static int scratch_alloc(ref_scratch *s, int64_t max_len, int64_t wq, int64_t wk, int64_t hq, int bwd) {
  const size_t nq = (size_t)(max_len * wq) + 1, nk = (size_t)(max_len * wk) + 1;
  const size_t nl = (size_t)(max_len * hq) + 1, nqb = bwd ? nq : 0, nkb = bwd ? nk : 0;
  const size_t sizes[] = {nq, nk, nk, nq, nl, nqb, nqb, nkb, nkb};
  double **slices[] = {&s->q, &s->k, &s->v, &s->o, &s->lse, &s->dout, &s->dq, &s->dk, &s->dv};
  size_t total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
    total += sizes[i];
  double *next = malloc(total * sizeof *next);
  memset(s, 0, sizeof *s);
  if (!next)
    return -1;
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    *slices[i] = sizes[i] ? next : NULL;
    next += sizes[i];
  }
  return 0;
}

int ref_prefix(const ref_prefix_args *a, const ref_prefix_out *out) {
  const forkattn_prefix_layout *lay = a->layout;
  const int64_t T = ref_prefix_rows(lay);
  if (T < 0 || a->hq <= 0 || a->hkv <= 0 || a->hq % a->hkv != 0 || a->d <= 0)
    return -1;
  const int64_t P = lay->prompt_len, N = lay->num_responses;
  const int64_t wq = a->hq * a->d, wk = a->hkv * a->d;
  const int bwd = a->dout != NULL;

  int64_t max_len = P;
  for (int64_t i = 0; i < N; i++) {
    const int64_t L = P + lay->response_offsets[i + 1] - lay->response_offsets[i];
    if (L > max_len)
      max_len = L;
  }
  ref_scratch s;
  int rc = -1;
  if (scratch_alloc(&s, max_len, wq, wk, a->hq, bwd) != 0)
    goto done;

  /* 1. The prompt alone: prompt rows' o, lse, dq and the own part of dk/dv. */
  if (P > 0) {
    if (ref_attention_dense(P, P, 0, lay->mask, a->hq, a->hkv, a->d, a->scale, a->q, a->k, a->v,
                            a->dout, s.o, s.lse, s.dq, s.dk, s.dv) != 0)
      goto done;
    if (out->o)
      copy_rows(out->o, 0, s.o, 0, P, wq);
    if (out->lse)
      copy_rows(out->lse, 0, s.lse, 0, P, a->hq);
    if (bwd) {
      if (out->dq)
        copy_rows(out->dq, 0, s.dq, 0, P, wq);
      if (out->dk)
        copy_rows(out->dk, 0, s.dk, 0, P, wk);
      if (out->dv)
        copy_rows(out->dv, 0, s.dv, 0, P, wk);
    }
  }

  /* 2. Each response replicated behind its own copy of the prompt. */
  for (int64_t i = 0; i < N; i++) {
    const int64_t r0 = P + lay->response_offsets[i];
    const int64_t R = lay->response_offsets[i + 1] - lay->response_offsets[i];
    const int64_t L = P + R;
    if (R == 0)
      continue; /* a copy without response rows adds nothing */
    copy_rows(s.q, 0, a->q, 0, P, wq);
    copy_rows(s.q, P, a->q, r0, R, wq);
    copy_rows(s.k, 0, a->k, 0, P, wk);
    copy_rows(s.k, P, a->k, r0, R, wk);
    copy_rows(s.v, 0, a->v, 0, P, wk);
    copy_rows(s.v, P, a->v, r0, R, wk);
    if (bwd) {
      memset(s.dout, 0, (size_t)(P * wq) * sizeof *s.dout); /* prompt copy: no loss */
      copy_rows(s.dout, P, a->dout, r0, R, wq);
    }
    if (ref_attention_dense(L, P, P, lay->mask, a->hq, a->hkv, a->d, a->scale, s.q, s.k, s.v,
                            bwd ? s.dout : NULL, s.o, s.lse, s.dq, s.dk, s.dv) != 0)
      goto done;
    if (out->o)
      copy_rows(out->o, r0, s.o, P, R, wq);
    if (out->lse)
      copy_rows(out->lse, r0, s.lse, P, R, a->hq);
    if (!bwd)
      continue;
    if (out->dq)
      copy_rows(out->dq, r0, s.dq, P, R, wq);
    if (out->dk) {
      copy_rows(out->dk, r0, s.dk, P, R, wk);
      for (int64_t x = 0; x < P * wk; x++)
        out->dk[x] += s.dk[x];
    }
    if (out->dv) {
      copy_rows(out->dv, r0, s.dv, P, R, wk);
      for (int64_t x = 0; x < P * wk; x++)
        out->dv[x] += s.dv[x];
    }
  }
  rc = 0;

done:
  scratch_free(&s);
  return rc;
}

int ref_tree(const ref_tree_args *a, const ref_prefix_out *out) {
  const forkattn_tree_layout *t = a->tree;
  const int64_t n = t->num_nodes;
  if (n < 0 || a->hq <= 0 || a->hkv <= 0 || a->hq % a->hkv != 0 || a->d <= 0) return -1;
  const int64_t *off = t->node_offsets, *par = t->parents;
  const int64_t T = n ? off[n] : 0, wq = a->hq * a->d, wk = a->hkv * a->d;
  const int bwd = a->dout != NULL;
  for (int64_t i = 0; i < n; i++)
    if (off[i + 1] < off[i] || par[i] < -1 || par[i] >= i) return -1;
  /* path length of every node (ancestors' rows + own rows) */
  int64_t *plen = malloc((size_t)(n + 1) * sizeof *plen), max_len = 0;
  int64_t *rows = NULL;
  ref_scratch s = {0};
  int rc = -1;
  if (!plen) return -1;
  for (int64_t i = 0; i < n; i++) {
    plen[i] = (par[i] >= 0 ? plen[par[i]] : 0) + off[i + 1] - off[i];
    if (plen[i] > max_len) max_len = plen[i];
  }
  rows = malloc((size_t)(max_len + 1) * sizeof *rows);
  if (!rows || scratch_alloc(&s, max_len, wq, wk, a->hq, bwd) != 0) goto done;
  if (bwd && out->dk) memset(out->dk, 0, (size_t)(T * wk) * sizeof *out->dk);
  if (bwd && out->dv) memset(out->dv, 0, (size_t)(T * wk) * sizeof *out->dv);
  for (int64_t x = 0; x < n; x++) {
    const int64_t len = off[x + 1] - off[x], L = plen[x], own = L - len;
    if (len == 0) continue;
    /* the path's rows, root first: walk up filling from the back */
    int64_t pos = L;
    for (int64_t y = x; y >= 0; y = par[y])
      for (int64_t r = off[y + 1] - 1; r >= off[y]; r--) rows[--pos] = r;
    for (int64_t j = 0; j < L; j++) {
      copy_rows(s.q, j, a->q, rows[j], 1, wq);
      copy_rows(s.k, j, a->k, rows[j], 1, wk);
      copy_rows(s.v, j, a->v, rows[j], 1, wk);
      if (bwd) {
        if (j < own)
          memset(s.dout + j * wq, 0, (size_t)wq * sizeof *s.dout); /* ancestors' loss is counted at their own node */
        else
          copy_rows(s.dout, j, a->dout, rows[j], 1, wq);
      }
    }
    if (ref_attention_dense(L, 0, own, FORKATTN_MASK_CAUSAL, a->hq, a->hkv, a->d, a->scale, s.q, s.k, s.v,
                            bwd ? s.dout : NULL, s.o, s.lse, s.dq, s.dk, s.dv) != 0)
      goto done;
    if (out->o) copy_rows(out->o, off[x], s.o, own, len, wq);
    if (out->lse) copy_rows(out->lse, off[x], s.lse, own, len, a->hq);
    if (!bwd) continue;
    if (out->dq) copy_rows(out->dq, off[x], s.dq, own, len, wq);
    for (int64_t j = 0; j < L; j++)
      for (int64_t c = 0; c < wk; c++) {
        if (out->dk) out->dk[rows[j] * wk + c] += s.dk[j * wk + c];
        if (out->dv) out->dv[rows[j] * wk + c] += s.dv[j * wk + c];
      }
  }
  rc = 0;
done:
  free(plen);
  free(rows);
  scratch_free(&s);
  return rc;
}
