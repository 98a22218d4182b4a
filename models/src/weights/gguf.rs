//! llama.cpp GGUF files, read by MLX's own reader. Produces what a Hugging Face folder would
//! hold: a `config.json` value, weights under HF names, and the tokenizer (built from the
//! GGUF's vocabulary, merges and chat template).
//!
//! MLX maps Q4_0/Q4_1/Q8_0 blocks to its affine format (group 32), and they stay so (on the
//! CPU with float32 scales and biases, for the shim's CPU product); F16/F32 stay as they are on
//! GPUs and become float32 on the CPU. A file with any other type (the K-quants of most hub
//! files, Q5_0, BF16, ...) is read by `gguf_reader.rs` instead and dequantized (to float32 on
//! the CPU, else bfloat16), except that on the CPU its Q4_0/Q4_1/Q8_0/Q4_K matrices are
//! repacked exactly into the same affine layout, and its Q5_0/Q5_1/Q5_K ones into its 8-bit
//! form (five-bit codes as eight-bit ones, the same values).
//! llama.cpp stores the Q and K projection rows of Llama models permuted for its rotary
//! layout; they are permuted back here so the usual (non-traditional) RoPE applies.

use super::gguf_gemma4;
use crate::tokenizer::Tokenizer;
use crate::weights::{Quantization, Weights};
use crate::{Error, Result};
use mlx::io::GgufValue;
use mlx::{ops, Array, Dtype};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// What a GGUF file amounts to.
pub struct Gguf {
    pub config: Value,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
}

const LAYER_MAP: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Gemma 3's names where they differ from the others': its four norms per block.
const GEMMA3_LAYER_MAP: &[(&str, &str)] = &[
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

/// The experts of Qwen's mixtures (qwen2moe, qwen3moe, qwen35moe): the router, the stacked
/// (or fused gate-and-up) experts, the shared expert and its gate.
const MOE_LAYER_MAP: &[(&str, &str)] = &[
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_exps", "mlp.switch_mlp.gate_proj"),
    ("ffn_up_exps", "mlp.switch_mlp.up_proj"),
    ("ffn_down_exps", "mlp.switch_mlp.down_proj"),
    ("ffn_gate_up_exps", "mlp.switch_mlp.gate_up_proj"),
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
];

/// GGUF architectures and the `model_type` they load as.
const ARCHS: &[(&str, &str)] = &[
    ("llama", "llama"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("qwen2moe", "qwen2_moe"),
    ("qwen3moe", "qwen3_moe"),
    ("gemma3", "gemma3_text"),
    ("gemma4", "gemma4_text"),
    ("minicpm", "minicpm"),
    ("qwen35", "qwen3_5"),
    ("qwen35moe", "qwen3_5_moe"),
];

/// Qwen3.5's hybrid architectures (`gguf_qwen35.rs`).
fn is_qwen35(arch: &str) -> bool {
    matches!(arch, "qwen35" | "qwen35moe")
}

/// GGUF tensor name (without `.weight`/`.bias`/`.scales`/`.biases`) to HF module name.
fn hf_name(arch: &str, gguf: &str) -> Option<String> {
    match gguf {
        "token_embd" => return Some("model.embed_tokens".into()),
        "output_norm" => return Some("model.norm".into()),
        "output" => return Some("lm_head".into()),
        _ => {}
    }
    if arch == "gemma4" {
        if let Some((_, hf)) = super::gguf_gemma4::TOP_MAP.iter().find(|(g, _)| *g == gguf) {
            return Some(hf.to_string());
        }
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, kind) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if is_qwen35(arch) && kind.starts_with("nextn.") {
        // A multi-token-prediction block's own tensors (dropped with the block).
        return Some(format!("model.layers.{layer}.{kind}"));
    }
    let special = match arch {
        "gemma3" => GEMMA3_LAYER_MAP,
        "gemma4" => super::gguf_gemma4::LAYER_MAP,
        a if is_qwen35(a) => super::gguf_qwen35::LAYER_MAP,
        _ => &[],
    };
    let hf = special.iter().chain(MOE_LAYER_MAP).chain(LAYER_MAP).find(|(g, _)| *g == kind)?.1;
    Some(format!("model.layers.{layer}.{hf}"))
}

struct Meta<'a> {
    map: &'a HashMap<String, GgufValue>,
    path: &'a Path,
}

impl Meta<'_> {
    fn err(&self, message: String) -> Error {
        Error::Gguf { path: self.path.to_path_buf(), message }
    }
    fn number(&self, key: &str) -> Result<Option<f64>> {
        match self.map.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(a)) => Ok(a.to_vec_f32()?.first().map(|&v| v as f64)),
            Some(_) => Err(self.err(format!("metadata {key:?} should be a number"))),
        }
    }
    fn required(&self, key: &str) -> Result<f64> {
        self.number(key)?.ok_or_else(|| self.err(format!("missing metadata key {key:?}")))
    }
    fn string(&self, key: &str) -> Option<&str> {
        match self.map.get(key) {
            Some(GgufValue::String(s)) => Some(s),
            _ => None,
        }
    }
    fn strings(&self, key: &str) -> Result<&[String]> {
        match self.map.get(key) {
            Some(GgufValue::Strings(s)) => Ok(s),
            _ => Err(self.err(format!("missing metadata key {key:?} (a list of strings)"))),
        }
    }
    fn ints(&self, key: &str) -> Result<Vec<i32>> {
        match self.map.get(key) {
            Some(GgufValue::Array(a)) => Ok(a.to_vec_i32()?),
            _ => Err(self.err(format!("missing metadata key {key:?} (a list of integers)"))),
        }
    }
}

