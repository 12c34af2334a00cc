/* Segment plan: the one description every attention layout compiles to.
 *
 * Rows are packed once. A segment is a contiguous row range. A pair (qs, ks,
 * causal) says: queries of segment qs attend to keys of segment ks, all of
 * them (full) or those at key rows <= the query's row (causal, compared in
 * the key rows' frame: query row r sits at key row r + qshift). A query row's
 * softmax runs over the union of its pairs' visible keys (one online
 * softmax). Prefix-shared attention is a tree of depth one, a trie is the
 * general case, bidirectional masks are full pairs.
 *
 * Queries and keys usually share one row space (qshift = 0). A query block
 * appended after cached keys (a DFS path stack, a prefix KV cache) has its own
 * rows: query segments index the query tensors, key segments the key tensors,
 * and qshift places query row 0 among the keys.
 *
 * Backward needs the inverse view: for each key segment the pairs that read
 * it, so dK/dV of a shared segment is summed over all its readers without
 * races (one owner per key block). A pair may read a part of another key
 * segment (a tree node reading an ancestor's chain up to that ancestor): its
 * own key segment is then a view inside that owner segment, and the inverse
 * view lists it under the owner, whose key blocks are cut where a view
 * begins or ends (fa_plan_blocks), so a reader sees all of a key block or
 * none of it. */
#ifndef FORKATTN_SEGMENT_PLAN_H
#define FORKATTN_SEGMENT_PLAN_H
#include <stdint.h>

typedef struct fa_range {
  int64_t start, len;
} fa_range;

typedef struct fa_pair {
  int64_t qseg, kseg, causal;
} fa_pair;

struct fa_plan_memo;

typedef struct fa_plan {
  int64_t rows;        /* query rows (= key rows unless queries have their own space) */
  int64_t qshift;      /* key-frame row of query row 0 (causal pairs) */
  int64_t nseg;        /* segments */
  fa_range *seg;       /* [nseg] */
  int64_t npairs;      /* pairs, grouped by query segment */
  fa_pair *pair;       /* [npairs] */
  int64_t *q_pair_off; /* [nseg+1]: pairs of query segment s are pair[q_pair_off[s]..q_pair_off[s+1]) */
  int64_t *k_pair_off; /* [nseg+1]: CSR over k_pair_idx by owning key segment (a view's owner) */
  int64_t *k_pair_idx; /* [npairs]: pair indices grouped by owning key segment */
  /* Derived data kept with the plan (fa_plan_blocks_memo): a cache, so it may
   * grow through a const plan; freed by fa_plan_free. */
  struct fa_plan_memo *memo;
} fa_plan;

/* A block of rows inside one segment: queries (forward, dQ) or keys (dK/dV). */
typedef struct fa_block {
  int64_t seg, start, len; /* start is an absolute row */
} fa_block;

/* Keys the query blocks `blocks` [nblocks] see, summed over the blocks (each block's keys
 * through all its segment's pairs; a causal pair counted up to the block's last row). Blocks
 * from fa_plan_blocks_memo keep the sum with them: a cached plan's calls walk its pairs once. */
int64_t fa_plan_query_keys(const fa_plan *p, const fa_block *blocks, int64_t nblocks);
/* The fewest keys one of those blocks sees (INT64_MAX without blocks), kept with them the same way:
 * the backward asks whether some block takes its D from the inputs (rowsum_exact.h). */
int64_t fa_plan_fewest_query_keys(const fa_plan *p, const fa_block *blocks, int64_t nblocks);

/* Build the plan from segments and pairs (pairs must be grouped by qseg in
 * increasing order); qshift = 0. Copies the inputs. Returns 0, or -1 on
 * allocation failure. */
int fa_plan_build(fa_plan *p, int64_t rows, int64_t nseg, const fa_range *seg, int64_t npairs,
                  const fa_pair *pair);
/* The same with key views: owner[i] is the key segment that contains pair i's
 * key segment and owns its rows in the backward (owner NULL: every pair owns
 * its own; no segment read directly may overlap another's rows). */
int fa_plan_build_owned(fa_plan *p, int64_t rows, int64_t nseg, const fa_range *seg, int64_t npairs,
                        const fa_pair *pair, const int64_t *owner);
void fa_plan_free(fa_plan *p);

