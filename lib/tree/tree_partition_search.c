/* Partition candidates over the leaves of a tree (see tree_partition.c):
 * (a) contiguous DFS ranges, (b) LPT, (c) local moves and swaps. */
#include <math.h>
#include <string.h>

#include "tree_partition.h"

/* ---- (a) contiguous leaf ranges ------------------------------------------ */

/* Cost of leaves [l, r), r > l. */
static double fa_range_cost(const fa_pwork *w, int64_t l, int64_t r) {
  return (w->PC[r] - w->PC[l]) - (w->PS[r] - w->PS[l + 1]);
}

/* Fewest ranges of cost <= B (a single leaf may exceed it); stops past limit.
 * The slack absorbs the rounding of prefix-sum differences, so a bound equal
 * to the whole range's cost always fits in one range. */
static int64_t fa_greedy(const fa_pwork *w, double B, int64_t limit, int64_t *starts) {
  int64_t parts = 0;
  B += 1e-12 * (w->PC[w->L] + w->PS[w->L]);
  for (int64_t l = 0; l < w->L;) {
    if (parts == limit) return limit + 1;
    int64_t r = l + 1;
    while (r < w->L && fa_range_cost(w, l, r + 1) <= B) r++;
    if (starts) starts[parts] = l;
    parts++;
    l = r;
  }
  return parts;
}

/* Max-heap of ranges by cost (ranges of one leaf are never pushed). */
static int fa_range_above(const fa_pwork *w, const fa_ranges *rg, int64_t a, int64_t b) {
  const double ca = fa_range_cost(w, rg->l[a], rg->r[a]), cb = fa_range_cost(w, rg->l[b], rg->r[b]);
  return ca > cb || (ca == cb && rg->l[a] < rg->l[b]);
}

static void fa_range_push(const fa_pwork *w, fa_ranges *rg, int64_t k) {
  if (rg->r[k] - rg->l[k] < 2) return;
  int64_t i = rg->size++;
  for (; i > 0 && fa_range_above(w, rg, k, rg->heap[(i - 1) / 2]); i = (i - 1) / 2) rg->heap[i] = rg->heap[(i - 1) / 2];
  rg->heap[i] = k;
}

static int64_t fa_range_pop(const fa_pwork *w, fa_ranges *rg) {
  const int64_t top = rg->heap[0], last = rg->heap[--rg->size];
  int64_t i = 0;
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= rg->size) break;
    if (c + 1 < rg->size && fa_range_above(w, rg, rg->heap[c + 1], rg->heap[c])) c++;
    if (!fa_range_above(w, rg, rg->heap[c], last)) break;
    rg->heap[i] = rg->heap[c];
    i = c;
  }
  if (rg->size > 0) rg->heap[i] = last;
  return top;
}

static int fa_range_first(const void *arg, int64_t a, int64_t b) {
  const int64_t *l = arg;
  return l[a] < l[b];
}

/* (a) for K < L. rg: three [K] scratch arrays. The bisection finds the least
 * bound B the greedy sweep meets with <= K ranges. Fewer ranges than parts:
 * split the costliest at its best point (cost(l, s) grows and cost(s, r)
 * shrinks with s: bisect) until K; never raises the maximum. */
