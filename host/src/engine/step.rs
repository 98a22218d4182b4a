//! What every decode loop shares: running a prompt into a cache (`prefill`) and token ids as
//! an MLX array. The generation (`decode.rs`), speculative drafting (`speculative.rs`), the
//! batch (`batch.rs`) and the engine thread (`worker.rs`) all call it; it calls none of them.

use anyhow::Result;
use mlx::Array;
use models::{CausalLm, KvCache};

/// Runs `tokens` through `model` into `cache`, `step` positions per forward pass (bounding
/// activation memory on long prompts), pipelined as decoding is: chunk k+1's graph is built
/// and handed to MLX while the device still runs chunk k, and after handing over chunk k+1 it
/// waits for chunk k, so at most two chunks' work is in flight. The last chunk is left in
/// flight: whatever reads the cache next waits for it. MLX's buffer cache is not cleared
/// between chunks (mlx-lm clears it after each; on the H200 that, with the waits, cost
/// 12-26% of a 4,096-token prefill, bench/NOTES.md session 10); `commit` clears it at the
/// first token.
pub fn prefill(model: &dyn CausalLm, cache: &mut [KvCache], tokens: &[u32], step: usize) -> Result<()> {
    let wait = |state: &[Array]| -> Result<()> { Ok(mlx::eval(&state.iter().collect::<Vec<_>>())?) };
    let mut in_flight: Option<Vec<Array>> = None;
    let done = tokens.chunks(step.max(1)).try_for_each(|chunk| -> Result<()> {
        model.forward(&tokens_array(chunk)?.expand_dims(&[0])?, cache)?;
        let state: Vec<Array> = cache.iter().flat_map(KvCache::state).cloned().collect();
        mlx::async_eval(&state.iter().collect::<Vec<_>>())?;
        match in_flight.replace(state) {
            Some(before) => wait(&before),
            None => Ok(()),
        }
    });
    if done.is_err() {
        // No MLX work outlives a failed prefill (the caller's cleanup waits on nothing).
        if let Some(state) = &in_flight {
            let _ = wait(state);
        }
    }
    done
}

pub fn tokens_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_i32(&ids, &[ids.len()])?)
}
