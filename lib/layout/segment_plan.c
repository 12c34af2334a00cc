/* Segment plan construction, block splitting and visibility ranges. */
#include "alloc.h"
#include "rowsum_exact.h"
#include "segment_plan.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Key units of key blocks for one chunk (fa_plan_key_units_memo). */
typedef struct fa_units_memo {
  struct fa_units_memo *next;
  int64_t chunk, n;
  fa_key_unit *units;
  int64_t *unit_off;
} fa_units_memo;

/* Block lists derived from a plan, one per (block_rows, by_key) asked for. */
typedef struct fa_blocks_memo {
  struct fa_blocks_memo *next;
  int64_t block_rows, n;
  int by_key;
  int64_t query_keys;   /* fa_plan_query_keys of query blocks once asked for; -1 before */
  int64_t fewest_keys;  /* fa_plan_fewest_query_keys, computed with query_keys */
  fa_block *blocks;
  fa_block_item *items; /* fa_plan_block_items_memo once asked for */
  int items_see_keys;   /* fa_block_items_see_keys of items */
  int64_t key_work, key_heaviest; /* fa_plan_key_chunk's sums over key blocks once asked for; -1 before */
  fa_units_memo *units;           /* fa_plan_key_units_memo, one per chunk asked for */
} fa_blocks_memo;

struct fa_plan_memo {
  fa_blocks_memo *blocks;
};

static void fa_plan_memo_free(struct fa_plan_memo *m) {
  if (!m) return;
  for (fa_blocks_memo *b = m->blocks, *next; b; b = next) {
    next = b->next;
    for (fa_units_memo *u = b->units, *unext; u; u = unext) {
      unext = u->next;
      fa_free(u->units);
      fa_free(u->unit_off);
      fa_free(u);
    }
    fa_free(b->blocks);
    fa_free(b->items);
    fa_free(b);
  }
  fa_free(m);
}

void fa_plan_free(fa_plan *p) {
  fa_plan_memo_free(p->memo);
  fa_free(p->seg);
  fa_free(p->pair);
  fa_free(p->q_pair_off);
  fa_free(p->k_pair_off);
  fa_free(p->k_pair_idx);
  memset(p, 0, sizeof *p);
}

int fa_plan_build_owned(fa_plan *p, int64_t rows, int64_t nseg, const fa_range *seg, int64_t npairs,
                        const fa_pair *pair, const int64_t *owner) {
  memset(p, 0, sizeof *p);
  p->rows = rows;
  p->nseg = nseg;
  p->npairs = npairs;
  p->seg = fa_malloc_array(nseg, sizeof *p->seg);
  p->pair = fa_malloc_array(npairs, sizeof *p->pair);
  p->q_pair_off = fa_calloc((size_t)nseg + 1, sizeof *p->q_pair_off);
  p->k_pair_off = fa_calloc((size_t)nseg + 1, sizeof *p->k_pair_off);
  p->k_pair_idx = fa_malloc_array(npairs, sizeof *p->k_pair_idx);
  p->memo = fa_calloc(1, sizeof *p->memo);
  if (!p->seg || !p->pair || !p->q_pair_off || !p->k_pair_off || !p->k_pair_idx || !p->memo) {
    fa_plan_free(p);
    return -1;
  }
  if (nseg) memcpy(p->seg, seg, sizeof *seg * (size_t)nseg);
  if (npairs) memcpy(p->pair, pair, sizeof *pair * (size_t)npairs);
  for (int64_t i = 0; i < npairs; i++) {
    p->q_pair_off[pair[i].qseg + 1]++;
    p->k_pair_off[(owner ? owner[i] : pair[i].kseg) + 1]++;
  }
  for (int64_t s = 0; s < nseg; s++) {
    p->q_pair_off[s + 1] += p->q_pair_off[s];
    p->k_pair_off[s + 1] += p->k_pair_off[s];
  }
  /* Counting sort of pair indices by key segment (stable: deterministic sums). */
  int64_t *fill = fa_calloc((size_t)nseg + 1, sizeof *fill);
  if (!fill) {
    fa_plan_free(p);
    return -1;
  }
  for (int64_t i = 0; i < npairs; i++) {
    int64_t ks = owner ? owner[i] : pair[i].kseg;
    p->k_pair_idx[p->k_pair_off[ks] + fill[ks]++] = i;
  }
  fa_free(fill);
  return 0;
}

