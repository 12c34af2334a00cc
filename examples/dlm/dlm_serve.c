/* Workload, calibration and the serving loop of dlm_serve.h. */
#include "dlm_serve.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t dlm_hash(uint64_t a, uint64_t b, uint64_t c) { /* splitmix64 of a mix */
  uint64_t z = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull ^ c;
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Token ids 0..vocab-2; vocab-1 is the mask id. */
static int32_t dlm_token(uint64_t h, int64_t vocab) { return (int32_t)(h % (uint64_t)(vocab - 1)); }

/* ---- workload ------------------------------------------------------------------ */

void dlm_workload_free(dlm_workload *w) {
  for (int64_t p = 0; w->prompt && p < w->nprompts; p++) free(w->prompt[p]);
  free(w->prompt);
  free(w->prompt_len);
  free(w->req_prompt);
  free(w->req_own);
  free(w->ratio);
  memset(w, 0, sizeof *w);
}

int dlm_workload_make(dlm_workload *w, const dlm_workload_opts *o, const dlm_model *m, char *err, size_t errlen) {
  memset(w, 0, sizeof *w);
  if (o->prompts < 1 || o->requests < 1 || o->prompt_min < 1 || o->prompt_max < o->prompt_min || o->own_min < 1 ||
      o->own_max < o->own_min || !(o->ratio_min > 0) || !(o->ratio_max < 1) || o->ratio_max < o->ratio_min) {
    snprintf(err, errlen, "dlm: bad workload (prompts, requests, lengths >= 1, min <= max, 0 < ratio < 1)");
    return -1;
  }
  if (o->prompt_max + o->own_max > m->c.max_pos) {
    snprintf(err, errlen, "dlm: prompt %lld + own %lld tokens exceed the model's %lld positions",
             (long long)o->prompt_max, (long long)o->own_max, (long long)m->c.max_pos);
    return -1;
  }
  w->nprompts = o->prompts, w->nreq = o->requests, w->vocab = m->c.vocab, w->seed = o->seed;
  w->prompt = calloc((size_t)o->prompts, sizeof *w->prompt);
  w->prompt_len = calloc((size_t)o->prompts, sizeof *w->prompt_len);
  w->req_prompt = calloc((size_t)o->requests, sizeof *w->req_prompt);
  w->req_own = calloc((size_t)o->requests, sizeof *w->req_own);
  w->ratio = calloc((size_t)o->requests, sizeof *w->ratio);
  int ok = w->prompt && w->prompt_len && w->req_prompt && w->req_own && w->ratio;
  for (int64_t p = 0; ok && p < o->prompts; p++) {
    const int64_t len = o->prompts == 1 ? o->prompt_min
                                        : o->prompt_min + (o->prompt_max - o->prompt_min) * p / (o->prompts - 1);
    w->prompt_len[p] = len;
    ok = (w->prompt[p] = malloc(sizeof(int32_t) * (size_t)len)) != NULL;
    for (int64_t j = 0; ok && j < len; j++) w->prompt[p][j] = dlm_token(dlm_hash(o->seed, 1000 + (uint64_t)p, (uint64_t)j), w->vocab);
  }
  if (!ok) {
    dlm_workload_free(w);
    snprintf(err, errlen, "dlm: out of memory for the workload");
    return -1;
  }
  for (int64_t i = 0; i < o->requests; i++) {
    const int64_t p = (int64_t)(dlm_hash(o->seed, 2, (uint64_t)i) % (uint64_t)o->prompts);
    const double u = (double)(dlm_hash(o->seed, 3, (uint64_t)i) >> 11) * 0x1.0p-53;
    const double r = o->ratio_min + (o->ratio_max - o->ratio_min) * u, P = (double)w->prompt_len[p];
    int64_t own = (int64_t)llround(P * (1 - r) / r);
    own = own < o->own_min ? o->own_min : own > o->own_max ? o->own_max : own;
    w->req_prompt[i] = p;
    w->req_own[i] = own;
    w->ratio[i] = P / (P + (double)own);
  }
  return 0;
}

void dlm_workload_tokens(const dlm_workload *w, int64_t i, int64_t step, int64_t steps, int32_t *dst) {
  const int64_t p = w->req_prompt[i], P = w->prompt_len[p];
  memcpy(dst, w->prompt[p], sizeof(int32_t) * (size_t)P);
  for (int64_t j = 0; j < w->req_own[i]; j++) {
    const uint64_t h = dlm_hash(w->seed, 4 + (uint64_t)i * 7919, (uint64_t)j);
    const int64_t reveal = (int64_t)((h >> 40) % (uint64_t)steps);
    dst[P + j] = step >= reveal ? dlm_token(h, w->vocab) : (int32_t)(w->vocab - 1);
  }
}

