/*
 * test_trie.c - rollout tries: forkattn_trie_from_sequences / _from_parents /
 * _from_token_parents and the row maps.
 *
 * Random RL-like inputs (shared prompts, branches at random points, duplicate
 * and prefix rollouts, small and large token alphabets) are built and every
 * property of the contract is checked against the input: each sequence is a
 * root-to-node path whose rows hold its tokens at positions 0..len-1, nodes are
 * maximal, subtrees are contiguous (DFS), the largest child comes first and the
 * others in order of first appearance, the row count and the replicated count
 * match brute-force counts.
 * Node-parent tries are compared with the input tree (and across shuffled
 * inputs by canonical form); token-parent tries with the sequence tries of the
 * same paths. Every invalid argument fails with a message naming it and leaves
 * *trie NULL; allocation failures (FORKATTN_ALLOC_TEST builds) leak nothing.
 */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_common.h"

/* Exported by FORKATTN_ALLOC_TEST builds of the library only (lib/core/alloc.c). */
extern int64_t forkattn_test_fail_alloc_after(int64_t n) __attribute__((weak));

/* A non-NULL *trie before each failing call: the builder must reset it. */
static char sentinel_obj;
#define SENTINEL ((forkattn_trie *)(void *)&sentinel_obj)

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  cr_assert_not_null(p, "test: out of memory");
  return p;
}

static int64_t *xi64(int64_t n) { return xcalloc((size_t)n, sizeof(int64_t)); }

/* ---- sequence sets --------------------------------------------------------- */

typedef struct seqs {
  int64_t n, ntok, cap_seq, cap_tok;
  int64_t *off, *tok;
} seqs;

static void seqs_init(seqs *s) {
  memset(s, 0, sizeof *s);
  s->cap_seq = 16;
  s->cap_tok = 256;
  s->off = xi64(s->cap_seq + 1);
  s->tok = xi64(s->cap_tok);
}

static void seqs_free(seqs *s) {
  free(s->off);
  free(s->tok);
}

static void seqs_push(seqs *s, int64_t token) {
  if (s->ntok == s->cap_tok) {
    s->cap_tok *= 2;
    s->tok = realloc(s->tok, (size_t)s->cap_tok * sizeof(int64_t));
    cr_assert_not_null(s->tok);
  }
  s->tok[s->ntok++] = token;
}

/* Close the sequence made of the tokens pushed since the last one. */
static void seqs_end(seqs *s) {
  if (s->n + 1 == s->cap_seq) {
    s->cap_seq *= 2;
    s->off = realloc(s->off, (size_t)(s->cap_seq + 1) * sizeof(int64_t));
    cr_assert_not_null(s->off);
  }
  s->off[++s->n] = s->ntok;
}

static int64_t seq_len(const seqs *s, int64_t q) { return s->off[q + 1] - s->off[q]; }

/* Append tokens [from, from + len) of sequence q (of the same set). */
static void seqs_copy(seqs *s, int64_t q, int64_t len) {
  for (int64_t j = 0; j < len; j++) seqs_push(s, s->tok[s->off[q] + j]);
}

typedef struct rl_params {
  int64_t nseq, nprompts, alphabet, token_base, max_prompt, max_response;
} rl_params;

static int64_t rand_token(tc_rng *rng, const rl_params *p) {
  return p->token_base + tc_randint(rng, 0, p->alphabet - 1);
}

/* RL-like rollouts: prompts (distinct first tokens) followed by responses;
 * some rollouts branch off an earlier one at a random point, some repeat an
 * earlier one or a prefix of it. */
static void gen_rl(tc_rng *rng, const rl_params *p, seqs *s) {
  seqs prompts;
  seqs_init(&prompts);
  for (int64_t i = 0; i < p->nprompts; i++) {
    seqs_push(&prompts, p->token_base - 1 - i); /* distinct first tokens */
    for (int64_t j = tc_randint(rng, 1, p->max_prompt); j > 1; j--) seqs_push(&prompts, rand_token(rng, p));
    seqs_end(&prompts);
  }
  seqs_init(s);
  for (int64_t q = 0; q < p->nseq; q++) {
    const double u = tc_uniform(rng, 0.0, 1.0);
    const int64_t e = q > 0 ? tc_randint(rng, 0, q - 1) : -1;
    if (e >= 0 && u < 0.1) {
      seqs_copy(s, e, seq_len(s, e)); /* the same rollout again */
    } else if (e >= 0 && u < 0.2) {
      seqs_copy(s, e, tc_randint(rng, 1, seq_len(s, e))); /* a prefix of one */
    } else if (e >= 0 && u < 0.6) {
      seqs_copy(s, e, tc_randint(rng, 1, seq_len(s, e))); /* a branch */
      for (int64_t j = tc_randint(rng, 1, p->max_response); j > 0; j--) seqs_push(s, rand_token(rng, p));
    } else {
      const int64_t pr = tc_randint(rng, 0, p->nprompts - 1);
      for (int64_t j = 0; j < seq_len(&prompts, pr); j++) seqs_push(s, prompts.tok[prompts.off[pr] + j]);
      for (int64_t j = tc_randint(rng, 0, p->max_response); j > 0; j--) seqs_push(s, rand_token(rng, p));
    }
    seqs_end(s);
  }
  seqs_free(&prompts);
}

static rl_params random_params(tc_rng *rng, int64_t max_seq) {
  static const int64_t alphabets[] = {1, 2, 3, 8, 1000, (int64_t)1 << 40};
  rl_params p;
  p.nseq = tc_randint(rng, 1, max_seq);
  p.nprompts = tc_randint(rng, 0, 3) == 0 ? tc_randint(rng, 2, 4) : 1;
  p.alphabet = alphabets[tc_randint(rng, 0, 5)];
  p.token_base = tc_randint(rng, 0, 1) ? 0 : -((int64_t)1 << 50);
  p.max_prompt = tc_randint(rng, 1, 120);
  p.max_response = tc_randint(rng, 1, 90);
  return p;
}

/* ---- layout invariants ----------------------------------------------------- */

/* What check_layout learns about a trie (free with shape_free). */
typedef struct shape {
  int64_t n, T;
  const int64_t *off, *par;
  int64_t *nkids, *kid_start, *kids; /* children in increasing packed index */
  int64_t *size;                     /* subtree sizes in nodes */
  int64_t leaf_path_sum;             /* sum over leaves of the root-to-leaf token count */
} shape;

static void shape_free(shape *sh) {
  free(sh->nkids);
  free(sh->kid_start);
  free(sh->kids);
  free(sh->size);
}

