/* Tensor-core micro-kernels for the GPU segment kernels: mma.sync m16n8k16
 * (bf16/f16 in, f32 accumulate), ldmatrix, cp.async, quad shuffles, exp2 and
 * bf16x2/f16x2 packing, as inline PTX for nvptx64.
 *
 * Each function has a portable C base (the host compilation of the offload
 * regions needs one) and an nvptx64 variant in the `begin declare variant`
 * block below. The bases of the per-element helpers (exp2, packing) compute
 * the same values as the PTX. The warp-collective ones (shuffle, ballot,
 * ldmatrix, mma) are, with FORKATTN_MMA_EMULATE defined, a SIMT emulation
 * that runs the kernels' team functions on the host for tests; otherwise they
 * have no single-thread meaning and trap (the library's dispatch never runs a
 * GPU kernel on the host: LLVM 19's host fallback of `ompx_bare` regions is
 * broken anyway, design doc).
 *
 * Everything passes and returns by value: a local whose address escapes is
 * "globalized" by the OpenMP device compiler into runtime-managed shared
 * stack, which `ompx_bare` kernels do not set up (see dtype_convert.h). */
#ifndef FORKATTN_GPU_MMA_H
#define FORKATTN_GPU_MMA_H
#include <math.h>
#include <stdint.h>

#include "dtype_convert.h"

typedef struct fa_f4 {
  float x, y, z, w;
} fa_f4; /* an m16n8 accumulator fragment: rows g, g, g+8, g+8; cols 2t, 2t+1 */

typedef struct fa_u4 {
  uint32_t x, y, z, w;
} fa_u4; /* four b16x2 registers: an A fragment, or two B fragments */

/* A team's memory as the operands of cp.async and ldmatrix see it: the
 * generic pointer (the host bases and plain loads use p + off) and its 32-bit
 * shared-window address (the nvptx variants use s + 2 off). Addressing by
 * element offset keeps the address arithmetic 32-bit and lets constant
 * offsets fold into the instructions; through generic pointers every operand
 * cost a 64-bit add chain and a window conversion. */
typedef struct fa_smem {
  unsigned short *p;
  uint32_t s;
} fa_smem;

#pragma omp declare target

/* ---- portable bases ------------------------------------------------------ */

static inline fa_f4 fa_f4_zero(void) {
  fa_f4 c = {0.0f, 0.0f, 0.0f, 0.0f};
  return c;
}

static inline float fa_mma_exp2(float x) { return exp2f(x); }

/* 1 / x for x >= 1 (a softmax row sum): the hardware reciprocal, within an
 * ulp. The IEEE-rounded division is a subroutine call on the GPU, and a call
 * makes ptxas serialize the wgmma kernels' asynchronous products. */
static inline float fa_mma_rcp(float x) { return 1.0f / x; }

/* Order this thread's generic-proxy writes to team memory (cp.async, plain
 * stores) before async-proxy reads of it (wgmma), across the next barrier. */
static inline void fa_fence_proxy_async(void) {}

/* lo in the low half (the smaller column index of an A fragment). f16 != 0
 * packs IEEE halves, else bf16; both round to nearest even. */
static inline uint32_t fa_mma_pack(float lo, float hi, int f16) {
  return f16 ? (uint32_t)fa_f32_to_f16(lo) | (uint32_t)fa_f32_to_f16(hi) << 16
             : (uint32_t)fa_f32_to_bf16(lo) | (uint32_t)fa_f32_to_bf16(hi) << 16;
}

/* 16 bytes at p, 16-byte aligned (global or team memory): one vector load. */
typedef uint32_t fa_v4u32 __attribute__((vector_size(16))); /* 16-byte aligned, unlike fa_u4 */
static inline fa_u4 fa_load_u4(const void *p) {
  const fa_v4u32 v = *(const fa_v4u32 *)p;
  const fa_u4 r = {v[0], v[1], v[2], v[3]};
  return r;
}

/* v to 16 bytes at p, 16-byte aligned (team memory): one vector store. */
static inline void fa_store_u4(void *p, fa_u4 v) {
  const fa_v4u32 w = {v.x, v.y, v.z, v.w};
  *(fa_v4u32 *)p = w;
}

/* w (two b16 halves; IEEE halves when f16 != 0, else bf16) with its
 * non-finite halves (exponent all ones: inf or NaN) zeroed. */
static inline uint32_t fa_b16x2_finite(uint32_t w, int f16) {
  const uint32_t e = f16 ? 0x7c00u : 0x7f80u;
  return w & ((w & e) == e ? 0xffff0000u : ~0u) & ((w >> 16 & e) == e ? 0x0000ffffu : ~0u);
}

