"""forkattn.tree_exec: the DFS path stack, the tree cost model, partitions and batch plans, checked
against tree attention over the whole tree (torch and numpy front ends)."""

import random

import pytest

np = pytest.importorskip("numpy")

import forkattn  # noqa: E402
from forkattn import _lib  # noqa: E402
from forkattn import numpy_api as fnp  # noqa: E402
from conftest import TOL, abs_err, bind_without, rel_err, run_without_torch  # noqa: E402

try:
    import torch
except ImportError:  # numpy-only run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
pytestmark = pytest.mark.skipif(not _lib.has_symbol("forkattn_path_create")
                                or not _lib.has_symbol("forkattn_tree_partition"),
                                reason="the loaded library has no path stack / tree partition")

HQ, HKV, D = 4, 2, 16
MODEL = forkattn.TreeCostModel(heads_q=HQ, head_dim=D, sec_per_mac=1e-10, sec_per_row=1e-8, sec_per_pair=1e-6)


def _random_tree(n, seed, max_len=6, roots=1):
    """A random forest with parents before children, NOT packed depth-first (a node's subtree is
    not contiguous), node lengths 1..max_len. Returns (node_offsets, parents) int lists."""
    rng = random.Random(seed)
    parents = []
    for i in range(n):
        parents.append(-1 if i < roots else rng.randrange(i))
    offs = [0]
    for _ in range(n):
        offs.append(offs[-1] + rng.randint(1, max_len))
    return offs, parents


def _random_trie(seed, n_seqs=9, prompts=1):
    """Rollout-like token sequences: ``prompts`` prompts, each continued by branching answers."""
    rng = random.Random(seed)
    seqs = []
    for p in range(prompts):
        prompt = [1000 * (p + 1) + j for j in range(rng.randint(3, 8))]
        stems = [prompt + [rng.randrange(4) for _ in range(rng.randint(0, 3))] for _ in range(3)]
        for _ in range(n_seqs):
            s = list(rng.choice(stems)) + [rng.randrange(6) for _ in range(rng.randint(1, 6))]
            seqs.append(s)
    return seqs


def _np_qkv(T, dtype, seed):
    rng = np.random.default_rng(seed)
    q = (rng.uniform(-2, 2, (T, HQ, D))).astype(dtype)
    k = rng.uniform(-1, 1, (T, HKV, D)).astype(dtype)
    v = rng.uniform(-1, 1, (T, HKV, D)).astype(dtype)
    do = rng.uniform(-1, 1, (T, HQ, D)).astype(dtype)
    return q, k, v, do


def _walk(path, events, offs, q, k, v, o=None, lse=None, do=None, like=None):
    """Drive ``path`` over the walk: forward (do None) returns (o, lse); backward returns (dq, dk,
    dv) assembled into packed rows. Arrays are numpy or torch (``like`` allocates outputs)."""
    zeros = (lambda shape, dt: torch.zeros(shape, dtype=dt)) if torch is not None and isinstance(q, torch.Tensor) \
        else (lambda shape, dt: np.zeros(shape, dtype=dt))
    T = q.shape[0]
    f32 = torch.float32 if torch is not None and isinstance(q, torch.Tensor) else np.float32
    if do is None:
        o_out, lse_out = zeros(q.shape, q.dtype), zeros((T, HQ), f32)
    else:
        dq, dk, dv = zeros(q.shape, q.dtype), zeros(k.shape, k.dtype), zeros(v.shape, v.dtype)
    max_depth = 0
    for op, x in events:
        a, b = offs[x], offs[x + 1]
        if op == "push":
            path.push(k[a:b], v[a:b])
            max_depth = max(max_depth, path.depth)
            assert path.top_rows == b - a
            if do is None:
                o_out[a:b], lse_out[a:b] = path.attend(q[a:b])
            else:
                dq[a:b] = path.attend_backward(q[a:b], o[a:b], do[a:b], lse[a:b])
        else:
            got = path.pop(want_grads=do is not None)
            if do is None:
                assert got is None
            else:
                dk[a:b], dv[a:b] = got
    assert path.depth == 0 and path.rows == 0
    return (o_out, lse_out) if do is None else (dq, dk, dv)


# --------------------------------------------------------------------------------------------
# DFS path stack


