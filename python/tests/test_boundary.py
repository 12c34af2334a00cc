"""Boundary checks of the binding: tensors whose row counts disagree with the layout, integers
outside the C types' ranges, and backward calls whose settings differ from their forward's.

Every case must raise ForkattnInvalidArgument before the C library touches memory it does not
own (the C library trusts a descriptor's row count). The numpy-level part imports no torch; the
torch-level part at the end skips without it."""

import numpy as np
import pytest

import forkattn
from forkattn import _lib
from forkattn import numpy_api as fnp

INVALID = forkattn.ForkattnInvalidArgument

# One layout for the shared-prompt cases: two groups (prompt 4, one response of 3 each): 14 rows.
P2, S2, R2 = [4, 4], [1, 1], [3, 3]
T2 = 14
TREE_OFFS, TREE_PAR = [0, 4, 7, 9], [-1, 0, 0]  # 9 rows
CU = [0, 5, 9]  # varlen: 9 rows
H, D = 2, 8


def _a(rows, heads=H, d=D, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (rows, heads, d)).astype(np.float32)


def _has(sym):
    return hasattr(forkattn.load_library(), sym)


def _sweep(call, rows, layout=True):
    """call(rows dict) must succeed with ``rows`` and raise ForkattnInvalidArgument with each
    tensor alone one row short and one row long, and (``layout``: the rows are the layout's)
    with every tensor so."""
    call(dict(rows))  # the correct call works: the refusals below are about the rows alone
    for delta in (-1, 1):
        variants = [{k: n + delta for k, n in rows.items()}] if layout else []
        variants += [dict(rows, **{k: n + delta}) for k, n in rows.items()]
        for rs in variants:
            if min(rs.values()) < 0:
                continue
            try:
                call(rs)
            except INVALID:
                continue
            pytest.fail("rows %s (the layout's: %s) were accepted" % (rs, rows))


# --------------------------------------------------------------------------------------------
# numpy level: every operation, row counts one short and one long


def _fit(x, rows, axis=0):
    """x with ``rows`` rows along ``axis``: cut, or padded by repeating the last row."""
    n = x.shape[axis]
    if rows <= n:
        return np.ascontiguousarray(np.take(x, np.arange(rows), axis=axis))
    return np.ascontiguousarray(np.take(x, np.r_[np.arange(n), np.full(rows - n, n - 1)], axis=axis))


def _np_attention_rows(fwd, bwd, T, *layout, lse_axis=0, **kw):
    """Sweep the rows of every tensor of fwd(q, k, v, *layout, **kw) and of its backward
    ``bwd``; the layout packs T rows."""
    _sweep(lambda r: fwd(_a(r["q"]), _a(r["k"], seed=1), _a(r["v"], seed=2), *layout, **kw),
           {"q": T, "k": T, "v": T})
    q, k, v = _a(T), _a(T, seed=1), _a(T, seed=2)
    out, lse = fwd(q, k, v, *layout, return_lse=True, **kw)
    _sweep(lambda r: bwd(_a(r["dout"], seed=3), _a(r["q"]), _a(r["k"], seed=1), _a(r["v"], seed=2),
                         _fit(out, r["out"]), _fit(np.asarray(lse), r["lse"], axis=lse_axis), *layout, **kw),
           {"q": T, "k": T, "v": T, "out": T, "dout": T, "lse": T})


_QKV = {"q": T2, "k": T2, "v": T2}
_BWD = dict(_QKV, out=T2, dout=T2, lse=T2)


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_prefix_rows(causal):
    fwd, bwd = fnp.prefix_attention, fnp.prefix_attention_backward
    _np_attention_rows(fwd, bwd, T2, P2, R2, S2, causal=causal)
    _np_attention_rows(fwd, bwd, 7, 4, [3], None, causal=causal)  # one group: the C library's own check