int fa_plan_build(fa_plan *p, int64_t rows, int64_t nseg, const fa_range *seg, int64_t npairs,
                  const fa_pair *pair) {
  return fa_plan_build_owned(p, rows, nseg, seg, npairs, pair, NULL);
}

void fa_tree_chains(int64_t n, const int64_t *off, const int64_t *parents, int causal, int64_t *near,
                    int64_t *kids, int64_t *cont) {
  for (int64_t i = 0; i < n; i++) kids[i] = 0;
  for (int64_t i = 0; i < n; i++) { /* parents precede children: one pass */
    const int64_t a = parents[i];
    near[i] = (a < 0 || off[a + 1] > off[a]) ? a : near[a];
    if (off[i + 1] > off[i] && near[i] >= 0) kids[near[i]]++;
  }
  for (int64_t i = 0; i < n; i++) {
    const int64_t a = near[i];
    cont[i] = causal && off[i + 1] > off[i] && a >= 0 && off[a + 1] == off[i];
  }
}

/* Key segments of a tree (fa_tree_chains says which nodes continue their
 * ancestor's): each node's segment and each segment's first node. */
typedef struct {
  int64_t *par;   /* nearest non-empty ancestor, -1 for none */
  int64_t *kseg;  /* key segment of each node, -1 for an empty node */
  int64_t *first; /* first node of each key segment */
  int64_t nkseg;
} fa_tree_keys;

static void fa_tree_keys_free(fa_tree_keys *t) {
  fa_free(t->par);
  fa_free(t->kseg);
  fa_free(t->first);
}

static int fa_tree_keys_build(fa_tree_keys *t, int64_t n, const int64_t *off, const int64_t *parents,
                              int causal) {
  const int64_t cap = n;
  int64_t *kids = fa_malloc_array(cap, sizeof *kids);
  t->par = fa_malloc_array(cap, sizeof *t->par);
  t->kseg = fa_malloc_array(cap, sizeof *t->kseg);
  t->first = fa_malloc_array(cap, sizeof *t->first);
  t->nkseg = 0;
  if (!kids || !t->par || !t->kseg || !t->first) {
    fa_free(kids);
    fa_tree_keys_free(t);
    return -1;
  }
  fa_tree_chains(n, off, parents, causal, t->par, kids, t->kseg);
  for (int64_t i = 0; i < n; i++) { /* kseg holds "continues" until rewritten here; ancestors first */
    if (off[i + 1] == off[i])
      t->kseg[i] = -1;
    else if (t->kseg[i])
      t->kseg[i] = t->kseg[t->par[i]];
    else
      t->first[t->kseg[i] = t->nkseg++] = i;
  }
  fa_free(kids);
  return 0;
}

