//! Streamed responses: server-sent events in OpenAI's chunk format, one chunk per piece of text
//! as the scheduler sends it, the last carrying `finish_reason` and `usage` (the same object a
//! whole response has, fill report included), then `data: [DONE]`. Apart from the whole
//! responses because a stream is a state machine over the job's events, not one JSON value.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::legacy::Logprobs;
use super::request::Kind;
use super::response::{Head, usage};
use super::state::AppState;
use crate::commands::serve::engine::{Event, TokenLogprob};

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. Dropping the stream
/// (the client went away) closes the receiver, which frees the request's slot. A completion's
/// token logprobs ride on the chunk that carries their text.
pub fn stream(
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
        lp.push_completion(st, 0, &self.text, &self.pending);
        self.pending.clear();
        lp.into_json()
    }
}
