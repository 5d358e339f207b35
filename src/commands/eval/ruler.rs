//! RULER's synthetic tasks (Hsieh et al. 2024, NVIDIA/RULER), generated here from a seed:
//! needle retrieval in eight variants, variable tracking (multi-hop tracing) and common / frequent
//! word extraction (aggregation). Skip-and-fill risks losing what the bulk rows hold; RULER asks
//! for exactly that in the ways long-context models are judged by, so its scores say whether the
//! fill keeps a model's long-context ability, not just one planted fact ([`super::ruler_run`]
//! runs them per method).
//!
//! As RULER writes them: its templates, needle formats, answer prefixes and generation budgets;
//! the prompt is template then answer prefix (RULER's `base` model template), a plain completion
//! with BOS as the tokenizer adds it; a length L means prompt tokens plus the task's generation
//! budget within L, the haystack as large as that allows (binary search over its size, as RULER);
//! scored by `string_match_all`. Where this differs from RULER, deliberately:
//! - words and the essay come from [`super::ruler_data`] (Brown's tagged words; Austen's *Emma*);
//! - every random choice comes from one generator seeded per sample, where RULER reseeds some
//!   shuffles with the fixed seed (the same permutation for every sample);
//! - a sample longer than L is fitted by its own binary search, where RULER drops a fixed step
//!   (500 essay words at once), so every prompt lands just under L;
//! - keys, values and variable names are drawn distinct, so every answer is derivable.

use std::collections::{BTreeSet, HashSet};
use std::ops::Range;

use anyhow::Result;
use rand::rngs::StdRng;
use rand::seq::{SliceRandom, index};
use rand::{Rng, SeedableRng};

use super::ruler_data::{Essay, Lexicon, letters, number, sentences, uuid};
use super::ruler_fit::{Encode, MAX_SIZE, fitted, largest};

/// NIAH's prompt, answer prefix and needle (RULER's `niah` template).
const NIAH_TEMPLATE: &str = "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?";
const NIAH_PREFIX: &str =
    " The special magic {type_needle_v} for {query} mentioned in the provided text are";
const NIAH_NEEDLE: &str = "One of the special magic {type_needle_v} for {key} is: {value}.";
/// RULER's rewrites of the NIAH template when one value is asked for, in order.
const SINGULAR: [(&str, &str); 4] = [
    ("Some", "A"),
    ("are all", "is"),
    ("are", "is"),
    ("answers", "answer"),
];
/// The repeated noise haystack (NIAH `noise`, variable tracking).
const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const VT_TEMPLATE: &str = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.";
const VT_PREFIX: &str = " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ";
const CWE_TEMPLATE: &str = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?";
const CWE_PREFIX: &str = " Answer: The top 10 words that appear most often in the list are:";
const FWE_TEMPLATE: &str = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?";
const FWE_PREFIX: &str =
    " Answer: According to the coded text above, the three most frequently appeared words are:";