/* The chain rule of tree key segments, shared by the plan and the cost model:
 * near[i] = nearest non-empty ancestor of node i (-1 for none); cont[i] = 1 when
 * non-empty node i continues near[i]'s key segment: causal and starting where
 * near[i] ends (in DFS packing: near[i]'s first non-empty child; at most one
 * node does), so a run of nodes packed back to back down the tree is one
 * segment (a chain), read causally by its own nodes and, through a view up to
 * the branching node, by the other children's subtrees. A node has one pair
 * per chain on its root path: with the largest child packed first (the tries'
 * order) at most O(log nodes) chains, so the plan has O(nodes log nodes)
 * pairs instead of one per ancestor. With causal = 0 a node sees all its own
 * rows, so every node is its own key segment. kids: n int64 of scratch
 * (non-empty children per node on return). No allocation. */
void fa_tree_chains(int64_t n, const int64_t *off, const int64_t *parents, int causal, int64_t *near,
                    int64_t *kids, int64_t *cont);

/* Tree of n nodes: node i owns rows [off[i], off[i+1]) and reads all rows of
 * its ancestors (parents[i] < i, -1 for a root) and its own rows (causally
 * when causal != 0, else all of them). Pairs per node: one per chain on its
 * root path (fa_tree_chains); an ancestor's chain is read through a view up
 * to that ancestor. Empty nodes are dropped. */
int fa_plan_tree(fa_plan *p, int64_t n, const int64_t *off, const int64_t *parents, int causal);

/* Prefix-shared group, the depth-one tree: prompt [0, P), response i at
 * P + off[i] .. P + off[i+1]. causal != 0 for the causal mask. */
int fa_plan_prefix(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int causal);

/* Cached prefix: keys [0, P) are a prefix with no queries of its own (a KV
 * cache), response i's queries are rows [off[i], off[i+1]) of the query
 * tensors and its keys rows P + off[i] .. of the key tensors; qshift = P.
 * Response i reads the prefix (full) and its own keys (causally when causal
 * != 0). Empty responses are dropped. */
int fa_plan_prefix_cached(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int causal);

/* Block-causal variant (block diffusion): response i's rows form blocks of
 * `block` rows from its first row; block j's queries read the prefix and the
 * response's blocks 0..j, all of their keys: two pairs per block, the prefix
 * and a view of the response's keys up to the block's end (owned by the
 * response's key segment, whose backward key blocks are cut at every block
 * end, so each key row has one owner). block 1 (the causal mask) and a block
 * at least as long as every response (the bidirectional mask) build
 * fa_plan_prefix_cached's plan instead. Any block >= 1 works. */
int fa_plan_prefix_cached_blocks(fa_plan *p, int64_t prompt_len, int64_t n, const int64_t *off, int64_t block);

/* Split segments into blocks of at most block_rows rows, heaviest first.
 * by_key = 0: query blocks of segments that have pairs as queries;
 * by_key = 1: key blocks of segments read by at least one pair.
 * *out is malloc'ed (free() it); returns the count, or -1 on allocation failure. */
int64_t fa_plan_blocks(const fa_plan *p, int64_t block_rows, int by_key, fa_block **out);

/* fa_plan_blocks kept with the plan: the first call for (block_rows, by_key)
 * splits the plan, later ones return the same blocks, so a plan reused across
 * calls (the context's plan cache) is split once. *out belongs to the plan
 * (freed by fa_plan_free) and must not be modified: a caller that changes its
 * blocks takes fa_plan_blocks' own copy. Block sizes come from the kernels'
 * few fixed choices, so a plan keeps a handful. One thread at a time (a plan
 * serves one context); p comes from a fa_plan_* builder (they make its memo).
 * Returns the count, or -1 on allocation failure. */
int64_t fa_plan_blocks_memo(const fa_plan *p, int64_t block_rows, int by_key, const fa_block **out);

/* A query block with the first keys it sees, in 32-bit positions, for kernels that take an item's
 * start in one load: the block (seg, start, len), the first pair of its segment that gives it keys
 * (pi; pend: the segment's pair end; pi == pend when it sees none), those keys [kb, kend) and
 * that pair's causal flag. 32 bytes, two 16-byte copies. */
typedef struct fa_block_item {
  int32_t pi, pend, kb, kend, causal, seg, start, len;
} fa_block_item;

/* The items of query blocks `blocks` [nblocks] (from fa_plan_blocks_memo, by_key 0), kept with
 * them like the blocks, and in *see_keys (when not NULL) whether every one sees a key
 * (fa_block_items_see_keys, also kept). Returns nblocks; -1 on allocation failure or blocks the
 * plan does not keep; -2 when a position or index does not fit 32 bits. */
