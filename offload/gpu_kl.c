/* GPU StreamKL: OpenMP offload, `ompx_bare` teams of 128 threads, FP32 on
 * CUDA cores, the team shape of the attention kernels (gpu_tiles.h: 16 rows x
 * 8 lanes). Semantics: cpu/cpu_kl.c (the reference) and streamkl.h.
 *
 * Forward: team = (query block, query head). Both sides' Q rows stay in team
 * memory, K tiles of both stream through. Lane l of a row folds the keys
 * j = l (mod 8) into its own online KL state and teacher log-sum-exp, so no
 * score tile is needed; the 8 partial states merge in a fixed shuffle tree.
 *
 * Backward, deterministic (no atomics): dQ of both sides by query block
 * (team = query block x query head); dK by key block, one pass per side
 * (team = key block x that side's KV head, a side's GQA group is its own),
 * summing every reader pair and query head of the group in a fixed order.
 * Heavily read key blocks (a shared prompt) are cut into units whose partial
 * sums are reduced in unit order, as in gpu_segment_bwd.c. Rows with a zero
 * upstream gradient (loss-masked) are skipped. */
#include "alloc.h"
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_backend.h"
#include "gpu_fwd.h" /* FA_MMA_ROWS */
#include "gpu_kl.h"
#include "gpu_select_ctx.h"
#include "gpu_split.h"
#include "gpu_stage.h"
#include "gpu_tiles.h"
#include "online_softmax.h"
#include "streamkl.h"


/* The side whose dK a pass computes (a) and the other one (b). */
typedef struct {
  fa_dev_tensor qa, ka, qb, kb, dk;
  int64_t da, db, hkva, groupa, groupb;
  float sca, scb;
  int teacher; /* side a is the teacher */
} fa_gpu_kl_side;

/* Team-memory floats: forward and dQ hold FA_GPU_ROWS query rows of both
 * sides plus n keys of both (dQ: and two coefficient tiles, per-row g); dK
 * holds FA_GPU_ROWS keys of both sides plus n query rows of both, the
 * coefficient tile and the rows' statistics and g. Pitches d+1 as in
 * gpu_tiles.h. */
static int64_t fa_gpu_kl_smem(int64_t da, int64_t db, int pass, int64_t n) {
  const int64_t p = da + db + 2, R = FA_GPU_ROWS;
  if (pass == 0) return (R + n) * p;                               /* forward */
  if (pass == 1) return (R + n) * p + 2 * R * (n + 1) + R;         /* dQ */
  return (R + n) * p + R * (n + 1) + n * (FORKATTN_KL_STATS + 1); /* dK */
}

static int64_t fa_gpu_kl_tile(int64_t da, int64_t db, int pass) {
  const int64_t fixed = fa_gpu_kl_smem(da, db, pass, 0);
  return fa_gpu_fit(fixed, fa_gpu_kl_smem(da, db, pass, 1) - fixed);
}

