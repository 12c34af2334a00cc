/* Segment plan construction, block splitting and visibility ranges. */
#include "alloc.h"
#include "segment_plan.h"

#include <stdlib.h>
#include <string.h>

void fa_plan_free(fa_plan *p) {
  fa_free(p->seg);
  fa_free(p->pair);
  fa_free(p->q_pair_off);
  fa_free(p->k_pair_off);
  fa_free(p->k_pair_idx);
  memset(p, 0, sizeof *p);
}

int fa_plan_build(fa_plan *p, int64_t rows, int64_t nseg, const fa_range *seg, int64_t npairs,
                  const fa_pair *pair) {
  memset(p, 0, sizeof *p);
  p->rows = rows;
  p->nseg = nseg;
  p->npairs = npairs;
  p->seg = fa_malloc(sizeof *p->seg * (size_t)(nseg ? nseg : 1));
  p->pair = fa_malloc(sizeof *p->pair * (size_t)(npairs ? npairs : 1));
  p->q_pair_off = fa_calloc((size_t)nseg + 1, sizeof *p->q_pair_off);
  p->k_pair_off = fa_calloc((size_t)nseg + 1, sizeof *p->k_pair_off);
  p->k_pair_idx = fa_malloc(sizeof *p->k_pair_idx * (size_t)(npairs ? npairs : 1));
  if (!p->seg || !p->pair || !p->q_pair_off || !p->k_pair_off || !p->k_pair_idx) {
    fa_plan_free(p);
    return -1;
  }
  if (nseg) memcpy(p->seg, seg, sizeof *seg * (size_t)nseg);
  if (npairs) memcpy(p->pair, pair, sizeof *pair * (size_t)npairs);
  for (int64_t i = 0; i < npairs; i++) {
    p->q_pair_off[pair[i].qseg + 1]++;
    p->k_pair_off[pair[i].kseg + 1]++;
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
    int64_t ks = pair[i].kseg;
    p->k_pair_idx[p->k_pair_off[ks] + fill[ks]++] = i;
  }
  fa_free(fill);
  return 0;
}

int fa_plan_prefix(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int causal) {
  int64_t cap = n + 1;
  fa_range *seg = fa_malloc(sizeof *seg * (size_t)cap);
  fa_pair *pair = fa_malloc(sizeof *pair * (size_t)(2 * cap));
  if (!seg || !pair) {
    fa_free(seg);
    fa_free(pair);
    return -1;
  }
  int64_t ns = 0, np = 0, prompt = -1;
  if (prompt_len > 0) {
    prompt = ns;
    seg[ns++] = (fa_range){0, prompt_len};
    pair[np++] = (fa_pair){prompt, prompt, causal};
  }
  for (int64_t i = 0; i < n; i++) {
    int64_t len = off[i + 1] - off[i];
    if (len == 0) continue;
    int64_t s = ns;
    seg[ns++] = (fa_range){prompt_len + off[i], len};
    if (prompt >= 0) pair[np++] = (fa_pair){s, prompt, 0};
    pair[np++] = (fa_pair){s, s, causal};
  }
  int rc = fa_plan_build(p, prompt_len + (n ? off[n] : 0), ns, seg, np, pair);
  fa_free(seg);
  fa_free(pair);
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

int64_t fa_plan_blocks(const fa_plan *p, int64_t block_rows, int by_key, fa_block **out) {
  const int64_t *off = by_key ? p->k_pair_off : p->q_pair_off;
  int64_t n = 0;
  for (int64_t s = 0; s < p->nseg; s++)
    if (off[s + 1] > off[s]) n += (p->seg[s].len + block_rows - 1) / block_rows;
  fa_costed_block *cb = fa_malloc(sizeof *cb * (size_t)(n ? n : 1));
  *out = fa_malloc(sizeof **out * (size_t)(n ? n : 1));
  if (!cb || !*out) {
    fa_free(cb);
    fa_free(*out);
    *out = NULL;
    return -1;
  }
  int64_t i = 0;
  for (int64_t s = 0; s < p->nseg; s++) {
    if (off[s + 1] == off[s]) continue;
    for (int64_t r = 0; r < p->seg[s].len; r += block_rows) {
      fa_block b = {s, p->seg[s].start + r, p->seg[s].len - r < block_rows ? p->seg[s].len - r : block_rows};
      int64_t cost = 0;
      for (int64_t j = off[s]; j < off[s + 1]; j++) {
        /* work of the block with this pair: rows x visible rows on the other side
         * (an upper bound for causal pairs) */
        const fa_pair pr = by_key ? p->pair[p->k_pair_idx[j]] : p->pair[j];
        fa_range other = by_key ? fa_pair_queries(p->seg, pr, b.start) : fa_pair_keys(p->seg, pr, b.start, b.len);
        cost += other.len * b.len;
      }
      cb[i] = (fa_costed_block){b, cost, i};
      i++;
    }
  }
  qsort(cb, (size_t)n, sizeof *cb, fa_cmp_cost);
  for (int64_t j = 0; j < n; j++) (*out)[j] = cb[j].b;
  fa_free(cb);
  return n;
}
