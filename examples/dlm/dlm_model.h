/* A small bidirectional transformer (diffusion-LM shaped) for the BiCache
 * demo, benchmark and tests. Its weights are SYNTHETIC: deterministic hashes
 * of (seed, tensor, index), no training, no checkpoint. Forward only:
 *   embed(token) + sinusoidal position -> L x [RMSNorm, QKV (sgemm),
 *   attention (forkattn), out-proj, residual, RMSNorm, MLP 4x (GELU),
 *   residual] -> RMSNorm -> final hidden; logits = hidden x W_out (untied, so
 *   top-1 is not just the input token carried by the residual stream).
 * No RoPE (positions are additive), no GQA (kv heads = heads).
 *
 * A batch is n requests sharing their first `prefix` tokens. With reuse depth
 * b_i, request i's layers < b_i compute only its own rows, attending to
 * [prefix K/V computed alone ; own K/V] (forkattn_prefix_cached_fwd, one call
 * for all such requests of the batch); its layers >= b_i recompute every row
 * of [prefix ; own] with full bidirectional attention (one varlen
 * forkattn_prefix_fwd with no prompt for all such requests), the prefix rows
 * re-entering with their hidden state computed alone at layer b_i (held by
 * the caller next to the cached K/V; docs/dlm-cache.md). b = 0 for every
 * request is the uncached reference. */
#ifndef FORKATTN_TOOLS_DLM_MODEL_H
#define FORKATTN_TOOLS_DLM_MODEL_H
#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

#define DLM_MAX_LAYERS 64

typedef struct dlm_config {
  int64_t layers;  /* 1..DLM_MAX_LAYERS */
  int64_t width;   /* heads * head_dim */
  int64_t heads;   /* head_dim = width / heads, 1..256 */
  int64_t vocab;   /* token ids 0..vocab-1 (embedding and logits) */
  int64_t max_pos; /* positions 0..max_pos-1 */
  uint64_t seed;   /* of the synthetic weights */
  float qk_gain;   /* scale of the Q/K projections: attention sharpness */
  float res_gain;  /* scale of the residual branches' output projections */
  /* test-only: prefix rows never see the request (per request, the prefix
   * attends to itself only), so a prefix's K/V and hidden states do not
   * depend on what follows: reuse is then exact up to float rounding. */
  int prefix_blind;
} dlm_config;

/* Defaults: 8 layers, width 512, 8 heads of 64, vocab 4096, 8192 positions,
 * gains chosen so the prefix's K/V drift grows with depth and shrinks with r. */
dlm_config dlm_config_default(void);

typedef struct dlm_model {
  dlm_config c;
  int64_t d, mlp;
  float *embed;  /* [vocab, width] */
  float *wout;   /* [width, vocab] */
  float *pos;    /* [max_pos, width] sinusoidal */
  float *wqkv[DLM_MAX_LAYERS], *wo[DLM_MAX_LAYERS], *w1[DLM_MAX_LAYERS], *w2[DLM_MAX_LAYERS];
  float *g1[DLM_MAX_LAYERS], *g2[DLM_MAX_LAYERS], *gf; /* RMSNorm gains */
} dlm_model;

/* Generate the synthetic weights. FORKATTN_OK, INVALID_ARGUMENT (bad config)
 * or OUT_OF_MEMORY; the message goes to err. */
/* Write a message into err (when given) and return s: the error path every dlm_* call shares. */
forkattn_status dlm_fail(char *err, size_t errlen, forkattn_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

forkattn_status dlm_model_init(dlm_model *m, const dlm_config *c, char *err, size_t errlen);
void dlm_model_free(dlm_model *m);
/* Weight bytes (float32). */
double dlm_model_bytes(const dlm_model *m);

/* n requests, their full token sequences packed: request i is
 * tokens[off[i], off[i+1]), and the first `prefix` tokens of each are the
 * shared prefix (the forward checks they are equal when it reuses it).
 * Own rows: request i's positions prefix..len-1; R = off[n] - n * prefix. */
typedef struct dlm_batch {
  int64_t n;
  const int64_t *off; /* n+1 entries, off[0] = 0 */
  const int32_t *tokens;
  int64_t prefix;
} dlm_batch;

/* A prefix computed alone (one sequence, nothing after it), per layer:
 * K/V [len, heads, d] f32 host (e.g. a forkattn_kv_cache entry's views) and
 * the hidden state entering the layer [len, width] (NULL where not needed:
 * only hidden[b] is read, when 0 < b < layers). */
typedef struct dlm_prefix {
  int64_t len;
  forkattn_tensor k[DLM_MAX_LAYERS], v[DLM_MAX_LAYERS];
  const float *hidden[DLM_MAX_LAYERS];
} dlm_prefix;

/* Copies of rows [0, rows) of request 0's full sequence, taken in the layers
 * that compute it fully (l >= b_0): K, V and the hidden state entering layer
 * l, each [rows, width] (NULL: not taken). Builds a prefix alone; calibrates. */
typedef struct dlm_record {
  int64_t rows;
  float *k[DLM_MAX_LAYERS], *v[DLM_MAX_LAYERS], *hidden[DLM_MAX_LAYERS];
} dlm_record;

/* Deep-layer refresh (denoising steps): per request, its prefix rows' K/V
 * as computed inside its full input at its layers >= b_i, [n * prefix, width]
 * per layer (request i at rows i * prefix). reuse = 0: the forward fills
 * them; reuse = 1: layers >= b_i compute only own rows, against them (stale
 * by the steps since the fill). Buffers needed for layers >= min b_i. */
typedef struct dlm_deep {
  int reuse;
  float *k[DLM_MAX_LAYERS], *v[DLM_MAX_LAYERS];
} dlm_deep;

typedef struct dlm_run {
  const dlm_batch *batch;
  int64_t depth;            /* b in 0..layers for every request (0: the uncached reference) */
  const int64_t *depths;    /* optional: b_i per request, non-increasing (replaces depth) */
  const dlm_prefix *prefix; /* required when some b_i > 0: len == batch->prefix */
  dlm_deep *deep;           /* optional */
  dlm_record *record;       /* optional */
  float *hidden;            /* optional out [R, width]: final normed hidden of own rows */
} dlm_run;

/* One forward. FORKATTN_OK, or an error with its message in err (bad run
 * description, or the library's message when a call fails). */
forkattn_status dlm_forward(forkattn_ctx *ctx, const dlm_model *m, const dlm_run *run, char *err, size_t errlen);

/* logits [rows, vocab] = hidden [rows, width] x W_out. */
void dlm_logits(const dlm_model *m, const float *hidden, int64_t rows, float *logits);
#endif
