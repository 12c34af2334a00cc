/* Rollout tries: the public builders (argument checking, then the shared
 * packer of trie_pack.c), the accessors and forkattn_trie_free (see forkattn.h). */
#include <stdint.h>

#include "alloc.h"
#include "context_internal.h"
#include "trie_internal.h"
#include "validate.h"

#define FA_BAD FORKATTN_ERR_INVALID_ARGUMENT

/* Checks every builder starts with; clears *trie. */
static forkattn_status fa_trie_begin(forkattn_ctx *ctx, unsigned flags, forkattn_trie **trie) {
  if (trie) *trie = NULL;
  if (!ctx) return FA_BAD;
  fa_clear_error(ctx);
  if (!trie) return fa_fail(ctx, FA_BAD, "trie: the output pointer trie is NULL");
  if (flags & ~FORKATTN_TRIE_SINGLE_ROOT)
    return fa_fail(ctx, FA_BAD, "trie: flags 0x%x has unknown bits (only FORKATTN_TRIE_SINGLE_ROOT = 0x1 is defined)",
                   flags);
  return FORKATTN_OK;
}

/* Parent entries: -1 or [0, n), never the entry itself; counts the roots and
 * keeps the first two. */
static forkattn_status fa_trie_check_parents(forkattn_ctx *ctx, const char *name, int64_t n, const int64_t *parents,
                                             unsigned flags) {
  int64_t roots = 0, root[2] = {-1, -1};
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = parents[i];
    if (p < -1 || p >= n)
      return fa_fail(ctx, FA_BAD, "trie: %s[%lld] = %lld is out of range [-1, %lld)", name, (long long)i,
                     (long long)p, (long long)n);
    if (p == i)
      return fa_fail(ctx, FA_BAD, "trie: %s[%lld] = %lld is the entry itself", name, (long long)i, (long long)p);
    if (p < 0 && roots++ < 2) root[roots - 1] = i;
  }
  if ((flags & FORKATTN_TRIE_SINGLE_ROOT) && roots > 1)
    return fa_fail(ctx, FA_BAD, "trie: FORKATTN_TRIE_SINGLE_ROOT, but %s has %lld roots (%s[%lld] = %s[%lld] = -1)",
                   name, (long long)roots, name, (long long)root[0], name, (long long)root[1]);
  return FORKATTN_OK;
}

/* The packer's failures as statuses; `name` is the parents argument, `cycle_at`
 * the entry of it (a `unit`) that lies on the cycle. */
static forkattn_status fa_trie_pack_status(forkattn_ctx *ctx, fa_pack_result r, const char *name, const char *unit,
                                           int64_t cycle_at) {
  if (r == FA_PACK_CYCLE)
    return fa_fail(ctx, FA_BAD, "trie: %s form a cycle through %s %lld (%s[%lld] never leads to a root)", name, unit,
                   (long long)cycle_at, name, (long long)cycle_at);
  if (r == FA_PACK_OVERFLOW)
    return fa_fail(ctx, FA_BAD, "trie: the replicated token count (sum of root-to-leaf path lengths) overflows int64");
  return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "trie: out of memory");
}

forkattn_status forkattn_trie_from_sequences(forkattn_ctx *ctx, int64_t num_sequences, const int64_t *seq_offsets,
                                             const int64_t *tokens, unsigned flags, forkattn_trie **trie) {
  forkattn_status st = fa_trie_begin(ctx, flags, trie);
  if (st) return st;
  const int64_t n = num_sequences, *off = seq_offsets;
  if (n < 1) return fa_fail(ctx, FA_BAD, "trie: num_sequences %lld must be >= 1", (long long)n);
  if (!off) return fa_fail(ctx, FA_BAD, "trie: seq_offsets is NULL");
  if (!tokens) return fa_fail(ctx, FA_BAD, "trie: tokens is NULL");
  if ((st = fa_check_aligned(ctx, "trie: seq_offsets", off, sizeof *off)) ||
      (st = fa_check_aligned(ctx, "trie: tokens", tokens, sizeof *tokens)))
    return st;
  if (off[0] != 0) return fa_fail(ctx, FA_BAD, "trie: seq_offsets[0] is %lld, must be 0", (long long)off[0]);
  for (int64_t s = 0; s < n; s++)
    if (off[s + 1] <= off[s])
      return fa_fail(ctx, FA_BAD,
                     "trie: seq_offsets must be strictly increasing, but sequence %lld is %s "
                     "(seq_offsets[%lld] = %lld, seq_offsets[%lld] = %lld)",
                     (long long)s, off[s + 1] == off[s] ? "empty" : "of negative length", (long long)s,
                     (long long)off[s], (long long)(s + 1), (long long)off[s + 1]);
  if (flags & FORKATTN_TRIE_SINGLE_ROOT)
    for (int64_t s = 1; s < n; s++)
      if (tokens[off[s]] != tokens[0])
        return fa_fail(ctx, FA_BAD,
                       "trie: FORKATTN_TRIE_SINGLE_ROOT, but tokens of sequence %lld start with %lld and those of "
                       "sequence 0 with %lld (several roots)",
                       (long long)s, (long long)tokens[off[s]], (long long)tokens[0]);
  if (fa_trie_build_sequences(n, off, tokens, trie))
    return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "trie: out of memory building the trie of %lld tokens",
                   (long long)off[n]);
  return FORKATTN_OK;
}

