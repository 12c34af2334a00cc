/* CPU backward of segment attention (FlashAttention-2 style, deterministic).
 *
 * P is recomputed from the saved lse; D = rowsum(dO * O) is computed once.
 * Pass 1 owns query blocks and writes dQ = scale * dS K.
 * Pass 2 owns key blocks and visits every (pair, query block) that reads them,
 * so a shared prompt's dK/dV is summed over all responses by one thread, in a
 * fixed order: no atomics, bitwise reproducible for a given thread count and
 * independent of it. */
#include "alloc.h"
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "cpu_tile.h"
#include "cpu_team.h"
#include "online_softmax.h"
#include "rowsum_exact.h"
#include "cpu_backend.h"

typedef struct {
  float *q, *dout, *lse, *dd, *s, *dp, *acc, *acc2, *kbuf, *vbuf;
} fa_bwd_tiles;

/* Stack query rows [q0, q0+qn) of every head of group g: scaled Q, dO, lse, D. */
static void fa_bwd_load_queries(const fa_attn_bwd *a, const float *dsum, int64_t g, int64_t q0,
                                int64_t qn, fa_bwd_tiles *t) {
  const int64_t group = a->hq / a->hkv, d = a->d;
  for (int64_t hh = 0; hh < group; hh++) {
    const int64_t h = g * group + hh;
    fa_cpu_gather(&a->q, q0, qn, h, a->scale, t->q + hh * qn * d, d);
    fa_cpu_gather(&a->dout, q0, qn, h, 1.0f, t->dout + hh * qn * d, d);
    for (int64_t r = 0; r < qn; r++) {
      t->lse[hh * qn + r] = a->lse[(q0 + r) * a->hq + h];
      t->dd[hh * qn + r] = dsum[(q0 + r) * a->hq + h];
    }
  }
}

/* With S = Q K^T in t->s (M x nk): P in t->s and dS = P * (dO V^T - D) in t->dp,
 * exactly 0 wherever P is 0 (masked keys included, even when dO V^T is not
 * finite there). Returns non-zero when the tile crosses the causal diagonal. */
static int fa_bwd_probs(const fa_pair *pr, const fa_plan *p, const fa_kept *kept, int64_t g, int64_t group,
                        int64_t q0, int64_t qn, int64_t kb, int64_t nk, const float *V, int64_t ldv, int64_t d,
                        fa_bwd_tiles *t) {
  const int64_t M = group * qn;
  const int64_t q_pos0 = q0 + p->qshift;
  const int crossing = pr->causal && kb + nk - 1 > q_pos0;
  if (crossing) fa_cpu_mask_causal(t->s, nk, group, qn, q_pos0, nk, kb);
  if (kept) fa_cpu_mask_kept(t->s, nk, kept, g, group, qn, q0, nk, kb);
  for (int64_t i = 0; i < M; i++) {
    float *srow = t->s + i * nk;
    if (t->lse[i] == -INFINITY)
      memset(srow, 0, sizeof(float) * (size_t)nk);
    else
      fa_cpu_exp_sub(srow, nk, t->lse[i]);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)nk, (int)d, 1.0f, t->dout,
              (int)d, V, (int)ldv, 0.0f, t->dp, (int)nk);
  for (int64_t i = 0; i < M; i++) {
    const float *prow = t->s + i * nk;
    float *row = t->dp + i * nk, di = t->dd[i];
#pragma omp simd
    for (int64_t j = 0; j < nk; j++) row[j] = prow[j] == 0.0f ? 0.0f : prow[j] * (row[j] - di);
  }
  return crossing;
}

