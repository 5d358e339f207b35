//! One decoder, several families: random Qwen2, Qwen3 and Gemma 3 models (their switches as
//! config data) checked against a plain f64 host forward written from the transformers
//! definitions, cached against uncached, skip-and-fill with every row exact against full
//! prefill, and sliding windows against a window longer than the prompt. Both CPU code paths
//! (fused kernels where a block allows them, plain burn ops) are checked.

mod common;

use ridgefill::io::config::{Activation, ModelConfig};
use ridgefill::model::Decoder;
use ridgefill::model::fill::{FillMaps, FillOptions, FillRows, Prefill};
use ridgefill::model::{Device, FloatDType, to_host_f32};
use ridgefill_testkit::reference::{Reference, max_abs_diff_f64 as diff};
use ridgefill_testkit::{fill, prompt};

/// Agreement expected between an f32 model and the f64 reference.
const TOL: f32 = 2e-3;
const CAPACITY: usize = 64;

fn qwen2() -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 256,
        "max_position_embeddings": 1024, "tie_word_embeddings": false,
        "use_sliding_window": false, "sliding_window": 4, "max_window_layers": 1
    }))
    .unwrap()
}

fn qwen3() -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "head_dim": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 256,
        "max_position_embeddings": 1024, "tie_word_embeddings": false
    }))
    .unwrap()
}

/// Gemma 3 with every switch on, soft-caps included (Gemma 2's, which the decoder also takes),
/// sliding layers 0 and 2 over 5 keys, and a scalar that is not head_dim.
fn gemma3() -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
        "head_dim": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": 256,
        "max_position_embeddings": 1024, "sliding_window": 5, "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 8.0
    }))
    .unwrap()
}

fn families() -> Vec<(&'static str, ModelConfig)> {
    vec![("qwen2", qwen2()), ("qwen3", qwen3()), ("gemma3", gemma3())]
}

fn model(cfg: &ModelConfig, cpu_kernels: bool) -> Decoder {
    common::init();
    let mut m =
        Decoder::random(cfg.clone(), &Device::flex(), FloatDType::F32, CAPACITY, 17).unwrap();
    m.set_cpu_kernels(cpu_kernels);
    m
}

/// The f64 reference from the model's own tensors (`windows`, when given, overriding each
/// layer's); the logits of every position.
fn reference(m: &Decoder, tokens: &[u32], windows: Option<&[Option<usize>]>) -> Vec<Vec<f64>> {
    let r = Reference::from_decoder(m);
    match windows {
        Some(w) => r.with_windows(w),
        None => r,
    }
    .logits(tokens)
}

#[test]
fn configs_switch_on_each_familys_features() {
    let q2 = qwen2();
    assert!(q2.attention_bias && !q2.qk_norm && !q2.tie_word_embeddings);
    // use_sliding_window false: Qwen's window is off whatever sliding_window says.
    assert!(q2.sliding_window.is_none() && (0..3).all(|l| q2.layer_window(l).is_none()));
    let q3 = qwen3();
    assert!(!q3.attention_bias && q3.qk_norm && q3.head_dim() == 32);
    let g = gemma3();
    assert!(g.qk_norm && g.sandwich_norms && g.tie_word_embeddings);
    assert_eq!(g.hidden_act, Activation::GeluTanh);
    assert_eq!(g.norm_weight_offset, 1.0);
    assert_eq!(g.embed_scale, Some(8.0));
    let windows: Vec<_> = (0..4).map(|l| g.layer_window(l)).collect();
    assert_eq!(windows, vec![Some(5), None, Some(5), None]);
    assert!(g.layer_uses_local_rope(0) && !g.layer_uses_local_rope(1));
    assert_eq!(g.rope_theta, 1_000_000.0);
    assert_eq!(g.rope_local_base_freq, Some(10_000.0));
    // The resolved config survives a serde round trip.
    for (name, c) in families() {
        let back: ModelConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back, c, "{name}");
    }
}

#[test]
fn decoder_matches_host_reference_on_every_family() {
    const N: usize = 12;
    for (name, cfg) in families() {
        for cpu_kernels in [true, false] {
            let m = model(&cfg, cpu_kernels);
            let ids = prompt(N, cfg.vocab_size);
            let want = reference(&m, &ids, None);
            let got = to_host_f32(m.forward_all_logits(&ids, &mut m.new_cache(N)).unwrap());
            let v = cfg.vocab_size;
            for (i, w) in want.iter().enumerate() {
                let d = diff(&got[i * v..(i + 1) * v], w);
                assert!(
                    d < TOL,
                    "{name} kernels {cpu_kernels} position {i}: max |Δ| {d} against the reference"
                );
            }
        }
    }
}

