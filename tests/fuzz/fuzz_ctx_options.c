/* Fuzz target: the context API and the small entry points that take enums,
 * sizes and pointers.
 *
 *  - forkattn_ctx_create() with fuzzed options (backend, device, threads,
 *    bind_threads, verbose) and a fuzzed FORKATTN_BACKEND environment value
 *    (printable), NULL options and a NULL ctx pointer; status against the
 *    header's rules (threads above forkattn_max_threads() refused), *ctx NULL and forkattn_ctx_create_error() non-empty on
 *    failure, the context's getters on success, optionally a tiny forward on
 *    it; then forkattn_ctx_destroy().
 *  - forkattn_status_string() / forkattn_backend_name() on arbitrary ints.
 *  - forkattn_memcpy() with NULL / host pointers (overlapping too), fuzzed
 *    memory kinds and sizes on a CPU context (host to host must behave as
 *    memmove, anything else must be refused without touching memory), and
 *    forkattn_device_malloc()/forkattn_device_free() on a CPU context.
 *  - every entry with a NULL context.
 *
 * Input format (missing bytes read as 0):
 *   flags    bit0 options NULL   bit1 ctx pointer NULL   bit2 set FORKATTN_BACKEND
 *            bit3 run a tiny forward on the new context   bit4 allow verbose
 *   backend  fz_enum_field(AUTO)   device, threads, bind_threads, verbose: fz_field(0)
 *   env      byte e: e < 0x80: a token (cpu, gpu, auto, mixed case, padded, ...);
 *            else e % 16 raw bytes, each mapped to a printable character
 *   3 x      status value, backend value: fz_int(-2, 10)
 *   memcpy   count byte % 4, then per call: dst (byte % 4: NULL, A, B, A), dst
 *            offset byte % 64, src likewise, dst/src memory fz_enum(2), bytes fz_field(16)
 *   malloc   bytes fz_field(64)
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "fuzz_common.h"

static const char *const tokens[] = {"cpu",  "gpu",  "auto",    "CPU", "Gpu",   "AUTO", "",
                                     "cpu ", " cpu", "cpux",    "c",   "autoo", "gp",   "none",
                                     "0",    "1",    "cpu,gpu", "cPu", "aUtO",  "gpu\n"};
#define NTOKENS ((int)(sizeof tokens / sizeof tokens[0]))

static int documented(forkattn_status st) { return st >= FORKATTN_OK && st <= FORKATTN_ERR_INTERNAL; }

/* Which backend the environment asks for: -1 none (unset or empty), -2 unknown. */
static int env_backend(const char *e) {
  if (!e || !*e) return -1;
  if (!strcasecmp(e, "cpu")) return FORKATTN_BACKEND_CPU;
  if (!strcasecmp(e, "gpu")) return FORKATTN_BACKEND_GPU;
  if (!strcasecmp(e, "auto")) return FORKATTN_BACKEND_AUTO;
  return -2;
}

static void tiny_forward(forkattn_ctx *ctx) {
  float q[3 * 4], k[3 * 4], v[3 * 4], o[3 * 4], lse[3];
  for (int i = 0; i < 12; i++) {
    q[i] = (float)(i % 5) / 4.0f;
    k[i] = (float)(i % 3) / 2.0f;
    v[i] = (float)(i % 7) / 8.0f;
    o[i] = 0.0f;
  }
  forkattn_prefix_layout lay = {3, 0, NULL, FORKATTN_MASK_CAUSAL};
  forkattn_tensor tq = forkattn_tensor_contiguous(q, FORKATTN_DTYPE_F32, 3, 1, 4);
  forkattn_tensor tk = forkattn_tensor_contiguous(k, FORKATTN_DTYPE_F32, 3, 1, 4);
  forkattn_tensor tv = forkattn_tensor_contiguous(v, FORKATTN_DTYPE_F32, 3, 1, 4);
  forkattn_tensor to = forkattn_tensor_contiguous(o, FORKATTN_DTYPE_F32, 3, 1, 4);
  forkattn_status st = forkattn_prefix_fwd(ctx, &lay, &tq, &tk, &tv, &to, lse, 0.5f, FORKATTN_MEMORY_HOST);
  FZ_CHECK(st == FORKATTN_OK, "tiny forward on a new context: %s (%s)", forkattn_status_string(st),
           forkattn_ctx_last_error(ctx));
  for (int i = 0; i < 12; i++)
    FZ_CHECK(isfinite(o[i]), "tiny forward: o[%d] = %g", i, (double)o[i]);
  /* row 0 sees only key 0: o[0] = v[0] */
  for (int c = 0; c < 4; c++)
    FZ_CHECK(fabsf(o[c] - v[c]) < 1e-6f, "tiny forward: o[0,%d] = %g, want %g", c, (double)o[c],
             (double)v[c]);
}

