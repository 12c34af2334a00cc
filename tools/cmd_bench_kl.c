/* `forkattn bench kl`: StreamKL vs a materialized implementation of the same
 * loss in the same binary (full score GEMMs, row log-softmax, KL, and for the
 * backward G = dKL/ds and two more GEMMs: what a framework does without a
 * fused kernel), on one dense causal sequence. Times (median), peak memory of
 * each, and their agreement. The materialized baseline runs on the host
 * (OpenBLAS); on the GPU, bench/compare_kl.py compares with PyTorch instead,
 * and this command times StreamKL alone (--backend gpu, device memory).
 * --dtype bf16|f16 runs StreamKL on 16-bit inputs (the GPU's tensor-core
 * kernels take those); the f32 baseline and the comparison are skipped. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "json_out.h"
#include "group.h"
#include "options.h"
#include "reference.h"

typedef struct bk_opts {
  int64_t seq, heads, d, repeats;
  forkattn_backend backend;
  forkattn_dtype dtype;
  int reverse, json, no_materialized;
  double keep; /* block keep fraction of a sparse student (StreamKL only), 0 = dense */
} bk_opts;

static void bk_usage(void) {
  printf("usage: forkattn bench kl [options]\n"
         "StreamKL (forkattn_kl_fwd/bwd) vs a materialized KL (S x S score GEMMs + log-softmax +\n"
         "KL, backward by two more GEMMs) on one causal sequence, teacher and student of the\n"
         "same shape, f32 inputs, student gradients.\n"
         "  --seq S          sequence length (default 4096)\n"
         "  --heads H        query = KV heads (default 4)\n"
         "  --d D            head_dim (default 128)\n"
         "  --reverse        KL(S||T) instead of KL(T||S)\n"
         "  --keep F         sparse student: keep each 64x64 block with probability F (StreamKL only)\n"
         "  --dtype T        f32 | bf16 | f16 inputs and gradients (default f32; 16-bit: StreamKL only)\n"
         "  --backend B      auto | cpu | gpu (default auto; gpu: device memory, no materialized run)\n"
         "  --repeats N      timed runs, median reported (default 3)\n"
         "  --no-materialized  skip the baseline (it needs 3 * H * S^2 floats)\n"
         "  --json           JSON line only\n");
}

static int bk_parse(int argc, char **argv, bk_opts *o) {
  *o = (bk_opts){4096, 4, 128, 3, FORKATTN_BACKEND_AUTO, FORKATTN_DTYPE_F32, 0, 0, 0, 0.0};
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return 1;
    if (!strcmp(a, "--reverse")) o->reverse = 1;
    else if (!strcmp(a, "--json")) o->json = 1;
    else if (!strcmp(a, "--no-materialized")) o->no_materialized = 1;
    else if (!v) bad = 1;
    else if (!strcmp(a, "--seq")) bad = tool_parse_i64(v, 1, 1LL << 31, &o->seq), i++;
    else if (!strcmp(a, "--heads")) bad = tool_parse_i64(v, 1, 1024, &o->heads), i++;
    else if (!strcmp(a, "--d")) bad = tool_parse_i64(v, 1, 256, &o->d), i++;
    else if (!strcmp(a, "--repeats")) bad = tool_parse_i64(v, 1, 1000, &o->repeats), i++;
    else if (!strcmp(a, "--backend")) bad = tool_parse_backend(v, &o->backend), i++;
    else if (!strcmp(a, "--dtype")) bad = tool_parse_dtype(v, &o->dtype), i++;
    else if (!strcmp(a, "--keep")) {
      char *end;
      o->keep = strtod(v, &end);
      bad = *end || !(o->keep > 0.0 && o->keep <= 1.0);
      i++;
    } else bad = 1;
    if (bad) {
      fprintf(stderr, "forkattn bench kl: bad option or value: %s %s\n", a, v ? v : "");
      return -1;
    }
  }
  return 0;
}

