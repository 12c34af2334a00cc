/* The GPU forward's staged arguments, shared by its two kernels: the FP32
 * CUDA-core kernel (any dtype, head_dim, stride, kept set: gpu_segment_fwd.c)
 * and the tensor-core kernel (bf16/f16, head_dim 64 or 128: gpu_mma_fwd.c). */
#ifndef FORKATTN_GPU_FWD_H
#define FORKATTN_GPU_FWD_H
#include <stdint.h>

#include "gpu_stage.h"
#include "segment_attn.h"

struct fa_tma_map;

typedef struct fa_gpu_fwd_args {
  fa_dev_tensor q, k, v, o; /* device views */
  float *lse;               /* device [rows, hq] or NULL */
  const fa_range *seg;      /* device copies of the plan */
  const fa_pair *pair;
  const int64_t *qoff;
  const fa_block *blocks; /* query blocks, heaviest first */
  int64_t nblocks, hq, hkv, d, qshift;
  float scale;
  fa_kept kept; /* device copy (maps staged) */
  int has_kept;
  int device;
  const struct fa_tma_map *tma; /* device copies of K's and V's tensor maps (gpu_tma.h), or NULL: cp.async */
  int wg2; /* blocks of FA_WG2_ROWS for the two-warpgroup wgmma kernel (fa_gpu_mma_fwd_tma) */
  int *work; /* device counter of a persistent launch's items, zeroed by the plan copy */
} fa_gpu_fwd_args;

/* Query rows per team of the tensor-core forward (16 per warp, 4 warps). */
#define FA_MMA_ROWS 64
/* Query rows per team of the two-warpgroup wgmma forward (64 per warpgroup). */
#define FA_WG2_ROWS 128
/* Keys per tile of the wgmma forward (its S is one m64n64 product a k-step). */
#define FA_WG_BK 64

/* 1 when the tensor-core forward runs this call: FORKATTN_GPU_MMA is not 0
 * in the environment, q, k, v all bf16 or
 * all f16, head_dim 64 or 128, no kept set, 16-byte aligned rows in device
 * memory (host tensors are staged dense), o as fa_gpu_mma_out_ok (gpu_mma_tiles.h) asks. */
int fa_gpu_mma_fwd_ok(const fa_attn_fwd *a, forkattn_memory memory);
/* The shared rule: tensors t[0..n) all bf16 or all f16 (the dtype of t[0])
 * and, in device memory, 16-byte aligned rows; head_dim d; no kept set; the
 * plan's rows (with qshift) and pairs below FA_MMA_MAX_POS (32-bit walks). */
int fa_gpu_mma_ok(const forkattn_tensor *const *t, int n, int64_t d, int has_kept, const fa_plan *plan,
                  forkattn_memory memory);
/* The tensor-core forward of g; argp: g's device copy (fa_stage_array), which the kernels read. */
void fa_gpu_mma_fwd(const fa_gpu_fwd_args *g, const fa_gpu_fwd_args *argp);
/* 1 when a tensor-core launch of a call that passes fa_gpu_mma_ok takes its
 * wgmma kernel (team memory `smem`) with bulk tensor copies (sm_90a build,
 * device team memory, FORKATTN_GPU_TMA not 0) and the driver encoded the
 * tensor maps of a and b (device views of [rows][heads][d]) into maps[0],
 * maps[1], boxes of box_rows rows: the forward's K and V, the dK/dV's Q and
 * dO. A shape the driver refuses keeps the cp.async loads. */
int fa_gpu_mma_tma_pair(struct fa_tma_map *maps, const fa_dev_tensor *a, int64_t a_rows, const fa_dev_tensor *b,
                        int64_t b_rows, int64_t heads, int64_t d, int box_rows, size_t smem, int device);
/* 1 unless FORKATTN_GPU_WG2=0 asks for the one-warpgroup wgmma kernels
 * instead of the two-warpgroup forward and dQ. Host code. */
int fa_gpu_wg2_on(void);
/* Teams of a persistent launch of nteams items (the two-warpgroup forward and dQ): one an SM, at
 * most nteams; 0 for a team an item (gpu_persist.h's choice; FORKATTN_GPU_PERSIST=0 or 1 forces
 * either, n > 1 persistent teams, at most n). */
int fa_gpu_persist_grid(int device, int nteams);
/* The wgmma forward's tensor maps of K and V (fa_gpu_mma_tma_pair): for the
 * two-warpgroup kernel (gpu_mma_fwd_team.h: 128-row blocks, 128-key tiles;
 * *wg2 = 1) when FORKATTN_GPU_WG2 is not 0 and its team memory fits, else
 * for the one-warpgroup kernel (64-key tiles). 0: no maps (cp.async loads). */
int fa_gpu_mma_fwd_tma(struct fa_tma_map *maps, const fa_dev_tensor *k, int64_t k_rows, const fa_dev_tensor *v,
                       int64_t v_rows, int64_t hkv, int64_t d, int device, int *wg2);

#endif
