/* Host unit tests of the logic the CPU and GPU kernels share: online-softmax
 * state updates and merges, mask visibility, the segment plan (pairs, inverse
 * key view, block splitting, visible key/query ranges), dtype conversions and
 * the CPU vectorized exp. These are the pieces the GPU kernels compile from
 * the same headers, so a bug here is a bug on every backend. [ran on host] */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_tile.h"
#include "dtype_convert.h"
#include "online_kl.h"
#include "streamkl.h"
#include "online_softmax.h"
#include "segment_plan.h"
#include "test_common.h"

/* ---- online softmax ------------------------------------------------------ */

Test(online_softmax, empty_set_is_zero_and_minus_inf) {
  cr_assert_eq(fa_rescale(-INFINITY, -INFINITY), 0.0f, "no NaN when nothing was seen");
  cr_assert_eq(fa_prob(-INFINITY, -INFINITY), 0.0f);
  cr_assert_eq(fa_prob_lse(1.0f, -INFINITY), 0.0f);
  cr_assert_eq(fa_prob_lse(-INFINITY, 3.0f), 0.0f);
  float inv = 1, lse = 0;
  fa_finish(-INFINITY, 0.0f, &inv, &lse);
  cr_assert_eq(inv, 0.0f);
  cr_assert(isinf(lse) && lse < 0);
}

Test(online_softmax, streaming_equals_one_shot_softmax) {
  tc_rng rng = tc_rng_for("online_softmax.streaming");
  for (int trial = 0; trial < 200; trial++) {
    int n = (int)tc_randint(&rng, 1, 300);
    double spread = tc_uniform(&rng, 0.1, 60.0); /* includes very peaked rows */
    float s[300], v[300];
    for (int j = 0; j < n; j++) {
      s[j] = (float)tc_uniform(&rng, -spread, spread);
      v[j] = (float)tc_uniform(&rng, -1, 1);
      if (tc_randint(&rng, 0, 9) == 0) s[j] = -INFINITY; /* masked keys */
    }
    /* float64 reference */
    double mx = -INFINITY, den = 0, num = 0;
    for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    for (int j = 0; j < n; j++)
      if (s[j] != -INFINITY) {
        den += exp(s[j] - mx);
        num += exp(s[j] - mx) * v[j];
      }
    /* streaming in random chunks, as the kernels do per key block */
    float m = -INFINITY, l = 0, o = 0;
    for (int j0 = 0; j0 < n;) {
      int len = (int)tc_randint(&rng, 1, 64);
      if (j0 + len > n) len = n - j0;
      float cm = -INFINITY;
      for (int j = j0; j < j0 + len; j++) cm = s[j] > cm ? s[j] : cm;
      float m_new = cm > m ? cm : m, alpha = fa_rescale(m, m_new);
      l *= alpha;
      o *= alpha;
      for (int j = j0; j < j0 + len; j++) {
        float p = fa_prob(s[j], m_new);
        l += p;
        o += p * v[j];
      }
      m = m_new;
      j0 += len;
    }
    float inv, lse;
    fa_finish(m, l, &inv, &lse);
    cr_assert(!isnan(o * inv) && !isnan(lse));
    if (den == 0) {
      cr_assert_eq(o * inv, 0.0f);
      cr_assert(isinf(lse) && lse < 0);
    } else {
      /* f32 sums of <= 300 terms in [0, 1]: ~300 * 6e-8 relative at worst */
      cr_assert_float_eq(o * inv, num / den, 2e-5 * (1 + fabs(num / den)), "trial %d", trial);
      cr_assert_float_eq(lse, mx + log(den), 1e-5 * (1 + fabs(mx + log(den))), "trial %d", trial);
    }
  }
}

Test(masks, causal_and_full_visibility) {
  cr_assert(fa_visible(0, 0, 1000));
  cr_assert(fa_visible(1, 5, 5));
  cr_assert(fa_visible(1, 5, 0));
  cr_assert(!fa_visible(1, 5, 6));
}

/* ---- segment plan --------------------------------------------------------- */

/* Brute-force visibility of (query row, key row) under the plan. */
static int plan_sees(const fa_plan *p, int64_t qr, int64_t kr) {
  for (int64_t i = 0; i < p->npairs; i++) {
    const fa_pair *pr = &p->pair[i];
    fa_range qs = p->seg[pr->qseg], ks = p->seg[pr->kseg];
    if (qr >= qs.start && qr < qs.start + qs.len && kr >= ks.start && kr < ks.start + ks.len &&
        fa_visible((int)pr->causal, qr + p->qshift, kr))
      return 1;
  }
  return 0;
}

/* The backward's key blocks (any block size): each read key row in exactly
 * one block, every reader of a block's owner sees all of the block's keys or
 * none (a view never ends inside a block), each pair listed under an owner
 * that holds its keys. */
static void check_key_blocks(const fa_plan *p, int64_t key_rows, int64_t block_rows) {
  for (int64_t s = 0; s < p->nseg; s++)
    for (int64_t j = p->k_pair_off[s]; j < p->k_pair_off[s + 1]; j++) {
      const fa_range k = p->seg[p->pair[p->k_pair_idx[j]].kseg], o = p->seg[s];
      cr_assert(k.start >= o.start && k.start + k.len <= o.start + o.len, "pair %lld outside its owner %lld",
                (long long)p->k_pair_idx[j], (long long)s);
    }
  fa_block *b;
  const int64_t nb = fa_plan_blocks(p, block_rows, 1, &b);
  cr_assert_geq(nb, 0);
  int *cover = calloc((size_t)key_rows + 1, sizeof *cover), *read = calloc((size_t)key_rows + 1, sizeof *read);
  for (int64_t i = 0; i < p->npairs; i++)
    for (int64_t r = p->seg[p->pair[i].kseg].start; r < p->seg[p->pair[i].kseg].start + p->seg[p->pair[i].kseg].len; r++)
      read[r] = 1;
  for (int64_t x = 0; x < nb; x++) {
    cr_assert(b[x].len >= 1 && b[x].len <= block_rows);
    for (int64_t r = b[x].start; r < b[x].start + b[x].len; r++) cover[r]++;
    for (int64_t j = p->k_pair_off[b[x].seg]; j < p->k_pair_off[b[x].seg + 1]; j++) {
      const fa_range k = p->seg[p->pair[p->k_pair_idx[j]].kseg];
      const int64_t in = (b[x].start >= k.start) + (b[x].start + b[x].len <= k.start + k.len);
      const int64_t out = b[x].start + b[x].len <= k.start || b[x].start >= k.start + k.len;
      cr_assert(in == 2 || out, "key block [%lld, +%lld) straddles reader %lld's keys [%lld, +%lld)",
                (long long)b[x].start, (long long)b[x].len, (long long)p->k_pair_idx[j], (long long)k.start,
                (long long)k.len);
    }
  }
  for (int64_t r = 0; r < key_rows; r++)
    cr_assert_eq(cover[r], read[r], "key row %lld in %d key blocks (read: %d)", (long long)r, cover[r], read[r]);
  free(cover);
  free(read);
  free(b);
}

/* What the prefix mask says directly, independent of the plan. */
static int prefix_sees(int64_t P, const int64_t *off, int64_t n, int causal, int64_t qr, int64_t kr) {
  if (qr < P) return kr < P && (!causal || kr <= qr);
  int64_t i = 0;
  while (i < n && !(qr - P >= off[i] && qr - P < off[i + 1])) i++;
  if (kr < P) return 1;
  int64_t a = P + off[i], b = P + off[i + 1];
  return kr >= a && kr < b && (!causal || kr <= qr);
}

