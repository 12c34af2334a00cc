/* Sum the gradients of rows that several parts of a partition hold.
 *
 * Every rank derives the same list of shared global rows from the partition
 * (rows that appear in two or more parts), packs its values for those rows
 * (zeros for shared rows it does not hold), and one MPI_Allreduce over that
 * list sums them. Only shared rows travel: the duplicated ancestors, not the
 * whole tree. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "context_internal.h"
#include "dtype_convert.h"
#include "forkattn_mpi.h"
#include "validate.h"

#define FA_MPI_MAX_TENSORS 16

/* Shared global rows in increasing order, and for this part the local row of
 * each (-1 where the part does not hold it). Returns the count, or -1 (OOM). */
static int64_t fa_shared_rows(const forkattn_partition *pt, int64_t part, int64_t **local_of) {
  const int64_t parts = forkattn_partition_num_parts(pt);
  int64_t total = 0;
  for (int64_t i = 0; i < parts; i++) {
    int64_t n = 0;
    const int64_t *rows = forkattn_partition_rows(pt, i, &n);
    for (int64_t r = 0; rows && r < n; r++)
      if (rows[r] + 1 > total) total = rows[r] + 1;
  }
  int64_t *count = fa_calloc((size_t)total + 1, sizeof *count), *loc = fa_malloc(sizeof *loc * ((size_t)total + 1));
  if (!count || !loc) {
    fa_free(count);
    fa_free(loc);
    return -1;
  }
  for (int64_t g = 0; g < total; g++) loc[g] = -1;
  for (int64_t i = 0; i < parts; i++) {
    int64_t n = 0;
    const int64_t *rows = forkattn_partition_rows(pt, i, &n);
    for (int64_t r = 0; rows && r < n; r++) {
      count[rows[r]]++;
      if (i == part) loc[rows[r]] = r;
    }
  }
  int64_t m = 0;
  for (int64_t g = 0; g < total; g++)
    if (count[g] > 1) loc[m++] = loc[g]; /* compact in place: m <= g */
  fa_free(count);
  *local_of = loc;
  return m;
}

forkattn_status forkattn_partition_allreduce(forkattn_ctx *ctx, MPI_Comm comm,
                                             const forkattn_partition *partition,
                                             const forkattn_tensor *const *tensors, int count) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!partition) return fa_fail(ctx, bad, "allreduce: partition is NULL");
  if (count < 0 || count > FA_MPI_MAX_TENSORS)
    return fa_fail(ctx, bad, "allreduce: count %d outside 0..%d", count, FA_MPI_MAX_TENSORS);
  if (count > 0 && !tensors) return fa_fail(ctx, bad, "allreduce: tensors is NULL with count %d", count);
  int rank, size;
  if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS || MPI_Comm_size(comm, &size) != MPI_SUCCESS)
    return fa_fail(ctx, FORKATTN_ERR_DEVICE, "allreduce: MPI_Comm_rank/size failed");
  if ((int64_t)size != forkattn_partition_num_parts(partition))
    return fa_fail(ctx, bad, "allreduce: communicator has %d ranks, the partition %lld parts", size,
                   (long long)forkattn_partition_num_parts(partition));
  int64_t rows = 0;
  forkattn_partition_rows(partition, rank, &rows);
  int64_t width = 0;
  for (int i = 0; i < count; i++) {
    const forkattn_tensor *t = tensors[i];
    char name[32];
    snprintf(name, sizeof name, "tensors[%d]", i);
    forkattn_status st = fa_check_tensor(ctx, name, t, t ? t->dtype : FORKATTN_DTYPE_F32, rows,
                                         t ? t->heads : 1, t ? t->head_dim : 1);
    if (st) return st;
    width += t->heads * t->head_dim;
  }
  int64_t *local = NULL;
  const int64_t m = fa_shared_rows(partition, rank, &local);
  if (m < 0) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "allreduce: cannot allocate the shared-row list");
  if (m == 0 || width == 0) {
    fa_free(local);
    return FORKATTN_OK;
  }
  float *buf = fa_calloc((size_t)(m * width), sizeof *buf);
  if (!buf) {
    fa_free(local);
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "allreduce: cannot allocate %lld shared rows",
                   (long long)m);
  }
  /* pack: row-major over shared rows, tensors side by side */
  for (int64_t s = 0; s < m; s++) {
    if (local[s] < 0) continue;
    float *dst = buf + s * width;
    for (int i = 0; i < count; i++) {
      const forkattn_tensor *t = tensors[i];
      for (int64_t h = 0; h < t->heads; h++)
        for (int64_t c = 0; c < t->head_dim; c++)
          *dst++ = fa_load(t->data, (int)t->dtype, local[s] * t->row_stride + h * t->head_stride + c);
    }
  }
  /* MPI counts are int: reduce in chunks */
  int rc = MPI_SUCCESS;
  const int64_t total = m * width, chunk = 1 << 28;
  for (int64_t off = 0; off < total && rc == MPI_SUCCESS; off += chunk) {
    const int n = (int)(total - off < chunk ? total - off : chunk);
    rc = MPI_Allreduce(MPI_IN_PLACE, buf + off, n, MPI_FLOAT, MPI_SUM, comm);
  }
  if (rc == MPI_SUCCESS)
    for (int64_t s = 0; s < m; s++) {
      if (local[s] < 0) continue;
      const float *src = buf + s * width;
      for (int i = 0; i < count; i++) {
        const forkattn_tensor *t = tensors[i];
        for (int64_t h = 0; h < t->heads; h++)
          for (int64_t c = 0; c < t->head_dim; c++)
            fa_store(t->data, (int)t->dtype, local[s] * t->row_stride + h * t->head_stride + c, *src++);
      }
    }
  fa_free(buf);
  fa_free(local);
  if (rc != MPI_SUCCESS) return fa_fail(ctx, FORKATTN_ERR_DEVICE, "allreduce: MPI_Allreduce failed (%d)", rc);
  return FORKATTN_OK;
}
