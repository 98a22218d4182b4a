//! The decode loop, in mlx-lm's pipelined shape: prefill the prompt but its last token in
//! chunks, then for each step build step n+1's graph from step n's lazy token and start it
//! (`async_eval`) before reading step n's token, so graph building overlaps device work.
//!
//! This file reads as prefill, step, yield; stop strings and output formatting live with
//! their callers.

use super::constraint::{self, forced_runs, Guard, Overlap, MAX_FORCED_RUN};
use super::external::pick_external;
use super::hooks::ExternalSampler;
use super::sampling::{log_softmax, Sampler};
use super::speculative::{Drafts, Speculation, Verify};
use super::stats::DecodeStats;
use super::step::{prefill, tokens_array};
use super::step::{DecodeOptions, Token};
use anyhow::{bail, Context, Result};
use mlx::{memory, Array};
use models::{CausalLm, KvCache};
use std::collections::VecDeque;
use std::time::Instant;

/// Optional parts of a generation: a sampler plugin, speculative decoding and a constraint
/// on the output.
#[derive(Default)]
pub struct Hooks<'m> {
    pub external: Option<Box<dyn ExternalSampler + 'm>>,
    pub speculation: Option<Speculation<'m>>,
    pub constraint: Option<Guard>,
}

/// A generation in progress: call [`Generation::next_token`] until it returns `None`.
pub struct Generation<'m> {
    model: &'m dyn CausalLm,
    external: Option<Box<dyn ExternalSampler + 'm>>,
    /// The last committed token when it is not yet in the cache and no step is in flight
    /// (serial mode, speculation): the next forward's input.
    next_input: Option<Array>,
    speculation: Option<Speculation<'m>>,
    /// Masks the logits of every step. Each mask needs the token before it, so a step's
    /// forward is queued before that token is read and its sampling after (`advance`).
    constraint: Option<Guard>,
    /// Committed tokens not yet returned (a verification commits several at once).
    ready: VecDeque<Token>,
    cache: Vec<KvCache>,
    sampler: Sampler,
    options: DecodeOptions,
    /// Prompt plus generated tokens so far, on device; kept only when a processor needs it.
    history: Option<Array>,
    /// The step whose token is read next: (token `[1]`, logprobs `[V]`).
    pending: Option<(Array, Array)>,
    /// A constrained step in flight whose next mask is worked out on a helper thread: its
    /// token's private copy, for `overlapped` to read there.
    pending_copy: Option<mlx::Detached>,
    /// Generation finished with a step still queued behind the last token (see `Drop`).
    abandoned_step: bool,
    /// The device constants a constraint's masks are applied with.
    masking: constraint::Masking,
    /// When a constrained step works out its mask beside other host work (`Overlap`).
    pub(crate) overlap: Overlap,
    /// Whether tokens a constraint forces are committed in runs (`forced_run`); for
    /// measuring, `HOST_FORCED_RUNS=off` turns it off.
    pub(crate) forced_runs: bool,
    prompt_len: usize,
    generated: usize,
    started: Instant,
    first_token_at: Option<Instant>,
    stats: DecodeStats,
}

/// What a generation hands over to go on as a row of a batch (`Generation::hand_over`).
pub struct Handover {
    /// Holds the prompt and every committed token but the last, which the row feeds first.
    pub cache: Vec<KvCache>,
    pub sampler: Sampler,
    /// The generation's, `max_tokens` less the tokens it committed.
    pub options: DecodeOptions,
    pub constraint: Option<Guard>,
    /// What the generation did, to count before it ends.
    pub stats: DecodeStats,
}

/// How many of `drafts` the model's `picks` (at the same positions) agree with, from the first.
pub(super) fn agreement(drafts: &[u32], picks: &[i32]) -> usize {
    drafts.iter().zip(picks).take_while(|(d, p)| **d as i32 == **p).count()
}

/// The most bytes of cache copies that scoring several speculative candidates may make (one
/// copy of the cache per row).
const CANDIDATE_CACHE_BYTES: usize = 256 << 20;

/// A generation ends with no MLX work of its own still running. Generation stops on an
/// end-of-sequence token with the next step already queued (pipelining), or is dropped
/// mid-way with one queued, and dropping its arrays does not stop MLX's stream thread
/// computing it. A process that then exits runs the BLAS library's exit handler while that
/// thread is inside a matrix product: `host generate` hung there (OpenBLAS joining its worker
/// in `blas_thread_shutdown_`) or aborted with a corrupted heap, about one run in a hundred
/// on a 2-core machine. (Nothing else a generation queues outlives the call that queued it.)
impl Drop for Generation<'_> {
    fn drop(&mut self) {
        if self.pending.is_some() || self.abandoned_step {
            if let Err(e) = mlx::synchronize() {
                tracing::warn!("waiting for the last decode step: {e:#}");
            }
        }
    }
}

impl<'m> Generation<'m> {
    /// Prefills `prompt` and queues the first step.
    pub fn start(model: &'m dyn CausalLm, prompt: &[u32], sampler: Sampler, options: DecodeOptions) -> Result<Self> {
        let cache = model.make_cache();
        Self::start_with_cache(model, cache, prompt, sampler, options)
    }

    /// As `start`, continuing from `cache`, which may already hold a prefix of `prompt` (the
    /// whole prompt: what the cache holds is not run again).
    pub fn start_with_cache(
        model: &'m dyn CausalLm,
        cache: Vec<KvCache>,
        prompt: &[u32],
        sampler: Sampler,
        options: DecodeOptions,
    ) -> Result<Self> {
        Self::start_with(model, cache, prompt, sampler, options, Hooks::default())
    }