Test(segment_plan, prefix_plan_matches_the_mask_exactly) {
  tc_rng rng = tc_rng_for("segment_plan.prefix");
  for (int trial = 0; trial < 60; trial++) {
    int64_t P = tc_randint(&rng, 0, 20), n = tc_randint(&rng, 0, 6), off[8] = {0};
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(&rng, 0, 7);
    int causal = (int)tc_randint(&rng, 0, 1);
    fa_plan p;
    cr_assert_eq(fa_plan_prefix(&p, P, n, off, causal), 0);
    int64_t rows = P + off[n];
    cr_assert_eq(p.rows, rows);
    for (int64_t q = 0; q < rows; q++)
      for (int64_t k = 0; k < rows; k++)
        cr_assert_eq(plan_sees(&p, q, k), prefix_sees(P, off, n, causal, q, k),
                     "trial %d P=%lld n=%lld causal=%d q=%lld k=%lld", trial, (long long)P, (long long)n,
                     causal, (long long)q, (long long)k);
    /* no empty segment; the inverse key view lists each pair exactly once,
     * under a key segment that holds the pair's keys (itself or a view's owner) */
    int64_t *seen = calloc((size_t)p.npairs + 1, sizeof *seen);
    for (int64_t s = 0; s < p.nseg; s++) {
      cr_assert_gt(p.seg[s].len, 0);
      for (int64_t j = p.k_pair_off[s]; j < p.k_pair_off[s + 1]; j++) {
        const fa_range k = p.seg[p.pair[p.k_pair_idx[j]].kseg];
        cr_assert(k.start >= p.seg[s].start && k.start + k.len <= p.seg[s].start + p.seg[s].len);
        seen[p.k_pair_idx[j]]++;
      }
    }
    for (int64_t i = 0; i < p.npairs; i++) cr_assert_eq(seen[i], 1);
    free(seen);
    fa_plan_free(&p);
  }
}

/* What the tree mask says directly: k's node is an ancestor of q's node, or
 * the same node with k <= q (node_of: row -> node; parents < index). */
static int tree_sees(const int64_t *node_of, const int64_t *par, int64_t qr, int64_t kr) {
  const int64_t x = node_of[qr], y = node_of[kr];
  if (x == y) return kr <= qr;
  for (int64_t a = par[x]; a >= 0; a = par[a])
    if (a == y) return 1;
  return 0;
}

Test(segment_plan, tree_plan_matches_the_mask_exactly) {
  tc_rng rng = tc_rng_for("segment_plan.tree");
  for (int trial = 0; trial < 80; trial++) {
    /* random trees with empty nodes, chains of only children, forests */
    const int64_t n = tc_randint(&rng, 1, 14);
    int64_t off[16] = {0}, par[15], node_of[15 * 5 + 1];
    for (int64_t i = 0; i < n; i++) {
      const int64_t kind = tc_randint(&rng, 0, 3);
      par[i] = i == 0 || kind == 0 ? -1 : (kind == 1 ? i - 1 : tc_randint(&rng, 0, i - 1));
      off[i + 1] = off[i] + tc_randint(&rng, 0, 5);
      for (int64_t r = off[i]; r < off[i + 1]; r++) node_of[r] = i;
    }
    fa_plan p;
    cr_assert_eq(fa_plan_tree(&p, n, off, par, 1), 0);
    cr_assert_eq(p.rows, off[n]);
    for (int64_t q = 0; q < off[n]; q++)
      for (int64_t k = 0; k < off[n]; k++)
        cr_assert_eq(plan_sees(&p, q, k), tree_sees(node_of, par, q, k), "trial %d q=%lld k=%lld", trial,
                     (long long)q, (long long)k);
    /* each (query, key) is reached through one pair at most: no key counted twice */
    for (int64_t q = 0; q < off[n]; q++)
      for (int64_t k = 0; k < off[n]; k++) {
        int hits = 0;
        for (int64_t i = 0; i < p.npairs; i++) {
          const fa_pair *pr = &p.pair[i];
          const fa_range qs = p.seg[pr->qseg], ks = p.seg[pr->kseg];
          hits += q >= qs.start && q < qs.start + qs.len && k >= ks.start && k < ks.start + ks.len &&
                  fa_visible((int)pr->causal, q, k);
        }
        cr_assert_leq(hits, 1, "key %lld reached %d times from query %lld", (long long)k, hits, (long long)q);
      }
    check_key_blocks(&p, off[n], tc_randint(&rng, 1, 9));
    fa_plan_free(&p);
  }
}

Test(segment_plan, chain_of_only_children_is_one_key_segment) {
  int64_t off[1001], par[1000];
  off[0] = 0;
  for (int64_t i = 0; i < 1000; i++) {
    par[i] = i - 1;
    off[i + 1] = off[i] + 1 + i % 3;
  }
  fa_plan p;
  cr_assert_eq(fa_plan_tree(&p, 1000, off, par, 1), 0);
  cr_expect_eq(p.npairs, 1000, "one pair per node, not one per ancestor");
  cr_expect_eq(p.nseg, 1001, "1000 query segments + one key segment");
  fa_plan_free(&p);
}

/* What the block-causal cached mask says directly: query row qr (response
 * rows) sees every prefix key and its response's keys up to the end of its
 * block (keys in the key frame: prefix [0, P), response i at P + off[i]). */
static int blocks_sees(int64_t P, const int64_t *off, int64_t n, int64_t block, int64_t qr, int64_t kr) {
  if (kr < P) return 1;
  int64_t i = 0;
  while (i < n && !(qr >= off[i] && qr < off[i + 1])) i++;
  const int64_t kq = kr - P;
  if (kq < off[i] || kq >= off[i + 1]) return 0;
  /* compare block indices by subtraction: block may be INT64_MAX */
  return (kq - off[i]) / block <= (qr - off[i]) / block;
}

Test(segment_plan, prefix_cached_blocks_plan_matches_the_mask_for_any_block_size) {
  tc_rng rng = tc_rng_for("segment_plan.cached_blocks");
  const int64_t huge[4] = {INT64_MAX, INT64_MAX - 1, (int64_t)1 << 62, ((int64_t)1 << 62) - 1};
  for (int trial = 0; trial < 80; trial++) {
    int64_t P = tc_randint(&rng, 0, 6), n = tc_randint(&rng, 1, 4), off[6] = {0}, longest = 0;
    for (int64_t i = 0; i < n; i++) {
      off[i + 1] = off[i] + tc_randint(&rng, 0, 12);
      longest = off[i + 1] - off[i] > longest ? off[i + 1] - off[i] : longest;
    }
    const int64_t pick = tc_randint(&rng, 0, 7);
    const int64_t block = pick < 4 ? huge[pick] : pick == 4 ? 1 : pick == 5 ? longest + tc_randint(&rng, -1, 1)
                                                                         : tc_randint(&rng, 1, 13);
    if (block < 1) continue;
    fa_plan p;
    cr_assert_eq(fa_plan_prefix_cached_blocks(&p, P, n, off, block), 0, "block %lld", (long long)block);
    cr_assert_eq(p.rows, off[n]);
    cr_assert_eq(p.qshift, P);
    for (int64_t q = 0; q < off[n]; q++)
      for (int64_t k = 0; k < P + off[n]; k++)
        cr_assert_eq(plan_sees(&p, q, k), blocks_sees(P, off, n, block, q, k),
                     "trial %d P=%lld block=%lld q=%lld k=%lld", trial, (long long)P, (long long)block, (long long)q,
                     (long long)k);
    check_key_blocks(&p, P + off[n], tc_randint(&rng, 1, 9));
    for (int64_t s = 0; s < p.nseg; s++) /* disjoint owners: one owner per key row in the backward */
      for (int64_t t = s + 1; t < p.nseg; t++)
        if (p.k_pair_off[s + 1] > p.k_pair_off[s] && p.k_pair_off[t + 1] > p.k_pair_off[t])
          cr_assert(p.seg[s].start + p.seg[s].len <= p.seg[t].start || p.seg[t].start + p.seg[t].len <= p.seg[s].start,
                    "key segments %lld and %lld overlap", (long long)s, (long long)t);
    fa_plan_free(&p);
  }
}

