/* The GPU backend's host-side bookkeeping, run on the host: the context's
 * device-block cache (offload/gpu_pool.c) and the one-copy staging of plan
 * arrays (offload/gpu_stage.c) and the copies a launch carries
 * (offload/gpu_launch_copy.c, with a stand-in for the driver's asynchronous
 * copy), with the OpenMP initial device standing in for the GPU
 * (omp_target_alloc and omp_target_memcpy work there too). The GPU suite runs
 * the same code against the real device. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "context_internal.h"
#include "gpu_launch_copy.h"
#include "gpu_persist.h"
#include "gpu_pool.h"
#include "gpu_stage.h"
#include "gpu_stream.h"
#include "test_common.h"

/* gpu_stage.c's kept-mask staging refers to these (lib/distill/kept_set.c, which would
 * pull in the whole library); no test here stages a kept mask. */
int64_t fa_kept_keep_bytes(const fa_kept *k) {
  (void)k;
  cr_assert_fail("not used by these tests");
  return 0;
}
int64_t fa_kept_block_bytes(const fa_kept *k) {
  (void)k;
  cr_assert_fail("not used by these tests");
  return 0;
}

/* The driver's wait for a caller's stream (gpu_stream.c), stood in: counts, remembers the stream, fails on
 * demand. The calls that must wait for it (a routed call's copy made at once, trimming the pool) call it. */
static int sync_calls, sync_fail;
static void *sync_stream;
static int fake_calls; /* the stand-in driver copy's calls, below */
int fa_gpu_stream_sync(int device, void *stream) {
  (void)device;
  sync_calls++;
  sync_stream = stream;
  return sync_fail;
}

/* Whether this thread's call is being recorded into a CUDA graph (gpu_stream.c), stood in. */
static int capturing;
int fa_gpu_capturing(void) { return capturing; }

static forkattn_ctx host_ctx(void) {
  forkattn_ctx c;
  memset(&c, 0, sizeof c);
  c.device = omp_get_initial_device();
  return c;
}

Test(gpu_pool, reuses_a_returned_block_of_fitting_size) {
  forkattn_ctx c = host_ctx();
  char *a = fa_gpu_pool_get(&c, 1000);
  cr_assert_not_null(a);
  memset(a, 7, 1000); /* the block is real memory of at least the size asked */
  fa_gpu_pool_put(&c, a);
  cr_assert_eq(fa_gpu_pool_get(&c, 900), a, "a returned block that fits is reused");
  char *b = fa_gpu_pool_get(&c, 900);
  cr_assert(b && b != a, "a block in use is never handed out twice");
  fa_gpu_pool_put(&c, a);
  fa_gpu_pool_put(&c, b);
  fa_gpu_pool_destroy(&c);
  cr_assert_null(c.gpu_pool);
}

Test(gpu_pool, best_fit_and_no_huge_block_for_a_small_request) {
  forkattn_ctx c = host_ctx();
  void *big = fa_gpu_pool_get(&c, 5000), *small = fa_gpu_pool_get(&c, 2000), *huge = fa_gpu_pool_get(&c, 1 << 20);
  cr_assert(big && small && huge);
  fa_gpu_pool_put(&c, big);
  fa_gpu_pool_put(&c, small);
  fa_gpu_pool_put(&c, huge);
  cr_assert_eq(fa_gpu_pool_get(&c, 1500), small, "the smallest block that fits");
  cr_assert_eq(fa_gpu_pool_get(&c, 1500), big, "then the next one");
  void *fresh = fa_gpu_pool_get(&c, 1500); /* 1 MiB is more than 2x + 64 KiB too large */
  cr_assert(fresh && fresh != huge);
  cr_assert_eq(fa_gpu_pool_get(&c, 600000), huge, "a large request takes the large block");
  fa_gpu_pool_destroy(&c);
}

