/*
 * test_streamkl.c - StreamKL (forkattn_kl_fwd / forkattn_kl_bwd /
 * forkattn_rows_mean) against the float64 reference of tests/reference_kl.c.
 *
 * Every library run goes through klh_run() (reference_kl.h): seeded inputs
 * rounded to their dtype (FORKATTN_TEST_SEED=<n> reproduces a run), poisoned
 * outputs with guards, every element written, inputs and the backward's
 * stats untouched, kl >= -1e-6, and kl / stats / outside_mass / dq_s / dk_s
 * (/ dq_t / dk_t) within the tolerances derived in reference_kl.c (f32:
 * 1e-5 of the row's scale and condition forward, 1e-4 tensor-relative
 * gradients; bf16: 1e-3 forward, 1e-2 gradients).
 *
 * The reference itself is checked first: its hand-derived gradients against
 * float64 central finite differences of its forward on small problems.
 *
 * Cases: odd sizes (3 x 423 rows; dense causal 512 x d128 and
 * 2048 x d128 with one head here, 4 heads and bf16 in test_streamkl_slow);
 * forests with empty nodes, head dims 1, 33, 255, 256; peaked rows (q x10,
 * x30, x30 with a block mask); tau = 2 with
 * tau^2; teacher 32/8 heads d64 vs student 32/4 d32; both directions;
 * causal and bidirectional prefixes and a tree; block masks (50% of 64x64
 * blocks, diagonal kept or not, rows keeping only the diagonal block, rows
 * keeping nothing) and CSR kept lists with query_start / compressed_rows;
 * teacher == student gives KL 0; f32, bf16, mixed dtypes, strided tensors;
 * no rows x keys buffer (T = 4096); no rows; bitwise reruns; argument errors;
 * forkattn_rows_mean.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "reference_kl.h"
#include "test_common.h"
#include "tree_builder.h"

#define F32 FORKATTN_DTYPE_F32
#define BF16 FORKATTN_DTYPE_BF16
#define F16 FORKATTN_DTYPE_F16
#define CAUSAL FORKATTN_MASK_CAUSAL
#define BIDIR FORKATTN_MASK_BIDIRECTIONAL

/* A prefix layout with its offsets kept alive by the struct. */
typedef struct pfx {
  int64_t off[8];
  forkattn_prefix_layout p;
  forkattn_layout l;
} pfx;

static void pfx_make(pfx *x, int64_t P, int n, const int64_t *lens, forkattn_mask mask) {
  memset(x, 0, sizeof *x);
  cr_assert(n < 8);
  x->off[0] = 0;
  for (int i = 0; i < n; i++)
    x->off[i + 1] = x->off[i] + lens[i];
  x->p = (forkattn_prefix_layout){P, n, n ? x->off : NULL, mask};
  x->l = (forkattn_layout){&x->p, NULL};
}

/* ---- the reference's gradients vs finite differences ----------------------- */

/* Central differences of L = sum w * kl (reference forward) with respect to
 * every input element against the reference's analytic gradients. Float64:
 * truncation h^2/6 |L'''| ~ 1e-10 and rounding ~ 1e-16 |L| / h ~ 1e-10 at
 * h = 1e-5, so 1e-6 of the largest gradient is a wide margin that a wrong
 * term (a missing -E, a sign, a wrong support) exceeds by orders. */
static void fd_check(const char *name, const forkattn_layout *lay, const forkattn_kept_set *kept, int reverse,
                     double tau, int tau2) {
  tc_rng rng = tc_rng_for(name);
  const int64_t T = refkl_layout_rows(lay), H = 2, hkv_t = 2, hkv_s = 1, dt = 8, ds = 6;
  cr_assert(T > 0);
  const int64_t n[4] = {T * H * dt, T * hkv_t * dt, T * H * ds, T * hkv_s * ds};
  double *x[4], *g[4], *w = malloc(sizeof(double) * (size_t)(T * H));
  for (int a = 0; a < 4; a++) {
    x[a] = malloc(sizeof(double) * (size_t)n[a]);
    g[a] = malloc(sizeof(double) * (size_t)n[a]);
    cr_assert(x[a] && g[a]);
    for (int64_t i = 0; i < n[a]; i++)
      x[a][i] = tc_uniform(&rng, a % 2 ? -1.0 : -2.0, a % 2 ? 1.0 : 2.0);
  }
  cr_assert(w);
  for (int64_t i = 0; i < T * H; i++)
    w[i] = tc_uniform(&rng, -1.0, 1.0);
  refkl_args ra = {lay, kept, H, hkv_t, hkv_s, dt, ds, 0.35, 0.5, tau, reverse, tau2, x[0], x[1], x[2], x[3], w};
  refkl_out ro;
  memset(&ro, 0, sizeof ro);
  double *kl = malloc(sizeof(double) * (size_t)(T * H)), *stats = malloc(sizeof(double) * (size_t)(4 * T * H));
  ro.kl = kl;
  ro.stats = stats;
  ro.dqt = g[0];
  ro.dkt = g[1];
  ro.dqs = g[2];
  ro.dks = g[3];
  cr_assert_eq(refkl_run(&ra, &ro), 0);
  int64_t empty = 0;
  for (int64_t i = 0; i < T * H; i++) {
    empty += stats[4 * i + 1] == -INFINITY;
    cr_expect(kl[i] >= -1e-12, "%s: reference kl[%" PRId64 "] = %g < 0", name, i, kl[i]);
  }
  const char *names[4] = {"dq_t", "dk_t", "dq_s", "dk_s"};
  const double h = 1e-5;
  for (int a = 0; a < 4; a++) {
    double max_g = 0.0, max_e = 0.0;
    int64_t worst = 0;
    for (int64_t i = 0; i < n[a]; i++) {
      const double x0 = x[a][i];
      x[a][i] = x0 + h;
      const double lp = refkl_loss(&ra, w);
      x[a][i] = x0 - h;
      const double lm = refkl_loss(&ra, w);
      x[a][i] = x0;
      const double fd = (lp - lm) / (2 * h);
      max_g = fmax(max_g, fabs(g[a][i]));
      if (fabs(fd - g[a][i]) > max_e) {
        max_e = fabs(fd - g[a][i]);
        worst = i;
      }
    }
    const double rel = max_e / fmax(max_g, 1e-300);
    fprintf(stderr, "  %s %s: finite differences vs analytic: max |diff| %.3e, max |grad| %.3e, rel %.3e (<= 1e-6)\n",
            name, names[a], max_e, max_g, rel);
    cr_expect(max_g > 0.0, "%s: %s is identically zero", name, names[a]);
    cr_expect(rel <= 1e-6, "%s: %s analytic vs finite differences: rel %.3e at element %" PRId64, name, names[a],
              rel, worst);
  }
  fprintf(stderr, "  %s: %" PRId64 " (row, head) pairs keeping nothing\n", name, empty);
  for (int a = 0; a < 4; a++)
    free(x[a]), free(g[a]);
  free(w), free(kl), free(stats);
}

/* T = 20: prompt 8, responses 7 and 5. Kept lists: head 0 keeps a few of the
 * first 10 keys, head 1 none of them, from query row 3 on: rows 3..9 of head 1
 * keep nothing (they see only keys < 10). */
static const int64_t fd_lens[2] = {7, 5};
static const int64_t fd_offsets[3] = {0, 5, 5};
static const int64_t fd_index[5] = {1, 3, 4, 6, 9};
static const forkattn_kept_set fd_kept = {2, 10, 3, fd_offsets, fd_index, NULL};

