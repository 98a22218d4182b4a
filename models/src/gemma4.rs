//! Gemma 4, text only (`gemma4_text`, and the text model of a `gemma4` folder). Reference:
//! mlx-lm 0.32.2 `models/gemma4_text.py`. Beside Gemma 3's shape (sliding and full layers,
//! four norms per block, q/k norms, a GELU-gated MLP, scaled embeddings) it has:
//!
//! - full layers with their own head size (`global_head_dim`), "proportional" RoPE over a
//!   fraction of it, and optionally keys as values (`attention_k_eq_v`, with their own KV
//!   head count); values RMS-normed without a scale; attention unscaled (scale 1);
//! - per-layer inputs (the e-series): a second embedding of every token, one slice per layer,
//!   mixed with a projection of the hidden state and gated into each layer's output;
//! - KV sharing: the last `num_kv_shared_layers` layers compute no keys or values of their
//!   own; each attends over those of the last earlier layer of its type (the cache holds
//!   only the other layers), and their MLPs are twice as wide (`use_double_wide_mlp`);
//! - a mixture of experts beside the dense MLP in every layer (the 26B-A4B: its own router
//!   with a scale per feature and per expert, GELU-gated experts);
//! - a learned scalar per layer, plain RMSNorm weights (not `1 + w`), and logits soft-capped
//!   (`tanh(x / cap) * cap`).
//!
//! mlx-lm's `gemma4_text` has no AltUp (Gemma 3n's); neither has this.

use crate::cache::{KvCache, LayerCache};
use crate::layers::{Embedding, Linear, Positions, RmsNorm, Rope};
use crate::llama::{self, Activation, Dims, Mlp, Tp};
use crate::moe::{ExpertActivation, SwitchGlu};
use crate::weights::Weights;
use crate::{BatchKvCache, CausalLm, Error, LoadOptions, Result};
use mlx::fast::{self, Mask};
use mlx::{ops, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

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
    #[serde(default = "d_global_head_dim")]
    pub global_head_dim: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_vocab")]
    pub vocab_size_per_layer_input: usize,
    #[serde(default = "d_one")]
    pub num_key_value_heads: usize,
    pub num_global_key_value_heads: Option<usize>,
    #[serde(default = "d_shared")]
    pub num_kv_shared_layers: usize,
    #[serde(default = "d_ple")]
    pub hidden_size_per_layer_input: usize,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_parameters: Option<Value>,
    #[serde(default = "d_window")]
    pub sliding_window: usize,
    #[serde(default = "d_pattern")]
    pub sliding_window_pattern: usize,
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default = "d_softcap")]
    pub final_logit_softcapping: Option<f64>,
    #[serde(default = "d_true")]
    pub use_double_wide_mlp: bool,
    #[serde(default)]
    pub enable_moe_block: bool,
    pub num_experts: Option<usize>,
    pub top_k_experts: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
}

fn d_hidden() -> usize {
    1536
}
fn d_layers() -> usize {
    35
}
fn d_ffn() -> usize {
    6144
}
fn d_heads() -> usize {
    8
}
fn d_head_dim() -> usize {
    256
}
fn d_global_head_dim() -> usize {
    512
}
fn d_eps() -> f64 {
    1e-6
}
fn d_vocab() -> usize {
    262144
}
fn d_one() -> usize {
    1
}
fn d_shared() -> usize {
    20
}
fn d_ple() -> usize {
    256
}
fn d_window() -> usize {
    512
}
fn d_pattern() -> usize {
    5
}
fn d_softcap() -> Option<f64> {
    Some(30.0)
}
fn d_true() -> bool {
    true
}

const FULL: &str = "full_attention";
const SLIDING: &str = "sliding_attention";

impl Config {
    /// Each layer's type: the config's, or `sliding_window_pattern - 1` sliding layers then a
    /// full one, repeated.
    pub fn layer_types(&self) -> Vec<String> {
        if let Some(t) = &self.layer_types {
            return t.clone();
        }
        let p = self.sliding_window_pattern.max(1);
        (0..self.num_hidden_layers).map(|i| if i % p == p - 1 { FULL } else { SLIDING }.to_string()).collect()
    }

    /// The first layer that shares another's keys and values (the layer count when none does).
    pub fn first_shared(&self) -> usize {
        self.num_hidden_layers - self.num_kv_shared_layers.min(self.num_hidden_layers)
    }

    fn is_full(&self, types: &[String], i: usize) -> bool {
        types[i] == FULL
    }

