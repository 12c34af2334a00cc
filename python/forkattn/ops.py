"""PyTorch front end: the differentiable attention functions.

Each operation exists twice:

* as ``torch.library`` custom ops (``torch.ops.forkattn.prefix_fwd`` / ``prefix_bwd``,
  ``tree_fwd`` / ``tree_bwd``, ``varlen_fwd`` / ``varlen_bwd``) with fake (meta)
  implementations and registered autograd, so ``torch.compile(fullgraph=True)`` traces
  through them (layouts enter as their integer tensors, never as Python objects);
* as ``torch.autograd.Function`` s (:class:`PrefixAttentionFunction`,
  :class:`TreeAttentionFunction`, :class:`VarlenAttentionFunction`) for eager use and older
  PyTorch without ``torch.library.custom_op``.

Which one a public function calls is ``USE_CUSTOM_OPS``: ``"compile"`` (the default) takes the
custom ops while ``torch.compile`` or ``torch.export`` traces and the autograd.Functions in eager
mode, where the custom ops' dispatch costs more than a small call's kernels; ``True`` always
the custom ops, ``False`` never.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Tuple

import torch

from . import _lib
from .layouts import SharedPrefixLayout, TreeLayout, _as_i64

__all__ = [
    "prefix_attention",
    "tree_attention",
    "varlen_attention",
    "PrefixAttentionFunction",
    "TreeAttentionFunction",
    "VarlenAttentionFunction",
    "HAVE_CUSTOM_OPS",
    "USE_CUSTOM_OPS",
]

_DTYPES = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_F16}
Tensor = torch.Tensor


def _records_context(fn):
    """Decorates an autograd.Function's forward or a custom op's setup_context: records the
    :func:`forkattn.use_context` context the call ran under, which its backward follows."""
    @functools.wraps(fn)
    def run(ctx, *args, **kwargs):  # torch calls a setup_context with keywords
        ctx.fa_ctx = _lib.forward_context()
        return fn(ctx, *args, **kwargs)
    return run


def _follows_context(fn):
    """Decorates a backward: its calls use what its forward's did (_lib.backward_context), also on
    autograd's own thread."""
    @functools.wraps(fn)
    def run(ctx, *grads):
        with _lib.backward_context(getattr(ctx, "fa_ctx", None)):
            return fn(ctx, *grads)
    return run


# --------------------------------------------------------------------------------------------
# checks and descriptors


