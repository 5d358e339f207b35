//! The golden files in `tests/golden`, made by transformers (and python gguf / SentencePiece)
//! through the scripts in `scripts/`, with the schema the tests read. Fields the tests do not
//! read are left out; a field they read that is missing fails the parse.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ridgefill_io::chat::ChatMessage;
use serde::Deserialize;

/// `tests/golden/<name>` under the repository root.
pub fn path(name: &str) -> PathBuf {
    crate::repo().join("tests/golden").join(name)
}

/// Parses a JSON file, panicking with its path (and `made_by`, the script that writes it).
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path, made_by: &str) -> T {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{} (made by {made_by}): {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `tests/golden/smollm2.json` (scripts/reference.py), parsed once.
pub fn smollm2() -> &'static ModelGolden {
    static G: OnceLock<ModelGolden> = OnceLock::new();
    G.get_or_init(|| read_json(&path("smollm2.json"), "scripts/reference.py"))
}

/// `tests/golden/gemma3.json` (scripts/reference_gemma3.py), parsed once.
pub fn gemma3() -> &'static ModelGolden {
    static G: OnceLock<ModelGolden> = OnceLock::new();
    G.get_or_init(|| read_json(&path("gemma3.json"), "scripts/reference_gemma3.py"))
}

/// `tests/golden/tiny_qwen.json` (scripts/tiny_qwen.py), parsed once.
pub fn tiny_qwen() -> &'static TinyQwenGolden {
    static G: OnceLock<TinyQwenGolden> = OnceLock::new();
    G.get_or_init(|| read_json(&path("tiny_qwen.json"), "scripts/tiny_qwen.py"))
}

/// A real model's golden values (SmolLM2 and Gemma 3 share this schema).
#[derive(Debug, Deserialize)]
pub struct ModelGolden {
    pub tokenizer: Vec<TokenizerCase>,
    pub tokenizer_info: TokenizerInfo,
    pub prompts: Vec<Prompt>,
    pub greedy: Vec<Greedy>,
    pub score: Score,
    /// Gemma 3 only: a score over windows longer than its sliding window.
    pub score_long: Option<Score>,
    pub chat: Chat,
    /// Gemma 3 only.
    pub model_facts: Option<ModelFacts>,
}

#[derive(Debug, Deserialize)]
pub struct TokenizerCase {
    pub text: String,
    pub ids_no_special: Vec<u32>,
    pub ids_default: Vec<u32>,
    pub decoded: String,
    /// Gemma 3 only: SentencePiece's ids, and whether they differ from transformers'.
    pub spm_ids: Option<Vec<u32>>,
    pub spm_differs: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct TokenizerInfo {
    pub vocab_size: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub bos_added_by_default: bool,
}

/// A prompt with a sample of its last-position logits.
#[derive(Debug, Deserialize)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub logits_last: LogitsSample,
    pub argmax: u32,
    pub logits_last_l2: f64,
}

/// Some logits of one position: `values[i]` is the logit of token `indices[i]`.
#[derive(Debug, Deserialize)]
pub struct LogitsSample {
    pub indices: Vec<u32>,
    pub values: Vec<f64>,
}

/// The greedy continuation of `prompts[prompt]`.
#[derive(Debug, Deserialize)]
pub struct Greedy {
    pub prompt: usize,
    pub ids: Vec<u32>,
    pub text: String,
}

/// The mean NLL of `file` (relative to the repository root) in windows of `ctx` tokens.
#[derive(Debug, Deserialize)]
pub struct Score {
    pub file: String,
    pub ctx: usize,
    pub n_tokens: usize,
    pub first_ids: Vec<u32>,
    pub tokens_scored: usize,
    pub mean_nll: f64,
    /// Gemma 3 only.
    pub spm_ids_match: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct Chat {
    pub messages: Vec<ChatMessage>,
    pub add_generation_prompt: bool,
    pub chat_template: String,
    pub chat_rendered: String,
    pub chat_rendered_ids: Vec<u32>,
    /// Gemma 3 only.
    pub stop_ids: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
pub struct ModelFacts {
    pub layer_types: Vec<String>,
    pub attn_scale: f64,
}

/// The tiny random Qwen2 and Qwen3 models in `tests/data` and transformers' values for them.
#[derive(Debug, Deserialize)]
pub struct TinyQwenGolden {
    pub seq_long: Vec<u32>,
    pub seq_short: Vec<u32>,
    pub models: BTreeMap<String, TinyQwenModel>,
}

#[derive(Debug, Deserialize)]
pub struct TinyQwenModel {
    /// Paths relative to the repository root.
    pub hf_folder: String,
    pub gguf: String,
    pub logits_long_last: Vec<f32>,
    pub logits_short_all: Vec<Vec<f32>>,
    pub greedy_short: GreedyIds,
    pub tokenizer: QwenTokenizer,
    pub chat: QwenChat,
}

#[derive(Debug, Deserialize)]
pub struct GreedyIds {
    pub ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
pub struct QwenTokenizer {
    pub bos_added_by_default: bool,
    pub specials: BTreeMap<String, u32>,
    pub cases: Vec<QwenCase>,
}

#[derive(Debug, Deserialize)]
pub struct QwenCase {
    pub text: String,
    pub ids: Vec<u32>,
    pub decoded: String,
}

#[derive(Debug, Deserialize)]
pub struct QwenChat {
    pub messages: Vec<ChatMessage>,
    pub add_generation_prompt: bool,
    pub template: String,
    pub rendered: String,
    pub rendered_ids: Vec<u32>,
}
