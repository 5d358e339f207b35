//! Tests of [`super`]: samples are deterministic, fill their length, and their answers can be
//! derived from the prompt; the scorer is RULER's.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::commands::eval::ruler_data::{Essay, Lexicon};

/// A word-level stand-in for a tokenizer: BOS, then one token per word and per punctuation mark.
fn encode(text: &str) -> Result<Vec<u32>> {
    let words = text.split_whitespace().count();
    let marks = text.chars().filter(char::is_ascii_punctuation).count();
    Ok(vec![0; 1 + words + marks])
}

/// A distinct lowercase word for each `i`.
fn word(mut i: usize) -> String {
    let mut w = String::from("w");
    for _ in 0..4 {
        w.push(char::from(b'a' + (i % 26) as u8));
        i /= 26;
    }
    w
}

fn lexicon() -> Lexicon {
    let tags = ["nn", "jj", "vb"];
    let tagged: Vec<String> = (0..1200)
        .flat_map(|i| std::iter::repeat_n(format!("{}/{}", word(i), tags[i % 3]), 3))
        .collect();
    Lexicon::from_tagged(&tagged.join(" "), "test").unwrap()
}

fn essay() -> Essay {
    let text: Vec<String> = (0..3000)
        .map(|i| format!("The {} met the {} by the river.", word(i), word(i + 7)))
        .collect();
    Essay::from_text(&text.join(" "), "test").unwrap()
}

const LENGTHS: [usize; 2] = [1024, 2048];
/// Prompts land within this share of their length below it (one haystack unit at most).
const TOLERANCE: f64 = 0.05;

#[test]
fn samples_are_deterministic_and_fill_their_length() {
    let (lex, essay) = (lexicon(), essay());
    let m = Material {
        lexicon: &lex,
        essay: Some(&essay),
    };
    for task in RulerTask::ALL {
        for length in LENGTHS {
            let a = samples(task, length, 3, 42, &m, &encode).unwrap();
            let b = samples(task, length, 3, 42, &m, &encode).unwrap();
            let c = samples(task, length, 3, 43, &m, &encode).unwrap();
            assert_eq!(a.len(), 3);
            for ((x, y), z) in a.iter().zip(&b).zip(&c) {
                assert_eq!(x.text, y.text, "{}", task.name());
                assert_ne!(x.text, z.text, "{}", task.name());
                let used = x.prompt.len() + task.max_new();
                assert!(used <= length, "{} {length}: {used}", task.name());
                let short = (length - used) as f64 / length as f64;
                assert!(short < TOLERANCE, "{} {length}: {used}", task.name());
                assert_eq!(x.prompt, encode(&x.text).unwrap());
            }
            assert_ne!(a[0].text, a[1].text, "{}", task.name());
        }
    }
}

/// The key of the needle holding `value`: `... for KEY is: VALUE.`
fn key_of(text: &str, value: &str) -> String {
    let at = text.find(&format!(" is: {value}.")).expect("the needle");
    let start = text[..at].rfind(" for ").expect("the key") + " for ".len();
    text[start..at].to_string()
}

#[test]
fn niah_plants_each_answer_once_and_asks_for_its_key() {
    let (lex, essay) = (lexicon(), essay());
    let m = Material {
        lexicon: &lex,
        essay: Some(&essay),
    };
    for task in RulerTask::ALL.into_iter().filter(|t| t.niah().is_some()) {
        let n = task.niah().unwrap();
        for s in samples(task, 2048, 4, 7, &m, &encode).unwrap() {
            assert_eq!(s.references.len(), n.values * n.queries, "{}", task.name());
            let (question, prefix) = s.text.rsplit_once('?').unwrap();
            for r in &s.references {
                assert_eq!(
                    s.text.matches(r.as_str()).count(),
                    1,
                    "{}: {r}",
                    task.name()
                );
                let key = key_of(&s.text, r);
                assert!(prefix.contains(&key), "{}: {key} in {prefix}", task.name());
                assert!(question.ends_with("mentioned in the provided text"));
            }
            let single = n.values * n.queries == 1;
            let opening = if single {
                "A special magic "
            } else {
                "Some special magic "
            };
            assert!(s.text.starts_with(opening), "{}", task.name());
            assert_eq!(prefix.ends_with(" is"), single, "{}: {prefix}", task.name());
            let needles = s.text.matches("One of the special magic").count();
            if n.haystack == Haystack::Needle {
                assert_eq!(needles, s.size + 1, "{}", task.name());
            } else {
                assert_eq!(needles, n.keys.max(n.queries) * n.values, "{}", task.name());
            }
        }
    }
}

