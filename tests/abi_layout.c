/* abi_layout: prints, as JSON, the size and alignment of every public struct of
 * forkattn.h and forkattn_experimental.h and the offset and size of each of
 * their fields, in declaration order. python/tests/test_abi_layout.py compares
 * it with the header's declarations and with the Python binding's ctypes
 * copies, so a field added on one side only fails that test. */
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>

#include "forkattn_experimental.h"

static int first_struct = 1, first_field;

static void begin(const char *name, size_t size, size_t align) {
  printf("%s\n  \"%s\": {\"size\": %zu, \"align\": %zu, \"fields\": [", first_struct ? "{" : ",", name, size, align);
  first_struct = 0;
  first_field = 1;
}

static void field(const char *name, size_t offset, size_t size) {
  printf("%s\n    [\"%s\", %zu, %zu]", first_field ? "" : ",", name, offset, size);
  first_field = 0;
}

static void end(void) { printf("]}"); }

#define BEGIN(T) begin(#T, sizeof(T), alignof(T))
#define FIELD(T, f) field(#f, offsetof(T, f), sizeof(((T *)0)->f))

int main(void) {
  BEGIN(forkattn_tensor);
  FIELD(forkattn_tensor, data);
  FIELD(forkattn_tensor, dtype);
  FIELD(forkattn_tensor, rows);
  FIELD(forkattn_tensor, heads);
  FIELD(forkattn_tensor, head_dim);
  FIELD(forkattn_tensor, row_stride);
  FIELD(forkattn_tensor, head_stride);
  end();

  BEGIN(forkattn_ctx_options);
  FIELD(forkattn_ctx_options, struct_size);
  FIELD(forkattn_ctx_options, backend);
  FIELD(forkattn_ctx_options, device);
  FIELD(forkattn_ctx_options, threads);
  FIELD(forkattn_ctx_options, bind_threads);
  FIELD(forkattn_ctx_options, verbose);
  FIELD(forkattn_ctx_options, gpu_kernels);
  FIELD(forkattn_ctx_options, gpu_persist);
  FIELD(forkattn_ctx_options, f32_precision);
  end();

  BEGIN(forkattn_prefix_layout);
  FIELD(forkattn_prefix_layout, prompt_len);
  FIELD(forkattn_prefix_layout, num_responses);
  FIELD(forkattn_prefix_layout, response_offsets);
  FIELD(forkattn_prefix_layout, mask);
  end();

  BEGIN(forkattn_tree_layout);
  FIELD(forkattn_tree_layout, num_nodes);
  FIELD(forkattn_tree_layout, node_offsets);
  FIELD(forkattn_tree_layout, parents);
  end();

  BEGIN(forkattn_layout);
  FIELD(forkattn_layout, prefix);
  FIELD(forkattn_layout, tree);
  end();

  BEGIN(forkattn_kept_set);
  FIELD(forkattn_kept_set, heads);
  FIELD(forkattn_kept_set, compressed_rows);
  FIELD(forkattn_kept_set, query_start);
  FIELD(forkattn_kept_set, offsets);
  FIELD(forkattn_kept_set, index);
  FIELD(forkattn_kept_set, block_mask);
  end();

  BEGIN(forkattn_kv_policy);
  FIELD(forkattn_kv_policy, struct_size);
  FIELD(forkattn_kv_policy, kind);
  FIELD(forkattn_kv_policy, budget);
  FIELD(forkattn_kv_policy, sinks);
  FIELD(forkattn_kv_policy, window);
  FIELD(forkattn_kv_policy, pool_kernel);
  FIELD(forkattn_kv_policy, scale);
  end();

  BEGIN(forkattn_kl_options);
  FIELD(forkattn_kl_options, struct_size);
  FIELD(forkattn_kl_options, direction);
  FIELD(forkattn_kl_options, scale_teacher);
  FIELD(forkattn_kl_options, scale_student);
  FIELD(forkattn_kl_options, temperature);
  FIELD(forkattn_kl_options, scale_by_tau2);
  end();

  BEGIN(forkattn_kv_cache_options);
  FIELD(forkattn_kv_cache_options, struct_size);
  FIELD(forkattn_kv_cache_options, capacity_bytes);
  FIELD(forkattn_kv_cache_options, block_tokens);
  FIELD(forkattn_kv_cache_options, layers);
  FIELD(forkattn_kv_cache_options, kv_heads);
  FIELD(forkattn_kv_cache_options, head_dim);
  FIELD(forkattn_kv_cache_options, dtype);
  FIELD(forkattn_kv_cache_options, memory);
  end();

  BEGIN(forkattn_kv_cache_stats);
  FIELD(forkattn_kv_cache_stats, hits);
  FIELD(forkattn_kv_cache_stats, misses);
  FIELD(forkattn_kv_cache_stats, insertions);
  FIELD(forkattn_kv_cache_stats, evictions);
  FIELD(forkattn_kv_cache_stats, rejected);
  FIELD(forkattn_kv_cache_stats, bytes);
  FIELD(forkattn_kv_cache_stats, entries);
  end();

  BEGIN(forkattn_tree_cost_model);
  FIELD(forkattn_tree_cost_model, heads_q);
  FIELD(forkattn_tree_cost_model, head_dim);
  FIELD(forkattn_tree_cost_model, sec_per_mac);
  FIELD(forkattn_tree_cost_model, sec_per_row);
  FIELD(forkattn_tree_cost_model, sec_per_pair);
  end();

  printf("\n}\n");
  return 0;
}