int fa_plan_tree(fa_plan *p, int64_t n, const int64_t *off, const int64_t *parents, int causal) {
  fa_tree_keys t;
  if (fa_tree_keys_build(&t, n, off, parents, causal)) return -1;
  /* Segments: one per non-empty node (its queries), then one per key segment
   * spanning more than one node (a single-node key segment reuses the node's),
   * then the views: one per node whose chain is read up to it by a node of
   * another chain, unless that is the whole chain. */
  int64_t nq = 0, npairs = 0;
  int64_t *qseg = fa_malloc_array(n, sizeof *qseg);
  int64_t *view = fa_malloc_array(n, sizeof *view);
  int64_t *kseg_index = fa_malloc_array(t.nkseg ? t.nkseg : 1, sizeof *kseg_index);
  fa_range *seg = fa_malloc_array(2 * n + t.nkseg + 1, sizeof *seg);
  fa_pair *pair = NULL;
  int64_t *owner = NULL;
  if (!qseg || !view || !kseg_index || !seg) goto oom;
  for (int64_t i = 0; i < n; i++) {
    qseg[i] = view[i] = -1;
    if (off[i + 1] == off[i]) continue;
    seg[qseg[i] = nq++] = (fa_range){off[i], off[i + 1] - off[i]};
    for (int64_t a = i; a >= 0; a = t.par[t.first[t.kseg[a]]]) npairs++; /* one pair per chain on the path */
  }
  int64_t ns = nq;
  for (int64_t k = 0; k < t.nkseg; k++) kseg_index[k] = -1;
  for (int64_t i = n - 1; i >= 0; i--) { /* key segment end = end of its last node */
    if (qseg[i] < 0) continue;
    int64_t k = t.kseg[i];
    if (kseg_index[k] >= 0) continue;
    const int64_t f = t.first[k];
    if (f == i)
      kseg_index[k] = qseg[i];
    else
      seg[kseg_index[k] = ns++] = (fa_range){off[f], off[i + 1] - off[f]};
  }
  pair = fa_malloc_array(npairs, sizeof *pair);
  owner = fa_malloc_array(npairs, sizeof *owner);
  if (!pair || !owner) goto oom;
  int64_t np = 0;
  for (int64_t i = 0; i < n; i++) {
    if (qseg[i] < 0) continue;
    int64_t first_pair = np;
    for (int64_t a = i; a >= 0; a = t.par[t.first[t.kseg[a]]]) {
      /* a: the deepest node of this chain on i's path; i reads the chain up to a's end */
      const int64_t ks = kseg_index[t.kseg[a]], f = t.first[t.kseg[a]];
      int64_t rd = ks;
      if (a != i && off[a + 1] < seg[ks].start + seg[ks].len) {
        if (view[a] < 0) seg[view[a] = ns++] = (fa_range){off[f], off[a + 1] - off[f]};
        rd = view[a];
      }
      owner[np] = ks;
      pair[np++] = (fa_pair){qseg[i], rd, a == i ? causal : 0};
    }
    for (int64_t x = first_pair, y = np - 1; x < y; x++, y--) { /* root first, own node last */
      fa_pair tmp = pair[x];
      pair[x] = pair[y];
      pair[y] = tmp;
      int64_t o = owner[x];
      owner[x] = owner[y];
      owner[y] = o;
    }
  }
  int rc = fa_plan_build_owned(p, n ? off[n] : 0, ns, seg, np, pair, owner);
  fa_free(pair);
  fa_free(owner);
  fa_free(qseg);
  fa_free(view);
  fa_free(kseg_index);
  fa_free(seg);
  fa_tree_keys_free(&t);
  return rc;
oom:
  fa_free(pair);
  fa_free(owner);
  fa_free(qseg);
  fa_free(view);
  fa_free(kseg_index);
  fa_free(seg);
  fa_tree_keys_free(&t);
  return -1;
}

int fa_plan_prefix(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int causal) {
  /* the depth-one tree: node 0 = prompt, node 1+i = response i */
  int64_t *node_off = fa_malloc_array(n + 2, sizeof *node_off);
  int64_t *parents = fa_malloc_array(n + 1, sizeof *parents);
  if (!node_off || !parents) {
    fa_free(node_off);
    fa_free(parents);
    return -1;
  }
  node_off[0] = 0;
  parents[0] = -1;
  for (int64_t i = 0; i <= n; i++) node_off[i + 1] = prompt_len + (n ? off[i] : 0);
  for (int64_t i = 0; i < n; i++) parents[i + 1] = 0;
  int rc = fa_plan_tree(p, n + 1, node_off, parents, causal);
  fa_free(node_off);
  fa_free(parents);
  return rc;
}

int fa_plan_prefix_cached(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int causal) {
  /* segments: 0 = prefix keys, then per response its keys and its queries */
  fa_range *seg = fa_malloc_array(2 * n + 1, sizeof *seg);
  fa_pair *pair = fa_malloc_array(2 * n + 1, sizeof *pair);
  if (!seg || !pair) {
    fa_free(seg);
    fa_free(pair);
    return -1;
  }
  seg[0] = (fa_range){0, prompt_len};
  int64_t np = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t len = off[i + 1] - off[i];
    seg[1 + i] = (fa_range){prompt_len + off[i], len};
    seg[1 + n + i] = (fa_range){off[i], len};
    if (len == 0) continue;
    if (prompt_len > 0) pair[np++] = (fa_pair){1 + n + i, 0, 0};
    pair[np++] = (fa_pair){1 + n + i, 1 + i, causal != 0};
  }
  int rc = fa_plan_build(p, n ? off[n] : 0, 2 * n + 1, seg, np, pair);
  if (!rc) p->qshift = prompt_len;
  fa_free(seg);
  fa_free(pair);
  return rc;
}