/* Everything a packed tree must satisfy, whichever builder made it. */
static void check_layout(const forkattn_trie *t, shape *sh) {
  const forkattn_tree_layout l = tc_trie_layout(t);
  const int64_t n = l.num_nodes, *off = l.node_offsets, *par = l.parents;
  cr_assert_geq(n, 1);
  cr_assert(off && par);
  cr_assert_eq(off[0], 0, "node_offsets[0] = %lld", (long long)off[0]);
  for (int64_t i = 0; i < n; i++) {
    cr_assert_gt(off[i + 1], off[i], "node %lld is empty or reversed", (long long)i);
    cr_assert(par[i] == -1 || (par[i] >= 0 && par[i] < i), "parents[%lld] = %lld", (long long)i, (long long)par[i]);
  }
  const int64_t T = off[n];
  cr_assert_eq(forkattn_trie_num_rows(t), T);
  const int64_t *depth = forkattn_trie_node_depths(t), *rnode = forkattn_trie_row_nodes(t),
                *rpos = forkattn_trie_row_positions(t);
  cr_assert(depth && rnode && rpos);
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = par[i];
    cr_assert_eq(depth[i], p < 0 ? 0 : depth[p] + 1, "node_depths[%lld]", (long long)i);
    const int64_t pos0 = p < 0 ? 0 : rpos[off[p + 1] - 1] + 1;
    for (int64_t r = off[i]; r < off[i + 1]; r++) {
      cr_assert_eq(rnode[r], i, "row_nodes[%lld] = %lld, node %lld", (long long)r, (long long)rnode[r], (long long)i);
      cr_assert_eq(rpos[r], pos0 + (r - off[i]), "row_positions[%lld]", (long long)r);
    }
  }
  /* DFS: a node's first child follows it, each next child follows the
   * previous child's subtree, the subtree ends where the next sibling starts;
   * roots likewise cover [0, n). */
  sh->n = n;
  sh->T = T;
  sh->off = off;
  sh->par = par;
  sh->nkids = xi64(n + 1); /* slot n: the roots */
  sh->kid_start = xi64(n + 2);
  sh->kids = xi64(n);
  sh->size = xi64(n);
  for (int64_t i = 0; i < n; i++) sh->nkids[par[i] < 0 ? n : par[i]]++;
  for (int64_t k = 0; k <= n; k++) sh->kid_start[k + 1] = sh->kid_start[k] + sh->nkids[k];
  int64_t *fill = xi64(n + 1);
  for (int64_t i = 0; i < n; i++) {
    const int64_t k = par[i] < 0 ? n : par[i];
    sh->kids[sh->kid_start[k] + fill[k]++] = i;
  }
  free(fill);
  for (int64_t i = n - 1; i >= 0; i--) {
    sh->size[i] += 1;
    if (par[i] >= 0) sh->size[par[i]] += sh->size[i];
  }
  for (int64_t k = 0; k <= n; k++) {
    int64_t expect = k == n ? 0 : k + 1;
    for (int64_t j = sh->kid_start[k]; j < sh->kid_start[k + 1]; j++) {
      cr_assert_eq(sh->kids[j], expect, "DFS order: child %lld of %lld, expected %lld", (long long)sh->kids[j],
                   (long long)k, (long long)expect);
      expect += sh->size[sh->kids[j]];
    }
    cr_assert_eq(expect, k == n ? n : k + sh->size[k], "subtree of %lld is not contiguous", (long long)k);
  }
  /* replicated tokens of a tree: root-to-leaf token counts over the leaves */
  sh->leaf_path_sum = 0;
  for (int64_t i = 0; i < n; i++)
    if (sh->nkids[i] == 0) sh->leaf_path_sum += rpos[off[i + 1] - 1] + 1;
  const double ratio = forkattn_trie_dedup_ratio(t), want = (double)forkattn_trie_replicated_tokens(t) / (double)T;
  cr_assert(fabs(ratio - want) <= 1e-12 * want, "dedup ratio %.17g, replicated / rows %.17g", ratio, want);
  cr_assert_geq(ratio, 1.0);
}

/* Children order: under each node, the child with the most nodes in its
 * subtree first (the smallest key among equals), then the others in
 * increasing key; roots in increasing key. key: first appearance or input
 * index of every packed node. */
static void check_child_order(const shape *sh, const int64_t *key, const char *what) {
  for (int64_t k = 0; k <= sh->n; k++) {
    const int64_t a = sh->kid_start[k], b = sh->kid_start[k + 1];
    if (a == b) continue;
    int64_t j0 = a;
    if (k < sh->n) {
      const int64_t h = sh->kids[a];
      for (int64_t j = a + 1; j < b; j++) {
        const int64_t c = sh->kids[j];
        cr_assert(sh->size[c] < sh->size[h] || (sh->size[c] == sh->size[h] && key[c] > key[h]),
                  "node %lld: first child %lld (%lld nodes) is not the largest (child %lld: %lld nodes), earliest in %s",
                  (long long)k, (long long)h, (long long)sh->size[h], (long long)c, (long long)sh->size[c], what);
      }
      j0 = a + 1;
    }
    for (int64_t j = j0 + 1; j < b; j++)
      cr_assert_lt(key[sh->kids[j - 1]], key[sh->kids[j]], "children of %lld after the largest: not in %s",
                   (long long)k, what);
  }
}

/* ---- sequence tries -------------------------------------------------------- */

/* Rows before deduplication minus rows shared with an earlier sequence. */
static int64_t brute_force_rows(const seqs *s) {
  int64_t rows = 0;
  for (int64_t q = 0; q < s->n; q++) {
    int64_t best = 0;
    for (int64_t e = 0; e < q; e++) {
      int64_t k = 0;
      const int64_t lim = seq_len(s, q) < seq_len(s, e) ? seq_len(s, q) : seq_len(s, e);
      while (k < lim && s->tok[s->off[q] + k] == s->tok[s->off[e] + k]) k++;
      if (k > best) best = k;
    }
    rows += seq_len(s, q) - best;
  }
  return rows;
}

/* Every property of a trie built from s. */
static void check_sequences(const forkattn_trie *t, const seqs *s) {
  shape sh;
  check_layout(t, &sh);
  const int64_t n = sh.n, T = sh.T, *off = sh.off, *par = sh.par;
  const int64_t *in = forkattn_trie_input_rows(t), *rtok = forkattn_trie_row_tokens(t),
                *rpos = forkattn_trie_row_positions(t), *rnode = forkattn_trie_row_nodes(t);
  cr_assert(in && rtok);
  cr_assert_null(forkattn_trie_input_nodes(t));
  int64_t *ends = xi64(n), *first_seq = xi64(n);
  for (int64_t i = 0; i < n; i++) first_seq[i] = -1;
  for (int64_t q = 0; q < s->n; q++) {
    const int64_t a = s->off[q], b = s->off[q + 1];
    for (int64_t j = 0; j < b - a; j++) {
      const int64_t r = in[a + j];
      cr_assert(r >= 0 && r < T, "input_rows[%lld] = %lld", (long long)(a + j), (long long)r);
      cr_assert_eq(rtok[r], s->tok[a + j], "sequence %lld position %lld: row %lld holds token %lld, not %lld",
                   (long long)q, (long long)j, (long long)r, (long long)rtok[r], (long long)s->tok[a + j]);
      cr_assert_eq(rpos[r], j, "sequence %lld position %lld: row %lld at position %lld", (long long)q, (long long)j,
                   (long long)r, (long long)rpos[r]);
    }
    /* the sequence's rows are exactly its root-to-node path, in order */
    const int64_t v = rnode[in[b - 1]];
    cr_assert_eq(in[b - 1], off[v + 1] - 1, "sequence %lld ends inside node %lld", (long long)q, (long long)v);
    ends[v] = 1;
    int64_t idx = b - 1;
    for (int64_t u = v; u >= 0; u = par[u]) {
      if (first_seq[u] < 0) first_seq[u] = q;
      for (int64_t r = off[u + 1] - 1; r >= off[u]; r--, idx--)
        cr_assert(idx >= a && in[idx] == r, "sequence %lld: path row %lld is not its row %lld", (long long)q,
                  (long long)r, (long long)(idx - a));
    }
    cr_assert_eq(idx, a - 1, "sequence %lld is longer than its path", (long long)q);
  }
  for (int64_t k = 0; k <= n; k++) {
    if (k < n) {
      cr_assert_geq(first_seq[k], 0, "node %lld is on no sequence", (long long)k);
      cr_assert(sh.nkids[k] >= 2 || ends[k], "node %lld has %lld child(ren) and no sequence ends there: not maximal",
                (long long)k, (long long)sh.nkids[k]);
    }
    for (int64_t j = sh.kid_start[k]; j < sh.kid_start[k + 1]; j++) {
      const int64_t c = sh.kids[j];
      for (int64_t i = sh.kid_start[k]; i < j; i++)
        cr_assert_neq(rtok[off[c]], rtok[off[sh.kids[i]]], "siblings %lld and %lld start with the same token",
                      (long long)sh.kids[i], (long long)c);
    }
  }
  check_child_order(&sh, first_seq, "order of first appearance");
  cr_assert_eq(forkattn_trie_replicated_tokens(t), s->ntok);
  const int64_t brute = brute_force_rows(s);
  cr_assert_eq(T, brute, "%lld rows, brute force %lld", (long long)T, (long long)brute);
  free(ends);
  free(first_seq);
  shape_free(&sh);
}

