/* Host unit tests of the logic the CPU and GPU kernels share: online-softmax
 * state updates and merges, mask visibility, the segment plan (pairs, inverse
 * key view, block splitting, visible key/query ranges), dtype conversions and
 * the CPU vectorized exp. These are the pieces the GPU kernels compile from
 * the same headers, so a bug here is a bug on every backend. [ran on host] */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_tile.h"
#include "dtype_convert.h"
#include "online_softmax.h"
#include "segment_plan.h"
#include "test_common.h"

/* ---- online softmax ------------------------------------------------------ */

Test(online_softmax, empty_set_is_zero_and_minus_inf) {
  cr_assert_eq(fa_rescale(-INFINITY, -INFINITY), 0.0f, "no NaN when nothing was seen");
  cr_assert_eq(fa_prob(-INFINITY, -INFINITY), 0.0f);
  cr_assert_eq(fa_prob_lse(1.0f, -INFINITY), 0.0f);
  cr_assert_eq(fa_prob_lse(-INFINITY, 3.0f), 0.0f);
  float inv = 1, lse = 0;
  fa_finish(-INFINITY, 0.0f, &inv, &lse);
  cr_assert_eq(inv, 0.0f);
  cr_assert(isinf(lse) && lse < 0);
}

Test(online_softmax, streaming_equals_one_shot_softmax) {
  tc_rng rng = tc_rng_for("online_softmax.streaming");
  for (int trial = 0; trial < 200; trial++) {
    int n = (int)tc_randint(&rng, 1, 300);
    double spread = tc_uniform(&rng, 0.1, 60.0); /* includes very peaked rows */
    float s[300], v[300];
    for (int j = 0; j < n; j++) {
      s[j] = (float)tc_uniform(&rng, -spread, spread);
      v[j] = (float)tc_uniform(&rng, -1, 1);
      if (tc_randint(&rng, 0, 9) == 0) s[j] = -INFINITY; /* masked keys */
    }
    /* float64 reference */
    double mx = -INFINITY, den = 0, num = 0;
    for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    for (int j = 0; j < n; j++)
      if (s[j] != -INFINITY) {
        den += exp(s[j] - mx);
        num += exp(s[j] - mx) * v[j];
      }
    /* streaming in random chunks, as the kernels do per key block */
    float m = -INFINITY, l = 0, o = 0;
    for (int j0 = 0; j0 < n;) {
      int len = (int)tc_randint(&rng, 1, 64);
      if (j0 + len > n) len = n - j0;
      float cm = -INFINITY;
      for (int j = j0; j < j0 + len; j++) cm = s[j] > cm ? s[j] : cm;
      float m_new = cm > m ? cm : m, alpha = fa_rescale(m, m_new);
      l *= alpha;
      o *= alpha;
      for (int j = j0; j < j0 + len; j++) {
        float p = fa_prob(s[j], m_new);
        l += p;
        o += p * v[j];
      }
      m = m_new;
      j0 += len;
    }
    float inv, lse;
    fa_finish(m, l, &inv, &lse);
    cr_assert(!isnan(o * inv) && !isnan(lse));
    if (den == 0) {
      cr_assert_eq(o * inv, 0.0f);
      cr_assert(isinf(lse) && lse < 0);
    } else {
      /* f32 sums of <= 300 terms in [0, 1]: ~300 * 6e-8 relative at worst */
      cr_assert_float_eq(o * inv, num / den, 2e-5 * (1 + fabs(num / den)), "trial %d", trial);
      cr_assert_float_eq(lse, mx + log(den), 1e-5 * (1 + fabs(mx + log(den))), "trial %d", trial);
    }
  }
}

Test(masks, causal_and_full_visibility) {
  cr_assert(fa_visible(0, 0, 1000));
  cr_assert(fa_visible(1, 5, 5));
  cr_assert(fa_visible(1, 5, 0));
  cr_assert(!fa_visible(1, 5, 6));
}

/* ---- segment plan --------------------------------------------------------- */