def test_numpy_prefix_bidirectional_groups_reproducer():
    # Two bidirectional groups need 14 rows, q has 10: refused, and repeated calls stay refused.
    q = _a(10)
    with pytest.raises(INVALID, match="14"):
        fnp.prefix_attention(q, q, q, prompt_lens=[4, 4], response_lens=[3, 3], group_sizes=[1, 1], causal=False)
    out = np.zeros_like(q)
    lse = np.zeros(q.shape[:2], np.float32)
    for _ in range(3):
        with pytest.raises(INVALID):
            fnp.prefix_attention_backward(q, q, q, q, out, lse, prompt_lens=[4, 4], response_lens=[3, 3],
                                          group_sizes=[1, 1], causal=False)


def test_lib_row_slice_bounds():
    t = _lib.make_tensor(0, _lib.DTYPE_F32, 5, H, D, H * D, D)
    assert _lib.row_slice(t, 2, 3).rows == 3
    for start, n in ((3, 3), (-1, 2), (0, 6), (0, -1)):
        with pytest.raises(INVALID):
            _lib.row_slice(t, start, n)


def test_numpy_tree_rows():
    _np_attention_rows(fnp.tree_attention, fnp.tree_attention_backward, TREE_OFFS[-1], TREE_OFFS, TREE_PAR)


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_varlen_rows(causal):
    _np_attention_rows(fnp.varlen_attention, fnp.varlen_attention_backward, CU[-1], CU, lse_axis=1,
                       causal=causal)  # lse [Hq, T]


_KEPT = {"heads": H, "compressed_rows": 4, "query_start": 4, "offsets": [0, 2, 5], "index": [0, 3, 0, 1, 2]}


@pytest.mark.parametrize("layout", ["groups", "tree", "dense"])
def test_numpy_kept_and_stream_kl_rows(layout):
    if not _has("forkattn_kl_fwd"):
        pytest.skip("the loaded libforkattn has no StreamKL / kept sets")
    lay, T = {"groups": ({"prompt_lens": P2, "response_lens": R2, "group_sizes": S2}, T2),
              "tree": ({"node_offsets": TREE_OFFS, "parents": TREE_PAR}, TREE_OFFS[-1]),
              "dense": (9, 9)}[layout]
    for kept in (None, _KEPT):
        _np_attention_rows(fnp.kept_attention, fnp.kept_attention_backward, T, lay, kept)

        def kl(r):
            fnp.stream_kl(_a(r["q_t"]), _a(r["k_t"], seed=1), _a(r["q_s"], seed=2), _a(r["k_s"], seed=3), lay, kept)
        _sweep(kl, {"q_t": T, "k_t": T, "q_s": T, "k_s": T})
        _, stats, _ = fnp.stream_kl(_a(T), _a(T, seed=1), _a(T, seed=2), _a(T, seed=3), lay, kept)

        def klb(r):
            fnp.stream_kl_backward(np.ones((r["dkl"], H), np.float32), _a(r["q_t"]), _a(r["k_t"], seed=1),
                                   _a(r["q_s"], seed=2), _a(r["k_s"], seed=3), _fit(np.asarray(stats), r["stats"]),
                                   lay, kept, teacher_grad=True)
        _sweep(klb, {"q_t": T, "k_t": T, "q_s": T, "k_s": T, "dkl": T, "stats": T})


def test_numpy_kv_select_and_rows_mean_rows():
    if _has("forkattn_kv_select"):
        _sweep(lambda r: fnp.kv_select(_a(r["q"]), _a(r["k"], seed=1), "h2o", budget=4), {"q": 9, "k": 9},
               layout=False)
    x = np.ones((6, H), np.float32)
    _sweep(lambda r: fnp.rows_mean(x[:r["x"]] if r["x"] <= 6 else np.ones((r["x"], H), np.float32),
                                   np.ones(r["w"], np.float32)), {"x": 6, "w": 6}, layout=False)


