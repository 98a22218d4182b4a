//! The crate's one error type.

/// An MLX call failed; the message is MLX's own (shape mismatch, out of memory, bad file).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("mlx: {0}")]
    Mlx(String),
    #[error("{0}")]
    Invalid(String),
}

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}

pub type Result<T> = std::result::Result<T, Error>;
