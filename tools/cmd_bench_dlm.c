/* `forkattn bench dlm`: BiCache serving throughput against recomputation,
 * one row per prefix ratio r = 0.2 .. 0.9. Requests have --seq tokens, the
 * first round(r * seq) a prompt shared with the others of its prompt; the
 * prompts are cached before the timed serving (steady state; --cold: an
 * empty cache, misses timed) and each row uses the depth the calibrated
 * profile gives for r. A table and JSON lines. */
#include <math.h>
#include <stdio.h>

#include "commands.h"
#include "json_out.h"
#include "dlm_cli.h"

int cmd_bench_dlm(int argc, char **argv) {
  dlm_cli o;
  dlm_setup s;
  const int started = dlm_cli_start(argc, argv, 1, &o, &s);
  if (started >= 0) return started;
  char err[512];
  int rc = 1;
  if (!o.json) {
    dlm_print_model(&s, &o, "forkattn bench dlm: BiCache serving throughput, cached vs recomputed");
    dlm_print_calibration(&s, &o);
    printf("rows: %lld requests of %lld tokens over %lld prompts, batches of %lld, %lld step(s); %s\n",
           (long long)o.work.requests, (long long)o.seq, (long long)o.work.prompts, (long long)o.serve.batch,
           (long long)o.serve.steps,
           o.serve.warm ? "prompts cached before timing (steady state)" : "empty cache per row (misses timed)");
    printf("%5s %6s %5s %5s %11s %11s %11s %11s %8s %10s %7s\n", "r", "prompt", "own", "b", "uncached/s", "cached/s",
           "unc tok/s", "cache tok/s", "gain", "drift", "top-1");
    fflush(stdout);
  }
  double gmin = INFINITY, gmax = -INFINITY;
  for (int k = 2; k <= 9; k++) {
    const double r = k / 10.0;
    int64_t P = (int64_t)llround(r * (double)o.seq);
    P = P < 1 ? 1 : P > o.seq - 1 ? o.seq - 1 : P;
    dlm_workload_opts wo = o.work;
    wo.prompt_min = wo.prompt_max = P;
    wo.ratio_min = wo.ratio_max = (double)P / (double)o.seq;
    wo.own_min = wo.own_max = o.seq - P;
    wo.seed = o.work.seed + (uint64_t)k;
    dlm_workload w;
    if (dlm_workload_make(&w, &wo, &s.model, err, sizeof err)) {
      fprintf(stderr, "forkattn: %s\n", err);
      goto done;
    }
    dlm_serve_result res;
    const forkattn_status st = dlm_serve(s.ctx, &s.model, &w, s.profile, &o.serve, &res, err, sizeof err);
    dlm_workload_free(&w);
    if (st) {
      fprintf(stderr, "forkattn: %s\n", err);
      goto done;
    }
    int64_t b = 0;
    for (int64_t d = 0; d <= s.model.c.layers; d++)
      if (res.depth_used[d]) b = d; /* one ratio: one depth */
    const double ru = (double)res.requests / res.sec_uncached, rcached = (double)res.requests / res.sec_cached;
    const double gain = rcached / ru - 1, top1 = (double)res.top1_agree / (double)(res.rows ? res.rows : 1);
    gmin = gain < gmin ? gain : gmin;
    gmax = gain > gmax ? gain : gmax;
    if (!o.json)
      printf("%5.2f %6lld %5lld %5lld %11.2f %11.2f %11.0f %11.0f %+7.0f%% %10.2e %6.2f%%\n", wo.ratio_min, (long long)P,
             (long long)(o.seq - P), (long long)b, ru, rcached, (double)res.tokens / res.sec_uncached,
             (double)res.tokens / res.sec_cached, 100 * gain, res.hid_mean, 100 * top1);
    tool_json_printf("{\"bench\":\"dlm\",\"synthetic_weights\":true,\"backend\":\"%s\",\"layers\":%lld,\"width\":%lld,"
           "\"heads\":%lld,\"ratio\":%.4f,\"prompt\":%lld,\"own\":%lld,\"requests\":%lld,\"depth\":%lld,"
           "\"uncached_req_s\":%.4f,\"cached_req_s\":%.4f,\"uncached_tok_s\":%.1f,\"cached_tok_s\":%.1f,"
           "\"gain\":%.4f,\"alone_s\":%.4f,\"hits\":%llu,\"misses\":%llu,\"hidden_rel_max\":%.4g,"
           "\"hidden_rel_mean\":%.4g,\"logit_rel_mean\":%.4g,\"top1_agreement\":%.5f,"
           "\"paper_gain_range\":[0.36,0.98]}\n",
           forkattn_backend_name(forkattn_ctx_backend(s.ctx)), (long long)s.model.c.layers,
           (long long)s.model.c.width, (long long)s.model.c.heads, wo.ratio_min, (long long)P, (long long)(o.seq - P),
           (long long)res.requests, (long long)b, ru, rcached, (double)res.tokens / res.sec_uncached,
           (double)res.tokens / res.sec_cached, gain, res.sec_alone, (unsigned long long)res.cache.hits,
           (unsigned long long)res.cache.misses, res.hid_max, res.hid_mean, res.logit_mean, top1);
    fflush(stdout);
  }
  if (!o.json)
    printf("ours: %+.0f%% to %+.0f%% serving throughput over r = 0.2..0.9 (synthetic weights, this machine);\n"
           "paper (BiCache, arXiv 2606.07571): +36%% to +98%% serving throughput, accuracy within 0-1.8%%.\n"
           "drift: mean over own rows of ||cached - uncached|| / ||uncached|| of the final hidden state.\n",
           100 * gmin, 100 * gmax);
  rc = 0;
done:
  dlm_setup_free(&s);
  return rc;
}
