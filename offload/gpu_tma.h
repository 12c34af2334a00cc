/* Hopper bulk tensor copies (TMA, sm_90+) from OpenMP offload: a tensor map
 * encoded on the host (fa_gpu_tma_encode, through the CUDA driver's
 * cuTensorMapEncodeTiled, looked up at run time), kept in device global
 * memory, and the device side: an mbarrier in team memory that one thread
 * arms with the bytes to expect, the copy it issues, and the wait every
 * thread of the team does on the barrier's phase.
 *
 * The map describes a [rows][heads][d] tensor of 16-bit elements (row and
 * head strides in elements) read as boxes of box_rows rows x 64 columns of
 * one head with the hardware's 128-byte swizzle: one box is one 64-column
 * slab of the wgmma tile layout (fa_wg_elem, gpu_mma_tiles.h) when its
 * destination is 1024-byte aligned, so a d = 128 tile is two copies.
 * Rows past the tensor's last row arrive as zeros; rows past a segment's
 * end inside the tensor arrive as they are (the caller masks or zeroes them).
 *
 * The wgmma forward loads its K and V tiles this way (gpu_fwd_teams.h),
 * the wgmma dK/dV its Q and dO tiles (gpu_bwd_teams.h); tests/test_tma.c
 * checks on the GPU that a copy lands bit for bit where fa_mma_load_rows
 * (cp.async) puts the same rows, and that a barrier serves consecutive
 * phases; tests/test_mma_emulated.c runs the forward and dK/dV with
 * emulated copies (below) against their cp.async form. The nvptx variants
 * exist for sm_90 and newer. */
#ifndef FORKATTN_GPU_TMA_H
#define FORKATTN_GPU_TMA_H
#include <stdint.h>
#include <string.h>

#include "gpu_mma.h"
#include "gpu_mma_tiles.h"

/** An encoded tensor map (CUtensorMap: 128 bytes, 64-byte aligned). */
typedef struct fa_tma_map { /* struct tag: forward-declared in gpu_fwd.h */
  _Alignas(64) uint64_t opaque[16];
} fa_tma_map;

/* Encode *map for the tensor at base (device memory, 16-byte aligned):
 * rows x heads x d elements of bf16 (f16 = 0) or f16, strides in elements
 * (multiples of 8), boxes of box_rows (<= 256) rows x 64 columns of one
 * head, 128-byte swizzle. Host code. Returns 0, or -1 with a reason in msg
 * (no CUDA driver, the driver refused the shape). */
int fa_gpu_tma_encode(fa_tma_map *map, const void *base, int f16, int64_t rows, int64_t heads, int64_t d,
                      int64_t row_stride, int64_t head_stride, int box_rows, char *msg, int msg_len);

#pragma omp declare target
/* Team-memory offsets below are in 16-bit elements, like every fa_smem
 * operand; an mbarrier takes 8 bytes (4 elements), 8-byte aligned.
 *  fa_mbar_init       initialise the mbarrier at off for `count` arriving
 *                     threads (one thread; a team barrier must follow);
 *  fa_mbar_expect_tx  this thread arrives and adds `bytes` to the transfer
 *                     the current phase waits for;
 *  fa_tma_load_3d     copy the box at (column c0, head c1, row c2) of the
 *                     tensor `map` describes to team memory at dst (1024-byte
 *                     aligned for the swizzle), its bytes completing the
 *                     barrier at bar; issued by one thread;
 *  fa_mbar_try_wait   1 once the barrier's phase of this parity (0, 1, 0, ...)
 *                     completed;
 *  fa_mbar_arrive     this thread arrives (no transfer): a consumer's
 *                     release of a buffer (gpu_fwd_teams.h's two-warpgroup
 *                     forward).
 * Bases: with FORKATTN_MMA_EMULATE (host tests) the copy happens at once,
 * from the map fa_tma_emulated_map wrote, into the wgmma layout the
 * cp.async loader writes (so the emulated wgmma reads it alike), and the
 * barrier calls only check their barrier's alignment: the team barrier that
 * precedes every read of a tile orders it. Otherwise they trap. */
#ifndef FORKATTN_MMA_EMULATE
static inline void fa_mbar_init(fa_smem m, int off, int count) { (void)m, (void)off, (void)count, __builtin_trap(); }
static inline void fa_mbar_inval(fa_smem m, int off) { (void)m, (void)off, __builtin_trap(); }
static inline void fa_mbar_expect_tx(fa_smem m, int off, int bytes) { (void)m, (void)off, (void)bytes, __builtin_trap(); }
static inline void fa_mbar_arrive(fa_smem m, int off) { (void)m, (void)off, __builtin_trap(); }
static inline void fa_tma_load_3d(fa_smem m, int dst, const fa_tma_map *map, int c0, int c1, int c2, int bar) {
  (void)m, (void)dst, (void)map, (void)c0, (void)c1, (void)c2, (void)bar, __builtin_trap();
}
static inline int fa_mbar_try_wait(fa_smem m, int off, int parity) {
  (void)m, (void)off, (void)parity, __builtin_trap();
  return 1;
}
#else
/* The emulation's map: what fa_gpu_tma_encode gives the driver. */
typedef struct fa_tma_emu {
  const uint16_t *base;
  int64_t rows, heads, d, row_stride, head_stride; /* elements */
  int box_rows;
} fa_tma_emu;
_Static_assert(sizeof(fa_tma_emu) <= sizeof(fa_tma_map), "the emulated map fits a tensor map");

