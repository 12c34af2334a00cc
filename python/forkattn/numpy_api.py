"""numpy front end (host memory, no PyTorch needed).

Arrays are [rows, heads, head_dim] ``float32`` or ``float16`` (numpy has no bfloat16; an
``ml_dtypes.bfloat16`` array is accepted too). Layouts are given as plain integers/sequences.
Each function takes an optional ``context`` (a :class:`forkattn.Context`); by default the
calling thread's context is used. Forward and backward are provided; nothing here tracks
gradients.
"""

from __future__ import annotations

import math

import numpy as np

from . import _lib

__all__ = [
    "prefix_attention",
    "prefix_attention_backward",
    "tree_attention",
    "tree_attention_backward",
    "varlen_attention",
    "varlen_attention_backward",
    "trie_from_sequences",
]


def _dtype_code(a):
    if a.dtype == np.float32:
        return _lib.DTYPE_F32
    if a.dtype == np.float16:
        return _lib.DTYPE_F16
    if a.dtype.name == "bfloat16":
        return _lib.DTYPE_BF16
    raise ValueError("forkattn: dtype %s is not supported (float32, float16, bfloat16)" % a.dtype)


def _arr(a, name):
    if not isinstance(a, np.ndarray):
        raise TypeError("forkattn: %s must be a numpy array, got %s" % (name, type(a).__name__))
    if a.ndim != 3:
        raise ValueError("forkattn: %s must be [rows, heads, head_dim], got shape %s" % (name, a.shape))
    return a


