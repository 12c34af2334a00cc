/* Shared-prompt groups for the tools: build, replicate, run, compare. */
#include "group.h"
#include "reference.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

double tool_now(void) { return omp_get_wtime(); }

size_t tool_dtype_size(forkattn_dtype t) { return t == FORKATTN_DTYPE_F32 ? 4 : 2; }

static uint64_t tool_rng(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* 16-bit conversions: the float64 reference's (round to nearest even, subnormals kept). */
static uint16_t tool_to_half(float f, forkattn_dtype t) {
  return t == FORKATTN_DTYPE_BF16 ? ref_float_to_bf16(f) : ref_float_to_f16(f);
}

static float tool_from(const void *p, forkattn_dtype t, int64_t i) {
  if (t == FORKATTN_DTYPE_F32) return ((const float *)p)[i];
  const uint16_t h = ((const uint16_t *)p)[i];
  return t == FORKATTN_DTYPE_BF16 ? ref_bf16_to_float(h) : ref_f16_to_float(h);
}

static void tool_fill(void *p, forkattn_dtype t, int64_t n, uint64_t *seed) {
  for (int64_t i = 0; i < n; i++) {
    float x = (float)((double)(tool_rng(seed) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    if (t == FORKATTN_DTYPE_F32) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = tool_to_half(x, t);
  }
}

static int tool_alloc(tool_group *g, const tool_shape *s) {
  size_t es = tool_dtype_size(s->dtype);
  size_t nq = (size_t)(g->rows * s->hq * s->d) * es, nk = (size_t)(g->rows * s->hkv * s->d) * es;
  g->q = malloc(nq); g->o = malloc(nq); g->dout = malloc(nq); g->dq = malloc(nq);
  g->k = malloc(nk); g->v = malloc(nk); g->dk = malloc(nk); g->dv = malloc(nk);
  g->lse = malloc(sizeof(float) * (size_t)(g->rows * s->hq) + 1);
  return (g->q && g->o && g->dout && g->dq && g->k && g->v && g->dk && g->dv && g->lse) ? 0 : -1;
}

int tool_group_shared(tool_group *g, const tool_shape *s, uint64_t seed) {
  memset(g, 0, sizeof *g);
  g->off = malloc(sizeof(int64_t) * (size_t)(s->n + 1));
  if (!g->off) return -1;
  for (int64_t i = 0; i <= s->n; i++) g->off[i] = i * s->r;
  g->rows = s->p + s->n * s->r;
  g->layout = (forkattn_prefix_layout){s->p, s->n, g->off, s->mask};
  if (tool_alloc(g, s)) return -1;
  tool_fill(g->q, s->dtype, g->rows * s->hq * s->d, &seed);
  tool_fill(g->k, s->dtype, g->rows * s->hkv * s->d, &seed);
  tool_fill(g->v, s->dtype, g->rows * s->hkv * s->d, &seed);
  tool_fill(g->dout, s->dtype, g->rows * s->hq * s->d, &seed);
  return 0;
}

int tool_group_replicated(tool_group *rep, const tool_group *sh, const tool_shape *s) {
  memset(rep, 0, sizeof *rep);
  rep->off = malloc(sizeof(int64_t) * (size_t)(s->n + 1));
  if (!rep->off) return -1;
  int64_t len = s->p + s->r;
  for (int64_t i = 0; i <= s->n; i++) rep->off[i] = i * len;
  rep->rows = s->n * len;
  /* causal: one variable-length batch; bidirectional: the prompt must not see
   * the response, so each copy is its own one-response group (see tool_group_run) */
  rep->layout = (forkattn_prefix_layout){0, s->n, rep->off, s->mask};
  if (tool_alloc(rep, s)) return -1;
  size_t es = tool_dtype_size(s->dtype);
  size_t qrow = (size_t)(s->hq * s->d) * es, krow = (size_t)(s->hkv * s->d) * es;
  for (int64_t i = 0; i < s->n; i++)
    for (int64_t rel = 0; rel < len; rel++) {
      int64_t src = rel < s->p ? rel : s->p + i * s->r + (rel - s->p);
      int64_t dst = i * len + rel;
      memcpy((char *)rep->q + dst * qrow, (char *)sh->q + src * qrow, qrow);
      memcpy((char *)rep->k + dst * krow, (char *)sh->k + src * krow, krow);
      memcpy((char *)rep->v + dst * krow, (char *)sh->v + src * krow, krow);
      if (rel < s->p && i > 0)
        memset((char *)rep->dout + dst * qrow, 0, qrow);
      else
        memcpy((char *)rep->dout + dst * qrow, (char *)sh->dout + src * qrow, qrow);
    }
  return 0;
}

void tool_group_free(forkattn_ctx *ctx, tool_group *g) {
  for (int i = 0; i < 8; i++)
    if (g->dev[i]) forkattn_device_free(ctx, g->dev[i]);
  if (g->dev_lse) forkattn_device_free(ctx, g->dev_lse);
  free(g->off); free(g->q); free(g->k); free(g->v); free(g->o);
  free(g->dout); free(g->dq); free(g->dk); free(g->dv); free(g->lse);
  memset(g, 0, sizeof *g);
}

int tool_group_to_device(forkattn_ctx *ctx, tool_group *g, const tool_shape *s) {
  if (forkattn_ctx_backend(ctx) != FORKATTN_BACKEND_GPU) return 0;
  size_t es = tool_dtype_size(s->dtype);
  size_t nq = (size_t)(g->rows * s->hq * s->d) * es, nk = (size_t)(g->rows * s->hkv * s->d) * es;
  void *host[8] = {g->q, g->k, g->v, g->o, g->dout, g->dq, g->dk, g->dv};
  size_t bytes[8] = {nq, nk, nk, nq, nq, nq, nk, nk};
  for (int i = 0; i < 8; i++) {
    if (forkattn_device_malloc(ctx, bytes[i], &g->dev[i])) return -1;
    if (forkattn_memcpy(ctx, g->dev[i], FORKATTN_MEMORY_DEVICE, host[i], FORKATTN_MEMORY_HOST, bytes[i]))
      return -1;
  }
  void *l;
  if (forkattn_device_malloc(ctx, sizeof(float) * (size_t)(g->rows * s->hq), &l)) return -1;
  g->dev_lse = l;
  return 0;
}

int tool_group_fetch(forkattn_ctx *ctx, tool_group *g, const tool_shape *s) {
  if (!g->dev[0]) return 0;
  size_t es = tool_dtype_size(s->dtype);
  size_t nq = (size_t)(g->rows * s->hq * s->d) * es, nk = (size_t)(g->rows * s->hkv * s->d) * es;
  const int idx[4] = {3, 5, 6, 7};
  void *host[4] = {g->o, g->dq, g->dk, g->dv};
  size_t bytes[4] = {nq, nq, nk, nk};
  for (int i = 0; i < 4; i++)
    if (forkattn_memcpy(ctx, host[i], FORKATTN_MEMORY_HOST, g->dev[idx[i]], FORKATTN_MEMORY_DEVICE, bytes[i]))
      return -1;
  return forkattn_memcpy(ctx, g->lse, FORKATTN_MEMORY_HOST, g->dev_lse, FORKATTN_MEMORY_DEVICE,
                         sizeof(float) * (size_t)(g->rows * s->hq)) ? -1 : 0;
}

/* Run on rows [row0, row0 + layout rows) of the group's (host or device) buffers. */
static forkattn_status tool_run_layout(forkattn_ctx *ctx, tool_group *g, const tool_shape *s,
                                       const forkattn_prefix_layout *l, int64_t row0, int bwd) {
  int dev = g->dev[0] != NULL;
  void *const *src = dev ? g->dev : (void *[8]){g->q, g->k, g->v, g->o, g->dout, g->dq, g->dk, g->dv};
  float *lse = (dev ? g->dev_lse : g->lse) + row0 * s->hq;
  int64_t rows = l->prompt_len + l->response_offsets[l->num_responses];
  size_t es = tool_dtype_size(s->dtype);
  forkattn_tensor t[8];
  for (int i = 0; i < 8; i++) {
    int64_t h = (i == 1 || i == 2 || i == 6 || i == 7) ? s->hkv : s->hq;
    t[i] = forkattn_tensor_contiguous((char *)src[i] + (size_t)(row0 * h * s->d) * es, s->dtype, rows, h, s->d);
  }
  forkattn_memory mem = dev ? FORKATTN_MEMORY_DEVICE : FORKATTN_MEMORY_HOST;
  float scale = 1.0f / sqrtf((float)s->d);
  forkattn_status st = forkattn_prefix_fwd(ctx, l, &t[0], &t[1], &t[2], &t[3], lse, scale, mem);
  if (st || !bwd) return st;
  return forkattn_prefix_bwd(ctx, l, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], scale, mem);
}

forkattn_status tool_group_run(forkattn_ctx *ctx, tool_group *g, const tool_shape *s, int bwd) {
  /* A replicated bidirectional batch runs copy by copy (prompt must not see responses). */
  if (g->layout.prompt_len == 0 && s->mask == FORKATTN_MASK_BIDIRECTIONAL && s->p > 0) {
    int64_t one[2] = {0, s->r};
    forkattn_prefix_layout l = {s->p, 1, one, s->mask};
    for (int64_t i = 0; i < s->n; i++) {
      forkattn_status st = tool_run_layout(ctx, g, s, &l, i * (s->p + s->r), bwd);
      if (st) return st;
    }
    return FORKATTN_OK;
  }
  return tool_run_layout(ctx, g, s, &g->layout, 0, bwd);
}

/* max |a - b| over a [rows, heads*d] slice, normalised by max |a|. */
typedef struct { double diff, ref; } tool_err_acc;

static void tool_acc(tool_err_acc *e, double a, double b) {
  double d = fabs(a - b);
  if (!(d <= e->diff)) e->diff = d; /* NaN propagates */
  if (fabs(a) > e->ref) e->ref = fabs(a);
}

static double tool_rel(const tool_err_acc *e) { return e->ref > 0 ? e->diff / e->ref : e->diff; }

void tool_compare(const tool_group *sh, const tool_group *rep, const tool_shape *s, tool_errors *e) {
  const int64_t len = s->p + s->r, qw = s->hq * s->d, kw = s->hkv * s->d;
  tool_err_acc o = {0, 0}, lse = {0, 0}, dq = {0, 0}, dk = {0, 0}, dv = {0, 0};
  for (int64_t row = 0; row < sh->rows; row++) {
    /* the replicated rows holding this packed row */
    int64_t first = row < s->p ? row : ((row - s->p) / s->r) * len + s->p + (row - s->p) % s->r;
    int64_t copies = row < s->p ? s->n : 1;
    for (int64_t c = 0; c < qw; c++) {
      double sum_dq = 0;
      for (int64_t i = 0; i < copies; i++) sum_dq += tool_from(rep->dq, s->dtype, (first + i * len) * qw + c);
      tool_acc(&o, tool_from(sh->o, s->dtype, row * qw + c), tool_from(rep->o, s->dtype, first * qw + c));
      tool_acc(&dq, tool_from(sh->dq, s->dtype, row * qw + c), sum_dq);
    }
    for (int64_t h = 0; h < s->hq; h++) tool_acc(&lse, sh->lse[row * s->hq + h], rep->lse[first * s->hq + h]);
    for (int64_t c = 0; c < kw; c++) {
      double sk = 0, sv = 0;
      for (int64_t i = 0; i < copies; i++) {
        sk += tool_from(rep->dk, s->dtype, (first + i * len) * kw + c);
        sv += tool_from(rep->dv, s->dtype, (first + i * len) * kw + c);
      }
      tool_acc(&dk, tool_from(sh->dk, s->dtype, row * kw + c), sk);
      tool_acc(&dv, tool_from(sh->dv, s->dtype, row * kw + c), sv);
    }
  }
  e->o = tool_rel(&o);
  e->lse = lse.diff;
  e->dq = tool_rel(&dq);
  e->dk = tool_rel(&dk);
  e->dv = tool_rel(&dv);
}

double tool_errors_max(const tool_errors *e) {
  double m = e->o;
  const double x[3] = {e->dq, e->dk, e->dv};
  for (int i = 0; i < 3; i++) m = x[i] > m || x[i] != x[i] ? x[i] : m;
  return m;
}

static double tool_pairs_causal(double n) { return n * (n + 1) / 2; }

double tool_flops_shared(const tool_shape *s) {
  double pairs = s->mask == FORKATTN_MASK_CAUSAL
                     ? tool_pairs_causal((double)s->p) + (double)s->n * ((double)s->r * s->p + tool_pairs_causal((double)s->r))
                     : (double)s->p * s->p + (double)s->n * ((double)s->r * s->p + (double)s->r * s->r);
  return 4.0 * s->d * s->hq * pairs;
}

double tool_flops_replicated(const tool_shape *s) {
  double len = (double)(s->p + s->r);
  double pairs = s->mask == FORKATTN_MASK_CAUSAL
                     ? s->n * tool_pairs_causal(len)
                     : s->n * ((double)s->p * s->p + (double)s->r * len);
  return 4.0 * s->d * s->hq * pairs;
}

double tool_tensor_bytes(const tool_shape *s, int64_t rows) {
  double es = (double)tool_dtype_size(s->dtype);
  return (double)rows * (es * (4.0 * s->hq * s->d + 4.0 * s->hkv * s->d) + 4.0 * s->hq);
}
