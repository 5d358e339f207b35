//! Hugging Face model directories: config.json, (sharded) safetensors, tokenizer files.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, SafeTensors};
use serde::Deserialize;
use serde_json::Value;

use crate::bytes::FileBytes;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{IoError, Result};
use crate::quant::{self, GgmlType};
use crate::tokenizer::{SpecialTokens, Tokenizer};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// Name of the entry to use when `chat_template` is a list of named templates.
const DEFAULT_TEMPLATE_NAME: &str = "default";
/// Bytes of the little-endian header length that starts every safetensors file.
const SAFETENSORS_LEN_BYTES: usize = 8;

struct Shard {
    path: PathBuf,
    mmap: FileBytes,
}

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct SafetensorsEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    start: usize,
    end: usize,
}

/// All safetensors files of a model, memory-mapped, indexed by tensor name.
pub struct SafetensorsSet {
    /// The file named in "tensor not found" errors (index JSON or the single file).
    origin: PathBuf,
    shards: Vec<Shard>,
    entries: BTreeMap<String, SafetensorsEntry>,
}

impl std::fmt::Debug for SafetensorsSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsSet")
            .field("origin", &self.origin)
            .field("shards", &self.shards.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl SafetensorsSet {
    /// Opens `model.safetensors`, or the shards listed by `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<SafetensorsSet> {
        let single = dir.join(SINGLE_WEIGHTS_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            return Self::open_files(single.clone(), &[single]);
        }
        if !index.is_file() {
            return Err(IoError::MissingFile {
                path: single,
                what: format!("weights ({SINGLE_WEIGHTS_FILE} or {INDEX_FILE})"),
            });
        }
        let text = std::fs::read_to_string(&index).map_err(|e| IoError::os(&index, "read", e))?;
        let parsed: ShardIndex = serde_json::from_str(&text).map_err(|source| IoError::Json {
            path: index.clone(),
            source,
        })?;
        let mut files: Vec<PathBuf> = Vec::new();
        let mut seen = HashSet::new();
        for (tensor, file) in &parsed.weight_map {
            // Shards must sit next to the index; a path would let the index point anywhere.
            if Path::new(file).file_name().and_then(|f| f.to_str()) != Some(file.as_str()) {
                return Err(IoError::BadTensor {
                    path: index.clone(),
                    tensor: tensor.clone(),
                    what: "shard file name".into(),
                    expected: "a plain file name in the model directory".into(),
                    found: file.clone(),
                });
            }
            if seen.insert(file.clone()) {
                files.push(dir.join(file));
            }
        }
        let set = Self::open_files(index.clone(), &files)?;
        for (tensor, file) in &parsed.weight_map {
            let in_shard = set
                .entries
                .get(tensor)
                .map(|e| set.shards[e.shard].path.file_name() == Some(file.as_ref()));
            if in_shard != Some(true) {
                return Err(IoError::MissingTensor {
                    path: dir.join(file),
                    tensor: tensor.clone(),
                });
            }
        }
        Ok(set)
    }

    /// Opens explicit safetensors files; `origin` names the set in missing-tensor errors.
    pub fn open_files(origin: PathBuf, files: &[PathBuf]) -> Result<SafetensorsSet> {
        let mut set = SafetensorsSet {
            origin,
            shards: Vec::with_capacity(files.len()),
            entries: BTreeMap::new(),
        };
        for path in files {
            set.add_shard(path.clone(), FileBytes::map(path)?)?;
        }
        Ok(set)
    }

    /// One safetensors image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: PathBuf, bytes: Vec<u8>) -> Result<SafetensorsSet> {
        let mut set = SafetensorsSet {
            origin: path.clone(),
            shards: Vec::new(),
            entries: BTreeMap::new(),
        };
        set.add_shard(path, FileBytes::Owned(bytes))?;
        Ok(set)
    }

    fn add_shard(&mut self, path: PathBuf, mmap: FileBytes) -> Result<()> {
        // read_metadata bounds the header length by the buffer and checks every tensor's
        // offsets and byte size against its shape and the data section.
        let (header_len, meta): (usize, Metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| IoError::Safetensors {
                path: path.clone(),
                message: format!("{e} (file is {} bytes)", mmap.len()),
            })?;
        let data_start = SAFETENSORS_LEN_BYTES + header_len;
        let shard = self.shards.len();
        for (name, info) in meta.tensors() {
            let (s, e) = info.data_offsets;
            let range = data_start
                .checked_add(s)
                .zip(data_start.checked_add(e))
                .filter(|&(start, end)| start <= end && end <= mmap.len());
            let Some((start, end)) = range else {
                return Err(IoError::BadTensor {
                    path,
                    tensor: name,
                    what: "data offsets".into(),
                    expected: format!(
                        "a range within the data section ({} bytes)",
                        mmap.len().saturating_sub(data_start)
                    ),
                    found: format!("{s}..{e}"),
                });
            };
            let entry = SafetensorsEntry {
                dtype: info.dtype,
                shape: info.shape.clone(),
                shard,
                start,
                end,
            };
            if self.entries.insert(name.clone(), entry).is_some() {
                return Err(IoError::BadTensor {
                    path,
                    tensor: name,
                    what: "name".into(),
                    expected: "unique across shards".into(),
                    found: "a duplicate".into(),
                });
            }
        }
        self.shards.push(Shard { path, mmap });
        Ok(())
    }

    /// The index file, or the single weights file.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// A tensor's entry.
    pub fn entry(&self, name: &str) -> Option<&SafetensorsEntry> {
        self.entries.get(name)
    }

    /// The file a tensor is stored in.
    pub fn file_of(&self, name: &str) -> &Path {
        match self.entries.get(name) {
            Some(e) => &self.shards[e.shard].path,
            None => &self.origin,
        }
    }

    fn missing(&self, name: &str) -> IoError {
        IoError::MissingTensor {
            path: self.origin.clone(),
            tensor: name.to_string(),
        }
    }

    /// A tensor's raw little-endian bytes (validated by the safetensors header check).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let e = self.entries.get(name).ok_or_else(|| self.missing(name))?;
        let shard = &self.shards[e.shard];
        shard
            .mmap
            .get(e.start..e.end)
            .ok_or_else(|| IoError::BadTensor {
                path: shard.path.clone(),
                tensor: name.to_string(),
                what: "data range".into(),
                expected: format!("within the file ({} bytes)", shard.mmap.len()),
                found: format!("{}..{}", e.start, e.end),
            })
    }

    /// A tensor converted to f32 (row-major, safetensors shape order).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.entries.get(name).ok_or_else(|| self.missing(name))?;
        let ty = match e.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(IoError::UnsupportedDtype {
                    path: self.file_of(name).to_path_buf(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let raw = self.bytes(name)?;
        let n = e
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| IoError::BadTensor {
                path: self.file_of(name).to_path_buf(),
                tensor: name.to_string(),
                what: "element count".into(),
                expected: "a shape whose product fits in usize".into(),
                found: format!("{:?}", e.shape),
            })?;
        quant::dequantize(ty, raw, n).map_err(|source| IoError::Dequantize {
            path: self.file_of(name).to_path_buf(),
            tensor: name.to_string(),
            source,
        })
    }
}