Test(gpu_pool, a_full_table_evicts_an_unused_block_or_fails) {
  forkattn_ctx c = host_ctx();
  void *p[64];
  for (int i = 0; i < 64; i++) cr_assert_not_null(p[i] = fa_gpu_pool_get(&c, 100 + (size_t)i));
  cr_assert_null(fa_gpu_pool_get(&c, 1 << 20), "64 blocks in use and none to give back: out of memory");
  fa_gpu_pool_put(&c, p[10]);
  void *q = fa_gpu_pool_get(&c, 1 << 20); /* the unused small block is freed to make room */
  cr_assert_not_null(q);
  cr_assert_null(fa_gpu_pool_get(&c, 1 << 20));
  for (int i = 0; i < 64; i++)
    if (i != 10) fa_gpu_pool_put(&c, p[i]);
  fa_gpu_pool_put(&c, q);
  fa_gpu_pool_put(&c, NULL); /* ignored */
  fa_gpu_pool_destroy(&c);   /* LeakSanitizer (CI's sanitizer build) checks every block went */
}

Test(gpu_stage, plan_arrays_go_up_in_one_block_aligned_and_intact) {
  forkattn_ctx c = host_ctx();
  tc_rng rng = tc_rng_for("gpu_stage/plan_arrays");
  int64_t a[5];
  char b[33];
  double e[3];
  for (int i = 0; i < 5; i++) a[i] = (int64_t)(tc_uniform(&rng, -1e9, 1e9));
  for (int i = 0; i < 33; i++) b[i] = (char)(tc_uniform(&rng, 0, 255));
  for (int i = 0; i < 3; i++) e[i] = tc_uniform(&rng, -1, 1);
  const void *host[4] = {a, NULL, b, e};
  const size_t bytes[4] = {sizeof a, 0, sizeof b, sizeof e};
  void *dev[4] = {NULL, NULL, NULL, NULL};
  fa_stage st;
  fa_stage_init(&st, &c, 0);
  cr_assert_eq(fa_stage_arrays(&st, 4, host, bytes, dev), 0);
  cr_assert_eq(st.n, 1, "one device block for all arrays");
  for (int i = 0; i < 4; i++) cr_assert_eq((uintptr_t)dev[i] % 16, 0, "array %d is 16-byte aligned", i);
  cr_assert(memcmp(dev[0], a, sizeof a) == 0 && memcmp(dev[2], b, sizeof b) == 0 && memcmp(dev[3], e, sizeof e) == 0);
  cr_assert((char *)dev[2] >= (char *)dev[0] + sizeof a && (char *)dev[3] >= (char *)dev[2] + sizeof b, "no overlap");
  void *block = st.dev[0];
  fa_stage_free(&st);
  fa_stage st2;
  fa_stage_init(&st2, &c, 0);
  cr_assert_eq(fa_stage_scratch(&st2, 100), block, "the next call's scratch reuses the returned block");
  fa_stage_free(&st2);
  fa_gpu_pool_destroy(&c);
}

/* The driver's cuMemcpyHtoDAsync as the launch forwarder would call it: the
 * initial device's memory is host memory, so a memcpy; it records each call's
 * stream, and fails with fake_fail (a CUDA error code) when set. */
static int fake_fail;
static void *fake_stream;
static int fake_htod(unsigned long long dst, const void *src, size_t bytes, void *stream) {
  fake_calls++;
  fake_stream = stream;
  if (fake_fail) return fake_fail;
  memcpy((void *)(uintptr_t)dst, src, bytes);
  return 0;
}

static void carry_on(void) {
  fake_calls = fake_fail = 0;
  fake_stream = NULL;
  fa_gpu_launch_copy_init((void *)(uintptr_t)fake_htod);
}

/* A stand-in context and a stage on it, copies carried by the fake driver. */
typedef struct carry_case {
  forkattn_ctx c;
  fa_stage st;
  tc_rng rng;
} carry_case;

