/* When the two-warpgroup forward and dQ run persistent teams
 * (FA_PERSISTENT_QUERY_TEAMS, gpu_work_scheduler.h): one team an SM taking items (query block x
 * query head) from a counter, instead of a team an item; and when the forward runs stream
 * teams (FA_STREAM_QUERY_TEAMS, gpu_fwd_stream_team.h): one team an SM running a fixed share of
 * the items through one ring, the next item's tiles copied while the current one computes. A persistent team
 * skips the gap between teams and the reload of its arguments, and pays an
 * atomic, a barrier and the ring's re-initialisation an item; on the H200
 * (docs/gpu-kernels.md) that gained 2.6 % (forward) and 2.2 % (dQ) at
 * case 2's ~39 items an SM and lost 2-4 % at case 1's ~4, hence the
 * threshold. Host code, tested in test_gpu_pool and test_gpu_select. */
#ifndef FORKATTN_GPU_PERSIST_H
#define FORKATTN_GPU_PERSIST_H
#include <stdint.h>

/* The context's gpu_persist value that asks for stream teams wherever the forward can run them. */
#define FA_PERSIST_STREAM (-2)
/* Items an SM from which the automatic choice runs persistent teams. */
#define FA_PERSIST_MIN_ITEMS_PER_SM 8
/* Keys an item sees (mean over the launch's query blocks) below which the automatic choice runs
 * a team an item: short items gain nothing from persistent teams (64 causal sequences of 512
 * rows, ~320 keys an item, on an H100: 0.43 ms a team an item, 0.45 ms persistent), while
 * case 2's items (~4600 keys) gain 2 %. */
#define FA_PERSIST_MIN_KEYS_PER_ITEM 1024

/* Why the automatic choice runs a launch a team an item, or FA_PERSIST_AUTO_YES. */
typedef enum { FA_PERSIST_AUTO_YES, FA_PERSIST_FEW_ITEMS, FA_PERSIST_SHORT_ITEMS } fa_persist_auto;
static inline fa_persist_auto fa_persist_auto_for(int sms, int64_t nteams, int64_t item_keys) {
  if (sms <= 0 || nteams < (int64_t)FA_PERSIST_MIN_ITEMS_PER_SM * sms) return FA_PERSIST_FEW_ITEMS;
  return item_keys < FA_PERSIST_MIN_KEYS_PER_ITEM ? FA_PERSIST_SHORT_ITEMS : FA_PERSIST_AUTO_YES;
}

/* Teams of the launch for nteams items of seeing item_keys keys each (mean) on `sms`
 * multiprocessors; 0: a team an item. mode (the context's gpu_persist, gpu_select.h): 0 never,
 * 1 always, n > 1 always with at most n teams (many items a team on small launches, for the
 * sanitizers and test_persist), -1 auto. */
static inline int fa_persist_grid_for(int sms, int64_t nteams, int64_t item_keys, int mode) {
  if (mode == 0 || mode == FA_PERSIST_STREAM || sms <= 0 || nteams <= 0) return 0;
  if (mode < 0 && fa_persist_auto_for(sms, nteams, item_keys) != FA_PERSIST_AUTO_YES) return 0;
  const int cap = mode > 1 && mode < sms ? mode : sms;
  return nteams < cap ? (int)nteams : cap;
}

/* Items an SM from which the automatic choice runs short items (under FA_PERSIST_MIN_KEYS_PER_ITEM
 * keys) on stream teams: with one, there is no next item whose tiles could overlap. */
#define FA_STREAM_MIN_ITEMS_PER_SM 2

/* Stream teams of the forward's launch of nteams items seeing item_keys keys each (mean); 0: none
 * (persistent teams or a team an item, fa_persist_grid_for). mode as fa_persist_grid_for's, and
 * FA_PERSIST_STREAM: always. */
static inline int fa_stream_grid_for(int sms, int64_t nteams, int64_t item_keys, int mode) {
  if (sms <= 0 || nteams <= 0 || (mode != -1 && mode != FA_PERSIST_STREAM)) return 0;
  if (mode == -1 && (item_keys >= FA_PERSIST_MIN_KEYS_PER_ITEM || nteams < (int64_t)FA_STREAM_MIN_ITEMS_PER_SM * sms))
    return 0;
  return nteams < sms ? (int)nteams : sms;
}

#endif
