/*
 * reference_kl.c - float64 reference of StreamKL and kept-set attention
 * (tests only). See reference_kl.h for the definitions.
 *
 * Two passes, both parallel without floating-point races: pass 1 runs over
 * (row, head) pairs (forward outputs, dq and the per-row quantities the
 * gradients need); pass 2 runs over key rows and recomputes each score to
 * accumulate dk (every key row belongs to one thread).
 */
#include "reference_kl.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "test_common.h"

#ifdef _OPENMP
#define REFKL_PRAGMA(x) _Pragma(#x)
#else
#define REFKL_PRAGMA(x)
#endif

/* ---- layouts and kept sets ------------------------------------------------ */

int64_t refkl_layout_rows(const forkattn_layout *layout) {
  if (!layout || !layout->prefix == !layout->tree)
    return -1;
  if (layout->prefix) {
    const forkattn_prefix_layout *p = layout->prefix;
    if (p->prompt_len < 0 || p->num_responses < 0)
      return -1;
    if (p->num_responses == 0)
      return p->prompt_len;
    const int64_t *off = p->response_offsets;
    if (!off || off[0] != 0)
      return -1;
    for (int64_t i = 0; i < p->num_responses; i++)
      if (off[i + 1] < off[i])
        return -1;
    return p->prompt_len + off[p->num_responses];
  }
  const forkattn_tree_layout *t = layout->tree;
  if (t->num_nodes < 0)
    return -1;
  if (t->num_nodes == 0)
    return 0;
  if (!t->node_offsets || !t->parents || t->node_offsets[0] != 0)
    return -1;
  for (int64_t x = 0; x < t->num_nodes; x++)
    if (t->node_offsets[x + 1] < t->node_offsets[x] || t->parents[x] < -1 || t->parents[x] >= x)
      return -1;
  return t->node_offsets[t->num_nodes];
}

unsigned char *refkl_vis(const forkattn_layout *layout, int64_t *rows) {
  const int64_t T = refkl_layout_rows(layout);
  if (rows)
    *rows = T;
  if (T < 0)
    return NULL;
  unsigned char *vis = calloc((size_t)(T * T) + 1, 1);
  if (!vis)
    return NULL;
  if (layout->prefix) {
    const forkattn_prefix_layout *p = layout->prefix;
    const int64_t P = p->prompt_len;
    const int causal = p->mask == FORKATTN_MASK_CAUSAL;
    for (int64_t i = 0; i < P; i++)
      for (int64_t j = 0; j < (causal ? i + 1 : P); j++)
        vis[i * T + j] = 1;
    for (int64_t n = 0; n < p->num_responses; n++) {
      const int64_t r0 = P + p->response_offsets[n], r1 = P + p->response_offsets[n + 1];
      for (int64_t i = r0; i < r1; i++) {
        for (int64_t j = 0; j < P; j++)
          vis[i * T + j] = 1;
        for (int64_t j = r0; j < (causal ? i + 1 : r1); j++)
          vis[i * T + j] = 1;
      }
    }
    return vis;
  }
  const forkattn_tree_layout *t = layout->tree;
  const int64_t *off = t->node_offsets, *par = t->parents;
  for (int64_t x = 0; x < t->num_nodes; x++)
    for (int64_t i = off[x]; i < off[x + 1]; i++) {
      for (int64_t j = off[x]; j <= i; j++)
        vis[i * T + j] = 1;
      for (int64_t y = par[x]; y >= 0; y = par[y])
        for (int64_t j = off[y]; j < off[y + 1]; j++)
          vis[i * T + j] = 1;
    }
  return vis;
}

int refkl_kept_init(refkl_kept *k, const forkattn_kept_set *set, int64_t T, int64_t H) {
  memset(k, 0, sizeof *k);
  k->set = set;
  k->T = T;
  k->H = H;
  k->heads_div = H;
  k->nb = (T + FORKATTN_KEPT_BLOCK - 1) / FORKATTN_KEPT_BLOCK;
  if (!set)
    return 0;
  if (set->heads < 1 || H % set->heads)
    return -1;
  k->heads_div = H / set->heads;
  if (set->offsets) {
    const int64_t cr = set->compressed_rows;
    k->keep = calloc((size_t)(set->heads * cr) + 1, 1);
    if (!k->keep)
      return -1;
    for (int64_t h = 0; h < set->heads; h++)
      for (int64_t x = set->offsets[h]; x < set->offsets[h + 1]; x++) {
        const int64_t j = set->index[x];
        if (j < 0 || j >= cr)
          return -1;
        k->keep[h * cr + j] = 1;
      }
  }
  return 0;
}

void refkl_kept_free(refkl_kept *k) {
  free(k->keep);
  k->keep = NULL;
}

int refkl_kept_keeps(const refkl_kept *k, int64_t h, int64_t i, int64_t j) {
  const forkattn_kept_set *s = k->set;
  if (!s)
    return 1;
  const int64_t kh = h / k->heads_div;
  if (s->block_mask &&
      s->block_mask[(kh * k->nb + i / FORKATTN_KEPT_BLOCK) * k->nb + j / FORKATTN_KEPT_BLOCK] == 0)
    return 0;
  if (k->keep && i >= s->query_start && j < s->compressed_rows &&
      !k->keep[kh * s->compressed_rows + j])
    return 0;
  return 1;
}

/* ---- helpers -------------------------------------------------------------- */

static double dot(const double *a, const double *b, int64_t n) {
  double s = 0.0;
  for (int64_t c = 0; c < n; c++)
    s += a[c] * b[c];
  return s;
}

