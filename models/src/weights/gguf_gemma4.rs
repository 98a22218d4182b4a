//! Gemma 4 GGUF files (llama.cpp's `gemma4`) back to what `gemma4.rs` loads: HF names and a
//! `gemma4_text` config.
//!
//! llama.cpp's converter (`conversion/gemma.py`: `Gemma4Model`) writes the checkpoint mostly
//! as it is (Gemma 4's norms scale by the weight itself, so none is shifted), with:
//! - per-layer values as metadata arrays: `feed_forward_length` (double-wide MLPs in the
//!   KV-shared layers), `attention.head_count_kv` (full layers' KV heads), the sliding layers
//!   as `attention.sliding_window_pattern`; the full layers' head size as `key_length`, the
//!   sliding layers' as `key_length_swa`;
//! - the full layers' proportional RoPE as a `rope_freqs` tensor: 1 for each rotated pair,
//!   1e30 for the rest (read back as the config's `partial_rotary_factor`, then dropped);
//! - `layer_scalar` as `layer_output_scale.weight`, `router.scale` as `ffn_gate_inp.scale`,
//!   `router.per_expert_scale` as `ffn_down_exps.scale`, the fused experts `[E, 2I, H]` as
//!   `ffn_gate_up_exps` (older files: `ffn_gate_exps` and `ffn_up_exps`);
//! - a KV-shared layer takes its keys and values from the last unshared layer of its kind, as
//!   in mlx-lm (llama.cpp assumes the unshared layers end sliding, full, as every Gemma 4
//!   does; there both rules agree);
//! - the vocabulary as tokenizer model `gemma4`: SentencePiece-style BPE with its merges
//!   (`gguf.rs` builds it).

use crate::{Error, Result};
use mlx::Array;
use serde_json::{json, Value};
use std::collections::HashMap;

/// GGUF block tensor names of `gemma4` to HF module names (where they differ from the other
/// architectures'; see `gguf.rs`).
pub const LAYER_MAP: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
    ("pre_ffw_norm_2", "pre_feedforward_layernorm_2"),
    ("post_ffw_norm_1", "post_feedforward_layernorm_1"),
    ("post_ffw_norm_2", "post_feedforward_layernorm_2"),
    ("inp_gate", "per_layer_input_gate"),
    ("proj", "per_layer_projection"),
    ("post_norm", "post_per_layer_input_norm"),
    ("layer_output_scale", "layer_scalar"),
    ("ffn_gate_inp", "router.proj"),
    ("ffn_gate_up_exps", "experts.switch_glu.gate_up_proj"),
    ("ffn_gate_exps", "experts.switch_glu.gate_proj"),
    ("ffn_up_exps", "experts.switch_glu.up_proj"),
    ("ffn_down_exps", "experts.switch_glu.down_proj"),
];

/// The model-level tensors of the per-layer inputs (e-series).
pub const TOP_MAP: &[(&str, &str)] = &[
    ("per_layer_token_embd", "model.embed_tokens_per_layer"),
    ("per_layer_model_proj", "model.per_layer_model_projection"),
    ("per_layer_proj_norm", "model.per_layer_projection_norm"),
];

/// The full layers' RoPE table (read for the config, not a weight).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The HF name of a suffix-less `X.scale` tensor: the router's input scale and its per-expert
/// output scale.
pub fn scale_name(gguf: &str) -> Option<String> {
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, kind) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match kind {
        "ffn_gate_inp.scale" => "router.scale",
        "ffn_down_exps.scale" => "router.per_expert_scale",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// What the config is read from besides the scalar metadata.
pub struct Source<'a> {
    /// `{arch}.key` as a list of integers (a scalar as a list of one), if present.
    pub ints: &'a dyn Fn(&str) -> Result<Option<Vec<i64>>>,
    /// `{arch}.key` as a number, if present.
    pub num: &'a dyn Fn(&str) -> Result<Option<f64>>,
    /// The `rope_freqs` tensor's values, if the file has one.
    pub rope_freqs: Option<Vec<f32>>,
    pub tensors: &'a HashMap<String, Array>,
    pub err: &'a dyn Fn(String) -> Error,
}