/// Greedy tokens generated per task (RULER's `tokens_to_generate`).
const NIAH_NEW: usize = 128;
const VT_NEW: usize = 30;
const CWE_NEW: usize = 120;
const FWE_NEW: usize = 50;
/// Keys, values per key or queries in the `multi*` NIAH variants.
const MULTI: usize = 4;
/// NIAH essay needles go at depths drawn from this many evenly spaced percentages, 0 to 100.
const DEPTH_STEPS: usize = 40;
const PERCENT: f64 = 100.0;
/// Variable tracking: one chain of this many hops; its variables' and the ICL example's lengths.
const VT_HOPS: usize = 4;
const VT_VAR_LEN: usize = 5;
const VT_ICL_VAR_LEN: usize = 3;
/// The chain's value: a 5-digit number (numpy's `randint(10000, 99999)`, upper bound excluded).
const VT_VALUE: std::ops::Range<u32> = 10_000..99_999;
/// The in-context example is fitted to this many tokens, without an answer budget.
const VT_ICL_TOKENS: usize = 500;
/// Common words asked for in `cwe`; from this length on, RULER uses the longer repetitions.
const CWE_COMMON: usize = 10;
const CWE_LONG: usize = 4096;
/// `cwe` lists: (distinct words, repeats of a common word, repeats of an uncommon one).
const CWE_SHORT_SHOT: (usize, usize, usize) = (20, 3, 1);
const CWE_SHORT_MAIN: (usize, usize) = (6, 1);
const CWE_LONG_SHOT: (usize, usize, usize) = (40, 10, 3);
const CWE_LONG_MAIN: (usize, usize) = (30, 3);
/// `fwe`: coded words of this many letters, one per this many tokens of the budget, counts
/// following a zeta law with exponent 2 (ζ(2) = π²/6); three asked for, after the noise `...`.
const FWE_WORD_LEN: usize = 6;
const FWE_TOKENS_PER_WORD: usize = 50;
const FWE_ALPHA: i32 = 2;
const ZETA_2: f64 = std::f64::consts::PI * std::f64::consts::PI / 6.0;
const FWE_ASKED: usize = 3;
const FWE_NOISE: &str = "...";

/// One of RULER's synthetic tasks (its QA tasks need downloaded data sets and are left out).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RulerTask {
    NiahSingle1,
    NiahSingle2,
    NiahSingle3,
    NiahMultikey1,
    NiahMultikey2,
    NiahMultikey3,
    NiahMultivalue,
    NiahMultiquery,
    Vt,
    Cwe,
    Fwe,
}

/// A RULER generation or prompt that cannot be made as asked.
#[derive(Debug, thiserror::Error)]
pub enum RulerError {
    #[error(
        "{task}: the smallest prompt takes {tokens} tokens, with the {new} answer tokens more than \
         the length {length}: raise --lengths"
    )]
    FixedTooLong {
        task: &'static str,
        length: usize,
        tokens: usize,
        new: usize,
    },
    #[error(
        "{task}: its material runs out at {tokens} tokens (size {size}), short of the length \
         {length}: lower --lengths"
    )]
    MaterialTooShort {
        task: &'static str,
        length: usize,
        tokens: usize,
        size: usize,
    },
    #[error("{task}: needs the essay haystack, which was not loaded")]
    NoEssay { task: &'static str },
    #[error(
        "fwe at length {length}: a vocabulary of {words} coded words cannot rank {FWE_ASKED} of \
         them: raise --lengths"
    )]
    FweVocabulary { length: usize, words: usize },
    #[error("cwe: {asked} distinct words asked for, the word list holds {held}")]
    FewWords { asked: usize, held: usize },
}

/// What a NIAH haystack is made of.
#[derive(Clone, Copy, PartialEq)]
enum Haystack {
    /// [`NOISE`] repeated, one per line.
    Noise,
    /// Sentences of the essay.
    Essay,
    /// Other needles with other keys, one per line.
    Needle,
}

/// What a NIAH key or value is.
#[derive(Clone, Copy)]
enum Draw {
    Word,
    Number,
    Uuid,
}

impl Draw {
    fn plural(self) -> &'static str {
        match self {
            Self::Word => "words",
            Self::Number => "numbers",
            Self::Uuid => "uuids",
        }
    }

    fn draw(self, lex: &Lexicon, rng: &mut StdRng) -> String {
        match self {
            Self::Word => lex.key(rng),
            Self::Number => number(rng),
            Self::Uuid => uuid(rng),
        }
    }
}

/// One NIAH variant (RULER's `synthetic.yaml`).
struct Niah {
    haystack: Haystack,
    key: Draw,
    value: Draw,
    keys: usize,
    values: usize,
    queries: usize,
}