int fa_plan_prefix_cached_blocks(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int64_t block) {
  /* Blocks of one row are the causal mask, and a block at least as long as
   * every response is the bidirectional one: both are planned as such (two
   * pairs per response, no key block cut at every row). */
  int64_t longest = 0;
  for (int64_t i = 0; i < n; i++) longest = off[i + 1] - off[i] > longest ? off[i + 1] - off[i] : longest;
  if (block <= 1 || block >= longest) return fa_plan_prefix_cached(p, prompt_len, n, off, block <= 1);
  /* Segments: 0 = prefix keys; per response its keys (the owner); per block its
   * queries and a view of the response's keys up to the block's end (the last
   * block reads the owner itself). Block j's pairs: the prefix, then the view:
   * two pairs per block, not one per (block, earlier block). block < longest
   * <= rows here, so no count below overflows. */
  int64_t nb = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t len = off[i + 1] - off[i];
    nb += len / block + (len % block != 0);
  }
  fa_range *seg = fa_malloc_array(1 + n + 2 * nb, sizeof *seg);
  fa_pair *pair = fa_malloc_array(2 * nb + 1, sizeof *pair);
  int64_t *owner = fa_malloc_array(2 * nb + 1, sizeof *owner);
  if (!seg || !pair || !owner) {
    fa_free(seg);
    fa_free(pair);
    fa_free(owner);
    return -1;
  }
  seg[0] = (fa_range){0, prompt_len};
  int64_t ns = 1 + n, k = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t len = off[i + 1] - off[i];
    seg[1 + i] = (fa_range){prompt_len + off[i], len};
    for (int64_t r = off[i], bl; r < off[i + 1]; r += bl) {
      bl = off[i + 1] - r < block ? off[i + 1] - r : block;
      const int64_t q = ns++, upto = r + bl - off[i];
      seg[q] = (fa_range){r, bl};
      int64_t kv = 1 + i;
      if (upto < len) seg[kv = ns++] = (fa_range){prompt_len + off[i], upto};
      if (prompt_len > 0) {
        owner[k] = 0;
        pair[k++] = (fa_pair){q, 0, 0};
      }
      owner[k] = 1 + i;
      pair[k++] = (fa_pair){q, kv, 0};
    }
  }
  int rc = fa_plan_build_owned(p, n ? off[n] : 0, ns, seg, k, pair, owner);
  if (!rc) p->qshift = prompt_len;
  fa_free(seg);
  fa_free(pair);
  fa_free(owner);
  return rc;
}

typedef struct {
  fa_block b;
  int64_t cost, order;
} fa_costed_block;

static int fa_cmp_cost(const void *a, const void *b) {
  const fa_costed_block *x = a, *y = b;
  if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
  return x->order < y->order ? -1 : (x->order > y->order);
}

static int fa_cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Where owner key segment s must be cut so that no key block straddles a
 * view's start or end: the sorted distinct offsets 0 < c < len, in cut;
 * returns the count. */
static int64_t fa_key_cuts(const fa_plan *p, int64_t s, int64_t *cut) {
  const fa_range o = p->seg[s];
  int64_t n = 0;
  for (int64_t j = p->k_pair_off[s]; j < p->k_pair_off[s + 1]; j++) {
    const fa_range k = p->seg[p->pair[p->k_pair_idx[j]].kseg];
    if (k.start > o.start && k.start < o.start + o.len) cut[n++] = k.start - o.start;
    if (k.start + k.len > o.start && k.start + k.len < o.start + o.len) cut[n++] = k.start + k.len - o.start;
  }
  if (n > 1) qsort(cut, (size_t)n, sizeof *cut, fa_cmp_i64);
  int64_t u = 0;
  for (int64_t i = 0; i < n; i++)
    if (u == 0 || cut[u - 1] != cut[i]) cut[u++] = cut[i];
  return u;
}

