/**
 * @file forkattn_mpi.h
 * @brief Multi-rank tree attention through MPI (library forkattn_mpi, built
 * with -DFORKATTN_MPI=ON).
 *
 * Rank i of a communicator runs part i of a forkattn_partition: forward and
 * backward tree attention over the part's own rows (its leaves' root paths,
 * shared ancestors duplicated), with dout = 0 on the rows it does not own.
 * The gradients of the duplicated rows are then summed across the ranks that
 * hold them with forkattn_partition_allreduce(); afterwards every rank holds,
 * for each of its rows, exactly the single-process gradient.
 *
 * Experimental, as the partition it takes (forkattn_experimental.h, which
 * this header includes): a minor release may change it.
 */
#ifndef FORKATTN_MPI_H
#define FORKATTN_MPI_H

#include <mpi.h>

#include "forkattn_experimental.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Sum the rows that several parts share, across the ranks of @p comm (rank i
 * holds part i; the communicator's size must equal the partition's number of
 * parts). Every rank must call it with the same partition and the same number
 * of tensors of the same shape kind. Rows only this part holds are untouched.
 * Summation is in float32 (MPI_SUM over MPI_FLOAT), in rank order as MPI
 * defines it; the result is written back in each tensor's dtype.
 *
 * Collective on errors as well: every rank checks its own arguments and
 * allocates before any data moves, then the ranks agree on the outcome. When
 * any rank fails, every rank returns the failing rank's status with its
 * message ("allreduce: rank R of N: ..."); ranks that pass different counts,
 * heads or head_dim, or different partitions all return
 * FORKATTN_ERR_INVALID_ARGUMENT. No rank is left waiting in the reduction, and
 * on error no tensor is modified.
 *
 * @param ctx the context (error messages)
 * @param comm the communicator
 * @param partition the partition every rank built from the same tree and model
 * @param tensors @p count tensors of this rank's part: [part rows, heads, d]
 *        (e.g. dq, dk, dv), host memory
 * @param count number of tensors (0..16)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY;
 *         FORKATTN_ERR_DEVICE when an MPI call fails
 */
FORKATTN_API forkattn_status forkattn_partition_allreduce(forkattn_ctx *ctx, MPI_Comm comm,
                                                          const forkattn_partition *partition,
                                                          const forkattn_tensor *const *tensors,
                                                          int count);

#ifdef __cplusplus
}
#endif
#endif /* FORKATTN_MPI_H */
