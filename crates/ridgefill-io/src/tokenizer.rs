//! Tokenizer wrapper: HF `tokenizer.json`, byte-level BPE rebuilt from GGUF metadata, or
//! SentencePiece BPE from GGUF metadata (see [`crate::spm`] for why that one is hand-written).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{Template, TemplateProcessing};
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    SplitDelimiterBehavior,
};

use crate::error::{IoError, Result};
use crate::gguf::GgufFile;
use crate::spm::{PieceKind, SpmModel, SpmSpec, SpmStream};

/// GGUF keys of the tokenizer.
pub const KEY_MODEL: &str = "tokenizer.ggml.model";
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// Vocabulary arrays the tokenizer copies into its own tables: a loaded checkpoint drops them
/// from the GGUF metadata rather than hold ~6 MB twice.
pub const VOCAB_KEYS: &[&str] = &[KEY_TOKENS, KEY_MERGES, KEY_SCORES, KEY_TOKEN_TYPE];
pub const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
pub const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
pub const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
pub const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// llama.cpp token types (`enum llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Tokenizer models we can rebuild from GGUF.
const SUPPORTED_MODELS: &str = "\"gpt2\" (byte-level BPE), \"llama\" (SentencePiece BPE)";
/// Pre-tokenizer names (`tokenizer.ggml.pre`) we can rebuild.
const SUPPORTED_PRE: &str =
    "\"default\", \"gpt2\", \"smollm\", \"llama-bpe\", \"llama3\", \"qwen2\"";

/// Llama 3 split regex (from its HF tokenizer.json).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 split regex (Llama 3's with single digits).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts that end a turn in common chat formats (llama.cpp's end-of-generation list).
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
];

/// The encoder behind a [`Tokenizer`].
#[derive(Clone)]
enum Backend {
    /// HF `tokenizers` (tokenizer.json, or byte-level BPE rebuilt from GGUF).
    Hf(Box<tokenizers::Tokenizer>),
    /// SentencePiece BPE from GGUF (shared: the vocabulary can be large).
    Spm(Arc<SpmModel>),
}

/// A text tokenizer plus the special ids a generator needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Backend,
    path: PathBuf,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

/// Special-token settings that come from files other than `tokenizer.json`.
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    /// BOS token text (from tokenizer_config.json) or id (from config.json).
    pub bos: Option<String>,
    pub bos_id: Option<u32>,
    /// EOS token texts and ids from tokenizer_config.json / config.json / generation_config.json.
    pub eos: Vec<String>,
    pub eos_ids: Vec<u32>,
}

type InnerDecodeStream<'a> = tokenizers::DecodeStream<
    'a,
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

enum StreamInner<'a> {
    Hf(Box<InnerDecodeStream<'a>>),
    Spm {
        model: &'a SpmModel,
        state: SpmStream,
        skip_special: bool,
    },
}

/// Incremental detokeniser that only emits complete UTF-8 text (HF `DecodeStream`).
pub struct StreamDecoder<'a> {
    inner: StreamInner<'a>,
    path: &'a Path,
}

impl StreamDecoder<'_> {
    /// Feeds one id; returns newly completed text, or `None` while a character is incomplete.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let fail = |message: String| IoError::Tokenizer {
            path: self.path.to_path_buf(),
            what: format!("stream decode of id {id}"),
            message,
        };
        match &mut self.inner {
            StreamInner::Hf(s) => s.step(id).map_err(|e| fail(e.to_string())),
            StreamInner::Spm {
                model,
                state,
                skip_special,
            } => state
                .push(model, id, *skip_special)
                .map_err(|_| fail(out_of_range(id, model.vocab_size()))),
        }
    }
}

fn out_of_range(id: u32, vocab: usize) -> String {
    format!("id {id} is out of range: the vocabulary has {vocab} tokens")
}

