#!/usr/bin/env python3
"""Tensor-parallel decode, host vs mlx-lm, at 1 and N ranks, in one run:

    bench/tensor_parallel.py HOST_BINARY MODEL_DIR --ranks 2 --device gpu [--python PY]

Host: `host bench --tensor-parallel R --json` (it launches its own ranks). mlx-lm: R
processes of bench/tp_mlx_lm.py with MLX's rank environment (ring over loopback on the CPU;
NCCL with one GPU per rank on GPUs, NVLink multicast off), rank 0 reporting. Prompt 512,
128 generated, median of 3 after a warm-up; `--rounds K` repeats the 1- and N-rank pairs
interleaved (this device varies ±20% run to run). Prints a markdown table.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_lm(py, model, ranks, device, prompt, gen, timeout):
    backend = "nccl" if device == "gpu" else "ring"
    hostfile = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)], hostfile)
    hostfile.close()
    nccl_port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")
        if ranks > 1:
            env.update(MLX_RANK=str(rank), MLX_HOSTFILE=hostfile.name, MLX_WORLD_SIZE=str(ranks),
                       NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(nccl_port))
        if device == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        cmd = [py, os.path.join(HERE, "tp_mlx_lm.py"), model, "--prompt", str(prompt), "--gen", str(gen),
               "--backend", backend if ranks > 1 else "any"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    try:
        out = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        sys.stderr.write(f"mlx-lm at {ranks} ranks: no result within {timeout} s\n")
        return None
    rows = [json.loads(l) for l in out[0].splitlines() if l.startswith("{")]
    return rows[0] if rows else None


def host(binary, model, ranks, device, prompt, gen, timeout):
    cmd = [binary, "bench", "--model", model, "--device", device, "--prompt-lengths", str(prompt), "--gen", str(gen),
           "--runs", "3", "--json", "--tensor-parallel", str(ranks)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        sys.stderr.write(f"host at {ranks} ranks: no result within {timeout} s\n{e.stderr or ''}\n")
        return None
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    if not rows:
        sys.stderr.write(out.stderr)
    return rows[0] if rows else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("host")
    ap.add_argument("model")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison, interleaved")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for each engine at each rank count")
    a = ap.parse_args()
    print("| model | ranks | mlx-lm decode tok/s | host decode tok/s | host/mlx-lm |")
    print("|---|---|---|---|---|")
    for ranks in [r for _ in range(a.rounds) for r in sorted({1, a.ranks})]:
        m = mlx_lm(a.python, a.model, ranks, a.device, a.prompt, a.gen, a.timeout)
        h = host(a.host, a.model, ranks, a.device, a.prompt, a.gen, a.timeout)
        md, hd = (m or {}).get("decode_tps"), (h or {}).get("decode_tps")
        ratio = f"{hd / md:.2f}x" if md and hd else "-"
        print(f"| {os.path.basename(a.model.rstrip('/'))} | {ranks} | {md or 0:.1f} | {hd or 0:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
