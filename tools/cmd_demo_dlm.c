/* `forkattn demo dlm`: BiCache serving on a synthetic diffusion-LM-shaped
 * model. A stream of requests sharing a few system prompts is served in
 * batches, each batch twice: uncached (every layer recomputes every row) and
 * with the shared-prefix KV cache (the prompt's K/V computed alone, reused in
 * the first b(r) layers). Prints throughput of both, the depths chosen, the
 * cache's counters and the drift of the cached outputs. */
#include <stdio.h>

#include "commands.h"
#include "json_out.h"
#include "dlm_cli.h"

static void dlm_print_hist(const char *what, const int64_t *h, int64_t L) {
  printf("  %s:", what);
  for (int64_t b = 0; b <= L; b++)
    if (h[b]) printf(" b=%lld: %lld", (long long)b, (long long)h[b]);
  printf("\n");
}

static double dlm_mean_depth(const int64_t *h, int64_t L) {
  double s = 0, n = 0;
  for (int64_t b = 0; b <= L; b++) s += (double)(b * h[b]), n += (double)h[b];
  return n > 0 ? s / n : 0;
}

int cmd_demo_dlm(int argc, char **argv) {
  dlm_cli o;
  dlm_setup s;
  const int started = dlm_cli_start(argc, argv, 0, &o, &s);
  if (started >= 0) return started;
  char err[512];
  dlm_workload w = {0};
  int rc = 1;
  if (dlm_workload_make(&w, &o.work, &s.model, err, sizeof err)) {
    fprintf(stderr, "forkattn: %s\n", err);
    goto done;
  }
  double rmin = 1, rmax = 0;
  int64_t tokens = 0, omin = INT64_MAX, omax = 0;
  for (int64_t i = 0; i < w.nreq; i++) {
    rmin = w.ratio[i] < rmin ? w.ratio[i] : rmin;
    rmax = w.ratio[i] > rmax ? w.ratio[i] : rmax;
    omin = w.req_own[i] < omin ? w.req_own[i] : omin;
    omax = w.req_own[i] > omax ? w.req_own[i] : omax;
    tokens += w.prompt_len[w.req_prompt[i]] + w.req_own[i];
  }
  if (!o.json) {
    dlm_print_model(&s, &o, "forkattn demo dlm: shared-prefix KV cache for diffusion LMs (BiCache)");
    printf("workload: %lld requests over %lld prompts of %lld..%lld tokens, own %lld..%lld tokens,\n"
           "  prefix ratio r %.2f..%.2f, %lld tokens; batches of %lld arrivals grouped by prompt; %lld denoising step(s)",
           (long long)w.nreq, (long long)w.nprompts, (long long)o.work.prompt_min, (long long)o.work.prompt_max,
           (long long)omin, (long long)omax, rmin, rmax, (long long)tokens, (long long)o.serve.batch,
           (long long)o.serve.steps);
    if (o.serve.steps > 1)
      printf(o.serve.refresh ? ", deep-layer prefix K/V refreshed every %lld steps" : ", deep layers recomputed every step",
             (long long)o.serve.refresh);
    printf("\n");
    dlm_print_calibration(&s, &o);
    if (o.serve.fixed_depth >= 0) printf("  --depth %lld overrides the profile\n", (long long)o.serve.fixed_depth);
    fflush(stdout);
  }
  dlm_serve_result r;
  if (dlm_serve(s.ctx, &s.model, &w, s.profile, &o.serve, &r, err, sizeof err)) {
    fprintf(stderr, "forkattn: %s\n", err);
    goto done;
  }
  const int64_t L = s.model.c.layers;
  const double speed = r.sec_uncached / r.sec_cached, hit = (double)r.cache.hits / (double)(r.cache.hits + r.cache.misses);
  if (!o.json) {
    printf("serving (%lld batches of one prompt each):\n", (long long)r.groups);
    printf("  %-22s %10s %10s %12s\n", "", "time s", "req/s", "tokens/s");
    printf("  %-22s %10.3f %10.2f %12.0f\n", "uncached (recompute)", r.sec_uncached, (double)r.requests / r.sec_uncached,
           (double)r.tokens / r.sec_uncached);
    printf("  %-22s %10.3f %10.2f %12.0f   (%.3f s of it computing %lld prompts alone)\n", "cached (BiCache)",
           r.sec_cached, (double)r.requests / r.sec_cached, (double)r.tokens / r.sec_cached, r.sec_alone,
           (long long)r.cache.insertions);
    if (o.serve.warm) printf("  (--warm: the prompts were cached first, in %.3f s, not timed)\n", r.sec_warm);
    printf("  throughput: %+.0f%% with the cache (paper, arXiv 2606.07571: +36%% to +98%%)\n", 100 * (speed - 1));
    printf("reuse depth b(r) per request (of %lld layers), mean %.2f:\n", (long long)L, dlm_mean_depth(r.depth_used, L));
    dlm_print_hist("requests", r.depth_used, L);
    printf("cache: %llu hits, %llu misses (hit rate %.1f%%), %llu insertions, %llu evictions, %llu rejected,\n"
           "  %lld entries, %.1f MiB of K/V; side table of hidden states %.1f MiB; %llu side-table misses\n",
           (unsigned long long)r.cache.hits, (unsigned long long)r.cache.misses, 100 * hit,
           (unsigned long long)r.cache.insertions, (unsigned long long)r.cache.evictions,
           (unsigned long long)r.cache.rejected, (long long)r.cache.entries, (double)r.cache.bytes / 1048576.0,
           r.side_bytes / 1048576.0, (unsigned long long)r.side_misses);
    printf("drift against recomputation over %lld own rows (||cached - uncached|| / ||uncached|| per row):\n"
           "  final hidden state: max %.3e, mean %.3e\n"
           "  logits:             max %.3e, mean %.3e; top-1 token agreement %.2f%%\n"
           "  (paper: accuracy within 0-1.8%%; synthetic weights measure drift, not accuracy)\n",
           (long long)r.rows, r.hid_max, r.hid_mean, r.logit_max, r.logit_mean,
           100.0 * (double)r.top1_agree / (double)(r.rows ? r.rows : 1));
  }
  tool_json_printf("{\"demo\":\"dlm\",\"synthetic_weights\":true,\"backend\":\"%s\",\"layers\":%lld,\"width\":%lld,\"heads\":%lld,"
         "\"requests\":%lld,\"prompts\":%lld,\"tokens\":%lld,\"steps\":%lld,\"refresh\":%lld,\"threshold\":%.3f,"
         "\"uncached_s\":%.4f,\"cached_s\":%.4f,\"alone_s\":%.4f,\"uncached_req_s\":%.3f,\"cached_req_s\":%.3f,"
         "\"uncached_tok_s\":%.1f,\"cached_tok_s\":%.1f,\"speedup\":%.4f,\"mean_depth\":%.3f,\"hits\":%llu,"
         "\"misses\":%llu,\"hit_rate\":%.4f,\"cache_bytes\":%zu,\"side_bytes\":%.0f,\"rows\":%lld,"
         "\"hidden_rel_max\":%.4g,\"hidden_rel_mean\":%.4g,\"logit_rel_max\":%.4g,\"logit_rel_mean\":%.4g,"
         "\"top1_agreement\":%.5f,\"depth_used\":[",
         forkattn_backend_name(forkattn_ctx_backend(s.ctx)), (long long)L, (long long)s.model.c.width,
         (long long)s.model.c.heads, (long long)r.requests, (long long)w.nprompts, (long long)r.tokens,
         (long long)o.serve.steps, (long long)o.serve.refresh, o.threshold, r.sec_uncached, r.sec_cached, r.sec_alone,
         (double)r.requests / r.sec_uncached, (double)r.requests / r.sec_cached, (double)r.tokens / r.sec_uncached,
         (double)r.tokens / r.sec_cached, speed, dlm_mean_depth(r.depth_used, L), (unsigned long long)r.cache.hits,
         (unsigned long long)r.cache.misses, hit, r.cache.bytes, r.side_bytes, (long long)r.rows, r.hid_max,
         r.hid_mean, r.logit_max, r.logit_mean, (double)r.top1_agree / (double)(r.rows ? r.rows : 1));
  for (int64_t b = 0; b <= L; b++) printf("%s%lld", b ? "," : "", (long long)r.depth_used[b]);
  printf("]}\n");
  rc = 0;
done:
  dlm_workload_free(&w);
  dlm_setup_free(&s);
  return rc;
}
