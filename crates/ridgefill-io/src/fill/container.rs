//! The safetensors container shared by fill and statistics files: validated reads, atomic writes.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use serde_json::Value;

use crate::bytes::FileBytes;
use crate::error::{IoError, Result};

/// Bytes of the little-endian header length that starts every safetensors file.
const LEN_BYTES: usize = 8;
/// The safetensors crate refuses headers longer than this when reading.
const MAX_HEADER_BYTES: usize = 100_000_000;
/// Elements converted per write call, so no tensor is copied whole into a byte buffer.
const WRITE_CHUNK_ELEMS: usize = 1 << 16;
/// Write buffer size for the temporary file.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// A safetensors file mapped into memory with its header parsed and checked against its length.
pub(crate) struct Reader {
    path: PathBuf,
    bytes: FileBytes,
    data_start: usize,
    meta: Metadata,
}

impl Reader {
    pub(crate) fn open(path: &Path) -> Result<Reader> {
        Self::from_storage(path, FileBytes::map(path)?)
    }

    /// A safetensors image held in memory; `path` only names it in errors.
    pub(crate) fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Reader> {
        Self::from_storage(path, FileBytes::Owned(bytes))
    }

    fn from_storage(path: &Path, bytes: FileBytes) -> Result<Reader> {
        let len = bytes.len();
        // The safetensors reader bounds the header length by the buffer and checks every
        // offset and size against it.
        let (header_len, meta) =
            SafeTensors::read_metadata(&bytes).map_err(|e| IoError::Safetensors {
                path: path.to_path_buf(),
                message: format!("{e} (file is {len} bytes)"),
            })?;
        Ok(Reader {
            path: path.to_path_buf(),
            bytes,
            data_start: LEN_BYTES + header_len,
            meta,
        })
    }

    /// The JSON value stored under `key` in `__metadata__`.
    pub(crate) fn metadata_json(&self, key: &str) -> Result<Value> {
        let raw = self
            .meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(key))
            .ok_or_else(|| IoError::MissingMetadata {
                path: self.path.clone(),
                key: format!("__metadata__.{key}"),
            })?;
        serde_json::from_str(raw).map_err(|e| IoError::BadMetadata {
            path: self.path.clone(),
            key: format!("__metadata__.{key}"),
            expected: "a JSON object".into(),
            found: format!("invalid JSON ({e})"),
        })
    }

    /// Every tensor's header entry, by name.
    pub(crate) fn tensors(&self) -> BTreeMap<String, &TensorInfo> {
        self.meta.tensors().into_iter().collect()
    }

    /// A tensor's raw bytes; `info` must come from [`Reader::tensors`] (offsets checked on open).
    fn data(&self, info: &TensorInfo) -> &[u8] {
        let (s, e) = info.data_offsets;
        match (
            self.data_start.checked_add(s),
            self.data_start.checked_add(e),
        ) {
            (Some(start), Some(end)) => self.bytes.get(start..end).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// Checks a tensor's shape and dtype; returns its header entry.
    pub(crate) fn expect(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<&TensorInfo> {
        let info = self.meta.info(name).ok_or_else(|| IoError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        if info.shape != shape {
            return Err(IoError::BadTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
                what: "shape".into(),
                expected: format!("{shape:?}"),
                found: format!("{:?}", info.shape),
            });
        }
        if !dtypes.contains(&info.dtype) {
            let expected: Vec<String> = dtypes.iter().map(Dtype::to_string).collect();
            return Err(IoError::BadTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
                what: "dtype".into(),
                expected: expected.join(" or "),
                found: info.dtype.to_string(),
            });
        }
        Ok(info)
    }

    /// An F32 or F16 tensor as finite f32 values.
    pub(crate) fn f32_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let info = self.expect(name, shape, &[Dtype::F32, Dtype::F16])?;
        let data = self.data(info);
        let out: Vec<f32> = match info.dtype {
            Dtype::F16 => data
                .chunks_exact(size_of::<u16>())
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            _ => data
                .chunks_exact(size_of::<f32>())
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        };
        if let Some(index) = out.iter().position(|v| !v.is_finite()) {
            return Err(self.non_finite(name, index, f64::from(out[index])));
        }
        Ok(out)
    }

    /// An F64 tensor as finite f64 values.
    pub(crate) fn f64_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f64>> {
        let info = self.expect(name, shape, &[Dtype::F64])?;
        let out = decode_f64(self.data(info));
        if let Some(index) = out.iter().position(|v| !v.is_finite()) {
            return Err(self.non_finite(name, index, out[index]));
        }
        Ok(out)
    }

    /// A one-element F64 or I64 tensor holding a non-negative whole count.
    pub(crate) fn count(&self, name: &str) -> Result<u64> {
        let info = self.expect(name, &[1], &[Dtype::F64, Dtype::I64])?;
        let data = self.data(info);
        let bad = |found: String| IoError::BadTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
            what: "value".into(),
            expected: "a non-negative whole number".into(),
            found,
        };
        match info.dtype {
            Dtype::I64 => {
                let v = decode_i64(data)[0];
                u64::try_from(v).map_err(|_| bad(v.to_string()))
            }
            _ => {
                let v = decode_f64(data)[0];
                // Above 2^53 an f64 no longer holds every whole number exactly.
                let exact_limit = (1u64 << f64::MANTISSA_DIGITS) as f64;
                if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= exact_limit {
                    Ok(v as u64)
                } else {
                    Err(bad(v.to_string()))
                }
            }
        }
    }

    fn non_finite(&self, name: &str, index: usize, value: f64) -> IoError {
        IoError::NonFinite {
            path: self.path.clone(),
            tensor: name.to_string(),
            index,
            value,
        }
    }
}