static void fuzz_create(fz_reader *r) {
  const uint8_t flags = fz_u8(r);
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  FZ_CHECK(opt.struct_size == sizeof opt && opt.backend == FORKATTN_BACKEND_AUTO && opt.device == 0 && opt.threads == 0 && !opt.bind_threads &&
               !opt.verbose,
           "forkattn_ctx_options_init: not the documented defaults");
  opt.backend = (forkattn_backend)fz_enum_field(r, FORKATTN_BACKEND_AUTO);
  opt.device = (int)fz_field(r, 0);
  opt.threads = (int)fz_field(r, 0);
  opt.bind_threads = (int)fz_field(r, 0);
  opt.verbose = (int)fz_field(r, 0);
  if (!(flags & 16)) opt.verbose = 0;
  const int opt_null = flags & 1, ctxp_null = (flags >> 1) & 1;

  char env[17] = "";
  const uint8_t e = fz_u8(r);
  if (e < 0x80) {
    strcpy(env, tokens[e % NTOKENS]);
    for (char *p = env; *p; p++)
      if (*p == '\n') *p = '~'; /* printable only */
  } else {
    const int len = e % 16;
    for (int i = 0; i < len; i++)
      env[i] = (char)(0x20 + fz_u8(r) % 95);
    env[len] = '\0';
  }
  if (flags & 4)
    setenv("FORKATTN_BACKEND", env, 1);
  else
    unsetenv("FORKATTN_BACKEND");

  /* What the header says must happen. */
  forkattn_ctx_options eff;
  forkattn_ctx_options_init(&eff);
  if (!opt_null) eff = opt;
  int want_bad = ctxp_null ||
                 (eff.backend != FORKATTN_BACKEND_AUTO && eff.backend != FORKATTN_BACKEND_CPU &&
                  eff.backend != FORKATTN_BACKEND_GPU) ||
                 eff.threads < 0 || eff.threads > forkattn_max_threads() || eff.device < 0;
  /* the environment applies to an auto request only */
  int eb = eff.backend == FORKATTN_BACKEND_AUTO ? env_backend(flags & 4 ? env : NULL) : -1;
  int backend = (int)eff.backend;
  if (eb == -2) want_bad = 1;
  if (eb >= 0) backend = eb;

  forkattn_ctx *sentinel = (forkattn_ctx *)(uintptr_t)0x1, *ctx = sentinel;
  forkattn_status st = forkattn_ctx_create(ctxp_null ? NULL : &ctx, opt_null ? NULL : &opt);
  FZ_CHECK(documented(st), "ctx_create: undocumented status %d", (int)st);
  const char *why = forkattn_ctx_create_error();
  if (getenv("FORKATTN_FUZZ_VERBOSE"))
    fprintf(stderr,
            "ctx_create(options%s backend %d device %d threads %d bind %d verbose %d, ctx pointer%s, "
            "FORKATTN_BACKEND %s%s%s): %s %s\n",
            opt_null ? " NULL," : "", (int)opt.backend, opt.device, opt.threads, opt.bind_threads,
            opt.verbose, ctxp_null ? " NULL" : "", flags & 4 ? "'" : "unset", flags & 4 ? env : "",
            flags & 4 ? "'" : "", forkattn_status_string(st), why ? why : "(null)");
  FZ_CHECK(why != NULL, "forkattn_ctx_create_error() is NULL");
  if (want_bad) {
    FZ_CHECK(st == FORKATTN_ERR_INVALID_ARGUMENT,
             "ctx_create: %s for invalid options (backend %d, device %d, "
             "threads %d, env '%s')",
             forkattn_status_string(st), (int)eff.backend, eff.device, eff.threads,
             flags & 4 ? env : "(unset)");
  } else if (backend == FORKATTN_BACKEND_GPU) {
    FZ_CHECK(st == FORKATTN_OK || st == FORKATTN_ERR_BACKEND_UNAVAILABLE, "ctx_create (gpu): %s: %s",
             forkattn_status_string(st), why);
    if (!forkattn_build_has_offload())
      FZ_CHECK(st == FORKATTN_ERR_BACKEND_UNAVAILABLE, "ctx_create: gpu granted by a build without offload");
  } else {
    FZ_CHECK(st == FORKATTN_OK, "ctx_create (%s): %s: %s", forkattn_backend_name((forkattn_backend)backend),
             forkattn_status_string(st), why);
  }
  if (st != FORKATTN_OK) {
    FZ_CHECK(why[0], "ctx_create: %s without a message in forkattn_ctx_create_error()",
             forkattn_status_string(st));
    if (!ctxp_null) FZ_CHECK(ctx == NULL, "ctx_create failed but *ctx is not NULL");
  } else {
    FZ_CHECK(ctx && ctx != sentinel, "ctx_create: OK without a context");
    FZ_CHECK(why[0] == '\0', "forkattn_ctx_create_error() is '%s' after a success", why);
    forkattn_backend b = forkattn_ctx_backend(ctx);
    FZ_CHECK(b == FORKATTN_BACKEND_CPU || b == FORKATTN_BACKEND_GPU, "context backend %d", (int)b);
    if (backend == FORKATTN_BACKEND_CPU || !forkattn_build_has_offload())
      FZ_CHECK(b == FORKATTN_BACKEND_CPU, "context backend %s, want cpu", forkattn_backend_name(b));
    const char *reason = forkattn_ctx_backend_reason(ctx);
    FZ_CHECK(reason && reason[0], "empty backend reason");
    const int threads = forkattn_ctx_threads(ctx);
    FZ_CHECK(eff.threads > 0 ? threads == eff.threads : threads >= 1, "threads %d (asked %d)", threads,
             eff.threads);
    FZ_CHECK(forkattn_ctx_last_error(ctx) && !forkattn_ctx_last_error(ctx)[0], "last error of a new context");
    FZ_CHECK(forkattn_ctx_peak_workspace(ctx) == 0, "peak workspace of a new context");
    if ((flags & 8) && b == FORKATTN_BACKEND_CPU && threads <= 4) tiny_forward(ctx);
    forkattn_ctx_destroy(ctx);
  }
  unsetenv("FORKATTN_BACKEND");
}

