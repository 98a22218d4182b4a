//! The engine: the decode loop (`decode.rs`) and native sampling (`sampling.rs`).
//! All MLX arrays of a model live on the thread that drives it.

pub mod decode;
pub mod sampling;

pub use decode::{DecodeOptions, DecodeStats, FinishReason, Generation, Token};
pub use sampling::{Sampler, SamplingParams};
