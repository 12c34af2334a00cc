"""TreeLayout (tries built through ctypes) and tree_attention against float64 references."""

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from conftest import check_close, leaf64, make_qkv, masked_attention_f64, rel_err, replicated_reference  # noqa: E402

# A forest: shared prefixes, a sequence that is a prefix of another, a duplicate, another root.
SEQS = [
    [1, 2, 3, 4, 5],
    [1, 2, 3, 6],
    [1, 2, 3, 4, 7, 8],
    [9, 10],
    [1, 2],
    [1, 2, 3, 6],
    [9, 11, 12],
]
HQ, HKV, D = 4, 2, 16


def _paths(layout):
    offs, rows = layout._sequence_rows()
    return [rows[offs[i]:offs[i + 1]].tolist() for i in range(offs.numel() - 1)]


def test_from_sequences_structure():
    lay = forkattn.TreeLayout.from_sequences([torch.tensor(s) for s in SEQS])
    toks = [t for s in SEQS for t in s]
    # every input token maps to a packed row holding that token
    assert lay.row_tokens[lay.input_rows].tolist() == toks
    # unique prefixes = packed rows
    prefixes = {tuple(s[:j + 1]) for s in SEQS for j in range(len(s))}
    assert lay.num_rows == len(prefixes)
    assert lay.replicated_tokens == len(toks)
    assert lay.dedup_ratio == pytest.approx(len(toks) / len(prefixes))
    # position ids: position of every row within its sequences
    pos = lay.position_ids()
    for s, rows in zip(SEQS, _paths(lay)):
        assert pos[rows].tolist() == list(range(len(s)))
        assert lay.row_tokens[rows].tolist() == s
    # parents precede children, DFS packing
    assert all(p < i for i, p in enumerate(lay.parents.tolist()))
    # the same maps through the python fallbacks of a raw layout
    raw = forkattn.TreeLayout(lay.node_offsets, lay.parents)
    assert torch.equal(raw.position_ids(), pos)
    # raw layouts count root-to-leaf paths (sequences that are prefixes of others don't count)
    leaves = [s for s in {tuple(x) for x in SEQS}
              if not any(len(o) > len(s) and tuple(o[:len(s)]) == s for o in SEQS)]
    assert raw.replicated_tokens == sum(len(s) for s in leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_matches_replicated(dtype):
    lay = forkattn.TreeLayout.from_sequences(SEQS)
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, dtype, seed=21)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = forkattn.tree_attention(qg, kg, vg, lay, return_lse=True)
    (out * do).sum().backward()
    q64, k64, v64 = leaf64(q, k, v)
    ro, rl = replicated_reference(q64, k64, v64, _paths(lay), D ** -0.5)
    (ro * do.double()).sum().backward()
    check_close((out.detach(), lse, qg.grad, kg.grad, vg.grad),
                (ro.detach(), rl.detach(), q64.grad, k64.grad, v64.grad), dtype)


def test_each_sequence_equals_causal_attention_on_it():
    """gather_sequences(tree output) == causal attention run on each sequence alone."""
    lay = forkattn.TreeLayout.from_sequences(SEQS)
    q, k, v, _ = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=4)
    out = forkattn.tree_attention(q, k, v, lay)
    per_seq = lay.gather_sequences(out, padded=False)
    qs, ks, vs = (lay.gather_sequences(t, padded=False) for t in (q, k, v))
    assert len(per_seq) == len(SEQS)
    for s, o, qq, kk, vv in zip(SEQS, per_seq, qs, ks, vs):
        L = len(s)
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[None]
        ref = masked_attention_f64(qq[None].double(), kk[None].double(), vv[None].double(), mask, D ** -0.5)[0][0]
        assert o.shape == (L, HQ, D)
        assert rel_err(o, ref) <= 1e-5
    padded = lay.gather_sequences(out)
    assert padded.shape == (len(SEQS), max(map(len, SEQS)), HQ, D)
    for i, o in enumerate(per_seq):
        assert torch.equal(padded[i, :len(o)], o) and not padded[i, len(o):].any()
    # pack_sequences inverts gather_sequences (shared rows carry equal values)
    assert torch.equal(lay.pack_sequences(per_seq), out)
    assert torch.equal(lay.pack_sequences(padded), out)
    assert lay.gather_sequences(out, length=9).shape[1] == 9


