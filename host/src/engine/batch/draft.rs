//! The draft model's side of a speculative batch: the rows that draft with a draft model
//! hold their draft caches as the rows of one `BatchKvCache` per draft layer, so a step's
//! drafts are K forwards of the draft model over all of them together (and one read of the
//! tokens), not K forwards per row and a read per row.
//!
//! A row takes a seat at its first draft: its drafter's own cache (what it held drafting
//! alone, or nothing) caught up to its sequence but the last token (rows taking seats
//! together in one joint prefill where their lengths are near, as prompts arriving together
//! are), then pushed as a row. Each draft then feeds every seat its tokens since the last (`[S, T]`, T the longest
//! catch-up; rows that do not draft this step feed only padding, and a recurrent layer is
//! told where each row's real positions end, `end_rows_at`), trims the padding off
//! (`trim_rows`), and runs `K - 1` one-position forwards, each row sampling its next draft
//! with its own sampler from its own logits. A row that fell far behind (plain steps while
//! drafts did not pay) is caught up alone first, as a prompt is, not padded into everyone's
//! forward. `commit` keeps each row's accepted drafts and rolls the rest back, holes as a
//! verification leaves them (a recurrent layer goes back to the state it kept before the
//! row's first rejected draft: it keeps one before each drafted position until then). A
//! leaving row's cache goes back to its drafter.
//!
//! Not used where the target's caches are mirrored on other ranks (tensor parallelism: those
//! ranks know no draft caches; those rows draft alone, as before), or under
//! `HOST_DRAFT_BATCH=0` (for measuring).

use super::super::sampling::{log_softmax, Sampler};
use super::super::speculative::{pick_draft, Drafts, Held};
use super::super::step::{joint_rows, prefill, prefill_together};
use anyhow::{bail, Result};
use mlx::Array;
use models::{BatchKvCache, CausalLm, KvCache};

/// A row farther behind than this many tokens is caught up alone before it drafts with the
/// others (each position it feeds would otherwise be fed by every seat).
const CATCH_UP_TOGETHER: usize = 8;

/// `HOST_DRAFT_BATCH=0` drafts row by row (for measuring).
fn batched_by_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HOST_DRAFT_BATCH").map_or(true, |v| v != "0"))
}

/// One row's seat: its key, the tokens of its sequence the draft cache holds, and its last
/// proposal (sequence length when drafting, tokens drafted) until committed.
struct Seat {
    key: u64,
    held: usize,
    last: Option<(usize, usize)>,
}

/// What a drafting row asks for: its key, its sequence (prompt and committed tokens), how
/// many drafts, its sampler, and whether its drafts' distributions are wanted (lossless).
pub(super) struct Ask<'a> {
    pub key: u64,
    pub seq: &'a [u32],
    pub k: usize,
    pub sampler: &'a Sampler,
    pub lossless: bool,
    /// The row's drafter's own cache and the tokens it holds, for a row taking its seat.
    pub own: Option<Held>,
}

pub(super) struct DraftBatch<'m> {
    model: &'m dyn CausalLm,
    batched: bool,
    cache: Vec<BatchKvCache>,
    /// In the cache's row order.
    seats: Vec<Seat>,
    prefill_step_size: usize,
    /// Columns the last draft's one-position forwards wrote, kept until `commit`.
    pending: usize,
    /// Forwards of the draft model run (for tests and measurement).
    pub forwards: usize,
    /// Seats caught up in a joint prefill (for tests).
    pub caught_up_together: usize,
}