def test_numpy_prefix_cached_rows():
    if not _has("forkattn_prefix_cached_fwd"):
        pytest.skip("the loaded libforkattn has no cached-prefix attention")
    from forkattn import dlm_cache

    P, R = 4, [3, 2]
    for block in (None, 2):
        def fwd(r):
            dlm_cache.prefix_cached_attention_numpy(_a(r["q"]), _a(r["k"], seed=1), _a(r["v"], seed=2), P, R,
                                                    block_size=block)
        _sweep(fwd, {"q": 5, "k": 9, "v": 9})
        out, lse = dlm_cache.prefix_cached_attention_numpy(_a(5), _a(9, seed=1), _a(9, seed=2), P, R,
                                                           block_size=block, return_lse=True)

        def bwd(r):
            dlm_cache.prefix_cached_attention_backward_numpy(
                _a(r["dout"], seed=3), _a(r["q"]), _a(r["k"], seed=1), _a(r["v"], seed=2), _fit(out, r["out"]),
                _fit(lse, r["lse"]), P, R, block_size=block)
        _sweep(bwd, {"q": 5, "k": 9, "v": 9, "out": 5, "dout": 5, "lse": 5})


def test_numpy_kv_cache_and_similarity_rows():
    if not _has("forkattn_kv_cache_create"):
        pytest.skip("the loaded libforkattn has no KV cache")
    from forkattn import dlm_cache

    _sweep(lambda r: dlm_cache.kv_similarity(_a(r["a"]), _a(r["b"], seed=1)), {"a": 6, "b": 6}, layout=False)
    with dlm_cache.KVCache(1 << 20, 2, H, D, "float32") as cache:
        def ins(r):
            cache.insert(list(range(100, 100 + r["tokens"])), [_a(r["k0"]), _a(r["k1"])],
                         [_a(r["v0"]), _a(r["v1"])])
        _sweep(ins, {"tokens": 5, "k0": 5, "k1": 5, "v0": 5, "v1": 5}, layout=False)


def test_numpy_path_stack_rows():
    if not _has("forkattn_path_create"):
        pytest.skip("the loaded libforkattn has no path stack")
    from forkattn import tree_exec

    with tree_exec.PathStack(H, H, D) as path:
        with pytest.raises(INVALID):
            path.push(_a(3), _a(4))
        with pytest.raises(INVALID):
            path.push(_a(4), _a(3))
        path.push(_a(3), _a(3))
        _sweep(lambda r: path.attend(_a(r["q"])), {"q": 3})
        o, lse = path.attend(_a(3))

        def bwd(r):
            path.attend_backward(_a(r["q"]), _fit(o, r["o"]), _a(r["dout"], seed=3), _fit(lse, r["lse"]))
        _sweep(bwd, {"q": 3, "o": 3, "dout": 3, "lse": 3})


# --------------------------------------------------------------------------------------------
# numpy level: integers outside the C types' ranges, head_dim 0

BIG = [2 ** 64 + 6, 2 ** 63, -(2 ** 63) - 1]


