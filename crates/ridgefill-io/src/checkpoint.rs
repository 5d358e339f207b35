//! One entry point for a model: a `.gguf` file or a Hugging Face safetensors directory.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::bytes::SharedBytes;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{IoError, Result};
use crate::gguf::{GGUF_MAGIC, GgufFile};
use crate::hf::{HfDir, SafetensorsSet};
use crate::names::{expected_shape, gguf_to_hf_arch, hf_layer_index, required_tensors_iter};
use crate::quant::GgmlType;
use crate::tokenizer::Tokenizer;

/// llama.cpp's converter permutes Q/K rows only for these architectures.
const PERMUTED_QK_ARCHS: &[&str] = &["llama", "mistral"];
const Q_PROJ_SUFFIX: &str = "self_attn.q_proj.weight";
const K_PROJ_SUFFIX: &str = "self_attn.k_proj.weight";
/// Bytes hashed from each end of every tensor by [`Checkpoint::weights_fingerprint`].
const FINGERPRINT_EDGE_BYTES: usize = 64 * 1024;
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Which kind of checkpoint was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    Gguf,
    HfSafetensors,
}

/// A tensor's name, HF-order shape and storage dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// HF name, e.g. "model.layers.0.self_attn.q_proj.weight".
    pub name: String,
    /// Row-major shape, e.g. `[out, in]` for a linear weight.
    pub shape: Vec<usize>,
    /// Storage type: "F32", "F16", "BF16", "Q4_1", ...
    pub dtype: String,
}

enum Source {
    Gguf {
        file: GgufFile,
        /// HF name -> index into `file.tensors()`.
        by_hf: BTreeMap<String, usize>,
        permute_qk: bool,
    },
    Hf(SafetensorsSet),
}

/// A weight in its stored block format ([`Checkpoint::tensor_stored`]).
#[derive(Clone, Debug)]
pub struct StoredTensor {
    pub ty: GgmlType,
    /// HF (row-major) shape: `[out, in]` for a projection.
    pub shape: Vec<usize>,
    pub bytes: SharedBytes,
}

