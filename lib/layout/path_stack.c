/* DFS path stack: the KV of the active root-to-node path, with per-row dK/dV
 * accumulators. The top node's queries attend through the segment-attention
 * primitive with queries in their own row space: one causal pair over the
 * whole stack, query row 0 placed at the top node's first stack row (qshift),
 * so ancestors are fully visible and the node itself causally. */
#include <stdint.h>
#include <string.h>

#include "alloc.h"
#include "dtype_convert.h"
#include "segment_attn.h"
#include "validate.h"

struct forkattn_path {
  forkattn_ctx *ctx;
  forkattn_dtype dtype;
  int64_t hq, hkv, d;
  int64_t depth, rows, cap_nodes, cap_rows;
  int64_t *node_start;   /* [cap_nodes + 1]: first stack row of each node, then rows */
  void *k, *v;           /* [cap_rows, hkv, d] in dtype */
  float *dk, *dv;        /* [cap_rows, hkv, d] accumulators */
  float *gk, *gv;        /* [cap_rows, hkv, d] one backward's contribution */
  size_t bytes, peak;
};

static void fa_path_free_rows(forkattn_path *p) {
  fa_free(p->k);
  fa_free(p->v);
  fa_free(p->dk);
  fa_free(p->dv);
  fa_free(p->gk);
  fa_free(p->gv);
}

/* Bytes of the six row arrays for cap rows (K, V in dtype; four f32 accumulators);
 * 0 when that overflows size_t. */
static size_t fa_path_rows_bytes(const forkattn_path *p, int64_t cap) {
  size_t elems, kv, acc, total;
  if (__builtin_mul_overflow((size_t)(p->hkv * p->d), (size_t)cap, &elems) ||
      __builtin_mul_overflow(elems, fa_esize(p->dtype), &kv) ||
      __builtin_mul_overflow(elems, sizeof(float), &acc) || __builtin_mul_overflow(kv, (size_t)2, &kv) ||
      __builtin_mul_overflow(acc, (size_t)4, &acc) || __builtin_add_overflow(kv, acc, &total))
    return 0;
  return total;
}

/* Room for `rows` stack rows and one more node: grow by doubling, keeping contents.
 * Every size is checked: a node of 2^61 rows must be refused here, before push
 * reads a byte of it, not wrap to a tiny allocation. */
static forkattn_status fa_path_reserve(forkattn_path *p, int64_t rows) {
  if (p->depth + 1 >= p->cap_nodes) {
    int64_t cap;
    if (__builtin_mul_overflow(p->cap_nodes, (int64_t)2, &cap))
      return fa_fail(p->ctx, FORKATTN_ERR_INVALID_ARGUMENT, "path: the node count overflows int64");
    int64_t *ns = fa_malloc_array(cap + 1, sizeof *ns);
    if (!ns) return fa_fail(p->ctx, FORKATTN_ERR_OUT_OF_MEMORY, "path: cannot grow the node stack");
    memcpy(ns, p->node_start, sizeof *ns * (size_t)(p->depth + 1));
    fa_free(p->node_start);
    p->node_start = ns;
    p->cap_nodes = cap;
  }
  if (rows <= p->cap_rows) return FORKATTN_OK;
  int64_t cap = p->cap_rows ? p->cap_rows : 64;
  while (cap < rows) cap = cap > INT64_MAX / 2 ? rows : 2 * cap;
  if (!fa_path_rows_bytes(p, cap)) cap = rows; /* doubling past size_t: try the exact size */
  const size_t row_bytes = fa_path_rows_bytes(p, cap);
  size_t bytes;
  if (!row_bytes || __builtin_add_overflow(row_bytes, sizeof(int64_t) * (size_t)(p->cap_nodes + 1), &bytes))
    return fa_fail(p->ctx, FORKATTN_ERR_INVALID_ARGUMENT,
                   "path: a stack of %lld rows x %lld kv heads x %lld dims does not fit in the address space",
                   (long long)rows, (long long)p->hkv, (long long)p->d);
  const size_t w = (size_t)(p->hkv * p->d), es = fa_esize(p->dtype);
  /* each array's size is below row_bytes, so these products cannot overflow */
  forkattn_path n = *p;
  n.k = fa_malloc(w * es * (size_t)cap);
  n.v = fa_malloc(w * es * (size_t)cap);
  n.dk = fa_malloc(w * sizeof(float) * (size_t)cap);
  n.dv = fa_malloc(w * sizeof(float) * (size_t)cap);
  n.gk = fa_malloc(w * sizeof(float) * (size_t)cap);
  n.gv = fa_malloc(w * sizeof(float) * (size_t)cap);
  if (!n.k || !n.v || !n.dk || !n.dv || !n.gk || !n.gv) {
    fa_path_free_rows(&n);
    return fa_fail(p->ctx, FORKATTN_ERR_OUT_OF_MEMORY, "path: cannot grow the stack to %lld rows",
                   (long long)cap);
  }
  if (p->rows) {
    memcpy(n.k, p->k, w * es * (size_t)p->rows);
    memcpy(n.v, p->v, w * es * (size_t)p->rows);
    memcpy(n.dk, p->dk, w * sizeof(float) * (size_t)p->rows);
    memcpy(n.dv, p->dv, w * sizeof(float) * (size_t)p->rows);
  }
  fa_path_free_rows(p);
  p->k = n.k, p->v = n.v, p->dk = n.dk, p->dv = n.dv, p->gk = n.gk, p->gv = n.gv;
  p->cap_rows = cap;
  p->bytes = bytes;
  if (p->bytes > p->peak) p->peak = p->bytes;
  return FORKATTN_OK;
}

