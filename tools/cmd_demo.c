/* `forkattn demo`: the main job. A GRPO-shaped group (N responses sharing one
 * prompt) runs shared-prompt attention forward+backward on the best backend,
 * is checked against the replicated computation, and reports errors, time,
 * memory and the speedup over replicated. `demo dlm`: cmd_demo_dlm.c. */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "measure.h"

int cmd_demo(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "dlm")) return cmd_demo_dlm(argc, argv); /* BiCache serving */
  tool_opts o = {{8, 1024, 256, 8, 2, 64, FORKATTN_DTYPE_F32, FORKATTN_MASK_CAUSAL},
                 FORKATTN_BACKEND_AUTO, 5, 0, 0, 20261130};
  int p = tool_parse(argc, argv, 1, &o);
  if (p) {
    tool_usage("demo", &o);
    return p > 0 ? 0 : 2;
  }
  o.no_replicated = 0;
  const tool_shape *s = &o.shape;
  printf("forkattn demo: GRPO group of %lld responses x %lld tokens sharing a %lld-token prompt,\n"
         "               %lld query / %lld KV heads, head_dim %lld, %s, %s mask\n",
         (long long)s->n, (long long)s->r, (long long)s->p, (long long)s->hq, (long long)s->hkv,
         (long long)s->d, tool_dtype_name(s->dtype),
         tool_mask_name(s->mask));
  tool_result r;
  if (tool_measure(&o, &r)) return 1;
  printf("backend:       %s (%s)\n", r.backend, r.reason);
  const double mib = 1.0 / (1 << 20);
  printf("%-12s %10s %12s %14s %14s %12s\n", "", "fwd ms", "fwd+bwd ms", "tensors MiB", "workspace MiB", "rows");
  printf("%-12s %10.3f %12.3f %14.1f %14.1f %12lld\n", "shared", r.shared.fwd_ms, r.shared.fwdbwd_ms,
         r.shared.tensor_bytes * mib, r.shared.workspace_bytes * mib, (long long)(s->p + s->n * s->r));
  printf("%-12s %10.3f %12.3f %14.1f %14.1f %12lld\n", "replicated", r.rep.fwd_ms, r.rep.fwdbwd_ms,
         r.rep.tensor_bytes * mib, r.rep.workspace_bytes * mib, (long long)(s->n * (s->p + s->r)));
  printf("speedup:       fwd %.2fx, fwd+bwd %.2fx (ideal %.2fx = replicated / shared useful FLOPs)\n",
         r.rep.fwd_ms / r.shared.fwd_ms, r.rep.fwdbwd_ms / r.shared.fwdbwd_ms, r.rep.flops / r.shared.flops);
  printf("memory:        shared uses %.1f%% of the replicated tensor + workspace bytes\n",
         100.0 * (r.shared.tensor_bytes + r.shared.workspace_bytes) / (r.rep.tensor_bytes + r.rep.workspace_bytes));
  printf("max error vs replicated (relative to max |x|): o %.2e  dq %.2e  dk %.2e  dv %.2e;  lse abs %.2e\n",
         r.err.o, r.err.dq, r.err.dk, r.err.dv, r.err.lse);
  /* f32: both sides are f32 computations of one function (different summation
   * order), so they agree to ~1e-6; bf16/f16 outputs are rounded separately
   * (2^-8 / 2^-11 relative) and gradients summed from rounded copies. */
  double tol = s->dtype == FORKATTN_DTYPE_F32 ? 1e-4 : 3e-2;
  int ok = tool_errors_max(&r.err) <= tol && r.err.lse <= (s->dtype == FORKATTN_DTYPE_F32 ? 1e-4 : 1e-2);
  printf("check:         %s (tolerance %.0e relative)\n", ok ? "PASSED" : "FAILED", tol);
  return ok ? 0 : 1;
}
