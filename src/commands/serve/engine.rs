//! The scheduler: one thread owns the model and runs continuous batching over up to `parallel`
//! sequences. Between decode steps it admits queued requests and prefills one chunk of one
//! prompt (skip-and-fill too), so a long prompt delays the running streams by at most one chunk
//! per step; every sequence that is decoding advances in one batched step
//! ([`Decoder::decode_batch`](ridgefill::model::Decoder::decode_batch)).
//!
//! A finished request leaves its cache behind, with the tokens it holds (prompt and the fed
//! completion tokens): a new request takes the idle cache with the longest common token prefix
//! (ties: least recently used) and prefills only the rest, as llama-server's `cache_prompt` and
//! vLLM's prefix caching do (a copy of it when that prefix is under half of what it holds, so a
//! short shared prefix does not cost another conversation its cache). The `parallel` most recently
//! used idle caches stay (one per slot), and older ones while they fit in `cache_ram` bytes
//! (llama-server's `--cache-ram`), the least recently used dropped first. A fill request continues
//! a cached prefix with skip-and-fill ([`Prefill::resume`]): its question's spans may re-run rows
//! an earlier request filled, from the split input the cache's [`FillHistory`] keeps. A request
//! that runs every layer reuses a prefix only where no row was ever filled. A request that fails or
//! whose client goes away drops its cache, so no half-written cache is ever reused.
//!
//! While no request is running or waiting, the scheduler gives the most recently used idle cache
//! short of room half its length again (so the next turn does not copy it), and settles the most
//! recently used idle cache that still holds filled rows ([`settle`], [`SETTLE_ROWS`] rows at a
//! time, checking the queue between batches): a conversation's next fill turn then reuses a cache
//! with no predictions left and re-runs no spans (`--no-settle` leaves them filled). A settled
//! cache still serves only filling requests: its rows ran over predictions once.
//!
//! A request asking for log-probabilities gets them from the same logits it samples from; one
//! that wants its prompt's (OpenAI's `echo` with `logprobs`, what evaluation harnesses score
//! with) is prefilled in full with every position's logits, since skip-and-fill computes no
//! logits for the rows it skips.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use ridgefill::io::tokenizer::{StreamDecoder, Tokenizer};
use ridgefill::model::fill::decode::{restore, restore_due};
use ridgefill::model::fill::{
    FillHistory, FillMaps, FillOptions, FillReport, FillRows, Prefill, settle,
};
use ridgefill::model::sample::sample_rows;
use ridgefill::model::{Decoder, decoder::PREFILL_CHUNK};
use ridgefill::model::{KvCache, Sampler, SamplerConfig, to_host_f32};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::commands::common::{SETTLE_AFTER, reusable_prefix};

/// How long the idle scheduler waits for a request before checking for shutdown.
const IDLE_POLL: Duration = Duration::from_millis(50);
/// Filled rows settled per idle batch: a request arriving meanwhile waits for at most one
/// (~40 ms for SmolLM2's upper half over a 3000-token cache on 2 cores).
pub const SETTLE_ROWS: usize = 32;

/// One generation request, tokenised and checked by the HTTP layer.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Skip-and-fill prefill for this request (when the server has a fill file).
    pub fill: bool,
    /// Generate `max_tokens` even past EOS (benchmarks).
    pub ignore_eos: bool,
    /// Log-probabilities of the generated tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
    /// Also the prompt's log-probabilities (every token after the first), with this many
    /// alternatives each; forces full prefill.
    pub prompt_logprobs: Option<usize>,
    /// May reuse a cached prefix (OpenAI-compatible servers' `cache_prompt`).
    pub cache_prompt: bool,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

/// What a request's stream receives.
#[derive(Debug)]
pub enum Event {
    /// Newly completed text (never splits a UTF-8 character or a possible stop string).
    Text(String),
    /// The log-probabilities of the prompt's tokens after the first, in order (sent once, after
    /// the prefill and before any text).
    Prompt(Vec<TokenLogprob>),
    /// The log-probability of one generated token (sent before the text it completes, and for a
    /// token that ends the completion, such as EOS, too).
    Token(TokenLogprob),
    Done(Finish),
    /// The request could not be completed (a model error, or the server shutting down).
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct Finish {
    /// OpenAI's `finish_reason`: `stop` (EOS or a stop string) or `length`.
    pub reason: &'static str,
    pub prompt_tokens: usize,
    /// Prompt tokens reused from a cached prefix (OpenAI's `cached_tokens`).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_ms: f64,
    pub ttft_ms: f64,
    /// Whether skip-and-fill filled rows of the prompt (not when its self-check fell back to
    /// running every layer exactly).
    pub filled: bool,
    /// What skip-and-fill did with the prompt; `None` when it did not run (no fill file,
    /// `"fill": false`, or prompt logprobs).
    pub report: Option<FillReport>,
    /// Filled rows the decode restored where the generated tokens read them.
    pub decode_restored: usize,
}

/// One token's log-probability under the model, with the most likely tokens at its position.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
    /// Byte offset of the token's text in the completion text (0 for prompt tokens).
    pub offset: usize,
}

