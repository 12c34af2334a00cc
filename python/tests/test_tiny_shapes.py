"""Tiny problems (1-16 rows, 1-4 heads, head_dim 64/128, both masks) in bf16 and f16, held to
flash-attention's rule: every output's largest error against float64 is at most twice that of a
naive computation in the same precision, plus 1e-5 and flash-attention's atol (twice the rounding of
(ref + 0.3) - 0.3 - ref in the dtype: outputs this small hold whole roundings, so one element
rounded the other way must not fail a case). Summed over the sweep, per output, forkattn's largest
errors stay within twice the naive's without atol, so an error every case shares still fails.
Runs on the CPU, and on the GPU when torch sees one and the loaded library has offload (the
tensor-core kernels take these shapes there)."""

import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from conftest import abs_err, leaf64, make_qkv, prefix_sequences, replicated_reference  # noqa: E402

LAYOUTS = [  # (prompt_len, response_lens): 1 to 16 rows
    (1, [1]), (1, [0]), (0, [1]), (1, [2]), (2, [1]), (3, [5]), (4, [4, 4]), (7, [9]),
    (8, [1] * 8), (16, [0]), (5, [11]), (2, [3, 0, 2]),
]
HEADS = [(1, 1), (2, 1), (3, 3), (4, 2)]


def _devices():
    devs = ["cpu"]
    if torch.cuda.is_available() and forkattn.build_has_offload():
        devs.append("cuda")
    return devs


def _naive(q, k, v, sequences, scale, prompt_lens):
    """Attention over the replicated batch computed the plain way in q's precision (products
    rounded to it, softmax in it): the computation the rule measures against."""
    L = max(len(s) for s in sequences)
    idx = torch.zeros(len(sequences), L, dtype=torch.long)
    valid = torch.zeros(len(sequences), L, dtype=torch.bool)
    for n, s in enumerate(sequences):
        idx[n, : len(s)] = torch.tensor(s, dtype=torch.long)
        valid[n, : len(s)] = True
    idx, valid = idx.to(q.device), valid.to(q.device)
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    mask = valid[:, :, None] & valid[:, None, :]
    if prompt_lens is None:
        mask = mask & (j <= i)
    else:
        P = torch.tensor(prompt_lens, dtype=torch.long, device=q.device)[:, None, None]
        mask = mask & ((j < P) | (i >= P))
    rep = q.shape[1] // k.shape[1]
    qq, kk, vv = q[idx], k[idx].repeat_interleave(rep, 2), v[idx].repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", qq, kk) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # padded rows of the batch see nothing
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    src = {}
    for n, seq in enumerate(sequences):
        for pos, r in enumerate(seq):
            src.setdefault(r, (n, pos))
    T = q.shape[0]
    nn = torch.tensor([src[r][0] for r in range(T)], dtype=torch.long, device=q.device)
    pp = torch.tensor([src[r][1] for r in range(T)], dtype=torch.long, device=q.device)
    return o[nn, pp]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_tiny_prefix_flash_attention_rule(device, dtype, d, causal):
    failures = []
    sums = {name: [0.0, 0.0] for name in ("o", "dq", "dk", "dv")}
    for li, (P, rl) in enumerate(LAYOUTS):
        lay = forkattn.SharedPrefixLayout.from_lengths([P], [rl])
        T = lay.num_rows
        for hq, hkv in HEADS:
            q, k, v, do = make_qkv(T, hq, hkv, d, dtype, seed=1000 * li + 10 * hq + hkv + causal)
            scale = d ** -0.5
            pairs = [sp for sp in zip(*prefix_sequences([P], [len(rl)], rl)) if sp[0]]
            seqs, plens = [sp[0] for sp in pairs], [sp[1] for sp in pairs]
            # float64 reference
            q64, k64, v64 = leaf64(q, k, v)
            ro, rlse = replicated_reference(q64, k64, v64, seqs, scale, None if causal else plens)
            (ro * do.double()).sum().backward()
            ref = dict(o=ro.detach(), dq=q64.grad, dk=k64.grad, dv=v64.grad)
            # the same-precision naive computation
            qn, kn, vn = (t.to(device).detach().requires_grad_() for t in (q, k, v))
            on = _naive(qn, kn, vn, seqs, scale, None if causal else plens)
            (on * do.to(device)).sum().backward()
            naive = dict(o=on.detach(), dq=qn.grad, dk=kn.grad, dv=vn.grad)
            # forkattn
            qf, kf, vf = (t.to(device).detach().requires_grad_() for t in (q, k, v))
            out, lse = forkattn.prefix_attention(qf, kf, vf, lay, causal=causal, return_lse=True)
            (out * do.to(device)).sum().backward()
            got = dict(o=out.detach(), dq=qf.grad, dk=kf.grad, dv=vf.grad)
            for name in ("o", "dq", "dk", "dv"):
                g, n, r = got[name].cpu().double(), naive[name].cpu().double(), ref[name]
                if not torch.isfinite(g).all():
                    failures.append((P, rl, hq, hkv, name, "non-finite"))
                    continue
                e_f = (g - r).abs().max().item() if r.numel() else 0.0
                e_n = (n - r).abs().max().item() if r.numel() else 0.0
                rd = r.to(dtype)
                atol = 2 * (rd + 0.3 - 0.3 - rd).abs().max().item() if r.numel() else 0.0
                sums[name][0] += e_f
                sums[name][1] += e_n
                if e_f > 2 * e_n + atol + 1e-5:
                    failures.append((P, rl, hq, hkv, name, "forkattn %.3g > 2 x naive %.3g + atol %.3g + 1e-5" % (e_f, e_n, atol)))
            e_lse = abs_err(lse.cpu(), rlse.detach())
            if e_lse > 1e-3:
                failures.append((P, rl, hq, hkv, "lse", "abs error %.3g" % e_lse))
    for name, (s_f, s_n) in sums.items():
        if s_f > 2 * s_n:
            failures.append(("sweep", name, "largest errors sum to %.3g, over 2 x the naive's %.3g" % (s_f, s_n)))
    assert not failures, "\n".join(map(str, failures))
