//! Constrained decoding: a row's constraint says which tokens may come next, and the decode
//! loops add its mask (0 where allowed, -inf elsewhere) to the processed logits before any
//! sampler sees them, native or plugin. The mask of a step is computed on the CPU while the
//! device runs that step's forward (the loops start the logits first), and a speculative
//! verification gets one mask per drafted position, the drafts accepted tentatively and
//! rolled back before the committed tokens are told.
//!
//! The engine knows constraints only through [`Constraint`]; what they are made from (a JSON
//! schema, a regex, a grammar, a plugin) is the server's business (`crate::structured`).

use anyhow::{bail, Result};
use mlx::Array;
use std::sync::Arc;

/// What a constraint allows at the next position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allowed {
    /// Any token.
    Anything,
    /// Only an end-of-sequence token: the constrained output is complete.
    End,
    /// The tokens whose bit is set: bit `t % 32` of word `t / 32`. A model's end-of-sequence
    /// token among them allows all of its end-of-sequence tokens.
    Tokens(Vec<u32>),
}

impl Allowed {
    /// Whether token `id` may come next (`eos`: the model's end-of-sequence tokens).
    pub fn permits(&self, id: u32, eos: &[u32]) -> bool {
        match self {
            Allowed::Anything => true,
            Allowed::End => eos.contains(&id),
            Allowed::Tokens(bits) => {
                let set = |t: u32| bits.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
                set(id) || (eos.contains(&id) && eos.iter().any(|&e| set(e)))
            }
        }
    }
}

/// A constraint over one request's output, told every token it is held to.
pub trait Constraint {
    /// The tokens allowed at the next position.
    fn allowed(&mut self) -> Result<Allowed>;
    /// `token` comes next (committed, or drafted and perhaps rolled back). End-of-sequence
    /// tokens are not passed: they end the output.
    fn accept(&mut self, token: u32) -> Result<()>;
    /// Forgets the last `tokens` accepted.
    fn rollback(&mut self, tokens: usize) -> Result<()>;
}

/// How a request's constraint is made: compiled once when the request arrives (so a bad
/// spec is refused there), started on the engine thread when the request starts.
#[derive(Clone)]
pub struct ConstraintSpec {
    /// What it is, for logs ("json_schema", "regex", a plugin's name).
    pub kind: String,
    start: Arc<dyn Fn(u64) -> Result<Box<dyn Constraint>> + Send + Sync>,
}

impl std::fmt::Debug for ConstraintSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintSpec").field("kind", &self.kind).finish_non_exhaustive()
    }
}

impl ConstraintSpec {
    pub fn new(
        kind: impl Into<String>,
        start: impl Fn(u64) -> Result<Box<dyn Constraint>> + Send + Sync + 'static,
    ) -> Self {
        ConstraintSpec { kind: kind.into(), start: Arc::new(start) }
    }
}

/// A row's constraint as the decode loops use it: masks as device arrays, end-of-sequence
/// tokens kept out of the constraint, tentative drafts rolled back.
pub struct Guard {
    inner: Box<dyn Constraint>,
    eos: Vec<u32>,
    vocab: usize,
    /// Masks computed and the seconds spent on them (the constraint's part and building
    /// the row), for `DecodeStats`.
    pub masks: usize,
    pub mask_secs: f64,
}

impl Guard {
    /// Starts `spec` for a request whose random seed is `seed`, on a model of `vocab` tokens
    /// whose end-of-sequence tokens are `eos`.
    pub fn start(spec: &ConstraintSpec, seed: u64, eos: &[u32], vocab: usize) -> Result<Guard> {
        Ok(Guard { inner: (spec.start)(seed)?, eos: eos.to_vec(), vocab, masks: 0, mask_secs: 0.0 })
    }

    /// The mask of the next position: `[1, V]` float32 of 0 and -inf, `None` when anything
    /// goes.
    pub fn mask(&mut self) -> Result<Option<Array>> {
        let allowed = self.allowed()?;
        self.mask_of(&allowed)
    }

