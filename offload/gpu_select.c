/* The GPU kernel decision table (gpu_select.h). Host code, no device headers:
 * the kernels' team memory comes in through fa_gpu_caps. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gpu_persist.h"
#include "gpu_select.h"

/* f32 inputs reach the tensor cores split into bf16 pieces (every pass has such a kernel) unless the
 * context asks for f32 products, when the pass's team memory fits the device. */
static int fa_select_split(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, fa_gpu_pass pass,
                           const fa_gpu_call *c) {
  const size_t need = caps->split_smem[pass][c->d == 128];
  return c->f32 && knobs->f32 != FORKATTN_F32_PRECISION_HIGHEST && need && need <= caps->team_memory;
}

/* Tensor-core kernels exist for bf16/f16 (and f32 split into bf16, fa_select_split) at head_dim 64 and 128
 * without a kept set, on 16-byte rows. */
static int fa_select_tensor_cores(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, fa_gpu_pass pass,
                                  const fa_gpu_call *c) {
  if (c->kept || !c->rows16 || !c->same_d || (c->d != 64 && c->d != 128)) return 0;
  /* the StreamKL backward's teams read both sides' K tiles of one KV head */
  if (pass == FA_PASS_KL_BWD && !c->same_kv_heads) return 0;
  return c->half || fa_select_split(caps, knobs, pass, c);
}

/* The wgmma kernel of an attention pass: fits the build, the device's team memory and the call's maps. */
static fa_gpu_kernel fa_select_wgmma(const fa_gpu_caps *caps, fa_gpu_pass pass, const fa_gpu_call *c) {
  if (pass != FA_PASS_FWD && pass != FA_PASS_DQ && pass != FA_PASS_DKV) return FA_KERNEL_MMA; /* StreamKL */
  const size_t need = caps->wg_smem[pass][c->d == 128];
  if (!caps->wgmma || !c->tma || !need || need > caps->team_memory) return FA_KERNEL_MMA;
  /* the dK/dV at head_dim 64 is key-major: faster there than the query-major kernel (docs/gpu-kernels.md) */
  return pass == FA_PASS_DKV && c->d == 64 ? FA_KERNEL_WG_KEY_MAJOR : FA_KERNEL_WG_PAIR;
}

fa_gpu_kernel fa_gpu_select(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, fa_gpu_pass pass,
                            const fa_gpu_call *call) {
  if (knobs->kernels == FORKATTN_GPU_KERNELS_FP32 || !fa_select_tensor_cores(caps, knobs, pass, call))
    return FA_KERNEL_FP32;
  if (knobs->kernels == FORKATTN_GPU_KERNELS_MMA || !call->half) return FA_KERNEL_MMA; /* split f32: mma.sync */
  return fa_select_wgmma(caps, pass, call);
}

void fa_gpu_select_pieces(const fa_gpu_knobs *knobs, fa_gpu_pass pass, fa_gpu_kernel k, const fa_gpu_call *call,
                          int *qk, int *v) {
  const int split = call->f32 && k != FA_KERNEL_FP32;
  *qk = !split ? 0 : knobs->f32 == FORKATTN_F32_PRECISION_MEDIUM ? 2 : 3;
  *v = pass == FA_PASS_KL_FWD || pass == FA_PASS_KL_BWD ? 0 : *qk;
}

int fa_gpu_select_needs_tma(fa_gpu_kernel k) { return k == FA_KERNEL_WG_PAIR || k == FA_KERNEL_WG_KEY_MAJOR; }

int fa_gpu_select_grid(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, fa_gpu_pass pass, fa_gpu_kernel k,
                       int64_t nteams, int64_t item_keys) {
  if (k != FA_KERNEL_WG_PAIR || (pass != FA_PASS_FWD && pass != FA_PASS_DQ)) return 0;
  const int grid = fa_persist_grid_for(caps->sms, nteams, item_keys, knobs->persist);
  if (grid || pass != FA_PASS_FWD) return grid;
  return -fa_stream_grid_for(caps->sms, nteams, item_keys, knobs->persist);
}

