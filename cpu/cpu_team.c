/* The CPU kernels' parallel region. */
#include "cpu_team.h"

#include <omp.h>

#include "cpu_tile.h"
#include "hostinfo.h"

int fa_cpu_team_run(forkattn_ctx *ctx, int64_t ws_floats, size_t extra_bytes,
                    void (*body)(fa_cpu_ws *ws, void *arg), void *arg) {
  int failed = 0;
  if (ws_floats < 0) return -1; /* the caller's size formula overflowed (fa_cpu_ws_floats) */
  fa_note_workspace(ctx, (size_t)ctx->threads * sizeof(float) * (size_t)ws_floats + extra_bytes);
  fa_cpu_blas_single();
#pragma omp parallel num_threads(ctx->threads)
  {
    fa_host_binding bind;
    fa_host_bind_begin(&bind, ctx->bind_threads, omp_get_thread_num());
    fa_cpu_ws ws;
    int ok = fa_cpu_ws_init(&ws, ws_floats) == 0;
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (!failed) body(&ws, arg); /* every thread sees the same `failed`: no split team */
    if (ok) fa_cpu_ws_free(&ws);
    fa_host_bind_end(&bind);
  }
  fa_cpu_blas_restore();
  return failed ? -1 : 0;
}
