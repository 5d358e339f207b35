//! `ridgefill eval --task ruler` (or single RULER tasks): every method answers the same samples of
//! [`super::ruler`], and each row pairs its RULER score with what its prefill cost. The fill's
//! claim is speed at equal quality, so quality and speed are measured together: the score
//! against full prefill's, the FLOPs against full's, and the measured prefill seconds on the same
//! prompts, methods taking turns sample by sample (each sample starting with the next one) so
//! that drift in the machine's load touches them alike. Per-sample answers go into the JSON so that a divergence can be read off.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::session::Loaded;

use super::methods::{Generation, Header, Runner, generate, report_json};
use super::paired::Gap;
use super::ruler::{Material, RulerTask, Sample, postprocess, samples, string_match_all};
use super::ruler_data::{Essay, Lexicon};
use super::tasks::Task;
use crate::commands::common::Bar;
use ridgefill::model::fill::FillReport;

/// RULER reports scores in percent.
const PERCENT: f64 = 100.0;
/// Samples per task and length when `--samples` is not given.
pub const DEFAULT_SAMPLES: usize = 10;
/// RULER's own default `random_seed`.
pub const DEFAULT_SEED: u64 = 42;

/// What to run.
pub struct RulerSpec<'a> {
    pub tasks: &'a [RulerTask],
    pub lengths: &'a [usize],
    pub samples: usize,
    pub seed: u64,
    /// Only these sample indices (of `0..samples`) run; empty: all. The prompts are those the
    /// full set would have, so one lost sample can be looked at alone.
    pub pick: &'a [usize],
    /// The essay haystack's text (`--text`); none: the Gutenberg novel.
    pub text: &'a [PathBuf],
    pub lossy: bool,
}

impl RulerSpec<'_> {
    /// Whether sample `i` runs (`--pick`).
    fn picked(&self, i: usize) -> bool {
        self.pick.is_empty() || self.pick.contains(&i)
    }
}

/// The RULER tasks among `tasks` (`ruler` expanded), in order, each once.
pub fn ruler_tasks(tasks: &[Task]) -> Vec<RulerTask> {
    let mut out: Vec<RulerTask> = Vec::new();
    for &r in tasks.iter().flat_map(|t| t.ruler()) {
        if !out.contains(&r) {
            out.push(r);
        }
    }
    out
}

/// How one method answered one sample.
struct Answer {
    prompt_tokens: usize,
    /// The greedy answer, as RULER post-processes it.
    text: String,
    /// `string_match_all` of this sample, 0 to 1.
    score: f64,
    prefill_secs: f64,
    /// Prefill FLOPs against full's, the self-check's fallback included.
    flops: f64,
    /// Token for token the same answer as full prefill's.
    same_as_full: bool,
    /// Bulk spans that ran exactly (methods that choose them).
    spans: Vec<Range<usize>>,
    report: FillReport,
}

/// One method on one task at one length.
struct Row<'s> {
    task: RulerTask,
    length: usize,
    method: &'static str,
    samples: &'s [Sample],
    answers: Vec<Answer>,
}