/* Brute-force visibility of (query row, key row) under the plan. */
static int plan_sees(const fa_plan *p, int64_t qr, int64_t kr) {
  for (int64_t i = 0; i < p->npairs; i++) {
    const fa_pair *pr = &p->pair[i];
    fa_range qs = p->seg[pr->qseg], ks = p->seg[pr->kseg];
    if (qr >= qs.start && qr < qs.start + qs.len && kr >= ks.start && kr < ks.start + ks.len &&
        fa_visible((int)pr->causal, qr + p->qshift, kr))
      return 1;
  }
  return 0;
}

/* What the prefix mask says directly, independent of the plan. */
static int prefix_sees(int64_t P, const int64_t *off, int64_t n, int causal, int64_t qr, int64_t kr) {
  if (qr < P) return kr < P && (!causal || kr <= qr);
  int64_t i = 0;
  while (i < n && !(qr - P >= off[i] && qr - P < off[i + 1])) i++;
  if (kr < P) return 1;
  int64_t a = P + off[i], b = P + off[i + 1];
  return kr >= a && kr < b && (!causal || kr <= qr);
}

Test(segment_plan, prefix_plan_matches_the_mask_exactly) {
  tc_rng rng = tc_rng_for("segment_plan.prefix");
  for (int trial = 0; trial < 60; trial++) {
    int64_t P = tc_randint(&rng, 0, 20), n = tc_randint(&rng, 0, 6), off[8] = {0};
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(&rng, 0, 7);
    int causal = (int)tc_randint(&rng, 0, 1);
    fa_plan p;
    cr_assert_eq(fa_plan_prefix(&p, P, n, off, causal), 0);
    int64_t rows = P + off[n];
    cr_assert_eq(p.rows, rows);
    for (int64_t q = 0; q < rows; q++)
      for (int64_t k = 0; k < rows; k++)
        cr_assert_eq(plan_sees(&p, q, k), prefix_sees(P, off, n, causal, q, k),
                     "trial %d P=%lld n=%lld causal=%d q=%lld k=%lld", trial, (long long)P, (long long)n,
                     causal, (long long)q, (long long)k);
    /* no empty segment; the inverse key view lists each pair exactly once */
    int64_t *seen = calloc((size_t)p.npairs + 1, sizeof *seen);
    for (int64_t s = 0; s < p.nseg; s++) {
      cr_assert_gt(p.seg[s].len, 0);
      for (int64_t j = p.k_pair_off[s]; j < p.k_pair_off[s + 1]; j++) {
        cr_assert_eq(p.pair[p.k_pair_idx[j]].kseg, s);
        seen[p.k_pair_idx[j]]++;
      }
    }
    for (int64_t i = 0; i < p.npairs; i++) cr_assert_eq(seen[i], 1);
    free(seen);
    fa_plan_free(&p);
  }
}

/* What the tree mask says directly: k's node is an ancestor of q's node, or
 * the same node with k <= q (node_of: row -> node; parents < index). */
static int tree_sees(const int64_t *node_of, const int64_t *par, int64_t qr, int64_t kr) {
  const int64_t x = node_of[qr], y = node_of[kr];
  if (x == y) return kr <= qr;
  for (int64_t a = par[x]; a >= 0; a = par[a])
    if (a == y) return 1;
  return 0;
}

