/* `forkattn`: info, demo (the main job), bench. */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "forkattn.h"

static int usage(FILE *f) {
  fprintf(f,
          "forkattn %s: shared-prefix attention for RL post-training\n"
          "usage: forkattn <command> [options]\n"
          "  info                 version, backends, devices, CPU topology\n"
          "  demo [--backend B]   GRPO-shaped group: shared-prompt fwd+bwd vs replicated\n"
          "  demo dlm [...]       diffusion-LM serving with a shared-prefix KV cache (BiCache; --help)\n"
          "  bench prefix [...]   time shared vs replicated (forkattn bench prefix --help)\n"
          "  bench tree [...]     time tree vs replicated vs prompt-only (forkattn bench tree --help)\n"
          "  bench kl [...]       time StreamKL vs a materialized KL (forkattn bench kl --help)\n"
          "  bench dlm [...]      BiCache serving throughput per prefix ratio (forkattn bench dlm --help)\n"
          "  check [...]          problems against the float64 reference (forkattn check --help)\n"
          "  version              print the version\n"
          "Environment: FORKATTN_BACKEND=cpu|gpu|auto overrides the backend.\n",
          forkattn_version_string());
  return f == stderr ? 2 : 0;
}

int main(int argc, char **argv) {
  if (argc < 2) return usage(stderr);
  const char *c = argv[1];
  if (!strcmp(c, "info")) return cmd_info(argc - 1, argv + 1);
  if (!strcmp(c, "demo")) return cmd_demo(argc - 1, argv + 1);
  if (!strcmp(c, "bench")) return cmd_bench(argc - 1, argv + 1);
  if (!strcmp(c, "check")) return cmd_check(argc - 1, argv + 1);
  if (!strcmp(c, "version") || !strcmp(c, "--version")) {
    printf("%s\n", forkattn_version_string());
    return 0;
  }
  if (!strcmp(c, "help") || !strcmp(c, "--help") || !strcmp(c, "-h")) return usage(stdout);
  fprintf(stderr, "forkattn: unknown command '%s'\n", c);
  return usage(stderr);
}
