/* Fuzz target: kept-set attention (forkattn_kept_fwd / forkattn_kept_bwd) and
 * StreamKL (forkattn_kl_fwd / forkattn_kl_bwd) with kept sets derived from the
 * input, on a CPU context with contiguous f32 tensors.
 *
 * The input picks a prefix layout (P, 0..3 responses, causal or bidirectional)
 * or a tree layout (0..8 nodes), possibly invalid (negative/huge sizes,
 * non-monotonic offsets, NULL arrays, NULL layout, both or neither layout
 * pointer set), tensor rows agreeing with it or not, heads (Hkv 1..2, group
 * 1..3), head_dim 1..24, a student (KV heads 1..8, mostly divisors of Hq;
 * head_dim 1..24) and a
 * forkattn_kept_set: heads (divisors of Hq, 0, negative, non-divisors,
 * extremes), compressed_rows, query_start (negative, > rows, extremes), CSR
 * index lists drawn per head and then corrupted (offsets[0] != 0,
 * non-monotonic, huge; index unsorted, duplicated, out of range, negative),
 * offsets/index NULL mismatch, a block mask (0/1, or one value 2..255), kept
 * NULL; StreamKL options (direction, temperature, scales: valid, 0 = default,
 * -0, negative, NaN, +-inf, FLT_MAX, denormals, raw bits; opt NULL; tau^2),
 * NULL outputs and inputs the header makes optional or required.
 *
 * Checks (oracle written from include/forkattn.h, not from lib/): every call
 * returns OK or INVALID_ARGUMENT as predicted (where the header is silent, the
 * library may choose, but all four calls of an input must choose alike); on an
 * error a message is set and no buffer changed; on success no input changed,
 * every output element written (outputs are poisoned with a NaN pattern
 * first), outputs finite (sane scales), rows whose kept keys are all dropped
 * give o = 0, lse = -inf, dq = 0, kl = 0, outside mass 1; kl >= -1e-6 and
 * outside mass in [0, 1] (0 without a kept set); and, for small problems, o,
 * lse, dq, dk, dv, kl, outside mass and the four StreamKL gradients against a
 * float64 computation straight from the layout mask and the kept set.
 *
 * Input format (missing bytes read as 0; 0 is always a valid choice):
 *   lay      bit0 tree (else prefix); bits1-3 shape: 0-4 as is, 5 layout NULL,
 *            6 prefix and tree both set, 7 neither; bit4 bidirectional (prefix);
 *            bit5 raw offsets (else non-negative deltas); bit6 tree: raw parents,
 *            prefix: raw mask enum; bit7 the offsets array NULL
 *   prefix   P fz_int(0, 100), N fz_int(0, 4), offsets raw (N+1) x fz_int(0, 64)
 *            or deltas N x fz_int(0, 35) [, mask fz_enum(2) when bit6]
 *   tree     n fz_int(0, 9), offsets raw (n+1) x fz_int(0, 64) or deltas
 *            n x fz_int(0, 25), parents raw n x fz_int(-1, 12) or per node a
 *            byte k: parent k % (i+1) - 1
 *   rows     fz_field(T): rows of every tensor (inputs with rows outside [0, 208] skipped)
 *   hkv fz_int(1, 2), group fz_int(1, 3), d fz_int(1, 24) (other values skipped),
 *   hkv_s byte t: t < 0x80 the (t % #divisors)-th divisor of Hq, else 1 + (t & 7),
 *   d_s fz_int(1, 24) (other values skipped), seed byte
 *   kf       bit0 kept NULL, bit1 index lists, bit2 NULL mismatch (lists: index
 *            NULL; no lists: index set), bit3 block mask, bit4 one block-mask
 *            value 2..255, bit5 corrupt offsets, bit6 and bit7 corrupt index
 *   heads    byte sel, fz_field(sel-th divisor of Hq)
 *   cr       byte sel, fz_field(T - sel % (T+1))       compressed_rows
 *   qs       fz_field(0)                               query_start
 *   lists    per kept head (1 <= heads <= 8): density byte b, each key row of
 *            [0, compressed_rows) kept with probability (256 - b) / 256
 *   bit5:    j byte, op byte x: offsets[j % (heads+1)] gets by x % 4: 0 += (x >> 4) - 8,
 *            1 fz_int(0, 64), 2 swapped with the next, 3 fz_extremes[(x >> 2) % 32]
 *   bit6/7:  pos u16, op byte x: index[pos % n] by x % 6: 0 duplicate, 1 swapped with
 *            the next, 2 = compressed_rows, 3 = -1, 4 fz_int(0, 64), 5 fz_extremes[(x >> 3) % 32]
 *   block    density byte b (entry 1 with probability (256 - b) / 256),
 *            bit4: pos u16, value byte (2 + v % 254)
 *   ko       bit0 opt NULL, bit1 scale_by_tau2, bit2 teacher gradients, bit3
 *            forward first without stats, bit4 outside_mass NULL, bit5 dq_t
 *            without dk_t, bit6 student q heads Hq+1, bit7 forward first with kl NULL
 *   nulls    bit0 stats NULL in the backward, bit1 dkl NULL, bit2 kept forward
 *            first without lse, bit3 kept backward lse NULL
 *   direction fz_enum(2), temperature tag, scale_teacher tag, scale_student tag
 *            (tags: kk_temperature / kk_kl_scale), attention scale fz_scale(d) */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define KK_MAX_ROWS 208
#define KK_MAX_NODES 8
#define KK_MAX_KH 8      /* kept heads for which arrays are backed */
#define KK_MAX_LIST 4096 /* index entries backed (>= KK_MAX_KH * (KK_MAX_ROWS + 8)) */
#define KK_POISON 0x7fc5a5a5u
#define KK_REF_WORK 3e6 /* T*T*Hq*(d+d_s) up to which values are checked in float64 */

enum { ACC = 0, EITHER = 1, REJ = 2 };
static int vmax(int a, int b) { return a > b ? a : b; }
static int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }

/* ---- the case (for messages) ---------------------------------------------- */

static struct {
  int tree, shape, mask, offsets_null, parents_null;
  int64_t P, N, n, T, rows;
  int lay_ok;
  int64_t H, hkv, d, hkv_s, d_s, hs;
  int kept_null, lists, null_mismatch;
  int64_t kh, cr, qs, noff, nidx, nblk;
  const int64_t *koff, *kidx;
  const unsigned char *kblk;
  int dir, tau2, opt_null;
  float tau, sc_t, sc_s, scale;
  uint8_t ko, nulls, kf;
} C;

static void kk_dump(void) {
  fprintf(stderr, "case: %s layout shape %d", C.tree ? "tree" : "prefix", C.shape);
  if (C.tree)
    fprintf(stderr, " n=%lld", (long long)C.n);
  else
    fprintf(stderr, " P=%lld N=%lld mask %d", (long long)C.P, (long long)C.N, C.mask);
  fprintf(stderr, " offsets%s parents%s: layout %s T=%lld, tensor rows %lld\n", C.offsets_null ? " NULL" : "",
          C.parents_null ? " NULL" : "", C.lay_ok ? "valid" : "invalid", (long long)C.T, (long long)C.rows);
  fprintf(stderr, "  Hq %lld Hkv %lld d %lld | student Hq %lld Hkv %lld d %lld | attention scale %.9g\n",
          (long long)C.H, (long long)C.hkv, (long long)C.d, (long long)C.hs, (long long)C.hkv_s, (long long)C.d_s,
          (double)C.scale);
  if (C.kept_null) {
    fprintf(stderr, "  kept NULL\n");
  } else {
    fprintf(stderr, "  kept: heads %lld compressed_rows %lld query_start %lld, offsets", (long long)C.kh,
            (long long)C.cr, (long long)C.qs);
    if (!C.koff) fprintf(stderr, " NULL");
    for (int64_t i = 0; C.koff && i < C.noff; i++) fprintf(stderr, " %lld", (long long)C.koff[i]);
    fprintf(stderr, "; index");
    if (!C.kidx) fprintf(stderr, " NULL");
    for (int64_t i = 0; C.kidx && i < C.nidx && i < 64; i++) fprintf(stderr, " %lld", (long long)C.kidx[i]);
    fprintf(stderr, "%s; block mask", C.kidx && C.nidx > 64 ? " ..." : "");
    if (!C.kblk) fprintf(stderr, " NULL");
    for (int64_t i = 0; C.kblk && i < C.nblk && i < 64; i++) fprintf(stderr, " %d", C.kblk[i]);
    fprintf(stderr, "\n");
  }
  fprintf(stderr, "  kl: opt%s direction %d tau %.9g tau2 %d scale_t %.9g scale_s %.9g; flags ko 0x%02x nulls 0x%02x\n",
          C.opt_null ? " NULL" : "", C.dir, (double)C.tau, C.tau2, (double)C.sc_t, (double)C.sc_s, C.ko, C.nulls);
}

