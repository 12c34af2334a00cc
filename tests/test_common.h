/*
 * test_common.h - helpers shared by the forkattn tests: seeded RNG, tensor
 * buffers with guard regions and poisoned outputs, error metrics, and the
 * "where did this run" line.
 */
#ifndef FORKATTN_TESTS_COMMON_H
#define FORKATTN_TESTS_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "forkattn_experimental.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- random numbers ------------------------------------------------------- */

/** xoshiro256** state. */
typedef struct tc_rng {
  uint64_t s[4];
} tc_rng;

/**
 * The run's seed: FORKATTN_TEST_SEED from the environment when set (decimal or
 * 0x-hex), otherwise derived from the time and the process id. Computed once
 * per process.
 */
uint64_t tc_seed(void);

/**
 * RNG for one test: seeded from tc_seed() mixed with @p test_name (so tests
 * draw different data but one FORKATTN_TEST_SEED reproduces all of them).
 * Prints "[seed] FORKATTN_TEST_SEED=<seed> (<test_name>)" to stderr.
 */
tc_rng tc_rng_for(const char *test_name);
/** Seed an RNG directly (no printing). */
void tc_rng_init(tc_rng *rng, uint64_t seed);
uint64_t tc_next(tc_rng *rng);
/** Uniform double in [lo, hi). */
double tc_uniform(tc_rng *rng, double lo, double hi);
/** Uniform integer in [lo, hi]. */
int64_t tc_randint(tc_rng *rng, int64_t lo, int64_t hi);
/** Fill every element of @p t with U[lo, hi) rounded to its dtype. */
void tc_fill_tensor(tc_rng *rng, const forkattn_tensor *t, double lo, double hi);

/* ---- buffers with guards and poison --------------------------------------- */

/** Bytes of guard on each side of every test buffer. */
#define TC_GUARD_BYTES 4096
/** Byte pattern of guard regions and of gaps between a buffer's views. */
#define TC_GUARD_BYTE 0xA5
/** Poison bit patterns written to output elements before a call (NaNs with
 *  a payload no computation produces). */
#define TC_POISON_F32 0x7FBADBADu
#define TC_POISON_BF16 0x7FBDu
#define TC_POISON_F16 0x7DADu

/**
 * A host allocation of @c elems elements of one dtype with TC_GUARD_BYTES of
 * guard before and after. Views (tensors) over it mark which elements are
 * outputs; everything else (guards, gaps) must never change.
 */
typedef struct tc_buf {
  unsigned char *alloc;    /* guard + data + guard */
  size_t alloc_bytes;
  void *data;              /* first element */
  size_t elems;            /* elements in data */
  forkattn_dtype dtype;
  unsigned char *mark;     /* per element: 1 when part of a view */
  unsigned char *snapshot; /* copy of alloc taken by tc_buf_snapshot() */
} tc_buf;

/** Allocate (all guard pattern, no views). Returns 0, or -1. */
int tc_buf_alloc(tc_buf *b, size_t elems, forkattn_dtype dtype);
void tc_buf_free(tc_buf *b);
/**
 * A tensor over @p b starting at element @p offset with the given sizes and
 * strides; its elements are marked as view elements. The caller guarantees
 * it fits.
 */
forkattn_tensor tc_buf_view(tc_buf *b, int64_t offset, int64_t rows, int64_t heads,
                            int64_t head_dim, int64_t row_stride, int64_t head_stride);
/** A contiguous [rows, heads, head_dim] tensor filling a new buffer. */
forkattn_tensor tc_buf_contiguous(tc_buf *b, forkattn_dtype dtype, int64_t rows, int64_t heads,
                                  int64_t head_dim);
/** f32 buffer of @p n elements, all of them marked (for lse). */
float *tc_buf_f32(tc_buf *b, int64_t n);
/** Set guards/gaps to TC_GUARD_BYTE and every view element to the poison. */
void tc_buf_poison(tc_buf *b);

