/* Reuse-depth profile files: forkattn_reuse_profile_save() / _load().
 *
 * Version 1, text, one record per line, fields separated by spaces:
 *   forkattn-reuse-profile 1
 *   layers <L>
 *   threshold <t>                  (%.9g: the float threshold exactly)
 *   bins <N>                       (number of bin lines that follow, 0..101)
 *   <bin> <count> <mean_0> ... <mean_{L-1}>   N lines, bins ascending
 *   end
 * Means are written with %.17g, so a loaded profile equals the saved one
 * bit for bit (same depths, and further adds continue identically). Numbers
 * use '.' whatever the C locale's LC_NUMERIC. Loading checks everything: the
 * header and version, every range (1 <= L <= FA_PROFILE_MAX_LAYERS, threshold
 * and means finite in [0, 1] and [-1, 1], bins 0..100 strictly ascending,
 * counts >= 1), the number of values of every line, the number of bin lines
 * and the final "end" (a truncated file is refused); blank lines may follow
 * "end", nothing else. Reading is bounded so that an endless or garbage
 * stream (/dev/zero, a huge file) is refused after a few MB at most: header,
 * "end" and trailing lines hold at most FA_LINE_SHORT bytes, a bin line at most
 * FA_LINE_BIN(L) (about 40 bytes a mean, a saved one needs at most 25), at most
 * FA_TRAILING_LINES blank lines may follow "end", and a NUL byte stops at once. */
#include <ctype.h>
#include <errno.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "reuse_profile.h"

#define FA_BAD FORKATTN_ERR_INVALID_ARGUMENT
#define FA_MAGIC "forkattn-reuse-profile"
#define FA_VERSION 1
#define FA_LINE_SHORT 256                          /* header, "end" and trailing lines */
#define FA_LINE_BIN(L) (64 + 40 * (size_t)(L))     /* "<bin> <count>" and L means */
#define FA_TRAILING_LINES 1024                     /* blank lines accepted after "end" */

/* A short reason for an errno value (strerror is not thread-safe). */
static const char *fa_errno_text(int e) {
  switch (e) {
    case ENOENT: return "no such file or directory";
    case EACCES: return "permission denied";
    case EISDIR: return "is a directory";
    case ENOSPC: return "no space left on device";
    case EROFS: return "read-only file system";
    case ENOTDIR: return "a path component is not a directory";
    case ENAMETOOLONG: return "file name too long";
    default: return "I/O error";
  }
}

/* ---- numbers independent of LC_NUMERIC ------------------------------------ */

static const char *fa_decimal_point(void) {
  const struct lconv *lc = localeconv();
  return lc && lc->decimal_point && lc->decimal_point[0] ? lc->decimal_point : ".";
}

/* x with `digits` significant digits and '.' as the decimal point. */
static void fa_fmt(char *buf, size_t n, double x, int digits) {
  snprintf(buf, n, "%.*g", digits, x);
  const char *dp = fa_decimal_point();
  if (!strcmp(dp, ".")) return;
  char *at = strstr(buf, dp);
  if (!at) return;
  const size_t dl = strlen(dp);
  *at = '.';
  memmove(at + 1, at + dl, strlen(at + dl) + 1);
}

/* strtod/strtoll skip leading white space, but tokens are split at blanks only: a token that
 * starts with another white-space character ('\r', '\v', '\f') is not a number. */
static int fa_starts_number(const char *tok) { return *tok && !isspace((unsigned char)*tok); }

/* A whole token as a double ('.' as the decimal point). 0 or -1. */
static int fa_parse_double(const char *tok, double *x) {
  if (!fa_starts_number(tok)) return -1;
  char buf[96];
  const char *dp = fa_decimal_point();
  const size_t dl = strlen(dp), tl = strlen(tok);
  if (tl == 0 || tl + dl >= sizeof buf) return -1;
  const char *dot = strchr(tok, '.');
  if (dot && strcmp(dp, ".")) { /* rewrite '.' as the locale's point for strtod */
    const size_t pre = (size_t)(dot - tok);
    memcpy(buf, tok, pre);
    memcpy(buf + pre, dp, dl);
    strcpy(buf + pre + dl, dot + 1);
  } else {
    strcpy(buf, tok);
  }
  char *end;
  errno = 0;
  *x = strtod(buf, &end);
  return *end == '\0' && end != buf ? 0 : -1; /* ERANGE: out-of-range values fail the range checks */
}