/* ---- calibration ------------------------------------------------------------------ */

forkattn_status dlm_calibrate(forkattn_ctx *ctx, const dlm_model *m, int64_t seq, const double *ratios,
                              int64_t nratios, uint64_t seed, forkattn_reuse_profile *profile, dlm_calib *out,
                              char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  if (nratios < 1 || nratios > DLM_CALIB_MAX || seq < 2 || seq > m->c.max_pos) {
    snprintf(err, errlen, "dlm: calibration needs 1..%d ratios and 2..%lld tokens", DLM_CALIB_MAX,
             (long long)m->c.max_pos);
    return FORKATTN_ERR_INVALID_ARGUMENT;
  }
  const int64_t L = m->c.layers, W = m->c.width;
  int32_t *tok = malloc(sizeof(int32_t) * (size_t)seq);
  float *kv = malloc(sizeof(float) * (size_t)(2 * L * seq * W));
  if (!tok || !kv) {
    free(tok);
    free(kv);
    snprintf(err, errlen, "dlm: out of memory for calibration");
    return FORKATTN_ERR_OUT_OF_MEMORY;
  }
  const double t0 = omp_get_wtime();
  forkattn_status s = FORKATTN_OK;
  for (int64_t c = 0; c < nratios && !s; c++) {
    int64_t P = (int64_t)llround(ratios[c] * (double)seq);
    P = P < 1 ? 1 : P > seq - 1 ? seq - 1 : P;
    for (int64_t j = 0; j < seq; j++) tok[j] = dlm_token(dlm_hash(seed, 5000 + (uint64_t)c, (uint64_t)j), m->c.vocab);
    dlm_alone a;
    if ((s = dlm_alone_compute(ctx, m, tok, P, &a, err, errlen))) break;
    dlm_record rec = {.rows = P};
    for (int64_t l = 0; l < L; l++) {
      rec.k[l] = kv + l * P * W;
      rec.v[l] = kv + (L + l) * P * W;
    }
    const int64_t off[2] = {0, seq};
    const dlm_batch b = {1, off, tok, P};
    const dlm_run run = {.batch = &b, .record = &rec};
    if (!(s = dlm_forward(ctx, m, &run, err, errlen))) {
      out->ratio[c] = (double)P / (double)seq;
      for (int64_t l = 0; l < L && !s; l++) {
        const int64_t per = P * W;
        float sk[256], sv[256], mk = 0, mv = 0;
        const forkattn_tensor ka = forkattn_tensor_contiguous(a.k + l * per, FORKATTN_DTYPE_F32, P, m->c.heads, m->d),
                              kb = forkattn_tensor_contiguous(rec.k[l], FORKATTN_DTYPE_F32, P, m->c.heads, m->d),
                              va = forkattn_tensor_contiguous(a.v + l * per, FORKATTN_DTYPE_F32, P, m->c.heads, m->d),
                              vb = forkattn_tensor_contiguous(rec.v[l], FORKATTN_DTYPE_F32, P, m->c.heads, m->d);
        float *skp = m->c.heads <= 256 ? sk : NULL, *svp = m->c.heads <= 256 ? sv : NULL;
        if (!skp) {
          snprintf(err, errlen, "dlm: calibration supports up to 256 heads");
          s = FORKATTN_ERR_INVALID_ARGUMENT;
          break;
        }
        s = forkattn_kv_similarity(ctx, &ka, &kb, skp, &mk, FORKATTN_MEMORY_HOST);
        if (!s) s = forkattn_kv_similarity(ctx, &va, &vb, svp, &mv, FORKATTN_MEMORY_HOST);
        if (s)
          snprintf(err, errlen, "dlm: forkattn_kv_similarity failed (%s): %s", forkattn_status_string(s),
                   forkattn_ctx_last_error(ctx));
        out->sim[c][l] = mk < mv ? mk : mv; /* a reused layer needs both K and V close */
      }
      if (!s) {
        s = forkattn_reuse_profile_add(ctx, profile, out->ratio[c], out->sim[c]);
        if (s)
          snprintf(err, errlen, "dlm: forkattn_reuse_profile_add failed (%s): %s", forkattn_status_string(s),
                   forkattn_ctx_last_error(ctx));
      }
      out->samples = c + 1;
    }
    dlm_alone_free(&a);
  }
  out->seconds = omp_get_wtime() - t0;
  free(tok);
  free(kv);
  return s;
}

