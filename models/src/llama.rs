//! Llama (covers SmolLM2, Mistral-style checkpoints and Llama 3.x RoPE scaling).
//! Reference: mlx-lm `models/llama.py`; every op mirrors it so outputs are bit-identical.

use crate::cache::{KvCache, LayerCache};
use crate::layers::{
    attention, attention_unfused, causal_mask, short_query, Embedding, Forward, Linear, Positions, RmsNorm, Rope,
};
use crate::weights::Weights;
use crate::BatchKvCache;
use crate::{CausalLm, LoadOptions, Result};
use mlx::fast::Mask;
use mlx::{ops, Array, Dtype};
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
    /// "full_attention" or "sliding_attention" per layer (mlx-lm's Llama reads these, e.g.
    /// for Ministral); absent: every layer attends fully, whatever `sliding_window` says.
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<usize>,
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
    /// Mixture-of-experts layers (Qwen3-MoE, GPT-OSS); `None`: every MLP is dense.
    pub moe: Option<crate::moe::MoeDims>,
    /// Each layer's sliding window (GPT-OSS's sliding layers), `None` for full attention;
    /// empty: every layer attends fully.
    pub windows: Vec<Option<usize>>,
}

impl Dims {
    /// Output widths of q, k and v.
    fn qkv_widths(&self) -> [usize; 3] {
        let kv = self.n_kv_heads * self.head_dim;
        [self.n_heads * self.head_dim, kv, kv]
    }
}

impl Config {
    /// Each layer's sliding window from `layer_types` (empty when there are none).
    pub(crate) fn windows(&self) -> crate::Result<Vec<Option<usize>>> {
        let Some(types) = &self.layer_types else { return Ok(Vec::new()) };
        layer_windows(types, self.num_hidden_layers, self.sliding_window)
    }

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
            moe: None,
            windows: Vec::new(),
        }
    }
}

/// A config's `sliding_window`, refused when it is 0 (no position could be attended).
pub(crate) fn sliding_window(w: usize) -> crate::Result<usize> {
    if w == 0 {
        return Err(crate::Error::Invalid("sliding_window is 0; a sliding layer needs a window of at least 1".into()));
    }
    Ok(w)
}

/// Per-layer sliding windows from a config's `layer_types` ("sliding_attention" layers get
/// `window`, "full_attention" ones `None`).
pub(crate) fn layer_windows(
    types: &[String],
    layers: usize,
    window: Option<usize>,
) -> crate::Result<Vec<Option<usize>>> {
    if types.len() != layers {
        return Err(crate::Error::Invalid(format!(
            "layer_types lists {} layers; the model has {layers} (num_hidden_layers)",
            types.len()
        )));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => Ok(None),
            "sliding_attention" => window.map(|w| sliding_window(w).map(Some)).unwrap_or_else(|| {
                Err(crate::Error::Invalid(
                    "layer_types has sliding_attention layers but the config has no sliding_window".into(),
                ))
            }),
            other => Err(crate::Error::Invalid(format!(
                "layer type {other:?} is not supported; supported: sliding_attention, full_attention"
            ))),
        })
        .collect()
}

/// Linear layers that read the same input (q/k/v, gate/up): a matmul each, or one matmul
/// over their concatenated rows (`LoadOptions::fuse_projections`, made by `fuse`) whose
/// output is sliced back into the parts' widths.
enum Projections {
    Separate(Vec<Linear>),
    Fused { linear: Linear, widths: Vec<i32> },
}

impl Projections {
    /// Modules `names` under `p` with output widths `widths`, or their fusion `p.fused`.
    fn load(
        w: &Weights,
        p: &str,
        names: &[&str],
        widths: &[usize],
        fused: &str,
        inputs: usize,
        bias: bool,
    ) -> Result<Self> {
        let fused = format!("{p}.{fused}");
        if w.contains(&format!("{fused}.weight")) {
            let linear = Linear::load(w, &fused, inputs, widths.iter().sum(), bias)?;
            return Ok(Projections::Fused { linear, widths: widths.iter().map(|&n| n as i32).collect() });
        }
        let parts = names.iter().zip(widths).map(|(name, &n)| Linear::load(w, &format!("{p}.{name}"), inputs, n, bias));
        Ok(Projections::Separate(parts.collect::<Result<_>>()?))
    }

    /// Each part's output, in order.
    fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|l| l.forward(x)).collect(),
            Projections::Fused { linear, widths } => split_last(&linear.forward(x)?, widths),
        }
    }

    /// As `forward`, with the first `n` parts' outputs as one array (one slice of the fused
    /// output); `None` when the parts are separate matmuls.
    fn forward_first_joined(&self, x: &Array, n: usize) -> Result<Option<Vec<Array>>> {
        let Projections::Fused { linear, widths } = self else { return Ok(None) };
        let joined: Vec<i32> = std::iter::once(widths[..n].iter().sum()).chain(widths[n..].iter().copied()).collect();
        Ok(Some(split_last(&linear.forward(x)?, &joined)?))
    }
}