/** The outputs of one attention forward and backward, each in its own guarded buffer. */
enum { TC_OUT_O, TC_OUT_LSE, TC_OUT_DQ, TC_OUT_DK, TC_OUT_DV, TC_NOUT };
/** "o", "lse", "dq", "dk", "dv": the names of the TC_OUT_* buffers. */
extern const char *const tc_out_names[TC_NOUT];
typedef struct tc_attn_out {
  tc_buf buf[TC_NOUT];
  forkattn_tensor o, dq, dk, dv;
  float *lse;
} tc_attn_out;
/** Contiguous outputs of a problem of @p T rows, @p hq query and @p hkv key/value heads of
 *  @p head_dim. Returns 0, or -1 when out of memory (tc_attn_out_free() it either way). */
int tc_attn_out_init(tc_attn_out *o, forkattn_dtype dtype, int64_t T, int64_t hq, int64_t hkv, int64_t head_dim);
void tc_attn_out_free(tc_attn_out *o);
/** Remember the current bytes (guards included). */
void tc_buf_snapshot(tc_buf *b);
/** Number of bytes that differ from the snapshot (0: untouched). */
size_t tc_buf_changed_bytes(const tc_buf *b);

/** Result of checking an output buffer after a call. */
typedef struct tc_write_check {
  size_t guard_bad;     /* guard/gap bytes not equal to TC_GUARD_BYTE */
  size_t unwritten;     /* view elements still holding the poison */
  size_t first_guard;   /* byte index (into alloc) of the first bad guard byte */
  size_t first_unwritten; /* element index of the first unwritten element */
} tc_write_check;
/** Check a buffer prepared with tc_buf_poison(). */
tc_write_check tc_buf_check(const tc_buf *b);

/* ---- error metrics -------------------------------------------------------- */

typedef struct tc_err {
  double max_abs;     /* max |got - want| (inf when a non-finite value mismatches) */
  double max_ref;     /* max |want| over finite want */
  double rel;         /* max_abs / max_ref (max_abs when max_ref == 0) */
  int64_t nonfinite;  /* got non-finite where want is finite, or mismatched inf */
  int64_t count;      /* elements compared */
  int64_t worst;      /* flat index (row-major [rows, heads, d]) of max_abs */
  double got, want;   /* values at worst */
} tc_err;

/** Compare tensor @p got with contiguous [rows, heads, head_dim] @p want. */
tc_err tc_compare_tensor(const forkattn_tensor *got, const double *want);
/** Compare @p n floats with doubles (equal infinities count as exact). */
tc_err tc_compare_f32(const float *got, const double *want, int64_t n);
/** Compare @p n doubles with doubles (equal infinities count as exact). */
tc_err tc_compare_f64(const double *got, const double *want, int64_t n);
/** Number of non-finite elements in a tensor / float array. */
int64_t tc_count_nonfinite_tensor(const forkattn_tensor *t);
int64_t tc_count_nonfinite_f32(const float *x, int64_t n);
/** Format one line "name: max_abs=... rel=... worst=[r,h,c] got=... want=...". */
void tc_err_format(char *buf, size_t size, const char *name, const tc_err *e, int64_t heads,
                   int64_t head_dim);

/* ---- layouts of tries, partitions and batch plans ------------------------- */

/** The trie's layout; fails the test when the accessor does. */
forkattn_tree_layout tc_trie_layout(const forkattn_trie *trie);
/** The layout of one part; fails the test when the accessor does. */
forkattn_tree_layout tc_partition_layout(const forkattn_partition *partition, int64_t part);
/** The layout of one batch; fails the test when the accessor does. */
forkattn_tree_layout tc_batch_plan_layout(const forkattn_batch_plan *plan, int64_t batch);

/* ---- context and misc ----------------------------------------------------- */

/**
 * Print where a context runs: "[ran on device] <reason>" when its backend is
 * FORKATTN_BACKEND_GPU, "[ran on host] <reason>" otherwise (stderr).
 */
void tc_print_where(const forkattn_ctx *ctx, const char *test_name);
/**
 * Create a context with the default options and print where it runs.
 * Returns NULL (after printing the status) on failure.
 */
forkattn_ctx *tc_ctx_default(const char *test_name);
/**
 * A default context on the GPU backend, or the calling Criterion test is
 * skipped (and says so) when the context runs on the host. For tests that
 * need device memory or GPU kernels.
 */
forkattn_ctx *tc_gpu_ctx_or_skip(const char *test_name);
/** Monotonic wall clock in seconds. */
double tc_now(void);

#ifdef __cplusplus
}
#endif
#endif /* FORKATTN_TESTS_COMMON_H */
