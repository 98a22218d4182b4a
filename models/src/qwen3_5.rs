//! Qwen3.5 / Qwen3.6, text only: dense (`qwen3_5`) and mixture-of-experts (`qwen3_5_moe`,
//! e.g. Qwen3.5-35B-A3B). Reference: mlx-lm `models/qwen3_5.py`, `qwen3_5_moe.py`,
//! `qwen3_next.py` (its attention, MLP, sparse MoE block and gated norm) and `gated_delta.py`.
//!
//! A hybrid: every `full_attention_interval`-th layer is a full-attention one (Qwen3-Next's:
//! q/k norms, RoPE over the first `partial_rotary_factor` of each head, and an output gate
//! from a `q_proj` twice as wide); the others are Gated DeltaNet layers, a linear attention
//! that carries a recurrent state instead of keys and values. A DeltaNet layer projects its
//! input to q/k/v (through a causal depthwise convolution and SiLU), a gate `z`, and per value
//! head a write strength `beta = sigmoid(b)` and a decay `g = exp(-exp(A_log) * softplus(a +
//! dt_bias))`; then for each position `t`, with the state `S` (`[value dim, key dim]` per head):
//! `S = g S`, `S += k (beta (v - S k))^T`, `y = S q`; and the output is `out_proj(rmsnorm(y) *
//! silu(z))`. Its cache ([`KvCache::recurrent`]) keeps the convolution's last `kernel - 1`
//! inputs and `S`.
//!
//! With experts, every layer's MLP is Qwen3-Next's sparse block: a softmax router, the top
//! `num_experts_per_tok` experts (renormalized with `norm_topk_prob`) and a shared expert
//! gated by `sigmoid(shared_expert_gate(x))` (`moe.rs`'s `SparseMoe`, as Qwen2-MoE's).
//!
//! The recurrence runs as mlx-lm runs it off Metal (`gated_delta_ops`): one compiled step per
//! position, the same ops, so logits match mlx-lm's on the CPU. Checkpoints as Qwen publishes
//! them (conv1d `[C, 1, K]`, norms stored as offsets from 1) are sanitized as mlx-lm does;
//! mlx-community's conversions are already in that form.

use crate::cache::{KvCache, LayerCache, Snapshot};
use crate::layers::{Embedding, Forward, Linear, Positions, RmsNorm, Rope};
use crate::llama::{self, Activation, Attention, Dims, Mlp, Tp};
use crate::moe::{MoeDims, SparseMoe};
use crate::weights::Weights;
use crate::{BatchKvCache, CausalLm, Error, LoadOptions, Result};
use mlx::fast::{self, Mask};
use mlx::{ops, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

/// The text model's config, with mlx-lm's `TextModelArgs` defaults for the keys it may omit.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_ffn")]
    pub intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d_v_heads")]
    pub linear_num_value_heads: usize,
    #[serde(default = "d_k_heads")]
    pub linear_num_key_heads: usize,
    #[serde(default = "d_k_dim")]
    pub linear_key_head_dim: usize,
    #[serde(default = "d_v_dim")]
    pub linear_value_head_dim: usize,
    #[serde(default = "d_conv")]
    pub linear_conv_kernel_dim: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    pub head_dim: Option<usize>,
    #[serde(default = "d_interval")]
    pub full_attention_interval: usize,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    pub rope_parameters: Option<Value>,
    pub partial_rotary_factor: Option<f64>,
    pub rope_theta: Option<f64>,
}

