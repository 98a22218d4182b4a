#!/usr/bin/env python3
"""Reads a GPU activity trace of a speculative `host bench` run (bench/device/cupti_trace.c,
ideally with CUPTI_TRACE_API=1) and splits the last measured run into target forwards, one
per greedy argmax kernel: plain steps and verifications. A verification is told apart by its
kernel count (its short-query attention is several kernels per layer where a plain step has
one). Per kind it prints the median wall time from the previous forward's argmax to this
one's, the GPU busy time inside that span, the kernel count, and the CUDA driver calls the
CPU made in it: counts, and CPU time per call name (all threads).

    spec_trace.py TRACE.tsv [--marker REGEX] [--last N]
"""
import argparse
import bisect
import collections
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_trace import busy_time as busy, load  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--marker", default="arg_?reduce")
    ap.add_argument("--last", type=int, default=400, help="forwards analysed, from the end")
    a = ap.parse_args()
    import re

    kernels, _, api = load(a.trace)
    rx = re.compile(a.marker, re.I)
    ends = [e for s, e, n in kernels if rx.search(n)]
    starts = [k[0] for k in kernels]
    api.sort()
    api_starts = [x[0] for x in api]
    rows = []
    for t0, t1 in list(zip(ends, ends[1:]))[-a.last :]:
        window = [k for k in kernels[bisect.bisect_right(starts, t0) : bisect.bisect_right(starts, t1)]]
        calls = api[bisect.bisect_left(api_starts, t0) : bisect.bisect_left(api_starts, t1)]
        spent = collections.Counter()
        for c in calls:
            spent[c[3]] += c[1] - c[0]
        rows.append((t1 - t0, busy(window), len(window), collections.Counter(c[3] for c in calls), spent))
    if not rows:
        raise SystemExit("no forwards found")
    counts = sorted(r[2] for r in rows)
    plain = statistics.median_low(counts[: max(1, len(counts) // 4)])
    # A forward with clearly more kernels than the common plain one is a verification.
    kinds = collections.defaultdict(list)
    for r in rows:
        kinds["verification" if r[2] > plain * 1.15 else "plain"].append(r)
    print(f"{len(rows)} forwards; plain ~{plain} kernels")
    print("| forward | n | wall us (median) | GPU busy us | GPU idle us | kernels | driver calls per forward (top) |")
    print("|---|---|---|---|---|---|---|")
    for kind, rs in kinds.items():
        wall = statistics.median(r[0] for r in rs) / 1e3
        b = statistics.median(r[1] for r in rs) / 1e3
        k = statistics.median(r[2] for r in rs)
        calls = collections.Counter()
        for r in rs:
            calls.update(r[3])
        top = ", ".join(f"{n} {c / len(rs):.1f}" for n, c in calls.most_common(6))
        print(f"| {kind} | {len(rs)} | {wall:.0f} | {b:.0f} | {wall - b:.0f} | {k:.0f} | {top or '-'} |")
    # CPU time in each driver call per forward, by kind (all threads), costliest first.
    print()
    print("| driver call | " + " | ".join(f"{k} n | {k} us" for k in kinds) + " |")
    print("|---|" + "---|---|" * len(kinds))
    names = set().union(*(r[4] for r in rows))
    cost = lambda n: max(sum(r[4][n] for r in rs) / len(rs) for rs in kinds.values())
    for n in sorted(names, key=cost, reverse=True)[:15]:
        cells = []
        for rs in kinds.values():
            cells.append(f"{sum(r[3][n] for r in rs) / len(rs):.1f} | {sum(r[4][n] for r in rs) / len(rs) / 1e3:.0f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"- | {sum(sum(r[4].values()) for r in rs) / len(rs) / 1e3:.0f}" for rs in kinds.values()) + " |")


if __name__ == "__main__":
    main()
