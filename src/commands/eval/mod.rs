//! `ridgefill eval`: how closely each prefill method tracks full prefill, on text (NLL, KL, top-1)
//! or on retrieval tasks (see [`retrieval`]), or on questions about real documents (see
//! [`answers`]). Imports run one way: this file uses [`methods`], [`tasks`], [`retrieval`] and
//! [`answers`]; `retrieval` uses `methods` and `tasks`; `answers` uses `methods`, `tasks` and
//! [`answers_score`], which uses [`paired`]; `methods` and `tasks` use neither. RULER's tasks:
//! [`ruler_run`] uses `methods`, `tasks`, `paired`, [`ruler`] and [`ruler_data`]; `tasks` uses
//! `ruler`, which uses `ruler_data` and [`ruler_fit`]. Retrieval across chat turns: [`turns`]
//! uses `methods`, `tasks` and `retrieval`.

mod answers;
mod answers_score;
mod methods;
mod paired;
mod retrieval;
mod ruler;
mod ruler_data;
mod ruler_fit;
mod ruler_run;
mod tasks;
mod turns;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::io::text::collect_documents;
use ridgefill::model::eval::{self, Method, WindowStats};
use ridgefill::model::fill::FillRows;

use super::common::{Bar, ModelArgs, RowArgs, load};
use methods::{EvalMethod, Header, Runner, load_runners};
use tasks::{Prose, Spec, Task};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Fill file made by `ridgefill fit` for this model; further files (comma-separated, other
    /// splits) each add a `fill@S` method.
    #[arg(long, value_delimiter = ',', required = true)]
    pub fill: Vec<PathBuf>,
    /// Evaluation text: files or directories (Brown is detected and detagged). With --task, the
    /// prose of the `prose` and `multi` tasks (default: the Brown corpus, fetched when missing).
    #[arg(long, num_args = 1.., required_unless_present_any = ["passkey", "task"])]
    pub text: Vec<PathBuf>,
    /// Methods to compare; `full` always runs, since every other method is measured against it.
    /// `fill` is the fill file's shipped method as the row flags configure it, `ridge` and
    /// `spans` the same maps without spans or without the per-prompt update.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "full,fill,ridge,drop,own-proj"
    )]
    pub methods: Vec<EvalMethod>,
    /// Retrieval tasks instead of text fidelity: passkey, passkey-first, prose, multi,
    /// passkey-turns (a code asked two chat turns after it was given, cold and with reuse); or
    /// `answers` (alone): questions about real documents, see --questions; or RULER's synthetic
    /// tasks (niah_single_1 .. fwe; `ruler`: all of them), see --samples.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub task: Vec<Task>,
    /// Passkey retrieval: the same as `--task passkey`.
    #[arg(long)]
    pub passkey: bool,
    /// Diagnosis of the retrieval tasks instead of methods: plain ridge fill with parts of the
    /// filled K/V replaced by full prefill's (all, keys only, values only, the key's rows only,
    /// each upper layer alone).
    #[arg(long, requires = "task")]
    pub oracle: bool,
    /// Prompt lengths (tokens) for the retrieval tasks, up to the model's context (RULER's tasks:
    /// prompt and answer budget together, as RULER counts them).
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096")]
    pub lengths: Vec<usize>,
    /// `--task answers`: the question set (default: data/answers/questions.toml of the source
    /// tree).
    #[arg(long)]
    pub questions: Option<PathBuf>,
    /// `--task answers`: greedy tokens per answer (fewer when the model stops first).
    #[arg(long, default_value_t = answers::DEFAULT_ANSWER_TOKENS)]
    pub answer_tokens: usize,
    /// `--task answers`: leave out the numerical floor (a second load with f32 weights), for
    /// quicker comparisons of fill settings.
    #[arg(long)]
    pub no_floor: bool,
    /// RULER tasks: samples per task and length.
    #[arg(long, default_value_t = ruler_run::DEFAULT_SAMPLES)]
    pub samples: usize,
    /// RULER tasks: the seed every sample is generated from.
    #[arg(long, default_value_t = ruler_run::DEFAULT_SEED)]
    pub seed: u64,
    /// RULER: run only these sample indices (0-based, below --samples), each with the prompt it
    /// has in the full set.
    #[arg(long, value_delimiter = ',')]
    pub pick: Vec<usize>,
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

impl Args {
    /// The retrieval tasks asked for (`--passkey` included), in order, each once.
    fn tasks(&self) -> Vec<Task> {
        let mut tasks = Vec::new();
        let passkey = self.passkey.then_some(Task::Passkey);
        for t in passkey.into_iter().chain(self.task.iter().copied()) {
            if !tasks.contains(&t) {
                tasks.push(t);
            }
        }
        tasks
    }

    /// The methods to run: `full` first (the reference), then the others in the order given;
    /// an oracle run needs plain ridge only.
    fn method_list(&self) -> Vec<EvalMethod> {
        let mut list = vec![EvalMethod::Full];
        if self.oracle {
            list.push(EvalMethod::Ridge);
            return list;
        }
        for &m in &self.methods {
            if !list.contains(&m) {
                list.push(m);
            }
        }
        list
    }
}

