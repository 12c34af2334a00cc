/* Option parsing for demo and bench. */
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *tool_dtype_name(forkattn_dtype t) {
  return t == FORKATTN_DTYPE_F32 ? "f32" : t == FORKATTN_DTYPE_BF16 ? "bf16" : "f16";
}

const char *tool_mask_name(forkattn_mask m) { return m == FORKATTN_MASK_CAUSAL ? "causal" : "bidirectional"; }

int tool_parse_dtype(const char *v, forkattn_dtype *out) {
  if (!strcmp(v, "f32")) *out = FORKATTN_DTYPE_F32;
  else if (!strcmp(v, "bf16")) *out = FORKATTN_DTYPE_BF16;
  else if (!strcmp(v, "f16")) *out = FORKATTN_DTYPE_F16;
  else return -1;
  return 0;
}

int tool_parse_mask(const char *v, forkattn_mask *out) {
  if (!strcmp(v, "causal")) *out = FORKATTN_MASK_CAUSAL;
  else if (!strcmp(v, "bidirectional")) *out = FORKATTN_MASK_BIDIRECTIONAL;
  else return -1;
  return 0;
}

int tool_parse_backend(const char *v, forkattn_backend *out) {
  if (!strcmp(v, "auto")) *out = FORKATTN_BACKEND_AUTO;
  else if (!strcmp(v, "cpu")) *out = FORKATTN_BACKEND_CPU;
  else if (!strcmp(v, "gpu")) *out = FORKATTN_BACKEND_GPU;
  else return -1;
  return 0;
}

void tool_usage(const char *cmd, const tool_opts *o) {
  const tool_shape *s = &o->shape;
  printf("usage: forkattn %s [options]\n"
         "  --n N          responses (default %lld)\n"
         "  --p P          prompt rows (default %lld)\n"
         "  --r R          rows per response (default %lld)\n"
         "  --hq H         query heads (default %lld)\n"
         "  --hkv H        KV heads (default %lld)\n"
         "  --d D          head_dim (default %lld)\n"
         "  --dtype T      f32 | bf16 | f16 (default %s)\n"
         "  --mask M       causal | bidirectional (default %s)\n"
         "  --backend B    auto | cpu | gpu (default auto; FORKATTN_BACKEND chooses for auto)\n"
         "  --repeats K    timed repetitions, median reported (default %d)\n"
         "  --seed S       random seed (default %llu)\n"
         "  --no-replicated  skip the replicated baseline\n"
         "  --json         JSON lines only\n",
         cmd, (long long)s->n, (long long)s->p, (long long)s->r, (long long)s->hq, (long long)s->hkv,
         (long long)s->d, tool_dtype_name(s->dtype), tool_mask_name(s->mask),
         o->repeats, o->seed);
}

int tool_parse_i64(const char *v, long long lo, long long hi, int64_t *out) {
  char *end;
  long long x = strtoll(v, &end, 10);
  if (*v == '\0' || *end != '\0' || x < lo || x > hi) return -1;
  *out = x;
  return 0;
}

int tool_parse(int argc, char **argv, int first, tool_opts *o) {
  for (int i = first; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return 1;
    if (!strcmp(a, "--json")) { o->json = 1; continue; }
    if (!strcmp(a, "--no-replicated")) { o->no_replicated = 1; continue; }
    if (i + 1 >= argc) {
      fprintf(stderr, "forkattn: option %s needs a value (or is unknown)\n", a);
      return -1;
    }
    const char *v = argv[++i];
    int64_t x = 0;
    int bad = 0;
    tool_shape *s = &o->shape;
    if (!strcmp(a, "--n")) bad = tool_parse_i64(v, 0, 1 << 20, &s->n);
    else if (!strcmp(a, "--p")) bad = tool_parse_i64(v, 0, 1 << 24, &s->p);
    else if (!strcmp(a, "--r")) bad = tool_parse_i64(v, 0, 1 << 24, &s->r);
    else if (!strcmp(a, "--hq")) bad = tool_parse_i64(v, 1, 1024, &s->hq);
    else if (!strcmp(a, "--hkv")) bad = tool_parse_i64(v, 1, 1024, &s->hkv);
    else if (!strcmp(a, "--d")) bad = tool_parse_i64(v, 1, 256, &s->d);
    else if (!strcmp(a, "--repeats")) { bad = tool_parse_i64(v, 1, 100000, &x); o->repeats = (int)x; }
    else if (!strcmp(a, "--seed")) { bad = tool_parse_i64(v, 0, (long long)1 << 62, &x); o->seed = (unsigned long long)x; }
    else if (!strcmp(a, "--dtype")) bad = tool_parse_dtype(v, &s->dtype);
    else if (!strcmp(a, "--mask")) bad = tool_parse_mask(v, &s->mask);
    else if (!strcmp(a, "--backend")) bad = tool_parse_backend(v, &o->backend);
    else {
      fprintf(stderr, "forkattn: unknown option %s\n", a);
      return -1;
    }
    if (bad) {
      fprintf(stderr, "forkattn: bad value '%s' for %s\n", v, a);
      return -1;
    }
  }
  if (o->shape.hq % o->shape.hkv) {
    fprintf(stderr, "forkattn: --hq must be a multiple of --hkv\n");
    return -1;
  }
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double tool_median(double *x, int n) {
  qsort(x, (size_t)n, sizeof *x, cmp_double);
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}
