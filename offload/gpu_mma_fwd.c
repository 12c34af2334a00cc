/* Tensor-core GPU forward of segment attention (FlashAttention-2 shape), for
 * bf16/f16 q/k/v with head_dim 64 or 128. The same segment plan as the FP32
 * kernel: a team owns FA_MMA_ROWS query rows of one segment and one query
 * head, and walks the key tiles of every pair of its segment in one online
 * softmax.
 *
 * Team: 4 warps, each owning 16 query rows (Q fragments in registers for the
 * whole walk). Key tiles of BK keys x head_dim of K and V are copied with
 * cp.async into two team-memory buffers (the next tile, across pair
 * boundaries, streams in while this one is computed). S = Q K^T and O += P V
 * with mma.sync m16n8k16 (f32 accumulate), K fragments by ldmatrix, V
 * fragments by ldmatrix.trans; P goes from the S accumulators to bf16/f16 A
 * fragments without touching memory. Scores are in log2 units (scale * log2 e
 * folded in) so the softmax uses ex2. Row max across the quad of lanes that
 * share a row; row sums stay per lane until the end. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_fwd_teams.h"
#include "gpu_mma_tiles.h"
#include "gpu_persist.h"
#include "gpu_team_memory.h"
#include "gpu_tma.h"
#include "gpu_wgmma.h"
#include "online_softmax.h"


int fa_gpu_mma_ok(const forkattn_tensor *const *t, int n, int64_t d, int has_kept, const fa_plan *plan,
                  forkattn_memory memory) {
  /* FORKATTN_GPU_MMA=0 keeps the FP32 kernels (a fallback for comparison and diagnosis). */
  const char *env = getenv("FORKATTN_GPU_MMA");
  if (env && strcmp(env, "0") == 0) return 0;
  if (!fa_mma_plan_fits(plan)) return 0; /* walks in 32 bits: fewer registers and instructions */
  const int dt = (int)t[0]->dtype;
  if (has_kept || (dt != FORKATTN_DTYPE_BF16 && dt != FORKATTN_DTYPE_F16) || (d != 64 && d != 128)) return 0;
  for (int i = 0; i < n; i++) {
    if ((int)t[i]->dtype != dt || !fa_gpu_mma_rows16(t[i], memory)) return 0;
  }
  return 1;
}

int fa_gpu_mma_fwd_ok(const fa_attn_fwd *a, forkattn_memory memory) {
  const forkattn_tensor *t[3] = {&a->q, &a->k, &a->v}, *out[1] = {&a->o};
  return fa_gpu_mma_ok(t, 3, a->d, a->kept != NULL, a->plan, memory) && fa_gpu_mma_out_ok(out, 1, memory);
}


#define FA_MMA_FWD(D, F16) \
  FA_MMA_QUERY_TEAMS(fa_mma_fwd_team, blocks, D, FA_MMA_BK(D), F16, FA_MMA_QUERY_SMEM(FA_MMA_BK(D), (D) + 8))

int fa_gpu_wgmma_on(int device, size_t smem) {
#ifdef FORKATTN_HAVE_WGMMA
  /* FORKATTN_GPU_WGMMA=0 keeps the mma.sync kernels (comparison and diagnosis). */
  const char *env = getenv("FORKATTN_GPU_WGMMA");
  if (env && strcmp(env, "0") == 0) return 0;
  return fa_gpu_team_memory(device) >= smem;
#else
  (void)device, (void)smem;
  return 0;
#endif
}

int fa_gpu_mma_tma_pair(fa_tma_map *maps, const fa_dev_tensor *a, int64_t a_rows, const fa_dev_tensor *b,
                        int64_t b_rows, int64_t heads, int64_t d, int box_rows, size_t smem, int device) {
  /* FORKATTN_GPU_TMA=0 keeps the cp.async loads (comparison and diagnosis). */
  const char *env = getenv("FORKATTN_GPU_TMA");
  if ((env && strcmp(env, "0") == 0) || !fa_gpu_wgmma_on(device, smem)) return 0;
  char msg[96];
  const int f16 = a->dtype == FORKATTN_DTYPE_F16;
  return !fa_gpu_tma_encode(&maps[0], a->data, f16, a_rows, heads, d, a->rs, a->hs, box_rows, msg, sizeof msg) &&
         !fa_gpu_tma_encode(&maps[1], b->data, f16, b_rows, heads, d, b->rs, b->hs, box_rows, msg, sizeof msg);
}

