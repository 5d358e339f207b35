//! A file's bytes: memory-mapped from disk, or owned (parsed from memory, e.g. by the fuzz targets).

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{IoError, Result};

pub(crate) enum FileBytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl FileBytes {
    /// Maps `path` read-only; an empty file becomes an empty buffer (mapping it fails on some platforms).
    pub(crate) fn map(path: &Path) -> Result<FileBytes> {
        let file = File::open(path).map_err(|e| IoError::os(path, "open", e))?;
        let len = file
            .metadata()
            .map_err(|e| IoError::os(path, "stat", e))?
            .len();
        if len == 0 {
            return Ok(FileBytes::Owned(Vec::new()));
        }
        // SAFETY: read-only map; like every mmap loader we assume the file is not truncated while open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| IoError::os(path, "memory-map", e))?;
        Ok(FileBytes::Map(mmap))
    }
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Map(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}