/// `y` cut along its last axis into consecutive slices of `widths`.
fn split_last(y: &Array, widths: &[i32]) -> Result<Vec<Array>> {
    let last = y.ndim() as i32 - 1;
    let mut start = 0;
    widths
        .iter()
        .map(|&n| {
            start += n;
            Ok(y.slice_axis(last, start - n, start)?)
        })
        .collect()
}

/// Module names of the projections that `fuse` concatenates, and of their fusions (never in
/// a checkpoint).
const QKV: [&str; 3] = ["q_proj", "k_proj", "v_proj"];
const FUSED_QKV: &str = "fused_qkv";
const GATE_UP: [&str; 2] = ["gate_proj", "up_proj"];
const FUSED_GATE_UP: &str = "fused_gate_up";

/// Concatenates each layer's q/k/v and gate/up weights where their formats and shapes agree
/// with `d` (a misfit part stays separate, and loading it names it).
pub(crate) fn fuse(d: &Dims, w: &mut Weights) -> Result<()> {
    for i in 0..d.layers {
        for (module, names, widths, fused) in [
            ("self_attn", &QKV[..], &d.qkv_widths()[..], FUSED_QKV),
            ("mlp", &GATE_UP[..], &[d.ffn, d.ffn][..], FUSED_GATE_UP),
        ] {
            let p = format!("model.layers.{i}.{module}");
            let parts: Vec<String> = names.iter().map(|n| format!("{p}.{n}")).collect();
            w.fuse_rows(&parts, widths, &format!("{p}.{fused}"))?;
        }
    }
    Ok(())
}

pub(crate) struct Attention {
    /// q, k, v.
    qkv: Projections,
    o_proj: Linear,
    /// Per-head norms of q and k (Qwen3), applied before RoPE.
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
    /// Sliding-window attention (Gemma 3's local layers): a query sees the last `window`
    /// positions, itself included.
    window: Option<usize>,
    /// GPT-OSS's attention sinks: a learned logit per head in every softmax.
    sinks: Option<Array>,
    /// Tensor parallel: this rank holds some heads; sum `o_proj`'s partial outputs.
    reduce: Tp,
    /// Qwen3-Next's output gate: `q_proj` gives each head its queries and as many gate
    /// values, and the attention's output is multiplied by their sigmoid before `o_proj`.
    gated: bool,
}

/// Llama 4's query scale by position (Ministral 3), as mlx-lm's `_get_llama_4_attn_scale`:
/// `1 + beta * ln(1 + floor(position / original))` for `l` new queries at `at`, `[L, 1]` or
/// `[B, 1, L, 1]` per row; made once per forward, multiplied into every layer's queries after RoPE.
fn query_scale(beta: f32, original: f32, l: i32, at: &Positions, dtype: mlx::Dtype) -> Result<Array> {
    let f32 = mlx::Dtype::Float32;
    let steps = Array::arange(0.0, l as f64, 1.0, f32)?;
    let pos = match at {
        Positions::From(offset) => steps.add(&Array::scalar(*offset as f32, f32)?)?.reshape(&[l, 1])?,
        Positions::Rows(offsets) | Positions::Ragged { offsets, .. } => {
            let rows = offsets.astype(f32)?.reshape(&[-1, 1])?.add(&steps)?;
            rows.reshape(&[rows.dim(0) as i32, 1, l, 1])?
        }
    };
    let one = Array::scalar(1.0, f32)?;
    let s = pos.floor_divide(&Array::scalar(original, f32)?)?.add(&one)?.log()?;
    Ok(s.multiply(&Array::scalar(beta, f32)?)?.add(&one)?.astype(dtype)?)
}

impl Attention {
    pub(crate) fn load(w: &Weights, p: &str, d: &Dims, tp: Tp) -> Result<Self> {
        Self::load_projections(w, p, d, tp, d.qkv_widths())
    }

    fn load_projections(w: &Weights, p: &str, d: &Dims, tp: Tp, widths: [usize; 3]) -> Result<Self> {
        Ok(Attention {
            qkv: Projections::load(w, p, &QKV, &widths, FUSED_QKV, d.hidden, d.qkv_bias)?,
            o_proj: Linear::load(
                w,
                &format!("{p}.o_proj"),
                d.n_heads * d.head_dim,
                d.hidden,
                d.o_bias && tp.rank == 0,
            )?,
            q_norm: d.qk_norm.then(|| RmsNorm::load(w, &format!("{p}.q_norm"), d.head_dim, d.eps)).transpose()?,
            k_norm: d.qk_norm.then(|| RmsNorm::load(w, &format!("{p}.k_norm"), d.head_dim, d.eps)).transpose()?,
            n_heads: d.n_heads as i32,
            n_kv_heads: d.n_kv_heads as i32,
            scale: (d.head_dim as f64).powf(-0.5) as f32,
            window: None,
            sinks: None,
            reduce: tp,
            gated: false,
        })
    }