/// The `config.json` of a `gemma4` file: `base` (the fields every architecture has) with
/// Gemma 4's per-layer fields.
pub fn config(mut base: Value, s: &Source<'_>) -> Result<Value> {
    let need = |k: &str| -> Result<Vec<i64>> {
        (s.ints)(k)?.ok_or_else(|| (s.err)(format!("missing metadata key \"gemma4.{k}\"")))
    };
    let layers = base["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let per_layer = |k: &str, v: Vec<i64>| -> Result<Vec<i64>> {
        match v.len() {
            1 => Ok(vec![v[0]; layers]),
            n if n == layers => Ok(v),
            n => Err((s.err)(format!("gemma4.{k} has {n} values for {layers} layers"))),
        }
    };
    let sliding: Vec<bool> = per_layer("attention.sliding_window_pattern", need("attention.sliding_window_pattern")?)?
        .iter()
        .map(|&v| v != 0)
        .collect();
    let types: Vec<&str> = sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
    let shared = (s.num)("attention.shared_kv_layers")?.unwrap_or(0.0) as usize;
    if shared >= layers {
        return Err((s.err)(format!("{shared} KV-shared layers leave none of the {layers} computing keys")));
    }
    let first_shared = layers - shared;
    let ffn = per_layer("feed_forward_length", need("feed_forward_length")?)?;
    let double_wide = shared > 0 && ffn[first_shared..].iter().all(|&f| f == 2 * ffn[0]) && ffn[first_shared] != ffn[0];
    let kv = per_layer("attention.head_count_kv", need("attention.head_count_kv")?)?;
    let kv_sliding = sliding.iter().position(|&s| s).map_or(kv[0], |i| kv[i]);
    let kv_full = sliding.iter().position(|&s| !s).map(|i| kv[i]);
    let full_hd = need("attention.key_length")?[0] as usize;
    let swa_hd = (s.num)("attention.key_length_swa")?.map_or(full_hd, |v| v as usize);
    // Keys as values: a full layer with keys of its own and no value projection.
    let has = |l: usize, t: &str| s.tensors.keys().any(|n| n.starts_with(&format!("model.layers.{l}.self_attn.{t}.")));
    let k_eq_v = (0..first_shared).any(|l| !sliding[l] && has(l, "k_proj") && !has(l, "v_proj"));
    // Proportional RoPE: the share of the full layers' pairs that rotate.
    let full_rope = match &s.rope_freqs {
        Some(f) => {
            let rotated = f.iter().take_while(|&&v| v < 1e29).count();
            json!({"rope_type": "proportional", "rope_theta": base["rope_theta"],
                   "partial_rotary_factor": 2.0 * rotated as f64 / full_hd.max(1) as f64})
        }
        None => {
            let dims = (s.num)("rope.dimension_count")?.unwrap_or(full_hd as f64);
            json!({"rope_type": "default", "rope_theta": base["rope_theta"],
                   "partial_rotary_factor": dims / full_hd.max(1) as f64})
        }
    };
    let swa_dims = (s.num)("rope.dimension_count_swa")?.unwrap_or(swa_hd as f64);
    let swa_theta = (s.num)("rope.freq_base_swa")?.unwrap_or(10000.0) as f32 as f64;
    let ple = (s.num)("embedding_length_per_layer_input")?.unwrap_or(0.0) as usize;
    let ple_vocab = s.tensors.get("model.embed_tokens_per_layer.weight").map(|a| a.dim(0));
    let vocab = s.tensors.get("model.embed_tokens.weight").map(|a| a.dim(0));
    let experts = (s.num)("expert_count")?.unwrap_or(0.0) as usize;
    let o = base.as_object_mut().expect("a config object");
    o.insert("model_type".into(), json!("gemma4_text"));
    o.insert("intermediate_size".into(), json!(ffn[0]));
    o.insert("use_double_wide_mlp".into(), json!(double_wide));
    o.insert("num_key_value_heads".into(), json!(kv_sliding));
    o.insert("num_global_key_value_heads".into(), json!(kv_full));
    o.insert("attention_k_eq_v".into(), json!(k_eq_v));
    o.insert("head_dim".into(), json!(swa_hd));
    o.insert("global_head_dim".into(), json!(full_hd));
    o.insert("layer_types".into(), json!(types));
    o.insert("num_kv_shared_layers".into(), json!(shared));
    o.insert(
        "sliding_window".into(),
        json!((s.num)("attention.sliding_window")?
            .ok_or_else(|| (s.err)("missing metadata key \"gemma4.attention.sliding_window\"".into()))?
            as usize),
    );
    o.insert(
        "rope_parameters".into(),
        json!({"full_attention": full_rope, "sliding_attention": {"rope_type": "default", "rope_theta": swa_theta,
            "partial_rotary_factor": swa_dims / swa_hd.max(1) as f64}}),
    );
    o.insert("final_logit_softcapping".into(), json!((s.num)("final_logit_softcapping")?));
    o.insert("hidden_size_per_layer_input".into(), json!(ple));
    if let Some(v) = ple_vocab {
        o.insert("vocab_size_per_layer_input".into(), json!(v));
    }
    if let Some(v) = vocab {
        o.insert("vocab_size".into(), json!(v));
    }
    o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    o.insert("enable_moe_block".into(), json!(experts > 0));
    if experts > 0 {
        let need = |k: &str| need(k).map(|v| v[0] as usize);
        o.insert("num_experts".into(), json!(experts));
        o.insert("top_k_experts".into(), json!(need("expert_used_count")?));
        o.insert("moe_intermediate_size".into(), json!(need("expert_feed_forward_length")?));
    }
    Ok(base)
}

/// Undoes the converter's renames in `tensors` (HF names, as the GGUF's were mapped): the
/// layer scalars lose the `.weight` the converter gave them (fused experts are split by
/// `gguf.rs`).
pub fn restore(tensors: &mut HashMap<String, Array>) -> Result<()> {
    let names: Vec<String> = tensors.keys().filter(|n| n.ends_with(".layer_scalar.weight")).cloned().collect();
    for name in names {
        let a = tensors.remove(&name).expect("listed");
        let stem = name.trim_end_matches(".layer_scalar.weight");
        tensors.insert(format!("{stem}.layer_scalar"), a.reshape(&[1])?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::arange;

    /// The renames `restore` undoes: a layer scalar back to its suffix-less `[1]`; the router's
    /// scales named.
    #[test]
    fn layer_scalars_lose_their_suffix_and_scales_are_named() {
        let mut t = HashMap::new();
        let p = "model.layers.3";
        t.insert(format!("{p}.layer_scalar.weight"), arange(&[1]));
        restore(&mut t).unwrap();
        assert_eq!(t[&format!("{p}.layer_scalar")].shape(), vec![1]);
        assert!(!t.keys().any(|k| k.ends_with("layer_scalar.weight")));
        assert_eq!(scale_name("blk.3.ffn_gate_inp.scale").as_deref(), Some("model.layers.3.router.scale"));
        assert_eq!(scale_name("blk.0.ffn_down_exps.scale").as_deref(), Some("model.layers.0.router.per_expert_scale"));
        assert_eq!(scale_name("blk.0.attn_q.scale"), None);
    }
}
