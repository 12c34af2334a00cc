"""Hugging Face ``transformers`` integration: an attention function registered through
``transformers.AttentionInterface`` under the name ``"forkattn"``.

Usage::

    import forkattn, forkattn.hf
    forkattn.hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="forkattn")
    layout = forkattn.SharedPrefixLayout.from_uid(uid, prompt_mask, response_mask, input_ids)
    out = model(**forkattn.hf.packed_inputs(model, layout, input_ids))    # input_ids [1, T], ...
    logits = layout.unpack_responses(out.logits[0], shift=True)            # [B, R_max, V]

The packed rows of a :class:`~forkattn.SharedPrefixLayout` or :class:`~forkattn.TreeLayout`
enter the model as a batch of one sequence (``input_ids`` [1, T], ``position_ids`` [1, T] from
``layout.position_ids()``); the layout itself travels as the keyword argument
``forkattn_layout=`` of the model call, which ``transformers`` (v4.48+, v5) forwards through
the decoder layers to the attention function. Without it the function raises: it never falls
back to plain causal attention over the packed rows (which would let responses read each
other).

The attention implementation is a field of the config object, which models built from one
config share: switching one of them (``set_attn_implementation("sdpa")``) switches all, and
another attention would run on the packed rows with no error of its own. So
:func:`packed_inputs` takes the model, checks that its attention dispatches to forkattn and
installs hooks that check it again on every call with a layout (see :func:`packed_inputs`).

Importing this module does not import ``transformers``; :func:`register` does.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import warnings
import weakref

import torch

from .layouts import SharedPrefixLayout, TreeLayout
from . import ops as _ops
from .ops import _compiling

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LAYOUT_KWARG",
    "VerificationError",
    "attention_forward",
    "check_model",
    "packed_inputs",
    "register",
    "replicated_sequences",
    "last_verification",
]

ATTN_IMPLEMENTATION = "forkattn"
LAYOUT_KWARG = "forkattn_layout"
VERIFY_ENV = "FORKATTN_HF_VERIFY"

logger = logging.getLogger("forkattn.hf")

# Verify mode: "off", "once" (the first call after register()), "all" (every call).
_state = {"verify": "off", "verified": False, "tol": None}
#: The result of the last verification (a dict), or None.
last_verification = None

# normwise relative tolerances of the verify mode, by dtype (forkattn computes in float32; the
# reference is PyTorch's SDPA in float32 on the same, rounded, inputs)
_VERIFY_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


class VerificationError(AssertionError):
    """The verify mode found forkattn's output different from the replicated computation."""


def _verify_mode(verify):
    if verify is None:
        verify = os.environ.get(VERIFY_ENV, "0")
    if verify is True:
        return "once"
    if verify is False:
        return "off"
    v = str(verify).strip().lower()
    if v in ("", "0", "off", "false", "no"):
        return "off"
    if v in ("1", "once", "true", "yes", "on"):
        return "once"
    if v in ("all", "always", "every"):
        return "all"
    raise ValueError("forkattn.hf: verify must be True/False, 'once' or 'all' (or %s=0|1|all), got %r"
                     % (VERIFY_ENV, verify))