    /// An attention with Qwen3-Next's output gate (`q_proj` twice as wide: each head's
    /// queries, then its gate); single rank, projections unfused.
    pub(crate) fn load_gated(w: &Weights, p: &str, d: &Dims) -> Result<Self> {
        let [q, k, v] = d.qkv_widths();
        Ok(Attention { gated: true, ..Self::load_projections(w, p, d, Tp::ONE, [2 * q, k, v])? })
    }

    /// Scores scaled by `scale` instead of `head_dim^-0.5`.
    pub(crate) fn scaled(self, scale: f64) -> Self {
        Attention { scale: scale as f32, ..self }
    }

    /// With these per-head norms of q and k (Gemma's scale by `1 + weight`).
    pub(crate) fn with_qk_norms(self, q_norm: RmsNorm, k_norm: RmsNorm) -> Self {
        Attention { q_norm: Some(q_norm), k_norm: Some(k_norm), ..self }
    }

    /// With attention sinks (`[n_heads]`).
    pub(crate) fn with_sinks(self, sinks: Option<Array>) -> Self {
        Attention { sinks, ..self }
    }

    /// Attending over a sliding window of `window` positions.
    pub(crate) fn windowed(self, window: Option<usize>) -> Self {
        Attention { window, ..self }
    }

    /// The cache this layer needs: bounded to its window, if it slides.
    pub(crate) fn cache(&self) -> KvCache {
        KvCache::windowed(self.window)
    }

    pub(crate) fn forward(
        &self,
        x: &Array,
        mask: &Mask<'_>,
        cache: &mut impl LayerCache,
        rope: &Rope,
        at: &Positions,
        query_scale: Option<&Array>,
    ) -> Result<Array> {
        let (b, l) = (x.dim(0) as i32, x.dim(1) as i32);
        let heads = |a: &Array, n: i32, norm: Option<&RmsNorm>| -> Result<Array> {
            let mut a = a.reshape(&[b, l, n, -1])?;
            if let Some(norm) = norm {
                a = norm.forward(&a)?;
            }
            Ok(a.transpose(&[0, 2, 1, 3])?)
        };
        let mut gate = None;
        // Without per-head norms, q and k heads get the same rotation: with fused projections
        // they are one slice of the product, and one RoPE over all their heads is one kernel
        // (per layer and step) fewer than two.
        let joined = if self.q_norm.is_none() && !self.gated { self.qkv.forward_first_joined(x, 2)? } else { None };
        let (q, k, v) = match joined {
            Some(qk_v) => {
                let (nq, nk) = (self.n_heads, self.n_kv_heads);
                let qk = rope.forward_at(&heads(&qk_v[0], nq + nk, None)?, at)?;
                (qk.slice_axis(1, 0, nq)?, qk.slice_axis(1, nq, nq + nk)?, heads(&qk_v[1], nk, None)?)
            }
            None => {
                let mut qkv = self.qkv.forward(x)?;
                if self.gated {
                    // `[B, L, H, 2 * D]`: each head's queries, then its gate.
                    let both = qkv[0].reshape(&[b, l, self.n_heads, -1])?;
                    let d = both.dim(3) as i32 / 2;
                    gate = Some(both.slice_axis(3, d, 2 * d)?.reshape(&[b, l, -1])?);
                    qkv[0] = both.slice_axis(3, 0, d)?;
                }
                let q = heads(&qkv[0], self.n_heads, self.q_norm.as_ref())?;
                let k = heads(&qkv[1], self.n_kv_heads, self.k_norm.as_ref())?;
                (rope.forward_at(&q, at)?, rope.forward_at(&k, at)?, heads(&qkv[2], self.n_kv_heads, None)?)
            }
        };
        let (k, v) = cache.update_and_fetch(&k, &v)?;
        let q = match query_scale {
            Some(s) => q.multiply(s)?,
            None => q,
        };
        let o = attend(&q, &k, &v, self.scale, mask, self.window, self.sinks.as_ref(), at)?;
        let mut o = o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        if let Some(gate) = gate {
            o = o.multiply(&gate.sigmoid()?)?;
        }
        self.reduce.sum(self.o_proj.forward(&o)?)
    }
}

/// Scaled dot-product attention of `q` over the keys and values a layer's cache gave back,
/// under the forward's `mask` (a batch's padding mask cut to the columns held), over the last
/// `window` positions for a sliding layer (by the keys' distances where `at` gives them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Mask<'_>,
    window: Option<usize>,
    sinks: Option<&Array>,
    at: &Positions,
) -> Result<Array> {
    if let (Some(window), Positions::Ragged { distance, .. }) = (window, at) {
        // A row's last `window` positions are not its last `window` columns here: the mask
        // takes the keys each query is near by position, over every key the layer holds.
        let n = k.dim(2);
        let near = last_keys(distance, n)?.less(&Array::scalar(window as f32, Dtype::Int32)?)?;
        let visible = match mask {
            Mask::Array(m) => last_keys(m, n)?.logical_and(&near)?,
            _ => near,
        };
        return attention(q, k, v, scale, Mask::Array(&visible), sinks);
    }
    match window {
        Some(window) if k.dim(2) > window => windowed_attention(q, k, v, scale, mask, window, sinks),
        _ => match mask {
            Mask::Array(m) => attention(q, k, v, scale, Mask::Array(&last_keys(m, k.dim(2))?), sinks),
            _ => attention(q, k, v, scale, mask_ref(mask), sinks),
        },
    }
}

