//! Qwen3 (dense). Reference: mlx-lm `models/qwen3.py`.
//! Differs from Llama in RMSNorm on each head of q and k (before RoPE), an explicit
//! `head_dim`, and reading `rope_parameters` (transformers 5 configs) when `rope_theta` is absent.

use crate::cache::KvCache;
use crate::layers::{Embedding, Linear, RmsNorm, Rope};
use crate::llama::{attention_mask, Mlp};
use crate::weights::Weights;
use crate::{CausalLm, Error, Result};
use mlx::fast::{self, Mask};
use mlx::Array;
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

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
}

impl Attention {
    fn load(w: &Weights, p: &str, c: &Config) -> Result<Self> {
        let (d, hd) = (c.hidden_size, c.head_dim);
        Ok(Attention {
            q_proj: Linear::load(w, &format!("{p}.q_proj"), d, c.num_attention_heads * hd, false)?,
            k_proj: Linear::load(w, &format!("{p}.k_proj"), d, c.num_key_value_heads * hd, false)?,
            v_proj: Linear::load(w, &format!("{p}.v_proj"), d, c.num_key_value_heads * hd, false)?,
            o_proj: Linear::load(w, &format!("{p}.o_proj"), c.num_attention_heads * hd, d, false)?,
            q_norm: RmsNorm::load(w, &format!("{p}.q_norm"), hd, c.rms_norm_eps)?,
            k_norm: RmsNorm::load(w, &format!("{p}.k_norm"), hd, c.rms_norm_eps)?,
            n_heads: c.num_attention_heads as i32,
            n_kv_heads: c.num_key_value_heads as i32,
            scale: (hd as f64).powf(-0.5) as f32,
        })
    }

    fn forward(&self, x: &Array, mask: &Mask<'_>, cache: &mut KvCache, rope: &Rope) -> Result<Array> {
        let (b, l) = (x.dim(0) as i32, x.dim(1) as i32);
        let q = self
            .q_norm
            .forward(&self.q_proj.forward(x)?.reshape(&[b, l, self.n_heads, -1])?)?
            .transpose(&[0, 2, 1, 3])?;
        let k = self
            .k_norm
            .forward(&self.k_proj.forward(x)?.reshape(&[b, l, self.n_kv_heads, -1])?)?
            .transpose(&[0, 2, 1, 3])?;
        let v = self.v_proj.forward(x)?.reshape(&[b, l, self.n_kv_heads, -1])?.transpose(&[0, 2, 1, 3])?;
        let q = rope.forward(&q, cache.offset())?;
        let k = rope.forward(&k, cache.offset())?;
        let (k, v) = cache.update_and_fetch(&k, &v)?;
        let o = fast::scaled_dot_product_attention(&q, &k, &v, self.scale, crate::llama::mask_ref(mask))?;
        self.o_proj.forward(&o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)
    }
}

struct Block {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
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
    pub fn load(c: &Config, w: &Weights) -> Result<Self> {
        let rope_theta = c
            .rope_theta
            .or_else(|| c.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(|v| v.as_f64()))
            .ok_or_else(|| Error::Invalid("rope_theta is missing from the model config".into()))?;
        let scaling = c.rope_scaling.as_ref().or(c.rope_parameters.as_ref());
        let rope = Rope::new(c.head_dim, rope_theta, false, scaling)?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(Block {
                    self_attn: Attention::load(w, &format!("{p}.self_attn"), c)?,
                    mlp: Mlp::load(w, &format!("{p}.mlp"), c.hidden_size, c.intermediate_size, false)?,
                    input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), c.hidden_size, c.rms_norm_eps)?,
                    post_attention_layernorm: RmsNorm::load(
                        w,
                        &format!("{p}.post_attention_layernorm"),
                        c.hidden_size,
                        c.rms_norm_eps,
                    )?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            embed_tokens: Embedding::load(w, "model.embed_tokens", c.vocab_size, c.hidden_size)?,
            layers,
            norm: RmsNorm::load(w, "model.norm", c.hidden_size, c.rms_norm_eps)?,
            lm_head: if c.tie_word_embeddings {
                None
            } else {
                Some(Linear::load(w, "lm_head", c.hidden_size, c.vocab_size, false)?)
            },
            rope,
            vocab: c.vocab_size,
        })
    }
}

impl CausalLm for Model {
    fn forward(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let mut h = self.embed_tokens.forward(tokens)?;
        let mask = attention_mask(tokens.dim(-1));
        for (layer, c) in self.layers.iter().zip(cache.iter_mut()) {
            let attn = &layer.self_attn;
            let r = attn.forward(&layer.input_layernorm.forward(&h)?, &mask, c, &self.rope)?;
            let mid = h.add(&r)?;
            h = mid.add(&layer.mlp.forward(&layer.post_attention_layernorm.forward(&mid)?)?)?;
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
