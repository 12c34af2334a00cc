/* CPU topology through hwloc: physical core count, a one-line description,
 * and optional pinning of worker threads to cores. */
#ifndef FORKATTN_HOSTINFO_H
#define FORKATTN_HOSTINFO_H
#include <stddef.h>

/* Number of physical cores (>= 1; falls back to omp_get_num_procs()). */
int fa_host_physical_cores(void);
/* "N packages, C cores, P PUs, L3 ... " into buf. */
void fa_host_describe(char *buf, size_t len);
/* Pin the calling thread to core (index modulo the number of cores); 0 on success. */
int fa_host_bind_thread_to_core(int index);

#endif
