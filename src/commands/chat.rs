//! `ridgefill chat`: an interactive terminal chat with the model's own template. Replies stream
//! to stdout; Ctrl-C stops a reply and returns to the prompt (a second press quits); `/reset`
//! clears the history, `/exit` or end of input leaves.
//!
//! The conversation's KV cache outlives the turn: each turn's prompt is compared, token by token,
//! with what the cache holds (earlier prompts and the replies sampled into it), and only the
//! tokens after the longest common prefix are prefilled — as llama-server's `cache_prompt` does.
//! Where the template re-renders earlier text differently (a reply re-tokenized otherwise than it
//! was sampled), the prefix simply ends there. With a fill file every turn is a skip-and-fill
//! prefill of its new tokens over the cache ([`Prefill::resume`]): the new question's spans may
//! lie in rows an earlier turn filled, which then run the upper layers exactly from their stored
//! split input ([`FillHistory`]), so a fact pasted in turn 1 and asked for in turn 5 is read
//! exactly — when the question gives those rows at least `--resume-min-attention` of its
//! attention (a broad question restores nothing). While the user reads the reply and types the
//! next message, the turn's filled rows settle ([`settle`]: run exactly from that stored input,
//! a few at a time between checks for input), so a later turn mostly finds an exact cache and
//! re-runs no spans at all.

use ridgefill::model::fill::{FillHistory, FillOptions, Prefill, RestoringDecode, settle};
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};

use anyhow::{Result, bail};
use ridgefill::interrupt;
use ridgefill::io::chat::ChatMessage;
use ridgefill::model::{Sampler, to_host_f32};

use super::common::{
    ModelArgs, RowArgs, SETTLE_AFTER, SamplingArgs, check_logits, load, reusable_prefix,
};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System message at the start of the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n_predict: usize,
    /// Context (the whole conversation plus a reply); defaults to the model's, capped at 4096.
    /// The oldest turns are dropped when it fills.
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Prefill each turn with skip-and-fill using this fill file.
    #[arg(long)]
    pub fill: Option<PathBuf>,
    #[command(flatten)]
    pub rows: RowArgs,
    /// Prefill every turn's whole conversation afresh instead of reusing the cached prefix.
    #[arg(long)]
    pub no_cache_prompt: bool,
    /// Leave a turn's filled rows as predicted instead of running them exactly while waiting
    /// for the next message.
    #[arg(long)]
    pub no_settle: bool,
}

/// Set to print each turn's cache use on stderr when stdin is not a terminal.
const VERBOSE_ENV: &str = "RIDGEFILL_CHAT_VERBOSE";

/// Largest default context.
const DEFAULT_CTX_CAP: usize = 4096;
/// Filled rows settled between checks for the next message (tens of milliseconds).
const SETTLE_ROWS: usize = 32;

