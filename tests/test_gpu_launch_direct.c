/* Direct launches (offload/gpu_launch_direct.h) on the host, with a stand-in
 * driver: a site's watched launch through the runtime is kept only when it
 * is exactly what the site would launch itself, and then its routed
 * launches go to the driver with the site's parameters on the routed
 * stream, in the runtime's CUDA context; everything else keeps the runtime. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "gpu_launch_copy.h"
#include "gpu_launch_direct.h"

#define ENV (~(uintptr_t)0) /* the runtime's launch environment of a kernel without reductions */

/* The stand-in driver: kernels are ints whose value is their parameter count; contexts are ints. */
static int runtime_ctx, other_ctx;
static void *current;     /* the thread's current context */
static int pushes, pops;  /* context pushes and pops */
static int launches;      /* direct launches */
static int launch_fail;   /* a CUDA error the next launch returns (0: none) */
static struct {
  void *f, *stream, *ctx;
  unsigned grid, threads, smem;
  uintptr_t env;
  const void *argp;
  uint64_t teams;
} last;

static int param_queries; /* cuFuncGetParamInfo calls */
static int fake_param_info(void *f, size_t index, size_t *offset, size_t *size) {
  param_queries++;
  const int n = *(const int *)f;
  if ((int)index >= n) return 1; /* CUDA_ERROR_INVALID_VALUE */
  *offset = 8 * index;
  *size = 8;
  return 0;
}
static int fake_get(void **ctx) { return *ctx = current, 0; }
static void *pushed_over;
static int fake_push(void *ctx) { return pushes++, pushed_over = current, current = ctx, 0; }
static int fake_pop(void **ctx) { return pops++, *ctx = current, current = pushed_over, 0; }
static int fake_launch(void *f, unsigned grid, unsigned threads, unsigned smem, void *stream, void **params) {
  launches++;
  last.f = f, last.grid = grid, last.threads = threads, last.smem = smem, last.stream = stream, last.ctx = current;
  last.env = *(const uintptr_t *)params[0];
  last.argp = *(const void *const *)params[1];
  last.teams = *(const uint64_t *)params[2];
  return launch_fail;
}

static const fa_direct_driver fake = {fake_param_info, fake_get, fake_push, fake_pop, fake_launch};
static int three_params = 3, two_params = 2, four_params = 4;
static int caller_stream;

static void setup(void) {
  fa_gpu_direct_init(&fake);
  current = &runtime_ctx;
  pushes = pops = launches = launch_fail = 0;
  memset(&last, 0, sizeof last);
  fa_gpu_launch_route(&caller_stream);
  fa_gpu_direct_enable(1);
  (void)fa_gpu_direct_error_take();
}

static void teardown(void) {
  fa_gpu_direct_enable(0);
  fa_gpu_launch_unroute();
}

/* The runtime's launch of a site's kernel f, as the forwarder sees it: `grid` teams of `threads`,
 * `smem` bytes, parameters {env, argp, teams} (LLVM 19: the launch environment, the captured
 * argument copy, the num_teams value Clang captures too). */
static void runtime_launch_teams(void *f, unsigned grid, unsigned threads, unsigned smem, uintptr_t env,
                                 const void *argp, uint64_t teams, void **extra) {
  void *a = (void *)argp;
  void *params[4] = {&env, &a, &teams, &teams};
  fa_gpu_direct_observe(f, grid, 1, 1, threads, 1, 1, smem, params, extra);
}
static void runtime_launch(void *f, unsigned grid, unsigned threads, unsigned smem, uintptr_t env, const void *argp,
                           void **extra) {
  runtime_launch_teams(f, grid, threads, smem, env, argp, grid, extra);
}

/* Watch the site's launch through the runtime (as FA_DIRECT_OR_RUNTIME does when it cannot go direct). */
static void watched(fa_direct_site *s, int device, void *f, unsigned grid, unsigned threads, unsigned smem,
                    uintptr_t env, const void *argp, void **extra) {
  fa_gpu_direct_watch(s, device, 132, 256, 100000, argp);
  runtime_launch(f, grid, threads, smem, env, argp, extra);
  fa_gpu_direct_unwatch();
}

TestSuite(gpu_launch_direct, .init = setup, .fini = teardown);

Test(gpu_launch_direct, a_matching_watched_launch_makes_the_next_ones_direct) {
  fa_direct_site s = {0};
  char args0[16] = {0}, args1[16] = {0};
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args0), 0, "unseen: through the runtime");
  watched(&s, 0, &three_params, 132, 256, 100000, ENV, args0, NULL);
  cr_assert_eq(launches, 0, "watching launches nothing itself");
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 77, 256, 90000, args1), 1);
  cr_assert_eq(launches, 1);
  cr_assert_eq(last.f, (void *)&three_params);
  cr_assert(last.grid == 77 && last.threads == 256 && last.smem == 90000, "the call's own grid and team memory");
  cr_assert_eq(last.stream, (void *)&caller_stream, "on the routed stream");
  cr_assert_eq(last.env, ENV);
  cr_assert_eq(last.argp, (const void *)args1, "the call's own arguments");
  cr_assert_eq(last.teams, 77, "the team count Clang captures");
  cr_assert_eq(last.ctx, (void *)&runtime_ctx);
  cr_assert_eq(pushes, 0, "the runtime's context was current: no push");
  cr_assert_eq(fa_gpu_direct_error_take(), 0);

  current = &other_ctx; /* another thread's library made its context current */
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 1, 256, 0, args0), 1);
  cr_assert_eq(last.ctx, (void *)&runtime_ctx, "launched in the runtime's context");
  cr_assert(pushes == 1 && pops == 1 && current == &other_ctx, "the caller's context restored");

  cr_assert_eq(fa_gpu_direct_launch(&s, 1, 1, 256, 0, args0), 0, "device 1's kernel is not known");
}

