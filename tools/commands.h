/* Subcommands of the `forkattn` program. Each returns a process exit code. */
#ifndef FORKATTN_TOOLS_COMMANDS_H
#define FORKATTN_TOOLS_COMMANDS_H
int cmd_info(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
/* `bench tree`; argv[0] = "bench", argv[1] = "tree" */
int cmd_bench_tree(int argc, char **argv);
/* `bench kl`; argv[1] = "kl" */
int cmd_bench_kl(int argc, char **argv);
/* `bench dlm` and `demo dlm` (BiCache serving); argv[1] = "dlm" */
int cmd_bench_dlm(int argc, char **argv);
int cmd_demo_dlm(int argc, char **argv);
int cmd_check(int argc, char **argv);
#endif
