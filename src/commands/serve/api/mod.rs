//! The OpenAI-compatible HTTP surface: the router, the handlers, and the hand-off of checked
//! requests to the scheduler. Bodies are parsed by [`request`], not by axum's extractors, so
//! every malformed request gets the same `{"error": {...}}` shape ([`error`]) the `openai`
//! clients read. `/v1/completions` also takes the legacy options evaluation harnesses score with
//! (lm-evaluation-harness's API models): prompts as token ids (their own tokenization, used as
//! is), batches of prompts, `echo` and `logprobs` ([`legacy`]). Answers are whole JSON
//! ([`response`]) or server-sent events ([`stream`]).

mod error;
mod legacy;
mod request;
mod response;
mod state;
mod stream;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TrySendError;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::engine::{Event, Job};
use error::{ApiError, method_not_allowed, not_found};
use request::{Kind, Params, Prompt, chat_messages, params, read_json, text_prompts};
use response::{Head, choice, collect, usage};
pub use state::AppState;

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

/// `POST /v1/chat/completions`: the messages through the model's chat template, one choice.
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

/// `POST /v1/completions`: one choice per prompt.
async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let o = read_json(body, st.body_limit).await?;
    let prompts = text_prompts(o.get("prompt"), &st)?;
    let p = params(&o, &st, Kind::Text)?;
    submit(&st, Kind::Text, prompts, p).await
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
        return Ok(stream::stream(head, rx, Arc::clone(st)).into_response());
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
        cache_prompt: p.cache_prompt,
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
