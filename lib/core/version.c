/* Version, status and backend names. */
#include "backend.h"

#define FA_STR2(x) #x
#define FA_STR(x) FA_STR2(x)

unsigned forkattn_version_number(void) { return FORKATTN_VERSION_NUMBER; }

const char *forkattn_version_string(void) {
  return FA_STR(FORKATTN_VERSION_MAJOR) "." FA_STR(FORKATTN_VERSION_MINOR) "." FA_STR(
      FORKATTN_VERSION_PATCH);
}

const char *forkattn_status_string(forkattn_status status) {
  switch (status) {
  case FORKATTN_OK: return "ok";
  case FORKATTN_ERR_INVALID_ARGUMENT: return "invalid argument";
  case FORKATTN_ERR_OUT_OF_MEMORY: return "out of memory";
  case FORKATTN_ERR_UNSUPPORTED: return "unsupported";
  case FORKATTN_ERR_BACKEND_UNAVAILABLE: return "backend unavailable";
  case FORKATTN_ERR_DEVICE: return "device error";
  case FORKATTN_ERR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

const char *forkattn_backend_name(forkattn_backend backend) {
  switch (backend) {
  case FORKATTN_BACKEND_AUTO: return "auto";
  case FORKATTN_BACKEND_CPU: return "cpu";
  case FORKATTN_BACKEND_GPU: return "gpu";
  }
  return "unknown";
}

int forkattn_build_has_offload(void) { return fa_backend_get(FORKATTN_BACKEND_GPU) != NULL; }
