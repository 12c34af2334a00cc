#!/usr/bin/env python3
"""A shape grid of forkattn against PyTorch on one GPU, side by side in one process.

Per case (bf16 inputs, softmax scale 1/sqrt(d)), each timed forward and forward+backward
(gradients of sum(o * dout), dout random):
  forkattn binding: forkattn.varlen_attention (dense cases; int32 cu_seqlens on the inputs' device,
      as flash-attn takes them),
      forkattn.prefix_attention with a SharedPrefixLayout (GRPO groups) or forkattn.tree_attention
      with a TreeLayout (the trie), backward by autograd on the binding's outputs;
  forkattn C: the C library's forkattn_prefix_* / forkattn_tree_* through ctypes, arguments built
      once, calls queued on PyTorch's stream (compare_torch.py's first row);
  SDPA: scaled_dot_product_attention (enable_gqa) on the head-major batch [B, H, L, d]: the
      sequences of a dense case, or N copies of prompt + response of a GRPO group;
  flex_attention: compiled, with the layout's block mask (GRPO groups and the trie; eager and
      forward only on the CPU).
Times are medians of CUDA-event times (compare_torch.time_rounds): the implementations take turns
in --rounds interleaved rounds; a case gets at most --reps timed samples per implementation, fewer
(not under --min-reps) where one round of them takes longer than --case-seconds allows. A sample
is one call timed alone (the GPU idle before it, so the host's time until its first kernel counts),
or with --queue N, N calls back to back divided by N (what a call costs in a stream of calls, such
as a model's layers, where its host work overlaps the GPU's earlier calls).

Grid (--grid): dense = varlen sequences {1x4096, 1x16384, 4x8192, 8x2048, 64x512, 256x128} x
heads q/kv {32/8, 16/16, 14/2, 28/4} x d {64, 128} x {causal, bidirectional}; grpo = GRPO groups
(N responses of R rows sharing a P-row prompt) and a random RL trie (compare_torch's case 3);
full = both and a tiny call (one sequence of 64 rows, 8 heads, d 64), the shared-prefix cases first;
quick = a few tiny shapes of every kind (a smoke test, --device cpu). --filter keeps the cases
whose name holds one of its comma-separated substrings (--list prints them).
A case whose replicated PyTorch batch would not fit the free memory is skipped with a note.

Correctness: every forkattn output (o, dq, dk, dv of the binding and of the C calls) against a
float32 reference from the same bf16 inputs (compare_torch.reference), passing when its max abs
error is at most 2x PyTorch's bf16 error on it + 1e-3 (compare_torch.check). The C calls' outputs
are NaN-filled before their checked run; the binding's are allocated in freed NaN-filled blocks
(CUDA's caching allocator reuses them). The exit status is 1 when a check fails or a forkattn call
errs.

Usage (on the GPU machine, library built with offload; the full grid is sized for under 8 minutes
on an H100):
  OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/grid.py \\
      --lib build-gpu/libforkattn.so --json $OUT/grid.json
  --results PATH (default bench/RESULTS.md, '' for none): replace its section between
  <!-- grid:begin --> and <!-- grid:end --> (appended the first time); written after every case.
  --time-limit SECONDS (default 480, 0 for none): start no case after that (the table lists the
  rest as not run). Below the table, per forkattn path and direction: the geometric mean of SDPA's
  time over forkattn's and the cases where forkattn is the slower.
  --device cpu --quick: the quick grid on the CPU backend with host pointers (its times mean
  little: PyTorch's and the library's OpenMP runtimes share the cores).
"""
import argparse
import collections
import json
import math
import os
import random
import statistics
import sys
import time
import types
import warnings
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402  (its ctypes binding, inputs, reference, timing and checks)

BEGIN, END = "<!-- grid:begin -->", "<!-- grid:end -->"
DENSE_SHAPES = ((1, 4096), (1, 16384), (4, 8192), (8, 2048), (64, 512), (256, 128))
DENSE_HEADS = ((32, 8), (16, 16), (14, 2), (28, 4))
GRPO_GROUPS = (  # N, P, R, hq, hkv, d
    (16, 1024, 1024, 14, 2, 64), (4, 512, 128, 16, 4, 128), (8, 1024, 256, 8, 2, 64),
    (8, 4096, 2048, 28, 4, 128), (16, 4096, 1024, 32, 8, 128), (16, 16384, 1024, 32, 8, 128),
    (64, 2048, 512, 32, 8, 128))
