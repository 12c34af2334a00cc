#!/usr/bin/env python3
"""Where a call through the Python binding spends its time, against the C call and SDPA.

For each case (varlen causal attention, bf16) it times forkattn.varlen_attention (cu_seqlens on
the GPU and on the host; eager calls as users make them, which run the autograd.Function, a
forward under torch.no_grad, and the torch.library custom op forced in eager mode), the same call
through C with ctypes arguments built once (compare_torch's binding, on torch's stream), and SDPA
on the sequences' batch, forward and forward+backward, and prints per call the wall time on the
CPU, the CUDA-event time, the kernel time and the phases of profile_calls.py (torch.profiler).
For the tiny case it splits a forward+backward's host time by phase (the forward, the autograd
engine until it enters the binding's backward, that backward, the engine after it) beside SDPA's
and an autograd.Function that does no work (the floor of a Python backward), with the autograd
engine's worker threads on and off (torch.autograd.set_multithreading_enabled); with --cpp-floor
also the same do-nothing function as a C++ autograd op (torch.utils.cpp_extension.load_inline,
which needs a C++ compiler and ninja: the floor a compiled binding would have); and a cProfile
of the binding's tiny call shows the Python functions that cost most. The wall
time minus the kernels is the host's cost per call: the binding's Python and PyTorch's dispatch
on top of the library's host work (the C row).

Usage (GPU machine, offload build):
  OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/profile_binding.py \\
      --lib build-gpu/libforkattn.so [--cases tiny,dense,varlen] [--cpp-floor]
"""
import argparse
import cProfile
import io
import os
import pstats
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

CASES = {  # name: (sequences, rows each, query heads, KV heads, head_dim)
    "tiny": (1, 64, 8, 8, 64),
    "dense": (1, 4096, 16, 16, 128),
    "varlen": (64, 512, 16, 16, 128),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="build-gpu/libforkattn.so")
    ap.add_argument("--cases", default="tiny,dense,varlen")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpp-floor", action="store_true",
                    help="also time a do-nothing C++ autograd op (builds it with load_inline)")
    a = ap.parse_args()
    os.environ["FORKATTN_LIBRARY"] = os.path.abspath(a.lib)
    import torch
    import torch.nn.functional as F
    import forkattn
    import compare_torch as ct
    import profile_calls as pc

    dev, bf = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), "forkattn", forkattn.__version__ if hasattr(forkattn, "__version__") else "")
    fa = ct.Forkattn(a.lib, True, True)
    for name in a.cases.split(","):
        B, L, hq, hkv, d = CASES[name]
        T = B * L
        q = torch.randn(T, hq, d, device=dev, dtype=bf, requires_grad=True)
        k = torch.randn(T, hkv, d, device=dev, dtype=bf, requires_grad=True)
        v = torch.randn(T, hkv, d, device=dev, dtype=bf, requires_grad=True)
        dout = torch.randn_like(q)
        heads = lambda x: x.detach().view(B, L, x.shape[1], d).transpose(1, 2).contiguous().requires_grad_()
        qs, ks, vs = heads(q), heads(k), heads(v)
        douts = dout.view(B, L, hq, d).transpose(1, 2).contiguous()
        cu_d = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
        print("== %s: %d x %d rows, %d/%d heads, d %d" % (name, B, L, hq, hkv, d), flush=True)
        for label, cu in (("cu on the GPU", cu_d), ("cu on the host", cu_d.cpu())):
            f = lambda: forkattn.varlen_attention(q, k, v, cu, cu, L, L)
            pc.report("  binding fwd (%s)" % label, f, a.reps, None)
            pc.report("  binding fwd+bwd (%s)" % label, lambda: f().backward(dout), a.reps, None)
        cu_h = cu_d.cpu()
        f = lambda: forkattn.varlen_attention(q, k, v, cu_h, cu_h, L, L)

        def no_grad():
            with torch.no_grad():
                return f()
        pc.report("  binding fwd under torch.no_grad", no_grad, a.reps, None)
        mode = forkattn.ops.USE_CUSTOM_OPS
        forkattn.ops.USE_CUSTOM_OPS = True
        pc.report("  binding fwd (custom op in eager)", f, a.reps, None)
        pc.report("  binding fwd+bwd (custom op in eager)", lambda: f().backward(dout), a.reps, None)
        forkattn.ops.USE_CUSTOM_OPS = mode
        t = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "do": dout, "o": torch.empty_like(q),
             "lse": torch.empty(T, hq, device=dev), "dq": torch.empty_like(q), "dk": torch.empty_like(k),
             "dv": torch.empty_like(v)}
        lay = ct.Layout("prefix", [L], [-1]) if B == 1 else ct.Layout("prefix", [0] + [L] * B, [-1] + [0] * B)
        cf, cb = fa.prepared(lay, t)
        pc.report("  C fwd", cf, a.reps, None)
        pc.report("  C fwd+bwd", lambda: (cf(), cb()), a.reps, None)
        s = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        pc.report("  SDPA fwd", s, a.reps, None)
        pc.report("  SDPA fwd+bwd", lambda: s().backward(douts), a.reps, None)
        if name == "tiny":
            backward_phases(forkattn, q, k, v, cu_h, L, dout, qs, ks, vs, douts,
                            cpp=cpp_floor() if a.cpp_floor else None)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                forkattn.varlen_attention(q, k, v, cu_h, cu_h, L, L).backward(dout)
            torch.cuda.synchronize()
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14)
            print(out.getvalue())
        del q, k, v, t
        torch.cuda.empty_cache()


