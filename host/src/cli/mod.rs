//! The subcommands other than `serve`: `generate` (one prompt, streamed), `bench`
//! (prefill, decode and serving measurements), `launch` (an agent harness against
//! `host serve`), `plugins` (validate, list), `models` (the hub cache's models) and `pull`
//! (a model downloaded into that cache). Only
//! `main.rs` calls them.

pub mod bench;
pub mod generate;
pub mod launch;
pub mod models;
pub mod plugins;
pub mod pull;