#pragma omp declare target
static inline float fa_gpu_dot(const float *a, const float *b, int64_t d) {
  float s = 0.0f;
  for (int64_t c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

/* Online log-sum-exp (m, l) of the teacher's scores on dropped keys: add one. */
static inline void fa_gpu_lse_add(float *m, float *l, float x) {
  const float m2 = fmaxf(*m, x);
  if (m2 != *m) {
    *l *= fa_rescale(*m, m2);
    *m = m2;
  }
  *l += expf(x - *m);
}

static inline void fa_gpu_lse_merge(float *m, float *l, float m2, float l2) {
  const float mx = fmaxf(*m, m2);
  *l = *l * fa_rescale(*m, mx) + l2 * fa_rescale(m2, mx);
  *m = mx;
}

static inline float fa_gpu_shfl(float v, unsigned delta) {
  return ompx_shfl_down_sync_f(0xffffffffu, v, delta, FA_GPU_LANES);
}

/* The state of the lane `delta` above (FA_GPU_LANES-wide segments). */
static inline fa_kl_state fa_gpu_kl_shfl(fa_kl_state s, unsigned delta) {
  return FA_KL_STATE_SHFL(s, fa_gpu_shfl, delta);
}

#pragma omp end declare target

/* ---- forward ------------------------------------------------------------ */

static void fa_gpu_kl_fwd_kernel(const fa_gpu_kl *b, int dev) {
  const fa_dev_tensor qt = b->qt, kt = b->kt, qs = b->qs, ks = b->ks;
  const fa_range *seg = b->seg;
  const fa_pair *pair = b->pair;
  const int64_t *qoff = b->qoff;
  const fa_block *blocks = b->qblocks;
  float *kl = b->kl, *stats = b->stats, *outside = b->outside;
  const fa_kept kept = b->kept;
  const int has_kept = b->has_kept, reverse = b->reverse;
  const int64_t H = b->h, dt = b->dt, ds = b->ds, divt = H / b->hkv_t, divs = H / b->hkv_s;
  const int64_t pt = dt + 1, ps = ds + 1, bk = fa_gpu_kl_tile(dt, ds, 0);
  const float sct = b->st, scs = b->ss, loss_mul = b->loss_mul;
  const int nteams = (int)(b->nqb * H);
  const size_t smem = sizeof(float) * (size_t)fa_gpu_kl_smem(dt, ds, 0, bk);
  if (nteams == 0) return;
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) \
    ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(qt, kt, qs, ks, kept) \
    is_device_ptr(seg, pair, qoff, blocks, kl, stats, outside)
  {
    float *Qt = (float *)llvm_omp_target_dynamic_shared_alloc();
    float *Qs = Qt + FA_GPU_ROWS * pt, *Kt = Qs + FA_GPU_ROWS * ps, *Ks = Kt + bk * pt;
    const int tid = ompx_thread_id_x(), row = tid / FA_GPU_LANES, lane = tid % FA_GPU_LANES;
    const int64_t team = ompx_block_id_x(), h = team % H;
    const fa_block blk = blocks[team / H];
    const int valid = row < blk.len;
    const int64_t r = blk.start + row; /* qshift is 0: rows are key-frame rows */
    const fa_kept *kp = has_kept ? &kept : NULL;
    fa_gpu_load_tile(Qt, pt, FA_GPU_ROWS, qt, blk.start, blk.len, h, dt, sct, tid);
    fa_gpu_load_tile(Qs, ps, FA_GPU_ROWS, qs, blk.start, blk.len, h, ds, scs, tid);
    fa_kl_state acc = fa_kl_init();
    float mtf = -INFINITY, ltf = 0.0f; /* teacher over the keys the kept set drops */
    for (int64_t pi = qoff[blk.seg]; pi < qoff[blk.seg + 1]; pi++) {
      const fa_pair pr = pair[pi];
      const fa_range keys = fa_pair_keys(seg, pr, blk.start, blk.len, 0);
      for (int64_t kb = keys.start; kb < keys.start + keys.len; kb += bk) {
        const int64_t nk = keys.start + keys.len - kb < bk ? keys.start + keys.len - kb : bk;
        ompx_sync_block_acq_rel(); /* Q loaded / previous K tile consumed */
        fa_gpu_load_tile(Kt, pt, bk, kt, kb, nk, h / divt, dt, 1.0f, tid);
        fa_gpu_load_tile(Ks, ps, bk, ks, kb, nk, h / divs, ds, 1.0f, tid);
        ompx_sync_block_acq_rel();
        if (!valid) continue;
        for (int64_t j = lane; j < nk; j += FA_GPU_LANES) {
          if (!fa_visible((int)pr.causal, r, kb + j)) continue;
          const float t = fa_gpu_dot(Qt + row * pt, Kt + j * pt, dt);
          if (!fa_kept_visible(kp, h, r, kb + j)) {
            fa_gpu_lse_add(&mtf, &ltf, t);
            continue;
          }
          fa_kl_add(&acc, t, fa_gpu_dot(Qs + row * ps, Ks + j * ps, ds));
        }
      }
    }
    /* merge the lanes' partial states into lane 0's in a fixed tree (deterministic);
     * inline here so that the states are the kernel's locals (see fa_kl_merge) */
    for (unsigned delta = FA_GPU_LANES / 2; delta > 0; delta /= 2) {
      fa_kl_state o = fa_gpu_kl_shfl(acc, delta);
      const float m2 = fa_gpu_shfl(mtf, delta), l2 = fa_gpu_shfl(ltf, delta);
      fa_kl_merge(&acc, &o);
      fa_gpu_lse_merge(&mtf, &ltf, m2, l2);
    }
    if (valid && lane == 0) {
      float stats4[FORKATTN_KL_STATS], out;
      const float div = fa_kl_row_finish(acc, mtf, ltf, reverse, stats4, &out);
      const int64_t i = r * H + h;
      kl[i] = div * loss_mul;
      if (stats)
        for (int s = 0; s < FORKATTN_KL_STATS; s++) stats[i * FORKATTN_KL_STATS + s] = stats4[s];
      if (outside) outside[i] = out;
    }
  }
}

/* ---- backward ----------------------------------------------------------- */

/* dQ of the student (and the teacher with teacher_grad) by query block. */
static void fa_gpu_kl_dq_kernel(const fa_gpu_kl *b, int dev) {
  const fa_dev_tensor qt = b->qt, kt = b->kt, qs = b->qs, ks = b->ks, dqs = b->dqs, dqt = b->dqt;
  const fa_range *seg = b->seg;
  const fa_pair *pair = b->pair;
  const int64_t *qoff = b->qoff;
  const fa_block *blocks = b->qblocks;
  const float *stats_in = b->stats_in, *dkl = b->dkl;
  const fa_kept kept = b->kept;
  const int has_kept = b->has_kept, reverse = b->reverse, teacher_grad = b->teacher_grad;
  const int64_t H = b->h, dt = b->dt, ds = b->ds, divt = H / b->hkv_t, divs = H / b->hkv_s;
  const int64_t pt = dt + 1, ps = ds + 1, bk = fa_gpu_kl_tile(dt, ds, 1), pc = bk + 1;
  const float sct = b->st, scs = b->ss, loss_mul = b->loss_mul;
  const int nteams = (int)(b->nqb * H);
  const size_t smem = sizeof(float) * (size_t)fa_gpu_kl_smem(dt, ds, 1, bk);
  if (nteams == 0) return;
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) \
    ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(qt, kt, qs, ks, dqs, dqt, kept) \
    is_device_ptr(seg, pair, qoff, blocks, stats_in, dkl)
  {
    float *Qt = (float *)llvm_omp_target_dynamic_shared_alloc();
    float *Qs = Qt + FA_GPU_ROWS * pt, *Kt = Qs + FA_GPU_ROWS * ps, *Ks = Kt + bk * pt;
    float *Ct = Ks + bk * ps, *Cs = Ct + FA_GPU_ROWS * pc, *Gr = Cs + FA_GPU_ROWS * pc;
    const int tid = ompx_thread_id_x(), row = tid / FA_GPU_LANES, lane = tid % FA_GPU_LANES;
    const int64_t team = ompx_block_id_x(), h = team % H;
    const fa_block blk = blocks[team / H];
    const int valid = row < blk.len;
    const int64_t r = blk.start + row;
    const fa_kept *kp = has_kept ? &kept : NULL;
    float s4[FORKATTN_KL_STATS] = {0.0f, 0.0f, 0.0f, 0.0f};
    const float g = valid ? dkl[r * H + h] * loss_mul : 0.0f;
    if (valid)
      for (int s = 0; s < FORKATTN_KL_STATS; s++) s4[s] = stats_in[(r * H + h) * FORKATTN_KL_STATS + s];
    if (lane == 0) Gr[row] = g;
    fa_gpu_load_tile(Qt, pt, FA_GPU_ROWS, qt, blk.start, blk.len, h, dt, sct, tid);
    fa_gpu_load_tile(Qs, ps, FA_GPU_ROWS, qs, blk.start, blk.len, h, ds, scs, tid);
    float at[FA_GPU_MAX_COLS], as[FA_GPU_MAX_COLS];
    for (int t = 0; t < FA_GPU_MAX_COLS; t++) at[t] = as[t] = 0.0f;
    ompx_sync_block_acq_rel();
    int live = 0; /* team-uniform: some row of the block has a gradient */
    for (int i = 0; i < FA_GPU_ROWS; i++) live |= Gr[i] != 0.0f;
    for (int64_t pi = qoff[blk.seg]; live && pi < qoff[blk.seg + 1]; pi++) {
      const fa_pair pr = pair[pi];
      const fa_range keys = fa_pair_keys(seg, pr, blk.start, blk.len, 0);
      for (int64_t kb = keys.start; kb < keys.start + keys.len; kb += bk) {
        const int64_t nk = keys.start + keys.len - kb < bk ? keys.start + keys.len - kb : bk;
        /* forward KL: dropped keys have no gradient on either side */
        if (!reverse && fa_kept_tile_dropped(kp, h, h + 1, blk.start, blk.len, kb, nk)) continue;
        fa_gpu_load_tile(Kt, pt, bk, kt, kb, nk, h / divt, dt, 1.0f, tid);
        fa_gpu_load_tile(Ks, ps, bk, ks, kb, nk, h / divs, ds, 1.0f, tid);
        ompx_sync_block_acq_rel();
        for (int64_t j = lane; j < bk; j += FA_GPU_LANES) {
          float ct = 0.0f, cs = 0.0f;
          if (g != 0.0f && j < nk && fa_visible((int)pr.causal, r, kb + j)) {
            const int vs = fa_kept_visible(kp, h, r, kb + j);
            if (vs || reverse) { /* else fa_kl_elem_grad gives 0 */
              const float t = fa_gpu_dot(Qt + row * pt, Kt + j * pt, dt);
              const float s = vs ? fa_gpu_dot(Qs + row * ps, Ks + j * ps, ds) : 0.0f;
              float gt, gs;
              fa_kl_elem_grad(t, s, 1, vs, s4, reverse, &gt, &gs);
              ct = gt == 0.0f ? 0.0f : g * gt;
              cs = gs == 0.0f ? 0.0f : g * gs;
            }
          }
          Ct[row * pc + j] = ct;
          Cs[row * pc + j] = cs;
        }
        ompx_sync_block_acq_rel();
        for (int64_t j = 0; j < nk; j++) {
          const float cs = Cs[row * pc + j], ct = teacher_grad ? Ct[row * pc + j] : 0.0f;
          if (cs != 0.0f) /* 0 * a non-finite key must not reach this row */
            for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
              const int64_t c = lane + (int64_t)t * FA_GPU_LANES;
              if (c < ds) as[t] += cs * Ks[j * ps + c];
            }
          if (ct != 0.0f)
            for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
              const int64_t c = lane + (int64_t)t * FA_GPU_LANES;
              if (c < dt) at[t] += ct * Kt[j * pt + c];
            }
        }
        ompx_sync_block_acq_rel();
      }
    }
    if (valid)
      for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
        const int64_t c = lane + (int64_t)t * FA_GPU_LANES;
        if (c < ds) fa_store(dqs.data, dqs.dtype, r * dqs.rs + h * dqs.hs + c, scs * as[t]);
        if (teacher_grad && c < dt) fa_store(dqt.data, dqt.dtype, r * dqt.rs + h * dqt.hs + c, sct * at[t]);
      }
  }
}

