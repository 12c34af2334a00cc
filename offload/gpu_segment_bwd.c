/* GPU backward of segment attention (FlashAttention-2 style, deterministic):
 * D = rowsum(dO * O); dQ by query block (team = query block x query head);
 * dK/dV by key block (team = key block x KV head) summing over every pair and
 * query head that reads it, so a shared prompt's gradients need no atomics.
 * FP32 compute; same team shape and tiles as the forward (gpu_tiles.h).
 * A kept-set mask zeroes P and dS of the keys it drops, by query head. */
#include "alloc.h"
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_backend.h"
#include "gpu_bwd.h"
#include "gpu_stage.h"
#include "gpu_stream.h"
#include "gpu_trace.h"
#include "gpu_segment_walk.h"
#include "gpu_split.h"
#include "gpu_tiles.h"
#include "gpu_select_ctx.h"
#include "gpu_tma.h"
#include "online_softmax.h"
#include "rowsum_exact.h"
#include "validate.h"



/* D = rowsum(dO * O) per (row, query head): one warp per pair, lanes over the
 * head's columns (coalesced), a shuffle tree for the sum (fixed order:
 * deterministic). */
#define FA_ROWSUM_WARPS 8
static void fa_gpu_rowsum(const fa_gpu_bwd *b, const fa_gpu_bwd *argp) {
  const int nteams = (int)((b->rows * b->hq + FA_ROWSUM_WARPS - 1) / FA_ROWSUM_WARPS), dev = b->device;
  /* arguments from the staged copy: a routed call's kernels may not read a firstprivate struct (the
   * runtime's copy of it is neither ordered with the caller's stream nor kept until they run) */
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(32 * FA_ROWSUM_WARPS) device(dev) is_device_ptr(argp)
  {
    const fa_dev_tensor o = argp->o, dout = argp->dout;
    float *dsum = argp->dsum;
    const int64_t n = argp->rows * argp->hq, hq = argp->hq, d = argp->d;
    const int tid = ompx_thread_id_x(), lane = tid % 32;
    const int64_t i = (int64_t)ompx_block_id_x() * FA_ROWSUM_WARPS + tid / 32; /* warp-uniform */
    if (i < n) {
      const int64_t r = i / hq, h = i % hq;
      float s = 0.0f;
      for (int64_t c = lane; c < d; c += 32)
        s += fa_load(o.data, o.dtype, r * o.rs + h * o.hs + c) * fa_load(dout.data, dout.dtype, r * dout.rs + h * dout.hs + c);
      for (unsigned off = 16; off > 0; off /= 2) s += ompx_shfl_down_sync_f(~0ull, s, off, 32);
      if (lane == 0) dsum[i] = s;
    }
  }
}

/* D of every row, a team per query block, a warp per (row, query head), lanes over the columns,
 * shuffle trees in a fixed order (deterministic): blocks that see few keys from the inputs,
 * sum_j exp(s_j - lse) (dO . v_j) (lib/core/rowsum_exact.h), the others as dO . O. */
