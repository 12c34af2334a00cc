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
/* Median of n doubles (sorts in place). */
double tool_median(double *x, int n);
#endif