/* Pass 1: dQ of one query block. */
static void fa_bwd_dq_block(const fa_attn_bwd *a, const float *dsum, const fa_block *b, int64_t g,
                            fa_bwd_tiles *t) {
  const fa_plan *p = a->plan;
  const int64_t group = a->hq / a->hkv, d = a->d, qn = b->len, M = group * qn;
  fa_bwd_load_queries(a, dsum, g, b->start, qn, t);
  memset(t->acc, 0, sizeof(float) * (size_t)(M * d));
  for (int64_t pi = p->q_pair_off[b->seg]; pi < p->q_pair_off[b->seg + 1]; pi++) {
    const fa_pair *pr = &p->pair[pi];
    const fa_range keys = fa_pair_keys(p->seg, *pr, b->start, qn, p->qshift);
    const int64_t k0 = keys.start, kn = keys.len;
    for (int64_t kb = k0; kb < k0 + kn; kb += FA_CPU_KEY_BLOCK) {
      const int64_t nk = k0 + kn - kb < FA_CPU_KEY_BLOCK ? k0 + kn - kb : FA_CPU_KEY_BLOCK;
      if (fa_kept_tile_dropped(a->kept, g * group, (g + 1) * group, b->start, qn, kb, nk)) continue;
      int64_t ldk, ldv;
      const float *K = fa_cpu_rows_view(&a->k, kb, nk, g, t->kbuf, &ldk);
      const float *V = fa_cpu_rows_view(&a->v, kb, nk, g, t->vbuf, &ldv);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)nk, (int)d, 1.0f, t->q,
                  (int)d, K, (int)ldk, 0.0f, t->s, (int)nk);
      const int crossing = fa_bwd_probs(pr, p, a->kept, g, group, b->start, qn, kb, nk, V, ldv, d, t);
      if (a->kept)
        fa_cpu_sparse_ab(t->dp, nk, M, nk, K, ldk, d, a->scale, t->acc, d);
      else if (crossing && !fa_cpu_all_finite(K, nk, d, ldk))
        fa_cpu_causal_ab(t->dp, nk, K, ldk, t->acc, d, group, qn, b->start + p->qshift, nk, kb, d,
                         a->scale);
      else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)d, (int)nk, a->scale,
                    t->dp, (int)nk, K, (int)ldk, 1.0f, t->acc, (int)d);
    }
  }
  for (int64_t hh = 0; hh < group; hh++)
    fa_cpu_scatter(&a->dq, b->start, qn, g * group + hh, t->acc + hh * qn * d, d);
}

/* Pass 2: dK and dV of one key block, summed over every reader. */
static void fa_bwd_dkv_block(const fa_attn_bwd *a, const float *dsum, const fa_block *b, int64_t g,
                             int64_t bq, fa_bwd_tiles *t) {
  const fa_plan *p = a->plan;
  const int64_t group = a->hq / a->hkv, d = a->d, nk = b->len;
  int64_t ldk, ldv;
  const float *K = fa_cpu_rows_view(&a->k, b->start, nk, g, t->kbuf, &ldk);
  const float *V = fa_cpu_rows_view(&a->v, b->start, nk, g, t->vbuf, &ldv);
  float *dk = t->acc, *dv = t->acc2;
  memset(dk, 0, sizeof(float) * (size_t)(nk * d));
  memset(dv, 0, sizeof(float) * (size_t)(nk * d));
  for (int64_t j = p->k_pair_off[b->seg]; j < p->k_pair_off[b->seg + 1]; j++) {
    const fa_pair *pr = &p->pair[p->k_pair_idx[j]];
    const fa_range queries = fa_pair_queries(p->seg, *pr, b->start, p->qshift);
    const int64_t q0 = queries.start, qn = queries.len;
    for (int64_t qb = q0; qb < q0 + qn; qb += bq) {
      const int64_t nq = q0 + qn - qb < bq ? q0 + qn - qb : bq, M = group * nq;
      if (fa_kept_tile_dropped(a->kept, g * group, (g + 1) * group, qb, nq, b->start, nk)) continue;
      fa_bwd_load_queries(a, dsum, g, qb, nq, t);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)nk, (int)d, 1.0f, t->q,
                  (int)d, K, (int)ldk, 0.0f, t->s, (int)nk);
      const int crossing = fa_bwd_probs(pr, p, a->kept, g, group, qb, nq, b->start, nk, V, ldv, d, t);
      if (a->kept) { /* P and dS are exactly 0 on dropped keys */
        fa_cpu_sparse_atb(t->s, nk, M, nk, t->dout, d, d, dv, d);
        fa_cpu_sparse_atb(t->dp, nk, M, nk, t->q, d, d, dk, d);
        continue;
      }
      if (crossing && !(fa_cpu_all_finite(t->dout, M, d, d) && fa_cpu_all_finite(t->q, M, d, d))) {
        const int64_t q_pos0 = qb + p->qshift;
        fa_cpu_causal_atb(t->s, nk, t->dout, d, dv, d, group, nq, q_pos0, nk, b->start, d);
        fa_cpu_causal_atb(t->dp, nk, t->q, d, dk, d, group, nq, q_pos0, nk, b->start, d);
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nk, (int)d, (int)M, 1.0f, t->s,
                  (int)nk, t->dout, (int)d, 1.0f, dv, (int)d);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nk, (int)d, (int)M, 1.0f, t->dp,
                  (int)nk, t->q, (int)d, 1.0f, dk, (int)d);
    }
  }
  fa_cpu_scatter(&a->dk, b->start, nk, g, dk, d);
  fa_cpu_scatter(&a->dv, b->start, nk, g, dv, d);
}

