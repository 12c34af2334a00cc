/* The forward of dlm_model.h with per-request reuse depths.
 *
 * At layer l request i is CACHED (l < b_i: own rows only, against the shared
 * prefix's cached K/V), FULL (every row of [prefix ; own]) or DEEP (own rows
 * only, against its own stale deep-layer prefix K/V). Requests come sorted by
 * b_i descending, so the CACHED ones are always the first and one
 * forkattn_prefix_cached_fwd serves them all. Layouts, per request in order:
 *   x   (hidden, attention output): CACHED own | FULL prefix+own | DEEP own
 *   qkv: [shared prefix K/V, when any request is CACHED] then
 *        CACHED own | FULL prefix+own | DEEP stale prefix K/V + own
 * so the CACHED and FULL blocks map x rows to qkv rows one to one. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlm_model.h"

#define F32 FORKATTN_DTYPE_F32
#define HOST FORKATTN_MEMORY_HOST
/* elements below which a loop stays serial: a parallel region costs more */
#define DLM_PAR_MIN ((int64_t)1 << 16)

enum { DLM_CACHED, DLM_FULL, DLM_DEEP };


/* ---- small kernels ------------------------------------------------------------------ */

/* y = x / rms(x) * g per row */
static void dlm_rmsnorm(const float *x, int64_t rows, int64_t W, const float *g, float *y) {
#pragma omp parallel for schedule(static) if (rows * W > DLM_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const float *a = x + r * W;
    float *b = y + r * W;
    double ss = 0;
    for (int64_t j = 0; j < W; j++) ss += (double)a[j] * a[j];
    const float inv = (float)(1.0 / sqrt(ss / (double)W + 1e-6));
    for (int64_t j = 0; j < W; j++) b[j] = a[j] * inv * g[j];
  }
}

/* GELU, sigmoid form x * sigmoid(1.702 x): one expf per element */
static void dlm_gelu(float *x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > DLM_PAR_MIN)
  for (int64_t i = 0; i < n; i++) x[i] = x[i] / (1.0f + expf(-1.702f * x[i]));
}

/* C[M, N] (ldc) = beta C + A[M, K] (lda) B[K, N] */
static void dlm_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, float beta, float *C,
                     int64_t ldc) {
  if (M <= 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, A, (int)lda, B, (int)N, beta,
              C, (int)ldc);
}

static void dlm_copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) memcpy(dst + r * dst_ld, src + r * src_ld, sizeof(float) * (size_t)cols);
}

/* dst rows (stride dst_ld) = the f32 tensor t's first `rows` rows as [heads * d] */
static void dlm_copy_tensor_rows(float *dst, int64_t dst_ld, const forkattn_tensor *t, int64_t rows) {
  const float *src = t->data;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < t->heads; h++)
      memcpy(dst + r * dst_ld + h * t->head_dim, src + r * t->row_stride + h * t->head_stride,
             sizeof(float) * (size_t)t->head_dim);
}

/* ---- state --------------------------------------------------------------------------- */

typedef struct dlm_fw {
  forkattn_ctx *ctx;
  const dlm_model *m;
  const dlm_run *run;
  const dlm_batch *b;
  int64_t n, pre, T, R, W, H, d, L;
  const int64_t *depth;                 /* b_i */
  int64_t *own, *xoff, *qoff, *st, *lo; /* own rows; x and qkv offsets; state; layout offsets */
  int64_t xrows, qrows, ncached, rcached, shared;
  float *x, *x2, *xn, *qkv, *att, *mid;
  float scale;
  char *err;
  size_t errlen;
} dlm_fw;

static forkattn_tensor dlm_view(float *p, int64_t rows, const dlm_fw *f) {
  return (forkattn_tensor){p, F32, rows, f->H, f->d, 3 * f->W, f->d};
}