static void fuzz_names(fz_reader *r) {
  for (int i = 0; i < 3; i++) {
    const int s = (int)fz_int(r, -2, 10), b = (int)fz_int(r, -2, 10);
    const char *ss = forkattn_status_string((forkattn_status)s),
               *bs = forkattn_backend_name((forkattn_backend)b);
    FZ_CHECK(ss && ss[0], "forkattn_status_string(%d) is NULL or empty", s);
    FZ_CHECK(bs && bs[0], "forkattn_backend_name(%d) is NULL or empty", b);
    if (s < 0 || s > FORKATTN_ERR_INTERNAL) FZ_CHECK(!strcmp(ss, "unknown status"), "status %d: '%s'", s, ss);
    if (b < 0 || b > FORKATTN_BACKEND_GPU) FZ_CHECK(!strcmp(bs, "unknown"), "backend %d: '%s'", b, bs);
  }
}

static void fuzz_memcpy(fz_reader *r, forkattn_ctx *ctx) {
  enum { SZ = 128 };
  unsigned char *a = malloc(SZ), *b = malloc(SZ), ra[SZ], rb[SZ];
  FZ_CHECK(a && b, "out of memory");
  for (int i = 0; i < SZ; i++) {
    a[i] = (unsigned char)i;
    b[i] = (unsigned char)(200 - i);
  }
  const int calls = fz_u8(r) % 4;
  for (int n = 0; n < calls; n++) {
    unsigned char *base[4] = {NULL, a, b, a};
    const int ds = fz_u8(r) % 4, doff = fz_u8(r) % 64, ss = fz_u8(r) % 4, soff = fz_u8(r) % 64;
    unsigned char *dst = base[ds] ? base[ds] + doff : NULL;
    const unsigned char *src = base[ss] ? base[ss] + soff : NULL;
    const int dm = fz_enum(r, 2), sm = fz_enum(r, 2);
    size_t bytes = (size_t)fz_field(r, 16);
    const int kinds_ok = (dm == 0 || dm == 1) && (sm == 0 || sm == 1);
    if (dst && src && dm == 0 && sm == 0) { /* host to host really copies: keep it inside the buffers */
      const size_t room = (size_t)(SZ - (doff > soff ? doff : soff));
      if (bytes > room) bytes = bytes % (room + 1);
    }
    forkattn_status want;
    if ((!dst || !src) && bytes)
      want = FORKATTN_ERR_INVALID_ARGUMENT;
    else if (!kinds_ok)
      want = FORKATTN_ERR_INVALID_ARGUMENT;
    else if (dm == 0 && sm == 0)
      want = FORKATTN_OK;
    else
      want = FORKATTN_ERR_BACKEND_UNAVAILABLE; /* device memory on a CPU context */
    memcpy(ra, a, SZ);
    memcpy(rb, b, SZ);
    if (want == FORKATTN_OK && bytes) memmove((ds == 2 ? rb : ra) + doff, (ss == 2 ? rb : ra) + soff, bytes);
    forkattn_status st = forkattn_memcpy(ctx, dst, (forkattn_memory)dm, src, (forkattn_memory)sm, bytes);
    if (getenv("FORKATTN_FUZZ_VERBOSE"))
      fprintf(stderr, "memcpy(dst %d+%d kind %d, src %d+%d kind %d, %zu bytes): %s %s\n", ds, doff, dm, ss,
              soff, sm, bytes, forkattn_status_string(st), forkattn_ctx_last_error(ctx));
    FZ_CHECK(st == want, "memcpy(dst %d+%d, kind %d, src %d+%d, kind %d, %zu bytes): %s, want %s (%s)", ds,
             doff, dm, ss, soff, sm, bytes, forkattn_status_string(st), forkattn_status_string(want),
             forkattn_ctx_last_error(ctx));
    if (st != FORKATTN_OK)
      FZ_CHECK(forkattn_ctx_last_error(ctx)[0], "memcpy: %s without a message", forkattn_status_string(st));
    FZ_CHECK(!memcmp(a, ra, SZ) && !memcmp(b, rb, SZ),
             "memcpy: buffers differ from memmove's result (status %s)", forkattn_status_string(st));
  }
  free(a);
  free(b);

  /* device memory entry points need the gpu backend */
  void *p = (void *)(uintptr_t)0x2;
  const size_t bytes = (size_t)fz_field(r, 64);
  forkattn_status st = forkattn_device_malloc(ctx, bytes, (fz_u8(r) & 1) ? NULL : &p);
  FZ_CHECK(st == FORKATTN_ERR_BACKEND_UNAVAILABLE, "device_malloc(%zu) on a CPU context: %s", bytes,
           forkattn_status_string(st));
  FZ_CHECK(p == (void *)(uintptr_t)0x2, "device_malloc on a CPU context wrote *ptr");
  st = forkattn_device_free(ctx, (void *)(uintptr_t)(fz_u8(r) ? 0x1000 : 0));
  FZ_CHECK(st == FORKATTN_ERR_BACKEND_UNAVAILABLE, "device_free on a CPU context: %s",
           forkattn_status_string(st));
}

