/* --sweep / --plot for `forkattn bench` (see plot.h). The .gp script names
 * its files relative to its own directory; gnuplot runs there. */
#include "plot.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int tool_plot_take_args(int *argc, char **argv, int first, const char **sweep, const char **plot) {
  int w = first;
  for (int i = first; i < *argc; i++) {
    const char **dst = !strcmp(argv[i], "--sweep") ? sweep : !strcmp(argv[i], "--plot") ? plot : NULL;
    if (!dst) {
      argv[w++] = argv[i];
      continue;
    }
    if (i + 1 >= *argc) {
      fprintf(stderr, "forkattn: option %s needs a value\n", argv[i]);
      return -1;
    }
    *dst = argv[++i];
  }
  *argc = w;
  argv[w] = NULL;
  return 0;
}

int tool_sweep_parse(const char *arg, tool_sweep *sw) {
  memset(sw, 0, sizeof *sw);
  const char *eq = strchr(arg, '=');
  if (!eq || eq == arg || (size_t)(eq - arg) >= sizeof sw->key) {
    fprintf(stderr, "forkattn: --sweep wants KEY=V1,V2,... (got '%s')\n", arg);
    return -1;
  }
  memcpy(sw->key, arg, (size_t)(eq - arg));
  for (const char *v = eq + 1;;) {
    const char *end = strchr(v, ',');
    const size_t len = end ? (size_t)(end - v) : strlen(v);
    if (!len || len >= sizeof sw->text[0] || sw->count == TOOL_SWEEP_MAX) {
      fprintf(stderr, "forkattn: --sweep %s: empty or too long value, or more than %d values\n", sw->key,
              TOOL_SWEEP_MAX);
      return -1;
    }
    memcpy(sw->text[sw->count++], v, len);
    if (!end) break;
    v = end + 1;
  }
  return 0;
}

static int plot_ext(const char *file, const char *ext) {
  const size_t n = strlen(file), e = strlen(ext);
  return n > e && !strcmp(file + n - e, ext) && file[n - e - 1] != '/';
}

int tool_plot_check_name(const char *file) {
  if (plot_ext(file, ".svg") || plot_ext(file, ".png")) return 0;
  fprintf(stderr, "forkattn: --plot wants a file name ending in .svg or .png (got '%s')\n", file);
  return -1;
}

/* A gnuplot double-quoted string. */
static void gp_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '\n') fputs("\\n", f);
    else {
      if (*s == '"' || *s == '\\') fputc('\\', f);
      fputc(*s, f);
    }
  }
  fputc('"', f);
}

/* A POSIX shell single-quoted word appended to dst (room checked by the caller). */
static void sh_word(char *dst, const char *s) {
  dst += strlen(dst);
  *dst++ = '\'';
  for (; *s; s++) {
    if (*s == '\'') {
      memcpy(dst, "'\\''", 4);
      dst += 4;
    } else *dst++ = *s;
  }
  *dst++ = '\'';
  *dst = '\0';
}

static void gp_value(FILE *f, double v) {
  if (v != v) fputs(" NaN", f);
  else fprintf(f, " %.6g", v);
}

static int write_dat(const tool_plot *p, const tool_sweep *sw, const double *rows, const char *path,
                     const char *title) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "# %s\n# %s", title, sw->key);
  for (int c = 0; c < p->ncols; c++) fprintf(f, " %s", p->cols[c]);
  fputc('\n', f);
  for (int i = 0; i < sw->count; i++) {
    if (p->categorical) fputs(sw->text[i], f);
    else fprintf(f, "%lld", (long long)sw->num[i]);
    for (int c = 0; c < p->ncols; c++) gp_value(f, rows[(size_t)i * (size_t)p->ncols + (size_t)c]);
    fputc('\n', f);
  }
  return fclose(f) ? -1 : 0;
}

/* blue, green, purple; the last series (replicated) red */
static const char *const gp_colors[4] = {"#1f77b4", "#2ca02c", "#9467bd", "#d62728"};
static const int gp_points[4] = {7, 9, 13, 5};

static int gp_style(const tool_plot *p, int s) { return s == p->nseries - 1 ? 3 : s; }

/* "using X:col" with the x column or the row index (categories), xtic labels on the first. */
static void gp_using(FILE *f, const tool_plot *p, int col, int first) {
  if (p->categorical) fprintf(f, "using 0:%d%s", col + 2, first ? ":xtic(1)" : "");
  else fprintf(f, "using 1:%d", col + 2);
}