impl Row<'_> {
    /// RULER's task score: mean `string_match_all`, in percent.
    fn score(&self) -> f64 {
        mean(self.answers.iter().map(|a| a.score)) * PERCENT
    }

    /// Prefill FLOPs against full's, averaged over the samples.
    fn flops(&self) -> f64 {
        mean(self.answers.iter().map(|a| a.flops))
    }

    fn secs(&self) -> f64 {
        self.answers.iter().map(|a| a.prefill_secs).sum()
    }

    fn same(&self) -> usize {
        self.answers.iter().filter(|a| a.same_as_full).count()
    }

    fn tokens(&self) -> f64 {
        mean(self.answers.iter().map(|a| a.prompt_tokens as f64))
    }

    /// Per-sample scores in percent.
    fn scores(&self) -> Vec<f64> {
        self.answers.iter().map(|a| a.score * PERCENT).collect()
    }

    /// This row's score over `full`'s on the same samples, in points, with its interval.
    fn gap(&self, full: &Row) -> Gap {
        Gap::paired(&self.scores(), &full.scores())
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// A method's rows pooled (one length, or all): RULER's average over tasks, and the suite's
/// speed-up as total full prefill time over the method's.
struct Pooled {
    length: Option<usize>,
    method: &'static str,
    score: f64,
    relative: Option<f64>,
    /// The score's paired gap to full's, tasks averaged.
    gap: Gap,
    flops: f64,
    secs: f64,
    speedup: f64,
}

/// Runs every task × length × method (`runners[0]` is full prefill) and prints a markdown table,
/// or one JSON object.
pub fn run(
    loaded: &Loaded,
    runners: &[Runner],
    spec: &RulerSpec,
    header: &Header,
    json: bool,
) -> Result<()> {
    let t0 = Instant::now();
    let model = &loaded.model;
    let tok = &loaded.ckpt.tokenizer;
    let lexicon = Lexicon::load()?;
    let essay = spec
        .tasks
        .iter()
        .any(|t| t.needs_essay())
        .then(|| Essay::load(spec.text, spec.lossy))
        .transpose()?;
    let material = Material {
        lexicon: &lexicon,
        essay: essay.as_ref(),
    };
    let encode = |text: &str| -> Result<Vec<u32>> { Ok(tok.encode(text, true)?) };
    // Every prompt first: an impossible length fails before any model time is spent.
    let mut sets: Vec<(RulerTask, usize, Vec<Sample>)> = Vec::new();
    for &task in spec.tasks {
        for &length in spec.lengths {
            interrupt::check()?;
            let s = samples(task, length, spec.samples, spec.seed, &material, &encode)?;
            let s = s
                .into_iter()
                .enumerate()
                .filter(|(i, _)| spec.picked(*i))
                .map(|(_, s)| s)
                .collect();
            sets.push((task, length, s));
        }
    }
    let stop = tok.eos_ids();
    // One untimed prefill per method, so one-time set-up is not billed to the first sample.
    if let Some(first) = sets.first().and_then(|(_, _, s)| s.first()) {
        for r in runners {
            generate(model, r.prefill(), &first.prompt, 0, &stop)?;
        }
    }
    let total = sets.iter().map(|(_, _, s)| s.len()).sum::<usize>() * runners.len();
    let bar = Bar::new(
        total as u64,
        "ruler [{bar:30}] {pos}/{len} answers ETA {eta}",
    );
    let mut rows: Vec<Row> = Vec::new();
    for (task, length, set) in &sets {
        let first = rows.len();
        for r in runners {
            rows.push(Row {
                task: *task,
                length: *length,
                method: r.name(),
                samples: set,
                answers: Vec::with_capacity(set.len()),
            });
        }
        for (si, s) in set.iter().enumerate() {
            // Each sample starts with the next method, so no method always runs first.
            let mut gens: Vec<Option<Generation>> = runners.iter().map(|_| None).collect();
            for k in 0..runners.len() {
                let i = (si + k) % runners.len();
                interrupt::check()?;
                let r = &runners[i];
                gens[i] = Some(generate(
                    model,
                    r.prefill(),
                    &s.prompt,
                    task.max_new(),
                    &stop,
                )?);
                bar.inc(1);
            }
            let gens: Vec<Generation> = gens.into_iter().flatten().collect();
            for (i, g) in gens.iter().enumerate() {
                let text = postprocess(&tok.decode(&g.tokens, true)?);
                rows[first + i].answers.push(Answer {
                    prompt_tokens: s.prompt.len(),
                    score: string_match_all(&text, &s.references),
                    text,
                    prefill_secs: g.prefill_secs,
                    flops: runners[i].flops_ratio_run(&model.config, s.prompt.len(), &g.report),
                    same_as_full: g.tokens == gens[0].tokens,
                    spans: g.spans.clone(),
                    report: g.report,
                });
            }
        }
    }
    bar.finish_and_clear();
    let pooled = pool(&rows, spec.lengths, runners.len());
    let wall = t0.elapsed().as_secs_f64();
    if json {
        print_json(&rows, &pooled, spec, header, loaded, wall);
    } else {
        print_table(&rows, &pooled, spec, header);
    }
    eprintln!(
        "ruler: {} answers by {} methods in {wall:.0} s",
        total,
        runners.len()
    );
    Ok(())
}

/// Full's row for `row`: the first of its task × length block.
fn full_of<'r>(rows: &'r [Row<'r>], row: &Row) -> Option<&'r Row<'r>> {
    rows.iter()
        .find(|r| r.task == row.task && r.length == row.length)
}

/// Per length (when there are several) and over the suite, per method.
fn pool(rows: &[Row], lengths: &[usize], methods: usize) -> Vec<Pooled> {
    let mut scopes: Vec<Option<usize>> = Vec::new();
    if lengths.len() > 1 {
        scopes.extend(lengths.iter().copied().map(Some));
    }
    scopes.push(None);
    let mut out = Vec::new();
    for scope in scopes {
        let inside: Vec<&Row> = rows
            .iter()
            .filter(|r| scope.is_none_or(|l| r.length == l))
            .collect();
        let names: Vec<&'static str> = inside.iter().take(methods).map(|r| r.method).collect();
        let mut full: Option<(f64, f64)> = None;
        for name in names {
            let of: Vec<&&Row> = inside.iter().filter(|r| r.method == name).collect();
            let score = mean(of.iter().map(|r| r.score()));
            let secs: f64 = of.iter().map(|r| r.secs()).sum();
            let (full_score, full_secs) = *full.get_or_insert((score, secs));
            let gaps: Vec<(Gap, usize)> = of
                .iter()
                .filter_map(|r| full_of(rows, r).map(|f| (r.gap(f), r.answers.len())))
                .collect();
            out.push(Pooled {
                length: scope,
                method: name,
                score,
                relative: (full_score > 0.0).then(|| score / full_score),
                gap: Gap::average(&gaps),
                flops: mean(of.iter().map(|r| r.flops())),
                secs,
                speedup: full_secs / secs,
            });
        }
    }
    out
}

/// The row's score over full's, where full's is not zero.
fn relative(row: &Row, full: Option<&Row>) -> Option<f64> {
    full.map(Row::score)
        .filter(|&f| f > 0.0)
        .map(|f| row.score() / f)
}

fn print_json(
    rows: &[Row],
    pooled: &[Pooled],
    spec: &RulerSpec,
    h: &Header,
    loaded: &Loaded,
    wall: f64,
) {
    // Each answer's sample index in the full set, however few `--pick` ran.
    let indices: Vec<usize> = (0..spec.samples).filter(|&i| spec.picked(i)).collect();
    let results: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let full = full_of(rows, r);
            let answers: Vec<serde_json::Value> = r
                .answers
                .iter()
                .zip(r.samples)
                .enumerate()
                .map(|(i, (a, s))| {
                    let spans: Vec<[usize; 2]> = a.spans.iter().map(|s| [s.start, s.end]).collect();
                    serde_json::json!({
                        "index": indices[i],
                        "prompt_tokens": a.prompt_tokens,
                        "references": s.references,
                        // Where each reference sits in the prompt (share of its characters).
                        "reference_depths": s.references.iter().map(|x| {
                            s.text.find(x.as_str()).map(|p| p as f64 / s.text.len() as f64)
                        }).collect::<Vec<_>>(),
                        "reference_rows": s.reference_rows.iter()
                            .map(|r| r.as_ref().map(|r| [r.start, r.end]))
                            .collect::<Vec<_>>(),
                        "answer": a.text,
                        "score": a.score,
                        "same_as_full": a.same_as_full,
                        "prefill_secs": a.prefill_secs,
                        "spans": spans,
                        "fill": report_json(&a.report),
                    })
                })
                .collect();
            serde_json::json!({
                "task": r.task.name(),
                "length": r.length,
                "method": r.method,
                "score": r.score(),
                "relative_score": relative(r, full),
                "gap_vs_full": full.map(|f| r.gap(f).json()),
                "same_as_full": r.same(),
                "samples": r.answers.len(),
                "prompt_tokens": r.tokens(),
                "max_new": r.task.max_new(),
                "flops_ratio": r.flops(),
                "prefill_secs": r.secs(),
                "speedup": full.map(|f| f.secs() / r.secs()),
                "answers": answers,
            })
        })
        .collect();
    let summary: Vec<serde_json::Value> = pooled
        .iter()
        .map(|p| {
            serde_json::json!({
                "length": p.length,
                "method": p.method,
                "score": p.score,
                "relative_score": p.relative,
                "gap_vs_full": p.gap.json(),
                "flops_ratio": p.flops,
                "prefill_secs": p.secs,
                "speedup": p.speedup,
            })
        })
        .collect();
    let out = serde_json::json!({
        "benchmark": "ruler",
        "split": h.split,
        "sink": h.rows.sink,
        "tail": h.rows.tail,
        "fill_method": h.fill.json(),
        "samples": spec.samples,
        "seed": spec.seed,
        "device": format!("{} {}", loaded.device.backend, loaded.device.adapter),
        "wall_secs": wall,
        "results": results,
        "summary": summary,
    });
    println!("{out}");
}

