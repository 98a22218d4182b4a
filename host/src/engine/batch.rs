//! The batch step: every row of the batch advances one token per forward, in mlx-lm's
//! pipelined shape (step n+1's graph is built from step n's lazy tokens and handed to MLX
//! before step n's tokens are read). Rows join between steps with their prompt already in a
//! cache of their own (`engine/worker.rs` prefills it in chunks) and leave between steps with
//! their cache handed back, holding exactly the tokens they committed but the last.
//!
//! Each row keeps what its request has alone: its sampler (logit bias, penalties over its own
//! history, temperature, top-k/p, min-p, its seed keyed by position), its limits and stop
//! tokens. The batch knows nothing about text, plugins or requests; rows are named by a key.

use super::decode::{DecodeOptions, FinishReason, Token};
use super::sampling::{log_softmax, Sampler};
use anyhow::{bail, Context, Result};
use mlx::{memory, Array, Dtype};
use models::{BatchKvCache, CausalLm, KvCache};

/// One sequence of the batch.
pub struct Row {
    key: u64,
    sampler: Sampler,
    options: DecodeOptions,
    /// The sequence so far (prompt and committed tokens) when the sampler's penalties need it.
    history: Option<Array>,
    /// The position the next built step samples at.
    position: usize,
    /// The token fed to the most recent step built with this row; before any, the one to feed.
    last: u32,
    generated: usize,
}

impl Row {
    /// A row whose cache holds `prompt` but its last token, which the first step feeds.
    pub fn new(key: u64, prompt: &[u32], sampler: Sampler, options: DecodeOptions) -> Result<Row> {
        let Some((&last, head)) = prompt.split_last() else { bail!("the prompt is empty; give at least one token") };
        let history = if sampler.params().needs_history() { Some(tokens(head)?) } else { None };
        Ok(Row { key, sampler, options, history, position: prompt.len(), last, generated: 0 })
    }

    pub fn key(&self) -> u64 {
        self.key
    }

    /// Tokens committed so far.
    pub fn generated(&self) -> usize {
        self.generated
    }
}

/// A row that left the batch: its state and a cache holding the tokens it committed but the
/// last (`row`'s next step feeds that one), ready to rejoin or to go to the prompt cache.
pub struct Left {
    pub row: Row,
    pub cache: Vec<KvCache>,
}

/// A built step, in flight: its rows' keys in row order, their tokens and log-probabilities.
struct Step {
    keys: Vec<u64>,
    tokens: Array,
    logprobs: Array,
}

pub struct Batch<'m> {
    model: &'m dyn CausalLm,
    cache: Vec<BatchKvCache>,
    /// In the cache's row order.
    rows: Vec<Row>,
    pending: Option<Step>,
    steps: usize,
}