/// The longest RoPE table `eval` builds: beyond any supported model's context, and it keeps an
/// absurd `--lengths` from allocating before the context check below rejects it.
const MAX_LOAD_POSITIONS: usize = 1 << 17;

/// An `eval` run that cannot be done as asked.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("--prefix and --cont must be positive")]
    EmptyWindow,
    #[error("--lengths must list positive prompt lengths")]
    NoLengths,
    #[error(
        "RULER's tasks need --samples of at least 1, and --oracle diagnoses the retrieval tasks \
         (passkey, passkey-first, prose, multi) only"
    )]
    RulerRun,
    #[error("--sink {sink} + --tail {tail} leaves no bulk rows in a {what} of {len}")]
    NoBulk {
        sink: usize,
        tail: usize,
        what: &'static str,
        len: usize,
    },
    #[error("{what} needs {needed} positions, but the model's context is {context}: {hint}")]
    BeyondContext {
        what: String,
        needed: usize,
        context: usize,
        hint: String,
    },
    #[error("no window of {0} tokens in the evaluation text")]
    NoWindow(usize),
    #[error(
        "non-finite log-likelihood (NLL {nll}, KL {kl}) under method {method} in window {window} \
         of {len} tokens: the model's activations overflowed"
    )]
    NonFinite {
        nll: f64,
        kl: f64,
        method: &'static str,
        window: usize,
        len: usize,
    },
}

pub fn run(a: Args) -> Result<()> {
    let tasks = a.tasks();
    // Its own prompts, lengths and a second load for the floor: a run of its own.
    if tasks.contains(&Task::Answers) {
        return answers::run(answers::Options {
            tasks: &tasks,
            oracle: a.oracle,
            model: a.model.load_args(),
            fill: &a.fill,
            rows: &a.rows,
            methods: a.method_list(),
            questions: a.questions.clone(),
            answer_tokens: a.answer_tokens,
            floor: !a.no_floor,
            max_positions: MAX_LOAD_POSITIONS,
            json: a.json,
        });
    }
    // RULER's tasks run after the retrieval ones, on prompts of their own.
    let ruler = ruler_run::ruler_tasks(&tasks);
    let tasks: Vec<Task> = tasks.into_iter().filter(|t| t.ruler().is_empty()).collect();
    if !ruler.is_empty() && (a.oracle || a.samples == 0) {
        return Err(EvalError::RulerRun.into());
    }
    if let Some(i) = a.pick.iter().find(|&&i| i >= a.samples) {
        anyhow::bail!(
            "--pick {i}: only samples 0..{} exist (--samples)",
            a.samples
        );
    }
    let plain = a.rows.rows();
    // The longest prompt asked for, and the positions needed beyond it.
    let (asked, reserved) = if tasks.is_empty() && ruler.is_empty() {
        if a.prefix == 0 || a.cont == 0 {
            return Err(EvalError::EmptyWindow.into());
        }
        check_bulk(plain, "prefix", a.prefix)?;
        (a.prefix, a.cont)
    } else {
        let shortest = a.lengths.iter().copied().min().unwrap_or(0);
        if shortest == 0 {
            return Err(EvalError::NoLengths.into());
        }
        check_bulk(plain, "prompt", shortest)?;
        let longest = a.lengths.iter().copied().max().unwrap_or(0);
        // RULER's lengths include their answers.
        let answers = if tasks.is_empty() {
            0
        } else {
            tasks::ANSWER_TOKENS
        };
        (longest, answers)
    };
    let needed = asked + reserved;
    let loaded = load(&a.model.load_args(), needed.min(MAX_LOAD_POSITIONS))?;
    let context = loaded
        .model
        .config
        .max_position_embeddings
        .min(MAX_LOAD_POSITIONS);
    if needed > context {
        let room = context.saturating_sub(reserved);
        let (what, hint) = if tasks.is_empty() && ruler.is_empty() {
            (
                format!("--prefix {} + --cont {}", a.prefix, a.cont),
                format!("keep --prefix within {room} for --cont {}", a.cont),
            )
        } else {
            (
                format!("--lengths {asked} (+ {reserved} answer tokens)"),
                format!("keep --lengths within {room}"),
            )
        };
        return Err(EvalError::BeyondContext {
            what,
            needed,
            context,
            hint,
        }
        .into());
    }
    let (runners, fill, split) = load_runners(&loaded, &a.fill, &a.rows, &a.method_list())?;
    let header = Header {
        split,
        rows: plain,
        fill,
    };
    if tasks.is_empty() && ruler.is_empty() {
        return text(&a, &loaded, &runners, &header);
    }
    if !tasks.is_empty() {
        let prose = tasks
            .iter()
            .any(|t| t.needs_prose())
            .then(|| Prose::load(&a.text, a.lossy, asked))
            .transpose()?;
        let single: Vec<Task> = tasks
            .iter()
            .copied()
            .filter(|&t| t != Task::PasskeyTurns)
            .collect();
        let spec = Spec {
            tasks: &single,
            lengths: &a.lengths,
            prose: prose.as_ref(),
        };
        if a.oracle {
            retrieval::run_oracle(&loaded, &runners[1], &spec, &header, a.json)?;
        } else if !single.is_empty() {
            retrieval::run(&loaded, &runners, &spec, &header, a.json)?;
        }
        if let (Some(prose), true) = (&prose, tasks.contains(&Task::PasskeyTurns)) {
            turns::run(&loaded, &runners, &a.lengths, prose, &header, a.json)?;
        }
    }
    if ruler.is_empty() {
        return Ok(());
    }
    let spec = ruler_run::RulerSpec {
        tasks: &ruler,
        lengths: &a.lengths,
        samples: a.samples,
        pick: &a.pick,
        seed: a.seed,
        text: &a.text,
        lossy: a.lossy,
    };
    ruler_run::run(&loaded, &runners, &spec, &header, a.json)
}

