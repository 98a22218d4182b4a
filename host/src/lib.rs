//! `host`: the engine, its CLI commands and (later) the server and plugin runtime.
//! `main.rs` is the thin `anyhow` edge over these modules.

#![forbid(unsafe_code)]

pub mod bench;
pub mod config;
pub mod default_model;
pub mod engine;
pub mod generate;
pub mod launch;
pub mod plugins;
pub mod server;
pub mod structured;
pub mod tp;
