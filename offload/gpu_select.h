/* Which GPU kernel runs each pass of a call.
 *
 * One pure function of the device (sm_90a build, team memory, SMs), the
 * context's knobs and the call's shape decides, so that the whole decision
 * table lives here and is unit-tested on the host (tests/test_gpu_select.c).
 * A GPU context reads its knobs (options, then the environment) and the
 * device once, at creation (gpu_select_ctx.c); its calls only look them up.
 *
 * The families, fastest first:
 *  - FA_KERNEL_WG_PAIR: wgmma (sm_90a), two warpgroups a team sharing tiles that
 *    arrive by bulk tensor copies (TMA): the forward and dQ (128 query rows
 *    a team, 128-key tiles; persistent teams on large launches) and the
 *    dK/dV at head_dim 128 (query-major, 128-key blocks);
 *  - FA_KERNEL_WG_KEY_MAJOR: the wgmma dK/dV at head_dim 64, one warpgroup,
 *    key-major (64 keys as the products' rows), Q and dO by bulk copies;
 *  - FA_KERNEL_MMA: mma.sync tensor-core kernels (any offload target), also
 *    every StreamKL tensor-core pass, and the forward and StreamKL forward
 *    of f32 inputs split into bf16 pieces (the context's f32 precision HIGH
 *    or MEDIUM, lib/core/split_bf16.h);
 *  - FA_KERNEL_FP32: CUDA-core kernels for everything else (f32 at HIGHEST
 *    precision and f32 backward passes, other head_dims, kept sets, rows not
 *    16-byte aligned).
 * A wgmma kernel runs when the build has wgmma, its team memory fits the
 * device and the driver encodes its tensor maps; otherwise mma.sync. */
#ifndef FORKATTN_GPU_SELECT_H
#define FORKATTN_GPU_SELECT_H
#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

typedef enum fa_gpu_kernel { FA_KERNEL_FP32, FA_KERNEL_MMA, FA_KERNEL_WG_PAIR, FA_KERNEL_WG_KEY_MAJOR } fa_gpu_kernel;

typedef enum fa_gpu_pass {
  FA_PASS_FWD,    /* attention forward */
  FA_PASS_DQ,     /* attention backward, dQ */
  FA_PASS_DKV,    /* attention backward, dK and dV */
  FA_PASS_KL_FWD, /* StreamKL forward */
  FA_PASS_KL_BWD, /* StreamKL backward (dQ and dK of both sides) */
  FA_PASSES
} fa_gpu_pass;

/* What the device and the build offer, found once at context creation. */
typedef struct fa_gpu_caps {
  int wgmma;          /* the device image has the wgmma kernels (an sm_90a build) */
  size_t team_memory; /* bytes of team memory a launch may ask for (gpu_team_memory.h) */
  int sms;            /* multiprocessors (0: unknown) */
  /* team memory the wgmma kernel of a pass needs at head_dim 64 ([0]) and 128 ([1]); 0: none */
  size_t wg_smem[FA_PASSES][2];
  /* team memory the mma.sync kernel of a pass needs for split f32 inputs at head_dim 64 ([0]) and 128
   * ([1]) at HIGH precision (MEDIUM needs less); 0: the pass has none */
  size_t split_smem[FA_PASSES][2];
} fa_gpu_caps;

/* The context's knobs (forkattn_ctx_options, overridden by the environment). */
typedef struct fa_gpu_knobs {
  int kernels; /* forkattn_gpu_kernels: the fastest family allowed */
  int persist; /* -1 auto; 0 a team an item; 1 persistent, one team an SM; n > 1 persistent, at most n teams */
  int trace;   /* FORKATTN_GPU_TRACE=1: each call prints its phases' times */
  int f32;     /* forkattn_f32_precision of f32 inputs */
  int direct;  /* routed launches may go straight to the driver (gpu_launch_direct.h); FORKATTN_GPU_DIRECT_LAUNCH=0: not */
} fa_gpu_knobs;

