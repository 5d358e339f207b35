//! Gemma 3 270M (Q4_K_M GGUF) against transformers for the same GGUF
//! (`tests/golden/gemma3.json`, made by `scripts/reference_gemma3.py`): logits and greedy
//! continuations fed the golden token ids (the decoder, not the tokenizer), and the mean NLL of
//! `tests/data/score.txt` tokenized by RidgeFill (tokenizer, decoder and sliding windows
//! together). The model is fetched when missing (`ridgefill fetch gemma3-270m`), never skipped.

mod common;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::{Device, to_host_f32};

/// Issue 12: Gemma 3 logits within 1e-3 of transformers.
const TOL: f64 = 1e-3;
/// Issue 12: mean NLL within 1e-3 of transformers', relative.
const NLL_REL_TOL: f64 = 1e-3;
fn golden() -> serde_json::Value {
    let path = common::repo().join("tests/golden/gemma3.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{} (made by scripts/reference_gemma3.py): {e}",
            path.display()
        )
    });
    serde_json::from_str(&text).expect("golden JSON parses")
}

/// The checkpoint (fetched when missing) and its golden values.
fn setup() -> (&'static Checkpoint, serde_json::Value) {
    (common::gemma3_ckpt(), golden())
}

/// Mean NLL over windows of 1024 tokens: two sliding windows' worth, so windowed layers drop
/// keys that global layers still see.
#[test]
fn gemma3_270m_nll_matches_transformers() {
    let (ckpt, g) = setup();
    let want = &g["score_long"];
    let text =
        std::fs::read_to_string(common::repo().join(want["file"].as_str().unwrap())).unwrap();
    let ids = ckpt.tokenizer.encode(&text, true).unwrap();
    assert_eq!(ids.len() as u64, want["n_tokens"].as_u64().unwrap());
    assert_eq!(ids[..16], common::ids_of(&want["first_ids"])[..]);
    let model = common::load_on(ckpt, &Device::flex());
    let ctx = want["ctx"].as_u64().unwrap() as usize;
    let got = ridgefill::score::score_ids(&model, &ids, ctx).unwrap();
    assert_eq!(
        got.tokens_scored as u64,
        want["tokens_scored"].as_u64().unwrap()
    );
    let w = want["mean_nll"].as_f64().unwrap();
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
    let facts = &g["model_facts"];
    let types: Vec<String> = (0..c.num_hidden_layers)
        .map(|l| match c.layer_window(l) {
            Some(_) => "sliding_attention".to_string(),
            None => "full_attention".to_string(),
        })
        .collect();
    let want_types: Vec<String> = facts["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(types, want_types);
    assert_eq!(c.sliding_window, Some(512));
    assert_eq!(c.attention_scale(), facts["attn_scale"].as_f64().unwrap());
    let model = common::load_on(ckpt, &Device::flex());
    for (k, p) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = common::ids_of(&p["ids"]);
        let logits = to_host_f32(
            model
                .prefill(&ids, &mut model.new_cache(ids.len()))
                .unwrap(),
        );
        let idx = common::ids_of(&p["logits_last"]["indices"]);
        let want = common::floats_of(&p["logits_last"]["values"]);
        let worst = idx
            .iter()
            .zip(&want)
            .map(|(&i, &w)| (f64::from(logits[i as usize]) - w).abs())
            .fold(0.0, f64::max);
        let argmax = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u64)
            .unwrap();
        eprintln!("prompt {k}: max |Δ| {worst:.2e}, argmax {argmax}");
        assert_eq!(argmax, p["argmax"].as_u64().unwrap(), "prompt {k}: argmax");
        assert!(worst < TOL, "prompt {k}: logits max |Δ| {worst}");
    }
    // Greedy continuation of each prompt, through the cache.
    for gr in g["greedy"].as_array().unwrap() {
        let k = gr["prompt"].as_u64().unwrap() as usize;
        let prompt = common::ids_of(&g["prompts"][k]["ids"]);
        let want = common::ids_of(&gr["ids"]);
        let mut cache = model.new_cache(prompt.len() + want.len());
        let mut logits = to_host_f32(model.prefill(&prompt, &mut cache).unwrap());
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            got.push(next);
            logits = to_host_f32(model.decode_step(next, &mut cache).unwrap());
        }
        assert_eq!(got, want, "prompt {k}: greedy continuation");
    }
}