def test_dfs_walk_events():
    ev = forkattn.dfs_walk([-1, 0, 0, 1, -1, 2])
    assert ev == [("push", 0), ("push", 1), ("push", 3), ("pop", 3), ("pop", 1), ("push", 2), ("push", 5),
                  ("pop", 5), ("pop", 2), ("pop", 0), ("push", 4), ("pop", 4)]
    assert forkattn.dfs_walk([]) == []
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="parents\\[1\\] = 1"):
        forkattn.dfs_walk([-1, 1])


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_path_stack_walk_equals_tree_attention_torch(dtype):
    tdt = getattr(torch, dtype)
    offs, parents = _random_tree(30, seed=3, roots=2)
    lay = forkattn.TreeLayout(offs, parents)
    T = lay.num_rows
    g = torch.Generator().manual_seed(5)
    q = ((torch.rand(T, HQ, D, generator=g) * 4 - 2)).to(tdt)
    k, v, do = ((torch.rand(T, h, D, generator=g) * 2 - 1).to(tdt) for h in (HKV, HKV, HQ))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = forkattn.tree_attention(qg, kg, vg, lay, return_lse=True)
    (ref_o.float() * do.float()).sum().backward()

    events = forkattn.dfs_walk(lay.parents)
    with forkattn.PathStack(HQ, HKV, D, tdt) as path:
        assert path.dtype == dtype and path.depth == 0
        o, lse = _walk(path, events, offs, q, k, v)
        dq, dk, dv = _walk(path, events, offs, q, k, v, o=o, lse=lse, do=do)
        assert path.peak_bytes > 0
    assert o.dtype == tdt and dq.dtype == tdt and dk.dtype == tdt and lse.dtype == torch.float32
    tol = TOL[dtype]
    assert rel_err(o, ref_o.detach()) <= tol["o"]
    assert abs_err(lse, ref_lse) <= 1e-4
    assert rel_err(dq, qg.grad) <= tol["grad"]
    assert rel_err(dk, kg.grad) <= tol["grad"]
    assert rel_err(dv, vg.grad) <= tol["grad"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_path_stack_walk_equals_tree_attention_numpy(dtype):
    offs, parents = _random_tree(25, seed=11)
    T = offs[-1]
    q, k, v, do = _np_qkv(T, dtype, seed=2)
    ref_o, ref_lse = fnp.tree_attention(q, k, v, offs, parents, return_lse=True, softmax_scale=0.3)
    rdq, rdk, rdv = fnp.tree_attention_backward(do, q, k, v, ref_o, ref_lse, offs, parents, softmax_scale=0.3)
    events = forkattn.dfs_walk(parents)
    path = forkattn.PathStack(HQ, HKV, D, dtype)
    fwd = []
    for op, x in events:  # the walk with an explicit scale
        a, b = offs[x], offs[x + 1]
        if op == "push":
            path.push(k[a:b], v[a:b])
            fwd.append((a, b, *path.attend(q[a:b], scale=0.3)))
        else:
            path.pop(want_grads=False)
    o = np.zeros_like(q)
    lse = np.zeros((T, HQ), np.float32)
    for a, b, oo, ll in fwd:
        o[a:b], lse[a:b] = oo, ll
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for op, x in events:
        a, b = offs[x], offs[x + 1]
        if op == "push":
            path.push(k[a:b], v[a:b])
            dq[a:b] = path.attend_backward(q[a:b], o[a:b], do[a:b], lse[a:b], scale=0.3)
        else:
            dk[a:b], dv[a:b] = path.pop()
    path.close()
    assert "closed" in repr(path)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert isinstance(o, np.ndarray) and o.dtype == dtype
    assert rel_err(o, ref_o) <= tol
    assert abs_err(lse, ref_lse) <= 1e-4
    for got, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(got, ref) <= tol


def test_path_stack_state_and_peak_follow_the_path():
    # a star: a 16-row root and 40 children of 16 rows; paths of 32 rows, 656 rows in all
    offs = [0] + [16 * (i + 1) for i in range(41)]
    parents = [-1] + [0] * 40
    T = offs[-1]
    q, k, v, _ = _np_qkv(T, np.float32, seed=4)
    with forkattn.PathStack(HQ, HKV, D) as path:
        assert path.dtype == "float32"
        assert "depth=0" in repr(path)
        path.push(k[:16], v[:16])
        path.push(k[16:32], v[16:32])
        assert (path.depth, path.rows, path.top_rows) == (2, 32, 16)
        path.pop(False)
        path.pop(False)
        _walk(path, forkattn.dfs_walk(parents), offs, q, k, v)
        whole = T * HKV * D * (2 * 4 + 4 * 4)
        assert 0 < path.peak_bytes < whole / 5
    with pytest.raises(ValueError, match="closed"):
        path.depth


def test_path_stack_errors():
    k = np.zeros((3, HKV, D), np.float32)
    q = np.zeros((3, HQ, D), np.float32)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="heads_q 3"):
        forkattn.PathStack(3, 2, D)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="head_dim 300"):
        forkattn.PathStack(2, 2, 300)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="dtype"):
        forkattn.PathStack(2, 2, 16, "float64")
    path = forkattn.PathStack(HQ, HKV, D)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="empty"):
        path.attend(q)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="empty"):
        path.pop()
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="rows >= 1"):
        path.push(k[:0], k[:0])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="float16 differs from the PathStack's float32"):
        path.push(k.astype(np.float16), k.astype(np.float16))
    with pytest.raises(TypeError, match="numpy array or a CPU torch tensor"):
        path.push(k.tolist(), k)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="rows"):
        path.push(k, k[:2])  # v rows differ from k's
    assert path.depth == 0
    path.push(k, k)
    with pytest.raises(forkattn.ForkattnInvalidArgument):
        path.attend(q[:2])  # the top node has 3 rows
    o, lse = path.attend(q)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="lse must be float32"):
        path.attend_backward(q, o, o, lse[:2])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="scale"):
        path.attend(q, scale=-1.0)
    assert path.depth == 1
    path.close()
    path.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        path.push(k, k)


