//! Retrieval tasks for `ridgefill eval --task`: a fact planted deep in a long prompt and asked
//! for at its end, where skipping the upper layers for the bulk rows hurts first. Each method is
//! scored by whether its greedy answer contains the key, and by the teacher-forced NLL of the
//! key's digits (graded where accuracy is all or nothing).

use std::ops::Range;
use std::path::PathBuf;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::io::text::collect_documents;
use ridgefill::io::tokenizer::Tokenizer;
use ridgefill::model::KvCache;
use ridgefill::model::eval::Method;
use ridgefill::model::fill::{FillRows, Oracle};
use ridgefill::model::{Llama, sample, to_host_f32};
use ridgefill::session::Loaded;

use super::eval::{Header, Runner};

/// Greedy tokens generated for an answer; also the positions kept free after the longest prompt.
pub const ANSWER_TOKENS: usize = 8;
/// Relative depths of the planted key (`passkey`, `passkey-first`).
const DEPTHS: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];
/// Relative depths of the `prose` fact: ten, so one question is 10 points of accuracy, the
/// resolution the comparison with full prefill is judged at.
const PROSE_DEPTHS: [f64; 10] = [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95];
/// One unit of the passkey haystack, repeated.
const PASSKEY_FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
/// Fixed keys, one per depth, so runs are comparable.
const PASSKEY_KEYS: [u32; 5] = [68_231, 40_957, 13_586, 92_714, 57_309];
/// The question after the haystack (`passkey`).
const PASSKEY_QUESTION: &str = " What is the pass key? The pass key is";
/// The question before the haystack (`passkey-first`), chat-like.
const PASSKEY_FIRST_QUESTION: &str =
    "Question: What is the pass key? Read the text below, then answer.\n";
/// The answer cue after the haystack (`passkey-first`).
const PASSKEY_FIRST_CUE: &str = "\nAnswer: The pass key is";
/// Facts for the prose tasks, `(object, code)`: every object and code differs, so no answer is
/// shared between depths or between the facts of one prompt.
const FACTS: [(&str, u32); 12] = [
    ("blue lighthouse", 48_213),
    ("red bicycle", 73_051),
    ("old library", 26_984),
    ("silver teapot", 85_417),
    ("green submarine", 31_679),
    ("stone bridge", 64_302),
    ("copper kettle", 19_846),
    ("yellow kite", 57_120),
    ("glass tower", 90_375),
    ("wooden ladder", 42_698),
    ("purple umbrella", 36_507),
    ("iron gate", 81_962),
];
/// Relative depths of the three facts of a `multi` prompt.
const MULTI_DEPTHS: [f64; 3] = [0.2, 0.5, 0.8];
/// `multi` prompts per length, each with its own facts, each fact asked in turn.
const MULTI_PROMPTS: usize = 4;
/// Every depth, and every fact of every `multi` prompt, has a fact of its own.
const _: () =
    assert!(FACTS.len() >= PROSE_DEPTHS.len() && FACTS.len() >= MULTI_PROMPTS * MULTI_DEPTHS.len());
/// Prose characters gathered per token of the longest prompt: generous whatever the tokenizer
/// (English BPE averages about four), so the haystack never runs out.
const PROSE_CHARS_PER_TOKEN: usize = 8;
/// The passkey haystack offers this many times the filler a prompt can hold, so the longest
/// fitting prompt is always found.
const FILLER_MARGIN: usize = 2;
/// Characters that end a sentence when splitting prose (closing quotes and brackets aside).
const SENTENCE_ENDS: [char; 3] = ['.', '!', '?'];
const CLOSERS: [char; 4] = ['"', '\'', ')', ']'];

/// A retrieval task.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// A 5-digit pass key in repeated filler, asked for at the end.
    Passkey,
    /// The same, with the question before the filler and an answer cue after it.
    PasskeyFirst,
    /// A secret code planted in real prose, asked for at the end.
    Prose,
    /// Three codes planted at 20/50/80% of the prose, each asked for in turn.
    Multi,
}

impl Task {
    pub fn name(self) -> &'static str {
        match self {
            Self::Passkey => "passkey",
            Self::PasskeyFirst => "passkey-first",
            Self::Prose => "prose",
            Self::Multi => "multi",
        }
    }

    /// Whether the haystack is prose (`--text`, or the Brown corpus).
    pub fn needs_prose(self) -> bool {
        matches!(self, Self::Prose | Self::Multi)
    }

    /// Questions asked per prompt length.
    fn queries(self) -> usize {
        match self {
            Self::Multi => MULTI_PROMPTS * MULTI_DEPTHS.len(),
            Self::Prose => PROSE_DEPTHS.len(),
            _ => DEPTHS.len(),
        }
    }
}