forkattn_status forkattn_trie_from_parents(forkattn_ctx *ctx, int64_t num_nodes, const int64_t *parents,
                                           const int64_t *node_lengths, unsigned flags, forkattn_trie **trie) {
  forkattn_status st = fa_trie_begin(ctx, flags, trie);
  if (st) return st;
  const int64_t n = num_nodes;
  if (n < 1) return fa_fail(ctx, FA_BAD, "trie: num_nodes %lld must be >= 1", (long long)n);
  if (!parents) return fa_fail(ctx, FA_BAD, "trie: parents is NULL");
  if (!node_lengths) return fa_fail(ctx, FA_BAD, "trie: node_lengths is NULL");
  if ((st = fa_check_aligned(ctx, "trie: parents", parents, sizeof *parents)) ||
      (st = fa_check_aligned(ctx, "trie: node_lengths", node_lengths, sizeof *node_lengths)))
    return st;
  if ((st = fa_trie_check_parents(ctx, "parents", n, parents, flags))) return st;
  int64_t rows = 0;
  for (int64_t i = 0; i < n; i++) {
    if (node_lengths[i] < 1)
      return fa_fail(ctx, FA_BAD, "trie: node_lengths[%lld] = %lld, must be >= 1", (long long)i,
                     (long long)node_lengths[i]);
    if (__builtin_add_overflow(rows, node_lengths[i], &rows))
      return fa_fail(ctx, FA_BAD, "trie: the sum of node_lengths overflows int64 at node_lengths[%lld] = %lld",
                     (long long)i, (long long)node_lengths[i]);
  }
  int64_t *pack = fa_trie_i64(n), *input_rows = NULL, bad = -1;
  if (!pack) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "trie: out of memory");
  const fa_trie_forest f = {n, parents, node_lengths, rows};
  forkattn_trie *t;
  fa_pack_result r = fa_trie_pack(&f, pack, &t, &bad);
  if (r == FA_PACK_OK && !(input_rows = fa_trie_i64(rows))) {
    fa_trie_destroy(t);
    r = FA_PACK_NOMEM;
  }
  if (r != FA_PACK_OK) {
    fa_free(pack);
    return fa_trie_pack_status(ctx, r, "parents", "node", bad);
  }
  for (int64_t i = 0, g = 0; i < n; i++)
    for (int64_t k = 0, base = t->node_offsets[pack[i]]; k < node_lengths[i]; k++) input_rows[g++] = base + k;
  t->input_rows = input_rows;
  t->num_inputs = rows;
  t->input_nodes = pack;
  *trie = t;
  return FORKATTN_OK;
}

/* Token trees: a token starts a node unless it is the only child of its
 * parent; the node runs down the chain of only children. */
typedef struct fa_token_nodes {
  int64_t *block;               /* one allocation: the four arrays of n */
  int64_t *nchild, *child, *node, *offset; /* per token: children, one child, node, index in it */
  int64_t *nblock;              /* one allocation: the four arrays of m */
  int64_t *start, *parent, *len, *pack; /* per node */
  int64_t m;
} fa_token_nodes;

static void fa_token_nodes_free(fa_token_nodes *tn) {
  fa_free(tn->block);
  fa_free(tn->nblock);
}

/* Returns 0, -1 out of memory, or 1 with *bad = a token on a cycle no node reaches. */
static int fa_token_nodes_build(int64_t n, const int64_t *tp, fa_token_nodes *tn, int64_t *bad) {
  if (n > INT64_MAX / 4 || !(tn->block = fa_trie_i64(4 * n))) return -1;
  tn->nchild = tn->block;
  tn->child = tn->nchild + n;
  tn->node = tn->child + n;
  tn->offset = tn->node + n;
  for (int64_t t = 0; t < n; t++) tn->nchild[t] = 0, tn->node[t] = -1;
  for (int64_t t = 0; t < n; t++)
    if (tp[t] >= 0) tn->nchild[tp[t]]++, tn->child[tp[t]] = t;
  int64_t m = 0;
  for (int64_t t = 0; t < n; t++) m += tp[t] < 0 || tn->nchild[tp[t]] != 1;
  if (!(tn->nblock = fa_trie_i64(4 * m))) return -1;
  tn->start = tn->nblock;
  tn->parent = tn->start + m;
  tn->len = tn->parent + m;
  tn->pack = tn->len + m;
  tn->m = m;
  for (int64_t t = 0, i = 0; t < n; t++) {
    if (tp[t] >= 0 && tn->nchild[tp[t]] == 1) continue;
    int64_t u = t, k = 0;
    for (;;) { /* a chain never comes back to t: t's parent is not an only-child parent */
      tn->node[u] = i;
      tn->offset[u] = k++;
      if (tn->nchild[u] != 1 || tn->node[tn->child[u]] >= 0) break;
      u = tn->child[u];
    }
    tn->start[i] = t;
    tn->len[i++] = k;
  }
  for (int64_t t = 0; t < n; t++)
    if (tn->node[t] < 0) { /* above it only chains of only children: a cycle without branches */
      int64_t u = t;
      for (int64_t s = 0; s < n; s++) u = tp[u];
      *bad = u;
      return 1;
    }
  for (int64_t i = 0; i < m; i++) {
    const int64_t p = tp[tn->start[i]];
    tn->parent[i] = p < 0 ? -1 : tn->node[p];
  }
  return 0;
}

