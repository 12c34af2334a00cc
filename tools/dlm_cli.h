/* Options and setup shared by `forkattn demo dlm` and `forkattn bench dlm`:
 * the context, the synthetic model, and the calibrated reuse-depth profile. */
#ifndef FORKATTN_TOOLS_DLM_CLI_H
#define FORKATTN_TOOLS_DLM_CLI_H
#include "dlm_serve.h"

typedef struct dlm_cli {
  dlm_config model;
  dlm_workload_opts work;
  dlm_serve_opts serve;
  forkattn_backend backend;
  double threshold;
  int64_t calib_seq; /* tokens per calibration sequence */
  int64_t seq;       /* bench: tokens per request */
  int64_t cache_mib;
  int json;
  int bench;
} dlm_cli;

/* Defaults of the demo (bench = 0) or the benchmark (bench = 1). */
void dlm_cli_defaults(dlm_cli *o, int bench);
/* Parse from argv[first]: 0, 1 for --help (usage printed), -1 on error (message printed). */
int dlm_cli_parse(int argc, char **argv, int first, dlm_cli *o);

typedef struct dlm_setup {
  forkattn_ctx *ctx;
  dlm_model model;
  forkattn_reuse_profile *profile;
  dlm_calib calib;
  double init_seconds;
} dlm_setup;

/* Context, model and calibration (ratios 0.1, 0.2, .. 0.9); 0 or -1 (printed). */
int dlm_setup_make(dlm_setup *s, const dlm_cli *o);
void dlm_setup_free(dlm_setup *s);
/* The start of `demo dlm` (bench = 0) and `bench dlm` (1): defaults, options from argv[2], then
 * dlm_setup_make. -1: go on (the caller frees @p s); else the command's exit status (nothing
 * left to free). */
int dlm_cli_start(int argc, char **argv, int bench, dlm_cli *o, dlm_setup *s);
/* The banner every run prints: synthetic weights, model shape, backend. */
void dlm_print_model(const dlm_setup *s, const dlm_cli *o, const char *title);
/* The calibration table and b(r) at r = 0.1 .. 0.9. */
void dlm_print_calibration(const dlm_setup *s, const dlm_cli *o);
#endif
