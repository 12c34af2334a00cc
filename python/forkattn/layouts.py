"""Packed layouts of shared-prefix groups and rollout trees, as plain integer tensors.

Every layout keeps only CPU ``torch.int64`` tensors and Python ints, so it can be pickled,
passed through ``torch.utils.checkpoint`` and read by ``torch.compile``; the index tensors the
helpers need are built once, at construction, and moved to the data's device on use.
"""

from __future__ import annotations

import torch

from . import _lib

__all__ = ["SharedPrefixLayout", "TreeLayout"]

_i64 = torch.int64


def _as_i64(t, name):
    """An integer tensor as int64. uint64 values above int64's range are refused
    (ForkattnInvalidArgument) rather than wrapped to negative numbers by the cast."""
    if t.dtype == getattr(torch, "uint64", None) and t.numel() and bool(t.view(_i64).lt(0).any()):
        raise _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT, "%s: a value does not fit in int64" % name)
    return t.to(dtype=_i64)


def _ints_as_i64(x, name, catch, other_error=None):
    """A CPU int64 tensor from an integer tensor, array or sequence of ints. An int outside int64
    raises ForkattnInvalidArgument; another error of ``catch`` from the conversion is re-raised,
    or replaced by ``other_error(e)`` when given."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError("forkattn: %s must hold integers, got %s" % (name, t.dtype))
        return _as_i64(t.to(device="cpu"), name)
    try:
        return torch.as_tensor(x, dtype=_i64)
    except catch as e:
        if "verflow" in str(e):  # a Python int outside int64
            raise _lib.ForkattnInvalidArgument(_lib.ERR_INVALID_ARGUMENT,
                                               "%s: a value does not fit in int64 (%s)" % (name, e)) from None
        if other_error is None:
            raise
        raise other_error(e) from None


def _long1d(x, name):
    """A 1-D CPU int64 contiguous tensor from a tensor, array or sequence of ints."""
    t = _ints_as_i64(x, name, (TypeError, ValueError, RuntimeError),
                     lambda e: TypeError("forkattn: %s must be a 1-D sequence of ints (%s)" % (name, e)))
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise ValueError("forkattn: %s must be 1-D, got shape %s" % (name, tuple(t.shape)))
    return t.contiguous()


def _excl_cumsum(x):
    out = torch.zeros(x.numel() + 1, dtype=_i64)
    if x.numel():
        torch.cumsum(x, 0, out=out[1:])
    return out


def _seg_arange(lengths):
    """[sum(lengths)]: the index of every element inside its segment."""
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=_i64)
    starts = _excl_cumsum(lengths)[:-1]
    return torch.arange(total, dtype=_i64) - torch.repeat_interleave(starts, lengths)


def _mask2d(m, name):
    if not isinstance(m, torch.Tensor):
        m = torch.as_tensor(m)
    if m.dim() != 2:
        raise ValueError("forkattn: %s must be [batch, seq_len], got shape %s" % (name, tuple(m.shape)))
    if m.is_floating_point():
        raise TypeError("forkattn: %s must be bool (or 0/1 integers), got %s" % (name, m.dtype))
    m = m.detach().cpu()
    if m.dtype != torch.bool:
        if m.numel() and bool(((m != 0) & (m != 1)).any()):
            raise ValueError("forkattn: %s must hold only 0 and 1" % name)
        m = m != 0
    return m.contiguous()


def _row_cols(mask):
    """For a [B, L] bool mask: (counts [B], columns [sum] in row-major order)."""
    counts = mask.sum(1, dtype=_i64) if mask.numel() else torch.zeros(mask.shape[0], dtype=_i64)
    cols = mask.nonzero()[:, 1].contiguous() if mask.numel() else torch.zeros(0, dtype=_i64)
    return counts, cols


def _compiling():
    c = getattr(torch, "compiler", None)
    return c is not None and hasattr(c, "is_compiling") and c.is_compiling()


def _dev(layout, name, t, device):
    """Index tensor ``t`` (a layout's, CPU) on ``device``; cached per device outside
    torch.compile."""
    if t.device == device:
        return t
    if _compiling():
        return t.to(device)
    cache = layout.__dict__.setdefault("_device_cache", {})
    key = (name, str(device))
    c = cache.get(key)
    if c is None:
        c = cache[key] = t.to(device)
    return c


def _scatter_rows(y, batch_idx, col_idx, rows, shape):
    """out [*shape, *y.shape[1:]] zeros with out[batch_idx, col_idx] = y[rows] (differentiable)."""
    out = y.new_zeros(tuple(shape) + tuple(y.shape[1:]))
    if rows.numel() == 0:
        return out
    return out.index_put((batch_idx, col_idx), y.index_select(0, rows))


class SharedPrefixLayout:
    """Packed rows of shared-prompt groups: ``[prompt_0, responses of group 0..., prompt_1, ...]``.

    Integer tensors (CPU int64): ``prompt_lens`` [G], ``group_sizes`` [G] (responses per
    group), ``response_lens`` [N] (responses in packed order, N = sum(group_sizes)), and the
    derived ``group_offsets`` [G+1] (first packed row of each group; the last entry is
    ``num_rows``), ``response_starts`` [N] (first packed row of each response),
    ``response_group`` [N] and ``batch_index`` [N] (the batch row each packed response came
    from; see the constructors).

    A layout built by a constructor also knows its *batch view* (where every packed row comes
    from in the trainer's padded tensors), used by :meth:`pack`, :meth:`unpack` and
    :meth:`unpack_responses`.
    """

    def __init__(self, prompt_lens, response_lens, group_sizes, _batch_view=True):
        P = _long1d(prompt_lens, "prompt_lens")
        R = _long1d(response_lens, "response_lens")
        S = _long1d(group_sizes, "group_sizes")
        if P.numel() != S.numel():
            raise ValueError("forkattn: prompt_lens has %d groups, group_sizes %d" % (P.numel(), S.numel()))
        for name, t in (("prompt_lens", P), ("group_sizes", S), ("response_lens", R)):
            if t.numel() and int(t.min()) < 0:
                i = int((t < 0).nonzero()[0, 0])
                raise ValueError("forkattn: %s[%d] = %d is negative" % (name, i, int(t[i])))
        if int(S.sum()) != R.numel():
            raise ValueError("forkattn: group_sizes sum to %d responses, response_lens has %d"
                             % (int(S.sum()), R.numel()))
        self.prompt_lens, self.group_sizes, self.response_lens = P, S, R
        G, N = P.numel(), R.numel()
        self.num_groups, self.num_responses = G, N
        self.response_group = torch.repeat_interleave(torch.arange(G, dtype=_i64), S)
        first_resp = _excl_cumsum(S)  # [G+1]: index of each group's first response
        self.group_first_response = first_resp[:-1].clone()
        # group totals: P_g + sum of its responses
        resp_sum = torch.zeros(G, dtype=_i64)
        if N:
            resp_sum.index_add_(0, self.response_group, R)
        self.group_offsets = _excl_cumsum(P + resp_sum)
        self.num_rows = int(self.group_offsets[-1])
        r_excl = _excl_cumsum(R)
        within = r_excl[:-1] - r_excl[first_resp[:-1]][self.response_group]  # offset in its group
        self.response_starts = self.group_offsets[:-1][self.response_group] + P[self.response_group] + within
        self.max_response_len = int(R.max()) if N else 0
        # segments in packed order: per group [prompt, response...]
        seg_lens = torch.zeros(G + N, dtype=_i64)
        seg_base = torch.zeros(G + N, dtype=_i64)
        seg_is_prompt = torch.zeros(G + N, dtype=torch.bool)
        prompt_seg = torch.arange(G, dtype=_i64) + first_resp[:-1]
        resp_seg = self.response_group + 1 + torch.arange(N, dtype=_i64)
        seg_lens[prompt_seg] = P
        seg_is_prompt[prompt_seg] = True
        seg_lens[resp_seg] = R
        seg_base[resp_seg] = P[self.response_group]
        self._row_is_prompt = torch.repeat_interleave(seg_is_prompt, seg_lens)
        self._position_ids = _seg_arange(seg_lens) + torch.repeat_interleave(seg_base, seg_lens)
        # default batch view (from_lengths): row i = prompt of its group, then response i
        self.batch_index = torch.arange(N, dtype=_i64)
        self.batch_size = N
        self._sources = None
        self.seq_len = None
        if _batch_view and (N == 0 or bool((S > 0).all())):
            Pr = P[self.response_group]
            self._set_batch_view(
                batch_index=self.batch_index,
                prompt_cols=_seg_arange(Pr),
                response_cols=_seg_arange(R) + torch.repeat_interleave(Pr, R),
                batch_size=N,
                seq_len=int((Pr + R).max()) if N else 0,
            )

    # ---------------------------------------------------------------------------------------
    # constructors

    @classmethod
    def from_lengths(cls, prompt_lens, response_lens_per_group):
        """Groups given by lengths: ``prompt_lens`` [G] and, per group, the list of its response
        lengths. The batch view is one row per response, in packed order: its prompt in
        columns ``[0, P)``, then its response (right padding), ``seq_len = max(P + R)``."""
        P = _long1d(prompt_lens, "prompt_lens")
        groups = list(response_lens_per_group)
        if len(groups) != P.numel():
            raise ValueError("forkattn: %d prompt lengths but %d response groups" % (P.numel(), len(groups)))
        sizes, lens = [], []
        for g, rl in enumerate(groups):
            r = _long1d(rl, "response_lens_per_group[%d]" % g)
            if r.numel() == 0:
                raise ValueError("forkattn: group %d has no responses" % g)
            sizes.append(r.numel())
            lens.append(r)
        R = torch.cat(lens) if lens else torch.zeros(0, dtype=_i64)
        return cls(P, R, torch.tensor(sizes, dtype=_i64))

    @classmethod
    def from_uid(cls, uid, prompt_mask, response_mask, input_ids=None):
        """The trainer's batch view: row ``b`` of the padded batch ``[B, L]`` holds one response.

        ``uid`` [B]: rows with equal uid share a prompt (any hashable values: ints, strings as
        in verl's ``non_tensor_batch["uid"]``, a tensor). ``prompt_mask`` / ``response_mask``
        [B, L] (bool or 0/1) mark the prompt and response tokens of each row over the same
        columns (left-padded prompts then right-padded responses, as verl and OpenRLHF lay them
        out; any padding works as long as a row's prompt tokens come before its response
        tokens). Groups are ordered by first appearance of their uid, responses by batch row.
        The prompt of a group is taken from its first row; every row of the group must have
        the same prompt length, and with ``input_ids`` [B, L] the same prompt tokens
        (``ValueError`` otherwise).
        """
        pm = _mask2d(prompt_mask, "prompt_mask")
        rm = _mask2d(response_mask, "response_mask")
        if pm.shape != rm.shape:
            raise ValueError(
                "forkattn: prompt_mask %s and response_mask %s must have the same [B, L] shape "
                "(both over the columns of input_ids; e.g. verl: prompt_mask = attention_mask with "
                "the response columns zeroed, response_mask padded on the left with zeros)"
                % (tuple(pm.shape), tuple(rm.shape)))
        B, L = pm.shape
        if isinstance(uid, torch.Tensor):
            uids = uid.detach().cpu().reshape(-1).tolist()
        elif hasattr(uid, "tolist"):
            uids = list(uid.tolist())
        else:
            uids = list(uid)
        if len(uids) != B:
            raise ValueError("forkattn: uid has %d entries, the masks %d rows" % (len(uids), B))
        if B and bool((pm & rm).any()):
            b = int((pm & rm).any(1).nonzero()[0, 0])
            raise ValueError("forkattn: row %d has columns in both prompt_mask and response_mask" % b)
        pcount, pcols = _row_cols(pm)
        rcount, rcols = _row_cols(rm)
        # prompt tokens must precede response tokens within a row
        if B:
            colidx = torch.arange(L, dtype=_i64).expand(B, L)
            last_p = torch.where(pm, colidx, torch.full_like(colidx, -1)).max(1).values
            first_r = torch.where(rm, colidx, torch.full_like(colidx, L)).min(1).values
            bad = (pcount > 0) & (rcount > 0) & (last_p > first_r)
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError("forkattn: row %d has response tokens before its last prompt token "
                                 "(column %d > %d)" % (b, int(last_p[b]), int(first_r[b])))
        # groups by first appearance
        gid_of = {}
        gids = []
        for u in uids:
            try:
                gids.append(gid_of.setdefault(u, len(gid_of)))
            except TypeError:
                raise TypeError("forkattn: uid entries must be hashable, got %r" % (u,)) from None
        gid = torch.tensor(gids, dtype=_i64) if B else torch.zeros(0, dtype=_i64)
        G = len(gid_of)
        order = torch.sort(gid, stable=True).indices if B else gid  # batch rows in packed order
        sizes = torch.bincount(gid, minlength=G) if B else torch.zeros(0, dtype=_i64)
        first = _excl_cumsum(sizes)[:-1]
        rep = order[first] if G else torch.zeros(0, dtype=_i64)  # first batch row of each group
        Pg = pcount[rep] if G else torch.zeros(0, dtype=_i64)
        if B:
            bad = pcount != Pg[gid]
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError(
                    "forkattn: rows %d and %d share uid %r but their prompts have %d and %d tokens"
                    % (int(rep[gid[b]]), b, uids[b], int(Pg[gid[b]]), int(pcount[b])))
        if input_ids is not None and B:
            ids = input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
            if tuple(ids.shape[:2]) != (B, L):
                raise ValueError("forkattn: input_ids has shape %s, the masks %s" % (tuple(ids.shape), (B, L)))
            mine = ids[pm]
            theirs = ids[rep[gid]][pm[rep[gid]]]
            diff = mine != theirs
            if diff.dim() > 1:
                diff = diff.reshape(diff.shape[0], -1).any(1)
            if bool(diff.any()):
                k = int(diff.nonzero()[0, 0])
                b = int(torch.searchsorted(_excl_cumsum(pcount)[1:], torch.tensor(k), right=True))
                raise ValueError(
                    "forkattn: rows %d and %d share uid %r but their prompt tokens differ (prompt "
                    "position %d): rows with equal uid must have identical prompts"
                    % (int(rep[gid[b]]), b, uids[b], k - int(_excl_cumsum(pcount)[b])))
        layout = cls(Pg, rcount[order], sizes, _batch_view=False)
        layout._set_batch_view(
            batch_index=order,
            prompt_cols=pcols,
            response_cols=rcols,
            batch_size=B,
            seq_len=L,
            prompt_counts=pcount,
            response_counts=rcount,
        )
        return layout

    @classmethod
    def from_prefix_suffix_masks(cls, prefix_mask, suffix_mask, group_size):
        """PrefixGrouper's view: ``prefix_mask`` [G, Lp] marks each group's prompt tokens once,
        ``suffix_mask`` [N, Ls] each response's tokens, the responses of group 0 first, then
        group 1, ...; ``group_size`` is an int (same for all groups) or [G] sizes.
        :meth:`pack` then takes ``(prefix_x [G, Lp, ...], suffix_x [N, Ls, ...])`` and
        :meth:`unpack` returns both."""
        pm = _mask2d(prefix_mask, "prefix_mask")
        sm = _mask2d(suffix_mask, "suffix_mask")
        G, N = pm.shape[0], sm.shape[0]
        if isinstance(group_size, int):
            sizes = torch.full((G,), int(group_size), dtype=_i64)
        else:
            sizes = _long1d(group_size, "group_size")
            if sizes.numel() != G:
                raise ValueError("forkattn: group_size has %d entries, prefix_mask %d rows" % (sizes.numel(), G))
        if int(sizes.sum()) != N:
            raise ValueError("forkattn: the groups hold %d responses but suffix_mask has %d rows"
                             % (int(sizes.sum()), N))
        pcount, pcols = _row_cols(pm)
        scount, scols = _row_cols(sm)
        layout = cls(pcount, scount, sizes, _batch_view=False)
        T = layout.num_rows
        prow = layout._row_is_prompt.nonzero()[:, 0]
        srow = (~layout._row_is_prompt).nonzero()[:, 0]
        pb = torch.repeat_interleave(torch.arange(G, dtype=_i64), pcount)
        sb = torch.repeat_interleave(torch.arange(N, dtype=_i64), scount)
        perm = torch.empty(T, dtype=_i64)
        perm[torch.cat([prow, srow])] = torch.arange(T, dtype=_i64)
        layout._sources = [(pb, pcols, prow, (G, pm.shape[1])), (sb, scols, srow, (N, sm.shape[1]))]
        layout._pack_src = [(pb, pcols), (sb, scols)]
        layout._pack_perm = perm
        layout.batch_index = torch.arange(N, dtype=_i64)
        layout.batch_size = N
        layout.seq_len = None
        layout._set_response_view(torch.arange(N, dtype=_i64), N)
        layout._min_lens = None
        layout._min_len(0)
        return layout

    # ---------------------------------------------------------------------------------------
    # batch views

    def _set_batch_view(self, batch_index, prompt_cols, response_cols, batch_size, seq_len,
                        prompt_counts=None, response_counts=None):
        """One source [batch_size, seq_len]: packed response i is batch row batch_index[i];
        prompt_cols / response_cols list every batch row's prompt / response columns in
        row-major order (rows 0..B-1)."""
        N, B = self.num_responses, int(batch_size)
        bi = batch_index.to(_i64)
        self.batch_index = bi
        self.batch_size = B
        self.seq_len = int(seq_len)
        resp_of_row = torch.empty(B, dtype=_i64)
        resp_of_row[bi] = torch.arange(N, dtype=_i64)
        g_of_row = self.response_group[resp_of_row] if B else torch.zeros(0, dtype=_i64)
        pc = self.prompt_lens[g_of_row] if prompt_counts is None else prompt_counts
        rc = self.response_lens[resp_of_row] if response_counts is None else response_counts
        rows_b = torch.arange(B, dtype=_i64)
        # unpack entries: every prompt and response token of every row
        ub_p = torch.repeat_interleave(rows_b, pc)
        urow_p = self.group_offsets[:-1][g_of_row].repeat_interleave(pc) + _seg_arange(pc)
        ub_r = torch.repeat_interleave(rows_b, rc)
        urow_r = self.response_starts[resp_of_row].repeat_interleave(rc) + _seg_arange(rc)
        self._sources = [(torch.cat([ub_p, ub_r]), torch.cat([prompt_cols, response_cols]),
                          torch.cat([urow_p, urow_r]), (B, self.seq_len))]
        # pack entries, in packed order: prompt tokens from each group's first row
        rep = bi[self.group_first_response] if self.num_groups else torch.zeros(0, dtype=_i64)
        rep_is = torch.zeros(B, dtype=torch.bool)
        rep_is[rep] = True
        keep_p = rep_is.repeat_interleave(pc)
        pb = torch.empty(self.num_rows, dtype=_i64)
        pcol = torch.empty(self.num_rows, dtype=_i64)
        pb[urow_p[keep_p]] = ub_p[keep_p]
        pcol[urow_p[keep_p]] = prompt_cols[keep_p]
        pb[urow_r] = ub_r
        pcol[urow_r] = response_cols
        self._pack_src = [(pb, pcol)]
        self._pack_perm = None
        self._min_lens = None
        self._min_len(0)
        self._set_response_view(resp_of_row, B)

    def _set_response_view(self, resp_of_row, B):
        rl = self.response_lens[resp_of_row] if B else torch.zeros(0, dtype=_i64)
        self._resp_b = torch.repeat_interleave(torch.arange(B, dtype=_i64), rl)
        self._resp_j = _seg_arange(rl)
        rows = self.response_starts[resp_of_row].repeat_interleave(rl) + self._resp_j
        self._resp_rows = rows
        # the row whose output predicts each response token: the previous token of the sequence,
        # i.e. the last prompt row for a response's first token (none when the prompt is empty)
        g = self.response_group[resp_of_row].repeat_interleave(rl) if B else rl
        last_prompt = self.group_offsets[:-1][g] + self.prompt_lens[g] - 1 if B else rl
        pred = torch.where(self._resp_j == 0, last_prompt, rows - 1)
        valid = (self._resp_j > 0) | (self.prompt_lens[g] > 0) if B else rl.bool()
        self._pred_b, self._pred_j, self._pred_rows = self._resp_b[valid], self._resp_j[valid], pred[valid]

    # ---------------------------------------------------------------------------------------
    # helpers

    def position_ids(self, device=None):
        """[num_rows] int64: prompt rows 0..P-1, each response continuing P, P+1, ..."""
        if device is None:
            return self._position_ids
        return _dev(self, "position_ids", self._position_ids, torch.device(device))

    def pack(self, *xs):
        """Packed rows ``[num_rows, ...]`` from the batch view: ``pack(x)`` with x [B, L, ...]
        (``from_uid`` / ``from_lengths``: the prompt is taken once, from each group's first
        row), or ``pack(prefix_x, suffix_x)`` for ``from_prefix_suffix_masks`` layouts.
        Differentiable (a prompt's gradient goes to the row it was taken from)."""
        if self._sources is None:
            raise ValueError("forkattn: this layout has no batch view (a group without responses); "
                             "build it with from_lengths/from_uid/from_prefix_suffix_masks")
        if len(xs) != len(self._pack_src):
            raise TypeError("forkattn: pack() takes %d tensor(s) for this layout, got %d"
                            % (len(self._pack_src), len(xs)))
        vals = []
        for s, x in enumerate(xs):
            B, L = self._sources[s][3]
            if x.dim() < 2 or x.shape[0] != B or x.shape[1] < self._min_len(s):
                raise ValueError("forkattn: pack() input %d has shape %s, expected [%d, >=%d, ...]"
                                 % (s, tuple(x.shape), B, self._min_len(s)))
            dev = x.device
            b = _dev(self, ("pack_b", s), self._pack_src[s][0], dev)
            c = _dev(self, ("pack_c", s), self._pack_src[s][1], dev)
            vals.append(x[b, c])
        if self._pack_perm is None:
            return vals[0]
        return torch.cat(vals, 0)[_dev(self, "pack_perm", self._pack_perm, xs[0].device)]

    def _min_len(self, s):
        """Columns a batch-view source needs (a Python int, computed once: compile-friendly)."""
        ml = self.__dict__.get("_min_lens")
        if ml is None or len(ml) != len(self._sources):
            ml = self._min_lens = [int(c.max()) + 1 if c.numel() else 0 for (_, c, _, _) in self._sources]
        return ml[s]

    def unpack(self, y, seq_len=None):
        """Back to the batch view: ``[B, seq_len, ...]`` zero padded, every row's prompt copied
        from the shared rows (``from_uid`` / ``from_lengths``), or ``(prefix [G, Lp, ...],
        suffix [N, Ls, ...])`` for ``from_prefix_suffix_masks`` layouts. Differentiable (the
        copies' gradients are summed into the shared rows)."""
        if self._sources is None:
            raise ValueError("forkattn: this layout has no batch view")
        self._check_rows(y, "unpack")
        outs = []
        for s, (b, c, rows, shape) in enumerate(self._sources):
            if seq_len is not None and len(self._sources) == 1:
                if seq_len < self._min_len(0):
                    raise ValueError("forkattn: seq_len %d < %d columns used" % (seq_len, self._min_len(0)))
                shape = (shape[0], int(seq_len))
            dev = y.device
            outs.append(_scatter_rows(y, _dev(self, ("ub", s), b, dev), _dev(self, ("uc", s), c, dev),
                                      _dev(self, ("ur", s), rows, dev), shape))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def unpack_responses(self, y, length=None, shift=False):
        """Per-token values of the responses, ``[B, length or max_response_len, ...]`` zero
        padded, rows in batch order (``from_uid``: the batch rows; ``from_lengths`` /
        ``from_prefix_suffix_masks``: the responses in order).

        ``shift=True`` takes, for response token j, the row that *predicts* it (the previous
        token: the shared last prompt row for j = 0): ``unpack_responses(logits, shift=True)``
        lines logits up with the response tokens, as ``logits[:, -R-1:-1]`` does on the
        replicated batch. A response's first token has no predictor when the prompt is empty
        (left at zero)."""
        self._check_rows(y, "unpack_responses")
        Lr = self.max_response_len if length is None else int(length)
        if Lr < self.max_response_len:
            raise ValueError("forkattn: length %d < longest response %d" % (Lr, self.max_response_len))
        dev = y.device
        if shift:
            b, j, rows = self._pred_b, self._pred_j, self._pred_rows
        else:
            b, j, rows = self._resp_b, self._resp_j, self._resp_rows
        k = "pred" if shift else "resp"
        return _scatter_rows(y, _dev(self, (k, "b"), b, dev), _dev(self, (k, "j"), j, dev),
                             _dev(self, (k, "r"), rows, dev), (self.batch_size, Lr))

    def response_mask(self, length=None):
        """[B, length or max_response_len] bool: which entries of unpack_responses() are tokens."""
        Lr = self.max_response_len if length is None else int(length)
        m = torch.zeros(self.batch_size, Lr, dtype=torch.bool)
        m[self._resp_b, self._resp_j] = True
        return m

    def _check_rows(self, y, what):
        if y.dim() < 1 or y.shape[0] != self.num_rows:
            raise ValueError("forkattn: %s() needs [%d, ...] packed rows, got shape %s"
                             % (what, self.num_rows, tuple(y.shape)))

    # ---------------------------------------------------------------------------------------
    # misc

    @property
    def replicated_rows(self):
        """Rows of the replicated batch: sum over responses of (P + R)."""
        if self.num_responses == 0:
            return 0
        return int((self.prompt_lens[self.response_group] + self.response_lens).sum())

    @property
    def dedup_ratio(self):
        """replicated_rows / num_rows (1.0 for an empty layout)."""
        return self.replicated_rows / self.num_rows if self.num_rows else 1.0

    def state_dict(self):
        """The three defining tensors (rebuild with ``SharedPrefixLayout(**state)``; the batch
        view is not included)."""
        return {"prompt_lens": self.prompt_lens, "group_sizes": self.group_sizes,
                "response_lens": self.response_lens}

    def __repr__(self):
        return "SharedPrefixLayout(groups=%d, responses=%d, rows=%d, dedup=%.2fx)" % (
            self.num_groups, self.num_responses, self.num_rows, self.dedup_ratio)


class TreeLayout:
    """A packed tree (forest) of segments: node i owns rows ``[node_offsets[i],
    node_offsets[i+1])``, ``parents[i]`` is -1 or a node packed before it (CPU int64 tensors).
    A row attends to every row of its ancestors and causally within its node.

    Built from a trie (:meth:`from_sequences`, :meth:`from_parents`,
    :meth:`from_token_parents`: deduplicated, depth-first packing, with the maps to go between
    the inputs and the packed rows), or directly from ``node_offsets`` and ``parents``.
    """

    def __init__(self, node_offsets, parents):
        self.node_offsets = _long1d(node_offsets, "node_offsets")
        self.parents = _long1d(parents, "parents")
        n = self.parents.numel()
        if self.node_offsets.numel() != n + 1:
            raise ValueError("forkattn: node_offsets has %d entries, parents %d (need n+1 and n)"
                             % (self.node_offsets.numel(), n))
        self.num_nodes = n
        self.num_rows = int(self.node_offsets[-1])
        self.input_rows = None      # packed row of every input token (trie builders)
        self.seq_offsets = None     # CSR of the input sequences (from_sequences)
        self.input_nodes = None     # packed node of every input node (from_parents)
        self.row_tokens = None      # token id of every row (from_sequences)
        self._row_positions = None
        self._replicated = None

    @classmethod
    def _from_trie(cls, d):
        def t(a):
            return None if a is None else torch.frombuffer(bytearray(a), dtype=_i64) if len(a) else torch.zeros(0, dtype=_i64)
        lay = cls(t(d["node_offsets"]), t(d["parents"]))
        lay.input_rows = t(d["input_rows"])
        lay.row_nodes = t(d["row_nodes"])
        lay._row_positions = t(d["row_positions"])
        lay.node_depths = t(d["node_depths"])
        lay.row_tokens = t(d["row_tokens"])
        lay.input_nodes = t(d["input_nodes"])
        lay._replicated = d["replicated_tokens"]
        return lay

    @classmethod
    def from_sequences(cls, sequences, single_root=False):
        """The deduplicated trie of token sequences (list of 1-D int tensors / lists / arrays;
        each non-empty). Keeps ``seq_offsets`` [N+1], ``input_rows`` (packed row of token j of
        sequence s at ``seq_offsets[s] + j``), ``row_tokens`` [T] and the position ids."""
        seqs = [_long1d(s, "sequences[%d]" % i) for i, s in enumerate(sequences)]
        offs = _excl_cumsum(torch.tensor([s.numel() for s in seqs], dtype=_i64))
        if not seqs:
            lay = cls(torch.zeros(1, dtype=_i64), torch.zeros(0, dtype=_i64))
            lay.seq_offsets, lay.input_rows = offs, torch.zeros(0, dtype=_i64)
            lay.row_tokens = torch.zeros(0, dtype=_i64)
            lay._row_positions, lay._replicated = torch.zeros(0, dtype=_i64), 0
            return lay
        toks = torch.cat(seqs).contiguous()
        ctx = _lib.current_context()
        d = _lib.trie_from_sequences(ctx, offs.data_ptr(), toks.data_ptr(), len(seqs), toks.numel(),
                                     single_root)
        lay = cls._from_trie(d)
        lay.seq_offsets = offs
        lay._sequence_index()  # precomputed: gather_sequences works under torch.compile
        return lay

    @classmethod
    def from_parents(cls, parents, node_lengths, single_root=False):
        """A tree you already have: per node its parent (-1 for a root) and token count (>= 1),
        nodes in any order; repacked depth-first (``input_nodes`` maps input node i to its
        packed node, ``input_rows`` maps input token rows, nodes concatenated in input order,
        to packed rows: use :meth:`pack_inputs`)."""
        p = _long1d(parents, "parents")
        ln = _long1d(node_lengths, "node_lengths")
        if p.numel() != ln.numel():
            raise ValueError("forkattn: parents has %d entries, node_lengths %d" % (p.numel(), ln.numel()))
        if p.numel() == 0:
            lay = cls(torch.zeros(1, dtype=_i64), torch.zeros(0, dtype=_i64))
            lay.input_rows = lay.input_nodes = torch.zeros(0, dtype=_i64)
            return lay
        ntok = int(ln.clamp(min=0).sum())
        d = _lib.trie_from_parents(_lib.current_context(), p.data_ptr(), ln.data_ptr(), p.numel(),
                                   ntok, single_root)
        return cls._from_trie(d)

    @classmethod
    def from_token_parents(cls, token_parents, single_root=False):
        """Per-token parents (-1 for a first token): maximal chains of only children become
        nodes. ``input_rows[i]`` is token i's packed row."""
        p = _long1d(token_parents, "token_parents")
        if p.numel() == 0:
            lay = cls(torch.zeros(1, dtype=_i64), torch.zeros(0, dtype=_i64))
            lay.input_rows = torch.zeros(0, dtype=_i64)
            return lay
        d = _lib.trie_from_token_parents(_lib.current_context(), p.data_ptr(), p.numel(), single_root)
        return cls._from_trie(d)

    # ---------------------------------------------------------------------------------------

    def node_lengths(self):
        return self.node_offsets[1:] - self.node_offsets[:-1]

    def _ancestor_tokens(self):
        """[n] tokens above each node (sum of its ancestors' lengths)."""
        lens = self.node_lengths().tolist()
        par = self.parents.tolist()
        above = [0] * self.num_nodes
        for i, p in enumerate(par):
            if p >= 0:
                if p >= i:
                    raise ValueError("forkattn: parents[%d] = %d is not a node packed before it" % (i, p))
                above[i] = above[p] + lens[p]
            elif p != -1:
                raise ValueError("forkattn: parents[%d] = %d (must be -1 or a node index)" % (i, p))
        return torch.tensor(above, dtype=_i64)

    def position_ids(self):
        """[num_rows] int64: the number of ancestor tokens of every row (its position in every
        sequence through it)."""
        if self._row_positions is None:
            lens = self.node_lengths()
            self._row_positions = (torch.repeat_interleave(self._ancestor_tokens(), lens)
                                   + _seg_arange(lens))
        return self._row_positions

    @property
    def replicated_tokens(self):
        """Tokens before deduplication: the sum of the sequence lengths (from sequences) or of
        the root-to-leaf path lengths."""
        if self._replicated is None:
            if self.num_nodes == 0:
                self._replicated = 0
            else:
                above = self._ancestor_tokens()
                has_child = torch.zeros(self.num_nodes, dtype=torch.bool)
                ch = self.parents[self.parents >= 0]
                has_child[ch] = True
                leaf = ~has_child
                self._replicated = int((above + self.node_lengths())[leaf].sum())
        return self._replicated

    @property
    def dedup_ratio(self):
        """replicated_tokens / num_rows (>= 1; 1.0 for an empty tree)."""
        return self.replicated_tokens / self.num_rows if self.num_rows else 1.0

    def _sequence_rows(self):
        """(seq_offsets [N+1], rows [sum]) of the sequences: the input sequences (from_sequences)
        or the root-to-leaf paths, leaves in packed order."""
        if self.seq_offsets is not None and self.input_rows is not None:
            return self.seq_offsets, self.input_rows
        if self.__dict__.get("_paths") is None:
            n = self.num_nodes
            par = self.parents.tolist()
            off = self.node_offsets.tolist()
            has_child = [False] * n
            for p in par:
                if p >= 0:
                    has_child[p] = True
            pieces, lens = [], []
            for leaf in range(n):
                if has_child[leaf]:
                    continue
                chain, x = [], leaf
                while x >= 0:
                    chain.append(x)
                    x = par[x]
                rows = [torch.arange(off[c], off[c + 1], dtype=_i64) for c in reversed(chain)]
                r = torch.cat(rows) if rows else torch.zeros(0, dtype=_i64)
                pieces.append(r)
                lens.append(r.numel())
            self._paths = (_excl_cumsum(torch.tensor(lens, dtype=_i64)),
                           torch.cat(pieces) if pieces else torch.zeros(0, dtype=_i64))
        return self._paths

    @property
    def num_sequences(self):
        return self._sequence_rows()[0].numel() - 1

    def sequence_lengths(self):
        offs = self._sequence_rows()[0]
        return offs[1:] - offs[:-1]

    def gather_sequences(self, y, padded=True, length=None):
        """Per-sequence values from packed rows ``y`` [T, ...]: a padded ``[N, L_max, ...]``
        tensor (zeros past each sequence; ``length`` to pad further), or with ``padded=False``
        a list of [L_s, ...] tensors. Sequences are the input sequences (from_sequences) or the
        root-to-leaf paths. Differentiable."""
        if y.dim() < 1 or y.shape[0] != self.num_rows:
            raise ValueError("forkattn: gather_sequences() needs [%d, ...] packed rows, got shape %s"
                             % (self.num_rows, tuple(y.shape)))
        offs, rows, b, j, lens_list = self._sequence_index()
        dev = y.device
        rows_d = _dev(self, "seq_rows", rows, dev)
        if not padded:
            return list(torch.split(y.index_select(0, rows_d), lens_list, 0))
        longest = max(lens_list, default=0)
        Lm = longest if length is None else int(length)
        if Lm < longest:
            raise ValueError("forkattn: length %d < longest sequence %d" % (Lm, longest))
        return _scatter_rows(y, _dev(self, "seq_b", b, dev), _dev(self, "seq_j", j, dev), rows_d,
                             (len(lens_list), Lm))

    def _sequence_index(self):
        """Cached (offsets, rows, batch index, position, lengths as ints) of the sequences."""
        si = self.__dict__.get("_seq_index")
        if si is None:
            offs, rows = self._sequence_rows()
            lens = offs[1:] - offs[:-1]
            b = torch.repeat_interleave(torch.arange(lens.numel(), dtype=_i64), lens)
            si = self._seq_index = (offs, rows, b, _seg_arange(lens), lens.tolist())
        return si

    def pack_sequences(self, xs):
        """Packed rows [T, ...] from per-sequence values (list of [L_s, ...] tensors or a padded
        [N, L, ...] tensor): each packed row takes the value of the first sequence token mapped
        to it (shared tokens must carry equal values, e.g. token ids or embeddings)."""
        offs, rows = self._sequence_rows()
        lens = offs[1:] - offs[:-1]
        if isinstance(xs, (list, tuple)):
            if len(xs) != lens.numel():
                raise ValueError("forkattn: %d sequences given, the layout has %d" % (len(xs), lens.numel()))
            flat = torch.cat(list(xs), 0) if xs else None
            if flat is None or flat.shape[0] != int(lens.sum()):
                raise ValueError("forkattn: the sequences have the wrong lengths")
        else:
            b = torch.repeat_interleave(torch.arange(lens.numel(), dtype=_i64), lens).to(xs.device)
            j = _seg_arange(lens).to(xs.device)
            flat = xs[b, j]
        src = self._first_source(rows)
        return flat.index_select(0, src.to(flat.device))

    def pack_inputs(self, x):
        """Packed rows [T, ...] from input-ordered rows (from_parents: nodes concatenated in
        input order; from_token_parents: tokens in input order), via input_rows."""
        if self.input_rows is None:
            raise ValueError("forkattn: this layout has no input map")
        src = self._first_source(self.input_rows)
        return x.index_select(0, src.to(x.device))

    def _first_source(self, rows):
        T = self.num_rows
        src = torch.full((T,), rows.numel(), dtype=_i64)
        if rows.numel():
            src.scatter_reduce_(0, rows, torch.arange(rows.numel(), dtype=_i64), "amin")
        if T and int(src.max()) >= rows.numel():
            raise ValueError("forkattn: some packed rows have no source token")
        return src

    def state_dict(self):
        return {"node_offsets": self.node_offsets, "parents": self.parents}

    def __repr__(self):
        return "TreeLayout(nodes=%d, rows=%d, dedup=%.2fx)" % (self.num_nodes, self.num_rows,
                                                              self.dedup_ratio)
