/* Streaming attention-mass scores of the KV-cache policies
 * (fa_backend.kv_scores, contract in backend.h), on f32 tiles and OpenBLAS:
 * no rows x keys buffer.
 *
 * Work is tiled like the CPU forward (cpu/cpu_segment_fwd.c): the query rows
 * of all `group` query heads of KV head g are stacked into one M = group*bq
 * tall f32 tile, keys come in blocks of FA_CPU_KEY_BLOCK, S = Q K^T by sgemm.
 *  Pass 1, work item (g, query block): online softmax over the key blocks up
 *    to the diagonal -> lse of every (row, query head).
 *  Pass 2, work item (g, key block): for every query block from the diagonal
 *    on, P = exp(S - lse) (causally masked), column sums added to the block's
 *    keys. A key's score is owned by one work item and summed over query
 *    blocks in ascending order, so the result does not depend on threads. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "cpu_backend.h"
#include "cpu_team.h"
#include "cpu_tile.h"
#include "online_softmax.h"

typedef struct {
  const forkattn_tensor *q, *k;
  float scale;
  int64_t L, hq, hkv, d, group, qlo, kend, bq, bk;
  int64_t nqb, nkb; /* query blocks of [qlo, L), key blocks of [0, kend) */
  float *lse;       /* [L - qlo, hq] */
  double *score;    /* [hkv, kend] */
} fa_kv_job;

typedef struct {
  float *q, *s, *kbuf, *m, *l, *col;
} fa_kv_tiles;

static int64_t fa_kv_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* Scaled queries of rows [q0, q0+qn) of every query head of g, stacked. */
static void fa_kv_gather_q(const fa_kv_job *j, int64_t g, int64_t q0, int64_t qn, float *dst) {
  for (int64_t hh = 0; hh < j->group; hh++)
    fa_cpu_gather(j->q, q0, qn, g * j->group + hh, j->scale, dst + hh * qn * j->d, j->d);
}

/* S[M x nk] = Q K^T with K the rows [k0, k0+nk) viewed at ldk. */
static void fa_kv_scores_tile(const fa_kv_job *j, const float *Q, int64_t M, const float *K, int64_t ldk,
                              int64_t nk, float *S) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)nk, (int)j->d, 1.0f, Q, (int)j->d, K,
              (int)ldk, 0.0f, S, (int)nk);
}

/* Pass 1: lse of the rows of query block qb for every query head of g. */
static void fa_kv_lse_block(const fa_kv_job *j, int64_t g, int64_t qb, fa_kv_tiles *t) {
  const int64_t q0 = j->qlo + qb * j->bq, qn = fa_kv_min(j->bq, j->L - q0), M = j->group * qn;
  const int64_t kn = q0 + qn; /* causal: keys [0, q0 + qn) */
  fa_kv_gather_q(j, g, q0, qn, t->q);
  for (int64_t i = 0; i < M; i++) {
    t->m[i] = -INFINITY;
    t->l[i] = 0.0f;
  }
  for (int64_t kb = 0; kb < kn; kb += j->bk) {
    const int64_t nk = fa_kv_min(j->bk, kn - kb);
    int64_t ldk;
    const float *K = fa_cpu_rows_view(j->k, kb, nk, g, t->kbuf, &ldk);
    fa_kv_scores_tile(j, t->q, M, K, ldk, nk, t->s);
    if (kb + nk - 1 > q0) fa_cpu_mask_causal(t->s, nk, j->group, qn, q0, nk, kb);
    float alpha;
    for (int64_t i = 0; i < M; i++) fa_cpu_online_row(t->s + i * nk, nk, &t->m[i], &t->l[i], &alpha);
  }
  for (int64_t hh = 0; hh < j->group; hh++)
    for (int64_t r = 0; r < qn; r++) {
      float inv, lse;
      fa_finish(t->m[hh * qn + r], t->l[hh * qn + r], &inv, &lse);
      j->lse[(q0 + r - j->qlo) * j->hq + g * j->group + hh] = lse;
    }
}

