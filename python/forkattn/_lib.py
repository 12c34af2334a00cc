"""ctypes layer: finding and loading libforkattn, C struct mirrors, contexts,
status -> exception, and the array-library-neutral call helpers that the torch
(ops.py) and numpy (numpy_api.py) front ends share.

Nothing here imports torch or numpy: tensors reach this module as
``forkattn_tensor`` descriptors (pointer, dtype code, sizes, element strides)
built by the front ends with :func:`make_tensor`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import math
import os
import sys
import threading
from ctypes import POINTER, Structure, byref, c_char_p, c_double, c_float, c_int, c_int64, c_size_t
from ctypes import c_uint, c_uint64, c_void_p

__all__ = [
    "ForkattnError",
    "ForkattnInvalidArgument",
    "Context",
    "load_library",
    "library_path",
    "backend",
    "configure",
    "current_context",
    "default_context",
    "use_context",
    "version",
]

# --------------------------------------------------------------------------------------------
# enums (values fixed by include/forkattn.h; only ever appended to)

STATUS_NAMES = {
    0: "ok",
    1: "invalid argument",
    2: "out of memory",
    3: "unsupported",
    4: "backend unavailable",
    5: "device error",
    6: "internal error",
}
OK, ERR_INVALID_ARGUMENT = 0, 1
UNSUPPORTED, BACKEND_UNAVAILABLE = 3, 4
BACKENDS = {"auto": 0, "cpu": 1, "gpu": 2}
BACKEND_NAMES = {0: "auto", 1: "cpu", 2: "gpu"}
# forkattn_f32_precision: how a GPU context multiplies f32 inputs (docs/numerics.md "f32 on tensor cores")
F32_PRECISIONS = {"high": 0, "highest": 1, "medium": 2}
DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2
DTYPE_ITEMSIZE = {DTYPE_F32: 4, DTYPE_BF16: 2, DTYPE_F16: 2}
DTYPE_CODES = {
    "float32": DTYPE_F32, "f32": DTYPE_F32, "float": DTYPE_F32,
    "bfloat16": DTYPE_BF16, "bf16": DTYPE_BF16,
    "float16": DTYPE_F16, "f16": DTYPE_F16, "half": DTYPE_F16,
}
DTYPE_NAMES = {DTYPE_F32: "float32", DTYPE_BF16: "bfloat16", DTYPE_F16: "float16"}
MEMORY_HOST, MEMORY_DEVICE = 0, 1
MASK_CAUSAL, MASK_BIDIRECTIONAL = 0, 1
TRIE_SINGLE_ROOT = 1
KL_FORWARD, KL_REVERSE = 0, 1
KL_DIRECTIONS = {"forward": KL_FORWARD, "reverse": KL_REVERSE}
KL_STATS = 4  # FORKATTN_KL_STATS: floats per (row, head) of StreamKL's saved statistics
KEPT_BLOCK = 64  # FORKATTN_KEPT_BLOCK: side of a block of a kept set's block mask
KV_STREAMING_LLM, KV_H2O, KV_SNAPKV = 0, 1, 2
KV_POLICIES = {"streaming_llm": KV_STREAMING_LLM, "h2o": KV_H2O, "snapkv": KV_SNAPKV}
EXEC_TREE, EXEC_REPLICATED = 0, 1
EXEC_MODES = {EXEC_TREE: "tree", EXEC_REPLICATED: "replicated"}

# The C library major version this binding speaks (minor versions only add).
_ABI_MAJOR = 0
_MIN_VERSION_NUMBER = 200  # 0.2.0: struct_size in the option structs


# --------------------------------------------------------------------------------------------
# struct mirrors: field for field the C structs of include/forkattn.h and
# forkattn_experimental.h (python/tests/test_abi_layout.py checks them against the C layouts).


class _Options(Structure):
    """An option struct: its first field ``struct_size`` is set to the struct's size on
    construction, as the C _init functions do; positional arguments fill the fields after it."""

    def __init__(self, *args, **kwargs):
        super().__init__(ctypes.sizeof(type(self)), *args, **kwargs)


class Tensor(Structure):
    """``forkattn_tensor``: a strided [rows, heads, head_dim] view, strides in elements."""

    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int),
        ("rows", c_int64),
        ("heads", c_int64),
        ("head_dim", c_int64),
        ("row_stride", c_int64),
        ("head_stride", c_int64),
    ]


class PrefixLayout(Structure):
    """``forkattn_prefix_layout``: one shared-prompt group (CSR response offsets)."""

    _fields_ = [
        ("prompt_len", c_int64),
        ("num_responses", c_int64),
        ("response_offsets", POINTER(c_int64)),
        ("mask", c_int),
    ]


class TreeLayoutC(Structure):
    """``forkattn_tree_layout``: node_offsets [n+1] and parents [n] (host arrays)."""

    _fields_ = [
        ("num_nodes", c_int64),
        ("node_offsets", POINTER(c_int64)),
        ("parents", POINTER(c_int64)),
    ]


class LayoutC(Structure):
    """``forkattn_layout``: exactly one of ``prefix`` / ``tree`` is non-NULL."""

    _fields_ = [
        ("prefix", POINTER(PrefixLayout)),
        ("tree", POINTER(TreeLayoutC)),
    ]


class KeptSetC(Structure):
    """``forkattn_kept_set``: CSR kept-key lists and/or a [heads, nb, nb] block mask (host)."""

    _fields_ = [
        ("heads", c_int64),
        ("compressed_rows", c_int64),
        ("query_start", c_int64),
        ("offsets", POINTER(c_int64)),
        ("index", POINTER(c_int64)),
        ("block_mask", POINTER(ctypes.c_ubyte)),
    ]


class KlOptions(_Options):
    """``forkattn_kl_options``."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("direction", c_int),
        ("scale_teacher", c_float),
        ("scale_student", c_float),
        ("temperature", c_float),
        ("scale_by_tau2", c_int),
    ]


class KvPolicy(_Options):
    """``forkattn_kv_policy``."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("kind", c_int),
        ("budget", c_int64),
        ("sinks", c_int64),
        ("window", c_int64),
        ("pool_kernel", c_int64),
        ("scale", c_float),
    ]


class TreeCostModelC(Structure):
    """``forkattn_tree_cost_model``: seconds = sec_per_mac * heads_q * head_dim * M
    + sec_per_row * heads_q * T + sec_per_pair * pairs."""

    _fields_ = [
        ("heads_q", c_int64),
        ("head_dim", c_int64),
        ("sec_per_mac", c_double),
        ("sec_per_row", c_double),
        ("sec_per_pair", c_double),
    ]


class KvCacheOptions(_Options):
    """``forkattn_kv_cache_options``: shape and byte budget of a shared-prefix KV cache."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("capacity_bytes", c_size_t),
        ("block_tokens", c_int64),
        ("layers", c_int64),
        ("kv_heads", c_int64),
        ("head_dim", c_int64),
        ("dtype", c_int),
        ("memory", c_int),
    ]


class KvCacheStats(Structure):
    """``forkattn_kv_cache_stats``."""

    _fields_ = [
        ("hits", c_uint64),
        ("misses", c_uint64),
        ("insertions", c_uint64),
        ("evictions", c_uint64),
        ("rejected", c_uint64),
        ("bytes", c_size_t),
        ("entries", c_int64),
    ]


