/* GPU forward of segment attention: OpenMP offload, `ompx_bare` teams.
 * Staging and dispatch for both kernels, and the FP32 CUDA-core kernel that
 * serves every call the tensor-core kernel (gpu_tc_fwd_launch.c) does not: f32,
 * other head_dims, strides not 16-byte aligned, kept sets. FP32 kernel:
 * teams of 128 threads, team-shared Q/K/V tiles, one online softmax per
 * query row across every pair of its segment; one team = (query block of
 * FA_GPU_ROWS rows, query head). A kept-set mask (KV compression) drops keys
 * on top of the layout's mask; key tiles its block mask drops entirely are
 * skipped. */
#include "alloc.h"
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <ompx.h>

#include "dtype_convert.h"
#include "gpu_backend.h"
#include "gpu_finite_check_policy.h"
#include "gpu_fwd.h"
#include "gpu_select_ctx.h"
#include "gpu_tma.h"
#include "gpu_stage.h"
#include "gpu_stream.h"
#include "gpu_team_memory.h"
#include "gpu_segment_walk.h"
#include "gpu_split.h"
#include "gpu_tiles.h"
#include "gpu_trace.h"
#include "online_softmax.h"

static void fa_gpu_fp32_fwd(const fa_gpu_fwd_args *ga) {
  const fa_dev_tensor q = ga->q, k = ga->k, v = ga->v, o = ga->o;
  const fa_range *seg = ga->seg;
  const fa_pair *pair = ga->pair;
  const int64_t *qoff = ga->qoff;
  const fa_block *blocks = ga->blocks;
  float *lse = ga->lse;
  const fa_kept kept = ga->kept;
  const int has_kept = ga->has_kept;
  const int64_t qshift = ga->qshift, hq = ga->hq, hkv = ga->hkv, d = ga->d;
  const int64_t bk = fa_gpu_key_tile(d, 0), pitch = d + 1, group = hq / hkv;
  const size_t smem = sizeof(float) * (size_t)(FA_GPU_ROWS * pitch + 2 * bk * pitch + FA_GPU_ROWS * (bk + 1));
  const int nteams = (int)(ga->nblocks * hq);
  const float scale = ga->scale;
  const int dev = ga->device;
#pragma omp target teams ompx_bare num_teams(nteams) thread_limit(FA_GPU_THREADS) \
    ompx_dyn_cgroup_mem(smem) device(dev) firstprivate(q, k, v, o, kept) \
    is_device_ptr(seg, pair, qoff, blocks, lse)
  {
    float *Qs = (float *)llvm_omp_target_dynamic_shared_alloc();
    float *Ks = Qs + FA_GPU_ROWS * pitch, *Vs = Ks + bk * pitch, *Ss = Vs + bk * pitch;
    const int tid = ompx_thread_id_x(), row = tid / FA_GPU_LANES, lane = tid % FA_GPU_LANES;
    const int64_t team = ompx_block_id_x(), h = team % hq, g = h / group;
    const fa_block blk = blocks[team / hq];
    const int valid = row < blk.len;
    const int64_t q_pos = blk.start + row + qshift; /* causal masks compare key-frame rows */
    const fa_kept *kp = has_kept ? &kept : NULL;     /* kept sets come with qshift = 0 */

    fa_gpu_load_tile(Qs, pitch, FA_GPU_ROWS, q, blk.start, blk.len, h, d, scale, tid);
    float acc[FA_GPU_MAX_COLS];
    for (int t = 0; t < FA_GPU_MAX_COLS; t++) acc[t] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    ompx_sync_block_acq_rel();

    for (int64_t pi = qoff[blk.seg]; pi < qoff[blk.seg + 1]; pi++) {
      const fa_pair pr = pair[pi];
      const fa_range keys = fa_pair_keys(seg, pr, blk.start, blk.len, qshift);
      const int64_t k0 = keys.start, kn = keys.len;
      for (int64_t kb = k0; kb < k0 + kn; kb += bk) {
        const int64_t nk = k0 + kn - kb < bk ? k0 + kn - kb : bk;
        if (!fa_seg_key_tile(Ks, Vs, pitch, bk, &k, &v, kp, &blk, h, g, kb, nk, d, tid)) continue; /* team-uniform */
        for (int64_t j = lane; j < bk; j += FA_GPU_LANES) {
          float s = -INFINITY;
          if (valid && j < nk && fa_visible((int)pr.causal, q_pos, kb + j) &&
              fa_kept_visible(kp, h, blk.start + row, kb + j)) {
            s = 0.0f;
            for (int64_t c = 0; c < d; c++) s += Qs[row * pitch + c] * Ks[j * pitch + c];
          }
          Ss[row * (bk + 1) + j] = s;
        }
        ompx_sync_block_acq_rel();
        /* Every thread of a row recomputes the row's max, sum and P: no second
         * barrier, and exp costs little next to the bk/8 dot products. */
        float mx = -INFINITY;
        for (int64_t j = 0; j < nk; j++) mx = fmaxf(mx, Ss[row * (bk + 1) + j]);
        const float m_new = fmaxf(m, mx), alpha = fa_rescale(m, m_new);
        l *= alpha;
        for (int t = 0; t < FA_GPU_MAX_COLS; t++) acc[t] *= alpha;
        for (int64_t j = 0; j < nk; j++) {
          const float pj = fa_prob(Ss[row * (bk + 1) + j], m_new);
          if (pj == 0.0f) continue;
          l += pj;
          for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
            int64_t c = lane + (int64_t)t * FA_GPU_LANES;
            if (c < d) acc[t] += pj * Vs[j * pitch + c];
          }
        }
        m = m_new;
        ompx_sync_block_acq_rel();
      }
    }
    float inv, row_lse;
    fa_finish(m, l, &inv, &row_lse);
    if (valid) {
      const int64_t r = blk.start + row;
      for (int t = 0; t < FA_GPU_MAX_COLS; t++) {
        int64_t c = lane + (int64_t)t * FA_GPU_LANES;
        if (c < d) fa_store(o.data, o.dtype, r * o.rs + h * o.hs + c, acc[t] * inv);
      }
      if (lse && lane == 0) lse[r * hq + h] = row_lse;
    }
  }
}

