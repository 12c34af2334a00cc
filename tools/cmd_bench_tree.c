/* `forkattn bench tree`: one tree shape run three ways on the same data:
 * tree attention on the packed trie; every root-to-leaf path replicated as its
 * own sequence (one varlen batch, forkattn_prefix with no prompt); prompt-only
 * sharing (forkattn_prefix with the root as prompt, the rest of each path as a
 * response). Times, peak memory, forward FLOPs of the visible
 * (query, key) pairs, dedup ratio, achieved vs ideal speedup over replicated,
 * and the errors of the baselines against the tree. A table and a JSON line;
 * --sweep runs it per size or shape, --plot draws the sweep (plot.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "forkattn_experimental.h"
#include "json_out.h"
#include "options.h"
#include "plot.h"
#include "reference.h"
#include "tree_shapes.h"

typedef struct bt_opts {
  tree_shape_params shape;
  tool_shape heads; /* hq, hkv, d, dtype; rows (p) are set per execution */
  forkattn_backend backend;
  int64_t repeats;
  int json;
  int model; /* --model: calibrate the cost model, predicted vs measured, partition balance */
} bt_opts;

/* One execution: its context, its rows, and (baselines) which tree row each copies. */
typedef struct bt_exec {
  const char *name, *key;           /* table and JSON names */
  forkattn_ctx *ctx;
  tool_group g;                     /* host (and device) tensors; g.layout for forkattn_prefix */
  const forkattn_tree_layout *tree; /* set: run forkattn_tree on it instead */
  int64_t *src;                     /* baseline row -> tree row */
  unsigned char *owner;             /* 1 on the one copy of a tree row that gets its dout */
  double pairs, fwd_ms, both_ms, mem_bytes;
} bt_exec;

enum { BT_TREE, BT_PROMPT, BT_REP, BT_N };

/* ---- options ------------------------------------------------------------ */

static void bt_usage(void) {
  tree_shape_params d[3];
  for (int k = 0; k < 3; k++) {
    d[k] = (tree_shape_params){(tree_shape_kind)k, -1, -1, -1, -1, -1, -1};
    tree_shape_defaults(&d[k]);
  }
  printf("usage: forkattn bench tree [options]\n"
         "Tree attention vs the same root-to-leaf sequences replicated vs prompt-only sharing\n"
         "(forkattn_prefix, the root as prompt), forward and forward+backward, same data.\n"
         "  --shape S      rl | wide | deep (default rl)\n"
         "                   rl:   random RL trie, segments hung under random nodes until L leaves\n"
         "                   wide: prompt, ceil(sqrt(L)) branches, L leaves dealt under them\n"
         "                   deep: per turn each branch continues, or forks in 2 (p = 1/2) up to L leaves\n"
         "  --prompt P     root rows (default rl %lld, wide %lld, deep %lld)\n"
         "  --leaves L     leaves; deep: at most L (default rl %lld, wide %lld, deep %lld)\n"
         "  --min-seg A    rows of the other nodes, uniform in [A, B] (default rl %lld, wide %lld, deep %lld)\n"
         "  --max-seg B    (default rl %lld, wide %lld, deep %lld)\n"
         "  --turns T      deep: turns below the prompt (default %lld)\n"
         "  --seed S       seed of the shape and the data (default %lld)\n"
         "  --hq H         query heads (default 8)\n"
         "  --hkv H        KV heads (default 2)\n"
         "  --d D          head_dim (default 128)\n"
         "  --dtype T      f32 | bf16 | f16 (default f32)\n"
         "  --backend B    auto | cpu | gpu (default auto; FORKATTN_BACKEND overrides)\n"
         "  --repeats K    timed repetitions after one warm-up, median reported (default 3)\n"
         "  --json         the JSON line only\n"
         "  --model        also calibrate the cost model on this backend, print its prediction\n"
         "                 of the tree's fwd+bwd next to the measurement, and the imbalance of\n"
         "                 forkattn_tree_partition into 2, 3 and 4 parts\n"
         "  --sweep K=V,... one tree per value of K: prompt, leaves, min-seg, max-seg, turns, or\n"
         "                 shape (e.g. shape=rl,wide,deep; each shape's defaults for sizes not given)\n"
         "  --plot FILE    with --sweep: FILE.svg or FILE.png (gnuplot) of time and memory against K,\n"
         "                 tree vs prompt-only vs replicated, plus its data FILE.dat and script FILE.gp\n"
         "Exit status 1 when a call fails or an error exceeds 1e-4 (f32) / 2e-2 (bf16, f16).\n",
         (long long)d[0].prompt, (long long)d[1].prompt, (long long)d[2].prompt, (long long)d[0].leaves,
         (long long)d[1].leaves, (long long)d[2].leaves, (long long)d[0].min_seg, (long long)d[1].min_seg,
         (long long)d[2].min_seg, (long long)d[0].max_seg, (long long)d[1].max_seg, (long long)d[2].max_seg,
         (long long)d[2].turns, (long long)d[0].seed);
}

