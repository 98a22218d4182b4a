//! What every decode loop shares: its options and finish (`DecodeOptions`, `FinishReason`,
//! `Token`), running a prompt into a cache (`prefill`) and token ids as an MLX array. The generation (`decode.rs`), speculative drafting (`speculative.rs`), the
//! batch (`batch.rs`) and the engine thread (`worker.rs`) all call it; it calls none of them.

use anyhow::Result;
use mlx::Array;
use models::{BatchKvCache, CausalLm, KvCache};

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

/// Whether `prefill_together` may take a model's prompts: it batches on one rank
/// (`prefills_in_batches`: its caches are not mirrored on other ranks; a recurrent layer
/// stops each row's state at its end). `HOST_JOINT_PREFILL=0` prefills every prompt alone
/// (for measuring).
pub fn prefills_together(model: &dyn CausalLm) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HOST_JOINT_PREFILL").map_or(true, |v| v != "0")) && model.prefills_in_batches()
}

/// Which of several chunks waiting to be prefilled go through one `prefill_together`: those
/// not empty and at least half the longest's length (a shorter one would mostly feed
/// padding), where two or more are and `model` allows it (asked only then: it makes a cache
/// to look at the layers). The others are prefilled alone.
pub fn joint_rows(model: &dyn CausalLm, lens: &[usize]) -> Vec<bool> {
    let longest = lens.iter().copied().max().unwrap_or(0);
    let mut joint: Vec<bool> = lens.iter().map(|&n| n > 0 && n * 2 >= longest).collect();
    if joint.iter().filter(|&&j| j).count() < 2 || !prefills_together(model) {
        joint.fill(false);
    }
    joint
}

/// Several sequences' next prompt tokens together: `chunks[i]` (not empty) runs into
/// `caches[i]` (a sequence's cache, one entry per layer) as `prefill` would run it alone, at
/// most `step` positions a row per forward. In each forward the caches become the rows of a
/// batch (`BatchKvCache::push`: the shorter padded on the left), the chunks' next `step`
/// tokens its `[B, T]` input (the shorter repeating their last token after their end:
/// causally masked from the real positions), the padding is trimmed off row by row
/// (`trim_rows`) and each row's positions are taken back as its cache (`extract`); rows
/// whose chunk ended take no part in later forwards. The same keys and values as alone, up
/// to float rounding; one forward's dispatch and one pass over the weights instead of one a
/// sequence, which is what short prompts arriving together cost most (a CPU's packed weights
/// are unpacked once a forward). Only for models that `prefills_together`. Waits for the
/// caches.
pub fn prefill_together(
    model: &dyn CausalLm,
    caches: &mut [&mut Vec<KvCache>],
    chunks: &[&[u32]],
    step: usize,
) -> Result<()> {
    if caches.len() != chunks.len() || chunks.iter().any(|c| c.is_empty()) || step == 0 {
        anyhow::bail!("prefill_together takes one chunk (not empty) per cache, and a step of at least 1");
    }
    let longest = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
    for from in (0..longest).step_by(step) {
        let rows: Vec<usize> = (0..chunks.len()).filter(|&r| chunks[r].len() > from).collect();
        let part = |r: usize| &chunks[r][from..chunks[r].len().min(from + step)];
        let t = rows.iter().map(|&r| part(r).len()).max().unwrap_or(0);
        let mut batch: Vec<BatchKvCache> = caches[rows[0]].iter().map(|_| BatchKvCache::default()).collect();
        let mut ids = Vec::with_capacity(rows.len() * t);
        // The rows in one copy per layer, with room for this forward's `t` positions.
        for (layer, b) in batch.iter_mut().enumerate() {
            let layer: Vec<&KvCache> = rows.iter().map(|&r| &caches[r][layer]).collect();
            b.push_all(&layer, t)?;
        }
        for &r in &rows {
            let part = part(r);
            ids.extend(part.iter().map(|&x| x as i32));
            ids.extend(std::iter::repeat_n(part[part.len() - 1] as i32, t - part.len()));
        }
        // The hidden states only: nothing reads the logits of a prompt's positions.
        let kept: Vec<usize> = rows.iter().map(|&r| part(r).len()).collect();
        for b in &mut batch {
            b.end_rows_at(&kept);
        }
        model.forward_hidden_batch(&Array::from_i32(&ids, &[rows.len(), t])?, &mut batch)?;
        for b in &mut batch {
            b.trim_rows(t, &kept)?;
        }
        for (i, &r) in rows.iter().enumerate() {
            *caches[r] = batch.iter().map(|b| b.extract(i)).collect::<models::Result<Vec<_>>>()?;
        }
    }
    let state: Vec<&Array> = caches.iter().flat_map(|c| c.iter().flat_map(KvCache::state)).collect();
    mlx::eval(&state)?;
    Ok(())
}

