//! Qwen3 (dense). Reference: mlx-lm `models/qwen3.py`.
//! Differs from Llama in RMSNorm on each head of q and k (before RoPE), an explicit
//! `head_dim`, and reading `rope_parameters` (transformers 5 configs) when `rope_theta` is absent.

use crate::layers::Rope;
use crate::weights::Weights;
use crate::{llama, Error, Result};
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
    pub head_dim: usize,
    pub tie_word_embeddings: bool,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_parameters: Option<serde_json::Value>,
}

/// A config's `rope_theta`, or (transformers 5) `rope_parameters.rope_theta`.
pub(crate) fn rope_theta(theta: Option<f64>, parameters: Option<&serde_json::Value>) -> Result<f64> {
    theta
        .or_else(|| parameters.and_then(|p| p.get("rope_theta")).and_then(|v| v.as_f64()))
        .ok_or_else(|| Error::Invalid("rope_theta is missing from the model config".into()))
}

/// Llama's decoder with Qwen3's per-head q/k norms.
pub fn load(c: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    let rope_theta = rope_theta(c.rope_theta, c.rope_parameters.as_ref())?;
    let scaling = c.rope_scaling.as_ref().or(c.rope_parameters.as_ref());
    let rope = Rope::new(c.head_dim, rope_theta, false, scaling)?;
    let dims = llama::Dims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        ffn: c.intermediate_size,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: true,
        tied: c.tie_word_embeddings,
        moe: None,
        windows: Vec::new(),
    };
    llama::Model::load_dims(&dims, rope, weights, options)
}
