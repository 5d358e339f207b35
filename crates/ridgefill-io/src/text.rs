//! Calibration text: UTF-8 files or directories of them; Brown's `word/tag` form is turned back into plain sentences.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::error::{IoError, Result};

/// Tokens [`detect_kind`] looks at: a file's opening is representative, and this bounds the cost on huge files.
const DETECT_TOKENS: usize = 10_000;
/// Below this many tokens a text is never called tagged, so a short plain note like `and/or` stays plain.
const DETECT_MIN_TOKENS: usize = 16;
/// Share of `word/tag` tokens from which a text counts as Brown: every Brown token is tagged, prose has a rare `and/or`.
const BROWN_MIN_SHARE: f64 = 0.9;
/// Brown tag characters besides lowercase letters: `-tl`/`-hl` suffixes, `np$`, `md*`, `ppss+ber` and punctuation tags.
const TAG_SYMBOLS: &str = "-$*+.,:()'`";
/// Brown's opening and closing double quotes; both become a plain `"`.
const BROWN_QUOTES: [&str; 2] = ["``", "''"];
/// Lower-cased name prefixes of files that describe a corpus rather than belong to it.
const SKIP_PREFIXES: [&str; 2] = ["readme", "license"];
/// Lower-cased extensions of packaging and code files that sit next to corpora.
const SKIP_EXTENSIONS: [&str; 3] = ["json", "md", "js"];
/// Byte-order mark some editors prepend; it is not text.
const BOM: char = '\u{feff}';

/// One calibration document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    /// The path as given, joined with the file's relative path when a directory was given.
    pub source: String,
    /// Plain text (Brown files already detagged).
    pub text: String,
}

/// How a text file is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextKind {
    /// Ordinary text, used as is.
    Plain,
    /// The Brown corpus' `word/tag` form, one sentence per line.
    BrownTagged,
}

/// Reads a UTF-8 text file (leading BOM dropped); non-UTF-8 is an error naming the file and byte offset, unless `lossy` (then U+FFFD).
pub fn read_text_file(path: &Path, lossy: bool) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| IoError::os(path, "read", e))?;
    decode_text(path, bytes, lossy)
}

/// [`read_text_file`] for bytes already in memory; `path` only names them in errors.
pub fn decode_text(path: &Path, bytes: Vec<u8>, lossy: bool) -> Result<String> {
    let mut text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) if lossy => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        Err(e) => {
            return Err(IoError::NotUtf8 {
                path: path.to_path_buf(),
                offset: e.utf8_error().valid_up_to(),
            });
        }
    };
    if text.starts_with(BOM) {
        text.drain(..BOM.len_utf8());
    }
    Ok(text)
}

/// Whether `tag` is made only of characters Brown tags use (`nn`, `np$-tl`, `ppss+ber`, `.`, ``` `` ```).
fn is_brown_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag
            .chars()
            .all(|c| c.is_ascii_lowercase() || TAG_SYMBOLS.contains(c))
}

/// Whether a whitespace-separated token is `word/tag` (the tag after the last `/`).
fn is_tagged_token(token: &str) -> bool {
    token
        .rsplit_once('/')
        .is_some_and(|(word, tag)| !word.is_empty() && is_brown_tag(tag))
}

/// Detects the Brown corpus' POS-tagged format: nearly all tokens are `word/tag` with tags like `nn`, `np$-tl`, `md*`, `ppss+ber`, `.`.
pub fn detect_kind(text: &str) -> TextKind {
    let (mut total, mut tagged) = (0usize, 0usize);
    for token in text.split_whitespace().take(DETECT_TOKENS) {
        total += 1;
        tagged += usize::from(is_tagged_token(token));
    }
    if total >= DETECT_MIN_TOKENS && tagged as f64 >= BROWN_MIN_SHARE * total as f64 {
        TextKind::BrownTagged
    } else {
        TextKind::Plain
    }
}