int64_t fa_plan_blocks(const fa_plan *p, int64_t block_rows, int by_key, fa_block **out) {
  const int64_t *off = by_key ? p->k_pair_off : p->q_pair_off;
  /* key blocks: owner segments cut at their views first (cut[] holds one
   * segment's cuts, then its end) */
  int64_t *cut = fa_malloc_array(2 * p->npairs + 1, sizeof *cut);
  if (!cut) {
    *out = NULL;
    return -1;
  }
  int64_t n = 0;
  for (int64_t s = 0; s < p->nseg; s++) {
    if (off[s + 1] == off[s]) continue;
    const int64_t nc = by_key ? fa_key_cuts(p, s, cut) : 0;
    cut[nc] = p->seg[s].len;
    for (int64_t c = 0, from = 0; c <= nc; from = cut[c++]) n += (cut[c] - from + block_rows - 1) / block_rows;
  }
  fa_costed_block *cb = fa_malloc_array(n, sizeof *cb);
  *out = fa_malloc_array(n, sizeof **out);
  if (!cb || !*out) {
    fa_free(cut);
    fa_free(cb);
    fa_free(*out);
    *out = NULL;
    return -1;
  }
  int64_t i = 0;
  for (int64_t s = 0; s < p->nseg; s++) {
    if (off[s + 1] == off[s]) continue;
    const int64_t nc = by_key ? fa_key_cuts(p, s, cut) : 0;
    cut[nc] = p->seg[s].len;
    for (int64_t c = 0, from = 0; c <= nc; from = cut[c++])
      for (int64_t r = from; r < cut[c]; r += block_rows) {
        fa_block b = {s, p->seg[s].start + r, cut[c] - r < block_rows ? cut[c] - r : block_rows};
        int64_t cost = 0;
        for (int64_t j = off[s]; j < off[s + 1]; j++) {
          /* work of the block with this pair: rows x visible rows on the other side
           * (an upper bound for causal pairs) */
          const fa_pair pr = by_key ? p->pair[p->k_pair_idx[j]] : p->pair[j];
          fa_range other = by_key ? fa_pair_queries(p->seg, pr, b.start, p->qshift)
                                  : fa_pair_keys(p->seg, pr, b.start, b.len, p->qshift);
          cost += other.len * b.len;
        }
        cb[i] = (fa_costed_block){b, cost, i};
        i++;
      }
  }
  fa_free(cut);
  qsort(cb, (size_t)n, sizeof *cb, fa_cmp_cost);
  for (int64_t j = 0; j < n; j++) (*out)[j] = cb[j].b;
  fa_free(cb);
  return n;
}

int64_t fa_plan_blocks_memo(const fa_plan *p, int64_t block_rows, int by_key, const fa_block **out) {
  for (const fa_blocks_memo *b = p->memo->blocks; b; b = b->next)
    if (b->block_rows == block_rows && b->by_key == by_key) {
      *out = b->blocks;
      return b->n;
    }
  *out = NULL;
  fa_blocks_memo *b = fa_malloc(sizeof *b);
  if (!b) return -1;
  b->n = fa_plan_blocks(p, block_rows, by_key, &b->blocks);
  if (b->n < 0) {
    fa_free(b);
    return -1;
  }
  b->block_rows = block_rows;
  b->by_key = by_key;
  b->query_keys = -1;
  b->fewest_keys = INT64_MAX;
  b->items = NULL;
  b->key_work = b->key_heaviest = -1;
  b->units = NULL;
  b->next = p->memo->blocks;
  p->memo->blocks = b;
  *out = b->blocks;
  return b->n;
}

static int fa_fits32(int64_t v) { return v >= 0 && v <= INT32_MAX; }

