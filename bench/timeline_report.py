#!/usr/bin/env python3
"""Summarise an in-kernel timeline (offload/gpu_timeline.h; a build with
-DFORKATTN_GPU_TIMELINE=ON writes one per kernel when FORKATTN_GPU_TIMELINE=prefix).

Usage: python3 bench/timeline_report.py FILE [--teams K] [--ghz F]

Prints (1) the teams on the card's time axis: kernel span, the SMs' busy
fraction, the gap between consecutive teams on an SM, the tail after the last
team starts; (2) each phase of the loop in cycles (median, mean, p90) per
warpgroup, from consecutive events of one warp, and how far the warps of a
warpgroup are apart at each event; (3) the first warps of the two warpgroups
of a few long teams interleaved over three middle iterations, on the SM's
cycle counter. Needs numpy.
"""
import argparse
import sys

import numpy as np

NAMES = {1: "START", 2: "READY", 3: "TILE", 4: "ARRIVED", 5: "ISSUED", 6: "S", 7: "PV", 8: "NEXT", 9: "END",
         10: "BEGIN", 11: "FINISH", 12: "GRADS", 13: "NEXTQ", 14: "TURN", 15: "ISSUED_S", 16: "MAX", 17: "EXP",
         18: "RELEASED", 19: "COMPUTED", 20: "STORED"}
START, TILE, END = 1, 3, 9
GLOBAL = (START, END)
LOW56 = (1 << 56) - 1
LOW48 = (1 << 48) - 1


def name(e):
    return NAMES.get(int(e), str(int(e)))


def load(path):
    with open(path, "rb") as f:
        teams, warps, cap, call = np.frombuffer(f.read(16), dtype="<u4")
        words = np.frombuffer(f.read(), dtype="<u8")
    words = words[:(teams + 1) * warps * cap].reshape(teams + 1, warps, cap)[:teams]
    valid = words != 0
    n = np.where(valid.all(axis=2), cap, valid.argmin(axis=2))  # leading events of each warp
    return int(teams), int(warps), int(cap), int(call), words >> np.uint64(56), words & np.uint64(LOW56), n


