/* Prefixes computed alone; the K/V cache plus hidden-state side table. */
#include "dlm_prefix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dlm_side {
  int32_t *tokens;
  int64_t len;
  float *hidden; /* [layers][len, width] */
};

forkattn_status dlm_alone_compute(forkattn_ctx *ctx, const dlm_model *m, const int32_t *tokens, int64_t len,
                                  dlm_alone *a, char *err, size_t errlen) {
  memset(a, 0, sizeof *a);
  if (len < 1) {
    snprintf(err, errlen, "dlm: a prefix needs at least one token");
    return FORKATTN_ERR_INVALID_ARGUMENT;
  }
  const int64_t L = m->c.layers, per = len * m->c.width;
  float *buf = malloc(sizeof(float) * (size_t)(3 * L * per));
  if (!buf) {
    snprintf(err, errlen, "dlm: out of memory for a %lld-token prefix", (long long)len);
    return FORKATTN_ERR_OUT_OF_MEMORY;
  }
  dlm_record rec = {.rows = len};
  for (int64_t l = 0; l < L; l++) {
    rec.k[l] = buf + l * per;
    rec.v[l] = buf + (L + l) * per;
    rec.hidden[l] = buf + (2 * L + l) * per;
  }
  const int64_t off[2] = {0, len};
  const dlm_batch b = {1, off, tokens, 0};
  const dlm_run run = {.batch = &b, .record = &rec};
  const forkattn_status s = dlm_forward(ctx, m, &run, err, errlen);
  if (s) {
    free(buf);
    return s;
  }
  *a = (dlm_alone){len, buf, buf + L * per, buf + 2 * L * per};
  return FORKATTN_OK;
}

void dlm_alone_free(dlm_alone *a) {
  free(a->k); /* one allocation */
  memset(a, 0, sizeof *a);
}

void dlm_alone_prefix(const dlm_model *m, const dlm_alone *a, dlm_prefix *p) {
  memset(p, 0, sizeof *p);
  p->len = a->len;
  const int64_t per = a->len * m->c.width;
  for (int64_t l = 0; l < m->c.layers; l++) {
    p->k[l] = forkattn_tensor_contiguous(a->k + l * per, FORKATTN_DTYPE_F32, a->len, m->c.heads, m->d);
    p->v[l] = forkattn_tensor_contiguous(a->v + l * per, FORKATTN_DTYPE_F32, a->len, m->c.heads, m->d);
    p->hidden[l] = a->hidden + l * per;
  }
}

forkattn_status dlm_store_create(dlm_store *s, forkattn_ctx *ctx, const dlm_model *m, size_t capacity_bytes,
                                 char *err, size_t errlen) {
  memset(s, 0, sizeof *s);
  s->layers = m->c.layers;
  s->width = m->c.width;
  s->heads = m->c.heads;
  s->cap_side = 64;
  s->side = calloc((size_t)s->cap_side, sizeof *s->side);
  if (!s->side) {
    snprintf(err, errlen, "dlm: out of memory for the side table");
    return FORKATTN_ERR_OUT_OF_MEMORY;
  }
  forkattn_kv_cache_options o;
  forkattn_kv_cache_options_init(&o);
  o.capacity_bytes = capacity_bytes;
  o.layers = m->c.layers;
  o.kv_heads = m->c.heads;
  o.head_dim = m->d;
  const forkattn_status st = forkattn_kv_cache_create(ctx, &o, &s->cache);
  if (st) {
    snprintf(err, errlen, "dlm: forkattn_kv_cache_create failed (%s): %s", forkattn_status_string(st),
             forkattn_ctx_last_error(ctx));
    free(s->side);
    s->side = NULL;
  }
  return st;
}

static void dlm_side_clear(dlm_side *e) {
  free(e->tokens);
  free(e->hidden);
  memset(e, 0, sizeof *e);
}

void dlm_store_destroy(dlm_store *s) {
  forkattn_kv_cache_destroy(s->cache);
  for (int64_t i = 0; i < s->nside; i++) dlm_side_clear(&s->side[i]);
  free(s->side);
  memset(s, 0, sizeof *s);
}

static dlm_side *dlm_side_find(dlm_store *s, const int32_t *tokens, int64_t len) {
  for (int64_t i = 0; i < s->nside; i++)
    if (s->side[i].len == len && !memcmp(s->side[i].tokens, tokens, sizeof(int32_t) * (size_t)len))
      return &s->side[i];
  return NULL;
}

