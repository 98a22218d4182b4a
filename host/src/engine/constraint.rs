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
use mlx::{Array, Dtype};
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

    /// A fresh constraint for a request whose random seed is `seed`.
    pub fn start(&self, seed: u64) -> Result<Box<dyn Constraint>> {
        (self.start)(seed)
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
        Ok(Guard { inner: spec.start(seed)?, eos: eos.to_vec(), vocab, masks: 0, mask_secs: 0.0 })
    }

    /// The mask of the next position: `[1, V]` bool, true where a token is refused; `None`
    /// when anything goes.
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
        let mut bits = match allowed {
            Allowed::Tokens(bits) => bits.clone(),
            _ => Vec::new(),
        };
        bits.resize(self.vocab.div_ceil(32), 0);
        for &e in &self.eos {
            if (e as usize) < self.vocab && allowed.permits(e, &self.eos) {
                bits[e as usize / 32] |= 1 << (e % 32);
            }
        }
        Ok(Some(refused(&bits, self.vocab)?))
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

/// The mask of a bitset of allowed tokens (bit `t % 32` of word `t / 32`): `[1, vocab]` bool,
/// true where a token is refused. Only the bitset (`vocab / 8` bytes) goes to the device,
/// which expands it: a `[1, V]` float row built on the host cost a step on the H200 ~0.4 ms
/// for SmolLM2's 49K tokens and ~0.9 ms for a 128K vocabulary (bench/RESULTS.md).
fn refused(bits: &[u32], vocab: usize) -> Result<Array> {
    let words = Array::from_u32(bits, &[bits.len(), 1])?;
    let pow2: Vec<u32> = (0..32).map(|b| 1u32 << b).collect();
    let two = Array::scalar(2.0, Dtype::Uint32)?;
    // Word `w`'s bit `b` is (w / 2^b) mod 2.
    let shifted = words.floor_divide(&Array::from_u32(&pow2, &[1, 32])?)?;
    let bit = shifted.subtract(&shifted.floor_divide(&two)?.multiply(&two)?)?;
    let refused = bit.equal(&Array::scalar(0.0, Dtype::Uint32)?)?;
    Ok(refused.reshape(&[1, -1])?.slice_axis(1, 0, vocab as i32)?)
}

/// Applies the masks of rows (`masks[i]` for row `i` of `logits`, `[N, V]`): a refused
/// token's logit becomes -inf; rows without a mask are left as they are.
pub fn apply(logits: &Array, masks: &[Option<Array>]) -> Result<Array> {
    if masks.iter().all(Option::is_none) {
        return Ok(logits.clone());
    }
    let refused = match masks {
        [Some(only)] => only.clone(),
        _ => {
            let none = Array::zeros(&[1, logits.dim(-1)], Dtype::Bool)?;
            let rows: Vec<&Array> = masks.iter().map(|m| m.as_ref().unwrap_or(&none)).collect();
            mlx::ops::concatenate(&rows, 0)?
        }
    };
    Ok(mlx::ops::where_(&refused, &Array::scalar(f32::NEG_INFINITY, logits.dtype())?, logits)?)
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
        assert!(row.iter().all(|&x| x == 0.0 || x == 1.0), "a boolean row");
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

    /// The bitset expands on the device into -inf logits exactly where it is clear, in the
    /// logits' own dtype, for the masked rows of a batch only.
    #[test]
    fn apply_sends_refused_tokens_to_minus_infinity_in_masked_rows_only() {
        let vocab = 70;
        let spec = script(vec![vec![0, 3, 31, 32, 33, 69]], vocab);
        let mut g = Guard::start(&spec, 0, &[], vocab).unwrap();
        let mask = g.mask().unwrap();
        let logits = Array::from_f32(&vec![1.5; 2 * vocab], &[2, vocab]).unwrap().astype(Dtype::Bfloat16).unwrap();
        let out = apply(&logits, &[mask, None]).unwrap();
        assert_eq!(out.dtype(), Dtype::Bfloat16);
        let out = out.to_vec_f32().unwrap();
        let open: Vec<usize> = (0..vocab).filter(|&t| out[t] == 1.5).collect();
        assert_eq!(open, vec![0, 3, 31, 32, 33, 69]);
        assert!((0..vocab).all(|t| out[t] == 1.5 || out[t] == f32::NEG_INFINITY));
        assert!(out[vocab..].iter().all(|&x| x == 1.5), "the unmasked row is as it was");
    }

    #[test]
    fn a_complete_constraint_without_an_eos_token_is_an_error() {
        let mut g = Guard::start(&script(vec![], 8), 0, &[], 8).unwrap();
        let e = g.mask().unwrap_err().to_string();
        assert!(e.contains("no end-of-sequence token"), "{e}");
    }
}
