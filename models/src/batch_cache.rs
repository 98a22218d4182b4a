//! The key/value cache of a batch of sequences decoded together, in mlx-lm's
//! `BatchKVCache` layout: one buffer `[B, n_kv_heads, capacity, head_dim]` per layer whose
//! rows are right-aligned, so a row holding fewer positions than the longest is padded on
//! the left (masked out of attention, and its RoPE positions start from its own length).
//! Every row appends at the same index, so a decode step is one `slice_update` per layer
//! for the whole batch, whatever the rows' lengths. The buffer is a [`KvCache`] of B rows
//! (its growth and writes are a single sequence's); this type adds the rows' padding.
//!
//! Rows join from single sequences' [`KvCache`]s ([`push_all`](BatchKvCache::push_all), all
//! of a turn's joins in one copy) and leave ([`remove`](BatchKvCache::remove)), optionally
//! handing their positions back as a [`KvCache`] first ([`extract`](BatchKvCache::extract));
//! both copy the buffer, which is paid once per join or leave, not per step, and keep room
//! for the steps after (else the next step would grow the buffer by a second copy). Leaving
//! also drops the left padding no remaining row needs.
//!
//! A recurrent layer's batch (Qwen3.5's Gated DeltaNet) stacks its rows' states (convolution
//! inputs and recurrence state, one row each; a row with no position yet holds zeros, which
//! is what a fresh state means) and keeps the padding bookkeeping the attention layers keep,
//! so every layer agrees on the rows' lengths. Its state has no positions to slice, so a row
//! leaving while a step is in flight takes its state from before that step: the batch keeps
//! the states at its last offset but one ([`extract_before_step`](BatchKvCache::extract_before_step)).
//!
//! Speculative rows roll back by their own amounts ([`trim_rows`](BatchKvCache::trim_rows)):
//! after a forward of T positions per row, each row keeps its first few, the buffer is cut to
//! the row that kept most, and in every other row the columns it rejected become *holes*,
//! masked out of attention as padding is, until enough of them gather that the rows are
//! compacted in one gather (the cost of a buffer's growth, paid once per many steps).
//! Chosen over keeping the rows right-aligned by shifting each row after every verification
//! (a copy of the row's whole KV per step) and over a left-aligned layout (per-row scattered
//! writes in every plain step). Holes are for attention layers: a recurrent layer refuses a
//! ragged trim. A sliding layer's rows with holes hold their last `window` positions in more
//! than `window` columns, so it masks its window by position (`key_distance`) and holes are
//! compacted before they outgrow the columns its cache keeps beyond the window.
//!
//! A sliding-window layer's batch is bounded as its rows' caches are: the buffer's columns
//! are numbered from the first ever written, and the buffer holds columns `start..width`
//! (see `KvCache::windowed`), so a row's padding and length keep their meaning when the
//! oldest columns go.

use crate::cache::{next_id, record, CacheOp, KvCache, LayerCache, Snapshot, STEP};
use crate::{Error, Result};
use mlx::{Array, Dtype};

pub struct BatchKvCache {
    /// Every row's positions, padding included: its offset is the index all rows write at.
    buffer: KvCache,
    /// Row r's first `left_padding[r]` positions are padding.
    left_padding: Vec<usize>,
    /// Process-unique (from the same counter as `KvCache`'s), so a tensor-parallel peer can
    /// mirror the batch: joins, leaves and extractions are recorded as `CacheOp`s.
    id: u64,
    /// A recurrent layer's rows' checkpoints (`KvCache::checkpoint`), given back on extraction.
    checkpoints: Vec<Vec<(usize, Snapshot)>>,
    /// Row r's holes: column ranges `[from, to)` past its padding that hold no position of
    /// its own (drafts it rejected while another row accepted more), in column order.
    holes: Vec<Vec<(usize, usize)>>,
    /// A recurrent layer's rows' ends in the next forward ([`end_rows_at`](Self::end_rows_at)),
    /// until the forward takes them; then the ends it ran to, until `trim_rows` drops the
    /// padding after them.
    ends: Ends,
}

/// Where a recurrent layer's rows end in a forward whose shorter rows are padded after their
/// last position (prompts prefilled together).
#[derive(Default, Clone, PartialEq, Debug)]
enum Ends {
    #[default]
    Full,
    /// Set for the next forward.
    Next(Vec<usize>),
    /// The last forward left each row's state at its end.
    Ran(Vec<usize>),
}

