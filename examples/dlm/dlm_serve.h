/* BiCache serving on the synthetic model (dlm_model.h): a workload of
 * requests sharing a few prompts, the calibration that builds the reuse-depth
 * profile, and a serving loop that runs every batch uncached (the reference)
 * and cached, timing both and measuring the cached outputs' drift. Used by
 * `forkattn demo dlm` and `forkattn bench dlm`. */
#ifndef FORKATTN_TOOLS_DLM_SERVE_H
#define FORKATTN_TOOLS_DLM_SERVE_H
#include "dlm_prefix.h"
#include "forkattn_experimental.h"

typedef struct dlm_workload_opts {
  int64_t prompts, requests;
  int64_t prompt_min, prompt_max; /* prompt lengths, spread evenly */
  double ratio_min, ratio_max;    /* a request's prefix ratio r = prompt / (prompt + own), uniform */
  int64_t own_min, own_max;       /* own tokens = prompt (1 - r) / r, clamped to these */
  uint64_t seed;
} dlm_workload_opts;

typedef struct dlm_workload {
  int64_t nprompts, nreq, vocab;
  uint64_t seed;
  int64_t *prompt_len;
  int32_t **prompt;
  int64_t *req_prompt, *req_own; /* prompt index and own tokens per request */
  double *ratio;                 /* prompt / (prompt + own) */
} dlm_workload;

/* 0, or -1 with a message in err. */
int dlm_workload_make(dlm_workload *w, const dlm_workload_opts *o, const dlm_model *m, char *err, size_t errlen);
void dlm_workload_free(dlm_workload *w);
/* Request i's tokens at denoising step s of `steps` ([prompt ; own]): own
 * token j is revealed at a step fixed by a hash and is the mask id
 * (vocab - 1) before it; one step reveals everything. The schedule does not
 * depend on the model, so cached and uncached runs see the same inputs. */
void dlm_workload_tokens(const dlm_workload *w, int64_t i, int64_t step, int64_t steps, int32_t *dst);

/* Calibration: per ratio, a fresh random sequence of `seq` tokens whose
 * first round(r * seq) are the prefix; similarity per layer of the prefix's
 * K/V alone vs inside the sequence = min over K and V of
 * forkattn_kv_similarity's mean over heads; added to the profile. */
#define DLM_CALIB_MAX 64
typedef struct dlm_calib {
  int64_t samples;
  double seconds;
  double ratio[DLM_CALIB_MAX];
  float sim[DLM_CALIB_MAX][DLM_MAX_LAYERS];
} dlm_calib;

forkattn_status dlm_calibrate(forkattn_ctx *ctx, const dlm_model *m, int64_t seq, const double *ratios,
                              int64_t nratios, uint64_t seed, forkattn_reuse_profile *profile, dlm_calib *out,
                              char *err, size_t errlen);

typedef struct dlm_serve_opts {
  int64_t batch;        /* arrivals per window; a window's requests are grouped by prompt,
                           each group one forward per step (per-request depths) */
  int64_t steps;        /* denoising steps per request (>= 1) */
  int64_t refresh;      /* > 0: deep-layer prefix K/V recomputed every `refresh` steps (0: every step) */
  int64_t fixed_depth;  /* >= 0: this depth instead of the profile's */
  size_t cache_bytes;   /* the cache's capacity */
  int warm;             /* insert every prompt before the timed serving (steady state) */
  int compare;          /* also run uncached, time it and measure drift */
} dlm_serve_opts;

typedef struct dlm_serve_result {
  double sec_uncached, sec_cached, sec_alone; /* sec_alone (prefixes computed alone) is inside sec_cached */
  double sec_warm;                            /* warm-up insertions, not in sec_cached */
  int64_t requests, groups, tokens, own_tokens; /* tokens: every row of every step */
  int64_t depth_used[DLM_MAX_LAYERS + 1];    /* requests per reuse depth b(r) run */
  forkattn_kv_cache_stats cache;
  uint64_t side_misses;
  double side_bytes;
  /* drift of cached vs uncached outputs: per own row, ||c - u|| / ||u|| */
  int64_t rows, top1_agree;
  double hid_max, hid_mean, logit_max, logit_mean;
} dlm_serve_result;

forkattn_status dlm_serve(forkattn_ctx *ctx, const dlm_model *m, const dlm_workload *w,
                          const forkattn_reuse_profile *profile, const dlm_serve_opts *o, dlm_serve_result *r,
                          char *err, size_t errlen);
#endif
