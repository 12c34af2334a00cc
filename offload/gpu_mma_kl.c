/* Tensor-core StreamKL: call shapes and launches of the forward
 * (gpu_mma_kl_team.h) and the backward's dQ and dK (gpu_mma_kl_bwd_team.h), of
 * bf16/f16 inputs and of f32 inputs split into bf16 pieces;
 * gpu_kl.c stages the arguments, sums split units and runs the FP32 kernels
 * for the other calls. */
#include <omp.h>
#include <ompx.h>

#include "gpu_fwd.h"
#include "gpu_kl.h"
#include "gpu_mma_kl_bwd_team.h"
#include "gpu_mma_kl_team.h"
#include "gpu_mma_tiles.h"

fa_gpu_call fa_gpu_kl_call(const fa_kl_call *c, forkattn_memory memory, int bwd) {
  const forkattn_tensor *in[4] = {&c->qt, &c->kt, &c->qs, &c->ks}, *out[4] = {&c->dqs, &c->dks, &c->dqt, &c->dkt};
  fa_gpu_call g = fa_gpu_call_of(in, 4, out, bwd ? 4 : 0, c->dt, c->kept != NULL, c->plan, memory);
  g.same_d = c->ds == c->dt;
  g.same_kv_heads = c->hkv_t == c->hkv_s;
  return g;
}

/* One team per (64-row query block, query head); two buffers of both sides' K tiles. */
#define FA_MMA_KL(D, F16)                                                                                      \
  do {                                                                                                        \
    const size_t smem = (size_t)(4 * FA_MMA_BK(D) * ((D) + 8)) * 2;                                           \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      fa_mma_kl_fwd_team((D), FA_MMA_BK(D), (F16), args, args.qblocks[team / args.h], team % args.h, sm);             \
    }                                                                                                         \
  } while (0)

/* The same for f32 inputs split into NP bf16 pieces (gpu_kl.h: pieces): half-size tiles, as the attention
 * forward's split teams (FA_MMA_SPLIT_BK). */
#define FA_MMA_KL_SPLIT(D, TEAM, NP)                                                                            \
  do {                                                                                                        \
    const size_t smem = FA_MMA_KL_FWD_SMEM(D, FA_MMA_SPLIT_BK(D), NP);                                         \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      TEAM((D), FA_MMA_SPLIT_BK(D), 0, args, args.qblocks[team / args.h], team % args.h, sm);                  \
    }                                                                                                         \
  } while (0)

/* LAUNCH(D, TEAM, NP) for b's split inputs: HIGH's team (3 pieces) or MEDIUM's (2), at b's head_dim. */
#define FA_MMA_KL_BY_PIECES(LAUNCH, HIGH, MEDIUM)                                                               \
  do {                                                                                                        \
    if (b->pieces == 3 && b->dt == 128) LAUNCH(128, HIGH, 3);                                                  \
    else if (b->pieces == 3) LAUNCH(64, HIGH, 3);                                                              \
    else if (b->dt == 128) LAUNCH(128, MEDIUM, 2);                                                             \
    else LAUNCH(64, MEDIUM, 2);                                                                                \
  } while (0)

void fa_gpu_mma_kl_fwd(const fa_gpu_kl *b, int dev) {
  const fa_gpu_kl args = *b;
  const int nteams = (int)(b->nqb * b->h);
  if (nteams == 0) return;
  if (b->pieces > 1) FA_MMA_KL_BY_PIECES(FA_MMA_KL_SPLIT, fa_mma_kl_fwd_team_f32_high, fa_mma_kl_fwd_team_f32_medium);
  else FA_MMA_BY_HEAD_DIM(FA_MMA_KL, b->dt, b->qt.dtype == FORKATTN_DTYPE_F16);
}

