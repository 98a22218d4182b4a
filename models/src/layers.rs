//! Pieces shared by two or more architectures: linear layers (dense or MLX-quantized),
//! embeddings, RMSNorm and rotary embeddings. Each computes exactly what the matching
//! `mlx.nn` layer computes, op for op, so outputs match mlx-lm bit for bit.

use crate::weights::{Quantization, Weights};
use crate::{Error, Result};
use mlx::fast::{self, Mask};
use mlx::{ops, Array, Dtype};
use serde_json::Value;

/// A layer that maps hidden states to hidden states, as a part of a model that another
/// module's layer holds without naming its type (Qwen2-MoE's shared expert, a decoder MLP,
/// inside `moe::SparseMoe`).
pub(crate) trait Forward {
    fn forward(&self, x: &Array) -> Result<Array>;
}

/// `nn.Linear` or `nn.QuantizedLinear`.
pub enum Linear {
    Dense { weight: Array, bias: Option<Array> },
    Quantized { weight: Array, scales: Array, biases: Option<Array>, bias: Option<Array>, q: Quantization },
}

fn packed_cols(in_dim: usize, q: Quantization) -> usize {
    in_dim * q.bits as usize / 32
}

impl Linear {
    /// Loads `{prefix}.weight` (`[out_dim, in_dim]`) and, with `bias`, `{prefix}.bias`.
    pub fn load(w: &Weights, prefix: &str, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear> {
        let bias = if bias { Some(w.get_shaped(&format!("{prefix}.bias"), &[out_dim])?) } else { None };
        match w.quantization_of(prefix)? {
            None => Ok(Linear::Dense { weight: w.get_shaped(&format!("{prefix}.weight"), &[out_dim, in_dim])?, bias }),
            Some(q) => {
                let groups = in_dim / q.group_size as usize;
                Ok(Linear::Quantized {
                    weight: w.get_shaped(&format!("{prefix}.weight"), &[out_dim, packed_cols(in_dim, q)])?,
                    scales: w.get_shaped(&format!("{prefix}.scales"), &[out_dim, groups])?,
                    biases: group_biases(w, prefix, q, &[out_dim, groups])?,
                    bias,
                    q,
                })
            }
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Linear::Dense { weight, bias: None } => ops::matmul(x, &weight.transpose(&[1, 0])?)?,
            Linear::Dense { weight, bias: Some(b) } => ops::addmm(b, x, &weight.transpose(&[1, 0])?, 1.0, 1.0)?,
            Linear::Quantized { weight, scales, biases, bias, q } => {
                let y = ops::quantized_matmul(x, weight, scales, q.op(biases.as_ref()), true)?;
                match bias {
                    Some(b) => y.add(b)?,
                    None => y,
                }
            }
        })
    }
}

/// `nn.Embedding` or `nn.QuantizedEmbedding`; `as_linear` serves tied output heads.
pub enum Embedding {
    Dense { weight: Array },
    Quantized { weight: Array, scales: Array, biases: Option<Array>, q: Quantization },
}

/// `{prefix}.biases` (`shape`) of a quantized module, in the modes that have them.
pub(crate) fn group_biases(w: &Weights, prefix: &str, q: Quantization, shape: &[usize]) -> Result<Option<Array>> {
    match q.mode.has_biases() {
        true => Ok(Some(w.get_shaped(&format!("{prefix}.biases"), shape)?)),
        false => Ok(None),
    }
}

impl Embedding {
    pub fn load(w: &Weights, prefix: &str, vocab: usize, dim: usize) -> Result<Embedding> {
        match w.quantization_of(prefix)? {
            None => Ok(Embedding::Dense { weight: w.get_shaped(&format!("{prefix}.weight"), &[vocab, dim])? }),
            Some(q) => {
                let groups = dim / q.group_size as usize;
                Ok(Embedding::Quantized {
                    weight: w.get_shaped(&format!("{prefix}.weight"), &[vocab, packed_cols(dim, q)])?,
                    scales: w.get_shaped(&format!("{prefix}.scales"), &[vocab, groups])?,
                    biases: group_biases(w, prefix, q, &[vocab, groups])?,
                    q,
                })
            }
        }
    }

