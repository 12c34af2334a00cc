/* When V's finite check (gpu_finite_check.h) runs before the two-warpgroup forward: only on
 * launches of many items. The check costs a launch and a pass over V, a few microseconds whatever
 * the call; the tile scans it saves cost about as much an item on the SM's critical path. On an
 * H100 (grid, side by side with SDPA) the check lost 10-30 % of the forward on calls of 8 to 192
 * items (a tiny call, GRPO groups of 1-3k rows) and gained 5-15 % on 256 causal sequences of 128
 * rows (3.5k-8k items). Host code, tested in test_gpu_select. */
#ifndef FORKATTN_GPU_FINITE_CHECK_POLICY_H
#define FORKATTN_GPU_FINITE_CHECK_POLICY_H
#include <stdint.h>

/* Items (query block x query head) an SM from which the forward checks V instead of scanning. */
#define FA_V_CHECK_MIN_ITEMS_PER_SM 4

/* 1 when a forward of `items` items on `sms` multiprocessors (0: unknown) checks V first. */
static inline int fa_v_check_pays(int sms, int64_t items) {
  return sms > 0 && items >= (int64_t)FA_V_CHECK_MIN_ITEMS_PER_SM * sms;
}

#endif
