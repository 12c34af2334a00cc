/*
 * reference.h - float64 reference of shared-prompt and tree attention (tests only).
 *
 * The reference follows the REPLICATED formulation with a materialized
 * softmax, i.e. the computation the packed library call must be equivalent
 * to:
 *
 *  - The prompt alone (rows [0, P)) is one sequence. Its rows attend causally
 *    to the prompt (FORKATTN_MASK_CAUSAL) or to the whole prompt
 *    (FORKATTN_MASK_BIDIRECTIONAL). Prompt rows' o, lse and dq come from this
 *    sequence only: they never depend on the responses.
 *  - Response i is replicated as the sequence [prompt ; response i] of
 *    P + R_i rows (the prompt's q/k/v rows copied in front). Its rows attend
 *    with a standard causal mask over that sequence (causal), or to all of
 *    [prompt ; response i] (bidirectional). Their o, lse, dq come from this
 *    copy.
 *  - Gradients are those of sum(o * dout) over the packed rows. Each copy is
 *    differentiated with the copy's prompt rows carrying dout = 0 (the prompt
 *    rows' loss is counted once, in the prompt-alone sequence), so the dk/dv
 *    that a copy's prompt rows receive are exactly what response i's queries
 *    put there. The prompt's dk/dv = own part (prompt-only queries) + the sum
 *    over all copies. Since a copy's prompt queries have dout = 0 and their
 *    outputs are discarded, the reference does not evaluate them (see
 *    ref_attention_dense()'s q_begin); this changes no result.
 *  - N = 0 is the prompt alone; P = 0 is plain variable-length attention.
 *  - Fully masked rows cannot occur with these masks (every row sees at least
 *    itself); the only empty cases are empty sets of rows (P = 0 and/or
 *    R_i = 0 produce no rows at all). The dense kernel still implements the
 *    contract for a row with no visible key: o = 0, lse = -inf, no gradient.
 *  - GQA: query head h reads KV head h / (Hq / Hkv).
 *  - lse is the natural log of the softmax denominator of the scaled scores.
 *
 * Data given to the reference is contiguous float64: q, o, dout, dq are
 * [T, Hq, d] and k, v, dk, dv are [T, Hkv, d] (row-major), lse is [T, Hq].
 * ref_tensor_read() turns any strided forkattn_tensor (f32, bf16, f16) into
 * that format. Only the forkattn_tensor / layout types of forkattn.h are
 * used: the reference calls no library function.
 */
#ifndef FORKATTN_TESTS_REFERENCE_H
#define FORKATTN_TESTS_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- 16-bit floating point conversions (round to nearest, ties to even) -- */

/** The IEEE binary32 bits of @p f. */
uint32_t ref_float_bits(float f);
/** The float of IEEE binary32 bits @p u. */
float ref_bits_float(uint32_t u);

/** bfloat16 bits -> float (exact). */
float ref_bf16_to_float(uint16_t h);
/** float -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN. */
uint16_t ref_float_to_bf16(float f);
/** IEEE binary16 bits -> float (exact, subnormals included). */
float ref_f16_to_float(uint16_t h);
/** float -> binary16 bits, round to nearest even, overflow to inf, subnormals. */
uint16_t ref_float_to_f16(float f);
/** Round a double to the value the dtype stores (f32, bf16 or f16). */
double ref_round_to_dtype(double x, forkattn_dtype dtype);

/** Bytes per element of a dtype (0 for an unknown dtype). */
size_t ref_dtype_size(forkattn_dtype dtype);
/** Short name of a dtype ("f32", "bf16", "f16", "?"). */
const char *ref_dtype_name(forkattn_dtype dtype);

/* ---- strided tensors ------------------------------------------------------ */

