"""SharedPrefixLayout constructors and helpers: from_uid / from_prefix_suffix_masks /
from_lengths, pack / unpack / unpack_responses / position_ids round trips, and a GRPO-style
end-to-end check (one attention layer) against the replicated batch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forkattn  # noqa: E402
from conftest import masked_attention_f64, rel_err  # noqa: E402

PAD = 0


def verl_batch(prompts, responses, Lp, Lr, order=None):
    """A verl-style batch: left-padded prompts in columns [0, Lp), right-padded responses in
    [Lp, Lp + Lr). Rows are (group, response) pairs, in ``order`` if given."""
    rows = [(g, p, r) for g, p in enumerate(prompts) for r in responses[g]]
    if order is not None:
        rows = [rows[i] for i in order]
    B, L = len(rows), Lp + Lr
    ids = torch.full((B, L), PAD, dtype=torch.long)
    pm = torch.zeros(B, L, dtype=torch.bool)
    rm = torch.zeros(B, L, dtype=torch.bool)
    for b, (g, p, r) in enumerate(rows):
        ids[b, Lp - len(p):Lp] = torch.tensor(p, dtype=torch.long)
        pm[b, Lp - len(p):Lp] = True
        ids[b, Lp:Lp + len(r)] = torch.tensor(r, dtype=torch.long)
        rm[b, Lp:Lp + len(r)] = True
    uid = np.array(["uid-%d" % g for g, _, _ in rows], dtype=object)
    return uid, ids, pm, rm, rows


PROMPTS = [[11, 12, 13, 14], [21, 22], [31, 32, 33]]
RESPONSES = [[[101, 102, 103], [104], [105, 106]], [[201, 202, 203, 204], []], [[301, 302]]]


def test_from_uid_pack_unpack_positions():
    order = [4, 0, 3, 1, 5, 2]  # interleaved groups
    uid, ids, pm, rm, rows = verl_batch(PROMPTS, RESPONSES, 5, 4, order)
    lay = forkattn.SharedPrefixLayout.from_uid(uid, pm, rm, input_ids=ids)
    B = len(rows)
    assert lay.batch_size == B and lay.num_responses == B
    # groups in order of first appearance, responses in batch order within a group
    first_seen = []
    for g, _, _ in rows:
        if g not in first_seen:
            first_seen.append(g)
    assert lay.num_groups == len(first_seen)
    expect, pos = [], []
    for g in first_seen:
        p = PROMPTS[g]
        expect += p
        pos += list(range(len(p)))
        for b, (gg, _, r) in enumerate(rows):
            if gg == g:
                expect += r
                pos += list(range(len(p), len(p) + len(r)))
    packed = lay.pack(ids)
    assert packed.tolist() == expect
    assert lay.position_ids().tolist() == pos
    assert lay.num_rows == len(expect)
    assert lay.dedup_ratio == pytest.approx(sum(len(PROMPTS[g]) + len(r) for g, _, r in rows) / len(expect))
    # per-token values back to the batch rows
    resp = lay.unpack_responses(packed)
    Rm = max(len(r) for _, _, r in rows)
    assert resp.shape == (B, Rm)
    m = lay.response_mask()
    for b, (_, _, r) in enumerate(rows):
        assert resp[b, :len(r)].tolist() == r and not resp[b, len(r):].any()
        assert m[b].tolist() == [True] * len(r) + [False] * (Rm - len(r))
    assert lay.unpack_responses(packed, length=6).shape == (B, 6)
    # shift=True: the row predicting each response token holds the previous token
    prev = lay.unpack_responses(packed, shift=True)
    for b, (g, p, r) in enumerate(rows):
        seq = p + r
        for j in range(len(r)):
            assert prev[b, j].item() == seq[len(p) + j - 1]
    # the whole batch view back (prompts copied to every row)
    full = lay.unpack(packed)
    assert torch.equal(full, ids * (pm | rm))
    # features [B, L, F] pack/unpack, with gradients: prompt grads go to the group's first row
    x = torch.randn(B, ids.shape[1], 3, requires_grad=True)
    px = lay.pack(x)
    assert px.shape == (lay.num_rows, 3)
    px.sum().backward()
    rep = {}
    for b, (g, _, _) in enumerate(rows):
        rep.setdefault(g, b)
    for b, (g, _, _) in enumerate(rows):
        expect_p = 1.0 if rep[g] == b else 0.0
        assert torch.all(x.grad[b][pm[b]] == expect_p)
        assert torch.all(x.grad[b][rm[b]] == 1.0)
        assert torch.all(x.grad[b][~(pm[b] | rm[b])] == 0.0)


def test_from_uid_accepts_tensor_uid_and_int_masks():
    uid, ids, pm, rm, rows = verl_batch(PROMPTS, RESPONSES, 4, 4)
    t_uid = torch.tensor([int(u.split("-")[1]) for u in uid])
    a = forkattn.SharedPrefixLayout.from_uid(t_uid, pm.int(), rm.long())
    b = forkattn.SharedPrefixLayout.from_uid(list(uid), pm, rm)
    for name in ("prompt_lens", "group_sizes", "response_lens", "batch_index"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert torch.equal(a.pack(ids), b.pack(ids))


def test_from_uid_errors():
    uid, ids, pm, rm, rows = verl_batch(PROMPTS, RESPONSES, 5, 4)
    bad = ids.clone()
    bad[1, 4] = 999  # second row of group 0: last prompt token differs
    with pytest.raises(ValueError, match="prompt tokens differ"):
        forkattn.SharedPrefixLayout.from_uid(uid, pm, rm, input_ids=bad)
    pm2 = pm.clone()
    pm2[1, 0] = True  # a longer prompt in the same group
    with pytest.raises(ValueError, match="tokens"):
        forkattn.SharedPrefixLayout.from_uid(uid, pm2, rm)
    with pytest.raises(ValueError, match="both"):
        forkattn.SharedPrefixLayout.from_uid(uid, pm | rm, rm)
    with pytest.raises(ValueError, match="before"):
        forkattn.SharedPrefixLayout.from_uid(uid, rm, pm)
    with pytest.raises(ValueError, match="uid has"):
        forkattn.SharedPrefixLayout.from_uid(uid[:-1], pm, rm)
    with pytest.raises(ValueError, match="same"):
        forkattn.SharedPrefixLayout.from_uid(uid, pm, rm[:, 5:])
    with pytest.raises(ValueError, match="pack"):
        forkattn.SharedPrefixLayout.from_uid(uid, pm, rm).pack(ids[:, :3])


def test_from_prefix_suffix_masks_matches_from_uid():
    # PrefixGrouper's view: prompts once [G, Lp] (right padded here), responses [N, Ls]
    G = len(PROMPTS)
    Lp, Ls = 6, 5
    pre = torch.zeros(G, Lp, dtype=torch.long)
    pmask = torch.zeros(G, Lp, dtype=torch.bool)
    for g, p in enumerate(PROMPTS):
        pre[g, :len(p)] = torch.tensor(p)
        pmask[g, :len(p)] = True
    resp = [r for g in range(G) for r in RESPONSES[g]]
    suf = torch.zeros(len(resp), Ls, dtype=torch.long)
    smask = torch.zeros(len(resp), Ls, dtype=torch.bool)
    for i, r in enumerate(resp):
        suf[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        smask[i, :len(r)] = True
    sizes = [len(RESPONSES[g]) for g in range(G)]
    lay = forkattn.SharedPrefixLayout.from_prefix_suffix_masks(pmask, smask, sizes)
    uid, ids, pm, rm, rows = verl_batch(PROMPTS, RESPONSES, 5, 4)
    ref = forkattn.SharedPrefixLayout.from_uid(uid, pm, rm)
    packed = lay.pack(pre, suf)
    assert torch.equal(packed, ref.pack(ids))
    assert torch.equal(lay.position_ids(), ref.position_ids())
    p2, s2 = lay.unpack(packed)
    assert torch.equal(p2, pre) and torch.equal(s2, suf)
    assert torch.equal(lay.unpack_responses(packed), ref.unpack_responses(packed))
    with pytest.raises(TypeError):
        lay.pack(pre)
    with pytest.raises(ValueError):
        forkattn.SharedPrefixLayout.from_prefix_suffix_masks(pmask, smask, 3)
    # an int group size
    lay2 = forkattn.SharedPrefixLayout.from_prefix_suffix_masks(pmask, smask, 2)
    assert lay2.group_sizes.tolist() == [2, 2, 2]


def test_from_lengths_batch_view_and_zero_lengths():
    lay = forkattn.SharedPrefixLayout.from_lengths([3, 0, 2], [[2, 0], [1], [0, 3]])
    assert lay.prompt_lens.tolist() == [3, 0, 2]
    assert lay.group_sizes.tolist() == [2, 1, 2]
    assert lay.response_lens.tolist() == [2, 0, 1, 0, 3]
    assert lay.group_offsets.tolist() == [0, 5, 6, 11]
    assert lay.response_starts.tolist() == [3, 5, 5, 8, 8]
    assert lay.position_ids().tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4]
    assert lay.seq_len == 5 and lay.batch_size == 5
    y = torch.arange(lay.num_rows) + 1
    full = lay.unpack(y)  # [5, 5]: row i = prompt then response i
    assert full.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 0, 0], [6, 0, 0, 0, 0], [7, 8, 0, 0, 0],
                             [7, 8, 9, 10, 11]]
    assert torch.equal(lay.pack(full), y)
    assert lay.unpack_responses(y).tolist() == [[4, 5, 0], [0, 0, 0], [6, 0, 0], [0, 0, 0], [9, 10, 11]]
    # shift: the first token of a response after an empty prompt has no predictor (0)
    assert lay.unpack_responses(y, shift=True).tolist() == [[3, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                                                            [8, 9, 10]]
    with pytest.raises(ValueError):
        forkattn.SharedPrefixLayout.from_lengths([3], [[]])
    with pytest.raises(ValueError):
        forkattn.SharedPrefixLayout.from_lengths([3, -1], [[1], [1]])
    with pytest.raises(ValueError):
        lay.unpack_responses(y[:-1])
    # state_dict round trip (plain integer tensors)
    again = forkattn.SharedPrefixLayout(**lay.state_dict())
    assert torch.equal(again.position_ids(), lay.position_ids())


def test_layout_pickles():
    import pickle

    uid, ids, pm, rm, rows = verl_batch(PROMPTS, RESPONSES, 5, 4)
    lay = forkattn.SharedPrefixLayout.from_uid(uid, pm, rm)
    lay2 = pickle.loads(pickle.dumps(lay))
    assert torch.equal(lay2.pack(ids), lay.pack(ids))


def test_grpo_step_matches_replicated_batch():
    """A one-layer attention 'policy' on a verl batch: per-token log-probs of the responses and
    the parameters' gradients, packed (shared prompts) vs the replicated padded batch."""
    torch.manual_seed(0)
    V, E, H, HKV, D = 400, 24, 4, 2, 8
    uid, ids, pm, rm, rows = verl_batch(PROMPTS, RESPONSES, 5, 4, order=[2, 5, 0, 1, 4, 3])
    B, L = ids.shape
    params = {
        "emb": torch.randn(V, E) * 0.5,
        "pos": torch.randn(16, E) * 0.5,
        "wq": torch.randn(E, H * D) * 0.3,
        "wk": torch.randn(E, HKV * D) * 0.3,
        "wv": torch.randn(E, HKV * D) * 0.3,
        "wo": torch.randn(H * D, V) * 0.3,
    }
    adv = torch.randn(B)

    def policy(p, tok, pos, attend):
        x = p["emb"][tok] + p["pos"][pos]
        q = (x @ p["wq"]).unflatten(-1, (H, D))
        k = (x @ p["wk"]).unflatten(-1, (HKV, D))
        v = (x @ p["wv"]).unflatten(-1, (HKV, D))
        return attend(q, k, v).flatten(-2) @ p["wo"]

    # replicated: float64, explicit causal + padding masks, positions from the masks
    p64 = {k: v.double().requires_grad_() for k, v in params.items()}
    valid = pm | rm
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    mask = valid[:, None, :] & valid[:, :, None] & causal

    def attend_rep(q, k, v):
        return masked_attention_f64(q, k, v, mask, D ** -0.5)[0]

    logits = policy(p64, ids, pos, attend_rep)  # [B, L, V]
    Lp = 5
    Rm = max(len(r) for _, _, r in rows)
    lp = torch.log_softmax(logits[:, Lp - 1:Lp - 1 + Rm], -1)
    tgt = ids[:, Lp:Lp + Rm]
    ref_lp = lp.gather(-1, tgt[..., None])[..., 0] * rm[:, Lp:Lp + Rm]
    (-(ref_lp * adv[:, None]).sum()).backward()

    # packed: from_uid -> pack -> prefix_attention -> unpack_responses(shift=True)
    p32 = {k: v.clone().requires_grad_() for k, v in params.items()}
    lay = forkattn.SharedPrefixLayout.from_uid(uid, pm, rm, input_ids=ids)
    tok = lay.pack(ids)
    logits_p = policy(p32, tok, lay.position_ids(), lambda q, k, v: forkattn.prefix_attention(q, k, v, lay))
    lg = lay.unpack_responses(logits_p, shift=True)  # [B, Rm, V]
    tgt_p = lay.unpack_responses(tok)
    got_lp = torch.log_softmax(lg, -1).gather(-1, tgt_p[..., None])[..., 0] * lay.response_mask()
    (-(got_lp * adv[:, None]).sum()).backward()

    assert rel_err(got_lp.detach(), ref_lp.detach()) <= 1e-5
    for name in params:
        assert rel_err(p32[name].grad, p64[name].grad) <= 1e-4, name