#define KK_CHECK(cond, ...)                                                                                  \
  do {                                                                                                       \
    if (!(cond)) {                                                                                           \
      kk_dump();                                                                                             \
      fz_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);                                                       \
    }                                                                                                        \
  } while (0)

/* ---- buffers -------------------------------------------------------------- */

enum {
  B_Q, B_K, B_V, B_DOUT, B_QS, B_KS, B_DKL, /* inputs */
  B_O, B_LSE, B_DQ, B_DK, B_DV,              /* kept attention outputs */
  B_KL, B_STATS, B_OUT, B_DQS, B_DKS, B_DQT, B_DKT, /* StreamKL outputs */
  B_KOFF, B_KIDX, B_KBLK,                    /* kept set (inputs) */
  B_N
};
static const char *const bnames[B_N] = {"q", "k", "v", "dout", "q_s", "k_s", "dkl", "o", "lse", "dq", "dk",
                                        "dv", "kl", "stats", "outside", "dq_s", "dk_s", "dq_t", "dk_t",
                                        "kept.offsets", "kept.index", "kept.block_mask"};
typedef struct {
  void *p;
  size_t bytes;
  unsigned char *snap;
} kk_buf;
static kk_buf B[B_N];

static void *balloc(int i, size_t bytes) {
  B[i].bytes = bytes;
  B[i].p = malloc(bytes ? bytes : 1); /* exactly the claimed size: one element too far is an ASan report */
  B[i].snap = malloc(bytes ? bytes : 1);
  KK_CHECK(B[i].p && B[i].snap, "out of memory");
  return B[i].p;
}
static void snap_all(void) {
  for (int i = 0; i < B_N; i++)
    if (B[i].p) memcpy(B[i].snap, B[i].p, B[i].bytes);
}
static int bsame(int i) { return !B[i].p || !memcmp(B[i].snap, B[i].p, B[i].bytes); }
static void poison(int i) {
  const uint32_t u = KK_POISON;
  for (size_t x = 0; x + 4 <= B[i].bytes; x += 4) memcpy((char *)B[i].p + x, &u, 4);
}
static int is_poison(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u == KK_POISON;
}
#define F(i) ((float *)B[i].p)

/* ---- layout mask ---------------------------------------------------------- */

static int64_t P_off[KK_MAX_NODES + 2], T_off[KK_MAX_NODES + 1], T_par[KK_MAX_NODES];
static unsigned char *lmask; /* [T, T]: row i sees key j under the layout */

static void build_layout_mask(void) {
  const int64_t T = C.T;
  lmask = calloc((size_t)(T > 0 ? T * T : 1), 1);
  KK_CHECK(lmask, "out of memory");
  if (!C.tree) {
    int64_t *resp = malloc(sizeof(int64_t) * (size_t)(T ? T : 1));
    KK_CHECK(resp, "out of memory");
    for (int64_t i = 0; i < T; i++) resp[i] = -1;
    for (int64_t r = 0; r < C.N; r++)
      for (int64_t i = C.P + P_off[r]; i < C.P + P_off[r + 1]; i++) resp[i] = r;
    const int causal = C.mask == FORKATTN_MASK_CAUSAL;
    for (int64_t i = 0; i < T; i++)
      for (int64_t j = 0; j < T; j++) {
        int s;
        if (j < C.P)
          s = resp[i] >= 0 || !causal || j <= i;
        else
          s = resp[i] >= 0 && resp[i] == resp[j] && (!causal || j <= i);
        lmask[i * T + j] = (unsigned char)s;
      }
    free(resp);
  } else {
    int64_t *node = malloc(sizeof(int64_t) * (size_t)(T ? T : 1));
    KK_CHECK(node, "out of memory");
    for (int64_t x = 0; x < C.n; x++)
      for (int64_t r = T_off[x]; r < T_off[x + 1]; r++) node[r] = x;
    for (int64_t i = 0; i < T; i++)
      for (int64_t j = 0; j < T; j++) {
        int s = 0;
        if (node[i] == node[j])
          s = j <= i;
        else
          for (int64_t a = T_par[node[i]]; a >= 0 && !s; a = T_par[a]) s = a == node[j];
        lmask[i * T + j] = (unsigned char)s;
      }
    free(node);
  }
}

/* The kept set's own mask (header: block mask AND index lists), for a valid kept set. */
static unsigned char *keepmap; /* [kh, T]: kept by the lists (key rows < min(cr, T)) */
static int kept_sees(int64_t h, int64_t i, int64_t j) {
  if (C.kept_null) return 1;
  const int64_t kh = h / (C.H / C.kh), nb = (C.T + FORKATTN_KEPT_BLOCK - 1) / FORKATTN_KEPT_BLOCK;
  if (C.kblk && !C.kblk[(kh * nb + i / FORKATTN_KEPT_BLOCK) * nb + j / FORKATTN_KEPT_BLOCK]) return 0;
  if (C.koff && i >= C.qs && j < C.cr && !keepmap[kh * C.T + j]) return 0;
  return 1;
}

/* ---- oracle for the kept set ------------------------------------------------ */

static int kept_verdict(void) {
  if (C.kept_null) return ACC;
  if (C.kh < 1 || C.H % C.kh) return REJ; /* >= 1 and divides the query heads */
  if (!C.koff != !C.kidx) return REJ;     /* NULL iff */
  int v = ACC;
  if (C.kblk) /* [heads, nb, nb] of 0/1 */
    for (int64_t i = 0; i < C.nblk; i++)
      if (C.kblk[i] > 1) return REJ;
  if (C.koff) {
    const int64_t *o = C.koff;
    if (o[0] != 0) return REJ; /* CSR offsets from 0 */
    for (int64_t h = 0; h < C.kh; h++) {
      if (o[h + 1] < o[h]) return REJ;
      /* strictly increasing entries in [0, compressed_rows): at most max(cr, 0) of them */
      if (o[h + 1] - o[h] > (C.cr > 0 ? C.cr : 0)) return REJ;
    }
    KK_CHECK(o[C.kh] <= C.nidx, "harness: index not backed");
    for (int64_t h = 0; h < C.kh; h++)
      for (int64_t x = o[h]; x < o[h + 1]; x++) {
        if (C.kidx[x] < 0 || C.kidx[x] >= C.cr) return REJ;
        if (x > o[h] && C.kidx[x] <= C.kidx[x - 1]) return REJ;
      }
    /* the header bounds neither compressed_rows (a count of key rows: >= 0? <= T?) nor query_start */
    if (C.cr < 0 || C.cr > C.T || C.qs < 0) v = EITHER;
  }
  return v;
}

/* ---- status checks ---------------------------------------------------------- */

static int kept_decided = -1; /* how the library decided an EITHER kept set (1 accepted) */

