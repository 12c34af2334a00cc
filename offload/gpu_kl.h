/* GPU StreamKL's staged arguments, shared by the FP32 kernels (gpu_kl.c)
 * and the tensor-core ones (gpu_mma_kl.c). */
#ifndef FORKATTN_GPU_KL_H
#define FORKATTN_GPU_KL_H
#include <stdint.h>

#include "gpu_select.h"
#include "gpu_stage.h"
#include "segment_plan.h"
#include "streamkl.h"

/* A lane's StreamKL state (fa_kl_state, online_kl.h) from another lane,
 * field by field through SHFL(x, ARG): the FP32 kernels' segment shuffle
 * (gpu_kl.c) and the tensor-core teams' quad shuffle (gpu_mma_kl_team.h). */
#define FA_KL_STATE_SHFL(S, SHFL, ARG)                                                                          \
  ((fa_kl_state){.mt = SHFL((S).mt, ARG), .lt = SHFL((S).lt, ARG), .ms = SHFL((S).ms, ARG),                       \
                 .ls = SHFL((S).ls, ARG), .a = SHFL((S).a, ARG), .b = SHFL((S).b, ARG)})

/* One call's device views and launch sizes. */
typedef struct fa_gpu_kl {
  fa_dev_tensor qt, kt, qs, ks, dqs, dks, dqt, dkt;
  const fa_range *seg;
  const fa_pair *pair;
  const int64_t *qoff, *kidx, *unit_off;
  const fa_block *qblocks, *kblocks;
  const fa_key_unit *units;
  float *part; /* [units, hkv, krows, d] partial dK of one side, or NULL: one unit per block */
  float *kl, *stats, *outside;
  const float *stats_in, *dkl;
  fa_kept kept; /* device copy, used when has_kept */
  int has_kept, reverse, teacher_grad;
  int64_t nqb, nkb, nunits, h, hkv_t, hkv_s, dt, ds;
  int64_t krows; /* rows per query and key block: FA_GPU_ROWS, or FA_MMA_ROWS on tensor cores */
  float st, ss, loss_mul;
  /* f32 inputs split into bf16 pieces (lib/core/split_bf16.h) for the tensor-core teams: qt, kt, qs, ks
   * in `pieces` pieces each (0 or 1: as they are), piece p of input x p * pstride[x] elements past piece 0 */
  int pieces;
  int64_t pstride[4];
} fa_gpu_kl;

/* A StreamKL call's shape for the kernel choice (fa_gpu_call_of): the four score tensors in
 * (all bf16 or all f16), the teacher's head_dim and whether the student's is the same, whether
 * both sides share KV heads; bwd: the four gradients out too. */
fa_gpu_call fa_gpu_kl_call(const fa_kl_call *c, forkattn_memory memory, int bwd);
void fa_gpu_mma_kl_fwd(const fa_gpu_kl *b, int dev);
/* Team memory of the StreamKL forward of f32 inputs split into `pieces` bf16 pieces at head_dim d. */
size_t fa_gpu_mma_kl_fwd_split_smem(int64_t d, int pieces);
/* Team memory of the StreamKL backward's dQ and dK teams of f32 inputs split into three bf16 pieces
 * (HIGH precision; MEDIUM needs less) at head_dim d, the larger of the two. */
size_t fa_gpu_mma_kl_bwd_split_smem(int64_t d);
/* dQ of one side (teacher != 0: the teacher's) by 64-row query block x query
 * head; dK of one side by key unit x KV head (b->part: partial sums). */
void fa_gpu_mma_kl_dq(const fa_gpu_kl *b, int teacher, int dev);
void fa_gpu_mma_kl_dk(const fa_gpu_kl *b, int teacher, int dev);

#endif