Test(segment_plan, tree_plan_matches_the_mask_exactly) {
  tc_rng rng = tc_rng_for("segment_plan.tree");
  for (int trial = 0; trial < 80; trial++) {
    /* random trees with empty nodes, chains of only children, forests */
    const int64_t n = tc_randint(&rng, 1, 14);
    int64_t off[16] = {0}, par[15], node_of[15 * 5 + 1];
    for (int64_t i = 0; i < n; i++) {
      const int64_t kind = tc_randint(&rng, 0, 3);
      par[i] = i == 0 || kind == 0 ? -1 : (kind == 1 ? i - 1 : tc_randint(&rng, 0, i - 1));
      off[i + 1] = off[i] + tc_randint(&rng, 0, 5);
      for (int64_t r = off[i]; r < off[i + 1]; r++) node_of[r] = i;
    }
    fa_plan p;
    cr_assert_eq(fa_plan_tree(&p, n, off, par, 1), 0);
    cr_assert_eq(p.rows, off[n]);
    for (int64_t q = 0; q < off[n]; q++)
      for (int64_t k = 0; k < off[n]; k++)
        cr_assert_eq(plan_sees(&p, q, k), tree_sees(node_of, par, q, k), "trial %d q=%lld k=%lld", trial,
                     (long long)q, (long long)k);
    /* each (query, key) is reached through one pair at most: no key counted twice */
    for (int64_t q = 0; q < off[n]; q++)
      for (int64_t k = 0; k < off[n]; k++) {
        int hits = 0;
        for (int64_t i = 0; i < p.npairs; i++) {
          const fa_pair *pr = &p.pair[i];
          const fa_range qs = p.seg[pr->qseg], ks = p.seg[pr->kseg];
          hits += q >= qs.start && q < qs.start + qs.len && k >= ks.start && k < ks.start + ks.len &&
                  fa_visible((int)pr->causal, q, k);
        }
        cr_assert_leq(hits, 1, "key %lld reached %d times from query %lld", (long long)k, hits, (long long)q);
      }
    fa_plan_free(&p);
  }
}

Test(segment_plan, chain_of_only_children_is_one_key_segment) {
  int64_t off[1001], par[1000];
  off[0] = 0;
  for (int64_t i = 0; i < 1000; i++) {
    par[i] = i - 1;
    off[i + 1] = off[i] + 1 + i % 3;
  }
  fa_plan p;
  cr_assert_eq(fa_plan_tree(&p, 1000, off, par, 1), 0);
  cr_expect_eq(p.npairs, 1000, "one pair per node, not one per ancestor");
  cr_expect_eq(p.nseg, 1001, "1000 query segments + one key segment");
  fa_plan_free(&p);
}

/* Key units (GPU dK/dV split): every reader's visible query rows of every key
 * block are covered exactly once, in reader order, in units of <= chunk rows. */
Test(segment_plan, key_units_cover_every_reader_row_once) {
  tc_rng rng = tc_rng_for("segment_plan.key_units");
  for (int trial = 0; trial < 60; trial++) {
    const int64_t n = tc_randint(&rng, 1, 10);
    int64_t off[12] = {0}, par[11];
    for (int64_t i = 0; i < n; i++) {
      par[i] = i == 0 || tc_randint(&rng, 0, 3) == 0 ? -1 : tc_randint(&rng, 0, i - 1);
      off[i + 1] = off[i] + tc_randint(&rng, 0, 40);
    }
    fa_plan p;
    cr_assert_eq(fa_plan_tree(&p, n, off, par, 1), 0);
    fa_block *blk;
    const int64_t nb = fa_plan_blocks(&p, tc_randint(&rng, 1, 20), 1, &blk);
    cr_assert_geq(nb, 0);
    const int64_t chunk = tc_randint(&rng, 1, 50);
    fa_key_unit *u;
    int64_t *uo;
    const int64_t nu = fa_plan_key_units(&p, blk, nb, chunk, &u, &uo);
    cr_assert_geq(nu, nb);
    cr_assert_eq(uo[0], 0);
    cr_assert_eq(uo[nb], nu);
    for (int64_t b = 0; b < nb; b++) {
      cr_assert_gt(uo[b + 1], uo[b], "block %lld has no unit", (long long)b);
      const int64_t ja = p.k_pair_off[blk[b].seg], jb = p.k_pair_off[blk[b].seg + 1];
      int64_t total = 0, next_j = ja, next_row = 0; /* where the next unit must start */
      for (int64_t j = ja; j < jb; j++)
        total += fa_pair_queries(p.seg, p.pair[p.k_pair_idx[j]], blk[b].start, p.qshift).len;
      int64_t covered = 0;
      for (int64_t x = uo[b]; x < uo[b + 1]; x++) {
        const fa_key_unit *k = &u[x];
        cr_assert_eq(k->block, b);
        cr_assert(k->j0 >= ja && k->j1 < jb && k->j0 <= k->j1);
        int64_t rows = 0;
        for (int64_t j = k->j0; j <= k->j1; j++) {
          const int64_t len = fa_pair_queries(p.seg, p.pair[p.k_pair_idx[j]], blk[b].start, p.qshift).len;
          const int64_t lo = j == k->j0 ? k->lo : 0, hi = j == k->j1 ? k->hi : len;
          cr_assert(lo >= 0 && lo <= hi && hi <= len);
          rows += hi - lo;
        }
        cr_assert_leq(rows, chunk);
        /* contiguous with the previous unit (empty readers in between are skipped) */
        if (k->j0 == next_j) cr_assert_eq(k->lo, next_row);
        else {
          cr_assert_gt(k->j0, next_j);
          cr_assert_eq(k->lo, 0);
          for (int64_t j = next_j; j < k->j0; j++)
            cr_assert_eq(fa_pair_queries(p.seg, p.pair[p.k_pair_idx[j]], blk[b].start, p.qshift).len - (j == next_j ? next_row : 0), 0);
        }
        next_j = k->j1;
        next_row = k->hi;
        covered += rows;
      }
      cr_assert_eq(covered, total, "block %lld: %lld of %lld reader rows", (long long)b, (long long)covered, (long long)total);
      const int64_t want = total == 0 ? 1 : (total + chunk - 1) / chunk;
      cr_assert_eq(uo[b + 1] - uo[b], want, "block %lld: %lld units for %lld rows, chunk %lld", (long long)b,
                   (long long)(uo[b + 1] - uo[b]), (long long)total, (long long)chunk);
    }
    free(u);
    free(uo);
    free(blk);
    fa_plan_free(&p);
  }
}

