//! `load(path)`: a Hugging Face folder or a `.gguf` file to a ready model. `model_type`
//! picks the architecture file; aliases sharing an architecture are one match arm each.

use crate::tokenizer::Tokenizer;
use crate::weights::{gguf, safetensors, QuantMode, Quantization, Weights};
use crate::{
    gemma3, gemma4, gpt_oss, llama, minicpm, ministral3, phi3, qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_moe, CausalLm,
    Error, Result,
};
use mlx::Device;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const SUPPORTED_MODEL_TYPES: &str = "llama, mistral, ministral3, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe, gemma3_text, gemma4_text, gpt_oss, phi3, minicpm (and the text models of gemma3, gemma4 and mistral3 folders)";

/// What the engine needs to know about a loaded model besides the model itself.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_type: String,
    pub source: PathBuf,
    /// Token ids that end generation (config, generation_config and tokenizer EOS).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// Bytes of all weights as held in memory.
    pub weight_bytes: usize,
    /// Bytes one decode step reads: all weights, except that an untied embedding table
    /// counts one row (a tied one is read whole as the output head) and a mixture of experts
    /// counts the share of its experts one token uses.
    pub weight_bytes_per_token: usize,
    pub n_layers: usize,
    pub vocab_size: usize,
    /// Context length from the config, if it says.
    pub max_position_embeddings: Option<usize>,
    /// KV-cache bytes one position takes over all layers.
    pub kv_bytes_per_token: usize,
    /// Layers whose cache is a recurrent state (Qwen3.5's Gated DeltaNet): it rolls back only
    /// to the snapshots it keeps (`KvCache::keep_snapshots`).
    pub recurrent_layers: usize,
    /// Bytes of recurrent state one sequence holds whatever its length (0 without recurrent
    /// layers): what a request reserves beside its keys and values.
    pub recurrent_state_bytes: usize,
}

pub struct Loaded {
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Tokenizer,
    pub info: ModelInfo,
}

/// How to load. The default keeps weights as stored on GPUs; on the CPU a GGUF file's dense
/// tensors become float32 and its Q4_0/Q4_1/Q8_0 blocks stay packed (the shim's CPU product
/// reads them), unless `HOST_CPU_QMATMUL=0` turns that product off (then they are
/// dequantized to float32: MLX's own CPU quantized matmul is about a tenth of its speed).
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Dequantize GGUF weights; `None` decides by the default device as above.
    pub dequantize_gguf: Option<bool>,
    /// Load this rank's tensor-parallel shard (the group must be initialized): the shard's
    /// index and the shard count (with `pipeline` too, within its stage).
    pub tensor_parallel: Option<mlx::distributed::Group>,
    /// Load this rank's pipeline stage: a contiguous range of the layers (the last ones on
    /// rank 0, which holds the head), receiving the hidden state from the rank above and
    /// sending it to the rank below (`llama::Stage`): the stage's index and the stage count.
    /// With `tensor_parallel` too, a stage is that many neighbouring ranks, each a shard of
    /// its layers: the group's rank is `stage * shards + shard`.
    pub pipeline: Option<mlx::distributed::Group>,
    /// Concatenate each layer's q/k/v and gate/up weights so one matmul replaces three and
    /// two (fewer kernels per step: 1.4x decode on the H200's 0.5B shape, the same logits on
    /// the CPU, the same greedy ids as mlx-lm on the GPU; bench/NOTES.md). `None` means on,
    /// unless the environment sets `HOST_FUSE_PROJECTIONS=0` (for A/B measurements).
    pub fuse_projections: Option<bool>,
}

impl LoadOptions {
    pub fn fuse_projections(&self) -> bool {
        self.fuse_projections.unwrap_or_else(|| {
            !std::env::var("HOST_FUSE_PROJECTIONS").is_ok_and(|v| matches!(v.as_str(), "0" | "off" | "false"))
        })
    }
}

pub fn load(path: &Path) -> Result<Loaded> {
    load_with(path, &LoadOptions::default())
}

