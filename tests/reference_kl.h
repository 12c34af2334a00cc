/*
 * reference_kl.h - float64 materialized reference of StreamKL (attention
 * distillation, forkattn_kl_fwd/bwd) and of kept-set attention
 * (forkattn_kept_fwd/bwd) (tests only).
 *
 * Everything is written from the definitions, with dense rows x keys
 * decisions per (row, head), and calls no library function:
 *
 *  - Visibility vis(i, j) of a layout (refkl_vis):
 *      prefix, prompt row i < P: causal j <= i, bidirectional j < P;
 *      prefix, row i of response n (rows [r0, r1)): j < P, or r0 <= j <= i
 *        (causal) / r0 <= j < r1 (bidirectional);
 *      tree, row i of node x: every row of every ancestor of x, and rows
 *        node_offsets[x] <= j <= i of x itself.
 *  - Kept set (refkl_kept): query head h uses kept head kh = h / (H / heads);
 *    key j is dropped for row i when block_mask[(kh*nb + i/64)*nb + j/64] == 0,
 *    or when lists are given, i >= query_start, j < compressed_rows and j is
 *    not in head kh's list. A NULL kept set keeps everything.
 *  - Teacher scores t_j = scale_t/tau * q_t[i,h].k_t[j, h/(H/Hkv_t)] over the
 *    teacher-visible keys vis(i, j); student scores s_j likewise over the
 *    student-visible keys vs(i, j) = vis(i, j) AND kept(h, i, j).
 *    T = softmax_vis(t), Tk = softmax_vs(t) (teacher renormalised on the kept
 *    keys), S = softmax_vs(s).
 *      forward: div = KL(Tk || S) = sum_{vs} Tk_j log(Tk_j / S_j)
 *      reverse: div = KL(S || T)  = sum_{vs} S_j log(S_j / T_j)
 *    kl = div * (tau^2 when scale_by_tau2, else 1); outside = 1 - sum_{vs} T_j.
 *    stats (FORKATTN_KL_STATS per (row, head)): [0] LSE_vs(t), [1] LSE_vs(s),
 *    [2] div, [3] LSE_vis(t). A row with no student-visible key: kl = 0,
 *    stats [0] = [1] = -inf, [2] = 0, [3] = LSE_vis(t); outside = 1 when it
 *    sees a teacher key (0 otherwise); zero gradients.
 *  - Backward of L = sum_{i,h} dkl[i,h] * kl[i,h], derived by hand:
 *      forward:  dL/ds_j = g (S_j - Tk_j),
 *                dL/dt_j = g Tk_j ((t_j - s_j) - E_Tk[t - s])   (j in vs; 0 else)
 *      reverse:  dL/dt_j = g (T_j - S_j)                       (j in vis; S_j = 0 off vs)
 *                dL/ds_j = g S_j ((s_j - t_j) - E_S[s - t])      (j in vs)
 *    with g = dkl[i,h] * mul, then through the dot products:
 *      dq_s[i,h] += dL/ds_j * scale_s/tau * k_s[j], dk_s[j] += dL/ds_j * scale_s/tau * q_s[i,h]
 *    (teacher likewise). The expectations are computed directly (sum over
 *    keys), not from div and the log-sum-exps as the library does.
 *  - Kept-set attention: softmax(scale * q.k) over vs(i, j), o = P v,
 *    lse = LSE; a row with no key: o = 0, lse = -inf, zero gradients;
 *    backward of sum(o * dout) with D = sum_j P_j dP_j computed in float64.
 *
 * Tensors are contiguous float64: q [T, H, d], k [T, Hkv, d] (row-major), as
 * ref_tensor_read() produces; kl, outside, lse [T, H]; stats [T, H, 4].
 */
#ifndef FORKATTN_TESTS_REFERENCE_KL_H
#define FORKATTN_TESTS_REFERENCE_KL_H

#include <stdint.h>

#include "forkattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Rows of a layout (exactly one of prefix/tree set), -1 when inconsistent. */
int64_t refkl_layout_rows(const forkattn_layout *layout);

/**
 * Dense visibility map of a layout: a malloc'ed [T, T] byte array with
 * vis[i*T + j] = 1 when row i sees key j (free() it). *rows receives T.
 * NULL on a bad layout or allocation failure (T = 0 gives a 1-byte block).
 */
unsigned char *refkl_vis(const forkattn_layout *layout, int64_t *rows);

/**
 * A kept set prepared for dense queries: per kept head, a keep byte map over
 * the compressed rows built from the CSR lists.
 */
typedef struct refkl_kept {
  const forkattn_kept_set *set; /* NULL: keeps everything */
  int64_t T, H, heads_div, nb;
  unsigned char *keep;          /* [heads, compressed_rows] or NULL */
} refkl_kept;

/** Prepare @p set (may be NULL) for T rows and H query heads. Returns 0 or -1. */
int refkl_kept_init(refkl_kept *k, const forkattn_kept_set *set, int64_t T, int64_t H);
void refkl_kept_free(refkl_kept *k);
/** Does query head h at row i keep key j (the layout's mask not included)? */
int refkl_kept_keeps(const refkl_kept *k, int64_t h, int64_t i, int64_t j);