/// The last `n` key columns of an attention mask (`[..., keys]`). A batch forward's padding
/// mask spans the columns of the layer that holds the most (a global one); a sliding layer's
/// bounded cache holds the last of them.
fn last_keys(mask: &Array, n: usize) -> Result<Array> {
    let (last, keys) = (mask.ndim() as i32 - 1, mask.dim(-1));
    if keys <= n {
        return Ok(mask.clone());
    }
    Ok(mask.slice_axis(last, (keys - n) as i32, keys as i32)?)
}

/// Attention over the last `window` positions of `k`/`v` (`[B, KVH, S, D]`, S > window) for
/// queries `q` (`[B, H, L, D]`) at the last L of the S positions. `mask` is the forward's
/// mask over (at least) the last S positions: causal when L > 1 (a single sequence or a fork
/// of one), and for one query none or a batch's padding mask. The keys no query can see are
/// sliced off, so a decode step reads `window` positions whatever the sequence's length.
fn windowed_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Mask<'_>,
    window: usize,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (l, s) = (q.dim(2), k.dim(2));
    // The first query, at position s - l, sees positions from s - l + 1 - window on.
    let lo = (s + 1).saturating_sub(l + window);
    let keep = |a: &Array| -> Result<Array> { Ok(a.slice_axis(2, lo as i32, s as i32)?) };
    let (k, v) = (keep(k)?, keep(v)?);
    if l == 1 {
        return match mask {
            Mask::Array(m) => attention(q, &k, &v, scale, Mask::Array(&last_keys(m, s - lo)?), sinks),
            _ => attention(q, &k, &v, scale, Mask::None, sinks),
        };
    }
    // Query i (position s - l + i) sees key j (position lo + j) when 0 <= (s - l + i) - (lo + j) < window.
    let rows = Array::arange((s - l) as f64, s as f64, 1.0, Dtype::Int32)?.expand_dims(&[1])?;
    let cols = Array::arange(lo as f64, s as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
    let since = rows.subtract(&cols)?;
    let visible = since
        .greater_equal(&Array::scalar(0.0, Dtype::Int32)?)?
        .logical_and(&since.less(&Array::scalar(window as f32, Dtype::Int32)?)?)?;
    if short_query(l) {
        // Not the short causal kernel: this mask is not the plain causal one.
        attention_unfused(q, &k, &v, scale, Some(&visible), sinks)
    } else {
        attention(q, &k, &v, scale, Mask::Array(&visible), sinks)
    }
}

fn mask_ref<'a>(m: &'a Mask<'a>) -> Mask<'a> {
    match m {
        Mask::None => Mask::None,
        Mask::Causal => Mask::Causal,
        Mask::Array(a) => Mask::Array(a),
    }
}

/// What a forward's layers take besides the hidden states, from its tokens and caches: the
/// attention mask (`mask`) and where each position sits (`positions`). Every decoder builds
/// its single-sequence and batch forwards from these.
pub(crate) enum StepInputs {
    /// `len` new positions of one sequence after `offset` held ones; `short`: a short query's
    /// explicit causal mask (`layers::short_query`), else mlx-lm's choice.
    Sequence { len: usize, offset: usize, short: Option<Array> },
    /// New tokens per row of a batch (one, or a speculative step's several): each row's
    /// offset, and the mask of the rows' padding and holes (causal over several new ones);
    /// with sliding layers and holes or several new positions, the keys' distances from the
    /// queries (`Positions::Ragged`).
    Batch { offsets: Array, padding: Option<Array>, distance: Option<Array> },
}

impl StepInputs {
    pub(crate) fn sequence(tokens: &Array, cache: &[KvCache]) -> Result<StepInputs> {
        let (len, offset) = (tokens.dim(-1), cache.first().map_or(0, KvCache::offset));
        let short = short_query(len).then(|| causal_mask(len, offset)).transpose()?;
        Ok(StepInputs::Sequence { len, offset, short })
    }

