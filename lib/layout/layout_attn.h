/* The call flow every attention layout shares: check arguments, compile the
 * layout to a segment plan, run segment attention. A layout only supplies its
 * check and its plan builder. */
#ifndef FORKATTN_LAYOUT_ATTN_H
#define FORKATTN_LAYOUT_ATTN_H
#include "plan_cache.h"
#include "segment_attn.h"

typedef struct fa_layout_ops {
  /* Validate the layout; on success *rows = its packed row count. */
  forkattn_status (*check)(forkattn_ctx *ctx, const void *layout, int64_t *rows);
  /* Compile a checked layout; -1 on allocation failure. */
  int (*plan)(const void *layout, fa_plan *plan);
  /* What defines a checked layout's plan: the plan cache's key. */
  void (*key)(const void *layout, fa_plan_key *key);
} fa_layout_ops;

/* The two layouts' ops (prefix.c, tree.c). */
extern const fa_layout_ops fa_prefix_ops, fa_tree_ops;

/* Resolve a forkattn_layout to its ops and layout pointer (exactly one of
 * prefix / tree set). */
forkattn_status fa_layout_pick(forkattn_ctx *ctx, const forkattn_layout *layout, const fa_layout_ops **ops,
                               const void **l);

/* The plan of a checked layout for one call: the context's cached plan or one
 * built into *own (fa_plan_for_call); fa_plan_free(own) once the call is done. */
forkattn_status fa_layout_plan(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout, fa_plan *own,
                               const fa_plan **plan);

/* kept: optional kept set restricting the keys (forkattn_kept_fwd/bwd). */
forkattn_status fa_layout_fwd(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                              const forkattn_kept_set *kept, const forkattn_tensor *q, const forkattn_tensor *k,
                              const forkattn_tensor *v, const forkattn_tensor *o, float *lse,
                              float scale, forkattn_memory memory);

forkattn_status fa_layout_bwd(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *layout,
                              const forkattn_kept_set *kept, const forkattn_tensor *q, const forkattn_tensor *k,
                              const forkattn_tensor *v, const forkattn_tensor *o,
                              const forkattn_tensor *dout, const float *lse,
                              const forkattn_tensor *dq, const forkattn_tensor *dk,
                              const forkattn_tensor *dv, float scale, forkattn_memory memory);
#endif
