/* embed.c - forkattn from C through the installed package.
 *
 *   cmake:      find_package(forkattn 0.1 REQUIRED) + target_link_libraries(app forkattn::forkattn)
 *   pkg-config: cc embed.c $(pkg-config --cflags --libs forkattn) -lm
 *
 * A GRPO-shaped group (one prompt, four responses of different lengths, one of
 * them empty) runs shared-prompt attention forward and backward, then the same
 * data replicated (each response with its own copy of the prompt, one call per
 * sequence) as a check: outputs must agree and the prompt's dK/dV must equal
 * the sum over the copies. Exit status 0 when they do. */
#include <forkattn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { P = 48, N = 4, HQ = 4, HKV = 2, D = 32 };
static const int64_t lens[N] = {17, 0, 33, 5};

static float frand(unsigned *s) {
  *s = *s * 1664525u + 1013904223u;
  return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

#define CHECK(call)                                                                              \
  do {                                                                                           \
    forkattn_status st_ = (call);                                                                \
    if (st_) {                                                                                   \
      fprintf(stderr, "embed: %s: %s (%s)\n", #call, forkattn_status_string(st_),             \
              forkattn_ctx_last_error(ctx));                                                     \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

/* fwd+bwd of one layout over contiguous buffers (q k v o dout dq dk dv). */
static forkattn_status run(forkattn_ctx *ctx, const forkattn_prefix_layout *l, int64_t rows, float *b[8],
                           float *lse) {
  const int64_t heads[8] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  forkattn_tensor t[8];
  for (int i = 0; i < 8; i++) t[i] = forkattn_tensor_contiguous(b[i], FORKATTN_DTYPE_F32, rows, heads[i], D);
  const float scale = 1.0f / sqrtf((float)D);
  forkattn_status st = forkattn_prefix_fwd(ctx, l, &t[0], &t[1], &t[2], &t[3], lse, scale, FORKATTN_MEMORY_HOST);
  if (st) return st;
  return forkattn_prefix_bwd(ctx, l, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7], scale,
                             FORKATTN_MEMORY_HOST);
}

int main(void) {
  printf("forkattn %s (header %d.%d.%d)\n", forkattn_version_string(), FORKATTN_VERSION_MAJOR,
         FORKATTN_VERSION_MINOR, FORKATTN_VERSION_PATCH);
  forkattn_ctx *ctx = NULL;
  if (forkattn_ctx_create(&ctx, NULL)) {
    fprintf(stderr, "embed: %s\n", forkattn_ctx_create_error());
    return 1;
  }
  printf("backend: %s\n", forkattn_ctx_backend_reason(ctx));

  int64_t off[N + 1] = {0};
  for (int i = 0; i < N; i++) off[i + 1] = off[i] + lens[i];
  const int64_t T = P + off[N], width[8] = {HQ, HKV, HKV, HQ, HQ, HQ, HKV, HKV};
  float *g[8], *lse = malloc(sizeof(float) * (size_t)(T * HQ));
  unsigned seed = 7;
  for (int i = 0; i < 8; i++) {
    g[i] = malloc(sizeof(float) * (size_t)(T * width[i] * D));
    for (int64_t e = 0; e < T * width[i] * D; e++) g[i][e] = frand(&seed);
  }
  forkattn_prefix_layout shared = {P, N, off, FORKATTN_MASK_CAUSAL};
  CHECK(run(ctx, &shared, T, g, lse));

  /* replicated: sequence i = [prompt ; response i]; its prompt dout only in copy 0 */
  double err = 0, ref = 0;
  float *dk_sum = calloc((size_t)(P * HKV * D), sizeof(float)), *dv_sum = calloc((size_t)(P * HKV * D), sizeof(float));
  for (int i = 0; i < N; i++) {
    const int64_t L = P + lens[i];
    float *r[8], *rl = malloc(sizeof(float) * (size_t)(L * HQ));
    for (int t = 0; t < 8; t++) {
      const int64_t w = width[t] * D;
      r[t] = malloc(sizeof(float) * (size_t)(L * w));
      memcpy(r[t], g[t], sizeof(float) * (size_t)(P * w));                                /* prompt copy */
      memcpy(r[t] + P * w, g[t] + (P + off[i]) * w, sizeof(float) * (size_t)(lens[i] * w)); /* response */
      if (t == 4 && i > 0) memset(r[t], 0, sizeof(float) * (size_t)(P * w));
    }
    int64_t one[2] = {0, lens[i]};
    forkattn_prefix_layout single = {P, 1, one, FORKATTN_MASK_CAUSAL};
    CHECK(run(ctx, &single, L, r, rl));
    const int64_t wq = HQ * D, wk = HKV * D;
    for (int64_t e = 0; e < lens[i] * wq; e++) { /* response rows: o and dq match */
      err = fmax(err, fabs(r[3][P * wq + e] - g[3][(P + off[i]) * wq + e]));
      err = fmax(err, fabs(r[5][P * wq + e] - g[5][(P + off[i]) * wq + e]));
      ref = fmax(ref, fabs(g[3][(P + off[i]) * wq + e]));
    }
    for (int64_t e = 0; e < P * wk; e++) dk_sum[e] += r[6][e], dv_sum[e] += r[7][e];
    for (int t = 0; t < 8; t++) free(r[t]);
    free(rl);
  }
  for (int64_t e = 0; e < P * HKV * D; e++) { /* prompt dK/dV = sum over the copies */
    err = fmax(err, fabs(dk_sum[e] - g[6][e]));
    err = fmax(err, fabs(dv_sum[e] - g[7][e]));
  }
  const int ok = err <= 1e-4 * (ref > 1 ? ref : 1);
  printf("shared vs replicated: max |diff| %.2e over o, dq and the prompt's dk/dv: %s\n", err, ok ? "OK" : "MISMATCH");
  for (int i = 0; i < 8; i++) free(g[i]);
  free(lse);
  free(dk_sum);
  free(dv_sum);
  forkattn_ctx_destroy(ctx);
  return ok ? 0 : 1;
}