/* ---- serving -------------------------------------------------------------------------- */

/* Drift of the cached outputs against the reference, accumulated per own row. */
static void dlm_drift(const dlm_model *m, const float *hu, const float *hc, int64_t rows, float *lu, float *lc,
                      int64_t chunk, dlm_serve_result *r, double *hid_sum, double *logit_sum) {
  const int64_t W = m->c.width, V = m->c.vocab;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
    dlm_logits(m, hu + r0 * W, n, lu);
    dlm_logits(m, hc + r0 * W, n, lc);
    for (int64_t i = 0; i < n; i++) {
      const float *a = hu + (r0 + i) * W, *b = hc + (r0 + i) * W, *la = lu + i * V, *lb = lc + i * V;
      double num = 0, den = 0, lnum = 0, lden = 0;
      for (int64_t j = 0; j < W; j++) num += ((double)b[j] - a[j]) * ((double)b[j] - a[j]), den += (double)a[j] * a[j];
      int64_t ta = 0, tb = 0;
      for (int64_t j = 0; j < V; j++) {
        lnum += ((double)lb[j] - la[j]) * ((double)lb[j] - la[j]), lden += (double)la[j] * la[j];
        if (la[j] > la[ta]) ta = j;
        if (lb[j] > lb[tb]) tb = j;
      }
      const double e = sqrt(num / (den > 0 ? den : 1)), le = sqrt(lnum / (lden > 0 ? lden : 1));
      r->hid_max = e > r->hid_max ? e : r->hid_max;
      r->logit_max = le > r->logit_max ? le : r->logit_max;
      *hid_sum += e;
      *logit_sum += le;
      r->top1_agree += ta == tb;
      r->rows++;
    }
  }
}

typedef struct dlm_group {
  int64_t n, prompt, P, T, R;
  int64_t *idx, *off, *depth; /* requests (by depth, deepest first), token offsets, depths */
  int32_t *tok;
  float *hu, *hc, *deep;
  dlm_held *held;
} dlm_group;

static void dlm_group_free(dlm_group *g) {
  free(g->idx);
  free(g->off);
  free(g->depth);
  free(g->tok);
  free(g->hu);
  free(g->hc);
  free(g->deep);
  free(g->held);
  memset(g, 0, sizeof *g);
}

/* b(r) of one request: the profile's, or the fixed depth. */
static forkattn_status dlm_depth_of(forkattn_ctx *ctx, const dlm_model *m, const forkattn_reuse_profile *profile,
                                    const dlm_serve_opts *o, double ratio, int64_t *b, char *err, size_t errlen) {
  if (o->fixed_depth >= 0) {
    *b = o->fixed_depth < m->c.layers ? o->fixed_depth : m->c.layers;
    return FORKATTN_OK;
  }
  const forkattn_status s = forkattn_reuse_profile_depth(ctx, profile, ratio, b);
  if (s)
    snprintf(err, errlen, "dlm: forkattn_reuse_profile_depth failed (%s): %s", forkattn_status_string(s),
             forkattn_ctx_last_error(ctx));
  return s;
}

/* The window's requests with the prompt of its first unserved one, sorted by
 * depth (deepest first: one cached-attention call serves all that still
 * reuse a layer), packed into g. */
