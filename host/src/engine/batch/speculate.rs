//! Speculative rows of the batch: a row with a drafter (prompt lookup, a draft model) drafts
//! its next tokens, and one forward verifies every row's drafts together — `[B, T]`, T one
//! more than the longest draft, shorter rows padded (their padded positions are causal-masked
//! from the real ones and never read). Each row keeps the prefix its own sampler agrees with
//! (sample and match: exactly the tokens plain decoding gives it) plus the sampler's token
//! after it, and its cache rolls back by its own amount (`BatchKvCache::trim_rows`). Rows
//! with no draft this step take the one token a plain step gives them.
//!
//! A verification needs every row's last token on the host (the drafts continue it), so it
//! is not pipelined: a step in flight is read first (`Batch::step`), and the step after a
//! verification is built from tokens already read. While no speculative row expects a draft
//! the batch steps pipelined as before.
//!
//! A `lossless` row (at a temperature) verifies by rejection sampling against its drafts
//! instead (`decode::verify_lossless`, row by row): the same output distribution, not the same
//! tokens.
//!
//! A constrained row's logits are masked at each drafted position (`Guard::draft_masks`:
//! the drafts accepted tentatively, then rolled back), and its committed tokens are told to
//! its constraint.
//!
//! Which rows may speculate here: native samplers (penalties and bias included, under a
//! constraint or not), in a batch without a sampler plugin row (its steps are serial; a
//! speculative row then decodes a token a step, the same tokens). The worker decodes a
//! speculative request with a sampler plugin alone, as before.

use super::draft::{Ask, DraftBatch};
use super::{Batch, Row, StepTokens};
use crate::engine::decode::{agreement, verify_lossless};
use crate::engine::external::pick_external;
use crate::engine::sampling::log_softmax;
use crate::engine::scheduler::{DraftRow, DraftView, Policy};
use crate::engine::speculative::{Drafts, Held, Speculation, Verify};
use crate::engine::step::Token;
use anyhow::{anyhow, Result};
use mlx::{Array, Dtype};
use std::time::Instant;

/// How a row's drafts fare, position by position: for the i-th drafted token, (verifications
/// that reached it, those that accepted it), decayed so the recent ones weigh more. Drafts
/// are not accepted independently (prompt lookup's either follow the copied text for a while
/// or miss at once), so the chance that the first i all pass is the product of each
/// position's rate given the ones before it, not one rate to the i-th power.
#[derive(Debug, Clone, Default)]
pub struct Acceptance {
    at: Vec<[f64; 2]>,
}

/// The weight of a verification relative to the one after it, in `Acceptance`.
const ACCEPTANCE_DECAY: f64 = 0.9;

/// A position's rate before any news of it, as this many verifications' worth (weight, and
/// passes for the first position: a rate of 0.6).
const PRIOR: (f64, f64) = (0.5, 0.3);

impl Acceptance {
    /// A verification of `drafted` tokens accepted the first `accepted`.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if self.at.len() < drafted {
            self.at.resize(drafted, [0.0; 2]);
        }
        // Drafts after the first miss, and past the draft, were not tried: no news of them.
        for (i, [reached, passed]) in self.at.iter_mut().enumerate().take(drafted.min(accepted + 1)) {
            *reached = *reached * ACCEPTANCE_DECAY + 1.0;
            *passed = *passed * ACCEPTANCE_DECAY + f64::from(u8::from(i < accepted));
        }
    }

    /// The chance that the first i + 1 drafts all pass, for i below `k`. A position with
    /// little news is taken to pass about as the one before it does (a copy that held so far
    /// tends to go on), the first as `PRIOR` says.
    pub fn survival(&self, k: usize) -> Vec<f64> {
        let (mut p, mut rate) = (1.0, PRIOR.1 / PRIOR.0);
        (0..k)
            .map(|i| {
                let [reached, passed] = self.at.get(i).copied().unwrap_or_default();
                rate = (passed + PRIOR.0 * rate) / (reached + PRIOR.0);
                p *= rate;
                p
            })
            .collect()
    }
}

/// A batch's speculative steps so far: how many, the draft tokens they verified (summed over
/// rows), the positions they fed (rows × positions per row) and of those the padding after rows
/// that drafted less than the longest (what a flattened layout would not feed).
#[derive(Debug, Clone, Copy, Default)]
pub struct Verified {
    pub steps: usize,
    pub drafts: usize,
    pub positions: usize,
    pub padding: usize,
}

/// A speculative row's counts, for its usage.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecCounts {
    pub drafted: usize,
    pub accepted: usize,
    /// Target forwards the row took part in (plain steps and verifications).
    pub steps: usize,
    pub verifications: usize,
}