/// Inverse of llama.cpp's `permute` of Q/K rows: `[n_head, hd/2, 2, ...] -> [n_head, 2, hd/2, ...]`.
fn unpermute(w: &Array, n_head: usize) -> Result<Array> {
    let shape: Vec<i32> = w.shape().iter().map(|&d| d as i32).collect();
    let rows = shape[0];
    let mut split = vec![n_head as i32, rows / n_head as i32 / 2, 2];
    split.extend_from_slice(&shape[1..]);
    let mut axes: Vec<i32> = (0..split.len() as i32).collect();
    axes.swap(1, 2);
    Ok(w.reshape(&split)?.transpose(&axes)?.reshape(&shape)?)
}

/// The file's tensors and metadata: MLX's reader where it reads every tensor type (it keeps
/// quantized blocks quantized), else ours: dequantized (to float32 for the CPU), except on
/// the CPU with `pack` the matrices whose blocks are affine per 32 values (Q4_0, Q4_1, Q8_0,
/// Q4_K, and as 8-bit codes Q5_0, Q5_1, Q5_K: most of a Q4_K_M or Q5_K_M file), repacked exactly into MLX's layout as MLX's reader names it
/// (`X.weight`, `X.scales`, `X.biases`).
fn read(path: &Path, header: &super::gguf_reader::Header, cpu: bool, pack: bool) -> Result<mlx::io::Tensors> {
    if header.mlx_reads_all() {
        return mlx::io::load_gguf(path).map_err(|e| Error::Gguf {
            path: path.to_path_buf(),
            message: format!("{e}; is this a complete GGUF file?"),
        });
    }
    let file = super::gguf_reader::GgufFile::read(path)?;
    let mut arrays = HashMap::new();
    for t in &file.header.tensors {
        let packed = if cpu && pack { t.name.strip_suffix(".weight").zip(file.affine(t)) } else { None };
        if let Some((stem, a)) = packed {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            arrays.insert(format!("{stem}.weight"), Array::from_u32(&a.codes, &[rows, cols * a.bits / 32])?);
            arrays.insert(format!("{stem}.scales"), Array::from_f32(&a.scales, &[rows, cols / 32])?);
            arrays.insert(format!("{stem}.biases"), Array::from_f32(&a.biases, &[rows, cols / 32])?);
            continue;
        }
        let a = Array::from_f32(&file.dequantize(t), &t.shape)?;
        arrays.insert(t.name.clone(), if cpu { a } else { a.astype(Dtype::Bfloat16)? });
    }
    Ok(mlx::io::Tensors { arrays, metadata: HashMap::new(), gguf: file.header.metadata })
}

