"""StreamKL (stream_kl, kl_outside_mass), kept sets (KeptSet, kv_select) and kept-set attention
against float64 PyTorch references that materialise the rows x keys masks and distributions
(log_softmax with masks; a large finite fill instead of -inf so masked entries get exact zero
gradients), and the numpy API against the torch one."""

import math

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from forkattn import _lib  # noqa: E402
from conftest import bind_without, rel_err  # noqa: E402

NEG = -1e30
HT, HKV_T, DT = 4, 2, 16  # teacher: 4 query heads, 2 KV heads, head_dim 16
HKV_S, DS = 1, 8          # student: 4 query heads, 1 KV head, head_dim 8

pytestmark = pytest.mark.skipif(not _lib.has_symbol("forkattn_kl_fwd"),
                                reason="the loaded libforkattn has no StreamKL (forkattn_kl_fwd)")


# --------------------------------------------------------------------------------------------
# layouts and masks


def _layout(name):
    if name == "dense":
        return None, 70
    if name == "prefix1":  # one group: a forkattn_prefix_layout
        lay = forkattn.SharedPrefixLayout.from_lengths([50], [[10, 0, 12]])
    elif name == "prefix":  # several groups: the forest tree layout
        lay = forkattn.SharedPrefixLayout.from_lengths([40, 9], [[12, 0, 7], [6, 5]])
    elif name == "tree":
        seqs = [list(range(30)) + [100 + i for i in range(20)], list(range(30)) + [200 + i for i in range(9)],
                list(range(25)) + [300 + i for i in range(14)], [7, 8, 9]]
        lay = forkattn.TreeLayout.from_sequences(seqs)
    else:
        raise KeyError(name)
    return lay, lay.num_rows


def _nodes(layout, T):
    """(node_offsets, parents) lists of any layout (prefix groups as the forest)."""
    if layout is None:
        return [0, T], [-1]
    if isinstance(layout, forkattn.TreeLayout):
        return layout.node_offsets.tolist(), layout.parents.tolist()
    offs, par = [0], []
    r = 0
    for P, n in zip(layout.prompt_lens.tolist(), layout.group_sizes.tolist()):
        root = len(par)
        par.append(-1)
        offs.append(offs[-1] + P)
        for _ in range(n):
            par.append(root)
            offs.append(offs[-1] + layout.response_lens[r].item())
            r += 1
    return offs, par


def visibility(layout, T):
    """[T, T] bool: may row i see key j under the layout (ancestors fully, own node causally)."""
    offs, par = _nodes(layout, T)
    node = torch.zeros(T, dtype=torch.long)
    for i in range(len(par)):
        node[offs[i]:offs[i + 1]] = i
    anc = torch.zeros(len(par), len(par), dtype=torch.bool)  # anc[a, b]: b is a proper ancestor of a
    for a in range(len(par)):
        p = par[a]
        while p >= 0:
            anc[a, p] = True
            p = par[p]
    i = torch.arange(T)
    ni, nj = node[:, None], node[None, :]
    return anc[ni, nj] | ((ni == nj) & (i[None, :] <= i[:, None]))