def _check_qkv(q, k, v):
    """Checks that need no data (also run by the fake implementations). Sizes (GQA, head_dim
    range, rows vs layout) are checked by the C library with its own messages."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError("forkattn: %s must be a torch.Tensor, got %s" % (name, type(x).__name__))
        if x.dim() != 3:
            raise ValueError("forkattn: %s must be [rows, heads, head_dim], got shape %s"
                             % (name, tuple(x.shape)))
    if q.dtype not in _DTYPES:
        raise ValueError("forkattn: dtype %s is not supported (float32, bfloat16, float16; compute "
                         "is float32)" % q.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("forkattn: q, k, v must share one dtype, got %s, %s, %s" % (q.dtype, k.dtype, v.dtype))
    if k.device != q.device or v.device != q.device:
        raise ValueError("forkattn: q, k, v must be on one device, got %s, %s, %s"
                         % (q.device, k.device, v.device))
    if q.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError("forkattn: tensors on %s are not supported (cpu or cuda)" % q.device)


def _desc(x):
    """(tensor kept alive, forkattn_tensor) for a [rows, heads, d] tensor; copies only when the
    head_dim stride is not 1 or the strides are not a layout the C library accepts."""
    rows, heads, d = x.shape
    if x.is_contiguous():  # the common case, row-major as make_tensor would normalize it
        return x, _lib.Tensor(x.data_ptr() or None, _DTYPES[x.dtype], rows, heads, d, heads * d, d)
    if d > 1 and x.stride(2) != 1:
        x = x.contiguous()
    t = _lib.make_tensor(x.data_ptr(), _DTYPES[x.dtype], rows, heads, d, x.stride(0), x.stride(1))
    if t is None:
        x = x.contiguous()
        t = _lib.make_tensor(x.data_ptr(), _DTYPES[x.dtype], rows, heads, d, x.stride(0), x.stride(1))
    return x, t


# The current stream's raw handle without building a torch.cuda.Stream object (a few µs a call).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _ctx_for(x):
    """(context, memory kind) for a call on tensors like ``x``, in PyTorch's stream order: a GPU
    context follows PyTorch's current stream (forkattn_ctx_set_stream), so its tensor-core calls
    are queued there and return at once, and its other calls wait for the stream; where the
    library cannot take a stream, or FORKATTN_TORCH_STREAM=0, the stream is synchronized here and
    the call runs on the library's own stream."""
    if x.is_cuda:
        dev = x.device.index
        if dev is None:
            dev = torch.cuda.current_device()
        ctx = _lib.current_context(dev)
        stream = _raw_stream(dev) if _raw_stream is not None else torch.cuda.current_stream(dev)
        if os.environ.get("FORKATTN_TORCH_STREAM") == "0" or not ctx.follow_stream(stream):
            if ctx.stream is not None:
                ctx.clear_stream()
            torch.cuda.current_stream(dev).synchronize()
        return ctx, _lib.MEMORY_DEVICE
    return _lib.current_context(), _lib.MEMORY_HOST


class _HostInts:
    """Host copies (tuples) of small integer tensors: layouts' lengths and cu_seqlens. Reading a GPU
    tensor waits for the GPU, and turning any tensor into Python ints costs time that grows with
    its length, so each tensor is read once per version (``Tensor._version``, which every in-place
    write bumps) and reused by the other layers' and the backward's calls, with what is derived
    from it (``longest``). An entry holds a weak reference, so a new tensor at a freed one's
    address is read again."""

    def __init__(self, limit=64):
        self.limit, self.items = limit, {}

    def _entry(self, t, name):
        key = id(t)
        hit = self.items.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit
        if t.is_floating_point():
            raise TypeError("forkattn: %s must be an integer tensor" % name)
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "forkattn: %s is on the GPU and this tensor (at this version) was not read before the "
                "CUDA graph capture began; run the call once before capturing, or pass it on the CPU"
                % name)
        values = tuple(t.detach().reshape(-1).tolist())
        if len(self.items) >= self.limit:
            self.items.clear()
        hit = self.items[key] = (weakref.ref(t), t._version, values, {})
        return hit

    def get(self, t, name):
        return self._entry(t, name)[2]

    def longest(self, t, name):
        """The largest difference of consecutive values (cu_seqlens: the longest sequence)."""
        entry = self._entry(t, name)
        got = entry[3].get("longest")
        if got is None:
            v = entry[2]
            got = entry[3]["longest"] = max((b - a for a, b in zip(v, v[1:])), default=0)
        return got


_host_ints = _HostInts()


def _ints(t, name):
    """The values of a 1-D integer tensor or sequence as a tuple of Python ints (a tensor: read
    once per version, see _HostInts)."""
    if not isinstance(t, torch.Tensor):
        return tuple(int(a) for a in t)
    return _host_ints.get(t, name)


def _host_i64(t):
    """A CPU contiguous int64 copy/view of a 1-D integer tensor (for host pointers)."""
    return _as_i64(t.detach().reshape(-1).to(device="cpu"), "index tensor").contiguous()


# empty_like (contiguous) parses fewer arguments than torch.empty(shape, dtype=, device=): about a
# third of its host time, per output of every call.
_CONTIGUOUS = torch.contiguous_format


def _new_outputs(q):
    return (torch.empty_like(q, memory_format=_CONTIGUOUS),
            q.new_empty(q.shape[:2], dtype=torch.float32))