@needs_torch
def test_path_stack_torch_errors_and_context():
    ctx = forkattn.Context("cpu", threads=1)
    path = forkattn.PathStack(HQ, HKV, D, torch.bfloat16, context=ctx)
    assert path.context is ctx
    k = torch.zeros(2, HKV, D)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="float32 differs from the PathStack's bfloat16"):
        path.push(k, k)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="must be \\[rows, heads, head_dim\\]"):
        path.push(k[0], k[0])
    path.push(k.bfloat16(), k.bfloat16())
    dk, dv = path.pop()
    assert dk.dtype == torch.bfloat16 and dk.shape == (2, HKV, D)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="empty"):
        path.pop()
    assert path.depth == 0
    ctx.close()
    with pytest.raises(ValueError, match="Context is closed"):
        path.depth
    path.close()


def test_binding_without_the_symbols(monkeypatch):
    """A library without the path stack / partition symbols still binds; only these calls fail."""
    bind_without(monkeypatch, lambda name: name.startswith((
        "forkattn_path_", "forkattn_tree_partition", "forkattn_tree_cost", "forkattn_tree_plan_batches",
        "forkattn_partition_", "forkattn_batch_plan_")))
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_path_create") as e:
        forkattn.PathStack(HQ, HKV, D)
    assert e.value.status == 3
    with pytest.raises(forkattn.ForkattnError, match="has no forkattn_tree_partition"):
        forkattn.tree_partition(([0, 2], [-1]), 2, MODEL)


# --------------------------------------------------------------------------------------------
# cost model, partition, batch plan


def test_cost_model_calibrate_and_cost():
    m = forkattn.TreeCostModel.calibrate(2, 1, 128, "float32")
    assert (m.heads_q, m.head_dim) == (2, 128)
    coef = (m.sec_per_mac, m.sec_per_row, m.sec_per_pair)
    assert all(np.isfinite(c) and c >= 0 for c in coef) and sum(coef) > 0
    assert m.sec_per_mac > 0
    offs, parents = _random_tree(20, seed=1)
    c = m.cost((offs, parents))
    assert c > 0 and c == pytest.approx(forkattn.tree_cost({"node_offsets": offs, "parents": parents}, m))
    # the model's formula on a single sequence of L rows: M = L(L+1)/2, T = L, one pair
    L = 10
    one = forkattn.TreeCostModel(3, 8, 1e-9, 1e-7, 1e-5)
    assert one.cost(([0, L], [-1])) == pytest.approx(1e-9 * 3 * 8 * L * (L + 1) / 2 + 1e-7 * 3 * L + 1e-5)
    assert forkattn.TreeCostModel(**one.as_dict()) == one
    assert forkattn.tree_cost(([0], []), one) == 0.0


