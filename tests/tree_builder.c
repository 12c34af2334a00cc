/* tree_builder.c - trees for the tests (see tree_builder.h). */
#include "tree_builder.h"

#include <criterion/criterion.h>
#include <stdlib.h>

void tt_init(tt_tree *t, int64_t cap) {
  t->n = 0;
  t->parent = malloc(sizeof(int64_t) * (size_t)cap);
  t->len = malloc(sizeof(int64_t) * (size_t)cap);
  cr_assert(t->parent && t->len);
}

int64_t tt_add(tt_tree *t, int64_t parent, int64_t len) {
  t->parent[t->n] = parent;
  t->len[t->n] = len;
  return t->n++;
}

void tt_free(tt_tree *t) {
  free(t->parent);
  free(t->len);
}

/* Pack in DFS order (bfs = 0; children in index order, iterative) or BFS order. */
void tt_pack(tt_packed *p, const tt_tree *t, int bfs) {
  const int64_t n = t->n;
  int64_t *first = malloc(sizeof(int64_t) * (size_t)(n + 1)), *next = malloc(sizeof(int64_t) * (size_t)(n + 1));
  int64_t *stack = malloc(sizeof(int64_t) * (size_t)(n + 1)), *packed_of = malloc(sizeof(int64_t) * (size_t)(n + 1));
  p->off = malloc(sizeof(int64_t) * (size_t)(n + 1));
  p->par = malloc(sizeof(int64_t) * (size_t)(n + 1));
  p->order = malloc(sizeof(int64_t) * (size_t)(n + 1));
  p->row_of_node = malloc(sizeof(int64_t) * (size_t)(n + 1));
  cr_assert(first && next && stack && packed_of && p->off && p->par && p->order && p->row_of_node);
  for (int64_t i = 0; i < n; i++) first[i] = next[i] = -1;
  /* child lists in index order: insert in reverse */
  for (int64_t i = n - 1; i >= 0; i--)
    if (t->parent[i] >= 0) {
      next[i] = first[t->parent[i]];
      first[t->parent[i]] = i;
    }
  int64_t k = 0, top = 0, head = 0;
  for (int64_t r = n - 1; r >= 0; r--) /* roots: stack (DFS, reversed) or queue (BFS) */
    if (t->parent[r] < 0) stack[top++] = r;
  if (bfs)
    for (int64_t a = 0, b = top - 1; a < b; a++, b--) {
      int64_t x = stack[a];
      stack[a] = stack[b];
      stack[b] = x;
    }
  while (bfs ? head < top : top > 0) {
    const int64_t x = bfs ? stack[head++] : stack[--top];
    p->order[k] = x;
    packed_of[x] = k++;
    if (bfs) {
      for (int64_t c = first[x]; c >= 0; c = next[c]) stack[top++] = c;
    } else {
      int64_t m = 0;
      for (int64_t c = first[x]; c >= 0; c = next[c]) m++;
      int64_t j = top + m;
      for (int64_t c = first[x]; c >= 0; c = next[c]) stack[--j] = c; /* first child on top */
      top += m;
    }
  }
  cr_assert_eq(k, n, "tree has a cycle or a bad parent");
  p->off[0] = 0;
  for (int64_t j = 0; j < n; j++) {
    const int64_t x = p->order[j];
    p->off[j + 1] = p->off[j] + t->len[x];
    p->par[j] = t->parent[x] < 0 ? -1 : packed_of[t->parent[x]];
    p->row_of_node[x] = p->off[j];
  }
  p->layout = (forkattn_tree_layout){n, p->off, p->par};
  free(first);
  free(next);
  free(stack);
  free(packed_of);
}

void tt_packed_free(tt_packed *p) {
  free(p->off);
  free(p->par);
  free(p->order);
  free(p->row_of_node);
}

/* Random RL trie: a prompt root, then children hung under random nodes until
 * the tree has `leaves` leaves; segment lengths in [1, max_seg]. */
void tt_random_trie(tt_tree *t, tc_rng *rng, int64_t prompt, int64_t leaves, int64_t max_seg) {
  tt_init(t, 4 * leaves + 2);
  tt_add(t, -1, prompt);
  int64_t *kids = calloc((size_t)(4 * leaves + 2), sizeof *kids), nleaves = 1;
  cr_assert(kids);
  while (nleaves < leaves && t->n < 4 * leaves + 1) {
    const int64_t x = tc_randint(rng, 0, t->n - 1);
    if (kids[x]++ > 0) nleaves++; /* a second child adds a leaf; a first one moves it */
    tt_add(t, x, tc_randint(rng, 1, max_seg));
  }
  free(kids);
}