fn print_table(rows: &[Row], pooled: &[Pooled], spec: &RulerSpec, h: &Header) {
    let dash = || "–".to_string();
    println!(
        "ruler | {} | samples per task and length: {} | seed {}",
        h.describe(),
        spec.samples,
        spec.seed
    );
    println!(
        "score: RULER's string_match_all × 100 (share of a sample's references in its greedy \
         answer, averaged); vs full: over full prefill's score; gap: the score minus full's on the \
         same samples, ± the half-width of its 95% t interval; same: answers identical to full's; \
         tokens: mean prompt tokens (the answer budget fills the length); prefill s: summed over \
         the samples, methods taking turns; speed-up: full's prefill seconds over the method's"
    );
    println!(
        "| task | length | tokens | method | score | vs full | gap | same | prefill FLOPs | \
         prefill s | speed-up |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let full = full_of(rows, r);
        let rel = relative(r, full).map_or_else(dash, |x| format!("{x:.2}"));
        let speedup = full.map_or_else(dash, |f| format!("{:.2}×", f.secs() / r.secs()));
        let gap = full
            .filter(|f| !std::ptr::eq(*f, r))
            .map_or_else(dash, |f| r.gap(f).show());
        println!(
            "| {} | {} | {:.0} | {} | {:.1} | {rel} | {gap} | {}/{} | {:.3} | {:.2} | {speedup} |",
            r.task.name(),
            r.length,
            r.tokens(),
            r.method,
            r.score(),
            r.same(),
            r.answers.len(),
            r.flops(),
            r.secs(),
        );
    }
    println!();
    println!(
        "suite: score averaged over tasks (RULER's average); gap: the tasks' gaps averaged, \
         their variances added; speed-up: total full prefill seconds over the method's"
    );
    println!("| length | method | score | vs full | gap | prefill FLOPs | prefill s | speed-up |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (i, p) in pooled.iter().enumerate() {
        let length = p.length.map_or("all".to_string(), |l| l.to_string());
        let rel = p.relative.map_or_else(dash, |x| format!("{x:.2}"));
        // Full's own gap is nothing: the first method of each scope.
        let first = i == 0 || pooled[i - 1].length != p.length;
        let gap = if first { dash() } else { p.gap.show() };
        println!(
            "| {length} | {} | {:.1} | {rel} | {gap} | {:.3} | {:.2} | {:.2}× |",
            p.method, p.score, p.flops, p.secs, p.speedup
        );
    }
}
