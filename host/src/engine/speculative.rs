//! Speculative decoding: a drafter proposes the next K tokens, the target model scores all of
//! them in one forward of K+1 positions, and the longest prefix the target agrees with is
//! kept (plus the target's own token after it). Rejected positions are trimmed from the KV
//! caches. `decode.rs` runs the verification; this file holds the drafters, the settings and
//! the adaptive draft length.
//!
//! Exactness: the target's token at position p is a function of (its logits at p, seed, p),
//! so "sample and match" — draw the target token at every drafted position and keep drafts
//! while they equal the draw — yields exactly the tokens plain decoding would, for greedy,
//! seeded native sampling and plugin samplers alike. `Verify::Lossless` instead accepts a
//! draft with probability min(1, p/q) and resamples from the residual on rejection: the same
//! output distribution with higher acceptance, not the same tokens.
//!
//! Several candidates: with greedy decoding, prompt lookup can propose up to
//! `SpecConfig::candidates` different continuations (the most recent matches of the longest
//! n-grams first, then shorter ones down to one token), scored together as a batch of rows
//! over a copy of the cache (`KvCache::fork_batch`); the row the target agrees with longest
//! wins and only its positions enter the cache (`KvCache::adopt_row`). It raises tokens per
//! step (SmolLM2 on the edit workload: 1.69 -> 2.34 on the H200) but each step costs more
//! (the cache copies, more rows), and on the H200 it has not paid yet (bench/NOTES.md), so
//! the default is one candidate.

use super::sampling::Sampler;
use anyhow::{bail, Result};
use mlx::Array;
use models::{CausalLm, KvCache};

/// How drafts are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// Sample and match: token for token what non-speculative decoding gives.
    #[default]
    Exact,
    /// Rejection sampling against the draft distribution (native samplers only).
    Lossless,
}

/// Which drafter a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpecMethod {
    #[default]
    Off,
    /// Continue the longest recent n-gram match in the prompt and output.
    PromptLookup,
    /// A smaller model sharing the tokenizer (`--draft-model`).
    Draft,
}

impl SpecMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Off => "off",
            SpecMethod::PromptLookup => "prompt-lookup",
            SpecMethod::Draft => "draft",
        }
    }
}

/// Settings of one speculative generation.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// The most tokens drafted per target step (the adaptive length stays at or below it).
    pub num_draft_tokens: usize,
    /// Prompt lookup: the longest and shortest n-gram tried, longest first.
    pub ngram_max: usize,
    pub ngram_min: usize,
    pub verify: Verify,
    /// Prompt lookup, greedy: how many different continuations to verify per step, as rows of
    /// one batch; `None`: 1.
    pub candidates: Option<usize>,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            method: SpecMethod::Off,
            num_draft_tokens: 8,
            ngram_max: 4,
            ngram_min: 2,
            verify: Verify::Exact,
            candidates: None,
        }
    }
}

