//! Turning a `-m MODEL` argument into a checkpoint on disk.

use std::path::{Path, PathBuf};

use anyhow::Result;

/// `MODEL` may be a `.gguf` file, a Hugging Face directory, or a manifest name (fetched if missing).
pub fn model_path(arg: &str) -> Result<PathBuf> {
    let p = Path::new(arg);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    if arg.contains('/') || arg.contains('\\') || arg.ends_with(".gguf") {
        anyhow::bail!("{arg}: no such file or directory");
    }
    crate::fetch::ensure(arg)
}
