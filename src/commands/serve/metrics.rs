//! Server counters, served as Prometheus text at `/metrics`.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use ridgefill::model::fill::FillReport;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub rejected: AtomicU64,
    pub queue_depth: AtomicUsize,
    pub active: AtomicUsize,
    /// Finished requests' caches kept for reuse, and their bytes.
    pub idle_caches: AtomicUsize,
    pub idle_cache_bytes: AtomicUsize,
    pub shutdown: AtomicBool,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    prompt_tokens: u64,
    completion_tokens: u64,
    /// Completed requests whose prompt skipped upper layers (skip-and-fill ran).
    filled: u64,
    /// Prompt rows whose upper-layer K/V were filled, over every completed request.
    filled_rows: u64,
    /// Completed requests whose fill failed its self-check (`--max-fill-error`) and ran every
    /// layer exactly.
    fill_fallbacks: u64,
    /// Completed requests whose fill failed its self-check and was filled again with more rows
    /// exact (`--retry-exact`).
    fill_retries: u64,
    prefill_tokens: u64,
    prefill_seconds: f64,
    /// Prompt tokens taken from a cached prefix, and those prefilled, over every started request.
    cache_hit_tokens: u64,
    cache_miss_tokens: u64,
    decode_tokens: u64,
    decode_seconds: f64,
    /// Filled rows of idle caches run exactly while the server was idle, and the time it took.
    settled_rows: u64,
    settle_seconds: f64,
    /// Filled rows run exactly during decoding where the generated tokens read them, the
    /// restores that did it and their time (its tokens' rows included).
    restored_rows: u64,
    restores: u64,
    restore_seconds: f64,
    decode_steps: u64,
    ttft_counts: [u64; TTFT_BUCKETS.len()],
    ttft_sum: f64,
    ttft_count: u64,
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Inner)) {
        // A panic elsewhere cannot leave these counters half-updated in a harmful way.
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g);
    }

    /// A request started with `hit` prompt tokens reused from a cached prefix, `miss` to prefill.
    pub fn record_cache(&self, hit: usize, miss: usize) {
        self.with(|m| {
            m.cache_hit_tokens += hit as u64;
            m.cache_miss_tokens += miss as u64;
        });
    }

    /// One idle batch of settling that ran `rows` filled rows exactly.
    pub fn record_settled(&self, rows: usize, took: Duration) {
        self.with(|m| {
            m.settled_rows += rows as u64;
            m.settle_seconds += took.as_secs_f64();
        });
    }

    /// One restore during a decode that ran `rows` filled rows exactly.
    pub fn record_restore(&self, rows: usize, took: Duration) {
        self.with(|m| {
            m.restored_rows += rows as u64;
            m.restores += 1;
            m.restore_seconds += took.as_secs_f64();
        });
    }

    /// The idle caches now kept: how many, and their bytes.
    pub fn record_idle(&self, caches: usize, bytes: usize) {
        self.idle_caches.store(caches, Ordering::Relaxed);
        self.idle_cache_bytes.store(bytes, Ordering::Relaxed);
    }

    pub fn record_prefill(&self, tokens: usize, took: Duration) {
        self.with(|m| {
            m.prefill_tokens += tokens as u64;
            m.prefill_seconds += took.as_secs_f64();
        });
    }

    /// One batched decode step that produced `tokens` tokens.
    pub fn record_decode(&self, tokens: usize, took: Duration) {
        self.with(|m| {
            m.decode_tokens += tokens as u64;
            m.decode_seconds += took.as_secs_f64();
            m.decode_steps += 1;
        });
    }

    pub fn record_ttft(&self, seconds: f64) {
        self.with(|m| {
            for (c, &b) in m.ttft_counts.iter_mut().zip(&TTFT_BUCKETS) {
                if seconds <= b {
                    *c += 1;
                }
            }
            m.ttft_sum += seconds;
            m.ttft_count += 1;
        });
    }

    /// A completed request; `report` is what skip-and-fill did with its prompt, if it ran.
    pub fn record_done(
        &self,
        prompt: usize,
        completion: usize,
        filled: bool,
        report: Option<&FillReport>,
    ) {
        self.with(|m| {
            m.prompt_tokens += prompt as u64;
            m.completion_tokens += completion as u64;
            m.filled += u64::from(filled);
            if let Some(r) = report {
                m.filled_rows += r.filled as u64;
                m.fill_fallbacks += u64::from(r.fell_back);
                m.fill_retries += u64::from(r.widened);
            }
        });
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP ridgefill_{name} {help}");
            let _ = writeln!(out, "# TYPE ridgefill_{name} {kind}");
            let _ = writeln!(out, "ridgefill_{name} {value}");
        };
        let rate = |t: u64, s: f64| if s > 0.0 { t as f64 / s } else { 0.0 };
        metric(
            "requests_total",
            "counter",
            "Requests accepted.",
            self.requests.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "requests_rejected_total",
            "counter",
            "Requests refused because the queue was full.",
            self.rejected.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of completed requests.",
            m.prompt_tokens.to_string(),
        );
        metric(
            "completion_tokens_total",
            "counter",
            "Generated tokens of completed requests.",
            m.completion_tokens.to_string(),
        );
        // What an evaluation against a fill server checks: the fill really ran.
        metric(
            "filled_requests_total",
            "counter",
            "Completed requests prefilled with skip-and-fill.",
            m.filled.to_string(),
        );
        metric(
            "prompt_cache_hit_tokens_total",
            "counter",
            "Prompt tokens reused from a slot's cached prefix instead of prefilled.",
            m.cache_hit_tokens.to_string(),
        );
        metric(
            "prompt_cache_miss_tokens_total",
            "counter",
            "Prompt tokens prefilled (not found in any cached prefix).",
            m.cache_miss_tokens.to_string(),
        );
        metric(
            "filled_rows_total",
            "counter",
            "Prompt rows whose upper-layer K/V skip-and-fill predicted instead of computing.",
            m.filled_rows.to_string(),
        );
        metric(
            "fill_fallbacks_total",
            "counter",
            "Completed requests whose fill failed its self-check (--max-fill-error) and ran every layer exactly.",
            m.fill_fallbacks.to_string(),
        );
        metric(
            "fill_retries_total",
            "counter",
            "Completed requests whose fill failed its self-check and was filled again with more rows exact (--retry-exact).",
            m.fill_retries.to_string(),
        );
        metric(
            "settled_rows_total",
            "counter",
            "Filled rows of idle caches run exactly while the server had nothing else to do.",
            m.settled_rows.to_string(),
        );
        metric(
            "settle_seconds_total",
            "counter",
            "Seconds spent settling idle caches' filled rows.",
            format!("{:.6}", m.settle_seconds),
        );
        metric(
            "decode_restored_rows_total",
            "counter",
            "Filled rows run exactly while decoding, where the generated tokens read them (--restore-every).",
            m.restored_rows.to_string(),
        );
        metric(
            "decode_restores_total",
            "counter",
            "Restores during decoding: the tokens since the last one run again as a prefill over the cache.",
            m.restores.to_string(),
        );
        metric(
            "decode_restore_seconds_total",
            "counter",
            "Seconds spent in restores during decoding.",
            format!("{:.6}", m.restore_seconds),
        );
        metric(
            "queue_depth",
            "gauge",
            "Requests waiting for a slot.",
            self.queue_depth.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "active_requests",
            "gauge",
            "Requests holding a slot (prefilling or decoding).",
            self.active.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "prompt_cache_entries",
            "gauge",
            "Finished requests' caches kept for prefix reuse.",
            self.idle_caches.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "prompt_cache_bytes",
            "gauge",
            "Bytes of the caches kept for prefix reuse (K/V storage and fill history).",
            self.idle_cache_bytes.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "prefill_seconds_total",
            "counter",
            "Seconds from each request's first prefill chunk to its first token's logits, summed (other slots' steps in between count too: with --parallel 1 it is pure prefill).",
            format!("{:.6}", m.prefill_seconds),
        );
        metric(
            "prefill_tokens_per_second",
            "gauge",
            "Prompt tokens per second of prefill, over the server's life.",
            format!("{:.3}", rate(m.prefill_tokens, m.prefill_seconds)),
        );
        metric(
            "decode_tokens_per_second",
            "gauge",
            "Generated tokens per second of batched decode steps, over the server's life.",
            format!("{:.3}", rate(m.decode_tokens, m.decode_seconds)),
        );
        metric(
            "decode_steps_total",
            "counter",
            "Batched decode steps.",
            m.decode_steps.to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP ridgefill_ttft_seconds Time from request to first token."
        );
        let _ = writeln!(out, "# TYPE ridgefill_ttft_seconds histogram");
        for (c, b) in m.ttft_counts.iter().zip(TTFT_BUCKETS) {
            let _ = writeln!(out, "ridgefill_ttft_seconds_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "ridgefill_ttft_seconds_bucket{{le=\"+Inf\"}} {}",
            m.ttft_count
        );
        let _ = writeln!(out, "ridgefill_ttft_seconds_sum {:.6}", m.ttft_sum);
        let _ = writeln!(out, "ridgefill_ttft_seconds_count {}", m.ttft_count);
        out
    }
}