void fa_gpu_grid_reason(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, int64_t nteams, int64_t item_keys,
                        int grid, char *buf, size_t len) {
  const double per_sm = caps->sms > 0 ? (double)nteams / caps->sms : 0.0;
  const int n = snprintf(buf, len, "%lld items (%.1f an SM, %lld keys an item): ", (long long)nteams, per_sm,
                         (long long)item_keys);
  if (n < 0 || (size_t)n >= len) return;
  buf += n;
  len -= (size_t)n;
  if (grid < 0)
    snprintf(buf, len, knobs->persist == FA_PERSIST_STREAM ? "%d stream teams (gpu_persist = stream)"
                                                            : "%d stream teams (short items)",
             -grid);
  else if (knobs->persist >= 0)
    snprintf(buf, len, grid ? "%d persistent teams (gpu_persist = %d)" : "a team an item (gpu_persist = %d)",
             grid ? grid : knobs->persist, knobs->persist);
  else if (grid)
    snprintf(buf, len, "%d persistent teams", grid);
  else if (item_keys < FA_PERSIST_MIN_KEYS_PER_ITEM)
    snprintf(buf, len, "a team an item (short items: the forward's stream teams from %d items an SM)", FA_STREAM_MIN_ITEMS_PER_SM);
  else
    snprintf(buf, len, "a team an item (persistent from %d items an SM)", FA_PERSIST_MIN_ITEMS_PER_SM);
}

const char *fa_gpu_kernel_name(fa_gpu_pass pass, fa_gpu_kernel k) {
  switch (k) {
  case FA_KERNEL_WG_PAIR:
    return pass == FA_PASS_DKV ? "wgmma two-warpgroup query-major" : "wgmma two-warpgroup";
  case FA_KERNEL_WG_KEY_MAJOR:
    return "wgmma key-major";
  case FA_KERNEL_MMA:
    return "mma.sync";
  default:
    return "fp32";
  }
}

/* A bf16/f16 call at head_dim d with aligned rows whose maps encode: what the summary describes. */
static fa_gpu_call fa_select_typical(int64_t d) {
  return (fa_gpu_call){.half = 1, .d = d, .rows16 = 1, .same_d = 1, .same_kv_heads = 1, .tma = 1};
}

void fa_gpu_select_describe(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, char *buf, size_t len) {
  static const char *const pass_names[FA_PASSES] = {"forward", "dQ", "dK/dV", "StreamKL forward",
                                                    "StreamKL backward"};
  size_t at = 0;
  int n = 0;
  buf[0] = '\0';
  for (int p = 0; p < FA_PASSES; p++) {
    const char *k[2];
    for (int i = 0; i < 2; i++) {
      const fa_gpu_call c = fa_select_typical(i ? 128 : 64);
      k[i] = fa_gpu_kernel_name((fa_gpu_pass)p, fa_gpu_select(caps, knobs, (fa_gpu_pass)p, &c));
    }
    n = strcmp(k[0], k[1]) ? snprintf(buf + at, len - at, "%s %s (d=64), %s (d=128); ", pass_names[p], k[0], k[1])
                           : snprintf(buf + at, len - at, "%s %s; ", pass_names[p], k[0]);
    if (n < 0 || (size_t)n >= len - at) return;
    at += (size_t)n;
  }
  const fa_gpu_call fwd = fa_select_typical(128);
  if (fa_gpu_select(caps, knobs, FA_PASS_FWD, &fwd) != FA_KERNEL_WG_PAIR || knobs->persist == 0)
    n = snprintf(buf + at, len - at, "no persistent teams");
  else if (knobs->persist == FA_PERSIST_STREAM)
    n = snprintf(buf + at, len - at, "forward stream teams, one an SM");
  else if (knobs->persist < 0)
    n = snprintf(buf + at, len - at, "persistent teams from %d items an SM, forward stream teams for short items",
                 FA_PERSIST_MIN_ITEMS_PER_SM);
  else if (knobs->persist == 1)
    n = snprintf(buf + at, len - at, "persistent teams, one an SM");
  else
    n = snprintf(buf + at, len - at, "persistent teams, at most %d", knobs->persist);
  if (n < 0 || (size_t)n >= len - at) return;
  at += (size_t)n;
  /* the passes that multiply f32 inputs (at head_dim 128) on tensor cores */
  const fa_gpu_call f32 = {.f32 = 1, .d = 128, .rows16 = 1, .same_d = 1, .same_kv_heads = 1, .tma = 1};
  for (int p = 0, first = 1; p < FA_PASSES; p++) {
    if (fa_gpu_select(caps, knobs, (fa_gpu_pass)p, &f32) != FA_KERNEL_MMA) continue;
    n = first ? snprintf(buf + at, len - at, "; f32 as bf16x%d on mma.sync: %s",
                         knobs->f32 == FORKATTN_F32_PRECISION_MEDIUM ? 3 : 6, pass_names[p])
              : snprintf(buf + at, len - at, ", %s", pass_names[p]);
    if (n < 0 || (size_t)n >= len - at) return;
    at += (size_t)n;
    first = 0;
  }
  snprintf(buf + at, len - at, "; other calls fp32");
}