/* Block b's item (fa_block_item); 0, or -2 when something does not fit 32 bits. */
static int fa_block_item_of(const fa_plan *p, fa_block b, fa_block_item *it) {
  const int64_t p0 = p->q_pair_off[b.seg], p1 = p->q_pair_off[b.seg + 1];
  int64_t pi = p0, kb = 0, kend = 0;
  int causal = 0;
  for (; pi < p1; pi++) {
    const fa_range k = fa_pair_keys(p->seg, p->pair[pi], b.start, b.len, p->qshift);
    if (k.len > 0) {
      kb = k.start, kend = k.start + k.len, causal = p->pair[pi].causal != 0;
      break;
    }
  }
  if (!fa_fits32(p1) || !fa_fits32(kend) || !fa_fits32(b.seg) || !fa_fits32(b.start + b.len)) return -2;
  *it = (fa_block_item){(int32_t)pi, (int32_t)p1, (int32_t)kb, (int32_t)kend, causal,
                        (int32_t)b.seg, (int32_t)b.start, (int32_t)b.len};
  return 0;
}

int fa_block_items_see_keys(const fa_block_item *items, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (items[i].pi >= items[i].pend) return 0;
  return 1;
}

int fa_plan_has_partial_tiles(const fa_plan *p, int64_t bk) {
  for (int64_t i = 0; i < p->npairs; i++)
    if (p->pair[i].causal || p->seg[p->pair[i].kseg].len % bk) return 1;
  return 0;
}

/* The memo of blocks `blocks` [nblocks] (query blocks, or key blocks with by_key) when the plan keeps
 * them (fa_plan_blocks_memo), else NULL. */
static fa_blocks_memo *fa_blocks_memo_of(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int by_key) {
  for (fa_blocks_memo *m = p->memo ? p->memo->blocks : NULL; m; m = m->next)
    if (m->blocks == blocks && m->n == nblocks && !m->by_key == !by_key) return m;
  return NULL;
}

int64_t fa_plan_block_items_memo(const fa_plan *p, const fa_block *blocks, int64_t nblocks,
                                 const fa_block_item **out, int *see_keys) {
  fa_blocks_memo *memo = fa_blocks_memo_of(p, blocks, nblocks, 0);
  *out = NULL;
  if (!memo) return -1; /* only blocks the plan keeps have items kept with them */
  if (!memo->items) {
    fa_block_item *items = fa_malloc_array(nblocks > 0 ? nblocks : 1, sizeof *items);
    if (!items) return -1;
    for (int64_t b = 0; b < nblocks; b++)
      if (fa_block_item_of(p, blocks[b], &items[b])) {
        fa_free(items);
        return -2;
      }
    memo->items = items;
    memo->items_see_keys = fa_block_items_see_keys(items, nblocks);
  }
  *out = memo->items;
  if (see_keys) *see_keys = memo->items_see_keys;
  return nblocks;
}

/* Keys each query block sees, summed and their least (INT64_MAX without blocks), kept with blocks the
 * plan keeps. */
static void fa_plan_query_key_sums(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t *sum,
                                   int64_t *fewest) {
  fa_blocks_memo *memo = fa_blocks_memo_of(p, blocks, nblocks, 0);
  if (memo && memo->query_keys >= 0) {
    *sum = memo->query_keys, *fewest = memo->fewest_keys;
    return;
  }
  int64_t keys = 0, least = INT64_MAX;
  for (int64_t b = 0; b < nblocks; b++) {
    const int64_t n = fa_block_key_count(p->seg, p->pair, p->q_pair_off[blocks[b].seg],
                                         p->q_pair_off[blocks[b].seg + 1], blocks[b].start, blocks[b].len, p->qshift);
    keys += n;
    least = n < least ? n : least;
  }
  if (memo) memo->query_keys = keys, memo->fewest_keys = least;
  *sum = keys, *fewest = least;
}

int64_t fa_plan_query_keys(const fa_plan *p, const fa_block *blocks, int64_t nblocks) {
  int64_t sum, fewest;
  fa_plan_query_key_sums(p, blocks, nblocks, &sum, &fewest);
  return sum;
}

int64_t fa_plan_fewest_query_keys(const fa_plan *p, const fa_block *blocks, int64_t nblocks) {
  int64_t sum, fewest;
  fa_plan_query_key_sums(p, blocks, nblocks, &sum, &fewest);
  return fewest;
}

