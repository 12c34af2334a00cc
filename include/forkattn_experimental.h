/**
 * @file forkattn_experimental.h
 * @brief Experimental forkattn APIs: the tree cost model and its calibration,
 * tree partitioning and batch planning, and the diffusion-LM reuse-depth profile.
 *
 * These are exported by the same library as forkattn.h but are outside its
 * stability promise: a minor release may change or remove any declaration
 * here, and the structs here have no struct_size field. forkattn_mpi.h builds
 * on the partition and so is experimental too. Include this header instead of
 * (or after) forkattn.h; it includes forkattn.h. Code that uses only
 * forkattn.h keeps working across every 1.x release.
 */
#ifndef FORKATTN_EXPERIMENTAL_H
#define FORKATTN_EXPERIMENTAL_H

#include "forkattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/** @name Tree cost model, partitioning and batch planning
 * Predict what a tree costs, split a tree across ranks or GPUs with balanced
 * cost (duplicating shared ancestors where a subtree is split), and group the
 * independent trees of a forest into launches, choosing per launch between
 * tree execution and plain per-sequence attention. All host-side, O(n) memory,
 * no recursion (chains of any depth work). Every function here checks all of
 * its arguments before it allocates, sets pointer outputs to NULL on any error,
 * and returns FORKATTN_ERR_OUT_OF_MEMORY (having freed everything) when an
 * allocation fails. Accessors accept NULL and out-of-range indices (they
 * return empty values; the layout accessors also return
 * FORKATTN_ERR_INVALID_ARGUMENT). See docs/tree.md. */
/**@{*/

/** Linear cost model of one forward + backward of tree attention:
 *  seconds = sec_per_mac * heads_q * head_dim * M + sec_per_row * heads_q * T
 *  + sec_per_pair * pairs, where M is the number of (query row, visible key)
 *  pairs, T the packed rows and pairs the (node, key segment) pairs of the
 *  tree's segment plan (a node has one per key segment on its root path; a
 *  chain of only children packed back to back reads one segment). */
typedef struct forkattn_tree_cost_model {
  int64_t heads_q;     /**< query heads of the calls being modelled (>= 1) */
  int64_t head_dim;    /**< head dimension (>= 1) */
  double sec_per_mac;  /**< seconds per visible (query row, key row, head, dim) term */
  double sec_per_row;  /**< seconds per packed row and query head */
  double sec_per_pair; /**< seconds per (node, key segment) pair: tile edges, plan, launch share */
} forkattn_tree_cost_model;

/**
 * A model with the given shape and coefficients measured by timing a few
 * trees (a long sequence, a chain and a binary tree of one-token nodes, a
 * star, a forest of short sequences, a small trie) with forkattn_tree_fwd()
 * and forkattn_tree_bwd() on the context's backend (host memory, random
 * inputs; median of a few runs), fitted by least squares on relative errors
 * with non-negative coefficients. Takes about a second; sizes shrink as
 * heads_q * head_dim grows. Timings depend on the machine's load.
 *
 * @param ctx the context whose backend is timed
 * @param heads_q query heads
 * @param heads_kv KV heads (divides heads_q)
 * @param head_dim head dimension
 * @param dtype storage dtype
 * @param model receives the fitted model (untouched on error)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY; or the
 *         status of a failed forkattn_tree_fwd() / forkattn_tree_bwd()
 */
FORKATTN_API forkattn_status forkattn_tree_cost_model_calibrate(forkattn_ctx *ctx, int64_t heads_q,
                                                                int64_t heads_kv, int64_t head_dim,
                                                                forkattn_dtype dtype,
                                                                forkattn_tree_cost_model *model);

/**
 * Predicted seconds of forward + backward tree attention over @p tree (the
 * model's formula; O(n) time).
 *
 * @param ctx the context (error messages)
 * @param tree the packed tree
 * @param model the cost model (heads_q, head_dim >= 1; coefficients finite, >= 0)
 * @param seconds receives the prediction (untouched on error)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY
 *         (O(n) scratch)
 */
FORKATTN_API forkattn_status forkattn_tree_cost(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                                const forkattn_tree_cost_model *model, double *seconds);

/** A partition of a tree into parts (opaque). */
typedef struct forkattn_partition forkattn_partition;

