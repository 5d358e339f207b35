//! The OpenAI-compatible HTTP surface: request checking, OpenAI-shaped errors, JSON and SSE
//! responses. Bodies are parsed here, not by axum's extractors, so every malformed request gets
//! the same `{"error": {...}}` shape the `openai` clients read.

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

use super::engine::{Event, Finish, Job};
use super::metrics::Metrics;

/// Seconds a client is told to wait when the queue is full.
const RETRY_AFTER_S: u32 = 1;
/// Roles a chat message may have.
const ROLES: &[&str] = &["system", "user", "assistant"];
/// OpenAI allows at most this many stop strings.
const MAX_STOPS: usize = 4;
/// Largest sampling temperature accepted (OpenAI's range).
const MAX_TEMPERATURE: f64 = 2.0;

pub struct AppState {
    pub queue: SyncSender<Job>,
    pub metrics: Arc<Metrics>,
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
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
    sampler: SamplerConfig,
    stop: Vec<String>,
    stream: bool,
    fill: bool,
    ignore_eos: bool,
}

fn params(o: &serde_json::Map<String, Value>, st: &AppState) -> Result<Params, ApiError> {
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
    let count = |key: &'static str| -> Result<Option<usize>, ApiError> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v > 0) => {
                Ok(n.as_u64().map(|v| v as usize))
            }
            Some(v) => Err(ApiError::invalid(
                Some(key),
                format!("`{key}` must be a positive integer, found {v}"),
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
    let fill = boolean("fill")?.unwrap_or(true) && st.has_fill;
    let seed = seed.unwrap_or_else(|| st.next_id.load(Ordering::Relaxed));
    Ok(Params {
        max_tokens,
        sampler: SamplerConfig {
            temperature: temperature as f32,
            // OpenAI's sampling: temperature and nucleus only.
            top_k: 0,
            top_p: top_p as f32,
            min_p: 0.0,
            seed,
        },
        stop,
        stream: boolean("stream")?.unwrap_or(false),
        fill,
        // llama-server's extension: generate max_tokens tokens (benchmarks).
        ignore_eos: boolean("ignore_eos")?.unwrap_or(false),
    })
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
    let p = params(&o, &st)?;
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
    submit(&st, Kind::Chat, ids, p).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let o = read_json(body, st.body_limit).await?;
    let prompt = match o.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid(Some("prompt"), "`prompt` is empty"));
        }
        _ => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "`prompt` must be a string",
            ));
        }
    };
    let p = params(&o, &st)?;
    let ids = st
        .tokenizer
        .encode(&prompt, true)
        .map_err(|e| ApiError::server(e.to_string()))?;
    submit(&st, Kind::Text, ids, p).await
}

/// Checks the prompt against the context, queues the job and answers as JSON or SSE.
async fn submit(
    st: &Arc<AppState>,
    kind: Kind,
    ids: Vec<u32>,
    p: Params,
) -> Result<Response, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid(None, "the prompt encodes to no tokens"));
    }
    let room = st.ctx.saturating_sub(ids.len());
    let max_tokens = p.max_tokens.unwrap_or(room);
    if room == 0 || max_tokens > room {
        return Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "the prompt has {} tokens and {} completion tokens were asked for, but the context holds {} (--ctx)",
                ids.len(),
                p.max_tokens.map_or("some".into(), |n| n.to_string()),
                st.ctx
            ),
            kind: "invalid_request_error",
            param: Some("messages"),
            code: Some("context_length_exceeded"),
        });
    }
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt: ids,
        max_tokens,
        sampler: p.sampler,
        stop: p.stop,
        fill: p.fill,
        ignore_eos: p.ignore_eos,
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
        Ok(stream(head, rx).into_response())
    } else {
        whole(head, rx).await
    }
}

/// What every response object of one request repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prefill_ms": f.prefill_ms,
        "ttft_ms": f.ttft_ms,
        "fill": f.filled,
    })
}

async fn whole(h: Head, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let finish = loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done(f)) => break f,
            Some(Event::Failed(e)) => return Err(ApiError::server(e)),
            None => return Err(ApiError::server("the request was dropped by the scheduler")),
        }
    };
    let choice = match h.kind {
        Kind::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish.reason, "logprobs": null})
        }
        Kind::Text => {
            json!({"index": 0, "text": text, "finish_reason": finish.reason, "logprobs": null})
        }
    };
    let object = match h.kind {
        Kind::Chat => "chat.completion",
        Kind::Text => "text_completion",
    };
    Ok(axum::Json(json!({
        "id": h.id, "object": object, "created": h.created, "model": h.model,
        "choices": [choice], "usage": usage(&finish),
    }))
    .into_response())
}

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. Dropping the stream
/// (the client went away) closes the receiver, which frees the request's slot.
fn stream(
    h: Head,
    rx: UnboundedReceiver<Event>,
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
    // State: the receiver, whether the role chunk went out, whether the stream has ended.
    let s = futures_util::stream::unfold((rx, false, false), move |(mut rx, started, ended)| {
        let chunk = chunk.clone();
        async move {
            if ended {
                return None;
            }
            if kind == Kind::Chat && !started {
                let c = chunk(
                    json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}),
                    None,
                );
                return Some((Ok(c), (rx, true, false)));
            }
            let ev = match rx.recv().await {
                Some(Event::Text(t)) => match kind {
                    Kind::Chat => chunk(
                        json!({"index": 0, "delta": {"content": t}, "finish_reason": null}),
                        None,
                    ),
                    Kind::Text => {
                        chunk(json!({"index": 0, "text": t, "finish_reason": null}), None)
                    }
                },
                // After the last event the receiver is closed: the next poll sends [DONE].
                Some(Event::Done(f)) => {
                    rx.close();
                    match kind {
                        Kind::Chat => chunk(
                            json!({"index": 0, "delta": {}, "finish_reason": f.reason}),
                            Some(usage(&f)),
                        ),
                        Kind::Text => chunk(
                            json!({"index": 0, "text": "", "finish_reason": f.reason}),
                            Some(usage(&f)),
                        ),
                    }
                }
                Some(Event::Failed(e)) => {
                    rx.close();
                    SseEvent::default().data(
                        json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}).to_string(),
                    )
                }
                None => return Some((Ok(SseEvent::default().data("[DONE]")), (rx, true, true))),
            };
            Some((Ok(ev), (rx, true, false)))
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}