int64_t fa_plan_key_chunk(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t teams_per_block,
                          int64_t slots) {
  fa_blocks_memo *memo = fa_blocks_memo_of(p, blocks, nblocks, 1);
  int64_t work = 0, heaviest = 0;
  if (memo && memo->key_work >= 0) {
    work = memo->key_work, heaviest = memo->key_heaviest;
  } else {
    for (int64_t b = 0; b < nblocks; b++) {
      int64_t rows = 0;
      for (int64_t j = p->k_pair_off[blocks[b].seg]; j < p->k_pair_off[blocks[b].seg + 1]; j++)
        rows += fa_pair_queries(p->seg, p->pair[p->k_pair_idx[j]], blocks[b].start, p->qshift).len;
      work += rows;
      heaviest = rows > heaviest ? rows : heaviest;
    }
    if (memo) memo->key_work = work, memo->key_heaviest = heaviest;
  }
  if (slots < 1) slots = 1;
  const int64_t share = (work * teams_per_block + slots - 1) / slots;
  if (heaviest <= share) return INT64_MAX;
  return share < 64 ? 64 : share;
}

int64_t fa_plan_key_units(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t chunk,
                          fa_key_unit **units, int64_t **unit_off) {
  if (chunk < 1) chunk = 1;
  *units = NULL;
  *unit_off = fa_malloc_array(nblocks + 1, sizeof **unit_off);
  if (!*unit_off) return -1;
  int64_t n = 0; /* pass 1: count; pass 2: fill */
  for (int pass = 0; pass < 2; pass++) {
    n = 0;
    for (int64_t b = 0; b < nblocks; b++) {
      const fa_block *blk = &blocks[b];
      const int64_t ja = p->k_pair_off[blk->seg], jb = p->k_pair_off[blk->seg + 1];
      if (pass) (*unit_off)[b] = n;
      const int64_t first = n;
      fa_key_unit u = {b, ja, ja, 0, 0};
      int64_t filled = 0;
      for (int64_t j = ja; j < jb; j++) {
        const int64_t len = fa_pair_queries(p->seg, p->pair[p->k_pair_idx[j]], blk->start, p->qshift).len;
        for (int64_t at = 0; at < len;) {
          if (filled == chunk) { /* full: emit, the next unit starts here */
            if (pass) (*units)[n] = u;
            n++;
            u = (fa_key_unit){b, j, j, at, at};
            filled = 0;
          }
          const int64_t take = len - at < chunk - filled ? len - at : chunk - filled;
          at += take;
          filled += take;
          u.j1 = j;
          u.hi = at;
        }
      }
      if (filled > 0 || n == first) { /* the rest, or the one (empty) unit of a block */
        if (pass) (*units)[n] = u;
        n++;
      }
    }
    if (!pass) {
      *units = fa_malloc_array(n, sizeof **units);
      if (!*units) {
        fa_free(*unit_off);
        *unit_off = NULL;
        return -1;
      }
    }
  }
  (*unit_off)[nblocks] = n;
  return n;
}

int64_t fa_plan_key_units_memo(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t chunk,
                               const fa_key_unit **units, const int64_t **unit_off) {
  *units = NULL;
  *unit_off = NULL;
  fa_blocks_memo *memo = fa_blocks_memo_of(p, blocks, nblocks, 1);
  if (!memo) return -1; /* only blocks the plan keeps have units kept with them */
  if (chunk < 1) chunk = 1; /* as fa_plan_key_units takes it */
  fa_units_memo *u = memo->units;
  while (u && u->chunk != chunk) u = u->next;
  if (!u) {
    if (!(u = fa_malloc(sizeof *u))) return -1;
    u->n = fa_plan_key_units(p, blocks, nblocks, chunk, &u->units, &u->unit_off);
    if (u->n < 0) {
      fa_free(u);
      return -1;
    }
    u->chunk = chunk;
    u->next = memo->units;
    memo->units = u;
  }
  *units = u->units;
  *unit_off = u->unit_off;
  return u->n;
}
