"""Tree attention across the ranks of a torch.distributed process group.

:class:`DistributedTree` splits a tree (a :class:`forkattn.TreeLayout`, or the groups of a
:class:`forkattn.SharedPrefixLayout`) into one part per rank with the tree cost model
(:func:`forkattn.tree_partition`): a part is the root-to-leaf paths of some leaves, so shared
ancestors are duplicated into every part that needs them, and each row is *owned* by exactly one
part. Every rank computes the same deterministic partition locally; one all_gather of two
checksums makes sure the ranks passed the same tree and cost model.

Each rank holds only its part's rows (``dt.rows``: the original packed row of every part row; a
rank with the full packed tensors takes them with ``dt.gather(x)``). :meth:`DistributedTree.attention`
is exact on every part row in the forward (a part holds every ancestor of its rows) and needs
no communication there. Its backward counts a row's output gradient on the row's owner only,
and sums the dq/dk/dv of the rows several parts hold across the ranks (one all_reduce), so the
owner of a row ends with the row's single-process gradient. Same code for gloo (CPU tensors) and
NCCL (CUDA tensors): the collectives run on the tensors' device.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from . import _lib
from .layouts import SharedPrefixLayout, TreeLayout
from .ops import _check_qkv, _follows_context, _needs_grad, _records_context, _scale_of, _tree_bwd_impl, _tree_fwd_impl
from .tree_exec import TreeCostModel, tree_partition

__all__ = ["DistributedTree", "partition_for_ranks", "prefix_tree", "DEFAULT_MODEL"]

# Balances the visible (query, key) row pairs, the term that dominates tree attention; a
# partition depends only on the ratios of the coefficients, so heads and head_dim are 1.
DEFAULT_MODEL = TreeCostModel(heads_q=1, head_dim=1, sec_per_mac=1.0)


def prefix_tree(layout):
    """The :class:`TreeLayout` of a :class:`SharedPrefixLayout`'s packed rows: per group a root
    node (the prompt) with one child per response. Tree attention over it equals
    ``prefix_attention(..., causal=True)``."""
    offsets, parents = _lib._forest(layout.prompt_lens.tolist(), layout.group_sizes.tolist(),
                                    layout.response_lens.tolist())
    return TreeLayout(offsets, parents)


def _digest(*tensors_and_text):
    """A signed 64-bit checksum of int64 tensors and strings."""
    h = hashlib.blake2b(digest_size=8)
    for x in tensors_and_text:
        h.update(x.encode() if isinstance(x, str) else x.contiguous().numpy().tobytes())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little", signed=True)


def _collective_device(group):
    # NCCL reduces CUDA tensors only; gloo (and a "cpu:gloo,cuda:nccl" group) takes CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DistributedTree:
    """One rank's part of a tree partitioned across a torch.distributed process group.

    ``DistributedTree(layout, group=None, model=None)``: ``layout`` a :class:`TreeLayout` or a
    :class:`SharedPrefixLayout` (converted with :func:`prefix_tree`); ``group`` the process group
    (default: the world); ``model`` a :class:`forkattn.TreeCostModel` (default
    :data:`DEFAULT_MODEL`, balancing visible row pairs; pass a calibrated one for measured
    balance, the same on every rank). Collective: every rank of the group must construct it
    with the same layout and model, else every rank raises ValueError.

    Attributes: ``rank``, ``world_size``, ``tree`` (the whole TreeLayout), ``partition`` (the
    :class:`forkattn.TreePartition`, part i for rank i), ``layout`` (this rank's part,
    a TreeLayout over its own rows), ``rows`` (int64 [R]: the packed row of every part row),
    ``owned`` (bool [R]: rows this rank owns), ``num_rows`` (rows of the whole tree),
    ``num_shared_rows`` (rows held by several ranks, the ones the backward reduces).
    """

    def __init__(self, layout, group=None, model=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("forkattn.distributed: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        if isinstance(layout, SharedPrefixLayout):
            layout = prefix_tree(layout)
        if not isinstance(layout, TreeLayout):
            raise TypeError("forkattn.distributed: layout must be a TreeLayout or a SharedPrefixLayout, got %s"
                            % type(layout).__name__)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.model = DEFAULT_MODEL if model is None else model
        self.tree = layout
        self.num_rows = layout.num_rows
        try:
            self.partition, failed = tree_partition(layout, self.world_size, self.model), None
        except Exception as e:  # still join the check below, so the other ranks raise too
            self.partition, failed = None, e
        self._check_ranks_agree(failed)
        part = self.partition[self.rank]
        self.layout, self.rows, self.owned, self.cost = part.layout, part.rows, part.owned, part.cost
        # Rows held by several parts, in increasing order: the rows of the backward's all_reduce.
        holders = torch.zeros(self.num_rows, dtype=torch.int64)
        for p in self.partition:
            holders.index_add_(0, p.rows, torch.ones_like(p.rows))
        shared = (holders > 1).nonzero().flatten()
        mine = holders[self.rows] > 1
        self.num_shared_rows = shared.numel()
        self._shared_local = mine.nonzero().flatten()  # part rows that are shared
        self._shared_slot = torch.searchsorted(shared, self.rows[mine])  # their row in the buffer
        self._on_device = {}

    def _check_ranks_agree(self, failed):
        """One all_gather of (failed, layout and model checksum, partition checksum) per rank;
        raises on every rank when a rank failed to partition or the ranks disagree."""
        m = self.model.as_dict() if isinstance(self.model, TreeCostModel) else self.model
        m = sorted(m.items()) if isinstance(m, dict) else m  # the same fields in any order
        sums = torch.tensor([int(failed is not None),
                             _digest(self.tree.node_offsets, self.tree.parents, repr(m)),
                             0 if failed else _digest(self.partition.row_owner)], dtype=torch.int64,
                            device=_collective_device(self.group))
        got = [torch.empty_like(sums) for _ in range(self.world_size)]
        dist.all_gather(got, sums, group=self.group)
        got = torch.stack(got).cpu()
        if failed is not None:
            raise failed
        if bool(got[:, 0].any()):
            raise ValueError("forkattn.distributed: ranks %s could not partition the tree (they raised the error)"
                             % got[:, 0].nonzero().flatten().tolist())
        for col, what in ((1, "passed different layouts (node_offsets, parents) or cost models"),
                          (2, "computed different partitions of the same tree (different library builds?)")):
            if not bool((got[:, col] == got[0, col]).all()):
                same = (got[:, col] == got[self.rank, col]).nonzero().flatten().tolist()
                raise ValueError("forkattn.distributed: the ranks %s: ranks %s agree with rank %d, the others "
                                 "do not; every rank must partition the same tree" % (what, same, self.rank))

    def _indices(self, device):
        """(rows, owned, shared part rows, their buffer rows) on ``device``, cached."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = tuple(t.to(device) for t in (self.rows, self.owned, self._shared_local,
                                                                 self._shared_slot))
        return self._on_device[key]

    def gather(self, x):
        """This rank's part rows ``x[self.rows]`` of a full packed tensor ``[num_rows, ...]``
        (differentiable: gradients scatter back to the full tensor)."""
        if x.shape[0] != self.num_rows:
            raise ValueError("forkattn.distributed: gather takes the %d packed rows of the whole tree, got %d"
                             % (self.num_rows, x.shape[0]))
        return x.index_select(0, self._indices(x.device)[0])

    def attention(self, q, k, v, *, softmax_scale=None, return_lse=False, grads="owned"):
        """Tree attention over this rank's part: q ``[R, Hq, d]``, k/v ``[R, Hkv, d]``, the part's
        rows (R = ``len(self.rows)``; ``self.gather(full)`` from full packed tensors). Returns
        out ``[R, Hq, d]`` (and lse ``[R, Hq]`` float32 with ``return_lse``), equal to
        :func:`forkattn.tree_attention` over the whole tree on every part row.

        Backward (collective: every rank of the group must run it): the output gradient of a
        row counts on its owner only (losses on duplicated rows are not counted twice), and the
        dq/dk/dv of rows several ranks hold are summed across them. ``grads="owned"``: owned rows
        get their single-process gradients, the other rows zero, so summing gradients across
        ranks (parameters, as DDP does, or a replicated input's) gives the single-process ones.
        ``grads="all"``: every part row gets its single-process gradient (as
        ``forkattn_partition_allreduce`` leaves them)."""
        if grads not in ("owned", "all"):
            raise ValueError("forkattn.distributed: grads must be 'owned' or 'all', got %r" % (grads,))
        _check_qkv(q, k, v)
        R = self.rows.numel()
        if q.shape[0] != R:
            raise ValueError("forkattn.distributed: q has %d rows, rank %d's part has %d (pass the part's rows, "
                             "e.g. DistributedTree.gather(full_q))" % (q.shape[0], self.rank, R))
        scale = _scale_of(q, softmax_scale)
        if _needs_grad(q, k, v):
            out, lse = _PartAttention.apply(q, k, v, self, scale, grads == "all")
        else:
            out, lse = _tree_fwd_impl(q, k, v, self.layout.node_offsets, self.layout.parents, scale)
        return (out, lse) if return_lse else out

    def _sum_shared(self, tensors):
        """Sum the shared rows of ``tensors`` ([R, heads, d] each) across the ranks, in float32,
        in place."""
        if self.num_shared_rows == 0:  # the same on every rank: all skip together
            return
        dev = tensors[0].device
        _, _, local, slot = self._indices(dev)
        widths = [t.shape[1:].numel() for t in tensors]
        buf = torch.zeros(self.num_shared_rows, sum(widths), dtype=torch.float32, device=dev)
        if local.numel():
            buf[slot] = torch.cat([t[local].reshape(local.numel(), -1).float() for t in tensors], 1)
        dist.all_reduce(buf, group=self.group)
        col = 0
        for t, w in zip(tensors, widths):
            t[local] = buf[slot, col:col + w].reshape(-1, *t.shape[1:]).to(t.dtype)
            col += w

    def assemble(self, x):
        """The whole tree's ``[num_rows, ...]`` tensor on every rank from each rank's part values
        ``x`` ``[R, ...]`` (outputs, lse): each row from its owner, by one all_reduce of a
        zero-filled full tensor. Not differentiable (for metrics, sampling, checks)."""
        if x.shape[0] != self.rows.numel():
            raise ValueError("forkattn.distributed: assemble takes this rank's %d part rows, got %d"
                             % (self.rows.numel(), x.shape[0]))
        rows, owned, _, _ = self._indices(x.device)
        full = x.new_zeros((self.num_rows,) + tuple(x.shape[1:]))
        with torch.no_grad():
            full[rows[owned]] = x[owned]
            dist.all_reduce(full, group=self.group)
        return full

    def __repr__(self):
        return "DistributedTree(rank %d of %d: %d of %d rows, %d owned, %d shared across ranks, imbalance %.3f)" % (
            self.rank, self.world_size, self.rows.numel(), self.num_rows, int(self.owned.sum()),
            self.num_shared_rows, self.partition.imbalance)


