#!/usr/bin/env python3
"""forkattn's attention against PyTorch's on one GPU, side by side in one process.

Cases (bf16 inputs, f32 lse, forkattn outputs in bf16, d = 128, softmax scale 1/sqrt(d)):
  1. dense causal attention, 16 heads x 4096 rows: SDPA(is_causal) vs forkattn_prefix_fwd/bwd on
     one sequence (prompt_len = 4096, no responses);
  2. a GRPO group, N=16 responses of R=1024 rows sharing a P=4096-row prompt, 32 query / 8 KV
     heads: replicated SDPA on [16, 32, 5120, 128] (GQA), compiled flex_attention over the packed
     P + N*R rows with a shared-prefix block mask, forkattn_prefix_fwd/bwd on the packed rows;
  3. a random RL trie (96 nodes packed depth first: a 1024-row prompt, nodes of 16..256 rows),
     16 query / 4 KV heads: compiled flex_attention with the tree's mask vs forkattn_tree_fwd/bwd.
Each is timed forward and forward+backward (gradients of sum(o * dout), dout random). PyTorch gets
head-major [B, H, L, d] copies of the packed [T, H, d] rows that forkattn reads (made before
timing; flex_attention's block mask too); forkattn gets the torch tensors' data_ptr() (device
memory; its ctypes arguments are built once per case, as a binding would cache them). forkattn is
timed two ways (--calls both, the default): its context queued on PyTorch's current stream
(forkattn_ctx_set_stream; calls return without waiting, as PyTorch's do; the first row, which
speedups are relative to), and with synchronous calls, PyTorch's stream synchronized before each
(as compare_kl.py does). CUDA events around each call, then a synchronize; warm-up, median. The timed calls
are spread over --rounds interleaved rounds (forkattn, then each PyTorch implementation, again),
so that no implementation is timed only right after the float32 reference or only after another's
runs. TFLOP/s count useful FLOPs: 4*d*Hq*(visible query-key pairs) forward, 3.5x that
forward+backward, the same count for every implementation.

Correctness: a float32 reference from the same bf16 inputs, computed by the formulas in chunks of
query rows. forkattn's outputs are filled with NaN before its checked run and must all be written;
each of o, dq, dk, dv passes when its max abs error is at most 2x PyTorch's bf16 error on it (the
largest among the PyTorch kernels of the case; a naive bf16 computation where none produced that
output) + 1e-3. The exit status is 1 when a check fails or anything errs. StreamKL against
PyTorch is bench/compare_kl.py.

Usage (on the GPU machine, library built with offload):
  OMP_TARGET_OFFLOAD=mandatory bash bench/gpu_run.sh python3 bench/compare_torch.py \
      --lib build-gpu/libforkattn.so --json $OUT/compare_torch.json
  --results PATH (default bench/RESULTS.md, '' for none): replace its section between
  <!-- compare_torch:begin --> and <!-- compare_torch:end --> (appended the first time).
  --device cpu: the same on the CPU backend with host pointers, lengths /16 and heads /4
  (flex_attention forward only, eager): a smoke test, its times mean little (PyTorch's and the
  library's OpenMP runtimes share the cores). --small: lengths /4 (about 16x fewer FLOPs).
"""
import argparse
import collections
import ctypes as C
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from compare_kl import DEVICE, HOST, CtxOpt, Prefix, Tensor, ctx_options

BACKEND_CPU, BACKEND_GPU = 1, 2  # forkattn_backend
BF16 = 1  # FORKATTN_DTYPE_BF16
CAUSAL, BIDIRECTIONAL = 0, 1  # forkattn_mask
D = 128
OUTS = ("o", "dq", "dk", "dv")
ABS_TOL = 1e-3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- compare_torch:begin -->", "<!-- compare_torch:end -->"
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

Spec = collections.namedtuple("Spec", "name desc layout hq hkv torch d", defaults=(D,))


class TreeC(C.Structure):
    _fields_ = [("num_nodes", C.c_int64), ("node_offsets", C.c_void_p), ("parents", C.c_void_p)]


class LibraryError(RuntimeError):
    pass


