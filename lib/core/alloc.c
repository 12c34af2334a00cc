/* Host allocation wrappers with optional failure injection. */
#include "alloc.h"

#include <stdint.h>
#include <stdlib.h>

#include "forkattn.h"

#ifdef FORKATTN_ALLOC_TEST
#include <stdatomic.h>

/* Allocations left before the failing one (< 0: never fail), and a count of
 * allocations; atomic because worker threads allocate their scratch concurrently. */
static _Atomic int64_t fa_fail_countdown = -1, fa_alloc_count;

/* Test hook (exported only by FORKATTN_ALLOC_TEST builds): the (n+1)-th
 * library allocation from now fails (n = 0: the next one); n < 0 disables.
 * Returns the number of allocations counted since the previous call. */
FORKATTN_API int64_t forkattn_test_fail_alloc_after(int64_t n);

int64_t forkattn_test_fail_alloc_after(int64_t n) {
  atomic_store(&fa_fail_countdown, n);
  return atomic_exchange(&fa_alloc_count, 0);
}

int fa_alloc_inject_failure(void) {
  atomic_fetch_add(&fa_alloc_count, 1);
  int64_t left = atomic_load(&fa_fail_countdown);
  /* claim the countdown step; exactly one allocation sees it reach 0 */
  while (left >= 0 && !atomic_compare_exchange_weak(&fa_fail_countdown, &left, left - 1)) {
  }
  return left == 0;
}
#else
int fa_alloc_inject_failure(void) { return 0; }
#endif

void *fa_malloc(size_t bytes) { return fa_alloc_inject_failure() ? NULL : malloc(bytes ? bytes : 1); }

void *fa_calloc(size_t count, size_t size) {
  return fa_alloc_inject_failure() ? NULL : calloc(count ? count : 1, size ? size : 1);
}

void *fa_malloc_array(int64_t count, size_t size) {
  size_t bytes;
  if (count < 0 || __builtin_mul_overflow((size_t)count, size, &bytes)) return NULL;
  return fa_malloc(bytes);
}

void *fa_aligned_alloc(size_t bytes) {
  if (fa_alloc_inject_failure()) return NULL;
  if (bytes > SIZE_MAX - 63) return NULL; /* rounding up would wrap to a tiny block */
  return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

void fa_free(void *p) { free(p); }
