/* CPU StreamKL forward and backward on OpenBLAS tiles.
 *
 * Forward: work item = (query head, query block). For each key tile of each
 * pair of the block's segment, two GEMMs give the teacher and student score
 * tiles; each row folds its visible keys into an online KL state (online_kl.h)
 * and, with a kept set, the teacher's scores of dropped keys into a log-sum-exp. Extra memory:
 * the tiles, O(rows * heads) outputs; never rows x keys.
 *
 * Backward: scores are recomputed tile by tile from the saved statistics and
 * turned into the score gradients G_t, G_s (fa_kl_elem_grad). dQ by query
 * block; dK by key block, summing over every reader pair and query head of the
 * KV head in a fixed order (deterministic, no atomics). Teacher and student
 * have their own GQA groups, so each side's dK has its own pass. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "cpu_team.h"
#include "cpu_tile.h"
#include "cpu_backend.h"
#include "streamkl.h"

#define FA_KL_QB 64
#define FA_KL_KB FA_CPU_KEY_BLOCK

typedef struct {
  float *qt, *qs, *kt, *ks, *st, *ss, *acc_t, *acc_s, *vt, *vs, *dd, *row;
} fa_kl_tiles;

static int64_t fa_kl_ws_floats(const fa_kl_call *c) {
  const int64_t b = FA_KL_QB > FA_KL_KB ? FA_KL_QB : FA_KL_KB;
  return b * (c->dt + c->ds) * 2 + 2 * FA_KL_QB * FA_KL_KB + b * (c->dt + c->ds) + 3 * FA_KL_KB +
         16 * FA_KL_QB + 12 * 16;
}

static fa_kl_tiles fa_kl_take(fa_cpu_ws *ws, const fa_kl_call *c) {
  const int64_t b = FA_KL_QB > FA_KL_KB ? FA_KL_QB : FA_KL_KB;
  fa_kl_tiles t;
  t.qt = fa_cpu_ws_take(ws, b * c->dt);
  t.qs = fa_cpu_ws_take(ws, b * c->ds);
  t.kt = fa_cpu_ws_take(ws, b * c->dt);
  t.ks = fa_cpu_ws_take(ws, b * c->ds);
  t.st = fa_cpu_ws_take(ws, FA_KL_QB * FA_KL_KB);
  t.ss = fa_cpu_ws_take(ws, FA_KL_QB * FA_KL_KB);
  t.acc_t = fa_cpu_ws_take(ws, b * c->dt);
  t.acc_s = fa_cpu_ws_take(ws, b * c->ds);
  t.vt = fa_cpu_ws_take(ws, FA_KL_KB);
  t.vs = fa_cpu_ws_take(ws, FA_KL_KB);
  t.dd = fa_cpu_ws_take(ws, FA_KL_KB);
  t.row = fa_cpu_ws_take(ws, 16 * FA_KL_QB);
  return t;
}

/* S_t = (st q_t) K_t^T and S_s = (ss q_s) K_s^T for query rows of head h
 * (already gathered, scaled, in t->qt / t->qs) against keys [kb, kb+nk). */
static void fa_kl_scores(const fa_kl_call *c, int64_t h, int64_t qn, int64_t kb, int64_t nk, fa_kl_tiles *t,
                         const float **Kt, int64_t *ldt, const float **Ks, int64_t *lds) {
  *Kt = fa_cpu_rows_view(&c->kt, kb, nk, h / (c->h / c->hkv_t), t->kt, ldt);
  *Ks = fa_cpu_rows_view(&c->ks, kb, nk, h / (c->h / c->hkv_s), t->ks, lds);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)qn, (int)nk, (int)c->dt, 1.0f, t->qt, (int)c->dt, *Kt,
              (int)*ldt, 0.0f, t->st, (int)nk);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)qn, (int)nk, (int)c->ds, 1.0f, t->qs, (int)c->ds, *Ks,
              (int)*lds, 0.0f, t->ss, (int)nk);
}

