//! The batch step: every row of the batch advances one token per forward, in mlx-lm's
//! pipelined shape (step n+1's graph is built from step n's lazy tokens and handed to MLX
//! before step n's tokens are read). Rows join between steps with their prompt already in a
//! cache of their own (`engine/worker.rs` prefills it in chunks) and leave between steps with
//! their cache handed back, holding exactly the tokens they committed but the last.
//!
//! Each row keeps what its request has alone: its sampler (logit bias, penalties over its own
//! history, temperature, top-k/p, min-p, its seed keyed by position), its limits and stop
//! tokens, and its external sampler (a plugin) if it has one. Rows sampled natively stay on
//! the device; a plugin row's candidates are read back for all plugin rows at once, one host
//! round trip per step, and while a plugin row is in the batch its steps run serially (the
//! plugin must see each committed token before it picks the next). A row under a constraint
//! keeps the pipeline: the next step's forward is queued before the tokens are read, its
//! masks are worked out while that forward runs, and its sampling is queued after them. The
//! batch knows nothing about text or requests; rows are named by a key.

use super::constraint::{self, takes_forced_runs, Guard, Overlap, SLOW_MASK_SECS};
use super::external::{external_frame, pick_from_frame};
use super::hooks::ExternalSampler;
use super::sampling::{log_softmax, Sampler};
use super::scheduler::Policy;
use super::speculative::Speculation;
use super::step::tokens_array;
use super::step::{DecodeOptions, FinishReason, Token};
use anyhow::{bail, Context, Result};
use mlx::{memory, Array, Dtype};
use models::{BatchKvCache, CausalLm, KvCache};
use std::time::Instant;

/// Freed memory MLX may keep across a row's joining (beyond the batch's KV bytes) before the
/// join returns it to the system.
const JOIN_CLEAR_BYTES: usize = 256 << 20;

mod draft;
mod speculate;
pub use speculate::{DraftCost, SpecCounts, Verified};

/// One sequence of the batch.
pub struct Row<'m> {
    key: u64,
    sampler: Sampler,
    /// A sampler plugin picking this row's tokens (it has accepted the prompt).
    external: Option<Box<dyn ExternalSampler + 'm>>,
    /// Masks this row's logits (a step's sampling then waits for the tokens before it).
    constraint: Option<Guard>,
    /// The row's external sampler failed in the step in flight (no fallback allowed).
    failed: Option<anyhow::Error>,
    options: DecodeOptions,
    /// The sequence so far (prompt and committed tokens) when the sampler's penalties need it.
    history: Option<Array>,
    /// The position the next built step samples at.
    position: usize,
    /// The token fed to the most recent step built with this row; before any, the one to feed.
    last: u32,
    generated: usize,
    /// Drafts tokens to verify several a step (`speculate.rs`).
    speculation: Option<Speculation<'m>>,
    counts: SpecCounts,
    /// How the row's drafts fared lately, position by position.
    acceptance: speculate::Acceptance,
}

impl<'m> Row<'m> {
    /// A row whose cache holds `prompt` but its last token, which the first step feeds.
    pub fn new(key: u64, prompt: &[u32], sampler: Sampler, options: DecodeOptions) -> Result<Row<'m>> {
        let Some((&last, head)) = prompt.split_last() else { bail!("the prompt is empty; give at least one token") };
        let history = if sampler.params().needs_history() { Some(tokens_array(head)?) } else { None };
        Ok(Row {
            key,
            sampler,
            external: None,
            constraint: None,
            failed: None,
            options,
            history,
            position: prompt.len(),
            last,
            generated: 0,
            speculation: None,
            counts: SpecCounts::default(),
            acceptance: speculate::Acceptance::default(),
        })
    }

    /// The row's tokens picked by `external` (which has already accepted the prompt).
    pub fn with_external(mut self, external: Option<Box<dyn ExternalSampler + 'm>>) -> Row<'m> {
        self.external = external;
        self
    }

    /// The row's output held to `constraint` (which has seen nothing of it yet).
    pub fn with_constraint(mut self, constraint: Option<Guard>) -> Row<'m> {
        self.constraint = constraint;
        self
    }

    /// An external sampler failure: fatal for the row unless the sampler allows falling back
    /// to native sampling, which then takes over for the rest of the request.
    fn external_failed(&mut self, e: anyhow::Error) {
        if self.external.as_ref().is_some_and(|x| x.fallback()) {
            tracing::warn!("external sampler failed, falling back to native sampling: {e:#}");
            self.external = None;
        } else {
            self.failed.get_or_insert(e);
        }
    }

    pub fn key(&self) -> u64 {
        self.key
    }

    /// Whether the row would go faster as a generation of its own when it is alone
    /// (`constraint::takes_forced_runs`; a speculative row stays: its drafts verify runs too).
    pub fn takes_forced_runs(&self) -> bool {
        self.speculation.is_none()
            && takes_forced_runs(self.constraint.is_some(), self.external.is_some(), self.sampler.params())
    }

    /// The row's sampler, options (`max_tokens` less the tokens it committed) and
    /// constraint, for a generation of its own to go on where it left the batch: a left
    /// row's cache holds its sequence but the last token, which is fed next at `position`.
    pub fn into_parts(self) -> (Sampler, DecodeOptions, Option<Guard>) {
        let mut options = self.options;
        options.max_tokens -= self.generated;
        (self.sampler, options, self.constraint)
    }

    /// Tokens committed so far.
    pub fn generated(&self) -> usize {
        self.generated
    }
}

/// A row that left the batch: its state and a cache holding the tokens it committed but the
/// last (`row`'s next step feeds that one), ready to rejoin or to go to the prompt cache.
pub struct Left<'m> {
    pub row: Row<'m>,
    pub cache: Vec<KvCache>,
}

/// A built step, in flight: its rows' keys in row order, their tokens and log-probabilities,
/// and, when the next step's masks will be worked out on a helper thread, the tokens'
/// private copy for it to read.
struct Step {
    keys: Vec<u64>,
    tokens: Array,
    logprobs: Array,
    copy: Option<mlx::Detached>,
}

/// A step's tokens: each row's, in row order, or the error that fails that row alone.
type StepTokens = Vec<(u64, Result<Token>)>;

/// A step's token for one row, told to the row (its sampler plugin, its constraint, its
/// limits): the token and its finish, or the error that fails the row.
type Told = (u64, Result<(u32, Option<FinishReason>)>);

pub struct Batch<'m> {
    model: &'m dyn CausalLm,
    cache: Vec<BatchKvCache>,
    /// In the cache's row order.
    rows: Vec<Row<'m>>,
    pending: Option<Step>,
    steps: usize,
    /// The device constants the rows' constraint masks are applied with.
    masking: constraint::Masking,
    /// Where a constrained step's tokens are read and its masks worked out (`beside`).
    overlap: Overlap,
    /// Constrained steps whose forward started with their sampling (`merged`).
    merged_steps: usize,
    /// Where the steps spent the engine thread's time.
    split: StepSplit,
    /// What the speculative steps so far verified (`speculate.rs`).
    verified: Verified,
    /// The step's cost the draft length is chosen by.
    draft_cost: DraftCost,
    /// The draft model's rows, drafting together (`batch/draft.rs`), once a row drafts.
    drafts: Option<draft::DraftBatch<'m>>,
}

/// Where a batch's steps spend the engine thread's time, summed in seconds (`host bench
/// --batch` prints them per step, a constrained batch's beside its plain one's).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepSplit {
    /// Steps read (`step` calls that gave tokens).
    pub steps: usize,
    /// Building the next step's graph while this one is in flight: its forward, and unless a
    /// constrained row waits for masks, its sampling (a serial batch's, with a plugin row,
    /// is built when it is read: not counted).
    pub build: f64,
    /// Handing that graph to MLX (`async_eval`).
    pub dispatch: f64,
    /// Waiting after the dispatch for this step's tokens; with a constrained row, also for
    /// the constraints told them and their next masks (a helper thread's join, or that work
    /// done here).
    pub wait: f64,
    /// Telling the rows their tokens (sampler plugins, limits; constraints when not
    /// already) and cutting their log-probabilities.
    pub tell: f64,
    /// A constrained step's separate sampling: applying the masks (`Masking`), building the
    /// sampling and handing it to MLX (a merged step's forward with it: then its dispatch is
    /// here, not in `dispatch`).
    pub pick: f64,
}

impl StepSplit {
    /// Milliseconds per step: build, dispatch, wait, tell, pick.
    pub fn per_step_ms(&self) -> [f64; 5] {
        let n = self.steps.max(1) as f64;
        [self.build, self.dispatch, self.wait, self.tell, self.pick].map(|s| s * 1e3 / n)
    }
}