int fa_gpu_persist_grid(int device, int nteams) {
  /* FORKATTN_GPU_PERSIST=0, 1 or n > 1 overrides the choice by items an SM (comparison, diagnosis,
   * tests); anything else is the automatic choice */
  const char *env = getenv("FORKATTN_GPU_PERSIST");
  char *end = NULL;
  const long v = env ? strtol(env, &end, 10) : -1;
  const int mode = env && *env && end && !*end && v >= 0 && v <= 1 << 20 ? (int)v : -1;
  return fa_persist_grid_for(fa_gpu_sms(device), nteams, mode);
}

int fa_gpu_wg2_on(void) {
  /* FORKATTN_GPU_WG2=0 keeps the one-warpgroup kernels (comparison and diagnosis). */
  const char *env = getenv("FORKATTN_GPU_WG2");
  return !(env && strcmp(env, "0") == 0);
}

int fa_gpu_mma_fwd_tma(fa_tma_map *maps, const fa_dev_tensor *k, int64_t k_rows, const fa_dev_tensor *v,
                       int64_t v_rows, int64_t hkv, int64_t d, int device, int *wg2) {
  *wg2 = fa_gpu_wg2_on() &&
         fa_gpu_mma_tma_pair(maps, k, k_rows, v, v_rows, hkv, d, FA_WG2_BK, FA_WG2_FWD_SMEM(d), device);
  return *wg2 ||
         fa_gpu_mma_tma_pair(maps, k, k_rows, v, v_rows, hkv, d, FA_WG_BK, FA_WG_QUERY_SMEM(FA_WG_BK, d, 1), device);
}

#define FA_WG_FWD(D, F16) FA_MMA_QUERY_TEAMS(fa_wg_fwd_team, blocks, D, FA_WG_BK, F16, FA_WG_QUERY_SMEM(FA_WG_BK, D, 1))
#define FA_WG2_FWD(D, F16)                                                                                     \
  FA_MMA_QUERY_TEAMS_OF(fa_wg2_fwd_team, blocks, D, FA_WG2_BK, F16, FA_WG2_FWD_SMEM(D), FA_WG2_THREADS)
#define FA_WG2_FWD_PERSIST(D, F16) \
  FA_WG2_QUERY_TEAMS_PERSIST(fa_wg2_fwd_team, fa_wg2_fwd_ring, blocks, nblocks, D, FA_WG2_BK, F16, FA_WG2_FWD_SMEM(D))

void fa_gpu_mma_fwd(const fa_gpu_fwd_args *g, const fa_gpu_fwd_args *argp) {
  const int nteams = (int)(g->nblocks * g->hq), dev = g->device, f16 = g->q.dtype == FORKATTN_DTYPE_F16;
#ifdef FORKATTN_HAVE_WGMMA
  if (g->wg2) { /* fa_gpu_mma_fwd_tma chose it, and the blocks are FA_WG2_ROWS */
    const int grid = fa_gpu_persist_grid(dev, nteams);
    if (grid) FA_TL_LAUNCH(dev, "wg2_fwd", FA_MMA_BY_HEAD_DIM(FA_WG2_FWD_PERSIST, g->d, f16));
    else FA_TL_LAUNCH(dev, "wg2_fwd", FA_MMA_BY_HEAD_DIM(FA_WG2_FWD, g->d, f16));
    return;
  }
#endif
  FA_WG_OR_MMA(FA_WG_FWD, FA_MMA_FWD, FA_WG_QUERY_SMEM(FA_WG_BK, g->d, 1), g->d, f16);
}
