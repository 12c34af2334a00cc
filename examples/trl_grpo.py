#!/usr/bin/env python3
"""TRL's GRPOTrainer with forkattn: each prompt's rows computed once per group.

Trains a tiny randomly initialised Qwen2 (no download) for a few GRPO steps twice, from the same
seed: as TRL ships it, and with ``forkattn.integrations.trl.patch_grpo_trainer(trainer)``, which
computes the policy's, the old policy's and the reference model's per-token log-probs on packed
rows (each prompt once, its completions after it) through forkattn's attention. It prints both
runs' losses and the forkattn calls the patched run made, and exits 1 unless the losses agree
(float32, 1e-5 relative) and forkattn ran. CPU, about a minute.

    pip install . trl          # from the repository root (trl brings transformers and datasets)
    python3 examples/trl_grpo.py [--steps N]

In a real run the one line is all that changes:

    trainer = trl.GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    forkattn.integrations.trl.patch_grpo_trainer(trainer)
    trainer.train()
"""
import argparse
import os
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

try:
    import datasets
    import torch
    import transformers
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
except ImportError as e:
    sys.exit("trl_grpo.py needs torch, transformers and trl (pip install trl): %s" % e)

import forkattn
import forkattn.ops
from forkattn.integrations import trl as fa_trl

WORDS = ["w%d" % i for i in range(12)]
TOL = 1e-5


def tiny_model(path):
    """A 2-layer Qwen2 (hidden 32, 4 query / 2 KV heads) saved to ``path``, and a word-level
    tokenizer over WORDS (TRL builds the reference model from the path)."""
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
    transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").save_pretrained(path)
    return tok


def distinct_words(completions, **kw):
    """The reward: distinct words in a completion (it differs within a group)."""
    return [float(len(set(c.split()))) for c in completions]


def train(path, tok, out, steps, packed):
    """The losses of ``steps`` GRPO steps (4 prompts x 4 completions), and the forkattn calls."""
    ds = datasets.Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3 + 2 * (i % 3)]) for i in range(4)]})
    with warnings.catch_warnings():  # TRL's and transformers' deprecation notices
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
                              max_completion_length=8, max_steps=steps, learning_rate=1e-2, beta=0.1,
                              temperature=0.7, num_iterations=2, steps_per_generation=1,
                              logging_strategy="no", disable_tqdm=True, save_strategy="no", report_to=[],
                              use_cpu=True, seed=1,
                              bf16=False, fp16=False, dataloader_num_workers=0,
                              model_init_kwargs={"attn_implementation": "sdpa", "dtype": torch.float32})
        trainer = trl.GRPOTrainer(model=path, reward_funcs=distinct_words, args=args, train_dataset=ds,
                                  processing_class=tok)
    if packed:
        fa_trl.patch_grpo_trainer(trainer)
    losses, calls = [], [0]
    compute_loss, attention = trainer.compute_loss, forkattn.ops.prefix_attention

    def recorded_loss(*a, **k):
        loss = compute_loss(*a, **k)
        losses.append(float(loss))
        return loss

    def counted(*a, **k):
        calls[0] += 1
        return attention(*a, **k)

    trainer.compute_loss = recorded_loss
    forkattn.ops.prefix_attention = counted
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        forkattn.ops.prefix_attention = attention
    return losses, calls[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    print("forkattn %s (%s), trl %s, transformers %s, torch %s"
          % (forkattn.__version__, forkattn.library_path(), trl.__version__, transformers.__version__,
             torch.__version__))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny_qwen2")
        tok = tiny_model(path)
        stock, stock_calls = train(path, tok, os.path.join(tmp, "stock"), a.steps, packed=False)
        packed, calls = train(path, tok, os.path.join(tmp, "packed"), a.steps, packed=True)
    print("step  loss (TRL as shipped)  loss (packed, forkattn)")
    for i, (s, p) in enumerate(zip(stock, packed)):
        print("%4d  %21.8f  %23.8f" % (i + 1, s, p))
    worst = max((abs(p - s) / max(1.0, abs(s)) for s, p in zip(stock, packed)), default=float("inf"))
    print("forkattn attention calls: %d packed, %d stock; largest loss difference %.2e (tolerance %.0e)"
          % (calls, stock_calls, worst, TOL))
    ok = len(stock) == len(packed) == a.steps and calls > 0 and stock_calls == 0 and worst <= TOL
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
