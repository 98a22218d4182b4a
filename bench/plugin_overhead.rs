//! Per-token cost of sampler plugins next to the native sampler, same model, same run.
//!
//!     cargo run --release -p host --example plugin_overhead -- MODEL CANDIDATE.wasm FULL.wasm [TOKENS] [RUNS]
//!
//! CANDIDATE.wasm is a candidate-tier sampler (e.g. examples/rust-sampler, top-64 candidates),
//! FULL.wasm a full-vocabulary one (e.g. bench/plugins/argmax-full.wat, assembled with
//! `host plugins build-wat`). Each generates TOKENS greedy-equivalent tokens from the same
//! prompt; the table shows the median decode time per token over RUNS runs, the overhead
//! against native sampling in microseconds and as % of a native decode step. The plugin paths
//! also lose the pipelining of the native loop (each step's logits are read back before the
//! next step is built), which is part of what they cost.

use anyhow::{Context, Result};
use host::engine::{DecodeOptions, ExternalSampler, Generation, Sampler, SamplingParams};
use host::engine::{Frame, Hooks, Pick};
use host::plugins::{PluginRegistry, PluginSampler};
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
    host::generate::select_device(host::generate::DeviceChoice::Auto)?;
    let loaded = host::generate::load_model(Some(&PathBuf::from(model)))?;
    let prompt = host::generate::prompt_tokens(&loaded, b"Write a long story about a dragon.", None, false)?;
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
            let external: Option<Box<dyn ExternalSampler>> = match plugin {
                None => None,
                Some(p) => {
                    let selected = host::plugins::Selected {
                        plugin: p.clone(),
                        config: config.clone(),
                        params: serde_json::json!({}),
                        fallback: false,
                    };
                    let mut instance = registry.start(&selected, 1)?;
                    instance.accept(&prompt)?;
                    Some(Box::new(Timed {
                        inner: PluginSampler::new(instance, loaded.info.vocab_size),
                        seconds: in_plugin.clone(),
                    }))
                }
            };
            let sampler = Sampler::new(SamplingParams::default(), loaded.info.vocab_size)?;
            let options = DecodeOptions { max_tokens: tokens, eos_token_ids: vec![], prefill_step_size: 2048 };
            let mut g = Generation::start_with(
                loaded.model.as_ref(),
                loaded.model.make_cache(),
                &prompt,
                sampler,
                options,
                Hooks { external, speculation: None },
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
