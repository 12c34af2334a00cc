/* Tensor-core StreamKL forward: eligibility and launch (the team function is
 * gpu_mma_kl_team.h). The backward stays on gpu_kl.c's FP32 kernels: it reads
 * the same statistics. */
#include <omp.h>
#include <ompx.h>

#include "gpu_fwd.h"
#include "gpu_kl.h"
#include "gpu_mma_kl_team.h"
#include "gpu_mma_tiles.h"

int fa_gpu_mma_kl_ok(const fa_kl_call *c, forkattn_memory memory) {
  const forkattn_tensor *t[4] = {&c->qt, &c->kt, &c->qs, &c->ks};
  return c->ds == c->dt && fa_gpu_mma_ok(t, 4, c->dt, c->kept != NULL, c->plan, memory);
}

/* One team per (64-row query block, query head); two buffers of both sides' K tiles. */
#define FA_MMA_KL(D, BK, F16)                                                                                  \
  do {                                                                                                        \
    const size_t smem = (size_t)(4 * (BK) * ((D) + 8)) * 2;                                                   \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x();                                                                 \
      fa_mma_kl_fwd_team((D), (BK), (F16), args, args.qblocks[team / args.h], team % args.h, sm);             \
    }                                                                                                         \
  } while (0)

void fa_gpu_mma_kl_fwd(const fa_gpu_kl *b, int dev) {
  const fa_gpu_kl args = *b;
  const int nteams = (int)(b->nqb * b->h);
  if (nteams == 0) return;
  FA_MMA_BY_SHAPE(FA_MMA_KL, b->dt, b->qt.dtype == FORKATTN_DTYPE_F16);
}
