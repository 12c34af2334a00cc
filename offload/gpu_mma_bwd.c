/* Tensor-core GPU backward of segment attention (FlashAttention-2 shape), for
 * bf16/f16 with head_dim 64 or 128; the same plan, blocks, key units and
 * reduce as the FP32 backward (gpu_segment_bwd.c), which computes D first.
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
 * units are summed in order afterwards. */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_bwd.h"
#include "gpu_mma.h"
#include "gpu_mma_bwd_team.h"
#include "gpu_mma_tiles.h"

int fa_gpu_mma_bwd_ok(const fa_attn_bwd *a, forkattn_memory memory) {
  const forkattn_tensor *t[4] = {&a->q, &a->k, &a->v, &a->dout};
  return fa_gpu_mma_ok(t, 4, a->d, a->kept != NULL, a->plan, memory);
}


#define FA_MMA_DQ(D, BK, F16) FA_MMA_QUERY_TEAMS(fa_mma_dq_team, qblocks, D, BK, F16)

void fa_gpu_mma_dq(const fa_gpu_bwd *b) {
  const fa_gpu_bwd args = *b;
  const int nteams = (int)(b->nqb * b->hq), dev = b->device;
  FA_MMA_BY_SHAPE(FA_MMA_DQ, b->d, b->q.dtype == FORKATTN_DTYPE_F16);
}

/* At head_dim 128 the dK/dV teams keep V in team memory and walk 16-query
 * tiles (FA_DKV_VSMEM: 4 products per tile, one team per unit). Built with
 * FA_MMA_DKV_FUSED=0 they run a dV and a dK pass instead (5 products), as the
 * two adjacent teams of each unit: one launch instead of two (each costs tens
 * of microseconds on the host), the heaviest units' passes both first. */
#ifndef FA_MMA_DKV_FUSED
#define FA_MMA_DKV_FUSED 1
#endif

int fa_gpu_mma_dkv_passes(int64_t d) { return d == 128 && !FA_MMA_DKV_FUSED ? 2 : 1; }

#define FA_MMA_DKV(D, F16, MODE)                                                                                   \
  do {                                                                                                        \
    const int split = (MODE) == 2, vsm = (MODE) == 1;                                                         \
    const size_t smem = FA_MMA_DKV_SMEM((D), vsm);                                                            \
    const int nteams = split ? 2 * nunit_teams : nunit_teams;                                                 \
    _Pragma("omp target teams ompx_bare num_teams(nteams) thread_limit(FA_MMA_THREADS) ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(args)") \
    {                                                                                                         \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      const int64_t team = ompx_block_id_x(), t = (MODE) == 2 ? team / 2 : team;                              \
      if ((MODE) == 0)                                                                                        \
        fa_mma_dkv_team((D), (F16), FA_DKV_K | FA_DKV_V, args, t / args.hkv, t % args.hkv, sm);               \
      else if ((MODE) == 1)                                                                                   \
        fa_mma_dkv_team((D), (F16), FA_DKV_K | FA_DKV_V | FA_DKV_VSMEM, args, t / args.hkv, t % args.hkv, sm); \
      else if (team % 2 == 0) /* team-uniform */                                                              \
        fa_mma_dkv_team((D), (F16), FA_DKV_V, args, t / args.hkv, t % args.hkv, sm);                          \
      else                                                                                                    \
        fa_mma_dkv_team((D), (F16), FA_DKV_K, args, t / args.hkv, t % args.hkv, sm);                          \
    }                                                                                                         \
  } while (0)

void fa_gpu_mma_dkv(const fa_gpu_bwd *b) {
  const fa_gpu_bwd args = *b;
  const int nunit_teams = (int)(b->nunits * b->hkv), dev = b->device, f16 = b->q.dtype == FORKATTN_DTYPE_F16;
  /* modes (compile-time: one form per kernel): 0 both in registers, 1 V in team memory, 2 two passes */
#define FA_MMA_DKV_MODE128 (FA_MMA_DKV_FUSED ? 1 : 2)
  if (b->d == 128 && f16) FA_MMA_DKV(128, 1, FA_MMA_DKV_MODE128);
  else if (b->d == 128) FA_MMA_DKV(128, 0, FA_MMA_DKV_MODE128);
  else if (f16) FA_MMA_DKV(64, 1, 0);
  else FA_MMA_DKV(64, 0, 0);
}
