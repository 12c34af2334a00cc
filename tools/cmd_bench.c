/* `forkattn bench prefix`: shared vs replicated times, useful FLOP rates,
 * memory, and (CPU) OpenBLAS sgemm measured in the same run for reference.
 * Prints a table, or JSON lines with --json; --sweep runs it per size, --plot
 * draws the sweep (plot.c). `bench tree`: cmd_bench_tree.c, `bench kl`: cmd_bench_kl.c, `bench dlm`: cmd_bench_dlm.c. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "json_out.h"
#include "measure.h"
#include "plot.h"

/* OpenBLAS sgemm GFLOP/s at n^3 as configured (default threads), median of 3. */
static double sgemm_gflops(int n) {
  float *a = malloc(sizeof(float) * (size_t)n * n), *b = malloc(sizeof(float) * (size_t)n * n),
        *c = malloc(sizeof(float) * (size_t)n * n);
  if (!a || !b || !c) {
    free(a); free(b); free(c);
    return 0;
  }
  for (size_t i = 0; i < (size_t)n * n; i++) {
    a[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    b[i] = (float)((i * 40503u) % 1000) * 1e-3f - 0.5f;
  }
  double t[3];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1, a, n, b, n, 0, c, n);
  for (int i = 0; i < 3; i++) {
    double t0 = tool_now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1, a, n, b, n, 0, c, n);
    t[i] = tool_now() - t0;
  }
  free(a); free(b); free(c);
  return 2.0 * n * n * (double)n / tool_median(t, 3) * 1e-9;
}

/* .dat columns of a sweep point */
enum { BP_COLS = 8 };
static const char *const bp_cols[BP_COLS] = {"shared_fwd_ms", "shared_fwdbwd_ms", "rep_fwd_ms", "rep_fwdbwd_ms",
                                             "shared_mib", "rep_mib", "ideal_speedup", "achieved_speedup"};

/* One measurement, printed. *gemm < 0: not measured yet (measured once, CPU only).
 * row (if set) gets the .dat values, backend its name. 0, or 1 on failure. */