/// An opened model: config, tokenizer, chat template and lazily converted weights.
pub struct Checkpoint {
    pub path: PathBuf,
    pub format: CheckpointFormat,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    source: Source,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("config", &self.config)
            .field("tokenizer", &self.tokenizer)
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl Checkpoint {
    /// Opens a `.gguf` file or a directory containing `config.json`, and checks every tensor
    /// the config implies is present with the right shape.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let ckpt = if path.is_dir() {
            Self::open_hf(path)?
        } else if path.is_file() {
            if !has_gguf_magic(path)? {
                return Err(IoError::NotACheckpoint {
                    path: path.to_path_buf(),
                });
            }
            Self::open_gguf(path)?
        } else {
            return Err(IoError::MissingFile {
                path: path.to_path_buf(),
                what: "checkpoint (a .gguf file or a model directory)".into(),
            });
        };
        ckpt.check_tensors()?;
        Ok(ckpt)
    }

    fn open_gguf(path: &Path) -> Result<Checkpoint> {
        Self::from_gguf_unchecked(GgufFile::open(path)?)
    }

    /// A checkpoint over an already parsed GGUF (e.g. [`GgufFile::from_bytes`]), with the same
    /// tensor checks as [`Checkpoint::open`].
    pub fn from_gguf(file: GgufFile) -> Result<Checkpoint> {
        let ckpt = Self::from_gguf_unchecked(file)?;
        ckpt.check_tensors()?;
        Ok(ckpt)
    }

    fn from_gguf_unchecked(mut file: GgufFile) -> Result<Checkpoint> {
        let path = file.path().to_path_buf();
        let path = path.as_path();
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        // The file's template, else the family's built-in one (Gemma 3's GGUF ships none).
        let chat_template =
            crate::chat::gguf_template(&file, &tokenizer, config.eos_ids().first().copied())?;
        file.forget_metadata(crate::tokenizer::VOCAB_KEYS);
        let arch = file.architecture()?.to_string();
        let by_hf = file
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| (gguf_to_hf_arch(&arch, &t.name), i))
            .collect();
        let permute_qk = PERMUTED_QK_ARCHS.contains(&file.architecture()?);
        Ok(Checkpoint {
            path: path.to_path_buf(),
            format: CheckpointFormat::Gguf,
            config,
            tokenizer,
            chat_template,
            source: Source::Gguf {
                file,
                by_hf,
                permute_qk,
            },
        })
    }

    fn open_hf(dir: &Path) -> Result<Checkpoint> {
        let hf = HfDir::open(dir)?;
        let weights = SafetensorsSet::open_dir(dir)?;
        Ok(Checkpoint {
            path: dir.to_path_buf(),
            format: CheckpointFormat::HfSafetensors,
            config: hf.config,
            tokenizer: hf.tokenizer,
            chat_template: hf.chat_template,
            source: Source::Hf(weights),
        })
    }

    /// The file a tensor lives in (for error messages).
    fn file_of(&self, hf_name: &str) -> PathBuf {
        match &self.source {
            Source::Gguf { file, .. } => file.path().to_path_buf(),
            Source::Hf(set) => set.file_of(hf_name).to_path_buf(),
        }
    }

    /// The name to show in errors: HF name, plus the GGUF name when they differ.
    fn display_name(&self, hf_name: &str) -> String {
        match &self.source {
            Source::Gguf { file, by_hf, .. } => match by_hf.get(hf_name) {
                Some(&i) => format!("{hf_name} (GGUF {})", file.tensors()[i].name),
                None => hf_name.to_string(),
            },
            Source::Hf(_) => hf_name.to_string(),
        }
    }

    fn missing(&self, hf_name: &str) -> IoError {
        let path = match &self.source {
            Source::Gguf { file, .. } => file.path().to_path_buf(),
            Source::Hf(set) => set.origin().to_path_buf(),
        };
        IoError::MissingTensor {
            path,
            tensor: hf_name.to_string(),
        }
    }

    fn check_tensors(&self) -> Result<()> {
        for name in self.tensor_names() {
            let info = self.tensor_info(&name)?;
            if let Some(layer) = hf_layer_index(&name)
                && layer >= self.config.num_hidden_layers
            {
                return Err(IoError::BadTensor {
                    path: self.file_of(&name),
                    tensor: self.display_name(&name),
                    what: "layer index".into(),
                    expected: format!("< num_hidden_layers {}", self.config.num_hidden_layers),
                    found: layer.to_string(),
                });
            }
            if let Some(expected) = expected_shape(&self.config, &name)
                && expected != info.shape
            {
                return Err(IoError::ShapeMismatch {
                    path: self.file_of(&name),
                    tensor: self.display_name(&name),
                    expected,
                    found: info.shape,
                });
            }
        }
        // Lazily: the first missing name turns up within (tensors in the file) / 9 + 1 layers.
        for name in required_tensors_iter(&self.config) {
            if !self.has_tensor(&name) {
                return Err(self.missing(&name));
            }
        }
        Ok(())
    }

    /// The GGUF file, when this checkpoint is one.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf { file, .. } => Some(file),
            Source::Hf(_) => None,
        }
    }

    /// All tensor names (HF naming), sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        match &self.source {
            Source::Gguf { by_hf, .. } => by_hf.keys().cloned().collect(),
            Source::Hf(set) => set.names().map(str::to_string).collect(),
        }
    }

    /// Whether a tensor (HF name) exists.
    pub fn has_tensor(&self, hf_name: &str) -> bool {
        match &self.source {
            Source::Gguf { by_hf, .. } => by_hf.contains_key(hf_name),
            Source::Hf(set) => set.entry(hf_name).is_some(),
        }
    }

    /// Name, HF-order shape and storage dtype of a tensor.
    pub fn tensor_info(&self, hf_name: &str) -> Result<TensorInfo> {
        match &self.source {
            Source::Gguf { file, by_hf, .. } => {
                let &i = by_hf.get(hf_name).ok_or_else(|| self.missing(hf_name))?;
                let t = &file.tensors()[i];
                Ok(TensorInfo {
                    name: hf_name.to_string(),
                    shape: t.shape_row_major(),
                    dtype: t.ggml_type.name().to_string(),
                })
            }
            Source::Hf(set) => {
                let e = set.entry(hf_name).ok_or_else(|| self.missing(hf_name))?;
                Ok(TensorInfo {
                    name: hf_name.to_string(),
                    shape: e.shape.clone(),
                    dtype: format!("{:?}", e.dtype),
                })
            }
        }
    }

    /// A tensor as f32, row-major in HF shape order (GGUF Q/K rows un-permuted). A NaN or
    /// infinity is an error naming the tensor and the first bad element's index in that order.
    pub fn tensor_f32(&self, hf_name: &str) -> Result<Vec<f32>> {
        let data = self.tensor_f32_unchecked(hf_name)?;
        if let Some(index) = data.iter().position(|v| !v.is_finite()) {
            return Err(IoError::NonFinite {
                path: self.file_of(hf_name),
                tensor: self.display_name(hf_name),
                index,
                value: f64::from(data[index]),
            });
        }
        Ok(data)
    }

    fn tensor_f32_unchecked(&self, hf_name: &str) -> Result<Vec<f32>> {
        match &self.source {
            Source::Hf(set) => set.to_f32(hf_name),
            Source::Gguf {
                file,
                by_hf,
                permute_qk,
            } => {
                let &i = by_hf.get(hf_name).ok_or_else(|| self.missing(hf_name))?;
                let info = &file.tensors()[i];
                let data = file.dequantize(&info.name)?;
                let heads = self.permuted_heads(hf_name, *permute_qk);
                match heads {
                    None => Ok(data),
                    Some(n_heads) => {
                        let shape = info.shape_row_major();
                        let rows = shape.first().copied().unwrap_or(0);
                        unpermute_qk_rows(&data, rows, n_heads).ok_or_else(|| IoError::BadTensor {
                            path: file.path().to_path_buf(),
                            tensor: self.display_name(hf_name),
                            what: "rows for the Q/K un-permute".into(),
                            expected: format!("a multiple of 2 x {n_heads} heads"),
                            found: rows.to_string(),
                        })
                    }
                }
            }
        }
    }

    /// Heads of a GGUF Q or K projection whose rows llama.cpp permuted, else `None`.
    fn permuted_heads(&self, hf_name: &str, permute_qk: bool) -> Option<usize> {
        if !permute_qk {
            None
        } else if hf_name.ends_with(Q_PROJ_SUFFIX) {
            Some(self.config.num_attention_heads)
        } else if hf_name.ends_with(K_PROJ_SUFFIX) {
            Some(self.config.num_key_value_heads)
        } else {
            None
        }
    }

    /// A GGUF weight as stored: its block type, HF shape and bytes (pointing into the mapped
    /// file; Q/K rows un-permuted into a copy). `None` for a Hugging Face checkpoint.
    pub fn tensor_stored(&self, hf_name: &str) -> Result<Option<StoredTensor>> {
        let Source::Gguf {
            file,
            by_hf,
            permute_qk,
        } = &self.source
        else {
            return Ok(None);
        };
        let &i = by_hf.get(hf_name).ok_or_else(|| self.missing(hf_name))?;
        let info = &file.tensors()[i];
        let shape = info.shape_row_major();
        let bytes = file.shared_bytes_of(info);
        let heads = self.permuted_heads(hf_name, *permute_qk);
        let rows = shape.first().copied().unwrap_or(0);
        let bytes = match heads {
            None => bytes,
            Some(n_heads) => {
                let copy =
                    SharedBytes::owned(unpermute_rows(&bytes, rows, n_heads).ok_or_else(|| {
                        IoError::BadTensor {
                            path: file.path().to_path_buf(),
                            tensor: self.display_name(hf_name),
                            what: "rows for the Q/K un-permute".into(),
                            expected: format!("a multiple of 2 x {n_heads} heads"),
                            found: rows.to_string(),
                        }
                    })?);
                bytes.evict();
                copy
            }
        };
        Ok(Some(StoredTensor {
            ty: info.ggml_type,
            shape,
            bytes,
        }))
    }

    /// Raw stored bytes of a tensor (quantised for GGUF; Q/K rows still permuted there).
    pub fn tensor_raw(&self, hf_name: &str) -> Result<&[u8]> {
        match &self.source {
            Source::Hf(set) => set.bytes(hf_name),
            Source::Gguf { file, by_hf, .. } => {
                let &i = by_hf.get(hf_name).ok_or_else(|| self.missing(hf_name))?;
                Ok(file.bytes_of(&file.tensors()[i]))
            }
        }
    }

    /// Cheap stable 64-bit FNV-1a hash (hex) of names, shapes, dtypes and each tensor's edges.
    pub fn weights_fingerprint(&self) -> String {
        let mut h = Fnv::new();
        for name in self.tensor_names() {
            h.write(name.as_bytes());
            h.write(&[0]);
            if let Ok(info) = self.tensor_info(&name) {
                for d in &info.shape {
                    h.write(&(*d as u64).to_le_bytes());
                }
                h.write(info.dtype.as_bytes());
                h.write(&[0]);
            }
            if let Ok(raw) = self.tensor_raw(&name) {
                h.write(&(raw.len() as u64).to_le_bytes());
                if raw.len() <= 2 * FINGERPRINT_EDGE_BYTES {
                    h.write(raw);
                } else {
                    h.write(&raw[..FINGERPRINT_EDGE_BYTES]);
                    h.write(&raw[raw.len() - FINGERPRINT_EDGE_BYTES..]);
                }
            }
        }
        format!("{:016x}", h.0)
    }
}

