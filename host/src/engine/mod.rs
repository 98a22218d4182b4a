//! The engine: the decode loop (`decode.rs`), speculative decoding (`speculative.rs`),
//! native sampling (`sampling.rs`), stop strings
//! (`stop.rs`), KV reuse across requests (`prompt_cache.rs`) and the engine thread that
//! serves requests (`worker.rs`). All MLX arrays of a model live on the thread that drives it.

pub mod batch;
pub mod constraint;
pub mod decode;
pub mod handle;
pub mod job;
mod output;
pub mod prompt_cache;
pub mod queue;
pub mod sampling;
pub mod speculative;
pub mod stats;
pub mod step;
pub mod stop;
mod warm_up;
mod worker;

pub use constraint::{Allowed, Constraint, ConstraintSpec, Guard};
pub use decode::{DecodeOptions, DecodeStats, ExternalSampler, FinishReason, Frame, Generation, Hooks, Pick, Token};
pub use sampling::{Sampler, SamplingParams};
pub use speculative::{SpecConfig, SpecMethod, Speculation, Verify};