/// Errors unless `rows` leaves bulk rows to skip in `len` rows.
fn check_bulk(rows: FillRows, what: &'static str, len: usize) -> Result<(), EvalError> {
    match rows.bulk(len) {
        Some(_) => Ok(()),
        None => Err(EvalError::NoBulk {
            sink: rows.sink,
            tail: rows.tail,
            what,
            len,
        }),
    }
}

/// Text fidelity: each method prefills every window's prefix, the full model teacher-forces the
/// continuation, and the continuation's log-probabilities are compared with full prefill's.
fn text(
    a: &Args,
    loaded: &ridgefill::session::Loaded,
    runners: &[Runner],
    header: &Header,
) -> Result<()> {
    let model = &loaded.model;
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
        return Err(EvalError::NoWindow(len).into());
    }
    let mut totals: BTreeMap<&str, WindowStats> = BTreeMap::new();
    let bar = Bar::new(
        windows.len() as u64,
        "evaluating [{bar:30}] {pos}/{len} windows ETA {eta}",
    );
    for (wi, w) in windows.iter().enumerate() {
        interrupt::check()?;
        let (prefix, cont) = w.split_at(a.prefix);
        let reference = eval::continuation_logp(model, prefix, cont, Method::Full)?;
        for r in runners {
            let logp = match r.method {
                EvalMethod::Full => reference.clone(),
                _ => eval::continuation_logp(model, prefix, cont, r.prefill())?,
            };
            let s = eval::compare_logp(model, logp, reference.clone(), cont);
            if !s.nll.is_finite() || !s.kl.is_finite() {
                return Err(EvalError::NonFinite {
                    nll: s.nll,
                    kl: s.kl,
                    method: r.name(),
                    window: wi,
                    len,
                }
                .into());
            }
            totals.entry(r.name()).or_default().add(&s);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let cfg = &model.config;
    let mut methods = serde_json::Map::new();
    for r in runners {
        let s = totals[r.name()];
        let t = s.tokens as f64;
        methods.insert(
            r.name().to_string(),
            serde_json::json!({
                "nll": s.nll / t,
                "kl": s.kl / t,
                "top1": s.top1 as f64 / t,
                "exact": r.rows.exact,
                "flops_ratio": r.flops_ratio(cfg, a.prefix),
                "flops_ratio_every_row": r.flops_ratio_with(cfg, a.prefix, true),
            }),
        );
    }
    let tokens = totals[EvalMethod::Full.name()].tokens;
    if a.json {
        let out = serde_json::json!({
            "windows": windows.len(),
            "tokens": tokens,
            "split": header.split,
            "prefix": a.prefix,
            "cont": a.cont,
            "sink": header.rows.sink,
            "tail": header.rows.tail,
            "fill_method": header.fill.json(),
            "methods": methods,
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} windows, {tokens} continuation tokens | prefix {} cont {} | {}",
        windows.len(),
        a.prefix,
        a.cont,
        header.describe()
    );
    // Sliding-window layers above the split fill only the rows an exact row can reach.
    let sliding = (header.split..cfg.num_hidden_layers).any(|l| cfg.layer_window(l).is_some());
    println!(
        "| method | NLL | KL(full‖method) | top-1 | prefill FLOPs |{}",
        if sliding { " filling every row |" } else { "" }
    );
    println!(
        "|---|---:|---:|---:|---:|{}",
        if sliding { "---:|" } else { "" }
    );
    for r in runners {
        let m = &methods[r.name()];
        let f = |key: &str| m[key].as_f64().unwrap_or(f64::NAN);
        let every = if sliding {
            format!(" {:.3} |", f("flops_ratio_every_row"))
        } else {
            String::new()
        };
        println!(
            "| {} | {:.4} | {:.4} | {:.3} | {:.3} |{every}",
            r.name(),
            f("nll"),
            f("kl"),
            f("top1"),
            f("flops_ratio")
        );
    }
    Ok(())
}