/* dK of side a by key block (or unit of its readers) x a's KV head. */
static void fa_gpu_kl_dk_kernel(const fa_gpu_kl *b, const fa_gpu_kl_side *sd, int dev) {
  const fa_dev_tensor qa = sd->qa, ka = sd->ka, qb = sd->qb, kb = sd->kb, dk = sd->dk;
  const fa_range *seg = b->seg;
  const fa_pair *pair = b->pair;
  const int64_t *kidx = b->kidx;
  const fa_block *blocks = b->kblocks;
  const fa_key_unit *units = b->units;
  const float *stats_in = b->stats_in, *dkl = b->dkl;
  float *part = b->part;
  const fa_kept kept = b->kept;
  const int has_kept = b->has_kept, reverse = b->reverse, teacher = sd->teacher;
  const int64_t H = b->h, da = sd->da, db = sd->db, hkva = sd->hkva, groupa = sd->groupa, groupb = sd->groupb;
  const int64_t pa = da + 1, pb = db + 1, bq = fa_gpu_kl_tile(da, db, 2), pc = bq + 1;
  const float sca = sd->sca, scb = sd->scb, loss_mul = b->loss_mul;
  /* the student's dK never sees a dropped key; the teacher's does in reverse KL */
  const int skip_dropped = !teacher || !reverse;
  const int nteams = (int)(b->nunits * hkva);
  const size_t smem = sizeof(float) * (size_t)fa_gpu_kl_smem(da, db, 2, bq);
  if (nteams == 0) return;
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) \
    ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(qa, ka, qb, kb, dk, kept) \
    is_device_ptr(seg, pair, kidx, blocks, units, stats_in, dkl, part)
  {
    float *Ka = (float *)llvm_omp_target_dynamic_shared_alloc();
    float *Kb = Ka + FA_GPU_ROWS * pa, *Qa = Kb + FA_GPU_ROWS * pb, *Qb = Qa + bq * pa, *C = Qb + bq * pb;
    float *S4 = C + FA_GPU_ROWS * pc, *G = S4 + bq * FORKATTN_KL_STATS;
    const int tid = ompx_thread_id_x(), row = tid / FA_GPU_LANES, lane = tid % FA_GPU_LANES;
    const int64_t team = ompx_block_id_x(), g = team % hkva, ui = team / hkva;
    const fa_key_unit unit = units[ui];
    const fa_block blk = blocks[unit.block];
    const int valid = row < blk.len;
    const int64_t krow = blk.start + row;
    const fa_kept *kp = has_kept ? &kept : NULL;
    fa_gpu_load_tile(Ka, pa, FA_GPU_ROWS, ka, blk.start, blk.len, g, da, 1.0f, tid);
    float acc[FA_GPU_MAX_COLS];
    for (int t = 0; t < FA_GPU_MAX_COLS; t++) acc[t] = 0.0f;
    for (int64_t j = unit.j0; j <= unit.j1; j++) {
      const fa_pair pr = pair[kidx[j]];
      const fa_range queries = fa_pair_queries(seg, pr, blk.start, 0);
      const int64_t lo = j == unit.j0 ? unit.lo : 0, hi = j == unit.j1 ? unit.hi : queries.len;
      const int64_t q0 = queries.start + lo, qn = hi - lo;
      for (int64_t hh = 0; hh < groupa; hh++) {
        const int64_t h = g * groupa + hh;
        /* Kb's last readers finished before the last barrier: no barrier needed */
        fa_gpu_load_tile(Kb, pb, FA_GPU_ROWS, kb, blk.start, blk.len, h / groupb, db, 1.0f, tid);
        for (int64_t q = q0; q < q0 + qn; q += bq) {
          const int64_t nq = q0 + qn - q < bq ? q0 + qn - q : bq;
          if (skip_dropped && fa_kept_tile_dropped(kp, h, h + 1, q, nq, blk.start, blk.len)) continue;
          ompx_sync_block_acq_rel(); /* previous tile fully consumed */
          fa_gpu_load_tile(Qa, pa, bq, qa, q, nq, h, da, sca, tid);
          fa_gpu_load_tile(Qb, pb, bq, qb, q, nq, h, db, scb, tid);
          for (int64_t i = tid; i < bq; i += FA_GPU_THREADS) {
            const int64_t x = (q + i) * H + h;
            G[i] = i < nq ? dkl[x] * loss_mul : 0.0f;
            for (int s = 0; s < FORKATTN_KL_STATS; s++)
              S4[i * FORKATTN_KL_STATS + s] = i < nq ? stats_in[x * FORKATTN_KL_STATS + s] : 0.0f;
          }
          ompx_sync_block_acq_rel();
          int live = 0; /* team-uniform: some query row of the tile has a gradient */
          for (int64_t i = 0; i < nq; i++) live |= G[i] != 0.0f;
          if (!live) continue;
          for (int64_t i = lane; i < bq; i += FA_GPU_LANES) {
            float coef = 0.0f;
            if (valid && i < nq && G[i] != 0.0f && fa_visible((int)pr.causal, q + i, krow)) {
              const int vs = fa_kept_visible(kp, h, q + i, krow);
              if (vs || (teacher && reverse)) { /* else fa_kl_elem_grad gives 0 for side a */
                const float sa = fa_gpu_dot(Qa + i * pa, Ka + row * pa, da);
                const float sb = vs ? fa_gpu_dot(Qb + i * pb, Kb + row * pb, db) : 0.0f;
                float gt, gs;
                fa_kl_elem_grad(teacher ? sa : sb, teacher ? sb : sa, 1, vs, S4 + i * FORKATTN_KL_STATS, reverse,
                                &gt, &gs);
                const float ga = teacher ? gt : gs;
                coef = ga == 0.0f ? 0.0f : G[i] * ga;
              }
            }
            C[row * pc + i] = coef;
          }
          ompx_sync_block_acq_rel();
          for (int64_t i = 0; i < nq; i++) {
            const float cf = C[row * pc + i];
            if (cf == 0.0f) continue;
            for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
              const int64_t c = lane + (int64_t)t * FA_GPU_LANES;
              if (c < da) acc[t] += cf * Qa[i * pa + c];
            }
          }
        }
      }
    }
    if (valid) {
      const int64_t slot = ((ui * hkva + g) * FA_GPU_ROWS + row) * da;
      for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
        const int64_t c = lane + (int64_t)t * FA_GPU_LANES;
        if (c >= da) continue;
        if (part) part[slot + c] = acc[t];
        else fa_store(dk.data, dk.dtype, krow * dk.rs + g * dk.hs + c, acc[t]);
      }
    }
  }
}