/// Loads `path` for the CPU (`cpu`: dense tensors, scales and biases in float32) or a GPU (as
/// stored); `dequantize` expands quantized blocks to dense weights too.
pub fn load(path: &Path, cpu: bool, dequantize: bool) -> Result<Gguf> {
    // The architecture is checked from the header, before any weight is read.
    let header = super::gguf_reader::header(path)?;
    let head = Meta { map: &header.metadata, path };
    let arch = head
        .string("general.architecture")
        .ok_or_else(|| head.err("missing metadata key \"general.architecture\"".into()))?;
    let model_type = ARCHS.iter().find(|(a, _)| *a == arch).map(|(_, m)| *m).ok_or_else(|| {
        let known: Vec<&str> = ARCHS.iter().map(|a| a.0).collect();
        head.err(format!("GGUF architecture {arch:?} is not supported; supported: {}", known.join(", ")))
    })?;
    let file = read(path, &header, cpu, !dequantize)?;
    let meta = Meta { map: &file.gguf, path };
    let key = |k: &str| format!("{arch}.{k}");
    let n_head = meta.required(&key("attention.head_count"))? as usize;
    let n_kv = meta.number(&key("attention.head_count_kv"))?.map_or(n_head, |v| v as usize);
    let hidden = meta.required(&key("embedding_length"))? as usize;
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let vocab = meta.number(&key("vocab_size"))?.map_or(tokens.len(), |v| v as usize);
    let rope_scaling = match meta.string(&key("rope.scaling.type")) {
        None | Some("none") => Value::Null,
        Some("linear") => json!({"type": "linear", "factor": meta.required(&key("rope.scaling.factor"))?}),
        Some(t) => {
            return Err(meta.err(format!("rope scaling {t:?} in GGUF files is not supported; supported: none, linear")))
        }
    };

    // Weights under HF names; quantized triples keep their per-tensor bits.
    let mut tensors: HashMap<String, Array> = HashMap::new();
    let mut overrides: HashMap<String, Option<Quantization>> = HashMap::new();
    let mut stems: Vec<&String> = file
        .arrays
        .keys()
        .filter(|k| {
            (k.ends_with(".weight") || k.ends_with(".bias")) && !(arch == "gemma4" && *k == gguf_gemma4::ROPE_FREQS)
        })
        .collect();
    stems.sort();
    if arch == "gemma4" {
        // The router's scales are tensors with a `.scale` suffix.
        for (name, a) in file.arrays.iter().filter(|(k, _)| k.ends_with(".scale")) {
            let hf = gguf_gemma4::scale_name(name).ok_or_else(|| meta.err(format!("unknown tensor {name:?}")))?;
            tensors.insert(hf, if cpu { a.astype(Dtype::Float32)? } else { a.clone() });
        }
    }
    if is_qwen35(arch) {
        // A DeltaNet layer's `ssm_a` is a tensor without a suffix.
        for (name, a) in file.arrays.iter().filter(|(k, _)| k.ends_with(".ssm_a")) {
            let hf = hf_name(arch, name).ok_or_else(|| meta.err(format!("unknown tensor {name:?}")))?;
            tensors.insert(hf, if cpu { a.astype(Dtype::Float32)? } else { a.clone() });
        }
    }
    for name in stems {
        let (stem, suffix) = name.rsplit_once('.').expect("filtered on a suffix");
        let hf = hf_name(arch, stem).ok_or_else(|| meta.err(format!("unknown tensor {name:?}")))?;
        let permute = |a: &Array| -> Result<Array> {
            if arch != "llama" && arch != "minicpm" {
                return Ok(a.clone());
            }
            match stem.rsplit('.').next() {
                Some("attn_q") => unpermute(a, n_head),
                Some("attn_k") => unpermute(a, n_kv),
                _ => Ok(a.clone()),
            }
        };
        let w = &file.arrays[name];
        let scales = file.arrays.get(&format!("{stem}.scales"));
        let biases = file.arrays.get(&format!("{stem}.biases"));
        match (suffix, scales, biases) {
            ("weight", Some(s), Some(b)) => {
                let group_size = 32;
                let bits = (w.dim(-1) / s.dim(-1)) as i32;
                if dequantize {
                    let s32 = s.astype(Dtype::Float32)?;
                    let b32 = b.astype(Dtype::Float32)?;
                    let dense = ops::dequantize(
                        w,
                        &s32,
                        Quantization::affine(group_size, bits).op(Some(&b32)),
                        Dtype::Float32,
                    )?;
                    tensors.insert(format!("{hf}.weight"), permute(&dense)?);
                } else {
                    let widen = |a: &Array| if cpu { a.astype(Dtype::Float32) } else { Ok(a.clone()) };
                    tensors.insert(format!("{hf}.weight"), permute(w)?);
                    tensors.insert(format!("{hf}.scales"), permute(&widen(s)?)?);
                    tensors.insert(format!("{hf}.biases"), permute(&widen(b)?)?);
                    overrides.insert(hf.clone(), Some(Quantization::affine(group_size, bits)));
                }
            }
            _ => {
                let mut w = if cpu && w.dtype() != Dtype::Float32 { w.astype(Dtype::Float32)? } else { w.clone() };
                if arch == "gemma3" && stem.ends_with("norm") {
                    // llama.cpp stores Gemma's norms as 1 + weight; the model adds the 1.
                    w = w.subtract(&Array::scalar(1.0, w.dtype())?)?;
                }
                tensors.insert(format!("{hf}.{suffix}"), permute(&w)?);
            }
        }
    }
    let tied = !tensors.contains_key("lm_head.weight") && !tensors.contains_key("lm_head.scales");
    let head_dim = meta.number(&key("attention.key_length"))?.map_or(hidden / n_head, |v| v as usize);
    let bos = meta.number("tokenizer.ggml.bos_token_id")?.map(|v| v as u32);
    let eos = meta.number("tokenizer.ggml.eos_token_id")?.map(|v| v as u32);
    let layers = meta.required(&key("block_count"))? as usize;
    let ffn = match meta.number(&key("feed_forward_length"))? {
        Some(n) => n as usize,
        // A mixture's layers may have experts only.
        None if matches!(arch, "qwen35moe" | "qwen3moe" | "qwen2moe") => 0,
        None => meta.required(&key("feed_forward_length"))? as usize,
    };
    let mut config = json!({
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": meta.required(&key("attention.layer_norm_rms_epsilon"))? as f32 as f64,
        "vocab_size": vocab,
        "rope_theta": meta.number(&key("rope.freq_base"))?.unwrap_or(10000.0) as f32 as f64,
        "max_position_embeddings": meta.number(&key("context_length"))?.map(|v| v as usize),
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "rope_scaling": rope_scaling,
    });
    if arch == "gemma3" {
        // What the file leaves out, as llama.cpp fills it in: a local RoPE base of 10000,
        // every sixth layer global (the config's defaults), and scores scaled by head_dim^-0.5
        // except in the 27B (62 layers), which scales by (hidden / heads)^-0.5.
        config["sliding_window"] = json!(meta.number(&key("attention.sliding_window"))?.map_or(512, |v| v as usize));
        config["query_pre_attn_scalar"] = json!(if layers == 62 { hidden / n_head } else { head_dim });
    }
    if matches!(arch, "qwen3moe" | "qwen2moe") {
        let need = |k: &str| meta.required(&key(k)).map(|v| v as usize);
        config["num_experts"] = json!(need("expert_count")?);
        config["num_experts_per_tok"] = json!(need("expert_used_count")?);
        config["moe_intermediate_size"] = json!(need("expert_feed_forward_length")?);
        if arch == "qwen3moe" {
            // llama.cpp renormalizes a Qwen3 MoE's top experts; a layer without a router is dense.
            let dense: Vec<usize> = (0..layers)
                .filter(|l| !tensors.keys().any(|n| n.starts_with(&format!("model.layers.{l}.mlp.gate."))))
                .collect();
            config["norm_topk_prob"] = json!(true);
            config["decoder_sparse_step"] = json!(1);
            config["mlp_only_layers"] = json!(dense);
        } else {
            config["shared_expert_intermediate_size"] = json!(need("expert_shared_feed_forward_length")?);
        }
    }
    if arch == "minicpm" {
        // llama.cpp's three scalings, back to the checkpoint's fields.
        let need = |k: &str| meta.required(&key(k));
        let (embedding, residual, logit) = (need("embedding_scale")?, need("residual_scale")?, need("logit_scale")?);
        config["scale_emb"] = json!(embedding as f32 as f64);
        config["scale_depth"] = json!(residual * (layers as f64).sqrt());
        config["dim_model_base"] = json!((hidden as f64 / logit).round() as usize);
    }
    if is_qwen35(arch) {
        let num = |k: &str| meta.number(&key(k));
        let err = |m: String| meta.err(m);
        let (c, shape) = super::gguf_qwen35::config(arch == "qwen35moe", config, &num, &err)?;
        config = c;
        super::gguf_qwen35::restore(&mut tensors, &shape).map_err(|e| meta.err(e.to_string()))?;
    }
    if arch == "gemma4" {
        let ints = |k: &str| -> Result<Option<Vec<i64>>> {
            match meta.map.get(&key(k)) {
                None => Ok(None),
                Some(GgufValue::Array(a)) => {
                    Ok(Some(a.astype(Dtype::Int32)?.to_vec_i32()?.into_iter().map(i64::from).collect()))
                }
                Some(_) => Err(meta.err(format!("metadata {:?} should be numbers", key(k)))),
            }
        };
        let rope_freqs =
            file.arrays.get(gguf_gemma4::ROPE_FREQS).map(|a| a.astype(Dtype::Float32)?.to_vec_f32()).transpose()?;
        let source = gguf_gemma4::Source {
            ints: &ints,
            num: &|k: &str| meta.number(&key(k)),
            rope_freqs,
            tensors: &tensors,
            err: &|m: String| meta.err(m),
        };
        config = gguf_gemma4::config(config, &source)?;
        // End of turn as llama.cpp reads a Gemma 4 vocabulary: `<eos>`, `<turn|>`, and
        // `<|tool_response>` (a tool call waits for its result).
        let mut eos: Vec<u32> = eos.into_iter().collect();
        for (i, t) in tokens.iter().enumerate() {
            if matches!(t.as_str(), "<turn|>" | "<|tool_response>" | "<end_of_turn>") {
                eos.push(i as u32);
            }
        }
        config["eos_token_id"] = json!(eos);
        gguf_gemma4::restore(&mut tensors).map_err(|e| meta.err(e.to_string()))?;
    }
    restore_experts(&mut tensors).map_err(|e| meta.err(e.to_string()))?;
    // Quantization overrides follow the tensors' names (a fused expert split in two).
    for (hf, q) in overrides.clone() {
        if let Some(stem) = hf.strip_suffix(".gate_up_proj") {
            overrides.insert(format!("{stem}.gate_proj"), q);
            overrides.insert(format!("{stem}.up_proj"), q);
        }
    }
    overrides.retain(|hf, _| tensors.contains_key(&format!("{hf}.weight")));
    let weights = Weights::new(tensors, path, arch).with_quantization(None, overrides);
    let tokenizer = build_tokenizer(&meta, arch)?;
    Ok(Gguf { config, weights, tokenizer })
}