impl SpecConfig {
    pub fn validate(&self) -> Result<()> {
        if self.method != SpecMethod::Off && !(1..=64).contains(&self.num_draft_tokens) {
            bail!("`num_draft_tokens` must be between 1 and 64, got {}", self.num_draft_tokens);
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > 32 {
            bail!(
                "prompt-lookup n-gram sizes must satisfy 1 <= min <= max <= 32, got min {} and max {}",
                self.ngram_min,
                self.ngram_max
            );
        }
        if let Some(n) = self.candidates.filter(|n| !(1..=32).contains(n)) {
            bail!("`candidates` must be between 1 and 32, got {n}");
        }
        Ok(())
    }

    /// Candidates per step (see `candidates`).
    pub fn candidates(&self) -> usize {
        self.candidates.unwrap_or(1)
    }
}

/// A drafter's proposal.
pub struct Drafts {
    pub tokens: Vec<u32>,
    /// The draft's sampling distributions (`[K, V]`, as `Sampler::distribution`), when the
    /// drafter has them; `None` means the drafts were chosen deterministically.
    pub distributions: Option<Array>,
}

/// A draft model's cache (one entry per layer) and the tokens of its sequence it holds.
pub type Held = (Vec<KvCache>, usize);

/// A draft token from `logprobs` (`[1, V]`) for sequence position `position`, picked by the
/// request's `sampler` (greedy, or its seeded draw there), with the distribution it was drawn
/// from when `lossless` verification needs it (lazy).
pub fn pick_draft(
    sampler: &Sampler,
    logprobs: &Array,
    position: usize,
    lossless: bool,
) -> Result<(Array, Option<Array>)> {
    let token = sampler.sample(logprobs, position)?;
    Ok((token, lossless.then(|| sampler.distribution(logprobs)).transpose()?))
}

/// Proposes continuations of the committed sequence.
pub trait Drafter {
    /// Up to `k` tokens continuing `seq` (the prompt and every committed token). An empty
    /// proposal means "decode this step normally".
    fn draft(&mut self, seq: &[u32], k: usize, sampler: &Sampler, lossless: bool) -> Result<Drafts>;
    /// After verification: the first `accepted` drafts of the last proposal were kept.
    fn commit(&mut self, accepted: usize) -> Result<()>;
    /// A cheap guess whether `draft` would propose anything for `seq` (lets the decode loop
    /// stay pipelined while there is nothing to draft).
    fn likely(&self, seq: &[u32]) -> bool;
    /// A stricter `likely`, for when drafts have been missing: whether a proposal for `seq`
    /// would very likely be accepted. Drafters without a cheap signal say `likely`.
    fn sure(&self, seq: &[u32]) -> bool {
        self.likely(seq)
    }
    /// Up to `n` different continuations of `seq`, each of at most `k` tokens and none a
    /// prefix of another, most promising first; greedy decoding verifies them as one batch.
    /// Drafters that cannot propose alternatives give `draft`'s one.
    fn candidates(&mut self, seq: &[u32], k: usize, _n: usize, sampler: &Sampler) -> Result<Vec<Vec<u32>>> {
        let d = self.draft(seq, k, sampler, false)?;
        Ok(if d.tokens.is_empty() { Vec::new() } else { vec![d.tokens] })
    }
    /// A draft model's cache and the tokens of the sequence it holds, handed to a batch that
    /// drafts for several rows at once (the drafter then holds nothing); `None` for drafters
    /// without one.
    fn take_cache(&mut self) -> Option<Held> {
        None
    }
    /// The cache a batch drafted with, back (holding the sequence's first `held` tokens).
    fn give_cache(&mut self, _cache: Vec<KvCache>, _held: usize) {}
}

/// Prompt lookup decoding: find the most recent earlier occurrence of the sequence's last n
/// tokens (n from `ngram_max` down to `ngram_min`) and propose what followed it. Candidates
/// (`Drafter::candidates`) continue the next most recent matches, then shorter ones, down
/// to `fill_min` tokens.
pub struct PromptLookup {
    pub ngram_max: usize,
    pub ngram_min: usize,
    /// The shortest match that fills the candidate slots left (1 with several candidates).
    pub fill_min: usize,
}

impl PromptLookup {
    /// Prompt lookup as `config` sets it (several candidates fill their slots down to 1-token
    /// matches).
    pub fn new(config: &SpecConfig) -> Self {
        let fill_min = if config.candidates() > 1 { 1 } else { config.ngram_min };
        PromptLookup { ngram_max: config.ngram_max, ngram_min: config.ngram_min, fill_min }
    }

