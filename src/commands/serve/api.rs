//! The OpenAI-compatible HTTP surface: request checking, OpenAI-shaped errors, JSON and SSE
//! responses. Bodies are parsed here, not by axum's extractors, so every malformed request gets
//! the same `{"error": {...}}` shape the `openai` clients read. `/v1/completions` also takes the
//! legacy options evaluation harnesses score with (lm-evaluation-harness's API models): prompts
//! as token ids (their own tokenization, used as is), batches of prompts, `echo` and `logprobs`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ridgefill::io::chat::{ChatMessage, ChatTemplate};
use ridgefill::io::tokenizer::Tokenizer;
use ridgefill::model::SamplerConfig;
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::engine::{Event, Finish, Job, TokenLogprob};
use super::metrics::Metrics;

/// Seconds a client is told to wait when the queue is full.
const RETRY_AFTER_S: u32 = 1;
/// Roles a chat message may have.
const ROLES: &[&str] = &["system", "user", "assistant"];
/// OpenAI allows at most this many stop strings.
const MAX_STOPS: usize = 4;
/// Largest sampling temperature accepted (OpenAI's range).
const MAX_TEMPERATURE: f64 = 2.0;
/// Most alternatives `logprobs` may ask for per token (vLLM's default limit).
const MAX_LOGPROBS: usize = 20;

pub struct AppState {
    pub queue: SyncSender<Job>,
    pub metrics: Arc<Metrics>,
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// The model's vocabulary: token-id prompts must stay below it.
    pub vocab: usize,
    /// Positions a request's cache holds: prompt plus completion.
    pub ctx: usize,
    pub has_fill: bool,
    pub body_limit: usize,
    pub next_id: std::sync::atomic::AtomicU64,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// An OpenAI-shaped error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn invalid(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }});
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        r
    }
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "unknown endpoint: the server has /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

/// A known path asked with the wrong method: 405 in OpenAI's error shape (axum's own is an empty
/// body), naming the method the path takes.
async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let allowed = match uri.path() {
        "/v1/chat/completions" | "/v1/completions" => "POST",
        _ => "GET",
    };
    let err = ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "method {method} is not allowed on {}: use {allowed}",
            uri.path()
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    };
    let mut r = err.into_response();
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allowed));
    r
}

