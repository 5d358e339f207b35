//! The legacy `/v1/completions` options evaluation harnesses score with (lm-evaluation-harness's
//! API models): `echo` (the prompt comes first in the text) and `logprobs` (OpenAI's old
//! `{tokens, token_logprobs, top_logprobs, text_offset}` object). Their checks and the logprobs
//! object live here, apart from the request checks every endpoint shares, since only text
//! completions, whole or streamed, use them.

use serde_json::{Value, json};

use super::error::ApiError;
use super::state::AppState;
use crate::commands::serve::engine::TokenLogprob;
use ridgefill::io::tokenizer::Tokenizer;

/// Most alternatives `logprobs` may ask for per token (vLLM's default limit).
const MAX_LOGPROBS: usize = 20;

/// The legacy completions' `echo` and `logprobs`, checked as OpenAI checks them.
pub fn options(
    o: &serde_json::Map<String, Value>,
    stream: bool,
) -> Result<(bool, Option<usize>), ApiError> {
    let echo = match o.get("echo") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::invalid(
                Some("echo"),
                format!("`echo` must be true or false, found {v}"),
            ));
        }
    };
    if echo && stream {
        return Err(ApiError::invalid(
            Some("echo"),
            "`echo` cannot be used with `stream`: ask for the whole response",
        ));
    }
    let logprobs = match o.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v <= MAX_LOGPROBS as u64) => {
            n.as_u64().map(|v| v as usize)
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("logprobs"),
                format!("`logprobs` must be an integer from 0 to {MAX_LOGPROBS}, found {v}"),
            ));
        }
    };
    Ok((echo, logprobs))
}

/// OpenAI's legacy `logprobs` object, built token by token.
#[derive(Default)]
pub struct Logprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
}

impl Logprobs {
    /// Adds token `id` at char `offset`; `lp` is `None` for the first prompt token.
    fn push(&mut self, st: &AppState, id: u32, lp: Option<&TokenLogprob>, offset: usize) {
        self.tokens.push(json!(token_text(st, id)));
        self.text_offset.push(json!(offset));
        match lp {
            Some(t) => {
                self.token_logprobs.push(json!(t.logprob));
                let mut top = serde_json::Map::new();
                for &(j, v) in &t.top {
                    top.entry(token_text(st, j)).or_insert(json!(v));
                }
                // OpenAI always lists the chosen token too: up to logprobs + 1 entries.
                top.entry(token_text(st, t.id)).or_insert(json!(t.logprob));
                self.top_logprobs.push(Value::Object(top));
            }
            None => {
                self.token_logprobs.push(Value::Null);
                self.top_logprobs.push(Value::Null);
            }
        }
    }

    /// Adds generated `tokens`, whose byte offsets are into `text`, which itself starts at char
    /// `base` of the choice's text.
    pub fn push_completion(
        &mut self,
        st: &AppState,
        base: usize,
        text: &str,
        tokens: &[TokenLogprob],
    ) {
        for t in tokens {
            self.push(st, t.id, Some(t), base + char_offset(text, t.offset));
        }
    }

    pub fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// `echo`: the prompt's text (less the tokens the server added, such as BOS) and its logprobs
/// entries, one per prompt token; `prompt_lp` holds those of every token after the first.
pub fn echo(
    st: &AppState,
    ids: &[u32],
    added_bos: usize,
    prompt_lp: &[TokenLogprob],
) -> Result<(String, Logprobs), ApiError> {
    let mut lp = Logprobs::default();
    let shown = &ids[added_bos.min(ids.len())..];
    let (echoed, offsets) = decode_with_offsets(&st.tokenizer, shown)?;
    // Tokens the server added (BOS) sit at offset 0 with no text of their own.
    let offsets = std::iter::repeat_n(0, ids.len() - shown.len()).chain(offsets);
    for (i, (&id, offset)) in ids.iter().zip(offsets).enumerate() {
        // OpenAI gives the first prompt token no logprob: nothing precedes it.
        let entry = i.checked_sub(1).and_then(|j| prompt_lp.get(j));
        lp.push(st, id, entry, offset);
    }
    Ok((echoed, lp))
}

/// A token's own text (special tokens by name; a piece of a multi-byte character comes out
/// lossy, as it does from HF's decoder).
fn token_text(st: &AppState, id: u32) -> String {
    st.tokenizer
        .decode(&[id], false)
        .unwrap_or_else(|_| format!("<id {id}>"))
}

/// The text of `ids` and each token's char offset in it, decoded as a stream (a character split
/// across tokens lands at the token that completes it).
fn decode_with_offsets(tok: &Tokenizer, ids: &[u32]) -> Result<(String, Vec<usize>), ApiError> {
    let mut dec = tok.stream_decoder(false);
    let mut text = String::new();
    let mut chars = 0;
    let mut offsets = Vec::with_capacity(ids.len());
    for &id in ids {
        offsets.push(chars);
        if let Some(piece) = dec.push(id).map_err(|e| ApiError::server(e.to_string()))? {
            chars += piece.chars().count();
            text.push_str(&piece);
        }
    }
    Ok((text, offsets))
}

/// The char offset of byte offset `at` in `text` (clamped to the text: a stop string may have
/// cut the tokens after it away).
fn char_offset(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text[..at].chars().count()
}