/// A retrieval prompt that cannot be built as asked, or a method that broke on one.
#[derive(Debug, thiserror::Error)]
pub enum RetrievalError {
    #[error(
        "task {task}: the question and fact alone take {tokens} tokens, more than the prompt \
         length {length}: raise --lengths"
    )]
    FixedTooLong {
        task: &'static str,
        length: usize,
        tokens: usize,
    },
    #[error(
        "task {task}: the prose gives only {tokens} tokens, short of the prompt length {length}: \
         give more --text or lower --lengths"
    )]
    HaystackTooShort {
        task: &'static str,
        length: usize,
        tokens: usize,
    },
    #[error(
        "task {task}, length {length}: the prompt's tokens are not a prefix of the prompt and \
         key {key:?} tokenized together, so the key's NLL cannot be read off"
    )]
    NotAPrefix {
        task: &'static str,
        length: usize,
        key: String,
    },
    #[error("task {task}: the key {key:?} tokenizes to no token holding a digit")]
    NoDigits { task: &'static str, key: String },
    #[error(
        "non-finite NLL ({nll}) of the key under method {method}, task {task}, length {length}: \
         the model's activations overflowed"
    )]
    NonFinite {
        nll: f64,
        method: &'static str,
        task: &'static str,
        length: usize,
    },
}

/// Prose to plant facts in: sentences, so a fact never splits one.
pub struct Prose {
    sentences: Vec<String>,
}

impl Prose {
    /// Sentences from `paths` (the Brown corpus, fetched when missing, if none), enough for a
    /// prompt of `longest` tokens.
    pub fn load(paths: &[PathBuf], lossy: bool, longest: usize) -> Result<Prose> {
        let paths = match paths {
            [] => vec![ridgefill::fetch::ensure("brown")?],
            p => p.to_vec(),
        };
        let want = longest.saturating_mul(PROSE_CHARS_PER_TOKEN);
        let mut sentences = Vec::new();
        let mut chars = 0;
        for doc in collect_documents(&paths, lossy)? {
            for s in split_sentences(&doc.text) {
                chars += s.len() + 1;
                sentences.push(s);
            }
            if chars >= want {
                break;
            }
        }
        Ok(Prose { sentences })
    }
}

/// `text`'s sentences with single spaces. One ends at a word ending in `.`, `!` or `?` that
/// ends its line or comes before a capitalised word: Brown's one-sentence lines stay whole
/// (`Jr. .` included), and lowercase after an abbreviation does not split.
fn split_sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut sentence: Vec<&str> = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        for (i, &w) in words.iter().enumerate() {
            sentence.push(w);
            let ends = w.trim_end_matches(CLOSERS).ends_with(SENTENCE_ENDS);
            let next_starts = words
                .get(i + 1)
                .is_none_or(|n| n.starts_with(char::is_uppercase));
            if ends && next_starts {
                out.push(sentence.join(" "));
                sentence.clear();
            }
        }
    }
    if !sentence.is_empty() {
        out.push(sentence.join(" "));
    }
    out
}

/// What to run: tasks × lengths, and the prose when a task needs it.
pub struct Spec<'a> {
    pub tasks: &'a [Task],
    pub lengths: &'a [usize],
    pub prose: Option<&'a Prose>,
}

/// One prompt's text: a question or cue around a haystack with facts planted in it.
struct Layout<'a> {
    /// Before the haystack.
    header: &'a str,
    /// The haystack's units (filler or sentences); a prefix of them is used.
    units: &'a [String],
    /// `(depth, sentence)`, by increasing depth.
    needles: Vec<(f64, String)>,
    /// After the haystack.
    question: String,
}

