//! Native on-device sampling: logits processors (logit bias, repetition, presence and
//! frequency penalties over a context window) and samplers (greedy, temperature with
//! top-p, min-p, top-k). The math follows mlx-lm's `sample_utils.py` op for op.
//!
//! Randomness comes from explicit keys derived from (seed, sequence position), never from a
//! global state: the same seed gives the same output, and a token can be re-drawn at a
//! given position (what speculative decoding needs to verify drafts).

use anyhow::{bail, Result};
use mlx::{ops, random, Array, Dtype};
use std::collections::BTreeMap;

/// Sampling settings of one request. `Default` is greedy with no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1); 0 or 1 disables.
    pub top_p: f32,
    /// Drop tokens below `min_p` times the top token's probability; 0 disables.
    pub min_p: f32,
    /// Multiplicative penalty (sign-aware) on recent tokens; `None` or 1 disables.
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: usize,
    /// Subtracted once from the logit of each token present in the recent window.
    pub presence_penalty: Option<f32>,
    pub presence_context_size: usize,
    /// Subtracted from a token's logit for every occurrence in the recent window.
    pub frequency_penalty: Option<f32>,
    pub frequency_context_size: usize,
    /// Added to the logits of the given token ids.
    pub logit_bias: BTreeMap<u32, f32>,
    /// Seed of the random stream; `None` picks one per request.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 0.0,
            min_p: 0.0,
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
            logit_bias: BTreeMap::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the message names the parameter, the value and what is accepted.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        if !(0.0..=100.0).contains(&self.temperature) || self.temperature.is_nan() {
            bail!("`temperature` must be between 0 and 100, got {}", self.temperature);
        }
        if !(0.0..=1.0).contains(&self.top_p) || self.top_p.is_nan() {
            bail!("`top_p` must be between 0 and 1, got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) || self.min_p.is_nan() {
            bail!("`min_p` must be between 0 and 1, got {}", self.min_p);
        }
        if self.top_k >= vocab_size {
            bail!("`top_k` must be below the vocabulary size {vocab_size} (0 disables it), got {}", self.top_k);
        }
        if let Some(p) = self.repetition_penalty {
            if !(p > 0.0 && p.is_finite()) {
                bail!("`repetition_penalty` must be a positive number, got {p}");
            }
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if let Some(v) = v {
                if !(-2.0..=2.0).contains(&v) || v.is_nan() {
                    bail!("`{name}` must be between -2 and 2, got {v}");
                }
            }
        }
        for (&id, &bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                bail!("`logit_bias` names token {id}, but the vocabulary has {vocab_size} tokens");
            }
            if !bias.is_finite() {
                bail!("`logit_bias` for token {id} must be a finite number, got {bias}");
            }
        }
        Ok(())
    }

    fn penalty(p: Option<f32>, neutral: f32) -> Option<f32> {
        p.filter(|&v| v != neutral && v != 0.0)
    }

    /// Whether any processor needs the token history.
    pub fn needs_history(&self) -> bool {
        Self::penalty(self.repetition_penalty, 1.0).is_some()
            || Self::penalty(self.presence_penalty, 0.0).is_some()
            || Self::penalty(self.frequency_penalty, 0.0).is_some()
    }
}

/// A request's sampler, with the device arrays it reuses every step.
#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    bias: Option<Array>,
}

/// SplitMix64: a strong 64-bit mix, so nearby (seed, position) pairs give unrelated keys.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Log-probabilities of `logits` along the last axis (`logits - logsumexp`), as mlx-lm
/// normalizes before sampling.
pub fn log_softmax(logits: &Array) -> Result<Array> {
    Ok(logits.subtract(&logits.logsumexp(&[-1], true)?)?)
}

fn scalar(v: f32) -> Result<Array> {
    Ok(Array::scalar(v, Dtype::Float32)?)
}

