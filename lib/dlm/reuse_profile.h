/* Reuse-depth profile (forkattn_reuse_profile_*): the structure shared by the
 * model (reuse_profile.c) and its text file (reuse_profile_io.c). */
#ifndef FORKATTN_REUSE_PROFILE_H
#define FORKATTN_REUSE_PROFILE_H
#include <stdint.h>

#include "context_internal.h"
#include "forkattn_experimental.h"

#define FA_PROFILE_BINS 101           /* ratio bins 0..100, 1% wide */
#define FA_PROFILE_MAX_LAYERS 65536   /* bounds memory (and what a file may ask for) */
#define FA_PROFILE_SIM_SLACK 1e-6     /* similarities this far outside [-1, 1] are rounding: clamped */

struct forkattn_reuse_profile {
  int64_t layers;
  float threshold;
  int64_t count[FA_PROFILE_BINS];  /* measurements per bin */
  double *mean;                    /* [FA_PROFILE_BINS][layers]: running means, in [-1, 1] */
  int64_t depth[FA_PROFILE_BINS];  /* monotone reuse depth per bin (fa_profile_refresh) */
};

/* A new empty profile after checking layers and threshold (messages name
 * them). *out stays untouched on failure. */
forkattn_status fa_profile_new(forkattn_ctx *ctx, int64_t layers, double threshold, forkattn_reuse_profile **out);

/* Recompute depth[] from count[] and mean[] (rule: reuse_profile.c). */
void fa_profile_refresh(forkattn_reuse_profile *p);

#endif