impl RulerTask {
    pub const ALL: [RulerTask; 11] = [
        Self::NiahSingle1,
        Self::NiahSingle2,
        Self::NiahSingle3,
        Self::NiahMultikey1,
        Self::NiahMultikey2,
        Self::NiahMultikey3,
        Self::NiahMultivalue,
        Self::NiahMultiquery,
        Self::Vt,
        Self::Cwe,
        Self::Fwe,
    ];

    /// RULER's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::NiahSingle1 => "niah_single_1",
            Self::NiahSingle2 => "niah_single_2",
            Self::NiahSingle3 => "niah_single_3",
            Self::NiahMultikey1 => "niah_multikey_1",
            Self::NiahMultikey2 => "niah_multikey_2",
            Self::NiahMultikey3 => "niah_multikey_3",
            Self::NiahMultivalue => "niah_multivalue",
            Self::NiahMultiquery => "niah_multiquery",
            Self::Vt => "vt",
            Self::Cwe => "cwe",
            Self::Fwe => "fwe",
        }
    }

    /// Greedy tokens generated for an answer; counted in the prompt length, as RULER does.
    pub fn max_new(self) -> usize {
        match self {
            Self::Vt => VT_NEW,
            Self::Cwe => CWE_NEW,
            Self::Fwe => FWE_NEW,
            _ => NIAH_NEW,
        }
    }

    /// Whether the haystack is the essay.
    pub fn needs_essay(self) -> bool {
        self.niah().is_some_and(|n| n.haystack == Haystack::Essay)
    }

    fn niah(self) -> Option<Niah> {
        use Draw::{Number, Uuid, Word};
        use Haystack::{Essay, Needle, Noise};
        let n = |haystack, key, value, (keys, values, queries)| Niah {
            haystack,
            key,
            value,
            keys,
            values,
            queries,
        };
        Some(match self {
            Self::NiahSingle1 => n(Noise, Word, Number, (1, 1, 1)),
            Self::NiahSingle2 => n(Essay, Word, Number, (1, 1, 1)),
            Self::NiahSingle3 => n(Essay, Word, Uuid, (1, 1, 1)),
            Self::NiahMultikey1 => n(Essay, Word, Number, (MULTI, 1, 1)),
            Self::NiahMultikey2 => n(Needle, Word, Number, (1, 1, 1)),
            Self::NiahMultikey3 => n(Needle, Uuid, Uuid, (1, 1, 1)),
            Self::NiahMultivalue => n(Essay, Word, Number, (1, MULTI, 1)),
            Self::NiahMultiquery => n(Essay, Word, Number, (MULTI, 1, MULTI)),
            Self::Vt | Self::Cwe | Self::Fwe => return None,
        })
    }
}

/// One generated prompt and what a right answer contains.
pub struct Sample {
    pub text: String,
    /// `text` tokenized, BOS included.
    pub prompt: Vec<u32>,
    pub references: Vec<String>,
    /// The haystack size the prompt was fitted with (lines, words or list entries).
    pub size: usize,
    /// The prompt rows each reference's first occurrence covers (none: not in the text), so a
    /// lost answer can be read against the spans that ran exactly.
    pub reference_rows: Vec<Option<Range<usize>>>,
}

/// The prompt rows `references` take in `text` (BOS counted, as in the prompt).
fn reference_rows(
    text: &str,
    references: &[String],
    encode: &Encode,
) -> Result<Vec<Option<Range<usize>>>> {
    references
        .iter()
        .map(|r| {
            let Some(at) = text.find(r.as_str()) else {
                return Ok(None);
            };
            let start = encode(&text[..at])?.len();
            let end = encode(&text[..at + r.len()])?.len();
            Ok(Some(start.min(end)..end))
        })
        .collect()
}

/// The material the generators draw on.
pub struct Material<'a> {
    pub lexicon: &'a Lexicon,
    pub essay: Option<&'a Essay>,
}

/// One task at one length: what every sample's generator shares.
struct Gen<'a> {
    task: RulerTask,
    length: usize,
    material: &'a Material<'a>,
    /// Noise lines of the variable-tracking example.
    vt_icl: usize,
}