static double absdot(const double *a, const double *b, int64_t n) {
  double s = 0.0;
  for (int64_t c = 0; c < n; c++)
    s += fabs(a[c] * b[c]);
  return s;
}

static void axpy(double *y, double a, const double *x, int64_t n) {
  for (int64_t c = 0; c < n; c++)
    y[c] += a * x[c];
}

/* log(sum_j exp(x_j)) over the j with m[j] set; -inf when none. */
static double lse_masked(const double *x, const unsigned char *m, int64_t n) {
  double mx = -INFINITY;
  for (int64_t j = 0; j < n; j++)
    if (m[j] && x[j] > mx)
      mx = x[j];
  if (mx == -INFINITY)
    return -INFINITY;
  double s = 0.0;
  for (int64_t j = 0; j < n; j++)
    if (m[j])
      s += exp(x[j] - mx);
  return mx + log(s);
}

/* ---- StreamKL ------------------------------------------------------------- */

/* Per (row, head) quantities of pass 1 that pass 2 needs. */
typedef struct kl_row {
  double lse_t, lse_s, lse_tf, e; /* e: E_Tk[t - s] (forward) or E_S[s - t] (reverse) */
  double g;                       /* dkl * mul */
  int empty;                      /* no student-visible key */
} kl_row;

/* dL/dt_j, dL/ds_j of one key of a row (see reference_kl.h). */
static void kl_elem_grad(const kl_row *r, int reverse, double t, double s, int vt, int vs,
                         double *gt, double *gs) {
  *gt = *gs = 0.0;
  if (!vt || r->empty)
    return;
  if (!reverse) {
    if (!vs)
      return;
    const double tk = exp(t - r->lse_t), sp = exp(s - r->lse_s);
    *gs = r->g * (sp - tk);
    *gt = r->g * tk * ((t - s) - r->e);
  } else {
    const double tf = exp(t - r->lse_tf);
    if (vs) {
      const double sp = exp(s - r->lse_s);
      *gt = r->g * (tf - sp);
      *gs = r->g * sp * ((s - t) - r->e);
    } else {
      *gt = r->g * tf;
    }
  }
}

/* The visibility mask of a run's layout (its rows in *T) with the kept sets in *km, or NULL
 * (nothing left allocated) when either fails or the run's arguments are not valid (!args_ok). */
static unsigned char *run_masks(const forkattn_layout *layout, const forkattn_kept_set *kept, int64_t H,
                                int args_ok, int64_t *T, refkl_kept *km) {
  unsigned char *vis = refkl_vis(layout, T);
  if (!vis)
    return NULL;
  if (!args_ok) {
    free(vis);
    return NULL;
  }
  if (refkl_kept_init(km, kept, *T, H) != 0) {
    refkl_kept_free(km);
    free(vis);
    return NULL;
  }
  return vis;
}

