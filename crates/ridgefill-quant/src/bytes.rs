//! Shared, immutable weight bytes: a slice of something kept alive by an `Arc` (an owned buffer,
//! or a whole memory-mapped GGUF file), so many matrices can point into one mmap without copying.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// A read-only byte slice together with the owner that keeps it alive.
///
/// Cloning is cheap (one `Arc` increment). The bytes never change while any clone exists.
#[derive(Clone)]
pub struct WeightBytes {
    /// Keeps the memory behind `ptr` alive; never handed out mutably.
    _owner: Arc<dyn Any + Send + Sync>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: `ptr..ptr+len` is immutable memory owned by `_owner`, which is `Send + Sync`; sharing or
// sending a read-only view of it across threads is as safe as sharing `&[u8]` borrowed from it.
unsafe impl Send for WeightBytes {}
// SAFETY: as above; the type exposes only `&[u8]`.
unsafe impl Sync for WeightBytes {}

impl WeightBytes {
    /// Takes ownership of a buffer.
    pub fn from_vec(bytes: Vec<u8>) -> WeightBytes {
        // Owned as is: `Arc<[u8]>::from` would copy, briefly holding the weights twice.
        Self::from_owner(Arc::new(bytes), |b| &b[..])
    }

    /// Shares an already reference-counted buffer.
    pub fn from_arc(bytes: Arc<[u8]>) -> WeightBytes {
        Self::from_owner(Arc::new(bytes), |b| &b[..])
    }

    /// A slice chosen inside `owner` (e.g. one tensor of an `Arc<GgufFile>` that maps the file).
    ///
    /// `select` may only return memory borrowed from the owner (or `'static` memory): the borrow
    /// checker enforces this through the higher-ranked lifetime.
    pub fn from_owner<O, F>(owner: Arc<O>, select: F) -> WeightBytes
    where
        O: Send + Sync + 'static,
        F: for<'a> FnOnce(&'a O) -> &'a [u8],
    {
        let slice = select(&owner);
        let (ptr, len) = (slice.as_ptr(), slice.len());
        WeightBytes {
            _owner: owner,
            ptr,
            len,
        }
    }

    /// The bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` came from a `&[u8]` borrowed from `_owner`. The owner lives in an
        // `Arc` that this value keeps alive, and an `Arc` never hands out `&mut` while another
        // handle (ours) exists, so the borrowed memory stays valid and unchanged for `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_outlive_the_original_handle() {
        let owner = Arc::new(vec![1u8, 2, 3, 4, 5]);
        let w = WeightBytes::from_owner(owner.clone(), |v| &v[1..4]);
        drop(owner);
        let w2 = w.clone();
        drop(w);
        assert_eq!(&*w2, &[2, 3, 4]);
        assert_eq!(&*WeightBytes::from_vec(vec![7, 8]), &[7, 8]);
    }
}