    fn head_dim_of(&self, full: bool) -> usize {
        if full && self.global_head_dim > 0 {
            self.global_head_dim
        } else {
            self.head_dim
        }
    }

    fn kv_heads_of(&self, full: bool) -> usize {
        match self.num_global_key_value_heads {
            Some(n) if full && self.attention_k_eq_v => n,
            _ => self.num_key_value_heads,
        }
    }

    /// Key (or value) features per position over the layers that keep their own (the others
    /// share them).
    pub fn kv_features(&self) -> usize {
        let types = self.layer_types();
        (0..self.first_shared())
            .map(|i| {
                let full = self.is_full(&types, i);
                self.kv_heads_of(full) * self.head_dim_of(full)
            })
            .sum()
    }

    /// RoPE parameters of a layer type, mlx-lm's defaults where the config has none.
    fn rope_parameters(&self, kind: &str) -> Value {
        let defaults = serde_json::json!({
            FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
        });
        let all = self.rope_parameters.as_ref().unwrap_or(&defaults);
        all.get(kind).cloned().unwrap_or(Value::Object(Default::default()))
    }

    fn rope(&self, kind: &str) -> Result<Rope> {
        let params = self.rope_parameters(kind);
        let dims = self.head_dim_of(kind == FULL);
        let theta = params.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0);
        let rope_type = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str);
        if rope_type != Some("proportional") {
            return Rope::new(dims, theta, self.rope_traditional, Some(&params));
        }
        // `ProportionalRoPE`: the default frequencies over `dims` for the rotated share of the
        // pairs, infinite (no rotation) for the rest.
        let fraction = params.get("partial_rotary_factor").and_then(Value::as_f64).unwrap_or(1.0);
        let factor = params.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
        let rotated = (dims as f64 * fraction) as usize;
        if rotated > dims {
            return Err(Error::Invalid(format!(
                "rope partial_rotary_factor {fraction} rotates more than the head's {dims} features"
            )));
        }
        let exponents = Array::arange(0.0, rotated as f64, 2.0, Dtype::Float32)?
            .divide(&Array::scalar(dims as f32, Dtype::Float32)?)?;
        let freqs = Array::scalar(theta as f32, Dtype::Float32)?
            .power(&exponents)?
            .multiply(&Array::scalar(factor as f32, Dtype::Float32)?)?;
        let rest = Array::from_f32(&vec![f32::INFINITY; (dims - rotated) / 2], &[(dims - rotated) / 2])?;
        let freqs = ops::concatenate(&[&freqs, &rest], 0)?;
        freqs.eval()?;
        Ok(Rope::Freqs { dims: dims as i32, traditional: self.rope_traditional, freqs, input_scale: 1.0 })
    }
}