Test(fd, reference_gradients_prefix, .timeout = 120) {
  pfx x;
  pfx_make(&x, 8, 2, fd_lens, CAUSAL);
  fd_check("fd/prefix_forward", &x.l, NULL, 0, 1.0, 0);
  fd_check("fd/prefix_reverse", &x.l, NULL, 1, 1.0, 0);
  fd_check("fd/prefix_forward_tau2", &x.l, NULL, 0, 2.0, 1);
  fd_check("fd/prefix_reverse_tau2", &x.l, NULL, 1, 2.0, 1);
  pfx_make(&x, 8, 2, fd_lens, BIDIR);
  fd_check("fd/bidir_forward", &x.l, NULL, 0, 1.0, 0);
  fd_check("fd/bidir_reverse", &x.l, NULL, 1, 0.7, 1);
}

Test(fd, reference_gradients_kept_and_tree, .timeout = 120) {
  pfx x;
  pfx_make(&x, 8, 2, fd_lens, CAUSAL);
  fd_check("fd/kept_forward", &x.l, &fd_kept, 0, 1.0, 0);
  fd_check("fd/kept_reverse", &x.l, &fd_kept, 1, 2.0, 1);
  /* a tree of 20 rows: root 6, children 5 and 3, grandchildren 4 and 2 */
  const int64_t off[6] = {0, 6, 11, 14, 18, 20}, par[5] = {-1, 0, 0, 1, 1};
  const forkattn_tree_layout tl = {5, off, par};
  const forkattn_layout l = {NULL, &tl};
  fd_check("fd/tree_forward", &l, NULL, 0, 1.0, 0);
  fd_check("fd/tree_reverse_kept", &l, &fd_kept, 1, 1.0, 0);
}

/* The library on the finite-difference shapes (f32 and bf16, teacher grads). */
Test(fd, library_on_small_shapes, .timeout = 120) {
  pfx x;
  pfx_make(&x, 8, 2, fd_lens, CAUSAL);
  klh_case c = {.layout = x.l, .H = 2, .hkv_t = 2, .hkv_s = 1, .dt = 8, .ds = 6, .dtype_t = F32,
                .dtype_s = F32, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "small/forward", "small/reverse", &rf, &rr);
  c.kept = &fd_kept;
  c.opt = klh_options(0, 2.0f, 1);
  klh_run_both(c, "small/kept_forward_tau2", "small/kept_reverse_tau2", &rf, &rr);
  cr_expect_gt(rf.empty_rows, 0, "the kept lists should leave rows keeping nothing");
  c.dtype_t = c.dtype_s = BF16;
  c.strided = 1;
  klh_run_both(c, "small/kept_bf16_strided_forward", "small/kept_bf16_strided_reverse", &rf, &rr);
}

/* ---- odd sizes ------------------------------------------------------------- */

Test(odd, prefix_423_with_two_responses_of_423, .timeout = 300) {
  pfx x;
  const int64_t lens[2] = {423, 423};
  pfx_make(&x, 423, 2, lens, CAUSAL);
  klh_case c = {.layout = x.l, .H = 4, .hkv_t = 2, .hkv_s = 1, .dt = 64, .ds = 64, .dtype_t = F32,
                .dtype_s = F32, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "odd/3x423_forward", "odd/3x423_reverse", &rf, &rr);
}

Test(odd, dense_causal_512_d128, .timeout = 300) {
  pfx x;
  pfx_make(&x, 512, 0, NULL, CAUSAL);
  /* student = teacher + noise: the close-distribution regime of distillation */
  klh_case c = {.layout = x.l, .H = 2, .hkv_t = 1, .hkv_s = 1, .dt = 128, .ds = 128, .dtype_t = F32,
                .dtype_s = F32, .noise = 0.2, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "odd/dense512_d128_forward", "odd/dense512_d128_reverse", &rf, &rr);
}

/* The S = 2048, head_dim 128 causal shape with one head (the float64
 * reference takes a few seconds; 4 heads and bf16 run in test_streamkl_slow). */
Test(odd, dense_causal_2048_d128_one_head, .timeout = 300) {
  pfx x;
  pfx_make(&x, 2048, 0, NULL, CAUSAL);
  klh_case c = {.layout = x.l, .H = 1, .hkv_t = 1, .hkv_s = 1, .dt = 128, .ds = 128, .dtype_t = F32,
                .dtype_s = F32, .noise = 0.3, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "odd/dense2048_d128_forward", "odd/dense2048_d128_reverse", &rf, &rr);
}

/* ---- peaked rows, temperature, GQA ----------------------------------------- */

static void peaked(double amp, const char *nf, const char *nr) {
  pfx x;
  const int64_t lens[2] = {100, 57};
  pfx_make(&x, 200, 2, lens, CAUSAL);
  klh_case c = {.layout = x.l, .H = 2, .hkv_t = 1, .hkv_s = 2, .dt = 64, .ds = 64, .dtype_t = F32,
                .dtype_s = F32, .qamp_t = amp, .qamp_s = amp, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, nf, nr, &rf, &rr);
  fprintf(stderr, "  peaked x%g: kl up to %.3g (forward) / %.3g (reverse), row scale up to %.3g\n", amp,
          rf.kl_max_abs, rr.kl_max_abs, rf.rmax);
}

Test(peaked, q_times_10, .timeout = 300) { peaked(10.0, "peaked/x10_forward", "peaked/x10_reverse"); }
Test(peaked, q_times_30, .timeout = 300) { peaked(30.0, "peaked/x30_forward", "peaked/x30_reverse"); }

static unsigned char *random_blocks(tc_rng *rng, int64_t heads, int64_t nb, int diag);

/* Peaked rows with a sparse student: the kept keys may hold a teacher mass
 * of e^-50 or less (outside_mass rounds to 1) while Tk, renormalised on them,
 * stays a proper distribution; nothing may overflow or turn NaN. */
Test(peaked, q_times_30_block_mask, .timeout = 300) {
  tc_rng rng = tc_rng_for("peaked/x30_kept.shape");
  pfx x;
  const int64_t lens[2] = {100, 57};
  pfx_make(&x, 200, 2, lens, CAUSAL); /* T = 357: 6 blocks */
  unsigned char *bm = random_blocks(&rng, 2, 6, 0);
  bm[0] = 1; /* keep block (0,0) of kept head 0 */
  const forkattn_kept_set ks = {2, 0, 0, NULL, NULL, bm};
  klh_case c = {.layout = x.l, .kept = &ks, .H = 2, .hkv_t = 1, .hkv_s = 2, .dt = 64, .ds = 64, .dtype_t = F32,
                .dtype_s = F32, .qamp_t = 30.0, .qamp_s = 30.0, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "peaked/x30_kept_forward", "peaked/x30_kept_reverse", &rf, &rr);
  free(bm);
}

Test(temperature, tau_2_scaled_by_tau2, .timeout = 300) {
  pfx x;
  const int64_t lens[3] = {80, 1, 45};
  pfx_make(&x, 130, 3, lens, CAUSAL);
  klh_case c = {.layout = x.l, .H = 4, .hkv_t = 4, .hkv_s = 2, .dt = 32, .ds = 48, .dtype_t = F32,
                .dtype_s = F32, .qamp_t = 6.0, .qamp_s = 4.0, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 2.0f, 1);
  klh_run_both(c, "tau/2_tau2_forward", "tau/2_tau2_reverse", &rf, &rr);
  c.opt = klh_options(0, 0.5f, 0); /* tau < 1 without the tau^2 factor, explicit scales */
  c.opt.scale_teacher = 0.3f;
  c.opt.scale_student = 0.1f;
  klh_run_both(c, "tau/0.5_scales_forward", "tau/0.5_scales_reverse", &rf, &rr);
}

