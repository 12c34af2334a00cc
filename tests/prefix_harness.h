/*
 * prefix_harness.h - runs forkattn_prefix_fwd/bwd (or forkattn_tree_fwd/bwd)
 * on one shape in one memory layout and checks it against the float64
 * reference (tests only).
 *
 * Flow of one check: make_inputs() draws q, k, v, dout (rounded to the
 * dtype, so the reference sees exactly the values the library sees);
 * ph_reference() computes the float64 reference; ph_run() lays the inputs out
 * in the requested layout, poisons the outputs (guards around every buffer),
 * calls forward then backward (backward consumes the library's own o and
 * lse), checks guards, that every output element was written, that inputs are
 * unchanged and that nothing is NaN/inf, and converts outputs to doubles;
 * ph_check() compares with the reference under the case's tolerances.
 */
#ifndef FORKATTN_TESTS_PREFIX_HARNESS_H
#define FORKATTN_TESTS_PREFIX_HARNESS_H

#include <stdint.h>

#include "forkattn.h"
#include "test_common.h"

#define PH_MAX_RESPONSES 64

/** How the tensors of one call are laid out in memory. */
typedef enum ph_layout {
  PH_CONTIGUOUS = 0, /* every tensor its own contiguous [T, H, d] buffer */
  PH_QKV_PACKED = 1, /* q,k,v in one [T, Hq+2Hkv, d] buffer, dq,dk,dv likewise */
  PH_STRIDED = 2     /* padded rows and heads everywhere; o and dq head-major */
} ph_layout;

/** One shape. lens[] holds the N response lengths. */
typedef struct ph_case {
  int64_t P, N;
  int64_t lens[PH_MAX_RESPONSES];
  int64_t hq, hkv, d;
  forkattn_mask mask;
  forkattn_dtype dtype;
  double q_amp;  /* q ~ U[-q_amp, q_amp] (0: 4.0); k, v, dout ~ U[-1, 1] */
  double scale;  /* softmax scale (0: 1/sqrt(d)) */
  int zero_q;    /* q = 0 exactly (uniform attention) */
} ph_case;

/** Tolerances (0 means "use the dtype default"). */
typedef struct ph_tol {
  double o_rel, lse_abs, grad_rel;
} ph_tol;

/** The inputs of one shape, rounded to the dtype, as contiguous doubles. */
typedef struct ph_inputs {
  forkattn_prefix_layout layout;
  const forkattn_tree_layout *tree; /* non-NULL: a tree case (layout unused; caller owns it) */
  int64_t off[PH_MAX_RESPONSES + 1];
  int64_t T, hq, hkv, d;
  forkattn_dtype dtype;
  double scale;
  double *q, *k, *v, *dout;
} ph_inputs;

/** Outputs as contiguous doubles (reference or library). */
typedef struct ph_outputs {
  double *o, *lse, *dq, *dk, *dv;
} ph_outputs;

/** One-line description of a case (for logs). */
void ph_describe(const ph_case *c, char *buf, size_t size);
/** Draw the inputs of @p c. */
void ph_make_inputs(ph_inputs *in, const ph_case *c, tc_rng *rng);
/** Draw inputs for tree attention over @p tree (kept by pointer: keep it alive);
 *  q ~ U[-q_amp, q_amp] (0: 4.0), k, v, dout ~ U[-1, 1], scale 1/sqrt(d). */
void ph_make_tree_inputs(ph_inputs *in, const forkattn_tree_layout *tree, int64_t hq, int64_t hkv,
                         int64_t d, forkattn_dtype dtype, double q_amp, tc_rng *rng);
void ph_free_inputs(ph_inputs *in);
/** Float64 reference of @p in (prints its run time). */
void ph_reference(ph_outputs *ref, const ph_inputs *in);
/**
 * Run the library on @p in laid out as @p lay. Every contract check (status,
 * guards, all elements written, inputs unchanged, finite) is a Criterion
 * expectation labelled with @p label. With @p do_bwd == 0 only the forward
 * runs (dq, dk, dv are left NULL).
 */
void ph_run(ph_outputs *got, const ph_inputs *in, ph_layout lay, int do_bwd, forkattn_ctx *ctx,
            const char *label);
void ph_free_outputs(ph_outputs *o);
/** Compare @p got with @p ref (Criterion expectations, one log line per tensor). */
void ph_check(const ph_outputs *got, const ph_outputs *ref, const ph_inputs *in, ph_tol tol,
              const char *label);
/** Default tolerances of a dtype (see the justification in prefix_harness.c). */
ph_tol ph_default_tol(forkattn_dtype dtype);

/**
 * The whole flow on one case in the contiguous layout, forward and backward,
 * with a context of default options. @p tol fields that are 0 take the
 * dtype's defaults.
 */
void ph_run_case(const char *name, const ph_case *c, ph_tol tol);

#endif /* FORKATTN_TESTS_PREFIX_HARNESS_H */