def _new_grads(q, k, v):
    return (torch.empty_like(q, memory_format=_CONTIGUOUS), torch.empty_like(k, memory_format=_CONTIGUOUS),
            torch.empty_like(v, memory_format=_CONTIGUOUS))


def _check_bwd(dout, out, lse, q):
    if dout.shape != q.shape or out.shape != q.shape:
        raise _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, "dout %s / out %s must have q's shape %s"
                                           % (tuple(dout.shape), tuple(out.shape), tuple(q.shape)))
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:2]):
        raise _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, "lse must be float32 [rows, heads_q] = %s, "
                                           "got %s %s" % (tuple(q.shape[:2]), lse.dtype, tuple(lse.shape)))


# --------------------------------------------------------------------------------------------
# implementations (eager, real tensors)


def _descs(q, *ts):
    """Descriptors of q and the other [rows, heads, d] tensors (cast to q's dtype, copied when
    the C library cannot take their strides). Returns (tensors kept alive, descriptors).
    Any copy is queued on PyTorch's stream: call _ctx_for() (which orders the call after it) afterwards."""
    dtype = q.dtype
    keep, ds = [], []
    for t in (q,) + ts:
        t, desc = _desc(t if t.dtype == dtype else t.to(dtype))
        keep.append(t)
        ds.append(desc)
    return keep, ds


# Each layout has an _impl pair (checks, reads the layout's host values, then runs: what the
# custom ops and the no-grad path call) and a _run pair on host values. The autograd.Functions
# keep the forward's host values on their ctx, so the backward neither reads nor checks the
# layout again.


def _prefix_ints(prompt_lens, response_lens, group_sizes):
    return (_ints(prompt_lens, "prompt_lens"), _ints(response_lens, "response_lens"),
            _ints(group_sizes, "group_sizes"))


def _prefix_fwd_run(q, k, v, P, R, S, scale, causal):
    if not P and q.shape[0] != 0:
        raise _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT,
                                           "q has %d rows, the (empty) layout needs 0" % q.shape[0])
    out, lse = _new_outputs(q)
    keep, ds = _descs(q, k, v, out)
    ctx, mem = _ctx_for(q)  # after every copy above: the call is ordered after them
    _lib.prefix_fwd(ctx, P, S, R, bool(causal), *ds, lse.data_ptr() or None, float(scale), mem)
    return out, lse


def _prefix_fwd_checked(q, k, v, prompt_lens, response_lens, group_sizes, scale, causal):
    return _prefix_fwd_run(q, k, v, *_prefix_ints(prompt_lens, response_lens, group_sizes), scale, causal)


def _prefix_fwd_impl(q, k, v, prompt_lens, response_lens, group_sizes, scale, causal):
    _check_qkv(q, k, v)
    return _prefix_fwd_checked(q, k, v, prompt_lens, response_lens, group_sizes, scale, causal)


def _prefix_bwd_impl(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes, scale, causal):
    _check_qkv(q, k, v)
    _check_bwd(dout, out, lse, q)
    return _prefix_bwd_run(dout, q, k, v, out, lse, *_prefix_ints(prompt_lens, response_lens, group_sizes),
                           scale, causal)


def _prefix_bwd_run(dout, q, k, v, out, lse, P, R, S, scale, causal):
    dq, dk, dv = _new_grads(q, k, v)
    if not P:
        return dq, dk, dv
    keep, ds = _descs(q, k, v, out, dout, dq, dk, dv)
    lse_c = lse.contiguous()
    ctx, mem = _ctx_for(q)
    _lib.prefix_bwd(ctx, P, S, R, bool(causal), *ds[:5], lse_c.data_ptr() or None, *ds[5:],
                    float(scale), mem)
    return dq, dk, dv


def _tree_fwd_checked(q, k, v, node_offsets, parents, scale):
    return _tree_fwd_run(q, k, v, _host_i64(node_offsets), _host_i64(parents), scale)