static void fa_gpu_rowsum_blocks(const fa_gpu_bwd *b, const fa_gpu_bwd *argp) {
  const int nteams = (int)b->nqb, dev = b->device;
  /* arguments from the staged copy, as fa_gpu_rowsum */
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(32 * FA_ROWSUM_WARPS) device(dev) is_device_ptr(argp)
  {
    const fa_dev_tensor q = argp->q, k = argp->k, v = argp->v, o = argp->o, dout = argp->dout;
    const float *lse = argp->lse;
    float *dsum = argp->dsum;
    const fa_range *seg = argp->seg;
    const fa_pair *pair = argp->pair;
    const int64_t *qoff = argp->qoff;
    const fa_block *blocks = argp->qblocks;
    const int64_t hq = argp->hq, d = argp->d, group = argp->hq / argp->hkv, qshift = argp->qshift;
    const float scale = argp->scale;
    const int tid = ompx_thread_id_x(), lane = tid % 32, warp = tid / 32;
    const fa_block blk = blocks[ompx_block_id_x()];
    const int64_t p0 = qoff[blk.seg], p1 = qoff[blk.seg + 1];
    const int exact = fa_block_key_count(seg, pair, p0, p1, blk.start, blk.len, qshift) <= FA_EXACT_D_KEYS;
    for (int64_t i = warp; i < blk.len * hq; i += FA_ROWSUM_WARPS) { /* warp-uniform */
      const int64_t r = blk.start + i / hq, h = i % hq, g = h / group;
      const float l = lse[r * hq + h];
      float qr[FA_MAX_HEAD_DIM / 32], dor[FA_MAX_HEAD_DIM / 32], sum = 0.0f; /* the row's q (or o) and dO */
      for (int c = 0; c < FA_MAX_HEAD_DIM / 32 && lane + 32 * c < d; c++) {
        qr[c] = exact ? fa_load(q.data, q.dtype, r * q.rs + h * q.hs + lane + 32 * c)
                      : fa_load(o.data, o.dtype, r * o.rs + h * o.hs + lane + 32 * c);
        dor[c] = fa_load(dout.data, dout.dtype, r * dout.rs + h * dout.hs + lane + 32 * c);
        if (!exact) sum += qr[c] * dor[c];
      }
      if (!exact)
        for (unsigned off = 16; off > 0; off /= 2) sum += ompx_shfl_down_sync_f(~0ull, sum, off, 32);
      for (int64_t pi = p0; exact && pi < p1 && l != -INFINITY; pi++) {
        const fa_range keys = fa_pair_keys(seg, pair[pi], r, 1, qshift);
        for (int64_t j = keys.start; j < keys.start + keys.len; j++) {
          float s = 0.0f, dp = 0.0f;
          for (int c = 0; c < FA_MAX_HEAD_DIM / 32 && lane + 32 * c < d; c++) {
            s += qr[c] * fa_load(k.data, k.dtype, j * k.rs + g * k.hs + lane + 32 * c);
            dp += dor[c] * fa_load(v.data, v.dtype, j * v.rs + g * v.hs + lane + 32 * c);
          }
          for (unsigned off = 16; off > 0; off /= 2) {
            s += ompx_shfl_down_sync_f(~0ull, s, off, 32);
            dp += ompx_shfl_down_sync_f(~0ull, dp, off, 32);
          }
          sum += expf(s * scale - l) * dp; /* lane 0's sums are the whole ones */
        }
      }
      if (lane == 0) dsum[r * hq + h] = sum;
    }
  }
}

/* 1 when some query block of the backward sees few enough keys to take its D from the inputs. */
static int fa_gpu_rowsum_exact_needed(const fa_attn_bwd *a, const fa_block *qb, int64_t nqb) {
  if (a->o.dtype == FORKATTN_DTYPE_F32 || a->kept) return 0;
  return fa_plan_fewest_query_keys(a->plan, qb, nqb) <= FA_EXACT_D_KEYS;
}

