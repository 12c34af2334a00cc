"""TRL integration: ``GRPOTrainer`` computes the per-token log-probs of the policy and of the
reference model on packed rows (each prompt once per group, its completions after it) through
the ``"forkattn"`` attention function of :mod:`forkattn.hf`.

Usage (one line after building the trainer)::

    import forkattn.integrations.trl
    trainer = GRPOTrainer(model=model, reward_funcs=..., args=..., train_dataset=...)
    forkattn.integrations.trl.patch_grpo_trainer(trainer)
    trainer.train()

The policy and reference models are switched to the ``"forkattn"`` attention implementation
for good (gradient checkpointing recomputes the forward during backward, so the switch must
outlast the log-prob call); ``generate()`` switches the policy back to its own implementation
(e.g. ``"sdpa"``) while it runs. Rows with identical prompt tokens form a group, whatever their
order in the batch (TRL puts the ``num_generations`` completions of a prompt next to each
other). What the packed path cannot reproduce is refused with :class:`Unsupported`: when
patching (multimodal models, MoE auxiliary loss, Liger kernels, continuous-batching
generation) or at the call (prompts not left-padded, completions not right-padded, an empty
prompt).

Written against trl 1.16 (``GRPOTrainer._get_per_token_logps_and_entropies``).
"""

from __future__ import annotations

import functools

import torch

from .. import hf as _hf
from ..layouts import SharedPrefixLayout

__all__ = ["Unsupported", "packed_per_token_logps", "patch_grpo_trainer", "use_forkattn"]

_WHO = "forkattn.integrations.trl"
_METHOD = "_get_per_token_logps_and_entropies"
_PATCHED = "_forkattn_packed_logps"
_GENERATE = "_forkattn_generate_impl"


class Unsupported(NotImplementedError):
    """A trainer setting or log-prob call the packed path cannot compute as the trainer would."""