static float fa_dot(const float *x, const float *y, int64_t d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < d; c++) s += x[c] * y[c];
  return s;
}

/* D[r, h] = sum_c dO[r, h, c] * O[r, h, c]. */
static void fa_bwd_rowsum(const fa_attn_bwd *a, float *dsum, float *buf) {
  const int64_t d = a->d, rows = a->plan->rows;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < a->hq; h++) {
      fa_cpu_gather(&a->o, r, 1, h, 1.0f, buf, d);
      fa_cpu_gather(&a->dout, r, 1, h, 1.0f, buf + d, d);
      dsum[r * a->hq + h] = fa_dot(buf, buf + d, d);
    }
}

/* D of a query block's rows from the inputs, sum_j exp(s_j - lse) (dO . v_j) over each
 * row's visible keys (lib/core/rowsum_exact.h says when and why); buf holds 3 d floats. */
static void fa_bwd_rowsum_exact(const fa_attn_bwd *a, float *dsum, const fa_block *b, float *buf) {
  const fa_plan *p = a->plan;
  const int64_t d = a->d, group = a->hq / a->hkv;
  float *q = buf, *dout = buf + d, *kv = buf + 2 * d;
  for (int64_t r = b->start; r < b->start + b->len; r++)
    for (int64_t h = 0; h < a->hq; h++) {
      const float lse = a->lse[r * a->hq + h];
      double sum = 0.0;
      fa_cpu_gather(&a->q, r, 1, h, a->scale, q, d);
      fa_cpu_gather(&a->dout, r, 1, h, 1.0f, dout, d);
      for (int64_t pi = p->q_pair_off[b->seg]; pi < p->q_pair_off[b->seg + 1] && lse != -INFINITY; pi++) {
        const fa_range keys = fa_pair_keys(p->seg, p->pair[pi], r, 1, p->qshift);
        for (int64_t j = keys.start; j < keys.start + keys.len; j++) {
          fa_cpu_gather(&a->k, j, 1, h / group, 1.0f, kv, d);
          const float s = fa_dot(q, kv, d);
          fa_cpu_gather(&a->v, j, 1, h / group, 1.0f, kv, d);
          sum += (double)expf(s - lse) * fa_dot(dout, kv, d);
        }
      }
      dsum[r * a->hq + h] = (float)sum;
    }
}

