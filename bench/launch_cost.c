/* launch_cost: what the host pays per OpenMP offload launch and copy, with
 * kernels that do nothing, so a synchronous library call's time outside its
 * kernels can be split into its parts (docs/gpu-kernels.md, "The launch path").
 *
 * Each line is the median over `reps` calls (after 20 warm-ups) of the wall
 * time of one step, in microseconds:
 *   - an empty `target teams ompx_bare` region (one team), synchronous;
 *   - the same with a 512-byte firstprivate struct (libomptarget copies it);
 *   - the same asking for 100 KB of team memory (the forwarder of
 *     gpu_team_memory.c sets the kernel's limit on each such launch);
 *   - the firstprivate region carrying a 4 KB copy (gpu_launch_copy.h) from
 *     pageable and from pinned memory;
 *   - two empty regions with nowait, then one taskwait;
 *   - omp_target_memcpy host to device of 4 KB and of 64 KB, from pageable
 *     memory and from pinned memory (llvm_omp_target_alloc_host);
 *   - omp_target_alloc + omp_target_free of 1 MB.
 * The host waits as the library's contexts make it wait (gpu_sync.h:
 * FORKATTN_GPU_SYNC, e.g. =runtime for the offload runtime's blocking sync).
 * Needs an offload build and the GPU. Usage: launch_cost [reps] (default 2000) */
#include <omp.h>
#include <ompx.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_launch_copy.h"
#include "gpu_sync.h"
#include "gpu_team_memory.h"

void *llvm_omp_target_alloc_host(size_t size, int device_num);
void llvm_omp_target_free_host(void *ptr, int device_num);

typedef struct lc_args {
  float v[128];
} lc_args;

static int lc_cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

enum {
  EMPTY,
  FIRSTPRIVATE,
  TEAM_MEMORY,
  CARRY_4K,
  CARRY_4K_PINNED,
  NOWAIT_PAIR,
  COPY_4K,
  COPY_64K,
  COPY_4K_PINNED,
  COPY_64K_PINNED,
  ALLOC_1M,
  NSTEP
};
static const char *const lc_name[NSTEP] = {"empty region",
                                           "region + 512 B firstprivate",
                                           "region + firstprivate + 100 KB team memory",
                                           "region + firstprivate + carried 4 KB pageable",
                                           "region + firstprivate + carried 4 KB pinned",
                                           "two nowait regions + taskwait",
                                           "memcpy 4 KB pageable -> device",
                                           "memcpy 64 KB pageable -> device",
                                           "memcpy 4 KB pinned -> device",
                                           "memcpy 64 KB pinned -> device",
                                           "target alloc + free 1 MB"};

static void lc_step(int step, int dev, lc_args *args, char *pageable, char *pinned, char *dbuf) {
  const lc_args a = *args;
  switch (step) {
  case EMPTY:
#pragma omp target teams ompx_bare num_teams(1) thread_limit(32) device(dev)
    { (void)0; }
    break;
  case CARRY_4K:
  case CARRY_4K_PINNED:
    /* gpu_launch_copy.h; without the launch forwarder: a synchronous copy first */
    if (!fa_gpu_launch_copy(dbuf, step == CARRY_4K ? pageable : pinned, 4096) &&
        omp_target_memcpy(dbuf, step == CARRY_4K ? pageable : pinned, 4096, 0, 0, dev, omp_get_initial_device()))
      abort();
    /* fall through */
  case FIRSTPRIVATE:
#pragma omp target teams ompx_bare num_teams(1) thread_limit(32) device(dev) firstprivate(a)
    {
      if (a.v[ompx_thread_id_x()] == -1.0f) __builtin_trap(); /* never: the values are positive */
    }
    break;
  case TEAM_MEMORY:
#pragma omp target teams ompx_bare num_teams(1) thread_limit(32) device(dev) firstprivate(a) \
    ompx_dyn_cgroup_mem(100 * 1024)
    {
      if (a.v[ompx_thread_id_x()] == -1.0f) __builtin_trap();
    }
    break;
  case NOWAIT_PAIR:
#pragma omp target teams ompx_bare num_teams(1) thread_limit(32) device(dev) nowait
    { (void)0; }
#pragma omp target teams ompx_bare num_teams(1) thread_limit(32) device(dev) nowait
    { (void)0; }
#pragma omp taskwait
    break;
  case COPY_4K:
  case COPY_64K:
  case COPY_4K_PINNED:
  case COPY_64K_PINNED: {
    const size_t n = step == COPY_4K || step == COPY_4K_PINNED ? 4096 : 65536;
    const char *src = step == COPY_4K || step == COPY_64K ? pageable : pinned;
    if (omp_target_memcpy(dbuf, src, n, 0, 0, dev, omp_get_initial_device())) abort();
    break;
  }
  case ALLOC_1M: {
    void *p = omp_target_alloc(1 << 20, dev);
    if (!p) abort();
    omp_target_free(p, dev);
    break;
  }
  }
}

int main(int argc, char **argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 2000, dev = omp_get_default_device();
  if (reps < 1 || omp_get_num_devices() < 1) {
    fprintf(stderr, "launch_cost: needs reps >= 1 and an offload device\n");
    return 2;
  }
#pragma omp target device(dev)
  { (void)0; } /* the runtime's device initialization, before the forwarder goes in */
  fa_gpu_sync_policy(dev);
  if (fa_gpu_team_memory_init(dev) < 100 * 1024) {
    fprintf(stderr, "launch_cost: no 100 KB of team memory on device %d\n", dev);
    return 1;
  }
  lc_args args;
  for (int i = 0; i < 128; i++) args.v[i] = 1.0f + (float)i;
  char *pageable = malloc(65536), *pinned = llvm_omp_target_alloc_host(65536, dev);
  char *dbuf = omp_target_alloc(65536, dev);
  double *t = malloc(sizeof *t * (size_t)reps);
  if (!pageable || !pinned || !dbuf || !t) return 1;
  memset(pageable, 1, 65536);
  memset(pinned, 2, 65536);
  printf("launch_cost: median wall time of one step over %d calls, device %d\n", reps, dev);
  for (int s = 0; s < NSTEP; s++) {
    for (int i = 0; i < 20; i++) lc_step(s, dev, &args, pageable, pinned, dbuf);
    for (int i = 0; i < reps; i++) {
      const double t0 = omp_get_wtime();
      lc_step(s, dev, &args, pageable, pinned, dbuf);
      t[i] = (omp_get_wtime() - t0) * 1e6;
    }
    qsort(t, (size_t)reps, sizeof *t, lc_cmp);
    printf("  %-44s %8.2f us (p10 %.2f, p90 %.2f)\n", lc_name[s], t[reps / 2], t[reps / 10], t[reps * 9 / 10]);
  }
  omp_target_free(dbuf, dev);
  llvm_omp_target_free_host(pinned, dev);
  free(pageable);
  free(t);
  return 0;
}