def softmax_scale(x):
    """1/sqrt(d) of a tensor [..., d]."""
    return 1.0 / math.sqrt(x.shape[-1])


def load(path):
    lib = C.CDLL(path)
    lib.forkattn_ctx_options_init.argtypes = [C.POINTER(CtxOpt)]
    lib.forkattn_ctx_create.argtypes = [C.POINTER(C.c_void_p), C.POINTER(CtxOpt)]
    for name in ("forkattn_ctx_last_error", "forkattn_ctx_backend_reason"):
        getattr(lib, name).restype = C.c_char_p
        getattr(lib, name).argtypes = [C.c_void_p]
    lib.forkattn_ctx_create_error.restype = C.c_char_p
    lib.forkattn_ctx_set_stream.argtypes = [C.c_void_p, C.c_void_p]
    lib.forkattn_version_string.restype = C.c_char_p
    for kind in ("prefix", "tree"):
        # ctx, layout, q, k, v, o, lse, scale, memory / ctx, layout, q, k, v, o, dout, lse, dq, dk, dv, scale, memory
        getattr(lib, "forkattn_%s_fwd" % kind).argtypes = [C.c_void_p] * 7 + [C.c_float, C.c_int]
        getattr(lib, "forkattn_%s_bwd" % kind).argtypes = [C.c_void_p] * 11 + [C.c_float, C.c_int]
    return lib


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def desc(x):
    """A forkattn_tensor of a bf16 torch tensor [rows, heads, d] with a contiguous last axis."""
    assert x.dtype == torch.bfloat16 and x.stride(2) == 1
    return C.byref(Tensor(x.data_ptr(), BF16, *x.shape, x.stride(0), x.stride(1)))


def int64_array(values):
    return (C.c_int64 * len(values))(*values)


class Forkattn:
    """A forkattn context: the GPU backend on device pointers, or the CPU backend on host pointers. With
    stream, its calls are queued on PyTorch's current CUDA stream (forkattn_ctx_set_stream) and return
    without waiting; without, each call waits for its kernels and PyTorch's stream is synchronized
    before it."""

    def __init__(self, path, cuda, stream=False):
        self.lib, self.cuda, self.stream = load(path), cuda, stream
        self.name = "forkattn, on torch's stream" if stream else "forkattn"
        self.memory = DEVICE if cuda else HOST
        self.ctx = C.c_void_p()
        opt = ctx_options(self.lib, BACKEND_GPU if cuda else BACKEND_CPU)
        if self.lib.forkattn_ctx_create(C.byref(self.ctx), C.byref(opt)):
            sys.exit("no forkattn context: %s" % self.lib.forkattn_ctx_create_error().decode())
        self.version = self.lib.forkattn_version_string().decode()
        self.reason = self.lib.forkattn_ctx_backend_reason(self.ctx).decode()
        if stream and self.lib.forkattn_ctx_set_stream(self.ctx, torch.cuda.current_stream().cuda_stream):
            sys.exit("forkattn_ctx_set_stream: %s" % self.lib.forkattn_ctx_last_error(self.ctx).decode())

    def _prepare(self, which, lay, *args):
        """The call as a closure whose ctypes arguments are built once, as a binding would cache
        them: the timed calls then measure the library (and the synchronize it needs), not the
        per-call marshalling of nine tensor descriptors in Python."""
        name = "forkattn_%s_%s" % (lay.kind, which)
        fn, full = getattr(self.lib, name), (self.ctx, C.byref(lay.c)) + args + (self.memory,)

        def call():
            if not self.stream:
                sync(self.cuda)
            rc = fn(*full)
            if rc:
                raise LibraryError("%s: status %d: %s" % (name, rc, self.lib.forkattn_ctx_last_error(self.ctx).decode()))
        return call

    def prepared(self, lay, t):
        """fwd() and bwd() closures on tensors t (their data pointers must not change)."""
        s = softmax_scale(t["q"])
        fwd = self._prepare("fwd", lay, desc(t["q"]), desc(t["k"]), desc(t["v"]), desc(t["o"]),
                            t["lse"].data_ptr(), s)
        bwd = self._prepare("bwd", lay, desc(t["q"]), desc(t["k"]), desc(t["v"]), desc(t["o"]), desc(t["do"]),
                            t["lse"].data_ptr(), desc(t["dq"]), desc(t["dk"]), desc(t["dv"]), s)
        return fwd, bwd


