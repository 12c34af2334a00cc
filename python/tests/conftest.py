"""Shared helpers: float64 references on the replicated batch and error measures.

Works without torch (the numpy-only tests import only what they need)."""

import os
import sys

import pytest

# In a source checkout the tests import its python/forkattn; a copy of the tests beside no
# package (run_tests.sh --installed) imports the installed forkattn instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(os.path.dirname(_HERE), "forkattn")):
    sys.path.insert(0, os.path.dirname(_HERE))

try:
    import torch
except ImportError:  # numpy-only run
    torch = None


def rel_err(got, ref):
    """max |got - ref| / max |ref| (normwise relative, as the C tests measure it)."""
    if torch is not None and isinstance(got, torch.Tensor):
        got, ref = got.double(), ref.double()
        if ref.numel() == 0:
            return 0.0
        den = ref.abs().max().item()
        return (got - ref).abs().max().item() / (den if den > 0 else 1.0)
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    den = np.abs(ref).max()
    return float(np.abs(got - ref).max() / (den if den > 0 else 1.0))


def abs_err(got, ref):
    """max |got - ref| over finite entries; infinities must match exactly."""
    if torch is not None and isinstance(got, torch.Tensor):
        got, ref = got.double(), ref.double()
        if ref.numel() == 0:
            return 0.0
        inf = torch.isinf(ref)
        if not torch.equal(torch.isinf(got), inf) or not torch.equal(got[inf], ref[inf]):
            return float("inf")
        fin = ~inf
        return (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    inf = np.isinf(ref)
    if not np.array_equal(np.isinf(got), inf) or not np.array_equal(got[inf], ref[inf]):
        return float("inf")
    return float(np.abs(got[~inf] - ref[~inf]).max()) if (~inf).any() else 0.0


# Tolerances (normwise relative for o and grads, absolute for lse). The f32 ones are tighter
# than the C suite's (docs/numerics.md: 2e-5 / 1e-4 / 1e-4) because these problems are tiny
# (tens of keys per row); measured errors are about 3e-7.
TOL = {
    "float32": dict(o=1e-5, lse=1e-5, grad=1e-5),
    "bfloat16": dict(o=1e-2, lse=1e-3, grad=1e-2),
    "float16": dict(o=1e-2, lse=1e-3, grad=1e-2),
}


def check_close(got, ref, dtype):
    """Assert (o, lse, dq, dk, dv) ``got`` match the float64 ``ref`` within TOL of ``dtype``;
    returns the errors."""
    tol = TOL[str(dtype).replace("torch.", "")]
    o, lse, dq, dk, dv = got
    ro, rlse, rdq, rdk, rdv = ref
    errs = dict(o=rel_err(o, ro), lse=abs_err(lse, rlse), dq=rel_err(dq, rdq), dk=rel_err(dk, rdk),
                dv=rel_err(dv, rdv))
    assert errs["o"] <= tol["o"], errs
    assert errs["lse"] <= tol["lse"], errs
    for g in ("dq", "dk", "dv"):
        assert errs[g] <= tol["grad"], errs
    return errs


def bind_without(monkeypatch, hidden):
    """Make the binding use the loaded library without the symbols for which ``hidden(name)``
    is true (an older or stripped build) for the rest of the test; returns that binding."""
    from forkattn import _lib

    real = _lib.load_library()

    class Stripped:
        _name = real._name

        def __getattr__(self, name):
            if hidden(name):
                raise AttributeError(name)
            return getattr(real, name)

    lib = _lib._bind(Stripped())
    monkeypatch.setattr(_lib, "_lib", lib)
    return lib


def run_without_torch(code):
    """Run Python ``code`` in a fresh interpreter that cannot import torch, with this checkout's
    forkattn on the path; asserts it exits 0 and returns its stdout."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.path.dirname(_HERE))
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None\n" + code], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


# --------------------------------------------------------------------------------------------
# torch references


def masked_attention_f64(q, k, v, mask, scale):
    """q [B, L, Hq, d], k/v [B, L, Hkv, d], mask [B, L, L] bool (True: may attend), float64.
    Returns o [B, L, Hq, d] and lse [B, L, Hq] (-inf, o = 0 where a row sees nothing)."""
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, 2)
    v = v.repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    m = mask[:, None]
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [B, H, L]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None]) * m
    o = torch.einsum("bhij,bjhd->bihd", p, v)
    return o, lse.transpose(1, 2)


def replicated_reference(q, k, v, sequences, scale, prompt_lens=None):
    """Reference on the replicated batch: ``sequences`` is a list of lists of packed rows (each
    a root-to-leaf path / prompt+response); prompt_lens[i] (bidirectional prompts) or None
    (causal). Builds the padded replicated batch [N, Lmax] with explicit masks, runs float64
    attention, and maps every packed row to its first occurrence. Differentiable w.r.t. the
    packed float64 q, k, v (copies' gradients are summed by autograd)."""
    T = q.shape[0]
    N = len(sequences)
    Lmax = max((len(s) for s in sequences), default=0)
    idx = torch.zeros(N, max(Lmax, 1), dtype=torch.long)
    valid = torch.zeros(N, max(Lmax, 1), dtype=torch.bool)
    for n, s in enumerate(sequences):
        idx[n, : len(s)] = torch.tensor(s, dtype=torch.long)
        valid[n, : len(s)] = True
    L = idx.shape[1]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    mask = valid[:, :, None] & valid[:, None, :]
    if prompt_lens is None:
        mask = mask & (j <= i)
    else:
        P = torch.tensor(prompt_lens, dtype=torch.long)[:, None, None]
        mask = mask & ((j < P) | (i >= P))
    o, lse = masked_attention_f64(q[idx], k[idx], v[idx], mask, scale)
    # first occurrence of every packed row
    src = {}
    for n, s in enumerate(sequences):
        for pos, r in enumerate(s):
            src.setdefault(r, (n, pos))
    assert len(src) == T, "reference: rows without a sequence"
    nn = torch.tensor([src[r][0] for r in range(T)], dtype=torch.long)
    pp = torch.tensor([src[r][1] for r in range(T)], dtype=torch.long)
    return o[nn, pp], lse[nn, pp]


def prefix_sequences(prompt_lens, group_sizes, response_lens):
    """Replicated sequences of a shared-prefix layout: per group a prompt-only sequence (the
    prompt rows' outputs) and one prompt+response sequence per response. Returns (sequences,
    their prompt lengths)."""
    seqs, plens = [], []
    row, r = 0, 0
    for P, n in zip(prompt_lens, group_sizes):
        prompt = list(range(row, row + P))
        row += P
        seqs.append(prompt)
        plens.append(P)
        for _ in range(n):
            R = response_lens[r]
            r += 1
            seqs.append(prompt + list(range(row, row + R)))
            plens.append(P)
            row += R
    return seqs, plens


def make_qkv(T, hq, hkv, d, dtype, seed, device="cpu", scale_q=2.0):
    """Fresh random inputs (never zeros), rounded to dtype; float64 copies of the rounded
    values for the reference."""
    g = torch.Generator().manual_seed(seed)
    q = ((torch.rand(T, hq, d, generator=g, dtype=torch.float64) * 2 - 1) * scale_q).to(dtype)
    k = (torch.rand(T, hkv, d, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    v = (torch.rand(T, hkv, d, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    do = (torch.rand(T, hq, d, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    return [t.to(device) for t in (q, k, v, do)]


def leaf64(*ts):
    return [t.detach().double().cpu().requires_grad_() for t in ts]


@pytest.fixture
def torch_mod():
    if torch is None:
        pytest.skip("torch is not installed")
    return torch