Test(gqa, teacher_32_8_d64_vs_student_32_4_d32, .timeout = 300) {
  pfx x;
  const int64_t lens[2] = {30, 22};
  pfx_make(&x, 48, 2, lens, CAUSAL);
  klh_case c = {.layout = x.l, .H = 32, .hkv_t = 8, .hkv_s = 4, .dt = 64, .ds = 32, .dtype_t = F32,
                .dtype_s = F32, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "gqa/32_8_vs_32_4_forward", "gqa/32_8_vs_32_4_reverse", &rf, &rr);
  c.teacher_grad = 0; /* student gradients only */
  c.opt = klh_options(0, 2.0f, 1);
  klh_run_both(c, "gqa/student_only_forward", "gqa/student_only_reverse", &rf, &rr);
}

/* ---- layouts --------------------------------------------------------------- */

Test(layout, bidirectional_prefix, .timeout = 300) {
  pfx x;
  const int64_t lens[3] = {70, 0, 33};
  pfx_make(&x, 95, 3, lens, BIDIR);
  klh_case c = {.layout = x.l, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 32, .ds = 32, .dtype_t = F32,
                .dtype_s = F32, .noise = 0.5, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "layout/bidir_forward", "layout/bidir_reverse", &rf, &rr);
}

Test(layout, tree, .timeout = 300) {
  tc_rng rng = tc_rng_for("layout/tree.shape");
  tt_tree t;
  tt_random_trie(&t, &rng, 90, 6, 50);
  tt_packed p;
  tt_pack(&p, &t, 0);
  klh_case c = {.layout = {NULL, &p.layout}, .H = 4, .hkv_t = 2, .hkv_s = 1, .dt = 32, .ds = 16,
                .dtype_t = F32, .dtype_s = F32, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "layout/tree_forward", "layout/tree_reverse", &rf, &rr);
  /* BFS packing with a kept block mask (every block of head 1 row-block 0 dropped) */
  tt_packed b;
  tt_pack(&b, &t, 1);
  const int64_t T = b.off[t.n], nb = (T + 63) / 64;
  unsigned char *bm = malloc((size_t)(2 * nb * nb));
  cr_assert(bm);
  for (int64_t i = 0; i < 2 * nb * nb; i++)
    bm[i] = (unsigned char)(tc_randint(&rng, 0, 1));
  for (int64_t j = 0; j < nb; j++)
    bm[(1 * nb + 0) * nb + j] = 0;
  const forkattn_kept_set ks = {2, 0, 0, NULL, NULL, bm};
  c.layout = (forkattn_layout){NULL, &b.layout};
  c.kept = &ks;
  klh_run_both(c, "layout/tree_bfs_kept_forward", "layout/tree_bfs_kept_reverse", &rf, &rr);
  cr_expect_gt(rf.empty_rows, 0);
  free(bm);
  tt_packed_free(&b);
  tt_packed_free(&p);
  tt_free(&t);
}

/* A forest with empty nodes (children see through them) in BFS order, and
 * head dims at the ends of the supported range and not multiples of a
 * vector width. */
Test(layout, forest_with_empty_nodes_and_odd_head_dims, .timeout = 300) {
  tt_tree t;
  tt_init(&t, 12);
  tt_add(&t, -1, 40); /* 0 */
  tt_add(&t, 0, 0);   /* 1: empty */
  tt_add(&t, 1, 17);  /* 2 */
  tt_add(&t, 1, 5);   /* 3 */
  tt_add(&t, -1, 0);  /* 4: empty root */
  tt_add(&t, 4, 9);   /* 5 */
  tt_add(&t, 5, 1);   /* 6 */
  tt_add(&t, -1, 33); /* 7 */
  tt_add(&t, 7, 12);  /* 8 */
  tt_add(&t, 8, 0);   /* 9: empty leaf */
  tt_packed p;
  tt_pack(&p, &t, 1);
  klh_case c = {.layout = {NULL, &p.layout}, .H = 2, .hkv_t = 1, .hkv_s = 2, .dt = 256, .ds = 33,
                .dtype_t = F32, .dtype_s = F32, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "layout/forest_d256_vs_d33_forward", "layout/forest_d256_vs_d33_reverse", &rf, &rr);
  c.dt = 1;
  c.ds = 255;
  c.strided = 1;
  klh_run_both(c, "layout/forest_d1_vs_d255_forward", "layout/forest_d1_vs_d255_reverse", &rf, &rr);
  tt_packed_free(&p);
  tt_free(&t);
}

/* ---- sparse students (kept sets) ------------------------------------------ */

/* Random 0/1 block mask with probability 1/2 per block. diag: 1 keep every
 * diagonal block, 0 leave it random. */
static unsigned char *random_blocks(tc_rng *rng, int64_t heads, int64_t nb, int diag) {
  unsigned char *m = malloc((size_t)(heads * nb * nb) + 1);
  cr_assert(m);
  for (int64_t h = 0; h < heads; h++)
    for (int64_t i = 0; i < nb; i++)
      for (int64_t j = 0; j < nb; j++)
        m[(h * nb + i) * nb + j] = (diag && i == j) ? 1 : (unsigned char)tc_randint(rng, 0, 1);
  return m;
}

Test(sparse, block_mask_half_diagonal_kept, .timeout = 300) {
  tc_rng rng = tc_rng_for("sparse/blocks_diag.shape");
  pfx x;
  const int64_t lens[2] = {150, 111};
  pfx_make(&x, 190, 2, lens, CAUSAL); /* T = 451: 8 blocks, the last one partial */
  const int64_t T = 451, nb = 8;
  unsigned char *bm = random_blocks(&rng, 2, nb, 1);
  /* kept head 1, block row 3: only its diagonal block */
  for (int64_t j = 0; j < nb; j++)
    bm[(1 * nb + 3) * nb + j] = j == 3;
  const forkattn_kept_set ks = {2, 0, 0, NULL, NULL, bm};
  klh_case c = {.layout = x.l, .kept = &ks, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 32, .ds = 32,
                .dtype_t = F32, .dtype_s = F32, .noise = 0.3, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "sparse/diag_kept_forward", "sparse/diag_kept_reverse", &rf, &rr);
  cr_expect_gt(rf.outside_max, 0.0, "the block mask drops teacher mass");
  (void)T;
  free(bm);
}

Test(sparse, block_mask_half_diagonal_random_rows_keeping_nothing, .timeout = 300) {
  tc_rng rng = tc_rng_for("sparse/blocks_random.shape");
  pfx x;
  const int64_t lens[2] = {200, 61};
  pfx_make(&x, 190, 2, lens, CAUSAL); /* T = 451 */
  const int64_t nb = 8;
  unsigned char *bm = random_blocks(&rng, 4, nb, 0);
  /* head 0: block (0,0) dropped -> prompt rows 0..63 keep nothing */
  bm[0] = 0;
  /* head 2: block row 5 keeps only its diagonal block */
  for (int64_t j = 0; j < nb; j++)
    bm[(2 * nb + 5) * nb + j] = j == 5;
  const forkattn_kept_set ks = {4, 0, 0, NULL, NULL, bm};
  klh_case c = {.layout = x.l, .kept = &ks, .H = 4, .hkv_t = 4, .hkv_s = 2, .dt = 32, .ds = 24,
                .dtype_t = F32, .dtype_s = F32, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "sparse/diag_random_forward", "sparse/diag_random_reverse", &rf, &rr);
  cr_expect_geq(rf.empty_rows, 64, "rows 0..63 of head 0 keep nothing");
  cr_expect_eq(rf.outside_max, 1.0, "a row keeping nothing has outside_mass 1");
  c.opt = klh_options(0, 2.0f, 1);
  c.strided = 1;
  klh_run_both(c, "sparse/diag_random_tau2_strided_forward", "sparse/diag_random_tau2_strided_reverse", &rf, &rr);
  free(bm);
}