    fn allowed(&mut self) -> Result<Allowed> {
        let started = std::time::Instant::now();
        let allowed = self.inner.allowed();
        self.masks += 1;
        self.mask_secs += started.elapsed().as_secs_f64();
        let allowed = allowed?;
        // Nothing allowed is the constraint's way of saying it is finished.
        Ok(match allowed {
            Allowed::Tokens(bits) if bits.iter().all(|&w| w == 0) => Allowed::End,
            a => a,
        })
    }

    fn mask_of(&self, allowed: &Allowed) -> Result<Option<Array>> {
        if *allowed == Allowed::Anything {
            return Ok(None);
        }
        if *allowed == Allowed::End && self.eos.is_empty() {
            bail!("the constraint is complete, but the model has no end-of-sequence token to end the output with");
        }
        let mut row = vec![f32::NEG_INFINITY; self.vocab];
        if let Allowed::Tokens(bits) = allowed {
            for (w, &word) in bits.iter().enumerate() {
                let mut word = word;
                while word != 0 {
                    let t = w * 32 + word.trailing_zeros() as usize;
                    if t < self.vocab {
                        row[t] = 0.0;
                    }
                    word &= word - 1;
                }
            }
        }
        for &e in &self.eos {
            if (e as usize) < self.vocab && allowed.permits(e, &self.eos) {
                row[e as usize] = 0.0;
            }
        }
        Ok(Some(Array::from_f32(&row, &[1, self.vocab])?))
    }

    /// A committed token (end-of-sequence tokens end the output and are not passed on).
    pub fn accept(&mut self, id: u32) -> Result<()> {
        if self.eos.contains(&id) {
            return Ok(());
        }
        self.inner.accept(id)
    }

    /// The masks of a verification's `drafts.len() + 1` positions (from the last committed
    /// token's), each `None` where anything goes. Drafts are accepted tentatively and rolled
    /// back; past the first draft the constraint refuses, nothing is asked (the target's
    /// token there differs from the draft, so no later position is committed).
    pub fn draft_masks(&mut self, drafts: &[u32]) -> Result<Vec<Option<Array>>> {
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        let mut fed = 0;
        let result = (|| -> Result<()> {
            for i in 0..=drafts.len() {
                let allowed = self.allowed()?;
                masks.push(self.mask_of(&allowed)?);
                let Some(&d) = drafts.get(i) else { break };
                if !allowed.permits(d, &self.eos) || self.eos.contains(&d) {
                    break;
                }
                self.inner.accept(d)?;
                fed += 1;
            }
            Ok(())
        })();
        if fed > 0 {
            self.inner.rollback(fed)?;
        }
        result?;
        masks.resize_with(drafts.len() + 1, || None);
        Ok(masks)
    }
}

