//! The real SmolLM2-135M GGUF against golden values printed by `scripts/reference.py`
//! (Hugging Face transformers, f32, CPU, same file).

mod common;

use common::*;
use ridgefill::model::sample::argmax;
use ridgefill::model::to_host_f32;
use ridgefill_testkit::decode;
use ridgefill_testkit::golden::{self, ModelGolden};

fn golden() -> &'static ModelGolden {
    golden::smollm2()
}

/// Logit tolerance against transformers (f32 on both sides; summation order differs).
const LOGIT_TOL: f64 = 1e-3;
/// Relative tolerance on the mean NLL of the scoring text.
const NLL_REL_TOL: f64 = 1e-4;

#[test]
fn tokenizer_matches_transformers() {
    let tok = &smollm2_ckpt().tokenizer;
    let cases = &golden().tokenizer;
    assert!(cases.len() >= 10);
    for case in cases {
        let text = &case.text;
        assert_eq!(
            tok.encode(text, false).unwrap(),
            case.ids_no_special,
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, true).unwrap(),
            case.ids_default,
            "{text:?}"
        );
    }
}

#[test]
fn last_position_logits_match_transformers() {
    let model = smollm2_flex();
    let tok = &smollm2_ckpt().tokenizer;
    for p in &golden().prompts {
        let text = &p.text;
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, p.ids, "token ids of {text:?}");
        let mut cache = model.new_cache(ids.len());
        let logits = to_host_f32(model.prefill(&ids, &mut cache).unwrap());
        let (idx, want) = (&p.logits_last.indices, &p.logits_last.values);
        let mut worst = 0.0f64;
        for (&i, &w) in idx.iter().zip(want) {
            worst = worst.max((logits[i as usize] as f64 - w).abs());
        }
        eprintln!(
            "{text:?}: max |Δlogit| = {worst:.2e} over {} ids",
            idx.len()
        );
        assert!(
            worst <= LOGIT_TOL,
            "{text:?}: max |Δlogit| {worst} > {LOGIT_TOL}"
        );
        assert_eq!(argmax(&logits), p.argmax);
        let l2 = logits
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let want_l2 = p.logits_last_l2;
        assert!(
            (l2 - want_l2).abs() / want_l2 < 1e-5,
            "{text:?}: ‖logits‖ {l2} vs {want_l2}"
        );
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    let model = smollm2_flex();
    let tok = &smollm2_ckpt().tokenizer;
    for g in &golden().greedy {
        let p = &golden().prompts[g.prompt];
        let ids = tok.encode(&p.text, true).unwrap();
        let got = decode::greedy(model, &ids, g.ids.len());
        assert_eq!(got, g.ids, "greedy ids");
        assert_eq!(tok.decode(&got, true).unwrap(), g.text);
    }
}

#[test]
fn score_matches_transformers() {
    let model = smollm2_flex();
    let tok = &smollm2_ckpt().tokenizer;
    let s = &golden().score;
    let text = std::fs::read_to_string(repo().join(&s.file)).unwrap();
    let ids = tok.encode(&text, true).unwrap();
    assert_eq!(ids.len(), s.n_tokens);
    let r = ridgefill::score::score_ids(model, &ids, s.ctx).unwrap();
    let want = s.mean_nll;
    eprintln!("mean NLL {} vs transformers {want}", r.mean_nll);
    assert_eq!(r.tokens_scored, s.tokens_scored);
    assert!(
        (r.mean_nll - want).abs() / want <= NLL_REL_TOL,
        "mean NLL {} vs {want}",
        r.mean_nll
    );
}

#[test]
fn prefill_then_decode_equals_one_longer_prefill() {
    let model = smollm2_flex();
    let ids = &golden().prompts[1].ids;
    let n = ids.len();
    let mut full = model.new_cache(n);
    let one = to_host_f32(model.prefill(ids, &mut full).unwrap());
    // Split prefill into two chunks, then decode the last token.
    let mut cache = model.new_cache(n);
    model.prefill(&ids[..n / 2], &mut cache).unwrap();
    model.prefill(&ids[n / 2..n - 1], &mut cache).unwrap();
    let stepped = to_host_f32(model.decode_step(ids[n - 1], &mut cache).unwrap());
    let d = max_abs_diff(&one, &stepped);
    assert!(d < 1e-3, "cached vs uncached max |Δ| {d}");
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_matches_flex_on_smollm2() {
    let flex = smollm2_flex();
    let wgpu = load_on(smollm2_ckpt(), &common::wgpu().device);
    let ids = &golden().prompts[1].ids;
    let a = to_host_f32(flex.prefill(ids, &mut flex.new_cache(ids.len())).unwrap());
    let b = to_host_f32(wgpu.prefill(ids, &mut wgpu.new_cache(ids.len())).unwrap());
    let d = max_abs_diff(&a, &b);
    eprintln!("flex vs wgpu max |Δlogit| = {d:.2e}");
    assert!(d <= 1e-3, "flex vs wgpu max |Δlogit| {d}");
}