static void null_context(void) {
  FZ_CHECK(forkattn_ctx_backend(NULL) == FORKATTN_BACKEND_CPU, "ctx_backend(NULL)");
  FZ_CHECK(forkattn_ctx_backend_reason(NULL) && forkattn_ctx_last_error(NULL),
           "NULL strings for a NULL context");
  FZ_CHECK(forkattn_ctx_threads(NULL) == 0 && forkattn_ctx_peak_workspace(NULL) == 0, "getters of NULL");
  void *p = NULL;
  FZ_CHECK(forkattn_device_malloc(NULL, 16, &p) == FORKATTN_ERR_INVALID_ARGUMENT && !p,
           "device_malloc(NULL ctx)");
  FZ_CHECK(forkattn_device_free(NULL, NULL) == FORKATTN_ERR_INVALID_ARGUMENT, "device_free(NULL ctx)");
  FZ_CHECK(forkattn_memcpy(NULL, NULL, FORKATTN_MEMORY_HOST, NULL, FORKATTN_MEMORY_HOST, 0) ==
               FORKATTN_ERR_INVALID_ARGUMENT,
           "memcpy(NULL ctx)");
  FZ_CHECK(forkattn_prefix_fwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1.0f, FORKATTN_MEMORY_HOST) ==
               FORKATTN_ERR_INVALID_ARGUMENT,
           "prefix_fwd(NULL ctx)");
  FZ_CHECK(forkattn_prefix_bwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1.0f,
                               FORKATTN_MEMORY_HOST) == FORKATTN_ERR_INVALID_ARGUMENT,
           "prefix_bwd(NULL ctx)");
  forkattn_ctx_destroy(NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_reader rd = {data, size, 0};
  fuzz_create(&rd);
  fuzz_names(&rd);
  fuzz_memcpy(&rd, fz_cpu_ctx());
  null_context();
  return 0;
}
