//! `ridgefill eval --task`: each method answers the questions of [`super::tasks`], where
//! skipping the upper layers for the bulk rows hurts first. Each method is scored by whether its
//! greedy answer contains the key, and by the teacher-forced NLL of the key's digits (graded
//! where accuracy is all or nothing).

use std::ops::Range;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::io::tokenizer::Tokenizer;
use ridgefill::model::KvCache;
use ridgefill::model::eval::{self, Method};
use ridgefill::model::fill::{FillOptions, FillRows, Oracle, Prefill};
use ridgefill::model::{Decoder, sample, to_host_f32};
use ridgefill::session::Loaded;

use super::methods::{Header, Runner};
use super::tasks::{ANSWER_TOKENS, Query, RetrievalError, Spec, Task, queries};
use crate::commands::common::Bar;

/// How one method answered one question.
struct Answer {
    depth: f64,
    /// The greedy answer holds the key.
    hit: bool,
    /// The greedy answer's text.
    text: String,
    /// Summed NLL of the key's digit tokens, teacher-forced by the full model on top of the
    /// method's prefill.
    nll: f64,
    /// The key's tokens ran every layer exactly (`None` for a method without chosen spans).
    covered: Option<bool>,
}

/// One prefill by `method`, then a greedy answer and, from a copy of the cache, the key's NLL.
fn ask(
    model: &Decoder,
    tok: &Tokenizer,
    method: Method,
    oracle: Option<&Oracle>,
    q: &Query,
) -> Result<Answer> {
    let mut cache = model.new_cache(q.prompt.len() + ANSWER_TOKENS.max(q.cont.len()));
    let (last, spans) = match (method, oracle) {
        (Method::Fill(maps, rows), Some(o)) => Prefill::run(
            model,
            &q.prompt,
            &mut cache,
            FillOptions::fill(maps, rows).with_oracle(o),
        )
        .map(|f| (f.logits, f.spans))?,
        _ => eval::prefill_with_spans(model, &q.prompt, &mut cache, method)
            .map(|f| (f.logits, f.spans))?,
    };

    let covered = match method {
        Method::Fill(_, rows) if rows.exact > 0.0 => Some(q.covered(rows, &spans)),
        _ => None,
    };
    let (text, nll) = answer_and_key_nll(model, tok, last, &mut cache, &q.cont, &q.digits)?;
    let hit = text.contains(&q.key);
    Ok(Answer {
        depth: q.depth,
        hit,
        text,
        nll,
        covered,
    })
}

/// After a prefill whose last-position logits are `last` (`[vocab]`): the greedy answer's text
/// ([`ANSWER_TOKENS`] tokens, decoded into `cache`), and the summed NLL of the key's digit tokens
/// (`cont[digits]`), teacher-forced by the full model from a copy of the cache.
pub(super) fn answer_and_key_nll(
    model: &Decoder,
    tok: &Tokenizer,
    last: ridgefill::model::Tensor<1>,
    cache: &mut KvCache,
    cont: &[u32],
    digits: &[usize],
) -> Result<(String, f64)> {
    let mut forced = cache.clone();
    // `[c, vocab]`, flattened on the host: c is a handful of tokens.
    let logp = to_host_f32(eval::continue_logp(model, last.clone(), cont, &mut forced)?);
    drop(forced);
    let vocab = model.config.vocab_size;
    let nll = digits
        .iter()
        .map(|&i| -f64::from(logp[i * vocab + cont[i] as usize]))
        .sum();
    let mut logits = to_host_f32(last);
    let mut answer = Vec::with_capacity(ANSWER_TOKENS);
    for step in 0..ANSWER_TOKENS {
        let t = sample::argmax(&logits);
        answer.push(t);
        if step + 1 < ANSWER_TOKENS {
            logits = to_host_f32(model.decode_step(t, cache)?);
        }
    }
    Ok((tok.decode(&answer, true)?, nll))
}

/// One method's score on one task at one length.
struct Outcome {
    task: Task,
    length: usize,
    method: &'static str,
    exact: f64,
    flops_ratio: f64,
    hits: usize,
    queries: usize,
    /// Summed NLL over `digits` key digit tokens.
    nll: f64,
    digits: usize,
    /// Accuracy over full prefill's on the same prompts (`None` when full gets none right).
    relative: Option<f64>,
    answers: Vec<Answer>,
}

impl Outcome {
    fn new(task: Task, length: usize, method: &'static str, qs: &[Query], exact: f64) -> Self {
        Outcome {
            task,
            length,
            method,
            exact,
            flops_ratio: 1.0,
            hits: 0,
            queries: qs.len(),
            nll: 0.0,
            digits: 0,
            relative: None,
            answers: Vec::with_capacity(qs.len()),
        }
    }

