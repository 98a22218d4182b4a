//! MiniCPM (OpenBMB's MiniCPM 1B/2B). Reference: mlx-lm `models/minicpm.py`. Llama's
//! decoder with three scalings: embeddings multiplied by `scale_emb`, each residual branch by
//! `scale_depth / sqrt(num_hidden_layers)`, and the final hidden state divided by
//! `hidden_size / dim_model_base` before the output head (an untied one; mlx-lm copies the
//! embeddings in as the head when a folder has none, and a tied model skips the division).

use crate::layers::Rope;
use crate::weights::Weights;
use crate::{llama, Error, Result};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub dim_model_base: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub num_key_value_heads: usize,
    pub scale_depth: f64,
    pub scale_emb: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// mlx-lm's default for MiniCPM (not Llama's 10,000).
fn default_rope_theta() -> f64 {
    1_000_000.0
}

impl Config {
    /// The Llama config this one's decoder is (head_dim = hidden_size / heads, no biases).
    pub(crate) fn llama(&self) -> llama::Config {
        llama::Config {
            hidden_size: self.hidden_size,
            num_hidden_layers: self.num_hidden_layers,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            rms_norm_eps: self.rms_norm_eps,
            vocab_size: self.vocab_size,
            head_dim: None,
            num_key_value_heads: Some(self.num_key_value_heads),
            attention_bias: false,
            mlp_bias: false,
            rope_theta: self.rope_theta,
            rope_traditional: self.rope_traditional,
            rope_scaling: self.rope_scaling.clone(),
            tie_word_embeddings: self.tie_word_embeddings,
            layer_types: None,
            sliding_window: None,
        }
    }
}

pub fn load(config: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    if config.dim_model_base == 0 || config.num_hidden_layers == 0 {
        return Err(Error::Invalid("minicpm: dim_model_base and num_hidden_layers must be positive".into()));
    }
    // As mlx-lm's `sanitize`: an untied model whose folder has no head uses the embeddings.
    if !config.tie_word_embeddings && !weights.contains("lm_head.weight") && !weights.contains("lm_head.scales") {
        for part in ["weight", "scales", "biases"] {
            let embedding = format!("model.embed_tokens.{part}");
            if weights.contains(&embedding) {
                let a = weights.get(&embedding)?;
                weights.insert(format!("lm_head.{part}"), a);
            }
        }
    }
    let llama = config.llama();
    let rope = Rope::new(
        config.hidden_size / config.num_attention_heads,
        config.rope_theta,
        config.rope_traditional,
        config.rope_scaling.as_ref(),
    )?;
    let model = llama::Model::load_dims(&llama.dims(), rope, weights, options)?;
    // Python floats, as mlx-lm computes them, then float32 scalars.
    let residual = config.scale_depth / (config.num_hidden_layers as f64).sqrt();
    let divisor = config.hidden_size as f64 / config.dim_model_base as f64;
    Ok(model.scaled(config.scale_emb as f32, residual as f32, divisor as f32))
}
