//! How close one greedy answer is to another, for `eval --task answers` ([`super::answers`]):
//! whether the whole text or its first sentence is identical, and ROUGE-L F1 over words. Kept
//! apart from the run so the measures can be tested by hand on small strings.

use super::paired::Gap;

/// Characters that end a sentence when followed by whitespace or the end of the text (so the
/// dots inside `1.71.0` or `0x1.5p3` do not).
const SENTENCE_ENDS: [char; 3] = ['.', '!', '?'];

/// Lower-cased word tokens: maximal runs of letters and digits, punctuation and spacing dropped
/// (the usual ROUGE tokenisation, Unicode-aware).
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Length of the longest common subsequence of `a` and `b` (one row of the usual table).
fn lcs_len(a: &[String], b: &[String]) -> usize {
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        // `diag` is the previous row's value left of `row[j + 1]`.
        let mut diag = 0;
        for (j, y) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if x == y { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    row[b.len()]
}

/// ROUGE-L F1 of `candidate` against `reference`: the LCS of their [`words`] over each one's
/// length gives precision and recall, and F1 is their harmonic mean. Two empty texts agree
/// fully (1.0); an empty text against a non-empty one shares nothing (0.0).
pub fn rouge_l(candidate: &str, reference: &str) -> f64 {
    let (c, r) = (words(candidate), words(reference));
    if c.is_empty() && r.is_empty() {
        return 1.0;
    }
    let common = lcs_len(&c, &r) as f64;
    if common == 0.0 {
        return 0.0;
    }
    let precision = common / c.len() as f64;
    let recall = common / r.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Line breaks and runs of spaces as single spaces: the same words wrapped differently read
/// the same.
pub fn squash(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The first sentence of `text`, whitespace [squashed](squash): up to and including the first
/// `.`, `!` or `?` followed by whitespace or the end, or up to the first blank line (the end of
/// a paragraph or block), whichever comes first; the whole text when neither does (an answer
/// cut off by the token limit). A single line break does not end it: answers about wrapped
/// text are wrapped too.
pub fn first_sentence(text: &str) -> String {
    let t = text.trim_start();
    let mut end = t.len();
    let mut chars = t.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let at_end = chars.peek().is_none_or(|&(_, next)| next.is_whitespace());
        if SENTENCE_ENDS.contains(&c) && at_end {
            end = i + c.len_utf8();
            break;
        }
        let blank_line = || {
            t[i + c.len_utf8()..]
                .trim_start_matches([' ', '\t', '\r'])
                .starts_with('\n')
        };
        if c == '\n' && blank_line() {
            end = i;
            break;
        }
    }
    squash(&t[..end])
}

/// One answer set against the reference answer to the same question.
#[derive(Clone, Copy, Debug)]
pub struct Agreement {
    pub identical: bool,
    pub first_sentence: bool,
    pub rouge_l: f64,
}

impl Agreement {
    pub fn of(answer: &str, reference: &str) -> Self {
        Agreement {
            identical: answer == reference,
            first_sentence: first_sentence(answer) == first_sentence(reference),
            rouge_l: rouge_l(answer, reference),
        }
    }
}

/// One row of the report: a method's answers to every question against the reference's, and
/// what its prefills cost.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub questions: usize,
    pub identical: usize,
    pub first_sentence: usize,
    /// Each answer's ROUGE-L, in order.
    rouges: Vec<f64>,
    /// `(kind, summed ROUGE-L, questions)`, kinds in the order first met.
    kinds: Vec<(String, f64, usize)>,
    /// Wall seconds of every prefill.
    pub prefill_secs: f64,
    /// Prefill FLOPs of every prompt, and full prefill's of the same prompts.
    pub flops: f64,
    pub full_flops: f64,
    /// Wall seconds of every decode after its prefill, the restores included.
    pub decode_secs: f64,
    /// Tokens those decodes generated.
    pub decode_tokens: usize,
    /// Filled rows the decodes restored.
    pub restored: usize,
}

impl Tally {
    /// Counts one answer to a question about a document of `kind`.
    pub fn add(&mut self, kind: &str, a: Agreement, prefill_secs: f64, flops: (f64, f64)) {
        self.questions += 1;
        self.identical += usize::from(a.identical);
        self.first_sentence += usize::from(a.first_sentence);
        self.rouges.push(a.rouge_l);
        match self.kinds.iter_mut().find(|(k, ..)| k == kind) {
            Some((_, sum, n)) => {
                *sum += a.rouge_l;
                *n += 1;
            }
            None => self.kinds.push((kind.to_string(), a.rouge_l, 1)),
        }
        self.prefill_secs += prefill_secs;
        self.flops += flops.0;
        self.full_flops += flops.1;
    }

    /// Counts one answer's decode: `secs` for `tokens` tokens, `restored` rows restored.
    pub fn add_decode(&mut self, secs: f64, tokens: usize, restored: usize) {
        self.decode_secs += secs;
        self.decode_tokens += tokens;
        self.restored += restored;
    }

    /// Mean decode milliseconds per generated token.
    pub fn decode_ms_per_token(&self) -> f64 {
        1e3 * self.decode_secs / self.decode_tokens.max(1) as f64
    }

    /// Mean ROUGE-L over the questions, with the half-width of its 95% interval (`None` under
    /// two questions): at 24 questions one answer moves the mean by ~0.03.
    pub fn rouge_l(&self) -> Gap {
        Gap::mean_of(&self.rouges)
    }

    /// Mean ROUGE-L per kind of document, in the order the kinds were first met.
    pub fn per_kind(&self) -> Vec<(&str, f64)> {
        self.kinds
            .iter()
            .map(|(k, sum, n)| (k.as_str(), sum / *n as f64))
            .collect()
    }

    /// Prefill FLOPs over full prefill's, over all prompts together.
    pub fn flops_ratio(&self) -> f64 {
        self.flops / self.full_flops
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn words_are_lower_cased_alphanumeric_runs() {
        assert_eq!(
            words("Hello, World! MSRV is 1.71.0 (x_y)"),
            ["hello", "world", "msrv", "is", "1", "71", "0", "x", "y"]
        );
        assert!(words(" .,;\n").is_empty());
    }

    #[test]
    fn rouge_l_matches_hand_computed_values() {
        // LCS "the cat on mat" = 4 of 6 words each: P = R = 2/3.
        assert!(close(
            rouge_l("the cat sat on the mat", "the cat lay on a mat"),
            2.0 / 3.0
        ));
        // Case and punctuation ignored; LCS 3, P = 3/3, R = 3/5: F1 = 2·0.6/1.6 = 0.75.
        assert!(close(
            rouge_l("Twenty thousand pounds.", "He bets twenty thousand pounds!"),
            0.75
        ));
        // Order matters: LCS of "a b c d" and "d c b a" is 1 word: P = R = 1/4.
        assert!(close(rouge_l("a b c d", "d c b a"), 0.25));
        // Subsequence, not substring: "a x b y c" against "a b c": LCS 3, P = 3/5, R = 1.
        assert!(close(rouge_l("a x b y c", "a b c"), 0.75));
        assert!(close(rouge_l("Same words.", "same WORDS"), 1.0));
        assert!(close(rouge_l("", ""), 1.0));
        assert!(close(rouge_l("", "something"), 0.0));
        assert!(close(rouge_l("nothing shared", "at all"), 0.0));
    }

    #[test]
    fn first_sentence_ends_at_a_stop_before_whitespace_or_a_blank_line() {
        assert_eq!(
            first_sentence("  The MSRV is 1.71.0. It was 1.65 before."),
            "The MSRV is 1.71.0."
        );
        assert_eq!(first_sentence("Yes! And more"), "Yes!");
        assert_eq!(first_sentence("Why? Because."), "Why?");
        // Wrapped lines are one sentence; a blank line ends a block.
        assert_eq!(
            first_sentence("which is a\npart of it. More"),
            "which is a part of it."
        );
        assert_eq!(first_sentence("a list:\n- one\n \n- two"), "a list: - one");
        assert_eq!(
            first_sentence("```rust\nfn f() {}\n```\n\nThat"),
            "```rust fn f() {} ```"
        );
        assert_eq!(
            first_sentence("cut off mid sentence "),
            "cut off mid sentence"
        );
        assert_eq!(first_sentence("ends with a dot."), "ends with a dot.");
        assert_eq!(first_sentence(""), "");
        assert_eq!(
            first_sentence("\n\nafter blank lines. x"),
            "after blank lines."
        );
    }

    #[test]
    fn agreement_and_tally_count_per_kind() {
        let same = Agreement::of("One. Two.", "One. Two.");
        assert!(same.identical && same.first_sentence && close(same.rouge_l, 1.0));
        let first = Agreement::of("One. Three.", "One. Two.");
        assert!(!first.identical && first.first_sentence);
        assert!(close(first.rouge_l, 0.5));
        let mut t = Tally::default();
        t.add("prose", same, 2.0, (4.0, 8.0));
        t.add("code", first, 1.0, (2.0, 4.0));
        t.add("prose", first, 1.0, (2.0, 4.0));
        assert_eq!((t.questions, t.identical, t.first_sentence), (3, 1, 3));
        // ROUGE-L 1, 0.5, 0.5: sd 0.289, se 0.167, t(2) 4.303.
        let r = t.rouge_l();
        assert!(close(r.mean, 2.0 / 3.0));
        assert!((r.half.unwrap() - 4.303 * (1.0f64 / 12.0).sqrt() / 3f64.sqrt()).abs() < 1e-9);
        assert_eq!(t.per_kind(), [("prose", 0.75), ("code", 0.5)]);
        assert!(close(t.flops_ratio(), 0.5));
        assert!(close(t.prefill_secs, 4.0));
    }
}
