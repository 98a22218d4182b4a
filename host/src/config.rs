//! `ServeConfig`: settings of `host serve`, from an optional TOML file (`--config`) with CLI
//! flags on top. Defaults live in one place, `Default for ServeConfig`.

use crate::engine::speculative::{SpecConfig, SpecMethod, Verify};
use crate::load::{DeviceChoice, Split};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Settings for `host serve`. Every field is optional in the TOML file.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// A Hugging Face folder or .gguf file. Default: the built-in SmolLM2-135M-Instruct.
    pub model: Option<PathBuf>,
    /// Address to listen on. Default: 127.0.0.1 (loopback only).
    pub host: IpAddr,
    /// Default: 8080; 0 picks a free port (printed at start).
    pub port: u16,
    /// Required bearer token / x-api-key, if set. Default: none (or $HOST_API_KEY).
    pub api_key: Option<String>,
    /// Host names (besides IP addresses and `localhost`) the server answers to, e.g. the
    /// machine's name on the LAN; `"*"`: any. Default: none (a guard against DNS rebinding).
    pub allowed_hosts: Vec<String>,
    /// Web origins whose pages may call the server (CORS), e.g. `"http://localhost:3000"`;
    /// `"*"`: any. Default: none (cross-origin browser requests are refused).
    pub cors_origins: Vec<String>,
    /// Default: auto (the GPU when there is one).
    pub device: DeviceChoice,
    /// Requests waiting beyond the running ones; more get 429. Default: 64.
    pub queue_limit: usize,
    /// Most requests decoded at once (rows of one batch step). Default: 32.
    pub max_batch: usize,
    /// Prompt tokens prefilled between two decode steps of the batch (less one per running
    /// row), so a long prompt joins in chunks without stalling running streams. Default: 512.
    pub step_token_budget: usize,
    /// Bytes of KV cache kept for prefix reuse across requests. Default: 1 GiB.
    #[serde(deserialize_with = "bytes")]
    pub prompt_cache_bytes: u64,
    /// Bytes the model and one request's KV cache may use; requests that cannot fit get 400.
    /// Default: 80% of GPU memory, or 60% of system RAM on the CPU.
    #[serde(deserialize_with = "opt_bytes")]
    pub memory_budget: Option<u64>,
    /// The longest sequence (prompt + completion) a request may have, in tokens. Default: the
    /// model's context length (its config's `max_position_embeddings`, a GGUF's
    /// `context_length`); longer is allowed, with a warning (past its training the model's
    /// output degrades).
    pub context_length: Option<usize>,
    /// Largest request body. Default: 4 MiB.
    #[serde(deserialize_with = "bytes")]
    pub max_body_bytes: u64,
    /// max_tokens when a request gives none. Default: 2048.
    pub default_max_tokens: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM. Default: 10.
    pub shutdown_grace_secs: u64,
    /// Seconds a client has to send a request's headers; slower connections are closed.
    /// Default: 30.
    pub header_timeout_secs: u64,
    /// Seconds a client has to send a request's body once its headers are in; then 408.
    /// Default: 60.
    pub body_timeout_secs: u64,
    /// Open connections at most; more are closed as they arrive (logged). Default: 1024.
    pub max_connections: usize,
    /// Folder of `*.wasm` plugins loaded at start and watched for changes. Default: none.
    pub plugins: Option<PathBuf>,
    /// Plugins for requests that carry no `plugins` field (same shape as that field).
    /// Default: none.
    pub default_plugins: Option<crate::plugins::request::PluginsField>,
    /// A draft model for speculative decoding (must share the model's tokenizer). Default: none.
    pub draft_model: Option<PathBuf>,
    /// Speculative decoding for requests that do not choose: off, prompt-lookup or draft.
    /// Default: draft with a draft model, else off.
    pub speculative: Option<SpecMethod>,
    /// The most tokens drafted per step. Default: 8.
    pub num_draft_tokens: Option<usize>,
    /// exact (token-identical to plain decoding) or lossless (rejection sampling). Default: exact.
    pub speculative_verify: Option<Verify>,
    /// Prompt lookup with greedy decoding: continuations verified per step as one batch.
    /// Default: 1.
    pub draft_candidates: Option<usize>,
    /// The tool-call adapter plugin for requests with tools (e.g. "hermes"); "none" turns
    /// parsing off. Default: chosen from the model's chat template.
    pub tool_adapter: Option<String>,
    /// Hold every tool call the model starts on its own to its tool's schema (the tool
    /// adapter's lazy grammar, from the call's opening to its end), not only forced calls and
    /// `strict: true` tools' calls. Default: false.
    pub constrain_tool_calls: bool,
    /// Serve the built-in web page (chat and plugin console) at `/` to browsers. Default: true.
    pub ui: bool,
    /// The reasoning-parser plugin that splits a thinking model's reasoning from its answer
    /// on chat routes (e.g. "think"); "none" leaves the thinking in the text. Default:
    /// chosen from the model's chat template (`<think>` or `[THINK]`: think).
    pub reasoning_parser: Option<String>,
    /// The scheduling-policy plugin ordering the queue: fcfs, priority,
    /// shortest-prompt-first, latest-wins, fair or a user plugin. Default: fcfs.
    pub scheduler: String,
    /// Config for the scheduling policy's `host_init`. Default: none (`{}`).
    pub scheduler_config: Option<serde_json::Value>,
    /// Split the model over this many processes (tensor parallel over MLX distributed: the
    /// ring backend on CPUs, NCCL on GPUs). Default: 1 (off).
    pub tensor_parallel: usize,
    /// Split the model's layers into this many pipeline stages (each of `tensor_parallel`
    /// processes, one per shard). Default: 1 (off).
    pub pipeline_parallel: usize,
    /// MLX's hostfile: the model split over the hosts it lists, one rank each (this one is
    /// rank 0; the others run `host tp-worker --hostfile`). Default: none (this machine).
    pub hostfile: Option<PathBuf>,
    /// The port the ranks of a hostfile listen on from. Default: 32323.
    pub starting_port: Option<u16>,
    /// Start the hostfile's other ranks over ssh (`ssh NAME BINARY tp-worker ...`, as
    /// mlx.launch does) instead of waiting for them to be started by hand. Default: false.
    pub ssh_launch: bool,
    /// Generate a few tokens before serving so kernels compile at start, not in the first
    /// requests. Default: on for GPUs, off on the CPU.
    pub warm_up: Option<bool>,
    /// Per-model overrides, keyed by model id (the model folder's or file's name), e.g.
    /// `[models.SmolLM2-135M-Instruct] tool_adapter = "hermes"`.
    pub models: std::collections::BTreeMap<String, ModelDefaults>,
}

