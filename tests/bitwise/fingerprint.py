"""Digests of the CPU library's outputs on a fixed grid of calls, one line a call.

Restructuring the code must not change a single bit of what the CPU backend computes. Run this
against the library before and after a change and compare the two listings:

    python3 tests/bitwise/fingerprint.py > before.txt   # FORKATTN_LIBRARY=old/libforkattn.so
    python3 tests/bitwise/fingerprint.py > after.txt    # FORKATTN_LIBRARY=new/libforkattn.so
    diff before.txt after.txt

tests/bitwise/compare.sh does both with two build folders. Inputs come from fixed seeds, so a
line changes only when the library's result does (the CPU backend's bits do not depend on the
thread count: docs/reliability.md, Determinism).
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import forkattn  # noqa: E402
from forkattn import numpy_api as fa  # noqa: E402
from forkattn import dlm_cache  # noqa: E402


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:24]


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def grid():
    for dtype in (np.float32, np.float16):
        for d in (64, 128):
            for hq, hkv in ((4, 4), (4, 2)):
                yield dtype, d, hq, hkv


def main():
    forkattn.configure(backend="cpu", threads=2)
    out = []
    for dtype, d, hq, hkv in grid():
        tag = f"{np.dtype(dtype).name} d={d} hq={hq} hkv={hkv}"
        rng = np.random.default_rng(d * 1000 + hq * 10 + hkv)

        # shared prompt: two groups
        P, R, G = [37, 20], [15, 9, 33, 7, 12], [3, 2]
        T = sum(P) + sum(R)
        q, k, v = rand(rng, (T, hq, d), dtype), rand(rng, (T, hkv, d), dtype), rand(rng, (T, hkv, d), dtype)
        o, lse = fa.prefix_attention(q, k, v, P, R, G, return_lse=True)
        do = rand(rng, o.shape, dtype)
        g = fa.prefix_attention_backward(do, q, k, v, o, lse, P, R, G)
        out.append(f"prefix {tag} fwd {digest(o, lse)} bwd {digest(*g)}")

        # varlen, causal and not
        cu = [0, 5, 40, 41, 96]
        q, k, v = rand(rng, (96, hq, d), dtype), rand(rng, (96, hkv, d), dtype), rand(rng, (96, hkv, d), dtype)
        for causal in (True, False):
            o, lse = fa.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
            do = rand(rng, o.shape, dtype)
            g = fa.varlen_attention_backward(do, q, k, v, o, lse, cu, causal=causal)
            out.append(f"varlen causal={int(causal)} {tag} fwd {digest(o, lse)} bwd {digest(*g)}")

        # tree: a root, two children, a grandchild
        offs, par = [0, 30, 41, 70, 77], [-1, 0, 0, 1]
        q, k, v = rand(rng, (77, hq, d), dtype), rand(rng, (77, hkv, d), dtype), rand(rng, (77, hkv, d), dtype)
        o, lse = fa.tree_attention(q, k, v, offs, par, return_lse=True)
        do = rand(rng, o.shape, dtype)
        g = fa.tree_attention_backward(do, q, k, v, o, lse, offs, par)
        out.append(f"tree {tag} fwd {digest(o, lse)} bwd {digest(*g)}")

        # KV compression: a kept set chosen by each policy, attention over it, StreamKL
        L = 90
        q, k, v = rand(rng, (L, hq, d), dtype), rand(rng, (L, hkv, d), dtype), rand(rng, (L, hkv, d), dtype)
        for policy in ("streaming_llm", "h2o", "snapkv"):
            kept = fa.kv_select(q, k, policy, budget=24, sinks=4, window=8)
            kd = digest(*[np.asarray(kept[key]) for key in sorted(kept) if kept[key] is not None])
            o, lse = fa.kept_attention(q, k, v, L, kept, return_lse=True)
            do = rand(rng, o.shape, dtype)
            g = fa.kept_attention_backward(do, q, k, v, o, lse, L, kept)
            out.append(f"kept {policy} {tag} select {kd} fwd {digest(o, lse)} bwd {digest(*g)}")
        qs, ks = rand(rng, (L, hq, d), dtype), rand(rng, (L, hkv, d), dtype)
        kept = fa.kv_select(q, k, "h2o", budget=24, sinks=4, window=8)
        for direction in ("forward", "reverse"):
            for kk in (None, kept):
                kl, stats, outside = fa.stream_kl(q, k, qs, ks, L, kk, direction=direction, temperature=1.5)
                dkl = rng.standard_normal(kl.shape).astype(np.float32)
                g = fa.stream_kl_backward(dkl, q, k, qs, ks, stats, L, kk, direction=direction,
                                          temperature=1.5, teacher_grad=True)
                out.append(f"streamkl {direction} kept={int(kk is not None)} {tag} "
                           f"fwd {digest(kl, stats, outside)} bwd {digest(*g)}")
        per, mean = dlm_cache.kv_similarity(k, ks)
        out.append(f"kv_similarity {tag} {digest(per, np.float64(mean))}")

        # a cached prefix (bidirectional diffusion-LM attention)
        Pc, Rc = 33, [11, 20]
        q = rand(rng, (sum(Rc), hq, d), dtype)
        k, v = rand(rng, (Pc + sum(Rc), hkv, d), dtype), rand(rng, (Pc + sum(Rc), hkv, d), dtype)
        o, lse = dlm_cache.prefix_cached_attention_numpy(q, k, v, Pc, Rc, return_lse=True)
        do = rand(rng, o.shape, dtype)
        g = dlm_cache.prefix_cached_attention_backward_numpy(do, q, k, v, o, lse, Pc, Rc)
        out.append(f"prefix_cached {tag} fwd {digest(o, lse)} bwd {digest(*g)}")
    x = np.random.default_rng(7).standard_normal((50, 3)).astype(np.float32)
    out.append(f"rows_mean {digest(np.asarray(fa.rows_mean(x)))}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
