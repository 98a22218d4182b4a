//! Top-n-sigma sampling (Tang et al., 2024) as a host plugin written with `plugin-sdk`:
//! keep the candidates whose logit is within `n` standard deviations of the best one, then
//! sample among them at temperature `temperature` with `(seed, position)`-keyed randomness.
//! Config: `{"n": 1.0, "temperature": 1.0}`.

use plugin_sdk::{Candidate, Choice, Sampler};

pub struct TopNSigma {
    n: f32,
    temperature: f32,
    seed: u64,
}

impl Default for TopNSigma {
    fn default() -> Self {
        TopNSigma { n: 1.0, temperature: 1.0, seed: 0 }
    }
}

/// Reads a number field from a flat JSON object without a JSON library.
fn field(json: &str, key: &str) -> Option<f32> {
    let at = json.find(&format!("\"{key}\""))?;
    let rest = json[at + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e' || c == 'E' || c == '+'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

impl Sampler for TopNSigma {
    fn init(&mut self, config: &str) -> Result<(), String> {
        self.n = field(config, "n").unwrap_or(1.0);
        self.temperature = field(config, "temperature").unwrap_or(1.0);
        if !(self.n > 0.0) || !(self.temperature >= 0.0) {
            return Err(format!(
                "top-n-sigma: need n > 0 and temperature >= 0, got n={} temperature={}",
                self.n, self.temperature
            ));
        }
        Ok(())
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
        let kept: Vec<&Candidate> = candidates.iter().filter(|c| c.logit >= cut).collect();
        if self.temperature == 0.0 || kept.len() == 1 {
            return Choice::Token(kept[0].token);
        }
        let weights: Vec<f64> =
            kept.iter().map(|c| (((c.logit - kept[0].logit) / self.temperature) as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut u = plugin_sdk::rng(self.seed, position)() * total;
        for (c, w) in kept.iter().zip(&weights) {
            if u < *w {
                return Choice::Token(c.token);
            }
            u -= w;
        }
        Choice::Token(kept[kept.len() - 1].token)
    }
}

plugin_sdk::export_sampler!(
    TopNSigma,
    r#"{"abi": 1, "name": "top-n-sigma", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"input": "candidates", "k": 64}, "description": "top-n-sigma sampling"}"#
);