    /// The dtype `forward` gives: the weights', or a quantized table's scales' (bfloat16 for
    /// the microscaling modes, which have no biases).
    pub fn output_dtype(&self) -> Dtype {
        match self {
            Embedding::Dense { weight } => weight.dtype(),
            Embedding::Quantized { scales, biases, .. } => {
                if biases.is_some() {
                    scales.dtype()
                } else {
                    Dtype::Bfloat16
                }
            }
        }
    }

    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense { weight } => weight.take(ids, 0)?,
            Embedding::Quantized { weight, scales, biases, q } => {
                // As MLX's dequantize without a dtype (mlx-lm's QuantizedEmbedding): affine
                // rows come out in the scales' dtype, the microscaling modes' in bfloat16.
                let biases = biases.as_ref().map(|b| b.take(ids, 0)).transpose()?;
                let dtype = if biases.is_some() { scales.dtype() } else { Dtype::Bfloat16 };
                ops::dequantize(&weight.take(ids, 0)?, &scales.take(ids, 0)?, q.op(biases.as_ref()), dtype)?
            }
        })
    }

    /// `x @ weight.T`: the output head of tied-embedding models.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense { weight } => ops::matmul(x, &weight.transpose(&[1, 0])?)?,
            Embedding::Quantized { weight, scales, biases, q } => {
                ops::quantized_matmul(x, weight, scales, q.op(biases.as_ref()), true)?
            }
        })
    }
}

/// Causal queries of 2 to this many positions attend through [`attention_unfused`].
pub const SHORT_QUERY: usize = 32;

/// Whether a forward of `len` new positions attends through [`attention_unfused`], with a
/// [`causal_mask`] made once per forward: 2..=[`SHORT_QUERY`] positions (a speculative
/// verification, a short prompt or prompt tail), outside Metal. MLX's CUDA backend sends
/// those to cuDNN, which builds an execution plan for every new (query length, key length):
/// ~45 ms each on an H200, i.e. for nearly every verification of a live request, where a plain
/// step takes ~3 ms (bench/NOTES.md, session 6; one-token decoding has a plan that serves
/// every length, and long prompts amortize theirs). The unfused graph, what MLX's fallback
/// for the fused op builds (and the CPU runs for it), needs no plan. Metal serves short
/// queries with its vector kernel, so it keeps the fused op.
pub fn short_query(len: usize) -> bool {
    (2..=SHORT_QUERY).contains(&len) && !cfg!(target_os = "macos")
}

/// Whether arrays are computed on the CPU (read once).
fn on_cpu() -> bool {
    mlx::Device::default_device() == mlx::Device::Cpu
}

/// `[len, offset + len]` booleans: query i (at position offset + i) sees keys 0..=offset + i.
pub fn causal_mask(len: usize, offset: usize) -> Result<Array> {
    let (offset, len) = (offset as f64, len as f64);
    let rows = Array::arange(offset, offset + len, 1.0, Dtype::Int32)?.expand_dims(&[1])?;
    let cols = Array::arange(0.0, offset + len, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
    Ok(rows.greater_equal(&cols)?)
}

/// `fast::scaled_dot_product_attention` (with `sinks`, GPT-OSS's per-head sink logits, where
/// given), except that a boolean mask over a short query ([`short_query`]), which is always a
/// [`causal_mask`], runs the host's CUDA kernel for it where that applies
/// (`fast::short_causal_attention`, which has no sinks) and [`attention_unfused`] elsewhere.
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>, sinks: Option<&Array>) -> Result<Array> {
    match mask {
        Mask::Array(m) if short_query(q.dim(2)) && m.dtype() == Dtype::Bool => {
            let fused = if sinks.is_none() { fast::short_causal_attention(q, k, v, scale)? } else { None };
            match fused {
                Some(o) => Ok(o),
                None => attention_unfused(q, k, v, scale, Some(m), sinks),
            }
        }
        // One query a row on the CPU (decode steps): the same ops as MLX's fallback for the
        // fused op, whose softmax inside MLX would be MLX's scalar one; this one's is the
        // host's (the same bits, `ops::softmax` on the CPU).
        Mask::Array(m) if q.dim(2) == 1 && m.dtype() == Dtype::Bool && on_cpu() => {
            attention_unfused(q, k, v, scale, Some(m), sinks)
        }
        Mask::None if q.dim(2) == 1 && on_cpu() => attention_unfused(q, k, v, scale, None, sinks),
        mask => Ok(match sinks {
            Some(sinks) => fast::scaled_dot_product_attention_sinks(q, k, v, scale, mask, sinks)?,
            None => fast::scaled_dot_product_attention(q, k, v, scale, mask)?,
        }),
    }
}