void fa_contiguous(fa_pwork *w, fa_ranges *rg, int64_t *assign) {
  const int64_t L = w->L, K = w->K;
  double lo = 0, hi = fa_range_cost(w, 0, L);
  for (int64_t j = 0; j < L; j++) lo = fmax(lo, fa_range_cost(w, j, j + 1));
  lo = fmax(lo, hi / (double)K);
  if (fa_greedy(w, lo, K, NULL) <= K) hi = lo;
  for (int it = 0; it < 100 && hi - lo > 1e-12 * hi; it++) {
    const double mid = 0.5 * (lo + hi);
    if (fa_greedy(w, mid, K, NULL) <= K)
      hi = mid;
    else
      lo = mid;
  }
  int64_t p = fa_greedy(w, hi, K, rg->l);
  if (p > K) p = 1, rg->l[0] = 0; /* cannot happen (hi always fits); stay in bounds regardless */
  rg->size = 0;
  for (int64_t k = 0; k < p; k++) {
    rg->r[k] = k + 1 < p ? rg->l[k + 1] : L;
    fa_range_push(w, rg, k);
  }
  for (; p < K && rg->size > 0; p++) {
    const int64_t k = fa_range_pop(w, rg), l = rg->l[k], r = rg->r[k];
    int64_t a = l + 1, b = r - 1; /* first s in [l+1, r-1] with cost(l, s) >= cost(s, r), or r-1 */
    while (a < b) {
      const int64_t s = a + (b - a) / 2;
      if (fa_range_cost(w, l, s) >= fa_range_cost(w, s, r))
        b = s;
      else
        a = s + 1;
    }
    int64_t m = a;
    if (m > l + 1 && fmax(fa_range_cost(w, l, m - 1), fa_range_cost(w, m - 1, r)) <=
                         fmax(fa_range_cost(w, l, m), fa_range_cost(w, m, r)))
      m--;
    rg->r[k] = m;
    rg->l[p] = m, rg->r[p] = r;
    fa_range_push(w, rg, k);
    fa_range_push(w, rg, p);
  }
  for (int64_t k = 0; k < p; k++) rg->heap[k] = k;
  fa_sort_idx(rg->heap, p, fa_range_first, rg->l);
  for (int64_t k = 0; k < p; k++)
    for (int64_t j = rg->l[rg->heap[k]]; j < rg->r[rg->heap[k]]; j++) assign[j] = k;
}

/* ---- (b) LPT and (c) local moves: per-part node counters ------------------- */

/* Cost x's path adds to part p (walk up to the first node p already has). */
static double fa_add_cost(fa_pwork *w, int64_t p, int64_t x) {
  const int32_t *cnt = w->cnt + p * w->n;
  double s = 0;
  for (; x >= 0 && cnt[x] == 0; x = w->par[x], w->steps++) s += w->c[x];
  return s;
}

/* Cost part p sheds when leaf x leaves it (nodes only x uses). */
static double fa_rem_cost(fa_pwork *w, int64_t p, int64_t x) {
  const int32_t *cnt = w->cnt + p * w->n;
  double s = 0;
  for (; x >= 0 && cnt[x] == 1; x = w->par[x], w->steps++) s += w->c[x];
  return s;
}

static void fa_apply(fa_pwork *w, int64_t p, int64_t x, int32_t delta) {
  int32_t *cnt = w->cnt + p * w->n;
  for (; x >= 0; x = w->par[x], w->steps++) cnt[x] += delta;
}

/* fa_rem_cost that also stamps the nodes it would free. */
static double fa_rem_mark(fa_pwork *w, int64_t p, int64_t x, int64_t *mark, int64_t stamp) {
  const int32_t *cnt = w->cnt + p * w->n;
  double s = 0;
  for (; x >= 0 && cnt[x] == 1; x = w->par[x], w->steps++) s += w->c[x], mark[x] = stamp;
  return s;
}

/* fa_add_cost to part p once the nodes stamped by fa_rem_mark are gone
 * (a swap evaluated without touching the counters). */
static double fa_add_without(fa_pwork *w, int64_t p, int64_t x, const int64_t *mark, int64_t stamp) {
  const int32_t *cnt = w->cnt + p * w->n;
  double s = 0;
  for (; x >= 0 && (cnt[x] == 0 || mark[x] == stamp); x = w->par[x], w->steps++) s += w->c[x];
  return s;
}

static int fa_heavier_leaf(const void *arg, int64_t a, int64_t b) {
  const fa_pwork *w = arg;
  const double ca = w->C[w->leaf[a]], cb = w->C[w->leaf[b]];
  return ca > cb || (ca == cb && a < b);
}

