#!/usr/bin/env python3
"""Reads GPU activity traces written by bench/device/cupti_trace.c and prints, per engine, what
one decode step (or, with --prefill, the last run's prefill) costs on the GPU: kernels per step by name, GPU busy time against the step's
wall time (the difference is idle GPU), Unified Memory traffic (pages migrating between
host and device memory while decoding) and, when the trace has them (CUPTI_TRACE_API=1),
the CUDA driver calls the CPU made per step on its busiest thread, by name.

    gpu_trace.py [--steps 100] [--marker REGEX] [--prefill] LABEL=TRACE.tsv...

Decode steps are found from a marker kernel that runs once per step (the greedy argmax,
default regex `arg_?reduce`): consecutive markers closer than 3x the median gap are one step
apart; the last `--steps` such steps of the trace are analysed (the final measured run).
With --prefill the window is instead that run's prefill: from the first kernel after the
marker before the run's long gap (the previous run's last token) to the run's first marker
(its first token), one "step".
"""
import argparse
import bisect
import collections
import re
import shutil
import statistics
import subprocess


def load(path):
    kernels, um, api = [], [], []
    with open(path, errors="replace") as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            if p[0] == "K":
                kernels.append((int(p[1]), int(p[2]), p[4]))
            elif p[0] in ("C", "S"):
                kernels.append((int(p[1]), int(p[2]), "[memcpy]" if p[0] == "C" else "[memset]"))
            elif p[0] == "U":
                um.append((int(p[1]), int(p[3]), int(p[4])))
            elif p[0] == "A":
                api.append((int(p[1]), int(p[2]), int(p[3]), p[4]))
    kernels.sort()
    return kernels, um, api


def busy_time(window):
    """Time at least one of `window`'s (start, end, name) records (sorted by start) was running."""
    total, cur_s, cur_e = 0, None, None
    for s, e, _ in window:
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0 if cur_e is None else cur_e - cur_s)


def demangle(names):
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return dict(zip(names, out))


def short(name, width=70):
    name = re.sub(r"\(.*\)$", "", name)  # parameter list
    name = re.sub(r"mlx::core::(cu::)?", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def analyse(path, steps, marker, prefill=False):
    kernels, um, api = load(path)
    rx = re.compile(marker, re.I)
    ends = [e for s, e, n in kernels if rx.search(n)]
    if len(ends) < 3:
        raise SystemExit(f"{path}: fewer than 3 marker kernels matching {marker!r}; pick another --marker")
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    limit = 3 * statistics.median(gaps)
    # The last run of consecutive short gaps, at most `steps` long.
    i = len(gaps) - 1
    while i >= 0 and gaps[i] >= limit:
        i -= 1
    last = i
    while i >= 0 and gaps[i] < limit and last - i < steps:
        i -= 1
    first = i + 1
    n = last - first + 1
    t0, t1 = ends[first], ends[last + 1]
    starts = [k[0] for k in kernels]
    if prefill:
        while i >= 0 and gaps[i] < limit:
            i -= 1
        if i < 0:
            raise SystemExit(f"{path}: no run before the last one, so no prefill gap to analyse")
        # Kernels after the previous run's last marker, up to this run's first token.
        n, t1 = 1, ends[i + 1]
        t0 = kernels[bisect.bisect_right(starts, ends[i])][0]
    window = [k for k in kernels[bisect.bisect_left(starts, t0) : bisect.bisect_left(starts, t1)] if k[1] <= t1]
    busy = busy_time(window)
    per = collections.defaultdict(lambda: [0, 0])
    for s, e, name in window:
        per[name][0] += 1
        per[name][1] += e - s
    um_all = collections.Counter()
    um_window = collections.Counter()
    for t, kind, value in um:
        um_all[kind] += value
        if t0 <= t <= t1:
            um_window[kind] += value
    # Driver calls inside the window, on the thread that spent the most time in them.
    calls = [a for a in api if t0 <= a[0] and a[1] <= t1]
    by_thread = collections.Counter()
    for s, e, th, _ in calls:
        by_thread[th] += e - s
    main_thread = by_thread.most_common(1)[0][0] if by_thread else None
    api_per = collections.defaultdict(lambda: [0, 0])
    for s, e, th, name in calls:
        if th == main_thread:
            api_per[name][0] += 1
            api_per[name][1] += e - s
    return {
        "api_us": sum(d for _, d in api_per.values()) / n / 1e3,
        "api_per": {k: (c / n, d / n / 1e3) for k, (c, d) in api_per.items()},
        "steps": n,
        "step_us": (t1 - t0) / n / 1e3,
        "busy_us": busy / n / 1e3,
        "kernels": len(window) / n,
        "per": {k: (c / n, d / n / 1e3) for k, (c, d) in per.items()},
        "um_all": um_all,
        "um_window": um_window,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--marker", default=r"arg_?reduce")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill", action="store_true", help="analyse the last run's prefill instead")
    ap.add_argument("traces", nargs="+", help="LABEL=PATH")
    a = ap.parse_args()
    runs = {}
    for t in a.traces:
        label, path = t.split("=", 1)
        runs[label] = analyse(path, a.steps, a.marker, a.prefill)
    labels = list(runs)
    um_kinds = {1: "UM host->device bytes", 2: "UM device->host bytes", 4: "UM GPU page faults"}
    print(f"| per {'prefill' if a.prefill else 'decode step'} | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for key, what in [("steps", "steps analysed"), ("step_us", "wall us"), ("busy_us", "GPU busy us"),
                      ("kernels", "kernels + copies")]:
        print(f"| {what} | " + " | ".join(f"{runs[l][key]:.1f}" for l in labels) + " |")
    print("| GPU idle us | " + " | ".join(f"{runs[l]['step_us'] - runs[l]['busy_us']:.1f}" for l in labels) + " |")
    for kind, what in um_kinds.items():
        print(f"| {what}, window / whole trace | "
              + " | ".join(f"{runs[l]['um_window'][kind]} / {runs[l]['um_all'][kind]}" for l in labels) + " |")
    if any(runs[l]["api_per"] for l in labels):
        print("| CPU us in driver calls (busiest thread) | " + " | ".join(f"{runs[l]['api_us']:.1f}" for l in labels) + " |")
        table(runs, labels, "api_per", "driver call", a.top)
    names = set().union(*(r["per"] for r in runs.values()))
    table(runs, labels, "per", "kernel", a.top, demangle(sorted(names)))


def table(runs, labels, key, what, top, pretty=None):
    """Per-name counts and times per step, costliest first (by the engine it costs most)."""
    names = set().union(*(r[key] for r in runs.values()))
    cost = lambda n: max(runs[l][key].get(n, (0, 0))[1] for l in labels)
    print()
    print(f"| {what} | " + " | ".join(f"{l} n/step | {l} us/step" for l in labels) + " |")
    print("|---|" + "---|---|" * len(labels))
    for name in sorted(names, key=cost, reverse=True)[:top]:
        cells = []
        for l in labels:
            c, d = runs[l][key].get(name, (0, 0))
            cells.append(f"{c:.1f} | {d:.1f}")
        label = short(pretty[name]) if pretty else name
        print(f"| `{label}` | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
