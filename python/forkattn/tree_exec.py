"""Executing trees: the DFS path stack, the tree cost model, partitions and batch plans.

* :class:`PathStack` (``forkattn_path_*``): depth-first execution of a tree for frameworks
  that run a whole model segment by segment. Only the KV of the active root-to-node path is
  resident: push a node's k/v, attend its queries, visit its children, pop. The backward walk
  is the same walk; ``pop`` then hands back the node's complete dk/dv. Host memory: numpy
  arrays or CPU torch tensors ``[rows, heads, head_dim]``. Nothing tracks gradients.
* :class:`TreeCostModel` (``forkattn_tree_cost_model``, ``_calibrate``, ``forkattn_tree_cost``),
  :func:`tree_partition` (``forkattn_tree_partition``: a tree split across ranks with balanced
  cost) and :func:`tree_plan_batches` (``forkattn_tree_plan_batches``: the trees of a forest
  grouped into launches, each run as a tree or replicated). Their results are plain
  Python/torch/numpy data copied out of the C objects, which are freed before the call returns.

Layouts given to these functions: a :class:`forkattn.TreeLayout`, a dict or object with
``node_offsets`` and ``parents`` (e.g. :func:`forkattn.numpy_api.trie_from_sequences`' result)
or a ``(node_offsets, parents)`` pair of int sequences / arrays / tensors. Layouts in the results
are :class:`forkattn.TreeLayout` s with torch int64 index tensors when the input layout was a
TreeLayout or held torch tensors, else ``{"node_offsets", "parents"}`` dicts of numpy int64
arrays (what :mod:`forkattn.numpy_api` takes).

Works without PyTorch (numpy arrays); imports neither torch nor numpy by itself.
"""

from __future__ import annotations

import sys
from collections import namedtuple
from dataclasses import asdict, dataclass

from . import _lib

__all__ = [
    "PathStack",
    "dfs_walk",
    "TreeCostModel",
    "tree_cost",
    "tree_partition",
    "TreePartition",
    "TreePart",
    "tree_plan_batches",
    "BatchPlan",
    "TreeBatch",
]

_CODE_NAMES = _lib.DTYPE_NAMES
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _invalid(msg):
    return _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, msg)


def _torch():
    return sys.modules.get("torch")


def _is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _int_arg(x, name):
    """A Python int in int64 range (bools and non-integral values refused)."""
    if isinstance(x, bool):
        raise TypeError("forkattn: %s must be an int, got bool" % name)
    try:
        i = int(x)
    except (TypeError, ValueError):
        raise TypeError("forkattn: %s must be an int, got %s" % (name, type(x).__name__)) from None
    if i != x:
        raise TypeError("forkattn: %s must be an int, got %r" % (name, x))
    if not _INT64_MIN <= i <= _INT64_MAX:
        raise _invalid("%s = %d does not fit in int64" % (name, i))
    return i


def _dtype_code(dtype):
    """:func:`forkattn._lib.dtype_code`, or a C dtype code itself."""
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in _CODE_NAMES:
        return int(dtype)
    return _lib.dtype_code(dtype)


# --------------------------------------------------------------------------------------------
# [rows, heads, head_dim] host arrays (numpy or CPU torch)


def _host3(x, name):
    """(array kept alive, forkattn_tensor, dtype code) of a 3-D numpy array or CPU torch tensor."""
    if _is_torch(x):
        from .ops import _DTYPES, _desc

        if x.dim() != 3:
            raise _invalid("%s must be [rows, heads, head_dim], got shape %s" % (name, tuple(x.shape)))
        if x.device.type != "cpu":
            raise _invalid("%s is on %s: the path stack takes host memory (move it to the CPU)" % (name, x.device))
        if x.dtype not in _DTYPES:
            raise _invalid("%s: dtype %s is not supported (float32, bfloat16, float16)" % (name, x.dtype))
        kept, t = _desc(x.detach())
        return kept, t, _DTYPES[x.dtype]
    if _is_numpy(x):
        from .numpy_api import _desc, _dtype_code as _np_code

        if x.ndim != 3:
            raise _invalid("%s must be [rows, heads, head_dim], got shape %s" % (name, x.shape))
        code = _np_code(x)
        kept, t = _desc(x)
        return kept, t, code
    raise TypeError("forkattn: %s must be a numpy array or a CPU torch tensor, got %s" % (name, type(x).__name__))


