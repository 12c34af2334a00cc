"""The shared-prefix KV cache for diffusion LMs (forkattn.dlm_cache): cached-prefix attention
against prefix_attention on the full rows and a float64 reference (outputs, lse, gradients; torch
op, autograd.Function, numpy), opcheck, the cache (longest prefix, LRU, holding, stats, views),
K/V similarity against float64, the reuse-depth profile, errors, a library without the symbols,
a run without torch, and CUDA (skipped without a GPU and an offload build)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from forkattn import _lib, dlm_cache, ops  # noqa: E402
from conftest import TOL, abs_err, bind_without, make_qkv, rel_err, run_without_torch  # noqa: E402

pytestmark = pytest.mark.skipif(not _lib.has_symbol("forkattn_prefix_cached_fwd")
                                or not _lib.has_symbol("forkattn_kv_cache_create"),
                                reason="the loaded libforkattn has no diffusion-LM KV cache")

HQ, HKV, D = 4, 2, 16
P, RESP = 9, [4, 0, 7, 1]  # a zero-length and a one-token response


def _layout(P=P, resp=RESP):
    return forkattn.SharedPrefixLayout.from_lengths([P], [resp])


# --------------------------------------------------------------------------------------------
# cached-prefix attention


def _reference(q, k, v, P, resp, scale, causal, block=0):
    """float64 attention of the response rows q [R, Hq, d] against k/v [P + R, Hkv, d]; block > 0:
    block-causal (row i of a response sees the response's keys up to the end of i's block)."""
    R = sum(resp)
    mask = torch.zeros(R, P + R, dtype=torch.bool)  # [query row, key row]
    mask[:, :P] = True
    start = 0
    for n in resp:
        for i in range(start, start + n):
            if block:
                last = P + min(start + n, start + ((i - start) // block + 1) * block)
            else:
                last = P + (i + 1 if causal else start + n)
            mask[i, P + start:last] = True
        start += n
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)
    return o, lse.t()


def _run_cached(q, k, v, do, lay, causal, use_ops=True, scale=None, block_size=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    prev = ops.USE_CUSTOM_OPS
    ops.USE_CUSTOM_OPS = use_ops
    try:
        out, lse = forkattn.prefix_cached_attention(q, k, v, lay, scale=scale, causal=causal, return_lse=True,
                                                    block_size=block_size)
        (out * do).sum().backward()
    finally:
        ops.USE_CUSTOM_OPS = prev
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32 and not lse.requires_grad
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_cached_matches_prefix_attention_on_full_rows(dtype, causal):
    """Response rows of prefix_attention on [prompt ; responses] = the cached call; gradients
    with the prompt rows' dout = 0 match too (dk/dv of every row, dq of the response rows)."""
    lay = _layout()
    T = lay.num_rows
    q, k, v, do = make_qkv(T, HQ, HKV, D, dtype, seed=3 + causal)
    do[:P] = 0
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    full, flse = forkattn.prefix_attention(qf, kf, vf, lay, causal=causal, return_lse=True)
    (full * do).sum().backward()
    o, lse, dq, dk, dv = _run_cached(q[P:], k, v, do[P:], lay, causal)
    tol = TOL[str(dtype).replace("torch.", "")]
    assert rel_err(o, full[P:].detach()) <= tol["o"]
    assert abs_err(lse, flse[P:]) <= tol["lse"]
    assert rel_err(dq, qf.grad[P:]) <= tol["grad"]
    assert rel_err(dk, kf.grad) <= tol["grad"] and rel_err(dv, vf.grad) <= tol["grad"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_ops", [True, False])
def test_cached_matches_float64_reference(causal, use_ops):
    lay = _layout()
    R = sum(RESP)
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=21)
    q, do = q[P:].contiguous(), do[P:].contiguous()
    scale = 0.37
    o, lse, dq, dk, dv = _run_cached(q, k, v, do, lay, causal, use_ops=use_ops, scale=scale)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = _reference(q64, k64, v64, P, RESP, scale, causal)
    (ro * do.double()).sum().backward()
    assert o.shape == (R, HQ, D)
    assert rel_err(o, ro.detach()) <= 1e-5 and abs_err(lse, rl.detach()) <= 1e-5
    for g, r in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert rel_err(g, r) <= 1e-5


