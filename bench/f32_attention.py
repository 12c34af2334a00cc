#!/usr/bin/env python3
"""float32 attention on one GPU: forkattn at each f32_precision against SDPA in float32, side by
side in one process, with each output's error against float64.

Per case (float32 inputs q in [-2, 2], k, v, dout in [-1, 1]; softmax scale 1/sqrt(d)), timed
forward and forward+backward (gradients of sum(o * dout)) through the Python binding
(varlen_attention for dense cases, prefix_attention for a GRPO group) with the default contexts at
(forkattn.configure, which the autograd thread's backward follows) f32_precision "high" (the default: bf16x6 products on tensor cores), "medium" (bf16x3)
and "highest" (float32 CUDA-core kernels), and scaled_dot_product_attention in float32 (enable_gqa,
on the sequences' batch; N copies of prompt + response for a group). Times are medians of
CUDA-event times in interleaved rounds (compare_torch.time_rounds), each precision's with SDPA's. Errors: max |o - o64| / max
|o64| against SDPA's math kernel in float64 on the same inputs, for every implementation (SDPA's
own float32 error included, as the yardstick), and the largest of the three gradients' errors,
measured the same way against SDPA's float64 gradients of sum(o * dout).

Usage (GPU machine, offload build):
  OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/f32_attention.py \\
      --lib build-gpu/libforkattn.so
  --results PATH (default bench/RESULTS.md, '' for none): replace its section between
  <!-- f32:begin --> and <!-- f32:end --> (appended the first time).
"""
import argparse
import os
import sys
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402  (timing, results file, commit and device names)

BEGIN, END = "<!-- f32:begin -->", "<!-- f32:end -->"
PRECISIONS = ("high", "medium", "highest")
# name, sequences, rows a sequence, hq, hkv, d, causal; or a group: ("grpo", N, P, R, hq, hkv, d)
CASES = (
    ("dense causal 1 x 16 x 4096, d128", 1, 4096, 16, 16, 128, True),
    ("dense causal 8 x 32/8 x 2048, d128", 8, 2048, 32, 8, 128, True),
    ("dense bidirectional 2 x 16 x 2048, d128", 2, 2048, 16, 16, 128, False),
    ("dense causal 4 x 14/2 x 1024, d64", 4, 1024, 14, 2, 64, True),
    ("GRPO N=8 P=1024 R=256, 8/2, d64", "grpo", 8, 1024, 256, 8, 2, 64),
)


def dense_case(name, n, L, hq, hkv, d, causal):
    def fa_call(q, k, v):
        cu = torch.arange(0, (n + 1) * L, L, dtype=torch.int32, device=q.device)
        return forkattn.varlen_attention(q, k, v, cu, cu, L, L, causal=causal)

    def sdpa(q, k, v):  # packed [n L, h, d] -> [n, h, L, d]
        b = [x.view(n, L, x.shape[1], d).transpose(1, 2) for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*b, is_causal=causal, enable_gqa=hq != hkv)
        return o.transpose(1, 2).reshape(n * L, hq, d)

    return types.SimpleNamespace(name=name, rows=n * L, hq=hq, hkv=hkv, d=d, fa=fa_call, sdpa=sdpa, sdpa_of=None,
                                 flops=4.0 * n * L * L * hq * d * (0.5 if causal else 1.0))


def grpo_case(name, N, P, R, hq, hkv, d):
    lay = forkattn.SharedPrefixLayout.from_lengths([P], [[R] * N])
    idx = torch.cat([torch.cat([torch.arange(P), P + i * R + torch.arange(R)]) for i in range(N)])

    def fa_call(q, k, v):
        return forkattn.prefix_attention(q, k, v, lay)

    def sdpa(q, k, v):  # N copies of prompt + response, causal
        ix = idx.to(q.device)
        b = [x[ix].view(N, P + R, x.shape[1], d).transpose(1, 2) for x in (q, k, v)]
        return F.scaled_dot_product_attention(*b, is_causal=True, enable_gqa=hq != hkv)

    def sdpa_of(o_rep):  # the packed rows of the replicated output: the prompt from copy 0
        o = o_rep.transpose(1, 2).reshape(N * (P + R), hq, d)
        first = torch.cat([torch.arange(P)] + [i * (P + R) + P + torch.arange(R) for i in range(N)])
        return o[first.to(o.device)]

    return types.SimpleNamespace(name=name, rows=P + N * R, hq=hq, hkv=hkv, d=d, fa=fa_call, sdpa=sdpa,
                                 sdpa_of=sdpa_of, flops=4.0 * N * (P + R) ** 2 * hq * d * 0.5)


