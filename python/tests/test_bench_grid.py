"""Smoke test of bench/grid.py: its quick grid on the CPU backend, every case checked."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRID = os.path.join(REPO, "bench", "grid.py")


def quick_case_names():
    spec = importlib.util.spec_from_file_location("bench_grid", GRID)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [c.name for c in mod.grid("quick", 1)]


def cpu_library():
    """The CPU build's library the scripts load (skips the test without one)."""
    lib = os.environ.get("FORKATTN_LIBRARY") or os.path.join(REPO, "build", "libforkattn.so")
    if not os.path.exists(lib):
        pytest.skip("no library at %s" % lib)
    return lib


def test_quick_grid_on_cpu(tmp_path):
    lib = cpu_library()
    out = tmp_path / "grid.json"
    r = subprocess.run([sys.executable, GRID, "--device", "cpu", "--quick", "--seed", "1", "--results", "",
                        "--lib", lib, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    for name in quick_case_names():
        assert name in rows, (name, r.stdout[-4000:])
        assert rows[name].rstrip().endswith("| PASS |"), rows[name]
    data = json.loads(out.read_text())
    assert data["passed"]
    assert [c["name"] for c in data["cases"]] == quick_case_names()
    for c in data["cases"]:
        impls = {x["impl"]: x for x in c["impls"]}
        for fa in ("binding", "c"):
            assert impls[fa]["check"]["pass"] and impls[fa]["fwd_ms"] > 0 and impls[fa]["fwd_bwd_ms"] > 0, c["name"]
        assert ("sdpa" in impls) == (c["kind"] != "trie") and ("flex" in impls) == (c["kind"] in ("grpo", "trie"))


def test_queued_grid_times_calls_back_to_back(tmp_path, monkeypatch):
    """--queue N: each timed sample is N calls back to back; the run says so and records it."""
    lib = cpu_library()
    out = tmp_path / "grid.json"
    r = subprocess.run([sys.executable, GRID, "--device", "cpu", "--quick", "--filter", "tiny", "--queue", "3",
                        "--results", "", "--lib", lib, "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "each sample 3 calls back to back" in r.stdout
    data = json.loads(out.read_text())
    assert data["passed"] and data["meta"]["queue"] == 3 and [c["name"] for c in data["cases"]] == [
        "tiny 1x64 8/8 d64 causal"]
    # the timer itself: three calls a sample, the time divided by three
    spec = importlib.util.spec_from_file_location("compare_torch", os.path.join(REPO, "bench", "compare_torch.py"))
    ct = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    spec.loader.exec_module(ct)
    calls = []
    ms = ct.time_once(lambda: calls.append(1), False, 3)
    assert len(calls) == 3 and ms >= 0


def test_host_cost_on_cpu():
    """bench/host_cost.py's CPU smoke run: a row of host times for every case."""
    lib = cpu_library()
    script = os.path.join(REPO, "bench", "host_cost.py")
    r = subprocess.run([sys.executable, script, "--device", "cpu", "--lib", lib, "--reps", "5", "--rounds", "2",
                        "--burst", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    tables, rows = [], None
    for line in r.stdout.splitlines():
        if line.startswith("| case "):
            rows = []
            tables.append(rows)
        elif line.startswith("| ") and rows is not None:
            rows.append([c.strip() for c in line.split("|")[1:-1]])
    assert len(tables) == 2, r.stdout[-4000:]
    c_rows, binding_rows = tables
    kinds = ["tiny", "dense", "GRPO", "trie"]
    assert [c[0].split()[0] for c in c_rows] == kinds and [c[0].split()[0] for c in binding_rows] == kinds
    for cells in c_rows:
        host = [float(cells[i]) for i in (2, 3, 5, 6)]  # alone and queued, forward and backward
        assert all(x > 0 for x in host), cells
        assert cells[4] == "—" and cells[7] == "—"  # no GPU time on the CPU backend
    for cells in binding_rows:
        assert all(float(x) > 0 for x in cells[1:]), cells