fn d_hidden() -> usize {
    4096
}
fn d_ffn() -> usize {
    14336
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> usize {
    32
}
fn d_eps() -> f64 {
    1e-6
}
fn d_vocab() -> usize {
    151936
}
fn d_kv_heads() -> usize {
    8
}
fn d_v_heads() -> usize {
    64
}
fn d_k_heads() -> usize {
    16
}
fn d_k_dim() -> usize {
    192
}
fn d_v_dim() -> usize {
    128
}
fn d_conv() -> usize {
    4
}
fn d_interval() -> usize {
    4
}
fn d_true() -> bool {
    true
}

impl Config {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Whether layer `i` is a Gated DeltaNet one (the others attend fully).
    pub fn is_linear(&self, i: usize) -> bool {
        !(i + 1).is_multiple_of(self.full_attention_interval.max(1))
    }

    /// The mixture of experts in every layer's MLP, if there is one.
    pub(crate) fn moe(&self) -> Option<MoeDims> {
        (self.num_experts > 0).then(|| {
            let mut m = MoeDims::qwen(
                self.num_experts,
                self.num_experts_per_tok,
                self.moe_intermediate_size,
                self.norm_topk_prob,
                vec![true; self.num_hidden_layers],
            );
            m.shared = Some(self.shared_expert_intermediate_size);
            m
        })
    }

    /// How many layers attend fully (and so keep keys and values).
    pub fn attention_layers(&self) -> usize {
        (0..self.num_hidden_layers).filter(|&i| !self.is_linear(i)).count()
    }

    /// Bytes one sequence's recurrent states take over the DeltaNet layers, whatever its
    /// length: each layer's convolution inputs (`kernel - 1` positions of the q/k/v channels,
    /// in the activations' `act` bytes) and recurrence state (value heads x value dim x key
    /// dim, float32), twice (the state before the last step is kept too).
    pub fn recurrent_state_bytes(&self, act: usize) -> usize {
        let key_dim = self.linear_num_key_heads * self.linear_key_head_dim;
        let value_dim = self.linear_num_value_heads * self.linear_value_head_dim;
        let conv = self.linear_conv_kernel_dim.saturating_sub(1) * (2 * key_dim + value_dim) * act;
        let state = self.linear_num_value_heads * self.linear_value_head_dim * self.linear_key_head_dim * 4;
        2 * (self.num_hidden_layers - self.attention_layers()) * (conv + state)
    }

    /// `rope_parameters`' theta and rotated fraction when it is there, else the config's own
    /// keys, else mlx-lm's defaults (100000, a quarter of the head).
    fn rope(&self) -> (f64, f64) {
        let p = self.rope_parameters.as_ref().filter(|p| p.as_object().is_some_and(|o| !o.is_empty()));
        let get = |key: &str, own: Option<f64>, default: f64| match p {
            Some(p) => p.get(key).and_then(Value::as_f64).unwrap_or(default),
            None => own.unwrap_or(default),
        };
        (get("rope_theta", self.rope_theta, 100_000.0), get("partial_rotary_factor", self.partial_rotary_factor, 0.25))
    }

    fn dims(&self) -> Dims {
        Dims {
            hidden: self.hidden_size,
            layers: self.num_hidden_layers,
            ffn: self.intermediate_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim(),
            vocab: self.vocab_size,
            eps: self.rms_norm_eps,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: false,
            qk_norm: true,
            tied: self.tie_word_embeddings,
            moe: None,
            windows: Vec::new(),
        }
    }
}

/// How many positions the recurrence solves together when a forward runs `s` of them (a
/// prefill): 64, or the power of two that covers a shorter run; `None` runs them one by one as
/// mlx-lm does off Metal (`HOST_DELTANET_CHUNK=0`, for A/B measurements; another power of two
/// there sets the size). Chunks and single steps agree to float32 rounding (the parity suites
/// and `chunked_gated_delta_equals_the_step_by_step_rule`).
fn chunk_size(s: i32) -> Option<i32> {
    static CHUNK: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    let most =
        *CHUNK.get_or_init(|| match std::env::var("HOST_DELTANET_CHUNK").ok().and_then(|v| v.parse::<i32>().ok()) {
            Some(n) if n <= 0 => 0,
            Some(n) => (n as u32).next_power_of_two() as i32,
            None => 64,
        });
    (most > 0 && s > 1).then(|| most.min((s as u32).next_power_of_two() as i32))
}

/// A Gated DeltaNet layer (mlx-lm's `GatedDeltaNet`).
struct DeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// `[conv_dim, kernel, 1]`: one causal filter per channel.
    conv: Array,
    dt_bias: Array,
    a_log: Array,
    /// The gated RMSNorm over each head's output.
    norm: Array,
    out_proj: Linear,
    k_heads: i32,
    v_heads: i32,
    k_dim: i32,
    v_dim: i32,
    kernel: i32,
    eps: f32,
}