class CtxOptions(_Options):
    """``forkattn_ctx_options``."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("backend", c_int),
        ("device", c_int),
        ("threads", c_int),
        ("bind_threads", c_int),
        ("verbose", c_int),
        ("gpu_kernels", c_int),
        ("gpu_persist", c_int),
        ("f32_precision", c_int),
    ]


_T = POINTER(Tensor)
_I64P = POINTER(c_int64)

# name: (restype, argtypes). Only _REQUIRED symbols must exist: a stripped-down build may lack
# the others (tries, kept sets, StreamKL, kv_select, the DFS path stack, the experimental tree
# cost model / partition / batch plan, the diffusion-LM KV cache), and the binding then fails
# only when they are used.
_SIGNATURES = {
    "forkattn_version_number": (c_uint, []),
    "forkattn_version_string": (c_char_p, []),
    "forkattn_status_string": (c_char_p, [c_int]),
    "forkattn_backend_name": (c_char_p, [c_int]),
    "forkattn_build_has_offload": (c_int, []),
    "forkattn_ctx_options_init": (None, [POINTER(CtxOptions)]),
    "forkattn_ctx_create": (c_int, [POINTER(c_void_p), POINTER(CtxOptions)]),
    "forkattn_ctx_create_error": (c_char_p, []),
    "forkattn_ctx_destroy": (None, [c_void_p]),
    "forkattn_ctx_backend": (c_int, [c_void_p]),
    "forkattn_ctx_backend_reason": (c_char_p, [c_void_p]),
    "forkattn_ctx_gpu_kernels": (c_char_p, [c_void_p]),
    "forkattn_ctx_threads": (c_int, [c_void_p]),
    "forkattn_ctx_last_error": (c_char_p, [c_void_p]),
    "forkattn_ctx_peak_workspace": (c_size_t, [c_void_p]),
    "forkattn_ctx_set_stream": (c_int, [c_void_p, c_void_p]),
    "forkattn_ctx_synchronize": (c_int, [c_void_p]),
    "forkattn_ctx_clear_stream": (c_int, [c_void_p]),
    "forkattn_prefix_fwd": (
        c_int,
        [c_void_p, POINTER(PrefixLayout), _T, _T, _T, _T, c_void_p, c_float, c_int],
    ),
    "forkattn_prefix_bwd": (
        c_int,
        [c_void_p, POINTER(PrefixLayout), _T, _T, _T, _T, _T, c_void_p, _T, _T, _T, c_float, c_int],
    ),
    "forkattn_tree_fwd": (
        c_int,
        [c_void_p, POINTER(TreeLayoutC), _T, _T, _T, _T, c_void_p, c_float, c_int],
    ),
    "forkattn_tree_bwd": (
        c_int,
        [c_void_p, POINTER(TreeLayoutC), _T, _T, _T, _T, _T, c_void_p, _T, _T, _T, c_float, c_int],
    ),
    "forkattn_trie_from_sequences": (
        c_int,
        [c_void_p, c_int64, _I64P, _I64P, c_uint, POINTER(c_void_p)],
    ),
    "forkattn_trie_from_parents": (
        c_int,
        [c_void_p, c_int64, _I64P, _I64P, c_uint, POINTER(c_void_p)],
    ),
    "forkattn_trie_from_token_parents": (
        c_int,
        [c_void_p, c_int64, _I64P, c_uint, POINTER(c_void_p)],
    ),
    "forkattn_trie_free": (None, [c_void_p]),
    "forkattn_trie_layout": (c_int, [c_void_p, POINTER(TreeLayoutC)]),
    "forkattn_trie_num_rows": (c_int64, [c_void_p]),
    "forkattn_trie_replicated_tokens": (c_int64, [c_void_p]),
    "forkattn_trie_dedup_ratio": (c_double, [c_void_p]),
    "forkattn_trie_input_rows": (_I64P, [c_void_p]),
    "forkattn_trie_input_nodes": (_I64P, [c_void_p]),
    "forkattn_trie_row_nodes": (_I64P, [c_void_p]),
    "forkattn_trie_row_positions": (_I64P, [c_void_p]),
    "forkattn_trie_node_depths": (_I64P, [c_void_p]),
    "forkattn_trie_row_tokens": (_I64P, [c_void_p]),
    # kept sets, kept-set attention, StreamKL (optional: without them only these functions fail,
    # with FORKATTN_ERR_UNSUPPORTED)
    "forkattn_kept_fwd": (
        c_int,
        [c_void_p, POINTER(LayoutC), POINTER(KeptSetC), _T, _T, _T, _T, c_void_p, c_float, c_int],
    ),
    "forkattn_kept_bwd": (
        c_int,
        [c_void_p, POINTER(LayoutC), POINTER(KeptSetC), _T, _T, _T, _T, _T, c_void_p, _T, _T, _T,
         c_float, c_int],
    ),
    "forkattn_kl_options_init": (None, [POINTER(KlOptions)]),
    "forkattn_kl_fwd": (
        c_int,
        [c_void_p, POINTER(LayoutC), _T, _T, _T, _T, POINTER(KeptSetC), POINTER(KlOptions),
         c_void_p, c_void_p, c_void_p, c_int],
    ),
    "forkattn_kl_bwd": (
        c_int,
        [c_void_p, POINTER(LayoutC), _T, _T, _T, _T, POINTER(KeptSetC), POINTER(KlOptions),
         c_void_p, c_void_p, _T, _T, _T, _T, c_int],
    ),
    "forkattn_rows_mean": (
        c_int,
        [c_void_p, c_void_p, c_int64, c_int64, c_void_p, POINTER(c_double), c_int],
    ),
    "forkattn_kv_policy_init": (None, [POINTER(KvPolicy), c_int, c_int64]),
    "forkattn_kv_select": (
        c_int,
        [c_void_p, POINTER(KvPolicy), _T, _T, _I64P, _I64P, c_int],
    ),
    # DFS path stack (optional, like the above: only PathStack fails without them)
    "forkattn_path_create": (c_int, [c_void_p, c_int, c_int64, c_int64, c_int64, POINTER(c_void_p)]),
    "forkattn_path_destroy": (None, [c_void_p]),
    "forkattn_path_push": (c_int, [c_void_p, _T, _T]),
    "forkattn_path_attend_fwd": (c_int, [c_void_p, _T, _T, c_void_p, c_float]),
    "forkattn_path_attend_bwd": (c_int, [c_void_p, _T, _T, _T, c_void_p, _T, c_float]),
    "forkattn_path_pop": (c_int, [c_void_p, _T, _T]),
    "forkattn_path_depth": (c_int64, [c_void_p]),
    "forkattn_path_rows": (c_int64, [c_void_p]),
    "forkattn_path_peak_bytes": (c_size_t, [c_void_p]),
    # tree cost model, partition, batch plan (experimental, optional)
    "forkattn_tree_cost_model_calibrate": (
        c_int,
        [c_void_p, c_int64, c_int64, c_int64, c_int, POINTER(TreeCostModelC)],
    ),
    "forkattn_tree_cost": (
        c_int,
        [c_void_p, POINTER(TreeLayoutC), POINTER(TreeCostModelC), POINTER(c_double)],
    ),
    "forkattn_tree_partition": (
        c_int,
        [c_void_p, POINTER(TreeLayoutC), c_int64, POINTER(TreeCostModelC), POINTER(c_void_p)],
    ),
    "forkattn_partition_free": (None, [c_void_p]),
    "forkattn_partition_num_parts": (c_int64, [c_void_p]),
    "forkattn_partition_layout": (c_int, [c_void_p, c_int64, POINTER(TreeLayoutC)]),
    "forkattn_partition_rows": (_I64P, [c_void_p, c_int64, _I64P]),
    "forkattn_partition_owned": (POINTER(ctypes.c_ubyte), [c_void_p, c_int64]),
    "forkattn_partition_cost": (c_double, [c_void_p, c_int64]),
    "forkattn_partition_imbalance": (c_double, [c_void_p]),
    "forkattn_tree_plan_batches": (
        c_int,
        [c_void_p, POINTER(TreeLayoutC), c_int64, POINTER(TreeCostModelC), POINTER(c_void_p)],
    ),
    "forkattn_batch_plan_free": (None, [c_void_p]),
    "forkattn_batch_plan_count": (c_int64, [c_void_p]),
    "forkattn_batch_plan_layout": (c_int, [c_void_p, c_int64, POINTER(TreeLayoutC)]),
    "forkattn_batch_plan_rows": (_I64P, [c_void_p, c_int64, _I64P]),
    "forkattn_batch_plan_mode": (c_int, [c_void_p, c_int64]),
    "forkattn_batch_plan_reason": (c_char_p, [c_void_p, c_int64]),
    # shared-prefix KV cache for diffusion LMs (optional): cached-prefix attention, the cache,
    # K/V similarity, the reuse-depth profile (experimental). Tokens are int32 host arrays (c_void_p).
    "forkattn_prefix_cached_fwd": (
        c_int,
        [c_void_p, POINTER(PrefixLayout), _T, _T, _T, _T, c_void_p, c_float, c_int],
    ),
    "forkattn_prefix_cached_bwd": (
        c_int,
        [c_void_p, POINTER(PrefixLayout), _T, _T, _T, _T, _T, c_void_p, _T, _T, _T, c_float, c_int],
    ),
    "forkattn_prefix_cached_block_fwd": (
        c_int,
        [c_void_p, POINTER(PrefixLayout), c_int64, _T, _T, _T, _T, c_void_p, c_float, c_int],
    ),
    "forkattn_prefix_cached_block_bwd": (
        c_int,
        [c_void_p, POINTER(PrefixLayout), c_int64, _T, _T, _T, _T, _T, c_void_p, _T, _T, _T, c_float, c_int],
    ),
    "forkattn_kv_cache_create": (c_int, [c_void_p, POINTER(KvCacheOptions), POINTER(c_void_p)]),
    "forkattn_kv_cache_destroy": (None, [c_void_p]),
    "forkattn_kv_cache_insert": (c_int, [c_void_p, c_void_p, c_int64, _T, _T, c_int, POINTER(c_int)]),
    "forkattn_kv_cache_lookup": (c_int, [c_void_p, c_void_p, c_int64, POINTER(c_void_p), POINTER(c_int64)]),
    "forkattn_kv_entry_k": (c_int, [c_void_p, c_int64, _T]),
    "forkattn_kv_entry_v": (c_int, [c_void_p, c_int64, _T]),
    "forkattn_kv_cache_release": (None, [c_void_p, c_void_p]),
    "forkattn_kv_cache_get_stats": (c_int, [c_void_p, POINTER(KvCacheStats)]),
    "forkattn_kv_similarity": (c_int, [c_void_p, _T, _T, POINTER(c_float), POINTER(c_float), c_int]),
    "forkattn_reuse_profile_create": (c_int, [c_void_p, c_int64, c_float, POINTER(c_void_p)]),
    "forkattn_reuse_profile_free": (None, [c_void_p]),
    "forkattn_reuse_profile_add": (c_int, [c_void_p, c_void_p, c_double, POINTER(c_float)]),
    "forkattn_reuse_profile_depth": (c_int, [c_void_p, c_void_p, c_double, POINTER(c_int64)]),
    "forkattn_reuse_profile_save": (c_int, [c_void_p, c_void_p, c_char_p]),
    "forkattn_reuse_profile_load": (c_int, [c_void_p, c_char_p, POINTER(c_void_p)]),
}
_REQUIRED = (
    "forkattn_version_number",
    "forkattn_ctx_create",
    "forkattn_prefix_fwd",
    "forkattn_prefix_bwd",
    "forkattn_tree_fwd",
    "forkattn_tree_bwd",
)


# --------------------------------------------------------------------------------------------
# errors


class ForkattnError(RuntimeError):
    """A forkattn call failed. ``status`` is the C ``forkattn_status`` value, ``message`` the
    context's last-error text (or the reason a context could not be created)."""

    def __init__(self, status, message=""):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "unknown status")
        self.message = message or ""
        text = "forkattn: %s (status %d)" % (self.status_name, self.status)
        if self.message:
            text += ": " + self.message
        super().__init__(text)

    def __reduce__(self):  # picklable across processes (DataLoader workers, Ray)
        return (_make_error, (self.status, self.message))


class ForkattnInvalidArgument(ForkattnError, ValueError):
    """FORKATTN_ERR_INVALID_ARGUMENT: also a ValueError, so ``except ValueError`` catches the
    library's argument checks as well as the binding's own."""


def _make_error(status, message=""):
    if int(status) == ERR_INVALID_ARGUMENT:
        return ForkattnInvalidArgument(status, message)
    return ForkattnError(status, message)


# --------------------------------------------------------------------------------------------
# loading

_lib = None
_lib_path = None
_lib_lock = threading.Lock()


