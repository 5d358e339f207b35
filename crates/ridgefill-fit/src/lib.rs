//! Calibration pass, f64 sufficient statistics and the ridge solve that produce fill files.
//!
//! One pass over plain text runs the full model, capturing the hidden state entering the split
//! layer (features) and every upper layer's pre-RoPE K/V (targets). Only their moments are kept,
//! so shards made on different machines add up to exactly one pass over the union. The same
//! pass can feed several candidate splits at once, for `fit --split auto`
//! ([`calibrate_splits_with`], [`fit_fill_split_search`]).

pub mod calibrate;
pub mod heldout;
pub mod pipeline;
pub mod solve;
pub mod split_search;

pub use calibrate::{
    CalibConfig, Calibration, Control, Progress, SplitCalibration, calibrate,
    calibrate_splits_with, calibrate_with,
};
pub use heldout::HeldoutFidelity;
pub use pipeline::{fit_fill, fit_fill_until};
pub use solve::{AlphaChoice, FitOptions, MIN_ROWS_PER_FEATURE, min_rows, ridge_solve};
pub use split_search::{SplitBudget, SplitEvent, default_split_candidates, fit_fill_split_search};

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
        "too few calibration tokens for a stable solve: {rows} rows (tokens after each window's \
         sink) for {features} features; need at least {needed} ({per_feature} per feature; \
         give more text or a larger --max-tokens)",
        per_feature = solve::MIN_ROWS_PER_FEATURE
    )]
    TooFewTokens {
        rows: u64,
        features: usize,
        needed: u64,
    },
    #[error("the ridge system is not positive definite at alpha {alpha} (try a larger --alpha)")]
    NotPositiveDefinite { alpha: f64 },
    #[error(
        "the fitted maps contain a non-finite value ({value}) at alpha {alpha}: row {row}, \
         column {column} of the solution (the statistics are ill-conditioned or overflowed; \
         try a larger --alpha)"
    )]
    NonFinite {
        alpha: f64,
        row: usize,
        column: usize,
        value: f64,
    },
    /// The fitted maps make the model overflow on held-out text.
    #[error(
        "held-out KL at alpha {alpha} is not finite: the fitted maps make the model overflow \
         (try a larger --alpha)"
    )]
    NonFiniteKl { alpha: f64 },
    /// Every α of the `--alpha auto` grid failed (not positive definite or overflowing).
    #[error(
        "no alpha of the grid {tried:?} gives a usable fit (the last: {last}); give more \
         calibration text or a larger fixed --alpha"
    )]
    NoUsableAlpha { tried: Vec<f64>, last: String },
    /// The model produced NaN or infinity on calibration text.
    #[error(
        "non-finite {what} ({value}) in calibration window {window} at token {position}: the \
         model's activations overflowed"
    )]
    NonFiniteActivation {
        what: &'static str,
        window: usize,
        position: usize,
        value: f32,
    },
    /// `--split auto`: no candidate split is within the quality budget. Carries every
    /// candidate measured, so a caller can show them.
    #[error("{}", split_search::no_split_message(.budget, .trials))]
    NoSplitWithinBudget {
        budget: split_search::SplitBudget,
        trials: Vec<ridgefill_io::fill::SplitTrial>,
    },
    /// The caller's stop hook asked the pass or the solve to end early.
    #[error("stopped before the fit finished")]
    Stopped,
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