static forkattn_status dlm_lib_fail(dlm_fw *f, forkattn_status s, const char *what, int64_t layer) {
  return dlm_fail(f->err, f->errlen, s, "dlm: %s at layer %lld failed (%s): %s", what, (long long)layer,
                  forkattn_status_string(s), forkattn_ctx_last_error(f->ctx));
}

/* States and offsets at layer l. */
static void dlm_plan(dlm_fw *f, int64_t l, int64_t *st) {
  const int deep = f->run->deep && f->run->deep->reuse;
  f->ncached = f->rcached = 0;
  for (int64_t i = 0; i < f->n; i++) {
    st[i] = l < f->depth[i] ? DLM_CACHED : deep ? DLM_DEEP : DLM_FULL;
    if (st[i] == DLM_CACHED) f->ncached++, f->rcached += f->own[i];
  }
  f->shared = f->ncached ? f->pre : 0;
  f->xrows = 0;
  f->qrows = f->shared;
  for (int64_t i = 0; i < f->n; i++) {
    f->xoff[i] = f->xrows;
    f->qoff[i] = f->qrows;
    f->xrows += f->own[i] + (st[i] == DLM_FULL ? f->pre : 0);
    f->qrows += f->own[i] + (st[i] == DLM_CACHED ? 0 : f->pre);
  }
}

/* Token + position embeddings of request i's rows from position p0 into x. */
static void dlm_embed(const dlm_fw *f, int64_t i, int64_t p0, float *x) {
  const dlm_batch *b = f->b;
  const int64_t W = f->W, len = b->off[i + 1] - b->off[i];
#pragma omp parallel for schedule(static) if ((len - p0) * W > DLM_PAR_MIN)
  for (int64_t p = p0; p < len; p++) {
    const float *e = f->m->embed + (int64_t)b->tokens[b->off[i] + p] * W, *q = f->m->pos + p * W;
    float *y = x + (p - p0) * W;
    for (int64_t j = 0; j < W; j++) y[j] = e[j] + q[j];
  }
}

/* Requests leaving CACHED at layer l re-enter FULL with the prefix's hidden
 * state computed alone; x is rebuilt in the new layout. */
static void dlm_transition(dlm_fw *f, const int64_t *old_st, const int64_t *old_xoff, int64_t l) {
  const int64_t W = f->W;
  for (int64_t i = 0; i < f->n; i++) {
    float *dst = f->x2 + f->xoff[i] * W;
    if (old_st[i] == DLM_CACHED && f->st[i] == DLM_FULL) {
      memcpy(dst, f->run->prefix->hidden[l], sizeof(float) * (size_t)(f->pre * W));
      dst += f->pre * W;
    }
    const int64_t rows = f->own[i] + (old_st[i] == DLM_FULL ? f->pre : 0);
    memcpy(dst, f->x + old_xoff[i] * W, sizeof(float) * (size_t)(rows * W));
  }
  float *t = f->x;
  f->x = f->x2;
  f->x2 = t;
}

/* ---- one layer ---------------------------------------------------------------------- */

static forkattn_status dlm_qkv(dlm_fw *f, int64_t l) {
  const int64_t W = f->W, W3 = 3 * W;
  const dlm_model *m = f->m;
  if (f->shared) {
    dlm_copy_tensor_rows(f->qkv + W, W3, &f->run->prefix->k[l], f->pre);
    dlm_copy_tensor_rows(f->qkv + 2 * W, W3, &f->run->prefix->v[l], f->pre);
  }
  for (int64_t i = 0; i < f->n;) {
    if (f->st[i] == DLM_DEEP) { /* its stale prefix K/V, then its own rows */
      float *blk = f->qkv + f->qoff[i] * W3;
      dlm_copy_rows(blk + W, W3, f->run->deep->k[l] + i * f->pre * W, W, f->pre, W);
      dlm_copy_rows(blk + 2 * W, W3, f->run->deep->v[l] + i * f->pre * W, W, f->pre, W);
      dlm_gemm(f->own[i], W3, W, f->xn + f->xoff[i] * W, W, m->wqkv[l], 0, blk + f->pre * W3, W3);
      i++;
      continue;
    }
    int64_t j = i, rows = 0; /* a run of CACHED/FULL requests: x rows map one to one */
    while (j < f->n && f->st[j] != DLM_DEEP) rows += f->own[j] + (f->st[j] == DLM_FULL ? f->pre : 0), j++;
    dlm_gemm(rows, W3, W, f->xn + f->xoff[i] * W, W, m->wqkv[l], 0, f->qkv + f->qoff[i] * W3, W3);
    i = j;
  }
  return FORKATTN_OK;
}