impl Layout<'_> {
    /// The text with the first `k` haystack units, each needle at its depth among them.
    fn text(&self, k: usize) -> String {
        let mut parts: Vec<&str> = self.units[..k].iter().map(String::as_str).collect();
        // Deepest first: earlier positions stay valid, and equal positions keep depth order.
        for (depth, needle) in self.needles.iter().rev() {
            let at = ((depth * k as f64).round() as usize).min(k);
            parts.insert(at, needle);
        }
        format!("{}{}{}", self.header, parts.join(" "), self.question)
    }

    /// The longest text of at most `length` tokens, and its tokens.
    fn fit(&self, tok: &Tokenizer, task: Task, length: usize) -> Result<(String, Vec<u32>)> {
        let encode = |k: usize| -> Result<(String, Vec<u32>)> {
            let text = self.text(k);
            let ids = tok.encode(&text, true)?;
            Ok((text, ids))
        };
        let mut best = encode(0)?;
        if best.1.len() > length {
            return Err(RetrievalError::FixedTooLong {
                task: task.name(),
                length,
                tokens: best.1.len(),
            }
            .into());
        }
        let all = encode(self.units.len())?.1.len();
        if all <= length {
            return Err(RetrievalError::HaystackTooShort {
                task: task.name(),
                length,
                tokens: all,
            }
            .into());
        }
        // Invariant: `lo` units fit, `hi` do not.
        let (mut lo, mut hi) = (0, self.units.len());
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let candidate = encode(mid)?;
            if candidate.1.len() <= length {
                lo = mid;
                best = candidate;
            } else {
                hi = mid;
            }
        }
        Ok(best)
    }
}

/// One question: the prompt's tokens, and the key's tokens as they continue it.
struct Query {
    prompt: Vec<u32>,
    /// `" " + key` tokenized jointly with the prompt, less the prompt.
    cont: Vec<u32>,
    /// Indices into `cont` of the tokens holding the key's digits.
    digits: Vec<usize>,
    key: String,
    /// Relative depth of the asked fact in the haystack.
    depth: f64,
    /// Start positions in `prompt` of the key's digit tokens, wherever the prompt holds them.
    planted: Vec<usize>,
}

impl Query {
    fn new(
        tok: &Tokenizer,
        task: Task,
        length: usize,
        layout: &Layout,
        (depth, key): (f64, u32),
    ) -> Result<Self> {
        let (text, prompt) = layout.fit(tok, task, length)?;
        let key = key.to_string();
        let joint = tok.encode(&format!("{text} {key}"), true)?;
        if joint.len() <= prompt.len() || !joint.starts_with(&prompt) {
            return Err(RetrievalError::NotAPrefix {
                task: task.name(),
                length,
                key,
            }
            .into());
        }
        let cont = joint[prompt.len()..].to_vec();
        let mut digits = Vec::new();
        for (i, &t) in cont.iter().enumerate() {
            if tok.decode(&[t], false)?.chars().any(|c| c.is_ascii_digit()) {
                digits.push(i);
            }
        }
        if digits.is_empty() {
            return Err(RetrievalError::NoDigits {
                task: task.name(),
                key,
            }
            .into());
        }
        let needle: Vec<u32> = digits.iter().map(|&i| cont[i]).collect();
        let planted = prompt
            .windows(needle.len())
            .enumerate()
            .filter(|(_, w)| *w == needle.as_slice())
            .map(|(i, _)| i)
            .collect();
        Ok(Query {
            prompt,
            cont,
            digits,
            key,
            depth,
            planted,
        })
    }

    /// Whether some planted copy of the key lies wholly in the exact rows: sink, `spans` or tail.
    fn covered(&self, rows: FillRows, spans: &[Range<usize>]) -> bool {
        let n = self.prompt.len();
        let Some(bulk) = rows.bulk(n) else {
            return true;
        };
        let len = self.digits.len();
        let exact = |p: usize| !bulk.contains(&p) || spans.iter().any(|s| s.contains(&p));
        self.planted.iter().any(|&p| (p..p + len).all(exact))
    }
}