forkattn_status forkattn_trie_from_token_parents(forkattn_ctx *ctx, int64_t num_tokens, const int64_t *token_parents,
                                                 unsigned flags, forkattn_trie **trie) {
  forkattn_status st = fa_trie_begin(ctx, flags, trie);
  if (st) return st;
  const int64_t n = num_tokens;
  if (n < 1) return fa_fail(ctx, FA_BAD, "trie: num_tokens %lld must be >= 1", (long long)n);
  if (!token_parents) return fa_fail(ctx, FA_BAD, "trie: token_parents is NULL");
  if ((st = fa_check_aligned(ctx, "trie: token_parents", token_parents, sizeof *token_parents))) return st;
  if ((st = fa_trie_check_parents(ctx, "token_parents", n, token_parents, flags))) return st;
  fa_token_nodes tn = {0};
  int64_t bad = -1, *input_rows = NULL;
  const int built = fa_token_nodes_build(n, token_parents, &tn, &bad);
  fa_pack_result r = built < 0 ? FA_PACK_NOMEM : built > 0 ? FA_PACK_CYCLE : FA_PACK_OK;
  forkattn_trie *t = NULL;
  if (r == FA_PACK_OK) {
    const fa_trie_forest f = {tn.m, tn.parent, tn.len, n};
    if ((r = fa_trie_pack(&f, tn.pack, &t, &bad)) == FA_PACK_CYCLE) bad = tn.start[bad];
  }
  if (r == FA_PACK_OK && !(input_rows = fa_trie_i64(n))) {
    fa_trie_destroy(t);
    r = FA_PACK_NOMEM;
  }
  if (r != FA_PACK_OK) {
    fa_token_nodes_free(&tn);
    return fa_trie_pack_status(ctx, r, "token_parents", "token", bad);
  }
  for (int64_t u = 0; u < n; u++) input_rows[u] = t->node_offsets[tn.pack[tn.node[u]]] + tn.offset[u];
  fa_token_nodes_free(&tn);
  t->input_rows = input_rows;
  t->num_inputs = n;
  *trie = t;
  return FORKATTN_OK;
}

void forkattn_trie_free(forkattn_trie *trie) { fa_trie_destroy(trie); }

forkattn_status forkattn_trie_layout(const forkattn_trie *trie, forkattn_tree_layout *layout) {
  if (!layout) return FORKATTN_ERR_INVALID_ARGUMENT;
  *layout = (forkattn_tree_layout){0, NULL, NULL};
  if (!trie) return FORKATTN_ERR_INVALID_ARGUMENT;
  layout->num_nodes = trie->num_nodes;
  layout->node_offsets = trie->node_offsets;
  layout->parents = trie->parents;
  return FORKATTN_OK;
}

int64_t forkattn_trie_num_rows(const forkattn_trie *trie) { return trie ? trie->num_rows : 0; }
int64_t forkattn_trie_replicated_tokens(const forkattn_trie *trie) { return trie ? trie->replicated : 0; }
double forkattn_trie_dedup_ratio(const forkattn_trie *trie) {
  return trie && trie->num_rows > 0 ? (double)trie->replicated / (double)trie->num_rows : 0.0;
}
const int64_t *forkattn_trie_input_rows(const forkattn_trie *trie) { return trie ? trie->input_rows : NULL; }
const int64_t *forkattn_trie_input_nodes(const forkattn_trie *trie) { return trie ? trie->input_nodes : NULL; }
const int64_t *forkattn_trie_row_nodes(const forkattn_trie *trie) { return trie ? trie->row_nodes : NULL; }
const int64_t *forkattn_trie_row_positions(const forkattn_trie *trie) { return trie ? trie->row_positions : NULL; }
const int64_t *forkattn_trie_node_depths(const forkattn_trie *trie) { return trie ? trie->node_depths : NULL; }
const int64_t *forkattn_trie_row_tokens(const forkattn_trie *trie) { return trie ? trie->row_tokens : NULL; }