impl Tokenizer {
    /// Loads a HF `tokenizer.json` on its own (EOS ids only from known end-of-turn tokens).
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        Self::from_hf_file(path, &SpecialTokens::default())
    }

    /// Loads a HF `tokenizer.json`; special ids come from `special` and the tokenizer's own added tokens.
    pub fn from_hf_file(path: &Path, special: &SpecialTokens) -> Result<Tokenizer> {
        if !path.is_file() {
            return Err(IoError::MissingFile {
                path: path.to_path_buf(),
                what: "tokenizer (tokenizer.json)".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| IoError::Tokenizer {
            path: path.to_path_buf(),
            what: "load".into(),
            message: e.to_string(),
        })?;
        let bos_id = special
            .bos
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or(special.bos_id);
        let mut eos_ids = Vec::new();
        for id in special
            .eos_ids
            .iter()
            .copied()
            .chain(special.eos.iter().filter_map(|t| inner.token_to_id(t)))
        {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let mut tok = Tokenizer {
            inner: Backend::Hf(Box::new(inner)),
            path: path.to_path_buf(),
            bos_id,
            eos_ids,
            add_bos: false,
        };
        tok.add_end_of_turn_tokens();
        // HF adds BOS through the post-processor; detect it so add_bos() reports the truth.
        tok.add_bos = match (tok.bos_id, tok.encode("", true)) {
            (Some(bos), Ok(ids)) => ids.first() == Some(&bos),
            _ => false,
        };
        Ok(tok)
    }

    /// Rebuilds the tokenizer described by GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let path = g.path();
        let model = g.get_str(KEY_MODEL)?;
        match model {
            "gpt2" => {}
            "llama" => return Self::from_gguf_spm(g),
            _ => {
                return Err(IoError::UnsupportedTokenizer {
                    path: path.to_path_buf(),
                    field: KEY_MODEL.into(),
                    kind: model.to_string(),
                    supported: SUPPORTED_MODELS.into(),
                });
            }
        }
        let tokens = g.get_str_array(KEY_TOKENS)?;
        let merges = g.get_str_array(KEY_MERGES)?;
        let types = g.opt_int_array(KEY_TOKEN_TYPE)?;
        if let Some(t) = &types
            && t.len() != tokens.len()
        {
            return Err(IoError::BadMetadata {
                path: path.to_path_buf(),
                key: KEY_TOKEN_TYPE.into(),
                expected: format!("{} entries (one per token)", tokens.len()),
                found: t.len().to_string(),
            });
        }
        let tok_err = |what: String, message: String| IoError::Tokenizer {
            path: path.to_path_buf(),
            what,
            message,
        };

        let mut vocab = Vocab::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            let id = u32::try_from(id).map_err(|_| {
                tok_err(KEY_TOKENS.into(), format!("more than {} tokens", u32::MAX))
            })?;
            // Keep the first id of a duplicated text, as llama.cpp's text-to-id map does.
            vocab.entry(t.clone()).or_insert(id);
        }
        let mut pairs = Vec::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| {
                tok_err(
                    format!("{KEY_MERGES}[{i}]"),
                    format!("expected two tokens separated by a space, found {m:?}"),
                )
            })?;
            pairs.push((a.to_string(), b.to_string()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, pairs)
            .build()
            .map_err(|e| tok_err("BPE model".into(), e.to_string()))?;

        let mut inner = tokenizers::Tokenizer::new(bpe);
        let add_prefix_space = g.opt_bool(KEY_ADD_SPACE_PREFIX)?.unwrap_or(false);
        let pre = g.opt_str(KEY_PRE)?.unwrap_or("default");
        inner.with_pre_tokenizer(Some(pre_tokenizer(path, pre, add_prefix_space)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let mut special = Vec::new();
        let mut user = Vec::new();
        if let Some(types) = &types {
            for (t, &ty) in tokens.iter().zip(types.iter()) {
                match ty {
                    TOKEN_TYPE_CONTROL => special.push(AddedToken::from(t.clone(), true)),
                    TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(t.clone(), false)),
                    _ => {}
                }
            }
        }
        inner.add_special_tokens(&special);
        inner.add_tokens(&user);

        let id_opt = |key: &str| token_id(g, key, tokens.len());
        let bos_id = id_opt(KEY_BOS)?;
        let eos_id = id_opt(KEY_EOS)?;
        let mut eos_ids: Vec<u32> = [eos_id, id_opt(KEY_EOT)?, id_opt(KEY_EOM)?]
            .into_iter()
            .flatten()
            .collect();
        eos_ids.dedup();
        // Byte-level BPE (GPT-2 style) adds no BOS unless the file asks for it.
        let add_bos = g.opt_bool(KEY_ADD_BOS)?.unwrap_or(false) && bos_id.is_some();
        let add_eos = g.opt_bool(KEY_ADD_EOS)?.unwrap_or(false) && eos_id.is_some();
        let mut single: Vec<String> = Vec::new();
        let mut special_map: Vec<(String, u32)> = Vec::new();
        let text_of = |id: u32| tokens[id as usize].clone();
        if let (true, Some(b)) = (add_bos, bos_id) {
            single.push(text_of(b));
            special_map.push((text_of(b), b));
        }
        single.push("$A".into());
        if let (true, Some(e)) = (add_eos, eos_id) {
            single.push(text_of(e));
            special_map.push((text_of(e), e));
        }
        if add_bos || add_eos {
            let mut pair = single.clone();
            pair.extend(
                single
                    .iter()
                    .map(|p| if p == "$A" { "$B".into() } else { p.clone() }),
            );
            let single =
                Template::try_from(single).map_err(|e| tok_err("BOS/EOS template".into(), e))?;
            let pair =
                Template::try_from(pair).map_err(|e| tok_err("BOS/EOS template".into(), e))?;
            let post = TemplateProcessing::builder()
                .single(single)
                .pair(pair)
                .special_tokens(special_map)
                .build()
                .map_err(|e| tok_err("BOS/EOS template".into(), e.to_string()))?;
            inner.with_post_processor(Some(post));
        }

        let mut tok = Tokenizer {
            inner: Backend::Hf(Box::new(inner)),
            path: path.to_path_buf(),
            bos_id,
            eos_ids,
            add_bos,
        };
        tok.add_end_of_turn_tokens();
        Ok(tok)
    }

    /// SentencePiece BPE (`tokenizer.ggml.model = "llama"`) from tokens, scores and token types.
    fn from_gguf_spm(g: &GgufFile) -> Result<Tokenizer> {
        let path = g.path();
        let tokens = g.get_str_array(KEY_TOKENS)?;
        let n = tokens.len();
        let per_token = |key: &str, found: usize| IoError::BadMetadata {
            path: path.to_path_buf(),
            key: key.to_string(),
            expected: format!("{n} entries (one per token)"),
            found: found.to_string(),
        };
        let scores = g.get_float_array(KEY_SCORES)?;
        if scores.len() != n {
            return Err(per_token(KEY_SCORES, scores.len()));
        }
        let kinds = match g.opt_int_array(KEY_TOKEN_TYPE)? {
            None => vec![PieceKind::Normal; n],
            Some(t) if t.len() != n => return Err(per_token(KEY_TOKEN_TYPE, t.len())),
            Some(t) => t
                .iter()
                .enumerate()
                .map(|(i, &ty)| {
                    PieceKind::from_gguf(ty).ok_or_else(|| IoError::BadMetadata {
                        path: path.to_path_buf(),
                        key: format!("{KEY_TOKEN_TYPE}[{i}]"),
                        expected: "a token type 0..=6".into(),
                        found: ty.to_string(),
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if u32::try_from(n).is_err() {
            return Err(IoError::Tokenizer {
                path: path.to_path_buf(),
                what: KEY_TOKENS.into(),
                message: format!("more than {} tokens", u32::MAX),
            });
        }
        let id_opt = |key: &str| token_id(g, key, n);
        let bos_id = id_opt(KEY_BOS)?;
        let eos_id = id_opt(KEY_EOS)?;
        let unk_id = id_opt(KEY_UNK)?.or_else(|| {
            kinds
                .iter()
                .position(|k| *k == PieceKind::Unknown)
                .map(|i| i as u32)
        });
        let mut eos_ids: Vec<u32> = [eos_id, id_opt(KEY_EOT)?, id_opt(KEY_EOM)?]
            .into_iter()
            .flatten()
            .collect();
        eos_ids.dedup();
        // llama.cpp's defaults for SentencePiece vocabularies: BOS added, a space prefix.
        let add_bos = g.opt_bool(KEY_ADD_BOS)?.unwrap_or(true) && bos_id.is_some();
        let add_space_prefix = g.opt_bool(KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);
        let model = SpmModel::new(SpmSpec {
            tokens: tokens.to_vec(),
            scores: scores.iter().map(|&s| s as f32).collect(),
            kinds,
            unk_id,
            add_space_prefix,
        });
        let mut tok = Tokenizer {
            inner: Backend::Spm(Arc::new(model)),
            path: path.to_path_buf(),
            bos_id,
            eos_ids,
            add_bos,
        };
        tok.add_end_of_turn_tokens();
        Ok(tok)
    }

    /// Adds known end-of-turn special tokens (e.g. `<|im_end|>`) to the EOS set.
    fn add_end_of_turn_tokens(&mut self) {
        let specials: HashSet<String> = match &self.inner {
            Backend::Hf(t) => t
                .get_added_tokens_decoder()
                .values()
                .filter(|t| t.special)
                .map(|t| t.content.clone())
                .collect(),
            Backend::Spm(m) => m
                .control_ids()
                .filter_map(|id| m.id_to_token(id))
                .filter(|t| END_OF_TURN_TOKENS.contains(t))
                .map(str::to_string)
                .collect(),
        };
        let extra: Vec<u32> = END_OF_TURN_TOKENS
            .iter()
            .filter(|t| specials.contains(**t))
            .filter_map(|t| self.token_to_id(t))
            .collect();
        for id in extra {
            if !self.eos_ids.contains(&id) {
                self.eos_ids.push(id);
            }
        }
    }

    fn error(&self, what: &str, message: String) -> IoError {
        IoError::Tokenizer {
            path: self.path.clone(),
            what: what.into(),
            message,
        }
    }

    /// Encodes text; with `add_special`, BOS/EOS are added as the model's settings say.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Backend::Hf(t) => t
                .encode(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| self.error("encode", e.to_string())),
            Backend::Spm(m) => {
                let mut ids = Vec::with_capacity(text.len() / 3 + 1);
                if add_special
                    && self.add_bos
                    && let Some(bos) = self.bos_id
                {
                    ids.push(bos);
                }
                ids.extend(m.encode(text).map_err(|e| self.error("encode", e.0))?);
                Ok(ids)
            }
        }
    }

    /// Decodes ids to text, optionally dropping special tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.inner {
            Backend::Hf(t) => t
                .decode(ids, skip_special)
                .map_err(|e| self.error("decode", e.to_string())),
            Backend::Spm(m) => m
                .decode(ids, skip_special)
                .map_err(|id| self.error("decode", out_of_range(id, m.vocab_size()))),
        }
    }

    /// A streaming decoder borrowing this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        let inner = match &self.inner {
            Backend::Hf(t) => StreamInner::Hf(Box::new(t.decode_stream(skip_special))),
            Backend::Spm(m) => StreamInner::Spm {
                model: m,
                state: SpmStream::default(),
                skip_special,
            },
        };
        StreamDecoder {
            inner,
            path: &self.path,
        }
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end generation: EOS plus end-of-turn tokens such as `<|im_end|>`.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    /// Whether `encode(.., true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Backend::Hf(t) => t.get_vocab_size(true),
            Backend::Spm(m) => m.vocab_size(),
        }
    }

    /// Id of an exact token text.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Backend::Hf(t) => t.token_to_id(token),
            Backend::Spm(m) => m.token_to_id(token),
        }
    }

    /// Text of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Backend::Hf(t) => t.id_to_token(id),
            Backend::Spm(m) => m.id_to_token(id).map(str::to_string),
        }
    }

    /// The wrapped `tokenizers` tokenizer; `None` for SentencePiece vocabularies from GGUF,
    /// which RidgeFill encodes itself.
    pub fn inner(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.inner {
            Backend::Hf(t) => Some(t),
            Backend::Spm(_) => None,
        }
    }

    /// The tokenizer model: `"sentencepiece-bpe"` or `"hf"` (tokenizer.json or byte-level BPE).
    pub fn kind(&self) -> &'static str {
        match &self.inner {
            Backend::Hf(_) => "hf",
            Backend::Spm(_) => "sentencepiece-bpe",
        }
    }

    /// The file the tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// An optional token id in metadata key `key`, checked against the vocabulary size.