static forkattn_status dlm_attention(dlm_fw *f, int64_t l) {
  const int64_t W = f->W, W3 = 3 * W, P = f->pre;
  forkattn_status s;
  if (f->ncached) { /* every CACHED request against the shared prefix, one call */
    f->lo[0] = 0;
    for (int64_t i = 0; i < f->ncached; i++) f->lo[i + 1] = f->lo[i] + f->own[i];
    const forkattn_prefix_layout lay = {P, f->ncached, f->lo, FORKATTN_MASK_BIDIRECTIONAL};
    const forkattn_tensor q = dlm_view(f->qkv + P * W3, f->rcached, f), k = dlm_view(f->qkv + W, P + f->rcached, f),
                          v = dlm_view(f->qkv + 2 * W, P + f->rcached, f),
                          o = forkattn_tensor_contiguous(f->att, F32, f->rcached, f->H, f->d);
    if ((s = forkattn_prefix_cached_fwd(f->ctx, &lay, &q, &k, &v, &o, NULL, f->scale, HOST)))
      return dlm_lib_fail(f, s, "forkattn_prefix_cached_fwd", l);
  }
  const int64_t first = f->ncached, nrest = f->n - first;
  if (nrest && f->st[first] == DLM_FULL && !f->m->c.prefix_blind) { /* plain varlen bidirectional */
    f->lo[0] = 0;
    for (int64_t j = 0; j < nrest; j++) f->lo[j + 1] = f->lo[j] + P + f->own[first + j];
    const forkattn_prefix_layout lay = {0, nrest, f->lo, FORKATTN_MASK_BIDIRECTIONAL};
    float *base = f->qkv + f->qoff[first] * W3;
    const forkattn_tensor q = dlm_view(base, f->lo[nrest], f), k = dlm_view(base + W, f->lo[nrest], f),
                          v = dlm_view(base + 2 * W, f->lo[nrest], f),
                          o = forkattn_tensor_contiguous(f->att + f->xoff[first] * W, F32, f->lo[nrest], f->H, f->d);
    if ((s = forkattn_prefix_fwd(f->ctx, &lay, &q, &k, &v, &o, NULL, f->scale, HOST)))
      return dlm_lib_fail(f, s, "forkattn_prefix_fwd", l);
  } else
    for (int64_t i = first; i < f->n; i++) {
      /* DEEP: own rows against the stale prefix; FULL in the test-only blind
       * model: the prefix as a prompt that cannot see the request */
      const int deep = f->st[i] == DLM_DEEP;
      const int64_t ro[2] = {0, f->own[i]}, rows = (deep ? 0 : P) + f->own[i];
      const forkattn_prefix_layout lay = {P, 1, ro, FORKATTN_MASK_BIDIRECTIONAL};
      float *blk = f->qkv + f->qoff[i] * W3;
      const forkattn_tensor q = dlm_view(blk + (deep ? P * W3 : 0), rows, f), k = dlm_view(blk + W, P + f->own[i], f),
                            v = dlm_view(blk + 2 * W, P + f->own[i], f),
                            o = forkattn_tensor_contiguous(f->att + f->xoff[i] * W, F32, rows, f->H, f->d);
      s = deep ? forkattn_prefix_cached_fwd(f->ctx, &lay, &q, &k, &v, &o, NULL, f->scale, HOST)
               : forkattn_prefix_fwd(f->ctx, &lay, &q, &k, &v, &o, NULL, f->scale, HOST);
      if (s) return dlm_lib_fail(f, s, deep ? "forkattn_prefix_cached_fwd (deep refresh)" : "forkattn_prefix_fwd", l);
    }
  return FORKATTN_OK;
}