int refkl_run(const refkl_args *a, const refkl_out *out) {
  const int64_t H = a->H;
  const int args_ok = !(H <= 0 || a->hkv_t <= 0 || a->hkv_s <= 0 || H % a->hkv_t || H % a->hkv_s ||
                        a->dt <= 0 || a->ds <= 0 || !(a->tau > 0));
  int64_t T = -1;
  refkl_kept km;
  unsigned char *vis = run_masks(a->layout, a->kept, H, args_ok, &T, &km);
  if (!vis)
    return -1;
  const int bwd = a->dkl != NULL;
  const int64_t gt_div = H / a->hkv_t, gs_div = H / a->hkv_s, dt = a->dt, ds = a->ds;
  const double st = a->scale_t / a->tau, ss = a->scale_s / a->tau;
  const double mul = a->tau2 ? a->tau * a->tau : 1.0;
  kl_row *rows = malloc((size_t)(T * H + 1) * sizeof *rows);
  int ok = rows != NULL;
  if (bwd && ok) {
    if (out->dks)
      memset(out->dks, 0, (size_t)(T * a->hkv_s * ds) * sizeof(double));
    if (out->dkt)
      memset(out->dkt, 0, (size_t)(T * a->hkv_t * dt) * sizeof(double));
  }

  /* pass 1: rows */
  REFKL_PRAGMA(omp parallel if (ok && T * H > 1))
  {
    double *t = malloc((size_t)(T + 1) * sizeof *t), *s = malloc((size_t)(T + 1) * sizeof *s);
    double *at = malloc((size_t)(T + 1) * sizeof *at), *as = malloc((size_t)(T + 1) * sizeof *as);
    unsigned char *mvs = malloc((size_t)T + 1);
    if (!t || !s || !at || !as || !mvs) {
      REFKL_PRAGMA(omp atomic write)
      ok = 0;
    }
    REFKL_PRAGMA(omp for schedule(dynamic, 4))
    for (int64_t x = 0; x < T * H; x++) {
      if (!t || !s || !at || !as || !mvs)
        continue;
      const int64_t i = x / H, h = x % H;
      const unsigned char *mvt = vis + i * T;
      const double *qt = a->qt + (i * H + h) * dt, *qs = a->qs + (i * H + h) * ds;
      double rsc = 0.0;
      for (int64_t j = 0; j < T; j++) {
        mvs[j] = mvt[j] && refkl_kept_keeps(&km, h, i, j);
        t[j] = s[j] = at[j] = as[j] = 0.0;
        if (mvt[j]) {
          const double *kt = a->kt + (j * a->hkv_t + h / gt_div) * dt;
          t[j] = st * dot(qt, kt, dt);
          at[j] = st * absdot(qt, kt, dt);
          rsc = fmax(rsc, at[j]);
        }
        if (mvs[j]) {
          const double *ks = a->ks + (j * a->hkv_s + h / gs_div) * ds;
          s[j] = ss * dot(qs, ks, ds);
          as[j] = ss * absdot(qs, ks, ds);
          rsc = fmax(rsc, as[j]);
        }
      }
      kl_row r;
      r.lse_tf = lse_masked(t, mvt, T);
      r.lse_t = lse_masked(t, mvs, T);
      r.lse_s = lse_masked(s, mvs, T);
      r.empty = r.lse_s == -INFINITY;
      r.g = bwd ? a->dkl[i * H + h] * mul : 0.0;
      double div = 0.0, e = 0.0;
      if (!r.empty) {
        for (int64_t j = 0; j < T; j++) {
          if (!mvs[j])
            continue;
          const double lt = t[j] - (a->reverse ? r.lse_tf : r.lse_t), ls = s[j] - r.lse_s;
          if (!a->reverse) {
            const double p = exp(lt);
            div += p * (lt - ls);
            e += p * (t[j] - s[j]);
          } else {
            const double p = exp(ls);
            div += p * (ls - lt);
            e += p * (s[j] - t[j]);
          }
        }
      }
      r.e = e;
      rows[x] = r;
      if (out->kl)
        out->kl[x] = div * mul;
      if (out->stats) {
        out->stats[4 * x + 0] = r.lse_t;
        out->stats[4 * x + 1] = r.lse_s;
        out->stats[4 * x + 2] = div;
        out->stats[4 * x + 3] = r.lse_tf;
      }
      if (out->outside)
        out->outside[x] = r.lse_tf == -INFINITY ? 0.0
                          : r.empty            ? 1.0
                                               : -expm1(r.lse_t - r.lse_tf);
      if (out->rscale)
        out->rscale[x] = rsc;
      if (out->cond) { /* sum_j |d div / d t_j| A_t,j + |d div / d s_j| A_s,j */
        kl_row r1 = r;
        r1.g = 1.0;
        double cnd = 0.0;
        for (int64_t j = 0; j < T; j++) {
          double g_t, g_s;
          kl_elem_grad(&r1, a->reverse, t[j], s[j], mvt[j], mvs[j], &g_t, &g_s);
          cnd += fabs(g_t) * at[j] + fabs(g_s) * as[j];
        }
        out->cond[x] = cnd;
      }
      if (!bwd)
        continue;
      double *dqs = out->dqs ? out->dqs + (i * H + h) * ds : NULL;
      double *dqt = out->dqt ? out->dqt + (i * H + h) * dt : NULL;
      if (dqs)
        memset(dqs, 0, (size_t)ds * sizeof *dqs);
      if (dqt)
        memset(dqt, 0, (size_t)dt * sizeof *dqt);
      for (int64_t j = 0; j < T; j++) {
        double g_t, g_s;
        kl_elem_grad(&r, a->reverse, t[j], s[j], mvt[j], mvs[j], &g_t, &g_s);
        if (dqs && g_s != 0.0)
          axpy(dqs, g_s * ss, a->ks + (j * a->hkv_s + h / gs_div) * ds, ds);
        if (dqt && g_t != 0.0)
          axpy(dqt, g_t * st, a->kt + (j * a->hkv_t + h / gt_div) * dt, dt);
      }
    }
    free(t);
    free(s);
    free(at);
    free(as);
    free(mvs);
  }

  /* pass 2: keys */
  if (ok && bwd && (out->dks || out->dkt)) {
    REFKL_PRAGMA(omp parallel for schedule(dynamic, 4))
    for (int64_t j = 0; j < T; j++) {
      for (int64_t h = 0; h < H; h++) {
        const double *kt = a->kt + (j * a->hkv_t + h / gt_div) * dt;
        const double *ks = a->ks + (j * a->hkv_s + h / gs_div) * ds;
        double *dkt = out->dkt ? out->dkt + (j * a->hkv_t + h / gt_div) * dt : NULL;
        double *dks = out->dks ? out->dks + (j * a->hkv_s + h / gs_div) * ds : NULL;
        for (int64_t i = 0; i < T; i++) {
          if (!vis[i * T + j])
            continue;
          const kl_row *r = &rows[i * H + h];
          if (r->empty || r->g == 0.0)
            continue;
          const int vs = refkl_kept_keeps(&km, h, i, j);
          const double *qt = a->qt + (i * H + h) * dt, *qs = a->qs + (i * H + h) * ds;
          const double t = st * dot(qt, kt, dt), s = vs ? ss * dot(qs, ks, ds) : 0.0;
          double g_t, g_s;
          kl_elem_grad(r, a->reverse, t, s, 1, vs, &g_t, &g_s);
          if (dks && g_s != 0.0)
            axpy(dks, g_s * ss, qs, ds);
          if (dkt && g_t != 0.0)
            axpy(dkt, g_t * st, qt, dt);
        }
      }
    }
  }
  free(rows);
  refkl_kept_free(&km);
  free(vis);
  return ok ? 0 : -1;
}

