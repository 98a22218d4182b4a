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

/// What an external sampler (a plugin) sees at one position.
pub enum Frame<'a> {
    /// The top-k `(token, logit)` pairs, highest logit first.
    Candidates(&'a mut [(u32, f32)]),
    /// The whole logits row, indexed by token id.
    Logits(&'a mut [f32]),
}

/// An external sampler's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Token(u32),
    /// Sample natively from the (possibly edited) frame.
    Defer,
}

/// A token picker outside the engine (a sampler plugin). With one, decoding is serial: each
/// step's logits are read back and the picker runs before the next step is built.
pub trait ExternalSampler {
    /// `Some(k)`: wants the top-k candidates; `None`: wants the full logits row.
    fn candidates(&self) -> Option<usize>;
    fn sample(&mut self, position: usize, frame: Frame<'_>) -> Result<Pick>;
    /// Called with each committed token, in order.
    fn accept(&mut self, tokens: &[u32]) -> Result<()>;
    /// Whether a failure should hand sampling back to the native sampler (for the rest of
    /// the request) instead of failing it.
    fn fallback(&self) -> bool {
        false
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
    external: Option<Box<dyn ExternalSampler + 'm>>,
    /// Serial mode (external sampler): the input of the next step, once its token is known.
    next_input: Option<Array>,
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
        Self::start_with(model, cache, prompt, sampler, options, None)
    }

    /// As `start_with_cache`, with an optional external sampler that picks every token
    /// (it must already have accepted the whole prompt).
    pub fn start_with(
        model: &'m dyn CausalLm,
        cache: Vec<KvCache>,
        prompt: &[u32],
        sampler: Sampler,
        options: DecodeOptions,
        external: Option<Box<dyn ExternalSampler + 'm>>,
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
            external,
            next_input: None,
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
        let picked = match self.external.as_deref_mut() {
            None => None,
            Some(external) => match pick_external(external, &self.sampler, &logits, position) {
                Ok(token) => Some(token),
                Err(e) if external.fallback() => {
                    tracing::warn!("external sampler failed, falling back to native sampling: {e:#}");
                    self.external = None;
                    None
                }
                Err(e) => return Err(e),
            },
        };
        let token = match picked {
            Some(token) => token,
            None => self.sampler.sample(&logprobs, position)?,
        };
        Ok((token, logprobs.squeeze(&[0])?))
    }

    /// The next token, or `None` once generation has finished.
    pub fn next_token(&mut self) -> Result<Option<Token>> {
        if let Some(input) = self.next_input.take() {
            let position = self.prompt_len + self.generated;
            self.pending = Some(self.step(&input, position)?);
        }
        // Read after the step: a sampler that failed with fallback has just been dropped, and
        // decoding goes back to the pipelined loop.
        let serial = self.external.is_some();
        let Some((y, logprobs)) = self.pending.take() else { return Ok(None) };
        let n = self.generated;
        if !serial && n + 1 < self.options.max_tokens {
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
        if let Some(external) = self.external.as_deref_mut() {
            if let Err(e) = external.accept(&[id]) {
                if !external.fallback() {
                    return Err(e);
                }
                tracing::warn!("external sampler failed, falling back to native sampling: {e:#}");
                self.external = None;
            }
            if finish.is_none() {
                self.next_input = Some(y);
            }
        }
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

/// Runs the external sampler on one step's processed logits (`[1, V]`); returns the chosen
/// token as a `[1]` int32 array, sampling natively from the edited frame on `Pick::Defer`.
fn pick_external(
    external: &mut dyn ExternalSampler,
    sampler: &Sampler,
    logits: &Array,
    position: usize,
) -> Result<Array> {
    let vocab = logits.dim(-1);
    let logits = logits.astype(mlx::Dtype::Float32)?;
    let native = |values: &[f32]| -> Result<usize> {
        let row = Array::from_f32(values, &[1, values.len()])?;
        let lp = row.subtract(&row.logsumexp(&[-1], true)?)?;
        Ok(sampler.sample(&lp, position)?.item_i32()? as usize)
    };
    let id = match external.candidates() {
        Some(k) => {
            let k = k.min(vocab).max(1);
            let idx = logits.negative()?.argpartition(k as i32 - 1, -1)?.slice_axis(-1, 0, k as i32)?;
            let values = logits.take_along_axis(&idx, -1)?.to_vec_f32()?;
            let mut frame: Vec<(u32, f32)> = idx.to_vec_i32()?.into_iter().map(|t| t as u32).zip(values).collect();
            frame.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            match external.sample(position, Frame::Candidates(&mut frame))? {
                Pick::Token(t) => t,
                Pick::Defer => {
                    let values: Vec<f32> = frame.iter().map(|c| c.1).collect();
                    frame[native(&values)?].0
                }
            }
        }
        None => {
            let mut row = logits.to_vec_f32()?;
            match external.sample(position, Frame::Logits(&mut row))? {
                Pick::Token(t) => t,
                Pick::Defer => native(&row)? as u32,
            }
        }
    };
    if id as usize >= vocab {
        bail!("the external sampler picked token {id}, outside the vocabulary of {vocab}");
    }
    Ok(Array::from_i32(&[id as i32], &[1])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SamplingParams;
    use models::testing;

    fn run(
        model: &dyn CausalLm,
        prompt: &[u32],
        params: SamplingParams,
        options: DecodeOptions,
    ) -> (Vec<u32>, Option<FinishReason>) {
        run_with(model, prompt, params, options, None).unwrap()
    }

    /// Generates to the end, with an optional external sampler; returns ids and finish.
    fn run_with(
        model: &dyn CausalLm,
        prompt: &[u32],
        params: SamplingParams,
        options: DecodeOptions,
        external: Option<Box<dyn ExternalSampler>>,
    ) -> Result<(Vec<u32>, Option<FinishReason>)> {
        let sampler = Sampler::new(params, model.vocab_size())?;
        let mut g = Generation::start_with(model, model.make_cache(), prompt, sampler, options, external)?;
        let (mut ids, mut finish) = (Vec::new(), None);
        while let Some(t) = g.next_token()? {
            ids.push(t.id);
            finish = t.finish;
        }
        Ok((ids, finish))
    }

    fn opts(max_tokens: usize) -> DecodeOptions {
        DecodeOptions { max_tokens, eos_token_ids: vec![], prefill_step_size: 5 }
    }

    /// Greedy decoding the slow way: a full forward over the whole sequence per token.
    fn reference_greedy(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut seq: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let mut out = Vec::new();
        for _ in 0..n {
            let logits =
                model.forward(&Array::from_i32(&seq, &[1, seq.len()]).unwrap(), &mut model.make_cache()).unwrap();
            let last = logits.slice_axis(1, seq.len() as i32 - 1, seq.len() as i32).unwrap();
            let id = last.argmax(-1, false).unwrap().item_i32().unwrap();
            out.push(id as u32);
            seq.push(id);
        }
        out
    }

    #[test]
    fn pipelined_greedy_decoding_equals_full_recomputation() {
        for arch in ["llama", "qwen2", "qwen3"] {
            let model = testing::model(arch, 11).unwrap();
            let prompt: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 128).collect();
            let (ids, finish) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(12));
            assert_eq!(ids, reference_greedy(model.as_ref(), &prompt, 12), "{arch}");
            assert_eq!(finish, Some(FinishReason::Length));
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let model = testing::model("llama", 12).unwrap();
        let prompt = [1, 2, 3, 4];
        let p = |seed| SamplingParams { temperature: 1.5, seed: Some(seed), ..Default::default() };
        let a = run(model.as_ref(), &prompt, p(42), opts(24)).0;
        assert_eq!(a, run(model.as_ref(), &prompt, p(42), opts(24)).0);
        assert_ne!(a, run(model.as_ref(), &prompt, p(43), opts(24)).0);
    }

    #[test]
    fn generation_stops_at_an_eos_token_and_yields_it_last() {
        let model = testing::model("qwen2", 13).unwrap();
        let prompt = [5, 6, 7];
        let (free, _) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(10));
        let eos = free[3];
        let first_eos = free.iter().position(|&t| t == eos).unwrap();
        let options = DecodeOptions { eos_token_ids: vec![eos], ..opts(10) };
        let (ids, finish) = run(model.as_ref(), &prompt, SamplingParams::default(), options);
        assert_eq!(ids, free[..=first_eos].to_vec());
        assert_eq!(finish, Some(FinishReason::Stop));
    }

    #[test]
    fn a_strong_repetition_penalty_avoids_recent_tokens() {
        let model = testing::model("llama", 14).unwrap();
        let prompt = [9, 10, 11];
        let params = SamplingParams { repetition_penalty: Some(1e6), repetition_context_size: 8, ..Default::default() };
        let (ids, _) = run(model.as_ref(), &prompt, params, opts(8));
        let mut seq: Vec<u32> = prompt.to_vec();
        for &t in &ids {
            let window = &seq[seq.len().saturating_sub(8)..];
            assert!(!window.contains(&t), "{t} repeats within the window {window:?}");
            seq.push(t);
        }
    }

    /// Picks the lowest-id candidate, records what it saw.
    struct Lowest {
        accepted: std::rc::Rc<std::cell::RefCell<Vec<u32>>>,
        k: Option<usize>,
    }

    impl ExternalSampler for Lowest {
        fn candidates(&self) -> Option<usize> {
            self.k
        }
        fn sample(&mut self, _position: usize, frame: Frame<'_>) -> Result<Pick> {
            Ok(match frame {
                Frame::Candidates(c) => {
                    assert!(c.windows(2).all(|w| w[0].1 >= w[1].1), "candidates are sorted");
                    Pick::Token(c.iter().map(|c| c.0).min().unwrap())
                }
                Frame::Logits(row) => {
                    row.iter_mut().enumerate().for_each(|(i, v)| *v = if i == 7 { 100.0 } else { -100.0 });
                    Pick::Defer
                }
            })
        }
        fn accept(&mut self, tokens: &[u32]) -> Result<()> {
            self.accepted.borrow_mut().extend(tokens);
            Ok(())
        }
    }

    #[test]
    fn an_external_sampler_picks_every_token_and_sees_each_committed_one() {
        let model = testing::model("llama", 16).unwrap();
        let accepted = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let ext = Lowest { accepted: accepted.clone(), k: Some(4) };
        let (ids, _) =
            run_with(model.as_ref(), &[1, 2, 3], SamplingParams::default(), opts(6), Some(Box::new(ext))).unwrap();
        assert_eq!(ids.len(), 6);
        assert_eq!(*accepted.borrow(), ids);
        // Each pick is the lowest id among the step's top 4: check against a fresh forward.
        let mut seq: Vec<i32> = vec![1, 2, 3];
        for &id in &ids {
            let logits =
                model.forward(&Array::from_i32(&seq, &[1, seq.len()]).unwrap(), &mut model.make_cache()).unwrap();
            let n = seq.len() as i32;
            let row = logits.slice_axis(1, n - 1, n).unwrap().to_vec_f32().unwrap();
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            assert_eq!(id as usize, *order[..4].iter().min().unwrap());
            seq.push(id as i32);
        }
        // Deferring over an edited full row samples natively from the edit.
        let ext = Lowest { accepted: Default::default(), k: None };
        let (ids, _) =
            run_with(model.as_ref(), &[1, 2, 3], SamplingParams::default(), opts(3), Some(Box::new(ext))).unwrap();
        assert_eq!(ids, vec![7, 7, 7]);
    }

    /// Picks the best candidate until it fails at call `fail_at`; may allow a fallback.
    struct Broken {
        fallback: bool,
        fail_at: usize,
        calls: usize,
    }

    impl ExternalSampler for Broken {
        fn candidates(&self) -> Option<usize> {
            Some(4)
        }
        fn sample(&mut self, _position: usize, frame: Frame<'_>) -> Result<Pick> {
            self.calls += 1;
            if self.calls >= self.fail_at {
                bail!("broken sampler");
            }
            match frame {
                Frame::Candidates(c) => Ok(Pick::Token(c[0].0)),
                Frame::Logits(_) => Ok(Pick::Defer),
            }
        }
        fn accept(&mut self, _tokens: &[u32]) -> Result<()> {
            Ok(())
        }
        fn fallback(&self) -> bool {
            self.fallback
        }
    }

    #[test]
    fn a_failing_external_sampler_fails_the_generation_unless_fallback_is_allowed() {
        let model = testing::model("qwen3", 17).unwrap();
        let prompt = [4u32, 5, 6];
        let start = |fallback, fail_at| {
            let broken = Broken { fallback, fail_at, calls: 0 };
            run_with(model.as_ref(), &prompt, SamplingParams::default(), opts(5), Some(Box::new(broken)))
        };
        assert!(start(false, 1).unwrap_err().to_string().contains("broken sampler"));
        // Failing at the first call or in the middle: native greedy takes over for the rest,
        // and the generation still runs to its end.
        for fail_at in [1, 3] {
            let (ids, _) = start(true, fail_at).unwrap();
            assert_eq!(ids, reference_greedy(model.as_ref(), &prompt, 5), "fail at call {fail_at}");
        }
    }

    #[test]
    fn bad_prompts_are_refused() {
        let model = testing::model("llama", 15).unwrap();
        let sampler = || Sampler::new(SamplingParams::default(), 128).unwrap();
        let err = Generation::start(model.as_ref(), &[], sampler(), opts(4)).err().unwrap();
        assert!(err.to_string().contains("prompt is empty"));
        let err = Generation::start(model.as_ref(), &[1, 500], sampler(), opts(4)).err().unwrap();
        assert!(err.to_string().contains("token 500 is outside the model's vocabulary of 128"), "{err}");
    }
}
