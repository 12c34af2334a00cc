/* Context life cycle, backend choice (made once, never silent) and errors. */
#include "alloc.h"
#include "backend.h"

#include <limits.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "hostinfo.h"
#include "plan_cache.h"
#include "struct_size.h"

forkattn_status fa_fail(forkattn_ctx *ctx, forkattn_status status, const char *fmt, ...) {
  if (ctx) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->last_error, sizeof ctx->last_error, fmt, ap);
    va_end(ap);
  }
  return status;
}

void fa_clear_error(forkattn_ctx *ctx) {
  if (ctx) ctx->last_error[0] = '\0';
}

void fa_note_workspace(forkattn_ctx *ctx, size_t bytes) {
  if (bytes > ctx->peak_workspace) ctx->peak_workspace = bytes;
}

size_t forkattn_ctx_peak_workspace(const forkattn_ctx *ctx) { return ctx ? ctx->peak_workspace : 0; }

void forkattn_ctx_options_init(forkattn_ctx_options *opt) {
  if (!opt) return;
  memset(opt, 0, sizeof *opt);
  opt->struct_size = sizeof *opt;
  opt->backend = FORKATTN_BACKEND_AUTO;
  opt->gpu_persist = -1;
  opt->f32_precision = FORKATTN_F32_PRECISION_HIGH;
}

/* FORKATTN_BACKEND chooses the backend of a context whose options ask for
 * AUTO (the caller's explicit choice stands); 1 when it is set, -1 on an
 * unknown value. */
static int fa_env_backend(forkattn_backend *b) {
  const char *e = getenv("FORKATTN_BACKEND");
  if (!e || !*e) return 0;
  if (!strcasecmp(e, "cpu")) *b = FORKATTN_BACKEND_CPU;
  else if (!strcasecmp(e, "gpu")) *b = FORKATTN_BACKEND_GPU;
  else if (!strcasecmp(e, "auto")) *b = FORKATTN_BACKEND_AUTO;
  else return -1;
  return 1;
}

/* Decide the backend. Returns OK or BACKEND_UNAVAILABLE (gpu requested, none usable). */
static forkattn_status fa_choose_backend(forkattn_ctx *c, forkattn_backend want, const char *src) {
  if (want == FORKATTN_BACKEND_CPU) {
    c->backend = FORKATTN_BACKEND_CPU;
    c->ops = fa_backend_get(FORKATTN_BACKEND_CPU);
    snprintf(c->reason, sizeof c->reason, "cpu: requested by %s", src);
    return FORKATTN_OK;
  }
  char why[FA_MSG_LEN] = "this build has no GPU offload (configure with -DFORKATTN_OFFLOAD=nvptx:sm_90)";
  const fa_backend *gpu = fa_backend_get(FORKATTN_BACKEND_GPU);
  if (gpu && gpu->probe(c->device, why, sizeof why)) {
    c->backend = FORKATTN_BACKEND_GPU;
    c->ops = gpu;
    snprintf(c->reason, sizeof c->reason, "gpu: %s (%s by %s)", why,
             want == FORKATTN_BACKEND_AUTO ? "auto" : "requested", src);
    return FORKATTN_OK;
  }
  if (want == FORKATTN_BACKEND_GPU) {
    snprintf(c->reason, sizeof c->reason, "gpu requested by %s but unavailable: %s", src, why);
    return FORKATTN_ERR_BACKEND_UNAVAILABLE;
  }
  c->backend = FORKATTN_BACKEND_CPU;
  c->ops = fa_backend_get(FORKATTN_BACKEND_CPU);
  snprintf(c->reason, sizeof c->reason, "cpu: auto fell back to the CPU kernels because %s", why);
  return FORKATTN_OK;
}

/* Why the last forkattn_ctx_create() of this thread failed (no context exists
 * to hold the message). */
static _Thread_local char fa_create_error[FA_MSG_LEN];

const char *forkattn_ctx_create_error(void) { return fa_create_error; }