/// The tokenizer of the GGUF file at `path`, from its header alone (no weight is read).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let header = super::gguf_reader::header(path)?;
    let meta = Meta { map: &header.metadata, path };
    build_tokenizer(&meta, meta.string("general.architecture").unwrap_or(""))
}

/// The tokenizer the file's vocabulary describes (its kind from `tokenizer.ggml.model`).
fn build_tokenizer(meta: &Meta<'_>, arch: &str) -> Result<Tokenizer> {
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let bos = meta.number("tokenizer.ggml.bos_token_id")?.map(|v| v as u32);
    let eos = meta.number("tokenizer.ggml.eos_token_id")?.map(|v| v as u32);
    match meta.string("tokenizer.ggml.model") {
        Some("llama") => sentencepiece_tokenizer(meta, tokens, bos, eos, arch == "gemma3"),
        Some("gemma4") => gemma4_tokenizer(meta, tokens, bos, eos),
        _ => tokenizer(meta, tokens, bos, eos),
    }
}

/// llama.cpp's fused experts (`ffn_gate_up_exps`, `[E, 2I, H]`: gate rows, then up rows) split
/// into the gate and up a `switch_mlp` or `switch_glu` loads (quantization triples alike: the
/// rows are the second-last axis of each), and a shared expert's gate stored `[H]` made the
/// `[1, H]` a linear layer reads.
fn restore_experts(tensors: &mut HashMap<String, Array>) -> Result<()> {
    let names: Vec<String> = tensors.keys().cloned().collect();
    for name in names {
        let fused = name
            .split_once(".gate_up_proj.")
            .filter(|(stem, _)| stem.ends_with(".switch_mlp") || stem.ends_with(".switch_glu"));
        if let Some((stem, part)) = fused {
            let a = tensors.remove(&name).expect("listed");
            let (axis, rows) = (a.ndim() as i32 - 2, a.dim(-2) as i32);
            if axis < 0 || rows % 2 != 0 {
                return Err(Error::Invalid(format!("{name}: {rows} rows do not split into gate and up halves")));
            }
            tensors.insert(format!("{stem}.gate_proj.{part}"), a.slice_axis(axis, 0, rows / 2)?);
            tensors.insert(format!("{stem}.up_proj.{part}"), a.slice_axis(axis, rows / 2, rows)?);
        } else if name.ends_with(".mlp.shared_expert_gate.weight") && tensors[&name].ndim() == 1 {
            let a = &tensors[&name];
            let a = a.reshape(&[1, a.dim(0) as i32])?;
            tensors.insert(name, a);
        }
    }
    Ok(())
}