/* Sum the units' partial dK of every key block in unit order (deterministic). */
static void fa_gpu_kl_dk_reduce(const fa_gpu_kl *b, const fa_gpu_kl_side *sd, int dev) {
  const fa_dev_tensor dk = sd->dk;
  const float *part = b->part;
  const fa_block *blocks = b->kblocks;
  const int64_t *unit_off = b->unit_off;
  const int64_t hkv = sd->hkva, d = sd->da, R = b->krows, n = b->nkb * hkv * R * d;
#pragma omp target teams distribute parallel for device(dev) firstprivate(dk) is_device_ptr(part, blocks, unit_off)
  for (int64_t i = 0; i < n; i++) {
    const int64_t c = i % d, row = (i / d) % R, g = (i / (d * R)) % hkv;
    const int64_t kb = i / (d * R * hkv);
    const fa_block blk = blocks[kb];
    if (row >= blk.len) continue;
    float s = 0.0f;
    for (int64_t u = unit_off[kb]; u < unit_off[kb + 1]; u++) s += part[((u * hkv + g) * R + row) * d + c];
    fa_store(dk.data, dk.dtype, (blk.start + row) * dk.rs + g * dk.hs + c, s);
  }
}

/* Zero a [rows, heads, d] device tensor (dK rows no pair reads get no gradient). */
static void fa_gpu_kl_zero(fa_dev_tensor t, int64_t rows, int64_t heads, int64_t d, int dev) {
  const int64_t n = rows * heads * d;
#pragma omp target teams distribute parallel for device(dev) firstprivate(t)
  for (int64_t i = 0; i < n; i++) {
    const int64_t c = i % d, h = (i / d) % heads, r = i / (d * heads);
    fa_store(t.data, t.dtype, r * t.rs + h * t.hs + c, 0.0f);
  }
}