/// Where a layer's keys and values come from: its own cache, which its forward appends to,
/// or the keys and values another layer attended over.
enum Kv<'a> {
    Own(&'a mut dyn LayerCache),
    Shared(&'a (Array, Array)),
}

/// A layer's attention: its own keys and values (kept in its cache), or those of the layer it
/// shares them with.
struct Attention {
    q_proj: Linear,
    /// `None` for a KV-shared layer.
    k_proj: Option<Linear>,
    /// `None` for a shared layer, and where keys are the values (`attention_k_eq_v`).
    v_proj: Option<Linear>,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: Option<RmsNorm>,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    eps: f32,
    window: Option<usize>,
}

impl Attention {
    fn load(w: &Weights, p: &str, c: &Config, full: bool, has_kv: bool) -> Result<Self> {
        let (hidden, hd) = (c.hidden_size, c.head_dim_of(full));
        let n_kv = c.kv_heads_of(full);
        let k_eq_v = c.attention_k_eq_v && full;
        Ok(Attention {
            q_proj: Linear::load(w, &format!("{p}.q_proj"), hidden, c.num_attention_heads * hd, false)?,
            k_proj: has_kv.then(|| Linear::load(w, &format!("{p}.k_proj"), hidden, n_kv * hd, false)).transpose()?,
            v_proj: (has_kv && !k_eq_v)
                .then(|| Linear::load(w, &format!("{p}.v_proj"), hidden, n_kv * hd, false))
                .transpose()?,
            o_proj: Linear::load(w, &format!("{p}.o_proj"), c.num_attention_heads * hd, hidden, false)?,
            q_norm: RmsNorm::load(w, &format!("{p}.q_norm"), hd, c.rms_norm_eps)?,
            k_norm: has_kv.then(|| RmsNorm::load(w, &format!("{p}.k_norm"), hd, c.rms_norm_eps)).transpose()?,
            n_heads: c.num_attention_heads as i32,
            n_kv_heads: n_kv as i32,
            head_dim: hd as i32,
            eps: c.rms_norm_eps as f32,
            window: (!full).then_some(c.sliding_window),
        })
    }

    /// The layer's output and the keys and values it attended over (all positions held), for
    /// the layers that share them.
    fn forward(
        &self,
        x: &Array,
        mask: &Mask<'_>,
        kv: Kv,
        rope: &Rope,
        at: &Positions,
    ) -> Result<(Array, (Array, Array))> {
        let (b, l) = (x.dim(0) as i32, x.dim(1) as i32);
        let heads = |a: Array, n: i32| -> Result<Array> { Ok(a.reshape(&[b, l, n, self.head_dim])?) };
        let q = self.q_norm.forward(&heads(self.q_proj.forward(x)?, self.n_heads)?)?;
        let q = rope.forward_at(&q.transpose(&[0, 2, 1, 3])?, at)?;
        let (k, v) = match (kv, &self.k_proj) {
            (Kv::Shared(kv), _) => kv.clone(),
            (Kv::Own(cache), Some(k_proj)) => {
                let k = heads(k_proj.forward(x)?, self.n_kv_heads)?;
                let v = match &self.v_proj {
                    Some(v_proj) => heads(v_proj.forward(x)?, self.n_kv_heads)?,
                    None => k.clone(),
                };
                let k = self.k_norm.as_ref().expect("loaded with k_proj").forward(&k)?;
                let k = rope.forward_at(&k.transpose(&[0, 2, 1, 3])?, at)?;
                let v = fast::rms_norm_plain(&v, self.eps)?.transpose(&[0, 2, 1, 3])?;
                cache.update_and_fetch(&k, &v)?
            }
            (Kv::Own(_), None) => {
                return Err(Error::Invalid("a KV-shared Gemma 4 layer ran without the keys it shares".into()))
            }
        };
        let o = llama::attend(&q, &k, &v, 1.0, mask, self.window, None, at)?;
        let o = o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        Ok((self.o_proj.forward(&o)?, (k, v)))
    }
}

/// The 26B-A4B's experts beside the dense MLP: Gemma 4's router (an RMS norm scaled per
/// feature, a projection, the top k, a softmax over them times a scale per expert) and
/// GELU-gated experts.
struct Experts {
    router_norm: Array,
    router_proj: Linear,
    per_expert_scale: Array,
    switch_glu: SwitchGlu,
    top_k: usize,
    eps: f32,
    pre_norm: RmsNorm,
    post_norm: RmsNorm,
    /// Applied to the dense MLP's output before the two are summed.
    post_dense_norm: RmsNorm,
}

impl Experts {
    fn load(w: &Weights, p: &str, c: &Config) -> Result<Self> {
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps);
        let missing = |k: &str| Error::Invalid(format!("enable_moe_block is set but the config has no `{k}`"));
        let experts = c.num_experts.ok_or_else(|| missing("num_experts"))?;
        let top_k = c.top_k_experts.ok_or_else(|| missing("top_k_experts"))?;
        let ffn = c.moe_intermediate_size.ok_or_else(|| missing("moe_intermediate_size"))?;
        if top_k == 0 || top_k > experts {
            return Err(Error::Invalid(format!(
                "top_k_experts is {top_k}; it must be between 1 and num_experts ({experts})"
            )));
        }
        // `scale * hidden^-0.5`, as mlx-lm computes it each call.
        let scale = w.get_shaped(&format!("{p}.router.scale"), &[hidden])?;
        let router_norm = scale.multiply(&Array::scalar((hidden as f64).powf(-0.5) as f32, scale.dtype())?)?;
        router_norm.eval()?;
        Ok(Experts {
            router_norm,
            router_proj: Linear::load(w, &format!("{p}.router.proj"), hidden, experts, false)?,
            per_expert_scale: w.get_shaped(&format!("{p}.router.per_expert_scale"), &[experts])?,
            switch_glu: SwitchGlu::load(
                w,
                &format!("{p}.experts.switch_glu"),
                experts,
                hidden,
                ffn,
                ExpertActivation::Geglu,
            )?,
            top_k,
            eps: eps as f32,
            pre_norm: RmsNorm::load(w, &format!("{p}.pre_feedforward_layernorm_2"), hidden, eps)?,
            post_norm: RmsNorm::load(w, &format!("{p}.post_feedforward_layernorm_2"), hidden, eps)?,
            post_dense_norm: RmsNorm::load(w, &format!("{p}.post_feedforward_layernorm_1"), hidden, eps)?,
        })
    }

    /// The experts' share for `h` (the block's input to its feed-forward part).
    fn forward(&self, h: &Array) -> Result<Array> {
        let scores = self.router_proj.forward(&fast::rms_norm(h, &self.router_norm, self.eps)?)?;
        let (last, n, k) = (scores.ndim() as i32 - 1, scores.dim(-1) as i32, self.top_k as i32);
        let inds = scores.argpartition(-k, -1)?.slice_axis(last, n - k, n)?;
        let weights = scores.take_along_axis(&inds, -1)?.softmax(&[-1], false)?;
        let weights = weights.multiply(&self.per_expert_scale.take(&inds, 0)?)?;
        let y = self.switch_glu.forward(&self.pre_norm.forward(h)?, &inds)?;
        let y = y.multiply(&weights.expand_dims(&[-1])?)?.sum(&[-2], false)?;
        self.post_norm.forward(&y)
    }
}