/// A batch's step ends with no MLX work of its own running (see `Generation`'s `Drop`).
impl Drop for Batch<'_> {
    fn drop(&mut self) {
        if self.pending.is_some() {
            if let Err(e) = mlx::synchronize() {
                tracing::warn!("waiting for the last batch step: {e:#}");
            }
        }
    }
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m dyn CausalLm) -> Batch<'m> {
        let layers = model.make_cache().len();
        Batch {
            model,
            cache: (0..layers).map(|_| BatchKvCache::default()).collect(),
            rows: Vec::new(),
            pending: None,
            steps: 0,
            masking: constraint::Masking::default(),
            overlap: Overlap::from_env(),
            merged_steps: 0,
            split: StepSplit::default(),
            verified: Verified::default(),
            draft_cost: DraftCost::from_env(),
            drafts: None,
        }
    }

    /// Forwards the draft model ran for the rows drafting together.
    pub fn draft_forwards(&self) -> usize {
        self.drafts.as_ref().map_or(0, |d| d.forwards)
    }

    /// Rows whose draft caches were caught up in a joint prefill on taking their seats.
    pub fn drafts_caught_up_together(&self) -> usize {
        self.drafts.as_ref().map_or(0, |d| d.caught_up_together)
    }

    /// Where the steps so far spent the engine thread's time.
    pub fn split(&self) -> StepSplit {
        self.split
    }

    /// Constrained steps so far whose tokens were already there when the next forward was
    /// built, and whose quick masks were worked out before that forward started, with its
    /// sampling, in one dispatch.
    pub fn merged_steps(&self) -> usize {
        self.merged_steps
    }

    /// Row masks applied so far, and of them those sent from the host (`Masking`): (applied,
    /// sent).
    pub fn mask_counts(&self) -> (usize, usize) {
        (self.masking.applied, self.masking.sent)
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Whether the model decodes rows in batches (`CausalLm::batches`).
    pub fn batches(&self) -> bool {
        self.model.batches()
    }

    /// Row `key`, if it is in the batch.
    pub fn row(&self, key: u64) -> Option<&Row<'m>> {
        self.rows.iter().find(|r| r.key == key)
    }

    /// Bytes of KV the batch holds (padding included).
    pub fn kv_bytes(&self) -> usize {
        self.cache.iter().map(BatchKvCache::nbytes).sum()
    }

    /// Adds `row` with `cache` (one entry per layer, holding its sequence but the last token);
    /// it takes part from the next step built.
    pub fn join(&mut self, row: Row<'m>, cache: &[KvCache]) -> Result<()> {
        self.join_all(vec![(row, cache)])
    }

    /// Adds `rows`, each with its cache (as [`join`](Self::join)), in one copy of the batch's
    /// KV per layer: joining them one by one copies it once per row.
    pub fn join_all(&mut self, rows: Vec<(Row<'m>, &[KvCache])>) -> Result<()> {
        for (i, (row, cache)) in rows.iter().enumerate() {
            if cache.len() != self.cache.len() {
                bail!("a row's cache has {} layers, the batch's {}", cache.len(), self.cache.len());
            }
            if self.rows.iter().chain(rows[..i].iter().map(|(r, _)| r)).any(|r| r.key == row.key) {
                bail!("row {} is already in the batch", row.key);
            }
        }
        for (layer, b) in self.cache.iter_mut().enumerate() {
            let caches: Vec<&KvCache> = rows.iter().map(|(_, cache)| &cache[layer]).collect();
            b.push_all(&caches, models::cache::STEP)?;
        }
        self.rows.extend(rows.into_iter().map(|(row, _)| row));
        // MLX keeps freed buffers for reuse; a prefill's and a changing batch's shapes leave
        // many it will not reuse (a single generation clears them at its first token too).
        // Only when they are many: clearing returns the pages to the system, and the next step
        // takes them back one fault at a time (eight short chat prompts joining at once on the
        // 2-core CPU: their first step 110 ms with a clear at each join, 85 without, 35 after).
        if memory::cache() > self.kv_bytes().max(JOIN_CLEAR_BYTES) {
            memory::clear_cache();
        }
        Ok(())
    }

    /// Takes row `key` out of the batch (`None` if it is not in it).
    pub fn leave(&mut self, key: u64) -> Result<Option<Left<'m>>> {
        let Some(index) = self.rows.iter().position(|r| r.key == key) else { return Ok(None) };
        let in_flight = self.pending.as_ref().is_some_and(|p| p.keys.contains(&key));
        // A step in flight has fed the row's last token and sampled past it: its position and
        // that token's KV (a recurrent layer's state before it) are given back, so the row's
        // next step feeds `last` again.
        let cache: Vec<KvCache> = (self.cache.iter())
            .map(|b| if in_flight { b.extract_before_step(index) } else { b.extract(index) })
            .collect::<models::Result<_>>()?;
        for b in &mut self.cache {
            b.remove(index)?;
        }
        let mut row = self.rows.remove(index);
        // Its draft cache goes back to its drafter (a generation of its own drafts on from it).
        if let Some((cache, held)) = self.drafts.as_mut().map(|d| d.leave(key)).transpose()?.flatten() {
            if let Some(spec) = row.speculation.as_mut() {
                spec.drafter.give_cache(cache, held);
            }
        }
        if in_flight {
            row.position -= 1;
            if let Some(h) = &row.history {
                let n = h.dim(0) as i32;
                row.history = Some(h.slice_axis(0, 0, n - 1)?);
            }
        }
        if self.rows.is_empty() {
            // The last row: the step in flight feeds no one. It ends here, as a generation's
            // does (no MLX work outlives the rows it was for; under tensor parallelism a rank
            // lost during a forgotten step's all-reduce aborted the process).
            if self.pending.take().is_some() {
                mlx::synchronize()?;
            }
            memory::clear_cache();
        }
        Ok(Some(Left { row, cache }))
    }

    /// Advances every row by one token: returns each row's token of the step read now, in row
    /// order (a row that joined since the last call gets its first), or the error that fails
    /// that row alone (its sampler plugin failed). Rows that leave before the next call are
    /// simply not fed again. An `Err` of the whole call is the device's: every row fails.
    /// A speculative row may commit several tokens in one step (they come in order, none
    /// after its finish).
    pub fn step(&mut self) -> Result<Vec<(u64, Result<Token>)>> {
        self.step_with(None)
    }

    /// `step`, with `policy` choosing the speculative rows' draft budgets where it does
    /// (`Policy::drafts`; else the built-in rule, `DraftCost`).
    pub fn step_with(&mut self, mut policy: Option<&mut (dyn Policy + '_)>) -> Result<StepTokens> {
        let chooses = policy.as_deref_mut().is_some_and(|p| p.chooses_drafts());
        if self.wants_speculation(chooses) {
            // Drafts continue the rows' last tokens: a step in flight is read first, without
            // building the next (the call after this one verifies).
            if let Some(current) = self.pending.take() {
                return self.read(current);
            }
            if let Some(out) = self.speculate(policy.filter(|_| chooses))? {
                return Ok(out);
            }
        }
        let (started, rows) = (Instant::now(), self.rows.len());
        // A step that reads one in flight and starts the next is what plain decoding costs; the
        // first after a verification also waits for its own forward (the pipeline's restart,
        // a cost of the verification), so it is not timed — unless the batch never pipelines.
        let steady = self.pending.is_some() || self.serial();
        let out = self.plain_step();
        let secs = started.elapsed().as_secs_f64();
        self.draft_cost.plain_taken();
        if steady && rows > 0 {
            for spec in self.rows.iter_mut().filter_map(|r| r.speculation.as_mut()) {
                spec.adaptive.plain_step(secs);
            }
            self.draft_cost.timed_plain(rows, secs);
        }
        out
    }

    /// Whether every step is read before the next is built: a sampler plugin's row (its
    /// picks come from the host) or a constrained row that speculates (each token is looked
    /// at for a draft).
    fn serial(&self) -> bool {
        self.rows.iter().any(|r| r.external.is_some() || r.constrained_speculation())
    }

    /// One plain step: every row one token, pipelined where no row needs otherwise.
    fn plain_step(&mut self) -> Result<Vec<(u64, Result<Token>)>> {
        let current = match self.pending.take() {
            Some(step) => step,
            None if self.rows.is_empty() => return Ok(Vec::new()),
            None => self.build(None)?,
        };
        let serial = self.serial();
        let constrained = self.rows.iter().any(|r| r.constraint.is_some());
        if self.rows.is_empty() || serial {
            return self.read(current);
        }
        if !constrained {
            self.pending = Some(self.build(Some(&current))?);
            return self.read(current);
        }
        // With a constrained row only the next step's forward is built before this step's
        // tokens are read (its masks need them). When the masks are slow, reading the tokens,
        // telling the constraints and working out the next masks happen on a helper thread
        // beside the forward's start (starting a forward costs ~1 ms of host time for a 1B
        // model on the H200); the helper reads the tokens' private copy (`Step::copy`, made
        // when the step was built if its masks were slow then). When they are quick and the
        // tokens are already there, that work is done first and the forward starts with the
        // sampling, in one dispatch as an unconstrained step (`merged`); else it is done here
        // after the forward's start. The sampling is started behind the forward with the masks.
        let t0 = Instant::now();
        let (keys, logits) = self.forward(Some(&current))?;
        let t1 = Instant::now();
        let mut dispatched_at = t1;
        let mut current = current;
        let beside = self.beside();
        let copy = current.copy.take().filter(|_| beside);
        let merged = !beside && self.overlap.merges(|| current.tokens.is_available());
        let step_keys = &current.keys;
        let guards: Vec<Telling> = (self.rows.iter_mut())
            .filter_map(|r| {
                let guard = r.constraint.as_mut()?;
                let failed = r.failed.is_some();
                Some(Telling { key: r.key, guard, options: &r.options, generated: r.generated, failed })
            })
            .collect();
        let work = move |ids: Result<Vec<i32>>| -> Result<Helped> {
            let ids = ids.context("reading the batch's tokens")?;
            let (accepted, masks) = tell_constraints(guards, step_keys, &ids);
            Ok(Helped { ids, accepted, masks })
        };
        let read = || current.tokens.to_vec_i32().map_err(anyhow::Error::from);
        let dispatched_at = &mut dispatched_at;
        let helped = match copy {
            Some(copy) => {
                let (helped, dispatched) = constraint::beside(
                    move || work(copy.to_vec_i32().map_err(anyhow::Error::from)),
                    || {
                        let dispatched = mlx::async_eval(&[&logits]);
                        *dispatched_at = Instant::now();
                        dispatched
                    },
                );
                dispatched.map_err(anyhow::Error::from).and(helped)
            }
            None if merged => {
                self.merged_steps += 1;
                work(read())
            }
            None => mlx::async_eval(&[&logits]).map_err(anyhow::Error::from).and_then(|()| {
                *dispatched_at = Instant::now();
                work(read())
            }),
        };
        let t2 = Instant::now();
        let helped = match helped {
            Ok(helped) => helped,
            Err(e) => {
                // No MLX work outlives the batch's failure (see `Drop`).
                let _ = mlx::synchronize();
                return Err(e);
            }
        };
        for (key, said) in helped.accepted {
            if let (Err(e), Some(row)) = (said, self.rows.iter_mut().find(|r| r.key == key)) {
                row.failed = Some(e.context("the output constraint"));
            }
        }
        let told = tell(&mut self.rows, &current.keys, &helped.ids, false);
        let masks = place(&mut self.rows, helped.masks);
        let out = self.tokens(&current, told)?;
        let t3 = Instant::now();
        let next = self.sample(keys, &logits, masks)?;
        self.pending = Some(self.start(next)?);
        // A merged step's forward is handed to MLX with its sampling (in `pick`).
        self.split.build += (t1 - t0).as_secs_f64();
        self.split.dispatch += (*dispatched_at - t1).as_secs_f64();
        self.split.wait += (t2 - *dispatched_at).as_secs_f64();
        self.split.tell += (t3 - t2).as_secs_f64();
        self.split.pick += t3.elapsed().as_secs_f64();
        self.split.steps += 1;
        Ok(out)
    }

    /// Whether a constrained step's tokens are read and its masks worked out on a helper
    /// thread beside the next forward's start: when the rows' masks together are slow
    /// (`SLOW_MASK_SECS`; `Overlap::beside`, `HOST_MASK_OVERLAP` for measuring).
    fn beside(&self) -> bool {
        let mask_secs: f64 = self.rows.iter().filter_map(|r| r.constraint.as_ref()).map(Guard::mean_secs).sum();
        self.overlap.beside(mask_secs > SLOW_MASK_SECS)
    }

    /// Reads the step `current` (evaluating it): each row's token with its finish, told to
    /// its sampler plugin and constraint.
    fn read(&mut self, current: Step) -> Result<Vec<(u64, Result<Token>)>> {
        let t0 = Instant::now();
        let ids = current.tokens.to_vec_i32().context("reading the batch's tokens")?;
        let t1 = Instant::now();
        let told = tell(&mut self.rows, &current.keys, &ids, true);
        let out = self.tokens(&current, told);
        self.split.wait += (t1 - t0).as_secs_f64();
        self.split.tell += t1.elapsed().as_secs_f64();
        self.split.steps += 1;
        out
    }

    /// The step `current`'s tokens as told to its rows, with their log-probabilities.
    fn tokens(&mut self, current: &Step, told: Vec<Told>) -> Result<Vec<(u64, Result<Token>)>> {
        let mut out = Vec::with_capacity(told.len());
        for (key, told) in told {
            let i = current.keys.iter().position(|&k| k == key).expect("a key of the step") as i32;
            out.push((
                key,
                match told {
                    Ok((id, finish)) => {
                        let logprobs = current.logprobs.slice_axis(0, i, i + 1)?.squeeze(&[0])?;
                        Ok(Token { id, logprobs, finish })
                    }
                    Err(e) => Err(e),
                },
            ));
        }
        self.steps += 1;
        if self.steps.is_multiple_of(256) {
            memory::clear_cache();
        }
        Ok(out)
    }

    /// Builds and starts one step over every row: rows in `previous` feed its (lazy) token,
    /// rows that joined since feed their `last`.
    fn build(&mut self, previous: Option<&Step>) -> Result<Step> {
        let t0 = Instant::now();
        let (keys, logits) = self.forward(previous)?;
        let masks = if self.rows.iter().any(|r| r.constraint.is_some()) {
            // The forward runs while the constraints work out their masks.
            mlx::async_eval(&[&logits])?;
            masks(&mut self.rows, &[])
        } else {
            Vec::new()
        };
        let step = self.sample(keys, &logits, masks)?;
        let t1 = Instant::now();
        let step = self.start(step)?;
        if previous.is_some() {
            // Built behind a step in flight (a batch's first step is not).
            self.split.build += (t1 - t0).as_secs_f64();
            self.split.dispatch += t1.elapsed().as_secs_f64();
        }
        Ok(step)
    }

    /// A step's first half: the forward over every row (as `build`) and the rows' logits
    /// processors, giving the rows' keys and processed logits `[B, V]`, lazy.
    fn forward(&mut self, previous: Option<&Step>) -> Result<(Vec<u64>, Array)> {
        let keys: Vec<u64> = self.rows.iter().map(|r| r.key).collect();
        let input = match previous {
            Some(p) if p.keys == keys => p.tokens.clone(),
            _ => {
                let mut pieces = Vec::with_capacity(self.rows.len());
                for row in &self.rows {
                    let fed = previous.and_then(|p| p.keys.iter().position(|&k| k == row.key));
                    pieces.push(match (fed, previous) {
                        (Some(i), Some(p)) => p.tokens.slice_axis(0, i as i32, i as i32 + 1)?,
                        _ => Array::from_i32(&[row.last as i32], &[1])?,
                    });
                }
                mlx::ops::concatenate(&pieces.iter().collect::<Vec<_>>(), 0)?
            }
        };
        let b = self.rows.len() as i32;
        let logits = self.model.forward_batch(&input.reshape(&[b, 1])?, &mut self.cache)?.reshape(&[b, -1])?;
        // Rows with logit processors (bias, penalties over their own history) are processed
        // one by one; the others keep the batch's rows as they are.
        let processed = self.rows.iter().any(|r| r.history.is_some() || !r.sampler.params().logit_bias.is_empty());
        let logits = if processed {
            let mut rows = Vec::with_capacity(self.rows.len());
            for (i, row) in self.rows.iter_mut().enumerate() {
                let i = i as i32;
                let mine = logits.slice_axis(0, i, i + 1)?;
                if let Some(h) = &row.history {
                    row.history = Some(mlx::ops::concatenate(&[h, &input.slice_axis(0, i, i + 1)?], 0)?);
                }
                rows.push(row.sampler.process(&mine, row.history.as_ref())?);
            }
            mlx::ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?
        } else {
            logits
        };
        Ok((keys, logits))
    }

    /// A step's second half: every row's token from the processed `logits` of the forward
    /// over `keys` (its rows, in row order) under `masks` (none: no row is masked), built
    /// (`start` starts it).
    fn sample(&mut self, keys: Vec<u64>, logits: &Array, masks: Vec<Option<constraint::Bits>>) -> Result<Step> {
        let masked;
        let logits = if masks.is_empty() {
            logits
        } else {
            masked = self.masking.apply(logits, &masks)?;
            &masked
        };
        let logprobs = log_softmax(logits)?;
        let external = self.external_picks(logits)?;
        let tokens = if external.is_empty() && self.rows.iter().all(|r| r.sampler.params().temperature == 0.0) {
            logprobs.argmax(-1, false)?.astype(Dtype::Int32)?
        } else {
            let mut picks = Vec::with_capacity(self.rows.len());
            for (i, row) in self.rows.iter().enumerate() {
                let pick = match external.iter().find(|(r, _)| *r == i) {
                    Some((_, id)) => Array::from_i32(&[*id as i32], &[1])?,
                    None => {
                        let mine = logprobs.slice_axis(0, i as i32, i as i32 + 1)?;
                        row.sampler.sample(&mine, row.position)?.astype(Dtype::Int32)?
                    }
                };
                picks.push(pick);
            }
            mlx::ops::concatenate(&picks.iter().collect::<Vec<_>>(), 0)?
        };
        for row in &mut self.rows {
            row.position += 1;
        }
        Ok(Step { keys, tokens, logprobs, copy: None })
    }

    /// Hands a built step to MLX: with the tokens' private copy when the next step's masks
    /// will be worked out on a helper thread (`beside`).
    fn start(&self, mut step: Step) -> Result<Step> {
        if self.rows.iter().any(|r| r.constraint.is_some()) && self.beside() {
            step.copy = Some(mlx::async_eval_detached(&[&step.tokens, &step.logprobs], &step.tokens)?);
        } else {
            mlx::async_eval(&[&step.tokens, &step.logprobs])?;
        }
        Ok(step)
    }

    /// Each plugin row's pick from its processed logits (a row of `logits`, `[B, V]`): the
    /// frames of every plugin row (top-k candidates, or the whole row) are read back in one
    /// evaluation. Returns (row index, token); a row whose plugin failed is left out (it
    /// samples natively: after a fallback for good, else for this step, which then fails it).
    fn external_picks(&mut self, logits: &Array) -> Result<Vec<(usize, u32)>> {
        let vocab = logits.dim(-1);
        let mut frames = Vec::new();
        for (i, row) in self.rows.iter().enumerate() {
            let Some(external) = row.external.as_deref() else { continue };
            frames.push((i, external_frame(external, &logits.slice_axis(0, i as i32, i as i32 + 1)?)?));
        }
        if frames.is_empty() {
            return Ok(Vec::new());
        }
        let arrays: Vec<&Array> = frames.iter().flat_map(|(_, frame)| frame.arrays()).collect();
        mlx::eval(&arrays)?;
        let mut picks = Vec::with_capacity(frames.len());
        for (i, frame) in frames {
            let row = &mut self.rows[i];
            let external = row.external.as_deref_mut().expect("a plugin row");
            match pick_from_frame(external, &row.sampler, row.position, frame, vocab) {
                Ok(id) => picks.push((i, id)),
                Err(e) => row.external_failed(e),
            }
        }
        Ok(picks)
    }
}