/* Value options: 0 parsed, -1 bad value, -2 unknown option. */
static int bt_parse_value(const char *a, const char *v, bt_opts *o) {
  tree_shape_params *p = &o->shape;
  tool_shape *s = &o->heads;
  const struct { const char *name; long long lo, hi; int64_t *dst; } ints[] = {
      {"--prompt", 1, 1 << 24, &p->prompt},   {"--leaves", 1, 1 << 16, &p->leaves},
      {"--min-seg", 1, 1 << 24, &p->min_seg}, {"--max-seg", 1, 1 << 24, &p->max_seg},
      {"--turns", 0, 64, &p->turns},          {"--seed", 0, (long long)1 << 62, &p->seed},
      {"--hq", 1, 1024, &s->hq},              {"--hkv", 1, 1024, &s->hkv},
      {"--d", 1, 256, &s->d},                 {"--repeats", 1, 100000, &o->repeats}};
  for (size_t k = 0; k < sizeof ints / sizeof *ints; k++)
    if (!strcmp(a, ints[k].name)) return tool_parse_i64(v, ints[k].lo, ints[k].hi, ints[k].dst);
  if (!strcmp(a, "--shape")) return tree_shape_parse_kind(v, &p->kind);
  if (!strcmp(a, "--dtype")) return tool_parse_dtype(v, &s->dtype);
  if (!strcmp(a, "--backend")) return tool_parse_backend(v, &o->backend);
  return -2;
}

/* argv[0] = "bench", argv[1] = "tree". 0, 1 for --help, -1 on error. */
static int bt_parse(int argc, char **argv, bt_opts *o) {
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return 1;
    if (!strcmp(a, "--model")) {
      o->model = 1;
      continue;
    }
    if (!strcmp(a, "--json")) {
      o->json = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "forkattn: option %s needs a value (or is unknown)\n", a);
      return -1;
    }
    const int bad = bt_parse_value(a, argv[i + 1], o);
    if (bad == -2) {
      fprintf(stderr, "forkattn: unknown option %s\n", a);
      return -1;
    }
    if (bad) {
      fprintf(stderr, "forkattn: bad value '%s' for %s\n", argv[i + 1], a);
      return -1;
    }
    i++;
  }
  if (o->heads.hq % o->heads.hkv) {
    fprintf(stderr, "forkattn: --hq must be a multiple of --hkv\n");
    return -1;
  }
  return 0;
}

/* The kind's defaults for the sizes not given; 0, or -1 (message printed). */
static int bt_resolve(tree_shape_params *p) {
  tree_shape_defaults(p);
  if (p->min_seg > p->max_seg) {
    fprintf(stderr, "forkattn: %s: --min-seg %lld exceeds --max-seg %lld\n", tree_shape_name(p->kind),
            (long long)p->min_seg, (long long)p->max_seg);
    return -1;
  }
  return 0;
}

/* ---- executions ----------------------------------------------------------- */

/* A packed group of `rows` rows: tool_group_shared with no responses gives the
 * allocation and seeded random q, k, v, dout (never zeros). */
static int bt_alloc(tool_group *g, const tool_shape *s, int64_t rows, uint64_t seed) {
  tool_shape a = *s;
  a.n = 0;
  a.r = 0;
  a.p = rows;
  return tool_group_shared(g, &a, seed);
}

/* Append node's rows as copies; the first copy of a node carries the dout. */
static int64_t bt_append(bt_exec *x, const tree_shape *t, int64_t node, int64_t e, unsigned char *seen) {
  for (int64_t r = t->off[node]; r < t->off[node + 1]; r++, e++) {
    x->src[e] = r;
    x->owner[e] = !seen[node];
  }
  seen[node] = 1;
  return e;
}

static void bt_copy_row(void *dst, int64_t de, const void *src, int64_t se, size_t bytes) {
  if (src) memcpy((char *)dst + (size_t)de * bytes, (const char *)src + (size_t)se * bytes, bytes);
  else memset((char *)dst + (size_t)de * bytes, 0, bytes);
}

