/* The GPU backend's table (backend.h). */
#include "gpu_backend.h"

#include "gpu_pool.h"
#include "gpu_select_ctx.h"
#include "gpu_stream.h"

/* Waits that cannot be ordered on the stream (copies, frees, synchronous kernels). */
static forkattn_status fa_gpu_stream_wait_call(forkattn_ctx *ctx, const char *what) {
  return fa_gpu_stream_enter(ctx, 0, what);
}

static void fa_gpu_ctx_teardown(forkattn_ctx *ctx) {
  fa_gpu_pool_destroy(ctx);
  fa_gpu_choice_free(ctx);
}

static int fa_gpu_stream_wait_quiet(const forkattn_ctx *ctx) { return fa_gpu_stream_wait(ctx); }

const fa_backend fa_gpu_backend = {
    .kind = FORKATTN_BACKEND_GPU,
    .probe = fa_gpu_probe,
    .attn_fwd = fa_gpu_attn_fwd,
    .attn_bwd = fa_gpu_attn_bwd,
    .kl_fwd = fa_gpu_kl_fwd,
    .kl_bwd = fa_gpu_kl_bwd,
    .kv_similarity = fa_gpu_kv_similarity,
    .mem_alloc = fa_gpu_malloc,
    .mem_free = fa_gpu_free,
    .mem_copy = fa_gpu_memcpy,
    .stream_check = fa_gpu_stream_check,
    .stream_wait = fa_gpu_stream_wait_call,
    .stream_wait_quiet = fa_gpu_stream_wait_quiet,
    .ctx_init = fa_gpu_choice_init,
    .ctx_teardown = fa_gpu_ctx_teardown,
};