class Layout:
    """A forest packed depth first, every subtree a contiguous row range: node i owns rows
    [offsets[i], offsets[i+1]) and has parent parents[i] < i (-1: a root). A row sees every row of
    its node's ancestors and, causally, its own node's: row r sees key row j iff j <= r < end[j],
    end[j] being where the subtree of j's node ends; not causal, a row also sees every row of its own
    node. kind "prefix" (a root and its children; a root of 0 rows: plain variable-length attention)
    runs forkattn_prefix_*, "tree" (causal only) forkattn_tree_*."""

    def __init__(self, kind, lengths, parents, causal=True):
        self.kind, self.lengths, self.parents, self.causal = kind, lengths, parents, causal
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.rows = self.offsets[-1]
        self.above = [0] * len(lengths)  # rows of a node's strict ancestors
        for i in range(1, len(lengths)):
            if parents[i] >= 0:
                self.above[i] = self.above[parents[i]] + lengths[parents[i]]
        self.sub_end = self.offsets[1:]
        for i in reversed(range(len(lengths))):
            if parents[i] >= 0:
                self.sub_end[parents[i]] = max(self.sub_end[parents[i]], self.sub_end[i])
        self.leaves = sorted(set(range(len(lengths))) - set(parents))
        own = (lambda n: n * (n + 1) // 2) if causal else (lambda n: n * n)
        self.pairs = sum(n * a + own(n) for n, a in zip(lengths, self.above))
        self.replicated_pairs = sum(self.path_pairs(i, own) for i in self.leaves)
        self.c = self._c_struct()

    def path_rows(self, node):
        return self.above[node] + self.lengths[node]

    def path_pairs(self, node, own):
        """Visible pairs of the sequence of the root-to-node path alone."""
        pairs = 0
        while node >= 0:
            pairs += self.lengths[node] * self.above[node] + own(self.lengths[node])
            node = self.parents[node]
        return pairs

    def _c_struct(self):
        if self.kind == "prefix":
            assert all(p == 0 for p in self.parents[1:])
            P = self.lengths[0]
            self._arrays = [int64_array([o - P for o in self.offsets[1:]])]
            mask = CAUSAL if self.causal else BIDIRECTIONAL
            return Prefix(P, len(self.lengths) - 1, C.addressof(self._arrays[0]), mask)
        assert self.causal
        self._arrays = [int64_array(self.offsets), int64_array(self.parents)]
        return TreeC(len(self.lengths), *(C.addressof(x) for x in self._arrays))

    def row_end(self, dev):
        return torch.repeat_interleave(torch.tensor(self.sub_end), torch.tensor(self.lengths)).to(dev)

    def row_node_end(self, dev):
        """Where each row's node ends."""
        return torch.repeat_interleave(torch.tensor(self.offsets[1:]), torch.tensor(self.lengths)).to(dev)

    def sequences(self, dev):
        """[leaves, L]: the packed rows of every root-to-leaf sequence (they must have one length)."""
        seqs = []
        for leaf in self.leaves:
            path, node = [], leaf
            while node >= 0:
                path[:0] = range(self.offsets[node], self.offsets[node + 1])
                node = self.parents[node]
            seqs.append(path)
        return torch.tensor(seqs, device=dev)


def random_trie(rng, nodes, prompt, lo, hi):
    """Lengths and parents of a tree in depth-first order: a root of `prompt` rows, then nodes of
    lo..hi rows, each a child of a node on the path from the root to the previous node (the
    previous node itself half the time: multi-turn chains)."""
    lengths, parents, path = [prompt], [-1], [0]
    for i in range(1, nodes):
        depth = len(path) if rng.random() < 0.5 else rng.randint(1, len(path))
        path = path[:depth]
        parents.append(path[-1])
        lengths.append(rng.randint(lo, hi))
        path.append(i)
    return lengths, parents


def case_spec(n, a, seed):
    div = (4 if a.small else 1) * (1 if a.cuda else 16)
    hd = 1 if a.cuda else 4
    if n == 1:
        S, H = 4096 // div, 16 // hd
        return Spec("dense", "one causal sequence of %d rows, %d heads" % (S, H), Layout("prefix", [S], [-1]), H, H,
                    ("sdpa",))
    if n == 2:
        P, R, N, hq, hkv = 4096 // div, 1024 // div, 16, 32 // hd, 8 // hd
        lay = Layout("prefix", [P] + [R] * N, [-1] + [0] * N)
        desc = "N=%d responses of R=%d sharing P=%d, %d rows packed, %d/%d heads" % (N, R, P, lay.rows, hq, hkv)
        return Spec("GRPO", desc, lay, hq, hkv, ("sdpa", "flex"))
    if n == 3:
        lay = Layout("tree", *random_trie(random.Random(seed), 96, 1024 // div, max(1, 16 // div), 256 // div))
        hq, hkv = 16 // hd, 4 // hd
        desc = "random trie of %d nodes, %d rows (dedup %.2fx: %d leaves), %d/%d heads" % (
            len(lay.lengths), lay.rows, sum(map(lay.path_rows, lay.leaves)) / lay.rows, len(lay.leaves), hq, hkv)
        return Spec("tree", desc, lay, hq, hkv, ("flex",))
    raise SystemExit("no case %d" % n)


def inputs(spec, dev):
    T = spec.layout.rows
    mk = lambda h: torch.randn(T, h, spec.d, device=dev, dtype=torch.bfloat16)
    t = {"q": mk(spec.hq), "k": mk(spec.hkv), "v": mk(spec.hkv), "do": mk(spec.hq)}
    t.update(o=torch.empty_like(t["q"]), lse=torch.empty(T, spec.hq, device=dev), dq=torch.empty_like(t["q"]),
             dk=torch.empty_like(t["k"]), dv=torch.empty_like(t["v"]))
    return t


def reference(t, lay, dtype):
    """o, dq, dk, dv of the layout's attention in `dtype`, by the formulas (P = softmax, dP = dO V^T,
    dS = P (dP - rowsum(dO o)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO) over chunks of
    query rows of at most 2^28 scores: no rows x rows buffer."""
    q, k, v, do = (t[n].to(dtype) for n in ("q", "k", "v", "do"))
    T, hq, d = q.shape
    hkv = k.shape[1]
    g, s = hq // hkv, softmax_scale(q)
    end, rows = lay.row_end(q.device), torch.arange(T, device=q.device)
    node_end = None if lay.causal else lay.row_node_end(q.device)
    out = {"o": torch.empty_like(q), "dq": torch.empty_like(q), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v)}
    chunk = max(1, (1 << 28) // (hq * T))
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        qc, dc = q[r0:r1].view(r1 - r0, hkv, g, d), do[r0:r1].view(r1 - r0, hkv, g, d)
        k1 = r1 if lay.causal else int(node_end[r1 - 1])
        kc, vc = k[:k1], v[:k1]  # later keys are masked
        last = rows[r0:r1, None] if lay.causal else node_end[r0:r1, None] - 1  # last key row seen
        seen = (rows[:k1] <= last) & (rows[r0:r1, None] < end[:k1])
        p = torch.softmax((torch.einsum("chgd,khd->hgck", qc, kc) * s).masked_fill(~seen, -math.inf), -1)
        oc = torch.einsum("hgck,khd->chgd", p, vc)
        ds = p * (torch.einsum("chgd,khd->hgck", dc, vc) - (oc * dc).sum(-1).permute(1, 2, 0)[..., None])
        out["o"][r0:r1] = oc.reshape(r1 - r0, hq, d)
        out["dq"][r0:r1] = s * torch.einsum("hgck,khd->chgd", ds, kc).reshape(r1 - r0, hq, d)
        out["dk"][:k1] += s * torch.einsum("hgck,chgd->khd", ds, qc)
        out["dv"][:k1] += torch.einsum("hgck,chgd->khd", p, dc)
    return out


def max_err(x, ref):
    return float((x.float() - ref.float()).abs().max())


class TorchAttention:
    """A PyTorch implementation on head-major [B, H, L, d] copies of the packed rows: entry b holds
    rows idx[b]. A row held by several entries (a replicated prompt) gets its dout in the first
    only, so the loss is the packed one and the copies' gradients summed are the packed gradients."""

    def __init__(self, attend, idx, t, backward, mask_ms=None):
        self.attend, self.idx, self.backward, self.mask_ms = attend, idx, backward, mask_ms
        self.rows = t["q"].shape[0]
        B, L = idx.shape
        ids = torch.arange(B, device=idx.device)
        owner = torch.full((self.rows,), B, device=idx.device)
        owner.scatter_reduce_(0, idx.flatten(), ids.repeat_interleave(L), "amin")
        self.first = owner[idx] == ids[:, None]
        heads = lambda x: x.permute(0, 2, 1, 3).contiguous()
        self.q, self.k, self.v = (heads(t[n][idx]).requires_grad_(backward) for n in ("q", "k", "v"))
        self.do = heads(t["do"][idx] * self.first[..., None, None])

    def fwd(self):
        with torch.no_grad():
            return self.attend(self.q, self.k, self.v)

    def fwd_bwd(self):
        o = self.attend(self.q, self.k, self.v)
        return (o,) + torch.autograd.grad(o, (self.q, self.k, self.v), self.do)

    def packed(self, name, x):
        """An output [B, H, L, d] as packed float32 rows [T, H, d]."""
        x = x.detach().permute(0, 2, 1, 3).float()
        out = torch.zeros(self.rows, *x.shape[2:], device=x.device)
        if name == "o":
            out[self.idx[self.first]] = x[self.first]
            return out
        return out.index_add_(0, self.idx.flatten(), x.flatten(0, 1))


def sdpa(q, k, v, causal=True):
    g = q.shape[1] // k.shape[1]
    if g > 1 and not SDPA_GQA:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    gqa = {"enable_gqa": True} if g > 1 and SDPA_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale(q), **gqa)


def flex(lay, cuda, dev):
    """flex_attention with the layout's block mask (compiled on the GPU; eager, forward only, on
    the CPU) and the milliseconds the block mask took to build."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    end = lay.row_end(dev)
    t0 = time.perf_counter()
    mask = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q < end[kv]), None, None, lay.rows, lay.rows,
                             device=dev)
    sync(cuda)
    mask_ms = (time.perf_counter() - t0) * 1e3
    fn = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention

    def attend(q, k, v):
        return fn(q, k, v, block_mask=mask, scale=softmax_scale(q), enable_gqa=q.shape[1] != k.shape[1])
    return attend, mask_ms


def torch_impls(spec, t, cuda, dev):
    """(label, note, constructor) of the case's PyTorch implementations."""
    lay = spec.layout

    def make_sdpa():
        return TorchAttention(lambda q, k, v: sdpa(q, k, v, lay.causal), lay.sequences(dev), t, True)

    def make_flex():
        attend, mask_ms = flex(lay, cuda, dev)
        return TorchAttention(attend, torch.arange(lay.rows, device=dev)[None], t, cuda, mask_ms)

    for name in spec.torch:
        if name == "sdpa":
            B = len(lay.leaves)
            label = "SDPA" if B == 1 else "SDPA replicated (%d x %d rows)" % (B, lay.path_rows(lay.leaves[0]))
            yield label, "", make_sdpa
        else:
            note = "" if cuda else "eager, forward only: no flex_attention backward on the CPU"
            yield "flex_attention", note, make_flex


def time_once(fn, cuda, queue=1):
    """Milliseconds of one call: CUDA events recorded around it, then a synchronize (a wall clock on
    the CPU). queue > 1: around that many calls back to back, divided by it: a call's time when the
    host's work hides under the GPU's earlier calls, as in a training step's stream of layers."""
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(queue):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / queue
    t0 = time.perf_counter()
    for _ in range(queue):
        fn()
    return (time.perf_counter() - t0) * 1e3 / queue


def time_rounds(timers, a):
    """Median milliseconds of each (record, key, fn) in timers, taken in a.rounds interleaved rounds:
    each round runs every timer in turn (a.warmup calls before its first round's, one before each
    later round's, untimed), so every implementation meets the GPU in the same states (clocks,
    temperature, what ran just before) rather than one after the other. a.reps calls in all."""
    times = [[] for _ in timers]
    per = max(1, -(-a.reps // a.rounds))
    for rnd in range(a.rounds):
        for i, (r, key, fn) in enumerate(timers):
            if "error" in r:
                continue
            try:
                for _ in range(a.warmup if rnd == 0 else 1):
                    fn()
                sync(a.cuda)
                queue = getattr(a, "queue", 1)
                times[i] += [time_once(fn, a.cuda, queue) for _ in range(min(per, a.reps - len(times[i])))]
            except Exception as e:
                r["error"] = describe(e)
    for (r, key, _), t in zip(timers, times):
        if "error" not in r and t:
            r[key] = statistics.median(t)


def describe(e):
    return ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:200]


def run_forkattn(fa, lay, t, ref, a):
    r = {"name": fa.name}
    try:
        for n in ("o", "lse", "dq", "dk", "dv"):
            t[n].fill_(math.nan)
        fwd, bwd = fa.prepared(lay, t)
        fwd()
        bwd()
        r["written"] = all(bool(torch.isfinite(t[n]).all()) for n in ("o", "lse", "dq", "dk", "dv"))
        r["err"] = {n: max_err(t[n], ref[n]) for n in OUTS}
        timers = [(r, "fwd_ms", fwd), (r, "fwd_bwd_ms", lambda: (fwd(), bwd()))]
    except Exception as e:  # a failed case is recorded and the others still run
        r["error"] = describe(e)
        timers = []
    return r, timers


def run_torch(label, note, make, ref, a):
    r = {"name": label, "note": note}
    try:
        impl = make()
        if impl.mask_ms is not None:
            r["block_mask_ms"] = impl.mask_ms
        outs = impl.fwd_bwd() if impl.backward else (impl.fwd(),)
        r["err"] = {n: max_err(impl.packed(n, x), ref[n]) for n, x in zip(OUTS, outs)}
        del outs
        timers = [(r, "fwd_ms", impl.fwd)] + ([(r, "fwd_bwd_ms", impl.fwd_bwd)] if impl.backward else [])
    except Exception as e:
        r["error"] = describe(e)
        timers = []
    return r, timers


def check(fa, torch_rows, t, lay, ref):
    """forkattn passes when it wrote every output and each error is at most 2x PyTorch's bf16 error
    on that output + ABS_TOL; PyTorch's error is the largest of its kernels that produced the
    output, or a naive bf16 computation's where none did."""
    if "error" in fa:
        return {"pass": False, "why": "forkattn failed"}
    naive = None
    base = {}
    for n in OUTS:
        errs = [(r["err"][n], r["name"]) for r in torch_rows if math.isfinite(r.get("err", {}).get(n, math.nan))]
        if not errs:
            naive = naive or reference(t, lay, torch.bfloat16)
            errs = [(max_err(naive[n], ref[n]), "naive bf16")]
        base[n] = max(errs)
    bound = {n: 2 * base[n][0] + ABS_TOL for n in OUTS}
    bad = [n for n in OUTS if not fa["err"][n] <= bound[n]]
    why = "; ".join("%s %.2e %s %.2e (2 x %s %.2e + %g)" % (
        n, fa["err"][n], ">" if n in bad else "<=", bound[n], base[n][1], base[n][0], ABS_TOL) for n in OUTS)
    if not fa["written"]:
        why = "outputs left NaN; " + why
    return {"pass": fa["written"] and not bad, "bound": bound, "baseline": base, "why": why}


def run_case(n, a, seed, fa, dev):
    spec = case_spec(n, a, seed)
    lay = spec.layout
    gflop = 4e-9 * spec.d * spec.hq * lay.pairs
    rec = {"case": n, "name": spec.name, "desc": spec.desc, "rows": lay.rows, "hq": spec.hq, "hkv": spec.hkv,
           "d": spec.d, "useful_gflop": gflop, "replicated_gflop": 4e-9 * spec.d * spec.hq * lay.replicated_pairs,
           "impls": []}
    print("case %d (%s): %s" % (n, spec.name, spec.desc), flush=True)
    try:
        torch.manual_seed(seed + n)
        t = inputs(spec, dev)
        ref = reference(t, lay, torch.float32)
    except Exception as e:
        rec["error"] = describe(e)
        print("  error: %s" % rec["error"], flush=True)
        return rec
    fa_rows, torch_rows, timers = [], [], []
    for f in fa:
        r, more = run_forkattn(f, lay, t, ref, a)
        fa_rows.append(r)
        timers += more
    for label, note, make in torch_impls(spec, t, a.cuda, dev):
        r, more = run_torch(label, note, make, ref, a)
        torch_rows.append(r)
        timers += more
    rows = fa_rows + torch_rows
    time_rounds(timers, a)
    del timers  # the implementations' tensors
    if a.cuda:
        torch.cuda.empty_cache()
    for r in rows:
        progress(r)
    rates(rows, gflop)
    rec["impls"] = rows
    for r in fa_rows:
        r["check"] = check(r, torch_rows, t, lay, ref)
        print("  check %s %s: %s" % (r["name"], "PASS" if r["check"]["pass"] else "FAIL", r["check"]["why"]),
              flush=True)
    rec["check"] = fa_rows[0]["check"]
    rec["check"]["pass"] = all(r["check"]["pass"] for r in fa_rows)
    return rec


def rates(rows, gflop):
    """TFLOP/s on useful FLOPs (3.5x the forward's for forward+backward) and, for PyTorch's rows,
    forkattn's speedup: their time over forkattn's first row (rows[0])."""
    for r in rows:
        for k, mult in (("fwd", 1), ("fwd_bwd", 3.5)):
            if k + "_ms" in r:
                r[k + "_tflops"] = gflop * mult / r[k + "_ms"]
                if r is not rows[0] and k + "_ms" in rows[0]:
                    r[k + "_speedup"] = r[k + "_ms"] / rows[0][k + "_ms"]


def progress(r):
    if "error" in r:
        print("  %-34s error: %s" % (r["name"], r["error"]), flush=True)
        return
    errs = " ".join("%s %.2e" % kv for kv in r["err"].items())
    print("  %-34s fwd %s ms, fwd+bwd %s ms; max abs err %s"
          % (r["name"], num(r.get("fwd_ms")), num(r.get("fwd_bwd_ms")), errs), flush=True)


def num(x, spec="%.3f"):
    return "—" if x is None else spec % x


def table(cases):
    lines = ["| case | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "forkattn speedup fwd / fwd+bwd | max abs error o / dq / dk / dv | check |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for c in cases:
        label = "%d %s" % (c["case"], c["name"])
        if "error" in c:
            lines.append("| %s | — | | | | | | | error: %s |" % (label, cell(c["error"])))
        for r in c["impls"]:
            if "check" in r:
                status = "PASS" if r["check"]["pass"] else "FAIL"
            else:
                status = r["note"]
            if "error" in r:
                status = "error: " + cell(r["error"])
            errs = " / ".join(num(r.get("err", {}).get(n), "%.1e") for n in OUTS)
            speed = "" if r is c["impls"][0] else "%s / %s" % (num(r.get("fwd_speedup"), "%.2fx"),
                                                              num(r.get("fwd_bwd_speedup"), "%.2fx"))
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                label, r["name"], num(r.get("fwd_ms")), num(r.get("fwd_tflops"), "%.3g"), num(r.get("fwd_bwd_ms")),
                num(r.get("fwd_bwd_tflops"), "%.3g"), speed, errs, status))
    return lines


def cell(s):
    return s.replace("|", "/")


def notes(cases):
    lines = []
    for c in cases:
        lines.append("- Case %d (%s): %s, d=%d; useful %.4g GFLOP forward (replicated %.4g)." % (
            c["case"], c["name"], c["desc"], c["d"], c["useful_gflop"], c["replicated_gflop"]))
        for r in c["impls"]:
            if "block_mask_ms" in r:
                lines.append("  %s block mask built in %.1f ms (not timed)." % (r["name"], r["block_mask_ms"]))
        for r in c["impls"]:
            if "check" in r:
                lines.append("  Check of %s %s: %s." % (r["name"], "PASS" if r["check"]["pass"] else "FAIL",
                                                        r["check"]["why"]))
    return lines


def section(meta, cases):
    head = ("%s, %s, torch %s, commit %s; forkattn %s, %s backend on %s pointers; seed %d; median of %d calls in %d "
            "interleaved rounds (%d warm-ups before the first, 1 before each other)." % (
                meta["date"], meta["device"], meta["torch"], meta["commit"], meta["forkattn"], meta["backend"],
                meta["memory"], meta["seed"], meta["reps"], meta.get("rounds", 1), meta["warmup"]))
    expl = ("TFLOP/s on useful FLOPs (4·d·Hq·visible pairs forward, 3.5x that forward+backward) for every "
            "implementation; speedup = the row's time / the first forkattn row's time. Errors: max abs difference from a float32 "
            "reference on the same bf16 inputs; forkattn passes when each is at most 2x PyTorch's bf16 error "
            "+ %g and it wrote every output (NaN-poisoned before)." % ABS_TOL)
    return "\n".join(["#### The latest run", "", head, "",
                      "Command: `%s`" % meta["command"], ""] + table(cases) + ["", expl, ""] + notes(cases)) + "\n"


def write_results(path, text, begin=BEGIN, end=END):
    """Replace the block between the markers begin and end in the file at path (appended the first
    time)."""
    old = open(path).read() if os.path.exists(path) else ""
    block = "%s\n%s%s" % (begin, text, end)
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = (old.rstrip("\n") + "\n\n" if old else "") + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def git_commit(a):
    if a.commit:
        return a.commit
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def device_name(cuda):
    if cuda:
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def command_line():
    env = ["%s=%s" % (k, os.environ[k]) for k in ("OMP_TARGET_OFFLOAD", "FORKATTN_BACKEND") if k in os.environ]
    return " ".join(env + ["python3"] + [shlex.quote(x) for x in sys.argv])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="build-gpu/libforkattn.so")
    ap.add_argument("--cases", default="1,2,3", help="comma-separated case numbers")
    ap.add_argument("--reps", type=int, default=20, help="timed runs (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds the runs are spread over")
    ap.add_argument("--small", action="store_true", help="lengths /4 (about 16x fewer FLOPs)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seed", type=int, help="default: a fresh one (printed)")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "RESULTS.md"), help="'' for none")
    ap.add_argument("--commit", help="build's commit (default: git rev-parse --short HEAD)")
    ap.add_argument("--calls", choices=("stream", "sync", "both"), default="both",
                    help="forkattn's calls queued on torch's stream, synchronous, or both side by side (cuda)")
    a = ap.parse_args()
    a.cuda = a.device == "cuda"
    dev = torch.device(a.device)
    if a.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    modes = [m for m in (True, False) if a.cuda and a.calls in ("both", "stream" if m else "sync")] or [False]
    fa = [Forkattn(a.lib, a.cuda, m) for m in modes]
    meta = {"date": time.strftime("%Y-%m-%d"), "device": device_name(a.cuda), "torch": torch.__version__,
            "commit": git_commit(a), "command": command_line(), "forkattn": fa[0].version,
            "backend": "gpu" if a.cuda else "cpu", "memory": "device" if a.cuda else "host",
            "backend_reason": fa[0].reason, "seed": seed, "reps": a.reps, "warmup": a.warmup,
            "rounds": a.rounds}
    print("seed %d; %s; forkattn %s: %s" % (seed, meta["device"], fa[0].version, fa[0].reason), flush=True)
    cases = []
    for n in (int(x) for x in a.cases.split(",")):
        cases.append(run_case(n, a, seed, fa, dev))
        if a.cuda:
            torch.cuda.empty_cache()
        ok = all(c.get("check", {}).get("pass") and all("error" not in r for r in c["impls"]) for c in cases)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "passed": ok, "cases": cases}, f, indent=1)
        if a.results:
            write_results(a.results, section(meta, cases))
    print("\n" + section(meta, cases))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
