//! The engine thread: loads the model on its own thread (MLX arrays never leave it) and
//! serves generation jobs from a bounded queue, up to `max_batch` at once, streaming events
//! back. Requests decode together as rows of one batch (`engine/batch.rs`), their prompts
//! prefilled in chunks between the batch's steps, speculative ones included (their drafts
//! verified in the batch's steps); a lone constrained request taking forced runs, speculation
//! under `HOST_SPEC_ROWS=0` and every request of a model that does not batch decode alone,
//! beside the batch.
//! The async server never blocks on MLX: it submits a job and reads a channel.
//!
//! A job ends early when its event receiver is dropped (the client went away): the loop
//! notices at the next token and frees the job's cache.

use super::batch::{Batch, Left, Row};
use super::constraint::takes_forced_runs;
use super::constraint::{ConstraintFailed, Guard};
use super::job::{Cancel, Event, Finish, Job, SpecUsage, TokenLogprob, Usage};
use super::output::{char_split, flush, logprob, route, Tools};
use super::prompt_cache::PromptCache;
use super::scheduler::Policy;
use super::stats::{DecodeStats, EngineStats, SPEC_DRAFTERS};
use super::stop::StopMatcher;
use super::{DecodeOptions, FinishReason, Generation, Hooks, Sampler, SpecMethod, Speculation};

use super::hooks::{PluginFault, PluginRefused, ReasoningOutput, Started, StopRule, TextParser};
use anyhow::{bail, Context, Result};
use mlx::{memory, Array};
use models::{CausalLm, Detokenizer, KvCache, ModelInfo, Tokenizer};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod preempt;

pub(super) struct Worker {
    pub(super) info: ModelInfo,
    pub(super) cache: PromptCache,
    pub(super) stats: Arc<EngineStats>,
    pub(super) prefill_step_size: usize,
    pub(super) max_batch: usize,
    pub(super) step_token_budget: usize,
    /// The queue policy; `None`: first come, first served.
    pub(super) policy: Option<Box<dyn Policy>>,
    pub(super) kv_budget_tokens: Arc<AtomicUsize>,
    /// The running request a pause was last refused for (logged once per request).
    pub(super) not_paused: Option<String>,
    pub(super) abort: Arc<AtomicBool>,
}

impl Active<'_> {
    /// Positions of KV the request holds now (about: prompt prefilled plus tokens generated).
    fn kv_tokens(&self) -> usize {
        let prompt = self.job.request.prompt.len();
        match &self.source {
            Source::Prefill { todo, .. } => prompt - todo.len() - 1,
            Source::Dropped { .. } => 0,
            _ => prompt + self.generated.len(),
        }
    }

    /// Whether it keeps KV of its own while it waits (a dropped request does not).
    fn holds_kv(&self) -> bool {
        !matches!(self.source, Source::Dropped { .. })
    }
}

/// The KV a request may come to hold, in positions: its whole prompt plus every token it may
/// generate, plus `state` (a recurrent model's fixed state per sequence, as positions:
/// `Worker::state_positions`).
fn kv_reserved(job: &Job, state: usize) -> usize {
    job.request.prompt.len() + job.request.max_tokens + state
}

/// Whether speculative requests may be batch rows (`HOST_SPEC_ROWS=0` decodes them alone,
/// beside the batch, as before: for measuring).
fn speculative_rows() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HOST_SPEC_ROWS").map_or(true, |v| v != "0"))
}

/// What generation borrows for as long as the engine thread runs.
#[derive(Clone, Copy)]
pub(super) struct Models<'m> {
    pub(super) model: &'m dyn CausalLm,
    pub(super) draft: Option<&'m dyn CausalLm>,
    pub(super) tokenizer: &'m Tokenizer,
}

/// While requests wait, the policy is asked again at least this often (aging).
const POLICY_INTERVAL: Duration = Duration::from_millis(100);
/// Prompt tokens prefilled per step however full the batch: a budget at or below the batch's
/// rows still lets a joining prompt progress.
const MIN_PREFILL_PER_STEP: usize = 16;

/// A recurrent layer's state is checkpointed at the end of each prompt and, within a long
/// one, at the first chunk's end past every this many positions, so a later request that
/// shares only part of it resumes from the prompt cache (a recurrent state cannot be cut
/// back to the shared prefix as keys and values are). Each checkpoint holds one state per
/// recurrent layer; a cache keeps at most `models::MAX_CHECKPOINTS`.
const CHECKPOINT_EVERY: usize = 4096;

/// A request in the queue: not started yet, or paused by the policy.
enum Waiting<'m> {
    New(Box<Job>),
    Paused(Box<Active<'m>>),
}

impl Waiting<'_> {
    fn job(&self) -> &Job {
        match self {
            Waiting::New(job) => job,
            Waiting::Paused(active) => &active.job,
        }
    }
}

