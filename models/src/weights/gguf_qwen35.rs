//! Qwen3.5/3.6 GGUF files (llama.cpp's `qwen35` and `qwen35moe`) back to what `qwen3_5.rs`
//! loads: mlx-community's layout under HF names.
//!
//! llama.cpp's converter (`conversion/qwen.py`: `Qwen3NextModel`, `_LinearAttentionVReorderBase`)
//! writes a Gated DeltaNet layer differently from the checkpoint, and each change is undone
//! here:
//! - `A_log` is stored as `ssm_a = -exp(A_log)`; `dt_bias` as `ssm_dt.bias`;
//! - the conv1d kernel is squeezed to `[C, K]` (MLX's is `[C, K, 1]`);
//! - the norms that scale by `1 + w` are stored with the 1 added (as MLX's sanitized layout
//!   holds them; the DeltaNet's own gated norm is stored as is);
//! - where a layer has fewer key heads than value heads, the value heads are reordered from
//!   grouped by key head (`[k0 v0..v(r-1), k1 v0.., ..]`) to tiled (`[v0 of every k, v1 of
//!   every k, ..]`) in every tensor that has them: the V rows of `in_proj_qkv` and of the conv
//!   kernel, `in_proj_z`, `in_proj_a`/`in_proj_b`, `A_log`, `dt_bias` and the columns of
//!   `out_proj`;
//! - multi-token-prediction layers (`nextn_predict_layers` past the last block) are dropped.
//!
//! The reorder is a permutation of whole rows (or of whole head-sized column blocks), so it
//! applies to MLX-quantized triples too: weights, scales and biases alike.

use crate::{Error, Result};
use mlx::Array;
use serde_json::{json, Value};
use std::collections::HashMap;

/// GGUF block tensor names of `qwen35`/`qwen35moe` to HF module names (without `.weight`;
/// the experts' are `gguf.rs`'s `MOE_LAYER_MAP`).
pub const LAYER_MAP: &[(&str, &str)] = &[
    ("attn_qkv", "linear_attn.in_proj_qkv"),
    ("attn_gate", "linear_attn.in_proj_z"),
    ("ssm_alpha", "linear_attn.in_proj_a"),
    ("ssm_beta", "linear_attn.in_proj_b"),
    ("ssm_conv1d", "linear_attn.conv1d"),
    ("ssm_a", "linear_attn.A_log"),
    ("ssm_dt", "linear_attn.dt_proj"),
    ("ssm_norm", "linear_attn.norm"),
    ("ssm_out", "linear_attn.out_proj"),
    ("post_attention_norm", "post_attention_layernorm"),
];

/// What the layers' shapes are, from the file's metadata.
pub struct Shape {
    pub layers: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
}

/// The `config.json` of a `qwen35`/`qwen35moe` file: `base` (the fields every architecture
/// has) with the DeltaNet, attention and expert fields from `num(key)` (the metadata value of
/// `{arch}.key`).
pub fn config(
    moe: bool,
    mut base: Value,
    num: &dyn Fn(&str) -> Result<Option<f64>>,
    err: &dyn Fn(String) -> Error,
) -> Result<(Value, Shape)> {
    let need = |k: &str| num(k)?.map(|v| v as usize).ok_or_else(|| err(format!("missing metadata key {k:?}")));
    let (k_heads, v_heads) = (need("ssm.group_count")?, need("ssm.time_step_rank")?);
    let k_dim = need("ssm.state_size")?;
    let v_dim = need("ssm.inner_size")? / v_heads.max(1);
    if k_heads == 0 || v_heads % k_heads != 0 {
        return Err(err(format!("{v_heads} value heads do not group over {k_heads} key heads")));
    }
    let head_dim = base["head_dim"].as_u64().unwrap_or(0) as f64;
    let rotary = num("rope.dimension_count")?.unwrap_or(head_dim / 4.0);
    let layers =
        base["num_hidden_layers"].as_u64().unwrap_or(0) as usize - num("nextn_predict_layers")?.unwrap_or(0.0) as usize;
    let o = base.as_object_mut().expect("a config object");
    o.insert("model_type".into(), json!(if moe { "qwen3_5_moe" } else { "qwen3_5" }));
    o.insert("num_hidden_layers".into(), json!(layers));
    o.insert("linear_num_key_heads".into(), json!(k_heads));
    o.insert("linear_num_value_heads".into(), json!(v_heads));
    o.insert("linear_key_head_dim".into(), json!(k_dim));
    o.insert("linear_value_head_dim".into(), json!(v_dim));
    o.insert("linear_conv_kernel_dim".into(), json!(need("ssm.conv_kernel")?));
    o.insert("full_attention_interval".into(), json!(num("full_attention_interval")?.unwrap_or(4.0) as usize));
    o.insert("attn_output_gate".into(), json!(true));
    let theta = o.get("rope_theta").cloned().unwrap_or(json!(10_000_000.0));
    let partial = if head_dim > 0.0 { rotary / head_dim } else { 0.25 };
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}),
    );
    if moe {
        o.insert("num_experts".into(), json!(need("expert_count")?));
        o.insert("num_experts_per_tok".into(), json!(need("expert_used_count")?));
        o.insert("moe_intermediate_size".into(), json!(need("expert_feed_forward_length")?));
        let shared = num("expert_shared_feed_forward_length")?.map(|v| v as usize).unwrap_or(0);
        o.insert("shared_expert_intermediate_size".into(), json!(shared));
        o.insert("norm_topk_prob".into(), json!(true));
    }
    Ok((base, Shape { layers, k_heads, v_heads, k_dim }))
}

