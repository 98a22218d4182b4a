//! Llama (covers SmolLM2, Mistral-style checkpoints and Llama 3.x RoPE scaling).
//! Reference: mlx-lm `models/llama.py`; every op mirrors it so outputs are bit-identical.

use crate::cache::KvCache;
use crate::layers::{Embedding, Linear, RmsNorm, Rope};
use crate::weights::Weights;
use crate::{CausalLm, Result};
use mlx::fast::{self, Mask};
use mlx::{ops, Array};
use serde::Deserialize;

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
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_true() -> bool {
    true
}

/// The shapes and options of one decoder stack, resolved from any of the configs that
/// share Llama's block (Llama, Qwen2, Qwen3).
#[derive(Debug, Clone)]
pub(crate) struct Dims {
    pub hidden: usize,
    pub layers: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f64,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub tied: bool,
}

impl Config {
    pub(crate) fn dims(&self) -> Dims {
        Dims {
            hidden: self.hidden_size,
            layers: self.num_hidden_layers,
            ffn: self.intermediate_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads),
            vocab: self.vocab_size,
            eps: self.rms_norm_eps,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            qk_norm: false,
            tied: self.tie_word_embeddings,
        }
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Per-head norms of q and k (Qwen3), applied before RoPE.
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
}

impl Attention {
    fn load(w: &Weights, p: &str, d: &Dims) -> Result<Self> {
        Ok(Attention {
            q_proj: Linear::load(w, &format!("{p}.q_proj"), d.hidden, d.n_heads * d.head_dim, d.qkv_bias)?,
            k_proj: Linear::load(w, &format!("{p}.k_proj"), d.hidden, d.n_kv_heads * d.head_dim, d.qkv_bias)?,
            v_proj: Linear::load(w, &format!("{p}.v_proj"), d.hidden, d.n_kv_heads * d.head_dim, d.qkv_bias)?,
            o_proj: Linear::load(w, &format!("{p}.o_proj"), d.n_heads * d.head_dim, d.hidden, d.o_bias)?,
            q_norm: d.qk_norm.then(|| RmsNorm::load(w, &format!("{p}.q_norm"), d.head_dim, d.eps)).transpose()?,
            k_norm: d.qk_norm.then(|| RmsNorm::load(w, &format!("{p}.k_norm"), d.head_dim, d.eps)).transpose()?,
            n_heads: d.n_heads as i32,
            n_kv_heads: d.n_kv_heads as i32,
            scale: (d.head_dim as f64).powf(-0.5) as f32,
        })
    }

    fn forward(&self, x: &Array, mask: &Mask<'_>, cache: &mut KvCache, rope: &Rope) -> Result<Array> {
        let (b, l) = (x.dim(0) as i32, x.dim(1) as i32);
        let heads = |a: Array, n: i32, norm: Option<&RmsNorm>| -> Result<Array> {
            let mut a = a.reshape(&[b, l, n, -1])?;
            if let Some(norm) = norm {
                a = norm.forward(&a)?;
            }
            Ok(a.transpose(&[0, 2, 1, 3])?)
        };
        let q = heads(self.q_proj.forward(x)?, self.n_heads, self.q_norm.as_ref())?;
        let k = heads(self.k_proj.forward(x)?, self.n_kv_heads, self.k_norm.as_ref())?;
        let v = heads(self.v_proj.forward(x)?, self.n_kv_heads, None)?;
        let q = rope.forward(&q, cache.offset())?;
        let k = rope.forward(&k, cache.offset())?;
        let (k, v) = cache.update_and_fetch(&k, &v)?;
        let o = fast::scaled_dot_product_attention(&q, &k, &v, self.scale, mask_ref(mask))?;
        self.o_proj.forward(&o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)
    }
}

fn mask_ref<'a>(m: &'a Mask<'a>) -> Mask<'a> {
    match m {
        Mask::None => Mask::None,
        Mask::Causal => Mask::Causal,
        Mask::Array(a) => Mask::Array(a),
    }
}

/// mlx-lm's mask choice: none for one new token, "causal" for several.
fn attention_mask(len: usize) -> Mask<'static> {
    if len > 1 {
        Mask::Causal
    } else {
        Mask::None
    }
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn load(w: &Weights, p: &str, hidden: usize, ffn: usize, bias: bool) -> Result<Self> {
        Ok(Mlp {
            gate_proj: Linear::load(w, &format!("{p}.gate_proj"), hidden, ffn, bias)?,
            up_proj: Linear::load(w, &format!("{p}.up_proj"), hidden, ffn, bias)?,
            down_proj: Linear::load(w, &format!("{p}.down_proj"), ffn, hidden, bias)?,
        })
    }
    fn forward(&self, x: &Array) -> Result<Array> {
        self.down_proj.forward(&ops::swiglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?)
    }
}

struct Block {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl Block {
    fn forward(&self, x: &Array, mask: &Mask<'_>, cache: &mut KvCache, rope: &Rope) -> Result<Array> {
        let h = x.add(&self.self_attn.forward(&self.input_layernorm.forward(x)?, mask, cache, rope)?)?;
        Ok(h.add(&self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?)
    }
}

pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rope: Rope,
    vocab: usize,
}

impl Model {
    pub fn load(config: &Config, weights: &Weights) -> Result<Self> {
        let rope = Rope::new(
            config.head_dim.unwrap_or(config.hidden_size / config.num_attention_heads),
            config.rope_theta,
            config.rope_traditional,
            config.rope_scaling.as_ref(),
        )?;
        Self::load_dims(&config.dims(), rope, weights)
    }

    pub(crate) fn load_dims(d: &Dims, rope: Rope, w: &Weights) -> Result<Self> {
        let layers = (0..d.layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(Block {
                    self_attn: Attention::load(w, &format!("{p}.self_attn"), d)?,
                    mlp: Mlp::load(w, &format!("{p}.mlp"), d.hidden, d.ffn, d.mlp_bias)?,
                    input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), d.hidden, d.eps)?,
                    post_attention_layernorm: RmsNorm::load(
                        w,
                        &format!("{p}.post_attention_layernorm"),
                        d.hidden,
                        d.eps,
                    )?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            embed_tokens: Embedding::load(w, "model.embed_tokens", d.vocab, d.hidden)?,
            layers,
            norm: RmsNorm::load(w, "model.norm", d.hidden, d.eps)?,
            lm_head: if d.tied { None } else { Some(Linear::load(w, "lm_head", d.hidden, d.vocab, false)?) },
            rope,
            vocab: d.vocab,
        })
    }
}

impl CausalLm for Model {
    fn forward(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let mut h = self.embed_tokens.forward(tokens)?;
        let mask = attention_mask(tokens.dim(-1));
        for (layer, c) in self.layers.iter().zip(cache.iter_mut()) {
            h = layer.forward(&h, &mask, c, &self.rope)?;
        }
        let h = self.norm.forward(&h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed_tokens.as_linear(&h),
        }
    }

    fn make_cache(&self) -> Vec<KvCache> {
        vec![KvCache::default(); self.layers.len()]
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }
}
