//! The key/value cache of a batch of sequences decoded together, in mlx-lm's
//! `BatchKVCache` layout: one buffer `[B, n_kv_heads, capacity, head_dim]` per layer whose
//! rows are right-aligned, so a row holding fewer positions than the longest is padded on
//! the left (masked out of attention, and its RoPE positions start from its own length).
//! Every row appends at the same index, so a decode step is one `slice_update` per layer
//! for the whole batch, whatever the rows' lengths. The buffer is a [`KvCache`] of B rows
//! (its growth and writes are a single sequence's); this type adds the rows' padding.
//!
//! Rows join from a single sequence's [`KvCache`] ([`push`](BatchKvCache::push)) and leave
//! ([`remove`](BatchKvCache::remove)), optionally handing their positions back as a
//! [`KvCache`] first ([`extract`](BatchKvCache::extract)); both copy the buffer, which is
//! paid once per join or leave, not per step. Leaving also drops the left padding no
//! remaining row needs.
//!
//! A sliding-window layer's batch is bounded as its rows' caches are: the buffer's columns
//! are numbered from the first ever written, and the buffer holds columns `start..width`
//! (see `KvCache::windowed`), so a row's padding and length keep their meaning when the
//! oldest columns go.

use crate::cache::{next_id, record, CacheOp, KvCache, LayerCache};
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
}

impl Default for BatchKvCache {
    fn default() -> Self {
        BatchKvCache { buffer: KvCache::default(), left_padding: Vec::new(), id: next_id() }
    }
}

impl Drop for BatchKvCache {
    fn drop(&mut self) {
        record(CacheOp::Drop(self.id));
    }
}

/// `a` (`[rows, H, have, D]`, or nothing when it holds no position) as its last `width`
/// positions: left-padded with zeros, shaped like `like`, or with its first ones cut; `None`
/// when there is nothing to pad or to keep.
fn padded(a: Option<Array>, rows: usize, width: usize, like: &Array) -> Result<Option<Array>> {
    let have = a.as_ref().map_or(0, |a| a.dim(2));
    if let (Some(a), true) = (&a, have > width) {
        return Ok(Some(a.slice_axis(2, (have - width) as i32, have as i32)?));
    }
    let pad = width - have;
    if rows == 0 || (a.is_none() && pad == 0) {
        return Ok(None);
    }
    let zeros = Array::zeros(&[rows, like.dim(1), pad, like.dim(3)], like.dtype())?;
    Ok(Some(match a {
        Some(a) if pad == 0 => a,
        Some(a) => mlx::ops::concatenate(&[&zeros, &a], 2)?,
        None => zeros,
    }))
}

impl BatchKvCache {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.left_padding.len()
    }

    /// Positions row `row` holds (its sequence length so far).
    pub fn len(&self, row: usize) -> usize {
        self.width() - self.left_padding[row]
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
        if self.left_padding.iter().all(|&p| p == 0) {
            return Ok(None);
        }
        let b = self.rows() as i32;
        let (from, to) = (self.start() as f64, (self.width() + 1) as f64);
        let cols = Array::arange(from, to, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
        let pads: Vec<i32> = self.left_padding.iter().map(|&p| p as i32).collect();
        let pads = Array::from_i32(&pads, &[pads.len(), 1])?;
        Ok(Some(cols.greater_equal(&pads)?.reshape(&[b, 1, 1, -1])?))
    }

    /// Adds a row holding `cache`'s positions (one sequence's cache of this layer) as the
    /// last row. The shorter of the batch and the row is padded on the left. Where a window
    /// dropped the oldest positions of either, the joined buffer starts at the later of the
    /// two first columns held (what it cuts of the other is outside every window).
    pub fn push(&mut self, cache: &KvCache) -> Result<()> {
        let n = cache.offset();
        record(CacheOp::BatchPush { batch: self.id, cache: cache.id(), offset: n });
        let (width, target) = (self.width(), self.width().max(n));
        // The first column each side holds in the joined buffer (0 when it holds all of its
        // own: the columns before are padding).
        let first = |start: usize, len: usize| if start > 0 { start + target - len } else { 0 };
        let from = first(self.start(), width).max(first(cache.start(), n));
        let (old_k, old_v) = self.buffer.held()?.unzip();
        let (new_k, new_v) = cache.held()?.unzip();
        let join = |old: Option<Array>, new: Option<Array>| -> Result<Option<Array>> {
            let Some(like) = new.as_ref().or(old.as_ref()).cloned() else { return Ok(None) };
            let parts: Vec<Array> =
                [padded(old, self.rows(), target - from, &like)?, padded(new, 1, target - from, &like)?]
                    .into_iter()
                    .flatten()
                    .collect();
            Ok(Some(mlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?))
        };
        let (k, v) = (join(old_k, new_k)?, join(old_v, new_v)?);
        self.buffer = match (k, v) {
            (Some(k), Some(v)) => cache.with_buffer(k, v, from, target),
            _ => cache.empty_like(),
        };
        for p in &mut self.left_padding {
            *p += target - width;
        }
        self.left_padding.push(target - n);
        Ok(())
    }

    /// Row `row`'s positions as a single sequence's cache (a copy in a buffer of its own).
    pub fn extract(&self, row: usize) -> Result<KvCache> {
        self.check_row(row)?;
        let cache = match self.buffer.held()? {
            None => self.buffer.empty_like(),
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
        record(CacheOp::BatchExtract { batch: self.id, row, to: cache.id() });
        Ok(cache)
    }

    /// Drops row `row`; the rows after it move up by one.
    pub fn remove(&mut self, row: usize) -> Result<()> {
        self.check_row(row)?;
        record(CacheOp::BatchRemove { batch: self.id, row });
        self.left_padding.remove(row);
        let held = self.buffer.held()?;
        let (Some((k, v)), false) = (held, self.left_padding.is_empty()) else {
            // No row left, or none holds a position yet.
            self.buffer = self.buffer.empty_like();
            self.left_padding.iter_mut().for_each(|p| *p = 0);
            return Ok(());
        };
        let trim = self.left_padding.iter().copied().min().unwrap_or(0);
        let (start, first) = (self.start(), self.start().max(trim));
        let keep: Vec<i32> = (0..=self.rows() as i32).filter(|&r| r != row as i32).collect();
        let keep = Array::from_i32(&keep, &[keep.len()])?;
        let (lo, hi) = ((first - start) as i32, (self.width() - start) as i32);
        let take = |a: &Array| -> Result<Array> { Ok(a.take(&keep, 0)?.slice_axis(2, lo, hi)?) };
        self.buffer = self.buffer.with_buffer(take(&k)?, take(&v)?, first - trim, self.width() - trim);
        for p in &mut self.left_padding {
            *p -= trim;
        }
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
