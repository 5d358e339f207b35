//! Typed errors. Every variant names the file it is about, so a message alone says where to look.

use std::path::PathBuf;

use crate::quant::QuantError;

/// Result alias used across the crate.
pub type Result<T, E = IoError> = std::result::Result<T, E>;

/// Everything that can go wrong while reading a checkpoint, tokenizer or template.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The operating system refused an open, read, write or map.
    #[error("{}: cannot {action}: {source}", .path.display())]
    Os {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// The file does not start with the GGUF magic.
    #[error("{}: not a GGUF file: expected magic \"GGUF\", found {found:?}", .path.display())]
    BadMagic { path: PathBuf, found: String },

    /// A GGUF version this reader does not understand.
    #[error("{}: unsupported GGUF version: expected 2 or 3, found {found}", .path.display())]
    UnsupportedVersion { path: PathBuf, found: u32 },

    /// The file ends before a field it declares.
    #[error(
        "{}: truncated while reading {field}: expected {needed} more bytes at offset {offset}, found only {available}",
        .path.display()
    )]
    Truncated {
        path: PathBuf,
        field: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    /// A count or length in a header is larger than the rest of the file could possibly hold.
    #[error(
        "{}: {field}: declared count {claimed} needs at least {needed} bytes, but only {available} bytes remain in the file",
        .path.display()
    )]
    LengthExceedsFile {
        path: PathBuf,
        field: String,
        claimed: u64,
        needed: u128,
        available: u64,
    },

    /// A metadata value is malformed or of the wrong type.
    #[error("{}: metadata key {key:?}: expected {expected}, found {found}", .path.display())]
    BadMetadata {
        path: PathBuf,
        key: String,
        expected: String,
        found: String,
    },

    /// A required metadata key is absent.
    #[error("{}: metadata key {key:?} is missing", .path.display())]
    MissingMetadata { path: PathBuf, key: String },

    /// A tensor uses a ggml type id this crate does not know.
    #[error("{}: tensor {tensor:?}: unknown ggml type id {type_id}", .path.display())]
    UnknownGgmlType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
    },

    /// A tensor's raw bytes could not be turned into f32.
    #[error("{}: tensor {tensor:?}: {source}", .path.display())]
    Dequantize {
        path: PathBuf,
        tensor: String,
        #[source]
        source: QuantError,
    },

    /// A tensor descriptor is inconsistent (dims, offset, size, alignment).
    #[error("{}: tensor {tensor:?}: {what}: expected {expected}, found {found}", .path.display())]
    BadTensor {
        path: PathBuf,
        tensor: String,
        what: String,
        expected: String,
        found: String,
    },

    /// A tensor was asked for (or is required by the architecture) but is not in the checkpoint.
    #[error("{}: tensor {tensor:?} not found", .path.display())]
    MissingTensor { path: PathBuf, tensor: String },

    /// A tensor's shape contradicts the model config.
    #[error(
        "{}: tensor {tensor:?}: shape contradicts the config: expected {expected:?}, found {found:?}",
        .path.display()
    )]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    /// A safetensors tensor uses a dtype we do not convert.
    #[error("{}: tensor {tensor:?}: unsupported dtype: expected F32, F16 or BF16, found {dtype}", .path.display())]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },

    /// A JSON file failed to parse or did not match the expected schema.
    #[error("{}: invalid JSON: {source}", .path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// A safetensors header is malformed.
    #[error("{}: invalid safetensors file: {message}", .path.display())]
    Safetensors { path: PathBuf, message: String },

    /// A config value is out of range or inconsistent with another.
    #[error("{}: config field {field}: expected {expected}, found {found}", .path.display())]
    Config {
        path: PathBuf,
        field: String,
        expected: String,
        found: String,
    },

    /// A file the checkpoint needs is absent; `path` is where it was looked for.
    #[error("{}: missing {what}", .path.display())]
    MissingFile { path: PathBuf, what: String },

    /// The path is neither a GGUF file nor a Hugging Face model directory.
    #[error(
        "{}: not a checkpoint: expected a .gguf file or a directory containing config.json",
        .path.display()
    )]
    NotACheckpoint { path: PathBuf },

    /// The tokenizer could not be built or failed to encode/decode.
    #[error("{}: tokenizer {what}: {message}", .path.display())]
    Tokenizer {
        path: PathBuf,
        what: String,
        message: String,
    },

    /// The tokenizer kind is not one this crate can build.
    #[error("{}: unsupported tokenizer: {field} is {kind:?}, expected one of {supported}", .path.display())]
    UnsupportedTokenizer {
        path: PathBuf,
        field: String,
        kind: String,
        supported: String,
    },

    /// A chat template failed to compile or render.
    #[error("{}: chat template failed to render: {message}", .path.display())]
    Template { path: PathBuf, message: String },

    /// A tensor holds NaN or infinity where only finite numbers are allowed.
    #[error(
        "{}: tensor {tensor:?}: element {index} is {value}, expected a finite number",
        .path.display()
    )]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: usize,
        value: f64,
    },

    /// A tensor the format does not define is present.
    #[error("{}: unexpected tensor {tensor:?}: expected only {expected}", .path.display())]
    UnexpectedTensor {
        path: PathBuf,
        tensor: String,
        expected: String,
    },

    /// A file made for one model is used with another; every differing field is listed.
    #[error(
        "{}: {what} was made for a model with {}",
        .path.display(),
        FieldMismatch::describe_all(.fields)
    )]
    ModelMismatch {
        path: PathBuf,
        what: &'static str,
        fields: Vec<FieldMismatch>,
    },

    /// Two statistics shards that cannot be summed; names both files.
    #[error(
        "{}: cannot merge with {}: {field} differs: {} has {other_value}, this file has {value}",
        .path.display(),
        .other.display(),
        .other.display()
    )]
    ShardMismatch {
        path: PathBuf,
        other: PathBuf,
        field: String,
        value: String,
        other_value: String,
    },

    /// A text file is not valid UTF-8 and lossy reading was not asked for.
    #[error(
        "{}: not valid UTF-8: invalid byte sequence at byte offset {offset} (read it lossily to replace bad bytes with U+FFFD)",
        .path.display()
    )]
    NotUtf8 { path: PathBuf, offset: usize },

    /// A path given as calibration text yields no non-empty document.
    #[error("{}: no calibration text: {reason}", .path.display())]
    NoText { path: PathBuf, reason: String },
}