    /// A batch forward's RoPE offsets (each row's length, the same in every layer) and padding
    /// mask, from the layer's cache that holds the most columns (a full-attention one, where
    /// sliding layers drop their oldest; a recurrent layer's only if there is no other);
    /// `tokens` `[B, T]`: T new positions per row (several in a speculative step, whose rows
    /// then roll back by their own amounts, `BatchKvCache::trim_rows`). Where a sliding layer's
    /// row may not hold its positions in one run (holes, or several new ones), the distances too.
    pub(crate) fn batch(tokens: &Array, cache: &[BatchKvCache]) -> Result<StepInputs> {
        if tokens.ndim() != 2 || tokens.dim(1) == 0 {
            return Err(crate::Error::Invalid(format!(
                "a batch forward takes [B, T] tokens (T new positions per row); got shape {:?}",
                tokens.shape()
            )));
        }
        let widest = cache
            .iter()
            .min_by_key(|c| (c.is_recurrent(), c.start()))
            .ok_or_else(|| crate::Error::Invalid("a batch forward needs a cache".into()))?;
        let len = tokens.dim(1);
        let sliding = cache.iter().any(|c| c.is_windowed());
        let distance = (sliding && (len > 1 || widest.has_holes())).then(|| widest.key_distance(len)).transpose()?;
        Ok(StepInputs::Batch { offsets: widest.offsets()?, padding: widest.mask_for(len)?, distance })
    }

    pub(crate) fn mask(&self) -> Mask<'_> {
        match self {
            StepInputs::Sequence { len, short, .. } => short.as_ref().map_or(attention_mask(*len), Mask::Array),
            StepInputs::Batch { padding, .. } => padding.as_ref().map_or(Mask::None, Mask::Array),
        }
    }

    pub(crate) fn positions(&self) -> Positions<'_> {
        match self {
            StepInputs::Sequence { offset, .. } => Positions::From(*offset),
            StepInputs::Batch { offsets, distance: None, .. } => Positions::Rows(offsets),
            StepInputs::Batch { offsets, distance: Some(distance), .. } => Positions::Ragged { offsets, distance },
        }
    }
}

/// mlx-lm's mask choice: none for one new token, "causal" for several (but a short query
/// outside Metal gets an explicit causal mask: `layers::short_query`).
fn attention_mask(len: usize) -> Mask<'static> {
    if len > 1 {
        Mask::Causal
    } else {
        Mask::None
    }
}

/// The gated MLP's activation of its gate.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Activation {
    /// `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// `gelu_approx(gate) * up` (Gemma).
    GeluApprox,
}

pub(crate) struct Mlp {
    /// gate, up.
    gate_up: Projections,
    down_proj: Linear,
    activation: Activation,
    /// Tensor parallel: this rank holds some columns; sum `down_proj`'s partial outputs.
    reduce: Tp,
}

impl Mlp {
    pub(crate) fn load(w: &Weights, p: &str, d: &Dims, activation: Activation, tp: Tp) -> Result<Self> {
        let (hidden, ffn, bias) = (d.hidden, d.ffn, d.mlp_bias);
        Ok(Mlp {
            gate_up: Projections::load(w, p, &GATE_UP, &[ffn, ffn], FUSED_GATE_UP, hidden, bias)?,
            down_proj: Linear::load(w, &format!("{p}.down_proj"), ffn, hidden, bias && tp.rank == 0)?,
            activation,
            reduce: tp,
        })
    }
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        Forward::forward(self, x)
    }
}

impl Forward for Mlp {
    fn forward(&self, x: &Array) -> Result<Array> {
        let gate_up = self.gate_up.forward(x)?;
        let gated = match self.activation {
            Activation::Silu => ops::swiglu(&gate_up[0], &gate_up[1])?,
            Activation::GeluApprox => ops::gelu_approx(&gate_up[0])?.multiply(&gate_up[1])?,
        };
        let y = self.down_proj.forward(&gated)?;
        self.reduce.sum(y)
    }
}

/// A block's feed-forward layer: a dense MLP, or a sparse mixture of experts.
enum FeedForward {
    Dense(Mlp),
    Sparse(crate::moe::SparseMoe),
}

impl FeedForward {
    fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Sparse(m) => m.forward(x),
        }
    }
}

struct Block {
    self_attn: Attention,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    /// Each residual branch multiplied by this before it is added (MiniCPM's
    /// `scale_depth / sqrt(layers)`); `None`: added as it is.
    residual: Option<f32>,
}

impl Block {
    fn forward(
        &self,
        x: &Array,
        mask: &Mask<'_>,
        cache: &mut impl LayerCache,
        rope: &Rope,
        at: &Positions,
        query_scale: Option<&Array>,
    ) -> Result<Array> {
        let branch = |r: Array| -> Result<Array> {
            Ok(match self.residual {
                Some(s) => r.multiply(&Array::scalar(s, r.dtype())?)?,
                None => r,
            })
        };
        let h = x.add(&branch(self.self_attn.forward(
            &self.input_layernorm.forward(x)?,
            mask,
            cache,
            rope,
            at,
            query_scale,
        )?)?)?;
        Ok(h.add(&branch(self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?)?)
    }
}

pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rope: Rope,
    vocab: usize,
    /// Llama 4's query scale by position (Ministral 3): (beta, original context length).
    position_scale: Option<(f32, f32)>,
    /// Embeddings multiplied by this (MiniCPM's `scale_emb`).
    embed_scale: Option<f32>,
    /// The final hidden state divided by this before an untied head (MiniCPM's
    /// `hidden_size / dim_model_base`).
    head_divisor: Option<f32>,
    /// This rank's pipeline stage (`layers` holds only its layers); `None`: every layer.
    stage: Option<Stage>,
    hidden: usize,
}