/// Tells each row of a step its token `ids` (in the step's row order, `keys`): its sampler
/// plugin, and its constraint unless `constraints` is false (they were told already, a
/// refusal set as the row's failure), are told, its limits checked.
fn tell(rows: &mut [Row<'_>], keys: &[u64], ids: &[i32], constraints: bool) -> Vec<Told> {
    let mut out = Vec::with_capacity(ids.len());
    for (&key, &id) in keys.iter().zip(ids) {
        let Some(row) = rows.iter_mut().find(|r| r.key == key) else { continue };
        let id = id as u32;
        row.last = id;
        row.generated += 1;
        row.committed(id, true);
        if let Some(e) = row.failed.take() {
            out.push((key, Err(e)));
            continue;
        }
        if let Some(external) = row.external.as_deref_mut() {
            if let Err(e) = external.accept(&[id]) {
                row.external_failed(e);
                if let Some(e) = row.failed.take() {
                    out.push((key, Err(e)));
                    continue;
                }
            }
        }
        if let Some(guard) = row.constraint.as_mut().filter(|_| constraints) {
            if let Err(e) = guard.accept(id) {
                out.push((key, Err(e.context("the output constraint"))));
                continue;
            }
        }
        out.push((key, Ok((id, row.options.finish(id, row.generated)))));
    }
    out
}

/// A constrained row's part in a step's helper thread (`Batch::step`).
struct Telling<'a> {
    key: u64,
    guard: &'a mut Guard,
    options: &'a DecodeOptions,
    /// Tokens the row committed before this step's.
    generated: usize,
    /// The row failed in the step (it leaves with that failure).
    failed: bool,
}