double refkl_loss(const refkl_args *args, const double *w) {
  const int64_t T = refkl_layout_rows(args->layout);
  if (T < 0)
    return NAN;
  double *kl = malloc((size_t)(T * args->H + 1) * sizeof *kl);
  if (!kl)
    return NAN;
  refkl_args a = *args;
  a.dkl = NULL;
  refkl_out o;
  memset(&o, 0, sizeof o);
  o.kl = kl;
  double L = NAN;
  if (refkl_run(&a, &o) == 0) {
    L = 0.0;
    for (int64_t x = 0; x < T * args->H; x++)
      L += w[x] * kl[x];
  }
  free(kl);
  return L;
}

/* ---- kept-set attention --------------------------------------------------- */

int refkept_run(const refkept_args *a, const refkept_out *out) {
  const int64_t H = a->H, hkv = a->hkv, d = a->d;
  int64_t T = -1;
  refkl_kept km;
  unsigned char *vis = run_masks(a->layout, a->kept, H, !(H <= 0 || hkv <= 0 || H % hkv || d <= 0), &T, &km);
  if (!vis)
    return -1;
  const int bwd = a->dout != NULL;
  const int64_t grp = H / hkv;
  double *lse = malloc((size_t)(T * H + 1) * sizeof *lse), *D = malloc((size_t)(T * H + 1) * sizeof *D);
  int ok = lse && D;
  if (ok && bwd) {
    if (out->dk)
      memset(out->dk, 0, (size_t)(T * hkv * d) * sizeof(double));
    if (out->dv)
      memset(out->dv, 0, (size_t)(T * hkv * d) * sizeof(double));
  }

  REFKL_PRAGMA(omp parallel if (ok && T * H > 1))
  {
    double *p = malloc((size_t)(T + 1) * sizeof *p), *dp = malloc((size_t)(T + 1) * sizeof *dp);
    unsigned char *m = malloc((size_t)T + 1);
    double *oi = malloc((size_t)d * sizeof *oi);
    if (!p || !dp || !m || !oi) {
      REFKL_PRAGMA(omp atomic write)
      ok = 0;
    }
    REFKL_PRAGMA(omp for schedule(dynamic, 4))
    for (int64_t x = 0; x < T * H; x++) {
      if (!p || !dp || !m || !oi)
        continue;
      const int64_t i = x / H, h = x % H, g = h / grp;
      const double *qi = a->q + x * d;
      for (int64_t j = 0; j < T; j++) {
        m[j] = vis[i * T + j] && refkl_kept_keeps(&km, h, i, j);
        p[j] = m[j] ? a->scale * dot(qi, a->k + (j * hkv + g) * d, d) : 0.0;
      }
      const double l = lse_masked(p, m, T);
      lse[x] = l;
      memset(oi, 0, (size_t)d * sizeof *oi);
      double Dx = 0.0;
      if (l != -INFINITY) {
        for (int64_t j = 0; j < T; j++)
          if (m[j]) {
            p[j] = exp(p[j] - l);
            axpy(oi, p[j], a->v + (j * hkv + g) * d, d);
          }
        if (bwd) {
          const double *doi = a->dout + x * d;
          for (int64_t j = 0; j < T; j++)
            if (m[j]) {
              dp[j] = dot(doi, a->v + (j * hkv + g) * d, d);
              Dx += p[j] * dp[j];
            }
        }
      }
      D[x] = Dx;
      if (out->o)
        memcpy(out->o + x * d, oi, (size_t)d * sizeof *oi);
      if (out->lse)
        out->lse[x] = l;
      if (bwd && out->dq) {
        double *dq = out->dq + x * d;
        memset(dq, 0, (size_t)d * sizeof *dq);
        if (l != -INFINITY)
          for (int64_t j = 0; j < T; j++)
            if (m[j])
              axpy(dq, a->scale * p[j] * (dp[j] - Dx), a->k + (j * hkv + g) * d, d);
      }
    }
    free(p);
    free(dp);
    free(m);
    free(oi);
  }

  if (ok && bwd && (out->dk || out->dv)) {
    REFKL_PRAGMA(omp parallel for schedule(dynamic, 4))
    for (int64_t j = 0; j < T; j++)
      for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / grp;
        const double *kj = a->k + (j * hkv + g) * d, *vj = a->v + (j * hkv + g) * d;
        double *dk = out->dk ? out->dk + (j * hkv + g) * d : NULL;
        double *dv = out->dv ? out->dv + (j * hkv + g) * d : NULL;
        for (int64_t i = 0; i < T; i++) {
          const int64_t x = i * H + h;
          if (!vis[i * T + j] || lse[x] == -INFINITY || !refkl_kept_keeps(&km, h, i, j))
            continue;
          const double *qi = a->q + x * d, *doi = a->dout + x * d;
          const double pij = exp(a->scale * dot(qi, kj, d) - lse[x]);
          const double dsij = pij * (dot(doi, vj, d) - D[x]);
          if (dk)
            axpy(dk, a->scale * dsij, qi, d);
          if (dv)
            axpy(dv, pij, doi, d);
        }
      }
  }
  free(lse);
  free(D);
  refkl_kept_free(&km);
  free(vis);
  return ok ? 0 : -1;
}