/// Settings that apply only when the server runs a given model; each replaces the global one.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelDefaults {
    pub default_plugins: Option<crate::plugins::request::PluginsField>,
    pub tool_adapter: Option<String>,
    pub reasoning_parser: Option<String>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            model: None,
            host: IpAddr::from([127, 0, 0, 1]),
            port: 8080,
            api_key: None,
            allowed_hosts: Vec::new(),
            cors_origins: Vec::new(),
            device: DeviceChoice::Auto,
            queue_limit: 64,
            max_batch: 32,
            step_token_budget: 512,
            prompt_cache_bytes: 1 << 30,
            memory_budget: None,
            context_length: None,
            max_body_bytes: 4 << 20,
            default_max_tokens: 2048,
            shutdown_grace_secs: 10,
            header_timeout_secs: 30,
            body_timeout_secs: 60,
            max_connections: 1024,
            plugins: None,
            default_plugins: None,
            draft_model: None,
            speculative: None,
            num_draft_tokens: None,
            speculative_verify: None,
            draft_candidates: None,
            tool_adapter: None,
            constrain_tool_calls: false,
            ui: true,
            reasoning_parser: None,
            scheduler: "fcfs".into(),
            scheduler_config: None,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            hostfile: None,
            starting_port: None,
            ssh_launch: false,
            warm_up: None,
            models: Default::default(),
        }
    }
}

/// Parses `1048576`, `512K`, `64MiB`, `2G`, `1.5GB` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 =
        num.parse().with_context(|| format!("{s:?} is not a size; use e.g. 512M, 2G or a number of bytes"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => bail!("unknown size unit {other:?} in {s:?}; use K, M, G or T"),
    };
    Ok((value * scale as f64) as u64)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Number(u64),
    Text(String),
}

