//! One decoder, several families: random Qwen2, Qwen3 and Gemma 3 models (their switches as
//! config data) checked against a plain f64 host forward written from the transformers
//! definitions, cached against uncached, skip-and-fill with every row exact against full
//! prefill, and sliding windows against a window longer than the prompt. Both CPU code paths
//! (fused kernels where a block allows them, plain burn ops) are checked.

mod common;

use ridgefill::io::config::{Activation, ModelConfig};
use ridgefill::model::Decoder;
use ridgefill::model::fill::{FillMaps, FillOptions, FillRows, Prefill};
use ridgefill::model::{Device, FloatDType, Tensor, to_host_f32};

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

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

fn host<const D: usize>(t: &Tensor<D>) -> Vec<f64> {
    to_host_f32(t.clone()).into_iter().map(f64::from).collect()
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

/// `x · W` for a row-major `[in, out]` weight.
fn vecmat(x: &[f64], w: &[f64]) -> Vec<f64> {
    let out = w.len() / x.len();
    let mut y = vec![0.0; out];
    for (i, xi) in x.iter().enumerate() {
        for (o, yo) in y.iter_mut().enumerate() {
            *yo += xi * w[i * out + o];
        }
    }
    y
}

fn rope(x: &mut [f64], pos: usize, theta: f64) {
    let hd = x.len();
    let half = hd / 2;
    for i in 0..half {
        let f = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
        let (s, c) = (pos as f64 * f).sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

fn softcap(x: f64, cap: Option<f64>) -> f64 {
    cap.map_or(x, |c| c * (x / c).tanh())
}

/// Plain f64 forward from the model's own tensors, following transformers' Llama / Qwen2 /
/// Qwen3 / Gemma 3 code (`window` per layer overrides the model's when given); returns the
/// logits of every position.
fn reference(m: &Decoder, tokens: &[u32], windows: Option<&[Option<usize>]>) -> Vec<Vec<f64>> {
    let c = &m.config;
    let (d, hd, nh, nkv) = (
        c.hidden_size,
        c.head_dim(),
        c.num_attention_heads,
        c.num_key_value_heads,
    );
    let (q_dim, kv_dim, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
    let eps = c.rms_norm_eps;
    let emb = host(&m.embed_tokens.embedding_dense(&m.device, m.dtype));
    let scale = c.embed_scale.map_or(1.0, |s| f64::from(s as f32));
    let mut hs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            let row = &emb[t as usize * d..(t as usize + 1) * d];
            row.iter().map(|v| v * scale).collect()
        })
        .collect();
    let n = hs.len();
    for (l, layer) in m.layers.iter().enumerate() {
        let window = windows.map_or(layer.window, |w| w[l]);
        let theta = if layer.local_rope {
            c.rope_local_base_freq.unwrap()
        } else {
            c.rope_theta
        };
        let (ln1, wqkv) = (
            host(&layer.pre_attn_norm),
            host(&layer.qkv_proj.dense(&m.device, m.dtype)),
        );
        let bias = layer.qkv_bias.as_ref().map(host);
        let (qn, kn) = (
            layer.q_norm.as_ref().map(host),
            layer.k_norm.as_ref().map(host),
        );
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, h) in hs.iter().enumerate() {
            let mut y = vecmat(&rms_norm(h, &ln1, eps), &wqkv);
            if let Some(b) = &bias {
                y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
            let mut q = y[..q_dim].to_vec();
            let mut k = y[q_dim..q_dim + kv_dim].to_vec();
            for (x, w) in [(&mut q, &qn), (&mut k, &kn)] {
                for head in x.chunks_mut(hd) {
                    if let Some(w) = w {
                        let normed = rms_norm(head, w, eps);
                        head.copy_from_slice(&normed);
                    }
                    rope(head, pos, theta);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(y[q_dim + kv_dim..].to_vec());
        }
        let att_scale = 1.0 / c.query_pre_attn_scalar.unwrap_or(hd as f64).sqrt();
        let group = nh / nkv;
        let wo = host(&layer.o_proj.dense(&m.device, m.dtype));
        let post_attn = layer.post_attn_norm.as_ref().map(host);
        let pre_mlp = host(&layer.pre_mlp_norm);
        let post_mlp = layer.post_mlp_norm.as_ref().map(host);
        let (wgu, wd) = (
            host(&layer.gate_up_proj.dense(&m.device, m.dtype)),
            host(&layer.down_proj.dense(&m.device, m.dtype)),
        );
        for i in 0..n {
            let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
            let mut attn = vec![0.0; q_dim];
            for h in 0..nh {
                let kvh = h / group;
                let q = &qs[i][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (lo..=i)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        let s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * att_scale;
                        softcap(s, c.attn_logit_softcapping)
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for (jj, ej) in e.iter().enumerate() {
                    let j = lo + jj;
                    for t in 0..hd {
                        attn[h * hd + t] += ej / z * vs[j][kvh * hd + t];
                    }
                }
            }
            let mut o = vecmat(&attn, &wo);
            if let Some(w) = &post_attn {
                o = rms_norm(&o, w, eps);
            }
            hs[i].iter_mut().zip(&o).for_each(|(h, o)| *h += o);
            let gu = vecmat(&rms_norm(&hs[i], &pre_mlp, eps), &wgu);
            let act: Vec<f64> = (0..ff)
                .map(|j| {
                    let (g, u) = (gu[j], gu[ff + j]);
                    let a = match c.hidden_act {
                        Activation::Silu => g / (1.0 + (-g).exp()),
                        Activation::GeluTanh => {
                            let k = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh())
                        }
                    };
                    a * u
                })
                .collect();
            let mut y = vecmat(&act, &wd);
            if let Some(w) = &post_mlp {
                y = rms_norm(&y, w, eps);
            }
            hs[i].iter_mut().zip(&y).for_each(|(h, y)| *h += y);
        }
    }
    let (norm, head) = (host(&m.norm), host(&m.lm_head.dense(&m.device, m.dtype)));
    hs.iter()
        .map(|h| {
            vecmat(&rms_norm(h, &norm, eps), &head)
                .into_iter()
                .map(|x| softcap(x, c.final_logit_softcapping))
                .collect()
        })
        .collect()
}

fn diff(a: &[f32], b: &[f64]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).abs() as f32)
        .fold(0.0, f32::max)
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
    let c = &m.config;
    let rows = (c.hidden_size + 1) * c.kv_dim();
    let mut x = 0.1f32;
    let mut next = || {
        x = (x * 3.7 + 0.31).fract();
        x - 0.5
    };
    let mut maps = || {
        (split..c.num_hidden_layers)
            .map(|_| (0..rows).map(|_| next()).collect())
            .collect::<Vec<Vec<f32>>>()
    };
    let (k, v) = (maps(), maps());
    FillMaps::from_host(
        split,
        c.hidden_size,
        c.kv_dim(),
        &k,
        &v,
        FloatDType::F32,
        &m.device,
    )
    .unwrap()
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
            let got = to_host_f32(
                Prefill::run(
                    &m,
                    &ids[..N],
                    &mut m.new_cache(N),
                    FillOptions::fill(&maps, rows),
                )
                .map(|f| f.logits)
                .unwrap(),
            );
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
