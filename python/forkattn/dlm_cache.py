"""Shared-prefix KV cache for diffusion LMs (BiCache): the C API's section of that name
(include/forkattn.h, docs/dlm-cache.md).

A diffusion LM attends bidirectionally, so a prefix's K/V depends on the tokens after it; they may
be reused only in the shallow layers where they barely change. This module binds the four parts:

* :func:`prefix_cached_attention` (``forkattn_prefix_cached_fwd`` / ``_bwd``): attention of one
  group's response rows against ``[cached prefix K/V ; own K/V]``; differentiable in q, k and v.
  ``block_size=n`` makes it block-causal (``forkattn_prefix_cached_block_fwd`` / ``_bwd``).
  Also a ``torch.library`` custom op pair (``torch.ops.forkattn.prefix_cached_fwd`` /
  ``prefix_cached_bwd``) with fake implementations and registered autograd,
  :class:`PrefixCachedAttentionFunction` for PyTorch without custom ops, and the numpy
  :func:`prefix_cached_attention_numpy` / :func:`prefix_cached_attention_backward_numpy`.
* :class:`KVCache` (``forkattn_kv_cache``): per-layer K/V of token prefixes, longest-prefix lookup,
  LRU eviction within a byte budget, held entries (:class:`KVEntry`). Thread-safe.
* :func:`kv_similarity` (``forkattn_kv_similarity``): per-head mean cosine similarity of two
  ``[rows, heads, d]`` tensors.
* :class:`ReuseProfile` (``forkattn_reuse_profile``): reuse depth b(r) per prefix-ratio bin.

Works with numpy arrays without PyTorch (the torch names then raise ImportError). The symbols are
looked up lazily: with an older library every call here raises ``ForkattnError`` (status 3);
a library without the block-causal functions fails so only when ``block_size`` is used.
"""

from __future__ import annotations

import ctypes
import operator
import sys
import threading
import weakref
from typing import Tuple

from . import _lib

try:
    import torch
except ImportError:  # numpy-only installs
    torch = None

__all__ = [
    "prefix_cached_attention",
    "PrefixCachedAttentionFunction",
    "prefix_cached_attention_numpy",
    "prefix_cached_attention_backward_numpy",
    "KVCache",
    "KVEntry",
    "kv_similarity",
    "ReuseProfile",
]

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_CODE_NAMES = _lib.DTYPE_NAMES


def _invalid(msg):
    return _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, msg)


def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def _is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _need_torch(name):
    if torch is None:
        raise ImportError("forkattn.%s needs PyTorch, which could not be imported; the numpy functions are "
                          "prefix_cached_attention_numpy / prefix_cached_attention_backward_numpy" % name)


def _int_arg(x, name, lo=None):
    if isinstance(x, bool):
        raise TypeError("forkattn: %s must be an int, got bool" % name)
    try:
        i = operator.index(x)
    except TypeError:
        raise TypeError("forkattn: %s must be an int, got %s" % (name, type(x).__name__)) from None
    if lo is not None and i < lo:
        raise _invalid("%s = %d must be >= %d" % (name, i, lo))
    return i


def _block_arg(block_size):
    """0 (not block-causal) for None or 0, else the block size (an int >= 1; negative raises)."""
    if block_size is None:
        return 0
    b = _int_arg(block_size, "block_size")
    if b < 0:
        raise _invalid("block_size = %d must be >= 1 (or None / 0: not block-causal)" % b)
    if b > (1 << 63) - 1:
        raise _invalid("block_size = %d does not fit in int64" % b)
    return b


_dtype_code = _lib.dtype_code


def _is_numpy_dtype(dtype):
    if isinstance(dtype, str) or (torch is not None and isinstance(dtype, torch.dtype)):
        return False
    np = sys.modules.get("numpy")
    if np is None:
        return False
    return isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic))


def _cuda_index(dev):
    """CUDA device index of a torch.device."""
    if dev.index is not None:
        return int(dev.index)
    return int(torch.cuda.current_device())


def _arr3(x, name):
    """(array kept alive, forkattn_tensor, memory, CUDA device index or None) of a 3-D numpy array or
    torch tensor (CPU or CUDA; copied only when the C library cannot take its strides)."""
    if _is_torch(x):
        from .ops import _DTYPES, _desc

        if x.dim() != 3:
            raise _invalid("%s must be [rows, heads, head_dim], got shape %s" % (name, tuple(x.shape)))
        if x.dtype not in _DTYPES:
            raise _invalid("%s: dtype %s is not supported (float32, bfloat16, float16)" % (name, x.dtype))
        if x.device.type == "cuda":
            kept, t = _desc(x.detach())
            return kept, t, _lib.MEMORY_DEVICE, _cuda_index(x.device)
        if x.device.type != "cpu":
            raise _invalid("%s is on %s: host (cpu) or cuda tensors only" % (name, x.device))
        kept, t = _desc(x.detach())
        return kept, t, _lib.MEMORY_HOST, None
    if _is_numpy(x):
        from .numpy_api import _desc

        if x.ndim != 3:
            raise _invalid("%s must be [rows, heads, head_dim], got shape %s" % (name, x.shape))
        if x.dtype.name not in ("float32", "float16", "bfloat16"):
            raise _invalid("%s: dtype %s is not supported (float32, float16, ml_dtypes.bfloat16)" % (name, x.dtype))
        kept, t = _desc(x)
        return kept, t, _lib.MEMORY_HOST, None
    raise TypeError("forkattn: %s must be a numpy array or a torch tensor, got %s" % (name, type(x).__name__))


