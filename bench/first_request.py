#!/usr/bin/env python3
"""Start-up and first-request latency of `host serve`, with and without the load-time
warm-up (issue 6: kernels compile at start, not in the first request).

    bench/first_request.py HOST_BINARY MODEL_DIR [--device gpu]

For each setting: seconds from launch to "serving", then the latency of three identical
completion requests (32 generated tokens, greedy, prompt cache off), printed as a table.
Each server gets an empty MLX kernel cache (MLX_PTX_CACHE_DIR in a fresh folder), so both
settings start from uncompiled kernels.
"""
import argparse
import json
import re
import os
import subprocess
import tempfile
import time
import urllib.request


def request(url):
    body = json.dumps({"prompt": "Write a haiku about the sea.", "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)
    return time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("host")
    ap.add_argument("model")
    ap.add_argument("--device", default="gpu")
    a = ap.parse_args()
    print("| warm-up | start-up s | request 1 s | request 2 s | request 3 s |")
    print("|---|---|---|---|---|")
    for warm in ["false", "true"]:
        t = time.time()
        env = dict(os.environ, MLX_PTX_CACHE_DIR=tempfile.mkdtemp(prefix="ptx-"))
        p = subprocess.Popen([a.host, "serve", "--model", a.model, "--device", a.device, "--port", "0",
                              "--prompt-cache-bytes", "0", "--warm-up", warm], stderr=subprocess.PIPE, text=True,
                             env=env)
        url = None
        for line in p.stderr:
            m = re.search(r"on (http://[0-9.:]+)", line)
            if m:
                url = m.group(1)
                break
        startup = time.time() - t
        try:
            lat = [request(url) for _ in range(3)]
        finally:
            p.terminate()
            p.wait(30)
        print(f"| {warm} | {startup:.1f} | " + " | ".join(f"{x:.2f}" for x in lat) + " |")


if __name__ == "__main__":
    main()
