use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Result, bail};
use ridgefill::interrupt;
use ridgefill::io::text::collect_documents;
use ridgefill::model::eval::{Method, WindowStats, prefill_flops};

use super::common::{ModelArgs, load};
use super::generate::RowArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Fill file made by `ridgefill fit` for this model.
    #[arg(long)]
    pub fill: PathBuf,
    /// Evaluation text: files or directories (Brown is detected and detagged).
    #[arg(long, num_args = 1.., required_unless_present = "passkey")]
    pub text: Vec<PathBuf>,
    /// Passkey retrieval instead: a 5-digit key hidden at depths 10..90% of filler text.
    #[arg(long)]
    pub passkey: bool,
    /// Prompt lengths (tokens) for --passkey.
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048")]
    pub lengths: Vec<usize>,
    /// Prefix tokens, prefilled by each method.
    #[arg(long, default_value_t = 512)]
    pub prefix: usize,
    /// Continuation tokens, teacher-forced with the full model on top of the prefix's cache.
    #[arg(long, default_value_t = 64)]
    pub cont: usize,
    #[command(flatten)]
    pub rows: RowArgs,
    /// Stop after this many windows.
    #[arg(long)]
    pub max_windows: Option<usize>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Replace undecodable bytes in text files instead of failing.
    #[arg(long)]
    pub lossy: bool,
}

/// Method names in report order.
const METHODS: [&str; 4] = ["full", "fill", "drop", "own-proj"];

