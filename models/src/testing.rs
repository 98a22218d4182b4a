//! Tiny random-weight models (hidden 64, two layers, vocab 128) for tests in this and
//! dependent crates: shapes, cache behaviour and decode-loop logic, not output quality.

use crate::weights::Weights;
use crate::{Arch, CausalLm, Result};
use mlx::{random, Array, Dtype};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// Vocabulary of `byte_tokenizer_json`: two specials and the 256 byte symbols.
pub const BYTE_VOCAB: usize = 258;

/// A ChatML template like SmolLM2's.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

pub const VOCAB: usize = 128;
const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const FFN: usize = 128;

/// Gemma 3's sliding window in the tiny `gemma3_text` (layer 0 slides, layer 1 is global).
pub const GEMMA_WINDOW: usize = 8;

/// Experts and their MLP width in the tiny `qwen3_moe`.
const MOE_EXPERTS: usize = 4;
const MOE_FFN: usize = 32;

/// Gated DeltaNet heads and widths in the tiny `qwen3_5` (layer 0 is a DeltaNet layer, layer
/// 1 a gated full-attention one).
const LINEAR_K_HEADS: usize = 2;
const LINEAR_V_HEADS: usize = 4;
const LINEAR_DIM: usize = 16;
const LINEAR_KERNEL: usize = 4;

/// The `config.json` of a tiny model of `model_type` (llama, qwen2, qwen3, qwen3_moe,
/// qwen2_moe, gemma3_text, gpt_oss, phi3 or qwen3_5).
pub fn config(model_type: &str) -> Value {
    let mut c = json!({
        "model_type": model_type,
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 10000.0,
        "tie_word_embeddings": !matches!(model_type, "llama" | "gpt_oss" | "phi3" | "qwen2_moe"),
        "eos_token_id": 2, "bos_token_id": 1,
    });
    if model_type == "qwen3_moe" {
        // Layer 0 is a mixture of 4 experts (2 per token), layer 1 a dense MLP.
        c["num_experts"] = json!(MOE_EXPERTS);
        c["num_experts_per_tok"] = json!(2);
        c["decoder_sparse_step"] = json!(1);
        c["mlp_only_layers"] = json!([1]);
        c["moe_intermediate_size"] = json!(MOE_FFN);
        c["norm_topk_prob"] = json!(true);
    }
    if model_type == "qwen2_moe" {
        // Every layer: 4 experts (2 per token) and a shared expert of width FFN.
        c["num_experts"] = json!(MOE_EXPERTS);
        c["num_experts_per_tok"] = json!(2);
        c["moe_intermediate_size"] = json!(MOE_FFN);
        c["shared_expert_intermediate_size"] = json!(FFN);
    }
    if model_type == "gpt_oss" {
        // Layer 0 slides (window 8), layer 1 attends fully; 4 experts, 2 per token; YaRN.
        c["num_local_experts"] = json!(MOE_EXPERTS);
        c["num_experts_per_tok"] = json!(2);
        c["sliding_window"] = json!(GEMMA_WINDOW);
        c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0});
        c["tie_word_embeddings"] = json!(false);
    }
    if model_type == "phi3" {
        // RoPE over 12 of the 16 head dims, longrope scaling (a context grown 32x).
        c["partial_rotary_factor"] = json!(0.75);
        c["max_position_embeddings"] = json!(131072);
        c["original_max_position_embeddings"] = json!(4096);
        c["rope_scaling"] = json!({"type": "longrope", "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0],
            "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]});
        c["tie_word_embeddings"] = json!(false);
    }
    if model_type == "ministral3" {
        // YaRN over an original context of 8 positions, so the query scale grows from
        // position 8 on; layer 0 slides (window 8).
        c["rope_parameters"] = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1, "rope_theta": 1000000.0});
        c["layer_types"] = json!(["sliding_attention", "full_attention"]);
        c["sliding_window"] = json!(GEMMA_WINDOW);
    }
    if model_type == "qwen3_5" {
        c["full_attention_interval"] = json!(2);
        c["linear_num_key_heads"] = json!(LINEAR_K_HEADS);
        c["linear_num_value_heads"] = json!(LINEAR_V_HEADS);
        c["linear_key_head_dim"] = json!(LINEAR_DIM);
        c["linear_value_head_dim"] = json!(LINEAR_DIM);
        c["linear_conv_kernel_dim"] = json!(LINEAR_KERNEL);
        c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25});
    }
    if model_type == "gemma3_text" {
        c["sliding_window"] = json!(GEMMA_WINDOW);
        c["sliding_window_pattern"] = json!(LAYERS);
        c["query_pre_attn_scalar"] = json!(HEAD_DIM);
    }
    c
}

