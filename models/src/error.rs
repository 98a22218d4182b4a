//! The crate's one error type. Messages name the file or key and say what was expected.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("unsupported model_type {found:?} in {config}; supported: {supported}")]
    UnsupportedModel { found: String, config: PathBuf, supported: String },
    #[error("weight {name:?} not found in {path}; is this a {arch} checkpoint?")]
    MissingWeight { name: String, path: PathBuf, arch: String },
    #[error("weight {name:?} in {path} has shape {found:?}, expected {expected:?}")]
    WeightShape { name: String, path: PathBuf, found: Vec<usize>, expected: Vec<usize> },
    #[error("{path} is not a valid safetensors file: {message}; re-download or re-convert it")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Gguf { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;