fn bytes<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    match Size::deserialize(d)? {
        Size::Number(n) => Ok(n),
        Size::Text(s) => parse_bytes(&s).map_err(serde::de::Error::custom),
    }
}

fn opt_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<u64>, D::Error> {
    bytes(d).map(Some)
}

/// Flags of `host serve`; each overrides the same key of the config file.
#[derive(Debug, Default, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with any of the settings below (unknown keys are an error).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A Hugging Face model folder or a .gguf file (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1).
    #[arg(long)]
    pub host: Option<IpAddr>,
    /// Port (default 8080; 0 picks a free one).
    #[arg(long)]
    pub port: Option<u16>,
    /// Require this key (Authorization: Bearer or x-api-key).
    #[arg(long, env = "HOST_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A host name the server answers to besides IP addresses and localhost (repeatable;
    /// "*" for any).
    #[arg(long = "allowed-host")]
    pub allowed_hosts: Vec<String>,
    /// A web origin whose pages may call the server, e.g. http://localhost:3000 (repeatable;
    /// "*" for any).
    #[arg(long = "cors-origin")]
    pub cors_origins: Vec<String>,
    #[arg(long, value_enum)]
    pub device: Option<DeviceChoice>,
    /// Waiting requests beyond which new ones get 429 (default 64).
    #[arg(long)]
    pub queue_limit: Option<usize>,
    /// Most requests decoded at once, as rows of one batch (default 32).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Prompt tokens prefilled between two batch steps (default 512).
    #[arg(long)]
    pub step_token_budget: Option<usize>,
    /// KV cache kept for prefix reuse, e.g. 512M (default 1G).
    #[arg(long, value_parser = parse_bytes)]
    pub prompt_cache_bytes: Option<u64>,
    /// Memory the model and a request may use, e.g. 8G (default: a safe fraction of the device's).
    #[arg(long, value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
    /// The longest prompt + completion in tokens (default: the model's context length).
    #[arg(long)]
    pub context_length: Option<usize>,
    /// Largest request body, e.g. 4M (default 4M).
    #[arg(long, value_parser = parse_bytes)]
    pub max_body_bytes: Option<u64>,
    /// max_tokens for requests that give none (default 2048).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// Folder of *.wasm plugins (ABI v1, see plugin-sdk/ABI.md).
    #[arg(long)]
    pub plugins: Option<PathBuf>,
    /// The scheduling-policy plugin (default fcfs; also priority, shortest-prompt-first,
    /// latest-wins, fair).
    #[arg(long)]
    pub scheduler: Option<String>,
    /// The tool-call adapter for requests with tools (default: chosen from the chat
    /// template; "none" leaves tool calls in the text).
    #[arg(long)]
    pub tool_adapter: Option<String>,
    /// Hold every tool call the model starts to its tool's schema (default: only forced
    /// calls and `strict: true` tools' calls).
    #[arg(long)]
    pub constrain_tool_calls: bool,
    /// Serve no web page: `GET /` answers JSON to browsers too (`ui = false` in host.toml).
    #[arg(long)]
    pub no_ui: bool,
    /// The reasoning parser for chat replies (default: chosen from the chat template;
    /// "none" leaves the model's thinking in the text).
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    #[command(flatten)]
    pub split: SplitArgs,
    /// Compile kernels before serving with a short generation (default: true on GPUs).
    #[arg(long)]
    pub warm_up: Option<bool>,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// How the model is split over processes and hosts (`serve`, `generate`, `bench`; for
/// `serve` host.toml may set each too, and a flag given overrides it).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct SplitArgs {
    /// Split the model over this many processes (tensor parallel; with --pipeline-parallel,
    /// the processes of each stage; default 1: off).
    #[arg(long)]
    pub tensor_parallel: Option<usize>,
    /// Split the model's layers into this many stages (pipeline parallel; one activation a
    /// step between neighbours: for slow links; default 1: off). With --tensor-parallel T,
    /// stages x T processes: rank r is shard r % T of stage r / T.
    #[arg(long)]
    pub pipeline_parallel: Option<usize>,
    /// Split the model over the hosts of this hostfile (MLX's format), one rank each: this
    /// host is the first; start `host tp-worker --hostfile FILE --rank R` on the others.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// With --hostfile: the port the ranks listen on from (default 32323).
    #[arg(long)]
    pub starting_port: Option<u16>,
    /// With --hostfile: start the other ranks over ssh, each by the host's "ssh" name (the
    /// same binary path on every host; HOST_SSH overrides the ssh command and its options).
    #[arg(long)]
    pub ssh_launch: bool,
}

