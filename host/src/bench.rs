//! `host bench`: loads a model once and measures, per prompt length, prefill tok/s, time to
//! first token, decode tok/s (median of `--runs` after a warm-up that compiles kernels),
//! peak memory, and decode speed against a memory-bandwidth floor (weight bytes read per
//! token / bandwidth). Prompts are seeded random token ids; end of sequence is ignored.

use crate::engine::{DecodeOptions, Generation, Sampler, SamplingParams};
use crate::generate::{load_model, select_device, DeviceChoice};
use anyhow::{bail, Result};
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
    pub peak_memory_bytes: usize,
    pub weight_bytes_per_token: usize,
    pub warmup_s: f64,
    /// `bandwidth / weight_bytes_per_token`, when a bandwidth was given.
    pub floor_tps: Option<f64>,
    pub pct_of_floor: Option<f64>,
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

/// (time to first token, decode seconds for the remaining tokens, peak memory).
fn run_once(model: &dyn models::CausalLm, ids: &[u32], gen: usize) -> Result<(f64, f64, usize)> {
    let started = Instant::now();
    let sampler = Sampler::new(SamplingParams::default(), model.vocab_size())?;
    let options = DecodeOptions { max_tokens: gen, eos_token_ids: Vec::new(), ..Default::default() };
    let mut g = Generation::start(model, ids, sampler, options)?;
    let mut first = None;
    while let Some(_t) = g.next_token()? {
        first.get_or_insert_with(Instant::now);
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    Ok(((first - started).as_secs_f64(), (end - first).as_secs_f64(), g.stats().peak_memory_bytes))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: Args) -> Result<()> {
    if args.gen < 2 || args.runs == 0 || args.prompt_lengths.iter().any(|&l| l == 0) {
        bail!("--gen must be at least 2, --runs at least 1 and every prompt length at least 1");
    }
    let device = select_device(args.device)?;
    let loaded = load_model(args.model.as_deref())?;
    let model = loaded.model.as_ref();
    let vocab = loaded.info.vocab_size;
    let name = loaded.info.source.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let per_token = loaded.info.weight_bytes_per_token;
    if !args.json {
        eprintln!("host bench: {name} on {device} (mlx {}), {} runs per row", mlx::version(), args.runs);
    }
    let mut rows = Vec::new();
    for (i, &len) in args.prompt_lengths.iter().enumerate() {
        let ids = prompt(len, vocab, 1 + i as u64);
        // Warm-up at this shape: compiles kernels and fills MLX's buffer cache.
        let t = Instant::now();
        run_once(model, &ids, args.gen.min(16))?;
        let warmup_s = t.elapsed().as_secs_f64();
        let (mut ttft, mut decode, mut peak) = (Vec::new(), Vec::new(), 0);
        for _ in 0..args.runs {
            let (first, rest, p) = run_once(model, &ids, args.gen)?;
            ttft.push(first);
            decode.push((args.gen - 1) as f64 / rest);
            peak = peak.max(p);
        }
        let ttft = median(ttft);
        let decode_tps = median(decode);
        let floor_tps = (args.bandwidth > 0.0).then(|| args.bandwidth * 1e9 / per_token as f64);
        let row = Row {
            model: name.clone(),
            device: device.to_string(),
            prompt_tokens: len,
            gen_tokens: args.gen,
            runs: args.runs,
            prefill_tps: len as f64 / ttft,
            ttft_ms: ttft * 1e3,
            decode_tps,
            peak_memory_bytes: peak,
            weight_bytes_per_token: per_token,
            warmup_s,
            floor_tps,
            pct_of_floor: floor_tps.map(|f| 100.0 * decode_tps / f),
        };
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    if !args.json {
        println!("| model | prompt | prefill tok/s | TTFT ms | decode tok/s | peak memory GB | weights/token GB | floor tok/s | % of floor |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            let floor = r.floor_tps.map_or("-".into(), |f| format!("{f:.0}"));
            let pct = r.pct_of_floor.map_or("-".into(), |p| format!("{p:.0}%"));
            println!(
                "| {} | {} | {:.0} | {:.1} | {:.1} | {:.3} | {:.3} | {floor} | {pct} |",
                r.model,
                r.prompt_tokens,
                r.prefill_tps,
                r.ttft_ms,
                r.decode_tps,
                r.peak_memory_bytes as f64 / 1e9,
                r.weight_bytes_per_token as f64 / 1e9
            );
        }
    }
    Ok(())
}