pub fn run(a: Args) -> Result<()> {
    if a.prefix == 0 || a.cont == 0 {
        bail!("--prefix and --cont must be positive");
    }
    let rows = a.rows.rows();
    if rows.sink + rows.tail >= a.prefix {
        bail!(
            "--sink {} + --tail {} leaves no bulk rows in a prefix of {}",
            rows.sink,
            rows.tail,
            a.prefix
        );
    }
    let positions = if a.passkey {
        a.lengths.iter().copied().max().unwrap_or(0) + PASSKEY_ANSWER_TOKENS
    } else {
        a.prefix + a.cont
    };
    let loaded = load(&a.model.load_args(), positions)?;
    let model = &loaded.model;
    let (file, fill) = ridgefill::fillfile::load_maps(&a.fill, &loaded.ckpt, model)?;
    let split = file.meta.split;
    let own = model.own_proj_maps(split)?;
    if a.passkey {
        let methods = [
            ("full", Method::Full),
            ("fill", Method::Fill(&fill, rows)),
            ("drop", Method::Drop(split, rows)),
            ("own-proj", Method::Fill(&own, rows)),
        ];
        return passkey(&loaded, &methods, &a.lengths, split, rows, a.json);
    }
    let docs = collect_documents(&a.text, a.lossy)?;
    let len = a.prefix + a.cont;
    let mut windows = Vec::new();
    for d in &docs {
        interrupt::check()?;
        let ids = loaded.ckpt.tokenizer.encode(&d.text, true)?;
        windows.extend(ids.chunks_exact(len).map(<[u32]>::to_vec));
    }
    if let Some(m) = a.max_windows {
        windows.truncate(m);
    }
    if windows.is_empty() {
        bail!("no window of {len} tokens in the evaluation text");
    }
    let mut totals: BTreeMap<&str, WindowStats> = BTreeMap::new();
    let bar = super::fit::Bar::new(
        windows.len() as u64,
        "evaluating [{bar:30}] {pos}/{len} windows ETA {eta}",
    );
    for (wi, w) in windows.iter().enumerate() {
        interrupt::check()?;
        let (prefix, cont) = w.split_at(a.prefix);
        let reference = model.continuation_logp(prefix, cont, Method::Full)?;
        for name in METHODS {
            let method = match name {
                "full" => Method::Full,
                "fill" => Method::Fill(&fill, rows),
                "drop" => Method::Drop(split, rows),
                _ => Method::Fill(&own, rows),
            };
            let logp = if name == "full" {
                reference.clone()
            } else {
                model.continuation_logp(prefix, cont, method)?
            };
            let s = model.compare_logp(logp, reference.clone(), cont);
            if !s.nll.is_finite() || !s.kl.is_finite() {
                bail!(
                    "non-finite log-likelihood (NLL {}, KL {}) under method {name} in window {wi} \
                     of {len} tokens: the model's activations overflowed",
                    s.nll,
                    s.kl
                );
            }
            totals.entry(name).or_default().add(&s);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let cfg = &model.config;
    let full_flops = prefill_flops(cfg, a.prefix, None);
    let flops = |name: &str| -> f64 {
        let skip = |filled| Some((split, rows, filled));
        let f = match name {
            "full" => full_flops,
            "drop" => prefill_flops(cfg, a.prefix, skip(false)),
            _ => prefill_flops(cfg, a.prefix, skip(true)),
        };
        f / full_flops
    };
    let mut methods = serde_json::Map::new();
    for name in METHODS {
        let s = totals[name];
        let t = s.tokens as f64;
        methods.insert(
            name.to_string(),
            serde_json::json!({
                "nll": s.nll / t,
                "kl": s.kl / t,
                "top1": s.top1 as f64 / t,
                "flops_ratio": flops(name),
            }),
        );
    }
    let tokens = totals["full"].tokens;
    if a.json {
        let out = serde_json::json!({
            "windows": windows.len(),
            "tokens": tokens,
            "split": split,
            "prefix": a.prefix,
            "cont": a.cont,
            "sink": rows.sink,
            "tail": rows.tail,
            "methods": methods,
        });
        println!("{out}");
    } else {
        println!(
            "{} windows, {tokens} continuation tokens | split {split} | prefix {} cont {} | sink {} tail {}",
            windows.len(),
            a.prefix,
            a.cont,
            rows.sink,
            rows.tail
        );
        println!("| method | NLL | KL(full‖method) | top-1 | prefill FLOPs |");
        println!("|---|---:|---:|---:|---:|");
        for name in METHODS {
            let m = &methods[name];
            println!(
                "| {name} | {:.4} | {:.4} | {:.3} | {:.3} |",
                m["nll"].as_f64().unwrap_or(f64::NAN),
                m["kl"].as_f64().unwrap_or(f64::NAN),
                m["top1"].as_f64().unwrap_or(f64::NAN),
                m["flops_ratio"].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    Ok(())
}

/// Greedy tokens generated for the passkey answer.
const PASSKEY_ANSWER_TOKENS: usize = 8;
/// Relative depths at which the key is hidden.
const PASSKEY_DEPTHS: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];
const PASSKEY_FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
const PASSKEY_QUESTION: &str = "What is the pass key? The pass key is";
/// Fixed keys, one per depth, so runs are comparable.
const PASSKEY_KEYS: [u32; 5] = [68_231, 40_957, 13_586, 92_714, 57_309];

fn passkey(
    loaded: &ridgefill::session::Loaded,
    methods: &[(&str, Method)],
    lengths: &[usize],
    split: usize,
    rows: ridgefill::model::fill::FillRows,
    json: bool,
) -> Result<()> {
    let model = &loaded.model;
    let tok = &loaded.ckpt.tokenizer;
    let filler_len = tok.encode(PASSKEY_FILLER, false)?.len();
    let mut results = Vec::new();
    for &len in lengths {
        for (name, method) in methods {
            let mut hits = 0;
            for (&depth, &key) in PASSKEY_DEPTHS.iter().zip(&PASSKEY_KEYS) {
                interrupt::check()?;
                let needle = format!("The pass key is {key}. Remember it. {key} is the pass key. ");
                let fixed =
                    tok.encode(&needle, false)?.len() + tok.encode(PASSKEY_QUESTION, false)?.len();
                let reps = len.saturating_sub(fixed) / filler_len;
                let before = (reps as f64 * depth).round() as usize;
                let text = format!(
                    "{}{needle}{}{PASSKEY_QUESTION}",
                    PASSKEY_FILLER.repeat(before),
                    PASSKEY_FILLER.repeat(reps - before)
                );
                let ids = tok.encode(&text, true)?;
                let mut cache = model.new_cache(ids.len() + PASSKEY_ANSWER_TOKENS);
                let mut logits =
                    ridgefill::model::to_host_f32(model.prefill_with(&ids, &mut cache, *method)?);
                let mut answer = Vec::new();
                for _ in 0..PASSKEY_ANSWER_TOKENS {
                    let t = ridgefill::model::sample::argmax(&logits);
                    answer.push(t);
                    logits = ridgefill::model::to_host_f32(model.decode_step(t, &mut cache)?);
                }
                if tok.decode(&answer, true)?.contains(&key.to_string()) {
                    hits += 1;
                }
            }
            results.push((len, *name, hits as f64 / PASSKEY_DEPTHS.len() as f64));
        }
    }
    if json {
        let rows_json: Vec<_> = results
            .iter()
            .map(|(len, m, acc)| serde_json::json!({"length": len, "method": m, "accuracy": acc}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"split": split, "sink": rows.sink, "tail": rows.tail, "passkey": rows_json})
        );
    } else {
        println!(
            "passkey retrieval, split {split}, sink {} tail {}, {} depths",
            rows.sink,
            rows.tail,
            PASSKEY_DEPTHS.len()
        );
        println!("| length | method | accuracy |");
        println!("|---:|---|---:|");
        for (len, m, acc) in results {
            println!("| {len} | {m} | {acc:.2} |");
        }
    }
    Ok(())
}