def _candidate_paths():
    """Where load_library() looks, in order (FORKATTN_LIBRARY is handled before these)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    # 1. next to the package: what `pip install <repository>` puts there (pyproject.toml)
    for pat in ("libforkattn.so", "libforkattn.so.*", "lib/libforkattn.so", "lib/libforkattn.so.*",
                "libforkattn.dylib", "forkattn.dll"):
        out.extend(sorted(glob.glob(os.path.join(here, pat))))
    # 2. the repository's build folders (source checkout or editable install: python/forkattn)
    repo = os.path.dirname(os.path.dirname(here))
    builds = ["build", "build-gpu"]
    if os.path.exists("/dev/nvidiactl"):
        builds.reverse()  # a GPU node: prefer the offload build (falls back if it cannot load)
    for b in builds:
        out.append(os.path.join(repo, b, "libforkattn.so"))
    return [p for p in out if os.path.isfile(p)]


def _bind(lib):
    for name, (res, args) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in _REQUIRED:
                raise OSError("%s lacks the symbol %s: not a forkattn library" % (lib._name, name))
            continue
        fn.restype = res
        fn.argtypes = args
    num = lib.forkattn_version_number()
    if num // 10000 != _ABI_MAJOR or num < _MIN_VERSION_NUMBER:
        raise OSError(
            "%s is forkattn %s; this binding needs %d.x >= %d.%d"
            % (lib._name, lib.forkattn_version_string().decode(), _ABI_MAJOR, _ABI_MAJOR,
               _MIN_VERSION_NUMBER // 100 % 100)
        )
    return lib


def load_library(path=None):
    """Load libforkattn (once per process) and return the ``ctypes.CDLL``.

    Search order: ``path`` if given; the ``FORKATTN_LIBRARY`` environment variable; a library
    next to this package (what ``pip install`` of the repository builds there); the repository's ``build/`` and
    ``build-gpu/`` folders (source checkouts; ``build-gpu`` first on a machine with
    ``/dev/nvidiactl``); ``ctypes.util.find_library("forkattn")`` and ``libforkattn.so.0``
    (installed by ``cmake --install``). A candidate that fails to load (e.g. an offload build
    without its LLVM runtime) is skipped; the error lists every attempt.

    Once a library is loaded, later calls return it; a different explicit ``path`` then raises
    ``RuntimeError`` (one library per process).
    """
    global _lib, _lib_path
    with _lib_lock:
        if _lib is not None:
            if path is not None and os.path.realpath(path) != os.path.realpath(_lib_path or ""):
                raise RuntimeError(
                    "forkattn: %s is already loaded; cannot switch to %s in the same process"
                    % (_lib_path, path)
                )
            return _lib
        tried = []
        if path is not None:
            cands = [("argument", path)]
        elif os.environ.get("FORKATTN_LIBRARY"):
            # An explicit choice: do not silently fall back to another library.
            cands = [("FORKATTN_LIBRARY", os.environ["FORKATTN_LIBRARY"])]
        else:
            cands = [("package/build", p) for p in _candidate_paths()]
            found = ctypes.util.find_library("forkattn")
            if found:
                cands.append(("find_library", found))
            cands.append(("system", "libforkattn.so.0"))
        for origin, cand in cands:
            try:
                lib = _bind(ctypes.CDLL(cand))
            except OSError as e:
                tried.append("%s (%s): %s" % (cand, origin, e))
                continue
            _lib, _lib_path = lib, getattr(lib, "_name", cand)
            return _lib
        raise OSError(
            "forkattn: could not load libforkattn. Install the package with its library (pip install "
            "<forkattn repository>: docs/python.md), or build it (cmake -S . -B build && cmake --build "
            "build) and set FORKATTN_LIBRARY=/path/to/libforkattn.so. Tried:\n  "
            + "\n  ".join(tried or ["(no candidate found)"])
        )


def library_path():
    """Path of the loaded library (loads it first)."""
    load_library()
    return _lib_path


def version():
    """Version string of the loaded C library, e.g. ``"0.2.0"``."""
    return load_library().forkattn_version_string().decode()


def build_has_offload():
    """True when the loaded library was built with GPU offload."""
    return bool(load_library().forkattn_build_has_offload())


def has_symbol(name):
    """True when the loaded library exports ``name`` (e.g. ``"forkattn_kv_select"``)."""
    return hasattr(load_library(), name)


def _fn(name):
    lib = load_library()
    try:
        return getattr(lib, name)
    except AttributeError:
        raise ForkattnError(3, "the loaded library (%s) has no %s" % (_lib_path, name)) from None


# --------------------------------------------------------------------------------------------
# contexts


class _Owned:
    """Lifetime of an object that owns a C handle: ``with`` closes it, and so does garbage
    collection (quietly: the interpreter may be shutting down). Subclasses define ``close()``;
    ``_close_on_gc()`` is what collection calls (``close()`` unless overridden)."""

    def _close_on_gc(self):
        self.close()

    def __del__(self):
        try:
            self._close_on_gc()
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _ContextBound(_Owned):
    """An owned C handle (``self._handle``, None once closed) tied to one :class:`Context`
    (``self._ctx``): ``handle`` refuses a closed object or a closed context."""

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("forkattn: this %s is closed" % type(self).__name__)
        self._ctx.handle  # raises if the context was closed under it
        return self._handle

    @property
    def context(self):
        return self._ctx


def _stream_handle(stream):
    """The CUDA stream handle of a ``torch.cuda.Stream`` or a handle (None and 0: the legacy default stream)."""
    return int(getattr(stream, "cuda_stream", stream) or 0)


class Context:
    """A forkattn context (``forkattn_ctx``): backend, device, CPU threads, last error.

    ``backend`` is ``"auto"`` (GPU when usable, else CPU), ``"cpu"`` or ``"gpu"``; with
    ``"auto"`` the ``FORKATTN_BACKEND`` environment variable may choose (C library rule). A context is not
    thread-safe: use one per thread. ``with ctx:`` makes it the current context of this thread
    for the calls inside the block (see :func:`use_context`).

    ``f32_precision`` says how a GPU context multiplies float32 inputs, after
    ``torch.set_float32_matmul_precision``: ``"high"`` (default; bf16 pieces on tensor cores, within
    float32 test tolerances), ``"highest"`` (float32 products on CUDA cores) or ``"medium"`` (two bf16
    pieces per value, faster, ~2^-16 relative per product). ``FORKATTN_F32_PRECISION`` overrides it; CPU
    contexts always multiply in float32.
    """

    def __init__(self, backend="auto", device=0, threads=0, bind_threads=False, verbose=False,
                 f32_precision="high"):
        if backend not in BACKENDS:
            raise ValueError("forkattn: backend must be one of %s, not %r" % (sorted(BACKENDS), backend))
        if f32_precision not in F32_PRECISIONS:
            raise ValueError(
                "forkattn: f32_precision must be one of %s, not %r" % (sorted(F32_PRECISIONS), f32_precision)
            )
        lib = load_library()
        self._lib = lib
        self._handle = None
        opt = CtxOptions()
        lib.forkattn_ctx_options_init(byref(opt))
        opt.backend = BACKENDS[backend]
        opt.device = int_arg(device, "device")
        opt.threads = int_arg(threads, "threads")
        opt.bind_threads = 1 if bind_threads else 0
        opt.verbose = 1 if verbose else 0
        opt.f32_precision = F32_PRECISIONS[f32_precision]
        h = c_void_p()
        st = lib.forkattn_ctx_create(byref(h), byref(opt))
        if st != OK:
            raise _make_error(st, (lib.forkattn_ctx_create_error() or b"").decode(errors="replace"))
        self._handle = h
        self.requested_backend = backend
        self.device = int(device)
        self._options = (backend, int(device), int(threads), bool(bind_threads), bool(verbose), f32_precision)
        self._owner = threading.get_ident()
        self._stream = None  # the CUDA stream handle the calls are ordered on (set_stream), or None
        self._no_stream = None  # why set_stream is refused here, once known (follow_stream)

    # -- properties
    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("forkattn: this Context is closed")
        return self._handle

    @property
    def backend(self):
        """The backend really used: ``"cpu"`` or ``"gpu"``."""
        return BACKEND_NAMES.get(self._lib.forkattn_ctx_backend(self.handle), "unknown")

    @property
    def backend_reason(self):
        return (self._lib.forkattn_ctx_backend_reason(self.handle) or b"").decode(errors="replace")

    @property
    def gpu_kernels(self):
        """The GPU kernel family of each pass ("" on a CPU context; ``FORKATTN_GPU_KERNELS``)."""
        return (self._lib.forkattn_ctx_gpu_kernels(self.handle) or b"").decode(errors="replace")

    @property
    def threads(self):
        return int(self._lib.forkattn_ctx_threads(self.handle))

    @property
    def last_error(self):
        return (self._lib.forkattn_ctx_last_error(self.handle) or b"").decode(errors="replace")

    @property
    def peak_workspace(self):
        """Largest scratch memory (bytes) one call of this context allocated so far."""
        return int(self._lib.forkattn_ctx_peak_workspace(self.handle))

    # -- CUDA streams (GPU contexts; C: forkattn_ctx_set_stream)
    @property
    def stream(self):
        """The CUDA stream handle (an int; 0 is the legacy default stream) this context's calls are
        ordered on, or None (synchronous calls, the default)."""
        return self._stream

    def set_stream(self, stream):
        """Order this context's calls on a CUDA stream: a handle (``torch.cuda.Stream.cuda_stream``,
        0 for the legacy default stream) or a ``torch.cuda.Stream``. Tensor-core attention calls on
        CUDA tensors are then queued on it and return at once; every other call waits for it first.
        Raises ForkattnError (UNSUPPORTED: this runtime cannot route launches; INVALID_ARGUMENT:
        not a stream of the device's primary context)."""
        handle = _stream_handle(stream)
        fn = getattr(self._lib, "forkattn_ctx_set_stream", None)
        if fn is None:
            raise _make_error(UNSUPPORTED, "forkattn: %s has no forkattn_ctx_set_stream" % self._lib._name)
        self.check(fn(self.handle, c_void_p(handle)))
        self._stream = handle

    def follow_stream(self, stream):
        """set_stream(stream) unless already on it; False (and nothing set) where this context or
        library cannot take a stream: the caller then synchronizes the stream itself."""
        handle = _stream_handle(stream)
        if self._stream == handle:
            return True
        if self._no_stream is not None:
            return False
        try:
            self.set_stream(handle)
            return True
        except ForkattnError as e:
            if e.status not in (UNSUPPORTED, BACKEND_UNAVAILABLE):
                raise
            self._no_stream = str(e)
            return False

    def synchronize(self):
        """Wait for everything queued on the context's stream (at once without one)."""
        fn = getattr(self._lib, "forkattn_ctx_synchronize", None)
        if fn is not None:
            self.check(fn(self.handle))

    def clear_stream(self):
        """Wait for the context's stream, then make its calls synchronous again."""
        fn = getattr(self._lib, "forkattn_ctx_clear_stream", None)
        self._stream = None
        if fn is not None:
            self.check(fn(self.handle))

    def check(self, status):
        """Raise the ForkattnError of a non-zero status, with this context's last error."""
        if status != OK:
            raise _make_error(status, self.last_error)

    # -- lifetime
    def close(self):
        if self._handle is not None and self._lib is not None:
            self._lib.forkattn_ctx_destroy(self._handle)
        self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self):
        _push_context(self)
        return self

    def __exit__(self, *exc):
        _pop_context(self)
        return False

    def __repr__(self):
        if self._handle is None:
            return "<forkattn.Context closed>"
        return "<forkattn.Context backend=%s device=%d threads=%d>" % (self.backend, self.device,
                                                                       self.threads)


