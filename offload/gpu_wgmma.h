/* Warpgroup tensor-core micro-kernels (Hopper, sm_90a): wgmma.mma_async
 * m64nNk16 with A from registers and B from team memory through a matrix
 * descriptor, its fence / commit / wait, and the tile layout it reads.
 *
 * A warpgroup is the team's 4 warps. Warp w's share of A (rows 16w..16w+15)
 * and of the accumulator D is laid out exactly as mma.sync m16n8k16's A and
 * C fragments (PTX ISA, "Register Fragments" of wgmma): a fa_u4 per 16-wide
 * k-step, a fa_f4 per 8 columns of D. So the kernels' softmax, masks and P
 * packing are unchanged; only the products move to wgmma.
 *
 * Tile layout (fa_wg_elem, gpu_mma_tiles.h): the hardware's 128-byte
 * swizzle. A tile of R rows is cut into 64-column slabs; a slab row is 128
 * bytes, and within each 8-row (1024-byte) block the 16-byte chunk c of row r
 * sits at chunk c ^ (r % 8). Tiles start 1024-byte aligned (fa_wg_align),
 * since the swizzle XORs absolute address bits 4-6 with bits 7-9. One layout
 * serves both operand roles:
 *  - K-major B (S = Q K^T, B[k = d][n = key] from K's rows): a 16-wide
 *    k-step starts 32 bytes into its slab's rows, 8-row blocks are 1024
 *    bytes apart (SBO);
 *  - N-major B (O += P V, B[k = key][n = d] from V's rows): a k-step is two
 *    8-row blocks (SBO 1024 bytes), the slabs of 64 d-columns R * 128 bytes
 *    apart (LBO).
 * cp.async fills a slab row with 8 lanes' 16 bytes (one 128-byte line of
 * global memory, one 128-byte row of team memory: no bank conflicts), and
 * ldmatrix of Q reads 8 rows of one chunk from 8 different bank groups.
 *
 * Bases and the emulation follow gpu_mma.h: with FORKATTN_MMA_EMULATE the
 * product is computed from the warpgroup's published A fragments and the
 * descriptor's layout as the ISA defines it; otherwise the host base traps.
 * The nvptx variant exists only when compiling for sm_90a
 * (__CUDA_ARCH_FEAT_SM90_ALL); other device builds trap, and the launch
 * side compiles the wgmma kernels only with FORKATTN_HAVE_WGMMA. */
#ifndef FORKATTN_GPU_WGMMA_H
#define FORKATTN_GPU_WGMMA_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gpu_fwd.h"
#include "gpu_mma.h"
#include "gpu_mma_tiles.h"

#pragma omp declare target
#define FA_WG_BLOCK_BYTES 1024 /* 8 swizzled 128-byte rows: the descriptors' SBO */
/* Elements to skip from team memory m so that tiles start 1024-byte aligned
 * (the runtime aligns the dynamic buffer to 16 bytes only). */
static inline int fa_wg_align(fa_smem m) {
  return (int)((FA_WG_BLOCK_BYTES - (m.s & (FA_WG_BLOCK_BYTES - 1))) & (FA_WG_BLOCK_BYTES - 1)) / 2;
}

/* The two wgmma forms the kernels use, warpgroup-collective and
 * asynchronous (results defined only after fa_wg_commit and fa_wg_wait):
 *  fa_wg_mma     acc (this warp's 16 rows x N, N/8 fragments; N 64 or 128)
 *                += A B: A the warp's 16 x 16 register fragment a (P, dS),
 *                B (16 x N) at element off of m, N-major (rows are k, 8-row
 *                blocks FA_WG_BLOCK_BYTES apart, 64-column slabs lbo bytes
 *                apart): V, K, dO or Q read as [k][n];
 *  fa_wg_mma_ss  acc (N 32, 64 or 128) = A B (+ acc when acc_in): A (64 x 16)
 *                the warpgroup's rows at element aoff of view ma, B (16 x N)
 *                the rows at element off of view m, both K-major (rows are
 *                m or n, k along the row);
 *  fa_wg_mma_tt  acc (N 64 or 128) += A B: A (64 x 16) and B (16 x N) both
 *                MN-major (rows are k, 8-row blocks FA_WG_BLOCK_BYTES apart):
 *                A the single 64-column slab at element aoff of view ma (P or
 *                dS stored [query][key], read as P^T), B at element off of
 *                view m with its 64-column slabs lbo bytes apart (dO or Q
 *                read as [query][dim]).
 * A view is the team memory or a part of it (fa_wg_opaque_at); the forms
 * with two take one for each operand.
 * All in the 128-byte swizzle. fa_stmatrix_x4 (stmatrix, sm_90): lane 8i + j
 * gives the address of row j of 8 x 8 matrix i, whose row r is lanes
 * 4r..4r+3's register i (x, y, z, w): an accumulator fragment's layout. */