def _tree_fwd_impl(q, k, v, node_offsets, parents, scale):
    _check_qkv(q, k, v)
    return _tree_fwd_checked(q, k, v, node_offsets, parents, scale)


def _tree_fwd_run(q, k, v, offs, par, scale):
    out, lse = _new_outputs(q)
    keep, ds = _descs(q, k, v, out)
    ctx, mem = _ctx_for(q)
    _lib.tree_fwd(ctx, (offs.data_ptr(), offs.numel()), (par.data_ptr(), par.numel()), *ds,
                  lse.data_ptr() or None, float(scale), mem)
    return out, lse


def _tree_bwd_impl(dout, q, k, v, out, lse, node_offsets, parents, scale):
    _check_qkv(q, k, v)
    _check_bwd(dout, out, lse, q)
    return _tree_bwd_run(dout, q, k, v, out, lse, _host_i64(node_offsets), _host_i64(parents), scale)


def _tree_bwd_run(dout, q, k, v, out, lse, offs, par, scale):
    dq, dk, dv = _new_grads(q, k, v)
    keep, ds = _descs(q, k, v, out, dout, dq, dk, dv)
    lse_c = lse.contiguous()
    ctx, mem = _ctx_for(q)
    _lib.tree_bwd(ctx, (offs.data_ptr(), offs.numel()), (par.data_ptr(), par.numel()), *ds[:5],
                  lse_c.data_ptr() or None, *ds[5:], float(scale), mem)
    return dq, dk, dv


def _varlen_seqlens(cu_seqlens_q, cu_seqlens_k):
    cq = _ints(cu_seqlens_q, "cu_seqlens_q")
    ck = cq if cu_seqlens_k is cu_seqlens_q else _ints(cu_seqlens_k, "cu_seqlens_k")
    if cq != ck:
        raise NotImplementedError(
            "forkattn.varlen_attention: cu_seqlens_q must equal cu_seqlens_k (self-attention over "
            "the same packed sequences); cross-attention with different query and key lengths is "
            "not supported")
    if not cq:
        raise ValueError("forkattn: cu_seqlens must have at least one entry (0)")
    return cq


def _varlen_fwd_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    return _varlen_fwd_run(q, k, v, _varlen_seqlens(cu_seqlens_q, cu_seqlens_k), scale, causal)


def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    _check_qkv(q, k, v)
    return _varlen_fwd_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


def _varlen_fwd_run(q, k, v, cu, scale, causal):
    out, lse = _new_outputs(q)
    keep, ds = _descs(q, k, v, out)
    ctx, mem = _ctx_for(q)
    _lib.varlen_fwd(ctx, cu, bool(causal), *ds, lse.data_ptr() or None, float(scale), mem)
    return out, lse


def _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, causal):
    _check_qkv(q, k, v)
    _check_bwd(dout, out, lse, q)
    return _varlen_bwd_run(dout, q, k, v, out, lse, _varlen_seqlens(cu_seqlens_q, cu_seqlens_k), scale, causal)


def _varlen_bwd_run(dout, q, k, v, out, lse, cu, scale, causal):
    dq, dk, dv = _new_grads(q, k, v)
    keep, ds = _descs(q, k, v, out, dout, dq, dk, dv)
    lse_c = lse.contiguous()
    ctx, mem = _ctx_for(q)
    _lib.varlen_bwd(ctx, cu, bool(causal), *ds[:5], lse_c.data_ptr() or None, *ds[5:], float(scale), mem)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# autograd.Function versions


