/* abi.c - the installed headers' ABI rules seen by a consumer: both headers
 * compile together, an option struct from its _init function is accepted and
 * one without struct_size refused, layouts come back through output pointers,
 * and an experimental symbol links. Exit status 0 when all hold. */
#include <forkattn.h>
#include <forkattn_experimental.h>
#include <stdio.h>

#define EXPECT(cond)                                        \
  do {                                                      \
    if (!(cond)) {                                          \
      fprintf(stderr, "abi: %s does not hold\n", #cond);    \
      return 1;                                             \
    }                                                       \
  } while (0)

int main(void) {
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  EXPECT(opt.struct_size == sizeof opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  forkattn_ctx *ctx = NULL;
  opt.struct_size = 0;
  EXPECT(forkattn_ctx_create(&ctx, &opt) == FORKATTN_ERR_INVALID_ARGUMENT && !ctx);
  opt.struct_size = sizeof opt;
  EXPECT(forkattn_ctx_create(&ctx, &opt) == FORKATTN_OK);

  const int64_t offsets[] = {0, 3}, tokens[] = {1, 2, 3};
  forkattn_trie *trie = NULL;
  EXPECT(forkattn_trie_from_sequences(ctx, 1, offsets, tokens, 0, &trie) == FORKATTN_OK);
  forkattn_tree_layout tree;
  EXPECT(forkattn_trie_layout(trie, &tree) == FORKATTN_OK && tree.num_nodes == 1);
  const forkattn_tree_cost_model model = {1, 8, 1e-9, 1e-8, 1e-6};
  double seconds = 0;
  EXPECT(forkattn_tree_cost(ctx, &tree, &model, &seconds) == FORKATTN_OK && seconds > 0);
  forkattn_trie_free(trie);
  forkattn_ctx_destroy(ctx);
  printf("abi: ok\n");
  return 0;
}
