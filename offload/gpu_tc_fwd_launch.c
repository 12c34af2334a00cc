/* Launches of the tensor-core forward of segment attention (the mma.sync and
 * wgmma teams of gpu_fwd_teams.h), for bf16/f16 q/k/v, head_dim 64 or 128. The
 * same segment plan as the FP32 kernel: a team owns FA_MMA_ROWS query rows of
 * one segment and one query head, and walks the key tiles of every pair of its
 * segment in one online softmax.
 *
 * Team: 4 warps, each owning 16 query rows (Q fragments in registers for the
 * whole walk). Key tiles of BK keys x head_dim of K and V are copied with
 * cp.async into two team-memory buffers (the next tile, across pair
 * boundaries, streams in while this one is computed). S = Q K^T and O += P V
 * with mma.sync m16n8k16 (f32 accumulate), K fragments by ldmatrix, V
 * fragments by ldmatrix.trans; P goes from the S accumulators to bf16/f16 A
 * fragments without touching memory. Scores are in log2 units (scale * log2 e
 * folded in) so the softmax uses ex2. Row max across the quad of lanes that
 * share a row; row sums stay per lane until the end.
 *
 * sm_90a builds run the two-warpgroup wgmma kernel instead when the context's
 * choice (gpu_select.h) says so: fa_wg_pair_fwd_team (gpu_fwd_teams.h), K and
 * V by bulk tensor copies, persistent teams on large launches, stream teams
 * (gpu_fwd_stream_team.h) on launches of many short items. */
#include <math.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_finite_check.h"
#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_fwd_stream_team.h"
#include "gpu_fwd_teams.h"
#include "gpu_mma_tiles.h"
#include "gpu_team_memory.h"
#include "gpu_tma.h"
#include "gpu_wgmma.h"
#include "online_softmax.h"

fa_gpu_call fa_gpu_call_of(const forkattn_tensor *const *in, int nin, const forkattn_tensor *const *out, int nout,
                           int64_t d, int has_kept, const fa_plan *plan, forkattn_memory memory) {
  const int dt = (int)in[0]->dtype;
  /* positions in 32 bits: the tensor-core walks use fewer registers and instructions */
  fa_gpu_call c = {.half = dt == FORKATTN_DTYPE_BF16 || dt == FORKATTN_DTYPE_F16, .f32 = dt == FORKATTN_DTYPE_F32,
                   .d = d, .kept = has_kept,
                   .rows16 = fa_mma_plan_fits(plan) && fa_gpu_mma_out_ok(out, nout, memory), .same_d = 1,
                   .same_kv_heads = 1, .tma = 1};
  for (int i = 0; i < nin; i++) {
    if ((int)in[i]->dtype != dt) c.half = c.f32 = 0;
    if (!fa_gpu_mma_rows16(in[i], memory)) c.rows16 = 0;
  }
  return c;
}

fa_gpu_call fa_gpu_fwd_call(const fa_attn_fwd *a, forkattn_memory memory) {
  const forkattn_tensor *in[3] = {&a->q, &a->k, &a->v}, *out[1] = {&a->o};
  return fa_gpu_call_of(in, 3, out, 1, a->d, a->kept != NULL, a->plan, memory);
}

void fa_gpu_mma_fwd_smem(size_t smem[2]) { /* the stream teams' (the most of the three schedules) */
  smem[0] = FA_FWD_STREAM_SMEM(FA_WG_PAIR_FWD_SMEM(64));
  smem[1] = FA_FWD_STREAM_SMEM(FA_WG_PAIR_FWD_SMEM(128));
}

int fa_gpu_mma_tma_pair(fa_tma_map *maps, const fa_dev_tensor *a, int64_t a_rows, const fa_dev_tensor *b,
                        int64_t b_rows, int64_t heads, int64_t d, int box_rows) {
  char msg[96];
  const int f16 = a->dtype == FORKATTN_DTYPE_F16;
  return !fa_gpu_tma_encode(&maps[0], a->data, f16, a_rows, heads, d, a->rs, a->hs, box_rows, msg, sizeof msg) &&
         !fa_gpu_tma_encode(&maps[1], b->data, f16, b_rows, heads, d, b->rs, b->hs, box_rows, msg, sizeof msg);
}

int fa_gpu_wg_pair_kv_tma(fa_tma_map *maps, const fa_dev_tensor *k, int64_t k_rows, const fa_dev_tensor *v,
                          int64_t v_rows, int64_t hkv, int64_t d) {
  return fa_gpu_mma_tma_pair(maps, k, k_rows, v, v_rows, hkv, d, FA_WG_PAIR_BK);
}

#define FA_MMA_FWD(D, F16) FA_MMA_QUERY_TEAMS(fa_mma_fwd_team, blocks, D, FA_MMA_BK(D), F16, FA_MMA_FWD_SMEM(D, 1, 1))
#define FA_MMA_FWD_F32_HIGH(D)                                                                                      \
  FA_MMA_QUERY_TEAMS(fa_mma_fwd_team_f32_high, blocks, D, FA_MMA_SPLIT_BK(D), 0, FA_MMA_FWD_SMEM(D, 3, 3))
