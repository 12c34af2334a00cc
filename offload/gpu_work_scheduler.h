/* How a kernel maps work to teams: one team an item (FA_MMA_QUERY_TEAMS_OF:
 * item = query block x query head; FA_MMA_DKV_TEAMS_OF: key unit x KV head;
 * from the team number) or, query side, persistent teams that fetch items
 * from a counter (FA_PERSISTENT_QUERY_TEAMS; when: gpu_persist.h), or
 * teams that each run a fixed share of the items (FA_STREAM_QUERY_TEAMS). A query
 * team function has the signature TEAM(D, BK, F16, args, block, h, g, smem),
 * a dK/dV one TEAM(D, F16, args, unit, g, smem). */
#ifndef FORKATTN_GPU_WORK_SCHEDULER_H
#define FORKATTN_GPU_WORK_SCHEDULER_H
#include <ompx.h>

#include "gpu_launch_direct.h"

#define FA_MMA_PRAGMA(x) _Pragma(#x)
/* The target region of GRID teams of THREADS threads (a constant: the
 * kernel's launch bound) and SMEM bytes of team memory (GRID, SMEM:
 * variables) on device `dev`, each running the statements after SMEM with
 * `args` (the call's arguments) and `sm` (its team memory) in scope. Needs
 * `argp` (a device copy of the call's arguments, staged with the plan so
 * that its copy rides on the launch: gpu_launch_copy.h; the kernels read
 * their arguments from device memory either way, firstprivate's copy
 * costing the runtime one more) and `dev` in scope. argp is the region's
 * one captured variable (Clang adds GRID's value), so that the launch can go
 * straight to the driver (gpu_launch_direct.h). */
#define FA_TEAMS_REGION(GRID, THREADS, SMEM, ...)                                                             \
  FA_DIRECT_OR_RUNTIME(GRID, THREADS, SMEM,                                                                   \
    FA_MMA_PRAGMA(omp target teams ompx_bare num_teams(GRID) thread_limit(THREADS) ompx_dyn_cgroup_mem(SMEM) device(dev) is_device_ptr(argp)) \
    {                                                                                                         \
      const __typeof__(*argp) args = *argp;                                                                   \
      unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();                          \
      __VA_ARGS__                                                                                             \
    })
/* FA_TEAMS_REGION of `nteams` teams (in scope) and SMEM bytes. Team indices
 * are 32-bit: a 64-bit division is a subroutine call, which makes ptxas
 * serialize wgmma. */
#define FA_TEAMS_LAUNCH(THREADS, SMEM, ...)                                                                   \
  do {                                                                                                        \
    const size_t smem = (SMEM);                                                                               \
    FA_TEAMS_REGION(nteams, THREADS, smem, __VA_ARGS__);                                                      \
  } while (0)
/* TEAM(D, BK, F16, args, block, h, g, smem) on one team per (query block of
 * args.BLOCKS, query head): FA_TEAMS_LAUNCH. FA_MMA_QUERY_TEAMS:
 * FA_MMA_THREADS. */
#define FA_MMA_QUERY_TEAMS_OF(TEAM, BLOCKS, D, BK, F16, SMEM, THREADS)                                          \
  FA_TEAMS_LAUNCH(THREADS, SMEM, const int team = (int)ompx_block_id_x(), hq = (int)args.hq, h = team % hq;    \
                  TEAM((D), (BK), (F16), args, args.BLOCKS[team / hq], h, h / (hq / (int)args.hkv), sm);)
#define FA_MMA_QUERY_TEAMS(TEAM, BLOCKS, D, BK, F16, SMEM)                                                      \
  FA_MMA_QUERY_TEAMS_OF(TEAM, BLOCKS, D, BK, F16, SMEM, FA_MMA_THREADS)
/* TEAM(D, F16, args, unit, KV head, smem) on one team per (key unit, KV
 * head): FA_TEAMS_LAUNCH. FA_MMA_DKV_TEAMS: FA_MMA_THREADS. */
#define FA_MMA_DKV_TEAMS_OF(TEAM, D, F16, SMEM, THREADS)                                                        \
  FA_TEAMS_LAUNCH(THREADS, SMEM, const int team = (int)ompx_block_id_x(), hkv = (int)args.hkv;                 \
                  TEAM((D), (F16), args, team / hkv, team % hkv, sm);)
#define FA_MMA_DKV_TEAMS(TEAM, D, F16, SMEM) FA_MMA_DKV_TEAMS_OF(TEAM, D, F16, SMEM, FA_MMA_THREADS)

/* Bytes of team memory past a team's SMEM for a persistent launch's two
 * next-item slots. */
#define FA_PERSIST_NEXT_AT(SMEM) (((SMEM) + 15) / 16 * 16)
/* A persistent launch of a two-warpgroup query-side team (as
 * FA_MMA_QUERY_TEAMS_OF, with `grid` teams from the caller, at most one
 * an SM): each team runs items (query block x query head, heaviest blocks
 * first) from args.work, a counter the call's plan copy zeroes: its first
 * item is its team number, the next fetched by thread 0 when an item
 * starts (into a slot of the item's parity, read after the item's closing
 * barrier, so the atomic's latency hides under the item). RING(D, BK,
 * smem) names the team's ring, whose mbarriers are invalidated before the
 * team initialises them again. */
#define FA_PERSISTENT_QUERY_TEAMS(TEAM, RING, BLOCKS, NBLOCKS, D, BK, F16, SMEM)                                 \
  do {                                                                                                        \
    const size_t smem = FA_PERSIST_NEXT_AT(SMEM) + 16;                                                         \
    FA_TEAMS_REGION(grid, FA_WG_PAIR_THREADS, smem,                                                           \
      volatile int *next = (volatile int *)((char *)sm + FA_PERSIST_NEXT_AT(SMEM));                            \
      unsigned short *al = sm + fa_wg_align(fa_smem_of(sm));                                                  \
      const int hq = (int)args.hq, n = (int)args.NBLOCKS * hq, tid = ompx_thread_id_x();                      \
      const int step = (int)ompx_grid_dim_x();                                                               \
      int item = (int)ompx_block_id_x();                                                                      \
      for (int it = 0; item < n; it++) {                                                                      \
        if (tid == 0) {                                                                                       \
          next[it & 1] = __atomic_fetch_add(args.work, 1, __ATOMIC_RELAXED) + step;                           \
          if (it > 0) fa_tile_ring_inval(fa_smem_of(al), RING((D), (BK), al));                                 \
        }                                                                                                     \
        const int h = item % hq;                                                                              \
        TEAM((D), (BK), (F16), args, args.BLOCKS[item / hq], h, h / (hq / (int)args.hkv), sm);                \
        ompx_sync_block_acq_rel(); /* the item's team memory and its next slot */                             \
        item = next[it & 1];                                                                                  \
      });                                                                                                     \
  } while (0)

/* A launch of `grid` (from the caller, at most one an SM) two-warpgroup
 * teams that each run TEAM(D, BK, F16, args, team, grid, smem): a team
 * that takes its share of the items itself, in a fixed order (the
 * forward's stream team, gpu_fwd_stream_team.h). No counter: a CUDA
 * graph's replays run it as the capture did. */
#define FA_STREAM_QUERY_TEAMS(TEAM, D, BK, F16, SMEM)                                                            \
  do {                                                                                                        \
    const size_t smem = (SMEM);                                                                               \
    FA_TEAMS_REGION(grid, FA_WG_PAIR_THREADS, smem,                                                           \
      TEAM((D), (BK), (F16), args, (int)ompx_block_id_x(), (int)ompx_grid_dim_x(), sm););                     \
  } while (0)

#endif
