"""forkattn.distributed: a tree partitioned across 2 and 3 gloo ranks (spawned processes, f32 CPU)
against single-process tree_attention and the float64 replicated reference."""

import os
import random

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import forkattn  # noqa: E402
from forkattn import _lib  # noqa: E402
from forkattn.distributed import DistributedTree, prefix_tree  # noqa: E402
from conftest import TOL, abs_err, leaf64, make_qkv, rel_err, replicated_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not _lib.has_symbol("forkattn_tree_partition"),
                                reason="the loaded library has no tree partition")

HQ, HKV, D = 4, 2, 16


def _random_tree(seed, nodes=50, max_len=10):
    """A forest of 2 roots, parents before children but not packed depth-first; deep chains
    (a node often continues the previous one) next to bushy levels; ~275 rows."""
    rng = random.Random(seed)
    parents = [-1, -1] + [i - 1 if rng.random() < 0.4 else rng.randrange(i) for i in range(2, nodes)]
    offs = [0]
    for _ in range(nodes):
        offs.append(offs[-1] + rng.randint(1, max_len))
    return forkattn.TreeLayout(offs, parents)


def _spawn(worker, world, tmp_path, *args):
    """Run worker(rank, world, init_file, out_dir, *args) on ``world`` gloo ranks."""
    mp.spawn(_entry, args=(worker, world, str(tmp_path / "init"), str(tmp_path), args), nprocs=world)


def _entry(rank, worker, world, init_file, out_dir, args):
    torch.set_num_threads(1)  # several ranks share this machine's cores
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        worker(rank, world, out_dir, *args)
    finally:
        dist.destroy_process_group()


def _two_layers(attend, q, k, v, w):
    """Attention, a row-wise projection by the parameter ``w`` [D, D], attention again: the
    second layer's q/k of a duplicated row depend on the first layer's output there."""
    o = attend(q, k, v)
    return attend(o @ w, o[:, :HKV] @ w, v)


def _weight(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.eye(D) + 0.2 * torch.rand(D, D, generator=g)


def _tree_worker(rank, world, out_dir, seed):
    lay = _random_tree(seed)
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=seed)
    dt = DistributedTree(lay)
    res = dict(rows=dt.rows, owned=dt.owned, num_shared=dt.num_shared_rows, modes={})
    for mode in ("owned", "all"):
        # replicated full tensors: the part rows gathered from them
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = dt.attention(*(dt.gather(t) for t in (fq, fk, fv)), return_lse=True, grads=mode)
        # the loss on every part row: duplicated rows count on their owner only
        (o * dt.gather(do)).sum().backward()
        res["modes"][mode] = dict(o=o.detach(), lse=lse, full_o=dt.assemble(o.detach()), full_lse=dt.assemble(lse))
        for name, t in zip(("dq", "dk", "dv"), (fq, fk, fv)):
            res["modes"][mode][name] = t.grad[dt.rows]  # the part rows' gradients
            if mode == "owned":  # each row's gradient on one rank: their sum (as DDP's) is exact
                dist.all_reduce(t.grad)
                res["modes"][mode]["full_" + name] = t.grad
    # a model's layers on the part rows: parameter gradients summed across ranks (as DDP) are exact
    w = _weight(seed).requires_grad_()
    fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
    o = _two_layers(dt.attention, *(dt.gather(t) for t in (fq, fk, fv)), w)
    (o * dt.gather(do)).sum().backward()
    for t in (w, fq, fk, fv):
        dist.all_reduce(t.grad)
    res["two_layers"] = (dt.assemble(o.detach()), w.grad, fq.grad, fk.grad, fv.grad)
    # fewer leaves than ranks: the last rank's part is empty, yet it joins the reduction
    small = forkattn.TreeLayout.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    sq, sk, sv, sdo = make_qkv(small.num_rows, HQ, HKV, D, torch.float32, seed=seed + 1)
    ds = DistributedTree(small)
    assert ds.rows.numel() == 0 if rank == 2 else ds.num_shared_rows == 2
    leaves = [t.clone().requires_grad_() for t in (sq, sk, sv)]
    (ds.attention(*(ds.gather(t) for t in leaves)) * ds.gather(sdo)).sum().backward()
    ref = [t.clone().requires_grad_() for t in (sq, sk, sv)]
    (forkattn.tree_attention(*ref, small) * sdo).sum().backward()
    for got, want in zip(leaves, ref):
        dist.all_reduce(got.grad)
        assert rel_err(got.grad, want.grad) <= TOL["float32"]["grad"]
    with torch.no_grad():  # no autograd: the forward alone
        res["no_grad_o"] = dt.attention(*(dt.gather(t) for t in (q, k, v)))
    torch.save(res, os.path.join(out_dir, "rank%d.pt" % rank))


def _reference(lay, seed):
    """(single-process f32 tree_attention, float64 replicated) results: o, lse, dq, dk, dv."""
    q, k, v, do = make_qkv(lay.num_rows, HQ, HKV, D, torch.float32, seed=seed)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = forkattn.tree_attention(qg, kg, vg, lay, return_lse=True)
    (o * do).sum().backward()
    f32 = (o.detach(), lse, qg.grad, kg.grad, vg.grad)
    offs, rows = lay._sequence_rows()
    paths = [rows[offs[i]:offs[i + 1]].tolist() for i in range(offs.numel() - 1)]
    q64, k64, v64 = leaf64(q, k, v)
    ro, rl = replicated_reference(q64, k64, v64, paths, D ** -0.5)
    (ro * do.double()).sum().backward()
    f64 = (ro.detach(), rl.detach(), q64.grad, k64.grad, v64.grad)
    return f32, f64