/// Attention of `q` `[B, H, L, D]` over `k`, `v` `[B, KVH, S, D]` with a boolean `mask`
/// broadcastable to `[L, S]` (or none) (and `sinks`, `[H]`, as one more logit per head in the softmax),
/// op for op as MLX's fallback for the fused op computes it: on the CPU the result is the
/// fused op's, bit for bit (with [`causal_mask`], the causal one's).
pub fn attention_unfused(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Option<&Array>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (b, h, l, d) = (q.dim(0) as i32, q.dim(1) as i32, q.dim(2) as i32, q.dim(3) as i32);
    let kv_heads = k.dim(1) as i32;
    let dtype = q.dtype();
    let mut q = Array::scalar(scale, dtype)?.multiply(q)?;
    let repeats = h / kv_heads;
    let (k, v) = if repeats > 1 {
        q = q.reshape(&[b, kv_heads, repeats, l, d])?;
        (k.expand_dims(&[2])?, v.expand_dims(&[2])?)
    } else {
        (k.clone(), v.clone())
    };
    let last = k.ndim();
    let mut axes: Vec<i32> = (0..last as i32).collect();
    axes.swap(last - 1, last - 2);
    let scores = ops::matmul(&q, &k.transpose(&axes)?)?;
    let mut scores = match mask {
        None => scores,
        Some(mask) => {
            let lowest = Array::scalar(lowest_finite(dtype), dtype)?;
            // A per-row mask `[B, 1, L, S]` gains the repeats' axis, as MLX's fallback gives it.
            let grouped;
            let mask = if repeats > 1 && mask.ndim() >= 3 && mask.dim(-3) == 1 {
                grouped = mask.expand_dims(&[-3])?;
                &grouped
            } else {
                mask
            };
            ops::where_(mask, &scores, &lowest)?
        }
    };
    if let Some(sinks) = sinks {
        // A first column of each head's sink logit, dropped after the softmax.
        let mut shape: Vec<i32> = scores.shape().iter().map(|&n| n as i32).collect();
        let mut per_head = vec![1, h, 1, 1];
        if repeats > 1 {
            per_head = vec![1, kv_heads, repeats, 1, 1];
        }
        let column = sinks.astype(dtype)?.reshape(&per_head)?;
        *shape.last_mut().expect("scores have axes") = 1;
        scores = ops::concatenate(&[&column.broadcast_to(&shape)?, &scores], -1)?;
    }
    let mut scores = scores.softmax(&[-1], true)?;
    if sinks.is_some() {
        let last = scores.ndim() as i32 - 1;
        scores = scores.slice_axis(last, 1, scores.dim(-1) as i32)?;
    }
    let out = ops::matmul(&scores, &v)?;
    Ok(if repeats > 1 { out.reshape(&[b, h, l, d])? } else { out })
}

/// The most negative finite value of a float dtype (`mx.finfo(dtype).min`).
fn lowest_finite(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => f32::from_bits(0xff7f_0000),
        _ => f32::MIN,
    }
}

/// `nn.RMSNorm`.
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Array, eps: f64) -> RmsNorm {
        RmsNorm { weight, eps: eps as f32 }
    }
    pub fn load(w: &Weights, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: w.get_shaped(&format!("{prefix}.weight"), &[dim])?, eps: eps as f32 })
    }
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, &self.weight, self.eps)?)
    }
}

/// Rotary position embedding as mlx-lm's `initialize_rope` builds it.
pub enum Rope {
    /// `nn.RoPE` (also "linear" scaling, as `scale = 1 / factor`).
    Default { dims: i32, traditional: bool, base: f32, scale: f32 },
    /// `Llama3RoPE` and `YarnRoPE`: explicit per-pair frequencies; YaRN also scales the
    /// rotated dimensions of its input by `input_scale` (its `mscale`), 1 otherwise.
    Freqs { dims: i32, traditional: bool, freqs: Array, input_scale: f32 },
}

fn number(cfg: &Value, key: &str) -> Option<f64> {
    cfg.get(key).and_then(Value::as_f64)
}

