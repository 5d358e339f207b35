//! Tiny random Qwen2 and Qwen3 models (written by `scripts/tiny_qwen.py` as HF safetensors and,
//! through the `gguf` package, as GGUF) against transformers' logits in
//! `tests/golden/tiny_qwen.json`: within 1e-4 from either format.

mod common;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::{Device, to_host_f32};
use ridgefill_testkit::{decode, golden};

/// The tiny Qwen models' logits match transformers within this.
const TOL: f32 = 1e-4;

fn check(family: &str) {
    let g = golden::tiny_qwen();
    let m = &g.models[family];
    let (long, short) = (&g.seq_long, &g.seq_short);
    let greedy = &m.greedy_short.ids;
    for path in [&m.hf_folder, &m.gguf] {
        let ckpt = Checkpoint::open(&common::repo().join(path))
            .unwrap_or_else(|e| panic!("open {path}: {e}"));
        assert_eq!(ckpt.config.model_type, family, "{path}");
        let model = common::load_on(&ckpt, &Device::flex());
        let got = to_host_f32(
            model
                .prefill(long, &mut model.new_cache(long.len()))
                .unwrap(),
        );
        let d = common::max_abs_diff(&got, &m.logits_long_last);
        assert!(d < TOL, "{path}: last-position logits max |Δ| {d}");
        let all = to_host_f32(
            model
                .forward_all_logits(short, &mut model.new_cache(short.len()))
                .unwrap(),
        );
        let v = model.config.vocab_size;
        for (i, want) in m.logits_short_all.iter().enumerate() {
            let d = common::max_abs_diff(&all[i * v..(i + 1) * v], want);
            assert!(d < TOL, "{path}: short prompt position {i} max |Δ| {d}");
        }
        // Greedy continuation of the short prompt, through the cache.
        let ids = decode::greedy(&model, short, greedy.len());
        assert_eq!(&ids, greedy, "{path}: greedy continuation");
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
