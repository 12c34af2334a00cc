/* The GPU backward's staged arguments, shared by its FP32 kernels
 * (gpu_segment_bwd.c) and its tensor-core kernels (gpu_tc_bwd_launch.c). Both
 * compute D = rowsum(dO * O) first, dQ by query block, dK/dV by key block
 * over its readers (units of a heavily read block summed in order by the
 * reduce kernel: deterministic, no atomics). */
#ifndef FORKATTN_GPU_BWD_H
#define FORKATTN_GPU_BWD_H
#include <stdint.h>

#include "gpu_fwd.h"
#include "gpu_stage.h"
#include "segment_attn.h"

typedef struct fa_gpu_bwd {
  fa_dev_tensor q, k, v, o, dout, dq, dk, dv;
  const float *lse;
  float *dsum;
  const fa_range *seg;
  const fa_pair *pair;
  const int64_t *qoff, *kidx;
  const fa_block *qblocks, *kblocks;
  const fa_key_unit *units;  /* dK/dV work: slices of the key blocks' readers */
  const int64_t *unit_off;   /* [nkb+1] units of each key block */
  float *part_k, *part_v;    /* [units, hkv, krows, d] partial sums, or NULL: one unit per block */
  int64_t nqb, nkb, nunits, rows, qshift, hq, hkv, d;
  int64_t krows; /* rows per key block: FA_GPU_ROWS, FA_MMA_ROWS on tensor cores, FA_WG_PAIR_ROWS (dkv_wg_pair) */
  float scale;
  fa_kept kept; /* device copy, used when has_kept */
  int has_kept;
  int device;
  const struct fa_tma_map *tma; /* device copies of Q's and dO's tensor maps: the wgmma dK/dV runs; or NULL */
  const struct fa_tma_map *kv_tma; /* K's and V's for the two-warpgroup dQ (dq_wg_pair), or NULL */
  int dq_wg_pair; /* the two-warpgroup dQ runs: qblocks of FA_WG_PAIR_ROWS rows */
  int dkv_wg_pair; /* the two-warpgroup dK/dV runs (head_dim 128): kblocks of FA_WG_PAIR_ROWS rows, tma set */
  int *work;   /* device counter of the persistent dQ's items, zeroed by the plan copy */
  int dsum_ready; /* dsum holds D before the tensor-core dQ runs (some rows' D from the inputs) */
  /* f32 inputs split into bf16 pieces for the tensor-core teams (lib/core/split_bf16.h): `pieces` per
   * input (0: none; 3 at HIGH precision, 2 at MEDIUM), views of piece 0 of q, k, v and dout, piece p of
   * input x (0 q, 1 k, 2 v, 3 dout) p * pstride[x] elements past it; q .. dout stay the f32 inputs */
  int pieces;
  fa_dev_tensor pq, pk, pv, pdo;
  int64_t pstride[4];
} fa_gpu_bwd;

/* The backward's call shape (fa_gpu_call_of): q, k, v, dout, o in; dq, dk, dv out. */
fa_gpu_call fa_gpu_bwd_call(const fa_attn_bwd *a, forkattn_memory memory);
/* Team memory of the wgmma dQ (two warpgroups) and dK/dV (key-major at head_dim 64, two
 * warpgroups at 128) at head_dim 64 and 128 (fa_gpu_caps.wg_smem). */
void fa_gpu_mma_bwd_smem(size_t dq[2], size_t dkv[2]);
/* Team memory of the mma.sync dQ and dK/dV of f32 inputs split into bf16 pieces at HIGH precision,
 * head_dim 64 and 128 (fa_gpu_caps.split_smem). */
void fa_gpu_mma_bwd_split_smem(size_t dq[2], size_t dkv[2]);
/* The tensor-core dQ and dK/dV of b; argp: b's device copy (fa_stage_array), which the kernels
 * read; grid: the dQ's persistent teams (fa_gpu_select_grid), 0 for a team an item. */
void fa_gpu_mma_dq(const fa_gpu_bwd *b, const fa_gpu_bwd *argp, int grid);
void fa_gpu_mma_dkv(const fa_gpu_bwd *b, const fa_gpu_bwd *argp);
/* The wgmma dK/dV's maps of Q and dO (boxes of its query tiles): fa_gpu_mma_tma_pair (gpu_fwd.h);
 * the two-warpgroup dQ's maps of K and V are the forward's (fa_gpu_wg_pair_kv_tma). */
int fa_gpu_mma_dkv_tma(struct fa_tma_map *maps, const fa_dev_tensor *q, int64_t q_rows, const fa_dev_tensor *dout,
                       int64_t dout_rows, int64_t hq, int64_t d);

#endif
