//! Mixture-of-experts feed-forward layers, op for op as mlx-lm's: `SwitchGLU` over
//! `SwitchLinear` / `QuantizedSwitchLinear` (`switch_layers.py`: MLX's `gather_mm` /
//! `gather_qmm`, with the tokens sorted by expert from 64 (token, expert) pairs up) and the
//! softmax top-k router of its Qwen MoE blocks (`qwen3_moe.py`).

use crate::layers::Linear;
use crate::weights::{Quantization, Weights};
use crate::{Error, Result};
use mlx::{ops, Array, Device, Dtype};

/// `SwitchLinear` or `QuantizedSwitchLinear`: one `[out, in]` matrix per expert.
enum SwitchLinear {
    Dense { weight: Array },
    Quantized { weight: Array, scales: Array, biases: Array, q: Quantization },
}

impl SwitchLinear {
    fn load(w: &Weights, prefix: &str, experts: usize, in_dim: usize, out_dim: usize) -> Result<Self> {
        match w.quantization_of(prefix)? {
            None => {
                let mut weight = w.get_shaped(&format!("{prefix}.weight"), &[experts, out_dim, in_dim])?;
                // MLX's CPU gather_mm takes float32 only: there the experts are kept in float32.
                if Device::default_device() == Device::Cpu && weight.dtype() != Dtype::Float32 {
                    weight = weight.astype(Dtype::Float32)?;
                    weight.eval()?;
                }
                Ok(SwitchLinear::Dense { weight })
            }
            Some(q) => {
                let groups = in_dim / q.group_size as usize;
                let packed = in_dim * q.bits as usize / 32;
                Ok(SwitchLinear::Quantized {
                    weight: w.get_shaped(&format!("{prefix}.weight"), &[experts, out_dim, packed])?,
                    scales: w.get_shaped(&format!("{prefix}.scales"), &[experts, out_dim, groups])?,
                    biases: w.get_shaped(&format!("{prefix}.biases"), &[experts, out_dim, groups])?,
                    q,
                })
            }
        }
    }

    /// Each row of `x` times its expert's matrix (`indices`, broadcast against x's batch axes).
    fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            SwitchLinear::Dense { weight } if weight.dtype() != x.dtype() => {
                let y = ops::gather_mm(&x.astype(weight.dtype())?, &weight.transpose(&[0, 2, 1])?, indices, sorted)?;
                y.astype(x.dtype())?
            }
            SwitchLinear::Dense { weight } => ops::gather_mm(x, &weight.transpose(&[0, 2, 1])?, indices, sorted)?,
            SwitchLinear::Quantized { weight, scales, biases, q } => {
                ops::gather_qmm(x, weight, scales, biases, indices, true, q.group_size, q.bits, sorted)?
            }
        })
    }
}

/// `SwitchGLU`: each token through its top-k experts' SwiGLU MLPs.
struct SwitchGlu {
    gate_proj: SwitchLinear,
    up_proj: SwitchLinear,
    down_proj: SwitchLinear,
}

/// From this many (token, expert) pairs up, tokens are sorted by expert first (mlx-lm's
/// `do_sort`), so each expert's rows are contiguous.
const SORT_FROM: usize = 64;

impl SwitchGlu {
    /// `x` `[..., D]`, `indices` `[..., k]` → `[..., k, D]`.
    fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        let x = x.expand_dims(&[-2, -3])?;
        let k = indices.dim(-1) as i32;
        let sort = indices.size() >= SORT_FROM;
        let (x, idx, inverse) = if sort {
            // `_gather_sort`: the rows of x repeated per pair, in expert order.
            let flat = indices.reshape(&[-1])?;
            let order = flat.argsort(-1)?;
            let inverse = order.argsort(-1)?;
            let rows = x.reshape(&[-1, 1, x.dim(-1) as i32])?;
            let tokens = order.floor_divide(&Array::scalar(k as f32, order.dtype())?)?;
            (rows.take(&tokens, 0)?, flat.take(&order, 0)?, Some(inverse))
        } else {
            (x, indices.clone(), None)
        };
        let up = self.up_proj.forward(&x, &idx, sort)?;
        let gate = self.gate_proj.forward(&x, &idx, sort)?;
        let y = self.down_proj.forward(&ops::swiglu(&gate, &up)?, &idx, sort)?;
        let y = match inverse {
            Some(inverse) => {
                // `_scatter_unsort`: back to token order, then to `[..., k, 1, D]`.
                let mut shape: Vec<i32> = indices.shape().iter().map(|&d| d as i32).collect();
                shape.extend([1, y.dim(-1) as i32]);
                y.take(&inverse, 0)?.reshape(&shape)?
            }
            None => y,
        };
        let last = y.ndim() as i32 - 2;
        Ok(y.squeeze(&[last])?)
    }
}