IMPLS = ("binding", "c", "sdpa", "flex")
HEADING = "### Shape grid against PyTorch (grid)"
DESCRIPTION = """\
`bench/grid.py` times forkattn through its Python binding and through the C library (calls on
PyTorch's stream) against SDPA (the sequences' batch; N copies of prompt + response for a GRPO
group) and compiled flex_attention (the layout's block mask) over a grid of shapes: dense varlen
sequences x heads x d x causal/bidirectional, GRPO groups, a random RL trie and a tiny call; bf16,
forward and forward+backward, median of CUDA-event times in interleaved rounds, every forkattn
output checked against a float32 reference. Command (GPU machine, offload build; the full grid is
sized for under 8 minutes on an H100, and `--time-limit`, default 480 s, starts no case after
that): `OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/grid.py --lib
build-gpu/libforkattn.so --json $OUT/grid.json` (`--grid dense|grpo`, `--filter SUBSTR` for part
of it). The block below is written by the script (`--results`)."""
LABELS = {"binding": "forkattn binding", "c": "forkattn C", "sdpa": "SDPA", "flex": "flex_attention"}

Case = collections.namedtuple("Case", "name kind spec")


def dense(n, L, hq, hkv, d, causal, kind="dense"):
    """n sequences of L rows: a prefix layout with an empty prompt (plain varlen attention)."""
    lay = ct.Layout("prefix", [0] + [L] * n, [-1] + [0] * n, causal)
    name = "%s %dx%d %d/%d d%d %s" % (kind, n, L, hq, hkv, d, "causal" if causal else "bidir")
    desc = "%d sequence%s of %d rows, %s" % (n, "s" * (n > 1), L, "causal" if causal else "bidirectional")
    return Case(name, kind, ct.Spec(name, desc, lay, hq, hkv, ("sdpa",), d))


def grpo(N, P, R, hq, hkv, d):
    lay = ct.Layout("prefix", [P] + [R] * N, [-1] + [0] * N)
    name = "GRPO N%d P%d R%d %d/%d d%d" % (N, P, R, hq, hkv, d)
    desc = "N=%d responses of R=%d sharing P=%d, %d rows packed" % (N, R, P, lay.rows)
    return Case(name, "grpo", ct.Spec(name, desc, lay, hq, hkv, ("sdpa", "flex"), d))


def trie(nodes, prompt, lo, hi, hq, hkv, d, seed):
    lay = ct.Layout("tree", *ct.random_trie(random.Random(seed), nodes, prompt, lo, hi))
    name = "trie %d nodes %d rows %d/%d d%d" % (nodes, lay.rows, hq, hkv, d)
    desc = "random RL trie: a %d-row prompt, nodes of %d..%d rows, %d leaves" % (prompt, lo, hi, len(lay.leaves))
    return Case(name, "trie", ct.Spec(name, desc, lay, hq, hkv, ("flex",), d))


def grid(which, seed):
    tiny = [dense(1, 64, 8, 8, 64, True, "tiny")]
    if which == "quick":
        return [dense(2, 64, 4, 2, 64, True), dense(2, 48, 4, 4, 128, False), tiny[0],
                grpo(3, 40, 24, 4, 2, 64), trie(12, 32, 4, 16, 4, 2, 64, seed)]
    cases = []  # the shared-prefix cases first: a --time-limit cuts dense ones
    if which in ("full", "grpo"):
        cases += [grpo(*g) for g in GRPO_GROUPS] + [trie(96, 1024, 16, 256, 16, 4, 128, seed)]
    if which == "full":
        cases += tiny
    if which in ("full", "dense"):
        cases += [dense(n, L, hq, hkv, d, causal) for n, L in DENSE_SHAPES for hq, hkv in DENSE_HEADS
                  for d in (64, 128) for causal in (True, False)]
    return cases


