/* The key-tile step the FP32 query-side kernels share (the forward of
 * gpu_segment_fwd.c, the dQ of gpu_segment_bwd.c): a team walks the pairs
 * of its query block's segment and, per pair, its keys in tiles of bk; each
 * tile the kept set does not drop comes into team memory here. */
#ifndef FORKATTN_GPU_SEGMENT_WALK_H
#define FORKATTN_GPU_SEGMENT_WALK_H
#include <stdint.h>
#include <ompx.h>

#include "gpu_fwd.h"
#include "gpu_tiles.h"
#include "kept_mask.h"

#pragma omp declare target
/* By every thread of the team: key tile [kb, kb + nk) of KV head g for
 * query head h and block blk. 0 when kept set kp (NULL: none) drops all of
 * it for the block (team-uniform: the caller skips the tile); otherwise its
 * K and V rows into the team's tiles Ks and Vs (bk rows, pitch floats
 * apart), visible to the whole team, and 1. */
static inline __attribute__((always_inline)) int fa_seg_key_tile(float *Ks, float *Vs, int64_t pitch, int64_t bk,
                                                                 const fa_dev_tensor *k, const fa_dev_tensor *v,
                                                                 const fa_kept *kp, const fa_block *blk, int64_t h,
                                                                 int64_t g, int64_t kb, int64_t nk, int64_t d,
                                                                 int tid) {
  if (fa_kept_tile_dropped(kp, h, h + 1, blk->start, blk->len, kb, nk)) return 0;
  fa_gpu_load_tile(Ks, pitch, bk, *k, kb, nk, g, d, 1.0f, tid);
  fa_gpu_load_tile(Vs, pitch, bk, *v, kb, nk, g, d, 1.0f, tid);
  ompx_sync_block_acq_rel();
  return 1;
}
#pragma omp end declare target

#endif
