#!/usr/bin/env python3
"""make_hybrid.py SHAPE OUT [--quantize 4] [--seed N]

Runs ON THE DEVICE after `. /tmp/site/env.sh` (issue 44's side by side). Writes a random-weight
model of a real Qwen3.5 or Gemma 4 shape as mlx-lm saves one: mlx-lm 0.32.2's own model class
(`qwen3_5`, `gemma4_text`) built from the shape's config, its random initialization cast to
bfloat16 (a MoE quantized to 4 bits, group 64, with mlx-lm's quantization predicate: routers at
8 bits), saved with `mlx_lm.utils.save_model`; the tokenizer is the device kit's byte-level BPE
(`make-model.py`'s `make_tokenizer`) covering every id. Shapes (configs as the public
checkpoints give them; see bench/RESULTS.md for where they were read):

    qwen3.5-0.8b      24 layers, hidden 1024, DeltaNet 16 key / 16 value heads, tied embeddings (the CPU's)
    qwen3.5-4b        32 layers (every 4th full attention), hidden 2560, DeltaNet 16 key / 32 value heads
    qwen3.5-9b        32 layers, hidden 4096, DeltaNet 16 key / 32 value heads
    qwen3.5-27b       64 layers, hidden 5120, DeltaNet 16 key / 48 value heads
    qwen3.5-35b-a3b   40 layers, hidden 2048, 256 experts (8 per token) + a shared expert
    qwen3.5-35b-a3b-narrow  the same layers, experts and heads, hidden 256 (a step's dispatch)
    gemma4-e4b        42 layers, hidden 2560, per-layer inputs (256), the last 18 sharing KV
    gemma4-12b        48 layers, hidden 3840 (Gemma 3 12B's dimensions with Gemma 4's attention:
                      no published config was found in the reference material here)
    gemma4-26b-a4b    30 layers, hidden 2816, 128 experts (8 per token) beside the dense MLP

A quantized shape is quantized before it is evaluated and then evaluated layer by layer, so the
bfloat16 model never exists whole (a 35B-A3B's is 70 GB).
"""
import argparse
import importlib.util
import json
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

QWEN_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                   linear_num_value_heads=32, linear_value_head_dim=128, full_attention_interval=4,
                   head_dim=256, attn_output_gate=True, rms_norm_eps=1e-6, vocab_size=248320,
                   tie_word_embeddings=False, max_position_embeddings=262144,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})
GEMMA_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
              "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
GEMMA = dict(model_type="gemma4_text", head_dim=256, global_head_dim=512, vocab_size=262144, rms_norm_eps=1e-6,
             final_logit_softcapping=30.0, use_double_wide_mlp=False, tie_word_embeddings=True,
             rope_parameters=GEMMA_ROPE)


def gemma_layers(n):
    """Gemma 4's layer pattern: one global layer in six."""
    return ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n)]


SHAPES = {
    "qwen3.5-4b": ("qwen3_5", dict(QWEN_LINEAR, model_type="qwen3_5", hidden_size=2560, intermediate_size=9216,
                                   num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4)),
    "qwen3.5-0.8b": ("qwen3_5", dict(QWEN_LINEAR, model_type="qwen3_5", hidden_size=1024, intermediate_size=3584,
                                     num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                     linear_num_value_heads=16, tie_word_embeddings=True)),
    "qwen3.5-9b": ("qwen3_5", dict(QWEN_LINEAR, model_type="qwen3_5", hidden_size=4096, intermediate_size=12288,
                                   num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4)),
    "qwen3.5-27b": ("qwen3_5", dict(QWEN_LINEAR, model_type="qwen3_5", hidden_size=5120, intermediate_size=17408,
                                    num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                                    linear_num_value_heads=48)),
    "qwen3.5-35b-a3b": ("qwen3_5_moe", dict(QWEN_LINEAR, model_type="qwen3_5_moe", hidden_size=2048,
                                            intermediate_size=4096, num_hidden_layers=40, num_attention_heads=16,
                                            num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                            norm_topk_prob=True)),
    # The 35B-A3B's layers, experts and heads at a tenth of its widths: a step dispatches the
    # same kernels (what bounds the 35B-A3B's batch-1 step, bench/RESULTS.md session 34) and
    # the model builds in seconds, on the CPU too.
    "qwen3.5-35b-a3b-narrow": ("qwen3_5_moe", dict(QWEN_LINEAR, model_type="qwen3_5_moe", hidden_size=256,
                                                   intermediate_size=512, num_hidden_layers=40, num_attention_heads=16,
                                                   num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                                   moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                                   norm_topk_prob=True, linear_key_head_dim=32,
                                                   linear_value_head_dim=32, head_dim=64)),
    "gemma4-e4b": ("gemma4_text", dict(GEMMA, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
                                       num_attention_heads=8, num_key_value_heads=2, num_kv_shared_layers=18,
                                       hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                                       sliding_window=512, attention_k_eq_v=False, enable_moe_block=False,
                                       layer_types=gemma_layers(42))),
    "gemma4-12b": ("gemma4_text", dict(GEMMA, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                       num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=4,
                                       num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=1024,
                                       attention_k_eq_v=True, enable_moe_block=False, layer_types=gemma_layers(48))),
    "gemma4-26b-a4b": ("gemma4_text", dict(GEMMA, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                                           num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                                           num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=1024,
                                           attention_k_eq_v=True, enable_moe_block=True, num_experts=128,
                                           top_k_experts=8, moe_intermediate_size=704, layer_types=gemma_layers(30))),
}


def kit_tokenizer():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".device", "kit", "make-model.py")
    spec = importlib.util.spec_from_file_location("make_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_tokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--quantize", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="only the first N layers (a quick check of the script)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, "config.json")):
        print(f"{a.out}: exists")
        return
    from mlx_lm.utils import quantize_model, save_config, save_model
    module, config = SHAPES[a.shape]
    config = dict(config, eos_token_id=151643, bos_token_id=151643)
    if a.layers:
        config["num_hidden_layers"] = a.layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][: a.layers]
        if config.get("num_kv_shared_layers"):
            config["num_kv_shared_layers"] = a.layers // 3
    mx.random.seed(a.seed)
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # mlx-lm's random initialization, in bfloat16.
    dtype = getattr(mx, a.dtype)
    model.update(tree_map(lambda p: p.astype(dtype) if p.dtype == mx.float32 else p, model.parameters()))
    if a.quantize:
        model, config = quantize_model(model, config, 64, a.quantize)
        for layer in model.layers if hasattr(model, "layers") else []:
            mx.eval(layer.parameters())
    mx.eval(model.parameters())
    os.makedirs(a.out, exist_ok=True)
    save_model(a.out, model, donate_model=True)
    save_config(config, os.path.join(a.out, "config.json"))
    kit_tokenizer()(a.out, a.shape, dict(config, model_type="qwen2", max_position_embeddings=131072))
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 151643, "bos_token_id": 151643}, f)
    print(f"{a.out}: {a.shape}{' q' + str(a.quantize) if a.quantize else ''}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