fn token_id(g: &GgufFile, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    match g.opt_u32(key)? {
        Some(id) if (id as usize) < n_tokens => Ok(Some(id)),
        Some(id) => Err(IoError::BadMetadata {
            path: g.path().to_path_buf(),
            key: key.to_string(),
            expected: format!("a token id below {n_tokens}"),
            found: id.to_string(),
        }),
        None => Ok(None),
    }
}

fn pre_tokenizer(path: &Path, pre: &str, add_prefix_space: bool) -> Result<PreTokenizerWrapper> {
    // HF's ByteLevel(use_regex=true) applies the GPT-2 split regex itself.
    let gpt2 = || ByteLevel::new(add_prefix_space, true, true);
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| IoError::Tokenizer {
            path: path.to_path_buf(),
            what: format!("{KEY_PRE} {pre:?} regex"),
            message: e.to_string(),
        })?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split.into(),
            ByteLevel::new(add_prefix_space, false, false).into(),
        ])))
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => gpt2().into(),
        // SmolLM's HF tokenizer isolates every digit before the GPT-2 split.
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            Digits::new(true).into(),
            gpt2().into(),
        ])),
        "llama-bpe" | "llama3" => split(LLAMA3_PATTERN)?,
        "qwen2" => split(QWEN2_PATTERN)?,
        other => {
            return Err(IoError::UnsupportedTokenizer {
                path: path.to_path_buf(),
                field: KEY_PRE.into(),
                kind: other.to_string(),
                supported: SUPPORTED_PRE.into(),
            });
        }
    })
}