@needs_torch
@pytest.mark.parametrize("num_parts", [2, 3])
def test_partition_scatter_equals_whole_tree_torch(num_parts):
    lay = forkattn.TreeLayout.from_sequences(_random_trie(seed=num_parts))
    T = lay.num_rows
    pt = forkattn.tree_partition(lay, num_parts, MODEL)
    assert len(pt) == pt.num_parts == num_parts
    assert pt.num_rows == T and pt.imbalance >= 1.0
    # every row owned exactly once
    owned_count = torch.zeros(T, dtype=torch.int64)
    for part in pt:
        assert isinstance(part.layout, forkattn.TreeLayout)
        assert part.rows.dtype == torch.int64 and part.owned.dtype == torch.bool
        assert part.layout.num_rows == part.rows.numel() == part.owned.numel()
        owned_count.index_add_(0, part.rows[part.owned], torch.ones(int(part.owned.sum()), dtype=torch.int64))
        assert part.cost == pytest.approx(forkattn.tree_cost(part.layout, MODEL))
    assert torch.equal(owned_count, torch.ones(T, dtype=torch.int64))
    assert int(pt.row_owner.min()) >= 0 and pt.row_owner.numel() == T
    assert pt.imbalance == pytest.approx(max(pt.costs) / (sum(pt.costs) / num_parts))

    g = torch.Generator().manual_seed(7)
    q = torch.rand(T, HQ, D, generator=g) * 4 - 2
    k, v, do = (torch.rand(T, h, D, generator=g) * 2 - 1 for h in (HKV, HKV, HQ))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = forkattn.tree_attention(qg, kg, vg, lay, return_lse=True)
    (ref_o * do).sum().backward()
    outs, lses, grads = [], [], ([], [], [])
    for part in pt:
        r = part.rows
        pq, pk, pv = (t[r].clone().requires_grad_() for t in (q, k, v))
        o, lse = forkattn.tree_attention(pq, pk, pv, part.layout, return_lse=True)
        (o * (do[r] * part.owned[:, None, None])).sum().backward()  # dout = 0 on unowned rows
        outs.append(o.detach())
        lses.append(lse)
        for acc, t in zip(grads, (pq, pk, pv)):
            acc.append(t.grad)
    assert rel_err(pt.scatter(outs), ref_o.detach()) <= 1e-5
    assert abs_err(pt.scatter(lses), ref_lse) <= 1e-5
    for acc, ref in zip(grads, (qg.grad, kg.grad, vg.grad)):
        assert rel_err(pt.scatter(acc, owned_only=False), ref) <= 1e-5


def test_partition_numpy_and_more_parts_than_leaves():
    t = fnp.trie_from_sequences(_random_trie(seed=9, n_seqs=5))
    T = t["num_rows"]
    q, k, v, _ = _np_qkv(T, np.float32, seed=8)
    ref = fnp.tree_attention(q, k, v, t["node_offsets"], t["parents"])
    leaves = len(set(range(len(t["parents"]))) - set(t["parents"].tolist()))
    pt = forkattn.tree_partition(t, leaves + 2, MODEL)
    assert pt.num_parts == leaves + 2
    assert [p.rows.size for p in pt.parts[-2:]] == [0, 0]  # more parts than leaves: empty parts
    assert sum(p.cost == 0 for p in pt) == 2
    outs = []
    for part in pt:
        assert isinstance(part.layout, dict) and part.rows.dtype == np.int64 and part.owned.dtype == bool
        if part.rows.size:
            outs.append(fnp.tree_attention(q[part.rows], k[part.rows], v[part.rows], part.layout["node_offsets"],
                                           part.layout["parents"]))
        else:
            outs.append(np.zeros((0, HQ, D), np.float32))
    assert rel_err(pt.scatter(outs), ref) <= 1e-5
    assert np.array_equal(np.sort(np.concatenate([p.rows[p.owned] for p in pt])), np.arange(T))
    assert "TreePartition(parts=%d" % (leaves + 2) in repr(pt)
    one = forkattn.tree_partition((t["node_offsets"].tolist(), t["parents"].tolist()), 1, MODEL)
    assert one.imbalance == 1.0 and np.array_equal(one[0].rows, np.arange(T)) and one[0].owned.all()