/// The GGUF vocabulary as a `tokenizers` byte-level BPE, built the way
/// `shared/models/gguf_to_hf.py` writes `tokenizer.json`.
fn tokenizer(meta: &Meta<'_>, tokens: &[String], bos: Option<u32>, eos: Option<u32>) -> Result<Tokenizer> {
    let model = meta.string("tokenizer.ggml.model").unwrap_or("?");
    if model != "gpt2" {
        return Err(meta.err(format!(
            "GGUF tokenizer model {model:?} is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece), gemma4"
        )));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre = match meta.string("tokenizer.ggml.pre") {
        // llama.cpp's "\p{N}" split followed by the GPT-2 regex.
        Some("smollm" | "starcoder" | "refact") => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]}),
        Some("gpt2" | "default") | None => byte_level,
        // The split its merges were learned with (as transformers reads the file), then bytes.
        Some(p) => match split_regex(p) {
            Some(pattern) => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]}),
            None => {
                let known: Vec<&str> = SPLITS.iter().flat_map(|(names, _)| names.iter().copied()).collect();
                return Err(meta.err(format!(
                    "GGUF pre-tokenizer {p:?} is not supported; supported: smollm, starcoder, refact, gpt2, default, {}",
                    known.join(", ")
                )));
            }
        },
    };
    let added = added_tokens(meta, tokens)?;
    let vocab: serde_json::Map<String, Value> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let merges = file_merges(meta)?;
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": bos_processor(meta.number("tokenizer.ggml.add_bos_token")?.is_some_and(|v| v != 0.0), tokens, bos)
            .unwrap_or(json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})),
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    finish_tokenizer(meta, &spec, tokens, bos, eos)
}

