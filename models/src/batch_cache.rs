//! The key/value cache of a batch of sequences decoded together, in mlx-lm's
//! `BatchKVCache` layout: one buffer `[B, n_kv_heads, capacity, head_dim]` per layer whose
//! rows are right-aligned, so a row holding fewer positions than the longest is padded on
//! the left (masked out of attention, and its RoPE positions start from its own length).
//! Every row appends at the same index, so a decode step is one `slice_update` per layer
//! for the whole batch, whatever the rows' lengths.
//!
//! Rows join from a single sequence's [`KvCache`] ([`push`](BatchKvCache::push)) and leave
//! ([`remove`](BatchKvCache::remove)), optionally handing their positions back as a
//! [`KvCache`] first ([`extract`](BatchKvCache::extract)); both copy the buffer, which is
//! paid once per join or leave, not per step. Leaving also drops the left padding no
//! remaining row needs.

use crate::cache::{next_id, record, CacheOp, KvCache, LayerCache};
use crate::{Error, Result};
use mlx::{Array, Dtype};

const STEP: usize = 256;

pub struct BatchKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// Positions written, the same for every row; row r's first `left_padding[r]` are padding.
    idx: usize,
    left_padding: Vec<usize>,
    /// Process-unique (from the same counter as `KvCache`'s), so a tensor-parallel peer can
    /// mirror the batch: joins, leaves and extractions are recorded as `CacheOp`s.
    id: u64,
}

impl Default for BatchKvCache {
    fn default() -> Self {
        BatchKvCache { keys: None, values: None, idx: 0, left_padding: Vec::new(), id: next_id() }
    }
}