static void carry_case_init(carry_case *k, const char *name) {
  carry_on();
  k->c = host_ctx();
  k->rng = tc_rng_for(name);
  fa_stage_init(&k->st, &k->c, 0);
}

static void carry_case_end(carry_case *k) {
  fa_stage_free(&k->st);
  fa_gpu_pool_destroy(&k->c);
}

/* Stage 3 int64 arrays of fresh random values; the host arrays are then overwritten, as a caller may
 * free or reuse them once staging returned. want receives the values staged. */
static void stage_random(fa_stage *st, tc_rng *rng, int64_t want[3][4], void *dev[3]) {
  int64_t h[3][4];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++) want[i][j] = h[i][j] = (int64_t)tc_uniform(rng, -1e12, 1e12);
  const void *host[3] = {h[0], h[1], h[2]};
  const size_t bytes[3] = {sizeof h[0], sizeof h[1], sizeof h[2]};
  cr_assert_eq(fa_stage_arrays(st, 3, host, bytes, dev), 0);
  memset(h, 0x5a, sizeof h);
}

/* The 3 arrays stage_random staged hold want's values on the device. */
static void assert_in_place(void *const dev[3], int64_t want[3][4], const char *what) {
  for (int i = 0; i < 3; i++) cr_assert(memcmp(dev[i], want[i], sizeof want[i]) == 0, "%s: array %d intact", what, i);
}

Test(gpu_launch_copy, plan_arrays_ride_on_the_next_launch_on_its_stream) {
  carry_case k;
  carry_case_init(&k, "gpu_launch_copy/ride");
  char *block = fa_stage_scratch(&k.st, 4096); /* poison where the plan will land, then give it back */
  memset(block, 0xee, 4096);
  fa_stage_free(&k.st);
  fa_stage_init(&k.st, &k.c, 0);
  int64_t want[3][4];
  void *dev[3];
  stage_random(&k.st, &k.rng, want, dev);
  cr_assert_eq(fake_calls, 0, "nothing copied before the launch");
  cr_assert_eq(*(unsigned char *)dev[0], 0xee, "the device block is untouched before the launch");
  int stream_tag;
  cr_assert_eq(fa_gpu_launch_copies_issue(&stream_tag), 0);
  cr_assert_eq(fake_calls, 1, "one copy for the packed arrays");
  cr_assert_eq(fake_stream, (void *)&stream_tag, "issued on the launch's stream");
  assert_in_place(dev, want, "after the launch");
  cr_assert_eq(fa_gpu_launch_copies_issue(&stream_tag), 0);
  cr_assert_eq(fake_calls, 1, "a second launch carries nothing");
  carry_case_end(&k);
}

/* A call's arguments hold its plan's device addresses: reserved with the plan, filled in, then packed
 * with it into the same one copy. */
Test(gpu_launch_copy, arguments_that_point_into_the_plan_ride_in_its_copy) {
  carry_case k;
  carry_case_init(&k, "gpu_launch_copy/reserve");
  int64_t plan[5], want[5];
  for (int i = 0; i < 5; i++) want[i] = plan[i] = (int64_t)tc_uniform(&k.rng, -1e12, 1e12);
  struct {
    const int64_t *plan;
    int64_t n;
  } args = {NULL, 5};
  const void *host[3] = {plan, NULL, &args};
  const size_t bytes[3] = {sizeof plan, 0, sizeof args};
  void *dev[3] = {NULL, NULL, NULL};
  cr_assert_eq(fa_stage_reserve(&k.st, 3, bytes, dev), 0);
  cr_assert((uintptr_t)dev[0] % 16 == 0 && (uintptr_t)dev[2] % 16 == 0, "16-byte aligned");
  cr_assert((char *)dev[2] >= (char *)dev[0] + sizeof plan, "disjoint");
  args.plan = dev[0];
  cr_assert_eq(fa_stage_upload(&k.st, 3, host, bytes, dev), 0);
  memset(plan, 0x5a, sizeof plan);
  args.plan = NULL;
  cr_assert_eq(fake_calls, 0, "nothing copied before the launch");
  int stream_tag;
  cr_assert_eq(fa_gpu_launch_copies_issue(&stream_tag), 0);
  cr_assert_eq(fake_calls, 1, "one copy for the plan and the arguments");
  const int64_t *const *got = dev[2];
  cr_assert_eq(*got, (const int64_t *)dev[0], "the arguments point at the plan's device copy");
  cr_assert(memcmp(*got, want, sizeof want) == 0, "the plan in place");
  carry_case_end(&k);
}

