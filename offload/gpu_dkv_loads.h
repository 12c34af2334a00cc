/* The dK/dV teams' producer side: query tiles (Q and dO rows, their lse
 * and D) into team memory, by cp.async (fa_mma_load_queries,
 * fa_mma_load_query_stats, fa_wg_dkv_start: the key-major teams) or, for
 * the two-warpgroup query-major team, from the tile ring of
 * gpu_tile_ring.h with lse and D read into registers a tile ahead
 * (fa_wg_pair_dkv_stats, fa_wg_pair_dkv_scan, fa_wg_pair_dkv_next). The query side's
 * K/V tiles come through gpu_mma_tiles.h (cp.async) and gpu_tile_ring.h
 * (bulk tensor copies). */
#ifndef FORKATTN_GPU_DKV_LOADS_H
#define FORKATTN_GPU_DKV_LOADS_H
#include <stdint.h>

#include "gpu_bwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_tile_ring.h"
#include "gpu_tma.h"

#pragma omp declare target
/* Queries of tile w (BQ of them): fa_mma_load_queries copies Q, dO rows and
 * their lse and D into buffer `at` (Q [BQ][P], dO [BQ][P]) and the float
 * pair at element `ld` ([BQ] lse, [BQ] D), fa_mma_load_query_stats only lse
 * and D (the rows come by bulk tensor copies), all by cp.async in the
 * caller's copy group: a plain load there stalled its warp for a memory
 * latency per tile, and the team with it at the next barrier (ncu: a fifth
 * of the kernel's samples). lse stays in natural-log units; the reader
 * scales it. */
static inline void fa_mma_load_query_stats(fa_smem m, int ld, int BQ, const fa_gpu_bwd *b, fa_query_walk w,
                                           int64_t h, int tid) {
  const int nq = fa_qwalk_rows(w, BQ);
  if (tid < 2 * BQ) { /* visible to the team after the wait and barrier that precede its use */
    const int i = tid % BQ, in = i < nq;
    const float *src = (tid < BQ ? b->lse : b->dsum) + ((int64_t)w.qb + (in ? i : 0)) * b->hq + h;
    fa_cp_async4(m, ld + 2 * tid, src, in ? 4 : 0); /* zero-filled past the tile's queries */
  }
}

static inline void fa_mma_load_queries(fa_smem m, int at, int ld, int P, int D, int BQ, const fa_gpu_bwd *b,
                                       fa_query_walk w, int64_t h, int tid) {
  const int nq = fa_qwalk_rows(w, BQ);
  fa_mma_load_rows(m, at, P, BQ, D, b->q, w.qb, nq, h, tid);
  fa_mma_load_rows(m, at + BQ * P, P, BQ, D, b->dout, w.qb, nq, h, tid);
  fa_mma_load_query_stats(m, ld, BQ, b, w, h, tid);
}

/* A wgmma dK/dV team's start: its unit's K and V tiles (64 rows, the wgmma
 * layout, at elements ktile and vtile) and its first query tile (buffer
 * qbuf0, lse and D at ld0) by cp.async in one committed group; returns the
 * walk at that tile (w.j > u.j1: the unit has none). */
static inline __attribute__((always_inline)) fa_query_walk fa_wg_dkv_start(fa_smem sm, int ktile, int vtile, int qbuf0,
                                                                           int ld0, int D, int BQ, const fa_gpu_bwd *b,
                                                                           fa_key_unit u, fa_block blk, int64_t g,
                                                                           int64_t group, int tid) {
  fa_mma_load_rows(sm, ktile, D, FA_MMA_ROWS, D, b->k, blk.start, blk.len, g, tid);
  fa_mma_load_rows(sm, vtile, D, FA_MMA_ROWS, D, b->v, blk.start, blk.len, g, tid);
  fa_query_walk w = {(int)u.j0, 0, 0, 0, 0, 0};
  w = fa_qwalk_seek(w, b->seg, b->pair, b->kidx, b->qshift, u, blk, group);
  if (w.j <= u.j1) fa_mma_load_queries(sm, qbuf0, ld0, D, D, BQ, b, w, g * group + w.hh, tid);
  fa_cp_async_commit();
  return w;
}

/* The lane's lse (natural log) and D of tile w's rows r0 and r0 + 8 (query
 * head h) from global memory: st[0], st[1] lse, st[2], st[3] D. A row past
 * the tile's queries reads its first (masked where used). */
static inline __attribute__((always_inline)) void fa_wg_pair_dkv_stats(float *st, const fa_gpu_bwd *b, fa_query_walk w,
                                                                       int h, int r0) {
  const int nq = w.qend - w.qb;
  const int64_t i0 = (int64_t)(w.qb + (r0 < nq ? r0 : 0)) * b->hq + h;
  const int64_t i1 = (int64_t)(w.qb + (r0 + 8 < nq ? r0 + 8 : 0)) * b->hq + h;
  st[0] = b->lse[i0], st[1] = b->lse[i1], st[2] = b->dsum[i0], st[3] = b->dsum[i1];
}

/* The whole team's scan of tile w's Q and dO rows in the buffer at element
 * qt when it needs one (above; team-uniform): the non-finite rows among the
 * tile's queries. */
static inline unsigned long long fa_wg_pair_dkv_scan(unsigned short *smem, int qt, int BQ, int D, int f16,
                                                     fa_tile_ring rg, fa_query_walk w, fa_block blk, int qsh, int tid) {
  const int nq = fa_qwalk_rows(w, BQ);
  if (nq == BQ && !(w.causal && w.qb + qsh < (int)(blk.start + blk.len) - 1)) return 0;
  const unsigned long long f = fa_mma_scan_rows_by(smem + qt, D, BQ, 0, BQ, D, f16, rg.flags, tid, FA_WG_PAIR_THREADS) |
                               fa_mma_scan_rows_by(smem + qt + BQ * D, D, BQ, 0, BQ, D, f16, rg.flags, tid,
                                                   FA_WG_PAIR_THREADS);
  return nq < 64 ? f & ((1ull << nq) - 1) : f;
}

/* Tile t = w of the two-warpgroup dK/dV, in buffer i: its lse and D into st
 * (fa_wg_pair_dkv_stats), its arrival waited for, its scan (fa_wg_pair_dkv_scan,
 * the whole team). Returns the scan's flags. */
static inline __attribute__((always_inline)) unsigned long long
fa_wg_pair_dkv_next(float *st, const fa_gpu_bwd *b, fa_query_walk w, int h, int r0, fa_smem sm, unsigned short *smem,
                fa_tile_ring rg, int i, int t, int BQ, int D, int f16, fa_block blk, int qsh, int tid) {
  fa_wg_pair_dkv_stats(st, b, w, h, r0);
  fa_mbar_wait(sm, rg.full + 4 * i, (t / rg.S) & 1);
  return fa_wg_pair_dkv_scan(smem, fa_tile_ring_buf(rg, i), BQ, D, f16, rg, w, blk, qsh, tid);
}
#pragma omp end declare target

#endif
