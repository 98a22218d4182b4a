//! The integration tests of the `host` binary and library, linked as one test binary (five
//! binaries each linked the whole library, MLX and wasmtime; one link saves CI minutes).
//! Each file keeps its tests and their names, under its module (`parity::…`).

mod common;

#[path = "batch.rs"]
mod batch;
#[path = "cli.rs"]
mod cli;
#[path = "hub.rs"]
mod hub;
#[path = "parity.rs"]
mod parity;
#[path = "speculative.rs"]
mod speculative;
#[path = "tensor_parallel.rs"]
mod tensor_parallel;