/* ---- StreamKL test harness ------------------------------------------------ */
/*
 * Tolerance derivation (f32 compute, u = 6e-8):
 *  - A score is a d-term dot product, scaled: its rounding error is at most
 *    gamma_d * A_j with A_j = scale/tau * sum_c |q_c k_c| (gamma_d = d u
 *    <= 7.7e-6 for d <= 128, plus 2u for the scale and 1/tau). To first
 *    order the divergence then moves by at most gamma * cond, cond being
 *    the row's condition number sum_j |d div/d t_j| A_t,j + |d div/d s_j| A_s,j
 *    computed by the reference (0 for identical distributions, ~R for mild
 *    rows, up to ~R^2 for peaked unrelated ones: that is the conditioning
 *    of the problem, not slack).
 *  - The online state sums n exp-weighted centred differences |d| <= 2R
 *    (R = the row's largest A): about sqrt(n) u 2R (<= 4e-6 R at n = 1000),
 *    plus the relative rounding of log/exp of the totals: u (1 + |kl|).
 *  So c = 1e-5 on mul (1 + R + cond) + |kl| covers both with a margin, while
 *  a key wrongly kept or dropped (weight ~1/n of the row, log-ratio O(1))
 *  moves kl by ~1e-3 for n ~ 1000. Log-sum-exps: condition <= R, so
 *  c (1 + R); outside = 1 - exp(lse_t - lse_tf) moves by at most the sum of
 *  the two lse errors: c (1 + 2R).
 *  bf16/mixed inputs: the reference sees the same rounded values and the
 *  outputs are f32, so only compute rounding counts; c = 1e-3 allows a
 *  16-bit (tensor-core) intermediate such as probabilities rounded to bf16
 *  (2^-9 relative per term, averaging over the row).
 *  - Gradients (tensor-relative, as tests/prefix_harness.c): probabilities
 *    carry relative errors ~ u sqrt(d) R from their scores, the teacher term
 *    T_j (t_j - s_j - E) loses digits to cancellation, and dk sums over up to
 *    T rows times the group's heads: 1e-4 for R <= 8 (the attention
 *    harness's bound), growing linearly with R above (peaked rows). bf16:
 *    outputs stored in bf16 (2^-9 relative) and possibly 16-bit dS: 1e-2.
 */
static double *klh_doubles(int64_t n) {
  double *p = malloc((size_t)(n + 1) * sizeof *p);
  cr_assert(p, "out of memory (%" PRId64 " doubles)", n);
  return p;
}

/* padded rows and heads (gaps everywhere) */
static forkattn_tensor klh_padded(tc_buf *b, forkattn_dtype dt, int64_t T, int64_t H, int64_t d) {
  const int64_t hs = d + 3, rs = H * hs + 5;
  cr_assert_eq(tc_buf_alloc(b, (size_t)(T * rs + 8), dt), 0);
  return tc_buf_view(b, 2, T, H, d, rs, hs);
}

/* head-major [H][T][d] with padding */
static forkattn_tensor klh_head_major(tc_buf *b, forkattn_dtype dt, int64_t T, int64_t H, int64_t d) {
  const int64_t rs = d + 2, hs = T * rs + 7;
  cr_assert_eq(tc_buf_alloc(b, (size_t)(H * hs + 4), dt), 0);
  return tc_buf_view(b, 1, T, H, d, rs, hs);
}

static forkattn_tensor klh_tensor(tc_buf *b, forkattn_dtype dt, int64_t T, int64_t H, int64_t d, int strided,
                                  int head_major) {
  if (!strided)
    return tc_buf_contiguous(b, dt, T, H, d);
  return head_major ? klh_head_major(b, dt, T, H, d) : klh_padded(b, dt, T, H, d);
}

static void klh_expect_written(const tc_buf *b, const char *label, const char *what) {
  tc_write_check w = tc_buf_check(b);
  cr_expect_eq(w.guard_bad, 0, "%s: %s: %zu guard/gap bytes overwritten (first at byte %zu)", label, what,
               w.guard_bad, w.first_guard);
  cr_expect_eq(w.unwritten, 0, "%s: %s: %zu elements never written (first: element %zu)", label, what,
               w.unwritten, w.first_unwritten);
}

static void klh_expect_unchanged(const tc_buf *b, const char *label, const char *when, const char *what) {
  if (!b->alloc)
    return;
  const size_t n = tc_buf_changed_bytes(b);
  cr_expect_eq(n, 0, "%s: %s modified %zu bytes of %s", label, when, n, what);
}

/* Per-element comparison: worst |got - want| / tol[x]. want = -inf needs
 * got = -inf exactly; anything non-finite elsewhere fails. */
static double klh_cmp(const char *label, const char *what, const float *got, int64_t gstride, const double *want,
                      int64_t wstride, const double *tol, int64_t n, int64_t H) {
  double worst = 0.0;
  int64_t wi = -1, bad = 0;
  for (int64_t x = 0; x < n; x++) {
    const double g = got[x * gstride], w = want[x * wstride];
    double r;
    if (!isfinite(w))
      r = g == w ? 0.0 : INFINITY;
    else if (!isfinite(g))
      r = INFINITY;
    else
      r = fabs(g - w) / tol[x];
    if (!(r <= 1.0))
      bad++;
    if (wi < 0 || r > worst) {
      worst = r;
      wi = x;
    }
  }
  if (wi >= 0) {
    const int ok = bad == 0;
    fprintf(stderr, "  %s %-8s worst |err|/tol=%.3e at [row %" PRId64 ", head %" PRId64 "] got=%.9g want=%.9g tol=%.2e  %s\n",
            ok ? "ok  " : "FAIL", what, worst, wi / H, wi % H, (double)got[wi * gstride], want[wi * wstride], tol[wi],
            label);
    cr_expect(ok, "%s: %s: %" PRId64 " elements out of tolerance; worst [row %" PRId64 ", head %" PRId64
              "] got %.9g want %.9g (|err|/tol %.3e)",
              label, what, bad, wi / H, wi % H, (double)got[wi * gstride], want[wi * wstride], worst);
  }
  return worst;
}

