/* Routed launches straight to the CUDA driver, past the offload runtime.
 *
 * A synchronous target region costs the host ~11 µs (bench/launch_cost.c):
 * the runtime's bookkeeping and the wait on its own stream, which a routed
 * launch (gpu_stream.h) leaves empty. cuLaunchKernel alone costs a few. So
 * a launch site (one expansion of a launch macro, gpu_work_scheduler.h)
 * goes through the runtime once per device, and the cuLaunchKernel
 * forwarder (gpu_team_memory.c) watches that launch: when it is what the
 * site would make itself (the grid, the team size and team memory the site
 * asked for, and exactly three 8-byte parameters as LLVM 19 passes them:
 * the runtime's launch environment, ~0 for a kernel without reductions;
 * the site's one captured variable, the device copy of its arguments; and
 * the team count, which Clang captures from the num_teams clause though a
 * bare kernel never reads it), the site keeps the CUfunction and the CUDA
 * context it ran in. Its next routed launches on that device call the
 * driver directly with the same three parameters, on the routed stream,
 * after the copies queued for the launch (gpu_launch_copy.h). A launch that
 * differs (another compiler or runtime, a launch environment the runtime
 * allocates, a variable the region captures besides the arguments) leaves
 * the site on the runtime for good.
 *
 * Only routed launches go direct: they already run on the caller's stream
 * and the call returns before they end; an unrouted call keeps the
 * runtime's synchronous regions. FORKATTN_GPU_DIRECT_LAUNCH=0 (read per
 * context, fa_gpu_knobs) keeps every launch on the runtime. */
#ifndef FORKATTN_GPU_LAUNCH_DIRECT_H
#define FORKATTN_GPU_LAUNCH_DIRECT_H
#include <stddef.h>

/* Devices a site remembers a kernel for (the others always use the runtime). */
#define FA_DIRECT_DEVICES 16

/* A launch site: its kernel and context per device once seen, or `off`. Zero-initialised (static). */
typedef struct fa_direct_site {
  void *_Atomic fn[FA_DIRECT_DEVICES];
  void *_Atomic cu_ctx[FA_DIRECT_DEVICES];
  _Atomic int off; /* a watched launch differed from the site's own */
} fa_direct_site;

/* The driver functions a direct launch needs (the CUDA driver's, from the forwarder's installation;
 * stand-ins in the host tests). */
typedef struct fa_direct_driver {
  int (*param_info)(void *f, size_t index, size_t *offset, size_t *size); /* cuFuncGetParamInfo (CUDA 12.4+) */
  int (*ctx_get)(void **ctx);                                             /* cuCtxGetCurrent */
  int (*ctx_push)(void *ctx);                                             /* cuCtxPushCurrent */
  int (*ctx_pop)(void **ctx);                                             /* cuCtxPopCurrent */
  /* a launch as the forwarder makes it (gpu_team_memory.h: fa_gpu_launch_driver) */
  int (*launch)(void *f, unsigned grid, unsigned threads, unsigned smem, void *stream, void **params);
} fa_direct_driver;

/* Once, before any launch is watched: the driver's functions (copied); NULL or one missing: no launch
 * goes direct. */
void fa_gpu_direct_init(const fa_direct_driver *d);

/* Launch the site's kernel directly if it can (this thread's launches are routed with direct
 * launches on, the site's kernel on `device` is known): `grid` teams of `threads`, `smem` bytes of
 * team memory, its argument copy `argp`. 1 launched; 0 not: the caller launches through the runtime,
 * between fa_gpu_direct_watch and fa_gpu_direct_unwatch. */
int fa_gpu_direct_launch(fa_direct_site *s, int device, int grid, int threads, size_t smem, const void *argp);

/* The driver's error of this thread's failed direct launch since the last take (0: none), cleared. */
int fa_gpu_direct_error_take(void);

/* Watch this thread's next launch (the site's, through the runtime) as fa_gpu_direct_launch would
 * make it, unless the site is already judged on `device` (known or off); fa_gpu_direct_unwatch
 * after the region. */
void fa_gpu_direct_watch(fa_direct_site *s, int device, int grid, int threads, size_t smem, const void *argp);
void fa_gpu_direct_unwatch(void);

/* From the forwarder, for every launch the runtime makes: a watched launch's kernel is kept when
 * the launch matches the site's (above). */
void fa_gpu_direct_observe(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned smem, void **params, void **extra);

/* Direct launches for this thread's routed launches (fa_gpu_launch_route): on (1) or off (0). */
void fa_gpu_direct_enable(int on);

/* A launch through the site when it can go direct, else the statement after SMEM (the site's target
 * region) watched. Needs `dev` and `argp` in scope. */
#define FA_DIRECT_OR_RUNTIME(GRID, THREADS, SMEM, ...)                                                        \
  do {                                                                                                        \
    static fa_direct_site fa_site_;                                                                           \
    if (!fa_gpu_direct_launch(&fa_site_, dev, (GRID), (THREADS), (SMEM), argp)) {                             \
      fa_gpu_direct_watch(&fa_site_, dev, (GRID), (THREADS), (SMEM), argp);                                   \
      __VA_ARGS__                                                                                             \
      fa_gpu_direct_unwatch();                                                                                \
    }                                                                                                         \
  } while (0)

#endif