static void check_call(forkattn_ctx *ctx, const char *what, forkattn_status st, int others, int kept_v) {
  const int verdict = vmax(others, kept_v);
  const char *msg = forkattn_ctx_last_error(ctx);
  fz_stat.calls++;
  if (getenv("FORKATTN_FUZZ_VERBOSE"))
    fprintf(stderr, "  %s: %s (expected %s) %s\n", what, forkattn_status_string(st),
            verdict == ACC ? "OK" : verdict == REJ ? "INVALID_ARGUMENT" : "either", msg);
  if (st == FORKATTN_OK)
    fz_stat.ok++;
  else if (st == FORKATTN_ERR_INVALID_ARGUMENT)
    fz_stat.invalid++;
  else
    fz_stat.other++;
  KK_CHECK(st == FORKATTN_OK || st == FORKATTN_ERR_INVALID_ARGUMENT, "%s: returned %s ('%s')", what,
           forkattn_status_string(st), msg);
  KK_CHECK(verdict != ACC || st == FORKATTN_OK, "%s: returned %s ('%s'), the header says the call is valid", what,
           forkattn_status_string(st), msg);
  KK_CHECK(verdict != REJ || st != FORKATTN_OK, "%s: returned OK, the header says the call is invalid", what);
  if (others == ACC && kept_v == EITHER) {
    const int acc = st == FORKATTN_OK;
    KK_CHECK(kept_decided < 0 || kept_decided == acc,
             "%s: %s the kept set that an earlier call of the same input %s ('%s')", what,
             acc ? "accepted" : "refused", acc ? "refused" : "accepted", msg);
    kept_decided = acc;
  }
  if (st != FORKATTN_OK) {
    KK_CHECK(msg && msg[0], "%s: %s without a message", what, forkattn_status_string(st));
    for (int i = 0; i < B_N; i++)
      KK_CHECK(bsame(i), "%s: returned %s ('%s') but %s changed", what, forkattn_status_string(st), msg, bnames[i]);
  }
}

/* Inputs unchanged, every element of the listed outputs written. */
static void check_success(const char *what, const int *outs, int nouts) {
  for (int i = 0; i < B_N; i++) {
    int is_out = 0;
    for (int x = 0; x < nouts; x++) is_out |= outs[x] == i;
    if (!is_out) {
      KK_CHECK(bsame(i), "%s: %s (not an output of this call) changed", what, bnames[i]);
      continue;
    }
    for (size_t e = 0; e < B[i].bytes / 4; e++)
      KK_CHECK(!is_poison(F(i)[e]), "%s: %s[%zu] not written", what, bnames[i], e);
  }
}

/* ---- input decoding --------------------------------------------------------- */

static float kk_temperature(fz_reader *r) {
  static const float t[8] = {1.0f, 0.5f, 2.0f, 0.25f, 4.0f, 0.7f, 1.5f, 8.0f};
  const uint8_t tag = fz_u8(r);
  return tag < 0xE0 ? t[tag % 8] : fz_special(r, tag, 13);
}

/* 0 (the default 1/sqrt(d)), a sane multiple of 1/sqrt(d), or a special value. */
static float kk_kl_scale(fz_reader *r, int64_t d) {
  const uint8_t tag = fz_u8(r);
  if (tag == 0) return 0.0f;
  if (tag < 0xE0) return (float)((0.25 + (tag % 32) / 8.0) / sqrt((double)d));
  return fz_special(r, tag, 13);
}

static uint64_t rng_state;
static uint64_t rng(void) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return rng_state >> 33;
}
static void fill(int i) {
  for (size_t e = 0; e < B[i].bytes / 4; e++) F(i)[e] = (float)(rng() % 2001) / 1000.0f - 1.0f;
}

/* ---- float64 references ------------------------------------------------------- */

static double dot(const float *a, const float *b, int64_t d) {
  double s = 0;
  for (int64_t x = 0; x < d; x++) s += (double)a[x] * (double)b[x];
  return s;
}

/* Compare got[n] with want[n]: |got - want| <= 2e-3 |want| + e * max(mag) + 1e-6. */
static void compare(const char *what, const char *name, const float *got, const double *want, const double *mag,
                    int64_t n, double e) {
  double amax = 0;
  for (int64_t x = 0; x < n; x++) amax = fmax(amax, mag[x]);
  for (int64_t x = 0; x < n; x++) {
    const double tol = 2e-3 * fabs(want[x]) + e * amax + 1e-6;
    KK_CHECK(fabs((double)got[x] - want[x]) <= tol, "%s: %s[%lld] = %.9g, float64 reference %.9g (tolerance %.3g)",
             what, name, (long long)x, (double)got[x], want[x], tol);
  }
}

/* Kept attention forward and backward against float64 (o, lse from the library
 * for nothing: the reference recomputes its own softmax). */