def pct(xs, p):
    return float(np.quantile(xs, p)) if len(xs) else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--teams", type=int, default=2, help="teams whose interleaving is printed")
    ap.add_argument("--ghz", type=float, default=1.98, help="SM clock, to express ns in cycles")
    a = ap.parse_args()
    teams, warps, cap, call, ev, tm, n = load(a.file)
    wpg = 4 if warps == 8 else 1  # warps a warpgroup among the recorded ones
    rec = n[:, 0] > 0
    print("# %s: call %d, %d teams recorded, %d warps hit the %d-event cap" %
          (a.file, call, int(rec.sum()), int((n == cap).sum()), cap))

    # (1) teams on the global time axis: warp 0's first (START) and last (END) events
    t_idx = np.nonzero(rec)[0]
    last = n[t_idx, 0] - 1
    ok = (ev[t_idx, 0, 0] == START) & (ev[t_idx, 0, last] == END)
    t_idx, last = t_idx[ok], last[ok]
    if len(t_idx):
        s0 = (tm[t_idx, 0, 0] & np.uint64(LOW48)).astype(np.int64)
        s1 = (tm[t_idx, 0, last] & np.uint64(LOW48)).astype(np.int64)
        sm = (tm[t_idx, 0, 0] >> np.uint64(48)).astype(np.int64)
        tiles = (ev[t_idx, 0, :] == TILE).sum(axis=1)
        capped = n[t_idx, 0] >= cap
        t0, t1 = s0.min(), s1.max()
        sms = np.unique(sm)
        gaps = []
        for m in sms:
            o = np.argsort(s0[sm == m])
            a0, a1 = s0[sm == m][o], s1[sm == m][o]
            gaps += list(a0[1:] - a1[:-1])
        dur = s1 - s0
        print("teams %d on %d SMs; span %.1f us; SMs busy %.1f %% of span x SMs; team %.2f us median "
              "(p10 %.2f, p90 %.2f); gap between teams on an SM %.2f us median (p90 %.2f); "
              "tail after the last team's start %.1f us" %
              (len(t_idx), len(sms), (t1 - t0) / 1e3, 100.0 * dur.sum() / ((t1 - t0) * len(sms)),
               np.median(dur) / 1e3, pct(dur, 0.1) / 1e3, pct(dur, 0.9) / 1e3,
               np.median(gaps) / 1e3 if gaps else 0, pct(gaps, 0.9) / 1e3, (t1 - s0.max()) / 1e3))
        keep = (~capped) & (tiles > 0)
        if keep.any():
            per = dur[keep] / tiles[keep]
            print("team time per tile (teams under the cap): %.0f ns median (%.0f cycles at %.2f GHz)" %
                  (np.median(per), np.median(per) * a.ghz, a.ghz))
        counts = np.bincount(np.unique(sm, return_inverse=True)[1])
        vals, freq = np.unique(counts, return_counts=True)
        print("teams an SM ran: " + ", ".join("%d SMs x %d" % (f, v) for v, f in zip(vals, freq)))

    # (2) phases on the cycle counter, per warpgroup, over all its warps
    pos = np.arange(cap)
    usable = pos[None, None, :] < np.minimum(n, cap - 1)[:, :, None]  # a capped warp's last slot was overwritten
    e0, e1 = ev[:, :, :-1], ev[:, :, 1:]
    both = usable[:, :, :-1] & usable[:, :, 1:] & ~np.isin(e0, GLOBAL) & ~np.isin(e1, GLOBAL)
    d = (tm[:, :, 1:].astype(np.int64) - tm[:, :, :-1].astype(np.int64))
    key = (e0.astype(np.int64) << 8) | e1.astype(np.int64)
    for g in range(warps // wpg):
        sel = both[:, g * wpg:(g + 1) * wpg, :]
        k, x = key[:, g * wpg:(g + 1) * wpg, :][sel], d[:, g * wpg:(g + 1) * wpg, :][sel]
        total = x.sum()
        print("warpgroup %d: phase cycles (median / mean / p90, count), all its warps" % g)
        rows = []
        for kk in np.unique(k):
            xs = x[k == kk]
            rows.append((xs.sum(), kk, xs))
        for tot, kk, xs in sorted(rows, key=lambda r: -r[0]):
            print("  %-8s -> %-8s %7.0f %7.0f %7.0f  %8d  (%.1f %% of the recorded cycles)" %
                  (name(kk >> 8), name(kk & 255), np.median(xs), xs.mean(), pct(xs, 0.9), len(xs), 100.0 * tot / total))
    if wpg > 1:
        # warps of a warpgroup at the same event of the same iteration: same index in their sequences
        # when their event sequences agree (they run the same code)
        print("spread of a warpgroup's warps at an event (max - min cycles; median, p90), warp last there:")
        for g in range(warps // wpg):
            w = slice(g * wpg, (g + 1) * wpg)
            m = np.minimum(n[:, w].min(axis=1), cap - 1)
            same = (ev[:, w, :] == ev[:, g * wpg:g * wpg + 1, :]).all(axis=1) & (pos[None, :] < m[:, None])
            t = tm[:, w, :].astype(np.int64)
            spread = t.max(axis=1) - t.min(axis=1)
            lastw = t.argmax(axis=1)
            e = ev[:, g * wpg, :]
            parts = []
            for code in np.unique(e[same]):
                if code in GLOBAL:
                    continue
                sel = same & (e == code)
                lw = np.bincount(lastw[sel], minlength=wpg)
                parts.append("%s %.0f/%.0f (last: %s)" % (name(code), np.median(spread[sel]), pct(spread[sel], 0.9),
                                                         "/".join(str(int(c)) for c in lw)))
            print("  warpgroup %d: " % g + "; ".join(parts))

    # (3) interleaving of the two warpgroups' first warps in a few long teams
    for t in np.argsort(-n[:, 0])[:a.teams]:
        evs = []
        for w in range(0, warps, wpg):
            k = int(min(n[t, w], cap - 1))
            tiles = [i for i in range(k) if ev[t, w, i] == TILE]
            if len(tiles) < 4:
                continue
            mid = (len(tiles) - 4) // 2
            for i in range(tiles[mid], tiles[mid + 3]):
                evs.append((int(tm[t, w, i]), w // wpg, name(ev[t, w, i])))
        if not evs:
            continue
        evs.sort()
        base = evs[0][0]
        print("team %d, three middle iterations (warp 0 of each warpgroup; cycles from the first event):" % t)
        for x, g, nm in evs:
            print("  %6d  %s%s" % (x - base, "          " * g, nm))


if __name__ == "__main__":
    sys.exit(main())
