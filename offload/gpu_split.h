/* The split pass: f32 inputs into bf16 pieces (lib/core/split_bf16.h) in the
 * call's device scratch, for the tensor-core kernels that multiply f32 at
 * the context's f32 precision (gpu_select.h: fa_gpu_select_pieces). */
#ifndef FORKATTN_GPU_SPLIT_H
#define FORKATTN_GPU_SPLIT_H
#include <stdint.h>

#include "gpu_stage.h"

/* x (a device view of an f32 [rows][heads][d]) as np (1 to FA_SPLIT_MAX) bf16 pieces, each a dense
 * [rows][heads][d] plane of scratch from st: *out views piece 0, *plane is the elements from one piece
 * to the next. *out may be x itself. 0, or -1 when the scratch cannot be had. */
int fa_gpu_split_pieces(fa_stage *st, fa_dev_tensor *out, int64_t *plane, const fa_dev_tensor *x, int64_t rows,
                        int64_t heads, int64_t d, int np);

#endif
