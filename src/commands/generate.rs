use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ridgefill::io::chat::ChatMessage;
use ridgefill::model::{Sampler, SamplerConfig, to_host_f32};

use super::common::{ModelArgs, load};

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
    /// Number of tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Context size (prompt + generated tokens); defaults to the model's, capped at 4096.
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// When the prompt does not fit: keep its `left` or `right` part instead of failing.
    #[arg(long, value_parser = ["left", "right"])]
    pub truncate: Option<String>,
    /// Sampling temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// RNG seed.
    #[arg(short = 's', long = "seed", default_value_t = 42)]
    pub seed: u64,
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

/// Which prompt rows run every layer under skip-and-fill.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct RowArgs {
    /// Last prompt tokens computed exactly (skip-and-fill).
    #[arg(long, default_value_t = 16)]
    pub tail: usize,
    /// First prompt tokens computed exactly: the attention sink (skip-and-fill).
    #[arg(long, default_value_t = 1)]
    pub sink: usize,
}

impl RowArgs {
    pub fn rows(&self) -> ridgefill::model::fill::FillRows {
        ridgefill::model::fill::FillRows {
            sink: self.sink,
            tail: self.tail,
        }
    }
}

/// Largest context used when the model advertises a longer one (memory for the preallocated cache).
const DEFAULT_CTX_CAP: usize = 4096;

/// Reads a UTF-8 text file (non-UTF-8 is an error naming the byte offset).
pub fn read_text(path: &std::path::Path) -> Result<String> {
    Ok(ridgefill::io::text::read_text_file(path, false)?)
}

pub fn run(a: Args) -> Result<()> {
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_text(f)?,
        (None, None) => bail!("no prompt: give -p PROMPT or -f FILE"),
    };
    if prompt.is_empty() {
        bail!("empty prompt");
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
        let tmpl = loaded.ckpt.chat_template.as_ref().with_context(|| {
            format!("{}: model has no chat template", loaded.ckpt.path.display())
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
        bail!("the prompt encodes to no tokens");
    }
    let budget = ctx.saturating_sub(a.n_predict);
    if ids.len() > budget {
        match a.truncate.as_deref() {
            Some("left") => ids = ids[ids.len() - budget..].to_vec(),
            Some(_) => ids.truncate(budget),
            None => bail!(
                "prompt has {} tokens but the context holds {ctx} with {} to generate; \
                 raise -c, lower -n, or pass --truncate left|right",
                ids.len(),
                a.n_predict
            ),
        }
        if ids.is_empty() {
            bail!(
                "-n {} leaves no room for the prompt in a context of {ctx}",
                a.n_predict
            );
        }
    }

    let model = &loaded.model;
    let maps = match &a.fill {
        Some(path) => Some(ridgefill::fillfile::load_maps(path, &loaded.ckpt, model)?.1),
        None => None,
    };
    let mut cache = model.new_cache(ids.len() + a.n_predict);
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
    });
    let eos = tok.eos_ids();
    let mut stream = tok.stream_decoder(true);
    let mut out = std::io::stdout().lock();

    let t0 = Instant::now();
    let logits = match &maps {
        Some(maps) => model.prefill_fill(&ids, &mut cache, maps, a.rows.rows())?,
        None => model.prefill(&ids, &mut cache)?,
    };
    let logits = to_host_f32(logits);
    let prefill_s = t0.elapsed().as_secs_f64();

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
        let logits = to_host_f32(model.decode_step(next, &mut cache)?);
        steps += 1;
        next = sampler.sample(&logits);
    }
    writeln!(out)?;
    let decode_s = t1.elapsed().as_secs_f64();
    let n = ids.len();
    let mode = match &maps {
        Some(m) => format!("fill s={}", m.split),
        None => "full".to_string(),
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