static forkattn_status fa_create_fail(forkattn_status st, int verbose, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static forkattn_status fa_create_fail(forkattn_status st, int verbose, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(fa_create_error, sizeof fa_create_error, fmt, ap);
  va_end(ap);
  if (verbose) fprintf(stderr, "forkattn: %s\n", fa_create_error);
  return st;
}

/* The largest thread count a context accepts. Each call opens an OpenMP team of
 * that many threads, and libgomp/libomp abort the whole process when they
 * cannot allocate or create a team (INT_MAX threads asks for ~480 GB); a small
 * oversubscription is legitimate (tests, shared nodes), so the bound is a
 * multiple of the hardware threads with a floor for small machines. */
enum { FA_THREADS_PER_HW_THREAD = 4, FA_THREADS_FLOOR = 64 };

int forkattn_max_threads(void) {
  const int hw = fa_host_hw_threads();
  const int cap = hw > INT_MAX / FA_THREADS_PER_HW_THREAD ? INT_MAX : hw * FA_THREADS_PER_HW_THREAD;
  return cap > FA_THREADS_FLOOR ? cap : FA_THREADS_FLOOR;
}

forkattn_status forkattn_ctx_create(forkattn_ctx **ctx, const forkattn_ctx_options *opt) {
  fa_create_error[0] = '\0';
  if (!ctx) return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, 0, "ctx_create: ctx is NULL");
  *ctx = NULL;
  forkattn_ctx_options o;
  forkattn_ctx_options_init(&o);
  if (opt) {
    char why[FA_MSG_LEN];
    if (fa_struct_size_check("opt", opt->struct_size, sizeof *opt, "forkattn_ctx_options", why, sizeof why))
      return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, 0, "ctx_create: %s", why);
    o = *opt;
  }
  if (o.backend != FORKATTN_BACKEND_AUTO && o.backend != FORKATTN_BACKEND_CPU &&
      o.backend != FORKATTN_BACKEND_GPU)
    return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, o.verbose, "ctx_create: unknown backend %d",
                          (int)o.backend);
  if (o.threads < 0 || o.device < 0)
    return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, o.verbose,
                          "ctx_create: threads (%d) and device (%d) must be >= 0", o.threads, o.device);
  if (o.threads > forkattn_max_threads())
    return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, o.verbose,
                          "ctx_create: threads (%d) exceeds the limit %d (forkattn_max_threads(): the larger of "
                          "%d and %d x the %d hardware threads hwloc reports)",
                          o.threads, forkattn_max_threads(), FA_THREADS_FLOOR, FA_THREADS_PER_HW_THREAD,
                          fa_host_hw_threads());

  const char *src = "options";
  const int env = o.backend == FORKATTN_BACKEND_AUTO ? fa_env_backend(&o.backend) : 0;
  if (env < 0)
    return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, o.verbose,
                          "ctx_create: FORKATTN_BACKEND='%s' is not one of cpu, gpu, auto",
                          getenv("FORKATTN_BACKEND"));
  if (env > 0) src = "FORKATTN_BACKEND";
  const int plan_cache = fa_plan_cache_env();
  if (plan_cache < 0)
    return fa_create_fail(FORKATTN_ERR_INVALID_ARGUMENT, o.verbose,
                          "ctx_create: FORKATTN_PLAN_CACHE='%s' is not 0 or 1", getenv("FORKATTN_PLAN_CACHE"));

  forkattn_ctx *c = fa_calloc(1, sizeof *c);
  if (!c) return fa_create_fail(FORKATTN_ERR_OUT_OF_MEMORY, o.verbose, "ctx_create: out of memory");
  c->device = o.device;
  c->threads = o.threads > 0 ? o.threads : fa_host_physical_cores();
  c->bind_threads = o.bind_threads;
  c->verbose = o.verbose;
  c->plan_cache_on = plan_cache;
  forkattn_status st = fa_choose_backend(c, o.backend, src);
  if (st != FORKATTN_OK) {
    st = fa_create_fail(st, o.verbose, "ctx_create: %s", c->reason);
    fa_free(c);
    return st;
  }
  char err[FA_MSG_LEN];
  if (c->ops->ctx_init && (st = c->ops->ctx_init(c, &o, err, sizeof err)) != FORKATTN_OK) {
    forkattn_ctx_destroy(c);
    return fa_create_fail(st, o.verbose, "ctx_create: %s", err);
  }
  if (o.verbose) fprintf(stderr, "forkattn: backend %s\n", c->reason);
  if (o.verbose && c->kernels[0]) fprintf(stderr, "forkattn: gpu kernels: %s\n", c->kernels);
  *ctx = c;
  return FORKATTN_OK;
}