def test_from_parents_and_raw_layout_with_empty_nodes():
    # nodes given out of order: 0 is a child of 2, 2 is the root
    parents = [2, 0, -1, 2]
    lengths = [3, 2, 4, 1]
    lay = forkattn.TreeLayout.from_parents(parents, lengths)
    assert lay.num_nodes == 4 and lay.num_rows == 10
    x = torch.arange(10)  # rows in input order (nodes concatenated as given)
    packed = lay.pack_inputs(x)
    assert sorted(packed.tolist()) == list(range(10))
    assert packed[lay.input_rows].tolist() == x.tolist()
    q, k, v, do = make_qkv(10, HQ, HKV, D, torch.float32, seed=8)
    out = forkattn.tree_attention(q, k, v, lay)
    ro, _ = replicated_reference(*leaf64(q, k, v), _paths(lay), D ** -0.5)
    assert rel_err(out, ro) <= 1e-5
    # a raw layout (no trie) with empty nodes: children see through them
    raw = forkattn.TreeLayout([0, 3, 3, 5, 5, 7], [-1, 0, 1, 1, -1])
    q, k, v, do = make_qkv(7, HQ, HKV, D, torch.float32, seed=9)
    qg = q.clone().requires_grad_()
    out = forkattn.tree_attention(qg, k, v, raw)
    (out * do).sum().backward()
    q64, k64, v64 = leaf64(q, k, v)
    ro, _ = replicated_reference(q64, k64, v64, _paths(raw), D ** -0.5)
    (ro * do.double()).sum().backward()
    assert rel_err(out.detach(), ro.detach()) <= 1e-5
    assert rel_err(qg.grad, q64.grad) <= 1e-5
    assert raw.position_ids().tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_token_parents_builder():
    # tokens: 0 -> 1 -> 2, 1 -> 3 (branch), 4 is another root
    lay = forkattn.TreeLayout.from_token_parents([-1, 0, 1, 1, -1])
    assert lay.num_rows == 5 and lay.num_nodes == 4
    assert sorted(lay.input_rows.tolist()) == list(range(5))


def test_tree_empty_and_errors():
    lay = forkattn.TreeLayout.from_sequences([])
    assert lay.num_rows == 0 and lay.num_nodes == 0 and lay.dedup_ratio == 1.0
    q = torch.randn(0, HQ, D, requires_grad=True)
    out = forkattn.tree_attention(q, torch.randn(0, HKV, D), torch.randn(0, HKV, D), lay)
    assert out.shape == (0, HQ, D)
    out.sum().backward()
    assert lay.gather_sequences(out).shape == (0, 0, HQ, D)
    # an empty sequence: the C builder refuses it and names the argument
    with pytest.raises(forkattn.ForkattnError) as e:
        forkattn.TreeLayout.from_sequences([[1, 2], []])
    assert e.value.status == 1 and "seq_offsets" in e.value.message
    with pytest.raises(ValueError, match="cycle|parent"):
        forkattn.TreeLayout.from_parents([1, 0], [1, 1])
    with pytest.raises(ValueError, match="ROOT|root"):
        forkattn.TreeLayout.from_sequences([[1], [2]], single_root=True)
    # a bad raw layout is refused by the C call with its message
    bad = forkattn.TreeLayout([0, 2, 4], [1, -1])
    with pytest.raises(forkattn.ForkattnError, match="parent"):
        forkattn.tree_attention(torch.randn(4, 2, D), torch.randn(4, 2, D), torch.randn(4, 2, D), bad)
    with pytest.raises(ValueError):
        forkattn.TreeLayout([0, 2], [-1, -1])