fn tokens(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_i32(&ids, &[ids.len()])?)
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
        Batch { model, cache: (0..layers).map(|_| BatchKvCache::default()).collect(), rows: Vec::new(), pending: None, steps: 0 }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Bytes of KV the batch holds (padding included).
    pub fn kv_bytes(&self) -> usize {
        self.cache.iter().map(BatchKvCache::nbytes).sum()
    }

    /// Adds `row` with `cache` (one entry per layer, holding its sequence but the last token);
    /// it takes part from the next step built.
    pub fn join(&mut self, row: Row, cache: &[KvCache]) -> Result<()> {
        if cache.len() != self.cache.len() {
            bail!("a row's cache has {} layers, the batch's {}", cache.len(), self.cache.len());
        }
        if self.rows.iter().any(|r| r.key == row.key) {
            bail!("row {} is already in the batch", row.key);
        }
        for (b, c) in self.cache.iter_mut().zip(cache) {
            b.push(c)?;
        }
        self.rows.push(row);
        Ok(())
    }

    /// Takes row `key` out of the batch (`None` if it is not in it).
    pub fn leave(&mut self, key: u64) -> Result<Option<Left>> {
        let Some(index) = self.rows.iter().position(|r| r.key == key) else { return Ok(None) };
        let mut cache: Vec<KvCache> = self.cache.iter().map(|b| b.extract(index)).collect::<models::Result<_>>()?;
        for b in &mut self.cache {
            b.remove(index)?;
        }
        let mut row = self.rows.remove(index);
        // A step in flight has fed the row's last token and sampled past it: its position and
        // that token's KV are given back, so the row's next step feeds `last` again.
        if self.pending.as_ref().is_some_and(|p| p.keys.contains(&key)) {
            for c in &mut cache {
                c.trim(1);
            }
            row.position -= 1;
            if let Some(h) = &row.history {
                let n = h.dim(0) as i32;
                row.history = Some(h.slice_axis(0, 0, n - 1)?);
            }
        }
        Ok(Some(Left { row, cache }))
    }

    /// Advances every row by one token: returns each row's token of the step read now, in row
    /// order (a row that joined since the last call gets its first). Rows that leave before
    /// the next call are simply not fed again.
    pub fn step(&mut self) -> Result<Vec<(u64, Token)>> {
        let current = match self.pending.take() {
            Some(step) => step,
            None if self.rows.is_empty() => return Ok(Vec::new()),
            None => self.build(None)?,
        };
        if !self.rows.is_empty() {
            self.pending = Some(self.build(Some(&current))?);
        }
        let ids = current.tokens.to_vec_i32().context("reading the batch's tokens")?;
        let mut out = Vec::with_capacity(ids.len());
        for (i, (&key, &id)) in current.keys.iter().zip(&ids).enumerate() {
            let Some(row) = self.rows.iter_mut().find(|r| r.key == key) else { continue };
            let id = id as u32;
            row.last = id;
            row.generated += 1;
            let finish = if row.options.eos_token_ids.contains(&id) {
                Some(FinishReason::Stop)
            } else if row.generated >= row.options.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            let logprobs = current.logprobs.slice_axis(0, i as i32, i as i32 + 1)?.squeeze(&[0])?;
            out.push((key, Token { id, logprobs, finish }));
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
        let logprobs = log_softmax(&logits)?;
        let tokens = if self.rows.iter().all(|r| r.sampler.params().temperature == 0.0) {
            logprobs.argmax(-1, false)?.astype(Dtype::Int32)?
        } else {
            let mut picks = Vec::with_capacity(self.rows.len());
            for (i, row) in self.rows.iter().enumerate() {
                let mine = logprobs.slice_axis(0, i as i32, i as i32 + 1)?;
                picks.push(row.sampler.sample(&mine, row.position)?.astype(Dtype::Int32)?);
            }
            mlx::ops::concatenate(&picks.iter().collect::<Vec<_>>(), 0)?
        };
        for row in &mut self.rows {
            row.position += 1;
        }
        mlx::async_eval(&[&tokens, &logprobs])?;
        Ok(Step { keys, tokens, logprobs })
    }
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

    fn prefilled(model: &dyn CausalLm, prompt: &[u32]) -> Vec<KvCache> {
        let mut cache = model.make_cache();
        crate::engine::decode::prefill(model, &mut cache, &prompt[..prompt.len() - 1], 8).unwrap();
        cache
    }

    /// Rows with their own sampling settings (greedy, seeded with top-p, penalties with a
    /// bias), joining at different steps and one leaving and rejoining mid-way, each get the
    /// tokens they get alone.
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
            let join = |batch: &mut Batch, i: usize| {
                let sampler = Sampler::new(params[i].clone(), model.vocab_size()).unwrap();
                let row = Row::new(i as u64, &prompts[i], sampler, options(n)).unwrap();
                batch.join(row, &prefilled(model, &prompts[i])).unwrap();
            };
            join(&mut batch, 0);
            join(&mut batch, 1);
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
}