/// Everything in a HF model directory except the weights.
#[derive(Debug)]
pub struct HfDir {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

impl HfDir {
    /// Reads config, tokenizer, special tokens and chat template from `dir`.
    pub fn open(dir: &Path) -> Result<HfDir> {
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(IoError::NotACheckpoint {
                path: dir.to_path_buf(),
            });
        }
        let config = ModelConfig::from_hf_file(&config_path)?;
        let tok_cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        let tok_cfg = read_optional_json(&tok_cfg_path)?;
        let gen_cfg_path = dir.join(GENERATION_CONFIG_FILE);
        let gen_cfg = read_optional_json(&gen_cfg_path)?;

        let mut special = SpecialTokens {
            bos: tok_cfg
                .as_ref()
                .and_then(|c| token_text(c.get("bos_token"))),
            bos_id: config.bos_token_id,
            eos: tok_cfg
                .as_ref()
                .and_then(|c| token_text(c.get("eos_token")))
                .into_iter()
                .collect(),
            eos_ids: config.eos_ids(),
        };
        if let Some(ids) = gen_cfg.as_ref().and_then(|g| g.get("eos_token_id")) {
            special.eos_ids.extend(json_ids(ids));
        }
        let tokenizer = Tokenizer::from_hf_file(&dir.join(TOKENIZER_FILE), &special)?;

        let bos_text = special
            .bos
            .clone()
            .or_else(|| tokenizer.bos_id().and_then(|id| tokenizer.id_to_token(id)))
            .unwrap_or_default();
        let eos_text = special
            .eos
            .first()
            .cloned()
            .or_else(|| {
                tokenizer
                    .eos_ids()
                    .first()
                    .and_then(|&id| tokenizer.id_to_token(id))
            })
            .unwrap_or_default();
        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        let chat_template = if jinja_path.is_file() {
            let src = std::fs::read_to_string(&jinja_path)
                .map_err(|e| IoError::os(&jinja_path, "read", e))?;
            Some(ChatTemplate::with_origin(
                src,
                bos_text,
                eos_text,
                &jinja_path,
            )?)
        } else {
            match tok_cfg
                .as_ref()
                .and_then(|c| template_source(c.get("chat_template")))
            {
                Some(src) => Some(ChatTemplate::with_origin(
                    src,
                    bos_text,
                    eos_text,
                    &tok_cfg_path,
                )?),
                None => None,
            }
        };
        Ok(HfDir {
            dir: dir.to_path_buf(),
            config,
            tokenizer,
            chat_template,
        })
    }
}

fn read_optional_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| IoError::os(path, "read", e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| IoError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// `bos_token`/`eos_token` are either a string or an AddedToken object with `content`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn json_ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Value::Array(a) => a.iter().flat_map(json_ids).collect(),
        _ => Vec::new(),
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which we take "default".
fn template_source(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|e| e.get("name").and_then(Value::as_str) == Some(DEFAULT_TEMPLATE_NAME))
            .and_then(|e| e.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}