static void fa_gpu_dq(const fa_gpu_bwd *b, int dev) {
  const fa_dev_tensor q = b->q, k = b->k, v = b->v, dout = b->dout, dq = b->dq;
  const float *lse = b->lse, *dsum = b->dsum;
  const fa_range *seg = b->seg;
  const fa_pair *pair = b->pair;
  const int64_t *qoff = b->qoff;
  const fa_block *blocks = b->qblocks;
  const int64_t hq = b->hq, d = b->d, group = b->hq / b->hkv, pitch = d + 1, bk = fa_gpu_key_tile(d, 1);
  const int64_t qshift = b->qshift;
  const float scale = b->scale;
  const fa_kept kept = b->kept;
  const int has_kept = b->has_kept;
  const int nteams = (int)(b->nqb * hq);
  const size_t smem = sizeof(float) * (size_t)(2 * FA_GPU_ROWS * pitch + 2 * bk * pitch + FA_GPU_ROWS * (bk + 1));
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) \
    ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(q, k, v, dout, dq, kept) \
    is_device_ptr(lse, dsum, seg, pair, qoff, blocks)
  {
    float *Qs = (float *)llvm_omp_target_dynamic_shared_alloc();
    float *Os = Qs + FA_GPU_ROWS * pitch, *Ks = Os + FA_GPU_ROWS * pitch, *Vs = Ks + bk * pitch,
          *Ss = Vs + bk * pitch;
    const int tid = ompx_thread_id_x(), row = tid / FA_GPU_LANES, lane = tid % FA_GPU_LANES;
    const int64_t team = ompx_block_id_x(), h = team % hq, g = h / group;
    const fa_block blk = blocks[team / hq];
    const int valid = row < blk.len;
    const int64_t r = blk.start + row, q_pos = r + qshift;
    const fa_kept *kp = has_kept ? &kept : NULL; /* kept sets come with qshift = 0 */
    const float row_lse = valid ? lse[r * hq + h] : -INFINITY, row_d = valid ? dsum[r * hq + h] : 0.0f;
    fa_gpu_load_tile(Qs, pitch, FA_GPU_ROWS, q, blk.start, blk.len, h, d, scale, tid);
    fa_gpu_load_tile(Os, pitch, FA_GPU_ROWS, dout, blk.start, blk.len, h, d, 1.0f, tid);
    float acc[FA_GPU_MAX_COLS];
    for (int t = 0; t < FA_GPU_MAX_COLS; t++) acc[t] = 0.0f;
    ompx_sync_block_acq_rel();
    for (int64_t pi = qoff[blk.seg]; pi < qoff[blk.seg + 1]; pi++) {
      const fa_pair pr = pair[pi];
      const fa_range keys = fa_pair_keys(seg, pr, blk.start, blk.len, qshift);
      const int64_t k0 = keys.start, kn = keys.len;
      for (int64_t kb = k0; kb < k0 + kn; kb += bk) {
        const int64_t nk = k0 + kn - kb < bk ? k0 + kn - kb : bk;
        if (!fa_seg_key_tile(Ks, Vs, pitch, bk, &k, &v, kp, &blk, h, g, kb, nk, d, tid)) continue; /* team-uniform */
        for (int64_t j = lane; j < bk; j += FA_GPU_LANES) {
          float ds = 0.0f;
          if (valid && j < nk && fa_visible((int)pr.causal, q_pos, kb + j) && fa_kept_visible(kp, h, r, kb + j)) {
            float s = 0.0f, dp = 0.0f;
            for (int64_t c = 0; c < d; c++) {
              s += Qs[row * pitch + c] * Ks[j * pitch + c];
              dp += Os[row * pitch + c] * Vs[j * pitch + c];
            }
            ds = fa_prob_lse(s, row_lse) * (dp - row_d);
          }
          Ss[row * (bk + 1) + j] = ds;
        }
        ompx_sync_block_acq_rel();
        for (int64_t j = 0; j < nk; j++) {
          const float ds = Ss[row * (bk + 1) + j];
          if (ds == 0.0f) continue; /* masked: 0 * a non-finite key must not reach this row */
          for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
            int64_t c = lane + (int64_t)t * FA_GPU_LANES;
            if (c < d) acc[t] += ds * Ks[j * pitch + c];
          }
        }
        ompx_sync_block_acq_rel();
      }
    }
    if (valid)
      for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
        int64_t c = lane + (int64_t)t * FA_GPU_LANES;
        if (c < d) fa_store(dq.data, dq.dtype, r * dq.rs + h * dq.hs + c, scale * acc[t]);
      }
  }
}

