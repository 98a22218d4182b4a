//! `host bench`: loads a model once and measures, per prompt length, prefill tok/s, time to
//! first token, decode tok/s (median of `--runs` after a warm-up that compiles kernels),
//! peak memory, and decode speed against a memory-bandwidth floor (weight bytes read per
//! token / bandwidth). Prompts are seeded random token ids; end of sequence is ignored.
//! `--batch 1,8,32` measures batched decoding instead (`engine::batch::Batch`, the server's
//! engine): B prompts of each length decoded together, aggregate and per-stream decode tok/s;
//! with `--constraint` and `--prompt-file`, B rows answering the prompt, each held to the
//! constraint, each run paired with a plain batch run to the same row lengths.

use super::generate::prompt_tokens;
use crate::engine::speculative::PromptLookup;
use crate::engine::{DecodeOptions, Generation, Hooks, Sampler, SamplingParams, SpecConfig, SpecMethod, Speculation};
use crate::load::{load_draft, load_model_split, select_device, DeviceChoice};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder or a .gguf file (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [128, 512, 4096])]
    pub prompt_lengths: Vec<usize>,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 256)]
    pub gen: usize,
    /// Measured runs per prompt length (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Memory bandwidth in GB/s for the floor; 0 leaves the floor out. (H200: 4221, the
    /// measured device-to-device copy bandwidth.)
    #[arg(long, default_value_t = 0.0)]
    pub bandwidth: f64,
    /// Print one JSON object per prompt length instead of a table.
    #[arg(long)]
    pub json: bool,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Measure this text (through the chat template) instead of random prompts; generation
    /// then stops at end of sequence, and the row carries the generated ids.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    #[command(flatten)]
    pub spec: crate::config::SpecArgs,
    #[command(flatten)]
    pub split: crate::config::SplitArgs,
    /// With speculation: pair every measured run with a plain generation on the same loaded
    /// model (alternating which goes first) and report `plain_decode_tps` and `vs_plain`, the
    /// median of the pairs' ratios. Both sides then share one process, whose speed on the
    /// H200 moves by tens of percent from one process to the next (bench/NOTES.md, session 11).
    #[arg(long)]
    pub paired_plain: bool,
    /// Batch sizes, comma-separated: measure B prompts of each length decoded together as
    /// rows of one batch (as `host serve` runs concurrent requests) instead of one stream.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Hold the output to a structure (with --prompt-file): a JSON file `{"json_schema":
    /// {...}}`, `{"json_object": true}`, `{"regex": "..."}`, `{"grammar": "..."}` or a
    /// constraint plugin `{"plugin": "FILE.wasm", "params": {...}}` (a relative path is from
    /// the JSON file's folder; a name without `.wasm` is a built-in plugin, e.g. `guidance`). The row then reports the constraint's mask time per step and
    /// its compile time (a plugin's: instantiation, vocabulary and `host_begin`); with
    /// --paired-plain every run is paired with an unconstrained one. With --batch every row
    /// is held to it (row i's prompt ends "(#i)") and every run is paired with a plain batch.
    #[arg(long)]
    pub constraint: Option<PathBuf>,
}

/// What a `--constraint` file holds: a structure llguidance compiles, or a constraint plugin.
enum BenchConstraint {
    Structure(crate::structured::Structure),
    /// A plugin file, or a built-in plugin's name.
    Plugin {
        file: PathBuf,
        params: serde_json::Value,
    },
}

impl BenchConstraint {
    fn kind(&self) -> String {
        match self {
            BenchConstraint::Structure(s) => s.kind().to_string(),
            BenchConstraint::Plugin { file, .. } => format!("plugin {}", file.display()),
        }
    }
}

/// A `--constraint` file's structure or plugin.
fn read_constraint(path: &std::path::Path) -> Result<BenchConstraint> {
    use crate::structured::Structure;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
    if let Some(file) = s("plugin") {
        let file = match file.ends_with(".wasm") {
            true => path.parent().unwrap_or(std::path::Path::new(".")).join(file),
            false => PathBuf::from(file),
        };
        return Ok(BenchConstraint::Plugin { file, params: v.get("params").cloned().unwrap_or(serde_json::json!({})) });
    }
    Ok(BenchConstraint::Structure(match (v.get("json_schema"), v.get("json_object"), s("regex"), s("grammar")) {
        (Some(schema), None, None, None) => Structure::JsonSchema(crate::structured::strict(schema.clone())),
        (None, Some(_), None, None) => Structure::JsonObject,
        (None, None, Some(rx), None) => Structure::Regex(rx),
        (None, None, None, Some(g)) => Structure::Grammar(g),
        _ => bail!("{} must hold one of json_schema, json_object, regex, grammar and plugin", path.display()),
    }))
}

