/* Bulk tensor copies (TMA) from OpenMP offload (offload/gpu_tma.h), on the
 * GPU: one team copies 64-row x 128-column tiles of a strided
 * [rows][heads][128] bf16 tensor twice, by two TMA boxes (one 64-column
 * slab each, 128-byte swizzle) and by the cp.async loader the kernels use
 * (fa_mma_load_rows, wgmma layout), and both land in team memory; every
 * element must be equal, and equal to the host's swizzled copy of the same
 * rows (zeros past the tensor's end). The barrier serves two phases (a full
 * tile, then a tile that runs past the last row) so its parity tracking is
 * checked too. Skipped without a device that runs the image (sm_90 builds
 * only; CI has no GPU). [needs the GPU: the GPU suite runs it] */
#include <criterion/criterion.h>
#include <omp.h>
#include <ompx.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_mma.h"
#include "gpu_mma_tiles.h"
#include "gpu_tma.h"
#include "gpu_wgmma.h"
#include "test_common.h"

#define ROWS 200
#define HEADS 3
#define D 128
#define RS (HEADS * D + 8) /* padded rows: strides other than the dense ones */
#define TILE (64 * D)      /* elements of one tile */

static int device_runs(int dev) {
  int on = 0;
#pragma omp target map(from : on) device(dev)
  on = !omp_is_initial_device();
  return on;
}

/* Tiles at rows r[0] and r[1] of head h: out[p * 2 * TILE + w * TILE + i] is
 * element i of phase p's tile, w = 0 by TMA, 1 by cp.async. */
static void copy_tiles(int dev, fa_dev_tensor t, const fa_tma_map *map, int h, int r0, int r1, uint16_t *out) {
  const size_t smem = 2 * TILE * 2 + 64 + FA_WG_BLOCK_BYTES;
#pragma omp target teams ompx_bare num_teams(1) thread_limit(128) ompx_dyn_cgroup_mem(smem) device(dev) \
    firstprivate(t, map, h, r0, r1, out)
  {
    unsigned short *sm = (unsigned short *)llvm_omp_target_dynamic_shared_alloc();
    sm += fa_wg_align(fa_smem_of(sm));
    const fa_smem m = fa_smem_of(sm);
    const int tid = ompx_thread_id_x(), bar = 2 * TILE;
    if (tid == 0) fa_mbar_init(m, bar, 1);
    ompx_sync_block_acq_rel();
    for (int ph = 0; ph < 2; ph++) {
      const int row = ph ? r1 : r0, n = ROWS - row < 64 ? ROWS - row : 64;
      if (tid == 0) {
        fa_mbar_expect_tx(m, bar, TILE * 2); /* whole boxes count, zero-filled rows too */
        fa_tma_load_3d(m, 0, map, 0, h, row, bar);
        fa_tma_load_3d(m, 64 * 64, map, 64, h, row, bar);
      }
      fa_mma_load_rows(m, TILE, D, 64, D, t, row, n, h, tid);
      fa_cp_async_commit();
      fa_cp_async_wait(0);
      fa_mbar_wait(m, bar, ph);
      ompx_sync_block_acq_rel();
      for (int i = tid; i < 2 * TILE; i += 128) out[ph * 2 * TILE + i] = sm[i];
      ompx_sync_block_acq_rel(); /* the next phase overwrites both tiles */
    }
  }
}

Test(tma, boxes_land_where_the_cp_async_loader_puts_the_rows) {
  const int dev = omp_get_default_device();
  if (omp_get_num_devices() == 0 || !device_runs(dev)) cr_skip_test("no GPU runs this build's device image");
  tc_rng rng = tc_rng_for("tma/boxes");
  const size_t n = (size_t)ROWS * RS;
  uint16_t *host = malloc(n * 2), *out = malloc(4 * TILE * 2);
  cr_assert(host && out);
  for (size_t i = 0; i < n; i++) host[i] = fa_f32_to_bf16((float)tc_uniform(&rng, -4.0, 4.0));
  for (size_t i = 0; i < 4 * TILE; i++) out[i] = 0x7fc1; /* poison: a NaN pattern no copy writes */
  uint16_t *dt = omp_target_alloc(n * 2, dev), *dout = omp_target_alloc(4 * TILE * 2, dev);
  fa_tma_map *dmap = omp_target_alloc(sizeof(fa_tma_map), dev);
  cr_assert(dt && dout && dmap);
  cr_assert_eq(omp_target_memcpy(dt, host, n * 2, 0, 0, dev, omp_get_initial_device()), 0);
  cr_assert_eq(omp_target_memcpy(dout, out, 4 * TILE * 2, 0, 0, dev, omp_get_initial_device()), 0);
  fa_tma_map map;
  char msg[128];
  cr_assert_eq(fa_gpu_tma_encode(&map, dt, 0, ROWS, HEADS, D, RS, D, 64, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(omp_target_memcpy(dmap, &map, sizeof map, 0, 0, dev, omp_get_initial_device()), 0);

  const int h = (int)tc_randint(&rng, 0, HEADS - 1), r0 = (int)tc_randint(&rng, 0, ROWS - 64);
  const int r1 = ROWS - (int)tc_randint(&rng, 1, 63); /* past the last row: zero-filled */
  const fa_dev_tensor t = {dt, FORKATTN_DTYPE_BF16, RS, D};
  copy_tiles(dev, t, dmap, h, r0, r1, dout);
  cr_assert_eq(omp_target_memcpy(out, dout, 4 * TILE * 2, 0, 0, omp_get_initial_device(), dev), 0);

  long bad_tma = 0, bad_cp = 0;
  for (int ph = 0; ph < 2; ph++) {
    const int row = ph ? r1 : r0;
    for (int r = 0; r < 64; r++)
      for (int c = 0; c < D; c++) {
        const uint16_t want = row + r < ROWS ? host[(size_t)(row + r) * RS + (size_t)h * D + c] : 0;
        const int at = fa_wg_elem(r, c, 64);
        bad_tma += out[ph * 2 * TILE + at] != want;
        bad_cp += out[ph * 2 * TILE + TILE + at] != want;
      }
  }
  cr_expect_eq(bad_cp, 0, "cp.async loader: %ld of %d elements differ from the host's swizzled rows", bad_cp,
               4 * TILE / 2);
  cr_expect_eq(bad_tma, 0, "TMA: %ld of %d elements differ (head %d, rows %d and %d)", bad_tma, 4 * TILE / 2, h,
               r0, r1);
  omp_target_free(dt, dev);
  omp_target_free(dout, dev);
  omp_target_free(dmap, dev);
  free(host);
  free(out);
}
