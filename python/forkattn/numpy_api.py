"""numpy front end (host memory, no PyTorch needed).

Arrays are [rows, heads, head_dim] ``float32`` or ``float16`` (numpy has no bfloat16; an
``ml_dtypes.bfloat16`` array is accepted too). Layouts are given as plain integers/sequences.
Each function takes an optional ``context`` (a :class:`forkattn.Context`); by default the
calling thread's context is used. Forward and backward are provided; nothing here tracks
gradients.
"""

from __future__ import annotations

import hashlib

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
    "kept_attention",
    "kept_attention_backward",
    "stream_kl",
    "stream_kl_backward",
    "kv_select",
    "rows_mean",
    "SavedStats",
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


def _invalid(msg):
    return _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, msg)


def _ctx(context):
    return context if context is not None else _lib.current_context()


def _qkv(q, k, v):
    q, k, v = _arr(q, "q"), _arr(k, "k"), _arr(v, "v")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("forkattn: q, k, v must share one dtype, got %s, %s, %s" % (q.dtype, k.dtype, v.dtype))
    return q, k, v


def _scale(q, softmax_scale):
    return _lib.softmax_scale(q.shape[-1], softmax_scale)


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


def _i64_np(x, name):
    """A 1-D contiguous int64 copy/view of an integer sequence or array. Values outside int64
    (Python ints that make numpy pick an object array, uint64 values above 2**63 - 1) raise
    ForkattnInvalidArgument instead of wrapping around in the int64 cast."""
    if not isinstance(x, np.ndarray):
        try:  # a sequence of Python ints: numpy refuses those outside int64 itself
            return np.ascontiguousarray(np.asarray(x, dtype=np.int64).reshape(-1))
        except OverflowError:
            x = np.asarray(x, dtype=object)
    a = np.asarray(x)
    if a.dtype == object:
        return np.array([_lib.int64_arg(v, "%s[%d]" % (name, i)) for i, v in enumerate(a.reshape(-1))],
                        dtype=np.int64)
    if a.size and a.dtype.kind == "u" and int(a.max()) > _lib.INT64_MAX:
        raise _invalid("%s: value %d does not fit in int64" % (name, int(a.max())))
    if a.size and a.dtype.kind == "f":
        hi, lo = float(a.max()), float(a.min())
        # 2**63 is the first float above int64 (a float INT64_MAX rounds up to it); NaN fails too
        if not (lo >= _lib.INT64_MIN and hi < 2.0 ** 63):
            raise _invalid("%s: values in [%s, %s] do not fit in int64" % (name, lo, hi))
    return np.ascontiguousarray(a.reshape(-1), dtype=np.int64)


def _fwd_outputs(q):
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty(q.shape[:2], dtype=np.float32)
    return out, lse


def _grads(q, k, v):
    return np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)


class SavedStats(np.ndarray):
    """The lse (or StreamKL ``stats``) array a forward of this module returns: a float32 numpy
    array that also records the settings the forward ran with (``forkattn_settings``: the
    operation, softmax scale, mask, layout, kept set, KL options). The matching backward
    compares its own settings with the record and raises ForkattnInvalidArgument on a
    difference, since gradients from another temperature, KL direction or mask than the
    forward's would be silently wrong. Views and copies keep the record; arithmetic results,
    ``np.asarray`` / ``np.ascontiguousarray`` conversions and unpickled copies are plain arrays,
    which a backward accepts unchecked."""

    def __array_finalize__(self, obj):
        self.forkattn_settings = getattr(obj, "forkattn_settings", None)

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        obj = np.asarray(obj)  # a computed array is no longer the forward's statistics
        return obj[()] if return_scalar else obj


def _saved(a, settings):
    a = a.view(SavedStats)
    a.forkattn_settings = settings
    return a


def _f32(x):
    """A float setting as the C library receives it (float32), for comparisons."""
    return float(np.float32(x))


def _check_settings(saved, settings, what):
    """Refuse a backward whose settings differ from those recorded by its forward."""
    rec = getattr(saved, "forkattn_settings", None)
    if rec is None:
        return
    diff = [k for k in settings if rec.get(k) != settings[k]]
    if rec.get("op") != settings.get("op"):
        diff = ["op"]
    if diff:
        k = diff[0]
        raise _lib.ForkattnInvalidArgument(
            _lib.ERR_INVALID_ARGUMENT,
            "%s comes from a %s forward with %s = %r, this backward has %s = %r: a backward must use "
            "its forward's settings" % (what, rec.get("op"), k, _short(rec.get(k)), k, _short(settings[k])))


