"""PyTorch front end of distillation and KV compression: kept sets, kept-set attention and
StreamKL (the attention-distribution KL divergence in O(rows) extra memory).

* :class:`KeptSet`: the keys a compressed KV cache keeps, per head, as plain CPU tensors
  (CSR ``offsets``/``index`` int64 and/or a ``block_mask`` uint8 of 64x64 blocks);
  :func:`kv_select` builds one with StreamingLLM / H2O / SnapKV (``forkattn_kv_select``).
* :func:`stream_kl`: per-row KL between the teacher's and the student's attention
  distributions, differentiable w.r.t. the student's q and k (and the teacher's on request);
  saves only the ``[T, H, 4]`` statistics, never a rows x keys tensor.
* :func:`kept_attention`: attention restricted to a kept set (the compressed rollout's
  attention), differentiable in q, k, v.
* :func:`kl_outside_mass`: the teacher's probability on the keys a kept set drops.

Like :mod:`forkattn.ops`, each operation is a ``torch.library`` custom op
(``torch.ops.forkattn.kl_fwd`` / ``kl_bwd``, ``kept_fwd`` / ``kept_bwd``) with a fake
implementation and registered autograd, and a ``torch.autograd.Function``
(:class:`StreamKLFunction`, :class:`KeptAttentionFunction`) for PyTorch without custom ops.
Layouts and kept sets enter the ops as their integer tensors and ints.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _lib
from .layouts import SharedPrefixLayout, TreeLayout, _ints_as_i64
from .ops import HAVE_CUSTOM_OPS, use_custom_ops, _check_qkv, _check_bwd, _ctx_for, _desc, _DTYPES, _host_i64, _ints
from .ops import _follows_context, _records_context
from .ops import _scale_of

__all__ = [
    "KeptSet",
    "kv_select",
    "stream_kl",
    "kept_attention",
    "kl_outside_mass",
    "StreamKLFunction",
    "KeptAttentionFunction",
    "KL_STATS",
    "KEPT_BLOCK",
]

KL_STATS = _lib.KL_STATS
KEPT_BLOCK = _lib.KEPT_BLOCK
Tensor = torch.Tensor
_i64 = torch.int64


# --------------------------------------------------------------------------------------------
# kept sets


def _invalid(msg):
    return _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, msg)


def _i64_1d(x, name):
    return _ints_as_i64(x, name, (RuntimeError, ValueError, OverflowError)).reshape(-1).contiguous()


class KeptSet:
    """The keys a compressed KV cache keeps, per head (``forkattn_kept_set``), as CPU tensors.

    Two forms, either or both (combined with AND):

    * **index lists** (CSR): head ``h`` keeps key rows ``index[offsets[h]:offsets[h+1]]``
      (strictly increasing, each ``< compressed_rows``) among the packed key rows
      ``[0, compressed_rows)``; key rows ``>= compressed_rows`` (generated after compression)
      are always kept; the lists restrict only query rows ``>= query_start`` (earlier rows, a
      prefill that saw the full cache, are unrestricted). ``offsets`` [heads+1] and ``index``
      are int64.
    * **block mask**: ``block_mask`` uint8 ``[heads, nb, nb]`` with ``nb = ceil(T / 64)``;
      ``block_mask[h, i, j] = 0`` drops every key of key block ``j`` for every query of query
      block ``i`` (blocks of :data:`KEPT_BLOCK` packed rows). Its size ties it to one ``T``.

    Query head ``hq`` uses kept head ``hq // (Hq // heads)`` (``heads`` must divide the query
    heads). A query row whose visible keys are all dropped sees nothing: attention gives
    ``o = 0``, ``lse = -inf``; StreamKL gives ``kl = 0`` and outside mass 1.

    ``KeptSet(heads, offsets=None, index=None, compressed_rows=0, query_start=0,
    block_mask=None)`` takes the arrays as they are (the C library checks them when used);
    :meth:`from_lists`, :meth:`from_mask`, :meth:`from_block_mask` and :func:`kv_select` build
    one.
    """

    def __init__(self, heads, offsets=None, index=None, compressed_rows=0, query_start=0, block_mask=None):
        self.heads = int(heads)
        if self.heads < 1:
            raise _invalid("kept: heads %d must be >= 1" % self.heads)
        if (offsets is None) != (index is None):
            raise _invalid("kept: offsets and index must both be given or both be None")
        self.offsets = None if offsets is None else _i64_1d(offsets, "offsets")
        self.index = None if index is None else _i64_1d(index, "index")
        self.compressed_rows = int(compressed_rows)
        self.query_start = int(query_start)
        if self.offsets is not None:
            _lib.make_kept(self.heads, self.compressed_rows, self.query_start, self.offsets.tolist(),
                           (0, self.index.numel()), None, 0)  # sizes and monotonic offsets
        self.block_mask = None
        if block_mask is not None:
            bm = block_mask.detach().cpu() if isinstance(block_mask, torch.Tensor) else torch.as_tensor(block_mask)
            if bm.is_floating_point() or bm.is_complex():
                raise TypeError("forkattn: block_mask must be bool or 0/1 integers, got %s" % bm.dtype)
            if bm.dim() != 3 or bm.shape[0] != self.heads or bm.shape[1] != bm.shape[2]:
                raise _invalid("kept: block_mask must be [heads = %d, nb, nb], got shape %s"
                               % (self.heads, tuple(bm.shape)))
            if bm.dtype != torch.bool and bm.numel() and bool(((bm != 0) & (bm != 1)).any()):
                raise _invalid("kept: block_mask must hold only 0 and 1")
            self.block_mask = (bm != 0).to(torch.uint8).contiguous()

    # -- constructors
    @classmethod
    def from_lists(cls, lists, compressed_rows, query_start=0, block_mask=None):
        """Per head, the kept key rows (any order; sorted here) among ``[0, compressed_rows)``:
        ``lists`` a sequence of int sequences/tensors, or a 2-D ``[heads, n]`` integer tensor."""
        if isinstance(lists, torch.Tensor) and lists.dim() == 2:
            lists = list(lists)
        rows = [torch.sort(_i64_1d(x, "lists[%d]" % h)).values for h, x in enumerate(lists)]
        if not rows:
            raise _invalid("kept: from_lists needs one list per head (got none)")
        lens = torch.tensor([r.numel() for r in rows], dtype=_i64)
        offsets = torch.zeros(len(rows) + 1, dtype=_i64)
        torch.cumsum(lens, 0, out=offsets[1:])
        return cls(len(rows), offsets, torch.cat(rows), compressed_rows, query_start, block_mask)

    @classmethod
    def from_mask(cls, keep, query_start=0, block_mask=None):
        """From a dense ``[heads, compressed_rows]`` bool mask of kept keys."""
        keep = torch.as_tensor(keep).detach().cpu()
        if keep.dim() != 2:
            raise _invalid("kept: from_mask needs a [heads, compressed_rows] mask, got shape %s" % (tuple(keep.shape),))
        keep = keep != 0
        lists = [row.nonzero()[:, 0] for row in keep]
        return cls.from_lists(lists, keep.shape[1], query_start, block_mask)

    @classmethod
    def from_block_mask(cls, block_mask):
        """A kept set that is only a ``[heads, nb, nb]`` block mask (bool or 0/1)."""
        bm = torch.as_tensor(block_mask)
        if bm.dim() != 3:
            raise _invalid("kept: block_mask must be [heads, nb, nb], got shape %s" % (tuple(bm.shape),))
        return cls(bm.shape[0], block_mask=bm)

    def with_block_mask(self, block_mask):
        """The same lists combined (AND) with a block mask."""
        return KeptSet(self.heads, self.offsets, self.index, self.compressed_rows, self.query_start, block_mask)

    # -- views
    @property
    def has_lists(self):
        return self.offsets is not None

    def lists(self):
        """Per head, the kept key rows (int64 tensors); None without lists."""
        if self.offsets is None:
            return None
        o = self.offsets.tolist()
        return [self.index[o[h]:o[h + 1]] for h in range(self.heads)]

    def dense_mask(self, num_rows):
        """``[heads, num_rows, num_rows]`` bool: may query row i of kept head h see key row j
        (the kept set only; the layout's own mask is not applied). O(T^2): for debugging and
        tests."""
        T = int(num_rows)
        m = torch.ones(self.heads, T, T, dtype=torch.bool)
        if self.offsets is not None:
            cr = min(self.compressed_rows, T)
            keep = torch.zeros(self.heads, max(self.compressed_rows, 0), dtype=torch.bool)
            for h, idx in enumerate(self.lists()):
                keep[h, idx] = True
            rows = torch.arange(T) >= self.query_start
            m[:, rows, :cr] &= keep[:, None, :cr]
        if self.block_mask is not None:
            B = KEPT_BLOCK
            nb = self.block_mask.shape[1]
            if nb != _lib.kept_blocks(T):
                raise _invalid("kept: block_mask has %d blocks per side, %d rows need %d"
                               % (nb, T, _lib.kept_blocks(T)))
            blk = torch.arange(T) // B
            m &= self.block_mask.bool()[:, blk][:, :, blk]
        return m

    def op_args(self):
        """(offsets, index, block_mask, heads, compressed_rows, query_start): what the custom
        ops take."""
        return (self.offsets, self.index, self.block_mask, self.heads, self.compressed_rows, self.query_start)

    def state_dict(self):
        return {"heads": self.heads, "offsets": self.offsets, "index": self.index,
                "compressed_rows": self.compressed_rows, "query_start": self.query_start,
                "block_mask": self.block_mask}

    def __repr__(self):
        parts = ["heads=%d" % self.heads]
        if self.offsets is not None:
            parts.append("kept=%s of compressed_rows=%d, query_start=%d"
                         % ((self.offsets[1:] - self.offsets[:-1]).tolist(), self.compressed_rows, self.query_start))
        if self.block_mask is not None:
            parts.append("block_mask %dx%d (%d of %d blocks kept)"
                         % (self.block_mask.shape[1], self.block_mask.shape[2], int(self.block_mask.sum()),
                            self.block_mask.numel()))
        return "KeptSet(%s)" % ", ".join(parts)


_NO_KEPT = (None, None, None, 0, 0, 0)


def _kept_args(kept):
    if kept is None:
        return _NO_KEPT
    if not isinstance(kept, KeptSet):
        raise TypeError("forkattn: kept must be a forkattn.KeptSet or None, got %s" % type(kept).__name__)
    return kept.op_args()


def kv_select(q, k, policy="h2o", budget=None, *, sinks=None, window=None, pool_kernel=None, scale=None,
              query_start=None):
    """Select the keys a compressed KV cache keeps for one causal sequence of ``L`` rows
    (``forkattn_kv_select``; streaming, no L x L buffer) and return them as a :class:`KeptSet`
    with ``heads = Hkv``, ``compressed_rows = L`` and ``query_start = L`` by default (rows
    generated after the compression are restricted, the prefill is not).

    q [L, Hq, d], k [L, Hkv, d] (CPU or CUDA; the selection runs on the host). ``policy``:
    ``"streaming_llm"`` (the first ``sinks`` keys and the most recent ``budget - sinks``),
    ``"h2o"`` (the ``window`` most recent keys plus the heavy hitters by accumulated causal
    attention mass), ``"snapkv"`` (the last ``window`` queries score the earlier keys, pooled
    over ``pool_kernel`` positions). ``budget``: kept keys per KV head; unset fields take
    ``forkattn_kv_policy_init``'s defaults (sinks 4, H2O window budget/2, SnapKV window
    min(32, budget), pool_kernel 5, scale 1/sqrt(d)). Rows are relative to the sequence: pass
    the rows that start at packed row 0 (a prompt, a tree's root)."""
    if budget is None:
        raise TypeError("forkattn.kv_select: budget is required")
    with torch.no_grad():
        _check_qk_pair(q, k, "q", "k")
        pol = _lib.kv_policy(policy, budget, sinks, window, pool_kernel, scale)
        keep_q, qd = _desc(q)
        keep_k, kd = _desc(k)
        ctx, mem = _ctx_for(q)
        offs, idx, n = _lib.kv_select(ctx, pol, qd, kd, mem)
    offsets = torch.tensor(list(offs), dtype=_i64)
    index = torch.tensor(list(idx)[:n], dtype=_i64)
    L = int(q.shape[0])
    return KeptSet(int(k.shape[1]), offsets, index, L, L if query_start is None else int(query_start))


# --------------------------------------------------------------------------------------------
# layouts as op arguments


def _layout_args(layout, rows):
    """(prompt_lens, response_lens, group_sizes, node_offsets, parents): the prefix triple for a
    SharedPrefixLayout (causal groups), the tree pair for a TreeLayout, None elsewhere; layout
    None is one dense causal sequence of ``rows`` rows."""
    if isinstance(layout, SharedPrefixLayout):
        return (layout.prompt_lens, layout.response_lens, layout.group_sizes, None, None)
    if isinstance(layout, TreeLayout):
        return (None, None, None, layout.node_offsets, layout.parents)
    if layout is None:
        return (torch.tensor([int(rows)], dtype=_i64), torch.zeros(0, dtype=_i64), torch.zeros(1, dtype=_i64),
                None, None)
    raise TypeError("forkattn: layout must be a SharedPrefixLayout, a TreeLayout or None (one dense causal "
                    "sequence), got %s" % type(layout).__name__)


def _spec(prompt_lens, response_lens, group_sizes, node_offsets, parents):
    """(layout spec for _lib, host tensors kept alive)."""
    if node_offsets is not None:
        if parents is None:
            raise ValueError("forkattn: node_offsets without parents")
        offs, par = _host_i64(node_offsets), _host_i64(parents)
        return ("tree", (offs.data_ptr(), offs.numel()), (par.data_ptr(), par.numel())), (offs, par)
    if prompt_lens is None or response_lens is None or group_sizes is None:
        raise ValueError("forkattn: a layout needs prompt_lens, response_lens and group_sizes, or node_offsets "
                         "and parents")
    P, S, R = _ints(prompt_lens, "prompt_lens"), _ints(group_sizes, "group_sizes"), _ints(response_lens, "response_lens")
    return ("prefix", P, S, R), ()


def _kept(kept_offsets, kept_index, kept_block_mask, kept_heads, compressed_rows, query_start, rows):
    """(make_kept dict or None, host tensors kept alive)."""
    if kept_offsets is None and kept_index is None and kept_block_mask is None:
        return None, ()
    keep = []
    offs = idx = bm = None
    if kept_offsets is not None or kept_index is not None:
        if kept_offsets is None or kept_index is None:
            raise _invalid("kept: offsets and index must both be given or both be None")
        offs = _ints(kept_offsets, "kept offsets")
        it = _host_i64(kept_index)
        keep.append(it)
        idx = (it.data_ptr(), it.numel())
    if kept_block_mask is not None:
        b = kept_block_mask.detach().reshape(-1).to(device="cpu", dtype=torch.uint8).contiguous()
        keep.append(b)
        bm = (b.data_ptr(), b.numel())
    return _lib.make_kept(kept_heads, compressed_rows, query_start, offs, idx, bm, rows), keep


# --------------------------------------------------------------------------------------------
# checks


def _check_qk_pair(q, k, qn, kn):
    for name, x in ((qn, q), (kn, k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError("forkattn: %s must be a torch.Tensor, got %s" % (name, type(x).__name__))
        if x.dim() != 3:
            raise ValueError("forkattn: %s must be [rows, heads, head_dim], got shape %s" % (name, tuple(x.shape)))
    if q.dtype not in _DTYPES:
        raise ValueError("forkattn: dtype %s is not supported (float32, bfloat16, float16; compute is float32)"
                         % q.dtype)
    if k.dtype != q.dtype:
        raise ValueError("forkattn: %s and %s must share one dtype, got %s, %s" % (qn, kn, q.dtype, k.dtype))
    if k.device != q.device:
        raise ValueError("forkattn: %s and %s must be on one device, got %s, %s" % (qn, kn, q.device, k.device))
    if q.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError("forkattn: tensors on %s are not supported (cpu or cuda)" % q.device)


def _check_kl_inputs(q_t, k_t, q_s, k_s):
    """Checks that need no data (also run by the fake implementations); sizes (rows, heads,
    GQA, head_dim) are checked by the C library."""
    _check_qk_pair(q_t, k_t, "q_t", "k_t")
    _check_qk_pair(q_s, k_s, "q_s", "k_s")
    if q_s.device != q_t.device:
        raise ValueError("forkattn: teacher and student must be on one device, got %s, %s" % (q_t.device, q_s.device))


def _f32(x, shape, name):
    if x.dtype != torch.float32 or tuple(x.shape) != tuple(shape):
        raise _invalid("%s must be float32 %s, got %s %s" % (name, tuple(shape), x.dtype, tuple(x.shape)))
    return x.contiguous()


def _ptr(x):
    return x.data_ptr() or None


# --------------------------------------------------------------------------------------------
# implementations (eager, real tensors)


def _kl_fwd_impl(q_t, k_t, q_s, k_s, prompt_lens, response_lens, group_sizes, node_offsets, parents,
                 kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows, kept_query_start,
                 direction, scale_teacher, scale_student, temperature, scale_by_tau2):
    _check_kl_inputs(q_t, k_t, q_s, k_s)
    T, H = q_t.shape[0], q_t.shape[1]
    spec, keep_l = _spec(prompt_lens, response_lens, group_sizes, node_offsets, parents)
    kept, keep_k = _kept(kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                         kept_query_start, T)
    opt = _lib.kl_options(direction, scale_teacher, scale_student, temperature, scale_by_tau2)
    dev = q_t.device
    kl = torch.empty((T, H), dtype=torch.float32, device=dev)
    stats = torch.empty((T, H, KL_STATS), dtype=torch.float32, device=dev)
    outside = torch.empty((T, H), dtype=torch.float32, device=dev)
    keep = [_desc(x) for x in (q_t, k_t, q_s, k_s)]
    ctx, mem = _ctx_for(q_t)  # after every copy above: the call is ordered after them
    _lib.kl_fwd(ctx, spec, *[d for _, d in keep], kept, opt, _ptr(kl), _ptr(stats), _ptr(outside), mem)
    return kl, stats, outside


def _kl_bwd_impl(dkl, q_t, k_t, q_s, k_s, stats, prompt_lens, response_lens, group_sizes, node_offsets, parents,
                 kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows, kept_query_start,
                 direction, scale_teacher, scale_student, temperature, scale_by_tau2, teacher_grad):
    _check_kl_inputs(q_t, k_t, q_s, k_s)
    T, H = q_t.shape[0], q_t.shape[1]
    dkl = _f32(dkl, (T, H), "dkl")
    stats = _f32(stats, (T, H, KL_STATS), "stats")
    spec, keep_l = _spec(prompt_lens, response_lens, group_sizes, node_offsets, parents)
    kept, keep_k = _kept(kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                         kept_query_start, T)
    opt = _lib.kl_options(direction, scale_teacher, scale_student, temperature, scale_by_tau2)
    dq_s, dk_s = torch.empty_like(q_s, memory_format=torch.contiguous_format), \
        torch.empty_like(k_s, memory_format=torch.contiguous_format)
    if teacher_grad:
        dq_t = torch.empty_like(q_t, memory_format=torch.contiguous_format)
        dk_t = torch.empty_like(k_t, memory_format=torch.contiguous_format)
    else:
        dq_t, dk_t = q_t.new_empty(0), k_t.new_empty(0)
    keep = [_desc(x) for x in (q_t, k_t, q_s, k_s, dq_s, dk_s)]
    dt = [_desc(x) for x in (dq_t, dk_t)] if teacher_grad else [(None, None), (None, None)]
    ctx, mem = _ctx_for(q_t)
    _lib.kl_bwd(ctx, spec, *[d for _, d in keep[:4]], kept, opt, _ptr(stats), _ptr(dkl), keep[4][1], keep[5][1],
                dt[0][1], dt[1][1], mem)
    return dq_s, dk_s, dq_t, dk_t


def _kept_fwd_impl(q, k, v, prompt_lens, response_lens, group_sizes, node_offsets, parents, kept_offsets,
                   kept_index, kept_block_mask, kept_heads, kept_compressed_rows, kept_query_start, scale):
    _check_qkv(q, k, v)
    spec, keep_l = _spec(prompt_lens, response_lens, group_sizes, node_offsets, parents)
    kept, keep_k = _kept(kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                         kept_query_start, q.shape[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    keep = [_desc(x) for x in (q, k, v, out)]
    ctx, mem = _ctx_for(q)
    _lib.kept_fwd(ctx, spec, kept, *[d for _, d in keep], _ptr(lse), float(scale), mem)
    return out, lse


def _kept_bwd_impl(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes, node_offsets, parents,
                   kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows, kept_query_start,
                   scale):
    _check_qkv(q, k, v)
    _check_bwd(dout, out, lse, q)
    spec, keep_l = _spec(prompt_lens, response_lens, group_sizes, node_offsets, parents)
    kept, keep_k = _kept(kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                         kept_query_start, q.shape[0])
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    keep = [_desc(x.to(q.dtype) if x.dtype != q.dtype else x) for x in (q, k, v, out, dout, dq, dk, dv)]
    lse_c = lse.contiguous()
    ctx, mem = _ctx_for(q)
    d = [t for _, t in keep]
    _lib.kept_bwd(ctx, spec, kept, *d[:5], _ptr(lse_c), *d[5:], float(scale), mem)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# autograd.Function versions

_N_LAYOUT, _N_KEPT, _N_KLOPT = 5, 6, 5


class StreamKLFunction(torch.autograd.Function):
    """apply(q_t, k_t, q_s, k_s, <5 layout tensors>, <6 kept args>, direction, scale_teacher,
    scale_student, temperature, scale_by_tau2) -> (kl, stats, outside_mass); differentiable in
    kl; teacher gradients are computed when q_t or k_t requires grad."""

    @staticmethod
    @_records_context
    def forward(ctx, q_t, k_t, q_s, k_s, *args):
        kl, stats, outside = _kl_fwd_impl(q_t, k_t, q_s, k_s, *args)
        lay, kept = args[:_N_LAYOUT], args[_N_LAYOUT:_N_LAYOUT + _N_KEPT]
        ctx.save_for_backward(q_t, k_t, q_s, k_s, stats, *lay, *kept[:3])
        ctx.ints = tuple(kept[3:]) + tuple(args[_N_LAYOUT + _N_KEPT:])
        ctx.mark_non_differentiable(stats, outside)
        ctx.set_materialize_grads(False)  # no zero tensors for stats' and outside's gradients
        return kl, stats, outside

    @staticmethod
    @_follows_context
    def backward(ctx, dkl, _ds, _do):
        n = _N_LAYOUT + _N_KEPT + _N_KLOPT
        if dkl is None:  # only the statistics were used
            return (None,) * (4 + n)
        q_t, k_t, q_s, k_s, stats, *rest = ctx.saved_tensors
        lay, kt = rest[:_N_LAYOUT], rest[_N_LAYOUT:]
        tg = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        dq_s, dk_s, dq_t, dk_t = _kl_bwd_impl(dkl.float(), q_t, k_t, q_s, k_s, stats, *lay, *kt, *ctx.ints, tg)
        return (dq_t if tg else None, dk_t if tg else None, dq_s, dk_s) + (None,) * n


class KeptAttentionFunction(torch.autograd.Function):
    """apply(q, k, v, <5 layout tensors>, <6 kept args>, scale) -> (out, lse [T, Hq])."""

    @staticmethod
    @_records_context
    def forward(ctx, q, k, v, *args):
        out, lse = _kept_fwd_impl(q, k, v, *args)
        lay, kept = args[:_N_LAYOUT], args[_N_LAYOUT:_N_LAYOUT + _N_KEPT]
        ctx.save_for_backward(q, k, v, out, lse, *lay, *kept[:3])
        ctx.ints = tuple(kept[3:]) + (args[-1],)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @_follows_context
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * (3 + _N_LAYOUT + _N_KEPT + 1)
        q, k, v, out, lse, *rest = ctx.saved_tensors
        dq, dk, dv = _kept_bwd_impl(dout, q, k, v, out, lse, *rest, *ctx.ints)
        return (dq, dk, dv) + (None,) * (_N_LAYOUT + _N_KEPT + 1)


# --------------------------------------------------------------------------------------------
# torch.library custom ops


def _fake_kl_fwd(q_t, k_t, q_s, k_s):
    _check_kl_inputs(q_t, k_t, q_s, k_s)
    T, H = q_t.shape[0], q_t.shape[1]
    f = dict(dtype=torch.float32)
    return q_t.new_empty((T, H), **f), q_t.new_empty((T, H, KL_STATS), **f), q_t.new_empty((T, H), **f)


if HAVE_CUSTOM_OPS:

    @torch.library.custom_op("forkattn::kl_fwd", mutates_args=())
    def kl_fwd(q_t: Tensor, k_t: Tensor, q_s: Tensor, k_s: Tensor,
               prompt_lens: Optional[Tensor], response_lens: Optional[Tensor], group_sizes: Optional[Tensor],
               node_offsets: Optional[Tensor], parents: Optional[Tensor],
               kept_offsets: Optional[Tensor], kept_index: Optional[Tensor], kept_block_mask: Optional[Tensor],
               kept_heads: int, kept_compressed_rows: int, kept_query_start: int,
               direction: int, scale_teacher: float, scale_student: float, temperature: float,
               scale_by_tau2: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return _kl_fwd_impl(q_t, k_t, q_s, k_s, prompt_lens, response_lens, group_sizes, node_offsets, parents,
                            kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                            kept_query_start, direction, scale_teacher, scale_student, temperature, scale_by_tau2)

    @kl_fwd.register_fake
    def _(q_t, k_t, q_s, k_s, *args):
        return _fake_kl_fwd(q_t, k_t, q_s, k_s)

    @torch.library.custom_op("forkattn::kl_bwd", mutates_args=())
    def kl_bwd(dkl: Tensor, q_t: Tensor, k_t: Tensor, q_s: Tensor, k_s: Tensor, stats: Tensor,
               prompt_lens: Optional[Tensor], response_lens: Optional[Tensor], group_sizes: Optional[Tensor],
               node_offsets: Optional[Tensor], parents: Optional[Tensor],
               kept_offsets: Optional[Tensor], kept_index: Optional[Tensor], kept_block_mask: Optional[Tensor],
               kept_heads: int, kept_compressed_rows: int, kept_query_start: int,
               direction: int, scale_teacher: float, scale_student: float, temperature: float,
               scale_by_tau2: bool, teacher_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return _kl_bwd_impl(dkl, q_t, k_t, q_s, k_s, stats, prompt_lens, response_lens, group_sizes, node_offsets,
                            parents, kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                            kept_query_start, direction, scale_teacher, scale_student, temperature, scale_by_tau2,
                            teacher_grad)

    @kl_bwd.register_fake
    def _(dkl, q_t, k_t, q_s, k_s, stats, *args):
        _check_kl_inputs(q_t, k_t, q_s, k_s)
        T, H = q_t.shape[0], q_t.shape[1]
        _f32(dkl, (T, H), "dkl")
        _f32(stats, (T, H, KL_STATS), "stats")
        teacher_grad = args[-1]
        if teacher_grad:
            dt = (q_t.new_empty(q_t.shape), k_t.new_empty(k_t.shape))
        else:
            dt = (q_t.new_empty(0), k_t.new_empty(0))
        return (q_s.new_empty(q_s.shape), k_s.new_empty(k_s.shape)) + dt

    @_records_context

    def _kl_setup(ctx, inputs, output):
        q_t, k_t, q_s, k_s = inputs[:4]
        lay = inputs[4:4 + _N_LAYOUT]
        kept = inputs[4 + _N_LAYOUT:4 + _N_LAYOUT + _N_KEPT]
        _kl, stats, outside = output
        ctx.save_for_backward(q_t, k_t, q_s, k_s, stats, *lay, *kept[:3])
        ctx.ints = tuple(kept[3:]) + tuple(inputs[4 + _N_LAYOUT + _N_KEPT:])
        ctx.mark_non_differentiable(stats, outside)
        ctx.set_materialize_grads(False)  # no zero tensors filled for stats' and outside's gradients

    @_follows_context

    def _kl_backward(ctx, dkl, _ds, _do):
        if dkl is None:  # the divergence unused by the loss
            return (None,) * (4 + _N_LAYOUT + _N_KEPT + _N_KLOPT)
        q_t, k_t, q_s, k_s, stats, *rest = ctx.saved_tensors
        tg = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        dq_s, dk_s, dq_t, dk_t = torch.ops.forkattn.kl_bwd(dkl.float().contiguous(), q_t, k_t, q_s, k_s, stats,
                                                           *rest, *ctx.ints, tg)
        n = _N_LAYOUT + _N_KEPT + _N_KLOPT
        return (dq_t if tg else None, dk_t if tg else None, dq_s, dk_s) + (None,) * n

    kl_fwd.register_autograd(_kl_backward, setup_context=_kl_setup)

    @torch.library.custom_op("forkattn::kept_fwd", mutates_args=())
    def kept_fwd(q: Tensor, k: Tensor, v: Tensor,
                 prompt_lens: Optional[Tensor], response_lens: Optional[Tensor], group_sizes: Optional[Tensor],
                 node_offsets: Optional[Tensor], parents: Optional[Tensor],
                 kept_offsets: Optional[Tensor], kept_index: Optional[Tensor], kept_block_mask: Optional[Tensor],
                 kept_heads: int, kept_compressed_rows: int, kept_query_start: int,
                 softmax_scale: float) -> Tuple[Tensor, Tensor]:
        return _kept_fwd_impl(q, k, v, prompt_lens, response_lens, group_sizes, node_offsets, parents, kept_offsets,
                              kept_index, kept_block_mask, kept_heads, kept_compressed_rows, kept_query_start,
                              softmax_scale)

    @kept_fwd.register_fake
    def _(q, k, v, *args):
        _check_qkv(q, k, v)
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.custom_op("forkattn::kept_bwd", mutates_args=())
    def kept_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 prompt_lens: Optional[Tensor], response_lens: Optional[Tensor], group_sizes: Optional[Tensor],
                 node_offsets: Optional[Tensor], parents: Optional[Tensor],
                 kept_offsets: Optional[Tensor], kept_index: Optional[Tensor], kept_block_mask: Optional[Tensor],
                 kept_heads: int, kept_compressed_rows: int, kept_query_start: int,
                 softmax_scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        return _kept_bwd_impl(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes, node_offsets,
                              parents, kept_offsets, kept_index, kept_block_mask, kept_heads, kept_compressed_rows,
                              kept_query_start, softmax_scale)

    @kept_bwd.register_fake
    def _(dout, q, k, v, out, lse, *args):
        _check_qkv(q, k, v)
        _check_bwd(dout, out, lse, q)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @_records_context

    def _kept_setup(ctx, inputs, output):
        q, k, v = inputs[:3]
        lay = inputs[3:3 + _N_LAYOUT]
        kept = inputs[3 + _N_LAYOUT:3 + _N_LAYOUT + _N_KEPT]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *lay, *kept[:3])
        ctx.ints = tuple(kept[3:]) + (inputs[-1],)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)

    @_follows_context

    def _kept_backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * (3 + _N_LAYOUT + _N_KEPT + 1)
        q, k, v, out, lse, *rest = ctx.saved_tensors
        dq, dk, dv = torch.ops.forkattn.kept_bwd(dout, q, k, v, out, lse, *rest, *ctx.ints)
        return (dq, dk, dv) + (None,) * (_N_LAYOUT + _N_KEPT + 1)

    kept_fwd.register_autograd(_kept_backward, setup_context=_kept_setup)


# --------------------------------------------------------------------------------------------
# public functions


def _direction(direction):
    if isinstance(direction, str):
        d = direction.lower()
        if d in ("forward", "fwd", "kl(t||s)"):
            return _lib.KL_FORWARD
        if d in ("reverse", "rev", "kl(s||t)"):
            return _lib.KL_REVERSE
    elif direction in (_lib.KL_FORWARD, _lib.KL_REVERSE) and not isinstance(direction, bool):
        return int(direction)
    raise ValueError("forkattn: direction must be 'forward' (KL(T||S)) or 'reverse' (KL(S||T)), not %r"
                     % (direction,))


def _opt_scale(x):
    if x is None:
        return 0.0  # the C default: 1/sqrt(head_dim) of that side
    x = float(x)
    if not x > 0:
        raise _invalid("opt: scale %g must be > 0 (None = 1/sqrt(head_dim))" % x)
    return x


def _stream_kl_raw(q_t, k_t, q_s, k_s, layout, kept, direction, temperature, scale_by_tau2, scale_teacher,
                   scale_student):
    _check_kl_inputs(q_t, k_t, q_s, k_s)
    args = (q_t, k_t, q_s, k_s) + _layout_args(layout, q_t.shape[0]) + _kept_args(kept) + (
        _direction(direction), _opt_scale(scale_teacher), _opt_scale(scale_student), float(temperature),
        bool(scale_by_tau2))
    if use_custom_ops():
        return torch.ops.forkattn.kl_fwd(*args)
    return StreamKLFunction.apply(*args)


def stream_kl(q_t, k_t, q_s, k_s, layout=None, *, kept=None, direction="forward", temperature=1.0,
              scale_by_tau2=False, scale_teacher=None, scale_student=None, teacher_grad=False,
              return_outside_mass=False):
    """StreamKL: per query row and head, the KL divergence between the teacher's attention
    distribution ``T = softmax(scale_teacher * q_t.k_t / tau)`` and the student's
    ``S = softmax(scale_student * q_s.k_s / tau)`` over the keys the layout shows the row, in
    one tiled pass (no rows x keys tensor in forward or backward; the backward recomputes both
    distributions from the saved ``[T, H, 4]`` statistics).

    q_t [T, H, d_t], k_t [T, Hkv_t, d_t] (teacher), q_s [T, H, d_s], k_s [T, Hkv_s, d_s]
    (student): same rows and query heads, own GQA groups, head_dims and dtypes
    (float32/bfloat16/float16 per side), one device (CPU or CUDA). ``layout``: a
    :class:`SharedPrefixLayout` (causal groups), a :class:`TreeLayout`, or None (one dense
    causal sequence of T rows).

    ``direction``: ``"forward"`` = KL(T||S), ``"reverse"`` = KL(S||T). ``temperature`` tau
    divides both sides' scores; ``scale_by_tau2`` multiplies the loss by tau^2. Scales default
    to ``1/sqrt(d)`` of each side. ``kept``: the student's :class:`KeptSet` (shadow mask): the
    student sees only the kept keys; forward KL uses the teacher renormalised on them, reverse
    KL the full teacher.

    Returns ``kl`` float32 [T, H] (0 for a row that keeps no key), differentiable w.r.t. q_s
    and k_s, and w.r.t. q_t and k_t when ``teacher_grad=True`` (else the teacher is detached);
    with ``return_outside_mass=True`` also the teacher's probability on the dropped keys
    [T, H] (0 without a kept set; not differentiable).
    """
    if not teacher_grad:
        q_t, k_t = q_t.detach(), k_t.detach()
    kl, _stats, outside = _stream_kl_raw(q_t, k_t, q_s, k_s, layout, kept, direction, temperature, scale_by_tau2,
                                         scale_teacher, scale_student)
    return (kl, outside) if return_outside_mass else kl


def kl_outside_mass(q_t, k_t, layout, kept, *, temperature=1.0, scale_teacher=None):
    """The teacher's attention probability on the keys ``kept`` drops, per row and head
    (float32 [T, H], not differentiable): how much of the teacher a compressed cache cannot
    see. Runs the StreamKL forward with the teacher as its own student."""
    with torch.no_grad():
        q_t, k_t = q_t.detach(), k_t.detach()
        _kl, _st, outside = _stream_kl_raw(q_t, k_t, q_t, k_t, layout, kept, "forward", temperature, False,
                                           scale_teacher, scale_teacher)
    return outside


def kept_attention(q, k, v, layout=None, kept=None, *, softmax_scale=None, return_lse=False):
    """Attention restricted to a kept set (``forkattn_kept_fwd``): a row sees the keys its layout
    shows it that ``kept`` keeps (``kept=None``: the whole layout). q [T, Hq, d], k/v
    [T, Hkv, d] as in :func:`forkattn.prefix_attention`; ``layout`` a SharedPrefixLayout
    (causal groups), a TreeLayout or None (one dense causal sequence). Returns out [T, Hq, d]
    (differentiable in q, k, v; dropped keys get no gradient from the rows that do not see
    them) and, with ``return_lse=True``, lse float32 [T, Hq] (-inf and out = 0 for a row that
    sees no key; not differentiable)."""
    _check_qkv(q, k, v)
    scale = _scale_of(q, softmax_scale)
    args = (q, k, v) + _layout_args(layout, q.shape[0]) + _kept_args(kept) + (scale,)
    if use_custom_ops():
        out, lse = torch.ops.forkattn.kept_fwd(*args)
    else:
        out, lse = KeptAttentionFunction.apply(*args)
    return (out, lse) if return_lse else out