Test(gpu_launch_copy, a_call_that_launched_nothing_drops_only_its_own_copies) {
  carry_on();
  forkattn_ctx c = host_ctx();
  tc_rng rng = tc_rng_for("gpu_launch_copy/drop");
  fa_stage outer, inner;
  int64_t want_outer[3][4], want_inner[3][4];
  void *dev_outer[3], *dev_inner[3];
  fa_stage_init(&outer, &c, 0);
  stage_random(&outer, &rng, want_outer, dev_outer);
  fa_stage_init(&inner, &c, 0); /* a nested call that stages and returns without a launch */
  stage_random(&inner, &rng, want_inner, dev_inner);
  fa_stage_free(&inner);
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 0);
  cr_assert_eq(fake_calls, 1, "the inner call's copy was dropped, the outer one's kept");
  assert_in_place(dev_outer, want_outer, "the outer call's");
  fa_stage_free(&outer);
  fa_stage_init(&outer, &c, 0);
  stage_random(&outer, &rng, want_outer, dev_outer);
  fa_stage_free(&outer);
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 0);
  cr_assert_eq(fake_calls, 1, "an ended call's copy never reaches a later launch");
  fa_gpu_pool_destroy(&c);
}

Test(gpu_launch_copy, a_full_queue_or_a_large_plan_copies_at_once) {
  carry_case k;
  carry_case_init(&k, "gpu_launch_copy/full");
  int64_t want[FA_LAUNCH_COPIES + 1][3][4];
  void *dev[FA_LAUNCH_COPIES + 1][3];
  for (int i = 0; i <= FA_LAUNCH_COPIES; i++) stage_random(&k.st, &k.rng, want[i], dev[i]);
  assert_in_place(dev[FA_LAUNCH_COPIES], want[FA_LAUNCH_COPIES], "past the queue, copied at once");
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 0);
  cr_assert_eq(fake_calls, FA_LAUNCH_COPIES);
  for (int i = 0; i < FA_LAUNCH_COPIES; i++) assert_in_place(dev[i], want[i], "a queued copy");
  const size_t big = FA_STAGE_CARRY_MAX + 16;
  unsigned char *h = malloc(big);
  cr_assert_not_null(h);
  for (size_t i = 0; i < big; i++) h[i] = (unsigned char)tc_uniform(&k.rng, 0, 256);
  void *d = fa_stage_array(&k.st, h, big);
  cr_assert_not_null(d);
  cr_assert(memcmp(d, h, big) == 0, "a plan past FA_STAGE_CARRY_MAX is in place on return");
  cr_assert_eq(fake_calls, FA_LAUNCH_COPIES, "and was not queued");
  free(h);
  carry_case_end(&k);
}

Test(gpu_launch_copy, a_failed_copy_fails_the_launch_and_empties_the_queue) {
  carry_case k;
  carry_case_init(&k, "gpu_launch_copy/fail");
  int64_t want[2][3][4];
  void *dev[2][3];
  stage_random(&k.st, &k.rng, want[0], dev[0]);
  stage_random(&k.st, &k.rng, want[1], dev[1]);
  fake_fail = 700; /* CUDA_ERROR_ILLEGAL_ADDRESS */
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 700, "the launch reports the copy's error");
  cr_assert_eq(fake_calls, 1, "no copy after the failed one");
  fake_fail = 0;
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 0);
  cr_assert_eq(fake_calls, 1, "the queue was emptied");
  carry_case_end(&k);
}

