/* KV-cache compression policies (forkattn_kv_select): StreamingLLM keeps
 * sinks + recent keys; H2O and SnapKV rank keys by accumulated causal
 * attention mass (the CPU backend's kv_scores streams it, no L x L buffer)
 * and keep the top ones with a recent window.
 *
 * The work is CPU work on any backend. With FORKATTN_MEMORY_DEVICE (GPU
 * backend) q and k are first copied whole to host buffers (forkattn_memcpy of
 * each tensor's span, strides kept), and that copy counts as workspace.
 * Only the policy fields a kind uses are validated (StreamingLLM: sinks;
 * H2O: window, scale; SnapKV: window, pool_kernel, scale). Ranking: score
 * descending, then key index ascending (ties go to the earlier key); a NaN
 * score (non-finite inputs) ranks as -inf. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "backend.h"
#include "segment_attn.h"
#include "struct_size.h"
#include "validate.h"

static int64_t fa_kv_min(int64_t a, int64_t b) { return a < b ? a : b; }

void forkattn_kv_policy_init(forkattn_kv_policy *policy, forkattn_kv_policy_kind kind, int64_t budget) {
  if (!policy) return;
  const int64_t cap = budget > 0 ? budget : 0;
  memset(policy, 0, sizeof *policy);
  policy->struct_size = sizeof *policy;
  policy->kind = kind;
  policy->budget = budget;
  policy->sinks = fa_kv_min(4, cap);
  policy->window = kind == FORKATTN_KV_H2O ? cap / 2 : (kind == FORKATTN_KV_SNAPKV ? fa_kv_min(32, cap) : 0);
  policy->pool_kernel = cap >= 5 ? 5 : (cap >= 3 ? 3 : 1); /* clamped to the budget, kept odd */
  policy->scale = 0.0f;
}

static forkattn_status fa_kv_check_policy(forkattn_ctx *ctx, const forkattn_kv_policy *p) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!p) return fa_fail(ctx, bad, "policy: is NULL");
  forkattn_status st = FA_CHECK_STRUCT_SIZE(ctx, "policy", p, "forkattn_kv_policy");
  if (st) return st;
  if (p->kind != FORKATTN_KV_STREAMING_LLM && p->kind != FORKATTN_KV_H2O && p->kind != FORKATTN_KV_SNAPKV)
    return fa_fail(ctx, bad, "policy: unknown kind %d (STREAMING_LLM, H2O or SNAPKV)", (int)p->kind);
  if (p->budget < 1) return fa_fail(ctx, bad, "policy: budget %lld must be >= 1", (long long)p->budget);
  if (p->kind == FORKATTN_KV_STREAMING_LLM) {
    if (p->sinks < 0 || p->sinks > p->budget)
      return fa_fail(ctx, bad, "policy: sinks %lld outside [0, budget %lld]", (long long)p->sinks,
                     (long long)p->budget);
    return FORKATTN_OK;
  }
  if (p->window < 0 || p->window > p->budget)
    return fa_fail(ctx, bad, "policy: window %lld outside [0, budget %lld]", (long long)p->window,
                   (long long)p->budget);
  if (p->kind == FORKATTN_KV_SNAPKV && (p->pool_kernel < 1 || p->pool_kernel % 2 == 0))
    return fa_fail(ctx, bad, "policy: pool_kernel %lld must be odd and >= 1", (long long)p->pool_kernel);
  if (!(isfinite(p->scale) && p->scale >= 0.0f))
    return fa_fail(ctx, bad, "policy: scale %g must be finite and >= 0 (0 = 1/sqrt(head_dim))", (double)p->scale);
  return FORKATTN_OK;
}

/* q [L, Hq, d] and k [L, Hkv, d]: one dtype, Hq % Hkv == 0, 1 <= d <= 256. */
static forkattn_status fa_kv_check_qk(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k) {
  int64_t hq, hkv, d;
  return fa_check_qk(ctx, "q", "k", q, k, q ? q->rows : 0, q ? q->rows : 0, &hq, &hkv, &d);
}