impl<'m> Row<'m> {
    /// The row drafts and verifies its tokens with `speculation` (which has seen its prompt).
    pub fn with_speculation(mut self, speculation: Option<Speculation<'m>>) -> Row<'m> {
        self.speculation = speculation;
        self
    }

    /// Drafted, accepted, steps and verifications so far (zeros without speculation).
    pub fn spec_counts(&self) -> SpecCounts {
        self.counts
    }

    /// Whether the row verifies by rejection sampling (`Verify::Lossless` at a temperature).
    fn lossless(&self) -> bool {
        self.external.is_none()
            && self.sampler.params().temperature > 0.0
            && self.speculation.as_ref().is_some_and(|s| s.config.verify == Verify::Lossless)
    }

    /// Whether the row speculates under a constraint: the batch then steps serially (no step
    /// in flight when a step returns), so every token is looked at for a draft — a
    /// constraint's matches (JSON's keys, a list's items) are short, there at one token and
    /// gone at the next, and a pipelined batch sees each token a step late.
    pub(super) fn constrained_speculation(&self) -> bool {
        self.constraint.is_some() && self.speculation.is_some()
    }

    /// Whether the row would draft now (its back-off allows it and a draft is likely).
    fn wants_to_draft(&self) -> bool {
        self.speculation.as_ref().is_some_and(|s| s.wants_to_try())
    }

    /// A committed token, told to the row's speculation (its sequence; a plain one counts
    /// towards the end of a back-off).
    pub(super) fn committed(&mut self, id: u32, plain: bool) {
        self.counts.steps += usize::from(plain);
        if let Some(spec) = self.speculation.as_mut() {
            spec.seq.push(id);
            if plain {
                spec.adaptive.plain_token();
            }
        }
    }
}

/// How many positions a verification feeds per row, chosen each step by the batch's measured
/// cost against what the rows' drafts are expected to commit. A plain step's time is kept by
/// its rows, a verification's by the positions it feeds (rows × positions per row), apart:
/// a verification costs its drafting and, on a GPU, the pipeline it stops (it is read before
/// the next step is built), so a verification of 8 positions is not a plain step of 8 rows.
/// Each is a moving average per size, read between sizes by interpolation and past the
/// largest along the last two — not one line, because on a CPU it is not one (SmolLM2 on 2
/// cores: 2-4 positions take a matrix-vector product each, from 5 one matrix product does them
/// all). A verification's line takes the plain steps as points (a row a position) where no
/// verification of that size was timed; a size it cannot read is taken to cost what the plain
/// step does, so it gets tried once.
/// Each row's drafts are expected to commit one token plus the chance that each prefix of
/// them passes (its `Acceptance`). The rule takes the positions per row with the most tokens
/// per second, plain decoding included — so a CPU, where a step's cost grows with its
/// positions, drafts less as the batch grows, and a GPU, where it barely does, drafts as much
/// as rows accept.
#[derive(Debug, Clone, Default)]
pub struct DraftCost {
    /// Seconds per plain step by rows (a moving average, `COST_EWMA`).
    plain: std::collections::BTreeMap<usize, f64>,
    /// Seconds per verification by positions fed (likewise).
    verifying: std::collections::BTreeMap<usize, f64>,
    /// Steps the rule kept plain while rows had drafts, since the last verification.
    passed: usize,
    /// Verifications in a row taken while no plain step of as many rows as the batch's (or
    /// fewer) was timed (`knows_plain`).
    blind: usize,
    /// Plain steps still to take so that one is timed (`PROBE_AFTER`).
    probe: usize,
    /// Verify every draft whatever the cost (`HOST_DRAFT_COST=off`, for measuring; tests).
    off: bool,
}

/// The weight of a step's time in its size's moving average.
const COST_EWMA: f64 = 0.3;

/// The share of the best draft length's expected tokens per second within which the longest
/// drafts are verified instead.
const LONGEST_WITHIN: f64 = 0.85;

/// A plain step is chosen at most this many times in a row while rows have drafts; then one
/// verification of every draft is tried, so the sizes not taken keep being measured.
const EXPLORE_EVERY: usize = 32;

/// The other way round: after this many verifications in a row with no plain step of the
/// batch's size timed, the next two steps are plain (the first restarts the pipeline, the
/// second is timed). Without it a drafter whose drafts always pass but cost more than they
/// save (a draft model as slow as the target) is verified every step and never found out:
/// nothing plain is ever timed to weigh it against (bench/RESULTS.md, session 49).
const PROBE_AFTER: usize = 4;

impl DraftCost {
    /// The rule as `HOST_DRAFT_COST` sets it: measured, or `off` (every draft verified).
    pub fn from_env() -> DraftCost {
        DraftCost { off: std::env::var("HOST_DRAFT_COST").is_ok_and(|v| v == "off"), ..Default::default() }
    }

    /// Every draft verified, whatever the cost.
    pub fn off() -> DraftCost {
        DraftCost { off: true, ..Default::default() }
    }

    /// Seconds of a step by positions fed: the verifications timed, and the plain steps (a
    /// row a position) where no verification of that size was.
    fn by_positions(&self) -> std::collections::BTreeMap<usize, f64> {
        let mut secs = self.plain.clone();
        secs.extend(&self.verifying);
        secs
    }

    /// The sizes measured so far, milliseconds of a step by positions fed (`by_positions`).
    pub fn measured_ms(&self) -> std::collections::BTreeMap<usize, f64> {
        self.by_positions().into_iter().map(|(p, t)| (p, t * 1e3)).collect()
    }