/// Holes past which a batch is compacted: this many columns in one row (or an eighth of the
/// buffer's width, if more, up to [`MAX_HOLES`]), or a quarter of the columns held over all
/// rows. A hole costs a masked column of attention; a compaction a copy of the buffers.
const COMPACT_HOLES: usize = 32;

/// The most hole columns a row keeps after a trim. A sliding layer's row must find its last
/// `window` positions among the columns its cache keeps (`window - 1 + cache::SLACK`), so
/// its holes stay well inside the slack. The same for every layer, so all compact together.
const MAX_HOLES: usize = 64;

// A sliding row's window must stay inside what its layer keeps (the window less one, plus
// SLACK) after its holes and a verification's new positions (speculation drafts at most 64):
// what a compaction puts before a row's held columns is then older than any window reaches.
const _: () = assert!(MAX_HOLES + 2 * 65 < crate::cache::SLACK);

impl Default for BatchKvCache {
    fn default() -> Self {
        BatchKvCache {
            buffer: KvCache::default(),
            left_padding: Vec::new(),
            id: next_id(),
            checkpoints: Vec::new(),
            holes: Vec::new(),
            ends: Ends::Full,
        }
    }
}

impl Drop for BatchKvCache {
    fn drop(&mut self) {
        record(|| CacheOp::Drop(self.id));
    }
}

/// Row-stacked recurrent state: `batch` (`rows` rows, or nothing) with `row` (one row, or
/// nothing) as its last; the side that has nothing gets zeros shaped like the other.
fn stack(batch: Option<&Array>, rows: usize, row: Option<&Array>) -> Result<Option<Array>> {
    let zeros = |like: &Array, n: usize| -> Result<Array> {
        let mut shape = like.shape();
        shape[0] = n;
        Ok(Array::zeros(&shape, like.dtype())?)
    };
    Ok(match (batch.filter(|_| rows > 0), row) {
        (None, None) => None,
        (None, Some(r)) if rows == 0 => Some(r.clone()),
        (None, Some(r)) => Some(mlx::ops::concatenate(&[&zeros(r, rows)?, r], 0)?),
        (Some(b), None) => Some(mlx::ops::concatenate(&[b, &zeros(b, 1)?], 0)?),
        (Some(b), Some(r)) => Some(mlx::ops::concatenate(&[b, r], 0)?),
    })
}

/// The rows `keep` (int32 indices) of a row-stacked recurrent state, copied.
fn rows_of(s: &Snapshot, keep: &Array) -> Result<Snapshot> {
    let take = |a: &Option<Array>| -> Result<Option<Array>> {
        a.as_ref().map(|a| Ok(a.take(keep, 0)?.contiguous()?)).transpose()
    };
    Ok(Snapshot { conv: take(&s.conv)?, state: take(&s.state)? })
}

