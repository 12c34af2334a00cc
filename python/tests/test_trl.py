"""forkattn.integrations.trl: TRL's GRPOTrainer computing per-token log-probs on packed rows.

A tiny randomly initialised Qwen2 (saved locally: TRL builds the reference model from a path)
and a word-level tokenizer built here; no download. The packed log-probs must equal the
trainer's own (fused LM head on the replicated padded batch) within 1e-5 normwise relative in
float32, directly on fixed prompts/completions and along two real GRPO steps (policy, old and
reference log-probs, loss), and the packed run must go through forkattn. Skipped without trl."""

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl)")
datasets = pytest.importorskip("datasets", reason="datasets (a trl dependency) is not installed")

import forkattn.ops  # noqa: E402
from forkattn.integrations import trl as fa_trl  # noqa: E402
from conftest import rel_err  # noqa: E402

TOL = 1e-5
WORDS = ["w%d" % i for i in range(12)]  # a small vocabulary: <eos> often ends a completion early
G = 4  # completions per prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen2 (hidden 32, GQA) saved to a directory, and a word-level tokenizer (passed
    to the trainer: AutoProcessor would load Qwen2's own tokenizer class)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>", padding_side="left")
    cfg = transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, intermediate_size=64, vocab_size=len(vocab),
                                   max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    d = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(d)
    return str(d), tok


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


@pytest.fixture
def count_calls(monkeypatch):
    """Counts forkattn.prefix_attention calls made by forkattn.hf's attention function."""
    calls = []
    real = forkattn.ops.prefix_attention

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(forkattn.ops, "prefix_attention", counted)
    return calls


def _reward(completions, **kw):
    # a reward that differs within each group: the number of distinct words
    return [float(len(set(c.split()))) for c in completions]


def _trainer(model_dir, tmp_path, beta=0.1, temperature=0.7, steps=2):
    path, tok = model_dir
    # fresh configs: from_pretrained per trainer, so policy and reference share no config object
    ds = datasets.Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3 + 2 * (i % 3)]) for i in range(4)]})
    with warnings.catch_warnings():  # TRL's and transformers' deprecation notices
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=G,
                              max_completion_length=8, max_steps=steps, learning_rate=1e-2, beta=beta,
                              temperature=temperature, num_iterations=2, steps_per_generation=1,
                              gradient_accumulation_steps=1, logging_steps=1, save_strategy="no",
                              report_to=[], use_cpu=True, seed=1, bf16=False, fp16=False,
                              dataloader_num_workers=0,
                              model_init_kwargs={"attn_implementation": "sdpa", "dtype": torch.float32})
        return trl.GRPOTrainer(model=path, reward_funcs=_reward, args=args, train_dataset=ds,
                               processing_class=tok)


def _batch(gen, vocab, groups=3, Lp=7, K=6):
    """Left-padded prompts (different lengths) repeated G times, right-padded completions
    (different lengths, one empty), the trainer's concatenation."""
    ids, am = [], []
    for g in range(groups):
        p = Lp - 2 * g
        prompt = torch.randint(3, vocab, (p,), generator=gen)
        for i in range(G):
            r = (K - i) if (g, i) != (1, 3) else 0
            row = torch.zeros(Lp + K, dtype=torch.long)
            m = torch.zeros(Lp + K, dtype=torch.long)
            row[Lp - p:Lp] = prompt
            m[Lp - p:Lp] = 1
            row[Lp:Lp + r] = torch.randint(3, vocab, (r,), generator=gen)
            m[Lp:Lp + r] = 1
            ids.append(row)
            am.append(m)
    ids, am = torch.stack(ids), torch.stack(am)
    perm = torch.randperm(ids.shape[0], generator=gen)  # groups need not be consecutive
    return ids[perm], am[perm], K


