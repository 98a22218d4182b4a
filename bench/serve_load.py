#!/usr/bin/env python3
"""`host serve` against `mlx_lm.server` (or llama.cpp's `llama-server`) under N concurrent
streaming clients, in one run.

    bench/serve_load.py --model DIR [--host target/release/host] [--oracle-python PY]
        [--clients 1,8] [--max-tokens 64] [--rounds 2] [--device cpu|gpu] [--api chat|completions] [--join 31 [--join-samples 5]]
        [--llama-server BIN [--only host,llama.cpp]] [--baseline BIN] [--alternate]

`--llama-server BIN` adds llama.cpp's server on the same --model (a GGUF file), with as many
parallel slots as the most clients and the threads this machine has
(`bash bench/build-llama-cpp.sh` builds it and prints its folder).

Starts each server on a free loopback port (mlx-lm with Debian's OpenBLAS preloaded when
the host binary links it, so both run the same BLAS), warms it up, then for each client
count sends that many streaming chat completions at once (different prompts, greedy,
`max_tokens` each) and prints a markdown table: aggregate generation tok/s (tokens streamed
by all clients over the wall time from the first request to the last token), mean
per-stream tok/s (after each stream's first token), TTFT p50/p95, and host/mlx-lm ratios.
`--baseline BIN` serves another host binary beside (say, main before a change) as `host-base`,
with its own ratio column.
`--join N`: N streams decode, then `--join-samples` more requests arrive one after another;
their TTFT p50/p95 against the same requests alone (the issue's "joining a running batch"
figure).

Each server's rounds go round by round through the client counts (round 1 at every count,
then round 2 ...). `--alternate` starts every server first and takes the rounds in turn (round
1 of each server, then round 2 of each, the first server changing every round), so a machine
whose speed drifts over minutes (this 2-core VM's does, by tens of percent) weighs on all of
them alike; both servers' memory is held at once.

Tokens are counted from each server's `usage` (stream_options.include_usage), else from
the content chunks. Run it with the e2e virtualenv's Python (it needs httpx).
`SERVE_LOAD_LOGS=DIR` keeps each server's stderr in DIR/NAME.log (with `HOST_LOG=...=trace`,
the host's engine trace).
"""
import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
TOPICS = ["the sea", "a city at night", "an old library", "a mountain road", "a winter market", "a small robot",
          "the first snow", "a lighthouse", "a desert well", "a train journey", "a garden in spring", "a lost key"]


def prompt(i):
    return f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}, number {i}."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, cmd, port, env=None, model="default"):
        # mlx_lm.server loads whatever `model` names (the hub's, unless it is the folder it
        # serves), so each server is sent the name it serves.
        self.name, self.url, self.model = name, f"http://127.0.0.1:{port}", model
        logs = os.environ.get("SERVE_LOAD_LOGS")  # a folder: each server's stderr kept there
        err = open(os.path.join(logs, f"{name}.log"), "w") if logs else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{name} exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        sys.exit(f"{name} did not come up")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


API = "chat"  # or "completions": the prompt as plain text (a model without a chat template)


def request(server, text, max_tokens, **extra):
    """(url, body) of a streamed greedy request for `text` in the API chosen."""
    body = {"model": server.model, "temperature": 0, "max_tokens": max_tokens, "stream": True, **extra}
    if API == "completions":
        return server.url + "/v1/completions", {**body, "prompt": text}
    return server.url + "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


def content(choice):
    """A stream chunk choice's new text (chat delta or completion text)."""
    return (choice.get("delta") or {}).get("content") or choice.get("text")