/* Blocks of one row are the causal mask: the plan is the causal one, two
 * pairs per response, not one per (row, earlier row); a block covering every
 * response is the bidirectional plan; other blocks take two pairs each. */
Test(segment_plan, prefix_cached_blocks_of_one_or_whole_responses_stay_linear) {
  const int64_t off[4] = {0, 3000, 3000, 5000};
  fa_plan b, c;
  cr_assert_eq(fa_plan_prefix_cached_blocks(&b, 16, 3, off, 1), 0);
  cr_assert_eq(fa_plan_prefix_cached(&c, 16, 3, off, 1), 0);
  cr_expect_eq(b.npairs, 4, "prefix + own keys per non-empty response, got %lld pairs", (long long)b.npairs);
  cr_expect_leq(b.nseg, 2 * 3 + 1);
  cr_assert_eq(b.npairs, c.npairs);
  cr_assert_eq(b.nseg, c.nseg);
  cr_assert(!memcmp(b.pair, c.pair, sizeof *b.pair * (size_t)b.npairs), "not the causal plan");
  cr_assert(!memcmp(b.seg, c.seg, sizeof *b.seg * (size_t)b.nseg));
  fa_plan_free(&b);
  fa_plan_free(&c);
  const int64_t big[3] = {3000, INT64_MAX - 1, INT64_MAX};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(fa_plan_prefix_cached_blocks(&b, 16, 3, off, big[i]), 0, "block %lld", (long long)big[i]);
    cr_assert_eq(fa_plan_prefix_cached(&c, 16, 3, off, 0), 0);
    cr_assert_eq(b.npairs, c.npairs);
    cr_assert(!memcmp(b.pair, c.pair, sizeof *b.pair * (size_t)b.npairs), "not the bidirectional plan");
    fa_plan_free(&b);
    fa_plan_free(&c);
  }
  /* small blocks: two pairs per block (the prefix, a view of the response's
   * keys up to the block's end), not one per (block, earlier block) */
  const int64_t small[3] = {2, 3, 1000};
  for (int i = 0; i < 3; i++) {
    const int64_t blocks = (3000 + small[i] - 1) / small[i] + (2000 + small[i] - 1) / small[i];
    cr_assert_eq(fa_plan_prefix_cached_blocks(&b, 16, 3, off, small[i]), 0);
    cr_expect_eq(b.npairs, 2 * blocks, "block %lld: %lld pairs for %lld blocks", (long long)small[i],
                 (long long)b.npairs, (long long)blocks);
    cr_expect_leq(b.nseg, 1 + 3 + 2 * blocks);
    fa_plan_free(&b);
  }
}

/* Pairs of the tree plan of a trie: one per chain on each node's root path. */
static int64_t trie_plan_pairs(forkattn_trie *t) {
  const forkattn_tree_layout l = tc_trie_layout(t);
  fa_plan p;
  cr_assert_eq(fa_plan_tree(&p, l.num_nodes, l.node_offsets, l.parents, 1), 0);
  const int64_t n = p.npairs;
  fa_plan_free(&p);
  return n;
}

/* Rollouts that each diverge one token later than the previous one (sequence
 * i: tokens 1..i, then a token of its own) form a spine with a leaf at every
 * node. Packed largest child first, the spine is one chain: the plan grows
 * linearly (about 3 pairs per spine node), not with the depth of every node. */
Test(segment_plan, staircase_rollouts_plan_linearly) {
  forkattn_ctx *ctx = tc_ctx_default("segment_plan.staircase");
  int64_t pairs[2], nodes[2];
  for (int c = 0; c < 2; c++) {
    const int64_t n = c ? 1000 : 500;
    int64_t *off = malloc(sizeof *off * (size_t)(n + 1)), *tok = malloc(sizeof *tok * (size_t)(n * (n + 3) / 2));
    off[0] = 0;
    for (int64_t i = 1, t = 0; i <= n; i++) {
      for (int64_t j = 1; j <= i; j++) tok[t++] = j;
      tok[t++] = -i;
      off[i] = t;
    }
    forkattn_trie *t;
    cr_assert_eq(forkattn_trie_from_sequences(ctx, n, off, tok, FORKATTN_TRIE_SINGLE_ROOT, &t), FORKATTN_OK);
    nodes[c] = tc_trie_layout(t).num_nodes;
    pairs[c] = trie_plan_pairs(t);
    cr_expect_leq(pairs[c], 3 * nodes[c], "%lld sequences: %lld pairs for %lld nodes", (long long)n,
                  (long long)pairs[c], (long long)nodes[c]);
    forkattn_trie_free(t);
    free(off);
    free(tok);
  }
  cr_expect_leq(pairs[1], 2 * pairs[0] + 8, "twice the sequences: %lld -> %lld pairs (quadratic?)", (long long)pairs[0],
                (long long)pairs[1]);
  forkattn_ctx_destroy(ctx);
}

/* Any tree shape, packed by the tries (largest child first): at most
 * 1 + log2(n) chains on a root path, so at most n (1 + log2 n) pairs. Random
 * recursive trees, a caterpillar (a leaf on every spine node, given leaf
 * first), a broom, a complete binary tree. */
Test(segment_plan, trie_packed_trees_plan_in_n_log_n) {
  forkattn_ctx *ctx = tc_ctx_default("segment_plan.n_log_n");
  tc_rng rng = tc_rng_for("segment_plan.n_log_n");
  const int64_t n = 2000;
  int64_t *par = malloc(sizeof *par * (size_t)n), *len = malloc(sizeof *len * (size_t)n);
  for (int shape = 0; shape < 6; shape++) {
    for (int64_t i = 0; i < n; i++) {
      len[i] = tc_randint(&rng, 1, 3);
      if (i == 0)
        par[i] = -1;
      else if (shape < 3) /* random recursive, then biased to the latest nodes (deep) */
        par[i] = shape == 0 ? tc_randint(&rng, 0, i - 1) : i - 1 - tc_randint(&rng, 0, i < 4 ? 0 : shape == 1 ? 3 : 1);
      else if (shape == 3) /* caterpillar: spine nodes at even indices, leaves listed before the spine's next node */
        par[i] = i % 2 ? i - 1 : i - 2;
      else if (shape == 4) /* broom: a handle of n/2, then leaves on its end */
        par[i] = i < n / 2 ? i - 1 : n / 2 - 1;
      else
        par[i] = (i - 1) / 2;
    }
    forkattn_trie *t;
    cr_assert_eq(forkattn_trie_from_parents(ctx, n, par, len, 0, &t), FORKATTN_OK);
    const int64_t pairs = trie_plan_pairs(t);
    cr_expect_leq(pairs, n * (1 + 10), "shape %d: %lld pairs for %lld nodes", shape, (long long)pairs, (long long)n);
    forkattn_trie_free(t);
  }
  free(par);
  free(len);
  forkattn_ctx_destroy(ctx);
}