forkattn_status dlm_store_insert(dlm_store *s, forkattn_ctx *ctx, const int32_t *tokens, const dlm_alone *a,
                                 int *stored, char *err, size_t errlen) {
  const int64_t L = s->layers, per = a->len * s->width;
  forkattn_tensor k[DLM_MAX_LAYERS], v[DLM_MAX_LAYERS];
  for (int64_t l = 0; l < L; l++) {
    k[l] = forkattn_tensor_contiguous(a->k + l * per, FORKATTN_DTYPE_F32, a->len, s->heads, s->width / s->heads);
    v[l] = forkattn_tensor_contiguous(a->v + l * per, FORKATTN_DTYPE_F32, a->len, s->heads, s->width / s->heads);
  }
  const forkattn_status st = forkattn_kv_cache_insert(s->cache, tokens, a->len, k, v, FORKATTN_MEMORY_HOST, stored);
  if (st) {
    snprintf(err, errlen, "dlm: forkattn_kv_cache_insert failed (%s): %s", forkattn_status_string(st),
             forkattn_ctx_last_error(ctx));
    return st;
  }
  if (!*stored) return FORKATTN_OK;
  dlm_side *e = dlm_side_find(s, tokens, a->len);
  if (!e) {
    if (s->nside == s->cap_side) { /* drop the oldest: its cache entry is likely gone too */
      dlm_side_clear(&s->side[0]);
      memmove(s->side, s->side + 1, sizeof *s->side * (size_t)(s->nside - 1));
      s->nside--;
    }
    e = &s->side[s->nside];
    memset(e, 0, sizeof *e);
    e->tokens = malloc(sizeof(int32_t) * (size_t)a->len);
    e->hidden = malloc(sizeof(float) * (size_t)(L * per));
    if (!e->tokens || !e->hidden) {
      dlm_side_clear(e);
      snprintf(err, errlen, "dlm: out of memory for the side table");
      return FORKATTN_ERR_OUT_OF_MEMORY;
    }
    memcpy(e->tokens, tokens, sizeof(int32_t) * (size_t)a->len);
    e->len = a->len;
    s->nside++;
  }
  memcpy(e->hidden, a->hidden, sizeof(float) * (size_t)(L * per));
  return FORKATTN_OK;
}

forkattn_status dlm_store_lookup(dlm_store *s, forkattn_ctx *ctx, const int32_t *tokens, int64_t n, dlm_held *h,
                                 char *err, size_t errlen) {
  memset(h, 0, sizeof *h);
  int64_t matched = 0;
  const forkattn_status st = forkattn_kv_cache_lookup(s->cache, tokens, n, &h->entry, &matched);
  if (st) {
    snprintf(err, errlen, "dlm: forkattn_kv_cache_lookup failed (%s): %s", forkattn_status_string(st),
             forkattn_ctx_last_error(ctx));
    return st;
  }
  if (!h->entry) return FORKATTN_OK;
  const dlm_side *e = dlm_side_find(s, tokens, matched);
  if (!e) { /* K/V without hidden states: usable only at depth = layers; serve as a miss */
    s->side_misses++;
    dlm_store_release(s, h);
    return FORKATTN_OK;
  }
  h->len = matched;
  h->prefix.len = matched;
  const int64_t per = matched * s->width;
  for (int64_t l = 0; l < s->layers; l++) {
    forkattn_status vst = forkattn_kv_entry_k(h->entry, l, &h->prefix.k[l]);
    if (!vst) vst = forkattn_kv_entry_v(h->entry, l, &h->prefix.v[l]);
    if (vst) {
      snprintf(err, errlen, "dlm: the cached K/V of layer %lld: %s", (long long)l, forkattn_ctx_last_error(ctx));
      dlm_store_release(s, h);
      return vst;
    }
    h->prefix.hidden[l] = e->hidden + l * per;
  }
  return FORKATTN_OK;
}

void dlm_store_release(dlm_store *s, dlm_held *h) {
  if (h->entry) forkattn_kv_cache_release(s->cache, h->entry);
  memset(h, 0, sizeof *h);
}

double dlm_store_side_bytes(const dlm_store *s) {
  double b = 0;
  for (int64_t i = 0; i < s->nside; i++) b += 4.0 * (double)(s->layers * s->width) * (double)s->side[i].len;
  return b;
}
