/* Reuse-depth profile: measurements per prefix-ratio bin, and the depth b(r).
 *
 * Bins: bin(r) = floor(100 r + 1e-9), so bin k holds the ratios in
 * [k/100, (k+1)/100) and r = 1 is bin 100 alone; the 1e-9 keeps decimal ratios
 * in their own bin despite binary rounding (0.29 * 100 = 28.999999999999996).
 *
 * Each bin keeps its measurement count and, per layer, the running mean of the
 * similarities (double; mean += (x - mean) / count, so the result depends on
 * the order of the adds only through rounding).
 *
 * Depth, recomputed after every change (fa_profile_refresh):
 *  1. raw(k), for a bin k with data: the number of leading layers l = 0, 1, ...
 *     whose mean is >= the threshold (compared in double);
 *  2. a bin k with data: depth(k) = min of raw(j) over the bins j >= k with
 *     data (never more than any higher-ratio bin allows);
 *  3. a bin without data: the depth of the nearest lower bin with data, or 0
 *     when there is none.
 * Step 2 makes the depths of the bins with data non-decreasing in k, and step 3
 * fills each gap with the value at its lower end (<= the value at its upper
 * end): depth is non-decreasing over all 101 bins.
 *
 * Not thread-safe for writers: add and free need exclusive access; any number
 * of threads may call depth (and save) at once. */
#include "reuse_profile.h"

#include <math.h>

#include "alloc.h"
#include "validate.h"

#define FA_BAD FORKATTN_ERR_INVALID_ARGUMENT

forkattn_status fa_profile_new(forkattn_ctx *ctx, int64_t layers, double threshold, forkattn_reuse_profile **out) {
  if (layers < 1 || layers > FA_PROFILE_MAX_LAYERS)
    return fa_fail(ctx, FA_BAD, "layers: %lld must be in 1..%d", (long long)layers, FA_PROFILE_MAX_LAYERS);
  if (!(isfinite(threshold) && threshold >= 0.0 && threshold <= 1.0))
    return fa_fail(ctx, FA_BAD, "threshold: %g must be a finite similarity in [0, 1]", threshold);
  forkattn_reuse_profile *p = fa_calloc(1, sizeof *p);
  double *mean = p ? fa_calloc((size_t)(FA_PROFILE_BINS * layers), sizeof(double)) : NULL;
  if (!mean) {
    fa_free(p);
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "reuse_profile: cannot allocate a profile of %lld layers",
                   (long long)layers);
  }
  p->layers = layers;
  p->threshold = (float)threshold;
  p->mean = mean;
  *out = p;
  return FORKATTN_OK;
}

void fa_profile_refresh(forkattn_reuse_profile *p) {
  const int64_t L = p->layers;
  const double thr = (double)p->threshold;
  int64_t lim = L;
  for (int k = FA_PROFILE_BINS - 1; k >= 0; k--) {
    if (!p->count[k]) continue;
    const double *m = p->mean + (int64_t)k * L;
    int64_t raw = 0;
    while (raw < L && m[raw] >= thr) raw++;
    if (raw < lim) lim = raw;
    p->depth[k] = lim;
  }
  int64_t last = 0;
  for (int k = 0; k < FA_PROFILE_BINS; k++) {
    if (p->count[k])
      last = p->depth[k];
    else
      p->depth[k] = last;
  }
}

/* ratio must be finite in [0, 1]; *bin its bin. */
static forkattn_status fa_profile_bin(forkattn_ctx *ctx, double ratio, int *bin) {
  if (!(isfinite(ratio) && ratio >= 0.0 && ratio <= 1.0))
    return fa_fail(ctx, FA_BAD, "ratio: %g must be a finite prefix share in [0, 1]", ratio);
  const int k = (int)floor(ratio * 100.0 + 1e-9);
  *bin = k < FA_PROFILE_BINS ? k : FA_PROFILE_BINS - 1;
  return FORKATTN_OK;
}

forkattn_status forkattn_reuse_profile_create(forkattn_ctx *ctx, int64_t layers, float threshold,
                                              forkattn_reuse_profile **profile) {
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!profile) return fa_fail(ctx, FA_BAD, "profile: the output pointer is NULL");
  *profile = NULL;
  return fa_profile_new(ctx, layers, (double)threshold, profile);
}

void forkattn_reuse_profile_free(forkattn_reuse_profile *profile) {
  if (!profile) return;
  fa_free(profile->mean);
  fa_free(profile);
}

forkattn_status forkattn_reuse_profile_add(forkattn_ctx *ctx, forkattn_reuse_profile *profile, double ratio,
                                           const float *sim) {
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!profile) return fa_fail(ctx, FA_BAD, "profile: is NULL");
  int bin = 0;
  forkattn_status st = fa_profile_bin(ctx, ratio, &bin);
  if (st) return st;
  const int64_t L = profile->layers;
  if (!sim) return fa_fail(ctx, FA_BAD, "sim: is NULL (needs %lld values, one per layer)", (long long)L);
  if ((st = fa_check_aligned(ctx, "sim", sim, sizeof *sim))) return st;
  for (int64_t l = 0; l < L; l++) { /* everything checked before anything changes */
    const double x = (double)sim[l];
    if (!isfinite(x)) return fa_fail(ctx, FA_BAD, "sim[%lld]: %g is not finite", (long long)l, x);
    if (fabs(x) > 1.0 + FA_PROFILE_SIM_SLACK)
      return fa_fail(ctx, FA_BAD, "sim[%lld]: %.9g is outside [-1, 1] (a cosine similarity)", (long long)l, x);
  }
  if (profile->count[bin] == INT64_MAX)
    return fa_fail(ctx, FA_BAD, "ratio: bin %d already holds the most measurements a bin can count", bin);
  const int64_t n = ++profile->count[bin];
  double *m = profile->mean + (int64_t)bin * L;
  for (int64_t l = 0; l < L; l++) {
    const double x = fmin(1.0, fmax(-1.0, (double)sim[l]));
    m[l] = fmin(1.0, fmax(-1.0, m[l] + (x - m[l]) / (double)n));
  }
  fa_profile_refresh(profile);
  return FORKATTN_OK;
}

forkattn_status forkattn_reuse_profile_depth(forkattn_ctx *ctx, const forkattn_reuse_profile *profile, double ratio,
                                             int64_t *depth) {
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!profile) return fa_fail(ctx, FA_BAD, "profile: is NULL");
  if (!depth) return fa_fail(ctx, FA_BAD, "depth: is NULL");
  forkattn_status st = fa_check_aligned(ctx, "depth", depth, sizeof *depth);
  if (st) return st;
  int bin = 0;
  if ((st = fa_profile_bin(ctx, ratio, &bin))) return st;
  *depth = profile->depth[bin];
  return FORKATTN_OK;
}
