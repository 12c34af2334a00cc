#!/usr/bin/env python3
"""Summarise an in-kernel timeline (offload/gpu_timeline.h; a build with
-DFORKATTN_GPU_TIMELINE=ON writes one per kernel when FORKATTN_GPU_TIMELINE=path).

Usage: python3 bench/timeline_report.py FILE [--teams K] [--ghz F]

Prints (1) the teams on the card's time axis: kernel span, the SMs' busy
fraction, the gap between consecutive teams on an SM, the tail after the last
team starts; (2) each phase of the tile loop in cycles (median, mean, p90) per
warpgroup, from consecutive events of one warp; (3) a few teams' interleaving of
their two warpgroups over three middle iterations, on the SM's cycle counter.
"""
import argparse
import statistics
import struct
import sys
from collections import defaultdict

NAMES = {1: "START", 2: "READY", 3: "TILE", 4: "ARRIVED", 5: "ISSUED", 6: "S", 7: "PV", 8: "NEXT", 9: "END",
         10: "BEGIN", 11: "FINISH", 12: "GRADS", 13: "NEXTQ", 14: "TURN", 15: "ISSUED_S"}
GLOBAL = (1, 9)


def load(path):
    with open(path, "rb") as f:
        teams, warps, cap, call = struct.unpack("<4I", f.read(16))
        data = f.read()
    words = struct.unpack("<%dQ" % (len(data) // 8), data)
    seqs = {}
    for t in range(teams):
        for w in range(warps):
            base = (t * warps + w) * cap
            rec = words[base:base + cap]
            n = 0
            while n < cap and rec[n]:
                n += 1
            if n:
                s = [(r >> 56, r & ((1 << 56) - 1)) for r in rec[:n]]
                if n == cap and s[-1][0] != 9:
                    s = s[:-1]  # overwritten by later events, none of them the END
                seqs[(t, w)] = s
    return teams, warps, cap, call, seqs


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--teams", type=int, default=2, help="teams whose interleaving is printed")
    ap.add_argument("--ghz", type=float, default=1.98, help="SM clock, to express cycles in ns")
    a = ap.parse_args()
    teams, warps, cap, call, seqs = load(a.file)
    full = [k for k, s in seqs.items() if len(s) >= cap]
    print("# %s: call %d, %d warps recorded (%d teams), %d hit the %d-event cap" %
          (a.file, call, len(seqs), len({k[0] for k in seqs}), len(full), cap))

    # (1) teams on the global time axis (warp 0's START and END)
    span = []
    for (t, w), s in seqs.items():
        if w:
            continue
        st = [x for e, x in s if e == 1]
        en = [x for e, x in s if e == 9]
        if st and en:
            sm = st[0] >> 48
            capped = len(s) >= cap - 1  # its tiles were not all recorded
            span.append((st[0] & ((1 << 48) - 1), en[-1] & ((1 << 48) - 1), sm, t,
                         0 if capped else sum(1 for e, _ in s if e == 3)))
    if span:
        t0 = min(x[0] for x in span)
        t1 = max(x[1] for x in span)
        by_sm = defaultdict(list)
        for s0, s1, sm, t, nt in span:
            by_sm[sm].append((s0, s1, t, nt))
        busy = sum(s1 - s0 for s0, s1, _, _, _ in span)
        gaps = []
        for sm, lst in by_sm.items():
            lst.sort()
            gaps += [b[0] - a_[1] for a_, b in zip(lst, lst[1:])]
        dur = [s1 - s0 for s0, s1, _, _, _ in span]
        last_start = max(x[0] for x in span)
        print("teams %d on %d SMs; span %.1f us; SMs busy %.1f %% of span x SMs; team %.2f us median "
              "(p10 %.2f, p90 %.2f); gap between teams on an SM %.2f us median (p90 %.2f); "
              "tail after the last team's start %.1f us" %
              (len(span), len(by_sm), (t1 - t0) / 1e3, 100.0 * busy / ((t1 - t0) * len(by_sm)),
               statistics.median(dur) / 1e3, pct(dur, 0.1) / 1e3, pct(dur, 0.9) / 1e3,
               statistics.median(gaps) / 1e3 if gaps else 0, pct(gaps, 0.9) / 1e3 if gaps else 0,
               (t1 - last_start) / 1e3))
        per_tile = [(s1 - s0) / nt for s0, s1, _, _, nt in span if nt]
        if per_tile:
            print("team time per tile (teams under the cap): %.0f ns median (%.0f cycles at %.2f GHz)" %
                  (statistics.median(per_tile), statistics.median(per_tile) * a.ghz, a.ghz))
        waves = defaultdict(int)
        for lst in by_sm.values():
            waves[len(lst)] += 1
        print("teams an SM ran: " + ", ".join("%d SMs x %d" % (v, k) for k, v in sorted(waves.items())))

    # (2) phases on the cycle counter, per warpgroup
    for w in range(warps):
        ph = defaultdict(list)
        for (t, ww), s in seqs.items():
            if ww != w:
                continue
            if len(s) >= cap:  # the last slot was overwritten until the END: drop its neighbours' pair
                s = s[:-1]
            clk = [(e, x) for e, x in s if e not in GLOBAL]
            for (e0, x0), (e1, x1) in zip(clk, clk[1:]):
                ph[(e0, e1)].append(x1 - x0)
        print("warpgroup %d: phase cycles (median / mean / p90, count)" % w)
        for (e0, e1), xs in sorted(ph.items(), key=lambda kv: -sum(kv[1])):
            print("  %-8s -> %-8s %7.0f %7.0f %7.0f  %7d  (%.1f %% of the recorded cycles)" %
                  (NAMES.get(e0, e0), NAMES.get(e1, e1), statistics.median(xs), statistics.mean(xs), pct(xs, 0.9),
                   len(xs), 100.0 * sum(xs) / sum(sum(v) for v in ph.values())))

    # (3) interleaving of the two warpgroups of a few long teams
    longest = sorted({t for t, _ in seqs}, key=lambda t: -len(seqs.get((t, 0), [])))[:a.teams]
    for t in longest:
        ev = []
        for w in range(warps):
            s = seqs.get((t, w), [])
            tiles = [i for i, (e, _) in enumerate(s) if e == 3]
            if len(tiles) < 6:
                continue
            mid = len(tiles) // 2
            for e, x in s[tiles[mid]:tiles[mid + 3]]:
                ev.append((x, w, NAMES.get(e, e)))
        if not ev:
            continue
        ev.sort()
        base = ev[0][0]
        print("team %d, three middle iterations (cycles from the first event):" % t)
        for x, w, n in ev:
            print("  %6d  %s%s" % (x - base, "        " * w, n))


if __name__ == "__main__":
    sys.exit(main())
