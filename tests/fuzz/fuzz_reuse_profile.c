/* Fuzz target: the reuse-depth profile file loader (forkattn_reuse_profile_load)
 * and its round trip through forkattn_reuse_profile_save.
 *
 * The input bytes are the file, written to a temporary file (the loader takes a
 * path). Checks:
 *  - the status is OK, INVALID_ARGUMENT or OUT_OF_MEMORY; on failure *profile
 *    is NULL and the message is non-empty and names the file;
 *  - on success the profile saves, the saved file loads again, and the
 *    reloaded profile equals the first: the same reuse depth at every bin's
 *    ratio and in between, and saving it again gives the same bytes (the
 *    means are written exactly, so equal files mean equal profiles);
 *  - the saved file declares the input's layers, and its depths are monotone
 *    in the ratio and within 0..layers (the header's rule).
 *
 * Input format: the file's bytes, nothing else.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "forkattn_experimental.h"
#include "fuzz_common.h"

static char fz_in[64], fz_out[64], fz_again[64];

static void fz_remove_files(void) {
  unlink(fz_in);
  unlink(fz_out);
  unlink(fz_again);
}

/* Three private temporary paths, made once per process. */
static void fz_paths(void) {
  if (fz_in[0]) return;
  char *names[3] = {fz_in, fz_out, fz_again};
  for (int i = 0; i < 3; i++) {
    snprintf(names[i], sizeof fz_in, "/tmp/forkattn-fuzz-profile-XXXXXX");
    const int fd = mkstemp(names[i]);
    FZ_CHECK(fd >= 0, "cannot create a temporary file");
    close(fd);
  }
  atexit(fz_remove_files);
}

static void fz_write(const char *path, const uint8_t *data, size_t size) {
  FILE *f = fopen(path, "wb");
  FZ_CHECK(f, "cannot open %s", path);
  FZ_CHECK(fwrite(data, 1, size, f) == size, "cannot write %s", path);
  FZ_CHECK(fclose(f) == 0, "cannot close %s", path);
}

/* The whole file (NUL-terminated, caller frees); *len its size. */
static char *fz_read(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  FZ_CHECK(f, "cannot open %s", path);
  size_t cap = 4096, n = 0, got;
  char *s = malloc(cap + 1);
  FZ_CHECK(s, "out of memory");
  while ((got = fread(s + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) {
      s = realloc(s, (cap *= 2) + 1);
      FZ_CHECK(s, "out of memory");
    }
  }
  fclose(f);
  s[n] = '\0';
  *len = n;
  return s;
}

static forkattn_reuse_profile *fz_load(forkattn_ctx *ctx, const char *path, forkattn_status *st) {
  forkattn_reuse_profile *p = (forkattn_reuse_profile *)(void *)&p; /* non-NULL sentinel */
  *st = forkattn_reuse_profile_load(ctx, path, &p);
  FZ_CHECK(*st == FORKATTN_OK || *st == FORKATTN_ERR_INVALID_ARGUMENT || *st == FORKATTN_ERR_OUT_OF_MEMORY,
           "load: undocumented status %s", forkattn_status_string(*st));
  if (*st) {
    const char *msg = forkattn_ctx_last_error(ctx);
    FZ_CHECK(p == NULL, "load failed (%s) but *profile is not NULL", forkattn_status_string(*st));
    FZ_CHECK(msg[0], "load: %s without a message", forkattn_status_string(*st));
    FZ_CHECK(strstr(msg, "path:") && (*st == FORKATTN_ERR_OUT_OF_MEMORY || strstr(msg, path)),
             "load: message '%s' does not name the file", msg);
    return NULL;
  }
  FZ_CHECK(p && p != (forkattn_reuse_profile *)(void *)&p, "load: OK without a profile");
  return p;
}

/* "layers <L>" of a saved file (its second line). */
static int64_t fz_saved_layers(const char *text) {
  const char *l = strstr(text, "\nlayers ");
  FZ_CHECK(l, "saved file without a layers line: '%.80s'", text);
  return strtoll(l + 8, NULL, 10);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  forkattn_ctx *ctx = fz_cpu_ctx();
  fz_paths();
  fz_write(fz_in, data, size);
  forkattn_status st;
  forkattn_reuse_profile *p = fz_load(ctx, fz_in, &st);
  if (getenv("FORKATTN_FUZZ_VERBOSE"))
    fprintf(stderr, "load (%zu bytes): %s %s\n", size, forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  if (!p) return 0;

  st = forkattn_reuse_profile_save(ctx, p, fz_out);
  FZ_CHECK(st == FORKATTN_OK, "save of a loaded profile: %s (%s)", forkattn_status_string(st),
           forkattn_ctx_last_error(ctx));
  forkattn_reuse_profile *q = fz_load(ctx, fz_out, &st);
  FZ_CHECK(q, "the saved file does not load: %s (%s)", forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  st = forkattn_reuse_profile_save(ctx, q, fz_again);
  FZ_CHECK(st == FORKATTN_OK, "save of the reloaded profile: %s (%s)", forkattn_status_string(st),
           forkattn_ctx_last_error(ctx));
  size_t na, nb;
  char *a = fz_read(fz_out, &na), *b = fz_read(fz_again, &nb);
  FZ_CHECK(na == nb && !memcmp(a, b, na), "the reloaded profile saves differently:\n%.300s\n---\n%.300s", a, b);

  const int64_t L = fz_saved_layers(a);
  /* the input's "layers" value (line 2: blanks, "layers", blanks, an integer) is the saved one */
  const char *in = memchr(data, '\n', size), *end = (const char *)data + size;
  FZ_CHECK(in, "a loaded file of one line");
  in++;
  while (in < end && (*in == ' ' || *in == '\t')) in++;
  FZ_CHECK(end - in > 6 && !memcmp(in, "layers", 6), "a loaded file whose line 2 is not 'layers'");
  in += 6;
  while (in < end && (*in == ' ' || *in == '\t')) in++;
  char num[32] = {0};
  for (size_t k = 0; in < end && k + 1 < sizeof num && *in != ' ' && *in != '\t' && *in != '\r' && *in != '\n'; k++)
    num[k] = *in++;
  FZ_CHECK(strtoll(num, NULL, 10) == L, "saved layers %lld, the input says '%s'", (long long)L, num);

  int64_t prev = 0;
  for (int i = 0; i <= 400; i++) { /* every bin's ratio and points in between */
    const double r = i / 400.0;
    int64_t dp = -1, dq = -2;
    FZ_CHECK(forkattn_reuse_profile_depth(ctx, p, r, &dp) == FORKATTN_OK, "depth(%g): %s", r,
             forkattn_ctx_last_error(ctx));
    FZ_CHECK(forkattn_reuse_profile_depth(ctx, q, r, &dq) == FORKATTN_OK, "depth(%g): %s", r,
             forkattn_ctx_last_error(ctx));
    FZ_CHECK(dp == dq, "depth(%g): %lld loaded, %lld reloaded", r, (long long)dp, (long long)dq);
    FZ_CHECK(dp >= 0 && dp <= L, "depth(%g) = %lld outside 0..%lld", r, (long long)dp, (long long)L);
    FZ_CHECK(dp >= prev, "depth(%g) = %lld below depth at a lower ratio (%lld)", r, (long long)dp, (long long)prev);
    prev = dp;
  }
  free(a);
  free(b);
  forkattn_reuse_profile_free(p);
  forkattn_reuse_profile_free(q);
  return 0;
}
