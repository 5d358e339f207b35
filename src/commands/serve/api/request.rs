//! Request checks shared by both endpoints: the body read as a JSON object, the generation
//! parameters OpenAI defines (with their ranges and error messages), chat messages, and
//! `/v1/completions`' prompt shapes (a string, token ids, or a batch of either). Everything a
//! handler needs to know about a request is settled here, before anything is queued, so a bad
//! request costs no model time.

use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use ridgefill::io::chat::ChatMessage;
use ridgefill::model::SamplerConfig;
use serde_json::Value;

use super::error::ApiError;
use super::legacy;
use super::state::AppState;

/// Roles a chat message may have.
const ROLES: &[&str] = &["system", "user", "assistant"];
/// OpenAI allows at most this many stop strings.
const MAX_STOPS: usize = 4;
/// Largest sampling temperature accepted (OpenAI's range).
const MAX_TEMPERATURE: f64 = 2.0;

/// Reads the body up to the limit and parses it as a JSON object.
pub async fn read_json(
    body: Body,
    limit: usize,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let bytes: Bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "request body larger than the server's limit of {limit} bytes (--max-body)"
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("body_too_large"),
        })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::invalid(
            None,
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::invalid(
            None,
            format!("malformed JSON in the request body: {e}"),
        )),
    }
}

/// The generation parameters shared by both endpoints.
pub struct Params {
    pub max_tokens: Option<usize>,
    /// OpenAI's legacy `echo` (completions only): the prompt comes first in text and logprobs.
    pub echo: bool,
    /// OpenAI's legacy `logprobs` (completions only): this many alternatives per token.
    pub logprobs: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub fill: bool,
    pub ignore_eos: bool,
    /// May reuse a cached prefix (llama-server's `cache_prompt`, default true).
    pub cache_prompt: bool,
}

/// The generation parameters of `o`, each checked against OpenAI's range for it (`kind`:
/// chat needs at least one completion token and has no legacy options).
pub fn params(
    o: &serde_json::Map<String, Value>,
    st: &AppState,
    kind: Kind,
) -> Result<Params, ApiError> {
    let num = |key: &'static str| -> Result<Option<f64>, ApiError> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(v) => Err(ApiError::invalid(
                Some(key),
                format!("`{key}` must be a number, found {v}"),
            )),
        }
    };
    let boolean = |key: &'static str| -> Result<Option<bool>, ApiError> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(
                Some(key),
                format!("`{key}` must be true or false, found {v}"),
            )),
        }
    };
    // OpenAI's completions take `max_tokens: 0` (the schema's minimum; with `echo` it scores
    // the prompt alone); chat completions need at least one token.
    let least = u64::from(kind == Kind::Chat);
    let count = |key: &'static str| -> Result<Option<usize>, ApiError> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v >= least) => {
                Ok(n.as_u64().map(|v| v as usize))
            }
            Some(v) => Err(ApiError::invalid(
                Some(key),
                format!(
                    "`{key}` must be a {} integer, found {v}",
                    if least > 0 {
                        "positive"
                    } else {
                        "non-negative"
                    }
                ),
            )),
        }
    };
    let max_tokens = match count("max_completion_tokens")? {
        Some(n) => Some(n),
        None => count("max_tokens")?,
    };
    let temperature = num("temperature")?.unwrap_or(1.0);
    if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::invalid(
            Some("temperature"),
            format!("`temperature` must be between 0 and {MAX_TEMPERATURE}, found {temperature}"),
        ));
    }
    let top_p = num("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            Some("top_p"),
            format!("`top_p` must be in (0, 1], found {top_p}"),
        ));
    }
    let seed = match o.get("seed") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_i64().is_some() || n.as_u64().is_some() => {
            n.as_u64().or(n.as_i64().map(|v| v as u64))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("seed"),
                format!("`seed` must be an integer, found {v}"),
            ));
        }
    };
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                v => Err(ApiError::invalid(
                    Some("stop"),
                    format!("`stop` entries must be strings, found {v}"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(ApiError::invalid(
                Some("stop"),
                format!("`stop` must be a string or an array of strings, found {v}"),
            ));
        }
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("`stop` takes at most {MAX_STOPS} non-empty strings"),
        ));
    }
    if let Some(n) = o.get("n").and_then(Value::as_u64).filter(|&n| n != 1) {
        return Err(ApiError::invalid(
            Some("n"),
            format!("only n = 1 is supported, found {n}"),
        ));
    }
    let stream = boolean("stream")?.unwrap_or(false);
    let (echo, logprobs) = match kind {
        // Chat's `logprobs` is a different (boolean) option this server does not offer.
        Kind::Chat => (false, None),
        Kind::Text => legacy::options(o, stream)?,
    };
    let fill = boolean("fill")?.unwrap_or(true) && st.has_fill;
    let seed = seed.unwrap_or_else(|| st.next_id.load(Ordering::Relaxed));
    Ok(Params {
        max_tokens,
        echo,
        logprobs,
        sampler: SamplerConfig {
            temperature: temperature as f32,
            // OpenAI's sampling: temperature and nucleus only.
            top_k: 0,
            top_p: top_p as f32,
            min_p: 0.0,
            seed,
        },
        stop,
        stream,
        fill,
        // llama-server's extension: generate max_tokens tokens (benchmarks).
        ignore_eos: boolean("ignore_eos")?.unwrap_or(false),
        cache_prompt: boolean("cache_prompt")?.unwrap_or(true),
    })
}