def _one_memory(items, what):
    """The common (memory, device index) of _arr3 results; mixing host and CUDA (or two CUDA
    devices) is refused."""
    kinds = {(m, d) for _, _, m, d in items}
    if len(kinds) > 1:
        raise _invalid("%s: tensors are on different devices (host and cuda, or two cuda devices); put them "
                       "on one" % what)
    return kinds.pop() if kinds else (_lib.MEMORY_HOST, None)


def _sync(dev):
    """Finish PyTorch's pending work on CUDA device ``dev`` (the library uses its own stream)."""
    if dev is not None:
        torch.cuda.current_stream(torch.device("cuda", dev)).synchronize()


def _tokens(tokens):
    """(object kept alive, host pointer, n) of int32 token ids: a list/tuple of ints, a numpy
    integer array or an integer torch tensor (any device; copied to the host). Values must fit
    in int32."""
    if _is_torch(tokens):
        t = tokens.detach()
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError("forkattn: tokens must hold integers, got %s" % t.dtype)
        t = t.reshape(-1).cpu()
        if t.numel() and (int(t.min()) < _INT32_MIN or int(t.max()) > _INT32_MAX):
            raise _invalid("tokens: values must fit in int32")
        t = t.to(torch.int32).contiguous()
        return t, t.data_ptr() if t.numel() else None, t.numel()
    if _is_numpy(tokens):
        import numpy as np

        a = tokens.reshape(-1)
        if a.dtype.kind not in "iu":
            raise TypeError("forkattn: tokens must hold integers, got %s" % a.dtype)
        if a.size and (int(a.min()) < _INT32_MIN or int(a.max()) > _INT32_MAX):
            raise _invalid("tokens: values must fit in int32")
        a = np.ascontiguousarray(a, dtype=np.int32)
        return a, a.ctypes.data if a.size else None, a.size
    if isinstance(tokens, (str, bytes)):
        raise TypeError("forkattn: tokens must be a sequence of int token ids, got %s" % type(tokens).__name__)
    try:
        vals = list(tokens)
    except TypeError:
        raise TypeError("forkattn: tokens must be a sequence of int token ids, got %s"
                        % type(tokens).__name__) from None
    vals = [_int_arg(x, "tokens[%d]" % i) for i, x in enumerate(vals)]
    for i, x in enumerate(vals):
        if not _INT32_MIN <= x <= _INT32_MAX:
            raise _invalid("tokens[%d] = %d does not fit in int32" % (i, x))
    arr = (ctypes.c_int32 * max(1, len(vals)))(*vals)
    return arr, ctypes.addressof(arr), len(vals)


def _floats(x, name):
    """A list of Python floats from a 1-D sequence, numpy array or torch tensor."""
    if _is_torch(x) or _is_numpy(x):
        x = x.reshape(-1).tolist()
    try:
        return [float(v) for v in x]
    except TypeError:
        raise TypeError("forkattn: %s must be a 1-D sequence of floats, got %s" % (name, type(x).__name__)) from None


# --------------------------------------------------------------------------------------------
# cached-prefix attention: torch


if torch is not None:
    from .ops import HAVE_CUSTOM_OPS, _check_bwd, _check_qkv, _ctx_for, _descs, _ints, _new_grads, _new_outputs
    from .ops import _follows_context, _records_context
    from .ops import _compiling, _scale_of, use_custom_ops

    Tensor = torch.Tensor
else:  # pragma: no cover - numpy-only installs
    HAVE_CUSTOM_OPS = False
    Tensor = None


def _one_group(prompt_lens, response_lens):
    P = _ints(prompt_lens, "prompt_lens")
    if len(P) != 1:
        raise _invalid("layout: prefix_cached_attention takes one group (one cached prompt), got %d" % len(P))
    return P[0], _ints(response_lens, "response_lens")


def _cached_fwd_impl(q, k, v, prompt_lens, response_lens, scale, causal, block_size=0):
    _check_qkv(q, k, v)
    P, R = _one_group(prompt_lens, response_lens)
    out, lse = _new_outputs(q)
    keep, ds = _descs(q, k, v, out)
    ctx, mem = _ctx_for(q)  # after every copy: the call is ordered after them
    _lib.prefix_cached_fwd(ctx, P, R, bool(causal), *ds, lse.data_ptr() or None, float(scale), mem,
                           int(block_size) or None)
    return out, lse