static float bk_rand(unsigned long long *s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((*s >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

/* ---- materialized baseline (host) ---------------------------------------- */

typedef struct bk_mat {
  float *t, *s; /* [H, S, S]: scores, then log-probabilities */
  double bytes;
} bk_mat;

/* Row i of a causal score matrix -> log-softmax over keys 0..i. */
static void bk_log_softmax(float *row, int64_t i) {
  float m = -INFINITY;
  for (int64_t j = 0; j <= i; j++) m = fmaxf(m, row[j]);
  float l = 0.0f;
  for (int64_t j = 0; j <= i; j++) l += expf(row[j] - m);
  const float lse = m + logf(l);
  for (int64_t j = 0; j <= i; j++) row[j] -= lse;
}

static void bk_mat_fwd(const bk_opts *o, bk_mat *m, const float *qt, const float *kt, const float *qs, const float *ks,
                       float scale, float *kl) {
  const int64_t S = o->seq, H = o->heads, d = o->d;
  for (int64_t h = 0; h < H; h++) {
    float *t = m->t + h * S * S, *s = m->s + h * S * S;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)S, (int)S, (int)d, scale, qt + h * d, (int)(H * d),
                kt + h * d, (int)(H * d), 0.0f, t, (int)S);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)S, (int)S, (int)d, scale, qs + h * d, (int)(H * d),
                ks + h * d, (int)(H * d), 0.0f, s, (int)S);
  }
#pragma omp parallel for collapse(2) schedule(dynamic, 16)
  for (int64_t h = 0; h < H; h++)
    for (int64_t i = 0; i < S; i++) {
      float *lt = m->t + (h * S + i) * S, *ls = m->s + (h * S + i) * S, acc = 0.0f;
      bk_log_softmax(lt, i);
      bk_log_softmax(ls, i);
      for (int64_t j = 0; j <= i; j++)
        acc += o->reverse ? expf(ls[j]) * (ls[j] - lt[j]) : expf(lt[j]) * (lt[j] - ls[j]);
      kl[i * H + h] = acc;
    }
}

/* Student gradients of sum dkl * kl from the materialized log-probabilities. */
static void bk_mat_bwd(const bk_opts *o, bk_mat *m, const float *qs, const float *ks, float scale, const float *kl,
                       const float *dkl, float *dqs, float *dks) {
  const int64_t S = o->seq, H = o->heads, d = o->d;
#pragma omp parallel for collapse(2) schedule(dynamic, 16)
  for (int64_t h = 0; h < H; h++)
    for (int64_t i = 0; i < S; i++) {
      const float *lt = m->t + (h * S + i) * S;
      float *g = m->s + (h * S + i) * S; /* log S -> gradient, in place */
      const float up = dkl[i * H + h], k = kl[i * H + h];
      for (int64_t j = 0; j <= i; j++) {
        const float ps = expf(g[j]);
        g[j] = up * (o->reverse ? ps * ((g[j] - lt[j]) - k) : ps - expf(lt[j]));
      }
      for (int64_t j = i + 1; j < S; j++) g[j] = 0.0f;
    }
  for (int64_t h = 0; h < H; h++) {
    const float *g = m->s + h * S * S;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)S, (int)d, (int)S, scale, g, (int)S, ks + h * d,
                (int)(H * d), 0.0f, dqs + h * d, (int)(H * d));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)S, (int)d, (int)S, scale, g, (int)S, qs + h * d,
                (int)(H * d), 0.0f, dks + h * d, (int)(H * d));
  }
}

/* ---- StreamKL ---------------------------------------------------------------- */

typedef struct bk_stream {
  forkattn_ctx *ctx;
  forkattn_memory mem;
  void *qt, *kt, *qs, *ks, *dqs, *dks; /* in mem */
  float *kl, *stats, *dkl;             /* in mem */
  forkattn_prefix_layout pl;
  forkattn_layout layout;
  forkattn_kept_set kept;
  unsigned char *blocks;
  forkattn_kl_options opt;
} bk_stream;

