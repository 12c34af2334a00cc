/* Rollout tries: depth-first packing of a forest given by parent pointers
 * (iterative; chains of any depth; the largest child first), cycle detection,
 * and the row maps every builder shares (see trie_internal.h). */
#include <stdint.h>

#include "alloc.h"
#include "trie_internal.h"

int64_t *fa_trie_i64(int64_t count) {
  if (count < 0 || (uint64_t)count > SIZE_MAX / sizeof(int64_t)) return NULL;
  return fa_malloc((size_t)count * sizeof(int64_t));
}

void fa_trie_destroy(forkattn_trie *t) {
  if (!t) return;
  fa_free(t->node_offsets);
  fa_free(t->parents);
  fa_free(t->node_depths);
  fa_free(t->row_nodes);
  fa_free(t->row_positions);
  fa_free(t->row_tokens);
  fa_free(t->input_rows);
  fa_free(t->input_nodes);
  fa_free(t);
}

/* Children lists in CSR form: the children of node k (k = m: the roots) are
 * kids[first[k] .. first[k+1]), in increasing index. first has m+2 entries. */
static void fa_trie_children(int64_t m, const int64_t *parent, int64_t *first, int64_t *kids) {
  for (int64_t k = 0; k <= m + 1; k++) first[k] = 0;
  for (int64_t i = 0; i < m; i++) first[(parent[i] < 0 ? m : parent[i]) + 1]++;
  for (int64_t k = 0; k <= m; k++) first[k + 1] += first[k];
  for (int64_t i = 0; i < m; i++) kids[first[parent[i] < 0 ? m : parent[i]]++] = i;
  for (int64_t k = m + 1; k > 0; k--) first[k] = first[k - 1]; /* cursors back to starts */
  first[0] = 0;
}

/* Pre-order from the roots with an explicit stack; returns the nodes reached. */
static int64_t fa_trie_dfs(int64_t m, const int64_t *first, const int64_t *kids, int64_t *stack,
                           int64_t *order, int64_t *pack) {
  int64_t top = 0, next = 0;
  for (int64_t j = first[m + 1] - 1; j >= first[m]; j--) stack[top++] = kids[j];
  while (top > 0) {
    const int64_t v = stack[--top];
    pack[v] = next;
    order[next++] = v;
    for (int64_t j = first[v + 1] - 1; j >= first[v]; j--) stack[top++] = kids[j];
  }
  return next;
}

/* Move each node's child with the most nodes in its subtree (the first such)
 * to the front of its children, the others keeping their order: pre-order
 * then packs that child right after its parent, so tree attention's plan
 * reads it and its parent as one key segment (segment_plan.h,
 * fa_tree_chains), and every root path crosses O(log m) such chains instead
 * of one segment per branching ancestor. order: a pre-order; size: scratch. */
static void fa_trie_heavy_first(int64_t m, const int64_t *par, const int64_t *order, const int64_t *first,
                                int64_t *kids, int64_t *size) {
  for (int64_t i = 0; i < m; i++) size[i] = 1;
  for (int64_t i = m - 1; i >= 0; i--) /* children after their parent in pre-order */
    if (par[order[i]] >= 0) size[par[order[i]]] += size[order[i]];
  for (int64_t v = 0; v < m; v++) {
    int64_t best = first[v];
    for (int64_t j = first[v] + 1; j < first[v + 1]; j++) best = size[kids[j]] > size[kids[best]] ? j : best;
    const int64_t heavy = kids[best];
    for (int64_t j = best; j > first[v]; j--) kids[j] = kids[j - 1];
    if (first[v + 1] > first[v]) kids[first[v]] = heavy;
  }
}

fa_pack_result fa_trie_pack(const fa_trie_forest *f, int64_t *pack, forkattn_trie **out, int64_t *bad) {
  const int64_t m = f->m, *par = f->parent, *len = f->len;
  *out = NULL;
  if (m > (INT64_MAX - 2) / 5) return FA_PACK_NOMEM;
  int64_t *scratch = fa_trie_i64(5 * m + 2);
  if (!scratch) return FA_PACK_NOMEM;
  int64_t *first = scratch, *kids = first + m + 2, *stack = kids + m, *order = stack + m, *size = order + m;
  fa_trie_children(m, par, first, kids);
  for (int64_t i = 0; i < m; i++) pack[i] = -1;
  if (fa_trie_dfs(m, first, kids, stack, order, pack) < m) {
    /* An unreached node never gets to a root: m steps up from it lie on a cycle. */
    int64_t v = 0;
    while (pack[v] >= 0) v++;
    for (int64_t s = 0; s < m; s++) v = par[v];
    *bad = v;
    fa_free(scratch);
    return FA_PACK_CYCLE;
  }
  fa_trie_heavy_first(m, par, order, first, kids, size);
  fa_trie_dfs(m, first, kids, stack, order, pack);
  /* End of every node's root-to-node token path (packed order: parents first);
   * bounded by f->rows, so only the sum over leaves can overflow. */
  int64_t *pend = stack, replicated = 0;
  for (int64_t i = 0; i < m; i++) {
    const int64_t v = order[i], p = par[v];
    pend[i] = (p < 0 ? 0 : pend[pack[p]]) + len[v];
    if (first[v + 1] == first[v] && __builtin_add_overflow(replicated, pend[i], &replicated)) {
      fa_free(scratch);
      return FA_PACK_OVERFLOW;
    }
  }
  forkattn_trie *t = fa_calloc(1, sizeof *t);
  if (!t || !(t->node_offsets = fa_trie_i64(m + 1)) || !(t->parents = fa_trie_i64(m)) ||
      !(t->node_depths = fa_trie_i64(m)) || !(t->row_nodes = fa_trie_i64(f->rows)) ||
      !(t->row_positions = fa_trie_i64(f->rows))) {
    fa_trie_destroy(t);
    fa_free(scratch);
    return FA_PACK_NOMEM;
  }
  int64_t off = 0;
  for (int64_t i = 0; i < m; i++) {
    const int64_t v = order[i], p = par[v] < 0 ? -1 : pack[par[v]], pos = pend[i] - len[v];
    t->parents[i] = p;
    t->node_depths[i] = p < 0 ? 0 : t->node_depths[p] + 1;
    t->node_offsets[i] = off;
    for (int64_t k = 0; k < len[v]; k++) {
      t->row_nodes[off + k] = i;
      t->row_positions[off + k] = pos + k;
    }
    off += len[v];
  }
  t->node_offsets[m] = off;
  t->num_nodes = m;
  t->num_rows = off;
  t->replicated = replicated;
  fa_free(scratch);
  *out = t;
  return FA_PACK_OK;
}
