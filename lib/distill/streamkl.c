/* StreamKL API: validate, resolve options, compile the layout to a segment
 * plan, build the kept mask, run it on the context's backend. Also the
 * rows-mean reduction helper. */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "backend.h"
#include "layout_attn.h"
#include "streamkl.h"
#include "struct_size.h"
#include "validate.h"

void forkattn_kl_options_init(forkattn_kl_options *opt) {
  if (!opt) return;
  memset(opt, 0, sizeof *opt);
  opt->struct_size = sizeof *opt;
  opt->direction = FORKATTN_KL_FORWARD;
  opt->temperature = 1.0f;
}

static forkattn_status fa_kl_check_options(forkattn_ctx *ctx, const forkattn_kl_options *o) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_status st = FA_CHECK_STRUCT_SIZE(ctx, "opt", o, "forkattn_kl_options");
  if (st) return st;
  if (o->direction != FORKATTN_KL_FORWARD && o->direction != FORKATTN_KL_REVERSE)
    return fa_fail(ctx, bad, "opt: direction %d is neither forward nor reverse", (int)o->direction);
  if (!(isfinite(o->temperature) && o->temperature > 0.0f))
    return fa_fail(ctx, bad, "opt: temperature %g must be finite and > 0", (double)o->temperature);
  if (o->scale_by_tau2 && !isfinite(o->temperature * o->temperature))
    return fa_fail(ctx, bad, "opt: temperature %g squared overflows float (scale_by_tau2)", (double)o->temperature);
  if (!(isfinite(o->scale_teacher) && o->scale_teacher >= 0.0f))
    return fa_fail(ctx, bad, "opt: scale_teacher %g must be finite and >= 0 (0 = 1/sqrt(d))", (double)o->scale_teacher);
  if (!(isfinite(o->scale_student) && o->scale_student >= 0.0f))
    return fa_fail(ctx, bad, "opt: scale_student %g must be finite and >= 0 (0 = 1/sqrt(d))", (double)o->scale_student);
  return FORKATTN_OK;
}

/* q [T, H, d] and k [T, hkv, d] of one side (teacher or student); heads >= 0:
 * the query heads the teacher has. */
static forkattn_status fa_kl_check_side(forkattn_ctx *ctx, const char *qn, const char *kn, const forkattn_tensor *q,
                                        const forkattn_tensor *k, int64_t rows, int64_t heads, int64_t *hkv,
                                        int64_t *d) {
  if (q && heads >= 0 && q->heads != heads)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT,
                   "%s: %lld query heads, the teacher has %lld (distributions pair by query head)", qn,
                   (long long)q->heads, (long long)heads);
  int64_t hq;
  return fa_check_qk(ctx, qn, kn, q, k, rows, rows, &hq, hkv, d);
}

/* Everything both directions check; fills the call (plan excluded). */
static forkattn_status fa_kl_begin(forkattn_ctx *ctx, const forkattn_layout *layout, const forkattn_tensor *q_t,
                                   const forkattn_tensor *k_t, const forkattn_tensor *q_s,
                                   const forkattn_tensor *k_s, const forkattn_kl_options *opt,
                                   forkattn_memory memory, const fa_layout_ops **ops, const void **l,
                                   int64_t *rows, fa_kl_call *c) {
  forkattn_status st;
  forkattn_kl_options def;
  if (!opt) {
    forkattn_kl_options_init(&def);
    opt = &def;
  }
  memset(c, 0, sizeof *c);
  if ((st = fa_check_memory(ctx, memory)) || (st = fa_layout_pick(ctx, layout, ops, l)) ||
      (st = (*ops)->check(ctx, *l, rows)) || (st = fa_kl_check_options(ctx, opt)))
    return st;
  if ((st = fa_kl_check_side(ctx, "q_t", "k_t", q_t, k_t, *rows, -1, &c->hkv_t, &c->dt))) return st;
  c->h = q_t->heads;
  if ((st = fa_kl_check_side(ctx, "q_s", "k_s", q_s, k_s, *rows, c->h, &c->hkv_s, &c->ds))) return st;
  const float tau = opt->temperature;
  c->qt = *q_t;
  c->kt = *k_t;
  c->qs = *q_s;
  c->ks = *k_s;
  c->st = (opt->scale_teacher > 0.0f ? opt->scale_teacher : 1.0f / sqrtf((float)c->dt)) / tau;
  c->ss = (opt->scale_student > 0.0f ? opt->scale_student : 1.0f / sqrtf((float)c->ds)) / tau;
  c->loss_mul = opt->scale_by_tau2 ? tau * tau : 1.0f;
  c->reverse = opt->direction == FORKATTN_KL_REVERSE;
  return FORKATTN_OK;
}