/* Host copy of a device tensor (its whole span, same strides). */
static forkattn_status fa_kv_stage(forkattn_ctx *ctx, const char *name, const forkattn_tensor *t,
                                   forkattn_tensor *host, void **owned, size_t *bytes) {
  size_t n; /* the span fits int64 (t was validated), its bytes need not fit size_t */
  void *buf = __builtin_mul_overflow((size_t)fa_tensor_span(t), (size_t)(t->dtype == FORKATTN_DTYPE_F32 ? 4 : 2), &n)
                  ? NULL
                  : fa_malloc(n ? n : 1);
  if (!buf) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kv_select: cannot allocate %zu bytes to stage %s", n, name);
  forkattn_status st = forkattn_memcpy(ctx, buf, FORKATTN_MEMORY_HOST, t->data, FORKATTN_MEMORY_DEVICE, n);
  if (st) {
    fa_free(buf);
    return st;
  }
  *host = *t;
  host->data = buf;
  *owned = buf;
  *bytes += n;
  return FORKATTN_OK;
}

typedef struct {
  double s;
  int64_t j;
} fa_kv_rank;

static int fa_kv_rank_cmp(const void *a, const void *b) {
  const fa_kv_rank *x = a, *y = b;
  if (x->s != y->s) return x->s > y->s ? -1 : 1;
  return (x->j > y->j) - (x->j < y->j);
}