@pytest.mark.parametrize("big", BIG)
def test_numpy_integers_out_of_range(big):
    q = _a(8)
    cases = [
        lambda: fnp.prefix_attention(q, q, q, 2, [big]),
        lambda: fnp.prefix_attention(q, q, q, big, [6]),
        lambda: fnp.prefix_attention(q, q, q, [2, big], [3, 3], [1, 1], causal=False),
        lambda: fnp.prefix_attention(q, q, q, [2, 2], [2, big], [1, 1]),
        lambda: fnp.tree_attention(q, q, q, [0, big], [-1]),
        lambda: fnp.tree_attention(q, q, q, [0, 8], [big]),
        lambda: fnp.varlen_attention(q, q, q, [0, big]),
        lambda: fnp.trie_from_sequences([[1, big]]),
        lambda: fnp.kept_attention(q, q, q, big),
        lambda: _lib.int_arg(big, "x"),
    ]
    if _has("forkattn_kv_select"):
        cases += [lambda: fnp.kv_select(q, q, budget=big),
                  lambda: fnp.kv_select(q, q, "streaming_llm", budget=4, sinks=big),
                  lambda: fnp.kv_select(q, q, "streaming_llm", budget=4, window=big),
                  lambda: fnp.kv_select(q, q, "snapkv", budget=4, pool_kernel=big)]
    if _has("forkattn_kl_fwd"):
        kept = dict(_KEPT, index=[0, 3, 0, 1, big])
        cases += [lambda: fnp.kept_attention(q, q, q, 8, kept),
                  lambda: fnp.kept_attention(q, q, q, 8, dict(_KEPT, query_start=big)),
                  lambda: fnp.stream_kl(q, q, q, q, 8, dict(_KEPT, compressed_rows=big)),
                  lambda: fnp.stream_kl(q, q, q, q, 8, direction=big)]
    if _has("forkattn_prefix_cached_fwd"):
        from forkattn import dlm_cache

        cases += [lambda: dlm_cache.prefix_cached_attention_numpy(q, _a(9), _a(9), big, [8]),
                  lambda: dlm_cache.prefix_cached_attention_numpy(q, _a(9), _a(9), 1, [big]),
                  lambda: dlm_cache.prefix_cached_attention_numpy(q, _a(9), _a(9), 1, [8], block_size=big)]
    if _has("forkattn_path_create"):
        from forkattn import tree_exec

        cases += [lambda: tree_exec.PathStack(big, H, D),
                  lambda: tree_exec.tree_cost(([0, big], [-1]), tree_exec.TreeCostModel(2, 8, 1e-9)),
                  lambda: tree_exec.tree_cost((np.array([0, 2 ** 63], np.uint64), np.array([-1])),
                                              tree_exec.TreeCostModel(2, 8, 1e-9)),
                  lambda: tree_exec.tree_partition(([0, 4], [-1]), big, tree_exec.TreeCostModel(2, 8, 1e-9))]
    for i, case in enumerate(cases):
        with pytest.raises(INVALID, match="fit|negative|must be"):
            case()


def test_numpy_uint64_and_int_fields():
    q = _a(8)
    with pytest.raises(INVALID, match="fit"):  # a uint64 array above int64: no wrap-around
        fnp.trie_from_sequences([np.array([1, 2 ** 63 + 5], np.uint64)])
    with pytest.raises(INVALID, match="fit"):
        fnp.kept_attention(q, q, q, 8, dict(_KEPT, index=np.array([0, 3, 0, 1, 2 ** 63], np.uint64)))
    with pytest.raises(INVALID, match="fit"):  # a C int field: no truncation to 32 bits
        forkattn.Context("cpu", threads=2 ** 32 + 1)
    with pytest.raises(INVALID, match="fit"):
        fnp.stream_kl(q, q, q, q, 8, direction=2 ** 32)


def test_numpy_head_dim_zero():
    z = np.zeros((6, H, 0), np.float32)
    calls = [lambda: fnp.prefix_attention(z, z, z, 2, [4]),
             lambda: fnp.tree_attention(z, z, z, [0, 6], [-1]),
             lambda: fnp.varlen_attention(z, z, z, [0, 6]),
             lambda: fnp.kept_attention(z, z, z, 6)]
    if _has("forkattn_prefix_cached_fwd"):
        from forkattn import dlm_cache

        calls.append(lambda: dlm_cache.prefix_cached_attention_numpy(z[:4], z, z, 2, [4]))
    for c in calls:
        with pytest.raises(INVALID, match="head_dim"):
            c()
    with pytest.raises(INVALID):
        _lib.softmax_scale(0)
    assert _lib.softmax_scale(16) == 0.25 and _lib.softmax_scale(0, 0.5) == 0.5


# --------------------------------------------------------------------------------------------
# numpy level: a backward refuses settings other than its forward's


def _prefix_pair():
    q, k, v = _a(T2), _a(T2, seed=1), _a(T2, seed=2)
    kw = dict(causal=False, softmax_scale=0.3)
    out, lse = fnp.prefix_attention(q, k, v, P2, R2, S2, return_lse=True, **kw)

    def bwd(**ch):
        args = dict(kw, prompt_lens=P2, response_lens=R2, group_sizes=S2)
        args.update(ch)
        return fnp.prefix_attention_backward(out, q, k, v, out, lse, args.pop("prompt_lens"),
                                             args.pop("response_lens"), args.pop("group_sizes"), **args)
    return lse, bwd, [{"causal": True}, {"softmax_scale": 0.31}, {"softmax_scale": None},
                      {"response_lens": [2, 4]}, {"prompt_lens": [3, 5]}]