/* A causal plan of a random forest of 1..max_nodes (at most 12) nodes of 0..max_len rows. */
static void kl_random_forest_plan(tc_rng *rng, int64_t max_nodes, int64_t max_len, fa_plan *p) {
  const int64_t n = tc_randint(rng, 1, max_nodes);
  int64_t off[13] = {0}, par[12];
  for (int64_t i = 0; i < n; i++) {
    par[i] = i == 0 || tc_randint(rng, 0, 3) == 0 ? -1 : tc_randint(rng, 0, i - 1);
    off[i + 1] = off[i] + tc_randint(rng, 0, max_len);
  }
  cr_assert_eq(fa_plan_tree(p, n, off, par, 1), 0);
}

/* Key units (GPU dK/dV split): every reader's visible query rows of every key
 * block are covered exactly once, in reader order, in units of <= chunk rows. */
Test(segment_plan, key_units_cover_every_reader_row_once) {
  tc_rng rng = tc_rng_for("segment_plan.key_units");
  for (int trial = 0; trial < 60; trial++) {
    fa_plan p;
    kl_random_forest_plan(&rng, 10, 40, &p);
    fa_block *blk;
    const int64_t nb = fa_plan_blocks(&p, tc_randint(&rng, 1, 20), 1, &blk);
    cr_assert_geq(nb, 0);
    const int64_t chunk = tc_randint(&rng, 1, 50);
    fa_key_unit *u;
    int64_t *uo;
    const int64_t nu = fa_plan_key_units(&p, blk, nb, chunk, &u, &uo);
    cr_assert_geq(nu, nb);
    cr_assert_eq(uo[0], 0);
    cr_assert_eq(uo[nb], nu);
    for (int64_t b = 0; b < nb; b++) {
      cr_assert_gt(uo[b + 1], uo[b], "block %lld has no unit", (long long)b);
      const int64_t ja = p.k_pair_off[blk[b].seg], jb = p.k_pair_off[blk[b].seg + 1];
      int64_t total = 0, next_j = ja, next_row = 0; /* where the next unit must start */
      for (int64_t j = ja; j < jb; j++)
        total += fa_pair_queries(p.seg, p.pair[p.k_pair_idx[j]], blk[b].start, p.qshift).len;
      int64_t covered = 0;
      for (int64_t x = uo[b]; x < uo[b + 1]; x++) {
        const fa_key_unit *k = &u[x];
        cr_assert_eq(k->block, b);
        cr_assert(k->j0 >= ja && k->j1 < jb && k->j0 <= k->j1);
        int64_t rows = 0;
        for (int64_t j = k->j0; j <= k->j1; j++) {
          const int64_t len = fa_pair_queries(p.seg, p.pair[p.k_pair_idx[j]], blk[b].start, p.qshift).len;
          const int64_t lo = j == k->j0 ? k->lo : 0, hi = j == k->j1 ? k->hi : len;
          cr_assert(lo >= 0 && lo <= hi && hi <= len);
          rows += hi - lo;
        }
        cr_assert_leq(rows, chunk);
        /* contiguous with the previous unit (empty readers in between are skipped) */
        if (k->j0 == next_j) cr_assert_eq(k->lo, next_row);
        else {
          cr_assert_gt(k->j0, next_j);
          cr_assert_eq(k->lo, 0);
          for (int64_t j = next_j; j < k->j0; j++)
            cr_assert_eq(fa_pair_queries(p.seg, p.pair[p.k_pair_idx[j]], blk[b].start, p.qshift).len - (j == next_j ? next_row : 0), 0);
        }
        next_j = k->j1;
        next_row = k->hi;
        covered += rows;
      }
      cr_assert_eq(covered, total, "block %lld: %lld of %lld reader rows", (long long)b, (long long)covered, (long long)total);
      const int64_t want = total == 0 ? 1 : (total + chunk - 1) / chunk;
      cr_assert_eq(uo[b + 1] - uo[b], want, "block %lld: %lld units for %lld rows, chunk %lld", (long long)b,
                   (long long)(uo[b + 1] - uo[b]), (long long)total, (long long)chunk);
    }
    free(u);
    free(uo);
    free(blk);
    fa_plan_free(&p);
  }
}

/* The key-unit chunk for the GPU dK/dV teams: no split when every (key block,
 * team) is within a slot's share; otherwise the share, so no unit carries
 * more than its share. Both shapes of bench/RESULTS.md's cases 1 and 2 by their plans. */
static int64_t kl_block_rows(const fa_plan *p, const fa_block *b) {
  int64_t rows = 0;
  for (int64_t j = p->k_pair_off[b->seg]; j < p->k_pair_off[b->seg + 1]; j++)
    rows += fa_pair_queries(p->seg, p->pair[p->k_pair_idx[j]], b->start, p->qshift).len;
  return rows;
}

/* compare_torch's case 2: a causal 4096-row prompt shared by 16 responses of 1024 rows */
static void plan_case2(fa_plan *p) {
  int64_t off[17];
  for (int i = 0; i <= 16; i++) off[i] = 1024 * i;
  cr_assert_eq(fa_plan_prefix(p, 4096, 16, off, 1), 0);
}

Test(segment_plan, query_keys_sum_what_each_query_block_sees) {
  /* 64 causal sequences of 512 rows (varlen), 128-row query blocks: 128 + 256 + 384 + 512 keys each */
  fa_plan p;
  int64_t off[65];
  for (int i = 0; i <= 64; i++) off[i] = 512 * i;
  cr_assert_eq(fa_plan_prefix(&p, 0, 64, off, 1), 0);
  fa_block *blk;
  int64_t nb = fa_plan_blocks(&p, 128, 0, &blk);
  cr_assert_eq(nb, 256);
  cr_assert_eq(fa_plan_query_keys(&p, blk, nb), 64 * (128 + 256 + 384 + 512));
  free(blk);
  fa_plan_free(&p);
  /* a GRPO group: a 4096-row prompt (causal), 16 responses of 1024 that see it all */
  plan_case2(&p);
  nb = fa_plan_blocks(&p, 128, 0, &blk);
  cr_assert_eq(nb, 32 + 16 * 8);
  int64_t prompt = 0, response = 0;
  for (int b = 1; b <= 32; b++) prompt += 128 * b;
  for (int b = 1; b <= 8; b++) response += 4096 + 128 * b;
  cr_assert_eq(fa_plan_query_keys(&p, blk, nb), prompt + 16 * response);
  /* the plan's own blocks keep the sum: the same on the first and a later call */
  const fa_block *memo;
  cr_assert_eq(fa_plan_blocks_memo(&p, 128, 0, &memo), nb);
  cr_assert_eq(fa_plan_query_keys(&p, memo, nb), prompt + 16 * response);
  cr_assert_eq(fa_plan_query_keys(&p, memo, nb), prompt + 16 * response);
  cr_assert_eq(fa_plan_query_keys(&p, memo, nb / 2), fa_plan_query_keys(&p, blk, nb / 2), "a prefix of them: not the memo");
  free(blk);
  fa_plan_free(&p);
}

