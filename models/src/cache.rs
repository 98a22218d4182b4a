//! The per-layer key/value cache. Same layout and growth as mlx-lm's `KVCache`: buffers of
//! shape `[B, n_kv_heads, capacity, head_dim]` grown in steps of 256 positions, written with
//! `slice_update`, read as `[..., :offset, :]`. `trim(n)` drops the last `n` positions, which
//! is how speculative decoding rolls back rejected drafts.
//!
//! A sliding-window layer's cache is bounded ([`KvCache::windowed`]): where mlx-lm's
//! `RotatingKVCache` keeps exactly the window and so cannot roll back once it has wrapped,
//! this one keeps the window plus a rollback slack ([`SLACK`] positions) and, each time its
//! buffer is full, drops the positions before that instead of growing. The buffer then holds
//! positions `start..offset` (at most `window - 1 + slack` plus one allocation step), a
//! rollback of up to `slack` positions is always possible ([`trimmable`](KvCache::trimmable)
//! says how far exactly), and the copy that drops the old positions is paid once per step of
//! 256 appended positions, as a full cache's growth is.
//!
//! A recurrent layer's cache ([`KvCache::recurrent`], Qwen3.5's Gated DeltaNet layers) holds
//! a [`Recurrent`] state instead of keys and values, as mlx-lm's `ArraysCache`. A state
//! cannot be cut back by slicing, so the cache keeps snapshots: the states at its last few
//! offsets ([`keep_snapshots`](KvCache::keep_snapshots) says how many; 1 by default, so a
//! decode step in flight can be given back, as a batch row leaving or a generation handing
//! over does; speculative decoding keeps its verified window). A trim within them restores
//! one exactly; [`trimmable`](KvCache::trimmable) says how far that reaches. A trim past them
//! leaves the cache [`stale`](KvCache::stale), and using a stale one is an error. It also
//! keeps checkpoints, the states at chosen offsets further back ([`checkpoint`](KvCache::checkpoint):
//! the end of a prompt, every so many positions of a long one), so a prompt-cache entry can
//! resume a later request at any of them ([`reaches`](KvCache::reaches)).

use crate::{Error, Result};
use mlx::Array;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Columns a cache's buffer grows by (and a batch's buffer keeps free after a join).
pub const STEP: usize = 256;

/// Positions a sliding-window cache keeps beyond its window: the rollback it always allows
/// (speculative decoding drafts at most 64 tokens; a prompt-cache hit trims a few).
pub const SLACK: usize = 256;

pub struct KvCache {
    /// Positions `start..start + capacity`; those before `offset` are held.
    keys: Option<Array>,
    values: Option<Array>,
    /// Positions appended so far (the next one's index in the sequence).
    offset: usize,
    /// The first position the buffers hold (0 unless a window dropped the earlier ones).
    start: usize,
    /// The layer's sliding window, `None` for full attention (nothing is dropped).
    window: Option<usize>,
    /// Positions kept beyond the window, for rollbacks.
    slack: usize,
    /// Process-unique, so a tensor-parallel peer can mirror this cache (see [`mirror`]).
    id: u64,
    /// A recurrent layer's state, in place of keys and values (`None`: an attention layer).
    recurrent: Option<Recurrent>,
}

/// What a recurrent (linear-attention) layer carries from one position to the next: the
/// last `kernel - 1` inputs of its causal convolution (`[B, kernel - 1, channels]`) and its
/// recurrent state (`[B, value heads, value dim, key dim]`, float32); `None` before the first
/// position. Unlike keys and values, neither can be cut back to an earlier position: the
/// cache keeps [`snapshots`](Recurrent::snapshots) of the latest ones instead.
#[derive(Clone, Default)]
pub struct Recurrent {
    pub conv: Option<Array>,
    pub state: Option<Array>,
    /// A trim asked to drop positions: the state no longer matches the offset.
    stale: bool,
    /// The states at offsets `offset - snapshots.len() .. offset`, oldest first (the state
    /// at offset p holds the first p positions).
    snapshots: VecDeque<Snapshot>,
    /// How many snapshots to keep (`KvCache::keep_snapshots`; 0 is taken as 1).
    keep: usize,
    /// States at chosen offsets before the snapshots' (`KvCache::checkpoint`), by offset.
    checkpoints: Vec<(usize, Snapshot)>,
}

/// The most checkpoints a recurrent cache keeps (the oldest go first).
pub const MAX_CHECKPOINTS: usize = 16;

