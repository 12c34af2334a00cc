/* `forkattn bench ... --sweep K=V,... --plot FILE`: sweep parsing, the .dat
 * table, the gnuplot script, and the gnuplot run (used by bench prefix and tree). */
#ifndef FORKATTN_TOOLS_PLOT_H
#define FORKATTN_TOOLS_PLOT_H
#include <stdint.h>

#define TOOL_SWEEP_MAX 32

typedef struct tool_sweep {
  char key[16];                  /* what is swept: "p", "leaves", "shape", ... */
  int count;                     /* values */
  char text[TOOL_SWEEP_MAX][24]; /* each value as written */
  int64_t num[TOOL_SWEEP_MAX];   /* numeric sweeps: parsed by the caller */
} tool_sweep;

/* Take "--sweep V" and "--plot F" out of argv[first..argc) (*argc shrinks;
 * a NULL stays NULL when absent). 0, or -1 (message printed). */
int tool_plot_take_args(int *argc, char **argv, int first, const char **sweep, const char **plot);
/* "key=v1,v2,...": 0, or -1 (message printed). Values are checked by the caller. */
int tool_sweep_parse(const char *arg, tool_sweep *sw);
/* FILE ends in .svg or .png: 0, else -1 (message printed). */
int tool_plot_check_name(const char *file);

/* Columns of one execution (series) in a row of values (0-based, the x value not counted). */
typedef struct tool_plot_series {
  const char *name;
  int fwd, both, mem;
} tool_plot_series;

typedef struct tool_plot {
  const char *file;          /* out.svg or out.png; out.dat and out.gp next to it */
  const char *xlabel;        /* with units */
  const char *title;         /* shape, dtype, backend; the date is appended */
  const char *note;          /* time panel subtitle, e.g. what the labels show */
  int categorical;           /* x values are names, one tick each, in order */
  int ncols;                 /* values per row */
  const char *const *cols;   /* their .dat names (no spaces) */
  int nseries;               /* at most 4 */
  tool_plot_series series[4];
  int label_col;             /* -1, or a column printed as "%.1fx" above the last series' fwd+bwd point */
} tool_plot;

/* rows: sw->count rows of p->ncols values (NaN: missing). Writes the .dat and
 * .gp and runs gnuplot on them; without gnuplot says how to render and
 * returns 0. -1 when a file cannot be written or gnuplot fails. */
int tool_plot_write(const tool_plot *p, const tool_sweep *sw, const double *rows);
#endif
