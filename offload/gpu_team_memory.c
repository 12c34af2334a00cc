/* Team memory past 48 KB (gpu_team_memory.h): a forwarder in the offload
 * runtime's cuLaunchKernel slot, through the CUDA driver the runtime already
 * loaded (dlopen with RTLD_NOLOAD: no new dependency). */
#define _GNU_SOURCE /* dl_iterate_phdr */
#include <dlfcn.h>
#include <link.h>
#include <omp.h>
#include <ompx.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_launch_copy.h"
#include "gpu_launch_direct.h"
#include "gpu_team_memory.h"

#define FA_TM_DEVICES 64
#define FA_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define FA_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
#define FA_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
/* The check kernel's team memory: past the default, within every GPU that
 * allows more (sm_70 and later: 96 KB or more). */
#define FA_TM_CHECK_BYTES (64 * 1024)

typedef int (*fa_cu_launch)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned smem, void *stream, void **params, void **extra);
typedef int (*fa_cu_set_attr)(void *f, int attr, int value);
typedef int (*fa_cu_device_get)(int *dev, int ordinal);
typedef int (*fa_cu_device_attr)(int *value, int attr, int dev);

static fa_cu_launch fa_tm_launch; /* the driver's cuLaunchKernel */
static fa_cu_set_attr fa_tm_set;  /* the driver's cuFuncSetAttribute */
static int fa_tm_installed;       /* 1: the forwarder sits in the runtime's table */
static pthread_once_t fa_tm_once = PTHREAD_ONCE_INIT;
static void *fa_tm_cuda; /* for fa_tm_install_once */
/* Per device: 0 not yet, 1 being found (other callers wait), 2 found. */
static atomic_int fa_tm_state[FA_TM_DEVICES];
static size_t fa_tm_bytes[FA_TM_DEVICES];
static int fa_tm_sms[FA_TM_DEVICES];

/* cuLaunchKernel as the runtime calls it: on the caller's stream while this
 * thread's launches are routed (gpu_stream.h), else the runtime's; the copies this thread queued for
 * its next launch go first on the launch's stream (gpu_launch_copy.h); a
 * launch asking for more than the default team memory first raises its
 * kernel's limit (per call: the driver keeps the value per function, and
 * setting it costs far less than a launch). */
static int fa_tm_launch_on(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned smem, void *stream, void **params, void **extra) {
  const int rc = fa_gpu_launch_copies_issue(stream);
  if (rc) return rc;
  if (smem > FA_GPU_TEAM_MEMORY_DEFAULT) fa_tm_set(f, FA_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem);
  return fa_tm_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra);
}

static int fa_tm_forward(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned smem, void *stream, void **params, void **extra) {
  fa_gpu_direct_observe(f, gx, gy, gz, bx, by, bz, smem, params, extra);
  return fa_tm_launch_on(f, gx, gy, gz, bx, by, bz, smem, fa_gpu_launch_stream(stream), params, extra);
}

int fa_gpu_launch_driver(void *f, unsigned grid, unsigned threads, unsigned smem, void *stream, void **params) {
  return fa_tm_launch_on(f, grid, 1, 1, threads, 1, 1, smem, stream, params, NULL);
}

typedef struct fa_tm_scan {
  uintptr_t want, put;
  int replaced;
} fa_tm_scan;

/* Inside a PT_GNU_RELRO range of the object (read-only after relocation). */
static int fa_tm_in_relro(const struct dl_phdr_info *info, uintptr_t a) {
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *p = &info->dlpi_phdr[i];
    if (p->p_type == PT_GNU_RELRO && a >= info->dlpi_addr + p->p_vaddr &&
        a < info->dlpi_addr + p->p_vaddr + p->p_memsz)
      return 1;
  }
  return 0;
}

/* Every pointer-sized word equal to the driver's cuLaunchKernel in the
 * runtime's writable segments (its dlsym table) becomes the forwarder. A
 * word that only happens to hold the same value is replaced by a function
 * that behaves the same. */
static int fa_tm_patch(struct dl_phdr_info *info, size_t size, void *arg) {
  (void)size;
  fa_tm_scan *s = arg;
  if (!info->dlpi_name || !strstr(info->dlpi_name, "libomptarget.so")) return 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *p = &info->dlpi_phdr[i];
    if (p->p_type != PT_LOAD || !(p->p_flags & PF_W)) continue;
    uintptr_t a = (info->dlpi_addr + p->p_vaddr + 7) & ~(uintptr_t)7;
    const uintptr_t end = info->dlpi_addr + p->p_vaddr + p->p_memsz;
    for (; a + sizeof(uintptr_t) <= end; a += sizeof(uintptr_t)) {
      _Atomic uintptr_t *w = (_Atomic uintptr_t *)a;
      if (atomic_load_explicit(w, memory_order_relaxed) == s->want && !fa_tm_in_relro(info, a)) {
        atomic_store(w, s->put);
        s->replaced++;
      }
    }
  }
  return 0;
}

