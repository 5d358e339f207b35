//! GGUF v2/v3 reader (memory-mapped; header counts are checked against the file before allocating) and a small writer.

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
/// Arrays of arrays deeper than this are rejected so recursion stays shallow.
const MAX_ARRAY_NESTING: usize = 8;
/// Smallest possible KV pair: u64 key length, u32 value type, one byte of value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible tensor info: u64 name length, u32 n_dims, one u64 dim, u32 type, u64 offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// Largest ggml dimension (ggml stores them as int64).
const MAX_DIM: u64 = i64::MAX as u64;

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
        let parsed = parse(&path, &mmap)?;
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

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// A bounds-checked little-endian cursor whose errors name the file and the field.
struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(IoError::Truncated {
                path: self.path.to_path_buf(),
                field: field(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in the rest of the file.
    fn check_count(&self, count: u64, min_size: u64, field: &dyn Fn() -> String) -> Result<usize> {
        let needed = u128::from(count) * u128::from(min_size);
        if needed > u128::from(self.remaining()) {
            return Err(IoError::LengthExceedsFile {
                path: self.path.to_path_buf(),
                field: field(),
                claimed: count,
                needed,
                available: self.remaining(),
            });
        }
        // Bounded by the file length, which fits in usize because it is mapped.
        Ok(count as usize)
    }

    fn raw_string(&mut self, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        // take() bounds-checks before slicing, so a huge length is a Truncated error, not an allocation.
        let len = self.u64(field)?;
        self.take(len, field)
    }
}

fn utf8(path: &Path, key: &str, bytes: &[u8]) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|e| IoError::BadMetadata {
        path: path.to_path_buf(),
        key: key.to_string(),
        expected: "a UTF-8 string".into(),
        found: format!("invalid UTF-8 at byte {}", e.utf8_error().valid_up_to()),
    })
}

fn parse(path: &Path, buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { path, buf, pos: 0 };
    let magic: [u8; 4] = c.array(&|| "header magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(IoError::BadMagic {
            path: path.to_path_buf(),
            found: String::from_utf8_lossy(&magic).into_owned(),
        });
    }
    let version = c.u32(&|| "header version".into())?;
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(IoError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
        });
    }
    let n_tensors = c.u64(&|| "header tensor_count".into())?;
    let n_kv = c.u64(&|| "header kv_count".into())?;
    let n_kv = c.check_count(n_kv, MIN_KV_BYTES, &|| "header kv_count".into())?;
    let n_tensors = c.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, &|| {
        "header tensor_count".into()
    })?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key_field = || format!("metadata entry #{i} key");
        let key = c.raw_string(&key_field)?;
        let key = utf8(path, &key_field(), key)?;
        let field = || format!("metadata key {key:?}");
        let type_id = c.u32(&field)?;
        let ty = value_type(path, &key, type_id)?;
        let value = read_value(&mut c, &key, ty, 0)?;
        if metadata.contains_key(&key) {
            return Err(IoError::BadMetadata {
                path: path.to_path_buf(),
                key,
                expected: "each key once".into(),
                found: "a duplicate".into(),
            });
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(IoError::BadMetadata {
                    path: path.to_path_buf(),
                    key: ALIGNMENT_KEY.into(),
                    expected: "a power-of-two integer".into(),
                    found: match v.as_u64() {
                        Some(a) => a.to_string(),
                        None => v.describe(),
                    },
                });
            }
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut seen = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name_field = || format!("tensor info #{i} name");
        let name = c.raw_string(&name_field)?;
        let name = String::from_utf8(name.to_vec()).map_err(|e| IoError::BadTensor {
            path: path.to_path_buf(),
            tensor: format!("#{i}"),
            what: "name".into(),
            expected: "UTF-8".into(),
            found: format!("invalid UTF-8 at byte {}", e.utf8_error().valid_up_to()),
        })?;
        let field = || format!("tensor info {name:?}");
        let bad = |what: &str, expected: String, found: String| IoError::BadTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            what: what.into(),
            expected,
            found,
        };
        let n_dims = c.u32(&field)?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(bad("n_dims", format!("1..={MAX_DIMS}"), n_dims.to_string()));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = c.u64(&field)?;
            if d > MAX_DIM {
                return Err(bad("dimension", format!("<= {MAX_DIM}"), d.to_string()));
            }
            ne.push(d);
        }
        let type_id = c.u32(&field)?;
        let offset = c.u64(&field)?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| IoError::UnknownGgmlType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            type_id,
        })?;
        let n_elements = ne
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= MAX_DIM)
            .ok_or_else(|| bad("element count", "no overflow".into(), format!("{ne:?}")))?;
        if ne[0] % ggml_type.block_size() as u64 != 0 {
            return Err(bad(
                "row length ne[0]",
                format!(
                    "a multiple of the {ggml_type} block size {}",
                    ggml_type.block_size()
                ),
                ne[0].to_string(),
            ));
        }
        let n_bytes = ggml_type
            .bytes_for(n_elements)
            .ok_or_else(|| bad("byte size", "no overflow".into(), format!("{ne:?}")))?;
        if offset % alignment != 0 {
            return Err(bad(
                "data offset",
                format!("a multiple of the alignment {alignment}"),
                offset.to_string(),
            ));
        }
        if seen.insert(name.clone(), i).is_some() {
            return Err(bad("name", "unique".into(), "a duplicate".into()));
        }
        tensors.push(GgufTensorInfo {
            name,
            ne,
            ggml_type,
            offset,
            n_bytes,
        });
    }

    let data_offset = align_up(c.pos as u64, alignment);
    let file_len = buf.len() as u64;
    for t in &tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        match end {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(IoError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: t.name.clone(),
                    what: "data range".into(),
                    expected: format!("to end within the file ({file_len} bytes)"),
                    found: format!(
                        "offset {} + data section {} + {} bytes",
                        t.offset, data_offset, t.n_bytes
                    ),
                });
            }
        }
    }

    check_no_overlap(path, &tensors, data_offset)?;

    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// Tensor data ranges must not overlap (llama.cpp even requires them back to back), so reading