/* Returns 0, or -1 when the step budget ran out (candidate dropped). */
int fa_lpt(fa_pwork *w, int64_t *assign) {
  const int64_t K = w->K, L = w->L;
  memset(w->cnt, 0, sizeof *w->cnt * (size_t)(K * w->n));
  for (int64_t p = 0; p < K; p++) w->load[p] = 0;
  for (int64_t j = 0; j < L; j++) w->order[j] = j;
  fa_sort_idx(w->order, L, fa_heavier_leaf, w);
  for (int64_t i = 0; i < L; i++) {
    const int64_t j = w->order[i], x = w->leaf[j];
    int64_t best = 0;
    double bv = INFINITY, ba = INFINITY;
    for (int64_t p = 0; p < K; p++, w->steps++) {
      const double a = fa_add_cost(w, p, x), v = w->load[p] + a;
      if (v < bv || (v == bv && a < ba)) best = p, bv = v, ba = a;
    }
    fa_apply(w, best, x, 1);
    w->load[best] = bv;
    assign[j] = best;
    if (w->steps > FA_STEP_BUDGET) return -1;
  }
  return 0;
}

/* Move or swap single leaves while that lowers the most loaded part without
 * raising the other part to its old load (loads sorted descending shrink
 * lexicographically: no cycles). Stops early on the step budget. */
void fa_improve(fa_pwork *w, int64_t *assign) {
  const int64_t K = w->K, L = w->L;
  const int64_t n = w->n;
  /* counters bottom-up in O(n K), not a walk per leaf (deep trees) */
  memset(w->cnt, 0, sizeof *w->cnt * (size_t)(K * n));
  for (int64_t j = 0; j < L; j++) w->cnt[assign[j] * n + w->leaf[j]] = 1;
  for (int64_t p = 0; p < K; p++) {
    int32_t *cnt = w->cnt + p * n;
    w->load[p] = 0;
    for (int64_t x = n - 1; x >= 0; x--) {
      if (w->par[x] >= 0) cnt[w->par[x]] += cnt[x];
      if (cnt[x]) w->load[p] += w->c[x];
    }
  }
  w->steps += K * n;
  for (int64_t it = 0; it < 4 * (L + K) + 16 && w->steps <= FA_STEP_BUDGET; it++) {
    int64_t p = 0;
    for (int64_t q = 1; q < K; q++)
      if (w->load[q] > w->load[p]) p = q;
    double bv = w->load[p] * (1 - 1e-12), np = 0, nq = 0;
    int64_t mj = -1, mq = -1, si = -1; /* move leaf mj to part mq; or swap mj with leaf si */
    for (int64_t j = 0; j < L && w->steps <= FA_STEP_BUDGET; j++, w->steps++) {
      if (assign[j] != p) continue;
      const double rem = fa_rem_cost(w, p, w->leaf[j]);
      for (int64_t q = 0; q < K; q++, w->steps++) {
        if (q == p) continue;
        const double a = fa_add_cost(w, q, w->leaf[j]);
        const double v = fmax(w->load[p] - rem, w->load[q] + a);
        if (v < bv) bv = v, mj = j, mq = q, np = w->load[p] - rem, nq = w->load[q] + a;
      }
    }
    if (mj < 0)
      for (int64_t j = 0; j < L && w->steps <= FA_STEP_BUDGET; j++, w->steps++) {
        if (assign[j] != p) continue;
        const int64_t xj = w->leaf[j], sj = w->sstamp++;
        const double rp = fa_rem_mark(w, p, xj, w->mark_a, sj);
        for (int64_t i = 0; i < L && w->steps <= FA_STEP_BUDGET; i++, w->steps++) {
          const int64_t q = assign[i], xi = w->leaf[i];
          if (q == p) continue;
          const int64_t si_ = w->sstamp++;
          const double ap = fa_add_without(w, p, xi, w->mark_a, sj);
          const double rq = fa_rem_mark(w, q, xi, w->mark_b, si_);
          const double aq = fa_add_without(w, q, xj, w->mark_b, si_);
          const double vp = w->load[p] - rp + ap, vq = w->load[q] - rq + aq, v = fmax(vp, vq);
          if (v < bv) bv = v, mj = j, si = i, mq = q, np = vp, nq = vq;
        }
      }
    if (mj < 0) break;
    fa_apply(w, p, w->leaf[mj], -1);
    fa_apply(w, mq, w->leaf[mj], 1);
    assign[mj] = mq;
    if (si >= 0) {
      fa_apply(w, mq, w->leaf[si], -1);
      fa_apply(w, p, w->leaf[si], 1);
      assign[si] = p;
    }
    w->load[p] = np;
    w->load[mq] = nq;
  }
}