/// `count` samples of `task` at `length` tokens (answer budget included), each determined by
/// `seed`, the task, the length and its index.
pub fn samples(
    task: RulerTask,
    length: usize,
    count: usize,
    seed: u64,
    material: &Material,
    encode: &Encode,
) -> Result<Vec<Sample>> {
    let mut g = Gen {
        task,
        length,
        material,
        vt_icl: 0,
    };
    let seeds: Vec<u64> = (0..count)
        .map(|i| sample_seed(seed, task, length, i))
        .collect();
    if task == RulerTask::Vt {
        // RULER fits its example to 500 tokens, falling back to the smallest when none fits.
        let icl = |size: usize| -> Result<(String, Vec<String>)> {
            let mut rng = StdRng::seed_from_u64(seeds.first().copied().unwrap_or(seed));
            let vars = distinct(&mut rng, VT_HOPS + 1, |r| letters(r, VT_ICL_VAR_LEN, b'A'));
            Ok((vt_input(size, &vars, VT_VALUE.start, &mut rng), vars))
        };
        let fit = largest(&icl, encode, VT_ICL_TOKENS, g.min_size(), None, MAX_SIZE)?;
        g.vt_icl = fit.map_or(g.min_size(), |(size, _)| size);
    }
    let budget = length.saturating_sub(task.max_new());
    let mut out: Vec<Sample> = Vec::with_capacity(count);
    for &s in &seeds {
        let build = |size: usize| g.build(size, s);
        let (min, max) = (g.min_size(), g.max_size());
        let fit = match out.first().map(|f| f.size) {
            // Later samples start from the first's size, searching only when they overflow.
            Some(size) => match fitted(&build, encode, budget, size)? {
                Some(fit) => Some(fit),
                None => largest(&build, encode, budget, min, Some(size), max)?,
            },
            None => largest(&build, encode, budget, min, None, max)?,
        };
        let Some((size, (text, references, prompt))) = fit else {
            let (text, _) = build(g.min_size())?;
            return Err(RulerError::FixedTooLong {
                task: task.name(),
                length,
                tokens: encode(&text)?.len(),
                new: task.max_new(),
            }
            .into());
        };
        if size >= max {
            return Err(RulerError::MaterialTooShort {
                task: task.name(),
                length,
                tokens: prompt.len(),
                size,
            }
            .into());
        }
        let reference_rows = reference_rows(&text, &references, encode)?;
        out.push(Sample {
            text,
            prompt,
            references,
            size,
            reference_rows,
        });
    }
    Ok(out)
}

/// A sample's own seed: `seed`, task, length and index mixed (SplitMix64's finaliser).
fn sample_seed(seed: u64, task: RulerTask, length: usize, index: usize) -> u64 {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    [task as u64, length as u64, index as u64]
        .into_iter()
        .fold(mix(seed), |h, x| mix(h ^ x))
}

