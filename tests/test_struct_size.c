/* The struct_size rule of the option structs (include/forkattn.h, ABI rules):
 * the _init functions set it, and every call that takes options refuses 0 or a
 * size this library does not know with a message naming the _init function. */
#include <criterion/criterion.h>
#include <string.h>

#include "test_common.h"

/* Copies of the options with struct_size 0, one past the size, and one short of it. */
#define BAD_SIZES(T) {0, sizeof(T) + 8, sizeof(T) - 4}

static void expect_refused(forkattn_status st, const char *msg, const char *init, size_t size) {
  cr_assert_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "struct_size %zu: status %d", size, (int)st);
  cr_assert(strstr(msg, "struct_size") && strstr(msg, init), "struct_size %zu: message \"%s\" names neither", size,
            msg);
}

Test(struct_size, init_functions_set_it) {
  forkattn_ctx_options co;
  forkattn_kl_options ko;
  forkattn_kv_policy kp;
  forkattn_kv_cache_options cc;
  forkattn_ctx_options_init(&co);
  forkattn_kl_options_init(&ko);
  forkattn_kv_policy_init(&kp, FORKATTN_KV_H2O, 8);
  forkattn_kv_cache_options_init(&cc);
  cr_assert_eq(co.struct_size, sizeof co);
  cr_assert_eq(ko.struct_size, sizeof ko);
  cr_assert_eq(kp.struct_size, sizeof kp);
  cr_assert_eq(cc.struct_size, sizeof cc);
  cr_assert(cc.dtype == FORKATTN_DTYPE_F32 && cc.memory == FORKATTN_MEMORY_HOST && cc.capacity_bytes == 0);
}

Test(struct_size, ctx_create_refuses_unknown_sizes) {
  const size_t bad[] = BAD_SIZES(forkattn_ctx_options);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    forkattn_ctx_options opt;
    forkattn_ctx_options_init(&opt);
    opt.struct_size = bad[i];
    forkattn_ctx *ctx = (forkattn_ctx *)&opt;
    expect_refused(forkattn_ctx_create(&ctx, &opt), forkattn_ctx_create_error(), "forkattn_ctx_options_init",
                   bad[i]);
    cr_assert_null(ctx);
  }
  forkattn_ctx_options opt;
  forkattn_ctx_options_init(&opt);
  opt.backend = FORKATTN_BACKEND_CPU;
  forkattn_ctx *ctx = NULL;
  cr_assert_eq(forkattn_ctx_create(&ctx, &opt), FORKATTN_OK, "%s", forkattn_ctx_create_error());
  forkattn_ctx_destroy(ctx);
}

Test(struct_size, streamkl_refuses_unknown_sizes) {
  forkattn_ctx *ctx = tc_ctx_default("struct_size/streamkl");
  float qt[8] = {1, 2, 3, 4, 5, 6, 7, 8}, kt[8] = {8, 7, 6, 5, 4, 3, 2, 1}, kl[2] = {-7, -7};
  const forkattn_tensor q = forkattn_tensor_contiguous(qt, FORKATTN_DTYPE_F32, 2, 1, 4);
  const forkattn_tensor k = forkattn_tensor_contiguous(kt, FORKATTN_DTYPE_F32, 2, 1, 4);
  const forkattn_prefix_layout pl = {2, 0, NULL, FORKATTN_MASK_CAUSAL};
  const forkattn_layout lay = {&pl, NULL};
  const size_t bad[] = BAD_SIZES(forkattn_kl_options);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    forkattn_kl_options opt;
    forkattn_kl_options_init(&opt);
    opt.struct_size = bad[i];
    expect_refused(forkattn_kl_fwd(ctx, &lay, &q, &k, &q, &k, NULL, &opt, kl, NULL, NULL, FORKATTN_MEMORY_HOST),
                   forkattn_ctx_last_error(ctx), "forkattn_kl_options_init", bad[i]);
    cr_assert(kl[0] == -7 && kl[1] == -7, "outputs untouched");
  }
  forkattn_kl_options opt;
  forkattn_kl_options_init(&opt);
  cr_assert_eq(forkattn_kl_fwd(ctx, &lay, &q, &k, &q, &k, NULL, &opt, kl, NULL, NULL, FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  forkattn_ctx_destroy(ctx);
}

Test(struct_size, kv_select_refuses_unknown_sizes) {
  forkattn_ctx *ctx = tc_ctx_default("struct_size/kv_select");
  float qk[16] = {0};
  const forkattn_tensor t = forkattn_tensor_contiguous(qk, FORKATTN_DTYPE_F32, 4, 1, 4);
  int64_t off[2] = {-7, -7}, idx[4];
  const size_t bad[] = BAD_SIZES(forkattn_kv_policy);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    forkattn_kv_policy p;
    forkattn_kv_policy_init(&p, FORKATTN_KV_STREAMING_LLM, 2);
    p.struct_size = bad[i];
    expect_refused(forkattn_kv_select(ctx, &p, &t, &t, off, idx, FORKATTN_MEMORY_HOST), forkattn_ctx_last_error(ctx),
                   "forkattn_kv_policy_init", bad[i]);
    cr_assert(off[0] == -7 && off[1] == -7, "outputs untouched");
  }
  forkattn_kv_policy p;
  forkattn_kv_policy_init(&p, FORKATTN_KV_STREAMING_LLM, 2);
  cr_assert_eq(forkattn_kv_select(ctx, &p, &t, &t, off, idx, FORKATTN_MEMORY_HOST), FORKATTN_OK, "%s",
               forkattn_ctx_last_error(ctx));
  forkattn_ctx_destroy(ctx);
}

Test(struct_size, kv_cache_create_refuses_unknown_sizes) {
  forkattn_ctx *ctx = tc_ctx_default("struct_size/kv_cache");
  const size_t bad[] = BAD_SIZES(forkattn_kv_cache_options);
  forkattn_kv_cache_options opt;
  forkattn_kv_cache_options_init(&opt);
  opt.capacity_bytes = 1 << 20;
  opt.layers = 1;
  opt.kv_heads = 1;
  opt.head_dim = 8;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    forkattn_kv_cache_options o = opt;
    o.struct_size = bad[i];
    forkattn_kv_cache *cache = (forkattn_kv_cache *)&o;
    expect_refused(forkattn_kv_cache_create(ctx, &o, &cache), forkattn_ctx_last_error(ctx),
                   "forkattn_kv_cache_options_init", bad[i]);
    cr_assert_null(cache);
  }
  forkattn_kv_cache *cache = NULL;
  cr_assert_eq(forkattn_kv_cache_create(ctx, &opt, &cache), FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  forkattn_kv_cache_destroy(cache);
  forkattn_ctx_destroy(ctx);
}
