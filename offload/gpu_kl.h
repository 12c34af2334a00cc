/* GPU StreamKL's staged arguments, shared by the FP32 kernels (gpu_kl.c)
 * and the tensor-core ones (gpu_mma_kl.c). */
#ifndef FORKATTN_GPU_KL_H
#define FORKATTN_GPU_KL_H
#include <stdint.h>

#include "gpu_select.h"
#include "gpu_stage.h"
#include "segment_plan.h"
#include "streamkl.h"

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
} fa_gpu_kl;

/* A StreamKL call's shape for the kernel choice (fa_gpu_call_of): the four score tensors in
 * (all bf16 or all f16), the teacher's head_dim and whether the student's is the same, whether
 * both sides share KV heads; bwd: the four gradients out too. */
fa_gpu_call fa_gpu_kl_call(const fa_kl_call *c, forkattn_memory memory, int bwd);
void fa_gpu_mma_kl_fwd(const fa_gpu_kl *b, int dev);
/* dQ of one side (teacher != 0: the teacher's) by 64-row query block x query
 * head; dK of one side by key unit x KV head (b->part: partial sums). */
void fa_gpu_mma_kl_dq(const fa_gpu_kl *b, int teacher, int dev);
void fa_gpu_mma_kl_dk(const fa_gpu_kl *b, int teacher, int dev);

#endif