    /// Counts `a`, the answer to `q`; a non-finite NLL is an error.
    fn add(&mut self, a: Answer, q: &Query) -> Result<()> {
        if !a.nll.is_finite() {
            return Err(RetrievalError::NonFinite {
                nll: a.nll,
                method: self.method,
                task: self.task.name(),
                length: self.length,
            }
            .into());
        }
        self.hits += usize::from(a.hit);
        self.nll += a.nll;
        self.digits += q.digits.len();
        self.answers.push(a);
        Ok(())
    }

    fn accuracy(&self) -> f64 {
        self.hits as f64 / self.queries as f64
    }

    fn key_nll(&self) -> f64 {
        self.nll / self.digits as f64
    }

    /// Questions whose key ran exactly, of those asked (`None` without chosen spans).
    fn covered(&self) -> Option<usize> {
        self.answers
            .iter()
            .map(|a| a.covered.map(usize::from))
            .sum()
    }

    /// Depths of the questions answered wrongly, e.g. `0.3,0.9`.
    fn misses(&self) -> String {
        let m: Vec<String> = self
            .answers
            .iter()
            .filter(|a| !a.hit)
            .map(|a| format!("{}", a.depth))
            .collect();
        m.join(",")
    }
}

/// Runs every task × length × method (`runners[0]` is full prefill, the reference) and prints
/// a markdown table, or one JSON object.
pub fn run(
    loaded: &Loaded,
    runners: &[Runner],
    spec: &Spec,
    header: &Header,
    json: bool,
) -> Result<()> {
    let model = &loaded.model;
    let tok = &loaded.ckpt.tokenizer;
    let total: usize =
        spec.tasks.iter().map(|t| t.queries()).sum::<usize>() * spec.lengths.len() * runners.len();
    let bar = Bar::new(
        total as u64,
        "retrieval [{bar:30}] {pos}/{len} prompts ETA {eta}",
    );
    let mut outcomes = Vec::new();
    for &task in spec.tasks {
        for &length in spec.lengths {
            interrupt::check()?;
            let qs = queries(tok, task, length, spec.prose)?;
            let first = outcomes.len();
            for r in runners {
                let mut o = Outcome::new(task, length, r.name(), &qs, r.rows.exact);
                o.flops_ratio = r.flops_ratio(&model.config, length);
                for q in &qs {
                    interrupt::check()?;
                    o.add(ask(model, tok, r.prefill(), None, q)?, q)?;
                    bar.inc(1);
                }
                outcomes.push(o);
            }
            let full = outcomes[first].accuracy();
            for o in &mut outcomes[first..] {
                o.relative = (full > 0.0).then(|| o.accuracy() / full);
            }
        }
    }
    bar.finish_and_clear();
    if json {
        print_json(&outcomes, header);
    } else {
        print_table(&outcomes, header);
    }
    Ok(())
}

/// A part of the filled K/V that an oracle run replaces with full prefill's.
#[derive(Clone, Copy)]
enum Restore {
    /// Nothing: plain ridge fill.
    Nothing,
    /// Keys and values of every upper layer (equals full prefill up to rounding).
    All,
    Keys,
    Values,
    /// Keys and values of the key's rows (±`span` around each planted copy), every upper layer.
    KeyRows,
    /// Keys and values of one upper layer.
    Layer(usize),
}

impl Restore {
    fn name(self) -> String {
        match self {
            Self::Nothing => "ridge".into(),
            Self::All => "true K+V".into(),
            Self::Keys => "true K".into(),
            Self::Values => "true V".into(),
            Self::KeyRows => "true K+V on the key's rows".into(),
            Self::Layer(l) => format!("true K+V in layer {l}"),
        }
    }

    /// The oracle for `q`, restoring from `truth`; `None` for plain fill.
    fn oracle<'a>(
        self,
        truth: &'a KvCache,
        q: &Query,
        rows: FillRows,
        layers: Range<usize>,
    ) -> Option<Oracle<'a>> {
        let bulk = rows.bulk(q.prompt.len())?;
        let (mut keys, mut values, mut restored, mut at) = (true, true, vec![bulk.clone()], layers);
        match self {
            Self::Nothing => return None,
            Self::All => {}
            Self::Keys => values = false,
            Self::Values => keys = false,
            Self::KeyRows => {
                let len = q.digits.len();
                restored = q
                    .planted
                    .iter()
                    .map(|&p| {
                        p.saturating_sub(rows.span).max(bulk.start)
                            ..(p + len + rows.span).min(bulk.end)
                    })
                    .filter(|r| !r.is_empty())
                    .collect();
            }
            Self::Layer(l) => at = l..l + 1,
        }
        Some(Oracle {
            truth,
            layers: at,
            keys,
            values,
            rows: restored,
        })
    }
}

