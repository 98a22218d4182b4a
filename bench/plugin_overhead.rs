//! Per-token cost of sampler plugins next to the native sampler, same model, same run.
//!
//!     cargo run --release -p host --example plugin_overhead -- MODEL CANDIDATE.wasm FULL.wasm [TOKENS] [RUNS] [BATCH]
//!
//! CANDIDATE.wasm is a candidate-tier sampler (e.g. examples/rust-sampler, top-64 candidates),
//! FULL.wasm a full-vocabulary one (e.g. bench/plugins/argmax-full.wat, assembled with
//! `host plugins build-wat`). Each generates TOKENS greedy-equivalent tokens from the same
//! prompt; the table shows the median decode time per token over RUNS runs, the overhead
//! against native sampling in microseconds and as % of a native decode step. The plugin paths
//! also lose the pipelining of the native loop (each step's logits are read back before the
//! next step is built), which is part of what they cost.
//!
//! With BATCH (e.g. 8), a second table: the server's batch step (`engine::batch::Batch`) with
//! BATCH rows of different prompts, all sampled natively, then with one row, then with every
//! row, sampled by each plugin. The batch reads back the candidates of all its plugin rows in
//! one host round trip per step, so one plugin row costs the step that round trip and the lost
//! pipelining, and more plugin rows add only their calls.

use anyhow::{Context, Result};
use host::engine::{DecodeOptions, ExternalSampler, Generation, Sampler, SamplingParams};
use host::engine::{Frame, Hooks, Pick};
use host::plugins::adapters::PluginSampler;
use host::plugins::PluginRegistry;
use std::cell::Cell;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

/// Times the plugin calls themselves (frame copy in and out, the Wasm call).
struct Timed {
    inner: PluginSampler,
    seconds: Rc<Cell<f64>>,
}

impl ExternalSampler for Timed {
    fn candidates(&self) -> Option<usize> {
        self.inner.candidates()
    }
    fn sample(&mut self, position: usize, frame: Frame<'_>) -> Result<Pick> {
        let start = Instant::now();
        let pick = self.inner.sample(position, frame);
        self.seconds.set(self.seconds.get() + start.elapsed().as_secs_f64());
        pick
    }
    fn accept(&mut self, tokens: &[u32]) -> Result<()> {
        self.inner.accept(tokens)
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, candidate, full, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: plugin_overhead MODEL CANDIDATE.wasm FULL.wasm [TOKENS] [RUNS]");
    };
    let tokens: usize = rest.first().map(|s| s.parse()).transpose()?.unwrap_or(64);
    let runs: usize = rest.get(1).map(|s| s.parse()).transpose()?.unwrap_or(5);
    host::load::select_device(host::load::DeviceChoice::Auto)?;
    let loaded = host::load::load_model(Some(&PathBuf::from(model)))?;
    let prompt = host::cli::generate::prompt_tokens(&loaded, b"Write a long story about a dragon.", None, false)?;
    let registry = PluginRegistry::new()?;
    let cand = registry.load_file(&PathBuf::from(candidate)).context("loading the candidate-tier plugin")?;
    let full = registry.load_file(&PathBuf::from(full)).context("loading the full-vocabulary plugin")?;
    let config = serde_json::json!({"n": 0.0001});

    // Median seconds per decoded token (after the first), and per plugin call, for one setup.
    let measure = |plugin: Option<&std::sync::Arc<host::plugins::runtime::Plugin>>| -> Result<(f64, f64)> {
        let mut per_token = Vec::new();
        let mut per_call = Vec::new();
        for _ in 0..runs + 1 {
            let in_plugin = Rc::new(Cell::new(0.0));
            let external = plugin
                .map(|p| timed_sampler(&registry, p, &config, &prompt, loaded.info.vocab_size, &in_plugin))
                .transpose()?;
            let sampler = Sampler::new(SamplingParams::default(), loaded.info.vocab_size)?;
            let options = DecodeOptions { max_tokens: tokens, eos_token_ids: vec![], prefill_step_size: 2048 };
            let mut g = Generation::start_with(
                loaded.model.as_ref(),
                loaded.model.make_cache(),
                &prompt,
                sampler,
                options,
                Hooks { external, speculation: None, constraint: None },
            )?;
            g.next_token()?.context("no first token")?;
            let before = in_plugin.get();
            let start = Instant::now();
            let mut n = 0;
            while g.next_token()?.is_some() {
                n += 1;
            }
            per_token.push(start.elapsed().as_secs_f64() / n as f64);
            per_call.push((in_plugin.get() - before) / n as f64);
        }
        per_token.remove(0); // Warm-up run.
        per_call.remove(0);
        per_token.sort_by(f64::total_cmp);
        per_call.sort_by(f64::total_cmp);
        Ok((per_token[per_token.len() / 2], per_call[per_call.len() / 2]))
    };
    if let Some(b) = rest.get(2).map(|s| s.parse::<usize>()).transpose()? {
        batched(
            &loaded,
            &registry,
            &[("candidate-tier plugin (top-64)", &cand), ("full-vocabulary plugin", &full)],
            &config,
            b,
            tokens,
            runs,
        )?;
        println!();
    }
    let (native, _) = measure(None)?;
    let (cand_t, cand_call) = measure(Some(&cand))?;
    let (full_t, full_call) = measure(Some(&full))?;
    let rows = [
        ("native sampler (greedy, on device)", native, None),
        ("candidate-tier plugin (top-64)", cand_t, Some(cand_call)),
        ("full-vocabulary plugin", full_t, Some(full_call)),
    ];
    println!(
        "model {model}; {} prompt tokens; {tokens} tokens per run; median of {runs} runs; device {}",
        prompt.len(),
        mlx::Device::default_device()
    );
    println!();
    println!("| sampler | ms / token | tok/s | plugin call µs / token | call % of a native step | end-to-end overhead µs / token |");
    println!("|---|---|---|---|---|---|");
    for (name, t, call) in rows {
        let dash = || "-".to_string();
        println!(
            "| {name} | {:.3} | {:.1} | {} | {} | {} |",
            t * 1e3,
            1.0 / t,
            call.map_or_else(dash, |c| format!("{:.1}", c * 1e6)),
            call.map_or_else(dash, |c| format!("{:.2}%", c / native * 100.0)),
            call.map_or_else(dash, |_| format!("{:.0}", (t - native) * 1e6)),
        );
    }
    Ok(())
}