/// A pipeline rank's stage: the decoder layers `first..end`. Stages run from the highest rank
/// (the first layers, after the embeddings) down to rank 0 (the last layers, the norm and the
/// head: the server's rank), each receiving the hidden state from the rank above and sending
/// its own to the rank below — one activation a step between neighbours. Stages below
/// `layers % size` take one layer more, so rank 0's holds the most.
///
/// With tensor parallelism too, a stage is `shards` neighbouring ranks (stage `s` is ranks
/// `s * shards..(s + 1) * shards`, each a shard of the stage's layers): the stage's first
/// rank sends the hidden state on to the last rank of the stage below, which passes it down
/// its stage's ranks, each to the next.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stage {
    rank: usize,
    size: usize,
    first: usize,
    end: usize,
    /// This rank's tensor-parallel shard of the stage, and the stage's shard count.
    shard: usize,
    shards: usize,
}

impl Stage {
    pub(crate) fn of(options: &LoadOptions, layers: usize) -> Option<Stage> {
        let g = options.pipeline.filter(|g| g.size > 1)?;
        let count = |r: usize| layers / g.size + usize::from(r < layers % g.size);
        let first: usize = (g.rank + 1..g.size).map(count).sum();
        let (shard, shards) = options.tensor_parallel.filter(|t| t.size > 1).map_or((0, 1), |t| (t.rank, t.size));
        Some(Stage { rank: g.rank, size: g.size, first, end: first + count(g.rank), shard, shards })
    }

    /// Whether this stage starts the pipeline (it embeds the tokens).
    fn starts(&self) -> bool {
        self.rank + 1 == self.size
    }

    /// This process's rank in the group.
    fn me(&self) -> usize {
        self.rank * self.shards + self.shard
    }
}

impl Model {
    /// Every layer's queries scaled by position, Llama 4's way ([`query_scale`]).
    pub(crate) fn position_scaled(self, beta: f32, original: f32) -> Self {
        Model { position_scale: Some((beta, original)), ..self }
    }

    /// MiniCPM's scaling: embeddings by `embed`, each residual branch by `residual`, the
    /// hidden state divided by `head_divisor` before an untied head (a tied one takes it as
    /// it is, as mlx-lm's `minicpm.py`).
    pub(crate) fn scaled(mut self, embed: f32, residual: f32, head_divisor: f32) -> Self {
        for layer in &mut self.layers {
            layer.residual = Some(residual);
        }
        Model { embed_scale: Some(embed), head_divisor: Some(head_divisor), ..self }
    }

    /// The tokens' embeddings, scaled where the model scales them.
    fn embed(&self, tokens: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(tokens)?;
        Ok(match self.embed_scale {
            Some(s) => h.multiply(&Array::scalar(s, h.dtype())?)?,
            None => h,
        })
    }

    pub fn load(config: &Config, weights: &mut Weights, options: &LoadOptions) -> Result<Self> {
        let rope = Rope::new(
            config.head_dim.unwrap_or(config.hidden_size / config.num_attention_heads),
            config.rope_theta,
            config.rope_traditional,
            config.rope_scaling.as_ref(),
        )?;
        let dims = Dims { windows: config.windows()?, ..config.dims() };
        Self::load_dims(&dims, rope, weights, options)
    }

