//! The `host` binary: parse arguments, pick the device, run the command.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "host", version, about = "A native LLM inference server on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt, streaming it to stdout.
    Generate(host::generate::Args),
    /// Measure prefill, decode, time to first token and memory on one model.
    Bench(host::bench::Args),
    /// Serve the OpenAI and Anthropic APIs over HTTP.
    Serve(host::config::ServeArgs),
    /// Run an agent harness (pi, opencode, codex, claude) against `host serve`.
    Launch(host::launch::Args),
    /// Validate or list Wasm plugins.
    #[command(subcommand)]
    Plugins(host::plugins::PluginsCommand),
    /// One rank of a tensor-parallel group (launched by `--tensor-parallel`).
    #[command(hide = true)]
    TpWorker(host::tp::WorkerArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => host::generate::run(args),
        Command::Bench(args) => host::bench::run(args),
        Command::Serve(args) => host::server::run(args),
        Command::Launch(args) => host::launch::run(args),
        Command::Plugins(command) => host::plugins::run_command(command),
        Command::TpWorker(args) => host::tp::worker(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