size_t fa_gpu_mma_kl_fwd_split_smem(int64_t d, int pieces) {
  return d == 128 ? FA_MMA_KL_FWD_SMEM(128, FA_MMA_SPLIT_BK(128), pieces)
                  : FA_MMA_KL_FWD_SMEM(64, FA_MMA_SPLIT_BK(64), pieces);
}

/* One team per (64-row query block, query head), as the forward. */
#define FA_MMA_KL_DQ(D, F16)                                                                                   \
  do {                                                                                                        \
    const size_t smem = FA_MMA_KL_DQ_SMEM((D), FA_MMA_BK(D));                                                  \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args, teacher)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      fa_mma_kl_dq_team((D), FA_MMA_BK(D), (F16), args, args.qblocks[team / args.h], team % args.h, teacher, sm);     \
    }                                                                                                         \
  } while (0)

/* The same for f32 inputs split into NP bf16 pieces (gpu_kl.h: pieces), FA_MMA_SPLIT_BK tiles. */
#define FA_MMA_KL_DQ_SPLIT(D, TEAM, NP)                                                                         \
  do {                                                                                                        \
    const size_t smem = FA_MMA_KL_DQ_SPLIT_SMEM(D, NP);                                                        \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args, teacher)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      TEAM((D), FA_MMA_SPLIT_BK(D), args, args.qblocks[team / args.h], team % args.h, teacher, sm);           \
    }                                                                                                         \
  } while (0)

void fa_gpu_mma_kl_dq(const fa_gpu_kl *b, int teacher, int dev) {
  const fa_gpu_kl args = *b;
  const int nteams = (int)(b->nqb * b->h);
  if (nteams == 0) return;
  if (b->pieces > 1) FA_MMA_KL_BY_PIECES(FA_MMA_KL_DQ_SPLIT, fa_mma_kl_dq_team_f32_high, fa_mma_kl_dq_team_f32_medium);
  else FA_MMA_BY_HEAD_DIM(FA_MMA_KL_DQ, b->dt, b->qt.dtype == FORKATTN_DTYPE_F16);
}

/* One team per (key unit, KV head). */
#define FA_MMA_KL_DK(D, F16)                                                                                   \
  do {                                                                                                        \
    const size_t smem = FA_MMA_KL_DK_SMEM(D);                                                                  \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args, teacher)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      fa_mma_kl_dk_team((D), (F16), args, team / args.hkv_t, team % args.hkv_t, teacher, sm);                 \
    }                                                                                                         \
  } while (0)

#define FA_MMA_KL_DK_SPLIT(D, TEAM, NP)                                                                         \
  do {                                                                                                        \
    const size_t smem = FA_MMA_KL_DK_SPLIT_SMEM(D, NP);                                                        \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args, teacher)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      TEAM((D), args, team / args.hkv_t, team % args.hkv_t, teacher, sm);                                     \
    }                                                                                                         \
  } while (0)

void fa_gpu_mma_kl_dk(const fa_gpu_kl *b, int teacher, int dev) {
  const fa_gpu_kl args = *b;
  const int nteams = (int)(b->nunits * b->hkv_t), f16 = b->qt.dtype == FORKATTN_DTYPE_F16;
  if (nteams == 0) return;
  if (b->pieces > 1) FA_MMA_KL_BY_PIECES(FA_MMA_KL_DK_SPLIT, fa_mma_kl_dk_team_f32_high, fa_mma_kl_dk_team_f32_medium);
  else FA_MMA_BY_HEAD_DIM(FA_MMA_KL_DK, b->dt, f16);
}

size_t fa_gpu_mma_kl_bwd_split_smem(int64_t d) {
  const size_t dq = d == 128 ? FA_MMA_KL_DQ_SPLIT_SMEM(128, 3) : FA_MMA_KL_DQ_SPLIT_SMEM(64, 3);
  const size_t dk = d == 128 ? FA_MMA_KL_DK_SPLIT_SMEM(128, 3) : FA_MMA_KL_DK_SPLIT_SMEM(64, 3);
  return dq > dk ? dq : dk;
}