def kept_dense(heads, T, lists=None, compressed_rows=0, query_start=0, block_mask=None):
    """[heads, T, T] bool of what a kept set keeps, from its definition."""
    m = torch.ones(heads, T, T, dtype=torch.bool)
    if lists is not None:
        for h, idx in enumerate(lists):
            for j in range(compressed_rows):
                if j not in set(idx):
                    m[h, query_start:, j] = False
    if block_mask is not None:
        for h in range(heads):
            for i in range(T):
                for j in range(T):
                    if not block_mask[h][i // 64][j // 64]:
                        m[h, i, j] = False
    return m


def _kept_case(kind, T, seed=0):
    """(KeptSet, dense mask [2, T, T]) with 2 kept heads (query heads 0,1 -> 0; 2,3 -> 1)."""
    if kind is None:
        return None, None
    g = torch.Generator().manual_seed(seed)
    cr = 30
    lists = [sorted(torch.randperm(cr, generator=g)[:n].tolist()) for n in (11, 17)]
    nb = (T + 63) // 64
    bm = torch.ones(2, nb, nb, dtype=torch.uint8)
    if kind == "lists":
        ks = forkattn.KeptSet.from_lists(lists, compressed_rows=cr, query_start=cr)
        return ks, kept_dense(2, T, lists, cr, cr)
    assert nb >= 2
    bm[0, 1, 0] = 0  # head 0: query block 1 drops key block 0
    bm[1, 1, :] = 0  # head 1: query block 1 sees nothing (kl 0, outside mass 1, o 0, lse -inf)
    if kind == "block":
        ks = forkattn.KeptSet.from_block_mask(bm)
        return ks, kept_dense(2, T, block_mask=bm.tolist())
    ks = forkattn.KeptSet.from_lists(lists, compressed_rows=cr, query_start=20, block_mask=bm)  # both
    return ks, kept_dense(2, T, lists, cr, 20, bm.tolist())


# --------------------------------------------------------------------------------------------
# references


def ref_kl(qt, kt, qs, ks, vis, kept, direction="forward", tau=1.0, tau2=False, st=None, ss=None):
    """Float64: kl [T, H] and outside mass [T, H]; differentiable in all four inputs."""
    H = qt.shape[1]
    st = DT ** -0.5 if st is None else st
    ss = DS ** -0.5 if ss is None else ss
    ktr = kt.repeat_interleave(H // kt.shape[1], 1)
    ksr = ks.repeat_interleave(H // ks.shape[1], 1)
    t = torch.einsum("ihd,jhd->hij", qt, ktr) * (st / tau)
    s = torch.einsum("ihd,jhd->hij", qs, ksr) * (ss / tau)
    V = vis[None].expand(H, -1, -1)
    K = V if kept is None else V & kept.repeat_interleave(H // kept.shape[0], 0)
    logT_full = torch.log_softmax(torch.where(V, t, torch.full_like(t, NEG)), -1)
    logT_k = torch.log_softmax(torch.where(K, t, torch.full_like(t, NEG)), -1)
    logS = torch.log_softmax(torch.where(K, s, torch.full_like(s, NEG)), -1)
    zero = torch.zeros_like(t)
    if direction == "forward":
        kl = torch.where(K, logT_k.exp() * (logT_k - logS), zero).sum(-1)
    else:
        kl = torch.where(K, logS.exp() * (logS - logT_full), zero).sum(-1)
    kl = torch.where(K.any(-1), kl, torch.zeros_like(kl))
    if tau2:
        kl = kl * tau * tau
    outside = 1 - torch.where(K, logT_full.exp(), zero).sum(-1)
    return kl.transpose(0, 1), outside.transpose(0, 1).detach()


def ref_attention(q, k, v, vis, kept, scale):
    """Float64 masked attention: o [T, Hq, d] (0 for rows that see nothing), lse [T, Hq]."""
    H = q.shape[1]
    kr = k.repeat_interleave(H // k.shape[1], 1)
    vr = v.repeat_interleave(H // v.shape[1], 1)
    s = torch.einsum("ihd,jhd->hij", q, kr) * scale
    M = vis[None].expand(H, -1, -1)
    if kept is not None:
        M = M & kept.repeat_interleave(H // kept.shape[0], 0)
    p = torch.softmax(torch.where(M, s, torch.full_like(s, NEG)), -1) * M
    o = torch.einsum("hij,jhd->ihd", p, vr)
    lse = torch.where(M.any(-1), torch.logsumexp(torch.where(M, s, torch.full_like(s, NEG)), -1),
                      torch.full_like(s[..., 0], -math.inf))
    return o, lse.transpose(0, 1)


def _inputs(T, seed, dtype_t=torch.float32, dtype_s=torch.float32, amp=2.0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dt, a=1.0):
        return ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * a).to(dt)

    return (r(T, HT, DT, dt=dtype_t, a=amp), r(T, HKV_T, DT, dt=dtype_t), r(T, HT, DS, dt=dtype_s, a=amp),
            r(T, HKV_S, DS, dt=dtype_s))


def _leaves(*ts):
    return [t.detach().double().requires_grad_() for t in ts]


# --------------------------------------------------------------------------------------------
# StreamKL


@pytest.mark.parametrize("kept_kind", [None, "lists", "both"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("layout_name", ["dense", "prefix1", "prefix", "tree"])
def test_stream_kl_matches_reference(layout_name, direction, kept_kind):
    lay, T = _layout(layout_name)
    kept, km = _kept_case(kept_kind, T, seed=T)
    inp = _inputs(T, seed=7 * len(layout_name) + (direction == "reverse"))
    qt, kt, qs, ks = (x.clone().requires_grad_() for x in inp)
    kl, outside = forkattn.stream_kl(qt, kt, qs, ks, lay, kept=kept, direction=direction, teacher_grad=True,
                                     return_outside_mass=True)
    assert kl.shape == (T, HT) and kl.dtype == torch.float32 and outside.shape == (T, HT)
    g = torch.Generator().manual_seed(7)
    w = torch.rand(T, HT, generator=g, dtype=torch.float64)
    (kl * w.float()).sum().backward()

    r64 = _leaves(*inp)
    rkl, rout = ref_kl(*r64, visibility(lay, T), km, direction)
    (rkl * w).sum().backward()
    assert rel_err(kl.detach(), rkl.detach()) <= 1e-5
    assert (outside.double() - rout).abs().max().item() <= 1e-5
    if kept is None:
        assert torch.all(outside == 0)
    for got, ref in zip((qt.grad, kt.grad, qs.grad, ks.grad), r64):
        assert rel_err(got, ref.grad) <= 1e-5, (rel_err(got, ref.grad))
    if kept_kind == "both":  # rows of kept head 1 in query block 1 keep no key
        assert torch.all(kl.detach()[64:, 2:] == 0) and torch.all(outside[64:, 2:] == 1)


def test_stream_kl_temperature_tau2_and_scales():
    lay, T = _layout("prefix")
    kept, km = _kept_case("lists", T, seed=3)
    inp = _inputs(T, seed=11)
    vis = visibility(lay, T)
    for direction in ("forward", "reverse"):
        qt, kt, qs, ks = (x.clone().requires_grad_() for x in inp)
        kl = forkattn.stream_kl(qt, kt, qs, ks, lay, kept=kept, direction=direction, temperature=2.0,
                                scale_by_tau2=True, scale_teacher=0.3, scale_student=0.45, teacher_grad=True)
        kl.sum().backward()
        r64 = _leaves(*inp)
        rkl, _ = ref_kl(*r64, vis, km, direction, tau=2.0, tau2=True, st=0.3, ss=0.45)
        rkl.sum().backward()
        assert rel_err(kl.detach(), rkl.detach()) <= 1e-5
        for got, ref in zip((qt.grad, kt.grad, qs.grad, ks.grad), r64):
            assert rel_err(got, ref.grad) <= 1e-5
        # tau^2 is a plain factor of the loss
        kl1 = forkattn.stream_kl(*inp, lay, kept=kept, direction=direction, temperature=2.0, scale_teacher=0.3,
                                 scale_student=0.45)
        assert torch.allclose(kl.detach(), 4 * kl1, rtol=1e-6, atol=1e-7)


def test_stream_kl_teacher_detached_by_default_and_loss_example():
    lay, T = _layout("prefix")
    qt, kt, qs, ks = _inputs(T, seed=5)
    qt.requires_grad_()
    kt.requires_grad_()
    qs.requires_grad_()
    ks.requires_grad_()
    kl = forkattn.stream_kl(qt, kt, qs, ks, lay)
    mask = torch.zeros(T)
    mask[lay.response_starts[0]:] = 1  # a loss mask over rows
    loss = (kl.mean(-1) * mask).sum() / mask.sum()
    loss.backward()
    assert qt.grad is None and kt.grad is None
    assert qs.grad is not None and ks.grad is not None and qs.grad.abs().sum() > 0
    r64 = _leaves(qt, kt, qs, ks)
    rkl, _ = ref_kl(*r64, visibility(lay, T), None)
    rl = (rkl.mean(-1) * mask.double()).sum() / mask.sum()
    rl.backward()
    assert abs(loss.item() - rl.item()) <= 1e-5 * abs(rl.item())
    assert rel_err(qs.grad, r64[2].grad) <= 1e-5 and rel_err(ks.grad, r64[3].grad) <= 1e-5
    # the same student and teacher: KL 0 and zero gradient
    z = forkattn.stream_kl(qt.detach(), kt.detach(), qt.detach(), kt.detach(), lay)
    assert z.abs().max().item() <= 1e-5


def test_stream_kl_mixed_dtypes():
    """bf16 student, f32 teacher; the student's gradients come back in bf16."""
    lay, T = _layout("tree")
    inp = _inputs(T, seed=9, dtype_s=torch.bfloat16)
    qt, kt, qs, ks = (x.clone().requires_grad_() for x in inp)
    kl = forkattn.stream_kl(qt, kt, qs, ks, lay, teacher_grad=True)
    kl.sum().backward()
    assert qs.grad.dtype == torch.bfloat16 and qt.grad.dtype == torch.float32
    r64 = _leaves(*inp)
    rkl, _ = ref_kl(*r64, visibility(lay, T), None)
    rkl.sum().backward()
    assert rel_err(kl.detach(), rkl.detach()) <= 1e-4
    for got, ref in zip((qt.grad, kt.grad, qs.grad, ks.grad), r64):
        assert rel_err(got, ref.grad) <= 1e-2


def test_kl_outside_mass():
    lay, T = _layout("prefix1")
    kept, km = _kept_case("both", T, seed=1)
    qt, kt, _, _ = _inputs(T, seed=2)
    om = forkattn.kl_outside_mass(qt, kt, lay, kept, temperature=1.5)
    _, rout = ref_kl(qt.double(), kt.double(), qt.double(), kt.double(), visibility(lay, T), km, tau=1.5)
    assert (om.double() - rout).abs().max().item() <= 1e-5
    assert om.min().item() >= -1e-6 and om.max().item() <= 1 + 1e-6


# --------------------------------------------------------------------------------------------
# kept-set attention


@pytest.mark.parametrize("kept_kind", [None, "lists", "block", "both"])
@pytest.mark.parametrize("layout_name", ["dense", "prefix", "tree"])
def test_kept_attention_matches_reference(layout_name, kept_kind):
    lay, T = _layout(layout_name)
    kept, km = _kept_case(kept_kind, T, seed=T + 1)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(T, 4, 16, generator=g)
    k = torch.randn(T, 2, 16, generator=g)
    v = torch.randn(T, 2, 16, generator=g)
    do = torch.randn(T, 4, 16, generator=g)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = forkattn.kept_attention(qg, kg, vg, lay, kept, return_lse=True)
    (out * do).sum().backward()
    q64, k64, v64 = _leaves(q, k, v)
    ro, rl = ref_attention(q64, k64, v64, visibility(lay, T), km, 0.25)
    (ro * do.double()).sum().backward()
    assert rel_err(out.detach(), ro.detach()) <= 1e-5
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin].double() - rl[fin]).abs().max().item() <= 1e-5
    for got, ref in ((qg.grad, q64), (kg.grad, k64), (vg.grad, v64)):
        assert rel_err(got, ref.grad) <= 1e-5
    if kept is None and layout_name == "prefix":  # the full layout: prefix_attention
        assert torch.allclose(out, forkattn.prefix_attention(q, k, v, lay), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# kept sets and kv_select


def test_kept_set_forms():
    ks = forkattn.KeptSet.from_lists([[4, 1, 2], torch.tensor([0, 7])], compressed_rows=8, query_start=3)
    assert ks.heads == 2 and ks.offsets.tolist() == [0, 3, 5] and ks.index.tolist() == [1, 2, 4, 0, 7]
    assert ks.offsets.dtype == torch.int64 and [x.tolist() for x in ks.lists()] == [[1, 2, 4], [0, 7]]
    assert torch.equal(ks.dense_mask(70), kept_dense(2, 70, [[1, 2, 4], [0, 7]], 8, 3))
    keep = torch.zeros(2, 8, dtype=torch.bool)
    keep[0, [1, 2, 4]] = True
    keep[1, [0, 7]] = True
    ks2 = forkattn.KeptSet.from_mask(keep, query_start=3)
    assert torch.equal(ks2.index, ks.index) and ks2.compressed_rows == 8
    bm = torch.tensor([[[1, 0], [1, 1]], [[0, 1], [1, 0]]], dtype=torch.bool)
    ks3 = ks.with_block_mask(bm)
    assert ks3.block_mask.dtype == torch.uint8
    assert torch.equal(ks3.dense_mask(70), kept_dense(2, 70, [[1, 2, 4], [0, 7]], 8, 3, bm.tolist()))
    assert "KeptSet(heads=2" in repr(ks3)


def test_kv_select_streaming_llm_and_h2o_reference():
    L, hq, hkv, d = 40, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, hq, d, generator=g) * 2
    k = torch.randn(L, hkv, d, generator=g)
    ks = forkattn.kv_select(q, k, "streaming_llm", budget=10, sinks=3)
    assert ks.heads == hkv and ks.compressed_rows == L and ks.query_start == L
    assert [x.tolist() for x in ks.lists()] == [[0, 1, 2] + list(range(33, 40))] * hkv
    # H2O: window most recent + heavy hitters by the causal attention mass of every query
    budget, window = 12, 4
    ks = forkattn.kv_select(q, k, "h2o", budget=budget, window=window)
    s = torch.einsum("ihd,jhd->hij", q.double(), k.double().repeat_interleave(hq // hkv, 1)) * d ** -0.5
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)  # [hq, L, L]
    mass = p.sum(1).reshape(hkv, hq // hkv, L).sum(1)  # [hkv, L]
    for h, got in enumerate(ks.lists()):
        top = torch.topk(mass[h, :L - window], budget - window).indices.sort().values.tolist()
        assert got.tolist() == top + list(range(L - window, L))
    # SnapKV: the observation window scores the earlier keys, pooled (centred sums)
    ks = forkattn.kv_select(q, k, "snapkv", budget=budget, window=window, pool_kernel=3)
    obs = p[:, L - window:, :L - window].sum(1).reshape(hkv, hq // hkv, L - window).sum(1)
    pooled = torch.nn.functional.pad(obs, (1, 1)).unfold(1, 3, 1).sum(-1)
    for h, got in enumerate(ks.lists()):
        top = torch.topk(pooled[h], budget - window).indices.sort().values.tolist()
        assert got.tolist() == top + list(range(L - window, L))
    # a sequence shorter than the budget keeps everything
    ks = forkattn.kv_select(q[:5], k[:5], "snapkv", budget=budget)
    assert ks.index.tolist() == list(range(5)) * hkv


def test_kv_select_kept_set_in_stream_kl():
    """A student whose prompt cache was compressed by H2O: responses see the kept prompt keys."""
    lay = forkattn.SharedPrefixLayout.from_lengths([30], [[12, 9]])
    T = lay.num_rows
    qt, kt, qs, ks = _inputs(T, seed=12)
    kept = forkattn.kv_select(qs[:30], ks[:30], "h2o", budget=8)
    assert kept.heads == HKV_S and kept.compressed_rows == 30 and kept.query_start == 30
    km = kept_dense(1, T, [x.tolist() for x in kept.lists()], 30, 30)
    kl, om = forkattn.stream_kl(qt, kt, qs, ks, lay, kept=kept, return_outside_mass=True)
    rkl, rout = ref_kl(qt.double(), kt.double(), qs.double(), ks.double(), visibility(lay, T), km)
    assert rel_err(kl, rkl) <= 1e-5 and (om.double() - rout).abs().max().item() <= 1e-5
    assert torch.all(om[:30] == 0) and torch.all(om[30:] > 0)


# --------------------------------------------------------------------------------------------
# errors


def test_bad_inputs_raise():
    lay, T = _layout("prefix")
    qt, kt, qs, ks = _inputs(T, seed=1)
    Inv = forkattn.ForkattnInvalidArgument
    # library checks
    with pytest.raises(Inv, match="temperature"):
        forkattn.stream_kl(qt, kt, qs, ks, lay, temperature=0.0)
    with pytest.raises(Inv, match="heads"):  # student query heads != teacher's
        forkattn.stream_kl(qt, kt, qs[:, :2], ks, lay)
    with pytest.raises(Inv, match="GQA"):
        forkattn.stream_kl(qt, kt[:, :1].expand(T, 3, DT), qs, ks, lay)
    with pytest.raises(Inv, match="rows"):  # rows vs layout
        forkattn.stream_kl(qt[:-1], kt[:-1], qs[:-1], ks[:-1], lay)
    with pytest.raises(Inv, match="strictly increasing"):
        forkattn.stream_kl(qt, kt, qs, ks, lay, kept=forkattn.KeptSet(1, [0, 2], [3, 3], 10))
    with pytest.raises(Inv, match="outside"):
        forkattn.stream_kl(qt, kt, qs, ks, lay, kept=forkattn.KeptSet(1, [0, 2], [3, 12], 10))
    with pytest.raises(Inv, match="divide"):  # 3 kept heads for 4 query heads
        forkattn.kept_attention(qt, kt, kt, lay, forkattn.KeptSet(3, [0, 0, 0, 0], [], 5))
    with pytest.raises(Inv, match="compressed_rows"):
        forkattn.stream_kl(qt, kt, qs, ks, lay, kept=forkattn.KeptSet(1, [0, 1], [0], T + 1))
    with pytest.raises(Inv, match="budget"):
        forkattn.kv_select(qs, ks, "h2o", budget=0)
    # binding checks (array sizes the library cannot check)
    with pytest.raises(Inv, match="offsets"):
        forkattn.KeptSet(2, [0, 1], [0], 5)
    with pytest.raises(Inv, match="index has"):
        forkattn.KeptSet(1, [0, 3], [0, 1], 5)
    with pytest.raises(Inv, match="monotonic"):
        forkattn.KeptSet(2, [0, 3, 1], [0, 1, 2], 5)
    with pytest.raises(Inv, match="block_mask has"):  # nb = 2 for T = 79, not 3
        forkattn.stream_kl(qt, kt, qs, ks, lay, kept=forkattn.KeptSet.from_block_mask(torch.ones(1, 3, 3, dtype=torch.uint8)))
    with pytest.raises(Inv, match="0 and 1"):
        forkattn.KeptSet.from_block_mask(torch.full((1, 2, 2), 2))
    with pytest.raises(Inv):
        forkattn.stream_kl(qt, kt, qs, ks, lay, scale_student=-1.0)
    with pytest.raises(ValueError, match="direction"):
        forkattn.stream_kl(qt, kt, qs, ks, lay, direction="sideways")
    with pytest.raises(ValueError, match="dtype"):
        forkattn.stream_kl(qt, kt, qs.double(), ks.double(), lay)
    with pytest.raises(ValueError, match="policy"):
        forkattn.kv_select(qs, ks, "lru", budget=4)
    with pytest.raises(TypeError, match="layout"):
        forkattn.stream_kl(qt, kt, qs, ks, "causal")
    with pytest.raises(TypeError, match="KeptSet"):
        forkattn.kept_attention(qt, kt, kt, lay, kept=[1, 2])


def test_binding_loads_without_the_new_symbols(monkeypatch):
    """A library without kept/StreamKL/kv_select symbols still binds; only those calls fail."""
    missing = {"forkattn_kv_select", "forkattn_kv_policy_init", "forkattn_kl_fwd", "forkattn_kl_bwd",
               "forkattn_kl_options_init", "forkattn_kept_fwd", "forkattn_kept_bwd", "forkattn_rows_mean"}
    lib = bind_without(monkeypatch, missing.__contains__)
    assert not _lib.has_symbol("forkattn_kv_select")
    lay, T = _layout("dense")
    qt, kt, qs, ks = _inputs(T, seed=0)
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_kv_") as e:
        forkattn.kv_select(qs, ks, "streaming_llm", budget=4)
    assert e.value.status == 3
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_kl_fwd"):
        forkattn.stream_kl(qt, kt, qs, ks, lay)
    forkattn.tree_attention(qs, ks, ks, forkattn.TreeLayout([0, T], [-1]))  # still works


# --------------------------------------------------------------------------------------------
# numpy API


def test_numpy_api_matches_torch():
    np = pytest.importorskip("numpy")
    from forkattn import numpy_api as fnp

    lay, T = _layout("tree")
    kept, _ = _kept_case("both", T, seed=5)
    qt, kt, qs, ks = _inputs(T, seed=6)
    tree = {"node_offsets": lay.node_offsets.numpy(), "parents": lay.parents.numpy()}
    kd = {"heads": kept.heads, "offsets": kept.offsets.numpy(), "index": kept.index.numpy(),
          "compressed_rows": kept.compressed_rows, "query_start": kept.query_start,
          "block_mask": kept.block_mask.numpy()}
    for direction in ("forward", "reverse"):
        kw = dict(direction=direction, temperature=1.3, scale_by_tau2=True)
        kl, stats, om = fnp.stream_kl(qt.numpy(), kt.numpy(), qs.numpy(), ks.numpy(), tree, kd, **kw)
        assert stats.shape == (T, HT, 4)
        tq = [x.clone().requires_grad_() for x in (qt, kt, qs, ks)]
        tkl, tom = forkattn.stream_kl(*tq, lay, kept=kept, teacher_grad=True, return_outside_mass=True, **kw)
        assert np.array_equal(kl, tkl.detach().numpy()) and np.array_equal(om, tom.numpy())
        dkl = np.random.default_rng(0).random((T, HT), dtype=np.float32)
        grads = fnp.stream_kl_backward(dkl, qt.numpy(), kt.numpy(), qs.numpy(), ks.numpy(), stats, tree, kd,
                                       teacher_grad=True, **kw)
        (tkl * torch.from_numpy(dkl)).sum().backward()
        for a, t in zip(grads, (tq[2], tq[3], tq[0], tq[1])):
            assert np.allclose(a, t.grad.numpy(), rtol=1e-6, atol=1e-7)
        g2 = fnp.stream_kl_backward(dkl, qt.numpy(), kt.numpy(), qs.numpy(), ks.numpy(), stats, tree, kept, **kw)
        assert len(g2) == 2 and np.allclose(g2[0], grads[0], rtol=1e-6, atol=1e-7)
    # kept attention (a KeptSet object works too), dense layouts as an int
    v = qs[:, :1].contiguous()
    out, lse = fnp.kept_attention(qs.numpy(), ks.numpy(), v.numpy(), tree, kd, return_lse=True)
    tout, tlse = forkattn.kept_attention(qs, ks, v, lay, kept, return_lse=True)
    assert np.allclose(out, tout.numpy(), rtol=1e-6, atol=1e-7) and np.array_equal(lse, tlse.numpy())
    do = np.ones_like(out)
    dq, dk, dv = fnp.kept_attention_backward(do, qs.numpy(), ks.numpy(), v.numpy(), out, lse, tree, kept)
    assert dq.shape == qs.shape and np.isfinite(dq).all()
    o_dense = fnp.kept_attention(qs.numpy(), ks.numpy(), v.numpy(), T)
    assert np.allclose(o_dense, forkattn.kept_attention(qs, ks, v).numpy(), rtol=1e-6, atol=1e-7)
    # prefix lengths as a dict
    pl, Tp = _layout("prefix")
    a, b, c, d = _inputs(Tp, seed=8)
    pd = {"prompt_lens": [40, 9], "response_lens": [12, 0, 7, 6, 5], "group_sizes": [3, 2]}
    kl, _, _ = fnp.stream_kl(a.numpy(), b.numpy(), c.numpy(), d.numpy(), pd)
    assert np.array_equal(kl, forkattn.stream_kl(a, b, c, d, pl).numpy())
    # kv_select and rows_mean
    sel = fnp.kv_select(qs[:30].numpy(), ks[:30].numpy(), "snapkv", budget=9, window=3)
    tsel = forkattn.kv_select(qs[:30], ks[:30], "snapkv", budget=9, window=3)
    assert sel["offsets"].tolist() == tsel.offsets.tolist() and sel["index"].tolist() == tsel.index.tolist()
    x = np.random.default_rng(1).random((T, HT), dtype=np.float32)
    w = (np.arange(T) % 3).astype(np.float32)
    assert fnp.rows_mean(x, w) == pytest.approx(float((x.astype(np.float64) * w[:, None]).sum() / (HT * w.sum())),
                                                rel=1e-12)
    assert fnp.rows_mean(x) == pytest.approx(float(x.astype(np.float64).mean()), rel=1e-12)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="weights"):
        fnp.rows_mean(x, -w)


# --------------------------------------------------------------------------------------------
# custom ops: opcheck and torch.compile


def _op_args(lay, kept, T):
    from forkattn import distill

    return distill._layout_args(lay, T) + distill._kept_args(kept)


@pytest.mark.skipif(not forkattn.ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_opcheck_kl_and_kept_ops():
    lay, T = _layout("prefix")
    kept, _ = _kept_case("both", T, seed=2)
    qt, kt, qs, ks = (x.requires_grad_() for x in _inputs(T, seed=3))
    la = _op_args(lay, kept, T)
    args = (qt, kt, qs, ks) + la + (1, 0.0, 0.0, 1.5, True)
    res = torch.library.opcheck(torch.ops.forkattn.kl_fwd.default, args)
    assert all(v == "SUCCESS" for v in res.values()), res
    kl, stats, om = torch.ops.forkattn.kl_fwd(*args)
    for tg in (True, False):
        bargs = (torch.rand(T, HT), qt.detach(), kt.detach(), qs.detach(), ks.detach(), stats.detach()) + la + (
            1, 0.0, 0.0, 1.5, True, tg)
        res = torch.library.opcheck(torch.ops.forkattn.kl_bwd.default, bargs)
        assert all(v == "SUCCESS" for v in res.values()), res
    tl, Tt = _layout("tree")
    q = torch.randn(Tt, 4, 8, requires_grad=True)
    k = torch.randn(Tt, 2, 8, requires_grad=True)
    v = torch.randn(Tt, 2, 8, requires_grad=True)
    kept_t, _ = _kept_case("lists", Tt, seed=4)
    la = _op_args(tl, kept_t, Tt)
    res = torch.library.opcheck(torch.ops.forkattn.kept_fwd.default, (q, k, v) + la + (0.4,))
    assert all(v_ == "SUCCESS" for v_ in res.values()), res
    out, lse = torch.ops.forkattn.kept_fwd(q, k, v, *la, 0.4)
    res = torch.library.opcheck(torch.ops.forkattn.kept_bwd.default,
                                (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse)
                                + la + (0.4,))
    assert all(v_ == "SUCCESS" for v_ in res.values()), res


@pytest.mark.skipif(not forkattn.ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_compile_fullgraph_distillation_loss():
    lay, T = _layout("prefix")
    kept, _ = _kept_case("both", T, seed=6)
    qt, kt, qs, ks = _inputs(T, seed=10)
    mask = (torch.arange(T) >= 40).float()
    wq = torch.randn(DS, DS, requires_grad=True)

    def loss_fn(qt, kt, qs, ks, wq):
        kl = forkattn.stream_kl(qt, kt, qs @ wq, ks, lay, kept=kept, direction="reverse", temperature=2.0,
                                scale_by_tau2=True)
        o = forkattn.kept_attention(qs @ wq, ks, ks, lay, kept)
        return (kl.mean(-1) * mask).sum() / mask.sum() + o.square().mean()

    torch._dynamo.reset()
    cf = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss = cf(qt, kt, qs, ks, wq)
    loss.backward()
    g = wq.grad.clone()
    wq.grad = None
    ref = loss_fn(qt, kt, qs, ks, wq)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(g, wq.grad, rtol=1e-6, atol=1e-7)


def test_autograd_function_fallback(monkeypatch):
    """The torch.autograd.Function versions (PyTorch without custom ops) give the same results."""
    from forkattn import ops

    lay, T = _layout("prefix1")
    kept, _ = _kept_case("both", T, seed=7)
    inp = _inputs(T, seed=13)
    res = []
    for use in (True, False):
        monkeypatch.setattr(ops, "USE_CUSTOM_OPS", use)
        qt, kt, qs, ks = (x.clone().requires_grad_() for x in inp)
        kl = forkattn.stream_kl(qt, kt, qs, ks, lay, kept=kept, teacher_grad=True)
        o = forkattn.kept_attention(qs, ks, ks, lay, kept)
        (kl.sum() + o.sum()).backward()
        res.append([kl.detach(), o.detach(), qt.grad, kt.grad, qs.grad, ks.grad])
    for a, b in zip(*res):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# CUDA (device pointers, FORKATTN_MEMORY_DEVICE): skipped without a GPU and an offload build


def _cuda_ready():
    return torch.cuda.is_available() and forkattn.build_has_offload()


@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and an offload build of libforkattn")
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_cuda_stream_kl_and_kept_attention_match_reference(direction):
    lay, T = _layout("prefix")
    kept, km = _kept_case("both", T, seed=21)
    inp = _inputs(T, seed=22)
    qt, kt, qs, ks = (x.cuda().requires_grad_() for x in inp)
    kl, om = forkattn.stream_kl(qt, kt, qs, ks, lay, kept=kept, direction=direction, temperature=2.0,
                                scale_by_tau2=True, teacher_grad=True, return_outside_mass=True)
    assert kl.is_cuda and om.is_cuda
    w = torch.rand(T, HT, dtype=torch.float64)
    (kl * w.float().cuda()).sum().backward()
    r64 = _leaves(*inp)
    rkl, rout = ref_kl(*r64, visibility(lay, T), km, direction, tau=2.0, tau2=True)
    (rkl * w).sum().backward()
    assert rel_err(kl.detach().cpu(), rkl.detach()) <= 1e-5
    assert (om.cpu().double() - rout).abs().max().item() <= 1e-5
    for got, ref in zip((qt.grad, kt.grad, qs.grad, ks.grad), r64):
        assert got.is_cuda and rel_err(got.cpu(), ref.grad) <= 1e-5
    # kept-set attention on device tensors, and kv_select staging them to the host
    v = ks.detach().clone().requires_grad_()
    q, k = qs.detach().clone().requires_grad_(), ks.detach().clone().requires_grad_()
    out, lse = forkattn.kept_attention(q, k, v, lay, kept, return_lse=True)
    (out * out).sum().backward()
    qc, kc, vc = (x.detach().cpu().requires_grad_() for x in (q, k, v))
    oc, lc = forkattn.kept_attention(qc, kc, vc, lay, kept, return_lse=True)
    (oc * oc).sum().backward()
    assert rel_err(out.detach().cpu(), oc.detach()) <= 1e-5
    fin = torch.isfinite(lc)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    for a, b in ((q, qc), (k, kc), (v, vc)):
        assert rel_err(a.grad.cpu(), b.grad) <= 1e-5
    sel = forkattn.kv_select(qs.detach()[:40], ks.detach()[:40], "h2o", budget=9)
    ref = forkattn.kv_select(inp[2][:40], inp[3][:40], "h2o", budget=9)
    assert torch.equal(sel.index, ref.index)