/* One call's shape, as the kernels' requirements see it. */
typedef struct fa_gpu_call {
  int half;          /* every input bf16, or every input f16 */
  int f32;           /* every input f32 */
  int64_t d;         /* head_dim (StreamKL: the teacher's; see same_d) */
  int kept;          /* a kept-set mask restricts the keys */
  int rows16;        /* device tensors' rows 16-byte aligned, outputs included; plan positions fit 32 bits */
  int same_d;        /* StreamKL: teacher and student share head_dim (1 for attention) */
  int same_kv_heads; /* StreamKL backward: teacher and student share KV heads (1 otherwise) */
  int tma;           /* the pass's tensor maps encode (1 until the driver refused them) */
} fa_gpu_call;

/* A GPU context's choice, fixed at creation (forkattn_ctx.gpu; its summary line is the
 * context's `kernels`, from fa_gpu_select_describe). */
typedef struct fa_gpu_choice {
  fa_gpu_caps caps;
  fa_gpu_knobs knobs;
} fa_gpu_choice;

/* The kernel family of `pass` for `call`. */
fa_gpu_kernel fa_gpu_select(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, fa_gpu_pass pass,
                            const fa_gpu_call *call);

/* The bf16 pieces (lib/core/split_bf16.h) the f32 inputs of `call` are split into for kernel k of `pass`:
 * the score inputs (q and k; StreamKL's four) in *qk, v (and the backward's dout) in *v; 3 each at HIGH
 * precision, 2 each at MEDIUM (StreamKL: v 0), 0 and 0 when they stay as they are (bf16/f16 inputs,
 * HIGHEST, or the FP32 kernels). */
void fa_gpu_select_pieces(const fa_gpu_knobs *knobs, fa_gpu_pass pass, fa_gpu_kernel k, const fa_gpu_call *call,
                          int *qk, int *v);

/* 1 when kernel k of a pass loads tiles by bulk tensor copies (the caller encodes the maps and,
 * if the driver refuses them, selects again with call->tma = 0). */
int fa_gpu_select_needs_tma(fa_gpu_kernel k);

/* Teams of the launch of nteams items (query block x head) seeing item_keys keys each (mean), of
 * `pass` on kernel k: 0 for a team an item, else persistent teams (only the two-warpgroup forward
 * and dQ; gpu_persist.h). */
int fa_gpu_select_grid(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, fa_gpu_pass pass, fa_gpu_kernel k,
                       int64_t nteams, int64_t item_keys);

/* A short name of kernel k of `pass`, for logs and `forkattn info`. */
/* Why a two-warpgroup forward or dQ launch of nteams items seeing item_keys keys each (mean) runs
 * `grid` persistent teams (fa_gpu_select_grid's answer) or a team an item, in words, for a verbose
 * context's log. */
void fa_gpu_grid_reason(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, int64_t nteams, int64_t item_keys,
                        int grid, char *buf, size_t len);
const char *fa_gpu_kernel_name(fa_gpu_pass pass, fa_gpu_kernel k);

/* One line naming each pass's kernel for bf16/f16 calls at head_dim 64 and 128 with aligned rows. */
void fa_gpu_select_describe(const fa_gpu_caps *caps, const fa_gpu_knobs *knobs, char *buf, size_t len);

/* The knobs of options o (NULL: defaults), overridden by FORKATTN_GPU_KERNELS=auto|mma|fp32,
 * FORKATTN_GPU_PERSIST=auto|0|1|n, FORKATTN_F32_PRECISION=high|highest|medium, FORKATTN_GPU_TRACE=1 and FORKATTN_GPU_DIRECT_LAUNCH=0|1. 0, or -1 with a message in err
 * (a value out of range or unknown). */
int fa_gpu_knobs_read(const forkattn_ctx_options *o, fa_gpu_knobs *k, char *err, size_t len);

#endif
