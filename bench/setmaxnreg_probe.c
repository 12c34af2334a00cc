/* Compile-only probe (no device needed): does ptxas honour setmaxnreg in an
 * OpenMP offload kernel? FlashAttention-3 gives a producer warpgroup ~40
 * registers and its two consumer warpgroups ~232 with setmaxnreg; a
 * 384-thread team needs that, since 65536 / 384 leaves 170 each.
 *
 *   clang-19 -O3 -fopenmp --offload-arch=sm_90a -fopenmp-cuda-mode \
 *     --libomptarget-nvptx-bc-path=/usr/lib/llvm-19/lib/libomptarget-nvptx-sm_90.bc \
 *     --cuda-path=<build>/forkattn-cuda-root -Xoffload-linker -v bench/setmaxnreg_probe.c
 *
 * With clang 19 and CUDA 13 ptxas prints "(C7504) Potential Performance
 * Loss: 'setmaxnreg' ignored to maintain compatibility across compilation
 * units": the offload link runs ptxas with -c (relocatable), with and
 * without -foffload-lto, and the kernel gets one register count for all
 * its threads (206, or 254 under LTO: more than a 384-thread team can
 * launch with). bench/NOTES-gpu.md, v2.42. */
#include <omp.h>
#include <ompx.h>
#include <stdio.h>
#include <stdlib.h>

#pragma omp begin declare variant match(device = {arch(nvptx64)})
static inline void probe_inc(void) { __asm__ volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory"); }
static inline void probe_dec(void) { __asm__ volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory"); }
#pragma omp end declare variant
#pragma omp declare target
static inline void probe_inc(void) {}
static inline void probe_dec(void) {}
#pragma omp end declare target

int main(void) {
  const int n = 384 * 132;
  float *out = malloc(sizeof(float) * n);
  if (!out) return 1;
  float seed = 1.0f;
#pragma omp target teams ompx_bare num_teams(132) thread_limit(384) map(from : out[0 : n]) firstprivate(seed)
  {
    const int tid = ompx_thread_id_x(), wg = tid / 128;
    float r = 0;
    if (wg == 0) { /* the producer: few registers */
      probe_dec();
      for (int i = 0; i < 100; i++) r += seed * i;
    } else { /* a consumer: 200 live accumulators */
      probe_inc();
      float acc[200];
#pragma unroll
      for (int k = 0; k < 200; k++) acc[k] = seed * (float)(k + tid);
      for (int it = 0; it < 1000; it++) {
#pragma unroll
        for (int k = 0; k < 200; k++) acc[k] = acc[k] * acc[(k + 1) % 200] + seed;
      }
#pragma unroll
      for (int k = 0; k < 200; k++) r += acc[k];
    }
    out[ompx_block_id_x() * 384 + tid] = r;
  }
  printf("%f\n", out[5]);
  free(out);
  return 0;
}