/// A layer's per-layer input gate (the e-series).
struct PerLayer {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

struct Block {
    self_attn: Attention,
    mlp: Mlp,
    experts: Option<Experts>,
    per_layer: Option<PerLayer>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    /// The layer's output scale (`layer_scalar`; a checkpoint without one scales by 1).
    layer_scalar: Option<Array>,
    full: bool,
    /// The earlier layer whose keys and values this one attends over (its own index if none).
    shares: usize,
}

impl Block {
    fn forward(
        &self,
        x: &Array,
        mask: &Mask<'_>,
        kv: Kv,
        rope: &Rope,
        at: &Positions,
        per_layer_input: Option<&Array>,
    ) -> Result<(Array, (Array, Array))> {
        let (r, kv) = self.self_attn.forward(&self.input_layernorm.forward(x)?, mask, kv, rope, at)?;
        let h = x.add(&self.post_attention_layernorm.forward(&r)?)?;
        let dense = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        let f = match &self.experts {
            Some(e) => e.post_dense_norm.forward(&dense)?.add(&e.forward(&h)?)?,
            None => dense,
        };
        let mut h = h.add(&self.post_feedforward_layernorm.forward(&f)?)?;
        if let (Some(p), Some(input)) = (&self.per_layer, per_layer_input) {
            let gate = ops::gelu_approx(&p.gate.forward(&h)?)?.multiply(input)?;
            h = h.add(&p.norm.forward(&p.projection.forward(&gate)?)?)?;
        }
        match &self.layer_scalar {
            Some(s) => Ok((h.multiply(s)?, kv)),
            None => Ok((h, kv)),
        }
    }
}

/// The e-series' per-layer inputs: each token's second embedding (one slice per layer) mixed
/// with a projection of its first.
struct PerLayerInputs {
    embed: Embedding,
    projection: Linear,
    norm: RmsNorm,
    /// Features per layer.
    width: i32,
    layers: i32,
    hidden: usize,
}

impl PerLayerInputs {
    /// `[B, L, layers, width]` for `tokens` whose scaled embeddings are `h`.
    fn forward(&self, tokens: &Array, h: &Array) -> Result<Array> {
        let (b, l) = (h.dim(0) as i32, h.dim(1) as i32);
        let shape = [b, l, self.layers, self.width];
        let scalar = |v: f64, like: &Array| Array::scalar(v as f32, like.dtype());
        let inputs = self.embed.forward(tokens)?;
        let inputs = inputs.multiply(&scalar((self.width as f64).sqrt(), &inputs)?)?.reshape(&shape)?;
        let projected = self.projection.forward(h)?;
        let projected = projected.multiply(&scalar((self.hidden as f64).powf(-0.5), &projected)?)?.reshape(&shape)?;
        let projected = self.norm.forward(&projected)?;
        let mixed = projected.add(&inputs)?;
        Ok(mixed.multiply(&scalar(2f64.powf(-0.5), &mixed)?)?)
    }
}

pub struct Model {
    embed_tokens: Embedding,
    embed_scale: f32,
    per_layer_inputs: Option<PerLayerInputs>,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    full_rope: Rope,
    sliding_rope: Rope,
    softcap: Option<f32>,
    /// Layers with a cache of their own (the first ones; the rest share).
    cached: usize,
    window: usize,
    vocab: usize,
}

/// mlx-lm's `sanitize`: rotary buffers and clipping ranges dropped, the KV-shared layers'
/// unused key/value projections dropped, fused experts (`experts.gate_up_proj` `[E, 2I, H]`,
/// `experts.down_proj`) split into `switch_glu`'s three.
fn sanitize(w: &mut Weights, c: &Config) -> Result<()> {
    let names: Vec<String> = w.names().cloned().collect();
    let unused = ["self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min"];
    let first_shared = c.first_shared();
    for name in &names {
        let layer =
            name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        let shared_kv =
            [".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm"].iter().any(|s| name.contains(s))
                && layer.is_some_and(|i| i >= first_shared);
        if unused.iter().any(|s| name.contains(s)) || shared_kv {
            w.remove(name);
        }
    }
    for name in names.iter().filter(|n| n.ends_with(".experts.gate_up_proj")) {
        let base = name.trim_end_matches(".gate_up_proj");
        let Some(gate_up) = w.remove(name) else { continue };
        let (axis, rows) = (gate_up.ndim() as i32 - 2, gate_up.dim(-2) as i32);
        w.insert(format!("{base}.switch_glu.gate_proj.weight"), gate_up.slice_axis(axis, 0, rows / 2)?.contiguous()?);
        w.insert(format!("{base}.switch_glu.up_proj.weight"), gate_up.slice_axis(axis, rows / 2, rows)?.contiguous()?);
        let down = format!("{base}.down_proj");
        let down = w.remove(&down).ok_or_else(|| Error::Invalid(format!("{name} has no {down} beside it")))?;
        w.insert(format!("{base}.switch_glu.down_proj.weight"), down);
    }
    Ok(())
}

pub fn load(c: &Config, w: &mut Weights, options: &LoadOptions) -> Result<Model> {
    if Tp::of(options).size > 1 {
        return Err(Error::Invalid(
            "tensor parallelism over gemma4 (per-layer head sizes and shared keys) is not supported yet; run it on one rank"
                .into(),
        ));
    }
    let types = c.layer_types();
    let n = c.num_hidden_layers;
    if types.len() != n || types.iter().any(|t| t != FULL && t != SLIDING) {
        return Err(Error::Invalid(format!(
            "layer_types must give each of the {n} layers as {FULL:?} or {SLIDING:?}; got {types:?}"
        )));
    }
    let first_shared = c.first_shared();
    if first_shared == 0 {
        return Err(Error::Invalid(format!(
            "num_kv_shared_layers ({}) leaves no layer computing keys and values",
            c.num_kv_shared_layers
        )));
    }
    sanitize(w, c)?;
    let window = llama::sliding_window(c.sliding_window)?;
    let w = &*w;
    let tp = Tp::ONE;
    let eps = c.rms_norm_eps;
    let layers = (0..n)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let full = c.is_full(&types, i);
            // A shared layer attends over the last earlier layer's of its type.
            let shares = if i < first_shared {
                i
            } else {
                (0..first_shared).rev().find(|&j| types[j] == types[i]).ok_or_else(|| {
                    Error::Invalid(format!("KV-shared layer {i} ({}) has no earlier layer of its type", types[i]))
                })?
            };
            let wide = c.use_double_wide_mlp && i >= first_shared;
            let dims = Dims {
                hidden: c.hidden_size,
                layers: n,
                ffn: c.intermediate_size * if wide { 2 } else { 1 },
                n_heads: c.num_attention_heads,
                n_kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                vocab: c.vocab_size,
                eps,
                qkv_bias: false,
                o_bias: false,
                mlp_bias: false,
                qk_norm: true,
                tied: c.tie_word_embeddings,
                moe: None,
                windows: Vec::new(),
            };
            let ple = c.hidden_size_per_layer_input;
            Ok(Block {
                self_attn: Attention::load(w, &format!("{p}.self_attn"), c, full, i < first_shared)?,
                mlp: Mlp::load(w, &format!("{p}.mlp"), &dims, Activation::GeluApprox, tp)?,
                experts: c.enable_moe_block.then(|| Experts::load(w, &p, c)).transpose()?,
                per_layer: (ple > 0)
                    .then(|| {
                        Ok::<_, Error>(PerLayer {
                            gate: Linear::load(w, &format!("{p}.per_layer_input_gate"), c.hidden_size, ple, false)?,
                            projection: Linear::load(
                                w,
                                &format!("{p}.per_layer_projection"),
                                ple,
                                c.hidden_size,
                                false,
                            )?,
                            norm: RmsNorm::load(w, &format!("{p}.post_per_layer_input_norm"), c.hidden_size, eps)?,
                        })
                    })
                    .transpose()?,
                input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), c.hidden_size, eps)?,
                post_attention_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.post_attention_layernorm"),
                    c.hidden_size,
                    eps,
                )?,
                pre_feedforward_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.pre_feedforward_layernorm"),
                    c.hidden_size,
                    eps,
                )?,
                post_feedforward_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.post_feedforward_layernorm"),
                    c.hidden_size,
                    eps,
                )?,
                layer_scalar: w
                    .contains(&format!("{p}.layer_scalar"))
                    .then(|| w.get_shaped(&format!("{p}.layer_scalar"), &[1]))
                    .transpose()?,
                full,
                shares,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let ple = c.hidden_size_per_layer_input;
    let per_layer_inputs = (ple > 0)
        .then(|| {
            Ok::<_, Error>(PerLayerInputs {
                embed: Embedding::load(w, "model.embed_tokens_per_layer", c.vocab_size_per_layer_input, n * ple)?,
                projection: Linear::load(w, "model.per_layer_model_projection", c.hidden_size, n * ple, false)?,
                norm: RmsNorm::load(w, "model.per_layer_projection_norm", ple, eps)?,
                width: ple as i32,
                layers: n as i32,
                hidden: c.hidden_size,
            })
        })
        .transpose()?;
    Ok(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", c.vocab_size, c.hidden_size)?,
        embed_scale: (c.hidden_size as f64).sqrt() as f32,
        per_layer_inputs,
        layers,
        norm: RmsNorm::load(w, "model.norm", c.hidden_size, eps)?,
        lm_head: if c.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(w, "lm_head", c.hidden_size, c.vocab_size, false)?)
        },
        full_rope: c.rope(FULL)?,
        sliding_rope: c.rope(SLIDING)?,
        softcap: c.final_logit_softcapping.map(|s| s as f32),
        cached: first_shared,
        window,
        vocab: c.vocab_size,
    })
}