pub fn run(a: Args) -> Result<()> {
    let ctx_guess = a.ctx_size.unwrap_or(DEFAULT_CTX_CAP);
    let loaded = load(&a.model.load_args(), ctx_guess)?;
    let ctx = a.ctx_size.unwrap_or_else(|| {
        loaded
            .model
            .config
            .max_position_embeddings
            .clamp(1, DEFAULT_CTX_CAP)
    });
    if a.n_predict >= ctx {
        bail!(
            "-n {} leaves no room for the conversation in a context of {ctx}",
            a.n_predict
        );
    }
    let Some(tmpl) = loaded.ckpt.chat_template.as_ref() else {
        bail!(
            "{}: chat needs a chat template, and this model has none",
            loaded.ckpt.path.display()
        );
    };
    let model = &loaded.model;
    let tok = &loaded.ckpt.tokenizer;
    let fill = match &a.fill {
        Some(path) => {
            let (_, maps, rows) =
                ridgefill::fillfile::load_configured(path, &loaded.ckpt, model, &a.rows.choice())?;
            Some((maps, rows))
        }
        None => None,
    };
    let interactive = std::io::stdin().is_terminal();
    // Per-turn cache use on stderr: at a terminal, or when asked for (scripts, tests).
    let verbose = interactive || std::env::var_os(VERBOSE_ENV).is_some();
    if interactive {
        eprintln!(
            "chat: {} | /reset clears the history, /exit or Ctrl-D leaves, Ctrl-C stops a reply",
            loaded.ckpt.path.display()
        );
    }
    let eos = tok.eos_ids();
    let mut sampler = Sampler::new(a.sampling.config());
    let mut history: Vec<ChatMessage> = a
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let keep = history.len();
    // The conversation's cache, the tokens it holds in order, and (with a fill file) which of
    // its rows were filled and what re-running them needs.
    let mut cache = model.new_cache(ctx);
    let mut cached: Vec<u32> = Vec::new();
    let mut filled_rows: Option<FillHistory> = None;
    let mut out = std::io::stdout().lock();
    // Lines arrive from a reader thread, so the wait for one can settle filled rows.
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    loop {
        if interactive {
            eprint!("> ");
        }
        // A cache the next turn will not reuse is not worth settling.
        let settling = filled_rows
            .as_mut()
            .filter(|_| !a.no_settle && !a.no_cache_prompt);
        let Some(line) = next_line(&lines, model, &mut cache, settling, verbose)? else {
            break;
        };
        let line = line?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.truncate(keep);
                continue;
            }
            _ => {}
        }
        // A Ctrl-C pressed at the prompt should not cut the coming reply short.
        interrupt::reset();
        let received = std::time::Instant::now();
        history.push(ChatMessage::new("user", line));
        // Drop the oldest turns (never the system message or this one) until the reply fits.
        let ids = loop {
            let ids = tok.encode(&tmpl.render(&history, true)?, false)?;
            if ids.len() + a.n_predict <= ctx {
                break ids;
            }
            if history.len() <= keep + 1 {
                history.pop();
                bail!(
                    "the message is {} tokens: more than the context of {ctx} holds with -n {}",
                    ids.len(),
                    a.n_predict
                );
            }
            history.remove(keep);
        };
        // A filled cache is resumed from its history; without one it cannot be reused.
        let resumable = fill.is_none() || filled_rows.is_some();
        let reuse = match a.no_cache_prompt || !resumable {
            true => 0,
            false => reusable_prefix(&cached, &ids, model.reuse_min_rows()),
        };
        cache.truncate(reuse);
        cached.truncate(reuse);
        if let Some(h) = filled_rows.as_mut() {
            h.truncate(reuse);
        }
        let (logits, report, mut restoring) = match &fill {
            Some((maps, rows)) => {
                let opts = FillOptions::fill(maps, *rows);
                let run = Prefill::over(model, &ids, &cache, filled_rows.take(), opts)?;
                let f = run.finish(&mut cache)?;
                let restoring = RestoringDecode::new(model, opts, &ids, f.history);
                (f.logits, Some(f.report), Some(restoring))
            }
            None => (model.prefill(&ids[reuse..], &mut cache)?, None, None),
        };
        cached.extend_from_slice(&ids[reuse..]);
        let mut logits = to_host_f32(logits);
        if verbose {
            let fill = report.map_or_else(String::new, |r| {
                let share = r.filled_attention.map_or_else(String::new, |s| {
                    format!(" ({:.1}% of attention on filled rows)", 100.0 * s)
                });
                format!(", {} filled, {} restored{share}", r.filled, r.restored)
            });
            // From the message read to the logits of its first token: the turn's TTFT.
            let ms = received.elapsed().as_secs_f64() * 1e3;
            eprintln!(
                "chat: prompt {} tokens, {reuse} reused from the cache, {} prefilled{fill}, {ms:.0} ms",
                ids.len(),
                ids.len() - reuse
            );
        }
        let mut stream = tok.stream_decoder(true);
        let mut reply = String::new();
        let decode_started = std::time::Instant::now();
        let mut generated = 0;
        for step in 0..a.n_predict {
            check_logits(&logits, ids.len() + step - 1)?;
            let next = sampler.sample(&logits);
            if eos.contains(&next) {
                break;
            }
            generated += 1;
            if let Some(piece) = stream.push(next)? {
                out.write_all(piece.as_bytes())?;
                out.flush()?;
                reply.push_str(&piece);
            }
            if interrupt::requested() {
                interrupt::reset();
                break;
            }
            if step + 1 < a.n_predict {
                logits = to_host_f32(match restoring.as_mut() {
                    Some(r) => r.step(next, &mut cache)?,
                    None => model.decode_step(next, &mut cache)?,
                });
                cached.push(next);
            }
        }
        // The reply's restores leave rows exact that the next turn need not restore.
        let restored = restoring.map(|r| {
            let done = r.restored();
            filled_rows = r.into_history();
            done
        });
        writeln!(out)?;
        out.flush()?;
        if verbose {
            let secs = decode_started.elapsed().as_secs_f64();
            let restored = restored.map_or_else(String::new, |(rows, n)| {
                format!(", {rows} filled rows restored in {n} restores")
            });
            eprintln!(
                "chat: reply {generated} tokens, {:.1} tokens/s{restored}",
                generated as f64 / secs.max(f64::MIN_POSITIVE)
            );
        }
        history.push(ChatMessage::new("assistant", reply));
    }
    Ok(())
}

/// The next line of input (`None` at its end). While none has arrived, the cache's filled rows
/// settle a batch at a time; once none is left the wait simply blocks.
fn next_line(
    lines: &Receiver<std::io::Result<String>>,
    model: &ridgefill::model::Decoder,
    cache: &mut ridgefill::model::KvCache,
    mut history: Option<&mut FillHistory>,
    verbose: bool,
) -> Result<Option<std::io::Result<String>>> {
    let mut settled = 0;
    // A scripted conversation sends its next line at once: settle only once the input pauses.
    if history.is_some() {
        match lines.recv_timeout(SETTLE_AFTER) {
            Ok(line) => return Ok(Some(line)),
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
    loop {
        match lines.try_recv() {
            Ok(line) => return Ok(Some(line)),
            Err(TryRecvError::Disconnected) => return Ok(None),
            Err(TryRecvError::Empty) => {}
        }
        let ran = match history.as_deref_mut() {
            Some(h) => settle(model, cache, h, SETTLE_ROWS)?,
            None => 0,
        };
        if ran > 0 {
            settled += ran;
            continue;
        }
        if verbose && settled > 0 {
            eprintln!("chat: settled {settled} filled rows; the cache is exact");
        }
        return Ok(lines.recv().ok());
    }
}
