/* Device probe and memory through the OpenMP device API. */
#include <omp.h>
#include <stdio.h>

#include "alloc.h"
#include "gpu_backend.h"
#include "gpu_sync.h"
#include "gpu_team_memory.h"

int fa_gpu_probe(int device, char *why, size_t len) {
  int n = omp_get_num_devices();
  if (n <= 0) {
    snprintf(why, len, "no OpenMP offload device found (omp_get_num_devices() = 0)");
    return 0;
  }
  if (device >= n) {
    snprintf(why, len, "device %d requested but only %d OpenMP device(s) exist", device, n);
    return 0;
  }
  int on_device = 0, value = 0;
  /* A plain target region: if our image does not load on the device, the
   * runtime falls back to the host and on_device stays 0. */
#pragma omp target device(device) map(from : on_device, value)
  {
    on_device = !omp_is_initial_device();
    value = 42;
  }
  if (!on_device || value != 42) {
    snprintf(why, len,
             "%d OpenMP device(s) present but the library's device image did not run on device %d "
             "(incompatible image or driver; LIBOMPTARGET_INFO=-1 shows why)",
             n, device);
    return 0;
  }
  fa_gpu_sync_policy(device); /* the runtime has initialized the device by now */
  const size_t team = fa_gpu_team_memory_init(device);
  snprintf(why, len, "device %d of %d ran the probe kernel; team memory up to %zu KB", device, n, team / 1024);
  return 1;
}

void *fa_gpu_malloc(int device, size_t bytes) {
  return fa_alloc_inject_failure() ? NULL : omp_target_alloc(bytes, device);
}

void fa_gpu_free(int device, void *p) { omp_target_free(p, device); }

int fa_gpu_memcpy(int device, void *dst, int dst_dev, const void *src, int src_dev, size_t bytes) {
  if (!bytes) return 0;
  int host = omp_get_initial_device();
  return omp_target_memcpy(dst, src, bytes, 0, 0, dst_dev ? device : host, src_dev ? device : host) ? -1 : 0;
}