/// Adds the masks of rows (`masks[i]` for row `i` of `logits`, `[N, V]`); rows without one
/// are left as they are.
pub fn apply(logits: &Array, masks: &[Option<Array>]) -> Result<Array> {
    if masks.iter().all(Option::is_none) {
        return Ok(logits.clone());
    }
    let vocab = logits.dim(-1);
    let zeros = Array::zeros(&[1, vocab], mlx::Dtype::Float32)?;
    let rows: Vec<&Array> = masks.iter().map(|m| m.as_ref().unwrap_or(&zeros)).collect();
    let bias = mlx::ops::concatenate(&rows, 0)?;
    Ok(logits.add(&bias.astype(logits.dtype())?)?)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A constraint for tests: position `i` of its output allows only `allowed[i]` (then the
    /// end), recording what it was told.
    pub struct Script {
        pub allowed: Vec<Vec<u32>>,
        pub accepted: Vec<u32>,
        pub vocab: usize,
    }

    impl Constraint for Script {
        fn allowed(&mut self) -> Result<Allowed> {
            let Some(set) = self.allowed.get(self.accepted.len()) else { return Ok(Allowed::End) };
            let mut bits = vec![0u32; self.vocab.div_ceil(32)];
            for &t in set {
                bits[t as usize / 32] |= 1 << (t % 32);
            }
            Ok(Allowed::Tokens(bits))
        }
        fn accept(&mut self, token: u32) -> Result<()> {
            let ok = self.allowed.get(self.accepted.len()).is_some_and(|s| s.contains(&token));
            if !ok {
                bail!("token {token} is not allowed at output position {}", self.accepted.len());
            }
            self.accepted.push(token);
            Ok(())
        }
        fn rollback(&mut self, tokens: usize) -> Result<()> {
            let n = self.accepted.len();
            if tokens > n {
                bail!("cannot roll back {tokens} of {n} tokens");
            }
            self.accepted.truncate(n - tokens);
            Ok(())
        }
    }

    pub fn script(allowed: Vec<Vec<u32>>, vocab: usize) -> ConstraintSpec {
        ConstraintSpec::new("script", move |_| {
            Ok(Box::new(Script { allowed: allowed.clone(), accepted: Vec::new(), vocab }) as Box<dyn Constraint>)
        })
    }

    #[test]
    fn masks_allow_exactly_the_permitted_tokens_and_every_eos_with_one() {
        let vocab = 70;
        let spec = script(vec![vec![3, 33, 69], vec![5, 1]], vocab);
        let mut g = Guard::start(&spec, 0, &[1, 2], vocab).unwrap();
        let row = g.mask().unwrap().unwrap().to_vec_f32().unwrap();
        let open: Vec<usize> = (0..vocab).filter(|&t| row[t] == 0.0).collect();
        assert_eq!(open, vec![3, 33, 69]);
        assert!(row.iter().all(|&x| x == 0.0 || x == f32::NEG_INFINITY));
        g.accept(33).unwrap();
        let row = g.mask().unwrap().unwrap().to_vec_f32().unwrap();
        let open: Vec<usize> = (0..vocab).filter(|&t| row[t] == 0.0).collect();
        assert_eq!(open, vec![1, 2, 5], "eos 1 allowed stands for eos 2 as well");
        g.accept(5).unwrap();
        let row = g.mask().unwrap().unwrap().to_vec_f32().unwrap();
        let open: Vec<usize> = (0..vocab).filter(|&t| row[t] == 0.0).collect();
        assert_eq!(open, vec![1, 2], "a complete constraint allows only the end");
        g.accept(2).unwrap();
        assert!(g.accept(7).is_err(), "a token the constraint refuses is an error");
    }

    #[test]
    fn draft_masks_follow_the_drafts_and_leave_the_constraint_where_it_was() {
        let vocab = 40;
        let spec = script(vec![vec![3], vec![4], vec![5]], vocab);
        let mut g = Guard::start(&spec, 0, &[0], vocab).unwrap();
        let open = |m: &Option<Array>| -> Vec<usize> {
            let row = m.as_ref().unwrap().to_vec_f32().unwrap();
            (0..vocab).filter(|&t| row[t] == 0.0).collect()
        };
        let masks = g.draft_masks(&[3, 4]).unwrap();
        assert_eq!(masks.len(), 3);
        assert_eq!(open(&masks[0]), vec![3]);
        assert_eq!(open(&masks[1]), vec![4]);
        assert_eq!(open(&masks[2]), vec![5]);
        // A refused draft: positions after it are not constrained (never committed).
        let masks = g.draft_masks(&[3, 9, 5]).unwrap();
        assert_eq!(open(&masks[1]), vec![4]);
        assert!(masks[2].is_none() && masks[3].is_none());
        // Rolled back: the first position is still the first.
        assert_eq!(open(&g.mask().unwrap()), vec![3]);
    }

    #[test]
    fn a_complete_constraint_without_an_eos_token_is_an_error() {
        let mut g = Guard::start(&script(vec![], 8), 0, &[], 8).unwrap();
        let e = g.mask().unwrap_err().to_string();
        assert!(e.contains("no end-of-sequence token"), "{e}");
    }
}