static void fa_gpu_dkv(const fa_gpu_bwd *b, int dev) {
  const fa_dev_tensor q = b->q, k = b->k, v = b->v, dout = b->dout, dk = b->dk, dv = b->dv;
  const float *lse = b->lse, *dsum = b->dsum;
  float *part_k = b->part_k, *part_v = b->part_v;
  const fa_range *seg = b->seg;
  const fa_pair *pair = b->pair;
  const int64_t *kidx = b->kidx;
  const fa_block *blocks = b->kblocks;
  const fa_key_unit *units = b->units;
  const int64_t hq = b->hq, hkv = b->hkv, d = b->d, group = b->hq / b->hkv, pitch = d + 1;
  const int64_t qshift = b->qshift;
  const int64_t bq = fa_gpu_query_tile(d);
  const float scale = b->scale;
  const fa_kept kept = b->kept;
  const int has_kept = b->has_kept;
  const int nteams = (int)(b->nunits * hkv);
  const size_t smem = sizeof(float) * (size_t)(2 * FA_GPU_ROWS * pitch + 2 * bq * pitch +
                                               2 * FA_GPU_ROWS * (bq + 1) + 2 * bq);
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) \
    ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(q, k, v, dout, dk, dv, kept) \
    is_device_ptr(lse, dsum, seg, pair, kidx, blocks, units, part_k, part_v)
  {
    float *Ks = (float *)llvm_omp_target_dynamic_shared_alloc();
    float *Vs = Ks + FA_GPU_ROWS * pitch, *Qs = Vs + FA_GPU_ROWS * pitch, *Os = Qs + bq * pitch,
          *Ps = Os + bq * pitch, *Ds = Ps + FA_GPU_ROWS * (bq + 1), *Ls = Ds + FA_GPU_ROWS * (bq + 1),
          *Rs = Ls + bq;
    const int tid = ompx_thread_id_x(), row = tid / FA_GPU_LANES, lane = tid % FA_GPU_LANES;
    const int64_t team = ompx_block_id_x(), g = team % hkv, ui = team / hkv;
    const fa_key_unit unit = units[ui];
    const fa_block blk = blocks[unit.block];
    const int valid = row < blk.len;
    const fa_kept *kp = has_kept ? &kept : NULL; /* applied with each query head of the group */
    fa_gpu_load_tile(Ks, pitch, FA_GPU_ROWS, k, blk.start, blk.len, g, d, 1.0f, tid);
    fa_gpu_load_tile(Vs, pitch, FA_GPU_ROWS, v, blk.start, blk.len, g, d, 1.0f, tid);
    float adk[FA_GPU_MAX_COLS], adv[FA_GPU_MAX_COLS];
    for (int t = 0; t < FA_GPU_MAX_COLS; t++) adk[t] = adv[t] = 0.0f;
    for (int64_t j = unit.j0; j <= unit.j1; j++) {
      const fa_pair pr = pair[kidx[j]];
      const int64_t k_pos = blk.start + row;
      const fa_range queries = fa_pair_queries(seg, pr, blk.start, qshift);
      const int64_t lo = j == unit.j0 ? unit.lo : 0, hi = j == unit.j1 ? unit.hi : queries.len;
      const int64_t q0 = queries.start + lo, qn = hi - lo;
      for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = g * group + hh;
        for (int64_t qb = q0; qb < q0 + qn; qb += bq) {
          const int64_t nq = q0 + qn - qb < bq ? q0 + qn - qb : bq;
          if (fa_kept_tile_dropped(kp, h, h + 1, qb, nq, blk.start, blk.len)) continue; /* team-uniform */
          ompx_sync_block_acq_rel(); /* previous tile fully consumed */
          fa_gpu_load_tile(Qs, pitch, bq, q, qb, nq, h, d, scale, tid);
          fa_gpu_load_tile(Os, pitch, bq, dout, qb, nq, h, d, 1.0f, tid);
          for (int64_t i = tid; i < bq; i += FA_GPU_THREADS) {
            Ls[i] = i < nq ? lse[(qb + i) * hq + h] : -INFINITY;
            Rs[i] = i < nq ? dsum[(qb + i) * hq + h] : 0.0f;
          }
          ompx_sync_block_acq_rel();
          for (int64_t i = lane; i < bq; i += FA_GPU_LANES) {
            float pv = 0.0f, ds = 0.0f;
            if (valid && i < nq && fa_visible((int)pr.causal, qb + i + qshift, k_pos) &&
                fa_kept_visible(kp, h, qb + i, k_pos)) {
              float s = 0.0f, dp = 0.0f;
              for (int64_t c = 0; c < d; c++) {
                s += Qs[i * pitch + c] * Ks[row * pitch + c];
                dp += Os[i * pitch + c] * Vs[row * pitch + c];
              }
              pv = fa_prob_lse(s, Ls[i]);
              ds = pv * (dp - Rs[i]);
            }
            Ps[row * (bq + 1) + i] = pv;
            Ds[row * (bq + 1) + i] = ds;
          }
          ompx_sync_block_acq_rel();
          for (int64_t i = 0; i < nq; i++) {
            const float pv = Ps[row * (bq + 1) + i], ds = Ds[row * (bq + 1) + i];
            if (pv == 0.0f && ds == 0.0f) continue;
            for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
              int64_t c = lane + (int64_t)t * FA_GPU_LANES;
              if (c < d) {
                adv[t] += pv * Os[i * pitch + c];
                adk[t] += ds * Qs[i * pitch + c];
              }
            }
          }
        }
      }
    }
    if (valid) {
      const int64_t r = blk.start + row, slot = ((ui * hkv + g) * FA_GPU_ROWS + row) * d; /* krows = FA_GPU_ROWS */
      for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
        int64_t c = lane + (int64_t)t * FA_GPU_LANES;
        if (c >= d) continue;
        if (part_k) {
          part_k[slot + c] = adk[t];
          part_v[slot + c] = adv[t];
        } else {
          fa_store(dk.data, dk.dtype, r * dk.rs + g * dk.hs + c, adk[t]);
          fa_store(dv.data, dv.dtype, r * dv.rs + g * dv.hs + c, adv[t]);
        }
      }
    }
  }
}