/// The questions of `task` at prompt length `length`.
fn queries(
    tok: &Tokenizer,
    task: Task,
    length: usize,
    prose: Option<&Prose>,
) -> Result<Vec<Query>> {
    let fact = |(object, code): (&str, u32)| {
        (
            format!("The secret code of the {object} is {code}."),
            format!(
                "\nWhat is the secret code of the {object}? The secret code of the {object} is"
            ),
        )
    };
    let prose_units = prose.map_or(&[][..], |p| &p.sentences[..]);
    let mut out = Vec::with_capacity(task.queries());
    match task {
        Task::Passkey | Task::PasskeyFirst => {
            let unit_tokens = tok.encode(PASSKEY_FILLER, false)?.len().max(1);
            let units = vec![PASSKEY_FILLER.to_string(); FILLER_MARGIN * length / unit_tokens + 1];
            let (header, question) = match task {
                Task::Passkey => ("", PASSKEY_QUESTION),
                _ => (PASSKEY_FIRST_QUESTION, PASSKEY_FIRST_CUE),
            };
            for (&depth, &key) in DEPTHS.iter().zip(&PASSKEY_KEYS) {
                let needle = format!("The pass key is {key}. Remember it. {key} is the pass key.");
                let layout = Layout {
                    header,
                    units: &units,
                    needles: vec![(depth, needle)],
                    question: question.to_string(),
                };
                out.push(Query::new(tok, task, length, &layout, (depth, key))?);
            }
        }
        Task::Prose => {
            for (&depth, &f) in PROSE_DEPTHS.iter().zip(&FACTS) {
                let (needle, question) = fact(f);
                let layout = Layout {
                    header: "",
                    units: prose_units,
                    needles: vec![(depth, needle)],
                    question,
                };
                out.push(Query::new(tok, task, length, &layout, (depth, f.1))?);
            }
        }
        Task::Multi => {
            for facts in FACTS.chunks_exact(MULTI_DEPTHS.len()).take(MULTI_PROMPTS) {
                let needles: Vec<(f64, String)> = MULTI_DEPTHS
                    .iter()
                    .zip(facts)
                    .map(|(&depth, &f)| (depth, fact(f).0))
                    .collect();
                for (&depth, &f) in MULTI_DEPTHS.iter().zip(facts) {
                    let layout = Layout {
                        header: "",
                        units: prose_units,
                        needles: needles.clone(),
                        question: fact(f).1,
                    };
                    out.push(Query::new(tok, task, length, &layout, (depth, f.1))?);
                }
            }
        }
    }
    Ok(out)
}

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
    model: &Llama,
    tok: &Tokenizer,
    method: Method,
    oracle: Option<&Oracle>,
    q: &Query,
) -> Result<Answer> {
    let mut cache = model.new_cache(q.prompt.len() + ANSWER_TOKENS.max(q.cont.len()));
    let (last, spans) = match (method, oracle) {
        (Method::Fill(maps, rows), Some(o)) => {
            model.prefill_oracle(&q.prompt, &mut cache, maps, rows, o)?
        }
        _ => model.prefill_with_spans(&q.prompt, &mut cache, method)?,
    };

    let covered = match method {
        Method::Fill(_, rows) if rows.exact > 0.0 => Some(q.covered(rows, &spans)),
        _ => None,
    };
    let mut forced = cache.clone();
    let logp = model.continue_logp(last.clone(), &q.cont, &mut forced)?;
    drop(forced);
    let mut logits = to_host_f32(last);
    let mut answer = Vec::with_capacity(ANSWER_TOKENS);
    for step in 0..ANSWER_TOKENS {
        let t = sample::argmax(&logits);
        answer.push(t);
        if step + 1 < ANSWER_TOKENS {
            logits = to_host_f32(model.decode_step(t, &mut cache)?);
        }
    }
    let text = tok.decode(&answer, true)?;
    let hit = text.contains(&q.key);
    // `[c, vocab]`, flattened on the host: c is a handful of tokens.
    let vocab = logp.dims()[1];
    let logp = to_host_f32(logp);
    let nll = q
        .digits
        .iter()
        .map(|&i| -f64::from(logp[i * vocab + q.cont[i] as usize]))
        .sum();
    Ok(Answer {
        depth: q.depth,
        hit,
        text,
        nll,
        covered,
    })
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
    let bar = super::fit::Bar::new(
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
    let bar = super::fit::Bar::new(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_keep_brown_lines_whole_and_split_plain_text() {
        let brown = "It was won by Ivan Allen Jr. .\n\" Only a handful \" , the jury said .\n";
        assert_eq!(
            split_sentences(brown),
            [
                "It was won by Ivan Allen Jr. .",
                "\" Only a handful \" , the jury said ."
            ]
        );
        let plain = "See e.g. the cat. It sat! Did it?\"  Yes";
        assert_eq!(
            split_sentences(plain),
            ["See e.g. the cat.", "It sat!", "Did it?\"", "Yes"]
        );
    }

    #[test]
    fn needles_sit_at_their_depths_in_order() {
        let units: Vec<String> = (0..10).map(|i| format!("u{i}")).collect();
        let layout = Layout {
            header: "H ",
            units: &units,
            needles: vec![(0.2, "A".into()), (0.5, "B".into()), (0.8, "C".into())],
            question: " Q".into(),
        };
        assert_eq!(layout.text(10), "H u0 u1 A u2 u3 u4 B u5 u6 u7 C u8 u9 Q");
        assert_eq!(layout.text(0), "H A B C Q");
    }
}