/// Where a running request's tokens come from.
enum Source<'m> {
    /// Decoded alone: speculation under `HOST_SPEC_ROWS=0`, a constrained request running
    /// alone (forced runs), or a model that does not batch.
    Solo(Box<Generation<'m>>),
    /// Its prompt being prefilled into `cache` in chunks between the batch's steps (`todo`
    /// is what is left of it, but the last token; a request that leaves stops it between
    /// chunks); then it joins the batch or starts decoding alone.
    Prefill { cache: Vec<KvCache>, todo: Vec<u32>, then: Then<'m> },
    /// A row of the batch, keyed by the job's `seq`.
    Batched,
    /// Paused out of the batch; it rejoins with its row and cache.
    Parked(Box<Left<'m>>),
    /// Preempted when memory was short: its KV went to the prompt cache and was freed. On
    /// resuming, `sequence` (the tokens it had, the last one still to feed) is prefilled again
    /// from whatever prefix the prompt cache still holds, and it goes on as `then`.
    Dropped { sequence: Vec<u32>, then: Then<'m> },
}

/// What a prefilled request becomes.
enum Then<'m> {
    /// A row of the batch.
    Batch(Box<Row<'m>>),
    /// A generation of its own, started from the prefilled cache.
    Solo(Box<(Sampler, DecodeOptions, Hooks<'m>)>),
}

/// A request being served: its generation and its text pipeline.
struct Active<'m> {
    job: Job,
    source: Source<'m>,
    detok: Detokenizer<'m>,
    stop: StopMatcher,
    /// Stop-rule plugins.
    stop_rules: Vec<Box<dyn StopRule>>,
    hold: usize,
    held: String,
    tools: Option<Tools>,
    /// The reasoning parser: the model's thinking goes out as `Event::Reasoning`.
    reasoning: Option<Box<dyn TextParser<ReasoningOutput>>>,
    /// The reply's forced opening (`JobRequest::reply_prefix`), until the first text goes out:
    /// through the tool adapter, or as content when the adapter is off.
    reply_prefix: Option<String>,
    generated: Vec<u32>,
    reused: usize,
    finish: Option<Finish>,
}

/// The event for a failed job: a refused plugin config (400), a plugin fault, or an
/// internal error.
fn failure(e: anyhow::Error) -> Event {
    if let Some(r) = e.chain().find_map(|c| c.downcast_ref::<PluginRefused>()) {
        Event::Refused(r.0.clone())
    } else if let Some(f) = e.chain().find_map(|c| c.downcast_ref::<PluginFault>()) {
        tracing::warn!("{}", f.0);
        Event::PluginFault(f.0.clone())
    } else if let Some(c) = e.chain().find_map(|c| c.downcast_ref::<ConstraintFailed>()) {
        tracing::warn!("{}", c.message);
        Event::Constraint { param: c.param, message: c.message.clone() }
    } else {
        tracing::error!("generation failed: {e:#}");
        Event::Error(format!("{e:#}"))
    }
}

impl Worker {
    /// The engine loop: take jobs into the queue, let the policy order it (and pause or
    /// cancel), start waiting requests while slots are free and the memory budget allows,
    /// then advance everything running by a token: prefill chunks of joining prompts within
    /// the step's token budget, one batch step, one token of each request decoding alone.
    pub(super) fn run<'m>(mut self, m: Models<'m>, rx: Receiver<Job>) {
        let mut waiting: Vec<Waiting<'m>> = Vec::new();
        let mut running: Vec<Active<'m>> = Vec::new();
        let mut batch = Batch::new(m.model);
        let mut dirty = false;
        let mut decided = Instant::now();
        loop {
            if self.abort.load(Ordering::SeqCst) {
                let cancel = Event::Cancelled(Cancel {
                    message: "the server is shutting down: this request was stopped after the shutdown grace period; retry it on a running server".into(),
                    shutdown: true,
                });
                for job in running.iter().map(|a| &a.job).chain(waiting.iter().map(Waiting::job)) {
                    let _ = job.events.send(cancel.clone());
                }
                while let Ok(job) = rx.try_recv() {
                    let _ = job.events.send(cancel.clone());
                }
                break;
            }
            if running.is_empty() && waiting.is_empty() {
                match rx.recv() {
                    Ok(job) => waiting.push(Waiting::New(Box::new(job))),
                    Err(_) => break,
                }
                dirty = true;
            }
            while let Ok(job) = rx.try_recv() {
                waiting.push(Waiting::New(Box::new(job)));
                dirty = true;
            }
            // Requests whose client went away leave the queue.
            waiting.retain_mut(|w| {
                let closed = w.job().events.is_closed();
                if closed && matches!(w, Waiting::New(_)) {
                    self.stats.queue_depth.fetch_sub(1, Ordering::SeqCst);
                }
                !closed
            });
            if self.policy.is_some() && !waiting.is_empty() && (dirty || decided.elapsed() >= POLICY_INTERVAL) {
                self.schedule(&mut waiting, &mut running, &mut batch);
                dirty = false;
                decided = Instant::now();
            }
            let turn = Instant::now();
            self.admit(m, &mut waiting, &mut running, &mut batch);
            let mut ended: Vec<(usize, Option<anyhow::Error>)> = Vec::new();
            let admitted = turn.elapsed();
            self.prefill_some(m, &mut running, &mut batch, &mut ended);
            if self.abort.load(Ordering::SeqCst) {
                continue; // stopped inside a prefill: the loop's top ends every request
            }
            let prefilled = turn.elapsed();
            self.rebalance(m, &mut running, &mut batch, &mut ended);
            // Where a turn's time goes (`HOST_LOG=host::engine::worker=trace`).
            tracing::trace!(
                running = running.len(),
                rows = batch.len(),
                admit_ms = admitted.as_secs_f64() * 1e3,
                prefill_ms = (prefilled - admitted).as_secs_f64() * 1e3,
                "engine turn"
            );
            if !batch.is_empty() {
                self.stats.batch_step(batch.len());
                let stepping = Instant::now();
                let stepped = batch.step_with(self.policy.as_deref_mut());
                tracing::trace!(rows = batch.len(), step_ms = stepping.elapsed().as_secs_f64() * 1e3, "batch step");
                match stepped {
                    Ok(tokens) => {
                        for (key, token) in tokens {
                            let Some(i) = running.iter().position(|a| a.job.seq == key) else { continue };
                            // A speculative row's tokens after its text ended (a stop string).
                            if ended.iter().any(|(j, _)| *j == i) {
                                continue;
                            }
                            match token.and_then(|token| self.deliver(m, &mut running[i], token)) {
                                Ok(false) => {}
                                Ok(true) => ended.push((i, None)),
                                Err(e) => ended.push((i, Some(e))),
                            }
                        }
                    }
                    // A failed step fails every row of the batch (an MLX error, not a request's).
                    Err(e) => {
                        let message = format!("{e:#}");
                        for (i, a) in running.iter().enumerate() {
                            if matches!(a.source, Source::Batched) {
                                ended.push((i, Some(anyhow::anyhow!("{message}"))));
                            }
                        }
                    }
                }
            }
            for (i, a) in running.iter_mut().enumerate() {
                let Source::Solo(generation) = &mut a.source else { continue };
                let result = match generation.next_token() {
                    Ok(Some(token)) => self.deliver(m, a, token),
                    Ok(None) => Ok(true),
                    Err(e) => Err(e),
                };
                match result {
                    Ok(false) => {}
                    Ok(true) => ended.push((i, None)),
                    Err(e) => ended.push((i, Some(e))),
                }
            }
            // Closed streams of rows that produced nothing this turn (prefilling, parked).
            for (i, a) in running.iter().enumerate() {
                if a.job.events.is_closed() && !ended.iter().any(|(j, _)| *j == i) {
                    ended.push((i, None));
                }
            }
            ended.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
            ended.dedup_by_key(|(i, _)| *i);
            let any_ended = !ended.is_empty();
            for (i, error) in ended {
                let active = running.remove(i);
                let outcome = match error {
                    None => self.finish(active, &mut batch),
                    Some(e) => {
                        let _ = active.job.events.send(failure(e));
                        self.discard(active, &mut batch)
                    }
                };
                if let Err(e) = outcome {
                    tracing::error!("finishing a generation failed: {e:#}");
                }
            }
            if any_ended {
                dirty = true;
                self.stats.prompt_cache_bytes.store(self.cache.bytes(), Ordering::Relaxed);
                self.stats.active_memory.store(memory::active(), Ordering::Relaxed);
            }
            self.stats.running.store(running.len(), Ordering::Relaxed);
            self.stats.batch_rows.store(batch.len(), Ordering::Relaxed);
            self.stats.batch_kv_bytes.store(batch.kv_bytes(), Ordering::Relaxed);
            let crate::engine::batch::Verified { steps: verifications, drafts: drafted, .. } = batch.verified();
            self.stats.batch_verifications.store(verifications, Ordering::Relaxed);
            self.stats.batch_draft_tokens.store(drafted, Ordering::Relaxed);
        }
        // Stopped (shutdown, or the queue closed): no MLX work of a request outlives this
        // thread. A prefill's chunk is started before the one after it is built, so an
        // abandoned prefill could leave one running; the process then exited under it
        // (SIGSEGV in CI's orphaned-prefill shutdown test), as `Generation`'s `Drop` says.
        if let Err(e) = mlx::synchronize() {
            tracing::warn!("waiting for the engine's last device work: {e:#}");
        }
    }

    /// Starts waiting requests, in the queue's order, while a slot is free and (when the
    /// server set a memory budget) the KV every running request may come to hold, with the
    /// next one's, fits it; the first request always starts when nothing runs.
    fn admit<'m>(
        &mut self,
        m: Models<'m>,
        waiting: &mut Vec<Waiting<'m>>,
        running: &mut Vec<Active<'m>>,
        batch: &mut Batch<'m>,
    ) {
        let budget = self.kv_budget_tokens.load(Ordering::Relaxed);
        while running.len() < self.max_batch && !waiting.is_empty() {
            let state = self.state_positions();
            let reserved: usize = running.iter().map(|a| kv_reserved(&a.job, state)).sum();
            if budget > 0 && !running.is_empty() && reserved + kv_reserved(waiting[0].job(), state) > budget {
                break;
            }
            match waiting.remove(0) {
                Waiting::Paused(mut active) => {
                    match std::mem::replace(&mut active.source, Source::Batched) {
                        Source::Parked(left) => {
                            let Left { row, cache } = *left;
                            if let Err(e) = batch.join(row, &cache) {
                                let _ = active.job.events.send(failure(e));
                                continue;
                            }
                        }
                        Source::Dropped { sequence, then } => {
                            active.source = self.recompute(m, &active.job, sequence, then)
                        }
                        other => active.source = other,
                    }
                    running.push(*active);
                }
                Waiting::New(job) => {
                    self.stats.queue_depth.fetch_sub(1, Ordering::SeqCst);
                    if job.events.is_closed() {
                        continue;
                    }
                    let alone = running.is_empty();
                    match self.start(m, *job, alone) {
                        Ok(active) => running.push(active),
                        Err((job, e)) => {
                            let _ = job.events.send(failure(e));
                        }
                    }
                }
            }
        }
    }

    /// Prefills the prompts of joining requests, oldest first, up to the step's token budget
    /// (less a token per batch row, at least `MIN_PREFILL_PER_STEP`); a prompt done joins the
    /// batch. Chunks of similar length go through one forward together where the model allows
    /// it (`step::prefill_together`: requests arriving at once are prefilled as one batch);
    /// the rest one by one.
    fn prefill_some<'m>(
        &mut self,
        m: Models<'m>,
        running: &mut [Active<'m>],
        batch: &mut Batch<'m>,
        ended: &mut Vec<(usize, Option<anyhow::Error>)>,
    ) {
        let mut budget = self.step_token_budget.saturating_sub(batch.len()).max(MIN_PREFILL_PER_STEP);
        // This turn's chunks by request (empty for a resumed request whose KV the prompt cache
        // held whole: it only joins).
        let mut turn: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, a) in running.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            let Source::Prefill { todo, .. } = &mut a.source else { continue };
            if a.job.events.is_closed() {
                continue;
            }
            let n = todo.len().min(budget);
            turn.push((i, todo.drain(..n).collect()));
            budget -= n;
        }
        // Chunks near the longest in length go through one forward (`step::joint_rows`).
        let lens: Vec<usize> = turn.iter().map(|(_, c)| c.len()).collect();
        let together: Vec<usize> = (turn.iter().zip(super::step::joint_rows(m.model, &lens)))
            .filter_map(|(&(i, _), joint)| joint.then_some(i))
            .collect();
        if !together.is_empty() {
            if self.abort.load(Ordering::SeqCst) {
                return; // shutting down: the loop's next turn ends every request
            }
            let chunks: Vec<&[u32]> = turn.iter().filter(|(i, _)| together.contains(i)).map(|(_, c)| &c[..]).collect();
            let mut caches: Vec<&mut Vec<KvCache>> = (running.iter_mut().enumerate())
                .filter(|(i, _)| together.contains(i))
                .filter_map(|(_, a)| match &mut a.source {
                    Source::Prefill { cache, .. } => Some(cache),
                    _ => None,
                })
                .collect();
            let started = Instant::now();
            let prefilled = super::step::prefill_together(m.model, &mut caches, &chunks, self.prefill_step_size);
            tracing::trace!(
                rows = chunks.len(),
                tokens = chunks.iter().map(|c| c.len()).sum::<usize>(),
                ms = started.elapsed().as_secs_f64() * 1e3,
                "joint prefill"
            );
            match prefilled {
                Ok(()) => {
                    self.stats.prefilled_together.fetch_add(chunks.len(), Ordering::Relaxed);
                }
                Err(e) => {
                    let message = format!("{:#}", e.context("prefill"));
                    ended.extend(together.iter().map(|&i| (i, Some(anyhow::anyhow!("{message}")))));
                }
            }
        }
        // The requests whose prompts are done join the batch together, after the loop (one
        // copy of the batch's KV for all of them).
        let mut joining: Vec<(usize, Row<'m>, Vec<KvCache>)> = Vec::new();
        for (i, chunk) in turn {
            let a = &mut running[i];
            let Source::Prefill { cache, todo, .. } = &mut a.source else { continue };
            if ended.iter().any(|(j, _)| *j == i) {
                continue; // its joint prefill failed
            }
            // (A resumed request whose KV the prompt cache held whole has nothing to prefill.)
            if !chunk.is_empty() && !together.contains(&i) {
                let abort = &self.abort;
                let stop = || abort.load(Ordering::SeqCst);
                match super::step::prefill_until(m.model, cache, &chunk, self.prefill_step_size, &stop)
                    .context("prefill")
                {
                    Ok(true) => {}
                    // Shutting down: the loop's next turn ends every request (those done
                    // still join, below: a request is in the batch once it left `Prefill`).
                    Ok(false) => break,
                    Err(e) => {
                        ended.push((i, Some(e)));
                        continue;
                    }
                }
            }
            // A recurrent model's states are kept where a later prompt may resume them: the
            // prompt's end, and every CHECKPOINT_EVERY positions of a long one.
            if !chunk.is_empty() && self.info.recurrent_layers > 0 {
                let held = cache.first().map_or(0, KvCache::offset);
                let crossed = held / CHECKPOINT_EVERY > (held - chunk.len()) / CHECKPOINT_EVERY;
                if todo.is_empty() || crossed {
                    cache.iter_mut().for_each(KvCache::checkpoint);
                }
            }
            if todo.is_empty() && !ended.iter().any(|(j, _)| *j == i) {
                let Source::Prefill { cache, then, .. } = std::mem::replace(&mut a.source, Source::Batched) else {
                    unreachable!("matched above")
                };
                match then {
                    Then::Batch(row) => joining.push((i, *row, cache)),
                    Then::Solo(start) => {
                        let (sampler, options, hooks) = *start;
                        let started =
                            Generation::start_with(m.model, cache, &a.job.request.prompt, sampler, options, hooks)
                                .map(|g| a.source = Source::Solo(Box::new(g)));
                        if let Err(e) = started {
                            ended.push((i, Some(e)));
                        }
                    }
                }
            }
        }
        if joining.is_empty() {
            return;
        }
        let at: Vec<usize> = joining.iter().map(|(i, ..)| *i).collect();
        let (rows, caches): (Vec<Row<'m>>, Vec<Vec<KvCache>>) = joining.into_iter().map(|(_, r, c)| (r, c)).unzip();
        if let Err(e) = batch.join_all(rows.into_iter().zip(caches.iter().map(Vec::as_slice)).collect()) {
            let message = format!("{e:#}");
            ended.extend(at.into_iter().map(|i| (i, Some(anyhow::anyhow!("{message}")))));
        }
    }

    /// Moves a constrained request between decoding alone and the batch: alone (a generation
    /// of its own, which takes a constraint's forced tokens in runs: `takes_forced_runs`)
    /// while it is the only running request, a batch row (one forward for every request)
    /// as soon as another joins the batch. Either way it goes on at the position where it
    /// stopped, with the same sampler, constraint and remaining `max_tokens`.
    fn rebalance<'m>(
        &mut self,
        m: Models<'m>,
        running: &mut [Active<'m>],
        batch: &mut Batch<'m>,
        ended: &mut Vec<(usize, Option<anyhow::Error>)>,
    ) {
        if !m.model.batches() {
            return;
        }
        let sequence = |a: &Active<'_>| -> Vec<u32> {
            let mut s = a.job.request.prompt.clone();
            s.extend(&a.generated);
            s
        };
        // The batch's only row, nothing else running (a request prefilling would join next).
        if let [a @ Active { source: Source::Batched, .. }] = running {
            if batch.len() != 1 || !batch.row(a.job.seq).is_some_and(Row::takes_forced_runs) {
                return;
            }
            let alone = (|| -> Result<()> {
                let Some(Left { row, cache }) = batch.leave(a.job.seq)? else { return Ok(()) };
                let (sampler, options, constraint) = row.into_parts();
                let hooks = Hooks { constraint, ..Default::default() };
                let generation = Generation::start_with(m.model, cache, &sequence(a), sampler, options, hooks)?;
                a.source = Source::Solo(Box::new(generation));
                Ok(())
            })();
            if let Err(e) = alone {
                ended.push((0, Some(e.context("moving a request out of the batch"))));
            }
        } else if !batch.is_empty() {
            for (i, a) in running.iter_mut().enumerate() {
                if !matches!(&a.source, Source::Solo(g) if g.can_hand_over()) {
                    continue;
                }
                let Source::Solo(generation) = std::mem::replace(&mut a.source, Source::Batched) else {
                    unreachable!("matched above")
                };
                let handover = generation.hand_over();
                self.stats.forced_tokens.fetch_add(handover.stats.forced_tokens, Ordering::Relaxed);
                let sequence = sequence(a);
                let joined = (|| -> Result<()> {
                    let held = handover.cache.first().map_or(0, KvCache::offset);
                    if held + 1 != sequence.len() {
                        bail!(
                            "a generation handed over a cache of {held} positions for a sequence of {}",
                            sequence.len()
                        );
                    }
                    let row = Row::new(a.job.seq, &sequence, handover.sampler, handover.options)?;
                    batch.join(row.with_constraint(handover.constraint), &handover.cache)
                })();
                if let Err(e) = joined {
                    ended.push((i, Some(e.context("moving a request into the batch"))));
                }
            }
        }
    }

    /// The positions of keys and values one sequence's recurrent state weighs as much as (0
    /// without recurrent layers): what each request reserves beside its own in the budget.
    fn state_positions(&self) -> usize {
        self.info.recurrent_state_bytes.div_ceil(self.info.kv_bytes_per_token.max(1))
    }

    /// Stores `cache` in the prompt cache under the leading tokens of `sequence` it holds (a
    /// cache holding more positions than `sequence` has tokens is not stored, nor one whose
    /// recurrent state was asked to drop positions it could not). A recurrent layer keeps
    /// its checkpoints, not the snapshots of its last steps.
    fn keep_cache(&mut self, sequence: &[u32], mut cache: Vec<KvCache>) -> Result<()> {
        let held = cache.first().map_or(0, models::KvCache::offset);
        if held == 0 || held > sequence.len() || cache.iter().any(KvCache::stale) {
            return Ok(());
        }
        cache.iter_mut().for_each(KvCache::drop_snapshots);
        let state: Vec<&Array> = cache.iter().flat_map(models::KvCache::state).collect();
        mlx::eval(&state)?;
        self.cache.insert(sequence[..held].to_vec(), cache);
        Ok(())
    }

    /// The prompt cache's longest prefix of `tokens` and how many tokens it holds, or a fresh
    /// cache and 0.
    fn cached_prefix(&mut self, m: Models<'_>, tokens: &[u32]) -> (Vec<KvCache>, usize) {
        match self.cache.take(tokens) {
            Some(r) => (r.cache, r.reused),
            None => (m.model.make_cache(), 0),
        }
    }

    /// A dropped request resuming: its KV again from the longest prefix the prompt cache
    /// holds, the rest prefilled in the engine loop's chunks before it goes on as `then`.
    fn recompute<'m>(&mut self, m: Models<'m>, job: &Job, sequence: Vec<u32>, then: Then<'m>) -> Source<'m> {
        let (cache, reused) = self.cached_prefix(m, &sequence);
        let todo = sequence[reused..sequence.len() - 1].to_vec();
        tracing::info!(
            request = job.key(),
            from_prompt_cache = reused,
            recomputed = todo.len(),
            "resumed a dropped request"
        );
        Source::Prefill { cache, todo, then }
    }

    /// Starts a job: prompt-cache lookup, plugins, prefill; sends `Started`.
    #[allow(clippy::result_large_err)]
    /// A request that is `alone` (nothing else running) and whose constraint may force runs of
    /// tokens decodes as a generation of its own, which takes them (`rebalance` moves it into
    /// the batch when another request joins). A speculative request is a batch row (every
    /// model that batches verifies rows' drafts together), unless `HOST_SPEC_ROWS=0`.
    fn start<'m>(
        &mut self,
        m: Models<'m>,
        job: Job,
        alone: bool,
    ) -> std::result::Result<Active<'m>, (Job, anyhow::Error)> {
        let request = &job.request;
        let prompt = &request.prompt;
        let (cache, reused) = self.cached_prefix(m, prompt);
        if reused > 0 {
            self.stats.prompt_cache_hits.fetch_add(1, Ordering::Relaxed);
        }
        let started = (|| -> Result<_> {
            let sampler = Sampler::new(request.sampling.clone(), self.info.vocab_size)?;
            let seed = sampler.seed();
            let options = DecodeOptions {
                max_tokens: request.max_tokens,
                eos_token_ids: self.info.eos_token_ids.clone(),
                prefill_step_size: self.prefill_step_size,
            };
            let plugins = match &request.hooks {
                Some(hooks) => hooks.start(prompt, seed, self.info.vocab_size)?,
                None => Started::default(),
            };
            let (external, rest) = (plugins.sampler, (plugins.stops, plugins.tools, plugins.reasoning));
            let speculation = match request.speculative.method {
                SpecMethod::Off => None,
                _ => Some(Speculation::new(request.speculative.clone(), prompt, m.draft, self.prefill_step_size)?),
            };
            let vocab = self.info.vocab_size;
            if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
                bail!("prompt token {bad} is outside the model's vocabulary of {vocab}");
            }
            let constraint = request
                .constraint
                .as_ref()
                .map(|c| Guard::start(c, seed, &options.eos_token_ids, vocab))
                .transpose()?;
            // Both prefill in the engine loop's chunks (cancellable, interleaved with decoding).
            // (A speculative one stays a batch row: its drafts do what the runs would.)
            let runs = alone
                && speculation.is_none()
                && takes_forced_runs(constraint.is_some(), external.is_some(), sampler.params());
            // A speculative request is a batch row (`HOST_SPEC_ROWS=0`: it decodes alone).
            let batched = speculation.is_none() || speculative_rows();
            let then = if batched && m.model.batches() && !runs {
                let row = Row::new(job.seq, prompt, sampler, options)?.with_external(external);
                Then::Batch(Box::new(row.with_constraint(constraint).with_speculation(speculation)))
            } else {
                Then::Solo(Box::new((sampler, options, Hooks { external, speculation, constraint })))
            };
            let source = Source::Prefill { cache, todo: prompt[reused..prompt.len() - 1].to_vec(), then };
            Ok((source, rest))
        })();
        let (source, (stop_rules, tools, reasoning)) = match started {
            Ok(parts) => parts,
            Err(e) => return Err((job, e)),
        };
        self.stats.prompt_tokens.fetch_add(prompt.len(), Ordering::Relaxed);
        self.stats.cached_tokens.fetch_add(reused, Ordering::Relaxed);
        let _ = job.events.send(Event::Started { prompt_tokens: prompt.len(), cached_tokens: reused });
        let hold = stop_rules.iter().map(|r| r.hold()).max().unwrap_or(0);
        let stop = StopMatcher::new(&request.stop);
        let reply_prefix = request.reply_prefix.clone();
        Ok(Active {
            job,
            source,
            detok: Detokenizer::new(m.tokenizer),
            stop,
            stop_rules,
            hold,
            held: String::new(),
            tools: tools.map(|adapter| Tools { adapter, calls: 0 }),
            reasoning,
            reply_prefix,
            generated: Vec::new(),
            reused,
            finish: None,
        })
    }

    /// Passes a generated token's text down the pipeline (stop-rule plugins, stop strings,
    /// the tool adapter) to the client. `Ok(true)` when the request is over.
    fn deliver(&mut self, m: Models<'_>, a: &mut Active<'_>, token: super::Token) -> Result<bool> {
        if a.job.events.is_closed() {
            return Ok(true);
        }
        a.generated.push(token.id);
        self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let is_eos = token.finish == Some(FinishReason::Stop);
        let logprobs = match a.job.request.top_logprobs {
            Some(k) => vec![logprob(m.tokenizer, &token.logprobs, token.id, k)?],
            None => vec![],
        };
        let mut text = String::new();
        if !is_eos {
            let mut piece = a.detok.push(token.id)?;
            // Stop-rule plugins see raw text; the last `hold` characters wait for them.
            let mut faulted = None;
            for (i, rule) in a.stop_rules.iter_mut().enumerate() {
                let verdict = match rule.check(token.id, &piece) {
                    Ok(v) => v,
                    Err(e) if rule.fallback() => {
                        tracing::warn!("stop rule dropped for this request: {e:#}");
                        faulted = Some(i);
                        break;
                    }
                    Err(e) => return Err(e),
                };
                if let Some(trim) = verdict {
                    a.held.push_str(&piece);
                    piece.clear();
                    let keep = a.held.chars().count().saturating_sub(trim);
                    a.held = a.held.chars().take(keep).collect();
                    a.finish = Some(Finish::StopRule(rule.name().to_string()));
                    break;
                }
            }
            if let Some(i) = faulted {
                a.stop_rules.remove(i);
            }
            a.held.push_str(&piece);
            let release = if a.finish.is_some() { a.held.len() } else { char_split(&a.held, a.hold) };
            let out = a.stop.push(&a.held[..release]);
            a.held.drain(..release);
            text = out.text;
            if let Some(s) = out.stopped {
                a.finish = Some(Finish::StopString(s));
            }
        }
        if a.finish.is_none() {
            a.finish = match token.finish {
                Some(FinishReason::Stop) => Some(Finish::Eos),
                Some(FinishReason::Length) => Some(Finish::Length),
                None => None,
            };
            if a.finish.is_some() {
                a.held.push_str(&a.detok.flush()?);
                let tail = a.stop.push(&std::mem::take(&mut a.held));
                text.push_str(&tail.text);
                match tail.stopped {
                    Some(s) => a.finish = Some(Finish::StopString(s)),
                    None => text.push_str(&a.stop.flush()),
                }
            }
        }
        let sent = emit(a, text, logprobs, a.finish.is_some())?;
        Ok(!sent || a.finish.is_some() || a.job.events.is_closed())
    }

    /// Takes a request's KV out of wherever it is (its own generation, the batch), holding
    /// exactly the committed tokens but the last; `None` while it was still prefilling.
    fn release<'m>(&mut self, source: Source<'m>, key: u64, batch: &mut Batch<'m>) -> Result<Option<Vec<KvCache>>> {
        Ok(match source {
            Source::Solo(generation) => Some(generation.into_cache()),
            Source::Batched => batch.leave(key)?.map(|left| left.cache),
            Source::Parked(left) => Some(left.cache),
            Source::Prefill { .. } | Source::Dropped { .. } => None,
        })
    }

    /// Frees a failed request's place (its batch row, if any).
    fn discard<'m>(&mut self, a: Active<'m>, batch: &mut Batch<'m>) -> Result<()> {
        self.release(a.source, a.job.seq, batch).map(drop)
    }

    /// Reports usage, sends `Done`, and keeps the request's KV for the prompt cache.
    fn finish<'m>(&mut self, mut a: Active<'m>, batch: &mut Batch<'m>) -> Result<()> {
        let request = &a.job.request;
        let stats = match &a.source {
            Source::Solo(generation) => generation.stats(),
            Source::Batched => {
                batch.row(a.job.seq).map(Row::spec_counts).map_or_else(Default::default, |c| DecodeStats {
                    generated_tokens: a.generated.len(),
                    decode_steps: c.steps,
                    drafted_tokens: c.drafted,
                    accepted_tokens: c.accepted,
                    verifications: c.verifications,
                    ..Default::default()
                })
            }
            _ => Default::default(),
        };
        self.stats.forced_tokens.fetch_add(stats.forced_tokens, Ordering::Relaxed);
        let speculative = (request.speculative.method != SpecMethod::Off).then_some(SpecUsage {
            method: request.speculative.method,
            drafted_tokens: stats.drafted_tokens,
            accepted_tokens: stats.accepted_tokens,
            target_steps: stats.decode_steps,
        });
        if let Some(s) = &speculative {
            self.stats.spec_drafted_tokens.fetch_add(s.drafted_tokens, Ordering::Relaxed);
            if let Some(d) = SPEC_DRAFTERS.iter().position(|&d| d == s.method.as_str()) {
                self.stats.spec_by_drafter[d][0].fetch_add(s.drafted_tokens, Ordering::Relaxed);
                self.stats.spec_by_drafter[d][1].fetch_add(s.accepted_tokens, Ordering::Relaxed);
            }
            self.stats.spec_accepted_tokens.fetch_add(s.accepted_tokens, Ordering::Relaxed);
            self.stats.spec_target_steps.fetch_add(s.target_steps, Ordering::Relaxed);
            self.stats.spec_generated_tokens.fetch_add(stats.generated_tokens, Ordering::Relaxed);
        }
        let usage = Usage {
            prompt_tokens: request.prompt.len(),
            completion_tokens: a.generated.len(),
            cached_tokens: a.reused,
            speculative,
        };
        let mut finish = a.finish.take().unwrap_or(Finish::Length);
        if a.tools.as_ref().is_some_and(|t| t.calls > 0) && finish != Finish::Length {
            finish = Finish::ToolCalls;
        }
        // Out of the batch before the client hears it is done: the last row's leave hands
        // MLX's freed buffers back to the system, so memory is at its baseline by then.
        let source = std::mem::replace(&mut a.source, Source::Batched);
        let released = self.release(source, a.job.seq, batch);
        let _ = a.job.events.send(Event::Done { finish, usage });
        // Keep the KV of everything the cache now holds for the next request.
        let Some(cache) = released? else { return Ok(()) };
        let mut sequence = a.job.request.prompt.clone();
        sequence.extend(&a.generated);
        self.keep_cache(&sequence, cache)
    }
}