static int bp_run(const tool_opts *opts, double *gemm_once, double *row, char *backend) {
  const tool_opts o = *opts;
  tool_result r;
  if (tool_measure(&o, &r)) return 1;
  const tool_shape *s = &o.shape;
  if (*gemm_once < 0) *gemm_once = strcmp(r.backend, "cpu") ? 0 : sgemm_gflops(2048);
  const double gemm = *gemm_once;
  double fwd_gf = r.shared.flops / r.shared.fwd_ms * 1e-6, both_gf = 3.5 * r.shared.flops / r.shared.fwdbwd_ms * 1e-6;
  double ideal = r.have_rep ? r.rep.flops / r.shared.flops : 0;
  const char *dt = tool_dtype_name(s->dtype);
  const char *mk = tool_mask_name(s->mask);
  if (!o.json) {
    printf("forkattn bench prefix: N=%lld P=%lld R=%lld heads %lld/%lld d=%lld %s %s, backend %s, median of %d\n",
           (long long)s->n, (long long)s->p, (long long)s->r, (long long)s->hq, (long long)s->hkv, (long long)s->d,
           dt, mk, r.backend, o.repeats);
    printf("%-11s %10s %12s %12s %16s %10s\n", "layout", "fwd ms", "fwd+bwd ms", "fwd GFLOP/s", "fwd+bwd GFLOP/s", "mem MiB");
    printf("%-11s %10.3f %12.3f %12.1f %16.1f %10.1f\n", "shared", r.shared.fwd_ms, r.shared.fwdbwd_ms, fwd_gf, both_gf,
           (r.shared.tensor_bytes + r.shared.workspace_bytes) / 1048576.0);
    if (r.have_rep)
      printf("%-11s %10.3f %12.3f %12.1f %16.1f %10.1f   (GFLOP/s on replicated FLOPs)\n", "replicated", r.rep.fwd_ms,
             r.rep.fwdbwd_ms, r.rep.flops / r.rep.fwd_ms * 1e-6, 3.5 * r.rep.flops / r.rep.fwdbwd_ms * 1e-6,
             (r.rep.tensor_bytes + r.rep.workspace_bytes) / 1048576.0);
    if (r.have_rep)
      printf("speedup fwd %.2fx, fwd+bwd %.2fx; ideal %.2fx; fwd+bwd reaches %.0f%% of ideal\n",
             r.rep.fwd_ms / r.shared.fwd_ms, r.rep.fwdbwd_ms / r.shared.fwdbwd_ms, ideal,
             100.0 * r.rep.fwdbwd_ms / r.shared.fwdbwd_ms / ideal);
    if (gemm > 0)
      printf("OpenBLAS sgemm 2048^3 (same run): %.1f GFLOP/s; shared fwd useful rate = %.0f%% of it\n", gemm,
             100.0 * fwd_gf / gemm);
    if (r.have_rep)
      printf("max rel error shared vs replicated: o %.1e dq %.1e dk %.1e dv %.1e\n", r.err.o, r.err.dq, r.err.dk,
             r.err.dv);
  }
  tool_json_printf("{\"bench\":\"prefix\",\"backend\":\"%s\",\"n\":%lld,\"p\":%lld,\"r\":%lld,\"hq\":%lld,\"hkv\":%lld,"
         "\"d\":%lld,\"dtype\":\"%s\",\"mask\":\"%s\",\"repeats\":%d,"
         "\"shared_fwd_ms\":%.4f,\"shared_fwdbwd_ms\":%.4f,\"shared_fwd_gflops\":%.2f,\"shared_fwdbwd_gflops\":%.2f,"
         "\"shared_mem_bytes\":%.0f,\"useful_flops_fwd\":%.6g,\"replicated_flops_fwd\":%.6g",
         r.backend, (long long)s->n, (long long)s->p, (long long)s->r, (long long)s->hq, (long long)s->hkv,
         (long long)s->d, dt, mk, o.repeats, r.shared.fwd_ms, r.shared.fwdbwd_ms, fwd_gf, both_gf,
         r.shared.tensor_bytes + r.shared.workspace_bytes, r.shared.flops, tool_flops_replicated(s));
  if (r.have_rep)
    tool_json_printf(",\"rep_fwd_ms\":%.4f,\"rep_fwdbwd_ms\":%.4f,\"rep_mem_bytes\":%.0f,\"speedup_fwd\":%.3f,"
           "\"speedup_fwdbwd\":%.3f,\"ideal_speedup\":%.3f,\"max_rel_err\":%.3g",
           r.rep.fwd_ms, r.rep.fwdbwd_ms, r.rep.tensor_bytes + r.rep.workspace_bytes, r.rep.fwd_ms / r.shared.fwd_ms,
           r.rep.fwdbwd_ms / r.shared.fwdbwd_ms, ideal, tool_errors_max(&r.err));
  if (gemm > 0) tool_json_printf(",\"sgemm_gflops\":%.1f,\"fwd_over_sgemm\":%.3f", gemm, fwd_gf / gemm);
  tool_json_printf("}\n");
  fflush(stdout);
  if (row) {
    const double mib = 1.0 / 1048576.0, na = NAN;
    const int h = r.have_rep;
    const double v[BP_COLS] = {r.shared.fwd_ms, r.shared.fwdbwd_ms, h ? r.rep.fwd_ms : na, h ? r.rep.fwdbwd_ms : na,
                               (r.shared.tensor_bytes + r.shared.workspace_bytes) * mib,
                               h ? (r.rep.tensor_bytes + r.rep.workspace_bytes) * mib : na, h ? ideal : na,
                               h ? r.rep.fwdbwd_ms / r.shared.fwdbwd_ms : na};
    memcpy(row, v, sizeof v);
    snprintf(backend, 16, "%s", r.backend);
  }
  return 0;
}