def _tree_pair():
    T = TREE_OFFS[-1]
    q, k, v = _a(T), _a(T, seed=1), _a(T, seed=2)
    out, lse = fnp.tree_attention(q, k, v, TREE_OFFS, TREE_PAR, softmax_scale=0.3, return_lse=True)

    def bwd(**ch):
        args = dict(node_offsets=TREE_OFFS, parents=TREE_PAR, softmax_scale=0.3)
        args.update(ch)
        return fnp.tree_attention_backward(out, q, k, v, out, lse, args.pop("node_offsets"), args.pop("parents"),
                                           **args)
    return lse, bwd, [{"softmax_scale": 0.2}, {"parents": [-1, 0, 1]}, {"node_offsets": [0, 3, 7, 9]}]


def _varlen_pair():
    T = CU[-1]
    q, k, v = _a(T), _a(T, seed=1), _a(T, seed=2)
    out, lse = fnp.varlen_attention(q, k, v, CU, causal=True, return_lse=True)

    def bwd(**ch):
        args = dict(cu_seqlens=CU, causal=True)
        args.update(ch)
        return fnp.varlen_attention_backward(out, q, k, v, out, lse, args.pop("cu_seqlens"), **args)
    return lse, bwd, [{"causal": False}, {"softmax_scale": 0.5}, {"cu_seqlens": [0, 4, 9]}]


def _kept_pair():
    lay = {"prompt_lens": P2, "response_lens": R2, "group_sizes": S2}
    q, k, v = _a(T2), _a(T2, seed=1), _a(T2, seed=2)
    out, lse = fnp.kept_attention(q, k, v, lay, _KEPT, return_lse=True)

    def bwd(**ch):
        args = dict(layout=lay, kept=_KEPT)
        args.update(ch)
        return fnp.kept_attention_backward(out, q, k, v, out, lse, args.pop("layout"), args.pop("kept"), **args)
    other = dict(_KEPT, index=[0, 2, 0, 1, 2])
    return lse, bwd, [{"softmax_scale": 0.2}, {"kept": None}, {"kept": other}, {"layout": T2},
                      {"layout": {"prompt_lens": [5, 3], "response_lens": R2, "group_sizes": S2}}]


def _kl_pair():
    lay = {"prompt_lens": P2, "response_lens": R2, "group_sizes": S2}
    xs = [_a(T2, seed=s) for s in range(4)]
    kw = dict(direction="forward", temperature=2.0, scale_by_tau2=True)
    kl, stats, _ = fnp.stream_kl(*xs, lay, _KEPT, **kw)

    def bwd(**ch):
        args = dict(kw, layout=lay, kept=_KEPT)
        args.update(ch)
        return fnp.stream_kl_backward(np.ones_like(kl), *xs, stats, args.pop("layout"), args.pop("kept"), **args)
    return stats, bwd, [{"temperature": 1.0}, {"direction": "reverse"}, {"scale_by_tau2": False},
                        {"scale_teacher": 0.5}, {"scale_student": 0.5}, {"kept": None}, {"layout": T2}]


def _cached_pair():
    from forkattn import dlm_cache

    q, k, v = _a(5), _a(9, seed=1), _a(9, seed=2)
    out, lse = dlm_cache.prefix_cached_attention_numpy(q, k, v, 4, [3, 2], block_size=2, return_lse=True)

    def bwd(**ch):
        args = dict(prompt_len=4, response_lens=[3, 2], block_size=2)
        args.update(ch)
        return dlm_cache.prefix_cached_attention_backward_numpy(out, q, k, v, out, lse, args.pop("prompt_len"),
                                                                args.pop("response_lens"), **args)
    return lse, bwd, [{"block_size": None}, {"block_size": None, "causal": True}, {"scale": 0.2},
                      {"response_lens": [2, 3]}]