pub fn tokens_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_i32(&ids, &[ids.len()])?)
}

#[cfg(test)]
mod tests {
    use models::{CausalLm, KvCache};

    /// The last position's logits after `cache` took `token`.
    fn next(model: &dyn CausalLm, cache: &mut [KvCache], token: u32) -> Vec<f32> {
        let logits = model.forward(&super::tokens_array(&[token]).unwrap().expand_dims(&[0]).unwrap(), cache).unwrap();
        logits.to_vec_f32().unwrap()
    }

    /// Prompts of different lengths prefilled together, a few positions a forward — one
    /// resuming a prefix already in its cache — hold what each holds prefilled alone: as many
    /// positions in every layer, and the same next logits (up to float rounding); for Qwen3.5's
    /// hybrid too, whose recurrent rows stop at their own ends in a forward where others go on,
    /// and Gemma 3's sliding layers, one of whose rows has dropped its oldest positions.
    #[test]
    fn prompts_prefilled_together_hold_what_each_holds_alone() {
        for arch in ["llama", "qwen3", "qwen3_5", "gemma3_text"] {
            let model = models::testing::model(arch, 3).unwrap();
            let model = model.as_ref();
            assert!(super::prefills_together(model), "{arch}");
            let vocab = model.vocab_size() as u32;
            let prompt = |n: u32, seed: u32| -> Vec<u32> { (0..n).map(|i| (i * 37 + seed * 11) % vocab).collect() };
            let prompts = [prompt(700, 1), prompt(300, 2), prompt(1230, 3)];
            let mut alone: Vec<Vec<KvCache>> = Vec::new();
            for p in &prompts {
                let mut cache = model.make_cache();
                super::prefill(model, &mut cache, p, 64).unwrap();
                alone.push(cache);
            }
            // The third resumes 600 positions held already (a prompt-cache hit; more than a
            // sliding layer keeps, so its cache has dropped its oldest).
            let mut held: Vec<Vec<KvCache>> = (0..3).map(|_| model.make_cache()).collect();
            super::prefill(model, &mut held[2], &prompts[2][..600], 64).unwrap();
            if arch == "gemma3_text" {
                assert!(held[2].iter().any(|c| c.start() > 0), "the sliding layers dropped positions");
            }
            let chunks = [&prompts[0][..], &prompts[1][..], &prompts[2][600..]];
            let mut caches: Vec<&mut Vec<KvCache>> = held.iter_mut().collect();
            // 512 positions a forward, as the server's: the shorter rows drop out of the last.
            super::prefill_together(model, &mut caches, &chunks, 512).unwrap();
            for (i, (together, alone)) in held.iter_mut().zip(&mut alone).enumerate() {
                assert!(together.iter().all(|c| c.offset() == prompts[i].len()), "{arch} row {i}");
                let (a, b) = (next(model, together, 5), next(model, alone, 5));
                let largest = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(diff <= 1e-4 * largest.max(1.0), "{arch} row {i}: logits differ by {diff}");
            }
        }
    }

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