def _empty_like(x, shape):
    if _is_torch(x):
        return _torch().empty(shape, dtype=x.dtype)
    import numpy as np

    return np.empty(shape, dtype=x.dtype)


def _lse_new(x, n, hq):
    if _is_torch(x):
        t = _torch()
        return t.empty((n, hq), dtype=t.float32)
    import numpy as np

    return np.empty((n, hq), dtype=np.float32)


def _ptr(a):
    return (a.data_ptr() if _is_torch(a) else a.ctypes.data) or None


def _lse_in(lse, n, hq):
    """(float32 contiguous host copy/view, pointer) of a forward's lse [n, hq]."""
    if _is_torch(lse):
        t = _torch()
        if lse.device.type != "cpu":
            raise _invalid("lse is on %s: the path stack takes host memory" % lse.device)
        a = lse.detach().to(dtype=t.float32).contiguous()
        shape = tuple(a.shape)
    elif _is_numpy(lse):
        import numpy as np

        a = np.ascontiguousarray(lse, dtype=np.float32)
        shape = a.shape
    else:
        raise TypeError("forkattn: lse must be a numpy array or a CPU torch tensor, got %s" % type(lse).__name__)
    if shape != (n, hq):
        raise _invalid("lse must be float32 [%d, %d] (the forward's), got shape %s" % (n, hq, shape))
    return a, _ptr(a)


# --------------------------------------------------------------------------------------------
# DFS path stack