    /// Builds the decoder; with a tensor-parallel `group`, this rank's shard of it (attention
    /// heads and MLP columns split across ranks, an all-reduce after `o_proj` and `down_proj`).
    /// `w` is cut down to this rank's shard in place, and its projections fused when
    /// `options` says so.
    pub(crate) fn load_dims(d: &Dims, rope: Rope, w: &mut Weights, options: &LoadOptions) -> Result<Self> {
        let tp = Tp::of(options);
        let stage = Stage::of(options, d.layers);
        let own = stage.map_or(0..d.layers, |s| s.first..s.end);
        if stage.is_some() {
            // Other stages' layers are never read here (nor materialized by the loader).
            let others: Vec<String> = w
                .names()
                .filter(|n| {
                    n.strip_prefix("model.layers.")
                        .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
                        .is_some_and(|i| !own.contains(&i))
                })
                .cloned()
                .collect();
            for n in others {
                w.remove(&n);
            }
        }
        if tp.size > 1 && d.moe.is_some() {
            return Err(crate::Error::Invalid(
                "tensor parallelism over a mixture-of-experts model is not supported yet; run it on one rank".into(),
            ));
        }
        if let Some(m) = &d.moe {
            for (i, _) in m.sparse.iter().enumerate().filter(|(i, &s)| s && own.contains(i)) {
                crate::moe::stack_experts(w, &format!("model.layers.{i}.mlp"), m.experts)?;
            }
        }
        let d = &if tp.size > 1 { shard(d, w, tp)? } else { d.clone() };
        if options.fuse_projections() {
            fuse(d, w)?;
        }
        let w = &*w;
        let layers = own
            .map(|i| {
                let p = format!("model.layers.{i}");
                let sinks = format!("{p}.self_attn.sinks");
                let sinks = w.contains(&sinks).then(|| w.get_shaped(&sinks, &[d.n_heads])).transpose()?;
                Ok(Block {
                    self_attn: Attention::load(w, &format!("{p}.self_attn"), d, tp)?
                        .windowed(d.windows.get(i).copied().flatten())
                        .with_sinks(sinks),
                    mlp: match &d.moe {
                        Some(m) if m.sparse[i] => {
                            let shared = m.shared.map(|ffn| {
                                let s = Dims { ffn, ..d.clone() };
                                Mlp::load(w, &format!("{p}.mlp.shared_expert"), &s, Activation::Silu, tp)
                                    .map(|m| Box::new(m) as Box<dyn Forward>)
                            });
                            let moe =
                                crate::moe::SparseMoe::load(w, &format!("{p}.mlp"), d.hidden, m, shared.transpose()?);
                            FeedForward::Sparse(moe?)
                        }
                        _ => FeedForward::Dense(Mlp::load(w, &format!("{p}.mlp"), d, Activation::Silu, tp)?),
                    },
                    input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), d.hidden, d.eps)?,
                    post_attention_layernorm: RmsNorm::load(
                        w,
                        &format!("{p}.post_attention_layernorm"),
                        d.hidden,
                        d.eps,
                    )?,
                    residual: None,
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
            position_scale: None,
            embed_scale: None,
            head_divisor: None,
            stage,
            hidden: d.hidden,
        })
    }
}

impl Model {
    /// The final hidden states (after the last norm), before the output head. Under tensor
    /// parallelism every rank evaluates these: they depend on every all-reduce of the step.
    /// In a pipeline, a stage other than rank 0's returns what sends its hidden states on
    /// (evaluating it sends them).
    pub fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let s = StepInputs::sequence(tokens, cache)?;
        self.decoder(self.stage_input(tokens)?, &s.mask(), cache, &s.positions())
    }

    /// The embeddings of `tokens`, or in a pipeline stage after the first, the hidden states
    /// the stage above sends (passed on to the stage's next shard, if it has one below).
    fn stage_input(&self, tokens: &Array) -> Result<Array> {
        match self.stage {
            Some(st) if !st.starts() => {
                let mut shape = tokens.shape();
                shape.push(self.hidden);
                let h = mlx::distributed::recv(&shape, self.embed_tokens.output_dtype(), st.me() + 1)?;
                Ok(if st.shard > 0 { mlx::distributed::send(&h, st.me() - 1)? } else { h })
            }
            _ => self.embed(tokens),
        }
    }

    /// The decoder layers and the final norm over embeddings `h` (in a pipeline stage other
    /// than rank 0's, the layers, then the send to the stage below).
    fn decoder(&self, mut h: Array, mask: &Mask<'_>, cache: &mut [impl LayerCache], at: &Positions) -> Result<Array> {
        let scale =
            self.position_scale.map(|(beta, original)| query_scale(beta, original, h.dim(1) as i32, at, h.dtype()));
        let scale = scale.transpose()?;
        for (layer, c) in self.layers.iter().zip(cache.iter_mut()) {
            h = layer.forward(&h, mask, c, &self.rope, at, scale.as_ref())?;
        }
        match self.stage {
            Some(st) if st.rank > 0 && st.shard == 0 => Ok(mlx::distributed::send(&h, st.me() - 1)?),
            Some(st) if st.rank > 0 => Ok(h),
            _ => self.norm.forward(&h),
        }
    }

    /// As `forward_hidden`, for one new token per row of a batch (`tokens` `[B, 1]`): each
    /// row rotated from its own length and masked off its left padding.
    pub fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        let s = StepInputs::batch(tokens, cache)?;
        self.decoder(self.stage_input(tokens)?, &s.mask(), cache, &s.positions())
    }

    /// Logits of final hidden states.
    pub fn head(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => match self.head_divisor {
                Some(d) => head.forward(&h.divide(&Array::scalar(d, h.dtype())?)?),
                None => head.forward(h),
            },
            None => self.embed_tokens.as_linear(h),
        }
    }
}

/// This process's tensor-parallel shard: its index and the shard count (1 when not
/// tensor-parallel).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tp {
    pub rank: usize,
    pub size: usize,
    /// With pipeline stages too, the group rank of this stage's first shard: the stage's
    /// shards are the ranks `first..first + size`, neighbours in the ring, and they sum
    /// over a chain of sends ([`Tp::sum`]). `None`: the shards are the whole group.
    pub first: Option<usize>,
}

