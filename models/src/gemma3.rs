//! Gemma 3, text only (`gemma3_text`). Reference: mlx-lm `models/gemma3_text.py`.
//! Differs from Llama in: sliding-window layers (a local RoPE base, attention over the last
//! `sliding_window` positions) with every `sliding_window_pattern`-th layer global; RMSNorms
//! that scale by `1 + weight`, four per block (after attention and after the MLP as well as
//! before each); per-head q/k norms; scores scaled by `query_pre_attn_scalar^-0.5`; a GELU
//! (tanh approximation) MLP; embeddings multiplied by `sqrt(hidden_size)` rounded to bfloat16;
//! float16 residual sums clipped to float16's range.
//!
//! Every layer's cache keeps all positions (as a global layer's does), so `trim` and batching
//! work as for Llama; a sliding layer attends over the last `sliding_window` of them.

use crate::cache::{KvCache, LayerCache};
use crate::layers::{Embedding, Linear, Positions, RmsNorm, Rope};
use crate::llama::{self, Activation, Attention, Dims, Mlp, Tp};
use crate::weights::Weights;
use crate::{BatchKvCache, CausalLm, LoadOptions, Result};
use mlx::fast::Mask;
use mlx::{Array, Dtype};
use serde::Deserialize;

/// The config, with mlx-lm's `ModelArgs` defaults for the keys a config may leave out.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_ffn")]
    pub intermediate_size: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_head_dim")]
    pub head_dim: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "d_rope_local")]
    pub rope_local_base_freq: f64,
    #[serde(default = "d_head_dim_f")]
    pub query_pre_attn_scalar: f64,
    #[serde(default = "d_window")]
    pub sliding_window: usize,
    #[serde(default = "d_pattern")]
    pub sliding_window_pattern: usize,
    pub rope_scaling: Option<serde_json::Value>,
}

fn d_hidden() -> usize {
    1152
}
fn d_layers() -> usize {
    26
}
fn d_ffn() -> usize {
    6912
}
fn d_heads() -> usize {
    4
}
fn d_head_dim() -> usize {
    256
}
fn d_head_dim_f() -> f64 {
    256.0
}
fn d_eps() -> f64 {
    1e-6
}
fn d_vocab() -> usize {
    262144
}
fn d_kv_heads() -> usize {
    1
}
fn d_rope_theta() -> f64 {
    1_000_000.0
}
fn d_rope_local() -> f64 {
    10_000.0
}
fn d_window() -> usize {
    512
}
fn d_pattern() -> usize {
    6
}

impl Config {
    fn dims(&self) -> Dims {
        Dims {
            hidden: self.hidden_size,
            layers: self.num_hidden_layers,
            ffn: self.intermediate_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            vocab: self.vocab_size,
            eps: self.rms_norm_eps,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: true,
            tied: true,
            moe: None,
            windows: Vec::new(),
        }
    }

    /// Whether layer `i` attends globally (the others use the sliding window).
    pub fn is_global(&self, i: usize) -> bool {
        self.sliding_window_pattern <= 1 || i % self.sliding_window_pattern == self.sliding_window_pattern - 1
    }
}

/// Gemma's RMSNorm scales by `1 + weight`: `nn.RMSNorm` over the shifted weight, shifted
/// once here (the same op mlx-lm runs per call, so the same rounding).
fn norm(w: &Weights, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
    let weight = w.get_shaped(&format!("{prefix}.weight"), &[dim])?;
    let shifted = Array::scalar(1.0, weight.dtype())?.add(&weight)?;
    shifted.eval()?;
    Ok(RmsNorm::new(shifted, eps))
}

/// `clip_residual`: `x + y`, summed in float32 and clipped to float16's range for float16.
fn residual(x: &Array, y: &Array) -> Result<Array> {
    if x.dtype() != Dtype::Float16 {
        return Ok(x.add(y)?);
    }
    let bound = 65504.0;
    let sum = x.astype(Dtype::Float32)?.add(&y.astype(Dtype::Float32)?)?;
    let clipped =
        sum.maximum(&Array::scalar(-bound, Dtype::Float32)?)?.minimum(&Array::scalar(bound, Dtype::Float32)?)?;
    Ok(clipped.astype(Dtype::Float16)?)
}

struct Block {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    global: bool,
}

