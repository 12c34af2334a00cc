/* Options and setup of `forkattn demo dlm` and `forkattn bench dlm`. */
#include "dlm_cli.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"

void dlm_cli_defaults(dlm_cli *o, int bench) {
  memset(o, 0, sizeof *o);
  o->model = dlm_config_default();
  /* demo: 4 prompts, ratios spread 0.2..0.9; bench: one row per ratio at --seq tokens */
  o->work = (dlm_workload_opts){bench ? 2 : 4, bench ? 8 : 64, 128, 512, 0.2, 0.9, 16, 2048, 20261130};
  o->serve = (dlm_serve_opts){.batch = bench ? 8 : 16, .steps = 1, .fixed_depth = -1, .warm = bench, .compare = 1};
  o->backend = FORKATTN_BACKEND_CPU;
  o->threshold = 0.95;
  o->calib_seq = 512;
  o->seq = 512;
  o->cache_mib = 1024;
  o->bench = bench;
}

static void dlm_cli_usage(const dlm_cli *o) {
  printf("usage: forkattn %s dlm [options]\n", o->bench ? "bench" : "demo");
  printf(o->bench ? "BiCache serving throughput with and without the shared-prefix KV cache, one row per\n"
                    "prefix ratio r = 0.2 .. 0.9 (requests of --seq tokens, the first r * seq a shared prompt).\n"
                  : "Serve a stream of requests sharing a few system prompts on a small bidirectional\n"
                    "(diffusion-LM shaped) transformer, without and with BiCache prefix KV reuse.\n");
  printf("The model's weights are SYNTHETIC (deterministic hashes): figures are about speed and\n"
         "numerical drift, not about a trained model's accuracy.\n"
         "  --layers N       transformer layers (default %lld)\n"
         "  --width W        model width (default %lld)\n"
         "  --heads H        attention heads, head_dim = W / H (default %lld)\n"
         "  --vocab V        vocabulary, for embeddings and logits (default %lld)\n"
         "  --requests N     requests%s (default %lld)\n"
         "  --prompts K      distinct system prompts (default %lld)\n",
         (long long)o->model.layers, (long long)o->model.width, (long long)o->model.heads,
         (long long)o->model.vocab, o->bench ? " per ratio" : "", (long long)o->work.requests,
         (long long)o->work.prompts);
  if (o->bench)
    printf("  --seq T          tokens per request (default %lld)\n", (long long)o->seq);
  else
    printf("  --prompt-min P   shortest prompt (default %lld)\n"
           "  --prompt-max P   longest prompt (default %lld)\n"
           "  --ratio-min R    prefix ratios r = prompt / (prompt + own) drawn in [R, R'] (default %.2f)\n"
           "  --ratio-max R'   (default %.2f); own tokens = prompt (1 - r) / r, at most %lld\n",
           (long long)o->work.prompt_min, (long long)o->work.prompt_max, o->work.ratio_min, o->work.ratio_max,
           (long long)o->work.own_max);
  printf("  --batch B        arrivals per batch; a batch's requests are grouped by prompt (default %lld)\n"
         "  --steps S        denoising steps per request (default %lld)\n"
         "  --refresh K      with --steps: deep-layer prefix K/V recomputed every K steps (default 0: every step)\n"
         "  --depth B        reuse depth for every request instead of the calibrated profile\n"
         "  --threshold X    similarity a reused layer keeps (default %.2f)\n"
         "  --calib-seq T    tokens per calibration sequence (default %lld)\n"
         "  --cache-mib M    capacity of the KV cache (default %lld)\n"
         "  --warm | --cold  prompts cached before the timed serving, or not (default %s)\n"
         "  --backend B      cpu | gpu | auto (default cpu; FORKATTN_BACKEND chooses for auto;\n"
         "                   tensors stay in host memory, the GPU backend stages attention)\n"
         "  --seed S         seed of weights and workload (default %llu)\n"
         "  --json           JSON lines only\n",
         (long long)o->serve.batch, (long long)o->serve.steps, o->threshold, (long long)o->calib_seq,
         (long long)o->cache_mib, o->serve.warm ? "warm" : "cold", (unsigned long long)o->model.seed);
}