Test(gpu_launch_direct, only_routed_launches_with_direct_launches_on_go_direct) {
  fa_direct_site s = {0};
  char args[16] = {0};
  watched(&s, 0, &three_params, 132, 256, 100000, ENV, args, NULL);
  fa_gpu_direct_enable(0); /* FORKATTN_GPU_DIRECT_LAUNCH=0 */
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 0);
  fa_gpu_direct_enable(1);
  fa_gpu_launch_unroute(); /* a call without a stream: the runtime's synchronous regions */
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 0);
  param_queries = 0;
  watched(&s, 0, &three_params, 132, 256, 100000, ENV, args, NULL);
  cr_assert_eq(param_queries, 0, "a site known on the device is not judged again at each unrouted launch");
  fa_gpu_launch_route(&caller_stream);
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 1);
  cr_assert_eq(launches, 1);
  fa_gpu_direct_init(NULL); /* a driver without cuFuncGetParamInfo */
  fa_direct_site t = {0};
  watched(&t, 0, &three_params, 132, 256, 100000, ENV, args, NULL);
  cr_assert_eq(fa_gpu_direct_launch(&t, 0, 132, 256, 100000, args), 0);
  cr_assert_eq(launches, 1);
}

/* Each way the runtime's launch can differ from the site's own turns the site off for good. */
Test(gpu_launch_direct, a_launch_unlike_the_sites_keeps_it_on_the_runtime) {
  char args[16] = {0}, other[16] = {0};
  void *extra[1] = {NULL};
  const struct {
    const char *what;
    void *f;
    unsigned grid, threads, smem;
    uintptr_t env;
    const void *argp;
    void **extra;
  } diff[] = {
      {"another grid", &three_params, 133, 256, 100000, ENV, args, NULL},
      {"another team size", &three_params, 132, 128, 100000, ENV, args, NULL},
      {"more team memory (LIBOMPTARGET_SHARED_MEMORY_SIZE)", &three_params, 132, 256, 110000, ENV, args, NULL},
      {"a launch environment the runtime allocated", &three_params, 132, 256, 100000, (uintptr_t)other, args, NULL},
      {"another first variable", &three_params, 132, 256, 100000, ENV, other, NULL},
      {"a fourth parameter (another captured variable)", &four_params, 132, 256, 100000, ENV, args, NULL},
      {"two parameters (no team count)", &two_params, 132, 256, 100000, ENV, args, NULL},
      {"parameters by `extra`", &three_params, 132, 256, 100000, ENV, args, extra},
  };
  for (size_t i = 0; i < sizeof diff / sizeof diff[0]; i++) {
    fa_direct_site s = {0};
    fa_gpu_direct_watch(&s, 0, 132, 256, 100000, args);
    runtime_launch(diff[i].f, diff[i].grid, diff[i].threads, diff[i].smem, diff[i].env, diff[i].argp, diff[i].extra);
    fa_gpu_direct_unwatch();
    cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 0, "%s", diff[i].what);
    watched(&s, 0, &three_params, 132, 256, 100000, ENV, args, NULL); /* a matching one later changes nothing */
    cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 0, "%s, then a match", diff[i].what);
  }
  fa_direct_site s = {0};
  fa_gpu_direct_watch(&s, 0, 132, 256, 100000, args);
  runtime_launch_teams(&three_params, 132, 256, 100000, ENV, args, 7, NULL);
  fa_gpu_direct_unwatch();
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 0, "a third parameter other than the team count");
  cr_assert_eq(launches, 0);
}

Test(gpu_launch_direct, only_the_watched_launch_is_judged) {
  fa_direct_site s = {0};
  char args[16] = {0};
  runtime_launch(&four_params, 1, 32, 0, ENV, args, NULL); /* a launch nobody watches */
  watched(&s, 0, &three_params, 132, 256, 100000, ENV, args, NULL);
  runtime_launch(&four_params, 1, 32, 0, ENV, args, NULL); /* after the site's: not the site's */
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 1);
}

Test(gpu_launch_direct, a_failed_direct_launch_is_the_calls_error_not_a_second_launch) {
  fa_direct_site s = {0};
  char args[16] = {0};
  watched(&s, 0, &three_params, 132, 256, 100000, ENV, args, NULL);
  launch_fail = 700;
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 1, "done: no launch through the runtime");
  launch_fail = 0;
  cr_assert_eq(fa_gpu_direct_launch(&s, 0, 132, 256, 100000, args), 1);
  cr_assert_eq(fa_gpu_direct_error_take(), 700, "the first error");
  cr_assert_eq(fa_gpu_direct_error_take(), 0, "taken");
}