async fn health() -> axum::Json<Value> {
    axum::Json(json!({"status": "ok"}))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> axum::Json<Value> {
    axum::Json(json!({"object": "list", "data": [{
        "id": st.model_id, "object": "model", "created": unix_now(), "owned_by": "ridgefill",
    }]}))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Reads the body up to the limit and parses it as a JSON object.
async fn read_json(body: Body, limit: usize) -> Result<serde_json::Map<String, Value>, ApiError> {
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
struct Params {
    max_tokens: Option<usize>,
    /// OpenAI's legacy `echo` (completions only): the prompt comes first in text and logprobs.
    echo: bool,
    /// OpenAI's legacy `logprobs` (completions only): this many alternatives per token.
    logprobs: Option<usize>,
    sampler: SamplerConfig,
    stop: Vec<String>,
    stream: bool,
    fill: bool,
    ignore_eos: bool,
}

fn params(
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
        Kind::Text => legacy_logprobs(o, stream)?,
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
    })
}

/// The legacy completions' `echo` and `logprobs`, checked as OpenAI checks them.
fn legacy_logprobs(
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

fn chat_messages(o: &serde_json::Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
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
enum Kind {
    Chat,
    Text,
}

async fn chat(State(st): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let o = read_json(body, st.body_limit).await?;
    let msgs = chat_messages(&o)?;
    let p = params(&o, &st, Kind::Chat)?;
    let tmpl = st.template.as_ref().ok_or_else(|| {
        ApiError::invalid(None, "this model has no chat template: use /v1/completions")
    })?;
    let text = tmpl.render(&msgs, true).map_err(|e| {
        ApiError::invalid(Some("messages"), format!("the chat template failed: {e}"))
    })?;
    let ids = st
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::server(e.to_string()))?;
    let prompt = Prompt { ids, added_bos: 0 };
    submit(&st, Kind::Chat, vec![prompt], p).await
}

/// One prompt of a request, tokenised.
struct Prompt {
    ids: Vec<u32>,
    /// Leading tokens the server added (BOS for a text prompt), not part of the echoed text.
    added_bos: usize,
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let o = read_json(body, st.body_limit).await?;
    let prompts = text_prompts(o.get("prompt"), &st)?;
    let p = params(&o, &st, Kind::Text)?;
    submit(&st, Kind::Text, prompts, p).await
}

/// `prompt` as OpenAI takes it: a string, an array of token ids, or an array of either (one
/// choice each). Text is encoded with the model's BOS; token ids are used as they are.
fn text_prompts(v: Option<&Value>, st: &AppState) -> Result<Vec<Prompt>, ApiError> {
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

/// Checks each prompt against the context, queues one job per prompt and answers as JSON or SSE.
async fn submit(
    st: &Arc<AppState>,
    kind: Kind,
    prompts: Vec<Prompt>,
    p: Params,
) -> Result<Response, ApiError> {
    if p.stream && prompts.len() > 1 {
        return Err(ApiError::invalid(
            Some("prompt"),
            "streaming takes one prompt: send the others as their own requests",
        ));
    }
    let mut receivers = Vec::with_capacity(prompts.len());
    // A later prompt that cannot be queued drops the earlier receivers, which cancels their jobs.
    for prompt in &prompts {
        receivers.push(enqueue(st, kind, prompt.ids.clone(), &p)?);
    }
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{n}"),
        Kind::Text => format!("cmpl-{n}"),
    };
    let head = Head {
        id,
        created: unix_now(),
        model: st.model_id.clone(),
        kind,
    };
    if p.stream {
        let rx = receivers
            .pop()
            .ok_or_else(|| ApiError::server("no prompt was queued"))?;
        return Ok(stream(head, rx, Arc::clone(st)).into_response());
    }
    let mut choices = Vec::with_capacity(prompts.len());
    let mut finishes = Vec::with_capacity(prompts.len());
    for (index, (rx, prompt)) in receivers.into_iter().zip(&prompts).enumerate() {
        let out = collect(rx).await?;
        choices.push(choice(st, kind, index, prompt, &out, &p)?);
        finishes.push(out.finish);
    }
    let object = match kind {
        Kind::Chat => "chat.completion",
        Kind::Text => "text_completion",
    };
    Ok(axum::Json(json!({
        "id": head.id, "object": object, "created": head.created, "model": head.model,
        "choices": choices, "usage": usage(&finishes),
    }))
    .into_response())
}

/// Queues one job; the receiver gets its events.
fn enqueue(
    st: &AppState,
    kind: Kind,
    ids: Vec<u32>,
    p: &Params,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid(None, "the prompt encodes to no tokens"));
    }
    let room = st.ctx.saturating_sub(ids.len());
    let max_tokens = p.max_tokens.unwrap_or(room);
    // Generating needs room for one token; `max_tokens: 0` needs only the prompt to fit.
    if ids.len() > st.ctx || max_tokens > room || (p.max_tokens.is_none() && room == 0) {
        return Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "the prompt has {} tokens and {} completion tokens were asked for, but the context holds {} (--ctx)",
                ids.len(),
                p.max_tokens.map_or("some".into(), |n| n.to_string()),
                st.ctx
            ),
            kind: "invalid_request_error",
            param: Some(match kind {
                Kind::Chat => "messages",
                Kind::Text => "prompt",
            }),
            code: Some("context_length_exceeded"),
        });
    }
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt: ids,
        max_tokens,
        sampler: p.sampler.clone(),
        stop: p.stop.clone(),
        fill: p.fill,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs,
        prompt_logprobs: if p.echo { p.logprobs } else { None },
        events: tx,
        received: Instant::now(),
    };
    st.metrics.queue_depth.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = st.queue.try_send(job) {
        st.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
        return Err(match e {
            TrySendError::Full(_) => {
                st.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                ApiError {
                    status: StatusCode::TOO_MANY_REQUESTS,
                    message: "the server's queue is full; retry shortly".into(),
                    kind: "rate_limit_error",
                    param: None,
                    code: Some("queue_full"),
                }
            }
            TrySendError::Disconnected(_) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the server is shutting down".into(),
                kind: "server_error",
                param: None,
                code: None,
            },
        });
    }
    st.metrics.requests.fetch_add(1, Ordering::Relaxed);
    Ok(rx)
}

/// What every response object of one request repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

/// Token counts summed over the request's choices; times are the slowest choice's.
fn usage(fs: &[Finish]) -> Value {
    let prompt: usize = fs.iter().map(|f| f.prompt_tokens).sum();
    let completion: usize = fs.iter().map(|f| f.completion_tokens).sum();
    let ms = |g: fn(&Finish) -> f64| fs.iter().map(g).fold(0.0, f64::max);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prefill_ms": ms(|f| f.prefill_ms),
        "ttft_ms": ms(|f| f.ttft_ms),
        "fill": fs.iter().any(|f| f.filled),
    })
}

/// Everything one job sent.
struct Outcome {
    text: String,
    /// With `echo` and `logprobs`: the prompt's tokens after the first.
    prompt_lp: Vec<TokenLogprob>,
    /// With `logprobs`: every sampled token's.
    tokens: Vec<TokenLogprob>,
    finish: Finish,
}

async fn collect(mut rx: UnboundedReceiver<Event>) -> Result<Outcome, ApiError> {
    let mut text = String::new();
    let mut prompt_lp = Vec::new();
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Prompt(lp)) => prompt_lp = lp,
            Some(Event::Token(lp)) => tokens.push(lp),
            Some(Event::Done(finish)) => {
                return Ok(Outcome {
                    text,
                    prompt_lp,
                    tokens,
                    finish,
                });
            }
            Some(Event::Failed(e)) => return Err(ApiError::server(e)),
            None => return Err(ApiError::server("the request was dropped by the scheduler")),
        }
    }
}

