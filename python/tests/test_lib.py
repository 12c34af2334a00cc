"""Library loading, contexts and errors (no PyTorch or numpy needed)."""

import os
import subprocess
import sys
import threading

import pytest

import forkattn
from forkattn import _lib
from conftest import run_without_torch

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_load_library_is_cached_and_versioned():
    lib = forkattn.load_library()
    assert forkattn.load_library() is lib
    assert forkattn.version().count(".") == 2
    assert lib.forkattn_version_number() // 10000 == 0
    assert os.path.exists(forkattn.library_path())
    with pytest.raises(RuntimeError, match="already loaded"):
        forkattn.load_library("/nonexistent/libforkattn.so")


def test_bad_forkattn_library_env_is_reported():
    env = dict(os.environ, FORKATTN_LIBRARY="/nonexistent/libforkattn.so", PYTHONPATH=PYDIR)
    code = "import sys; sys.modules['torch'] = None; import forkattn; forkattn.load_library()"
    r = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "FORKATTN_LIBRARY" in r.stderr and "/nonexistent/libforkattn.so" in r.stderr


def test_context_properties_and_reason():
    ctx = forkattn.Context(backend="cpu", threads=1)
    assert ctx.backend == "cpu"  # explicit: FORKATTN_BACKEND applies to "auto" only
    assert ctx.threads >= 1
    assert ctx.backend_reason
    assert ctx.last_error == ""
    assert ctx.peak_workspace >= 0
    assert "Context" in repr(ctx)
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        ctx.backend
    with pytest.raises(ValueError):
        forkattn.Context(backend="tpu")


def test_a_cpu_context_takes_no_stream():
    ctx = forkattn.Context(backend="cpu", threads=1)
    assert ctx.stream is None
    with pytest.raises(forkattn.ForkattnError, match="CPU context has no stream") as e:
        ctx.set_stream(0)
    assert e.value.status == _lib.BACKEND_UNAVAILABLE
    assert ctx.follow_stream(0) is False, "the caller synchronizes instead"
    assert ctx.follow_stream(0) is False and ctx.stream is None
    ctx.synchronize()  # nothing queued
    ctx.clear_stream()
    ctx.close()


def test_backend_name_and_default_context_per_thread():
    name = forkattn.backend()
    assert name in ("cpu", "gpu")
    main = forkattn.current_context()
    assert forkattn.current_context() is main
    seen = []
    t = threading.Thread(target=lambda: seen.append(forkattn.current_context()))
    t.start()
    t.join()
    assert seen[0] is not main  # one context per thread
    own = forkattn.Context("cpu")
    with forkattn.use_context(own):
        assert forkattn.current_context() is own
        with own:
            assert forkattn.current_context() is own
    assert forkattn.current_context() is main


def test_configure_replaces_default_contexts():
    before = forkattn.current_context()
    prev = forkattn.configure(threads=1)
    try:
        after = forkattn.current_context()
        assert after is not before and after.threads == 1
    finally:
        forkattn.configure(**prev)


def test_gpu_context_unavailable_raises_with_reason():
    if forkattn.build_has_offload():
        pytest.skip("offload build: a GPU context may well be available")
    with pytest.raises(forkattn.ForkattnError) as e:
        forkattn.Context(backend="gpu")
    assert e.value.status == 4 and e.value.status_name == "backend unavailable"
    assert "offload" in e.value.message
    assert not isinstance(e.value, ValueError)


def test_error_types_and_pickling():
    import pickle

    e = _lib._make_error(1, "q: bad")
    assert isinstance(e, forkattn.ForkattnInvalidArgument) and isinstance(e, ValueError)
    assert "invalid argument" in str(e) and "q: bad" in str(e)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is type(e) and e2.status == 1 and e2.message == "q: bad"
    e3 = _lib._make_error(5, "copy failed")
    assert type(e3) is forkattn.ForkattnError and e3.status_name == "device error"


def test_make_tensor_stride_rules():
    mk = _lib.make_tensor
    assert mk(8, 0, 4, 2, 8, 16, 8) is not None                    # contiguous
    assert mk(8, 0, 4, 2, 8, 32, 8) is not None                    # padded rows (fused qkv)
    t = mk(8, 0, 4, 2, 8, 8, 32)                                   # head-major
    assert t is not None and t.head_stride == 32
    assert mk(8, 0, 4, 2, 8, 8, 8) is None                         # overlapping
    assert mk(8, 0, 4, 2, 8, 16, 0) is None                        # expanded heads
    t = mk(8, 0, 4, 1, 8, 8, 12345)                                # one head: stride unused
    assert t is not None and t.head_stride == 8
    t = mk(8, 0, 1, 2, 8, 0, 8)                                    # one row: stride unused
    assert t is not None and t.row_stride == 16
    assert mk(8, 0, 4, 1, 8, 0, 8) is None                         # expanded rows


def test_import_without_torch_names_fail_cleanly():
    code = ("import forkattn\n"
            "assert not forkattn.HAVE_TORCH\n"
            "try:\n    forkattn.SharedPrefixLayout\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n")
    out = run_without_torch(code)
    assert "IMPORTERROR" in out and "numpy_api" in out


def test_f32_precision_option_is_checked_and_configurable():
    for p in ("high", "highest", "medium"):
        forkattn.Context("cpu", f32_precision=p).close()  # a CPU context accepts (and ignores) it
    with pytest.raises(ValueError, match="f32_precision"):
        forkattn.Context("cpu", f32_precision="tf32")
    with pytest.raises(ValueError, match="f32_precision"):
        forkattn.configure(f32_precision="fast")
    prev = forkattn.configure(f32_precision="medium")
    try:
        assert prev["f32_precision"] == "high"
        assert forkattn.configure()["f32_precision"] == "medium"
    finally:
        forkattn.configure(**prev)