    /// As `start_with_cache`, with hooks: an external sampler that picks every token (it must
    /// already have accepted the whole prompt) and speculative decoding.
    pub fn start_with(
        model: &'m dyn CausalLm,
        mut cache: Vec<KvCache>,
        prompt: &[u32],
        sampler: Sampler,
        options: DecodeOptions,
        hooks: Hooks<'m>,
    ) -> Result<Self> {
        let Hooks { external, speculation, constraint } = hooks;
        if prompt.is_empty() {
            bail!("the prompt is empty; give at least one token");
        }
        if let Some(s) = &speculation {
            if s.config.verify == Verify::Lossless && external.is_some() {
                bail!("lossless speculative verification works with the native sampler only; plugin samplers are verified exactly (verify: exact)");
            }
            // A recurrent layer rolls a verification back to the state before a rejected
            // draft: it keeps one per position of the longest verified window.
            for c in &mut cache {
                c.keep_snapshots(s.config.num_draft_tokens + 1);
            }
        }
        let vocab = model.vocab_size();
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("prompt token {bad} is outside the model's vocabulary of {vocab}");
        }
        let started = Instant::now();
        memory::reset_peak();
        let cached = cache.first().map_or(0, KvCache::offset);
        if cached >= prompt.len() {
            bail!("the cache holds {cached} positions, not fewer than the prompt's {}", prompt.len());
        }
        let mut generation = Generation {
            model,
            external,
            next_input: None,
            speculation,
            constraint,
            ready: VecDeque::new(),
            cache,
            sampler,
            options,
            history: None,
            pending: None,
            pending_copy: None,
            abandoned_step: false,
            masking: constraint::Masking::default(),
            overlap: Overlap::from_env(),
            forced_runs: forced_runs(),
            prompt_len: prompt.len(),
            generated: 0,
            started,
            first_token_at: None,
            stats: DecodeStats { prompt_tokens: prompt.len() - cached, ..Default::default() },
        };
        let (head, last) = prompt.split_at(prompt.len() - 1);
        if generation.sampler.params().needs_history() {
            generation.history = Some(tokens_array(head)?);
        }
        prefill(model, &mut generation.cache, &head[cached..], generation.options.prefill_step_size)
            .context("prefill")?;
        let first = generation.step(&tokens_array(last)?, generation.prompt_len)?;
        mlx::async_eval(&[&first.0, &first.1])?;
        generation.pending = Some(first);
        Ok(generation)
    }

    /// One forward pass over `input` (`[L]`), returning the lazy next token and logprobs.
    fn step(&mut self, input: &Array, position: usize) -> Result<(Array, Array)> {
        let logits = self.forward(input)?;
        let mask = match self.constraint.as_mut() {
            Some(guard) => {
                // The forward runs while the constraint works out its mask.
                mlx::async_eval(&[&logits])?;
                guard.mask()?
            }
            None => None,
        };
        self.pick(&logits, mask, position)
    }

    /// A step's first half: the forward pass over `input` (`[L]`) and the logits processors,
    /// giving its last position's processed logits `[1, V]`, lazy.
    fn forward(&mut self, input: &Array) -> Result<Array> {
        let len = input.dim(0) as i32;
        let logits = self.model.forward(&input.expand_dims(&[0])?, &mut self.cache)?;
        let logits = logits.slice_axis(1, len - 1, len)?.squeeze(&[1])?;
        if let Some(h) = &self.history {
            self.history = Some(mlx::ops::concatenate(&[h, input], 0)?);
        }
        self.sampler.process(&logits, self.history.as_ref())
    }

    /// A step's second half: the token at `position` from processed `logits` under the
    /// constraint's `mask` (if any), and the log-probabilities it was drawn from, lazy.
    fn pick(&mut self, logits: &Array, mask: Option<constraint::Bits>, position: usize) -> Result<(Array, Array)> {
        let masked;
        let logits = match mask {
            Some(m) => {
                masked = self.masking.apply(logits, &[Some(m)])?;
                &masked
            }
            None => logits,
        };
        let logprobs = log_softmax(logits)?;
        let token = match self.external_pick(logits, position)? {
            Some(token) => token,
            None => self.sampler.sample(&logprobs, position)?,
        };
        Ok((token, logprobs.squeeze(&[0])?))
    }

    /// The next token, or `None` once generation has finished.
    pub fn next_token(&mut self) -> Result<Option<Token>> {
        if self.ready.is_empty() {
            self.advance()?;
        }
        Ok(self.ready.pop_front())
    }

    /// Commits at least one token to `ready`, unless generation has finished.
    fn advance(&mut self) -> Result<()> {
        let entered = Instant::now();
        // A step already in flight, with nothing to build first: this call is one pipelined
        // plain step, the cost speculation is weighed against.
        let in_flight = self.pending.is_some() && self.next_input.is_none();
        // Asked once per step (a scan of the sequence for a match): a speculation that
        // drafts nothing changes nothing, so the answer holds for the plain step too.
        let wants_to_try = self.speculation.as_ref().is_some_and(|s| s.wants_to_try());
        if self.next_input.is_some() && wants_to_try && self.speculate()? {
            return Ok(());
        }
        if let Some(input) = self.next_input.take() {
            let position = self.prompt_len + self.generated;
            self.pending = Some(self.step(&input, position)?);
        }
        let Some((y, logprobs)) = self.pending.take() else { return Ok(()) };
        let copy = self.pending_copy.take();
        let n = self.generated;
        // Serial when a plugin picks tokens (read after the step: a sampler that failed with
        // fallback has just been dropped) or when the next step will likely be speculative;
        // and with a constraint under speculation, so a draft is tried at the very step its
        // match appears (pipelined, tests/e2e's speculation-under-a-constraint case drafted
        // nothing: a match is seen a step late there, and JSON's are short).
        let constrained_speculation = self.constraint.is_some() && self.speculation.is_some();
        let serial = self.external.is_some() || wants_to_try || constrained_speculation;
        let queued = !serial && n + 1 < self.options.max_tokens;
        // Under a constraint only the next step's forward is queued before this step's token
        // is read: its mask needs that token. The mask is then worked out while the forward
        // runs, and the sampling queued behind it — or, when the token is already there and
        // masks take a while, while the forward is being started (`overlapped`).
        let mut forward_queued = None;
        let t0 = Instant::now();
        if queued && self.constraint.is_some() {
            let logits = self.forward(&y)?;
            if self.beside() {
                return self.overlapped(&y, copy, logprobs, logits, t0);
            }
            if self.overlap.merges(|| y.is_available()) {
                return self.merged(&y, logprobs, logits, t0);
            }
            forward_queued = Some(self.dispatch_forward(logits, t0)?);
        } else if queued {
            let next = self.step(&y, self.prompt_len + n + 1)?;
            let t1 = Instant::now();
            if n == 3 {
                // A debugging aid: the graph of one decode step, to compare with mlx-lm's
                // (`mx.export_to_dot`); bench/NOTES.md shows how.
                if let Some(path) = std::env::var_os("HOST_DEBUG_STEP_GRAPH") {
                    let _ = std::fs::write(path, mlx::graph_dot(&[&next.0, &next.1]));
                }
            }
            mlx::async_eval(&[&next.0, &next.1])?;
            let t2 = Instant::now();
            self.stats.build_secs += (t1 - t0).as_secs_f64();
            self.stats.dispatch_secs += (t2 - t1).as_secs_f64();
            self.pending = Some(next);
        }
        let t3 = Instant::now();
        let id = y.item_i32()? as u32;
        if queued {
            self.stats.pipelined_steps += 1;
            self.stats.wait_secs += t3.elapsed().as_secs_f64();
        }
        self.stats.decode_steps += 1;
        if let Some(s) = self.speculation.as_mut() {
            s.adaptive.plain_token();
            if queued && in_flight {
                s.adaptive.plain_step(entered.elapsed().as_secs_f64());
            }
        }
        self.external_accept(id)?;
        if let Some(guard) = self.constraint.as_mut() {
            guard.accept(id)?;
        }
        let finished = self.commit(id, logprobs);
        if finished {
            self.abandoned_step = self.pending.take().is_some() || forward_queued.is_some();
        } else if let Some(logits) = forward_queued {
            let mask = self.constraint.as_mut().map(Guard::mask).transpose()?.flatten();
            self.after_mask(logits, mask)?;
        } else if !queued {
            self.next_input = Some(y);
        }
        Ok(())
    }

    /// Starts a constrained step's forward, built from `t0` on; until it has its sampling it is
    /// a step in flight to wait for.
    fn dispatch_forward(&mut self, logits: Array, t0: Instant) -> Result<Array> {
        let t1 = Instant::now();
        mlx::async_eval(&[&logits])?;
        self.stats.build_secs += (t1 - t0).as_secs_f64();
        self.stats.dispatch_secs += t1.elapsed().as_secs_f64();
        self.abandoned_step = true;
        Ok(logits)
    }

    /// Whether a constrained step's mask is worked out on a helper thread beside the next
    /// forward's start (`overlapped`): when the constraint's masks are slow (`Guard::slow`;
    /// `HOST_MASK_OVERLAP` for measuring).
    fn beside(&self) -> bool {
        self.overlap.beside(self.constraint.as_ref().is_some_and(Guard::slow))
    }

    /// A constrained step whose mask is worked out beside the next forward's start (`logits`,
    /// built from `t0` on): a helper thread reads the token, tells the constraint and asks
    /// it for the next mask while this one starts the forward (MLX's `async_eval`, ~1 ms of
    /// host time for a 1B model on the H200), so neither the mask nor the wait for the
    /// token cost time of their own; then the sampling is queued behind the forward. The
    /// helper waits on `copy`, the token's private copy started with its step
    /// (`queue_pick`, when masks were slow then); without one the token `y` is read here first.
    fn overlapped(
        &mut self,
        y: &Array,
        copy: Option<mlx::Detached>,
        logprobs: Array,
        logits: Array,
        t0: Instant,
    ) -> Result<()> {
        debug_assert!(self.speculation.is_none() && self.external.is_none(), "such steps are serial");
        let t1 = Instant::now();
        let read = match copy {
            Some(copy) => Err(copy),
            None => Ok(y.item_i32()? as u32),
        };
        let t2 = Instant::now();
        let guard = self.constraint.as_mut().expect("a constrained step");
        let (told, dispatched) = constraint::beside(
            move || -> Result<(u32, Result<Option<constraint::Bits>>)> {
                let id = match read {
                    Ok(id) => id,
                    Err(copy) => copy.to_vec_i32()?[0] as u32,
                };
                guard.accept(id)?;
                Ok((id, guard.mask()))
            },
            || mlx::async_eval(&[&logits]),
        );
        self.stats.build_secs += (t1 - t0).as_secs_f64();
        self.stats.wait_secs += (t2 - t1).as_secs_f64();
        self.stats.dispatch_secs += t2.elapsed().as_secs_f64();
        self.abandoned_step = true;
        dispatched?;
        let (id, mask) = told?;
        self.stats.pipelined_steps += 1;
        self.stats.decode_steps += 1;
        self.stats.overlapped_masks += 1;
        if self.commit(id, logprobs) {
            // The mask (of a position past the end) is not needed.
            return Ok(());
        }
        self.after_mask(logits, mask?)
    }

    /// A constrained step whose token `y` is already computed and whose constraint is quick:
    /// the token is read and told to the constraint, the next mask worked out, and the next
    /// step's forward (`logits`, built from `t0` on, not yet started) and its sampling are
    /// started as one (one `async_eval`, as an unconstrained step), rather than the forward
    /// first and the sampling behind it once the mask is known (two).
    fn merged(&mut self, y: &Array, logprobs: Array, logits: Array, t0: Instant) -> Result<()> {
        debug_assert!(self.speculation.is_none() && self.external.is_none(), "such steps are serial");
        let t1 = Instant::now();
        let id = y.item_i32()? as u32;
        self.stats.build_secs += (t1 - t0).as_secs_f64();
        self.stats.wait_secs += t1.elapsed().as_secs_f64();
        let guard = self.constraint.as_mut().expect("a constrained step");
        guard.accept(id)?;
        self.stats.pipelined_steps += 1;
        self.stats.decode_steps += 1;
        self.stats.merged_steps += 1;
        if self.commit(id, logprobs) {
            // The forward, never started, is not needed (the cache's next reader would run it).
            return Ok(());
        }
        let mask = self.constraint.as_mut().expect("a constrained step").mask()?;
        let t2 = Instant::now();
        self.after_mask(logits, mask)?;
        self.stats.dispatch_secs += t2.elapsed().as_secs_f64();
        Ok(())
    }

    /// A constrained step's second half once its mask is known, its forward (`logits`, for
    /// the position after the last committed token) started: the sampling is queued behind
    /// the forward — unless the mask allows one token only. That token comes next whatever
    /// the logits say, and so may more after it (a JSON schema's keys and punctuation): see
    /// `forced_run` (not with penalties over the history, whose logits processing a run's
    /// forward would have to do position by position).
    fn after_mask(&mut self, logits: Array, mask: Option<constraint::Bits>) -> Result<()> {
        let forced = mask.as_deref().and_then(constraint::only_token).is_some();
        match mask {
            Some(mask) if forced && self.forced_runs && self.history.is_none() => self.forced_run(&logits, mask),
            mask => self.queue_pick(&logits, mask, self.prompt_len + self.generated),
        }
    }

    /// Commits the run of tokens the constraint forces from here (`mask`, of the position
    /// after the last committed token, allows one token; the run goes on while the next
    /// mask allows one too, up to `MAX_FORCED_RUN`), feeds them to the model together in
    /// one forward, and queues the sampling of the position after them, under the first
    /// mask that leaves a choice. Without this every forced token would cost a forward and
    /// a sampling of its own. A forced token's log-probabilities are its mask's, as a sampled
    /// one's are (`Masking::forced`). `logits` are the position's, for their dtype.
    fn forced_run(&mut self, logits: &Array, mask: constraint::Bits) -> Result<()> {
        let remaining = self.options.max_tokens.saturating_sub(self.generated);
        let guard = self.constraint.as_mut().expect("a constrained step");
        let mut run = Vec::new();
        let mut current = Some(mask);
        // The mask of the position after the run (`None` inside: anything goes), or `None`
        // when the run ends the output.
        let after = loop {
            let token = match current.as_deref().and_then(constraint::only_token) {
                Some(token) if run.len() < MAX_FORCED_RUN => token,
                _ => break Some(current),
            };
            run.push(token);
            if guard.ends(token) || run.len() == remaining {
                break None;
            }
            guard.accept(token)?;
            current = guard.mask()?;
        };
        let logprobs = self.masking.forced(&run, logits.dim(-1), logits.dtype())?;
        for (i, &token) in run.iter().enumerate() {
            self.stats.forced_tokens += 1;
            let row = logprobs.slice_axis(0, i as i32, i as i32 + 1)?.squeeze(&[0])?;
            if self.commit(token, row) {
                return Ok(());
            }
        }
        let mask = match after {
            Some(mask) => mask,
            // An end-of-sequence token the options do not stop at.
            None => self.constraint.as_mut().expect("a constrained step").mask()?,
        };
        self.stats.decode_steps += 1;
        let input = tokens_array(&run)?.expand_dims(&[0])?;
        let last =
            self.model.forward(&input, &mut self.cache)?.slice_axis(1, run.len() as i32 - 1, run.len() as i32)?;
        let last = self.sampler.process(&last.squeeze(&[1])?, None)?;
        self.queue_pick(&last, mask, self.prompt_len + self.generated)
    }

    /// A constrained step's second half, started behind its forward (`logits`): the step in
    /// flight from here on.
    fn queue_pick(&mut self, logits: &Array, mask: Option<constraint::Bits>, position: usize) -> Result<()> {
        let started = Instant::now();
        let next = self.pick(logits, mask, position)?;
        self.pending_copy = if self.beside() {
            Some(mlx::async_eval_detached(&[&next.0, &next.1], &next.0)?)
        } else {
            mlx::async_eval(&[&next.0, &next.1])?;
            None
        };
        self.stats.picks += 1;
        self.stats.pick_secs += started.elapsed().as_secs_f64();
        self.pending = Some(next);
        self.abandoned_step = false;
        Ok(())
    }

    /// Records a committed token; returns whether generation has finished.
    fn commit(&mut self, id: u32, logprobs: Array) -> bool {
        let now = Instant::now();
        let first = *self.first_token_at.get_or_insert(now);
        if self.generated.is_multiple_of(256) {
            memory::clear_cache();
        }
        self.generated += 1;
        let finish = self.options.finish(id, self.generated);
        if let Some(s) = self.speculation.as_mut() {
            s.seq.push(id);
        }
        let prompt_secs = (first - self.started).as_secs_f64();
        let gen_secs = (now - first).as_secs_f64();
        self.stats.generated_tokens = self.generated;
        self.stats.prompt_tps = if prompt_secs > 0.0 { self.stats.prompt_tokens as f64 / prompt_secs } else { 0.0 };
        self.stats.generation_tps = if gen_secs > 0.0 { self.generated as f64 / gen_secs } else { 0.0 };
        self.stats.peak_memory_bytes = memory::peak();
        self.ready.push_back(Token { id, logprobs, finish });
        finish.is_some()
    }

    /// One speculative step from the last committed token: draft, verify all drafts in one
    /// forward, commit the agreed prefix and the target's next token, trim the rest from the
    /// cache. Returns false (having changed nothing) when the drafter proposes nothing.
    fn speculate(&mut self) -> Result<bool> {
        let remaining = self.options.max_tokens - self.generated;
        let started = Instant::now();
        let spec = self.speculation.as_mut().expect("speculate needs speculation");
        let k = spec.adaptive.k.min(remaining.saturating_sub(1));
        if k == 0 {
            return Ok(false);
        }
        let lossless = spec.config.verify == Verify::Lossless
            && self.sampler.params().temperature > 0.0
            && self.external.is_none();
        let greedy = self.sampler.params().temperature == 0.0;
        let single = self.external.is_some() || self.history.is_some() || self.constraint.is_some();
        let candidates = if greedy && !single && self.model.takes_cache_forks() {
            // Each row copies the cache: keep the copies within CANDIDATE_CACHE_BYTES.
            let held: usize = self.cache.iter().map(|c| c.nbytes()).sum();
            spec.config.candidates().min((CANDIDATE_CACHE_BYTES / held.max(1)).max(1))
        } else {
            1
        };
        let drafts = if candidates > 1 {
            let mut c = spec.drafter.candidates(&spec.seq, k, candidates, &self.sampler)?;
            if c.len() > 1 {
                return self.verify_candidates(c, started).map(|()| true);
            }
            Drafts { tokens: c.pop().unwrap_or_default(), distributions: None }
        } else {
            spec.drafter.draft(&spec.seq, k, &self.sampler, lossless)?
        };
        let k = drafts.tokens.len();
        if k == 0 {
            return Ok(false);
        }
        let drafted_at = Instant::now();
        self.stats.verify_draft_secs += (drafted_at - started).as_secs_f64();
        let last = *spec.seq.last().expect("the sequence holds the prompt");
        self.next_input = None;
        let mut ids = vec![last];
        ids.extend(&drafts.tokens);
        let input = tokens_array(&ids)?;
        let position = self.prompt_len + self.generated; // of the first drafted token
        self.stats.decode_steps += 1;
        let logits = self.model.forward(&input.expand_dims(&[0])?, &mut self.cache)?.squeeze(&[0])?;
        // A mask per position, worked out while the forward runs.
        let masks = match self.constraint.as_mut() {
            Some(guard) => {
                mlx::async_eval(&[&logits])?;
                Some(guard.draft_masks(&drafts.tokens)?)
            }
            None => None,
        };
        let mut logprobs = Vec::with_capacity(k + 1);
        let mut processed = Vec::with_capacity(k + 1);
        // Without history-dependent penalties the logits processors act row by row, so all
        // K+1 rows go through them (and the normalization) at once: a handful of device
        // operations per verify step instead of a handful per row.
        let batched = match &self.history {
            None => {
                let rows = self.sampler.process(&logits, None)?;
                let rows = match &masks {
                    Some(m) => self.masking.apply(&rows, m)?,
                    None => rows,
                };
                let lp = log_softmax(&rows)?;
                for i in 0..=k as i32 {
                    if self.external.is_some() {
                        processed.push(rows.slice_axis(0, i, i + 1)?);
                    }
                    logprobs.push(lp.slice_axis(0, i, i + 1)?);
                }
                Some(lp)
            }
            Some(h) => {
                for i in 0..=k {
                    let row = logits.slice_axis(0, i as i32, i as i32 + 1)?;
                    let history = mlx::ops::concatenate(&[h, &input.slice_axis(0, 0, i as i32 + 1)?], 0)?;
                    let row = self.sampler.process(&row, Some(&history))?;
                    let row = match &masks {
                        Some(m) => self.masking.apply(&row, &m[i..=i])?,
                        None => row,
                    };
                    logprobs.push(log_softmax(&row)?);
                    processed.push(row);
                }
                None
            }
        };
        let emitted = if self.external.is_some() {
            self.stats.verify_build_secs += drafted_at.elapsed().as_secs_f64();
            self.verify_external(&drafts.tokens, &processed, &logprobs, position)?
        } else if lossless {
            self.stats.verify_build_secs += drafted_at.elapsed().as_secs_f64();
            self.verify_lossless(&drafts, &logprobs, position)?
        } else {
            let picks = match batched.filter(|_| greedy) {
                Some(lp) => self.sampler.sample(&lp, position)?,
                None => {
                    let picks: Vec<Array> =
                        (0..=k).map(|i| self.sampler.sample(&logprobs[i], position + i)).collect::<Result<_>>()?;
                    let refs: Vec<&Array> = picks.iter().collect();
                    mlx::ops::concatenate(&refs, 0)?
                }
            };
            let built = Instant::now();
            if self.stats.verifications == 3 {
                // As HOST_DEBUG_STEP_GRAPH, for one verification.
                if let Some(path) = std::env::var_os("HOST_DEBUG_VERIFY_GRAPH") {
                    let _ = std::fs::write(path, mlx::graph_dot(&[&picks]));
                }
            }
            mlx::async_eval(&[&picks])?;
            let dispatched = Instant::now();
            let picks = picks.to_vec_i32()?;
            self.stats.verify_build_secs += (built - drafted_at).as_secs_f64();
            self.stats.verify_dispatch_secs += (dispatched - built).as_secs_f64();
            self.stats.verify_wait_secs += dispatched.elapsed().as_secs_f64();
            picks[..=agreement(&drafts.tokens, &picks)].iter().map(|&t| t as u32).collect()
        };
        let accepted = emitted.len() - 1;
        models::roll_back(&mut self.cache, k - accepted)?;
        if let Some(h) = &self.history {
            self.history = Some(mlx::ops::concatenate(&[h, &input.slice_axis(0, 0, accepted as i32 + 1)?], 0)?);
        }
        self.settle(&emitted, &logprobs, k, started)?;
        Ok(true)
    }

    /// Greedy verification of several candidate continuations as the rows of one batch, over
    /// forks of the cache; the row the model agrees with longest is committed and only its
    /// positions enter the cache.
    fn verify_candidates(&mut self, candidates: Vec<Vec<u32>>, started: Instant) -> Result<()> {
        let spec = self.speculation.as_mut().expect("speculation is on");
        let last = *spec.seq.last().expect("the sequence holds the prompt");
        let rows = candidates.len();
        let width = candidates.iter().map(Vec::len).max().unwrap_or(0) + 1;
        let mut ids = Vec::with_capacity(rows * width);
        for c in &candidates {
            // Shorter rows are padded; nothing past a candidate's own length is accepted.
            ids.push(last as i32);
            ids.extend(c.iter().chain(std::iter::repeat(&last)).take(width - 1).map(|&t| t as i32));
        }
        let input = Array::from_i32(&ids, &[rows, width])?;
        let position = self.prompt_len + self.generated;
        self.next_input = None;
        self.stats.decode_steps += 1;
        let mut forks: Vec<KvCache> = self.cache.iter().map(|c| c.fork_batch(rows)).collect::<models::Result<_>>()?;
        let logits = self.model.forward(&input, &mut forks)?;
        let vocab = logits.dim(2) as i32;
        let lp = log_softmax(&self.sampler.process(&logits.reshape(&[(rows * width) as i32, vocab])?, None)?)?;
        let picks = self.sampler.sample(&lp, position)?.to_vec_i32()?;
        // The longest agreement; among equals the first (most promising) row.
        let (row, accepted) = (0..rows)
            .map(|r| (r, agreement(&candidates[r], &picks[r * width..])))
            .fold((0, 0), |b, x| if x.1 > b.1 { x } else { b });
        for (c, fork) in self.cache.iter_mut().zip(&forks) {
            c.adopt_row(fork, row, accepted + 1)?;
        }
        drop(forks);
        let first = (row * width) as i32;
        let emitted: Vec<u32> = picks[row * width..=row * width + accepted].iter().map(|&t| t as u32).collect();
        let logprobs: Vec<Array> =
            (0..=accepted as i32).map(|i| lp.slice_axis(0, first + i, first + i + 1)).collect::<mlx::Result<_>>()?;
        self.stats.candidate_rows += rows;
        self.settle(&emitted, &logprobs, candidates[row].len(), started)
    }

    /// After a verification that began at `started`: tells the drafter and the adaptive
    /// length what was accepted of `drafted` tokens, commits `emitted` (the accepted drafts
    /// and the model's own next token; `logprobs[i]` is `[1, V]` for `emitted[i]`) and makes
    /// the last one the next input.
    fn settle(&mut self, emitted: &[u32], logprobs: &[Array], drafted: usize, started: Instant) -> Result<()> {
        let accepted = emitted.len() - 1;
        let spec = self.speculation.as_mut().expect("speculation is on");
        spec.drafter.commit(accepted)?;
        let secs = started.elapsed().as_secs_f64();
        spec.adaptive.verify_step(secs, emitted.len());
        self.stats.verifications += 1;
        self.stats.verify_secs += secs;
        spec.adaptive.update(drafted, accepted);
        self.stats.drafted_tokens += drafted;
        self.stats.accepted_tokens += accepted;
        for (&id, lp) in emitted.iter().zip(logprobs) {
            if let Some(guard) = self.constraint.as_mut() {
                guard.accept(id)?;
            }
            if self.commit(id, lp.squeeze(&[0])?) {
                return Ok(());
            }
        }
        let last = *emitted.last().expect("at least one token");
        self.next_input = Some(Array::from_i32(&[last as i32], &[1])?);
        Ok(())
    }

    /// Sample and match with the external sampler, row by row: it sees (and accepts) only
    /// tokens that end up committed, exactly as in plain decoding.
    fn verify_external(
        &mut self,
        drafts: &[u32],
        processed: &[Array],
        logprobs: &[Array],
        position: usize,
    ) -> Result<Vec<u32>> {
        let mut emitted = Vec::new();
        for i in 0..=drafts.len() {
            let token = match self.external_pick(&processed[i], position + i)? {
                Some(token) => token,
                None => self.sampler.sample(&logprobs[i], position + i)?,
            };
            let id = token.item_i32()? as u32;
            self.external_accept(id)?;
            emitted.push(id);
            if i == drafts.len() || drafts[i] != id {
                break;
            }
        }
        Ok(emitted)
    }

    /// Rejection sampling: accept draft i with probability min(1, p_i(d)/q_i(d)); at the
    /// first rejection draw from normalize(max(p_i - q_i, 0)); after K acceptances draw the
    /// bonus token from p_K. Without draft distributions, q is one-hot on the draft.
    fn verify_lossless(
        &self,
        drafts: &super::speculative::Drafts,
        logprobs: &[Array],
        position: usize,
    ) -> Result<Vec<u32>> {
        verify_lossless(&self.sampler, drafts, logprobs, position)
    }

    pub fn stats(&self) -> DecodeStats {
        let mut stats = self.stats;
        if let Some(guard) = &self.constraint {
            stats.masks = guard.masks;
            stats.mask_secs = guard.mask_secs;
            stats.accepts = guard.accepts;
            stats.accept_secs = guard.accept_secs;
        }
        stats.masks_applied = self.masking.applied;
        stats.masks_sent = self.masking.sent;
        stats
    }

    /// Whether the generation can go on as a row of a batch from here (`hand_over`): every
    /// committed token returned, not finished, and no hook a row lacks (speculation; a plugin
    /// sampler, which makes the batch serial).
    pub fn can_hand_over(&self) -> bool {
        self.ready.is_empty()
            && self.speculation.is_none()
            && self.external.is_none()
            && (self.pending.is_some() || self.next_input.is_some())
    }

    /// Ends decoding alone for a batch row to go on where it stopped (`can_hand_over` must
    /// hold): the step in flight, which fed the last committed token and sampled past it, is
    /// given up with that token's KV, so the row's first step feeds it again at the same
    /// position (seeds are keyed by position: the same draw). The constraint has been told
    /// every committed token and nothing else.
    pub fn hand_over(mut self) -> Handover {
        debug_assert!(self.can_hand_over());
        let held = self.prompt_len + self.generated - 1;
        for c in &mut self.cache {
            let extra = c.offset().saturating_sub(held);
            c.trim(extra);
        }
        // Nothing to wait for on drop: what the step in flight writes, the cache's next
        // reader waits for.
        self.pending = None;
        self.pending_copy = None;
        self.abandoned_step = false;
        let mut options = self.options.clone();
        options.max_tokens -= self.generated;
        Handover {
            cache: std::mem::take(&mut self.cache),
            sampler: self.sampler.clone(),
            options,
            stats: self.stats(),
            constraint: self.constraint.take(),
        }
    }

    /// The seed the sampler uses (the request's, or the one picked for it).
    pub fn seed(&self) -> u64 {
        self.sampler.seed()
    }

    /// Ends generation and hands back the cache (for prompt caching by a caller). It holds no
    /// position of a token the caller was not given: a verification commits several tokens at
    /// once, and a caller that stops early leaves some of them unread.
    pub fn into_cache(mut self) -> Vec<KvCache> {
        let unread = self.ready.len();
        for c in &mut self.cache {
            c.trim(unread);
        }
        std::mem::take(&mut self.cache)
    }

    /// The external sampler's pick at `position` from processed logits `[1, V]`; `None` when
    /// there is no external sampler or it just failed and the request allows a fallback.
    fn external_pick(&mut self, logits: &Array, position: usize) -> Result<Option<Array>> {
        let Some(external) = self.external.as_deref_mut() else { return Ok(None) };
        match pick_external(external, &self.sampler, logits, position) {
            Ok(token) => Ok(Some(token)),
            Err(e) => self.external_failed(e).map(|()| None),
        }
    }

    /// Tells the external sampler (if any) that `id` was committed.
    fn external_accept(&mut self, id: u32) -> Result<()> {
        let Some(external) = self.external.as_deref_mut() else { return Ok(()) };
        match external.accept(&[id]) {
            Ok(()) => Ok(()),
            Err(e) => self.external_failed(e),
        }
    }

    /// An external sampler failure fails the generation, unless the request allows falling
    /// back: then native sampling takes over for the rest of it.
    fn external_failed(&mut self, e: anyhow::Error) -> Result<()> {
        if !self.external.as_ref().is_some_and(|x| x.fallback()) {
            return Err(e);
        }
        tracing::warn!("external sampler failed, falling back to native sampling: {e:#}");
        self.external = None;
        Ok(())
    }
}

