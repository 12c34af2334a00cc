/* CPU topology through hwloc. The topology is loaded once per process. */
#include "hostinfo.h"

#include <hwloc.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>

static hwloc_topology_t fa_topo;
static int fa_topo_ok;

static void fa_topo_load(void) {
  if (hwloc_topology_init(&fa_topo) == 0 && hwloc_topology_load(fa_topo) == 0)
    fa_topo_ok = 1;
}

static hwloc_topology_t fa_topology(void) {
  /* pthread_once rather than `omp critical`: LLVM 19's libomp crashes in
   * __kmpc_end_critical under an OMPT tool (Archer) once the thread that first
   * used OpenMP has exited, and contexts may be created from any thread. */
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, fa_topo_load);
  return fa_topo_ok ? fa_topo : NULL;
}

int fa_host_physical_cores(void) {
  hwloc_topology_t t = fa_topology();
  int n = t ? hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE) : 0;
  if (n <= 0) n = omp_get_num_procs();
  return n > 0 ? n : 1;
}

int fa_host_hw_threads(void) {
  hwloc_topology_t t = fa_topology();
  int n = t ? hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU) : 0;
  if (n <= 0) n = omp_get_num_procs();
  return n > 0 ? n : 1;
}

void fa_host_describe(char *buf, size_t len) {
  hwloc_topology_t t = fa_topology();
  if (!t) {
    snprintf(buf, len, "hwloc unavailable; %d logical CPUs", omp_get_num_procs());
    return;
  }
  int pk = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE);
  int nu = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  int co = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
  int pu = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU);
  hwloc_obj_t l3 = hwloc_get_obj_by_type(t, HWLOC_OBJ_L3CACHE, 0);
  hwloc_obj_t l2 = hwloc_get_obj_by_type(t, HWLOC_OBJ_L2CACHE, 0);
  hwloc_obj_t root = hwloc_get_root_obj(t);
  const char *model = hwloc_obj_get_info_by_name(root, "CPUModel");
  if (!model) {
    hwloc_obj_t p = hwloc_get_obj_by_type(t, HWLOC_OBJ_PACKAGE, 0);
    model = p ? hwloc_obj_get_info_by_name(p, "CPUModel") : NULL;
  }
  snprintf(buf, len, "%s; %d package(s), %d NUMA node(s), %d core(s), %d PU(s), L2 %llu KiB, L3 %llu KiB",
           model ? model : "unknown CPU", pk, nu, co, pu,
           l2 ? (unsigned long long)(l2->attr->cache.size >> 10) : 0ULL,
           l3 ? (unsigned long long)(l3->attr->cache.size >> 10) : 0ULL);
}

void fa_host_bind_begin(fa_host_binding *b, int enable, int index) {
  b->saved = NULL;
  hwloc_topology_t t = enable ? fa_topology() : NULL;
  int n = t ? hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE) : 0;
  if (n <= 0) return;
  hwloc_obj_t core = hwloc_get_obj_by_type(t, HWLOC_OBJ_CORE, (unsigned)(index % n));
  hwloc_bitmap_t prev = hwloc_bitmap_alloc();
  if (!core || !prev || hwloc_get_cpubind(t, prev, HWLOC_CPUBIND_THREAD) ||
      hwloc_set_cpubind(t, core->cpuset, HWLOC_CPUBIND_THREAD)) {
    hwloc_bitmap_free(prev);
    return;
  }
  b->saved = prev;
}

void fa_host_bind_end(fa_host_binding *b) {
  if (!b->saved) return;
  hwloc_set_cpubind(fa_topology(), (hwloc_bitmap_t)b->saved, HWLOC_CPUBIND_THREAD);
  hwloc_bitmap_free((hwloc_bitmap_t)b->saved);
  b->saved = NULL;
}