# Process-wide defaults for lazily created per-thread contexts, and a generation counter so
# that configure() invalidates every thread's cache.
_defaults = {"backend": "auto", "threads": 0, "bind_threads": False, "f32_precision": "high"}
_generation = [0]
_tls = threading.local()


def configure(backend=None, threads=None, bind_threads=None, f32_precision=None):
    """Set the options of the default contexts that every thread creates lazily (host tensors:
    ``backend``; CUDA tensors always get a ``"gpu"`` context on the tensor's device;
    ``f32_precision`` as :class:`Context`'s). Contexts already created are replaced at their thread's
    next call. Returns the previous settings."""
    prev = dict(_defaults)
    if f32_precision is not None:
        if f32_precision not in F32_PRECISIONS:
            raise ValueError(
                "forkattn: f32_precision must be one of %s, not %r" % (sorted(F32_PRECISIONS), f32_precision)
            )
        _defaults["f32_precision"] = f32_precision
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError("forkattn: backend must be one of %s, not %r" % (sorted(BACKENDS), backend))
        _defaults["backend"] = backend
    if threads is not None:
        _defaults["threads"] = int(threads)
    if bind_threads is not None:
        _defaults["bind_threads"] = bool(bind_threads)
    _generation[0] += 1
    return prev


def _thread_cache():
    cache = getattr(_tls, "contexts", None)
    if cache is None or getattr(_tls, "generation", None) != _generation[0]:
        cache = {}
        _tls.contexts = cache
        _tls.generation = _generation[0]
    return cache


def default_context(cuda_device=None):
    """This thread's default context: for host memory (``cuda_device=None``), or a GPU context
    on CUDA device ``cuda_device``. Created on first use."""
    cache = _thread_cache()
    key = ("host",) if cuda_device is None else ("cuda", int(cuda_device))
    ctx = cache.get(key)
    if ctx is None:
        if cuda_device is None:
            ctx = Context(_defaults["backend"], 0, _defaults["threads"], _defaults["bind_threads"],
                          f32_precision=_defaults["f32_precision"])
        else:
            try:
                ctx = Context("gpu", int(cuda_device), _defaults["threads"], f32_precision=_defaults["f32_precision"])
            except ForkattnError as e:
                raise ForkattnError(
                    e.status,
                    "CUDA tensors need a GPU context on device %d and it could not be created (%s). "
                    "Install an offload build (pip install . -C cmake.define.FORKATTN_OFFLOAD=nvptx:sm_90a "
                    "..., docs/python.md), load one (FORKATTN_LIBRARY=.../build-gpu/libforkattn.so) or "
                    "move the tensors to the CPU. Loaded: %s (offload: %s)"
                    % (int(cuda_device), e.message, _lib_path, bool(_lib.forkattn_build_has_offload())),
                ) from None
        cache[key] = ctx
    return ctx


def _push_context(ctx):
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(ctx)


def _pop_context(ctx):
    stack = getattr(_tls, "stack", None)
    if stack and stack[-1] is ctx:
        stack.pop()


class use_context:
    """``with forkattn.use_context(ctx): ...``: calls on this thread inside the block use ``ctx``.

    A backward of a call made inside the block uses a context of the same options, also when
    autograd runs it on another thread (CUDA tensors), outside torch.compile; a compiled
    backward uses its thread's default context (set defaults process-wide with :func:`configure`)."""

    def __init__(self, ctx):
        if not isinstance(ctx, Context):
            raise TypeError("forkattn.use_context expects a forkattn.Context")
        self.ctx = ctx

    def __enter__(self):
        _push_context(self.ctx)
        return self.ctx

    def __exit__(self, *exc):
        _pop_context(self.ctx)
        return False


def forward_context():
    """What a forward records for its backward: the innermost :func:`use_context` context of this
    thread, or None (the thread's defaults)."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


class backward_context:
    """``with backward_context(c):`` (``c`` from :func:`forward_context` at the forward): the
    backward's calls use what the forward used. On ``c``'s own thread that is ``c``; on another
    thread (autograd runs a CUDA backward on its own) a context of ``c``'s options kept for that
    thread, since a context serves one thread at a time; None: the thread's defaults."""

    def __init__(self, ctx):
        self.fwd, self.ctx = ctx, None

    def __enter__(self):
        c = self.fwd
        if c is None:
            return None
        if c._owner != threading.get_ident() or c._handle is None:
            cache = _thread_cache()
            key = ("like",) + c._options
            like = cache.get(key)
            if like is None or like._handle is None:
                like = cache[key] = Context(*c._options)
            c = like
        self.ctx = c
        _push_context(c)
        return c

    def __exit__(self, *exc):
        if self.ctx is not None:
            _pop_context(self.ctx)
        return False


def current_context(cuda_device=None):
    """The context a call on this thread uses: the innermost :func:`use_context` one, else the
    thread's default context for host memory or for CUDA device ``cuda_device``."""
    stack = getattr(_tls, "stack", None)
    if stack:
        ctx = stack[-1]
        if cuda_device is not None and (ctx.backend != "gpu" or ctx.device != int(cuda_device)):
            raise ValueError(
                "forkattn: the current context (%r) cannot take CUDA tensors of device %d: they "
                "need a gpu context on that device" % (ctx, int(cuda_device))
            )
        return ctx
    return default_context(cuda_device)


def backend(cuda_device=None):
    """Name of the backend (``"cpu"`` or ``"gpu"``) the current context of this thread uses."""
    return current_context(cuda_device).backend


# --------------------------------------------------------------------------------------------
# tensor descriptors


def make_tensor(ptr, dtype_code, rows, heads, head_dim, row_stride, head_stride):
    """A ``Tensor`` descriptor for a [rows, heads, head_dim] view with unit stride on head_dim,
    or ``None`` when the strides are not in a family the C library accepts (row-major or
    head-major, no overlap): the caller then passes a contiguous copy.

    Strides of size-1 (and empty) axes carry no information and are normalized."""
    rows, heads, d = int(rows), int(heads), int(head_dim)
    rs, hs = int(row_stride), int(head_stride)
    if rows == 0 or heads == 0 or d == 0:
        rs, hs = heads * d, d
    else:
        if heads == 1:  # head stride unused: pick one that makes the view row-major
            hs = d
        if rows == 1:  # row stride unused
            rs = (heads - 1) * hs + d
        if rs <= 0 or hs <= 0:
            return None
        row_major = hs >= d and rs >= (heads - 1) * hs + d
        head_major = rs >= d and hs >= (rows - 1) * rs + d
        if not (row_major or head_major):
            return None
    return Tensor(c_void_p(int(ptr) or None), int(dtype_code), rows, heads, d, rs, hs)


def row_slice(t, start, n):
    """Descriptor of rows [start, start + n) of ``t``. Raises ForkattnInvalidArgument when the
    slice does not lie within ``t``'s rows: the C library trusts a descriptor's row count, so
    a slice past the end would make it read and write outside the array."""
    start, n = int(start), int(n)
    if start < 0 or n < 0 or start + n > t.rows:
        raise _invalid("rows [%d, %d) of a tensor with %d rows: the layout needs more rows than the "
                       "tensors have" % (start, start + n, t.rows))
    off = start * t.row_stride * DTYPE_ITEMSIZE[t.dtype]
    base = t.data or 0
    return Tensor(c_void_p(base + off if base else None), t.dtype, n, t.heads, t.head_dim,
                  t.row_stride, t.head_stride)


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1


def int64_arg(x, name):
    """``int(x)``, refused (ForkattnInvalidArgument) outside int64: ctypes silently keeps the
    low 64 bits of a larger Python int, so 2**64 + 6 would reach the library as 6."""
    i = int(x)
    if not INT64_MIN <= i <= INT64_MAX:
        raise _invalid("%s = %d does not fit in int64" % (name, i))
    return i


def int_arg(x, name):
    """``int(x)`` checked against the range of a C int (the library's int parameters)."""
    i = int(x)
    if not INT_MIN <= i <= INT_MAX:
        raise _invalid("%s = %d does not fit in a C int" % (name, i))
    return i


def _i64_array(values, name="array"):
    """(ctypes int64 array, length) of int values, each checked to fit in int64."""
    values = [int64_arg(x, "%s[%d]" % (name, i)) for i, x in enumerate(values)]
    return (c_int64 * max(1, len(values)))(*values), len(values)


