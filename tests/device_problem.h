/*
 * device_problem.h - one GRPO-like bf16 problem in device memory for the GPU
 * tests that compare two ways of running the same calls (tests only).
 *
 * Two layouts share the inputs: A, a 1536-row prompt and 8 responses of 128
 * rows; B, a 1024-row prompt and 5 responses of mixed lengths (one empty).
 * 16 query and 4 KV heads, head_dim 128: the tensor-core kernels, several
 * items (query block x head) per SM. A problem holds q, k, v, dout of
 * fresh random values and DP_SETS output sets, poisoned (all-ones bytes,
 * NaN in bf16 and f32) so that an element left unwritten shows. A duo is
 * two GPU contexts with problems on the same inputs (the same seed), whose
 * outputs must agree bitwise: the kernels are deterministic.
 */
#ifndef FORKATTN_TESTS_DEVICE_PROBLEM_H
#define FORKATTN_TESTS_DEVICE_PROBLEM_H
#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

#define DP_HQ 16
#define DP_HKV 4
#define DP_D 128
#define DP_SETS 4

typedef struct dp_lay {
  int64_t off[9];
  forkattn_prefix_layout l;
  int64_t T;
} dp_lay;

typedef struct dp_outs {
  void *o, *lse, *dq, *dk, *dv;
} dp_outs;

typedef struct dp_problem {
  forkattn_ctx *ctx;
  int64_t T; /* rows allocated: the larger layout's */
  void *q, *k, *v, *dout;
  dp_outs set[DP_SETS], scratch;
} dp_problem;

/* The two layouts. */
void dp_make_lays(dp_lay *a, dp_lay *b);
/* Inputs of T rows drawn from the seed of `name`, outputs poisoned, all on ctx's device. */
void dp_problem_init(dp_problem *p, forkattn_ctx *ctx, int64_t T, const char *name);
void dp_problem_free(dp_problem *p);
/* forkattn_prefix_fwd / _bwd of layout L into output set s (device memory; asserts OK). */
void dp_fwd(dp_problem *p, const dp_lay *L, dp_outs *s);
void dp_bwd(dp_problem *p, const dp_lay *L, dp_outs *s);
/* 10 forwards of layout a into the scratch set: GPU work ahead of what follows. */
void dp_queue_prologue(dp_problem *p, const dp_lay *a);

/* Two GPU contexts on the same inputs: ps, the reference's; pq, the way under test. */
typedef struct dp_duo {
  forkattn_ctx *sync_ctx, *ctx;
  dp_lay a, b;
  dp_problem ps, pq;
} dp_duo;

/* Skips the test on a CPU context, or when FORKATTN_GPU_KERNELS=fp32 leaves no tensor-core call. */
void dp_duo_init(dp_duo *d, const char *name);
/* dp_duo_init with environment variable var (unless NULL) set to ref_value while the reference's
 * context is created and to value while the other's is (contexts read their GPU knobs then). */
void dp_duo_init_env(dp_duo *d, const char *name, const char *var, const char *ref_value, const char *value);
void dp_duo_free(dp_duo *d);
/* Output set i of layout L: the reference's every element written, the other's bitwise the same. */
void dp_assert_same(dp_duo *d, int i, const dp_lay *L, const char *what);

#endif