/* Fill the baseline's q, k, v, dout from the tree's rows (dout only on owners). */
static void bt_gather(bt_exec *x, const tool_group *tree, const tool_shape *s) {
  const size_t es = tool_dtype_size(s->dtype);
  const size_t qb = (size_t)(s->hq * s->d) * es, kb = (size_t)(s->hkv * s->d) * es;
  for (int64_t e = 0; e < x->g.rows; e++) {
    const int64_t r = x->src[e];
    bt_copy_row(x->g.q, e, tree->q, r, qb);
    bt_copy_row(x->g.k, e, tree->k, r, kb);
    bt_copy_row(x->g.v, e, tree->v, r, kb);
    bt_copy_row(x->g.dout, e, x->owner[e] ? tree->dout : NULL, r, qb);
  }
}

/* Visible pairs of a causal shared-prompt layout: the prompt causally, each
 * response the prompt plus itself causally. */
static double bt_prefix_pairs(const forkattn_prefix_layout *l) {
  const double p = (double)l->prompt_len;
  double pairs = p * (p + 1) / 2;
  for (int64_t i = 0; i < l->num_responses; i++) {
    const double r = (double)(l->response_offsets[i + 1] - l->response_offsets[i]);
    pairs += r * p + r * (r + 1) / 2;
  }
  return pairs;
}

/* A baseline: one sequence per leaf, its root-to-leaf path; with share_root
 * the root is the shared prompt and each sequence is the path below it. */
static int bt_baseline(bt_exec *x, const tree_shape *t, const tool_group *tree, const tool_shape *s,
                       int share_root) {
  const int64_t nl = t->num_leaves, prompt = share_root ? tree_shape_len(t, 0) : 0;
  const int64_t rows = tree_shape_replicated_rows(t) - (share_root ? (nl - 1) * prompt : 0);
  if (bt_alloc(&x->g, s, rows, 0)) return -1;
  int64_t *off = realloc(x->g.off, sizeof(int64_t) * (size_t)(nl + 1)), *path = NULL;
  if (off) x->g.off = off;
  unsigned char *seen = calloc((size_t)t->layout.num_nodes, 1);
  x->src = malloc(sizeof(int64_t) * (size_t)rows + 1);
  x->owner = malloc((size_t)rows + 1);
  path = malloc(sizeof(int64_t) * (size_t)(t->depth + 1));
  int rc = off && seen && x->src && x->owner && path ? 0 : -1;
  if (!rc) {
    int64_t e = share_root ? bt_append(x, t, 0, 0, seen) : 0;
    off[0] = 0;
    for (int64_t i = 0; i < nl; i++) {
      const int64_t m = tree_shape_path(t, t->leaf[i], path);
      for (int64_t j = share_root; j < m; j++) e = bt_append(x, t, path[j], e, seen);
      off[i + 1] = e - prompt;
    }
    x->g.layout = (forkattn_prefix_layout){prompt, nl, off, FORKATTN_MASK_CAUSAL};
    x->pairs = bt_prefix_pairs(&x->g.layout);
    bt_gather(x, tree, s);
  }
  free(seen);
  free(path);
  return rc;
}

static forkattn_status bt_tree_run(bt_exec *x, const tool_shape *s, int bwd) {
  tool_group *g = &x->g;
  const int dev = g->dev[0] != NULL;
  void *host[8] = {g->q, g->k, g->v, g->o, g->dout, g->dq, g->dk, g->dv};
  forkattn_tensor t[8];
  for (int i = 0; i < 8; i++) {
    const int kv = i == 1 || i == 2 || i >= 6;
    t[i] = forkattn_tensor_contiguous(dev ? g->dev[i] : host[i], s->dtype, g->rows, kv ? s->hkv : s->hq, s->d);
  }
  float *lse = dev ? g->dev_lse : g->lse;
  const forkattn_memory mem = dev ? FORKATTN_MEMORY_DEVICE : FORKATTN_MEMORY_HOST;
  const float scale = 1.0f / sqrtf((float)s->d); /* the one tool_group_run uses */
  forkattn_status st = forkattn_tree_fwd(x->ctx, x->tree, &t[0], &t[1], &t[2], &t[3], lse, scale, mem);
  if (st || !bwd) return st;
  return forkattn_tree_bwd(x->ctx, x->tree, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], scale,
                           mem);
}

static forkattn_status bt_run(bt_exec *x, const tool_shape *s, int bwd) {
  return x->tree ? bt_tree_run(x, s, bwd) : tool_group_run(x->ctx, &x->g, s, bwd);
}

static int bt_fail(const bt_exec *x, const char *what) {
  fprintf(stderr, "forkattn: %s: %s failed: %s\n", x->name, what, x->ctx ? forkattn_ctx_last_error(x->ctx) : "");
  return -1;
}