/// Rejection sampling: accept draft i with probability min(1, p_i(d)/q_i(d)); at the
/// first rejection draw from normalize(max(p_i - q_i, 0)); after K acceptances draw the
/// bonus token from p_K. Without draft distributions, q is one-hot on the draft.
pub(super) fn verify_lossless(
    sampler: &Sampler,
    drafts: &super::speculative::Drafts,
    logprobs: &[Array],
    position: usize,
) -> Result<Vec<u32>> {
    let k = drafts.tokens.len() as i32;
    let rows: Vec<Array> = logprobs.iter().map(|lp| sampler.distribution(lp)).collect::<Result<_>>()?;
    let refs: Vec<&Array> = rows.iter().collect();
    let p_logits = mlx::ops::concatenate(&refs, 0)?.astype(mlx::Dtype::Float32)?;
    let p = p_logits.softmax(&[-1], true)?;
    let p_drafted = p.slice_axis(0, 0, k)?;
    let d = Array::from_i32(&drafts.tokens.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[k as usize, 1])?;
    let p_d = p_drafted.take_along_axis(&d, 1)?;
    let (q_d, residual) = match &drafts.distributions {
        Some(q) => {
            let q = q.astype(mlx::Dtype::Float32)?.softmax(&[-1], true)?;
            let zero = Array::scalar(0.0, mlx::Dtype::Float32)?;
            (q.take_along_axis(&d, 1)?, p_drafted.subtract(&q)?.maximum(&zero)?)
        }
        None => {
            let zeros = Array::zeros(&[k as usize, 1], mlx::Dtype::Float32)?;
            (Array::scalar(1.0, mlx::Dtype::Float32)?.broadcast_to(&[k, 1])?, p_drafted.put_along_axis(&d, &zeros, 1)?)
        }
    };
    // Where the residual is all zero (p == q) rejection cannot happen; fall back to p.
    let mass = residual.sum(&[-1], true)?;
    let zero = Array::scalar(0.0, mlx::Dtype::Float32)?;
    let residual_logits = mlx::ops::where_(&mass.greater(&zero)?, &residual.log()?, &p_logits.slice_axis(0, 0, k)?)?;
    let mut draws = Vec::with_capacity(k as usize + 1);
    for i in 0..k {
        let key = sampler.salted_key(position + i as usize, 2)?;
        draws.push(mlx::random::categorical(&residual_logits.slice_axis(0, i, i + 1)?, -1, &key)?);
    }
    draws.push(mlx::random::categorical(&p_logits.slice_axis(0, k, k + 1)?, -1, &sampler.key(position + k as usize)?)?);
    let refs: Vec<&Array> = draws.iter().collect();
    let draws = mlx::ops::concatenate(&refs, 0)?;
    mlx::eval(&[&p_d, &q_d, &draws])?;
    let (p_d, q_d, draws) = (p_d.to_vec_f32()?, q_d.to_vec_f32()?, draws.to_vec_i32()?);
    let mut emitted = Vec::new();
    for i in 0..k as usize {
        let u = sampler.uniform(position + i, 1);
        if u * (q_d[i] as f64) < p_d[i] as f64 {
            emitted.push(drafts.tokens[i]);
        } else {
            emitted.push(draws[i] as u32);
            return Ok(emitted);
        }
    }
    emitted.push(draws[k as usize] as u32);
    Ok(emitted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::speculative::{SpecConfig, SpecMethod};
    use crate::engine::{FinishReason, Frame, Pick, SamplingParams};
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
        let hooks = Hooks { external, speculation: None, constraint: None };
        let mut g = Generation::start_with(model, model.make_cache(), prompt, sampler, options, hooks)?;
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

    /// The policy the solo and batch steps share: under `Auto` slow masks go beside the next
    /// forward's start, quick ones before it when the token is there (else after it); the
    /// measuring switches force one way whatever the masks cost.
    #[test]
    fn when_a_constrained_step_works_out_its_masks() {
        use Overlap::*;
        let way = |o: Overlap, slow: bool, available: bool| match (o.beside(slow), o.merges(|| available)) {
            (true, _) => "beside",
            (false, true) => "merged",
            (false, false) => "after",
        };
        assert_eq!(way(Auto, true, true), "beside");
        assert_eq!(way(Auto, false, true), "merged");
        assert_eq!(way(Auto, false, false), "after");
        for (slow, available) in [(true, true), (false, false)] {
            assert_eq!(way(Always, slow, available), "beside");
            assert_eq!(way(Merged, slow, available), "merged");
            assert_eq!(way(Never, slow, available), "after");
        }
        // The token's availability is asked only where it decides.
        assert!(!Never.merges(|| panic!("asked")) && Merged.merges(|| panic!("asked")));
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
        let p = |seed| SamplingParams { temperature: 0.6, seed: Some(seed), ..Default::default() };
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

    /// Generates with speculation; returns ids and stats.
    fn run_spec(
        model: &dyn CausalLm,
        draft: Option<&dyn CausalLm>,
        prompt: &[u32],
        params: SamplingParams,
        options: DecodeOptions,
        config: SpecConfig,
        external: Option<Box<dyn ExternalSampler>>,
    ) -> (Vec<u32>, DecodeStats) {
        let speculation = Speculation::new(config, prompt, draft, options.prefill_step_size).unwrap();
        run_hooked(model, prompt, params, options, Hooks { external, speculation: Some(speculation), constraint: None })
    }

    /// Generates to the end with `hooks`; returns ids and stats.
    fn run_hooked(
        model: &dyn CausalLm,
        prompt: &[u32],
        params: SamplingParams,
        options: DecodeOptions,
        hooks: Hooks<'_>,
    ) -> (Vec<u32>, DecodeStats) {
        let sampler = Sampler::new(params, model.vocab_size()).unwrap();
        let mut g = Generation::start_with(model, model.make_cache(), prompt, sampler, options, hooks).unwrap();
        let mut ids = Vec::new();
        while let Some(t) = g.next_token().unwrap() {
            ids.push(t.id);
        }
        (ids, g.stats())
    }

    fn spec(method: SpecMethod, k: usize) -> SpecConfig {
        SpecConfig { method, num_draft_tokens: k, ngram_min: 1, ..Default::default() }
    }

    /// A prompt with repeats, so prompt lookup has something to draft.
    fn repetitive_prompt() -> Vec<u32> {
        let phrase: Vec<u32> = (0..9).map(|i| (i * 13 + 5) % 128).collect();
        phrase.iter().chain(&[77, 78]).chain(&phrase).chain(&phrase[..4]).copied().collect()
    }

    /// A constraint holds every token to its set and ends the output (with the model's
    /// end-of-sequence token) where it ends; the tokens it forces, committed in runs, and
    /// speculative decoding under it, with either drafter, greedy and seeded, give the
    /// tokens of one sampled step a token.
    #[test]
    fn a_constraint_holds_each_token_and_speculation_under_it_gives_the_plain_tokens() {
        use crate::engine::constraint::tests::script;
        let model = testing::model("llama", 21).unwrap();
        let other = testing::model("llama", 22).unwrap();
        let (model, other) = (model.as_ref(), other.as_ref());
        let vocab = model.vocab_size();
        let eos = vocab as u32 - 1;
        let prompt = repetitive_prompt();
        let (free, _) = run(model, &prompt, SamplingParams::default(), opts(24));
        // Each position allows the free token and another; positions 6 and 10-13 only the
        // other: forced, as is the end (the model has one end-of-sequence token).
        let other_of = |t: u32| (t + 7) % 100;
        let forced = |i: usize| i == 6 || (10..14).contains(&i);
        let sets: Vec<Vec<u32>> = free
            .iter()
            .enumerate()
            .map(|(i, &t)| if forced(i) { vec![other_of(t)] } else { vec![t, other_of(t)] })
            .collect();
        assert!(sets.iter().flatten().all(|&t| t != eos));
        let options = DecodeOptions { max_tokens: 60, eos_token_ids: vec![eos], prefill_step_size: 5 };
        let guard = || Some(Guard::start(&script(sets.clone(), vocab), 0, &[eos], vocab).unwrap());
        let decode = |params: &SamplingParams, overlap: Overlap, forced_runs: bool| {
            let sampler = Sampler::new(params.clone(), vocab).unwrap();
            let hooks = Hooks { constraint: guard(), ..Default::default() };
            let mut g =
                Generation::start_with(model, model.make_cache(), &prompt, sampler, options.clone(), hooks).unwrap();
            (g.overlap, g.forced_runs) = (overlap, forced_runs);
            let tokens: Vec<Token> = std::iter::from_fn(|| g.next_token().unwrap()).collect();
            (tokens, g.stats())
        };
        let ids = |tokens: &[Token]| tokens.iter().map(|t| t.id).collect::<Vec<u32>>();
        let seeded = SamplingParams { temperature: 0.8, seed: Some(5), ..Default::default() };
        for params in [SamplingParams::default(), seeded] {
            // Every token sampled under its mask, one step each: the reference.
            let (stepped, stats) = decode(&params, Overlap::Never, false);
            let plain = ids(&stepped);
            assert_eq!(plain.len(), sets.len() + 1, "{plain:?}");
            // Pipelined: every step's forward was queued before the token before it was read,
            // and a mask was made for each position read, none past the end.
            assert_eq!((stats.pipelined_steps, stats.masks), (plain.len(), plain.len()), "{stats:?}");
            assert_eq!(plain.last(), Some(&eos), "the constraint's end is the model's end of sequence");
            for (i, t) in plain[..sets.len()].iter().enumerate() {
                assert!(sets[i].contains(t), "token {i} ({t}) is outside its set {:?}", sets[i]);
            }
            // Forced tokens committed in runs and fed together (1, 4 and the end), with each
            // mask worked out after the next forward's start, beside it, or before it with
            // forward and sampling started as one (the last two as when the device is ahead of
            // the host): the same tokens, and log-probabilities to rounding.
            for overlap in [Overlap::Never, Overlap::Always, Overlap::Merged] {
                let (tokens, stats) = decode(&params, overlap, true);
                assert_eq!(ids(&tokens), plain, "{overlap:?} {params:?}");
                assert_eq!((stats.forced_tokens, stats.masks), (6, plain.len()), "{stats:?}");
                let steps = |way| if overlap == way { plain.len() - 6 } else { 0 };
                assert_eq!(
                    (stats.overlapped_masks, stats.merged_steps),
                    (steps(Overlap::Always), steps(Overlap::Merged))
                );
                for (i, (a, b)) in tokens.iter().zip(&stepped).enumerate() {
                    let (a, b) = (a.logprobs.to_vec_f32().unwrap(), b.logprobs.to_vec_f32().unwrap());
                    let close = a.iter().zip(&b).all(|(x, y)| x == y || (x - y).abs() < 1e-4);
                    assert!(a.len() == b.len() && close, "log-probabilities of token {i}");
                }
            }
            for (draft, method) in [(None, SpecMethod::PromptLookup), (Some(other), SpecMethod::Draft)] {
                let speculation = Speculation::new(spec(method, 3), &prompt, draft, 5).unwrap();
                let hooks = Hooks { speculation: Some(speculation), constraint: guard(), external: None };
                let (ids, stats) = run_hooked(model, &prompt, params.clone(), options.clone(), hooks);
                assert_eq!(ids, plain, "{method:?} {params:?}");
                if method == SpecMethod::Draft {
                    assert!(stats.drafted_tokens > 0 && stats.verifications > 0, "{stats:?}");
                }
            }
        }
    }

    /// A forced run that the constraint follows with "anything": the run stops there and the
    /// next position is sampled freely, its mask asked for once (one mask per position).
    #[test]
    fn a_forced_run_ends_where_the_constraint_lets_anything_follow() {
        use crate::engine::constraint::{Allowed, Constraint, ConstraintSpec};
        struct ThenFree {
            forced: Vec<u32>,
            told: usize,
            vocab: usize,
        }
        impl Constraint for ThenFree {
            fn allowed(&mut self) -> Result<Allowed> {
                let Some(&t) = self.forced.get(self.told) else { return Ok(Allowed::Anything) };
                let mut bits = vec![0u32; self.vocab.div_ceil(32)];
                bits[t as usize / 32] |= 1 << (t % 32);
                Ok(Allowed::Tokens(bits))
            }
            fn accept(&mut self, _: u32) -> Result<()> {
                self.told += 1;
                Ok(())
            }
            fn rollback(&mut self, tokens: usize) -> Result<()> {
                self.told -= tokens;
                Ok(())
            }
        }
        let model = testing::model("llama", 21).unwrap();
        let (model, vocab) = (model.as_ref(), model.vocab_size());
        let prompt = repetitive_prompt();
        let spec = ConstraintSpec::new("then-free", move |_| {
            Ok(Box::new(ThenFree { forced: vec![3, 4, 5], told: 0, vocab }) as Box<dyn Constraint>)
        });
        let options = DecodeOptions { max_tokens: 12, eos_token_ids: vec![], prefill_step_size: 5 };
        let decode = |forced_runs: bool| {
            let sampler = Sampler::new(SamplingParams::default(), vocab).unwrap();
            let hooks = Hooks { constraint: Some(Guard::start(&spec, 0, &[], vocab).unwrap()), ..Default::default() };
            let mut g =
                Generation::start_with(model, model.make_cache(), &prompt, sampler, options.clone(), hooks).unwrap();
            (g.overlap, g.forced_runs) = (Overlap::Never, forced_runs);
            let ids: Vec<u32> = std::iter::from_fn(|| g.next_token().unwrap().map(|t| t.id)).collect();
            (ids, g.stats())
        };
        let (stepped, _) = decode(false);
        let (ids, stats) = decode(true);
        assert_eq!(ids, stepped);
        assert_eq!(ids[..3], [3, 4, 5]);
        // The first token is sampled at the start; 4 and 5 are a run.
        assert_eq!((stats.forced_tokens, stats.masks), (2, ids.len()), "{stats:?}");
    }

    #[test]
    fn speculative_greedy_decoding_is_token_identical_with_both_drafters() {
        for arch in ["llama", "qwen2", "qwen3"] {
            let model = testing::model(arch, 21).unwrap();
            let other = testing::model(arch, 22).unwrap();
            let prompt = repetitive_prompt();
            let (plain, _) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(40));
            for (draft, method) in [(None, SpecMethod::PromptLookup), (Some(other.as_ref()), SpecMethod::Draft)] {
                for k in [1, 3, 8] {
                    let (ids, stats) = run_spec(
                        model.as_ref(),
                        draft,
                        &prompt,
                        SamplingParams::default(),
                        opts(40),
                        spec(method, k),
                        None,
                    );
                    assert_eq!(ids, plain, "{arch} {method:?} k={k}");
                    assert!(stats.drafted_tokens > 0, "{arch} {method:?} k={k}: nothing was drafted");
                    assert_eq!(stats.generated_tokens, 40);
                    // The verification time's parts are measured and add up to at most the whole.
                    let parts = stats.verify_draft_secs
                        + stats.verify_build_secs
                        + stats.verify_dispatch_secs
                        + stats.verify_wait_secs;
                    assert!(stats.verify_build_secs > 0.0 && stats.verify_dispatch_secs + stats.verify_wait_secs > 0.0);
                    assert!(parts <= stats.verify_secs, "{parts} > {}", stats.verify_secs);
                }
            }
        }
    }

    #[test]
    fn greedy_decoding_with_several_prompt_lookup_candidates_is_token_identical() {
        // Candidates are scored as rows of one batch over forks of the cache; the output must
        // not change, whether the winning row is the first or another one, across the cache's
        // 256-position chunk boundary too (a prompt of 250 tokens, 40 generated; there the
        // tiny models tend to loop with one continuation: `models` tests fork and adopt across
        // the boundary directly).
        // The repetitive prompt after 226 pseudo-random tokens.
        let long: Vec<u32> = (0..226u64)
            .scan(7u64, |x, _| {
                *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                Some((*x >> 40) as u32 % 128)
            })
            .chain(repetitive_prompt())
            .collect();
        let mut rows = 0;
        for arch in ["llama", "qwen2", "qwen3"] {
            let model = testing::model(arch, 21).unwrap();
            for prompt in [repetitive_prompt(), long.clone()] {
                let (plain, _) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(40));
                for (k, n) in [(1, 2), (3, 4), (8, 8)] {
                    let config = SpecConfig { candidates: Some(n), ..spec(SpecMethod::PromptLookup, k) };
                    let (ids, stats) =
                        run_spec(model.as_ref(), None, &prompt, SamplingParams::default(), opts(40), config, None);
                    let what = format!("{arch} prompt {} k={k} candidates={n}", prompt.len());
                    assert_eq!(ids, plain, "{what}");
                    rows += stats.candidate_rows;
                    assert_eq!(stats.generated_tokens, 40);
                    if stats.candidate_rows > 0 {
                        // A model whose caches cannot be forked (tensor parallelism) verifies
                        // one candidate at a time, with the same result.
                        let config = SpecConfig { candidates: Some(n), ..spec(SpecMethod::PromptLookup, k) };
                        let no_forks = NoForks(model.as_ref());
                        let (ids, stats) =
                            run_spec(&no_forks, None, &prompt, SamplingParams::default(), opts(40), config, None);
                        assert_eq!((ids, stats.candidate_rows), (plain.clone(), 0), "{what}, no forks");
                    }
                }
            }
        }
        assert!(rows > 0, "no step verified several candidates");
    }

    /// A model whose caches may not be forked, as under tensor parallelism.
    struct NoForks<'a>(&'a dyn CausalLm);

    impl CausalLm for NoForks<'_> {
        fn forward(&self, tokens: &Array, cache: &mut [KvCache]) -> models::Result<Array> {
            self.0.forward(tokens, cache)
        }
        fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> models::Result<Array> {
            self.0.forward_hidden(tokens, cache)
        }
        fn head(&self, hidden: &Array) -> models::Result<Array> {
            self.0.head(hidden)
        }
        fn make_cache(&self) -> Vec<KvCache> {
            self.0.make_cache()
        }
        fn vocab_size(&self) -> usize {
            self.0.vocab_size()
        }
        fn takes_cache_forks(&self) -> bool {
            false
        }
    }

    #[test]
    fn a_draft_identical_to_the_target_accepts_every_draft() {
        let model = testing::model("qwen3", 23).unwrap();
        let same = testing::model("qwen3", 23).unwrap();
        let prompt = [3u32, 4, 5, 6];
        let (plain, _) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(30));
        let (ids, stats) = run_spec(
            model.as_ref(),
            Some(same.as_ref()),
            &prompt,
            SamplingParams::default(),
            opts(30),
            spec(SpecMethod::Draft, 4),
            None,
        );
        assert_eq!(ids, plain);
        assert_eq!(stats.accepted_tokens, stats.drafted_tokens);
        assert!(stats.tokens_per_step() > 3.0, "{} tokens per target step", stats.tokens_per_step());
        // Seeded sampling with coupled draws: the same distributions draw the same tokens.
        let params = SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(5), ..Default::default() };
        let (plain, _) = run(model.as_ref(), &prompt, params.clone(), opts(30));
        let (ids, stats) =
            run_spec(model.as_ref(), Some(same.as_ref()), &prompt, params, opts(30), spec(SpecMethod::Draft, 4), None);
        assert_eq!(ids, plain);
        assert_eq!(stats.accepted_tokens, stats.drafted_tokens);
    }

    #[test]
    fn seeded_sampling_under_speculation_gives_the_plain_tokens() {
        let model = testing::model("llama", 24).unwrap();
        let other = testing::model("llama", 25).unwrap();
        let prompt = repetitive_prompt();
        let cases = [
            SamplingParams { temperature: 0.7, seed: Some(1), ..Default::default() },
            SamplingParams { temperature: 1.0, top_k: 20, min_p: 0.05, seed: Some(2), ..Default::default() },
            // Penalties read the history, which verification extends with the drafts.
            SamplingParams {
                temperature: 0.5,
                repetition_penalty: Some(1.3),
                presence_penalty: Some(0.5),
                seed: Some(3),
                ..Default::default()
            },
            SamplingParams { repetition_penalty: Some(1.2), frequency_penalty: Some(0.3), ..Default::default() },
            // No history: verification processes all rows as one batch (greedy: one argmax).
            SamplingParams {
                logit_bias: std::collections::BTreeMap::from([(5, 4.0), (7, -100.0)]),
                ..Default::default()
            },
        ];
        let mut looked_up = 0;
        for params in cases {
            let (plain, _) = run(model.as_ref(), &prompt, params.clone(), opts(32));
            for (draft, method) in [(None, SpecMethod::PromptLookup), (Some(other.as_ref()), SpecMethod::Draft)] {
                let (ids, stats) =
                    run_spec(model.as_ref(), draft, &prompt, params.clone(), opts(32), spec(method, 4), None);
                assert_eq!(ids, plain, "{params:?} {method:?}");
                // Strong penalties can keep the output free of repeats: nothing to look up.
                match method {
                    SpecMethod::Draft => assert!(stats.drafted_tokens > 0, "{params:?}: {stats:?}"),
                    _ => looked_up += stats.drafted_tokens,
                }
            }
        }
        assert!(looked_up > 0);
    }

    #[test]
    fn an_external_sampler_under_speculation_sees_only_committed_tokens_and_picks_the_same() {
        let model = testing::model("qwen2", 26).unwrap();
        let same = testing::model("qwen2", 26).unwrap();
        let prompt = repetitive_prompt();
        let plain_seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let ext = Lowest { accepted: plain_seen.clone(), k: Some(3) };
        let (plain, _) =
            run_with(model.as_ref(), &prompt, SamplingParams::default(), opts(24), Some(Box::new(ext))).unwrap();
        for (draft, method) in [(None, SpecMethod::PromptLookup), (Some(same.as_ref()), SpecMethod::Draft)] {
            let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
            let ext = Lowest { accepted: seen.clone(), k: Some(3) };
            let (ids, stats) = run_spec(
                model.as_ref(),
                draft,
                &prompt,
                SamplingParams::default(),
                opts(24),
                spec(method, 4),
                Some(Box::new(ext)),
            );
            assert_eq!(ids, plain, "{method:?}");
            assert_eq!(*seen.borrow(), plain, "{method:?}: the sampler accepted exactly the committed tokens");
            assert!(stats.drafted_tokens > 0, "{method:?}");
        }
    }

    #[test]
    fn rollback_across_a_cache_growth_boundary_keeps_later_tokens_correct() {
        // The KV buffers grow every 256 positions: verification of up to 8 drafts from a
        // 250-token prompt writes past 256 and is then trimmed back; prefill chunks of 5.
        let model = testing::model("llama", 27).unwrap();
        let other = testing::model("llama", 28).unwrap();
        let prompt: Vec<u32> = (0..250).map(|i| (i * 31 + 7) % 128).collect();
        let (plain, _) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(20));
        for (draft, method) in [(None, SpecMethod::PromptLookup), (Some(other.as_ref()), SpecMethod::Draft)] {
            let (ids, stats) =
                run_spec(model.as_ref(), draft, &prompt, SamplingParams::default(), opts(20), spec(method, 8), None);
            assert_eq!(ids, plain, "{method:?}");
            assert!(stats.drafted_tokens > stats.accepted_tokens, "{method:?}: some drafts were rejected");
        }
    }

    #[test]
    fn speculation_over_sliding_layers_that_dropped_their_oldest_positions_is_token_identical() {
        // Sliding layers (window 8) keep `models::SLACK` positions beyond their window: a
        // 530-token prompt in chunks of 64 crosses 512 positions, where they drop the oldest,
        // and every rollback after is within what they keep. Prompt lookup (one and four
        // candidates, over forks of the bounded caches) and a draft model with sliding layers.
        let long: Vec<u32> = (0..505).map(|i| (i * 37 + 11) % 128).chain(repetitive_prompt()).collect();
        let options = || DecodeOptions { max_tokens: 24, eos_token_ids: vec![], prefill_step_size: 64 };
        for arch in ["gemma3_text", "gpt_oss", "ministral3"] {
            let model = testing::model(arch, 41).unwrap();
            let other = testing::model(arch, 42).unwrap();
            // A draft that disagrees more often (the tiny sliding models tend to agree).
            let unlike = testing::model("llama", 43).unwrap();
            let sampler = || Sampler::new(SamplingParams::default(), model.vocab_size()).unwrap();
            let mut g = Generation::start(model.as_ref(), &long, sampler(), options()).unwrap();
            let mut plain = Vec::new();
            while let Some(t) = g.next_token().unwrap() {
                plain.push(t.id);
            }
            let cache = g.into_cache();
            assert!(cache[0].start() > 0 && cache[0].window() == Some(8), "{arch}: the sliding layer dropped nothing");
            let configs = [
                (None, spec(SpecMethod::PromptLookup, 8)),
                (None, SpecConfig { candidates: Some(4), ..spec(SpecMethod::PromptLookup, 4) }),
                (Some(other.as_ref()), spec(SpecMethod::Draft, 6)),
                (Some(unlike.as_ref()), spec(SpecMethod::Draft, 6)),
            ];
            let mut rejected = 0;
            for (draft, config) in configs {
                let what = format!("{arch} {:?} candidates {:?}", config.method, config.candidates);
                let (ids, stats) =
                    run_spec(model.as_ref(), draft, &long, SamplingParams::default(), options(), config, None);
                assert_eq!(ids, plain, "{what}");
                assert!(stats.drafted_tokens > 0, "{what}: nothing drafted");
                rejected += stats.drafted_tokens - stats.accepted_tokens;
            }
            assert!(rejected > 0, "{arch}: no draft was rolled back");
        }
    }

    #[test]
    fn the_cache_handed_back_holds_only_tokens_the_caller_read() {
        let model = testing::model("llama", 33).unwrap();
        let same = testing::model("llama", 33).unwrap();
        let prompt = [7u32, 8, 9, 10];
        let sampler = Sampler::new(SamplingParams::default(), model.vocab_size()).unwrap();
        let speculation = Speculation::new(spec(SpecMethod::Draft, 8), &prompt, Some(same.as_ref()), 5).unwrap();
        let hooks = Hooks { external: None, speculation: Some(speculation), constraint: None };
        let mut g =
            Generation::start_with(model.as_ref(), model.make_cache(), &prompt, sampler, opts(30), hooks).unwrap();
        // The identical draft makes each verification commit several tokens; read only 3.
        for _ in 0..3 {
            g.next_token().unwrap().unwrap();
        }
        assert!(g.stats().generated_tokens > 3, "a verification committed more than was read");
        let cache = g.into_cache();
        // Prompt and the first two read tokens; the third is the next input, not yet in it.
        assert_eq!(cache[0].offset(), prompt.len() + 2);
    }

    #[test]
    fn speculation_stops_at_eos_and_max_tokens_like_plain_decoding() {
        let model = testing::model("qwen3", 29).unwrap();
        let same = testing::model("qwen3", 29).unwrap();
        let prompt = [5u32, 6, 7];
        let (free, _) = run(model.as_ref(), &prompt, SamplingParams::default(), opts(12));
        let options = DecodeOptions { eos_token_ids: vec![free[5]], ..opts(12) };
        let (plain, _) = run(model.as_ref(), &prompt, SamplingParams::default(), options.clone());
        let (ids, _) = run_spec(
            model.as_ref(),
            Some(same.as_ref()),
            &prompt,
            SamplingParams::default(),
            options,
            spec(SpecMethod::Draft, 8),
            None,
        );
        assert_eq!(ids, plain);
        for max in [1, 2, 7] {
            let (ids, _) = run_spec(
                model.as_ref(),
                Some(same.as_ref()),
                &prompt,
                SamplingParams::default(),
                opts(max),
                spec(SpecMethod::Draft, 8),
                None,
            );
            assert_eq!(ids, free[..max].to_vec());
        }
    }

    #[test]
    fn lossless_verification_accepts_everything_from_an_identical_draft_and_differs_from_plain_otherwise() {
        let model = testing::model("llama", 30).unwrap();
        let same = testing::model("llama", 30).unwrap();
        let prompt = repetitive_prompt();
        let params = SamplingParams { temperature: 1.0, seed: Some(9), ..Default::default() };
        let lossless = |method| SpecConfig { verify: Verify::Lossless, ..spec(method, 4) };
        let (ids, stats) = run_spec(
            model.as_ref(),
            Some(same.as_ref()),
            &prompt,
            params.clone(),
            opts(40),
            lossless(SpecMethod::Draft),
            None,
        );
        assert_eq!(ids.len(), 40);
        assert_eq!(stats.accepted_tokens, stats.drafted_tokens, "p == q accepts with probability 1");
        let (ids, stats) =
            run_spec(model.as_ref(), None, &prompt, params.clone(), opts(40), lossless(SpecMethod::PromptLookup), None);
        assert_eq!(ids.len(), 40);
        assert!(stats.drafted_tokens > 0);
        // A plugin sampler cannot be verified losslessly.
        let sampler = Sampler::new(params, model.vocab_size()).unwrap();
        let speculation = Speculation::new(lossless(SpecMethod::PromptLookup), &prompt, None, 5).unwrap();
        let ext = Lowest { accepted: Default::default(), k: Some(2) };
        let hooks = Hooks { external: Some(Box::new(ext)), speculation: Some(speculation), constraint: None };
        let err =
            Generation::start_with(model.as_ref(), model.make_cache(), &prompt, sampler, opts(4), hooks).err().unwrap();
        assert!(err.to_string().contains("lossless"), "{err}");
    }

    /// The lossless mode keeps the target's distribution: over many seeds, the first
    /// speculative token (drafted by a different model) is distributed as plain sampling's.
    #[test]
    fn lossless_verification_keeps_the_output_distribution() {
        let model = testing::model("qwen2", 31).unwrap();
        let draft = testing::model("qwen2", 32).unwrap();
        let prompt = [1u32, 2, 3];
        let n = 400;
        let (mut plain, mut specd) = (vec![0f64; 128], vec![0f64; 128]);
        for seed in 0..n {
            let params = SamplingParams { temperature: 0.6, seed: Some(seed), ..Default::default() };
            let (a, _) = run(model.as_ref(), &prompt, params.clone(), opts(3));
            plain[a[1] as usize] += 1.0;
            let config = SpecConfig { verify: Verify::Lossless, ..spec(SpecMethod::Draft, 1) };
            let (b, _) = run_spec(model.as_ref(), Some(draft.as_ref()), &prompt, params, opts(3), config, None);
            specd[b[1] as usize] += 1.0;
        }
        // Total variation distance between the two empirical second-token distributions:
        // 0.11 here; accepting every draft instead (the draft's distribution) gives 0.92.
        let tv: f64 = plain.iter().zip(&specd).map(|(a, b)| (a - b).abs()).sum::<f64>() / (2.0 * n as f64);
        assert!(tv < 0.3, "total variation {tv}");
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
