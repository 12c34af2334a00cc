/* Shared-vs-replicated measurement used by demo and bench. */
#ifndef FORKATTN_TOOLS_MEASURE_H
#define FORKATTN_TOOLS_MEASURE_H
#include "options.h"

typedef struct tool_timing {
  double fwd_ms, fwdbwd_ms; /* medians */
  double tensor_bytes;      /* q, k, v, o, dout, dq, dk, dv, lse */
  double workspace_bytes;   /* library scratch, peak */
  double flops;             /* useful forward FLOPs */
} tool_timing;

typedef struct tool_result {
  char backend[16];
  char reason[512];
  tool_timing shared, rep;
  tool_errors err;
  int have_rep;
} tool_result;

/* Build the group, time shared (and replicated unless o->no_replicated) on
 * the requested backend, check shared against replicated. 0 on success. */
int tool_measure(const tool_opts *o, tool_result *r);
#endif