class PathStack(_lib._ContextBound):
    """The DFS path stack (``forkattn_path``): the K/V of the active root-to-node path of a tree,
    with float32 dk/dv accumulators, in host memory.

    ``PathStack(heads_q, heads_kv, head_dim, dtype="float32", context=None)``: every tensor given
    to it is ``[rows, heads, head_dim]`` of that dtype (``"float32"``, ``"bfloat16"``,
    ``"float16"``, a torch or numpy dtype), a numpy array or a CPU torch tensor; results come
    back as the same kind of array. Forward walk, for every node in depth-first order (parents
    before children): pop the finished nodes, ``push(k, v)``, ``o, lse = attend(q)``. Backward,
    the same walk: ``push(k, v)``, ``dq = attend_backward(q, o, dout, lse)``, and each
    ``pop()`` returns the popped node's complete ``(dk, dv)`` (its own rows' share plus every
    descendant's). :func:`dfs_walk` gives the walk of a tree. Outputs equal
    :func:`forkattn.tree_attention` over the whole tree; peak memory follows the deepest path
    (:attr:`peak_bytes`).

    Bound to ``context`` (default: the calling thread's current context), which must not be used
    by two threads at once. ``close()`` (or ``with PathStack(...) as path:``) frees it.
    """

    def __init__(self, heads_q, heads_kv, head_dim, dtype="float32", *, context=None):
        self._handle = None
        self._nodes = []  # per node on the stack: (rows, array pushed as k) for pop's outputs
        ctx = context if context is not None else _lib.current_context()
        if not isinstance(ctx, _lib.Context):
            raise TypeError("forkattn: context must be a forkattn.Context, got %s" % type(ctx).__name__)
        self.heads_q = _int_arg(heads_q, "heads_q")
        self.heads_kv = _int_arg(heads_kv, "heads_kv")
        self.head_dim = _int_arg(head_dim, "head_dim")
        self._code = _dtype_code(dtype)
        self.dtype = _CODE_NAMES[self._code]
        self._ctx = ctx
        self._handle = _lib.path_create(ctx, self._code, self.heads_q, self.heads_kv, self.head_dim)

    # -- state
    @property
    def depth(self):
        """Nodes on the stack."""
        return _lib.path_depth(self.handle)

    @property
    def rows(self):
        """Rows on the stack (the active path's length)."""
        return _lib.path_rows(self.handle)

    @property
    def top_rows(self):
        """Rows of the top node (0 when the stack is empty)."""
        return self._nodes[-1][0] if self._nodes else 0

    @property
    def peak_bytes(self):
        """Largest number of bytes the stack's own buffers have held since creation."""
        return _lib.path_peak_bytes(self.handle)

    def _check_dtype(self, name, code):
        if code != self._code:
            raise _invalid("%s: dtype %s differs from the PathStack's %s" % (name, _CODE_NAMES[code], self.dtype))

    def _scale(self, scale):
        return _lib.softmax_scale(self.head_dim, scale)

    # -- operations
    def push(self, k, v):
        """Push a node: copy its keys and values ``[n, heads_kv, head_dim]`` (n >= 1) on top."""
        h = self.handle
        (k, kd, kc), (v, vd, vc) = _host3(k, "k"), _host3(v, "v")
        self._check_dtype("k", kc)
        self._check_dtype("v", vc)
        _lib.path_push(self._ctx, h, kd, vd)
        self._nodes.append((int(kd.rows), k))

    def attend(self, q, scale=None):
        """Attention of the top node's queries ``[n, heads_q, head_dim]`` (n = its rows): every
        row sees all rows below on the stack and its own node's rows causally. Returns
        ``(o [n, heads_q, head_dim], lse [n, heads_q] float32)``; ``scale`` defaults to
        1/sqrt(head_dim)."""
        h = self.handle
        q, qd, qc = _host3(q, "q")
        self._check_dtype("q", qc)
        n = int(qd.rows)
        o = _empty_like(q, tuple(q.shape))
        lse = _lse_new(q, n, int(qd.heads))
        _, od, _ = _host3(o, "o")
        _lib.path_attend_fwd(self._ctx, h, qd, od, _ptr(lse), self._scale(scale))
        return o, lse

    def attend_backward(self, q, o, dout, lse, scale=None):
        """Backward of :meth:`attend` for the top node (same KV on the stack as in the forward):
        returns dq and adds the node's dk/dv contributions to every node on the stack."""
        h = self.handle
        q, qd, qc = _host3(q, "q")
        self._check_dtype("q", qc)
        (o, od, oc), (dout, dd, dc) = _host3(o, "o"), _host3(dout, "dout")
        self._check_dtype("o", oc)
        self._check_dtype("dout", dc)
        n = int(qd.rows)
        lse_c, lp = _lse_in(lse, n, int(qd.heads))
        dq = _empty_like(q, tuple(q.shape))
        _, dqd, _ = _host3(dq, "dq")
        _lib.path_attend_bwd(self._ctx, h, qd, od, dd, lp, dqd, self._scale(scale))
        del lse_c
        return dq

    def pop(self, want_grads=True):
        """Pop the top node. ``want_grads=True``: return its accumulated ``(dk, dv)``
        ``[n, heads_kv, head_dim]`` (the kind and dtype of the k pushed for it); else None."""
        h = self.handle
        if not self._nodes:
            _lib.path_pop(self._ctx, h, None, None)  # the library's error: empty stack
            raise _invalid("path: pop on an empty stack")
        n, like = self._nodes[-1]
        if want_grads:
            shape = (n, self.heads_kv, self.head_dim)
            dk, dv = _empty_like(like, shape), _empty_like(like, shape)
            _lib.path_pop(self._ctx, h, _host3(dk, "dk")[1], _host3(dv, "dv")[1])
            out = (dk, dv)
        else:
            _lib.path_pop(self._ctx, h, None, None)
            out = None
        self._nodes.pop()
        return out

    # -- lifetime
    def close(self):
        if self._handle is not None:
            _lib.path_destroy(self._handle)
        self._handle = None
        self._nodes = []

    def __repr__(self):
        if self._handle is None:
            return "<forkattn.PathStack closed>"
        return "<forkattn.PathStack %s heads_q=%d heads_kv=%d head_dim=%d depth=%d rows=%d>" % (
            self.dtype, self.heads_q, self.heads_kv, self.head_dim, self.depth, self.rows)


def dfs_walk(parents):
    """The depth-first walk of a packed forest (``parents[i]`` is -1 or a node before ``i``):
    a list of ``("push", node)`` and ``("pop", node)`` events, roots and children in index
    order, every node pushed once after its parent and popped after all of its descendants.
    Drive a :class:`PathStack` with it (forward: push, attend; backward: push,
    attend_backward; pop hands back the node's dk/dv)."""
    if _is_torch(parents):
        par = [int(p) for p in parents.detach().reshape(-1).cpu().tolist()]
    else:
        par = [int(p) for p in (parents.reshape(-1).tolist() if _is_numpy(parents) else parents)]
    n = len(par)
    children = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(par):
        if p == -1:
            roots.append(i)
        elif 0 <= p < i:
            children[p].append(i)
        else:
            raise _invalid("parents[%d] = %d: must be -1 or a node packed before it" % (i, p))
    events = []
    for r in roots:
        events.append(("push", r))
        stack = [[r, 0]]
        while stack:
            top = stack[-1]
            ch = children[top[0]]
            if top[1] < len(ch):
                c = ch[top[1]]
                top[1] += 1
                events.append(("push", c))
                stack.append([c, 0])
            else:
                stack.pop()
                events.append(("pop", top[0]))
    return events


