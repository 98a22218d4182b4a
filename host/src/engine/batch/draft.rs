//! The draft model's side of a speculative batch: the rows that draft with a draft model
//! hold their draft caches as the rows of one `BatchKvCache` per draft layer, so a step's
//! drafts are K forwards of the draft model over all of them together (and one read of the
//! tokens), not K forwards per row and a read per row.
//!
//! A row takes a seat at its first draft: its drafter's own cache (what it held drafting
//! alone, or nothing) caught up alone to its sequence but the last token, then pushed as a
//! row. Each draft then feeds every seat its tokens since the last (`[S, T]`, T the longest
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
use super::super::speculative::Drafts;
use super::super::step::prefill;
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

/// A draft cache (one entry per draft layer) and the tokens of its sequence it holds.
pub(super) type Held = (Vec<KvCache>, usize);

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
}

impl<'m> DraftBatch<'m> {
    pub fn new(model: &'m dyn CausalLm, prefill_step_size: usize) -> DraftBatch<'m> {
        let layers = model.make_cache().len();
        DraftBatch {
            model,
            batched: model.batches() && batched_by_env(),
            cache: (0..layers).map(|_| BatchKvCache::default()).collect(),
            seats: Vec::new(),
            prefill_step_size: prefill_step_size.max(1),
            pending: 0,
            forwards: 0,
        }
    }

    /// Whether the draft model drafts as a batch: it batches (and `HOST_DRAFT_BATCH` allows).
    pub fn batched(&self) -> bool {
        self.batched
    }

    pub fn is_model(&self, model: &dyn CausalLm) -> bool {
        std::ptr::addr_eq(self.model as *const dyn CausalLm, model as *const dyn CausalLm)
    }

    pub fn seated(&self, key: u64) -> bool {
        self.seats.iter().any(|s| s.key == key)
    }

    /// Drafts for every row of `asks` (each with `k` at least 1), in their order.
    pub fn draft(&mut self, asks: Vec<Ask<'_>>) -> Result<Vec<Drafts>> {
        // Drafts never committed (their verification failed) are dropped.
        self.settle()?;
        // Seats for the new rows and the ones far behind, each caught up alone to its
        // sequence but the last token.
        let mut arriving: Vec<Vec<KvCache>> = Vec::new();
        let mut asks = asks;
        for ask in &mut asks {
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
            let (mut cache, held) = match index {
                Some(i) => (self.unseat(i)?, held),
                None => match ask.own.take() {
                    Some((cache, held)) if held < ask.seq.len() => (cache, held),
                    _ => (self.model.make_cache(), 0),
                },
            };
            prefill(self.model, &mut cache, &ask.seq[held..ask.seq.len() - 1], self.prefill_step_size)?;
            self.seats.push(Seat { key: ask.key, held: ask.seq.len() - 1, last: None });
            arriving.push(cache);
        }
        if !arriving.is_empty() {
            for (layer, b) in self.cache.iter_mut().enumerate() {
                let caches: Vec<&KvCache> = arriving.iter().map(|c| &c[layer]).collect();
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
        // Each drafting row's logits at its last token, then its drafts one position a forward.
        let vocab = logits.dim(2) as i32;
        let logits = logits.reshape(&[s * t as i32, vocab])?;
        let mut tokens: Vec<Vec<Array>> = vec![Vec::new(); asks.len()];
        let mut dists: Vec<Vec<Array>> = vec![Vec::new(); asks.len()];
        let mut at: Vec<Option<Array>> = (0..self.seats.len())
            .map(|i| {
                let n = kept[i] as i32;
                rows[i].map(|_| logits.slice_axis(0, i as i32 * t as i32 + n - 1, i as i32 * t as i32 + n)).transpose()
            })
            .collect::<mlx::Result<_>>()?;
        for j in 0..k_most {
            let mut next = Vec::with_capacity(self.seats.len());
            for (i, row) in rows.iter().enumerate() {
                let picked = match (row, &at[i]) {
                    (Some(r), Some(l)) if j < asks[*r].k => {
                        let ask = &asks[*r];
                        let logprobs = log_softmax(l)?;
                        let token = ask.sampler.sample(&logprobs, ask.seq.len() + j)?;
                        if ask.lossless {
                            dists[*r].push(ask.sampler.distribution(&logprobs)?);
                        }
                        tokens[*r].push(token.clone());
                        Some(token)
                    }
                    _ => None,
                };
                next.push(match picked {
                    Some(token) => token.astype(mlx::Dtype::Int32)?.reshape(&[1, 1])?,
                    None => Array::from_i32(&[pad], &[1, 1])?,
                });
            }
            if j + 1 == k_most {
                break;
            }
            let input = mlx::ops::concatenate(&next.iter().collect::<Vec<_>>(), 0)?;
            let logits = self.model.forward_batch(&input, &mut self.cache)?;
            self.forwards += 1;
            let logits = logits.reshape(&[s, vocab])?;
            for (i, l) in at.iter_mut().enumerate() {
                if l.is_some() {
                    *l = Some(logits.slice_axis(0, i as i32, i as i32 + 1)?);
                }
            }
        }
        let tokens: Vec<Array> = (tokens.iter())
            .map(|t| mlx::ops::concatenate(&t.iter().collect::<Vec<_>>(), 0))
            .collect::<mlx::Result<_>>()?;
        let dists: Vec<Option<Array>> = (dists.iter())
            .map(|d| (!d.is_empty()).then(|| mlx::ops::concatenate(&d.iter().collect::<Vec<_>>(), 0)).transpose())
            .collect::<mlx::Result<_>>()?;
        let mut outputs: Vec<&Array> = tokens.iter().chain(dists.iter().flatten()).collect();
        let state: Vec<&Array> = self.cache.iter().flat_map(BatchKvCache::state).collect();
        outputs.extend(state);
        mlx::eval(&outputs)?;
        // Every seat held its sequence; the drafting ones also their drafts but the last.
        for (seat, f) in self.seats.iter_mut().zip(&feed) {
            seat.held += f.len();
        }
        let mut out = Vec::with_capacity(asks.len());
        for (r, ask) in asks.iter().enumerate() {
            let seat = self.seats.iter_mut().find(|s| s.key == ask.key).expect("every ask has a seat");
            seat.last = Some((ask.seq.len(), ask.k));
            let ids = tokens[r].to_vec_i32()?.into_iter().map(|t| t as u32).collect();
            out.push(Drafts { tokens: ids, distributions: dists[r].clone() });
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