int64_t fa_plan_block_items_memo(const fa_plan *p, const fa_block *blocks, int64_t nblocks,
                                 const fa_block_item **out, int *see_keys);

/* 1 when every one of items [n] sees at least one key. */
int fa_block_items_see_keys(const fa_block_item *items, int64_t n);

/* 1 when a walk of p's pairs in tiles of bk keys meets a tile that hides keys from some query row
 * or holds fewer than bk keys: some pair is causal, or some pair's key segment is not a whole
 * number of tiles. The tensor-core kernels scan such tiles for non-finite rows. */
int fa_plan_has_partial_tiles(const fa_plan *p, int64_t bk);

/* A slice of one key block's readers, for splitting a heavily read block
 * (a shared prompt) over several GPU teams: the query rows of readers
 * k_pair_idx[j0..j1] (indices into k_pair_idx, inclusive) as fa_pair_queries
 * gives them, minus the first `lo` rows of reader j0, up to row `hi` of reader
 * j1 (exclusive; counted from that reader's first visible query). */
typedef struct fa_key_unit {
  int64_t block, j0, j1, lo, hi;
} fa_key_unit;

/* Cut the readers of every key block into units of about `chunk` query rows
 * (at least one unit per block; a block's units are contiguous and in reader
 * order, so summing their partial dK/dV in unit order is deterministic).
 * unit_off[b]..unit_off[b+1] are block b's units. *units and *unit_off are
 * malloc'ed (free() them); returns the unit count, or -1 on allocation failure. */
int64_t fa_plan_key_units(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t chunk,
                          fa_key_unit **units, int64_t **unit_off);

/* fa_plan_key_units for key blocks the plan keeps (from fa_plan_blocks_memo, by_key 1), kept with
 * them per chunk, so a cached plan's backward cuts its readers once (a trie's or many short
 * sequences' cut costs tens to hundreds of microseconds a call). *units and *unit_off belong to
 * the plan (freed by fa_plan_free) and must not be modified. One thread at a time, as
 * fa_plan_blocks_memo. Returns the unit count; -1 on allocation failure or blocks the plan does
 * not keep. */
int64_t fa_plan_key_units_memo(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t chunk,
                               const fa_key_unit **units, const int64_t **unit_off);

/* The chunk to give fa_plan_key_units so that the dK/dV work of `blocks`
 * spreads over `slots` teams running at once, when every key block is worked
 * by `teams_per_block` teams (KV heads x passes) of work proportional to its
 * reader rows: INT64_MAX (no block is split, so no partial sums) when no block
 * carries more than a slot's share of the total, else that share (at least
 * 64 rows: below a few query tiles a unit's partial sums cost more than the
 * balance saves). Its sums over key blocks the plan keeps are kept with them. */
int64_t fa_plan_key_chunk(const fa_plan *p, const fa_block *blocks, int64_t nblocks, int64_t teams_per_block,
                          int64_t slots);

#pragma omp declare target
/* Keys of pair pr visible to query rows [q0, q0+qn) (qn > 0): the whole key
 * segment, or for a causal pair those up to the last query's diagonal.
 * seg is the plan's segment array (host or device copy: CPU and GPU share this). */
static inline fa_range fa_pair_keys(const fa_range *seg, fa_pair pr, int64_t q0, int64_t qn, int64_t qshift) {
  fa_range k = seg[pr.kseg];
  if (pr.causal) {
    int64_t lim = q0 + qn + qshift - k.start; /* keys before the last query's diagonal + 1 */
    k.len = lim < k.len ? (lim > 0 ? lim : 0) : k.len;
  }
  return k;
}

/* Queries of pair pr that see at least one key of [k0, k0+kn) (kn > 0, a key
 * block of the pair's owner segment): none when the block lies outside the
 * pair's key segment (a view; blocks never straddle one), else the whole query
 * segment, or for a causal pair those at or after the block's first key's
 * diagonal. */
static inline fa_range fa_pair_queries(const fa_range *seg, fa_pair pr, int64_t k0, int64_t qshift) {
  fa_range q = seg[pr.qseg];
  const fa_range k = seg[pr.kseg];
  if (k0 < k.start || k0 >= k.start + k.len) {
    q.len = 0;
    return q;
  }
  if (pr.causal) {
    int64_t first = k0 - qshift - q.start;
    int64_t skip = first < 0 ? 0 : (first < q.len ? first : q.len);
    q.start += skip;
    q.len -= skip;
  }
  return q;
}
#pragma omp end declare target

#endif
