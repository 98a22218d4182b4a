//! The warm-up before serving: short generations (and batches up to `max_batch`) so the
//! device compiles its kernels then, not in the first requests.

use super::batch::{Batch, Row};
use super::{DecodeOptions, Generation, Sampler, SamplingParams};
use anyhow::Result;
use mlx::Array;

use models::CausalLm;
use std::time::{Duration, Instant};

/// Draft lengths whose verification shapes the warm-up compiles (the default
/// `num_draft_tokens`; longer drafts asked for per request compile on first use).
pub(super) const WARM_UP_DRAFTS: usize = 8;

/// Runs two short generations (a 64-token prefill, then greedy and sampled decode steps), the
/// forwards a speculative verification of 1..=WARM_UP_DRAFTS drafts runs (with its greedy
/// pick over all rows), a short generation of the draft model, and a few batch steps at each
/// power-of-two batch size up to `max_batch`, so the device compiles its kernels at start
/// rather than in the first requests. Leaves no state behind: the caches are dropped and
/// nothing reaches the prompt cache or the stats.
pub(super) fn warm_up(
    model: &dyn CausalLm,
    draft: Option<&dyn CausalLm>,
    vocab: usize,
    prefill_step_size: usize,
    max_batch: usize,
) -> Result<Duration> {
    let started = Instant::now();
    let prompt = warm_up_prompt(vocab);
    for (model, temperature) in [(Some(model), 0.0), (Some(model), 1.0), (draft, 0.0)] {
        let Some(model) = model else { continue };
        let params = SamplingParams { temperature, seed: Some(0), ..Default::default() };
        let options = DecodeOptions { max_tokens: 4, eos_token_ids: vec![], prefill_step_size };
        let mut generation = Generation::start(model, &prompt, Sampler::new(params, vocab)?, options)?;
        while generation.next_token()?.is_some() {}
    }
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    let mut cache = model.make_cache();
    mlx::eval(&[&model.forward(&Array::from_i32(&ids, &[1, ids.len()])?, &mut cache)?])?;
    // A recurrent layer rolls a verification back to its snapshot.
    for c in &mut cache {
        c.keep_snapshots(WARM_UP_DRAFTS + 1);
    }
    for width in 2..=WARM_UP_DRAFTS + 1 {
        let logits = model.forward(&Array::from_i32(&ids[..width], &[1, width])?, &mut cache)?.squeeze(&[0])?;
        mlx::eval(&[&super::sampling::log_softmax(&logits)?.argmax(-1, false)?])?;
        for c in &mut cache {
            c.trim(width);
        }
    }
    if model.batches() {
        let mut rows = 2;
        while rows <= max_batch {
            let mut batch = Batch::new(model);
            for key in 0..rows {
                let prompt = &prompt[..8 + key % 8];
                let mut cache = model.make_cache();
                super::step::prefill(model, &mut cache, &prompt[..prompt.len() - 1], prefill_step_size)?;
                let params = SamplingParams { temperature: (key % 2) as f32, seed: Some(0), ..Default::default() };
                let options = DecodeOptions { max_tokens: 3, eos_token_ids: vec![], prefill_step_size };
                batch.join(Row::new(key as u64, prompt, Sampler::new(params, vocab)?, options)?, &cache)?;
            }
            while !batch.is_empty() {
                for (key, token) in batch.step()? {
                    if token?.finish.is_some() {
                        batch.leave(key)?;
                    }
                }
            }
            rows *= 2;
        }
    }
    Ok(started.elapsed())
}

pub(super) fn warm_up_prompt(vocab: usize) -> Vec<u32> {
    (0..64u32).map(|i| (i * 7919 + 13) % vocab as u32).collect()
}