def check_rows(total, tensors, what="the layout"):
    """Refuse (ForkattnInvalidArgument) when a tensor's rows differ from ``total``, the rows
    ``what`` packs; run before a call that slices the tensors by the layout's rows."""
    for t in tensors:
        if t is not None and int(t.rows) != int(total):
            raise _invalid("a tensor has %d rows, %s needs %d" % (int(t.rows), what, int(total)))


def _ptr_add(p, nbytes):
    return None if not p else int(p) + int(nbytes)


# --------------------------------------------------------------------------------------------
# attention calls (array-library neutral). Layout arguments are Python int lists; lse is a
# pointer to float32 [rows, heads_q] row-major.

# How several causal shared-prompt groups run: "tree" = one forkattn_tree_fwd/bwd call over the
# forest (root = prompt, children = responses); "loop" = one forkattn_prefix_* call per group
# on row slices. Both are exact; "tree" is one launch. Bidirectional groups always loop.
MULTI_GROUP_CAUSAL = "tree"


def _forest(prompt_lens, group_sizes, response_lens):
    offsets, parents = [0], []
    r = 0
    for P, n in zip(prompt_lens, group_sizes):
        root = len(parents)
        parents.append(-1)
        offsets.append(offsets[-1] + P)
        for _ in range(n):
            parents.append(root)
            offsets.append(offsets[-1] + response_lens[r])
            r += 1
    return offsets, parents


def _groups(prompt_lens, group_sizes, response_lens):
    """Yield (row_start, prompt_len, [response lens]) per group."""
    row, r = 0, 0
    for P, n in zip(prompt_lens, group_sizes):
        lens = response_lens[r:r + n]
        yield row, P, lens
        row += P + sum(lens)
        r += n


def _check_layout_lists(prompt_lens, group_sizes, response_lens):
    """Group counts agree, lengths are >= 0 and fit in int64, and so do the packed rows."""
    if len(prompt_lens) != len(group_sizes):
        raise _invalid("prompt_lens has %d groups, group_sizes %d" % (len(prompt_lens), len(group_sizes)))
    if sum(group_sizes) != len(response_lens):
        raise _invalid("group_sizes sum to %d responses, response_lens has %d"
                       % (sum(group_sizes), len(response_lens)))
    for name, seq in (("prompt_lens", prompt_lens), ("group_sizes", group_sizes),
                      ("response_lens", response_lens)):
        for i, x in enumerate(seq):
            if x < 0:
                raise _invalid("%s[%d] = %d is negative" % (name, i, x))
            int64_arg(x, "%s[%d]" % (name, i))
    int64_arg(sum(prompt_lens) + sum(response_lens), "the layout's total rows")
    return sum(prompt_lens) + sum(response_lens)


def _scale(scale):
    return c_float(float(scale))


def softmax_scale(head_dim, scale=None):
    """``scale`` as a float, or 1/sqrt(head_dim) when None; a head_dim < 1 is refused here
    (ForkattnInvalidArgument) rather than failing as a division by zero."""
    if scale is not None:
        return float(scale)
    d = int(head_dim)
    if d < 1:
        raise _invalid("head_dim = %d: must be >= 1" % d)
    return 1.0 / math.sqrt(d)


def _attn_args(tensors, lse_ptr):
    """The tensor arguments of a forward (q, k, v, o) or backward (q, k, v, o, do, dq, dk, dv)
    call, by reference, with the lse pointer after the inputs as the C functions take them."""
    n_in = 4 if len(tensors) == 4 else 5
    refs = [byref(t) for t in tensors]
    return refs[:n_in] + [lse_ptr] + refs[n_in:]


class _LayoutCache:
    """Marshalled C layouts by their Python-int key: every layer of a step, forward and backward,
    calls with the same layout, so its ctypes structs are built (and checked) once. Holds at most
    ``limit`` layouts; emptied when full (a trainer's step uses a handful)."""

    def __init__(self, limit=64):
        self.limit, self.items, self.lock = limit, {}, threading.Lock()

    def get(self, key, build):
        hit = self.items.get(key)
        if hit is None:
            hit = build()
            with self.lock:
                if len(self.items) >= self.limit:
                    self.items.clear()
                self.items[key] = hit
        return hit


_prefix_layouts = _LayoutCache()
_varlen_layouts = _LayoutCache()


def _prefix_plan(prompt_lens, group_sizes, response_lens, causal):
    """(rows, calls) of a multi-group shared-prompt layout: calls is one ("tree", struct, keep)
    over the forest, or per non-empty group ("prefix", row, rows, struct, keep)."""
    total = _check_layout_lists(prompt_lens, group_sizes, response_lens)
    G = len(prompt_lens)
    if G == 0:
        return total, ()
    if causal and G > 1 and MULTI_GROUP_CAUSAL == "tree":
        lay, keep = _tree_struct(*_forest(prompt_lens, group_sizes, response_lens))
        return total, (("tree", lay, keep),)
    mask = MASK_CAUSAL if causal else MASK_BIDIRECTIONAL
    calls = []
    for row, P, lens in _groups(prompt_lens, group_sizes, response_lens):
        n = P + sum(lens)
        if G > 1 and n == 0:
            continue
        arr, _ = _i64_array([0] + _cumsum(lens), "response offsets")
        calls.append(("prefix", row, n, PrefixLayout(P, len(lens), arr, mask), arr))
    return total, tuple(calls)


def _prefix_call(ctx, direction, prompt_lens, group_sizes, response_lens, causal, tensors,
                 lse_ptr, scale, memory):
    """forkattn_prefix_fwd or _bwd (``direction``) over several groups packed back to back."""
    key = (tuple(prompt_lens), tuple(group_sizes), tuple(response_lens), bool(causal), MULTI_GROUP_CAUSAL)
    total, calls = _prefix_layouts.get(key, lambda: _prefix_plan(prompt_lens, group_sizes, response_lens, causal))
    # Before any call: several bidirectional groups run on row slices, which only row_slice's
    # bound protects; every tensor must have exactly the layout's rows.
    check_rows(total, tensors)
    for c in calls:
        if c[0] == "tree":
            ctx.check(_fn("forkattn_tree_" + direction)(ctx.handle, byref(c[1]), *_attn_args(tensors, lse_ptr),
                                                       _scale(scale), memory))
            continue
        _, row, n, lay, _ = c
        if len(calls) == 1 and row == 0 and n == total:
            ts, lp = tensors, lse_ptr
        else:
            ts = tuple(row_slice(t, row, n) for t in tensors)
            lp = _ptr_add(lse_ptr, row * tensors[0].heads * 4)
        ctx.check(_fn("forkattn_prefix_" + direction)(ctx.handle, byref(lay), *_attn_args(ts, lp),
                                                      _scale(scale), memory))


def prefix_fwd(ctx, prompt_lens, group_sizes, response_lens, causal, q, k, v, o, lse_ptr, scale,
               memory):
    """Shared-prompt forward over several groups packed back to back."""
    _prefix_call(ctx, "fwd", prompt_lens, group_sizes, response_lens, causal, (q, k, v, o),
                 lse_ptr, scale, memory)


def prefix_bwd(ctx, prompt_lens, group_sizes, response_lens, causal, q, k, v, o, do, lse_ptr, dq,
               dk, dv, scale, memory):
    _prefix_call(ctx, "bwd", prompt_lens, group_sizes, response_lens, causal,
                 (q, k, v, o, do, dq, dk, dv), lse_ptr, scale, memory)


def _varlen_plan(cu_seqlens, causal):
    n = len(cu_seqlens) - 1
    if n < 0:
        raise ValueError("forkattn: cu_seqlens must have at least one entry (0)")
    arr, _ = _i64_array(cu_seqlens, "cu_seqlens")
    return PrefixLayout(0, n, arr, MASK_CAUSAL if causal else MASK_BIDIRECTIONAL), arr


def _varlen_call(ctx, direction, cu_seqlens, causal, tensors, lse_ptr, scale, memory):
    """Plain variable-length attention: one prefix call with prompt_len 0."""
    lay, _ = _varlen_layouts.get((tuple(cu_seqlens), bool(causal)), lambda: _varlen_plan(cu_seqlens, causal))
    st = _fn("forkattn_prefix_" + direction)(ctx.handle, byref(lay), *_attn_args(tensors, lse_ptr),
                                             _scale(scale), memory)
    ctx.check(st)


def varlen_fwd(ctx, cu_seqlens, causal, q, k, v, o, lse_ptr, scale, memory):
    _varlen_call(ctx, "fwd", cu_seqlens, causal, (q, k, v, o), lse_ptr, scale, memory)


def varlen_bwd(ctx, cu_seqlens, causal, q, k, v, o, do, lse_ptr, dq, dk, dv, scale, memory):
    _varlen_call(ctx, "bwd", cu_seqlens, causal, (q, k, v, o, do, dq, dk, dv), lse_ptr, scale,
                 memory)


def _tree_struct(node_offsets, parents):
    """node_offsets/parents: int lists, or (pointer, n) pairs of host int64 arrays."""
    if isinstance(node_offsets, tuple):
        (op, n1), (pp, n) = node_offsets, parents
        if n1 != n + 1:
            raise ValueError("forkattn: node_offsets has %d entries, parents %d (need n+1 and n)"
                             % (n1, n))
        keep = ()
        return TreeLayoutC(n, ctypes.cast(c_void_p(op), _I64P) if n else None,
                           ctypes.cast(c_void_p(pp), _I64P) if n else None), keep
    if len(node_offsets) != len(parents) + 1:
        raise ValueError("forkattn: node_offsets has %d entries, parents %d (need n+1 and n)"
                         % (len(node_offsets), len(parents)))
    oa, _ = _i64_array(node_offsets, "node_offsets")
    pa, n = _i64_array(parents, "parents")
    return TreeLayoutC(n, oa if n else None, pa if n else None), (oa, pa)


def _tree_call(ctx, direction, node_offsets, parents, tensors, lse_ptr, scale, memory):
    lay, keep = _tree_struct(node_offsets, parents)
    st = _fn("forkattn_tree_" + direction)(ctx.handle, byref(lay), *_attn_args(tensors, lse_ptr),
                                           _scale(scale), memory)
    del keep
    ctx.check(st)


