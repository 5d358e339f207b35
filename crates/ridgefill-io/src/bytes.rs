//! A file's bytes: memory-mapped from disk, or owned (parsed from memory, e.g. by the fuzz targets).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

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
        let _ = mmap.advise(memmap2::Advice::Random);
        Ok(FileBytes::Map(mmap))
    }

    /// Drops `range`'s pages from the resident set once their bytes have been copied out:
    /// keeping both the copy and the mapped original resident would count the tensor twice.
    pub(crate) fn evict(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let FileBytes::Map(m) = self
            && range.end <= m.len()
        {
            // SAFETY: on a read-only shared file mapping MADV_DONTNEED only unmaps the pages;
            // a later access reads the same bytes back from the file, so no reference sees a change.
            let advice = memmap2::UncheckedAdvice::DontNeed;
            // Advice that fails only leaves the pages resident.
            let _ = unsafe { m.unchecked_advise_range(advice, range.start, range.len()) };
        }
        #[cfg(not(unix))]
        let _ = (self, range);
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

/// A range of a file's bytes that keeps the file (mapped or owned) alive: quantised weights
/// point into the mapped GGUF instead of being copied.
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<FileBytes>,
    start: usize,
    len: usize,
}

impl SharedBytes {
    /// `range` of `owner`, or `None` when it lies outside.
    pub(crate) fn new(owner: &Arc<FileBytes>, range: std::ops::Range<usize>) -> Option<Self> {
        owner.get(range.clone())?;
        Some(Self {
            owner: Arc::clone(owner),
            start: range.start,
            len: range.len(),
        })
    }

    /// Bytes owned by this value alone (e.g. rows rearranged at load).
    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            owner: Arc::new(FileBytes::Owned(bytes)),
            start: 0,
            len,
        }
    }
}

impl SharedBytes {
    /// Drops these bytes' pages from the resident set after they were copied (see [`FileBytes::evict`]).
    pub fn evict(&self) {
        self.owner.evict(self.start..self.start + self.len);
    }
}

impl std::ops::Deref for SharedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.owner[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for SharedBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes)", self.len)
    }
}
