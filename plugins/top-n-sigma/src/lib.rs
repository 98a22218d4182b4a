//! Top-n-sigma sampling (Tang et al., 2024), built in and the SDK's worked example: keep the
//! candidates whose logit is within `n` standard deviations of the best one, then sample
//! among them at `temperature` with `(seed, position)`-keyed randomness.
//! Config: `{"n": 1.0, "temperature": 1.0}`.

use plugin_sdk::{Candidate, Choice, Sampler};
use plugin_util::{check, parse, pick, softmax};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TopNSigma {
    n: f32,
    temperature: f32,
    #[serde(skip)]
    seed: u64,
}

impl Default for TopNSigma {
    fn default() -> Self {
        TopNSigma { n: 1.0, temperature: 1.0, seed: 0 }
    }
}

impl Sampler for TopNSigma {
    fn init(&mut self, config: &str) -> Result<(), String> {
        *self = parse("top-n-sigma", "config", config)?;
        check("top-n-sigma", "n", self.n, self.n > 0.0, "> 0")?;
        check("top-n-sigma", "temperature", self.temperature, self.temperature >= 0.0, ">= 0")
    }

    fn begin(&mut self, _params: &str, seed: u64) -> Result<(), String> {
        self.seed = seed;
        Ok(())
    }

    fn sample(&self, position: usize, candidates: &mut [Candidate]) -> Choice {
        let count = candidates.len() as f32;
        let mean = candidates.iter().map(|c| c.logit).sum::<f32>() / count;
        let sigma = (candidates.iter().map(|c| (c.logit - mean).powi(2)).sum::<f32>() / count).sqrt();
        let cut = candidates[0].logit - self.n * sigma;
        let kept = candidates.iter().take_while(|c| c.logit >= cut).count().max(1);
        if self.temperature == 0.0 || kept == 1 {
            return Choice::Token(candidates[0].token);
        }
        let p = softmax(&candidates[..kept], self.temperature);
        Choice::Token(candidates[pick(&p, plugin_sdk::rng(self.seed, position)())].token)
    }
}

plugin_sdk::export_sampler!(
    TopNSigma,
    r#"{"abi": 1, "name": "top-n-sigma", "version": "0.2.0", "kinds": ["sampler"], "sampler": {"input": "candidates", "k": 64}, "description": "top-n-sigma sampling: keep logits within n standard deviations of the best"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    fn frame() -> Vec<Candidate> {
        [5.0, 4.9, 1.0, 0.5, 0.0]
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate { token: i as u32 + 10, logit: l })
            .collect()
    }

    #[test]
    fn keeps_only_the_band_near_the_best() {
        let mut s = TopNSigma::default();
        s.init(r#"{"n": 0.1, "temperature": 1.0}"#).unwrap();
        // sigma ~2.2, the band is 0.22 wide: tokens 10 and 11 only.
        let picks: std::collections::BTreeSet<Choice> = (0..200).map(|p| s.sample(p, &mut frame())).collect();
        assert_eq!(picks, [Choice::Token(10), Choice::Token(11)].into());
        assert!(s.init(r#"{"n": -1}"#).unwrap_err().contains("`n` must be > 0"));
    }
}
