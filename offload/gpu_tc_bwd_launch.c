/* Launches of the tensor-core backward of segment attention (the mma.sync and
 * wgmma teams of gpu_bwd_teams.h), for bf16/f16 and f32 split into bf16
 * pieces (the mma.sync split teams), head_dim 64 or 128; the same
 * plan, blocks, key units and reduce as the FP32 backward (gpu_segment_bwd.c).
 *
 * dQ: a team owns 64 query rows of one query head (4 warps x 16 rows, Q and
 * dO fragments in registers) and walks its key tiles like the forward:
 * S = Q K^T and dP = dO V^T (K and V through the same ldmatrix map),
 * P = exp2(S - lse) in log2 units, dS = P (dP - D), dQ += dS K with dS packed
 * from the accumulators and K through ldmatrix.trans.
 *
 * dK/dV: a team owns a unit of one key block (64 keys, 4 warps x 16 keys, K
 * fragments in registers; V fragments too at head_dim 64, V in team memory at
 * 128) and one KV head, and walks the unit's reader queries in tiles of 32
 * (FA_MMA_BQ; 16 at head_dim 128) for each query head of the group:
 * S^T = K Q^T, dP^T = V dO^T, P^T and dS^T as above with lse and D per
 * column, dV += P^T dO and dK += dS^T Q (Q and dO through ldmatrix.trans).
 * Q/dO tiles are double-buffered with cp.async. No atomics: each key block's
 * units are summed in order afterwards.
 *
 * sm_90a builds run wgmma teams instead when the context's choice
 * (gpu_select.h) says so (gpu_bwd_teams.h): the dQ as two warpgroups
 * (fa_wg_pair_dq_team), the dK/dV at head_dim 128 query-major (the queries as the
 * products' rows, P and dS through team memory) as two warpgroups of a
 * 128-key block (fa_wg_pair_dkv_query_major_team), at 64 key-major (fa_wg_dkv_team); all
 * with their tiles by bulk tensor copies. */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_bwd.h"
#include "gpu_mma.h"
#include "gpu_bwd_teams.h"
#include "gpu_mma_tiles.h"
#include "gpu_wgmma.h"

fa_gpu_call fa_gpu_bwd_call(const fa_attn_bwd *a, forkattn_memory memory) {
  /* o too: the dQ teams read it in 16-byte chunks for D */
  const forkattn_tensor *in[5] = {&a->q, &a->k, &a->v, &a->dout, &a->o}, *out[3] = {&a->dq, &a->dk, &a->dv};
  return fa_gpu_call_of(in, 5, out, 3, a->d, a->kept != NULL, a->plan, memory);
}

void fa_gpu_mma_bwd_smem(size_t dq[2], size_t dkv[2]) {
  dq[0] = FA_WG_PAIR_DQ_SMEM(64);
  dq[1] = FA_WG_PAIR_DQ_SMEM(128);
  dkv[0] = FA_WG_DKV_SMEM(64);       /* key-major */
  dkv[1] = FA_WG_PAIR_DKV_SMEM(128); /* two-warpgroup query-major */
}

void fa_gpu_mma_bwd_split_smem(size_t dq[2], size_t dkv[2]) {
  dq[0] = FA_MMA_DQ_SPLIT_SMEM(64, 3);
  dq[1] = FA_MMA_DQ_SPLIT_SMEM(128, 3);
  dkv[0] = FA_MMA_DKV_SPLIT_SMEM(64, 3);
  dkv[1] = FA_MMA_DKV_SPLIT_SMEM(128, 3);
}

#define FA_MMA_DQ(D, F16) \
  FA_MMA_QUERY_TEAMS(fa_mma_dq_team, qblocks, D, FA_MMA_BK(D), F16, FA_MMA_QUERY_SMEM(FA_MMA_BK(D), (D) + 8))

#define FA_WG_PAIR_DQ(D, F16) \
  FA_MMA_QUERY_TEAMS_OF(fa_wg_pair_dq_team, qblocks, D, FA_WG_PAIR_BK, F16, FA_WG_PAIR_DQ_SMEM(D), FA_WG_PAIR_THREADS)
#define FA_WG_PAIR_DQ_PERSISTENT(D, F16)                                                                      \
  FA_PERSISTENT_QUERY_TEAMS(fa_wg_pair_dq_team, fa_wg_pair_dq_ring, qblocks, nqb, D, FA_WG_PAIR_BK, F16,       \
                            FA_WG_PAIR_DQ_SMEM(D))