/* A whole token as a decimal int64. 0 or -1. */
static int fa_parse_i64(const char *tok, int64_t *v) {
  if (!fa_starts_number(tok)) return -1;
  char *end;
  errno = 0;
  const long long x = strtoll(tok, &end, 10);
  if (end == tok || *end != '\0' || errno == ERANGE) return -1;
  *v = (int64_t)x;
  return 0;
}

/* ---- save ------------------------------------------------------------------ */

forkattn_status forkattn_reuse_profile_save(forkattn_ctx *ctx, const forkattn_reuse_profile *profile,
                                            const char *path) {
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!profile) return fa_fail(ctx, FA_BAD, "profile: is NULL");
  if (!path || !path[0]) return fa_fail(ctx, FA_BAD, "path: is NULL or empty");
  FILE *f = fopen(path, "w");
  if (!f) return fa_fail(ctx, FA_BAD, "path: cannot open '%s' for writing (%s)", path, fa_errno_text(errno));
  errno = 0;
  const int64_t L = profile->layers;
  int nbins = 0;
  for (int k = 0; k < FA_PROFILE_BINS; k++) nbins += profile->count[k] > 0;
  char num[64];
  fa_fmt(num, sizeof num, (double)profile->threshold, 9);
  int bad = fprintf(f, "%s %d\nlayers %lld\nthreshold %s\nbins %d\n", FA_MAGIC, FA_VERSION, (long long)L, num,
                    nbins) < 0;
  for (int k = 0; k < FA_PROFILE_BINS && !bad; k++) {
    if (!profile->count[k]) continue;
    bad |= fprintf(f, "%d %lld", k, (long long)profile->count[k]) < 0;
    for (int64_t l = 0; l < L && !bad; l++) {
      fa_fmt(num, sizeof num, profile->mean[(int64_t)k * L + l], 17);
      bad |= fprintf(f, " %s", num) < 0;
    }
    bad |= fputc('\n', f) == EOF;
  }
  bad |= fputs("end\n", f) == EOF;
  bad |= ferror(f) != 0;
  int e = bad ? errno : 0;
  if (fclose(f)) {
    bad = 1;
    if (!e) e = errno;
  }
  if (bad) return fa_fail(ctx, FA_BAD, "path: writing '%s' failed (%s)", path, fa_errno_text(e));
  return FORKATTN_OK;
}

/* ---- load ------------------------------------------------------------------ */

typedef struct {
  FILE *f;
  const char *path;
  char *buf; /* the current line, NUL-terminated, end-of-line removed */
  size_t cap;
  size_t max_line; /* longest line accepted now, end-of-line excluded */
  int64_t lineno;
  char *cur; /* tokenizer position in buf */
} fa_reader;

/* Next line: 1, 0 at end of file, -1 out of memory, -2 a NUL byte in it,
 * -3 a read error, -4 longer than r->max_line (a '\r' before the '\n' aside).
 * On -2 and -4 reading stops there, so the line is never buffered whole. */
static int fa_next_line(fa_reader *r) {
  size_t len = 0;
  int c;
  if ((c = fgetc(r->f)) == EOF) return ferror(r->f) ? -3 : 0;
  for (; c != EOF && c != '\n'; c = fgetc(r->f)) {
    if (c == '\0' || len > r->max_line) { /* len may reach max_line + 1: a CR counts below */
      r->lineno++;
      return c == '\0' ? -2 : -4;
    }
    if (len + 2 > r->cap) {
      const size_t cap = r->cap ? 2 * r->cap : 256;
      char *nb = fa_malloc(cap);
      if (!nb) return -1;
      if (len) memcpy(nb, r->buf, len);
      fa_free(r->buf);
      r->buf = nb;
      r->cap = cap;
    }
    r->buf[len++] = (char)c;
  }
  if (c == EOF && ferror(r->f)) return -3;
  if (!r->buf) { /* an empty last line before anything was buffered */
    if (!(r->buf = fa_malloc(256))) return -1;
    r->cap = 256;
  }
  if (len && r->buf[len - 1] == '\r') len--;
  r->lineno++;
  if (len > r->max_line) return -4;
  r->buf[len] = '\0';
  r->cur = r->buf;
  return 1;
}

/* Next space-separated token of the line, or NULL. */
static const char *fa_token(fa_reader *r) {
  char *s = r->cur;
  while (*s == ' ' || *s == '\t') s++;
  if (!*s) {
    r->cur = s;
    return NULL;
  }
  char *t = s;
  while (*s && *s != ' ' && *s != '\t') s++;
  if (*s) *s++ = '\0';
  r->cur = s;
  return t;
}

