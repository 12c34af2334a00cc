"""forkattn.hf: the "forkattn" attention implementation of Hugging Face transformers.

Small randomly initialised models built from configs (no download). The packed call through
forkattn must give the logits and parameter gradients of the stock attention (sdpa / eager) on
the replicated padded batch: normwise relative error (max |diff| / max |ref|) <= 1e-5 in float32
(measured: about 3e-7 for logits, 1e-6 for gradients). Skipped without transformers."""

import contextlib
import copy
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
try:
    import transformers
except Exception as _e:  # not installed, or broken against this torch
    pytest.skip("transformers is not importable (%s)" % _e, allow_module_level=True)
if not hasattr(transformers, "AttentionInterface"):  # pragma: no cover
    pytest.skip("transformers %s has no AttentionInterface" % transformers.__version__,
                allow_module_level=True)

import forkattn  # noqa: E402
import forkattn.hf as fhf  # noqa: E402
from conftest import rel_err  # noqa: E402

TOL = 1e-5  # float32, normwise relative (logits and every parameter's gradient)
V = 128


def _config(arch):
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=128, vocab_size=V, max_position_embeddings=256)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)


def _models(arch, ref_impl, seed=0):
    """(stock model, forkattn model) with the same weights; separate configs (from_config sets
    the attention implementation on the config object)."""
    cfg = _config(arch)
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=ref_impl)
    fa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="forkattn")
    fa.load_state_dict(ref.state_dict())
    assert fa.config._attn_implementation == "forkattn" and ref.config._attn_implementation == ref_impl
    return ref.float().eval(), fa.float().eval()


@pytest.fixture(autouse=True)
def registered():
    fhf.register(verify=False)
    yield
    fhf.register(verify=False)