# --------------------------------------------------------------------------------------------
# layouts in and out


def _i64_host(x, name):
    """(kept alive, (pointer, n)) of a 1-D int64 host copy/view of a sequence, array or tensor."""
    if _is_torch(x):
        t = _torch()
        if x.is_floating_point() or x.is_complex() or x.dtype == t.bool:
            raise TypeError("forkattn: %s must hold integers, got %s" % (name, x.dtype))
        from .layouts import _as_i64

        a = _as_i64(x.detach().reshape(-1).to(device="cpu"), name).contiguous()
        return a, (a.data_ptr(), a.numel())
    import numpy as np

    from .numpy_api import _i64_np

    # A sequence stays Python ints (numpy would turn a large one into a float) for _i64_np's check.
    a = x if isinstance(x, np.ndarray) else np.asarray(x, dtype=object)
    if a.dtype == object:
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in a.reshape(-1)):
            raise TypeError("forkattn: %s must hold integers, got %s" % (name, a.dtype))
    elif a.size and a.dtype.kind not in "iu":
        raise TypeError("forkattn: %s must hold integers, got %s" % (name, a.dtype))
    a = _i64_np(a, name)
    return a, (a.ctypes.data, a.size)


def _layout_in(layout):
    """(node_offsets arg, parents arg, kept alive, "torch" or "numpy") for _lib."""
    if isinstance(layout, tuple) and len(layout) == 2:
        offs, par = layout
    elif isinstance(layout, dict):
        if "node_offsets" not in layout or "parents" not in layout:
            raise TypeError("forkattn: a layout dict needs node_offsets and parents")
        offs, par = layout["node_offsets"], layout["parents"]
    elif hasattr(layout, "node_offsets") and hasattr(layout, "parents"):
        offs, par = layout.node_offsets, layout.parents
    else:
        raise TypeError("forkattn: layout must be a TreeLayout, a dict/object with node_offsets and parents, "
                        "or a (node_offsets, parents) pair; got %s" % type(layout).__name__)
    kind = "torch" if (_is_torch(offs) or _is_torch(par)) else "numpy"
    ka, oa = _i64_host(offs, "node_offsets")
    kb, pa = _i64_host(par, "parents")
    if oa[1] != pa[1] + 1:
        raise _invalid("node_offsets has %d entries, parents %d (need n+1 and n)" % (oa[1], pa[1]))
    return oa, pa, (ka, kb), kind


def _i64_out(buf, kind):
    """A ctypes int64 array as a torch int64 tensor or a numpy int64 array (a copy)."""
    if kind == "torch":
        t = _torch()
        return t.frombuffer(bytearray(buf), dtype=t.int64) if len(buf) else t.zeros(0, dtype=t.int64)
    import numpy as np

    return np.frombuffer(buf, dtype=np.int64).copy() if len(buf) else np.zeros(0, np.int64)


def _bool_out(raw, kind):
    if kind == "torch":
        t = _torch()
        return t.frombuffer(bytearray(raw), dtype=t.uint8).bool() if raw else t.zeros(0, dtype=t.bool)
    import numpy as np

    return np.frombuffer(raw, dtype=np.uint8).astype(bool) if raw else np.zeros(0, bool)


def _layout_out(offs, par, kind):
    if kind == "torch":
        from .layouts import TreeLayout

        return TreeLayout(_i64_out(offs, kind), _i64_out(par, kind))
    return {"node_offsets": _i64_out(offs, kind), "parents": _i64_out(par, kind)}


# --------------------------------------------------------------------------------------------
# cost model