# A C++ autograd op doing what Floor does (nothing): the engine's own cost without a Python backward.
CPP_FLOOR = r"""
#include <torch/extension.h>
struct Floor : public torch::autograd::Function<Floor> {
  static at::Tensor forward(torch::autograd::AutogradContext *, at::Tensor q, at::Tensor, at::Tensor) {
    return at::empty_like(q);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *,
                                                 torch::autograd::variable_list g) {
    return {g[0], at::empty_like(g[0]), at::empty_like(g[0])};
  }
};
at::Tensor floor_op(at::Tensor q, at::Tensor k, at::Tensor v) { return Floor::apply(q, k, v); }
TORCH_LIBRARY(forkattn_profile_floor, m) { m.def("floor(Tensor q, Tensor k, Tensor v) -> Tensor"); }
TORCH_LIBRARY_IMPL(forkattn_profile_floor, CompositeImplicitAutograd, m) { m.impl("floor", floor_op); }
"""


def cpp_floor():
    """The C++ Floor op (built on first use), or None with the reason printed."""
    import torch
    try:
        from torch.utils.cpp_extension import load_inline
        load_inline("forkattn_profile_floor", cpp_sources=[CPP_FLOOR], is_python_module=False,
                    extra_cflags=["-O2"])
        return torch.ops.forkattn_profile_floor.floor
    except Exception as e:  # no compiler or ninja: the row is left out
        print("  (no C++ floor: %s)" % str(e).splitlines()[0][:200])
        return None


def backward_phases(forkattn, q, k, v, cu, L, dout, qs, ks, vs, douts, reps=50, cpp=None):
    """Host time of a forward+backward by phase (perf_counter, medians, µs): the forward call, the
    autograd engine until it enters VarlenAttentionFunction.backward (on its device thread for
    CUDA), that backward, and the engine after it; SDPA's forward and backward beside it."""
    import statistics
    import time
    import torch
    import torch.nn.functional as F

    fn = forkattn.ops.VarlenAttentionFunction
    inner, marks = fn.backward, {}

    def backward(ctx, *grads):
        marks["in"] = time.perf_counter()
        r = inner(ctx, *grads)
        marks["out"] = time.perf_counter()
        return r
    fn.backward = staticmethod(backward)

    class Floor(torch.autograd.Function):
        """No work at all: what any Python autograd.Function costs the engine (its floor)."""

        @staticmethod
        def forward(ctx, q, k, v):
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, g):
            return g, torch.empty_like(g), torch.empty_like(g)

    def measure(suffix):
        rows = {}
        for i in range(reps + 10):
            for x in (q, k, v, qs, ks, vs):
                x.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = forkattn.varlen_attention(q, k, v, cu, cu, L, L)
            t1 = time.perf_counter()
            o.backward(dout)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            t4 = time.perf_counter()
            o.backward(douts)
            t5 = time.perf_counter()
            torch.cuda.synchronize()
            for x in (q, k, v):
                x.grad = None
            t6 = time.perf_counter()
            o = Floor.apply(q, k, v)
            o.backward(dout)
            t7 = time.perf_counter()
            torch.cuda.synchronize()
            t8 = t9 = 0.0
            if cpp is not None:
                for x in (q, k, v):
                    x.grad = None
                t8 = time.perf_counter()
                cpp(q, k, v).backward(dout)
                t9 = time.perf_counter()
                torch.cuda.synchronize()
            if i < 10:
                continue
            for key, val in (("binding forward", t1 - t0), ("engine until backward", marks["in"] - t1),
                             ("binding backward", marks["out"] - marks["in"]),
                             ("engine after backward", t2 - marks["out"]), ("binding fwd+bwd", t2 - t0),
                             ("SDPA forward", t4 - t3), ("SDPA backward (engine)", t5 - t4),
                             ("SDPA fwd+bwd", t5 - t3), ("empty Function fwd+bwd", t7 - t6)) + \
                    ((("empty C++ op fwd+bwd", t9 - t8),) if cpp is not None else ()):
                rows.setdefault(key + suffix, []).append(val)
        return rows

    try:
        rows = measure("")
        # the engine runs a CUDA backward on its device thread, which a Python backward must enter
        # with the GIL; without its worker threads the backward runs on the calling thread
        with torch.autograd.set_multithreading_enabled(False):
            rows.update(measure(", no engine threads"))
    finally:
        fn.backward = inner
    print("  host time by phase (perf_counter, grads reset each step, median of %d, µs):" % reps)
    for key, val in rows.items():
        print("    %-44s %7.1f" % (key, 1e6 * statistics.median(val)))


if __name__ == "__main__":
    main()