    /// Where the continuations of earlier occurrences of the sequence's last n tokens start,
    /// for n from `ngram_max` down to `min`: longest matches first, then most recent first
    /// (a match must end before the suffix itself does).
    fn matches<'s>(&self, seq: &'s [u32], min: usize) -> impl Iterator<Item = usize> + 's {
        (min..=self.ngram_max).rev().filter(move |&n| seq.len() > n).flat_map(move |n| {
            let suffix = &seq[seq.len() - n..];
            (0..seq.len() - n).rev().filter(move |&i| &seq[i..i + n] == suffix).map(move |i| i + n)
        })
    }

    /// The start of the continuation of the longest, most recent match, if any.
    fn find(&self, seq: &[u32]) -> Option<usize> {
        self.matches(seq, self.ngram_min).next()
    }

    /// Prompt lookup's ceiling on `out`, the text plain decoding wrote after `prompt`: tokens
    /// per target step if every step verified this drafter's draft of at most `k` tokens
    /// (`None`: unbounded), each step committing the accepted drafts and one token of the
    /// target's own. Speculation's speed-up over plain decoding stays below it wherever a
    /// verification costs at least a plain step. 0 for an empty `out`.
    pub fn ceiling(&self, prompt: &[u32], out: &[u32], k: Option<usize>) -> f64 {
        let seq: Vec<u32> = prompt.iter().chain(out).copied().collect();
        let (mut i, mut steps) = (prompt.len(), 0usize);
        while i < seq.len() {
            let accepted = self.find(&seq[..i]).map_or(0, |from| {
                let end = k.map_or(i, |k| (from + k).min(i));
                seq[from..end].iter().zip(&seq[i..]).take_while(|(d, t)| d == t).count()
            });
            i += accepted + 1;
            steps += 1;
        }
        if steps == 0 {
            0.0
        } else {
            out.len() as f64 / steps as f64
        }
    }
}

impl Drafter for PromptLookup {
    fn draft(&mut self, seq: &[u32], k: usize, _sampler: &Sampler, _lossless: bool) -> Result<Drafts> {
        let tokens = match self.find(seq) {
            Some(from) => seq[from..(from + k).min(seq.len())].to_vec(),
            None => Vec::new(),
        };
        Ok(Drafts { tokens, distributions: None })
    }

    fn commit(&mut self, _accepted: usize) -> Result<()> {
        Ok(())
    }

    fn likely(&self, seq: &[u32]) -> bool {
        self.matches(seq, self.fill_min.min(self.ngram_min)).next().is_some()
    }

    /// A match of the longest n-gram size: in prose, two-token matches ("of the") recur
    /// everywhere and rarely continue the same way; a text being copied matches at length.
    fn sure(&self, seq: &[u32]) -> bool {
        self.matches(seq, self.ngram_max).next().is_some()
    }

    fn candidates(&mut self, seq: &[u32], k: usize, n: usize, _sampler: &Sampler) -> Result<Vec<Vec<u32>>> {
        let mut out: Vec<Vec<u32>> = Vec::new();
        for from in self.matches(seq, self.fill_min.min(self.ngram_min)) {
            let c = &seq[from..(from + k).min(seq.len())];
            if out.iter().any(|o| o.starts_with(c)) {
                continue;
            }
            match out.iter_mut().find(|o| c.starts_with(o)) {
                Some(shorter) => *shorter = c.to_vec(),
                None => out.push(c.to_vec()),
            }
            if out.len() == n {
                break;
            }
        }
        Ok(out)
    }
}

/// A draft model with its own KV cache. It proposes by decoding `k` tokens with the request's
/// native sampler at the same positions and keys as the target (greedy drafts for greedy
/// requests; "coupled" draws otherwise, which agree whenever the two distributions are close).
pub struct DraftModel<'m> {
    model: &'m dyn CausalLm,
    cache: Vec<KvCache>,
    /// Tokens of the committed sequence held in `cache`.
    held: usize,
    /// The last proposal: sequence length when drafting and tokens drafted.
    last: Option<(usize, usize)>,
    prefill_step_size: usize,
    max_draft: usize,
}