impl DeltaNet {
    fn load(w: &Weights, p: &str, c: &Config) -> Result<DeltaNet> {
        let (hidden, hv, hk) = (c.hidden_size, c.linear_num_value_heads, c.linear_num_key_heads);
        if hk == 0 || hv % hk != 0 {
            return Err(Error::Invalid(format!(
                "linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})"
            )));
        }
        let key_dim = hk * c.linear_key_head_dim;
        let value_dim = hv * c.linear_value_head_dim;
        let conv_dim = 2 * key_dim + value_dim;
        Ok(DeltaNet {
            in_proj_qkv: Linear::load(w, &format!("{p}.in_proj_qkv"), hidden, conv_dim, false)?,
            in_proj_z: Linear::load(w, &format!("{p}.in_proj_z"), hidden, value_dim, false)?,
            in_proj_b: Linear::load(w, &format!("{p}.in_proj_b"), hidden, hv, false)?,
            in_proj_a: Linear::load(w, &format!("{p}.in_proj_a"), hidden, hv, false)?,
            conv: w.get_shaped(&format!("{p}.conv1d.weight"), &[conv_dim, c.linear_conv_kernel_dim, 1])?,
            dt_bias: w.get_shaped(&format!("{p}.dt_bias"), &[hv])?,
            a_log: w.get_shaped(&format!("{p}.A_log"), &[hv])?,
            norm: w.get_shaped(&format!("{p}.norm.weight"), &[c.linear_value_head_dim])?,
            out_proj: Linear::load(w, &format!("{p}.out_proj"), value_dim, hidden, false)?,
            k_heads: hk as i32,
            v_heads: hv as i32,
            k_dim: c.linear_key_head_dim as i32,
            v_dim: c.linear_value_head_dim as i32,
            kernel: c.linear_conv_kernel_dim as i32,
            eps: c.rms_norm_eps as f32,
        })
    }

