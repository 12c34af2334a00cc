/* Fuzz target: the rollout-trie builders (forkattn_trie_from_sequences,
 * _from_parents, _from_token_parents) on inputs decoded from the bytes, valid
 * and invalid: empty and decreasing offsets, huge offsets and lengths,
 * parents out of range, self-parents, cycles with and without branches,
 * several roots under FORKATTN_TRIE_SINGLE_ROOT, unknown flags, NULL pointers.
 *
 * An independent oracle written from include/forkattn.h predicts the verdict.
 * On success every property of the contract is checked (packed layout: DFS
 * order, node_offsets, parents, depths, row_nodes, row_positions; sequences
 * rebuilt from row_tokens through input_rows, each a root-to-node path, nodes
 * maximal, children largest first then in order of first appearance, row
 * count against a brute force; node and token parents: the packed tree is the input tree through the
 * input maps; replicated counts and dedup ratio). On failure the status must
 * be FORKATTN_ERR_INVALID_ARGUMENT, *trie NULL and the message non-empty.
 * Calls whose valid output would exceed a few MiB are not made.
 *
 * Input format (missing bytes read as 0; 0 is always a valid choice):
 *   mode     bits 0-1 builder (0 sequences, 1 node parents, 2 token parents, 3 sequences)
 *            bit2 FORKATTN_TRIE_SINGLE_ROOT   bit3 raw flags: the next 4 bytes (fz_u32)
 *            bit4 first array NULL (seq_offsets, parents, token_parents)
 *            bit5 second array NULL (tokens, node_lengths)   bit6 ctx NULL
 *            bit7 output pointer NULL
 *   (a count above the cap of its builder (256 sequences, 512 nodes, 1024 tokens) ends
 *   the input: its arrays could not be backed; a count < 1 is passed with arrays never read)
 *   sequences    N fz_int(1, 24); if N >= 1: offsets kind byte: even: N deltas
 *                fz_int(1, 12) from offsets[0] = 0 (wrapping), odd: N+1 raw fz_int(0, 64);
 *                alphabet 1 + byte % 8; one byte per token: byte < 0xF0: byte % alphabet,
 *                else fz_u64 (raw)
 *   node parents n fz_int(1, 24); if n >= 1: per node a parent (see fz_parent), then
 *                per node a length fz_int(1, 6); shuffle byte (0: input order kept)
 *   token parents n fz_int(1, 48); if n >= 1: per token a parent; shuffle byte
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define MAX_SEQS 256
#define MAX_TOKENS (1 << 16)  /* sequences: tokens backed */
#define MAX_NODES 512
#define MAX_TOKEN_NODES 1024
#define MAX_ROWS (1 << 18)    /* node parents: valid calls with more rows are not made */

static char sentinel_obj;
#define SENTINEL ((forkattn_trie *)(void *)&sentinel_obj)

static void *fz_xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  FZ_CHECK(p, "out of memory");
  return p;
}

static int64_t *i64s(int64_t n) { return fz_xcalloc((size_t)n, sizeof(int64_t)); }

/* Parent of entry i of n. tag < 0x80: -1 or an earlier entry (a tree when
 * every entry does this); < 0xC0: any value in [-1, n) (cycles, self);
 * < 0xE0: fz_extremes; else small negatives / raw bytes as in fz_int. */
static int64_t fz_parent(fz_reader *r, int64_t i, int64_t n) {
  const uint8_t tag = fz_u8(r);
  if (tag < 0x80) return i - 1 - (int64_t)(tag % (uint64_t)(i + 1));
  if (tag < 0xC0) return (int64_t)((tag - 0x80) % (uint64_t)(n + 1)) - 1;
  if (tag < 0xE0) return fz_extremes[tag - 0xC0];
  if (tag < 0xF0) return (int64_t)(tag & 15) - 8;
  return (int64_t)fz_u64(r);
}

/* Renumber entries with a permutation drawn from seed (0: identity); parents
 * inside [0, n) follow their entry, other values stay. */