impl Model {
    fn decoder<C: LayerCache>(
        &self,
        tokens: &Array,
        mask: &Mask<'_>,
        cache: &mut [C],
        at: &Positions,
    ) -> Result<Array> {
        if cache.len() != self.cached {
            return Err(Error::Invalid(format!(
                "a Gemma 4 forward over {} layer caches; the model keeps {}",
                cache.len(),
                self.cached
            )));
        }
        let h = self.embed_tokens.forward(tokens)?;
        let mut h = h.multiply(&Array::scalar(self.embed_scale, h.dtype())?)?;
        let per_layer = self.per_layer_inputs.as_ref().map(|p| p.forward(tokens, &h)).transpose()?;
        let mut kvs: Vec<(Array, Array)> = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let rope = if layer.full { &self.full_rope } else { &self.sliding_rope };
            let input = per_layer
                .as_ref()
                .map(|p| -> Result<Array> { Ok(p.slice_axis(2, i as i32, i as i32 + 1)?.squeeze(&[2])?) })
                .transpose()?;
            let kv = match cache.get_mut(i) {
                Some(c) => Kv::Own(c),
                None => Kv::Shared(&kvs[layer.shares]),
            };
            let (out, kv) = layer.forward(&h, mask, kv, rope, at, input.as_ref())?;
            h = out;
            kvs.push(kv);
        }
        self.norm.forward(&h)
    }
}

impl CausalLm for Model {
    fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let s = llama::StepInputs::sequence(tokens, cache)?;
        self.decoder(tokens, &s.mask(), cache, &s.positions())
    }

    fn head(&self, h: &Array) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(h)?,
            None => self.embed_tokens.as_linear(h)?,
        };
        match self.softcap {
            Some(cap) => Ok(ops::softcap(&logits, cap)?),
            None => Ok(logits),
        }
    }

    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        let s = llama::StepInputs::batch(tokens, cache)?;
        self.decoder(tokens, &s.mask(), cache, &s.positions())
    }

    fn batches(&self) -> bool {
        true
    }

    fn make_cache(&self) -> Vec<KvCache> {
        (self.layers.iter().take(self.cached)).map(|l| KvCache::windowed((!l.full).then_some(self.window))).collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }
}