pub fn load_with(path: &Path, options: &LoadOptions) -> Result<Loaded> {
    if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        let cpu = Device::default_device() == Device::Cpu;
        let dequantize = options.dequantize_gguf.unwrap_or(cpu && !mlx::cpu_quantized_products());
        let g = gguf::load(path, cpu, dequantize)?;
        let arch = Arch::parse(&g.config, path)?;
        return build(path, arch, &g.config, Value::Null, g.weights, g.tokenizer, options);
    }
    if !path.is_dir() {
        return Err(Error::Invalid(format!(
            "model path {} is neither a Hugging Face folder (config.json, *.safetensors, tokenizer.json) nor a .gguf file",
            path.display()
        )));
    }
    // Config first: an unsupported or incomplete config fails before any weight is read.
    let config_path = path.join("config.json");
    let (config, multimodal) = text_model_config(read_json(&config_path)?);
    let arch = Arch::parse(&config, &config_path)?;
    let (q, overrides) = quantization(&config, &config_path)?;
    let generation = read_json(&path.join("generation_config.json")).unwrap_or(Value::Null);
    let mut tensors = safetensors::load(path)?;
    if multimodal {
        tensors = tensors.into_iter().filter_map(|(name, a)| Some((text_weight_name(&name)?, a))).collect();
    }
    let weights = Weights::new(tensors, path, arch.name()).with_quantization(q, overrides);
    let tokenizer = Tokenizer::from_dir(path)?;
    build(path, arch, &config, generation, weights, tokenizer, options)
}

/// Checks that the model folder at `path` splits over `n` tensor-parallel ranks (GGUF files
/// are checked when they load).
/// Refuses a pipeline over `n` ranks that the model at `path` cannot take (an architecture
/// without stages yet, or fewer layers than ranks), before any rank loads weights.
pub fn check_pipeline(path: &Path, n: usize) -> Result<()> {
    if !path.is_dir() {
        return Ok(()); // A GGUF file: its architecture is checked as it loads.
    }
    let config_path = path.join("config.json");
    let (config, _) = text_model_config(read_json(&config_path)?);
    Arch::parse(&config, &config_path)?.check_pipeline(n)
}

pub fn check_tensor_parallel(path: &Path, n: usize) -> Result<()> {
    if !path.is_dir() {
        return Ok(());
    }
    let config_path = path.join("config.json");
    let (config, _) = text_model_config(read_json(&config_path)?);
    Arch::parse(&config, &config_path)?.check_tensor_parallel(n)
}

/// A vision-language folder's text model, as mlx-lm's `gemma3` and `mistral3` wrappers read
/// it (mlx-community ships Gemma 3 4B-27B and Mistral 3 this way): its config is
/// `text_config`, given the defaults the wrapper gives it, the folder's `quantization` and
/// token ids; `true` when `config` was such a folder's (its weights then need
/// [`text_weight_name`]). The vision tower is not loaded: images are not supported.
pub(crate) fn text_model_config(config: Value) -> (Value, bool) {
    let kind = config.get("model_type").and_then(Value::as_str).unwrap_or_default();
    if matches!(kind, "qwen3_5" | "qwen3_5_moe") {
        return (qwen3_5_text_config(&config, kind), true);
    }
    let Some(Value::Object(mut text)) =
        config.get("text_config").cloned().filter(|_| matches!(kind, "gemma3" | "gemma4" | "mistral3"))
    else {
        return (config, false);
    };
    if kind == "gemma3" {
        text.insert("model_type".into(), "gemma3_text".into());
        text.insert("vocab_size".into(), config.get("vocab_size").cloned().unwrap_or(262208.into()));
        text.entry("num_attention_heads").or_insert(8.into());
        text.entry("num_key_value_heads").or_insert(4.into());
    } else if kind == "gemma4" {
        text.insert("model_type".into(), "gemma4_text".into());
        text.insert("vocab_size".into(), config.get("vocab_size").cloned().unwrap_or(262144.into()));
        text.entry("num_attention_heads").or_insert(8.into());
        text.entry("num_key_value_heads").or_insert(1.into());
    } else {
        // mlx-lm builds `ministral3` and `mistral4` text models by name, anything else as Llama.
        let inner = text.get("model_type").and_then(Value::as_str).unwrap_or("llama");
        if !matches!(inner, "ministral3" | "mistral4") {
            text.insert("model_type".into(), "llama".into());
        }
        text.entry("tie_word_embeddings").or_insert(false.into());
    }
    for key in ["quantization", "quantization_config"] {
        if let Some(Value::Object(q)) = config.get(key) {
            // Module entries take their weights' names; a vision module's keeps its own (unused).
            let renamed = q.iter().map(|(k, v)| (text_weight_name(k).unwrap_or_else(|| k.clone()), v.clone()));
            text.insert(key.into(), Value::Object(renamed.collect()));
        }
    }
    for key in ["eos_token_id", "bos_token_id"] {
        if let Some(v) = config.get(key) {
            text.entry(key).or_insert(v.clone());
        }
    }
    (Value::Object(text), true)
}

