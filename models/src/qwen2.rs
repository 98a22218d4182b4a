//! Qwen2 / Qwen2.5. Reference: mlx-lm `models/qwen2.py`.
//! Differs from Llama only in biased q/k/v projections (o_proj has none) and in its
//! config defaults (tied embeddings, rope_theta 1e6), so it reuses Llama's block.

use crate::layers::Rope;
use crate::weights::Weights;
use crate::{llama, Result};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}
fn default_true() -> bool {
    true
}

/// Llama's decoder with Qwen2's biases and defaults.
pub fn load(c: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    let head_dim = c.hidden_size / c.num_attention_heads;
    let dims = llama::Dims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        ffn: c.intermediate_size,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.num_key_value_heads,
        head_dim,
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        tied: c.tie_word_embeddings,
        moe: None,
        windows: Vec::new(),
    };
    let rope = Rope::new(head_dim, c.rope_theta, c.rope_traditional, c.rope_scaling.as_ref())?;
    llama::Model::load_dims(&dims, rope, weights, options)
}
