"""CUDA tensors (device pointers, FORKATTN_MEMORY_DEVICE, a GPU context per device). Skipped
unless torch sees a GPU; needs an offload build of libforkattn (FORKATTN_LIBRARY=
build-gpu/libforkattn.so, run through .gpu/run where LLVM 19's runtime is not installed)."""

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from conftest import TOL, abs_err, leaf64, make_qkv, prefix_sequences, rel_err, replicated_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")

HQ, HKV, D = 8, 2, 64


@pytest.fixture(scope="module", autouse=True)
def _gpu_context():
    if not forkattn.build_has_offload():
        pytest.skip("the loaded libforkattn (%s) has no GPU offload" % forkattn.library_path())
    assert forkattn.backend(0) == "gpu"


def _check(got, ref, dtype):
    tol = TOL[str(dtype).replace("torch.", "")]
    names = ("o", "lse", "dq", "dk", "dv")
    for n, g, r in zip(names, got, ref):
        e = abs_err(g.cpu(), r) if n == "lse" else rel_err(g.cpu(), r)
        assert e <= tol["lse" if n == "lse" else ("o" if n == "o" else "grad")], (n, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_prefix_matches_reference(dtype, causal):
    lay = forkattn.SharedPrefixLayout.from_lengths([100, 0, 37], [[20, 0, 64], [9, 33], [1]])
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, dtype, seed=1 + causal)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    out, lse = forkattn.prefix_attention(qc, kc, vc, lay, causal=causal, return_lse=True)
    assert out.is_cuda and lse.is_cuda
    (out * do.cuda()).sum().backward()
    q64, k64, v64 = leaf64(q, k, v)
    seqs, plens = prefix_sequences(lay.prompt_lens.tolist(), lay.group_sizes.tolist(), lay.response_lens.tolist())
    ro, rl = replicated_reference(q64, k64, v64, seqs, D ** -0.5, None if causal else plens)
    (ro * do.double()).sum().backward()
    _check((out.detach(), lse, qc.grad, kc.grad, vc.grad),
           (ro.detach(), rl.detach(), q64.grad, k64.grad, v64.grad), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_prefix_head_dim_128_matches_reference(dtype):
    """The tensor-core kernels at head_dim 128: 32-key forward tiles, the dV and dK halves of one
    dK/dV launch, and prompt key blocks read by 441 rows, split into key units summed by the reduce."""
    hq, hkv, d = 4, 2, 128
    lay = forkattn.SharedPrefixLayout.from_lengths([150], [[130, 97, 64]])
    q, k, v, do = make_qkv(lay.num_rows, hq, hkv, d, dtype, seed=21)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    out, lse = forkattn.prefix_attention(qc, kc, vc, lay, return_lse=True)
    (out * do.cuda()).sum().backward()
    q64, k64, v64 = leaf64(q, k, v)
    seqs, _ = prefix_sequences(lay.prompt_lens.tolist(), lay.group_sizes.tolist(), lay.response_lens.tolist())
    ro, rl = replicated_reference(q64, k64, v64, seqs, d ** -0.5, None)
    (ro * do.double()).sum().backward()
    _check((out.detach(), lse, qc.grad, kc.grad, vc.grad),
           (ro.detach(), rl.detach(), q64.grad, k64.grad, v64.grad), dtype)


def test_cuda_tree_varlen_and_strided_views_match_cpu():
    lay = forkattn.TreeLayout.from_sequences([[1, 2, 3, 4] * 10, [1, 2, 3, 5] * 8, [7, 8, 9]])
    T = lay.num_rows
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, HQ + 2 * HKV, D, generator=g).bfloat16()
    views = lambda x: (x[:, :HQ], x[:, HQ:HQ + HKV], x[:, HQ + HKV:])  # noqa: E731
    cpu = forkattn.tree_attention(*views(qkv), lay)
    gpu = forkattn.tree_attention(*views(qkv.cuda()), lay)  # strided device views, no copies
    assert rel_err(gpu.cpu(), cpu) <= 1e-2
    cu = torch.tensor([0, 40, T], dtype=torch.int32)
    a = forkattn.varlen_attention(*views(qkv.float()), cu, cu, 40, 40)
    b = forkattn.varlen_attention(*views(qkv.float().cuda()), cu.cuda(), cu.cuda(), 40, 40)
    assert rel_err(b.cpu(), a) <= 1e-5


def test_cuda_waits_for_pending_work_on_torch_stream():
    """q is produced by a long kernel queued just before the call: the binding must synchronize
    PyTorch's stream first (the library runs on its own stream)."""
    lay = forkattn.SharedPrefixLayout.from_lengths([256], [[128, 128]])
    T = lay.num_rows
    a = torch.randn(4096, 4096, device="cuda")
    k = torch.randn(T, HKV, D, device="cuda")
    v = torch.randn(T, HKV, D, device="cuda")
    torch.cuda.synchronize()
    big = a @ a  # queued
    q = (big[:T, : HQ * D] * 1e-3).reshape(T, HQ, D)  # depends on the queued product
    out = forkattn.prefix_attention(q, k, v, lay)
    ref = forkattn.prefix_attention(q.cpu(), k.cpu(), v.cpu(), lay)
    assert rel_err(out.cpu(), ref) <= 1e-5


