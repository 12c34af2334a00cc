/* Backend dispatch of segment attention: chosen once per context, applied here. */
#include "segment_attn.h"
#include "validate.h"
#ifdef FORKATTN_HAVE_OFFLOAD
#include "gpu_backend.h"
#endif

forkattn_status fa_check_memory(forkattn_ctx *ctx, forkattn_memory memory) {
  if (memory != FORKATTN_MEMORY_HOST && memory != FORKATTN_MEMORY_DEVICE)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "memory: unknown value %d", (int)memory);
  if (memory == FORKATTN_MEMORY_DEVICE && ctx->backend != FORKATTN_BACKEND_GPU)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT,
                   "memory: device pointers need the gpu backend, this context uses %s",
                   forkattn_backend_name(ctx->backend));
  return FORKATTN_OK;
}

forkattn_status fa_attn_fwd_run(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory) {
  /* lse here too: every attention entry (layouts, path stack, cached prefix) comes through */
  forkattn_status st = fa_check_memory(ctx, memory);
  if (st || (st = fa_check_aligned(ctx, "lse", a->lse, sizeof *a->lse))) return st;
#ifdef FORKATTN_HAVE_OFFLOAD
  if (ctx->backend == FORKATTN_BACKEND_GPU) return fa_gpu_attn_fwd(ctx, a, memory);
#endif
  return fa_cpu_attn_fwd(ctx, a);
}

forkattn_status fa_attn_bwd_run(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory) {
  forkattn_status st = fa_check_memory(ctx, memory);
  if (st || (st = fa_check_aligned(ctx, "lse", a->lse, sizeof *a->lse))) return st;
#ifdef FORKATTN_HAVE_OFFLOAD
  if (ctx->backend == FORKATTN_BACKEND_GPU) return fa_gpu_attn_bwd(ctx, a, memory);
#endif
  return fa_cpu_attn_bwd(ctx, a);
}
