//! Safe Rust over MLX C++, linked against the prebuilt libmlx of the PyPI wheels.
//!
//! The public API reads like a tensor library: [`Array`], [`Dtype`], [`ops`], [`Device`].
//! Every fallible MLX call returns [`Result`]; C++ exceptions become [`Error::Mlx`].
//! This crate knows nothing about models.

mod array;
mod device;
pub mod distributed;
mod dtype;
mod error;
mod ffi;
pub mod io;
pub mod ops;

pub use array::Array;
pub use device::{
    async_eval, async_eval_detached, cap_cpu_qmatmul_isa, cpu_quantized_products, eval, exit_without_teardown,
    graph_dot, memory, set_cpu_exp_mode, synchronize, version, Detached, Device, Stream,
};
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use ops::{fast, random};

#[cfg(test)]
mod tests;