#[test]
fn cached_decode_equals_uncached_forward_on_every_family() {
    const N: usize = 14;
    for (name, cfg) in families() {
        for cpu_kernels in [true, false] {
            let m = model(&cfg, cpu_kernels);
            let ids = prompt(N, cfg.vocab_size);
            let mut cache = m.new_cache(N);
            m.prefill(&ids[..4], &mut cache).unwrap();
            for (i, &t) in ids[4..].iter().enumerate() {
                let step = to_host_f32(m.decode_step(t, &mut cache).unwrap());
                let prefix = &ids[..4 + i + 1];
                let full = to_host_f32(m.prefill(prefix, &mut m.new_cache(prefix.len())).unwrap());
                let d = common::max_abs_diff(&step, &full);
                assert!(
                    d < 1e-4,
                    "{name} kernels {cpu_kernels} step {i}: max |Δ| {d}"
                );
            }
        }
    }
}

fn random_maps(m: &Decoder, split: usize) -> FillMaps {
    let mut x = 0.1f32;
    fill::random_maps(m, split, || {
        x = (x * 3.7 + 0.31).fract();
        x - 0.5
    })
}

/// Skip-and-fill whose tail is the whole prompt, and whose chosen spans cover every bulk row
/// (the exact pass at explicit positions, sliding windows included), equal full prefill; so
/// does decoding after it.
#[test]
fn skip_fill_with_every_row_exact_equals_full_prefill_on_every_family() {
    const N: usize = 20;
    for (name, cfg) in families() {
        for cpu_kernels in [true, false] {
            let m = model(&cfg, cpu_kernels);
            let ids = prompt(N + 1, cfg.vocab_size);
            let mut full_cache = m.new_cache(N + 1);
            let full = to_host_f32(m.prefill(&ids[..N], &mut full_cache).unwrap());
            let full_next = to_host_f32(m.decode_step(ids[N], &mut full_cache).unwrap());
            let maps = random_maps(&m, 1);
            let tail = FillRows {
                sink: 1,
                tail: N,
                ..FillRows::default()
            };
            let spans = FillRows {
                sink: 1,
                tail: 3,
                exact: 1.0,
                span: N,
                ..FillRows::default()
            };
            for rows in [tail, spans] {
                let mut cache = m.new_cache(N + 1);
                let got = to_host_f32(
                    Prefill::run(&m, &ids[..N], &mut cache, FillOptions::fill(&maps, rows))
                        .map(|f| f.logits)
                        .unwrap(),
                );
                let d = common::max_abs_diff(&full, &got);
                assert!(
                    d < 1e-4,
                    "{name} kernels {cpu_kernels} {rows:?}: max |Δ| {d}"
                );
                let next = to_host_f32(m.decode_step(ids[N], &mut cache).unwrap());
                let d = common::max_abs_diff(&full_next, &next);
                assert!(
                    d < 1e-4,
                    "{name} kernels {cpu_kernels} {rows:?}: decode max |Δ| {d}"
                );
            }
            // Plain fill (random maps) differs from full, and stays finite.
            let rows = FillRows {
                sink: 1,
                tail: 3,
                ..FillRows::default()
            };
            let got = fill::fill_logits(&m, &ids[..N], &maps, rows);
            assert!(got.iter().all(|x| x.is_finite()), "{name}");
            assert!(
                common::max_abs_diff(&full, &got) > 1e-4,
                "{name}: fill had no effect"
            );
        }
    }
}