def partition_for_ranks(layout, group=None, model=None):
    """This rank's part of ``layout`` partitioned across ``group``: a :class:`DistributedTree`."""
    return DistributedTree(layout, group, model)


class _PartAttention(torch.autograd.Function):
    """apply(q, k, v, dt, scale, all_rows) -> (out, lse) over ``dt.layout``; backward reduces."""

    @staticmethod
    @_records_context
    def forward(ctx, q, k, v, dt, scale, all_rows):
        out, lse = _tree_fwd_impl(q, k, v, dt.layout.node_offsets, dt.layout.parents, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.dt, ctx.scale, ctx.all_rows = dt, scale, all_rows
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @_follows_context
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dt = ctx.dt
        owned = dt._indices(dout.device)[1][:, None, None]
        dout = (dout * owned).contiguous()  # a row's loss counts once, on its owner
        dq, dk, dv = _tree_bwd_impl(dout, q, k, v, out, lse, dt.layout.node_offsets, dt.layout.parents, ctx.scale)
        if ctx.all_rows:
            dt._sum_shared([dq, dk, dv])
        else:
            # dq of a row needs only its own dout and its ancestors' keys: the owner has it whole
            # (and it is zero elsewhere); dk/dv collect every descendant's share.
            dt._sum_shared([dk, dv])
            dk.mul_(owned)
            dv.mul_(owned)
        return dq, dk, dv, None, None, None