static void fz_shuffle(uint8_t seed, int64_t n, int64_t *par, int64_t *len) {
  if (!seed) return;
  int64_t *perm = i64s(n), *p2 = i64s(n), *l2 = i64s(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < n; i++) perm[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t j = (int64_t)((x >> 33) % (uint64_t)(i + 1)), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int64_t i = 0; i < n; i++) {
    p2[perm[i]] = par[i] >= 0 && par[i] < n ? perm[par[i]] : par[i];
    if (len) l2[perm[i]] = len[i];
  }
  memcpy(par, p2, (size_t)n * sizeof(int64_t));
  if (len) memcpy(len, l2, (size_t)n * sizeof(int64_t));
  free(perm), free(p2), free(l2);
}

/* ---- oracle ---------------------------------------------------------------- */

/* Parent arrays: 1 when every entry is -1 or another entry, every entry
 * reaches a root, and (single_root) there is one root. */
static int oracle_tree(int64_t n, const int64_t *par, int single_root) {
  int64_t roots = 0;
  for (int64_t i = 0; i < n; i++) {
    if (par[i] < -1 || par[i] >= n || par[i] == i) return 0;
    roots += par[i] < 0;
  }
  if (single_root && roots != 1) return 0;
  /* state: 0 unknown, 1 on the current walk, 2 reaches a root */
  char *state = fz_xcalloc((size_t)n, 1);
  int ok = 1;
  for (int64_t i = 0; i < n && ok; i++) {
    int64_t u = i;
    while (u >= 0 && state[u] == 0) {
      state[u] = 1;
      u = par[u];
    }
    if (u >= 0 && state[u] == 1) ok = 0; /* came back to this walk: a cycle */
    for (int64_t v = i; v >= 0 && state[v] == 1; v = par[v]) state[v] = 2;
  }
  free(state);
  return ok;
}

/* Sum over leaves of root-to-leaf sums of len; -1 on overflow (a valid tree). */
static int64_t oracle_replicated(int64_t n, const int64_t *par, const int64_t *len) {
  char *inner = fz_xcalloc((size_t)n, 1);
  for (int64_t i = 0; i < n; i++)
    if (par[i] >= 0) inner[par[i]] = 1;
  int64_t sum = 0;
  for (int64_t i = 0; i < n && sum >= 0; i++) {
    if (inner[i]) continue;
    for (int64_t u = i; u >= 0 && sum >= 0; u = par[u])
      if (__builtin_add_overflow(sum, len ? len[u] : 1, &sum)) sum = -1;
  }
  free(inner);
  return sum;
}

/* ---- checks on a built trie ------------------------------------------------ */

typedef struct view {
  int64_t n, T;
  const int64_t *off, *par, *depth, *rnode, *rpos;
  int64_t *nkids, *kid_start, *kids; /* children by packed index; slot n: the roots */
  int64_t *size;                     /* subtree sizes in nodes */
} view;

static void view_free(view *v) { free(v->nkids), free(v->kid_start), free(v->kids), free(v->size); }

/* Children come largest subtree first (the smallest key among equals), then
 * in increasing key; roots in increasing key. */
static void check_child_order(const view *v, const int64_t *key, const char *what) {
  for (int64_t k = 0; k <= v->n; k++) {
    const int64_t a = v->kid_start[k], b = v->kid_start[k + 1];
    if (a == b) continue;
    if (k < v->n)
      for (int64_t j = a + 1; j < b; j++) {
        const int64_t c = v->kids[j], h = v->kids[a];
        FZ_CHECK(v->size[c] < v->size[h] || (v->size[c] == v->size[h] && key[c] > key[h]),
                 "children of %lld: first is not the largest (%s)", (long long)k, what);
      }
    for (int64_t j = (k < v->n ? a + 1 : a) + 1; j < b; j++)
      FZ_CHECK(key[v->kids[j - 1]] < key[v->kids[j]], "children of %lld out of order (%s)", (long long)k, what);
  }
}