/* Records (request 0's rows) and deep-layer captures of FULL requests. */
static void dlm_capture(dlm_fw *f, int64_t l) {
  const int64_t W = f->W, W3 = 3 * W;
  const dlm_record *rec = f->run->record;
  if (rec && f->st[0] == DLM_FULL) {
    const float *blk = f->qkv + f->qoff[0] * W3;
    if (rec->k[l]) dlm_copy_rows(rec->k[l], W, blk + W, W3, rec->rows, W);
    if (rec->v[l]) dlm_copy_rows(rec->v[l], W, blk + 2 * W, W3, rec->rows, W);
  }
  const dlm_deep *dp = f->run->deep;
  if (dp && !dp->reuse)
    for (int64_t i = 0; i < f->n; i++)
      if (f->st[i] == DLM_FULL) {
        const float *blk = f->qkv + f->qoff[i] * W3;
        dlm_copy_rows(dp->k[l] + i * f->pre * W, W, blk + W, W3, f->pre, W);
        dlm_copy_rows(dp->v[l] + i * f->pre * W, W, blk + 2 * W, W3, f->pre, W);
      }
}

static forkattn_status dlm_layer(dlm_fw *f, int64_t l) {
  const dlm_model *m = f->m;
  const int64_t W = f->W, rows = f->xrows;
  const dlm_record *rec = f->run->record;
  if (rec && rec->hidden[l] && f->st[0] == DLM_FULL) dlm_copy_rows(rec->hidden[l], W, f->x, W, rec->rows, W);
  dlm_rmsnorm(f->x, rows, W, m->g1[l], f->xn);
  forkattn_status s = dlm_qkv(f, l);
  if (!s) s = dlm_attention(f, l);
  if (s) return s;
  dlm_capture(f, l);
  dlm_gemm(rows, W, W, f->att, W, m->wo[l], 1, f->x, W);
  dlm_rmsnorm(f->x, rows, W, m->g2[l], f->xn);
  dlm_gemm(rows, m->mlp, W, f->xn, W, m->w1[l], 0, f->mid, m->mlp);
  dlm_gelu(f->mid, rows * m->mlp);
  dlm_gemm(rows, W, m->mlp, f->mid, m->mlp, m->w2[l], 1, f->x, W);
  return FORKATTN_OK;
}

/* ---- checks ---------------------------------------------------------------------------- */

static int dlm_tensor_ok(const forkattn_tensor *t, int64_t rows, const dlm_fw *f) {
  return t->data && t->dtype == F32 && t->rows == rows && t->heads == f->H && t->head_dim == f->d;
}

