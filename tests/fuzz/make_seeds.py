#!/usr/bin/env python3
"""Write the seed corpus of the forkattn fuzz targets (tests/fuzz/corpus/<target>/).

    python3 tests/fuzz/make_seeds.py            # (re)writes the seed files

The byte formats are documented at the top of each target (fuzz_*.c) and the
value encodings (fz_int, fz_field, fz_enum, ...) in fuzz_common.h. Seeds are
small valid and invalid calls. Files named crash-* reproduce library bugs found
by fuzzing: they make the replay test (or the fuzzing run) fail until the bug is
fixed, then stay as regression inputs. This script writes the reproducers of
the bugs listed in docs/reliability.md; crash files saved straight from
libFuzzer are left alone.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# fz_extremes indices (fuzz_common.c)
X_ZERO, X_ONE, X_MINUS1, X_TWO, X_I64MIN, X_I64MAX = 0, 1, 2, 3, 4, 5
X_I32MAX, X_I32MIN, X_2P62, X_SQRTMAX1, X_256, X_257 = 8, 9, 14, 21, 25, 26


def small(v):
    """fz_int(base=0, range) tag for a small value v (v < 0xC0 and v < range)."""
    assert 0 <= v < 0xC0
    return [v]


def extreme(i):
    return [0xC0 + i]


def neg(v):
    """fz_int tag for a small negative value -8 <= v < 0."""
    assert -8 <= v < 0
    return [0xE0 + v + 8]


def raw64(v):
    return [0xF0] + list(struct.pack("<q", v))


def field_small(v):
    """fz_field tag for the value v in 0..63 (0x00..0x7F means 'nominal')."""
    assert 0 <= v < 64
    return [0x80 + v]


NOMINAL = [0]


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


# ---- fuzz_prefix_layout -----------------------------------------------------
# flags seed P N offsets mask hkv group d dtype memory scale 8 x tensor


def prefix(flags=0, seed=1, P=small(8), N=small(3), offsets=(5, 0, 7), mask=0, hkv=1, group=1, d=15,
           dtype=0, memory=0, scale=0, tensors=None):
    """hkv, group, d are tags of fz_int(1, range): value = 1 + tag."""
    out = [flags, seed] + list(P) + list(N)
    for o in offsets:
        out += list(o) if isinstance(o, list) else small(o)
    out += [mask, hkv, group, d, dtype, memory, scale]
    tensors = tensors or [[0]] * 8
    for t in tensors:
        out += t
    return out


def prefix_seeds():
    t = "fuzz_prefix_layout"
    write(t, "seed-empty", [])
    # GRPO-like group: P=8, responses 5, 0, 7 (one empty), Hq=4 over Hkv=2, d=16, f32 causal
    write(t, "seed-grpo-f32-causal", prefix())
    # bidirectional bf16 with head-major q and padded row-major k
    write(t, "seed-bidir-bf16-strided",
          prefix(mask=1, dtype=1, tensors=[[6, 1, 2], [7, 3, 1]] + [[0]] * 6))
    # f16 causal, 147 rows (more than one 128-key block), one head
    write(t, "seed-f16-long", prefix(P=small(70), N=small(2), offsets=(47, 30), hkv=0, group=0, d=7, dtype=2))
    # plain variable-length attention (no prompt), GQA 3:1, d=1
    write(t, "seed-varlen-gqa", prefix(P=small(0), N=small(4), offsets=(3, 1, 0, 6), hkv=0, group=2, d=0))
    # forward without lse, head_dim 256
    write(t, "seed-fwd-no-lse-d256", prefix(flags=1, P=small(3), N=small(1), offsets=(2,), d=0xC0 + X_256))
    # invalid calls
    write(t, "seed-bad-head-dim-257", prefix(P=small(2), N=small(0), offsets=(), d=0xC0 + X_257))
    write(t, "seed-bad-offsets-not-monotonic", prefix(flags=8, N=small(2), offsets=(0, 5, 3)))
    write(t, "seed-bad-offsets-first-nonzero", prefix(flags=8, N=small(1), offsets=(2, 5)))
    write(t, "seed-bad-offsets-null", prefix(flags=4))
    write(t, "seed-bad-prompt-negative", prefix(P=neg(-1)))
    write(t, "seed-bad-rows-overflow", prefix(P=extreme(X_I64MAX), N=small(1), offsets=(1,)))
    write(t, "seed-bad-num-responses-huge", prefix(N=extreme(X_I64MAX), offsets=()))
    write(t, "seed-bad-mask", prefix(mask=0xF0))
    write(t, "seed-bad-dtype", prefix(dtype=0xF1))
    write(t, "seed-bad-dtype-mismatch", prefix(tensors=[[0], [9, 5, 0x81]] + [[0]] * 6))
    write(t, "seed-bad-overlapping-strides", prefix(tensors=[[8, 0, 0]] + [[0]] * 7))
    write(t, "seed-bad-stride-overflow", prefix(tensors=[[8, 0xC0 + X_I64MAX, 0]] + [[0]] * 7))
    write(t, "seed-bad-negative-stride", prefix(tensors=[[0], [0], [8, 0xE0, 0]] + [[0]] * 5))
    write(t, "seed-bad-scale-nan", prefix(scale=0xE3))
    write(t, "seed-bad-scale-negative", prefix(scale=0xE2))
    write(t, "seed-bad-memory-device", prefix(memory=0xE0))
    write(t, "seed-bad-memory-unknown", prefix(memory=0xF0))
    write(t, "seed-bad-bwd-lse-null", prefix(flags=2))
    write(t, "seed-bad-null-descriptor", prefix(tensors=[[0]] * 7 + [[10]]))
    write(t, "seed-bad-data-null", prefix(tensors=[[0]] * 4 + [[9, 6]] + [[0]] * 3))
    write(t, "seed-bad-layout-null", prefix(flags=16))
    # Bug: scale = FLT_MAX (finite, > 0: accepted) makes scores +inf; the CPU exp then
    # converts NaN (inf - inf) to int (UBSan: float-cast-overflow in cpu/cpu_tile.c).
    write(t, "crash-huge-scale-exp-nan", prefix(scale=0xE6))


# ---- fuzz_tensor_validate ---------------------------------------------------
# flags layout shape dtype seed scale [memory] 8 x (mode dt rows heads head_dim [row_stride head_stride])


def tv(flags=0, layout=0, shape=0, dtype=0, seed=1, scale=0, memory=None, tensors=None):
    out = [flags, layout, shape, dtype, seed, scale]
    if memory is not None:
        out.append(memory)
    tensors = tensors or [[0, 0, 0, 0, 0, 0, 0]] * 8
    for t in tensors:
        out += t
    return out


def tv_one(i, t, default=(0, 0, 0, 0, 0, 0, 0)):
    ts = [list(default)] * 8
    ts[i] = t
    return ts


def tensor_seeds():
    t = "fuzz_tensor_validate"
    write(t, "seed-empty", [])
    write(t, "seed-valid-layout0-shape0-f32", tv())
    write(t, "seed-valid-empty-layout-bf16", tv(layout=1, shape=2, dtype=1))
    write(t, "seed-valid-bidir-f16", tv(layout=2, shape=3, dtype=2))
    write(t, "seed-valid-one-row", tv(layout=3, shape=1))
    # q head-major: (T=5, Hq=2, d=4): row_stride 4, head_stride 20
    write(t, "seed-valid-q-head-major", tv(tensors=tv_one(0, [0, 0, 0, 0, 0] + field_small(4) + field_small(20))))
    write(t, "seed-valid-contiguous-helper", tv(tensors=[[2, 0, 0, 0, 0]] * 8))
    write(t, "seed-valid-forward-lse-null", tv(flags=1, layout=2))
    # invalid descriptors
    write(t, "seed-bad-rows-max", tv(tensors=tv_one(3, [0, 0] + extreme(X_I64MAX) + [0, 0, 0, 0])))
    write(t, "seed-bad-heads-zero", tv(tensors=tv_one(1, [0, 0, 0] + field_small(0) + [0, 0, 0])))
    write(t, "seed-bad-head-stride-min", tv(tensors=tv_one(2, [0, 0, 0, 0, 0, 0] + extreme(X_I64MIN))))
    write(t, "seed-bad-row-stride-overflow", tv(tensors=tv_one(0, [0, 0, 0, 0, 0] + extreme(X_2P62) + [0])))
    write(t, "seed-bad-strides-equal-huge", tv(shape=2, tensors=tv_one(5, [0, 0, 0, 0, 0] + extreme(X_SQRTMAX1) + extreme(X_SQRTMAX1))))
    write(t, "seed-bad-dtype-int-min", tv(tensors=tv_one(7, [0, 0xC1, 0, 0, 0, 0, 0])))
    write(t, "seed-bad-data-null", tv(tensors=tv_one(4, [3, 0, 0, 0, 0, 0, 0])))
    write(t, "seed-bad-descriptor-null", tv(tensors=tv_one(0, [0xFF])))
    write(t, "seed-bad-head-dim-huge", tv(tensors=tv_one(0, [0, 0, 0, 0] + raw64(1 << 40) + [0, 0])))
    write(t, "seed-bad-memory", tv(flags=4, memory=0xF0))
    write(t, "seed-bad-bwd-lse-null", tv(flags=2))
    write(t, "seed-bad-scale-inf", tv(scale=0xE4))
    # rows 0 with absurd heads: nothing to read, the library may accept or refuse
    # Bug: forkattn_tensor_contiguous computes heads * head_dim without an overflow
    # check (UBSan: signed integer overflow in lib/core/tensor.c).
    write(t, "crash-tensor-contiguous-overflow", tv(tensors=tv_one(0, [2, 0, 0] + extreme(X_I64MAX) + [0])))
    write(t, "seed-empty-layout-huge-heads", tv(layout=1, tensors=[[0, 0, 0] + extreme(X_2P62) + [0, 0, 0]] * 8))


# ---- fuzz_ctx_options -------------------------------------------------------
# flags backend device threads bind verbose env 3x(status backend) memcpy... malloc


def ctx(flags=0, backend=0, device=0, threads=0, bind=0, verbose=0, env=(0,), names=(0, 0, 0, 0, 0, 0),
        memcpy=(0,), malloc=(0, 0, 0)):
    out = [flags, backend, device, threads, bind, verbose] + list(env) + list(names) + list(memcpy) + list(malloc)
    return out


def ctx_seeds():
    t = "fuzz_ctx_options"
    write(t, "seed-empty", [])
    write(t, "seed-cpu-tiny-forward", ctx(flags=8, backend=0x81, threads=field_small(1)[0]))
    write(t, "seed-cpu-bind-threads", ctx(flags=8, backend=0x81, threads=field_small(2)[0], bind=field_small(1)[0]))
    write(t, "seed-env-cpu", ctx(flags=4 | 8, env=(0,), threads=field_small(1)[0]))
    write(t, "seed-env-gpu", ctx(flags=4, env=(1,)))
    write(t, "seed-env-auto-mixed-case", ctx(flags=4, env=(18,)))
    write(t, "seed-env-unknown", ctx(flags=4, env=(9,)))
    write(t, "seed-env-empty", ctx(flags=4, env=(6,)))
    write(t, "seed-env-raw", ctx(flags=4, env=(0x85, ord("c") - 0x20, ord("p") - 0x20, ord("u") - 0x20, 0, 1)))
    write(t, "seed-backend-gpu", ctx(backend=0x82))
    write(t, "seed-bad-backend", ctx(backend=0xC0))
    write(t, "seed-bad-threads-negative", ctx(threads=0xE7))
    write(t, "seed-bad-device-int-min", ctx(device=0xC0 + X_I32MIN))
    # threads above forkattn_max_threads(): refused at create time (the OpenMP runtime would abort the
    # process at the first call: INT_MAX asks libgomp for ~480 GB, 10^8 crashes inside it)
    write(t, "seed-bad-threads-int-max", ctx(flags=8, backend=0x81, threads=0xC0 + X_I32MAX))
    write(t, "seed-bad-threads-1e8", ctx(flags=8, backend=0x81, threads=0xF0)[:4] + list(struct.pack("<q", 100000000))
          + [0] * 16)
    write(t, "seed-options-null", ctx(flags=1))
    write(t, "seed-ctx-pointer-null", ctx(flags=2))
    write(t, "seed-names-extremes", ctx(names=(0xC4, 0xC5, 0xE7, 0xC8, 0x08, 0x04)))
    # memcpy: overlapping host copy in A, NULL source with bytes, device kind on a CPU context
    write(t, "seed-memcpy-mixed", ctx(memcpy=(3, 1, 8, 3, 0, 0, 0, field_small(40)[0],
                                              1, 0, 0, 0, 0, 0, field_small(3)[0],
                                              2, 0, 1, 0, 1, 0, field_small(8)[0]),
                                      malloc=(field_small(16)[0], 0, 1)))
    write(t, "seed-memcpy-unknown-kind-huge", ctx(memcpy=(1, 1, 0, 2, 0, 0xF2, 0) + tuple(extreme(X_I64MAX))))


# ---- fuzz_trie --------------------------------------------------------------
# mode [flags u32] then per builder (see fuzz_trie.c):
#   sequences:     N, offsets kind, offsets, alphabet, tokens
#   node parents:  n, parents, lengths, shuffle
#   token parents: n, parents, shuffle
T_SEQ, T_PAR, T_TOK = 0, 1, 2
T_SINGLE, T_RAWFLAGS, T_NULL_A, T_NULL_B, T_NULL_CTX, T_NULL_OUT = 4, 8, 16, 32, 64, 128


def count(v, base):
    """fz_int(base, range) tag for v >= base (v - base < 0xC0)."""
    return small(v - base)


def parent_earlier(i, p):
    """fz_parent tag for entry i: -1 or an earlier entry p."""
    assert -1 <= p < i
    return [i - 1 - p]


def parent_any(p):
    """fz_parent tag for any parent in [-1, 63)."""
    return [0x80 + p + 1]


def trie_seqs(seqs, mode=T_SEQ, alphabet=8, raw_offsets=None, n=None):
    out = [mode] + (count(len(seqs), 1) if n is None else list(n))
    if raw_offsets is not None:
        out += [1] + [b for o in raw_offsets for b in (o if isinstance(o, list) else small(o))]
    else:
        out += [0] + [b for q in seqs for b in count(len(q), 1)]
    out += [alphabet - 1]
    for q in seqs:
        for t in q:
            out += t if isinstance(t, list) else [t]
    return out


def trie_tree(parents, lengths=None, mode=T_PAR, shuffle=0, n=None):
    """parents: per entry a tag list (parent_earlier / parent_any / raw tags)."""
    out = [mode] + (count(len(parents), 1) if n is None else list(n))
    for p in parents:
        out += p
    for l in lengths or []:
        out += l if isinstance(l, list) else count(l, 1)
    return out + [shuffle]


def tree_tags(par):
    """Tags for a parents list in which every parent comes first (or -1)."""
    return [parent_earlier(i, p) for i, p in enumerate(par)]


def trie_seeds():
    t = "fuzz_trie"
    write(t, "seed-empty", [])
    prompt = [3, 1, 4, 1, 5]
    grpo = [prompt + [2, 6], prompt + [2, 7, 7], prompt + [0], prompt + [2, 6], prompt[:3], prompt + [2]]
    write(t, "seed-seq-grpo-single-root", trie_seqs(grpo, mode=T_SEQ | T_SINGLE))
    write(t, "seed-seq-forest", trie_seqs([[1, 2, 3], [4, 2], [1, 2, 5], [4], [6, 6, 6, 6]]))
    write(t, "seed-seq-binary-alphabet", trie_seqs([[0, 1, 0, 1, 1], [0, 1, 1], [1, 0], [0, 1, 0, 1, 1, 0]], alphabet=2))
    write(t, "seed-seq-one-symbol", trie_seqs([[0] * 5, [0] * 2, [0] * 9, [0] * 5], alphabet=1))
    write(t, "seed-seq-raw-tokens", trie_seqs([[[0xF0] + list(struct.pack("<q", -(1 << 62))), 1],
                                               [[0xF0] + list(struct.pack("<q", -(1 << 62))), 2]]))
    write(t, "seed-seq-bad-empty-sequence", trie_seqs([[1, 2, 3], [], [1, 2]], raw_offsets=(0, 3, 3, 5)))
    write(t, "seed-seq-bad-first-offset", trie_seqs([[1, 2]], raw_offsets=(2, 4)))
    write(t, "seed-seq-bad-decreasing", trie_seqs([[1, 2, 3], [1]], raw_offsets=(0, 3, 1)))
    write(t, "seed-seq-bad-huge-offset-wraps", [T_SEQ] + count(2, 1) + [0] + extreme(X_I64MAX) + extreme(X_TWO))
    write(t, "seed-seq-bad-num-zero", trie_seqs([[1]], n=extreme(X_ZERO)))
    write(t, "seed-seq-bad-num-negative", trie_seqs([[1]], n=neg(-1)))
    write(t, "seed-seq-bad-num-min", trie_seqs([[1]], n=extreme(X_I64MIN)))
    write(t, "seed-seq-bad-single-root", trie_seqs([[1, 2], [1, 3], [2, 3]], mode=T_SEQ | T_SINGLE))
    write(t, "seed-seq-bad-offsets-null", trie_seqs(grpo, mode=T_SEQ | T_NULL_A))
    write(t, "seed-seq-bad-tokens-null", trie_seqs(grpo, mode=T_SEQ | T_NULL_B))
    write(t, "seed-seq-bad-ctx-null", trie_seqs(grpo, mode=T_SEQ | T_NULL_CTX))
    write(t, "seed-seq-bad-output-null", trie_seqs(grpo, mode=T_SEQ | T_NULL_OUT))
    write(t, "seed-seq-bad-flags", [T_SEQ | T_RAWFLAGS, 3, 0, 0, 0] + trie_seqs(grpo)[1:])

    tree = [-1, 0, 0, 1, 1, 2, 5]
    write(t, "seed-par-tree", trie_tree(tree_tags(tree), [4, 1, 2, 3, 1, 6, 2]))
    write(t, "seed-par-tree-shuffled", trie_tree(tree_tags(tree), [4, 1, 2, 3, 1, 6, 2], mode=T_PAR | T_SINGLE,
                                                 shuffle=0x5A))
    write(t, "seed-par-chain", trie_tree(tree_tags(list(range(-1, 23))), [1] * 24, shuffle=7))
    write(t, "seed-par-forest", trie_tree(tree_tags([-1, 0, -1, 2, -1]), [2, 2, 2, 2, 2], shuffle=3))
    write(t, "seed-par-bad-forest-single-root", trie_tree(tree_tags([-1, 0, -1, 2]), [1, 1, 1, 1],
                                                          mode=T_PAR | T_SINGLE))
    write(t, "seed-par-bad-cycle", trie_tree([parent_earlier(0, -1), parent_any(3), parent_any(1), parent_any(2),
                                              parent_any(2)], [1] * 5))
    write(t, "seed-par-bad-no-root", trie_tree([parent_any(1), parent_any(0)], [1, 1]))
    write(t, "seed-par-bad-self", trie_tree([parent_earlier(0, -1), parent_any(1)], [1, 1]))
    write(t, "seed-par-bad-out-of-range", trie_tree([parent_earlier(0, -1), extreme(X_I64MAX), neg(-2)], [1] * 3))
    write(t, "seed-par-bad-length-zero", trie_tree(tree_tags([-1, 0]), [1, extreme(X_ZERO)]))
    write(t, "seed-par-bad-length-negative", trie_tree(tree_tags([-1, 0]), [extreme(X_I64MIN), 1]))
    write(t, "seed-par-bad-lengths-overflow", trie_tree(tree_tags([-1, 0, 0]), [1, extreme(X_I64MAX), extreme(X_I64MAX)]))
    write(t, "seed-par-bad-replicated-overflow", trie_tree(tree_tags([-1, 0, 0, 0]), [extreme(X_2P62), 1, 1, 1]))
    write(t, "seed-par-bad-num-zero", trie_tree([], [], n=extreme(X_ZERO)))
    write(t, "seed-par-bad-lengths-null", trie_tree(tree_tags(tree), [1] * 7, mode=T_PAR | T_NULL_B))

    write(t, "seed-tok-tree", trie_tree(tree_tags([-1, 0, 1, 2, 2, 4, 2, 6, 7, -1, 9]), mode=T_TOK))
    write(t, "seed-tok-tree-shuffled-single-root", trie_tree(tree_tags([-1, 0, 1, 1, 3, 3, 5, 0, 7]),
                                                             mode=T_TOK | T_SINGLE, shuffle=0x33))
    write(t, "seed-tok-comb", trie_tree(tree_tags([-1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]), mode=T_TOK, shuffle=9))
    write(t, "seed-tok-chain", trie_tree(tree_tags(list(range(-1, 47))), mode=T_TOK, shuffle=1))
    write(t, "seed-tok-bad-cycle", trie_tree([parent_earlier(0, -1), parent_any(3), parent_any(1), parent_any(2)],
                                             mode=T_TOK))
    write(t, "seed-tok-bad-cycle-with-branches", trie_tree([parent_earlier(0, -1), parent_any(3), parent_any(1),
                                                           parent_any(2), parent_any(2), parent_any(2)], mode=T_TOK))
    write(t, "seed-tok-bad-self", trie_tree([parent_earlier(0, -1), parent_earlier(1, 0), parent_any(2)], mode=T_TOK))
    write(t, "seed-tok-bad-out-of-range", trie_tree([parent_earlier(0, -1), extreme(X_I32MAX)], mode=T_TOK))
    write(t, "seed-tok-bad-single-root", trie_tree(tree_tags([-1, 0, -1, 2]), mode=T_TOK | T_SINGLE))
    write(t, "seed-tok-bad-null", trie_tree(tree_tags([-1, 0]), mode=T_TOK | T_NULL_A))


# ---- fuzz_kept_kl -------------------------------------------------------------
# lay, layout, rows, hkv group d hkv_s d_s (tags of fz_int(1, range): value - 1), seed,
# kf, heads (sel, field), cr (sel, field), query_start (field), per-head list densities,
# corruptions, block mask, ko, nulls, direction, temperature, scale_t, scale_s, scale
# (format at the top of fuzz_kept_kl.c)
KL_TREE, KL_BIDIR, KL_RAWOFF, KL_RAW2, KL_OFFNULL = 1, 16, 32, 64, 128
KL_LAYOUT_NULL, KL_BOTH, KL_NEITHER = 5 << 1, 6 << 1, 7 << 1
K_NULL, K_LISTS, K_MISMATCH, K_BLOCK, K_BADBLOCK, K_BADOFF, K_BADIDX, K_BADIDX2 = 1, 2, 4, 8, 16, 32, 64, 128
O_NULL, O_TAU2, O_TGRAD, O_STATS_FIRST, O_OUT_NULL, O_ONLY_DQT, O_QS_HEADS, O_KL_NULL = 1, 2, 4, 8, 16, 32, 64, 128
N_STATS, N_DKL, N_LSE_FIRST, N_BWD_LSE = 1, 2, 4, 8
GRPO_T = 120


def kl_prefix(P, lengths):
    """Prefix layout bytes (delta offsets): P, N, response lengths."""
    return small(P) + small(len(lengths)) + [b for x in lengths for b in small(x)]


def kl_tree(lengths, parents):
    """Tree layout bytes (delta offsets; parent p of node i as the byte p + 1)."""
    return small(len(lengths)) + [b for x in lengths for b in small(x)] + [p + 1 for p in parents]


def kl_cr(T, cr):
    """(sel, tag) of compressed_rows = cr <= T: the nominal T - sel % (T+1)."""
    return [T - cr, 0]


def kept_kl(lay=0, layout=None, rows=NOMINAL, hkv=2, group=2, d=16, hkv_s=1, d_s=8, seed=1, kf=K_LISTS,
            heads=(1, 0), cr=None, qs=NOMINAL, lists=(128, 128), badoff=(), badidx=(), block=(), ko=O_TGRAD,
            nulls=0, direction=0, tau=0, scale_t=0, scale_s=0, scale=6):
    """Defaults: a GRPO group (P=70 > one 64-row block, responses 20, 0, 30: T=120), Hq=4 over
    Hkv=2, d=16, a student with one KV head and d=8, index lists on 2 kept heads over the prompt
    (compressed_rows 70), forward KL with teacher gradients, attention scale 1/sqrt(d)."""
    layout = kl_prefix(70, (20, 0, 30)) if layout is None else layout
    cr = kl_cr(GRPO_T, 70) if cr is None else cr
    out = [lay] + list(layout) + list(rows)
    divisors = [x for x in range(1, hkv * group + 1) if hkv * group % x == 0]
    hkv_s_tag = divisors.index(hkv_s) if hkv_s in divisors else 0x80 + hkv_s - 1
    out += [hkv - 1, group - 1, d - 1, hkv_s_tag, d_s - 1, seed, kf] + list(heads) + list(cr) + list(qs)
    out += list(lists) + list(badoff) + list(badidx) + list(block)
    out += [ko, nulls, direction, tau, scale_t, scale_s, scale]
    return out


def kept_kl_seeds():
    t = "fuzz_kept_kl"
    write(t, "seed-empty", [])
    write(t, "seed-grpo-lists-forward-kl", kept_kl())
    # lists apply from query row 70 on (the prompt was prefilled with the full cache)
    write(t, "seed-grpo-lists-query-start", kept_kl(qs=field_small(40), lists=(40, 200)))
    write(t, "seed-grpo-lists-qs-beyond-rows", kept_kl(qs=raw64(1000)))
    write(t, "seed-grpo-bidir-lists-and-block", kept_kl(lay=KL_BIDIR, kf=K_LISTS | K_BLOCK, heads=(2, 0),
                                                        lists=(100, 30, 200, 0), block=(60,), d=24, d_s=24, hkv_s=4))
    # tree (4 nodes, 120 rows), block mask on one kept head, reverse KL, tau 2 with tau^2
    tree = kl_tree((24, 20, 24, 22), (-1, 0, 0, 1))  # 90 rows
    write(t, "seed-tree-block-reverse-tau2", kept_kl(lay=KL_TREE, layout=tree, kf=K_BLOCK, heads=(0, 0),
                                                     lists=(), block=(64,), ko=O_TGRAD | O_TAU2, direction=1, tau=2))
    write(t, "seed-tree-lists-gqa3", kept_kl(lay=KL_TREE, layout=tree, hkv=1, group=3, d=5, hkv_s=3, d_s=11,
                                             heads=(1, 0), lists=(90, 10, 250), ko=O_TGRAD, direction=1))
    # every key dropped: block mask almost all 0, lists keeping nothing
    write(t, "seed-all-dropped-block", kept_kl(kf=K_BLOCK, lists=(), block=(255,)))
    write(t, "seed-all-dropped-lists", kept_kl(cr=kl_cr(GRPO_T, GRPO_T), lists=(255, 255), direction=1))
    write(t, "seed-kept-null-dense-reverse", kept_kl(kf=K_NULL, lists=(), direction=1, ko=O_TGRAD | O_NULL))
    write(t, "seed-kept-heads-equal-hq", kept_kl(heads=(2, 0), lists=(10, 60, 120, 240)))
    write(t, "seed-one-row", kept_kl(layout=kl_prefix(1, ()), cr=kl_cr(1, 1), hkv=1, group=1, d=1, d_s=1,
                                     heads=(0, 0), lists=(0,)))
    write(t, "seed-zero-rows-lists", kept_kl(layout=kl_prefix(0, ()), cr=kl_cr(0, 0), lists=(0, 0)))
    # optional outputs and inputs: lse, stats, outside mass NULL (valid)
    write(t, "seed-optional-nulls", kept_kl(ko=O_TGRAD | O_STATS_FIRST | O_OUT_NULL, nulls=N_LSE_FIRST))
    write(t, "seed-options-sane-scales", kept_kl(tau=4, scale_t=9, scale_s=20, direction=1, ko=O_TAU2))
    write(t, "seed-scale-minus-zero-default", kept_kl(scale_t=0xE1, scale_s=0xE1))
    # invalid kept sets
    write(t, "seed-bad-heads-zero", kept_kl(heads=(0, 0x80), lists=()))
    write(t, "seed-bad-heads-not-divisor", kept_kl(heads=(0, 0x83), lists=(128, 128, 128)))
    write(t, "seed-bad-heads-above-hq", kept_kl(heads=(0, 0x88), lists=(128,) * 8))
    write(t, "seed-bad-heads-negative", kept_kl(heads=(0, 0xE6), lists=()))
    write(t, "seed-bad-heads-max", kept_kl(heads=(0, 0xC0 + X_I64MAX), lists=()))
    write(t, "seed-bad-offsets-first-nonzero", kept_kl(kf=K_LISTS | K_BADOFF, badoff=(0, 0x90)))
    write(t, "seed-bad-offsets-not-monotonic", kept_kl(kf=K_LISTS | K_BADOFF, badoff=(2, 1, 10)))
    write(t, "seed-bad-offsets-huge", kept_kl(kf=K_LISTS | K_BADOFF, badoff=(1, 3 + 4 * X_I64MAX)))
    write(t, "seed-bad-offsets-min", kept_kl(kf=K_LISTS | K_BADOFF, badoff=(2, 3 + 4 * X_I64MIN)))
    write(t, "seed-bad-index-duplicate", kept_kl(kf=K_LISTS | K_BADIDX, badidx=(5, 0, 0)))
    write(t, "seed-bad-index-unsorted", kept_kl(kf=K_LISTS | K_BADIDX, badidx=(5, 0, 1)))
    write(t, "seed-bad-index-out-of-range", kept_kl(kf=K_LISTS | K_BADIDX, badidx=(20, 0, 2)))
    write(t, "seed-bad-index-negative", kept_kl(kf=K_LISTS | K_BADIDX, badidx=(0, 0, 3)))
    write(t, "seed-bad-index-max", kept_kl(kf=K_LISTS | K_BADIDX | K_BADIDX2, badidx=(7, 0, 4) + tuple(raw64(1 << 62))
                                           + (9, 0, 41)))  # 41: op 5, extreme X_I64MAX
    write(t, "seed-bad-index-null", kept_kl(kf=K_LISTS | K_MISMATCH))
    write(t, "seed-bad-offsets-null", kept_kl(kf=K_MISMATCH, lists=()))
    write(t, "seed-bad-block-value", kept_kl(kf=K_BLOCK | K_BADBLOCK, lists=(), heads=(2, 0), block=(0, 3, 0, 7)))
    # the header does not bound these: either answer, the same for all four calls
    write(t, "seed-either-query-start-negative", kept_kl(qs=[0xE7]))
    write(t, "seed-either-compressed-rows-above-rows", kept_kl(cr=[0, 0xE9], lists=(0, 10)))
    write(t, "seed-either-compressed-rows-negative", kept_kl(cr=[0, 0xC0 + X_MINUS1], lists=(0, 10)))
    # invalid options, tensors, NULLs
    write(t, "seed-bad-direction", kept_kl(direction=0xF3))
    write(t, "seed-bad-temperature-zero", kept_kl(tau=0xE0))
    write(t, "seed-bad-temperature-nan", kept_kl(tau=0xE3))
    write(t, "seed-bad-temperature-negative", kept_kl(tau=0xE2))
    write(t, "seed-bad-scale-teacher-inf", kept_kl(scale_t=0xE4))
    write(t, "seed-bad-scale-student-negative", kept_kl(scale_s=0xE2))
    write(t, "seed-bad-attention-scale-nan", kept_kl(scale=0xE3))
    write(t, "seed-bad-attention-scale-zero", kept_kl(scale=0xE0))
    write(t, "seed-bad-student-query-heads", kept_kl(ko=O_QS_HEADS))
    write(t, "seed-bad-student-kv-heads", kept_kl(hkv_s=3))
    write(t, "seed-bad-kl-null", kept_kl(ko=O_TGRAD | O_KL_NULL))
    write(t, "seed-bad-stats-null", kept_kl(nulls=N_STATS))
    write(t, "seed-bad-dkl-null", kept_kl(nulls=N_DKL))
    write(t, "seed-bad-one-teacher-grad", kept_kl(ko=O_ONLY_DQT))
    write(t, "seed-bad-bwd-lse-null", kept_kl(nulls=N_BWD_LSE))
    write(t, "seed-bad-layout-null", kept_kl(lay=KL_LAYOUT_NULL))
    write(t, "seed-bad-layout-both", kept_kl(lay=KL_BOTH))
    write(t, "seed-bad-layout-neither", kept_kl(lay=KL_TREE | KL_NEITHER, layout=tree))
    write(t, "seed-bad-rows-mismatch", kept_kl(rows=[0xE9]))
    write(t, "seed-bad-tree-parent", kept_kl(lay=KL_TREE | KL_RAW2, layout=kl_tree((40, 30), (-1, 1))))
    # Bug: temperature 1e30 is valid (finite, > 0) but tau^2 overflows float to +inf with
    # scale_by_tau2, and kl = divergence * tau^2 = 0 * inf = NaN for a row that keeps no key
    # (the header: 0), here one row whose only key block the block mask drops.
    write(t, "crash-kl-tau2-overflow-nan", kept_kl(layout=kl_prefix(1, ()), hkv=1, group=1, d=1, d_s=1, kf=K_BLOCK,
                                                   heads=(0, 0), cr=kl_cr(1, 1), lists=(), block=(255,), ko=O_TAU2,
                                                   tau=0xE9))


# ---- fuzz_reuse_profile -----------------------------------------------------
# The input is the profile file itself.
PROFILE_HEAD = "forkattn-reuse-profile 1\nlayers {}\nthreshold {}\nbins {}\n"


def profile(layers, threshold, bins, tail="end\n"):
    text = PROFILE_HEAD.format(layers, threshold, len(bins))
    for b, count, means in bins:
        text += "{} {} {}\n".format(b, count, " ".join(means))
    return text + tail


def reuse_profile_seeds():
    t = "fuzz_reuse_profile"
    w = lambda name, text: write(t, name, text.encode("latin-1"))
    w("seed-empty", "")
    w("seed-two-bins", profile(2, "0.949999988", [(50, 2, ["0.875", "0.125"]), (100, 1, ["1", "0.5"])]))
    w("seed-no-bins", profile(3, "1", []))
    w("seed-crlf-spaces-blank-tail",
      profile(2, "5e-1", [(3, 4, ["0.9", "0.1"])], "end\n\n \n").replace("\n", "\r\n").replace("layers", "layers\t"))
    w("seed-no-final-newline", profile(1, "0.5", [(0, 1, ["-1"])], "end"))
    w("seed-exact-means", profile(3, "0.899999976", [
        (0, 7, ["0.99999999999999989", "-1.1754943508222875e-38", "0.33333333333333331"]),
        (37, 123456789, ["0.5", "0.94999998807907104", "-0.25"]),
        (100, 9223372036854775807, ["1", "1", "1"])]))
    w("seed-all-bins", profile(1, "0.5", [(b, 1 + b, ["{:.3f}".format(1 - b / 100.0)]) for b in range(101)]))
    w("seed-depth-not-monotone", profile(2, "0.5", [(10, 1, ["1", "1"]), (20, 1, ["0.1", "0.1"]), (30, 1, ["1", "0.2"])]))
    w("seed-bad-truncated", profile(2, "0.5", [(3, 4, ["0.9", "0.1"])], ""))
    w("seed-bad-nan", profile(2, "0.5", [(3, 4, ["nan", "0.1"])]))
    w("seed-bad-extra-mean", profile(2, "0.5", [(3, 4, ["0.9", "0.1", "0.2"])]))
    w("seed-bad-order", profile(2, "0.5", [(5, 1, ["0.9", "0.1"]), (4, 1, ["0.9", "0.1"])]))
    w("seed-bad-version", "forkattn-reuse-profile 2\nlayers 2\n")
    w("seed-bad-layers", "forkattn-reuse-profile 1\nlayers 65537\n")
    w("seed-bad-nul", "forkattn-reuse-profile 1\nlayers 2\nthr\0shold 0.5\n")
    w("seed-bad-long-line", "forkattn-reuse-profile 1\nlayers " + "1" * 300 + "\n")
    w("seed-bad-content-after-end", profile(1, "0.5", [], "end\nmore\n"))


def main():
    prefix_seeds()
    tensor_seeds()
    ctx_seeds()
    trie_seeds()
    kept_kl_seeds()
    reuse_profile_seeds()


if __name__ == "__main__":
    main()
