/* Host-to-device copies issued on the next launch's stream (gpu_launch_copy.h). */
#include <stdint.h>

#include "gpu_launch_copy.h"

typedef int (*fa_cu_htod_async)(unsigned long long dst, const void *src, size_t bytes, void *stream);

typedef struct fa_launch_copy_item {
  void *dev;
  const void *host;
  size_t bytes;
} fa_launch_copy_item;

static fa_cu_htod_async fa_lc_copy; /* set once, before any call can queue */
static _Thread_local fa_launch_copy_item fa_lc_queue[FA_LAUNCH_COPIES];
static _Thread_local int fa_lc_n;
static _Thread_local void *fa_lc_route; /* valid while fa_lc_routed */
static _Thread_local int fa_lc_routed;

void fa_gpu_launch_copy_init(void *cu_memcpy_htod_async) {
  fa_lc_copy = (fa_cu_htod_async)(uintptr_t)cu_memcpy_htod_async;
}

int fa_gpu_launch_copy_room(void) { return fa_lc_copy && fa_lc_n < FA_LAUNCH_COPIES; }

int fa_gpu_launch_copy(void *dev, const void *host, size_t bytes) {
  if (!fa_gpu_launch_copy_room()) return 0;
  fa_lc_queue[fa_lc_n++] = (fa_launch_copy_item){dev, host, bytes};
  return 1;
}

int fa_gpu_launch_copies_issue(void *stream) {
  int rc = 0;
  for (int i = 0; i < fa_lc_n && !rc; i++)
    if (fa_lc_queue[i].bytes)
      rc = fa_lc_copy((unsigned long long)(uintptr_t)fa_lc_queue[i].dev, fa_lc_queue[i].host, fa_lc_queue[i].bytes,
                      stream);
  fa_lc_n = 0;
  return rc;
}

void fa_gpu_launch_route(void *stream) {
  fa_lc_route = stream;
  fa_lc_routed = 1;
}

void fa_gpu_launch_unroute(void) { fa_lc_routed = 0; }

int fa_gpu_launch_routed(void) { return fa_lc_routed; }

void *fa_gpu_launch_stream(void *runtime_stream) { return fa_lc_routed ? fa_lc_route : runtime_stream; }

void fa_gpu_launch_copies_drop(const void *const *hosts, int n) {
  int kept = 0;
  for (int i = 0; i < fa_lc_n; i++) {
    int mine = 0;
    for (int j = 0; j < n && !mine; j++) mine = fa_lc_queue[i].host == hosts[j];
    if (!mine) fa_lc_queue[kept++] = fa_lc_queue[i];
  }
  fa_lc_n = kept;
}
