"""TRL integration: ``GRPOTrainer`` computes the per-token log-probs of the policy and of the
reference model on packed rows (each prompt once per group, its completions after it) through
the ``"forkattn"`` attention function of :mod:`forkattn.hf`.

Usage (one line after building the trainer)::

    import forkattn.integrations.trl
    trainer = GRPOTrainer(model=model, reward_funcs=..., args=..., train_dataset=...)
    forkattn.integrations.trl.patch_grpo_trainer(trainer)
    trainer.train()

The model keeps its own attention implementation (e.g. ``"sdpa"``) for generation; each
log-prob computation switches it to ``"forkattn"`` for the packed forward and back. Rows
with identical prompt tokens form a group, whatever their order in the batch (TRL puts the
``num_generations`` completions of a prompt next to each other). Calls the packed path
cannot reproduce (multimodal inputs, MoE auxiliary loss, prompts not left-padded or
completions not right-padded, an empty prompt) go to TRL's own computation with a warning
(or raise with ``fallback=False``).

Tested with trl 1.16 (its ``GRPOTrainer._get_per_token_logps_and_entropies``).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .. import hf as _hf
from ..layouts import SharedPrefixLayout

__all__ = ["Unsupported", "patch_grpo_trainer", "packed_per_token_logps"]

_METHOD = "_get_per_token_logps_and_entropies"
_PATCHED = "_forkattn_packed_logps"


class Unsupported(NotImplementedError):
    """A log-prob call the packed path cannot compute exactly as the trainer would."""


def _pretrained(model):
    """The transformers model inside DDP/accelerate wrappers and PEFT."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