/// Sends a token's text down the parsers and out with its logprobs: the reasoning parser
/// (thinking goes out as `Event::Reasoning`), then the tool adapter over the rest (the
/// reply's forced opening first), each flushed at the end of output. `Ok(false)` when the
/// client has gone. When the request allows one tool call, the adapter's report of a second
/// ends the reply before it (`finish` becomes `ToolCalls`).
fn emit(a: &mut Active<'_>, text: String, logprobs: Vec<TokenLogprob>, last: bool) -> Result<bool> {
    let mut pieces = match a.reasoning.as_mut() {
        Some(parser) => {
            let mut out = if text.is_empty() { Vec::new() } else { parser.feed(&text)? };
            if last {
                out.extend(parser.finish()?);
            }
            out
        }
        None => vec![ReasoningOutput::Content(text)],
    };
    if let Some(prefix) = a.reply_prefix.take() {
        pieces.insert(0, ReasoningOutput::Content(prefix));
    }
    let one_call = a.job.request.one_tool_call;
    let (mut events, mut content, mut cut) = (Vec::new(), String::new(), false);
    for piece in pieces {
        match (piece, a.tools.as_mut()) {
            (ReasoningOutput::Reasoning(r), _) => {
                flush(&mut events, &mut content);
                events.push(Event::Reasoning { text: r });
            }
            (ReasoningOutput::Content(c), None) => content.push_str(&c),
            (ReasoningOutput::Content(c), Some(tools)) if !c.is_empty() => {
                let out = tools.adapter.feed(&c)?;
                if route(tools, out, one_call, &mut events, &mut content) {
                    cut = true;
                    break;
                }
            }
            _ => {}
        }
    }
    if let (Some(tools), true, false) = (a.tools.as_mut(), last, cut) {
        let out = tools.adapter.finish()?;
        cut = route(tools, out, one_call, &mut events, &mut content);
    }
    if cut {
        a.finish = Some(Finish::ToolCalls);
    }
    if !content.is_empty() || !logprobs.is_empty() {
        events.push(Event::Delta { text: content, logprobs });
    }
    Ok(events.into_iter().all(|e| a.job.events.send(e).is_ok()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::handle::{Engine, EngineConfig};
    use crate::engine::job::{JobRequest, SubmitError};
    use crate::engine::warm_up::warm_up_prompt;
    use crate::engine::{SamplingParams, SpecConfig};
    use tokio::sync::mpsc::UnboundedReceiver;

    #[test]
    fn a_constraint_that_cannot_go_on_fails_its_request_as_the_clients_error() {
        let e = anyhow::Error::new(ConstraintFailed { param: "response_format", message: "too much".into() })
            .context("the output constraint");
        match failure(e) {
            Event::Constraint { param, message } => {
                assert_eq!((param, message.as_str()), ("response_format", "too much"))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(failure(anyhow::anyhow!("a bug")), Event::Error(_)));
    }

    fn engine(dir: &std::path::Path, warm_up: bool) -> Engine {
        Engine::start(EngineConfig { warm_up: Some(warm_up), ..EngineConfig::cpu(dir.to_path_buf()) }).unwrap()
    }

    fn request(prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> JobRequest {
        JobRequest {
            prompt,
            sampling,
            max_tokens,
            stop: vec![],
            top_logprobs: None,
            hooks: None,
            reply_prefix: None,
            one_tool_call: false,
            speculative: SpecConfig::default(),
            constraint: None,
            priority: 0,
            client: None,
        }
    }

    fn run(engine: &Engine, prompt: Vec<u32>) -> (String, Usage) {
        let mut rx = engine.submit(request(prompt, SamplingParams::default(), 8)).unwrap();
        let mut text = String::new();
        while let Some(event) = rx.blocking_recv() {
            match event {
                Event::Started { .. } => {}
                Event::Delta { text: t, .. } => text.push_str(&t),
                Event::Done { usage, .. } => return (text, usage),
                other => panic!("{other:?}"),
            }
        }
        panic!("the engine dropped the job")
    }

    /// `stop_now` ends the running request and every waiting one, those the engine loop has
    /// taken and those still in the submission channel alike, with a shutdown `Cancel`;
    /// the thread stops, and later submissions are refused.
    #[test]
    fn stop_now_ends_every_request_with_a_shutdown_cancel() {
        let dir = std::env::temp_dir().join(format!("host-stop-now-{}", std::process::id()));
        models::testing::write_model(&dir, "llama", 5).unwrap();
        let engine = engine(&dir, false);
        let job = |max_tokens| {
            let mut sampling = SamplingParams::default();
            // No end-of-sequence (id 2): the first request runs until it is stopped.
            sampling.logit_bias.insert(2, -1e9);
            request(vec![5, 6, 7], sampling, max_tokens)
        };
        let mut running = engine.submit(job(100_000)).unwrap();
        // Running: its first token has been streamed.
        while !matches!(running.blocking_recv(), Some(Event::Delta { .. })) {}
        let mut waiting: Vec<_> = (0..3).map(|_| engine.submit(job(4)).unwrap()).collect();
        assert!(engine.stop_now(Duration::from_secs(20)), "the engine thread did not stop");
        for (i, rx) in std::iter::once(&mut running).chain(waiting.iter_mut()).enumerate() {
            let mut last = None;
            while let Some(event) = rx.blocking_recv() {
                last = Some(event);
            }
            match last {
                Some(Event::Cancelled(Cancel { shutdown: true, message })) => {
                    assert!(message.contains("shutting down"))
                }
                other => panic!("request {i} ended with {other:?}, not a shutdown cancel"),
            }
        }
        assert!(matches!(engine.submit(job(4)), Err(SubmitError::Stopped)));
        drop(engine);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Collects a job's text, usage and finish (`None` when it ended otherwise).
    fn collect(rx: &mut UnboundedReceiver<Event>) -> (String, Option<(Finish, Usage)>) {
        let mut text = String::new();
        while let Some(event) = rx.blocking_recv() {
            match event {
                Event::Delta { text: t, .. } => text.push_str(&t),
                Event::Done { finish, usage } => return (text, Some((finish, usage))),
                Event::Started { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        (text, None)
    }

    /// The queue limit counts the requests that must wait: a burst into free rows is taken
    /// whole (issue 42: 72 at once got 429s with 32 rows free), a request beyond the rows
    /// and the limit is refused.
    #[test]
    fn a_burst_into_free_rows_is_not_counted_against_the_queue_limit() {
        let dir = std::env::temp_dir().join(format!("host-burst-worker-{}", std::process::id()));
        models::testing::write_model(&dir, "llama", 5).unwrap();
        let engine =
            Engine::start(EngineConfig { max_batch: 4, queue_limit: 1, ..EngineConfig::cpu(dir.clone()) }).unwrap();
        let mut endless = SamplingParams::default();
        endless.logit_bias.insert(1, -1e9);
        let job = |i: u32| request(vec![40 + i, 41, 42], endless.clone(), 100_000);
        let accepted: Vec<_> = (0..5).map(|i| engine.submit(job(i))).collect();
        assert!(accepted.iter().all(Result::is_ok), "four free rows and a queue of one take five at once");
        let deadline = Instant::now() + Duration::from_secs(60);
        while engine.stats.running.load(Ordering::SeqCst) < 4 {
            assert!(Instant::now() < deadline, "the rows did not fill");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(engine.submit(job(9)).err(), Some(SubmitError::QueueFull(1)));
        drop(accepted);
        assert!(engine.stop_now(Duration::from_secs(30)));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Issue 19, in the engine: requests running together as rows of one batch, each with its
    /// own sampling settings and stop strings, get what they get alone, while one row is
    /// cancelled mid-stream and a prompt-cache hit joins the running batch.
    #[test]
    fn concurrent_requests_get_their_solo_outputs_while_one_is_cancelled_and_a_cache_hit_joins() {
        check_concurrent("llama");
    }

    /// The same for Qwen3.5's hybrid: the rows' recurrent states join and leave the batch
    /// (a cancelled row while its step is in flight), and the cache hit resumes from the
    /// checkpoint taken at the end of job 0's prompt (its entry's state is past it).
    #[test]
    fn a_hybrid_models_concurrent_requests_get_their_solo_outputs_and_resume_from_a_checkpoint() {
        check_concurrent("qwen3_5");
    }

    fn check_concurrent(arch: &str) {
        let dir = std::env::temp_dir().join(format!("host-batch-worker-{arch}-{}", std::process::id()));
        models::testing::write_model(&dir, arch, 7).unwrap();
        let engine =
            Engine::start(EngineConfig { max_batch: 8, queue_limit: 16, ..EngineConfig::cpu(dir.clone()) }).unwrap();
        let no_eos = |mut p: SamplingParams| {
            p.logit_bias.insert(1, -1e9);
            p
        };
        let seeded = SamplingParams { temperature: 0.9, top_k: 40, seed: Some(42), ..Default::default() };
        let penalized = SamplingParams { presence_penalty: Some(0.7), ..Default::default() };
        let prompts: Vec<Vec<u32>> =
            (0..4).map(|i| (0..(5 + 9 * i)).map(|t| 40 + (t * 7 + i) % 80).collect()).collect();
        let jobs = |stop: Vec<String>| {
            vec![
                request(prompts[0].clone(), no_eos(SamplingParams::default()), 24),
                request(prompts[1].clone(), no_eos(seeded.clone()), 24),
                JobRequest { stop, ..request(prompts[2].clone(), no_eos(penalized.clone()), 24) },
                request(prompts[3].clone(), no_eos(SamplingParams::default()), 24),
            ]
        };
        let alone: Vec<(String, Option<(Finish, Usage)>)> =
            jobs(vec![]).into_iter().map(|j| collect(&mut engine.submit(j).unwrap())).collect();
        // A stop string from the middle of job 2's text.
        let text2 = &alone[2].0;
        let cut = text2.char_indices().nth(text2.chars().count() / 2).unwrap().0;
        let stop: String = text2[cut..].chars().take(2).collect();
        let want2 = &text2[..text2.find(&stop).unwrap()];
        // Together: a long row to cancel, the four jobs, and a cache hit on job 0's sequence.
        let mut long = engine.submit(request(prompts[3].clone(), no_eos(SamplingParams::default()), 100_000)).unwrap();
        while !matches!(long.blocking_recv(), Some(Event::Delta { .. })) {}
        let mut rxs: Vec<_> = jobs(vec![stop.clone()]).into_iter().map(|j| engine.submit(j).unwrap()).collect();
        let mut extended = prompts[0].clone();
        extended.extend([50, 51, 52]);
        let cached_alone = {
            // What the extended prompt gives on a fresh engine (no cache).
            let fresh =
                Engine::start(EngineConfig { prompt_cache_bytes: 0, ..EngineConfig::cpu(dir.clone()) }).unwrap();
            collect(&mut fresh.submit(request(extended.clone(), no_eos(SamplingParams::default()), 12)).unwrap())
        };
        rxs.push(engine.submit(request(extended, no_eos(SamplingParams::default()), 12)).unwrap());
        for _ in 0..3 {
            long.blocking_recv();
        }
        drop(long);
        let got: Vec<_> = rxs.iter_mut().map(collect).collect();
        assert_eq!(got[0].0, alone[0].0);
        assert_eq!(got[1].0, alone[1].0, "seeded sampling in a batch");
        assert_eq!(got[2].0, want2, "the stop string {stop:?} ends job 2 where it first occurs");
        assert_eq!(got[2].1.as_ref().unwrap().0, Finish::StopString(stop));
        assert_eq!(got[3].0, alone[3].0);
        assert_eq!(got[4].0, cached_alone.0);
        let usage = got[4].1.as_ref().unwrap().1;
        assert!(usage.cached_tokens >= prompts[0].len() - 1, "the cache hit reused {} tokens", usage.cached_tokens);
        drop(engine);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Issue 19: a long prompt is prefilled in chunks of the step's token budget between the
    /// batch's steps, so a stream already running keeps getting tokens meanwhile (prefilled in
    /// one piece, it would get one or two).
    #[test]
    fn a_long_prompt_joins_in_chunks_while_a_running_stream_keeps_decoding() {
        use tokio::sync::mpsc::error::TryRecvError;
        let dir = std::env::temp_dir().join(format!("host-chunked-join-{}", std::process::id()));
        models::testing::write_model(&dir, "llama", 8).unwrap();
        let engine = Engine::start(EngineConfig { step_token_budget: 32, ..EngineConfig::cpu(dir.clone()) }).unwrap();
        let mut no_eos = SamplingParams::default();
        no_eos.logit_bias.insert(1, -1e9);
        let mut running = engine.submit(request(vec![5, 6, 7], no_eos, 100_000)).unwrap();
        while !matches!(running.blocking_recv(), Some(Event::Delta { .. })) {}
        let prompt: Vec<u32> = (0..640u32).map(|i| 40 + i % 90).collect();
        let chunks = (prompt.len() - 1).div_ceil(31);
        let mut long = engine.submit(request(prompt, SamplingParams::default(), 2)).unwrap();
        // Tokens generated meanwhile, counted by the engine (a tiny model's bytes often make no
        // text yet, so the running stream's deltas would undercount them).
        let generated = || engine.stats.generation_tokens.load(Ordering::SeqCst);
        let mut at_start = None;
        let during = loop {
            match long.try_recv() {
                Ok(Event::Started { .. }) => at_start = Some(generated()),
                Ok(Event::Delta { .. }) => break generated() - at_start.expect("started first") - 1,
                Ok(other) => panic!("{other:?}"),
                Err(TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(1)),
                Err(TryRecvError::Disconnected) => panic!("the long request ended without a token"),
            }
            while running.try_recv().is_ok() {}
        };
        assert!(during >= chunks / 2, "{during} tokens of the running stream during {chunks} prefill chunks");
        drop((running, long, engine));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Issue 23: a lone constrained request decodes alone, taking its constraint's forced
    /// tokens in runs (one forward for a run, no sampling); when another request joins it
    /// moves into the batch, and out again once it is alone, going on each time where it
    /// stopped: both requests write what they write alone.
    #[test]
    fn a_lone_constrained_request_takes_forced_runs_and_shares_the_batch_when_another_joins() {
        let dir = std::env::temp_dir().join(format!("host-solo-constrained-{}", std::process::id()));
        models::testing::write_model(&dir, "llama", 9).unwrap();
        let engine = Engine::start(EngineConfig {
            max_batch: 4,
            prompt_cache_bytes: 0,
            warm_up: Some(false),
            ..EngineConfig::cpu(dir.clone())
        })
        .unwrap();
        // 400 positions, a choice of 16 tokens each, but from position 300 on three of every
        // four are forced (runs of three): long after the other request below has finished.
        let forced = |p: usize| p >= 300 && p % 4 != 3;
        let allowed: Vec<Vec<u32>> =
            (0..400).map(|p| if forced(p) { vec![40 + (p as u32 * 7) % 50] } else { (40..56).collect() }).collect();
        let n_forced = (0..400).filter(|&p| forced(p)).count();
        let constrained = || JobRequest {
            constraint: Some(crate::engine::constraint::tests::script(allowed.clone(), 128)),
            ..request(vec![5, 6, 7, 8], SamplingParams::default(), 400)
        };
        let mut no_eos = SamplingParams::default();
        no_eos.logit_bias.insert(2, -1e9);
        let other = || request((0..20).map(|t| 60 + t * 3).collect(), no_eos.clone(), 12);
        let stat = |counter: &AtomicUsize| counter.load(Ordering::SeqCst);
        let two_rows = || stat(&engine.stats.batch_size_counts[1]);

        let alone = collect(&mut engine.submit(constrained()).unwrap());
        assert_eq!(alone.1.as_ref().unwrap().1.completion_tokens, 400);
        assert_eq!(stat(&engine.stats.forced_tokens), n_forced, "alone, every forced token is taken in a run");
        assert_eq!(two_rows(), 0);
        let other_alone = collect(&mut engine.submit(other()).unwrap());

        let mut c = engine.submit(constrained()).unwrap();
        // Decoding alone when the other arrives.
        let first = loop {
            match c.blocking_recv() {
                Some(Event::Delta { text, .. }) => break text,
                Some(Event::Started { .. }) => {}
                other => panic!("{other:?}"),
            }
        };
        let mut o = engine.submit(other()).unwrap();
        let (mut together, other_together) = (collect(&mut c), collect(&mut o));
        together.0.insert_str(0, &first);
        assert!(two_rows() > 0, "the constrained request never shared the batch");
        assert_eq!(together.0, alone.0, "the constrained request's output, moved into the batch and out");
        assert_eq!(together.1.unwrap().1.completion_tokens, 400);
        assert_eq!(other_together.0, other_alone.0);
        assert_eq!(
            stat(&engine.stats.forced_tokens),
            2 * n_forced,
            "alone again after the other request left, it takes the forced tokens in runs"
        );
        drop(engine);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_warm_up_leaves_no_trace() {
        let dir = std::env::temp_dir().join(format!("host-warm-up-{}", std::process::id()));
        models::testing::write_model(&dir, "llama", 5).unwrap();
        // Warmed up with a draft model too (the model itself: same vocabulary).
        let warm = Engine::start(EngineConfig {
            warm_up: Some(true),
            draft_model: Some(dir.clone()),
            ..EngineConfig::cpu(dir.clone())
        })
        .unwrap();
        let cold = engine(&dir, false);
        // The warm-up's own prompt: had it reached the prompt cache, this would reuse it.
        let prompt = warm_up_prompt(warm.info.vocab_size);
        let (a, b) = (run(&warm, prompt.clone()), run(&cold, prompt));
        assert!(warm.warmed_up.is_some() && cold.warmed_up.is_none());
        assert_eq!(a.0, b.0);
        assert_eq!((a.1.cached_tokens, a.1.completion_tokens), (0, 8));
        assert_eq!(warm.stats.generation_tokens.load(Ordering::Relaxed), 8);
        assert_eq!(warm.stats.prompt_tokens.load(Ordering::Relaxed), 64);
        drop((warm, cold));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Qwen3.5's hybrid (recurrent Gated DeltaNet layers beside attention ones) through the
    /// engine: warmed up or not, the same output; a conversation's next turn resumes from the
    /// state the last turn left in the prompt cache and equals a cold run; prompt lookup
    /// drafts, rolls rejected drafts back to the state's snapshots and gives the plain text.
    #[test]
    fn a_hybrid_model_resumes_a_conversation_from_the_prompt_cache_and_speculates_exactly() {
        let dir = std::env::temp_dir().join(format!("host-hybrid-{}", std::process::id()));
        models::testing::write_model(&dir, "qwen3_5", 7).unwrap();
        let (warm, cold) = (engine(&dir, true), engine(&dir, false));
        assert_eq!(warm.info.recurrent_layers, 1);
        // Letters and digits only (one byte token each), so a reply's text gives its ids back.
        let mut no_eos = SamplingParams::default();
        for id in 0..warm.info.vocab_size as u32 {
            let text = warm.tokenizer.decode(&[id]).unwrap_or_default();
            if !(text.len() == 1 && text.bytes().all(|b| b.is_ascii_alphanumeric())) {
                no_eos.logit_bias.insert(id, -1e9);
            }
        }
        let turn = |e: &Engine, prompt: Vec<u32>| collect(&mut e.submit(request(prompt, no_eos.clone(), 8)).unwrap());
        let first: Vec<u32> = (0..20).map(|t| 40 + t * 5).collect();
        let (text, usage) = turn(&warm, first.clone());
        assert_eq!(turn(&cold, first.clone()).0, text, "the warm-up changed nothing");
        assert_eq!(usage.unwrap().1.cached_tokens, 0);
        let mut second = first.clone();
        second.extend(warm.tokenizer.encode(&text, false).unwrap());
        second.extend([99, 100, 101]);
        let (resumed, usage) = turn(&warm, second.clone());
        let cached = usage.unwrap().1.cached_tokens;
        assert!(cached > first.len() && cached < second.len(), "cached {cached} of {}", second.len());
        let fresh = engine(&dir, false);
        let (again, usage) = turn(&fresh, second.clone());
        assert_eq!((resumed, usage.unwrap().1.cached_tokens), (again, 0));
        // A prompt whose phrases recur with different endings: prompt lookup drafts from
        // them, and the model follows some and not others.
        let repeating: Vec<u32> = (0..48).map(|t| if t % 8 == 7 { 60 + t } else { 40 + (t % 8) * 5 }).collect();
        let plain = collect(&mut cold.submit(request(repeating.clone(), no_eos.clone(), 24)).unwrap()).0;
        let speculative = JobRequest {
            speculative: SpecConfig { method: crate::engine::SpecMethod::PromptLookup, ..SpecConfig::default() },
            ..request(repeating, no_eos.clone(), 24)
        };
        let (text, _) = collect(&mut fresh.submit(speculative).unwrap());
        let (drafted, accepted) = (
            fresh.stats.spec_drafted_tokens.load(Ordering::Relaxed),
            fresh.stats.spec_accepted_tokens.load(Ordering::Relaxed),
        );
        assert!(drafted > accepted, "no draft was rolled back: {accepted} of {drafted} accepted");
        assert_eq!(text, plain);
        drop((warm, cold, fresh));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A native policy for tests: the waiting by priority, and any running request of lower
    /// priority than the first of them preempted.
    struct ByPriority;

    impl crate::engine::scheduler::Policy for ByPriority {
        fn name(&self) -> String {
            "by-priority".into()
        }

        fn decide(
            &mut self,
            view: &crate::engine::scheduler::QueueView,
        ) -> anyhow::Result<crate::engine::scheduler::Decision> {
            let mut waiting = view.waiting.clone();
            waiting.sort_by_key(|e| std::cmp::Reverse(e.priority));
            let top = waiting.first().map_or(i64::MIN, |e| e.priority);
            Ok(crate::engine::scheduler::Decision {
                order: waiting.iter().map(|e| e.id.clone()).collect(),
                preempt: view.running.iter().filter(|e| e.priority < top).map(|e| e.id.clone()).collect(),
                cancel: vec![],
            })
        }
    }

    /// Qwen3.5's hybrid preempted by recompute: a running request whose KV and recurrent
    /// state are dropped for a higher-priority one (memory is short) resumes, from the prompt
    /// cache or, with none, from its tokens, and gives the text it gives alone.
    #[test]
    fn a_hybrid_request_dropped_for_another_and_recomputed_gives_its_solo_text() {
        let dir = std::env::temp_dir().join(format!("host-hybrid-preempt-{}", std::process::id()));
        models::testing::write_model(&dir, "qwen3_5", 9).unwrap();
        let alone = engine(&dir, false);
        let mut no_eos = SamplingParams::default();
        no_eos.logit_bias.insert(2, -1e9);
        let long: Vec<u32> = (0..20).map(|t| 40 + t * 3).collect();
        let want = collect(&mut alone.submit(request(long.clone(), no_eos.clone(), 300)).unwrap()).0;
        for prompt_cache_bytes in [1 << 20, 0] {
            let maker = crate::engine::scheduler::MakePolicy(Arc::new(|| Box::new(ByPriority)));
            let config = EngineConfig { policy: Some(maker), prompt_cache_bytes, ..EngineConfig::cpu(dir.clone()) };
            let engine = Engine::start(config).unwrap();
            // The long request reserves 320 positions; beside it the next one's 15 are over.
            engine.set_kv_budget_tokens(330);
            let mut rx = engine.submit(request(long.clone(), no_eos.clone(), 300)).unwrap();
            let mut text = String::new();
            while text.is_empty() {
                if let Some(Event::Delta { text: t, .. }) = rx.blocking_recv() {
                    text.push_str(&t);
                }
            }
            let high =
                JobRequest { priority: 10, ..request(vec![50, 51, 52, 53, 54, 55, 56, 57, 58, 59], no_eos.clone(), 5) };
            let high = collect(&mut engine.submit(high).unwrap());
            assert_eq!(high.1.unwrap().1.completion_tokens, 5);
            let (rest, _) = collect(&mut rx);
            text.push_str(&rest);
            assert_eq!(engine.stats.preemptions.load(Ordering::Relaxed), 1, "prompt cache {prompt_cache_bytes}");
            assert_eq!(text, want, "prompt cache {prompt_cache_bytes}");
        }
        drop(alone);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A policy that records the memory each view shows, and decides nothing.
    struct Recorder(Arc<std::sync::Mutex<Vec<(usize, usize)>>>);

    impl crate::engine::scheduler::Policy for Recorder {
        fn name(&self) -> String {
            "recorder".into()
        }

        fn decide(
            &mut self,
            view: &crate::engine::scheduler::QueueView,
        ) -> anyhow::Result<crate::engine::scheduler::Decision> {
            if !view.running.is_empty() {
                self.0.lock().unwrap().push((view.memory.kv_budget_tokens, view.memory.kv_free_tokens));
            }
            Ok(Default::default())
        }
    }

    /// A running Qwen3.5 request reserves its recurrent states beside its positions: the free
    /// memory the scheduler shows is the budget less prompt, max_tokens and the states'
    /// weight in positions (`recurrent_state_bytes` / `kv_bytes_per_token`, rounded up).
    #[test]
    fn a_hybrid_request_reserves_its_recurrent_state_in_the_memory_budget() {
        let dir = std::env::temp_dir().join(format!("host-hybrid-reserve-{}", std::process::id()));
        models::testing::write_model(&dir, "qwen3_5", 4).unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let maker = crate::engine::scheduler::MakePolicy(Arc::new(move || Box::new(Recorder(record.clone()))));
        let engine = Engine::start(EngineConfig { policy: Some(maker), ..EngineConfig::cpu(dir.clone()) }).unwrap();
        let state = engine.info.recurrent_state_bytes.div_ceil(engine.info.kv_bytes_per_token);
        assert!(state > 0);
        engine.set_kv_budget_tokens(10_000);
        let mut no_eos = SamplingParams::default();
        no_eos.logit_bias.insert(2, -1e9);
        let mut long = engine.submit(request((40..60).collect(), no_eos.clone(), 200)).unwrap();
        while !matches!(long.blocking_recv(), Some(Event::Delta { .. })) {}
        // A waiting request makes the engine consult the policy while the long one runs.
        let short = collect(&mut engine.submit(request(vec![50, 51, 52], no_eos, 2)).unwrap());
        assert!(short.1.is_some());
        drop(long);
        let views = seen.lock().unwrap().clone();
        assert!(views.contains(&(10_000, 10_000 - (20 + 200 + state))), "{views:?} (state {state})");
        drop(engine);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