class PrefixAttentionFunction(torch.autograd.Function):
    """apply(q, k, v, prompt_lens, response_lens, group_sizes, scale, causal) -> (out, lse)."""

    @staticmethod
    @_records_context
    def forward(ctx, q, k, v, prompt_lens, response_lens, group_sizes, scale, causal):
        _check_qkv(q, k, v)
        ctx.ints = _prefix_ints(prompt_lens, response_lens, group_sizes)
        out, lse = _prefix_fwd_run(q, k, v, *ctx.ints, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient would be a zero tensor filled every backward
        return out, lse

    @staticmethod
    @_follows_context
    def backward(ctx, dout, _dlse):
        if dout is None:  # only lse was used: nothing reaches the inputs
            return (None,) * 8
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _prefix_bwd_run(dout, q, k, v, out, lse, *ctx.ints, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None


class TreeAttentionFunction(torch.autograd.Function):
    """apply(q, k, v, node_offsets, parents, scale) -> (out, lse)."""

    @staticmethod
    @_records_context
    def forward(ctx, q, k, v, node_offsets, parents, scale):
        _check_qkv(q, k, v)
        ctx.ints = _host_i64(node_offsets), _host_i64(parents)
        out, lse = _tree_fwd_run(q, k, v, *ctx.ints, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @_follows_context
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 6
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _tree_bwd_run(dout, q, k, v, out, lse, *ctx.ints, ctx.scale)
        return dq, dk, dv, None, None, None


class VarlenAttentionFunction(torch.autograd.Function):
    """apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal) -> (out, lse [rows, heads])."""

    @staticmethod
    @_records_context
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
        _check_qkv(q, k, v)
        ctx.cu = _varlen_seqlens(cu_seqlens_q, cu_seqlens_k)
        out, lse = _varlen_fwd_run(q, k, v, ctx.cu, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @_follows_context
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _varlen_bwd_run(dout, q, k, v, out, lse, ctx.cu, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None


# --------------------------------------------------------------------------------------------
# torch.library custom ops

HAVE_CUSTOM_OPS = hasattr(torch, "library") and hasattr(torch.library, "custom_op")
USE_CUSTOM_OPS = "compile"


def _fake_fwd(q, k, v):
    _check_qkv(q, k, v)
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def _fake_bwd(dout, q, k, v, out, lse):
    _check_qkv(q, k, v)
    _check_bwd(dout, out, lse, q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


if HAVE_CUSTOM_OPS:

    @torch.library.custom_op("forkattn::prefix_fwd", mutates_args=())
    def prefix_fwd(q: Tensor, k: Tensor, v: Tensor, prompt_lens: Tensor, response_lens: Tensor,
                   group_sizes: Tensor, softmax_scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
        return _prefix_fwd_impl(q, k, v, prompt_lens, response_lens, group_sizes, softmax_scale, causal)

    @prefix_fwd.register_fake
    def _(q, k, v, prompt_lens, response_lens, group_sizes, softmax_scale, causal):
        return _fake_fwd(q, k, v)

    @torch.library.custom_op("forkattn::prefix_bwd", mutates_args=())
    def prefix_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   prompt_lens: Tensor, response_lens: Tensor, group_sizes: Tensor,
                   softmax_scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return _prefix_bwd_impl(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes,
                                softmax_scale, causal)

    @prefix_bwd.register_fake
    def _(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes, softmax_scale, causal):
        return _fake_bwd(dout, q, k, v, out, lse)

    @_records_context

    def _prefix_setup(ctx, inputs, output):
        q, k, v, P, R, S, scale, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, P, R, S)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero tensor filled for lse's gradient every backward

    @_follows_context

    def _prefix_backward(ctx, dout, _dlse):
        if dout is None:  # out unused by the loss
            return None, None, None, None, None, None, None, None
        q, k, v, out, lse, P, R, S = ctx.saved_tensors
        dq, dk, dv = torch.ops.forkattn.prefix_bwd(dout, q, k, v, out, lse, P, R, S, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None

    prefix_fwd.register_autograd(_prefix_backward, setup_context=_prefix_setup)

    @torch.library.custom_op("forkattn::tree_fwd", mutates_args=())
    def tree_fwd(q: Tensor, k: Tensor, v: Tensor, node_offsets: Tensor, parents: Tensor,
                 softmax_scale: float) -> Tuple[Tensor, Tensor]:
        return _tree_fwd_impl(q, k, v, node_offsets, parents, softmax_scale)

    @tree_fwd.register_fake
    def _(q, k, v, node_offsets, parents, softmax_scale):
        return _fake_fwd(q, k, v)

    @torch.library.custom_op("forkattn::tree_bwd", mutates_args=())
    def tree_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 node_offsets: Tensor, parents: Tensor, softmax_scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        return _tree_bwd_impl(dout, q, k, v, out, lse, node_offsets, parents, softmax_scale)

    @tree_bwd.register_fake
    def _(dout, q, k, v, out, lse, node_offsets, parents, softmax_scale):
        return _fake_bwd(dout, q, k, v, out, lse)

    @_records_context

    def _tree_setup(ctx, inputs, output):
        q, k, v, offs, par, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, offs, par)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero tensor filled for lse's gradient every backward

    @_follows_context

    def _tree_backward(ctx, dout, _dlse):
        if dout is None:  # out unused by the loss
            return None, None, None, None, None, None
        q, k, v, out, lse, offs, par = ctx.saved_tensors
        dq, dk, dv = torch.ops.forkattn.tree_bwd(dout, q, k, v, out, lse, offs, par, ctx.scale)
        return dq, dk, dv, None, None, None

    tree_fwd.register_autograd(_tree_backward, setup_context=_tree_setup)

    @torch.library.custom_op("forkattn::varlen_fwd", mutates_args=())
    def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   softmax_scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
        return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)

    @varlen_fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
        return _fake_fwd(q, k, v)

    @torch.library.custom_op("forkattn::varlen_bwd", mutates_args=())
    def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, softmax_scale: float,
                   causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)

    @varlen_bwd.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
        return _fake_bwd(dout, q, k, v, out, lse)

    @_records_context

    def _varlen_setup(ctx, inputs, output):
        q, k, v, cq, ck, scale, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cq, ck)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero tensor filled for lse's gradient every backward

    @_follows_context

    def _varlen_backward(ctx, dout, _dlse):
        if dout is None:  # out unused by the loss
            return None, None, None, None, None, None, None
        q, k, v, out, lse, cq, ck = ctx.saved_tensors
        dq, dk, dv = torch.ops.forkattn.varlen_bwd(dout, q, k, v, out, lse, cq, ck, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None

    varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# --------------------------------------------------------------------------------------------
# public functions


def _scale_of(q, softmax_scale):
    return _lib.softmax_scale(q.shape[-1], softmax_scale)


def use_custom_ops():
    """Whether a call now goes through the torch.library custom ops (see ``USE_CUSTOM_OPS``)."""
    if not HAVE_CUSTOM_OPS or not USE_CUSTOM_OPS:
        return False
    return USE_CUSTOM_OPS != "compile" or _compiling()


def _needs_grad(q, k, v):
    """Whether autograd records this call; without it (torch.no_grad, or inputs that need no
    gradient: a reference model's forward) the call skips the autograd.Function's bookkeeping."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _forward(op, function, checked, args):
    """(out, lse) of a forward whose args start with q, k, v, already checked by _check_qkv: through
    the custom op ``op`` (see ``USE_CUSTOM_OPS``), the autograd.Function ``function`` where autograd
    records the call, or the implementation ``checked`` (which skips that check) directly."""
    if use_custom_ops():
        return getattr(torch.ops.forkattn, op)(*args)
    if _needs_grad(*args[:3]):
        return function.apply(*args)
    return checked(*args)


def prefix_attention(q, k, v, layout, *, softmax_scale=None, causal=True, return_lse=False):
    """Shared-prompt attention over the packed rows of a :class:`SharedPrefixLayout`.

    q [T, Hq, d], k/v [T, Hkv, d] (Hq a multiple of Hkv), float32/bfloat16/float16, CPU or
    CUDA. Every prompt attends (causally, or fully with ``causal=False``) to itself; every
    response to its whole prompt and (causally) to itself. Exact, with the gradients of the
    replicated batch (a prompt's dk/dv summed over its responses). Returns out [T, Hq, d], and
    lse [T, Hq] float32 (natural log; not differentiable) with ``return_lse=True``.
    """
    if not isinstance(layout, SharedPrefixLayout):
        raise TypeError("forkattn.prefix_attention: layout must be a SharedPrefixLayout, got %s"
                        % type(layout).__name__)
    _check_qkv(q, k, v)
    scale = _scale_of(q, softmax_scale)
    args = (q, k, v, layout.prompt_lens, layout.response_lens, layout.group_sizes, scale, bool(causal))
    out, lse = _forward("prefix_fwd", PrefixAttentionFunction, _prefix_fwd_checked, args)
    return (out, lse) if return_lse else out


def tree_attention(q, k, v, layout, *, softmax_scale=None, return_lse=False):
    """Tree attention over the packed rows of a :class:`TreeLayout`: a row attends to every row
    of its ancestor nodes and causally within its node. Same tensor conventions as
    :func:`prefix_attention`; lse [T, Hq]."""
    if not isinstance(layout, TreeLayout):
        raise TypeError("forkattn.tree_attention: layout must be a TreeLayout, got %s" % type(layout).__name__)
    _check_qkv(q, k, v)
    scale = _scale_of(q, softmax_scale)
    args = (q, k, v, layout.node_offsets, layout.parents, scale)
    out, lse = _forward("tree_fwd", TreeAttentionFunction, _tree_fwd_checked, args)
    return (out, lse) if return_lse else out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     softmax_scale=None, causal=True, return_lse=False):
    """Variable-length attention with flash-attn's ``flash_attn_varlen_func`` conventions:
    packed rows q [total, Hq, d], k/v [total, Hkv, d], ``cu_seqlens`` [batch+1] (int32 or
    int64, any device) of cumulative sequence lengths starting at 0. Self-attention only:
    ``cu_seqlens_q`` must equal ``cu_seqlens_k`` (else NotImplementedError).

    Differences from flash-attn: ``causal`` defaults to True here; ``max_seqlen_*`` are only
    checked (>= the longest sequence), not needed. With ``return_lse=True`` returns
    ``(out, softmax_lse)`` with softmax_lse float32 **[Hq, total]** as flash-attn's varlen
    functions return it (prefix/tree attention return [T, Hq])."""
    _check_qkv(q, k, v)
    if int(max_seqlen_q) != int(max_seqlen_k):
        raise NotImplementedError("forkattn.varlen_attention: max_seqlen_q (%d) != max_seqlen_k (%d): "
                                  "self-attention only" % (int(max_seqlen_q), int(max_seqlen_k)))
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point():
            raise ValueError("forkattn: %s must be a 1-D integer tensor" % name)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise NotImplementedError("forkattn.varlen_attention: cu_seqlens_q and cu_seqlens_k differ "
                                  "(self-attention only)")
    if not _compiling() and cu_seqlens_q.numel() > 1:
        longest = _host_ints.longest(cu_seqlens_q, "cu_seqlens_q")  # the call reads the same host copy
        if longest > int(max_seqlen_q):
            raise ValueError("forkattn: max_seqlen_q = %d but a sequence has %d tokens"
                             % (int(max_seqlen_q), longest))
    scale = _scale_of(q, softmax_scale)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal))
    out, lse = _forward("varlen_fwd", VarlenAttentionFunction, _varlen_fwd_checked, args)
    if return_lse:
        return out, lse.t().contiguous()
    return out


# torch.compiler.is_compiling, looked up once (every call asks); torch before 2.3 has none.
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
