//! Parsing a GGUF file's header: metadata, tensor descriptors and the data offset, every count
//! and length checked against the bytes before anything is allocated, every error naming the
//! file and the field.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::value::{MetaArray, MetaValue, ValueType};
use super::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufTensorInfo, MAX_DIMS, SUPPORTED_VERSIONS,
    align_up,
};
use crate::error::{IoError, Result};
use crate::quant::GgmlType;

/// Arrays of arrays deeper than this are rejected so recursion stays shallow.
const MAX_ARRAY_NESTING: usize = 8;
/// Smallest possible KV pair: u64 key length, u32 value type, one byte of value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible tensor info: u64 name length, u32 n_dims, one u64 dim, u32 type, u64 offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// Largest ggml dimension (ggml stores them as int64).
const MAX_DIM: u64 = i64::MAX as u64;

pub(super) struct Parsed {
    pub(super) version: u32,
    pub(super) metadata: BTreeMap<String, MetaValue>,
    pub(super) tensors: Vec<GgufTensorInfo>,
    pub(super) alignment: u64,
    pub(super) data_offset: u64,
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

pub(super) fn parse(path: &Path, buf: &[u8]) -> Result<Parsed> {
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