/// llama.cpp's pre-tokenizer names and the split each one's merges were learned with, as
/// transformers 5 reads them (`GGUF_PRE_TOKENIZER_SPLITS`).
const SPLITS: &[(&[&str], &str)] = &[
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ],
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        &["tekken"],
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        &["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"],
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    // Qwen3.5's counts combining marks (\p{M}) with letters.
    (
        &["qwen35"],
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// The split regex of pre-tokenizer `pre`, if known.
fn split_regex(pre: &str) -> Option<&'static str> {
    SPLITS.iter().find(|(names, _)| names.contains(&pre)).map(|(_, r)| *r)
}

/// A post-processor putting BOS first, where `add_bos` and the vocabulary has one.
fn bos_processor(add_bos: bool, tokens: &[String], bos: Option<u32>) -> Option<Value> {
    let id = bos.filter(|_| add_bos)?;
    let name = tokens.get(id as usize)?;
    Some(json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": name, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name.as_str(): {"id": name, "ids": [id], "tokens": [name]}},
    }))
}

/// The tokens the vocabulary marks (`token_type`: 1 normal, 2 unknown, 3 control, 4
/// user-defined, 5 unused, 6 byte) as added tokens: unknown and control ones special,
/// user-defined ones (like `<think>`) not; all matched whole in text.
fn added_tokens(meta: &Meta<'_>, tokens: &[String]) -> Result<Vec<Value>> {
    let types = meta.ints("tokenizer.ggml.token_type")?;
    Ok(tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, t))| matches!(t, 2..=4))
        .map(|(i, (tok, t))| {
            json!({"id": i, "content": tok, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": *t != 4})
        })
        .collect())
}

/// The `Tokenizer` of a `tokenizer.json` value `spec`, with the file's chat template and
/// BOS/EOS tokens.
fn finish_tokenizer(
    meta: &Meta<'_>,
    spec: &Value,
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
) -> Result<Tokenizer> {
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
    let config = json!({
        "chat_template": meta.string("tokenizer.chat_template"),
        "bos_token": name(bos),
        "eos_token": name(eos),
    });
    let bytes = serde_json::to_vec(spec).map_err(|e| Error::Tokenizer(e.to_string()))?;
    Tokenizer::from_parts(&bytes, &config)
}

