//! Gemma 3 270M (Q4_K_M GGUF) against transformers for the same GGUF
//! (`tests/golden/gemma3.json`, made by `scripts/reference_gemma3.py`): logits and greedy
//! continuations fed the golden token ids (the decoder, not the tokenizer), and the mean NLL of
//! `tests/data/score.txt` tokenized by RidgeFill (tokenizer, decoder and sliding windows
//! together). The model is fetched when missing (`ridgefill fetch gemma3-270m`), never skipped.

mod common;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::{Device, to_host_f32};
use ridgefill_testkit::decode;
use ridgefill_testkit::golden::{self, ModelGolden};

/// Gemma 3 logits within 1e-3 of transformers.
const TOL: f64 = 1e-3;
/// Mean NLL within 1e-3 of transformers', relative.
const NLL_REL_TOL: f64 = 1e-3;

/// The checkpoint (fetched when missing) and its golden values.
fn setup() -> (&'static Checkpoint, &'static ModelGolden) {
    (common::gemma3_ckpt(), golden::gemma3())
}

/// Mean NLL over windows of 1024 tokens: two sliding windows' worth, so windowed layers drop
/// keys that global layers still see.
#[test]
fn gemma3_270m_nll_matches_transformers() {
    let (ckpt, g) = setup();
    let want = g
        .score_long
        .as_ref()
        .expect("Gemma 3's golden has score_long");
    let text = std::fs::read_to_string(common::repo().join(&want.file)).unwrap();
    let ids = ckpt.tokenizer.encode(&text, true).unwrap();
    assert_eq!(ids.len(), want.n_tokens);
    assert_eq!(ids[..16], want.first_ids[..]);
    let model = common::load_on(ckpt, &Device::flex());
    let got = ridgefill::score::score_ids(&model, &ids, want.ctx).unwrap();
    assert_eq!(got.tokens_scored, want.tokens_scored);
    let w = want.mean_nll;
    let rel = (got.mean_nll - w).abs() / w;
    eprintln!(
        "mean NLL {:.6} vs transformers {w:.6} (relative {rel:.1e})",
        got.mean_nll
    );
    assert!(rel < NLL_REL_TOL, "mean NLL {} vs {w}", got.mean_nll);
}

#[test]
fn gemma3_270m_logits_match_transformers() {
    let (ckpt, g) = setup();
    let c = &ckpt.config;
    assert_eq!(c.model_type, "gemma3_text");
    let facts = g
        .model_facts
        .as_ref()
        .expect("Gemma 3's golden has model_facts");
    let types: Vec<String> = (0..c.num_hidden_layers)
        .map(|l| match c.layer_window(l) {
            Some(_) => "sliding_attention".to_string(),
            None => "full_attention".to_string(),
        })
        .collect();
    assert_eq!(types, facts.layer_types);
    assert_eq!(c.sliding_window, Some(512));
    assert_eq!(c.attention_scale(), facts.attn_scale);
    let model = common::load_on(ckpt, &Device::flex());
    for (k, p) in g.prompts.iter().enumerate() {
        let ids = &p.ids;
        let logits = to_host_f32(model.prefill(ids, &mut model.new_cache(ids.len())).unwrap());
        let (idx, want) = (&p.logits_last.indices, &p.logits_last.values);
        let worst = idx
            .iter()
            .zip(want)
            .map(|(&i, &w)| (f64::from(logits[i as usize]) - w).abs())
            .fold(0.0, f64::max);
        let argmax = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        eprintln!("prompt {k}: max |Δ| {worst:.2e}, argmax {argmax}");
        assert_eq!(argmax, p.argmax, "prompt {k}: argmax");
        assert!(worst < TOL, "prompt {k}: logits max |Δ| {worst}");
    }
    // Greedy continuation of each prompt, through the cache.
    for gr in &g.greedy {
        let k = gr.prompt;
        let got = decode::greedy(&model, &g.prompts[k].ids, gr.ids.len());
        assert_eq!(got, gr.ids, "prompt {k}: greedy continuation");
    }
}
