//! Mirostat v2 (Basu et al., 2021; as llama.cpp implements it): keeps the surprise of the
//! generated text near a target `tau` by truncating candidates whose surprise exceeds a
//! running bound `mu`, updated after every committed token: `mu -= eta * (surprise - tau)`.
//! Config: `{"tau": 5.0, "eta": 0.1, "temperature": 1.0}`.
//!
//! `mu` depends on the output, so it changes only in `accept` (with a stack for `rollback`);
//! `sample` stays pure and memoizes its frame so `accept` can find the committed token's
//! surprise.

use plugin_sdk::{Candidate, Choice, Sampler};
use plugin_util::{check, parse, pick, softmax};
use serde::Deserialize;
use std::cell::RefCell;

#[derive(Deserialize, Clone, Copy)]
#[serde(default, deny_unknown_fields)]
struct Config {
    tau: f32,
    eta: f32,
    temperature: f32,
}

impl Default for Config {
    fn default() -> Self {
        Config { tau: 5.0, eta: 0.1, temperature: 1.0 }
    }
}

/// A sampled frame: (position, [(token, surprise in bits after truncation)]).
type Memo = (usize, Vec<(u32, f32)>);

#[derive(Default)]
pub struct Mirostat {
    config: Config,
    seed: u64,
    /// `mu` after each accepted token, prompt included (so its length is the next position
    /// and `rollback` pops); the last entry is the current bound.
    mu: Vec<f32>,
    /// The last frame sampled.
    memo: RefCell<Option<Memo>>,
}

impl Mirostat {
    fn mu(&self) -> f32 {
        *self.mu.last().unwrap_or(&(2.0 * self.config.tau))
    }

    /// Truncated, renormalized distribution: (candidate index, probability).
    fn truncated(&self, candidates: &[Candidate]) -> Vec<(usize, f64)> {
        let p = softmax(candidates, self.config.temperature);
        let mu = f64::from(self.mu());
        let mut kept: Vec<(usize, f64)> =
            p.iter().enumerate().filter(|(_, &q)| -q.log2() <= mu).map(|(i, &q)| (i, q)).collect();
        if kept.is_empty() {
            kept.push((0, p[0]));
        }
        let total: f64 = kept.iter().map(|k| k.1).sum();
        kept.iter_mut().for_each(|k| k.1 /= total);
        kept
    }
}

impl Sampler for Mirostat {
    fn init(&mut self, config: &str) -> Result<(), String> {
        let c: Config = parse("mirostat", "config", config)?;
        check("mirostat", "tau", c.tau, c.tau > 0.0, "> 0")?;
        check("mirostat", "eta", c.eta, c.eta > 0.0 && c.eta <= 1.0, "in (0, 1]")?;
        check("mirostat", "temperature", c.temperature, c.temperature > 0.0, "> 0")?;
        self.config = c;
        Ok(())
    }

    fn begin(&mut self, _params: &str, seed: u64) -> Result<(), String> {
        self.seed = seed;
        Ok(())
    }

    fn accept(&mut self, tokens: &[u32]) {
        for &token in tokens {
            let position = self.mu.len();
            let surprise = match &*self.memo.borrow() {
                Some((p, frame)) if *p == position => frame.iter().find(|f| f.0 == token).map(|f| f.1),
                _ => None,
            };
            let mu = self.mu();
            // A prompt token, or one the plugin did not sample, leaves mu unchanged.
            self.mu.push(surprise.map_or(mu, |s| mu - self.config.eta * (s - self.config.tau)));
        }
    }

    fn rollback(&mut self, n: usize) -> bool {
        self.mu.truncate(self.mu.len().saturating_sub(n));
        true
    }

    fn sample(&self, position: usize, candidates: &mut [Candidate]) -> Choice {
        let kept = self.truncated(candidates);
        let weights: Vec<f64> = kept.iter().map(|k| k.1).collect();
        let chosen = kept[pick(&weights, plugin_sdk::rng(self.seed, position)())].0;
        let frame = kept.iter().map(|&(i, q)| (candidates[i].token, -(q.log2()) as f32)).collect();
        *self.memo.borrow_mut() = Some((position, frame));
        Choice::Token(candidates[chosen].token)
    }
}

plugin_sdk::export_sampler!(
    Mirostat,
    r#"{"abi": 1, "name": "mirostat", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"input": "candidates", "k": 256}, "description": "Mirostat v2: adaptive truncation toward a target surprise tau"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: usize) -> Vec<Candidate> {
        (0..n).map(|i| Candidate { token: i as u32, logit: -(i as f32) * 0.3 }).collect()
    }

    #[test]
    fn mu_tracks_tau_and_rolls_back() {
        let mut m = Mirostat::default();
        m.init(r#"{"tau": 3.0, "eta": 0.5}"#).unwrap();
        m.begin("{}", 7).unwrap();
        m.accept(&[1, 2, 3]);
        let mut history = vec![];
        for step in 0..200 {
            let position = 3 + step;
            let Choice::Token(t) = m.sample(position, &mut frame(64)) else { panic!() };
            m.accept(&[t]);
            history.push(m.mu());
        }
        // The running bound settles near the level whose truncation gives surprise ~tau.
        let tail: f32 = history[150..].iter().sum::<f32>() / 50.0;
        assert!(tail > 2.0 && tail < 8.0, "mu settled at {tail}");
        let before = m.mu.clone();
        let Choice::Token(t) = m.sample(203, &mut frame(64)) else { panic!() };
        m.accept(&[t]);
        assert!(m.rollback(1));
        assert_eq!(m.mu, before);
        // Pure sampling: the same position gives the same token.
        assert_eq!(m.sample(203, &mut frame(64)), m.sample(203, &mut frame(64)));
    }

    #[test]
    fn low_mu_truncates_to_the_best() {
        let mut m = Mirostat::default();
        m.init(r#"{"tau": 0.005}"#).unwrap();
        assert!((0..50).all(|p| m.sample(p, &mut frame(16)) == Choice::Token(0)));
        assert!(m.init(r#"{"eta": 2}"#).unwrap_err().contains("`eta` must be in (0, 1]"));
    }
}