Test(segment_plan, blocks_cover_every_row_once_heaviest_first) {
  tc_rng rng = tc_rng_for("segment_plan.blocks");
  for (int trial = 0; trial < 40; trial++) {
    int64_t P = tc_randint(&rng, 0, 300), n = tc_randint(&rng, 0, 9), off[10] = {0};
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(&rng, 0, 90);
    fa_plan p;
    cr_assert_eq(fa_plan_prefix(&p, P, n, off, (int)tc_randint(&rng, 0, 1)), 0);
    for (int by_key = 0; by_key < 2; by_key++) {
      int64_t br = tc_randint(&rng, 1, 64);
      fa_block *b;
      int64_t nb = fa_plan_blocks(&p, br, by_key, &b);
      cr_assert_geq(nb, 0);
      int *cover = calloc((size_t)p.rows + 1, sizeof *cover);
      for (int64_t i = 0; i < nb; i++) {
        cr_assert(b[i].len > 0 && b[i].len <= br);
        const fa_range s = p.seg[b[i].seg];
        cr_assert(b[i].start >= s.start && b[i].start + b[i].len <= s.start + s.len);
        for (int64_t r = b[i].start; r < b[i].start + b[i].len; r++) cover[r]++;
      }
      for (int64_t r = 0; r < p.rows; r++) cr_assert_eq(cover[r], 1, "row %lld by_key %d", (long long)r, by_key);
      free(cover);
      free(b);
    }
    fa_plan_free(&p);
  }
}

Test(segment_plan, key_and_query_ranges_contain_every_visible_pair) {
  tc_rng rng = tc_rng_for("segment_plan.ranges");
  for (int trial = 0; trial < 40; trial++) {
    int64_t P = tc_randint(&rng, 1, 40), n = tc_randint(&rng, 1, 4), off[6] = {0};
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + tc_randint(&rng, 1, 30);
    fa_plan p;
    cr_assert_eq(fa_plan_prefix(&p, P, n, off, (int)tc_randint(&rng, 0, 1)), 0);
    for (int64_t i = 0; i < p.npairs; i++) {
      const fa_pair *pr = &p.pair[i];
      const fa_range qs = p.seg[pr->qseg], ks = p.seg[pr->kseg];
      int64_t q0 = qs.start + tc_randint(&rng, 0, qs.len - 1);
      int64_t qn = tc_randint(&rng, 1, qs.start + qs.len - q0);
      const fa_range keys = fa_pair_keys(p.seg, *pr, q0, qn, p.qshift);
      const int64_t k0 = keys.start, kn = keys.len;
      for (int64_t q = q0; q < q0 + qn; q++)
        for (int64_t k = ks.start; k < ks.start + ks.len; k++)
          if (fa_visible((int)pr->causal, q + p.qshift, k))
            cr_assert(k >= k0 && k < k0 + kn, "visible key outside the key range");
      /* and the range is tight: its last key is visible to the block's last query */
      if (kn > 0) cr_assert(fa_visible((int)pr->causal, q0 + qn - 1 + p.qshift, k0 + kn - 1));
      int64_t kb = ks.start + tc_randint(&rng, 0, ks.len - 1), kbn = tc_randint(&rng, 1, ks.start + ks.len - kb);
      const fa_range queries = fa_pair_queries(p.seg, *pr, kb, p.qshift);
      const int64_t a0 = queries.start, an = queries.len;
      for (int64_t q = qs.start; q < qs.start + qs.len; q++)
        for (int64_t k = kb; k < kb + kbn; k++)
          if (fa_visible((int)pr->causal, q + p.qshift, k))
            cr_assert(q >= a0 && q < a0 + an, "query that sees the key block outside the query range");
    }
    fa_plan_free(&p);
  }
}

