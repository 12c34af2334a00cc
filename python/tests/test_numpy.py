"""forkattn.numpy_api (no PyTorch needed) against a numpy float64 reference with analytic
gradients on the replicated sequences."""

import numpy as np
import pytest

import forkattn
from forkattn import numpy_api as fnp
from conftest import abs_err, prefix_sequences, rel_err


def _attn64(q, k, v, mask, scale):
    """One sequence: q [L, Hq, d], k/v [L, Hkv, d], mask [L, L]. Returns o, lse [L, Hq], P."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    e = np.exp(s - m) * mask[None]
    den = e.sum(-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    with np.errstate(divide="ignore"):
        lse = (np.log(den) + m)[..., 0]
    o = np.einsum("hij,jhd->ihd", p, v)
    return o, lse.T, p


def _attn64_bwd(q, k, v, o, p, do, scale):
    rep = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    dvr = np.einsum("hij,ihd->jhd", p, do)
    dp = np.einsum("ihd,jhd->hij", do, vr)
    D = np.einsum("ihd,ihd->hi", do, o)[..., None]
    ds = p * (dp - D)
    dq = np.einsum("hij,jhd->ihd", ds, kr) * scale
    dkr = np.einsum("hij,ihd->jhd", ds, q) * scale
    L, hkv, d = k.shape
    return dq, dkr.reshape(L, hkv, rep, d).sum(2), dvr.reshape(L, hkv, rep, d).sum(2)


def _reference(q, k, v, do, sequences, scale, prompt_lens=None):
    """Float64 on the replicated sequences; outputs from each row's first occurrence, gradients
    of sum(out * do) summed over the copies."""
    q, k, v, do = (np.asarray(t, np.float64) for t in (q, k, v, do))
    T = q.shape[0]
    src = {}
    for n, s in enumerate(sequences):
        for pos, r in enumerate(s):
            src.setdefault(r, (n, pos))
    O = np.zeros_like(q)
    LSE = np.zeros(q.shape[:2])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for n, s in enumerate(sequences):
        L = len(s)
        if L == 0:
            continue
        idx = np.array(s)
        i, j = np.arange(L)[:, None], np.arange(L)[None, :]
        if prompt_lens is None:
            mask = j <= i
        else:
            mask = (j < prompt_lens[n]) | (i >= prompt_lens[n])
        o, lse, p = _attn64(q[idx], k[idx], v[idx], mask, scale)
        owned = np.array([src[r] == (n, pos) for pos, r in enumerate(s)])
        O[idx[owned]] = o[owned]
        LSE[idx[owned]] = lse[owned]
        g = np.where(owned[:, None, None], do[idx], 0.0)  # dout only where this copy is used
        a, b, c = _attn64_bwd(q[idx], k[idx], v[idx], o, p, g, scale)
        np.add.at(dq, idx, a)
        np.add.at(dk, idx, b)
        np.add.at(dv, idx, c)
    assert len(src) == T
    return O, LSE, dq, dk, dv


def _inputs(T, hq, hkv, d, dtype, seed):
    rng = np.random.default_rng(seed)
    q = rng.uniform(-2, 2, (T, hq, d)).astype(dtype)
    k = rng.uniform(-1, 1, (T, hkv, d)).astype(dtype)
    v = rng.uniform(-1, 1, (T, hkv, d)).astype(dtype)
    do = rng.uniform(-1, 1, (T, hq, d)).astype(dtype)
    return q, k, v, do


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 1e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_numpy_prefix_groups(dtype, tol, causal):
    P, S, R = [6, 0, 4], [2, 1, 3], [3, 0, 5, 2, 0, 1]
    T = sum(P) + sum(R)
    q, k, v, do = _inputs(T, 4, 2, 8, dtype, seed=1)
    out, lse = fnp.prefix_attention(q, k, v, P, R, S, causal=causal, return_lse=True)
    dq, dk, dv = fnp.prefix_attention_backward(do, q, k, v, out, lse, P, R, S, causal=causal)
    seqs, plens = prefix_sequences(P, S, R)
    ro, rl, rdq, rdk, rdv = _reference(q, k, v, do, seqs, 8 ** -0.5, None if causal else plens)
    assert out.dtype == dtype and lse.dtype == np.float32
    assert rel_err(out, ro) <= tol
    assert abs_err(lse, rl) <= (1e-5 if dtype == np.float32 else 1e-3)
    for g, r in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, r) <= tol


def test_numpy_single_group_strided():
    P, R = 5, [4, 2]
    T = P + sum(R)
    q, k, v, do = _inputs(T, 2, 2, 8, np.float32, seed=2)
    fused = np.concatenate([q, k, v], axis=1)  # [T, 6, d]: strided views
    out = fnp.prefix_attention(fused[:, :2], fused[:, 2:4], fused[:, 4:], P, R)
    ro = _reference(q, k, v, do, prefix_sequences([P], [2], R)[0], 8 ** -0.5)[0]
    assert rel_err(out, ro) <= 1e-5


def test_numpy_tree_and_trie():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7], [8]]
    t = fnp.trie_from_sequences(seqs)
    T = t["num_rows"]
    assert T == 8 and t["replicated_tokens"] == 13
    toks = np.concatenate([np.array(s) for s in seqs])
    assert np.array_equal(t["row_tokens"][t["input_rows"]], toks)
    q, k, v, do = _inputs(T, 2, 1, 8, np.float32, seed=3)
    out, lse = fnp.tree_attention(q, k, v, t["node_offsets"], t["parents"], return_lse=True)
    dq, dk, dv = fnp.tree_attention_backward(do, q, k, v, out, lse, t["node_offsets"], t["parents"])
    offs = t["seq_offsets"]
    paths = [t["input_rows"][offs[i]:offs[i + 1]].tolist() for i in range(len(seqs))]
    ro, rl, rdq, rdk, rdv = _reference(q, k, v, do, paths, 8 ** -0.5)
    assert rel_err(out, ro) <= 1e-5 and abs_err(lse, rl) <= 1e-5
    for g, r in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, r) <= 1e-5


def test_numpy_varlen():
    lens = [3, 0, 5, 1]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    q, k, v, do = _inputs(T, 4, 4, 8, np.float32, seed=4)
    out, lse = fnp.varlen_attention(q, k, v, cu, return_lse=True)
    assert lse.shape == (4, T)
    dq, dk, dv = fnp.varlen_attention_backward(do, q, k, v, out, lse, cu)
    seqs = [list(range(cu[i], cu[i + 1])) for i in range(len(lens))]
    ro, rl, rdq, rdk, rdv = _reference(q, k, v, do, seqs, 8 ** -0.5)
    assert rel_err(out, ro) <= 1e-5 and abs_err(lse, rl.T) <= 1e-5
    for g, r in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, r) <= 1e-5


def test_numpy_errors():
    q, k, v, _ = _inputs(7, 3, 2, 8, np.float32, seed=5)
    with pytest.raises(forkattn.ForkattnError) as e:
        fnp.prefix_attention(q, k, v, 3, [4])
    assert "GQA" in e.value.message and isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="dtype"):
        fnp.prefix_attention(q.astype(np.float64), k, v, 3, [4])
    with pytest.raises(ValueError, match="rows"):
        fnp.prefix_attention(q[:, :2], k, v, 3, [5])


# --------------------------------------------------------------------------------------------
# StreamKL and kept-set attention (numpy only): forward against a float64 numpy reference,
# backward against central finite differences of it along a random direction


def _kl64(qt, kt, qs, ks, vis, keep, reverse, tau, st, ss):
    """kl [T, H] and outside mass; vis [T, T] layout mask, keep [H, T, T] kept mask (or None)."""
    H = qt.shape[1]
    ktr, ksr = np.repeat(kt, H // kt.shape[1], 1), np.repeat(ks, H // ks.shape[1], 1)
    t = np.einsum("ihd,jhd->hij", qt, ktr) * st / tau
    s = np.einsum("ihd,jhd->hij", qs, ksr) * ss / tau
    V = np.broadcast_to(vis, t.shape)
    K = V if keep is None else V & keep

    def logsm(x, m):
        x = np.where(m, x, -1e30)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lt_full, lt, ls = logsm(t, V), logsm(t, K), logsm(s, K)
    if reverse:
        kl = np.where(K, np.exp(ls) * (ls - lt_full), 0).sum(-1)
    else:
        kl = np.where(K, np.exp(lt) * (lt - ls), 0).sum(-1)
    kl = np.where(K.any(-1), kl, 0)
    return kl.T, (1 - np.where(K, np.exp(lt_full), 0).sum(-1)).T


@pytest.mark.parametrize("reverse", [False, True])
def test_numpy_stream_kl_and_kept_attention(reverse):
    if not hasattr(forkattn.load_library(), "forkattn_kl_fwd"):
        pytest.skip("the loaded libforkattn has no StreamKL")
    rng = np.random.default_rng(3 + reverse)
    P, R = [9], [5, 0, 6]  # one group: prompt 9, responses 5, 0, 6
    T, H = 20, 4
    qt = rng.uniform(-2, 2, (T, H, 8)).astype(np.float32)
    kt = rng.uniform(-1, 1, (T, 2, 8)).astype(np.float32)
    qs = rng.uniform(-2, 2, (T, H, 4)).astype(np.float32)
    ks = rng.uniform(-1, 1, (T, 1, 4)).astype(np.float32)
    layout = {"prompt_lens": 9, "response_lens": R}
    kept = {"heads": 2, "compressed_rows": 9, "query_start": 9, "offsets": np.array([0, 3, 7]),
            "index": np.array([0, 4, 8, 1, 2, 3, 7]), "block_mask": None}
    vis = np.zeros((T, T), bool)  # prompt causal; responses see the prompt and themselves causally
    starts = np.cumsum([P[0]] + R)
    for i in range(T):
        vis[i, :min(i, P[0] - 1) + 1] = True
        for a, b in zip(starts[:-1], starts[1:]):
            if a <= i < b:
                vis[i, a:i + 1] = True
    keep = np.ones((H, T, T), bool)
    for h, idx in ((0, [0, 4, 8]), (1, [1, 2, 3, 7])):
        drop = np.setdiff1d(np.arange(9), idx)
        for hq in (2 * h, 2 * h + 1):
            keep[hq, 9:, drop] = False
    kw = dict(direction="reverse" if reverse else "forward", temperature=1.5, scale_by_tau2=True)
    kl, stats, outside = fnp.stream_kl(qt, kt, qs, ks, layout, kept, **kw)
    args64 = [x.astype(np.float64) for x in (qt, kt, qs, ks)]
    ref, rout = _kl64(*args64, vis, keep, reverse, 1.5, 8 ** -0.5, 0.5)
    assert rel_err(kl, ref * 2.25) <= 1e-5 and abs_err(outside, rout) <= 1e-5
    assert np.all(outside[:9] == 0)
    dkl = rng.uniform(0, 1, (T, H)).astype(np.float32)
    dq_s, dk_s, dq_t, dk_t = fnp.stream_kl_backward(dkl, qt, kt, qs, ks, stats, layout, kept, teacher_grad=True,
                                                    **kw)
    dirs = [rng.standard_normal(x.shape) for x in args64]
    eps = 1e-5

    def f(sign):
        xs = [x + sign * eps * d for x, d in zip(args64, dirs)]
        return (_kl64(*xs, vis, keep, reverse, 1.5, 8 ** -0.5, 0.5)[0] * 2.25 * dkl).sum()

    fd = (f(1) - f(-1)) / (2 * eps)
    an = sum((g.astype(np.float64) * d).sum() for g, d in zip((dq_t, dk_t, dq_s, dk_s), dirs))
    assert abs(an - fd) <= 1e-4 * max(1.0, abs(fd))
    # kept-set attention: the same masks, numpy reference
    v = rng.uniform(-1, 1, (T, 1, 4)).astype(np.float32)
    out, lse = fnp.kept_attention(qs, ks, v, layout, kept, return_lse=True)
    s = np.einsum("ihd,jhd->hij", qs.astype(np.float64), np.repeat(ks, H, 1).astype(np.float64)) * 0.5
    m = vis[None] & keep
    p = np.exp(np.where(m, s, -1e30) - np.where(m, s, -1e30).max(-1, keepdims=True)) * m
    ro = np.einsum("hij,jhd->ihd", p / p.sum(-1, keepdims=True), np.repeat(v, H, 1).astype(np.float64))
    assert rel_err(out, ro) <= 1e-5
    dq, dk, dv = fnp.kept_attention_backward(np.ones_like(out), qs, ks, v, out, lse, layout, kept)
    assert dq.shape == qs.shape and dk.shape == ks.shape and np.isfinite(dv).all()
    sel = fnp.kv_select(qs[:9], ks[:9], "streaming_llm", budget=5, sinks=2)
    assert sel["heads"] == 1 and sel["index"].tolist() == [0, 1, 6, 7, 8] and sel["query_start"] == 9
    assert fnp.rows_mean(kl) == pytest.approx(float(kl.astype(np.float64).mean()), rel=1e-12)