/// Deterministic random weights for `config(model_type)`, named as in HF checkpoints.
pub fn weights(model_type: &str, seed: u64) -> Result<HashMap<String, Array>> {
    weights_with_vocab(model_type, seed, VOCAB)
}

/// As `weights`, with a vocabulary of `vocab` tokens.
pub fn weights_with_vocab(model_type: &str, seed: u64, vocab: usize) -> Result<HashMap<String, Array>> {
    let mut counter = 0u64;
    let mut w = HashMap::new();
    let mut add = |name: String, shape: &[usize], scale: f32| -> Result<()> {
        counter += 1;
        let key = random::key(seed.wrapping_mul(1_000_003).wrapping_add(counter))?;
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let u = random::uniform(&dims, &key)?;
        let a = u
            .multiply(&Array::scalar(2.0 * scale, Dtype::Float32)?)?
            .subtract(&Array::scalar(scale, Dtype::Float32)?)?;
        a.eval()?;
        w.insert(name, a);
        Ok(())
    };
    let lin = |cols: usize| (3.0 / cols as f32).sqrt();
    add("model.embed_tokens.weight".into(), &[vocab, HIDDEN], 1.0)?;
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        if model_type == "qwen3_5" {
            // MLX's layout (a conv1d weight [C, K, 1]): as mlx-community ships it.
            if i == 0 {
                let a = format!("{p}.linear_attn");
                let (key_dim, value_dim) = (LINEAR_K_HEADS * LINEAR_DIM, LINEAR_V_HEADS * LINEAR_DIM);
                let conv_dim = 2 * key_dim + value_dim;
                add(format!("{a}.in_proj_qkv.weight"), &[conv_dim, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.in_proj_z.weight"), &[value_dim, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.in_proj_b.weight"), &[LINEAR_V_HEADS, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.in_proj_a.weight"), &[LINEAR_V_HEADS, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.conv1d.weight"), &[conv_dim, LINEAR_KERNEL, 1], 0.5)?;
                add(format!("{a}.dt_bias"), &[LINEAR_V_HEADS], 1.0)?;
                add(format!("{a}.A_log"), &[LINEAR_V_HEADS], 1.0)?;
                add(format!("{a}.norm.weight"), &[LINEAR_DIM], 1.0)?;
                add(format!("{a}.out_proj.weight"), &[HIDDEN, value_dim], lin(value_dim))?;
            } else {
                let a = format!("{p}.self_attn");
                add(format!("{a}.q_proj.weight"), &[2 * HEADS * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.k_proj.weight"), &[KV_HEADS * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.v_proj.weight"), &[KV_HEADS * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
                add(format!("{a}.o_proj.weight"), &[HIDDEN, HEADS * HEAD_DIM], lin(HEADS * HEAD_DIM))?;
                add(format!("{a}.q_norm.weight"), &[HEAD_DIM], 1.0)?;
                add(format!("{a}.k_norm.weight"), &[HEAD_DIM], 1.0)?;
            }
            add(format!("{p}.mlp.gate_proj.weight"), &[FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.mlp.up_proj.weight"), &[FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.mlp.down_proj.weight"), &[HIDDEN, FFN], lin(FFN))?;
            add(format!("{p}.input_layernorm.weight"), &[HIDDEN], 1.0)?;
            add(format!("{p}.post_attention_layernorm.weight"), &[HIDDEN], 1.0)?;
            continue;
        }
        if model_type == "phi3" {
            // Phi-3's checkpoints store q/k/v and gate/up fused.
            add(format!("{p}.self_attn.qkv_proj.weight"), &[(HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.self_attn.o_proj.weight"), &[HIDDEN, HEADS * HEAD_DIM], lin(HEADS * HEAD_DIM))?;
            add(format!("{p}.mlp.gate_up_proj.weight"), &[2 * FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.mlp.down_proj.weight"), &[HIDDEN, FFN], lin(FFN))?;
            add(format!("{p}.input_layernorm.weight"), &[HIDDEN], 1.0)?;
            add(format!("{p}.post_attention_layernorm.weight"), &[HIDDEN], 1.0)?;
            continue;
        }
        add(format!("{p}.self_attn.q_proj.weight"), &[HEADS * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
        add(format!("{p}.self_attn.k_proj.weight"), &[KV_HEADS * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
        add(format!("{p}.self_attn.v_proj.weight"), &[KV_HEADS * HEAD_DIM, HIDDEN], lin(HIDDEN))?;
        add(format!("{p}.self_attn.o_proj.weight"), &[HIDDEN, HEADS * HEAD_DIM], lin(HEADS * HEAD_DIM))?;
        if matches!(model_type, "qwen2" | "gpt_oss" | "qwen2_moe") {
            add(format!("{p}.self_attn.q_proj.bias"), &[HEADS * HEAD_DIM], 0.1)?;
            add(format!("{p}.self_attn.k_proj.bias"), &[KV_HEADS * HEAD_DIM], 0.1)?;
            add(format!("{p}.self_attn.v_proj.bias"), &[KV_HEADS * HEAD_DIM], 0.1)?;
        }
        if matches!(model_type, "qwen3" | "qwen3_moe" | "gemma3_text") {
            add(format!("{p}.self_attn.q_norm.weight"), &[HEAD_DIM], 1.0)?;
            add(format!("{p}.self_attn.k_norm.weight"), &[HEAD_DIM], 1.0)?;
        }
        if model_type == "gpt_oss" {
            add(format!("{p}.self_attn.o_proj.bias"), &[HIDDEN], 0.1)?;
            add(format!("{p}.self_attn.sinks"), &[HEADS], 1.0)?;
            add(format!("{p}.mlp.router.weight"), &[MOE_EXPERTS, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.mlp.router.bias"), &[MOE_EXPERTS], 0.1)?;
            let x = format!("{p}.mlp.experts");
            add(format!("{x}.gate_proj.weight"), &[MOE_EXPERTS, FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{x}.up_proj.weight"), &[MOE_EXPERTS, FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{x}.down_proj.weight"), &[MOE_EXPERTS, HIDDEN, FFN], lin(FFN))?;
            add(format!("{x}.gate_proj.bias"), &[MOE_EXPERTS, FFN], 0.1)?;
            add(format!("{x}.up_proj.bias"), &[MOE_EXPERTS, FFN], 0.1)?;
            add(format!("{x}.down_proj.bias"), &[MOE_EXPERTS, HIDDEN], 0.1)?;
        } else if model_type == "qwen2_moe" {
            // Stacked experts (mlx-community's layout) and the gated shared expert.
            add(format!("{p}.mlp.gate.weight"), &[MOE_EXPERTS, HIDDEN], lin(HIDDEN))?;
            let x = format!("{p}.mlp.switch_mlp");
            add(format!("{x}.gate_proj.weight"), &[MOE_EXPERTS, MOE_FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{x}.up_proj.weight"), &[MOE_EXPERTS, MOE_FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{x}.down_proj.weight"), &[MOE_EXPERTS, HIDDEN, MOE_FFN], lin(MOE_FFN))?;
            let s = format!("{p}.mlp.shared_expert");
            add(format!("{s}.gate_proj.weight"), &[FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{s}.up_proj.weight"), &[FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{s}.down_proj.weight"), &[HIDDEN, FFN], lin(FFN))?;
            add(format!("{p}.mlp.shared_expert_gate.weight"), &[1, HIDDEN], lin(HIDDEN))?;
        } else if model_type == "qwen3_moe" && i == 0 {
            // Hugging Face's layout: one module per expert (loading stacks them).
            add(format!("{p}.mlp.gate.weight"), &[MOE_EXPERTS, HIDDEN], lin(HIDDEN))?;
            for e in 0..MOE_EXPERTS {
                let x = format!("{p}.mlp.experts.{e}");
                add(format!("{x}.gate_proj.weight"), &[MOE_FFN, HIDDEN], lin(HIDDEN))?;
                add(format!("{x}.up_proj.weight"), &[MOE_FFN, HIDDEN], lin(HIDDEN))?;
                add(format!("{x}.down_proj.weight"), &[HIDDEN, MOE_FFN], lin(MOE_FFN))?;
            }
        } else {
            add(format!("{p}.mlp.gate_proj.weight"), &[FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.mlp.up_proj.weight"), &[FFN, HIDDEN], lin(HIDDEN))?;
            add(format!("{p}.mlp.down_proj.weight"), &[HIDDEN, FFN], lin(FFN))?;
        }
        add(format!("{p}.input_layernorm.weight"), &[HIDDEN], 1.0)?;
        add(format!("{p}.post_attention_layernorm.weight"), &[HIDDEN], 1.0)?;
        if model_type == "gemma3_text" {
            add(format!("{p}.pre_feedforward_layernorm.weight"), &[HIDDEN], 1.0)?;
            add(format!("{p}.post_feedforward_layernorm.weight"), &[HIDDEN], 1.0)?;
        }
    }
    add("model.norm.weight".into(), &[HIDDEN], 1.0)?;
    if matches!(model_type, "llama" | "gpt_oss" | "phi3" | "qwen2_moe") {
        add("lm_head.weight".into(), &[vocab, HIDDEN], 1.0)?;
    }
    Ok(w)
}

/// A tiny random model of `model_type`.
pub fn model(model_type: &str, seed: u64) -> Result<Box<dyn CausalLm>> {
    let mut w = Weights::new(weights(model_type, seed)?, Path::new("<tiny random>"), model_type);
    model_from(model_type, &mut w, &Default::default())
}

/// A tiny model of `model_type` built from `weights` (changed as loading changes them: cut
/// to a shard, projections fused) with `options`.
pub fn model_from(model_type: &str, weights: &mut Weights, options: &crate::LoadOptions) -> Result<Box<dyn CausalLm>> {
    Arch::parse(&config(model_type), Path::new("<tiny random>"))?.model(weights, options)
}

/// A byte-level BPE `tokenizer.json` with no merges: `<|im_start|>` (0), `<|im_end|>` (1),
/// then the 256 byte symbols.
pub fn byte_tokenizer_json() -> Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<|im_start|>".into(), json!(0));
    vocab.insert("<|im_end|>".into(), json!(1));
    // The alphabet is a hash set: sort it so ids are the same in every call.
    let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    for (i, c) in alphabet.into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(i + 2));
    }
    let special = |id: u32, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "added_tokens": [special(0, "<|im_start|>"), special(1, "<|im_end|>")],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []}
    })
}

/// Writes a complete tiny model folder (config, safetensors, byte tokenizer with a ChatML
/// template; `<|im_end|>` is EOS) into `dir`.
pub fn write_model(dir: &Path, model_type: &str, seed: u64) -> Result<()> {
    let io = |e: std::io::Error| crate::Error::Io { path: dir.to_path_buf(), source: e };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut cfg = config(model_type);
    cfg["vocab_size"] = json!(BYTE_VOCAB);
    cfg["eos_token_id"] = json!(1);
    std::fs::write(dir.join("config.json"), cfg.to_string()).map_err(io)?;
    let weights = weights_with_vocab(model_type, seed, BYTE_VOCAB)?;
    let refs: Vec<(&str, &Array)> = weights.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_safetensors(&dir.join("model.safetensors"), &refs)?;
    std::fs::write(dir.join("tokenizer.json"), byte_tokenizer_json().to_string()).map_err(io)?;
    let tok_config = json!({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"});
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).map_err(io)?;
    Ok(())
}