def binding_call(case, dev):
    """The binding's attention on packed q, k, v for the case's layout."""
    import forkattn

    lay = case.spec.layout
    if case.kind == "grpo":
        layout = forkattn.SharedPrefixLayout([lay.lengths[0]], lay.lengths[1:], [len(lay.lengths) - 1])
        return lambda q, k, v: forkattn.prefix_attention(q, k, v, layout)
    if case.kind == "trie":
        layout = forkattn.TreeLayout(torch.tensor(lay.offsets), torch.tensor(lay.parents))
        return lambda q, k, v: forkattn.tree_attention(q, k, v, layout)
    cu, longest = torch.tensor(lay.offsets[1:], dtype=torch.int32, device=dev), max(lay.lengths)
    return lambda q, k, v: forkattn.varlen_attention(q, k, v, cu, cu, longest, longest, causal=lay.causal)


def poison_allocator(t):
    """Free NaN-filled blocks of the binding's output sizes, for the caching allocator to hand out
    as its outputs: rows a call leaves unwritten then read NaN rather than an earlier result."""
    if t["q"].is_cuda:
        blocks = [torch.full_like(t[n], math.nan) for n in ("q", "lse", "q", "k", "v")]
        del blocks


def run_binding(case, t, ref):
    r = {"name": LABELS["binding"], "impl": "binding"}
    try:
        call = binding_call(case, t["q"].device)
        q, k, v = (t[n].detach().requires_grad_() for n in ("q", "k", "v"))

        def fwd():
            with torch.no_grad():
                return call(q, k, v)

        def fwd_bwd():
            o = call(q, k, v)
            return (o,) + torch.autograd.grad(o, (q, k, v), t["do"])
        poison_allocator(t)
        outs = [x.detach() for x in fwd_bwd()]
        r["written"] = all(bool(torch.isfinite(x).all()) for x in outs)
        r["err"] = {n: ct.max_err(x, ref[n]) for n, x in zip(ct.OUTS, outs)}
        del outs
        return r, [(r, "fwd_ms", fwd), (r, "fwd_bwd_ms", fwd_bwd)]
    except Exception as e:  # recorded; the other implementations still run
        r["error"] = ct.describe(e)
        return r, []


def replicated_bytes(spec):
    """A bound on the memory a case needs: PyTorch's head-major copies with their outputs and
    gradients (K/V counted at Hq heads, in case GQA is expanded), the packed tensors of both
    forkattn paths, and the float32 reference with its chunk of scores."""
    lay, d = spec.layout, spec.d
    rows = len(lay.leaves) * lay.path_rows(lay.leaves[0]) if "sdpa" in spec.torch else lay.rows
    torch_side = rows * d * 2 * (4 * spec.hq + 6 * spec.hq)
    packed = lay.rows * d * 2 * 2 * (4 * spec.hq + 4 * spec.hkv) + lay.rows * spec.hq * 8
    scores = min(1 << 28, spec.hq * lay.rows * lay.rows)  # compare_torch.reference's chunk
    ref = lay.rows * d * 4 * 4 * (spec.hq + spec.hkv) + 6 * 4 * scores
    return torch_side + packed + ref


def free_bytes(cuda):
    if cuda:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf")


def case_timing(timers, a):
    """a's timing options for this case: --reps calls each, fewer (at least --min-reps) where a
    round of every implementation's calls would exceed --case-seconds; two untimed calls of each
    first (the second's time is the estimate; the first compiles where it must)."""
    est = 0.0
    for r, _, fn in timers:
        try:
            fn()
            est += ct.time_once(fn, a.cuda) / 1e3
        except Exception as e:
            r["error"] = ct.describe(e)
    est *= a.queue  # a timed sample is --queue calls
    reps = a.reps if est <= 0 else max(a.min_reps, min(a.reps, int(a.case_seconds / est)))
    return types.SimpleNamespace(reps=reps, rounds=max(1, min(a.rounds, reps)), warmup=a.warmup, cuda=a.cuda,
                                 queue=a.queue)


