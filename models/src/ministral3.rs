//! Ministral 3 (Ministral 3 3B/8B/14B, Devstral Small 2's text model; it comes inside
//! `mistral3` folders). Reference: mlx-lm `models/ministral3.py`. Llama's decoder, with
//! sliding layers from `layer_types`, RoPE from `rope_parameters` (YaRN in the released
//! models), and Llama 4's query scale by position: after RoPE, queries are multiplied by
//! `1 + llama_4_scaling_beta * ln(1 + floor(position / original_max_position_embeddings))`.

use crate::layers::Rope;
use crate::weights::Weights;
use crate::{llama, Error, Result};
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub head_dim: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub rope_parameters: Value,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<usize>,
}

fn default_true() -> bool {
    true
}

impl Config {
    /// The Llama config this one's decoder is.
    fn llama(&self) -> Result<llama::Config> {
        let number = |key: &str| self.rope_parameters.get(key).and_then(Value::as_f64);
        Ok(llama::Config {
            hidden_size: self.hidden_size,
            num_hidden_layers: self.num_hidden_layers,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            rms_norm_eps: self.rms_norm_eps,
            vocab_size: self.vocab_size,
            head_dim: self.head_dim,
            num_key_value_heads: self.num_key_value_heads,
            attention_bias: false,
            mlp_bias: false,
            rope_theta: number("rope_theta")
                .ok_or_else(|| Error::Invalid("ministral3: rope_parameters needs a numeric `rope_theta`".into()))?,
            rope_traditional: false,
            rope_scaling: Some(self.rope_parameters.clone()),
            tie_word_embeddings: self.tie_word_embeddings,
            layer_types: self.layer_types.clone(),
            sliding_window: self.sliding_window,
        })
    }

    /// (beta, original context length) of the query scale.
    fn query_scale(&self) -> Result<(f32, f32)> {
        let number = |key: &str| {
            self.rope_parameters.get(key).and_then(Value::as_f64).ok_or_else(|| {
                Error::Invalid(format!("ministral3: rope_parameters needs a numeric `{key}` (the query scale's)"))
            })
        };
        Ok((number("llama_4_scaling_beta")? as f32, number("original_max_position_embeddings")? as f32))
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }
}

pub fn load(c: &Config, weights: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    let (beta, original) = c.query_scale()?;
    let l = c.llama()?;
    let rope = Rope::new(c.head_dim(), l.rope_theta, false, l.rope_scaling.as_ref())?;
    let dims = llama::Dims { windows: l.windows()?, ..l.dims() };
    Ok(llama::Model::load_dims(&dims, rope, weights, options)?.position_scaled(beta, original))
}
