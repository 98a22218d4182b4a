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

/// `a` (`[rows, H, have, D]`, or nothing when it holds no position) left-padded with zeros
/// to `width` positions, shaped like `like`; `None` when there is nothing to pad or to keep.
fn padded(a: Option<Array>, rows: usize, width: usize, like: &Array) -> Result<Option<Array>> {
    let pad = width - a.as_ref().map_or(0, |a| a.dim(2));
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

    /// Buffer positions per row, padding included.
    pub fn width(&self) -> usize {
        self.buffer.offset()
    }

    /// Each row's length, int32 `[B]`: where its next position starts (RoPE offsets).
    pub fn offsets(&self) -> Result<Array> {
        let lengths: Vec<i32> = (0..self.rows()).map(|r| self.len(r) as i32).collect();
        Ok(Array::from_i32(&lengths, &[lengths.len()])?)
    }

    /// The attention mask of a forward of one new position per row: boolean
    /// `[B, 1, 1, width + 1]`, false on each row's padding; `None` when no row is padded.
    pub fn mask(&self) -> Result<Option<Array>> {
        if self.left_padding.iter().all(|&p| p == 0) {
            return Ok(None);
        }
        let b = self.rows() as i32;
        let cols = Array::arange(0.0, (self.width() + 1) as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
        let pads: Vec<i32> = self.left_padding.iter().map(|&p| p as i32).collect();
        let pads = Array::from_i32(&pads, &[pads.len(), 1])?;
        Ok(Some(cols.greater_equal(&pads)?.reshape(&[b, 1, 1, -1])?))
    }

    /// Adds a row holding `cache`'s positions (one sequence's cache of this layer) as the
    /// last row. The shorter of the batch and the row is padded on the left.
    pub fn push(&mut self, cache: &KvCache) -> Result<()> {
        let n = cache.offset();
        record(CacheOp::BatchPush { batch: self.id, cache: cache.id(), offset: n });
        let (width, target) = (self.width(), self.width().max(n));
        let (old_k, old_v) = self.buffer.held()?.unzip();
        let (new_k, new_v) = cache.held()?.unzip();
        let join = |old: Option<Array>, new: Option<Array>| -> Result<Option<Array>> {
            let Some(like) = new.as_ref().or(old.as_ref()).cloned() else { return Ok(None) };
            let parts: Vec<Array> = [padded(old, self.rows(), target, &like)?, padded(new, 1, target, &like)?]
                .into_iter()
                .flatten()
                .collect();
            Ok(Some(mlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?))
        };
        let (k, v) = (join(old_k, new_k)?, join(old_v, new_v)?);
        self.buffer = match (k, v) {
            (Some(k), Some(v)) => KvCache::from_buffer(k, v, target),
            _ => KvCache::default(),
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
            None => KvCache::default(),
            Some((k, v)) => {
                let (r, start, end) = (row as i32, self.left_padding[row] as i32, self.width() as i32);
                // `contiguous`, not `copy`: MLX's copy of a slice shares the whole buffer.
                let take = |a: &Array| -> Result<Array> {
                    Ok(a.slice_axis(0, r, r + 1)?.slice_axis(2, start, end)?.contiguous()?)
                };
                KvCache::from_buffer(take(&k)?, take(&v)?, (end - start) as usize)
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
            self.buffer = KvCache::default();
            self.left_padding.iter_mut().for_each(|p| *p = 0);
            return Ok(());
        };
        let trim = self.left_padding.iter().copied().min().unwrap_or(0);
        let width = self.width() - trim;
        let keep: Vec<i32> = (0..=self.rows() as i32).filter(|&r| r != row as i32).collect();
        let keep = Array::from_i32(&keep, &[keep.len()])?;
        let (lo, hi) = (trim as i32, self.width() as i32);
        let take = |a: &Array| -> Result<Array> { Ok(a.take(&keep, 0)?.slice_axis(2, lo, hi)?) };
        self.buffer = KvCache::from_buffer(take(&k)?, take(&v)?, width);
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
