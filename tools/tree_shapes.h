/* Deterministic, seeded tree shapes for `forkattn bench tree`, packed in DFS
 * order (every subtree a contiguous range of nodes and rows) for
 * forkattn_tree_fwd(). Built without recursion, so any depth works. */
#ifndef FORKATTN_TOOLS_TREE_SHAPES_H
#define FORKATTN_TOOLS_TREE_SHAPES_H
#include <stdint.h>

#include "forkattn.h"

typedef enum tree_shape_kind {
  TREE_SHAPE_RL = 0, /* random RL trie: children hung under random nodes */
  TREE_SHAPE_WIDE,   /* long prompt, two shallow levels of many short branches */
  TREE_SHAPE_DEEP    /* multi-turn: every branch forks in two with probability 1/2 per turn */
} tree_shape_kind;

/* Sizes of a shape; -1 asks for the kind's default (tree_shape_defaults). */
typedef struct tree_shape_params {
  tree_shape_kind kind;
  int64_t prompt;           /* rows of the root */
  int64_t leaves;           /* rl, wide: leaves; deep: cap on leaves */
  int64_t min_seg, max_seg; /* rows of every other node, uniform in [min_seg, max_seg] */
  int64_t turns;            /* deep: levels below the root */
  int64_t seed;             /* same seed, same tree */
} tree_shape_params;

/* A packed tree plus what benchmarks derive from it (arrays owned). */
typedef struct tree_shape {
  forkattn_tree_layout layout; /* points into off and par */
  int64_t *off, *par;          /* num_nodes+1 row offsets, num_nodes packed parents */
  int64_t *anc;                /* rows of each node's ancestors (its rows' first position) */
  int64_t *leaf;               /* the leaves, in packed order */
  int64_t num_leaves, depth;   /* depth: most edges from the root to a leaf */
} tree_shape;

const char *tree_shape_name(tree_shape_kind k);
/* "rl" / "wide" / "deep": 0, or -1 for anything else (*out untouched). */
int tree_shape_parse_kind(const char *v, tree_shape_kind *out);
/* Replace the -1 fields by the kind's defaults. */
void tree_shape_defaults(tree_shape_params *p);
/* Generate and pack; 0, or -1 when memory runs out (*t then freed). */
int tree_shape_build(tree_shape *t, const tree_shape_params *p);
void tree_shape_free(tree_shape *t);

static inline int64_t tree_shape_rows(const tree_shape *t) { return t->off[t->layout.num_nodes]; }
static inline int64_t tree_shape_len(const tree_shape *t, int64_t node) { return t->off[node + 1] - t->off[node]; }
/* Nodes of the path root..node into path (room for depth+1); returns their count. */
int64_t tree_shape_path(const tree_shape *t, int64_t node, int64_t *path);
/* Visible (query row, key row) pairs of tree attention: a row at position j of
 * node x sees anc[x] + j + 1 keys. */
double tree_shape_pairs(const tree_shape *t);
/* Rows of all root-to-leaf paths laid end to end (the replicated batch). */
int64_t tree_shape_replicated_rows(const tree_shape *t);
#endif