/* Fresh context (so its peak workspace is this execution's), device copies on
 * the GPU backend, one warm-up, medians of fwd and fwd+bwd, results to host. */
static int bt_measure(bt_exec *x, const tool_shape *s, const bt_opts *o) {
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co);
  co.backend = o->backend;
  if (forkattn_ctx_create(&x->ctx, &co)) {
    fprintf(stderr, "forkattn: cannot create a context for backend %s: %s\n", forkattn_backend_name(o->backend),
            forkattn_ctx_create_error());
    return -1;
  }
  if (tool_group_to_device(x->ctx, &x->g, s)) return bt_fail(x, "copying to the device");
  const int n = (int)o->repeats;
  double fwd[n], both[n];
  if (bt_run(x, s, 1)) return bt_fail(x, "the warm-up");
  for (int i = 0; i < n; i++) {
    const double t0 = tool_now();
    if (bt_run(x, s, 0)) return bt_fail(x, "the forward");
    const double t1 = tool_now();
    if (bt_run(x, s, 1)) return bt_fail(x, "the forward+backward");
    fwd[i] = (t1 - t0) * 1e3;
    both[i] = (tool_now() - t1) * 1e3;
  }
  x->fwd_ms = tool_median(fwd, n);
  x->both_ms = tool_median(both, n);
  x->mem_bytes = tool_tensor_bytes(s, x->g.rows) + (double)forkattn_ctx_peak_workspace(x->ctx);
  return tool_group_fetch(x->ctx, &x->g, s) ? bt_fail(x, "copying results back") : 0;
}

static void bt_exec_free(bt_exec *x) {
  tool_group_free(x->ctx, &x->g);
  forkattn_ctx_destroy(x->ctx);
  free(x->src);
  free(x->owner);
}

/* ---- errors --------------------------------------------------------------- */

/* Worst |want - got| (NaN sticks) and largest |want|, per compared tensor. */
typedef struct bt_dev { double worst, scale; } bt_dev;

static void bt_note(bt_dev *d, double want, double got) {
  const double diff = fabs(want - got);
  if (diff > d->worst || diff != diff) d->worst = diff;
  d->scale = fmax(d->scale, fabs(want));
}

static double bt_relative(const bt_dev *d) { return d->scale > 0 ? d->worst / d->scale : d->worst; }

/* Largest of o, dq, dk, dv; NaN if any is NaN (so it fails every tolerance). */
static double bt_worst(const tool_errors *e) {
  const double v[4] = {e->o, e->dq, e->dk, e->dv};
  double m = 0;
  for (int i = 0; i < 4; i++) {
    if (v[i] != v[i]) return v[i];
    m = fmax(m, v[i]);
  }
  return m;
}

/* [rows, width] view of a host buffer for ref_tensor_get(view, row, 0, column). */
static forkattn_tensor bt_view(void *data, const tool_shape *s, int64_t rows, int64_t width) {
  return forkattn_tensor_contiguous(data, s->dtype, rows, 1, width);
}

/* Baseline x against the tree: o on every copy, dq and lse on the owner copy
 * (the others have dout 0), dk/dv summed over all copies of a row. */
static int bt_compare(const bt_exec *tree, const bt_exec *x, const tool_shape *s, tool_errors *err) {
  const int64_t T = tree->g.rows, R = x->g.rows, qw = s->hq * s->d, kw = s->hkv * s->d;
  double *sum[2] = {calloc((size_t)(T * kw) + 1, sizeof(double)), calloc((size_t)(T * kw) + 1, sizeof(double))};
  if (!sum[0] || !sum[1]) {
    free(sum[0]);
    free(sum[1]);
    return -1;
  }
  const forkattn_tensor to = bt_view(tree->g.o, s, T, qw), tdq = bt_view(tree->g.dq, s, T, qw),
                        xo = bt_view(x->g.o, s, R, qw), xdq = bt_view(x->g.dq, s, R, qw);
  const forkattn_tensor tk[2] = {bt_view(tree->g.dk, s, T, kw), bt_view(tree->g.dv, s, T, kw)},
                        xk[2] = {bt_view(x->g.dk, s, R, kw), bt_view(x->g.dv, s, R, kw)};
  bt_dev o = {0, 0}, dq = {0, 0}, lse = {0, 0}, dkv[2] = {{0, 0}, {0, 0}};
  for (int64_t e = 0; e < R; e++) {
    const int64_t r = x->src[e];
    for (int64_t c = 0; c < qw; c++) {
      bt_note(&o, ref_tensor_get(&to, r, 0, c), ref_tensor_get(&xo, e, 0, c));
      if (x->owner[e]) bt_note(&dq, ref_tensor_get(&tdq, r, 0, c), ref_tensor_get(&xdq, e, 0, c));
    }
    for (int64_t h = 0; x->owner[e] && h < s->hq; h++) bt_note(&lse, tree->g.lse[r * s->hq + h], x->g.lse[e * s->hq + h]);
    for (int j = 0; j < 2; j++)
      for (int64_t c = 0; c < kw; c++) sum[j][r * kw + c] += ref_tensor_get(&xk[j], e, 0, c);
  }
  for (int j = 0; j < 2; j++)
    for (int64_t r = 0; r < T; r++)
      for (int64_t c = 0; c < kw; c++) bt_note(&dkv[j], ref_tensor_get(&tk[j], r, 0, c), sum[j][r * kw + c]);
  *err = (tool_errors){bt_relative(&o), lse.worst, bt_relative(&dq), bt_relative(&dkv[0]), bt_relative(&dkv[1])};
  free(sum[0]);
  free(sum[1]);
  return 0;
}