static forkattn_status dlm_group_make(forkattn_ctx *ctx, const dlm_model *m, dlm_group *g, const dlm_workload *w,
                                      int64_t lo, int64_t hi, unsigned char *done,
                                      const forkattn_reuse_profile *profile, const dlm_serve_opts *o, char *err,
                                      size_t errlen) {
  memset(g, 0, sizeof *g);
  const int64_t W = m->c.width, L = m->c.layers, cap = hi - lo;
  int64_t first = lo;
  while (done[first - lo]) first++;
  g->prompt = w->req_prompt[first];
  g->P = w->prompt_len[g->prompt];
  g->idx = malloc(sizeof(int64_t) * (size_t)cap);
  g->off = malloc(sizeof(int64_t) * (size_t)(cap + 1));
  g->depth = malloc(sizeof(int64_t) * (size_t)cap);
  if (!g->idx || !g->off || !g->depth) goto oom;
  for (int64_t i = first; i < hi; i++)
    if (!done[i - lo] && w->req_prompt[i] == g->prompt) {
      done[i - lo] = 1;
      int64_t b = 0;
      const forkattn_status s = dlm_depth_of(ctx, m, profile, o, w->ratio[i], &b, err, errlen);
      if (s) return s;
      int64_t k = g->n++; /* insertion sort, stable, deepest first */
      for (; k > 0 && g->depth[k - 1] < b; k--) g->idx[k] = g->idx[k - 1], g->depth[k] = g->depth[k - 1];
      g->idx[k] = i;
      g->depth[k] = b;
    }
  g->off[0] = 0;
  for (int64_t j = 0; j < g->n; j++) {
    g->off[j + 1] = g->off[j] + g->P + w->req_own[g->idx[j]];
    g->R += w->req_own[g->idx[j]];
  }
  g->T = g->off[g->n];
  g->tok = malloc(sizeof(int32_t) * (size_t)g->T);
  g->held = calloc((size_t)g->n, sizeof *g->held);
  if (o->compare) g->hu = malloc(sizeof(float) * (size_t)(g->R * W));
  g->hc = malloc(sizeof(float) * (size_t)(g->R * W));
  if (o->refresh > 0) g->deep = malloc(sizeof(float) * (size_t)(2 * L * g->n * g->P * W));
  if (g->tok && g->held && (!o->compare || g->hu) && g->hc && (o->refresh <= 0 || g->deep)) return FORKATTN_OK;
oom:
  snprintf(err, errlen, "dlm: out of memory for a batch");
  return FORKATTN_ERR_OUT_OF_MEMORY;
}

/* The cached path's setup of a group: one lookup per request (a miss
 * computes the prompt alone and inserts it, so the group's later requests
 * hit) and the prefix to reuse. Timed by the caller. */
static forkattn_status dlm_group_prefix(forkattn_ctx *ctx, const dlm_model *m, dlm_store *st, dlm_group *g,
                                        dlm_alone *alone, dlm_prefix *pre, dlm_serve_result *r, char *err,
                                        size_t errlen) {
  const dlm_prefix *use = NULL;
  for (int64_t j = 0; j < g->n; j++) {
    const int32_t *t = g->tok + g->off[j];
    forkattn_status s = dlm_store_lookup(st, ctx, t, g->off[j + 1] - g->off[j], &g->held[j], err, errlen);
    if (s) return s;
    if (g->held[j].entry && g->held[j].len != g->P) dlm_store_release(st, &g->held[j]); /* another prefix: no use */
    if (!use && g->held[j].entry) use = &g->held[j].prefix;
    if (!use && !alone->len) {
      const double t0 = omp_get_wtime();
      if ((s = dlm_alone_compute(ctx, m, g->tok, g->P, alone, err, errlen))) return s;
      int stored = 0;
      if ((s = dlm_store_insert(st, ctx, g->tok, alone, &stored, err, errlen))) return s;
      r->sec_alone += omp_get_wtime() - t0;
      dlm_alone_prefix(m, alone, pre);
      use = pre;
    }
  }
  if (use != pre) *pre = *use;
  return FORKATTN_OK;
}