Test(gpu_launch_copy, off_without_the_driver) {
  forkattn_ctx c = host_ctx();
  tc_rng rng = tc_rng_for("gpu_launch_copy/off");
  fake_calls = 0;
  fa_gpu_launch_copy_init(NULL); /* no forwarder: the runtime's table was not found */
  fa_stage st;
  fa_stage_init(&st, &c, 0);
  int64_t want[3][4];
  void *dev[3];
  stage_random(&st, &rng, want, dev);
  assert_in_place(dev, want, "no forwarder");
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 0);
  cr_assert_eq(fake_calls, 0, "nothing queued");
  fa_stage_free(&st);
  fa_gpu_pool_destroy(&c);
}

/* A context given a stream (forkattn_ctx_set_stream): its routed calls' launches, and the copies they
 * carry, go to that stream; a copy that cannot ride waits for the stream first, since the stream's
 * earlier kernels may still read the pool block it lands in; trimming the pool waits too. */
Test(gpu_stream, routed_launches_and_their_copies_go_to_the_callers_stream) {
  carry_case k;
  carry_case_init(&k, "gpu_stream/route");
  int runtime_stream, caller_stream;
  cr_assert_eq(fa_gpu_launch_stream(&runtime_stream), (void *)&runtime_stream, "not routed: the runtime's");
  fa_gpu_launch_route(&caller_stream);
  cr_assert(fa_gpu_launch_routed());
  int64_t want[3][4];
  void *dev[3];
  stage_random(&k.st, &k.rng, want, dev);
  cr_assert_null(k.st.pinned, "a routed call never takes the page-locked buffer (the next call rewrites it)");
  cr_assert_eq(k.st.ncarried, 1);
  cr_assert_eq(k.st.in_pinned[0], 0, "its pack is ordinary memory, read by the driver before the launch returns");
  cr_assert_eq(fa_gpu_launch_copies_issue(fa_gpu_launch_stream(&runtime_stream)), 0); /* as the forwarder does */
  cr_assert_eq(fake_stream, (void *)&caller_stream, "the carried copy went to the caller's stream");
  assert_in_place(dev, want, "after the routed launch");
  cr_assert_eq(sync_calls, 0, "a carried copy never waits");
  fa_gpu_launch_unroute();
  cr_assert_not(fa_gpu_launch_routed());
  cr_assert_eq(fa_gpu_launch_stream(&runtime_stream), (void *)&runtime_stream, "unrouted: the runtime's again");
  carry_case_end(&k);
}

Test(gpu_stream, a_routed_copy_made_at_once_waits_for_the_stream) {
  for (int fail = 0; fail < 2; fail++) {
    carry_case k;
    carry_case_init(&k, fail ? "gpu_stream/wait_fails" : "gpu_stream/wait");
    int caller_stream;
    k.c.stream_set = 1, k.c.stream = &caller_stream;
    sync_calls = 0, sync_stream = NULL, sync_fail = fail ? 700 : 0;
    fa_gpu_launch_route(&caller_stream);
    int64_t want[FA_LAUNCH_COPIES + 1][3][4];
    void *dev[FA_LAUNCH_COPIES + 1][3];
    for (int i = 0; i < FA_LAUNCH_COPIES; i++) stage_random(&k.st, &k.rng, want[i], dev[i]);
    cr_assert_eq(sync_calls, 0, "the queued copies do not wait");
    int64_t h[4] = {1, 2, 3, 4};
    const void *host[1] = {h};
    const size_t bytes[1] = {sizeof h};
    void *d[1] = {NULL};
    const int rc = fa_stage_arrays(&k.st, 1, host, bytes, d); /* the queue is full: copied at once */
    cr_assert_eq(sync_calls, 1, "the copy made at once waited for the stream first");
    cr_assert_eq(sync_stream, (void *)&caller_stream, "for the context's stream");
    if (fail) {
      cr_assert_eq(rc, -1, "a failed wait fails the staging");
      cr_assert_eq(fa_stage_status(&k.st), FORKATTN_ERR_DEVICE, "as a device error");
    } else {
      cr_assert_eq(rc, 0);
      cr_assert(memcmp(d[0], h, sizeof h) == 0, "then copied");
    }
    fa_gpu_launch_copies_issue(NULL);
    fa_gpu_launch_unroute();
    sync_fail = 0;
    carry_case_end(&k);
  }
}