#ifndef FORKATTN_MMA_EMULATE
static inline __attribute__((always_inline)) void fa_wg_mma(fa_f4 *acc, int N, fa_u4 a, fa_smem m, int off, int lbo,
                                                            int f16) {
  (void)acc, (void)N, (void)a, (void)m, (void)off, (void)lbo, (void)f16;
  __builtin_trap();
}
static inline __attribute__((always_inline)) void fa_wg_mma_ss(fa_f4 *acc, int N, fa_smem ma, int aoff, fa_smem m,
                                                               int off, int f16, int acc_in) {
  (void)acc, (void)N, (void)ma, (void)aoff, (void)m, (void)off, (void)f16, (void)acc_in;
  __builtin_trap();
}
static inline __attribute__((always_inline)) void fa_wg_mma_tt(fa_f4 *acc, int N, fa_smem ma, int aoff, fa_smem m,
                                                               int off, int lbo, int f16) {
  (void)acc, (void)N, (void)ma, (void)aoff, (void)m, (void)off, (void)lbo, (void)f16;
  __builtin_trap();
}
static inline void fa_stmatrix_x4(fa_smem m, int off, fa_u4 v) { (void)m, (void)off, (void)v, __builtin_trap(); }
#else
/* The 16-bit element at logical team-memory address la, after the 128-byte swizzle of the
 * absolute address (bits 4-6 ^= bits 7-9). */
static inline float fa_emu_swz(uintptr_t la, int f16) {
  uint16_t v;
  memcpy(&v, (const void *)(la ^ (((la >> 7) & 7) << 4)), 2);
  return f16 ? fa_f16_to_f32(v) : fa_bf16_to_f32(v);
}

/* One wgmma for this thread's accumulators: A from the warpgroup's published register
 * fragments e->a, or (aoff >= 0) from team memory, K-major (rows m, 8-row blocks 1024 bytes
 * apart) or, tnsp & 2, M-major (rows k, one 64-wide slab); B[k][n] at its logical address:
 * K-major rows are n (8-row blocks sbo apart) with k along the row, N-major (tnsp & 1) rows are
 * k (blocks sbo apart) with n along the row in 64-wide slabs lbo apart. */
