/* The CPU kernels' parallel region: one OpenMP team per call with per-thread
 * scratch, OpenBLAS single-threaded inside, optional hwloc pinning. */
#ifndef FORKATTN_CPU_TEAM_H
#define FORKATTN_CPU_TEAM_H
#include "context_internal.h"
#include "cpu_workspace.h"

/* Run body(ws, arg) on every thread of a ctx->threads team, each with its own
 * scratch of ws_floats floats (recorded as workspace together with
 * extra_bytes allocated by the caller). body may contain orphaned `omp for`
 * loops. Returns 0, or -1 when ws_floats < 0 or a thread could not allocate its
 * scratch (body then runs on no thread). */
int fa_cpu_team_run(forkattn_ctx *ctx, int64_t ws_floats, size_t extra_bytes,
                    void (*body)(fa_cpu_ws *ws, void *arg), void *arg);

#endif