def _cached_bwd_impl(dout, q, k, v, out, lse, prompt_lens, response_lens, scale, causal, block_size=0):
    _check_qkv(q, k, v)
    _check_bwd(dout, out, lse, q)
    P, R = _one_group(prompt_lens, response_lens)
    dq, dk, dv = _new_grads(q, k, v)
    keep, ds = _descs(q, k, v, out, dout, dq, dk, dv)
    lse_c = lse.contiguous()
    ctx, mem = _ctx_for(q)
    _lib.prefix_cached_bwd(ctx, P, R, bool(causal), *ds[:5], lse_c.data_ptr() or None, *ds[5:], float(scale), mem,
                           int(block_size) or None)
    return dq, dk, dv


if torch is not None:

    class PrefixCachedAttentionFunction(torch.autograd.Function):
        """apply(q, k, v, prompt_lens, response_lens, scale, causal, block_size=0) -> (out, lse
        [R_total, Hq]); block_size 0: the causal / bidirectional mask, >= 1: block-causal."""

        @staticmethod
        @_records_context
        def forward(ctx, q, k, v, prompt_lens, response_lens, scale, causal, block_size=0):
            out, lse = _cached_fwd_impl(q, k, v, prompt_lens, response_lens, scale, causal, block_size)
            ctx.save_for_backward(q, k, v, out, lse, prompt_lens, response_lens)
            ctx.scale, ctx.causal, ctx.block_size = scale, causal, block_size
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)  # no zero tensor for lse's gradient every backward
            return out, lse

        @staticmethod
        @_follows_context
        def backward(ctx, dout, _dlse):
            if dout is None:  # only lse was used
                return (None,) * 8
            q, k, v, out, lse, P, R = ctx.saved_tensors
            dq, dk, dv = _cached_bwd_impl(dout, q, k, v, out, lse, P, R, ctx.scale, ctx.causal, ctx.block_size)
            return dq, dk, dv, None, None, None, None, None

else:  # pragma: no cover
    PrefixCachedAttentionFunction = None


if HAVE_CUSTOM_OPS:

    @torch.library.custom_op("forkattn::prefix_cached_fwd", mutates_args=())
    def prefix_cached_fwd(q: Tensor, k: Tensor, v: Tensor, prompt_lens: Tensor, response_lens: Tensor,
                          softmax_scale: float, causal: bool, block_size: int = 0) -> Tuple[Tensor, Tensor]:
        return _cached_fwd_impl(q, k, v, prompt_lens, response_lens, softmax_scale, causal, block_size)

    @prefix_cached_fwd.register_fake
    def _(q, k, v, prompt_lens, response_lens, softmax_scale, causal, block_size=0):
        _check_qkv(q, k, v)
        return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)

    @torch.library.custom_op("forkattn::prefix_cached_bwd", mutates_args=())
    def prefix_cached_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          prompt_lens: Tensor, response_lens: Tensor, softmax_scale: float,
                          causal: bool, block_size: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
        return _cached_bwd_impl(dout, q, k, v, out, lse, prompt_lens, response_lens, softmax_scale, causal,
                                block_size)

    @prefix_cached_bwd.register_fake
    def _(dout, q, k, v, out, lse, prompt_lens, response_lens, softmax_scale, causal, block_size=0):
        _check_qkv(q, k, v)
        _check_bwd(dout, out, lse, q)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @_records_context

    def _cached_setup(ctx, inputs, output):
        # block_size has a schema default: torch fills it in, but be safe if a version does not
        q, k, v, P, R, scale, causal = inputs[:7]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, P, R)
        ctx.scale, ctx.causal = scale, causal
        ctx.block_size = int(inputs[7]) if len(inputs) > 7 else 0
        ctx.num_inputs = len(inputs)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero tensor filled for lse's gradient every backward

    @_follows_context

    def _cached_backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * ctx.num_inputs
        q, k, v, out, lse, P, R = ctx.saved_tensors
        if ctx.block_size:
            dq, dk, dv = torch.ops.forkattn.prefix_cached_bwd(dout, q, k, v, out, lse, P, R, ctx.scale, ctx.causal,
                                                              ctx.block_size)
        else:  # the op's original seven-argument form
            dq, dk, dv = torch.ops.forkattn.prefix_cached_bwd(dout, q, k, v, out, lse, P, R, ctx.scale, ctx.causal)
        return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)

    prefix_cached_fwd.register_autograd(_cached_backward, setup_context=_cached_setup)