void forkattn_ctx_destroy(forkattn_ctx *ctx) {
  if (ctx && ctx->ops->ctx_teardown) {
    forkattn_ctx_clear_stream(ctx); /* its queued kernels may read what the backend cached */
    ctx->ops->ctx_teardown(ctx);
  }
  if (ctx) fa_plan_cache_free(ctx->plan_cache);
  fa_free(ctx);
}

forkattn_backend forkattn_ctx_backend(const forkattn_ctx *ctx) {
  return ctx ? ctx->backend : FORKATTN_BACKEND_CPU;
}

const char *forkattn_ctx_backend_reason(const forkattn_ctx *ctx) {
  return ctx ? ctx->reason : "no context";
}

const char *forkattn_ctx_gpu_kernels(const forkattn_ctx *ctx) { return ctx ? ctx->kernels : ""; }

int forkattn_ctx_threads(const forkattn_ctx *ctx) { return ctx ? ctx->threads : 0; }

const char *forkattn_ctx_last_error(const forkattn_ctx *ctx) {
  return ctx ? ctx->last_error : "no context";
}

forkattn_status fa_ctx_wait_stream(forkattn_ctx *ctx, const char *what) {
  return ctx->ops->stream_wait ? ctx->ops->stream_wait(ctx, what) : FORKATTN_OK;
}

/* Wait for the context's stream with no work of the library's after it (allowed while the
 * stream records a CUDA graph: nothing recorded has run yet). */
static forkattn_status fa_ctx_drain_stream(forkattn_ctx *ctx, const char *what) {
  const int rc = ctx->ops->stream_wait_quiet ? ctx->ops->stream_wait_quiet(ctx) : 0;
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE,
                      "%s: waiting for the context's stream failed (CUDA error %d, an earlier call's kernel or "
                      "the caller's own work)",
                      what, rc)
            : FORKATTN_OK;
}

forkattn_status forkattn_ctx_set_stream(forkattn_ctx *ctx, void *stream) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  if (ctx->backend != FORKATTN_BACKEND_GPU)
    return fa_fail(ctx, FORKATTN_ERR_BACKEND_UNAVAILABLE, "ctx_set_stream: a CPU context has no stream (%s)",
                   ctx->reason);
  char why[FA_MSG_LEN / 2];
  int invalid = 0;
  if (ctx->ops->stream_check(ctx->device, stream, &invalid, why, sizeof why))
    return fa_fail(ctx, invalid ? FORKATTN_ERR_INVALID_ARGUMENT : FORKATTN_ERR_UNSUPPORTED, "ctx_set_stream: %s",
                   why);
  const forkattn_status st = fa_ctx_drain_stream(ctx, "ctx_set_stream");
  if (st) return st;
  ctx->stream = stream;
  ctx->stream_set = 1;
  return FORKATTN_OK;
}

forkattn_status forkattn_ctx_synchronize(forkattn_ctx *ctx) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  return fa_ctx_drain_stream(ctx, "ctx_synchronize");
}

forkattn_status forkattn_ctx_clear_stream(forkattn_ctx *ctx) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const forkattn_status st = fa_ctx_drain_stream(ctx, "ctx_clear_stream");
  ctx->stream_set = 0;
  ctx->stream = NULL;
  return st;
}
