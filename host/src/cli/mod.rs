//! The subcommands other than `serve`: `generate` (one prompt, streamed), `bench`
//! (prefill, decode and serving measurements) and `launch` (an agent harness against
//! `host serve`). Only `main.rs` calls them.

pub mod bench;
pub mod generate;
pub mod launch;