/** Element offset (in elements) of (r, h, c) in @p t. */
int64_t ref_tensor_offset(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c);
/** Read element (r, h, c) of @p t as a double. */
double ref_tensor_get(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c);
/** Store @p x (rounded to nearest even for 16-bit types) at (r, h, c). */
void ref_tensor_set(const forkattn_tensor *t, int64_t r, int64_t h, int64_t c, double x);
/** Copy the whole tensor into contiguous [rows, heads, head_dim] doubles. */
void ref_tensor_read(const forkattn_tensor *t, double *out);
/** Store contiguous [rows, heads, head_dim] doubles into the tensor (rounded). */
void ref_tensor_write(const forkattn_tensor *t, const double *in);

/* ---- attention ------------------------------------------------------------ */

/** Total rows T = P + response_offsets[N] of a layout (-1 if inconsistent). */
int64_t ref_prefix_rows(const forkattn_prefix_layout *layout);

/**
 * Plain attention over ONE sequence of @p len rows with materialized softmax.
 *
 * Row i may see keys [0, end(i)):
 *   causal:        end(i) = i + 1;
 *   bidirectional: end(i) = prompt_len for i < prompt_len, len otherwise
 *   (the prompt part of the sequence sees only the prompt).
 * Only query rows [q_begin, len) are evaluated: o/lse/dq rows below q_begin
 * are left untouched and contribute nothing to dk/dv.
 *
 * q, dout: [len, hq, d]; k, v: [len, hkv, d]. o, lse: written (may be NULL).
 * When dout is non-NULL, dq is written (rows >= q_begin) and dk, dv
 * ([len, hkv, d]) are OVERWRITTEN with the gradients of sum(o * dout) over
 * the evaluated rows. Returns 0, or -1 on allocation failure / bad sizes.
 */
int ref_attention_dense(int64_t len, int64_t prompt_len, int64_t q_begin, forkattn_mask mask,
                        int64_t hq, int64_t hkv, int64_t d, double scale, const double *q,
                        const double *k, const double *v, const double *dout, double *o,
                        double *lse, double *dq, double *dk, double *dv);

/** Inputs of the shared-prompt reference (contiguous float64, see top). */
typedef struct ref_prefix_args {
  const forkattn_prefix_layout *layout;
  int64_t hq, hkv, d;
  double scale;
  const double *q, *k, *v; /* [T,hq,d], [T,hkv,d], [T,hkv,d] */
  const double *dout;      /* [T,hq,d], or NULL: forward only */
} ref_prefix_args;

/** Outputs of the shared-prompt reference; any may be NULL (not produced). */
typedef struct ref_prefix_out {
  double *o;   /* [T,hq,d] */
  double *lse; /* [T,hq] */
  double *dq;  /* [T,hq,d]   (needs args.dout) */
  double *dk;  /* [T,hkv,d]  (needs args.dout) */
  double *dv;  /* [T,hkv,d]  (needs args.dout) */
} ref_prefix_out;

/**
 * Shared-prompt attention forward (and backward when args->dout != NULL) in
 * the replicated formulation described at the top of this file.
 * Returns 0, or -1 on an inconsistent layout, bad sizes or allocation failure.
 */
int ref_prefix(const ref_prefix_args *args, const ref_prefix_out *out);

/** Inputs of the tree reference: same tensors as ref_prefix_args, T = node_offsets[n]. */
typedef struct ref_tree_args {
  const forkattn_tree_layout *tree;
  int64_t hq, hkv, d;
  double scale;
  const double *q, *k, *v;
  const double *dout; /* or NULL: forward only */
} ref_tree_args;

/**
 * Tree attention in the replicated formulation: for every node x, the sequence
 * [rows of x's ancestors, root first ; rows of x] runs plain causal attention
 * (ref_attention_dense) with only x's rows evaluated and carrying dout; x's
 * o, lse, dq come from it, and the copy's dk/dv are added to the rows they
 * were copied from. A node's dk/dv is thus its own part plus the sum over
 * every descendant, exactly as if every root-to-leaf path were trained as a
 * separate sequence. Returns 0, or -1 on a bad layout or allocation failure.
 */
int ref_tree(const ref_tree_args *args, const ref_prefix_out *out);

#ifdef __cplusplus
}
#endif
#endif /* FORKATTN_TESTS_REFERENCE_H */