/* CSR kept lists with query_start and compressed_rows, alone and with a block mask. */
Test(sparse, kept_lists_query_start_compressed_rows, .timeout = 300) {
  tc_rng rng = tc_rng_for("sparse/lists.shape");
  pfx x;
  const int64_t lens[2] = {90, 70};
  pfx_make(&x, 150, 2, lens, CAUSAL); /* T = 310; response 0 is rows 150..239 */
  const int64_t cr = 200, heads = 2;
  int64_t offsets[3] = {0, 0, 0}, *index = malloc(sizeof(int64_t) * (size_t)cr);
  cr_assert(index);
  /* head 0 keeps ~40% of [0, 200) (always key 0: an attention sink); head 1 keeps
   * nothing there, so its response-0 rows 150..199 keep nothing */
  int64_t n = 0;
  for (int64_t j = 0; j < cr; j++)
    if (j == 0 || tc_uniform(&rng, 0, 1) < 0.4)
      index[n++] = j;
  offsets[1] = offsets[2] = n;
  const forkattn_kept_set ks = {heads, cr, 150, offsets, index, NULL};
  klh_case c = {.layout = x.l, .kept = &ks, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 32, .ds = 32,
                .dtype_t = F32, .dtype_s = F32, .noise = 0.4, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "sparse/lists_forward", "sparse/lists_reverse", &rf, &rr);
  cr_expect_geq(rf.empty_rows, 2 * 50, "rows 150..199 of query heads 2, 3 keep nothing");
  /* lists AND a block mask */
  unsigned char *bm = random_blocks(&rng, heads, 5, 1);
  const forkattn_kept_set kb = {heads, cr, 150, offsets, index, bm};
  c.kept = &kb;
  klh_run_both(c, "sparse/lists_blocks_forward", "sparse/lists_blocks_reverse", &rf, &rr);
  /* query_start 0: the lists restrict every row (prompt rows too) */
  const forkattn_kept_set k0 = {heads, cr, 0, offsets, index, NULL};
  c.kept = &k0;
  c.dtype_t = c.dtype_s = BF16;
  klh_run_both(c, "sparse/lists_qs0_bf16_forward", "sparse/lists_qs0_bf16_reverse", &rf, &rr);
  free(bm);
  free(index);
}

/* ---- identical teacher and student ---------------------------------------- */

/* The same tensors on both sides: T = S (and Tk = S with a kept set) exactly,
 * so forward KL is 0 up to rounding (|kl| <= 1e-6), as is reverse KL without
 * a kept set. Reverse KL with a kept set is -log(teacher mass kept) > 0. */
Test(same, teacher_equals_student_gives_zero, .timeout = 300) {
  tc_rng rng = tc_rng_for("same.shape");
  pfx x;
  const int64_t lens[2] = {120, 77};
  pfx_make(&x, 140, 2, lens, CAUSAL); /* T = 337 */
  unsigned char *bm = random_blocks(&rng, 2, 6, 1);
  const forkattn_kept_set ks = {2, 0, 0, NULL, NULL, bm};
  klh_case c = {.layout = x.l, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 64, .ds = 64, .dtype_t = F32,
                .dtype_s = F32, .same = 1, .qamp_t = 8.0, .no_bwd = 1};
  klh_result r;
  const char *names[3] = {"same/forward", "same/reverse", "same/forward_kept"};
  for (int k = 0; k < 3; k++) {
    c.name = names[k];
    c.opt = klh_options(k == 1, 1.0f, 0);
    c.kept = k == 2 ? &ks : NULL;
    klh_run(&c, &r);
    cr_expect_leq(r.kl_max_abs, 1e-6, "%s: KL(T||T) = %.3e, expected 0", names[k], r.kl_max_abs);
  }
  c.dtype_t = c.dtype_s = BF16;
  c.name = "same/forward_bf16_tau2";
  c.opt = klh_options(0, 2.0f, 1);
  c.kept = NULL;
  klh_run(&c, &r);
  cr_expect_leq(r.kl_max_abs, 1e-6, "%s: KL(T||T) = %.3e, expected 0", c.name, r.kl_max_abs);
  /* reverse with a kept set: > 0, with gradients */
  c.dtype_t = c.dtype_s = F32;
  c.name = "same/reverse_kept";
  c.opt = klh_options(1, 1.0f, 0);
  c.kept = &ks;
  c.no_bwd = 0;
  c.teacher_grad = 1;
  klh_run(&c, &r);
  cr_expect_gt(r.kl_max_abs, 1e-3, "reverse KL against the full teacher is -log(kept mass) > 0");
  free(bm);
}

/* ---- dtypes and memory layouts --------------------------------------------- */

Test(dtype, bf16_mixed_and_strided, .timeout = 300) {
  pfx x;
  const int64_t lens[3] = {60, 41, 7};
  pfx_make(&x, 101, 3, lens, CAUSAL);
  klh_case c = {.layout = x.l, .H = 4, .hkv_t = 2, .hkv_s = 1, .dt = 64, .ds = 32, .dtype_t = BF16,
                .dtype_s = BF16, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "dtype/bf16_forward", "dtype/bf16_reverse", &rf, &rr);
  c.dtype_s = F32; /* teacher bf16 (frozen), student f32 */
  klh_run_both(c, "dtype/mixed_forward", "dtype/mixed_reverse", &rf, &rr);
  c.dtype_t = F32;
  c.strided = 1;
  klh_run_both(c, "dtype/f32_strided_forward", "dtype/f32_strided_reverse", &rf, &rr);
  c.dtype_t = c.dtype_s = BF16;
  klh_run_both(c, "dtype/bf16_strided_forward", "dtype/bf16_strided_reverse", &rf, &rr);
}

/* The tensor-core kernels' shapes (bf16/f16, one head_dim of 64 or 128 for
 * both sides, the same KV heads, no kept set): on the GPU backend the forward
 * and the backward run on tensor cores (gpu_mma_kl.c), elsewhere the same
 * float64 checks hold for the CPU kernels. Blocks of 64 rows cut the prompt
 * and the responses mid-way; a GQA group of 2; teacher gradients too. */
