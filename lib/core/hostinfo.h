/* CPU topology through hwloc: physical core count, a one-line description,
 * and optional pinning of worker threads to cores. */
#ifndef FORKATTN_HOSTINFO_H
#define FORKATTN_HOSTINFO_H
#include <stddef.h>

/* Number of physical cores (>= 1; falls back to omp_get_num_procs()). */
int fa_host_physical_cores(void);
/* Number of hardware threads (PUs) this process may run on (>= 1; falls back
 * to omp_get_num_procs()). */
int fa_host_hw_threads(void);
/* "N packages, C cores, P PUs, L3 ... " into buf. */
void fa_host_describe(char *buf, size_t len);
/* Pin the calling thread to core (index modulo the number of cores) for the
 * duration of one call, then give it back its previous affinity: worker
 * threads (the caller's own thread included) are never left pinned. */
typedef struct fa_host_binding {
  void *saved; /* hwloc_bitmap_t of the previous binding, NULL when not bound */
} fa_host_binding;
void fa_host_bind_begin(fa_host_binding *b, int enable, int index);
void fa_host_bind_end(fa_host_binding *b);

#endif