def _pretrained(model):
    """The transformers model inside DDP/accelerate wrappers and PEFT."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def use_forkattn(model, generate_with=None):
    """Switch ``model`` (a transformers model, possibly inside DDP/PEFT wrappers) to forkattn's
    attention implementation, registering it if needed, and make its ``generate()`` run with
    ``generate_with`` (default: the implementation it had, ``"sdpa"`` if that was forkattn's)
    for the duration of the call. Returns ``model``; calling it again is harmless."""
    inner = _pretrained(model)
    if not hasattr(inner, "set_attn_implementation"):
        raise Unsupported("forkattn.integrations.trl: %s cannot switch its attention implementation "
                          "(no set_attn_implementation)" % type(inner).__name__)
    if not _hf._dispatches_to_forkattn(_hf.ATTN_IMPLEMENTATION):
        _hf.register()
    before = inner.config._attn_implementation
    if inner.__dict__.get(_GENERATE) is None:
        own = generate_with or ("sdpa" if _hf._dispatches_to_forkattn(before) else before)
        inner.__dict__[_GENERATE] = own
        generate = inner.generate

        @functools.wraps(generate)
        def generate_own_attention(*args, **kwargs):
            inner.set_attn_implementation(inner.__dict__[_GENERATE])
            try:
                return generate(*args, **kwargs)
            finally:
                inner.set_attn_implementation(_hf.ATTN_IMPLEMENTATION)

        inner.generate = generate_own_attention
    elif generate_with is not None:
        inner.__dict__[_GENERATE] = generate_with
    inner.set_attn_implementation(_hf.ATTN_IMPLEMENTATION)
    _hf.check_model(inner)
    return model


def _layout(input_ids, attention_mask, logits_to_keep):
    """The SharedPrefixLayout of a TRL batch ``[prompt columns | completion columns]``: rows
    with the same prompt tokens share one prompt. Raises :class:`Unsupported` when the packed
    positions would differ from the trainer's (tokens not contiguous around the boundary)."""
    B, L = input_ids.shape
    C = L - int(logits_to_keep)
    if not 0 <= C <= L:
        raise Unsupported("%s: logits_to_keep %d outside the %d columns" % (_WHO, logits_to_keep, L))
    am = attention_mask.detach().cpu().bool()
    cols = torch.arange(L)
    pm = am & (cols < C)
    rm = am & (cols >= C)
    plen, rlen = pm.sum(1), rm.sum(1)
    # left-padded prompts ending at column C-1, right-padded completions starting at column C:
    # then each row's tokens are contiguous and RoPE sees the same relative positions
    if not torch.equal(pm, (cols >= C - plen[:, None]) & (cols < C)):
        raise Unsupported("%s: prompts are not left-padded (a row's prompt tokens do not end at the "
                          "last prompt column without gaps)" % _WHO)
    if not torch.equal(rm, (cols >= C) & (cols < C + rlen[:, None])):
        raise Unsupported("%s: completions are not right-padded (a gap in the completion mask)" % _WHO)
    if bool(((plen == 0) & (rlen > 0)).any()):
        raise Unsupported("%s: a row has an empty prompt (its first completion token has no "
                          "predictor)" % _WHO)
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
    predict a completion token are computed (a group's last prompt row once). ``model`` must
    dispatch to forkattn's attention (:func:`use_forkattn`). Raises :class:`Unsupported` for
    batches it cannot pack exactly."""
    K = int(logits_to_keep)
    layout = _layout(input_ids, attention_mask, K)
    dev = input_ids.device
    B = input_ids.shape[0]
    # the packed row that predicts each completion token (0: none, i.e. padding)
    pred = layout.unpack_responses(torch.arange(1, layout.num_rows + 1), K, shift=True)
    valid = pred > 0
    rows, inv = torch.unique(pred[valid] - 1, return_inverse=True)
    valid = valid.to(dev)
    labels = input_ids[:, input_ids.shape[1] - K:][valid]
    kw = _hf.packed_inputs(model, layout, input_ids)
    logits = model(**kw, logits_to_keep=rows.to(dev)).logits[0]           # [U, V]
    logits = logits.float() / float(temperature)
    lse = torch.logsumexp(logits, -1)                                          # [U]
    inv = inv.to(dev)
    logps = torch.zeros(B, K, dtype=torch.float32, device=dev)
    logps[valid] = logits[inv, labels] - lse[inv]
    ent = None
    if compute_entropy:
        p = torch.softmax(logits, -1)
        row_ent = lse - (p * logits).sum(-1)
        ent = torch.zeros(B, K, dtype=torch.float32, device=dev)
        ent[valid] = row_ent[inv]
    return logps, ent


def patch_grpo_trainer(trainer):
    """Make ``trainer`` (a ``trl.GRPOTrainer``) compute per-token log-probs on packed rows:
    policy (loss and old log-probs) and reference model alike. Returns the trainer.

    Switches the policy and reference models to forkattn's attention (:func:`use_forkattn`:
    generation keeps the policy's own) and replaces the trainer's
    ``_get_per_token_logps_and_entropies`` with :func:`packed_per_token_logps` over each of its
    ``batch_size`` chunks, at the trainer's temperature and under its autocast. Raises
    :class:`Unsupported` for settings it cannot reproduce. Calling it twice is harmless."""
    original = getattr(trainer, _METHOD, None)
    if original is None:
        raise TypeError("forkattn.integrations.trl: %s has no %s method (written against trl 1.16's "
                        "GRPOTrainer)" % (type(trainer).__name__, _METHOD))
    if getattr(original, _PATCHED, False):
        return trainer
    args = getattr(trainer, "args", None)
    refuse = [
        (getattr(args, "use_liger_kernel", False), "use_liger_kernel=True (Liger computes the loss "
                                                   "without this method)"),
        (getattr(trainer, "aux_loss_enabled", False), "a MoE router auxiliary loss (it depends on "
                                                      "every replicated row)"),
        (getattr(trainer, "_is_vlm", False), "a vision-language model (multimodal inputs)"),
        (getattr(trainer, "use_transformers_continuous_batching", False),
         "use_transformers_continuous_batching=True (generate_batch would run forkattn's attention)"),
    ]
    for bad, what in refuse:
        if bad:
            raise Unsupported("forkattn.integrations.trl: packed log-probs do not support %s" % what)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            use_forkattn(model)

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                        compute_entropy=False, compute_aux_loss=False, **extra):
        used = sorted(k for k, v in extra.items() if v is not None)
        if compute_aux_loss or used:
            raise Unsupported("forkattn.integrations.trl: packed log-probs do not support %s"
                              % ("the MoE auxiliary loss" if compute_aux_loss
                                 else "multimodal / token-type inputs (%s)" % ", ".join(used)))
        return _packed_chunks(trainer, model, input_ids, attention_mask, logits_to_keep,
                              batch_size, compute_entropy)

    setattr(per_token_logps, _PATCHED, True)
    setattr(trainer, _METHOD, per_token_logps)
    return trainer


def _packed_chunks(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                   compute_entropy):
    """TRL's chunking (``batch_size`` rows per forward, to bound memory), each chunk packed."""
    B = input_ids.shape[0]
    step = batch_size or B or 1
    temperature = getattr(trainer, "temperature", 1.0)
    logps, ents = [], []
    for s in range(0, B, step):
        with trainer.accelerator.autocast():
            lp, en = packed_per_token_logps(model, input_ids[s:s + step], attention_mask[s:s + step],
                                            logits_to_keep, temperature, compute_entropy)
        logps.append(lp)
        ents.append(en)
    return (torch.cat(logps), torch.cat(ents) if compute_entropy else None, None)
