//! XTC, "exclude top choices" (from text-generation-webui): with probability `probability`
//! per token, remove every candidate whose probability is at least `threshold` except the
//! least likely of them, pushing the text away from the most predictable continuations
//! without touching the tail. The host then samples natively among the rest.
//! Config: `{"threshold": 0.1, "probability": 0.5}`. The coin is keyed by (seed, position).

use plugin_sdk::{Candidate, Choice, Sampler};
use plugin_util::{check, parse, softmax};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Xtc {
    threshold: f32,
    probability: f32,
    #[serde(skip)]
    seed: u64,
}

impl Default for Xtc {
    fn default() -> Self {
        Xtc { threshold: 0.1, probability: 0.5, seed: 0 }
    }
}

impl Sampler for Xtc {
    fn init(&mut self, config: &str) -> Result<(), String> {
        *self = parse("xtc", "config", config)?;
        check("xtc", "threshold", self.threshold, (0.0..=0.5).contains(&self.threshold), "in [0, 0.5]")?;
        check("xtc", "probability", self.probability, (0.0..=1.0).contains(&self.probability), "in [0, 1]")
    }

    fn begin(&mut self, _params: &str, seed: u64) -> Result<(), String> {
        self.seed = seed;
        Ok(())
    }

    fn sample(&self, position: usize, candidates: &mut [Candidate]) -> Choice {
        // A salt keeps this coin independent of the host's own draw at the same position.
        if plugin_sdk::rng(self.seed ^ 0x7874_6300, position)() >= f64::from(self.probability) {
            return Choice::Defer;
        }
        let p = softmax(candidates, 1.0);
        // Candidates are sorted, so those above the threshold are a prefix.
        let above = p.iter().take_while(|&&q| q >= f64::from(self.threshold)).count();
        if above >= 2 {
            for c in &mut candidates[..above - 1] {
                c.logit = f32::NEG_INFINITY;
            }
        }
        Choice::Defer
    }
}

plugin_sdk::export_sampler!(
    Xtc,
    r#"{"abi": 1, "name": "xtc", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"input": "candidates", "k": 64}, "description": "XTC: exclude top choices above a probability threshold"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_all_top_choices_but_the_least_likely() {
        let mut s = Xtc::default();
        s.init(r#"{"threshold": 0.2, "probability": 1.0}"#).unwrap();
        let mut c = vec![
            Candidate { token: 1, logit: 2.0 },
            Candidate { token: 2, logit: 1.8 },
            Candidate { token: 3, logit: 1.5 },
            Candidate { token: 4, logit: -3.0 },
        ];
        assert_eq!(s.sample(0, &mut c), Choice::Defer);
        let alive: Vec<u32> = c.iter().filter(|c| c.logit.is_finite()).map(|c| c.token).collect();
        assert_eq!(alive, vec![3, 4]);
        s.init(r#"{"probability": 0.0}"#).unwrap();
        let mut d = c.clone();
        s.sample(0, &mut d);
        assert_eq!(c, d);
    }
}