/* One panel: per series the fwd+bwd line (solid) and, for time, the fwd line (dashed). */
static void gp_panel(FILE *f, const tool_plot *p, const char *dat, int time) {
  fputs("plot ", f);
  for (int s = 0; s < p->nseries; s++) {
    const tool_plot_series *x = &p->series[s];
    const char *sep = s ? ", \\\n     " : "";
    fputs(sep, f);
    gp_str(f, s ? "" : dat);
    fputc(' ', f);
    gp_using(f, p, time ? x->both : x->mem, !s);
    fprintf(f, " with linespoints lw 2 pt %d ps 1.2 lc rgb \"%s\" title ", gp_points[gp_style(p, s)],
            gp_colors[gp_style(p, s)]);
    char t[96];
    snprintf(t, sizeof t, "%s%s", x->name, time ? " fwd+bwd" : "");
    gp_str(f, t);
  }
  for (int s = 0; time && s < p->nseries; s++) {
    const tool_plot_series *x = &p->series[s];
    fputs(", \\\n     \"\" ", f);
    gp_using(f, p, x->fwd, 0);
    fprintf(f, " with linespoints lw 1 dt 2 pt %d ps 0.8 lc rgb \"%s\" title ", gp_points[gp_style(p, s)],
            gp_colors[gp_style(p, s)]);
    char t[96];
    snprintf(t, sizeof t, "%s fwd", x->name);
    gp_str(f, t);
  }
  if (time && p->label_col >= 0) {
    const tool_plot_series *x = &p->series[p->nseries - 1];
    fprintf(f, ", \\\n     \"\" using %s:%d:(sprintf(\"%%.2fx\", $%d)) with labels boxed offset 0,1.1 tc rgb \"%s\"",
            p->categorical ? "0" : "1", x->both + 2, p->label_col + 2, gp_colors[3]);
    fputs(" notitle", f);
  }
  fputc('\n', f);
}

/* Log y axis of a panel: range and 1-2-5-style tics from the plotted values. */
static void gp_yaxis(FILE *f, const tool_plot *p, const tool_sweep *sw, const double *rows, int time) {
  double lo = HUGE_VAL, hi = 0;
  for (int i = 0; i < sw->count; i++)
    for (int s = 0; s < p->nseries; s++)
      for (int j = 0; j < (time ? 2 : 1); j++) {
        const int c = time ? (j ? p->series[s].fwd : p->series[s].both) : p->series[s].mem;
        const double v = rows[(size_t)i * (size_t)p->ncols + (size_t)c];
        if (v > 0 && v < HUGE_VAL) {
          lo = fmin(lo, v);
          hi = fmax(hi, v);
        }
      }
  if (hi <= 0) {
    fputs("set autoscale y\nset ytics autofreq\n", f);
    return;
  }
  lo /= 1.3;
  hi *= time && p->label_col >= 0 ? 2.0 : 1.3; /* room for the labels */
  static const double mant[3][8] = {{1}, {1, 2, 5}, {1, 1.5, 2, 3, 4, 5, 6, 8}};
  static const int nm[3] = {1, 3, 8};
  const int e0 = (int)floor(log10(lo)), e1 = (int)ceil(log10(hi));
  int set = 2, count = 0;
  for (; set > 0; set--, count = 0) { /* the densest set with at most 10 tics */
    for (int e = e0; e <= e1; e++)
      for (int m = 0; m < nm[set]; m++) count += mant[set][m] * pow(10, e) >= lo && mant[set][m] * pow(10, e) <= hi;
    if (count <= 10) break;
  }
  fprintf(f, "set yrange [%.6g:%.6g]\nset ytics (", lo, hi);
  int first = 1;
  for (int e = e0; e <= e1; e++)
    for (int m = 0; m < nm[set]; m++) {
      const double v = mant[set][m] * pow(10, e);
      if (v < lo || v > hi) continue;
      fprintf(f, "%s%.6g", first ? "" : ", ", v);
      first = 0;
    }
  fputs(")\n", f);
}

