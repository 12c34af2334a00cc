/* Per-thread scratch of the CPU kernels: one malloc per thread per call. */
#ifndef FORKATTN_CPU_WORKSPACE_H
#define FORKATTN_CPU_WORKSPACE_H
#include "alloc.h"
#include <stdint.h>
#include <stdlib.h>

typedef struct fa_cpu_ws {
  float *base;
  int64_t used, cap;
} fa_cpu_ws;

/* 64-byte aligned allocation of cap floats; returns 0 or -1. */
static inline int fa_cpu_ws_init(fa_cpu_ws *w, int64_t cap) {
  w->used = 0;
  w->cap = (cap + 15) & ~(int64_t)15;
  w->base = fa_aligned_alloc(sizeof(float) * (size_t)w->cap);
  return w->base ? 0 : -1;
}

/* Carve n floats (64-byte aligned); the caller sized cap for every carve. */
static inline float *fa_cpu_ws_take(fa_cpu_ws *w, int64_t n) {
  float *p = w->base + w->used;
  w->used += (n + 15) & ~(int64_t)15;
  return p;
}

static inline void fa_cpu_ws_free(fa_cpu_ws *w) { fa_free(w->base); }

#endif
