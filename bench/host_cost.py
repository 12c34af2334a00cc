#!/usr/bin/env python3
"""What a call costs the host with its plan cached, through C and through the Python binding.

The C calls: forkattn_prefix_* / forkattn_tree_* through ctypes (arguments built once,
compare_torch.Forkattn), queued on PyTorch's stream.

Per case and direction (forward; backward), medians in µs:
  alone   the host time of one call made after a synchronize (the GPU idle): what the library
          does on the host per call, its launches included; the target is under 10 µs;
  queued  the host time per call of --burst calls made back to back: the same when nothing in the
          library waits for the GPU, and near the GPU time when something does (a copy the driver
          must stage, a queue that fills), which takes away the host's lead over the GPU;
  gpu     CUDA-event time of one call.
`ctypes floor` is a call into the library that does nothing (forkattn_build_has_offload): part of
every row, as it is of a binding's call. A second table times the Python binding on the same
inputs (bench/grid.py's binding_call: varlen_attention with cu_seqlens on the device,
prefix_attention, tree_attention): the forward as autograd records it (inputs that need
gradients) and forward+backward (torch.autograd.grad), alone and queued, beside a do-nothing
autograd.Function's forward+backward (the engine's floor, which SDPA pays too). With --trace,
each case runs a few calls more on a context created with FORKATTN_GPU_TRACE=1, whose phases
(views, maps, blocks, upload, the launches) go to stderr.

Cases: the tiny call, dense varlen batches (8 x 2048, 64 x 512, 256 x 128, 4096 x 4), two GRPO
groups and the random RL trie of bench/grid.py; --cases takes a comma-separated subset of
tiny, 8x2048, 64x512, 256x128, 4096x4, grpo-n8, grpo-n16, trie (--device cpu: small versions of
tiny, 256x128, grpo-n8 and trie).
Usage (GPU machine, offload build):
  OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/host_cost.py --lib build-gpu/libforkattn.so
--device cpu runs the same on the CPU backend (host pointers, calls that return when done: a smoke
test; its times are the kernels')."""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402
import grid  # noqa: E402

CASES = {
    "tiny": lambda: grid.dense(1, 64, 8, 8, 64, True, "tiny"),
    "8x2048": lambda: grid.dense(8, 2048, 32, 8, 128, True),
    "64x512": lambda: grid.dense(64, 512, 16, 16, 128, True),
    "256x128": lambda: grid.dense(256, 128, 32, 8, 64, True),
    "4096x4": lambda: grid.dense(4096, 4, 16, 16, 64, True),
    "grpo-n8": lambda: grid.grpo(8, 1024, 256, 8, 2, 64),
    "grpo-n16": lambda: grid.grpo(16, 4096, 1024, 32, 8, 128),
    "trie": lambda: grid.trie(96, 1024, 16, 256, 16, 4, 128, 1),
}
SMALL = {"tiny": lambda: grid.dense(1, 16, 2, 2, 64, True, "tiny"),  # --device cpu: the same kinds, small
         "256x128": lambda: grid.dense(16, 8, 2, 1, 64, True),
         "grpo-n8": lambda: grid.grpo(3, 24, 8, 2, 1, 64),
         "trie": lambda: grid.trie(12, 32, 4, 16, 2, 1, 64, 1)}


def median_us(xs):
    return 1e6 * statistics.median(xs)


def alone(fn, cuda, reps):
    """Host time of single calls, each after a synchronize."""
    xs = []
    for _ in range(reps):
        ct.sync(cuda)
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    ct.sync(cuda)
    return median_us(xs)


def queued(fn, cuda, burst, rounds):
    """Host time per call of `burst` calls back to back (median over rounds)."""
    xs = []
    for _ in range(rounds):
        ct.sync(cuda)
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        xs.append((time.perf_counter() - t0) / burst)
    ct.sync(cuda)
    return median_us(xs)


