/* `forkattn info`: version, build, backends and devices, CPU topology (hwloc). */
#include <hwloc.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "forkattn.h"

static void print_topology(void) {
  hwloc_topology_t t;
  if (hwloc_topology_init(&t) || hwloc_topology_load(t)) {
    printf("cpu topology:  hwloc could not load the topology\n");
    return;
  }
  hwloc_obj_t root = hwloc_get_root_obj(t);
  const char *model = hwloc_obj_get_info_by_name(root, "CPUModel");
  hwloc_obj_t pkg = hwloc_get_obj_by_type(t, HWLOC_OBJ_PACKAGE, 0);
  if (!model && pkg) model = hwloc_obj_get_info_by_name(pkg, "CPUModel");
  printf("cpu model:     %s\n", model ? model : "unknown");
  printf("cpu topology:  %d package(s), %d NUMA node(s), %d core(s), %d PU(s)\n",
         hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE), hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE),
         hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE), hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU));
  hwloc_obj_type_t caches[3] = {HWLOC_OBJ_L1CACHE, HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L3CACHE};
  for (int i = 0; i < 3; i++) {
    int n = hwloc_get_nbobjs_by_type(t, caches[i]);
    hwloc_obj_t c = hwloc_get_obj_by_type(t, caches[i], 0);
    if (c) printf("cpu L%d cache:  %d x %llu KiB\n", i + 1, n, (unsigned long long)(c->attr->cache.size >> 10));
  }
  hwloc_topology_destroy(t);
}

int cmd_info(int argc, char **argv) {
  (void)argc;
  (void)argv;
  printf("forkattn:      %s (version number %u)\n", forkattn_version_string(), forkattn_version_number());
  printf("gpu offload:   %s\n", forkattn_build_has_offload() ? "built in" : "not built (CPU-only build)");
  if (forkattn_build_has_offload()) {
    const char *sync = getenv("FORKATTN_GPU_SYNC");
    const int known = sync && (!strcmp(sync, "auto") || !strcmp(sync, "spin") || !strcmp(sync, "yield") ||
                               !strcmp(sync, "blocking") || !strcmp(sync, "runtime"));
    printf("gpu wait:      %s%s (FORKATTN_GPU_SYNC=auto|spin|yield|blocking|runtime)\n", known ? sync : "auto",
           sync && !known ? ", an unknown value is taken as auto" : "");
  }
  printf("omp devices:   %d\n", omp_get_num_devices());
  forkattn_ctx *ctx = NULL;
  forkattn_status st = forkattn_ctx_create(&ctx, NULL);
  if (st) {
    printf("auto backend:  error: %s\n", forkattn_status_string(st));
  } else {
    printf("auto backend:  %s\n", forkattn_backend_name(forkattn_ctx_backend(ctx)));
    printf("  because:     %s\n", forkattn_ctx_backend_reason(ctx));
    if (forkattn_ctx_backend(ctx) == FORKATTN_BACKEND_GPU)
      printf("gpu kernels:   %s\n               (bf16/f16, head_dim 64 or 128, 16-byte rows, no kept set; "
             "FORKATTN_GPU_KERNELS=auto|mma|fp32, FORKATTN_GPU_PERSIST=auto|0|1|n|stream)\n",
             forkattn_ctx_gpu_kernels(ctx));
    printf("cpu threads:   %d\n", forkattn_ctx_threads(ctx));
    forkattn_ctx_destroy(ctx);
  }
  print_topology();
  return st ? 1 : 0;
}
