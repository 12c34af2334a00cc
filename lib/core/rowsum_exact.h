/* When the backward's D = rowsum(dO * O) must come from the inputs instead of O.
 *
 * D is the softmax backward's sum_j P_j dP_j, and FlashAttention-style kernels read it
 * as dO . O. With O stored in bf16/f16 that carries O's rounding error into every
 * dS = P (dP - D); on a row that sees only a few keys dS is a small difference of
 * large terms, and the error of dQ and dK reaches several times that of a naive
 * same-precision computation (up to 13x at two keys, under 2x from about eight:
 * docs/numerics.md). So a query block whose rows see at most FA_EXACT_D_KEYS keys
 * computes D = sum_j exp(s_j - lse) (dO . v_j) over its visible keys; longer rows
 * keep dO . O, whose share of the error shrinks as 1/sqrt(keys). Shared by the CPU
 * and GPU backwards (declare target). */
#ifndef FORKATTN_ROWSUM_EXACT_H
#define FORKATTN_ROWSUM_EXACT_H
#include <stdint.h>

#include "segment_plan.h"

#define FA_EXACT_D_KEYS 16

#pragma omp declare target
/* Keys visible to some row of query rows [q0, q0+qn) over pairs [p0, p1) of the plan. */
static inline int64_t fa_block_key_count(const fa_range *seg, const fa_pair *pair, int64_t p0, int64_t p1,
                                         int64_t q0, int64_t qn, int64_t qshift) {
  int64_t n = 0;
  for (int64_t pi = p0; pi < p1; pi++) n += fa_pair_keys(seg, pair[pi], q0, qn, qshift).len;
  return n;
}
#pragma omp end declare target

#endif