/* Plan the layout and build the kept mask, run fn, release both. */
static forkattn_status fa_kl_run(forkattn_ctx *ctx, const fa_layout_ops *ops, const void *l,
                                 const forkattn_kept_set *kept, int64_t rows, fa_kl_call *c, int backward,
                                 forkattn_memory memory) {
  fa_kept km;
  unsigned char *owned = NULL;
  forkattn_status st = fa_kept_build(ctx, kept, rows, c->h, &km, &owned);
  if (st || rows == 0) return st;
  fa_plan own;
  if ((st = fa_layout_plan(ctx, ops, l, &own, &c->plan))) {
    fa_free(owned);
    return st;
  }
  c->kept = kept ? &km : NULL;
  st = (st = fa_ctx_wait_stream(ctx, backward ? "streamkl_bwd" : "streamkl_fwd")) ? st
       : backward ? ctx->ops->kl_bwd(ctx, c, memory)
                  : ctx->ops->kl_fwd(ctx, c, memory);
  fa_plan_free(&own);
  fa_free(owned);
  return st;
}

forkattn_status forkattn_kl_fwd(forkattn_ctx *ctx, const forkattn_layout *layout, const forkattn_tensor *q_t,
                                const forkattn_tensor *k_t, const forkattn_tensor *q_s, const forkattn_tensor *k_s,
                                const forkattn_kept_set *kept, const forkattn_kl_options *opt, float *kl,
                                float *stats, float *outside_mass, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const fa_layout_ops *ops = NULL;
  const void *l = NULL;
  int64_t rows;
  fa_kl_call c;
  forkattn_status st = fa_kl_begin(ctx, layout, q_t, k_t, q_s, k_s, opt, memory, &ops, &l, &rows, &c);
  if (st) return st;
  if (!kl && rows > 0) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "kl: is NULL");
  if ((st = fa_check_aligned(ctx, "kl", kl, sizeof *kl)) || (st = fa_check_aligned(ctx, "stats", stats, sizeof *stats)) ||
      (st = fa_check_aligned(ctx, "outside_mass", outside_mass, sizeof *outside_mass)))
    return st;
  c.kl = kl;
  c.stats = stats;
  c.outside = outside_mass;
  return fa_kl_run(ctx, ops, l, kept, rows, &c, 0, memory);
}