def stream(server, text, max_tokens):
    """One streamed request: (start, first token time, end, tokens)."""
    url, body = request(server, text, max_tokens, stream_options={"include_usage": True})
    start, first, chunks, usage = time.time(), None, 0, None
    with httpx.stream("POST", url, json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for c in event.get("choices") or []:
                if content(c):
                    chunks += 1
                    first = first or time.time()
    return start, first or time.time(), time.time(), usage or chunks


def load(server, clients, max_tokens, offset):
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda i: stream(server, prompt(offset + i), max_tokens), range(clients)))
    t0, t1 = min(r[0] for r in runs), max(r[2] for r in runs)
    tokens = sum(r[3] for r in runs)
    ttft = sorted(r[1] - r[0] for r in runs)
    per_stream = [(r[3] - 1) / (r[2] - r[1]) for r in runs if r[2] > r[1] and r[3] > 1]
    return {"aggregate": tokens / (t1 - t0), "per_stream": statistics.mean(per_stream) if per_stream else 0.0,
            "ttft_p50": ttft[len(ttft) // 2], "ttft_p95": ttft[min(len(ttft) - 1, int(len(ttft) * 0.95))],
            "tokens": tokens}


def join(server, running, max_tokens, samples):
    """TTFTs of `samples` requests alone, one after another, then of the same requests arriving
    one after another while `running` stream (each of `max_tokens`, read to their end, so they
    still decode while the joiners come): (alone p50, alone p95, joined p50, joined p95, how
    many joiners arrived while all `running` still decoded)."""
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(len(xs) * q))]
    alone = [stream(server, prompt(999 + k), 4) for k in range(samples)]
    alone = [r[1] - r[0] for r in alone]
    firsts, done = set(), set()

    def background(i):
        url, body = request(server, prompt(i), max_tokens)
        with httpx.stream("POST", url, json=body, timeout=1800) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                # A token, not the opening chunk (sent before the prompt is prefilled).
                if any(content(c) for c in json.loads(line[6:]).get("choices") or []):
                    firsts.add(i)
        done.add(i)
    threads = [threading.Thread(target=background, args=(i,)) for i in range(running)]
    for t in threads:
        t.start()
    deadline = time.time() + 1800
    while len(firsts) < running and time.time() < deadline:
        time.sleep(0.05)
    joined, inside = [], 0
    for k in range(samples):
        r = stream(server, prompt(999 + k), 4)
        joined.append(r[1] - r[0])
        inside += not done
    for t in threads:
        t.join()
    return pct(alone, 0.5), pct(alone, 0.95), pct(joined, 0.5), pct(joined, 0.95), inside


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="target/release/host")
    ap.add_argument("--oracle-python", default=os.path.expanduser("~/.cache/host/oracle/bin/python"))
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--join", type=int, default=0)
    ap.add_argument("--join-samples", type=int, default=5, help="joining requests (and as many alone)")
    ap.add_argument("--only", help="comma-separated servers to run (host, mlx-lm, llama.cpp)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: serve --model with it too")
    ap.add_argument("--baseline", help="another host binary (say, main before a change): served as host-base")
    ap.add_argument("--alternate", action="store_true",
                    help="start every server first and alternate them round by round")
    ap.add_argument("--api", choices=["chat", "completions"], default="chat",
                    help="completions for a model without a chat template (the device kit's random ones)")
    args = ap.parse_args()
    global API
    API = args.api
    counts = [int(c) for c in args.clients.split(",")]
    blas = OPENBLAS if os.path.exists(OPENBLAS) else None
    def host_cmd(binary, port):
        return [binary, "serve", "--model", args.model, "--port", str(port), "--device", args.device,
                "--max-batch", str(max(counts + [args.join + 1]))]

    servers = {
        "host": lambda p: Server("host", host_cmd(args.host, p), p),
        "mlx-lm": lambda p: Server("mlx-lm", [args.oracle_python, "-m", "mlx_lm", "server", "--model", args.model,
                                              "--port", str(p)], p,
                                   {"LD_PRELOAD": blas} if blas else {}, model=args.model),
    }
    if args.baseline:
        servers["host-base"] = lambda p: Server("host-base", host_cmd(args.baseline, p), p)
    if args.llama_server:
        slots = max(counts + [args.join + 1])
        servers["llama.cpp"] = lambda p: Server(
            "llama.cpp", [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(p), "-np",
                          str(slots), "-c", str(2048 * slots), "-t", str(os.cpu_count())], p)
    only = set(args.only.split(",")) if args.only else None
    names = [name for name in servers if not only or name in only]
    results = {}
    # Servers up at once, their rounds taken in turn (--alternate), or one server at a time.
    for group in [names] if args.alternate else [[name] for name in names]:
        running = {}
        try:
            for name in group:
                running[name] = servers[name](free_port())
                stream(running[name], prompt(0), 8)  # warm-up
            rounds = {(name, n): [] for name in group for n in counts}
            for r in range(args.rounds):
                order = group[r % len(group):] + group[:r % len(group)]
                for n in counts:
                    for name in order:
                        rounds[(name, n)].append(load(running[name], n, args.max_tokens, r * n))
            for (name, n), runs in rounds.items():
                results[(name, n)] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
                print(f"{name} {n} clients: {results[(name, n)]}", file=sys.stderr)
            if args.join:
                for name in group:
                    results[(name, "join")] = join(running[name], args.join, args.max_tokens, args.join_samples)
        finally:
            for server in running.values():
                server.stop()
    others = [o for o in servers if o != "host" and any((o, n) in results for n in counts)]
    print(f"model {args.model}, device {args.device}, {args.max_tokens} tokens per request, "
          f"median of {args.rounds} rounds{' (servers alternated)' if args.alternate else ''}, "
          f"BLAS: {'OpenBLAS (both)' if blas else 'the wheel reference BLAS'}"
          f"{'; llama.cpp: its own CPU kernels' if 'llama.cpp' in others else ''}\n")
    print("| clients | server | aggregate tok/s | per-stream tok/s | TTFT p50 s | TTFT p95 s | "
          + "".join(f"host/{o} aggregate | " for o in others))
    print("|---|---|---|---|---|---|" + "---|" * len(others))
    for n in counts:
        for name in servers:
            r = results.get((name, n))
            if not r:
                continue
            ratios = ""
            for o in others:
                other = results.get((o, n))
                ratios += (f"{r['aggregate'] / other['aggregate']:.2f}x" if name == "host" and other else "") + " | "
            print(f"| {n} | {name} | {r['aggregate']:.1f} | {r['per_stream']:.1f} | {r['ttft_p50']:.2f} | "
                  f"{r['ttft_p95']:.2f} | {ratios}")
    single = results.get(("host", 1))
    for n in counts:
        if single and n > 1 and ("host", n) in results:
            print(f"\nhost, {n} clients: aggregate {results[('host', n)]['aggregate'] / single['aggregate']:.2f}x "
                  "its single stream")
    for name in servers:
        if (name, "join") in results:
            a50, a95, j50, j95, inside = results[(name, "join")]
            print(f"\n{name}: TTFT alone p50 {a50:.3f} s p95 {a95:.3f} s; joining {args.join} running streams "
                  f"p50 {j50:.3f} s p95 {j95:.3f} s ({j95 / a95:.2f}x at p95; {inside} of {args.join_samples} "
                  "joiners arrived while every running stream still decoded)")


if __name__ == "__main__":
    main()