def prefix_cached_attention(q, k, v, layout, *, scale=None, causal=False, return_lse=False, softmax_scale=None,
                            block_size=None):
    """Attention of one group's responses against a shared prompt whose K/V are cached
    (``forkattn_prefix_cached_fwd`` / ``_bwd``).

    ``layout``: a :class:`forkattn.SharedPrefixLayout` of **one** group (prompt length P,
    responses R_0..R_{n-1}, R_total = their sum). ``q`` [R_total, Hq, d] holds the responses'
    query rows only (the prompt has no queries here); ``k``/``v`` [P + R_total, Hkv, d] hold the
    prompt's (cached) rows first, then the responses' rows in layout order (Hq a multiple of
    Hkv; float32/bfloat16/float16; CPU or CUDA). Response i's rows see all P prompt keys and
    their own response's keys: all of them with ``causal=False`` (the default: a diffusion LM's
    bidirectional attention), causally with ``causal=True``. The result equals rows P.. of
    :func:`forkattn.prefix_attention` on the full rows with the same ``causal`` (note that
    ``prefix_attention`` defaults to ``causal=True``).

    ``block_size=n`` (an int >= 1; default None, and 0, keep the mask above) makes it
    block-causal, for block diffusion LMs (``forkattn_prefix_cached_block_fwd`` / ``_bwd``): each
    response's rows form blocks of n rows from its first row (the last block may be shorter); a
    row of block j sees all P prompt keys and every key of its response's blocks 0..j
    (bidirectional inside a block, causal across blocks). ``block_size=1`` is ``causal=True``;
    a block at least as long as every response is ``causal=False``. It cannot be combined with
    ``causal=True``. A negative ``block_size`` raises ``ForkattnInvalidArgument``; a library
    without the block functions raises ``ForkattnError`` (status 3) only when it is used.

    Returns out [R_total, Hq, d], and lse float32 [R_total, Hq] (not differentiable) with
    ``return_lse=True``. Differentiable in q, k and v: dk/dv of the prompt rows sum every
    response's contribution (detach the cached K/V to keep gradients out of a cache).
    ``scale`` (alias ``softmax_scale``) defaults to 1/sqrt(d).
    """
    _need_torch("prefix_cached_attention")
    from .layouts import SharedPrefixLayout

    if not isinstance(layout, SharedPrefixLayout):
        raise TypeError("forkattn.prefix_cached_attention: layout must be a SharedPrefixLayout, got %s"
                        % type(layout).__name__)
    if scale is not None and softmax_scale is not None:
        raise TypeError("forkattn.prefix_cached_attention: give scale or softmax_scale, not both")
    block = _block_arg(block_size)
    if block and causal:
        raise _invalid("block_size = %d and causal=True: block-causal attention has its own mask (block_size=1 "
                       "is the causal one); give one of them" % block)
    _check_qkv(q, k, v)
    if layout.num_groups != 1:
        raise _invalid("layout: prefix_cached_attention takes one group (one cached prompt), got %d"
                       % layout.num_groups)
    if not _compiling():
        P = int(layout.prompt_lens[0])
        R = layout.num_rows - P
        if q.shape[0] != R:
            raise _invalid("q has %d rows; it holds the responses' rows only: %d (prompt %d of the layout's %d rows "
                           "excluded)" % (q.shape[0], R, P, layout.num_rows))
        for name, x in (("k", k), ("v", v)):
            if x.shape[0] != layout.num_rows:
                raise _invalid("%s has %d rows, need prompt + responses = %d + %d = %d"
                               % (name, x.shape[0], P, R, layout.num_rows))
    s = _scale_of(q, softmax_scale if scale is None else scale)
    args = (q, k, v, layout.prompt_lens, layout.response_lens, s, bool(causal))
    if block:  # only then: the seven-argument op / Function calls stay as they were
        args += (block,)
    if use_custom_ops():
        out, lse = torch.ops.forkattn.prefix_cached_fwd(*args)
    else:
        out, lse = PrefixCachedAttentionFunction.apply(*args)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# cached-prefix attention: numpy


def _np_scale(q, scale):
    return _lib.softmax_scale(q.shape[-1], scale)


def _np_block(block_size, causal):
    block = _block_arg(block_size)
    if block and causal:
        raise _invalid("block_size = %d and causal=True: block-causal attention has its own mask; give one of them"
                       % block)
    return block


def _resp_lens(response_lens):
    import numpy as np

    return [int(x) for x in np.asarray(response_lens).reshape(-1)]


def prefix_cached_attention_numpy(q, k, v, prompt_len, response_lens, *, scale=None, causal=False, return_lse=False,
                                  context=None, block_size=None):
    """numpy forward of :func:`prefix_cached_attention` (host memory): q [R_total, Hq, d] the
    responses' rows, k/v [prompt_len + R_total, Hkv, d] (cached prompt rows first),
    ``response_lens`` the responses' lengths, ``block_size`` as there (None / 0: not
    block-causal). Returns out (and lse float32 [R_total, Hq])."""
    from .numpy_api import _ctx, _desc, _fwd_outputs, _qkv, _saved

    block = _np_block(block_size, causal)
    q, k, v = _qkv(q, k, v)
    R = _resp_lens(response_lens)
    out, lse = _fwd_outputs(q)
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    sc = _np_scale(q, scale)
    _lib.prefix_cached_fwd(_ctx(context), int(prompt_len), R, bool(causal), qd, kd, vd, od, lse.ctypes.data,
                           sc, _lib.MEMORY_HOST, block or None)
    return (out, _saved(lse, _np_cached_settings(prompt_len, R, causal, block, sc))) if return_lse else out


def _np_cached_settings(prompt_len, R, causal, block, scale):
    """The record a numpy forward's lse carries (see forkattn.numpy_api.SavedStats)."""
    from .numpy_api import _f32

    return {"op": "prefix_cached_attention", "causal": bool(causal), "block_size": int(block),
            "softmax_scale": _f32(scale), "layout": (int(prompt_len), tuple(R))}