/// `messages` as chat roles and text (text parts of a content array are joined).
pub fn chat_messages(o: &serde_json::Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(Value::Array(list)) = o.get("messages") else {
        return Err(ApiError::invalid(
            Some("messages"),
            "`messages` must be an array of {role, content} objects",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "`messages` is empty: give at least one message",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    Some("messages"),
                    format!("messages[{i}].role must be a string"),
                )
            })?;
            // "developer" is OpenAI's newer name for the system role.
            let role = if role == "developer" { "system" } else { role };
            if !ROLES.contains(&role) {
                return Err(ApiError::invalid(
                    Some("messages"),
                    format!("messages[{i}].role {role:?} is not one of system, user, assistant"),
                ));
            }
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                // Text parts are joined; other part types (images) are refused.
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => Ok(t.to_string()),
                            _ => Err(ApiError::invalid(
                                Some("messages"),
                                format!("messages[{i}].content: only text parts are supported"),
                            )),
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(""),
                _ => {
                    return Err(ApiError::invalid(
                        Some("messages"),
                        format!("messages[{i}].content must be a string"),
                    ));
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// Which endpoint a response is shaped for.
#[derive(Clone, Copy, PartialEq)]
pub enum Kind {
    Chat,
    Text,
}

/// One prompt of a request, tokenised.
pub struct Prompt {
    pub ids: Vec<u32>,
    /// Leading tokens the server added (BOS for a text prompt), not part of the echoed text.
    pub added_bos: usize,
}

/// `prompt` as OpenAI takes it: a string, an array of token ids, or an array of either (one
/// choice each). Text is encoded with the model's BOS; token ids are used as they are.
pub fn text_prompts(v: Option<&Value>, st: &AppState) -> Result<Vec<Prompt>, ApiError> {
    let shape = "`prompt` must be a string, an array of token ids, or an array of strings or of token-id arrays";
    let text = |s: &str| -> Result<Prompt, ApiError> {
        if s.is_empty() {
            return Err(ApiError::invalid(Some("prompt"), "`prompt` is empty"));
        }
        let ids = st
            .tokenizer
            .encode(s, true)
            .map_err(|e| ApiError::server(e.to_string()))?;
        let added_bos = usize::from(st.tokenizer.add_bos() && st.tokenizer.bos_id().is_some());
        Ok(Prompt { ids, added_bos })
    };
    let tokens = |a: &[Value]| -> Result<Prompt, ApiError> {
        if a.is_empty() {
            return Err(ApiError::invalid(Some("prompt"), "`prompt` is empty"));
        }
        let ids = a
            .iter()
            .map(|t| match t.as_u64() {
                Some(id) if (id as usize) < st.vocab => Ok(id as u32),
                _ => Err(ApiError::invalid(
                    Some("prompt"),
                    format!(
                        "`prompt` token {t} is not a token id: expected an integer below the vocabulary size {}",
                        st.vocab
                    ),
                )),
            })
            .collect::<Result<Vec<u32>, _>>()?;
        Ok(Prompt { ids, added_bos: 0 })
    };
    match v {
        Some(Value::String(s)) => Ok(vec![text(s)?]),
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => Ok(vec![tokens(a)?]),
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|p| match p {
                Value::String(s) => text(s),
                Value::Array(t) => tokens(t),
                _ => Err(ApiError::invalid(Some("prompt"), shape)),
            })
            .collect(),
        Some(Value::Array(_)) => Err(ApiError::invalid(Some("prompt"), "`prompt` is empty")),
        _ => Err(ApiError::invalid(Some("prompt"), shape)),
    }
}