static void check_layout(const forkattn_trie *t, view *v) {
  forkattn_tree_layout l;
  FZ_CHECK(forkattn_trie_layout(t, &l) == FORKATTN_OK, "forkattn_trie_layout failed");
  const int64_t n = l.num_nodes, *off = l.node_offsets, *par = l.parents;
  FZ_CHECK(n >= 1 && off && par, "layout: %lld nodes", (long long)n);
  FZ_CHECK(off[0] == 0, "node_offsets[0] = %lld", (long long)off[0]);
  for (int64_t i = 0; i < n; i++) {
    FZ_CHECK(off[i + 1] > off[i], "node %lld empty", (long long)i);
    FZ_CHECK(par[i] >= -1 && par[i] < i, "parents[%lld] = %lld", (long long)i, (long long)par[i]);
  }
  v->n = n;
  v->T = off[n];
  v->off = off;
  v->par = par;
  v->depth = forkattn_trie_node_depths(t);
  v->rnode = forkattn_trie_row_nodes(t);
  v->rpos = forkattn_trie_row_positions(t);
  FZ_CHECK(v->depth && v->rnode && v->rpos, "NULL row maps");
  FZ_CHECK(forkattn_trie_num_rows(t) == v->T, "num_rows %lld, node_offsets[n] %lld",
           (long long)forkattn_trie_num_rows(t), (long long)v->T);
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = par[i], pos0 = p < 0 ? 0 : v->rpos[off[p + 1] - 1] + 1;
    FZ_CHECK(v->depth[i] == (p < 0 ? 0 : v->depth[p] + 1), "node_depths[%lld]", (long long)i);
    for (int64_t r = off[i]; r < off[i + 1]; r++)
      FZ_CHECK(v->rnode[r] == i && v->rpos[r] == pos0 + r - off[i], "row %lld: node %lld position %lld", (long long)r,
               (long long)v->rnode[r], (long long)v->rpos[r]);
  }
  v->nkids = i64s(n + 1);
  v->kid_start = i64s(n + 2);
  v->kids = i64s(n);
  int64_t *size = v->size = i64s(n), *fill = i64s(n + 1);
  for (int64_t i = 0; i < n; i++) v->nkids[par[i] < 0 ? n : par[i]]++;
  for (int64_t k = 0; k <= n; k++) v->kid_start[k + 1] = v->kid_start[k] + v->nkids[k];
  for (int64_t i = 0; i < n; i++) {
    const int64_t k = par[i] < 0 ? n : par[i];
    v->kids[v->kid_start[k] + fill[k]++] = i;
  }
  for (int64_t i = n - 1; i >= 0; i--) {
    size[i] += 1;
    if (par[i] >= 0) size[par[i]] += size[i];
  }
  for (int64_t k = 0; k <= n; k++) { /* DFS: children follow their parent, subtrees contiguous */
    int64_t expect = k == n ? 0 : k + 1;
    for (int64_t j = v->kid_start[k]; j < v->kid_start[k + 1]; j++) {
      FZ_CHECK(v->kids[j] == expect, "DFS: child %lld of %lld, expected %lld", (long long)v->kids[j], (long long)k,
               (long long)expect);
      expect += size[v->kids[j]];
    }
    FZ_CHECK(expect == (k == n ? n : k + size[k]), "subtree of %lld not contiguous", (long long)k);
  }
  free(fill);
  const double ratio = forkattn_trie_dedup_ratio(t),
               want = (double)forkattn_trie_replicated_tokens(t) / (double)v->T;
  FZ_CHECK(ratio == want && ratio >= 1.0, "dedup ratio %.17g, want %.17g", ratio, want);
}

