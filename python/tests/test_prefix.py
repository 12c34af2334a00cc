"""prefix_attention against a float64 reference on the replicated batch (explicit masks)."""

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from forkattn import _lib, ops  # noqa: E402
from conftest import check_close, leaf64, make_qkv, prefix_sequences, rel_err, replicated_reference  # noqa: E402

# Several groups, GQA 4/2, a zero-length prompt, zero-length responses, a one-token response.
PROMPTS = [7, 0, 12]
RESPONSES = [[5, 0, 9], [4, 6], [1, 0]]
HQ, HKV, D = 4, 2, 16


def _layout():
    return forkattn.SharedPrefixLayout.from_lengths(PROMPTS, RESPONSES)


def _reference(q, k, v, do, layout, scale, causal):
    q64, k64, v64 = leaf64(q, k, v)
    seqs, plens = prefix_sequences(layout.prompt_lens.tolist(), layout.group_sizes.tolist(),
                                   layout.response_lens.tolist())
    o, lse = replicated_reference(q64, k64, v64, seqs, scale, None if causal else plens)
    (o * do.double()).sum().backward()
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def _run(q, k, v, do, layout, causal, use_ops=True):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    prev = ops.USE_CUSTOM_OPS
    ops.USE_CUSTOM_OPS = use_ops
    try:
        out, lse = forkattn.prefix_attention(q, k, v, layout, causal=causal, return_lse=True)
        (out * do).sum().backward()
    finally:
        ops.USE_CUSTOM_OPS = prev
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert not lse.requires_grad
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_prefix_groups_match_replicated(dtype, causal):
    layout = _layout()
    q, k, v, do = make_qkv(layout.num_rows, HQ, HKV, D, dtype, seed=11 + causal)
    scale = D ** -0.5
    got = _run(q, k, v, do, layout, causal)
    check_close(got, _reference(q, k, v, do, layout, scale, causal), dtype)


@pytest.mark.parametrize("path", ["tree", "loop"])
@pytest.mark.parametrize("use_ops", [True, False])
def test_prefix_paths_and_functions_agree(path, use_ops, monkeypatch):
    """One forest call or one call per group; custom op or autograd.Function: all exact."""
    monkeypatch.setattr(_lib, "MULTI_GROUP_CAUSAL", path)
    layout = _layout()
    q, k, v, do = make_qkv(layout.num_rows, HQ, HKV, D, torch.float32, seed=5)
    got = _run(q, k, v, do, layout, True, use_ops=use_ops)
    check_close(got, _reference(q, k, v, do, layout, D ** -0.5, True), torch.float32)


def test_prefix_single_group_custom_scale_f16():
    layout = forkattn.SharedPrefixLayout.from_lengths([9], [[3, 7, 0, 2]])
    q, k, v, do = make_qkv(layout.num_rows, 6, 3, 8, torch.float16, seed=3)
    got = _run(q, k, v, do, layout, True)
    q2 = q.clone().requires_grad_()
    out = forkattn.prefix_attention(q2, k, v, layout, softmax_scale=0.2)
    ref = _reference(q, k, v, do, layout, 0.2, True)
    assert rel_err(out.detach(), ref[0]) <= 1e-2
    check_close(got, _reference(q, k, v, do, layout, 8 ** -0.5, True), torch.float16)


def test_prefix_strided_views_need_no_copy_and_agree():
    """q/k/v as slices of a fused projection and head-major views give the contiguous result."""
    layout = _layout()
    T = layout.num_rows
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, HQ + 2 * HKV, D, generator=g)
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    assert not q.is_contiguous()
    _, qd = ops._desc(q)
    assert qd.data == q.data_ptr() and qd.row_stride == (HQ + 2 * HKV) * D  # no copy
    hm = torch.randn(HQ, T, D, generator=g).transpose(0, 1)  # head-major [T, H, d] view
    _, hd = ops._desc(hm)
    assert hd.data == hm.data_ptr() and hd.row_stride == D and hd.head_stride == T * D
    odd = torch.randn(T, HKV, 2 * D, generator=g)[:, :, ::2]  # head_dim stride 2: copied
    _, od = ops._desc(odd)
    assert od.data != odd.data_ptr()
    out_s = forkattn.prefix_attention(hm, k, odd, layout)
    out_c = forkattn.prefix_attention(hm.contiguous(), k.contiguous(), odd.contiguous(), layout)
    assert rel_err(out_s, out_c) <= 1e-6
    # gradients flow back to the fused buffer
    qkv.requires_grad_()
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    forkattn.prefix_attention(q, k, v, layout).sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()


def test_prefix_expanded_dout_is_handled():
    """out.sum().backward() hands the backward a stride-0 dout: it must be made contiguous."""
    layout = _layout()
    q, k, v, _ = make_qkv(layout.num_rows, HQ, HKV, D, torch.float32, seed=8)
    q.requires_grad_()
    forkattn.prefix_attention(q, k, v, layout).sum().backward()
    ones = torch.ones(layout.num_rows, HQ, D)
    ref = _reference(q.detach(), k, v, ones, layout, D ** -0.5, True)
    assert rel_err(q.grad, ref[2]) <= 1e-4


