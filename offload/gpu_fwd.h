/* The GPU forward's staged arguments, shared by its kernels: the FP32
 * CUDA-core kernel (any dtype, head_dim, stride, kept set: gpu_segment_fwd.c)
 * and the tensor-core kernels (bf16/f16, head_dim 64 or 128: gpu_tc_fwd_launch.c). */
#ifndef FORKATTN_GPU_FWD_H
#define FORKATTN_GPU_FWD_H
#include <stdint.h>

#include "gpu_select.h"
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
  const struct fa_tma_map *tma; /* device copies of K's and V's tensor maps (gpu_tma.h) for the wgmma kernel */
  int wg_pair; /* the two-warpgroup wgmma kernel runs: blocks of FA_WG_PAIR_ROWS, tma set */
  int *work; /* device counter of a persistent launch's items, zeroed by the plan copy */
  /* f32 inputs split into bf16 pieces (lib/core/split_bf16.h): q and k in qk_pieces, v in v_pieces,
   * piece p of input x (q, k, v) p * pstride[x] elements past piece 0; 1 and 1: the inputs as they are */
  int qk_pieces, v_pieces;
  int64_t pstride[3];
  const fa_block_item *items; /* device copy of the blocks' items (fa_plan_block_items_memo): stream teams */
  /* two-warpgroup kernel: a device flag, 1 when V may hold a non-finite element (the tiles that hide
   * keys are scanned), 0 when V's check (v_check, gpu_finite_check.h) found none; NULL: 1 */
  int *v_nonfinite;
  int v_check;   /* V's check runs before the kernel and sets *v_nonfinite (which starts at 0) */
  int64_t vrows; /* V's rows, for its check */
} fa_gpu_fwd_args;

/* Query rows per team of the tensor-core forward (16 per warp, 4 warps). */
#define FA_MMA_ROWS 64
/* Query rows per team of the two-warpgroup wgmma kernels (64 per warpgroup); keys per team of their dK/dV. */
#define FA_WG_PAIR_ROWS 128

/* The shape of a call with inputs in[0..nin) and outputs out[0..nout) (NULL data: absent) as the
 * kernel choice sees it (gpu_select.h): dtypes (all bf16 or all f16, that of in[0]), head_dim d,
 * a kept set, 16-byte rows in device memory (host tensors are staged dense; outputs as
 * fa_gpu_mma_out_ok in gpu_mma_tiles.h asks), plan positions in 32 bits (fa_mma_plan_fits). */
fa_gpu_call fa_gpu_call_of(const forkattn_tensor *const *in, int nin, const forkattn_tensor *const *out, int nout,
                           int64_t d, int has_kept, const fa_plan *plan, forkattn_memory memory);
/* The forward's: q, k, v in, o out. */
fa_gpu_call fa_gpu_fwd_call(const fa_attn_fwd *a, forkattn_memory memory);
/* 1 when the two-warpgroup forward's walk of p meets key tiles it scans for non-finite V rows
 * (fa_plan_has_partial_tiles at its tile size): then V's check runs first (fa_gpu_fwd_args.v_check). */
int fa_gpu_wg_pair_fwd_scans(const fa_plan *p);
/* Team memory of the two-warpgroup wgmma forward at head_dim 64 and 128 (fa_gpu_caps.wg_smem). */
void fa_gpu_mma_fwd_smem(size_t smem[2]);
/* The tensor-core forward of g; argp: g's device copy (fa_stage_array), which the kernels read;
 * grid (fa_gpu_select_grid): n > 0 persistent teams of the two-warpgroup kernel, -n its n stream teams, 0 a
 * team an item. */
void fa_gpu_mma_fwd(const fa_gpu_fwd_args *g, const fa_gpu_fwd_args *argp, int grid);
/* Team memory of the mma.sync forward of f32 inputs split into `pieces` bf16 pieces each (3: HIGH,
 * 2: MEDIUM), at head_dim d (64 or 128). */
size_t fa_gpu_mma_fwd_split_smem(int64_t d, int pieces);
/* 1 when the driver encoded the tensor maps of a and b (device views of [rows][heads][d]) into
 * maps[0], maps[1], boxes of box_rows rows: the wgmma kernels' bulk tensor copies. */
int fa_gpu_mma_tma_pair(struct fa_tma_map *maps, const fa_dev_tensor *a, int64_t a_rows, const fa_dev_tensor *b,
                        int64_t b_rows, int64_t heads, int64_t d, int box_rows);
/* The maps of K and V in 128-key boxes that the two-warpgroup forward and dQ load:
 * fa_gpu_mma_tma_pair. */
int fa_gpu_wg_pair_kv_tma(struct fa_tma_map *maps, const fa_dev_tensor *k, int64_t k_rows, const fa_dev_tensor *v,
                          int64_t v_rows, int64_t hkv, int64_t d);

#endif