static int write_gp(const tool_plot *p, const tool_sweep *sw, const double *rows, const char *path,
                    const char *dat, const char *out, const char *title) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
  fprintf(f, "# written by forkattn bench --plot; render with `gnuplot %s` in this directory\n", name);
  if (plot_ext(out, ".png"))
    fputs("if (strstrt(GPVAL_TERMINALS, \"pngcairo\") > 0) {\n"
          "  set terminal pngcairo size 1400,560 noenhanced font \"sans,11\" background rgb \"white\"\n"
          "} else {\n"
          "  set terminal png size 1400,560 noenhanced background rgb \"white\"\n"
          "}\n", f);
  else fputs("set terminal svg size 1400,560 fixed noenhanced font \"sans,13\" background rgb \"white\"\n", f);
  fputs("set output ", f);
  gp_str(f, out);
  fputs("\nset datafile missing \"NaN\"\nset multiplot layout 1,2 title ", f);
  gp_str(f, title);
  fputs(" font \",14\"\nset grid\nset key below\nset style textbox opaque noborder\n"
        "set logscale y 10\nset xlabel ", f);
  gp_str(f, p->xlabel);
  if (p->categorical) fprintf(f, "\nset xrange [-0.5:%d.5]\n", sw->count - 1);
  else {
    fprintf(f, "\nset logscale x 2\nset xrange [%g:%g]\nset xtics (", (double)sw->num[0] / 1.25,
            (double)sw->num[sw->count - 1] * 1.25);
    for (int i = 0; i < sw->count; i++)
      fprintf(f, "%s\"%lld\" %lld", i ? ", " : "", (long long)sw->num[i], (long long)sw->num[i]);
    fputs(")\n", f);
  }
  fputs("set ylabel \"time [ms]\"\nset title ", f);
  gp_str(f, p->note);
  fputc('\n', f);
  gp_yaxis(f, p, sw, rows, 1);
  gp_panel(f, p, dat, 1);
  fputs("set ylabel \"memory [MiB]\"\nset title \"peak memory: tensors + library workspace\"\n", f);
  gp_yaxis(f, p, sw, rows, 0);
  gp_panel(f, p, dat, 0);
  fputs("unset multiplot\n", f);
  return fclose(f) ? -1 : 0;
}

int tool_plot_write(const tool_plot *p, const tool_sweep *sw, const double *rows) {
  const size_t n = strlen(p->file), stem = n - 4; /* ".svg" / ".png" */
  const char *slash = strrchr(p->file, '/');
  const size_t base = slash ? (size_t)(slash - p->file) + 1 : 0;
  char *dat = malloc(stem + 5), *gp = malloc(stem + 4), *dir = malloc(base + 2);
  char *cmd = malloc(8 * n + 64); /* each quoted path at most 4n + 2 */
  int rc = -1;
  if (!dat || !gp || !dir || !cmd) goto done;
  memcpy(dat, p->file, stem);
  strcpy(dat + stem, ".dat");
  memcpy(gp, p->file, stem);
  strcpy(gp + stem, ".gp");
  if (base) {
    memcpy(dir, p->file, base);
    dir[base] = '\0';
  } else strcpy(dir, ".");
  char date[32], title[1024];
  const time_t now = time(NULL);
  if (!strftime(date, sizeof date, "%Y-%m-%d %H:%M", localtime(&now))) strcpy(date, "?");
  snprintf(title, sizeof title, "%s, %s", p->title, date);
  if (write_dat(p, sw, rows, dat, title) || write_gp(p, sw, rows, gp, dat + base, p->file + base, title)) {
    fprintf(stderr, "forkattn: cannot write %s or %s\n", dat, gp);
    goto done;
  }
  strcpy(cmd, "cd ");
  sh_word(cmd, dir);
  strcat(cmd, " && gnuplot ");
  sh_word(cmd, gp + base);
  if (!system(NULL) || system("command -v gnuplot >/dev/null 2>&1")) {
    fprintf(stderr, "forkattn: wrote %s and %s; gnuplot is not installed, so no %s.\n"
            "  render it with: %s\n  (Debian: apt-get install gnuplot-nox)\n", dat, gp, p->file + base, cmd);
    rc = 0;
    goto done;
  }
  if (system(cmd)) {
    fprintf(stderr, "forkattn: gnuplot failed: %s\n", cmd);
    goto done;
  }
  fprintf(stderr, "forkattn: wrote %s, %s, %s\n", dat, gp, p->file);
  rc = 0;
done:
  free(dat);
  free(gp);
  free(dir);
  free(cmd);
  return rc;
}
