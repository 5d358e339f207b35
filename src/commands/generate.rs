use ridgefill::model::fill::{FillOptions, FillRows, Prefill, RestoringDecode};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use ridgefill::interrupt::{self, Interrupted};
use ridgefill::io::chat::ChatMessage;
use ridgefill::model::{Sampler, to_host_f32};

use super::common::{ModelArgs, RowArgs, SamplingArgs, check_logits, load, read_text};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Replace undecodable bytes of the -f file with U+FFFD instead of failing.
    #[arg(long, requires = "file")]
    pub lossy: bool,
    /// Number of tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Context size (prompt + generated tokens); defaults to the model's, capped at 4096.
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// When the prompt does not fit the context: drop tokens from its `left` (keep the end) or
    /// its `right` (keep the start) instead of failing.
    #[arg(long, value_parser = ["left", "right"])]
    pub truncate: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long = "system", requires = "chat")]
    pub system: Option<String>,
    /// Prefill with skip-and-fill using this fill file (made by `ridgefill fit`).
    #[arg(long)]
    pub fill: Option<PathBuf>,
    #[command(flatten)]
    pub rows: RowArgs,
}

/// Largest context used when the model advertises a longer one (memory for the preallocated cache).
const DEFAULT_CTX_CAP: usize = 4096;

/// A prompt that cannot be run.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("no prompt: give -p PROMPT or -f FILE")]
    Missing,
    #[error("empty prompt{}", .file.as_ref().map(|f| format!(": {} is empty", f.display())).unwrap_or_default())]
    Empty { file: Option<PathBuf> },
    #[error("the prompt encodes to no tokens")]
    NoTokens,
    #[error("{}: --chat needs a chat template, and this model has none", .path.display())]
    NoChatTemplate { path: PathBuf },
    #[error(
        "prompt has {tokens} tokens but the context holds {ctx} with {n_predict} to generate \
         ({budget} left for the prompt); raise -c, lower -n, or pass --truncate left|right"
    )]
    TooLong {
        tokens: usize,
        ctx: usize,
        n_predict: usize,
        budget: usize,
    },
    #[error("-n {n_predict} leaves no room for the prompt in a context of {ctx}")]
    NoRoom { n_predict: usize, ctx: usize },
}