static void ref_kept(int have_bwd, int sane) {
  const int64_t T = C.T, H = C.H, hkv = C.hkv, d = C.d, g = H / hkv;
  const float *q = F(B_Q), *k = F(B_K), *v = F(B_V), *dout = F(B_DOUT), *o = F(B_O), *lse = F(B_LSE);
  const double sc = C.scale;
  const int ref = sane && (double)T * T * H * (d + C.d_s) <= KK_REF_WORK;
  double *s = malloc(sizeof(double) * (size_t)T), *p = malloc(sizeof(double) * (size_t)T);
  double *ow = calloc((size_t)(T * H * d), sizeof(double)), *om = calloc((size_t)(T * H * d), sizeof(double));
  double *dq = calloc((size_t)(T * H * d), sizeof(double)), *mq = calloc((size_t)(T * H * d), sizeof(double));
  double *dk = calloc((size_t)(T * hkv * d), sizeof(double)), *mk = calloc((size_t)(T * hkv * d), sizeof(double));
  double *dv = calloc((size_t)(T * hkv * d), sizeof(double)), *mv = calloc((size_t)(T * hkv * d), sizeof(double));
  unsigned char *seen = calloc((size_t)(T * hkv), 1);
  KK_CHECK(s && p && ow && om && dq && mq && dk && mk && dv && mv && seen, "out of memory");
  double smax = 0;
  for (int64_t i = 0; i < T; i++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t kv = h / g, row = i * H + h;
      int64_t nv = 0;
      double m = -INFINITY;
      for (int64_t j = 0; j < T; j++) {
        p[j] = 0;
        s[j] = -INFINITY;
        if (!lmask[i * T + j] || !kept_sees(h, i, j)) continue;
        nv++;
        seen[j * hkv + kv] = 1;
        if (ref) {
          s[j] = sc * dot(q + row * d, k + (j * hkv + kv) * d, d);
          smax = fmax(smax, fabs(s[j]));
          m = fmax(m, s[j]);
        }
      }
      if (nv == 0) { /* the header: o = 0, lse = -inf, zero gradients */
        for (int64_t x = 0; x < d; x++)
          KK_CHECK(o[row * d + x] == 0.0f, "kept_fwd: row %lld head %lld keeps no key but o[%lld] = %g",
                   (long long)i, (long long)h, (long long)x, (double)o[row * d + x]);
        KK_CHECK(lse[row] == -INFINITY, "kept_fwd: row %lld head %lld keeps no key but lse = %g", (long long)i,
                 (long long)h, (double)lse[row]);
        if (have_bwd)
          for (int64_t x = 0; x < d; x++)
            KK_CHECK(F(B_DQ)[row * d + x] == 0.0f, "kept_bwd: row %lld head %lld keeps no key but dq[%lld] = %g",
                     (long long)i, (long long)h, (long long)x, (double)F(B_DQ)[row * d + x]);
        continue;
      }
      if (sane) {
        KK_CHECK(isfinite(lse[row]), "kept_fwd: lse[%lld] = %g not finite", (long long)row, (double)lse[row]);
        for (int64_t x = 0; x < d; x++)
          KK_CHECK(isfinite(o[row * d + x]), "kept_fwd: o not finite at row %lld head %lld", (long long)i,
                   (long long)h);
      }
      if (!ref) continue;
      double l = 0;
      for (int64_t j = 0; j < T; j++)
        if (s[j] > -INFINITY) l += exp(s[j] - m);
      const double L = m + log(l);
      KK_CHECK(fabs(lse[row] - L) <= 1e-4 * (1 + fabs(L)), "kept_fwd: lse row %lld head %lld = %.9g, reference %.9g",
               (long long)i, (long long)h, (double)lse[row], L);
      double D = 0;
      for (int64_t j = 0; j < T; j++) {
        if (s[j] == -INFINITY) continue;
        p[j] = exp(s[j] - L);
        const float *vj = v + (j * hkv + kv) * d;
        for (int64_t x = 0; x < d; x++) {
          ow[row * d + x] += p[j] * vj[x];
          om[row * d + x] += p[j] * fabs(vj[x]);
        }
        D += p[j] * dot(dout + row * d, vj, d);
      }
      if (!have_bwd) continue;
      for (int64_t j = 0; j < T; j++) {
        if (s[j] == -INFINITY) continue;
        const float *kj = k + (j * hkv + kv) * d, *vj = v + (j * hkv + kv) * d, *qi = q + row * d,
                    *di = dout + row * d;
        const double dp = dot(di, vj, d), ds = p[j] * (dp - D), as = p[j] * (fabs(dp) + fabs(D));
        for (int64_t x = 0; x < d; x++) {
          dq[row * d + x] += sc * ds * kj[x];
          mq[row * d + x] += sc * as * fabs(kj[x]);
          dk[(j * hkv + kv) * d + x] += sc * ds * qi[x];
          mk[(j * hkv + kv) * d + x] += sc * as * fabs(qi[x]);
          dv[(j * hkv + kv) * d + x] += p[j] * di[x];
          mv[(j * hkv + kv) * d + x] += p[j] * fabs(di[x]);
        }
      }
    }
  if (have_bwd && sane) {
    for (int64_t e = 0; e < T * H * d; e++)
      KK_CHECK(isfinite(F(B_DQ)[e]), "kept_bwd: dq[%lld] = %g not finite", (long long)e, (double)F(B_DQ)[e]);
    for (int64_t e = 0; e < T * hkv * d; e++) {
      KK_CHECK(isfinite(F(B_DK)[e]) && isfinite(F(B_DV)[e]), "kept_bwd: dk/dv[%lld] not finite", (long long)e);
      if (!seen[e / d])
        KK_CHECK(F(B_DK)[e] == 0.0f && F(B_DV)[e] == 0.0f,
                 "kept_bwd: key row %lld KV head %lld is seen by no row, dk = %g dv = %g", (long long)(e / d / hkv),
                 (long long)(e / d % hkv), (double)F(B_DK)[e], (double)F(B_DV)[e]);
    }
  }
  if (ref) {
    fz_stat.ref_checked++;
    compare("kept_fwd", "o", o, ow, om, T * H * d, 2e-6 * (1 + smax));
    if (have_bwd) {
      const double e = 4e-6 * (1 + smax);
      compare("kept_bwd", "dq", F(B_DQ), dq, mq, T * H * d, e);
      compare("kept_bwd", "dk", F(B_DK), dk, mk, T * hkv * d, e);
      compare("kept_bwd", "dv", F(B_DV), dv, mv, T * hkv * d, e);
    }
  }
  free(s);
  free(p);
  free(ow);
  free(om);
  free(dq);
  free(mq);
  free(dk);
  free(mk);
  free(dv);
  free(mv);
  free(seen);
}

static double lse_of(const double *x, const unsigned char *use, int64_t n) {
  double m = -INFINITY, l = 0;
  for (int64_t j = 0; j < n; j++)
    if (use[j]) m = fmax(m, x[j]);
  if (m == -INFINITY) return -INFINITY;
  for (int64_t j = 0; j < n; j++)
    if (use[j]) l += exp(x[j] - m);
  return m + log(l);
}

/* StreamKL forward (and backward when have_bwd) against float64. st, ss: the
 * score multipliers (scale / tau, as the header defines the scores). */
