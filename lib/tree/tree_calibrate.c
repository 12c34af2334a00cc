/* Calibration of the tree cost model: time forward + backward tree attention
 * on a few shapes whose (M, T, pairs) mixes differ, and fit the three
 * coefficients by non-negative least squares on relative errors. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "dtype_convert.h"
#include "tree_model.h"
#include "validate.h"

#define FA_CAL_SHAPES 6
#define FA_CAL_REPS 5

/* Shapes at heads_q * head_dim = 256 take 5-30 ms per fwd + bwd on 2 cores
 * (under a second in all); sizes scale with 256 / (heads_q * head_dim). */
typedef enum { FA_SEQ, FA_CHAIN, FA_BINARY, FA_STAR, FA_FOREST, FA_TRIE } fa_shape_kind;

/* Nodes of a shape at size factor f (arrays NULL: count only). */
static int64_t fa_cal_shape(fa_shape_kind kind, double f, int64_t *off, int64_t *par) {
  int64_t n = 0;
#define FA_ADD(p, len) \
  do {                 \
    if (off) {         \
      par[n] = (p);    \
      off[n + 1] = off[n] + (len); \
    }                  \
    n++;               \
  } while (0)
  if (off) off[0] = 0;
  const int64_t s = (int64_t)fmax(1.0, f * 512);
  switch (kind) {
    case FA_SEQ: /* mac-heavy: one long sequence */
      FA_ADD(-1, (int64_t)fmax(16.0, 1200 * sqrt(f)));
      break;
    case FA_CHAIN: /* 1-token nodes, one merged key segment: rows and pairs, few macs each */
      for (int64_t i = 0; i < 2 * s; i++) FA_ADD(i - 1, 1);
      break;
    case FA_BINARY: /* complete binary tree of 1-token nodes: pair-heavy */
      for (int64_t i = 0; i < 2 * s - 1; i++) FA_ADD(i ? (i - 1) / 2 : -1, 1);
      break;
    case FA_STAR: /* a prompt and many 1-token answers */
      FA_ADD(-1, s / 2 + 1);
      for (int64_t i = 0; i < s; i++) FA_ADD(0, 1);
      break;
    case FA_FOREST: /* many short independent sequences: row-heavy */
      for (int64_t i = 0; i < s; i++) FA_ADD(-1, 8);
      break;
    case FA_TRIE: { /* a small RL trie: prompt, branches of mixed lengths */
      FA_ADD(-1, s);
      uint64_t x = 0x9E3779B97F4A7C15u;
      for (int64_t i = 1; i < 24; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        FA_ADD((int64_t)(x % (uint64_t)i), 1 + (int64_t)((x >> 20) % (uint64_t)(s / 4 + 1)));
      }
      break;
    }
  }
#undef FA_ADD
  return n;
}

static void fa_fill_random(void *buf, forkattn_dtype dt, int64_t count, uint64_t *state) {
  for (int64_t i = 0; i < count; i++) {
    uint64_t x = *state;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    *state = x;
    const float v = (float)((double)(x >> 11) * 0x1.0p-53 * 2.0 - 1.0); /* U[-1, 1), never all zeros */
    if (dt == FORKATTN_DTYPE_F32)
      ((float *)buf)[i] = v;
    else
      ((uint16_t *)buf)[i] = dt == FORKATTN_DTYPE_BF16 ? fa_f32_to_bf16(v) : fa_f32_to_f16(v);
  }
}

/* Solve the k x k system a x = b in place (partial pivoting); -1 if singular. */
static int fa_solve(int k, double a[3][3], double b[3]) {
  for (int c = 0; c < k; c++) {
    int piv = c;
    for (int r = c + 1; r < k; r++)
      if (fabs(a[r][c]) > fabs(a[piv][c])) piv = r;
    if (fabs(a[piv][c]) < 1e-12) return -1;
    for (int j = 0; j < k; j++) {
      const double t = a[c][j];
      a[c][j] = a[piv][j], a[piv][j] = t;
    }
    const double t = b[c];
    b[c] = b[piv], b[piv] = t;
    for (int r = 0; r < k; r++) {
      if (r == c) continue;
      const double f = a[r][c] / a[c][c];
      for (int j = c; j < k; j++) a[r][j] -= f * a[c][j];
      b[r] -= f * b[c];
    }
  }
  for (int c = 0; c < k; c++) b[c] /= a[c][c];
  return 0;
}

/* min sum_i ((x_i . coef - y_i) / y_i)^2 with coef >= 0: the unconstrained
 * fit of every subset of the columns, the best that comes out non-negative
 * (exact NNLS for 3 unknowns). Columns are scaled to unit norm first. */
