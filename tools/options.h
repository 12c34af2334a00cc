/* Command-line options shared by `forkattn demo` and `forkattn bench`. */
#ifndef FORKATTN_TOOLS_OPTIONS_H
#define FORKATTN_TOOLS_OPTIONS_H
#include "group.h"

typedef struct tool_opts {
  tool_shape shape;
  forkattn_backend backend;
  int repeats;
  int json;     /* bench: JSON lines only */
  int no_replicated;
  unsigned long long seed;
} tool_opts;

/* Parse --n --p --r --hq --hkv --d --dtype --mask --backend --repeats --seed
 * --json --no-replicated starting at argv[first]; returns 0, 1 for --help, -1 on error. */
int tool_parse(int argc, char **argv, int first, tool_opts *o);
void tool_usage(const char *cmd, const tool_opts *defaults);
/* Shared spellings: "f32" / "bf16" / "f16", "causal" / "bidirectional", "auto" / "cpu" / "gpu". */
const char *tool_dtype_name(forkattn_dtype t);
const char *tool_mask_name(forkattn_mask m);
/* Parsers: 0 on success, -1 on a bad value (*out untouched). */
int tool_parse_i64(const char *v, long long lo, long long hi, int64_t *out);
int tool_parse_dtype(const char *v, forkattn_dtype *out);
int tool_parse_mask(const char *v, forkattn_mask *out);
int tool_parse_backend(const char *v, forkattn_backend *out);
/* Median of n doubles (sorts in place). */
double tool_median(double *x, int n);
#endif
