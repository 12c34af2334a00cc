/* Sum the gradients of rows that several parts of a partition hold.
 *
 * Every rank derives the same list of shared global rows from the partition
 * (rows that appear in two or more parts), packs its values for those rows
 * (zeros for shared rows it does not hold), and one MPI_Allreduce over that
 * list sums them. Only shared rows travel: the duplicated ancestors, not the
 * whole tree. */
#include <stdarg.h>
#include <stdint.h>
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
  int64_t *count = fa_calloc((size_t)total + 1, sizeof *count), *loc = fa_malloc_array(total + 1, sizeof *loc);
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

/* Result of this rank's own checks and allocations, before any rank reduces. */
typedef struct {
  forkattn_status status;
  char msg[FA_MSG_LEN];
} fa_local;

static void fa_local_fail(fa_local *l, forkattn_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void fa_local_fail(fa_local *l, forkattn_status status, const char *fmt, ...) {
  if (l->status) return; /* keep the first failure */
  l->status = status;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(l->msg, sizeof l->msg, fmt, ap);
  va_end(ap);
}

/* The agreement vector, reduced with MPI_MAX (minima travel negated): which
 * rank failed and how, the number of tensors, the shared-row count and each
 * tensor's heads and head_dim. A rank that failed contributes INT64_MIN to all
 * but the first slot, so its arguments never show up as a mismatch. */
enum { AG_FAIL, AG_COUNT, AG_SHARED = AG_COUNT + 2, AG_SHAPE = AG_SHARED + 2,
       AG_LEN = AG_SHAPE + 4 * FA_MPI_MAX_TENSORS };

static void fa_ag_put(int64_t *ag, int slot, int64_t v) {
  ag[slot] = v;
  ag[slot + 1] = -v;
}

/* the ranks disagree on the value of ag[slot] (max != min) */
static int fa_ag_differs(const int64_t *ag, int slot) { return ag[slot] != -ag[slot + 1]; }

forkattn_status forkattn_partition_allreduce(forkattn_ctx *ctx, MPI_Comm comm,
                                             const forkattn_partition *partition,
                                             const forkattn_tensor *const *tensors, int count) {
  fa_clear_error(ctx);
  int rank, size;
  if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS || MPI_Comm_size(comm, &size) != MPI_SUCCESS)
    return fa_fail(ctx, FORKATTN_ERR_DEVICE, "allreduce: MPI_Comm_rank/size failed");

  /* 1. Local checks and every allocation. A rank that fails here must not
   * return yet: the others would wait in the reduction for ever. */
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  fa_local me = {FORKATTN_OK, ""};
  int64_t width = 0, m = 0, *local = NULL;
  float *buf = NULL;
  if (!ctx) fa_local_fail(&me, bad, "ctx is NULL");
  if (!partition) fa_local_fail(&me, bad, "partition is NULL");
  else if ((int64_t)size != forkattn_partition_num_parts(partition))
    fa_local_fail(&me, bad, "communicator has %d ranks, the partition %lld parts", size,
                  (long long)forkattn_partition_num_parts(partition));
  if (count < 0 || count > FA_MPI_MAX_TENSORS)
    fa_local_fail(&me, bad, "count %d outside 0..%d", count, FA_MPI_MAX_TENSORS);
  else if (count > 0 && !tensors) fa_local_fail(&me, bad, "tensors is NULL with count %d", count);
  if (!me.status) {
    int64_t rows = 0;
    forkattn_partition_rows(partition, rank, &rows);
    for (int i = 0; i < count && !me.status; i++) {
      const forkattn_tensor *t = tensors[i];
      char name[32];
      snprintf(name, sizeof name, "tensors[%d]", i);
      forkattn_status st = fa_check_tensor(ctx, name, t, t ? t->dtype : FORKATTN_DTYPE_F32, rows,
                                           t ? t->heads : 1, t ? t->head_dim : 1);
      int64_t w;
      if (st) fa_local_fail(&me, st, "%s", forkattn_ctx_last_error(ctx));
      else if (__builtin_mul_overflow(t->heads, t->head_dim, &w) || __builtin_add_overflow(width, w, &width))
        fa_local_fail(&me, bad, "%s: heads*head_dim summed over the tensors overflows int64", name);
    }
  }
  if (!me.status) {
    m = fa_shared_rows(partition, rank, &local);
    if (m < 0) fa_local_fail(&me, FORKATTN_ERR_OUT_OF_MEMORY, "cannot allocate the shared-row list");
  }
  int64_t elems = 0;
  if (!me.status && m > 0 && width > 0) {
    if (__builtin_mul_overflow(m, width, &elems) || (uint64_t)elems > SIZE_MAX / sizeof *buf)
      fa_local_fail(&me, FORKATTN_ERR_OUT_OF_MEMORY, "%lld shared rows of %lld values overflow size_t",
                    (long long)m, (long long)width);
    else if (!(buf = fa_calloc((size_t)elems, sizeof *buf)))
      fa_local_fail(&me, FORKATTN_ERR_OUT_OF_MEMORY, "cannot allocate %lld shared rows of %lld values",
                    (long long)m, (long long)width);
  }

  /* 2. Agree: every rank learns the worst failure (lowest rank among those with
   * the highest status) and whether the ranks' arguments match. */
  int64_t ag[AG_LEN];
  for (int i = 0; i < AG_LEN; i++) ag[i] = INT64_MIN;
  ag[AG_FAIL] = me.status ? ((int64_t)me.status << 32) | (int64_t)(INT32_MAX - rank) : 0;
  if (!me.status) {
    fa_ag_put(ag, AG_COUNT, count);
    fa_ag_put(ag, AG_SHARED, m);
    for (int i = 0; i < count; i++) {
      fa_ag_put(ag, AG_SHAPE + 4 * i, tensors[i]->heads);
      fa_ag_put(ag, AG_SHAPE + 4 * i + 2, tensors[i]->head_dim);
    }
  }
  forkattn_status st = FORKATTN_OK;
  int rc = MPI_Allreduce(MPI_IN_PLACE, ag, AG_LEN, MPI_INT64_T, MPI_MAX, comm);
  if (rc != MPI_SUCCESS) {
    st = fa_fail(ctx, FORKATTN_ERR_DEVICE, "allreduce: MPI_Allreduce of the ranks' checks failed (%d)", rc);
  } else if (ag[AG_FAIL] != 0) {
    /* the failing rank tells the others what went wrong */
    const int who = INT32_MAX - (int)(ag[AG_FAIL] & 0xffffffff);
    if (MPI_Bcast(me.msg, (int)sizeof me.msg, MPI_CHAR, who, comm) != MPI_SUCCESS)
      snprintf(me.msg, sizeof me.msg, "(its message could not be broadcast)");
    me.msg[sizeof me.msg - 1] = '\0';
    st = fa_fail(ctx, (forkattn_status)(ag[AG_FAIL] >> 32), "allreduce: rank %d of %d: %s", who, size, me.msg);
  } else if (fa_ag_differs(ag, AG_COUNT)) {
    st = fa_fail(ctx, bad, "allreduce: ranks pass different numbers of tensors (%lld to %lld)",
                 (long long)-ag[AG_COUNT + 1], (long long)ag[AG_COUNT]);
  } else if (fa_ag_differs(ag, AG_SHARED)) {
    st = fa_fail(ctx, bad, "allreduce: ranks' partitions differ (%lld to %lld shared rows)",
                 (long long)-ag[AG_SHARED + 1], (long long)ag[AG_SHARED]);
  } else {
    for (int i = 0; i < count && !st; i++)
      for (int j = 0; j < 2 && !st; j++)
        if (fa_ag_differs(ag, AG_SHAPE + 4 * i + 2 * j))
          st = fa_fail(ctx, bad, "allreduce: tensors[%d]: ranks pass different %s (%lld to %lld)", i,
                       j ? "head_dim" : "heads", (long long)-ag[AG_SHAPE + 4 * i + 2 * j + 1],
                       (long long)ag[AG_SHAPE + 4 * i + 2 * j]);
  }
  if (st || !buf) {
    fa_free(buf);
    fa_free(local);
    return st;
  }

  /* 3. Every rank passed: pack, reduce, unpack. */
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
  const int64_t total = elems, chunk = 1 << 28;
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