/* Sum the units' partial dK/dV of every key block in unit order (deterministic). */
/* dK, dV of split key blocks: the sum of their units' partials, in unit
 * order (deterministic). One team per (key block, KV head, row), threads
 * over the columns: coalesced, and no 64-bit division per element. */
static void fa_gpu_dkv_reduce(const fa_gpu_bwd *b, const fa_gpu_bwd *argp) {
  const int nteams = (int)(b->nkb * b->hkv * b->krows), dev = b->device; /* <= the dK/dV launch's teams x rows */
  /* arguments from the staged copy (nothing the runtime copies: it may run on the caller's stream) */
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) device(dev) is_device_ptr(argp)
  {
    const fa_dev_tensor dk = argp->dk, dv = argp->dv;
    const float *part_k = argp->part_k, *part_v = argp->part_v;
    const fa_block *blocks = argp->kblocks;
    const int64_t *unit_off = argp->unit_off;
    const int64_t hkv = argp->hkv, d = argp->d, kr = argp->krows;
    const int64_t team = ompx_block_id_x(), row = team % kr, g = team / kr % hkv, kb = team / (kr * hkv);
    const fa_block blk = blocks[kb];
    if (row < blk.len) {
      const int64_t r = blk.start + row;
      for (int64_t c = ompx_thread_id_x(); c < d; c += FA_GPU_THREADS) {
        float sk = 0.0f, sv = 0.0f;
        for (int64_t u = unit_off[kb]; u < unit_off[kb + 1]; u++) {
          const int64_t slot = ((u * hkv + g) * kr + row) * d + c;
          sk += part_k[slot];
          sv += part_v[slot];
        }
        fa_store(dk.data, dk.dtype, r * dk.rs + g * dk.hs + c, sk);
        fa_store(dv.data, dv.dtype, r * dv.rs + g * dv.hs + c, sv);
      }
    }
  }
}

/* dK/dV teams that run at once on an H200 (132 SMs): the FP32 kernel fits 8
 * per SM, the tensor-core kernel 2 (255 registers x 128 threads), its
 * two-warpgroup form 1. Heavily read key blocks (a shared prompt) are cut
 * into units of reader queries (fa_plan_key_chunk) only when one (key block,
 * KV head) team would carry more than a slot's share of the work; on a GPU
 * with fewer SMs the cut is coarser than ideal, never wrong. */
#define FA_GPU_SMS 132