/* ---- dtype conversions ----------------------------------------------------- */

Test(dtype, f16_roundtrip_is_exact_for_every_value) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = fa_f16_to_f32((uint16_t)h);
    uint16_t back = fa_f32_to_f16(f);
    if (isnan(f))
      cr_assert(((back >> 10) & 0x1f) == 0x1f && (back & 0x3ff), "NaN stays NaN (0x%04x)", h);
    else
      cr_assert_eq(back, h, "0x%04x -> %a -> 0x%04x", h, (double)f, back);
  }
}

Test(dtype, narrowing_rounds_to_nearest_even) {
  /* bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0) */
  cr_assert_eq(fa_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  cr_assert_eq(fa_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  cr_assert_eq(fa_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82); /* tie, odd below: up */
  cr_assert(isnan(fa_bf16_to_f32(fa_f32_to_bf16(NAN))));
  /* f16: 1 + 2^-11 ties to 1; 65520 overflows to inf; 2^-25 rounds to 0, 3*2^-26 to 2^-24 */
  cr_assert_eq(fa_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  cr_assert_eq(fa_f32_to_f16(65520.0f), 0x7c00);
  cr_assert_eq(fa_f32_to_f16(65504.0f), 0x7bff);
  cr_assert_eq(fa_f32_to_f16(0x1p-25f), 0x0000);
  cr_assert_eq(fa_f32_to_f16(3 * 0x1p-26f), 0x0001);
  cr_assert_eq(fa_f32_to_f16(-2.0f), 0xc000);
}

/* ---- CPU vectorized exp ---------------------------------------------------- */

Test(cpu_exp, accurate_over_the_softmax_range_and_zero_when_masked) {
  enum { N = 20001 };
  static float x[N];
  for (int i = 0; i < N; i++) x[i] = -87.0f + 87.0f * (float)i / (N - 1); /* [-87, 0] */
  static float y[N];
  memcpy(y, x, sizeof x);
  fa_cpu_exp_sub(y, N, 0.0f);
  double worst = 0;
  for (int i = 0; i < N; i++) {
    double ref = exp((double)x[i]);
    double rel = fabs(y[i] - ref) / ref;
    worst = rel > worst ? rel : worst;
  }
  cr_assert_lt(worst, 4 * FLT_EPSILON, "max relative error %g", worst); /* a few ulp */
  float m[5] = {-INFINITY, -1e30f, -100.0f, -87.5f, 0.0f};
  fa_cpu_exp_sub(m, 5, 0.0f);
  cr_assert_eq(m[0], 0.0f);
  cr_assert_eq(m[1], 0.0f);
  cr_assert_eq(m[2], 0.0f);
  cr_assert_eq(m[3], 0.0f);
  cr_assert_eq(m[4], 1.0f);
  float sub[3] = {5.0f, 3.0f, -INFINITY};
  fa_cpu_exp_sub(sub, 3, 5.0f);
  cr_assert_eq(sub[0], 1.0f);
  cr_assert_float_eq(sub[1], expf(-2.0f), 4 * FLT_EPSILON);
  cr_assert_eq(sub[2], 0.0f);
}