static double klh_cmp_grad(const char *label, const char *what, const forkattn_tensor *got, const double *want,
                           double tol) {
  tc_err e = tc_compare_tensor(got, want);
  char line[320];
  tc_err_format(line, sizeof line, what, &e, got->heads, got->head_dim);
  const int ok = e.nonfinite == 0 && e.rel <= tol;
  fprintf(stderr, "  %s %s  [rel <= %.1e] %s\n", ok ? "ok  " : "FAIL", line, tol, label);
  cr_expect(ok, "%s: %s relative error %.3e exceeds %.1e (%s)", label, what, e.rel, tol, line);
  return e.nonfinite ? INFINITY : e.rel;
}

static void klh_draw(tc_rng *rng, double *x, int64_t n, double amp, forkattn_dtype dt) {
  for (int64_t i = 0; i < n; i++)
    x[i] = ref_round_to_dtype(tc_uniform(rng, -amp, amp), dt);
}

forkattn_kl_options klh_options(int reverse, float tau, int tau2) {
  forkattn_kl_options o;
  forkattn_kl_options_init(&o);
  o.direction = reverse ? FORKATTN_KL_REVERSE : FORKATTN_KL_FORWARD;
  o.temperature = tau;
  o.scale_by_tau2 = tau2;
  return o;
}

void klh_run_both(klh_case c, const char *fwd_name, const char *rev_name, klh_result *rf, klh_result *rr) {
  c.name = fwd_name;
  c.opt.direction = FORKATTN_KL_FORWARD;
  klh_run(&c, rf);
  c.name = rev_name;
  c.opt.direction = FORKATTN_KL_REVERSE;
  klh_run(&c, rr);
}