def grpo_batch(prompt_lens, response_lens, seed=1):
    """A verl-style batch: left-padded prompts in columns [0, Lp), right-padded responses in
    [Lp, Lp + Lr); groups interleaved in the batch. Returns uid, ids, prompt/response masks."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V, (p,), generator=g) for p in prompt_lens]
    rows = [(gi, r) for gi, rl in enumerate(response_lens) for r in rl]
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]
    Lp, Lr = max(prompt_lens), max(r for _, r in rows)
    B = len(rows)
    ids = torch.zeros(B, Lp + Lr, dtype=torch.long)
    pm = torch.zeros(B, Lp + Lr, dtype=torch.bool)
    rm = torch.zeros_like(pm)
    for b, (gi, r) in enumerate(rows):
        p = prompts[gi]
        ids[b, Lp - len(p):Lp] = p
        pm[b, Lp - len(p):Lp] = True
        ids[b, Lp:Lp + r] = torch.randint(1, V, (r,), generator=g)
        rm[b, Lp:Lp + r] = True
    uid = ["q%d" % gi for gi, _ in rows]
    return uid, ids, pm, rm, Lp, Lr


def _param_grad_errors(ref, fa):
    errs = {}
    for (n, p1), (n2, p2) in zip(ref.named_parameters(), fa.named_parameters()):
        assert n == n2
        assert p1.grad is not None and p2.grad is not None, n
        errs[n] = rel_err(p2.grad, p1.grad)
    return errs


@pytest.mark.parametrize("arch,ref_impl", [("llama", "sdpa"), ("qwen2", "eager")])
def test_grpo_group_matches_replicated_batch(arch, ref_impl):
    # 2 groups, prompts of 7 and 12 tokens, 3 and 4 responses of different lengths (two of 1)
    uid, ids, pm, rm, Lp, Lr = grpo_batch([7, 12], [[5, 1, 9], [3, 8, 1, 6]])
    B = ids.shape[0]
    ref, fa = _models(arch, ref_impl)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(3))

    # stock attention on the replicated padded batch
    am = pm | rm
    pos = (am.long().cumsum(1) - 1).clamp(min=0)
    logits_ref = ref(input_ids=ids, attention_mask=am.long(), position_ids=pos).logits
    lg_ref = logits_ref[:, Lp - 1:Lp + Lr - 1]          # the logits that predict each response token
    tgt = ids[:, Lp:]
    mask = rm[:, Lp:]

    # forkattn on the packed rows
    layout = forkattn.SharedPrefixLayout.from_uid(uid, pm, rm, input_ids=ids)
    assert layout.num_rows == 7 + 12 + 5 + 1 + 9 + 3 + 8 + 1 + 6
    kw = fhf.packed_inputs(fa, layout, ids)
    assert kw["input_ids"].shape == (1, layout.num_rows)
    logits = fa(**kw).logits
    assert logits.shape == (1, layout.num_rows, V)
    lg = layout.unpack_responses(logits[0], Lr, shift=True)
    assert torch.equal(layout.response_mask(Lr), mask)

    assert rel_err(lg[mask], lg_ref[mask]) <= TOL
    # the prompt rows too (every copy of a prompt in the replicated batch)
    full = layout.unpack(logits[0], ids.shape[1])
    assert rel_err(full[am], logits_ref[am]) <= TOL

    def loss(lgt):  # token-level policy-gradient loss
        logp = torch.log_softmax(lgt.float(), -1).gather(-1, tgt[..., None])[..., 0]
        return -torch.where(mask, logp * adv[:, None], torch.zeros_like(logp)).sum() / mask.sum()

    loss(lg_ref).backward()
    loss(lg).backward()
    errs = _param_grad_errors(ref, fa)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])


def test_tree_layout_matches_per_sequence_runs():
    # sequences sharing prefixes at several depths: a root of 6 tokens, a branch of 4 shared by
    # three sequences, then branches of 3 / 5 / 1 tokens, one sequence a prefix of another
    toks = (torch.randperm(V - 1, generator=torch.Generator().manual_seed(5)) + 1).split([6, 4, 3, 5, 2, 1, 106])
    root, a, b, c, d, e = toks[:6]  # distinct tokens: branches differ at their first token
    seqs = [torch.cat([root, a, b]), torch.cat([root, a, c]), torch.cat([root, d]),
            torch.cat([root, a, b, e]), torch.cat([root, a, torch.tensor([0])])]
    layout = forkattn.TreeLayout.from_sequences(seqs)
    assert layout.num_rows == 6 + 4 + 3 + 5 + 2 + 1 + 1
    ref, fa = _models("llama", "sdpa", seed=2)

    logits = fa(**fhf.packed_inputs(fa, layout)).logits[0]
    per_seq = layout.gather_sequences(logits, padded=False)
    loss_fa = 0
    loss_ref = 0
    for s, lg in zip(seqs, per_seq):
        lg_ref = ref(input_ids=s[None]).logits[0]
        assert rel_err(lg, lg_ref) <= TOL
        w = torch.linspace(-1, 1, len(s) - 1)
        loss_fa = loss_fa - (torch.log_softmax(lg[:-1], -1).gather(-1, s[1:, None])[:, 0] * w).sum()
        loss_ref = loss_ref - (torch.log_softmax(lg_ref[:-1], -1).gather(-1, s[1:, None])[:, 0] * w).sum()
    loss_ref.backward()
    loss_fa.backward()
    errs = _param_grad_errors(ref, fa)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])


def test_missing_layout_and_misuse_raise():
    _, fa = _models("llama", "sdpa")
    ids = torch.randint(1, V, (1, 10))
    with pytest.raises(ValueError, match="without the 'forkattn_layout' keyword"):
        fa(input_ids=ids)
    layout = forkattn.SharedPrefixLayout.from_lengths([4], [[3, 3]])
    kw = fhf.packed_inputs(fa, layout, torch.randint(1, V, (2, 7)))
    # no position ids (transformers would number the rows as one sequence)
    with pytest.raises(ValueError, match="without position_ids"):
        fa(input_ids=kw["input_ids"], forkattn_layout=layout, use_cache=False)
    # rows that are not the layout's
    with pytest.raises(ValueError, match="got 11 rows but the SharedPrefixLayout has 10"):
        fa(input_ids=torch.randint(1, V, (1, 11)), position_ids=torch.arange(11)[None],
           forkattn_layout=layout)
    with pytest.raises(ValueError, match="batch of 2"):
        fa(input_ids=kw["input_ids"].expand(2, -1), position_ids=kw["position_ids"].expand(2, -1),
           forkattn_layout=layout, use_cache=False)
    with pytest.raises(TypeError, match="SharedPrefixLayout or TreeLayout"):
        fa(input_ids=ids, forkattn_layout=[4, 3, 3])
    fa(**kw)  # the right call works


def _layout_and_ids():
    uid, ids, pm, rm, _, _ = grpo_batch([6, 4], [[5, 2, 7], [3, 4]], seed=11)
    return forkattn.SharedPrefixLayout.from_uid(uid, pm, rm, input_ids=ids), ids


def _reference_logits(layout, ids, ref):
    """Each sequence of the layout run alone through the stock model, scattered to packed rows."""
    packed = layout.pack(ids)
    out = torch.zeros(layout.num_rows, V)
    for rows in fhf.replicated_sequences(layout):
        out[rows] = ref(input_ids=packed[rows][None]).logits[0]
    return out


def test_shared_config_switched_to_sdpa_raises():
    # Two models built from one config object share config._attn_implementation: switching
    # the other one to sdpa switches this one too, and sdpa over the packed rows would let the
    # packed sequences attend to each other (with no error of its own).
    cfg = _config("llama")
    torch.manual_seed(0)
    fa = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="forkattn").eval()
    other = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="forkattn").eval()
    assert fa.config is other.config
    layout, ids = _layout_and_ids()
    kw = fhf.packed_inputs(fa, layout, ids)
    with torch.no_grad():
        good = fa(**kw).logits[0]
        ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
        ref.load_state_dict(fa.state_dict())
        assert rel_err(good, _reference_logits(layout, ids, ref.eval())) <= TOL

    other.set_attn_implementation("sdpa")
    assert fa.config._attn_implementation == "sdpa"
    manual = {"input_ids": kw["input_ids"], "position_ids": layout.position_ids()[None],
              "forkattn_layout": layout, "use_cache": False}
    for call in (lambda: fa(**kw), lambda: fa(**manual), lambda: fa.model(**manual),
                 lambda: fhf.packed_inputs(fa, layout, ids), lambda: fhf.check_model(fa)):
        with pytest.raises(ValueError, match="dispatches attention to 'sdpa'.*config object"):
            call()
    # the model's own call without a layout is untouched (an ordinary batch through sdpa)
    assert fa(input_ids=ids[:2]).logits.shape == (2, ids.shape[1], V)

    # one attention module with its own config, set to sdpa
    other.set_attn_implementation("forkattn")
    fa.model.layers[1].self_attn.config = copy.deepcopy(cfg)
    fa.model.layers[1].self_attn.config._attn_implementation = "sdpa"
    assert fa.config._attn_implementation == "forkattn"
    with pytest.raises(ValueError,
                       match=r"layers.1.self_attn \(LlamaAttention\) dispatches attention to 'sdpa'"):
        fhf.packed_inputs(fa, layout, ids)
    with pytest.raises(ValueError, match=r"LlamaAttention \(layer 1\) dispatches attention to 'sdpa'"):
        fa(**kw)
    fa.model.layers[1].self_attn.config = fa.config
    with torch.no_grad():
        assert torch.equal(fa(**kw).logits[0], good)


@contextlib.contextmanager
def _own_sdpa_config(module):
    """Runs ``module`` with the sdpa implementation for the duration (its own config copy)."""
    saved = module.config
    module.config = copy.deepcopy(saved)
    module.config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        module.config = saved


def test_attention_that_bypasses_forkattn_raises(monkeypatch):
    # Attention modules whose forward does not reach forkattn's function although the config
    # says forkattn: one computing SDPA itself, one that the decoder layer does not hand the
    # keyword arguments to. The call is checked afterwards: an error, not the mixed logits.
    _, fa = _models("qwen2", "sdpa")
    layout, ids = _layout_and_ids()
    kw = fhf.packed_inputs(fa, layout, ids)
    with torch.no_grad():
        good = fa(**kw).logits

    attn = fa.model.layers[0].self_attn
    real_forward = type(attn).forward

    def own_sdpa(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        saved = self.config._attn_implementation
        self.config._attn_implementation = "sdpa"
        try:
            return real_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
        finally:
            self.config._attn_implementation = saved
    monkeypatch.setattr(attn, "forward", own_sdpa.__get__(attn))
    with torch.no_grad(), pytest.raises(ValueError,
                                        match=r"Qwen2Attention \(layer 0\) did not run through forkattn"):
        fa(**kw)
    monkeypatch.undo()

    layer = fa.model.layers[1]
    real_layer_forward = type(layer).forward

    def drop_kwargs(self, hidden_states, **kwargs):
        kwargs.pop("forkattn_layout")
        with _own_sdpa_config(self.self_attn):
            return real_layer_forward(self, hidden_states, **kwargs)
    monkeypatch.setattr(layer, "forward", drop_kwargs.__get__(layer))
    with torch.no_grad(), pytest.raises(ValueError,
                                        match=r"Qwen2Attention \(layer 1\) did not run through forkattn"):
        fa(**kw)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(fa(**kw).logits, good)


def test_gradient_checkpointing_through_the_guard(monkeypatch):
    # the layers run again in backward (recomputation, outside the model call): no false
    # alarm from the post-call check, same gradients
    _, fa = _models("llama", "sdpa")
    layout, ids = _layout_and_ids()
    fa2 = copy.deepcopy(fa)
    calls = []
    real = fhf._ops.prefix_attention
    monkeypatch.setattr(fhf._ops, "prefix_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    grads, counts = [], []
    for m, ckpt in ((fa, False), (fa2, True)):
        m.train()
        if ckpt:
            (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        calls.clear()
        lg = m(**fhf.packed_inputs(m, layout, ids)).logits[0]
        (lg.float().log_softmax(-1)[:, 3] * torch.linspace(-1, 1, layout.num_rows)).sum().backward()
        grads.append([p.grad for p in m.parameters()])
        counts.append(len(calls))
    assert counts == [2, 4]  # 2 layers; each recomputed in backward with checkpointing
    assert all(rel_err(b, a) <= TOL for a, b in zip(*grads))


def test_position_ids_checked_on_every_call():
    _, fa = _models("llama", "sdpa")
    layout, ids = _layout_and_ids()
    packed = layout.pack(ids)[None]
    right = {"input_ids": packed, "position_ids": layout.position_ids()[None],
             "forkattn_layout": layout, "use_cache": False}
    with torch.no_grad():
        good = fa(**right).logits
        # the same layout again, with transformers' default positions (0..T-1): not the layout's
        without = {k: v for k, v in right.items() if k != "position_ids"}
        for bad in (without, dict(right, position_ids=torch.arange(layout.num_rows)[None])):
            with pytest.raises(ValueError, match="position_ids differ from layout.position_ids"):
                fa(**bad)
        assert torch.equal(fa(**right).logits, good)

        # through packed_inputs (the model's call checked too); a tensor changed in place after
        # an accepted call is compared again
        kw = fhf.packed_inputs(fa, layout, ids)
        assert torch.equal(fa(**kw).logits, good)
        for bad in ({k: v for k, v in kw.items() if k != "position_ids"},
                    dict(kw, position_ids=torch.arange(layout.num_rows)[None])):
            with pytest.raises(ValueError, match="position_ids"):
                fa(**bad)
        kw["position_ids"][0, -1] += 1
        with pytest.raises(ValueError, match="position_ids differ from layout.position_ids"):
            fa(**kw)
        kw["position_ids"][0, -1] -= 1
        assert torch.equal(fa(**kw).logits, good)
        assert torch.equal(layout.position_ids(), fhf.packed_inputs(fa, layout, ids)["position_ids"][0])
    # the layout still pickles and copies (the check's cache is not carried along)
    for lay2 in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout)):
        with torch.no_grad():
            assert torch.equal(fa(**fhf.packed_inputs(fa, lay2, ids)).logits, good)


def test_packed_inputs_without_model_warns():
    _, fa = _models("llama", "sdpa")
    layout, ids = _layout_and_ids()
    with pytest.warns(FutureWarning, match="cannot check that the model's attention"):
        kw = fhf.packed_inputs(layout, ids)
    assert torch.equal(kw["input_ids"], fhf.packed_inputs(fa, layout, ids)["input_ids"])
    with pytest.raises(TypeError, match="the model that will be called"):
        fhf.packed_inputs("model", layout, ids)


def test_verify_mode(caplog, monkeypatch):
    uid, ids, pm, rm, _, _ = grpo_batch([5, 9], [[4, 1], [2, 6, 3]], seed=7)
    layout = forkattn.SharedPrefixLayout.from_uid(uid, pm, rm, input_ids=ids)
    _, fa = _models("qwen2", "sdpa")
    fhf.register(verify=True)
    fhf.last_verification = None
    with caplog.at_level("WARNING", logger="forkattn.hf"):
        fa(**fhf.packed_inputs(fa, layout, ids))
        fa(**fhf.packed_inputs(fa, layout, ids))
    v = fhf.last_verification
    assert v is not None and v["ok"] and v["rel_err"] <= 1e-5 and v["sequences"] == 5
    assert "layer 0" in v["where"]
    msgs = [r.getMessage() for r in caplog.records if r.name == "forkattn.hf"]
    assert len(msgs) == 1 and "OK" in msgs[0]  # the first call only, logged once

    # the environment variable; a wrong kernel result is caught
    monkeypatch.setenv("FORKATTN_HF_VERIFY", "all")
    fhf.register()
    real = fhf._ops.prefix_attention

    def off_by_a_bit(*a, **k):
        return real(*a, **k) * 1.001
    monkeypatch.setattr(fhf._ops, "prefix_attention", off_by_a_bit)
    with pytest.raises(fhf.VerificationError, match="MISMATCH"):
        fa(**fhf.packed_inputs(fa, layout, ids))
    monkeypatch.undo()


def test_tree_verify_mode():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [9]]
    layout = forkattn.TreeLayout.from_sequences(seqs)
    _, fa = _models("llama", "sdpa")
    fhf.register(verify="all")
    fa(**fhf.packed_inputs(fa, layout))
    v = fhf.last_verification
    assert v["ok"] and v["sequences"] == 4 and "layer 1" in v["where"]


def test_import_forkattn_does_not_import_transformers():
    code = ("import sys, forkattn, forkattn.hf; assert 'transformers' not in sys.modules, 'imported'; "
            "print('ok')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
