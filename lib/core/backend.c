/* The backends this build has: the one place that names cpu/ and offload/. */
#include "backend.h"

#include "cpu_backend.h"
#ifdef FORKATTN_HAVE_OFFLOAD
#include "gpu_backend.h"
#endif

const fa_backend *fa_backend_get(forkattn_backend kind) {
  switch (kind) {
  case FORKATTN_BACKEND_CPU: return &fa_cpu_backend;
  case FORKATTN_BACKEND_GPU:
#ifdef FORKATTN_HAVE_OFFLOAD
    return &fa_gpu_backend;
#else
    return NULL;
#endif
  case FORKATTN_BACKEND_AUTO: break;
  }
  return NULL;
}