forkattn_status forkattn_path_create(forkattn_ctx *ctx, forkattn_dtype dtype, int64_t heads_q,
                                     int64_t heads_kv, int64_t head_dim, forkattn_path **path) {
  if (!ctx) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(ctx);
  const forkattn_status bad = FORKATTN_ERR_INVALID_ARGUMENT;
  if (!path) return fa_fail(ctx, bad, "path: output pointer is NULL");
  *path = NULL;
  if (dtype != FORKATTN_DTYPE_F32 && dtype != FORKATTN_DTYPE_BF16 && dtype != FORKATTN_DTYPE_F16)
    return fa_fail(ctx, bad, "path: unknown dtype %d", (int)dtype);
  if (heads_q <= 0 || heads_kv <= 0 || heads_q % heads_kv)
    return fa_fail(ctx, bad, "path: heads_q %lld must be a positive multiple of heads_kv %lld",
                   (long long)heads_q, (long long)heads_kv);
  if (head_dim <= 0 || head_dim > FA_MAX_HEAD_DIM)
    return fa_fail(ctx, bad, "path: head_dim %lld outside the supported 1..%d", (long long)head_dim,
                   FA_MAX_HEAD_DIM);
  int64_t row_elems; /* heads_q >= heads_kv: this bounds both row widths */
  if (__builtin_mul_overflow(heads_q, head_dim, &row_elems))
    return fa_fail(ctx, bad, "path: heads_q %lld x head_dim %lld overflows int64", (long long)heads_q,
                   (long long)head_dim);
  forkattn_path *p = fa_calloc(1, sizeof *p);
  if (!p) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "path: cannot allocate the stack");
  *p = (forkattn_path){.ctx = ctx, .dtype = dtype, .hq = heads_q, .hkv = heads_kv, .d = head_dim,
                       .cap_nodes = 16};
  p->node_start = fa_calloc((size_t)p->cap_nodes + 1, sizeof *p->node_start);
  if (!p->node_start) {
    fa_free(p);
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "path: cannot allocate the stack");
  }
  *path = p;
  return FORKATTN_OK;
}

void forkattn_path_destroy(forkattn_path *path) {
  if (!path) return;
  fa_path_free_rows(path);
  fa_free(path->node_start);
  fa_free(path);
}

/* The stack's K or V rows [0, rows) as a tensor. */
static forkattn_tensor fa_path_tensor(const forkattn_path *p, void *data, forkattn_dtype dtype, int64_t rows) {
  return (forkattn_tensor){data, dtype, rows, p->hkv, p->d, p->hkv * p->d, p->d};
}