Test(dtype, tensor_core_shapes, .timeout = 300) {
  pfx x;
  const int64_t lens[3] = {70, 1, 45};
  pfx_make(&x, 150, 3, lens, CAUSAL); /* T = 266 */
  klh_case c = {.layout = x.l, .H = 4, .hkv_t = 2, .hkv_s = 2, .dt = 64, .ds = 64, .dtype_t = BF16,
                .dtype_s = BF16, .teacher_grad = 1};
  klh_result rf, rr;
  c.opt = klh_options(0, 1.0f, 0);
  klh_run_both(c, "mma/bf16_d64_forward", "mma/bf16_d64_reverse", &rf, &rr);
  c.dt = c.ds = 128, c.dtype_t = c.dtype_s = F16, c.H = 2, c.hkv_t = c.hkv_s = 1;
  klh_run_both(c, "mma/f16_d128_forward", "mma/f16_d128_reverse", &rf, &rr);
  pfx_make(&x, 90, 3, lens, BIDIR);
  c.layout = x.l, c.dtype_t = c.dtype_s = BF16, c.opt = klh_options(0, 2.0f, 1);
  klh_run_both(c, "mma/bf16_d128_bidir_tau2_forward", "mma/bf16_d128_bidir_tau2_reverse", &rf, &rr);
}

/* ---- memory ----------------------------------------------------------------- */

/* StreamKL keeps O(rows) state: at T = 4096, H = 1 a rows x keys f32 buffer
 * would be T*T*4 = 64 MiB. After a forward and a backward (teacher gradients
 * too, and once more with a block mask), the context's peak workspace must
 * stay below an eighth of that (8 MiB), which no N^2 buffer fits (plus, on the
 * GPU backend with host tensors, the staged device copies of the inputs and
 * outputs, which are O(rows)). */