/// The shapes of a sparse MoE layer.
#[derive(Debug, Clone)]
pub(crate) struct MoeDims {
    pub experts: usize,
    pub top_k: usize,
    /// Each expert's MLP width.
    pub ffn: usize,
    /// Renormalize the top-k routing weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Whether each layer is sparse (the others have a dense MLP).
    pub sparse: Vec<bool>,
}

/// A Qwen MoE block: a softmax router over `experts`, each token through its `top_k`
/// experts, their outputs summed with the (optionally renormalized) routing weights.
pub(crate) struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    /// The block under `p` (`{p}.gate`, `{p}.switch_mlp.{gate,up,down}_proj`).
    pub(crate) fn load(w: &Weights, p: &str, hidden: usize, m: &MoeDims) -> Result<Self> {
        if m.top_k == 0 || m.top_k > m.experts {
            return Err(Error::Invalid(format!(
                "num_experts_per_tok is {}; it must be between 1 and num_experts ({})",
                m.top_k, m.experts
            )));
        }
        let s = format!("{p}.switch_mlp");
        Ok(SparseMoe {
            gate: Linear::load(w, &format!("{p}.gate"), hidden, m.experts, false)?,
            switch_mlp: SwitchGlu {
                gate_proj: SwitchLinear::load(w, &format!("{s}.gate_proj"), m.experts, hidden, m.ffn)?,
                up_proj: SwitchLinear::load(w, &format!("{s}.up_proj"), m.experts, hidden, m.ffn)?,
                down_proj: SwitchLinear::load(w, &format!("{s}.down_proj"), m.experts, m.ffn, hidden)?,
            },
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
        })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let gates = self.gate.forward(x)?.softmax(&[-1], true)?;
        let last = gates.ndim() as i32 - 1;
        let experts = gates.dim(-1) as i32;
        let k = self.top_k as i32;
        let inds = gates.argpartition(-k, -1)?.slice_axis(last, experts - k, experts)?;
        let mut scores = gates.take_along_axis(&inds, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(&scores.sum(&[-1], true)?)?;
        }
        let y = self.switch_mlp.forward(x, &inds)?;
        let dtype = y.dtype();
        Ok(y.multiply(&scores.expand_dims(&[-1])?)?.sum(&[-2], false)?.astype(dtype)?)
    }
}

/// mlx-lm's `sanitize` of Qwen MoE checkpoints: per-expert modules
/// `{p}.experts.{e}.{gate,up,down}_proj` (Hugging Face's layout) stacked into
/// `{p}.switch_mlp.{..}` (`[experts, out, in]`, mlx-community's layout), their quantization
/// scales and biases too where they have them. A layer already stacked is left alone.
pub(crate) fn stack_experts(w: &mut Weights, p: &str, experts: usize) -> Result<()> {
    if !w.contains(&format!("{p}.experts.0.up_proj.weight")) {
        return Ok(());
    }
    for n in ["up_proj", "down_proj", "gate_proj"] {
        let q = w.quantization_of(&format!("{p}.experts.0.{n}"))?;
        for part in ["weight", "scales", "biases"] {
            if part != "weight" && !w.contains(&format!("{p}.experts.0.{n}.{part}")) {
                continue;
            }
            let parts = (0..experts)
                .map(|e| {
                    let name = format!("{p}.experts.{e}.{n}.{part}");
                    let a = w.remove(&name).ok_or_else(|| {
                        Error::Invalid(format!("{name} is missing: a MoE layer needs all {experts} experts"))
                    })?;
                    Ok(a.expand_dims(&[0])?)
                })
                .collect::<Result<Vec<Array>>>()?;
            let refs: Vec<&Array> = parts.iter().collect();
            let stacked = ops::concatenate(&refs, 0)?;
            stacked.eval()?;
            w.insert(format!("{p}.switch_mlp.{n}.{part}"), stacked);
        }
        if q.is_some() {
            w.set_quantization(&format!("{p}.switch_mlp.{n}"), q);
        }
    }
    Ok(())
}