/** Inputs of the StreamKL reference. */
typedef struct refkl_args {
  const forkattn_layout *layout;
  const forkattn_kept_set *kept; /* or NULL */
  int64_t H, hkv_t, hkv_s, dt, ds;
  double scale_t, scale_s;       /* resolved (> 0): 0 in the options is 1/sqrt(d) */
  double tau;
  int reverse, tau2;
  const double *qt, *kt, *qs, *ks;
  const double *dkl;             /* [T, H], or NULL: forward only */
} refkl_args;

/** Outputs of the StreamKL reference; any may be NULL. */
typedef struct refkl_out {
  double *kl;       /* [T, H] */
  double *stats;    /* [T, H, 4] */
  double *outside;  /* [T, H] */
  double *rscale;   /* [T, H] row error scale: max over the row's visible keys of
                       scale/tau * sum_c |q_c k_c| of either side (bounds the f32
                       rounding of a score: gamma_d * rscale) */
  double *cond;     /* [T, H] condition of div (before tau^2) under score rounding:
                       sum_j |d div/d t_j| A_t,j + |d div/d s_j| A_s,j with A the
                       row's scale/tau * sum_c |q_c k_c| of key j; rounding every
                       score by a relative gamma moves div by <= gamma * cond */
  double *dqs, *dks, *dqt, *dkt; /* need args.dkl; overwritten */
} refkl_out;

/** StreamKL forward (and backward with args->dkl). Returns 0, or -1. */
int refkl_run(const refkl_args *args, const refkl_out *out);

/** The loss sum_{i,h} w[i,h] * kl[i,h] of the reference forward (for finite
 *  differences). Returns NAN on failure. */
double refkl_loss(const refkl_args *args, const double *w);

/* ---- StreamKL test harness (Criterion expectations) ------------------------
 * klh_run(): draw teacher/student inputs (rounded to their dtypes, so the
 * reference sees exactly what the library sees), lay them out (contiguous or
 * strided: padded rows and heads, head-major), poison every output, run
 * forkattn_kl_fwd then forkattn_kl_bwd (on the library's own stats), check
 * status, guards, every output element written, inputs (and the backward's
 * stats) unchanged, no NaN, kl >= -1e-6, and compare kl, stats, outside_mass
 * and the gradients with the float64 reference.
 *
 * Tolerances (defaults; see reference_kl.c for the derivation):
 *   forward, per (row, head): |got - ref| <= c * (mul * (1 + R + cond) + |kl|)
 *     for kl (c f32 1e-5, bf16 1e-3), the same without mul for stats[2],
 *     c * (1 + R) for the log-sum-exps stats[0,1,3], c * (1 + 2R) for
 *     outside_mass; R = rscale, cond = the row's condition (refkl_out).
 *   gradients, per tensor: max|got - ref| / max|ref| <= 1e-4 * max(1, Rmax/8)
 *     (f32), 1e-2 (bf16). */
typedef struct klh_case {
  const char *name;
  forkattn_layout layout;        /* pointers kept by the caller */
  const forkattn_kept_set *kept; /* or NULL */
  int64_t H, hkv_t, hkv_s, dt, ds;
  forkattn_dtype dtype_t, dtype_s;
  double qamp_t, qamp_s;         /* q ~ U[-amp, amp] (0: 2); k ~ U[-1, 1] */
  double noise;                  /* > 0 (same shapes): student = teacher + noise * U[-1, 1] */
  int same;                      /* the student's tensors ARE the teacher's (same buffers) */
  forkattn_kl_options opt;       /* as given to the library (scales 0 = default) */
  int strided;                   /* padded / head-major tensors instead of contiguous */
  int teacher_grad;              /* also dq_t, dk_t */
  int no_bwd;                    /* forward only */
  double fwd_c, grad_tol;        /* 0: defaults above */
} klh_case;

typedef struct klh_result {
  double kl_min, kl_max_abs;  /* over the library's kl */
  double fwd_ratio;           /* worst |got - ref| / tol of the forward outputs */
  double grad_rel;            /* worst relative gradient error */
  double rmax;                /* max row scale R */
  int64_t empty_rows;         /* (row, head) pairs keeping no key (reference) */
  double outside_max;         /* max reference outside_mass */
} klh_result;

/** Run one case (a context of default options); fills @p res when non-NULL. */
void klh_run(const klh_case *c, klh_result *res);

/** KL options: the defaults with the direction (@p reverse: FORKATTN_KL_REVERSE), the
 *  temperature @p tau and scale_by_tau2 = @p tau2. */
forkattn_kl_options klh_options(int reverse, float tau, int tau2);

/** klh_run of @p c in the forward direction (named @p fwd_name, result in @p rf) then the
 *  reverse one (@p rev_name, @p rr); either result may be NULL. */
void klh_run_both(klh_case c, const char *fwd_name, const char *rev_name, klh_result *rf, klh_result *rr);

/** Inputs of kept-set attention. */
typedef struct refkept_args {
  const forkattn_layout *layout;
  const forkattn_kept_set *kept; /* or NULL */
  int64_t H, hkv, d;
  double scale;
  const double *q, *k, *v;
  const double *dout; /* [T, H, d] or NULL: forward only */
} refkept_args;

/** Outputs of kept-set attention (any may be NULL; gradients need dout). */
typedef struct refkept_out {
  double *o, *lse, *dq, *dk, *dv;
} refkept_out;

/** Kept-set attention forward (and backward with args->dout). Returns 0, or -1. */
int refkept_run(const refkept_args *args, const refkept_out *out);

#ifdef __cplusplus
}
#endif
#endif /* FORKATTN_TESTS_REFERENCE_KL_H */
