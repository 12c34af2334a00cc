/* Team-level pieces of the tensor-core kernels (forward, dQ, dK/dV): the walk
 * over a query block's key tiles across its pairs, cp.async tile loads, the
 * masked score, and the scan that keeps 0 * NaN of a masked row out of the
 * tensor-core products. Everything by value (see gpu_mma.h). */
#ifndef FORKATTN_GPU_MMA_TILES_H
#define FORKATTN_GPU_MMA_TILES_H
#include <math.h>
#include <stdint.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_mma.h"
#include "gpu_stage.h"
#include "segment_plan.h"

#define FA_MMA_THREADS 128 /* 4 warps */
#define FA_MMA_MAX_D 128   /* head_dims 64 and 128 */
#define FA_MMA_MAX_BK 64   /* keys per tile: 64 at head_dim 64, 32 at 128 */
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

#pragma omp declare target
/* A team's walk over key tiles: pair pi (up to pend), tile [kb, kb + BK) of
 * the pair's visible keys [.., kend). Passed by value (see gpu_mma.h). */
typedef struct fa_tile_walk {
  int64_t pi, pend, kb, kend, causal;
} fa_tile_walk;

/* First tile at or after pair w.pi whose pair sees keys (w.pi == w.pend: done). */
static inline fa_tile_walk fa_walk_seek(fa_tile_walk w, const fa_range *seg, const fa_pair *pair, fa_block blk,
                                        int64_t qshift) {
  for (; w.pi < w.pend; w.pi++) {
    const fa_range k = fa_pair_keys(seg, pair[w.pi], blk.start, blk.len, qshift);
    if (k.len > 0) {
      w.kb = k.start;
      w.kend = k.start + k.len;
      w.causal = pair[w.pi].causal;
      return w;
    }
  }
  return w;
}

static inline fa_tile_walk fa_walk_next(fa_tile_walk w, int bk, const fa_range *seg, const fa_pair *pair,
                                        fa_block blk, int64_t qshift) {
  w.kb += bk;
  if (w.kb < w.kend) return w;
  w.pi++;
  return fa_walk_seek(w, seg, pair, blk, qshift);
}

/* Team-cooperative cp.async of rows [row0, row0 + n) of head `head` of t
 * (n <= cap) into a cap x D tile of pitch P elements; rows n..cap-1 are
 * zero-filled (masked lanes then multiply finite zeros). */
static inline void fa_mma_load_rows(unsigned short *dst, int P, int cap, int D, fa_dev_tensor t, int64_t row0,
                                    int64_t n, int64_t head, int tid) {
  const unsigned short *src = (const unsigned short *)t.data;
  const int chunks = D / 8; /* 16-byte chunks per row */
  for (int c = tid; c < cap * chunks; c += FA_MMA_THREADS) {
    const int r = c / chunks, col = (c % chunks) * 8;
    const int in = r < n;
    fa_cp_async16(dst + r * P + col, src + (row0 + (in ? r : 0)) * t.rs + head * t.hs + col, in ? 16 : 0);
  }
}

/* Scaled, masked score in log2 units (-inf where the key is not visible). */
static inline float fa_mma_score(float s, float mul, int key, int nk, int row_ok, int causal, int64_t kb,
                                 int64_t q_pos) {
  return key < nk && row_ok && (!causal || kb + key <= q_pos) ? s * mul : -INFINITY;
}


/* Team-cooperative scan of rows [0, n) of an n x D b16 tile (n = 16, 32 or
 * 64; pitch P): non-finite elements are zeroed, and bit r of the result says
 * row r had one. flags: 4 words of team memory. Contains barriers: call from
 * every thread of the team. A masked tile's product multiplies such a row by
 * an exact 0 for the rows or keys that cannot see it; zeroing keeps that 0,
 * and the caller marks NaN the outputs that do see the row. */
static inline unsigned long long fa_mma_scan_rows(unsigned short *t, int P, int n, int D, int f16,
                                                  unsigned *flags, int tid) {
  const int tpr = FA_MMA_THREADS / n, r = tid / tpr, part = tid % tpr, span = D / tpr, lane = tid % 32;
  int bad = 0;
  for (int c = part * span; c < (part + 1) * span; c++) {
    const float x = f16 ? fa_f16_to_f32(t[r * P + c]) : fa_bf16_to_f32(t[r * P + c]);
    if (!isfinite(x)) bad = 1, t[r * P + c] = 0;
  }
  const unsigned b = fa_mma_ballot(bad); /* lanes [i*tpr, (i+1)*tpr) own row (warp)*32/tpr + i */
  if (lane == 0) {
    unsigned f = 0;
    for (int i = 0; i < 32 / tpr; i++) f |= ((b >> (i * tpr)) & ((1u << tpr) - 1u)) ? 1u << i : 0u;
    flags[tid / 32] = f;
  }
  ompx_sync_block_acq_rel();
  unsigned long long rows = 0;
  for (int w = 0; w < 4; w++) rows |= (unsigned long long)flags[w] << (w * (32 / tpr));
  ompx_sync_block_acq_rel(); /* flags may be rewritten by the next scan */
  return rows;
}
#pragma omp end declare target

#endif