    /// `ends`: row r's real positions are its first `ends[r]` (the rest padding, which leaves
    /// its state as it was: no write, no decay; 0 for a row that is all padding); `None` when
    /// all `s` are.
    fn forward(&self, x: &Array, cache: &mut KvCache, ends: Option<&[usize]>) -> Result<Array> {
        let (b, s) = (x.dim(0) as i32, x.dim(1) as i32);
        let ends = ends.filter(|e| e.iter().any(|&n| n != s as usize));
        // An end of 0 (a row only padded in this forward) keeps the row's state as it was.
        if ends.is_some_and(|e| e.len() != b as usize || e.iter().any(|&n| n > s as usize)) {
            return Err(Error::Invalid(format!("row ends {ends:?} for a forward of {b} rows of {s} positions")));
        }
        let (hk, hv, dk, dv) = (self.k_heads, self.v_heads, self.k_dim, self.v_dim);
        let (key_dim, value_dim) = (hk * dk, hv * dv);
        let conv_dim = 2 * key_dim + value_dim;
        let qkv = self.in_proj_qkv.forward(x)?;
        let z = self.in_proj_z.forward(x)?.reshape(&[b, s, hv, dv])?;
        let beta_in = self.in_proj_b.forward(x)?;
        let a = self.in_proj_a.forward(x)?;
        let held = cache.recurrent_state()?;
        let keep = self.kernel - 1;
        let conv_state = match &held.conv {
            Some(c) => c.clone(),
            None => Array::zeros(&[b as usize, keep as usize, conv_dim as usize], x.dtype())?,
        };
        let conv_input = ops::concatenate(&[&conv_state, &qkv], 1)?;
        let total = conv_input.dim(1) as i32;
        // The convolution's next inputs: the last `keep` before each row's end.
        let next_conv = match ends {
            None => conv_input.slice_axis(1, total - keep, total)?.contiguous()?,
            Some(ends) => {
                let rows = (0..b)
                    .map(|r| {
                        let e = ends[r as usize] as i32;
                        conv_input.slice_axis(0, r, r + 1)?.slice_axis(1, e, e + keep)
                    })
                    .collect::<mlx::Result<Vec<_>>>()?;
                ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?.contiguous()?
            }
        };
        // 1 at each row's real positions, 0 on its padding: `[B, S, 1]`.
        let real = match ends {
            None => None,
            Some(ends) => {
                let flags: Vec<f32> =
                    ends.iter().flat_map(|&e| (0..s as usize).map(move |t| if t < e { 1.0 } else { 0.0 })).collect();
                Some(Array::from_f32(&flags, &[b as usize, s as usize, 1])?)
            }
        };
        let conv_out = ops::silu(&ops::conv1d(&conv_input, &self.conv, conv_dim)?)?;
        let part = |from: i32, to: i32, heads: i32, dim: i32| -> Result<Array> {
            Ok(conv_out.slice_axis(2, from, to)?.reshape(&[b, s, heads, dim])?)
        };
        let q = part(0, key_dim, hk, dk)?;
        let k = part(key_dim, 2 * key_dim, hk, dk)?;
        let v = part(2 * key_dim, conv_dim, hv, dv)?;
        // mlx-lm's `normalize_qk`: L2 norms as RMS norms (eps scaled to match), the readout
        // scale Dk^-0.5 folded into q. Python's float arithmetic, then f32.
        let inv_scale = (dk as f64).powf(-0.5);
        let rms_eps = (1e-6 * inv_scale * inv_scale) as f32;
        let q =
            fast::rms_norm_plain(&q, rms_eps)?.multiply(&Array::scalar((inv_scale * inv_scale) as f32, q.dtype())?)?;
        let k = fast::rms_norm_plain(&k, rms_eps)?.multiply(&Array::scalar(inv_scale as f32, k.dtype())?)?;
        // Padding writes nothing (beta 0) and decays nothing (g 1 below).
        let beta = match &real {
            None => beta_in.sigmoid()?,
            Some(real) => beta_in.sigmoid()?.multiply(&real.astype(beta_in.dtype())?)?,
        };
        let mut state = match &held.state {
            Some(state) => state.clone(),
            None => Array::zeros(&[b as usize, hv as usize, dv as usize, dk as usize], Dtype::Float32)?,
        };
        let (q, k) = match hv / hk {
            1 => (q, k),
            r => (ops::repeat(&q, r, -2)?, ops::repeat(&k, r, -2)?),
        };
        // The states before each position, while the cache keeps that many (a decode step's
        // one, a verified draft's window): a rollback restores them. Those windows run
        // position by position; longer ones (prefill) in chunks.
        let snapshots = s as usize <= held.keeps();
        let mut before = Vec::with_capacity(if snapshots { s as usize } else { 0 });
        let y = match chunk_size(s) {
            Some(chunk) if !snapshots => {
                let mut log_g = ops::gated_delta_log_g(&self.a_log, &a, &self.dt_bias)?;
                if let Some(real) = &real {
                    log_g = log_g.multiply(real)?;
                }
                let (y, next) = ops::gated_delta_chunked(&q, &k, &v, &log_g, &beta, &state, chunk)?;
                state = next;
                y
            }
            _ => {
                let mut g = ops::gated_delta_g(&self.a_log, &a, &self.dt_bias)?;
                if let Some(real) = &real {
                    let one = Array::scalar(1.0, Dtype::Float32)?;
                    g = g.multiply(real)?.add(&one.subtract(real)?)?;
                }
                let at = |a: &Array, t: i32| -> Result<Array> { Ok(a.slice_axis(1, t, t + 1)?.squeeze(&[1])?) };
                let mut ys = Vec::with_capacity(s as usize);
                for t in 0..s {
                    if snapshots {
                        let conv = match t {
                            0 => held.conv.clone(),
                            _ => Some(conv_input.slice_axis(1, t, t + keep)?),
                        };
                        let state = if t == 0 { held.state.clone() } else { Some(state.clone()) };
                        before.push(Snapshot { conv, state });
                    }
                    let (y, next) = ops::gated_delta_step(
                        &at(&q, t)?,
                        &at(&k, t)?,
                        &at(&v, t)?,
                        &at(&g, t)?,
                        &at(&beta, t)?,
                        &state,
                    )?;
                    ys.push(y.expand_dims(&[1])?);
                    state = next;
                }
                match ys.len() {
                    1 => ys.pop().expect("one step"),
                    _ => ops::concatenate(&ys.iter().collect::<Vec<_>>(), 1)?,
                }
            }
        };
        cache.set_recurrent(next_conv, state, s as usize, before)?;
        // `RMSNormGated`: rms_norm(y) * silu(z), in float32.
        let normed = fast::rms_norm(&y, &self.norm, self.eps)?;
        let out = ops::precise_swiglu(&y, &z, &normed)?;
        self.out_proj.forward(&out.reshape(&[b, s, -1])?)
    }
}

