//! Tokenizers and chat templates of the Gemma 3 and Qwen families against goldens from
//! transformers (and SentencePiece): `tests/golden/gemma3.json` (scripts/reference_gemma3.py) and
//! `tests/golden/tiny_qwen.json` (scripts/tiny_qwen.py).
//!
//! The Gemma 3 270M GGUF is not in git: `cargo run --release -- fetch gemma3-270m` puts it in
//! models/cache or `$RIDGEFILL_CACHE` (`RIDGEFILL_GEMMA3_GGUF` overrides the path;
//! scripts/test.sh fetches it); its tests fail, saying so, when it is absent. The tiny Qwen models are in tests/data.

use std::path::{Path, PathBuf};

use ridgefill_io::chat::{self, ChatMessage, ChatTemplate};
use ridgefill_io::gguf::GgufFile;
use ridgefill_io::tokenizer::{SpecialTokens, Tokenizer};
use ridgefill_testkit::golden::{self, TokenizerCase};

const GEMMA_ENV: &str = "RIDGEFILL_GEMMA3_GGUF";
const GEMMA3: &str = "gemma3-270m/gemma-3-270m-q4_k_m.gguf";
/// Control tokens the Gemma cases write in their text (parsed as single tokens).
const GEMMA_CONTROL_TEXT: &[&str] = &["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"];

fn manifest_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// The Gemma 3 GGUF; a missing file fails the test, saying how to fetch it.
fn gemma_gguf() -> GgufFile {
    let path = ridgefill_testkit::fetched_model(GEMMA3, Some(GEMMA_ENV));
    GgufFile::open(&path).expect("open the Gemma 3 GGUF")
}

/// The ids SentencePiece (and llama.cpp) give: transformers' except where the golden marks
/// SentencePiece as different on plain text (runs of 32+ spaces); with control tokens in the
/// text, transformers' (parsed) ids are the ones to follow.
fn gemma_expected(case: &TokenizerCase) -> &[u32] {
    let has_control = GEMMA_CONTROL_TEXT.iter().any(|t| case.text.contains(t));
    if spm_differs(case) && !has_control {
        spm_ids(case)
    } else {
        &case.ids_no_special
    }
}

/// SentencePiece's ids of a Gemma case.
fn spm_ids(case: &TokenizerCase) -> &[u32] {
    case.spm_ids.as_deref().expect("Gemma cases carry spm_ids")
}

/// Whether SentencePiece's ids differ from transformers' for a Gemma case.
fn spm_differs(case: &TokenizerCase) -> bool {
    case.spm_differs.expect("Gemma cases carry spm_differs")
}

#[test]
fn gemma3_tokenizer_matches_sentencepiece_and_transformers() {
    let g = gemma_gguf();
    let golden = golden::gemma3();
    let tok = Tokenizer::from_gguf(&g).expect("Gemma 3 tokenizer from GGUF metadata");
    let info = &golden.tokenizer_info;
    assert_eq!(tok.vocab_size(), info.vocab_size);
    assert_eq!(tok.bos_id(), Some(info.bos_token_id));
    assert_eq!(tok.add_bos(), info.bos_added_by_default);
    assert_eq!(tok.eos_ids()[0], info.eos_token_id);
    assert_eq!(tok.kind(), "sentencepiece-bpe");
    assert!(golden.tokenizer.len() >= 20);
    let mut spm_cases = 0;
    for case in &golden.tokenizer {
        let text = &case.text;
        let want = gemma_expected(case);
        if want == spm_ids(case) && spm_differs(case) {
            spm_cases += 1;
        }
        assert_eq!(tok.encode(text, false).unwrap(), want, "{text:?}");
        let mut with_bos = vec![info.bos_token_id];
        with_bos.extend_from_slice(want);
        assert_eq!(tok.encode(text, true).unwrap(), with_bos, "{text:?}");
        if !spm_differs(case) {
            assert_eq!(case.ids_default, with_bos, "golden is self-consistent");
        }
        assert_eq!(tok.decode(want, false).unwrap(), case.decoded, "{text:?}");
        let mut stream = tok.stream_decoder(false);
        let mut streamed = String::new();
        for &id in want {
            if let Some(piece) = stream.push(id).unwrap() {
                streamed.push_str(&piece);
            }
        }
        assert_eq!(streamed, case.decoded, "streamed {text:?}");
    }
    assert_eq!(
        spm_cases, 1,
        "exactly the 40-space case follows SentencePiece"
    );
    // Control tokens are dropped when decoding with skip_special.
    let ids = tok
        .encode("<start_of_turn>user\nhi<end_of_turn>", true)
        .unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
}

#[test]
fn gemma3_prompts_score_text_and_greedy_text() {
    let g = gemma_gguf();
    let golden = golden::gemma3();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    for p in &golden.prompts {
        assert_eq!(tok.encode(&p.text, true).unwrap(), p.ids, "{:?}", p.text);
    }
    for gr in &golden.greedy {
        assert!(gr.prompt < golden.prompts.len());
        assert_eq!(tok.decode(&gr.ids, true).unwrap(), gr.text);
    }
    let s = &golden.score;
    assert!(
        s.spm_ids_match
            .expect("Gemma's score carries spm_ids_match"),
        "transformers and SentencePiece agree on the score text"
    );
    let text = std::fs::read_to_string(manifest_path(&format!("../../{}", s.file))).unwrap();
    let ids = tok.encode(&text, true).unwrap();
    assert_eq!(ids.len(), s.n_tokens, "tokens of {}", s.file);
    assert_eq!(&ids[..s.first_ids.len()], s.first_ids.as_slice());
    assert_eq!(tok.decode(&ids, true).unwrap(), text);
}