def test_cached_default_scale_empty_responses_and_strided_views():
    """Default scale 1/sqrt(d); a group without response rows (dk = dv = 0); strided q/k/v views."""
    lay = _layout(5, [0, 0])
    q = torch.zeros(0, HQ, D, requires_grad=True)
    k = torch.randn(5, HKV, D, requires_grad=True)
    v = torch.randn(5, HKV, D, requires_grad=True)
    out = forkattn.prefix_cached_attention(q, k, v, lay)
    assert out.shape == (0, HQ, D)
    (out.sum() + 0 * k.sum()).backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))

    lay = _layout(6, [3, 5])
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(lay.num_rows, HQ + 2 * HKV, D, generator=g)
    q, k, v = qkv[6:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    got = forkattn.prefix_cached_attention(q, k, v, lay)
    ref, _ = _reference(q.double(), k.double(), v.double(), 6, [3, 5], D ** -0.5, False)
    assert rel_err(got, ref) <= 1e-5
    assert torch.equal(got, forkattn.prefix_cached_attention(q, k, v, lay, softmax_scale=D ** -0.5))


@pytest.mark.parametrize("causal", [False, True])
def test_cached_numpy_matches_torch(causal):
    lay = _layout()
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=8)
    q, do = q[P:].contiguous(), do[P:].contiguous()
    o, lse, dq, dk, dv = _run_cached(q, k, v, do, lay, causal)
    qn, kn, vn, dn = (t.numpy() for t in (q, k, v, do))
    on, ln = dlm_cache.prefix_cached_attention_numpy(qn, kn, vn, P, RESP, causal=causal, return_lse=True)
    assert isinstance(on, np.ndarray) and on.dtype == np.float32 and ln.shape == (sum(RESP), HQ)
    assert np.array_equal(on, o.numpy()) and np.array_equal(ln, lse.numpy())
    g = dlm_cache.prefix_cached_attention_backward_numpy(dn, qn, kn, vn, on, ln, P, RESP, causal=causal)
    for a, b in zip(g, (dq, dk, dv)):
        assert np.array_equal(a, b.numpy())
    h = dlm_cache.prefix_cached_attention_numpy(qn.astype(np.float16), kn.astype(np.float16), vn.astype(np.float16),
                                                P, RESP, causal=causal)
    assert h.dtype == np.float16 and rel_err(h, o.numpy()) <= 1e-2


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_opcheck_prefix_cached_ops():
    lay = _layout(5, [3, 2])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(10, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(10, 2, 8, generator=g, requires_grad=True)
    for causal in (False, True):
        args = (q, k, v, lay.prompt_lens, lay.response_lens, 0.3, causal)
        res = torch.library.opcheck(torch.ops.forkattn.prefix_cached_fwd.default, args)
        assert all(x == "SUCCESS" for x in res.values()), res
    out, lse = torch.ops.forkattn.prefix_cached_fwd(q, k, v, lay.prompt_lens, lay.response_lens, 0.3, False)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, lay.prompt_lens,
             lay.response_lens, 0.3, False)
    res = torch.library.opcheck(torch.ops.forkattn.prefix_cached_bwd.default, bargs)
    assert all(x == "SUCCESS" for x in res.values()), res


def test_cached_attention_errors():
    lay = _layout()
    R = sum(RESP)
    q, k, v = torch.randn(R, HQ, D), torch.randn(P + R, HKV, D), torch.randn(P + R, HKV, D)
    with pytest.raises(TypeError, match="SharedPrefixLayout"):
        forkattn.prefix_cached_attention(q, k, v, "layout")
    two = forkattn.SharedPrefixLayout.from_lengths([2, 3], [[1], [2]])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="one group"):
        forkattn.prefix_cached_attention(q, k, v, two)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="responses' rows only"):
        forkattn.prefix_cached_attention(torch.randn(P + R, HQ, D), k, v, lay)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="k has"):
        forkattn.prefix_cached_attention(q, k[1:], v, lay)
    with pytest.raises(ValueError, match="dtype"):
        forkattn.prefix_cached_attention(q.double(), k.double(), v.double(), lay)
    with pytest.raises(forkattn.ForkattnInvalidArgument):  # GQA: 4 query heads on 3 KV heads
        forkattn.prefix_cached_attention(q, torch.randn(P + R, 3, D), torch.randn(P + R, 3, D), lay)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="scale"):
        forkattn.prefix_cached_attention(q, k, v, lay, scale=-1.0)
    with pytest.raises(TypeError, match="not both"):
        forkattn.prefix_cached_attention(q, k, v, lay, scale=0.1, softmax_scale=0.1)
    with pytest.raises(forkattn.ForkattnInvalidArgument):  # numpy: k rows do not match the layout
        dlm_cache.prefix_cached_attention_numpy(q.numpy(), k[1:].numpy(), v[1:].numpy(), P, RESP)