Test(memory, no_rows_by_keys_buffer_at_4096, .timeout = 300) {
  const int64_t T = 4096, H = 1, d = 64;
  tc_rng rng = tc_rng_for("memory/4096");
  forkattn_ctx *ctx = tc_ctx_default("memory/4096");
  cr_assert(ctx);
  float *buf = malloc(sizeof(float) * (size_t)(T * H * d * 8 + T * H * 7));
  cr_assert(buf);
  float *p = buf;
  forkattn_tensor t[8];
  for (int i = 0; i < 8; i++, p += T * H * d)
    t[i] = forkattn_tensor_contiguous(p, F32, T, H, d);
  for (int i = 0; i < 4; i++)
    tc_fill_tensor(&rng, &t[i], -2.0, 2.0);
  float *kl = p, *stats = p + T * H, *dkl = p + 5 * T * H, *out = p + 6 * T * H;
  for (int64_t i = 0; i < T * H; i++)
    dkl[i] = 1.0f / (float)T;
  pfx x;
  pfx_make(&x, T, 0, NULL, CAUSAL);
  const int64_t nb = T / 64;
  unsigned char *bm = random_blocks(&rng, 1, nb, 1);
  const forkattn_kept_set ks = {1, 0, 0, NULL, NULL, bm};
  for (int pass = 0; pass < 2; pass++) {
    const forkattn_kept_set *kp = pass ? &ks : NULL;
    for (int dir = 0; dir < 2; dir++) {
      forkattn_kl_options o = klh_options(dir, 1.0f, 0);
      double t0 = tc_now();
      cr_assert_eq(forkattn_kl_fwd(ctx, &x.l, &t[0], &t[1], &t[2], &t[3], kp, &o, kl, stats, out,
                                   FORKATTN_MEMORY_HOST),
                   FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
      double t1 = tc_now();
      cr_assert_eq(forkattn_kl_bwd(ctx, &x.l, &t[0], &t[1], &t[2], &t[3], kp, &o, stats, dkl, &t[6], &t[7], &t[4],
                                   &t[5], FORKATTN_MEMORY_HOST),
                   FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
      fprintf(stderr, "[time] memory/4096 %s%s: fwd %.3f s, bwd %.3f s\n", dir ? "reverse" : "forward",
              pass ? " kept" : "", t1 - t0, tc_now() - t1);
      cr_expect_eq(tc_count_nonfinite_f32(kl, T * H), 0);
      for (int i = 4; i < 8; i++)
        cr_expect_eq(tc_count_nonfinite_tensor(&t[i]), 0, "gradient %d has NaN/inf", i);
    }
  }
  /* The GPU backend with host memory stages every tensor and float array on the
   * device (O(rows * heads * d), counted as workspace), and splits the four f32 score
   * inputs into at most three bf16 pieces each for its tensor cores: allow exactly that
   * on top. */
  const size_t staged = forkattn_ctx_backend(ctx) == FORKATTN_BACKEND_GPU
                            ? sizeof(float) * (size_t)(T * H * d * 8 + T * H * 7) + sizeof(uint16_t) * 3 * (size_t)(4 * T * H * d)
                            : 0;
  const size_t peak = forkattn_ctx_peak_workspace(ctx), limit = (size_t)(T * T * 4 / 8) + staged;
  fprintf(stderr, "  memory/4096: peak workspace %zu bytes (%.2f MiB, staged copies %.2f MiB); a rows x keys f32 buffer "
          "is %.0f MiB, limit %.0f MiB\n", peak, peak / 1048576.0, staged / 1048576.0, T * T * 4 / 1048576.0,
          limit / 1048576.0);
  cr_expect_lt(peak, limit, "peak workspace %zu bytes >= T*T*4/8 + staged %zu = %zu: a rows x keys buffer?", peak,
               staged, limit);
  free(bm);
  free(buf);
  forkattn_ctx_destroy(ctx);
}

/* ---- edges ---------------------------------------------------------------- */

/* No rows at all (an empty prefix, a tree of empty nodes): OK, nothing written. */
Test(edge, no_rows) {
  forkattn_ctx *ctx = tc_ctx_default("edge/no_rows");
  cr_assert(ctx);
  float dummy[8] = {0}, kl[1] = {7.0f}, st[4] = {7, 7, 7, 7};
  forkattn_tensor q = forkattn_tensor_contiguous(dummy, F32, 0, 2, 4), k = forkattn_tensor_contiguous(dummy, F32, 0, 1, 4);
  forkattn_tensor dq = q, dk = k;
  const forkattn_prefix_layout pl = {0, 0, NULL, CAUSAL};
  const int64_t off[3] = {0, 0, 0}, par[2] = {-1, 0};
  const forkattn_tree_layout tl = {2, off, par};
  const forkattn_layout lays[2] = {{&pl, NULL}, {NULL, &tl}};
  forkattn_kl_options o = klh_options(1, 1.0f, 0);
  for (int i = 0; i < 2; i++) {
    cr_expect_eq(forkattn_kl_fwd(ctx, &lays[i], &q, &k, &q, &k, NULL, &o, kl, st, NULL, FORKATTN_MEMORY_HOST),
                 FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
    cr_expect_eq(forkattn_kl_bwd(ctx, &lays[i], &q, &k, &q, &k, NULL, &o, st, kl, &dq, &dk, NULL, NULL,
                                 FORKATTN_MEMORY_HOST),
                 FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  }
  cr_expect_eq(kl[0], 7.0f);
  cr_expect_eq(st[0], 7.0f);
  forkattn_ctx_destroy(ctx);
}

/* Forward and backward are deterministic: two runs are bitwise equal. */
Test(edge, deterministic_reruns, .timeout = 300) {
  tc_rng rng = tc_rng_for("edge/deterministic");
  forkattn_ctx *ctx = tc_ctx_default("edge/deterministic");
  cr_assert(ctx);
  pfx x;
  const int64_t lens[3] = {130, 77, 201};
  pfx_make(&x, 300, 3, lens, CAUSAL);
  const int64_t T = 708, H = 4, hkv = 2, d = 32;
  unsigned char *bm = random_blocks(&rng, 2, (T + 63) / 64, 0);
  const forkattn_kept_set ks = {2, 0, 0, NULL, NULL, bm};
  const int64_t nq = T * H * d, nk = T * hkv * d;
  float *buf = malloc(sizeof(float) * (size_t)(2 * nq + 2 * nk + 2 * (2 * nq + 2 * nk + 6 * T * H)));
  cr_assert(buf);
  float *p = buf;
  forkattn_tensor qt = forkattn_tensor_contiguous(p, F32, T, H, d), kt = forkattn_tensor_contiguous(p += nq, F32, T, hkv, d);
  forkattn_tensor qs = forkattn_tensor_contiguous(p += nk, F32, T, H, d), ks2 = forkattn_tensor_contiguous(p += nq, F32, T, hkv, d);
  p += nk;
  tc_fill_tensor(&rng, &qt, -3, 3);
  tc_fill_tensor(&rng, &kt, -1, 1);
  tc_fill_tensor(&rng, &qs, -3, 3);
  tc_fill_tensor(&rng, &ks2, -1, 1);
  forkattn_tensor g[2][4];
  float *kl[2], *st[2], *out[2];
  for (int r = 0; r < 2; r++) {
    g[r][0] = forkattn_tensor_contiguous(p, F32, T, H, d);
    g[r][1] = forkattn_tensor_contiguous(p += nq, F32, T, hkv, d);
    g[r][2] = forkattn_tensor_contiguous(p += nk, F32, T, H, d);
    g[r][3] = forkattn_tensor_contiguous(p += nq, F32, T, hkv, d);
    kl[r] = (p += nk);
    st[r] = (p += T * H);
    out[r] = (p += 4 * T * H);
    p += T * H;
  }
  float *dk = malloc(sizeof(float) * (size_t)(T * H));
  cr_assert(dk);
  for (int64_t i = 0; i < T * H; i++)
    dk[i] = (float)tc_uniform(&rng, -1, 1);
  for (int dir = 0; dir < 2; dir++) {
    forkattn_kl_options o = klh_options(dir, 1.5f, 1);
    for (int r = 0; r < 2; r++) {
      cr_assert_eq(forkattn_kl_fwd(ctx, &x.l, &qt, &kt, &qs, &ks2, &ks, &o, kl[r], st[r], out[r],
                                   FORKATTN_MEMORY_HOST), FORKATTN_OK);
      cr_assert_eq(forkattn_kl_bwd(ctx, &x.l, &qt, &kt, &qs, &ks2, &ks, &o, st[r], dk, &g[r][2], &g[r][3], &g[r][0],
                                   &g[r][1], FORKATTN_MEMORY_HOST), FORKATTN_OK);
    }
    cr_expect_eq(memcmp(kl[0], kl[1], sizeof(float) * (size_t)(T * H)), 0, "kl differs between runs");
    cr_expect_eq(memcmp(st[0], st[1], sizeof(float) * (size_t)(4 * T * H)), 0, "stats differ between runs");
    cr_expect_eq(memcmp(out[0], out[1], sizeof(float) * (size_t)(T * H)), 0, "outside differs between runs");
    for (int i = 0; i < 4; i++)
      cr_expect_eq(memcmp(g[0][i].data, g[1][i].data,
                          sizeof(float) * (size_t)(g[0][i].rows * g[0][i].heads * g[0][i].head_dim)), 0,
                   "gradient %d differs between runs (direction %d)", i, dir);
  }
  free(dk);
  free(bm);
  free(buf);
  forkattn_ctx_destroy(ctx);
}

/* ---- argument errors ------------------------------------------------------- */

/* A small valid problem: T = 10 (prompt 5, responses 3 and 2), H = 4, teacher
 * 2 KV heads d 16, student 1 KV head d 8. Every tensor and array lives in a
 * guarded buffer; a bad call must return FORKATTN_ERR_INVALID_ARGUMENT, leave
 * every byte of every buffer as it was and name the argument in the message. */
#define EX_T 10
#define EX_H 4
enum { EQT, EKT, EQS, EKS, EKL, EST, EOUT, EDKL, EDQS, EDKS, EDQT, EDKT, EBM, ENB };
static const char *const ex_names[ENB] = {"q_t", "k_t", "q_s", "k_s", "kl", "stats", "outside", "dkl",
                                          "dq_s", "dk_s", "dq_t", "dk_t", "block_mask"};
typedef struct ex_fixture {
  forkattn_ctx *ctx;
  tc_buf b[ENB];
  forkattn_tensor qt, kt, qs, ks, dqs, dks, dqt, dkt;
  float *kl, *stats, *out, *dkl;
  int64_t off[3];
  forkattn_prefix_layout pl;
  forkattn_layout lay;
  int64_t koff[3], kidx[6];
  forkattn_kept_set kept;
  forkattn_kl_options opt;
} ex_fixture;

static void ex_setup(ex_fixture *f) {
  memset(f, 0, sizeof *f);
  forkattn_ctx_options o;
  forkattn_ctx_options_init(&o);
  cr_assert_eq(forkattn_ctx_create(&f->ctx, &o), FORKATTN_OK);
  f->qt = tc_buf_contiguous(&f->b[EQT], F32, EX_T, EX_H, 16);
  f->kt = tc_buf_contiguous(&f->b[EKT], F32, EX_T, 2, 16);
  f->qs = tc_buf_contiguous(&f->b[EQS], F32, EX_T, EX_H, 8);
  f->ks = tc_buf_contiguous(&f->b[EKS], F32, EX_T, 1, 8);
  f->dqs = tc_buf_contiguous(&f->b[EDQS], F32, EX_T, EX_H, 8);
  f->dks = tc_buf_contiguous(&f->b[EDKS], F32, EX_T, 1, 8);
  f->dqt = tc_buf_contiguous(&f->b[EDQT], F32, EX_T, EX_H, 16);
  f->dkt = tc_buf_contiguous(&f->b[EDKT], F32, EX_T, 2, 16);
  f->kl = tc_buf_f32(&f->b[EKL], EX_T * EX_H);
  f->stats = tc_buf_f32(&f->b[EST], EX_T * EX_H * FORKATTN_KL_STATS);
  f->out = tc_buf_f32(&f->b[EOUT], EX_T * EX_H);
  f->dkl = tc_buf_f32(&f->b[EDKL], EX_T * EX_H);
  cr_assert_eq(tc_buf_alloc(&f->b[EBM], 2, F32), 0); /* 2 kept heads x 1 x 1 blocks, bytes */
  memset(f->b[EBM].data, 1, 2);
  tc_rng rng = tc_rng_for("errors");
  tc_fill_tensor(&rng, &f->qt, -1, 1);
  tc_fill_tensor(&rng, &f->kt, -1, 1);
  tc_fill_tensor(&rng, &f->qs, -1, 1);
  tc_fill_tensor(&rng, &f->ks, -1, 1);
  for (int i = 0; i < EX_T * EX_H; i++)
    f->dkl[i] = 0.25f;
  f->off[0] = 0, f->off[1] = 3, f->off[2] = 5;
  f->pl = (forkattn_prefix_layout){5, 2, f->off, CAUSAL};
  f->lay = (forkattn_layout){&f->pl, NULL};
  f->koff[0] = 0, f->koff[1] = 3, f->koff[2] = 6;
  const int64_t idx[6] = {0, 2, 4, 1, 3, 5};
  memcpy(f->kidx, idx, sizeof idx);
  f->kept = (forkattn_kept_set){2, 6, 2, f->koff, f->kidx, f->b[EBM].data};
  forkattn_kl_options_init(&f->opt);
  /* a valid forward fills stats for the backward error cases */
  cr_assert_eq(forkattn_kl_fwd(f->ctx, &f->lay, &f->qt, &f->kt, &f->qs, &f->ks, &f->kept, &f->opt, f->kl,
                               f->stats, f->out, FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "valid fixture call failed: %s", forkattn_ctx_last_error(f->ctx));
  /* outputs poisoned (stats keep the forward's values: an input of the backward) */
  const int outs[] = {EKL, EOUT, EDQS, EDKS, EDQT, EDKT};
  for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
    tc_buf_poison(&f->b[outs[i]]);
  for (int i = 0; i < ENB; i++)
    tc_buf_snapshot(&f->b[i]);
}

static void ex_teardown(ex_fixture *f) {
  for (int i = 0; i < ENB; i++)
    tc_buf_free(&f->b[i]);
  forkattn_ctx_destroy(f->ctx);
}

static void ex_expect(ex_fixture *f, forkattn_status st, const char *what, const char *needle) {
  const char *msg = forkattn_ctx_last_error(f->ctx);
  fprintf(stderr, "  errors/%s: status %d, message \"%s\"\n", what, (int)st, msg);
  cr_expect_eq(st, FORKATTN_ERR_INVALID_ARGUMENT, "%s: expected FORKATTN_ERR_INVALID_ARGUMENT, got %d (%s)", what,
               (int)st, msg);
  cr_expect(strstr(msg, needle) != NULL, "%s: message \"%s\" does not mention \"%s\"", what, msg, needle);
  for (int i = 0; i < ENB; i++) {
    const size_t n = tc_buf_changed_bytes(&f->b[i]);
    cr_expect_eq(n, 0, "%s: %zu bytes of %s changed by a refused call", what, n, ex_names[i]);
  }
}

static forkattn_status ex_fwd(ex_fixture *f, const forkattn_layout *lay, const forkattn_tensor *qs,
                              const forkattn_tensor *kt, const forkattn_kept_set *kept, const forkattn_kl_options *o,
                              float *kl) {
  return forkattn_kl_fwd(f->ctx, lay, &f->qt, kt, qs, &f->ks, kept, o, kl, f->stats, f->out, FORKATTN_MEMORY_HOST);
}

Test(errors, forward_arguments) {
  ex_fixture f;
  ex_setup(&f);
  /* stats is an output of the forward: poison it too for these calls */
  tc_buf_poison(&f.b[EST]);
  tc_buf_snapshot(&f.b[EST]);
  ex_expect(&f, ex_fwd(&f, NULL, &f.qs, &f.kt, &f.kept, &f.opt, f.kl), "layout NULL", "layout");
  const forkattn_tree_layout tl = {3, (const int64_t[]){0, 5, 8, 10}, (const int64_t[]){-1, 0, 0}};
  forkattn_layout both = {&f.pl, &tl}, none = {NULL, NULL};
  ex_expect(&f, ex_fwd(&f, &both, &f.qs, &f.kt, &f.kept, &f.opt, f.kl), "layout with prefix and tree", "layout");
  ex_expect(&f, ex_fwd(&f, &none, &f.qs, &f.kt, &f.kept, &f.opt, f.kl), "layout with neither", "layout");
  forkattn_tensor qs2 = f.qs;
  qs2.heads = 2; /* student query heads differ from the teacher's 4 */
  qs2.row_stride = 2 * 8;
  ex_expect(&f, ex_fwd(&f, &f.lay, &qs2, &f.kt, &f.kept, &f.opt, f.kl), "student heads != teacher heads", "q_s");
  qs2 = f.qs;
  qs2.rows = EX_T - 1;
  ex_expect(&f, ex_fwd(&f, &f.lay, &qs2, &f.kt, &f.kept, &f.opt, f.kl), "student rows != layout rows", "q_s");
  forkattn_tensor kt2 = f.kt;
  kt2.heads = 3; /* 4 query heads are not a multiple of 3 */
  kt2.row_stride = 3 * 16;
  kt2.rows = 6;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &kt2, &f.kept, &f.opt, f.kl), "teacher KV heads", "k_t");
  const float bad_tau[4] = {0.0f, -1.0f, NAN, INFINITY};
  for (int i = 0; i < 4; i++) {
    forkattn_kl_options o = f.opt;
    o.temperature = bad_tau[i];
    char what[64];
    snprintf(what, sizeof what, "temperature %g", (double)bad_tau[i]);
    ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &f.kept, &o, f.kl), what, "temperature");
  }
  forkattn_kl_options o = f.opt;
  o.scale_teacher = -0.5f;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &f.kept, &o, f.kl), "scale_teacher negative", "scale_teacher");
  o = f.opt;
  o.scale_student = -1.0f;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &f.kept, &o, f.kl), "scale_student negative", "scale_student");
  o = f.opt;
  o.scale_student = NAN;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &f.kept, &o, f.kl), "scale_student NaN", "scale_student");
  o = f.opt;
  o.direction = (forkattn_kl_direction)7;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &f.kept, &o, f.kl), "direction 7", "direction");
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &f.kept, &f.opt, NULL), "kl NULL", "kl");

  /* kept sets */
  forkattn_kept_set k = f.kept;
  k.heads = 3; /* does not divide 4 query heads */
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &k, &f.opt, f.kl), "kept heads 3 of 4", "heads");
  int64_t idx[6];
  memcpy(idx, f.kidx, sizeof idx);
  idx[1] = 0; /* head 0: 0, 0, 4 */
  k = f.kept;
  k.index = idx;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &k, &f.opt, f.kl), "kept index not increasing", "index");
  memcpy(idx, f.kidx, sizeof idx);
  idx[4] = 5, idx[5] = 3; /* head 1: 1, 5, 3 */
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &k, &f.opt, f.kl), "kept index unsorted", "index");
  memcpy(idx, f.kidx, sizeof idx);
  idx[5] = 6; /* == compressed_rows */
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &k, &f.opt, f.kl), "kept index out of range", "index");
  idx[5] = -1;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &k, &f.opt, f.kl), "kept index negative", "index");
  unsigned char bm[2] = {1, 2};
  k = f.kept;
  k.block_mask = bm;
  ex_expect(&f, ex_fwd(&f, &f.lay, &f.qs, &f.kt, &k, &f.opt, f.kl), "block_mask value 2", "block_mask");
  ex_teardown(&f);
}

