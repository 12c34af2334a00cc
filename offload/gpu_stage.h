/* Device views of a call's tensors. Device-memory calls use the caller's
 * pointers (strided as given). Host-memory calls stage each tensor into a
 * dense device buffer (packing strided inputs on the host first) and scatter
 * outputs back element-exactly, so gaps in interleaved host buffers (another
 * tensor's data) are never overwritten. */
#ifndef FORKATTN_GPU_STAGE_H
#define FORKATTN_GPU_STAGE_H
#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"
#include "kept_mask.h"

typedef struct fa_dev_tensor {
  void *data; /* device pointer */
  int dtype;
  int64_t rs, hs; /* element strides */
} fa_dev_tensor;

#define FA_STAGE_MAX 32
/* Largest plan copy that rides on a launch; larger ones are synchronous. */
#define FA_STAGE_CARRY_MAX ((size_t)256 * 1024)

typedef struct fa_stage {
  forkattn_ctx *ctx; /* device scratch comes from its pool (gpu_pool.h) */
  int device;
  int host; /* tensors live in host memory */
  int n;
  void *dev[FA_STAGE_MAX];
  int ncarried;
  void *carried[FA_STAGE_MAX]; /* packed host copies a launch will carry (gpu_launch_copy.h) */
  unsigned char in_pinned[FA_STAGE_MAX]; /* carried[i] lies in the page-locked buffer, else fa_calloc'ed */
  char *pinned;     /* the context's page-locked buffer while this stage holds it, or NULL */
  size_t pinned_at; /* bytes of it taken */
  size_t bytes;    /* device scratch allocated, for forkattn_ctx_peak_workspace() */
  int copy_failed; /* a host<->device copy failed (as opposed to an allocation) */
} fa_stage;

void fa_stage_init(fa_stage *s, forkattn_ctx *ctx, int host);
/* Device view of t; copy != 0 uploads its values (inputs). 0 or -1. */
int fa_stage_tensor(fa_stage *s, const forkattn_tensor *t, int copy, fa_dev_tensor *out);
/* Write a staged output back to the host tensor t (no-op for device memory). */
int fa_stage_tensor_back(fa_stage *s, const forkattn_tensor *t, const fa_dev_tensor *dev);
/* Device copy of a host array (always staged: plan arrays). */
void *fa_stage_array(fa_stage *s, const void *host, size_t bytes);
/* Device copies of n host arrays in one device block and one copy: dev[i]
 * receives array i's copy (16-byte aligned). Up to FA_STAGE_CARRY_MAX bytes,
 * when the launch queue has room (gpu_launch_copy.h; else the copy is made at
 * once), the copy rides on the call's next kernel launch from a packed host
 * copy the stage holds: the device arrays are in place only once
 * a kernel of the call has been launched, and only kernels may read them;
 * the host arrays may change or be freed as soon as this returns. 0 or -1. */
int fa_stage_arrays(fa_stage *s, int n, const void *const *host, const size_t *bytes, void **dev);
/* fa_stage_arrays in two steps, for an array that holds the others' device addresses (a call's
 * arguments): fa_stage_reserve gives the n arrays' device addresses (one block, 16-byte aligned),
 * fa_stage_upload copies the host arrays there as fa_stage_arrays would. 0 or -1 each. */
int fa_stage_reserve(fa_stage *s, int n, const size_t *bytes, void **dev);
int fa_stage_upload(fa_stage *s, int n, const void *const *host, const size_t *bytes, void *const *dev);
/* Device view of a float array of the caller's memory (lse); copy uploads. */
float *fa_stage_floats(fa_stage *s, float *p, size_t n, int copy);
int fa_stage_floats_back(fa_stage *s, float *host, const float *dev, size_t n);
/* Scratch device memory owned by the stage (from the context's pool). */
void *fa_stage_scratch(fa_stage *s, size_t bytes);
/* Give the stage's device memory back to the context's pool. */
void fa_stage_free(fa_stage *s);
/* Device copy of a kept-set mask: its maps staged, *dev holding device
 * pointers (pass it to a kernel by value). host NULL gives an empty mask.
 * 0 or -1. (gpu_segment_fwd.c) */
int fa_gpu_stage_kept(fa_stage *s, const fa_kept *host, fa_kept *dev);
/* Status for a failed staging step: DEVICE when a copy failed, else OUT_OF_MEMORY. */
forkattn_status fa_stage_status(const fa_stage *s);

#endif