impl Tp {
    /// No split.
    pub(crate) const ONE: Tp = Tp { rank: 0, size: 1, first: None };

    pub(crate) fn of(options: &LoadOptions) -> Tp {
        let Some(g) = options.tensor_parallel.filter(|g| g.size > 1) else { return Tp::ONE };
        let first = options.pipeline.filter(|p| p.size > 1).map(|p| p.rank * g.size);
        Tp { rank: g.rank, size: g.size, first }
    }

    /// Sums a row-parallel layer's partial outputs `y` over the shards: MLX's all-reduce over
    /// the whole group, or within a pipeline stage a chain over its ranks, each a neighbour
    /// of the next in the ring (the ring backend sends to neighbours only, and cannot split
    /// its group): the partial sums run down to the stage's first rank, and the total back
    /// up, so every shard holds the same bits.
    fn sum(&self, y: Array) -> Result<Array> {
        use mlx::distributed::{recv_after, send};
        let Some(first) = self.first else {
            return Ok(if self.size > 1 { mlx::distributed::all_sum(&y)? } else { y });
        };
        let (me, shape, dtype) = (first + self.rank, y.shape(), y.dtype());
        let last = self.rank + 1 == self.size;
        // Each receive waits for this rank's own part: every message from a neighbour is then
        // read in the order it was sent (MLX may run an operation without inputs at any time).
        let partial = if last { y } else { y.add(&recv_after(&shape, dtype, me + 1, &y)?)? };
        let total = match self.rank {
            0 => partial,
            _ => recv_after(&shape, dtype, me - 1, &send(&partial, me - 1)?)?,
        };
        Ok(if last { total } else { send(&total, me + 1)? })
    }
}

/// Whether a decoder with these widths splits evenly over `n` ranks; the error says which
/// rank counts would.
pub(crate) fn check_split(n_heads: usize, n_kv_heads: usize, ffn: usize, n: usize) -> Result<()> {
    for (what, value) in [("key/value heads", n_kv_heads), ("attention heads", n_heads), ("MLP width", ffn)] {
        if !value.is_multiple_of(n) {
            let ok: Vec<String> = (1..=n_kv_heads)
                .filter(|&k| n_kv_heads.is_multiple_of(k) && n_heads.is_multiple_of(k) && ffn.is_multiple_of(k))
                .map(|k| k.to_string())
                .collect();
            return Err(crate::Error::Invalid(format!(
                "tensor parallelism over {n} ranks needs the model's {what} ({value}) to divide by {n}; this model can use {} ranks",
                ok.join(", ")
            )));
        }
    }
    Ok(())
}

/// This rank's dims and weights: q/k/v/gate/up split by output rows (column parallel),
/// o/down by input columns (row parallel, bias kept on rank 0 only); embeddings, norms and
/// the head stay whole.
pub(crate) fn shard(d: &Dims, w: &mut Weights, tp: Tp) -> Result<Dims> {
    let n = tp.size;
    check_split(d.n_heads, d.n_kv_heads, d.ffn, n)?;
    for i in 0..d.layers {
        let p = format!("model.layers.{i}");
        for (module, rows) in [
            ("self_attn.q_proj", true),
            ("self_attn.k_proj", true),
            ("self_attn.v_proj", true),
            ("mlp.gate_proj", true),
            ("mlp.up_proj", true),
            ("self_attn.o_proj", false),
            ("mlp.down_proj", false),
        ] {
            let prefix = format!("{p}.{module}");
            if let Some(q) = w.quantization_of(&prefix)? {
                let inputs = if module == "self_attn.o_proj" { d.n_heads * d.head_dim } else { d.ffn };
                if !rows && !(inputs / n).is_multiple_of(q.group_size as usize) {
                    return Err(crate::Error::Invalid(format!(
                        "tensor parallelism over {n} ranks splits {prefix}'s {inputs} inputs into parts of {}, not a multiple of its quantization group size {}",
                        inputs / n,
                        q.group_size
                    )));
                }
            }
            for part in ["weight", "scales", "biases"] {
                let name = format!("{prefix}.{part}");
                if w.contains(&name) {
                    w.shard(&name, if rows { 0 } else { 1 }, n, tp.rank)?;
                }
            }
            let bias = format!("{prefix}.bias");
            if w.contains(&bias) {
                if rows {
                    w.shard(&bias, 0, n, tp.rank)?;
                } else if tp.rank != 0 {
                    w.remove(&bias);
                }
            }
        }
    }
    Ok(Dims { n_heads: d.n_heads / n, n_kv_heads: d.n_kv_heads / n, ffn: d.ffn / n, ..d.clone() })
}

impl CausalLm for Model {
    fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        Model::forward_hidden(self, tokens, cache)
    }

    fn head(&self, hidden: &Array) -> Result<Array> {
        Model::head(self, hidden)
    }

    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        Model::forward_hidden_batch(self, tokens, cache)
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
