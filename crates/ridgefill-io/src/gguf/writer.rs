//! A small GGUF writer (used by tests and tools to build fixtures).

use std::path::Path;

use half::f16;

use super::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MetaArray, MetaValue, WRITE_VERSION, align_up,
};
use crate::error::{IoError, Result};
use crate::quant::GgmlType;

struct PendingTensor {
    name: String,
    ne: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes a GGUF file in one go.
pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty GGUF v3 file.
    pub fn new() -> Self {
        GgufWriter {
            version: WRITE_VERSION,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Overrides the version field (tests use this to produce unsupported files).
    pub fn version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Adds or replaces a metadata entry.
    pub fn add_meta(&mut self, key: &str, value: impl Into<MetaValue>) -> &mut Self {
        let value = value.into();
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        self
    }

    /// Adds an F32 tensor; `ne` is in ggml order (row length first).
    pub fn add_tensor_f32(&mut self, name: &str, ne: &[u64], data: &[f32]) -> &mut Self {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.add_tensor_raw(name, ne, GgmlType::F32, bytes)
    }

    /// Adds an F16 tensor converted (rounded) from f32.
    pub fn add_tensor_f16(&mut self, name: &str, ne: &[u64], data: &[f32]) -> &mut Self {
        let bytes = data
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
            .collect();
        self.add_tensor_raw(name, ne, GgmlType::F16, bytes)
    }

    /// Adds already-encoded (e.g. quantised) data of type `ty`.
    pub fn add_tensor_raw(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.add_tensor_raw_id(name, ne, ty.id(), data)
    }

    /// Adds data under an arbitrary type id (tests use this for unknown types).
    pub fn add_tensor_raw_id(
        &mut self,
        name: &str,
        ne: &[u64],
        type_id: u32,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ne: ne.to_vec(),
            type_id,
            data,
        });
        self
    }

    /// Serialises the file to memory; `path` only names the target in errors.
    pub fn to_bytes(&self, path: &Path) -> Result<Vec<u8>> {
        let alignment =
            match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
                None => DEFAULT_ALIGNMENT,
                Some((_, v)) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                    IoError::BadMetadata {
                        path: path.to_path_buf(),
                        key: ALIGNMENT_KEY.into(),
                        expected: "a power-of-two integer".into(),
                        found: v.describe(),
                    }
                })?,
            };
        for t in &self.tensors {
            // Known types must carry exactly the bytes their shape needs; unknown ids are written as given.
            if let Some(ty) = GgmlType::from_id(t.type_id) {
                let n: u64 = t.ne.iter().product();
                let expected = ty.bytes_for(n);
                if expected != Some(t.data.len() as u64) {
                    return Err(IoError::BadTensor {
                        path: path.to_path_buf(),
                        tensor: t.name.clone(),
                        what: format!("{ty} data for shape {:?}", t.ne),
                        expected: match expected {
                            Some(b) => format!("{b} bytes"),
                            None => format!("a multiple of {} elements", ty.block_size()),
                        },
                        found: format!("{} bytes", t.data.len()),
                    });
                }
            }
        }

        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            write_value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            write_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = align_up(offset + t.data.len() as u64, alignment);
        }
        let data_start = align_up(out.len() as u64, alignment);
        out.resize(data_start as usize, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        Ok(out)
    }

    /// Writes the file.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes(path)?;
        std::fs::write(path, bytes).map_err(|e| IoError::os(path, "write", e))
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(b) => out.push(u8::from(*b)),
        MetaValue::String(s) => write_str(out, s),
        MetaValue::Array(a) => write_array(out, a),
    }
}

fn write_array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        MetaArray::U8(v) => each!(v),
        MetaArray::I8(v) => each!(v),
        MetaArray::U16(v) => each!(v),
        MetaArray::I16(v) => each!(v),
        MetaArray::U32(v) => each!(v),
        MetaArray::I32(v) => each!(v),
        MetaArray::F32(v) => each!(v),
        MetaArray::U64(v) => each!(v),
        MetaArray::I64(v) => each!(v),
        MetaArray::F64(v) => each!(v),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::String(v) => v.iter().for_each(|s| write_str(out, s)),
        MetaArray::Array(v) => v.iter().for_each(|a| write_array(out, a)),
    }
}