@pytest.mark.parametrize("world", [2, 3])
def test_partitioned_forward_backward_equals_single_process(world, tmp_path):
    seed = 40 + world
    _spawn(_tree_worker, world, tmp_path, seed)
    lay = _random_tree(seed)
    T = lay.num_rows
    f32, f64 = _reference(lay, seed)
    tol = TOL["float32"]
    res = [torch.load(tmp_path / ("rank%d.pt" % r)) for r in range(world)]
    q, k, v, do = make_qkv(T, HQ, HKV, D, torch.float32, seed=seed)
    w = _weight(seed).requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = _two_layers(lambda *qkv: forkattn.tree_attention(*qkv, lay), *leaves, w)
    (o * do).sum().backward()
    for r in res:
        for got, ref in zip(r["two_layers"], (o.detach(), w.grad, *(t.grad for t in leaves))):
            assert rel_err(got, ref) <= tol["grad"]
    owners = torch.zeros(T, dtype=torch.int64)
    for r in res:
        owners.index_add_(0, r["rows"][r["owned"]], torch.ones(int(r["owned"].sum()), dtype=torch.int64))
    assert torch.equal(owners, torch.ones(T, dtype=torch.int64))  # every row owned once
    assert res[0]["num_shared"] > 0  # the test exercises the reduction
    for ref in (f32, f64):
        ro, rlse, rdq, rdk, rdv = ref
        for r in res:
            rows, owned = r["rows"], r["owned"]
            assert rel_err(r["no_grad_o"], ro[rows]) <= tol["o"]
            for mode in ("owned", "all"):
                m = r["modes"][mode]
                # forward: exact on every part row; assembled on every rank
                assert rel_err(m["o"], ro[rows]) <= tol["o"]
                assert abs_err(m["lse"], rlse[rows]) <= tol["lse"]
                assert rel_err(m["full_o"], ro) <= tol["o"]
                assert abs_err(m["full_lse"], rlse) <= tol["lse"]
                for name, rg in (("dq", rdq), ("dk", rdk), ("dv", rdv)):
                    g = m[name]
                    if mode == "all":  # every part row complete
                        assert rel_err(g, rg[rows]) <= tol["grad"], (mode, name)
                    else:  # owned rows complete, the others zero; summed across ranks: every row
                        assert rel_err(m["full_" + name], rg) <= tol["grad"], name
                        assert rel_err(g[owned], rg[rows[owned]]) <= tol["grad"], (mode, name)
                        assert not g[~owned].any(), name


def _mismatch_and_prefix_worker(rank, world, out_dir):
    # a rank with a different tree: every rank raises, none hangs
    lay = _random_tree(7 + (rank == 1))
    with pytest.raises(ValueError, match="different layouts"):
        DistributedTree(lay)
    with pytest.raises(ValueError, match="different layouts"):  # same tree, different cost models
        DistributedTree(_random_tree(7), model=forkattn.TreeCostModel(HQ, D, 1e-9, 1e-8 * (rank + 1)))
    # a rank whose partition fails raises its error, the others say which rank failed
    bad = forkattn.TreeCostModel(0 if rank == 1 else HQ, D, 1e-9)
    with pytest.raises(forkattn.ForkattnInvalidArgument if rank == 1 else ValueError,
                       match="heads_q" if rank == 1 else r"ranks \[1\] could not partition"):
        DistributedTree(_random_tree(7), model=bad)
    # the groups of a shared-prefix layout: the partitioned tree equals prefix_attention
    spl = forkattn.SharedPrefixLayout.from_lengths([5, 9, 3], [[4, 7, 2], [6], [3, 3, 8, 1]])
    q, k, v, do = make_qkv(spl.num_rows, HQ, HKV, D, torch.float32, seed=3)
    dt = DistributedTree(spl)
    assert rel_err(dt.assemble(dt.attention(*(dt.gather(t) for t in (q, k, v)))),
                   forkattn.prefix_attention(q, k, v, spl)) <= TOL["float32"]["o"]
    with pytest.raises(ValueError, match="rank %d's part has" % rank):
        dt.attention(q, k, v) if dt.rows.numel() != spl.num_rows else dt.attention(q[1:], k[1:], v[1:])
    with pytest.raises(ValueError, match="grads must be"):
        dt.attention(*(dt.gather(t) for t in (q, k, v)), grads="none")
    open(os.path.join(out_dir, "ok%d" % rank), "w").close()


def test_mismatched_layouts_and_shared_prefix_groups(tmp_path):
    _spawn(_mismatch_and_prefix_worker, 2, tmp_path)
    assert all((tmp_path / ("ok%d" % r)).exists() for r in range(2))


def test_prefix_tree_equals_prefix_attention():
    spl = forkattn.SharedPrefixLayout.from_lengths([5, 0, 3], [[4, 7], [6, 2], [3, 0, 8]])
    q, k, v, _ = make_qkv(spl.num_rows, HQ, HKV, D, torch.float32, seed=5)
    tree = prefix_tree(spl)
    assert tree.num_rows == spl.num_rows
    assert rel_err(forkattn.tree_attention(q, k, v, tree), forkattn.prefix_attention(q, k, v, spl)) <= 1e-6


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="not initialized"):
        DistributedTree(_random_tree(1))