def _short(x):
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _lse_arg(lse, q):
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    if lse.shape != q.shape[:2]:
        raise _invalid("lse must be float32 %s, got %s" % (q.shape[:2], lse.shape))
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
        raise _invalid("q has %d rows, the (empty) layout needs 0" % q.shape[0])
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    scale = _scale(q, softmax_scale)
    _lib.prefix_fwd(_ctx(context), P, S, R, causal, qd, kd, vd, od, lse.ctypes.data, scale, _lib.MEMORY_HOST)
    return (out, _saved(lse, _prefix_settings(P, S, R, causal, scale))) if return_lse else out


def _prefix_settings(P, S, R, causal, scale):
    return {"op": "prefix_attention", "causal": bool(causal), "softmax_scale": _f32(scale),
            "layout": (tuple(P), tuple(S), tuple(R))}


def prefix_attention_backward(dout, q, k, v, out, lse, prompt_lens, response_lens, group_sizes=None,
                              *, softmax_scale=None, causal=True, context=None):
    """Gradients (dq, dk, dv) of sum(out * dout); ``lse`` from the forward."""
    q, k, v = _qkv(q, k, v)
    P, S, R = _groups(prompt_lens, response_lens, group_sizes)
    dq, dk, dv = _grads(q, k, v)
    scale = _scale(q, softmax_scale)
    _check_settings(lse, _prefix_settings(P, S, R, causal, scale), "lse")
    lse = _lse_arg(lse, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.prefix_bwd(_ctx(context), P, S, R, causal, *d[:5], lse.ctypes.data, *d[5:], scale, _lib.MEMORY_HOST)
    return dq, dk, dv


def tree_attention(q, k, v, node_offsets, parents, *, softmax_scale=None, return_lse=False, context=None):
    """Tree attention over packed rows: node i owns rows [node_offsets[i], node_offsets[i+1])
    and attends to its ancestors (parents[i], -1 for a root) and causally to itself."""
    q, k, v = _qkv(q, k, v)
    out, lse = _fwd_outputs(q)
    offs, par = _ints(node_offsets), _ints(parents)
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    scale = _scale(q, softmax_scale)
    _lib.tree_fwd(_ctx(context), offs, par, qd, kd, vd, od, lse.ctypes.data, scale, _lib.MEMORY_HOST)
    return (out, _saved(lse, _tree_settings(offs, par, scale))) if return_lse else out


def _ints(x):
    return [int(a) for a in np.asarray(x).reshape(-1)]


def _tree_settings(offs, par, scale):
    return {"op": "tree_attention", "softmax_scale": _f32(scale), "layout": (tuple(offs), tuple(par))}


def tree_attention_backward(dout, q, k, v, out, lse, node_offsets, parents, *, softmax_scale=None,
                            context=None):
    q, k, v = _qkv(q, k, v)
    dq, dk, dv = _grads(q, k, v)
    offs, par = _ints(node_offsets), _ints(parents)
    scale = _scale(q, softmax_scale)
    _check_settings(lse, _tree_settings(offs, par, scale), "lse")
    lse = _lse_arg(lse, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.tree_bwd(_ctx(context), offs, par, *d[:5], lse.ctypes.data, *d[5:], scale, _lib.MEMORY_HOST)
    return dq, dk, dv


def varlen_attention(q, k, v, cu_seqlens, *, softmax_scale=None, causal=True, return_lse=False,
                     context=None):
    """Variable-length self-attention over packed sequences (``cu_seqlens`` [batch+1] starting at
    0). lse is returned as [Hq, total] float32 (flash-attn's varlen layout)."""
    q, k, v = _qkv(q, k, v)
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    out, lse = _fwd_outputs(q)
    (q, qd), (k, kd), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    scale = _scale(q, softmax_scale)
    _lib.varlen_fwd(_ctx(context), cu, causal, qd, kd, vd, od, lse.ctypes.data, scale, _lib.MEMORY_HOST)
    if not return_lse:
        return out
    return out, _saved(np.ascontiguousarray(lse.T), _varlen_settings(cu, causal, scale))


def _varlen_settings(cu, causal, scale):
    return {"op": "varlen_attention", "causal": bool(causal), "softmax_scale": _f32(scale), "layout": tuple(cu)}


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens, *, softmax_scale=None, causal=True,
                              context=None):
    """``lse`` as returned by varlen_attention ([Hq, total])."""
    q, k, v = _qkv(q, k, v)
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    dq, dk, dv = _grads(q, k, v)
    scale = _scale(q, softmax_scale)
    _check_settings(lse, _varlen_settings(cu, causal, scale), "lse")
    lse = _lse_arg(np.asarray(lse).T, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.varlen_bwd(_ctx(context), cu, causal, *d[:5], lse.ctypes.data, *d[5:], scale, _lib.MEMORY_HOST)
    return dq, dk, dv


def trie_from_sequences(sequences, single_root=False, context=None):
    """The deduplicated trie of token sequences, as a dict of int64 arrays: ``node_offsets``,
    ``parents``, ``input_rows`` (packed row of token j of sequence s at seq_offsets[s] + j),
    ``seq_offsets``, ``row_positions``, ``row_nodes``, ``node_depths``, ``row_tokens``, and
    ``num_rows``, ``replicated_tokens``, ``dedup_ratio``."""
    seqs = [_i64_np(s, "sequences[%d]" % i) for i, s in enumerate(sequences)]
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


# --------------------------------------------------------------------------------------------
# kept sets, kept-set attention, StreamKL, KV selection


def _get(obj, key, default=None):
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _layout_spec(layout, rows):
    """A layout as a _lib spec: an int T (one dense causal sequence of T rows), a dict (or object)
    with ``node_offsets`` and ``parents`` (a tree: e.g. trie_from_sequences' result), or with
    ``prompt_lens``, ``response_lens`` and ``group_sizes`` (causal shared-prompt groups; a scalar
    ``prompt_lens`` is one group, ``group_sizes`` then optional). None: one dense sequence of
    ``rows`` rows."""
    if layout is None:
        layout = rows
    if isinstance(layout, (int, np.integer)):
        return ("prefix", [int(layout)], [0], [])
    offs = _get(layout, "node_offsets")
    if offs is not None:
        return ("tree", [int(x) for x in np.asarray(offs).reshape(-1)],
                [int(x) for x in np.asarray(_get(layout, "parents")).reshape(-1)])
    P = _get(layout, "prompt_lens")
    if P is None:
        raise TypeError("forkattn: layout must be an int (rows of one dense sequence), or have node_offsets and "
                        "parents, or prompt_lens, response_lens (and group_sizes)")
    P, S, R = _groups(np.asarray(P), _get(layout, "response_lens"), _get(layout, "group_sizes"))
    return ("prefix", P, S, R)


def _kept_arg(kept, rows):
    """(make_kept dict or None, arrays kept alive) from a dict like kv_select()'s result or an
    object with the same attributes (a forkattn.KeptSet)."""
    if kept is None:
        return None, ()
    offs, idx, bm = _get(kept, "offsets"), _get(kept, "index"), _get(kept, "block_mask")
    keep = []
    ip = bp = None
    if idx is not None:
        ia = _i64_np(idx, "kept: index")
        keep.append(ia)
        ip = (ia.ctypes.data, ia.size)
        offs = [int(x) for x in np.asarray(offs).reshape(-1)] if offs is not None else None
    if bm is not None:
        ba = np.ascontiguousarray((np.asarray(bm) != 0).astype(np.uint8)).reshape(-1)
        keep.append(ba)
        bp = (ba.ctypes.data, ba.size)
    d = _lib.make_kept(_get(kept, "heads"), _get(kept, "compressed_rows", 0) or 0,
                       _get(kept, "query_start", 0) or 0, offs, ip, bp, rows)
    return d, keep


def _kept_record(d, keep):
    """What a forward's settings record of a kept set (a make_kept dict and its arrays)."""
    if d is None:
        return None
    h = hashlib.sha256()
    for a in keep:
        h.update(a.dtype.str.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    offs = tuple(d["offsets"]) if d["offsets"] is not None else None
    return (d["heads"], d["compressed_rows"], d["query_start"], offs, d["index"] is not None,
            d["block_mask"] is not None, h.hexdigest())


def _spec_record(spec):
    return tuple(tuple(x) if isinstance(x, list) else x for x in spec)


def kept_attention(q, k, v, layout=None, kept=None, *, softmax_scale=None, return_lse=False, context=None):
    """Attention restricted to a kept set: a row sees the keys its layout shows it that ``kept``
    keeps (a dict like :func:`kv_select`'s: ``heads``, ``compressed_rows``, ``query_start``,
    ``offsets``, ``index``, ``block_mask``; None: the whole layout). ``layout``: see
    _layout_spec (an int T, a tree dict, or prefix lengths). Returns out (and lse [rows, Hq])."""
    q, k, v = _qkv(q, k, v)
    spec = _layout_spec(layout, q.shape[0])
    kd, keep = _kept_arg(kept, q.shape[0])
    out, lse = _fwd_outputs(q)
    (q, qd), (k, kd_), (v, vd), (_, od) = _desc(q), _desc(k), _desc(v), _desc(out)
    scale = _scale(q, softmax_scale)
    _lib.kept_fwd(_ctx(context), spec, kd, qd, kd_, vd, od, lse.ctypes.data, scale, _lib.MEMORY_HOST)
    return (out, _saved(lse, _kept_settings(spec, kd, keep, scale))) if return_lse else out


def _kept_settings(spec, kd, keep, scale):
    return {"op": "kept_attention", "softmax_scale": _f32(scale), "layout": _spec_record(spec),
            "kept": _kept_record(kd, keep)}


def kept_attention_backward(dout, q, k, v, out, lse, layout=None, kept=None, *, softmax_scale=None, context=None):
    """Gradients (dq, dk, dv) of sum(out * dout) for :func:`kept_attention`."""
    q, k, v = _qkv(q, k, v)
    spec = _layout_spec(layout, q.shape[0])
    kd, keep = _kept_arg(kept, q.shape[0])
    dq, dk, dv = _grads(q, k, v)
    scale = _scale(q, softmax_scale)
    _check_settings(lse, _kept_settings(spec, kd, keep, scale), "lse")
    lse = _lse_arg(lse, q)
    ds = [_desc(_arr(np.asarray(t, dtype=q.dtype), "tensor")) for t in (q, k, v, out, dout, dq, dk, dv)]
    d = [t for _, t in ds]
    _lib.kept_bwd(_ctx(context), spec, kd, *d[:5], lse.ctypes.data, *d[5:], scale, _lib.MEMORY_HOST)
    return dq, dk, dv


def _kl_qk(q_t, k_t, q_s, k_s):
    q_t, k_t, q_s, k_s = _arr(q_t, "q_t"), _arr(k_t, "k_t"), _arr(q_s, "q_s"), _arr(k_s, "k_s")
    if q_t.dtype != k_t.dtype or q_s.dtype != k_s.dtype:
        raise ValueError("forkattn: q_t/k_t and q_s/k_s must each share one dtype, got %s, %s, %s, %s"
                         % (q_t.dtype, k_t.dtype, q_s.dtype, k_s.dtype))
    return q_t, k_t, q_s, k_s


def stream_kl(q_t, k_t, q_s, k_s, layout=None, kept=None, *, direction="forward", temperature=1.0,
              scale_by_tau2=False, scale_teacher=None, scale_student=None, context=None):
    """StreamKL forward (see forkattn.stream_kl): returns ``(kl, stats, outside_mass)``, float32
    [rows, H], [rows, H, 4] (for :func:`stream_kl_backward`) and [rows, H]."""
    q_t, k_t, q_s, k_s = _kl_qk(q_t, k_t, q_s, k_s)
    T, H = q_t.shape[0], q_t.shape[1]
    spec = _layout_spec(layout, T)
    kd, keep = _kept_arg(kept, T)
    opt = _lib.kl_options(direction, scale_teacher, scale_student, temperature, scale_by_tau2)
    kl = np.empty((T, H), np.float32)
    stats = np.empty((T, H, _lib.KL_STATS), np.float32)
    outside = np.empty((T, H), np.float32)
    ds = [_desc(a) for a in (q_t, k_t, q_s, k_s)]
    _lib.kl_fwd(_ctx(context), spec, *[d for _, d in ds], kd, opt, kl.ctypes.data, stats.ctypes.data,
                outside.ctypes.data, _lib.MEMORY_HOST)
    return kl, _saved(stats, _kl_settings(spec, kd, keep, opt)), outside


def _kl_settings(spec, kd, keep, opt):
    return {"op": "stream_kl", "direction": int(opt.direction), "temperature": _f32(opt.temperature),
            "scale_by_tau2": bool(opt.scale_by_tau2), "scale_teacher": _f32(opt.scale_teacher),
            "scale_student": _f32(opt.scale_student), "layout": _spec_record(spec), "kept": _kept_record(kd, keep)}


def stream_kl_backward(dkl, q_t, k_t, q_s, k_s, stats, layout=None, kept=None, *, direction="forward",
                       temperature=1.0, scale_by_tau2=False, scale_teacher=None, scale_student=None,
                       teacher_grad=False, context=None):
    """Gradients of sum(kl * dkl): ``(dq_s, dk_s)``, or ``(dq_s, dk_s, dq_t, dk_t)`` with
    ``teacher_grad=True``. ``stats`` from :func:`stream_kl` with the same arguments."""
    q_t, k_t, q_s, k_s = _kl_qk(q_t, k_t, q_s, k_s)
    T, H = q_t.shape[0], q_t.shape[1]
    dkl = np.ascontiguousarray(dkl, dtype=np.float32)
    saved = stats
    stats = np.ascontiguousarray(stats, dtype=np.float32)
    if dkl.shape != (T, H) or stats.shape != (T, H, _lib.KL_STATS):
        raise _invalid("dkl must be float32 %s and stats %s, got %s and %s"
                       % ((T, H), (T, H, _lib.KL_STATS), dkl.shape, stats.shape))
    spec = _layout_spec(layout, T)
    kd, keep = _kept_arg(kept, T)
    opt = _lib.kl_options(direction, scale_teacher, scale_student, temperature, scale_by_tau2)
    _check_settings(saved, _kl_settings(spec, kd, keep, opt), "stats")
    dq_s, dk_s = np.empty(q_s.shape, q_s.dtype), np.empty(k_s.shape, k_s.dtype)
    outs = [dq_s, dk_s]
    if teacher_grad:
        outs += [np.empty(q_t.shape, q_t.dtype), np.empty(k_t.shape, k_t.dtype)]
    ds = [_desc(a) for a in (q_t, k_t, q_s, k_s)]
    od = [_desc(a)[1] for a in outs]
    if not teacher_grad:
        od += [None, None]
    _lib.kl_bwd(_ctx(context), spec, *[d for _, d in ds], kd, opt, stats.ctypes.data, dkl.ctypes.data, *od,
                _lib.MEMORY_HOST)
    return tuple(outs)


def kv_select(q, k, policy="h2o", budget=None, *, sinks=None, window=None, pool_kernel=None, scale=None,
              query_start=None, context=None):
    """Kept keys of one causal sequence (q [L, Hq, d], k [L, Hkv, d]) under a compression policy
    (``"streaming_llm"``, ``"h2o"``, ``"snapkv"``; see forkattn.kv_select). Returns a kept-set
    dict: ``heads`` (Hkv), ``compressed_rows`` (L), ``query_start`` (L unless given),
    ``offsets`` [Hkv+1] and ``index`` int64, ``block_mask`` None."""
    if budget is None:
        raise TypeError("forkattn.kv_select: budget is required")
    q, k = _arr(q, "q"), _arr(k, "k")
    pol = _lib.kv_policy(policy, budget, sinks, window, pool_kernel, scale)
    (q, qd), (k, kd) = _desc(q), _desc(k)
    offs, idx, n = _lib.kv_select(_ctx(context), pol, qd, kd, _lib.MEMORY_HOST)
    L = q.shape[0]
    return {"heads": k.shape[1], "compressed_rows": L, "query_start": L if query_start is None else int(query_start),
            "offsets": np.array(list(offs), dtype=np.int64),
            "index": np.array(list(idx)[:n], dtype=np.int64), "block_mask": None}


def rows_mean(x, weights=None, context=None):
    """``sum_{i,h} w_i x[i,h] / (heads * sum_i w_i)`` of a [rows, heads] array in double
    (``forkattn_rows_mean``; weights None = all 1, a zero total weight gives 0)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError("forkattn: x must be [rows, heads], got shape %s" % (x.shape,))
    w = None
    if weights is not None:
        w = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
        if w.size != x.shape[0]:
            raise _invalid("weights has %d entries, x %d rows" % (w.size, x.shape[0]))
    return _lib.rows_mean(_ctx(context), x.ctypes.data if x.size else None, x.shape[0], x.shape[1],
                          w.ctypes.data if w is not None and w.size else None, _lib.MEMORY_HOST)