/* One group: every denoising step uncached (if compared) then cached. */
static forkattn_status dlm_group_serve(forkattn_ctx *ctx, const dlm_model *m, dlm_store *st, dlm_group *g,
                                       const dlm_workload *w, const dlm_serve_opts *o, dlm_serve_result *r,
                                       float *lu, float *lc, int64_t chunk, double *hid_sum, double *logit_sum,
                                       char *err, size_t errlen) {
  const int64_t L = m->c.layers, W = m->c.width;
  for (int64_t j = 0; j < g->n; j++) dlm_workload_tokens(w, g->idx[j], 0, o->steps, g->tok + g->off[j]);
  dlm_alone alone = {0};
  dlm_prefix pre;
  double t0 = omp_get_wtime();
  forkattn_status s = dlm_group_prefix(ctx, m, st, g, &alone, &pre, r, err, errlen);
  r->sec_cached += omp_get_wtime() - t0;
  dlm_deep deep = {0};
  for (int64_t l = 0; l < L && g->deep; l++) {
    deep.k[l] = g->deep + (2 * l) * g->n * g->P * W;
    deep.v[l] = g->deep + (2 * l + 1) * g->n * g->P * W;
  }
  const dlm_batch b = {g->n, g->off, g->tok, g->P};
  for (int64_t step = 0; step < o->steps && !s; step++) {
    for (int64_t j = 0; j < g->n && step; j++) dlm_workload_tokens(w, g->idx[j], step, o->steps, g->tok + g->off[j]);
    if (o->compare) {
      const dlm_run ru = {.batch = &b, .hidden = g->hu};
      t0 = omp_get_wtime();
      s = dlm_forward(ctx, m, &ru, err, errlen);
      r->sec_uncached += omp_get_wtime() - t0;
      if (s) break;
    }
    deep.reuse = o->refresh > 0 && step % o->refresh != 0;
    const dlm_run rc = {.batch = &b, .depths = g->depth, .prefix = &pre,
                        .deep = g->deep && g->depth[g->n - 1] < L ? &deep : NULL, .hidden = g->hc};
    t0 = omp_get_wtime();
    s = dlm_forward(ctx, m, &rc, err, errlen);
    r->sec_cached += omp_get_wtime() - t0;
    if (!s && o->compare) dlm_drift(m, g->hu, g->hc, g->R, lu, lc, chunk, r, hid_sum, logit_sum);
    r->tokens += g->T;
    r->own_tokens += g->R;
  }
  r->requests += g->n;
  for (int64_t j = 0; j < g->n; j++) {
    r->depth_used[g->depth[j]]++;
    dlm_store_release(st, &g->held[j]);
  }
  dlm_alone_free(&alone);
  return s;
}

forkattn_status dlm_serve(forkattn_ctx *ctx, const dlm_model *m, const dlm_workload *w,
                          const forkattn_reuse_profile *profile, const dlm_serve_opts *o, dlm_serve_result *r,
                          char *err, size_t errlen) {
  memset(r, 0, sizeof *r);
  if (o->batch < 1 || o->steps < 1 || o->refresh < 0 || (o->fixed_depth < 0 && !profile)) {
    snprintf(err, errlen, "dlm: serving needs batch >= 1, steps >= 1, refresh >= 0 and a profile or a fixed depth");
    return FORKATTN_ERR_INVALID_ARGUMENT;
  }
  const int64_t chunk = 256;
  dlm_store st;
  forkattn_status s = dlm_store_create(&st, ctx, m, o->cache_bytes, err, errlen);
  if (s) return s;
  unsigned char *done = malloc((size_t)o->batch);
  float *lu = malloc(sizeof(float) * (size_t)(chunk * m->c.vocab)), *lc = malloc(sizeof(float) * (size_t)(chunk * m->c.vocab));
  double hid_sum = 0, logit_sum = 0;
  if (!done || !lu || !lc) {
    snprintf(err, errlen, "dlm: out of memory");
    s = FORKATTN_ERR_OUT_OF_MEMORY;
  }
  const double t0 = omp_get_wtime();
  for (int64_t p = 0; p < w->nprompts && o->warm && !s; p++) { /* steady state: the prompts are cached */
    dlm_alone a;
    int stored = 0;
    s = dlm_alone_compute(ctx, m, w->prompt[p], w->prompt_len[p], &a, err, errlen);
    if (!s) s = dlm_store_insert(&st, ctx, w->prompt[p], &a, &stored, err, errlen);
    dlm_alone_free(&a);
  }
  r->sec_warm = omp_get_wtime() - t0;
  for (int64_t lo = 0; lo < w->nreq && !s; lo += o->batch) {
    const int64_t hi = lo + o->batch < w->nreq ? lo + o->batch : w->nreq;
    memset(done, 0, (size_t)o->batch);
    for (int64_t left = hi - lo; left > 0 && !s;) {
      dlm_group g;
      s = dlm_group_make(ctx, m, &g, w, lo, hi, done, profile, o, err, errlen);
      if (!s) s = dlm_group_serve(ctx, m, &st, &g, w, o, r, lu, lc, chunk, &hid_sum, &logit_sum, err, errlen);
      left -= g.n;
      r->groups++;
      dlm_group_free(&g);
    }
  }
  if (!s) {
    forkattn_kv_cache_get_stats(st.cache, &r->cache);
    r->side_misses = st.side_misses;
    r->side_bytes = dlm_store_side_bytes(&st);
  }
  if (r->rows) {
    r->hid_mean = hid_sum / (double)r->rows;
    r->logit_mean = logit_sum / (double)r->rows;
  }
  free(done);
  free(lu);
  free(lc);
  dlm_store_destroy(&st);
  return s;
}
