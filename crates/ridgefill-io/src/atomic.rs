//! Writing a file whole or not at all: a temporary file in the target's directory, written and
//! fsynced, renamed into place, the directory fsynced. On any error the target is untouched and
//! the temporary file removed, so no reader ever sees a half-written output.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{IoError, Result};

/// Tells apart temporary files of one process writing several outputs at once.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `path` through `write`, which gets the temporary file and must leave it complete and
/// fsynced.
pub fn write_with(path: &Path, write: impl FnOnce(File) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| IoError::MissingFile {
        path: path.to_path_buf(),
        what: "file name to write to".into(),
    })?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| IoError::os(path, "write (create a temporary file in its directory)", e))?;
    let result = write(file).and_then(|()| {
        std::fs::rename(&tmp, path)
            .map_err(|e| IoError::os(path, "write (rename the temporary file into place)", e))
    });
    if result.is_err() {
        // Best effort: the error being returned matters more than a failed clean-up.
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    sync_dir(path, &dir)
}

/// Writes `bytes` to `path` whole or not at all.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |mut file| {
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(|e| IoError::os(path, "write", e))
    })
}

/// Makes the rename durable; directories cannot be opened for syncing on every platform.
fn sync_dir(path: &Path, dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| IoError::os(path, "write (fsync the directory)", e))?;
    }
    #[cfg(not(unix))]
    let _ = (path, dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_target_untouched_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.txt");
        std::fs::write(&path, "old").unwrap();
        let err = write_with(&path, |_| {
            Err(IoError::os(
                &path,
                "write",
                std::io::Error::other("disk full"),
            ))
        });
        assert!(err.unwrap_err().to_string().contains("disk full"));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        write_bytes(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
    }
}
