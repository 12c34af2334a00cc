/* Time shared-prompt attention against the replicated batch on one backend. */
#include "measure.h"

#include <stdio.h>
#include <string.h>

static int tool_time(forkattn_ctx *ctx, tool_group *g, const tool_opts *o, tool_timing *t) {
  double fwd[o->repeats], both[o->repeats];
  if (tool_group_run(ctx, g, &o->shape, 1)) return -1; /* warm-up (and results for checks) */
  for (int i = 0; i < o->repeats; i++) {
    double t0 = tool_now();
    if (tool_group_run(ctx, g, &o->shape, 0)) return -1;
    double t1 = tool_now();
    if (tool_group_run(ctx, g, &o->shape, 1)) return -1;
    double t2 = tool_now();
    fwd[i] = (t1 - t0) * 1e3;
    both[i] = (t2 - t1) * 1e3;
  }
  t->fwd_ms = tool_median(fwd, o->repeats);
  t->fwdbwd_ms = tool_median(both, o->repeats);
  t->tensor_bytes = tool_tensor_bytes(&o->shape, g->rows);
  t->workspace_bytes = (double)forkattn_ctx_peak_workspace(ctx);
  return tool_group_fetch(ctx, g, &o->shape);
}

static int tool_fail(forkattn_ctx *ctx, const char *what) {
  fprintf(stderr, "forkattn: %s failed: %s\n", what, ctx ? forkattn_ctx_last_error(ctx) : "");
  return -1;
}

int tool_measure(const tool_opts *o, tool_result *r) {
  memset(r, 0, sizeof *r);
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co);
  co.backend = o->backend;
  forkattn_ctx *cs = NULL, *cr = NULL;
  if (forkattn_ctx_create(&cs, &co) || forkattn_ctx_create(&cr, &co)) {
    forkattn_ctx_destroy(cs);
    fprintf(stderr, "forkattn: cannot create a context for backend %s\n", forkattn_backend_name(o->backend));
    return -1;
  }
  snprintf(r->backend, sizeof r->backend, "%s", forkattn_backend_name(forkattn_ctx_backend(cs)));
  snprintf(r->reason, sizeof r->reason, "%s", forkattn_ctx_backend_reason(cs));
  tool_group sh, rep;
  memset(&rep, 0, sizeof rep);
  int rc = -1;
  if (tool_group_shared(&sh, &o->shape, o->seed) || tool_group_to_device(cs, &sh, &o->shape)) {
    tool_fail(cs, "allocating the shared group");
    goto done;
  }
  if (tool_time(cs, &sh, o, &r->shared)) {
    tool_fail(cs, "shared-prompt attention");
    goto done;
  }
  r->shared.flops = tool_flops_shared(&o->shape);
  if (!o->no_replicated) {
    if (tool_group_replicated(&rep, &sh, &o->shape) || tool_group_to_device(cr, &rep, &o->shape)) {
      tool_fail(cr, "allocating the replicated batch");
      goto done;
    }
    if (tool_time(cr, &rep, o, &r->rep)) {
      tool_fail(cr, "replicated attention");
      goto done;
    }
    r->rep.flops = tool_flops_replicated(&o->shape);
    tool_compare(&sh, &rep, &o->shape, &r->err);
    r->have_rep = 1;
  }
  rc = 0;
done:
  tool_group_free(cs, &sh);
  tool_group_free(cr, &rep);
  forkattn_ctx_destroy(cs);
  forkattn_ctx_destroy(cr);
  return rc;
}