/// One entry of `choices` for a whole (not streamed) response.
fn choice(
    st: &AppState,
    kind: Kind,
    index: usize,
    prompt: &Prompt,
    out: &Outcome,
    p: &Params,
) -> Result<Value, ApiError> {
    if kind == Kind::Chat {
        return Ok(
            json!({"index": index, "message": {"role": "assistant", "content": out.text}, "finish_reason": out.finish.reason, "logprobs": null}),
        );
    }
    let mut lp = Logprobs::default();
    let mut text = String::new();
    if p.echo {
        let shown = &prompt.ids[prompt.added_bos.min(prompt.ids.len())..];
        let (echoed, offsets) = decode_with_offsets(&st.tokenizer, shown)?;
        // Tokens the server added (BOS) sit at offset 0 with no text of their own.
        let offsets = std::iter::repeat_n(0, prompt.ids.len() - shown.len()).chain(offsets);
        for (i, (&id, offset)) in prompt.ids.iter().zip(offsets).enumerate() {
            // OpenAI gives the first prompt token no logprob: nothing precedes it.
            let entry = i.checked_sub(1).and_then(|j| out.prompt_lp.get(j));
            lp.push(st, id, entry, offset);
        }
        text = echoed;
    }
    let base = text.chars().count();
    text.push_str(&out.text);
    for t in &out.tokens {
        lp.push(st, t.id, Some(t), base + char_offset(&out.text, t.offset));
    }
    let logprobs = if p.logprobs.is_some() {
        lp.into_json()
    } else {
        Value::Null
    };
    Ok(
        json!({"index": index, "text": text, "finish_reason": out.finish.reason, "logprobs": logprobs}),
    )
}

/// OpenAI's legacy `logprobs` object, built token by token.
#[derive(Default)]
struct Logprobs {
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

    fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
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

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. Dropping the stream
/// (the client went away) closes the receiver, which frees the request's slot. A completion's
/// token logprobs ride on the chunk that carries their text.
fn stream(
    h: Head,
    rx: UnboundedReceiver<Event>,
    st: Arc<AppState>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let object = match h.kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Text => "text_completion",
    };
    let chunk = move |choice: Value, usage: Option<Value>| {
        let mut v = json!({"id": h.id, "object": object, "created": h.created, "model": h.model, "choices": [choice]});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    };
    let kind = h.kind;
    let state = StreamState {
        rx,
        started: false,
        ended: false,
        text: String::new(),
        pending: Vec::new(),
    };
    let s = futures_util::stream::unfold(state, move |mut s| {
        let chunk = chunk.clone();
        let st = Arc::clone(&st);
        async move {
            if s.ended {
                return None;
            }
            if kind == Kind::Chat && !s.started {
                s.started = true;
                let c = chunk(
                    json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}),
                    None,
                );
                return Some((Ok(c), s));
            }
            s.started = true;
            let ev = loop {
                match s.rx.recv().await {
                    Some(Event::Token(t)) => s.pending.push(t),
                    Some(Event::Prompt(_)) => {}
                    Some(Event::Text(t)) => {
                        s.text.push_str(&t);
                        break match kind {
                            Kind::Chat => chunk(
                                json!({"index": 0, "delta": {"content": t}, "finish_reason": null}),
                                None,
                            ),
                            Kind::Text => chunk(
                                json!({"index": 0, "text": t, "finish_reason": null, "logprobs": s.take_logprobs(&st)}),
                                None,
                            ),
                        };
                    }
                    // After the last event the receiver is closed: the next poll sends [DONE].
                    Some(Event::Done(f)) => {
                        s.rx.close();
                        break match kind {
                            Kind::Chat => chunk(
                                json!({"index": 0, "delta": {}, "finish_reason": f.reason}),
                                Some(usage(std::slice::from_ref(&f))),
                            ),
                            Kind::Text => chunk(
                                json!({"index": 0, "text": "", "finish_reason": f.reason, "logprobs": s.take_logprobs(&st)}),
                                Some(usage(std::slice::from_ref(&f))),
                            ),
                        };
                    }
                    Some(Event::Failed(e)) => {
                        s.rx.close();
                        break SseEvent::default().data(
                            json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}).to_string(),
                        );
                    }
                    None => {
                        s.ended = true;
                        return Some((Ok(SseEvent::default().data("[DONE]")), s));
                    }
                }
            };
            Some((Ok(ev), s))
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}

/// Where a stream stands.
struct StreamState {
    rx: UnboundedReceiver<Event>,
    /// Whether the chat role chunk went out.
    started: bool,
    ended: bool,
    /// The completion text sent so far (token offsets are into it).
    text: String,
    /// Token logprobs whose text has not gone out yet.
    pending: Vec<TokenLogprob>,
}

impl StreamState {
    /// The pending tokens' logprobs object (`null` when the request asked for none).
    fn take_logprobs(&mut self, st: &AppState) -> Value {
        if self.pending.is_empty() {
            return Value::Null;
        }
        let mut lp = Logprobs::default();
        for t in self.pending.drain(..) {
            lp.push(st, t.id, Some(&t), char_offset(&self.text, t.offset));
        }
        lp.into_json()
    }
}
