//! GGUF v2/v3 reader (memory-mapped; header counts are checked against the file before allocating) and a small writer.

mod parse;
mod value;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use value::{MetaArray, MetaValue, ValueType};

use crate::bytes::{FileBytes, SharedBytes};
use crate::error::{IoError, Result};
use crate::quant::{self, GgmlType};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Versions this reader accepts (v1 used 32-bit counts and is obsolete).
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];
/// Version the writer emits.
pub const WRITE_VERSION: u32 = 3;
/// Metadata key overriding the tensor data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Alignment used when [`ALIGNMENT_KEY`] is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most this many dimensions.
pub const MAX_DIMS: usize = 4;
/// One tensor's descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// GGUF tensor name, e.g. "blk.0.attn_q.weight".
    pub name: String,
    /// Dimensions in ggml order: `ne[0]` is the fastest-varying (row length).
    pub ne: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    /// Total number of elements.
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Shape in row-major (PyTorch) order, i.e. `ne` reversed.
    pub fn shape_row_major(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A memory-mapped (or in-memory) GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Arc<FileBytes>,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file; tensor data is mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let bytes = FileBytes::map(&path)?;
        Self::from_storage(path, bytes)
    }

    /// Parses and validates a GGUF image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_storage(path.into(), FileBytes::Owned(bytes))
    }

    fn from_storage(path: PathBuf, mmap: FileBytes) -> Result<GgufFile> {
        let parsed = parse::parse(&path, &mmap)?;
        Ok(GgufFile {
            path,
            mmap: Arc::new(mmap),
            version: parsed.version,
            metadata: parsed.metadata,
            index: parsed
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Length of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// All metadata, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// Drops metadata values whose contents were copied elsewhere (e.g. the vocabulary into a
    /// tokenizer); later reads of them find nothing.
    pub fn forget_metadata(&mut self, keys: &[&str]) {
        for k in keys {
            self.metadata.remove(*k);
        }
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// Tensor descriptors in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// A tensor's descriptor, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's raw bytes (bounds were checked at open).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| IoError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        Ok(self.bytes_of(info))
    }

    /// Raw bytes of a tensor described by `info` (which must come from this file).
    pub fn bytes_of(&self, info: &GgufTensorInfo) -> &[u8] {
        self.range_of(info)
            .and_then(|r| self.mmap.get(r))
            .unwrap_or(&[])
    }

    /// The tensor's byte range in the file, checked again so a descriptor from another file
    /// yields nothing rather than a panic.
    fn range_of(&self, info: &GgufTensorInfo) -> Option<std::ops::Range<usize>> {
        let start = self.data_offset.checked_add(info.offset)?;
        let end = start.checked_add(info.n_bytes)?;
        Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    /// [`GgufFile::bytes_of`] as a range that keeps the mapping alive (empty when out of range).
    pub fn shared_bytes_of(&self, info: &GgufTensorInfo) -> SharedBytes {
        self.range_of(info)
            .and_then(|r| SharedBytes::new(&self.mmap, r))
            .unwrap_or_else(|| SharedBytes::owned(Vec::new()))
    }

    /// Dequantises a tensor to f32 in GGUF storage order (`ne[0]` fastest).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| IoError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        let raw = self.bytes_of(info);
        let data = quant::dequantize(info.ggml_type, raw, info.n_elements() as usize).map_err(
            |source| IoError::Dequantize {
                path: self.path.clone(),
                tensor: name.to_string(),
                source,
            },
        )?;
        if let Some(r) = self.range_of(info) {
            self.mmap.evict(r);
        }
        Ok(data)
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &MetaValue) -> IoError {
        IoError::BadMetadata {
            path: self.path.clone(),
            key: key.to_string(),
            expected: expected.to_string(),
            found: found.describe(),
        }
    }

    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.metadata
            .get(key)
            .ok_or_else(|| IoError::MissingMetadata {
                path: self.path.clone(),
                key: key.to_string(),
            })
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        conv: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => conv(v)
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, expected, v)),
        }
    }

    fn required<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        conv: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<T> {
        let v = self.require(key)?;
        conv(v).ok_or_else(|| self.wrong_type(key, expected, v))
    }

    /// Unsigned integer of any width that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.required(key, "an integer fitting u32", as_u32)
    }

    /// Like [`Self::get_u32`], `None` when absent.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "an integer fitting u32", as_u32)
    }

    /// Non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.required(key, "a non-negative integer", MetaValue::as_u64)
    }

    /// Like [`Self::get_u64`], `None` when absent.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", MetaValue::as_u64)
    }

    /// Non-negative integer that fits in usize.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.required(key, "a non-negative integer", as_usize)
    }

    /// Like [`Self::get_usize`], `None` when absent.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "a non-negative integer", as_usize)
    }

    /// Signed integer of any width.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.required(key, "an integer", MetaValue::as_i64)
    }

    /// A float (f32 or f64), narrowed to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.required(key, "a float", |v| v.as_f64().map(|x| x as f32))
    }

    /// Like [`Self::get_f32`], `None` when absent.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "a float", |v| v.as_f64().map(|x| x as f32))
    }

    /// A float (f32 or f64) as f64.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.required(key, "a float", MetaValue::as_f64)
    }

    /// Like [`Self::get_f64`], `None` when absent.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a float", MetaValue::as_f64)
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.required(key, "a bool", MetaValue::as_bool)
    }

    /// Like [`Self::get_bool`], `None` when absent.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", MetaValue::as_bool)
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.required(key, "a string", MetaValue::as_str)
    }

    /// Like [`Self::get_str`], `None` when absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetaValue::as_str)
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&MetaArray> {
        self.required(key, "an array", MetaValue::as_array)
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        self.required(key, "an array of string", as_str_array)
    }

    /// Like [`Self::get_str_array`], `None` when absent.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        self.typed(key, "an array of string", as_str_array)
    }

    /// An array of integers (any width), widened to i64.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        self.required(key, "an array of integers", |v| {
            v.as_array().and_then(MetaArray::to_i64_vec)
        })
    }

    /// Like [`Self::get_int_array`], `None` when absent.
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.typed(key, "an array of integers", |v| {
            v.as_array().and_then(MetaArray::to_i64_vec)
        })
    }

    /// An array of floats (f32 or f64), widened to f64.
    pub fn get_float_array(&self, key: &str) -> Result<Vec<f64>> {
        self.required(key, "an array of floats", |v| {
            v.as_array().and_then(MetaArray::to_f64_vec)
        })
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }
}

fn as_u32(v: &MetaValue) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

fn as_usize(v: &MetaValue) -> Option<usize> {
    v.as_u64().and_then(|x| usize::try_from(x).ok())
}

fn as_str_array(v: &MetaValue) -> Option<&[String]> {
    match v {
        MetaValue::Array(MetaArray::String(s)) => Some(s.as_slice()),
        _ => None,
    }
}

/// Rounds `x` up to a multiple of the power of two `align`.
pub(crate) fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}