/**
 * Assign the leaves of @p tree (and so its root-to-leaf paths) to
 * @p num_parts parts so that the largest part's predicted cost (the step time
 * of parts run in parallel) is as small as possible, which also keeps it close
 * to the mean. Each part is a sub-forest of the tree: the nodes of its
 * leaves' paths, packed in the tree's order. A node belongs to every part
 * that holds one of its leaves (shared ancestors are duplicated) and is owned
 * by exactly one of them, the part of its first leaf in depth-first order
 * (children by index); a part runs attention over all of its rows and counts
 * outputs and losses only on the rows it owns. Summing every part's dq/dk/dv
 * scattered to global rows (with dout = 0 on rows a part does not own) gives
 * the single-process gradients.
 *
 * Candidates: contiguous ranges of leaves in depth-first order with min-max
 * split points; greedy LPT over leaves by decreasing path cost; single-leaf
 * moves and swaps out of the costliest part. The cheapest largest part wins
 * (ties: lower imbalance); deterministic. With more parts than leaves each
 * leaf gets its own part and the rest are empty.
 *
 * @param ctx the context (error messages)
 * @param tree the packed tree
 * @param num_parts >= 1 (parts may be empty when there are fewer leaves)
 * @param model the cost model balanced
 * @param partition receives the partition (NULL on error)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_tree_partition(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                                     int64_t num_parts,
                                                     const forkattn_tree_cost_model *model,
                                                     forkattn_partition **partition);

/** Free a partition (NULL is a no-op). @param partition the partition */
FORKATTN_API void forkattn_partition_free(forkattn_partition *partition);

/** @param partition the partition @return its number of parts */
FORKATTN_API int64_t forkattn_partition_num_parts(const forkattn_partition *partition);

/** The sub-forest of one part, in the part's own packed rows (arrays owned by
 *  the partition).
 *  @param partition the partition @param part 0 <= part < parts
 *  @param[out] layout receives the layout (num_nodes 0 for an empty part; an
 *         empty layout on error)
 *  @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (partition or layout
 *          NULL, or part out of range) */
FORKATTN_API forkattn_status forkattn_partition_layout(const forkattn_partition *partition, int64_t part,
                                                       forkattn_tree_layout *layout);

/** Global row (in the partitioned tree) of every row of a part.
 *  @param partition the partition @param part the part
 *  @param num_rows receives the part's row count (may be NULL)
 *  @return [num_rows] row indices, or NULL for a part without rows or a bad index */
FORKATTN_API const int64_t *forkattn_partition_rows(const forkattn_partition *partition, int64_t part,
                                                    int64_t *num_rows);

/** Ownership of every row of a part: 1 where this part owns the row, 0 for a
 *  duplicated ancestor row owned by another part. Every row of the tree is
 *  owned by exactly one part.
 *  @param partition the partition @param part the part
 *  @return [num_rows], or NULL for a part without rows or a bad index */
FORKATTN_API const unsigned char *forkattn_partition_owned(const forkattn_partition *partition,
                                                           int64_t part);

/** Predicted cost of one part (duplicated rows included).
 *  @param partition the partition @param part the part @return seconds (0 for a bad index) */
FORKATTN_API double forkattn_partition_cost(const forkattn_partition *partition, int64_t part);

/** Largest part cost over the mean part cost, the mean taken over all parts,
 *  empty ones included (1 = perfect balance; 1 for an empty tree).
 *  @param partition the partition @return the ratio (0 for NULL) */
FORKATTN_API double forkattn_partition_imbalance(const forkattn_partition *partition);

/** How a batch of the batch plan runs. */
typedef enum forkattn_exec_mode {
  FORKATTN_EXEC_TREE = 0,      /**< tree attention over the batch's packed trees */
  FORKATTN_EXEC_REPLICATED = 1 /**< plain causal attention per root-to-leaf sequence */
} forkattn_exec_mode;

/** A batch plan (opaque). */
typedef struct forkattn_batch_plan forkattn_batch_plan;

/**
 * Group the root trees of a packed forest (one tree per prompt, say) into
 * batches of at most @p max_batch_rows rows, trees of similar cost together
 * (one launch each), every tree in exactly one batch (a tree larger than the
 * limit gets a batch of its own). Trees are taken by decreasing predicted
 * cost and each goes to the first batch with room (first-fit decreasing); a
 * batch's nodes keep the forest's order. For every batch, decide from the
 * model whether tree execution pays against running each root-to-leaf
 * sequence separately as plain causal attention (predicted with the same
 * model: M = sum of L(L+1)/2, T = sum of L, one pair per sequence, over the
 * leaves' path lengths L): it runs replicated when the tree is predicted
 * slower (low deduplication or many tiny segments), and the reason says why.
 *
 * @param ctx the context (error messages)
 * @param forest the packed forest
 * @param max_batch_rows >= 1
 * @param model the cost model (its sec_per_pair term is what tiny segments cost)
 * @param plan receives the plan (NULL on error)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_tree_plan_batches(forkattn_ctx *ctx,
                                                        const forkattn_tree_layout *forest,
                                                        int64_t max_batch_rows,
                                                        const forkattn_tree_cost_model *model,
                                                        forkattn_batch_plan **plan);

/** Free a batch plan (NULL is a no-op). @param plan the plan */
FORKATTN_API void forkattn_batch_plan_free(forkattn_batch_plan *plan);

/** @param plan the plan @return the number of batches */
FORKATTN_API int64_t forkattn_batch_plan_count(const forkattn_batch_plan *plan);

/** The sub-forest of one batch in its own packed rows (arrays owned by the plan).
 *  @param plan the plan @param batch the batch index
 *  @param[out] layout receives the layout (an empty layout on error)
 *  @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (plan or layout NULL, or
 *          batch out of range) */
