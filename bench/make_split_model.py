#!/usr/bin/env python3
"""A random-weight Llama of SmolLM2-135M's cost whose heads divide by 2 and 4, for measuring
tensor parallelism on a CPU (SmolLM2's own 3 KV heads split only by 3):

    bench/make_split_model.py OUT_DIR [--tokenizer-dir SMOLLM2_DIR]

hidden 576, 30 layers, MLP 1536, vocabulary 49152 as SmolLM2's, but 8 attention heads and 4
KV heads of 72 (SmolLM2: 9 and 3 of 64), float32. Built by ../shared/models/make-tiny-random.py
with these sizes (deterministic, numpy only). Its text is noise: use it for speed, not output.
"""
import argparse
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer-dir", default=os.path.join(os.environ.get("HOST_TEST_MODELS", ""), "smollm2-f32"))
    shared = os.environ.get("HOST_SHARED_DIR", os.path.join(HERE, "..", "..", "shared"))
    ap.add_argument("--maker", default=os.path.join(shared, "models", "make-tiny-random.py"))
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("make_tiny_random", args.maker)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.DIMS = dict(hidden=576, layers=30, heads=8, kv_heads=4, ffn=1536, vocab=49152, ctx=8192)
    maker.make("llama", args.out, 0, "float32", args.tokenizer_dir)


if __name__ == "__main__":
    main()
