/* The synthetic weights of dlm_model.h, and the logits (the forward: dlm_forward.c). */
#include "dlm_model.h"

#include <cblas.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* elements below which a loop stays serial: a parallel region costs more */
#define DLM_PAR_MIN ((int64_t)1 << 16)

forkattn_status dlm_fail(char *err, size_t errlen, forkattn_status s, const char *fmt, ...) {
  if (err && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return s;
}

dlm_config dlm_config_default(void) {
  dlm_config c = {.layers = 8, .width = 512, .heads = 8, .vocab = 4096, .max_pos = 8192, .seed = 20261130};
  /* tuned on the calibration: b(0.2) = 1, b(0.5) = 5, b(0.8) = 8 at width 512 */
  c.qk_gain = 1.5f;
  c.res_gain = 1.0f;
  return c;
}

/* ---- synthetic weights ------------------------------------------------------ */

static uint64_t dlm_mix(uint64_t z) { /* splitmix64 finalizer */
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* x[i] = base + amp * u, u uniform in [-1, 1) from hash(seed, id, i):
 * the same weights for any thread count. */
static void dlm_fill(float *x, int64_t n, uint64_t seed, uint64_t id, float amp, float base) {
  const uint64_t s = dlm_mix(seed ^ dlm_mix(id));
#pragma omp parallel for schedule(static) if (n > DLM_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const double u = (double)(dlm_mix(s + (uint64_t)i) >> 11) * 0x1.0p-52 - 1.0;
    x[i] = base + amp * (float)u;
  }
}

forkattn_status dlm_model_init(dlm_model *m, const dlm_config *c, char *err, size_t errlen) {
  memset(m, 0, sizeof *m);
  if (!c) return dlm_fail(err, errlen, FORKATTN_ERR_INVALID_ARGUMENT, "dlm: config is NULL");
  if (c->layers < 1 || c->layers > DLM_MAX_LAYERS)
    return dlm_fail(err, errlen, FORKATTN_ERR_INVALID_ARGUMENT, "dlm: layers %lld not in 1..%d", (long long)c->layers,
                    DLM_MAX_LAYERS);
  if (c->heads < 1 || c->width < 1 || c->width % c->heads || c->width / c->heads > 256 || c->width > (1 << 16))
    return dlm_fail(err, errlen, FORKATTN_ERR_INVALID_ARGUMENT,
                    "dlm: width %lld must be heads (%lld) x head_dim with head_dim 1..256 (width <= 65536)",
                    (long long)c->width, (long long)c->heads);
  if (!(c->qk_gain > 0 && c->qk_gain < 100) || !(c->res_gain >= 0 && c->res_gain < 100))
    return dlm_fail(err, errlen, FORKATTN_ERR_INVALID_ARGUMENT, "dlm: gains must be finite, qk > 0, res >= 0");
  if (c->vocab < 2 || c->vocab > (1 << 24) || c->max_pos < 1 || c->max_pos > (1 << 24))
    return dlm_fail(err, errlen, FORKATTN_ERR_INVALID_ARGUMENT, "dlm: vocab %lld or max_pos %lld out of range",
                    (long long)c->vocab, (long long)c->max_pos);
  m->c = *c;
  const int64_t W = c->width, L = c->layers;
  m->d = W / c->heads;
  m->mlp = 4 * W;
  m->embed = malloc(sizeof(float) * (size_t)(c->vocab * W));
  m->pos = malloc(sizeof(float) * (size_t)(c->max_pos * W));
  m->wout = malloc(sizeof(float) * (size_t)(W * c->vocab));
  m->gf = malloc(sizeof(float) * (size_t)W);
  int ok = m->embed && m->pos && m->wout && m->gf;
  for (int64_t l = 0; l < L && ok; l++) {
    m->wqkv[l] = malloc(sizeof(float) * (size_t)(W * 3 * W));
    m->wo[l] = malloc(sizeof(float) * (size_t)(W * W));
    m->w1[l] = malloc(sizeof(float) * (size_t)(W * m->mlp));
    m->w2[l] = malloc(sizeof(float) * (size_t)(m->mlp * W));
    m->g1[l] = malloc(sizeof(float) * (size_t)W);
    m->g2[l] = malloc(sizeof(float) * (size_t)W);
    ok = m->wqkv[l] && m->wo[l] && m->w1[l] && m->w2[l] && m->g1[l] && m->g2[l];
  }
  if (!ok) {
    dlm_model_free(m);
    return dlm_fail(err, errlen, FORKATTN_ERR_OUT_OF_MEMORY, "dlm: out of memory for the weights");
  }
  const uint64_t s = c->seed;
  const float fw = sqrtf(3.0f / (float)W), fm = sqrtf(3.0f / (float)m->mlp); /* variance 1/fan_in */
  dlm_fill(m->embed, c->vocab * W, s, 1, sqrtf(3.0f), 0);
  dlm_fill(m->gf, W, s, 2, 0.1f, 1);
  dlm_fill(m->wout, W * c->vocab, s, 3, fw, 0);
  for (int64_t l = 0; l < L; l++) {
    const uint64_t id = 16 + 8 * (uint64_t)l;
    dlm_fill(m->wqkv[l], W * 3 * W, s, id, fw, 0);
    for (int64_t r = 0; r < W; r++) /* Q and K columns scaled by the QK gain, V plain */
      for (int64_t j = 0; j < 2 * W; j++) m->wqkv[l][r * 3 * W + j] *= c->qk_gain;
    dlm_fill(m->wo[l], W * W, s, id + 1, fw * c->res_gain, 0);
    dlm_fill(m->w1[l], W * m->mlp, s, id + 2, fw, 0);
    dlm_fill(m->w2[l], m->mlp * W, s, id + 3, fm * c->res_gain, 0);
    dlm_fill(m->g1[l], W, s, id + 4, 0.1f, 1);
    dlm_fill(m->g2[l], W, s, id + 5, 0.1f, 1);
  }
  /* additive sinusoidal positions: without them bidirectional attention is blind to order */
#pragma omp parallel for schedule(static) if (c->max_pos * W > DLM_PAR_MIN)
  for (int64_t p = 0; p < c->max_pos; p++)
    for (int64_t j = 0; j < W; j += 2) {
      const double f = pow(10000.0, -(double)j / (double)W);
      m->pos[p * W + j] = (float)sin((double)p * f);
      if (j + 1 < W) m->pos[p * W + j + 1] = (float)cos((double)p * f);
    }
  return FORKATTN_OK;
}

void dlm_model_free(dlm_model *m) {
  if (!m) return;
  free(m->embed);
  free(m->pos);
  free(m->wout);
  free(m->gf);
  for (int l = 0; l < DLM_MAX_LAYERS; l++) {
    free(m->wqkv[l]);
    free(m->wo[l]);
    free(m->w1[l]);
    free(m->w2[l]);
    free(m->g1[l]);
    free(m->g2[l]);
  }
  memset(m, 0, sizeof *m);
}

double dlm_model_bytes(const dlm_model *m) {
  const double W = (double)m->c.width;
  return 4.0 * (2 * (double)m->c.vocab * W + (double)m->c.layers * (4 * W * W + 2 * W * (double)m->mlp + 2 * W) + W);
}

/* ---- logits ------------------------------------------------------------------------ */

void dlm_logits(const dlm_model *m, const float *hidden, int64_t rows, float *logits) {
  if (rows <= 0) return;
  const int64_t W = m->c.width, V = m->c.vocab;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)V, (int)W, 1.0f, hidden, (int)W, m->wout,
              (int)V, 0.0f, logits, (int)V);
}
