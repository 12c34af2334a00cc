/*
 * tree_builder.h - trees for the tests: build one node at a time (parent
 * index < own index, lengths), random RL tries, and pack in DFS or BFS order
 * into a forkattn_tree_layout with the row maps (tests only).
 */
#ifndef FORKATTN_TESTS_TREE_BUILDER_H
#define FORKATTN_TESTS_TREE_BUILDER_H

#include <stdint.h>

#include "forkattn.h"
#include "test_common.h"

/* A tree as the caller builds it: parent (< index, -1 for a root) and length of each node. */
typedef struct tt_tree {
  int64_t n;
  int64_t *parent, *len;
} tt_tree;

/* A packed layout plus the node order used. */
typedef struct tt_packed {
  forkattn_tree_layout layout;
  int64_t *off, *par;
  int64_t *order;       /* packed index -> tree node */
  int64_t *row_of_node; /* tree node -> its first packed row */
} tt_packed;

/* Room for cap nodes. */
void tt_init(tt_tree *t, int64_t cap);
/* Append a node; returns its index. */
int64_t tt_add(tt_tree *t, int64_t parent, int64_t len);
void tt_free(tt_tree *t);
/* Pack in DFS order (bfs = 0; children in index order, first child right after
 * its parent; iterative) or in BFS order (bfs = 1). */
void tt_pack(tt_packed *p, const tt_tree *t, int bfs);
void tt_packed_free(tt_packed *p);
/* Random RL trie: a prompt root, then children hung under random nodes until
 * the tree has `leaves` leaves; segment lengths in [1, max_seg]. */
void tt_random_trie(tt_tree *t, tc_rng *rng, int64_t prompt, int64_t leaves, int64_t max_seg);

#endif
