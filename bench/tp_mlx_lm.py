#!/usr/bin/env python3
"""mlx-lm's own tensor-parallel decode, one process per rank, for comparison with
`host bench --tensor-parallel N` (bench/tensor_parallel.py launches both).

    bench/tp_mlx_lm.py MODEL_DIR --prompt 512 --gen 128 --trials 3

Run under MLX's rank environment (MLX_RANK + MLX_HOSTFILE for `ring`, or NCCL_HOST_IP,
NCCL_PORT, MLX_WORLD_SIZE and one visible GPU per rank for `nccl`); loads the model with
mlx-lm's `sharded_load` (attention heads and MLP columns split, as the host does), generates
greedily from a seeded random prompt with `stream_generate`, and on rank 0 prints one JSON
line: decode tok/s (median of the trials after a warm-up), prefill tok/s.
"""
import argparse
import json
import random
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import sharded_load


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--backend", default="any")
    a = ap.parse_args()
    group = mx.distributed.init(strict=a.backend != "any", backend=a.backend)
    if a.backend == "nccl":
        # sharded_load (mlx-lm 0.32.2) ends with an all_sum on the CPU stream, which MLX
        # 0.32.4's NCCL backend cannot run ("There is no Stream(gpu, 1) in current thread");
        # that barrier runs on the default stream instead.
        all_sum = mx.distributed.all_sum
        mx.distributed.all_sum = lambda x, *args, stream=None, **kw: all_sum(x, *args, **kw)
    model, tokenizer = sharded_load(a.model, None, group)
    vocab = model.args.vocab_size if hasattr(model, "args") else 32000
    rng = random.Random(1)
    prompt = [rng.randrange(100, min(vocab, 30000)) for _ in range(a.prompt)]
    sampler = make_sampler(temp=0.0)

    def run(n):
        first = last = None
        prefill = 0.0
        count = 0
        for r in stream_generate(model, tokenizer, prompt, max_tokens=n, sampler=sampler):
            now = time.perf_counter()
            first = first or now
            last = now
            prefill = r.prompt_tps
            count += 1
        return (count - 1) / (last - first) if count > 1 else 0.0, prefill

    run(8)
    results = [run(a.gen) for _ in range(a.trials)]
    if group.rank() == 0:
        print(json.dumps({"bench": "mlx-lm-tp", "model": a.model.rstrip("/").split("/")[-1], "ranks": group.size(),
                          "prompt": a.prompt, "gen": a.gen,
                          "decode_tps": statistics.median(r[0] for r in results),
                          "trials_decode_tps": [round(r[0], 1) for r in results],
                          "prefill_tps": statistics.median(r[1] for r in results)}), flush=True)


if __name__ == "__main__":
    main()