fn decode_f64(data: &[u8]) -> Vec<f64> {
    data.chunks_exact(size_of::<f64>())
        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect()
}

fn decode_i64(data: &[u8]) -> Vec<i64> {
    data.chunks_exact(size_of::<i64>())
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect()
}

/// Values of one tensor to write, with the dtype they are stored as.
pub(crate) enum OutData<'a> {
    F32(&'a [f32]),
    /// f32 values stored as IEEE half precision.
    F16(&'a [f32]),
    F64(&'a [f64]),
    I64(&'a [i64]),
}

impl OutData<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            OutData::F32(_) => Dtype::F32,
            OutData::F16(_) => Dtype::F16,
            OutData::F64(_) => Dtype::F64,
            OutData::I64(_) => Dtype::I64,
        }
    }

    fn len(&self) -> usize {
        match self {
            OutData::F32(v) | OutData::F16(v) => v.len(),
            OutData::F64(v) => v.len(),
            OutData::I64(v) => v.len(),
        }
    }

    fn byte_len(&self) -> usize {
        self.len() * self.dtype().bitsize() / u8::BITS as usize
    }

    /// The first NaN or infinity (f16 overflow is checked separately, with its own message).
    fn first_non_finite(&self) -> Option<(usize, f64)> {
        match self {
            OutData::F16(v) | OutData::F32(v) => v
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| (i, f64::from(v[i]))),
            OutData::F64(v) => v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i])),
            OutData::I64(_) => None,
        }
    }

    fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(WRITE_CHUNK_ELEMS * size_of::<f64>());
        let mut emit = |buf: &mut Vec<u8>| -> std::io::Result<()> {
            w.write_all(buf)?;
            buf.clear();
            Ok(())
        };
        match self {
            OutData::F32(v) => {
                for c in v.chunks(WRITE_CHUNK_ELEMS) {
                    c.iter()
                        .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
                    emit(&mut buf)?;
                }
            }
            OutData::F16(v) => {
                for c in v.chunks(WRITE_CHUNK_ELEMS) {
                    c.iter().for_each(|x| {
                        buf.extend_from_slice(&half::f16::from_f32(*x).to_le_bytes())
                    });
                    emit(&mut buf)?;
                }
            }
            OutData::F64(v) => {
                for c in v.chunks(WRITE_CHUNK_ELEMS) {
                    c.iter()
                        .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
                    emit(&mut buf)?;
                }
            }
            OutData::I64(v) => {
                for c in v.chunks(WRITE_CHUNK_ELEMS) {
                    c.iter()
                        .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
                    emit(&mut buf)?;
                }
            }
        }
        Ok(())
    }
}

/// One tensor to write.
pub(crate) struct OutTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: OutData<'a>,
}