impl TokenLogprob {
    /// The log-softmax of `row` at `id`, and the `n` most likely tokens of the row; every value
    /// is the same expression of the same logit, so a greedy token's logprob equals its top-1.
    ///
    /// # Shapes
    /// - row: `[vocab]`
    pub fn of(row: &[f32], id: u32, n: usize) -> TokenLogprob {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
        // Accumulated in f64: a 49k-term sum in f32 loses the small terms.
        let lse = f64::from(max) + sum.ln();
        let lp = |x: f32| (f64::from(x) - lse) as f32;
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
        if n > 0 {
            for (j, &x) in row.iter().enumerate() {
                if top.len() == n && top.last().is_some_and(|&(_, v)| x <= v) {
                    continue;
                }
                let at = top.partition_point(|&(_, v)| v >= x);
                top.insert(at, (j as u32, x));
                top.truncate(n);
            }
        }
        TokenLogprob {
            id,
            logprob: row.get(id as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)),
            top: top.into_iter().map(|(j, x)| (j, lp(x))).collect(),
            offset: 0,
        }
    }
}

/// The fill the server was started with.
pub struct Fill {
    pub maps: FillMaps,
    pub rows: FillRows,
}

/// A finished request's cache, kept for a later request that shares its prefix.
#[derive(Clone)]
struct Idle {
    cache: KvCache,
    /// The tokens the cache holds, in order.
    tokens: Vec<u32>,
    /// Which rows' upper-layer K/V were filled, and what re-running them needs (`None`: nothing
    /// was ever filled, every row is full prefill's).
    history: Option<FillHistory>,
    /// When it was left, in finished requests: the smallest is the least recently used.
    used: u64,
}

/// A request holding a slot.
struct Seq<'t> {
    job: Job,
    cache: KvCache,
    /// The tokens `cache` holds, in order.
    tokens: Vec<u32>,
    /// Prompt tokens reused from a cached prefix.
    reused: usize,
    /// Which of `cache`'s rows are filled (`None`: all exact).
    history: Option<FillHistory>,
    /// The request prefills with skip-and-fill (`filled` says whether rows were filled).
    fill: bool,
    sampler: Sampler,
    /// Prompt tokens not yet prefilled.
    prefilled: usize,
    /// The sampled token that the next decode step feeds (`None` while prefilling).
    next: Option<u32>,
    /// Tokens fed since the prefill or the last restore of filled rows ([`restore_due`]).
    since_restore: usize,
    /// Filled rows those restores ran exactly.
    decode_restored: usize,
    generated: usize,
    decoder: StreamDecoder<'t>,
    text: String,
    /// Bytes of `text` already sent.
    sent: usize,
    prefill_ms: f64,
    ttft_ms: f64,
    filled: bool,
    /// What the fill did, once it is done.
    report: Option<FillReport>,
    prefill_started: Option<Instant>,
    /// Set once the sequence is complete (`stop` or `length`).
    done_reason: Option<&'static str>,
    /// A skip-and-fill prefill in progress.
    fill_state: Option<Prefill<'t>>,
    /// The prompt's log-probabilities gathered so far (with `Job::prompt_logprobs`).
    prompt_lp: Vec<TokenLogprob>,
}

pub struct Engine<'m> {
    pub model: &'m Decoder,
    pub tokenizer: &'m Tokenizer,
    pub fill: Option<&'m Fill>,
    pub parallel: usize,
    pub metrics: Arc<Metrics>,
    /// Reuse finished requests' caches (`--no-cache-prompt` turns it off).
    pub cache_prompt: bool,
    /// Bytes of idle caches kept beyond the `parallel` most recent (`--cache-ram`).
    pub cache_ram: usize,
    /// Settle idle caches' filled rows while nothing else runs (`--no-settle` turns it off).
    pub settle: bool,
    /// Prompt rows a request runs even when a cache holds them all
    /// ([`Decoder::reuse_min_rows`]).
    pub min_rows: usize,
    /// Positions a request may hold (`--ctx`): how far a reused cache may grow.
    pub ctx: usize,
}