Test(errors, backward_arguments) {
  ex_fixture f;
  ex_setup(&f);
  forkattn_ctx *c = f.ctx;
  const forkattn_memory H = FORKATTN_MEMORY_HOST;
#define BWD(lay, opt, stats, dkl, dqs, dks, dqt, dkt)                                                          \
  forkattn_kl_bwd(c, lay, &f.qt, &f.kt, &f.qs, &f.ks, &f.kept, opt, stats, dkl, dqs, dks, dqt, dkt, H)
  ex_expect(&f, BWD(&f.lay, &f.opt, f.stats, f.dkl, &f.dqs, &f.dks, &f.dqt, NULL), "dq_t without dk_t", "dk_t");
  ex_expect(&f, BWD(&f.lay, &f.opt, f.stats, f.dkl, &f.dqs, &f.dks, NULL, &f.dkt), "dk_t without dq_t", "dq_t");
  ex_expect(&f, BWD(&f.lay, &f.opt, NULL, f.dkl, &f.dqs, &f.dks, &f.dqt, &f.dkt), "stats NULL", "stats");
  ex_expect(&f, BWD(&f.lay, &f.opt, f.stats, NULL, &f.dqs, &f.dks, &f.dqt, &f.dkt), "dkl NULL", "dkl");
  ex_expect(&f, BWD(&f.lay, &f.opt, f.stats, f.dkl, NULL, &f.dks, &f.dqt, &f.dkt), "dq_s NULL", "dq_s");
  forkattn_tensor bad = f.dks;
  bad.heads = 2;
  bad.row_stride = 16;
  bad.rows = 5;
  ex_expect(&f, BWD(&f.lay, &f.opt, f.stats, f.dkl, &f.dqs, &bad, &f.dqt, &f.dkt), "dk_s heads", "dk_s");
  ex_expect(&f, BWD(NULL, &f.opt, f.stats, f.dkl, &f.dqs, &f.dks, &f.dqt, &f.dkt), "layout NULL", "layout");
  forkattn_kl_options o = f.opt;
  o.temperature = -2.0f;
  ex_expect(&f, BWD(&f.lay, &o, f.stats, f.dkl, &f.dqs, &f.dks, &f.dqt, &f.dkt), "temperature -2", "temperature");
  unsigned char bm[2] = {2, 1};
  forkattn_kept_set k = f.kept;
  k.block_mask = bm;
  ex_expect(&f,
            forkattn_kl_bwd(c, &f.lay, &f.qt, &f.kt, &f.qs, &f.ks, &k, &f.opt, f.stats, f.dkl, &f.dqs, &f.dks,
                            &f.dqt, &f.dkt, H),
            "block_mask value 2", "block_mask");
#undef BWD
  ex_teardown(&f);
}