static void fa_kl_gather_queries(const fa_kl_call *c, int64_t h, int64_t q0, int64_t qn, fa_kl_tiles *t) {
  fa_cpu_gather(&c->qt, q0, qn, h, c->st, t->qt, c->dt);
  fa_cpu_gather(&c->qs, q0, qn, h, c->ss, t->qs, c->ds);
}

/* Number of keys of the tile visible to key-frame row q (layout mask). */
static int64_t fa_kl_visible_count(int causal, int64_t q, int64_t kb, int64_t nk) {
  if (!causal) return nk;
  const int64_t n = q - kb + 1;
  return n < 0 ? 0 : (n < nk ? n : nk);
}

/* ---- forward ------------------------------------------------------------ */

/* fa_kl_tile with the vectorized exp: the same update, scores t and s
 * overwritten, d: n floats of scratch. Rows holding NaN or infinite scores
 * take the scalar path (its NaN and overflow behaviour is the reference). */
static void fa_kl_tile_cpu(fa_kl_state *st, float *t, float *s, int64_t n, float *d) {
  if (n <= 0) return;
  const float mt = fmaxf(st->mt, fa_cpu_row_max(t, n)), ms = fmaxf(st->ms, fa_cpu_row_max(s, n));
  if (!(isfinite(mt) && isfinite(ms)) || fa_cpu_any_nan(t, n) || fa_cpu_any_nan(s, n)) {
    fa_kl_tile(st, t, s, (int)n);
    return;
  }
  fa_kl_rebase(st, mt, ms);
#pragma omp simd
  for (int64_t j = 0; j < n; j++) d[j] = (t[j] - mt) - (s[j] - ms);
  fa_cpu_exp_sub(t, n, mt);
  fa_cpu_exp_sub(s, n, ms);
  float lt = 0.0f, ls = 0.0f, a = 0.0f, b = 0.0f;
#pragma omp simd reduction(+ : lt, ls, a, b)
  for (int64_t j = 0; j < n; j++) {
    lt += t[j];
    ls += s[j];
    a += t[j] * d[j];
    b += s[j] * d[j];
  }
  st->lt += lt;
  st->ls += ls;
  st->a += a;
  st->b -= b;
}

/* Online log-sum-exp of n teacher scores (overwritten): the keys a kept set drops. */
static void fa_kl_lse_tile(float *mtf, float *ltf, float *t, int64_t n) {
  if (n <= 0) return;
  const float m = fmaxf(*mtf, fa_cpu_row_max(t, n));
  if (m == -INFINITY) { /* NaN scores only */
    if (fa_cpu_any_nan(t, n)) *mtf = *ltf = NAN;
    return;
  }
  float l = *mtf == -INFINITY ? 0.0f : *ltf * expf(*mtf - m);
  fa_cpu_exp_sub(t, n, m);
#pragma omp simd reduction(+ : l)
  for (int64_t j = 0; j < n; j++) l += t[j];
  *ltf = l;
  *mtf = m;
}