#[test]
fn gemma3_builtin_chat_template_and_stop_ids() {
    let g = gemma_gguf();
    let golden = golden::gemma3();
    let c = &golden.chat;
    assert_eq!(chat::GEMMA3_CHAT_TEMPLATE, c.chat_template);
    assert!(g.opt_str(chat::KEY_CHAT_TEMPLATE).unwrap().is_none());
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(
        tok.eos_ids(),
        c.stop_ids.clone().expect("Gemma's chat carries stop_ids"),
        "stop ids: <eos> and <end_of_turn>"
    );
    let tmpl = chat::gguf_template(&g, &tok, None)
        .unwrap()
        .expect("built-in Gemma 3 template");
    let rendered = tmpl.render(&c.messages, c.add_generation_prompt).unwrap();
    assert_eq!(rendered, c.chat_rendered);
    assert_eq!(tok.encode(&rendered, false).unwrap(), c.chat_rendered_ids);
    // Roles must alternate, as in transformers.
    let bad = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let err = tmpl.render(&bad, true).unwrap_err().to_string();
    assert!(err.contains("must alternate"), "{err}");
}

#[test]
fn builtin_templates_by_architecture() {
    assert!(chat::builtin_template("gemma3").is_some());
    assert!(chat::builtin_template("gemma3_text").is_some());
    assert!(chat::builtin_template("llama").is_none());
    let t = ChatTemplate::new(
        chat::GEMMA3_CHAT_TEMPLATE.into(),
        "<bos>".into(),
        "<eos>".into(),
    )
    .unwrap();
    let out = t
        .render(
            &[
                ChatMessage::new("user", " hi "),
                ChatMessage::new("assistant", "hello"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
    );
}

/// tokenizer.json plus the special tokens of tokenizer_config.json, as `HfDir::open` reads them.
fn qwen_hf_tokenizer(dir: &Path) -> (Tokenizer, ChatTemplate) {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let special = SpecialTokens {
        eos: cfg["eos_token"]
            .as_str()
            .map(str::to_string)
            .into_iter()
            .collect(),
        ..SpecialTokens::default()
    };
    let tok = Tokenizer::from_hf_file(&dir.join("tokenizer.json"), &special).unwrap();
    let tmpl = ChatTemplate::new(
        cfg["chat_template"].as_str().unwrap().to_string(),
        String::new(),
        special.eos[0].clone(),
    )
    .unwrap();
    (tok, tmpl)
}

#[test]
fn tiny_qwen_tokenizers_match_transformers() {
    let golden = golden::tiny_qwen();
    assert_eq!(golden.models.len(), 2);
    for (name, m) in &golden.models {
        let gguf = GgufFile::open(manifest_path(&format!("../../{}", m.gguf))).unwrap();
        let from_gguf = Tokenizer::from_gguf(&gguf).unwrap();
        let hf_dir = manifest_path(&format!("../../{}", m.hf_folder));
        let (from_hf, hf_template) = qwen_hf_tokenizer(&hf_dir);
        let gguf_template = chat::gguf_template(&gguf, &from_gguf, None)
            .unwrap()
            .expect("ChatML template in the GGUF");
        let t = &m.tokenizer;
        for (which, tok) in [("gguf", &from_gguf), ("tokenizer.json", &from_hf)] {
            assert_eq!(tok.add_bos(), t.bos_added_by_default, "{name} {which}");
            for (text, &id) in &t.specials {
                assert_eq!(tok.token_to_id(text), Some(id), "{name} {which} {text}");
            }
            for case in &t.cases {
                let text = &case.text;
                assert_eq!(
                    tok.encode(text, false).unwrap(),
                    case.ids,
                    "{name} {which} {text:?}"
                );
                assert_eq!(tok.encode(text, true).unwrap(), case.ids, "{name} {which}");
                assert_eq!(tok.decode(&case.ids, false).unwrap(), case.decoded);
            }
            // Generation stops at <|endoftext|> and at the end of a ChatML turn.
            let eos = tok.eos_ids();
            for stop in ["<|endoftext|>", "<|im_end|>"] {
                assert!(
                    eos.contains(&t.specials[stop]),
                    "{name} {which} {stop}: {eos:?}"
                );
            }
        }
        let c = &m.chat;
        for (which, tmpl) in [("gguf", &gguf_template), ("tokenizer_config", &hf_template)] {
            assert_eq!(tmpl.source(), c.template, "{name} {which}");
            let rendered = tmpl.render(&c.messages, c.add_generation_prompt).unwrap();
            assert_eq!(rendered, c.rendered, "{name} {which}");
            assert_eq!(from_gguf.encode(&rendered, true).unwrap(), c.rendered_ids);
            assert_eq!(from_hf.encode(&rendered, true).unwrap(), c.rendered_ids);
        }
    }
}
