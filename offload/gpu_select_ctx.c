/* A GPU context's kernel choice (gpu_select_ctx.h). */
#include <stdarg.h>
#include <stdio.h>

#include "alloc.h"
#include "gpu_bwd.h"
#include "gpu_fwd.h"
#include "gpu_kl.h"
#include "gpu_select_ctx.h"
#include "gpu_stream.h"
#include "gpu_team_memory.h"

forkattn_status fa_gpu_choice_init(forkattn_ctx *ctx, const forkattn_ctx_options *o, char *err, size_t len) {
  fa_gpu_choice *g = ctx->gpu = fa_calloc(1, sizeof *g);
  if (!g) {
    snprintf(err, len, "out of memory");
    return FORKATTN_ERR_OUT_OF_MEMORY;
  }
  if (fa_gpu_knobs_read(o, &g->knobs, err, len)) return FORKATTN_ERR_INVALID_ARGUMENT;
#ifdef FORKATTN_HAVE_WGMMA
  g->caps.wgmma = 1;
#endif
  g->caps.team_memory = fa_gpu_team_memory(ctx->device);
  g->caps.sms = fa_gpu_sms(ctx->device);
  fa_gpu_mma_fwd_smem(g->caps.wg_smem[FA_PASS_FWD]);
  for (int i = 0; i < 2; i++) {
    g->caps.split_smem[FA_PASS_FWD][i] = fa_gpu_mma_fwd_split_smem(i ? 128 : 64, 3);
    g->caps.split_smem[FA_PASS_KL_FWD][i] = fa_gpu_mma_kl_fwd_split_smem(i ? 128 : 64, 3);
    g->caps.split_smem[FA_PASS_KL_BWD][i] = fa_gpu_mma_kl_bwd_split_smem(i ? 128 : 64);
  }
  fa_gpu_mma_bwd_smem(g->caps.wg_smem[FA_PASS_DQ], g->caps.wg_smem[FA_PASS_DKV]);
  fa_gpu_mma_bwd_split_smem(g->caps.split_smem[FA_PASS_DQ], g->caps.split_smem[FA_PASS_DKV]);
  fa_gpu_select_describe(&g->caps, &g->knobs, ctx->kernels, sizeof ctx->kernels);
  return FORKATTN_OK;
}

void fa_gpu_choice_free(forkattn_ctx *ctx) {
  fa_free(ctx->gpu);
  ctx->gpu = NULL;
}

fa_gpu_kernel fa_gpu_choose(const forkattn_ctx *ctx, fa_gpu_pass pass, const fa_gpu_call *c) {
  return fa_gpu_select(&ctx->gpu->caps, &ctx->gpu->knobs, pass, c);
}

fa_gpu_kernel fa_gpu_choose_mapped(const forkattn_ctx *ctx, fa_gpu_pass pass, const fa_gpu_call *c, fa_gpu_kernel k,
                                   int encoded) {
  if (!fa_gpu_select_needs_tma(k) || encoded) return k;
  fa_gpu_call without = *c;
  without.tma = 0;
  return fa_gpu_choose(ctx, pass, &without);
}

int fa_gpu_choose_grid(const forkattn_ctx *ctx, fa_gpu_pass pass, fa_gpu_kernel k, int64_t nteams, const fa_plan *p,
                       const fa_block *blocks, int64_t nblocks) {
  const int64_t keys = nblocks > 0 ? fa_plan_query_keys(p, blocks, nblocks) / nblocks : 0;
  const int grid = fa_gpu_select_grid(&ctx->gpu->caps, &ctx->gpu->knobs, pass, k, nteams, keys);
  /* persistent teams count their work on a device counter the call zeroes; a graph's replays would not
   * (stream teams have no counter) */
  if (grid > 0 && fa_gpu_capturing()) {
    fa_gpu_log_kernels(ctx, "schedule", "a team an item (a CUDA graph capture)");
    return 0;
  }
  if (ctx->verbose && k == FA_KERNEL_WG_PAIR) {
    char why[160];
    fa_gpu_grid_reason(&ctx->gpu->caps, &ctx->gpu->knobs, nteams, keys, grid, why, sizeof why);
    fa_gpu_log_kernels(ctx, "schedule", "%s %s", pass == FA_PASS_FWD ? "forward" : "dQ", why);
  }
  return grid;
}

void fa_gpu_log_kernels(const forkattn_ctx *ctx, const char *call, const char *fmt, ...) {
  if (!ctx->verbose) return;
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  fprintf(stderr, "forkattn gpu %s: %s\n", call, what);
}
