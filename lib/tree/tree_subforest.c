/* Sub-forests: a subset of a tree's nodes repacked in its own rows (the parts
 * of a partition, the batches of a batch plan). */
#include <string.h>

#include "alloc.h"
#include "tree_model.h"

void fa_subset_local(const int64_t *off, const int64_t *par, const int64_t *nodes, int64_t count,
                     int64_t *g2l, int64_t *loc_off, int64_t *loc_par) {
  loc_off[0] = 0;
  for (int64_t j = 0; j < count; j++) {
    const int64_t x = nodes[j];
    g2l[x] = j;
    loc_off[j + 1] = loc_off[j] + (off[x + 1] - off[x]);
    loc_par[j] = par[x] < 0 ? -1 : g2l[par[x]]; /* the parent is listed, and earlier */
  }
}

void fa_subforest_free(fa_subforest *s) {
  fa_free(s->off);
  fa_free(s->par);
  fa_free(s->row_map);
  fa_free(s->owned);
  memset(s, 0, sizeof *s);
}

int fa_subforest_build(fa_subforest *s, const int64_t *off, const int64_t *par, const int64_t *nodes,
                       int64_t count, int64_t *g2l) {
  memset(s, 0, sizeof *s);
  if (count == 0) return 0;
  s->off = fa_malloc_array(count + 1, sizeof *s->off);
  s->par = fa_malloc_array(count, sizeof *s->par);
  if (!s->off || !s->par) {
    fa_subforest_free(s);
    return -1;
  }
  fa_subset_local(off, par, nodes, count, g2l, s->off, s->par);
  s->n = count;
  s->rows = s->off[count];
  if (s->rows == 0) return 0;
  /* rows come from node_offsets values, not from arrays of that size: 2^61 rows
   * must fail to allocate, not wrap to a tiny map */
  s->row_map = fa_malloc_array(s->rows, sizeof *s->row_map);
  if (!s->row_map) {
    fa_subforest_free(s);
    return -1;
  }
  for (int64_t j = 0; j < count; j++)
    for (int64_t r = s->off[j], g = off[nodes[j]]; r < s->off[j + 1]; r++, g++) s->row_map[r] = g;
  return 0;
}

forkattn_tree_layout fa_subforest_layout(const fa_subforest *s) {
  return (forkattn_tree_layout){s->n, s->off, s->par};
}

/* Heap sort of indices: no recursion, no allocation, deterministic. */
static void fa_sift_down(int64_t *a, int64_t root, int64_t n, fa_before_fn before, const void *arg) {
  for (;;) {
    int64_t c = 2 * root + 1;
    if (c >= n) return;
    if (c + 1 < n && before(arg, a[c], a[c + 1])) c++;
    if (!before(arg, a[root], a[c])) return;
    const int64_t t = a[root];
    a[root] = a[c];
    a[c] = t;
    root = c;
  }
}

void fa_sort_idx(int64_t *a, int64_t n, fa_before_fn before, const void *arg) {
  for (int64_t i = n / 2 - 1; i >= 0; i--) fa_sift_down(a, i, n, before, arg);
  for (int64_t end = n - 1; end > 0; end--) {
    const int64_t t = a[0];
    a[0] = a[end];
    a[end] = t;
    fa_sift_down(a, 0, end, before, arg);
  }
}

static int fa_less_i64(const void *arg, int64_t a, int64_t b) {
  (void)arg;
  return a < b;
}

void fa_sort_i64(int64_t *a, int64_t n) { fa_sort_idx(a, n, fa_less_i64, NULL); }
