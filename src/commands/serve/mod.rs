//! `ridgefill serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of the
//! continuous-batching scheduler in [`engine`].

mod api;
mod engine;
mod metrics;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

use super::common::{ModelArgs, RowArgs, load};
use metrics::Metrics;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Skip-and-fill prefill with this fill file (made by `ridgefill fit`), shaped by the row
    /// flags below (`--tail`, `--question-tail`, the `--max-fill-error` self-check and its
    /// `--fill-deeper` fallbacks); a request turns it off with `"fill": false`, and each
    /// response's `usage.fill_report` says what it filled.
    #[arg(long)]
    pub fill: Option<PathBuf>,
    #[command(flatten)]
    pub rows: RowArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together in one batched step.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub parallel: u64,
    /// Requests waiting for a slot beyond which new ones get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Context per request (prompt + completion); defaults to the model's, capped at 8192.
    #[arg(short = 'c', long = "ctx")]
    pub ctx: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Prefill every prompt whole: finished requests' caches are not kept for later requests
    /// sharing their prefix (per request: `"cache_prompt": false`).
    #[arg(long)]
    pub no_cache_prompt: bool,
    /// Megabytes of finished requests' caches kept beyond one per slot (least recently used
    /// dropped first), so a shared system prompt or document survives slot churn; 0 keeps only
    /// the slots' own. The caches live where the device keeps K/V: host RAM on `cpu`.
    #[arg(long, default_value_t = DEFAULT_CACHE_RAM_MB)]
    pub cache_ram: usize,
    /// Leave idle caches' filled rows as predicted. By default, while no request runs, the
    /// server re-runs them exactly a few rows at a time, so a conversation's next turn reuses an
    /// exact cache and re-runs no spans.
    #[arg(long)]
    pub no_settle: bool,
}

/// Default `--cache-ram`: a few dozen 4k-token SmolLM2 prompts, or ten 8k-token Llama-1B ones.
const DEFAULT_CACHE_RAM_MB: usize = 2048;
/// Bytes in one `--cache-ram` megabyte.
const MB: usize = 1 << 20;

/// Largest default context (the KV cache of each slot is sized per request).
const DEFAULT_CTX_CAP: usize = 8192;

pub fn run(a: Args) -> Result<()> {
    // Checked before the model loads: a typo should not cost a load.
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .with_context(|| format!("--host {:?} --port {}: not an address", a.host, a.port))?;
    let ctx_guess = a.ctx.unwrap_or(DEFAULT_CTX_CAP);
    let loaded = load(&a.model.load_args(), ctx_guess)?;
    let cfg = &loaded.model.config;
    let ctx = a
        .ctx
        .unwrap_or_else(|| cfg.max_position_embeddings.clamp(1, DEFAULT_CTX_CAP));
    let (fill, mode) = match &a.fill {
        Some(path) => {
            let (method, maps, rows) = ridgefill::fillfile::load_configured(
                path,
                &loaded.ckpt,
                &loaded.model,
                &a.rows.choice(),
            )?;
            // The self-check's and coverage check's limits and the deeper splits they fall back
            // to, if any.
            let mut check = String::new();
            if rows.min_coverage > 0.0 && maps.deeper.is_some() {
                check += &format!(", min span coverage {}", rows.min_coverage);
            }
            if rows.max_error.is_finite() {
                check += &format!(", max fill error {:.3}", rows.max_error);
            }
            if rows.max_span_error.is_finite() {
                check += &format!(", max span error {:.3}", rows.max_span_error);
            }
            if !check.is_empty() {
                let mut d = maps.deeper.as_deref();
                while let Some(m) = d {
                    check += &format!(" then s={}", m.split);
                    d = m.deeper.as_deref();
                }
            }
            let mode = format!("skip-and-fill s={} {method}{check}", maps.split);
            (Some(engine::Fill { maps, rows }), mode)
        }
        None => (None, "full prefill".to_string()),
    };
    let model_id = loaded.ckpt.path.file_stem().map_or_else(
        || a.model.model.clone(),
        |s| s.to_string_lossy().into_owned(),
    );
    let metrics = Arc::new(Metrics::default());
    let (queue_tx, queue_rx) = std::sync::mpsc::sync_channel(a.queue);
    let state = Arc::new(api::AppState {
        queue: queue_tx,
        metrics: Arc::clone(&metrics),
        model_id,
        tokenizer: loaded.ckpt.tokenizer.clone(),
        template: loaded.ckpt.chat_template.clone(),
        vocab: cfg.vocab_size,
        ctx,
        has_fill: fill.is_some(),
        body_limit: a.max_body,
        next_id: AtomicU64::new(1),
    });
    let parallel = a.parallel as usize;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    eprintln!(
        "serve: {} on {} ({}) | {mode} | parallel {parallel} | ctx {ctx} | listening on http://{bound}",
        loaded.ckpt.path.display(),
        loaded.device.backend,
        loaded.device.adapter,
    );
    std::thread::scope(|scope| -> Result<()> {
        let engine_metrics = Arc::clone(&metrics);
        let (model, tokenizer, fill) = (&loaded.model, &loaded.ckpt.tokenizer, fill.as_ref());
        scope.spawn(move || {
            engine::Engine {
                model,
                tokenizer,
                fill,
                parallel,
                metrics: engine_metrics,
                cache_prompt: !a.no_cache_prompt,
                cache_ram: a.cache_ram.saturating_mul(MB),
                settle: !a.no_settle,
                min_rows: model.reuse_min_rows(),
                ctx,
            }
            .run(queue_rx)
        });
        let app = api::router(state);
        let shutdown_metrics = Arc::clone(&metrics);
        let served = rt.block_on(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    shutdown_signal().await;
                    eprintln!("serve: stopping: in-flight requests are cancelled");
                    // The scheduler fails what is running, so open streams end and the
                    // graceful shutdown completes.
                    shutdown_metrics.shutdown.store(true, Ordering::SeqCst);
                })
                .await
        });
        metrics.shutdown.store(true, Ordering::SeqCst);
        served.context("the HTTP server failed")
    })
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
