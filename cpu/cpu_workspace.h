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

/* A kernel's scratch floats from its tile-size formula evaluated in double
 * (exact below 2^53): -1 above that, where the int64 products of an absurd
 * GQA group could have wrapped to a small count; no machine has 2^55 bytes
 * for one thread's tiles anyway. */
static inline int64_t fa_cpu_ws_floats(double n) { return n >= 0 && n < 0x1p53 ? (int64_t)n : -1; }

/* 64-byte aligned allocation of cap floats; returns 0 or -1 (also for cap < 0). */
static inline int fa_cpu_ws_init(fa_cpu_ws *w, int64_t cap) {
  w->used = 0;
  w->base = NULL;
  if (cap < 0 || cap > INT64_MAX - 15) return -1;
  w->cap = (cap + 15) & ~(int64_t)15;
  size_t bytes;
  if (__builtin_mul_overflow((size_t)w->cap, sizeof(float), &bytes)) return -1;
  w->base = fa_aligned_alloc(bytes);
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