def run_case(i, case, a, fa, dev):
    spec = case.spec
    lay = spec.layout
    rec = {"case": i, "name": case.name, "kind": case.kind, "desc": spec.desc, "rows": lay.rows, "hq": spec.hq,
           "hkv": spec.hkv, "d": spec.d, "causal": lay.causal, "useful_gflop": 4e-9 * spec.d * spec.hq * lay.pairs,
           "ideal_ratio": lay.replicated_pairs / lay.pairs, "impls": []}
    need, free = replicated_bytes(spec), free_bytes(a.cuda)
    if need > 0.9 * free:
        rec["skipped"] = "needs about %.1f GiB, %.1f GiB free" % (need / 2**30, free / 2**30)
        return rec
    torch.manual_seed(a.seed + zlib.crc32(case.name.encode()))  # the same inputs whatever --filter keeps
    t = ct.inputs(spec, dev)
    ref = ct.reference(t, lay, torch.float32)
    rows, timers = [], []
    r, more = run_binding(case, t, ref)
    rows.append(r)
    timers += more
    r, more = ct.run_forkattn(fa, lay, t, ref, a)
    r.update(name=LABELS["c"], impl="c")
    rows.append(r)
    timers += more
    for impl, (label, note, make) in zip(spec.torch, ct.torch_impls(spec, t, a.cuda, dev)):
        if impl == "flex" and a.no_flex:
            continue
        r, more = ct.run_torch(label, note, make, ref, a)
        r.update(name=LABELS[impl], impl=impl)
        rows.append(r)
        timers += more
    timing = case_timing(timers, a)
    ct.time_rounds(timers, timing)
    rec.update(reps=timing.reps, rounds=timing.rounds)
    del timers
    torch_rows = [r for r in rows if r["impl"] in ("sdpa", "flex")]
    for r in rows[:2]:
        r["check"] = ct.check(r, torch_rows, t, lay, ref)
    rec["impls"] = rows
    rec["pass"] = all(r["check"]["pass"] for r in rows[:2])
    ratios(rec)
    return rec


def ratios(rec):
    """PyTorch's time over forkattn's (above 1: forkattn is faster) and, where the replicated
    batch does more work than the packed rows, that ratio over the FLOP ratio."""
    by = {r["impl"]: r for r in rec["impls"]}
    out = rec["ratios"] = {}
    for base in ("sdpa", "flex"):
        for fa in ("binding", "c"):
            for k in ("fwd", "fwd_bwd"):
                x, y = by.get(base, {}).get(k + "_ms"), by.get(fa, {}).get(k + "_ms")
                if x and y:
                    out["%s/%s %s" % (base, fa, k)] = x / y
                    if base == "sdpa" and rec["ideal_ratio"] > 1.0001:
                        out["reached %s %s" % (fa, k)] = x / y / rec["ideal_ratio"]


def num(x, spec="%.3f"):
    return "—" if x is None else spec % x


def pair(r, spec="%.3f"):
    if r is None:
        return "—"
    if "error" in r:
        return "error"
    return "%s / %s" % (num(r.get("fwd_ms"), spec), num(r.get("fwd_bwd_ms"), spec))


def table(cases):
    lines = ["| case | binding ms fwd / f+b | C ms fwd / f+b | SDPA ms fwd / f+b | flex ms fwd / f+b | "
             "SDPA / binding | SDPA / C | flex / C | ideal | reached (C) | check |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        if "skipped" in c or "not_run" in c:
            lines.append("| %s | | | | | | | | | | %s |" % (c["name"], "skipped" if "skipped" in c else "not run"))
            continue
        by, q = {r["impl"]: r for r in c["impls"]}, c["ratios"]
        rat = lambda key: "%s / %s" % (num(q.get(key + " fwd"), "%.2f"), num(q.get(key + " fwd_bwd"), "%.2f"))
        ideal = c["ideal_ratio"] > 1.0001
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            c["name"], pair(by.get("binding")), pair(by.get("c")), pair(by.get("sdpa")), pair(by.get("flex")),
            rat("sdpa/binding") if "sdpa" in by else "—", rat("sdpa/c") if "sdpa" in by else "—",
            rat("flex/c") if "flex" in by else "—", num(c["ideal_ratio"] if ideal else None, "%.2f"),
            rat("reached c") if ideal and "sdpa" in by else "—", "PASS" if c["pass"] else "FAIL"))
    return lines


