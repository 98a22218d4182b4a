//! The subcommands other than `serve`: `generate` (one prompt, streamed), `bench`
//! (prefill, decode and serving measurements), `launch` (an agent harness against
//! `host serve`) and `plugins` (validate, list). Only `main.rs` calls them.

pub mod bench;
pub mod generate;
pub mod launch;
pub mod plugins;