/// `n` distinct values of `draw`.
fn distinct(
    rng: &mut StdRng,
    n: usize,
    mut draw: impl FnMut(&mut StdRng) -> String,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(n);
    while out.len() < n {
        let v = draw(rng);
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// `lines` with each of `inserts` put at a distinct random index, as RULER's noise haystacks.
fn insert_lines(rng: &mut StdRng, mut lines: Vec<String>, inserts: &[String]) -> Vec<String> {
    let mut at = index::sample(rng, lines.len(), inserts.len()).into_vec();
    at.sort_unstable_by(|a, b| b.cmp(a));
    for (i, s) in at.into_iter().zip(inserts) {
        lines.insert(i, s.clone());
    }
    lines
}

/// `1. w 2. w ...`, RULER's numbered word lists.
fn numbered(words: &[String]) -> String {
    let items: Vec<String> = words
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{}. {w}", i + 1))
        .collect();
    items.join(" ")
}

/// Variable tracking's question text: the chain `VAR A = value`, `VAR B = VAR A `, ... among
/// `size` noise lines, each chain line after the previous one.
fn vt_input(size: usize, vars: &[String], value: u32, rng: &mut StdRng) -> String {
    let mut lines = vec![NOISE.to_string(); size];
    let mut chain = vec![format!("VAR {} = {value}", vars[0])];
    chain.extend(
        vars.windows(2)
            .map(|w| format!("VAR {} = VAR {} ", w[1], w[0])),
    );
    let mut at = index::sample(rng, size, chain.len()).into_vec();
    at.sort_unstable();
    for (j, (i, line)) in at.into_iter().zip(chain).enumerate() {
        lines.insert(i + j, line);
    }
    let context = lines.join("\n").replace(". \n", ".\n");
    let value = value.to_string();
    let vars_asked = vars.len().to_string();
    format!("{VT_TEMPLATE}{VT_PREFIX}")
        .replace("{num_v}", &vars_asked)
        .replace("{query}", &value)
        .replace("{context}", &context)
}

/// The counts of `fwe`'s coded words by rank for `words` words in all.
fn fwe_counts(words: usize, vocab: usize) -> Vec<usize> {
    (1..=vocab)
        .map(|k| (words as f64 * f64::from(k as u32).powi(-FWE_ALPHA) / ZETA_2) as usize)
        .collect()
}

/// Whether the asked ranks of `fwe` (after the noise) are strictly ordered, the next one below.
fn fwe_ranked(counts: &[usize]) -> bool {
    counts.len() > FWE_ASKED + 1 && counts[1..=FWE_ASKED + 1].windows(2).all(|w| w[0] > w[1])
}

impl Gen<'_> {
    /// The smallest haystack a prompt can have.
    fn min_size(&self) -> usize {
        match self.task {
            RulerTask::Vt => VT_HOPS + 1,
            RulerTask::Cwe => CWE_COMMON + 1,
            RulerTask::Fwe => {
                let vocab = self.fwe_vocab();
                if vocab <= FWE_ASKED + 1 {
                    // Never ranked: the first build says so.
                    return MAX_SIZE;
                }
                (1..MAX_SIZE)
                    .find(|&n| fwe_ranked(&fwe_counts(n, vocab)))
                    .unwrap_or(MAX_SIZE)
            }
            t => t.niah().map_or(1, |n| match n.haystack {
                Haystack::Essay => 1,
                _ => n.keys.max(n.queries) * n.values,
            }),
        }
    }

    /// The largest haystack the material allows.
    fn max_size(&self) -> usize {
        match self.task {
            RulerTask::Cwe => self.material.lexicon.all.len(),
            _ => MAX_SIZE,
        }
    }

    fn fwe_vocab(&self) -> usize {
        self.length.saturating_sub(FWE_NEW) / FWE_TOKENS_PER_WORD
    }

    /// The prompt at haystack `size` from the sample seeded `seed`, and its references.
    fn build(&self, size: usize, seed: u64) -> Result<(String, Vec<String>)> {
        let mut rng = StdRng::seed_from_u64(seed);
        match (self.task, self.task.niah()) {
            (RulerTask::Vt, _) => Ok(self.vt(size, &mut rng)),
            (RulerTask::Cwe, _) => self.cwe(size, &mut rng),
            (RulerTask::Fwe, _) => self.fwe(size, &mut rng),
            (_, Some(n)) => self.niah(&n, size, &mut rng),
            (t, None) => anyhow::bail!("{}: no generator", t.name()),
        }
    }

    fn niah(&self, n: &Niah, size: usize, rng: &mut StdRng) -> Result<(String, Vec<String>)> {
        let lex = self.material.lexicon;
        let type_v = n.value.plural();
        let key_count = n.keys.max(n.queries);
        let keys = distinct(rng, key_count, |r| n.key.draw(lex, r));
        let flat = distinct(rng, key_count * n.values, |r| n.value.draw(lex, r));
        let values: Vec<&[String]> = flat.chunks(n.values).collect();
        let needle = |key: &str, value: &str| {
            NIAH_NEEDLE
                .replace("{type_needle_v}", type_v)
                .replace("{key}", key)
                .replace("{value}", value)
        };
        let mut needles: Vec<String> = keys
            .iter()
            .zip(&values)
            .flat_map(|(k, vs)| vs.iter().map(|v| needle(k, v)))
            .collect();
        needles.shuffle(rng);
        let context = match n.haystack {
            Haystack::Essay => {
                let essay = self.material.essay.ok_or(RulerError::NoEssay {
                    task: self.task.name(),
                })?;
                let sents = sentences(essay.head(size));
                let depths = index::sample(rng, DEPTH_STEPS, needles.len());
                let mut at: Vec<usize> = depths
                    .iter()
                    .map(|d| {
                        let percent = (PERCENT * d as f64 / (DEPTH_STEPS - 1) as f64).round();
                        (sents.len() as f64 * percent / PERCENT) as usize
                    })
                    .collect();
                at.sort_unstable();
                let mut parts: Vec<&str> = Vec::with_capacity(sents.len() + needles.len());
                let mut from = 0;
                for (&to, needle) in at.iter().zip(&needles) {
                    parts.extend(sents[from..to].iter().map(String::as_str));
                    parts.push(needle);
                    from = to;
                }
                parts.extend(sents[from..].iter().map(String::as_str));
                parts.join(" ")
            }
            Haystack::Noise => {
                insert_lines(rng, vec![NOISE.to_string(); size], &needles).join("\n")
            }
            Haystack::Needle => {
                // Other keys and values than the asked ones, so only the needle answers.
                let mut seen: HashSet<String> = keys.iter().chain(&flat).cloned().collect();
                let mut fresh = |draw: Draw, r: &mut StdRng| loop {
                    let v = draw.draw(lex, r);
                    if seen.insert(v.clone()) {
                        break v;
                    }
                };
                let lines: Vec<String> = (0..size)
                    .map(|_| {
                        let k = fresh(n.key, rng);
                        let v = fresh(n.value, rng);
                        needle(&k, &v)
                    })
                    .collect();
                insert_lines(rng, lines, &needles).join("\n")
            }
        };
        let asked = index::sample(rng, key_count, n.queries).into_vec();
        let queries: Vec<&str> = asked.iter().map(|&i| keys[i].as_str()).collect();
        let answers: Vec<String> = asked.iter().flat_map(|&i| values[i].to_vec()).collect();
        let query = match queries.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{}, and {last}", rest.join(", ")),
            _ => queries.concat(),
        };
        let mut template = format!("{NIAH_TEMPLATE}{NIAH_PREFIX}");
        let mut type_v = type_v;
        if n.queries * n.values == 1 {
            for (from, to) in SINGULAR {
                template = template.replace(from, to);
            }
            type_v = type_v.strip_suffix('s').unwrap_or(type_v);
        }
        let text = template
            .replace("{type_needle_v}", type_v)
            .replace("{query}", &query)
            .replace("{context}", &context);
        Ok((text, answers))
    }

    /// The question after an in-context example with other variables and another value.
    fn vt(&self, size: usize, rng: &mut StdRng) -> (String, Vec<String>) {
        let vars = distinct(rng, VT_HOPS + 1, |r| letters(r, VT_VAR_LEN, b'A'));
        let value = rng.random_range(VT_VALUE);
        let input = vt_input(size, &vars, value, rng);
        let icl_vars = distinct(rng, VT_HOPS + 1, |r| letters(r, VT_ICL_VAR_LEN, b'A'));
        let icl_value = loop {
            let v = rng.random_range(VT_VALUE);
            if v != value {
                break v;
            }
        };
        let icl = vt_input(self.vt_icl, &icl_vars, icl_value, rng);
        (format!("{icl} {}\n\n{input}", icl_vars.join(" ")), vars)
    }

    /// A numbered list after a solved example; the 10 words repeated most are the answer.
    fn cwe(&self, size: usize, rng: &mut StdRng) -> Result<(String, Vec<String>)> {
        let (shot, (common, uncommon)) = if self.length < CWE_LONG {
            (CWE_SHORT_SHOT, CWE_SHORT_MAIN)
        } else {
            (CWE_LONG_SHOT, CWE_LONG_MAIN)
        };
        let words = &self.material.lexicon.all;
        let list = |rng: &mut StdRng,
                    n: usize,
                    (c, u): (usize, usize)|
         -> Result<(String, Vec<String>), RulerError> {
            if n > words.len() {
                return Err(RulerError::FewWords {
                    asked: n,
                    held: words.len(),
                });
            }
            let picked: Vec<String> = index::sample(rng, words.len(), n)
                .iter()
                .map(|i| words[i].clone())
                .collect();
            let (top, rest) = picked.split_at(CWE_COMMON.min(n));
            let mut list: Vec<String> = Vec::with_capacity(top.len() * c + rest.len() * u);
            for _ in 0..c {
                list.extend_from_slice(top);
            }
            for _ in 0..u {
                list.extend_from_slice(rest);
            }
            list.shuffle(rng);
            Ok((numbered(&list), top.to_vec()))
        };
        let (example, example_answer) = list(rng, shot.0, (shot.1, shot.2))?;
        let (context, answer) = list(rng, size, (common, uncommon))?;
        let question =
            |context: &str| format!("{CWE_TEMPLATE}{CWE_PREFIX}").replace("{context}", context);
        let text = format!(
            "{} {}\n{}",
            question(&example),
            numbered(&example_answer),
            question(&context)
        );
        Ok((text, answer))
    }

    /// Coded words with zeta-distributed counts; the three most frequent after the noise.
    fn fwe(&self, size: usize, rng: &mut StdRng) -> Result<(String, Vec<String>)> {
        let vocab_size = self.fwe_vocab();
        let counts = fwe_counts(size, vocab_size);
        if !fwe_ranked(&counts) {
            return Err(RulerError::FweVocabulary {
                length: self.length,
                words: vocab_size,
            }
            .into());
        }
        let mut vocab: BTreeSet<String> = BTreeSet::new();
        while vocab.len() < vocab_size {
            vocab.insert(letters(rng, FWE_WORD_LEN, b'a'));
        }
        let mut vocab: Vec<String> = vocab.into_iter().collect();
        vocab.shuffle(rng);
        vocab[0] = FWE_NOISE.to_string();
        let mut words: Vec<&str> = vocab
            .iter()
            .zip(&counts)
            .flat_map(|(w, &c)| std::iter::repeat_n(w.as_str(), c))
            .collect();
        words.shuffle(rng);
        let text = format!("{FWE_TEMPLATE}{FWE_PREFIX}").replace("{context}", &words.join(" "));
        Ok((text, vocab[1..=FWE_ASKED].to_vec()))
    }
}

/// RULER's clean-up of a prediction: trimmed, control characters as line breaks.
pub fn postprocess(pred: &str) -> String {
    /// Characters below this are control characters.
    const CONTROL_END: char = '\u{20}';
    let swapped: String = pred
        .trim()
        .chars()
        .map(|c| if c < CONTROL_END { '\n' } else { c })
        .collect();
    swapped.trim().to_string()
}

/// RULER's `string_match_all` for one sample: the share of `references` contained in `pred`,
/// case-insensitively.
pub fn string_match_all(pred: &str, references: &[String]) -> f64 {
    if references.is_empty() {
        return 0.0;
    }
    let pred = pred.to_lowercase();
    let hits = references
        .iter()
        .filter(|r| pred.contains(&r.to_lowercase()))
        .count();
    hits as f64 / references.len() as f64
}

#[cfg(test)]
#[path = "ruler_tests.rs"]
mod tests;