static forkattn_tensor bk_tensor(void *p, const bk_opts *o) {
  return forkattn_tensor_contiguous(p, o->dtype, o->seq, o->heads, o->d);
}

static int bk_stream_fwd(bk_stream *b, const bk_opts *o) {
  forkattn_tensor qt = bk_tensor(b->qt, o), kt = bk_tensor(b->kt, o), qs = bk_tensor(b->qs, o), ks = bk_tensor(b->ks, o);
  return forkattn_kl_fwd(b->ctx, &b->layout, &qt, &kt, &qs, &ks, b->blocks ? &b->kept : NULL, &b->opt, b->kl,
                         b->stats, NULL, b->mem);
}

static int bk_stream_bwd(bk_stream *b, const bk_opts *o) {
  forkattn_tensor qt = bk_tensor(b->qt, o), kt = bk_tensor(b->kt, o), qs = bk_tensor(b->qs, o), ks = bk_tensor(b->ks, o);
  forkattn_tensor dqs = bk_tensor(b->dqs, o), dks = bk_tensor(b->dks, o);
  return forkattn_kl_bwd(b->ctx, &b->layout, &qt, &kt, &qs, &ks, b->blocks ? &b->kept : NULL, &b->opt, b->stats,
                         b->dkl, &dqs, &dks, NULL, NULL, b->mem);
}

static double bk_ms(double t0) { return (tool_now() - t0) * 1e3; }

static double bk_max_rel(const float *a, const float *b, int64_t n) {
  double e = 0.0, m = 0.0;
  for (int64_t i = 0; i < n; i++) {
    e = fmax(e, fabs((double)a[i] - b[i]));
    m = fmax(m, fabs((double)b[i]));
  }
  return m > 0 ? e / m : e;
}