Test(gpu_stream, trimming_the_pool_waits_for_the_stream) {
  for (int fail = 0; fail < 2; fail++) {
    forkattn_ctx c = host_ctx();
    int caller_stream;
    void *blocks[64];
    for (int i = 0; i < 64; i++) cr_assert_not_null(blocks[i] = fa_gpu_pool_get(&c, 1000));
    for (int i = 0; i < 64; i++) fa_gpu_pool_put(&c, blocks[i]);
    c.stream_set = 1, c.stream = &caller_stream; /* the returned blocks may still be read by queued kernels */
    sync_calls = 0, sync_fail = fail ? 700 : 0;
    void *big = fa_gpu_pool_get(&c, 1 << 20); /* fits none of the 64: the pool is full, one must go */
    cr_assert_eq(sync_calls, 1, "the trim waited for the stream before freeing a block");
    cr_assert_eq(sync_stream, (void *)&caller_stream);
    if (fail) cr_assert_null(big, "a failed wait frees nothing: the allocation fails");
    else cr_assert_not_null(big);
    fa_gpu_pool_put(&c, big);
    sync_fail = 0;
    c.stream_set = 0;
    fa_gpu_pool_destroy(&c);
  }
}

/* A call recorded into a CUDA graph: its kernels run at every replay, after the call returned and while
 * later calls run. Its device memory must never be handed to another call, its plan must be in place
 * without a copy the graph would not hold, and nothing may wait for the capturing stream. */
Test(gpu_stream, a_captured_call_owns_its_blocks_and_copies_its_plan_at_once) {
  carry_case k;
  carry_case_init(&k, "gpu_stream/capture");
  int caller_stream;
  k.c.stream_set = 1, k.c.stream = &caller_stream;
  void *old = fa_gpu_pool_get(&k.c, 4096); /* a pooled block an earlier call's kernels may still read */
  fa_gpu_pool_put(&k.c, old);
  sync_calls = 0;
  capturing = 1;
  fa_gpu_launch_route(&caller_stream);
  int64_t want[3][4];
  void *dev[3];
  stage_random(&k.st, &k.rng, want, dev);
  assert_in_place(dev, want, "on return, before any launch");
  cr_assert_eq(k.st.ncarried, 0, "nothing rides on a launch");
  cr_assert_eq(sync_calls, 0, "no wait for the capturing stream");
  void *scratch = fa_stage_scratch(&k.st, 4096);
  cr_assert(scratch && scratch != old && dev[0] != old, "new blocks, never a pooled one");
  cr_assert_eq(fa_gpu_pool_kept_bytes(&k.c) >= 4096 + 3 * sizeof want[0], 1);
  fa_gpu_launch_unroute();
  fa_stage_free(&k.st);
  capturing = 0;
  cr_assert_eq(fa_gpu_launch_copies_issue(NULL), 0);
  cr_assert_eq(fake_calls, 0, "and nothing was queued for a later launch");
  assert_in_place(dev, want, "after the call ended");
  for (int i = 0; i < 4; i++) { /* later calls get other memory: the graph's stays the graph's */
    void *p = fa_gpu_pool_get(&k.c, 4096);
    cr_assert(p && p != scratch && p != dev[0], "a kept block is never handed out again");
  }
  assert_in_place(dev, want, "after later calls");
  k.c.stream_set = 0;
  carry_case_end(&k); /* frees the kept blocks too (ASan: no leak) */
}

