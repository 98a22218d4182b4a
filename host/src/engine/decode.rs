//! The decode loop, in mlx-lm's pipelined shape: prefill the prompt but its last token in
//! chunks, then for each step build step n+1's graph from step n's lazy token and start it
//! (`async_eval`) before reading step n's token, so graph building overlaps device work.
//!
//! This file reads as prefill, step, yield; stop strings and output formatting live with
//! their callers.

use super::sampling::Sampler;
use anyhow::{bail, Context, Result};
use mlx::{memory, Array};
use models::{CausalLm, KvCache};
use std::time::Instant;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated (it is the last token yielded).
    Stop,
    /// `max_tokens` were generated.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Limits and stop tokens of one generation.
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    pub max_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    /// Prompt tokens per prefill forward pass (bounds activation memory on long prompts).
    pub prefill_step_size: usize,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions { max_tokens: 256, eos_token_ids: Vec::new(), prefill_step_size: 2048 }
    }
}

/// One generated token.
#[derive(Debug)]
pub struct Token {
    pub id: u32,
    /// Normalized log-probabilities over the vocabulary at this step (`[V]`, lazy).
    pub logprobs: Array,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
}

/// Throughput and memory of a finished (or ongoing) generation, measured as mlx-lm does:
/// prompt time runs until the first token is ready, generation time from then on.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prompt_tps: f64,
    pub generation_tps: f64,
    pub peak_memory_bytes: usize,
}

/// A generation in progress: call [`Generation::next_token`] until it returns `None`.
pub struct Generation<'m> {
    model: &'m dyn CausalLm,
    cache: Vec<KvCache>,
    sampler: Sampler,
    options: DecodeOptions,
    /// Prompt plus generated tokens so far, on device; kept only when a processor needs it.
    history: Option<Array>,
    /// The step whose token is read next: (token `[1]`, logprobs `[V]`).
    pending: Option<(Array, Array)>,
    prompt_len: usize,
    generated: usize,
    started: Instant,
    first_token_at: Option<Instant>,
    stats: DecodeStats,
}

fn tokens_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_i32(&ids, &[ids.len()])?)
}

impl<'m> Generation<'m> {
    /// Prefills `prompt` and queues the first step.
    pub fn start(model: &'m dyn CausalLm, prompt: &[u32], sampler: Sampler, options: DecodeOptions) -> Result<Self> {
        let cache = model.make_cache();
        Self::start_with_cache(model, cache, prompt, sampler, options)
    }

    /// As `start`, continuing from `cache` (which already holds a prefix of the sequence);
    /// `prompt` is the part not yet in the cache.
    pub fn start_with_cache(
        model: &'m dyn CausalLm,
        cache: Vec<KvCache>,
        prompt: &[u32],
        sampler: Sampler,
        options: DecodeOptions,
    ) -> Result<Self> {
        if prompt.is_empty() {
            bail!("the prompt is empty; give at least one token");
        }
        let vocab = model.vocab_size();
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("prompt token {bad} is outside the model's vocabulary of {vocab}");
        }
        let started = Instant::now();
        memory::reset_peak();
        let cached = cache.first().map_or(0, KvCache::offset);
        let mut generation = Generation {
            model,
            cache,
            sampler,
            options,
            history: None,
            pending: None,
            prompt_len: cached + prompt.len(),
            generated: 0,
            started,
            first_token_at: None,
            stats: DecodeStats { prompt_tokens: prompt.len(), ..Default::default() },
        };
        let (head, last) = prompt.split_at(prompt.len() - 1);
        if generation.sampler.params().needs_history() {
            generation.history = Some(tokens_array(&prompt[..0])?);
        }
        for chunk in head.chunks(generation.options.prefill_step_size.max(1)) {
            let input = tokens_array(chunk)?;
            generation.model.forward(&input.expand_dims(&[0])?, &mut generation.cache).context("prefill")?;
            let state: Vec<&Array> = generation.cache.iter().flat_map(KvCache::state).collect();
            mlx::eval(&state)?;
            if let Some(h) = &generation.history {
                generation.history = Some(mlx::ops::concatenate(&[h, &input], 0)?);
            }
            memory::clear_cache();
        }
        let first = generation.step(&tokens_array(last)?, generation.prompt_len)?;
        mlx::async_eval(&[&first.0, &first.1])?;
        generation.pending = Some(first);
        Ok(generation)
    }

    /// One forward pass over `input` (`[L]`), returning the lazy next token and logprobs.
    fn step(&mut self, input: &Array, position: usize) -> Result<(Array, Array)> {
        let len = input.dim(0) as i32;
        let logits = self.model.forward(&input.expand_dims(&[0])?, &mut self.cache)?;
        let logits = logits.slice_axis(1, len - 1, len)?.squeeze(&[1])?;
        if let Some(h) = &self.history {
            self.history = Some(mlx::ops::concatenate(&[h, input], 0)?);
        }
        let logits = self.sampler.process(&logits, self.history.as_ref())?;
        let logprobs = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
        let token = self.sampler.sample(&logprobs, position)?;
        Ok((token, logprobs.squeeze(&[0])?))
    }

    /// The next token, or `None` once generation has finished.
    pub fn next_token(&mut self) -> Result<Option<Token>> {
        let Some((y, logprobs)) = self.pending.take() else { return Ok(None) };
        let n = self.generated;
        if n + 1 < self.options.max_tokens {
            let next = self.step(&y, self.prompt_len + n + 1)?;
            mlx::async_eval(&[&next.0, &next.1])?;
            self.pending = Some(next);
        }
        let id = y.item_i32()? as u32;
        let now = Instant::now();
        let first = *self.first_token_at.get_or_insert(now);
        self.generated += 1;
        if n % 256 == 0 {
            memory::clear_cache();
        }
        let finish = if self.options.eos_token_ids.contains(&id) {
            Some(FinishReason::Stop)
        } else if self.generated >= self.options.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if finish.is_some() {
            self.pending = None;
        }
        let prompt_secs = (first - self.started).as_secs_f64();
        let gen_secs = (now - first).as_secs_f64();
        self.stats.generated_tokens = self.generated;
        self.stats.prompt_tps = if prompt_secs > 0.0 { self.stats.prompt_tokens as f64 / prompt_secs } else { 0.0 };
        self.stats.generation_tps = if gen_secs > 0.0 { self.generated as f64 / gen_secs } else { 0.0 };
        self.stats.peak_memory_bytes = memory::peak();
        Ok(Some(Token { id, logprobs, finish }))
    }

    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// The seed the sampler uses (the request's, or the one picked for it).
    pub fn seed(&self) -> u64 {
        self.sampler.seed()
    }

    /// Ends generation and hands back the cache (for prompt caching by a caller).
    pub fn into_cache(self) -> Vec<KvCache> {
        self.cache
    }
}