static inline void fa_emu_wgmma(fa_f4 *acc, int N, const fa_emu_lanes *e, fa_smem m, int aoff, int off, int lbo,
                                int sbo, int tnsp, int f16, int acc_in) {
  const int t = omp_get_thread_num(), L = t & 31, g0 = t & ~127;
  const unsigned char *abase = (const unsigned char *)(m.p + (aoff >= 0 ? aoff : 0));
  const unsigned char *base = (const unsigned char *)(m.p + off);
  for (int i = 0; i < N / 8; i++) {
    double d[4] = {acc[i].x, acc[i].y, acc[i].z, acc[i].w};
    if (!acc_in) d[0] = d[1] = d[2] = d[3] = 0.0;
    for (int k = 0; k < 16; k++)
      for (int e2 = 0; e2 < 4; e2++) {
        const int row = 16 * ((t - g0) / 32) + L / 4 + 8 * (e2 / 2), n = 8 * i + 2 * (L % 4) + e2 % 2;
        float av;
        if (aoff >= 0 && (tnsp & 2)) {
          av = fa_emu_swz((uintptr_t)(abase + (k / 8) * FA_WG_BLOCK_BYTES + (k % 8) * 128 + row * 2), f16);
        } else if (aoff >= 0) {
          av = fa_emu_swz((uintptr_t)(abase + (row / 8) * FA_WG_BLOCK_BYTES + (row % 8) * 128 + k * 2), f16);
        } else { /* warp row/16 of the group, lane 4 (row % 8) + (k % 8) / 2, register (row % 16) / 8 + 2 (k / 8) */
          const fa_u4 ar = e->a[g0 + 32 * (row / 16) + 4 * (row % 8) + (k % 8) / 2];
          const int reg = (row % 16) / 8 + 2 * (k / 8);
          av = fa_emu_half(reg == 0 ? ar.x : reg == 1 ? ar.y : reg == 2 ? ar.z : ar.w, k % 2, f16);
        }
        const uintptr_t la = (tnsp & 1) ? (uintptr_t)(base + (k / 8) * sbo + (k % 8) * 128 + (n / 64) * lbo + (n % 64) * 2)
                                  : (uintptr_t)(base + (n / 8) * sbo + (n % 8) * 128 + k * 2);
        d[e2] += (double)av * fa_emu_swz(la, f16);
      }
    const fa_f4 r = {(float)d[0], (float)d[1], (float)d[2], (float)d[3]};
    acc[i] = r;
  }
}

static inline __attribute__((always_inline)) void fa_wg_mma(fa_f4 *acc, int N, fa_u4 a, fa_smem m, int off, int lbo,
                                                            int f16) {
  const int t = omp_get_thread_num();
  fa_emu_lanes *e = fa_emu_next(t);
  e->a[t] = a;
#pragma omp barrier
  fa_emu_wgmma(acc, N, e, m, -1, off, lbo, FA_WG_BLOCK_BYTES, 1, f16, 1);
}

/* The emulation reads both operands from the lower of the two views (a
 * negative A offset would mean A from registers to fa_emu_wgmma): that
 * view, with *aoff and *off made relative to it. */
static inline fa_smem fa_emu_lower_view(fa_smem ma, int *aoff, fa_smem m, int *off) {
  const fa_smem lo = ma.p < m.p ? ma : m;
  *aoff += (int)(ma.p - lo.p), *off += (int)(m.p - lo.p);
  return lo;
}

static inline __attribute__((always_inline)) void fa_wg_mma_ss(fa_f4 *acc, int N, fa_smem ma, int aoff, fa_smem m,
                                                               int off, int f16, int acc_in) {
  const fa_smem lo = fa_emu_lower_view(ma, &aoff, m, &off);
#pragma omp barrier
  fa_emu_wgmma(acc, N, NULL, lo, aoff, off, 0, FA_WG_BLOCK_BYTES, 0, f16, acc_in);
}

static inline __attribute__((always_inline)) void fa_wg_mma_tt(fa_f4 *acc, int N, fa_smem ma, int aoff, fa_smem m,
                                                               int off, int lbo, int f16) {
  const fa_smem lo = fa_emu_lower_view(ma, &aoff, m, &off);
#pragma omp barrier
  fa_emu_wgmma(acc, N, NULL, lo, aoff, off, lbo, FA_WG_BLOCK_BYTES, 3, f16, 1);
}

static inline void fa_stmatrix_x4(fa_smem m, int off, fa_u4 v) {
  const int t = omp_get_thread_num(), w0 = t & ~31, L = t & 31, i = L / 8, j = L % 8;
  fa_emu_lanes *e = fa_emu_next(t);
  e->addr[t] = m.p + off;
  e->a[t] = v;
#pragma omp barrier
  unsigned short *row = (unsigned short *)(uintptr_t)e->addr[t]; /* row j of matrix i: lanes 4j..4j+3's register i */
  for (int q = 0; q < 4; q++) {
    const fa_u4 r = e->a[w0 + 4 * j + q];
    const uint32_t x = i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
    memcpy(row + 2 * q, &x, 4);
  }
}
#endif
/* Order this thread's earlier register writes (accumulators, A fragments)
 * before the warpgroup's next wgmma (wgmma.fence). */