def _desc(a):
    """(array kept alive, forkattn_tensor)."""
    code = _dtype_code(a)
    item = a.dtype.itemsize
    rows, heads, d = a.shape
    st = a.strides
    ok = all(s % item == 0 for s in st) and (d <= 1 or st[2] == item)
    t = None
    if ok:
        t = _lib.make_tensor(a.ctypes.data, code, rows, heads, d, st[0] // item, st[1] // item)
    if t is None:
        a = np.ascontiguousarray(a)
        t = _lib.make_tensor(a.ctypes.data, code, rows, heads, d, a.strides[0] // item, a.strides[1] // item)
    return a, t


def _ctx(context):
    return context if context is not None else _lib.current_context()


def _qkv(q, k, v):
    q, k, v = _arr(q, "q"), _arr(k, "k"), _arr(v, "v")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("forkattn: q, k, v must share one dtype, got %s, %s, %s" % (q.dtype, k.dtype, v.dtype))
    return q, k, v


def _scale(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _groups(prompt_lens, response_lens, group_sizes):
    if np.ndim(prompt_lens) == 0:
        P = [int(prompt_lens)]
        R = [int(x) for x in np.asarray(response_lens).reshape(-1)]
        S = [len(R)] if group_sizes is None else [int(x) for x in np.asarray(group_sizes).reshape(-1)]
    else:
        P = [int(x) for x in np.asarray(prompt_lens).reshape(-1)]
        R = [int(x) for x in np.asarray(response_lens).reshape(-1)]
        if group_sizes is None:
            raise ValueError("forkattn: group_sizes is required with several prompts")
        S = [int(x) for x in np.asarray(group_sizes).reshape(-1)]
    return P, S, R


def _fwd_outputs(q):
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty(q.shape[:2], dtype=np.float32)
    return out, lse


def _grads(q, k, v):
    return np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)


def _lse_arg(lse, q):
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    if lse.shape != q.shape[:2]:
        raise ValueError("forkattn: lse must be float32 %s, got %s" % (q.shape[:2], lse.shape))
    return lse


def prefix_attention(q, k, v, prompt_lens, response_lens, group_sizes=None, *, softmax_scale=None,
                     causal=True, return_lse=False, context=None):
    """Shared-prompt attention on packed rows. One group: ``prompt_lens`` an int and
    ``response_lens`` its responses' lengths. Several groups packed back to back
    (``[prompt_0, responses of 0..., prompt_1, ...]``): ``prompt_lens`` [G], ``group_sizes``
    [G] and ``response_lens`` [sum(group_sizes)]. Returns out (and lse [rows, Hq] float32)."""
    q, k, v = _qkv(q, k, v)
    P, S, R = _groups(prompt_lens, response_lens, group_sizes)
    out, lse = _fwd_outputs(q)
    if not P and q.shape[0] != 0:
        raise ValueError("forkattn: q has %d rows, the (empty) layout needs 0" % q.shape[0])
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    _lib.prefix_fwd(_ctx(context), P, S, R, causal, qd, kd, vd, od, lse.ctypes.data, _scale(q, softmax_scale),
                    _lib.MEMORY_HOST)
    return (out, lse) if return_lse else out


def prefix_attention_backward(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes=None,
                              *, softmax_scale=None, causal=True, context=None):
    """Gradients (dq, dk, dv) of sum(out * dout); ``lse`` from the forward."""
    q, k, v = _qkv(q, k, v)
    P, S, R = _groups(prompt_lens, response_lens, group_sizes)
    dq, dk, dv = _grads(q, k, v)
    lse = _lse_arg(lse, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.prefix_bwd(_ctx(context), P, S, R, causal, *d[:5], lse.ctypes.data, *d[5:],
                    _scale(q, softmax_scale), _lib.MEMORY_HOST)
    return dq, dk, dv


def tree_attention(q, k, v, node_offsets, parents, *, softmax_scale=None, return_lse=False, context=None):
    """Tree attention over packed rows: node i owns rows [node_offsets[i], node_offsets[i+1])
    and attends to its ancestors (parents[i], -1 for a root) and causally to itself."""
    q, k, v = _qkv(q, k, v)
    out, lse = _fwd_outputs(q)
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    _lib.tree_fwd(_ctx(context), [int(x) for x in node_offsets], [int(x) for x in parents], qd, kd, vd, od,
                  lse.ctypes.data, _scale(q, softmax_scale), _lib.MEMORY_HOST)
    return (out, lse) if return_lse else out


def tree_attention_backward(dout, q, k, v, out, lse, node_offsets, parents, *, softmax_scale=None,
                            context=None):
    q, k, v = _qkv(q, k, v)
    dq, dk, dv = _grads(q, k, v)
    lse = _lse_arg(lse, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.tree_bwd(_ctx(context), [int(x) for x in node_offsets], [int(x) for x in parents], *d[:5],
                  lse.ctypes.data, *d[5:], _scale(q, softmax_scale), _lib.MEMORY_HOST)
    return dq, dk, dv


def varlen_attention(q, k, v, cu_seqlens, *, softmax_scale=None, causal=True, return_lse=False,
                     context=None):
    """Variable-length self-attention over packed sequences (``cu_seqlens`` [batch+1] starting at
    0). lse is returned as [Hq, total] float32 (flash-attn's varlen layout)."""
    q, k, v = _qkv(q, k, v)
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    out, lse = _fwd_outputs(q)
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    _lib.varlen_fwd(_ctx(context), cu, causal, qd, kd, vd, od, lse.ctypes.data, _scale(q, softmax_scale),
                    _lib.MEMORY_HOST)
    return (out, np.ascontiguousarray(lse.T)) if return_lse else out


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens, *, softmax_scale=None, causal=True,
                              context=None):
    """``lse`` as returned by varlen_attention ([Hq, total])."""
    q, k, v = _qkv(q, k, v)
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    dq, dk, dv = _grads(q, k, v)
    lse = _lse_arg(np.asarray(lse).T, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.varlen_bwd(_ctx(context), cu, causal, *d[:5], lse.ctypes.data, *d[5:], _scale(q, softmax_scale),
                    _lib.MEMORY_HOST)
    return dq, dk, dv


def trie_from_sequences(sequences, single_root=False, context=None):
    """The deduplicated trie of token sequences, as a dict of int64 arrays: ``node_offsets``,
    ``parents``, ``input_rows`` (packed row of token j of sequence s at seq_offsets[s] + j),
    ``seq_offsets``, ``row_positions``, ``row_nodes``, ``node_depths``, ``row_tokens``, and
    ``num_rows``, ``replicated_tokens``, ``dedup_ratio``."""
    seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
    if not seqs:
        raise ValueError("forkattn: trie_from_sequences needs at least one sequence")
    offs = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([s.size for s in seqs], out=offs[1:])
    toks = np.ascontiguousarray(np.concatenate(seqs))
    d = _lib.trie_from_sequences(_ctx(context), offs.ctypes.data, toks.ctypes.data, len(seqs), toks.size,
                                 single_root)
    res = {}
    for key, val in d.items():
        if val is None or isinstance(val, (int, float)):
            res[key] = val
        else:
            res[key] = np.frombuffer(val, dtype=np.int64).copy() if len(val) else np.zeros(0, np.int64)
    res["seq_offsets"] = offs
    return res