/// Qwen3.5's text config as mlx-lm's `qwen3_5` reads it: `text_config` when there is one
/// (Qwen's own checkpoints, with a vision tower), else the config itself; its weights are
/// named as a multimodal folder's either way (mlx-lm prefixes `language_model.`).
fn qwen3_5_text_config(config: &Value, kind: &str) -> Value {
    let mut text = match config.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        _ => config.as_object().cloned().unwrap_or_default(),
    };
    text.insert("model_type".into(), kind.into());
    for key in ["quantization", "quantization_config"] {
        if let Some(Value::Object(q)) = config.get(key) {
            let renamed = q.iter().map(|(k, v)| (text_weight_name(k).unwrap_or_else(|| k.clone()), v.clone()));
            text.insert(key.into(), Value::Object(renamed.collect()));
        }
    }
    for key in ["eos_token_id", "bos_token_id", "tie_word_embeddings"] {
        if let Some(v) = config.get(key) {
            text.entry(key).or_insert(v.clone());
        }
    }
    Value::Object(text)
}

/// A vision-language checkpoint's weight (or module) name as its text model's: the vision
/// tower and projector dropped (`None`), `language_model.` and transformers 5's
/// `model.language_model.` taken off.
pub(crate) fn text_weight_name(name: &str) -> Option<String> {
    let towers =
        ["vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision", "vision_embedder"];
    if towers.iter().any(|t| name.contains(t)) || name.starts_with("model.visual.") {
        return None;
    }
    Some(match name.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => name.strip_prefix("language_model.").unwrap_or(name).to_string(),
    })
}

/// A parsed config of one of the supported architectures.
pub enum Arch {
    Llama(llama::Config),
    Ministral3(ministral3::Config),
    Qwen2(qwen2::Config),
    Qwen3(qwen3::Config),
    Qwen3Moe(qwen3_moe::Config),
    Qwen2Moe(qwen2_moe::Config),
    Gemma3(gemma3::Config),
    Gemma4(gemma4::Config),
    GptOss(gpt_oss::Config),
    Phi3(phi3::Config),
    MiniCpm(minicpm::Config),
    Qwen3_5(qwen3_5::Config),
}

