/* A shared-prompt group held by the command-line tools: sizes, host tensors,
 * optional device copies, and the replicated formulation used as baseline. */
#ifndef FORKATTN_TOOLS_GROUP_H
#define FORKATTN_TOOLS_GROUP_H
#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

typedef struct tool_shape {
  int64_t n, p, r;      /* responses, prompt rows, rows per response */
  int64_t hq, hkv, d;   /* heads and head_dim */
  forkattn_dtype dtype;
  forkattn_mask mask;
} tool_shape;

/* Host buffers of one layout (packed shared group or replicated batch). */
typedef struct tool_group {
  forkattn_prefix_layout layout;
  int64_t *off;  /* response offsets */
  int64_t rows;
  void *q, *k, *v, *o, *dout, *dq, *dk, *dv; /* host, dtype elements */
  float *lse;
  /* device mirrors (GPU backend), NULL on CPU */
  void *dev[8];
  float *dev_lse;
} tool_group;

size_t tool_dtype_size(forkattn_dtype t);
/* Packed shared-prompt group with random q, k, v, dout (seeded). */
int tool_group_shared(tool_group *g, const tool_shape *s, uint64_t seed);
/* The same data replicated: response i gets its own prompt copy, one
 * variable-length batch; prompt dout goes to copy 0 only, so summing the
 * copies' gradients gives the shared gradients. */
int tool_group_replicated(tool_group *rep, const tool_group *shared, const tool_shape *s);
void tool_group_free(forkattn_ctx *ctx, tool_group *g);

/* Mirror the group on the device (GPU contexts); no-op on CPU. */
int tool_group_to_device(forkattn_ctx *ctx, tool_group *g, const tool_shape *s);
/* Run forward (and backward when bwd) on the group; device data if mirrored. */
forkattn_status tool_group_run(forkattn_ctx *ctx, tool_group *g, const tool_shape *s, int bwd);
/* Copy results (o, lse, dq, dk, dv) back from the device, if mirrored. */
int tool_group_fetch(forkattn_ctx *ctx, tool_group *g, const tool_shape *s);

/* Max |shared - replicated| over o, dq, dk, dv with prompt copies folded. */
typedef struct tool_errors {
  double o, lse, dq, dk, dv;  /* max abs diff / max abs value of the shared tensor */
} tool_errors;
/* Largest of o, dq, dk, dv. */
double tool_errors_max(const tool_errors *e);
void tool_compare(const tool_group *sh, const tool_group *rep, const tool_shape *s, tool_errors *e);

/* Useful FLOPs of the shared group and of the replicated batch (forward;
 * backward counts 2.5x forward, as FlashAttention reports). */
double tool_flops_shared(const tool_shape *s);
double tool_flops_replicated(const tool_shape *s);
/* Tensor bytes of a layout: q, k, v, o, dout, dq, dk, dv and lse. */
double tool_tensor_bytes(const tool_shape *s, int64_t rows);

double tool_now(void);
#endif
