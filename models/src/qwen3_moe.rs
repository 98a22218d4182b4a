//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B). Reference: mlx-lm `models/qwen3_moe.py`.
//! Qwen3's attention (per-head q/k norms) over Llama's decoder, with the MLP of every
//! `decoder_sparse_step`-th layer not in `mlp_only_layers` a mixture of `num_experts`
//! SwiGLU experts, `num_experts_per_tok` per token (`moe.rs`).

use crate::layers::Rope;
use crate::moe::MoeDims;
use crate::weights::Weights;
use crate::{llama, Result};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub moe_intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<serde_json::Value>,
    pub tie_word_embeddings: bool,
    pub norm_topk_prob: bool,
}

impl Config {
    /// Whether layer `i`'s MLP is the mixture of experts (mlx-lm's rule).
    pub fn is_sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && self.decoder_sparse_step > 0
            && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

pub fn load(c: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    let rope_theta = crate::qwen3::rope_theta(c.rope_theta, c.rope_parameters.as_ref())?;
    // mlx-lm's Qwen3-MoE uses plain RoPE whatever `rope_scaling` says.
    let rope = Rope::new(c.head_dim, rope_theta, false, None)?;
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
        moe: Some(MoeDims::qwen(
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.norm_topk_prob,
            (0..c.num_hidden_layers).map(|i| c.is_sparse(i)).collect(),
        )),
        windows: Vec::new(),
    };
    llama::Model::load_dims(&dims, rope, weights, options)
}