/* lo*lo + hi*hi of two b16x2 words (bf16, or IEEE halves when f16 != 0). */
static inline float fa_dot_b16x2(uint32_t a, uint32_t b, int f16) {
  if (f16)
    return fa_f16_to_f32((uint16_t)a) * fa_f16_to_f32((uint16_t)b) +
           fa_f16_to_f32((uint16_t)(a >> 16)) * fa_f16_to_f32((uint16_t)(b >> 16));
  return fa_bits_to_f32(a << 16) * fa_bits_to_f32(b << 16) +
         fa_bits_to_f32(a & 0xffff0000u) * fa_bits_to_f32(b & 0xffff0000u);
}

/* size bytes to dst: the first `bytes` from src, then zeros. */
static inline void fa_copy_fill(void *dst, const void *src, int size, int bytes) {
  unsigned char *d = (unsigned char *)dst;
  const unsigned char *s = (const unsigned char *)src;
  for (int i = 0; i < size; i++) d[i] = i < bytes ? s[i] : 0;
}

#ifndef FORKATTN_MMA_EMULATE
/* 16-byte global-to-shared copy; the last 16 - bytes bytes are zero-filled.
 * The base copies synchronously (dst is a generic pointer on the host). */
static inline void fa_cp_async16(fa_smem m, int off, const void *src, int bytes) {
  fa_copy_fill(m.p + off, src, 16, bytes);
}
/* The same for 4 bytes (bytes 0 or 4): one float of a row's lse or D. */
static inline void fa_cp_async4(fa_smem m, int off, const void *src, int bytes) { fa_copy_fill(m.p + off, src, 4, bytes); }
static inline void fa_cp_async_commit(void) {}
/* Wait until at most n (0 or 1) of this thread's committed copy groups are pending. */
static inline void fa_cp_async_wait(int n) { (void)n; }
#endif

#ifdef FORKATTN_MMA_EMULATE
/* SIMT emulation of the warp-collective operations, for host tests of the
 * kernels' team functions (tests/test_mma_emulated.c): the team runs as the
 * 128 (two warpgroups: 256) threads of a host `omp parallel` region (ompx_thread_id_x and
 * ompx_sync_block map to the thread number and a barrier there). Each
 * collective publishes this thread's operands, meets the team at a barrier,
 * computes its lane's result from its warp's operands as the PTX ISA defines
 * it. Collectives alternate between two operand sets, so one barrier each
 * suffices: a set is rewritten two collectives later, after a barrier every
 * reader of it has passed. Valid because every collective in the kernels is
 * reached by all the team's threads in the same order. */
#include <omp.h>
#define FA_EMU_THREADS 256 /* the largest team: two warpgroups (gpu_fwd_teams.h); most teams run 128 */
typedef struct fa_emu_lanes {
  const unsigned short *addr[FA_EMU_THREADS];
  fa_u4 a[FA_EMU_THREADS];
  uint32_t b0[FA_EMU_THREADS], b1[FA_EMU_THREADS], bits[FA_EMU_THREADS];
  fa_f4 c[FA_EMU_THREADS];
} fa_emu_lanes;
static fa_emu_lanes fa_emu_sets[2];
static int fa_emu_parity[FA_EMU_THREADS]; /* per thread: which set its next collective uses */

static inline fa_emu_lanes *fa_emu_next(int t) {
  fa_emu_lanes *e = &fa_emu_sets[fa_emu_parity[t]];
  fa_emu_parity[t] ^= 1;
  return e;
}

/* cp.async as the hardware may run it: a copy lands only when a wait_group
 * retires its group, so a tile read before its wait, or a buffer refilled
 * while still read, shows up as wrong results. */
#define FA_EMU_COPIES 64
typedef struct fa_emu_copy {
  void *dst;
  const void *src;
  int size, bytes, group;
} fa_emu_copy;
static fa_emu_copy fa_emu_pending[FA_EMU_THREADS][FA_EMU_COPIES];
static int fa_emu_npending[FA_EMU_THREADS], fa_emu_committed[FA_EMU_THREADS];

