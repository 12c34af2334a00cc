"""float32 inputs on the GPU at each ``f32_precision`` (docs/numerics.md "f32 on tensor cores"):
the attention forward and backward and the StreamKL forward on tensor cores from bf16 pieces
("high", "medium") or on CUDA cores ("highest"), against float64; the StreamKL backward (FP32
kernels) reads the forward's statistics. Skipped unless torch sees a GPU and the library has
offload (as test_cuda.py)."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from conftest import TOL, abs_err, leaf64, make_qkv, prefix_sequences, rel_err, replicated_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")

# o and lse limits per precision: "high" and "highest" the float32 tolerances; "medium" its documented
# bound (8x); the large-logit case (scores ~40) the C suite's 1e-4 / 1e-3 and medium's 8x of those
LIMITS = {
    "high": (TOL["float32"]["o"], TOL["float32"]["lse"]),
    "highest": (TOL["float32"]["o"], TOL["float32"]["lse"]),
    "medium": (8 * TOL["float32"]["o"], 8 * TOL["float32"]["lse"]),
}
LARGE = {"high": (1e-4, 1e-3), "highest": (1e-4, 1e-3), "medium": (8e-4, 8e-3)}


@pytest.fixture(scope="module", autouse=True)
def _gpu_context():
    if not forkattn.build_has_offload():
        pytest.skip("the loaded libforkattn (%s) has no GPU offload" % forkattn.library_path())
    assert forkattn.backend(0) == "gpu"


@contextlib.contextmanager
def _precision(p):
    """Every default context at precision p (forkattn.configure), the one autograd's thread uses for
    a CUDA backward included."""
    prev = forkattn.configure(f32_precision=p)
    try:
        yield
    finally:
        forkattn.configure(f32_precision=prev["f32_precision"])


def _run(precision, d, scale_q, seed, softmax_scale=None):
    ctx = forkattn.Context("gpu", f32_precision=precision)
    split = "f32 as bf16x%d on mma.sync: forward, dQ, dK/dV, StreamKL forward, StreamKL backward" % (
        3 if precision == "medium" else 6)
    assert (split in ctx.gpu_kernels) == (precision != "highest"), ctx.gpu_kernels
    lay = forkattn.SharedPrefixLayout.from_lengths([150, 70], [[130, 97], [64, 1, 33]])
    hq, hkv = 4, 2
    q, k, v, do = make_qkv(lay.num_rows, hq, hkv, d, torch.float32, seed=seed, scale_q=scale_q)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    with _precision(precision):
        out, lse = forkattn.prefix_attention(qc, kc, vc, lay, softmax_scale=softmax_scale, return_lse=True)
        (out * do.cuda()).sum().backward()
    torch.cuda.synchronize()
    q64, k64, v64 = leaf64(q, k, v)
    seqs, _ = prefix_sequences(lay.prompt_lens.tolist(), lay.group_sizes.tolist(), lay.response_lens.tolist())
    ro, rl = replicated_reference(q64, k64, v64, seqs, softmax_scale or d ** -0.5, None)
    (ro * do.double()).sum().backward()
    errs = (rel_err(out.detach().cpu(), ro.detach()), abs_err(lse.cpu(), rl.detach()),
            max(rel_err(g.cpu(), r) for g, r in ((qc.grad, q64.grad), (kc.grad, k64.grad), (vc.grad, v64.grad))))
    ctx.close()
    return (out.detach().cpu(), qc.grad.cpu(), kc.grad.cpu()), errs


@pytest.mark.parametrize("precision", ["high", "medium", "highest"])
@pytest.mark.parametrize("d", [64, 128])
def test_f32_precision_matches_float64(precision, d):
    _, (eo, el, eg) = _run(precision, d, 4.0, seed=40 + d)
    o_lim, lse_lim = LIMITS[precision]
    print("f32_precision=%s d=%d: o %.2e lse %.2e grads %.2e" % (precision, d, eo, el, eg))
    assert eo <= o_lim and el <= lse_lim, (eo, el)
    assert eg <= (8 if precision == "medium" else 1) * TOL["float32"]["grad"], eg


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_f32_precision_large_logits(precision):
    """Scale 4 at d 64 (scores ~40, row maxima past 100: tests/test_prefix.c's large-logit case)."""
    _, (eo, el, _) = _run(precision, 64, 4.0, seed=7, softmax_scale=4.0)
    print("f32_precision=%s large logits: o %.2e lse %.2e" % (precision, eo, el))
    assert eo <= LARGE[precision][0] and el <= LARGE[precision][1], (eo, el)


def test_f32_precisions_run_different_kernels():
    """Not vacuous: the three precisions give three different outputs, dq and dk (the same inputs):
    the backward runs at the forward's precision."""
    runs = [_run(p, 64, 4.0, seed=3)[0] for p in ("high", "medium", "highest")]
    for i in range(3):  # o, dq, dk
        a, b, c = (r[i] for r in runs)
        assert not torch.equal(a, c) and not torch.equal(b, c) and not torch.equal(a, b), i


@pytest.mark.parametrize("precision", ["high", "medium", "highest"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_f32_precision_stream_kl(precision, direction):
    """StreamKL of f32 teacher and student (GQA 4/2 and 4/1, d 64) on a GRPO group: kl against float64
    at test_distill's f32 limit (1e-5 relative; medium 8x), gradients (FP32 backward) at 1e-5."""
    from test_distill import ref_kl, visibility

    lay = forkattn.SharedPrefixLayout.from_lengths([70], [[40, 23]])
    T, H, d = lay.num_rows, 4, 64
    g = torch.Generator().manual_seed(11 + (direction == "reverse"))
    shapes = ((T, H, d, 2.0), (T, 2, d, 1.0), (T, H, d, 2.0), (T, 1, d, 1.0))
    inp = [(torch.rand(*s[:3], generator=g, dtype=torch.float64) * 2 - 1) * s[3] for s in shapes]
    x = [t.float().cuda().requires_grad_() for t in inp]
    with _precision(precision):
        kl = forkattn.stream_kl(*x, lay, direction=direction, teacher_grad=True)
        w = torch.rand(T, H, generator=g, dtype=torch.float64)
        (kl * w.float().cuda()).sum().backward()
    torch.cuda.synchronize()
    r64 = [t.clone().requires_grad_() for t in inp]
    rkl, _ = ref_kl(*r64, visibility(lay, T), None, direction, st=d ** -0.5, ss=d ** -0.5)
    (rkl * w).sum().backward()
    e = rel_err(kl.detach().cpu(), rkl.detach())
    eg = max(rel_err(a.grad.cpu(), b.grad) for a, b in zip(x, r64))
    print("StreamKL f32_precision=%s %s: kl %.2e grads %.2e" % (precision, direction, e, eg))
    assert e <= (8e-5 if precision == "medium" else 1e-5), e
    assert eg <= (1e-4 if precision == "medium" else 1e-5), eg