impl IoError {
    /// The file the error is about.
    pub fn path(&self) -> &std::path::Path {
        match self {
            IoError::Os { path, .. }
            | IoError::BadMagic { path, .. }
            | IoError::UnsupportedVersion { path, .. }
            | IoError::Truncated { path, .. }
            | IoError::LengthExceedsFile { path, .. }
            | IoError::BadMetadata { path, .. }
            | IoError::MissingMetadata { path, .. }
            | IoError::UnknownGgmlType { path, .. }
            | IoError::Dequantize { path, .. }
            | IoError::BadTensor { path, .. }
            | IoError::MissingTensor { path, .. }
            | IoError::ShapeMismatch { path, .. }
            | IoError::UnsupportedDtype { path, .. }
            | IoError::Json { path, .. }
            | IoError::Safetensors { path, .. }
            | IoError::Config { path, .. }
            | IoError::MissingFile { path, .. }
            | IoError::NotACheckpoint { path }
            | IoError::Tokenizer { path, .. }
            | IoError::UnsupportedTokenizer { path, .. }
            | IoError::Template { path, .. }
            | IoError::NonFinite { path, .. }
            | IoError::UnexpectedTensor { path, .. }
            | IoError::ModelMismatch { path, .. }
            | IoError::ShardMismatch { path, .. }
            | IoError::NotUtf8 { path, .. }
            | IoError::NoText { path, .. } => path,
        }
    }

    pub(crate) fn os(
        path: impl Into<PathBuf>,
        action: &'static str,
        source: std::io::Error,
    ) -> Self {
        IoError::Os {
            path: path.into(),
            action,
            source,
        }
    }
}

/// One field on which a file's model and the model in use differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldMismatch {
    pub field: &'static str,
    /// The value recorded in the file.
    pub file: String,
    /// The value of the model in use.
    pub model: String,
}

impl FieldMismatch {
    /// "weights_hash A, this model has B; hidden_size ..." for error messages.
    pub fn describe_all(fields: &[FieldMismatch]) -> String {
        fields
            .iter()
            .map(|m| format!("{} {}, this model has {}", m.field, m.file, m.model))
            .collect::<Vec<_>>()
            .join("; and with ")
    }
}