forkattn_status forkattn_path_push(forkattn_path *path, const forkattn_tensor *k, const forkattn_tensor *v) {
  if (!path) return FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_ctx *ctx = path->ctx;
  fa_clear_error(ctx);
  if (!k) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "k: tensor descriptor is NULL");
  if (k->rows < 1) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "k: a pushed node needs rows >= 1 (got %lld)",
                                  (long long)k->rows);
  forkattn_status st;
  if ((st = fa_check_tensor(ctx, "k", k, path->dtype, k->rows, path->hkv, path->d))) return st;
  if ((st = fa_check_tensor(ctx, "v", v, path->dtype, k->rows, path->hkv, path->d))) return st;
  int64_t rows;
  if (__builtin_add_overflow(path->rows, k->rows, &rows))
    return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "path: stack rows overflow int64");
  if ((st = fa_path_reserve(path, rows))) return st;
  const int64_t r0 = path->rows, w = path->hkv * path->d;
  forkattn_tensor sk = fa_path_tensor(path, path->k, path->dtype, rows);
  forkattn_tensor sv = fa_path_tensor(path, path->v, path->dtype, rows);
  for (int64_t r = 0; r < k->rows; r++)
    for (int64_t h = 0; h < path->hkv; h++)
      for (int64_t c = 0; c < path->d; c++) {
        const int64_t dst = (r0 + r) * sk.row_stride + h * sk.head_stride + c;
        fa_store(sk.data, (int)sk.dtype, dst, fa_load(k->data, (int)k->dtype, r * k->row_stride + h * k->head_stride + c));
        fa_store(sv.data, (int)sv.dtype, dst, fa_load(v->data, (int)v->dtype, r * v->row_stride + h * v->head_stride + c));
      }
  memset(path->dk + r0 * w, 0, sizeof(float) * (size_t)(k->rows * w));
  memset(path->dv + r0 * w, 0, sizeof(float) * (size_t)(k->rows * w));
  path->node_start[path->depth] = r0;
  path->node_start[++path->depth] = rows;
  path->rows = rows;
  return FORKATTN_OK;
}

/* Plan of the top node against the stack (queries in their own rows). */
static forkattn_status fa_path_plan(forkattn_path *p, fa_plan *plan) {
  const int64_t top0 = p->node_start[p->depth - 1], n = p->rows - top0;
  const fa_range seg[2] = {{0, n}, {0, p->rows}};
  const fa_pair pair = {0, 1, 1};
  if (fa_plan_build(plan, n, 2, seg, 1, &pair))
    return fa_fail(p->ctx, FORKATTN_ERR_OUT_OF_MEMORY, "path: cannot allocate the segment plan");
  plan->qshift = top0;
  return FORKATTN_OK;
}

/* Checks both directions share; *n = the top node's rows. */
static forkattn_status fa_path_begin(forkattn_path *p, const forkattn_tensor *q, float scale, int64_t *n) {
  forkattn_ctx *ctx = p->ctx;
  if (p->depth == 0) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "path: the stack is empty (push a node first)");
  *n = p->rows - p->node_start[p->depth - 1];
  forkattn_status st = fa_check_tensor(ctx, "q", q, p->dtype, *n, p->hq, p->d);
  return st ? st : fa_check_scale(ctx, scale);
}

forkattn_status forkattn_path_attend_fwd(forkattn_path *path, const forkattn_tensor *q,
                                         const forkattn_tensor *o, float *lse, float scale) {
  if (!path) return FORKATTN_ERR_INVALID_ARGUMENT;
  fa_clear_error(path->ctx);
  int64_t n = 0;
  forkattn_status st = fa_path_begin(path, q, scale, &n);
  if (st || (st = fa_check_tensor(path->ctx, "o", o, path->dtype, n, path->hq, path->d))) return st;
  fa_plan plan;
  if ((st = fa_path_plan(path, &plan))) return st;
  fa_attn_fwd a = {&plan, *q, fa_path_tensor(path, path->k, path->dtype, path->rows),
                   fa_path_tensor(path, path->v, path->dtype, path->rows), *o, lse, scale,
                   path->hq, path->hkv, path->d, NULL};
  st = fa_attn_fwd_run(path->ctx, &a, FORKATTN_MEMORY_HOST);
  fa_plan_free(&plan);
  return st;
}