static int fa_kv_i64_cmp(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* out[0..keep) = the keep best of s[0..n), ascending. */
static void fa_kv_top(const double *s, int64_t n, int64_t keep, fa_kv_rank *rank, int64_t *out) {
  for (int64_t j = 0; j < n; j++) {
    rank[j].s = isnan(s[j]) ? -INFINITY : s[j];
    rank[j].j = j;
  }
  qsort(rank, (size_t)n, sizeof *rank, fa_kv_rank_cmp);
  for (int64_t t = 0; t < keep; t++) out[t] = rank[t].j;
  qsort(out, (size_t)keep, sizeof *out, fa_kv_i64_cmp);
}

typedef struct {
  double *score, *pooled, *prefix;
  fa_kv_rank *rank;
  void *q_host, *k_host;
} fa_kv_bufs;

static void fa_kv_bufs_free(fa_kv_bufs *b) {
  fa_free(b->score), fa_free(b->pooled), fa_free(b->prefix), fa_free(b->rank);
  fa_free(b->q_host), fa_free(b->k_host);
}

/* out[j] = sum of a[j'] over |j' - j| <= kernel / 2 and 0 <= j' < n (kernel
 * odd >= 1). scratch: n + 1 doubles (prefix sums for wide kernels). Windows
 * clamped to the same range give bitwise equal sums. */
static void fa_kv_pool(const double *a, int64_t n, int64_t kernel, double *out, double *scratch) {
  const int64_t r = kernel / 2;
  if (r <= 32) { /* narrow: direct sums */
    for (int64_t j = 0; j < n; j++) {
      const int64_t lo = j > r ? j - r : 0, hi = n - 1 - j > r ? j + r : n - 1;
      double s = 0.0;
      for (int64_t x = lo; x <= hi; x++) s += a[x];
      out[j] = s;
    }
    return;
  }
  scratch[0] = 0.0; /* wide: prefix sums, O(n) whatever the kernel */
  for (int64_t j = 0; j < n; j++) scratch[j + 1] = scratch[j] + a[j];
  for (int64_t j = 0; j < n; j++) {
    const int64_t lo = j > r ? j - r : 0, hi = n - 1 - j > r ? j + r : n - 1;
    out[j] = scratch[hi + 1] - scratch[lo];
  }
}

/* H2O / SnapKV with L > budget: per head, top budget - window of the keys
 * [0, L - window) by (pooled) score, then the window [L - window, L). */
static forkattn_status fa_kv_ranked(forkattn_ctx *ctx, const forkattn_kv_policy *p, const forkattn_tensor *q,
                                    const forkattn_tensor *k, int64_t *index, forkattn_memory memory) {
  const int64_t L = q->rows, hkv = k->heads, w = p->window, kend = L - w, keep = p->budget - w;
  const int snap = p->kind == FORKATTN_KV_SNAPKV;
  fa_kv_bufs b = {0};
  if (keep > 0) {
    const float scale = p->scale > 0.0f ? p->scale : 1.0f / sqrtf((float)q->head_dim);
    size_t bytes = sizeof(double) * (size_t)(hkv * kend) + sizeof(fa_kv_rank) * (size_t)kend;
    if (snap) bytes += sizeof(double) * (size_t)(2 * kend + 1);
    /* hkv x kend fits int64 (k was validated); the byte counts are checked */
    b.score = fa_malloc_array(hkv * kend, sizeof(double));
    b.rank = fa_malloc_array(kend, sizeof(fa_kv_rank));
    if (snap) {
      b.pooled = fa_malloc_array(kend, sizeof(double));
      b.prefix = fa_malloc_array(kend + 1, sizeof(double));
    }
    if (!b.score || !b.rank || (snap && (!b.pooled || !b.prefix))) {
      fa_kv_bufs_free(&b);
      return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kv_select: cannot allocate %zu bytes of scores", bytes);
    }
    forkattn_tensor qh = *q, kh = *k;
    forkattn_status st = FORKATTN_OK;
    if (memory == FORKATTN_MEMORY_DEVICE) {
      st = fa_kv_stage(ctx, "q", q, &qh, &b.q_host, &bytes);
      if (!st) st = fa_kv_stage(ctx, "k", k, &kh, &b.k_host, &bytes);
    }
    if (!st)
      st = fa_backend_get(FORKATTN_BACKEND_CPU)->kv_scores(ctx, &qh, &kh, scale, snap ? L - w : 0, kend, b.score,
                                                             bytes);
    if (st) {
      fa_kv_bufs_free(&b);
      return st;
    }
  }
  for (int64_t g = 0; g < hkv; g++) {
    int64_t *out = index + g * p->budget;
    if (keep > 0) {
      const double *s = b.score + g * kend;
      if (snap) {
        fa_kv_pool(s, kend, p->pool_kernel, b.pooled, b.prefix);
        s = b.pooled;
      }
      fa_kv_top(s, kend, keep, b.rank, out);
    }
    for (int64_t t = 0; t < w; t++) out[keep + t] = kend + t;
  }
  fa_kv_bufs_free(&b);
  return FORKATTN_OK;
}

forkattn_status forkattn_kv_select(forkattn_ctx *ctx, const forkattn_kv_policy *policy,
                                   const forkattn_tensor *q, const forkattn_tensor *k, int64_t *offsets,
                                   int64_t *index, forkattn_memory memory) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  forkattn_status st;
  if ((st = fa_kv_check_policy(ctx, policy))) return st;
  if ((st = fa_check_memory(ctx, memory))) return st;
  if ((st = fa_kv_check_qk(ctx, q, k))) return st;
  const int64_t L = q->rows, hkv = k->heads, n = fa_kv_min(policy->budget, L);
  if (!offsets) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "offsets: is NULL (needs %lld entries)",
                               (long long)(hkv + 1));
  if (!index && n > 0)
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "index: is NULL (needs %lld entries)", (long long)(hkv * n));
  if ((st = fa_check_aligned(ctx, "offsets", offsets, sizeof *offsets)) ||
      (st = fa_check_aligned(ctx, "index", index, sizeof *index)))
    return st;

  if (L <= policy->budget) { /* everything fits */
    for (int64_t g = 0; g < hkv; g++)
      for (int64_t t = 0; t < L; t++) index[g * L + t] = t;
  } else if (policy->kind == FORKATTN_KV_STREAMING_LLM) {
    const int64_t sinks = policy->sinks, recent = policy->budget - sinks;
    for (int64_t g = 0; g < hkv; g++) {
      int64_t *out = index + g * n;
      for (int64_t t = 0; t < sinks; t++) out[t] = t;
      for (int64_t t = 0; t < recent; t++) out[sinks + t] = L - recent + t;
    }
  } else if ((st = fa_kv_ranked(ctx, policy, q, k, index, memory))) {
    return st;
  }
  for (int64_t g = 0; g <= hkv; g++) offsets[g] = g * n;
  return FORKATTN_OK;
}