/// every tensor touches each byte of the file at most once.
fn check_no_overlap(path: &Path, tensors: &[GgufTensorInfo], data_offset: u64) -> Result<()> {
    let mut order: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (prev, next) = (pair[0], pair[1]);
        // Both ranges were checked to end within the file, so these sums cannot overflow.
        let prev_end = prev.offset + prev.n_bytes;
        if next.offset < prev_end {
            return Err(IoError::BadTensor {
                path: path.to_path_buf(),
                tensor: next.name.clone(),
                what: "data range".into(),
                expected: format!(
                    "to start at or after the end of tensor {:?} (data section offset {prev_end}, file offset {})",
                    prev.name,
                    data_offset + prev_end
                ),
                found: format!("data section offset {}", next.offset),
            });
        }
    }
    Ok(())
}

/// Rounds `x` up to a multiple of the power of two `align`.
pub(crate) fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

fn value_type(path: &Path, key: &str, id: u32) -> Result<ValueType> {
    ValueType::from_id(id).ok_or_else(|| IoError::BadMetadata {
        path: path.to_path_buf(),
        key: key.to_string(),
        expected: "a value type id 0..=12".into(),
        found: id.to_string(),
    })
}

fn read_value(c: &mut Cursor<'_>, key: &str, ty: ValueType, depth: usize) -> Result<MetaValue> {
    let field = || format!("metadata key {key:?}");
    Ok(match ty {
        ValueType::U8 => MetaValue::U8(u8::from_le_bytes(c.array(&field)?)),
        ValueType::I8 => MetaValue::I8(i8::from_le_bytes(c.array(&field)?)),
        ValueType::U16 => MetaValue::U16(u16::from_le_bytes(c.array(&field)?)),
        ValueType::I16 => MetaValue::I16(i16::from_le_bytes(c.array(&field)?)),
        ValueType::U32 => MetaValue::U32(u32::from_le_bytes(c.array(&field)?)),
        ValueType::I32 => MetaValue::I32(i32::from_le_bytes(c.array(&field)?)),
        ValueType::F32 => MetaValue::F32(f32::from_le_bytes(c.array(&field)?)),
        ValueType::U64 => MetaValue::U64(u64::from_le_bytes(c.array(&field)?)),
        ValueType::I64 => MetaValue::I64(i64::from_le_bytes(c.array(&field)?)),
        ValueType::F64 => MetaValue::F64(f64::from_le_bytes(c.array(&field)?)),
        ValueType::Bool => MetaValue::Bool(read_bool(c, key, &field)?),
        ValueType::String => MetaValue::String(utf8(c.path, key, c.raw_string(&field)?)?),
        ValueType::Array => MetaValue::Array(read_array(c, key, depth)?),
    })
}

fn read_bool(c: &mut Cursor<'_>, key: &str, field: &dyn Fn() -> String) -> Result<bool> {
    match c.array::<1>(field)?[0] {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(IoError::BadMetadata {
            path: c.path.to_path_buf(),
            key: key.to_string(),
            expected: "a bool (0 or 1)".into(),
            found: b.to_string(),
        }),
    }
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<MetaArray> {
    let field = || format!("metadata key {key:?} array");
    if depth >= MAX_ARRAY_NESTING {
        return Err(IoError::BadMetadata {
            path: c.path.to_path_buf(),
            key: key.to_string(),
            expected: format!("arrays nested at most {MAX_ARRAY_NESTING} deep"),
            found: "deeper nesting".into(),
        });
    }
    let elem = c.u32(&field)?;
    let elem = value_type(c.path, key, elem)?;
    let count = c.u64(&field)?;
    let n = c.check_count(count, elem.min_encoded_size(), &|| {
        format!("metadata key {key:?} array length")
    })?;

    macro_rules! fixed {
        ($t:ty, $v:ident) => {{
            const W: usize = std::mem::size_of::<$t>();
            let bytes = c.take((n * W) as u64, &field)?;
            MetaArray::$v(
                bytes
                    .chunks_exact(W)
                    .map(|b| <$t>::from_le_bytes(b.try_into().unwrap_or([0; W])))
                    .collect(),
            )
        }};
    }
    Ok(match elem {
        ValueType::U8 => fixed!(u8, U8),
        ValueType::I8 => fixed!(i8, I8),
        ValueType::U16 => fixed!(u16, U16),
        ValueType::I16 => fixed!(i16, I16),
        ValueType::U32 => fixed!(u32, U32),
        ValueType::I32 => fixed!(i32, I32),
        ValueType::F32 => fixed!(f32, F32),
        ValueType::U64 => fixed!(u64, U64),
        ValueType::I64 => fixed!(i64, I64),
        ValueType::F64 => fixed!(f64, F64),
        ValueType::Bool => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_bool(c, key, &field)?);
            }
            MetaArray::Bool(v)
        }
        ValueType::String => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(utf8(c.path, key, c.raw_string(&field)?)?);
            }
            MetaArray::String(v)
        }
        ValueType::Array => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            MetaArray::Array(v)
        }
    })
}