/* ---- report --------------------------------------------------------------- */

static double bt_flops(const bt_exec *x, const tool_shape *s) { return 4.0 * (double)s->d * (double)s->hq * x->pairs; }

static void bt_table(const bt_exec *x, const tree_shape *t, const bt_opts *o, const char *backend,
                     const tool_errors err[BT_N], double tol, int ok) {
  const tree_shape_params *p = &o->shape;
  const tool_shape *s = &o->heads;
  const bt_exec *rep = &x[BT_REP];
  printf("forkattn bench tree: shape %s, seed %lld: %lld nodes, %lld leaves, depth %lld; prompt %lld, segments %lld..%lld",
         tree_shape_name(p->kind), (long long)p->seed, (long long)t->layout.num_nodes, (long long)t->num_leaves,
         (long long)t->depth, (long long)p->prompt, (long long)p->min_seg, (long long)p->max_seg);
  if (p->kind == TREE_SHAPE_DEEP) printf(", %lld turns", (long long)p->turns);
  printf("\n                     heads %lld/%lld, d=%lld, %s, backend %s, median of %lld after a warm-up\n",
         (long long)s->hq, (long long)s->hkv, (long long)s->d, tool_dtype_name(s->dtype), backend,
         (long long)o->repeats);
  printf("%-12s %9s %10s %10s %11s %9s %7s %7s %7s %11s\n", "execution", "rows", "GFLOP fwd", "fwd ms", "fwd+bwd ms",
         "peak MiB", "ideal", "fwd", "fwd+bwd", "% of ideal");
  for (int i = 0; i < BT_N; i++) {
    const double ideal = rep->pairs / x[i].pairs, sf = rep->fwd_ms / x[i].fwd_ms, sb = rep->both_ms / x[i].both_ms;
    printf("%-12s %9lld %10.3f %10.3f %11.3f %9.1f %6.2fx %6.2fx %6.2fx %4.0f%% %4.0f%%\n", x[i].name,
           (long long)x[i].g.rows, bt_flops(&x[i], s) * 1e-9, x[i].fwd_ms, x[i].both_ms, x[i].mem_bytes / 1048576.0,
           ideal, sf, sb, 100 * sf / ideal, 100 * sb / ideal);
  }
  printf("speedups over replicated: ideal = forward FLOPs (visible pairs) ratio; %% of ideal: fwd, fwd+bwd\n");
  printf("dedup ratio %.2f (replicated rows / tree rows); tree over prompt-only: ideal %.2fx, fwd %.2fx, fwd+bwd %.2fx\n",
         (double)rep->g.rows / (double)x[BT_TREE].g.rows, x[BT_PROMPT].pairs / x[BT_TREE].pairs,
         x[BT_PROMPT].fwd_ms / x[BT_TREE].fwd_ms, x[BT_PROMPT].both_ms / x[BT_TREE].both_ms);
  for (int i = BT_PROMPT; i < BT_N; i++)
    printf("max rel error %s vs tree: o %.1e dq %.1e dk %.1e dv %.1e (lse abs %.1e)\n", x[i].name, err[i].o,
           err[i].dq, err[i].dk, err[i].dv, err[i].lse);
  printf("check: %s (tolerance %.0e)\n", ok ? "PASSED" : "FAILED", tol);
}