def tree_fwd(ctx, node_offsets, parents, q, k, v, o, lse_ptr, scale, memory):
    _tree_call(ctx, "fwd", node_offsets, parents, (q, k, v, o), lse_ptr, scale, memory)


def tree_bwd(ctx, node_offsets, parents, q, k, v, o, do, lse_ptr, dq, dk, dv, scale, memory):
    _tree_call(ctx, "bwd", node_offsets, parents, (q, k, v, o, do, dq, dk, dv), lse_ptr, scale,
               memory)


def _cumsum(xs):
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


# --------------------------------------------------------------------------------------------
# tries


def _copy_i64(ptr, n):
    """Copy n int64 from a C pointer into a fresh ctypes array (None for a NULL pointer)."""
    if not ptr or n <= 0:
        return None if not ptr else (c_int64 * 0)()
    buf = (c_int64 * n)()
    ctypes.memmove(buf, ptr, n * 8)
    return buf


def _trie_extract(ctx, trie, num_input_tokens, num_input_nodes=None):
    lib = load_library()
    try:
        lay = TreeLayoutC()
        ctx.check(lib.forkattn_trie_layout(trie, byref(lay)))
        n = int(lay.num_nodes)
        T = int(lib.forkattn_trie_num_rows(trie))
        out = {
            "node_offsets": _copy_i64(lay.node_offsets, n + 1),
            "parents": _copy_i64(lay.parents, n),
            "num_nodes": n,
            "num_rows": T,
            "replicated_tokens": int(lib.forkattn_trie_replicated_tokens(trie)),
            "dedup_ratio": float(lib.forkattn_trie_dedup_ratio(trie)),
            "input_rows": _copy_i64(lib.forkattn_trie_input_rows(trie), num_input_tokens),
            "row_nodes": _copy_i64(lib.forkattn_trie_row_nodes(trie), T),
            "row_positions": _copy_i64(lib.forkattn_trie_row_positions(trie), T),
            "node_depths": _copy_i64(lib.forkattn_trie_node_depths(trie), n),
            "row_tokens": _copy_i64(lib.forkattn_trie_row_tokens(trie), T),
            "input_nodes": (_copy_i64(lib.forkattn_trie_input_nodes(trie), num_input_nodes)
                            if num_input_nodes else None),
        }
    finally:
        lib.forkattn_trie_free(trie)
    return out


def trie_from_sequences(ctx, seq_offsets_ptr, tokens_ptr, num_sequences, num_tokens,
                        single_root=False):
    """Build the trie of sequences (CSR host int64 arrays given by address) and return its maps
    as ctypes int64 arrays (see _trie_extract)."""
    trie = c_void_p()
    st = _fn("forkattn_trie_from_sequences")(
        ctx.handle, int64_arg(num_sequences, "num_sequences"), ctypes.cast(c_void_p(seq_offsets_ptr), _I64P),
        ctypes.cast(c_void_p(tokens_ptr), _I64P), TRIE_SINGLE_ROOT if single_root else 0,
        byref(trie))
    ctx.check(st)
    return _trie_extract(ctx, trie, num_tokens)


def trie_from_parents(ctx, parents_ptr, lengths_ptr, num_nodes, num_tokens, single_root=False):
    trie = c_void_p()
    st = _fn("forkattn_trie_from_parents")(
        ctx.handle, int64_arg(num_nodes, "num_nodes"), ctypes.cast(c_void_p(parents_ptr), _I64P),
        ctypes.cast(c_void_p(lengths_ptr), _I64P), TRIE_SINGLE_ROOT if single_root else 0,
        byref(trie))
    ctx.check(st)
    return _trie_extract(ctx, trie, num_tokens, num_nodes)


def trie_from_token_parents(ctx, token_parents_ptr, num_tokens, single_root=False):
    trie = c_void_p()
    st = _fn("forkattn_trie_from_token_parents")(
        ctx.handle, int64_arg(num_tokens, "num_tokens"), ctypes.cast(c_void_p(token_parents_ptr), _I64P),
        TRIE_SINGLE_ROOT if single_root else 0, byref(trie))
    ctx.check(st)
    return _trie_extract(ctx, trie, num_tokens)


# --------------------------------------------------------------------------------------------
# layouts, kept sets, kept-set attention, StreamKL, KV selection (array-library neutral).
#
# A layout spec is ("prefix", prompt_lens, group_sizes, response_lens) (int lists; causal
# groups packed back to back: one group is a forkattn_prefix_layout, several the forest
# forkattn_tree_layout of _forest) or ("tree", node_offsets, parents) (int lists or
# (pointer, n) pairs of host int64 arrays, as for tree_fwd). A kept set is None or the dict of
# make_kept(). Output arrays (kl, stats, outside, lse) are pointers to float32 row-major arrays
# in the call's memory.


def _invalid(msg):
    return ForkattnInvalidArgument(ERR_INVALID_ARGUMENT, msg)


def dtype_code(dtype):
    """C dtype code of "float32"/"bfloat16"/"float16" (f32, bf16, f16, half), a torch dtype or a
    numpy dtype (ml_dtypes.bfloat16 included)."""
    torch = sys.modules.get("torch")
    if isinstance(dtype, str):
        name = dtype.lower()
    elif torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except Exception:
            name = str(dtype)
    if name not in DTYPE_CODES:
        raise _invalid("dtype %r is not supported (float32, bfloat16, float16)" % (dtype,))
    return DTYPE_CODES[name]


def layout_struct(spec):
    """(forkattn_layout, objects to keep alive) of a layout spec (see above)."""
    kind = spec[0]
    if kind == "prefix":
        _, P, S, R = spec
        _check_layout_lists(P, S, R)
        if len(P) > 1:
            offs, parents = _forest(P, S, R)
            tl, keep = _tree_struct(offs, parents)
            return LayoutC(None, ctypes.pointer(tl)), (tl, keep)
        if P:
            arr, _ = _i64_array([0] + _cumsum(R), "response offsets")
            pl = PrefixLayout(P[0], len(R), arr, MASK_CAUSAL)
        else:  # no group: zero rows
            arr = None
            pl = PrefixLayout(0, 0, None, MASK_CAUSAL)
        return LayoutC(ctypes.pointer(pl), None), (pl, arr)
    if kind == "tree":
        _, offs, parents = spec
        tl, keep = _tree_struct(offs, parents)
        return LayoutC(None, ctypes.pointer(tl)), (tl, keep)
    raise ValueError("forkattn: unknown layout kind %r" % (kind,))


def kept_blocks(rows):
    """Blocks per side of a kept set's block mask for a layout of ``rows`` packed rows."""
    return (int(rows) + KEPT_BLOCK - 1) // KEPT_BLOCK


def make_kept(heads, compressed_rows, query_start, offsets, index, block_mask, rows):
    """Check a kept set's array sizes for a layout of ``rows`` packed rows (what the C library
    cannot check: it trusts the lengths) and return the dict kept_struct() takes.

    offsets: int list [heads+1] or None; index: (host pointer, n) int64 or None; block_mask:
    (host pointer, n) uint8 or None. Raises ForkattnInvalidArgument."""
    heads, compressed_rows = int64_arg(heads, "kept: heads"), int64_arg(compressed_rows, "kept: compressed_rows")
    query_start = int64_arg(query_start, "kept: query_start")
    if (offsets is None) != (index is None):
        raise _invalid("kept: offsets and index must both be given or both be None")
    if heads >= 1:
        if offsets is not None:
            offsets = [int64_arg(x, "kept: offsets[%d]" % i) for i, x in enumerate(offsets)]
            if len(offsets) != heads + 1:
                raise _invalid("kept: offsets has %d entries, need heads + 1 = %d" % (len(offsets), heads + 1))
            if offsets[0] != 0:
                raise _invalid("kept: offsets[0] is %d, must be 0" % offsets[0])
            for h in range(heads):
                if offsets[h + 1] < offsets[h]:
                    raise _invalid("kept: offsets not monotonic at head %d (%d > %d)"
                                   % (h, offsets[h], offsets[h + 1]))
            if offsets[-1] != int(index[1]):
                raise _invalid("kept: offsets[-1] = %d but index has %d entries" % (offsets[-1], int(index[1])))
        if block_mask is not None:
            nb = kept_blocks(rows)
            if int(block_mask[1]) != heads * nb * nb:
                raise _invalid("kept: block_mask has %d entries, need heads * nb * nb = %d * %d * %d for %d "
                               "rows (blocks of %d)" % (int(block_mask[1]), heads, nb, nb, int(rows), KEPT_BLOCK))
    return {"heads": heads, "compressed_rows": compressed_rows, "query_start": query_start,
            "offsets": offsets, "index": index, "block_mask": block_mask}


def kept_struct(kept):
    """(pointer to forkattn_kept_set or None, objects to keep alive) of a make_kept() dict."""
    if kept is None:
        return None, ()
    offs_arr = None
    if kept["offsets"] is not None:
        offs_arr, _ = _i64_array(kept["offsets"])
    idx = None
    if kept["index"] is not None:
        idx = ctypes.cast(c_void_p(int(kept["index"][0]) or None), _I64P) if int(kept["index"][1]) else \
            (c_int64 * 1)()
    bm = None
    if kept["block_mask"] is not None:
        bm = ctypes.cast(c_void_p(int(kept["block_mask"][0]) or None), POINTER(ctypes.c_ubyte))
    ks = KeptSetC(kept["heads"], kept["compressed_rows"], kept["query_start"],
                  ctypes.cast(offs_arr, _I64P) if offs_arr is not None else None, idx, bm)
    return ctypes.pointer(ks), (ks, offs_arr, idx, bm)


