//! Operations over several arrays: linear algebra, quantization, the `fast` kernels,
//! selection and concatenation.

use crate::array::wrap;
use crate::ffi::ffi;
use crate::{Array, Dtype, Result};

pub(crate) fn list(arrays: &[&Array]) -> cxx::UniquePtr<ffi::ArrayList> {
    let mut list = ffi::list_new();
    for a in arrays {
        ffi::list_push(list.pin_mut(), &a.0);
    }
    list
}

pub fn matmul(a: &Array, b: &Array) -> Result<Array> {
    wrap(ffi::matmul(&a.0, &b.0))
}

/// `beta * c + alpha * (a @ b)`, as MLX's `addmm` (what `nn.Linear` uses with a bias).
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    wrap(ffi::addmm(&c.0, &a.0, &b.0, alpha, beta))
}

/// How a matrix is quantized: MLX's mode ("affine", "mxfp4", "mxfp8", "nvfp4"), group size
/// and bits, and the per-group biases that affine mode has (the others have none).
#[derive(Clone, Copy)]
pub struct Quant<'a> {
    pub mode: &'a str,
    pub group_size: i32,
    pub bits: i32,
    pub biases: Option<&'a Array>,
}

impl Quant<'_> {
    /// The biases argument: affine mode's, else `scales` (read by nothing).
    fn biases<'b>(&'b self, scales: &'b Array) -> &'b Array {
        self.biases.unwrap_or(scales)
    }
}

/// `x @ dequantize(w).T` (with `transpose`) for MLX-quantized `w`. On a CUDA GPU, one row of
/// bf16/f16 activations times 4-bit affine weights (decoding) runs the host's own
/// matrix-vector kernel (`shim.cc`, qmv4: 1.6-2.2x MLX's on an H200's large shapes,
/// bench/RESULTS.md); everything else, and every shape with `HOST_QGEMV=0`, runs MLX's.
pub fn quantized_matmul(x: &Array, w: &Array, scales: &Array, q: Quant<'_>, transpose: bool) -> Result<Array> {
    let biases = q.biases(scales);
    wrap(ffi::quantized_matmul(&x.0, &w.0, &scales.0, &biases.0, transpose, q.group_size, q.bits, q.mode, true))
}

pub fn dequantize(w: &Array, scales: &Array, q: Quant<'_>, dtype: Dtype) -> Result<Array> {
    wrap(ffi::dequantize(&w.0, &scales.0, &q.biases(scales).0, q.group_size, q.bits, q.mode, dtype as u8))
}

/// Affine quantization: returns `(w, scales, biases)`.
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<(Array, Array, Array)> {
    let (w, scales, biases) = quantize_mode(w, group_size, bits, "affine")?;
    Ok((w, scales, biases.expect("affine quantization has biases")))
}

/// Quantization in MLX's `mode`: `(w, scales, biases)`, biases only in affine mode.
pub fn quantize_mode(w: &Array, group_size: i32, bits: i32, mode: &str) -> Result<(Array, Array, Option<Array>)> {
    let out = ffi::quantize(&w.0, group_size, bits, mode)?;
    let get = |i| wrap(ffi::list_get(&out, i));
    let biases = if ffi::list_len(&out) > 2 { Some(get(2)?) } else { None };
    Ok((get(0)?, get(1)?, biases))
}

pub fn where_(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    wrap(ffi::where_(&cond.0, &a.0, &b.0))
}

pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap(ffi::concatenate(&list(arrays), axis))
}

/// `logits` (`[B, V]`) with row `i`'s tokens where `refused[i]` (`[1, V]` bool) is true set to
/// `neg_inf` (a `-inf` scalar of the logits' dtype): `where(concatenate(refused), neg_inf,
/// logits)`, in one kernel on a CUDA GPU (the host's, `shim.cc` `masked_rows`;
/// `HOST_MASK_KERNEL=0` keeps MLX's ops).
pub fn masked_rows(logits: &Array, refused: &[&Array], neg_inf: &Array) -> Result<Array> {
    wrap(ffi::masked_rows(&logits.0, &list(refused), &neg_inf.0))
}

/// `a @ b[rhs_indices]` batched (`mx.gather_mm` with only right-hand indices): the expert
/// products of a mixture-of-experts layer. `sorted_indices` promises the indices are sorted.
pub fn gather_mm(a: &Array, b: &Array, rhs_indices: &Array, sorted_indices: bool) -> Result<Array> {
    wrap(ffi::gather_mm(&a.0, &b.0, &rhs_indices.0, sorted_indices))
}