static void bt_json(const bt_exec *x, const tree_shape *t, const bt_opts *o, const char *backend,
                    const tool_errors err[BT_N], int ok) {
  const tree_shape_params *p = &o->shape;
  const tool_shape *s = &o->heads;
  const bt_exec *rep = &x[BT_REP], *tr = &x[BT_TREE], *po = &x[BT_PROMPT];
  tool_json_printf("{\"bench\":\"tree\",\"shape\":\"%s\",\"seed\":%lld,\"backend\":\"%s\",\"nodes\":%lld,\"leaves\":%lld,"
         "\"depth\":%lld,\"prompt\":%lld,\"min_seg\":%lld,\"max_seg\":%lld,\"turns\":%lld,\"hq\":%lld,\"hkv\":%lld,"
         "\"d\":%lld,\"dtype\":\"%s\",\"repeats\":%lld,\"dedup_ratio\":%.4f",
         tree_shape_name(p->kind), (long long)p->seed, backend, (long long)t->layout.num_nodes,
         (long long)t->num_leaves, (long long)t->depth, (long long)p->prompt, (long long)p->min_seg,
         (long long)p->max_seg, (long long)(p->kind == TREE_SHAPE_DEEP ? p->turns : 0), (long long)s->hq,
         (long long)s->hkv, (long long)s->d, tool_dtype_name(s->dtype), (long long)o->repeats,
         (double)rep->g.rows / (double)tr->g.rows);
  for (int i = 0; i < BT_N; i++)
    tool_json_printf(",\"%s_rows\":%lld,\"%s_flops_fwd\":%.6g,\"%s_fwd_ms\":%.4f,\"%s_fwdbwd_ms\":%.4f,\"%s_mem_bytes\":%.0f",
           x[i].key, (long long)x[i].g.rows, x[i].key, bt_flops(&x[i], s), x[i].key, x[i].fwd_ms, x[i].key,
           x[i].both_ms, x[i].key, x[i].mem_bytes);
  const double ideal = rep->pairs / tr->pairs;
  tool_json_printf(",\"ideal_speedup\":%.3f,\"speedup_fwd\":%.3f,\"speedup_fwdbwd\":%.3f,\"pct_of_ideal_fwd\":%.1f,"
         "\"pct_of_ideal_fwdbwd\":%.1f,\"prompt_only_ideal_speedup\":%.3f,\"prompt_only_speedup_fwd\":%.3f,"
         "\"prompt_only_speedup_fwdbwd\":%.3f,\"max_rel_err\":%.3g,\"max_rel_err_prompt_only\":%.3g,\"passed\":%s}\n",
         ideal, rep->fwd_ms / tr->fwd_ms, rep->both_ms / tr->both_ms, 100 * rep->fwd_ms / tr->fwd_ms / ideal,
         100 * rep->both_ms / tr->both_ms / ideal, rep->pairs / po->pairs, rep->fwd_ms / po->fwd_ms,
         rep->both_ms / po->both_ms, bt_worst(&err[BT_REP]), bt_worst(&err[BT_PROMPT]),
         ok ? "true" : "false");
}

/* ---- command -------------------------------------------------------------- */

/* Build the three executions, run them, compare. 0, or -1 (message printed). */
static int bt_execute(bt_exec *x, const tree_shape *t, const bt_opts *o, tool_errors err[BT_N]) {
  const tool_shape *s = &o->heads;
  if (bt_alloc(&x[BT_TREE].g, s, tree_shape_rows(t), (uint64_t)o->shape.seed) ||
      bt_baseline(&x[BT_PROMPT], t, &x[BT_TREE].g, s, 1) || bt_baseline(&x[BT_REP], t, &x[BT_TREE].g, s, 0)) {
    fprintf(stderr, "forkattn: out of host memory building the executions\n");
    return -1;
  }
  x[BT_TREE].tree = &t->layout;
  x[BT_TREE].pairs = tree_shape_pairs(t);
  for (int i = 0; i < BT_N; i++)
    if (bt_measure(&x[i], s, o)) return -1;
  memset(&err[BT_TREE], 0, sizeof err[BT_TREE]);
  for (int i = BT_PROMPT; i < BT_N; i++)
    if (bt_compare(&x[BT_TREE], &x[i], s, &err[i])) {
      fprintf(stderr, "forkattn: out of host memory comparing gradients\n");
      return -1;
    }
  return 0;
}

/* --model: the cost model calibrated on this backend against the measured
 * tree time, and how evenly the tree splits into 2..4 parts under it. */