static inline void fa_emu_cp_async(fa_smem m, int off, const void *src, int size, int bytes) {
  /* the hardware faults on a copy whose ends are not aligned to its size (team memory's base is) */
  if ((uintptr_t)(m.p + off) % (uintptr_t)size || (bytes > 0 && (uintptr_t)src % (uintptr_t)size)) __builtin_trap();
  const int t = omp_get_thread_num(), n = fa_emu_npending[t]++;
  if (n >= FA_EMU_COPIES) __builtin_trap(); /* more copies in flight than any kernel issues */
  const fa_emu_copy c = {m.p + off, src, size, bytes, fa_emu_committed[t]};
  fa_emu_pending[t][n] = c;
}
static inline void fa_cp_async16(fa_smem m, int off, const void *src, int bytes) {
  fa_emu_cp_async(m, off, src, 16, bytes);
}
static inline void fa_cp_async4(fa_smem m, int off, const void *src, int bytes) { fa_emu_cp_async(m, off, src, 4, bytes); }
static inline void fa_cp_async_commit(void) { fa_emu_committed[omp_get_thread_num()]++; }
static inline void fa_cp_async_wait(int n) {
  const int t = omp_get_thread_num(), retire = fa_emu_committed[t] - n; /* groups below this land */
  int kept = 0;
  for (int i = 0; i < fa_emu_npending[t]; i++) {
    const fa_emu_copy c = fa_emu_pending[t][i];
    if (c.group < retire) fa_copy_fill(c.dst, c.src, c.size, c.bytes);
    else fa_emu_pending[t][kept++] = c;
  }
  fa_emu_npending[t] = kept;
}

static inline float fa_emu_half(uint32_t r, int hi, int f16) {
  const uint16_t h = (uint16_t)(hi ? r >> 16 : r & 0xffffu);
  return f16 ? fa_f16_to_f32(h) : fa_bf16_to_f32(h);
}

static inline float fa_mma_shfl_xor(float x, int mask) {
  const int t = omp_get_thread_num();
  fa_emu_lanes *e = fa_emu_next(t);
  e->c[t].x = x;
#pragma omp barrier
  return e->c[t ^ mask].x;
}

static inline float fa_mma_shfl_idx(float x, int src) {
  const int t = omp_get_thread_num();
  fa_emu_lanes *e = fa_emu_next(t);
  e->c[t].x = x;
#pragma omp barrier
  return e->c[(t & ~31) | (src & 31)].x;
}

static inline uint32_t fa_mma_ballot(int pred) {
  const int t = omp_get_thread_num(), w0 = t & ~31;
  fa_emu_lanes *e = fa_emu_next(t);
  e->bits[t] = pred != 0;
#pragma omp barrier
  uint32_t b = 0;
  for (int l = 0; l < 32; l++) b |= e->bits[w0 + l] << l;
  return b;
}

/* ldmatrix.x4: lane 8i+j gives row j of matrix i; lane L receives
 * M_i[L/4][2(L%4)..+1], or with .trans M_i[2(L%4)..+1][L/4]. */
static inline fa_u4 fa_ldmatrix_x4(fa_smem m, int off, int trans) {
  const int t = omp_get_thread_num(), w0 = t & ~31, L = t & 31;
  fa_emu_lanes *e = fa_emu_next(t);
  if ((uintptr_t)(m.p + off) % 16) __builtin_trap(); /* a row address the hardware faults on */
  e->addr[t] = m.p + off;
#pragma omp barrier
  uint32_t r[4];
  for (int i = 0; i < 4; i++) {
    const int e0r = trans ? 2 * (L % 4) : L / 4, e0c = trans ? L / 4 : 2 * (L % 4);
    const int e1r = trans ? e0r + 1 : e0r, e1c = trans ? e0c : e0c + 1;
    r[i] = (uint32_t)e->addr[w0 + 8 * i + e0r][e0c] | (uint32_t)e->addr[w0 + 8 * i + e1r][e1c] << 16;
  }
  const fa_u4 out = {r[0], r[1], r[2], r[3]};
  return out;
}

/* mma.m16n8k16.row.col, g = L/4, t = L%4: A a0 (g, 2t..), a1 (g+8, 2t..),
 * a2 (g, 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t.., n g), b1 (k 2t+8.., n g);
 * C (g, 2t..2t+1), (g+8, 2t..2t+1). Products summed in double, rounded once. */