static inline void fa_wg_fence(void) {}
/* m with its shared-window address hidden from the compiler where it is
 * called: descriptors and addresses built from it are recomputed there (in
 * uniform registers), not kept live across a loop from its entry. */
static inline fa_smem fa_wg_opaque(fa_smem m) { return m; }
/* The view of m from element off on, its address hidden as fa_wg_opaque
 * hides m's: a product group's descriptors are built from it once, with
 * each k-step's offset a constant added to them, and nothing of it can be
 * hoisted out of a loop. */
static inline fa_smem fa_wg_opaque_at(fa_smem m, int off) {
  m.p += off, m.s += 2u * (uint32_t)off;
  return m;
}
/* Close the wgmma issued since the last commit into one group. */
static inline void fa_wg_commit(void) {}
/* Wait until at most n (0 or 1) of this warpgroup's groups are pending.
 * The emulation computes a product when it is issued; its wait is a team
 * barrier, so past it no thread still reads the operands (a buffer a
 * warpgroup releases after its wait may be refilled at once). */
#ifdef FORKATTN_MMA_EMULATE
static inline void fa_wg_wait(int n) {
  (void)n;
#pragma omp barrier
}
#else
static inline void fa_wg_wait(int n) { (void)n; }
#endif
/* Pin a register array at this point of the program (an empty asm that
 * reads and writes it): keeps the compiler from moving its reads above a
 * wait, or its writes below a fence. */
static inline __attribute__((always_inline)) void fa_wg_pin(fa_f4 *acc, int n) { (void)acc, (void)n; }
static inline __attribute__((always_inline)) void fa_wg_pin_u4(fa_u4 *a, int n) { (void)a, (void)n; }
/* Barrier `id` (1..15; 0 is the team's) of the n threads of one warpgroup
 * (bar.sync). The emulation meets the whole team: valid where every
 * warpgroup reaches its barrier at the same points (as the collectives,
 * gpu_mma.h). */
#ifdef FORKATTN_MMA_EMULATE
static inline void fa_wg_bar_sync(int id, int n) {
  (void)id, (void)n;
#pragma omp barrier
}
#else
static inline void fa_wg_bar_sync(int id, int n) { (void)id, (void)n; }
#endif
/* Turns of a two-warpgroup team (FlashAttention-3's ping-pong): wait at
 * named barrier `id` (3..15) for the other warpgroup's pass, or pass to it
 * (arrive without waiting), 256 threads each. They order only the tensor
 * cores' work, not data, so the emulation (warpgroups in step) skips them. */
static inline void fa_wg_turn_wait(int id) { (void)id; }
static inline void fa_wg_turn_pass(int id) { (void)id; }
#pragma omp end declare target

