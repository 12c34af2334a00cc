/* The two-warpgroup forward and dQ as persistent teams (one an SM, items
 * from a counter: gpu_tile_ring.h, gpu_persist.h) give bitwise the outputs of a
 * team an item, on layouts of several items an SM, alternating so that each
 * call's counter is the one the previous call left in the pool block; once
 * with a team an SM and once with three teams for the whole launch. So does
 * the forward as stream teams (gpu_fwd_stream_team.h: one ring across a
 * team's items). The
 * choice itself is unit-tested on the host (test_gpu_pool, test_gpu_select).
 * Skipped on a CPU context. [device only] */
#include <criterion/criterion.h>

#include "device_problem.h"
#include "test_common.h"

/* Each set run as a team an item (the reference context, FORKATTN_GPU_PERSIST=0), then as
 * persistent teams (the other, FORKATTN_GPU_PERSIST=mode), and compared bitwise. */
static void persistent_matches(const char *mode, const char *name, const char *what) {
  dp_duo d;
  dp_duo_init_env(&d, name, "FORKATTN_GPU_PERSIST", "0", mode);
  for (int i = 0; i < DP_SETS; i++) {
    const dp_lay *L = i % 2 ? &d.b : &d.a;
    dp_fwd(&d.ps, L, &d.ps.set[i]);
    dp_bwd(&d.ps, L, &d.ps.set[i]);
    dp_fwd(&d.pq, L, &d.pq.set[i]);
    dp_bwd(&d.pq, L, &d.pq.set[i]);
  }
  for (int i = 0; i < DP_SETS; i++)
    dp_assert_same(&d, i, i % 2 ? &d.b : &d.a, what);
  dp_duo_free(&d);
}

/* One team an SM, whatever the items an SM. */
Test(persist, persistent_teams_match_a_team_an_item_bitwise) {
  persistent_matches("1", "persist/bitwise", "persistent teams differ from a team an item");
}

/* Three teams: each runs dozens of items, so the ring's re-initialisation
 * and the next-item slots of both parities are used many times a launch. */
Test(persist, three_persistent_teams_match_a_team_an_item_bitwise) {
  persistent_matches("3", "persist/three_teams", "persistent teams differ from a team an item");
}

/* The forward's stream teams, one an SM at most: a team's items share one ring, whose copies run
 * on from one item's tiles into the next's. */
Test(persist, stream_teams_match_a_team_an_item_bitwise) {
  persistent_matches("stream", "persist/stream", "stream teams differ from a team an item");
}
