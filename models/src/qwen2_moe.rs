//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B). Reference: mlx-lm `models/qwen2_moe.py`.
//! Qwen2's attention (biased q/k/v) over Llama's decoder; every layer's MLP is a mixture of
//! `num_experts` SwiGLU experts, `num_experts_per_tok` per token (softmax then top-k, not
//! renormalized, as mlx-lm's block), plus a shared expert every token goes through, scaled
//! by `sigmoid(shared_expert_gate(x))` (`moe.rs`). mlx-lm's model ignores
//! `decoder_sparse_step`, `mlp_only_layers` and `norm_topk_prob`; so does this one.

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
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}

impl Config {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
}

pub fn load(c: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    let head_dim = c.hidden_size / c.num_attention_heads;
    let mut moe = MoeDims::qwen(
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        false,
        vec![true; c.num_hidden_layers],
    );
    moe.shared = Some(c.shared_expert_intermediate_size);
    let dims = llama::Dims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        ffn: c.intermediate_size,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.kv_heads(),
        head_dim,
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        tied: c.tie_word_embeddings,
        moe: Some(moe),
        windows: Vec::new(),
    };
    // mlx-lm's Qwen2-MoE checks that rope_scaling is linear, then uses plain RoPE.
    let rope = Rope::new(head_dim, c.rope_theta, c.rope_traditional, None)?;
    llama::Model::load_dims(&dims, rope, weights, options)
}