forkattn_status forkattn_kl_bwd(forkattn_ctx *ctx, const forkattn_layout *layout, const forkattn_tensor *q_t,
                                const forkattn_tensor *k_t, const forkattn_tensor *q_s, const forkattn_tensor *k_s,
                                const forkattn_kept_set *kept, const forkattn_kl_options *opt, const float *stats,
                                const float *dkl, const forkattn_tensor *dq_s, const forkattn_tensor *dk_s,
                                const forkattn_tensor *dq_t, const forkattn_tensor *dk_t, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  const fa_layout_ops *ops = NULL;
  const void *l = NULL;
  int64_t rows;
  fa_kl_call c;
  forkattn_status st = fa_kl_begin(ctx, layout, q_t, k_t, q_s, k_s, opt, memory, &ops, &l, &rows, &c);
  if (st) return st;
  if ((st = fa_check_tensor(ctx, "dq_s", dq_s, q_s->dtype, rows, c.h, c.ds)) ||
      (st = fa_check_tensor(ctx, "dk_s", dk_s, q_s->dtype, rows, c.hkv_s, c.ds)))
    return st;
  if (!dq_t != !dk_t) return fa_fail(ctx, bad, "dq_t/dk_t: pass both teacher gradients or neither");
  if (dq_t && ((st = fa_check_tensor(ctx, "dq_t", dq_t, q_t->dtype, rows, c.h, c.dt)) ||
               (st = fa_check_tensor(ctx, "dk_t", dk_t, q_t->dtype, rows, c.hkv_t, c.dt))))
    return st;
  if (!stats && rows > 0) return fa_fail(ctx, bad, "stats: is NULL (the forward's statistics are required)");
  if (!dkl && rows > 0) return fa_fail(ctx, bad, "dkl: is NULL");
  if ((st = fa_check_aligned(ctx, "stats", stats, sizeof *stats)) || (st = fa_check_aligned(ctx, "dkl", dkl, sizeof *dkl)))
    return st;
  c.stats_in = stats;
  c.dkl = dkl;
  c.dqs = *dq_s;
  c.dks = *dk_s;
  if (dq_t) {
    c.teacher_grad = 1;
    c.dqt = *dq_t;
    c.dkt = *dk_t;
  }
  return fa_kl_run(ctx, ops, l, kept, rows, &c, 1, memory);
}

forkattn_status forkattn_rows_mean(forkattn_ctx *ctx, const float *x, int64_t rows, int64_t heads,
                                   const float *weights, double *mean, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_status st = fa_check_memory(ctx, memory);
  if (st) return st;
  if (!mean) return fa_fail(ctx, bad, "mean: is NULL");
  if (rows < 0 || heads < 1)
    return fa_fail(ctx, bad, "rows/heads: need rows >= 0 and heads >= 1 (got %lld, %lld)", (long long)rows,
                   (long long)heads);
  int64_t n;
  if (__builtin_mul_overflow(rows, heads, &n)) return fa_fail(ctx, bad, "rows*heads overflows int64");
  if (!x && n > 0) return fa_fail(ctx, bad, "x: is NULL");
  if ((st = fa_check_aligned(ctx, "x", x, sizeof *x)) || (st = fa_check_aligned(ctx, "weights", weights, sizeof *weights)) ||
      (st = fa_check_aligned(ctx, "mean", mean, sizeof *mean)))
    return st;
  const float *hx = x, *hw = weights;
  float *buf = NULL;
  if (memory == FORKATTN_MEMORY_DEVICE && n > 0) { /* small: reduce on the host */
    int64_t total;
    const int64_t nw = weights ? rows : 0;
    buf = __builtin_add_overflow(n, nw, &total) ? NULL : fa_malloc_array(total, sizeof(float));
    if (!buf) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "rows_mean: cannot allocate a host copy");
    if ((st = forkattn_memcpy(ctx, buf, FORKATTN_MEMORY_HOST, x, memory, sizeof(float) * (size_t)n)) ||
        (weights && (st = forkattn_memcpy(ctx, buf + n, FORKATTN_MEMORY_HOST, weights, memory,
                                          sizeof(float) * (size_t)nw)))) {
      fa_free(buf);
      return st;
    }
    hx = buf;
    hw = weights ? buf + n : NULL;
  }
  double wsum = 0.0, sum = 0.0;
  for (int64_t i = 0; i < rows; i++) {
    const double w = hw ? hw[i] : 1.0;
    if (!(isfinite(w) && w >= 0.0)) {
      fa_free(buf);
      return fa_fail(ctx, bad, "weights: [%lld] = %g must be finite and >= 0", (long long)i, w);
    }
    if (w == 0.0) continue;
    double rs = 0.0;
    for (int64_t h = 0; h < heads; h++) rs += hx[i * heads + h];
    sum += w * rs;
    wsum += w;
  }
  fa_free(buf);
  *mean = wsum > 0.0 ? sum / (wsum * (double)heads) : 0.0;
  return FORKATTN_OK;
}