def make_case(spec, div):
    if spec[1] == "grpo":
        name, _, N, P, R, hq, hkv, d = spec
        return grpo_case(name, N, P // div, R // div, hq, hkv, d)
    name, n, L, hq, hkv, d, causal = spec
    return dense_case(name, n, L // div, hq, hkv, d, causal)


def err(o, ref):
    return ((o.double() - ref).abs().max() / ref.abs().max()).item()


def run_case(c, a):
    dev = a.device
    g = torch.Generator(device=dev).manual_seed(a.seed)
    q = (torch.rand(c.rows, c.hq, c.d, device=dev, generator=g) * 4 - 2).requires_grad_()
    k = (torch.rand(c.rows, c.hkv, c.d, device=dev, generator=g) * 2 - 1).requires_grad_()
    v = (torch.rand(c.rows, c.hkv, c.d, device=dev, generator=g) * 2 - 1).requires_grad_()
    do = torch.rand(c.rows, c.hq, c.d, device=dev, generator=g) * 2 - 1
    # float64 reference: o, and the gradients of sum(o * do) over the packed rows
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64 = c.sdpa(*x64)
    o64 = c.sdpa_of(o64) if c.sdpa_of else o64
    (o64 * do.double()).sum().backward()
    g64 = [t.grad for t in x64]
    o64 = o64.detach()
    del x64
    rec = {"case": c.name, "gflop": c.flops / 1e9}

    def impl(name, f):
        with torch.no_grad():
            o = f(q, k, v)
        dout = do if o.shape == do.shape else torch.rand_like(o) * 2 - 1  # SDPA's replicated batch

        def fwd():
            with torch.no_grad():
                f(q, k, v)

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            f(q, k, v).backward(dout)

        q.grad = k.grad = v.grad = None
        o_ = f(q, k, v)
        o_ = c.sdpa_of(o_) if name == "sdpa" and c.sdpa_of else o_
        (o_ * do).sum().backward()
        rec[name] = {"err": err(o_.detach(), o64), "gerr": max(err(t.grad, r) for t, r in zip((q, k, v), g64))}
        del o_
        return [(rec[name], "fwd", fwd), (rec[name], "fwd_bwd", fwd_bwd)]

    # A precision is set process-wide (forkattn.configure), so the backward on autograd's thread runs
    # at it too. Each precision is timed in
    # its own interleaved rounds with SDPA (the contexts are re-created when it changes); its ratio
    # is to that group's SDPA time.
    sdpa_timers = impl("sdpa", c.sdpa)
    for p in PRECISIONS:
        forkattn.configure(f32_precision=p)
        group = {}
        ct.time_rounds([(group, key, fn) for _, key, fn in sdpa_timers] + impl(p, c.fa), a)
        rec[p]["sdpa"] = group
        if p == PRECISIONS[0]:
            rec["sdpa"].update(group)
    forkattn.configure(f32_precision=PRECISIONS[0])
    return rec


def line(rec):
    s = rec["sdpa"]
    cells = [rec["case"], "%.3f / %.3f" % (s.get("fwd", float("nan")), s.get("fwd_bwd", float("nan")))]
    for p in PRECISIONS:
        r = rec[p]
        g = r["sdpa"]  # SDPA timed in the same rounds
        cells.append("%.3f / %.3f (%.2f× / %.2f×)" % (r.get("fwd", float("nan")), r.get("fwd_bwd", float("nan")),
                                                      g["fwd"] / r["fwd"], g["fwd_bwd"] / r["fwd_bwd"]))
    cells.append(" / ".join("%.1e" % rec[x]["err"] for x in ("sdpa",) + PRECISIONS))
    cells.append(" / ".join("%.1e" % rec[x]["gerr"] for x in ("sdpa",) + PRECISIONS))
    return "| " + " | ".join(cells) + " |"


def section(meta, recs):
    head = ["### float32 attention: forkattn's f32 precisions against SDPA (f32_attention)", "",
            "`bench/f32_attention.py`: float32 inputs through the binding at f32_precision high (bf16 pieces, "
            "bf16x6 products on tensor cores; the default), medium (bf16x3) and highest (float32 "
            "CUDA-core kernels), against `scaled_dot_product_attention` in float32 on the same card, one process; "
            "ms forward / forward+backward (median of CUDA-event times, interleaved rounds; the precision set by "
            "forkattn.configure, so the autograd thread's backward runs at it too) and SDPA's time, taken in "
            "the same rounds, over forkattn's. The backward runs at the same precision as the forward (split dQ and dK/dV teams at high and medium). Errors: max |o − o64| / "
            "max |o64| against SDPA in float64, and the largest of dq's, dk's and dv's (gradients of sum(o * dout), "
            "dout in [-1, 1]) likewise.", "",
            "%s, commit %s, torch %s. Command: `%s`" % (meta["device"], meta["commit"], torch.__version__, meta["cmd"]),
            "",
            "| case | SDPA f32 ms | high ms (×SDPA) | medium ms (×SDPA) | highest ms (×SDPA) | o error: SDPA / high / "
            "medium / highest | gradient error: SDPA / high / medium / highest |",
            "|---|---|---|---|---|---|---|"]
    return "\n".join(head + [line(r) for r in recs]) + "\n"


def main():
    global forkattn
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default="build-gpu/libforkattn.so")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--filter", default="")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke test of the script (the CPU backend has one f32 precision)")
    ap.add_argument("--div", type=int, default=1, help="sequence lengths divided by this (smoke tests)")
    ap.add_argument("--results", default=os.path.join(ct.REPO, "bench", "RESULTS.md"))
    ap.add_argument("--commit")
    a = ap.parse_args()
    a.cuda = a.device == "cuda"
    os.environ.setdefault("FORKATTN_LIBRARY", os.path.abspath(a.lib))
    import forkattn as fa_mod

    forkattn = fa_mod
    recs = []
    for spec in CASES:
        if a.filter.lower() not in spec[0].lower():
            continue
        rec = run_case(make_case(spec, a.div), a)
        print(line(rec), flush=True)
        recs.append(rec)
    meta = {"device": ct.device_name(a.cuda), "commit": ct.git_commit(a), "cmd": ct.command_line()}
    text = section(meta, recs)
    print(text)
    if a.results:
        ct.write_results(a.results, text, BEGIN, END)


forkattn = None

if __name__ == "__main__":
    main()