/// Compiles `--constraint`'s structure or plugin for a model (`info`, with its `tokenizer`):
/// the spec, the token trie's build (a server's first constrained request; a plugin's
/// vocabulary) and the structure's compile (a plugin's start), in ms.
fn compile_constraint(
    c: &BenchConstraint,
    tokenizer: models::Tokenizer,
    info: &models::ModelInfo,
) -> Result<(crate::engine::ConstraintSpec, f64, f64)> {
    let (vocab, eos) = (info.vocab_size, info.eos_token_ids.clone());
    let grammars = crate::structured::Grammars::new(std::sync::Arc::new(tokenizer), vocab, eos.clone());
    match c {
        BenchConstraint::Plugin { file, params } => {
            let t = Instant::now();
            let words = grammars.plugin_vocab()?;
            let trie_ms = t.elapsed().as_secs_f64() * 1e3;
            let (registry, plugin) = match file.extension().is_some_and(|e| e == "wasm") {
                true => {
                    let registry = crate::plugins::PluginRegistry::new()?;
                    let plugin = registry.load_file(file)?;
                    (registry, plugin)
                }
                false => {
                    let registry = crate::plugins::PluginRegistry::with_builtins()?;
                    let name = file.to_string_lossy();
                    let plugin = registry.get(&name).with_context(|| format!("no built-in plugin {name}"))?;
                    (registry, plugin)
                }
            };
            let kind = crate::plugins::abi_v1::Kind::Constraint;
            let selected = registry.select(kind, &plugin.manifest.name, None, Some(params.clone()), false)?;
            let spec = crate::plugins::adapters::constraint_spec(registry, selected, words);
            let t = Instant::now();
            drop(crate::engine::Guard::start(&spec, 0, &eos, vocab)?);
            Ok((spec, trie_ms, t.elapsed().as_secs_f64() * 1e3))
        }
        BenchConstraint::Structure(s) => {
            let t = Instant::now();
            grammars.prepare()?;
            let trie_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            let spec = grammars.compile(s).map_err(|e| match e {
                crate::structured::CompileError::Invalid(why) => {
                    anyhow::anyhow!("the constraint does not compile: {why}")
                }
                crate::structured::CompileError::Internal(e) => e,
            })?;
            Ok((spec, trie_ms, t.elapsed().as_secs_f64() * 1e3))
        }
    }
}

/// One (prompt length, batch size)'s results with `--batch`.
#[derive(Debug, Serialize)]
pub struct BatchRow {
    pub model: String,
    pub device: String,
    pub prompt_tokens: usize,
    pub batch: usize,
    pub gen_tokens: usize,
    pub runs: usize,
    /// Every row's tokens after its first over the time from the first step's tokens to the
    /// last (median of the runs), and that over the batch size.
    pub decode_tps: f64,
    pub per_stream_decode_tps: f64,
    /// Prefilling all B prompts and reading the first step's tokens.
    pub ttft_ms: f64,
    pub prefill_tps: f64,
    pub peak_memory_bytes: usize,
    pub warmup_s: f64,
    /// With --constraint (every row held to it): its kind; the rows' mean output length
    /// (first run); the median over runs of decode tok/s against a plain batch of the same
    /// prompts run to the same lengths in this process (each run paired with one); and the
    /// rows' masks in ms, per mask and per step (all rows' together, first run).
    pub constraint: Option<String>,
    pub mean_row_tokens: Option<f64>,
    pub plain_decode_tps: Option<f64>,
    pub vs_plain: Option<f64>,
    pub mask_ms: Option<f64>,
    pub mask_ms_per_step: Option<f64>,
    /// The first run's steps, and of them those whose quick masks came before the forward's
    /// start, the forward started with the sampling in one dispatch (`Batch::merged_steps`).
    pub merged_steps: Option<usize>,
    pub steps: Option<usize>,
    /// Row masks applied on the device in the first run, and of them those sent from the
    /// host (the rest were kept there: `Masking`).
    pub masks_applied: Option<usize>,
    pub masks_sent: Option<usize>,
    /// The engine thread's time per step (ms, first run): build, dispatch, wait, tell, pick
    /// (`engine::batch::StepSplit`); with --constraint, also the paired plain batch's, and
    /// both batches' whole step (ms, the run's decode time over its steps).
    pub step_split_ms: [f64; 5],
    pub step_ms: f64,
    pub plain_step_split_ms: Option<[f64; 5]>,
    pub plain_step_ms: Option<f64>,
    /// With --speculative (every row speculates; paired with a plain batch as a constraint
    /// is): the method, and in the first run the steps that verified drafts and the draft
    /// tokens they verified (summed over rows); the positions those steps fed (rows ×
    /// positions per row) and of those the padding after rows that drafted less than the
    /// longest (what a flattened layout, one sequence of every row's positions, would not feed).
    pub speculative: Option<&'static str>,
    pub verifications: Option<usize>,
    pub draft_tokens: Option<usize>,
    pub verify_positions: Option<usize>,
    pub verify_padding: Option<usize>,
}

/// One batched generation's measurements.
struct BatchRun {
    /// Seconds to the first step's tokens, and from there to the last.
    ttft: f64,
    rest: f64,
    /// Tokens after each row's first.
    tokens: usize,
    /// Each row's tokens (first included), in row order.
    lengths: Vec<usize>,
    steps: usize,
    merged_steps: usize,
    /// The rows' constraints' masks and seconds spent on them.
    masks: usize,
    mask_secs: f64,
    /// Row masks applied on the device, and of them those sent from the host.
    masks_applied: usize,
    masks_sent: usize,
    split: crate::engine::batch::StepSplit,
    /// Speculative rows: what their verifications verified.
    verified: crate::engine::batch::Verified,
}

impl BatchRun {
    /// Decode milliseconds per step after the first.
    fn step_ms(&self) -> f64 {
        self.rest * 1e3 / self.steps.saturating_sub(1).max(1) as f64
    }
}

