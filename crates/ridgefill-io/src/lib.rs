//! Pure-format readers for RidgeFill (GGUF, HF safetensors, tokenizers, chat templates); weights come out as `Vec<f32>`.

pub mod atomic;
mod bytes;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod date;
mod error;
pub mod fill;
pub mod fuzzing;
pub mod gguf;
pub mod hf;
pub mod names;
pub mod quant;
mod spm;
pub mod stats;
pub mod text;
pub mod tokenizer;
pub mod tokenizer_export;

pub use bytes::SharedBytes;
pub use chat::{ChatMessage, ChatTemplate};
pub use checkpoint::{Checkpoint, CheckpointFormat, StoredTensor, TensorInfo};
pub use config::{Activation, EosIds, Family, LayerType, ModelConfig, RopeScaling};
pub use error::{FieldMismatch, IoError, Result};
pub use fill::{FillDtype, FillFile, FillMeta, ModelFingerprint};
pub use gguf::{GgufFile, GgufTensorInfo, MetaArray, MetaValue};
pub use quant::{GgmlType, QuantError};
pub use stats::{Moments, StatsFile, StatsMeta};
pub use tokenizer::{StreamDecoder, Tokenizer};