enum Mixer {
    Linear(DeltaNet),
    Attention(Attention),
}

struct Block {
    mixer: Mixer,
    mlp: Box<dyn Forward>,
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

/// mlx-lm's `sanitize` for checkpoints as Qwen publishes them (a conv1d weight `[C, 1, K]`):
/// the convolutions moved to MLX's `[C, K, 1]` and the norms that scale by `1 + w` shifted
/// once (the gated norm inside the DeltaNet layers is stored as is); experts stored fused
/// (`experts.gate_up_proj` `[E, 2 I, H]`, `experts.down_proj`) split into `switch_mlp`'s
/// three. Multi-token prediction weights are not used.
fn sanitize(w: &mut Weights, layers: usize) -> Result<()> {
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        let Some(gate_up) = w.remove(&format!("{p}.experts.gate_up_proj")) else { continue };
        let (axis, rows) = (gate_up.ndim() as i32 - 2, gate_up.dim(-2) as i32);
        w.insert(format!("{p}.switch_mlp.gate_proj.weight"), gate_up.slice_axis(axis, 0, rows / 2)?);
        w.insert(format!("{p}.switch_mlp.up_proj.weight"), gate_up.slice_axis(axis, rows / 2, rows)?);
        let down = w.remove(&format!("{p}.experts.down_proj")).ok_or_else(|| {
            Error::Invalid(format!("{p}.experts.gate_up_proj has no {p}.experts.down_proj beside it"))
        })?;
        w.insert(format!("{p}.switch_mlp.down_proj.weight"), down);
    }
    let names: Vec<String> = w.names().cloned().collect();
    let mut unsanitized = false;
    for name in names.iter().filter(|n| n.ends_with("conv1d.weight")) {
        let a = w.get(name)?;
        if a.dim(-1) != 1 {
            unsanitized = true;
            w.insert(name.clone(), a.transpose(&[0, 2, 1])?);
        }
    }
    for name in names.iter().filter(|n| n.starts_with("mtp.")) {
        w.remove(name);
    }
    if !unsanitized {
        return Ok(());
    }
    let shifted = [
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    ];
    for name in names.iter().filter(|n| shifted.iter().any(|s| n.ends_with(s))) {
        let a = w.get(name)?;
        if a.ndim() == 1 {
            w.insert(name.clone(), a.add(&Array::scalar(1.0, a.dtype())?)?);
        }
    }
    Ok(())
}

