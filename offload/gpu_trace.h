/* FORKATTN_GPU_TRACE=1 (read at context creation, gpu_select.h): every GPU
 * attention call prints the wall time of its phases
 * (host planning and staging, each kernel launch, copies back) to stderr,
 * one line per call, to find time spent outside the kernels. The kernels
 * run synchronously, so a launch's time is the kernel plus its launch cost. */
#ifndef FORKATTN_GPU_TRACE_H
#define FORKATTN_GPU_TRACE_H

typedef struct fa_gpu_trace {
  int on;
  double t;       /* last mark (omp_get_wtime) */
  char line[256]; /* phases so far */
  int len;
} fa_gpu_trace;

/* Start a call's trace; on: the context's knob (else the marks do nothing). */
void fa_gpu_trace_begin(fa_gpu_trace *tr, int on);
/* Append "phase=<us since the last mark>" and mark. */
void fa_gpu_trace_mark(fa_gpu_trace *tr, const char *phase);
/* Print "forkattn gpu <call>: ..." with the total. */
void fa_gpu_trace_end(fa_gpu_trace *tr, const char *call);

#endif