impl Rope {
    /// From a config's `rope_theta` and `rope_scaling` (`null`, default, linear or llama3).
    pub fn new(dims: usize, base: f64, traditional: bool, scaling: Option<&Value>) -> Result<Rope> {
        let dims = dims as i32;
        let base32 = base as f32;
        let scaling = scaling.filter(|v| !v.is_null());
        let rope_type = scaling
            .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let factor = || {
            scaling
                .and_then(|s| number(s, "factor"))
                .ok_or_else(|| Error::Invalid(format!("rope_scaling of type {rope_type:?} needs a numeric `factor`")))
        };
        match rope_type {
            "default" => Ok(Rope::Default { dims, traditional, base: base32, scale: 1.0 }),
            "linear" => Ok(Rope::Default { dims, traditional, base: base32, scale: (1.0 / factor()?) as f32 }),
            "llama3" => {
                let s = scaling.expect("llama3 rope type comes from a scaling config");
                let freqs = llama3_freqs(
                    dims,
                    base32,
                    factor()? as f32,
                    number(s, "low_freq_factor").unwrap_or(1.0) as f32,
                    number(s, "high_freq_factor").unwrap_or(4.0) as f32,
                    number(s, "original_max_position_embeddings").unwrap_or(8192.0) as f32,
                )?;
                Ok(Rope::Freqs { dims, traditional, freqs, input_scale: 1.0 })
            }
            "yarn" => {
                let s = scaling.expect("yarn rope type comes from a scaling config");
                let (freqs, mscale) = yarn_freqs(
                    dims,
                    base,
                    factor()?,
                    number(s, "original_max_position_embeddings").unwrap_or(4096.0),
                    number(s, "beta_fast").unwrap_or(32.0),
                    number(s, "beta_slow").unwrap_or(1.0),
                    number(s, "mscale").unwrap_or(1.0),
                    number(s, "mscale_all_dim").unwrap_or(0.0),
                )?;
                Ok(Rope::Freqs { dims, traditional, freqs, input_scale: mscale as f32 })
            }
            other => Err(Error::Invalid(format!(
                "rope_scaling type {other:?} is not supported; supported: default, linear, llama3, yarn"
            ))),
        }
    }

    /// mlx-lm's `SuScaledRoPE` (Phi-3's "longrope"/"su" scaling): `long_factor` (a number or
    /// one per frequency) times the default frequencies, and the input scaled by
    /// `long_mscale`, else by sqrt(1 + ln(factor) / ln(original)) where the context grew
    /// (`factor` = max / original positions > 1), else 1.
    pub fn su_scaled(
        dims: usize,
        base: f64,
        max_positions: f64,
        original_positions: f64,
        long_factor: &Value,
        long_mscale: Option<f64>,
    ) -> Result<Rope> {
        let d = dims as f64;
        let freqs = Array::scalar(base as f32, Dtype::Float32)?
            .power(&Array::arange(0.0, d, 2.0, Dtype::Float32)?.divide(&Array::scalar(d as f32, Dtype::Float32)?)?)?;
        let factors: Vec<f32> = match long_factor {
            Value::Number(n) => vec![n.as_f64().unwrap_or(1.0) as f32],
            Value::Array(list) => list
                .iter()
                .map(|v| v.as_f64().map(|f| f as f32))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::Invalid("rope_scaling.long_factor must be numbers".into()))?,
            _ => return Err(Error::Invalid("rope_scaling.long_factor must be a number or a list of numbers".into())),
        };
        if factors.len() != 1 && factors.len() != dims / 2 {
            return Err(Error::Invalid(format!(
                "rope_scaling.long_factor has {} entries; the rotary dimensions need {} (or one)",
                factors.len(),
                dims / 2
            )));
        }
        let shape = [factors.len()];
        let freqs = Array::from_f32(&factors, &shape)?.multiply(&freqs)?;
        let factor = max_positions / original_positions;
        let scale = long_mscale.unwrap_or(if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / original_positions.ln()).sqrt()
        });
        Ok(Rope::Freqs { dims: dims as i32, traditional: false, freqs, input_scale: scale as f32 })
    }

    /// Rotates `x` (`[B, H, L, D]`) for the positions `at` says.
    pub fn forward_at(&self, x: &Array, at: &Positions<'_>) -> Result<Array> {
        match at {
            Positions::From(offset) => self.forward(x, *offset),
            Positions::Rows(offsets) | Positions::Ragged { offsets, .. } => Ok(match self {
                Rope::Default { dims, traditional, base, scale } => {
                    fast::rope_rows(x, *dims, *traditional, *base, *scale, offsets)?
                }
                Rope::Freqs { dims, traditional, freqs, input_scale } => fast::rope_rows_with_freqs(
                    &scaled_input(x, *dims, *input_scale)?,
                    *dims,
                    *traditional,
                    1.0,
                    offsets,
                    freqs,
                )?,
            }),
        }
    }

    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        let offset = offset as i32;
        Ok(match self {
            Rope::Default { dims, traditional, base, scale } => {
                fast::rope(x, *dims, *traditional, *base, *scale, offset)?
            }
            Rope::Freqs { dims, traditional, freqs, input_scale } => {
                fast::rope_with_freqs(&scaled_input(x, *dims, *input_scale)?, *dims, *traditional, 1.0, offset, freqs)?
            }
        })
    }
}