impl Block {
    fn forward(
        &self,
        x: &Array,
        mask: &Mask<'_>,
        cache: &mut impl LayerCache,
        rope: &Rope,
        at: &Positions,
    ) -> Result<Array> {
        let r = self.self_attn.forward(&self.input_layernorm.forward(x)?, mask, cache, rope, at, None)?;
        let h = residual(x, &self.post_attention_layernorm.forward(&r)?)?;
        let r = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        residual(&h, &self.post_feedforward_layernorm.forward(&r)?)
    }
}

pub struct Model {
    embed_tokens: Embedding,
    /// `sqrt(hidden_size)` rounded to bfloat16, as mlx-lm scales the embeddings.
    embed_scale: f32,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// RoPE of the global layers and of the sliding ones.
    global_rope: Rope,
    local_rope: Rope,
    vocab: usize,
}

impl Model {
    pub fn load(c: &Config, w: &mut Weights, options: &LoadOptions) -> Result<Self> {
        let tp = Tp::of(options);
        let d = &if tp.size > 1 { llama::shard(&c.dims(), w, tp)? } else { c.dims() };
        if options.fuse_projections() {
            llama::fuse(d, w)?;
        }
        let w = &*w;
        let scale = c.query_pre_attn_scalar.powf(-0.5);
        let window = llama::sliding_window(c.sliding_window)?;
        let layers = (0..d.layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let global = c.is_global(i);
                let a = format!("{p}.self_attn");
                Ok(Block {
                    self_attn: Attention::load(w, &a, d, tp)?
                        .with_qk_norms(
                            norm(w, &format!("{a}.q_norm"), d.head_dim, d.eps)?,
                            norm(w, &format!("{a}.k_norm"), d.head_dim, d.eps)?,
                        )
                        .scaled(scale)
                        .windowed((!global).then_some(window)),
                    mlp: Mlp::load(w, &format!("{p}.mlp"), d, Activation::GeluApprox, tp)?,
                    input_layernorm: norm(w, &format!("{p}.input_layernorm"), d.hidden, d.eps)?,
                    post_attention_layernorm: norm(w, &format!("{p}.post_attention_layernorm"), d.hidden, d.eps)?,
                    pre_feedforward_layernorm: norm(w, &format!("{p}.pre_feedforward_layernorm"), d.hidden, d.eps)?,
                    post_feedforward_layernorm: norm(w, &format!("{p}.post_feedforward_layernorm"), d.hidden, d.eps)?,
                    global,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_scale = Array::scalar((c.hidden_size as f32).sqrt(), Dtype::Bfloat16)?.astype(Dtype::Float32)?;
        Ok(Model {
            embed_tokens: Embedding::load(w, "model.embed_tokens", d.vocab, d.hidden)?,
            embed_scale: embed_scale.item_f32()?,
            layers,
            norm: norm(w, "model.norm", d.hidden, d.eps)?,
            // mlx-lm ties the head unless the checkpoint has one.
            lm_head: if w.contains("lm_head.weight") {
                Some(Linear::load(w, "lm_head", d.hidden, d.vocab, false)?)
            } else {
                None
            },
            global_rope: Rope::new(c.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?,
            local_rope: Rope::new(c.head_dim, c.rope_local_base_freq, false, None)?,
            vocab: d.vocab,
        })
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(tokens)?;
        Ok(h.multiply(&Array::scalar(self.embed_scale, h.dtype())?)?)
    }

    fn decoder(&self, mut h: Array, mask: &Mask<'_>, cache: &mut [impl LayerCache], at: &Positions) -> Result<Array> {
        for (layer, c) in self.layers.iter().zip(cache.iter_mut()) {
            let rope = if layer.global { &self.global_rope } else { &self.local_rope };
            h = layer.forward(&h, mask, c, rope, at)?;
        }
        self.norm.forward(&h)
    }
}

impl CausalLm for Model {
    fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let s = llama::StepInputs::sequence(tokens, cache)?;
        self.decoder(self.embed(tokens)?, &s.mask(), cache, &s.positions())
    }

    fn head(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed_tokens.as_linear(h),
        }
    }

    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        let s = llama::StepInputs::batch(tokens, cache)?;
        self.decoder(self.embed(tokens)?, &s.mask(), cache, &s.positions())
    }

    fn batches(&self) -> bool {
        true
    }

    fn make_cache(&self) -> Vec<KvCache> {
        self.layers.iter().map(|l| l.self_attn.cache()).collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }
}