def kl_options(direction, scale_teacher, scale_student, temperature, scale_by_tau2):
    """A ``forkattn_kl_options``; scales of 0 (or None) mean 1/sqrt(head_dim) of that side."""
    opt = KlOptions()
    init = getattr(load_library(), "forkattn_kl_options_init", None)
    if init is not None:
        init(byref(opt))
    if isinstance(direction, str):
        if direction not in KL_DIRECTIONS:
            raise ValueError("forkattn: direction must be 'forward' (KL(T||S)) or 'reverse' (KL(S||T)), "
                             "not %r" % direction)
        direction = KL_DIRECTIONS[direction]
    opt.direction = int_arg(direction, "direction")
    opt.scale_teacher = float(scale_teacher or 0.0)
    opt.scale_student = float(scale_student or 0.0)
    opt.temperature = float(temperature)
    opt.scale_by_tau2 = 1 if scale_by_tau2 else 0
    return opt


def _kept_call(ctx, direction, spec, kept, tensors, lse_ptr, scale, memory):
    lay, keep = layout_struct(spec)
    kp, keep2 = kept_struct(kept)
    st = _fn("forkattn_kept_" + direction)(ctx.handle, byref(lay), kp, *_attn_args(tensors, lse_ptr),
                                           _scale(scale), memory)
    del keep, keep2
    ctx.check(st)


def kept_fwd(ctx, spec, kept, q, k, v, o, lse_ptr, scale, memory):
    _kept_call(ctx, "fwd", spec, kept, (q, k, v, o), lse_ptr, scale, memory)


def kept_bwd(ctx, spec, kept, q, k, v, o, do, lse_ptr, dq, dk, dv, scale, memory):
    _kept_call(ctx, "bwd", spec, kept, (q, k, v, o, do, dq, dk, dv), lse_ptr, scale, memory)


def kl_fwd(ctx, spec, q_t, k_t, q_s, k_s, kept, opt, kl_ptr, stats_ptr, outside_ptr, memory):
    """StreamKL forward: kl [T, H], stats [T, H, KL_STATS] (or None), outside mass [T, H] (or
    None), float32 pointers in ``memory``."""
    lay, keep = layout_struct(spec)
    kp, keep2 = kept_struct(kept)
    st = _fn("forkattn_kl_fwd")(ctx.handle, byref(lay), byref(q_t), byref(k_t), byref(q_s), byref(k_s), kp,
                                byref(opt), kl_ptr, stats_ptr, outside_ptr, memory)
    del keep, keep2
    ctx.check(st)


def kl_bwd(ctx, spec, q_t, k_t, q_s, k_s, kept, opt, stats_ptr, dkl_ptr, dq_s, dk_s, dq_t, dk_t, memory):
    """StreamKL backward; dq_t/dk_t both None to skip the teacher's gradients."""
    lay, keep = layout_struct(spec)
    kp, keep2 = kept_struct(kept)
    st = _fn("forkattn_kl_bwd")(ctx.handle, byref(lay), byref(q_t), byref(k_t), byref(q_s), byref(k_s), kp,
                                byref(opt), stats_ptr, dkl_ptr, byref(dq_s), byref(dk_s),
                                byref(dq_t) if dq_t is not None else None,
                                byref(dk_t) if dk_t is not None else None, memory)
    del keep, keep2
    ctx.check(st)


def rows_mean(ctx, x_ptr, rows, heads, weights_ptr, memory):
    """Weighted mean over rows of a float32 [rows, heads] array (double accumulation)."""
    out = c_double()
    st = _fn("forkattn_rows_mean")(ctx.handle, x_ptr, int64_arg(rows, "rows"), int64_arg(heads, "heads"), weights_ptr,
                                   byref(out), memory)
    ctx.check(st)
    return float(out.value)


def kv_policy(kind, budget, sinks=None, window=None, pool_kernel=None, scale=None):
    """A ``forkattn_kv_policy``: forkattn_kv_policy_init()'s defaults for the kind and budget,
    then the fields given. ``kind``: "streaming_llm", "h2o", "snapkv" (or the C value)."""
    if isinstance(kind, str):
        key = kind.lower().replace("-", "_")
        if key not in KV_POLICIES:
            raise ValueError("forkattn: policy must be one of %s, not %r" % (sorted(KV_POLICIES), kind))
        kind = KV_POLICIES[key]
    p = KvPolicy()
    _fn("forkattn_kv_policy_init")(byref(p), int_arg(kind, "policy"), int64_arg(budget, "budget"))
    if sinks is not None:
        p.sinks = int64_arg(sinks, "sinks")
    if window is not None:
        p.window = int64_arg(window, "window")
    if pool_kernel is not None:
        p.pool_kernel = int64_arg(pool_kernel, "pool_kernel")
    if scale is not None:
        p.scale = float(scale)
    return p


def kv_select(ctx, policy, q, k, memory):
    """Kept keys of one causal sequence: (offsets [Hkv+1], index [Hkv * min(budget, L)]) as
    ctypes int64 arrays."""
    hkv = int(k.heads)
    n = min(int(policy.budget), int(q.rows)) if policy.budget > 0 else 0
    offs = (c_int64 * (hkv + 1 if hkv > 0 else 1))()
    idx = (c_int64 * max(1, hkv * n if hkv > 0 else 0))()
    st = _fn("forkattn_kv_select")(ctx.handle, byref(policy), byref(q), byref(k), offs, idx, memory)
    ctx.check(st)
    return offs, idx, hkv * n


# --------------------------------------------------------------------------------------------
# DFS path stack (host memory). ``path`` is the forkattn_path handle (a c_void_p) that
# forkattn.tree_exec.PathStack owns; its errors are reported through its context.


def path_create(ctx, dtype_code, heads_q, heads_kv, head_dim):
    """A new ``forkattn_path`` on ``ctx`` (the caller frees it with path_destroy)."""
    h = c_void_p()
    st = _fn("forkattn_path_create")(ctx.handle, int_arg(dtype_code, "dtype"), int64_arg(heads_q, "heads_q"),
                                     int64_arg(heads_kv, "heads_kv"), int64_arg(head_dim, "head_dim"), byref(h))
    ctx.check(st)
    return h


def path_destroy(path):
    if path:
        _fn("forkattn_path_destroy")(path)


def path_push(ctx, path, k, v):
    ctx.check(_fn("forkattn_path_push")(path, byref(k), byref(v)))


def path_attend_fwd(ctx, path, q, o, lse_ptr, scale):
    ctx.check(_fn("forkattn_path_attend_fwd")(path, byref(q), byref(o), lse_ptr, _scale(scale)))


def path_attend_bwd(ctx, path, q, o, do, lse_ptr, dq, scale):
    ctx.check(_fn("forkattn_path_attend_bwd")(path, byref(q), byref(o), byref(do), lse_ptr, byref(dq),
                                              _scale(scale)))


def path_pop(ctx, path, dk, dv):
    """Pop the top node; dk/dv descriptors or None (discard)."""
    ctx.check(_fn("forkattn_path_pop")(path, byref(dk) if dk is not None else None,
                                       byref(dv) if dv is not None else None))


def path_depth(path):
    return int(_fn("forkattn_path_depth")(path))


def path_rows(path):
    return int(_fn("forkattn_path_rows")(path))


def path_peak_bytes(path):
    return int(_fn("forkattn_path_peak_bytes")(path))


# --------------------------------------------------------------------------------------------
# tree cost model, partition, batch plan (host). Layout arguments as for tree_fwd: int lists or
# (pointer, n) pairs of host int64 arrays. Results are copied out of the C objects, which are
# freed before returning: no C pointer outlives a call.


def cost_model_struct(heads_q, head_dim, sec_per_mac, sec_per_row, sec_per_pair):
    return TreeCostModelC(int64_arg(heads_q, "heads_q"), int64_arg(head_dim, "head_dim"), float(sec_per_mac),
                          float(sec_per_row),
                          float(sec_per_pair))


def tree_cost_model_calibrate(ctx, heads_q, heads_kv, head_dim, dtype_code):
    """(heads_q, head_dim, sec_per_mac, sec_per_row, sec_per_pair) fitted on ctx's backend."""
    m = TreeCostModelC()
    st = _fn("forkattn_tree_cost_model_calibrate")(ctx.handle, int64_arg(heads_q, "heads_q"),
                                                   int64_arg(heads_kv, "heads_kv"), int64_arg(head_dim, "head_dim"),
                                                   int_arg(dtype_code, "dtype"), byref(m))
    ctx.check(st)
    return (int(m.heads_q), int(m.head_dim), float(m.sec_per_mac), float(m.sec_per_row),
            float(m.sec_per_pair))


def tree_cost(ctx, node_offsets, parents, model):
    """Predicted seconds of fwd + bwd over the tree (``model`` a TreeCostModelC)."""
    lay, keep = _tree_struct(node_offsets, parents)
    out = c_double()
    st = _fn("forkattn_tree_cost")(ctx.handle, byref(lay), byref(model), byref(out))
    del keep
    ctx.check(st)
    return float(out.value)


def _copy_layout(ctx, fn, obj, i):
    """(node_offsets, parents) ctypes int64 copies of the layout ``fn`` (the partition's or the
    batch plan's accessor) gives for part/batch i of ``obj``; an empty layout gives ([0], [])."""
    lay = TreeLayoutC()
    ctx.check(fn(obj, int(i), byref(lay)))
    n = int(lay.num_nodes)
    if n <= 0 or not lay.node_offsets or not lay.parents:
        return (c_int64 * 1)(0), (c_int64 * 0)()
    return _copy_i64(lay.node_offsets, n + 1), _copy_i64(lay.parents, n)


def _copy_rows(fn, obj, i):
    """Row map of part/batch i as a ctypes int64 array (length 0 when it has no rows)."""
    nr = c_int64(0)
    ptr = fn(obj, int(i), byref(nr))
    n = int(nr.value)
    if not ptr or n <= 0:
        return (c_int64 * 0)()
    return _copy_i64(ptr, n)