#[test]
fn vt_chain_resolves_to_the_answer() {
    let lex = lexicon();
    let m = Material {
        lexicon: &lex,
        essay: None,
    };
    for s in samples(RulerTask::Vt, 2048, 3, 5, &m, &encode).unwrap() {
        // The last question; the in-context example before it has its own chain.
        let main = s.text.rsplit("Memorize and track").next().unwrap();
        let value = main
            .split("assigned the value ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .unwrap();
        let mut assigned: BTreeSet<String> = BTreeSet::new();
        let lines: Vec<Vec<&str>> = main
            .lines()
            .filter(|l| l.starts_with("VAR "))
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(lines.len(), VT_HOPS + 1);
        loop {
            let before = assigned.len();
            for l in &lines {
                let direct = l.len() == 4 && l[3] == value;
                let hop = l.len() == 5 && assigned.contains(l[4]);
                if direct || hop {
                    assigned.insert(l[1].to_string());
                }
            }
            if assigned.len() == before {
                break;
            }
        }
        let refs: BTreeSet<String> = s.references.iter().cloned().collect();
        assert_eq!(assigned, refs);
        assert!(
            s.text
                .contains(&format!("{} variables are assigned", VT_HOPS + 1))
        );
    }
}

/// Word counts of the text between `from` (its last occurrence) and the next `to`, list numbers
/// (`12.`) left out.
fn counts(text: &str, from: &str, to: &str) -> BTreeMap<String, usize> {
    let tail = text.rsplit(from).next().unwrap();
    let body = tail.split(to).next().unwrap();
    let mut out = BTreeMap::new();
    for w in body.split_whitespace() {
        let numbered = w.ends_with('.') && w[..w.len() - 1].bytes().all(|b| b.is_ascii_digit());
        if !numbered {
            *out.entry(w.to_string()).or_default() += 1;
        }
    }
    out
}

/// The words of `counts` with more occurrences than any other word has, if the top `n` are
/// strictly separated from the rest.
fn top(counts: &BTreeMap<String, usize>, n: usize) -> BTreeSet<String> {
    let mut by: Vec<(&String, &usize)> = counts.iter().collect();
    by.sort_by(|a, b| b.1.cmp(a.1));
    assert!(by[n - 1].1 > by[n].1, "{by:?}");
    by[..n].iter().map(|(w, _)| (*w).clone()).collect()
}

#[test]
fn cwe_and_fwe_answers_are_the_most_frequent_words() {
    let lex = lexicon();
    let m = Material {
        lexicon: &lex,
        essay: None,
    };
    for length in [2048, CWE_LONG] {
        for s in samples(RulerTask::Cwe, length, 2, 3, &m, &encode).unwrap() {
            let c = counts(&s.text, "appear most often.\n", "\nQuestion:");
            let refs: BTreeSet<String> = s.references.iter().cloned().collect();
            assert_eq!(refs.len(), CWE_COMMON);
            assert_eq!(top(&c, CWE_COMMON), refs);
        }
    }
    for s in samples(RulerTask::Fwe, 2048, 2, 3, &m, &encode).unwrap() {
        let mut c = counts(&s.text, "coded words. ", "\nQuestion:");
        assert!(c.remove(FWE_NOISE).is_some());
        let refs: BTreeSet<String> = s.references.iter().cloned().collect();
        assert_eq!(top(&c, FWE_ASKED), refs);
    }
}

#[test]
fn impossible_lengths_and_missing_essays_are_named() {
    let lex = lexicon();
    let m = Material {
        lexicon: &lex,
        essay: None,
    };
    let err = |task, length| {
        samples(task, length, 1, 1, &m, &encode)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(err(RulerTask::NiahSingle1, 150).contains("raise --lengths"));
    assert!(err(RulerTask::Fwe, 200).contains("raise --lengths"));
    assert!(err(RulerTask::NiahSingle2, 1024).contains("essay"));
}

#[test]
fn scoring_is_rulers_string_match_all() {
    let refs = |r: &[&str]| r.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        string_match_all("are 1234567 and 7654321.", &refs(&["1234567", "7654321"])),
        1.0
    );
    assert_eq!(
        string_match_all("is 1234567", &refs(&["1234567", "7654321"])),
        0.5
    );
    assert_eq!(string_match_all("ABC-def", &refs(&["abc-DEF"])), 1.0);
    assert_eq!(string_match_all("anything", &[]), 0.0);
    assert_eq!(postprocess("  a\u{1}b \n"), "a\nb");
}