/* --sweep K=...: one run per value, then (--plot) the .dat, .gp and picture. */
static int bp_sweep(tool_opts *o, const char *arg, const char *plot) {
  tool_sweep sw;
  if (tool_sweep_parse(arg, &sw)) return 2;
  static const char *const keys[3] = {"n", "p", "r"};
  static const char *const xlabels[3] = {"responses N (sharing one prompt)", "prompt rows P",
                                         "rows per response R"};
  int64_t *dst[3] = {&o->shape.n, &o->shape.p, &o->shape.r};
  int k = 0;
  while (k < 3 && strcmp(sw.key, keys[k])) k++;
  if (k == 3) {
    fprintf(stderr, "forkattn: bench prefix --sweep: the key is p, n or r (got '%s')\n", sw.key);
    return 2;
  }
  for (int i = 0; i < sw.count; i++)
    if (tool_parse_i64(sw.text[i], 1, k ? 1 << 24 : 1 << 20, &sw.num[i])) {
      fprintf(stderr, "forkattn: bad --sweep value '%s' for %s\n", sw.text[i], sw.key);
      return 2;
    }
  if (plot && tool_plot_check_name(plot)) return 2;
  double rows[TOOL_SWEEP_MAX * BP_COLS], gemm = -1;
  char backend[16] = "";
  for (int i = 0; i < sw.count; i++) {
    *dst[k] = sw.num[i];
    if (bp_run(o, &gemm, rows + (size_t)i * BP_COLS, backend)) return 1;
  }
  if (!plot) return 0;
  const tool_shape *s = &o->shape;
  char title[512], sizes[96] = "", note[160];
  for (int j = 0; j < 3; j++)
    if (j != k) {
      const size_t used = strlen(sizes);
      snprintf(sizes + used, sizeof sizes - used, "%c=%lld, ", keys[j][0] - 'a' + 'A', (long long)*dst[j]);
    }
  snprintf(title, sizeof title, "forkattn bench prefix: %sheads %lld/%lld, d=%lld, %s, %s, backend %s",
           sizes, (long long)s->hq, (long long)s->hkv, (long long)s->d, tool_dtype_name(s->dtype),
           tool_mask_name(s->mask), backend);
  snprintf(note, sizeof note,
           "time (median of %d): fwd+bwd solid, fwd dashed\nlabels: fwd+bwd speedup of shared over replicated",
           o->repeats);
  const tool_plot p = {plot, xlabels[k], title, note, 0, BP_COLS, bp_cols, o->no_replicated ? 1 : 2,
                       {{"shared", 0, 1, 4}, {"replicated", 2, 3, 5}}, o->no_replicated ? -1 : 7};
  return tool_plot_write(&p, &sw, rows) ? 1 : 0;
}

int cmd_bench(int argc, char **argv) {
  tool_opts o = {{16, 2048, 256, 8, 2, 128, FORKATTN_DTYPE_F32, FORKATTN_MASK_CAUSAL},
                 FORKATTN_BACKEND_AUTO, 3, 0, 0, 1};
  if (argc >= 2 && !strcmp(argv[1], "tree")) return cmd_bench_tree(argc, argv);
  if (argc >= 2 && !strcmp(argv[1], "kl")) return cmd_bench_kl(argc, argv);
  if (argc >= 2 && !strcmp(argv[1], "dlm")) return cmd_bench_dlm(argc, argv);
  if (argc < 2 || strcmp(argv[1], "prefix")) {
    fprintf(stderr, "usage: forkattn bench prefix|tree|kl|dlm [options]  (--help for options)\n");
    return 2;
  }
  const char *sweep = NULL, *plot = NULL;
  if (tool_plot_take_args(&argc, argv, 2, &sweep, &plot)) return 2;
  int p = tool_parse(argc, argv, 2, &o);
  if (p) {
    tool_usage("bench prefix", &o);
    printf("  --sweep K=V,... one run per value of K (p, n or r; the other sizes as given)\n"
           "  --plot FILE    with --sweep: FILE.svg or FILE.png (gnuplot) of time and memory against K,\n"
           "                 shared vs replicated, plus its data FILE.dat and script FILE.gp\n");
    return p > 0 ? 0 : 2;
  }
  if (plot && !sweep) {
    fprintf(stderr, "forkattn: --plot needs --sweep\n");
    return 2;
  }
  double gemm = -1;
  return sweep ? bp_sweep(&o, sweep, plot) : bp_run(&o, &gemm, NULL, NULL);
}
