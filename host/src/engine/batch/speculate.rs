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
//! Which rows may speculate here: native samplers without history penalties, verified
//! exactly (`Verify::Exact`, or greedy), in a batch without a sampler plugin or a constraint
//! row (those steps are serial or masked; a speculative row then decodes a token a step, the
//! same tokens). `Batch::takes_speculation` says whether a request's row qualifies; the
//! worker decodes the others alone as before.

use super::{Batch, Row, StepTokens};
use crate::engine::decode::agreement;
use crate::engine::sampling::log_softmax;
use crate::engine::speculative::{Speculation, Verify};
use crate::engine::step::Token;
use anyhow::Result;
use mlx::{Array, Dtype};
use models::CausalLm;
use std::time::Instant;

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

/// Whether a row with these settings may speculate inside a batch (see the module's doc).
pub fn takes_speculation(speculation: &Speculation<'_>, params: &crate::engine::SamplingParams) -> bool {
    let exact = speculation.config.verify == Verify::Exact || params.temperature == 0.0;
    exact && !params.needs_history()
}

/// Whether `model`'s batch rows can roll back by their own amounts (it batches, and every
/// layer attends over all its keys: no sliding window, no recurrent state), so speculative
/// rows can join its batch.
pub fn speculates_in_batch(model: &dyn CausalLm) -> bool {
    model.batches() && model.make_cache().iter().all(|c| !c.is_windowed() && !c.is_recurrent())
}

impl<'m> Batch<'m> {
    /// Whether speculative rows can join this batch (`speculates_in_batch`).
    pub fn speculates(&self) -> bool {
        self.speculates
    }

    /// Whether the next step should verify drafts: a row expects one, and no row makes the
    /// batch serial or masked.
    pub(super) fn wants_speculation(&self) -> bool {
        self.speculates()
            && self.rows.iter().all(|r| r.external.is_none() && r.constraint.is_none())
            && self.rows.iter().any(Row::wants_to_draft)
    }

    /// One verification over every row, or `None` when no row drafted anything (the caller
    /// then steps plainly). Returns each row's committed tokens in order (several for a row
    /// whose drafts were accepted; none after one that finishes it).
    pub(super) fn speculate(&mut self) -> Result<Option<StepTokens>> {
        let started = Instant::now();
        let mut drafts: Vec<Vec<u32>> = Vec::with_capacity(self.rows.len());
        for row in &mut self.rows {
            let remaining = row.options.max_tokens.saturating_sub(row.generated);
            let wants = row.wants_to_draft();
            let tokens = match row.speculation.as_mut().filter(|_| wants) {
                Some(spec) => {
                    let k = spec.adaptive.k.min(remaining.saturating_sub(1));
                    match (k > 0).then(|| spec.drafter.draft(&spec.seq, k, &row.sampler, false)).transpose() {
                        Ok(d) => d.map(|d| d.tokens).unwrap_or_default(),
                        Err(e) => {
                            row.failed.get_or_insert(e.context("drafting"));
                            Vec::new()
                        }
                    }
                }
                None => Vec::new(),
            };
            drafts.push(tokens);
        }
        let t = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        if t == 1 {
            return Ok(None);
        }
        let b = self.rows.len();
        let mut ids = Vec::with_capacity(b * t);
        for (row, d) in self.rows.iter().zip(&drafts) {
            ids.push(row.last as i32);
            ids.extend(d.iter().map(|&x| x as i32));
            ids.extend(std::iter::repeat_n(row.last as i32, t - 1 - d.len()));
        }
        let input = Array::from_i32(&ids, &[b, t])?;
        let logits = self.model.forward_batch(&input, &mut self.cache)?;
        let vocab = logits.dim(2) as i32;
        let logits = logits.reshape(&[(b * t) as i32, vocab])?;
        // Logit bias acts on every position alike; history penalties are a plain row's (no
        // row with them drafts), applied at its one real position.
        let processed = self.rows.iter().any(|r| r.history.is_some() || !r.sampler.params().logit_bias.is_empty());
        let logits = if processed {
            let mut parts = Vec::with_capacity(b);
            for (i, row) in self.rows.iter_mut().enumerate() {
                let mine = logits.slice_axis(0, (i * t) as i32, ((i + 1) * t) as i32)?;
                parts.push(match &row.history {
                    Some(h) => {
                        let h = mlx::ops::concatenate(&[h, &Array::from_i32(&[row.last as i32], &[1])?], 0)?;
                        let first = row.sampler.process(&mine.slice_axis(0, 0, 1)?, Some(&h))?;
                        row.history = Some(h);
                        mlx::ops::concatenate(&[&first, &mine.slice_axis(0, 1, t as i32)?], 0)?
                    }
                    None => row.sampler.process(&mine, None)?,
                });
            }
            mlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?
        } else {
            logits
        };
        let logprobs = log_softmax(&logits)?;
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
        for (i, (row, drafted)) in self.rows.iter_mut().zip(&drafts).enumerate() {
            let mine = &picks[i * t..(i + 1) * t];
            let accepted = agreement(drafted, mine);
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
                spec.drafter.commit(accepted)?;
                spec.adaptive.verify_step(secs, told);
                spec.adaptive.update(drafted.len(), accepted);
                row.counts.drafted += drafted.len();
                row.counts.accepted += accepted;
                row.counts.verifications += 1;
            } else if let Some(spec) = row.speculation.as_mut() {
                spec.adaptive.plain_token();
            }
            kept.push(told);
        }
        for c in &mut self.cache {
            c.trim_rows(t, &kept)?;
        }
        self.verifications += 1;
        self.steps += 1;
        Ok(Some(out))
    }

    /// Verifications (speculative steps) so far.
    pub fn verifications(&self) -> usize {
        self.verifications
    }
}
