//! The retrieval tasks of `ridgefill eval --task` and their prompts: a fact planted deep in a
//! long haystack (filler or prose) and asked for at its end. [`super::retrieval`] runs them.

use std::ops::Range;
use std::path::PathBuf;

use anyhow::Result;
use ridgefill::io::text::collect_documents;
use ridgefill::io::tokenizer::Tokenizer;
use ridgefill::model::fill::FillRows;

use super::ruler::RulerTask;

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
pub(super) const FACTS: [(&str, u32); 12] = [
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
/// Groups of `multi` facts: each prompt plants one group's three facts, each asked in turn.
const MULTI_GROUPS: usize = 4;
/// Which depth each fact of a group takes, one `multi` prompt per order: the three rotations put
/// every fact at every depth, the reversal swaps first and last. 4 groups × 4 orders × 3 facts =
/// 48 questions, so one question is 2 points: 12 could not resolve the 2-point bar, and full
/// prefill with f32 weights already differs from native weights by one of 12 at 4096 tokens.
const MULTI_ORDERS: [[usize; 3]; 4] = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
/// Every depth, and every fact of every `multi` group, has a fact of its own.
const _: () =
    assert!(FACTS.len() >= PROSE_DEPTHS.len() && FACTS.len() >= MULTI_GROUPS * MULTI_DEPTHS.len());
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
    /// A code in the first turn's document of a chat, asked for two turns later: each method
    /// cold and with prefix reuse (`super::turns`).
    PasskeyTurns,
    /// Questions about real documents in a chat turn; answers compared with full prefill's
    /// (`super::answers`).
    Answers,
    /// RULER: a number under a word key in repeated noise.
    #[value(name = "niah_single_1")]
    NiahSingle1,
    /// RULER: a number under a word key in an essay.
    #[value(name = "niah_single_2")]
    NiahSingle2,
    /// RULER: a UUID under a word key in an essay.
    #[value(name = "niah_single_3")]
    NiahSingle3,
    /// RULER: four keys in an essay, one asked.
    #[value(name = "niah_multikey_1")]
    NiahMultikey1,
    /// RULER: the haystack is other needles (word keys, numbers).
    #[value(name = "niah_multikey_2")]
    NiahMultikey2,
    /// RULER: the haystack is other needles (UUID keys and values).
    #[value(name = "niah_multikey_3")]
    NiahMultikey3,
    /// RULER: four values under one key, all asked.
    #[value(name = "niah_multivalue")]
    NiahMultivalue,
    /// RULER: four keys, all asked.
    #[value(name = "niah_multiquery")]
    NiahMultiquery,
    /// RULER: variable tracking, a chain of four hops in noise.
    Vt,
    /// RULER: the ten most common words of a numbered list.
    Cwe,
    /// RULER: the three most frequent coded words.
    Fwe,
    /// Every RULER task above.
    Ruler,
}

