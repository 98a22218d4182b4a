//! Mixture-of-experts feed-forward layers, op for op as mlx-lm's: `SwitchGLU` over
//! `SwitchLinear` / `QuantizedSwitchLinear` (`switch_layers.py`: MLX's `gather_mm` /
//! `gather_qmm`, with the tokens sorted by expert from 64 (token, expert) pairs up) and the
//! softmax top-k router of its Qwen MoE blocks (`qwen3_moe.py`), with Qwen2-MoE's
//! sigmoid-gated shared expert (`qwen2_moe.py`).

use crate::layers::Forward;
use crate::layers::Linear;
use crate::weights::{Quantization, Weights};
use crate::{Error, Result};
use mlx::{ops, Array, Device, Dtype};

/// `SwitchLinear` or `QuantizedSwitchLinear`: one `[out, in]` matrix per expert, and one
/// `[out]` bias per expert where the model has them (GPT-OSS).
struct SwitchLinear {
    matrix: SwitchMatrix,
    bias: Option<Array>,
}

enum SwitchMatrix {
    Dense { weight: Array },
    Quantized { weight: Array, scales: Array, biases: Option<Array>, q: Quantization },
}

impl SwitchLinear {
    fn load(w: &Weights, prefix: &str, experts: usize, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let bias = if bias { Some(w.get_shaped(&format!("{prefix}.bias"), &[experts, out_dim])?) } else { None };
        Ok(SwitchLinear { matrix: SwitchMatrix::load(w, prefix, experts, in_dim, out_dim)?, bias })
    }

    /// Each row of `x` times its expert's matrix (`indices`, broadcast against x's batch
    /// axes), plus its expert's bias.
    fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        let y = self.matrix.forward(x, indices, sorted)?;
        match &self.bias {
            Some(b) => Ok(y.add(&b.take(indices, 0)?.expand_dims(&[-2])?)?),
            None => Ok(y),
        }
    }
}

impl SwitchMatrix {
    fn load(w: &Weights, prefix: &str, experts: usize, in_dim: usize, out_dim: usize) -> Result<Self> {
        match w.quantization_of(prefix)? {
            None => {
                let mut weight = w.get_shaped(&format!("{prefix}.weight"), &[experts, out_dim, in_dim])?;
                // MLX's CPU gather_mm takes float32 only: there the experts are kept in float32.
                if Device::default_device() == Device::Cpu && weight.dtype() != Dtype::Float32 {
                    weight = weight.astype(Dtype::Float32)?;
                    weight.eval()?;
                }
                Ok(SwitchMatrix::Dense { weight })
            }
            Some(q) => {
                let groups = in_dim / q.group_size as usize;
                let packed = in_dim * q.bits as usize / 32;
                Ok(SwitchMatrix::Quantized {
                    weight: w.get_shaped(&format!("{prefix}.weight"), &[experts, out_dim, packed])?,
                    scales: w.get_shaped(&format!("{prefix}.scales"), &[experts, out_dim, groups])?,
                    biases: crate::layers::group_biases(w, prefix, q, &[experts, out_dim, groups])?,
                    q,
                })
            }
        }
    }

    fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            SwitchMatrix::Dense { weight } if weight.dtype() != x.dtype() => {
                let y = ops::gather_mm(&x.astype(weight.dtype())?, &weight.transpose(&[0, 2, 1])?, indices, sorted)?;
                y.astype(x.dtype())?
            }
            SwitchMatrix::Dense { weight } => ops::gather_mm(x, &weight.transpose(&[0, 2, 1])?, indices, sorted)?,
            SwitchMatrix::Quantized { weight, scales, biases, q } => {
                ops::gather_qmm(x, weight, scales, q.op(biases.as_ref()), indices, true, sorted)?
            }
        })
    }
}

/// `SwitchGLU`: each token through its top-k experts' gated MLPs.
pub(crate) struct SwitchGlu {
    gate_proj: SwitchLinear,
    up_proj: SwitchLinear,
    down_proj: SwitchLinear,
    activation: ExpertActivation,
}

/// The experts' gate activation.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ExpertActivation {
    /// `silu(gate) * up` (Qwen).
    Swiglu,
    /// GPT-OSS's `swiglu_oai`: the gate clipped above at 7, the linear part to ±7, then
    /// `(up + 1) * gate * sigmoid(1.702 gate)`.
    SwigluOai,
    /// `gelu_approx(gate) * up` (Gemma 4).
    Geglu,
}

impl ExpertActivation {
    fn apply(self, gate: &Array, up: &Array) -> Result<Array> {
        match self {
            ExpertActivation::Swiglu => Ok(ops::swiglu(gate, up)?),
            ExpertActivation::SwigluOai => Ok(ops::swiglu_oai(gate, up)?),
            ExpertActivation::Geglu => Ok(ops::gelu_approx(gate)?.multiply(up)?),
        }
    }
}

/// From this many (token, expert) pairs up, tokens are sorted by expert first (mlx-lm's
/// `do_sort`), so each expert's rows are contiguous.
const SORT_FROM: usize = 64;

impl SwitchGlu {
    /// The experts under `s` (`{s}.{gate,up,down}_proj`), `experts` of width `ffn` over
    /// `hidden`, without biases.
    pub(crate) fn load(
        w: &Weights,
        s: &str,
        experts: usize,
        hidden: usize,
        ffn: usize,
        activation: ExpertActivation,
    ) -> Result<Self> {
        Ok(SwitchGlu {
            gate_proj: SwitchLinear::load(w, &format!("{s}.gate_proj"), experts, hidden, ffn, false)?,
            up_proj: SwitchLinear::load(w, &format!("{s}.up_proj"), experts, hidden, ffn, false)?,
            down_proj: SwitchLinear::load(w, &format!("{s}.down_proj"), experts, ffn, hidden, false)?,
            activation,
        })
    }