static void fa_kl_fwd_block(const fa_kl_call *c, const fa_block *b, int64_t h, fa_kl_tiles *t) {
  const fa_plan *p = c->plan;
  const int64_t qn = b->len;
  fa_kl_state *state = (fa_kl_state *)t->row; /* 6 floats each */
  float *mtf = t->row + 6 * FA_KL_QB, *ltf = mtf + FA_KL_QB;
  fa_kl_gather_queries(c, h, b->start, qn, t);
  for (int64_t r = 0; r < qn; r++) {
    state[r] = fa_kl_init();
    mtf[r] = -INFINITY;
    ltf[r] = 0.0f;
  }
  for (int64_t pi = p->q_pair_off[b->seg]; pi < p->q_pair_off[b->seg + 1]; pi++) {
    const fa_pair pr = p->pair[pi];
    const fa_range keys = fa_pair_keys(p->seg, pr, b->start, qn, p->qshift);
    for (int64_t kb = keys.start; kb < keys.start + keys.len; kb += FA_KL_KB) {
      const int64_t nk = keys.start + keys.len - kb < FA_KL_KB ? keys.start + keys.len - kb : FA_KL_KB;
      const float *Kt, *Ks;
      int64_t ldt, lds;
      fa_kl_scores(c, h, qn, kb, nk, t, &Kt, &ldt, &Ks, &lds);
      for (int64_t r = 0; r < qn; r++) {
        const int64_t row = b->start + r;
        const int64_t nv = fa_kl_visible_count((int)pr.causal, row + p->qshift, kb, nk);
        float *trow = t->st + r * nk, *srow = t->ss + r * nk;
        if (!c->kept) {
          fa_kl_tile_cpu(&state[r], trow, srow, nv, t->dd);
          continue;
        }
        int64_t n = 0, nd = 0;
        for (int64_t j = 0; j < nv; j++)
          if (fa_kept_visible(c->kept, h, row, kb + j)) {
            t->vt[n] = trow[j];
            t->vs[n++] = srow[j];
          } else {
            trow[nd++] = trow[j]; /* dropped keys' teacher scores, compacted in place */
          }
        fa_kl_lse_tile(&mtf[r], &ltf[r], trow, nd);
        fa_kl_tile_cpu(&state[r], t->vt, t->vs, n, t->dd);
      }
    }
  }
  for (int64_t r = 0; r < qn; r++) {
    const int64_t i = (b->start + r) * c->h + h;
    float stats4[FORKATTN_KL_STATS], outside;
    const float div = fa_kl_row_finish(state[r], mtf[r], ltf[r], c->reverse, stats4, &outside);
    c->kl[i] = div * c->loss_mul;
    if (c->stats) memcpy(c->stats + i * FORKATTN_KL_STATS, stats4, sizeof stats4);
    if (c->outside) c->outside[i] = outside;
  }
}

typedef struct {
  const fa_kl_call *c;
  const fa_block *qblocks, *kblocks;
  int64_t nq, nk;
} fa_kl_job;

static void fa_kl_fwd_team(fa_cpu_ws *ws, void *arg) {
  const fa_kl_job *j = arg;
  fa_kl_tiles t = fa_kl_take(ws, j->c);
  const int64_t H = j->c->h;
#pragma omp for schedule(dynamic, 1)
  for (int64_t w = 0; w < j->nq * H; w++) fa_kl_fwd_block(j->c, &j->qblocks[w / H], w % H, &t);
}

forkattn_status fa_cpu_kl_fwd(forkattn_ctx *ctx, const fa_kl_call *c, forkattn_memory memory) {
  (void)memory; /* host */
  const fa_block *qblocks;
  const int64_t nq = fa_plan_blocks_memo(c->plan, FA_KL_QB, 0, &qblocks);
  if (nq < 0) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kl_fwd: cannot allocate blocks");
  fa_kl_job job = {c, qblocks, NULL, nq, 0};
  int rc = fa_cpu_team_run(ctx, fa_kl_ws_floats(c), sizeof(fa_block) * (size_t)nq, fa_kl_fwd_team, &job);
  return rc ? fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kl_fwd: cannot allocate CPU tiles") : FORKATTN_OK;
}

/* ---- backward ----------------------------------------------------------- */

/* Turn the score tiles into score gradients, times each row's upstream
 * gradient: t->st = G_t, t->ss = G_s (0 on every key the row does not see).
 * fa_kl_elem_grad's formulas, vectorized: probabilities by the vectorized exp
 * in place, visibility by selects (a dropped key's score never reaches G). */