def test_prefix_empty_batch():
    layout = forkattn.SharedPrefixLayout.from_uid([], torch.zeros(0, 6, dtype=torch.bool),
                                                  torch.zeros(0, 6, dtype=torch.bool))
    assert layout.num_rows == 0 and layout.num_groups == 0 and layout.batch_size == 0
    q = torch.randn(0, HQ, D, requires_grad=True)
    k = torch.randn(0, HKV, D, requires_grad=True)
    v = torch.randn(0, HKV, D, requires_grad=True)
    out, lse = forkattn.prefix_attention(q, k, v, layout, return_lse=True)
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert layout.unpack_responses(out).shape == (0, 0, HQ, D)
    assert layout.pack(torch.zeros(0, 6, 3)).shape == (0, 3)
    with pytest.raises(ValueError):
        forkattn.prefix_attention(torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), layout)


def test_prefix_all_responses_empty():
    layout = forkattn.SharedPrefixLayout.from_lengths([4, 3], [[0, 0], [0]])
    q, k, v, do = make_qkv(layout.num_rows, HQ, HKV, D, torch.float32, seed=2)
    got = _run(q, k, v, do, layout, True)
    check_close(got, _reference(q, k, v, do, layout, D ** -0.5, True), torch.float32)
    assert layout.unpack_responses(got[0]).shape == (3, 0, HQ, D)


def test_prefix_errors_carry_the_c_message():
    layout = _layout()
    T = layout.num_rows
    # GQA mismatch: detected by the C library
    with pytest.raises(forkattn.ForkattnError) as e:
        forkattn.prefix_attention(torch.randn(T, 3, D), torch.randn(T, 2, D), torch.randn(T, 2, D), layout)
    assert e.value.status == 1 and "multiple" in e.value.message and isinstance(e.value, ValueError)
    # head_dim out of range
    with pytest.raises(ValueError, match="head_dim"):
        forkattn.prefix_attention(torch.randn(T, 2, 300), torch.randn(T, 2, 300), torch.randn(T, 2, 300), layout)
    # rows do not match the layout
    with pytest.raises(forkattn.ForkattnError, match="rows"):
        forkattn.prefix_attention(torch.randn(T + 1, 2, D), torch.randn(T + 1, 2, D), torch.randn(T + 1, 2, D),
                                  layout)
    # bad scale
    with pytest.raises(forkattn.ForkattnError, match="scale"):
        forkattn.prefix_attention(torch.randn(T, 2, D), torch.randn(T, 2, D), torch.randn(T, 2, D), layout,
                                  softmax_scale=-1.0)
    # Python-side checks
    with pytest.raises(ValueError, match="dtype"):
        forkattn.prefix_attention(torch.randn(T, 2, D, dtype=torch.float64), torch.randn(T, 2, D),
                                  torch.randn(T, 2, D), layout)
    with pytest.raises(ValueError, match="share one dtype"):
        forkattn.prefix_attention(torch.randn(T, 2, D), torch.randn(T, 2, D).bfloat16(), torch.randn(T, 2, D),
                                  layout)
    with pytest.raises(ValueError, match=r"\[rows, heads, head_dim\]"):
        forkattn.prefix_attention(torch.randn(T, 2 * D), torch.randn(T, 2, D), torch.randn(T, 2, D), layout)
    with pytest.raises(TypeError):
        forkattn.prefix_attention(torch.randn(T, 2, D), torch.randn(T, 2, D), torch.randn(T, 2, D), None)
    # the context still works after errors
    out = forkattn.prefix_attention(torch.randn(T, 2, D), torch.randn(T, 2, D), torch.randn(T, 2, D), layout)
    assert torch.isfinite(out).all()


def test_prefix_under_checkpoint():
    """torch.utils.checkpoint re-runs the forward with the layout's tensors."""
    from torch.utils.checkpoint import checkpoint

    layout = _layout()
    q, k, v, do = make_qkv(layout.num_rows, HQ, HKV, D, torch.float32, seed=9)
    w = torch.randn(D, D, requires_grad=True)

    def f(x):
        return forkattn.prefix_attention(x @ w, k, v, layout)

    (checkpoint(f, q, use_reentrant=False) * do).sum().backward()
    g1 = w.grad.clone()
    w.grad = None
    (f(q) * do).sum().backward()
    assert rel_err(g1, w.grad) <= 1e-6


def test_prefix_from_several_threads():
    """Each thread gets its own default context; ctypes releases the GIL during the calls."""
    import threading

    layout = _layout()
    q, k, v, _ = make_qkv(layout.num_rows, HQ, HKV, D, torch.float32, seed=13)
    ref = forkattn.prefix_attention(q, k, v, layout)
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(forkattn.prefix_attention(q, k, v, layout))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 15
    assert all(torch.equal(r, ref) for r in results)