int64_t fa_gpu_dkv_chunk(const fa_plan *p, const fa_block *kb, int64_t nkb, int64_t hkv, int mma) {
  return fa_plan_key_chunk(p, kb, nkb, hkv, (mma == 2 ? 1 : mma ? 2 : 8) * FA_GPU_SMS);
}

static forkattn_status fa_gpu_attn_bwd_run(forkattn_ctx *ctx, const void *args, forkattn_memory memory, int mma) {
  const fa_attn_bwd *a = args;
  const fa_plan *p = a->plan;
  const fa_block *qb_h = NULL, *kb_h = NULL;
  const fa_key_unit *units_h = NULL; /* kept with the plan, as its blocks */
  const int64_t *unit_off_h = NULL;
  fa_gpu_trace tr;
  fa_gpu_trace_begin(&tr, ctx->gpu->knobs.trace);
  fa_stage st;
  fa_stage_init(&st, ctx, memory == FORKATTN_MEMORY_HOST);
  fa_gpu_bwd b = {.rows = p->rows, .qshift = p->qshift, .hq = a->hq, .hkv = a->hkv, .d = a->d, .scale = a->scale,
                  .device = ctx->device};
  b.dsum = fa_stage_scratch(&st, sizeof(float) * (size_t)(p->rows * a->hq));
  b.has_kept = a->kept != NULL;
  int bad = fa_gpu_stage_kept(&st, a->kept, &b.kept);
  b.lse = fa_stage_floats(&st, (float *)a->lse, (size_t)(p->rows * a->hq), 1);
  bad = bad || !b.dsum || !b.lse || fa_stage_tensor(&st, &a->q, 1, &b.q) || fa_stage_tensor(&st, &a->k, 1, &b.k) ||
        fa_stage_tensor(&st, &a->v, 1, &b.v) || fa_stage_tensor(&st, &a->o, 1, &b.o) ||
        fa_stage_tensor(&st, &a->dout, 1, &b.dout) || fa_stage_tensor(&st, &a->dq, 0, &b.dq) ||
        fa_stage_tensor(&st, &a->dk, 0, &b.dk) || fa_stage_tensor(&st, &a->dv, 0, &b.dv);
  fa_gpu_trace_mark(&tr, "views");
  /* The kernels' choice (their maps encoded on the staged tensors), then their blocks: key blocks of
   * krows rows (the dK/dV teams'), query blocks of the dQ teams' rows. maps: the dK/dV's Q and dO maps,
   * the two-warpgroup dQ's K and V maps, uploaded with the plan, first (64-byte aligned). */
  fa_tma_map maps[4];
  const fa_gpu_call call = fa_gpu_bwd_call(a, memory);
  fa_gpu_kernel kdq = mma ? fa_gpu_choose(ctx, FA_PASS_DQ, &call) : FA_KERNEL_FP32;
  fa_gpu_kernel kdkv = mma ? fa_gpu_choose(ctx, FA_PASS_DKV, &call) : FA_KERNEL_FP32;
  kdkv = fa_gpu_choose_mapped(ctx, FA_PASS_DKV, &call, kdkv,
                              !bad && fa_gpu_select_needs_tma(kdkv) &&
                                  fa_gpu_mma_dkv_tma(maps, &b.q, a->q.rows, &b.dout, a->dout.rows, a->hq, a->d));
  kdq = fa_gpu_choose_mapped(ctx, FA_PASS_DQ, &call, kdq,
                             !bad && fa_gpu_select_needs_tma(kdq) &&
                                 fa_gpu_wg_pair_kv_tma(maps + 2, &b.k, a->k.rows, &b.v, a->v.rows, a->hkv, a->d));
  const int tma = fa_gpu_select_needs_tma(kdkv);
  /* f32 inputs on tensor cores: q, k, v and dout as bf16 pieces for the split teams; D from the f32 o
   * and dout by the rowsum kernel before them (dsum_ready) */
  int np, np_v;
  fa_gpu_select_pieces(&ctx->gpu->knobs, FA_PASS_DQ, kdq, &call, &np, &np_v);
  if (!bad && np)
    bad = fa_gpu_split_pieces(&st, &b.pq, &b.pstride[0], &b.q, a->q.rows, a->hq, a->d, np) ||
          fa_gpu_split_pieces(&st, &b.pk, &b.pstride[1], &b.k, a->k.rows, a->hkv, a->d, np) ||
          fa_gpu_split_pieces(&st, &b.pv, &b.pstride[2], &b.v, a->v.rows, a->hkv, a->d, np_v) ||
          fa_gpu_split_pieces(&st, &b.pdo, &b.pstride[3], &b.dout, a->dout.rows, a->hq, a->d, np_v);
  b.pieces = np;
  b.dq_wg_pair = kdq == FA_KERNEL_WG_PAIR;
  b.dkv_wg_pair = kdkv == FA_KERNEL_WG_PAIR;
  b.krows = b.dkv_wg_pair ? FA_WG_PAIR_ROWS : mma ? FA_MMA_ROWS : FA_GPU_ROWS;
  const int64_t qrows = b.dq_wg_pair ? FA_WG_PAIR_ROWS : mma ? FA_MMA_ROWS : FA_GPU_ROWS;
  fa_gpu_trace_mark(&tr, "maps");
  if (!bad) {
    b.nkb = fa_plan_blocks_memo(p, b.krows, 1, &kb_h);
    const int64_t chunk = b.nkb < 0 ? 0 : fa_gpu_dkv_chunk(p, kb_h, b.nkb, a->hkv, b.dkv_wg_pair ? 2 : mma);
    b.nunits = b.nkb < 0 ? -1 : fa_plan_key_units_memo(p, kb_h, b.nkb, chunk, &units_h, &unit_off_h);
    b.nqb = fa_plan_blocks_memo(p, qrows, 0, &qb_h);
    bad = b.nkb < 0 || b.nunits < 0 || b.nqb < 0;
  }
  if (!bad && (b.nqb * a->hq > INT_MAX || b.nunits * a->hkv > INT_MAX || b.nkb * a->hkv * b.krows > INT_MAX ||
               p->rows * a->hq / FA_ROWSUM_WARPS >= INT_MAX)) {
    fa_stage_free(&st);
    return fa_fail(ctx, FORKATTN_ERR_UNSUPPORTED, "gpu bwd: too many teams for one launch");
  }
  b.dsum_ready = !bad && (b.pieces || fa_gpu_rowsum_exact_needed(a, qb_h, b.nqb));
  fa_gpu_trace_mark(&tr, "blocks");
  void *plan_d[11] = {NULL};
  if (!bad) {
    static const int64_t zero = 0; /* the persistent dQ's work counter */
    /* the plan and, last, the kernels' arguments (which hold the plan's device addresses): one block,
     * one copy riding on the first launch */
    const void *plan_h[11] = {maps, p->seg,  p->pair, p->q_pair_off, p->k_pair_idx,
                              qb_h, kb_h,    units_h, unit_off_h,    &zero, &b};
    const size_t plan_bytes[11] = {tma || b.dq_wg_pair ? sizeof maps : 0,
                                   sizeof *p->seg * (size_t)p->nseg,       sizeof *p->pair * (size_t)p->npairs,
                                   sizeof(int64_t) * (size_t)(p->nseg + 1), sizeof(int64_t) * (size_t)p->npairs,
                                   sizeof *qb_h * (size_t)b.nqb,           sizeof *kb_h * (size_t)b.nkb,
                                   sizeof *units_h * (size_t)b.nunits,     sizeof *unit_off_h * (size_t)(b.nkb + 1),
                                   sizeof zero,                            sizeof b};
    bad = fa_stage_reserve(&st, 11, plan_bytes, plan_d);
    b.tma = tma ? (const fa_tma_map *)plan_d[0] : NULL;
    b.kv_tma = b.dq_wg_pair ? (const fa_tma_map *)plan_d[0] + 2 : NULL;
    b.seg = plan_d[1], b.pair = plan_d[2], b.qoff = plan_d[3], b.kidx = plan_d[4];
    b.qblocks = plan_d[5], b.kblocks = plan_d[6], b.units = plan_d[7], b.unit_off = plan_d[8];
    b.work = plan_d[9];
    if (!bad && b.nunits > b.nkb) { /* split blocks: partial sums, then the reduce kernel */
      const size_t part = sizeof(float) * (size_t)(b.nunits * a->hkv * b.krows * a->d);
      b.part_k = fa_stage_scratch(&st, part);
      b.part_v = fa_stage_scratch(&st, part);
      bad = !b.part_k || !b.part_v;
    }
    bad = bad || fa_stage_upload(&st, 11, plan_h, plan_bytes, plan_d);
  }
  /* the tensor-core kernels and the reduce read their arguments from that copy */
  const fa_gpu_bwd *b_dev = !bad ? plan_d[10] : NULL;
  const int grid = bad ? 0 : fa_gpu_choose_grid(ctx, FA_PASS_DQ, kdq, b.nqb * a->hq, p, qb_h, b.nqb);
  if (bad) {
    forkattn_status status = fa_stage_status(&st);
    fa_stage_free(&st);
    return fa_fail(ctx, status, "gpu bwd: device %s failed",
                   status == FORKATTN_ERR_DEVICE ? "copy" : "allocation");
  }
  fa_note_workspace(ctx, st.bytes);
  fa_gpu_trace_mark(&tr, "upload");
  if (b.dsum_ready && !b.pieces) { /* some blocks take D from the inputs */
    fa_gpu_rowsum_blocks(&b, b_dev);
    fa_gpu_trace_mark(&tr, "rowsum_blocks");
  } else if (!mma || b.pieces) { /* else the tensor-core dQ kernel computes D itself */
    fa_gpu_rowsum(&b, b_dev);
    fa_gpu_trace_mark(&tr, "rowsum");
  }
  fa_gpu_log_kernels(ctx, "attn_bwd", "dQ %s%s, dK/dV %s%s", fa_gpu_kernel_name(FA_PASS_DQ, kdq),
                     grid ? ", persistent teams" : "", fa_gpu_kernel_name(FA_PASS_DKV, kdkv),
                     np == 3 ? ", f32 as bf16x6" : np == 2 ? ", f32 as bf16x3" : "");
  if (mma) {
    fa_gpu_mma_dq(&b, b_dev, grid);
    fa_gpu_trace_mark(&tr, "mma_dq");
    fa_gpu_mma_dkv(&b, b_dev);
    fa_gpu_trace_mark(&tr, "mma_dkv");
  } else {
    fa_gpu_dq(&b, ctx->device);
    fa_gpu_trace_mark(&tr, "fp32_dq");
    fa_gpu_dkv(&b, ctx->device);
    fa_gpu_trace_mark(&tr, "fp32_dkv");
  }
  if (b.part_k) fa_gpu_dkv_reduce(&b, b_dev);
  fa_gpu_trace_mark(&tr, "reduce");
  int rc = fa_stage_tensor_back(&st, &a->dq, &b.dq) || fa_stage_tensor_back(&st, &a->dk, &b.dk) ||
           fa_stage_tensor_back(&st, &a->dv, &b.dv);
  fa_stage_free(&st);
  fa_gpu_trace_mark(&tr, "back");
  fa_gpu_trace_end(&tr, "attn_bwd");
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "gpu bwd: copying gradients back failed") : FORKATTN_OK;
}

forkattn_status fa_gpu_attn_bwd(forkattn_ctx *ctx, const fa_attn_bwd *a, forkattn_memory memory) {
  /* the tensor-core kernels and the reduce take their arguments from the staged copy: routable */
  const fa_gpu_call call = fa_gpu_bwd_call(a, memory);
  const int mma = fa_gpu_choose(ctx, FA_PASS_DQ, &call) != FA_KERNEL_FP32 &&
                  fa_gpu_choose(ctx, FA_PASS_DKV, &call) != FA_KERNEL_FP32;
  return fa_gpu_stream_run(ctx, fa_gpu_attn_bwd_run, a, memory, mma, "gpu bwd");
}