/// One batched generation: `prompts` prefilled (together, as the server prefills prompts that arrive
/// together, where the model allows it) and joined, then stepped until every row has finished: at
/// `gen[i]` tokens for row i, or, held to `constraint`, at its end of sequence.
fn run_batch(
    model: &dyn models::CausalLm,
    prompts: &[Vec<u32>],
    gen: &[usize],
    constraint: Option<(&crate::engine::ConstraintSpec, &[u32])>,
    speculative: Option<(&SpecConfig, Option<&dyn models::CausalLm>)>,
) -> Result<BatchRun> {
    use crate::engine::batch::{Batch, Row as BatchRowState};
    let started = Instant::now();
    let mut batch = Batch::new(model);
    // The prompts prefilled as the server prefills prompts that arrive together (512 positions
    // a row per forward: the server's default step token budget).
    let mut caches: Vec<Vec<models::KvCache>> = prompts.iter().map(|_| model.make_cache()).collect();
    let bodies: Vec<&[u32]> = prompts.iter().map(|ids| &ids[..ids.len() - 1]).collect();
    if prompts.len() > 1 && bodies.iter().all(|b| !b.is_empty()) && crate::engine::step::prefills_together(model) {
        let mut rows: Vec<&mut Vec<models::KvCache>> = caches.iter_mut().collect();
        crate::engine::step::prefill_together(model, &mut rows, &bodies, 512)?;
    } else {
        for (cache, body) in caches.iter_mut().zip(&bodies) {
            crate::engine::step::prefill(model, cache, body, 2048)?;
        }
    }
    for (key, ((ids, &gen), cache)) in prompts.iter().zip(gen).zip(caches).enumerate() {
        let sampler = Sampler::new(SamplingParams::default(), model.vocab_size())?;
        let eos = constraint.map_or(Vec::new(), |(_, eos)| eos.to_vec());
        let guard = constraint
            .map(|(c, eos)| crate::engine::Guard::start(c, key as u64, eos, model.vocab_size()))
            .transpose()?;
        let options = DecodeOptions { max_tokens: gen, eos_token_ids: eos, ..Default::default() };
        let speculation = speculative
            .map(|(config, draft)| crate::engine::Speculation::new(config.clone(), ids, draft, 2048))
            .transpose()?;
        let row = BatchRowState::new(key as u64, ids, sampler, options)?.with_constraint(guard);
        batch.join(row.with_speculation(speculation), &cache)?;
    }
    let mut run = BatchRun {
        ttft: 0.0,
        rest: 0.0,
        tokens: 0,
        lengths: vec![0; prompts.len()],
        steps: 0,
        merged_steps: 0,
        masks: 0,
        mask_secs: 0.0,
        masks_applied: 0,
        masks_sent: 0,
        split: Default::default(),
        verified: Default::default(),
    };
    let mut first = None;
    while !batch.is_empty() {
        let out = batch.step()?;
        run.steps += 1;
        if first.is_none() && !out.is_empty() {
            first = Some(Instant::now());
        } else {
            run.tokens += out.len();
        }
        for (key, token) in out {
            run.lengths[key as usize] += 1;
            if token?.finish.is_some() {
                let left = batch.leave(key)?.context("a row that finished is in the batch")?;
                if let (_, _, Some(guard)) = left.row.into_parts() {
                    run.masks += guard.masks;
                    run.mask_secs += guard.mask_secs;
                }
            }
        }
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    run.verified = batch.verified();
    run.merged_steps = batch.merged_steps();
    (run.masks_applied, run.masks_sent) = batch.mask_counts();
    run.split = batch.split();
    run.ttft = (first - started).as_secs_f64();
    run.rest = (end - first).as_secs_f64();
    Ok(run)
}

/// `host bench --batch`: a table (or JSON lines) of batched decoding per prompt length and
/// batch size; with --constraint, of batches whose every row is held to it, each run paired
/// with a plain batch of the same shape.
fn run_batches(args: &Args) -> Result<()> {
    if args.batch.contains(&0) || args.gen < 2 || args.runs == 0 || args.prompt_lengths.contains(&0) {
        bail!("every --batch size must be at least 1, --gen at least 2, --runs at least 1 and every prompt length at least 1");
    }
    let spec = args.spec.config()?;
    let speculating = spec.method != SpecMethod::Off;
    if args.constraint.is_some() && args.prompt_file.is_none() {
        bail!("--batch takes --constraint and --prompt-file together (constrained rows answer the prompt, row i with \"(#i)\" appended) or neither (random prompts)");
    }
    if args.prompt_file.is_some() && args.constraint.is_none() && !speculating {
        bail!("--batch takes --prompt-file with --constraint or --speculative (each paired with a plain batch); leave it out for random prompts");
    }
    let structure = args.constraint.as_deref().map(read_constraint).transpose()?;
    let text = match &args.prompt_file {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let device = select_device(args.device)?;
    let loaded = load_model_split(args.model.as_deref(), &args.split.split(), args.device)?;
    if !loaded.model.batches() {
        bail!("this model does not decode in batches (tensor-parallel models do not yet)");
    }
    let vocab = loaded.info.vocab_size;
    let name = loaded.info.source.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    // Each length's prompts (one per row of the largest batch).
    let most = args.batch.iter().copied().max().unwrap_or(1);
    let lengths: Vec<Vec<Vec<u32>>> = match &text {
        Some(t) => {
            let row = |r: usize| {
                prompt_tokens(&loaded, &[t.as_slice(), format!("\n\n(#{r})").as_bytes()].concat(), None, false)
            };
            vec![(0..most).map(row).collect::<Result<_>>()?]
        }
        None => (args.prompt_lengths.iter().enumerate())
            .map(|(i, &len)| (0..most).map(|r| prompt(len, vocab, 1 + i as u64 + 1000 * r as u64)).collect())
            .collect(),
    };
    let eos = loaded.info.eos_token_ids.clone();
    let draft = args.spec.draft_model.as_deref().map(|p| load_draft(p, &loaded)).transpose()?;
    let compiled = match &structure {
        Some(c) => Some(compile_constraint(c, loaded.tokenizer, &loaded.info)?.0),
        None => None,
    };
    let constraint = compiled.as_ref().map(|c| (c, eos.as_slice()));
    let speculative = speculating.then(|| (&spec, draft.as_ref().map(|d| d.model.as_ref())));
    let paired = constraint.is_some() || speculative.is_some();
    let model = loaded.model.as_ref();
    if !args.json {
        eprintln!("host bench --batch: {name} on {device} (mlx {}), {} runs per row", mlx::version(), args.runs);
    }
    let mut rows = Vec::new();
    for all in &lengths {
        for &b in &args.batch {
            let prompts = &all[..b];
            let t = Instant::now();
            run_batch(model, prompts, &vec![args.gen.min(16); b], None, speculative)?;
            // Held to a constraint, a warm-up at full length gives the rows' lengths: the
            // plain batch paired with each run runs every row to its constrained length, so
            // both have as many rows at every step. Speculative rows run to --gen, as plain.
            let shape = match constraint {
                Some(c) => Some(run_batch(model, prompts, &vec![args.gen; b], Some(c), speculative)?.lengths),
                None => paired.then(|| vec![args.gen; b]),
            };
            let warmup_s = t.elapsed().as_secs_f64();
            let (mut ttft, mut decode, mut peak, mut firsts) = (Vec::new(), Vec::new(), 0, None);
            let (mut plain_decode, mut ratios, mut first_plain) = (Vec::new(), Vec::new(), None);
            let tps = |r: &BatchRun| r.tokens as f64 / r.rest;
            for i in 0..args.runs {
                mlx::memory::reset_peak();
                // Paired: plain first in even runs, second in odd ones.
                let plain_run = || shape.as_ref().map(|s| run_batch(model, prompts, s, None, None)).transpose();
                let mut plain = if i % 2 == 0 { plain_run()? } else { None };
                let r = run_batch(model, prompts, &vec![args.gen; b], constraint, speculative)?;
                if plain.is_none() {
                    plain = plain_run()?;
                }
                if let Some(p) = plain {
                    plain_decode.push(tps(&p));
                    ratios.push(tps(&r) / tps(&p));
                    first_plain.get_or_insert(p);
                }
                ttft.push(r.ttft);
                decode.push(tps(&r));
                firsts.get_or_insert(r);
                peak = peak.max(mlx::memory::peak());
            }
            let first = firsts.expect("at least one run");
            let (ttft, decode_tps) = (median(ttft), median(decode));
            let held = |v: f64| structure.as_ref().map(|_| v);
            let speculated = |v: usize| speculative.map(|_| v);
            let row = BatchRow {
                model: name.clone(),
                device: device.to_string(),
                prompt_tokens: prompts[0].len(),
                batch: b,
                gen_tokens: args.gen,
                runs: args.runs,
                decode_tps,
                per_stream_decode_tps: decode_tps / b as f64,
                ttft_ms: ttft * 1e3,
                prefill_tps: prompts.iter().map(Vec::len).sum::<usize>() as f64 / ttft,
                peak_memory_bytes: peak,
                warmup_s,
                constraint: structure.as_ref().map(BenchConstraint::kind),
                mean_row_tokens: held(first.lengths.iter().sum::<usize>() as f64 / b as f64),
                plain_decode_tps: paired.then(|| median(plain_decode)),
                vs_plain: paired.then(|| median(ratios)),
                speculative: speculative.map(|_| spec.method.as_str()),
                verifications: speculated(first.verified.steps),
                draft_tokens: speculated(first.verified.drafts),
                verify_positions: speculated(first.verified.positions),
                verify_padding: speculated(first.verified.padding),
                mask_ms: held(per_step(first.mask_secs, first.masks)),
                mask_ms_per_step: held(per_step(first.mask_secs, first.steps)),
                merged_steps: structure.as_ref().map(|_| first.merged_steps),
                steps: paired.then_some(first.steps),
                masks_applied: structure.as_ref().map(|_| first.masks_applied),
                masks_sent: structure.as_ref().map(|_| first.masks_sent),
                step_split_ms: first.split.per_step_ms(),
                step_ms: first.step_ms(),
                plain_step_split_ms: first_plain.as_ref().map(|p| p.split.per_step_ms()),
                plain_step_ms: first_plain.as_ref().map(BatchRun::step_ms),
            };
            if args.json {
                println!("{}", serde_json::to_string(&row)?);
            }
            rows.push(row);
        }
    }
    if !args.json {
        println!("| model | prompt | batch | decode tok/s (all rows) | per stream tok/s | TTFT ms (all rows) | prefill tok/s | peak memory GB |");
        println!("|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.3} |",
                r.model,
                r.prompt_tokens,
                r.batch,
                r.decode_tps,
                r.per_stream_decode_tps,
                r.ttft_ms,
                r.prefill_tps,
                r.peak_memory_bytes as f64 / 1e9
            );
        }
        let split = |s: &[f64; 5]| s.map(|v| format!("{v:.3}")).join("/");
        for r in rows.iter().filter(|r| r.speculative.is_some() && r.constraint.is_none()) {
            println!(
                "batch {}, every row speculating ({}): {:.2}x a plain batch of the same rows in this process (median of {} pairs; plain {:.1} tok/s); {} of {} steps verified drafts, {} draft tokens; of the {} positions they fed, {} padding",
                r.batch,
                r.speculative.unwrap_or_default(),
                r.vs_plain.unwrap_or_default(),
                r.runs,
                r.plain_decode_tps.unwrap_or_default(),
                r.verifications.unwrap_or_default(),
                r.steps.unwrap_or_default(),
                r.draft_tokens.unwrap_or_default(),
                r.verify_positions.unwrap_or_default(),
                r.verify_padding.unwrap_or_default(),
            );
        }
        for r in rows.iter().filter(|r| r.constraint.is_some()) {
            println!(
                "batch {}, every row held to the {} constraint: {:.2}x a plain batch of the same lengths in this process (median of {} pairs; plain {:.1} tok/s); {:.0} tokens a row; {:.3} ms per mask, {:.3} ms of masks per step; {} of {} steps merged; {} of {} masks sent to the device; a step {:.3} ms, build/dispatch/wait/tell/pick {} (plain: {:.3} ms, {})",
                r.batch,
                r.constraint.as_deref().unwrap_or_default(),
                r.vs_plain.unwrap_or_default(),
                r.runs,
                r.plain_decode_tps.unwrap_or_default(),
                r.mean_row_tokens.unwrap_or_default(),
                r.mask_ms.unwrap_or_default(),
                r.mask_ms_per_step.unwrap_or_default(),
                r.merged_steps.unwrap_or_default(),
                r.steps.unwrap_or_default(),
                r.masks_sent.unwrap_or_default(),
                r.masks_applied.unwrap_or_default(),
                r.step_ms,
                split(&r.step_split_ms),
                r.plain_step_ms.unwrap_or_default(),
                split(&r.plain_step_split_ms.unwrap_or_default())
            );
        }
    }
    Ok(())
}

/// One prompt length's results.
#[derive(Debug, Serialize)]
pub struct Row {
    pub model: String,
    pub device: String,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub runs: usize,
    pub prefill_tps: f64,
    pub ttft_ms: f64,
    /// (gen - 1) tokens over the time from the first token to the last, as mlx-lm's bench.
    pub decode_tps: f64,
    /// The same, of the first measured run alone. With --prompt-file the warm-up generates
    /// from other tokens, so this run meets the prompt's shapes (speculative verifications'
    /// query and key lengths) for the first time, as a live request does; later runs replay
    /// them, so a cost paid per new shape shows as this number below `decode_tps`.
    pub first_decode_tps: f64,
    pub peak_memory_bytes: usize,
    pub weight_bytes_per_token: usize,
    pub warmup_s: f64,
    /// `bandwidth / weight_bytes_per_token`, when a bandwidth was given.
    pub floor_tps: Option<f64>,
    pub pct_of_floor: Option<f64>,
    /// Speculative decoding (off, prompt-lookup, draft) and how it went in the first run.
    pub speculative: &'static str,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub tokens_per_step: f64,
    /// Batch rows scored by verifications of several candidates (`--draft-candidates`).
    pub candidate_rows: usize,
    /// With --prompt-file: the first run's ids, and whether every run generated the same.
    pub token_ids: Option<Vec<u32>>,
    pub runs_identical: bool,
    /// Per pipelined decode step (first run), on the engine's thread: building the next
    /// step's graph, handing it to MLX, and waiting for the current token. Step time =
    /// 1000 / decode tok/s; when the wait is near 0 the device idles on the CPU.
    pub step_ms: f64,
    pub build_ms: f64,
    pub dispatch_ms: f64,
    pub wait_ms: f64,
    /// Speculation (first run): verifications and their mean time (a pipelined plain step
    /// takes `step_ms` of the plain run; a verification runs serially, from drafting to commit).
    pub verifications: usize,
    pub verify_ms: f64,
    /// Parts of `verify_ms` (`DecodeStats::verify_draft_secs` ...): drafting, building the
    /// graph, handing it to MLX, waiting for the picks; the rest is accepting and committing.
    pub verify_draft_ms: f64,
    pub verify_build_ms: f64,
    pub verify_dispatch_ms: f64,
    pub verify_wait_ms: f64,
    /// With --paired-plain: the plain runs' median decode tok/s, and the median over pairs
    /// of speculative over plain decode tok/s.
    pub plain_decode_tps: Option<f64>,
    pub vs_plain: Option<f64>,
    /// With --paired-plain: the first plain run's step on the engine's thread, ms: build /
    /// dispatch / wait (as `build_ms` ...), to set beside the measured run's.
    pub plain_step_split_ms: Option<[f64; 3]>,
    /// With --prompt-file: prompt lookup's ceiling on the first run's text (tokens per target
    /// step if every step verified a draft, `PromptLookup::ceiling`; greedy speculation writes
    /// plain decoding's text), at most `--num-draft-tokens` drafted and unbounded.
    pub lookup_ceiling: Option<f64>,
    pub lookup_ceiling_unbounded: Option<f64>,
    /// With --constraint: its kind, masks per generated token and milliseconds per mask
    /// (first run), and the token trie's build (a plugin's vocabulary) and the structure's
    /// compile (a plugin's start), in ms.
    pub constraint: Option<String>,
    pub masks_per_token: Option<f64>,
    /// Of the decode steps, those whose mask was worked out beside the next forward's start
    /// (the token already computed: `Generation::overlapped`).
    pub overlapped_steps: Option<usize>,
    /// Constrained steps whose forward and sampling started as one (`Generation::merged`).
    pub merged_steps: Option<usize>,
    /// Tokens the constraint forced, committed in runs without sampling (`forced_run`).
    pub forced_tokens: Option<usize>,
    pub mask_ms: Option<f64>,
    /// Per token told to the constraint, ms; per sampling queued (`DecodeStats::pick_secs`:
    /// the engine thread's build and `async_eval` of it; a merged step's or a forced run's
    /// with its forward), ms.
    pub accept_ms: Option<f64>,
    pub pick_ms: Option<f64>,
    /// Masks applied on the device (first run), and of them those sent from the host.
    pub masks_applied: Option<usize>,
    pub masks_sent: Option<usize>,
    pub trie_ms: Option<f64>,
    pub compile_ms: Option<f64>,
}

/// What one run gives back.
struct Run {
    ttft: f64,
    /// Seconds from the first token to the last.
    rest: f64,
    peak: usize,
    ids: Vec<u32>,
    stats: crate::engine::DecodeStats,
}

#[derive(Clone)]
struct Setup<'a> {
    model: &'a dyn models::CausalLm,
    draft: Option<&'a dyn models::CausalLm>,
    spec: &'a SpecConfig,
    eos: Vec<u32>,
    constraint: Option<&'a crate::engine::ConstraintSpec>,
}