/// A sliding window at least as long as the prompt changes nothing; a short one changes the
/// logits, and does so exactly as the reference's window does (checked above), on both CPU
/// paths and for decode steps past the window.
#[test]
fn sliding_window_longer_than_the_prompt_is_full_attention() {
    const N: usize = 16;
    let cfg = gemma3();
    for cpu_kernels in [true, false] {
        let windowed = model(&cfg, cpu_kernels);
        let mut wide = model(&cfg, cpu_kernels);
        for layer in &mut wide.layers {
            layer.window = layer.window.map(|_| N);
        }
        let mut open = model(&cfg, cpu_kernels);
        for layer in &mut open.layers {
            layer.window = None;
        }
        let ids = prompt(N, cfg.vocab_size);
        let run = |m: &Decoder| to_host_f32(m.prefill(&ids, &mut m.new_cache(N)).unwrap());
        let (a, b, c) = (run(&windowed), run(&wide), run(&open));
        assert!(common::max_abs_diff(&b, &c) < 1e-5, "window N vs none");
        assert!(
            common::max_abs_diff(&a, &c) > 1e-3,
            "window 5 vs none: no effect"
        );
        // Decode steps well past the window against the reference.
        let mut cache = windowed.new_cache(N);
        windowed.prefill(&ids[..3], &mut cache).unwrap();
        let mut last = Vec::new();
        for &t in &ids[3..] {
            last = to_host_f32(windowed.decode_step(t, &mut cache).unwrap());
        }
        let want = reference(&windowed, &ids, None);
        let d = diff(&last, &want[N - 1]);
        assert!(
            d < TOL,
            "kernels {cpu_kernels}: decode vs reference max |Δ| {d}"
        );
        let windows: Vec<Option<usize>> = vec![None; cfg.num_hidden_layers];
        let d = diff(&c, &reference(&open, &ids, Some(&windows))[N - 1]);
        assert!(d < TOL, "no window vs reference max |Δ| {d}");
    }
}

/// Sliding-window layers above the split fill only the rows an exact row can reach: logits and
/// decode steps past the prompt equal filling every row, with plain fill and with chosen spans,
/// and the unreachable rows really are left unwritten.
#[test]
fn sliding_layers_fill_only_rows_in_reach() {
    const N: usize = 40;
    const DECODE: usize = 6;
    let cfg = gemma3();
    let slides = cfg.layer_window(2).expect("layer 2 slides");
    for cpu_kernels in [true, false] {
        let m = model(&cfg, cpu_kernels);
        let ids = prompt(N + DECODE, cfg.vocab_size);
        let maps = random_maps(&m, 1);
        let every = maps.filling_unread();
        let plain = FillRows {
            sink: 1,
            tail: 3,
            ..FillRows::default()
        };
        let spans = FillRows {
            exact: 0.25,
            span: 1,
            ..plain
        };
        for rows in [plain, spans] {
            let run = |maps: &FillMaps| {
                let mut cache = m.new_cache(N + DECODE);
                let mut out = vec![to_host_f32(
                    Prefill::run(&m, &ids[..N], &mut cache, FillOptions::fill(maps, rows))
                        .map(|f| f.logits)
                        .unwrap(),
                )];
                for &t in &ids[N..] {
                    out.push(to_host_f32(m.decode_step(t, &mut cache).unwrap()));
                }
                (out, cache)
            };
            let (got, cache) = run(&maps);
            let (want, full_cache) = run(&every);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let d = common::max_abs_diff(a, b);
                assert!(
                    d < 1e-5,
                    "kernels {cpu_kernels} {rows:?} step {i}: max |Δ| {d}"
                );
            }
            // Row 5 is out of every exact row's reach on plain fill: never written.
            let row = |c: &ridgefill::model::KvCache| to_host_f32(c.read(2).0.narrow(2, 5, 1));
            assert!(row(&full_cache).iter().any(|&x| x != 0.0));
            if rows == plain {
                assert!(N - 3 > 5 + slides);
                assert!(row(&cache).iter().all(|&x| x == 0.0), "row 5 was filled");
            }
        }
    }
}

/// The fused flex kernels still take every Qwen block (biases and q/k norms live in the
/// projection), and no Gemma 3 block.
#[test]
fn fused_kernels_gate_by_block_features() {
    for (name, cfg) in families() {
        let m = model(&cfg, true);
        let fused: Vec<bool> = (0..m.num_layers()).map(|l| m.fused_block(l)).collect();
        let want = name != "gemma3";
        assert!(fused.iter().all(|&f| f == want), "{name}: {fused:?}");
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_matches_flex_on_every_family() {
    const N: usize = 12;
    let dev = common::wgpu();
    for (name, cfg) in families() {
        let flex = model(&cfg, true);
        let gpu = Decoder::random(cfg.clone(), &dev.device, FloatDType::F32, CAPACITY, 17).unwrap();
        let ids = prompt(N, cfg.vocab_size);
        let a = to_host_f32(
            flex.forward_all_logits(&ids, &mut flex.new_cache(N))
                .unwrap(),
        );
        let b = to_host_f32(gpu.forward_all_logits(&ids, &mut gpu.new_cache(N)).unwrap());
        let d = common::max_abs_diff(&a, &b);
        assert!(d < TOL, "{name}: flex vs wgpu max |Δ| {d}");
    }
}