/* The choice between persistent teams and a team an item (gpu_persist.h). */
/* Keys an item of case 2 sees (a response block: its 4096-row prompt and ~half its 1024 rows). */
#define LONG 4600
Test(gpu_persist, persistent_teams_only_where_an_sm_gets_many_items) {
  const int sms = 132;
  cr_assert_eq(fa_persist_grid_for(sms, 5120, LONG, -1), sms, "case 2: ~39 items an SM, one team an SM");
  cr_assert_eq(fa_persist_grid_for(sms, 512, LONG, -1), 0, "case 1: ~4 items an SM, a team an item");
  cr_assert_eq(fa_persist_grid_for(sms, FA_PERSIST_MIN_ITEMS_PER_SM * sms, LONG, -1), sms, "the threshold itself");
  cr_assert_eq(fa_persist_grid_for(sms, FA_PERSIST_MIN_ITEMS_PER_SM * sms - 1, LONG, -1), 0, "just below it");
  cr_assert_eq(fa_persist_grid_for(sms, 5120, LONG, 0), 0, "gpu_persist 0");
  cr_assert_eq(fa_persist_grid_for(sms, 512, LONG, 1), sms, "gpu_persist 1");
  cr_assert_eq(fa_persist_grid_for(sms, 40, LONG, 1), 40, "never more teams than items");
  cr_assert_eq(fa_persist_grid_for(sms, 40, LONG, 3), 3, "gpu_persist 3: at most 3 teams");
  cr_assert_eq(fa_persist_grid_for(sms, 2, LONG, 3), 2, "gpu_persist 3, two items");
  cr_assert_eq(fa_persist_grid_for(sms, 5120, LONG, 1000), sms, "gpu_persist 1000: one an SM at most");
  cr_assert_eq(fa_persist_grid_for(0, 5120, LONG, 1), 0, "unknown multiprocessors: a team an item");
  cr_assert_eq(fa_persist_grid_for(sms, 0, LONG, 1), 0, "no items");
  const int64_t many = 31 * sms; /* 64 causal sequences of 512 rows, 16 heads: ~320 keys an item */
  cr_assert_eq(fa_persist_grid_for(sms, many, 320, -1), 0, "short items: a team an item");
  cr_assert_eq(fa_persist_grid_for(sms, many, FA_PERSIST_MIN_KEYS_PER_ITEM, -1), sms, "the keys threshold itself");
  cr_assert_eq(fa_persist_grid_for(sms, many, 320, 1), sms, "gpu_persist 1 still forces them");
  cr_assert_eq(fa_persist_grid_for(sms, many, LONG, FA_PERSIST_STREAM), 0, "stream teams are not persistent ones");
  /* the forward's stream teams: short items from two an SM, or forced */
  cr_assert_eq(fa_stream_grid_for(sms, many, 320, -1), sms, "short items: one stream team an SM");
  cr_assert_eq(fa_stream_grid_for(sms, FA_STREAM_MIN_ITEMS_PER_SM * sms - 1, 320, -1), 0, "too few items");
  cr_assert_eq(fa_stream_grid_for(sms, many, LONG, -1), 0, "long items");
  cr_assert_eq(fa_stream_grid_for(sms, many, 320, 0), 0, "gpu_persist 0");
  cr_assert_eq(fa_stream_grid_for(sms, many, 320, 1), 0, "gpu_persist 1: persistent teams");
  cr_assert_eq(fa_stream_grid_for(sms, 7, LONG, FA_PERSIST_STREAM), 7, "forced: never more teams than items");
  cr_assert_eq(fa_stream_grid_for(0, many, 320, FA_PERSIST_STREAM), 0, "unknown multiprocessors");
}