pub fn load(c: &Config, w: &mut Weights, options: &LoadOptions) -> Result<Model> {
    if Tp::of(options).size > 1 {
        return Err(Error::Invalid(
            "tensor parallelism over qwen3_5 (recurrent layers) is not supported yet; run it on one rank".into(),
        ));
    }
    sanitize(w, c.num_hidden_layers)?;
    let d = c.dims();
    let moe = c.moe();
    let w = &*w;
    let tp = Tp::ONE;
    let layers = (0..c.num_hidden_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let mixer = if c.is_linear(i) {
                Mixer::Linear(DeltaNet::load(w, &format!("{p}.linear_attn"), c)?)
            } else {
                Mixer::Attention(Attention::load_gated(w, &format!("{p}.self_attn"), &d)?)
            };
            let mlp: Box<dyn Forward> = match &moe {
                None => Box::new(Mlp::load(w, &format!("{p}.mlp"), &d, Activation::Silu, tp)?),
                Some(m) => {
                    let s = Dims { ffn: c.shared_expert_intermediate_size, ..d.clone() };
                    let shared = Mlp::load(w, &format!("{p}.mlp.shared_expert"), &s, Activation::Silu, tp)?;
                    Box::new(SparseMoe::load(w, &format!("{p}.mlp"), d.hidden, m, Some(Box::new(shared)))?)
                }
            };
            Ok(Block {
                mixer,
                mlp,
                input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), d.hidden, d.eps)?,
                post_attention_layernorm: RmsNorm::load(w, &format!("{p}.post_attention_layernorm"), d.hidden, d.eps)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (theta, fraction) = c.rope();
    let rope_dims = (c.head_dim() as f64 * fraction) as usize;
    let rope = Rope::new(rope_dims, theta, false, c.rope_parameters.as_ref())?;
    Ok(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", d.vocab, d.hidden)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d.hidden, d.eps)?,
        lm_head: if c.tie_word_embeddings { None } else { Some(Linear::load(w, "lm_head", d.hidden, d.vocab, false)?) },
        rope,
        vocab: d.vocab,
    })
}

/// A layer's cache as the hybrid decoder uses it: keys and values for an attention layer,
/// the state a DeltaNet layer updates (one sequence's, or a batch's stacked rows).
trait HybridCache: LayerCache {
    fn recurrent(&mut self) -> Result<&mut KvCache>;
    /// Where each row's real positions end in this forward, if its shorter rows are padded
    /// after their end (`BatchKvCache::end_rows_at`).
    fn row_ends(&mut self) -> Option<Vec<usize>> {
        None
    }
}

impl HybridCache for KvCache {
    fn recurrent(&mut self) -> Result<&mut KvCache> {
        Ok(self)
    }
}

impl HybridCache for BatchKvCache {
    fn recurrent(&mut self) -> Result<&mut KvCache> {
        self.recurrent_mut()
    }

    fn row_ends(&mut self) -> Option<Vec<usize>> {
        self.take_row_ends()
    }
}

impl Model {
    fn decoder(
        &self,
        tokens: &Array,
        mask: &Mask<'_>,
        cache: &mut [impl HybridCache],
        at: &Positions,
    ) -> Result<Array> {
        let mut h = self.embed_tokens.forward(tokens)?;
        for (layer, c) in self.layers.iter().zip(cache.iter_mut()) {
            let x = layer.input_layernorm.forward(&h)?;
            let r = match &layer.mixer {
                Mixer::Linear(net) => {
                    let ends = c.row_ends();
                    net.forward(&x, c.recurrent()?, ends.as_deref())?
                }
                Mixer::Attention(attn) => attn.forward(&x, mask, c, &self.rope, at, None)?,
            };
            h = h.add(&r)?;
            h = h.add(&layer.mlp.forward(&layer.post_attention_layernorm.forward(&h)?)?)?;
        }
        self.norm.forward(&h)
    }
}

impl CausalLm for Model {
    fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let s = llama::StepInputs::sequence(tokens, cache)?;
        self.decoder(tokens, &s.mask(), cache, &s.positions())
    }

    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        let s = llama::StepInputs::batch(tokens, cache)?;
        self.decoder(tokens, &s.mask(), cache, &s.positions())
    }

    fn batches(&self) -> bool {
        true
    }

    fn head(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed_tokens.as_linear(h),
        }
    }

    fn make_cache(&self) -> Vec<KvCache> {
        self.layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(_) => KvCache::recurrent(),
                Mixer::Attention(a) => a.cache(),
            })
            .collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn takes_cache_forks(&self) -> bool {
        false
    }

    /// Its recurrent layers stop each row's state at the row's end (`end_rows_at`).
    fn prefills_in_batches(&self) -> bool {
        true
    }
}
