/* Tensor descriptor helpers. */
#include "forkattn.h"

forkattn_tensor forkattn_tensor_contiguous(void *data, forkattn_dtype dtype, int64_t rows,
                                           int64_t heads, int64_t head_dim) {
  forkattn_tensor t;
  t.data = data;
  t.dtype = dtype;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  /* an overflowing product gives row_stride 0, which every call refuses */
  if (__builtin_mul_overflow(heads, head_dim, &t.row_stride)) t.row_stride = 0;
  t.head_stride = head_dim;
  return t;
}