    /// `x` `[..., D]`, `indices` `[..., k]` → `[..., k, D]`.
    pub(crate) fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
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
        let y = self.down_proj.forward(&self.activation.apply(&gate, &up)?, &idx, sort)?;
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
    pub router: Router,
    pub activation: ExpertActivation,
    /// The router and the experts have biases (GPT-OSS).
    pub bias: bool,
    /// Module names under the MLP: the router's and the stacked experts'.
    pub names: (&'static str, &'static str),
    /// The width of a shared expert every token goes through, gated per token by
    /// `sigmoid(shared_expert_gate(x))` (Qwen2-MoE).
    pub shared: Option<usize>,
}

/// How the router's logits become each token's experts and their weights.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Router {
    /// Softmax over all experts, then the top k (renormalized with `norm_topk_prob`): Qwen.
    SoftmaxTopK,
    /// The top k logits, then a softmax over those k: GPT-OSS.
    TopKSoftmax,
}

impl MoeDims {
    /// Qwen MoE's: `gate` and `switch_mlp`, SwiGLU experts, no biases.
    pub(crate) fn qwen(experts: usize, top_k: usize, ffn: usize, norm_topk_prob: bool, sparse: Vec<bool>) -> Self {
        MoeDims {
            experts,
            top_k,
            ffn,
            norm_topk_prob,
            sparse,
            router: Router::SoftmaxTopK,
            activation: ExpertActivation::Swiglu,
            bias: false,
            names: ("gate", "switch_mlp"),
            shared: None,
        }
    }
}

/// A Qwen MoE block: a softmax router over `experts`, each token through its `top_k`
/// experts, their outputs summed with the (optionally renormalized) routing weights.
pub(crate) struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: usize,
    norm_topk_prob: bool,
    router: Router,
    shared: Option<SharedExpert>,
}

/// Qwen2-MoE's `shared_expert` (the decoder's dense SwiGLU MLP at its own width, as mlx-lm's
/// `MLP`) and its one-unit gate.
struct SharedExpert {
    mlp: Box<dyn Forward>,
    gate: Linear,
}

impl SharedExpert {
    fn forward(&self, x: &Array) -> Result<Array> {
        Ok(self.gate.forward(x)?.sigmoid()?.multiply(&self.mlp.forward(x)?)?)
    }
}

impl SparseMoe {
    /// The block under `p` (the router `{p}.gate`, the experts `{p}.switch_mlp.{gate,up,down}_proj`,
    /// or the names `m` gives), with `shared` (`{p}.shared_expert`, loaded by the decoder) gated
    /// by `{p}.shared_expert_gate`.
    pub(crate) fn load(
        w: &Weights,
        p: &str,
        hidden: usize,
        m: &MoeDims,
        shared: Option<Box<dyn Forward>>,
    ) -> Result<Self> {
        if m.top_k == 0 || m.top_k > m.experts {
            return Err(Error::Invalid(format!(
                "num_experts_per_tok is {}; it must be between 1 and num_experts ({})",
                m.top_k, m.experts
            )));
        }
        let (router, experts) = m.names;
        let s = format!("{p}.{experts}");
        let e = m.experts;
        Ok(SparseMoe {
            gate: Linear::load(w, &format!("{p}.{router}"), hidden, e, m.bias)?,
            switch_mlp: SwitchGlu {
                gate_proj: SwitchLinear::load(w, &format!("{s}.gate_proj"), e, hidden, m.ffn, m.bias)?,
                up_proj: SwitchLinear::load(w, &format!("{s}.up_proj"), e, hidden, m.ffn, m.bias)?,
                down_proj: SwitchLinear::load(w, &format!("{s}.down_proj"), e, m.ffn, hidden, m.bias)?,
                activation: m.activation,
            },
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
            router: m.router,
            shared: shared
                .map(|mlp| {
                    Ok::<_, Error>(SharedExpert {
                        mlp,
                        gate: Linear::load(w, &format!("{p}.shared_expert_gate"), hidden, 1, false)?,
                    })
                })
                .transpose()?,
        })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let logits = self.gate.forward(x)?;
        // mlx-lm's top k: the last k of an argpartition.
        let top_k = |a: &Array| -> Result<(Array, Array)> {
            let (last, n, k) = (a.ndim() as i32 - 1, a.dim(-1) as i32, self.top_k as i32);
            let inds = a.argpartition(-k, -1)?.slice_axis(last, n - k, n)?;
            Ok((a.take_along_axis(&inds, -1)?, inds))
        };
        let (scores, inds) = match self.router {
            Router::SoftmaxTopK => {
                let (mut scores, inds) = top_k(&logits.softmax(&[-1], true)?)?;
                if self.norm_topk_prob {
                    scores = scores.divide(&scores.sum(&[-1], true)?)?;
                }
                (scores, inds)
            }
            Router::TopKSoftmax => {
                let (values, inds) = top_k(&logits)?;
                (values.softmax(&[-1], true)?, inds)
            }
        };
        let y = self.switch_mlp.forward(x, &inds)?;
        let dtype = y.dtype();
        let y = y.multiply(&scores.expand_dims(&[-1])?)?.sum(&[-2], false)?.astype(dtype)?;
        match &self.shared {
            Some(shared) => Ok(y.add(&shared.forward(x)?)?),
            None => Ok(y),
        }
    }
}

impl Forward for SparseMoe {
    fn forward(&self, x: &Array) -> Result<Array> {
        SparseMoe::forward(self, x)
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