def tree_partition(ctx, node_offsets, parents, num_parts, model):
    """Partition a tree; returns {"parts": [dict(node_offsets, parents, rows: ctypes int64 arrays,
    owned: bytes, cost: float)], "imbalance": float}. The C partition is freed here."""
    lay, keep = _tree_struct(node_offsets, parents)
    h = c_void_p()
    st = _fn("forkattn_tree_partition")(ctx.handle, byref(lay), int64_arg(num_parts, "num_parts"), byref(model),
                                        byref(h))
    del keep
    ctx.check(st)
    lib = load_library()
    try:
        parts = []
        for i in range(int(lib.forkattn_partition_num_parts(h))):
            offs, par = _copy_layout(ctx, lib.forkattn_partition_layout, h, i)
            rows = _copy_rows(lib.forkattn_partition_rows, h, i)
            optr = lib.forkattn_partition_owned(h, i)
            owned = ctypes.string_at(optr, len(rows)) if optr and len(rows) else b""
            parts.append({"node_offsets": offs, "parents": par, "rows": rows, "owned": owned,
                          "cost": float(lib.forkattn_partition_cost(h, i))})
        return {"parts": parts, "imbalance": float(lib.forkattn_partition_imbalance(h))}
    finally:
        lib.forkattn_partition_free(h)


def tree_plan_batches(ctx, node_offsets, parents, max_batch_rows, model):
    """Batch plan of a forest: a list of dict(node_offsets, parents, rows: ctypes int64 arrays,
    mode: "tree" / "replicated", reason: str). The C plan is freed here."""
    lay, keep = _tree_struct(node_offsets, parents)
    h = c_void_p()
    st = _fn("forkattn_tree_plan_batches")(ctx.handle, byref(lay), int64_arg(max_batch_rows, "max_batch_rows"),
                                           byref(model),
                                           byref(h))
    del keep
    ctx.check(st)
    lib = load_library()
    try:
        out = []
        for i in range(int(lib.forkattn_batch_plan_count(h))):
            offs, par = _copy_layout(ctx, lib.forkattn_batch_plan_layout, h, i)
            mode = int(lib.forkattn_batch_plan_mode(h, i))
            out.append({"node_offsets": offs, "parents": par,
                        "rows": _copy_rows(lib.forkattn_batch_plan_rows, h, i),
                        "mode": EXEC_MODES.get(mode, str(mode)),
                        "reason": (lib.forkattn_batch_plan_reason(h, i) or b"").decode(errors="replace")})
        return out
    finally:
        lib.forkattn_batch_plan_free(h)



# --------------------------------------------------------------------------------------------
# shared-prefix KV cache for diffusion LMs (BiCache): cached-prefix attention, the cache, K/V
# similarity, the reuse-depth profile. Handles (cache, entry, profile) are c_void_p values owned
# by forkattn.dlm_cache's classes. Tokens are (host pointer, n) pairs of int32 arrays.


def _cached_layout(prompt_len, response_lens, causal):
    """(forkattn_prefix_layout of one group, offsets array kept alive)."""
    _check_layout_lists([int(prompt_len)], [len(response_lens)], response_lens)
    arr, _ = _i64_array([0] + _cumsum(response_lens), "response offsets")
    return PrefixLayout(int64_arg(prompt_len, "prompt_len"), len(response_lens), arr,
                        MASK_CAUSAL if causal else MASK_BIDIRECTIONAL), arr


def _prefix_cached_call(ctx, direction, prompt_len, response_lens, causal, tensors, lse_ptr, scale,
                        memory, block_size):
    lay, keep = _cached_layout(prompt_len, response_lens, causal)
    if block_size is None:
        fn = _fn("forkattn_prefix_cached_" + direction)
        mode = ()
    else:
        fn = _fn("forkattn_prefix_cached_block_" + direction)
        mode = (int64_arg(block_size, "block_size"),)
    st = fn(ctx.handle, byref(lay), *mode, *_attn_args(tensors, lse_ptr), _scale(scale), memory)
    del keep
    ctx.check(st)


def prefix_cached_fwd(ctx, prompt_len, response_lens, causal, q, k, v, o, lse_ptr, scale, memory, block_size=None):
    """Attention of one group's response rows (q, o [R_total, Hq, d]) against keys/values
    [P + R_total, Hkv, d] whose first P rows are a cached prefix. ``block_size`` None: the
    ``causal`` / bidirectional mask (``forkattn_prefix_cached_fwd``); an int: block-causal
    attention over blocks of that many rows (``forkattn_prefix_cached_block_fwd``, which checks
    it is >= 1; ``causal`` is then not used)."""
    _prefix_cached_call(ctx, "fwd", prompt_len, response_lens, causal, (q, k, v, o), lse_ptr, scale,
                        memory, block_size)


def prefix_cached_bwd(ctx, prompt_len, response_lens, causal, q, k, v, o, do, lse_ptr, dq, dk, dv, scale,
                      memory, block_size=None):
    """Backward of :func:`prefix_cached_fwd` (same ``causal`` / ``block_size``)."""
    _prefix_cached_call(ctx, "bwd", prompt_len, response_lens, causal, (q, k, v, o, do, dq, dk, dv),
                        lse_ptr, scale, memory, block_size)


def kv_cache_create(ctx, capacity_bytes, block_tokens, layers, kv_heads, head_dim, dtype_code, memory):
    """A new ``forkattn_kv_cache`` on ``ctx`` (freed with kv_cache_destroy, before the context)."""
    if not 0 <= int(capacity_bytes) <= (1 << 64) - 1:
        raise _invalid("capacity_bytes = %d does not fit in size_t" % int(capacity_bytes))
    opt = KvCacheOptions(int(capacity_bytes), int64_arg(block_tokens, "block_tokens"), int64_arg(layers, "layers"),
                         int64_arg(kv_heads, "kv_heads"), int64_arg(head_dim, "head_dim"), int_arg(dtype_code, "dtype"),
                         int_arg(memory, "memory"))
    h = c_void_p()
    st = _fn("forkattn_kv_cache_create")(ctx.handle, byref(opt), byref(h))
    ctx.check(st)
    return h


def kv_cache_destroy(cache):
    if cache:
        _fn("forkattn_kv_cache_destroy")(cache)


def kv_cache_insert(ctx, cache, layers, tokens_ptr, n, ks, vs, memory):
    """Store the prefix tokens[0..n) with per-layer descriptors ``ks``/``vs`` (lists of exactly
    ``layers`` Tensor: the C library reads that many). Returns True when stored (or refreshed),
    False when the cache rejected it. Errors are reported through ``ctx``, the cache's context."""
    layers = int64_arg(layers, "layers")
    if len(ks) != layers or len(vs) != layers:
        raise _invalid("insert: %d key and %d value tensors given, the cache has %d layers"
                       % (len(ks), len(vs), layers))
    karr = (Tensor * max(1, layers))(*ks)
    varr = (Tensor * max(1, layers))(*vs)
    stored = c_int(0)
    st = _fn("forkattn_kv_cache_insert")(cache, c_void_p(int(tokens_ptr) or None), int64_arg(n, "tokens"), karr,
                                         varr, int_arg(memory, "memory"), byref(stored))
    ctx.check(st)
    return bool(stored.value)


def kv_cache_lookup(ctx, cache, tokens_ptr, n):
    """(held entry handle or None, matched length) of the longest cached prefix of tokens[0..n)."""
    e = c_void_p()
    m = c_int64(0)
    st = _fn("forkattn_kv_cache_lookup")(cache, c_void_p(int(tokens_ptr) or None), int64_arg(n, "tokens"), byref(e),
                                         byref(m))
    ctx.check(st)
    return (e if e.value else None), int(m.value)


def kv_entry_view(entry, layer, which):
    """The contiguous descriptor of K (which=0) or V (which=1) of ``layer`` of a held entry
    (data NULL when the library refuses the layer)."""
    t = Tensor()
    _fn("forkattn_kv_entry_v" if which else "forkattn_kv_entry_k")(entry, int64_arg(layer, "layer"), byref(t))
    return t


def kv_cache_release(cache, entry):
    if cache and entry:
        _fn("forkattn_kv_cache_release")(cache, entry)


def kv_cache_stats(ctx, cache):
    s = KvCacheStats()
    ctx.check(_fn("forkattn_kv_cache_get_stats")(cache, byref(s)))
    return {name: int(getattr(s, name)) for name, _ in KvCacheStats._fields_}


def kv_similarity(ctx, a, b, memory):
    """(per-head similarities as a list of floats, their mean) of two [rows, heads, d] tensors."""
    heads = int(a.heads)
    sim = (c_float * max(1, heads))()
    mean = c_float(0.0)
    st = _fn("forkattn_kv_similarity")(ctx.handle, byref(a), byref(b), sim, byref(mean), int(memory))
    ctx.check(st)
    return [float(x) for x in sim[:heads]], float(mean.value)


def reuse_profile_create(ctx, layers, threshold):
    h = c_void_p()
    st = _fn("forkattn_reuse_profile_create")(ctx.handle, int64_arg(layers, "layers"), c_float(float(threshold)),
                                              byref(h))
    ctx.check(st)
    return h


def reuse_profile_free(profile):
    if profile:
        _fn("forkattn_reuse_profile_free")(profile)


def reuse_profile_add(ctx, profile, layers, ratio, sims):
    """``sims``: a sequence of exactly ``layers`` floats (the C library reads that many)."""
    sims = [float(x) for x in sims]
    if len(sims) != int(layers):
        raise _invalid("sims: %d values given, the profile has %d layers (one similarity per layer)"
                       % (len(sims), int(layers)))
    arr = (c_float * max(1, len(sims)))(*sims)
    ctx.check(_fn("forkattn_reuse_profile_add")(ctx.handle, profile, c_double(float(ratio)), arr))


def reuse_profile_depth(ctx, profile, ratio):
    d = c_int64(0)
    ctx.check(_fn("forkattn_reuse_profile_depth")(ctx.handle, profile, c_double(float(ratio)), byref(d)))
    return int(d.value)


def reuse_profile_save(ctx, profile, path):
    ctx.check(_fn("forkattn_reuse_profile_save")(ctx.handle, profile, os.fsencode(path)))


def reuse_profile_load(ctx, path):
    h = c_void_p()
    st = _fn("forkattn_reuse_profile_load")(ctx.handle, os.fsencode(path), byref(h))
    ctx.check(st)
    return h
