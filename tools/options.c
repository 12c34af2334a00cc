/* Option parsing for demo and bench. */
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *dtype_name(forkattn_dtype t) {
  return t == FORKATTN_DTYPE_F32 ? "f32" : t == FORKATTN_DTYPE_BF16 ? "bf16" : "f16";
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
         "  --backend B    auto | cpu | gpu (default auto; FORKATTN_BACKEND overrides)\n"
         "  --repeats K    timed repetitions, median reported (default %d)\n"
         "  --seed S       random seed (default %llu)\n"
         "  --no-replicated  skip the replicated baseline\n"
         "  --json         JSON lines only\n",
         cmd, (long long)s->n, (long long)s->p, (long long)s->r, (long long)s->hq, (long long)s->hkv,
         (long long)s->d, dtype_name(s->dtype), s->mask == FORKATTN_MASK_CAUSAL ? "causal" : "bidirectional",
         o->repeats, o->seed);
}

static int parse_i64(const char *v, long long lo, long long hi, int64_t *out) {
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
    if (!strcmp(a, "--n")) bad = parse_i64(v, 0, 1 << 20, &s->n);
    else if (!strcmp(a, "--p")) bad = parse_i64(v, 0, 1 << 24, &s->p);
    else if (!strcmp(a, "--r")) bad = parse_i64(v, 0, 1 << 24, &s->r);
    else if (!strcmp(a, "--hq")) bad = parse_i64(v, 1, 1024, &s->hq);
    else if (!strcmp(a, "--hkv")) bad = parse_i64(v, 1, 1024, &s->hkv);
    else if (!strcmp(a, "--d")) bad = parse_i64(v, 1, 256, &s->d);
    else if (!strcmp(a, "--repeats")) { bad = parse_i64(v, 1, 100000, &x); o->repeats = (int)x; }
    else if (!strcmp(a, "--seed")) { bad = parse_i64(v, 0, (long long)1 << 62, &x); o->seed = (unsigned long long)x; }
    else if (!strcmp(a, "--dtype")) {
      if (!strcmp(v, "f32")) s->dtype = FORKATTN_DTYPE_F32;
      else if (!strcmp(v, "bf16")) s->dtype = FORKATTN_DTYPE_BF16;
      else if (!strcmp(v, "f16")) s->dtype = FORKATTN_DTYPE_F16;
      else bad = 1;
    } else if (!strcmp(a, "--mask")) {
      if (!strcmp(v, "causal")) s->mask = FORKATTN_MASK_CAUSAL;
      else if (!strcmp(v, "bidirectional")) s->mask = FORKATTN_MASK_BIDIRECTIONAL;
      else bad = 1;
    } else if (!strcmp(a, "--backend")) {
      if (!strcmp(v, "auto")) o->backend = FORKATTN_BACKEND_AUTO;
      else if (!strcmp(v, "cpu")) o->backend = FORKATTN_BACKEND_CPU;
      else if (!strcmp(v, "gpu")) o->backend = FORKATTN_BACKEND_GPU;
      else bad = 1;
    } else {
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
