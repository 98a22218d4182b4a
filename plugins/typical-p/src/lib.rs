//! Locally typical sampling (Meister et al., 2022; as HF transformers' TypicalLogitsWarper):
//! keep the candidates whose surprise is closest to the distribution's entropy until their
//! probability mass reaches `p`, then let the host sample natively (with the request's
//! temperature and seed) among them. Config: `{"p": 0.9, "min_keep": 1}`.

use plugin_sdk::{Candidate, Choice, Sampler};
use plugin_util::{check, parse, softmax};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TypicalP {
    p: f32,
    min_keep: usize,
}

impl Default for TypicalP {
    fn default() -> Self {
        TypicalP { p: 0.9, min_keep: 1 }
    }
}

impl Sampler for TypicalP {
    fn init(&mut self, config: &str) -> Result<(), String> {
        *self = parse("typical-p", "config", config)?;
        check("typical-p", "p", self.p, self.p > 0.0 && self.p <= 1.0, "in (0, 1]")
    }

    fn sample(&self, _position: usize, candidates: &mut [Candidate]) -> Choice {
        let p = softmax(candidates, 1.0);
        let entropy: f64 = -p.iter().filter(|&&q| q > 0.0).map(|q| q * q.ln()).sum::<f64>();
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        let distance = |i: usize| (-p[i].ln() - entropy).abs();
        order.sort_by(|&a, &b| distance(a).total_cmp(&distance(b)));
        let (mut mass, mut keep) = (0.0, 0);
        for &i in &order {
            keep += 1;
            mass += p[i];
            if mass >= f64::from(self.p) && keep >= self.min_keep {
                break;
            }
        }
        for &i in &order[keep..] {
            candidates[i].logit = f32::NEG_INFINITY;
        }
        Choice::Defer
    }
}

plugin_sdk::export_sampler!(
    TypicalP,
    r#"{"abi": 1, "name": "typical-p", "version": "0.1.0", "kinds": ["sampler"], "sampler": {"input": "candidates", "k": 256}, "description": "locally typical sampling: keeps tokens whose surprise is near the entropy"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_atypical_candidates_and_defers() {
        let mut s = TypicalP::default();
        s.init(r#"{"p": 0.5}"#).unwrap();
        // One dominant token and a flat tail: the entropy is low, so the dominant token
        // (surprise ~ entropy) is typical and the unlikely tail is cut.
        let mut c: Vec<Candidate> =
            (0..20).map(|i| Candidate { token: i, logit: if i == 0 { 6.0 } else { 0.0 } }).collect();
        assert_eq!(s.sample(0, &mut c), Choice::Defer);
        assert!(c[0].logit.is_finite());
        assert!(c.iter().filter(|c| c.logit.is_finite()).count() < 20);
        assert!(s.init(r#"{"p": 0}"#).unwrap_err().contains("`p` must be in (0, 1]"));
    }
}
