/* CPU forward of segment attention (FlashAttention-2 style on OpenBLAS tiles).
 *
 * Work item = (KV head g, query block). The query rows of all `group` query
 * heads reading g are stacked into one M = group*bq tall tile so each K/V tile
 * feeds a GEMM large enough to run near sgemm speed. For every pair of the
 * block's segment, key blocks are visited in order with one running (m, l, O)
 * per row: the online softmax merges prefix and own-segment keys exactly. */
#include "alloc.h"
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "cpu_tile.h"
#include "cpu_team.h"
#include "online_softmax.h"
#include "cpu_backend.h"

typedef struct {
  float *q, *o, *s, *kbuf, *vbuf, *m, *l;
} fa_fwd_tiles;

/* One query block against every key block of every pair of its segment. */
static void fa_fwd_block(const fa_attn_fwd *a, const fa_block *b, int64_t g, fa_fwd_tiles *t) {
  const fa_plan *p = a->plan;
  const int64_t d = a->d, group = a->hq / a->hkv, qn = b->len, M = group * qn;
  const int64_t q_pos0 = b->start + p->qshift; /* causal masks compare key-frame rows */
  for (int64_t hh = 0; hh < group; hh++)
    fa_cpu_gather(&a->q, b->start, qn, g * group + hh, a->scale, t->q + hh * qn * d, d);
  for (int64_t i = 0; i < M; i++) {
    t->m[i] = -INFINITY;
    t->l[i] = 0.0f;
  }
  memset(t->o, 0, sizeof(float) * (size_t)(M * d));

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
      const int crossing = pr->causal && kb + nk - 1 > q_pos0;
      if (crossing) fa_cpu_mask_causal(t->s, nk, group, qn, q_pos0, nk, kb);
      if (a->kept) fa_cpu_mask_kept(t->s, nk, a->kept, g, group, qn, b->start, nk, kb);
      for (int64_t i = 0; i < M; i++) {
        float alpha;
        if (!fa_cpu_online_row(t->s + i * nk, nk, &t->m[i], &t->l[i], &alpha)) continue; /* P row is 0 */
        if (alpha != 1.0f) {
          float *orow = t->o + i * d;
#pragma omp simd
          for (int64_t c = 0; c < d; c++) orow[c] *= alpha;
        }
      }
      if (a->kept) /* P is exactly 0 on dropped keys: keep their non-finite values out */
        fa_cpu_sparse_ab(t->s, nk, M, nk, V, ldv, d, 1.0f, t->o, d);
      else if (crossing && !fa_cpu_all_finite(V, nk, d, ldv))
        fa_cpu_causal_ab(t->s, nk, V, ldv, t->o, d, group, qn, q_pos0, nk, kb, d, 1.0f);
      else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)d, (int)nk, 1.0f, t->s,
                    (int)nk, V, (int)ldv, 1.0f, t->o, (int)d);
    }
  }

  for (int64_t hh = 0; hh < group; hh++) {
    const int64_t h = g * group + hh;
    for (int64_t r = 0; r < qn; r++) {
      const int64_t i = hh * qn + r;
      float inv, lse;
      fa_finish(t->m[i], t->l[i], &inv, &lse);
      float *orow = t->o + i * d;
#pragma omp simd
      for (int64_t c = 0; c < d; c++) orow[c] *= inv;
      if (a->lse) a->lse[(b->start + r) * a->hq + h] = lse;
    }
    fa_cpu_scatter(&a->o, b->start, qn, h, t->o + hh * qn * d, d);
  }
}

typedef struct {
  const fa_attn_fwd *a;
  const fa_block *blocks;
  int64_t nwork, M, bk;
} fa_fwd_job;

static void fa_fwd_team(fa_cpu_ws *ws, void *arg) {
  const fa_fwd_job *j = arg;
  const int64_t M = j->M, bk = j->bk, d = j->a->d, hkv = j->a->hkv;
  fa_fwd_tiles t = {fa_cpu_ws_take(ws, M * d),  fa_cpu_ws_take(ws, M * d), fa_cpu_ws_take(ws, M * bk),
                    fa_cpu_ws_take(ws, bk * d), fa_cpu_ws_take(ws, bk * d), fa_cpu_ws_take(ws, M),
                    fa_cpu_ws_take(ws, M)};
#pragma omp for schedule(dynamic, 1)
  for (int64_t w = 0; w < j->nwork; w++) fa_fwd_block(j->a, &j->blocks[w / hkv], w % hkv, &t);
}

forkattn_status fa_cpu_attn_fwd(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory) {
  (void)memory; /* host */
  const int64_t group = a->hq / a->hkv, d = a->d, bq = fa_cpu_query_block(group);
  const int64_t bk = FA_CPU_KEY_BLOCK;
  int64_t M; /* an absurd GQA group saturates M: the scratch size below refuses it */
  if (__builtin_mul_overflow(group, bq, &M)) M = INT64_MAX;
  const fa_block *blocks;
  int64_t nb = fa_plan_blocks_memo(a->plan, bq, 0, &blocks);
  if (nb < 0) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "prefix_fwd: cannot allocate blocks");
  fa_fwd_job job = {a, blocks, nb * a->hkv, M, bk};
  const double Md = (double)M;
  const int64_t ws_floats = fa_cpu_ws_floats(2 * Md * (double)d + Md * (double)bk + 2.0 * (double)(bk * d) + 2 * Md +
                                             7 * 16); /* 7 carves, 16-aligned */
  int rc = fa_cpu_team_run(ctx, ws_floats, sizeof(fa_block) * (size_t)nb, fa_fwd_team, &job);
  if (rc) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "prefix_fwd: cannot allocate CPU tiles");
  return FORKATTN_OK;
}
