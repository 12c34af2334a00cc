"""forkattn.numpy_api (no PyTorch needed) against a numpy float64 reference with analytic
gradients on the replicated sequences."""

import numpy as np
import pytest

import forkattn
from forkattn import numpy_api as fnp
from conftest import abs_err, rel_err


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


def _prefix_seqs(P, S, R):
    seqs, plens, row, r = [], [], 0, 0
    for p, n in zip(P, S):
        prompt = list(range(row, row + p))
        row += p
        seqs.append(prompt)
        plens.append(p)
        for _ in range(n):
            seqs.append(prompt + list(range(row, row + R[r])))
            plens.append(p)
            row += R[r]
            r += 1
    return seqs, plens


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 1e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_numpy_prefix_groups(dtype, tol, causal):
    P, S, R = [6, 0, 4], [2, 1, 3], [3, 0, 5, 2, 0, 1]
    T = sum(P) + sum(R)
    q, k, v, do = _inputs(T, 4, 2, 8, dtype, seed=1)
    out, lse = fnp.prefix_attention(q, k, v, P, R, S, causal=causal, return_lse=True)
    dq, dk, dv = fnp.prefix_attention_backward(do, q, k, v, out, lse, P, R, S, causal=causal)
    seqs, plens = _prefix_seqs(P, S, R)
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
    ro = _reference(q, k, v, do, _prefix_seqs([P], [2], R)[0], 8 ** -0.5)[0]
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