@dataclass
class TreeCostModel:
    """Linear cost model of one forward + backward of tree attention (``forkattn_tree_cost_model``):
    ``seconds = sec_per_mac * heads_q * head_dim * M + sec_per_row * heads_q * T
    + sec_per_pair * pairs`` (M: visible (query, key) row pairs; T: packed rows; pairs: the
    (node, key segment) pairs of the tree's segment plan; docs/tree.md).

    Build one with known coefficients, or measure them with :meth:`calibrate`. Plain data
    (picklable: calibrate on one rank and broadcast it)."""

    heads_q: int
    head_dim: int
    sec_per_mac: float = 0.0
    sec_per_row: float = 0.0
    sec_per_pair: float = 0.0

    @classmethod
    def calibrate(cls, heads_q, heads_kv, head_dim, dtype="float32", *, context=None):
        """Time forward + backward tree attention on a few shapes on ``context``'s backend
        (default: the current one) and fit the coefficients (non-negative least squares on
        relative errors). About a second; depends on the machine's load."""
        ctx = context if context is not None else _lib.current_context()
        vals = _lib.tree_cost_model_calibrate(ctx, _int_arg(heads_q, "heads_q"), _int_arg(heads_kv, "heads_kv"),
                                              _int_arg(head_dim, "head_dim"), _dtype_code(dtype))
        return cls(*vals)

    def _struct(self):
        return _lib.cost_model_struct(_int_arg(self.heads_q, "heads_q"), _int_arg(self.head_dim, "head_dim"),
                                      self.sec_per_mac, self.sec_per_row, self.sec_per_pair)

    def cost(self, layout, *, context=None):
        """Predicted seconds of forward + backward tree attention over ``layout``."""
        return tree_cost(layout, self, context=context)

    def as_dict(self):
        return asdict(self)


def _model(model):
    if isinstance(model, TreeCostModel):
        return model._struct()
    if isinstance(model, dict):
        return TreeCostModel(**model)._struct()
    raise TypeError("forkattn: model must be a TreeCostModel (or a dict of its fields), got %s"
                    % type(model).__name__)


def tree_cost(layout, model, *, context=None):
    """Predicted seconds of forward + backward tree attention over ``layout`` under ``model``
    (``forkattn_tree_cost``; O(nodes))."""
    m = _model(model)
    oa, pa, keep, _ = _layout_in(layout)
    ctx = context if context is not None else _lib.current_context()
    out = _lib.tree_cost(ctx, oa, pa, m)
    del keep
    return out


# --------------------------------------------------------------------------------------------
# partition


TreePart = namedtuple("TreePart", ["layout", "rows", "owned", "cost"])
TreePart.__doc__ = """One part of a :class:`TreePartition`: ``layout`` (the part's sub-forest in its own
packed rows), ``rows`` (int64 [R]: the original row of every part row), ``owned`` (bool [R]:
rows this part owns; the others are ancestors duplicated from another part), ``cost`` (the
model's predicted seconds, duplicated rows included)."""


def _scatter(values, parts, total, owned_only):
    """[total, ...] from per-part [R_i, ...] values: owned rows copied (owned_only) or all rows
    summed."""
    vals = list(values)
    if len(vals) != len(parts):
        raise _invalid("%d arrays given for %d parts" % (len(vals), len(parts)))
    first = next((v for v in vals if v is not None), None)
    if first is None:
        raise _invalid("no values given")
    for i, (v, p) in enumerate(zip(vals, parts)):
        if v.shape[0] != len(p.rows):
            raise _invalid("part %d: values have %d rows, the part %d" % (i, v.shape[0], len(p.rows)))
    tail = tuple(first.shape[1:])
    if _is_torch(first):
        out = first.new_zeros((total,) + tail)
        for v, p in zip(vals, parts):
            rows = p.rows.to(v.device)
            if owned_only:
                m = p.owned.to(v.device)
                out[rows[m]] = v[m].to(out.dtype)
            else:
                out.index_add_(0, rows, v.to(out.dtype))
        return out
    import numpy as np

    out = np.zeros((total,) + tail, dtype=first.dtype)
    for v, p in zip(vals, parts):
        if owned_only:
            out[p.rows[p.owned]] = v[p.owned]
        else:
            np.add.at(out, p.rows, v)
    return out