# --------------------------------------------------------------------------------------------
# block-causal cached-prefix attention (block diffusion LMs)

needs_block = pytest.mark.skipif(not _lib.has_symbol("forkattn_prefix_cached_block_fwd"),
                                 reason="the loaded libforkattn has no block-causal cached attention")
BRESP = [7, 0, 5, 1, 10]  # none a multiple of the block sizes below (but 10 of 5), an empty response


def _float64_grads(q, k, v, do, P, resp, scale, causal=False, block=0):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = _reference(q64, k64, v64, P, resp, scale, causal, block)
    (ro * do.double()).sum().backward()
    return ro.detach(), rl.detach(), q64.grad, k64.grad, v64.grad


@needs_block
@pytest.mark.parametrize("prompt", [0, 6])
@pytest.mark.parametrize("block", [2, 3, 5])
@pytest.mark.parametrize("use_ops", [True, False])
def test_block_causal_matches_float64_reference(prompt, block, use_ops):
    lay = _layout(prompt, BRESP)
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=40 + block + prompt)
    q, do = q[prompt:].contiguous(), do[prompt:].contiguous()
    got = _run_cached(q, k, v, do, lay, False, use_ops=use_ops, scale=0.29, block_size=block)
    ref = _float64_grads(q, k, v, do, prompt, BRESP, 0.29, block=block)
    assert rel_err(got[0], ref[0]) <= 1e-5 and abs_err(got[1], ref[1]) <= 1e-5
    for g, r in zip(got[2:], ref[2:]):
        assert rel_err(g, r) <= 1e-5
    # the mask really differs from both non-block masks
    for causal in (False, True):
        other, _ = _reference(q.double(), k.double(), v.double(), prompt, BRESP, 0.29, causal)
        assert rel_err(got[0], other) > 1e-3


@needs_block
@pytest.mark.parametrize("prompt", [0, 6])
def test_block_one_is_causal_and_large_block_is_bidirectional(prompt):
    lay = _layout(prompt, BRESP)
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=60 + prompt)
    q, do = q[prompt:].contiguous(), do[prompt:].contiguous()
    for block, causal in ((1, True), (max(BRESP), False), (1000, False)):
        got = _run_cached(q, k, v, do, lay, False, block_size=block)
        want = _run_cached(q, k, v, do, lay, causal)
        for a, b in zip(got, want):
            assert rel_err(a, b) <= 1e-6
        ref = _float64_grads(q, k, v, do, prompt, BRESP, D ** -0.5, causal=causal)
        for g, r in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
            assert rel_err(g, r) <= 1e-5
    # None and 0 are the plain masks
    for b in (None, 0):
        for causal in (False, True):
            a = _run_cached(q, k, v, do, lay, causal, block_size=b)
            w = _run_cached(q, k, v, do, lay, causal)
            assert all(torch.equal(x, y) for x, y in zip(a, w))


@needs_block
def test_block_causal_bfloat16_and_numpy():
    lay = _layout(4, BRESP)
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=77)
    q, do = q[4:].contiguous(), do[4:].contiguous()
    o, lse, dq, dk, dv = _run_cached(q, k, v, do, lay, False, block_size=3)
    qn, kn, vn, dn = (t.numpy() for t in (q, k, v, do))
    on, ln = dlm_cache.prefix_cached_attention_numpy(qn, kn, vn, 4, BRESP, return_lse=True, block_size=3)
    assert np.array_equal(on, o.numpy()) and np.array_equal(ln, lse.numpy())
    g = dlm_cache.prefix_cached_attention_backward_numpy(dn, qn, kn, vn, on, ln, 4, BRESP, block_size=3)
    for a, b in zip(g, (dq, dk, dv)):
        assert np.array_equal(a, b.numpy())
    plain = dlm_cache.prefix_cached_attention_numpy(qn, kn, vn, 4, BRESP, block_size=0)
    assert np.array_equal(plain, dlm_cache.prefix_cached_attention_numpy(qn, kn, vn, 4, BRESP))
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.bfloat16, seed=78)
    q, do = q[4:].contiguous(), do[4:].contiguous()
    bf = _run_cached(q, k, v, do, lay, False, block_size=3)
    ref = _float64_grads(q, k, v, do, 4, BRESP, D ** -0.5, block=3)
    tol = TOL["bfloat16"]
    assert bf[0].dtype == torch.bfloat16
    assert rel_err(bf[0], ref[0]) <= tol["o"] and abs_err(bf[1], ref[1]) <= tol["lse"]
    for a, b in zip(bf[2:], ref[2:]):
        assert rel_err(a, b) <= tol["grad"]