static void fa_fit_nnls3(int m, double x[][3], const double *y, double coef[3]) {
  double a[FA_CAL_SHAPES][3], norm[3] = {0, 0, 0}, best = INFINITY;
  for (int i = 0; i < m; i++)
    for (int j = 0; j < 3; j++) a[i][j] = x[i][j] / y[i], norm[j] += a[i][j] * a[i][j];
  for (int j = 0; j < 3; j++) norm[j] = norm[j] > 0 ? sqrt(norm[j]) : 1;
  coef[0] = coef[1] = coef[2] = 0;
  for (int mask = 1; mask < 8; mask++) {
    int col[3], k = 0;
    for (int j = 0; j < 3; j++)
      if (mask >> j & 1) col[k++] = j;
    double g[3][3] = {{0}}, h[3] = {0};
    for (int i = 0; i < m; i++)
      for (int p = 0; p < k; p++) {
        h[p] += a[i][col[p]] / norm[col[p]];
        for (int q = 0; q < k; q++) g[p][q] += a[i][col[p]] / norm[col[p]] * a[i][col[q]] / norm[col[q]];
      }
    if (fa_solve(k, g, h)) continue;
    double c[3] = {0, 0, 0}, res = 0;
    int neg = 0;
    for (int p = 0; p < k; p++) neg |= h[p] < 0, c[col[p]] = h[p] / norm[col[p]];
    if (neg) continue;
    for (int i = 0; i < m; i++) {
      const double r = a[i][0] * c[0] + a[i][1] * c[1] + a[i][2] * c[2] - 1;
      res += r * r;
    }
    if (res < best) best = res, memcpy(coef, c, sizeof c);
  }
}