/* Everything checked before any work, so errors leave the outputs untouched. */
static forkattn_status dlm_check(dlm_fw *f) {
  const dlm_run *r = f->run;
  const dlm_model *m = f->m;
  char *e = f->err;
  const size_t el = f->errlen;
  const forkattn_status BAD = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!m->embed) return dlm_fail(e, el, BAD, "dlm: the model is not initialised");
  const dlm_batch *b = r->batch;
  if (!b || b->n < 1 || !b->off || !b->tokens)
    return dlm_fail(e, el, BAD, "dlm: the batch needs n >= 1 requests, offsets and tokens");
  if (b->off[0] != 0) return dlm_fail(e, el, BAD, "dlm: batch offsets must start at 0");
  if (b->prefix < 0) return dlm_fail(e, el, BAD, "dlm: batch prefix %lld < 0", (long long)b->prefix);
  for (int64_t i = 0; i < b->n; i++) {
    const int64_t len = b->off[i + 1] - b->off[i];
    if (len <= b->prefix)
      return dlm_fail(e, el, BAD, "dlm: request %lld has %lld tokens: it needs more than the %lld-token prefix",
                      (long long)i, (long long)len, (long long)b->prefix);
    if (len > m->c.max_pos)
      return dlm_fail(e, el, BAD, "dlm: request %lld has %lld tokens, the model has %lld positions", (long long)i,
                      (long long)len, (long long)m->c.max_pos);
  }
  for (int64_t t = 0; t < b->off[b->n]; t++)
    if (b->tokens[t] < 0 || b->tokens[t] >= m->c.vocab)
      return dlm_fail(e, el, BAD, "dlm: token %lld = %d is outside the vocabulary 0..%lld", (long long)t,
                      (int)b->tokens[t], (long long)m->c.vocab - 1);
  const int64_t L = m->c.layers;
  int64_t bmax = 0;
  for (int64_t i = 0; i < b->n; i++) {
    const int64_t bi = r->depths ? r->depths[i] : r->depth;
    if (bi < 0 || bi > L)
      return dlm_fail(e, el, BAD, "dlm: reuse depth %lld of request %lld not in 0..%lld", (long long)bi, (long long)i,
                      (long long)L);
    if (i && r->depths && bi > r->depths[i - 1])
      return dlm_fail(e, el, BAD, "dlm: reuse depths must not increase along the batch (request %lld)", (long long)i);
    bmax = bi > bmax ? bi : bmax;
  }
  const int shares = bmax > 0 || r->deep;
  if (shares && b->prefix < 1) return dlm_fail(e, el, BAD, "dlm: reusing a prefix needs batch prefix >= 1");
  for (int64_t i = 1; shares && i < b->n; i++)
    if (memcmp(b->tokens + b->off[i], b->tokens, sizeof(int32_t) * (size_t)b->prefix))
      return dlm_fail(e, el, BAD, "dlm: request %lld does not start with request 0's %lld-token prefix", (long long)i,
                      (long long)b->prefix);
  const int deep_reuse = r->deep && r->deep->reuse;
  if (bmax > 0) {
    const dlm_prefix *p = r->prefix;
    if (!p) return dlm_fail(e, el, BAD, "dlm: reuse depth %lld needs the prefix computed alone", (long long)bmax);
    if (p->len != b->prefix)
      return dlm_fail(e, el, BAD, "dlm: the cached prefix has %lld rows, the batch's prefix %lld", (long long)p->len,
                      (long long)b->prefix);
    for (int64_t l = 0; l < bmax; l++)
      if (!dlm_tensor_ok(&p->k[l], p->len, f) || !dlm_tensor_ok(&p->v[l], p->len, f))
        return dlm_fail(e, el, BAD, "dlm: the cached K/V of layer %lld must be f32 [%lld, %lld, %lld] host tensors",
                        (long long)l, (long long)p->len, (long long)f->H, (long long)f->d);
    for (int64_t i = 0; i < b->n && !deep_reuse; i++) {
      const int64_t bi = r->depths ? r->depths[i] : r->depth;
      if (bi > 0 && bi < L && !p->hidden[bi])
        return dlm_fail(e, el, BAD, "dlm: reuse depth %lld needs the prefix's hidden state entering layer %lld",
                        (long long)bi, (long long)bi);
    }
  }
  if (r->deep) {
    const int64_t bmin = r->depths ? r->depths[b->n - 1] : r->depth;
    for (int64_t l = bmin; l < L; l++)
      if (!r->deep->k[l] || !r->deep->v[l])
        return dlm_fail(e, el, BAD, "dlm: deep-layer K/V buffers of layer %lld are missing", (long long)l);
  }
  if (r->record && (r->record->rows < 0 || r->record->rows > b->off[1]))
    return dlm_fail(e, el, BAD, "dlm: record rows %lld not in 0..%lld (request 0's length)",
                    (long long)r->record->rows, (long long)b->off[1]);
  return FORKATTN_OK;
}

/* ---- the forward ----------------------------------------------------------------------- */

