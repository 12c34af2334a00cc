/* The host's wait policy for the GPU (gpu_sync.h), through the CUDA driver
 * the offload runtime already loaded (dlopen with RTLD_NOLOAD: no new
 * dependency, and nothing happens under another offload plugin). */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_sync.h"

#define FA_SYNC_DEVICES 64
#define FA_CU_SCHED_AUTO 0x0u
#define FA_CU_SCHED_SPIN 0x1u
#define FA_CU_SCHED_YIELD 0x2u
#define FA_CU_SCHED_BLOCKING 0x4u
#define FA_CU_SCHED_MASK 0x7u

typedef int (*fa_cu_device_get)(int *dev, int ordinal);
typedef int (*fa_cu_ctx_state)(int dev, unsigned *flags, int *active);
typedef int (*fa_cu_ctx_set_flags)(int dev, unsigned flags);

static atomic_int fa_sync_done[FA_SYNC_DEVICES];

void fa_gpu_sync_policy(int device) {
  if (device < 0 || device >= FA_SYNC_DEVICES || atomic_exchange(&fa_sync_done[device], 1)) return;
  const char *e = getenv("FORKATTN_GPU_SYNC");
  int keep_set = 1; /* auto: only replace a blocking-sync context */
  unsigned want = FA_CU_SCHED_AUTO;
  if (e && !strcmp(e, "runtime")) return;
  if (e && !strcmp(e, "spin")) want = FA_CU_SCHED_SPIN, keep_set = 0;
  else if (e && !strcmp(e, "yield")) want = FA_CU_SCHED_YIELD, keep_set = 0;
  else if (e && !strcmp(e, "blocking")) want = FA_CU_SCHED_BLOCKING, keep_set = 0;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) return;
  fa_cu_device_get get = (fa_cu_device_get)dlsym(cuda, "cuDeviceGet");
  fa_cu_ctx_state state = (fa_cu_ctx_state)dlsym(cuda, "cuDevicePrimaryCtxGetState");
  fa_cu_ctx_set_flags set = (fa_cu_ctx_set_flags)dlsym(cuda, "cuDevicePrimaryCtxSetFlags_v2");
  int dev = 0, active = 0;
  unsigned flags = 0;
  if (get && state && set && !get(&dev, device) && !state(dev, &flags, &active) &&
      (!keep_set || (flags & FA_CU_SCHED_MASK) == FA_CU_SCHED_BLOCKING))
    set(dev, (flags & ~FA_CU_SCHED_MASK) | want); /* best effort: a failure leaves the runtime's policy */
  dlclose(cuda);
}
