//! The per-layer key/value cache. Same layout and growth as mlx-lm's `KVCache`: buffers of
//! shape `[B, n_kv_heads, capacity, head_dim]` grown in steps of 256 positions, written with
//! `slice_update`, read as `[..., :offset, :]`. `trim(n)` drops the last `n` positions, which
//! is how speculative decoding rolls back rejected drafts.

use crate::Result;
use mlx::Array;

const STEP: usize = 256;

#[derive(Default, Clone)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
}

impl KvCache {
    /// Positions held.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) and returns all keys and values so far.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let prev = self.offset;
        let shape = keys.shape();
        let (b, h, l, dk) = (shape[0], shape[1], shape[2], shape[3]);
        let dv = values.dim(3);
        let capacity = self.keys.as_ref().map_or(0, |k| k.dim(2));
        if self.keys.is_none() || prev + l > capacity {
            let n_steps = (STEP + l - 1) / STEP;
            let new_k = Array::zeros(&[b, h, n_steps * STEP, dk], keys.dtype())?;
            let new_v = Array::zeros(&[b, h, n_steps * STEP, dv], values.dtype())?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % STEP != 0 {
                        k = k.slice_axis(2, 0, prev as i32)?;
                        v = v.slice_axis(2, 0, prev as i32)?;
                    }
                    self.keys = Some(mlx::ops::concatenate(&[&k, &new_k], 2)?);
                    self.values = Some(mlx::ops::concatenate(&[&v, &new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += l;
        let (start, stop) = ([0, 0, prev as i32, 0], [b as i32, h as i32, self.offset as i32]);
        let k = self.keys.as_ref().expect("allocated above");
        let v = self.values.as_ref().expect("allocated above");
        let k = k.slice_update(keys, &start, &[stop[0], stop[1], stop[2], dk as i32], &[1, 1, 1, 1])?;
        let v = v.slice_update(values, &start, &[stop[0], stop[1], stop[2], dv as i32], &[1, 1, 1, 1])?;
        let fetched = if self.offset < k.dim(2) {
            (k.slice_axis(2, 0, self.offset as i32)?, v.slice_axis(2, 0, self.offset as i32)?)
        } else {
            (k.clone(), v.clone())
        };
        self.keys = Some(k);
        self.values = Some(v);
        Ok(fetched)
    }

    /// Drops the last `n` positions (at most all of them); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
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