impl SplitArgs {
    pub fn split(&self) -> Split {
        Split {
            tensor_parallel: self.tensor_parallel.unwrap_or(1),
            pipeline_parallel: self.pipeline_parallel.unwrap_or(1),
            hostfile: self.hostfile.clone(),
            starting_port: self.starting_port,
            ssh_launch: self.ssh_launch,
        }
    }
}

impl ServeConfig {
    pub fn split(&self) -> Split {
        Split {
            tensor_parallel: self.tensor_parallel,
            pipeline_parallel: self.pipeline_parallel,
            hostfile: self.hostfile.clone(),
            starting_port: self.starting_port,
            ssh_launch: self.ssh_launch,
        }
    }
}

/// Speculative decoding flags (`host generate` and `host serve`).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct SpecArgs {
    /// A draft model (HF folder or .gguf) sharing the model's tokenizer; implies --speculative draft.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// Speculative decoding: off, prompt-lookup (drafts from n-grams of the prompt and
    /// output) or draft (the --draft-model). Default: draft with a draft model, else off.
    #[arg(long, value_enum)]
    pub speculative: Option<SpecMethod>,
    /// The most tokens drafted per step; the draft length adapts below it (default 8).
    #[arg(long)]
    pub num_draft_tokens: Option<usize>,
    /// exact: token-identical to plain decoding with the same seed; lossless: rejection
    /// sampling (same distribution, more accepted drafts; native samplers only).
    #[arg(long, value_enum)]
    pub speculative_verify: Option<Verify>,
    /// Prompt lookup with greedy decoding: how many different continuations to verify per
    /// step, as rows of one batch (default 1; more raise acceptance, each step costs more).
    #[arg(long)]
    pub draft_candidates: Option<usize>,
}

impl SpecArgs {
    /// The speculative settings, with the defaults filled in.
    pub fn config(&self) -> Result<SpecConfig> {
        let defaults = SpecConfig::default();
        let has_draft = self.draft_model.is_some();
        let method = self.speculative.unwrap_or(if has_draft { SpecMethod::Draft } else { SpecMethod::Off });
        if method == SpecMethod::Draft && !has_draft {
            bail!("--speculative draft needs --draft-model PATH (a model sharing the tokenizer), or use prompt-lookup");
        }
        let config = SpecConfig {
            method,
            num_draft_tokens: self.num_draft_tokens.unwrap_or(defaults.num_draft_tokens),
            verify: self.speculative_verify.unwrap_or_default(),
            candidates: self.draft_candidates,
            ..defaults
        };
        config.validate()?;
        Ok(config)
    }
}