/* f32 inputs split into bf16 pieces: HIGH (3) or MEDIUM (2) */
#define FA_MMA_DQ_F32(D, NP)                                                                                   \
  do {                                                                                                         \
    if ((NP) == 3)                                                                                             \
      FA_MMA_QUERY_TEAMS(fa_mma_dq_team_f32_high, qblocks, D, FA_MMA_SPLIT_BK(D), 0, FA_MMA_DQ_SPLIT_SMEM(D, 3));  \
    else                                                                                                       \
      FA_MMA_QUERY_TEAMS(fa_mma_dq_team_f32_medium, qblocks, D, FA_MMA_SPLIT_BK(D), 0, FA_MMA_DQ_SPLIT_SMEM(D, 2)); \
  } while (0)
#define FA_MMA_DKV_F32(D, NP)                                                                                  \
  do {                                                                                                         \
    if ((NP) == 3)                                                                                             \
      FA_MMA_DKV_TEAMS_OF(fa_mma_dkv_team_f32_high, D, 0, FA_MMA_DKV_SPLIT_SMEM(D, 3), FA_MMA_DKV_SPLIT_THREADS); \
    else                                                                                                       \
      FA_MMA_DKV_TEAMS_OF(fa_mma_dkv_team_f32_medium, D, 0, FA_MMA_DKV_SPLIT_SMEM(D, 2), FA_MMA_DKV_SPLIT_THREADS); \
  } while (0)

void fa_gpu_mma_dq(const fa_gpu_bwd *b, const fa_gpu_bwd *argp, int grid) {
  const int nteams = (int)(b->nqb * b->hq), dev = b->device, f16 = b->q.dtype == FORKATTN_DTYPE_F16;
  if (b->pieces) {
    if (b->d == 128) FA_MMA_DQ_F32(128, b->pieces);
    else FA_MMA_DQ_F32(64, b->pieces);
    return;
  }
#ifdef FORKATTN_HAVE_WGMMA
  if (b->dq_wg_pair) { /* the query blocks are FA_WG_PAIR_ROWS, K's and V's maps encoded */
    if (grid) FA_TL_LAUNCH(dev, "wg_pair_dq", FA_MMA_BY_HEAD_DIM(FA_WG_PAIR_DQ_PERSISTENT, b->d, f16));
    else FA_TL_LAUNCH(dev, "wg_pair_dq", FA_MMA_BY_HEAD_DIM(FA_WG_PAIR_DQ, b->d, f16));
    return;
  }
#else
  (void)grid;
#endif
  FA_MMA_BY_HEAD_DIM(FA_MMA_DQ, b->d, f16);
}

#define FA_MMA_DKV(D, F16) FA_MMA_DKV_TEAMS(fa_mma_dkv_team, D, F16, FA_MMA_DKV_SMEM(D))
#define FA_WG_DKV(D, F16) FA_MMA_DKV_TEAMS(fa_wg_dkv_team, D, F16, FA_WG_DKV_SMEM(D))

#define FA_WG_PAIR_DKV(D, F16) \
  FA_MMA_DKV_TEAMS_OF(fa_wg_pair_dkv_query_major_team, D, F16, FA_WG_PAIR_DKV_SMEM(D), FA_WG_PAIR_THREADS)

int fa_gpu_mma_dkv_tma(fa_tma_map *maps, const fa_dev_tensor *q, int64_t q_rows, const fa_dev_tensor *dout,
                       int64_t dout_rows, int64_t hq, int64_t d) {
  return fa_gpu_mma_tma_pair(maps, q, q_rows, dout, dout_rows, hq, d, d == 128 ? FA_DKV_QUERY_MAJOR_BQ : FA_WG_DKV_BQ);
}

void fa_gpu_mma_dkv(const fa_gpu_bwd *b, const fa_gpu_bwd *argp) {
  const int nteams = (int)(b->nunits * b->hkv), dev = b->device, f16 = b->q.dtype == FORKATTN_DTYPE_F16;
  if (b->pieces) {
    if (b->d == 128) FA_MMA_DKV_F32(128, b->pieces);
    else FA_MMA_DKV_F32(64, b->pieces);
    return;
  }
#ifdef FORKATTN_HAVE_WGMMA
  if (b->dkv_wg_pair) { /* head_dim 128: the key blocks are FA_WG_PAIR_ROWS, Q's and dO's maps encoded */
    FA_TL_LAUNCH(dev, "wg_pair_dkv", if (f16) FA_WG_PAIR_DKV(128, 1); else FA_WG_PAIR_DKV(128, 0));
    return;
  }
  if (b->tma) { /* head_dim 64: the key-major kernel, Q's and dO's maps encoded */
    if (f16) FA_WG_DKV(64, 1);
    else FA_WG_DKV(64, 0);
    return;
  }
#endif
  FA_MMA_BY_HEAD_DIM(FA_MMA_DKV, b->d, f16);
}