@needs_block
@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_opcheck_block_causal_ops():
    lay = _layout(5, [3, 4])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(7, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(12, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(12, 2, 8, generator=g, requires_grad=True)
    for block in (1, 2, 5):
        args = (q, k, v, lay.prompt_lens, lay.response_lens, 0.3, False, block)
        res = torch.library.opcheck(torch.ops.forkattn.prefix_cached_fwd.default, args)
        assert all(x == "SUCCESS" for x in res.values()), res
    out, lse = torch.ops.forkattn.prefix_cached_fwd(q, k, v, lay.prompt_lens, lay.response_lens, 0.3, False, 2)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, lay.prompt_lens,
             lay.response_lens, 0.3, False, 2)
    res = torch.library.opcheck(torch.ops.forkattn.prefix_cached_bwd.default, bargs)
    assert all(x == "SUCCESS" for x in res.values()), res


@needs_block
def test_block_causal_errors():
    lay = _layout(P, BRESP)
    R = sum(BRESP)
    q, k, v = torch.randn(R, HQ, D), torch.randn(P + R, HKV, D), torch.randn(P + R, HKV, D)
    for bad in (-1, -5):
        with pytest.raises(forkattn.ForkattnInvalidArgument, match="block_size"):
            forkattn.prefix_cached_attention(q, k, v, lay, block_size=bad)
        with pytest.raises(forkattn.ForkattnInvalidArgument, match="block_size"):
            dlm_cache.prefix_cached_attention_numpy(q.numpy(), k.numpy(), v.numpy(), P, BRESP, block_size=bad)
        with pytest.raises(forkattn.ForkattnInvalidArgument, match="block_size"):
            dlm_cache.prefix_cached_attention_backward_numpy(q.numpy(), q.numpy(), k.numpy(), v.numpy(), q.numpy(),
                                                             np.zeros((R, HQ), np.float32), P, BRESP, block_size=bad)
    for bad in (1.5, "2", True):
        with pytest.raises(TypeError, match="block_size"):
            forkattn.prefix_cached_attention(q, k, v, lay, block_size=bad)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="causal"):
        forkattn.prefix_cached_attention(q, k, v, lay, block_size=2, causal=True)
    # the C functions themselves refuse block sizes < 1 (0 and negative), in the op and the library
    for bad in (0, -3):
        with pytest.raises(forkattn.ForkattnInvalidArgument, match="block_size"):
            _raw_block_fwd(q, k, v, lay, bad)
    if ops.HAVE_CUSTOM_OPS:
        with pytest.raises(forkattn.ForkattnInvalidArgument, match="block_size"):
            torch.ops.forkattn.prefix_cached_fwd(q, k, v, lay.prompt_lens, lay.response_lens, 0.5, False, -2)


def _raw_block_fwd(q, k, v, lay, block):
    """forkattn_prefix_cached_block_fwd called directly with ``block``."""
    from forkattn.numpy_api import _ctx, _desc

    out = np.empty_like(q.numpy())
    (_, qd), (_, kd), (_, vd), (_, od) = _desc(q.numpy()), _desc(k.numpy()), _desc(v.numpy()), _desc(out)
    _lib.prefix_cached_fwd(_ctx(None), int(lay.prompt_lens[0]), [int(x) for x in lay.response_lens], False,
                           qd, kd, vd, od, None, 0.5, _lib.MEMORY_HOST, block)


# --------------------------------------------------------------------------------------------
# the cache

L, KVH, HD = 3, 2, 8


def _kv(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(n, KVH, HD, generator=g).to(dtype) for _ in range(L)]
    v = [torch.randn(n, KVH, HD, generator=g).to(dtype) for _ in range(L)]
    return k, v