impl ServeConfig {
    /// The file's settings (if any) with the flags applied on top.
    pub fn resolve(args: &ServeArgs) -> Result<ServeConfig> {
        let mut config = match &args.config {
            Some(path) => Self::from_file(path)?,
            None => ServeConfig::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = args.$field.clone() { config.$field = v.into(); } )* };
        }
        set!(
            host,
            port,
            device,
            queue_limit,
            max_batch,
            step_token_budget,
            prompt_cache_bytes,
            max_body_bytes,
            default_max_tokens
        );
        if args.model.is_some() {
            config.model = args.model.clone();
        }
        if args.plugins.is_some() {
            config.plugins = args.plugins.clone();
        }
        if args.warm_up.is_some() {
            config.warm_up = args.warm_up;
        }
        let split = &args.split;
        config.tensor_parallel = split.tensor_parallel.unwrap_or(config.tensor_parallel);
        config.pipeline_parallel = split.pipeline_parallel.unwrap_or(config.pipeline_parallel);
        if split.hostfile.is_some() {
            config.hostfile = split.hostfile.clone();
        }
        config.starting_port = split.starting_port.or(config.starting_port);
        config.ssh_launch |= split.ssh_launch;
        if let Some(s) = &args.scheduler {
            config.scheduler = s.clone();
        }
        if args.tool_adapter.is_some() {
            config.tool_adapter = args.tool_adapter.clone();
        }
        if args.reasoning_parser.is_some() {
            config.reasoning_parser = args.reasoning_parser.clone();
        }
        if args.constrain_tool_calls {
            config.constrain_tool_calls = true;
        }
        if args.no_ui {
            config.ui = false;
        }
        config.allowed_hosts.extend(args.allowed_hosts.iter().cloned());
        config.cors_origins.extend(args.cors_origins.iter().cloned());
        if args.api_key.is_some() {
            config.api_key = args.api_key.clone();
        }
        if args.context_length.is_some() {
            config.context_length = args.context_length;
        }
        if config.context_length == Some(0) {
            bail!("`context_length` (--context-length) must be at least 1 token; leave it out to use the model's");
        }
        if args.memory_budget.is_some() {
            config.memory_budget = args.memory_budget;
        }
        if args.spec.draft_model.is_some() {
            config.draft_model = args.spec.draft_model.clone();
        }
        if args.spec.speculative.is_some() {
            config.speculative = args.spec.speculative;
        }
        if args.spec.num_draft_tokens.is_some() {
            config.num_draft_tokens = args.spec.num_draft_tokens;
        }
        if args.spec.speculative_verify.is_some() {
            config.speculative_verify = args.spec.speculative_verify;
        }
        if args.spec.draft_candidates.is_some() {
            config.draft_candidates = args.spec.draft_candidates;
        }
        if config.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            bail!("the API key (--api-key, $HOST_API_KEY or api_key) is empty: give a key, or leave it unset to serve without one");
        }
        if config.max_batch == 0 {
            bail!("`max_batch` (--max-batch) must be at least 1, got 0; 1 serves one request at a time");
        }
        if config.step_token_budget == 0 {
            bail!("`step_token_budget` (--step-token-budget) must be at least 1, got 0 (default 512)");
        }
        Ok(config)
    }

    /// The settings for model `id`: its `[models.ID]` entries over the global ones.
    pub fn for_model(&self, id: &str) -> ServeConfig {
        let mut config = self.clone();
        if let Some(m) = self.models.get(id) {
            if m.default_plugins.is_some() {
                config.default_plugins = m.default_plugins.clone();
            }
            if m.tool_adapter.is_some() {
                config.tool_adapter = m.tool_adapter.clone();
            }
            if m.reasoning_parser.is_some() {
                config.reasoning_parser = m.reasoning_parser.clone();
            }
        }
        config
    }

    /// The server's default speculative settings.
    pub fn spec(&self) -> Result<SpecConfig> {
        SpecArgs {
            draft_model: self.draft_model.clone(),
            speculative: self.speculative,
            num_draft_tokens: self.num_draft_tokens,
            speculative_verify: self.speculative_verify,
            draft_candidates: self.draft_candidates,
        }
        .config()
    }

    pub fn from_file(path: &Path) -> Result<ServeConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.message()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("512K").unwrap(), 512 << 10);
        assert_eq!(parse_bytes("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert!(parse_bytes("12Q").unwrap_err().to_string().contains("unknown size unit"));
    }

    #[test]
    fn batch_settings_of_zero_are_refused_with_the_flag_named() {
        for (args, flag) in [
            (ServeArgs { max_batch: Some(0), ..Default::default() }, "--max-batch"),
            (ServeArgs { step_token_budget: Some(0), ..Default::default() }, "--step-token-budget"),
        ] {
            let e = ServeConfig::resolve(&args).unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains("at least 1"), "{e}");
        }
        let ok = ServeConfig::resolve(&ServeArgs { max_batch: Some(4), ..Default::default() }).unwrap();
        assert_eq!((ok.max_batch, ok.step_token_budget), (4, 512));
    }

    #[test]
    fn the_file_is_strict_and_flags_override_it() {
        let dir = std::env::temp_dir().join(format!("host-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("host.toml");
        std::fs::write(&path, "port = 9000\nqueue_limit = 3\nprompt_cache_bytes = \"256M\"\n").unwrap();
        let args = ServeArgs { config: Some(path.clone()), port: Some(9100), ..Default::default() };
        let c = ServeConfig::resolve(&args).unwrap();
        assert_eq!((c.port, c.queue_limit, c.prompt_cache_bytes), (9100, 3, 256 << 20));
        assert_eq!(c.host.to_string(), "127.0.0.1");
        std::fs::write(&path, "prot = 9000\n").unwrap();
        let err = ServeConfig::resolve(&ServeArgs { config: Some(path), ..Default::default() }).unwrap_err();
        assert!(format!("{err:#}").contains("unknown field `prot`"), "{err:#}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn per_model_sections_override_plugin_settings_for_their_model_only() {
        let text = r#"
            scheduler = "priority"
            scheduler_config = { aging_ms = 250 }
            tool_adapter = "hermes"
            [default_plugins]
            stop = [{ name = "max-sentences" }]
            [models.Qwen3-Coder]
            tool_adapter = "qwen3-coder"
            default_plugins = { sampler = { name = "mirostat", config = { tau = 3.0 } } }
        "#;
        let c: ServeConfig = toml::from_str(text).unwrap();
        assert_eq!(
            (c.scheduler.as_str(), c.scheduler_config.clone()),
            ("priority", Some(serde_json::json!({"aging_ms": 250})))
        );
        let other = c.for_model("SmolLM2");
        assert_eq!(other.tool_adapter.as_deref(), Some("hermes"));
        assert_eq!(other.default_plugins.as_ref().unwrap().stop[0].name, "max-sentences");
        let coder = c.for_model("Qwen3-Coder");
        assert_eq!(coder.tool_adapter.as_deref(), Some("qwen3-coder"));
        let d = coder.default_plugins.unwrap();
        assert_eq!((d.sampler.unwrap().name.as_str(), d.stop.len()), ("mirostat", 0));
        let args = ServeArgs { scheduler: Some("latest-wins".into()), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&args).unwrap().scheduler, "latest-wins");
        assert_eq!(ServeConfig::default().scheduler, "fcfs");
        let bad = toml::from_str::<ServeConfig>("[models.x]\nschedule = 1\n").unwrap_err();
        assert!(bad.message().contains("unknown field `schedule`"), "{}", bad.message());
    }

    #[test]
    fn speculative_settings_resolve_from_file_and_flags_with_clear_errors() {
        let dir = std::env::temp_dir().join(format!("host-config-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("host.toml");
        std::fs::write(
            &path,
            "speculative = \"prompt-lookup\"\nnum_draft_tokens = 5\nspeculative_verify = \"lossless\"\n",
        )
        .unwrap();
        let c = ServeConfig::resolve(&ServeArgs { config: Some(path.clone()), ..Default::default() }).unwrap();
        let spec = c.spec().unwrap();
        assert_eq!((spec.method, spec.num_draft_tokens, spec.verify), (SpecMethod::PromptLookup, 5, Verify::Lossless));
        // A draft model alone turns draft speculation on; a flag overrides the file.
        let args = ServeArgs {
            config: Some(path.clone()),
            spec: SpecArgs {
                draft_model: Some("d".into()),
                speculative: Some(SpecMethod::Draft),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(ServeConfig::resolve(&args).unwrap().spec().unwrap().method, SpecMethod::Draft);
        assert_eq!(ServeConfig::default().spec().unwrap().method, SpecMethod::Off);
        let with_draft = ServeConfig { draft_model: Some("d".into()), ..Default::default() };
        assert_eq!(with_draft.spec().unwrap().method, SpecMethod::Draft);
        std::fs::write(&path, "speculative = \"draft\"\n").unwrap();
        let c = ServeConfig::resolve(&ServeArgs { config: Some(path.clone()), ..Default::default() }).unwrap();
        assert!(c.spec().unwrap_err().to_string().contains("needs --draft-model"));
        std::fs::write(&path, "speculative = \"fast\"\n").unwrap();
        let err = ServeConfig::resolve(&ServeArgs { config: Some(path), ..Default::default() }).unwrap_err();
        assert!(format!("{err:#}").contains("unknown variant `fast`"), "{err:#}");
        let lookup = SpecArgs { speculative: Some(SpecMethod::PromptLookup), ..Default::default() };
        let zero = SpecArgs { num_draft_tokens: Some(0), ..lookup.clone() };
        assert!(zero.config().unwrap_err().to_string().contains("between 1 and 64"));
        let many = SpecArgs { draft_candidates: Some(33), ..lookup };
        assert!(many.config().unwrap_err().to_string().contains("`candidates` must be between 1 and 32"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