/// Strips `/tag` suffixes into plain text, one sentence per line, single spaces, Brown's quotes as `"` (as `scripts/make_score_text.py`).
pub fn detag_brown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut words = line
            .split_whitespace()
            .map(|token| token.rsplit_once('/').map_or(token, |(word, _)| word))
            .filter(|word| !word.is_empty())
            .map(|word| {
                if BROWN_QUOTES.contains(&word) {
                    "\""
                } else {
                    word
                }
            });
        let Some(first) = words.next() else {
            continue;
        };
        out.push_str(first);
        for word in words {
            out.push(' ');
            out.push_str(word);
        }
        out.push('\n');
    }
    out
}

/// Whether a directory entry is skipped: hidden, README*, LICENSE*, *.json, *.md, *.js.
fn is_skipped(name: &OsStr) -> bool {
    let name = name.to_string_lossy().to_lowercase();
    let extension = Path::new(&name).extension().and_then(OsStr::to_str);
    name.starts_with('.')
        || SKIP_PREFIXES.iter().any(|p| name.starts_with(p))
        || extension.is_some_and(|e| SKIP_EXTENSIONS.contains(&e))
}

/// Appends the files under `dir` to `out`, entries of each directory sorted by name.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries = std::fs::read_dir(dir)
        .map_err(|e| IoError::os(dir, "list", e))?
        .map(|entry| entry.map_err(|e| IoError::os(dir, "list", e)))
        .collect::<Result<Vec<_>>>()?;
    entries.sort_by_key(|entry| entry.file_name());
    for entry in entries {
        if is_skipped(&entry.file_name()) {
            continue;
        }
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(|e| IoError::os(&path, "stat", e))?;
        if kind.is_dir() {
            walk(&path, out)?;
        } else if kind.is_file() {
            out.push(path);
        } else if kind.is_symlink() && std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            // Linked directories are not entered, so a link cycle cannot recurse forever.
            out.push(path);
        }
    }
    Ok(())
}

/// Reads one file, detags it when it is Brown, and keeps it unless it is blank.
fn push_document(path: &Path, lossy: bool, docs: &mut Vec<Document>) -> Result<()> {
    let raw = read_text_file(path, lossy)?;
    docs.extend(document_from_text(path, raw));
    Ok(())
}

/// Detags `raw` when it is Brown; `None` when the result is blank.
pub fn document_from_text(path: &Path, raw: String) -> Option<Document> {
    let text = match detect_kind(&raw) {
        TextKind::Plain => raw,
        TextKind::BrownTagged => detag_brown(&raw),
    };
    (!text.trim().is_empty()).then(|| Document {
        source: path.display().to_string(),
        text,
    })
}

/// Files, or directories walked in sorted order (hidden, README*, LICENSE*, *.json, *.md, *.js skipped), detagged when Brown, blank ones dropped.
///
/// A path that does not exist, or yields no non-empty document, is an error naming it.
pub fn collect_documents(paths: &[PathBuf], lossy: bool) -> Result<Vec<Document>> {
    if paths.is_empty() {
        return Err(IoError::NoText {
            path: PathBuf::new(),
            reason: "no file or directory given".into(),
        });
    }
    let mut docs = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                IoError::MissingFile {
                    path: path.clone(),
                    what: "calibration text: no such file or directory".into(),
                }
            } else {
                IoError::os(path, "stat", e)
            }
        })?;
        let before = docs.len();
        let reason = if meta.is_dir() {
            let mut files = Vec::new();
            walk(path, &mut files)?;
            for file in &files {
                push_document(file, lossy, &mut docs)?;
            }
            "the directory holds no non-empty text file (hidden files, README*, LICENSE*, *.json, *.md and *.js are skipped)"
        } else {
            push_document(path, lossy, &mut docs)?;
            "the file is empty or blank"
        };
        if docs.len() == before {
            return Err(IoError::NoText {
                path: path.clone(),
                reason: reason.into(),
            });
        }
    }
    Ok(docs)
}
