#!/usr/bin/env python3
"""StreamKL vs PyTorch's materialized KL on one GPU, in one process.

PyTorch computes the loss the way a trainer without a fused kernel does: both score
matrices [H, S, S], causal masks, log_softmax, KL summed over keys; its backward is
autograd's. Cases: causal sequences of 4096 (16 heads) and 16384 rows (4 heads), and a GRPO
group (a 2048-row prompt and 8 responses of 512 rows, packed: forkattn's prefix layout, PyTorch's
scores over the 6144 packed rows under the group's mask), head_dim 128, both KL directions. forkattn_kl_fwd/bwd get the same tensors' data_ptr() (device memory, the
CUDA primary context is shared); the current stream is synchronized before each call.
Both are checked against each other, timed with CUDA events (warm-up, median), and
their peak memory is measured (torch.cuda.max_memory_allocated for PyTorch; for
forkattn the library's reported workspace plus its O(S*H) outputs, measured the same
way through the allocator for the inputs it shares).

Usage (on the GPU machine, library built with offload):
  OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/compare_kl.py \
      --lib build-gpu/libforkattn.so --out $OUT/compare_kl.json
  --million: also one head at 2^20 tokens, StreamKL only.
  --dtype bf16|f16: both sides in that dtype (the library then runs its tensor-core
  kernels; PyTorch its GEMMs and log_softmax in that dtype); kl and stats stay f32.
  --f32-precision high|highest|medium (f32 inputs): the context's f32_precision; high (the
  default) runs the forward on tensor cores from bf16 pieces, highest on the FP32 kernels
  (docs/numerics.md "f32 on tensor cores"); the backward runs the FP32 kernels either way.
"""
import argparse
import ctypes as C
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

# The binding's copies of the option structs (they set struct_size, docs/api.md ABI rules).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
from forkattn._lib import CtxOptions as CtxOpt, KlOptions as Opt  # noqa: E402

HOST, DEVICE = 0, 1


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("rows", C.c_int64), ("heads", C.c_int64),
                ("head_dim", C.c_int64), ("row_stride", C.c_int64), ("head_stride", C.c_int64)]


class Prefix(C.Structure):
    _fields_ = [("prompt_len", C.c_int64), ("num_responses", C.c_int64), ("offsets", C.c_void_p), ("mask", C.c_int)]


class Layout(C.Structure):
    _fields_ = [("prefix", C.c_void_p), ("tree", C.c_void_p)]


def load(path):
    lib = C.CDLL(path)
    lib.forkattn_ctx_options_init.argtypes = [C.POINTER(CtxOpt)]
    lib.forkattn_ctx_create.argtypes = [C.POINTER(C.c_void_p), C.POINTER(CtxOpt)]
    lib.forkattn_ctx_last_error.restype = C.c_char_p
    lib.forkattn_ctx_last_error.argtypes = [C.c_void_p]
    lib.forkattn_ctx_create_error.restype = C.c_char_p
    lib.forkattn_ctx_peak_workspace.restype = C.c_size_t
    lib.forkattn_ctx_peak_workspace.argtypes = [C.c_void_p]
    lib.forkattn_kl_fwd.argtypes = [C.c_void_p] * 11 + [C.c_int]
    lib.forkattn_kl_bwd.argtypes = [C.c_void_p] * 14 + [C.c_int]
    return lib


def ctx_options(lib, backend):
    """forkattn_ctx_options_init()'s defaults with the given backend."""
    opt = CtxOpt()
    lib.forkattn_ctx_options_init(C.byref(opt))
    opt.backend = backend
    return opt


DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # forkattn_dtype


def tdesc(x):
    s, h, d = x.shape
    assert x.dtype in DTYPES and x.is_contiguous()
    return Tensor(x.data_ptr(), DTYPES[x.dtype], s, h, d, h * d, d)