int cmd_bench_kl(int argc, char **argv) {
  bk_opts o;
  int pr = bk_parse(argc, argv, &o);
  if (pr) {
    bk_usage();
    return pr > 0 ? 0 : 2;
  }
  const int64_t S = o.seq, H = o.heads, d = o.d, n = S * H * d, nb = (S + 63) / 64;
  const float scale = 1.0f / sqrtf((float)d);
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co);
  co.backend = o.backend;
  bk_stream b;
  memset(&b, 0, sizeof b);
  if (forkattn_ctx_create(&b.ctx, &co)) {
    fprintf(stderr, "forkattn bench kl: %s\n", forkattn_ctx_create_error());
    return 1;
  }
  const int gpu = forkattn_ctx_backend(b.ctx) == FORKATTN_BACKEND_GPU;
  b.mem = gpu ? FORKATTN_MEMORY_DEVICE : FORKATTN_MEMORY_HOST;
  if (gpu || o.dtype != FORKATTN_DTYPE_F32) o.no_materialized = 1;
  const size_t es = tool_dtype_size(o.dtype);
  float *host[6], *kl = malloc(sizeof(float) * S * H), *dkl = malloc(sizeof(float) * S * H);
  unsigned long long seed = 42;
  int fail = !kl || !dkl;
  for (int t = 0; t < 6; t++) {
    host[t] = malloc(sizeof(float) * (size_t)n);
    fail |= !host[t];
    for (int64_t i = 0; host[t] && t < 4 && i < n; i++) host[t][i] = bk_rand(&seed);
  }
  for (int64_t i = 0; dkl && i < S * H; i++) dkl[i] = 1.0f / (float)(S * H); /* the mean's gradient */
  if (o.dtype != FORKATTN_DTYPE_F32) /* 16-bit in place: the first half of each buffer */
    for (int t = 0; t < 4 && !fail; t++)
      for (int64_t i = 0; i < n; i++) {
        const float x = host[t][i];
        ((uint16_t *)host[t])[i] = o.dtype == FORKATTN_DTYPE_BF16 ? ref_float_to_bf16(x) : ref_float_to_f16(x);
      }
  if (o.keep > 0.0) {
    b.blocks = malloc((size_t)(nb * nb));
    fail |= !b.blocks;
    for (int64_t i = 0; b.blocks && i < nb * nb; i++)
      b.blocks[i] = (i / nb == i % nb) || (bk_rand(&seed) * 0.5f + 0.5f) < o.keep; /* diagonal always kept */
    b.kept = (forkattn_kept_set){1, 0, 0, NULL, NULL, b.blocks};
  }
  b.pl = (forkattn_prefix_layout){S, 0, NULL, FORKATTN_MASK_CAUSAL};
  b.layout = (forkattn_layout){&b.pl, NULL};
  forkattn_kl_options_init(&b.opt);
  b.opt.direction = o.reverse ? FORKATTN_KL_REVERSE : FORKATTN_KL_FORWARD;
  void **dst[6] = {&b.qt, &b.kt, &b.qs, &b.ks, &b.dqs, &b.dks};
  for (int t = 0; t < 6 && !fail; t++) {
    if (!gpu) *dst[t] = host[t];
    else fail |= forkattn_device_malloc(b.ctx, es * (size_t)n, dst[t]) ||
                 forkattn_memcpy(b.ctx, *dst[t], b.mem, host[t], FORKATTN_MEMORY_HOST, es * (size_t)n);
  }
  if (!fail && gpu) {
    fail |= forkattn_device_malloc(b.ctx, sizeof(float) * S * H, (void **)&b.kl) ||
            forkattn_device_malloc(b.ctx, sizeof(float) * S * H * FORKATTN_KL_STATS, (void **)&b.stats) ||
            forkattn_device_malloc(b.ctx, sizeof(float) * S * H, (void **)&b.dkl) ||
            forkattn_memcpy(b.ctx, b.dkl, b.mem, dkl, FORKATTN_MEMORY_HOST, sizeof(float) * S * H);
  } else if (!fail) {
    b.kl = malloc(sizeof(float) * S * H);
    b.stats = malloc(sizeof(float) * S * H * FORKATTN_KL_STATS);
    b.dkl = dkl;
    fail |= !b.kl || !b.stats;
  }
  double sf[64], sb[64], mf[64], mb[64];
  const int reps = (int)(o.repeats < 64 ? o.repeats : 64);
  for (int r = -1; r < reps && !fail; r++) { /* r = -1: warm-up */
    double t0 = tool_now();
    fail |= bk_stream_fwd(&b, &o) != FORKATTN_OK;
    if (r >= 0) sf[r] = bk_ms(t0);
    t0 = tool_now();
    fail |= bk_stream_bwd(&b, &o) != FORKATTN_OK;
    if (r >= 0) sb[r] = bk_ms(t0);
  }
  if (fail) fprintf(stderr, "forkattn bench kl: StreamKL failed: %s\n", forkattn_ctx_last_error(b.ctx));
  const double stream_bytes = (double)forkattn_ctx_peak_workspace(b.ctx) + sizeof(float) * S * H * (2 + FORKATTN_KL_STATS);
  if (!fail) {
    fail |= forkattn_memcpy(b.ctx, kl, FORKATTN_MEMORY_HOST, b.kl, b.mem, sizeof(float) * S * H) ||
            forkattn_memcpy(b.ctx, host[4], FORKATTN_MEMORY_HOST, b.dqs, b.mem, es * (size_t)n) ||
            forkattn_memcpy(b.ctx, host[5], FORKATTN_MEMORY_HOST, b.dks, b.mem, es * (size_t)n);
  }
  /* materialized baseline */
  int have_mat = !fail && !o.no_materialized && o.keep == 0.0;
  double err_kl = 0, err_dq = 0, err_dk = 0, mat_bytes = 0;
  if (have_mat) {
    bk_mat m = {malloc(sizeof(float) * (size_t)(H * S * S)), malloc(sizeof(float) * (size_t)(H * S * S)), 0};
    float *mkl = malloc(sizeof(float) * S * H), *mdq = malloc(sizeof(float) * n), *mdk = malloc(sizeof(float) * n);
    have_mat = m.t && m.s && mkl && mdq && mdk;
    if (!have_mat) fprintf(stderr, "forkattn bench kl: materialized baseline does not fit (%.1f GiB)\n",
                           2.0 * H * S * S * 4 / 1073741824.0);
    mat_bytes = sizeof(float) * (2.0 * H * S * S + S * H + 2.0 * n);
    for (int r = -1; r < reps && have_mat; r++) {
      double t0 = tool_now();
      bk_mat_fwd(&o, &m, host[0], host[1], host[2], host[3], scale, mkl);
      if (r >= 0) mf[r] = bk_ms(t0);
      t0 = tool_now();
      bk_mat_bwd(&o, &m, host[2], host[3], scale, mkl, dkl, mdq, mdk);
      if (r >= 0) mb[r] = bk_ms(t0);
    }
    if (have_mat) {
      err_kl = bk_max_rel(kl, mkl, S * H);
      err_dq = bk_max_rel(host[4], mdq, n);
      err_dk = bk_max_rel(host[5], mdk, n);
    }
    free(m.t); free(m.s); free(mkl); free(mdq); free(mdk);
  }
  if (!fail) {
    const double f = tool_median(sf, reps), bw = tool_median(sb, reps);
    const double mfw = have_mat ? tool_median(mf, reps) : 0, mbw = have_mat ? tool_median(mb, reps) : 0;
    const char *be = forkattn_backend_name(forkattn_ctx_backend(b.ctx));
    if (!o.json) {
      printf("forkattn bench kl: S=%lld heads %lld d=%lld %s causal %s%s, backend %s, median of %d\n", (long long)S,
             (long long)H, (long long)d, tool_dtype_name(o.dtype), o.reverse ? "KL(S||T)" : "KL(T||S)", o.keep > 0 ? ", sparse student" : "",
             be, reps);
      printf("%-13s %10s %10s %12s\n", "", "fwd ms", "bwd ms", "peak MiB");
      printf("%-13s %10.2f %10.2f %12.2f\n", "StreamKL", f, bw, stream_bytes / 1048576.0);
      if (have_mat) {
        printf("%-13s %10.2f %10.2f %12.2f\n", "materialized", mfw, mbw, mat_bytes / 1048576.0);
        printf("StreamKL speedup: fwd %.2fx, bwd %.2fx; memory %.0fx less; max rel error kl %.1e dq_s %.1e dk_s %.1e\n",
               mfw / f, mbw / bw, mat_bytes / stream_bytes, err_kl, err_dq, err_dk);
      }
    }
    tool_json_printf("{\"bench\":\"kl\",\"backend\":\"%s\",\"dtype\":\"%s\",\"seq\":%lld,\"heads\":%lld,\"d\":%lld,\"reverse\":%d,\"keep\":%.3f,"
           "\"stream_fwd_ms\":%.3f,\"stream_bwd_ms\":%.3f,\"stream_mib\":%.3f,\"mat_fwd_ms\":%.3f,\"mat_bwd_ms\":%.3f,"
           "\"mat_mib\":%.3f,\"err_kl\":%.2e,\"err_dq\":%.2e,\"err_dk\":%.2e}\n",
           be, tool_dtype_name(o.dtype), (long long)S, (long long)H, (long long)d, o.reverse, o.keep, f, bw, stream_bytes / 1048576.0, mfw, mbw,
           mat_bytes / 1048576.0, err_kl, err_dq, err_dk);
  }
  if (gpu) {
    for (int t = 0; t < 6; t++) forkattn_device_free(b.ctx, *dst[t]);
    forkattn_device_free(b.ctx, b.kl);
    forkattn_device_free(b.ctx, b.stats);
    forkattn_device_free(b.ctx, b.dkl);
  } else {
    free(b.kl);
    free(b.stats);
  }
  for (int t = 0; t < 6; t++) free(host[t]);
  free(kl); free(dkl); free(b.blocks);
  forkattn_ctx_destroy(b.ctx);
  return fail ? 1 : 0;
}
