//! Model weights, architectures, KV caches, tokenizers and chat templates.
//!
//! [`load`] takes a Hugging Face folder or a `.gguf` file and returns a [`Loaded`] model:
//! a [`CausalLm`] (one file per architecture, picked by `model_type`), its [`Tokenizer`]
//! and [`ModelInfo`]. This crate knows nothing about HTTP, async runtimes or plugins.

#![forbid(unsafe_code)]

pub mod batch_cache;
pub mod cache;
mod error;
pub mod gemma3;
pub mod gemma4;
pub mod gpt_oss;
pub mod layers;
pub mod llama;
mod loader;
pub mod minicpm;
pub mod ministral3;
mod moe;
pub mod phi3;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use batch_cache::BatchKvCache;
pub use cache::{reach, roll_back, KvCache, LayerCache, Recurrent, Snapshot, MAX_CHECKPOINTS, SLACK};
pub use error::{Error, Result};
pub use loader::{
    check_pipeline, check_tensor_parallel, load, load_with, Arch, LoadOptions, Loaded, ModelInfo, SUPPORTED_MODEL_TYPES,
};
pub use tokenizer::{Detokenizer, Tokenizer};

use mlx::Array;

/// A decoder-only language model.
pub trait CausalLm {
    /// Runs `tokens` (`[B, L]` int32) through the model, appending to `cache` (one entry per
    /// layer), and returns logits `[B, L, vocab]`.
    fn forward(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let h = self.forward_hidden(tokens, cache)?;
        self.head(&h)
    }
    /// The final hidden states (`forward` is `head(forward_hidden(..))`). Tensor-parallel
    /// ranks evaluate these: they depend on every all-reduce of the step.
    fn forward_hidden(&self, tokens: &Array, cache: &mut [KvCache]) -> Result<Array>;
    /// The output head over final hidden states.
    fn head(&self, hidden: &Array) -> Result<Array>;
    /// A fresh cache, one entry per layer.
    fn make_cache(&self) -> Vec<KvCache>;
    fn vocab_size(&self) -> usize;
    /// Runs one new token per row (`tokens` `[B, 1]` int32) of a batch whose rows hold
    /// sequences of different lengths, appending to `cache` (one entry per layer), and returns
    /// logits `[B, 1, vocab]`. Each row's logits are those `forward` gives its sequence alone,
    /// up to float rounding.
    fn forward_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        let h = self.forward_hidden_batch(tokens, cache)?;
        self.head(&h)
    }
    /// The final hidden states of [`forward_batch`](Self::forward_batch) (before the head).
    fn forward_hidden_batch(&self, tokens: &Array, cache: &mut [BatchKvCache]) -> Result<Array> {
        let _ = (tokens, cache);
        Err(Error::Invalid("this model does not decode in batches".into()))
    }
    /// Whether [`forward_batch`](Self::forward_batch) is implemented.
    fn batches(&self) -> bool {
        false
    }
    /// Whether `forward` may be given caches made by `KvCache::fork_batch` (not where caches
    /// are mirrored by id on other processes, as under tensor parallelism).
    fn takes_cache_forks(&self) -> bool {
        true
    }
    /// Whether several sequences' prompts may run as the rows of one
    /// [`forward_hidden_batch`](Self::forward_hidden_batch), the shorter padded after their end
    /// and trimmed off (`BatchKvCache::end_rows_at`, `trim_rows`): models that batch, on one
    /// rank. A sliding-window layer's caller must still check its caches (`is_windowed`).
    fn prefills_in_batches(&self) -> bool {
        self.batches() && self.takes_cache_forks()
    }
}

#[cfg(test)]
mod tests;