@pytest.mark.parametrize("pair", ["prefix", "tree", "varlen", "kept", "stream_kl", "prefix_cached"])
def test_numpy_backward_settings_must_match_forward(pair):
    if pair in ("kept", "stream_kl") and not _has("forkattn_kl_fwd"):
        pytest.skip("the loaded libforkattn has no StreamKL / kept sets")
    if pair == "prefix_cached" and not _has("forkattn_prefix_cached_fwd"):
        pytest.skip("the loaded libforkattn has no cached-prefix attention")
    saved, bwd, changes = {"prefix": _prefix_pair, "tree": _tree_pair, "varlen": _varlen_pair,
                           "kept": _kept_pair, "stream_kl": _kl_pair, "prefix_cached": _cached_pair}[pair]()
    assert isinstance(saved, fnp.SavedStats) and saved.forkattn_settings["op"]
    ref = bwd()  # the forward's own settings: accepted
    for ch in changes:
        with pytest.raises(INVALID, match="forward"):
            bwd(**ch)
    # A plain array (no record) is accepted unchecked and gives the same gradients.
    plain = np.array(saved)
    assert type(plain) is np.ndarray
    saved.forkattn_settings, rec = None, saved.forkattn_settings
    try:
        again = bwd()
    finally:
        saved.forkattn_settings = rec
    for a, b in zip(ref, again):
        assert np.array_equal(a, b)


def test_numpy_saved_stats_record_follows_views_not_arithmetic():
    q = _a(7)
    _, lse = fnp.prefix_attention(q, q, q, 4, [3], return_lse=True)
    assert lse.copy().forkattn_settings == lse.forkattn_settings
    assert type(lse + 0) is np.ndarray and not isinstance(lse.max(), fnp.SavedStats)
    with pytest.raises(INVALID, match="prefix_attention"):  # an lse from another operation
        fnp.tree_attention_backward(q, q, q, q, q, lse, [0, 7], [-1])


# --------------------------------------------------------------------------------------------
# torch level (skipped without PyTorch)


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _t(torch, rows, heads=H, d=D, seed=0, grad=False):
    x = torch.from_numpy(_a(rows, heads, d, seed))
    return x.requires_grad_(True) if grad else x


def test_torch_prefix_tree_varlen_rows(torch):
    from forkattn import ops

    for causal in (False, True):
        lay = forkattn.SharedPrefixLayout.from_lengths(P2, [[3], [3]])

        def fwd(r):
            out = forkattn.prefix_attention(_t(torch, r["q"], grad=True), _t(torch, r["k"], seed=1),
                                            _t(torch, r["v"], seed=2), lay, causal=causal)
            out.sum().backward()
        _sweep(fwd, _QKV)
        q, k, v = _t(torch, T2), _t(torch, T2, seed=1), _t(torch, T2, seed=2)
        out, lse = ops._prefix_fwd_impl(q, k, v, lay.prompt_lens, lay.response_lens, lay.group_sizes, 0.3, causal)

        def bwd(r):
            ops._prefix_bwd_impl(_t(torch, r["dout"]), _t(torch, r["q"]), _t(torch, r["k"], seed=1),
                                 _t(torch, r["v"], seed=2), torch.from_numpy(_fit(out.numpy(), r["out"])),
                                 torch.from_numpy(_fit(lse.numpy(), r["lse"])), lay.prompt_lens, lay.response_lens,
                                 lay.group_sizes, 0.3, causal)
        _sweep(bwd, _BWD)
    tl = forkattn.TreeLayout(torch.tensor(TREE_OFFS), torch.tensor(TREE_PAR))
    T = TREE_OFFS[-1]

    def tfwd(r):
        forkattn.tree_attention(_t(torch, r["q"], grad=True), _t(torch, r["k"], seed=1), _t(torch, r["v"], seed=2),
                                tl).sum().backward()
    _sweep(tfwd, {"q": T, "k": T, "v": T})
    q, k, v = _t(torch, T), _t(torch, T, seed=1), _t(torch, T, seed=2)
    out, lse = ops._tree_fwd_impl(q, k, v, tl.node_offsets, tl.parents, 0.3)

    def tbwd(r):
        ops._tree_bwd_impl(_t(torch, r["dout"]), _t(torch, r["q"]), _t(torch, r["k"], seed=1),
                           _t(torch, r["v"], seed=2), torch.from_numpy(_fit(out.numpy(), r["out"])),
                           torch.from_numpy(_fit(lse.numpy(), r["lse"])), tl.node_offsets, tl.parents, 0.3)
    _sweep(tbwd, {"q": T, "k": T, "v": T, "out": T, "dout": T, "lse": T})
    cu = torch.tensor(CU, dtype=torch.int32)
    T = CU[-1]

    def vfwd(r):
        forkattn.varlen_attention(_t(torch, r["q"], grad=True), _t(torch, r["k"], seed=1), _t(torch, r["v"], seed=2),
                                  cu, cu, 5, 5).sum().backward()
    _sweep(vfwd, {"q": T, "k": T, "v": T})
    q, k, v = _t(torch, T), _t(torch, T, seed=1), _t(torch, T, seed=2)
    out, lse = ops._varlen_fwd_impl(q, k, v, cu, cu, 0.3, True)

    def vbwd(r):
        ops._varlen_bwd_impl(_t(torch, r["dout"]), _t(torch, r["q"]), _t(torch, r["k"], seed=1),
                             _t(torch, r["v"], seed=2), torch.from_numpy(_fit(out.numpy(), r["out"])),
                             torch.from_numpy(_fit(lse.numpy(), r["lse"])), cu, cu, 0.3, True)
    _sweep(vbwd, {"q": T, "k": T, "v": T, "out": T, "dout": T, "lse": T})


