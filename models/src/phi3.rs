//! Phi-3 / Phi-3.5 / Phi-4-mini. Reference: mlx-lm `models/phi3.py`.
//! Llama's decoder with q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`: read as
//! the decoder's own fused projections), RoPE over the first `partial_rotary_factor` of each
//! head, and "longrope"/"su" scaling (`Rope::su_scaled`) or linear scaling.

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
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<Value>,
    #[serde(default = "d_one")]
    pub partial_rotary_factor: f64,
    #[serde(default = "d_max")]
    pub max_position_embeddings: f64,
    #[serde(default = "d_original")]
    pub original_max_position_embeddings: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn d_theta() -> f64 {
    10000.0
}
fn d_one() -> f64 {
    1.0
}
fn d_max() -> f64 {
    131072.0
}
fn d_original() -> f64 {
    4096.0
}

impl Config {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// mlx-lm's choice: SuScaledRoPE for "longrope"/"su", a scaled `nn.RoPE` for "linear",
    /// plain RoPE otherwise (mlx-lm warns and drops other types).
    fn rope(&self) -> Result<Rope> {
        let dims = (self.head_dim() as f64 * self.partial_rotary_factor) as usize;
        let scaling = self.rope_scaling.as_ref().filter(|s| !s.is_null());
        let kind = scaling.and_then(|s| s.get("type").or_else(|| s.get("rope_type"))).and_then(Value::as_str);
        match (kind, scaling) {
            (Some("longrope" | "su"), Some(s)) => {
                let long = s
                    .get("long_factor")
                    .ok_or_else(|| Error::Invalid("rope_scaling of type longrope needs `long_factor`".into()))?;
                Rope::su_scaled(
                    dims,
                    self.rope_theta,
                    self.max_position_embeddings,
                    self.original_max_position_embeddings,
                    long,
                    s.get("long_mscale").and_then(Value::as_f64),
                )
            }
            (Some("linear"), Some(s)) => Rope::new(dims, self.rope_theta, self.rope_traditional, Some(s)),
            _ => Rope::new(dims, self.rope_theta, self.rope_traditional, None),
        }
    }
}

pub fn load(c: &Config, w: &mut Weights, options: &crate::LoadOptions) -> Result<llama::Model> {
    if options.tensor_parallel.is_some_and(|g| g.size > 1) {
        return Err(Error::Invalid("tensor parallelism over phi3 is not supported yet; run it on one rank".into()));
    }
    // The checkpoint's fused projections are the decoder's fused ones under other names.
    for i in 0..c.num_hidden_layers {
        for (from, to) in [("self_attn.qkv_proj", "self_attn.fused_qkv"), ("mlp.gate_up_proj", "mlp.fused_gate_up")] {
            let (from, to) = (format!("model.layers.{i}.{from}"), format!("model.layers.{i}.{to}"));
            let q = w.quantization_of(&from)?;
            for part in ["weight", "scales", "biases"] {
                if let Some(a) = w.remove(&format!("{from}.{part}")) {
                    w.insert(format!("{to}.{part}"), a);
                }
            }
            if q.is_some() {
                w.set_quantization(&to, q);
            }
        }
    }
    let dims = llama::Dims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        ffn: c.intermediate_size,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.kv_heads(),
        head_dim: c.head_dim(),
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        tied: c.tie_word_embeddings,
        moe: None,
        windows: Vec::new(),
    };
    llama::Model::load_dims(&dims, c.rope()?, w, options)
}
