//! Retrieval tasks for `ridgefill eval --task`: a fact planted deep in a long prompt and asked
//! for at its end, where skipping the upper layers for the bulk rows hurts first. Each method is
//! scored by whether its greedy answer contains the key, and by the teacher-forced NLL of the
//! key's digits (graded where accuracy is all or nothing).

use std::path::PathBuf;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::io::text::collect_documents;
use ridgefill::io::tokenizer::Tokenizer;
use ridgefill::model::eval::Method;
use ridgefill::model::{Llama, sample, to_host_f32};
use ridgefill::session::Loaded;

use super::eval::{Header, Runner};

/// Greedy tokens generated for an answer; also the positions kept free after the longest prompt.
pub const ANSWER_TOKENS: usize = 8;
/// Relative depths of the single planted fact (`passkey`, `passkey-first`, `prose`).
const DEPTHS: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];
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
const FACTS: [(&str, u32); 6] = [
    ("blue lighthouse", 48_213),
    ("red bicycle", 73_051),
    ("old library", 26_984),
    ("silver teapot", 85_417),
    ("green submarine", 31_679),
    ("stone bridge", 64_302),
];
/// Relative depths of the three facts of a `multi` prompt.
const MULTI_DEPTHS: [f64; 3] = [0.2, 0.5, 0.8];
/// `multi` prompts per length, each with its own facts, each fact asked in turn.
const MULTI_PROMPTS: usize = 2;
/// Every depth, and every fact of every `multi` prompt, has a fact of its own.
const _: () =
    assert!(FACTS.len() >= DEPTHS.len() && FACTS.len() >= MULTI_PROMPTS * MULTI_DEPTHS.len());
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
}

impl Query {
    fn new(tok: &Tokenizer, task: Task, length: usize, layout: &Layout, key: u32) -> Result<Self> {
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
        Ok(Query {
            prompt,
            cont,
            digits,
            key,
        })
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
                out.push(Query::new(tok, task, length, &layout, key)?);
            }
        }
        Task::Prose => {
            for (&depth, &f) in DEPTHS.iter().zip(&FACTS) {
                let (needle, question) = fact(f);
                let layout = Layout {
                    header: "",
                    units: prose_units,
                    needles: vec![(depth, needle)],
                    question,
                };
                out.push(Query::new(tok, task, length, &layout, f.1)?);
            }
        }
        Task::Multi => {
            for facts in FACTS.chunks_exact(MULTI_DEPTHS.len()).take(MULTI_PROMPTS) {
                let needles: Vec<(f64, String)> = MULTI_DEPTHS
                    .iter()
                    .zip(facts)
                    .map(|(&depth, &f)| (depth, fact(f).0))
                    .collect();
                for &f in facts {
                    let layout = Layout {
                        header: "",
                        units: prose_units,
                        needles: needles.clone(),
                        question: fact(f).1,
                    };
                    out.push(Query::new(tok, task, length, &layout, f.1)?);
                }
            }
        }
    }
    Ok(out)
}

/// Whether the greedy answer after prefilling by `method` contains the key, and the summed NLL
/// of the key's digit tokens, teacher-forced by the full model on top of that prefill.
fn ask(model: &Llama, tok: &Tokenizer, method: Method, q: &Query) -> Result<(bool, f64)> {
    let mut cache = model.new_cache(q.prompt.len() + ANSWER_TOKENS);
    let mut logits = to_host_f32(model.prefill_with(&q.prompt, &mut cache, method)?);
    let mut answer = Vec::with_capacity(ANSWER_TOKENS);
    for step in 0..ANSWER_TOKENS {
        let t = sample::argmax(&logits);
        answer.push(t);
        if step + 1 < ANSWER_TOKENS {
            logits = to_host_f32(model.decode_step(t, &mut cache)?);
        }
    }
    let hit = tok.decode(&answer, true)?.contains(&q.key);
    // `[c, vocab]`, flattened on the host: c is a handful of tokens.
    let logp = model.continuation_logp(&q.prompt, &q.cont, method)?;
    let vocab = logp.dims()[1];
    let logp = to_host_f32(logp);
    let nll = q
        .digits
        .iter()
        .map(|&i| -f64::from(logp[i * vocab + q.cont[i] as usize]))
        .sum();
    Ok((hit, nll))
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
}

impl Outcome {
    fn accuracy(&self) -> f64 {
        self.hits as f64 / self.queries as f64
    }

    fn key_nll(&self) -> f64 {
        self.nll / self.digits as f64
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
                let mut o = Outcome {
                    task,
                    length,
                    method: r.name(),
                    exact: r.rows.exact,
                    flops_ratio: r.flops_ratio(&model.config, length),
                    hits: 0,
                    queries: qs.len(),
                    nll: 0.0,
                    digits: 0,
                    relative: None,
                };
                for q in &qs {
                    interrupt::check()?;
                    let (hit, nll) = ask(model, tok, r.prefill(), q)?;
                    if !nll.is_finite() {
                        return Err(RetrievalError::NonFinite {
                            nll,
                            method: r.name(),
                            task: task.name(),
                            length,
                        }
                        .into());
                    }
                    o.hits += usize::from(hit);
                    o.nll += nll;
                    o.digits += q.digits.len();
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
         full prefill's; key NLL: mean over the key's digit tokens"
    );
    println!("| task | length | method | accuracy | vs full | key NLL | prefill FLOPs |");
    println!("|---|---:|---|---:|---:|---:|---:|");
    for o in outcomes {
        let relative = o.relative.map_or("–".to_string(), |r| format!("{r:.2}"));
        println!(
            "| {} | {} | {} | {:.2} | {relative} | {:.3} | {:.3} |",
            o.task.name(),
            o.length,
            o.method,
            o.accuracy(),
            o.key_nll(),
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
