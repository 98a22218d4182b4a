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
    Generate(host::cli::generate::Args),
    /// Measure prefill, decode, time to first token and memory on one model.
    Bench(host::cli::bench::Args),
    /// Serve the OpenAI and Anthropic APIs over HTTP.
    Serve(host::config::ServeArgs),
    /// Run an agent harness (pi, opencode, codex, claude) against `host serve`.
    Launch(host::cli::launch::Args),
    /// List the models the Hugging Face cache holds (for `--model org/name`).
    Models(host::cli::models::Args),
    /// Download a model from the Hugging Face hub into its cache (`org/name[@revision]`).
    Pull(host::cli::pull::Args),
    /// Validate or list Wasm plugins.
    #[command(subcommand)]
    Plugins(host::cli::plugins::PluginsCommand),
    /// One rank of a model split over hosts: `host tp-worker --hostfile FILE --rank R` on
    /// each host but the first, which runs `host serve --hostfile FILE`.
    TpWorker(host::load::tp::WorkerArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => host::cli::generate::run(args),
        Command::Bench(args) => host::cli::bench::run(args),
        Command::Serve(args) => host::server::run(args),
        Command::Launch(args) => host::cli::launch::run(args),
        Command::Models(args) => host::cli::models::run(args),
        Command::Pull(args) => host::cli::pull::run(args),
        Command::Plugins(command) => host::cli::plugins::run_command(command),
        Command::TpWorker(args) => host::load::tp::worker(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
