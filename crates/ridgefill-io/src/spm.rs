//! SentencePiece BPE (GGUF `tokenizer.ggml.model = "llama"`: Llama 2, Mistral v0.1, Gemma 3, ...),
//! written by hand rather than built as a `tokenizers` BPE model.
//!
//! Why not `tokenizers`: its BPE merges *pairs* in the order of a merge list, while SentencePiece
//! merges the adjacent pair whose *concatenation* is the vocabulary piece with the highest score,
//! the leftmost such pair on ties. A merge list derived from the scores (what transformers does for
//! GGUF) gives every split of one piece its own rank, so when two overlapping pairs form the same
//! piece (`[a][aa][a]`: both pairs make `aaa`) `tokenizers` takes the better-ranked split, not the
//! leftmost one. It also matches user-defined pieces differently: SentencePiece freezes them
//! (longest match first, so 40 spaces are the 31-space piece then the 9-space one, as llama.cpp
//! does) while transformers' rebuilt tokenizer merges them like any piece (16 + 24 spaces). And the
//! derived list has millions of merges for a 262k vocabulary, rebuilt on every load. The encoder
//! below is SentencePiece's `bpe_model.cc` algorithm: a priority queue of adjacent pairs keyed by
//! (piece score, leftmost), unused pieces re-split at the end, byte fallback for what is left.
//!
//! Around it, llama.cpp's handling of the text: control tokens written in the text (`<bos>`,
//! `<start_of_turn>`, ...) are always parsed as single tokens (leftmost, longest first); each text
//! fragment gets spaces escaped as `▁` (and a leading `▁` when `add_space_prefix` is set and the
//! fragment starts the text or follows a control token); user-defined pieces are then cut out of
//! the escaped text (leftmost, longest first, as SentencePiece's prefix matcher does; llama.cpp's
//! converter spells user-defined `▁` runs with spaces, so they are compared escaped) and the rest
//! is merged. Decoding turns `▁` into spaces and byte tokens into bytes.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece / llama.cpp piece types (`tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PieceKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl PieceKind {
    /// From llama.cpp's `enum llama_token_type` (0 = undefined is read as normal, as llama.cpp does).
    pub(crate) fn from_gguf(t: i64) -> Option<PieceKind> {
        Some(match t {
            0 | 1 => PieceKind::Normal,
            2 => PieceKind::Unknown,
            3 => PieceKind::Control,
            4 => PieceKind::UserDefined,
            5 => PieceKind::Unused,
            6 => PieceKind::Byte,
            _ => return None,
        })
    }

    /// Pieces BPE may merge into (SentencePiece's `pieces_` minus user-defined ones, which are
    /// cut out of the text before merging and so can never be formed by a merge).
    fn mergeable(self) -> bool {
        matches!(self, PieceKind::Normal | PieceKind::Unused)
    }
}

/// The whitespace marker SentencePiece escapes spaces to.
pub(crate) const SPACE_MARK: char = '\u{2581}';

/// One trie node: children sorted by byte (byte, node index), and the id of a token ending here.
type TrieNode = (Vec<(u8, u32)>, Option<u32>);

/// A byte trie for leftmost-longest matching of a small set of token texts.
#[derive(Clone, Debug, Default)]
struct Trie {
    /// Node 0 is the root.
    nodes: Vec<TrieNode>,
}

impl Trie {
    fn new() -> Trie {
        Trie {
            nodes: vec![(Vec::new(), None)],
        }
    }

    fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    /// Adds `text` (non-empty); the first id added for a text wins.
    fn insert(&mut self, text: &str, id: u32) {
        let mut node = 0usize;
        for &b in text.as_bytes() {
            let children = &self.nodes[node].0;
            node = match children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => children[i].1 as usize,
                Err(i) => {
                    let next = self.nodes.len();
                    self.nodes.push((Vec::new(), None));
                    self.nodes[node].0.insert(i, (b, next as u32));
                    next
                }
            };
        }
        if self.nodes[node].1.is_none() {
            self.nodes[node].1 = Some(id);
        }
    }

    /// Longest token starting at the beginning of `s`: (byte length, id).
    fn longest_prefix(&self, s: &[u8]) -> Option<(usize, u32)> {
        let mut node = 0usize;
        let mut best = None;
        for (i, &b) in s.iter().enumerate() {
            let children = &self.nodes[node].0;
            match children.binary_search_by_key(&b, |c| c.0) {
                Ok(j) => node = children[j].1 as usize,
                Err(_) => break,
            }
            if let Some(id) = self.nodes[node].1 {
                best = Some((i + 1, id));
            }
        }
        best
    }

    /// Splits `text` into plain stretches and matched tokens, leftmost-longest.
    fn split<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let mut out = Vec::new();
        if self.is_empty() {
            if !text.is_empty() {
                out.push(Fragment::Text(text));
            }
            return out;
        }
        let bytes = text.as_bytes();
        let first: Vec<u8> = self.nodes[0].0.iter().map(|c| c.0).collect();
        let (mut start, mut i) = (0usize, 0usize);
        while i < bytes.len() {
            if first.binary_search(&bytes[i]).is_ok()
                && let Some((len, id)) = self.longest_prefix(&bytes[i..])
            {
                if start < i {
                    out.push(Fragment::Text(&text[start..i]));
                }
                out.push(Fragment::Token(id));
                i += len;
                start = i;
            } else {
                i += 1;
            }
        }
        if start < bytes.len() {
            out.push(Fragment::Text(&text[start..]));
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// What [`SpmModel::new`] needs from the GGUF metadata.
#[derive(Clone, Debug)]
pub(crate) struct SpmSpec {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub kinds: Vec<PieceKind>,
    pub unk_id: Option<u32>,
    pub add_space_prefix: bool,
}

/// A SentencePiece BPE model.
#[derive(Clone, Debug)]
pub(crate) struct SpmModel {
    pieces: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<PieceKind>,
    /// Token text (as stored) to id; the first id of a duplicated text wins.
    vocab: HashMap<String, u32>,
    /// `<0xNN>` byte tokens, when all 256 exist.
    byte_ids: Option<Box<[u32; 256]>>,
    unk_id: Option<u32>,
    /// Control and unknown tokens, matched on the raw text.
    control: Trie,
    /// User-defined pieces with spaces escaped, matched on the escaped text.
    user: Trie,
    add_space_prefix: bool,
}

/// Why a text cannot be encoded.
#[derive(Debug)]
pub(crate) struct NoFallback(pub String);

/// A candidate merge of two adjacent symbols.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged piece, to notice stale candidates.
    len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// One symbol of the text being merged: a byte range, linked to its live neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    end: usize,
    prev: Option<usize>,
    next: Option<usize>,
    alive: bool,
}

impl SpmModel {
    pub(crate) fn new(spec: SpmSpec) -> SpmModel {
        let SpmSpec {
            tokens,
            scores,
            kinds,
            unk_id,
            add_space_prefix,
        } = spec;
        let mut vocab = HashMap::with_capacity(tokens.len());
        let mut control = Trie::new();
        let mut user = Trie::new();
        let mut bytes = [u32::MAX; 256];
        for (id, (t, &kind)) in tokens.iter().zip(&kinds).enumerate() {
            let id = id as u32;
            vocab.entry(t.clone()).or_insert(id);
            if t.is_empty() {
                continue;
            }
            match kind {
                PieceKind::Control | PieceKind::Unknown => control.insert(t, id),
                PieceKind::UserDefined => user.insert(&escape(t), id),
                PieceKind::Byte => {
                    if let Some(b) = parse_byte_token(t)
                        && bytes[b as usize] == u32::MAX
                    {
                        bytes[b as usize] = id;
                    }
                }
                _ => {}
            }
        }
        let byte_ids = (!bytes.contains(&u32::MAX)).then(|| Box::new(bytes));
        SpmModel {
            pieces: tokens,
            scores,
            kinds,
            vocab,
            byte_ids,
            unk_id,
            control,
            user,
            add_space_prefix,
        }
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub(crate) fn token_to_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    pub(crate) fn id_to_token(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Ids of every control token (for the end-of-turn list).
    pub(crate) fn control_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == PieceKind::Control)
            .map(|(i, _)| i as u32)
    }

