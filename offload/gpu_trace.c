/* Phase timing of GPU calls (gpu_trace.h). */
#include <omp.h>
#include <stdio.h>

#include "gpu_trace.h"

void fa_gpu_trace_begin(fa_gpu_trace *tr, int on) {
  tr->on = on;
  tr->len = 0;
  tr->line[0] = '\0';
  tr->t = tr->on ? omp_get_wtime() : 0.0;
}

void fa_gpu_trace_mark(fa_gpu_trace *tr, const char *phase) {
  if (!tr->on) return;
  const double now = omp_get_wtime();
  const int room = (int)sizeof tr->line - tr->len;
  const int n = snprintf(tr->line + tr->len, (size_t)(room > 0 ? room : 0), " %s=%.1f", phase, (now - tr->t) * 1e6);
  if (n > 0 && n < room) tr->len += n;
  tr->t = now;
}

void fa_gpu_trace_end(fa_gpu_trace *tr, const char *call) {
  if (tr->on) fprintf(stderr, "forkattn gpu %s (us):%s\n", call, tr->line);
}
