//! DRY, "don't repeat yourself" (from koboldcpp / text-generation-webui): a token that would
//! extend a sequence already seen in the context by `n >= allowed_length` tokens is penalized
//! by `multiplier * base^(n - allowed_length)` on its logit; the host then samples natively.
//! Config: `{"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "last_n": 1024,
//! "sequence_breakers": []}`; breakers are token ids that no repeated sequence may cross
//! (a plugin sees ids, not text: give the ids of e.g. "\n" in the model's vocabulary).

use plugin_sdk::{Candidate, Choice, Sampler};
use plugin_util::{check, parse};
use serde::Deserialize;
use std::collections::HashMap;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    multiplier: f32,
    base: f32,
    allowed_length: usize,
    last_n: usize,
    sequence_breakers: Vec<u32>,
}

impl Default for Config {
    fn default() -> Self {
        Config { multiplier: 0.8, base: 1.75, allowed_length: 2, last_n: 1024, sequence_breakers: vec![] }
    }
}

#[derive(Default)]
pub struct Dry {
    config: Config,
    history: Vec<u32>,
}

impl Dry {
    /// For each token that would repeat what followed an earlier occurrence of the current
    /// suffix, the longest such repeated suffix.
    fn repeats(&self) -> HashMap<u32, usize> {
        let h = &self.history[self.history.len().saturating_sub(self.config.last_n)..];
        let breaker = |t: &u32| self.config.sequence_breakers.contains(t);
        let mut out: HashMap<u32, usize> = HashMap::new();
        let Some(last) = h.last() else { return out };
        if breaker(last) {
            return out;
        }
        for i in 0..h.len() - 1 {
            // h[..=i] ends with the same token as the context: measure the common suffix.
            let mut n = 0;
            while n <= i && n < h.len() - 1 - i && h[i - n] == h[h.len() - 1 - n] && !breaker(&h[i - n]) {
                n += 1;
            }
            let next = h[i + 1];
            if n > 0 && !breaker(&next) {
                let e = out.entry(next).or_default();
                *e = (*e).max(n);
            }
        }
        out
    }
}

impl Sampler for Dry {
    fn init(&mut self, config: &str) -> Result<(), String> {
        let c: Config = parse("dry", "config", config)?;
        check("dry", "multiplier", c.multiplier, c.multiplier >= 0.0, ">= 0")?;
        check("dry", "base", c.base, c.base >= 1.0, ">= 1")?;
        if c.allowed_length == 0 || c.last_n == 0 {
            return Err("dry: `allowed_length` and `last_n` must be at least 1".into());
        }
        self.config = c;
        Ok(())
    }

    fn accept(&mut self, tokens: &[u32]) {
        self.history.extend_from_slice(tokens);
    }

    fn rollback(&mut self, n: usize) -> bool {
        self.history.truncate(self.history.len().saturating_sub(n));
        true
    }

    fn sample(&self, _position: usize, candidates: &mut [Candidate]) -> Choice {
        let repeats = self.repeats();
        for c in candidates.iter_mut() {
            if let Some(&n) = repeats.get(&c.token) {
                if n >= self.config.allowed_length {
                    let exponent = (n - self.config.allowed_length) as f32;
                    c.logit -= self.config.multiplier * self.config.base.powf(exponent.min(64.0));
                }
            }
        }
        Choice::Defer
    }
}

plugin_sdk::export_sampler!(
    Dry,
    r#"{"abi": 1, "name": "dry", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"input": "candidates", "k": 128}, "description": "DRY: penalizes tokens that extend a sequence repeated from the context"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalizes_the_token_that_continues_a_repeat() {
        let mut d = Dry::default();
        d.init(r#"{"multiplier": 1.0, "base": 2.0, "allowed_length": 2}"#).unwrap();
        // "1 2 3 4 9 1 2 3": continuing with 4 repeats "1 2 3 4" (suffix length 3).
        d.accept(&[1, 2, 3, 4, 9, 1, 2, 3]);
        let mut c = vec![Candidate { token: 4, logit: 1.0 }, Candidate { token: 5, logit: 1.0 }];
        assert_eq!(d.sample(0, &mut c), Choice::Defer);
        assert_eq!(c[0].logit, 1.0 - 2.0); // 1 * 2^(3 - 2)
        assert_eq!(c[1].logit, 1.0);
        // A breaker inside the repeat shortens it below allowed_length.
        d.init(r#"{"multiplier": 1.0, "base": 2.0, "allowed_length": 2, "sequence_breakers": [2]}"#).unwrap();
        let mut c = vec![Candidate { token: 4, logit: 1.0 }];
        d.sample(0, &mut c);
        assert_eq!(c[0].logit, 1.0);
        assert!(d.rollback(3));
        assert_eq!(d.history, vec![1, 2, 3, 4, 9]);
    }
}