/* ---- host side ---------------------------------------------------------- */

static void fa_gpu_kl_init(fa_gpu_kl *b, const fa_kl_call *c) {
  *b = (fa_gpu_kl){.h = c->h, .hkv_t = c->hkv_t, .hkv_s = c->hkv_s, .dt = c->dt, .ds = c->ds, .st = c->st,
                   .ss = c->ss, .loss_mul = c->loss_mul, .reverse = c->reverse, .teacher_grad = c->teacher_grad,
                   .has_kept = c->kept != NULL};
}

/* Plan arrays, the four score tensors and the kept mask. 0 or -1. */
static int fa_gpu_kl_stage_inputs(fa_stage *st, const fa_kl_call *c, fa_gpu_kl *b) {
  const fa_plan *p = c->plan;
  b->seg = fa_stage_array(st, p->seg, sizeof *p->seg * (size_t)p->nseg);
  b->pair = fa_stage_array(st, p->pair, sizeof *p->pair * (size_t)p->npairs);
  return !b->seg || !b->pair || fa_gpu_stage_kept(st, c->kept, &b->kept) || fa_stage_tensor(st, &c->qt, 1, &b->qt) ||
         fa_stage_tensor(st, &c->kt, 1, &b->kt) || fa_stage_tensor(st, &c->qs, 1, &b->qs) ||
         fa_stage_tensor(st, &c->ks, 1, &b->ks)
             ? -1
             : 0;
}