class Stream:
    """forkattn StreamKL on device pointers: a causal sequence of S rows, or a GRPO group (group=(P, N,
    R): a prompt of P rows and N responses of R rows, packed)."""

    def __init__(self, lib, ctx, S, reverse, group=None):
        self.lib, self.ctx = lib, ctx
        if group:
            P, N, R = group
            self.offsets = (C.c_int64 * (N + 1))(*[i * R for i in range(N + 1)])
            self.prefix = Prefix(P, N, C.cast(self.offsets, C.c_void_p), 0)
        else:
            self.prefix = Prefix(S, 0, None, 0)
        self.layout = Layout(C.addressof(self.prefix), None)
        self.opt = Opt(1 if reverse else 0, 0.0, 0.0, 1.0, 0)

    def check(self, rc):
        if rc:
            raise RuntimeError("forkattn: status %d: %s" % (rc, self.lib.forkattn_ctx_last_error(self.ctx)))

    def fwd(self, qt, kt, qs, ks, kl, stats):
        torch.cuda.current_stream().synchronize()
        self.check(self.lib.forkattn_kl_fwd(self.ctx, C.byref(self.layout), C.byref(tdesc(qt)), C.byref(tdesc(kt)),
                                            C.byref(tdesc(qs)), C.byref(tdesc(ks)), None, C.byref(self.opt),
                                            kl.data_ptr(), stats.data_ptr(), None, DEVICE))

    def bwd(self, qt, kt, qs, ks, stats, dkl, dqs, dks):
        torch.cuda.current_stream().synchronize()
        self.check(self.lib.forkattn_kl_bwd(self.ctx, C.byref(self.layout), C.byref(tdesc(qt)), C.byref(tdesc(kt)),
                                            C.byref(tdesc(qs)), C.byref(tdesc(ks)), None, C.byref(self.opt),
                                            stats.data_ptr(), dkl.data_ptr(), C.byref(tdesc(dqs)),
                                            C.byref(tdesc(dks)), None, None, DEVICE))


