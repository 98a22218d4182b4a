//! The engine: the decode loop (`decode.rs`), speculative decoding (`speculative.rs`),
//! native sampling (`sampling.rs`), stop strings
//! (`stop.rs`), KV reuse across requests (`prompt_cache.rs`) and the engine thread that
//! serves requests (`worker.rs`). All MLX arrays of a model live on the thread that drives it.

pub mod batch;
pub mod constraint;
pub mod decode;
mod external;
pub mod handle;
pub mod hooks;
pub mod job;
mod output;
pub mod prompt_cache;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
pub mod stats;
pub mod step;
pub mod stop;
mod warm_up;
mod worker;

pub use constraint::{Allowed, Constraint, ConstraintSpec, Guard};
pub use decode::{Generation, Hooks};
pub use hooks::{ExternalSampler, Frame, Pick};
pub use sampling::{Sampler, SamplingParams};
pub use speculative::{SpecConfig, SpecMethod, Speculation, Verify};
pub use stats::DecodeStats;
pub use step::{DecodeOptions, FinishReason, Token};
