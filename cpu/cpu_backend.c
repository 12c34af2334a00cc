/* The CPU backend's table (backend.h). */
#include "cpu_backend.h"

const fa_backend fa_cpu_backend = {
    .kind = FORKATTN_BACKEND_CPU,
    .attn_fwd = fa_cpu_attn_fwd,
    .attn_bwd = fa_cpu_attn_bwd,
    .kl_fwd = fa_cpu_kl_fwd,
    .kl_bwd = fa_cpu_kl_bwd,
    .kv_scores = fa_cpu_kv_scores,
    .kv_similarity = fa_cpu_kv_similarity,
};