def test_batch_plan_covers_every_tree_once():
    seqs = _random_trie(seed=4, n_seqs=3, prompts=6)
    t = fnp.trie_from_sequences(seqs)
    T, parents = t["num_rows"], t["parents"]
    roots = int((parents == -1).sum())
    assert roots == 6
    # root tree of every row
    node_root = np.empty(len(parents), np.int64)
    for i, p in enumerate(parents):
        node_root[i] = i if p < 0 else node_root[p]
    row_root = np.repeat(node_root, np.diff(t["node_offsets"]))
    sizes = np.bincount(row_root, minlength=len(parents))
    max_rows = int(sizes.max()) + 4
    plan = forkattn.tree_plan_batches(t, max_rows, MODEL)
    assert isinstance(plan, forkattn.BatchPlan) and 1 <= len(plan) <= roots
    q, k, v, _ = _np_qkv(T, np.float32, seed=3)
    ref = fnp.tree_attention(q, k, v, t["node_offsets"], parents)
    seen = []
    for b in plan:
        assert b.mode in ("tree", "replicated") and b.reason.startswith(b.mode)
        assert len(b.rows) <= max_rows and len(b.rows) == b.layout["node_offsets"][-1]
        trees = set(row_root[b.rows].tolist())
        assert all(sizes[r] == (row_root[b.rows] == r).sum() for r in trees)  # whole trees only
        seen.extend(trees)
        o = fnp.tree_attention(q[b.rows], k[b.rows], v[b.rows], b.layout["node_offsets"], b.layout["parents"])
        assert rel_err(o, ref[b.rows]) <= 1e-5
    assert sorted(seen) == sorted(set(node_root.tolist()))
    assert np.array_equal(np.sort(np.concatenate([b.rows for b in plan])), np.arange(T))
    # a limit below every tree: one batch per tree; replicated when pairs are expensive
    costly = forkattn.TreeCostModel(HQ, D, 1e-12, 1e-12, 1.0)
    plan1 = forkattn.tree_plan_batches(t, 1, costly)
    assert len(plan1) == roots and "batches" in repr(plan1)


@needs_torch
def test_batch_plan_torch_layouts():
    lay = forkattn.TreeLayout.from_sequences(_random_trie(seed=5, n_seqs=2, prompts=3))
    plan = forkattn.tree_plan_batches(lay, 10 ** 6, MODEL)
    assert len(plan) == 1
    b = plan[0]
    assert isinstance(b.layout, forkattn.TreeLayout) and torch.equal(b.rows, torch.arange(lay.num_rows))
    assert torch.equal(b.layout.parents, lay.parents) and torch.equal(b.layout.node_offsets, lay.node_offsets)


def test_partition_and_plan_errors():
    lay = ([0, 2, 5], [-1, 0])
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="num_parts"):
        forkattn.tree_partition(lay, 0, MODEL)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="max_batch_rows"):
        forkattn.tree_plan_batches(lay, 0, MODEL)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="heads_q"):
        forkattn.tree_partition(lay, 2, forkattn.TreeCostModel(0, D, 1e-9))
    with pytest.raises(forkattn.ForkattnInvalidArgument):
        forkattn.tree_cost(lay, forkattn.TreeCostModel(HQ, D, -1.0))
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="parents"):
        forkattn.tree_partition(([0, 2, 5], [-1, 1]), 2, MODEL)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="n\\+1"):
        forkattn.tree_partition(([0, 2], [-1, 0]), 2, MODEL)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="int64"):
        forkattn.tree_partition(lay, 2 ** 70, MODEL)
    with pytest.raises(TypeError, match="TreeCostModel"):
        forkattn.tree_partition(lay, 2, (HQ, D, 1e-9, 1e-8, 1e-6))
    with pytest.raises(TypeError, match="layout"):
        forkattn.tree_partition([0, 2, 5], 2, MODEL)
    with pytest.raises(TypeError, match="integers"):
        forkattn.tree_cost(([0.0, 2.5], [-1]), MODEL)
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="dtype"):
        forkattn.TreeCostModel.calibrate(HQ, HKV, D, "int8")
    with pytest.raises(forkattn.ForkattnInvalidArgument, match="heads"):
        forkattn.TreeCostModel.calibrate(3, 2, D)


def test_numpy_only_without_torch():
    code = ("import numpy as np, forkattn\n"
            "assert not forkattn.HAVE_TORCH\n"
            "p = forkattn.PathStack(2, 1, 4, np.float32)\n"
            "k = np.ones((3, 1, 4), np.float32); q = np.ones((3, 2, 4), np.float32)\n"
            "p.push(k, k); o, lse = p.attend(q); dk, dv = p.pop()\n"
            "assert isinstance(o, np.ndarray) and o.shape == (3, 2, 4) and dk.shape == (3, 1, 4)\n"
            "m = forkattn.TreeCostModel(2, 4, 1e-9, 1e-8, 1e-6)\n"
            "pt = forkattn.tree_partition(([0, 2, 4, 6], [-1, 0, 0]), 2, m)\n"
            "assert isinstance(pt[0].layout, dict) and pt.row_owner.tolist() == [0, 0, 0, 0, 1, 1]\n"
            "print('OK')\n")
    assert "OK" in run_without_torch(code)