/// `gather_mm` over MLX-quantized expert matrices (`mx.gather_qmm`, `transpose` as in
/// `quantized_matmul`).
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    q: Quant<'_>,
    rhs_indices: &Array,
    transpose: bool,
    sorted_indices: bool,
) -> Result<Array> {
    let biases = q.biases(scales);
    wrap(ffi::gather_qmm(
        &x.0,
        &w.0,
        &scales.0,
        &biases.0,
        &rhs_indices.0,
        transpose,
        q.group_size,
        q.bits,
        q.mode,
        sorted_indices,
    ))
}

/// `silu(gate) * x`, compiled as mlx-lm compiles it (same fused kernel, same rounding).
pub fn swiglu(gate: &Array, x: &Array) -> Result<Array> {
    wrap(ffi::swiglu(&gate.0, &x.0))
}

/// `nn.silu`, compiled as mlx.nn compiles it.
pub fn silu(x: &Array) -> Result<Array> {
    wrap(ffi::silu(&x.0))
}

/// mlx-lm's `logit_softcap(cap, x)` (Gemma's final logits): `tanh(x / cap) * cap`, compiled
/// as mlx-lm compiles it.
pub fn softcap(x: &Array, cap: f32) -> Result<Array> {
    wrap(ffi::softcap(&x.0, cap))
}

/// mlx-lm's `precise_swiglu(h, gate, x)`: `silu(gate) * x` in float32, in `h`'s dtype.
pub fn precise_swiglu(h: &Array, gate: &Array, x: &Array) -> Result<Array> {
    wrap(ffi::precise_swiglu(&h.0, &gate.0, &x.0))
}

/// The Gated DeltaNet's decay, mlx-lm's `compute_g`: `exp(-exp(a_log) * softplus(a + dt_bias))`.
pub fn gated_delta_g(a_log: &Array, a: &Array, dt_bias: &Array) -> Result<Array> {
    wrap(ffi::gated_delta_g(&a_log.0, &a.0, &dt_bias.0))
}

/// One step of the gated delta rule, compiled as mlx-lm's `_gated_delta_step_ops`: q, k
/// `[B, H, Dk]`, v `[B, H, Dv]`, g and beta `[B, H]`, state `[B, H, Dv, Dk]`; returns the
/// output `[B, H, Dv]` (in q's dtype) and the new state.
pub fn gated_delta_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let out = ffi::gated_delta_step(&q.0, &k.0, &v.0, &g.0, &beta.0, &state.0)?;
    Ok((wrap(ffi::list_get(&out, 0))?, wrap(ffi::list_get(&out, 1))?))
}

/// The decay of [`gated_delta_g`] in log space: `-exp(a_log) * softplus(a + dt_bias)`.
pub fn gated_delta_log_g(a_log: &Array, a: &Array, dt_bias: &Array) -> Result<Array> {
    wrap(ffi::gated_delta_log_g(&a_log.0, &a.0, &dt_bias.0))
}

/// The gated delta rule over a whole sequence, `chunk` positions (a power of two) solved
/// together at a time: the recurrence of [`gated_delta_step`] run over every position, with
/// `T / chunk` sequential steps instead of `T`. q, k `[B, T, H, Dk]`, v `[B, T, H, Dv]`, log_g
/// (from [`gated_delta_log_g`]) and beta `[B, T, H]`, state `[B, H, Dv, Dk]`; returns the
/// output `[B, T, H, Dv]` (in q's dtype) and the state after the last position.
pub fn gated_delta_chunked(
    q: &Array,
    k: &Array,
    v: &Array,
    log_g: &Array,
    beta: &Array,
    state: &Array,
    chunk: i32,
) -> Result<(Array, Array)> {
    let out = ffi::gated_delta_chunked(&q.0, &k.0, &v.0, &log_g.0, &beta.0, &state.0, chunk)?;
    Ok((wrap(ffi::list_get(&out, 0))?, wrap(ffi::list_get(&out, 1))?))
}

/// A 1D convolution with stride 1 and no padding: `x` `[B, L, C_in]`, `w` `[C_out, K, C_in /
/// groups]`.
pub fn conv1d(x: &Array, w: &Array, groups: i32) -> Result<Array> {
    wrap(ffi::conv1d(&x.0, &w.0, groups))
}

/// Each element repeated `repeats` times along `axis` (`mx.repeat`).
pub fn repeat(a: &Array, repeats: i32, axis: i32) -> Result<Array> {
    wrap(ffi::repeat_axis(&a.0, repeats, axis))
}

/// GPT-OSS's expert activation, compiled as mlx-lm compiles its `swiglu_oai`: `gate` clipped
/// above at 7, `x` to +-7, then `(x + 1) * gate * sigmoid(1.702 gate)`.
pub fn swiglu_oai(gate: &Array, x: &Array) -> Result<Array> {
    wrap(ffi::swiglu_oai(&gate.0, &x.0))
}