def test_cuda_compile_fullgraph():
    lay = forkattn.SharedPrefixLayout.from_lengths([30, 12], [[5, 7], [9]])
    q, k, v, _ = make_qkv(lay.num_rows, HQ, HKV, D, torch.bfloat16, seed=9, device="cuda")
    q.requires_grad_()

    def f(q, k, v):
        return forkattn.prefix_attention(q, k, v, lay).float().square().sum()

    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    g = q.grad.clone()
    q.grad = None
    f(q, k, v).backward()
    assert torch.equal(g, q.grad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one CUDA device")
def test_cuda_second_device_gets_its_own_context():
    lay = forkattn.SharedPrefixLayout.from_lengths([50, 20], [[10, 30], [5]])
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=12)
    ref_q = q.clone().requires_grad_()
    ref = forkattn.prefix_attention(ref_q, k, v, lay)
    (ref * do).sum().backward()
    q1 = q.to("cuda:1").requires_grad_()
    out = forkattn.prefix_attention(q1, k.to("cuda:1"), v.to("cuda:1"), lay)
    assert out.device == torch.device("cuda:1")
    (out * do.to("cuda:1")).sum().backward()
    assert rel_err(out.detach().cpu(), ref.detach()) <= 1e-5
    assert rel_err(q1.grad.cpu(), ref_q.grad) <= 1e-5
    ctx1 = forkattn.current_context(1)
    assert ctx1.backend == "gpu" and ctx1.device == 1
    with pytest.raises(ValueError, match="cannot take CUDA tensors"):
        with forkattn.use_context(forkattn.current_context(0)):
            forkattn.prefix_attention(q1, k.to("cuda:1"), v.to("cuda:1"), lay)


@pytest.mark.parametrize(
    "dtype, prompts, responses",
    [(torch.float32, [100, 37], [[20, 64], [9]]),  # f32 on tensor cores: D by the rowsum kernel
     (torch.bfloat16, [8, 5], [[4, 4], [3]])],  # rows that see few keys: D from the inputs
)
def test_cuda_calls_queued_behind_a_busy_stream_keep_their_arguments(dtype, prompts, responses, monkeypatch):
    """Two problems' forward and backward calls queued behind a long kernel on PyTorch's stream: each
    call's kernels run after later calls were made and must still read their own call's arguments
    (the backward's D kernels once took theirs from a copy the runtime made off the stream and
    reused). Gradients equal those of synchronous calls (FORKATTN_TORCH_STREAM=0) bitwise."""
    lay = forkattn.SharedPrefixLayout.from_lengths(prompts, responses)
    problems = [[t.cuda() for t in make_qkv(lay.num_rows, HQ, HKV, D, dtype, seed=s)] for s in (41, 42)]

    def run(busy):
        leaves = [[t.detach().clone().requires_grad_() for t in p[:3]] for p in problems]
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(1_000_000_000)  # about half a second of one SM's clock
        grads = []
        for (q, k, v), (_, _, _, do) in zip(leaves, problems):
            out = forkattn.prefix_attention(q, k, v, lay, causal=True)
            grads.append(torch.autograd.grad(out, (q, k, v), do))
        if busy:
            assert not torch.cuda.current_stream().query(), "the calls did not return while the stream was busy"
        return [[g.cpu() for g in gs] for gs in grads]

    monkeypatch.setenv("FORKATTN_TORCH_STREAM", "0")
    want = run(False)
    monkeypatch.delenv("FORKATTN_TORCH_STREAM")
    got = run(True)
    for w_problem, g_problem in zip(want, got):
        for name, w, g in zip(("dq", "dk", "dv"), w_problem, g_problem):
            assert torch.isfinite(w).all()
            assert torch.equal(w, g), (name, (w.double() - g.double()).abs().max().item())


def test_cuda_calls_follow_torchs_stream(monkeypatch):
    """A GPU context follows PyTorch's current stream (forkattn_ctx_set_stream): the bf16 tensor-core
    calls are queued on it and return at once. Their results are bitwise those of synchronous calls
    (FORKATTN_TORCH_STREAM=0), on the default stream and on a side stream."""
    lay = forkattn.SharedPrefixLayout.from_lengths([256], [[128, 64, 200]])
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, 128, torch.bfloat16, seed=31)
    ctx = forkattn.current_context(0)

    def run():
        qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
        out = forkattn.prefix_attention(qc, kc, vc, lay)
        (out * do.cuda()).sum().backward()
        return [x.detach().cpu() for x in (out, qc.grad, kc.grad, vc.grad)]

    monkeypatch.setenv("FORKATTN_TORCH_STREAM", "0")
    want = run()
    assert ctx.stream is None, "FORKATTN_TORCH_STREAM=0: synchronous calls"
    monkeypatch.delenv("FORKATTN_TORCH_STREAM")
    got = run()
    assert ctx.stream == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got_side = run()
        assert ctx.stream == side.cuda_stream
    for w, g, s in zip(want, got, got_side):
        assert torch.equal(w, g) and torch.equal(w, s)
        assert torch.isfinite(w.float()).all()