impl BatchKvCache {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether this is a recurrent layer's batch (its rows' states, no keys or values).
    pub fn is_recurrent(&self) -> bool {
        self.buffer.is_recurrent()
    }

    /// A recurrent layer's stacked state, for its forward to update (one position per row).
    pub(crate) fn recurrent_mut(&mut self) -> Result<&mut KvCache> {
        if !self.buffer.is_recurrent() {
            return Err(Error::Invalid("a recurrent layer was given an attention layer's batch cache".into()));
        }
        Ok(&mut self.buffer)
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.left_padding.len()
    }

    /// Positions row `row` holds (its sequence length so far).
    pub fn len(&self, row: usize) -> usize {
        self.width() - self.left_padding[row] - self.hole_columns(row)
    }

    /// Columns of row `row` that are holes.
    fn hole_columns(&self, row: usize) -> usize {
        self.holes[row].iter().map(|(a, b)| b - a).sum()
    }

    /// A recurrent layer's batch keeps the states before each of the last `n` positions of a
    /// forward (at least 1), so rows can roll back that far (`trim_rows`); no effect on an
    /// attention layer's.
    pub fn keep_snapshots(&mut self, n: usize) {
        self.buffer.keep_snapshots(n);
    }

    /// In the next forward of `added` positions per row, row r's real positions are its first
    /// `ends[r]`; the rest are padding that a `trim_rows(added, ends)` will drop. A recurrent
    /// layer's forward ([`take_row_ends`](Self::take_row_ends)) then leaves each row's state as
    /// it was at its end (the padding neither writes nor decays it), so the trim needs no
    /// snapshots. No effect on an attention layer's batch, whose trim drops the columns.
    pub fn end_rows_at(&mut self, ends: &[usize]) {
        if self.buffer.is_recurrent() {
            self.ends = Ends::Next(ends.to_vec());
        }
    }

    /// The rows' ends set for this forward by [`end_rows_at`](Self::end_rows_at), for a
    /// recurrent layer's forward to honour (it must, if it takes them).
    pub fn take_row_ends(&mut self) -> Option<Vec<usize>> {
        match std::mem::take(&mut self.ends) {
            Ends::Next(ends) => {
                self.ends = Ends::Ran(ends.clone());
                Some(ends)
            }
            _ => None,
        }
    }

    /// Whether this is a sliding-window layer's batch.
    pub fn is_windowed(&self) -> bool {
        self.buffer.is_windowed()
    }

    /// Whether any row has holes.
    pub fn has_holes(&self) -> bool {
        self.holes.iter().any(|h| !h.is_empty())
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.left_padding.is_empty()
    }

    /// Buffer positions per row, padding included (and those a window dropped).
    pub fn width(&self) -> usize {
        self.buffer.offset()
    }

    /// The first column the buffer holds (0 unless a window dropped the older ones).
    pub fn start(&self) -> usize {
        self.buffer.start()
    }

    /// Each row's length, int32 `[B]`: where its next position starts (RoPE offsets).
    pub fn offsets(&self) -> Result<Array> {
        let lengths: Vec<i32> = (0..self.rows()).map(|r| self.len(r) as i32).collect();
        Ok(Array::from_i32(&lengths, &[lengths.len()])?)
    }

    /// The attention mask of a forward of one new position per row over the columns held:
    /// boolean `[B, 1, 1, width + 1 - start]`, false on each row's padding; `None` when no row
    /// is padded.
    pub fn mask(&self) -> Result<Option<Array>> {
        self.mask_for(1)
    }

    /// The attention mask of a forward of `len` new positions per row: boolean
    /// `[B, 1, len, width + len - start]`, false on each row's padding and holes, and causal
    /// over the new positions; `None` when one position needs no mask (no padding, no hole).
    pub fn mask_for(&self, len: usize) -> Result<Option<Array>> {
        let holes = self.has_holes();
        if len == 1 && !holes && self.left_padding.iter().all(|&p| p == 0) {
            return Ok(None);
        }
        let b = self.rows();
        let (from, width) = (self.start(), self.width());
        let n = width + len - from;
        let held = if holes {
            let mut keep = vec![1i32; b * n];
            for (r, row) in keep.chunks_mut(n).enumerate() {
                let pad = self.left_padding[r].saturating_sub(from).min(n);
                row[..pad].fill(0);
                for &(a, z) in &self.holes[r] {
                    row[a.max(from) - from..z.max(from) - from].fill(0);
                }
            }
            Array::from_i32(&keep, &[b, n])?.astype(Dtype::Bool)?
        } else {
            let cols = Array::arange(from as f64, (width + len) as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
            let pads: Vec<i32> = self.left_padding.iter().map(|&p| p as i32).collect();
            cols.greater_equal(&Array::from_i32(&pads, &[b, 1])?)?
        };
        let held = held.reshape(&[b as i32, 1, 1, n as i32])?;
        if len == 1 {
            return Ok(Some(held));
        }
        // New position q sees the held columns and the new ones up to itself.
        let q = Array::arange(0.0, len as f64, 1.0, Dtype::Int32)?.reshape(&[len as i32, 1])?;
        let c = Array::arange(from as f64 - width as f64, len as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
        let causal = c.less(&q.add(&Array::scalar(1.0, Dtype::Int32)?)?)?.reshape(&[1, 1, len as i32, n as i32])?;
        Ok(Some(held.logical_and(&causal)?))
    }

    /// After a forward of `added` positions per row: row r keeps the first `kept[r]` of them
    /// (its committed tokens; a speculative row's rejected drafts go). The buffer is cut to
    /// the row that kept most; the others' rejected columns become holes (compacted once
    /// they gather, `COMPACT_HOLES`). A recurrent layer has no columns to leave: each row
    /// takes the state after its own kept positions, from the states the forward kept before
    /// each of them (`keep_snapshots` at least `added`; an error otherwise), and keeps the
    /// holes' bookkeeping so every layer agrees on the rows' lengths. Recorded for
    /// tensor-parallel peers, which repeat it on their shards (the same holes, compacted at
    /// the same step).
    pub fn trim_rows(&mut self, added: usize, kept: &[usize]) -> Result<()> {
        if kept.len() != self.rows() || kept.iter().any(|&k| k > added) || added > self.width() {
            return Err(Error::Invalid(format!(
                "a ragged trim of {} rows keeping {kept:?} of {added} new positions, over a batch of {} rows {} wide",
                kept.len(),
                self.rows(),
                self.width()
            )));
        }
        let most = kept.iter().copied().max().unwrap_or(0);
        let uniform = kept.iter().all(|&k| k == most);
        let ends = std::mem::take(&mut self.ends);
        record(|| CacheOp::BatchTrim { batch: self.id, added, kept: kept.to_vec() });
        if uniform {
            self.buffer.trim(added - most);
            return Ok(());
        }
        if self.buffer.is_recurrent() {
            let width = self.width() - (added - most);
            match ends {
                // The forward left every row's state at its end already.
                Ends::Ran(ends) if ends == kept => {
                    let now = self.buffer.recurrent_state()?.now();
                    self.buffer = self.buffer.with_recurrent(now, width, None);
                }
                _ => self.pick_states(added, kept, width)?,
            }
        } else {
            self.buffer.trim(added - most);
        }
        let end = self.width();
        for (holes, &k) in self.holes.iter_mut().zip(kept) {
            if k == most {
                continue;
            }
            let from = end - (most - k);
            match holes.last_mut() {
                Some(last) if last.1 == from => last.1 = end,
                _ => holes.push((from, end)),
            }
        }
        let in_holes: usize = (0..self.rows()).map(|r| self.hole_columns(r)).sum();
        let worst = (0..self.rows()).map(|r| self.hole_columns(r)).max().unwrap_or(0);
        if worst >= (self.width() / 8).clamp(COMPACT_HOLES, MAX_HOLES) || in_holes * 4 >= self.width() * self.rows() {
            self.compact()?;
        }
        Ok(())
    }

    /// A recurrent layer's rows after a forward of `added` positions: row r's state is the
    /// one before its position `kept[r]` (the forward's snapshots), or the state now where it
    /// kept them all; the batch is then `width` wide.
    fn pick_states(&mut self, added: usize, kept: &[usize], width: usize) -> Result<()> {
        let now = self.buffer.recurrent_state()?.now();
        let before = self.buffer.snapshots();
        if before.len() < added {
            return Err(Error::Invalid(format!(
                "a recurrent layer kept its states before {} of the {added} positions it was asked to roll back over (keep_snapshots)",
                before.len()
            )));
        }
        let first = before.len() - added;
        let rows = self.rows() as i32;
        let index: Vec<i32> = kept.iter().map(|&k| k as i32).collect();
        let pick = |part: fn(&Snapshot) -> Option<&Array>| -> Result<Array> {
            let missing = || Error::Invalid("a recurrent batch row has no state to roll back to".into());
            let states: Vec<Array> = (0..=added)
                .map(|k| {
                    let s = if k < added { part(before[first + k]) } else { part(&now) };
                    Ok(s.ok_or_else(missing)?.expand_dims(&[0])?)
                })
                .collect::<Result<_>>()?;
            let all = mlx::ops::concatenate(&states.iter().collect::<Vec<_>>(), 0)?;
            let mut shape = vec![1i32; all.ndim()];
            shape[1] = rows;
            let at = Array::from_i32(&index, &[index.len()])?.reshape(&shape)?;
            let mut full: Vec<i32> = all.shape().iter().map(|&d| d as i32).collect();
            full[0] = 1;
            Ok(all.take_along_axis(&at.broadcast_to(&full)?, 0)?.squeeze(&[0])?)
        };
        let state = Snapshot { conv: Some(pick(|s| s.conv.as_ref())?), state: Some(pick(|s| s.state.as_ref())?) };
        self.buffer = self.buffer.with_recurrent(state, width, None);
        Ok(())
    }

    /// For a forward of `len` new positions per row: each new query's position less each key
    /// column's (int32 `[B, 1, len, width + len - start]`, the columns `mask_for` masks), which a
    /// sliding layer compares with its window. A row's columns are its positions in order, but
    /// for padding and holes (their values are of no use: the mask hides them).
    pub fn key_distance(&self, len: usize) -> Result<Array> {
        let (b, from, width) = (self.rows(), self.start(), self.width());
        let n = width + len - from;
        let lens: Vec<usize> = (0..b).map(|r| self.len(r)).collect();
        let mut at = vec![0i32; b * n];
        for (r, row) in at.chunks_mut(n.max(1)).enumerate().take(b) {
            // The held columns are the row's last positions, in order; the new ones follow.
            let cols = self.row_columns(r);
            let first = lens[r] - cols.len();
            for (i, &c) in cols.iter().enumerate() {
                row[c as usize] = (first + i) as i32;
            }
            for (j, slot) in row[width - from..].iter_mut().enumerate() {
                *slot = (lens[r] + j) as i32;
            }
        }
        let keys = Array::from_i32(&at, &[b, 1, 1, n])?;
        let queries: Vec<i32> = lens.iter().flat_map(|&l| (0..len).map(move |i| (l + i) as i32)).collect();
        Ok(Array::from_i32(&queries, &[b, 1, len, 1])?.subtract(&keys)?)
    }

    /// Each row's held columns, in order: past its padding, outside its holes.
    fn row_columns(&self, row: usize) -> Vec<i32> {
        let (pad, start) = (self.left_padding[row], self.start());
        let mut holes = self.holes[row].iter().peekable();
        let mut cols = Vec::with_capacity(self.len(row));
        let mut c = pad.max(start);
        while c < self.width() {
            match holes.peek() {
                Some(&&(a, z)) if c >= a => {
                    c = c.max(z);
                    holes.next();
                }
                _ => {
                    cols.push((c - start) as i32);
                    c += 1;
                }
            }
        }
        cols
    }

    /// Gathers every row's positions right-aligned again, without holes (one gather of the
    /// buffers).
    fn compact(&mut self) -> Result<()> {
        let rows = self.rows();
        let lens: Vec<usize> = (0..rows).map(|r| self.len(r)).collect();
        let width = lens.iter().copied().max().unwrap_or(0);
        if self.buffer.is_recurrent() {
            // No columns: only the bookkeeping every layer shares.
            let now = self.buffer.recurrent_state()?.now();
            self.buffer = self.buffer.with_recurrent(now, width, None);
            self.left_padding = lens.iter().map(|&l| width - l).collect();
            self.holes.iter_mut().for_each(Vec::clear);
            return Ok(());
        }
        let Some((k, v)) = self.buffer.held()? else { return Ok(()) };
        // A sliding layer whose oldest positions are gone holds fewer columns than positions:
        // each row's held ones end the new buffer, which starts `held` columns before its end.
        // A row holding fewer than the widest gets, before its own, copies of its first
        // column: positions older than its window keeps (it held its window and the slack
        // less its holes, `MAX_HOLES`), which no query of it sees.
        let columns: Vec<Vec<i32>> = (0..rows).map(|r| self.row_columns(r)).collect();
        let held = columns.iter().map(Vec::len).max().unwrap_or(0);
        let mut index = vec![0i32; rows * held];
        for (out, cols) in index.chunks_mut(held.max(1)).zip(&columns) {
            let fill = cols.first().copied().unwrap_or(0);
            out[..held - cols.len()].fill(fill);
            out[held - cols.len()..].copy_from_slice(cols);
        }
        let index = Array::from_i32(&index, &[rows, 1, held, 1])?;
        let gather = |a: &Array| -> Result<Array> {
            let shape = [rows as i32, a.dim(1) as i32, held as i32, a.dim(3) as i32];
            Ok(a.take_along_axis(&index.broadcast_to(&shape)?, 2)?)
        };
        self.buffer = self.buffer.with_buffer(gather(&k)?, gather(&v)?, width - held, width);
        self.left_padding = lens.iter().map(|&l| width - l).collect();
        self.holes.iter_mut().for_each(Vec::clear);
        Ok(())
    }

    /// Adds a row holding `cache`'s positions (one sequence's cache of this layer) as the
    /// last row: [`push_all`](Self::push_all) of one row, with the room a step's growth gives.
    pub fn push(&mut self, cache: &KvCache) -> Result<()> {
        self.push_all(&[cache], STEP)
    }

    /// Adds rows holding `caches`' positions (each one sequence's cache of this layer) after
    /// the batch's rows, in one copy of the buffer that leaves room for the next `room`
    /// positions (`STEP` for decoding, as a step's growth would; for a prefill's forward, its
    /// length; the spare columns unwritten, `cache::room`). The forward after the join then writes
    /// in place rather than growing the buffer by a second copy (eight chat requests joining
    /// at once on the 2-core CPU: their first step 122 ms with a copy per row and the growth,
    /// 34-41 ms after one copy with room). The shorter of the batch and each row is padded on
    /// the left. Where a window dropped the oldest positions of a side, the joined buffer
    /// starts at the latest first column held (what it cuts of the others is outside every
    /// window).
    pub fn push_all(&mut self, caches: &[&KvCache], room: usize) -> Result<()> {
        for cache in caches {
            record(|| CacheOp::BatchPush { batch: self.id, cache: cache.id(), offset: cache.offset() });
        }
        let Some(last) = caches.last() else { return Ok(()) };
        if last.is_recurrent() {
            for cache in caches {
                let (width, target) = (self.width(), self.width().max(cache.offset()));
                self.push_recurrent(cache, target)?;
                self.pad_rows(target - width);
                self.left_padding.push(target - cache.offset());
                self.holes.push(Vec::new());
            }
            return Ok(());
        }
        let width = self.width();
        let target = caches.iter().map(|c| c.offset()).fold(width, usize::max);
        // The first column each side holds in the joined buffer (0 when it holds all of its
        // own: the columns before are padding).
        let first = |start: usize, len: usize| if start > 0 { start + target - len } else { 0 };
        let from = caches.iter().map(|c| first(c.start(), c.offset())).fold(first(self.start(), width), usize::max);
        let held = target - from;
        let rows = self.rows();
        // (first row, rows, keys and values) of each side holding positions.
        let mut parts: Vec<(usize, usize, (Array, Array))> = Vec::new();
        if let Some(old) = self.buffer.held()? {
            parts.push((0, rows, old));
        }
        for (i, cache) in caches.iter().enumerate() {
            if let Some(new) = cache.held()? {
                parts.push((rows + i, 1, new));
            }
        }
        let Some((_, _, (like_k, like_v))) = parts.first() else {
            self.buffer = last.empty_like();
            self.pad_rows(target - width);
            self.left_padding.extend(caches.iter().map(|c| target - c.offset()));
            self.holes.extend(caches.iter().map(|_| Vec::new()));
            return Ok(());
        };
        // Each side's last `held` columns written at the right end of its rows, zeros before
        // them (padding: masked, but read; a row holding nothing is all padding), the `room`
        // columns after unwritten: one buffer, written in place (MLX donates each update's
        // input to its output), each column once.
        let capacity = held + room;
        let all = rows + caches.len();
        let fill = |like: &Array, pick: fn(&(Array, Array)) -> &Array| -> Result<Array> {
            let (h, d) = (like.dim(1), like.dim(3));
            let mut out = crate::cache::room(&[all, h, capacity, d], like.dtype())?;
            let mut write = |a: &Array, row: usize, at: usize| -> Result<()> {
                let (n, w) = (a.dim(0), a.dim(2));
                let stop = [(row + n) as i32, h as i32, (at + w) as i32, d as i32];
                out = out.slice_update(a, &[row as i32, 0, at as i32, 0], &stop, &[1, 1, 1, 1])?;
                Ok(())
            };
            let mut bare = vec![true; all];
            for (row, n, side) in &parts {
                let a = pick(side);
                let have = a.dim(2);
                let a = if have > held { a.slice_axis(2, (have - held) as i32, have as i32)? } else { a.clone() };
                let at = held - a.dim(2);
                if at > 0 {
                    write(&Array::zeros(&[*n, h, at, d], like.dtype())?, *row, 0)?;
                }
                write(&a, *row, at)?;
                bare[*row..*row + *n].iter_mut().for_each(|b| *b = false);
            }
            for row in (0..all).filter(|&r| bare[r] && held > 0) {
                write(&Array::zeros(&[1, h, held, d], like.dtype())?, row, 0)?;
            }
            Ok(out)
        };
        let (k, v) = (fill(like_k, |s| &s.0)?, fill(like_v, |s| &s.1)?);
        self.buffer = last.with_buffer(k, v, from, target);
        self.pad_rows(target - width);
        self.left_padding.extend(caches.iter().map(|c| target - c.offset()));
        self.holes.extend(caches.iter().map(|_| Vec::new()));
        Ok(())
    }

    /// The rows' positions moved `by` columns right (the batch widened on the left).
    fn pad_rows(&mut self, by: usize) {
        for p in &mut self.left_padding {
            *p += by;
        }
        for (a, z) in self.holes.iter_mut().flatten() {
            (*a, *z) = (*a + by, *z + by);
        }
    }

    /// A recurrent layer's `push`: the row's state stacked under the batch's, the batch
    /// `target` positions wide. The snapshot before the last step gains the row's current
    /// state, which no one reads (the row took no part in that step).
    fn push_recurrent(&mut self, cache: &KvCache, target: usize) -> Result<()> {
        let row = cache.recurrent_state()?;
        let rows = self.rows();
        let mine = match rows {
            0 => Snapshot::default(),
            _ => self.buffer.recurrent_state()?.now(),
        };
        let joined = |batch: &Snapshot| -> Result<Snapshot> {
            Ok(Snapshot {
                conv: stack(batch.conv.as_ref(), rows, row.conv.as_ref())?,
                state: stack(batch.state.as_ref(), rows, row.state.as_ref())?,
            })
        };
        let state = joined(&mine)?;
        self.checkpoints.push(cache.checkpoint_states());
        let before = match (rows, self.buffer.last_snapshot()) {
            (0, _) | (_, None) => None,
            (_, Some(s)) => Some(joined(s)?),
        };
        self.buffer = KvCache::recurrent().with_recurrent(state, target, before);
        Ok(())
    }

    /// Row `row`'s cache as it was before the last step (the step in flight, which the row
    /// took part in, is given back): its positions but the last, and for a recurrent layer
    /// its state before that step.
    pub fn extract_before_step(&self, row: usize) -> Result<KvCache> {
        if !self.buffer.is_recurrent() {
            let mut cache = self.extract(row)?;
            cache.trim(1);
            return Ok(cache);
        }
        self.check_row(row)?;
        let Some(before) = self.buffer.last_snapshot() else {
            return Err(Error::Invalid(format!(
                "batch row {row} cannot give back its last step: the recurrent layer kept no state from before it"
            )));
        };
        let keep = Array::from_i32(&[row as i32], &[1])?;
        let mut cache = self.buffer.with_recurrent(rows_of(before, &keep)?, self.len(row) - 1, None);
        cache.set_checkpoints(self.checkpoints[row].clone());
        record(|| CacheOp::BatchExtract { batch: self.id, row, to: cache.id() });
        Ok(cache)
    }

    /// Row `row`'s positions as a single sequence's cache (a copy in a buffer of its own).
    pub fn extract(&self, row: usize) -> Result<KvCache> {
        self.check_row(row)?;
        if self.buffer.is_recurrent() {
            let now = self.buffer.recurrent_state()?.now();
            let keep = Array::from_i32(&[row as i32], &[1])?;
            let mut cache = self.buffer.with_recurrent(rows_of(&now, &keep)?, self.len(row), None);
            cache.set_checkpoints(self.checkpoints[row].clone());
            record(|| CacheOp::BatchExtract { batch: self.id, row, to: cache.id() });
            return Ok(cache);
        }
        let cache = match self.buffer.held()? {
            None => self.buffer.empty_like(),
            Some((k, v)) if !self.holes[row].is_empty() => {
                let cols = self.row_columns(row);
                let index = Array::from_i32(&cols, &[cols.len()])?;
                let r = row as i32;
                let take =
                    |a: &Array| -> Result<Array> { Ok(a.slice_axis(0, r, r + 1)?.take(&index, 2)?.contiguous()?) };
                // A sliding layer's oldest positions may be gone: the row holds its last ones.
                let len = self.len(row);
                self.buffer.with_buffer(take(&k)?, take(&v)?, len - cols.len(), len)
            }
            Some((k, v)) => {
                let (pad, start) = (self.left_padding[row], self.start());
                let first = pad.max(start);
                let (r, lo, hi) = (row as i32, (first - start) as i32, (self.width() - start) as i32);
                // `contiguous`, not `copy`: MLX's copy of a slice shares the whole buffer.
                let take = |a: &Array| -> Result<Array> {
                    Ok(a.slice_axis(0, r, r + 1)?.slice_axis(2, lo, hi)?.contiguous()?)
                };
                self.buffer.with_buffer(take(&k)?, take(&v)?, first - pad, self.width() - pad)
            }
        };
        record(|| CacheOp::BatchExtract { batch: self.id, row, to: cache.id() });
        Ok(cache)
    }

    /// Drops row `row`; the rows after it move up by one.
    pub fn remove(&mut self, row: usize) -> Result<()> {
        self.check_row(row)?;
        record(|| CacheOp::BatchRemove { batch: self.id, row });
        self.left_padding.remove(row);
        self.holes.remove(row);
        if self.buffer.is_recurrent() {
            return self.remove_recurrent(row);
        }
        let held = self.buffer.buffers().filter(|_| self.buffer.offset() > self.start());
        let (Some((k, v)), false) = (held, self.left_padding.is_empty()) else {
            // No row left, or none holds a position yet.
            self.buffer = self.buffer.empty_like();
            self.left_padding.iter_mut().for_each(|p| *p = 0);
            self.holes.iter_mut().for_each(Vec::clear);
            return Ok(());
        };
        let trim = self.left_padding.iter().copied().min().unwrap_or(0);
        let (start, first) = (self.start(), self.start().max(trim));
        let keep: Vec<i32> = (0..=self.rows() as i32).filter(|&r| r != row as i32).collect();
        let keep = Array::from_i32(&keep, &[keep.len()])?;
        // The columns after the held ones go too: the room they leave saves the next step
        // growing the buffer by another copy.
        let lo = (first - start) as i32;
        let take = |a: &Array| -> Result<Array> { Ok(a.slice_axis(2, lo, a.dim(2) as i32)?.take(&keep, 0)?) };
        let (k, v) = (take(k)?, take(v)?);
        self.buffer = self.buffer.with_buffer(k, v, first - trim, self.width() - trim);
        for p in &mut self.left_padding {
            *p -= trim;
        }
        for (a, z) in self.holes.iter_mut().flatten() {
            (*a, *z) = (*a - trim, *z - trim);
        }
        Ok(())
    }

    /// A recurrent layer's `remove` (`left_padding` already without the row): the other rows'
    /// states, and the batch narrowed by the padding no row needs any longer.
    fn remove_recurrent(&mut self, row: usize) -> Result<()> {
        self.checkpoints.remove(row);
        let trim = self.left_padding.iter().copied().min().unwrap_or(0);
        for p in &mut self.left_padding {
            *p -= trim;
        }
        let keep: Vec<i32> = (0..=self.rows() as i32).filter(|&r| r != row as i32).collect();
        if keep.is_empty() {
            self.buffer = self.buffer.empty_like();
            return Ok(());
        }
        let keep = Array::from_i32(&keep, &[keep.len()])?;
        let now = rows_of(&self.buffer.recurrent_state()?.now(), &keep)?;
        let before = self.buffer.last_snapshot().map(|s| rows_of(s, &keep)).transpose()?;
        self.buffer = self.buffer.with_recurrent(now, self.width() - trim, before);
        Ok(())
    }

    fn check_row(&self, row: usize) -> Result<()> {
        if row >= self.rows() {
            return Err(Error::Invalid(format!(
                "batch cache row {row} does not exist: the batch has {} rows",
                self.rows()
            )));
        }
        Ok(())
    }

    /// Positions every row can take before the buffer grows (by a copy).
    pub fn room(&self) -> usize {
        self.buffer.room()
    }

    /// The arrays to evaluate to materialize the cache.
    pub fn state(&self) -> Vec<&Array> {
        self.buffer.state()
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.buffer.nbytes()
    }
}

impl LayerCache for BatchKvCache {
    /// Appends `keys`/`values` (`[B, H, L, D]`, one row per batch row) at the shared index.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if keys.dim(0) != self.rows() {
            return Err(Error::Invalid(format!(
                "a forward of {} rows over a batch cache of {} rows",
                keys.dim(0),
                self.rows()
            )));
        }
        self.buffer.update_and_fetch(keys, values)
    }
}