/// Reorders the value heads along `axis` of `a` back from tiled (`[r][k]` blocks) to grouped
/// by key head (`[k][r]`): the inverse of the converter's `_reorder_v_heads`. Each of the
/// `k * r` blocks along the axis is one head's (of whatever width the array has there).
fn grouped(a: &Array, axis: usize, k: usize, r: usize) -> Result<Array> {
    if r == 1 {
        return Ok(a.clone());
    }
    let shape: Vec<i32> = a.shape().iter().map(|&d| d as i32).collect();
    let len = shape[axis];
    if len % (k * r) as i32 != 0 {
        return Err(Error::Invalid(format!("a dimension of {len} does not split into {} value heads", k * r)));
    }
    let mut split = shape[..axis].to_vec();
    split.extend([r as i32, k as i32, len / (k * r) as i32]);
    split.extend(&shape[axis + 1..]);
    let mut perm: Vec<i32> = (0..split.len() as i32).collect();
    perm.swap(axis, axis + 1);
    Ok(a.reshape(&split)?.transpose(&perm)?.reshape(&shape)?)
}

/// Undoes the converter's changes in `tensors` (HF names, as the GGUF's were mapped).
pub fn restore(tensors: &mut HashMap<String, Array>, s: &Shape) -> Result<()> {
    // Multi-token prediction blocks past the model's layers.
    let extra = |n: &str| {
        n.strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<usize>().ok())
            .is_some_and(|l| l >= s.layers)
    };
    tensors.retain(|n, _| !extra(n));
    let (k, r) = (s.k_heads, s.v_heads / s.k_heads);
    let qk_rows = (2 * s.k_heads * s.k_dim) as i32;
    let names: Vec<String> = tensors.keys().cloned().collect();
    for name in names {
        let Some(module) = name.split_once(".linear_attn.").map(|(_, m)| m.to_string()) else {
            continue;
        };
        let a = tensors.remove(&name).expect("listed");
        let prefix = &name[..name.len() - module.len()];
        let (new_name, a) = match module.as_str() {
            // Rows: q and k as they are, the value heads (width v_dim) regrouped.
            "in_proj_qkv.weight" | "in_proj_qkv.scales" | "in_proj_qkv.biases" => {
                let rows = a.dim(0) as i32;
                let v = grouped(&a.slice_axis(0, qk_rows, rows)?, 0, k, r)?;
                (name.clone(), mlx::ops::concatenate(&[&a.slice_axis(0, 0, qk_rows)?, &v], 0)?)
            }
            "in_proj_z.weight" | "in_proj_z.scales" | "in_proj_z.biases" | "in_proj_a.weight" | "in_proj_a.scales"
            | "in_proj_a.biases" | "in_proj_b.weight" | "in_proj_b.scales" | "in_proj_b.biases" => {
                (name.clone(), grouped(&a, 0, k, r)?)
            }
            // Columns: one block per value head.
            "out_proj.weight" | "out_proj.scales" | "out_proj.biases" => (name.clone(), grouped(&a, 1, k, r)?),
            "conv1d.weight" => {
                let (c, kernel) = (a.dim(0) as i32, a.dim(-1) as i32);
                let a = a.reshape(&[c, kernel])?;
                let v = grouped(&a.slice_axis(0, qk_rows, c)?, 0, k, r)?;
                let a = mlx::ops::concatenate(&[&a.slice_axis(0, 0, qk_rows)?, &v], 0)?;
                (name.clone(), a.reshape(&[c, kernel, 1])?)
            }
            "A_log" => {
                // ssm_a = -exp(A_log)
                let a = grouped(&a.reshape(&[-1])?, 0, k, r)?;
                (name.clone(), a.negative()?.log()?)
            }
            "dt_proj.bias" => (format!("{prefix}dt_bias"), grouped(&a.reshape(&[-1])?, 0, k, r)?),
            _ => (name.clone(), a),
        };
        tensors.insert(new_name, a);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::arange;

    /// A multi-token-prediction block past the last layer is dropped.
    #[test]
    fn the_mtp_block_is_dropped() {
        let s = Shape { layers: 1, k_heads: 1, v_heads: 1, k_dim: 4 };
        let mut t = HashMap::new();
        t.insert("model.layers.0.mlp.gate.weight".to_string(), arange(&[2, 3]));
        t.insert("model.layers.1.nextn.eh_proj.weight".to_string(), arange(&[2, 2]));
        restore(&mut t, &s).unwrap();
        assert_eq!(t.keys().collect::<Vec<_>>(), vec!["model.layers.0.mlp.gate.weight"]);
    }

    /// `grouped` undoes llama.cpp's `_reorder_v_heads` (grouped → tiled) along rows and along
    /// column blocks of any width, so packed quantized columns regroup with their scales.
    #[test]
    fn grouped_inverts_the_converters_tiling_on_rows_and_column_blocks() {
        let (k, r) = (2, 3);
        // Tiled rows of 6 heads of width 2: head order v0k0 v0k1 v1k0 ... (r outer, k inner).
        let tiled: Vec<f32> = (0..r).flat_map(|v| (0..k).flat_map(move |g| [(g * r + v) as f32; 2])).collect();
        let a = Array::from_f32(&tiled, &[12, 1]).unwrap();
        let back = grouped(&a, 0, k as usize, r as usize).unwrap().to_vec_f32().unwrap();
        let want: Vec<f32> = (0..k * r).flat_map(|h| [h as f32; 2]).collect();
        assert_eq!(back, want);
        let cols = grouped(&a.reshape(&[1, 12]).unwrap(), 1, k as usize, r as usize).unwrap();
        assert_eq!(cols.to_vec_f32().unwrap(), want);
        assert!(grouped(&arange(&[7, 1]), 0, 2, 3).is_err(), "7 rows do not split into 6 heads");
    }
}
