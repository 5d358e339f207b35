//! Calibration pass, f64 sufficient statistics and the ridge solve that produce fill files.
//!
//! One pass over plain text runs the full model, capturing the hidden state entering the split
//! layer (features) and every upper layer's pre-RoPE K/V (targets). Only their moments are kept,
//! so shards made on different machines add up to exactly one pass over the union.

pub mod calibrate;
pub mod solve;

pub use calibrate::{CalibConfig, Calibration, Progress, calibrate};
pub use solve::{AlphaChoice, FitOptions, fit_fill, ridge_solve};

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, FitError>;

#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error(transparent)]
    Model(#[from] ridgefill_model::ModelError),
    /// Boxed: the format errors are large and would bloat every `Result` here.
    #[error(transparent)]
    Io(Box<ridgefill_io::IoError>),
    #[error(
        "too few calibration tokens for a stable solve: {rows} rows of {features} features; \
         need at least {needed} (give more text or a larger --max-tokens)"
    )]
    TooFewTokens {
        rows: u64,
        features: usize,
        needed: u64,
    },
    #[error("the ridge system is not positive definite at alpha {alpha} (try a larger --alpha)")]
    NotPositiveDefinite { alpha: f64 },
    #[error("the fitted maps contain a non-finite value at alpha {alpha} (column {column})")]
    NonFinite { alpha: f64, column: usize },
    #[error("{}: {message}", .path.display())]
    Stats { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

impl From<ridgefill_io::IoError> for FitError {
    fn from(e: ridgefill_io::IoError) -> Self {
        Self::Io(Box::new(e))
    }
}
