#!/usr/bin/env python3
"""One GRPO policy step on a small randomly initialised Hugging Face causal LM, twice:

  * forkattn: the group packed (each prompt once, P + sum(R) rows) and run through the
    "forkattn" attention implementation (forkattn.hf), layout from the trainer's batch;
  * stock:    the replicated padded batch [B, P + R_max] through stock attention (sdpa or eager).

Both compute per-token log-probs of the responses, group-normalised advantages from synthetic
rewards, the PPO-clip policy-gradient loss (token mean), backward and an AdamW step. The
script prints the log-prob and gradient differences (first timed step) and, for each run, the
median step time over --steps timed steps after --warmup untimed ones, with the fastest and
slowest step, and the peak memory. Each run is measured in its own subprocess (peak RSS growth
over the timed steps on the CPU, reset through /proc/self/clear_refs;
torch.cuda.max_memory_allocated on CUDA); the model weights and the batch are made once here
and handed to both.

No download: the model is built from a config (LlamaConfig / Qwen2Config). Needs torch,
transformers (pip install transformers) and forkattn (pip install . from the repository root, or a
source checkout with build/ or FORKATTN_LIBRARY).

  python3 examples/grpo_step.py                       # small defaults, ~30 s on 2 CPU cores
  python3 examples/grpo_step.py --prompt 2048 --rmax 1024 --hidden 512 --layers 4
  python3 examples/grpo_step.py --device cuda --dtype bfloat16   # needs an offload build
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="One GRPO policy step with forkattn (packed shared prompt) vs stock attention "
                    "(replicated padded batch) on a small config-built HF model: log-probs, "
                    "gradients, time and peak memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("group")
    g.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    g.add_argument("--n", type=int, default=8, help="responses per prompt")
    g.add_argument("--rmin", type=int, default=64, help="shortest response")
    g.add_argument("--rmax", type=int, default=256, help="longest response (lengths spread evenly)")
    g.add_argument("--groups", type=int, default=1, help="prompts (groups) in the batch")
    m = p.add_argument_group("model")
    m.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    m.add_argument("--hidden", type=int, default=256, help="hidden size")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--heads", type=int, default=4, help="query heads")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    m.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2*hidden)")
    m.add_argument("--vocab", type=int, default=2048)
    r = p.add_argument_group("run")
    r.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    r.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    r.add_argument("--ref-attn", choices=("sdpa", "eager"), default="sdpa",
                   help="stock attention of the replicated run")
    r.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    r.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    r.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    r.add_argument("--verify", action="store_true",
                   help="also run forkattn.hf's verify mode (first attention call vs SDPA per sequence)")
    p.add_argument("--worker", choices=("forkattn", "stock"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rmin < 1 or a.rmax < a.rmin or a.prompt < 1 or a.n < 1 or a.groups < 1:
        p.error("need 1 <= rmin <= rmax, prompt >= 1, n >= 1, groups >= 1")
    if a.steps < 1 or a.warmup < 0:
        p.error("need steps >= 1, warmup >= 0")
    return a


def _imports():
    import importlib.util
    if importlib.util.find_spec("forkattn") is None:    # a source checkout, not installed
        sys.path.insert(0, os.path.join(REPO, "python"))
    import torch
    import transformers
    import forkattn
    import forkattn.hf
    return torch, transformers, forkattn


def build_model(a, attn, torch, transformers):
    common = dict(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  num_hidden_layers=a.layers, intermediate_size=a.intermediate or 2 * a.hidden,
                  vocab_size=a.vocab, max_position_embeddings=max(4096, a.prompt + a.rmax),
                  tie_word_embeddings=False)
    cfg = (transformers.LlamaConfig if a.arch == "llama" else transformers.Qwen2Config)(**common)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def response_lengths(a):
    if a.n == 1:
        return [a.rmax]
    return [round(a.rmin + (a.rmax - a.rmin) * i / (a.n - 1)) for i in range(a.n)]


# --------------------------------------------------------------------------------------------
# parent: make weights + batch, run both workers, compare


def make_setup(a, path):
    torch, transformers, _ = _imports()
    torch.manual_seed(a.seed)
    model = build_model(a, "sdpa", torch, transformers)
    g = torch.Generator().manual_seed(a.seed + 1)
    P, lens = a.prompt, response_lengths(a)
    Lr = max(lens)
    rows = [(gi, r) for gi in range(a.groups) for r in lens]
    B, L = len(rows), P + Lr
    ids = torch.zeros(B, L, dtype=torch.long)
    pm = torch.zeros(B, L, dtype=torch.bool)
    rm = torch.zeros(B, L, dtype=torch.bool)
    prompts = [torch.randint(1, a.vocab, (P,), generator=g) for _ in range(a.groups)]
    for b, (gi, r) in enumerate(rows):
        ids[b, :P] = prompts[gi]
        pm[b, :P] = True
        ids[b, P:P + r] = torch.randint(1, a.vocab, (r,), generator=g)
        rm[b, P:P + r] = True
    # synthetic rewards -> group-normalised advantages (GRPO)
    rewards = torch.rand(B, generator=g)            # e.g. partial credit in [0, 1)
    grp = torch.tensor([gi for gi, _ in rows])
    adv = torch.zeros(B)
    for gi in range(a.groups):
        m = grp == gi
        adv[m] = (rewards[m] - rewards[m].mean()) / (rewards[m].std() + 1e-6)
    uid = ["prompt-%d" % gi for gi, _ in rows]
    torch.save({"state_dict": model.state_dict(), "ids": ids, "prompt_mask": pm, "response_mask": rm,
                "uid": uid, "rewards": rewards, "adv": adv, "P": P, "Lr": Lr}, path)
    return dict(B=B, L=L, lens=lens, rewards=rewards.tolist(), adv=adv.tolist())


def run_worker(mode, a, workdir, argv):
    cmd = [sys.executable, os.path.abspath(__file__)] + list(argv) + ["--worker", mode, "--workdir", workdir]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit("grpo_step.py: the %s run failed (exit %d)" % (mode, r.returncode))
    if r.stderr.strip():
        # verify-mode log lines and library notes; transformers' warnings are dropped
        for line in r.stderr.splitlines():
            if line.startswith("forkattn"):
                print("  [%s] %s" % (mode, line))
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="grpo_step.") as wd:
        info = make_setup(a, os.path.join(wd, "setup.pt"))
        res = {m: run_worker(m, a, wd, argv) for m in ("forkattn", "stock")}
        import torch
        fa = torch.load(os.path.join(wd, "forkattn.pt"))
        st = torch.load(os.path.join(wd, "stock.pt"))
    report(a, info, res, fa, st, time.time() - t_start)
    return 0


def _rel(x, ref):
    den = ref.abs().max().item()
    return (x - ref).abs().max().item() / (den if den > 0 else 1.0)


def report(a, info, res, fa, st, total):
    f, s = res["forkattn"], res["stock"]
    lens = info["lens"]
    d = a.hidden // a.heads
    print("GRPO policy step: %s, hidden %d, %d layers, %d/%d heads (d=%d), vocab %d, %s on %s "
          "(forkattn backend: %s)" % (a.arch, a.hidden, a.layers, a.heads, a.kv_heads, d, a.vocab, a.dtype,
                                      f["device"], f["backend"]))
    print("batch: %d group(s) x (prompt %d + %d responses of %d..%d tokens): replicated padded [%d, %d] "
          "= %d rows, packed %d rows (%.2fx dedup vs unpadded)"
          % (a.groups, a.prompt, a.n, min(lens), max(lens), info["B"], info["L"], info["B"] * info["L"],
             f["rows"], f["dedup"]))
    print("rewards %s -> advantages %s" % (
        " ".join("%.2f" % x for x in info["rewards"][:a.n]),
        " ".join("%+.2f" % x for x in info["adv"][:a.n])) + (" (group 0)" if a.groups > 1 else ""))
    print()
    w = 28
    print("%-24s %*s %*s" % ("", w, "forkattn (packed)", w, "stock %s (replicated)" % a.ref_attn))
    print("%-24s %*.3f %*.3f   stock/forkattn %.2fx" % (
        "step time (s), median", w, f["t_step"], w, s["t_step"], s["t_step"] / f["t_step"]))
    print("%-24s %*s %*s" % ("  fastest .. slowest", w, "%.3f .. %.3f" % (f["t_min"], f["t_max"]),
                             w, "%.3f .. %.3f" % (s["t_min"], s["t_max"])))
    print("%-24s %*s %*s" % ("  forward / backward+opt", w, "%.3f / %.3f" % (f["t_fwd"], f["t_bwd"]),
                             w, "%.3f / %.3f" % (s["t_fwd"], s["t_bwd"])))
    print("%-24s %*s" % ("  timed steps", w, "%d after %d warm-up, each run" % (a.steps, a.warmup)))
    mem_f, mem_s = f["peak_mib"], s["peak_mib"]
    print("%-24s %*.1f %*.1f   stock/forkattn %.2fx" % ("peak memory (MiB)", w, mem_f, w, mem_s,
                                             mem_s / mem_f if mem_f > 0 else float("nan")))
    print("%-24s %*s %*s" % ("  measured as", w, f["mem_how"], w, s["mem_how"]))
    print("%-24s %*.6f %*.6f" % ("loss (first timed step)", w, f["loss"], w, s["loss"]))
    print()
    mask = fa["mask"]
    lp_f, lp_s = fa["logp"][mask], st["logp"][mask]
    print("log-probs of %d response tokens: max abs diff %.3g, normwise rel diff %.3g (mean logp %.4f)"
          % (lp_f.numel(), (lp_f - lp_s).abs().max().item(), _rel(lp_f, lp_s), lp_s.mean().item()))
    worst, worst_name, wabs = 0.0, "", 0.0
    for n, gs in st["grads"].items():
        gf = fa["grads"][n]
        e = _rel(gf, gs)
        wabs = max(wabs, (gf - gs).abs().max().item())
        if e >= worst:
            worst, worst_name = e, n
    print("gradients of %d parameter tensors: max abs diff %.3g, worst normwise rel diff %.3g (%s)"
          % (len(st["grads"]), wabs, worst, worst_name))
    print("(wall time of this script, both subprocesses included: %.1f s)" % total)


# --------------------------------------------------------------------------------------------
# worker: one measured run


def _rss_reset():
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); returns the current RSS in bytes or
    None when unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _proc_status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def worker(a):
    torch, transformers, forkattn = _imports()
    import logging
    logging.basicConfig(format="%(message)s")
    transformers.logging.set_verbosity_error()
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    cuda = dev.type == "cuda"
    if a.worker == "forkattn":
        forkattn.hf.register(verify=a.verify)
        attn = "forkattn"
    else:
        attn = a.ref_attn
    s = torch.load(os.path.join(a.workdir, "setup.pt"))
    model = build_model(a, attn, torch, transformers)
    model.load_state_dict(s["state_dict"])
    model.to(device=dev, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    ids, pm, rm = s["ids"], s["prompt_mask"], s["response_mask"]
    adv = s["adv"].to(dev)
    P, Lr = s["P"], s["Lr"]
    B = ids.shape[0]
    tgt = ids[:, P:P + Lr].to(dev)
    mask = rm[:, P:P + Lr].to(dev)
    ids_d = ids.to(dev)
    am = (pm | rm).to(dev)
    pos = (am.long().cumsum(1) - 1).clamp(min=0)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def step(record):
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        if a.worker == "forkattn":
            layout = forkattn.SharedPrefixLayout.from_uid(s["uid"], pm, rm, input_ids=ids)
            logits = model(**forkattn.hf.packed_inputs(model, layout, ids_d)).logits[0]   # [T, V]
            lg = layout.unpack_responses(logits, Lr, shift=True)                   # [B, Lr, V]
            extra = dict(rows=layout.num_rows, dedup=layout.dedup_ratio)
        else:
            logits = model(input_ids=ids_d, attention_mask=am.long(), position_ids=pos,
                           use_cache=False).logits                                 # [B, L, V]
            lg = logits[:, P - 1:P + Lr - 1]
            extra = dict(rows=B * ids.shape[1], dedup=1.0)
        logp = torch.log_softmax(lg.float(), -1).gather(-1, tgt[..., None])[..., 0]  # [B, Lr]
        old = logp.detach()                      # on-policy: the rollout policy is this one
        ratio = torch.exp(logp - old)
        A = adv[:, None]
        pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - a.clip, 1 + a.clip))
        loss = torch.where(mask, pg, torch.zeros_like(pg)).sum() / mask.sum()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        sync()
        t2 = time.perf_counter()
        out = dict(t_fwd=t1 - t0, t_bwd=t2 - t1, t_step=t2 - t0, loss=loss.item(), **extra)
        if record:  # after the clock: the step's gradients are still in .grad
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
            out["_save"] = dict(logp=logp.detach().float().cpu(), mask=mask.cpu(), grads=grads)
        return out

    # warm-up steps (library loading, thread pools, allocator) from a copy of the state
    init_model = {k: v.clone() for k, v in model.state_dict().items()}
    init_opt = opt.state_dict()
    for _ in range(a.warmup):
        step(False)
    if a.warmup:
        model.load_state_dict(init_model)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        opt.load_state_dict(init_opt)
    del init_model
    # the timed steps: the first from the initial state (compared between the runs), the others
    # continue training
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _rss_reset()
        if base is None:
            import resource
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steps = [step(i == 0) for i in range(a.steps)]
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev) - base
        how = "cuda max_memory_allocated"
    else:
        hwm = _proc_status("VmHWM")
        if hwm is None:
            import resource
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            how = "ru_maxrss growth"
        else:
            how = "peak RSS growth"
        peak = hwm - base
    save = steps[0].pop("_save")
    out = dict(steps[0])
    out.update({k: statistics.median(x[k] for x in steps) for k in ("t_fwd", "t_bwd", "t_step")})
    out.update(t_min=min(x["t_step"] for x in steps), t_max=max(x["t_step"] for x in steps))
    torch.save(save, os.path.join(a.workdir, a.worker + ".pt"))
    out.update(peak_mib=peak / 2**20, mem_how=how, device=str(dev),
               backend=forkattn.backend((dev.index if dev.index is not None else torch.cuda.current_device()) if cuda else None) if a.worker == "forkattn" else "-")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