static int bt_model(const bt_exec *tree, const tree_shape *t, const bt_opts *o) {
  const tool_shape *s = &o->heads;
  forkattn_tree_cost_model m;
  double predicted = 0;
  if (forkattn_tree_cost_model_calibrate(tree->ctx, s->hq, s->hkv, s->d, s->dtype, &m) ||
      forkattn_tree_cost(tree->ctx, &t->layout, &m, &predicted)) {
    fprintf(stderr, "forkattn: cost model: %s\n", forkattn_ctx_last_error(tree->ctx));
    return -1;
  }
  printf("cost model (calibrated here, host memory): %.3g s/mac %.3g s/row %.3g s/pair; tree fwd+bwd predicted "
         "%.1f ms, measured %.1f ms (ratio %.2f)\n", m.sec_per_mac, m.sec_per_row, m.sec_per_pair, predicted * 1e3,
         tree->both_ms, predicted * 1e3 / tree->both_ms);
  for (int64_t parts = 2; parts <= 4; parts++) {
    forkattn_partition *pt;
    if (forkattn_tree_partition(tree->ctx, &t->layout, parts, &m, &pt)) {
      fprintf(stderr, "forkattn: partition: %s\n", forkattn_ctx_last_error(tree->ctx));
      return -1;
    }
    double worst = 0;
    for (int64_t i = 0; i < parts; i++) worst = worst > forkattn_partition_cost(pt, i) ? worst : forkattn_partition_cost(pt, i);
    printf("partition into %lld parts: imbalance (largest / mean part cost) %.3f, predicted speedup %.2fx\n",
           (long long)parts, forkattn_partition_imbalance(pt), predicted / worst);
    forkattn_partition_free(pt);
  }
  return 0;
}

/* .dat columns of a sweep point */
enum { BT_COLS = 12 };
static const char *const bt_cols[BT_COLS] = {
    "tree_fwd_ms", "tree_fwdbwd_ms", "prompt_only_fwd_ms", "prompt_only_fwdbwd_ms", "rep_fwd_ms", "rep_fwdbwd_ms",
    "tree_mib", "prompt_only_mib", "rep_mib", "ideal_speedup", "achieved_speedup", "dedup_ratio"};

/* One tree (o->shape resolved): build, run, report. row (if set) gets the .dat
 * values, backend its name. 0, 1 when a check fails, -1 when a call fails. */
static int bt_point(const bt_opts *o, double *row, char *backend_out) {
  tree_shape t;
  if (tree_shape_build(&t, &o->shape)) {
    fprintf(stderr, "forkattn: out of host memory building the tree\n");
    return -1;
  }
  bt_exec x[BT_N] = {{.name = "tree", .key = "tree"},
                     {.name = "prompt-only", .key = "prompt_only"},
                     {.name = "replicated", .key = "replicated"}};
  tool_errors err[BT_N];
  int rc = bt_execute(x, &t, o, err) ? -1 : 0;
  if (!rc) {
    const double tol = o->heads.dtype == FORKATTN_DTYPE_F32 ? 1e-4 : 2e-2;
    int ok = 1;
    for (int i = BT_PROMPT; i < BT_N; i++) ok = ok && bt_worst(&err[i]) <= tol && err[i].lse <= tol;
    const char *backend = forkattn_backend_name(forkattn_ctx_backend(x[BT_TREE].ctx));
    if (!o->json) bt_table(x, &t, o, backend, err, tol, ok);
    bt_json(x, &t, o, backend, err, ok);
    rc = ok ? 0 : 1;
    if (o->model && bt_model(&x[BT_TREE], &t, o)) rc = -1;
    fflush(stdout);
    if (row) {
      const double mib = 1.0 / 1048576.0;
      const bt_exec *tr = &x[BT_TREE], *po = &x[BT_PROMPT], *rep = &x[BT_REP];
      const double v[BT_COLS] = {tr->fwd_ms, tr->both_ms, po->fwd_ms, po->both_ms, rep->fwd_ms, rep->both_ms,
                                 tr->mem_bytes * mib, po->mem_bytes * mib, rep->mem_bytes * mib,
                                 rep->pairs / tr->pairs, rep->both_ms / tr->both_ms,
                                 (double)rep->g.rows / (double)tr->g.rows};
      memcpy(row, v, sizeof v);
      snprintf(backend_out, 16, "%s", backend);
    }
  }
  for (int i = 0; i < BT_N; i++) bt_exec_free(&x[i]);
  tree_shape_free(&t);
  return rc;
}

/* Sweepable options; the last one is categorical. */
static const char *const bt_keys[6] = {"prompt", "leaves", "min-seg", "max-seg", "turns", "shape"};
static const char *const bt_xlabels[6] = {"prompt (root) rows", "leaves L (sequences)", "min rows per segment",
                                          "max rows per segment", "turns (deep)", "tree shape"};