Test(segment_plan, fewest_query_keys_is_the_least_block_and_kept_with_the_blocks) {
  /* 64 causal sequences of 512 rows, 128-row blocks: the first block of each sees 128 keys */
  fa_plan p;
  int64_t off[65];
  for (int i = 0; i <= 64; i++) off[i] = 512 * i;
  cr_assert_eq(fa_plan_prefix(&p, 0, 64, off, 1), 0);
  const fa_block *memo;
  int64_t nb = fa_plan_blocks_memo(&p, 128, 0, &memo);
  cr_assert_eq(fa_plan_fewest_query_keys(&p, memo, nb), 128);
  cr_assert_eq(fa_plan_fewest_query_keys(&p, memo, 0), INT64_MAX, "no blocks");
  fa_plan_free(&p);
  /* random forests: against the least per-block count summed here pair by pair, fresh and kept, before and after
   * fa_plan_query_keys filled the memo */
  tc_rng rng = tc_rng_for("segment_plan/fewest_query_keys");
  for (int it = 0; it < 200; it++) {
    kl_random_forest_plan(&rng, 10, 40, &p);
    const int64_t rows = tc_randint(&rng, 1, 20);
    fa_block *blk;
    nb = fa_plan_blocks(&p, rows, 0, &blk);
    cr_assert_geq(nb, 0);
    int64_t least = INT64_MAX, sum = 0;
    for (int64_t b = 0; b < nb; b++) {
      int64_t n = 0;
      for (int64_t j = p.q_pair_off[blk[b].seg]; j < p.q_pair_off[blk[b].seg + 1]; j++)
        n += fa_pair_keys(p.seg, p.pair[j], blk[b].start, blk[b].len, p.qshift).len;
      least = n < least ? n : least;
      sum += n;
    }
    cr_assert_eq(fa_plan_fewest_query_keys(&p, blk, nb), least, "fresh, iteration %d", it);
    cr_assert_eq(fa_plan_blocks_memo(&p, rows, 0, &memo), nb);
    if (it % 2) cr_assert_eq(fa_plan_query_keys(&p, memo, nb), sum);
    cr_assert_eq(fa_plan_fewest_query_keys(&p, memo, nb), least, "kept, iteration %d", it);
    cr_assert_eq(fa_plan_fewest_query_keys(&p, memo, nb), least, "kept, asked again");
    cr_assert_eq(fa_plan_query_keys(&p, memo, nb), sum, "the sum kept beside it");
    free(blk);
    fa_plan_free(&p);
  }
}

Test(segment_plan, block_items_hold_each_blocks_first_keys) {
  /* a GRPO group: a 4096-row prompt (causal), 16 responses of 1024 that see it all */
  fa_plan p;
  plan_case2(&p);
  const fa_block *blk;
  const int64_t nb = fa_plan_blocks_memo(&p, 128, 0, &blk);
  const fa_block_item *it, *again;
  int see_keys = 0;
  cr_assert_eq(fa_plan_block_items_memo(&p, blk, nb, &it, &see_keys), nb);
  for (int64_t b = 0; b < nb; b++) {
    cr_assert(it[b].seg == blk[b].seg && it[b].start == blk[b].start && it[b].len == blk[b].len);
    cr_assert_eq(it[b].pend, p.q_pair_off[blk[b].seg + 1]);
    /* the first pair that gives the block keys, and those keys (a prompt block: its own causal pair) */
    const fa_range k = fa_pair_keys(p.seg, p.pair[it[b].pi], blk[b].start, blk[b].len, p.qshift);
    cr_assert(k.len > 0 && it[b].kb == k.start && it[b].kend == k.start + k.len, "block %lld", (long long)b);
    cr_assert_eq(it[b].causal, p.pair[it[b].pi].causal != 0);
    for (int64_t j = p.q_pair_off[blk[b].seg]; j < it[b].pi; j++)
      cr_assert_eq(fa_pair_keys(p.seg, p.pair[j], blk[b].start, blk[b].len, p.qshift).len, 0, "an earlier pair sees none");
  }
  int seen_first = 0, seen_response = 0; /* blocks come heaviest first */
  for (int64_t b = 0; b < nb; b++) {
    if (blk[b].start == 0) {
      seen_first = 1;
      cr_assert(it[b].kb == 0 && it[b].kend == 128, "the prompt's first block sees its own 128 keys");
    }
    if (blk[b].start >= 4096) {
      seen_response = 1;
      cr_assert(it[b].kb == 0 && it[b].kend >= 4096, "a response block's first keys: the prompt, from row 0");
    }
  }
  cr_assert(seen_first && seen_response);
  cr_assert(see_keys && fa_block_items_see_keys(it, nb), "every block of a prefix layout sees keys");
  fa_block_item none = it[0];
  none.pi = none.pend;
  cr_assert(!fa_block_items_see_keys(&none, 1));
  cr_assert(fa_block_items_see_keys(&none, 0), "no items: nothing unseen");
  see_keys = 0;
  cr_assert_eq(fa_plan_block_items_memo(&p, blk, nb, &again, &see_keys), nb);
  cr_assert(see_keys, "kept with the items");
  cr_assert_eq(again, it, "kept with the blocks");
  fa_block *own;
  cr_assert_eq(fa_plan_blocks(&p, 128, 0, &own), nb);
  cr_assert_eq(fa_plan_block_items_memo(&p, own, nb, &again, NULL), -1, "blocks the plan does not keep");
  free(own);
  fa_plan_free(&p);
}

/* The two-warpgroup forward scans V's tiles that hide keys or hold fewer than a tile of keys; a
 * plan without such tiles needs no check of V first. */
Test(segment_plan, partial_tiles_are_causal_pairs_or_key_segments_not_whole_tiles) {
  fa_plan p;
  int64_t off[5] = {0, 128, 256, 384, 512};
  cr_assert_eq(fa_plan_prefix(&p, 0, 4, off, 0), 0); /* bidirectional sequences of 128 rows */
  cr_assert_eq(fa_plan_has_partial_tiles(&p, 128), 0, "whole tiles of 128");
  cr_assert_eq(fa_plan_has_partial_tiles(&p, 64), 0, "whole tiles of 64");
  cr_assert_eq(fa_plan_has_partial_tiles(&p, 96), 1, "128 keys in tiles of 96");
  fa_plan_free(&p);
  cr_assert_eq(fa_plan_prefix(&p, 0, 4, off, 1), 0);
  cr_assert_eq(fa_plan_has_partial_tiles(&p, 128), 1, "causal: the diagonal tiles hide keys");
  fa_plan_free(&p);
  off[3] = 383; /* one sequence of 127 rows, the next of 129 */
  cr_assert_eq(fa_plan_prefix(&p, 0, 4, off, 0), 0);
  cr_assert_eq(fa_plan_has_partial_tiles(&p, 128), 1, "a sequence of 127 keys");
  fa_plan_free(&p);
  off[3] = 384;
  cr_assert_eq(fa_plan_prefix(&p, 256, 4, off, 0), 0); /* a bidirectional group: 256-row prompt */
  cr_assert_eq(fa_plan_has_partial_tiles(&p, 128), 0);
  fa_plan_free(&p);
}

/* The key units and the key chunk kept with a plan's key blocks equal a fresh cut, the same arrays
 * come back for the same chunk and other arrays for another, all valid until fa_plan_free; blocks
 * the plan does not keep get none. */