static int64_t count_roots(const forkattn_trie *t) {
  const forkattn_tree_layout l = tc_trie_layout(t);
  int64_t roots = 0;
  for (int64_t i = 0; i < l.num_nodes; i++) roots += l.parents[i] < 0;
  return roots;
}

static forkattn_trie *build_seqs(forkattn_ctx *ctx, const seqs *s, unsigned flags) {
  forkattn_trie *t = NULL;
  const forkattn_status st = forkattn_trie_from_sequences(ctx, s->n, s->off, s->tok, flags, &t);
  cr_assert_eq(st, FORKATTN_OK, "from_sequences: %s (%s)", forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  cr_assert_not_null(t);
  return t;
}

Test(trie, rl_groups_random) {
  tc_rng rng = tc_rng_for("trie/rl_groups_random");
  forkattn_ctx *ctx = tc_ctx_default("trie/rl_groups_random");
  cr_assert_not_null(ctx);
  for (int it = 0; it < 200; it++) {
    const rl_params p = random_params(&rng, 48);
    seqs s;
    gen_rl(&rng, &p, &s);
    forkattn_trie *t = build_seqs(ctx, &s, 0);
    check_sequences(t, &s);
    if (p.nprompts == 1) cr_assert_eq(count_roots(t), 1);
    forkattn_trie_free(t);
    seqs_free(&s);
  }
  forkattn_ctx_destroy(ctx);
}

Test(trie, dedup_small_alphabets) {
  tc_rng rng = tc_rng_for("trie/dedup_small_alphabets");
  forkattn_ctx *ctx = tc_ctx_default("trie/dedup_small_alphabets");
  cr_assert_not_null(ctx);
  for (int it = 0; it < 40; it++) {
    /* independent random strings over 1..3 symbols: sharing only by accident */
    const int64_t alphabet = tc_randint(&rng, 1, 3), nseq = tc_randint(&rng, 1, 64);
    seqs s;
    seqs_init(&s);
    for (int64_t q = 0; q < nseq; q++) {
      for (int64_t j = tc_randint(&rng, 1, 24); j > 0; j--) seqs_push(&s, tc_randint(&rng, 0, alphabet - 1));
      seqs_end(&s);
    }
    forkattn_trie *t = build_seqs(ctx, &s, 0);
    check_sequences(t, &s);
    const double want = (double)s.ntok / (double)brute_force_rows(&s);
    cr_assert(fabs(forkattn_trie_dedup_ratio(t) - want) <= 1e-12 * want, "dedup ratio %.17g, brute force %.17g",
              forkattn_trie_dedup_ratio(t), want);
    forkattn_trie_free(t);
    seqs_free(&s);
  }
  forkattn_ctx_destroy(ctx);
}

Test(trie, identical_and_prefix_sequences) {
  tc_rng rng = tc_rng_for("trie/identical_and_prefix_sequences");
  forkattn_ctx *ctx = tc_ctx_default("trie/identical_and_prefix_sequences");
  cr_assert_not_null(ctx);
  const int64_t L = tc_randint(&rng, 30, 80), cut = tc_randint(&rng, 2, L - 2), tail = tc_randint(&rng, 1, 9);
  seqs s;
  seqs_init(&s);
  for (int64_t j = 0; j < L; j++) seqs_push(&s, tc_randint(&rng, 0, 1000));
  seqs_end(&s);                               /* 0: A */
  seqs_copy(&s, 0, L), seqs_end(&s);          /* 1: A again */
  seqs_copy(&s, 0, cut), seqs_end(&s);        /* 2: A[0, cut) */
  seqs_copy(&s, 0, cut);                      /* 3: A[0, cut) + a different tail */
  seqs_push(&s, s.tok[cut] + 1);
  for (int64_t j = 1; j < tail; j++) seqs_push(&s, tc_randint(&rng, 0, 1000));
  seqs_end(&s);
  seqs_copy(&s, 0, 1), seqs_end(&s);          /* 4: A's first token */
  seqs_copy(&s, 0, cut), seqs_end(&s);        /* 5: A[0, cut) again */
  forkattn_trie *t = build_seqs(ctx, &s, FORKATTN_TRIE_SINGLE_ROOT);
  check_sequences(t, &s);
  const int64_t *in = forkattn_trie_input_rows(t);
  for (int64_t j = 0; j < L; j++) cr_assert_eq(in[s.off[1] + j], in[j], "identical sequences share every row");
  for (int64_t j = 0; j < cut; j++) {
    cr_assert_eq(in[s.off[2] + j], in[j], "a prefix shares the rows of the longer sequence");
    cr_assert_eq(in[s.off[3] + j], in[j]);
    cr_assert_eq(in[s.off[5] + j], in[j]);
  }
  /* [A0] [A1, cut) [cut, L) [D's tail] */
  const forkattn_tree_layout l = tc_trie_layout(t);
  cr_assert_eq(l.num_nodes, 4);
  cr_assert_eq(forkattn_trie_num_rows(t), L + tail);
  const int64_t want_off[5] = {0, 1, cut, L, L + tail}, want_par[4] = {-1, 0, 1, 1};
  for (int i = 0; i < 4; i++) {
    cr_assert_eq(l.node_offsets[i + 1], want_off[i + 1]);
    cr_assert_eq(l.parents[i], want_par[i]);
  }
  forkattn_trie_free(t);
  seqs_free(&s);
  forkattn_ctx_destroy(ctx);
}

/* ---- node-parent tries ----------------------------------------------------- */

/* A random tree in parents-before-children order: long chains and bushy nodes. */
static void random_tree(tc_rng *rng, int64_t n, int64_t nroots, int64_t *par, int64_t *len) {
  for (int64_t i = 0; i < n; i++) {
    const double u = tc_uniform(rng, 0.0, 1.0);
    par[i] = i < nroots ? -1 : u < 0.5 ? i - 1 : tc_randint(rng, 0, i - 1);
    len[i] = tc_randint(rng, 0, 3) ? tc_randint(rng, 1, 4) : tc_randint(rng, 1, 300);
  }
}

/* Shuffle: node i of the input becomes perm[i]. */
static void shuffle_tree(tc_rng *rng, int64_t n, const int64_t *par, const int64_t *len, int64_t *perm,
                         int64_t *spar, int64_t *slen) {
  for (int64_t i = 0; i < n; i++) perm[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {
    const int64_t j = tc_randint(rng, 0, i), x = perm[i];
    perm[i] = perm[j];
    perm[j] = x;
  }
  for (int64_t i = 0; i < n; i++) {
    spar[perm[i]] = par[i] < 0 ? -1 : perm[par[i]];
    slen[perm[i]] = len[i];
  }
}

/* The trie of (par, len) is that tree: input_nodes is an isomorphism, the
 * input rows follow it, children come largest first, then in increasing input
 * index. */
static void check_parents(const forkattn_trie *t, int64_t n, const int64_t *par, const int64_t *len) {
  shape sh;
  check_layout(t, &sh);
  cr_assert_eq(sh.n, n);
  const int64_t *map = forkattn_trie_input_nodes(t), *in = forkattn_trie_input_rows(t);
  cr_assert(map && in);
  cr_assert_null(forkattn_trie_row_tokens(t));
  int64_t *inverse = xi64(n), rows = 0;
  for (int64_t i = 0; i < n; i++) inverse[i] = -1;
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = map[i];
    cr_assert(p >= 0 && p < n && inverse[p] < 0, "input_nodes[%lld] = %lld", (long long)i, (long long)p);
    inverse[p] = i;
    cr_assert_eq(sh.par[p], par[i] < 0 ? -1 : map[par[i]], "parent of input node %lld", (long long)i);
    cr_assert_eq(sh.off[p + 1] - sh.off[p], len[i], "length of input node %lld", (long long)i);
    for (int64_t k = 0; k < len[i]; k++)
      cr_assert_eq(in[rows + k], sh.off[p] + k, "input_rows of node %lld", (long long)i);
    rows += len[i];
  }
  check_child_order(&sh, inverse, "increasing input index");
  /* replicated: walk every input leaf up to its root */
  char *has_kid = xcalloc((size_t)n, 1);
  for (int64_t i = 0; i < n; i++)
    if (par[i] >= 0) has_kid[par[i]] = 1;
  int64_t replicated = 0;
  for (int64_t i = 0; i < n; i++)
    if (!has_kid[i])
      for (int64_t u = i; u >= 0; u = par[u]) replicated += len[u];
  cr_assert_eq(forkattn_trie_replicated_tokens(t), replicated);
  cr_assert_eq(sh.leaf_path_sum, replicated);
  free(has_kid);
  free(inverse);
  shape_free(&sh);
}

/* Canonical form of a packed forest (AHU): a node's class is given by its
 * length and the sorted classes of its children; classes are interned in a
 * table shared by the forests compared. */
typedef struct interner {
  int64_t count, cap, pool_len, pool_cap;
  int64_t *pool;  /* signatures back to back: len, k, k classes */
  int64_t *where; /* start of class i's signature */
} interner;

static int cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static int64_t intern(interner *in, const int64_t *sig, int64_t siglen) {
  for (int64_t c = 0; c < in->count; c++) {
    const int64_t *o = in->pool + in->where[c];
    if (o[1] + 2 == siglen && !memcmp(o, sig, (size_t)siglen * sizeof(int64_t))) return c;
  }
  if (in->count == in->cap) {
    in->cap = in->cap ? 2 * in->cap : 64;
    in->where = realloc(in->where, (size_t)in->cap * sizeof(int64_t));
    cr_assert_not_null(in->where);
  }
  while (in->pool_len + siglen > in->pool_cap) {
    in->pool_cap = in->pool_cap ? 2 * in->pool_cap : 1024;
    in->pool = realloc(in->pool, (size_t)in->pool_cap * sizeof(int64_t));
    cr_assert_not_null(in->pool);
  }
  memcpy(in->pool + in->pool_len, sig, (size_t)siglen * sizeof(int64_t));
  in->where[in->count] = in->pool_len;
  in->pool_len += siglen;
  return in->count++;
}

/* Sorted classes of the roots (n of them at most) into roots[]; returns how many. */
static int64_t canonical_roots(interner *in, const forkattn_trie *t, int64_t *roots) {
  shape sh;
  check_layout(t, &sh);
  const int64_t n = sh.n;
  int64_t *cls = xi64(n), *sig = xi64(n + 2);
  for (int64_t i = n - 1; i >= 0; i--) { /* children after their parent in DFS order */
    const int64_t k = sh.nkids[i];
    sig[0] = sh.off[i + 1] - sh.off[i];
    sig[1] = k;
    for (int64_t j = 0; j < k; j++) sig[2 + j] = cls[sh.kids[sh.kid_start[i] + j]];
    qsort(sig + 2, (size_t)k, sizeof(int64_t), cmp_i64);
    cls[i] = intern(in, sig, k + 2);
  }
  const int64_t nroots = sh.nkids[n];
  for (int64_t j = 0; j < nroots; j++) roots[j] = cls[sh.kids[sh.kid_start[n] + j]];
  qsort(roots, (size_t)nroots, sizeof(int64_t), cmp_i64);
  free(cls);
  free(sig);
  shape_free(&sh);
  return nroots;
}

static forkattn_trie *build_parents(forkattn_ctx *ctx, int64_t n, const int64_t *par, const int64_t *len,
                                    unsigned flags) {
  forkattn_trie *t = NULL;
  const forkattn_status st = forkattn_trie_from_parents(ctx, n, par, len, flags, &t);
  cr_assert_eq(st, FORKATTN_OK, "from_parents: %s (%s)", forkattn_status_string(st), forkattn_ctx_last_error(ctx));
  cr_assert_not_null(t);
  return t;
}

Test(trie, parents_shuffled_same_shape) {
  tc_rng rng = tc_rng_for("trie/parents_shuffled_same_shape");
  forkattn_ctx *ctx = tc_ctx_default("trie/parents_shuffled_same_shape");
  cr_assert_not_null(ctx);
  for (int it = 0; it < 30; it++) {
    const int64_t n = tc_randint(&rng, 1, 400), nroots = tc_randint(&rng, 0, 2) ? 1 : tc_randint(&rng, 1, n);
    int64_t *par = xi64(n), *len = xi64(n), *perm = xi64(n), *spar = xi64(n), *slen = xi64(n);
    random_tree(&rng, n, nroots, par, len);
    shuffle_tree(&rng, n, par, len, perm, spar, slen);
    const unsigned flags = nroots == 1 ? FORKATTN_TRIE_SINGLE_ROOT : 0;
    forkattn_trie *a = build_parents(ctx, n, par, len, flags), *b = build_parents(ctx, n, spar, slen, flags);
    check_parents(a, n, par, len);
    check_parents(b, n, spar, slen);
    cr_assert_eq(count_roots(a), nroots);
    interner in = {0};
    int64_t *ra = xi64(n), *rb = xi64(n);
    const int64_t na = canonical_roots(&in, a, ra), nb = canonical_roots(&in, b, rb);
    cr_assert_eq(na, nb);
    for (int64_t j = 0; j < na; j++) cr_assert_eq(ra[j], rb[j], "shuffled input gives another tree shape");
    cr_assert_eq(forkattn_trie_replicated_tokens(a), forkattn_trie_replicated_tokens(b));
    free(in.pool);
    free(in.where);
    free(ra);
    free(rb);
    forkattn_trie_free(a);
    forkattn_trie_free(b);
    free(par), free(len), free(perm), free(spar), free(slen);
  }
  forkattn_ctx_destroy(ctx);
}

/* ---- token-parent tries ---------------------------------------------------- */

/* Token-level trie of sequences, nodes numbered in order of first appearance. */
typedef struct token_trie {
  int64_t n, cap;
  int64_t *parent, *token, *first_kid, *next_sib;
  int64_t *id; /* per input token of the sequences: its trie node */
} token_trie;

static void token_trie_build(token_trie *tt, const seqs *s) {
  memset(tt, 0, sizeof *tt);
  tt->cap = s->ntok;
  tt->parent = xi64(tt->cap);
  tt->token = xi64(tt->cap);
  tt->first_kid = xi64(tt->cap);
  tt->next_sib = xi64(tt->cap);
  tt->id = xi64(s->ntok);
  int64_t root_first = -1;
  for (int64_t q = 0; q < s->n; q++) {
    int64_t cur = -1;
    for (int64_t g = s->off[q]; g < s->off[q + 1]; g++) {
      int64_t *link = cur < 0 ? &root_first : &tt->first_kid[cur], c = *link;
      while (c >= 0 && tt->token[c] != s->tok[g]) c = tt->next_sib[c];
      if (c < 0) {
        c = tt->n++;
        tt->parent[c] = cur;
        tt->token[c] = s->tok[g];
        tt->first_kid[c] = -1;
        tt->next_sib[c] = *link;
        *link = c;
      }
      tt->id[g] = cur = c;
    }
  }
}

static void token_trie_free(token_trie *tt) {
  free(tt->parent), free(tt->token), free(tt->first_kid), free(tt->next_sib), free(tt->id);
}

/* Properties of a trie built from token parents tp[n]. */
static void check_token_parents(const forkattn_trie *t, int64_t n, const int64_t *tp) {
  shape sh;
  check_layout(t, &sh);
  cr_assert_eq(sh.T, n);
  cr_assert_null(forkattn_trie_row_tokens(t));
  cr_assert_null(forkattn_trie_input_nodes(t));
  const int64_t *in = forkattn_trie_input_rows(t), *rpos = forkattn_trie_row_positions(t),
                *rnode = forkattn_trie_row_nodes(t);
  char *seen = xcalloc((size_t)n, 1);
  int64_t *nkids = xi64(n);
  for (int64_t u = 0; u < n; u++) {
    cr_assert(in[u] >= 0 && in[u] < n && !seen[in[u]], "input_rows is not a permutation at token %lld", (long long)u);
    seen[in[u]] = 1;
    if (tp[u] >= 0) nkids[tp[u]]++;
  }
  for (int64_t u = 0; u < n; u++) {
    const int64_t r = in[u], v = rnode[r];
    if (tp[u] < 0) {
      cr_assert_eq(rpos[r], 0, "first token %lld", (long long)u);
      cr_assert(r == sh.off[v] && sh.par[v] < 0, "first token %lld does not start a root", (long long)u);
      continue;
    }
    const int64_t pr = in[tp[u]];
    cr_assert_eq(rpos[r], rpos[pr] + 1, "token %lld", (long long)u);
    if (nkids[tp[u]] == 1 && r != sh.off[v]) {
      cr_assert_eq(pr, r - 1, "an only child continues its parent's node");
    } else {
      cr_assert(r == sh.off[v] && sh.par[v] == rnode[pr] && pr == sh.off[rnode[pr] + 1] - 1,
                "token %lld (row %lld) does not start a child of its parent's node", (long long)u, (long long)r);
      cr_assert(nkids[tp[u]] != 1, "an only child starts a node: not maximal");
    }
  }
  free(seen);
  free(nkids);
  shape_free(&sh);
}

Test(trie, token_parents_equal_sequences) {
  tc_rng rng = tc_rng_for("trie/token_parents_equal_sequences");
  forkattn_ctx *ctx = tc_ctx_default("trie/token_parents_equal_sequences");
  cr_assert_not_null(ctx);
  for (int it = 0; it < 40; it++) {
    const rl_params p = random_params(&rng, 40);
    seqs all, s;
    gen_rl(&rng, &p, &all);
    /* keep the root-to-leaf paths: drop prefixes of other sequences and repeats */
    token_trie tt;
    token_trie_build(&tt, &all);
    char *taken = xcalloc((size_t)tt.n, 1);
    seqs_init(&s);
    for (int64_t q = 0; q < all.n; q++) {
      const int64_t leaf = tt.id[all.off[q + 1] - 1];
      if (tt.first_kid[leaf] >= 0 || taken[leaf]) continue;
      taken[leaf] = 1;
      for (int64_t g = all.off[q]; g < all.off[q + 1]; g++) seqs_push(&s, all.tok[g]);
      seqs_end(&s);
    }
    free(taken);
    token_trie_free(&tt);
    token_trie_build(&tt, &s);
    cr_assert_eq(tt.n, brute_force_rows(&s));

    forkattn_trie *a = build_seqs(ctx, &s, 0), *b = NULL;
    forkattn_status st = forkattn_trie_from_token_parents(ctx, tt.n, tt.parent, 0, &b);
    cr_assert_eq(st, FORKATTN_OK, "from_token_parents: %s (%s)", forkattn_status_string(st),
                 forkattn_ctx_last_error(ctx));
    check_sequences(a, &s);
    check_token_parents(b, tt.n, tt.parent);
    const forkattn_tree_layout la = tc_trie_layout(a), lb = tc_trie_layout(b);
    cr_assert_eq(la.num_nodes, lb.num_nodes);
    for (int64_t i = 0; i < la.num_nodes; i++) {
      cr_assert_eq(la.node_offsets[i + 1], lb.node_offsets[i + 1], "node %lld", (long long)i);
      cr_assert_eq(la.parents[i], lb.parents[i], "node %lld", (long long)i);
    }
    const int64_t *ia = forkattn_trie_input_rows(a), *ib = forkattn_trie_input_rows(b);
    for (int64_t g = 0; g < s.ntok; g++) cr_assert_eq(ia[g], ib[tt.id[g]], "input token %lld", (long long)g);
    cr_assert_eq(forkattn_trie_replicated_tokens(a), forkattn_trie_replicated_tokens(b));
    forkattn_trie_free(b);

    /* the same tree with tokens numbered at random: same shape and counts */
    int64_t *perm = xi64(tt.n), *sp = xi64(tt.n), *ones = xi64(tt.n), *sl = xi64(tt.n);
    for (int64_t u = 0; u < tt.n; u++) ones[u] = 1;
    shuffle_tree(&rng, tt.n, tt.parent, ones, perm, sp, sl);
    st = forkattn_trie_from_token_parents(ctx, tt.n, sp, 0, &b);
    cr_assert_eq(st, FORKATTN_OK, "from_token_parents (shuffled): %s (%s)", forkattn_status_string(st),
                 forkattn_ctx_last_error(ctx));
    check_token_parents(b, tt.n, sp);
    cr_assert_eq(tc_trie_layout(b).num_nodes, la.num_nodes);
    cr_assert_eq(forkattn_trie_replicated_tokens(b), forkattn_trie_replicated_tokens(a));
    interner in = {0};
    int64_t *ra = xi64(la.num_nodes), *rb = xi64(la.num_nodes);
    const int64_t na = canonical_roots(&in, a, ra), nb = canonical_roots(&in, b, rb);
    cr_assert_eq(na, nb);
    for (int64_t j = 0; j < na; j++) cr_assert_eq(ra[j], rb[j], "shuffled tokens give another tree shape");
    free(in.pool), free(in.where), free(ra), free(rb);
    free(perm), free(sp), free(ones), free(sl);
    forkattn_trie_free(a);
    forkattn_trie_free(b);
    token_trie_free(&tt);
    seqs_free(&s);
    seqs_free(&all);
  }
  forkattn_ctx_destroy(ctx);
}

Test(trie, forest_and_single_root) {
  tc_rng rng = tc_rng_for("trie/forest_and_single_root");
  forkattn_ctx *ctx = tc_ctx_default("trie/forest_and_single_root");
  cr_assert_not_null(ctx);
  for (int it = 0; it < 20; it++) {
    rl_params p = random_params(&rng, 30);
    p.nprompts = tc_randint(&rng, 2, 5);
    p.nseq = tc_randint(&rng, p.nprompts, 30);
    seqs s;
    gen_rl(&rng, &p, &s);
    int64_t distinct = 0; /* distinct first tokens */
    for (int64_t q = 0; q < s.n; q++) {
      int64_t e = 0;
      while (e < q && s.tok[s.off[e]] != s.tok[s.off[q]]) e++;
      distinct += e == q;
    }
    forkattn_trie *t = build_seqs(ctx, &s, 0), *u = SENTINEL;
    check_sequences(t, &s);
    cr_assert_eq(count_roots(t), distinct);
    forkattn_status st = forkattn_trie_from_sequences(ctx, s.n, s.off, s.tok, FORKATTN_TRIE_SINGLE_ROOT, &u);
    if (distinct > 1) {
      cr_assert_eq(st, FORKATTN_ERR_INVALID_ARGUMENT);
      cr_assert_null(u);
      cr_assert_not_null(strstr(forkattn_ctx_last_error(ctx), "FORKATTN_TRIE_SINGLE_ROOT"));
    } else {
      cr_assert_eq(st, FORKATTN_OK);
      forkattn_trie_free(u);
    }
    forkattn_trie_free(t);
    seqs_free(&s);

    const int64_t n = tc_randint(&rng, 2, 200), nroots = tc_randint(&rng, 1, 4);
    int64_t *par = xi64(n), *len = xi64(n);
    random_tree(&rng, n, nroots < n ? nroots : n, par, len);
    t = build_parents(ctx, n, par, len, 0);
    check_parents(t, n, par, len);
    cr_assert_eq(count_roots(t), nroots < n ? nroots : n);
    forkattn_trie_free(t);
    u = SENTINEL;
    st = forkattn_trie_from_parents(ctx, n, par, len, FORKATTN_TRIE_SINGLE_ROOT, &u);
    cr_assert_eq(st, nroots > 1 ? FORKATTN_ERR_INVALID_ARGUMENT : FORKATTN_OK);
    if (st == FORKATTN_OK) forkattn_trie_free(u);
    else cr_assert_null(u);
    u = SENTINEL;
    st = forkattn_trie_from_token_parents(ctx, n, par, FORKATTN_TRIE_SINGLE_ROOT, &u);
    cr_assert_eq(st, nroots > 1 ? FORKATTN_ERR_INVALID_ARGUMENT : FORKATTN_OK);
    if (st == FORKATTN_OK) {
      check_token_parents(u, n, par);
      forkattn_trie_free(u);
    } else {
      cr_assert_null(u);
      cr_assert_not_null(strstr(forkattn_ctx_last_error(ctx), "token_parents"));
    }
    free(par), free(len);
  }
  forkattn_ctx_destroy(ctx);
}

/* ---- deep and large inputs ------------------------------------------------- */

Test(trie, chains_of_100k) {
  tc_rng rng = tc_rng_for("trie/chains_of_100k");
  forkattn_ctx *ctx = tc_ctx_default("trie/chains_of_100k");
  cr_assert_not_null(ctx);
  const int64_t n = 100000;
  int64_t *par = xi64(2 * n), *len = xi64(2 * n);
  /* node chain, listed root first and leaf first */
  for (int rev = 0; rev < 2; rev++) {
    for (int64_t i = 0; i < n; i++) {
      par[i] = rev ? (i + 1 < n ? i + 1 : -1) : i - 1;
      len[i] = 1;
    }
    forkattn_trie *t = build_parents(ctx, n, par, len, FORKATTN_TRIE_SINGLE_ROOT);
    check_parents(t, n, par, len);
    const int64_t *map = forkattn_trie_input_nodes(t), *depth = forkattn_trie_node_depths(t);
    for (int64_t i = 0; i < n; i++) {
      cr_assert_eq(map[i], rev ? n - 1 - i : i);
      cr_assert_eq(depth[map[i]], map[i]);
    }
    cr_assert_eq(forkattn_trie_replicated_tokens(t), n);
    forkattn_trie_free(t);
  }
  /* token chain (one node) and a comb (a leaf off every token of a chain:
   * n nodes deep), tokens at random positions */
  for (int comb = 0; comb < 2; comb++) {
    const int64_t m = comb ? 2 * n : n;
    for (int64_t i = 0; i < n; i++) {
      par[i] = i - 1;
      if (comb) par[n + i] = i;
    }
    int64_t *perm = xi64(m), *sp = xi64(m), *sl = xi64(m), *ones = xi64(m);
    for (int64_t i = 0; i < m; i++) ones[i] = 1;
    shuffle_tree(&rng, m, par, ones, perm, sp, sl);
    forkattn_trie *t = NULL;
    const forkattn_status st = forkattn_trie_from_token_parents(ctx, m, sp, FORKATTN_TRIE_SINGLE_ROOT, &t);
    cr_assert_eq(st, FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    check_token_parents(t, m, sp);
    const forkattn_tree_layout l = tc_trie_layout(t);
    cr_assert_eq(l.num_nodes, comb ? 2 * n - 1 : 1);
    cr_assert_eq(forkattn_trie_replicated_tokens(t), comb ? n * (n + 1) / 2 + n : n);
    forkattn_trie_free(t);
    free(perm), free(sp), free(sl), free(ones);
  }
  /* one 100k-token rollout and rollouts branching off it at random points */
  seqs s;
  seqs_init(&s);
  for (int64_t j = 0; j < n; j++) seqs_push(&s, tc_randint(&rng, 0, 50000));
  seqs_end(&s);
  for (int q = 0; q < 12; q++) {
    const int64_t e = tc_randint(&rng, 0, q);
    seqs_copy(&s, e, tc_randint(&rng, 1, seq_len(&s, e) - 1));
    for (int64_t j = tc_randint(&rng, 1, 20); j > 0; j--) seqs_push(&s, -1 - tc_randint(&rng, 0, 3));
    seqs_end(&s);
  }
  forkattn_trie *t = build_seqs(ctx, &s, FORKATTN_TRIE_SINGLE_ROOT);
  check_sequences(t, &s);
  forkattn_trie_free(t);
  seqs_free(&s);
  free(par), free(len);
  forkattn_ctx_destroy(ctx);
}

Test(trie, large_grpo_group) {
  tc_rng rng = tc_rng_for("trie/large_grpo_group");
  forkattn_ctx *ctx = tc_ctx_default("trie/large_grpo_group");
  cr_assert_not_null(ctx);
  /* 64 rollouts of 20k tokens: a 4k-token prompt, then a tree of branches */
  const int64_t N = 64, L = 20000, P = 4096;
  seqs s;
  seqs_init(&s);
  for (int64_t q = 0; q < N; q++) {
    const int64_t e = q > 0 ? tc_randint(&rng, 0, q - 1) : -1, b = e < 0 ? 0 : tc_randint(&rng, P, L - 1);
    for (int64_t j = 0; j < L; j++)
      seqs_push(&s, j < P ? (int64_t)(j * 7919 % 32000) : j < b ? s.tok[s.off[e] + j] : tc_randint(&rng, 0, 31999));
    seqs_end(&s);
  }
  const double t0 = tc_now();
  forkattn_trie *t = build_seqs(ctx, &s, FORKATTN_TRIE_SINGLE_ROOT);
  const double secs = tc_now() - t0;
  cr_log_info("trie of %lld x %lld tokens: %lld rows, %lld nodes, dedup %.2fx, built in %.3f s", (long long)N,
              (long long)L, (long long)forkattn_trie_num_rows(t), (long long)tc_trie_layout(t).num_nodes,
              forkattn_trie_dedup_ratio(t), secs);
  cr_assert_lt(secs, 10.0, "building took %.3f s: not O(total tokens)", secs);
  check_sequences(t, &s);
  forkattn_trie_free(t);
  seqs_free(&s);
  forkattn_ctx_destroy(ctx);
}

/* ---- invalid arguments ----------------------------------------------------- */

static forkattn_ctx *err_ctx;

static void err_setup(void) {
  err_ctx = tc_ctx_default("trie/errors");
  cr_assert_not_null(err_ctx);
}
static void err_teardown(void) { forkattn_ctx_destroy(err_ctx); }

/* st must be INVALID_ARGUMENT, *trie NULL, and the message must contain every needle. */
static void expect_invalid(forkattn_status st, forkattn_trie *const *t, const char *needle1, const char *needle2) {
  const char *msg = forkattn_ctx_last_error(err_ctx);
  cr_assert_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "status %s (%s)", forkattn_status_string(st), msg);
  cr_assert_null(*t, "*trie was not set to NULL");
  cr_assert(msg && strstr(msg, needle1), "message \"%s\" does not name %s", msg, needle1);
  if (needle2) cr_assert(strstr(msg, needle2), "message \"%s\" does not mention %s", msg, needle2);
}

static const int64_t ok_off[4] = {0, 3, 5, 9}, ok_tok[9] = {1, 2, 3, 1, 2, 1, 2, 3, 4};
static const int64_t ok_par[5] = {-1, 0, 0, 1, 1}, ok_len[5] = {4, 1, 2, 3, 1};

static forkattn_status seq_call(int64_t n, const int64_t *off, const int64_t *tok, unsigned flags, forkattn_trie **t) {
  *t = SENTINEL;
  return forkattn_trie_from_sequences(err_ctx, n, off, tok, flags, t);
}
static forkattn_status par_call(int64_t n, const int64_t *par, const int64_t *len, unsigned flags, forkattn_trie **t) {
  *t = SENTINEL;
  return forkattn_trie_from_parents(err_ctx, n, par, len, flags, t);
}
static forkattn_status tok_call(int64_t n, const int64_t *par, unsigned flags, forkattn_trie **t) {
  *t = SENTINEL;
  return forkattn_trie_from_token_parents(err_ctx, n, par, flags, t);
}

TestSuite(trie_errors, .init = err_setup, .fini = err_teardown);

Test(trie_errors, valid_calls_and_error_cleared) {
  forkattn_trie *t;
  expect_invalid(seq_call(0, ok_off, ok_tok, 0, &t), &t, "num_sequences", NULL);
  cr_assert_eq(seq_call(3, ok_off, ok_tok, FORKATTN_TRIE_SINGLE_ROOT, &t), FORKATTN_OK);
  cr_assert_str_empty(forkattn_ctx_last_error(err_ctx), "a successful call clears the last error");
  forkattn_trie_free(t);
  cr_assert_eq(par_call(5, ok_par, ok_len, FORKATTN_TRIE_SINGLE_ROOT, &t), FORKATTN_OK);
  forkattn_trie_free(t);
  cr_assert_eq(tok_call(5, ok_par, FORKATTN_TRIE_SINGLE_ROOT, &t), FORKATTN_OK);
  forkattn_trie_free(t);
}

Test(trie_errors, null_context) {
  forkattn_trie *t = SENTINEL;
  cr_assert_eq(forkattn_trie_from_sequences(NULL, 3, ok_off, ok_tok, 0, &t), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(t);
  t = SENTINEL;
  cr_assert_eq(forkattn_trie_from_parents(NULL, 5, ok_par, ok_len, 0, &t), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(t);
  t = SENTINEL;
  cr_assert_eq(forkattn_trie_from_token_parents(NULL, 5, ok_par, 0, &t), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert_null(t);
}

Test(trie_errors, output_pointer_null) {
  forkattn_trie *const none = NULL;
  expect_invalid(forkattn_trie_from_sequences(err_ctx, 3, ok_off, ok_tok, 0, NULL), &none, "trie", "NULL");
  expect_invalid(forkattn_trie_from_parents(err_ctx, 5, ok_par, ok_len, 0, NULL), &none, "trie", "NULL");
  expect_invalid(forkattn_trie_from_token_parents(err_ctx, 5, ok_par, 0, NULL), &none, "trie", "NULL");
}

Test(trie_errors, unknown_flags) {
  forkattn_trie *t;
  expect_invalid(seq_call(3, ok_off, ok_tok, 2u, &t), &t, "flags", NULL);
  expect_invalid(par_call(5, ok_par, ok_len, 0x80000001u, &t), &t, "flags", NULL);
  expect_invalid(tok_call(5, ok_par, ~0u, &t), &t, "flags", NULL);
}

Test(trie_errors, seq_num_sequences) {
  forkattn_trie *t;
  expect_invalid(seq_call(0, ok_off, ok_tok, 0, &t), &t, "num_sequences", "0");
  expect_invalid(seq_call(-5, ok_off, ok_tok, 0, &t), &t, "num_sequences", "-5");
  expect_invalid(seq_call(INT64_MIN, ok_off, ok_tok, 0, &t), &t, "num_sequences", NULL);
}

Test(trie_errors, seq_offsets_null) {
  forkattn_trie *t;
  expect_invalid(seq_call(3, NULL, ok_tok, 0, &t), &t, "seq_offsets", "NULL");
}

Test(trie_errors, seq_tokens_null) {
  forkattn_trie *t;
  expect_invalid(seq_call(3, ok_off, NULL, 0, &t), &t, "tokens", "NULL");
}

Test(trie_errors, seq_first_offset_nonzero) {
  forkattn_trie *t;
  const int64_t off[3] = {1, 3, 5};
  expect_invalid(seq_call(2, off, ok_tok, 0, &t), &t, "seq_offsets[0]", "1");
}

Test(trie_errors, seq_empty_sequence) {
  forkattn_trie *t;
  const int64_t off[4] = {0, 3, 3, 5};
  expect_invalid(seq_call(3, off, ok_tok, 0, &t), &t, "seq_offsets", "sequence 1 is empty");
}

Test(trie_errors, seq_decreasing_offsets) {
  forkattn_trie *t;
  const int64_t off[4] = {0, 3, INT64_MAX, INT64_MIN};
  expect_invalid(seq_call(3, off, ok_tok, 0, &t), &t, "seq_offsets", "sequence 2");
}

Test(trie_errors, seq_single_root) {
  forkattn_trie *t;
  const int64_t tok[9] = {1, 2, 3, 1, 2, 7, 2, 3, 4};
  expect_invalid(seq_call(3, ok_off, tok, FORKATTN_TRIE_SINGLE_ROOT, &t), &t, "FORKATTN_TRIE_SINGLE_ROOT",
                 "sequence 2");
}

Test(trie_errors, par_num_nodes) {
  forkattn_trie *t;
  expect_invalid(par_call(0, ok_par, ok_len, 0, &t), &t, "num_nodes", "0");
  expect_invalid(par_call(-1, ok_par, ok_len, 0, &t), &t, "num_nodes", "-1");
}

Test(trie_errors, par_parents_null) {
  forkattn_trie *t;
  expect_invalid(par_call(5, NULL, ok_len, 0, &t), &t, "parents", "NULL");
}

Test(trie_errors, par_node_lengths_null) {
  forkattn_trie *t;
  expect_invalid(par_call(5, ok_par, NULL, 0, &t), &t, "node_lengths", "NULL");
}

Test(trie_errors, par_parent_out_of_range) {
  forkattn_trie *t;
  const int64_t hi[5] = {-1, 0, 0, 5, 1}, lo[5] = {-1, 0, -2, 1, 1}, min[5] = {-1, INT64_MIN, 0, 1, 1};
  expect_invalid(par_call(5, hi, ok_len, 0, &t), &t, "parents[3]", "5");
  expect_invalid(par_call(5, lo, ok_len, 0, &t), &t, "parents[2]", "-2");
  expect_invalid(par_call(5, min, ok_len, 0, &t), &t, "parents[1]", NULL);
}

Test(trie_errors, par_self_parent) {
  forkattn_trie *t;
  const int64_t par[5] = {-1, 0, 0, 1, 4};
  expect_invalid(par_call(5, par, ok_len, 0, &t), &t, "parents[4]", "itself");
}

Test(trie_errors, par_cycle) {
  forkattn_trie *t;
  /* a root with a child, and 2 -> 3 -> 4 -> 2 with 5 hanging off it */
  const int64_t par[6] = {-1, 0, 4, 2, 3, 3}, len[6] = {1, 1, 1, 1, 1, 1};
  expect_invalid(par_call(6, par, len, 0, &t), &t, "parents", "cycle");
  const char *msg = forkattn_ctx_last_error(err_ctx);
  cr_assert(strstr(msg, "node 2") || strstr(msg, "node 3") || strstr(msg, "node 4"), "\"%s\" names no cycle node", msg);
  const int64_t two[2] = {1, 0}; /* no root at all */
  expect_invalid(par_call(2, two, len, 0, &t), &t, "parents", "cycle");
}

Test(trie_errors, par_node_length_below_one) {
  forkattn_trie *t;
  const int64_t zero[5] = {4, 1, 0, 3, 1}, neg[5] = {4, 1, 2, 3, INT64_MIN};
  expect_invalid(par_call(5, ok_par, zero, 0, &t), &t, "node_lengths[2]", "0");
  expect_invalid(par_call(5, ok_par, neg, 0, &t), &t, "node_lengths[4]", NULL);
}

Test(trie_errors, par_lengths_overflow) {
  forkattn_trie *t;
  const int64_t len[5] = {4, INT64_MAX / 2, INT64_MAX / 2, 3, 1};
  expect_invalid(par_call(5, ok_par, len, 0, &t), &t, "node_lengths", "overflows");
}

Test(trie_errors, par_replicated_overflow) {
  forkattn_trie *t;
  /* 2^62 + 3 rows fit; three leaves below a 2^62-token root do not */
  const int64_t par[4] = {-1, 0, 0, 0}, len[4] = {(int64_t)1 << 62, 1, 1, 1};
  expect_invalid(par_call(4, par, len, 0, &t), &t, "replicated", "overflows");
}

Test(trie_errors, par_single_root) {
  forkattn_trie *t;
  const int64_t par[5] = {-1, 0, -1, 1, 2};
  expect_invalid(par_call(5, par, ok_len, FORKATTN_TRIE_SINGLE_ROOT, &t), &t, "FORKATTN_TRIE_SINGLE_ROOT",
                 "parents[2]");
}

Test(trie_errors, tok_num_tokens) {
  forkattn_trie *t;
  expect_invalid(tok_call(0, ok_par, 0, &t), &t, "num_tokens", "0");
  expect_invalid(tok_call(-3, ok_par, 0, &t), &t, "num_tokens", "-3");
}

Test(trie_errors, tok_token_parents_null) {
  forkattn_trie *t;
  expect_invalid(tok_call(5, NULL, 0, &t), &t, "token_parents", "NULL");
}

Test(trie_errors, tok_parent_out_of_range) {
  forkattn_trie *t;
  const int64_t par[5] = {-1, 0, 0, 1, INT64_MAX};
  expect_invalid(tok_call(5, par, 0, &t), &t, "token_parents[4]", NULL);
}

Test(trie_errors, tok_self_parent) {
  forkattn_trie *t;
  const int64_t par[5] = {-1, 0, 2, 1, 1};
  expect_invalid(tok_call(5, par, 0, &t), &t, "token_parents[2]", "itself");
}

Test(trie_errors, tok_cycle) {
  forkattn_trie *t;
  /* a plain cycle 2 -> 3 -> 4 -> 2 beside a valid chain */
  const int64_t plain[5] = {-1, 0, 4, 2, 3};
  expect_invalid(tok_call(5, plain, 0, &t), &t, "token_parents", "cycle");
  /* a cycle with branches: 1 -> 2 -> 3 -> 1, 4 and 5 hang off 2 */
  const int64_t branchy[6] = {-1, 3, 1, 2, 2, 2};
  expect_invalid(tok_call(6, branchy, 0, &t), &t, "token_parents", "cycle");
  const char *msg = forkattn_ctx_last_error(err_ctx);
  cr_assert(strstr(msg, "token 1") || strstr(msg, "token 2") || strstr(msg, "token 3"), "\"%s\" names no cycle token",
            msg);
}

Test(trie_errors, tok_single_root) {
  forkattn_trie *t;
  const int64_t par[5] = {-1, 0, 1, -1, 3};
  expect_invalid(tok_call(5, par, FORKATTN_TRIE_SINGLE_ROOT, &t), &t, "FORKATTN_TRIE_SINGLE_ROOT", "token_parents[3]");
}

Test(trie_errors, null_trie_accessors) {
  forkattn_trie_free(NULL);
  forkattn_tree_layout l = {7, NULL, NULL};
  cr_assert_eq(forkattn_trie_layout(NULL, &l), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_assert(l.num_nodes == 0 && !l.node_offsets && !l.parents);
  cr_assert_eq(forkattn_trie_num_rows(NULL), 0);
  cr_assert_eq(forkattn_trie_replicated_tokens(NULL), 0);
  cr_assert(forkattn_trie_dedup_ratio(NULL) == 0.0);
  cr_assert(!forkattn_trie_input_rows(NULL) && !forkattn_trie_input_nodes(NULL) && !forkattn_trie_row_nodes(NULL) &&
            !forkattn_trie_row_positions(NULL) && !forkattn_trie_node_depths(NULL) && !forkattn_trie_row_tokens(NULL));
}

/* ---- allocation failures --------------------------------------------------- */

/* Fail allocation 0, 1, 2, ... of one build until it succeeds; the result
 * must then equal an undisturbed build. Returns the failure points. */
static int alloc_sweep(forkattn_ctx *ctx, int which, const seqs *s, int64_t n, const int64_t *par,
                       const int64_t *len, const forkattn_trie *want) {
  const int64_t inputs = which == 0 ? s->ntok : which == 1 ? forkattn_trie_num_rows(want) : n;
  int k = 0;
  for (;; k++) {
    cr_assert_lt(k, 1000, "builder %d never succeeded", which);
    forkattn_trie *t = SENTINEL;
    forkattn_test_fail_alloc_after(k);
    const forkattn_status st = which == 0   ? forkattn_trie_from_sequences(ctx, s->n, s->off, s->tok, 0, &t)
                               : which == 1 ? forkattn_trie_from_parents(ctx, n, par, len, 0, &t)
                                            : forkattn_trie_from_token_parents(ctx, n, par, 0, &t);
    forkattn_test_fail_alloc_after(-1);
    if (st == FORKATTN_OK) {
      const forkattn_tree_layout a = tc_trie_layout(t), b = tc_trie_layout(want);
      cr_assert_eq(a.num_nodes, b.num_nodes);
      cr_assert(!memcmp(a.node_offsets, b.node_offsets, (size_t)(a.num_nodes + 1) * sizeof(int64_t)));
      cr_assert(!memcmp(a.parents, b.parents, (size_t)a.num_nodes * sizeof(int64_t)));
      cr_assert(!memcmp(forkattn_trie_input_rows(t), forkattn_trie_input_rows(want), (size_t)inputs * sizeof(int64_t)));
      forkattn_trie_free(t);
      return k;
    }
    cr_assert_eq(st, FORKATTN_ERR_OUT_OF_MEMORY, "builder %d, allocation %d: %s", which, k, forkattn_status_string(st));
    cr_assert_null(t, "builder %d, allocation %d: *trie not NULL", which, k);
    cr_assert_str_not_empty(forkattn_ctx_last_error(ctx));
  }
}

Test(trie, allocation_failures) {
  if (!forkattn_test_fail_alloc_after) cr_skip_test("needs a FORKATTN_ALLOC_TEST build of the library");
  tc_rng rng = tc_rng_for("trie/allocation_failures");
  forkattn_ctx *ctx = tc_ctx_default("trie/allocation_failures");
  cr_assert_not_null(ctx);
  rl_params p = random_params(&rng, 20);
  seqs s;
  gen_rl(&rng, &p, &s);
  forkattn_trie *want = build_seqs(ctx, &s, 0);
  int points = alloc_sweep(ctx, 0, &s, 0, NULL, NULL, want);
  forkattn_trie_free(want);
  const int64_t n = tc_randint(&rng, 2, 100);
  int64_t *par = xi64(n), *len = xi64(n);
  random_tree(&rng, n, 1, par, len);
  want = build_parents(ctx, n, par, len, 0);
  points += alloc_sweep(ctx, 1, &s, n, par, len, want);
  forkattn_trie_free(want);
  cr_assert_eq(forkattn_trie_from_token_parents(ctx, n, par, 0, &want), FORKATTN_OK);
  points += alloc_sweep(ctx, 2, &s, n, par, len, want);
  forkattn_trie_free(want);
  cr_log_info("%d allocation failure points", points);
  cr_assert_geq(points, 6);
  free(par), free(len);
  seqs_free(&s);
  forkattn_ctx_destroy(ctx);
}