def notes(cases):
    lines = []
    for c in cases:
        if "skipped" in c:
            lines.append("- %s: skipped, %s." % (c["name"], c["skipped"]))
        for r in c.get("impls", ()):
            if "error" in r:
                lines.append("- %s: %s: %s." % (c["name"], r["name"], ct.cell(r["error"])))
            elif r.get("note"):
                lines.append("- %s: %s: %s." % (c["name"], r["name"], r["note"]))
            if "check" in r and not r["check"]["pass"]:
                lines.append("- %s: check of %s FAILED: %s." % (c["name"], r["name"], r["check"]["why"]))
    lines += slower(cases)
    not_run = [c["name"] for c in cases if "not_run" in c]
    if not_run:
        lines.append("- Not run (--time-limit): %d cases, from %s." % (len(not_run), not_run[0]))
    return lines


def slower(cases):
    """Per forkattn path and direction: the geometric mean of SDPA's time over forkattn's, and the
    cases where forkattn is the slower."""
    lines = []
    for fa in ("c", "binding"):
        for k, what in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
            key = "sdpa/%s %s" % (fa, k)
            have = [c for c in cases if key in c.get("ratios", {})]
            if not have:
                continue
            slow = [c for c in have if c["ratios"][key] < 1]
            mean = math.exp(statistics.fmean(math.log(c["ratios"][key]) for c in have))
            lines.append("- SDPA / %s, %s: geometric mean %.2f over %d cases; slower than SDPA in %d%s" % (
                LABELS[fa], what, mean, len(have), len(slow),
                (": " + ", ".join("%s (%.2f)" % (c["name"], c["ratios"][key]) for c in slow) if slow else "") + "."))
    return lines


def section(meta, cases):
    queue = meta.get("queue", 1)
    how = ("each call timed alone (the GPU idle before it: the host's time before the first kernel counts)"
           if queue == 1 else "each sample %d calls back to back, divided by %d (host time hidden under the "
           "GPU's earlier calls where it is shorter)" % (queue, queue))
    head = ("%s, %s, torch %s, commit %s; forkattn %s, %s backend on %s pointers; seed %d; median of at most %d "
            "samples (at least %d) in at most %d interleaved rounds, about %g s of calls per case, %s; %.0f s in "
            "all." % (meta["date"], meta["device"], meta["torch"], meta["commit"], meta["forkattn"], meta["backend"],
                      meta["memory"], meta["seed"], meta["reps"], meta["min_reps"], meta["rounds"],
                      meta["case_seconds"], how, meta["elapsed_s"]))
    expl = ("Times in ms, forward / forward+backward (gradients of sum(o·dout)). Ratios: PyTorch's time over "
            "forkattn's (above 1: forkattn is faster). ideal: FLOPs of the replicated batch over the packed "
            "rows'; reached: SDPA / C over ideal (the binding's in the JSON). A check passes when every output "
            "of both forkattn paths is within 2x PyTorch's bf16 error + %g of a float32 reference, all "
            "written." % ct.ABS_TOL)
    return "\n".join(["#### The latest run", "", head, "", "Command: `%s`" % meta["command"], ""] + table(cases)
                     + ["", expl, ""] + notes(cases)) + "\n"


def write_results(path, text):
    """The section between the markers; the first time, appended with its heading and description
    at the end of the file (its GPU part)."""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if BEGIN not in old or END not in old:
            with open(path, "w") as f:
                f.write(old.rstrip("\n") + "\n\n%s\n\n%s\n\n%s\n%s\n" % (HEADING, DESCRIPTION, BEGIN, END))
    ct.write_results(path, text, BEGIN, END)