Test(segment_plan, key_units_memo_is_the_cut_kept_with_the_plan) {
  tc_rng rng = tc_rng_for("segment_plan.key_units_memo");
  for (int trial = 0; trial < 40; trial++) {
    fa_plan p;
    kl_random_forest_plan(&rng, 12, 300, &p);
    const int64_t rows = tc_randint(&rng, 1, 130);
    const fa_block *kb;
    const int64_t nkb = fa_plan_blocks_memo(&p, rows, 1, &kb);
    cr_assert_geq(nkb, 0);
    fa_block *own;
    cr_assert_eq(fa_plan_blocks(&p, rows, 1, &own), nkb);
    const int64_t slots = tc_randint(&rng, 1, 2000), teams = tc_randint(&rng, 1, 16);
    const int64_t chunk = fa_plan_key_chunk(&p, own, nkb, teams, slots); /* not kept: computed */
    cr_assert_eq(fa_plan_key_chunk(&p, kb, nkb, teams, slots), chunk, "first, computed and kept");
    cr_assert_eq(fa_plan_key_chunk(&p, kb, nkb, teams, slots), chunk, "then from the memo");
    const int64_t chunks[3] = {chunk, tc_randint(&rng, 1, 90), chunk};
    const fa_key_unit *mu[3];
    const int64_t *mo[3];
    for (int c = 0; c < 3; c++) {
      const int64_t nu = fa_plan_key_units_memo(&p, kb, nkb, chunks[c], &mu[c], &mo[c]);
      fa_key_unit *u;
      int64_t *uo;
      cr_assert_eq(fa_plan_key_units(&p, kb, nkb, chunks[c], &u, &uo), nu);
      cr_assert(nu >= nkb && mu[c] && mo[c]);
      cr_assert_eq(memcmp(mu[c], u, sizeof *u * (size_t)nu), 0, "trial %d chunk %lld", trial, (long long)chunks[c]);
      cr_assert_eq(memcmp(mo[c], uo, sizeof *uo * (size_t)(nkb + 1)), 0);
      free(u);
      free(uo);
    }
    cr_assert(mu[2] == mu[0] && mo[2] == mo[0], "the same chunk: the kept arrays");
    if (chunks[1] != chunks[0]) cr_assert(mu[1] != mu[0], "another chunk: its own arrays");
    const fa_key_unit *none;
    const int64_t *none_off;
    cr_assert_eq(fa_plan_key_units_memo(&p, own, nkb, chunk, &none, &none_off), -1, "blocks the plan does not keep");
    cr_assert(!none && !none_off);
    free(own);
    fa_plan_free(&p);
  }
}

Test(segment_plan, key_chunk_splits_only_blocks_above_a_slots_share) {
  /* case 1: one causal sequence of 4096, 64-row key blocks, 16 KV heads */
  fa_plan p;
  int64_t off1[2] = {0, 0};
  cr_assert_eq(fa_plan_prefix(&p, 4096, 1, off1, 1), 0);
  fa_block *blk;
  int64_t nb = fa_plan_blocks(&p, 64, 1, &blk);
  cr_assert_eq(nb, 64);
  int64_t work = 0;
  for (int64_t b = 0; b < nb; b++) work += kl_block_rows(&p, &blk[b]);
  cr_assert_eq(work, 64 * 4096 - 64 * 63 / 2 * 64, "causal readers: 4096 + 4032 + ... + 64");
  /* tensor cores: 264 slots, two passes -> share 15 9xx rows, the heaviest block has 4096 */
  cr_assert_eq(fa_plan_key_chunk(&p, blk, nb, 16 * 2, 264), INT64_MAX);
  /* FP32: 1056 slots, one pass -> share ceil(133 120 * 16 / 1056) = 2017 < 4096: split */
  const int64_t c = fa_plan_key_chunk(&p, blk, nb, 16, 1056);
  cr_assert_eq(c, (work * 16 + 1055) / 1056);
  fa_key_unit *u;
  int64_t *uo;
  const int64_t nu = fa_plan_key_units(&p, blk, nb, c, &u, &uo);
  cr_assert_gt(nu, nb, "the heaviest blocks are cut");
  for (int64_t b = 0; b < nb; b++)
    cr_assert_eq(uo[b + 1] - uo[b], (kl_block_rows(&p, &blk[b]) + c - 1) / c);
  free(u);
  free(uo);
  /* a slot count too small to matter, and one per block: never below 64 rows */
  cr_assert_eq(fa_plan_key_chunk(&p, blk, nb, 1, 1), INT64_MAX);
  cr_assert_eq(fa_plan_key_chunk(&p, blk, nb, 1, 1 << 20), 64);
  free(blk);
  fa_plan_free(&p);

  /* case 2's shape: prompt 4096 read by 16 responses of 1024 -> prompt blocks
   * have 4096 - 64 i + 16 * 1024 readers; 8 KV heads, two passes, 264 slots */
  plan_case2(&p);
  nb = fa_plan_blocks(&p, 64, 1, &blk);
  cr_assert_eq(nb, 64 + 16 * 16);
  cr_assert_eq(kl_block_rows(&p, &blk[0]), 4096 + 16 * 1024, "heaviest first: the prompt's first block");
  cr_assert_eq(fa_plan_key_chunk(&p, blk, nb, 8 * 2, 264), INT64_MAX);
  /* with 16x the slots the prompt's blocks are over their share */
  const int64_t c2 = fa_plan_key_chunk(&p, blk, nb, 8 * 2, 264 * 16);
  cr_assert_lt(c2, 4096 + 16 * 1024);
  cr_assert_geq(c2, 64);
  free(blk);
  fa_plan_free(&p);
}

Test(segment_plan, blocks_cover_every_row_once_heaviest_first) {
  tc_rng rng = tc_rng_for("segment_plan.blocks");
  for (int trial = 0; trial < 40; trial++) {
    int64_t P = tc_randint(&rng, 0, 300), n = tc_randint(&rng, 0, 9), off[10] = {0};
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(&rng, 0, 90);
    fa_plan p;
    cr_assert_eq(fa_plan_prefix(&p, P, n, off, (int)tc_randint(&rng, 0, 1)), 0);
    for (int by_key = 0; by_key < 2; by_key++) {
      int64_t br = tc_randint(&rng, 1, 64);
      fa_block *b;
      int64_t nb = fa_plan_blocks(&p, br, by_key, &b);
      cr_assert_geq(nb, 0);
      int *cover = calloc((size_t)p.rows + 1, sizeof *cover);
      for (int64_t i = 0; i < nb; i++) {
        cr_assert(b[i].len > 0 && b[i].len <= br);
        const fa_range s = p.seg[b[i].seg];
        cr_assert(b[i].start >= s.start && b[i].start + b[i].len <= s.start + s.len);
        for (int64_t r = b[i].start; r < b[i].start + b[i].len; r++) cover[r]++;
      }
      for (int64_t r = 0; r < p.rows; r++) cr_assert_eq(cover[r], 1, "row %lld by_key %d", (long long)r, by_key);
      free(cover);
      free(b);
    }
    fa_plan_free(&p);
  }
}

Test(segment_plan, key_and_query_ranges_contain_every_visible_pair) {
  tc_rng rng = tc_rng_for("segment_plan.ranges");
  for (int trial = 0; trial < 40; trial++) {
    int64_t P = tc_randint(&rng, 1, 40), n = tc_randint(&rng, 1, 4), off[6] = {0};
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(&rng, 1, 30);
    fa_plan p;
    cr_assert_eq(fa_plan_prefix(&p, P, n, off, (int)tc_randint(&rng, 0, 1)), 0);
    for (int64_t i = 0; i < p.npairs; i++) {
      const fa_pair *pr = &p.pair[i];
      const fa_range qs = p.seg[pr->qseg], ks = p.seg[pr->kseg];
      int64_t q0 = qs.start + tc_randint(&rng, 0, qs.len - 1);
      int64_t qn = tc_randint(&rng, 1, qs.start + qs.len - q0);
      const fa_range keys = fa_pair_keys(p.seg, *pr, q0, qn, p.qshift);
      const int64_t k0 = keys.start, kn = keys.len;
      for (int64_t q = q0; q < q0 + qn; q++)
        for (int64_t k = ks.start; k < ks.start + ks.len; k++)
          if (fa_visible((int)pr->causal, q + p.qshift, k))
            cr_assert(k >= k0 && k < k0 + kn, "visible key outside the key range");
      /* and the range is tight: its last key is visible to the block's last query */
      if (kn > 0) cr_assert(fa_visible((int)pr->causal, q0 + qn - 1 + p.qshift, k0 + kn - 1));
      int64_t kb = ks.start + tc_randint(&rng, 0, ks.len - 1), kbn = tc_randint(&rng, 1, ks.start + ks.len - kb);
      const fa_range queries = fa_pair_queries(p.seg, *pr, kb, p.qshift);
      const int64_t a0 = queries.start, an = queries.len;
      for (int64_t q = qs.start; q < qs.start + qs.len; q++)
        for (int64_t k = kb; k < kb + kbn; k++)
          if (fa_visible((int)pr->causal, q + p.qshift, k))
            cr_assert(q >= a0 && q < a0 + an, "query that sees the key block outside the query range");
    }
    fa_plan_free(&p);
  }
}