impl Arch {
    /// Reads `model_type` and the architecture's config from a `config.json` value.
    pub fn parse(config: &Value, path: &Path) -> Result<Arch> {
        let model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Config { path: path.to_path_buf(), message: "missing key `model_type`".into() })?;
        Ok(match model_type {
            "llama" | "mistral" => Arch::Llama(parse(config, path)?),
            "ministral3" => Arch::Ministral3(parse(config, path)?),
            "qwen2" => Arch::Qwen2(parse(config, path)?),
            "qwen3" => Arch::Qwen3(parse(config, path)?),
            "qwen3_moe" => Arch::Qwen3Moe(parse(config, path)?),
            "qwen2_moe" => Arch::Qwen2Moe(parse(config, path)?),
            "gemma3_text" => Arch::Gemma3(parse(config, path)?),
            "gemma4_text" => Arch::Gemma4(parse(config, path)?),
            "gpt_oss" => Arch::GptOss(parse(config, path)?),
            "phi3" => Arch::Phi3(parse(config, path)?),
            "minicpm" => Arch::MiniCpm(parse(config, path)?),
            "qwen3_5" | "qwen3_5_moe" => Arch::Qwen3_5(parse(config, path)?),
            other => {
                return Err(Error::UnsupportedModel {
                    found: other.to_string(),
                    config: path.to_path_buf(),
                    supported: SUPPORTED_MODEL_TYPES.to_string(),
                })
            }
        })
    }

    /// Key (or value) features a position takes in the cache, summed over the layers that
    /// keep their own (layers x KV heads x head dim for a uniform stack).
    pub fn kv_features(&self) -> usize {
        let uniform = |layers: usize, kv: usize, hd: usize| layers * kv * hd;
        match self {
            Arch::Llama(c) => {
                let d = c.dims();
                uniform(d.layers, d.n_kv_heads, d.head_dim)
            }
            Arch::Ministral3(c) => uniform(c.num_hidden_layers, c.kv_heads(), c.head_dim()),
            Arch::Qwen2(c) => {
                uniform(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size / c.num_attention_heads)
            }
            Arch::Qwen3(c) => uniform(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
            Arch::Qwen3Moe(c) => uniform(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
            Arch::Qwen2Moe(c) => uniform(c.num_hidden_layers, c.kv_heads(), c.hidden_size / c.num_attention_heads),
            Arch::Gemma3(c) => uniform(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
            // Sliding and full layers' head sizes differ; shared layers keep none.
            Arch::Gemma4(c) => c.kv_features(),
            Arch::GptOss(c) => uniform(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
            Arch::Phi3(c) => uniform(c.num_hidden_layers, c.kv_heads(), c.head_dim()),
            Arch::MiniCpm(c) => {
                uniform(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size / c.num_attention_heads)
            }
            // Only the full-attention layers keep keys and values; a DeltaNet layer's state
            // is the same size whatever the length.
            Arch::Qwen3_5(c) => uniform(c.attention_layers(), c.num_key_value_heads, c.head_dim()),
        }
    }

    /// Refuses a pipeline over `n` ranks: only the Llama-shaped decoders (Llama, Mistral,
    /// Qwen2, Qwen3) have stages, each at least one layer.
    pub fn check_pipeline(&self, n: usize) -> Result<()> {
        let Some(layers) = self.stage_layers() else {
            return Err(Error::Invalid(format!(
                "pipeline parallelism over {} is not supported yet (Llama, Mistral, Qwen2 and Qwen3 are); run it on one rank or with --tensor-parallel",
                self.name()
            )));
        };
        if n > layers {
            return Err(Error::Invalid(format!(
                "a pipeline of {n} ranks needs at least {n} layers; this model has {layers}"
            )));
        }
        Ok(())
    }

    /// The decoder layers of an architecture that splits into pipeline stages; `None` for
    /// the others.
    pub fn stage_layers(&self) -> Option<usize> {
        match self {
            Arch::Llama(c) => Some(c.dims().layers),
            Arch::Qwen2(c) => Some(c.num_hidden_layers),
            Arch::Qwen3(c) => Some(c.num_hidden_layers),
            _ => None,
        }
    }

    /// Refuses a split over `n` tensor-parallel ranks that does not divide the heads and the
    /// MLP evenly, before any rank loads weights.
    pub fn check_tensor_parallel(&self, n: usize) -> Result<()> {
        let (heads, kv, ffn) = match self {
            Arch::Llama(c) => {
                let d = c.dims();
                (d.n_heads, d.n_kv_heads, d.ffn)
            }
            Arch::Qwen2(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Ministral3(c) => (c.num_attention_heads, c.kv_heads(), c.intermediate_size),
            Arch::Qwen3(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Gemma3(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Gemma4(_) if n > 1 => {
                return Err(Error::Invalid(
                    "tensor parallelism over gemma4 (per-layer head sizes and shared keys) is not supported yet; run it on one rank"
                        .into(),
                ))
            }
            Arch::Gemma4(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Qwen3Moe(_) | Arch::Qwen2Moe(_) | Arch::GptOss(_) if n > 1 => {
                return Err(Error::Invalid(format!(
                    "tensor parallelism over a mixture-of-experts model ({}) is not supported yet; run it on one rank",
                    self.name()
                )))
            }
            Arch::Phi3(_) if n > 1 => {
                return Err(Error::Invalid(
                    "tensor parallelism over phi3 (fused projections) is not supported yet; run it on one rank".into(),
                ))
            }
            Arch::Phi3(c) => (c.num_attention_heads, c.kv_heads(), c.intermediate_size),
            Arch::MiniCpm(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Qwen3_5(_) if n > 1 => {
                return Err(Error::Invalid(
                    "tensor parallelism over qwen3_5 (recurrent layers) is not supported yet; run it on one rank"
                        .into(),
                ))
            }
            Arch::Qwen3_5(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::GptOss(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Qwen3Moe(c) => (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
            Arch::Qwen2Moe(c) => (c.num_attention_heads, c.kv_heads(), c.intermediate_size),
        };
        llama::check_split(heads, kv, ffn, n)
    }

    /// (experts per token, experts) of a mixture-of-experts model.
    pub fn active_experts(&self) -> Option<(usize, usize)> {
        match self {
            Arch::Qwen3Moe(c) => Some((c.num_experts_per_tok, c.num_experts)),
            Arch::Qwen2Moe(c) => Some((c.num_experts_per_tok, c.num_experts)),
            Arch::GptOss(c) => Some((c.num_experts_per_tok, c.num_local_experts)),
            Arch::Qwen3_5(c) if c.num_experts > 0 => Some((c.num_experts_per_tok, c.num_experts)),
            Arch::Gemma4(c) if c.enable_moe_block => Some((c.top_k_experts?, c.num_experts?)),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Arch::Llama(_) => "llama",
            Arch::Ministral3(_) => "ministral3",
            Arch::Qwen2(_) => "qwen2",
            Arch::Qwen3(_) => "qwen3",
            Arch::Qwen3Moe(_) => "qwen3_moe",
            Arch::Qwen2Moe(_) => "qwen2_moe",
            Arch::Gemma3(_) => "gemma3_text",
            Arch::Gemma4(_) => "gemma4_text",
            Arch::GptOss(_) => "gpt_oss",
            Arch::Phi3(_) => "phi3",
            Arch::MiniCpm(_) => "minicpm",
            Arch::Qwen3_5(c) if c.num_experts > 0 => "qwen3_5_moe",
            Arch::Qwen3_5(_) => "qwen3_5",
        }
    }

    /// Builds the model from (sanitized) weights; with a tensor-parallel group, this rank's
    /// shard (and `weights` is cut down to it).
    pub fn model(&self, weights: &mut Weights, options: &LoadOptions) -> Result<Box<dyn CausalLm>> {
        Ok(match self {
            Arch::Llama(c) => Box::new(llama::Model::load(c, weights, options)?),
            Arch::Ministral3(c) => Box::new(ministral3::load(c, weights, options)?),
            Arch::Qwen2(c) => Box::new(qwen2::load(c, weights, options)?),
            Arch::Qwen3(c) => Box::new(qwen3::load(c, weights, options)?),
            Arch::Qwen3Moe(c) => Box::new(qwen3_moe::load(c, weights, options)?),
            Arch::Qwen2Moe(c) => Box::new(qwen2_moe::load(c, weights, options)?),
            Arch::Gemma3(c) => Box::new(gemma3::Model::load(c, weights, options)?),
            Arch::Gemma4(c) => Box::new(gemma4::load(c, weights, options)?),
            Arch::GptOss(c) => Box::new(gpt_oss::load(c, weights, options)?),
            Arch::Phi3(c) => Box::new(phi3::load(c, weights, options)?),
            Arch::MiniCpm(c) => Box::new(minicpm::load(c, weights, options)?),
            Arch::Qwen3_5(c) => Box::new(qwen3_5::load(c, weights, options)?),
        })
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Config { path: path.to_path_buf(), message: format!("not valid JSON: {e}") })
}

fn parse<T: DeserializeOwned>(config: &Value, path: &Path) -> Result<T> {
    serde_json::from_value(config.clone()).map_err(|e| Error::Config {
        path: path.to_path_buf(),
        message: format!("{e} (the key is required by this architecture, with this type)"),
    })
}

/// The default quantization and the per-module overrides.
type QuantizationConfig = (Option<Quantization>, HashMap<String, Option<Quantization>>);

/// `config.json`'s `quantization` (MLX) section: defaults plus per-module overrides.
fn quantization(config: &Value, path: &Path) -> Result<QuantizationConfig> {
    let Some(section) = config.get("quantization").or_else(|| config.get("quantization_config")) else {
        return Ok((None, HashMap::new()));
    };
    let read = |v: &Value| -> Result<Quantization> {
        let field = |k: &str| {
            v.get(k).and_then(Value::as_i64).map(|x| x as i32).ok_or_else(|| Error::Config {
                path: path.to_path_buf(),
                message: format!("quantization section needs an integer `{k}`"),
            })
        };
        // As mlx-lm reads it: a module's own entry without `mode` is affine, whatever the
        // default's mode.
        let mode = match v.get("mode").and_then(Value::as_str) {
            None => QuantMode::Affine,
            Some(name) => QuantMode::parse(name).ok_or_else(|| Error::Config {
                path: path.to_path_buf(),
                message: format!("quantization mode {name:?} is not supported; supported: {}", QuantMode::NAMES),
            })?,
        };
        Ok(Quantization { group_size: field("group_size")?, bits: field("bits")?, mode })
    };
    let default = read(section)?;
    let mut overrides = HashMap::new();
    if let Value::Object(map) = section {
        for (k, v) in map {
            match v {
                Value::Object(_) => {
                    overrides.insert(k.clone(), Some(read(v)?));
                }
                Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                _ => {}
            }
        }
    }
    Ok((Some(default), overrides))
}

fn eos_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

fn build(
    source: &Path,
    arch: Arch,
    config: &Value,
    generation: Value,
    mut weights: Weights,
    tokenizer: Tokenizer,
    options: &LoadOptions,
) -> Result<Loaded> {
    // Sanitize as mlx-lm does: precomputed rotary tables are unused; tied heads are dropped.
    let unused: Vec<String> = weights.names().filter(|n| n.contains("rotary_emb.inv_freq")).cloned().collect();
    for n in unused {
        weights.remove(&n);
    }
    // GPT-OSS has its own head whatever the config says (mlx-lm's model always makes one);
    // Qwen3.5's is untied unless the config ties it.
    let tie = config.get("tie_word_embeddings").and_then(Value::as_bool);
    let tied = match arch {
        Arch::GptOss(_) | Arch::Phi3(_) => false,
        Arch::Qwen3_5(_) => tie.unwrap_or(false),
        _ => tie.unwrap_or(true),
    };
    if tied {
        weights.remove("lm_head.weight");
    }
    if let Some(g) = options.pipeline.filter(|g| g.size > 1) {
        arch.check_pipeline(g.size)?;
    }
    let model = arch.model(&mut weights, options)?;
    // Materialize every weight now, as mlx-lm's `load` does: read errors surface here, and
    // the first request does not pay for reading the file.
    weights.eval()?;
    let mut eos = eos_ids(config.get("eos_token_id"));
    eos.extend(eos_ids(generation.get("eos_token_id")));
    eos.extend(tokenizer.eos_token_id());
    eos.sort_unstable();
    eos.dedup();
    if eos.is_empty() {
        return Err(Error::Config {
            path: source.to_path_buf(),
            message:
                "no eos_token_id in config.json or generation_config.json and no eos_token in the tokenizer config"
                    .into(),
        });
    }
    // The cache holds keys and values in the activation dtype: the embedding's (or, when
    // it is quantized, its scales').
    let act = weights.get("model.embed_tokens.scales").or_else(|_| weights.get("model.embed_tokens.weight"))?.dtype();
    // A tensor-parallel rank holds its share of the heads, a pipeline stage its layers'.
    let kv_features = arch.kv_features() / options.tensor_parallel.map_or(1, |g| g.size);
    let kv_features = match options.pipeline.filter(|g| g.size > 1) {
        Some(_) => kv_features / arch.stage_layers().unwrap_or(1).max(1) * model.make_cache().len(),
        None => kv_features,
    };
    let embedding: usize = weights
        .names()
        .filter(|n| n.starts_with("model.embed_tokens."))
        .map(|n| weights.get(n).map(|a| a.nbytes()))
        .sum::<Result<usize>>()?;
    let untied = weights.get("lm_head.weight").is_ok() || weights.get("lm_head.scales").is_ok();
    let mut per_token =
        if untied { weights.nbytes() - embedding + embedding / model.vocab_size().max(1) } else { weights.nbytes() };
    // Gemma 4's per-layer embedding: a token reads its own row.
    for name in weights.names().filter(|n| n.starts_with("model.embed_tokens_per_layer.")) {
        let bytes = weights.get(name)?.nbytes();
        per_token -= bytes - bytes / weights.get(name)?.dim(0).max(1);
    }
    // A token reads only its own experts' weights.
    if let Some((k, experts)) = arch.active_experts() {
        let expert_bytes: usize = weights
            .names()
            .filter(|n| n.contains(".switch_mlp.") || n.contains(".mlp.experts.") || n.contains(".experts.switch_glu."))
            .map(|n| weights.get(n).map(|a| a.nbytes()))
            .sum::<Result<usize>>()?;
        per_token -= expert_bytes - expert_bytes * k / experts.max(1);
    }
    let info = ModelInfo {
        model_type: arch.name().to_string(),
        source: source.to_path_buf(),
        eos_token_ids: eos,
        bos_token_id: config.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
        weight_bytes: weights.nbytes(),
        weight_bytes_per_token: per_token,
        n_layers: model.make_cache().len(),
        recurrent_layers: model.make_cache().iter().filter(|c| c.is_recurrent()).count(),
        recurrent_state_bytes: match &arch {
            Arch::Qwen3_5(c) => c.recurrent_state_bytes(act.size()),
            _ => 0,
        },
        vocab_size: model.vocab_size(),
        max_position_embeddings: config.get("max_position_embeddings").and_then(Value::as_u64).map(|x| x as usize),
        kv_bytes_per_token: 2 * kv_features * act.size(),
    };
    Ok(Loaded { model, tokenizer, info })
}