def test_cache_longest_prefix_hit_and_views():
    with forkattn.KVCache(1 << 20, L, KVH, HD, torch.float32, block_tokens=4) as cache:
        short, long_ = list(range(100, 103)), list(range(100, 110))
        ks, vs = _kv(3, seed=1)
        kl, vl = _kv(10, seed=2)
        assert cache.insert(short, ks, vs) and cache.insert(torch.tensor(long_), kl, vl)
        # the longest cached prefix of the request, compared exactly
        with cache.lookup(long_ + [7, 8]) as e:
            assert e and e.held and e.matched == 10
            for layer in range(L):
                kk, vv = e.k(layer), e.v(layer)
                assert kk.shape == (10, KVH, HD) and kk.dtype == torch.float32
                assert torch.equal(kk, kl[layer]) and torch.equal(vv, vl[layer])
        assert not e.held
        with pytest.raises(ValueError, match="released"):
            e.k(0)
        with cache.lookup(np.array(long_[:7] + [0, 1], dtype=np.int64)) as e:  # diverges at 7: the short entry
            assert e.matched == 3 and torch.equal(e.v(2), vs[2])
            kept = e.k(1, copy=True)
        assert torch.equal(kept, ks[1])  # a copy outlives the hold
        for miss in ([100, 101], [], [5] + long_):  # a shorter request is never served by a longer entry
            e = cache.lookup(miss)
            assert not e and e.matched == 0 and not e.held
            with pytest.raises(forkattn.ForkattnInvalidArgument, match="miss"):
                e.k(0)
            e.release()
        s = cache.stats()
        assert (s["hits"], s["misses"], s["insertions"], s["entries"]) == (2, 3, 2, 2)
        assert s["bytes"] == cache.entry_bytes(3) + cache.entry_bytes(10) and s["evictions"] == s["rejected"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_stores_bits_of_half_types_and_strided_inputs(dtype):
    cache = forkattn.KVCache(1 << 16, L, KVH, HD, dtype)
    assert cache.array == "torch" and cache.dtype == str(dtype).replace("torch.", "")
    big = torch.randn(L, 6, KVH + 1, HD).to(dtype)
    k = big[:, :, 1:]  # strided [layers, n, heads, d] view
    v = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in k]  # head-major layers
    assert cache.insert([1, 2, 3, 4, 5, 6], k, v)
    with cache.lookup([1, 2, 3, 4, 5, 6]) as e:
        for layer in range(L):
            assert e.k(layer).dtype == dtype
            assert torch.equal(e.k(layer), k[layer]) and torch.equal(e.v(layer), k[layer])
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        cache.stats()


def test_cache_numpy_arrays():
    cache = forkattn.KVCache(1 << 16, L, KVH, HD, np.float16)
    assert cache.array == "numpy"
    k = np.random.default_rng(0).standard_normal((L, 4, KVH, HD)).astype(np.float16)
    assert cache.insert(np.array([7, 8, 9, 10], dtype=np.int32), k, k[::-1])
    with cache.lookup([7, 8, 9, 10, 11]) as e:
        x = e.k(0)
        assert isinstance(x, np.ndarray) and x.dtype == np.float16 and not x.flags.writeable
        assert np.array_equal(x, k[0]) and np.array_equal(e.v(0), k[L - 1])
    cache.close()


def test_cache_lru_eviction_holding_and_stats():
    cache = forkattn.KVCache(2 * 2 * L * 4 * KVH * HD * 4, L, KVH, HD, "float32")  # room for two 4-token entries
    assert cache.entry_bytes(4) * 2 == cache.capacity_bytes
    A, B, C, Dt = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]
    for i, t in enumerate((A, B)):
        assert cache.insert(t, *_kv(4, seed=i))
    cache.lookup(A).release()  # A becomes the most recently used: B is the LRU entry
    assert cache.insert(C, *_kv(4, seed=2))
    s = cache.stats()
    assert s["evictions"] == 1 and s["entries"] == 2 and s["bytes"] == cache.capacity_bytes
    assert not cache.lookup(B) and cache.lookup(C).matched == 4
    # a held entry is out of eviction's reach: holding A, inserting D evicts C
    held = cache.lookup(A)
    kA = held.k(0).clone()
    assert cache.insert(Dt, *_kv(4, seed=3))
    assert not cache.lookup(C) and torch.equal(held.k(0), kA)
    assert cache.held == 1
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="still held"):
        cache.close()
    # refresh of a held prefix keeps the old K/V for the holder
    assert cache.insert(A, *_kv(4, seed=9))
    assert torch.equal(held.k(0), kA)
    # rejected: larger than the capacity, or room only by evicting held entries
    assert not cache.insert(list(range(9)), *_kv(9))
    other = cache.lookup(Dt)
    assert not cache.insert([5, 5, 5, 5], *_kv(4, seed=4))
    s = cache.stats()
    assert s["rejected"] == 2 and s["entries"] == 2
    assert (s["hits"], s["misses"], s["insertions"], s["evictions"]) == (4, 2, 5, 2)
    other.release()
    held.release()
    held.release()  # idempotent
    with cache.lookup(A) as e:  # the refresh while held kept the holder's K/V
        assert torch.equal(e.k(0), kA)
    cache.close()