@contextlib.contextmanager
def _forkattn_attention(model):
    """Switch the model's attention implementation to forkattn's for the block (generation
    needs the model's own: forkattn's function refuses calls without a layout)."""
    inner = _pretrained(model)
    before = getattr(inner.config, "_attn_implementation", None)
    if _hf._dispatches_to_forkattn(before):
        yield
        return
    if not hasattr(inner, "set_attn_implementation"):
        raise Unsupported("%s cannot switch its attention implementation (no set_attn_implementation)"
                          % type(inner).__name__)
    if not _hf._dispatches_to_forkattn(_hf.ATTN_IMPLEMENTATION):
        _hf.register()
    inner.set_attn_implementation(_hf.ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        inner.set_attn_implementation(before)


def _layout(input_ids, attention_mask, logits_to_keep):
    """The SharedPrefixLayout of a TRL batch ``[prompt columns | completion columns]``: rows
    with the same prompt tokens share one prompt. Raises :class:`Unsupported` when the packed
    positions would differ from the trainer's (tokens not contiguous around the boundary)."""
    B, L = input_ids.shape
    C = L - int(logits_to_keep)
    if not 0 <= C <= L:
        raise Unsupported("logits_to_keep %d outside the %d columns" % (logits_to_keep, L))
    am = attention_mask.detach().cpu().bool()
    cols = torch.arange(L)
    pm = am & (cols < C)
    rm = am & (cols >= C)
    plen, rlen = pm.sum(1), rm.sum(1)
    # left-padded prompts ending at column C-1, right-padded completions starting at column C:
    # then each row's tokens are contiguous and RoPE sees the same relative positions
    if not torch.equal(pm, (cols >= C - plen[:, None]) & (cols < C)):
        raise Unsupported("prompts are not left-padded (a row's prompt tokens do not end at the "
                          "last prompt column without gaps)")
    if not torch.equal(rm, (cols >= C) & (cols < C + rlen[:, None])):
        raise Unsupported("completions are not right-padded (a gap in the completion mask)")
    if bool(((plen == 0) & (rlen > 0)).any()):
        raise Unsupported("a row has an empty prompt (its first completion token has no predictor)")
    ids = input_ids.detach().cpu()[:, :C].masked_fill(~pm[:, :C], -1)
    uid = torch.unique(ids, dim=0, return_inverse=True)[1] if B else torch.zeros(0, dtype=torch.long)
    return SharedPrefixLayout.from_uid(uid, pm, rm)


def packed_per_token_logps(model, input_ids, attention_mask, logits_to_keep, temperature=1.0,
                           compute_entropy=False):
    """Per-token log-probs (and entropies) of the completions, as TRL's ``GRPOTrainer`` returns
    them, from one forward of ``model`` on the packed rows.

    ``input_ids`` / ``attention_mask`` [B, L]: the prompt columns (left-padded) then the last
    ``logits_to_keep`` completion columns (right-padded). Returns ``(logps, entropies)``
    [B, logits_to_keep] float32, zero at padding (``entropies`` is None unless
    ``compute_entropy``); logits are divided by ``temperature``. Only the logits of rows that
    predict a completion token are computed (a group's last prompt row once). Raises
    :class:`Unsupported` for batches it cannot pack exactly."""
    K = int(logits_to_keep)
    layout = _layout(input_ids, attention_mask, K)
    dev = input_ids.device
    B = input_ids.shape[0]
    # the packed row that predicts each completion token (0: none, i.e. padding)
    pred = layout.unpack_responses(torch.arange(1, layout.num_rows + 1), K, shift=True)
    valid = pred > 0
    rows, inv = torch.unique(pred[valid] - 1, return_inverse=True)
    labels = input_ids[:, input_ids.shape[1] - K:][valid.to(dev)]
    with _forkattn_attention(model):
        kw = _hf.packed_inputs(model, layout, input_ids)
        logits = model(**kw, logits_to_keep=rows.to(dev)).logits[0]       # [U, V]
    logits = logits.float() / float(temperature)
    lse = torch.logsumexp(logits, -1)                                          # [U]
    inv = inv.to(dev)
    logps = torch.zeros(B, K, dtype=torch.float32, device=dev)
    logps[valid.to(dev)] = logits[inv, labels] - lse[inv]
    ent = None
    if compute_entropy:
        p = torch.softmax(logits, -1)
        row_ent = lse - (p * logits).sum(-1)
        ent = torch.zeros(B, K, dtype=torch.float32, device=dev)
        ent[valid.to(dev)] = row_ent[inv]
    return logps, ent


def patch_grpo_trainer(trainer, fallback=True):
    """Make ``trainer`` (a ``trl.GRPOTrainer``) compute per-token log-probs on packed rows:
    policy (loss and old log-probs) and reference model alike. Returns the trainer.

    Replaces the trainer's ``_get_per_token_logps_and_entropies`` with
    :func:`packed_per_token_logps` over each of its ``batch_size`` chunks, at the trainer's
    temperature and under its autocast. A call it cannot reproduce goes to the original method
    with a ``UserWarning`` (once per reason), or raises :class:`Unsupported` with
    ``fallback=False``. Calling it twice is harmless."""
    original = getattr(trainer, _METHOD, None)
    if original is None:
        raise TypeError("forkattn.integrations.trl: %s has no %s method (tested with trl 1.16's "
                        "GRPOTrainer)" % (type(trainer).__name__, _METHOD))
    if getattr(original, _PATCHED, False):
        return trainer
    if getattr(getattr(trainer, "args", None), "use_liger_kernel", False):
        raise Unsupported("forkattn.integrations.trl: use_liger_kernel=True computes the loss in "
                          "Liger's kernels, not through %s" % _METHOD)
    warned = set()

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                        compute_entropy=False, compute_aux_loss=False, **extra):
        why = None
        if compute_aux_loss:
            why = "the MoE load-balancing loss depends on every (replicated) row"
        elif any(v is not None for v in extra.values()):
            why = "multimodal / token-type inputs (%s)" % ", ".join(
                sorted(k for k, v in extra.items() if v is not None))
        if why is None:
            try:
                return _packed_chunks(trainer, model, input_ids, attention_mask, logits_to_keep,
                                      batch_size, compute_entropy)
            except Unsupported as e:
                why = str(e)
        msg = "forkattn.integrations.trl: packed log-probs unsupported here (%s)" % why
        if not fallback:
            raise Unsupported(msg)
        if why not in warned:
            warned.add(why)
            warnings.warn(msg + "; using the trainer's own computation", UserWarning, stacklevel=2)
        return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                        compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)

    setattr(per_token_logps, _PATCHED, True)
    setattr(trainer, _METHOD, per_token_logps)
    return trainer


def _packed_chunks(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                   compute_entropy):
    """TRL's chunking (``batch_size`` rows per forward, to bound memory), each chunk packed."""
    B = input_ids.shape[0]
    step = batch_size or B or 1
    temperature = getattr(trainer, "temperature", 1.0)
    acc = getattr(trainer, "accelerator", None)
    logps, ents = [], []
    for s in range(0, B, step):
        with acc.autocast() if acc is not None else contextlib.nullcontext():
            lp, en = packed_per_token_logps(model, input_ids[s:s + step], attention_mask[s:s + step],
                                            logits_to_keep, temperature, compute_entropy)
        logps.append(lp)
        ents.append(en)
    return (torch.cat(logps), torch.cat(ents) if compute_entropy else None, None)