#ifdef __clang__
#pragma omp begin declare variant match(device = {arch(nvptx64)})
static inline __attribute__((always_inline)) void fa_wg_pin(fa_f4 *acc, int n) {
#pragma unroll
  for (int i = 0; i < n; i++)
    __asm__ volatile("" : "+f"(acc[i].x), "+f"(acc[i].y), "+f"(acc[i].z), "+f"(acc[i].w)::"memory");
}
static inline __attribute__((always_inline)) void fa_wg_pin_u4(fa_u4 *a, int n) {
#pragma unroll
  for (int i = 0; i < n; i++) __asm__ volatile("" : "+r"(a[i].x), "+r"(a[i].y), "+r"(a[i].z), "+r"(a[i].w)::"memory");
}
static inline void fa_wg_bar_sync(int id, int n) { __asm__ volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
static inline void fa_wg_turn_wait(int id) { __asm__ volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
static inline void fa_wg_turn_pass(int id) { __asm__ volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
static inline void fa_wg_fence(void) { __asm__ volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static inline void fa_wg_commit(void) { __asm__ volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
static inline void fa_wg_wait(int n) {
  if (n) __asm__ volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
  else __asm__ volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

#define FA_WG_F4(i) "+f"(c[i].x), "+f"(c[i].y), "+f"(c[i].z), "+f"(c[i].w)
#define FA_WG_ACC32                                                                                                \
  FA_WG_F4(0), FA_WG_F4(1), FA_WG_F4(2), FA_WG_F4(3), FA_WG_F4(4), FA_WG_F4(5), FA_WG_F4(6), FA_WG_F4(7)
#define FA_WG_ACC64                                                                                                \
  FA_WG_ACC32, FA_WG_F4(8), FA_WG_F4(9), FA_WG_F4(10), FA_WG_F4(11), FA_WG_F4(12), FA_WG_F4(13), FA_WG_F4(14),     \
      FA_WG_F4(15)
/* One wgmma: register A (N = 64, 128; B N-major) or shared-memory A (SS, N = 32, 64, 128; B K-major); TY the
 * input type. */
#define FA_WG_ACC16 FA_WG_F4(0), FA_WG_F4(1), FA_WG_F4(2), FA_WG_F4(3)
#define FA_WG_N64(TY)                                                                                              \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                     \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, " \
                   "1, 1;\n}\n"                                                                                    \
                   : FA_WG_ACC32                                                                                   \
                   : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc), "r"(acc_in)                                \
                   : "memory")
#define FA_WG_N128(TY)                                                                                             \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                    \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "    \
                   "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "    \
                   "%56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"          \
                   : FA_WG_ACC64                                                                                   \
                   : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc), "r"(acc_in)                                \
                   : "memory")

#define FA_WG_SS_N64(TY)                                                                                           \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                     \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"    \
                   : FA_WG_ACC32                                                                                   \
                   : "l"(adesc), "l"(desc), "r"(acc_in)                                                            \
                   : "memory")
#define FA_WG_SS_N128(TY)                                                                                          \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                    \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "    \
                   "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "    \
                   "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"                       \
                   : FA_WG_ACC64                                                                                   \
                   : "l"(adesc), "l"(desc), "r"(acc_in)                                                            \
                   : "memory")
#define FA_WG_SS_N32(TY)                                                                                           \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "                                     \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, " \
                   "0;\n}\n"                                                                                       \
                   : FA_WG_ACC16                                                                                   \
                   : "l"(adesc), "l"(desc), "r"(acc_in)                                                            \
                   : "memory")

/* SS with both operands MN-major (imm-trans-a, imm-trans-b 1), accumulating */
#define FA_WG_TT_N64(TY)                                                                                           \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                     \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"    \
                   : FA_WG_ACC32                                                                                   \
                   : "l"(adesc), "l"(desc), "r"(1)                                                                 \
                   : "memory")
#define FA_WG_TT_N128(TY)                                                                                          \
  __asm__ volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                    \
                   "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "    \
                   "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "    \
                   "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n"                       \
                   : FA_WG_ACC64                                                                                   \
                   : "l"(adesc), "l"(desc), "r"(1)                                                                 \
                   : "memory")

/* A descriptor of the 128-byte swizzle at element off of m (bits 62-63 = 1).
 * Written as a tile-invariant base plus off / 8 (16-byte units) in the low
 * word, the high word a constant: off is a multiple of 8, the team memory
 * window is under 256 KB and m is 1024-byte aligned, so the sum carries into
 * neither the LBO field nor the high word. Then every product of a tile
 * costs one add and one move to a uniform register, not the ~10 integer
 * instructions the masked form compiled to (ncu: integer work and R2UR were
 * ~60 % of the dK/dV kernel's instructions). */
static inline uint64_t fa_wg_desc(fa_smem m, int off, int lbo, int sbo) {
  const uint32_t lo = ((m.s & 0x3ffffu) >> 4 | (uint32_t)(lbo >> 4) << 16) + ((uint32_t)off >> 3);
  return (uint64_t)((uint32_t)(sbo >> 4) | 1u << 30) << 32 | lo;
}

