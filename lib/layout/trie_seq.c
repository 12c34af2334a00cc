/* Rollout tries: the compressed trie of token sequences.
 *
 * Each sequence is walked against the trie built so far. A node is a run of
 * the input, [start, start + len) in global token indices (the tokens of the
 * first sequence that went through it); a hash table maps (parent, first
 * token) to the child, so a step costs O(1) at a branch and one comparison
 * per token inside a run. A sequence that leaves a run, or ends inside it,
 * splits the run: the head becomes a new node in the run's place and the run
 * keeps its tail (and its children). Each sequence adds at most two nodes, so
 * the whole build is O(total tokens) expected time. Then nodes are sorted by
 * start (= order of first appearance among siblings) and packed depth-first. */
#include <stdint.h>

#include "alloc.h"
#include "trie_internal.h"

typedef struct fa_seq_trie {
  const int64_t *tok;
  int64_t *start, *len, *parent; /* per node */
  int64_t nodes;
  int64_t *slot; /* hash table of nodes, keyed by (parent, tok[start]); -1 empty */
  uint64_t mask;
} fa_seq_trie;

static uint64_t fa_mix64(uint64_t x) { /* splitmix64's finalizer */
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Slot of the child of `parent` (-1: the roots) starting with `token`, or the
 * empty slot where it would go. */
static uint64_t fa_seq_find(const fa_seq_trie *st, int64_t parent, int64_t token) {
  uint64_t i = fa_mix64((uint64_t)token ^ fa_mix64((uint64_t)parent + 0x9E3779B97F4A7C15ull)) & st->mask;
  for (;; i = (i + 1) & st->mask) {
    const int64_t v = st->slot[i];
    if (v < 0 || (st->parent[v] == parent && st->tok[st->start[v]] == token)) return i;
  }
}

/* Walk tokens [a, b) from the roots; firstocc[t] = global index of the row token t lands on. */
static void fa_seq_insert(fa_seq_trie *st, int64_t a, int64_t b, int64_t *firstocc) {
  const int64_t *tok = st->tok;
  int64_t pos = a, cur = -1;
  while (pos < b) {
    const uint64_t i = fa_seq_find(st, cur, tok[pos]);
    const int64_t c = st->slot[i];
    if (c < 0) { /* a new leaf: the rest of the sequence */
      const int64_t v = st->nodes++;
      st->start[v] = pos;
      st->len[v] = b - pos;
      st->parent[v] = cur;
      st->slot[i] = v;
      for (int64_t t = pos; t < b; t++) firstocc[t] = t;
      return;
    }
    const int64_t cs = st->start[c], cl = st->len[c], lim = cl < b - pos ? cl : b - pos;
    int64_t k = 1;
    while (k < lim && tok[cs + k] == tok[pos + k]) k++;
    for (int64_t j = 0; j < k; j++) firstocc[pos + j] = cs + j;
    pos += k;
    if (k == cl) {
      cur = c;
      continue;
    }
    /* Diverges from (or ends inside) c: head h = [cs, cs + k) takes c's slot. */
    const int64_t h = st->nodes++;
    st->start[h] = cs;
    st->len[h] = k;
    st->parent[h] = st->parent[c];
    st->slot[i] = h;
    st->start[c] = cs + k;
    st->len[c] = cl - k;
    st->parent[c] = h;
    st->slot[fa_seq_find(st, h, tok[cs + k])] = c;
    cur = h;
  }
}

forkattn_status fa_trie_build_sequences(int64_t num, const int64_t *offsets, const int64_t *tokens,
                                        forkattn_trie **out) {
  const int64_t total = offsets[num];
  forkattn_status st = FORKATTN_ERR_OUT_OF_MEMORY;
  forkattn_trie *t = NULL;
  int64_t *nodes = NULL, *firstocc = NULL, *rowmap = NULL, *forest = NULL;
  fa_seq_trie s = {tokens, NULL, NULL, NULL, 0, NULL, 0};
  *out = NULL;
  if (num > INT64_MAX / 8) goto done;
  const int64_t maxn = 2 * num; /* a split and a leaf per sequence at most */
  uint64_t cap = 16;
  while (cap < 2 * (uint64_t)maxn) cap *= 2; /* load <= 1/2 */
  if (!(nodes = fa_trie_i64(3 * maxn)) || !(s.slot = fa_trie_i64((int64_t)cap)) ||
      !(firstocc = fa_trie_i64(total)))
    goto done;
  s.start = nodes;
  s.len = nodes + maxn;
  s.parent = nodes + 2 * maxn;
  s.mask = cap - 1;
  for (uint64_t i = 0; i < cap; i++) s.slot[i] = -1;
  for (int64_t q = 0; q < num; q++) fa_seq_insert(&s, offsets[q], offsets[q + 1], firstocc);
  fa_free(s.slot);
  s.slot = NULL;

  /* Rank nodes by start through rowmap (global index -> node, then -> rank). */
  const int64_t m = s.nodes;
  if (!(rowmap = fa_trie_i64(total)) || !(forest = fa_trie_i64(4 * m))) goto done;
  int64_t *fpar = forest, *flen = forest + m, *fstart = forest + 2 * m, *pack = forest + 3 * m;
  for (int64_t g = 0; g < total; g++) rowmap[g] = -1;
  for (int64_t v = 0; v < m; v++) rowmap[s.start[v]] = v;
  int64_t rows = 0;
  for (int64_t g = 0, r = 0; g < total; g++) {
    const int64_t v = rowmap[g];
    if (v < 0) continue;
    rowmap[g] = r;
    fpar[r] = v; /* for the next pass */
    flen[r] = s.len[v];
    rows += s.len[v];
    fstart[r++] = g;
  }
  for (int64_t r = 0; r < m; r++) {
    const int64_t p = s.parent[fpar[r]];
    fpar[r] = p < 0 ? -1 : rowmap[s.start[p]];
  }
  const fa_trie_forest f = {m, fpar, flen, rows};
  int64_t bad;
  if (fa_trie_pack(&f, pack, &t, &bad) != FA_PACK_OK) goto done; /* no cycles here: out of memory */
  if (!(t->row_tokens = fa_trie_i64(t->num_rows))) goto done;

  /* Global index of every row's first occurrence -> packed row; then the input map. */
  for (int64_t r = 0; r < m; r++) {
    const int64_t base = t->node_offsets[pack[r]];
    for (int64_t k = 0; k < flen[r]; k++) {
      rowmap[fstart[r] + k] = base + k;
      t->row_tokens[base + k] = tokens[fstart[r] + k];
    }
  }
  for (int64_t g = 0; g < total; g++) firstocc[g] = rowmap[firstocc[g]];
  t->input_rows = firstocc;
  firstocc = NULL;
  t->num_inputs = total;
  t->replicated = total;
  *out = t;
  t = NULL;
  st = FORKATTN_OK;
done:
  fa_trie_destroy(t);
  fa_free(nodes);
  fa_free(s.slot);
  fa_free(firstocc);
  fa_free(rowmap);
  fa_free(forest);
  return st;
}
