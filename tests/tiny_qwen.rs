//! Tiny random Qwen2 and Qwen3 models (written by `scripts/tiny_qwen.py` as HF safetensors and,
//! through the `gguf` package, as GGUF) against transformers' logits in
//! `tests/golden/tiny_qwen.json`: within 1e-4 from either format.

mod common;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::{Device, to_host_f32};

/// Issue 12: the tiny Qwen models' logits match transformers within this.
const TOL: f32 = 1e-4;

fn golden() -> serde_json::Value {
    let text = std::fs::read_to_string(common::repo().join("tests/golden/tiny_qwen.json"))
        .expect("tests/golden/tiny_qwen.json");
    serde_json::from_str(&text).expect("golden JSON parses")
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    common::floats_of(v).into_iter().map(|x| x as f32).collect()
}

fn check(family: &str) {
    let g = golden();
    let m = &g["models"][family];
    let long = common::ids_of(&g["seq_long"]);
    let short = common::ids_of(&g["seq_short"]);
    let want_long = floats(&m["logits_long_last"]);
    let want_short: Vec<Vec<f32>> = m["logits_short_all"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let greedy = common::ids_of(&m["greedy_short"]["ids"]);
    for path in [
        m["hf_folder"].as_str().unwrap(),
        m["gguf"].as_str().unwrap(),
    ] {
        let ckpt = Checkpoint::open(&common::repo().join(path))
            .unwrap_or_else(|e| panic!("open {path}: {e}"));
        assert_eq!(ckpt.config.model_type, family, "{path}");
        let model = common::load_on(&ckpt, &Device::flex());
        let got = to_host_f32(
            model
                .prefill(&long, &mut model.new_cache(long.len()))
                .unwrap(),
        );
        let d = common::max_abs_diff(&got, &want_long);
        assert!(d < TOL, "{path}: last-position logits max |Δ| {d}");
        let all = to_host_f32(
            model
                .forward_all_logits(&short, &mut model.new_cache(short.len()))
                .unwrap(),
        );
        let v = model.config.vocab_size;
        for (i, want) in want_short.iter().enumerate() {
            let d = common::max_abs_diff(&all[i * v..(i + 1) * v], want);
            assert!(d < TOL, "{path}: short prompt position {i} max |Δ| {d}");
        }
        // Greedy continuation of the short prompt, through the cache.
        let mut cache = model.new_cache(short.len() + greedy.len());
        let mut logits = to_host_f32(model.prefill(&short, &mut cache).unwrap());
        let mut ids = Vec::new();
        for _ in 0..greedy.len() {
            let next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            ids.push(next);
            logits = to_host_f32(model.decode_step(next, &mut cache).unwrap());
        }
        assert_eq!(ids, greedy, "{path}: greedy continuation");
    }
}

#[test]
fn tiny_qwen2_matches_transformers() {
    common::init();
    check("qwen2");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    common::init();
    check("qwen3");
}