static inline __attribute__((always_inline)) void fa_wg_mma_ss(fa_f4 *c, int N, fa_smem ma, int aoff, fa_smem m,
                                                               int off, int f16, int acc_in) {
  /* K-major in the swizzle: LBO unused (16), SBO one 8-row block */
  const uint64_t adesc = fa_wg_desc(ma, aoff, 16, FA_WG_BLOCK_BYTES), desc = fa_wg_desc(m, off, 16, FA_WG_BLOCK_BYTES);
  if (N == 32) {
    if (f16) FA_WG_SS_N32("f16");
    else FA_WG_SS_N32("bf16");
  } else if (N == 64) {
    if (f16) FA_WG_SS_N64("f16");
    else FA_WG_SS_N64("bf16");
  } else {
    if (f16) FA_WG_SS_N128("f16");
    else FA_WG_SS_N128("bf16");
  }
}

static inline __attribute__((always_inline)) void fa_wg_mma_tt(fa_f4 *c, int N, fa_smem ma, int aoff, fa_smem m,
                                                               int off, int lbo, int f16) {
  /* MN-major: SBO one 8-row block of k; A's LBO (a second 64-wide slab of m) unused */
  const uint64_t adesc = fa_wg_desc(ma, aoff, FA_WG_BLOCK_BYTES, FA_WG_BLOCK_BYTES),
                 desc = fa_wg_desc(m, off, lbo, FA_WG_BLOCK_BYTES);
  if (N == 64) {
    if (f16) FA_WG_TT_N64("f16");
    else FA_WG_TT_N64("bf16");
  } else {
    if (f16) FA_WG_TT_N128("f16");
    else FA_WG_TT_N128("bf16");
  }
}

static inline fa_smem fa_wg_opaque(fa_smem m) {
  __asm__ volatile("" : "+r"(m.s));
  return m;
}
static inline fa_smem fa_wg_opaque_at(fa_smem m, int off) {
  m.p += off, m.s += 2u * (uint32_t)off;
  __asm__ volatile("" : "+r"(m.s));
  return m;
}

static inline void fa_stmatrix_x4(fa_smem m, int off, fa_u4 v) {
  __asm__ volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(m.s + 2u * (uint32_t)off),
                   "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                   : "memory");
}

static inline __attribute__((always_inline)) void fa_wg_mma(fa_f4 *c, int N, fa_u4 a, fa_smem m, int off, int lbo,
                                                            int f16) {
  const uint64_t desc = fa_wg_desc(m, off, lbo, FA_WG_BLOCK_BYTES);
  const int acc_in = 1; /* P V, dS K, P^T dO, dS^T Q all accumulate */
  if (N == 64) {
    if (f16) FA_WG_N64("f16");
    else FA_WG_N64("bf16");
  } else {
    if (f16) FA_WG_N128("f16");
    else FA_WG_N128("bf16");
  }
}
#undef FA_WG_TT_N128
#undef FA_WG_TT_N64
#undef FA_WG_SS_N128
#undef FA_WG_SS_N32
#undef FA_WG_SS_N64
#undef FA_WG_N64
#undef FA_WG_N128
#undef FA_WG_ACC64
#undef FA_WG_ACC32
#undef FA_WG_ACC16
#undef FA_WG_F4
#endif /* __CUDA_ARCH_FEAT_SM90_ALL */
#pragma omp end declare variant
#endif

#pragma omp declare target
/* acc (this warp's 16 rows x N) = A B^T over D/16 k-steps: A (64 x D) the
 * FA_MMA_ROWS-row tile at element atile of view ma, B (N x D) N rows at
 * element tile of view mb, of a tile of R rows (R = N, or a taller tile
 * whose rows from `tile` on are taken in parts: its 64-column slabs are R
 * rows apart), both in the wgmma layout (K-major). A is read from team
 * memory, not registers: ptxas 13.0 reused the registers of a loop-invariant
 * A fragment after its first wgmma (the dQ kernel's dO fragments, SASS of
 * the sm_90a build), so no wgmma here takes A from registers that must
 * outlive it. Issued, not waited. Views: the team memory (fa_wg_opaque), or
 * each operand's own tile (fa_wg_opaque_at, offsets 0), which the
 * two-warpgroup dK/dV takes. */
