"""forkattn: attention primitives for RL post-training with shared prefixes (Python binding).

A pure-Python ctypes binding of libforkattn (no compiled extension). Without PyTorch the
library, contexts and the numpy functions (:mod:`forkattn.numpy_api`) still work; the torch
API (layouts, differentiable attention, custom ops) needs ``import torch`` to succeed.

See docs/python.md.
"""

from ._lib import (  # noqa: F401
    Context,
    ForkattnError,
    ForkattnInvalidArgument,
    backend,
    build_has_offload,
    configure,
    current_context,
    default_context,
    library_path,
    load_library,
    use_context,
    version,
)

__version__ = "0.2.0"

_TORCH_NAMES = (
    "SharedPrefixLayout",
    "TreeLayout",
    "prefix_attention",
    "tree_attention",
    "varlen_attention",
    "PrefixAttentionFunction",
    "TreeAttentionFunction",
    "VarlenAttentionFunction",
    "KeptSet",
    "kv_select",
    "stream_kl",
    "kept_attention",
    "kl_outside_mass",
    "StreamKLFunction",
    "KeptAttentionFunction",
    "prefix_cached_attention",
    "PrefixCachedAttentionFunction",
)

# forkattn.dlm_cache (shared-prefix KV cache for diffusion LMs): the cache, K/V similarity and
# the reuse-depth profile work with numpy arrays too (loaded on first use without torch).
_DLM_NAMES = (
    "KVCache",
    "KVEntry",
    "kv_similarity",
    "ReuseProfile",
)

try:
    import torch as _torch  # noqa: F401
except ImportError as _e:  # numpy-only installs
    _TORCH_ERROR = _e
    HAVE_TORCH = False
else:
    _TORCH_ERROR = None
    HAVE_TORCH = True
    from .layouts import SharedPrefixLayout, TreeLayout  # noqa: F401
    from .ops import (  # noqa: F401
        PrefixAttentionFunction,
        TreeAttentionFunction,
        VarlenAttentionFunction,
        prefix_attention,
        tree_attention,
        varlen_attention,
    )
    from .distill import (  # noqa: F401
        KeptAttentionFunction,
        KeptSet,
        StreamKLFunction,
        kept_attention,
        kl_outside_mass,
        kv_select,
        stream_kl,
    )
    from .dlm_cache import (  # noqa: F401  (registers torch.ops.forkattn.prefix_cached_fwd/_bwd)
        KVCache,
        KVEntry,
        PrefixCachedAttentionFunction,
        ReuseProfile,
        kv_similarity,
        prefix_cached_attention,
    )


# forkattn.tree_exec (DFS path stack, tree cost model, partition, batch plan): numpy arrays or
# torch tensors, needs neither to import; loaded on first use.
_TREE_EXEC_NAMES = (
    "PathStack",
    "dfs_walk",
    "TreeCostModel",
    "tree_cost",
    "tree_partition",
    "TreePartition",
    "tree_plan_batches",
    "BatchPlan",
)


def __getattr__(name):
    if name in _TREE_EXEC_NAMES:
        from . import tree_exec

        return getattr(tree_exec, name)
    if name in _DLM_NAMES:
        from . import dlm_cache

        return getattr(dlm_cache, name)
    if name in _TORCH_NAMES and not HAVE_TORCH:
        raise ImportError("forkattn.%s needs PyTorch, which could not be imported (%s); the numpy "
                          "functions are in forkattn.numpy_api" % (name, _TORCH_ERROR))
    if name in ("numpy_api", "hf", "distill", "tree_exec", "dlm_cache", "distributed"):  # lazy submodules (forkattn.hf imports transformers only in register())
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError("module 'forkattn' has no attribute %r" % name)


__all__ = [
    "Context",
    "ForkattnError",
    "ForkattnInvalidArgument",
    "backend",
    "build_has_offload",
    "configure",
    "current_context",
    "default_context",
    "library_path",
    "load_library",
    "use_context",
    "version",
    "HAVE_TORCH",
] + list(_TORCH_NAMES) + list(_TREE_EXEC_NAMES) + list(_DLM_NAMES)