/* ---- dtype conversions ----------------------------------------------------- */

Test(dtype, f16_roundtrip_is_exact_for_every_value) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = fa_f16_to_f32((uint16_t)h);
    uint16_t back = fa_f32_to_f16(f);
    if (isnan(f))
      cr_assert(((back >> 10) & 0x1f) == 0x1f && (back & 0x3ff), "NaN stays NaN (0x%04x)", h);
    else
      cr_assert_eq(back, h, "0x%04x -> %a -> 0x%04x", h, (double)f, back);
  }
}

Test(dtype, narrowing_rounds_to_nearest_even) {
  /* bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0) */
  cr_assert_eq(fa_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  cr_assert_eq(fa_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  cr_assert_eq(fa_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82); /* tie, odd below: up */
  cr_assert(isnan(fa_bf16_to_f32(fa_f32_to_bf16(NAN))));
  /* f16: 1 + 2^-11 ties to 1; 65520 overflows to inf; 2^-25 rounds to 0, 3*2^-26 to 2^-24 */
  cr_assert_eq(fa_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  cr_assert_eq(fa_f32_to_f16(65520.0f), 0x7c00);
  cr_assert_eq(fa_f32_to_f16(65504.0f), 0x7bff);
  cr_assert_eq(fa_f32_to_f16(0x1p-25f), 0x0000);
  cr_assert_eq(fa_f32_to_f16(3 * 0x1p-26f), 0x0001);
  cr_assert_eq(fa_f32_to_f16(-2.0f), 0xc000);
}

/* ---- CPU vectorized exp ---------------------------------------------------- */

Test(cpu_exp, accurate_over_the_softmax_range_and_zero_when_masked) {
  enum { N = 20001 };
  static float x[N];
  for (int i = 0; i < N; i++) x[i] = -87.0f + 87.0f * (float)i / (N - 1); /* [-87, 0] */
  static float y[N];
  memcpy(y, x, sizeof x);
  fa_cpu_exp_sub(y, N, 0.0f);
  double worst = 0;
  for (int i = 0; i < N; i++) {
    double ref = exp((double)x[i]);
    double rel = fabs(y[i] - ref) / ref;
    worst = rel > worst ? rel : worst;
  }
  cr_assert_lt(worst, 4 * FLT_EPSILON, "max relative error %g", worst); /* a few ulp */
  float m[5] = {-INFINITY, -1e30f, -100.0f, -87.5f, 0.0f};
  fa_cpu_exp_sub(m, 5, 0.0f);
  cr_assert_eq(m[0], 0.0f);
  cr_assert_eq(m[1], 0.0f);
  cr_assert_eq(m[2], 0.0f);
  cr_assert_eq(m[3], 0.0f);
  cr_assert_eq(m[4], 1.0f);
  float sub[3] = {5.0f, 3.0f, -INFINITY};
  fa_cpu_exp_sub(sub, 3, 5.0f);
  cr_assert_eq(sub[0], 1.0f);
  cr_assert_float_eq(sub[1], expf(-2.0f), 4 * FLT_EPSILON);
  cr_assert_eq(sub[2], 0.0f);
}

/* ---- online KL (StreamKL building block, lib/distill/online_kl.h) --------------------- */

/* float64 KL(T||S), KL(S||T) and the log-sum-exps, directly. */
static void kl_direct(const float *t, const float *s, int n, double out[4]) {
  double mt = -INFINITY, ms = -INFINITY, zt = 0, zs = 0;
  for (int j = 0; j < n; j++) mt = fmax(mt, t[j]), ms = fmax(ms, s[j]);
  for (int j = 0; j < n; j++) zt += exp(t[j] - mt), zs += exp(s[j] - ms);
  const double lt = mt + log(zt), ls = ms + log(zs);
  double f = 0, r = 0;
  for (int j = 0; j < n; j++) {
    const double pt = exp(t[j] - lt), ps = exp(s[j] - ls);
    f += pt * ((t[j] - lt) - (s[j] - ls));
    r += ps * ((s[j] - ls) - (t[j] - lt));
  }
  out[0] = f, out[1] = r, out[2] = lt, out[3] = ls;
}

/* Stream a row in random tiles, optionally split into two states merged at the end. */
static void kl_stream(const float *t, const float *s, int n, tc_rng *rng, int split, float out[4]) {
  fa_kl_state a = fa_kl_init(), b = fa_kl_init();
  const int cut = split ? (int)tc_randint(rng, 0, n) : n;
  for (int j = 0; j < n;) {
    int len = (int)tc_randint(rng, 1, 64);
    const int lim = j < cut ? cut : n;
    if (j + len > lim) len = lim - j;
    fa_kl_tile(j < cut ? &a : &b, t + j, s + j, len);
    j += len;
  }
  fa_kl_merge(&a, &b);
  fa_kl_finish(a, &out[0], &out[1], &out[2], &out[3]);
}

/* A random row of n <= 300 (t, s) scores: spread of the scores, offset of
 * each distribution (up to 1e3: centring keeps the terms small), the student
 * partly correlated with the teacher, every `peaked`-th row with one key 60
 * above. Returns n; *sp is the spread including the peak. */
static int kl_random_row(tc_rng *rng, int peaked, float *t, float *s, double *sp) {
  const int n = (int)tc_randint(rng, 1, 300);
  const double spread = tc_uniform(rng, 0.1, 20.0), off_t = tc_uniform(rng, -1e3, 1e3);
  const double off_s = tc_uniform(rng, -1e3, 1e3), mix = tc_uniform(rng, 0, 1);
  for (int j = 0; j < n; j++) {
    const double base = tc_uniform(rng, -spread, spread);
    t[j] = (float)(off_t + base + (peaked && j == n / 2 ? 60 : 0));
    s[j] = (float)(off_s + mix * base + (1 - mix) * tc_uniform(rng, -spread, spread));
  }
  *sp = spread + (peaked ? 60 : 0);
  return n;
}

/* The float32 terms are O(spread); with n <= 300 keys the accumulated
 * rounding is a few 1e-7 of spread, so |error| <= 1e-5 * (1 + spread) + 1e-5 * KL. */
static void kl_assert_close(const float got[2], const double want[2], double sp, int trial, int n) {
  for (int k = 0; k < 2; k++)
    cr_assert_leq(fabs(got[k] - want[k]), 1e-5 * (1 + sp) + 1e-5 * want[k], "trial %d n %d %s: %.9g vs %.9g",
                  trial, n, k ? "reverse" : "forward", (double)got[k], want[k]);
}

/* Random rows (kl_random_row), peaked rows, merged partial states. */
Test(online_kl, streamed_matches_float64_direct) {
  tc_rng rng = tc_rng_for("online_kl.random");
  float t[300], s[300];
  for (int trial = 0; trial < 400; trial++) {
    double sp;
    const int n = kl_random_row(&rng, trial % 5 == 0, t, s, &sp);
    double want[4];
    kl_direct(t, s, n, want);
    float got[4];
    kl_stream(t, s, n, &rng, trial % 2, got);
    kl_assert_close(got, want, sp, trial, n);
    for (int k = 2; k < 4; k++) /* lse of scores near 1e3: half an f32 ulp there is 3e-5 */
      cr_assert_leq(fabs(got[k] - want[k]), 4e-7 * fabs(want[k]) + 1e-5 * (1 + log((double)n)), "trial %d lse", trial);
  }
}

/* T == S shifted by 1e4: KL is 0. The textbook E_T[t - s] - lse_t + lse_s
 * subtracts two numbers near 1e4 (f32 ulp 1e-3); the centred state must not.
 * The scores are multiples of 2^-10, so t + 1e4 is exact in f32 (ulp 2^-10
 * there) and the two distributions are exactly equal: a rounded shift would
 * make them differ by up to half an ulp a score, a true KL near 1e-8 whose
 * f32 evaluation can reach the bound by itself. */
Test(online_kl, equal_distributions_give_zero_far_from_the_origin) {
  tc_rng rng = tc_rng_for("online_kl.equal");
  float t[200], s[200];
  for (int trial = 0; trial < 50; trial++) {
    const int n = (int)tc_randint(&rng, 1, 200);
    for (int j = 0; j < n; j++) {
      t[j] = (float)(round(tc_uniform(&rng, -8, 8) * 1024.0) / 1024.0);
      s[j] = t[j] + 10000.0f;
      cr_assert(s[j] - 10000.0f == t[j], "the shift must be exact");
    }
    float got[4];
    kl_stream(t, s, n, &rng, trial % 2, got);
    cr_assert_leq(got[0], 1e-6, "trial %d: KL(T||S) %.3g for identical distributions", trial, (double)got[0]);
    cr_assert_leq(got[1], 1e-6, "trial %d: KL(S||T) %.3g", trial, (double)got[1]);
    cr_assert(got[0] >= 0 && got[1] >= 0);
  }
}

Test(online_kl, empty_row_and_single_key) {
  fa_kl_state st = fa_kl_init();
  float f, r, lt, ls;
  fa_kl_finish(st, &f, &r, &lt, &ls);
  cr_assert(f == 0 && r == 0 && lt == -INFINITY && ls == -INFINITY);
  const float t = 3.5f, s = -2.0f;
  fa_kl_tile(&st, &t, &s, 1);
  fa_kl_finish(st, &f, &r, &lt, &ls);
  cr_assert(f == 0 && r == 0, "one key: both distributions are 1 there");
  cr_assert_float_eq(lt, 3.5f, 1e-6);
  cr_assert_float_eq(ls, -2.0f, 1e-6);
}

/* fa_kl_grad against central differences of the float64 KL. */
Test(online_kl, gradients_match_finite_differences) {
  tc_rng rng = tc_rng_for("online_kl.grad");
  float t[40], s[40];
  for (int trial = 0; trial < 30; trial++) {
    const int n = (int)tc_randint(&rng, 2, 40);
    for (int j = 0; j < n; j++) t[j] = (float)tc_uniform(&rng, -3, 3), s[j] = (float)tc_uniform(&rng, -3, 3);
    float st[4];
    kl_stream(t, s, n, &rng, 0, st);
    for (int rev = 0; rev < 2; rev++)
      for (int j = 0; j < n; j++) {
        float g_t, g_s;
        fa_kl_grad(t[j], s[j], st[2], st[3], st[rev], rev, &g_t, &g_s);
        const float h = 1e-2f;
        double up[4], dn[4];
        const float keep_t = t[j], keep_s = s[j];
        t[j] = keep_t + h, kl_direct(t, s, n, up);
        t[j] = keep_t - h, kl_direct(t, s, n, dn);
        t[j] = keep_t;
        const double fd_t = (up[rev] - dn[rev]) / (2 * h);
        s[j] = keep_s + h, kl_direct(t, s, n, up);
        s[j] = keep_s - h, kl_direct(t, s, n, dn);
        s[j] = keep_s;
        const double fd_s = (up[rev] - dn[rev]) / (2 * h);
        /* central differences: O(h^2) truncation (second derivatives are O(1)) */
        cr_assert_leq(fabs(g_t - fd_t), 2e-4, "trial %d rev %d key %d: dt %.6g vs %.6g", trial, rev, j, (double)g_t, fd_t);
        cr_assert_leq(fabs(g_s - fd_s), 2e-4, "trial %d rev %d key %d: ds %.6g vs %.6g", trial, rev, j, (double)g_s, fd_s);
      }
  }
}

/* fa_kl_row_finish: the outside mass (teacher mass on the dropped keys) stays
 * in [0, 1] and matches float64 over the whole range of log(dropped / kept),
 * from nothing dropped to nothing kept, with scores far from the origin. The
 * float32 result is a logistic of x = lse_drop - lse_t: relative error a few
 * ulps of the result, plus the rounding of x itself (ulp(|lse|) ~ 6e-5 at 1e3). */
Test(online_kl, row_finish_outside_mass_in_unit_interval) {
  tc_rng rng = tc_rng_for("online_kl.outside");
  for (int trial = 0; trial < 4000; trial++) {
    const float off = (float)tc_uniform(&rng, -1e3, 1e3), x = (float)tc_uniform(&rng, -120, 120);
    fa_kl_state st = fa_kl_init();
    const float t = off, s = off * 0.5f;
    fa_kl_tile(&st, &t, &s, 1); /* kept support: one key, lse_t = off */
    float stats4[FORKATTN_KL_STATS], outside = -1.0f;
    fa_kl_row_finish(st, off + x, 1.0f, trial % 2, stats4, &outside); /* dropped: lse = off + x */
    const double xd = (double)(off + x) - (double)off, want = 1.0 / (1.0 + exp(-xd));
    cr_assert(outside >= 0.0f && outside <= 1.0f, "trial %d x %.9g: outside mass %.9g", trial, xd, (double)outside);
    cr_assert_leq(fabs(outside - want), 4e-7 * want + 1e-7, "trial %d x %.9g: %.9g vs %.9g", trial, xd,
                  (double)outside, want);
    const double lse_tf = (double)off + (xd > 0 ? xd + log1p(exp(-xd)) : log1p(exp(xd)));
    cr_assert_leq(fabs(stats4[FA_KL_LSE_TF] - lse_tf), 1.2e-7 * fabs(lse_tf) + 1e-6, "trial %d: full lse", trial);
  }
  float stats4[FORKATTN_KL_STATS], outside = -1.0f;
  fa_kl_row_finish(fa_kl_init(), 5.0f, 2.0f, 0, stats4, &outside);
  cr_assert(outside == 1.0f && stats4[FA_KL_DIV] == 0.0f, "nothing kept: mass 1, divergence 0");
  fa_kl_state st = fa_kl_init();
  const float t = 1.0f, s = 2.0f;
  fa_kl_tile(&st, &t, &s, 1);
  fa_kl_row_finish(st, -INFINITY, 0.0f, 0, stats4, &outside);
  cr_assert(outside == 0.0f, "nothing dropped: mass exactly 0");
}

/* fa_kl_add (one key at a time, rebasing only when a maximum grows: the GPU
 * kernels' fold) against float64 on the same random rows as above. */
Test(online_kl, one_key_fold_matches_float64_direct) {
  tc_rng rng = tc_rng_for("online_kl.add");
  float t[300], s[300];
  for (int trial = 0; trial < 200; trial++) {
    double sp;
    const int n = kl_random_row(&rng, trial % 5 == 0, t, s, &sp);
    double want[4];
    kl_direct(t, s, n, want);
    fa_kl_state st = fa_kl_init();
    for (int j = 0; j < n; j++) fa_kl_add(&st, t[j], s[j]);
    float got[4];
    fa_kl_finish(st, &got[0], &got[1], &got[2], &got[3]);
    kl_assert_close(got, want, sp, trial, n);
  }
}