static inline fa_f4 fa_mma_16816(fa_f4 c, fa_u4 a, uint32_t b0, uint32_t b1, int f16) {
  const int t = omp_get_thread_num(), w0 = t & ~31, L = t & 31;
  fa_emu_lanes *e = fa_emu_next(t);
  e->a[t] = a, e->b0[t] = b0, e->b1[t] = b1;
#pragma omp barrier
  const int g = L / 4, q = L % 4;
  double d[4] = {c.x, c.y, c.z, c.w};
  for (int k = 0; k < 16; k++) {
    /* A[row][k] is held by lane 4*(row%8) + (k%8)/2, register (row/8) + 2*(k/8), half k%2;
     * B[k][n] by lane 4*n + (k%8)/2, register b0 (k < 8) or b1, half k%2. */
    const int la = (k % 8) / 2, half = k % 2;
    for (int e2 = 0; e2 < 4; e2++) {
      const int row = g + 8 * (e2 / 2), n = 2 * q + e2 % 2;
      const fa_u4 ar = e->a[w0 + 4 * (row % 8) + la];
      const int reg = row / 8 + 2 * (k / 8);
      const uint32_t av = reg == 0 ? ar.x : reg == 1 ? ar.y : reg == 2 ? ar.z : ar.w;
      const uint32_t bv = k < 8 ? e->b0[w0 + 4 * n + la] : e->b1[w0 + 4 * n + la];
      d[e2] += (double)fa_emu_half(av, half, f16) * fa_emu_half(bv, half, f16);
    }
  }
  const fa_f4 out = {(float)d[0], (float)d[1], (float)d[2], (float)d[3]};
  return out;
}
#else
/* Butterfly exchange with lane ^ mask of the warp (one lane alone: itself). */
static inline float fa_mma_shfl_xor(float x, int mask) {
  (void)mask;
  return x;
}

/* x of lane src of the warp (one lane alone: its own). */
static inline float fa_mma_shfl_idx(float x, int src) {
  (void)src;
  return x;
}

/* Ballot of the warp (one lane alone: its own bit 0). */
static inline uint32_t fa_mma_ballot(int pred) { return pred ? 1u : 0u; }

/* Warp-collective: no single-thread meaning (see the top of this file). */
static inline fa_u4 fa_ldmatrix_x4(fa_smem m, int off, int trans) {
  (void)m, (void)off, (void)trans;
  __builtin_trap();
}

static inline fa_f4 fa_mma_16816(fa_f4 c, fa_u4 a, uint32_t b0, uint32_t b1, int f16) {
  (void)a, (void)b0, (void)b1, (void)f16;
  __builtin_trap();
  return c;
}
#endif

/* 32-bit shared-window address of a team-memory pointer (cp.async and
 * ldmatrix operands; only the nvptx variants use it). */
static inline uint32_t fa_mma_smem(const void *p) { return (uint32_t)(uintptr_t)p; }

/* Lane maps of the fragments (PTX ISA, mma.m16n8k16 and ldmatrix), shared by
 * the kernels and the host test that checks them (tests/test_mma_fragments.c).
 * ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i. */

/* A operand (16 x 16 at row 0, col 0 of a row-major tile): matrices (rows
 * 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = a0..a3. The same
 * map with .trans loads two B fragments of a row-major [k][n] tile (V in P V):
 * rows are k, and matrices 0, 1 / 2, 3 are b0, b1 of n-tiles 0 / 1. */
static inline int fa_ldsm_a_row(int lane) { return lane % 8 + 8 * ((lane / 8) % 2); }
static inline int fa_ldsm_a_col(int lane) { return 8 * (lane / 16); }

/* Two B fragments of a [n][k] row-major tile (K in Q K^T, keys = n): matrices
 * (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = b0, b1
 * of n-tile 0, then of n-tile 1. */
static inline int fa_ldsm_b_row(int lane) { return lane % 8 + 8 * (lane / 16); }
static inline int fa_ldsm_b_col(int lane) { return 8 * ((lane / 8) % 2); }

/* Accumulator element e (0..3, the x y z w of fa_f4) of a lane: row and column
 * within the 16 x 8 tile. */
static inline int fa_acc_row(int lane, int e) { return lane / 4 + 8 * (e / 2); }
static inline int fa_acc_col(int lane, int e) { return 2 * (lane % 4) + e % 2; }

#pragma omp end declare target

/* ---- nvptx64 variants (clang's offload builds; other compilers see the bases) */
#ifdef __clang__
#pragma omp begin declare variant match(device = {arch(nvptx64)})