def gpu(fn, cuda, reps):
    """CUDA-event time of one call (compare_torch.time_once), median in µs; NaN on the CPU."""
    if not cuda:
        return float("nan")
    return 1e3 * statistics.median(ct.time_once(fn, cuda) for _ in range(reps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="build-gpu/libforkattn.so")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cases", default="", help="comma-separated (default: every case of the device)")
    ap.add_argument("--reps", type=int, default=200, help="calls timed alone (median)")
    ap.add_argument("--burst", type=int, default=50, help="calls back to back in a queued round")
    ap.add_argument("--rounds", type=int, default=10, help="queued rounds (median)")
    ap.add_argument("--trace", action="store_true", help="a few more calls on a FORKATTN_GPU_TRACE=1 context")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("host_cost: no CUDA device (--device cpu for the CPU backend)")
    table = CASES if cuda else SMALL
    names = [n for n in a.cases.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit("host_cost: unknown case(s) %s (%s)" % (", ".join(unknown), ", ".join(table)))
    fa = ct.Forkattn(a.lib, cuda, stream=cuda)
    traced = None
    if a.trace and cuda:
        os.environ["FORKATTN_GPU_TRACE"] = "1"  # read when the context is created
        traced = ct.Forkattn(a.lib, cuda, stream=True)
        del os.environ["FORKATTN_GPU_TRACE"]
    floor = fa.lib.forkattn_build_has_offload
    print("%s, forkattn %s (%s); µs, medians: alone %d calls, queued %d rounds of %d" % (
        torch.cuda.get_device_name() if cuda else "CPU backend", fa.version, fa.reason, a.reps, a.rounds, a.burst))
    print("ctypes floor: %.2f" % alone(floor, False, a.reps))
    print()
    print("| case | rows | fwd alone | fwd queued | fwd gpu | bwd alone | bwd queued | bwd gpu |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    binding_rows = []
    for name in names:
        case = table[name]()
        t = ct.inputs(case.spec, "cuda" if cuda else "cpu")
        fwd, bwd = fa.prepared(case.spec.layout, t)
        for _ in range(5):  # plans cached, pools filled, launches direct
            fwd()
            bwd()
        r = [alone(fwd, cuda, a.reps), queued(fwd, cuda, a.burst, a.rounds), gpu(fwd, cuda, a.reps // 4 + 1),
             alone(bwd, cuda, a.reps), queued(bwd, cuda, a.burst, a.rounds), gpu(bwd, cuda, a.reps // 4 + 1)]
        cells = " | ".join("—" if x != x else "%.1f" % x for x in r)  # no GPU time on the CPU backend
        print("| %s | %d | %s |" % (case.name, case.spec.layout.rows, cells), flush=True)
        if traced is not None:
            tf, tb = traced.prepared(case.spec.layout, t)
            for _ in range(3):
                tf()
                tb()
            ct.sync(cuda)
            sys.stderr.flush()
            print("  (traced: %s, 3 forward and backward calls above on stderr)" % case.name, flush=True)
        binding_rows.append((case.name, binding_row(case, t, cuda, a)))
        del t
        if cuda:
            torch.cuda.empty_cache()
    floor = _floor_fb("cuda" if cuda else "cpu")
    print()
    print("The binding (µs, medians; an empty autograd.Function's forward+backward alone: %.1f):"
          % alone(floor, cuda, a.reps))
    print()
    print("| case | fwd alone | fwd queued | fwd+bwd alone | fwd+bwd queued |")
    print("|---|---:|---:|---:|---:|")
    for name, r in binding_rows:
        print("| %s | %s |" % (name, " | ".join("%.1f" % x for x in r)))


def binding_row(case, t, cuda, a):
    """Host times of the binding's forward (recorded by autograd) and forward+backward, alone and queued."""
    call = grid.binding_call(case, t["q"].device)
    q, k, v = (t[n].detach().requires_grad_() for n in ("q", "k", "v"))
    fwd = lambda: call(q, k, v)
    fwd_bwd = lambda: torch.autograd.grad(call(q, k, v), (q, k, v), t["do"])
    for _ in range(5):
        fwd_bwd()
    return [alone(fwd, cuda, a.reps), queued(fwd, cuda, a.burst, a.rounds),
            alone(fwd_bwd, cuda, a.reps), queued(fwd_bwd, cuda, a.burst, a.rounds)]


class _Empty(torch.autograd.Function):
    """No work: what any Python autograd.Function costs forward and backward."""

    @staticmethod
    def forward(ctx, q):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        return g


def _floor_fb(dev):
    q = torch.randn(64, 8, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(q)
    return lambda: torch.autograd.grad(_Empty.apply(q), (q,), g)


if __name__ == "__main__":
    main()