/// Writes a safetensors file with `metadata[key] = json` through a temporary file in the same
/// directory: fsync, rename, fsync the directory. On any error the target is untouched.
pub(crate) fn write_atomic(
    path: &Path,
    key: &str,
    json: String,
    tensors: &[OutTensor],
) -> Result<()> {
    let header = build_header(path, key, json, tensors)?;
    crate::atomic::write_with(path, |file| write_body(path, file, &header, tensors))
}

fn write_body(path: &Path, file: File, header: &[u8], tensors: &[OutTensor]) -> Result<()> {
    let mut w = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
    let io = |e| IoError::os(path, "write", e);
    w.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(header).map_err(io)?;
    for t in tensors {
        t.data.write_to(&mut w).map_err(io)?;
    }
    let file = w
        .into_inner()
        .map_err(|e| IoError::os(path, "write", e.into_error()))?;
    file.sync_all()
        .map_err(|e| IoError::os(path, "write (fsync)", e))
}

/// The padded JSON header, after checking every tensor's length and finiteness.
fn build_header(path: &Path, key: &str, json: String, tensors: &[OutTensor]) -> Result<Vec<u8>> {
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for t in tensors {
        let elems = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if elems != Some(t.data.len()) {
            return Err(IoError::BadTensor {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                what: "number of values".into(),
                expected: format!(
                    "{} for shape {:?}",
                    elems.map_or("overflow".into(), |e| e.to_string()),
                    t.shape
                ),
                found: t.data.len().to_string(),
            });
        }
        if let Some((index, value)) = t.data.first_non_finite() {
            return Err(IoError::NonFinite {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                index,
                value,
            });
        }
        if let OutData::F16(v) = t.data
            && let Some(index) = v.iter().position(|x| !half::f16::from_f32(*x).is_finite())
        {
            return Err(IoError::BadTensor {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                what: format!("element {index} stored as F16"),
                expected: format!("a magnitude of at most {} (the F16 range)", half::f16::MAX),
                found: v[index].to_string(),
            });
        }
        let end = offset + t.data.byte_len();
        infos.push((
            t.name.clone(),
            TensorInfo {
                dtype: t.data.dtype(),
                shape: t.shape.clone(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let meta =
        Metadata::new(Some(HashMap::from([(key.to_string(), json)])), infos).map_err(|e| {
            IoError::Safetensors {
                path: path.to_path_buf(),
                message: format!("cannot build the header: {e}"),
            }
        })?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| IoError::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    // Tensor data must start 8-byte aligned; safetensors pads the header with spaces.
    header.resize(header.len().next_multiple_of(LEN_BYTES), b' ');
    if header.len() > MAX_HEADER_BYTES {
        return Err(IoError::BadMetadata {
            path: path.to_path_buf(),
            key: format!("__metadata__.{key}"),
            expected: format!("a header of at most {MAX_HEADER_BYTES} bytes"),
            found: format!("{} bytes", header.len()),
        });
    }
    Ok(header)
}

/// Reads `format_version` from a metadata object before the rest is parsed, so a newer file
/// gets a version error rather than a schema error.
pub(crate) fn check_version(path: &Path, key: &str, json: &Value, supported: u32) -> Result<()> {
    check_versions(path, key, json, &[supported]).map(|_| ())
}

/// Checks `format_version` is one of `supported` (before the rest is parsed) and returns it.
pub(crate) fn check_versions(
    path: &Path,
    key: &str,
    json: &Value,
    supported: &[u32],
) -> Result<u32> {
    let field = format!("{key}.format_version");
    let v = json
        .get("format_version")
        .ok_or_else(|| IoError::MissingMetadata {
            path: path.to_path_buf(),
            key: field.clone(),
        })?;
    match v.as_u64().and_then(|v| u32::try_from(v).ok()) {
        Some(found) if supported.contains(&found) => Ok(found),
        _ => Err(IoError::BadMetadata {
            path: path.to_path_buf(),
            key: field,
            expected: supported
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" or "),
            found: v.to_string(),
        }),
    }
}

/// Parses the metadata object into its typed form; serde's message names the bad field.
pub(crate) fn parse_meta<T: serde::de::DeserializeOwned>(
    path: &Path,
    key: &str,
    json: Value,
    what: &str,
) -> Result<T> {
    serde_json::from_value(json).map_err(|e| IoError::BadMetadata {
        path: path.to_path_buf(),
        key: key.to_string(),
        expected: what.to_string(),
        found: e.to_string(),
    })
}
