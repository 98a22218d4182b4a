//! What every decode loop shares: its options and finish (`DecodeOptions`, `FinishReason`,
//! `Token`), running a prompt into a cache (`prefill`) and token ids as an MLX array. The generation (`decode.rs`), speculative drafting (`speculative.rs`), the
//! batch (`batch.rs`) and the engine thread (`worker.rs`) all call it; it calls none of them.

use anyhow::Result;
use mlx::Array;
use models::{CausalLm, KvCache};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated (it is the last token yielded).
    Stop,
    /// `max_tokens` were generated.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Limits and stop tokens of one generation.
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    pub max_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    /// Prompt tokens per prefill forward pass (bounds activation memory on long prompts).
    pub prefill_step_size: usize,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions { max_tokens: 256, eos_token_ids: Vec::new(), prefill_step_size: 2048 }
    }
}

impl DecodeOptions {
    /// Why generation ends at token `id`, the `generated`-th (counting it), if it does.
    pub fn finish(&self, id: u32, generated: usize) -> Option<FinishReason> {
        if self.eos_token_ids.contains(&id) {
            Some(FinishReason::Stop)
        } else if generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// One generated token.
#[derive(Debug)]
pub struct Token {
    pub id: u32,
    /// Normalized log-probabilities over the vocabulary at this step (`[V]`, lazy).
    pub logprobs: Array,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
}

/// Runs `tokens` through `model` into `cache`, `step` positions per forward pass (bounding
/// activation memory on long prompts), pipelined as decoding is: chunk k+1's graph is built
/// and handed to MLX while the device still runs chunk k, and after handing over chunk k+1 it
/// waits for chunk k, so at most two chunks' work is in flight. The last chunk is left in
/// flight: whatever reads the cache next waits for it. MLX's buffer cache is not cleared
/// between chunks (mlx-lm clears it after each; on the H200 that, with the waits, cost
/// 12-26% of a 4,096-token prefill, bench/NOTES.md session 10); `commit` clears it at the
/// first token.
pub fn prefill(model: &dyn CausalLm, cache: &mut [KvCache], tokens: &[u32], step: usize) -> Result<()> {
    prefill_until(model, cache, tokens, step, &|| false).map(|_| ())
}

/// `prefill`, asking `stop` before each `step` tokens: returns `Ok(false)`, with the cache
/// holding part of `tokens`, when it said to stop (the server's shutdown, which then waits
/// for one forward pass, not for the rest of the chunk).
pub fn prefill_until(
    model: &dyn CausalLm,
    cache: &mut [KvCache],
    tokens: &[u32],
    step: usize,
    stop: &dyn Fn() -> bool,
) -> Result<bool> {
    let wait = |state: &[Array]| -> Result<()> { Ok(mlx::eval(&state.iter().collect::<Vec<_>>())?) };
    let mut in_flight: Option<Vec<Array>> = None;
    let mut stopped = false;
    let done = tokens.chunks(step.max(1)).try_for_each(|chunk| -> Result<()> {
        if stop() {
            stopped = true;
            return Ok(());
        }
        model.forward(&tokens_array(chunk)?.expand_dims(&[0])?, cache)?;
        let state: Vec<Array> = cache.iter().flat_map(KvCache::state).cloned().collect();
        mlx::async_eval(&state.iter().collect::<Vec<_>>())?;
        match in_flight.replace(state) {
            Some(before) => wait(&before),
            None => Ok(()),
        }
    });
    // No MLX work outlives the call: a failed or stopped prefill's last step is waited for
    // too (the caller's cleanup, or the process's exit, waits on nothing).
    if done.is_err() || stopped {
        if let Some(state) = &in_flight {
            let _ = wait(state);
        }
    }
    done.map(|()| !stopped)
}

pub fn tokens_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_i32(&ids, &[ids.len()])?)
}

#[cfg(test)]
mod tests {
    /// The server's shutdown stops a prefill between its steps: asked to stop after two
    /// steps, the cache holds those two steps' positions, and no more.
    #[test]
    fn a_prefill_told_to_stop_ends_after_the_step_it_is_on() {
        let model = models::testing::model("llama", 2).unwrap();
        let tokens: Vec<u32> = (0..40).collect();
        let asked = std::cell::Cell::new(0);
        let stop = || {
            asked.set(asked.get() + 1);
            asked.get() > 2
        };
        let mut cache = model.make_cache();
        assert!(!super::prefill_until(model.as_ref(), &mut cache, &tokens, 8, &stop).unwrap());
        assert_eq!(cache[0].offset(), 16);
        let mut whole = model.make_cache();
        assert!(super::prefill_until(model.as_ref(), &mut whole, &tokens, 8, &|| false).unwrap());
        assert_eq!(whole[0].offset(), 40);
    }
}