static void check_sequences(const forkattn_trie *t, int64_t N, const int64_t *off, const int64_t *tok) {
  view v;
  check_layout(t, &v);
  const int64_t *in = forkattn_trie_input_rows(t), *rtok = forkattn_trie_row_tokens(t);
  FZ_CHECK(in && rtok && !forkattn_trie_input_nodes(t), "sequence trie maps");
  FZ_CHECK(forkattn_trie_replicated_tokens(t) == off[N], "replicated %lld, tokens %lld",
           (long long)forkattn_trie_replicated_tokens(t), (long long)off[N]);
  int64_t *ends = i64s(v.n), *first = i64s(v.n), rows = 0;
  for (int64_t i = 0; i < v.n; i++) first[i] = -1;
  for (int64_t q = 0; q < N; q++) {
    const int64_t a = off[q], b = off[q + 1];
    for (int64_t g = a; g < b; g++) {
      const int64_t r = in[g];
      FZ_CHECK(r >= 0 && r < v.T && rtok[r] == tok[g] && v.rpos[r] == g - a, "sequence %lld token %lld: row %lld",
               (long long)q, (long long)(g - a), (long long)r);
    }
    const int64_t leaf = v.rnode[in[b - 1]];
    FZ_CHECK(in[b - 1] == v.off[leaf + 1] - 1, "sequence %lld ends inside node %lld", (long long)q, (long long)leaf);
    ends[leaf] = 1;
    int64_t g = b - 1;
    for (int64_t u = leaf; u >= 0; u = v.par[u]) {
      if (first[u] < 0) first[u] = q;
      for (int64_t r = v.off[u + 1] - 1; r >= v.off[u]; r--, g--)
        FZ_CHECK(g >= a && in[g] == r, "sequence %lld: not its root-to-node path", (long long)q);
    }
    FZ_CHECK(g == a - 1, "sequence %lld longer than its path", (long long)q);
    int64_t best = 0; /* brute force: rows shared with an earlier sequence */
    for (int64_t e = 0; e < q; e++) {
      int64_t k = 0;
      while (k < b - a && k < off[e + 1] - off[e] && tok[off[e] + k] == tok[a + k]) k++;
      best = k > best ? k : best;
    }
    rows += b - a - best;
  }
  FZ_CHECK(rows == v.T, "%lld rows, brute force %lld", (long long)v.T, (long long)rows);
  for (int64_t k = 0; k <= v.n; k++) {
    FZ_CHECK(k == v.n || v.nkids[k] >= 2 || ends[k], "node %lld not maximal", (long long)k);
    for (int64_t j = v.kid_start[k]; j < v.kid_start[k + 1]; j++) {
      const int64_t c = v.kids[j];
      for (int64_t i = v.kid_start[k]; i < j; i++)
        FZ_CHECK(rtok[v.off[c]] != rtok[v.off[v.kids[i]]], "siblings with the same first token");
    }
  }
  check_child_order(&v, first, "first appearance");
  free(ends), free(first);
  view_free(&v);
}

static void check_parents(const forkattn_trie *t, int64_t n, const int64_t *par, const int64_t *len) {
  view v;
  check_layout(t, &v);
  FZ_CHECK(v.n == n, "%lld nodes, input %lld", (long long)v.n, (long long)n);
  const int64_t *map = forkattn_trie_input_nodes(t), *in = forkattn_trie_input_rows(t);
  FZ_CHECK(map && in && !forkattn_trie_row_tokens(t), "node trie maps");
  int64_t *inverse = i64s(n), g = 0;
  for (int64_t i = 0; i < n; i++) inverse[i] = -1;
  for (int64_t i = 0; i < n; i++) {
    const int64_t p = map[i];
    FZ_CHECK(p >= 0 && p < n && inverse[p] < 0, "input_nodes[%lld] = %lld", (long long)i, (long long)p);
    inverse[p] = i;
    FZ_CHECK(v.par[p] == (par[i] < 0 ? -1 : map[par[i]]) && v.off[p + 1] - v.off[p] == len[i],
             "input node %lld: wrong parent or length", (long long)i);
    for (int64_t k = 0; k < len[i]; k++, g++) FZ_CHECK(in[g] == v.off[p] + k, "input_rows[%lld]", (long long)g);
  }
  check_child_order(&v, inverse, "input order");
  FZ_CHECK(forkattn_trie_replicated_tokens(t) == oracle_replicated(n, par, len), "replicated %lld, oracle %lld",
           (long long)forkattn_trie_replicated_tokens(t), (long long)oracle_replicated(n, par, len));
  free(inverse);
  view_free(&v);
}