impl Task {
    pub fn name(self) -> &'static str {
        match self {
            Self::Passkey => "passkey",
            Self::PasskeyFirst => "passkey-first",
            Self::Prose => "prose",
            Self::Multi => "multi",
            Self::PasskeyTurns => "passkey-turns",
            Self::Answers => "answers",
            t => match t.ruler() {
                [one] => one.name(),
                _ => "ruler",
            },
        }
    }

    /// The RULER tasks this stands for (none for the other tasks).
    pub fn ruler(self) -> &'static [RulerTask] {
        use RulerTask as R;
        match self {
            Self::NiahSingle1 => &[R::NiahSingle1],
            Self::NiahSingle2 => &[R::NiahSingle2],
            Self::NiahSingle3 => &[R::NiahSingle3],
            Self::NiahMultikey1 => &[R::NiahMultikey1],
            Self::NiahMultikey2 => &[R::NiahMultikey2],
            Self::NiahMultikey3 => &[R::NiahMultikey3],
            Self::NiahMultivalue => &[R::NiahMultivalue],
            Self::NiahMultiquery => &[R::NiahMultiquery],
            Self::Vt => &[R::Vt],
            Self::Cwe => &[R::Cwe],
            Self::Fwe => &[R::Fwe],
            Self::Ruler => &RulerTask::ALL,
            Self::Passkey
            | Self::PasskeyFirst
            | Self::Prose
            | Self::Multi
            | Self::PasskeyTurns
            | Self::Answers => &[],
        }
    }

    /// Whether the haystack is prose (`--text`, or the Brown corpus).
    pub fn needs_prose(self) -> bool {
        matches!(self, Self::Prose | Self::Multi | Self::PasskeyTurns)
    }

    /// Questions asked per prompt length.
    pub(super) fn queries(self) -> usize {
        match self {
            Self::Multi => MULTI_GROUPS * MULTI_ORDERS.len() * MULTI_DEPTHS.len(),
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

    /// The sentences, in order.
    pub fn sentences(&self) -> &[String] {
        &self.sentences
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
pub(super) struct Layout<'a> {
    /// Before the haystack.
    pub(super) header: &'a str,
    /// The haystack's units (filler or sentences); a prefix of them is used.
    pub(super) units: &'a [String],
    /// `(depth, sentence)`, by increasing depth.
    pub(super) needles: Vec<(f64, String)>,
    /// After the haystack.
    pub(super) question: String,
}

impl Layout<'_> {
    /// The text with the first `k` haystack units, each needle at its depth among them.
    pub(super) fn text(&self, k: usize) -> String {
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
pub(super) struct Query {
    pub(super) prompt: Vec<u32>,
    /// `" " + key` tokenized jointly with the prompt, less the prompt.
    pub(super) cont: Vec<u32>,
    /// Indices into `cont` of the tokens holding the key's digits.
    pub(super) digits: Vec<usize>,
    pub(super) key: String,
    /// Relative depth of the asked fact in the haystack.
    pub(super) depth: f64,
    /// Start positions in `prompt` of the key's digit tokens, wherever the prompt holds them.
    pub(super) planted: Vec<usize>,
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
        let digits = digit_positions(tok, &cont)?;
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
    pub(super) fn covered(&self, rows: FillRows, spans: &[Range<usize>]) -> bool {
        let n = self.prompt.len();
        let Some(bulk) = rows.bulk(n) else {
            return true;
        };
        let len = self.digits.len();
        let exact = |p: usize| !bulk.contains(&p) || spans.iter().any(|s| s.contains(&p));
        self.planted.iter().any(|&p| (p..p + len).all(exact))
    }
}

/// Indices into `cont` of the tokens that hold a digit (a key's).
pub(super) fn digit_positions(tok: &Tokenizer, cont: &[u32]) -> Result<Vec<usize>> {
    let mut digits = Vec::new();
    for (i, &t) in cont.iter().enumerate() {
        if tok.decode(&[t], false)?.chars().any(|c| c.is_ascii_digit()) {
            digits.push(i);
        }
    }
    Ok(digits)
}

/// The questions of `task` at prompt length `length`.
pub(super) fn queries(
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
            for placed in multi_prompts() {
                let needles: Vec<(f64, String)> = placed
                    .iter()
                    .map(|&(depth, f)| (depth, fact(f).0))
                    .collect();
                for &(depth, f) in &placed {
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
        // Its questions come from a question set, asked by `super::answers`; the turns'
        // conversations are built by `super::turns`.
        Task::Answers | Task::PasskeyTurns => {}
        // RULER's prompts are generated by `super::ruler`, never asked here.
        _ => {}
    }
    Ok(out)
}

/// Each `multi` prompt's facts with their depths, by increasing depth: every group of
/// [`FACTS`] in every one of [`MULTI_ORDERS`].
fn multi_prompts() -> Vec<Vec<(f64, (&'static str, u32))>> {
    let groups = FACTS.chunks_exact(MULTI_DEPTHS.len()).take(MULTI_GROUPS);
    groups
        .flat_map(|g| MULTI_ORDERS.iter().map(move |o| (g, o)))
        .map(|(facts, order)| {
            let mut placed: Vec<_> = order
                .iter()
                .zip(facts)
                .map(|(&d, &f)| (MULTI_DEPTHS[d], f))
                .collect();
            placed.sort_by(|a, b| a.0.total_cmp(&b.0));
            placed
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_asks_every_fact_at_every_depth() {
        let prompts = multi_prompts();
        assert_eq!(prompts.len() * MULTI_DEPTHS.len(), Task::Multi.queries());
        assert_eq!(Task::Multi.queries(), 48);
        for (object, _) in &FACTS[..MULTI_GROUPS * MULTI_DEPTHS.len()] {
            let mut depths: Vec<f64> = prompts
                .iter()
                .flatten()
                .filter(|(_, f)| f.0 == *object)
                .map(|&(d, _)| d)
                .collect();
            depths.sort_by(f64::total_cmp);
            depths.dedup();
            assert_eq!(depths, MULTI_DEPTHS, "{object}");
        }
        // No two prompts are the same, and each lists its facts by increasing depth.
        for (i, p) in prompts.iter().enumerate() {
            assert!(p.windows(2).all(|w| w[0].0 < w[1].0), "{p:?}");
            assert!(!prompts[..i].contains(p), "{p:?}");
        }
    }

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