static void fa_kl_grad_tile(const fa_kl_call *c, int64_t h, int causal, int64_t q0, int64_t qn, int64_t kb,
                            int64_t nk, fa_kl_tiles *t) {
  float *d = t->dd, *vis = t->vt;
  for (int64_t r = 0; r < qn; r++) {
    const int64_t row = q0 + r, i = row * c->h + h;
    const float *stats4 = c->stats_in + i * FORKATTN_KL_STATS;
    const float g = c->dkl[i] * c->loss_mul, lse_s = stats4[FA_KL_LSE_S], kl = stats4[FA_KL_DIV];
    const float lse_t = c->reverse ? stats4[FA_KL_LSE_TF] : stats4[FA_KL_LSE_T];
    const int64_t nv = lse_s == -INFINITY ? 0 : fa_kl_visible_count(causal, row + c->plan->qshift, kb, nk);
    float *trow = t->st + r * nk, *srow = t->ss + r * nk;
    for (int64_t j = 0; j < nv; j++) vis[j] = c->kept && !fa_kept_visible(c->kept, h, row, kb + j) ? 0.0f : 1.0f;
#pragma omp simd
    for (int64_t j = 0; j < nv; j++) d[j] = trow[j] - srow[j];
    fa_cpu_exp_sub(trow, nv, lse_t); /* T_j (kept-renormalised forward, full reverse) */
    fa_cpu_exp_sub(srow, nv, lse_s); /* S_j where kept */
    if (!c->reverse) {
      const float shift = kl + lse_t - lse_s;
#pragma omp simd
      for (int64_t j = 0; j < nv; j++) {
        const float pt = trow[j], ps = srow[j], on = vis[j] != 0.0f;
        trow[j] = on ? g * (pt * (d[j] - shift)) : 0.0f;
        srow[j] = on ? g * (ps - pt) : 0.0f;
      }
    } else {
      const float shift = kl + lse_s - lse_t;
#pragma omp simd
      for (int64_t j = 0; j < nv; j++) {
        const float pt = trow[j], ps = vis[j] != 0.0f ? srow[j] : 0.0f;
        trow[j] = g * (pt - ps);
        srow[j] = vis[j] != 0.0f ? g * (ps * (-d[j] - shift)) : 0.0f;
      }
    }
    for (int64_t j = nv; j < nk; j++) trow[j] = srow[j] = 0.0f;
  }
}

static void fa_kl_dq_block(const fa_kl_call *c, const fa_block *b, int64_t h, fa_kl_tiles *t) {
  const fa_plan *p = c->plan;
  const int64_t qn = b->len;
  fa_kl_gather_queries(c, h, b->start, qn, t);
  memset(t->acc_s, 0, sizeof(float) * (size_t)(qn * c->ds));
  memset(t->acc_t, 0, sizeof(float) * (size_t)(qn * c->dt));
  for (int64_t pi = p->q_pair_off[b->seg]; pi < p->q_pair_off[b->seg + 1]; pi++) {
    const fa_pair pr = p->pair[pi];
    const fa_range keys = fa_pair_keys(p->seg, pr, b->start, qn, p->qshift);
    for (int64_t kb = keys.start; kb < keys.start + keys.len; kb += FA_KL_KB) {
      const int64_t nk = keys.start + keys.len - kb < FA_KL_KB ? keys.start + keys.len - kb : FA_KL_KB;
      const float *Kt, *Ks;
      int64_t ldt, lds;
      fa_kl_scores(c, h, qn, kb, nk, t, &Kt, &ldt, &Ks, &lds);
      fa_kl_grad_tile(c, h, (int)pr.causal, b->start, qn, kb, nk, t);
      fa_cpu_sparse_ab(t->ss, nk, qn, nk, Ks, lds, c->ds, c->ss, t->acc_s, c->ds);
      if (c->teacher_grad) fa_cpu_sparse_ab(t->st, nk, qn, nk, Kt, ldt, c->dt, c->st, t->acc_t, c->dt);
    }
  }
  fa_cpu_scatter(&c->dqs, b->start, qn, h, t->acc_s, c->ds);
  if (c->teacher_grad) fa_cpu_scatter(&c->dqt, b->start, qn, h, t->acc_t, c->dt);
}

/* dK of one KV head g of one side (teacher = 1) over key block b: every
 * reader pair, query block and query head of g, in a fixed order. */
