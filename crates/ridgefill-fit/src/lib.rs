//! Calibration pass, f64 sufficient statistics and the ridge solve that produce fill files.
//! Not yet implemented: the crate is in the workspace so its dependencies (faer) are part of the
//! one shared release build that both `cargo run` and `cargo test` reuse.