def test_cache_errors():
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="capacity"):
        forkattn.KVCache(0, L, KVH, HD, "float32")
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="layers"):
        forkattn.KVCache(1024, 0, KVH, HD, "float32")
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="head_dim"):
        forkattn.KVCache(1024, L, KVH, 300, "float32")  # the C library's check
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="dtype"):
        forkattn.KVCache(1024, L, KVH, HD, torch.float64)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="device"):
        forkattn.KVCache(1024, L, KVH, HD, "float32", device="tpu")
    with pytest.raises(ValueError, match="array"):
        forkattn.KVCache(1024, L, KVH, HD, "float32", array="jax")
    cache = forkattn.KVCache(1 << 16, L, KVH, HD, "float32")
    k, v = _kv(4)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="layers"):
        cache.insert([1, 2, 3, 4], k[:2], v)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="dtype"):  # the C library's check
        cache.insert([1, 2, 3, 4], [x.half() for x in k], v)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="rows"):  # 4 rows, 3 tokens
        cache.insert([1, 2, 3], k, v)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="n >= 1"):
        cache.insert([], [x[:0] for x in k], [x[:0] for x in v])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="dtype"):
        cache.insert([1, 2, 3, 4], [x.double() for x in k], v)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="int32"):
        cache.insert([1, 2, 3, 1 << 40], k, v)
    with pytest.raises(TypeError, match="int"):
        cache.lookup([1.5, 2])
    with pytest.raises(TypeError, match="integers"):
        cache.lookup(torch.tensor([1.0, 2.0]))
    with pytest.raises(forkattn.ForkattnInvalidArgument, match=r"\[n, kv_heads, head_dim\]"):
        cache.insert([1, 2, 3, 4], torch.zeros(4, KVH, HD), v)
    assert cache.insert([1, 2, 3, 4], k, v)
    with cache.lookup([1, 2, 3, 4]) as e:
        with pytest.raises(forkattn.ForkattnInvalidArgument, match="layer"):
            e.k(L)
    s = cache.stats()
    assert s["insertions"] == 1 and s["rejected"] == 0  # failed calls changed nothing
    cache.close()


def test_cache_force_close_releases_held_entries():
    cache = forkattn.KVCache(1 << 16, L, KVH, HD, "float32")
    cache.insert([1, 2], *_kv(2))
    e = cache.lookup([1, 2, 3])
    assert e.held
    cache.close(force=True)
    assert not e.held
    with pytest.raises(ValueError, match="released"):
        e.v(0)
    e.release()


# --------------------------------------------------------------------------------------------
# similarity


def _sim64(a, b):
    a, b = a.double(), b.double()
    dot = (a * b).sum(-1)
    na, nb = (a * a).sum(-1).sqrt(), (b * b).sum(-1).sqrt()
    cos = (dot / (na * nb)).clamp(-1, 1)
    both0, one0 = (na == 0) & (nb == 0), (na == 0) | (nb == 0)
    cos = torch.where(both0, torch.ones_like(cos), torch.where(one0, torch.zeros_like(cos), cos))
    per = cos.mean(0)
    return per, per.mean().item()


def test_kv_similarity_matches_float64():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(37, 3, 24, generator=g)
    b = a + 0.5 * torch.randn(37, 3, 24, generator=g)
    a[3, 1] = 0  # one side zero: 0
    a[5, 2] = 0
    b[5, 2] = 0  # both zero: 1
    b[7, 0] = -a[7, 0]
    per, mean = forkattn.kv_similarity(a, b)
    rp, rm = _sim64(a, b)
    assert per.dtype == torch.float32 and per.shape == (3,)
    assert (per.double() - rp).abs().max() <= 1e-6 and abs(mean - rm) <= 1e-6
    # mixed dtypes, strided views, numpy
    bb = b.bfloat16()
    per2, mean2 = forkattn.kv_similarity(a, bb)
    rp2, rm2 = _sim64(a, bb.float())
    assert (per2.double() - rp2).abs().max() <= 1e-6 and abs(mean2 - rm2) <= 1e-6
    pn, mn = forkattn.kv_similarity(a.numpy(), b.numpy().astype(np.float16))
    rp3, rm3 = _sim64(a, torch.from_numpy(b.numpy().astype(np.float16)).float())
    assert isinstance(pn, np.ndarray) and pn.dtype == np.float32
    assert np.abs(pn - rp3.numpy()).max() <= 1e-6 and abs(mn - rm3) <= 1e-6
    x = torch.randn(9, 4, 8)
    per, mean = forkattn.kv_similarity(x[:, ::2], x[:, ::2].clone())  # strided, identical: exactly 1
    assert torch.equal(per, torch.ones(2)) and mean == 1.0
    per, mean = forkattn.kv_similarity(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))
    assert torch.equal(per, torch.ones(2))
    with pytest.raises(forkattn.ForkattnInvalidArgument):
        forkattn.kv_similarity(x, x[:, :2])
    with pytest.raises(TypeError):
        forkattn.kv_similarity([1.0], x)


