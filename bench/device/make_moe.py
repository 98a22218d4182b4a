#!/usr/bin/env python3
"""make_moe.py SHAPE OUT_DIR [--layers N] [--bits 4 | --mxfp4] [--seed 0]

Runs ON THE DEVICE (after `. /tmp/site/env.sh`: MLX on the GPU). Writes a random-weight
mixture-of-experts model folder of a real model's shape, in mlx-community's layout (what
mlx-lm's sanitize produces and `mlx_lm.convert` writes):

    qwen3-30b-a3b   Qwen3-30B-A3B: 48 layers, hidden 2048, 32 q / 4 kv heads of 128,
                    128 experts of width 768, 8 per token, vocab 151936
    gpt-oss-20b     gpt-oss-20b: 24 layers, hidden 2880, 64 q / 8 kv heads of 64, 32 experts
                    of width 2880, 4 per token, sinks, sliding window 128, YaRN, vocab 201088

Weights are N(0, 0.02) (norms 1, sinks 0), generated tensor by tensor on the GPU in
bfloat16, so the whole model is never in memory at once; with --bits 4 every matrix
(embedding, attention, experts, head) is quantized with MLX's affine quantization, group 64,
and the routers with 8 bits (mlx-lm's quant_predicate for both models); with --mxfp4 the
experts are MXFP4 (group 32, no biases) and every other matrix 8-bit affine, as
mlx-community's gpt-oss "MXFP4-Q8" folders. --layers N keeps the
first N layers (every layer keeps its real shape): a decode step's time is the layers' sum,
so host/mlx-lm ratios hold; the weights per token shrink accordingly. The tokenizer is the
device kit's byte-level BPE over the whole vocabulary (`make-model.py`).
"""
import argparse
import importlib.util
import json
import os

import mlx.core as mx

SHAPES = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088,
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, rope_theta=150000,
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                      "original_max_position_embeddings": 4096, "rope_type": "yarn",
                      "truncate": False},
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=True, swiglu_limit=7.0,
        # The kit's tokenizer puts Qwen2's specials at these ids.
        bos_token_id=151643, eos_token_id=151643,
    ),
}


def tensors(c):
    """(name, shape, kind) of every tensor, layer by layer; kind: matrix, router, norm, bias, sinks."""
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (c["vocab_size"], h), "matrix"
    gpt = c["model_type"] == "gpt_oss"
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for n, shape in [("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))]:
            yield f"{p}.self_attn.{n}.weight", shape, "matrix"
            if gpt:
                yield f"{p}.self_attn.{n}.bias", shape[:1], "bias"
        if gpt:
            yield f"{p}.self_attn.sinks", (c["num_attention_heads"],), "sinks"
            e, f = c["num_local_experts"], c["intermediate_size"]
            yield f"{p}.mlp.router.weight", (e, h), "router"
            yield f"{p}.mlp.router.bias", (e,), "bias"
            experts = f"{p}.mlp.experts"
        else:
            yield f"{p}.self_attn.q_norm.weight", (hd,), "norm"
            yield f"{p}.self_attn.k_norm.weight", (hd,), "norm"
            e, f = c["num_experts"], c["moe_intermediate_size"]
            yield f"{p}.mlp.gate.weight", (e, h), "router"
            experts = f"{p}.mlp.switch_mlp"
        for n, shape in [("gate_proj", (e, f, h)), ("up_proj", (e, f, h)), ("down_proj", (e, h, f))]:
            yield f"{experts}.{n}.weight", shape, "matrix"
            if gpt:
                yield f"{experts}.{n}.bias", shape[:2], "bias"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
    yield "model.norm.weight", (h,), "norm"
    yield "lm_head.weight", (c["vocab_size"], h), "matrix"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--bits", type=int, choices=[4, 8])
    ap.add_argument("--mxfp4", action="store_true", help="experts in MXFP4, the rest 8-bit affine")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    c = dict(SHAPES[a.shape])
    if a.layers:
        c["num_hidden_layers"] = a.layers
    if c["model_type"] == "gpt_oss":
        c["layer_types"] = ["sliding_attention", "full_attention"] * (c["num_hidden_layers"] // 2)
    if os.path.exists(os.path.join(a.out, "config.json")):
        print(f"{a.out}: exists")
        return
    os.makedirs(a.out, exist_ok=True)
    mx.random.seed(a.seed)
    if a.mxfp4:
        a.bits = 8
    quant = {"group_size": 64, "bits": a.bits, "mode": "affine"} if a.bits else None
    shard, shards, index, size, total = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, shards, size
        if shard:
            shards += 1
            name = f"model-{shards:05d}.safetensors"
            mx.save_safetensors(os.path.join(a.out, name), shard, metadata={"format": "mlx"})
            index.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape, kind in tensors(c):
        if kind == "norm":
            arrays = {name: mx.ones(shape, dtype=mx.bfloat16)}
        elif kind == "sinks":
            arrays = {name: mx.zeros(shape, dtype=mx.bfloat16)}
        else:
            w = (0.02 * mx.random.normal(shape)).astype(mx.bfloat16)
            arrays = {name: w}
            stem = name.removesuffix(".weight")
            if a.mxfp4 and kind == "matrix" and len(shape) == 3:
                wq, scales = mx.quantize(w, 32, 4, mode="mxfp4")
                arrays = {name: wq, f"{stem}.scales": scales}
                quant[stem] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
            elif quant and kind in ("matrix", "router"):
                bits = 8 if kind == "router" else a.bits
                wq, scales, biases = mx.quantize(w, 64, bits)
                arrays = {name: wq, f"{stem}.scales": scales, f"{stem}.biases": biases}
                if kind == "router":
                    quant[stem] = {"group_size": 64, "bits": 8}
        mx.eval(list(arrays.values()))
        for k, v in arrays.items():
            shard[k] = v
            size += v.nbytes
            total += v.nbytes
        if size > 4 * 10**9:
            flush()
    flush()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    if quant:
        c["quantization"] = quant
        c["quantization_config"] = quant
    c["torch_dtype"] = "bfloat16"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]}, f)
    kit = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".device", "kit", "make-model.py")
    spec = importlib.util.spec_from_file_location("make_model", kit)
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    mm.make_tokenizer(a.out, a.shape, dict(c, model_type="qwen2"))
    print(f"{a.out}: {a.shape}, {c['num_hidden_layers']} layers, {total / 1e9:.2f} GB, "
          f"{'MXFP4 experts, 8-bit' if a.mxfp4 else '%d-bit' % a.bits if a.bits else 'bf16'}")


if __name__ == "__main__":
    main()