forkattn_status forkattn_path_attend_bwd(forkattn_path *path, const forkattn_tensor *q,
                                         const forkattn_tensor *o, const forkattn_tensor *dout,
                                         const float *lse, const forkattn_tensor *dq, float scale) {
  if (!path) return FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_ctx *ctx = path->ctx;
  fa_clear_error(ctx);
  int64_t n = 0;
  forkattn_status st = fa_path_begin(path, q, scale, &n);
  if (st || (st = fa_check_tensor(ctx, "o", o, path->dtype, n, path->hq, path->d)) ||
      (st = fa_check_tensor(ctx, "dout", dout, path->dtype, n, path->hq, path->d)) ||
      (st = fa_check_tensor(ctx, "dq", dq, path->dtype, n, path->hq, path->d)))
    return st;
  if (!lse) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "lse: is NULL (the forward's log-sum-exp is required)");
  fa_plan plan;
  if ((st = fa_path_plan(path, &plan))) return st;
  /* the kernel overwrites dk/dv of every stack row: write into scratch, then add */
  fa_attn_bwd a = {&plan, *q, fa_path_tensor(path, path->k, path->dtype, path->rows),
                   fa_path_tensor(path, path->v, path->dtype, path->rows), *o, *dout, *dq,
                   fa_path_tensor(path, path->gk, FORKATTN_DTYPE_F32, path->rows),
                   fa_path_tensor(path, path->gv, FORKATTN_DTYPE_F32, path->rows), lse, scale,
                   path->hq, path->hkv, path->d, NULL};
  st = fa_attn_bwd_run(ctx, &a, FORKATTN_MEMORY_HOST);
  fa_plan_free(&plan);
  if (st) return st;
  const int64_t total = path->rows * path->hkv * path->d;
#pragma omp simd
  for (int64_t i = 0; i < total; i++) {
    path->dk[i] += path->gk[i];
    path->dv[i] += path->gv[i];
  }
  return FORKATTN_OK;
}

forkattn_status forkattn_path_pop(forkattn_path *path, const forkattn_tensor *dk, const forkattn_tensor *dv) {
  if (!path) return FORKATTN_ERR_INVALID_ARGUMENT;
  forkattn_ctx *ctx = path->ctx;
  fa_clear_error(ctx);
  if (path->depth == 0) return fa_fail(ctx, FORKATTN_ERR_INVALID_ARGUMENT, "path: pop on an empty stack");
  const int64_t r0 = path->node_start[path->depth - 1], n = path->rows - r0, w = path->hkv * path->d;
  forkattn_status st;
  if (dk && (st = fa_check_tensor(ctx, "dk", dk, path->dtype, n, path->hkv, path->d))) return st;
  if (dv && (st = fa_check_tensor(ctx, "dv", dv, path->dtype, n, path->hkv, path->d))) return st;
  const forkattn_tensor *out[2] = {dk, dv};
  const float *acc[2] = {path->dk + r0 * w, path->dv + r0 * w};
  for (int t = 0; t < 2; t++) {
    if (!out[t]) continue;
    for (int64_t r = 0; r < n; r++)
      for (int64_t h = 0; h < path->hkv; h++)
        for (int64_t c = 0; c < path->d; c++)
          fa_store(out[t]->data, (int)out[t]->dtype, r * out[t]->row_stride + h * out[t]->head_stride + c,
                   acc[t][(r * path->hkv + h) * path->d + c]);
  }
  path->rows = r0;
  path->depth--;
  return FORKATTN_OK;
}

int64_t forkattn_path_depth(const forkattn_path *path) { return path ? path->depth : 0; }

int64_t forkattn_path_rows(const forkattn_path *path) { return path ? path->rows : 0; }

size_t forkattn_path_peak_bytes(const forkattn_path *path) { return path ? path->peak : 0; }