/// Python's `str.isspace` of one character (Unicode whitespace, and the four ASCII
/// separators U+001C..U+001F that Rust's `is_whitespace` leaves out).
fn python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model` "llama") as a `tokenizers` BPE with byte
/// fallback, built as transformers 5 builds it from a GGUF (`integrations/gguf`), so the host's
/// ids are the ones mlx-lm gets from the converted folder. Gemma files (`gemma_tokenizer`):
/// - a token of spaces only (two or more, stored as real spaces) is spelled with `▁` (and
///   is not an added token);
/// - the file has no merges: they are implied by the vocabulary, ranked by the token's
///   position in the file (earlier first), as Gemma's scores do not follow its merge order;
/// - spaces are normalized to `▁`; BOS is prepended when `tokenizer.ggml.add_bos_token` says
///   (the default).
///
/// Other files (Llama 2, Mistral 7B, MiniCPM: `LlamaTokenizer`): the file's merges, or those
/// its scores imply; a `▁` put before the text when `tokenizer.ggml.add_space_prefix` says
/// (the default) and taken off again when decoding; BOS as for Gemma.
fn sentencepiece_tokenizer(
    meta: &Meta<'_>,
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
    gemma: bool,
) -> Result<Tokenizer> {
    let spelled: Vec<String> = tokens
        .iter()
        .map(|t| {
            if gemma && t.contains(' ') && t.chars().all(python_space) {
                "\u{2581}".repeat(t.chars().count())
            } else {
                t.clone()
            }
        })
        .collect();
    // Python dicts: a repeated token keeps its first place and its last index.
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(spelled.len());
    let mut order: Vec<&str> = Vec::with_capacity(spelled.len());
    for (i, t) in spelled.iter().enumerate() {
        if index.insert(t.as_str(), i).is_none() {
            order.push(t);
        }
    }
    let merges = match meta.map.get("tokenizer.ggml.merges") {
        Some(_) if !gemma => file_merges(meta)?,
        _ if gemma => implied_merges(&order, &index, |i| -(i as f64)),
        _ => {
            let scores = match meta.map.get("tokenizer.ggml.scores") {
                Some(GgufValue::Array(a)) => a.to_vec_f32()?,
                _ => {
                    return Err(meta.err("a SentencePiece vocabulary without merges needs tokenizer.ggml.scores".into()))
                }
            };
            implied_merges(&order, &index, |i| scores.get(i).copied().unwrap_or(f32::MIN) as f64)
        }
    };
    let vocab: serde_json::Map<String, Value> = order.iter().map(|&t| (t.to_string(), json!(index[t]))).collect();
    // A respelled token (all spaces) is no added token: its file spelling is not in the vocabulary.
    let added: Vec<Value> = added_tokens(meta, tokens)?
        .into_iter()
        .filter(|a| a["id"].as_u64().is_some_and(|i| tokens[i as usize] == spelled[i as usize]))
        .collect();
    let add_bos = meta.number("tokenizer.ggml.add_bos_token")?.is_none_or(|v| v != 0.0);
    let prefix_space = (!gemma).then(|| meta.number("tokenizer.ggml.add_space_prefix")).transpose()?;
    let prefix_space = prefix_space.map(|p| p.is_none_or(|v| v != 0.0));
    spm_bpe_tokenizer(meta, tokens, bos, eos, SpmVocab { vocab, merges, added, add_bos, prefix_space })
}

/// The file's merges (`tokenizer.ggml.merges`: "left right"; llama.cpp splits at the first
/// space after the first character).
fn file_merges(meta: &Meta<'_>) -> Result<Vec<Value>> {
    Ok(meta
        .strings("tokenizer.ggml.merges")?
        .iter()
        .map(|m| match m.char_indices().skip(1).find(|(_, c)| *c == ' ') {
            Some((at, _)) => json!([&m[..at], &m[at + 1..]]),
            None => json!([m, ""]),
        })
        .collect())
}

/// The merges a vocabulary implies (transformers' `generate_merges` with scores): every split
/// of a token into two vocabulary tokens, the token's `score` (of its index) highest first,
/// then the longer left part, then the longer right part, then the token's place.
fn implied_merges(order: &[&str], index: &HashMap<&str, usize>, score: impl Fn(usize) -> f64) -> Vec<Value> {
    // (score, left chars, right chars, place, left, right)
    let mut merges: Vec<(f64, usize, usize, usize, &str, &str)> = Vec::new();
    for (place, &t) in order.iter().enumerate() {
        let s = score(index[t]);
        let total = t.chars().count();
        for (left_chars, (at, _)) in t.char_indices().enumerate().skip(1) {
            let (l, r) = t.split_at(at);
            if index.contains_key(l) && index.contains_key(r) {
                merges.push((s, left_chars, total - left_chars, place, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)).then(a.3.cmp(&b.3)));
    merges.iter().map(|m| json!([m.4, m.5])).collect()
}

/// A Gemma 4 vocabulary (`tokenizer.ggml.model` "gemma4", llama.cpp's SentencePiece-style BPE:
/// spaces as `▁`, the file's merges over whole text, bytes as `<0xXX>` tokens where no token
/// fits) as the `tokenizers` BPE that Gemma's `tokenizer.json` is, which the converter read.
fn gemma4_tokenizer(meta: &Meta<'_>, tokens: &[String], bos: Option<u32>, eos: Option<u32>) -> Result<Tokenizer> {
    // A repeated token keeps its last index, as transformers' dict of the file's tokens does.
    let vocab: serde_json::Map<String, Value> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let merges = file_merges(meta)?;
    let added = added_tokens(meta, tokens)?;
    // No BOS of its own, whatever the file's flag (the converter sets it): Gemma 4's tokenizer
    // adds none, as its chat template writes `<bos>` (transformers reads these files so too).
    spm_bpe_tokenizer(meta, tokens, bos, eos, SpmVocab { vocab, merges, added, add_bos: false, prefix_space: None })
}

/// What a SentencePiece-style BPE is built from: `vocab` (token to id), `merges` (pairs,
/// best first), the `added` tokens, whether BOS is prepended, and the prefix space: `None`
/// for Gemma's form (every space normalized to `▁`), else Llama's (`Metaspace`, a `▁` before
/// the text where `Some(true)`).
struct SpmVocab {
    vocab: serde_json::Map<String, Value>,
    merges: Vec<Value>,
    added: Vec<Value>,
    add_bos: bool,
    prefix_space: Option<bool>,
}

/// A SentencePiece-style BPE (`tokenizers`' form of these vocabularies): byte fallback, BOS
/// prepended where `add_bos`.
fn spm_bpe_tokenizer(
    meta: &Meta<'_>,
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
    v: SpmVocab,
) -> Result<Tokenizer> {
    let SpmVocab { vocab, merges, added, add_bos, prefix_space } = v;
    let unk = meta.number("tokenizer.ggml.unknown_token_id")?.and_then(|i| tokens.get(i as usize)).cloned();
    let post = bos_processor(add_bos, tokens, bos).unwrap_or(Value::Null);
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    let (normalizer, pre_tokenizer, unk) = match prefix_space {
        None => (
            json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            unk,
        ),
        Some(prefix) => {
            if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let scheme = if prefix { "first" } else { "never" };
            // `LlamaTokenizer` gives its BPE no unknown token: what no piece covers is bytes.
            (
                Value::Null,
                json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": scheme, "split": false}),
                None,
            )
        }
    };
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    finish_tokenizer(meta, &spec, tokens, bos, eos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::arange;

    /// Fused experts split into gate (the first rows) and up, their scales alike, for Qwen's
    /// `switch_mlp` and Gemma 4's `switch_glu`; a shared expert's gate `[H]` made `[1, H]`.
    #[test]
    fn fused_experts_split_and_a_shared_gate_is_made_two_dimensional() {
        let mut t = HashMap::new();
        for x in ["model.layers.0.mlp.switch_mlp", "model.layers.1.experts.switch_glu"] {
            t.insert(format!("{x}.gate_up_proj.weight"), arange(&[2, 6, 3]));
            t.insert(format!("{x}.gate_up_proj.scales"), arange(&[2, 6, 1]));
        }
        t.insert("model.layers.0.mlp.shared_expert_gate.weight".to_string(), arange(&[3]));
        restore_experts(&mut t).unwrap();
        for x in ["model.layers.0.mlp.switch_mlp", "model.layers.1.experts.switch_glu"] {
            let gate = &t[&format!("{x}.gate_proj.weight")];
            assert_eq!(gate.shape(), vec![2, 3, 3]);
            assert_eq!(gate.to_vec_f32().unwrap()[..3], [0.0, 1.0, 2.0]);
            assert_eq!(t[&format!("{x}.up_proj.weight")].to_vec_f32().unwrap()[..3], [9.0, 10.0, 11.0]);
            assert_eq!(t[&format!("{x}.up_proj.scales")].shape(), vec![2, 3, 1]);
        }
        assert_eq!(t["model.layers.0.mlp.shared_expert_gate.weight"].shape(), vec![1, 3]);
        assert!(!t.keys().any(|k| k.contains("gate_up_proj")), "{:?}", t.keys());
        let mut odd =
            HashMap::from([("model.layers.0.mlp.switch_mlp.gate_up_proj.weight".to_string(), arange(&[2, 5, 3]))]);
        assert!(restore_experts(&mut odd).is_err(), "5 rows do not halve");
    }
}