def test_packed_logps_match_trainer(model_dir, tmp_path, count_calls):
    tr = _trainer(model_dir, tmp_path)
    gen = torch.Generator().manual_seed(3)
    ids, am, K = _batch(gen, tr.model.config.vocab_size)
    for model in (tr.model, tr.ref_model):  # the reference model's fused head has no entropy
        ent_too = model is tr.model
        ref_lp, ref_ent, _ = tr._get_per_token_logps_and_entropies(model, ids, am, K, compute_entropy=ent_too)
        with pytest.raises(ValueError, match="not to forkattn"):  # still sdpa: refused, not mixed
            fa_trl.packed_per_token_logps(model, ids, am, K)
        fa_trl.use_forkattn(model)
        n0 = len(count_calls)
        lp, ent = fa_trl.packed_per_token_logps(model, ids, am, K, tr.temperature, compute_entropy=ent_too)
        assert len(count_calls) - n0 == model.config.num_hidden_layers
        # packed: 3 prompts once + completions, not 12 prompts
        assert count_calls[-1][0] == int(am[:, :7].sum()) // G + int(am[:, 7:].sum())
        assert lp.shape == ref_lp.shape == (ids.shape[0], K)
        assert torch.equal(lp == 0, ref_lp == 0)  # the same padding
        assert rel_err(lp, ref_lp) < TOL
        if ent_too:
            assert rel_err(ent, ref_ent) < TOL
            policy_lp = ref_lp
    # the patched method, chunked as the trainer calls it (chunks split groups)
    fa_trl.patch_grpo_trainer(tr)
    n0 = len(count_calls)
    lp5, ent5, aux = tr._get_per_token_logps_and_entropies(tr.model, ids, am, K, batch_size=5)
    assert len(count_calls) - n0 == 3 * tr.model.config.num_hidden_layers  # 12 rows in chunks of 5
    assert ent5 is None and aux is None
    assert rel_err(lp5, policy_lp) < TOL


def _train(model_dir, tmp_path, packed):
    """Two GRPO steps (one generation, two iterations over it: old, reference and policy
    log-probs all computed); every log-prob call's result and every loss recorded."""
    tr = _trainer(model_dir, tmp_path)
    if packed:
        fa_trl.patch_grpo_trainer(tr)
    logps, losses, masks = [], [], []
    inner, compute_loss = tr._get_per_token_logps_and_entropies, tr.compute_loss

    def recorded_logps(*a, **k):
        out = inner(*a, **k)
        logps.append(out[0].detach().clone())
        masks.append(a[2][:, -a[3]:].clone())
        return out

    def recorded_loss(*a, **k):
        loss = compute_loss(*a, **k)
        losses.append(float(loss))
        return loss

    tr._get_per_token_logps_and_entropies = recorded_logps
    tr.compute_loss = recorded_loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.train()
    gc = bool(tr.args.gradient_checkpointing)
    return logps, losses, masks, gc


def test_grpo_steps_match(model_dir, tmp_path, count_calls):
    ref_logps, ref_losses, ref_masks, _ = _train(model_dir, tmp_path / "stock", packed=False)
    assert not count_calls
    logps, losses, masks, gc = _train(model_dir, tmp_path / "packed", packed=True)
    # per layer: old and reference log-probs, then in each step the loss's forward (and its
    # recomputation in backward with gradient checkpointing, on by default in TRL)
    assert len(count_calls) == 2 * (2 + 2 * (1 + gc))
    assert len(logps) == len(ref_logps) == 4 and len(losses) == len(ref_losses) == 2
    for m, ref in zip(masks, ref_masks):
        assert torch.equal(m, ref)  # the same completions
    assert not bool(masks[0].all())  # some ended early: completion padding exercised
    for lp, ref in zip(logps, ref_logps):
        assert lp.shape == ref.shape and rel_err(lp, ref) < TOL
    for loss, ref in zip(losses, ref_losses):
        assert abs(loss - ref) <= TOL * max(1.0, abs(ref))
    assert ref_losses[1] != ref_losses[0]  # the second step saw updated weights


def test_refused(model_dir, tmp_path, count_calls):
    tr = fa_trl.patch_grpo_trainer(_trainer(model_dir, tmp_path))
    gen = torch.Generator().manual_seed(5)
    ids, am, K = _batch(gen, tr.model.config.vocab_size, groups=2)
    call = tr._get_per_token_logps_and_entropies
    with pytest.raises(fa_trl.Unsupported, match="multimodal"):
        call(tr.model, ids, am, K, pixel_values=torch.zeros(1, 3))
    with pytest.raises(fa_trl.Unsupported, match="auxiliary"):
        call(tr.model, ids, am, K, compute_aux_loss=True)
    gap = am.clone()
    gap[0, -K - 1] = 0  # a gap before the completion: the packed positions would differ
    with pytest.raises(fa_trl.Unsupported, match="not left-padded"):
        call(tr.model, ids, gap, K)
    gap = am.clone()
    gap[:, -K] = 0  # a gap at the start of the completions
    with pytest.raises(fa_trl.Unsupported, match="not right-padded"):
        call(tr.model, ids, gap, K)
    assert not count_calls
    liger = _trainer(model_dir, tmp_path)
    liger.args.use_liger_kernel = True  # set after construction: Liger itself need not be installed
    with pytest.raises(fa_trl.Unsupported, match="use_liger_kernel"):
        fa_trl.patch_grpo_trainer(liger)
