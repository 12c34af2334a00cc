/* Segment attention on the context's backend (backend.h), after the checks
 * every attention entry shares. */
#include "backend.h"
#include "validate.h"

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
  return ctx->ops->attn_fwd(ctx, a, memory);
}

forkattn_status fa_attn_bwd_run(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory) {
  forkattn_status st = fa_check_memory(ctx, memory);
  if (st || (st = fa_check_aligned(ctx, "lse", a->lse, sizeof *a->lse))) return st;
  return ctx->ops->attn_bwd(ctx, a, memory);
}
