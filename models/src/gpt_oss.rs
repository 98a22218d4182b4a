//! GPT-OSS (gpt-oss-20b, gpt-oss-120b). Reference: mlx-lm `models/gpt_oss.py`.
//! Llama's decoder with: biases on q/k/v/o; attention sinks (a learned logit per head in every
//! softmax); sliding-window layers (`layer_types`, alternating sliding and full by default);
//! YaRN RoPE; every MLP a mixture of experts whose router takes the top k logits and a softmax
//! over them, and whose experts (with biases) use `swiglu_oai` (`moe.rs`); an untied head.
//! Read in mlx-community's layout (experts stacked as `mlp.experts.{gate,up,down}_proj`);
//! OpenAI's original layout (`gate_up_proj` interleaved, MXFP4 blocks) is refused with a
//! message.

use crate::layers::Rope;
use crate::moe::{ExpertActivation, MoeDims, Router};
use crate::weights::Weights;
use crate::{llama, Error, Result};
use serde::Deserialize;

/// The config, with mlx-lm's `ModelArgs` defaults (gpt-oss-20b's shape).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_experts")]
    pub num_local_experts: usize,
    #[serde(default = "d_top_k")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_hidden")]
    pub intermediate_size: usize,
    #[serde(default = "d_head_dim")]
    pub head_dim: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d_window")]
    pub sliding_window: usize,
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    pub rope_scaling: Option<serde_json::Value>,
    pub layer_types: Option<Vec<String>>,
}

fn d_layers() -> usize {
    36
}
fn d_experts() -> usize {
    128
}
fn d_top_k() -> usize {
    4
}
fn d_vocab() -> usize {
    201088
}
fn d_eps() -> f64 {
    1e-5
}
fn d_hidden() -> usize {
    2880
}
fn d_head_dim() -> usize {
    64
}
fn d_heads() -> usize {
    64
}
fn d_kv_heads() -> usize {
    8
}
fn d_window() -> usize {
    128
}
fn d_rope_theta() -> f64 {
    150000.0
}

impl Config {
    /// Each layer's sliding window, `None` for a full-attention layer.
    pub fn windows(&self) -> Result<Vec<Option<usize>>> {
        let types: Vec<String> = match &self.layer_types {
            Some(t) => t.clone(),
            None => ["sliding_attention", "full_attention"]
                .iter()
                .cycle()
                .take(self.num_hidden_layers)
                .map(|s| s.to_string())
                .collect(),
        };
        llama::layer_windows(&types, self.num_hidden_layers, Some(self.sliding_window))
    }
}

pub fn load(c: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    if weights.names().any(|n| n.contains("gate_up_proj")) {
        return Err(Error::Invalid(
            "this GPT-OSS checkpoint is in OpenAI's original layout (gate_up_proj, MXFP4 blocks); \
             convert it with `mlx_lm.convert` (or use an mlx-community copy) and load that folder"
                .into(),
        ));
    }
    let rope = Rope::new(c.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?;
    let dims = llama::Dims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        ffn: c.intermediate_size,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: false,
        qk_norm: false,
        tied: false,
        moe: Some(MoeDims {
            experts: c.num_local_experts,
            top_k: c.num_experts_per_tok,
            ffn: c.intermediate_size,
            norm_topk_prob: false,
            sparse: vec![true; c.num_hidden_layers],
            router: Router::TopKSoftmax,
            activation: ExpertActivation::SwigluOai,
            bias: true,
            names: ("router", "experts"),
            shared: None,
        }),
        windows: c.windows()?,
    };
    llama::Model::load_dims(&dims, rope, weights, options)
}