impl<'m> DraftBatch<'m> {
    pub fn new(model: &'m dyn CausalLm, prefill_step_size: usize) -> DraftBatch<'m> {
        let layers = model.make_cache().len();
        DraftBatch {
            model,
            batched: model.batches() && !models::cache::mirrored() && batched_by_env(),
            cache: (0..layers).map(|_| BatchKvCache::default()).collect(),
            seats: Vec::new(),
            prefill_step_size: prefill_step_size.max(1),
            pending: 0,
            forwards: 0,
            caught_up_together: 0,
        }
    }

    /// Whether this batch drafts for rows drafting with `model`: it is its model, which
    /// batches, on one rank (under tensor parallelism the other ranks know no draft caches),
    /// and `HOST_DRAFT_BATCH` allows it. Rows it does not serve draft alone.
    pub fn serves(&self, model: &dyn CausalLm) -> bool {
        self.batched && std::ptr::addr_eq(self.model as *const dyn CausalLm, model as *const dyn CausalLm)
    }

    pub fn seated(&self, key: u64) -> bool {
        self.seats.iter().any(|s| s.key == key)
    }

    /// Drafts for every row of `asks` (each with `k` at least 1), in their order.
    pub fn draft(&mut self, mut asks: Vec<Ask<'_>>) -> Result<Vec<Drafts>> {
        // Drafts never committed (their verification failed) are dropped.
        self.settle()?;
        if asks.is_empty() {
            return Ok(Vec::new());
        }
        // Seats for the new rows and the ones far behind, caught up to their sequences but
        // the last token: together where prompts arriving together would be
        // (`step::joint_rows`), the others alone.
        let mut arriving: Vec<(usize, Vec<KvCache>, usize)> = Vec::new();
        for (a, ask) in asks.iter_mut().enumerate() {
            if ask.seq.is_empty() || ask.k == 0 {
                bail!("a draft of {} tokens was asked for a sequence of {}", ask.k, ask.seq.len());
            }
            let index = self.seats.iter().position(|s| s.key == ask.key);
            let held = index.map_or(0, |i| self.seats[i].held);
            if held >= ask.seq.len() {
                bail!("a draft cache holds {held} tokens of a {}-token sequence", ask.seq.len());
            }
            if index.is_some() && ask.seq.len() - held <= CATCH_UP_TOGETHER {
                continue;
            }
            let (cache, held) = match index {
                Some(i) => (self.unseat(i)?, held),
                None => match ask.own.take() {
                    Some((cache, held)) if held < ask.seq.len() => (cache, held),
                    _ => (self.model.make_cache(), 0),
                },
            };
            arriving.push((a, cache, held));
        }
        if !arriving.is_empty() {
            let chunks: Vec<&[u32]> =
                arriving.iter().map(|&(a, _, held)| &asks[a].seq[held..asks[a].seq.len() - 1]).collect();
            let joint = joint_rows(self.model, &chunks.iter().map(|c| c.len()).collect::<Vec<_>>());
            if joint.contains(&true) {
                let parts: Vec<&[u32]> = (chunks.iter().zip(&joint)).filter(|(_, &j)| j).map(|(c, _)| *c).collect();
                let mut caches: Vec<&mut Vec<KvCache>> =
                    (arriving.iter_mut().zip(&joint)).filter(|(_, &j)| j).map(|(r, _)| &mut r.1).collect();
                prefill_together(self.model, &mut caches, &parts, self.prefill_step_size)?;
                self.caught_up_together += parts.len();
            }
            for ((r, chunk), _) in arriving.iter_mut().zip(&chunks).zip(&joint).filter(|(_, &j)| !j) {
                prefill(self.model, &mut r.1, chunk, self.prefill_step_size)?;
            }
            for &(a, ..) in &arriving {
                self.seats.push(Seat { key: asks[a].key, held: asks[a].seq.len() - 1, last: None });
            }
            for (layer, b) in self.cache.iter_mut().enumerate() {
                let caches: Vec<&KvCache> = arriving.iter().map(|r| &r.1[layer]).collect();
                b.push_all(&caches, models::cache::STEP)?;
            }
        }
        // Each seat's row in `asks`, and what it feeds first: its tokens since the last.
        let rows: Vec<Option<usize>> = self.seats.iter().map(|s| asks.iter().position(|a| a.key == s.key)).collect();
        let feed: Vec<&[u32]> =
            (self.seats.iter().zip(&rows)).map(|(s, r)| r.map_or(&[][..], |r| &asks[r].seq[s.held..])).collect();
        let t = feed.iter().map(|f| f.len()).max().unwrap_or(0);
        let pad = asks[0].seq[asks[0].seq.len() - 1] as i32;
        let mut ids = Vec::with_capacity(self.seats.len() * t);
        for f in &feed {
            ids.extend(f.iter().map(|&x| x as i32));
            ids.extend(std::iter::repeat_n(pad, t - f.len()));
        }
        let s = self.seats.len() as i32;
        // Each row's real positions end where its feed does (a recurrent layer leaves its
        // state there: the padding neither writes nor decays it).
        let kept: Vec<usize> = feed.iter().map(|f| f.len()).collect();
        for b in &mut self.cache {
            b.end_rows_at(&kept);
        }
        let logits = self.model.forward_batch(&Array::from_i32(&ids, &[s as usize, t])?, &mut self.cache)?;
        self.forwards += 1;
        for b in &mut self.cache {
            b.trim_rows(t, &kept)?;
        }
        // A recurrent layer keeps the states before each drafted position, for `commit`.
        let k_most = asks.iter().map(|a| a.k).max().unwrap_or(0);
        for b in &mut self.cache {
            b.keep_snapshots(k_most);
        }
        // Every seat's logits at its last fed position (a seat not drafting: any), then the
        // drafts one position a forward. Each position's picks are one `[S]` array: one argmax
        // for all seats where every asking row is greedy, else each row's sampler on its row.
        let vocab = logits.dim(2) as i32;
        let last: Vec<i32> = kept.iter().enumerate().map(|(i, &n)| (i * t + n.max(1) - 1) as i32).collect();
        let mut logits = logits.reshape(&[s * t as i32, vocab])?.take(&Array::from_i32(&last, &[last.len()])?, 0)?;
        let greedy = asks.iter().all(|a| !a.lossless && a.sampler.params().temperature == 0.0);
        let mut picks: Vec<Array> = Vec::with_capacity(k_most);
        let mut dists: Vec<Vec<Array>> = vec![Vec::new(); asks.len()];
        for j in 0..k_most {
            let logprobs = log_softmax(&logits)?;
            let pick = if greedy {
                logprobs.argmax(-1, false)?.astype(mlx::Dtype::Int32)?
            } else {
                let mut each = Vec::with_capacity(self.seats.len());
                for (i, row) in rows.iter().enumerate() {
                    each.push(match row.map(|r| &asks[r]).filter(|a| j < a.k) {
                        Some(ask) => {
                            let (token, dist) = pick_draft(
                                ask.sampler,
                                &logprobs.slice_axis(0, i as i32, i as i32 + 1)?,
                                ask.seq.len() + j,
                                ask.lossless,
                            )?;
                            dists[rows[i].expect("asked")].extend(dist);
                            token.astype(mlx::Dtype::Int32)?
                        }
                        None => Array::from_i32(&[pad], &[1])?,
                    });
                }
                mlx::ops::concatenate(&each.iter().collect::<Vec<_>>(), 0)?
            };
            if j + 1 < k_most {
                logits = self.model.forward_batch(&pick.reshape(&[s, 1])?, &mut self.cache)?.reshape(&[s, vocab])?;
                self.forwards += 1;
            }
            picks.push(pick.expand_dims(&[0])?);
        }
        let picks = mlx::ops::concatenate(&picks.iter().collect::<Vec<_>>(), 0)?;
        let dists: Vec<Option<Array>> = (dists.iter())
            .map(|d| (!d.is_empty()).then(|| mlx::ops::concatenate(&d.iter().collect::<Vec<_>>(), 0)).transpose())
            .collect::<mlx::Result<_>>()?;
        let mut outputs: Vec<&Array> = std::iter::once(&picks).chain(dists.iter().flatten()).collect();
        outputs.extend(self.cache.iter().flat_map(BatchKvCache::state));
        mlx::eval(&outputs)?;
        // `[K, S]`: row r's drafts are its seat's column, its first `k` of them.
        let picks = picks.to_vec_i32()?;
        // Every seat held its sequence; the drafting ones also their drafts but the last.
        for (seat, f) in self.seats.iter_mut().zip(&feed) {
            seat.held += f.len();
        }
        let mut out = Vec::with_capacity(asks.len());
        for (r, ask) in asks.iter().enumerate() {
            let i = self.seats.iter().position(|s| s.key == ask.key).expect("every ask has a seat");
            self.seats[i].last = Some((ask.seq.len(), ask.k));
            let tokens = (0..ask.k).map(|j| picks[j * self.seats.len() + i] as u32).collect();
            out.push(Drafts { tokens, distributions: dists[r].clone() });
        }
        // The one-position forwards wrote `k_most - 1` columns for every seat: kept as drafts
        // until `commit`.
        self.pending = k_most - 1;
        Ok(out)
    }

    /// After verification: each row that drafted kept the first `accepted` of its drafts
    /// (rows not named kept none). The draft caches keep each row's sequence and its
    /// accepted drafts, but the last drafted token (never fed).
    pub fn commit(&mut self, accepted: &[(u64, usize)]) -> Result<()> {
        let added = std::mem::take(&mut self.pending);
        let mut kept = Vec::with_capacity(self.seats.len());
        for seat in &mut self.seats {
            let n = match seat.last.take() {
                Some((len, k)) => {
                    let a = accepted.iter().find(|(key, _)| *key == seat.key).map_or(0, |&(_, a)| a);
                    let keep = a.min(k - 1);
                    seat.held = len + keep;
                    keep
                }
                None => 0,
            };
            kept.push(n);
        }
        for b in &mut self.cache {
            if added > 0 {
                b.trim_rows(added, &kept)?;
            }
            b.keep_snapshots(1);
        }
        Ok(())
    }

    /// Row `key`'s draft cache and the tokens it holds, its seat given up (`None` if it has
    /// none). A proposal not committed is dropped from it.
    pub fn leave(&mut self, key: u64) -> Result<Option<Held>> {
        let Some(i) = self.seats.iter().position(|s| s.key == key) else { return Ok(None) };
        self.settle()?;
        let held = self.seats[i].held;
        Ok(Some((self.unseat(i)?, held)))
    }

    /// A proposal not committed rolled back (none of its drafts kept).
    fn settle(&mut self) -> Result<()> {
        if self.pending > 0 || self.seats.iter().any(|s| s.last.is_some()) {
            self.commit(&[])?;
        }
        Ok(())
    }

    /// Seat `i`'s cache, out of the batch.
    fn unseat(&mut self, i: usize) -> Result<Vec<KvCache>> {
        let cache = self.cache.iter().map(|b| b.extract(i)).collect::<models::Result<Vec<_>>>()?;
        for b in &mut self.cache {
            b.remove(i)?;
        }
        self.seats.remove(i);
        Ok(cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::SamplingParams;
    use crate::engine::speculative::{DraftModel, Drafter};

    /// A seat drafts what its row's own `DraftModel` drafts alone; drafts never committed (their
    /// verification failed) are rolled back at the next draft, which then drafts as alone; a
    /// sequence shorter than what the seat holds is refused, saying so.
    #[test]
    fn a_seat_drafts_as_alone_and_uncommitted_drafts_roll_back() {
        let model = models::testing::model("llama", 4).unwrap();
        let model = model.as_ref();
        let vocab = model.vocab_size() as u32;
        let sampler = Sampler::new(SamplingParams::default(), model.vocab_size()).unwrap();
        let seq: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % vocab).collect();
        fn ask<'a>(seq: &'a [u32], sampler: &'a Sampler) -> Vec<Ask<'a>> {
            vec![Ask { key: 7, seq, k: 3, sampler, lossless: false, own: None }]
        }
        let alone = DraftModel::new(model, 8, 3).draft(&seq, 3, &sampler, false).unwrap().tokens;
        let mut batch = DraftBatch::new(model, 8);
        let first = batch.draft(ask(&seq, &sampler)).unwrap().remove(0).tokens;
        assert_eq!(first, alone);
        // Not committed; the row went on with another token than the first draft.
        let longer: Vec<u32> = seq.iter().copied().chain([(first[0] + 1) % vocab]).collect();
        let alone = DraftModel::new(model, 8, 3).draft(&longer, 3, &sampler, false).unwrap().tokens;
        assert_eq!(batch.draft(ask(&longer, &sampler)).unwrap().remove(0).tokens, alone, "drafted after no commit");
        batch.commit(&[(7, 3)]).unwrap();
        let Err(err) = batch.draft(ask(&seq[..5], &sampler)) else { panic!("a shrunk sequence was drafted for") };
        let err = err.to_string();
        assert!(err.contains("holds 15 tokens of a 5-token sequence"), "{err}");
    }
}