void klh_run(const klh_case *c, klh_result *res) {
  const char *label = c->name;
  const int64_t T = refkl_layout_rows(&c->layout), H = c->H;
  cr_assert(T >= 0, "%s: bad layout", label);
  const forkattn_kl_options *opt = &c->opt;
  const double tau = opt->temperature, mul = opt->scale_by_tau2 ? tau * tau : 1.0;
  const int bf = c->dtype_t != FORKATTN_DTYPE_F32 || c->dtype_s != FORKATTN_DTYPE_F32;
  fprintf(stderr, "[case] %s: T=%" PRId64 " H=%" PRId64 " teacher %" PRId64 "kv d%" PRId64 " %s, student %" PRId64
          "kv d%" PRId64 " %s, %s tau=%g%s%s%s%s%s\n",
          label, T, H, c->hkv_t, c->dt, ref_dtype_name(c->dtype_t), c->hkv_s, c->ds, ref_dtype_name(c->dtype_s),
          opt->direction == FORKATTN_KL_REVERSE ? "reverse" : "forward", (double)opt->temperature,
          opt->scale_by_tau2 ? " *tau^2" : "", c->kept ? " kept" : "", c->same ? " same-tensors" : "",
          c->strided ? " strided" : "", c->teacher_grad ? " +teacher-grad" : "");
  if (c->same)
    cr_assert(c->dt == c->ds && c->hkv_t == c->hkv_s && c->dtype_t == c->dtype_s, "%s: same needs same shapes",
              label);
  if (c->noise > 0)
    cr_assert(c->dt == c->ds && c->hkv_t == c->hkv_s, "%s: noise needs same shapes", label);
  tc_rng rng = tc_rng_for(label);
  forkattn_ctx *ctx = tc_ctx_default(label);
  cr_assert(ctx, "%s: no context", label);

  /* inputs as doubles (rounded to their dtypes) */
  const int64_t nqt = T * H * c->dt, nkt = T * c->hkv_t * c->dt, nqs = T * H * c->ds, nks = T * c->hkv_s * c->ds;
  double *qt = klh_doubles(nqt), *kt = klh_doubles(nkt), *qs = klh_doubles(nqs), *ks = klh_doubles(nks);
  double *dkl = klh_doubles(T * H);
  klh_draw(&rng, qt, nqt, c->qamp_t > 0 ? c->qamp_t : 2.0, c->dtype_t);
  klh_draw(&rng, kt, nkt, 1.0, c->dtype_t);
  if (c->same) {
    memcpy(qs, qt, (size_t)nqt * sizeof *qs);
    memcpy(ks, kt, (size_t)nkt * sizeof *ks);
  } else if (c->noise > 0) {
    for (int64_t i = 0; i < nqs; i++)
      qs[i] = ref_round_to_dtype(qt[i] + tc_uniform(&rng, -c->noise, c->noise), c->dtype_s);
    for (int64_t i = 0; i < nks; i++)
      ks[i] = ref_round_to_dtype(kt[i] + tc_uniform(&rng, -c->noise, c->noise), c->dtype_s);
  } else {
    klh_draw(&rng, qs, nqs, c->qamp_s > 0 ? c->qamp_s : 2.0, c->dtype_s);
    klh_draw(&rng, ks, nks, 1.0, c->dtype_s);
  }
  float *dklf = NULL;
  tc_buf bdkl;
  dklf = tc_buf_f32(&bdkl, T * H);
  cr_assert(dklf || T * H == 0);
  for (int64_t x = 0; x < T * H; x++) {
    dklf[x] = (float)tc_uniform(&rng, -1.0, 1.0);
    dkl[x] = dklf[x];
  }

  /* library buffers */
  tc_buf bqt, bkt, bqs, bks, bkl, bst, bout, bdqs, bdks, bdqt, bdkt;
  memset(&bqs, 0, sizeof bqs);
  memset(&bks, 0, sizeof bks);
  memset(&bdqt, 0, sizeof bdqt);
  memset(&bdkt, 0, sizeof bdkt);
  forkattn_tensor tqt = klh_tensor(&bqt, c->dtype_t, T, H, c->dt, c->strided, 0);
  forkattn_tensor tkt = klh_tensor(&bkt, c->dtype_t, T, c->hkv_t, c->dt, c->strided, 1);
  forkattn_tensor tqs = tqt, tks = tkt;
  if (!c->same) {
    tqs = klh_tensor(&bqs, c->dtype_s, T, H, c->ds, c->strided, 1);
    tks = klh_tensor(&bks, c->dtype_s, T, c->hkv_s, c->ds, c->strided, 0);
  }
  ref_tensor_write(&tqt, qt);
  ref_tensor_write(&tkt, kt);
  if (!c->same) {
    ref_tensor_write(&tqs, qs);
    ref_tensor_write(&tks, ks);
  }
  float *kl = tc_buf_f32(&bkl, T * H), *stats = tc_buf_f32(&bst, T * H * FORKATTN_KL_STATS);
  float *outside = tc_buf_f32(&bout, T * H);
  cr_assert((kl && stats && outside) || T * H == 0);
  tc_buf *inputs[5] = {&bqt, &bkt, &bqs, &bks, &bdkl};
  const char *in_names[5] = {"q_t", "k_t", "q_s", "k_s", "dkl"};
  for (int i = 0; i < 5; i++)
    if (inputs[i]->alloc)
      tc_buf_snapshot(inputs[i]);
  tc_buf_poison(&bkl);
  tc_buf_poison(&bst);
  tc_buf_poison(&bout);

  double t0 = tc_now();
  forkattn_status st = forkattn_kl_fwd(ctx, &c->layout, &tqt, &tkt, &tqs, &tks, c->kept, opt, kl, stats, outside,
                                       FORKATTN_MEMORY_HOST);
  const double t_fwd = tc_now() - t0;
  cr_assert_eq(st, FORKATTN_OK, "%s: forkattn_kl_fwd returned %d (%s): %s", label, (int)st,
               forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  for (int i = 0; i < 5; i++)
    klh_expect_unchanged(inputs[i], label, "forward", in_names[i]);
  klh_expect_written(&bkl, label, "kl");
  klh_expect_written(&bst, label, "stats");
  klh_expect_written(&bout, label, "outside_mass");

  /* reference */
  double *rkl = klh_doubles(T * H), *rst = klh_doubles(4 * T * H), *rout = klh_doubles(T * H);
  double *rsc = klh_doubles(T * H), *cond = klh_doubles(T * H);
  double *rdqs = klh_doubles(nqs), *rdks = klh_doubles(nks), *rdqt = klh_doubles(nqt), *rdkt = klh_doubles(nkt);
  const double sct = opt->scale_teacher > 0 ? (double)opt->scale_teacher : 1.0 / sqrt((double)c->dt);
  const double scs = opt->scale_student > 0 ? (double)opt->scale_student : 1.0 / sqrt((double)c->ds);
  /* the library computes in f32 from the f32 scale / tau; the reference uses the
   * exact values: the difference is a relative 2u of every score, inside gamma */
  refkl_args ra = {&c->layout, c->kept, H, c->hkv_t, c->hkv_s, c->dt, c->ds, sct, scs, tau,
                   opt->direction == FORKATTN_KL_REVERSE, opt->scale_by_tau2 != 0, qt, kt, qs, ks,
                   c->no_bwd ? NULL : dkl};
  refkl_out ro = {rkl, rst, rout, rsc, cond, rdqs, rdks, rdqt, rdkt};
  t0 = tc_now();
  cr_assert_eq(refkl_run(&ra, &ro), 0, "%s: reference failed", label);
  fprintf(stderr, "[time] %s: float64 reference %.3f s\n", label, tc_now() - t0);

  /* forward comparisons */
  const double cf = c->fwd_c > 0 ? c->fwd_c : bf ? 1e-3 : 1e-5;
  double *tkl = klh_doubles(T * H), *tdiv = klh_doubles(T * H), *tlse = klh_doubles(T * H), *tout = klh_doubles(T * H);
  double rmax = 0.0, kl_min = INFINITY, kl_max = 0.0, out_max = 0.0;
  int64_t empty = 0, neg = 0, neg_at = -1;
  for (int64_t x = 0; x < T * H; x++) {
    tkl[x] = cf * (mul * (1.0 + rsc[x] + cond[x]) + fabs(rkl[x]));
    tdiv[x] = cf * (1.0 + rsc[x] + cond[x] + fabs(rst[4 * x + 2]));
    tlse[x] = cf * (1.0 + rsc[x]);
    tout[x] = cf * (1.0 + 2.0 * rsc[x]);
    rmax = fmax(rmax, rsc[x]);
    empty += rst[4 * x + 1] == -INFINITY;
    out_max = fmax(out_max, rout[x]);
    if (kl[x] < kl_min)
      kl_min = kl[x];
    kl_max = fmax(kl_max, fabs((double)kl[x]));
    if (!(kl[x] >= -1e-6)) {
      if (neg == 0)
        neg_at = x;
      neg++;
    }
  }
  cr_expect_eq(neg, 0, "%s: %" PRId64 " kl values below -1e-6 (or NaN); first at [row %" PRId64 ", head %" PRId64
               "] = %.9g", label, neg, neg_at < 0 ? 0 : neg_at / H, neg_at < 0 ? 0 : neg_at % H,
               neg_at < 0 ? 0.0 : (double)kl[neg_at]);
  double worst = 0.0;
  worst = fmax(worst, klh_cmp(label, "kl", kl, 1, rkl, 1, tkl, T * H, H));
  worst = fmax(worst, klh_cmp(label, "lse_t", stats + 0, 4, rst + 0, 4, tlse, T * H, H));
  worst = fmax(worst, klh_cmp(label, "lse_s", stats + 1, 4, rst + 1, 4, tlse, T * H, H));
  worst = fmax(worst, klh_cmp(label, "div", stats + 2, 4, rst + 2, 4, tdiv, T * H, H));
  worst = fmax(worst, klh_cmp(label, "lse_tf", stats + 3, 4, rst + 3, 4, tlse, T * H, H));
  worst = fmax(worst, klh_cmp(label, "outside", outside, 1, rout, 1, tout, T * H, H));
  fprintf(stderr, "  [info] %s: kl in [%.4g, %.4g], rscale max %.3g, %" PRId64 " (row, head) keeping nothing, "
          "outside max %.3g\n", label, kl_min, kl_max, rmax, empty, out_max);

  double grad_worst = 0.0;
  double t_bwd = 0.0;
  if (!c->no_bwd) {
    forkattn_tensor tdqs = klh_tensor(&bdqs, c->dtype_s, T, H, c->ds, c->strided, 0);
    forkattn_tensor tdks = klh_tensor(&bdks, c->dtype_s, T, c->hkv_s, c->ds, c->strided, 1);
    forkattn_tensor tdqt, tdkt;
    if (c->teacher_grad) {
      tdqt = klh_tensor(&bdqt, c->dtype_t, T, H, c->dt, c->strided, 1);
      tdkt = klh_tensor(&bdkt, c->dtype_t, T, c->hkv_t, c->dt, c->strided, 0);
      tc_buf_poison(&bdqt);
      tc_buf_poison(&bdkt);
    }
    tc_buf_poison(&bdqs);
    tc_buf_poison(&bdks);
    tc_buf_snapshot(&bst);
    tc_buf_snapshot(&bkl);
    tc_buf_snapshot(&bout);
    t0 = tc_now();
    st = forkattn_kl_bwd(ctx, &c->layout, &tqt, &tkt, &tqs, &tks, c->kept, opt, stats, dklf, &tdqs, &tdks,
                         c->teacher_grad ? &tdqt : NULL, c->teacher_grad ? &tdkt : NULL, FORKATTN_MEMORY_HOST);
    t_bwd = tc_now() - t0;
    cr_assert_eq(st, FORKATTN_OK, "%s: forkattn_kl_bwd returned %d (%s): %s", label, (int)st,
                 forkattn_status_string(st), forkattn_ctx_last_error(ctx));
    for (int i = 0; i < 5; i++)
      klh_expect_unchanged(inputs[i], label, "backward", in_names[i]);
    klh_expect_unchanged(&bst, label, "backward", "stats");
    klh_expect_unchanged(&bkl, label, "backward", "kl");
    klh_expect_unchanged(&bout, label, "backward", "outside_mass");
    klh_expect_written(&bdqs, label, "dq_s");
    klh_expect_written(&bdks, label, "dk_s");
    const double gt = c->grad_tol > 0 ? c->grad_tol
                      : bf            ? fmax(1e-2, 1e-4 * fmax(1.0, rmax / 8.0))
                                      : 1e-4 * fmax(1.0, rmax / 8.0);
    grad_worst = fmax(grad_worst, klh_cmp_grad(label, "dq_s", &tdqs, rdqs, gt));
    grad_worst = fmax(grad_worst, klh_cmp_grad(label, "dk_s", &tdks, rdks, gt));
    if (c->teacher_grad) {
      klh_expect_written(&bdqt, label, "dq_t");
      klh_expect_written(&bdkt, label, "dk_t");
      grad_worst = fmax(grad_worst, klh_cmp_grad(label, "dq_t", &tdqt, rdqt, gt));
      grad_worst = fmax(grad_worst, klh_cmp_grad(label, "dk_t", &tdkt, rdkt, gt));
      tc_buf_free(&bdqt);
      tc_buf_free(&bdkt);
    }
    tc_buf_free(&bdqs);
    tc_buf_free(&bdks);
  }
  fprintf(stderr, "[time] %s: library fwd %.4f s, bwd %.4f s\n", label, t_fwd, t_bwd);
  if (res) {
    res->kl_min = kl_min;
    res->kl_max_abs = kl_max;
    res->fwd_ratio = worst;
    res->grad_rel = grad_worst;
    res->rmax = rmax;
    res->empty_rows = empty;
    res->outside_max = out_max;
  }
  free(qt), free(kt), free(qs), free(ks), free(dkl);
  free(rkl), free(rst), free(rout), free(rsc), free(cond), free(rdqs), free(rdks), free(rdqt), free(rdkt);
  free(tkl), free(tdiv), free(tlse), free(tout);
  tc_buf_free(&bqt), tc_buf_free(&bkt), tc_buf_free(&bdkl), tc_buf_free(&bkl), tc_buf_free(&bst), tc_buf_free(&bout);
  if (bqs.alloc)
    tc_buf_free(&bqs);
  if (bks.alloc)
    tc_buf_free(&bks);
  forkattn_ctx_destroy(ctx);
}
