"""varlen_attention (flash-attn conventions) against per-sequence SDPA in float64."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import forkattn  # noqa: E402
from conftest import check_close, leaf64, make_qkv  # noqa: E402

HQ, HKV, D = 6, 2, 8
LENS = [5, 1, 0, 9, 3]


def _sdpa_reference(q, k, v, lens, scale, causal):
    """Per-sequence SDPA in float64 (GQA by repeating KV heads); lse from the scores."""
    outs, lses = [], []
    start = 0
    rep = q.shape[1] // k.shape[1]
    for L in lens:
        qs, ks, vs = (t[start:start + L].transpose(0, 1) for t in (q, k, v))  # [H, L, d]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        if L:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).transpose(0, 1))
            s = (qs @ ks.transpose(1, 2)) * scale
            if causal:
                s = s.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool)), float("-inf"))
            lses.append(torch.logsumexp(s, -1))  # [H, L]
        start += L
    return torch.cat(outs, 0), torch.cat(lses, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_per_sequence_sdpa(dtype, causal):
    T = sum(LENS)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, do = make_qkv(T, HQ, HKV, D, dtype, seed=31 + causal)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = forkattn.varlen_attention(qg, kg, vg, cu, cu, max(LENS), max(LENS), causal=causal,
                                         return_lse=True)
    assert lse.shape == (HQ, T) and lse.is_contiguous()  # flash-attn's varlen layout
    (out * do).sum().backward()
    q64, k64, v64 = leaf64(q, k, v)
    ro, rl = _sdpa_reference(q64, k64, v64, LENS, D ** -0.5, causal)
    (ro * do.double()).sum().backward()
    check_close((out.detach(), lse, qg.grad, kg.grad, vg.grad),
                (ro.detach(), rl.detach(), q64.grad, k64.grad, v64.grad), dtype)


def test_varlen_matches_prefix_with_empty_prompt():
    T = sum(LENS)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    q, k, v, _ = make_qkv(T, HQ, HKV, D, torch.float32, seed=2)
    a = forkattn.varlen_attention(q, k, v, cu, cu, 9, 9)
    lay = forkattn.SharedPrefixLayout.from_lengths([0], [LENS])
    b = forkattn.prefix_attention(q, k, v, lay)
    assert torch.equal(a, b)


def test_varlen_errors():
    T = sum(LENS)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, _ = make_qkv(T, HQ, HKV, D, torch.float32, seed=2)
    cu_k = cu.clone()
    cu_k[1] += 1
    with pytest.raises(NotImplementedError, match="cu_seqlens_q must equal cu_seqlens_k"):
        forkattn.varlen_attention(q, k, v, cu, cu_k, 9, 9)
    with pytest.raises(NotImplementedError):
        forkattn.varlen_attention(q, k, v, cu, cu, 9, 10)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        forkattn.varlen_attention(q, k, v, cu, cu, 4, 4)
    bad = cu.clone()
    bad[2] = 0  # decreasing offsets: the C library names the argument
    with pytest.raises(forkattn.ForkattnError, match="monotonic|decreas|offsets"):
        forkattn.varlen_attention(q, k, v, bad, bad, 100, 100)
    with pytest.raises(ValueError):
        forkattn.varlen_attention(q, k, v, cu.float(), cu.float(), 9, 9)


@pytest.mark.parametrize("custom_ops", [False, True])
def test_backward_follows_the_forwards_context(monkeypatch, custom_ops):
    """A backward uses what its forward's use_context gave it: on another thread (as autograd runs a
    CUDA backward) a context of the same options, on the forward's thread the context itself; a
    forward outside any use_context leaves the backward on its thread's default. Eager custom ops
    too (compiled backwards keep their thread's default, documented)."""
    import threading
    from forkattn import _lib, ops

    monkeypatch.setattr(ops, "USE_CUSTOM_OPS", True if custom_ops else "compile")
    seen = []
    bwd = _lib.varlen_bwd

    def spy(ctx, *args):
        seen.append((ctx, threading.get_ident()))
        return bwd(ctx, *args)

    monkeypatch.setattr(_lib, "varlen_bwd", spy)
    cu = torch.tensor([0, 5, 14])
    own = forkattn.Context("cpu", threads=1, verbose=False)

    def forward():
        q, k, v = (t.requires_grad_() for t in make_qkv(14, 2, 1, 8, torch.float32, seed=5)[:3])
        return forkattn.varlen_attention(q, k, v, cu, cu, 9, 9)

    with forkattn.use_context(own):
        out = forward()
    t = threading.Thread(target=lambda: out.sum().backward())
    t.start()
    t.join()
    ctx, tid = seen[-1]
    assert tid != threading.get_ident()
    assert ctx is not own and ctx._options == own._options and ctx.threads == 1

    with forkattn.use_context(own):
        out = forward()
    out.sum().backward()  # this thread, outside the block
    assert seen[-1][0] is own

    out = forward()  # no use_context: the thread's default, here and on another thread
    out.sum().backward()
    assert seen[-1][0] is forkattn.current_context()
    own.close()
    with forkattn.use_context(forkattn.Context("cpu", threads=1)) as again:
        out = forward()
    again.close()  # closed before its backward: a context of its options serves it
    out.sum().backward()
    assert seen[-1][0] is not again and seen[-1][0]._options == again._options