/* ---- forkattn_rows_mean --------------------------------------------------- */

Test(rows_mean, with_and_without_weights) {
  tc_rng rng = tc_rng_for("rows_mean");
  forkattn_ctx *ctx = tc_ctx_default("rows_mean");
  cr_assert(ctx);
  const int64_t rows = 37, heads = 3;
  float x[37 * 3], w[37];
  double sx = 0.0, swx = 0.0, sw = 0.0;
  for (int64_t i = 0; i < rows; i++) {
    w[i] = i % 5 == 0 ? 0.0f : (float)tc_uniform(&rng, 0.0, 2.0);
    for (int64_t h = 0; h < heads; h++) {
      x[i * heads + h] = (float)tc_uniform(&rng, -1.0, 3.0);
      sx += x[i * heads + h];
      swx += (double)w[i] * x[i * heads + h];
    }
    sw += w[i];
  }
  double m = NAN;
  cr_assert_eq(forkattn_rows_mean(ctx, x, rows, heads, NULL, &m, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  const double want = sx / (double)(rows * heads);
  /* float64 accumulation of f32 values on both sides: only the order differs */
  cr_expect(fabs(m - want) <= 1e-12 * (1.0 + fabs(want)), "unweighted mean %.17g, want %.17g", m, want);
  cr_assert_eq(forkattn_rows_mean(ctx, x, rows, heads, w, &m, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  const double wantw = swx / (sw * (double)heads);
  cr_expect(fabs(m - wantw) <= 1e-12 * (1.0 + fabs(wantw)), "weighted mean %.17g, want %.17g", m, wantw);
  /* zero total weight: 0 */
  float zw[37] = {0};
  m = NAN;
  cr_assert_eq(forkattn_rows_mean(ctx, x, rows, heads, zw, &m, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_expect_eq(m, 0.0, "zero total weight gives %.17g, want 0", m);
  m = NAN;
  cr_assert_eq(forkattn_rows_mean(ctx, NULL, 0, heads, NULL, &m, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  cr_expect_eq(m, 0.0, "no rows gives %.17g, want 0", m);
  /* bad arguments: refused, mean untouched */
  w[4] = -1.0f;
  m = 12345.0;
  cr_expect_eq(forkattn_rows_mean(ctx, x, rows, heads, w, &m, FORKATTN_MEMORY_HOST), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "weights"), "message: %s", forkattn_ctx_last_error(ctx));
  w[4] = NAN;
  cr_expect_eq(forkattn_rows_mean(ctx, x, rows, heads, w, &m, FORKATTN_MEMORY_HOST), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_eq(forkattn_rows_mean(ctx, x, rows, 0, NULL, &m, FORKATTN_MEMORY_HOST), FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect(strstr(forkattn_ctx_last_error(ctx), "heads"), "message: %s", forkattn_ctx_last_error(ctx));
  cr_expect_eq(forkattn_rows_mean(ctx, x, rows, heads, NULL, NULL, FORKATTN_MEMORY_HOST),
               FORKATTN_ERR_INVALID_ARGUMENT);
  cr_expect_eq(m, 12345.0, "a refused call wrote mean");
  forkattn_ctx_destroy(ctx);
}

/* rows_mean's gradient fed to the backward: the gradient of the mean equals
 * the backward with dkl = w_i / (heads * sum w) (checked through the
 * reference: sum dkl * kl is the mean). */
Test(rows_mean, mean_of_kl_matches_reference) {
  tc_rng rng = tc_rng_for("rows_mean.kl");
  forkattn_ctx *ctx = tc_ctx_default("rows_mean.kl");
  cr_assert(ctx);
  pfx x;
  const int64_t lens[2] = {9, 6};
  pfx_make(&x, 12, 2, lens, CAUSAL);
  const int64_t T = 27, H = 2, d = 16;
  float *q = malloc(sizeof(float) * (size_t)(4 * T * H * d)), kl[27 * 2], w[27];
  cr_assert(q);
  forkattn_tensor t[4];
  double *xd[4];
  for (int i = 0; i < 4; i++) {
    t[i] = forkattn_tensor_contiguous(q + i * T * H * d, F32, T, H, d);
    tc_fill_tensor(&rng, &t[i], -2, 2);
    xd[i] = malloc(sizeof(double) * (size_t)(T * H * d));
    cr_assert(xd[i]);
    ref_tensor_read(&t[i], xd[i]);
  }
  for (int64_t i = 0; i < T; i++)
    w[i] = i < 12 ? 0.0f : 1.0f; /* loss mask: response tokens only */
  forkattn_kl_options o = klh_options(0, 1.0f, 0);
  cr_assert_eq(forkattn_kl_fwd(ctx, &x.l, &t[0], &t[1], &t[2], &t[3], NULL, &o, kl, NULL, NULL,
                               FORKATTN_MEMORY_HOST),
               FORKATTN_OK, "%s", forkattn_ctx_last_error(ctx));
  double m;
  cr_assert_eq(forkattn_rows_mean(ctx, kl, T, H, w, &m, FORKATTN_MEMORY_HOST), FORKATTN_OK);
  double wr[27 * 2];
  for (int64_t i = 0; i < T * H; i++)
    wr[i] = w[i / H] / (15.0 * H);
  refkl_args ra = {&x.l, NULL, H, H, H, d, d, 0.25, 0.25, 1.0, 0, 0, xd[0], xd[1], xd[2], xd[3], NULL};
  const double want = refkl_loss(&ra, wr);
  fprintf(stderr, "  rows_mean.kl: library %.9g, reference %.9g\n", m, want);
  cr_expect(fabs(m - want) <= 1e-5 * (1.0 + fabs(want)), "masked mean KL %.9g, reference %.9g", m, want);
  for (int i = 0; i < 4; i++)
    free(xd[i]);
  free(q);
  forkattn_ctx_destroy(ctx);
}