static int64_t *bt_field(tree_shape_params *p, int k) {
  int64_t *f[5] = {&p->prompt, &p->leaves, &p->min_seg, &p->max_seg, &p->turns};
  return f[k];
}

/* --sweep K=...: one tree per value, then (--plot) the .dat, .gp and picture. */
static int bt_sweep(const bt_opts *o, const char *arg, const char *plot) {
  tool_sweep sw;
  if (tool_sweep_parse(arg, &sw)) return 2;
  int k = 0;
  while (k < 6 && strcmp(sw.key, bt_keys[k])) k++;
  if (k == 6) {
    fprintf(stderr, "forkattn: bench tree --sweep: the key is prompt, leaves, min-seg, max-seg, turns or shape "
            "(got '%s')\n", sw.key);
    return 2;
  }
  char opt[24];
  snprintf(opt, sizeof opt, "--%s", sw.key);
  bt_opts pt[TOOL_SWEEP_MAX];
  for (int i = 0; i < sw.count; i++) { /* every point checked before any runs */
    pt[i] = *o;
    if (bt_parse_value(opt, sw.text[i], &pt[i]) || (k < 5 && *bt_field(&pt[i].shape, k) < 1)) {
      fprintf(stderr, "forkattn: bad --sweep value '%s' for %s\n", sw.text[i], sw.key);
      return 2;
    }
    if (k < 5) sw.num[i] = *bt_field(&pt[i].shape, k);
    if (bt_resolve(&pt[i].shape)) return 2;
  }
  if (plot && tool_plot_check_name(plot)) return 2;
  double rows[TOOL_SWEEP_MAX * BT_COLS];
  char backend[16] = "";
  int failed = 0;
  for (int i = 0; i < sw.count; i++) {
    const int rc = bt_point(&pt[i], rows + (size_t)i * BT_COLS, backend);
    if (rc < 0) return 1;
    failed |= rc;
  }
  if (!plot) return failed;
  /* title: the sizes not swept (shape sweep: only those given) */
  const tree_shape_params *q = k == 5 ? &o->shape : &pt[0].shape;
  tree_shape_params c = *q;
  char title[512], note[160];
  int used = snprintf(title, sizeof title, "forkattn bench tree: ");
  if (k != 5) used += snprintf(title + used, sizeof title - (size_t)used, "shape %s, ", tree_shape_name(q->kind));
  for (int j = 0; j < 5; j++)
    if (j != k && *bt_field(&c, j) >= 0 && (j < 4 || q->kind == TREE_SHAPE_DEEP || k == 5))
      used += snprintf(title + used, sizeof title - (size_t)used, "%s %lld, ", bt_keys[j], (long long)*bt_field(&c, j));
  if (q->seed >= 0) used += snprintf(title + used, sizeof title - (size_t)used, "seed %lld, ", (long long)q->seed);
  snprintf(title + used, sizeof title - (size_t)used, "heads %lld/%lld, d=%lld, %s, backend %s", (long long)o->heads.hq,
           (long long)o->heads.hkv, (long long)o->heads.d, tool_dtype_name(o->heads.dtype), backend);
  snprintf(note, sizeof note,
           "time (median of %lld): fwd+bwd solid, fwd dashed\nlabels: fwd+bwd speedup of tree over replicated",
           (long long)o->repeats);
  const tool_plot p = {plot, bt_xlabels[k], title, note, k == 5, BT_COLS, bt_cols, 3,
                       {{"tree", 0, 1, 6}, {"prompt-only", 2, 3, 7}, {"replicated", 4, 5, 8}}, 10};
  return tool_plot_write(&p, &sw, rows) ? 1 : failed;
}

int cmd_bench_tree(int argc, char **argv) {
  bt_opts o = {{TREE_SHAPE_RL, -1, -1, -1, -1, -1, -1},
               {0, 0, 0, 8, 2, 128, FORKATTN_DTYPE_F32, FORKATTN_MASK_CAUSAL},
               FORKATTN_BACKEND_AUTO, 3, 0, 0};
  const char *sweep = NULL, *plot = NULL;
  if (tool_plot_take_args(&argc, argv, 2, &sweep, &plot)) return 2;
  const int p = bt_parse(argc, argv, &o);
  if (p) {
    if (p > 0) bt_usage();
    return p > 0 ? 0 : 2;
  }
  if (plot && !sweep) {
    fprintf(stderr, "forkattn: --plot needs --sweep\n");
    return 2;
  }
  if (sweep) return bt_sweep(&o, sweep, plot);
  if (bt_resolve(&o.shape)) return 2;
  return bt_point(&o, NULL, NULL) ? 1 : 0;
}