static inline __attribute__((always_inline)) void fa_wg_acc_abt_v(fa_f4 *acc, fa_smem ma, int atile, fa_smem mb,
                                                                  int tile, int N, int R, int D, int f16) {
  fa_wg_pin(acc, N / 8);
  fa_wg_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
    fa_wg_mma_ss(acc, N, ma, atile + (ks >> 2) * FA_MMA_ROWS * 64 + (ks & 3) * 16, mb,
                 tile + (ks >> 2) * R * 64 + (ks & 3) * 16, f16, ks > 0);
}

/* fa_wg_acc_abt_v with both operands in the view sm. */
static inline __attribute__((always_inline)) void fa_wg_acc_abt_of(fa_f4 *acc, int atile, fa_smem sm, int tile, int N,
                                                                   int R, int D, int f16) {
  fa_wg_acc_abt_v(acc, sm, atile, sm, tile, N, R, D, f16);
}

/* fa_wg_acc_abt_of for an N-row B tile. */
static inline __attribute__((always_inline)) void fa_wg_acc_abt(fa_f4 *acc, int atile, fa_smem sm, int tile, int N,
                                                                int D, int f16) {
  fa_wg_acc_abt_of(acc, atile, sm, tile, N, N, D, f16);
}

/* pa = A fragments of the accumulators a (16 rows x K, two n-tiles a
 * 16-wide k-step) in the input type, pinned so they are written before the
 * next fence. */
static inline __attribute__((always_inline)) void fa_wg_pack(fa_u4 *pa, const fa_f4 *a, int K, int f16) {
#pragma unroll
  for (int kk = 0; kk < K / 16; kk++) pa[kk] = fa_mma_p_frag(a[2 * kk], a[2 * kk + 1], f16);
  fa_wg_pin_u4(pa, K / 16);
}

/* acc (16 rows x D) += A B over K/16 k-steps: A the packed fragments pa
 * (fa_wg_pack), B (K x D) K rows of a tile of R rows (R = K, or a tile whose
 * rows from `tile` on are taken in parts) in the wgmma layout, read N-major:
 * its 64-column slabs are R rows apart. Issued, not waited: the caller keeps
 * pa unchanged and live until the wait (fa_wg_pin_u4 after it). */
static inline __attribute__((always_inline)) void fa_wg_acc_ab(fa_f4 *acc, const fa_u4 *pa, fa_smem sm, int tile,
                                                               int K, int R, int D, int f16) {
  fa_wg_pin(acc, D / 8);
  fa_wg_fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; kk++)
    fa_wg_mma(acc, D, pa[kk], sm, tile + kk * 1024, R * 128, f16);
}

/* acc (16 rows x D) += A^T B over K/16 k-steps: A (K x 64) the 64-column
 * tile at element atile of view ma (P or dS as [query][key]: the product
 * reads P^T), B (K x D) K rows of a tile of R rows at element tile of view
 * mb, both in the wgmma layout read MN-major. Issued, not waited. Views as
 * fa_wg_acc_abt_v's. */
static inline __attribute__((always_inline)) void fa_wg_acc_atb_v(fa_f4 *acc, fa_smem ma, int atile, fa_smem mb,
                                                                  int tile, int K, int R, int D, int f16) {
  fa_wg_pin(acc, D / 8);
  fa_wg_fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; kk++)
    fa_wg_mma_tt(acc, D, ma, atile + kk * 1024, mb, tile + kk * 1024, R * 128, f16);
}

/* fa_wg_acc_atb_v with both operands in the view sm. */
static inline __attribute__((always_inline)) void fa_wg_acc_atb(fa_f4 *acc, fa_smem sm, int atile, int tile, int K,
                                                                int R, int D, int f16) {
  fa_wg_acc_atb_v(acc, sm, atile, sm, tile, K, R, D, f16);
}
#pragma omp end declare target

#endif
