/* The GPU backend's host-side bookkeeping, run on the host: the context's
 * device-block cache (offload/gpu_pool.c) and the one-copy staging of plan
 * arrays (offload/gpu_stage.c), with the OpenMP initial device standing in for
 * the GPU (omp_target_alloc and omp_target_memcpy work there too). The GPU
 * suite runs the same code against the real device. */
#include <criterion/criterion.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "context_internal.h"
#include "gpu_pool.h"
#include "gpu_stage.h"
#include "test_common.h"

/* gpu_stage.c's kept-mask staging refers to these (lib/kept_set.c, which would
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