/// A recurrent state at one offset: its convolution's inputs and its recurrence's state
/// (`None` at offset 0).
#[derive(Clone, Default)]
pub struct Snapshot {
    pub conv: Option<Array>,
    pub state: Option<Array>,
}

impl Recurrent {
    /// The state held now, as a snapshot (the arrays shared, not copied).
    pub fn now(&self) -> Snapshot {
        Snapshot { conv: self.conv.clone(), state: self.state.clone() }
    }

    /// How many snapshots an update of the layer should give: the states at the offsets
    /// before each of its positions are wanted only while they number no more than this.
    pub fn keeps(&self) -> usize {
        self.keep.max(1)
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static MIRRORING: AtomicBool = AtomicBool::new(false);
static LOG: Mutex<Vec<CacheOp>> = Mutex::new(Vec::new());

/// What happened to caches since the last [`take_ops`], for a tensor-parallel peer that
/// keeps the same caches (its shard of every layer) by id. Appends need no entry (the peer
/// runs the same forward) and neither do a sequence's trims (each forward carries the offsets
/// it starts from); copies, frees and a batch's joins, leaves and trims do.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CacheOp {
    /// Cache `to` starts as a copy of cache `from`.
    Clone { from: u64, to: u64 },
    /// A cache or batch cache with this id is gone.
    Drop(u64),
    /// Batch cache `batch` (one layer's) gains a row: the first `offset` positions of cache
    /// `cache`.
    BatchPush { batch: u64, cache: u64, offset: usize },
    /// Batch cache `batch` drops row `row`.
    BatchRemove { batch: u64, row: usize },
    /// Cache `to` starts as a copy of row `row` of batch cache `batch`.
    BatchExtract { batch: u64, row: usize, to: u64 },
    /// Batch cache `batch` rolls back after a forward of `added` positions per row, row r
    /// keeping `kept[r]` of them (`BatchKvCache::trim_rows`).
    BatchTrim { batch: u64, added: usize, kept: Vec<usize> },
}

/// Starts recording [`CacheOp`]s (rank 0 of a tensor-parallel group does).
pub fn mirror() {
    MIRRORING.store(true, Ordering::SeqCst);
}

/// Whether this process records its cache operations for tensor-parallel peers ([`mirror`]):
/// caches made here must then exist on every rank.
pub fn mirrored() -> bool {
    MIRRORING.load(Ordering::Relaxed)
}

/// A buffer for positions to come, `shape` (`[B, H, columns, D]`), whose columns are written
/// before any forward reads them: unwritten (`Array::uninit`: the pages no row reaches are
/// never touched, where zeros cost a write and a fault per page at every join and growth), and
/// in debug builds NaN, so that a read of room anywhere shows in every test.
pub(crate) fn room(shape: &[usize], dtype: mlx::Dtype) -> Result<Array> {
    if cfg!(debug_assertions) {
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        return Ok(Array::scalar(f32::NAN, dtype)?.broadcast_to(&dims)?);
    }
    Ok(Array::uninit(shape, dtype)?)
}

/// The operations recorded since the last call.
pub fn take_ops() -> Vec<CacheOp> {
    std::mem::take(&mut *LOG.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A process-unique cache id (batch caches take theirs from the same counter).
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Logs the operation `op` builds, only while mirroring (a batch rollback's op carries a `Vec`,
/// built once per layer and verification otherwise for nothing).
pub(crate) fn record(op: impl FnOnce() -> CacheOp) {
    if MIRRORING.load(Ordering::Relaxed) {
        LOG.lock().unwrap_or_else(|e| e.into_inner()).push(op());
    }
}

/// The greatest offset at most `n` every layer's cache can be trimmed back to exactly
/// ([`KvCache::reaches`]); `None` when there is none.
pub fn reach(cache: &[KvCache], mut n: usize) -> Option<usize> {
    loop {
        let m = cache.iter().map(|c| c.reaches(n)).collect::<Option<Vec<_>>>()?.into_iter().min()?;
        if m == n || cache.iter().all(|c| c.reaches(m) == Some(m)) {
            return Some(m);
        }
        n = m;
    }
}

/// Drops the last `n` positions of every layer's cache (a speculative rollback); an error,
/// dropping nothing, when a sliding layer's cache cannot (a rollback longer than its slack).
pub fn roll_back(cache: &mut [KvCache], n: usize) -> Result<()> {
    if let Some(c) = cache.iter().find(|c| c.trimmable() < n) {
        let why = match &c.recurrent {
            Some(r) => format!("a recurrent layer's cache keeps states for only its last {}", r.keeps()),
            None => format!("a sliding-window layer's cache keeps only {} beyond its window", c.slack),
        };
        return Err(Error::Invalid(format!(
            "cannot roll back {n} positions: {why} (it can drop {}); draft fewer tokens",
            c.trimmable()
        )));
    }
    for c in cache {
        c.trim(n);
    }
    Ok(())
}

impl Default for KvCache {
    fn default() -> Self {
        KvCache {
            keys: None,
            values: None,
            offset: 0,
            start: 0,
            window: None,
            slack: SLACK,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            recurrent: None,
        }
    }
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let mut copy = self.empty_like();
        (copy.keys, copy.values, copy.start, copy.offset) =
            (self.keys.clone(), self.values.clone(), self.start, self.offset);
        copy.recurrent = self.recurrent.clone();
        record(|| CacheOp::Clone { from: self.id, to: copy.id });
        copy
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        record(|| CacheOp::Drop(self.id));
    }
}

/// What a layer's attention needs of its cache: append the new keys and values, get back
/// everything held. A single sequence's [`KvCache`] and a batch's
/// [`BatchKvCache`](crate::BatchKvCache) both are one.
pub trait LayerCache {
    /// Appends `keys`/`values` (`[B, H, L, D]`) and returns all keys and values so far.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)>;
}

impl LayerCache for KvCache {
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        KvCache::update_and_fetch(self, keys, values)
    }
}

impl KvCache {
    /// The cache of a layer attending over the last `window` positions (`None`: all of them).
    pub fn windowed(window: Option<usize>) -> KvCache {
        let mut cache = KvCache::default();
        cache.window = window;
        cache
    }

    /// The cache of a recurrent layer (a [`Recurrent`] state; no keys or values).
    pub fn recurrent() -> KvCache {
        let mut cache = KvCache::default();
        cache.recurrent = Some(Recurrent::default());
        cache
    }

    /// Whether this is a sliding-window layer's cache.
    pub fn is_windowed(&self) -> bool {
        self.window.is_some()
    }

    /// Whether this is a recurrent layer's cache.
    pub fn is_recurrent(&self) -> bool {
        self.recurrent.is_some()
    }

    /// Whether a trim asked this recurrent cache to drop positions it cannot: it is of no
    /// further use (not kept, not continued).
    pub fn stale(&self) -> bool {
        self.recurrent.as_ref().is_some_and(|r| r.stale)
    }

    /// A recurrent layer's state so far (an error for an attention layer's cache or a stale one).
    pub fn recurrent_state(&self) -> Result<&Recurrent> {
        match &self.recurrent {
            Some(r) if r.stale => Err(Error::Invalid(
                "a recurrent layer's state was asked to drop positions, which it cannot: \
                 it must be recomputed from the tokens"
                    .into(),
            )),
            Some(r) => Ok(r),
            None => Err(Error::Invalid("a recurrent layer was given an attention layer's cache".into())),
        }
    }

    /// A recurrent layer's state after `n` more positions. `before` are the states at the
    /// offsets before each of them (the first is the state held until now), given when
    /// `n <= keeps()`; otherwise empty, and the cache keeps no snapshot (the last ones are
    /// no longer next to the offset).
    pub fn set_recurrent(&mut self, conv: Array, state: Array, n: usize, before: Vec<Snapshot>) -> Result<()> {
        self.recurrent_state()?;
        let r = self.recurrent.as_mut().expect("checked above");
        if before.len() == n && n > 0 {
            r.snapshots.extend(before);
        } else {
            r.snapshots.clear();
        }
        while r.snapshots.len() > r.keeps() {
            r.snapshots.pop_front();
        }
        (r.conv, r.state) = (Some(conv), Some(state));
        self.offset += n;
        Ok(())
    }

    /// A recurrent layer's cache keeps the states at its last `n` offsets (at least 1), so a
    /// trim of up to `n` positions restores one; no effect on an attention layer's cache.
    /// Each snapshot holds a state's memory.
    pub fn keep_snapshots(&mut self, n: usize) {
        if let Some(r) = self.recurrent.as_mut() {
            r.keep = n.max(1);
            while r.snapshots.len() > r.keeps() {
                r.snapshots.pop_front();
            }
        }
    }

    /// Drops a recurrent cache's snapshots (it can no longer be trimmed): the memory of a
    /// cache kept for later, not rolled back.
    pub fn drop_snapshots(&mut self) {
        if let Some(r) = self.recurrent.as_mut() {
            r.snapshots.clear();
        }
    }

    /// A recurrent cache records its state at its offset as a checkpoint it can be trimmed
    /// back to later (at most [`MAX_CHECKPOINTS`], the oldest dropped); no effect on an
    /// attention layer's cache, which reaches every position it holds anyway.
    pub fn checkpoint(&mut self) {
        let offset = self.offset;
        let Some(r) = self.recurrent.as_mut().filter(|r| !r.stale) else { return };
        if offset == 0 || r.checkpoints.last().is_some_and(|&(at, _)| at >= offset) {
            return;
        }
        let now = r.now();
        r.checkpoints.push((offset, now));
        if r.checkpoints.len() > MAX_CHECKPOINTS {
            r.checkpoints.remove(0);
        }
    }

    /// The checkpoints' offsets, oldest first (none for an attention layer's cache).
    pub fn checkpoints(&self) -> Vec<usize> {
        self.recurrent.iter().flat_map(|r| r.checkpoints.iter().map(|&(at, _)| at)).collect()
    }

    /// The greatest offset at most `n` this cache can be trimmed back to exactly: for an
    /// attention layer any it holds (within a window's reach), for a recurrent one its
    /// offset, a snapshot's or a checkpoint's. `None` when there is none.
    pub fn reaches(&self, n: usize) -> Option<usize> {
        let Some(r) = &self.recurrent else {
            return (n + self.trimmable() >= self.offset).then_some(n.min(self.offset));
        };
        if r.stale {
            return r.checkpoints.iter().rev().map(|&(at, _)| at).find(|&at| at <= n);
        }
        if n >= self.offset {
            return Some(self.offset);
        }
        if n + r.snapshots.len() >= self.offset {
            return Some(n);
        }
        r.checkpoints.iter().rev().map(|&(at, _)| at).find(|&at| at <= n)
    }

    /// A recurrent cache's snapshots: the states before each of its last positions, oldest
    /// first (empty for an attention layer's).
    pub(crate) fn snapshots(&self) -> Vec<&Snapshot> {
        self.recurrent.as_ref().map_or_else(Vec::new, |r| r.snapshots.iter().collect())
    }

    /// The state at the offset before the last one of a recurrent cache (its snapshot), as
    /// a cache; `None` when it keeps none.
    pub(crate) fn last_snapshot(&self) -> Option<&Snapshot> {
        self.recurrent.as_ref().and_then(|r| r.snapshots.back())
    }

    /// A recurrent cache (this one's `keep`) holding `state` at `offset`, with `before` (if
    /// any) as the snapshot at `offset - 1`.
    pub(crate) fn with_recurrent(&self, state: Snapshot, offset: usize, before: Option<Snapshot>) -> KvCache {
        let mut cache = self.empty_like();
        let r = cache.recurrent.as_mut().expect("a recurrent cache");
        (r.conv, r.state) = (state.conv, state.state);
        r.snapshots.extend(before);
        cache.offset = offset;
        cache
    }

    /// A recurrent cache's checkpoints (a batch keeps them per row).
    pub(crate) fn checkpoint_states(&self) -> Vec<(usize, Snapshot)> {
        self.recurrent.as_ref().map(|r| r.checkpoints.clone()).unwrap_or_default()
    }

    /// Gives a recurrent cache `checkpoints` (those up to its offset).
    pub(crate) fn set_checkpoints(&mut self, mut checkpoints: Vec<(usize, Snapshot)>) {
        let offset = self.offset;
        if let Some(r) = self.recurrent.as_mut() {
            checkpoints.retain(|&(at, _)| at <= offset);
            r.checkpoints = checkpoints;
        }
    }

    /// With `slack` positions kept beyond the window instead of [`SLACK`] (no effect without
    /// a window): less memory, shorter rollbacks. Speculative decoding needs at least its
    /// draft length plus one.
    pub fn with_slack(mut self, slack: usize) -> KvCache {
        self.slack = slack;
        self
    }

    /// An empty cache with this one's window and slack (or an empty recurrent one keeping
    /// as many snapshots).
    pub fn empty_like(&self) -> KvCache {
        let mut cache = KvCache::default();
        (cache.window, cache.slack) = (self.window, self.slack);
        cache.recurrent = self.recurrent.as_ref().map(|r| Recurrent { keep: r.keep, ..Recurrent::default() });
        cache
    }

    /// A cache with this one's window and slack over buffers `keys`/`values`
    /// (`[B, H, capacity, D]`) holding positions `start..offset`.
    pub(crate) fn with_buffer(&self, keys: Array, values: Array, start: usize, offset: usize) -> KvCache {
        let mut cache = self.empty_like();
        (cache.keys, cache.values, cache.start, cache.offset) = (Some(keys), Some(values), start, offset);
        cache
    }

    /// The whole buffers, `[B, H, capacity, D]` each, columns past the held ones included.
    pub(crate) fn buffers(&self) -> Option<(&Array, &Array)> {
        self.keys.as_ref().zip(self.values.as_ref())
    }

    /// Positions the buffer takes before it grows (0 when it has none; a recurrent layer's
    /// state never grows).
    pub fn room(&self) -> usize {
        if self.recurrent.is_some() {
            return usize::MAX;
        }
        self.keys.as_ref().map_or(0, |k| k.dim(2) - (self.offset - self.start))
    }

    /// The positions held, `start()..offset()`: `[B, H, offset - start, D]` each (`None` when
    /// there are none).
    pub(crate) fn held(&self) -> Result<Option<(Array, Array)>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        if self.offset == self.start {
            return Ok(None);
        }
        let end = (self.offset - self.start) as i32;
        Ok(Some((k.slice_axis(2, 0, end)?, v.slice_axis(2, 0, end)?)))
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Positions appended (and not trimmed): the sequence's length.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The first position held: 0, or for a windowed cache where the older ones were dropped.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The layer's sliding window (`None` for full attention).
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// How many positions [`trim`](Self::trim) can drop: all of them, or for a windowed cache
    /// that has dropped its oldest, as many as leave a full window behind the next position,
    /// or for a recurrent one, as many as it keeps snapshots for.
    pub fn trimmable(&self) -> usize {
        if let Some(r) = &self.recurrent {
            return if r.stale { 0 } else { r.snapshots.len() };
        }
        match self.window {
            Some(w) if self.start > 0 => self.offset.saturating_sub(self.start + w - 1),
            _ => self.offset,
        }
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) and returns all keys and values so far.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if self.recurrent.is_some() {
            return Err(Error::Invalid("an attention layer was given a recurrent layer's cache".into()));
        }
        let prev = self.offset;
        let shape = keys.shape();
        let (b, h, l, dk) = (shape[0], shape[1], shape[2], shape[3]);
        let dv = values.dim(3);
        let capacity = self.keys.as_ref().map_or(0, |k| k.dim(2));
        let held = prev - self.start;
        if self.keys.is_none() || held + l > capacity {
            // A window drops what no query of this forward or after a rollback of `slack`
            // can see: positions before `prev - (window - 1) - slack`.
            let start = match self.window {
                Some(w) => self.start.max(prev.saturating_sub(w - 1 + self.slack)),
                None => self.start,
            };
            let n_steps = (STEP + l - 1) / STEP;
            let (lo, hi) = ((start - self.start) as i32, held as i32);
            // The positions kept, then room for `n_steps * STEP` more, unwritten (`room`).
            let grown = |a: Option<Array>, d: usize, dtype: mlx::Dtype| -> Result<Array> {
                let kept = a.filter(|_| lo < hi).map(|a| a.slice_axis(2, lo, hi)).transpose()?;
                let n = kept.as_ref().map_or(0, |k| k.dim(2));
                let out = room(&[b, h, n + n_steps * STEP, d], dtype)?;
                Ok(match kept {
                    Some(k) => {
                        out.slice_update(&k, &[0, 0, 0, 0], &[b as i32, h as i32, n as i32, d as i32], &[1; 4])?
                    }
                    None => out,
                })
            };
            self.keys = Some(grown(self.keys.take(), dk, keys.dtype())?);
            self.values = Some(grown(self.values.take(), dv, values.dtype())?);
            self.start = start;
        }
        self.offset += l;
        let (from, to) = ((prev - self.start) as i32, (self.offset - self.start) as i32);
        let (start, stop) = ([0, 0, from, 0], [b as i32, h as i32, to]);
        let k = self.keys.as_ref().expect("allocated above");
        let v = self.values.as_ref().expect("allocated above");
        let k = k.slice_update(keys, &start, &[stop[0], stop[1], stop[2], dk as i32], &[1, 1, 1, 1])?;
        let v = v.slice_update(values, &start, &[stop[0], stop[1], stop[2], dv as i32], &[1, 1, 1, 1])?;
        let fetched = if (to as usize) < k.dim(2) {
            (k.slice_axis(2, 0, to)?, v.slice_axis(2, 0, to)?)
        } else {
            (k.clone(), v.clone())
        };
        self.keys = Some(k);
        self.values = Some(v);
        Ok(fetched)
    }

    /// A cache for scoring `batch` continuations of this one at once: every row starts as a
    /// copy of this cache's positions (the copy is made when the fork is first appended to).
    /// This cache is unchanged; [`adopt_row`](Self::adopt_row) takes one row's new positions
    /// back. Not mirrored to tensor-parallel peers: single-process models only.
    pub fn fork_batch(&self, batch: usize) -> Result<KvCache> {
        if self.recurrent.is_some() {
            return Err(Error::Invalid("a recurrent layer's cache cannot be forked for a batch yet".into()));
        }
        let mut fork = self.empty_like();
        fork.offset = self.offset;
        fork.start = self.start;
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            let held = |a: &Array| -> Result<Array> {
                let a = a.slice_axis(2, 0, (self.offset - self.start) as i32)?;
                let mut shape: Vec<i32> = a.shape().iter().map(|&d| d as i32).collect();
                shape[0] = batch as i32;
                Ok(a.broadcast_to(&shape)?)
            };
            fork.keys = Some(held(k)?);
            fork.values = Some(held(v)?);
        }
        Ok(fork)
    }