typedef struct {
  const fa_attn_bwd *a;
  float *dsum;
  const fa_block *qblocks, *kblocks;
  int64_t nq, nk, M, bq, bk, acc_rows;
} fa_bwd_job;

static void fa_bwd_team(fa_cpu_ws *ws, void *arg) {
  const fa_bwd_job *j = arg;
  const fa_attn_bwd *a = j->a;
  const int64_t M = j->M, bk = j->bk, d = a->d, hkv = a->hkv;
  fa_bwd_tiles t = {fa_cpu_ws_take(ws, M * d),           fa_cpu_ws_take(ws, M * d),
                    fa_cpu_ws_take(ws, M),               fa_cpu_ws_take(ws, M),
                    fa_cpu_ws_take(ws, M * bk),          fa_cpu_ws_take(ws, M * bk),
                    fa_cpu_ws_take(ws, j->acc_rows * d), fa_cpu_ws_take(ws, j->acc_rows * d),
                    fa_cpu_ws_take(ws, bk * d),          fa_cpu_ws_take(ws, bk * d)};
  fa_bwd_rowsum(a, j->dsum, t.s); /* implicit barrier: D complete before use */
  if (a->o.dtype != FORKATTN_DTYPE_F32 && !a->kept) {
    const fa_plan *p = a->plan;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < j->nq; w++) {
      const fa_block *b = &j->qblocks[w];
      if (fa_block_key_count(p->seg, p->pair, p->q_pair_off[b->seg], p->q_pair_off[b->seg + 1], b->start, b->len,
                             p->qshift) <= FA_EXACT_D_KEYS)
        fa_bwd_rowsum_exact(a, j->dsum, b, t.s);
    }
  }
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t w = 0; w < j->nq * hkv; w++) fa_bwd_dq_block(a, j->dsum, &j->qblocks[w / hkv], w % hkv, &t);
#pragma omp for schedule(dynamic, 1)
  for (int64_t w = 0; w < j->nk * hkv; w++)
    fa_bwd_dkv_block(a, j->dsum, &j->kblocks[w / hkv], w % hkv, j->bq, &t);
}

forkattn_status fa_cpu_attn_bwd(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory) {
  (void)memory; /* host */
  const int64_t group = a->hq / a->hkv, d = a->d, bq = fa_cpu_query_block(group);
  const int64_t bk = FA_CPU_KEY_BLOCK;
  int64_t M; /* an absurd GQA group saturates M: the scratch size below refuses it */
  if (__builtin_mul_overflow(group, bq, &M)) M = INT64_MAX;
  const fa_block *qblocks = NULL, *kblocks = NULL;
  /* rows x hq fits int64 (q was validated), the bytes need not fit size_t */
  const size_t dsum_bytes = sizeof(float) * (size_t)(a->plan->rows * a->hq);
  float *dsum = fa_malloc_array(a->plan->rows * a->hq, sizeof(float));
  int64_t nq = fa_plan_blocks_memo(a->plan, bq, 0, &qblocks);
  int64_t nk = fa_plan_blocks_memo(a->plan, bk, 1, &kblocks);
  int rc = -1;
  if (dsum && nq >= 0 && nk >= 0) {
    const int64_t acc_rows = M > bk ? M : bk;
    fa_bwd_job job = {a, dsum, qblocks, kblocks, nq, nk, M, bq, bk, acc_rows};
    const double Md = (double)M, acc = (double)acc_rows;
    const int64_t ws_floats = fa_cpu_ws_floats(2 * Md * (double)d + 2 * Md + 2 * Md * (double)bk +
                                               2 * acc * (double)d + 2.0 * (double)(bk * d) + 10 * 16);
    rc = fa_cpu_team_run(ctx, ws_floats, dsum_bytes + sizeof(fa_block) * (size_t)(nq + nk), fa_bwd_team, &job);
  }
  fa_free(dsum);
  if (rc) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "prefix_bwd: cannot allocate workspace");
  return FORKATTN_OK;
}
