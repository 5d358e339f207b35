use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, ModelError>;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Boxed: the format errors are large and would bloat every `Result` here.
    #[error(transparent)]
    Io(Box<ridgefill_io::IoError>),
    #[error("{path}: unsupported architecture {found:?} (supported: llama, mistral)")]
    UnsupportedArchitecture { path: PathBuf, found: String },
    #[error(
        "{path}: tensor {tensor} has {found} elements, expected {expected} for shape {shape:?}"
    )]
    TensorSize {
        path: PathBuf,
        tensor: String,
        expected: usize,
        found: usize,
        shape: Vec<usize>,
    },
    #[error("{path}: tensor {tensor} contains a non-finite value (NaN or Inf) at index {index}")]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: usize,
    },
    #[error("KV cache holds {capacity} positions, but {needed} are needed")]
    CacheFull { capacity: usize, needed: usize },
    #[error("empty token sequence")]
    EmptyInput,
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("device {0:?} is not available: {1}")]
    DeviceUnavailable(String, String),
    #[error("{0}")]
    Invalid(String),
}

impl From<ridgefill_io::IoError> for ModelError {
    fn from(e: ridgefill_io::IoError) -> Self {
        Self::Io(Box::new(e))
    }
}
