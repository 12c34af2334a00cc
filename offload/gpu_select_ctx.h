/* A GPU context's kernel choice (gpu_select.h): read once at context
 * creation, looked up by every call. */
#ifndef FORKATTN_GPU_SELECT_CTX_H
#define FORKATTN_GPU_SELECT_CTX_H
#include "context_internal.h"
#include "gpu_select.h"

/* From forkattn_ctx_create, once the GPU backend is chosen (the probe found the device's team
 * memory and SMs): the knobs of o and the environment, the device's capabilities, the summary
 * (ctx->kernels). FORKATTN_OK, or FORKATTN_ERR_INVALID_ARGUMENT / _OUT_OF_MEMORY with a
 * message in err. */
forkattn_status fa_gpu_choice_init(forkattn_ctx *ctx, const forkattn_ctx_options *o, char *err, size_t len);

/* The kernel of `pass` for call c on ctx. */
/* Free what fa_gpu_choice_init allocated (also after it failed). */
void fa_gpu_choice_free(forkattn_ctx *ctx);

fa_gpu_kernel fa_gpu_choose(const forkattn_ctx *ctx, fa_gpu_pass pass, const fa_gpu_call *c);

/* k when it needs no tensor maps or they encoded (encoded != 0), else the kernel of `pass` for c
 * without maps (the driver refused them). */
fa_gpu_kernel fa_gpu_choose_mapped(const forkattn_ctx *ctx, fa_gpu_pass pass, const fa_gpu_call *c, fa_gpu_kernel k,
                                   int encoded);

/* Persistent teams of a launch of nteams items of `pass` on kernel k, the plan's query blocks
 * `blocks` [nblocks] (fa_gpu_select_grid; none while the call is captured into a CUDA graph). */
int fa_gpu_choose_grid(const forkattn_ctx *ctx, fa_gpu_pass pass, fa_gpu_kernel k, int64_t nteams, const fa_plan *p,
                       const fa_block *blocks, int64_t nblocks);

/* On a verbose context: "forkattn gpu <call>: <what>" on stderr, what printf-style. */
void fa_gpu_log_kernels(const forkattn_ctx *ctx, const char *call, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#endif