static int dlm_parse_double(const char *v, double lo, double hi, double *out) {
  char *end;
  const double x = strtod(v, &end);
  if (*v == '\0' || *end != '\0' || !(x >= lo && x <= hi)) return -1;
  *out = x;
  return 0;
}

int dlm_cli_parse(int argc, char **argv, int first, dlm_cli *o) {
  for (int i = first; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      dlm_cli_usage(o);
      return 1;
    }
    if (!strcmp(a, "--json")) {
      o->json = 1;
      continue;
    }
    if (!strcmp(a, "--warm") || !strcmp(a, "--cold")) {
      o->serve.warm = !strcmp(a, "--warm");
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "forkattn: option %s needs a value (or is unknown)\n", a);
      return -1;
    }
    const char *v = argv[++i];
    int64_t seed = 0;
    const struct { const char *name; long long lo, hi; int64_t *dst; } ints[] = {
        {"--layers", 1, DLM_MAX_LAYERS, &o->model.layers}, {"--width", 1, 1 << 16, &o->model.width},
        {"--heads", 1, 1 << 16, &o->model.heads},          {"--vocab", 2, 1 << 24, &o->model.vocab},
        {"--requests", 1, 1 << 20, &o->work.requests},     {"--prompts", 1, 1 << 16, &o->work.prompts},
        {"--prompt-min", 1, 1 << 20, &o->work.prompt_min}, {"--prompt-max", 1, 1 << 20, &o->work.prompt_max},
        {"--seq", 2, 1 << 20, &o->seq},                    {"--batch", 1, 1 << 16, &o->serve.batch},
        {"--steps", 1, 1 << 10, &o->serve.steps},          {"--refresh", 0, 1 << 10, &o->serve.refresh},
        {"--depth", 0, DLM_MAX_LAYERS, &o->serve.fixed_depth}, {"--calib-seq", 2, 1 << 20, &o->calib_seq},
        {"--cache-mib", 1, 1 << 30, &o->cache_mib},        {"--seed", 0, (long long)1 << 62, &seed}};
    int bad = -2;
    for (size_t k = 0; k < sizeof ints / sizeof *ints && bad == -2; k++)
      if (!strcmp(a, ints[k].name)) bad = tool_parse_i64(v, ints[k].lo, ints[k].hi, ints[k].dst);
    if (!strcmp(a, "--seed") && !bad) o->model.seed = o->work.seed = (uint64_t)seed;
    if (!strcmp(a, "--ratio-min")) bad = dlm_parse_double(v, 0.01, 0.99, &o->work.ratio_min);
    if (!strcmp(a, "--ratio-max")) bad = dlm_parse_double(v, 0.01, 0.99, &o->work.ratio_max);
    if (!strcmp(a, "--threshold")) bad = dlm_parse_double(v, 0, 1, &o->threshold);
    if (!strcmp(a, "--backend")) bad = tool_parse_backend(v, &o->backend);
    if (bad == -2) {
      fprintf(stderr, "forkattn: unknown option %s\n", a);
      return -1;
    }
    if (bad) {
      fprintf(stderr, "forkattn: bad value '%s' for %s\n", v, a);
      return -1;
    }
  }
  if (o->model.width % o->model.heads || o->model.width / o->model.heads > 256) {
    fprintf(stderr, "forkattn: --width must be --heads x head_dim with head_dim <= 256\n");
    return -1;
  }
  if (o->work.prompt_min > o->work.prompt_max || o->work.ratio_min > o->work.ratio_max) {
    fprintf(stderr, "forkattn: --prompt-min/--ratio-min must not exceed --prompt-max/--ratio-max\n");
    return -1;
  }
  o->serve.cache_bytes = (size_t)o->cache_mib << 20;
  return 0;
}