FORKATTN_API forkattn_status forkattn_batch_plan_layout(const forkattn_batch_plan *plan, int64_t batch,
                                                        forkattn_tree_layout *layout);

/** Global row of every row of a batch. @param plan the plan @param batch the batch
 *  @param num_rows receives the row count (may be NULL; 0 for a bad index)
 *  @return [num_rows], or NULL for a batch without rows or a bad index */
FORKATTN_API const int64_t *forkattn_batch_plan_rows(const forkattn_batch_plan *plan, int64_t batch,
                                                     int64_t *num_rows);

/** @param plan the plan @param batch the batch
 *  @return how the batch should run (FORKATTN_EXEC_TREE for a bad index) */
FORKATTN_API forkattn_exec_mode forkattn_batch_plan_mode(const forkattn_batch_plan *plan,
                                                         int64_t batch);

/** Why the batch runs that way, with the predicted costs of both modes and the
 *  deduplication ratio (replicated rows over packed rows), e.g.
 *  "tree: predicted 1.23 ms vs replicated 4.56 ms, dedup 3.70x".
 *  @param plan the plan @param batch the batch
 *  @return a string owned by the plan ("" for a bad index) */
FORKATTN_API const char *forkattn_batch_plan_reason(const forkattn_batch_plan *plan, int64_t batch);
/**@}*/

/** @name Reuse-depth profile (diffusion-LM KV cache)
 * How many leading layers b(r) a request with prefix share r may reuse a
 * cached prefix's K/V in (forkattn_kv_cache_lookup(), forkattn_prefix_cached_fwd()
 * and forkattn_kv_similarity() are the stable parts). docs/dlm-cache.md. */
/**@{*/

/** Reuse-depth profile: b(r) per prefix-ratio bin. */
typedef struct forkattn_reuse_profile forkattn_reuse_profile;

/**
 * An empty profile over `layers` layers with 1% ratio bins (r in [0, 1]).
 * Errors of the profile calls are explained in forkattn_ctx_last_error(ctx).
 * @param ctx the context (messages only) @param layers >= 1 @param threshold similarity a reused layer must keep (0..1; 0.95 usual)
 * @param profile the new profile @return FORKATTN_OK, INVALID_ARGUMENT or OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_reuse_profile_create(forkattn_ctx *ctx, int64_t layers, float threshold,
                                                           forkattn_reuse_profile **profile);
/** Free a profile. @param profile the profile (NULL: nothing) */
FORKATTN_API void forkattn_reuse_profile_free(forkattn_reuse_profile *profile);
/**
 * Add one measurement: a request with prefix ratio r and per-layer similarity
 * sim[0..layers) (e.g. forkattn_kv_similarity()'s mean per layer). Bins average
 * their measurements.
 * @param ctx the context @param profile the profile @param ratio r in [0, 1]
 * @param sim [layers] values in [-1, 1]
 * @return FORKATTN_OK or FORKATTN_ERR_INVALID_ARGUMENT
 */
FORKATTN_API forkattn_status forkattn_reuse_profile_add(forkattn_ctx *ctx, forkattn_reuse_profile *profile,
                                                        double ratio, const float *sim);
/**
 * Reuse depth b(r): the number of leading layers whose averaged similarity in
 * r's bin stays >= the threshold, made monotone non-decreasing in r
 * conservatively (a bin never reuses more than any higher-ratio bin with data
 * allows; bins without data take the nearest lower bin with data, or 0).
 * @param ctx the context @param profile the profile @param ratio r in [0, 1] @param depth 0..layers
 * @return FORKATTN_OK or FORKATTN_ERR_INVALID_ARGUMENT
 */
FORKATTN_API forkattn_status forkattn_reuse_profile_depth(forkattn_ctx *ctx, const forkattn_reuse_profile *profile,
                                                          double ratio, int64_t *depth);
/** Save as a small text file (layers, threshold, per-bin counts and means).
 *  @param ctx the context @param profile the profile @param path file path
 *  @return FORKATTN_OK, INVALID_ARGUMENT (also when the file cannot be written) */
FORKATTN_API forkattn_status forkattn_reuse_profile_save(forkattn_ctx *ctx, const forkattn_reuse_profile *profile,
                                                         const char *path);
/** Load a file written by forkattn_reuse_profile_save(); malformed files are refused.
 *  Reading is bounded (header lines 256 bytes, bin lines 64 + 40 x layers bytes,
 *  at most 1024 blank lines after "end"), so an endless stream is refused too.
 *  @param ctx the context @param path file path @param profile the loaded profile
 *  @return FORKATTN_OK, INVALID_ARGUMENT or OUT_OF_MEMORY */
FORKATTN_API forkattn_status forkattn_reuse_profile_load(forkattn_ctx *ctx, const char *path,
                                                         forkattn_reuse_profile **profile);
/**@}*/

#ifdef __cplusplus
}
#endif
#endif /* FORKATTN_EXPERIMENTAL_H */
