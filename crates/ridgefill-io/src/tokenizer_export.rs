//! Writes a model's tokenizer as a Hugging Face tokenizer directory (`tokenizer.json`,
//! `tokenizer_config.json`, `special_tokens_map.json`).
//!
//! Tools that tokenize on their own side of an API, such as lm-evaluation-harness (its context
//! lengths, RULER's haystacks) load a tokenizer with `transformers.AutoTokenizer`; a GGUF has
//! none they can read. Serialising the `tokenizers` pipeline RidgeFill itself encodes with gives
//! them the server's token ids exactly, rather than a second reconstruction that could drift.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::atomic;
use crate::error::{IoError, Result};
use crate::tokenizer::Tokenizer;

/// The file names written, in order.
pub const FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Writes the three files into `dir` (created when missing), each atomically; returns their
/// paths. `chat_template` is the model's Jinja chat template, if it has one.
///
/// SentencePiece vocabularies from GGUF (Gemma 3, Llama 2) are refused: RidgeFill encodes those
/// itself, and HF's BPE re-expression of them differs on some inputs (long runs of spaces).
pub fn export_hf(tok: &Tokenizer, chat_template: Option<&str>, dir: &Path) -> Result<Vec<PathBuf>> {
    let inner = tok.inner().ok_or_else(|| IoError::Tokenizer {
        path: tok.path().to_path_buf(),
        what: "export as tokenizer.json".into(),
        message: "SentencePiece vocabularies from GGUF are not exported (RidgeFill encodes them \
                  itself; HF's BPE form of them differs on some inputs): only byte-level BPE and \
                  tokenizer.json tokenizers are"
            .into(),
    })?;
    let tokenizer_json = inner.to_string(true).map_err(|e| IoError::Tokenizer {
        path: tok.path().to_path_buf(),
        what: "serialise as tokenizer.json".into(),
        message: e.to_string(),
    })?;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
    let bos = name(tok.bos_id());
    let eos = name(tok.eos_ids().first().copied());
    let mut config = json!({
        // The generic fast tokenizer runs tokenizer.json as written; a model-specific class
        // (GPT2Tokenizer, ...) would rebuild its own pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": tok.add_bos(),
        // Decoding must return the text the tokens spell, not a "cleaned" one.
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = chat_template {
        config["chat_template"] = Value::String(t.to_string());
    }
    let mut special = serde_json::Map::new();
    if let Some(b) = &bos {
        special.insert("bos_token".into(), json!(b));
    }
    if let Some(e) = &eos {
        special.insert("eos_token".into(), json!(e));
    }
    let texts = [
        tokenizer_json,
        pretty(&config, dir)?,
        pretty(&Value::Object(special), dir)?,
    ];
    std::fs::create_dir_all(dir).map_err(|e| IoError::os(dir, "create directory", e))?;
    let mut written = Vec::with_capacity(FILES.len());
    for (file, text) in FILES.iter().zip(texts) {
        let path = dir.join(file);
        atomic::write_bytes(&path, text.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}

fn pretty(v: &Value, dir: &Path) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|e| IoError::Tokenizer {
        path: dir.to_path_buf(),
        what: "serialise the tokenizer config".into(),
        message: e.to_string(),
    })
}