static int fa_cmp_time(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

forkattn_status forkattn_tree_cost_model_calibrate(forkattn_ctx *ctx, int64_t heads_q, int64_t heads_kv,
                                                   int64_t head_dim, forkattn_dtype dtype,
                                                   forkattn_tree_cost_model *model) {
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!ctx) return bad;
  fa_clear_error(ctx);
  if (heads_q < 1) return fa_fail(ctx, bad, "calibrate: heads_q %lld must be >= 1", (long long)heads_q);
  if (heads_kv < 1 || heads_q % heads_kv)
    return fa_fail(ctx, bad, "calibrate: heads_kv %lld must be >= 1 and divide heads_q %lld", (long long)heads_kv,
                   (long long)heads_q);
  if (head_dim < 1 || head_dim > FA_MAX_HEAD_DIM)
    return fa_fail(ctx, bad, "calibrate: head_dim %lld must be in 1..%d", (long long)head_dim, FA_MAX_HEAD_DIM);
  if (dtype != FORKATTN_DTYPE_F32 && dtype != FORKATTN_DTYPE_BF16 && dtype != FORKATTN_DTYPE_F16)
    return fa_fail(ctx, bad, "calibrate: dtype %d is not a forkattn_dtype", (int)dtype);
  if (!model) return fa_fail(ctx, bad, "calibrate: model is NULL");
  int64_t width; /* heads_q x head_dim: one query row's elements */
  if (__builtin_mul_overflow(heads_q, head_dim, &width))
    return fa_fail(ctx, bad, "calibrate: heads_q %lld x head_dim %lld overflows int64", (long long)heads_q,
                   (long long)head_dim);

  const double f = fmin(4.0, fmax(1.0 / 16, 256.0 / (double)width));
  int64_t maxn = 0, maxrows = 0;
  for (int s = 0; s < FA_CAL_SHAPES; s++) {
    const int64_t n = fa_cal_shape((fa_shape_kind)s, f, NULL, NULL);
    maxn = n > maxn ? n : maxn;
  }
  const size_t es = dtype == FORKATTN_DTYPE_F32 ? 4 : 2;
  int64_t *off = fa_malloc(sizeof *off * (size_t)(maxn + 1)), *par = fa_malloc(sizeof *par * (size_t)maxn);
  int64_t *work = fa_malloc(sizeof *work * (size_t)FA_TREE_COUNT_WORK(maxn));
  void *buf = NULL;
  float *lse = NULL;
  forkattn_status st = FORKATTN_OK;
  if (!off || !par || !work) goto oom;
  for (int s = 0; s < FA_CAL_SHAPES; s++) {
    const int64_t n = fa_cal_shape((fa_shape_kind)s, f, off, par);
    maxrows = off[n] > maxrows ? off[n] : maxrows;
  }
  /* q o dout dq: [T, hq, d]; k v dk dv: [T, hkv, d]. Huge heads make these sizes
   * unrepresentable: that is a bad argument, not a failed allocation. */
  int64_t qe, ke, lse_n, both;
  size_t bytes;
  if (__builtin_mul_overflow(maxrows, width, &qe) || __builtin_mul_overflow(maxrows, heads_kv * head_dim, &ke) ||
      __builtin_mul_overflow(maxrows, heads_q, &lse_n) || __builtin_add_overflow(qe, ke, &both) ||
      __builtin_mul_overflow((size_t)both, 4 * es, &bytes)) {
    fa_free(off), fa_free(par), fa_free(work);
    return fa_fail(ctx, bad, "calibrate: buffers of %lld rows x heads_q %lld x head_dim %lld overflow the address space",
                   (long long)maxrows, (long long)heads_q, (long long)head_dim);
  }
  buf = fa_malloc(bytes);
  lse = fa_malloc_array(lse_n, sizeof *lse);
  if (!buf || !lse) goto oom;
  char *p = buf;
  void *q = p, *o = p + es * (size_t)qe, *dout = p + 2 * es * (size_t)qe, *dq = p + 3 * es * (size_t)qe;
  void *k = p + 4 * es * (size_t)qe, *v = (char *)k + es * (size_t)ke, *dk = (char *)k + 2 * es * (size_t)ke,
       *dv = (char *)k + 3 * es * (size_t)ke;
  uint64_t rng = 0x2545F4914F6CDD1Du;
  fa_fill_random(q, dtype, qe, &rng);
  fa_fill_random(dout, dtype, qe, &rng);
  fa_fill_random(k, dtype, ke, &rng);
  fa_fill_random(v, dtype, ke, &rng);
  const float scale = (float)(1.0 / sqrt((double)head_dim));
  double x[FA_CAL_SHAPES][3], y[FA_CAL_SHAPES];
  for (int s = 0; s < FA_CAL_SHAPES; s++) {
    const int64_t n = fa_cal_shape((fa_shape_kind)s, f, off, par), T = off[n];
    const forkattn_tree_layout lay = {n, off, par};
    const forkattn_tensor tq = forkattn_tensor_contiguous(q, dtype, T, heads_q, head_dim);
    const forkattn_tensor to = forkattn_tensor_contiguous(o, dtype, T, heads_q, head_dim);
    const forkattn_tensor tdo = forkattn_tensor_contiguous(dout, dtype, T, heads_q, head_dim);
    const forkattn_tensor tdq = forkattn_tensor_contiguous(dq, dtype, T, heads_q, head_dim);
    const forkattn_tensor tk = forkattn_tensor_contiguous(k, dtype, T, heads_kv, head_dim);
    const forkattn_tensor tv = forkattn_tensor_contiguous(v, dtype, T, heads_kv, head_dim);
    const forkattn_tensor tdk = forkattn_tensor_contiguous(dk, dtype, T, heads_kv, head_dim);
    const forkattn_tensor tdv = forkattn_tensor_contiguous(dv, dtype, T, heads_kv, head_dim);
    double t[FA_CAL_REPS + 1];
    for (int r = 0; r <= FA_CAL_REPS; r++) { /* run 0 warms caches and threads */
      const double t0 = omp_get_wtime();
      st = forkattn_tree_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, scale, FORKATTN_MEMORY_HOST);
      if (!st)
        st = forkattn_tree_bwd(ctx, &lay, &tq, &tk, &tv, &to, &tdo, lse, &tdq, &tdk, &tdv, scale,
                               FORKATTN_MEMORY_HOST);
      if (st) goto out;
      t[r] = omp_get_wtime() - t0;
    }
    qsort(t + 1, FA_CAL_REPS, sizeof *t, fa_cmp_time);
    y[s] = fmax(t[1 + FA_CAL_REPS / 2], 1e-9);
    fa_tree_counts c;
    fa_tree_count(n, off, par, work, &c, NULL, NULL);
    x[s][0] = (double)width * c.macs;
    x[s][1] = (double)heads_q * (double)c.rows;
    x[s][2] = (double)c.pairs;
  }
  double coef[3];
  fa_fit_nnls3(FA_CAL_SHAPES, x, y, coef);
  *model = (forkattn_tree_cost_model){heads_q, head_dim, coef[0], coef[1], coef[2]};
out:
  fa_free(off), fa_free(par), fa_free(work), fa_free(buf), fa_free(lse);
  return st;
oom:
  fa_free(off), fa_free(par), fa_free(work), fa_free(buf), fa_free(lse);
  return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "calibrate: out of memory");
}
