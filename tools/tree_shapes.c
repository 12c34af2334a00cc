/* Seeded tree shapes for `forkattn bench tree` (see tree_shapes.h). Nodes are
 * generated with parent index < own index, then renumbered in DFS preorder. */
#include "tree_shapes.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const ts_names[] = {"rl", "wide", "deep"};

const char *tree_shape_name(tree_shape_kind k) { return ts_names[k]; }

int tree_shape_parse_kind(const char *v, tree_shape_kind *out) {
  for (int k = 0; k < 3; k++)
    if (!strcmp(v, ts_names[k])) {
      *out = (tree_shape_kind)k;
      return 0;
    }
  return -1;
}

void tree_shape_defaults(tree_shape_params *p) {
  /* prompt, leaves, min_seg, max_seg, turns per kind */
  static const int64_t def[3][5] = {{1024, 16, 1, 512, 0}, {4096, 64, 16, 128, 0}, {1024, 32, 64, 256, 8}};
  int64_t *f[5] = {&p->prompt, &p->leaves, &p->min_seg, &p->max_seg, &p->turns};
  for (int i = 0; i < 5; i++)
    if (*f[i] < 0) *f[i] = def[p->kind][i];
  if (p->seed < 0) p->seed = 1;
}

/* ---- generation: nodes in creation order ---------------------------------- */

typedef struct ts_raw {
  int64_t n, cap;
  int64_t *par, *len, *kids; /* kids: number of children so far */
  uint64_t rng;
} ts_raw;

static uint64_t ts_next(ts_raw *r) { /* xorshift64* */
  r->rng ^= r->rng >> 12;
  r->rng ^= r->rng << 25;
  r->rng ^= r->rng >> 27;
  return r->rng * 2685821657736338717ull;
}

static int64_t ts_uniform(ts_raw *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)((ts_next(r) >> 11) % (uint64_t)(hi - lo + 1));
}

/* Append a node under parent (-1: root); its index, or -1 without memory. */
static int64_t ts_add(ts_raw *r, int64_t parent, int64_t len) {
  if (r->n == r->cap) {
    int64_t cap = r->cap ? 2 * r->cap : 64;
    int64_t **a[3] = {&r->par, &r->len, &r->kids};
    for (int i = 0; i < 3; i++) {
      int64_t *p = realloc(*a[i], sizeof(int64_t) * (size_t)cap);
      if (!p) return -1;
      *a[i] = p;
    }
    r->cap = cap;
  }
  r->par[r->n] = parent;
  r->len[r->n] = len;
  r->kids[r->n] = 0;
  if (parent >= 0) r->kids[parent]++;
  return r->n++;
}

static int64_t ts_segment(ts_raw *r, const tree_shape_params *p) { return ts_uniform(r, p->min_seg, p->max_seg); }

/* Random RL trie: hang a segment under a random node until there are `leaves`
 * leaves. A node's first child only moves a leaf down; later ones add one. */
static int ts_gen_rl(ts_raw *r, const tree_shape_params *p) {
  if (ts_add(r, -1, p->prompt) < 0) return -1;
  for (int64_t leaves = 1; leaves < p->leaves;) {
    int64_t x = ts_uniform(r, 0, r->n - 1);
    if (r->kids[x] > 0) leaves++;
    if (ts_add(r, x, ts_segment(r, p)) < 0) return -1;
  }
  return 0;
}

/* Wide: ceil(sqrt(leaves)) branches under the prompt, the leaves dealt round-robin under them. */
static int ts_gen_wide(ts_raw *r, const tree_shape_params *p) {
  int64_t b = (int64_t)ceil(sqrt((double)p->leaves));
  if (ts_add(r, -1, p->prompt) < 0) return -1;
  for (int64_t i = 0; i < b; i++)
    if (ts_add(r, 0, ts_segment(r, p)) < 0) return -1;
  for (int64_t i = 0; i < p->leaves; i++)
    if (ts_add(r, 1 + i % b, ts_segment(r, p)) < 0) return -1;
  return 0;
}

/* Deep: every turn each active branch gets one new segment, or two (a fork,
 * probability 1/2) while the branch count stays within the leaf cap. Nodes of
 * one turn are created after those of the previous one, so the active branches
 * of a turn are the last `active` nodes. */
static int ts_gen_deep(ts_raw *r, const tree_shape_params *p) {
  if (ts_add(r, -1, p->prompt) < 0) return -1;
  int64_t first = 0, active = 1;
  for (int64_t t = 0; t < p->turns; t++) {
    int64_t next_first = r->n, branches = active;
    for (int64_t b = first; b < first + active; b++) {
      int fork = branches < p->leaves && (ts_next(r) >> 63);
      branches += fork;
      for (int c = 0; c <= fork; c++)
        if (ts_add(r, b, ts_segment(r, p)) < 0) return -1;
    }
    first = next_first;
    active = branches;
  }
  return 0;
}

