/* Host side of the bulk tensor copies (gpu_tma.h): tensor maps encoded by
 * the CUDA driver's cuTensorMapEncodeTiled, looked up in libcuda.so.1 at
 * run time so that the library neither links the driver nor needs its
 * headers. The enum values are the driver API's (cuda.h, CUDA 12 and 13). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "gpu_tma.h"

typedef int (*fa_encode_fn)(void *map, int dtype, uint32_t rank, void *base, const uint64_t *dims,
                            const uint64_t *strides, const uint32_t *box, const uint32_t *elem_strides,
                            int interleave, int swizzle, int l2_promotion, int oob_fill);

enum {
  FA_TMA_FLOAT16 = 6,    /* CU_TENSOR_MAP_DATA_TYPE_FLOAT16 */
  FA_TMA_BFLOAT16 = 9,   /* CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 */
  FA_TMA_SWIZZLE_128B = 3,
  FA_TMA_L2_256B = 3,    /* CU_TENSOR_MAP_L2_PROMOTION_L2_256B */
};

static fa_encode_fn fa_tma_encoder(void) {
  static fa_encode_fn fn; /* the driver stays loaded by the offload runtime; a race stores the same value */
  if (!fn) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h) fn = (fa_encode_fn)(uintptr_t)dlsym(h, "cuTensorMapEncodeTiled");
  }
  return fn;
}

int fa_gpu_tma_encode(fa_tma_map *map, const void *base, int f16, int64_t rows, int64_t heads, int64_t d,
                      int64_t row_stride, int64_t head_stride, int box_rows, char *msg, int msg_len) {
  const fa_encode_fn enc = fa_tma_encoder();
  if (!enc) {
    snprintf(msg, (size_t)msg_len, "no cuTensorMapEncodeTiled in libcuda.so.1");
    return -1;
  }
  memset(map, 0, sizeof *map);
  const uint64_t dims[3] = {(uint64_t)d, (uint64_t)heads, (uint64_t)rows};
  const uint64_t strides[2] = {(uint64_t)head_stride * 2, (uint64_t)row_stride * 2}; /* bytes, dims 1 and 2 */
  const uint32_t box[3] = {64, 1, (uint32_t)box_rows}, ones[3] = {1, 1, 1};
  const int rc = enc(map, f16 ? FA_TMA_FLOAT16 : FA_TMA_BFLOAT16, 3, (void *)(uintptr_t)base, dims, strides, box,
                     ones, 0, FA_TMA_SWIZZLE_128B, FA_TMA_L2_256B, 0);
  if (rc) {
    snprintf(msg, (size_t)msg_len, "cuTensorMapEncodeTiled: CUresult %d", rc);
    return -1;
  }
  return 0;
}