static void check_token_parents(const forkattn_trie *t, int64_t n, const int64_t *tp) {
  view v;
  check_layout(t, &v);
  FZ_CHECK(v.T == n, "%lld rows for %lld tokens", (long long)v.T, (long long)n);
  const int64_t *in = forkattn_trie_input_rows(t);
  FZ_CHECK(in && !forkattn_trie_row_tokens(t) && !forkattn_trie_input_nodes(t), "token trie maps");
  int64_t *nkids = i64s(n), *owner = i64s(n);
  for (int64_t u = 0; u < n; u++) owner[u] = -1;
  for (int64_t u = 0; u < n; u++) {
    FZ_CHECK(in[u] >= 0 && in[u] < n && owner[in[u]] < 0, "input_rows not a permutation at %lld", (long long)u);
    owner[in[u]] = u;
    if (tp[u] >= 0) nkids[tp[u]]++;
  }
  for (int64_t u = 0; u < n; u++) {
    const int64_t r = in[u], node = v.rnode[r], starts = r == v.off[node];
    if (tp[u] < 0) {
      FZ_CHECK(starts && v.par[node] < 0, "first token %lld does not start a root", (long long)u);
      continue;
    }
    const int64_t pr = in[tp[u]];
    if (nkids[tp[u]] == 1)
      FZ_CHECK(!starts && pr == r - 1, "only child %lld does not continue its parent's node", (long long)u);
    else
      FZ_CHECK(starts && v.par[node] == v.rnode[pr] && pr == v.off[v.rnode[pr] + 1] - 1,
               "token %lld does not start a child of its parent's node", (long long)u);
  }
  FZ_CHECK(forkattn_trie_replicated_tokens(t) == oracle_replicated(n, tp, NULL), "replicated");
  int64_t *key = i64s(v.n); /* a node's first token */
  for (int64_t k = 0; k < v.n; k++) key[k] = owner[v.off[k]];
  check_child_order(&v, key, "first token index");
  free(key);
  free(nkids), free(owner);
  view_free(&v);
}

/* ---- one call ------------------------------------------------------------ */

typedef struct call {
  int builder, ctx_null, out_null;
  unsigned flags;
  int64_t n;               /* num_sequences / num_nodes / num_tokens */
  int64_t *a, *b;          /* seq_offsets + tokens / parents + node_lengths / token_parents */
  int a_null, b_null;
  int predicted;           /* 1: must succeed */
} call;

static void run_call(const call *c) {
  forkattn_ctx *ctx = c->ctx_null ? NULL : fz_cpu_ctx();
  forkattn_trie *t = SENTINEL, **out = c->out_null ? NULL : &t;
  const int64_t *a = c->a_null ? NULL : c->a, *b = c->b_null ? NULL : c->b;
  forkattn_status st = c->builder == 0   ? forkattn_trie_from_sequences(ctx, c->n, a, b, c->flags, out)
                       : c->builder == 1 ? forkattn_trie_from_parents(ctx, c->n, a, b, c->flags, out)
                                         : forkattn_trie_from_token_parents(ctx, c->n, a, c->flags, out);
  fz_stat.calls++;
  if (st != FORKATTN_OK) {
    FZ_CHECK(st == FORKATTN_ERR_INVALID_ARGUMENT, "builder %d: status %s (%s)", c->builder,
             forkattn_status_string(st), ctx ? forkattn_ctx_last_error(ctx) : "");
    FZ_CHECK(!c->predicted, "builder %d refused a valid input: %s", c->builder, forkattn_ctx_last_error(ctx));
    FZ_CHECK(c->out_null || t == NULL, "builder %d: *trie not NULL after an error", c->builder);
    FZ_CHECK(!ctx || forkattn_ctx_last_error(ctx)[0], "builder %d: no message", c->builder);
    fz_stat.invalid++;
    return;
  }
  FZ_CHECK(c->predicted, "builder %d accepted an invalid input", c->builder);
  fz_stat.ok++;
  if (c->builder == 0) check_sequences(t, c->n, c->a, c->b);
  else if (c->builder == 1) check_parents(t, c->n, c->a, c->b);
  else check_token_parents(t, c->n, c->a);
  forkattn_trie_free(t);
}

