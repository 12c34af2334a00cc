/* Routed launches straight to the CUDA driver (gpu_launch_direct.h). */
#include <stdatomic.h>
#include <stdint.h>

#include "gpu_launch_copy.h"
#include "gpu_launch_direct.h"

/* Set once, before any launch can be watched (fa_gpu_direct_init); `on` 0: nothing goes direct. */
static struct {
  fa_direct_driver d;
  int on;
} fa_dl;

/* The launch environment the runtime passes a kernel without reductions (LLVM's
 * GenericKernelTy::getKernelLaunchEnvironment): a fixed non-null marker, never read. */
#define FA_DIRECT_NO_ENVIRONMENT (~(uintptr_t)0)

typedef struct fa_direct_watched {
  fa_direct_site *site; /* NULL: no launch watched */
  int device, grid, threads;
  size_t smem;
  const void *argp;
} fa_direct_watched;

static _Thread_local fa_direct_watched fa_dw;
static _Thread_local int fa_direct_on;
static _Thread_local int fa_direct_error; /* the driver's error of a failed direct launch, until taken */

void fa_gpu_direct_init(const fa_direct_driver *d) {
  fa_dl.on = d && d->param_info && d->ctx_get && d->ctx_push && d->ctx_pop && d->launch;
  if (fa_dl.on) fa_dl.d = *d;
}

void fa_gpu_direct_enable(int on) { fa_direct_on = on; }

int fa_gpu_direct_error_take(void) {
  const int rc = fa_direct_error;
  fa_direct_error = 0;
  return rc;
}

int fa_gpu_direct_launch(fa_direct_site *s, int device, int grid, int threads, size_t smem, const void *argp) {
  if (!fa_dl.on || !fa_direct_on || !fa_gpu_launch_routed() || device < 0 || device >= FA_DIRECT_DEVICES ||
      atomic_load_explicit(&s->off, memory_order_relaxed))
    return 0;
  void *const f = atomic_load_explicit(&s->fn[device], memory_order_acquire); /* published after cu_ctx */
  if (!f) return 0;
  void *const ctx = atomic_load_explicit(&s->cu_ctx[device], memory_order_relaxed);
  uintptr_t env = FA_DIRECT_NO_ENVIRONMENT;
  const void *arg = argp;
  uint64_t teams = (uint64_t)(unsigned)grid;
  void *params[3] = {&env, (void *)&arg, &teams};
  void *cur = NULL, *was = NULL;
  const int push = fa_dl.d.ctx_get(&cur) || cur != ctx; /* the runtime's context, as the runtime makes it current */
  int rc = push ? fa_dl.d.ctx_push(ctx) : 0;
  if (!rc) {
    rc = fa_dl.d.launch(f, (unsigned)grid, (unsigned)threads, (unsigned)smem, fa_gpu_launch_stream(NULL), params);
    if (push) fa_dl.d.ctx_pop(&was);
  }
  /* launched or failed, the site's launch is done: a failed one (its queued copies spent) is the
   * call's error (fa_gpu_direct_error_take), not a second launch through the runtime */
  if (rc && !fa_direct_error) fa_direct_error = rc;
  return 1;
}

void fa_gpu_direct_watch(fa_direct_site *s, int device, int grid, int threads, size_t smem, const void *argp) {
  fa_dw = (fa_direct_watched){NULL, device, grid, threads, smem, argp};
  /* a site is judged once a device: an unrouted call's launches, which keep the runtime, are not
   * checked again */
  if (fa_dl.on && device >= 0 && device < FA_DIRECT_DEVICES && !atomic_load(&s->off) &&
      !atomic_load_explicit(&s->fn[device], memory_order_relaxed))
    fa_dw.site = s;
}

void fa_gpu_direct_unwatch(void) { fa_dw.site = NULL; }

void fa_gpu_direct_observe(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned smem, void **params, void **extra) {
  const fa_direct_watched w = fa_dw;
  if (!w.site) return;
  fa_dw.site = NULL; /* the site's one launch */
  void *cur = NULL;
  /* exactly three 8-byte parameters (a fourth index is out of range), as the site would pass them */
  int sized = 1;
  for (size_t i = 0; i < 4 && sized; i++) {
    size_t at = 0, size = 0;
    const int rc = fa_dl.d.param_info(f, i, &at, &size);
    sized = i < 3 ? !rc && size == 8 : rc != 0;
  }
  const int same = sized && !extra && params && gx == (unsigned)w.grid && gy == 1 && gz == 1 &&
                   bx == (unsigned)w.threads && by == 1 && bz == 1 && smem == w.smem &&
                   *(const uintptr_t *)params[0] == FA_DIRECT_NO_ENVIRONMENT &&
                   *(const void *const *)params[1] == w.argp && *(const uint64_t *)params[2] == (unsigned)w.grid &&
                   !fa_dl.d.ctx_get(&cur) && cur;
  if (!same) {
    atomic_store(&w.site->off, 1);
    return;
  }
  atomic_store_explicit(&w.site->cu_ctx[w.device], cur, memory_order_relaxed);
  atomic_store_explicit(&w.site->fn[w.device], f, memory_order_release);
}