def group_mask(P, N, R, device):
    """[T, T] visibility of a packed GRPO group (T = P + N R): the prompt causal, each response its
    prompt and itself causally."""
    T = P + N * R
    seq = torch.cat([torch.full((P,), -1), torch.arange(N).repeat_interleave(R)]).to(device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return causal & ((seq[None, :] == -1) | (seq[:, None] == seq[None, :]))


def torch_kl(qt, kt, qs, ks, reverse, mask=None):
    """Materialized: [H, S, S] scores, the mask (causal by default), log_softmax, KL per (row, head) -> [S, H]."""
    S, H, d = qt.shape
    scale = 1.0 / math.sqrt(d)
    if mask is None:
        mask = torch.ones(S, S, dtype=torch.bool, device=qt.device).tril()
    # a large finite fill, not -inf: (-inf) - (-inf) = NaN would poison autograd through torch.where
    lt = torch.log_softmax((torch.einsum("shd,thd->hst", qt, kt) * scale).masked_fill(~mask, -1e30), -1)
    ls = torch.log_softmax((torch.einsum("shd,thd->hst", qs, ks) * scale).masked_fill(~mask, -1e30), -1)
    if reverse:
        term = torch.where(mask, ls.exp() * (ls - lt), torch.zeros((), device=qt.device))
    else:
        term = torch.where(mask, lt.exp() * (lt - ls), torch.zeros((), device=qt.device))
    return term.sum(-1).transpose(0, 1)


def timed(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def case(lib, ctx, S, H, d, reverse, reps, with_torch=True, dtype=torch.float32, group=None):
    """One comparison: a causal sequence of S rows, or (group=(P, N, R), S = P + N R) a packed GRPO group
    against PyTorch's materialized KL over the same packed rows under the group's mask."""
    g = torch.Generator(device="cuda").manual_seed(S * 131 + H)
    mk = lambda: torch.randn(S, H, d, device="cuda", generator=g).to(dtype)
    qt, kt, qs, ks = mk(), mk(), mk(), mk()
    st = Stream(lib, ctx, S, reverse, group)
    mask = group_mask(*group, qt.device) if group else None
    kl = torch.empty(S, H, device="cuda")
    stats = torch.empty(S, H, 4, device="cuda")
    dkl = torch.full((S, H), 1.0 / (S * H), device="cuda")
    dkl_t = dkl.to(dtype)  # PyTorch's upstream gradient, in the output's dtype
    dqs, dks = torch.empty_like(qs), torch.empty_like(ks)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    ms_f = timed(lambda: st.fwd(qt, kt, qs, ks, kl, stats), reps)
    ms_b = timed(lambda: st.bwd(qt, kt, qs, ks, stats, dkl, dqs, dks), reps)
    ws = lib.forkattn_ctx_peak_workspace(ctx)
    stream_mib = (ws + (kl.numel() + stats.numel() + dkl.numel()) * 4) / 2**20
    r = {"seq": S, "group": list(group) if group else None, "heads": H, "d": d,
         "dtype": str(dtype).replace("torch.", ""), "reverse": reverse,
         "stream_fwd_ms": ms_f, "stream_bwd_ms": ms_b,
         "stream_extra_mib": stream_mib}
    if with_torch:
        qs_r, ks_r = qs.clone().requires_grad_(), ks.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = torch_kl(qt, kt, qs_r, ks_r, reverse, mask)
        (out * dkl_t).sum().backward()
        torch.cuda.synchronize()
        r["torch_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        r["err_kl"] = rel(kl, out.detach().float())
        r["err_dq"], r["err_dk"] = rel(dqs.float(), qs_r.grad.float()), rel(dks.float(), ks_r.grad.float())
        del out
        qs_r.grad = ks_r.grad = None

        def tf():
            with torch.no_grad():
                torch_kl(qt, kt, qs_r, ks_r, reverse, mask)

        def tb_prep():
            return torch_kl(qt, kt, qs_r, ks_r, reverse, mask)

        r["torch_fwd_ms"] = timed(tf, reps)
        holder = {}

        def tb():
            holder["o"].backward((dkl_t,))

        # backward alone: rebuild the graph outside the timed region each time
        times = []
        for i in range(reps + 1):
            holder["o"] = tb_prep()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            tb()
            e1.record()
            torch.cuda.synchronize()
            if i:
                times.append(e0.elapsed_time(e1))
            qs_r.grad = ks_r.grad = None
        r["torch_bwd_ms"] = statistics.median(times)
        holder.clear()
        r["speedup_fwd"] = r["torch_fwd_ms"] / ms_f
        r["speedup_bwd"] = r["torch_bwd_ms"] / ms_b
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-gpu/libforkattn.so")
    ap.add_argument("--out", default="compare_kl.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--million", action="store_true")
    ap.add_argument("--million-bwd", action="store_true")
    ap.add_argument("--no-cases", action="store_true", help="skip the S=4096/16384 and GRPO-group comparisons")
    ap.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32")
    ap.add_argument("--commit", help="the library's commit (default: git rev-parse --short HEAD here)")
    ap.add_argument("--f32-precision", choices=("high", "highest", "medium"), default="high",
                    help="how the GPU context multiplies f32 inputs (forkattn_ctx_options.f32_precision)")
    a = ap.parse_args()
    lib = load(a.lib)
    ctx = C.c_void_p()
    o = ctx_options(lib, 2)
    o.f32_precision = {"high": 0, "highest": 1, "medium": 2}[a.f32_precision]
    if lib.forkattn_ctx_create(C.byref(ctx), C.byref(o)):
        sys.exit("no GPU context: %s" % lib.forkattn_ctx_create_error())
    rows = []
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    # causal sequences, then a GRPO group (prompt 2048, 8 responses of 512: 6144 packed rows)
    for S, H, group in () if a.no_cases else ((4096, 16, None), (16384, 4, None), (6144, 16, (2048, 8, 512))):
        for rev in (False, True):
            rows.append(case(lib, ctx, S, H, 128, rev, a.reps, dtype=dt, group=group))
            print(json.dumps(rows[-1]), flush=True)
    if a.million:
        S = 1 << 20
        g = torch.Generator(device="cuda").manual_seed(7)
        qt, kt, qs, ks = (torch.randn(S, 1, 128, device="cuda", generator=g) for _ in range(4))
        st = Stream(lib, ctx, S, False)
        kl, stats = torch.empty(S, 1, device="cuda"), torch.empty(S, 1, 4, device="cuda")
        torch.cuda.synchronize()
        t0 = time.time()
        st.fwd(qt, kt, qs, ks, kl, stats)
        torch.cuda.synchronize()
        r = {"seq": S, "heads": 1, "d": 128, "stream_fwd_s": time.time() - t0,
             "stream_extra_mib": (lib.forkattn_ctx_peak_workspace(ctx) + 5 * S * 4) / 2**20,
             "materialized_would_need_gib": 2 * S * S * 4 / 2**30, "kl_mean": float(kl.mean()),
             "kl_finite": bool(torch.isfinite(kl).all())}
        if a.million_bwd:
            dkl = torch.full((S, 1), 1.0 / S, device="cuda")
            dqs, dks = torch.empty_like(qs), torch.empty_like(ks)
            t0 = time.time()
            st.bwd(qt, kt, qs, ks, stats, dkl, dqs, dks)
            torch.cuda.synchronize()
            r["stream_bwd_s"] = time.time() - t0
            r["grads_finite"] = bool(torch.isfinite(dqs).all() and torch.isfinite(dks).all())
        rows.append(r)
        print(json.dumps(r), flush=True)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d"), "dtype": a.dtype, "f32_precision": a.f32_precision, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