impl<'m> Engine<'m> {
    /// Serves jobs from `queue` until it is closed (or `metrics.shutdown` is set); then fails
    /// what is still running or queued, so every stream ends.
    pub fn run(&self, queue: Receiver<Job>) {
        let eos = self.tokenizer.eos_ids();
        let mut active: Vec<Seq<'m>> = Vec::new();
        let mut idle: Vec<Idle> = Vec::new();
        let mut finished: u64 = 0;
        // When the engine last had a request: idle work waits SETTLE_AFTER past it.
        let mut busy_at = Instant::now();
        loop {
            let stopping = self.metrics.shutdown.load(Ordering::SeqCst);
            if stopping {
                for s in active.drain(..) {
                    let _ = s
                        .job
                        .events
                        .send(Event::Failed("the server is shutting down".into()));
                }
                while let Ok(j) = queue.try_recv() {
                    self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                    let _ = j
                        .events
                        .send(Event::Failed("the server is shutting down".into()));
                }
                return;
            }
            // Admit: new requests join between steps.
            while active.len() < self.parallel {
                let job = if active.is_empty() {
                    match queue.try_recv() {
                        Ok(j) => j,
                        Err(TryRecvError::Disconnected) => return,
                        // Idle for a while: make room in a kept cache or settle one batch of
                        // its filled rows, then look at the queue again.
                        Err(TryRecvError::Empty)
                            if busy_at.elapsed() >= SETTLE_AFTER
                                && (self.make_room(&mut idle) || self.settle_some(&mut idle)) =>
                        {
                            break;
                        }
                        // Wake when the grace ends, if it has not.
                        Err(TryRecvError::Empty) => match queue.recv_timeout(
                            match SETTLE_AFTER.saturating_sub(busy_at.elapsed()) {
                                left if left.is_zero() => IDLE_POLL,
                                left => left.min(IDLE_POLL),
                            },
                        ) {
                            Ok(j) => j,
                            Err(RecvTimeoutError::Timeout) => break,
                            Err(RecvTimeoutError::Disconnected) => return,
                        },
                    }
                } else {
                    match queue.try_recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    }
                };
                self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                if job.events.is_closed() {
                    continue;
                }
                active.push(self.start(job, &mut idle));
            }
            // A client that went away frees its slot at once.
            active.retain(|s| !s.job.events.is_closed());
            self.metrics.active.store(active.len(), Ordering::Relaxed);
            if active.is_empty() {
                continue;
            }
            busy_at = Instant::now();
            // One prefill chunk of the oldest sequence still prefilling.
            if let Some(i) = active.iter().position(|s| s.next.is_none()) {
                if let Err(e) = self.prefill_chunk(&mut active[i], &eos) {
                    let s = active.remove(i);
                    let _ = s.job.events.send(Event::Failed(e.to_string()));
                } else if active[i].done_reason.is_some() {
                    let s = active.remove(i);
                    finished += 1;
                    self.finish(s, &mut idle, finished);
                }
            }
            // A sequence due a restore of its filled rows feeds its token through it, alone;
            // the others take one batched decode step.
            let mut restored = vec![false; active.len()];
            let mut i = 0;
            while i < active.len() {
                if active[i].next.is_none() || !self.restore_due(&active[i]) {
                    i += 1;
                } else if let Err(e) = self.restore_step(&mut active[i], &eos) {
                    // A failed request drops its cache, half-restored or not.
                    let s = active.remove(i);
                    restored.remove(i);
                    let _ = s.job.events.send(Event::Failed(e.to_string()));
                } else if active[i].done_reason.is_some() {
                    // Its restore sampled the last token: it leaves now, batch or no batch.
                    let s = active.remove(i);
                    restored.remove(i);
                    finished += 1;
                    self.finish(s, &mut idle, finished);
                } else {
                    restored[i] = true;
                    i += 1;
                }
            }
            let ready: Vec<usize> = (0..active.len())
                .filter(|&i| active[i].next.is_some() && !restored[i])
                .collect();
            if ready.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            let fed: Vec<u32> = ready.iter().map(|&i| active[i].next.unwrap_or(0)).collect();
            // The decoding sequences' caches and samplers, in `ready`'s order.
            let (mut caches, mut samplers): (Vec<&mut KvCache>, Vec<&mut Sampler>) = active
                .iter_mut()
                .zip(&restored)
                .filter(|(s, r)| s.next.is_some() && !**r)
                .map(|(s, _)| (&mut s.cache, &mut s.sampler))
                .unzip();
            let logits = match self.model.decode_batch(&fed, &mut caches) {
                Ok(l) => to_host_f32(l),
                Err(e) => {
                    for s in active.drain(..) {
                        let _ = s.job.events.send(Event::Failed(e.to_string()));
                    }
                    continue;
                }
            };
            self.metrics.record_decode(ready.len(), t0.elapsed());
            let vocab = self.model.config.vocab_size;
            let tokens = sample_rows(&mut samplers, &logits, vocab);
            for (row, (&token, &i)) in tokens.iter().zip(&ready).enumerate() {
                active[i].tokens.push(fed[row]);
                active[i].since_restore += 1;
                active[i].accept(token, &logits[row * vocab..(row + 1) * vocab], &eos);
            }
            // Finished sequences leave; their slots take new requests next round.
            let mut i = 0;
            while i < active.len() {
                if active[i].done_reason.is_some() {
                    let s = active.remove(i);
                    finished += 1;
                    self.finish(s, &mut idle, finished);
                } else {
                    i += 1;
                }
            }
        }
    }

    /// A slot for `job`: the idle cache sharing its longest prefix when it may be reused (see
    /// the module doc), else a new one.
    fn start(&self, job: Job, idle: &mut Vec<Idle>) -> Seq<'m> {
        let n = job.prompt.len();
        let capacity = n + job.max_tokens;
        // Prompt logprobs need every position's logits: full prefill.
        let fill = job.fill && self.fill.is_some() && job.prompt_logprobs.is_none();
        let reusable = self.cache_prompt && job.cache_prompt && job.prompt_logprobs.is_none();
        // A filling request resumes any cache; an exact one only a prefix nothing was ever
        // filled in (rows restored or settled since ran over predictions).
        let usable =
            |e: &Idle, p: usize| fill || e.history.as_ref().is_none_or(|h| h.pristine_upto(p));
        let best = idle
            .iter()
            .enumerate()
            .filter(|_| reusable)
            .map(|(i, e)| (i, reusable_prefix(&e.tokens, &job.prompt, self.min_rows)))
            .filter(|&(i, p)| usable(&idle[i], p))
            .max_by(|a, b| a.1.cmp(&b.1).then(idle[b.0].used.cmp(&idle[a.0].used)));
        let (cache, tokens, reused, history) = match best {
            Some((i, p)) if p > 0 => {
                // A cache mostly about something else stays for its own conversation; this
                // request gets a copy (its storage is shared until written).
                let keep = p < idle[i].tokens.len() / 2;
                let Idle {
                    mut cache,
                    mut tokens,
                    mut history,
                    ..
                } = if keep {
                    idle[i].clone()
                } else {
                    idle.swap_remove(i)
                };
                cache.truncate(p);
                cache.grow(grown_capacity(cache.capacity(), capacity, self.ctx));
                tokens.truncate(p);
                if let Some(h) = history.as_mut() {
                    h.truncate(p);
                }
                (cache, tokens, p, history)
            }
            // A quarter to spare: a conversation's next turns fit without growing it.
            _ => {
                let roomy = (capacity + capacity / 4).min(self.ctx).max(capacity);
                (self.model.new_cache(roomy), Vec::new(), 0, None)
            }
        };
        self.metrics.record_cache(reused, n - reused);
        Seq {
            cache,
            tokens,
            reused,
            history,
            fill,
            sampler: Sampler::new(job.sampler.clone()),
            prefilled: reused,
            next: None,
            since_restore: 0,
            decode_restored: 0,
            generated: 0,
            decoder: self.tokenizer.stream_decoder(true),
            text: String::new(),
            sent: 0,
            prefill_ms: 0.0,
            ttft_ms: 0.0,
            filled: false,
            report: None,
            prefill_started: None,
            done_reason: None,
            fill_state: None,
            prompt_lp: Vec::new(),
            job,
        }
    }

    /// Prefills the next chunk of `s` (under skip-and-fill, a chunk of the layers below the
    /// split, then the upper layers' pass; with prompt logprobs, every row's logits); after the
    /// last, sends the prompt's logprobs, then samples and sends the first token.
    fn prefill_chunk(&self, s: &mut Seq<'m>, eos: &[u32]) -> anyhow::Result<()> {
        let started = *s.prefill_started.get_or_insert_with(Instant::now);
        let n = s.job.prompt.len();
        if let (true, Some(f), None, None) = (s.fill, self.fill, &s.fill_state, &s.report) {
            let opts = FillOptions::fill(&f.maps, f.rows);
            // An idle cache without a history is exact throughout.
            let p = Prefill::over(self.model, &s.job.prompt, &s.cache, s.history.take(), opts)?;
            s.fill_state = Some(p);
        }
        let logits: Option<Vec<f32>> = match &mut s.fill_state {
            Some(st) => {
                let l = st.step(&mut s.cache)?;
                if l.is_some() {
                    let report = st.report();
                    // Too short to have a bulk, or the self-check failed with no deeper fill:
                    // every row ran every layer.
                    s.filled = report.filled > 0;
                    s.report = Some(report);
                    s.history = st.take_history();
                    s.prefilled = n;
                    s.fill_state = None;
                }
                l.map(to_host_f32)
            }
            _ => {
                let start = s.prefilled;
                let end = (start + PREFILL_CHUNK).min(n);
                let chunk = &s.job.prompt[start..end];
                let l = match s.job.prompt_logprobs {
                    Some(top) => {
                        let all = self.model.forward_all_logits(chunk, &mut s.cache)?;
                        let all = to_host_f32(all);
                        let vocab = self.model.config.vocab_size;
                        check_finite(&all, vocab, start)?;
                        // Row i predicts the prompt token after position start + i.
                        for (i, row) in all.chunks_exact(vocab).enumerate() {
                            if let Some(&next) = s.job.prompt.get(start + i + 1) {
                                s.prompt_lp.push(TokenLogprob::of(row, next, top));
                            }
                        }
                        all[all.len() - vocab..].to_vec()
                    }
                    None => to_host_f32(self.model.prefill(chunk, &mut s.cache)?),
                };
                s.prefilled = end;
                (end == n).then_some(l)
            }
        };
        let Some(logits) = logits else {
            return Ok(());
        };
        let held = s.tokens.len();
        s.tokens.extend_from_slice(&s.job.prompt[held..]);
        check_finite(&logits, logits.len(), n - 1)?;
        s.prefill_ms = started.elapsed().as_secs_f64() * 1e3;
        self.metrics.record_prefill(n, started.elapsed());
        if s.job.prompt_logprobs.is_some() {
            let lp = std::mem::take(&mut s.prompt_lp);
            let _ = s.job.events.send(Event::Prompt(lp));
        }
        s.ttft_ms = s.job.received.elapsed().as_secs_f64() * 1e3;
        self.metrics.record_ttft(s.ttft_ms / 1e3);
        // OpenAI's `max_tokens: 0` (with `echo`, the prompt's logprobs alone): nothing to sample.
        if s.job.max_tokens == 0 {
            s.done_reason = Some("length");
            return Ok(());
        }
        let first = s.sampler.sample(&logits);
        s.accept(first, &logits, eos);
        Ok(())
    }

    /// Whether `s`, a filling request past its prefill, restores filled rows with the token it
    /// feeds next.
    fn restore_due(&self, s: &Seq<'m>) -> bool {
        let rows = self.fill.map(|f| &f.rows);
        s.fill && rows.is_some_and(|r| restore_due(r, s.history.as_ref(), s.since_restore + 1))
    }

    /// Feeds `s`'s next token as a restore ([`restore`]): its tokens since the last one run
    /// again as a prefill over the cache, restoring the filled rows they read; then samples.
    fn restore_step(&self, s: &mut Seq<'m>, eos: &[u32]) -> anyhow::Result<()> {
        let (Some(f), Some(token), Some(before)) = (self.fill, s.next, s.history.take()) else {
            anyhow::bail!("a restore needs a fill, a token to feed and the cache's history");
        };
        let t0 = Instant::now();
        s.tokens.push(token);
        let opts = FillOptions::fill(&f.maps, f.rows);
        let done = restore(
            self.model,
            opts,
            &s.tokens,
            s.since_restore + 1,
            &mut s.cache,
            before,
        )?;
        s.history = done.history;
        s.since_restore = 0;
        s.decode_restored += done.report.restored;
        self.metrics
            .record_restore(done.report.restored, t0.elapsed());
        let logits = to_host_f32(done.logits);
        check_finite(&logits, logits.len(), s.tokens.len() - 1)?;
        let next = s.sampler.sample(&logits);
        s.accept(next, &logits, eos);
        Ok(())
    }

    /// Sends `s`'s outcome and leaves its cache idle for a later request (`finished`: how many
    /// requests have finished, this one included).
    fn finish(&self, mut s: Seq<'m>, idle: &mut Vec<Idle>, finished: u64) {
        s.flush_all();
        let reason = s.done_reason.unwrap_or("stop");
        self.metrics
            .record_done(s.job.prompt.len(), s.generated, s.filled, s.report.as_ref());
        let _ = s.job.events.send(Event::Done(Finish {
            reason,
            prompt_tokens: s.job.prompt.len(),
            cached_tokens: s.reused,
            completion_tokens: s.generated,
            prefill_ms: s.prefill_ms,
            ttft_ms: s.ttft_ms,
            filled: s.filled,
            report: s.report,
            decode_restored: s.decode_restored,
        }));
        if !self.cache_prompt || s.tokens.is_empty() {
            return;
        }
        // A filled cache without its history cannot be resumed (every fill leaves one).
        if s.filled && s.history.is_none() {
            return;
        }
        // A cache nothing was ever filled in is full prefill's: no history needed.
        let history = s.history.filter(FillHistory::ever_filled);
        idle.push(Idle {
            cache: s.cache,
            tokens: s.tokens,
            history,
            used: finished,
        });
        self.evict(idle);
    }

    /// Grows the most recently used idle cache with room for less than an eighth of its length
    /// more to half its length again (within `ctx`), so the conversation's next turns do not copy
    /// it while their client waits (new caches start with a quarter to spare). Returns whether
    /// it grew one.
    fn make_room(&self, idle: &mut Vec<Idle>) -> bool {
        let short = |e: &Idle| {
            let (len, cap) = (e.cache.len(), e.cache.capacity());
            cap < (len + len / 8).min(self.ctx)
        };
        let Some(i) = (0..idle.len())
            .filter(|&i| short(&idle[i]))
            .max_by_key(|&i| idle[i].used)
        else {
            return false;
        };
        let len = idle[i].cache.len();
        let capacity = grown_capacity(idle[i].cache.capacity(), len + len / 2, self.ctx);
        idle[i].cache.grow(capacity);
        self.evict(idle);
        true
    }

    /// Settles up to [`SETTLE_ROWS`] filled rows of the most recently used idle cache that has
    /// any (its stored split input is dropped once none is left). Returns whether it did any
    /// work. A cache whose settling fails is dropped: it may be half-written.
    fn settle_some(&self, idle: &mut Vec<Idle>) -> bool {
        if !self.settle {
            return false;
        }
        let unsettled = |e: &Idle| {
            e.history
                .as_ref()
                .is_some_and(|h| h.filled(h.recorded()) > 0)
        };
        let Some(i) = (0..idle.len())
            .filter(|&i| unsettled(&idle[i]))
            .max_by_key(|&i| idle[i].used)
        else {
            return false;
        };
        let e = &mut idle[i];
        let Some(h) = e.history.as_mut() else {
            return false;
        };
        let t0 = Instant::now();
        match settle(self.model, &mut e.cache, h, SETTLE_ROWS) {
            // Filled rows past the cache's end (none should be): nothing to run, no busy loop.
            Ok(0) => false,
            Ok(rows) => {
                self.metrics.record_settled(rows, t0.elapsed());
                // Settled through: its stored split input was dropped (the bytes gauge falls).
                if h.filled(h.recorded()) == 0 {
                    self.evict(idle);
                }
                true
            }
            Err(err) => {
                eprintln!("serve: dropping an idle cache whose settling failed: {err}");
                idle.swap_remove(i);
                self.evict(idle);
                true
            }
        }
    }

    /// Keeps the `parallel` most recently used idle caches, then older ones while their bytes
    /// fit in `cache_ram`; drops the rest.
    fn evict(&self, idle: &mut Vec<Idle>) {
        idle.sort_by_key(|e| std::cmp::Reverse(e.used));
        let mut spare = self.cache_ram;
        let mut kept = 0;
        idle.retain(|e| {
            kept += 1;
            if kept <= self.parallel {
                return true;
            }
            let bytes = e.bytes();
            let fits = bytes <= spare;
            spare = spare.saturating_sub(bytes * usize::from(fits));
            fits
        });
        let bytes = idle.iter().map(Idle::bytes).sum();
        self.metrics.record_idle(idle.len(), bytes);
    }
}