    /// Encodes `text` (no BOS/EOS); control tokens in the text become single ids.
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, NoFallback> {
        let mut out = Vec::new();
        let mut after_control = true;
        for frag in self.control.split(text) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    after_control = true;
                }
                Fragment::Text(t) => {
                    let mut escaped = String::with_capacity(t.len() + SPACE_MARK.len_utf8());
                    if self.add_space_prefix && after_control {
                        escaped.push(SPACE_MARK);
                    }
                    escaped.push_str(&escape(t));
                    for part in self.user.split(&escaped) {
                        match part {
                            Fragment::Token(id) => out.push(id),
                            Fragment::Text(p) => self.bpe(p, &mut out)?,
                        }
                    }
                    after_control = false;
                }
            }
        }
        Ok(out)
    }

    /// A mergeable piece's id.
    fn piece_id(&self, piece: &str) -> Option<u32> {
        let id = *self.vocab.get(piece)?;
        self.kinds[id as usize].mergeable().then_some(id)
    }

    /// SentencePiece BPE on one escaped stretch of text without user-defined pieces.
    fn bpe(&self, s: &str, out: &mut Vec<u32>) -> Result<(), NoFallback> {
        let mut syms: Vec<Symbol> = Vec::with_capacity(s.len());
        for (start, c) in s.char_indices() {
            let n = syms.len();
            syms.push(Symbol {
                start,
                end: start + c.len_utf8(),
                prev: n.checked_sub(1),
                next: None,
                alive: true,
            });
            if n > 0 {
                syms[n - 1].next = Some(n);
            }
        }
        // Unused pieces formed by a merge, and the split point that formed them.
        let mut rev_merge: HashMap<(usize, usize), usize> = HashMap::new();
        let mut agenda = BinaryHeap::new();
        let try_pair = |syms: &[Symbol],
                        agenda: &mut BinaryHeap<Candidate>,
                        rev_merge: &mut HashMap<(usize, usize), usize>,
                        left: Option<usize>,
                        right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else {
                return;
            };
            let (a, b) = (syms[l], syms[r]);
            let Some(id) = self.piece_id(&s[a.start..b.end]) else {
                return;
            };
            agenda.push(Candidate {
                score: self.scores[id as usize],
                left: l,
                right: r,
                len: b.end - a.start,
            });
            if self.kinds[id as usize] == PieceKind::Unused {
                rev_merge.insert((a.start, b.end), a.end);
            }
        };
        for i in 1..syms.len() {
            try_pair(&syms, &mut agenda, &mut rev_merge, Some(i - 1), Some(i));
        }
        while let Some(c) = agenda.pop() {
            let (l, r) = (syms[c.left], syms[c.right]);
            if !l.alive || !r.alive || l.next != Some(c.right) || r.end - l.start != c.len {
                continue;
            }
            syms[c.left].end = r.end;
            syms[c.left].next = r.next;
            syms[c.right].alive = false;
            if let Some(n) = r.next {
                syms[n].prev = Some(c.left);
            }
            try_pair(&syms, &mut agenda, &mut rev_merge, l.prev, Some(c.left));
            try_pair(&syms, &mut agenda, &mut rev_merge, Some(c.left), r.next);
        }
        let mut cur = (!syms.is_empty()).then_some(0);
        while let Some(i) = cur {
            self.resegment(s, syms[i].start, syms[i].end, &rev_merge, out)?;
            cur = syms[i].next;
        }
        Ok(())
    }

    /// Emits `s[start..end]`: its id, unused pieces split back into what formed them, or bytes.
    fn resegment(
        &self,
        s: &str,
        start: usize,
        end: usize,
        rev_merge: &HashMap<(usize, usize), usize>,
        out: &mut Vec<u32>,
    ) -> Result<(), NoFallback> {
        let mut stack = vec![(start, end)];
        while let Some((a, b)) = stack.pop() {
            let piece = &s[a..b];
            match self.piece_id(piece) {
                Some(id) if self.kinds[id as usize] == PieceKind::Unused => {
                    match rev_merge.get(&(a, b)) {
                        Some(&mid) => {
                            stack.push((mid, b));
                            stack.push((a, mid));
                        }
                        None => out.push(id),
                    }
                }
                Some(id) => out.push(id),
                None => match (&self.byte_ids, self.unk_id) {
                    (Some(bytes), _) => out.extend(piece.bytes().map(|x| bytes[x as usize])),
                    (None, Some(unk)) => out.push(unk),
                    (None, None) => {
                        return Err(NoFallback(format!(
                            "{piece:?} is not in the vocabulary, which has neither byte tokens nor an unknown token"
                        )));
                    }
                },
            }
        }
        Ok(())
    }

    /// The bytes one id stands for; control and unknown tokens only when `!skip_special`.
    pub(crate) fn token_bytes(&self, id: u32, skip_special: bool, out: &mut Vec<u8>) -> bool {
        let Some(piece) = self.pieces.get(id as usize) else {
            return false;
        };
        match self.kinds[id as usize] {
            PieceKind::Byte => match parse_byte_token(piece) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(piece.as_bytes()),
            },
            PieceKind::Control | PieceKind::Unknown if skip_special => {}
            _ => {
                let mut buf = [0u8; 4];
                for c in piece.chars() {
                    let c = if c == SPACE_MARK { ' ' } else { c };
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        true
    }

    /// Decodes ids to text (invalid UTF-8 from byte tokens becomes U+FFFD).
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, u32> {
        let mut bytes = Vec::new();
        for &id in ids {
            if !self.token_bytes(id, skip_special, &mut bytes) {
                return Err(id);
            }
        }
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        // The space `add_space_prefix` put in front of the text is not part of it.
        if self.add_space_prefix && text.starts_with(' ') {
            text.remove(0);
        }
        Ok(text)
    }
}

/// SentencePiece's whitespace escaping: every space becomes `▁`.
fn escape(t: &str) -> String {
    t.replace(' ', "\u{2581}")
}

/// `<0xNN>` → NN.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Incremental decoder: emits text only once its UTF-8 is complete.
#[derive(Debug, Default)]
pub(crate) struct SpmStream {
    pending: Vec<u8>,
}

impl SpmStream {
    /// Adds one id's bytes; returns the newly completed text, if any.
    pub(crate) fn push(
        &mut self,
        model: &SpmModel,
        id: u32,
        skip_special: bool,
    ) -> Result<Option<String>, u32> {
        if !model.token_bytes(id, skip_special, &mut self.pending) {
            return Err(id);
        }
        let mut text = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    text.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    text.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..good);
                            break;
                        }
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
        Ok((!text.is_empty()).then_some(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small SentencePiece vocabulary: control tokens, bytes, user-defined space runs, merges.
    fn model(add_space_prefix: bool, extra: &[(&str, f32, PieceKind)]) -> SpmModel {
        let mut tokens = vec!["<pad>".to_string(), "<eos>".into(), "<bos>".into()];
        let mut kinds = vec![PieceKind::Control; 3];
        tokens.push("<unk>".into());
        kinds.push(PieceKind::Unknown);
        tokens.push("<start_of_turn>".into());
        kinds.push(PieceKind::Control);
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            kinds.push(PieceKind::Byte);
        }
        for n in 2..=4 {
            tokens.push(" ".repeat(n));
            kinds.push(PieceKind::UserDefined);
        }
        tokens.push("<b>".into());
        kinds.push(PieceKind::UserDefined);
        let mut scores = vec![0.0; tokens.len()];
        // Normal pieces: the score is minus the rank, as in real models.
        let normal = [
            "▁", "a", "b", "c", "h", "e", "l", "o", "t", "▁t", "he", "▁the", "ll", "llo", "▁a",
            "ab", "bc", "abc", "-", "--", "----",
        ];
        for (rank, p) in normal.iter().enumerate() {
            tokens.push(p.to_string());
            kinds.push(PieceKind::Normal);
            scores.push(-(rank as f32));
        }
        for &(p, s, k) in extra {
            tokens.push(p.to_string());
            kinds.push(k);
            scores.push(s);
        }
        SpmModel::new(SpmSpec {
            tokens,
            scores,
            kinds,
            unk_id: Some(3),
            add_space_prefix,
        })
    }

    fn pieces(m: &SpmModel, text: &str) -> Vec<String> {
        m.encode(text)
            .unwrap()
            .into_iter()
            .map(|id| m.id_to_token(id).unwrap().to_string())
            .collect()
    }

    #[test]
    fn merges_by_score_and_escapes_spaces() {
        let m = model(false, &[]);
        assert_eq!(pieces(&m, "the hello"), ["t", "he", "▁", "he", "llo"]);
        assert_eq!(pieces(&m, " the"), ["▁the"]);
        assert_eq!(pieces(&m, "abc"), ["abc"]);
        // "----" is a piece but "---" is not: pairs merge leftmost first.
        assert_eq!(pieces(&m, "-----"), ["----", "-"]);
        let ids = m.encode("the hello").unwrap();
        assert_eq!(m.decode(&ids, false).unwrap(), "the hello");
    }

    #[test]
    fn equal_scores_merge_leftmost() {
        // "xy" and "yz" have the same score: in "xyz" the leftmost pair wins.
        let m = model(
            false,
            &[
                ("x", -100.0, PieceKind::Normal),
                ("y", -101.0, PieceKind::Normal),
                ("z", -102.0, PieceKind::Normal),
                ("xy", -50.0, PieceKind::Normal),
                ("yz", -50.0, PieceKind::Normal),
            ],
        );
        assert_eq!(pieces(&m, "xyz"), ["xy", "z"]);
    }

    #[test]
    fn user_defined_pieces_are_frozen_longest_first() {
        let m = model(false, &[]);
        // 6 spaces: the 4-space piece, then the 2-space one; never merged with neighbours.
        assert_eq!(pieces(&m, "a      b"), ["a", "    ", "  ", "b"]);
        assert_eq!(pieces(&m, "a  the"), ["a", "  ", "t", "he"]);
        // A literal "▁" counts as a space, as in SentencePiece.
        assert_eq!(pieces(&m, "a▁ b"), ["a", "  ", "b"]);
        assert_eq!(pieces(&m, "<b>ab"), ["<b>", "ab"]);
        let ids = m.encode("a      b").unwrap();
        assert_eq!(m.decode(&ids, false).unwrap(), "a      b");
    }

    #[test]
    fn control_tokens_in_text_are_single_tokens() {
        let m = model(false, &[]);
        let ids = m.encode("<bos><start_of_turn>the<eos>").unwrap();
        assert_eq!(ids[0], 2);
        assert_eq!(ids[1], 4);
        assert_eq!(*ids.last().unwrap(), 1);
        assert_eq!(
            m.decode(&ids, false).unwrap(),
            "<bos><start_of_turn>the<eos>"
        );
        assert_eq!(m.decode(&ids, true).unwrap(), "the");
        // An unterminated control-token look-alike is plain text.
        assert_eq!(pieces(&m, "<bo"), ["<0x3C>", "b", "o"]);
    }

    #[test]
    fn byte_fallback_and_decoding() {
        let m = model(false, &[]);
        let ids = m.encode("é\u{7}").unwrap();
        assert_eq!(
            ids.iter()
                .map(|&i| m.id_to_token(i).unwrap())
                .collect::<Vec<_>>(),
            ["<0xC3>", "<0xA9>", "<0x07>"]
        );
        assert_eq!(m.decode(&ids, false).unwrap(), "é\u{7}");
        // Streaming holds back an incomplete character.
        let mut s = SpmStream::default();
        assert_eq!(s.push(&m, ids[0], true).unwrap(), None);
        assert_eq!(s.push(&m, ids[1], true).unwrap().as_deref(), Some("é"));
        assert_eq!(s.push(&m, ids[2], true).unwrap().as_deref(), Some("\u{7}"));
        // A stray continuation byte becomes U+FFFD instead of blocking the stream.
        assert_eq!(
            s.push(&m, ids[1], true).unwrap().as_deref(),
            Some("\u{FFFD}")
        );
        assert!(m.decode(&[u32::MAX], false).is_err());
    }

    #[test]
    fn unused_pieces_are_resegmented() {
        // An unused piece may be formed by a merge, but is split back if it is what remains.
        let mut m = model(false, &[]);
        let he = m.token_to_id("he").unwrap();
        m.kinds[he as usize] = PieceKind::Unused;
        assert_eq!(pieces(&m, "he"), ["h", "e"]);
        // Still usable as a step towards a normal piece.
        assert_eq!(pieces(&m, " the"), ["▁the"]);
    }

    #[test]
    fn space_prefix_after_control_tokens() {
        let m = model(true, &[]);
        assert_eq!(pieces(&m, "the"), ["▁the"]);
        assert_eq!(pieces(&m, "<bos>the"), ["<bos>", "▁the"]);
        let ids = m.encode("the").unwrap();
        assert_eq!(m.decode(&ids, false).unwrap(), "the");
    }

    #[test]
    fn no_fallback_is_an_error() {
        let m = SpmModel::new(SpmSpec {
            tokens: vec!["a".into()],
            scores: vec![0.0],
            kinds: vec![PieceKind::Normal],
            unk_id: None,
            add_space_prefix: false,
        });
        assert_eq!(m.encode("aa").unwrap(), [0, 0]);
        assert!(m.encode("ab").is_err());
    }
}