static void ref_kl(const float *out, int have_bwd, int teacher_grads, int sane, double st, double ss, double mul) {
  const int64_t T = C.T, H = C.H, d = C.d, ds = C.d_s, gt = H / C.hkv, gs = H / C.hkv_s, hkv = C.hkv,
                hkvs = C.hkv_s;
  const float *qt = F(B_Q), *kt = F(B_K), *qs = F(B_QS), *ks = F(B_KS), *kl = F(B_KL), *dkl = F(B_DKL);
  const int ref = sane && (double)T * T * H * (d + ds) <= KK_REF_WORK;
  double *t = malloc(sizeof(double) * (size_t)T), *s = malloc(sizeof(double) * (size_t)T);
  unsigned char *vis = malloc((size_t)T), *keep = malloc((size_t)T);
  double *w_kl = calloc((size_t)(T * H), sizeof(double)), *m_kl = calloc((size_t)(T * H), sizeof(double));
  double *dqs = calloc((size_t)(T * H * ds), sizeof(double)), *mqs = calloc((size_t)(T * H * ds), sizeof(double));
  double *dks = calloc((size_t)(T * hkvs * ds), sizeof(double)), *mks = calloc((size_t)(T * hkvs * ds), sizeof(double));
  double *dqt = calloc((size_t)(T * H * d), sizeof(double)), *mqt = calloc((size_t)(T * H * d), sizeof(double));
  double *dkt = calloc((size_t)(T * hkv * d), sizeof(double)), *mkt = calloc((size_t)(T * hkv * d), sizeof(double));
  unsigned char *ks_used = calloc((size_t)(T * hkvs), 1), *kt_used = calloc((size_t)(T * hkv), 1);
  KK_CHECK(t && s && vis && keep && w_kl && m_kl && dqs && mqs && dks && mks && dqt && mqt && dkt && mkt && ks_used &&
               kt_used,
           "out of memory");
  double smax = 0;
  for (int64_t i = 0; i < T; i++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = i * H + h, kvt = h / gt, kvs = h / gs;
      int64_t nv = 0, nk = 0;
      for (int64_t j = 0; j < T; j++) {
        vis[j] = lmask[i * T + j];
        keep[j] = vis[j] && kept_sees(h, i, j);
        nv += vis[j];
        nk += keep[j];
        if (ref && vis[j]) {
          t[j] = st * dot(qt + row * d, kt + (j * hkv + kvt) * d, d);
          s[j] = ss * dot(qs + row * ds, ks + (j * hkvs + kvs) * ds, ds);
          smax = fmax(smax, fmax(fabs(t[j]), fabs(s[j])));
        }
      }
      KK_CHECK(nv > 0, "harness: row %lld sees no key under a valid layout", (long long)i);
      if (nk == 0) { /* the header: kl 0, outside mass 1 */
        KK_CHECK(kl[row] == 0.0f, "kl_fwd: row %lld head %lld keeps no key but kl = %g", (long long)i, (long long)h,
                 (double)kl[row]);
        if (out && sane)
          KK_CHECK(out[row] == 1.0f, "kl_fwd: row %lld head %lld keeps no key but outside_mass = %g", (long long)i,
                   (long long)h, (double)out[row]);
      }
      if (sane) {
        KK_CHECK(isfinite(kl[row]) && kl[row] >= -1e-6f, "kl_fwd: kl[%lld] = %g (must be finite, >= 0)",
                 (long long)row, (double)kl[row]);
        if (out) {
          KK_CHECK(out[row] >= 0.0f && out[row] <= 1.0f, "kl_fwd: outside_mass[%lld] = %g outside [0, 1]",
                   (long long)row, (double)out[row]);
          if (C.kept_null)
            KK_CHECK(out[row] == 0.0f, "kl_fwd: no kept set but outside_mass[%lld] = %g", (long long)row,
                     (double)out[row]);
        }
      }
      if (!ref || nk == 0) continue;
      const double lt_v = lse_of(t, vis, T), lt_k = lse_of(t, keep, T), ls_k = lse_of(s, keep, T);
      double L = 0, Lm = 0;
      for (int64_t j = 0; j < T; j++) {
        if (!keep[j]) continue;
        if (C.dir == FORKATTN_KL_FORWARD) {
          const double pt = exp(t[j] - lt_k), term = (t[j] - lt_k) - (s[j] - ls_k);
          L += pt * term;
          Lm += pt * (fabs(t[j] - lt_k) + fabs(s[j] - ls_k));
        } else {
          const double ps = exp(s[j] - ls_k), term = (s[j] - ls_k) - (t[j] - lt_v);
          L += ps * term;
          Lm += ps * (fabs(s[j] - ls_k) + fabs(t[j] - lt_v));
        }
      }
      w_kl[row] = mul * L;
      m_kl[row] = mul * (Lm + 1 + smax);
      if (out) {
        const double want = C.kept_null ? 0.0 : -expm1(lt_k - lt_v);
        KK_CHECK(fabs(out[row] - want) <= 1e-5 * (1 + smax), "kl_fwd: outside_mass row %lld head %lld = %.9g, reference %.9g",
                 (long long)i, (long long)h, (double)out[row], want);
      }
      if (!have_bwd) continue;
      const double w = (double)dkl[row] * mul;
      for (int64_t j = 0; j < T; j++) {
        if (!vis[j]) continue;
        double g_t = 0, g_s = 0, a_t = 0, a_s = 0; /* dL/dt_j, dL/ds_j and magnitudes */
        if (C.dir == FORKATTN_KL_FORWARD) {
          if (!keep[j]) continue;
          const double pt = exp(t[j] - lt_k), ps = exp(s[j] - ls_k);
          const double lr = (t[j] - lt_k) - (s[j] - ls_k);
          g_s = ps - pt;
          a_s = ps + pt;
          g_t = pt * (lr - L);
          a_t = pt * (fabs(t[j] - lt_k) + fabs(s[j] - ls_k) + fabs(L));
        } else {
          const double pt = exp(t[j] - lt_v), ps = keep[j] ? exp(s[j] - ls_k) : 0.0;
          g_t = pt - ps;
          a_t = pt + ps;
          if (keep[j]) {
            g_s = ps * ((s[j] - ls_k) - (t[j] - lt_v) - L);
            a_s = ps * (fabs(s[j] - ls_k) + fabs(t[j] - lt_v) + fabs(L));
          }
        }
        const float *ksj = ks + (j * hkvs + kvs) * ds, *ktj = kt + (j * hkv + kvt) * d;
        if (keep[j]) ks_used[j * hkvs + kvs] = 1;
        kt_used[j * hkv + kvt] = 1;
        for (int64_t x = 0; x < ds; x++) {
          dqs[row * ds + x] += w * ss * g_s * ksj[x];
          mqs[row * ds + x] += fabs(w * ss) * a_s * fabs(ksj[x]);
          dks[(j * hkvs + kvs) * ds + x] += w * ss * g_s * qs[row * ds + x];
          mks[(j * hkvs + kvs) * ds + x] += fabs(w * ss) * a_s * fabs(qs[row * ds + x]);
        }
        for (int64_t x = 0; x < d; x++) {
          dqt[row * d + x] += w * st * g_t * ktj[x];
          mqt[row * d + x] += fabs(w * st) * a_t * fabs(ktj[x]);
          dkt[(j * hkv + kvt) * d + x] += w * st * g_t * qt[row * d + x];
          mkt[(j * hkv + kvt) * d + x] += fabs(w * st) * a_t * fabs(qt[row * d + x]);
        }
      }
    }
  if (ref) {
    fz_stat.ref_checked++;
    compare("kl_fwd", "kl", kl, w_kl, m_kl, T * H, 2e-5 * (1 + smax));
    if (have_bwd) {
      const double e = 4e-6 * (1 + smax);
      compare("kl_bwd", "dq_s", F(B_DQS), dqs, mqs, T * H * ds, e);
      compare("kl_bwd", "dk_s", F(B_DKS), dks, mks, T * hkvs * ds, e);
      if (teacher_grads) {
        compare("kl_bwd", "dq_t", F(B_DQT), dqt, mqt, T * H * d, e);
        compare("kl_bwd", "dk_t", F(B_DKT), dkt, mkt, T * hkv * d, e);
      }
      /* keys no row keeps get no student gradient, exactly */
      for (int64_t e2 = 0; e2 < T * hkvs * ds; e2++)
        if (!ks_used[e2 / ds])
          KK_CHECK(F(B_DKS)[e2] == 0.0f, "kl_bwd: student key row %lld KV head %lld is kept by no row, dk_s = %g",
                   (long long)(e2 / ds / hkvs), (long long)(e2 / ds % hkvs), (double)F(B_DKS)[e2]);
    }
  }
  if (have_bwd && sane) {
    const float *g[4] = {F(B_DQS), F(B_DKS), F(B_DQT), F(B_DKT)};
    const int64_t n[4] = {T * H * ds, T * hkvs * ds, T * H * d, T * hkv * d};
    for (int x = 0; x < (teacher_grads ? 4 : 2); x++)
      for (int64_t e2 = 0; e2 < n[x]; e2++)
        KK_CHECK(isfinite(g[x][e2]), "kl_bwd: %s[%lld] = %g not finite", bnames[B_DQS + x], (long long)e2,
                 (double)g[x][e2]);
  }
  free(t);
  free(s);
  free(vis);
  free(keep);
  free(w_kl);
  free(m_kl);
  free(dqs);
  free(mqs);
  free(dks);
  free(mks);
  free(dqt);
  free(mqt);
  free(dkt);
  free(mkt);
  free(ks_used);
  free(kt_used);
}