/* A count 0..2^20 in s: the value, or -1. */
static long fa_select_count(const char *s) {
  char *end = NULL;
  const long v = strtol(s, &end, 10);
  return *s && end && !*end && v >= 0 && v <= 1L << 20 ? v : -1;
}

int fa_gpu_knobs_read(const forkattn_ctx_options *o, fa_gpu_knobs *k, char *err, size_t len) {
  k->kernels = o ? (int)o->gpu_kernels : FORKATTN_GPU_KERNELS_AUTO;
  k->persist = o ? o->gpu_persist : -1;
  k->trace = 0;
  k->f32 = o ? (int)o->f32_precision : FORKATTN_F32_PRECISION_HIGH;
  const char *e = getenv("FORKATTN_GPU_KERNELS");
  if (e && *e) {
    if (!strcasecmp(e, "auto")) k->kernels = FORKATTN_GPU_KERNELS_AUTO;
    else if (!strcasecmp(e, "mma")) k->kernels = FORKATTN_GPU_KERNELS_MMA;
    else if (!strcasecmp(e, "fp32")) k->kernels = FORKATTN_GPU_KERNELS_FP32;
    else return snprintf(err, len, "FORKATTN_GPU_KERNELS='%s' is not one of auto, mma, fp32", e), -1;
  }
  e = getenv("FORKATTN_GPU_PERSIST");
  if (e && *e) {
    const long v = !strcasecmp(e, "auto") ? -1 : !strcasecmp(e, "stream") ? FA_PERSIST_STREAM : fa_select_count(e);
    if (v < 0 && strcasecmp(e, "auto") && strcasecmp(e, "stream"))
      return snprintf(err, len, "FORKATTN_GPU_PERSIST='%s' is not auto, stream or a count 0..%ld", e, 1L << 20), -1;
    k->persist = (int)v;
  }
  e = getenv("FORKATTN_F32_PRECISION");
  if (e && *e) {
    if (!strcasecmp(e, "high")) k->f32 = FORKATTN_F32_PRECISION_HIGH;
    else if (!strcasecmp(e, "highest")) k->f32 = FORKATTN_F32_PRECISION_HIGHEST;
    else if (!strcasecmp(e, "medium")) k->f32 = FORKATTN_F32_PRECISION_MEDIUM;
    else return snprintf(err, len, "FORKATTN_F32_PRECISION='%s' is not one of high, highest, medium", e), -1;
  }
  e = getenv("FORKATTN_GPU_TRACE");
  k->trace = e && !strcmp(e, "1");
  e = getenv("FORKATTN_GPU_DIRECT_LAUNCH");
  k->direct = 1;
  if (e && *e) {
    if (strcmp(e, "0") && strcmp(e, "1"))
      return snprintf(err, len, "FORKATTN_GPU_DIRECT_LAUNCH='%s' is not 0 or 1", e), -1;
    k->direct = *e == '1';
  }
  if (k->kernels < FORKATTN_GPU_KERNELS_AUTO || k->kernels > FORKATTN_GPU_KERNELS_FP32)
    return snprintf(err, len, "gpu_kernels (%d) is not a forkattn_gpu_kernels value", k->kernels), -1;
  if (k->f32 < FORKATTN_F32_PRECISION_HIGH || k->f32 > FORKATTN_F32_PRECISION_MEDIUM)
    return snprintf(err, len, "f32_precision (%d) is not a forkattn_f32_precision value", k->f32), -1;
  if (k->persist < FA_PERSIST_STREAM || k->persist > 1 << 20)
    return snprintf(err, len, "gpu_persist (%d) must lie in %d..%d", k->persist, FA_PERSIST_STREAM, 1 << 20), -1;
  return 0;
}