impl<'m> DraftModel<'m> {
    /// A drafter proposing at most `max_draft` tokens a step (a recurrent layer of the draft
    /// model keeps the states to roll that many back).
    pub fn new(model: &'m dyn CausalLm, prefill_step_size: usize, max_draft: usize) -> Self {
        let mut d = DraftModel {
            model,
            cache: Vec::new(),
            held: 0,
            last: None,
            prefill_step_size: prefill_step_size.max(1),
            max_draft,
        };
        d.cache = d.fresh_cache();
        d
    }

    fn fresh_cache(&self) -> Vec<KvCache> {
        let mut cache = self.model.make_cache();
        for c in &mut cache {
            c.keep_snapshots(self.max_draft + 1);
        }
        cache
    }
}

fn ids_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_i32(&ids, &[1, ids.len()])?)
}

impl Drafter for DraftModel<'_> {
    fn draft(&mut self, seq: &[u32], k: usize, sampler: &Sampler, lossless: bool) -> Result<Drafts> {
        if self.held >= seq.len() {
            bail!("draft cache holds {} tokens of a {}-token sequence", self.held, seq.len());
        }
        let new = &seq[self.held..];
        let (head, tail) = new.split_at(new.len().saturating_sub(self.prefill_step_size));
        super::step::prefill(self.model, &mut self.cache, head, self.prefill_step_size)?;
        let mut input = ids_array(tail)?;
        let (mut tokens, mut dists) = (Vec::with_capacity(k), Vec::new());
        for i in 0..k {
            let logits = self.model.forward(&input, &mut self.cache)?;
            let len = logits.dim(1) as i32;
            let logits = logits.slice_axis(1, len - 1, len)?.squeeze(&[1])?;
            let logprobs = super::sampling::log_softmax(&logits)?;
            let (token, dist) = pick_draft(sampler, &logprobs, seq.len() + i, lossless)?;
            dists.extend(dist);
            input = token.expand_dims(&[0])?;
            tokens.push(token);
        }
        let refs: Vec<&Array> = tokens.iter().collect();
        let tokens = mlx::ops::concatenate(&refs, 0)?;
        let distributions = if lossless {
            let refs: Vec<&Array> = dists.iter().collect();
            Some(mlx::ops::concatenate(&refs, 0)?)
        } else {
            None
        };
        let mut outputs = vec![&tokens];
        outputs.extend(distributions.as_ref());
        mlx::eval(&outputs)?;
        // The cache now holds the sequence and every draft but the last.
        self.held = seq.len() + k - 1;
        self.last = Some((seq.len(), k));
        let tokens = tokens.to_vec_i32()?.into_iter().map(|t| t as u32).collect();
        Ok(Drafts { tokens, distributions })
    }

    fn commit(&mut self, accepted: usize) -> Result<()> {
        let Some((len, k)) = self.last.take() else { return Ok(()) };
        let keep = len + accepted.min(k - 1);
        models::roll_back(&mut self.cache, self.held - keep)?;
        self.held = keep;
        Ok(())
    }

    fn take_cache(&mut self) -> Option<Held> {
        self.last = None;
        let fresh = self.fresh_cache();
        Some((std::mem::replace(&mut self.cache, fresh), std::mem::take(&mut self.held)))
    }

    fn give_cache(&mut self, cache: Vec<KvCache>, held: usize) {
        (self.cache, self.held, self.last) = (cache, held, None);
        for c in &mut self.cache {
            c.keep_snapshots(self.max_draft + 1);
        }
    }

    fn likely(&self, _seq: &[u32]) -> bool {
        true
    }
}