/* ---- the target ----------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_reader rd = {data, size, 0}, *r = &rd;
  memset(&C, 0, sizeof C);
  memset(B, 0, sizeof B);
  kept_decided = -1;
  lmask = keepmap = NULL;

  /* ---- layout ---- */
  const uint8_t lay = fz_u8(r);
  C.tree = lay & 1;
  C.shape = (lay >> 1) & 7;
  C.offsets_null = (lay >> 7) & 1;
  int lay_v = ACC;
  int64_t T = 0;
  forkattn_prefix_layout pl;
  forkattn_tree_layout tl;
  memset(&pl, 0, sizeof pl);
  memset(&tl, 0, sizeof tl);
  if (!C.tree) {
    C.P = fz_int(r, 0, 100);
    C.N = fz_int(r, 0, 4);
    const int arrays = C.N >= 0 && C.N <= KK_MAX_NODES;
    if (arrays) {
      P_off[0] = (lay & 32) ? fz_int(r, 0, 64) : 0;
      for (int64_t i = 0; i < C.N; i++)
        P_off[i + 1] = (lay & 32) ? fz_int(r, 0, 64) : wrap_add(P_off[i], fz_int(r, 0, 35));
    }
    C.mask = (lay & 64) ? fz_enum(r, 2) : (lay & 16) ? FORKATTN_MASK_BIDIRECTIONAL : FORKATTN_MASK_CAUSAL;
    if (!arrays) C.offsets_null = 1;
    pl.prompt_len = C.P;
    pl.num_responses = C.N;
    pl.response_offsets = C.offsets_null ? NULL : P_off;
    pl.mask = (forkattn_mask)C.mask;
    /* the header: P >= 0, N >= 0, N+1 non-decreasing offsets from 0 (NULL only when N = 0) */
    if (C.P < 0 || C.N < 0 || (C.mask != FORKATTN_MASK_CAUSAL && C.mask != FORKATTN_MASK_BIDIRECTIONAL)) {
      lay_v = REJ;
    } else if (C.N > 0) {
      if (C.offsets_null || P_off[0] != 0) lay_v = REJ;
      for (int64_t i = 0; lay_v == ACC && i < C.N; i++)
        if (P_off[i + 1] < P_off[i]) lay_v = REJ;
      if (lay_v == ACC && __builtin_add_overflow(C.P, P_off[C.N], &T)) lay_v = REJ;
    } else {
      T = C.P;
    }
  } else {
    C.n = fz_int(r, 0, 9);
    const int arrays = C.n >= 0 && C.n <= KK_MAX_NODES;
    if (arrays) {
      T_off[0] = (lay & 32) ? fz_int(r, 0, 64) : 0;
      for (int64_t i = 0; i < C.n; i++)
        T_off[i + 1] = (lay & 32) ? fz_int(r, 0, 64) : wrap_add(T_off[i], fz_int(r, 0, 25));
      for (int64_t i = 0; i < C.n; i++)
        T_par[i] = (lay & 64) ? fz_int(r, -1, 12) : (int64_t)(fz_u8(r) % (i + 1)) - 1;
    }
    C.parents_null = !arrays;
    if (!arrays) C.offsets_null = 1;
    tl.num_nodes = C.n;
    tl.node_offsets = C.offsets_null ? NULL : T_off;
    tl.parents = C.parents_null ? NULL : T_par;
    /* the header: n >= 0, offsets from 0 non-decreasing, parents[i] in [-1, i), arrays NULL only when n = 0 */
    if (C.n < 0) {
      lay_v = REJ;
    } else if (C.n > 0) {
      if (C.offsets_null || C.parents_null || T_off[0] != 0) lay_v = REJ;
      for (int64_t i = 0; lay_v == ACC && i < C.n; i++)
        if (T_off[i + 1] < T_off[i] || T_par[i] < -1 || T_par[i] >= i) lay_v = REJ;
      if (lay_v == ACC) T = T_off[C.n];
    }
  }
  forkattn_tree_layout empty_tree = {0, NULL, NULL};
  forkattn_prefix_layout empty_prefix = {0, 0, NULL, FORKATTN_MASK_CAUSAL};
  forkattn_layout L = {C.tree ? NULL : &pl, C.tree ? &tl : NULL};
  const forkattn_layout *Lp = &L;
  if (C.shape == 5) Lp = NULL;
  if (C.shape == 6) {
    L.prefix = C.tree ? &empty_prefix : &pl;
    L.tree = C.tree ? &tl : &empty_tree;
  }
  if (C.shape == 7) L.prefix = NULL, L.tree = NULL;
  if (C.shape >= 5) lay_v = REJ;
  C.lay_ok = lay_v == ACC;
  const int64_t rows = fz_field(r, C.lay_ok ? T : 0);
  C.rows = rows;
  if (rows < 0 || rows > KK_MAX_ROWS) return 0;
  if (!C.lay_ok) T = rows; /* kept-set arrays are sized from the tensors then */
  if (C.lay_ok && T != rows) lay_v = REJ;
  C.T = T;
  if (T > KK_MAX_ROWS) return 0;

  /* ---- heads ---- */
  C.hkv = fz_int(r, 1, 2);
  const int64_t group = fz_int(r, 1, 3);
  C.d = fz_int(r, 1, 24);
  if (C.hkv < 1 || C.hkv > 2 || group < 1 || group > 3 || C.d < 1 || C.d > 24) return 0;
  C.H = C.hkv * group;
  int64_t div[6], ndiv = 0; /* divisors of Hq */
  for (int64_t x = 1; x <= C.H; x++)
    if (C.H % x == 0) div[ndiv++] = x;
  {
    const uint8_t tag = fz_u8(r);
    C.hkv_s = tag < 0x80 ? div[tag % ndiv] : 1 + (tag & 7);
  }
  C.d_s = fz_int(r, 1, 24);
  if (C.d_s < 1 || C.d_s > 24) return 0;
  rng_state = 0x6b6b0000ull + fz_u8(r);

  /* ---- kept set ---- */
  forkattn_kept_set ks;
  memset(&ks, 0, sizeof ks);
  const uint8_t kf = fz_u8(r);
  C.kf = kf;
  C.kept_null = kf & 1;
  C.lists = (kf >> 1) & 1;
  C.null_mismatch = (kf >> 2) & 1;
  {
    const uint8_t sel = fz_u8(r);
    C.kh = fz_field(r, div[sel % ndiv]);
    const uint8_t csel = fz_u8(r);
    C.cr = fz_field(r, T - (int64_t)(csel % (T + 1)));
    C.qs = fz_field(r, 0);
  }
  const int kh_backed = C.kh >= 1 && C.kh <= KK_MAX_KH;
  const int64_t nb = (T + FORKATTN_KEPT_BLOCK - 1) / FORKATTN_KEPT_BLOCK;
  if (C.lists) {
    /* draw sorted lists among [0, cr) per head (cr capped: larger values are for the oracle) */
    const int64_t nh = kh_backed ? C.kh : 0, span = C.cr < 0 ? 0 : C.cr > KK_MAX_ROWS + 8 ? KK_MAX_ROWS + 8 : C.cr;
    static int64_t off[KK_MAX_KH + 1], idx[KK_MAX_LIST];
    int64_t n = 0;
    off[0] = 0;
    for (int64_t h = 0; h < nh; h++) {
      const unsigned dens = fz_u8(r);
      for (int64_t x = 0; x < span; x++)
        if (rng() % 256 >= dens) idx[n++] = x;
      off[h + 1] = n;
    }
    const int64_t noff = nh + 1;
    if (kf & 32) { /* corrupt one offset */
      const int64_t j = fz_u8(r) % noff;
      const uint8_t op = fz_u8(r);
      switch (op % 4) {
      case 0: off[j] = wrap_add(off[j], (int64_t)(op >> 4) - 8); break;
      case 1: off[j] = fz_int(r, 0, 64); break;
      case 2:
        if (j + 1 < noff) {
          const int64_t tmp = off[j];
          off[j] = off[j + 1];
          off[j + 1] = tmp;
        }
        break;
      default: off[j] = fz_extremes[(op >> 2) % FZ_NEXTREMES]; break;
      }
    }
    /* back every entry the offsets claim (up to KK_MAX_LIST) */
    int64_t want = 0;
    for (int64_t j = 0; j < noff; j++)
      if (off[j] > want && off[j] <= KK_MAX_LIST) want = off[j];
    for (int64_t x = n; x < want; x++) idx[x] = x - n; /* beyond the drawn lists: 0, 1, 2, ... */
    if (want > n) n = want;
    for (int c = 0; c < 2; c++) {
      if (!(kf & (64 << c)) || n == 0) continue;
      const int64_t pos = (int64_t)((fz_u8(r) | (unsigned)fz_u8(r) << 8) % (uint64_t)n);
      const uint8_t op = fz_u8(r);
      switch (op % 6) {
      case 0: idx[pos] = pos > 0 ? idx[pos - 1] : (n > 1 ? idx[1] : idx[0]); break;
      case 1:
        if (pos + 1 < n) {
          const int64_t tmp = idx[pos];
          idx[pos] = idx[pos + 1];
          idx[pos + 1] = tmp;
        }
        break;
      case 2: idx[pos] = C.cr; break;
      case 3: idx[pos] = -1; break;
      case 4: idx[pos] = fz_int(r, 0, 64); break;
      default: idx[pos] = fz_extremes[(op >> 3) % FZ_NEXTREMES]; break;
      }
    }
    /* Offsets claiming more entries than are backed with compressed_rows beyond
     * the rows: the header would let a library read them all. Skip. */
    int huge = 0;
    for (int64_t j = 0; j < noff; j++) huge |= off[j] > KK_MAX_LIST;
    if (huge && C.cr > T) return 0;
    int64_t *o = balloc(B_KOFF, sizeof(int64_t) * (size_t)noff);
    memcpy(o, off, sizeof(int64_t) * (size_t)noff);
    int64_t *ix = balloc(B_KIDX, sizeof(int64_t) * (size_t)n);
    if (n) memcpy(ix, idx, sizeof(int64_t) * (size_t)n);
    C.noff = noff;
    C.nidx = n;
    ks.offsets = o;
    ks.index = ix;
    if (C.null_mismatch) ks.index = NULL;
  } else if (C.null_mismatch) {
    int64_t *ix = balloc(B_KIDX, sizeof(int64_t));
    ix[0] = 0;
    C.nidx = 1;
    ks.index = ix;
  }
  if (kf & 8) {
    const int64_t n = kh_backed ? C.kh * nb * nb : 0;
    unsigned char *blk = balloc(B_KBLK, (size_t)n);
    const unsigned dens = fz_u8(r);
    for (int64_t x = 0; x < n; x++) blk[x] = rng() % 256 >= dens;
    if ((kf & 16) && n > 0) {
      const int64_t pos = (int64_t)((fz_u8(r) | (unsigned)fz_u8(r) << 8) % (uint64_t)n);
      blk[pos] = (unsigned char)(2 + fz_u8(r) % 254);
    }
    C.nblk = n;
    ks.block_mask = blk;
  }
  ks.heads = C.kh;
  ks.compressed_rows = C.cr;
  ks.query_start = C.qs;
  C.koff = ks.offsets;
  C.kidx = ks.index;
  C.kblk = ks.block_mask;
  const int kept_v = kept_verdict();
  if (!C.kept_null && kept_v != REJ && C.koff) { /* the keep map of the oracle */
    keepmap = calloc((size_t)(C.kh * T + 1), 1);
    KK_CHECK(keepmap, "out of memory");
    for (int64_t h = 0; h < C.kh; h++)
      for (int64_t x = C.koff[h]; x < C.koff[h + 1]; x++)
        if (C.kidx[x] < T) keepmap[h * T + C.kidx[x]] = 1;
  }
  const forkattn_kept_set *kp = C.kept_null ? NULL : &ks;

  /* ---- options ---- */
  const uint8_t ko = fz_u8(r), nulls = fz_u8(r);
  C.ko = ko;
  C.nulls = nulls;
  forkattn_kl_options opt;
  forkattn_kl_options_init(&opt);
  KK_CHECK(opt.direction == FORKATTN_KL_FORWARD && opt.temperature == 1.0f && opt.scale_teacher == 0.0f &&
               opt.scale_student == 0.0f && !opt.scale_by_tau2,
           "forkattn_kl_options_init: not forward KL, default scales, tau = 1");
  C.opt_null = ko & 1;
  C.dir = fz_enum(r, 2);
  C.tau = kk_temperature(r);
  C.sc_t = kk_kl_scale(r, C.d);
  C.sc_s = kk_kl_scale(r, C.d_s);
  C.tau2 = (ko >> 1) & 1;
  C.scale = fz_scale(r, C.d);
  if (!C.opt_null) {
    opt.direction = (forkattn_kl_direction)C.dir;
    opt.temperature = C.tau;
    opt.scale_teacher = C.sc_t;
    opt.scale_student = C.sc_s;
    opt.scale_by_tau2 = C.tau2;
  } else {
    C.dir = 0;
    C.tau = 1.0f;
    C.sc_t = C.sc_s = 0.0f;
    C.tau2 = 0;
  }
  C.hs = (ko & 64) ? C.H + 1 : C.H;

  /* ---- tensors ---- */
  const int64_t H = C.H, hkv = C.hkv, d = C.d, ds = C.d_s, hkvs = C.hkv_s, hs = C.hs;
  const size_t f = sizeof(float);
  balloc(B_Q, f * (size_t)(rows * H * d));
  balloc(B_K, f * (size_t)(rows * hkv * d));
  balloc(B_V, f * (size_t)(rows * hkv * d));
  balloc(B_DOUT, f * (size_t)(rows * H * d));
  balloc(B_QS, f * (size_t)(rows * hs * ds));
  balloc(B_KS, f * (size_t)(rows * hkvs * ds));
  balloc(B_DKL, f * (size_t)(rows * H));
  balloc(B_O, f * (size_t)(rows * H * d));
  balloc(B_LSE, f * (size_t)(rows * H));
  balloc(B_DQ, f * (size_t)(rows * H * d));
  balloc(B_DK, f * (size_t)(rows * hkv * d));
  balloc(B_DV, f * (size_t)(rows * hkv * d));
  balloc(B_KL, f * (size_t)(rows * H));
  balloc(B_STATS, f * (size_t)(rows * H * FORKATTN_KL_STATS));
  balloc(B_OUT, f * (size_t)(rows * H));
  balloc(B_DQS, f * (size_t)(rows * hs * ds));
  balloc(B_DKS, f * (size_t)(rows * hkvs * ds));
  balloc(B_DQT, f * (size_t)(rows * H * d));
  balloc(B_DKT, f * (size_t)(rows * hkv * d));
  for (int i = B_Q; i <= B_DKL; i++) fill(i);
  for (int i = B_O; i <= B_DKT; i++) poison(i);
  forkattn_tensor tq = forkattn_tensor_contiguous(B[B_Q].p, FORKATTN_DTYPE_F32, rows, H, d);
  forkattn_tensor tk = forkattn_tensor_contiguous(B[B_K].p, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tv = forkattn_tensor_contiguous(B[B_V].p, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tdo = forkattn_tensor_contiguous(B[B_DOUT].p, FORKATTN_DTYPE_F32, rows, H, d);
  forkattn_tensor to = forkattn_tensor_contiguous(B[B_O].p, FORKATTN_DTYPE_F32, rows, H, d);
  forkattn_tensor tdq = forkattn_tensor_contiguous(B[B_DQ].p, FORKATTN_DTYPE_F32, rows, H, d);
  forkattn_tensor tdk = forkattn_tensor_contiguous(B[B_DK].p, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tdv = forkattn_tensor_contiguous(B[B_DV].p, FORKATTN_DTYPE_F32, rows, hkv, d);
  forkattn_tensor tqs = forkattn_tensor_contiguous(B[B_QS].p, FORKATTN_DTYPE_F32, rows, hs, ds);
  forkattn_tensor tks = forkattn_tensor_contiguous(B[B_KS].p, FORKATTN_DTYPE_F32, rows, hkvs, ds);
  forkattn_tensor tdqs = forkattn_tensor_contiguous(B[B_DQS].p, FORKATTN_DTYPE_F32, rows, hs, ds);
  forkattn_tensor tdks = forkattn_tensor_contiguous(B[B_DKS].p, FORKATTN_DTYPE_F32, rows, hkvs, ds);
  forkattn_tensor tdqt = forkattn_tensor_contiguous(B[B_DQT].p, FORKATTN_DTYPE_F32, rows, H, d);
  forkattn_tensor tdkt = forkattn_tensor_contiguous(B[B_DKT].p, FORKATTN_DTYPE_F32, rows, hkv, d);

  forkattn_ctx *ctx = fz_cpu_ctx();
  if (getenv("FORKATTN_FUZZ_VERBOSE")) kk_dump();
  if (C.lay_ok && lay_v == ACC) build_layout_mask();
  const int T_pos = T > 0;

  /* ---- kept attention ---- */
  const int scale_v = isfinite(C.scale) && C.scale > 0.0f ? ACC : REJ;
  const int attn_sane = scale_v == ACC && (double)C.scale * sqrt((double)d) <= 64.0;
  const int kfwd_v = vmax(lay_v, scale_v);
  forkattn_status st;
  unsigned char *stash_o = NULL, *stash_kl = NULL; /* outputs of the first calls, compared with the full ones */
  if (nulls & 4) { /* lse is optional in the forward */
    snap_all();
    st = forkattn_kept_fwd(ctx, Lp, kp, &tq, &tk, &tv, &to, NULL, C.scale, FORKATTN_MEMORY_HOST);
    check_call(ctx, "kept_fwd (lse NULL)", st, kfwd_v, kept_v);
    if (st == FORKATTN_OK) {
      const int outs[] = {B_O};
      check_success("kept_fwd (lse NULL)", outs, 1);
      stash_o = malloc(B[B_O].bytes ? B[B_O].bytes : 1);
      KK_CHECK(stash_o, "out of memory");
      memcpy(stash_o, B[B_O].p, B[B_O].bytes);
      poison(B_O);
    }
  }
  snap_all();
  st = forkattn_kept_fwd(ctx, Lp, kp, &tq, &tk, &tv, &to, F(B_LSE), C.scale, FORKATTN_MEMORY_HOST);
  check_call(ctx, "kept_fwd", st, kfwd_v, kept_v);
  const int fwd_ok = st == FORKATTN_OK;
  if (fwd_ok) {
    const int outs[] = {B_O, B_LSE};
    check_success("kept_fwd", outs, 2);
    if (stash_o) KK_CHECK(!memcmp(stash_o, B[B_O].p, B[B_O].bytes), "kept_fwd: o differs with and without lse");
  }
  const int kbwd_v = vmax(kfwd_v, (nulls & 8) && T_pos ? REJ : ACC);
  snap_all();
  st = forkattn_kept_bwd(ctx, Lp, kp, &tq, &tk, &tv, &to, &tdo, (nulls & 8) ? NULL : F(B_LSE), &tdq, &tdk, &tdv,
                         C.scale, FORKATTN_MEMORY_HOST);
  check_call(ctx, "kept_bwd", st, kbwd_v, kept_v);
  const int bwd_ok = st == FORKATTN_OK;
  if (bwd_ok) {
    const int outs[] = {B_DQ, B_DK, B_DV};
    check_success("kept_bwd", outs, 3);
  }
  if (fwd_ok && T_pos) ref_kept(bwd_ok, attn_sane);

  /* ---- StreamKL ---- */
  int opt_v = ACC;
  if (C.dir != FORKATTN_KL_FORWARD && C.dir != FORKATTN_KL_REVERSE) opt_v = REJ;
  if (!(isfinite(C.tau) && C.tau > 0.0f)) opt_v = REJ;
  if (C.tau2 && !isfinite(C.tau * C.tau)) opt_v = REJ; /* the header: tau^2 must be finite */
  if (!(isfinite(C.sc_t) && C.sc_t >= 0.0f) || !(isfinite(C.sc_s) && C.sc_s >= 0.0f)) opt_v = REJ;
  const int student_v = hs == H && H % hkvs == 0 ? ACC : REJ; /* same query heads; GQA */
  const int kl_v = vmax(vmax(lay_v, opt_v), student_v);
  /* the scores as the header defines them: scale (0 = 1/sqrt(d)) / tau, in float like the options */
  const float st_f = (C.sc_t > 0.0f ? C.sc_t : 1.0f / sqrtf((float)d)) / C.tau;
  const float ss_f = (C.sc_s > 0.0f ? C.sc_s : 1.0f / sqrtf((float)ds)) / C.tau;
  const double mul = C.tau2 ? (double)C.tau * (double)C.tau : 1.0;
  const int kl_sane = opt_v == ACC && isfinite(st_f) && isfinite(ss_f) && (double)st_f * sqrt((double)d) <= 64.0 &&
                      (double)ss_f * sqrt((double)ds) <= 64.0 && mul <= 1e4;
  float *out = (ko & 16) ? NULL : F(B_OUT);
  if (ko & 128) { /* kl is required */
    snap_all();
    st = forkattn_kl_fwd(ctx, Lp, &tq, &tk, &tqs, &tks, kp, C.opt_null ? NULL : &opt, NULL, F(B_STATS), out,
                         FORKATTN_MEMORY_HOST);
    check_call(ctx, "kl_fwd (kl NULL)", st, vmax(kl_v, T_pos ? REJ : ACC), kept_v);
    if (st == FORKATTN_OK) {
      const int outs[] = {B_STATS, B_OUT};
      check_success("kl_fwd (kl NULL)", outs, out ? 2 : 1);
      poison(B_STATS);
      poison(B_OUT);
    }
  }
  if (ko & 8) { /* stats are optional in the forward */
    snap_all();
    st = forkattn_kl_fwd(ctx, Lp, &tq, &tk, &tqs, &tks, kp, C.opt_null ? NULL : &opt, F(B_KL), NULL, out,
                         FORKATTN_MEMORY_HOST);
    check_call(ctx, "kl_fwd (stats NULL)", st, kl_v, kept_v);
    if (st == FORKATTN_OK) {
      const int outs[] = {B_KL, B_OUT};
      check_success("kl_fwd (stats NULL)", outs, out ? 2 : 1);
      stash_kl = malloc(B[B_KL].bytes ? B[B_KL].bytes : 1);
      KK_CHECK(stash_kl, "out of memory");
      memcpy(stash_kl, B[B_KL].p, B[B_KL].bytes);
      poison(B_KL);
      poison(B_OUT);
    }
  }
  snap_all();
  st = forkattn_kl_fwd(ctx, Lp, &tq, &tk, &tqs, &tks, kp, C.opt_null ? NULL : &opt, F(B_KL), F(B_STATS), out,
                       FORKATTN_MEMORY_HOST);
  check_call(ctx, "kl_fwd", st, kl_v, kept_v);
  const int klf_ok = st == FORKATTN_OK;
  if (klf_ok) {
    const int outs[] = {B_KL, B_STATS, B_OUT};
    check_success("kl_fwd", outs, out ? 3 : 2);
    if (stash_kl)
      KK_CHECK(!memcmp(stash_kl, B[B_KL].p, B[B_KL].bytes), "kl_fwd: kl differs with and without stats");
  }
  const int tgrad = (ko >> 2) & 1, only_dqt = (ko >> 5) & 1;
  int klb_v = kl_v;
  if (T_pos && ((nulls & 1) || (nulls & 2))) klb_v = REJ; /* stats and dkl required */
  if (only_dqt) klb_v = REJ;                              /* both teacher gradients or neither */
  snap_all();
  st = forkattn_kl_bwd(ctx, Lp, &tq, &tk, &tqs, &tks, kp, C.opt_null ? NULL : &opt, (nulls & 1) ? NULL : F(B_STATS),
                       (nulls & 2) ? NULL : F(B_DKL), &tdqs, &tdks, (tgrad || only_dqt) ? &tdqt : NULL,
                       tgrad && !only_dqt ? &tdkt : NULL, FORKATTN_MEMORY_HOST);
  check_call(ctx, "kl_bwd", st, klb_v, kept_v);
  const int klb_ok = st == FORKATTN_OK;
  if (klb_ok) {
    const int outs[] = {B_DQS, B_DKS, B_DQT, B_DKT};
    check_success("kl_bwd", outs, tgrad ? 4 : 2);
  }
  if (klf_ok && T_pos) ref_kl(out, klb_ok, tgrad, kl_sane, st_f, ss_f, mul);

  for (int i = 0; i < B_N; i++) {
    free(B[i].p);
    free(B[i].snap);
  }
  free(lmask);
  free(keepmap);
  free(stash_o);
  free(stash_kl);
  return 0;
}
