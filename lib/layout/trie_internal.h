/* Rollout tries: the object and the pieces the three builders share
 * (lib/layout/trie.c: API and validation; lib/layout/trie_pack.c: depth-first packing;
 * lib/layout/trie_seq.c: the compressed trie of token sequences). */
#ifndef FORKATTN_TRIE_INTERNAL_H
#define FORKATTN_TRIE_INTERNAL_H
#include <stdint.h>

#include "forkattn.h"

struct forkattn_trie {
  int64_t num_nodes, num_rows;
  int64_t num_inputs; /* entries of input_rows */
  int64_t replicated; /* tokens before deduplication */
  int64_t *node_offsets; /* [n+1] */
  int64_t *parents, *node_depths; /* [n] */
  int64_t *row_nodes, *row_positions; /* [T] */
  int64_t *row_tokens; /* [T], from sequences only */
  int64_t *input_rows; /* [num_inputs] */
  int64_t *input_nodes; /* [input nodes], from node parents only */
};

/* fa_malloc of count int64 (NULL when count < 0 or the byte count overflows). */
int64_t *fa_trie_i64(int64_t count);

/* Free every array and the object (NULL-safe). */
void fa_trie_destroy(forkattn_trie *t);

/* A forest to pack: m nodes in "input order"; parent[i] is -1 or in [0, m) and
 * != i (cycles possible: the packer finds them); len[i] >= 1 with a sum (rows)
 * that fits int64. Children are packed in increasing input index, except that
 * the one with the most nodes in its subtree (the first such) comes first. */
typedef struct fa_trie_forest {
  int64_t m;
  const int64_t *parent, *len;
  int64_t rows;
} fa_trie_forest;

typedef enum fa_pack_result {
  FA_PACK_OK = 0,
  FA_PACK_NOMEM,    /* an allocation failed */
  FA_PACK_CYCLE,    /* *bad = an input node on a cycle */
  FA_PACK_OVERFLOW  /* the replicated token count overflows int64 */
} fa_pack_result;

/* Depth-first pre-order packing: checks for cycles and overflow before
 * allocating anything that outlives the call, then allocates *out with the
 * node arrays, row_nodes, row_positions and replicated (the sum over leaves of
 * the root-to-leaf token count) filled, and pack[i] = packed index of input
 * node i. On failure *out is NULL and nothing stays allocated. */
fa_pack_result fa_trie_pack(const fa_trie_forest *f, int64_t *pack, forkattn_trie **out, int64_t *bad);

/* Build the trie of validated sequences (num >= 1, offsets strictly
 * increasing from 0). Returns FORKATTN_OK or FORKATTN_ERR_OUT_OF_MEMORY with
 * *out NULL. */
forkattn_status fa_trie_build_sequences(int64_t num, const int64_t *offsets, const int64_t *tokens,
                                        forkattn_trie **out);

#endif
