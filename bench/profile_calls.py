#!/usr/bin/env python3
"""Where a forkattn GPU call's time goes: kernels against everything else.

Runs compare_torch.py's cases on device pointers under torch.profiler (CUPTI records every
kernel of the process, the library's too, and the CUDA driver calls the offload runtime makes),
after a warm-up, and prints per call: the wall time on the CPU, the summed kernel time, the
kernels one by one (mean microseconds) and the driver and runtime calls that took the most time.
Wall time minus kernel time is what the library's host side, the offload runtime's launches and
synchronizations, and the ctypes call cost; compare_torch's CUDA-event times include all of it.
The timeline line splits a call (between the two CUDA events around it, from the profiler's
trace) into: before its first GPU activity, its kernels, the gaps between its activities, and
after the last one.

Usage (on the GPU machine, library built with offload):
  bash bench/gpu_run.sh python3 bench/profile_calls.py --lib build-gpu/libforkattn.so \
      [--cases 1,2] [--reps 10] [--trace $OUT/trace.json]
"""
import argparse
import collections
import json
import math
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402  (its cases, inputs and ctypes binding)


def median_us(fn, reps, cuda):
    """Median microseconds of reps calls timed as compare_torch times them: CUDA events on torch's
    stream around the call (cuda), or the wall clock (fn synchronizes torch's stream first)."""
    return statistics.median(ct.time_once(fn, cuda) for _ in range(reps)) * 1e3


def profiled(fn, reps, trace):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernels, api = collections.defaultdict(list), collections.defaultdict(list)
    for e in prof.events():
        dev = getattr(e, "device_type", None)
        if dev is not None and "CUDA" in str(dev):
            kernels[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
        elif e.name.startswith(("cu", "cuda")):
            api[e.name].append(e.cpu_time_total)
    return kernels, api


def timeline(path):
    """Median phases of the profiled calls, from a chrome trace of calls timed by CUDA events
    (compare_torch.time_once): each call lies between two cudaEventRecord calls on the CPU. Returns {phase: microseconds}: before (first
    record to the first GPU activity: the synchronize, host staging, copies, the launch), kernels
    (their summed durations), gaps (between a call's GPU activities), after (the last activity's
    end to the second record: the wait and the return)."""
    with open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    rec = sorted(e["ts"] for e in ev if e["name"].startswith("cudaEventRecord"))
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("cat")) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy"))
    phases = collections.defaultdict(list)
    for t0, t1 in zip(rec[0::2], rec[1::2]):
        acts = [a for a in gpu if t0 <= a[0] <= t1]
        if not acts:
            continue
        phases["before"].append(acts[0][0] - t0)
        phases["kernels"].append(sum(a[1] - a[0] for a in acts if a[2] == "kernel"))
        phases["gaps"].append(sum(max(0.0, b[0] - a[1]) for a, b in zip(acts, acts[1:])))
        phases["after"].append(t1 - max(a[1] for a in acts))
    return {k: statistics.median(v) for k, v in phases.items()}


def report(label, fn, reps, trace):
    for _ in range(3):
        fn()
    wall = median_us(fn, reps, False)
    events = median_us(fn, reps, True)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or os.path.join(tmp, "trace.json")
        kernels, api = profiled(lambda: ct.time_once(fn, True), reps, path)
        ph = timeline(path)
    ktot = sum(sum(v) for v in kernels.values()) / reps
    print("%s: wall %.1f us, CUDA events %.1f us, kernels %.1f us per call; wall - kernels %.1f us" %
          (label, wall, events, ktot, wall - ktot))
    print("  timeline (median us): before the first GPU activity %.1f, kernels %.1f, gaps between %.1f, "
          "after the last %.1f" % tuple(ph.get(k, math.nan) for k in ("before", "kernels", "gaps", "after")))
    for name, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        print("  kernel %7.1f us x %.1f per call  %s" % (statistics.mean(v), len(v) / reps, name[:90]))
    for name, v in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print("  api    %7.1f us x %.1f per call  %s" % (statistics.mean(v), len(v) / reps, name[:90]))
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="build-gpu/libforkattn.so")
    ap.add_argument("--cases", default="1,2")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trace", help="chrome traces to PREFIX.fwdN.json, PREFIX.bwdN.json")
    ap.add_argument("--stream", action="store_true",
                    help="calls queued on torch's stream (forkattn_ctx_set_stream), as compare_torch's first row")
    a = ap.parse_args()
    a.cuda, a.small = True, False
    dev = torch.device("cuda")
    fa = ct.Forkattn(a.lib, True, a.stream)
    print("forkattn %s: %s" % (fa.version, fa.reason))
    for i, n in enumerate(int(x) for x in a.cases.split(",")):
        spec = ct.case_spec(n, a, 1234)
        torch.manual_seed(n)
        t = ct.inputs(spec, dev)
        fwd, bwd = fa.prepared(spec.layout, t)
        print("case %d (%s): %s" % (n, spec.name, spec.desc))
        report("  forward", fwd, a.reps, a.trace + ".fwd%d.json" % n if a.trace else None)
        report("  backward", bwd, a.reps, a.trace + ".bwd%d.json" % n if a.trace else None)
        report("  forward+backward", lambda: (fwd(), bwd()), a.reps, a.trace + ".both%d.json" % n if a.trace else None)
        del t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