/// Diagnosis: each task × length with plain ridge fill (`ridge`'s maps and rows) and parts of
/// its filled K/V replaced by full prefill's, to see which part of the fill loses the key.
pub fn run_oracle(
    loaded: &Loaded,
    ridge: &Runner,
    spec: &Spec,
    header: &Header,
    json: bool,
) -> Result<()> {
    let model = &loaded.model;
    let tok = &loaded.ckpt.tokenizer;
    let maps = ridge
        .maps()
        .ok_or_else(|| anyhow::anyhow!("the oracle needs fitted maps"))?;
    let rows = FillRows {
        exact: 0.0,
        ..ridge.rows
    };
    let upper = maps.split..model.num_layers();
    let restores: Vec<Restore> = [
        Restore::Nothing,
        Restore::All,
        Restore::Keys,
        Restore::Values,
        Restore::KeyRows,
    ]
    .into_iter()
    .chain(upper.clone().map(Restore::Layer))
    .collect();
    let total: usize = spec.tasks.iter().map(|t| t.queries()).sum::<usize>()
        * spec.lengths.len()
        * (restores.len() + 1);
    let bar = Bar::new(
        total as u64,
        "oracle [{bar:30}] {pos}/{len} prefills ETA {eta}",
    );
    let mut outcomes: Vec<(Outcome, String)> = Vec::new();
    for &task in spec.tasks {
        for &length in spec.lengths {
            interrupt::check()?;
            let qs = queries(tok, task, length, spec.prose)?;
            let first = outcomes.len();
            for &r in &restores {
                outcomes.push((
                    Outcome::new(task, length, "oracle", &qs, rows.exact),
                    r.name(),
                ));
            }
            for q in &qs {
                interrupt::check()?;
                let mut truth = model.new_cache(q.prompt.len());
                model.prefill(&q.prompt, &mut truth)?;
                bar.inc(1);
                for (i, &r) in restores.iter().enumerate() {
                    let oracle = r.oracle(&truth, q, rows, upper.clone());
                    let a = ask(model, tok, Method::Fill(maps, rows), oracle.as_ref(), q)?;
                    outcomes[first + i].0.add(a, q)?;
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    if json {
        let results: Vec<serde_json::Value> = outcomes
            .iter()
            .map(|(o, name)| {
                serde_json::json!({
                    "task": o.task.name(),
                    "length": o.length,
                    "restored": name,
                    "accuracy": o.accuracy(),
                    "key_nll": o.key_nll(),
                    "queries": o.queries,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "split": header.split, "tail": header.rows.tail, "results": results })
        );
    } else {
        println!(
            "oracle | {} | plain ridge fill, parts restored from full prefill",
            header.describe()
        );
        println!("| task | length | restored | accuracy | key NLL | missed |");
        println!("|---|---:|---|---:|---:|---|");
        for (o, name) in &outcomes {
            println!(
                "| {} | {} | {name} | {:.2} | {:.3} | {} |",
                o.task.name(),
                o.length,
                o.accuracy(),
                o.key_nll(),
                o.misses()
            );
        }
    }
    Ok(())
}

/// One object: the run's settings, and `results` with one self-contained row per task × length
/// × method.
fn print_json(outcomes: &[Outcome], h: &Header) {
    let settings = serde_json::json!({
        "split": h.split,
        "sink": h.rows.sink,
        "tail": h.rows.tail,
        "fill_method": h.fill.method.name(),
        "fill_exact": h.fill.exact,
        "fill_span": h.fill.span,
    });
    let results: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| {
            let mut row = serde_json::json!({
                "task": o.task.name(),
                "length": o.length,
                "method": o.method,
                "accuracy": o.accuracy(),
                "key_nll": o.key_nll(),
                "relative_accuracy": o.relative,
                "queries": o.queries,
                "exact": o.exact,
                "flops_ratio": o.flops_ratio,
                "key_covered": o.covered(),
                "answers": o.answers.iter().map(|a| serde_json::json!({
                    "depth": a.depth,
                    "hit": a.hit,
                    "answer": a.text,
                    "key_nll": a.nll,
                    "key_covered": a.covered,
                })).collect::<Vec<_>>(),
            });
            if let (Some(row), Some(s)) = (row.as_object_mut(), settings.as_object()) {
                row.extend(s.clone());
            }
            row
        })
        .collect();
    let mut out = settings;
    out["results"] = serde_json::Value::from(results);
    println!("{out}");
}

fn print_table(outcomes: &[Outcome], h: &Header) {
    println!("retrieval | {}", h.describe());
    println!(
        "accuracy: greedy answer of {ANSWER_TOKENS} tokens holds the key; vs full: accuracy over \
         full prefill's; key NLL: mean over the key's digit tokens; key exact: questions whose key \
         ran every layer (chosen spans); missed: depths answered wrongly"
    );
    println!(
        "| task | length | method | accuracy | vs full | key NLL | key exact | missed | \
         prefill FLOPs |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---|---:|");
    for o in outcomes {
        let relative = o.relative.map_or("–".to_string(), |r| format!("{r:.2}"));
        let covered = o
            .covered()
            .map_or("–".to_string(), |c| format!("{c}/{}", o.queries));
        println!(
            "| {} | {} | {} | {:.2} | {relative} | {:.3} | {covered} | {} | {:.3} |",
            o.task.name(),
            o.length,
            o.method,
            o.accuracy(),
            o.key_nll(),
            o.misses(),
            o.flops_ratio
        );
    }
}