/// Where a forward's new positions start: one offset for every row, or each row's own
/// (int32 `[B]`, a batch of sequences of different lengths).
pub enum Positions<'a> {
    From(usize),
    Rows(&'a Array),
    /// As `Rows`, for a batch whose key columns are not each row's positions in one run (rows
    /// with holes, or several new positions per row) and a model with sliding layers:
    /// `distance` (int32 `[B, 1, L, keys]`) is each new query's position less each key
    /// column's, which a sliding layer masks by (`BatchKvCache::key_distance`).
    Ragged {
        offsets: &'a Array,
        distance: &'a Array,
    },
}

/// `x` with its first `dims` features multiplied by `scale` (YaRN's `x.at[..., :dims].multiply`).
fn scaled_input(x: &Array, dims: i32, scale: f32) -> Result<Array> {
    if scale == 1.0 {
        return Ok(x.clone());
    }
    let s = Array::scalar(scale, x.dtype())?;
    let last = x.ndim() as i32 - 1;
    let width = x.dim(-1) as i32;
    if dims >= width {
        return Ok(x.multiply(&s)?);
    }
    let head = x.slice_axis(last, 0, dims)?.multiply(&s)?;
    Ok(ops::concatenate(&[&head, &x.slice_axis(last, dims, width)?], last)?)
}

/// mlx-lm's `YarnRoPE.__init__`: the frequencies (same MLX ops, same order) and `mscale`.
#[allow(clippy::too_many_arguments)]
fn yarn_freqs(
    dims: i32,
    base: f64,
    factor: f64,
    original_ctx: f64,
    beta_fast: f64,
    beta_slow: f64,
    mscale: f64,
    mscale_all_dim: f64,
) -> Result<(Array, f64)> {
    let d = dims as f64;
    let correction_dim =
        |rotations: f64| d * (original_ctx / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    let low = correction_dim(beta_fast).floor().max(0.0);
    let high = correction_dim(beta_slow).ceil().min(d - 1.0);
    let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let input_scale = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim);
    let s = |v: f64| Array::scalar(v as f32, Dtype::Float32);
    let exponents = Array::arange(0.0, d, 2.0, Dtype::Float32)?.divide(&s(d)?)?;
    let freq_extra = s(base)?.power(&exponents)?;
    let freq_inter = s(factor)?.multiply(&freq_extra)?;
    let high = if low == high { high + 0.001 } else { high };
    let ramp = Array::arange(0.0, (dims / 2) as f64, 1.0, Dtype::Float32)?
        .subtract(&s(low)?)?
        .divide(&s(high - low)?)?
        .maximum(&s(0.0)?)?
        .minimum(&s(1.0)?)?;
    let one = s(1.0)?;
    let freq_mask = one.subtract(&ramp)?;
    let numerator = freq_inter.multiply(&freq_extra)?;
    let denominator = freq_inter.multiply(&freq_mask)?.add(&freq_extra.multiply(&one.subtract(&freq_mask)?)?)?;
    Ok((numerator.divide(&denominator)?, input_scale))
}

/// mlx-lm's `Llama3RoPE.__init__`, with the same MLX ops in the same order.
fn llama3_freqs(dims: i32, base: f32, factor: f32, low: f32, high: f32, old_ctx: f32) -> Result<Array> {
    let s = |v: f32| Array::scalar(v, Dtype::Float32);
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    let exponents = Array::arange(0.0, dims as f64, 2.0, Dtype::Int32)?.divide(&s(dims as f32)?)?;
    let freqs = s(base)?.power(&exponents)?;
    let wavelens = s(2.0 * std::f32::consts::PI)?.multiply(&freqs)?;
    let freqs = ops::where_(&wavelens.greater(&s(low_wavelen)?)?, &freqs.multiply(&s(factor)?)?, &freqs)?;
    let is_medium = wavelens.greater(&s(high_wavelen)?)?.logical_and(&wavelens.less(&s(low_wavelen)?)?)?;
    let smooth = s(old_ctx)?.divide(&wavelens)?.subtract(&s(low)?)?.divide(&s(high - low)?)?;
    let one = s(1.0)?;
    let denom = one.subtract(&smooth)?.divide(&s(factor)?)?.add(&smooth)?;
    let smooth_freqs = freqs.divide(&denom)?;
    Ok(ops::where_(&is_medium, &smooth_freqs, &freqs)?)
}
