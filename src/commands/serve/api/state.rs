//! What every handler shares: the scheduler's queue, the counters, and the model facts a request
//! is checked against. Its own file so the request checks, the response shaping and the router
//! all read it without any of them importing another.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::SyncSender;

use ridgefill::io::chat::ChatTemplate;
use ridgefill::io::tokenizer::Tokenizer;

use crate::commands::serve::engine::Job;
use crate::commands::serve::metrics::Metrics;

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
    pub next_id: AtomicU64,
}
