/* In-kernel timeline (diagnosis only; build with -DFORKATTN_GPU_TIMELINE=ON).
 *
 * Every warp of a team records events, each an event id and the SM's
 * cycle counter (%clock64), into a device buffer; the first and last event
 * of a team carry the card's nanosecond timer (%globaltimer) and the SM id
 * instead, so teams on different SMs can be placed on one time axis. The
 * host copies the buffer out after one chosen call (FA_TL_LAUNCH)
 * and writes it raw; bench/timeline_report.py turns it into per-phase
 * cycles and the SMs' busy time.
 *
 * A mark is a clock read, an address and a store, with no branch: a
 * divergent branch near wgmma makes ptxas serialize every product of the
 * kernel (C7518), so teams past FA_TL_TEAMS write to a spill slot. In a
 * build without the option every mark is empty and the kernels' code is
 * unchanged. */
#ifndef FA_GPU_TIMELINE_H
#define FA_GPU_TIMELINE_H

#include <stddef.h>
#include <stdint.h>
#include <ompx.h>

#ifdef FA_GPU_TIMELINE

#define FA_TL_TEAMS 6144 /* teams that record; later teams write to the spill slot */
#define FA_TL_WARPS 8    /* recording warps a team: all of a two-warpgroup team */
#define FA_TL_CAP 512    /* events a warp; later events overwrite the last one */
#define FA_TL_WORDS ((size_t)(FA_TL_TEAMS + 1) * FA_TL_WARPS * FA_TL_CAP)

/* Event ids (8 bits). FA_TL_START and FA_TL_END hold (sm << 48 | globaltimer ns). */
enum {
  FA_TL_START = 1,    /* the team's first instruction */
  FA_TL_READY = 2,    /* Q loaded, ring started */
  FA_TL_TILE = 3,     /* iteration top */
  FA_TL_ARRIVED = 4,  /* tile's copies arrived (mbarrier) */
  FA_TL_ISSUED = 5,   /* products issued */
  FA_TL_S = 6,        /* S waited for (dQ: S of a 64-key half) */
  FA_TL_PV = 7,       /* P V waited for (dQ: dP of a half; dK/dV: the tile's products) */
  FA_TL_NEXT = 8,     /* iteration end: released, rescaled, packed */
  FA_TL_END = 9,      /* output written: the team's last event */
  FA_TL_BEGIN = 10,   /* right after FA_TL_START, on the cycle counter */
  FA_TL_FINISH = 11,  /* right before FA_TL_END, on the cycle counter */
  FA_TL_GRADS = 12,   /* dK/dV: the tile's P and dS stored for the products */
  FA_TL_NEXTQ = 13,   /* dK/dV: the next tile's statistics read, its copies waited for */
  FA_TL_TURN = 14,    /* dK/dV: this warpgroup's turn to issue products */
  FA_TL_ISSUED_S = 15, /* forward: S's products issued (P V's follow) */
  FA_TL_MAX = 16,      /* forward: the tile's row maxima */
  FA_TL_EXP = 17,      /* forward: the tile's exponentials and sums */
  FA_TL_RELEASED = 18, /* no kernel records it; reserved so recorded timelines decode */
  FA_TL_COMPUTED = 19, /* dK/dV: P and dS formed in registers */
  FA_TL_STORED = 20    /* dK/dV: P and dS stored to team memory and fenced */
};

#pragma omp declare target
extern __attribute__((visibility("protected"))) unsigned long long fa_tl_buf[FA_TL_WORDS];
#pragma omp end declare target

#pragma omp declare target
static inline unsigned long long fa_tl_clock(int global) {
  (void)global;
  return 0;
}
#pragma omp end declare target

#pragma omp begin declare variant match(device = {arch(nvptx64)})
static inline unsigned long long fa_tl_clock(int global) {
  unsigned long long t;
  if (global) {
    unsigned sm;
    __asm__ volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    __asm__ volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    return (unsigned long long)sm << 48 | (t & 0xffffffffffffull);
  }
  __asm__ volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t & 0xffffffffffffffull;
}
#pragma omp end declare variant

#pragma omp declare target
/* Record event ev as the n-th of the calling thread's warp. */
static inline __attribute__((always_inline)) void fa_tl_mark(int *n, int ev) {
  const int team = (int)ompx_block_id_x(), tid = (int)ompx_thread_id_x();
  const unsigned slot =
      team < FA_TL_TEAMS ? (unsigned)team * FA_TL_WARPS + (unsigned)tid / 32 : FA_TL_TEAMS * FA_TL_WARPS;
  const unsigned i = *n < FA_TL_CAP ? (unsigned)*n : FA_TL_CAP - 1;
  const unsigned long long t = fa_tl_clock(ev == FA_TL_START || ev == FA_TL_END);
  fa_tl_buf[slot * FA_TL_CAP + i] = (unsigned long long)ev << 56 | t;
  (*n)++;
}
#pragma omp end declare target

#define FA_TL_DECL int fa_tl_n_ = 0
#define FA_TL(ev) fa_tl_mark(&fa_tl_n_, (ev))
/* A helper's marks: the caller passes FA_TL_REF, the helper marks with FA_TL_AT(its pointer, ev). */
#define FA_TL_REF (&fa_tl_n_)
#define FA_TL_AT(n, ev) fa_tl_mark((n), (ev))

/* Host, around a launch of kernel `name`: on its call number
 * FORKATTN_GPU_TIMELINE_CALL (default 5) _begin clears the buffer and _end
 * copies it to the file "$FORKATTN_GPU_TIMELINE.name". Without the
 * variable: nothing. */
void fa_gpu_timeline_begin(int device, const char *name);
void fa_gpu_timeline_end(int device, const char *name);
#define FA_TL_LAUNCH(device, name, launch)                                                                    \
  do {                                                                                                        \
    fa_gpu_timeline_begin((device), (name));                                                                  \
    launch;                                                                                                   \
    fa_gpu_timeline_end((device), (name));                                                                    \
  } while (0)

#else
#define FA_TL_DECL ((void)0)
#define FA_TL(ev) ((void)0)
#define FA_TL_REF ((int *)0)
#define FA_TL_AT(n, ev) ((void)(n))
#define FA_TL_LAUNCH(device, name, launch) launch
#endif

#endif
