#!/usr/bin/env python3
"""Tensor parallel vs pipeline parallel over a slow link, on one machine: two network
namespaces joined by a veth pair whose both ends are throttled (`tc ... tbf`), rank 0 in one
(`host bench --hostfile`), rank 1 in the other (`host tp-worker --hostfile --rank 1`):

    bench/multihost.py HOST_BINARY MODEL [--rate 1gbit] [--delay-ms 0.2] [--batch 1,8] [--gen 64] [--rounds 2]

Runs, interleaved `--rounds` times: one rank alone (no link), 2 tensor-parallel ranks,
2 pipeline stages; decode tok/s at each batch size (`host bench --batch`, 32-token prompts,
median of `--runs`), and each split's ratio to one rank measured in the same round. Each
rank runs on a core of its own with one BLAS thread (a one-core host; rank 0 alone is the
baseline). Needs root (ip netns, tc). The model's heads must divide by 2 for the tensor-parallel split
(bench/make_split_model.py makes a SmolLM2-sized Llama whose heads do). Prints a markdown
table. `--delay-ms D` holds every packet D ms each way: this kernel has no `netem`, so the two
hosts are joined through a router namespace whose forwarding passes through a delay line
(bench/delay_line.py, a TUN device at real-time priority).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

ADDRESSES = ("10.249.0.1", "10.249.0.2")
# With a delay line: each host on a subnet of its own, the router between them.
ROUTED = ("10.249.1.1", "10.249.2.1")
HERE = os.path.dirname(os.path.abspath(__file__))


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


def throttle(ns, dev, rate):
    if rate:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "50ms"], check=True)


def make_link(rate):
    """Hosts `a` and `b` on one veth pair, each end throttled: (a, b, addresses, namespaces)."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"m{tag}a", f"m{tag}b"
    ip("netns", "add", a)
    ip("netns", "add", b)
    ip("link", "add", f"{a}0", "type", "veth", "peer", "name", f"{b}0")
    for ns, addr in zip((a, b), ADDRESSES):
        ip("link", "set", f"{ns}0", "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{ns}0")
        ip("-n", ns, "link", "set", f"{ns}0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        throttle(ns, f"{ns}0", rate)
    return a, b, ADDRESSES, [a, b], None


def make_delayed_link(rate, delay_ms):
    """Hosts `a` and `b`, each joined by a throttled veth pair to a router namespace `r` that
    forwards between them through a delay line: every packet (IP forwarding, policy-routed by
    the interface it came in on) goes into the delay line's TUN device and, `delay_ms` later,
    comes back out of it to be routed on by destination. Returns (a, b, addresses, namespaces,
    the delay line's process)."""
    tag = uuid.uuid4().hex[:6]
    a, b, r = f"m{tag}a", f"m{tag}b", f"m{tag}r"
    for ns in (a, b, r):
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
    for ns, addr, side in ((a, ROUTED[0], "a"), (b, ROUTED[1], "b")):
        gateway = addr.rsplit(".", 1)[0] + ".254"
        ip("link", "add", f"{ns}0", "type", "veth", "peer", "name", f"{r}{side}")
        ip("link", "set", f"{ns}0", "netns", ns)
        ip("link", "set", f"{r}{side}", "netns", r)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{ns}0")
        ip("-n", r, "addr", "add", f"{gateway}/24", "dev", f"{r}{side}")
        ip("-n", ns, "link", "set", f"{ns}0", "up")
        ip("-n", r, "link", "set", f"{r}{side}", "up")
        ip("-n", ns, "route", "add", "default", "via", gateway)
        throttle(ns, f"{ns}0", rate)
    for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
        subprocess.run(["ip", "netns", "exec", r, "sysctl", "-qw", key], check=True)
    line = subprocess.Popen(["ip", "netns", "exec", r, "chrt", "-f", "50", sys.executable,
                             os.path.join(HERE, "delay_line.py"), "dl", str(delay_ms / 1e3)],
                            stdout=subprocess.PIPE, text=True)
    line.stdout.readline()  # the device exists
    ip("-n", r, "link", "set", "dl", "up")
    ip("-n", r, "route", "add", "default", "dev", "dl", "table", "100")
    for side in "ab":
        ip("-n", r, "rule", "add", "iif", f"{r}{side}", "lookup", "100")
    return a, b, ROUTED, [a, b, r], line


def pinned(core):
    """Runs on one core with one BLAS thread, as a one-core host would (the ranks would
    otherwise share this machine's cores, and OpenBLAS's and the ring's waiting threads spin)."""
    return ["taskset", "-c", str(core), "env", "OPENBLAS_NUM_THREADS=1"]


def bench(host, model, ns, hostfile, split, batches, gen, runs):
    worker = None
    cmd = ["ip", "netns", "exec", ns, *pinned(0), host, "bench", "--model", model, "--device", "cpu", "--prompt-lengths", "32",
           "--gen", str(gen), "--runs", str(runs), "--batch", ",".join(map(str, batches)), "--json"]
    if split:
        worker = subprocess.Popen(["ip", "netns", "exec", split["b"], *pinned(1), host,
                                   "tp-worker", "--hostfile", hostfile, "--rank", "1", "--device", "cpu"],
                                  stderr=subprocess.DEVNULL)
        cmd += ["--hostfile", hostfile, *split["flags"]]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    finally:
        if worker:
            worker.wait(timeout=60)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["batch"]: r["decode_tps"] for r in rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("host")
    ap.add_argument("model")
    ap.add_argument("--rate", default="1gbit", help="tbf rate of each end of the link ('' for none)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay (a delay line; 0: none)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    a, b, addresses, namespaces, line = make_delayed_link(args.rate, args.delay_ms) if args.delay_ms else make_link(args.rate)
    hostfile = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump([{"ssh": "a", "ips": [addresses[0]]}, {"ssh": "b", "ips": [addresses[1]]}], hostfile)
    hostfile.close()
    splits = {"one rank": None, "tensor 2": {"b": b, "flags": []},
              "pipeline 2": {"b": b, "flags": ["--pipeline-parallel", "2"]}}
    got = {name: {bs: [] for bs in batches} for name in splits}
    ratios = {name: {bs: [] for bs in batches} for name in splits}
    try:
        for _ in range(args.rounds):
            base = None
            for name, split in splits.items():
                tps = bench(args.host, args.model, a, hostfile.name, split, batches, args.gen, args.runs)
                base = base or tps
                for bs in batches:
                    got[name][bs].append(tps[bs])
                    ratios[name][bs].append(tps[bs] / base[bs])
    finally:
        if line:
            line.terminate()
            line.wait(timeout=10)
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        os.unlink(hostfile.name)
    delay = f"{args.delay_ms} ms each way (delay line)" if args.delay_ms else "no added delay"
    print(f"model {args.model}, link {args.rate or 'unthrottled'} (veth, {delay}), one core a rank, "
          f"{args.rounds} rounds x {args.runs} runs, {args.gen} tokens, 32-token prompts")
    print()
    print("| split | " + " | ".join(f"batch {bs} decode tok/s (vs one rank)" for bs in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in splits:
        cells = []
        for bs in batches:
            v, r = got[name][bs], ratios[name][bs]
            cells.append(f"{statistics.median(v):.1f} ({min(r):.2f}-{max(r):.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