/* f32 inputs on tensor cores: the pass's pieces (fa_gpu_select_pieces) of the four staged inputs, in
 * place of their views (b->pieces, b->pstride). Returns the pieces (0: none) in *pieces; -1 when the
 * scratch cannot be had. */
static int fa_gpu_kl_split(fa_stage *st, const forkattn_ctx *ctx, fa_gpu_pass pass, fa_gpu_kernel kern,
                           const fa_gpu_call *call, const fa_kl_call *c, fa_gpu_kl *b, int *pieces) {
  int no_v;
  fa_gpu_select_pieces(&ctx->gpu->knobs, pass, kern, call, pieces, &no_v);
  const int np = *pieces;
  if (!np) return 0;
  b->pieces = np;
  return fa_gpu_split_pieces(st, &b->qt, &b->pstride[0], &b->qt, c->qt.rows, c->h, c->dt, np) ||
                 fa_gpu_split_pieces(st, &b->kt, &b->pstride[1], &b->kt, c->kt.rows, c->hkv_t, c->dt, np) ||
                 fa_gpu_split_pieces(st, &b->qs, &b->pstride[2], &b->qs, c->qs.rows, c->h, c->ds, np) ||
                 fa_gpu_split_pieces(st, &b->ks, &b->pstride[3], &b->ks, c->ks.rows, c->hkv_s, c->ds, np)
             ? -1
             : 0;
}

static forkattn_status fa_gpu_kl_stage_failed(forkattn_ctx *ctx, fa_stage *st, const char *what) {
  const forkattn_status status = fa_stage_status(st);
  fa_stage_free(st);
  return fa_fail(ctx, status, "gpu %s: device %s failed", what, status == FORKATTN_ERR_DEVICE ? "copy" : "allocation");
}

forkattn_status fa_gpu_kl_fwd(forkattn_ctx *ctx, const fa_kl_call *c, forkattn_memory memory) {
  const fa_plan *p = c->plan;
  const fa_block *qb_h;
  const fa_gpu_call call = fa_gpu_kl_call(c, memory, 0);
  const fa_gpu_kernel kern = fa_gpu_choose(ctx, FA_PASS_KL_FWD, &call);
  const int mma = kern != FA_KERNEL_FP32;
  const int64_t nqb = fa_plan_blocks_memo(p, mma ? FA_MMA_ROWS : FA_GPU_ROWS, 0, &qb_h);
  if (nqb < 0) return fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "gpu kl_fwd: cannot allocate blocks");
  if (nqb * c->h > INT_MAX)
    return fa_fail(ctx, FORKATTN_ERR_UNSUPPORTED, "gpu kl_fwd: %lld teams exceed one launch",
                   (long long)(nqb * c->h));
  const size_t n = (size_t)(p->rows * c->h);
  fa_stage st;
  fa_stage_init(&st, ctx, memory == FORKATTN_MEMORY_HOST);
  fa_gpu_kl b;
  fa_gpu_kl_init(&b, c);
  b.nqb = nqb;
  b.qoff = fa_stage_array(&st, p->q_pair_off, sizeof(int64_t) * (size_t)(p->nseg + 1));
  b.qblocks = fa_stage_array(&st, qb_h, sizeof *qb_h * (size_t)nqb);
  b.kl = fa_stage_floats(&st, c->kl, n, 0);
  int bad = !b.qoff || !b.qblocks || !b.kl || fa_gpu_kl_stage_inputs(&st, c, &b);
  int pieces = 0;
  if (!bad) bad = fa_gpu_kl_split(&st, ctx, FA_PASS_KL_FWD, kern, &call, c, &b, &pieces);
  if (!bad && c->stats) bad = !(b.stats = fa_stage_floats(&st, c->stats, n * FORKATTN_KL_STATS, 0));
  if (!bad && c->outside) bad = !(b.outside = fa_stage_floats(&st, c->outside, n, 0));
  if (bad) return fa_gpu_kl_stage_failed(ctx, &st, "kl_fwd");
  fa_note_workspace(ctx, st.bytes);
  fa_gpu_log_kernels(ctx, "kl_fwd", "StreamKL forward %s%s", fa_gpu_kernel_name(FA_PASS_KL_FWD, kern),
                     pieces == 3 ? ", f32 as bf16x6" : pieces == 2 ? ", f32 as bf16x3" : "");
  if (mma) fa_gpu_mma_kl_fwd(&b, ctx->device);
  else fa_gpu_kl_fwd_kernel(&b, ctx->device);
  int rc = fa_stage_floats_back(&st, c->kl, b.kl, n);
  if (!rc && c->stats) rc = fa_stage_floats_back(&st, c->stats, b.stats, n * FORKATTN_KL_STATS);
  if (!rc && c->outside) rc = fa_stage_floats_back(&st, c->outside, b.outside, n);
  fa_stage_free(&st);
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "gpu kl_fwd: copying results back failed") : FORKATTN_OK;
}