/// Undoes llama.cpp's Q/K permutation: within each head of `hd` rows, GGUF row `2j+s`
/// holds HF row `s*(hd/2)+j`. Returns `None` when rows do not split into even-sized heads.
pub fn unpermute_qk_rows(data: &[f32], rows: usize, n_heads: usize) -> Option<Vec<f32>> {
    unpermute_rows(data, rows, n_heads)
}

/// [`unpermute_qk_rows`] over any row contents (whole quantised blocks, for instance): rows
/// move, their elements do not.
pub fn unpermute_rows<T: Copy + Default>(
    data: &[T],
    rows: usize,
    n_heads: usize,
) -> Option<Vec<T>> {
    if rows == 0
        || n_heads == 0
        || !rows.is_multiple_of(n_heads)
        || !data.len().is_multiple_of(rows)
    {
        return None;
    }
    let hd = rows / n_heads;
    if !hd.is_multiple_of(2) {
        return None;
    }
    let half = hd / 2;
    let cols = data.len() / rows;
    let mut out = vec![T::default(); data.len()];
    for h in 0..n_heads {
        for j in 0..half {
            for s in 0..2 {
                let src = (h * hd + 2 * j + s) * cols;
                let dst = (h * hd + s * half + j) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    Some(out)
}

fn has_gguf_magic(path: &Path) -> Result<bool> {
    let mut f = std::fs::File::open(path).map_err(|e| IoError::os(path, "open", e))?;
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match f.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(IoError::os(path, "read", e)),
        }
    }
    // A .gguf name with a bad header still goes to the GGUF reader, which reports exactly what is wrong.
    let named_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    Ok(named_gguf || (got == magic.len() && magic == GGUF_MAGIC))
}

/// 64-bit FNV-1a.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(FNV_OFFSET)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV_PRIME);
        }
        self.0 = h;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // 2 heads of 4 rows, 1 column: HF rows 0..8.
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        // llama.cpp: reshape(heads, 2, hd/2) -> swap -> GGUF row 2j+s = HF row s*2+j.
        let gguf = vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
        assert_eq!(unpermute_qk_rows(&gguf, 8, 2).unwrap(), hf);
        assert!(unpermute_qk_rows(&gguf, 8, 3).is_none());
    }
}