/// `nn.gelu_approx` (GELU with the tanh approximation), compiled as mlx.nn compiles it.
pub fn gelu_approx(x: &Array) -> Result<Array> {
    wrap(ffi::gelu_approx(&x.0))
}

/// MLX's fused kernels.
pub mod fast {
    use super::*;

    /// `mx.fast.rms_norm(x, None, eps)`.
    pub fn rms_norm_plain(x: &Array, eps: f32) -> Result<Array> {
        wrap(ffi::rms_norm_plain(&x.0, eps))
    }

    pub fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<Array> {
        wrap(ffi::rms_norm(&x.0, &weight.0, eps))
    }

    /// Rotary embedding with frequencies `base^(-2i/dims)`, positions from `offset`.
    pub fn rope(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offset: i32) -> Result<Array> {
        wrap(ffi::rope(&x.0, dims, traditional, base, scale, offset))
    }

    /// As [`rope`], each batch row of `x` (`[B, H, L, D]`) from its own position: `offsets` is
    /// int32 `[B]` (a batch whose rows hold sequences of different lengths).
    pub fn rope_rows(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offsets: &Array) -> Result<Array> {
        wrap(ffi::rope_rows(&x.0, dims, traditional, base, scale, &offsets.0))
    }

    /// As [`rope_with_freqs`], each batch row from its own position (`offsets`, int32 `[B]`).
    pub fn rope_rows_with_freqs(
        x: &Array,
        dims: i32,
        traditional: bool,
        scale: f32,
        offsets: &Array,
        freqs: &Array,
    ) -> Result<Array> {
        wrap(ffi::rope_rows_freqs(&x.0, dims, traditional, scale, &offsets.0, &freqs.0))
    }

    /// Rotary embedding with explicit per-pair frequencies (Llama 3 scaling).
    pub fn rope_with_freqs(
        x: &Array,
        dims: i32,
        traditional: bool,
        scale: f32,
        offset: i32,
        freqs: &Array,
    ) -> Result<Array> {
        wrap(ffi::rope_freqs(&x.0, dims, traditional, scale, offset, &freqs.0))
    }

    /// How attention is masked.
    pub enum Mask<'a> {
        None,
        Causal,
        Array(&'a Array),
    }

    /// Causal attention of a short query block that ends the sequence (`q` `[1, H, L, D]`,
    /// L in 2..=32, over `k`, `v` `[1, KVH, S, D]`: query i sees keys 0..=S - L + i) through
    /// the host's own CUDA kernel (`shim.cc`, `sq_attention`; `HOST_SQ_KERNEL=1`), or `None`
    /// where it does not apply (off, not CUDA, other shapes or dtypes, S above 4,096).
    pub fn short_causal_attention(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Option<Array>> {
        if !ffi::short_causal_attention_applies(&q.0, &k.0, &v.0) {
            return Ok(None);
        }
        wrap(ffi::short_causal_attention(&q.0, &k.0, &v.0, scale)).map(Some)
    }

    pub fn scaled_dot_product_attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>) -> Result<Array> {
        match mask {
            Mask::None => wrap(ffi::sdpa(&q.0, &k.0, &v.0, scale, "")),
            Mask::Causal => wrap(ffi::sdpa(&q.0, &k.0, &v.0, scale, "causal")),
            Mask::Array(m) => wrap(ffi::sdpa_masked(&q.0, &k.0, &v.0, scale, &m.0)),
        }
    }

    /// As `scaled_dot_product_attention`, with attention sinks: `sinks` (`[H]`) is one more
    /// logit per query head in every softmax, whose share of the weight goes to no value.
    pub fn scaled_dot_product_attention_sinks(
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        mask: Mask<'_>,
        sinks: &Array,
    ) -> Result<Array> {
        match mask {
            Mask::None => wrap(ffi::sdpa_sinks(&q.0, &k.0, &v.0, scale, "", &sinks.0)),
            Mask::Causal => wrap(ffi::sdpa_sinks(&q.0, &k.0, &v.0, scale, "causal", &sinks.0)),
            Mask::Array(m) => wrap(ffi::sdpa_masked_sinks(&q.0, &k.0, &v.0, scale, &m.0, &sinks.0)),
        }
    }
}

/// Random numbers from explicit keys; nothing here touches MLX's global random state.
pub mod random {
    use super::*;

    /// A PRNG key from a seed.
    pub fn key(seed: u64) -> Result<Array> {
        wrap(ffi::random_key(seed))
    }

    /// One sample per row of `logits` (unnormalized log-probabilities) along `axis`.
    pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
        wrap(ffi::random_categorical(&logits.0, axis, &key.0))
    }

    /// Uniform float32 samples in [0, 1).
    pub fn uniform(shape: &[i32], key: &Array) -> Result<Array> {
        wrap(ffi::random_uniform(shape, &key.0))
    }
}
