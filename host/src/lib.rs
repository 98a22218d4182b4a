//! `host`: a native LLM inference server. Data flows one way:
//! `main → cli | server → engine → load → models → mlx`, with `plugins` and `structured`
//! beside the engine (they implement its hooks; the server hands them to it).
//!
//! - `cli/`: the `generate`, `bench` and `launch` commands;
//! - `config.rs`: `host serve`'s flags and `host.toml`, resolved once;
//! - `server/`: the OpenAI and Anthropic APIs over HTTP;
//! - `engine/`: the engine thread, batching, decoding, speculation, sampling;
//! - `load/`: device choice and model loading (tensor-parallel ranks included);
//! - `plugins/`: the Wasm plugin runtime and registry;
//! - `structured.rs`: JSON schema, regex and grammar constraints (llguidance).
//!
//! `main.rs` is the thin `anyhow` edge over these modules; `tidy.rs` (tests only) holds the
//! direction test that keeps the order.

#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod engine;
pub mod load;
pub mod plugins;
pub mod server;
pub mod structured;

#[cfg(test)]
mod tidy;