static inline float fa_mma_exp2(float x) {
  float y;
  __asm__("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

static inline void fa_fence_proxy_async(void) { __asm__ volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

static inline float fa_mma_rcp(float x) {
  float y;
  __asm__("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

static inline uint32_t fa_mma_pack(float lo, float hi, int f16) {
  uint32_t d;
  if (f16) __asm__("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else __asm__("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

static inline float fa_mma_shfl_xor(float x, int mask) {
  float y;
  __asm__ volatile("{ .reg .b32 t; mov.b32 t, %1; shfl.sync.bfly.b32 t, t, %2, 0x1f, 0xffffffff; mov.b32 %0, t; }"
                   : "=f"(y)
                   : "f"(x), "r"(mask));
  return y;
}

static inline float fa_mma_shfl_idx(float x, int src) {
  float y;
  __asm__ volatile("{ .reg .b32 t; mov.b32 t, %1; shfl.sync.idx.b32 t, t, %2, 0x1f, 0xffffffff; mov.b32 %0, t; }"
                   : "=f"(y)
                   : "f"(x), "r"(src));
  return y;
}

static inline uint32_t fa_mma_ballot(int pred) {
  uint32_t b;
  __asm__ volatile("{ .reg .pred p; setp.ne.s32 p, %1, 0; vote.sync.ballot.b32 %0, p, 0xffffffff; }"
                   : "=r"(b)
                   : "r"(pred));
  return b;
}

static inline uint32_t fa_mma_smem(const void *p) {
  uint64_t a;
  __asm__("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (uint32_t)a;
}

static inline void fa_cp_async16(fa_smem m, int off, const void *src, int bytes) {
  __asm__ volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(m.s + 2u * (uint32_t)off), "l"(src),
                   "r"(bytes)
                   : "memory");
}

/* .ca: .cg takes 16-byte copies only. */
static inline void fa_cp_async4(fa_smem m, int off, const void *src, int bytes) {
  __asm__ volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(m.s + 2u * (uint32_t)off), "l"(src),
                   "r"(bytes)
                   : "memory");
}

static inline void fa_cp_async_commit(void) { __asm__ volatile("cp.async.commit_group;" ::: "memory"); }

static inline void fa_cp_async_wait(int n) {
  if (n) __asm__ volatile("cp.async.wait_group 1;" ::: "memory");
  else __asm__ volatile("cp.async.wait_group 0;" ::: "memory");
}

static inline fa_u4 fa_ldmatrix_x4(fa_smem m, int off, int trans) {
  const uint32_t addr = m.s + 2u * (uint32_t)off;
  fa_u4 r;
  if (trans)
    __asm__ volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                     : "r"(addr)
                     : "memory");
  else
    __asm__ volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                     : "r"(addr)
                     : "memory");
  return r;
}

static inline fa_f4 fa_mma_16816(fa_f4 c, fa_u4 a, uint32_t b0, uint32_t b1, int f16) {
  if (f16)
    __asm__("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c.x), "+f"(c.y), "+f"(c.z), "+f"(c.w)
            : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  else
    __asm__("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c.x), "+f"(c.y), "+f"(c.z), "+f"(c.w)
            : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  return c;
}

#pragma omp end declare variant
#endif

/* ---- composites: defined after the variants because clang binds a call to
 * a variant only where the variant is already declared; above the block a
 * call would take the base (on the GPU: a ballot of one lane, C packing). */
#pragma omp declare target

/* The team memory at p (fa_smem). */
static inline fa_smem fa_smem_of(unsigned short *p) {
  const fa_smem m = {p, fa_mma_smem(p)};
  return m;
}

/* 1 when x is non-zero in any lane of this lane's quad (the 4 lanes that
 * hold one accumulator row). */
static inline int fa_mma_quad_any(int x, int lane) { return (fa_mma_ballot(x) >> (lane & ~3) & 0xfu) != 0; }

/* The A fragment of P (16 x 16) from the accumulators of its two 16 x 8 halves:
 * the accumulator layout of m16n8 is the A layout of m16k16 cut in two. */
static inline fa_u4 fa_mma_p_frag(fa_f4 lo, fa_f4 hi, int f16) {
  fa_u4 a;
  a.x = fa_mma_pack(lo.x, lo.y, f16);
  a.y = fa_mma_pack(lo.z, lo.w, f16);
  a.z = fa_mma_pack(hi.x, hi.y, f16);
  a.w = fa_mma_pack(hi.z, hi.w, f16);
  return a;
}

/* x and y minus their bf16 pair as fa_mma_pack rounds it: what a product of
 * the packed pair leaves out (the second bf16 piece, lib/core/split_bf16.h). */
static inline void fa_mma_pack_rest(float *x, float *y) {
  const uint32_t p = fa_mma_pack(*x, *y, 0);
  *x -= fa_bits_to_f32(p << 16);
  *y -= fa_bits_to_f32(p & 0xffff0000u);
}

/* Accumulators a[0 .. n) (P or dS) replaced by what their bf16 A fragments
 * (fa_mma_p_frag) leave: packed again, they are its second piece. */
static inline __attribute__((always_inline)) void fa_mma_split_rest(fa_f4 *a, int n) {
  for (int i = 0; i < n; i++) fa_mma_pack_rest(&a[i].x, &a[i].y), fa_mma_pack_rest(&a[i].z, &a[i].w);
}

#pragma omp end declare target

#endif