static fa_gpu_kl_side fa_gpu_kl_side_of(const fa_gpu_kl *b, int teacher) {
  fa_gpu_kl_side s = {.qa = teacher ? b->qt : b->qs, .ka = teacher ? b->kt : b->ks, .qb = teacher ? b->qs : b->qt,
                      .kb = teacher ? b->ks : b->kt, .dk = teacher ? b->dkt : b->dks,
                      .da = teacher ? b->dt : b->ds, .db = teacher ? b->ds : b->dt,
                      .hkva = teacher ? b->hkv_t : b->hkv_s, .sca = teacher ? b->st : b->ss,
                      .scb = teacher ? b->ss : b->st, .teacher = teacher};
  s.groupa = b->h / s.hkva;
  s.groupb = b->h / (teacher ? b->hkv_s : b->hkv_t);
  return s;
}

/* dK of one side: zero rows no pair reads, the block kernel (tensor cores
 * with mma), the reduce. */
static void fa_gpu_kl_dk_side(const fa_gpu_kl *b, int teacher, int64_t rows, int covered, int mma, int dev) {
  const fa_gpu_kl_side sd = fa_gpu_kl_side_of(b, teacher);
  if (!covered) fa_gpu_kl_zero(sd.dk, rows, sd.hkva, sd.da, dev);
  if (mma) fa_gpu_mma_kl_dk(b, teacher, dev);
  else fa_gpu_kl_dk_kernel(b, &sd, dev);
  if (b->part) fa_gpu_kl_dk_reduce(b, &sd, dev);
}

/* Device views of the backward's plan arrays, blocks, units and partials. */
static int fa_gpu_kl_stage_blocks(fa_stage *st, const fa_plan *p, const fa_kl_call *c, fa_gpu_kl *b,
                                  const fa_block *qb_h, const fa_block *kb_h, const fa_key_unit *units_h,
                                  const int64_t *unit_off_h) {
  const void *plan_h[6] = {p->q_pair_off, p->k_pair_idx, qb_h, kb_h, units_h, unit_off_h};
  const size_t plan_bytes[6] = {sizeof(int64_t) * (size_t)(p->nseg + 1), sizeof(int64_t) * (size_t)p->npairs,
                                sizeof *qb_h * (size_t)b->nqb,           sizeof *kb_h * (size_t)b->nkb,
                                sizeof *units_h * (size_t)b->nunits,     sizeof *unit_off_h * (size_t)(b->nkb + 1)};
  void *plan_d[6] = {NULL};
  int bad = fa_stage_arrays(st, 6, plan_h, plan_bytes, plan_d);
  b->qoff = plan_d[0], b->kidx = plan_d[1], b->qblocks = plan_d[2], b->kblocks = plan_d[3];
  b->units = plan_d[4], b->unit_off = plan_d[5];
  if (!bad && b->nunits > b->nkb) { /* split blocks: partial sums, then the reduce kernel */
    const int64_t ws = c->hkv_s * c->ds, wt = c->teacher_grad ? c->hkv_t * c->dt : 0;
    b->part = fa_stage_scratch(st, sizeof(float) * (size_t)(b->nunits * b->krows * (ws > wt ? ws : wt)));
    bad = !b->part;
  }
  return bad ? -1 : 0;
}

