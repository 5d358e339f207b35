//! What RidgeFill's test suites share (dev-only, never published): the tiny random Llama written
//! as GGUF and as a Hugging Face directory ([`tiny`]), the golden files from transformers with
//! their schema ([`golden`]), the `ridgefill` binary runner ([`cli`]), and with the `model`
//! feature the f64 reference forward for every family ([`reference`]), greedy decoding
//! ([`decode`]) and fill maps ([`fill`]).

pub mod cli;
#[cfg(feature = "model")]
pub mod decode;
#[cfg(feature = "model")]
pub mod fill;
pub mod golden;
#[cfg(feature = "model")]
pub mod reference;
pub mod tiny;

use std::path::{Path, PathBuf};

/// The repository root (where `tests/golden` and `tests/data` live).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/ridgefill-testkit sits two levels below the repository root")
        .to_path_buf()
}

/// Where `ridgefill fetch` puts models: `$RIDGEFILL_CACHE`, else the repository's
/// `models/cache` (the rule of `src/fetch/manifest.rs`).
pub fn models_dir() -> PathBuf {
    std::env::var_os("RIDGEFILL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("models/cache"))
}

/// A fetched model file, `rel` (`<model>/<file>`) under [`models_dir`], or `$env` when given and
/// set. A missing file fails the test, saying how to fetch it (`scripts/test.sh` fetches first).
pub fn fetched_model(rel: &str, env: Option<&str>) -> PathBuf {
    let path = env
        .and_then(std::env::var_os)
        .map(PathBuf::from)
        .unwrap_or_else(|| models_dir().join(rel));
    let model = rel.split('/').next().unwrap_or(rel);
    let set = env
        .map(|e| format!("{e} (the file) or "))
        .unwrap_or_default();
    assert!(
        path.is_file(),
        "{} not found: run `cargo run --release -- fetch {model}` first (scripts/test.sh does), \
         or set {set}RIDGEFILL_CACHE (where fetch put it)",
        path.display()
    );
    path
}

/// `n` token ids spread over a vocabulary of `vocab` (the same prompt every run).
pub fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// The largest |a - b| over two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Asserts an error message names the file and every given needle.
pub fn assert_names(err: &ridgefill_io::IoError, path: &Path, needles: &[&str]) {
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name {}: {msg}",
        path.display()
    );
    for n in needles {
        assert!(msg.contains(n), "message does not mention {n:?}: {msg}");
    }
}