/// When to speculate and how much: the draft length grows by 2 after a fully accepted step
/// and shrinks by 1 after a partial one. A step is a miss when it accepts nothing or, once
/// the decode loop has timed both kinds of step, when speculating does not pay: tokens per
/// verification per second below plain decoding's tokens per second (a verification runs
/// serially, a plain step overlaps the next one's dispatch with the device, so on a GPU a
/// verification costs well over one plain step: ~8-12 ms against ~3 ms on SmolLM2 on an
/// H200, bench/RESULTS.md). From the second consecutive miss, plain decoding takes over for
/// 2, 4, 8, 16, then 32 tokens before the next try, and while it is backing off the decode
/// loop tries only where the drafter is sure ([`Drafter::sure`]), so speculation on text that
/// does not repeat costs a few steps, not a slowdown. (Backing off from the first miss cost
/// 0.24 tokens/step on the edit workload; see bench/RESULTS.md.)
#[derive(Debug, Clone)]
pub struct AdaptiveK {
    pub k: usize,
    max: usize,
    misses: u32,
    cooldown: usize,
    /// Moving averages: seconds per pipelined plain step, seconds per verification, tokens
    /// committed per verification.
    plain_secs: Option<f64>,
    verify_secs: Option<f64>,
    verify_tokens: Option<f64>,
}

/// Weight of the newest sample in the moving averages.
const EWMA: f64 = 0.3;

fn ewma(avg: &mut Option<f64>, x: f64) {
    *avg = Some(avg.map_or(x, |a| a + EWMA * (x - a)));
}

impl AdaptiveK {
    pub fn new(max: usize) -> Self {
        AdaptiveK {
            k: max.clamp(1, 4),
            max: max.max(1),
            misses: 0,
            cooldown: 0,
            plain_secs: None,
            verify_secs: None,
            verify_tokens: None,
        }
    }

    /// Whether to try speculating now.
    pub fn ready(&self) -> bool {
        self.cooldown == 0
    }

    /// A token decoded without speculation.
    pub fn plain_token(&mut self) {
        self.cooldown = self.cooldown.saturating_sub(1);
    }

    /// A pipelined plain step took `secs`.
    pub fn plain_step(&mut self, secs: f64) {
        ewma(&mut self.plain_secs, secs);
    }

    /// A verification took `secs` and committed `tokens` tokens (before `update`).
    pub fn verify_step(&mut self, secs: f64, tokens: usize) {
        ewma(&mut self.verify_secs, secs);
        ewma(&mut self.verify_tokens, tokens as f64);
    }

    /// Whether the last two or more verifications missed: plain decoding is taking over.
    pub fn backing_off(&self) -> bool {
        self.misses >= 2
    }

    /// Whether speculating pays, by the timings so far (true until both kinds are timed).
    pub fn pays(&self) -> bool {
        match (self.plain_secs, self.verify_secs, self.verify_tokens) {
            (Some(p), Some(v), Some(g)) => g / v >= 1.0 / p,
            _ => true,
        }
    }

    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == drafted {
            self.k = (self.k + 2).min(self.max);
        } else {
            self.k = self.k.saturating_sub(1).max(1);
        }
        if accepted == 0 || !self.pays() {
            self.misses += 1;
            self.cooldown = if self.misses < 2 { 0 } else { 1usize << (self.misses - 1).min(5) };
        } else {
            self.misses = 0;
        }
    }
}

/// Speculation state carried by a `Generation`.
pub struct Speculation<'m> {
    pub drafter: Box<dyn Drafter + 'm>,
    pub config: SpecConfig,
    pub adaptive: AdaptiveK,
    /// The prompt (whole, including any prefix reused from the prompt cache) and every
    /// committed token.
    pub seq: Vec<u32>,
    /// The draft model the drafter runs (`SpecMethod::Draft`): a batch drafts for all its
    /// rows with one model together.
    pub draft_model: Option<&'m dyn CausalLm>,
}