/// An instance of `plugin` that has accepted `prompt`, its calls' time added to `seconds`.
fn timed_sampler(
    registry: &PluginRegistry,
    plugin: &std::sync::Arc<host::plugins::runtime::Plugin>,
    config: &serde_json::Value,
    prompt: &[u32],
    vocab: usize,
    seconds: &Rc<Cell<f64>>,
) -> Result<Box<dyn ExternalSampler>> {
    let selected = host::plugins::Selected {
        plugin: plugin.clone(),
        config: config.clone(),
        params: serde_json::json!({}),
        fallback: false,
    };
    let mut instance = registry.start(&selected, 1)?;
    instance.accept(prompt)?;
    Ok(Box::new(Timed { inner: PluginSampler::new(instance, vocab), seconds: seconds.clone() }))
}

/// The batch table: median ms per step and plugin µs per step for `b` rows with 0, 1 and `b`
/// plugin rows, for each plugin.
fn batched(
    loaded: &models::Loaded,
    registry: &PluginRegistry,
    plugins: &[(&str, &std::sync::Arc<host::plugins::runtime::Plugin>)],
    config: &serde_json::Value,
    b: usize,
    tokens: usize,
    runs: usize,
) -> Result<()> {
    use host::engine::batch::{Batch, Row};
    let model = loaded.model.as_ref();
    let vocab = loaded.info.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|i| {
            let text = format!("Write a long story about dragon number {i}.");
            host::cli::generate::prompt_tokens(loaded, text.as_bytes(), None, false)
        })
        .collect::<Result<_>>()?;
    // (seconds per step after the first, plugin seconds per step) for `k` plugin rows.
    let measure = |plugin: Option<&std::sync::Arc<host::plugins::runtime::Plugin>>, k: usize| -> Result<(f64, f64)> {
        let mut per_step = Vec::new();
        let mut per_call = Vec::new();
        for _ in 0..runs + 1 {
            let in_plugin = Rc::new(Cell::new(0.0));
            let mut batch = Batch::new(model);
            for (key, prompt) in prompts.iter().enumerate() {
                let mut cache = model.make_cache();
                host::engine::step::prefill(model, &mut cache, &prompt[..prompt.len() - 1], 2048)?;
                let external = plugin
                    .filter(|_| key < k)
                    .map(|p| timed_sampler(registry, p, config, prompt, vocab, &in_plugin))
                    .transpose()?;
                let sampler = Sampler::new(SamplingParams::default(), vocab)?;
                let options = DecodeOptions { max_tokens: tokens, eos_token_ids: vec![], prefill_step_size: 2048 };
                batch.join(Row::new(key as u64, prompt, sampler, options)?.with_external(external), &cache)?;
            }
            batch.step()?;
            let before = in_plugin.get();
            let start = Instant::now();
            let mut steps = 0;
            while !batch.is_empty() {
                let out = batch.step()?;
                steps += !out.is_empty() as usize;
                for (key, token) in out {
                    if token?.finish.is_some() {
                        batch.leave(key)?;
                    }
                }
            }
            per_step.push(start.elapsed().as_secs_f64() / steps.max(1) as f64);
            per_call.push((in_plugin.get() - before) / steps.max(1) as f64);
        }
        per_step.remove(0); // Warm-up run.
        per_call.remove(0);
        per_step.sort_by(f64::total_cmp);
        per_call.sort_by(f64::total_cmp);
        Ok((per_step[per_step.len() / 2], per_call[per_call.len() / 2]))
    };
    let (native, _) = measure(None, 0)?;
    println!(
        "batch of {b} rows ({} to {} prompt tokens); {tokens} tokens per row; median of {runs} runs; device {}",
        prompts.iter().map(Vec::len).min().unwrap_or(0),
        prompts.iter().map(Vec::len).max().unwrap_or(0),
        mlx::Device::default_device()
    );
    println!();
    println!("| rows sampled by a plugin | plugin | ms / step | rows x tok/s | plugin calls µs / step | step cost over all-native, µs |");
    println!("|---|---|---|---|---|---|");
    println!("| 0 of {b} | - | {:.3} | {:.1} | - | - |", native * 1e3, b as f64 / native);
    for (name, plugin) in plugins {
        for k in [1, b] {
            let (t, call) = measure(Some(plugin), k)?;
            println!(
                "| {k} of {b} | {name} | {:.3} | {:.1} | {:.1} | {:.0} |",
                t * 1e3,
                b as f64 / t,
                call * 1e6,
                (t - native) * 1e6
            );
        }
    }
    Ok(())
}