    /// The plain steps measured so far: milliseconds by rows.
    pub fn plain_ms(&self) -> std::collections::BTreeMap<usize, f64> {
        self.plain.iter().map(|(&r, &t)| (r, t * 1e3)).collect()
    }

    /// A plain step of `rows` rows took `secs`.
    pub fn timed_plain(&mut self, rows: usize, secs: f64) {
        average(&mut self.plain, rows, secs);
    }

    /// A verification that fed `positions` took `secs` (drafting to commit).
    pub fn timed_verification(&mut self, positions: usize, secs: f64) {
        average(&mut self.verifying, positions, secs);
    }

    /// Seconds of a plain step of `rows` rows, read off the plain steps timed (`read`).
    pub fn plain_secs(&self, rows: usize) -> Option<f64> {
        read(&self.plain, rows)
    }

    /// Whether a plain step of `rows` rows or fewer was timed: the plain line at `rows` is
    /// then read between measured sizes or along them. Below the smallest it is flat, so a
    /// bigger batch's time would pass for this one's.
    fn knows_plain(&self, rows: usize) -> bool {
        self.plain.range(..=rows).next().is_some()
    }

    /// A verification over `rows` rows was taken: a plain step is due (`probing`) after
    /// `PROBE_AFTER` of them in a row with no plain step of that size timed.
    pub fn verified_step(&mut self, rows: usize) {
        if self.off || self.knows_plain(rows) {
            self.blind = 0;
            return;
        }
        self.blind += 1;
        if self.blind >= PROBE_AFTER {
            (self.blind, self.probe) = (0, 2);
        }
    }

    /// Whether the next step must be plain, to time one.
    pub fn probing(&self) -> bool {
        self.probe > 0
    }

    /// A plain step was taken (timed by `timed` where it was a steady one).
    pub fn plain_taken(&mut self) {
        self.probe = self.probe.saturating_sub(1);
    }

    /// Positions per row for a step over rows whose drafts are `drafts` long, each row's
    /// chances that its first 1, 2, ... drafts all pass being `survival`: 1 (plain) or more.
    /// Before a plain step of the batch's size is timed, every draft is verified.
    pub fn best(&self, drafts: &[usize], survival: &[Vec<f64>]) -> usize {
        let b = drafts.len();
        let most = drafts.iter().copied().max().unwrap_or(0);
        if most == 0 {
            return 1;
        }
        let Some(plain) = self.plain_secs(b).filter(|_| !self.off && self.knows_plain(b)) else { return most + 1 };
        // A size never measured is tried once at the plain step's cost.
        let expected = |t: usize| -> f64 {
            let per_row = |(&k, s): (&usize, &Vec<f64>)| -> f64 { 1.0 + s.iter().take(k.min(t - 1)).sum::<f64>() };
            drafts.iter().zip(survival).map(per_row).sum()
        };
        let line = self.by_positions();
        let rate = |t: usize| expected(t) / read(&line, b * t).unwrap_or(plain).max(1e-9);
        let (mut best, mut at) = (b as f64 / plain.max(1e-9), 1);
        for t in 2..=most + 1 {
            if rate(t) > best {
                (best, at) = (rate(t), t);
            }
        }
        // Between draft lengths the longest is kept unless a shorter one clearly pays more:
        // the chances of long drafts are measured least (only where they are verified), and
        // each shorter verification leaves more for later steps, each a step the pipeline
        // waits for.
        if at > 1 && rate(most + 1) >= LONGEST_WITHIN * best {
            return most + 1;
        }
        at
    }

    /// A step the rule kept plain while rows had drafts; whether the next should verify
    /// anyway (every `EXPLORE_EVERY`th), to keep measuring.
    fn passed(&mut self) {
        self.passed += 1;
    }

    fn explore(&mut self) -> bool {
        self.passed >= EXPLORE_EVERY
    }