    /// Appends to this cache the positions `self.offset()..self.offset() + n` of row `row` of
    /// `fork` (a [`fork_batch`](Self::fork_batch) of this cache that has been appended to).
    pub fn adopt_row(&mut self, fork: &KvCache, row: usize, n: usize) -> Result<()> {
        let (Some(k), Some(v)) = (&fork.keys, &fork.values) else {
            return Err(Error::Invalid("adopt_row: the fork holds nothing".into()));
        };
        let (start, stop) = (self.offset, self.offset + n);
        if fork.offset < stop || fork.start > start || row >= k.dim(0) {
            return Err(Error::Invalid(format!(
                "adopt_row: row {row}, positions {start}..{stop} are not in a fork of {} rows holding {}..{}",
                k.dim(0),
                fork.start,
                fork.offset
            )));
        }
        let (lo, hi) = ((start - fork.start) as i32, (stop - fork.start) as i32);
        let take =
            |a: &Array| -> Result<Array> { Ok(a.slice_axis(0, row as i32, row as i32 + 1)?.slice_axis(2, lo, hi)?) };
        self.update_and_fetch(&take(k)?, &take(v)?)?;
        Ok(())
    }

    /// Drops the last `n` positions (at most [`trimmable`](Self::trimmable) of them); returns
    /// how many were dropped.
    /// A recurrent cache restores its snapshot at `offset - n`; asked to drop more than it
    /// keeps snapshots for, it takes them off its offset (so every layer's offset agrees)
    /// and goes [`stale`](Self::stale).
    pub fn trim(&mut self, n: usize) -> usize {
        if let Some(r) = self.recurrent.as_mut() {
            let n = n.min(self.offset);
            if n == 0 {
                return 0;
            }
            let to = self.offset - n;
            if n <= r.snapshots.len() && !r.stale {
                r.snapshots.truncate(r.snapshots.len() - n + 1);
                let back = r.snapshots.pop_back().expect("n >= 1 snapshots");
                (r.conv, r.state) = (back.conv, back.state);
            } else if let Some((_, back)) = r.checkpoints.iter().find(|&&(at, _)| at == to) {
                // (A checkpoint holds a state from before any trim that went stale; it is
                // kept, sharing the state now held.)
                (r.conv, r.state, r.stale) = (back.conv.clone(), back.state.clone(), false);
                r.snapshots.clear();
            } else {
                r.stale = true;
                r.snapshots.clear();
            }
            r.checkpoints.retain(|&(at, _)| at <= to);
            self.offset = to;
            return n;
        }
        let n = n.min(self.trimmable());
        self.offset -= n;
        n
    }

    /// The arrays to evaluate to materialize the cache.
    pub fn state(&self) -> Vec<&Array> {
        let recurrent = self.recurrent.iter().flat_map(|r| {
            let kept = r.snapshots.iter().chain(r.checkpoints.iter().map(|(_, s)| s));
            let kept = kept.flat_map(|s| s.conv.iter().chain(s.state.iter()));
            r.conv.iter().chain(r.state.iter()).chain(kept)
        });
        self.keys.iter().chain(self.values.iter()).chain(recurrent).collect()
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(|a| a.nbytes()).sum()
    }
}