forkattn_status fa_gpu_kl_bwd(forkattn_ctx *ctx, const fa_kl_call *c, forkattn_memory memory) {
  const fa_plan *p = c->plan;
  const fa_block *qb_h = NULL, *kb_h = NULL;
  const fa_key_unit *units_h = NULL; /* kept with the plan, as its blocks */
  const int64_t *unit_off_h = NULL;
  int64_t nunits = -1;
  const fa_gpu_call call = fa_gpu_kl_call(c, memory, 1);
  const fa_gpu_kernel kern = fa_gpu_choose(ctx, FA_PASS_KL_BWD, &call);
  const int mma = kern != FA_KERNEL_FP32;
  const int64_t krows = mma ? FA_MMA_ROWS : FA_GPU_ROWS;
  const int64_t nqb = fa_plan_blocks_memo(p, krows, 0, &qb_h);
  const int64_t nkb = fa_plan_blocks_memo(p, krows, 1, &kb_h);
  if (nqb >= 0 && nkb >= 0)
    nunits = fa_plan_key_units_memo(p, kb_h, nkb, fa_gpu_dkv_chunk(p, kb_h, nkb, c->hkv_s, mma), &units_h, &unit_off_h);
  const int64_t hkv_max = c->teacher_grad && c->hkv_t > c->hkv_s ? c->hkv_t : c->hkv_s;
  forkattn_status status = FORKATTN_OK;
  if (nunits < 0)
    status = fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "gpu kl_bwd: cannot allocate blocks");
  else if (nqb * c->h > INT_MAX || nunits * hkv_max > INT_MAX)
    status = fa_fail(ctx, FORKATTN_ERR_UNSUPPORTED, "gpu kl_bwd: too many teams for one launch");
  int64_t covered = 0; /* key rows some pair reads */
  for (int64_t i = 0; !status && i < nkb; i++) covered += kb_h[i].len;
  fa_stage st;
  fa_stage_init(&st, ctx, memory == FORKATTN_MEMORY_HOST);
  fa_gpu_kl b;
  fa_gpu_kl_init(&b, c);
  b.nqb = nqb;
  b.nkb = nkb;
  b.nunits = nunits;
  b.krows = krows;
  int bad = 0, pieces = 0;
  if (!status) {
    const size_t n = (size_t)(p->rows * c->h);
    b.stats_in = fa_stage_floats(&st, (float *)c->stats_in, n * FORKATTN_KL_STATS, 1);
    b.dkl = fa_stage_floats(&st, (float *)c->dkl, n, 1);
    bad = !b.stats_in || !b.dkl || fa_gpu_kl_stage_blocks(&st, p, c, &b, qb_h, kb_h, units_h, unit_off_h) ||
          fa_gpu_kl_stage_inputs(&st, c, &b) || fa_gpu_kl_split(&st, ctx, FA_PASS_KL_BWD, kern, &call, c, &b, &pieces) ||
          fa_stage_tensor(&st, &c->dqs, 0, &b.dqs) || fa_stage_tensor(&st, &c->dks, 0, &b.dks);
    if (!bad && c->teacher_grad)
      bad = fa_stage_tensor(&st, &c->dqt, 0, &b.dqt) || fa_stage_tensor(&st, &c->dkt, 0, &b.dkt);
  }
  if (status) return status;
  if (bad) return fa_gpu_kl_stage_failed(ctx, &st, "kl_bwd");
  fa_note_workspace(ctx, st.bytes);
  const int dev = ctx->device;
  fa_gpu_log_kernels(ctx, "kl_bwd", "StreamKL backward %s%s", fa_gpu_kernel_name(FA_PASS_KL_BWD, kern),
                     pieces == 3 ? ", f32 as bf16x6" : pieces == 2 ? ", f32 as bf16x3" : "");
  if (!mma) {
    fa_gpu_kl_dq_kernel(&b, dev);
  } else {
    fa_gpu_mma_kl_dq(&b, 0, dev);
    if (c->teacher_grad) fa_gpu_mma_kl_dq(&b, 1, dev);
  }
  fa_gpu_kl_dk_side(&b, 0, p->rows, covered == p->rows, mma, dev);
  if (c->teacher_grad) fa_gpu_kl_dk_side(&b, 1, p->rows, covered == p->rows, mma, dev);
  int rc = fa_stage_tensor_back(&st, &c->dqs, &b.dqs) || fa_stage_tensor_back(&st, &c->dks, &b.dks);
  if (!rc && c->teacher_grad)
    rc = fa_stage_tensor_back(&st, &c->dqt, &b.dqt) || fa_stage_tensor_back(&st, &c->dkt, &b.dkt);
  fa_stage_free(&st);
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "gpu kl_bwd: copying gradients back failed") : FORKATTN_OK;
}