    /// `best`, or every draft when a verification is due to keep the sizes measured.
    pub fn choose(&mut self, drafts: &[usize], survival: &[Vec<f64>]) -> usize {
        let best = self.best(drafts, survival);
        let most = drafts.iter().copied().max().unwrap_or(0);
        if best == 1 && most > 0 && self.explore() {
            self.passed = 0;
            return most + 1;
        }
        if best > 1 {
            self.passed = 0;
        }
        best
    }
}

/// `secs` into `times`' moving average at `size`.
fn average(times: &mut std::collections::BTreeMap<usize, f64>, size: usize, secs: f64) {
    let avg = times.entry(size).or_insert(secs);
    *avg += COST_EWMA * (secs - *avg);
}

/// Seconds at `size` from `times`: measured, or read between the sizes measured (past the
/// largest, along the last two; below the smallest, as the smallest); `None` when that size
/// cannot be read (nothing measured, or only one size, smaller).
fn read(times: &std::collections::BTreeMap<usize, f64>, size: usize) -> Option<f64> {
    if let Some(&t) = times.get(&size) {
        return Some(t);
    }
    let below: Vec<(usize, f64)> = times.range(..size).rev().take(2).map(|(&p, &t)| (p, t)).collect();
    let above = times.range(size..).next().map(|(&p, &t)| (p, t));
    let line = |(p0, t0): (usize, f64), (p1, t1): (usize, f64)| {
        let slope = ((t1 - t0) / (p1 as f64 - p0 as f64)).max(0.0);
        t0 + slope * (size as f64 - p0 as f64)
    };
    match (below.first(), above) {
        (Some(&lo), Some(hi)) => Some(line(lo, hi)),
        (None, Some((_, t))) => Some(t),
        (Some(&hi), None) => below.get(1).map(|&lo| line(lo, hi).max(hi.1)),
        (None, None) => None,
    }
}

impl<'m> Batch<'m> {
    /// Whether the next step should verify drafts: a row expects one, no row makes the batch
    /// serial (a sampler plugin), and by the rows' usual draft lengths (`AdaptiveK`) the cost rule
    /// would verify (or a verification is due to keep it measured).
    pub(super) fn wants_speculation(&mut self, policy_chooses: bool) -> bool {
        // Asked every step: a batch without a speculative row allocates nothing here.
        if self.rows.iter().all(|r| r.speculation.is_none()) {
            return false;
        }
        if policy_chooses {
            return self.rows.iter().any(Row::wants_to_draft);
        }
        if self.draft_cost.probing() {
            return false;
        }
        // A row whose drafts were never verified is verified once, whatever the cost: the
        // rule then weighs that row's own acceptance, not only the prior (and a short request
        // is not kept plain throughout by what earlier requests' steps cost).
        if self.rows.iter().any(|r| r.wants_to_draft() && r.counts.verifications == 0) {
            return true;
        }
        let lens: Vec<usize> = (self.rows.iter())
            .map(|r| r.speculation.as_ref().filter(|_| r.wants_to_draft()).map_or(0, |s| s.adaptive.k))
            .collect();
        if lens.iter().all(|&k| k == 0) {
            return false;
        }
        let survival: Vec<Vec<f64>> = self.rows.iter().zip(&lens).map(|(r, &k)| r.acceptance.survival(k)).collect();
        if self.draft_cost.best(&lens, &survival) > 1 || self.draft_cost.explore() {
            return true;
        }
        self.draft_cost.passed();
        false
    }