#define FA_MMA_FWD_F32_MEDIUM(D)                                                                                    \
  FA_MMA_QUERY_TEAMS(fa_mma_fwd_team_f32_medium, blocks, D, FA_MMA_SPLIT_BK(D), 0, FA_MMA_FWD_SMEM(D, 2, 2))
#define FA_WG_PAIR_FWD(D, F16)                                                                                     \
  FA_MMA_QUERY_TEAMS_OF(fa_wg_pair_fwd_team, blocks, D, FA_WG_PAIR_BK, F16, FA_WG_PAIR_FWD_SMEM(D), FA_WG_PAIR_THREADS)
#define FA_WG_PAIR_FWD_STREAM(D, F16)                                                                         \
  FA_STREAM_QUERY_TEAMS(fa_wg_pair_fwd_stream_team, D, FA_WG_PAIR_BK, F16, FA_FWD_STREAM_SMEM(FA_WG_PAIR_FWD_SMEM(D)))
#define FA_WG_PAIR_FWD_PERSISTENT(D, F16)                                                                     \
  FA_PERSISTENT_QUERY_TEAMS(fa_wg_pair_fwd_team, fa_wg_pair_fwd_ring, blocks, nblocks, D, FA_WG_PAIR_BK, F16,  \
                            FA_WG_PAIR_FWD_SMEM(D))

int fa_gpu_wg_pair_fwd_scans(const fa_plan *p) { return fa_plan_has_partial_tiles(p, FA_WG_PAIR_BK); }

#ifdef FORKATTN_HAVE_WGMMA
/* V's check (gpu_finite_check.h) into *argp->v_nonfinite: enough teams to fill the device a few
 * times over, each thread a few 16-byte chunks. Everything from args: the region captures argp
 * alone, so that it can launch directly (gpu_launch_direct.h). */
static void fa_gpu_v_check(const fa_gpu_fwd_args *g, const fa_gpu_fwd_args *argp) {
  const int dev = g->device, sms = fa_gpu_sms(dev);
  const int64_t per_team = FA_FINITE_CHECK_THREADS / (g->d / 8) * 4, want = (g->vrows * g->hkv + per_team - 1) / per_team;
  const int64_t most = (int64_t)(sms > 0 ? sms : 132) * 8;
  const int nteams = (int)(want < 1 ? 1 : want < most ? want : most);
  FA_TEAMS_LAUNCH(FA_FINITE_CHECK_THREADS, 0,
                  fa_finite_check_team(args.v, args.vrows, args.hkv, (int)args.d, args.v.dtype == FORKATTN_DTYPE_F16,
                                       args.v_nonfinite,
                                       (int)ompx_block_id_x(), (int)ompx_grid_dim_x(), (int)ompx_thread_id_x());
                  (void)sm;);
}
#endif

void fa_gpu_mma_fwd(const fa_gpu_fwd_args *g, const fa_gpu_fwd_args *argp, int grid) {
  const int nteams = (int)(g->nblocks * g->hq), dev = g->device, f16 = g->q.dtype == FORKATTN_DTYPE_F16;
#ifdef FORKATTN_HAVE_WGMMA
  if (g->wg_pair) { /* the blocks are FA_WG_PAIR_ROWS, K's and V's maps encoded */
    if (g->v_check) fa_gpu_v_check(g, argp);
    if (grid > 0) FA_TL_LAUNCH(dev, "wg_pair_fwd", FA_MMA_BY_HEAD_DIM(FA_WG_PAIR_FWD_PERSISTENT, g->d, f16));
    else if (grid < 0) {
      grid = -grid; /* stream teams */
      FA_TL_LAUNCH(dev, "wg_pair_fwd", FA_MMA_BY_HEAD_DIM(FA_WG_PAIR_FWD_STREAM, g->d, f16));
    } else FA_TL_LAUNCH(dev, "wg_pair_fwd", FA_MMA_BY_HEAD_DIM(FA_WG_PAIR_FWD, g->d, f16));
    return;
  }
#else
  (void)grid;
#endif
  if (g->qk_pieces == 3) { /* bf16 pieces of f32 inputs */
    if (g->d == 128) FA_MMA_FWD_F32_HIGH(128);
    else FA_MMA_FWD_F32_HIGH(64);
  } else if (g->qk_pieces == 2) {
    if (g->d == 128) FA_MMA_FWD_F32_MEDIUM(128);
    else FA_MMA_FWD_F32_MEDIUM(64);
  } else {
    FA_MMA_BY_HEAD_DIM(FA_MMA_FWD, g->d, f16);
  }
}

size_t fa_gpu_mma_fwd_split_smem(int64_t d, int pieces) {
  return d == 128 ? FA_MMA_FWD_SMEM(128, pieces, pieces) : FA_MMA_FWD_SMEM(64, pieces, pieces);
}
