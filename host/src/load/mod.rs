//! Device choice and model loading, below the engine: the engine thread calls it (MLX arrays
//! never leave the thread that loads them), and so do the CLI commands. Never imports the
//! engine, the server or the CLI.
//!
//! - `device.rs`: `--device` and MLX's default device;
//! - `tp/`: a model split over tensor-parallel ranks, on this machine or the hosts of a
//!   hostfile (this process is rank 0; `host tp-worker` the others);
//! - `default_model.rs`: the built-in default model, fetched on first use;
//! - `hub.rs`: `org/name[@revision]` found in the Hugging Face cache;
//! - `pull.rs`: such a model downloaded into that cache (`host pull`, or `--model` when missing).

pub mod default_model;
pub mod device;
pub mod hub;
pub mod pull;
pub mod tp;

pub use device::{select_device, DeviceChoice};
pub use tp::Split;

use anyhow::{bail, Context, Result};
use models::Loaded;
use std::path::Path;

/// Loads a draft model for `target` and checks that it shares the target's tokenizer.
pub fn load_draft(path: &Path, target: &Loaded) -> Result<Loaded> {
    let path = &pull::resolve_model_arg(path).context("the draft model")?;
    let draft = models::load(path).with_context(|| format!("loading the draft model from {}", path.display()))?;
    check_draft(target, &draft)?;
    Ok(draft)
}

/// Loads `path`, or the built-in default model (fetched on first use) when `None`.
pub fn load_model(path: Option<&Path>) -> Result<Loaded> {
    load_model_split(path, &Split::default(), DeviceChoice::Auto)
}

/// As `load_model`, split over ranks on `device` as `split` says (this process becomes rank
/// 0; see `tp/`).
pub fn load_model_split(model: Option<&Path>, split: &Split, device: DeviceChoice) -> Result<Loaded> {
    let path = match model {
        Some(p) => pull::resolve_model_arg(p)?,
        None => default_model::ensure()?,
    };
    if split.is_split() {
        return tp::load(model, &path, split, device);
    }
    models::load(&path).with_context(|| format!("loading model from {}", path.display()))
}

/// Refuses a draft model whose vocabulary differs from the target's: the same size of
/// logits row and the same token string for every id.
pub fn check_draft(target: &models::Loaded, draft: &models::Loaded) -> Result<()> {
    let (t, d) = (&target.info, &draft.info);
    let fix = "use a draft model made from the same tokenizer (e.g. a smaller model of the same family)";
    if t.vocab_size != d.vocab_size {
        bail!(
            "the draft model {} has a vocabulary of {} tokens but the model {} has {}; {fix}",
            d.source.display(),
            d.vocab_size,
            t.source.display(),
            t.vocab_size
        );
    }
    let (tv, dv) = (target.tokenizer.vocabulary(), draft.tokenizer.vocabulary());
    let mut differ: Vec<(&String, &u32)> = tv.iter().filter(|(tok, id)| dv.get(*tok) != Some(id)).collect();
    if !differ.is_empty() || tv.len() != dv.len() {
        differ.sort_by_key(|(_, id)| **id);
        let example = differ
            .first()
            .map(|(tok, id)| format!(" (e.g. {tok:?} is token {id} for the model, {:?} for the draft)", dv.get(*tok)))
            .unwrap_or_default();
        bail!(
            "the draft model {} does not share the tokenizer of {}: {} of {} token strings differ{example}; {fix}",
            d.source.display(),
            t.source.display(),
            differ.len().max(tv.len().abs_diff(dv.len())),
            tv.len()
        );
    }
    Ok(())
}