static inline void fa_tma_emulated_map(fa_tma_map *map, const void *base, int64_t rows, int64_t heads, int64_t d,
                                       int64_t row_stride, int64_t head_stride, int box_rows) {
  const fa_tma_emu e = {(const uint16_t *)base, rows, heads, d, row_stride, head_stride, box_rows};
  memset(map, 0, sizeof *map);
  memcpy(map, &e, sizeof e);
}

/* The alignments the hardware needs (an mbarrier: 8 bytes) or the kernels' layout assumes (a box
 * written with the 128-byte swizzle, whose pattern follows absolute address bits 4-9: 1024 bytes),
 * checked, since the emulation would work without them. */
static inline void fa_mbar_aligned(fa_smem m, int off) {
  if ((uintptr_t)(m.p + off) % 8) __builtin_trap();
}
static inline void fa_mbar_init(fa_smem m, int off, int count) { fa_mbar_aligned(m, off), (void)count; }
static inline void fa_mbar_inval(fa_smem m, int off) { fa_mbar_aligned(m, off); }
static inline void fa_mbar_expect_tx(fa_smem m, int off, int bytes) { fa_mbar_aligned(m, off), (void)bytes; }
static inline void fa_mbar_arrive(fa_smem m, int off) { fa_mbar_aligned(m, off); }
static inline void fa_tma_load_3d(fa_smem m, int dst, const fa_tma_map *map, int c0, int c1, int c2, int bar) {
  fa_tma_emu e;
  memcpy(&e, map, sizeof e);
  fa_mbar_aligned(m, bar);
  if ((uintptr_t)(m.p + dst) % 1024) __builtin_trap();
  for (int r = 0; r < e.box_rows; r++)
    for (int c = 0; c < 64; c++) { /* out of the tensor: zeros */
      const int64_t row = (int64_t)c2 + r, col = (int64_t)c0 + c;
      const int in = row < e.rows && col < e.d && c1 < e.heads;
      m.p[dst + fa_wg_elem(r, c, e.box_rows)] = in ? e.base[row * e.row_stride + c1 * e.head_stride + col] : 0;
    }
}
static inline int fa_mbar_try_wait(fa_smem m, int off, int parity) {
  fa_mbar_aligned(m, off), (void)parity;
  return 1;
}
#endif
#pragma omp end declare target

#ifdef __clang__
#pragma omp begin declare variant match(device = {arch(nvptx64)})
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
static inline void fa_mbar_init(fa_smem m, int off, int count) {
  __asm__ volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n"
                   "fence.mbarrier_init.release.cluster;" ::"r"(m.s + 2u * (uint32_t)off),
                   "r"(count)
                   : "memory");
}

/* Before an mbarrier's memory is initialised again (a persistent team's next item). */
static inline void fa_mbar_inval(fa_smem m, int off) {
  __asm__ volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(m.s + 2u * (uint32_t)off) : "memory");
}

static inline void fa_mbar_expect_tx(fa_smem m, int off, int bytes) {
  __asm__ volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(m.s + 2u * (uint32_t)off),
                   "r"(bytes)
                   : "memory");
}

static inline void fa_mbar_arrive(fa_smem m, int off) {
  __asm__ volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(m.s + 2u * (uint32_t)off) : "memory");
}

static inline void fa_tma_load_3d(fa_smem m, int dst, const fa_tma_map *map, int c0, int c1, int c2, int bar) {
  __asm__ volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(m.s + 2u * (uint32_t)dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(m.s + 2u * (uint32_t)bar)
      : "memory");
}

static inline int fa_mbar_try_wait(fa_smem m, int off, int parity) {
  uint32_t ok;
  __asm__ volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok)
                   : "r"(m.s + 2u * (uint32_t)off), "r"(parity)
                   : "memory");
  return (int)ok;
}
#endif
#pragma omp end declare variant
#endif

#pragma omp declare target
/* Wait for the barrier's phase of this parity (every thread that reads the copy). */
static inline void fa_mbar_wait(fa_smem m, int off, int parity) {
  while (!fa_mbar_try_wait(m, off, parity)) {
  }
}

/* Rows [row, row + R) of head `head` into an R x D tile at dst in the wgmma
 * layout (fa_wg_elem): one box per 64-column slab, R * 64 elements apart
 * (the map's boxes are R rows). Completes on the barrier at bar; one thread. */
static inline void fa_tma_tile(fa_smem m, int dst, const fa_tma_map *map, int head, int row, int R, int D, int bar) {
  for (int c = 0; c < D; c += 64) fa_tma_load_3d(m, dst + c * R, map, c, head, row, bar);
}
#pragma omp end declare target

#endif