def test_torch_distill_rows(torch):
    if not _has("forkattn_kl_fwd"):
        pytest.skip("the loaded libforkattn has no StreamKL / kept sets")
    from forkattn import distill

    lay = forkattn.SharedPrefixLayout.from_lengths(P2, [[3], [3]])
    kept = distill.KeptSet(H, torch.tensor(_KEPT["offsets"]), torch.tensor(_KEPT["index"]), 4, 4)
    for ks in (None, kept):
        def kfwd(r):
            distill.kept_attention(_t(torch, r["q"], grad=True), _t(torch, r["k"], seed=1), _t(torch, r["v"], seed=2),
                                   lay, ks).sum().backward()
        _sweep(kfwd, _QKV)

        def kl(r):
            q_s = _t(torch, r["q_s"], seed=2, grad=True)
            distill.stream_kl(_t(torch, r["q_t"]), _t(torch, r["k_t"], seed=1), q_s, _t(torch, r["k_s"], seed=3),
                              lay, kept=ks).sum().backward()
        _sweep(kl, {"q_t": T2, "k_t": T2, "q_s": T2, "k_s": T2})
    largs = (lay.prompt_lens, lay.response_lens, lay.group_sizes, None, None)
    kargs = (kept.offsets, kept.index, None, H, 4, 4)
    q, k, v = _t(torch, T2), _t(torch, T2, seed=1), _t(torch, T2, seed=2)
    out, lse = distill._kept_fwd_impl(q, k, v, *largs, *kargs, 0.3)

    def kbwd(r):
        distill._kept_bwd_impl(_t(torch, r["dout"]), _t(torch, r["q"]), _t(torch, r["k"], seed=1),
                               _t(torch, r["v"], seed=2), torch.from_numpy(_fit(out.numpy(), r["out"])),
                               torch.from_numpy(_fit(lse.numpy(), r["lse"])), *largs, *kargs, 0.3)
    _sweep(kbwd, _BWD)
    xs = [_t(torch, T2, seed=s) for s in range(4)]
    klopt = (_lib.KL_FORWARD, 0.0, 0.0, 1.0, False)
    _, stats, _ = distill._kl_fwd_impl(*xs, *largs, *kargs, *klopt)

    def klb(r):
        distill._kl_bwd_impl(torch.ones(r["dkl"], H), _t(torch, r["q_t"]), _t(torch, r["k_t"], seed=1),
                             _t(torch, r["q_s"], seed=2), _t(torch, r["k_s"], seed=3),
                             torch.from_numpy(_fit(stats.numpy(), r["stats"])), *largs, *kargs, *klopt, True)
    _sweep(klb, {"q_t": T2, "k_t": T2, "q_s": T2, "k_s": T2, "dkl": T2, "stats": T2})
    if _has("forkattn_kv_select"):
        _sweep(lambda r: distill.kv_select(_t(torch, r["q"]), _t(torch, r["k"], seed=1), "h2o", budget=4),
               {"q": 9, "k": 9}, layout=False)