def register(name=ATTN_IMPLEMENTATION, verify=None, verify_tol=None):
    """Register :func:`attention_forward` with ``transformers.AttentionInterface`` under
    ``name`` (default ``"forkattn"``) and return ``name``. Then build or switch models with
    ``attn_implementation="forkattn"`` (``from_config``/``from_pretrained``, or
    ``model.set_attn_implementation("forkattn")``).

    ``verify``: ``True`` / ``"once"`` checks the first attention call after this registration
    against the replicated computation (every sequence of the layout run separately through
    PyTorch's SDPA with a causal mask) and raises :class:`VerificationError` beyond
    ``verify_tol`` (normwise relative; default 1e-4 in float32, 2e-2 in bfloat16/float16);
    ``"all"`` checks every call (slow: for debugging); ``None`` (default) reads the
    environment variable ``FORKATTN_HF_VERIFY`` (``0``, ``1``/``once``, ``all``). The result is
    logged once on the ``forkattn.hf`` logger and kept in ``forkattn.hf.last_verification``.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("forkattn.hf.register() needs transformers with AttentionInterface "
                          "(v4.48 or later): %s" % e) from None
    _state["verify"] = _verify_mode(verify)
    _state["verified"] = False
    _state["tol"] = None if verify_tol is None else float(verify_tol)
    AttentionInterface.register(name, attention_forward)
    return name


# --------------------------------------------------------------------------------------------
# inputs


def packed_inputs(model, layout=None, input_ids=None, device=None):
    """The keyword arguments of a call of ``model`` on the packed rows of ``layout``:
    ``{"input_ids": [1, T], "position_ids": [1, T], "forkattn_layout": layout, "use_cache": False}``.

    ``model``: the object that will be called (a ``transformers`` model built or switched with
    ``attn_implementation="forkattn"``, or the wrapper around one that is called). It is
    checked here: every attention module in it (or, if none is recognised, its ``config``)
    must dispatch to forkattn's attention function, else ``ValueError`` (models built from one
    config object share the attention implementation: switching one switches all). Hooks are
    installed on it (once) that check every later call that passes ``forkattn_layout=``: each
    attention module's implementation again before it runs, the ``position_ids`` against the
    layout's, and, after the call, that every causal attention module that ran did so through
    forkattn's attention function.

    ``input_ids``: for a :class:`SharedPrefixLayout`, the trainer's padded batch ``[B, L]``
    (its batch view; packed with ``layout.pack``) or already packed ids ``[T]``; for a
    :class:`TreeLayout`, ``None`` (the token ids the trie was built from, ``layout.row_tokens``),
    the list of per-sequence token tensors (``layout.pack_sequences``), or packed ids ``[T]``.
    ``device`` defaults to that of ``input_ids`` (CPU for ``None``).

    The older form ``packed_inputs(layout, input_ids=None, device=None)`` (no model) still
    works but cannot check the model and warns (``FutureWarning``)."""
    if isinstance(model, (SharedPrefixLayout, TreeLayout)):
        # packed_inputs(layout, input_ids, device): shift the arguments
        model, layout, input_ids, device = None, model, layout, input_ids
        warnings.warn("forkattn.hf.packed_inputs(layout, ...) cannot check that the model's attention "
                      "is forkattn's (a model sharing its config with another can be switched to "
                      "another attention, which mixes the packed sequences silently): call "
                      "packed_inputs(model, layout, input_ids)", FutureWarning, stacklevel=2)
    elif not isinstance(model, torch.nn.Module):
        raise TypeError("forkattn.hf.packed_inputs: the first argument is the model that will be "
                        "called (a torch.nn.Module), got %s" % type(model).__name__)
    _check_layout_type(layout)
    if model is not None:
        check_model(model)
        _install_guard(model)
    T = layout.num_rows
    if input_ids is None:
        if isinstance(layout, TreeLayout) and layout.row_tokens is not None:
            ids = layout.row_tokens
        else:
            raise ValueError("forkattn.hf.packed_inputs: pass input_ids (the padded batch or the "
                             "packed [T] ids)")
    elif isinstance(input_ids, (list, tuple)):
        if not isinstance(layout, TreeLayout):
            raise TypeError("forkattn.hf.packed_inputs: a list of sequences needs a TreeLayout")
        ids = layout.pack_sequences([torch.as_tensor(s) for s in input_ids])
    else:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] == T and not (
                isinstance(layout, SharedPrefixLayout) and layout.batch_size == 1):
            ids = ids[0]
        if ids.dim() != 1:
            if isinstance(layout, SharedPrefixLayout):
                ids = layout.pack(ids)
            else:
                ids = layout.pack_sequences(ids)
    if ids.shape[0] != T:
        raise ValueError("forkattn.hf.packed_inputs: %d packed ids, the layout has %d rows"
                         % (ids.shape[0], T))
    dev = torch.device(device) if device is not None else ids.device
    pos = _layout_positions(layout, dev).clone()[None]  # the caller's to modify: a copy
    _positions_cache(layout).accept(pos)  # built from the layout: no comparison needed
    return {"input_ids": ids.to(dev)[None], "position_ids": pos,
            LAYOUT_KWARG: layout, "use_cache": False}


# --------------------------------------------------------------------------------------------
# the model check and guard
#
# transformers reads the attention implementation from ``module.config._attn_implementation``
# at every attention call, and that config object is shared by every model built from it. A
# model whose attention is not forkattn's would run its own attention on the packed rows (one
# long causal sequence: the packed sequences attend to each other) and ignore the layout
# keyword; forkattn's function never runs, so it cannot object. The checks below run outside
# forkattn's function: when the inputs are built, before each attention module runs, and after
# the model call.


def _is_attention_module(m):
    """An attention module of a transformers model: it reads ``config._attn_implementation``
    and has ``is_causal`` (LlamaAttention, Qwen2Attention, MistralAttention, ...)."""
    return hasattr(m, "is_causal") and hasattr(getattr(m, "config", None), "_attn_implementation")


def _dispatches_to_forkattn(impl):
    """Whether transformers' global AttentionInterface maps the implementation name ``impl`` to
    :func:`attention_forward`."""
    if not isinstance(impl, str):
        return False
    iface = _state.get("iface")
    if iface is None:
        try:
            from transformers import AttentionInterface
        except ImportError:
            return False
        iface = _state["iface"] = AttentionInterface()
    return iface.get(impl) is attention_forward


def _not_forkattn_error(what, impl):
    return ValueError(
        "forkattn.hf: %s dispatches attention to %r (config._attn_implementation), not to forkattn's "
        "attention function; on the packed rows that attention would let the packed sequences attend "
        "to each other. transformers keeps the attention implementation in the config object, which "
        "every model built from it shares: set_attn_implementation(...) or from_config(cfg, "
        "attn_implementation=...) on one model switches all of them. Give each model its own config "
        "(from_config(copy.deepcopy(cfg), ...)) and use attn_implementation='forkattn' (after "
        "forkattn.hf.register()) on this one." % (what, impl))


def check_model(model):
    """Raise ``ValueError`` unless every attention module of ``model`` (and, if it has none that
    can be recognised, ``model.config``) dispatches to forkattn's attention function.
    :func:`packed_inputs` calls it; call it yourself after switching implementations."""
    mods = [(n, m) for n, m in model.named_modules() if _is_attention_module(m)]
    for name, m in mods:
        impl = m.config._attn_implementation
        if not _dispatches_to_forkattn(impl):
            raise _not_forkattn_error("%s (%s)" % (name or "the model", type(m).__name__), impl)
    cfg = getattr(model, "config", None)
    if not mods and hasattr(cfg, "_attn_implementation"):
        if not _dispatches_to_forkattn(cfg._attn_implementation):
            raise _not_forkattn_error("the model (%s)" % type(model).__name__, cfg._attn_implementation)


_GUARD = "_forkattn_hf_guard"
_tls = threading.local()


class _Call:
    """One model call with a layout: the attention modules that ran, and those whose attention
    went through :func:`attention_forward` with this layout."""
    __slots__ = ("model", "layout", "ran", "used")

    def __init__(self, model, layout):
        self.model, self.layout, self.ran, self.used = model, layout, [], set()


def _calls():
    st = getattr(_tls, "calls", None)
    if st is None:
        st = _tls.calls = []
    return st


def _install_guard(model):
    """Hooks on ``model`` (the module the caller calls), once, and on each of its attention
    modules not hooked yet."""
    n = 0
    for m in model.modules():
        if _is_attention_module(m):
            n += 1
            if not m.__dict__.get(_GUARD):
                m.register_forward_pre_hook(_attention_pre_hook, with_kwargs=True)
                m.__dict__[_GUARD] = True
    if not model.__dict__.get(_GUARD):
        model.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)
        model.register_forward_hook(_model_post_hook, with_kwargs=True, always_call=True)
    model.__dict__[_GUARD] = {"attention_modules": n}


def _model_pre_hook(model, args, kwargs):
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None or _compiling():
        return None
    _check_layout_type(layout)
    guard = model.__dict__.get(_GUARD)
    cfg = getattr(model, "config", None)
    if guard and not guard["attention_modules"] and hasattr(cfg, "_attn_implementation"):
        # no attention module to hook: the model's config is all there is to check
        if not _dispatches_to_forkattn(cfg._attn_implementation):
            raise _not_forkattn_error("the model (%s)" % type(model).__name__, cfg._attn_implementation)
    if len(args) <= 1:  # position_ids may come positionally after input_ids, attention_mask
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError(
                "forkattn.hf: the model was called with %s= but without position_ids; transformers "
                "would number the packed rows 0..T-1 as one sequence. Pass position_ids="
                "layout.position_ids()[None] (forkattn.hf.packed_inputs(model, layout, input_ids) "
                "builds the whole call)" % LAYOUT_KWARG)
        _check_positions(layout, pos, "the model call")
    st = _calls()
    st[:] = [c for c in st if c.model is not model]  # left behind by an interrupted call
    st.append(_Call(model, layout))
    return None


def _model_post_hook(model, args, kwargs, result):
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None or _compiling():
        return None
    st = _calls()
    if not st or st[-1].model is not model or st[-1].layout is not layout:
        return None
    call = st.pop()
    if result is None:  # the forward raised (always_call): that error propagates
        return None
    missed = [m for m in call.ran if id(m) not in call.used]
    if missed:
        raise ValueError(
            "forkattn.hf: the model was called with %s=, but the attention of %s did not run through "
            "forkattn's attention function (implementation %r): its output mixes the packed "
            "sequences. The module does not dispatch through transformers' AttentionInterface, or "
            "does not forward the model call's keyword arguments to it; such a model cannot run on "
            "packed rows" % (LAYOUT_KWARG, ", ".join(_module_name(m) for m in missed),
                             getattr(missed[0].config, "_attn_implementation", None)))
    return None


def _attention_pre_hook(module, args, kwargs):
    if _compiling():
        return None
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is not None:
        impl = module.config._attn_implementation
        if not _dispatches_to_forkattn(impl):
            raise _not_forkattn_error(_module_name(module), impl)
    st = getattr(_tls, "calls", None)
    if not st or (layout is not None and st[-1].layout is not layout):
        return None
    # A causal attention module that runs during a packed call must consume the layout (one
    # that gets no layout, e.g. because the model does not forward keyword arguments, would
    # run its own attention). Not known when the module's forward is compiled on its own.
    if (layout is not None or module.is_causal is True) and not hasattr(
            getattr(module, "forward", None), "_torchdynamo_orig_callable"):
        st[-1].ran.append(module)
    return None


# --------------------------------------------------------------------------------------------
# the attention function


def _check_layout_type(layout):
    if not isinstance(layout, (SharedPrefixLayout, TreeLayout)):
        raise TypeError("forkattn.hf: %s must be a forkattn.SharedPrefixLayout or TreeLayout, got %s"
                        % (LAYOUT_KWARG, type(layout).__name__))


def _max_seq_len(layout):
    if layout.num_rows == 0:
        return 0
    return int(layout.position_ids().max()) + 1


def _module_name(module):
    idx = getattr(module, "layer_idx", None)
    return "%s%s" % (type(module).__name__, "" if idx is None else " (layer %d)" % idx)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """The ``AttentionInterface`` function: ``query`` [1, Hq, T, d], ``key``/``value``
    [1, Hkv, T, d] (un-repeated KV heads: GQA is handled by forkattn) over the packed rows of
    ``kwargs["forkattn_layout"]``. Returns ``(attn_output [1, T, Hq, d], None)`` like
    ``sdpa_attention_forward``. Differentiable in query, key and value."""
    layout = kwargs.get(LAYOUT_KWARG)
    where = _module_name(module)
    if layout is None:
        raise ValueError(
            "forkattn.hf: %s was called without the %r keyword argument. The 'forkattn' attention "
            "implementation only runs on packed rows described by a forkattn.SharedPrefixLayout or "
            "TreeLayout: call the model with input_ids [1, T], position_ids=layout.position_ids()[None] "
            "and %s=layout (forkattn.hf.packed_inputs(model, layout, input_ids) builds all three). It "
            "does not fall back to plain causal attention, which would let packed sequences attend to "
            "each other. For ordinary batches use a model with attn_implementation='sdpa' and its own "
            "config object (models built from one config share the implementation)."
            % (where, LAYOUT_KWARG, LAYOUT_KWARG))
    _check_layout_type(layout)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("forkattn.hf: expected query/key/value [batch, heads, seq, head_dim], got %s, "
                         "%s, %s" % (tuple(query.shape), tuple(key.shape), tuple(value.shape)))
    if query.shape[0] != 1:
        raise ValueError(
            "forkattn.hf: %s got a batch of %d; the packed rows of a layout are one sequence: call the "
            "model with input_ids [1, T] (layout.pack(input_ids)[None])" % (where, query.shape[0]))
    T = query.shape[2]
    if key.shape[2] != T or value.shape[2] != T:
        raise NotImplementedError(
            "forkattn.hf: %s has %d query rows but %d key rows: a KV cache is in use. The forkattn "
            "hook is for training/scoring forwards over packed rows; call the model with "
            "use_cache=False" % (where, T, key.shape[2]))
    if T != layout.num_rows:
        raise ValueError("forkattn.hf: %s got %d rows but the %s has %d (pack input_ids with this "
                         "layout)" % (where, T, type(layout).__name__, layout.num_rows))
    if attention_mask is not None:
        raise ValueError(
            "forkattn.hf: %s received an attention mask of shape %s; with forkattn the layout defines "
            "the mask (the packed rows have no padding): pass no 4-D attention_mask"
            % (where, tuple(attention_mask.shape)))
    if dropout:
        raise NotImplementedError("forkattn.hf: attention dropout (%g) is not supported; set the "
                                  "config's attention_dropout to 0" % dropout)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError("forkattn.hf: %s is not causal (an encoder or cross-attention "
                                  "layer); forkattn implements causal self-attention" % where)
    for k in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(k) is not None:
            raise NotImplementedError("forkattn.hf: %s passes %s=..., which forkattn does not "
                                      "implement" % (where, k))
    window = kwargs.get("sliding_window")
    if window is not None and not _compiling():
        longest = _max_seq_len(layout)
        if longest > int(window):
            raise NotImplementedError(
                "forkattn.hf: %s uses a sliding window of %d tokens and the layout has a sequence of "
                "%d; forkattn has no sliding-window mask" % (where, int(window), longest))
    pos = kwargs.get("position_ids")
    if pos is not None and not _compiling():
        _check_positions(layout, pos, where)

    # [1, H, T, d] -> [T, H, d] views (head-major; the library reads them in place)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    if isinstance(layout, SharedPrefixLayout):
        out = _ops.prefix_attention(q, k, v, layout, softmax_scale=scaling, causal=True)
    else:
        out = _ops.tree_attention(q, k, v, layout, softmax_scale=scaling)

    mode = _state["verify"]
    if mode != "off" and not _compiling() and (mode == "all" or not _state["verified"]):
        _state["verified"] = True
        _verify(where, layout, q, k, v, out, scaling, log=(mode == "once"))
    if not _compiling():
        st = getattr(_tls, "calls", None)
        if st and st[-1].layout is layout:
            st[-1].used.add(id(module))  # for the model's post-call check
    return out.unsqueeze(0), None


class _Positions:
    """Per layout: its position ids on each device, and the position_ids tensor last found equal
    to them there (held weakly, with its version counter), so that a call passing that same,
    unmodified tensor (every layer of one model call; every call on packed_inputs' tensor)
    costs no comparison. Not pickled or copied with the layout (a fresh one comes back)."""

    def __init__(self):
        self.want = {}
        self.ok = {}

    def __reduce__(self):
        return (_Positions, ())

    def want_on(self, layout, device):
        w = self.want.get(device)
        if w is None:
            w = self.want[device] = layout.position_ids().to(device)
        return w

    def accept(self, pos):
        v = _version(pos)
        if v is not None:
            self.ok[pos.device] = (weakref.ref(pos), v)

    def accepted(self, pos):
        ok = self.ok.get(pos.device)
        return ok is not None and ok[0]() is pos and ok[1] == _version(pos)


def _version(t):
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: always compared
        return None


def _positions_cache(layout):
    c = layout.__dict__.get("_hf_positions")
    if c is None:
        c = layout.__dict__["_hf_positions"] = _Positions()
    return c


def _layout_positions(layout, device):
    return _positions_cache(layout).want_on(layout, device)


def _check_positions(layout, pos, where):
    """position_ids must be the layout's (RoPE), on every call: a comparison unless ``pos`` is
    the tensor last found equal (see :class:`_Positions`)."""
    if not isinstance(pos, torch.Tensor):
        return
    p = pos
    if p.dim() == 2 and p.shape[0] == 1:
        p = p[0]
    if p.dim() != 1 or p.shape[0] != layout.num_rows:
        return  # e.g. multimodal 3-D rope positions: not ours to check
    cache = _positions_cache(layout)
    if cache.accepted(pos):
        return
    want = cache.want_on(layout, p.device)
    if not torch.equal(p.to(torch.int64), want):
        bad = int((p.to(torch.int64) != want).nonzero()[0, 0])
        raise ValueError(
            "forkattn.hf: %s: position_ids differ from layout.position_ids() (row %d: %d, expected %d); "
            "pass position_ids=layout.position_ids()[None] (forkattn.hf.packed_inputs(model, layout, "
            "input_ids) does): every response continues at its prompt's length"
            % (where, bad, int(p[bad]), int(want[bad])))
    cache.accept(pos)


# --------------------------------------------------------------------------------------------
# verify mode


def replicated_sequences(layout):
    """The sequences of the replicated batch as lists of packed rows (LongTensors): for a
    SharedPrefixLayout one per response (its prompt's rows, then its own) and a prompt-only one
    per group without responses; for a TreeLayout its input sequences (``from_sequences``) or
    root-to-leaf paths. Every packed row is in at least one."""
    if isinstance(layout, TreeLayout):
        T = layout.num_rows
        if T == 0:
            return []
        return [s for s in layout.gather_sequences(torch.arange(T), padded=False) if s.numel()]
    go = layout.group_offsets.tolist()
    P = layout.prompt_lens.tolist()
    S = layout.group_sizes.tolist()
    rs = layout.response_starts.tolist()
    R = layout.response_lens.tolist()
    rg = layout.response_group.tolist()
    seqs = []
    for g in range(layout.num_groups):
        if S[g] == 0 and P[g] > 0:
            seqs.append(torch.arange(go[g], go[g] + P[g]))
    for i in range(layout.num_responses):
        g = rg[i]
        s = torch.cat([torch.arange(go[g], go[g] + P[g]), torch.arange(rs[i], rs[i] + R[i])])
        if s.numel():
            seqs.append(s)
    return seqs


def _verify(where, layout, q, k, v, out, scaling, log):
    """Each replicated sequence through SDPA (float32, causal) vs forkattn's packed output."""
    global last_verification
    tol = _state["tol"] if _state["tol"] is not None else _VERIFY_TOL.get(q.dtype, 2e-2)
    scale = (1.0 / math.sqrt(q.shape[-1])) if scaling is None else float(scaling)
    rep = q.shape[1] // k.shape[1]
    with torch.no_grad():
        qf, kf, vf = (t.detach().float() for t in (q, k, v))
        of = out.detach().float()
        seqs = replicated_sequences(layout)
        err, den = 0.0, 0.0
        for s in seqs:
            rows = s.to(q.device)
            qs = qf.index_select(0, rows).transpose(0, 1)                          # [H, L, d]
            ks = kf.index_select(0, rows).transpose(0, 1).repeat_interleave(rep, 0)
            vs = vf.index_select(0, rows).transpose(0, 1).repeat_interleave(rep, 0)
            ref = torch.nn.functional.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], is_causal=True, scale=scale)[0].transpose(0, 1)
            got = of.index_select(0, rows)
            e = float((got - ref).abs().max()) if ref.numel() else 0.0
            den = max(den, float(ref.abs().max()) if ref.numel() else 0.0)
            err = max(err, e)
        rel = err / den if den > 0 else err
    ok = bool(rel <= tol) and math.isfinite(rel)
    last_verification = {"ok": ok, "rel_err": rel, "abs_err": err, "tol": tol, "where": where,
                         "layout": repr(layout), "sequences": len(seqs), "dtype": str(q.dtype)}
    msg = ("forkattn.hf verify: %s, %r, %s: forkattn vs the replicated computation (%d sequences "
           "through SDPA, causal, float32): normwise relative error %.3g (max abs %.3g), tolerance "
           "%.3g: %s" % (where, layout, str(q.dtype).replace("torch.", ""), len(seqs), rel, err,
                         tol, "OK" if ok else "MISMATCH"))
    if not ok:
        raise VerificationError(msg)
    if log:
        logger.warning(msg)
    else:
        logger.debug(msg)
