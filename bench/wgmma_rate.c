/* wgmma_rate: what the tensor cores deliver for the product shapes the
 * wgmma kernels issue, alone: no softmax, no loads, operands fixed in team
 * memory. Answers whether a kernel's shape (a shared-memory A operand with
 * N = 32 or 64, 1 or 2 warpgroups an SM) caps its rate before any of its
 * other work does: a wgmma with both operands in team memory reads
 * A (64 x 16) and B (16 x N) each time, and at N <= 64 that is as many bytes
 * per product as team memory delivers (128 bytes a clock an SM).
 *
 * Each team is one warpgroup issuing the same group of products `iters`
 * times on its own operands; `teams/SM` teams run on every SM at once (team
 * memory sized so that no more fit). Operands are random finite bf16, not
 * zeros. TFLOP/s = 2 m n k summed over the products / time of the launch
 * (best of 5). Needs an sm_90a build (FORKATTN_HAVE_WGMMA) and the GPU.
 * Usage: wgmma_rate [iters] [SMs]  (default 4096, 132: an H200) */
#include <omp.h>
#include <ompx.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_team_memory.h"
#include "gpu_wgmma.h"

enum { SS32, SS64, SS128, RS128, FWD_TILE, DKV_TILE, SS64_X2, NKIND };
static const char *const kind_name[NKIND] = {
    "SS m64n32k16 x8 (S^T, dP^T of dK/dV)",  "SS m64n64k16 x8 (S of the forward, dQ)",
    "SS m64n128k16 x8 (S, 128-key tiles)",   "RS m64n128k16 x4 (P V, 64 keys)",
    "forward tile: SS n64 x8 + RS n128 x4",  "dK/dV tile: 2 x SS n32 x8 + 2 x RS n128 x2",
    "SS m64n64k16 x8, two groups in flight"};
/* multiply-adds (m n k) a warpgroup issues per iteration */
static const double kind_macs[NKIND] = {
    64.0 * 32 * 128, 64.0 * 64 * 128, 64.0 * 128 * 128, 64.0 * 128 * 64, 64.0 * 64 * 128 + 64.0 * 128 * 64,
    2 * 64.0 * 32 * 128 + 2 * 64.0 * 128 * 32, 2 * 64.0 * 64 * 128};

#define A_TILE 0             /* 64 x 128 rows: Q (or K) */
#define B_TILE (64 * 128)    /* 128 x 128 rows: K, V, dO */
#define TILE_ELEMS (B_TILE + 128 * 128)

#pragma omp declare target
/* fa_wg_acc_abt's products, accumulating into acc from the first k-step on:
 * a group that overwrote acc would be dead code to ptxas in a loop that
 * reads acc only at the end (it keeps one of the unrolled iterations). */
static inline __attribute__((always_inline)) void acc_abt(fa_f4 *acc, int atile, fa_smem sm, int tile, int N) {
  fa_wg_pin(acc, N / 8);
  fa_wg_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ks++)
    fa_wg_mma_ss(acc, N, sm, atile + (ks >> 2) * FA_MMA_ROWS * 64 + (ks & 3) * 16, sm,
                 tile + (ks >> 2) * N * 64 + (ks & 3) * 16, 0, 1);
}

static inline __attribute__((always_inline)) void run_kind(const int kind, fa_smem sm, int iters, float *sink) {
  fa_f4 s[16], t[16], o[16];
  fa_u4 pa[4];
  const int tid = ompx_thread_id_x();
  for (int i = 0; i < 16; i++) s[i] = t[i] = o[i] = fa_f4_zero();
  for (int i = 0; i < 4; i++) { /* A fragments: bf16 pairs of small finite values */
    const unsigned v = 0x3c003c00u ^ (unsigned)(tid * 2654435761u >> 12 & 0x007f007fu);
    pa[i].x = v, pa[i].y = v ^ 0x00010001u, pa[i].z = v ^ 0x80008000u, pa[i].w = v ^ 0x00030003u;
  }
  fa_wg_pin_u4(pa, 4);
  for (int it = 0; it < iters; it++) {
    switch (kind) {
    case SS32: acc_abt(s, A_TILE, sm, B_TILE, 32); break;
    case SS64: acc_abt(s, A_TILE, sm, B_TILE, 64); break;
    case SS128: acc_abt(s, A_TILE, sm, B_TILE, 128); break;
    case RS128: fa_wg_acc_ab(o, pa, sm, B_TILE, 64, 128, 128, 0); break;
    case FWD_TILE:
      acc_abt(s, A_TILE, sm, B_TILE, 64);
      fa_wg_acc_ab(o, pa, sm, B_TILE, 64, 128, 128, 0);
      break;
    case DKV_TILE:
      acc_abt(s, A_TILE, sm, B_TILE, 32);
      acc_abt(t, A_TILE, sm, B_TILE + 32 * 128, 32);
      fa_wg_acc_ab(o, pa, sm, B_TILE, 32, 128, 128, 0);
      fa_wg_acc_ab(o, pa + 2, sm, B_TILE, 32, 128, 128, 0);
      break;
    default: /* SS64_X2: the second group is issued before the first is waited on */
      acc_abt(s, A_TILE, sm, B_TILE, 64);
      fa_wg_commit();
      acc_abt(t, A_TILE, sm, B_TILE + 64 * 128, 64);
      fa_wg_commit();
      fa_wg_wait(1);
      fa_wg_pin(s, 8);
      continue;
    }
    fa_wg_commit();
    fa_wg_wait(0);
    fa_wg_pin(s, 16), fa_wg_pin(t, 16), fa_wg_pin(o, 16);
  }
  fa_wg_wait(0);
  fa_wg_pin(s, 16), fa_wg_pin(t, 16), fa_wg_pin(o, 16);
  float acc = 0.0f;
  for (int i = 0; i < 16; i++) acc += s[i].x + t[i].y + o[i].z;
  if (acc == 12345.678f) *sink = acc; /* keeps the products live; never true for these operands */
}
#pragma omp end declare target

