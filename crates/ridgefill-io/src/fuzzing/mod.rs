//! Entry points of the `cargo fuzz` targets in `fuzz/`, shared with `tests/fuzz_regressions.rs`.
//!
//! Each takes arbitrary bytes and drives one reader as far as it goes; it must return (errors
//! are fine) without panicking, overflowing the stack, or allocating more than the input allows.

use std::path::Path;

use crate::chat::{ChatMessage, ChatTemplate};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::fill::FillFile;
use crate::gguf::{GgufFile, MetaValue};
use crate::hf::SafetensorsSet;
use crate::names::{expected_shape, hf_layer_index};
use crate::stats::StatsFile;
use crate::text::{decode_text, detag_brown, detect_kind, document_from_text};
use crate::tokenizer::Tokenizer;

/// The chat template shipped with SmolLM2 (the model the golden tests use).
pub const SHIPPED_CHAT_TEMPLATE: &str = include_str!("smollm2_chat_template.jinja");
/// Separates the parts of a multi-part input (config.json / safetensors; template / messages).
pub const SEPARATOR: u8 = 0;
/// Text encoded with tokenizers rebuilt from fuzzed GGUF metadata.
const PROBE_TEXT: &str = "Hello world, the 3 quick foxes.\n<|im_start|>user";

/// One fuzz entry point.
pub type Entry = fn(&[u8]);

/// Every target by name, as `fuzz/fuzz_targets/<name>.rs` calls it.
pub const TARGETS: &[(&str, Entry)] = &[
    ("gguf", gguf),
    ("safetensors_hf", safetensors_hf),
    ("fill", fill),
    ("text", text),
    ("chat_template", chat_template),
];

/// GGUF: parse, read every metadata key through each typed accessor, dequantise every tensor,
/// build the config, tokenizer and checkpoint, and convert every tensor the checkpoint names.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for (key, value) in file.metadata() {
        let _ = value.describe();
        let _ = file.get_u32(key);
        let _ = file.get_u64(key);
        let _ = file.get_i64(key);
        let _ = file.get_f64(key);
        let _ = file.get_bool(key);
        let _ = file.get_str(key);
        if let MetaValue::Array(_) = value {
            let _ = file.get_int_array(key);
            let _ = file.get_float_array(key);
            let _ = file.get_str_array(key);
        }
    }
    for t in file.tensors() {
        let _ = t.shape_row_major();
        let _ = file.dequantize(&t.name);
    }
    let _ = ModelConfig::from_gguf(&file);
    if let Ok(tok) = Tokenizer::from_gguf(&file)
        && let Ok(ids) = tok.encode(PROBE_TEXT, true)
    {
        let _ = tok.decode(&ids, false);
    }
    let Ok(ckpt) = Checkpoint::from_gguf(file) else {
        return;
    };
    for name in ckpt.tensor_names() {
        let _ = ckpt.tensor_info(&name);
        let _ = ckpt.tensor_f32(&name);
        let _ = ckpt.tensor_raw(&name);
    }
    let _ = ckpt.weights_fingerprint();
    if let Some(t) = &ckpt.chat_template {
        let _ = t.render(&[ChatMessage::new("user", "hi")], true);
    }
}

/// HF: `config.json` bytes, a 0 byte, then one safetensors file. Parses both, checks every
/// tensor's shape against the config as [`Checkpoint::open`] does, and converts it to f32.
pub fn safetensors_hf(data: &[u8]) {
    let (config_part, weights) = match data.iter().position(|&b| b == SEPARATOR) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let config = std::str::from_utf8(config_part)
        .ok()
        .and_then(|text| ModelConfig::from_hf_json(Path::new("config.json"), text).ok());
    if let Some(c) = &config {
        let _ = (c.head_dim(), c.kv_dim(), c.q_dim(), c.eos_ids());
    }
    let Ok(set) = SafetensorsSet::from_bytes("model.safetensors".into(), weights.to_vec()) else {
        return;
    };
    let names: Vec<String> = set.names().map(str::to_string).collect();
    for name in &names {
        if let (Some(c), Some(e)) = (&config, set.entry(name)) {
            let _ = hf_layer_index(name);
            let _ = expected_shape(c, name).map(|s| s == e.shape);
        }
        let _ = set.bytes(name);
        let _ = set.to_f32(name);
    }
}

/// Fill and statistics files: the same bytes through both full readers (header, metadata JSON,
/// every tensor's shape, dtype and finiteness).
pub fn fill(data: &[u8]) {
    if let Ok(f) = FillFile::from_bytes(Path::new("fuzz.fill"), data.to_vec()) {
        let _ = f.check_model(Path::new("fuzz.fill"), &f.meta.model);
    }
    let _ = StatsFile::from_bytes(Path::new("fuzz.stats"), data.to_vec());
}

/// Calibration text: first byte selects lossy UTF-8; the rest is a file's bytes, decoded,
/// classified, and detagged when it looks like Brown (and detagged regardless, too).
pub fn text(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let lossy = flags & 1 == 1;
    let path = Path::new("fuzz.txt");
    let Ok(decoded) = decode_text(path, rest.to_vec(), lossy) else {
        return;
    };
    let _ = detect_kind(&decoded);
    let _ = detag_brown(&decoded);
    let _ = document_from_text(path, decoded);
}

/// Chat templates: first byte's bit 0 picks the template (0: the first 0-separated part of the
/// rest is the template source; 1: [`SHIPPED_CHAT_TEMPLATE`]), bit 1 `add_generation_prompt`;
/// the remaining parts are alternating role and content of the messages.
pub fn chat_template(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let mut parts = rest
        .split(|&b| b == SEPARATOR)
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let src = if flags & 1 == 0 {
        parts.next().unwrap_or_default()
    } else {
        SHIPPED_CHAT_TEMPLATE.to_string()
    };
    let parts: Vec<String> = parts.collect();
    let messages: Vec<ChatMessage> = parts
        .chunks(2)
        .map(|c| ChatMessage::new(c[0].clone(), c.get(1).cloned().unwrap_or_default()))
        .collect();
    let Ok(t) = ChatTemplate::new(src, "<s>".into(), "</s>".into()) else {
        return;
    };
    let _ = t.render(&messages, flags & 2 == 2);
}