impl Drop for BatchKvCache {
    fn drop(&mut self) {
        record(CacheOp::Drop(self.id));
    }
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
        self.idx - self.left_padding[row]
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.left_padding.is_empty()
    }

    /// Buffer positions per row, padding included.
    pub fn width(&self) -> usize {
        self.idx
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
        let cols = Array::arange(0.0, (self.idx + 1) as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
        let pads: Vec<i32> = self.left_padding.iter().map(|&p| p as i32).collect();
        let pads = Array::from_i32(&pads, &[pads.len(), 1])?;
        Ok(Some(cols.greater_equal(&pads)?.reshape(&[b, 1, 1, -1])?))
    }

    /// The buffers' live part, `[B, H, idx, D]` each (`None` while nothing is written).
    fn held(&self) -> Result<Option<(Array, Array)>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        if self.idx == 0 {
            return Ok(None);
        }
        if k.dim(2) == self.idx {
            return Ok(Some((k.clone(), v.clone())));
        }
        let end = self.idx as i32;
        Ok(Some((k.slice_axis(2, 0, end)?, v.slice_axis(2, 0, end)?)))
    }

    /// Adds a row holding `cache`'s positions (one sequence's cache of this layer) as the
    /// last row. The shorter of the batch and the row is padded on the left.
    pub fn push(&mut self, cache: &KvCache) -> Result<()> {
        let n = cache.offset();
        record(CacheOp::BatchPush { batch: self.id, cache: cache.id(), offset: n });
        let row = cache.held()?;
        let batch = self.held()?;
        let target = self.idx.max(n);
        // Shapes for padding come from whichever side holds positions.
        let like = row.as_ref().map(|(k, v)| (k.clone(), v.clone())).or_else(|| batch.clone());
        let front = |kv: Option<(Array, Array)>, rows: usize, have: usize| -> Result<Option<(Array, Array)>> {
            let Some((k0, v0)) = &like else { return Ok(None) };
            let pad = target - have;
            let zeros = |a: &Array| Array::zeros(&[rows, a.dim(1), pad, a.dim(3)], a.dtype());
            Ok(match kv {
                Some((k, v)) if pad == 0 => Some((k, v)),
                Some((k, v)) => {
                    Some((mlx::ops::concatenate(&[&zeros(&k)?, &k], 2)?, mlx::ops::concatenate(&[&zeros(&v)?, &v], 2)?))
                }
                None if rows == 0 || pad == 0 => None,
                None => Some((zeros(k0)?, zeros(v0)?)),
            })
        };
        let old = front(batch, self.rows(), self.idx)?;
        let new = front(row, 1, n)?;
        let grown = target - self.idx;
        for p in &mut self.left_padding {
            *p += grown;
        }
        self.left_padding.push(target - n);
        self.idx = target;
        (self.keys, self.values) = match (old, new) {
            (Some((ok, ov)), Some((nk, nv))) => {
                (Some(mlx::ops::concatenate(&[&ok, &nk], 0)?), Some(mlx::ops::concatenate(&[&ov, &nv], 0)?))
            }
            (None, Some((nk, nv))) => (Some(nk), Some(nv)),
            (Some((ok, ov)), None) => (Some(ok), Some(ov)),
            (None, None) => (None, None),
        };
        Ok(())
    }

    /// Row `row`'s positions as a single sequence's cache (a copy).
    pub fn extract(&self, row: usize) -> Result<KvCache> {
        self.check_row(row)?;
        let cache = match self.held()? {
            None => KvCache::default(),
            Some((k, v)) => {
                let (r, start, end) = (row as i32, self.left_padding[row] as i32, self.idx as i32);
                let take = |a: &Array| -> Result<Array> {
                    Ok(a.slice_axis(0, r, r + 1)?.slice_axis(2, start, end)?.contiguous()?)
                };
                KvCache::from_held(take(&k)?, take(&v)?)
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
        if self.left_padding.is_empty() {
            (self.keys, self.values, self.idx) = (None, None, 0);
            return Ok(());
        }
        let keep: Vec<i32> = (0..=self.rows() as i32).filter(|&r| r != row as i32).collect();
        let keep = Array::from_i32(&keep, &[keep.len()])?;
        let trim = self.left_padding.iter().copied().min().unwrap_or(0);
        let (Some(k), Some(v)) = (self.keys.take(), self.values.take()) else {
            self.idx -= trim;
            return Ok(());
        };
        let (mut k, mut v) = (k.take(&keep, 0)?, v.take(&keep, 0)?);
        if trim > 0 {
            let capacity = k.dim(2) as i32;
            k = k.slice_axis(2, trim as i32, capacity)?;
            v = v.slice_axis(2, trim as i32, capacity)?;
            self.idx -= trim;
            for p in &mut self.left_padding {
                *p -= trim;
            }
        }
        (self.keys, self.values) = (Some(k), Some(v));
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
        self.keys.iter().chain(self.values.iter()).collect()
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(|a| a.nbytes()).sum()
    }
}

impl LayerCache for BatchKvCache {
    /// Appends `keys`/`values` (`[B, H, L, D]`, one row per batch row) at the shared index.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let shape = keys.shape();
        let (b, h, l, dk) = (shape[0], shape[1], shape[2], shape[3]);
        if b != self.rows() {
            return Err(Error::Invalid(format!("a forward of {b} rows over a batch cache of {} rows", self.rows())));
        }
        let dv = values.dim(3);
        let prev = self.idx;
        let capacity = self.keys.as_ref().map_or(0, |k| k.dim(2));
        if self.keys.is_none() || prev + l > capacity {
            let n_steps = (STEP + l - 1) / STEP;
            let new_k = Array::zeros(&[b, h, n_steps * STEP, dk], keys.dtype())?;
            let new_v = Array::zeros(&[b, h, n_steps * STEP, dv], values.dtype())?;
            match self.held()? {
                Some((k, v)) => {
                    self.keys = Some(mlx::ops::concatenate(&[&k, &new_k], 2)?);
                    self.values = Some(mlx::ops::concatenate(&[&v, &new_v], 2)?);
                }
                None => (self.keys, self.values) = (Some(new_k), Some(new_v)),
            }
        }
        self.idx += l;
        let (start, end) = ([0, 0, prev as i32, 0], [b as i32, h as i32, self.idx as i32]);
        let k = self.keys.as_ref().expect("allocated above");
        let v = self.values.as_ref().expect("allocated above");
        let k = k.slice_update(keys, &start, &[end[0], end[1], end[2], dk as i32], &[1, 1, 1, 1])?;
        let v = v.slice_update(values, &start, &[end[0], end[1], end[2], dv as i32], &[1, 1, 1, 1])?;
        (self.keys, self.values) = (Some(k), Some(v));
        Ok(self.held()?.expect("written above"))
    }
}
