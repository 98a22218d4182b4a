//! An external sampler's turn at a position: the logits row read back (the top-k candidates
//! or the whole row) as its `Frame`, its `Pick` applied or sampled natively from the edited
//! frame. Shared by the generation (`decode.rs`) and the batch's plugin rows (`batch.rs`).

use super::hooks::{ExternalSampler, Frame, Pick};
use super::sampling::{log_softmax, Sampler};
use anyhow::{bail, Result};
use mlx::Array;

/// Runs the external sampler on one step's processed logits (`[1, V]`); returns the chosen
/// token as a `[1]` int32 array, sampling natively from the edited frame on `Pick::Defer`.
pub(super) fn pick_external(
    external: &mut dyn ExternalSampler,
    sampler: &Sampler,
    logits: &Array,
    position: usize,
) -> Result<Array> {
    let frame = external_frame(external, logits)?;
    let id = pick_from_frame(external, sampler, position, frame, logits.dim(-1))?;
    Ok(Array::from_i32(&[id as i32], &[1])?)
}

/// What an external sampler's frame is read from, still on the device (lazy).
pub(crate) enum FrameArrays {
    /// The top-k candidates: their float32 logits and token ids.
    Candidates { logits: Array, ids: Array },
    /// The whole float32 logits row.
    Row(Array),
}

impl FrameArrays {
    /// The arrays to evaluate before reading the frame.
    pub(crate) fn arrays(&self) -> Vec<&Array> {
        match self {
            FrameArrays::Candidates { logits, ids } => vec![logits, ids],
            FrameArrays::Row(row) => vec![row],
        }
    }
}

/// The frame `external` asks for, from processed logits `[1, V]`.
pub(crate) fn external_frame(external: &dyn ExternalSampler, logits: &Array) -> Result<FrameArrays> {
    let logits = logits.astype(mlx::Dtype::Float32)?;
    Ok(match external.candidates() {
        Some(k) => {
            let k = k.min(logits.dim(-1)).max(1) as i32;
            let ids = logits.negative()?.argpartition(k - 1, -1)?.slice_axis(-1, 0, k)?;
            FrameArrays::Candidates { logits: logits.take_along_axis(&ids, -1)?, ids }
        }
        None => FrameArrays::Row(logits),
    })
}

/// The external sampler's pick from a frame made by [`external_frame`] (read back here, so
/// evaluating it first saves a round trip), sampling natively from the edited frame on
/// `Pick::Defer`; a pick outside the vocabulary is an error.
pub(crate) fn pick_from_frame(
    external: &mut dyn ExternalSampler,
    sampler: &Sampler,
    position: usize,
    frame: FrameArrays,
    vocab: usize,
) -> Result<u32> {
    let native = |values: &[f32]| -> Result<usize> {
        let row = Array::from_f32(values, &[1, values.len()])?;
        let lp = log_softmax(&row)?;
        Ok(sampler.sample(&lp, position)?.item_i32()? as usize)
    };
    let id = match frame {
        FrameArrays::Candidates { logits, ids } => {
            let values = logits.to_vec_f32()?;
            let mut frame: Vec<(u32, f32)> = ids.to_vec_i32()?.into_iter().map(|t| t as u32).zip(values).collect();
            frame.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            match external.sample(position, Frame::Candidates(&mut frame))? {
                Pick::Token(t) => t,
                Pick::Defer => {
                    let values: Vec<f32> = frame.iter().map(|c| c.1).collect();
                    frame[native(&values)?].0
                }
            }
        }
        FrameArrays::Row(row) => {
            let mut row = row.to_vec_f32()?;
            match external.sample(position, Frame::Logits(&mut row))? {
                Pick::Token(t) => t,
                Pick::Defer => native(&row)? as u32,
            }
        }
    };
    if id as usize >= vocab {
        bail!("the external sampler picked token {id}, outside the vocabulary of {vocab}");
    }
    Ok(id)
}
