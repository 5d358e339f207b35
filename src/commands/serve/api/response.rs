//! Whole (not streamed) responses: gathering one job's events, and the JSON OpenAI's clients
//! expect: each choice (a chat message, or a completion's text with the legacy `echo` and
//! `logprobs`), and `usage` with the server's additions (prefill and TTFT times, and what
//! skip-and-fill did with the prompt). The stream sends the same `usage` on its last chunk.

use ridgefill::model::fill::FillReport;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::legacy::{self, Logprobs};
use super::request::{Kind, Params, Prompt};
use super::state::AppState;
use crate::commands::serve::engine::{Event, Finish, TokenLogprob};

/// What every response object of one request repeats.
pub struct Head {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
}

/// Token counts summed over the request's choices; times are the slowest choice's. `fill` is
/// whether any choice's prompt had rows filled; `fill_report` is what the fill did (`null` when
/// no choice ran it).
pub fn usage(fs: &[Finish]) -> Value {
    let prompt: usize = fs.iter().map(|f| f.prompt_tokens).sum();
    let completion: usize = fs.iter().map(|f| f.completion_tokens).sum();
    let cached: usize = fs.iter().map(|f| f.cached_tokens).sum();
    let ms = |g: fn(&Finish) -> f64| fs.iter().map(g).fold(0.0, f64::max);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prefill_ms": ms(|f| f.prefill_ms),
        "ttft_ms": ms(|f| f.ttft_ms),
        "fill": fs.iter().any(|f| f.filled),
        "fill_report": fill_report(
            fs.iter().filter_map(|f| f.report.as_ref()),
            fs.iter().map(|f| f.decode_restored).sum(),
        ),
    })
}

/// The fill reports of a request's choices as one object: rows summed, the deepest split that
/// filled, the largest self-check errors (every exact row, spans alone), the smallest span coverage, whether any prompt fell
/// back to exact layers or was filled again with more rows exact, and the rows earlier requests had filled that this one's spans ran
/// exactly (prefix reuse) with the largest share of attention those filled rows drew, and the
/// filled rows the decodes restored where their tokens read them.
fn fill_report<'a>(reports: impl Iterator<Item = &'a FillReport>, decode_restored: usize) -> Value {
    let rs: Vec<&FillReport> = reports.collect();
    if rs.is_empty() {
        return Value::Null;
    }
    json!({
        "filled_rows": rs.iter().map(|r| r.filled).sum::<usize>(),
        "exact_tail": rs.iter().map(|r| r.tail).sum::<usize>(),
        "split": rs.iter().filter_map(|r| r.split).max(),
        "self_check_error": rs.iter().filter_map(|r| r.error).reduce(f64::max),
        "self_check_span_error": rs.iter().filter_map(|r| r.error_spans).reduce(f64::max),
        "span_coverage": rs.iter().filter_map(|r| r.coverage).reduce(f64::min),
        "fell_back": rs.iter().any(|r| r.fell_back),
        "widened": rs.iter().any(|r| r.widened),
        "restored_rows": rs.iter().map(|r| r.restored).sum::<usize>(),
        "filled_attention": rs.iter().filter_map(|r| r.filled_attention).reduce(f64::max),
        "decode_restored_rows": decode_restored,
    })
}

/// Everything one job sent.
pub struct Outcome {
    text: String,
    /// With `echo` and `logprobs`: the prompt's tokens after the first.
    prompt_lp: Vec<TokenLogprob>,
    /// With `logprobs`: every sampled token's.
    tokens: Vec<TokenLogprob>,
    pub finish: Finish,
}

/// Waits for one job's events until it is done (or failed).
pub async fn collect(mut rx: UnboundedReceiver<Event>) -> Result<Outcome, ApiError> {
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
pub fn choice(
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
    let (mut text, mut lp) = if p.echo {
        legacy::echo(st, &prompt.ids, prompt.added_bos, &out.prompt_lp)?
    } else {
        (String::new(), Logprobs::default())
    };
    let base = text.chars().count();
    text.push_str(&out.text);
    lp.push_completion(st, base, &out.text, &out.tokens);
    let logprobs = if p.logprobs.is_some() {
        lp.into_json()
    } else {
        Value::Null
    };
    Ok(
        json!({"index": index, "text": text, "finish_reason": out.finish.reason, "logprobs": logprobs}),
    )
}