int dlm_setup_make(dlm_setup *s, const dlm_cli *o) {
  memset(s, 0, sizeof *s);
  forkattn_ctx_options co;
  forkattn_ctx_options_init(&co);
  co.backend = o->backend;
  if (forkattn_ctx_create(&s->ctx, &co)) {
    fprintf(stderr, "forkattn: cannot create a %s context: %s\n", forkattn_backend_name(o->backend),
            forkattn_ctx_create_error());
    return -1;
  }
  char err[512];
  double t0 = omp_get_wtime();
  if (dlm_model_init(&s->model, &o->model, err, sizeof err)) {
    fprintf(stderr, "forkattn: %s\n", err);
    return -1;
  }
  s->init_seconds = omp_get_wtime() - t0;
  forkattn_status st = forkattn_reuse_profile_create(s->ctx, o->model.layers, (float)o->threshold, &s->profile);
  if (st) {
    fprintf(stderr, "forkattn: forkattn_reuse_profile_create: %s\n", forkattn_ctx_last_error(s->ctx));
    return -1;
  }
  double ratios[9];
  for (int k = 0; k < 9; k++) ratios[k] = 0.1 * (k + 1);
  const int64_t seq = o->calib_seq < o->model.max_pos ? o->calib_seq : o->model.max_pos;
  if (dlm_calibrate(s->ctx, &s->model, seq, ratios, 9, o->model.seed ^ 0xca11b, s->profile, &s->calib, err,
                    sizeof err)) {
    fprintf(stderr, "forkattn: calibration: %s\n", err);
    return -1;
  }
  return 0;
}

int dlm_cli_start(int argc, char **argv, int bench, dlm_cli *o, dlm_setup *s) {
  dlm_cli_defaults(o, bench);
  const int p = dlm_cli_parse(argc, argv, 2, o);
  if (p) return p > 0 ? 0 : 2;
  if (dlm_setup_make(s, o)) {
    dlm_setup_free(s);
    return 1;
  }
  return -1;
}

void dlm_setup_free(dlm_setup *s) {
  forkattn_reuse_profile_free(s->profile);
  dlm_model_free(&s->model);
  forkattn_ctx_destroy(s->ctx);
  memset(s, 0, sizeof *s);
}

void dlm_print_model(const dlm_setup *s, const dlm_cli *o, const char *title) {
  const dlm_model *m = &s->model;
  printf("%s\n", title);
  printf("  model: SYNTHETIC WEIGHTS (deterministic hashes of seed %llu; not a trained model)\n"
         "         %lld layers, width %lld, %lld heads x %lld, MLP %lld (GELU), RMSNorm, sinusoidal positions,\n"
         "         vocab %lld (untied logits), %.1f M parameters, generated in %.2f s\n",
         (unsigned long long)o->model.seed, (long long)m->c.layers, (long long)m->c.width, (long long)m->c.heads,
         (long long)m->d, (long long)m->mlp, (long long)m->c.vocab, dlm_model_bytes(m) / 4e6, s->init_seconds);
  printf("  backend: %s (%s), %d threads; tensors in host memory\n",
         forkattn_backend_name(forkattn_ctx_backend(s->ctx)), forkattn_ctx_backend_reason(s->ctx),
         forkattn_ctx_threads(s->ctx));
}

void dlm_print_calibration(const dlm_setup *s, const dlm_cli *o) {
  const dlm_calib *c = &s->calib;
  const int64_t L = s->model.c.layers;
  printf("calibration: %lld sequences of %lld tokens, %.2f s; cosine similarity of the prefix's K/V computed\n"
         "  alone vs inside the sequence (min of K and V, mean over heads and rows), threshold %.2f\n",
         (long long)c->samples, (long long)o->calib_seq, c->seconds, o->threshold);
  printf("  %5s", "r");
  for (int64_t l = 0; l < L && l < 16; l++) printf(" %6s%-2lld", "L", (long long)l);
  printf("\n");
  for (int64_t k = 0; k < c->samples; k++) {
    printf("  %5.2f", c->ratio[k]);
    for (int64_t l = 0; l < L && l < 16; l++) printf(" %8.4f", c->sim[k][l]);
    printf("\n");
  }
  printf("  reuse depth b(r):");
  for (int k = 1; k <= 9; k++) {
    int64_t b = 0;
    forkattn_reuse_profile_depth(s->ctx, s->profile, k / 10.0, &b);
    printf(" %.1f:%lld", k / 10.0, (long long)b);
  }
  printf(" (of %lld layers)\n", (long long)L);
}