/// What a step's helper thread gives back: the step's tokens, what each constraint said to
/// its token, and the next masks.
struct Helped {
    ids: Vec<i32>,
    accepted: Vec<(u64, Result<()>)>,
    masks: Vec<(u64, Result<Option<constraint::Bits>>)>,
}

/// Tells each constrained row's constraint its token of the step (`ids`, in the step's row
/// order, `keys`; a row that joined since has none) and works out the next masks of those
/// that go on (not failed, not ended by the constraint or by their limits): each row's accept
/// and mask together, the rows on helper threads when their masks are slow together
/// (`constraint::each`; llguidance's accept and mask of a row are independent of the others').
#[allow(clippy::type_complexity)]
fn tell_constraints(
    guards: Vec<Telling<'_>>,
    keys: &[u64],
    ids: &[i32],
) -> (Vec<(u64, Result<()>)>, Vec<(u64, Result<Option<constraint::Bits>>)>) {
    let serial: f64 = guards.iter().filter(|t| !t.failed).map(|t| t.guard.mean_secs()).sum();
    let told = constraint::each(guards, serial, |t| {
        let Some(i) = keys.iter().position(|&k| k == t.key) else {
            return (t.key, None, Some(t.guard.mask()));
        };
        if t.failed {
            return (t.key, None, None);
        }
        let id = ids[i] as u32;
        let said = t.guard.accept(id);
        let ends = said.is_err() || t.options.finish(id, t.generated + 1).is_some();
        let mask = (!ends).then(|| t.guard.mask());
        (t.key, Some(said), mask)
    });
    let mut accepted = Vec::new();
    let mut masks = Vec::new();
    for (key, said, mask) in told {
        accepted.extend(said.map(|said| (key, said)));
        masks.extend(mask.map(|mask| (key, mask)));
    }
    (accepted, masks)
}