/* Seconds of one launch of `teams` warpgroup teams with `smem` bytes of team memory each. */
static double launch(int kind, int teams, size_t smem, int iters, float *sink) {
  const double t0 = omp_get_wtime();
#pragma omp target teams ompx_bare num_teams(teams) thread_limit(128) ompx_dyn_cgroup_mem(smem) \
    firstprivate(kind, iters, sink)
  {
    unsigned short *p = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();
    p += fa_wg_align(fa_smem_of(p));
    const int tid = ompx_thread_id_x();
    for (int i = tid; i < TILE_ELEMS; i += 128) { /* bf16 in [-1, 1), never zero tiles */
      const unsigned h = (unsigned)(i + 7919 * ompx_block_id_x()) * 2654435761u;
      p[i] = (unsigned short)(0x3f80u - (h >> 25)) ^ (unsigned short)(h >> 16 & 0x8000u);
    }
    fa_fence_proxy_async(); /* generic-proxy writes, read by the tensor cores */
    ompx_sync_block_acq_rel();
    const fa_smem sm = fa_smem_of(p);
    switch (kind) { /* one instantiation per kind: the accumulators stay in registers */
    case SS32: run_kind(SS32, sm, iters, sink); break;
    case SS64: run_kind(SS64, sm, iters, sink); break;
    case SS128: run_kind(SS128, sm, iters, sink); break;
    case RS128: run_kind(RS128, sm, iters, sink); break;
    case FWD_TILE: run_kind(FWD_TILE, sm, iters, sink); break;
    case DKV_TILE: run_kind(DKV_TILE, sm, iters, sink); break;
    default: run_kind(SS64_X2, sm, iters, sink); break;
    }
  }
  return omp_get_wtime() - t0;
}

int main(int argc, char **argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 4096, sms = argc > 2 ? atoi(argv[2]) : 132;
  if (iters < 1 || sms < 1 || omp_get_num_devices() < 1) {
    fprintf(stderr, "usage: wgmma_rate [iters] [SMs]; needs a GPU\n");
    return 2;
  }
  const int dev = omp_get_default_device();
  float *sink = omp_target_alloc(sizeof(float), dev);
  if (!sink || fa_gpu_team_memory_init(dev) < 150 * 1024) { /* launches past 48 KB of team memory */
    fprintf(stderr, "wgmma_rate: no device memory, or team memory limited to %zu bytes\n", fa_gpu_team_memory(dev));
    return 1;
  }
  printf("wgmma_rate: %d iterations a team, %d SMs, TFLOP/s (best of 5 launches)\n", iters, sms);
  printf("%-46s %12s %12s\n", "product group", "1 team/SM", "2 teams/SM");
  for (int kind = 0; kind < NKIND; kind++) {
    double rate[2];
    for (int tps = 1; tps <= 2; tps++) {
      /* 1 team: 150 KB (a second one does not fit); 2 teams: 100 KB (a third does not) */
      const size_t smem = tps == 1 ? 150 * 1024 : 100 * 1024;
      const int teams = sms * tps;
      launch(kind, teams, smem, 16, sink); /* warm-up: module load, clocks */
      double best = 1e30;
      for (int r = 0; r < 5; r++) {
        const double s = launch(kind, teams, smem, iters, sink);
        if (s < best) best = s;
      }
      rate[tps - 1] = 2.0 * kind_macs[kind] * iters * teams / best / 1e12;
    }
    printf("%-46s %12.1f %12.1f\n", kind_name[kind], rate[0], rate[1]);
  }
  omp_target_free(sink, dev);
  return 0;
}