static int64_t wrap_add(int64_t x, int64_t y) { return (int64_t)((uint64_t)x + (uint64_t)y); }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_reader rd = {data, size, 0}, *r = &rd;
  call c;
  memset(&c, 0, sizeof c);
  const uint8_t mode = fz_u8(r);
  c.builder = (mode & 3) == 3 ? 0 : mode & 3;
  c.flags = mode & 4 ? FORKATTN_TRIE_SINGLE_ROOT : 0;
  if (mode & 8) c.flags = fz_u32(r);
  c.a_null = (mode >> 4) & 1;
  c.b_null = c.builder != 2 && ((mode >> 5) & 1);
  c.ctx_null = (mode >> 6) & 1;
  c.out_null = (mode >> 7) & 1;
  const int single = (c.flags & FORKATTN_TRIE_SINGLE_ROOT) != 0;
  int valid = !c.a_null && !c.b_null && !c.ctx_null && !c.out_null && !(c.flags & ~FORKATTN_TRIE_SINGLE_ROOT);

  if (c.builder == 0) {
    c.n = fz_int(r, 1, 24);
    if (c.n > MAX_SEQS) goto done; /* the offsets could not be backed */
    const int64_t N = c.n >= 1 ? c.n : 0;
    c.a = i64s(N + 1);
    if (N > 0 && fz_u8(r) % 2) {
      for (int64_t i = 0; i <= N; i++) c.a[i] = fz_int(r, 0, 64);
    } else {
      for (int64_t i = 0; i < N; i++) c.a[i + 1] = wrap_add(c.a[i], fz_int(r, 1, 12));
    }
    int offsets_ok = N > 0 && c.a[0] == 0;
    for (int64_t i = 0; i < N && offsets_ok; i++) offsets_ok = c.a[i + 1] > c.a[i];
    valid = valid && offsets_ok;
    /* tokens back the claimed count; a valid call claiming more is not made */
    if (offsets_ok && c.a[N] > MAX_TOKENS) goto done;
    const int64_t ntok = c.a[N] > 0 && c.a[N] <= MAX_TOKENS ? c.a[N] : 0;
    c.b = i64s(ntok);
    const int64_t alphabet = 1 + fz_u8(r) % 8;
    for (int64_t g = 0; g < ntok; g++) {
      const uint8_t x = fz_u8(r);
      c.b[g] = x < 0xF0 ? x % alphabet : (int64_t)fz_u64(r);
    }
    if (offsets_ok && single)
      for (int64_t q = 1; q < N; q++) valid = valid && c.b[c.a[q]] == c.b[0];
    if (N == 0) valid = 0; /* num_sequences < 1: arrays of one entry, never read */
  } else {
    const int nodes = c.builder == 1;
    c.n = nodes ? fz_int(r, 1, 24) : fz_int(r, 1, 48);
    if (c.n > (nodes ? MAX_NODES : MAX_TOKEN_NODES)) goto done; /* could not be backed */
    const int64_t n = c.n >= 1 ? c.n : 0;
    c.a = i64s(n);
    c.b = nodes ? i64s(n) : NULL;
    for (int64_t i = 0; i < n; i++) c.a[i] = fz_parent(r, i, n);
    int lengths_ok = 1;
    int64_t rows = 0;
    for (int64_t i = 0; nodes && i < n; i++) {
      c.b[i] = fz_int(r, 1, 6);
      if (c.b[i] < 1 || __builtin_add_overflow(rows, c.b[i], &rows)) lengths_ok = 0;
    }
    fz_shuffle(fz_u8(r), n, c.a, c.b);
    const int tree_ok = n > 0 && lengths_ok && oracle_tree(n, c.a, single);
    valid = valid && tree_ok && oracle_replicated(n, c.a, c.b) >= 0;
    if (tree_ok && nodes && rows > MAX_ROWS && oracle_replicated(n, c.a, c.b) >= 0) goto done;
  }
  c.predicted = valid;
  run_call(&c);
done:
  free(c.a);
  free(c.b);
  return 0;
}