    /// One verification over every row, or `None` when no row drafted anything (the caller
    /// then steps plainly). Returns each row's committed tokens in order (several for a row
    /// whose drafts were accepted; none after one that finishes it).
    pub(super) fn speculate(&mut self, policy: Option<&mut (dyn Policy + '_)>) -> Result<Option<StepTokens>> {
        let started = Instant::now();
        let mut drafts: Vec<Vec<u32>> = Vec::with_capacity(self.rows.len());
        // A lossless row's draft distributions (`None`: chosen deterministically).
        let mut dists: Vec<Option<Array>> = Vec::with_capacity(self.rows.len());
        // The rows a draft model drafts for together (`DraftBatch`): (row, draft length,
        // lossless, its drafter's cache when it takes its seat).
        let mut together: Vec<(usize, usize, bool, Option<Held>)> = Vec::new();
        for (i, row) in self.rows.iter_mut().enumerate() {
            let remaining = row.options.max_tokens.saturating_sub(row.generated);
            let wants = row.wants_to_draft();
            let lossless = row.lossless();
            let (tokens, dist) = match row.speculation.as_mut().filter(|_| wants) {
                Some(spec) => {
                    let k = spec.adaptive.k.min(remaining.saturating_sub(1));
                    let batch = spec.draft_model.filter(|_| k > 0).and_then(|m| {
                        let d = self.drafts.get_or_insert_with(|| DraftBatch::new(m, row.options.prefill_step_size));
                        d.serves(m).then_some(&*d)
                    });
                    if let Some(batch) = batch {
                        let own = if batch.seated(row.key) { None } else { spec.drafter.take_cache() };
                        together.push((i, k, lossless, own));
                        (Vec::new(), None)
                    } else {
                        match (k > 0).then(|| spec.drafter.draft(&spec.seq, k, &row.sampler, lossless)).transpose() {
                            Ok(Some(d)) => (d.tokens, d.distributions),
                            Ok(None) => Default::default(),
                            Err(e) => {
                                row.failed.get_or_insert(e.context("drafting"));
                                Default::default()
                            }
                        }
                    }
                }
                None => Default::default(),
            };
            drafts.push(tokens);
            dists.push(dist);
        }
        let batched: Vec<bool> = (0..self.rows.len()).map(|i| together.iter().any(|t| t.0 == i)).collect();
        if let (Some(batch), false) = (self.drafts.as_mut(), together.is_empty()) {
            let asks: Vec<Ask> = (together.into_iter())
                .map(|(i, k, lossless, own)| {
                    let row = &self.rows[i];
                    let seq = &row.speculation.as_ref().expect("a drafting row").seq;
                    Ask { key: row.key, seq, k, sampler: &row.sampler, lossless, own }
                })
                .collect();
            let proposals = batch.draft(asks);
            match proposals {
                Ok(proposals) => {
                    let rows = batched.iter().enumerate().filter(|(_, &b)| b).map(|(i, _)| i);
                    for (i, d) in rows.zip(proposals) {
                        (drafts[i], dists[i]) = (d.tokens, d.distributions);
                    }
                }
                Err(e) => {
                    for (row, _) in self.rows.iter_mut().zip(&batched).filter(|(_, &b)| b) {
                        row.failed.get_or_insert(anyhow!("drafting with the draft model's batch: {e:#}"));
                    }
                    // Its caches may be part-way through the draft: its rows start afresh.
                    self.drafts = None;
                }
            }
        }
        // The step is timed from here: what a drafter costs is its own, not the forward's size.
        let drafted_at = Instant::now();
        let lens: Vec<usize> = drafts.iter().map(Vec::len).collect();
        let survival: Vec<Vec<f64>> = self.rows.iter().zip(&lens).map(|(r, &k)| r.acceptance.survival(k)).collect();
        let mut t = self.draft_cost.choose(&lens, &survival);
        if t == 1 && self.rows.iter().zip(&lens).any(|(r, &k)| k > 0 && r.counts.verifications == 0) {
            t = 1 + lens.iter().copied().max().unwrap_or(0);
        }
        if let Some(policy) = policy {
            let budgets = self.policy_budgets(policy, &lens, survival, t);
            for (d, &n) in drafts.iter_mut().zip(&budgets) {
                d.truncate(n);
            }
            t = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        }
        if t == 1 {
            // Plain is quicker for what these drafts promise: none is verified, and each row
            // that drafted backs off as from a miss (a draft model's drafting is not free).
            for ((row, &k), &b) in self.rows.iter_mut().zip(&lens).zip(&batched) {
                if let Some(spec) = row.speculation.as_mut() {
                    if !b {
                        spec.drafter.commit(0)?;
                    }
                    if k > 0 {
                        spec.adaptive.update(k, 0);
                    }
                }
            }
            if let Some(batch) = self.drafts.as_mut() {
                batch.commit(&[])?;
            }
            return Ok(None);
        }
        for (d, q) in drafts.iter_mut().zip(&mut dists) {
            d.truncate(t - 1);
            if let Some(dist) = q.as_mut().filter(|dist| dist.dim(0) > d.len()) {
                *dist = dist.slice_axis(0, 0, d.len() as i32)?;
            }
        }
        let b = self.rows.len();
        let mut ids = Vec::with_capacity(b * t);
        for (row, d) in self.rows.iter().zip(&drafts) {
            ids.push(row.last as i32);
            ids.extend(d.iter().map(|&x| x as i32));
            ids.extend(std::iter::repeat_n(row.last as i32, t - 1 - d.len()));
        }
        let input = Array::from_i32(&ids, &[b, t])?;
        // A recurrent layer keeps its states before each position, for the rows' rollbacks.
        self.cache.iter_mut().for_each(|c| c.keep_snapshots(t));
        let logits = self.model.forward_batch(&input, &mut self.cache)?;
        let vocab = logits.dim(2) as i32;
        let logits = logits.reshape(&[(b * t) as i32, vocab])?;
        // Logit bias acts on every position alike; history penalties position by position,
        // each over the row's sequence with the drafts before it (as decoding them one by one
        // would see it). The padding's positions are left as they are (never read).
        let processed = self.rows.iter().any(|r| r.history.is_some() || !r.sampler.params().logit_bias.is_empty());
        let logits = if processed {
            let mut parts = Vec::with_capacity(b);
            for (i, row) in self.rows.iter_mut().enumerate() {
                let mine = logits.slice_axis(0, (i * t) as i32, ((i + 1) * t) as i32)?;
                parts.push(match &row.history {
                    Some(h) => {
                        let real = drafts[i].len() + 1;
                        let fed = input.slice_axis(0, i as i32, i as i32 + 1)?.reshape(&[t as i32])?;
                        let mut rows = Vec::with_capacity(t);
                        for j in 0..real as i32 {
                            let seen = mlx::ops::concatenate(&[h, &fed.slice_axis(0, 0, j + 1)?], 0)?;
                            rows.push(row.sampler.process(&mine.slice_axis(0, j, j + 1)?, Some(&seen))?);
                        }
                        if real < t {
                            rows.push(mine.slice_axis(0, real as i32, t as i32)?);
                        }
                        mlx::ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?
                    }
                    None => row.sampler.process(&mine, None)?,
                });
            }
            mlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?
        } else {
            logits
        };
        // A constrained row's mask at each drafted position (drafts accepted tentatively,
        // rolled back), worked out while the forward runs; a draft the constraint refuses
        // ends the masks there (nothing after it can be accepted).
        let logits = if self.rows.iter().any(|r| r.constraint.is_some()) {
            mlx::async_eval(&[&logits])?;
            let mut masks = vec![None; b * t];
            for (i, row) in self.rows.iter_mut().enumerate() {
                let Some(guard) = row.constraint.as_mut() else { continue };
                match guard.draft_masks(&drafts[i]) {
                    Ok(mine) => {
                        for (j, m) in mine.into_iter().enumerate() {
                            masks[i * t + j] = m;
                        }
                    }
                    Err(e) => {
                        row.failed.get_or_insert(e.context("the output constraint"));
                    }
                }
            }
            self.masking.apply(&logits, &masks)?
        } else {
            logits
        };
        let logprobs = log_softmax(&logits)?;
        let processed = logits;
        let picks = if self.rows.iter().all(|r| r.sampler.params().temperature == 0.0) {
            logprobs.argmax(-1, false)?.astype(Dtype::Int32)?
        } else {
            let mut picks = Vec::with_capacity(b * t);
            for (i, row) in self.rows.iter().enumerate() {
                let mine = logprobs.slice_axis(0, (i * t) as i32, ((i + 1) * t) as i32)?;
                if row.sampler.params().temperature == 0.0 {
                    picks.push(mine.argmax(-1, false)?.astype(Dtype::Int32)?);
                    continue;
                }
                // The sampler's draw at each real position (keyed by it); the padding's
                // picks are never read.
                for j in 0..t {
                    let at = mine.slice_axis(0, j as i32, j as i32 + 1)?;
                    picks.push(row.sampler.sample(&at, row.position + j)?.astype(Dtype::Int32)?);
                }
            }
            mlx::ops::concatenate(&picks.iter().collect::<Vec<_>>(), 0)?
        };
        mlx::async_eval(&[&picks, &logprobs])?;
        let picks = picks.to_vec_i32()?;
        let secs = started.elapsed().as_secs_f64();
        let mut out = Vec::new();
        let mut kept = Vec::with_capacity(b);
        // What each row drafting with the draft model's batch accepted.
        let mut accepted_together = Vec::new();
        for (i, (row, drafted)) in self.rows.iter_mut().zip(&drafts).enumerate() {
            let mut mine = picks[i * t..(i + 1) * t].to_vec();
            let accepted = if row.external.is_some() {
                // The plugin picks position by position, told each pick before the next (as
                // decoding them one by one would); its picks past the first miss are not asked.
                let mut emitted = Vec::with_capacity(drafted.len() + 1);
                for j in 0..=drafted.len() {
                    let at = (i * t + j) as i32;
                    let id = match row.external.as_deref_mut() {
                        Some(x) => match pick_external(
                            x,
                            &row.sampler,
                            &processed.slice_axis(0, at, at + 1)?,
                            row.position + j,
                        ) {
                            Ok(token) => Some(token.item_i32()?),
                            Err(e) => {
                                row.external_failed(e);
                                None
                            }
                        },
                        None => None,
                    };
                    if row.failed.is_some() {
                        break;
                    }
                    // After a fallback the row samples natively from here on.
                    let id = id.unwrap_or(mine[j]);
                    if let Some(Err(e)) = row.external.as_deref_mut().map(|x| x.accept(&[id as u32])) {
                        row.external_failed(e);
                        if row.failed.is_some() {
                            break;
                        }
                    }
                    emitted.push(id);
                    if j == drafted.len() || drafted[j] as i32 != id {
                        break;
                    }
                }
                mine = emitted;
                mine.len().saturating_sub(1)
            } else if row.lossless() && !drafted.is_empty() {
                // Rejection sampling against the draft (`decode::verify_lossless`).
                let at = |j: usize| logprobs.slice_axis(0, (i * t + j) as i32, (i * t + j + 1) as i32);
                let rows: Vec<Array> = (0..=drafted.len()).map(at).collect::<mlx::Result<_>>()?;
                let proposal = Drafts { tokens: drafted.clone(), distributions: dists[i].clone() };
                let emitted = verify_lossless(&row.sampler, &proposal, &rows, row.position)?;
                mine = emitted.iter().map(|&id| id as i32).collect();
                emitted.len() - 1
            } else {
                agreement(drafted, &mine)
            };
            let mut told = 0;
            row.counts.steps += 1;
            if let Some(e) = row.failed.take() {
                out.push((row.key, Err(e)));
                kept.push(1);
                continue;
            }
            for (j, &id) in mine[..=accepted].iter().enumerate() {
                let id = id as u32;
                row.last = id;
                row.generated += 1;
                row.position += 1;
                told += 1;
                row.committed(id, false);
                if let Some(Err(e)) = row.constraint.as_mut().map(|g| g.accept(id)) {
                    out.push((row.key, Err(e.context("the output constraint"))));
                    break;
                }
                let finish = row.options.finish(id, row.generated);
                let at = (i * t + j) as i32;
                let logprobs = logprobs.slice_axis(0, at, at + 1)?.squeeze(&[0])?;
                out.push((row.key, Ok(Token { id, logprobs, finish })));
                if finish.is_some() {
                    break;
                }
            }
            if let Some(spec) = row.speculation.as_mut().filter(|_| !drafted.is_empty()) {
                let accepted = accepted.min(told - 1);
                row.acceptance.verified(drafted.len(), accepted);
                if batched[i] {
                    accepted_together.push((row.key, accepted));
                } else {
                    spec.drafter.commit(accepted)?;
                }
                spec.adaptive.verify_step(secs, told);
                spec.adaptive.update(drafted.len(), accepted);
                row.counts.drafted += drafted.len();
                row.counts.accepted += accepted;
                row.counts.verifications += 1;
            } else if let Some(spec) = row.speculation.as_mut() {
                spec.adaptive.plain_token();
            }
            if let Some(h) = &row.history {
                // The fed positions it keeps: its last token and the drafts it committed.
                let fed = input.slice_axis(0, i as i32, i as i32 + 1)?.reshape(&[t as i32])?;
                row.history = Some(mlx::ops::concatenate(&[h, &fed.slice_axis(0, 0, told as i32)?], 0)?);
            }
            kept.push(told);
        }
        for c in &mut self.cache {
            c.trim_rows(t, &kept)?;
            c.keep_snapshots(1);
        }
        if let Some(batch) = self.drafts.as_mut() {
            batch.commit(&accepted_together)?;
        }
        self.draft_cost.timed_verification(b * t, drafted_at.elapsed().as_secs_f64());
        self.draft_cost.verified_step(b);
        let drafted = drafts.iter().map(Vec::len).sum::<usize>();
        let v = &mut self.verified;
        (v.steps, v.drafts, v.positions) = (v.steps + 1, v.drafts + drafted, v.positions + b * t);
        v.padding += b * t - b - drafted;
        self.steps += 1;
        Ok(Some(out))
    }

    /// Each row's draft budget as `policy` chooses it (`Policy::drafts`), the built-in rule's
    /// (`t - 1`) where it says nothing or fails (logged).
    fn policy_budgets(
        &self,
        policy: &mut (dyn Policy + '_),
        lens: &[usize],
        survival: Vec<Vec<f64>>,
        t: usize,
    ) -> Vec<usize> {
        let rule: Vec<usize> = lens.iter().map(|&k| k.min(t - 1)).collect();
        let view = DraftView {
            rows: (self.rows.iter().zip(lens).zip(survival).zip(&rule))
                .filter(|(((_, &k), _), _)| k > 0)
                .map(|(((r, &drafted), survival), &rule)| DraftRow {
                    id: format!("r{}", r.key),
                    drafted,
                    survival,
                    rule,
                })
                .collect(),
            batch_rows: self.rows.len(),
            step_ms: self.draft_cost.measured_ms(),
            plain_step_ms: self.draft_cost.plain_ms(),
        };
        match policy.drafts(&view) {
            Ok(Some(decision)) => (self.rows.iter().zip(lens).zip(&rule))
                .map(|((r, &k), &rule)| {
                    let named = decision.drafts.get(&format!("r{}", r.key)).copied();
                    named.or(decision.default).unwrap_or(rule).min(k)
                })
                .collect(),
            Ok(None) => rule,
            Err(e) => {
                tracing::warn!("the scheduling policy's draft budgets failed; the built-in rule's this step: {e:#}");
                rule
            }
        }
    }

    /// What the speculative steps so far verified.
    pub fn verified(&self) -> Verified {
        self.verified
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule verifies where the measured cost pays: on a line where every position costs
    /// (a CPU), a lone row with good drafts verifies most of them, eight rows with middling
    /// ones decode plainly and fewer drafts are taken where they clearly pay more; on a nearly flat line
    /// (a GPU) eight rows with good drafts verify all of them; with nothing timed, or the rule
    /// off, every draft is verified; kept plain, it still verifies now and then.
    /// `rows` rows each passing every draft with chance `a` independently.
    fn geometric(rows: usize, a: f64) -> Vec<Vec<f64>> {
        vec![(1..=8).map(|i| a.powi(i)).collect(); rows]
    }

    #[test]
    fn the_draft_length_follows_the_measured_cost_and_the_acceptance() {
        let mut cpu = DraftCost::default();
        // SmolLM2-135M in float32 on this 2-core CPU: a plain step of 1 row 44 ms, of 8 rows
        // 133; verifications of 4, 16 and 40 positions.
        for (rows, secs) in [(1, 0.044), (8, 0.133)] {
            cpu.timed_plain(rows, secs);
        }
        for (p, secs) in [(16, 0.235), (40, 0.54), (4, 0.085)] {
            cpu.timed_verification(p, secs);
        }
        assert!(cpu.best(&[6], &geometric(1, 0.9)) >= 5, "one row, good drafts: most of them");
        assert_eq!(cpu.best(&[6; 8], &geometric(8, 0.3)), 1, "eight rows, poor drafts: plain");
        assert_eq!(cpu.best(&[6; 8], &geometric(8, 0.7)), 1, "eight rows, middling drafts: plain");
        assert_eq!(cpu.best(&[6], &geometric(1, 0.5)), 2, "one row, middling drafts: fewer");
        // Where a shorter length is only a little better, the longest is kept.
        assert_eq!(cpu.best(&[6; 8], &geometric(8, 0.9)), 7);
        assert_eq!(DraftCost { off: true, ..cpu.clone() }.best(&[6; 8], &geometric(8, 0.3)), 7);
        let mut gpu = DraftCost::default();
        for (rows, secs) in [(1, 0.010), (8, 0.0102)] {
            gpu.timed_plain(rows, secs);
        }
        for (p, secs) in [(32, 0.0108), (64, 0.0115)] {
            gpu.timed_verification(p, secs);
        }
        assert_eq!(gpu.best(&[6; 8], &geometric(8, 0.8)), 7);
        assert_eq!(DraftCost::default().best(&[3, 0, 5], &geometric(3, 0.1)), 6);
        assert_eq!(cpu.best(&[0; 4], &geometric(4, 0.9)), 1, "nothing drafted");
        let picks: Vec<usize> = (0..EXPLORE_EVERY + 1)
            .map(|_| {
                cpu.passed();
                cpu.choose(&[6; 8], &geometric(8, 0.3))
            })
            .collect();
        assert_eq!(picks.iter().filter(|&&t| t > 1).count(), 1, "{picks:?}");
    }

    /// Verifications timed and no plain step: the rule verifies every draft (it has nothing
    /// to weigh them against) until `PROBE_AFTER` of them, then asks for two plain steps; a
    /// timed plain step of as many rows or fewer ends the probing, and with the rule off
    /// nothing is probed.
    #[test]
    fn a_batch_that_only_verifies_is_made_to_time_a_plain_step() {
        let mut rule = DraftCost::default();
        for _ in 0..PROBE_AFTER - 1 {
            rule.timed_verification(40, 0.2);
            rule.verified_step(8);
            assert!(!rule.probing());
        }
        assert_eq!(rule.best(&[4; 8], &geometric(8, 0.99)), 5, "nothing plain timed: every draft");
        rule.verified_step(8);
        assert!(rule.probing());
        rule.plain_taken();
        assert!(rule.probing(), "the first plain step restarts the pipeline: a second is due");
        rule.plain_taken();
        rule.timed_plain(8, 0.05);
        assert!(!rule.probing());
        for _ in 0..2 * PROBE_AFTER {
            rule.verified_step(8);
            assert!(!rule.probing());
        }
        assert_eq!(rule.best(&[4; 8], &geometric(8, 0.3)), 1, "now weighed: plain");
        let mut off = DraftCost::off();
        (0..2 * PROBE_AFTER).for_each(|_| off.verified_step(8));
        assert!(!off.probing());
    }

    /// A verification's time is kept apart from a plain step's of as many rows as it fed
    /// positions: on a GPU it includes the drafting and the pipeline it stops. Timed only
    /// verifications (of 8 and 16 positions), a batch of 8 rows knows no plain step (it verifies every
    /// draft and is made to time one); both timed, the plain step's cost is its own, and the
    /// policy's view shows each (a verification's where both were timed at one size).
    #[test]
    fn a_verifications_time_is_not_read_as_a_plain_steps() {
        let mut rule = DraftCost::default();
        rule.timed_verification(8, 0.5);
        rule.timed_verification(16, 0.5);
        assert!(!rule.knows_plain(8) && rule.plain_secs(8).is_none());
        assert_eq!(rule.best(&[1; 8], &geometric(8, 0.01)), 2, "no plain step timed: every draft");
        (0..PROBE_AFTER).for_each(|_| rule.verified_step(8));
        assert!(rule.probing());
        rule.timed_plain(8, 0.05);
        assert_eq!(rule.plain_secs(8), Some(0.05));
        assert_eq!(rule.best(&[1; 8], &geometric(8, 0.01)), 1, "drafts that never pass: plain");
        assert_eq!(rule.measured_ms()[&8], 500.0);
        assert_eq!(rule.plain_ms()[&8], 50.0);
    }

    /// Drafts that either all pass or miss at once (a copy followed or not): the chance of
    /// passing six is about that of passing one, where one rate to the sixth power would
    /// call six drafts hopeless; a row that misses at once lately gets low chances.
    #[test]
    fn acceptance_is_measured_position_by_position() {
        let mut copying = Acceptance::default();
        for i in 0..20 {
            copying.verified(6, if i % 2 == 0 { 6 } else { 0 });
        }
        let s = copying.survival(6);
        assert!((s[0] - 0.5).abs() < 0.1 && s[5] > 0.3, "{s:?}");
        let mut missing = Acceptance::default();
        for _ in 0..10 {
            missing.verified(4, 0);
        }
        assert!(missing.survival(4)[0] < 0.15, "{:?}", missing.survival(4));
        let fresh = Acceptance::default().survival(2);
        assert!((fresh[0] - 0.6).abs() < 1e-9 && (fresh[1] - 0.36).abs() < 1e-9, "{fresh:?}");
        // Copies that always held for the two drafts tried: the third is hoped to hold too.
        let mut short = Acceptance::default();
        for _ in 0..10 {
            short.verified(2, 2);
        }
        let s = short.survival(4);
        assert!(s[1] > 0.8 && s[3] > 0.75 * s[1], "{s:?}");
    }
}