impl Idle {
    /// Bytes this idle cache holds: its K/V storage and its fill history.
    fn bytes(&self) -> usize {
        self.cache.bytes() + self.history.as_ref().map_or(0, |h| h.bytes())
    }
}

/// The capacity a reused cache of `current` positions grows to for a request needing `needed`
/// (at most `ctx`): half as much again, so a conversation's next turns fit without copying the
/// whole cache each turn (at 3000 positions SmolLM2's K/V are 140 MB: ~10 ms a copy against a
/// 50 ms turn).
fn grown_capacity(current: usize, needed: usize, ctx: usize) -> usize {
    if needed <= current {
        return current;
    }
    (current + current / 2).min(ctx).max(needed)
}

/// Fails on the first non-finite logit of `logits` (rows of `vocab`, the first at prompt
/// position `first_pos`).
fn check_finite(logits: &[f32], vocab: usize, first_pos: usize) -> anyhow::Result<()> {
    if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
        anyhow::bail!(
            "non-finite logit for token id {} after prompt position {}: the model's activations overflowed",
            i % vocab.max(1),
            first_pos + i / vocab.max(1)
        );
    }
    Ok(())
}

impl Seq<'_> {
    /// Takes the token sampled from `logits`: ends on EOS, a stop string or `max_tokens`; else
    /// streams its text and queues it for the next decode step.
    ///
    /// # Shapes
    /// - logits: `[vocab]`
    fn accept(&mut self, token: u32, logits: &[f32], eos: &[u32]) {
        if let Some(top) = self.job.logprobs {
            // Reported for an ending EOS too: a scorer counts on one entry per sampled token.
            let mut lp = TokenLogprob::of(logits, token, top);
            lp.offset = self.text.len();
            let _ = self.job.events.send(Event::Token(lp));
        }
        if eos.contains(&token) && !self.job.ignore_eos {
            self.done_reason = Some("stop");
            return;
        }
        self.generated += 1;
        match self.decoder.push(token) {
            Ok(Some(piece)) => self.text.push_str(&piece),
            Ok(None) => {}
            Err(e) => {
                let _ = self.job.events.send(Event::Failed(e.to_string()));
                self.done_reason = Some("stop");
                return;
            }
        }
        if let Some(at) = self.stop_at() {
            self.text.truncate(at);
            self.done_reason = Some("stop");
            return;
        }
        self.flush_safe();
        if self.generated >= self.job.max_tokens {
            self.done_reason = Some("length");
        } else {
            self.next = Some(token);
        }
    }

    /// Where the first stop string starts in the text, searching only where a new one can be.
    fn stop_at(&self) -> Option<usize> {
        self.job
            .stop
            .iter()
            .filter_map(|s| {
                let from = self.sent.saturating_sub(s.len());
                let from = (from..=self.sent).find(|&i| self.text.is_char_boundary(i))?;
                self.text[from..].find(s.as_str()).map(|p| from + p)
            })
            .min()
    }

    /// Sends the text that cannot be the start of a stop string.
    fn flush_safe(&mut self) {
        let held = self
            .job
            .stop
            .iter()
            .map(|s| {
                (1..s.len())
                    .rev()
                    .find(|&k| s.is_char_boundary(k) && self.text.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let upto = self.text.len() - held;
        if upto > self.sent {
            let _ = self
                .job
                .events
                .send(Event::Text(self.text[self.sent..upto].to_string()));
            self.sent = upto;
        }
    }

    fn flush_all(&mut self) {
        if self.text.len() > self.sent {
            let _ = self
                .job
                .events
                .send(Event::Text(self.text[self.sent..].to_string()));
            self.sent = self.text.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::grown_capacity;

    #[test]
    fn a_reused_cache_grows_by_half_within_the_context() {
        assert_eq!(grown_capacity(3000, 2900, 8192), 3000, "fits: no growth");
        assert_eq!(grown_capacity(3000, 3050, 8192), 4500);
        assert_eq!(grown_capacity(3000, 5000, 8192), 5000);
        assert_eq!(grown_capacity(6000, 6100, 8192), 8192);
    }
}
