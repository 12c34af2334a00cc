"""The torch.library custom ops: opcheck (schema, fake tensors, autograd registration, AOT
dispatch) and torch.compile(fullgraph=True) through layouts and ops, on CPU."""

import os

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from forkattn import ops  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")


def _prefix_case():
    lay = forkattn.SharedPrefixLayout.from_lengths([3, 2], [[2, 0, 1], [3]])
    g = torch.Generator().manual_seed(0)
    T = lay.num_rows
    q = torch.randn(T, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(T, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(T, 2, 8, generator=g, requires_grad=True)
    return lay, q, k, v


def _opcheck(op, args):
    res = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in res.values()), res


def test_opcheck_prefix_ops():
    lay, q, k, v = _prefix_case()
    args = (q, k, v, lay.prompt_lens, lay.response_lens, lay.group_sizes, 0.3, True)
    _opcheck(torch.ops.forkattn.prefix_fwd.default, args)
    out, lse = torch.ops.forkattn.prefix_fwd(*args)
    do = torch.randn_like(out)
    _opcheck(torch.ops.forkattn.prefix_bwd.default,
             (do, q.detach(), k.detach(), v.detach(), out.detach(), lse, lay.prompt_lens, lay.response_lens,
              lay.group_sizes, 0.3, False))


def test_opcheck_tree_and_varlen_ops():
    lay = forkattn.TreeLayout.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]])
    T = lay.num_rows
    q = torch.randn(T, 2, 8, requires_grad=True)
    k = torch.randn(T, 1, 8, requires_grad=True)
    v = torch.randn(T, 1, 8, requires_grad=True)
    _opcheck(torch.ops.forkattn.tree_fwd.default, (q, k, v, lay.node_offsets, lay.parents, 0.5))
    out, lse = torch.ops.forkattn.tree_fwd(q, k, v, lay.node_offsets, lay.parents, 0.5)
    _opcheck(torch.ops.forkattn.tree_bwd.default,
             (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, lay.node_offsets,
              lay.parents, 0.5))
    cu = torch.tensor([0, 3, T], dtype=torch.int32)
    _opcheck(torch.ops.forkattn.varlen_fwd.default, (q, k, v, cu, cu, 0.5, True))


def _step(q, k, v, lay, x):
    """A GRPO-like fragment: pack features, attend, unpack per-response values."""
    px = lay.pack(x)  # [T, 1]
    out = forkattn.prefix_attention(q * px[:, :, None], k, v, lay)
    resp = lay.unpack_responses(out.sum(-1), shift=True)  # [B, R, H]
    return (resp * resp).sum() + out.mean()


def test_compile_fullgraph_aot_eager():
    lay, q, k, v = _prefix_case()
    x = torch.rand(lay.batch_size, lay.seq_len, 1) + 0.5
    torch._dynamo.reset()
    cf = torch.compile(_step, fullgraph=True, backend="aot_eager")
    loss = cf(q, k, v, lay, x)
    loss.backward()
    g = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = _step(q, k, v, lay, x)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    for a, t in zip(g, (q, k, v)):
        assert torch.allclose(a, t.grad, rtol=1e-6, atol=1e-6)

    # tree and varlen in one compiled graph
    tl = forkattn.TreeLayout.from_sequences([[1, 2, 3], [1, 2, 4, 5]])
    cu = torch.tensor([0, 2, tl.num_rows], dtype=torch.int32)

    def f(q, k, v):
        a = forkattn.tree_attention(q, k, v, tl)
        b = forkattn.varlen_attention(q, k, v, cu, cu, 3, 3, causal=False)
        return (a * b).sum()

    qt = torch.randn(tl.num_rows, 2, 8, requires_grad=True)
    kt, vt = torch.randn(tl.num_rows, 2, 8), torch.randn(tl.num_rows, 2, 8)
    torch._dynamo.reset()
    c = torch.compile(f, fullgraph=True, backend="aot_eager")(qt, kt, vt)
    c.backward()
    gq = qt.grad.clone()
    qt.grad = None
    e = f(qt, kt, vt)
    e.backward()
    assert torch.allclose(c, e) and torch.allclose(gq, qt.grad)


@pytest.mark.skipif(os.environ.get("FORKATTN_TEST_INDUCTOR", "1") == "0",
                    reason="FORKATTN_TEST_INDUCTOR=0 (inductor's C++ compile takes ~25 s on 2 cores)")
def test_compile_fullgraph_inductor():
    lay, q, k, v = _prefix_case()

    def f(q, k, v):
        return (forkattn.prefix_attention(q, k, v, lay) * 2).sum()

    torch._dynamo.reset()
    try:
        cf = torch.compile(f, fullgraph=True)
        loss = cf(q, k, v)
    except Exception as e:  # no C++ compiler for inductor on this machine
        if "compiler" in str(e).lower() or "cpp" in str(e).lower():
            pytest.skip("inductor unavailable: %s" % str(e)[:200])
        raise
    loss.backward()
    g = q.grad.clone()
    q.grad = None
    f(q, k, v).backward()
    assert torch.allclose(g, q.grad, rtol=1e-6, atol=1e-6)


def test_eager_calls_functions_and_compile_traces_custom_ops(monkeypatch):
    """USE_CUSTOM_OPS = "compile" (the default): eager calls take the autograd.Functions (cheaper
    dispatch), a torch.compile trace records the custom ops; True takes the ops in eager too."""
    assert ops.USE_CUSTOM_OPS == "compile"
    lay, q, k, v = _prefix_case()
    out = forkattn.prefix_attention(q, k, v, lay)
    assert type(out.grad_fn).__name__ == "PrefixAttentionFunctionBackward"
    cu = torch.tensor([0, 3, lay.num_rows], dtype=torch.int32)
    out_v = forkattn.varlen_attention(q, k, v, cu, cu, lay.num_rows, lay.num_rows)
    assert type(out_v.grad_fn).__name__ == "VarlenAttentionFunctionBackward"

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: forkattn.prefix_attention(q, k, v, lay), backend=backend,
                             fullgraph=True)
    got = compiled(q, k, v)
    assert any("forkattn.prefix_fwd" in s for s in seen), seen
    assert torch.equal(got, out)

    monkeypatch.setattr(ops, "USE_CUSTOM_OPS", True)
    out_op = forkattn.prefix_attention(q, k, v, lay)
    assert "PrefixAttentionFunction" not in type(out_op.grad_fn).__name__
    assert torch.equal(out_op, out)
