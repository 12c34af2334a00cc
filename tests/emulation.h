/* What the tests of the tensor-core team functions under the host's SIMT
 * emulation (offload/gpu_mma.h; test_mma_emulated.c, test_split_emulated.c)
 * share: device-tensor views of host arrays, teams as `omp parallel`
 * regions, and a prefix layout's plan. Include after defining
 * FORKATTN_MMA_EMULATE and the team headers. */
#ifndef FORKATTN_TESTS_EMULATION_H
#define FORKATTN_TESTS_EMULATION_H
#include <criterion/criterion.h>
#include <omp.h>
#include <stdint.h>

#include "gpu_stage.h"
#include "segment_plan.h"

/* A dense [rows][heads][d] host array as a device tensor view. */
static inline fa_dev_tensor emu_view(void *data, int dtype, int64_t heads, int64_t d) {
  const fa_dev_tensor t = {data, dtype, heads * d, d};
  return t;
}

/* Run one team of the emulated kernel: NTH host threads (128, or 256 for the two-warpgroup forward). */
#define EMU_TEAM_OF(NTH, call)                                                                                  \
  do {                                                                                                          \
    const int want = (NTH);                                                                                     \
    int nth = 0;                                                                                                \
    _Pragma("omp parallel num_threads(want)") {                                                                  \
      _Pragma("omp single") nth = omp_get_num_threads();                                                        \
      call;                                                                                                     \
    }                                                                                                           \
    cr_assert_eq(nth, want, "the emulation needs %d threads, got %d", want, nth);                             \
  } while (0)
#define EMU_TEAM(call) EMU_TEAM_OF(FA_MMA_THREADS, call)
/* One emulated team of NTH threads per (query block blk < NB, query head h < NH): a query-side kernel's launch. */
#define EMU_QUERY_TEAMS(NTH, NB, NH, call)                                                                      \
  do {                                                                                                          \
    for (int64_t blk = 0; blk < (NB); blk++)                                                                    \
      for (int64_t h = 0; h < (NH); h++) EMU_TEAM_OF(NTH, call);                                               \
  } while (0)

/* Element e of row `row` of key block blk's gradient, KV head g, from its units' partial sums
 * ([units][hkv][krows][d] f32) added in unit order, as the GPU's reduce kernels do. */
static inline float emu_unit_sum(const float *part, const int64_t *unit_off, int64_t blk, int64_t hkv, int64_t g,
                                 int64_t krows, int64_t row, int64_t d, int64_t e) {
  float sum = 0;
  for (int64_t u = unit_off[blk]; u < unit_off[blk + 1]; u++) sum += part[((u * hkv + g) * krows + row) * d + e];
  return sum;
}

/* The plan of a prompt of P rows with N responses of lens[] rows (off[0 .. N] receives their offsets, so
 * off has N + 1 entries); returns the layout's rows. */
static inline int64_t emu_prefix_plan(fa_plan *plan, int64_t P, int64_t N, const int64_t *lens, int causal,
                                      int64_t *off) {
  off[0] = 0;
  for (int64_t i = 0; i < N; i++) off[i + 1] = off[i] + lens[i];
  cr_assert_eq(fa_plan_prefix(plan, P, N, off, causal), 0);
  return P + off[N];
}

#endif