# --------------------------------------------------------------------------------------------
# reuse-depth profile


def test_profile_depths_monotone_and_doc_example(tmp_path):
    p = forkattn.ReuseProfile(8, 0.9)
    assert p.depth(0.5) == 0  # empty
    for r, raw in ((0.20, 4), (0.40, 6), (0.60, 2), (0.80, 5)):
        p.add(r, [0.99] * raw + [0.5] + [0.99] * (7 - raw))
    assert [p.depth(r) for r in (0.0, 0.19, 0.2, 0.5, 0.79, 0.8, 1.0)] == [0, 0, 2, 2, 2, 5, 5]
    rng = np.random.default_rng(0)
    q = forkattn.ReuseProfile(6, 0.95)
    for _ in range(60):
        r = float(rng.uniform())
        sims = np.clip(1 - rng.uniform(0, 0.1, 6) * np.arange(1, 7) * (1.2 - r), -1, 1).astype(np.float32)
        q.add(r, sims if rng.uniform() < 0.5 else torch.from_numpy(sims))
    depths = [q.depth(i / 100) for i in range(101)]
    assert all(0 <= d <= 6 for d in depths) and depths == sorted(depths)
    # bins average their measurements: two adds of 1.0 and 0.8 -> 0.9 >= 0.9
    a = forkattn.ReuseProfile(1, 0.9)
    a.add(0.3, [1.0])
    a.add(0.3, [0.8])
    assert a.depth(0.3) == 1
    a.add(0.3, [0.0])
    assert a.depth(0.3) == 0
    # save / load round trip: same depths, same file
    f1, f2 = tmp_path / "p.txt", str(tmp_path / "q.txt")
    q.save(f1)
    with forkattn.ReuseProfile.load(f1) as back:
        assert back.layers == 6 and abs(back.threshold - 0.95) < 1e-6
        assert [back.depth(i / 100) for i in range(101)] == depths
        back.save(f2)
        back.add(0.5, [1.0] * 6)  # later adds work on a loaded profile
    assert open(f1).read() == open(f2).read()
    assert open(f1).read().startswith("forkattn-reuse-profile 1\nlayers 6\n")
    q.close()
    q.close()
    with pytest.raises(ValueError, match="closed"):
        q.depth(0.5)


def test_profile_errors(tmp_path):
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="layers"):
        forkattn.ReuseProfile(0)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="threshold"):
        forkattn.ReuseProfile(2, 1.5)
    p = forkattn.ReuseProfile(2, 0.9)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="ratio"):
        p.add(1.5, [1.0, 1.0])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="sims"):
        p.add(0.5, [1.0])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="sim"):
        p.add(0.5, [1.0, 2.0])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="ratio"):
        p.depth(float("nan"))
    assert p.depth(0.5) == 0  # failed adds changed nothing
    with pytest.raises(forkattn.ForkattnInvalidArgument):
        p.save(tmp_path / "no" / "such" / "dir" / "p.txt")
    bad = tmp_path / "bad.txt"
    bad.write_text("forkattn-reuse-profile 1\nlayers 2\nthreshold 0.9\nbins 1\n50 1 0.5\nend\n")  # one mean short
    with pytest.raises(forkattn.ForkattnInvalidArgument):
        forkattn.ReuseProfile.load(bad)
    with pytest.raises(forkattn.ForkattnInvalidArgument):
        forkattn.ReuseProfile.load(tmp_path / "missing.txt")


# --------------------------------------------------------------------------------------------
# library without the symbols, no torch, CUDA


def test_binding_without_the_symbols(monkeypatch):
    bind_without(monkeypatch, lambda name: name.startswith((
        "forkattn_prefix_cached_", "forkattn_kv_cache_", "forkattn_kv_entry_", "forkattn_kv_similarity",
        "forkattn_reuse_profile_")))
    lay = _layout(2, [1])
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_prefix_cached_fwd") as e:
        forkattn.prefix_cached_attention(torch.randn(1, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4), lay)
    assert e.value.status == 3
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_kv_cache_create"):
        forkattn.KVCache(1024, 1, 1, 4, "float32")
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_kv_similarity"):
        forkattn.kv_similarity(torch.ones(2, 1, 4), torch.ones(2, 1, 4))
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_reuse_profile_create"):
        forkattn.ReuseProfile(2)
    forkattn.prefix_attention(torch.randn(3, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4), lay)  # still works