impl<'m> Speculation<'m> {
    /// `prompt` is the whole prompt, including a prefix served from the prompt cache.
    pub fn new(
        config: SpecConfig,
        prompt: &[u32],
        draft_model: Option<&'m dyn CausalLm>,
        prefill_step_size: usize,
    ) -> Result<Self> {
        config.validate()?;
        let drafter: Box<dyn Drafter + 'm> = match config.method {
            SpecMethod::Off => bail!("speculation is off"),
            SpecMethod::PromptLookup => Box::new(PromptLookup::new(&config)),
            SpecMethod::Draft => match draft_model {
                Some(m) => Box::new(DraftModel::new(m, prefill_step_size, config.num_draft_tokens)),
                None => bail!("speculative method `draft` needs a draft model; start with --draft-model PATH"),
            },
        };
        let adaptive = AdaptiveK::new(config.num_draft_tokens);
        let draft_model = draft_model.filter(|_| config.method == SpecMethod::Draft);
        Ok(Speculation { drafter, adaptive, config, seq: prompt.to_vec(), draft_model })
    }

    /// Whether to try a speculative step now: the back-off allows it and the drafter likely
    /// proposes something; while backing off, only where it is sure. (The step before runs
    /// serially, so a try that finds nothing still costs.)
    pub fn wants_to_try(&self) -> bool {
        self.adaptive.ready()
            && if self.adaptive.backing_off() { self.drafter.sure(&self.seq) } else { self.drafter.likely(&self.seq) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_continues_the_longest_most_recent_match() {
        let pl = PromptLookup { ngram_max: 3, ngram_min: 1, fill_min: 1 };
        // "1 2 3" occurs at 0 and 5; the most recent earlier one (5) wins.
        let seq = [1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(pl.find(&seq), Some(8));
        // A longer match beats a more recent shorter one: "5 6" at 0, "6" alone at 4.
        let seq = [5, 6, 10, 11, 6, 12, 5, 6];
        assert_eq!(pl.find(&seq), Some(2));
        assert_eq!(PromptLookup { ngram_max: 2, ngram_min: 2, fill_min: 2 }.find(&[1, 2, 3, 4]), None);
    }

    #[test]
    fn prompt_lookup_ceiling_counts_steps_that_verify_every_draft() {
        // Plain decoding copied the prompt. Steps: "1" (no earlier "5 6"), "2" (no "6 1"),
        // then "1 2" matches at the start and the draft "3 4 5 6 1 2" is accepted as far as
        // the text goes (4 tokens): 6 tokens in 3 steps. At most 2 drafted: "3 4" and the
        // target's "5", then "4 5" matches and "6 1" is accepted up to the text's end ("6").
        let pl = PromptLookup { ngram_max: 2, ngram_min: 2, fill_min: 2 };
        let text = [1, 2, 3, 4, 5, 6];
        assert_eq!(pl.ceiling(&text, &text, None), 2.0);
        assert_eq!(pl.ceiling(&text, &text, Some(2)), 1.5);
        // Nothing to copy: one token per step; nothing generated: 0.
        assert_eq!(pl.ceiling(&[1, 2, 3], &[7, 8, 9], None), 1.0);
        assert_eq!(pl.ceiling(&text, &[], None), 0.0);
    }

    #[test]
    fn prompt_lookup_candidates_rank_longer_then_more_recent_matches_without_duplicates() {
        let sampler = Sampler::new(Default::default(), 16).unwrap();
        let mut pl = PromptLookup { ngram_max: 2, ngram_min: 2, fill_min: 1 };
        // Ends in "... 1 2". "1 2" is followed by 5 (at 6) and 3 (at 0); "2" alone also by 9
        // (at 3), and by 3 again (a duplicate of the second).
        let seq = [1, 2, 3, 2, 9, 1, 2, 5, 4, 1, 2];
        let c = pl.candidates(&seq, 2, 8, &sampler).unwrap();
        assert_eq!(c, vec![vec![5, 4], vec![3, 2], vec![9, 1]]);
        assert_eq!(c[0], pl.draft(&seq, 2, &sampler, false).unwrap().tokens, "the first is the single draft");
        assert_eq!(pl.candidates(&seq, 2, 2, &sampler).unwrap().len(), 2, "at most n");
        // A candidate that extends an earlier, shorter one (cut by the sequence's end) replaces it.
        assert_eq!(pl.candidates(&[7, 8, 7, 8, 7, 8], 3, 8, &sampler).unwrap(), vec![vec![7, 8, 7]]);
        // Without fill_min below ngram_min, no one-token matches.
        let mut strict = PromptLookup { ngram_max: 2, ngram_min: 2, fill_min: 2 };
        assert_eq!(strict.candidates(&[1, 2, 3, 2, 9, 4, 2], 2, 8, &sampler).unwrap(), Vec::<Vec<u32>>::new());
        assert!(pl.likely(&[1, 2, 3, 2, 9, 4, 2]) && !strict.likely(&[1, 2, 3, 2, 9, 4, 2]));
    }

    #[test]
    fn adaptive_k_grows_on_full_acceptance_and_backs_off_on_misses() {
        let mut a = AdaptiveK::new(8);
        assert_eq!(a.k, 4);
        a.update(4, 4);
        assert_eq!(a.k, 6);
        a.update(6, 2);
        assert_eq!(a.k, 5);
        a.update(5, 0);
        assert!(a.ready(), "one miss: keep speculating");
        a.update(4, 0);
        assert!(!a.ready());
        a.plain_token();
        a.plain_token();
        assert!(a.ready(), "second consecutive miss: 2 plain tokens");
        a.update(3, 0);
        for _ in 0..3 {
            a.plain_token();
        }
        assert!(!a.ready(), "third consecutive miss: 4 plain tokens");
        a.plain_token();
        assert!(a.ready());
        a.update(2, 1);
        a.update(2, 0);
        assert!(a.ready(), "an accepting step resets the count");
    }

    #[test]
    fn adaptive_k_backs_off_when_verifications_cost_more_than_they_commit() {
        // Plain steps take 1 ms; a verification 3 ms. Committing 2 tokens per verification
        // does not pay (0.67 tokens/ms < 1), 4 does.
        let mut a = AdaptiveK::new(8);
        a.plain_step(0.001);
        for _ in 0..2 {
            a.verify_step(0.003, 2);
            a.update(4, 1);
        }
        assert!(!a.pays() && !a.ready(), "two verifications that do not pay: back off");
        let mut b = AdaptiveK::new(8);
        b.plain_step(0.001);
        for _ in 0..4 {
            b.verify_step(0.003, 4);
            b.update(4, 3);
        }
        assert!(b.pays() && b.ready());
        // Until plain steps are timed, only acceptance counts.
        let mut c = AdaptiveK::new(8);
        c.verify_step(0.003, 2);
        c.update(4, 1);
        c.update(4, 1);
        assert!(c.pays() && c.ready());
    }

    #[test]
    fn while_backing_off_only_sure_matches_are_tried() {
        let config = SpecConfig { method: SpecMethod::PromptLookup, ngram_max: 4, ngram_min: 2, ..Default::default() };
        // Ends in "7 8": a two-token match (at 2) but no four-token one.
        let bigram = [7, 8, 9, 1, 2, 3, 7, 8];
        // Ends in "1 2 3 4", which occurred before: a four-token match.
        let copied = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4];
        let mut s = Speculation::new(config.clone(), &bigram, None, 512).unwrap();
        assert!(s.wants_to_try(), "not backing off: a two-token match is enough");
        s.adaptive.update(4, 0);
        s.adaptive.update(4, 0);
        for _ in 0..2 {
            s.adaptive.plain_token();
        }
        assert!(s.adaptive.ready() && s.adaptive.backing_off());
        assert!(!s.wants_to_try(), "backing off: a two-token match is not tried");
        s.seq = copied.to_vec();
        assert!(s.wants_to_try(), "backing off: a four-token match is");
        s.adaptive.update(4, 3);
        s.seq = bigram.to_vec();
        assert!(s.wants_to_try(), "a verification that pays ends the back-off");
    }
}