/* Pass 2: scores of the keys of key block kbi of head g. */
static void fa_kv_score_block(const fa_kv_job *j, int64_t g, int64_t kbi, fa_kv_tiles *t) {
  const int64_t k0 = kbi * j->bk, nk = fa_kv_min(j->bk, j->kend - k0);
  const int64_t first = k0 > j->qlo ? k0 : j->qlo; /* earlier rows see none of these keys */
  int64_t ldk;
  const float *K = fa_cpu_rows_view(j->k, k0, nk, g, t->kbuf, &ldk);
  double *score = j->score + g * j->kend + k0;
  for (int64_t c = 0; c < nk; c++) score[c] = 0.0;
  for (int64_t qb = (first - j->qlo) / j->bq; qb < j->nqb; qb++) {
    const int64_t q0 = j->qlo + qb * j->bq, qn = fa_kv_min(j->bq, j->L - q0), M = j->group * qn;
    fa_kv_gather_q(j, g, q0, qn, t->q);
    fa_kv_scores_tile(j, t->q, M, K, ldk, nk, t->s);
    if (k0 + nk - 1 > q0) fa_cpu_mask_causal(t->s, nk, j->group, qn, q0, nk, k0);
    memset(t->col, 0, sizeof(float) * (size_t)nk);
    for (int64_t hh = 0; hh < j->group; hh++)
      for (int64_t r = 0; r < qn; r++) {
        float *srow = t->s + (hh * qn + r) * nk;
        fa_cpu_exp_sub(srow, nk, j->lse[(q0 + r - j->qlo) * j->hq + g * j->group + hh]);
        float *col = t->col;
#pragma omp simd
        for (int64_t c = 0; c < nk; c++) col[c] += srow[c];
      }
    for (int64_t c = 0; c < nk; c++) score[c] += (double)t->col[c];
  }
}

static fa_kv_tiles fa_kv_take(fa_cpu_ws *ws, const fa_kv_job *j) {
  const int64_t M = j->group * j->bq;
  fa_kv_tiles t = {fa_cpu_ws_take(ws, M * j->d), fa_cpu_ws_take(ws, M * j->bk),
                   fa_cpu_ws_take(ws, j->bk * j->d), fa_cpu_ws_take(ws, M),
                   fa_cpu_ws_take(ws, M), fa_cpu_ws_take(ws, j->bk)};
  return t;
}

/* Largest work first: late query blocks see the most keys, early key blocks
 * the most queries. */
static void fa_kv_lse_team(fa_cpu_ws *ws, void *arg) {
  const fa_kv_job *j = arg;
  fa_kv_tiles t = fa_kv_take(ws, j);
#pragma omp for schedule(dynamic, 1)
  for (int64_t w = 0; w < j->nqb * j->hkv; w++) fa_kv_lse_block(j, w % j->hkv, j->nqb - 1 - w / j->hkv, &t);
}

static void fa_kv_score_team(fa_cpu_ws *ws, void *arg) {
  const fa_kv_job *j = arg;
  fa_kv_tiles t = fa_kv_take(ws, j);
#pragma omp for schedule(dynamic, 1)
  for (int64_t w = 0; w < j->nkb * j->hkv; w++) fa_kv_score_block(j, w % j->hkv, w / j->hkv, &t);
}

forkattn_status fa_cpu_kv_scores(forkattn_ctx *ctx, const forkattn_tensor *q, const forkattn_tensor *k,
                                 float scale, int64_t qlo, int64_t kend, double *score, size_t extra_bytes) {
  const int64_t L = q->rows, hq = q->heads, hkv = k->heads, group = hq / hkv;
  fa_kv_job j = {q, k, scale, L, hq, hkv, q->head_dim, group, qlo, kend, fa_cpu_query_block(group),
                 FA_CPU_KEY_BLOCK, 0, 0, NULL, score};
  j.nqb = (L - qlo + j.bq - 1) / j.bq;
  j.nkb = (kend + j.bk - 1) / j.bk;
  if (kend <= 0) return FORKATTN_OK;
  if (j.nqb == 0) { /* no query rows: nothing attends */
    memset(score, 0, sizeof(double) * (size_t)(hkv * kend));
    return FORKATTN_OK;
  }
  /* (L - qlo) x hq fits int64 (q was validated), the bytes need not fit size_t */
  const size_t lse_bytes = sizeof(float) * (size_t)((L - qlo) * hq);
  j.lse = fa_malloc_array((L - qlo) * hq, sizeof(float));
  if (!j.lse) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kv_select: cannot allocate %zu bytes of lse", lse_bytes);
  const double Md = (double)group * (double)j.bq; /* M, which wraps for an absurd GQA group */
  const int64_t ws_floats = fa_cpu_ws_floats(Md * (double)j.d + Md * (double)j.bk + (double)(j.bk * j.d) + 2 * Md +
                                             (double)j.bk + 6 * 16); /* 6 carves, 16-aligned */
  int rc = fa_cpu_team_run(ctx, ws_floats, extra_bytes + lse_bytes, fa_kv_lse_team, &j);
  if (!rc) rc = fa_cpu_team_run(ctx, ws_floats, extra_bytes + lse_bytes, fa_kv_score_team, &j);
  fa_free(j.lse);
  if (rc) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kv_select: cannot allocate CPU tiles");
  return FORKATTN_OK;
}