static forkattn_status fa_gpu_attn_fwd_run(forkattn_ctx *ctx, const void *args, forkattn_memory memory, int mma) {
  const fa_attn_fwd *a = args;
  const fa_plan *p = a->plan;
  const fa_block *blocks_h = NULL;
  fa_gpu_trace tr;
  fa_gpu_trace_begin(&tr, ctx->gpu->knobs.trace);
  fa_stage st;
  fa_stage_init(&st, ctx, memory == FORKATTN_MEMORY_HOST);
  fa_dev_tensor q, k, v, o;
  const int64_t rows = p->rows, qshift = p->qshift, hq = a->hq, hkv = a->hkv, d = a->d;
  float *lse = NULL;
  fa_kept kept;
  const int has_kept = a->kept != NULL;
  int bad = fa_gpu_stage_kept(&st, a->kept, &kept) || fa_stage_tensor(&st, &a->q, 1, &q) ||
            fa_stage_tensor(&st, &a->k, 1, &k) || fa_stage_tensor(&st, &a->v, 1, &v) ||
            fa_stage_tensor(&st, &a->o, 0, &o);
  fa_gpu_trace_mark(&tr, "views");
  /* the plan and, for bulk tensor copies, K's and V's tensor maps in one upload; the maps first,
   * at the block's start (64-byte aligned); maps the driver refuses select again without them */
  fa_tma_map maps[2];
  const fa_gpu_call call = fa_gpu_fwd_call(a, memory);
  fa_gpu_kernel kern = mma ? fa_gpu_choose(ctx, FA_PASS_FWD, &call) : FA_KERNEL_FP32;
  kern = fa_gpu_choose_mapped(ctx, FA_PASS_FWD, &call, kern,
                              !bad && fa_gpu_select_needs_tma(kern) &&
                                  fa_gpu_wg_pair_kv_tma(maps, &k, a->k.rows, &v, a->v.rows, hkv, d));
  const int wg_pair = kern == FA_KERNEL_WG_PAIR, tma = wg_pair;
  fa_gpu_trace_mark(&tr, "maps");
  /* f32 inputs on tensor cores: their bf16 pieces (the kernel writes o and lse in f32) */
  int qk_pieces, v_pieces;
  fa_gpu_select_pieces(&ctx->gpu->knobs, FA_PASS_FWD, kern, &call, &qk_pieces, &v_pieces);
  int64_t pstride[3] = {0, 0, 0};
  if (!bad && qk_pieces)
    bad = fa_gpu_split_pieces(&st, &q, &pstride[0], &q, a->q.rows, hq, d, qk_pieces) ||
          fa_gpu_split_pieces(&st, &k, &pstride[1], &k, a->k.rows, hkv, d, qk_pieces) ||
          fa_gpu_split_pieces(&st, &v, &pstride[2], &v, a->v.rows, hkv, d, v_pieces);
  /* query blocks: the tensor-core kernels' teams (two warpgroups: 128 rows), or the FP32 kernel's */
  const int64_t block_rows = wg_pair ? FA_WG_PAIR_ROWS : mma ? FA_MMA_ROWS : FA_GPU_ROWS;
  const int64_t nb = bad ? 0 : fa_plan_blocks_memo(p, block_rows, 0, &blocks_h);
  if (!bad && (nb < 0 || nb * a->hq > INT_MAX)) {
    fa_stage_free(&st);
    return nb < 0 ? fa_fail(ctx, FORKATTN_ERR_OUT_OF_MEMORY, "gpu fwd: cannot allocate blocks")
                  : fa_fail(ctx, FORKATTN_ERR_UNSUPPORTED, "gpu fwd: %lld teams exceed one launch",
                            (long long)(nb * a->hq));
  }
  fa_gpu_trace_mark(&tr, "blocks");
  int grid = bad ? 0 : fa_gpu_choose_grid(ctx, FA_PASS_FWD, kern, nb * hq, p, blocks_h, nb);
  /* stream teams take each item's block and first keys in one load, and need every item to see keys
   * (gpu_fwd_stream_team.h) */
  const fa_block_item *items_h = NULL;
  int see_keys = 0;
  if (grid < 0 && (fa_plan_block_items_memo(p, blocks_h, nb, &items_h, &see_keys) < 0 || !see_keys)) {
    fa_gpu_log_kernels(ctx, "schedule", "a team an item (%s)", items_h ? "a query block sees no key" : "no item table");
    grid = 0;
  }
  static const int64_t zero = 0; /* the persistent launch's work counter */
  /* V's finiteness for the two-warpgroup kernel: checked before it (gpu_finite_check.h) where its
   * walk meets tiles it would scan and the launch has items enough to pay for the check
   * (gpu_finite_check_policy.h), the flag starting at 0 for the check to raise; else 1 */
  const int v_check = wg_pair && fa_v_check_pays(fa_gpu_sms(ctx->device), nb * hq) && fa_gpu_wg_pair_fwd_scans(p);
  static const int v_flag[2] = {1, 0};
  /* the plan and, last, the tensor-core kernels' arguments (which hold the plan's device addresses):
   * one block, one copy riding on the first launch */
  fa_gpu_fwd_args ga;
  const void *plan_h[9] = {maps, p->seg, p->pair, p->q_pair_off, blocks_h, &zero, items_h, &v_flag[v_check], &ga};
  const size_t plan_bytes[9] = {tma ? sizeof maps : 0,
                                sizeof *p->seg * (size_t)p->nseg,
                                sizeof *p->pair * (size_t)p->npairs,
                                sizeof(int64_t) * (size_t)(p->nseg + 1),
                                sizeof *blocks_h * (size_t)nb,
                                sizeof zero,
                                grid < 0 ? sizeof *items_h * (size_t)nb : 0,
                                wg_pair ? sizeof v_flag[0] : 0,
                                mma ? sizeof ga : 0};
  void *plan_d[9] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
  bad = bad || fa_stage_reserve(&st, 9, plan_bytes, plan_d);
  const fa_range *seg = plan_d[1];
  const fa_pair *pair = plan_d[2];
  const int64_t *qoff = plan_d[3];
  const fa_block *blocks = plan_d[4];
  if (!bad && a->lse) bad = !(lse = fa_stage_floats(&st, a->lse, (size_t)(rows * hq), 0));
  ga = (fa_gpu_fwd_args){q,  k,    v,      o,        lse,         seg,         pair,
                         qoff, blocks, nb, hq, hkv, d, qshift, a->scale, kept, has_kept, ctx->device,
                         tma ? (const fa_tma_map *)plan_d[0] : NULL, wg_pair, plan_d[5], qk_pieces ? qk_pieces : 1,
                         v_pieces ? v_pieces : 1, {pstride[0], pstride[1], pstride[2]}, plan_d[6],
                         plan_d[7], v_check, a->v.rows};
  bad = bad || fa_stage_upload(&st, 9, plan_h, plan_bytes, plan_d);
  /* the tensor-core kernels read their arguments from that copy */
  const fa_gpu_fwd_args *ga_dev = !bad && mma ? plan_d[8] : NULL;
  if (bad) {
    forkattn_status status = fa_stage_status(&st);
    fa_stage_free(&st);
    return fa_fail(ctx, status, "gpu fwd: device %s failed",
                   status == FORKATTN_ERR_DEVICE ? "copy" : "allocation");
  }
  fa_note_workspace(ctx, st.bytes);
  fa_gpu_trace_mark(&tr, "upload");

  fa_gpu_log_kernels(ctx, "attn_fwd", "forward %s%s%s", fa_gpu_kernel_name(FA_PASS_FWD, kern),
                     qk_pieces == 3 ? ", f32 as bf16x6" : qk_pieces == 2 ? ", f32 as bf16x3" : "",
                     grid > 0 ? ", persistent teams" : grid < 0 ? ", stream teams" : "");
  if (mma) fa_gpu_mma_fwd(&ga, ga_dev, grid);
  else fa_gpu_fp32_fwd(&ga);
  fa_gpu_trace_mark(&tr, mma ? "mma_fwd" : "fp32_fwd");

  int rc = fa_stage_tensor_back(&st, &a->o, &o);
  if (!rc && a->lse) rc = fa_stage_floats_back(&st, a->lse, lse, (size_t)(rows * hq));
  fa_stage_free(&st);
  fa_gpu_trace_mark(&tr, "back");
  fa_gpu_trace_end(&tr, "attn_fwd");
  return rc ? fa_fail(ctx, FORKATTN_ERR_DEVICE, "gpu fwd: copying results back failed") : FORKATTN_OK;
}

forkattn_status fa_gpu_attn_fwd(forkattn_ctx *ctx, const fa_attn_fwd *a, forkattn_memory memory) {
  const fa_gpu_call call = fa_gpu_fwd_call(a, memory);
  return fa_gpu_stream_run(ctx, fa_gpu_attn_fwd_run, a, memory, fa_gpu_choose(ctx, FA_PASS_FWD, &call) != FA_KERNEL_FP32,
                           "gpu fwd");
}