class TreePartition:
    """A tree split into parts (``forkattn_tree_partition``), as plain data.

    ``parts``: a list of :class:`TreePart` ``(layout, rows, owned, cost)``; ``imbalance``: the
    largest part cost over the mean (empty parts included; 1 = balanced); ``num_rows``: rows
    of the partitioned tree; ``row_owner``: int64 [num_rows], the part owning each row (every
    row is owned by exactly one part).

    A rank runs attention on its part's rows (``x[part.rows]``, the part's ``layout``) with
    ``dout = 0`` on rows it does not own; outputs on owned rows equal the whole tree's
    (``scatter(outs)`` assembles them), and the parts' dq/dk/dv summed to the original rows
    (``scatter(grads, owned_only=False)``, an all-reduce across ranks) equal the single-process
    gradients."""

    def __init__(self, parts, imbalance, kind):
        self.parts = parts
        self.imbalance = float(imbalance)
        self.kind = kind
        self.num_rows = sum(int(p.owned.sum()) for p in parts)
        if kind == "torch":
            t = _torch()
            owner = t.full((self.num_rows,), -1, dtype=t.int64)
            for i, p in enumerate(parts):
                owner[p.rows[p.owned]] = i
        else:
            import numpy as np

            owner = np.full(self.num_rows, -1, dtype=np.int64)
            for i, p in enumerate(parts):
                owner[p.rows[p.owned]] = i
        self.row_owner = owner

    @property
    def num_parts(self):
        return len(self.parts)

    @property
    def costs(self):
        return [p.cost for p in self.parts]

    def scatter(self, values, owned_only=True):
        """Per-part values ``[R_i, ...]`` (numpy arrays or torch tensors, one per part, in part
        order) back to the tree's rows ``[num_rows, ...]``: each row from the part that owns it
        (``owned_only=True``: outputs, lse), or the sum over every part holding the row
        (``owned_only=False``: gradients computed with dout zeroed on unowned rows)."""
        return _scatter(values, self.parts, self.num_rows, owned_only)

    def __len__(self):
        return len(self.parts)

    def __getitem__(self, i):
        return self.parts[i]

    def __iter__(self):
        return iter(self.parts)

    def __repr__(self):
        return "TreePartition(parts=%d, rows=%d, imbalance=%.3f, costs=[%s])" % (
            len(self.parts), self.num_rows, self.imbalance, ", ".join("%.3g" % c for c in self.costs))


def tree_partition(layout, num_parts, model, *, context=None):
    """Split the leaves (root-to-leaf paths) of ``layout`` into ``num_parts`` parts with balanced
    predicted cost under ``model`` (a :class:`TreeCostModel`), duplicating shared ancestors.
    Returns a :class:`TreePartition` (parts may be empty when there are fewer leaves)."""
    m = _model(model)
    n = _int_arg(num_parts, "num_parts")
    oa, pa, keep, kind = _layout_in(layout)
    ctx = context if context is not None else _lib.current_context()
    d = _lib.tree_partition(ctx, oa, pa, n, m)
    del keep
    parts = [TreePart(_layout_out(p["node_offsets"], p["parents"], kind), _i64_out(p["rows"], kind),
                      _bool_out(p["owned"], kind), p["cost"]) for p in d["parts"]]
    return TreePartition(parts, d["imbalance"], kind)


# --------------------------------------------------------------------------------------------
# batch plan


TreeBatch = namedtuple("TreeBatch", ["layout", "rows", "mode", "reason"])
TreeBatch.__doc__ = """One launch of a :class:`BatchPlan`: ``layout`` (the batch's trees in its own
packed rows, the forest's order kept), ``rows`` (int64: the forest row of every batch row),
``mode`` (``"tree"``: tree attention over the batch; ``"replicated"``: plain causal attention
per root-to-leaf sequence, predicted faster), ``reason`` (the predicted costs of both modes and
the deduplication ratio)."""


class BatchPlan(list):
    """The batches of :func:`tree_plan_batches`: a list of :class:`TreeBatch`; every tree of the
    forest is in exactly one batch."""

    def __repr__(self):
        return "BatchPlan(%d batches: %s)" % (
            len(self), ", ".join("%s/%d rows" % (b.mode, len(b.rows)) for b in self))


def tree_plan_batches(forest, max_batch_rows, model, *, context=None):
    """Group the root trees of ``forest`` into batches of at most ``max_batch_rows`` rows (a
    larger tree gets its own), trees of similar cost together, and decide per batch between
    tree execution and replicated per-sequence attention under ``model``
    (``forkattn_tree_plan_batches``). Returns a :class:`BatchPlan`."""
    m = _model(model)
    mx = _int_arg(max_batch_rows, "max_batch_rows")
    oa, pa, keep, kind = _layout_in(forest)
    ctx = context if context is not None else _lib.current_context()
    batches = _lib.tree_plan_batches(ctx, oa, pa, mx, m)
    del keep
    return BatchPlan(TreeBatch(_layout_out(b["node_offsets"], b["parents"], kind), _i64_out(b["rows"], kind),
                               b["mode"], b["reason"]) for b in batches)