/// Seeded pseudo-random token ids in `[0, vocab)`.
fn prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// One greedy generation of at most `gen` tokens.
fn run_once(setup: &Setup<'_>, ids: &[u32], gen: usize) -> Result<Run> {
    let started = Instant::now();
    let model = setup.model;
    let sampler = Sampler::new(SamplingParams::default(), model.vocab_size())?;
    let options = DecodeOptions { max_tokens: gen, eos_token_ids: setup.eos.clone(), ..Default::default() };
    let speculation = match setup.spec.method {
        SpecMethod::Off => None,
        _ => Some(Speculation::new(setup.spec.clone(), ids, setup.draft, options.prefill_step_size)?),
    };
    let constraint =
        setup.constraint.map(|c| crate::engine::Guard::start(c, 0, &setup.eos, model.vocab_size())).transpose()?;
    let hooks = Hooks { external: None, speculation, constraint };
    let mut g = Generation::start_with(model, model.make_cache(), ids, sampler, options, hooks)?;
    let (mut first, mut out) = (None, Vec::new());
    while let Some(t) = g.next_token()? {
        first.get_or_insert_with(Instant::now);
        out.push(t.id);
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    let stats = g.stats();
    Ok(Run {
        ttft: (first - started).as_secs_f64(),
        rest: (end - first).as_secs_f64(),
        peak: stats.peak_memory_bytes,
        ids: out,
        stats,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: Args) -> Result<()> {
    if !args.batch.is_empty() {
        return run_batches(&args);
    }
    if args.gen < 2 || args.runs == 0 || args.prompt_lengths.contains(&0) {
        bail!("--gen must be at least 2, --runs at least 1 and every prompt length at least 1");
    }
    let device = select_device(args.device)?;
    let spec = args.spec.config()?;
    if args.paired_plain && spec.method == SpecMethod::Off && args.constraint.is_none() {
        bail!("--paired-plain compares speculation or a constraint with plain decoding; add --speculative prompt-lookup or draft, or --constraint");
    }
    if args.constraint.is_some() && args.prompt_file.is_none() {
        bail!("--constraint needs --prompt-file (a constrained output ends at end of sequence)");
    }
    let structure = args.constraint.as_deref().map(read_constraint).transpose()?;
    let plain_spec = SpecConfig { method: SpecMethod::Off, ..spec.clone() };
    let lookup = PromptLookup::new(&spec);
    let text = match &args.prompt_file {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let loaded = load_model_split(args.model.as_deref(), &args.split.split(), args.device)?;
    let draft = args.spec.draft_model.as_deref().map(|p| load_draft(p, &loaded)).transpose()?;
    let model = loaded.model.as_ref();
    let vocab = loaded.info.vocab_size;
    let prompts: Vec<Vec<u32>> = match &text {
        Some(t) => vec![prompt_tokens(&loaded, t, None, false)?],
        None => args.prompt_lengths.iter().enumerate().map(|(i, &len)| prompt(len, vocab, 1 + i as u64)).collect(),
    };
    // The constraint: the token trie's build (a server's first constrained request) and the
    // schema's compile, timed apart. The tokenizer is not needed after the prompts.
    let (compiled, trie_ms, compile_ms) = match &structure {
        Some(c) => {
            let (spec, trie_ms, compile_ms) = compile_constraint(c, loaded.tokenizer, &loaded.info)?;
            (Some(spec), Some(trie_ms), Some(compile_ms))
        }
        None => (None, None, None),
    };
    let setup = Setup {
        model,
        draft: draft.as_ref().map(|d| d.model.as_ref()),
        spec: &spec,
        eos: if text.is_some() { loaded.info.eos_token_ids.clone() } else { Vec::new() },
        constraint: compiled.as_ref(),
    };
    let plain_setup = Setup { spec: &plain_spec, constraint: None, ..setup.clone() };
    let name = loaded.info.source.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let per_token = loaded.info.weight_bytes_per_token;
    if !args.json {
        eprintln!("host bench: {name} on {device} (mlx {}), {} runs per row", mlx::version(), args.runs);
    }
    let bench = Bench {
        args: &args,
        setup,
        plain_setup,
        text,
        name,
        device: device.to_string(),
        per_token,
        vocab,
        spec: &spec,
        lookup: &lookup,
        structure,
        trie_ms,
        compile_ms,
    };
    let mut rows = Vec::new();
    for ids in &prompts {
        let row = measure(&bench, ids)?;
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    if !args.json {
        print_rows(&rows);
    }
    Ok(())
}

/// What every prompt length of one `host bench` run shares.
struct Bench<'a> {
    args: &'a Args,
    setup: Setup<'a>,
    /// The same without speculation or a constraint (`--paired-plain`).
    plain_setup: Setup<'a>,
    /// The prompt file's bytes, when one was given.
    text: Option<Vec<u8>>,
    name: String,
    device: String,
    per_token: usize,
    vocab: usize,
    spec: &'a SpecConfig,
    lookup: &'a PromptLookup,
    structure: Option<BenchConstraint>,
    trie_ms: Option<f64>,
    compile_ms: Option<f64>,
}

/// One row: a warm-up, then `--runs` measured runs (each paired with a plain one under
/// `--paired-plain`), medians and the first run's split and counts.
fn measure(b: &Bench<'_>, ids: &[u32]) -> Result<Row> {
    let len = ids.len();
    // Warm-up: compiles kernels and fills MLX's buffer cache. A real prompt warms up on
    // as many seeded random tokens, generating as much, so the first measured run meets
    // its own speculative verification shapes unseen (`first_decode_tps`).
    let t = Instant::now();
    let warm_up = |setup: &Setup<'_>| match &b.text {
        Some(_) => run_once(setup, &prompt(len, b.vocab, 99), b.args.gen),
        None => run_once(setup, ids, b.args.gen.min(16)),
    };
    warm_up(&b.setup)?;
    if b.args.paired_plain {
        warm_up(&b.plain_setup)?;
    }
    let warmup_s = t.elapsed().as_secs_f64();
    let tps = |r: &Run| (r.ids.len().max(2) - 1) as f64 / r.rest;
    let (mut ttft, mut decode, mut peak, mut runs) = (Vec::new(), Vec::new(), 0, Vec::new());
    let (mut plain_decode, mut ratios, mut plain_split) = (Vec::new(), Vec::new(), None);
    for i in 0..b.args.runs {
        // Paired: plain first in even runs, second in odd ones.
        let plain_run = || run_once(&b.plain_setup, ids, b.args.gen);
        let mut plain = if b.args.paired_plain && i % 2 == 0 { Some(plain_run()?) } else { None };
        let r = run_once(&b.setup, ids, b.args.gen)?;
        if b.args.paired_plain && plain.is_none() {
            plain = Some(plain_run()?);
        }
        if let Some(p) = plain {
            plain_split.get_or_insert_with(|| step_split(&p.stats));
            plain_decode.push(tps(&p));
            ratios.push(tps(&r) / tps(&p));
        }
        ttft.push(r.ttft);
        decode.push(tps(&r));
        peak = peak.max(r.peak);
        runs.push(r);
    }
    let first = &runs[0];
    let [build_ms, dispatch_ms, wait_ms] = step_split(&first.stats);
    let ttft = median(ttft);
    let first_decode_tps = decode[0];
    let decode_tps = median(decode);
    let floor_tps = (b.args.bandwidth > 0.0).then(|| b.args.bandwidth * 1e9 / b.per_token as f64);
    Ok(Row {
        model: b.name.clone(),
        device: b.device.clone(),
        prompt_tokens: len,
        gen_tokens: first.ids.len(),
        runs: b.args.runs,
        prefill_tps: len as f64 / ttft,
        ttft_ms: ttft * 1e3,
        decode_tps,
        first_decode_tps,
        peak_memory_bytes: peak,
        weight_bytes_per_token: b.per_token,
        warmup_s,
        floor_tps,
        pct_of_floor: floor_tps.map(|f| 100.0 * decode_tps / f),
        speculative: b.spec.method.as_str(),
        drafted_tokens: first.stats.drafted_tokens,
        accepted_tokens: first.stats.accepted_tokens,
        tokens_per_step: first.stats.tokens_per_step(),
        candidate_rows: first.stats.candidate_rows,
        token_ids: b.text.as_ref().map(|_| first.ids.clone()),
        runs_identical: runs.iter().all(|r| r.ids == first.ids),
        step_ms: 1e3 / decode_tps,
        build_ms,
        dispatch_ms,
        wait_ms,
        verifications: first.stats.verifications,
        verify_ms: per_step(first.stats.verify_secs, first.stats.verifications),
        verify_draft_ms: per_step(first.stats.verify_draft_secs, first.stats.verifications),
        verify_build_ms: per_step(first.stats.verify_build_secs, first.stats.verifications),
        verify_dispatch_ms: per_step(first.stats.verify_dispatch_secs, first.stats.verifications),
        verify_wait_ms: per_step(first.stats.verify_wait_secs, first.stats.verifications),
        plain_decode_tps: b.args.paired_plain.then(|| median(plain_decode)),
        vs_plain: b.args.paired_plain.then(|| median(ratios)),
        plain_step_split_ms: plain_split,
        lookup_ceiling: b.text.as_ref().map(|_| b.lookup.ceiling(ids, &first.ids, Some(b.spec.num_draft_tokens))),
        lookup_ceiling_unbounded: b.text.as_ref().map(|_| b.lookup.ceiling(ids, &first.ids, None)),
        constraint: b.structure.as_ref().map(BenchConstraint::kind),
        masks_per_token: b.structure.as_ref().map(|_| first.stats.masks as f64 / first.ids.len().max(1) as f64),
        overlapped_steps: b.structure.as_ref().map(|_| first.stats.overlapped_masks),
        merged_steps: b.structure.as_ref().map(|_| first.stats.merged_steps),
        forced_tokens: b.structure.as_ref().map(|_| first.stats.forced_tokens),
        mask_ms: b.structure.as_ref().map(|_| per_step(first.stats.mask_secs, first.stats.masks)),
        accept_ms: b.structure.as_ref().map(|_| per_step(first.stats.accept_secs, first.stats.accepts)),
        pick_ms: b.structure.as_ref().map(|_| per_step(first.stats.pick_secs, first.stats.picks)),
        masks_applied: b.structure.as_ref().map(|_| first.stats.masks_applied),
        masks_sent: b.structure.as_ref().map(|_| first.stats.masks_sent),
        trie_ms: b.trie_ms,
        compile_ms: b.compile_ms,
    })
}

/// The rows as a markdown table, then a line per constrained row and per row compared with
/// plain decoding.
fn print_rows(rows: &[Row]) {
    println!("| model | prompt | prefill tok/s | TTFT ms | decode tok/s | peak memory GB | weights/token GB | floor tok/s | % of floor | step ms: build / dispatch / wait |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let floor = r.floor_tps.map_or("-".into(), |f| format!("{f:.0}"));
        let pct = r.pct_of_floor.map_or("-".into(), |p| format!("{p:.0}%"));
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.1} | {:.3} | {:.3} | {floor} | {pct} | {:.2}: {:.2} / {:.2} / {:.2} |",
            r.model,
            r.prompt_tokens,
            r.prefill_tps,
            r.ttft_ms,
            r.decode_tps,
            r.peak_memory_bytes as f64 / 1e9,
            r.weight_bytes_per_token as f64 / 1e9,
            r.step_ms,
            r.build_ms,
            r.dispatch_ms,
            r.wait_ms
        );
    }
    for r in rows.iter().filter(|r| r.constraint.is_some()) {
        println!(
            "{} constraint: {} tokens ({} forced), {:.3} ms per mask, {:.3} per accept, {:.3} per sampling queued ({:.2} masks per token, {} of {} applied sent to the device, {} steps overlapped, {} merged); token trie {:.0} ms, compile {:.1} ms",
            r.constraint.as_deref().unwrap_or_default(),
            r.gen_tokens,
            r.forced_tokens.unwrap_or_default(),
            r.mask_ms.unwrap_or_default(),
            r.accept_ms.unwrap_or_default(),
            r.pick_ms.unwrap_or_default(),
            r.masks_per_token.unwrap_or_default(),
            r.masks_sent.unwrap_or_default(),
            r.masks_applied.unwrap_or_default(),
            r.overlapped_steps.unwrap_or_default(),
            r.merged_steps.unwrap_or_default(),
            r.trie_ms.unwrap_or_default(),
            r.compile_ms.unwrap_or_default()
        );
    }
    for r in rows.iter().filter(|r| r.vs_plain.is_some()) {
        if r.gen_tokens < MIN_RATE_TOKENS {
            // A forced run commits its tokens at one instant: two tokens, one of them
            // forced, would read as thousands of tokens a second.
            println!("{} tokens: too few for a decode rate", r.gen_tokens);
            continue;
        }
        let [build, dispatch, wait] = r.plain_step_split_ms.unwrap_or_default();
        println!(
            "{}, prompt {}: {:.2}x plain decoding in this process (median of {} pairs; plain {:.1} tok/s, step ms: build {build:.2} / dispatch {dispatch:.2} / wait {wait:.2})",
            match &r.constraint {
                Some(c) => format!("{c} constraint, speculation {}", r.speculative),
                None => format!("{} speculation", r.speculative),
            },
            r.prompt_tokens,
            r.vs_plain.unwrap_or_default(),
            r.runs,
            r.plain_decode_tps.unwrap_or_default()
        );
    }
}

/// The fewest generated tokens whose decode rate `host bench` compares with plain decoding.
const MIN_RATE_TOKENS: usize = 16;

/// A run's pipelined decode step on the engine's thread, ms: build / dispatch / wait.
fn step_split(stats: &crate::engine::DecodeStats) -> [f64; 3] {
    let steps = stats.pipelined_steps;
    [per_step(stats.build_secs, steps), per_step(stats.dispatch_secs, steps), per_step(stats.wait_secs, steps)]
}

/// Milliseconds per step of a summed duration.
fn per_step(secs: f64, steps: usize) -> f64 {
    if steps == 0 {
        0.0
    } else {
        secs * 1e3 / steps as f64
    }
}