def summary(c):
    if "skipped" in c:
        return "skipped: " + c["skipped"]
    by = {r["impl"]: r for r in c["impls"]}
    parts = ["%s %s ms" % (LABELS[k], pair(by[k])) for k in IMPLS if k in by]
    return "; ".join(parts) + "; check %s" % ("PASS" if c["pass"] else "FAIL")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", help="libforkattn (default: $FORKATTN_LIBRARY, else build-gpu/ on cuda, build/ on cpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--grid", choices=("full", "dense", "grpo", "quick"), default="full")
    ap.add_argument("--quick", action="store_true", help="--grid quick")
    ap.add_argument("--filter", default="",
                    help="only the cases whose name contains this, or one of these comma-separated strings "
                         "(case-insensitive)")
    ap.add_argument("--reps", type=int, help="most timed calls per implementation and case (default 20; quick 3)")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, help="interleaved timing rounds (default 4; quick 1)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before the first round")
    ap.add_argument("--queue", type=int, default=1,
                    help="calls back to back in one timed sample, its time divided by them (default 1: "
                         "each call timed alone, the GPU idle before it)")
    ap.add_argument("--case-seconds", type=float, default=0.8, help="time of timed calls to aim for per case")
    ap.add_argument("--time-limit", type=float, default=480, help="start no case after this many seconds (0: none)")
    ap.add_argument("--no-flex", action="store_true", help="leave flex_attention out")
    ap.add_argument("--list", action="store_true", help="print the selected cases' names and stop")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--results", default=os.path.join(ct.REPO, "bench", "RESULTS.md"), help="'' for none")
    ap.add_argument("--commit", help="build's commit (default: git rev-parse --short HEAD)")
    a = ap.parse_args()
    quick = a.quick or a.grid == "quick"
    a.reps = a.reps or (3 if quick else 20)
    a.rounds = a.rounds or (1 if quick else 4)
    a.min_reps = min(a.min_reps, a.reps)
    if a.queue < 1:
        ap.error("--queue must be at least 1")
    a.cuda = a.device == "cuda"
    a.lib = os.path.abspath(a.lib or os.environ.get("FORKATTN_LIBRARY") or os.path.join(
        ct.REPO, "build-gpu" if a.cuda else "build", "libforkattn.so"))
    os.environ["FORKATTN_LIBRARY"] = a.lib  # the binding loads the same library
    dev = torch.device(a.device)
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # the CPU's eager one
    if a.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32
    cfg = torch._dynamo.config  # every flex_attention case compiles its shapes: no fallback to eager
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 1024)
    wanted = [f.strip().lower() for f in a.filter.split(",")]
    cases = [c for c in grid("quick" if quick else a.grid, a.seed) if any(f in c.name.lower() for f in wanted)]
    if a.list:
        print("\n".join(c.name for c in cases))
        return
    fa = ct.Forkattn(a.lib, a.cuda, a.cuda)
    start = time.time()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": ct.device_name(a.cuda), "torch": torch.__version__,
            "commit": ct.git_commit(a), "command": ct.command_line(), "forkattn": fa.version,
            "backend": "gpu" if a.cuda else "cpu", "memory": "device" if a.cuda else "host",
            "backend_reason": fa.reason, "seed": a.seed, "reps": a.reps, "min_reps": a.min_reps, "rounds": a.rounds,
            "warmup": a.warmup, "case_seconds": a.case_seconds, "queue": a.queue, "lib": a.lib}
    print("%s; forkattn %s: %s; %d cases" % (meta["device"], fa.version, fa.reason, len(cases)), flush=True)
    done, ok = [], True
    for i, case in enumerate(cases):
        if a.time_limit and time.time() - start > a.time_limit:
            done += [{"name": c.name, "kind": c.kind, "not_run": True} for c in cases[i:]]
            print("time limit: %d cases not run" % (len(cases) - i), flush=True)
            break
        print("[%d/%d %.0fs] %s: %s, %d/%d heads" % (i + 1, len(cases), time.time() - start, case.name,
                                                    case.spec.desc, case.spec.hq, case.spec.hkv), flush=True)
        t0 = time.time()
        try:
            rec = run_case(i, case, a, fa, dev)
        except Exception as e:  # the reference or the inputs (out of memory): recorded, the grid goes on
            rec = {"case": i, "name": case.name, "kind": case.kind, "skipped": ct.describe(e)}
        if a.cuda:
            torch.cuda.empty_cache()
        rec["seconds"] = time.time() - t0
        done.append(rec)
        ok = ok and rec.get("pass", True) and not any(
            "error" in r for r in rec.get("impls", ()) if r["impl"] in ("binding", "c"))
        print("  " + summary(rec), flush=True)
        for line in notes([rec]):
            print("  " + line, flush=True)
        meta["elapsed_s"] = time.time() - start
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "passed": ok, "cases": done}, f, indent=1)
        if a.results:
            write_results(a.results, section(meta, done))
    meta["elapsed_s"] = time.time() - start
    print("\n" + section(meta, done))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