pub fn run(a: Args) -> Result<()> {
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_text(f, a.lossy)?,
        (None, None) => return Err(PromptError::Missing.into()),
    };
    if prompt.is_empty() {
        return Err(PromptError::Empty {
            file: a.file.clone(),
        }
        .into());
    }
    // The RoPE table must cover the context; decided before loading.
    let ctx_guess = a.ctx_size.unwrap_or(DEFAULT_CTX_CAP);
    let loaded = load(&a.model.load_args(), ctx_guess)?;
    let cfg = &loaded.model.config;
    let ctx = a
        .ctx_size
        .unwrap_or_else(|| cfg.max_position_embeddings.clamp(1, DEFAULT_CTX_CAP));
    let tok = &loaded.ckpt.tokenizer;

    let mut ids = if a.chat {
        let tmpl =
            loaded
                .ckpt
                .chat_template
                .as_ref()
                .ok_or_else(|| PromptError::NoChatTemplate {
                    path: loaded.ckpt.path.clone(),
                })?;
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", &prompt));
        let text = tmpl.render(&msgs, true)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&prompt, true)?
    };
    if ids.is_empty() {
        return Err(PromptError::NoTokens.into());
    }
    let budget = ctx.saturating_sub(a.n_predict);
    if budget == 0 {
        return Err(PromptError::NoRoom {
            n_predict: a.n_predict,
            ctx,
        }
        .into());
    }
    if ids.len() > budget {
        match a.truncate.as_deref() {
            Some("left") => ids = ids[ids.len() - budget..].to_vec(),
            Some("right") => ids.truncate(budget),
            Some(other) => bail!("--truncate {other:?}: expected left or right"),
            None => {
                return Err(PromptError::TooLong {
                    tokens: ids.len(),
                    ctx,
                    n_predict: a.n_predict,
                    budget,
                }
                .into());
            }
        }
        eprintln!(
            "prompt truncated on the {} to {budget} tokens",
            a.truncate.as_deref().unwrap_or_default()
        );
    }

    let model = &loaded.model;
    let maps = match &a.fill {
        Some(path) => Some(ridgefill::fillfile::load_configured(
            path,
            &loaded.ckpt,
            model,
            &a.rows.choice(),
        )?),
        None => None,
    };
    let mut cache = model.new_cache(ids.len() + a.n_predict);
    let mut sampler = Sampler::new(a.sampling.config());
    let eos = tok.eos_ids();
    let mut stream = tok.stream_decoder(true);
    let mut out = std::io::stdout().lock();

    let t0 = Instant::now();
    let (logits, report, mut restoring) = match &maps {
        Some((_, maps, rows)) => {
            let opts = FillOptions::fill(maps, *rows);
            let f = Prefill::run(model, &ids, &mut cache, opts)?;
            let restoring = RestoringDecode::new(model, opts, &ids, f.history);
            (f.logits, Some(f.report), Some(restoring))
        }
        None => (model.prefill(&ids, &mut cache)?, None, None),
    };
    let logits = to_host_f32(logits);
    let prefill_s = t0.elapsed().as_secs_f64();
    check_logits(&logits, ids.len() - 1)?;
    interrupt::check()?;

    let t1 = Instant::now();
    let mut generated = 0usize;
    let mut steps = 0usize;
    let mut next = sampler.sample(&logits);
    loop {
        if eos.contains(&next) {
            break;
        }
        generated += 1;
        if let Some(piece) = stream.push(next)? {
            out.write_all(piece.as_bytes())?;
            out.flush()?;
        }
        if generated >= a.n_predict {
            break;
        }
        if interrupt::requested() {
            // End the partial line so the shell prompt starts on a fresh one.
            writeln!(out)?;
            out.flush()?;
            return Err(Interrupted.into());
        }
        let logits = to_host_f32(match restoring.as_mut() {
            Some(r) => r.step(next, &mut cache)?,
            None => model.decode_step(next, &mut cache)?,
        });
        check_logits(&logits, ids.len() + steps)?;
        steps += 1;
        next = sampler.sample(&logits);
    }
    writeln!(out)?;
    let decode_s = t1.elapsed().as_secs_f64();
    let n = ids.len();
    let mode = match (&maps, report) {
        (Some((method, m, rows)), Some(r)) => format!(
            "fill s={} {method} exact {} | {}{}",
            m.split,
            rows.exact,
            describe_fill(&r, rows),
            restoring.as_ref().map_or_else(String::new, |d| {
                let (rows, restores) = d.restored();
                format!(" | decode restored {rows} filled rows in {restores} restores")
            })
        ),
        _ => "full".to_string(),
    };
    eprintln!(
        "device: {} ({}) | {mode} | load {:.0} ms | prompt {n} tokens | prefill {:.1} ms, {:.1} tok/s | decode {generated} tokens, {:.1} tok/s",
        loaded.device.backend,
        loaded.device.adapter,
        loaded.load_ms,
        prefill_s * 1e3,
        n as f64 / prefill_s,
        if steps > 0 {
            steps as f64 / decode_s
        } else {
            0.0
        },
    );
    Ok(())
}

/// Whether and how much a prefill filled, and its self-check, in one phrase.
fn describe_fill(r: &ridgefill::model::fill::FillReport, rows: &FillRows) -> String {
    let spans = r
        .error_spans
        .map_or_else(String::new, |e| format!(", on the spans {e:.3}"));
    let error = r.error.map_or_else(
        || "no self-check".to_string(),
        |e| format!("fill error {e:.3}{spans}"),
    );
    let coverage = r
        .coverage
        .map_or_else(String::new, |c| format!(", span coverage {c:.2}"));
    if r.widened {
        format!(
            "{error} over the self-check's thresholds{coverage}: filled again with {:.0}% of rows \
             exact (--retry-exact), filled {}/{} rows, tail {}",
            rows.retry_exact * 100.0,
            r.filled,
            r.prompt,
            r.tail
        )
    } else if r.fell_back {
        let (max, max_spans) = (rows.max_error, rows.max_span_error);
        format!(
            "{error} over the self-check's {max:.3} (--max-fill-error) or {max_spans:.3} on the spans (--max-span-error){coverage}: ran exactly"
        )
    } else {
        format!(
            "filled {}/{} rows, tail {} | {error}{coverage}",
            r.filled, r.prompt, r.tail
        )
    }
}
