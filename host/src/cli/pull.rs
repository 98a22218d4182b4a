//! `host pull org/name[@revision]`: downloads a model from the Hugging Face hub into the hub's
//! own cache ahead of time (what `--model org/name` would otherwise fetch at start), showing
//! progress, resuming a cut download, and prints the path `--model` will load.

use crate::load::{hub, pull};
use anyhow::{bail, Result};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model as the hub names it: `org/name`, or `org/name@revision` (a branch, tag or commit).
    pub name: String,
    /// Fetch the repository's files matching this name instead (`*` matches anything;
    /// repeatable), e.g. one GGUF file of several: `--include '*Q4_K_M.gguf'`.
    #[arg(long)]
    pub include: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    let Some(name) = hub::HubName::parse(&args.name) else {
        bail!(
            "{:?} is not a model name as the hub writes it: org/name or org/name@revision (letters, digits, '-', '_', '.')",
            args.name
        );
    };
    let root = hub::cache_root()?;
    let path = pull::pull(&name, &root, &args.include)?;
    println!("{}", path.display());
    Ok(())
}