/* ---- packing --------------------------------------------------------------- */

/* DFS preorder without a stack: a node's position is its parent's next free
 * slot, and the slot then moves past the node's subtree (children in index
 * order; parents come before children, so one forward pass suffices). */
static void ts_preorder(const ts_raw *r, int64_t *pos, int64_t *slot) {
  for (int64_t i = 0; i < r->n; i++) slot[i] = 1; /* subtree sizes first */
  for (int64_t i = r->n - 1; i >= 0; i--)
    if (r->par[i] >= 0) slot[r->par[i]] += slot[i];
  int64_t next_root = 0;
  for (int64_t i = 0; i < r->n; i++) {
    int64_t *from = r->par[i] < 0 ? &next_root : &slot[r->par[i]];
    pos[i] = *from;
    *from += slot[i]; /* slot[i] still holds i's subtree size here */
    slot[i] = pos[i] + 1;
  }
}

static int ts_pack(tree_shape *t, const ts_raw *r) {
  const int64_t n = r->n;
  int64_t *pos = malloc(sizeof(int64_t) * (size_t)n), *slot = malloc(sizeof(int64_t) * (size_t)n);
  t->off = malloc(sizeof(int64_t) * (size_t)(n + 1));
  t->par = malloc(sizeof(int64_t) * (size_t)n);
  t->anc = malloc(sizeof(int64_t) * (size_t)n);
  t->leaf = malloc(sizeof(int64_t) * (size_t)n);
  int ok = pos && slot && t->off && t->par && t->anc && t->leaf;
  if (ok) {
    ts_preorder(r, pos, slot);
    for (int64_t i = 0; i < n; i++) {
      t->off[pos[i] + 1] = r->len[i];
      t->par[pos[i]] = r->par[i] < 0 ? -1 : pos[r->par[i]];
      slot[pos[i]] = r->kids[i]; /* reuse: children per packed node */
    }
    t->off[0] = 0;
    t->num_leaves = t->depth = 0;
    for (int64_t k = 0; k < n; k++) {
      t->off[k + 1] += t->off[k];
      const int64_t p = t->par[k];
      t->anc[k] = p < 0 ? 0 : t->anc[p] + t->off[p + 1] - t->off[p];
      pos[k] = p < 0 ? 0 : pos[p] + 1; /* reuse: depth */
      if (slot[k] == 0) t->leaf[t->num_leaves++] = k;
      if (pos[k] > t->depth) t->depth = pos[k];
    }
    t->layout = (forkattn_tree_layout){n, t->off, t->par};
  }
  free(pos);
  free(slot);
  return ok ? 0 : -1;
}

int tree_shape_build(tree_shape *t, const tree_shape_params *p) {
  memset(t, 0, sizeof *t);
  ts_raw r = {0, 0, NULL, NULL, NULL, 0x9e3779b97f4a7c15ull ^ (uint64_t)p->seed};
  if (!r.rng) r.rng = 1; /* xorshift's one fixed point */
  int (*const gen[3])(ts_raw *, const tree_shape_params *) = {ts_gen_rl, ts_gen_wide, ts_gen_deep};
  int rc = gen[p->kind](&r, p);
  if (!rc) rc = ts_pack(t, &r);
  free(r.par);
  free(r.len);
  free(r.kids);
  if (rc) tree_shape_free(t);
  return rc;
}

void tree_shape_free(tree_shape *t) {
  free(t->off);
  free(t->par);
  free(t->anc);
  free(t->leaf);
  memset(t, 0, sizeof *t);
}

int64_t tree_shape_path(const tree_shape *t, int64_t node, int64_t *path) {
  int64_t m = 0;
  for (int64_t x = node; x >= 0; x = t->par[x]) path[m++] = x;
  for (int64_t a = 0, b = m - 1; a < b; a++, b--) {
    int64_t x = path[a];
    path[a] = path[b];
    path[b] = x;
  }
  return m;
}

double tree_shape_pairs(const tree_shape *t) {
  double pairs = 0;
  for (int64_t k = 0; k < t->layout.num_nodes; k++) {
    double len = (double)tree_shape_len(t, k);
    pairs += len * (double)t->anc[k] + len * (len + 1) / 2;
  }
  return pairs;
}

int64_t tree_shape_replicated_rows(const tree_shape *t) {
  int64_t rows = 0;
  for (int64_t i = 0; i < t->num_leaves; i++) rows += t->anc[t->leaf[i]] + tree_shape_len(t, t->leaf[i]);
  return rows;
}