impl Sampler {
    pub fn new(params: SamplingParams, vocab_size: usize) -> Result<Sampler> {
        params.validate(vocab_size)?;
        let seed = params.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            mix(t ^ u64::from(std::process::id()))
        });
        // A dense bias row: `logits + bias` equals mlx-lm's `logits.at[:, ids].add(values)`
        // element for element (x + 0 == x).
        let bias = if params.logit_bias.is_empty() {
            None
        } else {
            let mut row = vec![0f32; vocab_size];
            for (&id, &b) in &params.logit_bias {
                row[id as usize] += b;
            }
            Some(Array::from_f32(&row, &[1, vocab_size])?)
        };
        Ok(Sampler { params, seed, bias })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed in use (the request's, or the one picked for it).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Applies the logits processors to `logits` (`[1, V]`); `history` is every token so
    /// far (prompt and generated, 1-D int32), needed only if `needs_history()`.
    pub fn process(&self, logits: &Array, history: Option<&Array>) -> Result<Array> {
        let mut logits = logits.clone();
        if let Some(bias) = &self.bias {
            logits = logits.add(bias)?;
        }
        let Some(history) = history else { return Ok(logits) };
        let window = |size: usize| -> Result<Array> {
            let n = history.dim(0);
            let start = n.saturating_sub(size) as i32;
            Ok(history.slice_axis(0, start, n as i32)?.expand_dims(&[0])?)
        };
        if let Some(p) = SamplingParams::penalty(self.params.repetition_penalty, 1.0) {
            let idx = window(self.params.repetition_context_size)?;
            let selected = logits.take_along_axis(&idx, 1)?;
            let zero = scalar(0.0)?;
            let p = scalar(p)?;
            let penalized = ops::where_(&selected.less(&zero)?, &selected.multiply(&p)?, &selected.divide(&p)?)?;
            logits = logits.put_along_axis(&idx, &penalized, 1)?;
        }
        if let Some(p) = SamplingParams::penalty(self.params.presence_penalty, 0.0) {
            let idx = window(self.params.presence_context_size)?;
            let selected = logits.take_along_axis(&idx, 1)?.subtract(&scalar(p)?)?;
            logits = logits.put_along_axis(&idx, &selected, 1)?;
        }
        if let Some(p) = SamplingParams::penalty(self.params.frequency_penalty, 0.0) {
            let idx = window(self.params.frequency_context_size)?;
            let minus = scalar(-p)?.broadcast_to(&[1, idx.dim(1) as i32])?;
            logits = logits.scatter_add_axis(&idx, &minus, 1)?;
        }
        Ok(logits)
    }

    /// Picks the next token from `logprobs` (`[1, V]`, normalized) for sequence position
    /// `position`; returns a lazy `[1]` int32 array.
    pub fn sample(&self, logprobs: &Array, position: usize) -> Result<Array> {
        if self.params.temperature == 0.0 {
            return Ok(logprobs.argmax(-1, false)?);
        }
        Ok(random::categorical(&self.distribution(logprobs)?, -1, &self.key(position)?)?)
    }

    /// The unnormalized log-distribution `sample` draws from at temperature > 0: `logprobs`
    /// (`[N, V]`) restricted by top-p, min-p and top-k (dropped tokens are -inf) and divided
    /// by the temperature. Lossless speculative verification compares these.
    pub fn distribution(&self, logprobs: &Array) -> Result<Array> {
        let p = &self.params;
        let neg_inf = scalar(f32::NEG_INFINITY)?;
        let mut lp = logprobs.clone();
        if p.top_p > 0.0 && p.top_p < 1.0 {
            let sorted = lp.sort(-1)?;
            let probs = sorted.astype(Dtype::Float32)?.exp()?;
            let mass_above = probs.cumsum(-1, true, false)?;
            let total = mass_above.slice_axis(-1, 0, 1)?.add(&probs.slice_axis(-1, 0, 1)?)?;
            let dropped = mass_above.greater_equal(&scalar(p.top_p)?.multiply(&total)?)?.sum(&[-1], true)?;
            let threshold = sorted.take_along_axis(&dropped, -1)?;
            lp = ops::where_(&lp.less(&threshold)?, &neg_inf, &lp)?;
        }
        if p.min_p > 0.0 {
            let top = lp.max(&[-1], true)?;
            let cut = top.add(&scalar(p.min_p.ln())?)?;
            lp = ops::where_(&lp.less(&cut)?, &neg_inf, &lp)?;
        }
        if p.top_k > 0 {
            let k = p.top_k as i32;
            let idx = lp.negative()?.argpartition(k - 1, -1)?;
            let drop = idx.slice_axis(-1, k, idx.dim(-1) as i32)?;
            lp = lp.put_along_axis(&drop, &neg_inf.astype(lp.dtype())?, -1)?;
        }
        Ok(lp.multiply(&scalar(1.0 / p.temperature.max(f32::MIN_POSITIVE))?)?)
    }

    /// The random key of sequence position `position`.
    pub fn key(&self, position: usize) -> Result<Array> {
        self.salted_key(position, 0)
    }

    /// A key for `position` from the independent stream `salt` (0 is `key`'s).
    pub fn salted_key(&self, position: usize, salt: u64) -> Result<Array> {
        Ok(random::key(self.stream(position, salt))?)
    }

    /// A uniform draw in [0, 1) for `position` from an independent stream `salt` (> 0),
    /// computed on the host: speculative verification's acceptance tests use these.
    pub fn uniform(&self, position: usize, salt: u64) -> f64 {
        (self.stream(position, salt) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn stream(&self, position: usize, salt: u64) -> u64 {
        let base = mix(self.seed ^ mix(position as u64));
        if salt == 0 {
            base
        } else {
            mix(base ^ mix(salt.wrapping_mul(0xA24B_AED4_963E_E407)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(values: &[f32]) -> Array {
        Array::from_f32(values, &[1, values.len()]).unwrap()
    }

    fn draw(params: SamplingParams, l: &[f32], positions: std::ops::Range<usize>) -> Vec<i32> {
        let s = Sampler::new(params, l.len()).unwrap();
        let lp = log_softmax(&logits(l)).unwrap();
        positions.map(|p| s.sample(&lp, p).unwrap().item_i32().unwrap()).collect()
    }

    #[test]
    fn temperature_zero_is_argmax() {
        assert_eq!(draw(SamplingParams::default(), &[0.1, 3.0, 2.9, -1.0], 0..3), vec![1, 1, 1]);
    }

    #[test]
    fn a_fixed_seed_gives_fixed_samples_and_another_seed_differs() {
        let flat = vec![0.0f32; 64];
        let p = |seed| SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() };
        let a = draw(p(7), &flat, 0..32);
        assert_eq!(a, draw(p(7), &flat, 0..32));
        assert_ne!(a, draw(p(8), &flat, 0..32));
        // Keyed by position: drawing position 5 alone gives what the run gave there.
        assert_eq!(draw(p(7), &flat, 5..6)[0], a[5]);
    }

    #[test]
    fn top_k_and_min_p_and_top_p_restrict_the_support() {
        let l = [5.0, 4.9, 0.0, -1.0, -2.0, 4.8];
        let top_k = SamplingParams { temperature: 1.0, top_k: 2, seed: Some(1), ..Default::default() };
        assert!(draw(top_k, &l, 0..64).iter().all(|t| [0, 1].contains(t)));
        let min_p = SamplingParams { temperature: 1.0, min_p: 0.5, seed: Some(1), ..Default::default() };
        assert!(draw(min_p, &l, 0..64).iter().all(|t| [0, 1, 5].contains(t)));
        let top_p = SamplingParams { temperature: 1.0, top_p: 0.3, seed: Some(1), ..Default::default() };
        assert!(draw(top_p, &l, 0..64).iter().all(|t| *t == 0));
    }

    #[test]
    fn penalties_and_bias_change_the_logits_as_documented() {
        let l = logits(&[2.0, -2.0, 1.0, 0.5]);
        let history = Array::from_i32(&[0, 1, 1], &[3]).unwrap();
        let run = |params: SamplingParams| {
            Sampler::new(params, 4).unwrap().process(&l, Some(&history)).unwrap().to_vec_f32().unwrap()
        };
        let rep = run(SamplingParams { repetition_penalty: Some(2.0), ..Default::default() });
        assert_eq!(rep, vec![1.0, -4.0, 1.0, 0.5]);
        let presence = run(SamplingParams { presence_penalty: Some(0.5), ..Default::default() });
        assert_eq!(presence, vec![1.5, -2.5, 1.0, 0.5]);
        let freq = run(SamplingParams { frequency_penalty: Some(0.5), ..Default::default() });
        assert_eq!(freq, vec![1.5, -3.0, 1.0, 0.5]);
        let bias = run(SamplingParams { logit_bias: [(3, 10.0)].into(), ..Default::default() });
        assert_eq!(bias, vec![2.0, -2.0, 1.0, 10.5]);
        // Window of 1: only the last token (1) is penalized.
        let windowed =
            run(SamplingParams { presence_penalty: Some(0.5), presence_context_size: 1, ..Default::default() });
        assert_eq!(windowed, vec![2.0, -2.5, 1.0, 0.5]);
    }

    #[test]
    fn out_of_range_parameters_are_refused_with_the_accepted_range() {
        let bad = |p: SamplingParams| Sampler::new(p, 10).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(bad(SamplingParams { temperature: -1.0, ..Default::default() })
            .contains("`temperature` must be between 0 and 100, got -1"));
        assert!(bad(SamplingParams { top_p: 1.5, ..Default::default() }).contains("`top_p`"));
        assert!(bad(SamplingParams { top_k: 10, ..Default::default() }).contains("vocabulary size 10"));
        assert!(bad(SamplingParams { logit_bias: [(99, 1.0)].into(), ..Default::default() }).contains("token 99"));
    }
}