static void fa_kl_dk_block(const fa_kl_call *c, const fa_block *b, int64_t g, int teacher, fa_kl_tiles *t) {
  const fa_plan *p = c->plan;
  const int64_t nk = b->len, d = teacher ? c->dt : c->ds;
  const int64_t group = c->h / (teacher ? c->hkv_t : c->hkv_s);
  float *acc = teacher ? t->acc_t : t->acc_s;
  memset(acc, 0, sizeof(float) * (size_t)(nk * d));
  for (int64_t j = p->k_pair_off[b->seg]; j < p->k_pair_off[b->seg + 1]; j++) {
    const fa_pair pr = p->pair[p->k_pair_idx[j]];
    const fa_range qr = fa_pair_queries(p->seg, pr, b->start, p->qshift);
    for (int64_t qb = qr.start; qb < qr.start + qr.len; qb += FA_KL_QB) {
      const int64_t qn = qr.start + qr.len - qb < FA_KL_QB ? qr.start + qr.len - qb : FA_KL_QB;
      for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = g * group + hh;
        const float *Kt, *Ks;
        int64_t ldt, lds;
        fa_kl_gather_queries(c, h, qb, qn, t);
        fa_kl_scores(c, h, qn, b->start, nk, t, &Kt, &ldt, &Ks, &lds);
        fa_kl_grad_tile(c, h, (int)pr.causal, qb, qn, b->start, nk, t);
        fa_cpu_sparse_atb(teacher ? t->st : t->ss, nk, qn, nk, teacher ? t->qt : t->qs, d, d, acc, d);
      }
    }
  }
  fa_cpu_scatter(teacher ? &c->dkt : &c->dks, b->start, nk, g, acc, d);
}

/* Zero the dK rows of key rows no pair reads (they get no gradient). */
static void fa_kl_zero_unread(const forkattn_tensor *dk, int64_t rows, const unsigned char *read, float *zeros) {
  memset(zeros, 0, sizeof(float) * (size_t)dk->head_dim);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; r++)
    if (!read[r])
      for (int64_t g = 0; g < dk->heads; g++) fa_cpu_scatter(dk, r, 1, g, zeros, dk->head_dim);
}

typedef struct {
  const fa_kl_call *c;
  const fa_block *qblocks, *kblocks;
  int64_t nq, nk;
  const unsigned char *read;
} fa_kl_bwd_job;

static void fa_kl_bwd_team(fa_cpu_ws *ws, void *arg) {
  const fa_kl_bwd_job *j = arg;
  const fa_kl_call *c = j->c;
  fa_kl_tiles t = fa_kl_take(ws, c);
  const int64_t H = c->h;
  fa_kl_zero_unread(&c->dks, c->plan->rows, j->read, t.acc_s);
  if (c->teacher_grad) fa_kl_zero_unread(&c->dkt, c->plan->rows, j->read, t.acc_t);
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t w = 0; w < j->nq * H; w++) fa_kl_dq_block(c, &j->qblocks[w / H], w % H, &t);
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t w = 0; w < j->nk * c->hkv_s; w++) fa_kl_dk_block(c, &j->kblocks[w / c->hkv_s], w % c->hkv_s, 0, &t);
  if (c->teacher_grad) {
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t w = 0; w < j->nk * c->hkv_t; w++)
      fa_kl_dk_block(c, &j->kblocks[w / c->hkv_t], w % c->hkv_t, 1, &t);
  }
}

forkattn_status fa_cpu_kl_bwd(forkattn_ctx *ctx, const fa_kl_call *c, forkattn_memory memory) {
  (void)memory; /* host */
  const fa_plan *p = c->plan;
  const fa_block *qblocks = NULL, *kblocks = NULL;
  const int64_t nq = fa_plan_blocks_memo(p, FA_KL_QB, 0, &qblocks);
  const int64_t nk = fa_plan_blocks_memo(p, FA_KL_KB, 1, &kblocks);
  unsigned char *read = fa_malloc((size_t)p->rows);
  int rc = -1;
  if (nq >= 0 && nk >= 0 && read) {
    memset(read, 0, (size_t)p->rows);
    for (int64_t i = 0; i < nk; i++) memset(read + kblocks[i].start, 1, (size_t)kblocks[i].len);
    fa_kl_bwd_job job = {c, qblocks, kblocks, nq, nk, read};
    rc = fa_cpu_team_run(ctx, fa_kl_ws_floats(c), sizeof(fa_block) * (size_t)(nq + nk) + (size_t)p->rows,
                         fa_kl_bwd_team, &job);
  }
  fa_free(read);
  return rc ? fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "kl_bwd: cannot allocate workspace") : FORKATTN_OK;
}