/* Failure at the current line: "path: '<file>' line <n>: <message>". */
#define FA_LOAD_FAIL(r, ...) fa_load_fail(ctx, (r), __VA_ARGS__)
static forkattn_status fa_load_fail(forkattn_ctx *ctx, const fa_reader *r, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static forkattn_status fa_load_fail(forkattn_ctx *ctx, const fa_reader *r, const char *fmt, ...) {
  char msg[FA_MSG_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return fa_fail(ctx, FA_BAD, "path: '%s' line %lld: %s", r->path, (long long)r->lineno, msg);
}

/* The failure of a fa_next_line() result below 0. */
static forkattn_status fa_line_fail(forkattn_ctx *ctx, const fa_reader *r, int rc) {
  if (rc == -1) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "path: out of memory reading '%s'", r->path);
  if (rc == -2) return FA_LOAD_FAIL(r, "contains a NUL byte (not a text file)");
  if (rc == -4) return FA_LOAD_FAIL(r, "is longer than %zu bytes (not a reuse-depth profile line)", r->max_line);
  return fa_fail(ctx, FA_BAD, "path: reading '%s' failed (%s)", r->path, fa_errno_text(errno));
}

/* Read a line that must exist (else the file is truncated). */
static forkattn_status fa_need_line(forkattn_ctx *ctx, fa_reader *r, const char *what) {
  const int rc = fa_next_line(r);
  if (rc == 1) return FORKATTN_OK;
  if (rc < 0) return fa_line_fail(ctx, r, rc);
  if (r->lineno == 0) return fa_fail(ctx, FA_BAD, "path: '%s' is empty (expected %s)", r->path, what);
  return fa_fail(ctx, FA_BAD, "path: '%s' is truncated after line %lld (expected %s)", r->path, (long long)r->lineno,
                 what);
}

/* "<key> <int64>" with the value in [lo, hi], nothing else on the line. */
static forkattn_status fa_keyed_int(forkattn_ctx *ctx, fa_reader *r, const char *key, int64_t lo, int64_t hi,
                                    int64_t *v) {
  forkattn_status st = fa_need_line(ctx, r, key);
  if (st) return st;
  const char *k = fa_token(r), *t = fa_token(r);
  if (!k || strcmp(k, key) || !t || fa_token(r)) return FA_LOAD_FAIL(r, "expected '%s <integer>'", key);
  if (fa_parse_i64(t, v) || *v < lo || *v > hi)
    return FA_LOAD_FAIL(r, "%s '%s' must be an integer in %lld..%lld", key, t, (long long)lo, (long long)hi);
  return FORKATTN_OK;
}

/* Header through "bins N": creates *p. */
static forkattn_status fa_load_header(forkattn_ctx *ctx, fa_reader *r, forkattn_reuse_profile **p, int64_t *nbins) {
  forkattn_status st = fa_need_line(ctx, r, "the header '" FA_MAGIC " 1'");
  if (st) return st;
  const char *magic = fa_token(r), *ver = fa_token(r);
  if (!magic || strcmp(magic, FA_MAGIC) || !ver || fa_token(r))
    return FA_LOAD_FAIL(r, "not a reuse-depth profile (the first line must be '%s %d')", FA_MAGIC, FA_VERSION);
  int64_t version;
  if (fa_parse_i64(ver, &version) || version != FA_VERSION)
    return FA_LOAD_FAIL(r, "format version '%s' is not supported (this library reads version %d)", ver, FA_VERSION);
  int64_t layers;
  if ((st = fa_keyed_int(ctx, r, "layers", 1, FA_PROFILE_MAX_LAYERS, &layers))) return st;
  if ((st = fa_need_line(ctx, r, "'threshold <value>'"))) return st;
  const char *k = fa_token(r), *t = fa_token(r);
  double thr;
  if (!k || strcmp(k, "threshold") || !t || fa_token(r)) return FA_LOAD_FAIL(r, "expected 'threshold <value>'");
  if (fa_parse_double(t, &thr) || !isfinite(thr) || thr < 0.0 || thr > 1.0)
    return FA_LOAD_FAIL(r, "threshold '%s' must be a finite number in [0, 1]", t);
  if ((st = fa_keyed_int(ctx, r, "bins", 0, FA_PROFILE_BINS, nbins))) return st;
  return fa_profile_new(ctx, layers, thr, p);
}

/* Bin line i of nbins, "<bin> <count> <means...>"; prev: the previous line's
 * bin or -1. */
static forkattn_status fa_load_bin(forkattn_ctx *ctx, fa_reader *r, forkattn_reuse_profile *p, int64_t i,
                                   int64_t nbins, int64_t *prev) {
  const int64_t L = p->layers;
  const char *tb = fa_token(r), *tc = fa_token(r);
  int64_t bin, count;
  if (tb && !tc && !strcmp(tb, "end"))
    return FA_LOAD_FAIL(r, "'end' after %lld of %lld bin lines (the bins line says %lld)", (long long)i,
                        (long long)nbins, (long long)nbins);
  if (!tb || !tc) return FA_LOAD_FAIL(r, "expected '<bin> <count>' and %lld means", (long long)L);
  if (fa_parse_i64(tb, &bin) || bin < 0 || bin >= FA_PROFILE_BINS)
    return FA_LOAD_FAIL(r, "bin '%s' must be an integer in 0..%d", tb, FA_PROFILE_BINS - 1);
  if (bin <= *prev)
    return FA_LOAD_FAIL(r, "bin %lld follows bin %lld (bins must be strictly ascending)", (long long)bin,
                        (long long)*prev);
  if (fa_parse_i64(tc, &count) || count < 1)
    return FA_LOAD_FAIL(r, "count '%s' of bin %lld must be an integer >= 1", tc, (long long)bin);
  double *m = p->mean + bin * L;
  int64_t n = 0;
  for (const char *t; (t = fa_token(r)); n++) {
    double x;
    if (n >= L) continue; /* counted for the message below */
    if (fa_parse_double(t, &x) || !isfinite(x))
      return FA_LOAD_FAIL(r, "mean %lld of bin %lld, '%s', is not a finite number", (long long)n, (long long)bin, t);
    if (x < -1.0 || x > 1.0)
      return FA_LOAD_FAIL(r, "mean %lld of bin %lld, %s, is outside [-1, 1]", (long long)n, (long long)bin, t);
    m[n] = x;
  }
  if (n != L)
    return FA_LOAD_FAIL(r, "bin %lld has %lld means, the profile has %lld layers", (long long)bin, (long long)n,
                        (long long)L);
  p->count[bin] = count;
  *prev = bin;
  return FORKATTN_OK;
}

static forkattn_status fa_load_body(forkattn_ctx *ctx, fa_reader *r, forkattn_reuse_profile **out) {
  forkattn_reuse_profile *p = NULL;
  int64_t nbins, prev = -1;
  forkattn_status st = fa_load_header(ctx, r, &p, &nbins);
  if (!st) r->max_line = FA_LINE_BIN(p->layers);
  for (int64_t i = 0; !st && i < nbins; i++) {
    char what[64];
    snprintf(what, sizeof what, "bin line %lld of %lld", (long long)i + 1, (long long)nbins);
    if (!(st = fa_need_line(ctx, r, what))) st = fa_load_bin(ctx, r, p, i, nbins, &prev);
  }
  if (!st && !(st = fa_need_line(ctx, r, "'end'"))) {
    const char *t = fa_token(r);
    if (!t || strcmp(t, "end") || fa_token(r))
      st = FA_LOAD_FAIL(r, "expected 'end' after %lld bin lines", (long long)nbins);
  }
  r->max_line = FA_LINE_SHORT;
  const int64_t end_line = r->lineno;
  for (int rc; !st && (rc = fa_next_line(r)) != 0;) {
    if (rc == -2 || (rc == 1 && fa_token(r))) st = FA_LOAD_FAIL(r, "unexpected content after 'end'");
    else if (rc < 0) st = fa_line_fail(ctx, r, rc);
    else if (r->lineno - end_line > FA_TRAILING_LINES)
      st = FA_LOAD_FAIL(r, "more than %d blank lines after 'end'", FA_TRAILING_LINES);
  }
  if (st) {
    forkattn_reuse_profile_free(p);
    return st;
  }
  fa_profile_refresh(p);
  *out = p;
  return FORKATTN_OK;
}

forkattn_status forkattn_reuse_profile_load(forkattn_ctx *ctx, const char *path, forkattn_reuse_profile **profile) {
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!profile) return fa_fail(ctx, FA_BAD, "profile: the output pointer is NULL");
  *profile = NULL;
  if (!path || !path[0]) return fa_fail(ctx, FA_BAD, "path: is NULL or empty");
  fa_reader r = {0};
  r.path = path;
  r.max_line = FA_LINE_SHORT;
  if (!(r.f = fopen(path, "r")))
    return fa_fail(ctx, FA_BAD, "path: cannot open '%s' for reading (%s)", path, fa_errno_text(errno));
  forkattn_status st = fa_load_body(ctx, &r, profile);
  fclose(r.f);
  fa_free(r.buf);
  return st;
}