/* Install the forwarder (once per process, whichever device asks first). */
static void fa_tm_install_once(void) {
  fa_tm_launch = (fa_cu_launch)dlsym(fa_tm_cuda, "cuLaunchKernel");
  fa_tm_set = (fa_cu_set_attr)dlsym(fa_tm_cuda, "cuFuncSetAttribute");
  if (!fa_tm_launch || !fa_tm_set) return;
  fa_tm_scan s = {(uintptr_t)fa_tm_launch, (uintptr_t)fa_tm_forward, 0};
  dl_iterate_phdr(fa_tm_patch, &s);
  fa_tm_installed = s.replaced > 0;
  if (!fa_tm_installed) return;
  fa_gpu_launch_copy_init(dlsym(fa_tm_cuda, "cuMemcpyHtoDAsync_v2"));
  const fa_direct_driver d = {
      .param_info = (int (*)(void *, size_t, size_t *, size_t *))dlsym(fa_tm_cuda, "cuFuncGetParamInfo"),
      .ctx_get = (int (*)(void **))dlsym(fa_tm_cuda, "cuCtxGetCurrent"),
      .ctx_push = (int (*)(void *))dlsym(fa_tm_cuda, "cuCtxPushCurrent_v2"),
      .ctx_pop = (int (*)(void **))dlsym(fa_tm_cuda, "cuCtxPopCurrent_v2"),
      .launch = fa_gpu_launch_driver};
  fa_gpu_direct_init(&d);
}

/* A launch with FA_TM_CHECK_BYTES of team memory: every word written by one
 * thread and read back by another after a barrier. 1 when all matched. */
static int fa_tm_check(int device) {
  int bad = 0;
  const int words = FA_TM_CHECK_BYTES / 4;
#pragma omp target teams ompx_bare num_teams(2) thread_limit(128) ompx_dyn_cgroup_mem(FA_TM_CHECK_BYTES) \
    device(device) map(tofrom : bad)
  {
    unsigned *m = (unsigned *)llvm_omp_target_dynamic_shared_alloc();
    const int t = ompx_thread_id_x();
    const unsigned team = (unsigned)ompx_block_id_x();
    for (int i = t; i < words; i += 128) m[i] = (unsigned)i * 2654435761u + team;
    ompx_sync_block_acq_rel();
    int good = 1;
    for (int i = 127 - t; i < words; i += 128) good &= m[i] == (unsigned)i * 2654435761u + team;
    if (!good) {
#pragma omp atomic write
      bad = 1;
    }
  }
  return !bad;
}

size_t fa_gpu_team_memory_init(int device) {
  if (device < 0 || device >= FA_TM_DEVICES) return FA_GPU_TEAM_MEMORY_DEFAULT;
  int idle = 0;
  if (!atomic_compare_exchange_strong(&fa_tm_state[device], &idle, 1)) {
    while (atomic_load(&fa_tm_state[device]) != 2) sched_yield(); /* another context's probe is finding it */
    return fa_tm_bytes[device];
  }
  size_t bytes = FA_GPU_TEAM_MEMORY_DEFAULT;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (cuda) {
    fa_cu_device_get get = (fa_cu_device_get)dlsym(cuda, "cuDeviceGet");
    fa_cu_device_attr attr = (fa_cu_device_attr)dlsym(cuda, "cuDeviceGetAttribute");
    int dev = 0, optin = 0;
    if (get && attr && !get(&dev, device) &&
        !attr(&optin, FA_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev) &&
        !attr(&fa_tm_sms[device], FA_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) &&
        (size_t)optin >= FA_TM_CHECK_BYTES) {
      fa_tm_cuda = cuda;
      pthread_once(&fa_tm_once, fa_tm_install_once);
      if (fa_tm_installed && fa_tm_check(device)) bytes = (size_t)optin;
    }
    dlclose(cuda); /* the runtime keeps the driver loaded */
  }
  fa_tm_bytes[device] = bytes;
  atomic_store(&fa_tm_state[device], 2);
  return bytes;
}

int fa_gpu_launch_forwarded(void) { return fa_tm_installed; }

int fa_gpu_sms(int device) {
  if (device < 0 || device >= FA_TM_DEVICES || atomic_load(&fa_tm_state[device]) != 2) return 0;
  return fa_tm_sms[device];
}

size_t fa_gpu_team_memory(int device) {
  if (device < 0 || device >= FA_TM_DEVICES || atomic_load(&fa_tm_state[device]) != 2)
    return FA_GPU_TEAM_MEMORY_DEFAULT;
  return fa_tm_bytes[device];
}