/// Each row's constraint mask for the next position (`None` for rows without one and for
/// the rows `ended`). A constraint that fails fails its row at the next step's read.
fn masks(rows: &mut [Row<'_>], ended: &[u64]) -> Vec<Option<constraint::Bits>> {
    let guards: Vec<(u64, &mut Guard)> = (rows.iter_mut())
        .filter(|row| !ended.contains(&row.key))
        .filter_map(|row| row.constraint.as_mut().map(|g| (row.key, g)))
        .collect();
    let masks = Guard::masks(guards);
    place(rows, masks)
}

/// Masks by row key in the rows' order (`None` where a row has none); a constraint that
/// failed fails its row at the next step's read.
fn place(rows: &mut [Row<'_>], masks: Vec<(u64, Result<Option<constraint::Bits>>)>) -> Vec<Option<constraint::Bits>> {
    let mut placed = vec![None; rows.len()];
    for (key, mask) in masks {
        let Some(i) = rows.iter().position(|r| r.key == key) else { continue };
        match mask {
            Ok(mask) => placed[i] = mask,
            Err(e) => {
                rows[i].failed.get_or_insert(e.context("the output constraint"));
            }
        }
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Generation, SamplingParams};
    use std::collections::HashMap;

    fn options(max_tokens: usize) -> DecodeOptions {
        DecodeOptions { max_tokens, eos_token_ids: vec![], prefill_step_size: 16 }
    }

    fn alone(model: &dyn CausalLm, prompt: &[u32], params: &SamplingParams, n: usize) -> Vec<u32> {
        let sampler = Sampler::new(params.clone(), model.vocab_size()).unwrap();
        let mut g = Generation::start(model, prompt, sampler, options(n)).unwrap();
        std::iter::from_fn(|| g.next_token().unwrap()).map(|t| t.id).collect()
    }

    /// A row that failed, with its error.
    type Failed = (u64, String);

    /// Steps `batch` until every row has left: each row's tokens, and the rows that failed
    /// with their errors (a row leaves at its finish or its failure).
    fn drain(batch: &mut Batch) -> (HashMap<u64, Vec<u32>>, Vec<Failed>) {
        let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut failed = Vec::new();
        while !batch.is_empty() {
            for (key, token) in batch.step().unwrap() {
                match token {
                    Ok(token) => {
                        got.entry(key).or_default().push(token.id);
                        if token.finish.is_some() {
                            batch.leave(key).unwrap();
                        }
                    }
                    Err(e) => {
                        failed.push((key, format!("{e:#}")));
                        batch.leave(key).unwrap();
                    }
                }
            }
        }
        (got, failed)
    }

    fn prefilled(model: &dyn CausalLm, prompt: &[u32]) -> Vec<KvCache> {
        let mut cache = model.make_cache();
        crate::engine::step::prefill(model, &mut cache, &prompt[..prompt.len() - 1], 8).unwrap();
        cache
    }

    /// What a scripted batch run does before a step: row i joins (`make(i)`, its prompt
    /// prefilled), row `key` leaves and is parked, the parked row joins again.
    enum At {
        Join(usize),
        Park(u64),
        Rejoin,
    }

    /// Steps `batch` through `script` (`(step, event)`: before that step) until every row has
    /// left and the script is done: each row's tokens, and its speculative counts at its
    /// finish.
    fn scripted<'m>(
        batch: &mut Batch<'m>,
        model: &'m dyn CausalLm,
        prompts: &[Vec<u32>],
        make: &dyn Fn(usize) -> Row<'m>,
        script: &[(usize, At)],
    ) -> (HashMap<u64, Vec<u32>>, HashMap<u64, SpecCounts>) {
        let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut counts: HashMap<u64, SpecCounts> = HashMap::new();
        let mut parked = None;
        let last = script.iter().map(|(s, _)| *s).max().unwrap_or(0);
        for step in 0..400 {
            for (_, at) in script.iter().filter(|(s, _)| *s == step) {
                match at {
                    At::Join(i) => batch.join(make(*i), &prefilled(model, &prompts[*i])).unwrap(),
                    At::Park(key) => parked = batch.leave(*key).unwrap(),
                    At::Rejoin => {
                        let left: Left = parked.take().unwrap();
                        batch.join(left.row, &left.cache).unwrap();
                    }
                }
            }
            for (key, token) in batch.step().unwrap() {
                let token = token.unwrap();
                got.entry(key).or_default().push(token.id);
                if token.finish.is_some() {
                    counts.insert(key, batch.row(key).unwrap().spec_counts());
                    batch.leave(key).unwrap();
                }
            }
            if batch.is_empty() && step >= last {
                break;
            }
        }
        (got, counts)
    }

    /// Rows with their own sampling settings (greedy, seeded with top-p, penalties with a
    /// bias), joining at different steps (the first two together, `join_all`) and one leaving
    /// and rejoining mid-way, each get the tokens they get alone. A join of a row already in
    /// the batch is refused, with the batch as it was.
    #[test]
    fn every_row_gets_the_tokens_it_gets_alone_while_rows_join_leave_and_rejoin() {
        for arch in ["llama", "qwen3"] {
            let model = models::testing::model(arch, 4).unwrap();
            let model = model.as_ref();
            let vocab = model.vocab_size() as u32;
            let prompts: Vec<Vec<u32>> = [3usize, 20, 1, 9]
                .iter()
                .map(|&n| (0..n as u32).map(|i| (i * 31 + n as u32 * 7) % vocab).collect())
                .collect();
            let mut penalized = SamplingParams { repetition_penalty: Some(1.3), ..Default::default() };
            penalized.logit_bias.insert(5, 2.0);
            let params = [
                SamplingParams::default(),
                SamplingParams { temperature: 0.9, top_p: 0.9, seed: Some(11), ..Default::default() },
                penalized,
                SamplingParams { temperature: 1.2, min_p: 0.05, top_k: 20, seed: Some(3), ..Default::default() },
            ];
            let n = 12;
            let expected: Vec<Vec<u32>> = (0..4).map(|i| alone(model, &prompts[i], &params[i], n)).collect();
            let mut batch = Batch::new(model);
            let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
            let row = |i: usize| {
                let sampler = Sampler::new(params[i].clone(), model.vocab_size()).unwrap();
                Row::new(i as u64, &prompts[i], sampler, options(n)).unwrap()
            };
            let join = |batch: &mut Batch, i: usize| batch.join(row(i), &prefilled(model, &prompts[i])).unwrap();
            let first: Vec<Vec<KvCache>> = (0..2).map(|i| prefilled(model, &prompts[i])).collect();
            batch.join_all(vec![(row(0), &first[0]), (row(1), &first[1])]).unwrap();
            let again = batch.join_all(vec![(row(2), &first[0]), (row(1), &first[1])]).unwrap_err();
            assert!(format!("{again:#}").contains("row 1 is already in the batch"), "{again:#}");
            assert_eq!((batch.len(), batch.cache[0].rows()), (2, 2), "{arch}: a refused join changed the batch");
            let mut parked = None;
            for step in 0..40 {
                match step {
                    2 => join(&mut batch, 2),
                    4 => parked = batch.leave(1).unwrap(),
                    5 => join(&mut batch, 3),
                    7 => {
                        let left = parked.take().unwrap();
                        batch.join(left.row, &left.cache).unwrap();
                    }
                    _ => {}
                }
                for (key, token) in batch.step().unwrap() {
                    let token = token.unwrap();
                    got.entry(key).or_default().push(token.id);
                    if token.finish.is_some() {
                        let left = batch.leave(key).unwrap().unwrap();
                        assert_eq!(left.row.generated(), n);
                    }
                }
                if batch.is_empty() && step > 7 {
                    break;
                }
            }
            for (i, want) in expected.iter().enumerate() {
                assert_eq!(got.get(&(i as u64)), Some(want), "{arch}: row {i}");
            }
        }
    }

    /// A constrained row beside free rows: the free rows get what they get alone, and the
    /// constrained one what it gets alone under the same constraint (its every token in its
    /// set, and the end of sequence where the constraint ends).
    #[test]
    fn a_constrained_row_gets_its_solo_tokens_and_leaves_the_other_rows_unchanged() {
        use crate::engine::constraint::tests::script;
        let model = models::testing::model("llama", 8).unwrap();
        let model = model.as_ref();
        let vocab = model.vocab_size();
        let eos = vocab as u32 - 1;
        let prompts: Vec<Vec<u32>> = vec![vec![3, 4, 5, 6], vec![9; 7], vec![1, 2, 40]];
        let sets: Vec<Vec<u32>> = (0..9u32).map(|i| vec![10 + i, 50 + 2 * i, 90 - i]).collect();
        let n = 16;
        let opts = DecodeOptions { max_tokens: n, eos_token_ids: vec![eos], prefill_step_size: 16 };
        let guard = || Guard::start(&script(sets.clone(), vocab), 0, &[eos], vocab).unwrap();
        let greedy = SamplingParams::default();
        let seeded = SamplingParams { temperature: 1.0, seed: Some(9), ..Default::default() };
        let params = [greedy.clone(), seeded, greedy];
        let solo = |i: usize, constrained: bool| -> Vec<u32> {
            let sampler = Sampler::new(params[i].clone(), model.vocab_size()).unwrap();
            let hooks = crate::engine::Hooks { constraint: constrained.then(guard), ..Default::default() };
            let mut g =
                Generation::start_with(model, model.make_cache(), &prompts[i], sampler, opts.clone(), hooks).unwrap();
            std::iter::from_fn(|| g.next_token().unwrap()).map(|t| t.id).collect()
        };
        let expected = [solo(0, false), solo(1, true), solo(2, false)];
        assert_eq!(expected[1].len(), sets.len() + 1);
        assert_eq!(expected[1].last(), Some(&eos));
        assert!(expected[1].iter().zip(&sets).all(|(t, s)| s.contains(t)), "{:?}", expected[1]);
        assert_ne!(expected[1], solo(1, false), "the constraint changes the output");
        // The tokens read and the masks worked out after the next forward's start, on a
        // helper thread beside it (as for slow masks), and before it, the forward started with
        // the sampling (as for quick ones whose tokens are there).
        for overlap in [Overlap::Never, Overlap::Always, Overlap::Merged] {
            let mut batch = Batch::new(model);
            batch.overlap = overlap;
            let join = |batch: &mut Batch, i: usize| {
                let sampler = Sampler::new(params[i].clone(), model.vocab_size()).unwrap();
                let row = Row::new(i as u64, &prompts[i], sampler, opts.clone()).unwrap();
                batch.join(row.with_constraint((i == 1).then(guard)), &prefilled(model, &prompts[i])).unwrap();
            };
            join(&mut batch, 0);
            join(&mut batch, 2);
            let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
            let mut steps = 0;
            while !batch.is_empty() {
                // The constrained row joins a batch whose step in flight was built without one.
                if steps == 2 {
                    join(&mut batch, 1);
                }
                steps += 1;
                let tokens = batch.step().unwrap();
                assert!(batch.pending.is_some(), "the next step is in flight when the tokens are read (pipelined)");
                for (key, token) in tokens {
                    let token = token.unwrap();
                    got.entry(key).or_default().push(token.id);
                    if token.finish.is_some() {
                        batch.leave(key).unwrap();
                    }
                }
            }
            for (i, want) in expected.iter().enumerate() {
                assert_eq!(got.get(&(i as u64)), Some(want), "row {i}, {overlap:?}");
            }
            // Merged: every constrained step read its tokens first and started the forward
            // with the sampling (the last step of the batch has nothing to build).
            let merged = batch.merged_steps();
            match overlap {
                Overlap::Merged => assert!(merged >= expected[1].len() - 1, "{merged} of {}", expected[1].len()),
                _ => assert_eq!(merged, 0, "{overlap:?}"),
            }
        }
    }

    /// A constraint that allows anything for `ok` positions, then fails.
    struct Breaks {
        ok: usize,
        seen: usize,
    }

    impl crate::engine::Constraint for Breaks {
        fn allowed(&mut self) -> Result<crate::engine::Allowed> {
            if self.seen >= self.ok {
                anyhow::bail!("the test constraint broke at output position {}", self.seen);
            }
            Ok(crate::engine::Allowed::Anything)
        }
        fn accept(&mut self, _token: u32) -> Result<()> {
            self.seen += 1;
            Ok(())
        }
        fn rollback(&mut self, tokens: usize) -> Result<()> {
            self.seen -= tokens;
            Ok(())
        }
    }

    /// A constraint that fails fails its row alone, with its reason; the other rows go on
    /// and get what they get alone.
    #[test]
    fn a_failing_constraint_fails_only_its_row() {
        let model = models::testing::model("llama", 8).unwrap();
        let model = model.as_ref();
        let prompts: Vec<Vec<u32>> = vec![vec![3, 4, 5], vec![9; 6], vec![1, 2]];
        let n = 10;
        let spec = crate::engine::ConstraintSpec::new("breaks", |_| {
            Ok(Box::new(Breaks { ok: 3, seen: 0 }) as Box<dyn crate::engine::Constraint>)
        });
        let greedy = SamplingParams::default();
        for overlap in [Overlap::Never, Overlap::Always, Overlap::Merged] {
            let mut batch = Batch::new(model);
            batch.overlap = overlap;
            for (i, p) in prompts.iter().enumerate() {
                let sampler = Sampler::new(greedy.clone(), model.vocab_size()).unwrap();
                let guard = (i == 1).then(|| Guard::start(&spec, 0, &[], model.vocab_size()).unwrap());
                let row = Row::new(i as u64, p, sampler, options(n)).unwrap().with_constraint(guard);
                batch.join(row, &prefilled(model, p)).unwrap();
            }
            let (got, failed) = drain(&mut batch);
            assert_eq!(failed.len(), 1, "{failed:?}");
            assert_eq!(failed[0].0, 1);
            assert!(
                failed[0].1.contains("output constraint") && failed[0].1.contains("broke at output position 3"),
                "{failed:?}"
            );
            assert_eq!(got[&1].len(), 3, "the row had its tokens before the failure ({overlap:?})");
            for i in [0, 2] {
                assert_eq!(got[&(i as u64)], alone(model, &prompts[i], &greedy, n), "row {i}, {overlap:?}");
            }
        }
    }

    /// A plugin-like sampler: picks the candidate at (position + accepted tokens) mod k, and
    /// fails at `fail_at` (a position) if set.
    struct Cycling {
        k: usize,
        accepted: Vec<u32>,
        fail_at: Option<usize>,
        fallback: bool,
    }

    impl ExternalSampler for Cycling {
        fn candidates(&self) -> Option<usize> {
            Some(self.k)
        }
        fn sample(&mut self, position: usize, frame: super::super::Frame<'_>) -> Result<super::super::Pick> {
            if self.fail_at == Some(position) {
                anyhow::bail!("the test sampler failed at position {position}");
            }
            let super::super::Frame::Candidates(c) = frame else { unreachable!("asked for candidates") };
            Ok(super::super::Pick::Token(c[(position + self.accepted.len()) % c.len()].0))
        }
        fn accept(&mut self, tokens: &[u32]) -> Result<()> {
            self.accepted.extend(tokens);
            Ok(())
        }
        fn fallback(&self) -> bool {
            self.fallback
        }
    }

    /// A plugin-sampled row beside native rows gets the plugin's picks, the plugin sees each
    /// committed token once and in order, the native rows are untouched, and a plugin that
    /// fails fails only its row (or hands it to native sampling when allowed).
    #[test]
    fn plugin_rows_beside_native_rows_get_what_they_get_alone_and_fail_alone() {
        let model = models::testing::model("llama", 6).unwrap();
        let model = model.as_ref();
        let prompts: Vec<Vec<u32>> = vec![vec![3, 4, 5], vec![9; 11], vec![1, 2], vec![7, 8, 9, 10]];
        let n = 10;
        let cycling = |fail_at, fallback| Cycling { k: 5, accepted: Vec::new(), fail_at, fallback };
        let greedy = SamplingParams::default();
        let alone_plugin = |p: &[u32], fail_at, fallback| -> Result<Vec<u32>> {
            let sampler = Sampler::new(greedy.clone(), model.vocab_size()).unwrap();
            let hooks = crate::engine::Hooks {
                external: Some(Box::new(cycling(fail_at, fallback))),
                speculation: None,
                constraint: None,
            };
            let mut g = Generation::start_with(model, model.make_cache(), p, sampler, options(n), hooks)?;
            let mut out = Vec::new();
            while let Some(t) = g.next_token()? {
                out.push(t.id);
            }
            Ok(out)
        };
        let expected = [
            alone(model, &prompts[0], &greedy, n),
            alone_plugin(&prompts[1], None, false).unwrap(),
            alone_plugin(&prompts[2], Some(prompts[2].len() + 3), true).unwrap(),
            alone(model, &prompts[3], &greedy, n),
        ];
        assert_ne!(expected[1], alone(model, &prompts[1], &greedy, n), "the plugin changes the output");
        let mut batch = Batch::new(model);
        let plugins: [Option<(Option<usize>, bool)>; 5] =
            [None, Some((None, false)), Some((Some(prompts[2].len() + 3), true)), None, Some((Some(9 + 2), false))];
        let mut all = prompts.clone();
        all.push(vec![9; 9]);
        for (i, p) in all.iter().enumerate() {
            let sampler = Sampler::new(greedy.clone(), model.vocab_size()).unwrap();
            let external = plugins[i].map(|(f, fb)| Box::new(cycling(f, fb)) as Box<dyn ExternalSampler>);
            let row = Row::new(i as u64, p, sampler, options(n)).unwrap().with_external(external);
            batch.join(row, &prefilled(model, p)).unwrap();
        }
        let (got, failed) = drain(&mut batch);
        for (i, want) in expected.iter().enumerate() {
            assert_eq!(got.get(&(i as u64)), Some(want), "row {i}");
        }
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert_eq!(failed[0].0, 4);
        assert!(failed[0].1.contains("failed at position 11"), "{failed:?}");
        assert_eq!(got[&4].len(), 2, "the failing row had its tokens before the failure");
    }

    /// Speculative rows (prompt lookup, a draft model; greedy and seeded) beside plain rows
    /// (greedy, penalized): every row gets exactly its solo plain tokens while rows join,
    /// park and rejoin, and leave; verifications ran, drafts were accepted and rejected (rows
    /// rolled back by their own amounts) — on models with sliding-window layers too (window
    /// 8: a row's window spans its holes) and with recurrent ones (Qwen3.5's DeltaNet).
    #[test]
    fn speculative_rows_get_their_solo_plain_tokens_beside_plain_rows() {
        use crate::engine::speculative::{SpecConfig, SpecMethod, Speculation};
        for arch in ["llama", "qwen3", "gemma3_text", "gpt_oss", "qwen3_5"] {
            let model = models::testing::model(arch, 4).unwrap();
            let model = model.as_ref();
            let draft = models::testing::model(arch, 9).unwrap();
            let vocab = model.vocab_size() as u32;
            // Repetitive prompts, so prompt lookup finds matches in them and in the output.
            let prompts: Vec<Vec<u32>> = [5usize, 3, 7, 4, 6]
                .iter()
                .map(|&p| (0..24u32).map(|i| (i % p as u32) * 13 % vocab + 2).collect())
                .collect();
            let mut penalized = SamplingParams { frequency_penalty: Some(0.3), ..Default::default() };
            penalized.logit_bias.insert(3, 1.0);
            let seeded = SamplingParams { temperature: 0.8, seed: Some(5), ..Default::default() };
            let greedy = SamplingParams::default();
            let params = [greedy.clone(), seeded.clone(), greedy.clone(), penalized, greedy];
            // Row 3 speculates under penalties and a bias (drafts processed position by position).
            let methods = [
                SpecMethod::PromptLookup,
                SpecMethod::PromptLookup,
                SpecMethod::Draft,
                SpecMethod::PromptLookup,
                SpecMethod::Off,
            ];
            let n = 40;
            let expected: Vec<Vec<u32>> = (0..5).map(|i| alone(model, &prompts[i], &params[i], n)).collect();
            let mut batch = Batch::new(model);
            // Every draft verified: the tiny model's timings would keep most steps plain.
            batch.draft_cost = DraftCost::off();
            let make = |i: usize| -> Row {
                let sampler = Sampler::new(params[i].clone(), model.vocab_size()).unwrap();
                let config = SpecConfig { method: methods[i], num_draft_tokens: 6, ..Default::default() };
                let spec = (methods[i] != SpecMethod::Off)
                    .then(|| Speculation::new(config, &prompts[i], Some(draft.as_ref()), 16).unwrap());
                Row::new(i as u64, &prompts[i], sampler, options(n)).unwrap().with_speculation(spec)
            };
            let script = [
                (0, At::Join(0)),
                (0, At::Join(3)),
                (2, At::Join(1)),
                (3, At::Join(2)),
                (6, At::Park(0)),
                (7, At::Join(4)),
                (9, At::Rejoin),
            ];
            let (got, counts) = scripted(&mut batch, model, &prompts, &make, &script);
            for (i, want) in expected.iter().enumerate() {
                assert_eq!(got.get(&(i as u64)), Some(want), "{arch}: row {i} ({:?})", methods[i]);
            }
            assert!(batch.verified().steps > 0, "{arch}: no step verified drafts");
            let spec: Vec<SpecCounts> = (0..4).map(|i| counts[&i]).collect();
            assert!(spec.iter().all(|c| c.verifications > 0), "{arch}: {spec:?}");
            assert!(spec.iter().any(|c| c.accepted > 0), "{arch}: no draft accepted: {spec:?}");
            assert!(spec.iter().any(|c| c.drafted > c.accepted), "{arch}: no draft rejected: {spec:?}");
            assert!(spec[0].steps < n, "{arch}: speculation saved no step: {spec:?}");
            assert_eq!(counts[&4].drafted, 0);
        }
    }

    /// Rows drafting with a draft model draft together (`batch/draft.rs`): one forward of the
    /// draft model a drafted position for all of them, not one a row. Drafted by another
    /// model, rows joining late, one parking and rejoining (its draft cache handed back and
    /// taken again), each gets its solo plain tokens, with drafts accepted and refused; on a
    /// model with sliding-window layers too (random draft weights: drafts refused). Drafted
    /// by the model itself, every draft of every row is accepted: the batch drafts each row
    /// from exactly its own sequence.
    #[test]
    fn draft_model_rows_draft_together_and_get_their_solo_tokens() {
        use crate::engine::speculative::{SpecConfig, SpecMethod, Speculation};
        // (model, drafted by itself, drafts refused: the tiny Gemma's greedy tokens are the
        // same whatever its weights)
        let cases = [
            ("llama", false, true),
            ("gemma3_text", false, false),
            ("qwen3_5", false, true),
            ("llama", true, false),
            ("qwen3_5", true, false),
        ];
        for (arch, same, refused) in cases {
            let model = models::testing::model(arch, 4).unwrap();
            let other = models::testing::model(arch, 9).unwrap();
            let (model, draft) = (model.as_ref(), if same { model.as_ref() } else { other.as_ref() });
            let vocab = model.vocab_size() as u32;
            // Rows 0 and 1 take their seats at the same draft, near enough in length to catch
            // up in one joint prefill of the draft model.
            let prompts: Vec<Vec<u32>> =
                [7u32, 11, 3, 17].iter().map(|&n| (0..n).map(|i| (i * 7 + n) % vocab).collect()).collect();
            let greedy = SamplingParams::default();
            let n = 40;
            let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(model, p, &greedy, n)).collect();
            let mut batch = Batch::new(model);
            batch.draft_cost = DraftCost::off();
            let make = |i: usize| -> Row {
                let sampler = Sampler::new(greedy.clone(), model.vocab_size()).unwrap();
                let config = SpecConfig { method: SpecMethod::Draft, num_draft_tokens: 4, ..Default::default() };
                let spec = Speculation::new(config, &prompts[i], Some(draft), 16).unwrap();
                Row::new(i as u64, &prompts[i], sampler, options(n)).unwrap().with_speculation(Some(spec))
            };
            let script = [
                (0, At::Join(0)),
                (0, At::Join(1)),
                (2, At::Join(2)),
                (4, At::Park(1)),
                (5, At::Join(3)),
                (8, At::Rejoin),
            ];
            let (got, counts) = scripted(&mut batch, model, &prompts, &make, &script);
            for (i, want) in expected.iter().enumerate() {
                assert_eq!(got.get(&(i as u64)), Some(want), "{arch}: row {i}");
            }
            let spec: Vec<SpecCounts> = (0..4).map(|i| counts[&i]).collect();
            assert!(spec.iter().all(|c| c.verifications > 0), "{arch}: {spec:?}");
            if same {
                let all = |c: &SpecCounts| c.accepted == c.drafted && c.accepted > 0;
                assert!(spec.iter().all(all), "{arch}: a draft of the model itself refused: {spec:?}");
            }
            if refused {
                assert!(spec.iter().any(|c| c.drafted > c.accepted), "{arch}: no draft refused: {spec:?}");
            }
            let drafted: usize = spec.iter().map(|c| c.drafted).sum();
            let forwards = batch.draft_forwards();
            assert!(forwards > 0 && forwards < drafted, "{arch}: {forwards} draft forwards for {drafted} drafts");
            assert!(batch.drafts_caught_up_together() >= 2, "{arch}: no seats caught up together");
        }
    }

    /// One greedy row of `n` tokens speculating with `method` (`draft` for a draft model, four
    /// tokens a draft), run alone in `batch` to its end: its ids and its last counts.
    fn speculating_alone<'m>(
        batch: &mut Batch<'m>,
        prompt: &[u32],
        method: crate::engine::speculative::SpecMethod,
        draft: Option<&'m dyn CausalLm>,
        n: usize,
    ) -> (Vec<u32>, SpecCounts) {
        use crate::engine::speculative::{SpecConfig, Speculation};
        let model = batch.model;
        let sampler = Sampler::new(SamplingParams::default(), model.vocab_size()).unwrap();
        let config = SpecConfig { method, num_draft_tokens: 4, ..Default::default() };
        let spec = Speculation::new(config, prompt, draft, 16).unwrap();
        let row = Row::new(0, prompt, sampler, options(n)).unwrap().with_speculation(Some(spec));
        batch.join(row, &prefilled(model, prompt)).unwrap();
        let (mut ids, mut counts) = (Vec::new(), SpecCounts::default());
        while !batch.is_empty() {
            for (key, token) in batch.step().unwrap() {
                counts = batch.row(key).unwrap().spec_counts();
                let token = token.unwrap();
                ids.push(token.id);
                if token.finish.is_some() {
                    batch.leave(key).unwrap();
                }
            }
        }
        (ids, counts)
    }

    /// A speculative row's first drafts are verified even where the measured cost says plain
    /// steps are quicker (verifications timed as a thousand times a plain step), so the rule
    /// learns the row's own acceptance; after that the cost keeps it plain.
    #[test]
    fn a_rows_first_drafts_are_verified_whatever_the_cost() {
        let model = models::testing::model("llama", 4).unwrap();
        let mut batch = Batch::new(model.as_ref());
        batch.draft_cost = DraftCost::default();
        batch.draft_cost.timed_plain(1, 0.001);
        for positions in 2..=16 {
            batch.draft_cost.timed_verification(positions, 1.0);
        }
        let prompt: Vec<u32> = [3u32, 4, 5, 6].repeat(4);
        let lookup = crate::engine::speculative::SpecMethod::PromptLookup;
        let (_, counts) = speculating_alone(&mut batch, &prompt, lookup, None, 12);
        assert_eq!(counts.verifications, 1, "{counts:?}");
    }

    /// A draft model drafting for itself: every draft passes, so no verification ever misses,
    /// and with nothing plain timed the rule cannot weigh a verification's cost (drafting
    /// included) against a plain step's — the batch takes plain steps to time one
    /// (`DraftCost::probing`) instead of verifying every step; its tokens stay plain's.
    #[test]
    fn a_batch_whose_drafts_always_pass_still_times_a_plain_step() {
        let model = models::testing::model("llama", 4).unwrap();
        let model = model.as_ref();
        let mut batch = Batch::new(model);
        batch.draft_cost = DraftCost::default();
        let prompt: Vec<u32> = (3u32..11).collect();
        let n = 40;
        let draft = crate::engine::speculative::SpecMethod::Draft;
        let (ids, counts) = speculating_alone(&mut batch, &prompt, draft, Some(model), n);
        assert_eq!(ids, alone(model, &prompt, &SamplingParams::default(), n));
        assert_eq!(counts.accepted, counts.drafted, "{counts:?}");
        assert!(counts.steps >= counts.verifications + 2, "no plain step was timed: {counts:?}");
    }

    /// Lossless verification in batch rows keeps each row's output distribution: over many
    /// seeds, the second token of a lossless row (drafted by another model) beside a plain
    /// row is distributed as plain sampling's (the statistical test of `decode.rs`, on rows),
    /// and the plain row beside it is unchanged.
    #[test]
    fn lossless_rows_keep_the_output_distribution() {
        use crate::engine::speculative::{SpecConfig, SpecMethod, Speculation, Verify};
        let model = models::testing::model("qwen2", 31).unwrap();
        let draft = models::testing::model("qwen2", 32).unwrap();
        let (model, draft) = (model.as_ref(), draft.as_ref());
        let prompt = [1u32, 2, 3];
        let other = [5u32, 6, 7, 8];
        let beside = alone(model, &other, &SamplingParams::default(), 3);
        let n = 400;
        let (mut plain, mut rows) = (vec![0f64; 128], vec![0f64; 128]);
        let mut verified = 0;
        for seed in 0..n {
            let params = SamplingParams { temperature: 0.6, seed: Some(seed), ..Default::default() };
            plain[alone(model, &prompt, &params, 3)[1] as usize] += 1.0;
            let mut batch = Batch::new(model);
            batch.draft_cost = DraftCost::off();
            let config = SpecConfig {
                method: SpecMethod::Draft,
                num_draft_tokens: 2,
                verify: Verify::Lossless,
                ..Default::default()
            };
            let spec = Speculation::new(config, &prompt, Some(draft), 16).unwrap();
            let sampler = Sampler::new(params, model.vocab_size()).unwrap();
            let row = Row::new(0, &prompt, sampler, options(3)).unwrap().with_speculation(Some(spec));
            batch.join(row, &prefilled(model, &prompt)).unwrap();
            let greedy = Sampler::new(SamplingParams::default(), model.vocab_size()).unwrap();
            batch.join(Row::new(1, &other, greedy, options(3)).unwrap(), &prefilled(model, &other)).unwrap();
            let (got, failed) = drain(&mut batch);
            assert!(failed.is_empty(), "{failed:?}");
            assert_eq!(got[&1], beside);
            rows[got[&0][1] as usize] += 1.0;
            verified += batch.verified().steps;
        }
        assert!(verified >= n as usize, "the lossless rows verified drafts");
        // Total variation between the two empirical second-token distributions (0.3: as
        // `decode.rs`'s test; accepting every draft instead would give ~0.9).
        let tv: f64 = plain.iter().zip(&rows).map(|(a, b)| (a - b).abs()).sum::<f64>() / (2.0 * n as f64);
        assert!(tv < 0.3, "total variation {tv}");
    }

    /// Constrained speculative rows: masked at every drafted position, their committed tokens
    /// told to the constraint. A row drafted by the model itself (its drafts are what the
    /// model picks unconstrained) and one by prompt lookup, each under a constraint that
    /// refuses some of those picks, get their solo tokens under it, beside a plain row; drafts
    /// were accepted and refused.
    #[test]
    fn constrained_speculative_rows_get_their_solo_constrained_tokens() {
        use crate::engine::constraint::tests::script;
        use crate::engine::speculative::{SpecConfig, SpecMethod, Speculation};
        let model = models::testing::model("llama", 8).unwrap();
        let model = model.as_ref();
        let vocab = model.vocab_size();
        let eos = vocab as u32 - 1;
        let prompts: Vec<Vec<u32>> =
            vec![vec![3, 4, 5, 6, 3, 4, 5, 6, 3, 4], vec![9, 8, 9, 8, 9, 8, 9], vec![1, 2, 40]];
        // Every position refuses an eighth of the vocabulary (a different eighth each time).
        let sets: Vec<Vec<u32>> =
            (0..30u32).map(|i| (0..vocab as u32 - 1).filter(|t| (t + i) % 8 != 0).collect()).collect();
        let n = 24;
        let opts = DecodeOptions { max_tokens: n, eos_token_ids: vec![eos], prefill_step_size: 16 };
        let guard = || Guard::start(&script(sets.clone(), vocab), 0, &[eos], vocab).unwrap();
        let greedy = SamplingParams::default();
        let solo = |i: usize, constrained: bool| -> Vec<u32> {
            let sampler = Sampler::new(greedy.clone(), vocab).unwrap();
            let hooks = crate::engine::Hooks { constraint: constrained.then(guard), ..Default::default() };
            let mut g =
                Generation::start_with(model, model.make_cache(), &prompts[i], sampler, opts.clone(), hooks).unwrap();
            std::iter::from_fn(|| g.next_token().unwrap()).map(|t| t.id).collect()
        };
        let expected = [solo(0, true), solo(1, true), solo(2, false)];
        assert_ne!(expected[0], solo(0, false), "the constraint changes the output");
        let mut batch = Batch::new(model);
        batch.draft_cost = DraftCost::off();
        let methods = [SpecMethod::Draft, SpecMethod::PromptLookup, SpecMethod::Off];
        for (i, p) in prompts.iter().enumerate() {
            let config = SpecConfig { method: methods[i], num_draft_tokens: 4, ..Default::default() };
            let spec = (methods[i] != SpecMethod::Off).then(|| Speculation::new(config, p, Some(model), 16).unwrap());
            let sampler = Sampler::new(greedy.clone(), vocab).unwrap();
            let row = Row::new(i as u64, p, sampler, opts.clone()).unwrap().with_speculation(spec);
            batch.join(row.with_constraint((i < 2).then(guard)), &prefilled(model, p)).unwrap();
        }
        let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut counts = Vec::new();
        while !batch.is_empty() {
            for (key, token) in batch.step().unwrap() {
                let token = token.unwrap();
                got.entry(key).or_default().push(token.id);
                if token.finish.is_some() {
                    counts.push((key, batch.row(key).unwrap().spec_counts()));
                    batch.leave(key).unwrap();
                }
            }
        }
        for (i, want) in expected.iter().enumerate() {
            assert_eq!(got.get(&(i as u64)), Some(want), "row {i} ({:?})", methods[i]);
        }
        let drafted = counts.iter().find(|(k, _)| *k == 0).unwrap().1;
        assert!(drafted.accepted > 0 && drafted.drafted > drafted.accepted, "{counts:?}");
    }

    /// Plugin-sampled speculative rows: the plugin picks at every drafted position, told each
    /// pick before the next, and a row keeps its drafts while they equal the picks. A plugin
    /// picking the top candidate with the model itself drafting (drafts accepted) and one
    /// picking other candidates with prompt lookup (drafts refused) get what they get alone
    /// without speculation, beside a plain row; a plugin that fails mid-way with a fallback
    /// hands its row to native sampling, as alone.
    #[test]
    fn plugin_sampled_speculative_rows_get_their_solo_tokens() {
        use crate::engine::speculative::{SpecConfig, SpecMethod, Speculation};
        let model = models::testing::model("llama", 6).unwrap();
        let model = model.as_ref();
        let prompts: Vec<Vec<u32>> =
            vec![vec![3, 4, 5, 3, 4, 5, 3], vec![9, 8, 9, 8, 9, 8], vec![1, 2], vec![7, 8, 7, 8]];
        let n = 16;
        let greedy = SamplingParams::default();
        // (top-k the plugin picks from, fails at, falls back) per row; row 2 is plain.
        let plugins = [Some((1, None)), Some((5, None)), None, Some((1, Some(prompts[3].len() + 6)))];
        let methods = [SpecMethod::Draft, SpecMethod::PromptLookup, SpecMethod::Off, SpecMethod::Draft];
        let external = |i: usize| -> Option<Box<dyn ExternalSampler>> {
            plugins[i].map(|(k, fail_at)| {
                Box::new(Cycling { k, accepted: Vec::new(), fail_at, fallback: true }) as Box<dyn ExternalSampler>
            })
        };
        let expected: Vec<Vec<u32>> = (0..4)
            .map(|i| {
                let sampler = Sampler::new(greedy.clone(), model.vocab_size()).unwrap();
                let hooks = crate::engine::Hooks { external: external(i), ..Default::default() };
                let mut g =
                    Generation::start_with(model, model.make_cache(), &prompts[i], sampler, options(n), hooks).unwrap();
                std::iter::from_fn(|| g.next_token().unwrap()).map(|t| t.id).collect()
            })
            .collect();
        let mut batch = Batch::new(model);
        batch.draft_cost = DraftCost::off();
        for (i, p) in prompts.iter().enumerate() {
            let config = SpecConfig { method: methods[i], num_draft_tokens: 4, ..Default::default() };
            let spec = (methods[i] != SpecMethod::Off).then(|| Speculation::new(config, p, Some(model), 16).unwrap());
            let sampler = Sampler::new(greedy.clone(), model.vocab_size()).unwrap();
            let row = Row::new(i as u64, p, sampler, options(n)).unwrap().with_external(external(i));
            batch.join(row.with_speculation(spec), &prefilled(model, p)).unwrap();
        }
        let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut counts = HashMap::new();
        while !batch.is_empty() {
            for (key, token) in batch.step().unwrap() {
                let token = token.unwrap();
                got.entry(key).or_default().push(token.id);
                if token.finish.is_some() {
                    counts.insert(key, batch.row(key).unwrap().spec_counts());
                    batch.leave(key).unwrap();
                }
            }
        }
        for (i, want) in expected.iter().enumerate() {
            assert_eq!(got.get(&(i as u64)), Some(want), "row {i} ({:?})", methods[i]);
        }
        assert!(counts[&0].accepted > 0, "{counts:?}");
        assert!(counts[&1].drafted > counts[&1].accepted, "{counts:?}");
    }
}