static void dlm_fw_free(dlm_fw *f) {
  free(f->own);
  free(f->x);
  free(f->x2);
  free(f->xn);
  free(f->qkv);
  free(f->att);
  free(f->mid);
}

forkattn_status dlm_forward(forkattn_ctx *ctx, const dlm_model *m, const dlm_run *run, char *err, size_t errlen) {
  if (err && errlen) err[0] = '\0';
  if (!ctx || !m || !run) return dlm_fail(err, errlen, FORKATTN_ERR_INVALID_ARGUMENT, "dlm: ctx, model or run is NULL");
  dlm_fw f = {.ctx = ctx, .m = m, .run = run, .b = run->batch, .err = err, .errlen = errlen};
  f.W = m->c.width, f.H = m->c.heads, f.d = m->d, f.L = m->c.layers;
  forkattn_status s = dlm_check(&f);
  if (s) return s;
  const dlm_batch *b = run->batch;
  const int64_t W = f.W, n = b->n;
  f.n = n, f.pre = b->prefix, f.T = b->off[n], f.R = f.T - n * f.pre;
  f.scale = 1.0f / sqrtf((float)f.d);
  const size_t T = (size_t)f.T, Q = (size_t)(f.T + f.pre); /* most rows of x and of qkv */
  f.own = malloc(sizeof(int64_t) * (size_t)(8 * n + 1));
  f.x = malloc(sizeof(float) * T * (size_t)W);
  f.x2 = malloc(sizeof(float) * T * (size_t)W);
  f.xn = malloc(sizeof(float) * T * (size_t)W);
  f.qkv = malloc(sizeof(float) * Q * (size_t)(3 * W));
  f.att = malloc(sizeof(float) * T * (size_t)W);
  f.mid = malloc(sizeof(float) * T * (size_t)m->mlp);
  if (!f.own || !f.x || !f.x2 || !f.xn || !f.qkv || !f.att || !f.mid) {
    dlm_fw_free(&f);
    return dlm_fail(err, errlen, FORKATTN_ERR_OUT_OF_MEMORY, "dlm: out of memory for %lld rows", (long long)f.T);
  }
  /* int64 scratch: own, xoff, qoff, st, depth, old st, old xoff (n each), lo (n + 1) */
  f.xoff = f.own + n, f.qoff = f.own + 2 * n, f.st = f.own + 3 * n;
  int64_t *depth = f.own + 4 * n, *old_st = f.own + 5 * n, *old_xoff = f.own + 6 * n;
  f.lo = f.own + 7 * n;
  for (int64_t i = 0; i < n; i++) {
    f.own[i] = b->off[i + 1] - b->off[i] - f.pre;
    depth[i] = run->depths ? run->depths[i] : run->depth;
  }
  f.depth = depth;
  dlm_plan(&f, 0, f.st);
  for (int64_t i = 0; i < n; i++)
    dlm_embed(&f, i, f.st[i] == DLM_FULL ? 0 : f.pre, f.x + f.xoff[i] * W);
  for (int64_t l = 0; l < f.L && !s; l++) {
    if (l > 0) {
      memcpy(old_st, f.st, sizeof(int64_t) * (size_t)n);
      memcpy(old_xoff, f.xoff, sizeof(int64_t) * (size_t)n);
      dlm_plan(&f, l, f.st);
      if (memcmp(old_st, f.st, sizeof(int64_t) * (size_t)n)) dlm_transition(&f, old_st, old_xoff, l);
    }
    s = dlm_layer(&f, l);
  }
  if (!s && run->hidden) { /* own rows, in request order, out of x */
    for (int64_t i = 0, r = 0; i < n; r += f.own[i], i++)
      memcpy(f.x2 + r * W, f.x + (f.xoff[i] + (f.st[i] == DLM_FULL ? f.pre : 0)) * W,
             sizeof(float) * (size_t)(f.own[i] * W));
    dlm_rmsnorm(f.x2, f.R, W, m->gf, run->hidden);
  }
  dlm_fw_free(&f);
  return s;
}