def prefix_cached_attention_backward_numpy(dout, q, k, v, out, lse, prompt_len, response_lens, *, scale=None,
                                           causal=False, context=None, block_size=None):
    """Gradients (dq [R_total, Hq, d], dk, dv [prompt_len + R_total, Hkv, d]) of sum(out * dout)
    for :func:`prefix_cached_attention_numpy`; ``lse`` from the forward (same ``causal`` and
    ``block_size``)."""
    import numpy as np

    from .numpy_api import _arr, _check_settings, _ctx, _desc, _grads, _lse_arg, _qkv

    block = _np_block(block_size, causal)
    q, k, v = _qkv(q, k, v)
    R = _resp_lens(response_lens)
    dq, dk, dv = _grads(q, k, v)
    sc = _np_scale(q, scale)
    _check_settings(lse, _np_cached_settings(prompt_len, R, causal, block, sc), "lse")
    lse = _lse_arg(lse, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.prefix_cached_bwd(_ctx(context), int(prompt_len), R, bool(causal), *d[:5], lse.ctypes.data, *d[5:],
                           sc, _lib.MEMORY_HOST, block or None)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# the cache


def _parse_device(device):
    """(memory, CUDA index or None, name) of "cpu", "cuda", "cuda:N" or a torch.device."""
    if torch is not None and isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError("forkattn: device must be 'cpu', 'cuda' or 'cuda:N', got %s" % type(device).__name__)
    d = device.strip().lower()
    if d == "cpu":
        return _lib.MEMORY_HOST, None, "cpu"
    if d == "cuda" or d.startswith("cuda:"):
        if torch is None:
            raise _invalid("device %r: a device cache hands out torch tensors; PyTorch is not installed" % device)
        if d == "cuda":
            idx = int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
        else:
            try:
                idx = int(d[5:])
            except ValueError:
                raise _invalid("device %r: expected 'cuda:N'" % device) from None
        return _lib.MEMORY_DEVICE, idx, "cuda:%d" % idx
    raise _invalid("device %r: 'cpu' (host memory) or 'cuda[:N]' (device memory, GPU backend)" % device)


class _CudaView:
    """A __cuda_array_interface__ over a C-owned device buffer (for torch.as_tensor)."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (int(ptr), False),
                                         "strides": None, "version": 2}


class KVCache(_lib._ContextBound):
    """A cache of token prefixes' per-layer K/V (``forkattn_kv_cache``).

    ``KVCache(capacity_bytes, layers, kv_heads, head_dim, dtype, *, block_tokens=0,
    device="cpu", context=None, array=None)``: entries hold, per layer, K and V
    ``[n, kv_heads, head_dim]`` of ``dtype`` (``"float32"``/``"bfloat16"``/``"float16"`` or a
    torch or numpy dtype; bits are stored, never converted), at most ``capacity_bytes`` of K/V
    in all (least recently used unheld entries are evicted to make room). ``block_tokens`` is
    the radix index's hash block (0: 16). ``device="cpu"`` keeps entries in host memory;
    ``"cuda"``/``"cuda:N"`` in device memory, which needs a GPU context (default: the thread's
    GPU context of that device). The cache keeps its context (``context``, default the thread's
    current one) alive; its argument errors are reported through it.

    ``array`` picks what :meth:`KVEntry.k` / :meth:`KVEntry.v` return: ``"torch"`` tensors or
    ``"numpy"`` arrays. Default: torch for a torch dtype or a device cache, numpy for a numpy
    dtype, else torch when PyTorch is installed. (numpy bfloat16 views need ``ml_dtypes``.)

    Methods: :meth:`insert`, :meth:`lookup` (a :class:`KVEntry`, a context manager that holds the
    entry), :meth:`stats`, :meth:`close` (also ``with KVCache(...) as cache:``). Any number of
    threads may insert, look up and release at once.
    """

    def __init__(self, capacity_bytes, layers, kv_heads, head_dim, dtype, *, block_tokens=0, device="cpu",
                 context=None, array=None):
        self._handle = None
        self._held = weakref.WeakSet()
        self._lock = threading.Lock()
        self.capacity_bytes = _int_arg(capacity_bytes, "capacity_bytes")
        if self.capacity_bytes < 1:
            raise _invalid("capacity_bytes = %d: the cache needs a budget of at least one byte" % self.capacity_bytes)
        self.layers = _int_arg(layers, "layers")
        self.kv_heads = _int_arg(kv_heads, "kv_heads")
        self.head_dim = _int_arg(head_dim, "head_dim")
        self.block_tokens = _int_arg(block_tokens, "block_tokens")
        for name, x in (("layers", self.layers), ("kv_heads", self.kv_heads)):
            if x < 1:
                raise _invalid("%s = %d must be >= 1" % (name, x))
        if self.block_tokens < 0:
            raise _invalid("block_tokens = %d must be >= 0 (0 picks 16)" % self.block_tokens)
        self._code = _dtype_code(dtype)
        self.dtype = _CODE_NAMES[self._code]
        self._memory, self._cuda, self.device = _parse_device(device)
        if array is None:
            if self._memory == _lib.MEMORY_DEVICE or (torch is not None and isinstance(dtype, torch.dtype)):
                array = "torch"
            elif _is_numpy_dtype(dtype):
                array = "numpy"
            else:
                array = "torch" if torch is not None else "numpy"
        if array not in ("torch", "numpy"):
            raise ValueError("forkattn: array must be 'torch' or 'numpy', not %r" % (array,))
        if array == "torch" and torch is None:
            raise _invalid("array='torch' but PyTorch is not installed (use array='numpy')")
        if array == "numpy" and self._memory == _lib.MEMORY_DEVICE:
            raise _invalid("array='numpy' cannot view device memory: a cuda cache hands out torch tensors")
        self.array = array
        if context is None:
            context = _lib.current_context(self._cuda)
        if not isinstance(context, _lib.Context):
            raise TypeError("forkattn: context must be a forkattn.Context, got %s" % type(context).__name__)
        self._ctx = context
        self._handle = _lib.kv_cache_create(context, self.capacity_bytes, self.block_tokens, self.layers,
                                            self.kv_heads, self.head_dim, self._code, self._memory)

    # -- state
    @property
    def itemsize(self):
        return _lib.DTYPE_ITEMSIZE[self._code]

    def entry_bytes(self, n):
        """K/V bytes an entry of ``n`` tokens takes from the budget: 2 * layers * n * kv_heads *
        head_dim * itemsize."""
        return 2 * self.layers * int(n) * self.kv_heads * self.head_dim * self.itemsize

    @property
    def held(self):
        """Entries held now through this object."""
        return len(self._held)

    # -- operations
    def _layer_list(self, x, name):
        if (_is_torch(x) and x.dim() == 4) or (_is_numpy(x) and x.ndim == 4):
            return [x[i] for i in range(x.shape[0])]
        if _is_torch(x) or _is_numpy(x):
            raise _invalid("%s must be a sequence of %d [n, kv_heads, head_dim] tensors or one [layers, n, kv_heads, "
                           "head_dim] tensor, got shape %s" % (name, self.layers, tuple(x.shape)))
        try:
            return list(x)
        except TypeError:
            raise TypeError("forkattn: %s must be a sequence of per-layer tensors, got %s"
                            % (name, type(x).__name__)) from None

    def insert(self, tokens, k_layers, v_layers):
        """Store the K/V of the prefix ``tokens`` (n >= 1 int32 token ids) computed alone:
        ``k_layers``/``v_layers`` are ``layers`` tensors ``[n, kv_heads, head_dim]`` each (or one
        ``[layers, n, kv_heads, head_dim]`` tensor), of the cache's dtype, numpy arrays or torch
        tensors on the CPU or (GPU context) CUDA; they are copied. An equal prefix already cached
        is refreshed. Returns True when stored, False when rejected (larger than the capacity, or
        room only by evicting held entries)."""
        h = self.handle
        ks, vs = self._layer_list(k_layers, "k_layers"), self._layer_list(v_layers, "v_layers")
        if len(ks) != self.layers or len(vs) != self.layers:
            raise _invalid("insert: %d key and %d value tensors given, the cache has %d layers"
                           % (len(ks), len(vs), self.layers))
        tk, tp, n = _tokens(tokens)
        items = [_arr3(x, "%s[%d]" % (nm, i)) for nm, arr in (("k", ks), ("v", vs)) for i, x in enumerate(arr)]
        mem, dev = _one_memory(items, "insert")
        if mem == _lib.MEMORY_DEVICE and self._ctx.backend == "gpu" and dev != self._ctx.device:
            raise _invalid("insert: the tensors are on cuda:%d, the cache's context on device %d"
                           % (dev, self._ctx.device))
        _sync(dev)
        descs = [t for _, t, _, _ in items]
        stored = _lib.kv_cache_insert(self._ctx, h, self.layers, tp, n, descs[:self.layers], descs[self.layers:],
                                      mem)
        del tk, items
        return stored

    def lookup(self, tokens):
        """The longest cached prefix of ``tokens`` (an entry whose tokens equal tokens[:m] for the
        largest m), held until released: a :class:`KVEntry` (``entry.matched`` = m, 0 and falsy
        on a miss). Use it as a context manager (``with cache.lookup(t) as e:``) or call
        ``e.release()``."""
        h = self.handle
        tk, tp, n = _tokens(tokens)
        e, m = _lib.kv_cache_lookup(self._ctx, h, tp, n)
        del tk
        entry = KVEntry(self, e, m)
        if e is not None:
            with self._lock:
                self._held.add(entry)
        return entry

    def stats(self):
        """Counters: ``hits``, ``misses`` (lookups), ``insertions`` (stored or refreshed),
        ``evictions`` (LRU), ``rejected`` (inserts that did not fit), ``bytes`` and ``entries``
        (held now)."""
        return _lib.kv_cache_stats(self._ctx, self.handle)

    # -- lifetime
    def close(self, force=False):
        """Destroy the cache. Refused (``ForkattnInvalidArgument``) while entries are held, unless
        ``force=True``: those entries are then released and their views become invalid."""
        if self._handle is None:
            return
        with self._lock:
            held = list(self._held)
        if held and not force:
            raise _invalid("KVCache.close: %d entries are still held; release them first (or close(force=True), "
                           "which invalidates their views)" % len(held))
        for e in held:
            e.release()
        with self._lock:
            h, self._handle = self._handle, None
        _lib.kv_cache_destroy(h)

    def _close_on_gc(self):
        self.close(force=True)

    def __repr__(self):
        if self._handle is None:
            return "<forkattn.KVCache closed>"
        s = self.stats()
        return ("<forkattn.KVCache %s %s layers=%d kv_heads=%d head_dim=%d: %d entries, %d of %d bytes>"
                % (self.device, self.dtype, self.layers, self.kv_heads, self.head_dim, s["entries"], s["bytes"],
                   self.capacity_bytes))


class KVEntry(_lib._Owned):
    """A lookup's result: ``matched`` tokens of a cached prefix (0 on a miss: the entry is falsy
    and holds nothing), held — never evicted, refreshed or freed — until :meth:`release` (or the
    end of its ``with`` block, or its garbage collection).

    :meth:`k` / :meth:`v` return layer ``l``'s ``[matched, kv_heads, head_dim]`` K / V as torch
    tensors or numpy arrays (the cache's ``array``) that **view the cache's memory**: no copy,
    but valid only while the entry is held. Do not use them after :meth:`release` (or after the
    cache is closed): copy what must outlive the hold (``k(l, copy=True)``, ``torch.cat`` with
    the request's own K/V, ...). They are read-only for the holder (numpy views are marked
    non-writeable; do not write into torch views).
    """

    def __init__(self, cache, handle, matched):
        self._cache = cache
        self._handle = handle
        self.matched = int(matched)

    @property
    def hit(self):
        return self.matched > 0

    @property
    def held(self):
        """True until released (a miss is never held)."""
        return self._handle is not None

    def __bool__(self):
        return self.hit

    def _view(self, layer, which, copy):
        if not self.hit:
            raise _invalid("the lookup missed: this entry holds no K/V")
        if self._handle is None:
            raise ValueError("forkattn: this KVEntry was released; its K/V views are no longer valid")
        c = self._cache
        layer = _int_arg(layer, "layer")
        if not 0 <= layer < c.layers:
            raise _invalid("layer %d outside 0..%d" % (layer, c.layers - 1))
        t = _lib.kv_entry_view(self._handle, layer, which)
        if not t.data:
            raise _lib.ForkattnError(6, "the library returned no data for layer %d" % layer)
        shape = (int(t.rows), int(t.heads), int(t.head_dim))
        n = shape[0] * shape[1] * shape[2]
        ptr = int(t.data)
        if c._memory == _lib.MEMORY_DEVICE:
            typestr = {_lib.DTYPE_F32: "<f4", _lib.DTYPE_F16: "<f2", _lib.DTYPE_BF16: "<i2"}[c._code]
            x = torch.as_tensor(_CudaView(ptr, shape, typestr), device=torch.device("cuda", c._cuda))
            if c._code == _lib.DTYPE_BF16:
                x = x.view(torch.bfloat16)
            return x.clone() if copy else x
        buf = (ctypes.c_char * (n * c.itemsize)).from_address(ptr)
        if c.array == "torch":
            from .ops import _DTYPES

            td = {code: dt for dt, code in _DTYPES.items()}[c._code]
            x = torch.frombuffer(buf, dtype=td, count=n).view(shape)
            return x.clone() if copy else x
        import numpy as np

        if c._code == _lib.DTYPE_BF16:
            try:
                import ml_dtypes
            except ImportError:
                raise _invalid("a bfloat16 cache's numpy views need ml_dtypes (pip install ml-dtypes), or use "
                               "array='torch'") from None
            nd = np.dtype(ml_dtypes.bfloat16)
        else:
            nd = np.dtype(np.float32 if c._code == _lib.DTYPE_F32 else np.float16)
        x = np.frombuffer(buf, dtype=nd, count=n).reshape(shape)
        if copy:
            return x.copy()
        x.flags.writeable = False
        return x

    def k(self, layer, copy=False):
        """Keys of ``layer``, ``[matched, kv_heads, head_dim]``: a view valid while held, or an
        independent copy with ``copy=True``."""
        return self._view(layer, 0, copy)

    def v(self, layer, copy=False):
        """Values of ``layer``, as :meth:`k`."""
        return self._view(layer, 1, copy)

    def release(self):
        """Release the hold (idempotent; nothing for a miss). Views taken from it become invalid."""
        c = self._cache
        with c._lock:  # one C release per hold, even with threads racing here
            h, self._handle = self._handle, None
            if h is not None:
                c._held.discard(self)
                if c._handle is not None:
                    _lib.kv_cache_release(c._handle, h)

    close = release  # with-blocks and collection release the entry (_lib._Owned)

    def __repr__(self):
        state = "held" if self.held else ("miss" if not self.hit else "released")
        return "<forkattn.KVEntry matched=%d %s>" % (self.matched, state)


# --------------------------------------------------------------------------------------------
# similarity and the reuse-depth profile


def kv_similarity(a, b, *, context=None):
    """Per-head similarity of two K (or V) tensors over the same rows (``forkattn_kv_similarity``):
    ``sim[h]`` = mean over rows r of cos(a[r, h, :], b[r, h, :]) (sums in double; a row where
    either vector is all zero counts 1 if both are, else 0; 0 rows give 1).

    ``a``, ``b``: ``[rows, heads, d]``, same shape, dtypes may differ (float32/bfloat16/float16),
    both numpy arrays / CPU tensors or both CUDA tensors of one device. Returns
    ``(per_head, mean)``: per_head float32 ``[heads]`` (a CPU torch tensor when ``a`` is a torch
    tensor, else a numpy array) and ``mean`` (a float) over heads."""
    ia, ib = _arr3(a, "a"), _arr3(b, "b")
    mem, dev = _one_memory([ia, ib], "kv_similarity")
    ctx = context if context is not None else _lib.current_context(dev)
    _sync(dev)
    per, mean = _lib.kv_similarity(ctx, ia[1], ib[1], mem)
    if _is_torch(a):
        return torch.tensor(per, dtype=torch.float32), mean
    import numpy as np

    return np.asarray(per, dtype=np.float32), mean


def _read_profile_header(path):
    """(layers, threshold) from a profile file the C library has just loaded (so well formed)."""
    layers = threshold = None
    with open(path, "rb") as f:
        for raw in f:
            parts = raw.decode("ascii", "replace").split()
            if len(parts) == 2 and parts[0] == "layers":
                layers = int(parts[1])
            elif len(parts) == 2 and parts[0] == "threshold":
                threshold = float(parts[1])
            if layers is not None and threshold is not None:
                break
    return layers, threshold


class ReuseProfile(_lib._Owned):
    """Reuse-depth profile (``forkattn_reuse_profile``): per 1% bin of the prefix ratio r
    (prefix / sequence), the averaged per-layer similarity of a prefix's K/V computed alone vs
    inside the request, and the depth b(r): how many leading layers may reuse cached K/V
    (similarity >= ``threshold``), non-decreasing in r.

    ``ReuseProfile(layers, threshold=0.95, *, context=None)``; :meth:`add` a measurement,
    :meth:`depth` of a ratio, :meth:`save` to / :meth:`load` from a small text file,
    :meth:`close` (or ``with``). ``context`` (default: the calling thread's current context)
    only receives error messages. Calls are serialized by a lock.
    """

    def __init__(self, layers, threshold=0.95, *, context=None, _handle=None):
        self._handle = None
        self._lock = threading.Lock()
        self._context = context
        if _handle is not None:
            self._handle = _handle
            self.layers, self.threshold = int(layers), float(threshold)
            return
        self.layers = _int_arg(layers, "layers")
        self.threshold = float(threshold)
        self._handle = _lib.reuse_profile_create(self._ctx(), self.layers, self.threshold)

    def _ctx(self):
        return self._context if self._context is not None else _lib.current_context()

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("forkattn: this ReuseProfile is closed")
        return self._handle

    def add(self, ratio, sims):
        """Add one measurement: prefix ratio ``ratio`` in [0, 1] and ``sims``, one similarity per
        layer in [-1, 1] (e.g. :func:`kv_similarity`'s mean per layer; a sequence, numpy array or
        tensor)."""
        vals = _floats(sims, "sims")
        with self._lock:
            _lib.reuse_profile_add(self._ctx(), self.handle, self.layers, float(ratio), vals)

    def depth(self, ratio):
        """b(ratio): the number of leading layers that may reuse cached K/V (0..layers)."""
        with self._lock:
            return _lib.reuse_profile_depth(self._ctx(), self.handle, float(ratio))

    def save(self, path):
        """Write the profile as text (docs/dlm-cache.md); :meth:`load` reads it back bit for bit."""
        with self._lock:
            _lib.reuse_profile_save(self._ctx(), self.handle, path)

    @classmethod
    def load(cls, path, *, context=None):
        """A profile read from a file written by :meth:`save` (malformed files raise
        ``ForkattnInvalidArgument``)."""
        ctx = context if context is not None else _lib.current_context()
        h = _lib.reuse_profile_load(ctx, path)
        try:
            layers, threshold = _read_profile_header(path)
            if layers is None or threshold is None:
                raise _invalid("%s: loaded, but its layers/threshold lines could not be read back" % (path,))
        except Exception:
            _lib.reuse_profile_free(h)
            raise
        return cls(layers, threshold, context=context, _handle=h)

    def close(self):
        with self._lock:
            h, self._handle = self._handle, None
        _lib.reuse_profile_free(h)

    def __repr__(self):
        if self._handle is None:
            return "<forkattn.ReuseProfile closed>"
        return "<forkattn.ReuseProfile layers=%d threshold=%g>" % (self.layers, self.threshold)