def test_binding_without_the_block_functions(monkeypatch):
    """An older library with the cached-prefix functions but not the block-causal ones: only
    block_size fails (status 3)."""
    bind_without(monkeypatch, lambda name: name.startswith("forkattn_prefix_cached_block_"))
    lay = _layout(2, [3])
    q, k, v = torch.randn(3, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    for use_ops in (True, False):
        monkeypatch.setattr(ops, "USE_CUSTOM_OPS", use_ops)
        assert forkattn.prefix_cached_attention(q, k, v, lay, block_size=0).shape == q.shape
        with pytest.raises(forkattn.ForkattnError, match="has no forkattn_prefix_cached_block_fwd") as e:
            forkattn.prefix_cached_attention(q, k, v, lay, block_size=2)
        assert e.value.status == 3
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_prefix_cached_block_fwd"):
        dlm_cache.prefix_cached_attention_numpy(q.numpy(), k.numpy(), v.numpy(), 2, [3], block_size=1)


def test_numpy_only_without_torch():
    code = ("import numpy as np, forkattn\n"
            "from forkattn import dlm_cache as dc\n"
            "assert not forkattn.HAVE_TORCH\n"
            "c = forkattn.KVCache(1 << 16, 2, 1, 4, 'float32')\n"
            "assert c.array == 'numpy'\n"
            "k = np.arange(24, dtype=np.float32).reshape(2, 3, 1, 4)\n"
            "assert c.insert([5, 6, 7], k, -k)\n"
            "e = c.lookup([5, 6, 7, 8]); assert e.matched == 3 and np.array_equal(e.v(1), -k[1]); e.release()\n"
            "per, mean = forkattn.kv_similarity(k[0], -k[0]); assert np.allclose(per, -1) and abs(mean + 1) < 1e-6\n"
            "p = forkattn.ReuseProfile(2); p.add(0.5, [1.0, 0.2]); assert p.depth(0.7) == 1\n"
            "q = np.ones((2, 2, 4), np.float32); kv = np.ones((5, 1, 4), np.float32)\n"
            "o = dc.prefix_cached_attention_numpy(q, kv, kv, 3, [2]); assert o.shape == (2, 2, 4)\n"
            "try:\n    forkattn.prefix_cached_attention\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit(1)\n"
            "c.close(); print('OK')\n")
    assert "OK" in run_without_torch(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
def test_cuda_cached_attention_cache_and_similarity():
    if not forkattn.build_has_offload():
        pytest.skip("the loaded libforkattn (%s) has no GPU offload" % forkattn.library_path())
    lay = _layout()
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=5)
    q, do = q[P:].contiguous(), do[P:].contiguous()
    cpu = _run_cached(q, k, v, do, lay, False)
    gpu = _run_cached(q.cuda(), k.cuda(), v.cuda(), do.cuda(), lay, False)
    for a, b in zip(gpu, cpu):
        assert a.is_cuda and rel_err(a.cpu(), b) <= 1e-5
    cache = forkattn.KVCache(1 << 20, L, KVH, HD, torch.bfloat16, device="cuda")
    kk, vv = _kv(5, torch.bfloat16)
    assert cache.insert([1, 2, 3, 4, 5], [x.cuda() for x in kk], [x.cuda() for x in vv])
    assert cache.insert([9, 9], [x[:2] for x in vv], [x[:2] for x in kk])  # host inputs, device entries
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="different devices"):
        cache.insert([1, 2, 3, 4, 5], [x.cuda() for x in kk], vv)
    with cache.lookup([1, 2, 3, 4, 5, 6]) as e:
        x = e.k(2)
        assert x.is_cuda and x.dtype == torch.bfloat16 and torch.equal(x.cpu(), kk[2])
        assert torch.equal(e.v(0, copy=True).cpu(), vv[0])
    cache.close()
    a = torch.randn(20, 2, 8)
    per, mean = forkattn.kv_similarity(a.cuda(), (a + 0.1).cuda())
    rp, rm = forkattn.kv_similarity(a, a + 0.1)
    assert torch.allclose(per, rp, atol=1e-6) and abs(mean - rm) < 1e-6
