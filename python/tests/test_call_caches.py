"""The binding's per-call caches: a layout marshalled once, a GPU integer tensor read once per
version. Every cached call must give what an uncached call gives, and a changed layout or tensor
must never be served from the cache."""

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from forkattn import _lib, ops  # noqa: E402
from conftest import make_qkv  # noqa: E402

HQ, HKV, D = 4, 2, 8


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def test_host_ints_follow_in_place_writes_and_new_tensors():
    cache = ops._HostInts(limit=4)
    t = torch.tensor([0, 3, 7])
    assert cache.get(t, "t") == (0, 3, 7) and cache.longest(t, "t") == 4
    t[2] = 9  # bumps t._version
    assert cache.get(t, "t") == (0, 3, 9) and cache.longest(t, "t") == 6
    u = torch.tensor([0, 1, 2])
    assert cache.get(u, "u") == (0, 1, 2) and cache.longest(u, "u") == 1
    for i in range(6):  # overflow empties the cache; entries stay correct
        assert cache.get(torch.tensor([0, i]), "x") == (0, i)
    assert cache.get(t, "t") == (0, 3, 9) and cache.longest(t, "t") == 6
    with pytest.raises(TypeError, match="integer tensor"):
        cache.get(torch.tensor([0.0, 1.0]), "f")


def test_varlen_layouts_are_not_confused():
    """Same row count, different sequence splits, one after the other: each call must use its
    own layout (a stale cache entry would give the other split's result)."""
    T = 12
    q, k, v, _ = make_qkv(T, HQ, HKV, D, torch.float32, seed=5)
    results = {}
    for lens in ([6, 6], [4, 8], [6, 6], [12], [4, 8]):
        cu = _cu(lens)
        out = forkattn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens))
        if tuple(lens) in results:
            assert torch.equal(out, results[tuple(lens)])
        results[tuple(lens)] = out
    assert not torch.equal(results[(6, 6)], results[(4, 8)])
    # the first sequence's rows of [4, 8] equal a lone 4-row sequence
    lone = forkattn.varlen_attention(q[:4], k[:4], v[:4], _cu([4]), _cu([4]), 4, 4)
    assert torch.equal(results[(4, 8)][:4], lone)


def test_varlen_in_place_update_of_cu_seqlens():
    T = 10
    q, k, v, _ = make_qkv(T, HQ, HKV, D, torch.float32, seed=6)
    cu = _cu([5, 5])
    a = forkattn.varlen_attention(q, k, v, cu, cu, 10, 10)
    cu.copy_(_cu([2, 8]))
    b = forkattn.varlen_attention(q, k, v, cu, cu, 10, 10)
    fresh = forkattn.varlen_attention(q, k, v, _cu([2, 8]), _cu([2, 8]), 10, 10)
    assert torch.equal(b, fresh) and not torch.equal(a, b)


def test_prefix_layout_cache_matches_fresh_marshalling():
    lay1 = forkattn.SharedPrefixLayout.from_lengths([3, 2], [[2, 1], [4]])
    lay2 = forkattn.SharedPrefixLayout.from_lengths([2, 3], [[1, 2], [4]])
    T = lay1.num_rows
    assert lay2.num_rows == T
    q, k, v, do = make_qkv(T, HQ, HKV, D, torch.float32, seed=7)
    for causal in (True, False):
        outs = []
        for lay in (lay1, lay2, lay1):
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            out = forkattn.prefix_attention(qg, kg, vg, lay, causal=causal)
            (out * do).sum().backward()
            outs.append((out.detach(), qg.grad, kg.grad, vg.grad))
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[2]))
        assert not torch.equal(outs[0][0], outs[1][0])
        _lib._prefix_layouts.items.clear()  # marshalled afresh: the same bits
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = forkattn.prefix_attention(qg, kg, vg, lay1, causal=causal)
        (out * do).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(outs[0], (out.detach(), qg.grad, kg.grad, vg.grad)))


def test_bad_layout_is_refused_every_time():
    """A refused layout is not cached: the second call is refused too."""
    q, k, v, _ = make_qkv(5, HQ, HKV, D, torch.float32, seed=8)
    for _ in range(2):
        with pytest.raises(_lib.ForkattnInvalidArgument):
            _lib.prefix_fwd(_lib.current_context(), [3], [1], [-1, 3], True, *(None,) * 4, None, 1.0,
                            _lib.MEMORY_HOST)


def test_layout_cache_limit():
    cache = _lib._LayoutCache(limit=3)
    built = []
    for i in list(range(5)) + [4]:
        cache.get(i, lambda: built.append(i) or i)
    assert built == [0, 1, 2, 3, 4] and len(cache.items) <= 3