def test_torch_dlm_cache_and_path_rows(torch):
    from forkattn import dlm_cache, tree_exec

    if _has("forkattn_prefix_cached_fwd"):
        lay = forkattn.SharedPrefixLayout.from_lengths([4], [[3, 2]])

        def fwd(r):
            dlm_cache.prefix_cached_attention(_t(torch, r["q"], grad=True), _t(torch, r["k"], seed=1),
                                              _t(torch, r["v"], seed=2), lay).sum().backward()
        _sweep(fwd, {"q": 5, "k": 9, "v": 9})
        q, k, v = _t(torch, 5), _t(torch, 9, seed=1), _t(torch, 9, seed=2)
        out, lse = dlm_cache._cached_fwd_impl(q, k, v, lay.prompt_lens, lay.response_lens, 0.3, False)

        def bwd(r):
            dlm_cache._cached_bwd_impl(_t(torch, r["dout"]), _t(torch, r["q"]), _t(torch, r["k"], seed=1),
                                       _t(torch, r["v"], seed=2), torch.from_numpy(_fit(out.numpy(), r["out"])),
                                       torch.from_numpy(_fit(lse.numpy(), r["lse"])), lay.prompt_lens,
                                       lay.response_lens, 0.3, False)
        _sweep(bwd, {"q": 5, "k": 9, "v": 9, "out": 5, "dout": 5, "lse": 5})
        _sweep(lambda r: dlm_cache.kv_similarity(_t(torch, r["a"]), _t(torch, r["b"], seed=1)), {"a": 6, "b": 6},
               layout=False)
    if _has("forkattn_path_create"):
        with tree_exec.PathStack(H, H, D) as path:
            path.push(_t(torch, 3), _t(torch, 3))
            _sweep(lambda r: path.attend(_t(torch, r["q"])), {"q": 3})


def test_torch_integers_out_of_range(torch):
    from forkattn import distill, ops

    q = _t(torch, 8)
    big = 2 ** 64 + 6
    with pytest.raises(INVALID, match="fit"):
        ops._prefix_fwd_impl(q, q, q, [2], [big], [1], 0.3, True)
    with pytest.raises(INVALID, match="head_dim"):
        z = torch.zeros(6, H, 0)
        forkattn.prefix_attention(z, z, z, forkattn.SharedPrefixLayout.from_lengths([2], [[4]]))
    if _has("forkattn_kv_select"):
        with pytest.raises(INVALID, match="fit"):
            distill.kv_select(q, q, budget=big)
    with pytest.raises(INVALID, match="fit"):
        forkattn.SharedPrefixLayout.from_lengths([2 ** 64], [[3]])
    if hasattr(torch, "uint64"):  # a uint64 tensor above int64: no wrap-around in the cast
        with pytest.raises(INVALID, match="fit"):
            forkattn.TreeLayout(torch.tensor([0, 2 ** 63 + 3], dtype=torch.uint64), torch.tensor([-1]))
        with pytest.raises(INVALID, match="fit"):
            ops._tree_fwd_impl(q, q, q, torch.tensor([0, 2 ** 63 + 3], dtype=torch.uint64), torch.tensor([-1]), 0.3)
        if _has("forkattn_kl_fwd"):
            with pytest.raises(INVALID, match="fit"):
                distill.KeptSet(H, [0, 2, 5], torch.tensor([0, 3, 0, 1, 2 ** 63], dtype=torch.uint64), 4, 4)
            with pytest.raises(INVALID, match="fit"):
                distill.KeptSet(H, [0, 2, 5], [0, 3, 0, 1, 2 ** 64], 4, 4)