@pytest.mark.parametrize("shape", [(5, 3, 8), (1, 3, 8), (5, 1, 8), (0, 3, 8), (5, 3, 1), (1, 1, 1)])
def test_contiguous_descriptor_fast_path_matches_make_tensor(shape):
    """_desc builds a contiguous tensor's descriptor directly; it must be the one make_tensor
    (which normalizes strides of size-1 and empty axes) builds."""
    x = torch.randn(*shape)
    _, fast = ops._desc(x)
    ref = _lib.make_tensor(x.data_ptr(), ops._DTYPES[x.dtype], *shape, x.stride(0), x.stride(1))
    names = [f[0] for f in _lib.Tensor._fields_]
    assert [getattr(fast, n) for n in names] == [getattr(ref, n) for n in names]


def _three_layouts(seed, **kw):
    """(Function class, call, inputs) for a prefix, a varlen and a tree call on small random
    inputs; kw goes to each public function."""
    lay = forkattn.SharedPrefixLayout.from_lengths([5, 3], [[4, 2], [6]])
    T = lay.num_rows
    q, k, v, _ = make_qkv(T, HQ, HKV, D, torch.float32, seed=seed)
    cu = _cu([7, 5, T - 12])
    tree = forkattn.TreeLayout.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]])
    qt, kt, vt, _ = make_qkv(tree.num_rows, HQ, HKV, D, torch.float32, seed=seed + 1)
    return [
        (ops.PrefixAttentionFunction, lambda a, b, c: forkattn.prefix_attention(a, b, c, lay, **kw), (q, k, v)),
        (ops.VarlenAttentionFunction, lambda a, b, c: forkattn.varlen_attention(a, b, c, cu, cu, T, T, **kw),
         (q, k, v)),
        (ops.TreeAttentionFunction, lambda a, b, c: forkattn.tree_attention(a, b, c, tree, **kw), (qt, kt, vt)),
    ]


def test_calls_without_autograd_skip_the_function_and_give_the_same_bits():
    """A forward autograd does not record (torch.no_grad, or inputs needing no gradient) runs the
    implementation directly: no grad_fn, the same output as the recorded call."""
    calls = [(fn, inputs) for _, fn, inputs in _three_layouts(11, return_lse=True)]
    for fn, inputs in calls:
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, lse = fn(*leaves)
        assert out.grad_fn is not None
        with torch.no_grad():
            out_ng, lse_ng = fn(*leaves)
        out_plain, lse_plain = fn(*inputs)
        for o, l in ((out_ng, lse_ng), (out_plain, lse_plain)):
            assert o.grad_fn is None and not o.requires_grad
            assert torch.equal(o, out.detach()) and torch.equal(l, lse)


def test_backward_gets_no_zero_tensor_for_lse():
    """lse is not differentiable: the backward must not make autograd allocate and fill a zero
    gradient for it on every call (a kernel launch on a GPU). The gradients stay those of a
    backward that did receive the zeros."""
    calls = _three_layouts(13)
    for fn_cls, fn, inputs in calls:
        inner, seen = fn_cls.backward, []

        def spy(ctx, dout, dlse, inner=inner, seen=seen):
            seen.append(dlse)
            return inner(ctx, dout, dlse)

        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        dout = torch.randn_like(out)
        fn_cls.backward = staticmethod(spy)
        try:
            out.backward(dout)
        finally:
            fn_cls.backward = inner
        assert seen == [None], fn_cls.__name__
        # the same backward handed materialized zeros for lse
        ctx_leaves = [t.clone().requires_grad_() for t in inputs]
        out2 = fn(*ctx_leaves)
        grads = inner(out2.grad_fn, dout, torch.zeros(out2.shape[:2]))
        for g, leaf in zip(grads, leaves):
            assert torch.equal(g, leaf.grad)


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="this torch has no torch.library.custom_op")
def test_custom_ops_backward_fills_no_zero_lse_gradient(monkeypatch):
    """The custom ops' autograd (what torch.compile traces) does not materialize lse's zero
    gradient either: no zeros op runs in the backward, and the gradients equal the eager path's."""
    for _, fn, inputs in _three_layouts(17):
        eager = [t.clone().requires_grad_() for t in inputs]
        out = fn(*eager)
        dout = torch.randn_like(out)
        out.backward(dout)
        monkeypatch.setattr(ops, "USE_CUSTOM_OPS", True)
        custom = [t.clone().requires_grad_() for t in inputs]
        out_c = fn(*custom)
        assert torch.equal(out_c, out)
        with torch.profiler.profile() as prof:
            out_c.backward(dout)
        monkeypatch.setattr(ops, "USE_CUSTOM_OPS", "compile")
        names = {e.name for e in prof.events()}
        assert "forkattn::prefix_bwd" in names or "forkattn::varlen_bwd" in names or "forkattn::tree_bwd" in names
        assert not names & {"aten::zeros", "aten::zero_", "aten::fill_"}, sorted(names)
        for a, b in zip(custom, eager):
            assert torch.equal(a.grad, b.grad)
