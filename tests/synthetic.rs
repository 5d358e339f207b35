//! A tiny random Llama, written by the test as GGUF (llama.cpp conventions, permuted Q/K) and as a
//! Hugging Face directory: no network. Checks the burn model against a plain host reference
//! forward, GGUF against HF, cached against uncached, skip-and-fill against full, flex against wgpu.

mod common;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::fill::{self, FillMaps, FillOptions, FillRows, Filled, Oracle, Prefill};
use ridgefill::model::{Decoder, KvCache};
use ridgefill::model::{Device, FloatDType, Weight, WeightFormat, to_host_f32};
use ridgefill_testkit::fill::{fill_logits, gqa_model, spans_rows, stand_in_precision};
use ridgefill_testkit::reference::{Reference, max_abs_diff_f64};
use ridgefill_testkit::{self as testkit, prompt, tiny};

/// Agreement expected between two f32 implementations of the same tiny model.
const TOL: f32 = 1e-3;

struct Fixture {
    _dir: tempfile::TempDir,
    gguf: Checkpoint,
    hf: Checkpoint,
}

fn fixture() -> Fixture {
    common::init();
    let t = tiny::tiny();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let hf = dir.path().join("hf");
    tiny::write_gguf(&t, &gguf, &tiny::Faults::default());
    tiny::write_hf_dir(&t, &hf, &tiny::Faults::default());
    Fixture {
        gguf: Checkpoint::open(&gguf).unwrap(),
        hf: Checkpoint::open(&hf).unwrap(),
        _dir: dir,
    }
}

/// Last-position logits of the f64 reference, with the weights read from the checkpoint.
fn reference_logits(ck: &Checkpoint, tokens: &[u32]) -> Vec<f32> {
    let all = Reference::from_checkpoint(ck).logits(tokens);
    all.last().unwrap().iter().map(|&v| v as f32).collect()
}

fn flex_model(ck: &Checkpoint) -> Decoder {
    common::load_on(ck, &Device::flex())
}

#[test]
fn burn_model_matches_host_reference_forward() {
    let f = fixture();
    let model = flex_model(&f.hf);
    let ids = prompt(11, model.config.vocab_size);
    let want = reference_logits(&f.hf, &ids);
    let got = to_host_f32(
        model
            .prefill(&ids, &mut model.new_cache(ids.len()))
            .unwrap(),
    );
    let d = common::max_abs_diff(&got, &want);
    assert!(d < TOL, "burn vs host reference max |Δ| {d}");
}

/// The reference reads the same weights from either source: a checkpoint by its tensor names, or
/// a model loaded from it, dense or in blocks (GGUF's Q8_0 and f16 tensors held natively).
#[test]
fn reference_from_checkpoint_equals_reference_from_model() {
    let f = fixture();
    for ck in [&f.hf, &f.gguf] {
        let ids = prompt(9, ck.config.vocab_size);
        let want = Reference::from_checkpoint(ck).logits(&ids);
        for weights in [WeightFormat::F32, WeightFormat::Native] {
            let m = common::load_with(ck, &Device::flex(), weights);
            let got = Reference::from_decoder(&m).logits(&ids);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let a: Vec<f32> = a.iter().map(|&v| v as f32).collect();
                let d = max_abs_diff_f64(&a, b);
                assert!(
                    d < 1e-5,
                    "{:?} {weights:?} ({}) position {i}: max |Δ| {d}",
                    ck.format,
                    m.weights_held()
                );
            }
        }
    }
}

#[test]
fn gguf_and_hf_checkpoints_give_the_same_logits() {
    let f = fixture();
    let (a, b) = (flex_model(&f.gguf), flex_model(&f.hf));
    let ids = prompt(9, a.config.vocab_size);
    let la = to_host_f32(a.prefill(&ids, &mut a.new_cache(ids.len())).unwrap());
    let lb = to_host_f32(b.prefill(&ids, &mut b.new_cache(ids.len())).unwrap());
    assert!(common::max_abs_diff(&la, &lb) < 1e-5);
}

#[test]
fn cached_decode_equals_uncached_forward() {
    let f = fixture();
    let model = flex_model(&f.hf);
    let ids = prompt(12, model.config.vocab_size);
    let mut cache = model.new_cache(ids.len());
    model.prefill(&ids[..5], &mut cache).unwrap();
    for (i, &t) in ids[5..].iter().enumerate() {
        let step = to_host_f32(model.decode_step(t, &mut cache).unwrap());
        let prefix = &ids[..5 + i + 1];
        let full = to_host_f32(
            model
                .prefill(prefix, &mut model.new_cache(prefix.len()))
                .unwrap(),
        );
        let d = common::max_abs_diff(&step, &full);
        assert!(d < TOL, "step {i}: cached vs uncached max |Δ| {d}");
    }
}

#[test]
fn all_position_logits_end_with_prefill_logits() {
    let f = fixture();
    let model = flex_model(&f.hf);
    let ids = prompt(8, model.config.vocab_size);
    let all = to_host_f32(
        model
            .forward_all_logits(&ids, &mut model.new_cache(8))
            .unwrap(),
    );
    let last = to_host_f32(model.prefill(&ids, &mut model.new_cache(8)).unwrap());
    let v = model.config.vocab_size;
    assert!(common::max_abs_diff(&all[7 * v..], &last) < 1e-5);
}

fn random_maps(model: &Decoder, split: usize, seed: u64) -> FillMaps {
    let mut rng = tiny::Rng::new(seed);
    testkit::fill::random_maps(model, split, || rng.next_f32())
}

#[test]
fn skip_fill_with_whole_prompt_as_tail_equals_full_prefill() {
    let f = fixture();
    let model = flex_model(&f.hf);
    let ids = prompt(10, model.config.vocab_size);
    let maps = random_maps(&model, 1, 3);
    let full = to_host_f32(model.prefill(&ids, &mut model.new_cache(10)).unwrap());
    let rows = FillRows {
        sink: 1,
        tail: ids.len(),
        ..FillRows::default()
    };
    let fill = fill_logits(&model, &ids, &maps, rows);
    assert!(common::max_abs_diff(&full, &fill) < 1e-5);
}

#[test]
fn skip_fill_writes_the_maps_predictions_into_the_cache() {
    let f = fixture();
    let model = flex_model(&f.hf);
    let ids = prompt(10, model.config.vocab_size);
    let maps = random_maps(&model, 1, 5);
    let rows = FillRows {
        sink: 1,
        tail: 3,
        ..FillRows::default()
    };
    let mut cache = model.new_cache(10);
    let fill = to_host_f32(
        Prefill::run(&model, &ids, &mut cache, FillOptions::fill(&maps, rows))
            .map(|f| f.logits)
            .unwrap(),
    );
    assert_eq!(cache.len(), 10);
    // Exact-vs-filled differs: the random maps are not the model.
    let full = to_host_f32(model.prefill(&ids, &mut model.new_cache(10)).unwrap());
    assert!(common::max_abs_diff(&full, &fill) > 1e-3);
    // Bulk V at layer 1 equals features · V-map, computed independently on the host.
    let c = &model.config;
    let h = model.embed(&ids).unwrap();
    let h1 = model
        .forward_layers(h, 0..1, &mut model.new_cache(10), 0)
        .unwrap();
    let feats = to_host_f32(fill::features(&model, h1));
    let w = to_host_f32(maps.w.clone());
    let (d1, kvd, cols) = (c.hidden_size + 1, c.kv_dim(), 2 * c.kv_dim());
    let v_cache = to_host_f32(cache.v[1].clone());
    let (hd, cap) = (c.head_dim(), cache.capacity());
    for pos in 1..7 {
        for j in 0..kvd {
            let want: f32 = (0..d1)
                .map(|r| feats[pos * d1 + r] * w[r * cols + kvd + j])
                .sum();
            let (head, t) = (j / hd, j % hd);
            let got = v_cache[(head * cap + pos) * hd + t];
            assert!(
                (got - want).abs() < 1e-3 * (1.0 + want.abs()),
                "pos {pos} col {j}: {got} vs {want}"
            );
        }
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_matches_flex_on_tiny_model() {
    let f = fixture();
    let flex = flex_model(&f.hf);
    let dev = common::wgpu();
    let gpu = common::load_on(&f.hf, &dev.device);
    let ids = prompt(13, flex.config.vocab_size);
    let a = to_host_f32(flex.prefill(&ids, &mut flex.new_cache(13)).unwrap());
    let b = to_host_f32(gpu.prefill(&ids, &mut gpu.new_cache(13)).unwrap());
    let d = common::max_abs_diff(&a, &b);
    assert!(d < TOL, "flex vs wgpu max |Δ| {d}");
    let maps = random_maps(&flex, 1, 9);
    let maps_gpu = FillMaps {
        split: 1,
        w: maps.w.clone().to_device(&dev.device),
        adapt: None,
        fill_unread: false,
        breaks: Vec::new(),
        stops: Vec::new(),
        deeper: None,
    };
    let rows = FillRows {
        sink: 1,
        tail: 4,
        ..FillRows::default()
    };
    let a = fill_logits(&flex, &ids, &maps, rows);
    let b = fill_logits(&gpu, &ids, &maps_gpu, rows);
    let d = common::max_abs_diff(&a, &b);
    assert!(d < TOL, "skip-fill flex vs wgpu max |Δ| {d}");
    // Query-chosen spans and the per-prompt update: masks, gathers and the k×k solve.
    let eye = stand_in_precision(&flex);
    let maps = maps
        .with_adapt(&eye, 100.0, FloatDType::F32, &flex.device)
        .unwrap();
    let maps_gpu = maps_gpu
        .with_adapt(&eye, 100.0, FloatDType::F32, &dev.device)
        .unwrap();
    let rows = spans_rows(4, 0.2, 1);
    let a = fill_logits(&flex, &ids, &maps, rows);
    let b = fill_logits(&gpu, &ids, &maps_gpu, rows);
    let d = common::max_abs_diff(&a, &b);
    assert!(d < TOL, "spans-adapt flex vs wgpu max |Δ| {d}");
}

/// The fused flex kernels against the plain burn ops on one random model: a prompt long enough
/// for every kernel's parallel path and several attention query blocks, a second prefill chunk
/// after cached rows, decode steps and skip-and-fill, with grouped-query heads.
#[test]
fn fused_cpu_kernels_match_plain_burn_ops() {
    common::init();
    const PROMPT: usize = 300;
    const CHUNK: usize = 70;
    const STEPS: usize = 3;
    let config: ridgefill::io::config::ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 512,
        "max_position_embeddings": 1024, "tie_word_embeddings": true
    }))
    .unwrap();
    let capacity = PROMPT + CHUNK + STEPS;
    // The same seed gives the same weights.
    let model = || {
        Decoder::random(
            config.clone(),
            &Device::flex(),
            FloatDType::F32,
            capacity,
            7,
        )
    };
    let fused = model().unwrap();
    assert!(fused.cpu_kernels(), "flex f32 must take the fused kernels");
    let mut plain = model().unwrap();
    plain.set_cpu_kernels(false);
    let ids = prompt(capacity, fused.config.vocab_size);
    let (mut ca, mut cb) = (fused.new_cache(capacity), plain.new_cache(capacity));
    let check = |what: &str, a: Vec<f32>, b: Vec<f32>| {
        let d = common::max_abs_diff(&a, &b);
        assert!(d < TOL, "{what}: fused vs plain max |Δ| {d}");
    };
    let all =
        |m: &Decoder, c: &mut _| to_host_f32(m.forward_all_logits(&ids[..PROMPT], c).unwrap());
    check(
        "prefill, every position",
        all(&fused, &mut ca),
        all(&plain, &mut cb),
    );
    let chunk = &ids[PROMPT..PROMPT + CHUNK];
    check(
        "second chunk after cached rows",
        to_host_f32(fused.prefill(chunk, &mut ca).unwrap()),
        to_host_f32(plain.prefill(chunk, &mut cb).unwrap()),
    );
    for &t in &ids[PROMPT + CHUNK..] {
        check(
            "decode step",
            to_host_f32(fused.decode_step(t, &mut ca).unwrap()),
            to_host_f32(plain.decode_step(t, &mut cb).unwrap()),
        );
    }
    let maps = random_maps(&fused, 1, 11);
    let rows = FillRows {
        sink: 1,
        tail: 40,
        ..FillRows::default()
    };
    check(
        "skip-and-fill prefill",
        fill_logits(&fused, &ids[..PROMPT], &maps, rows),
        fill_logits(&plain, &ids[..PROMPT], &maps, rows),
    );
    let eye = stand_in_precision(&fused);
    let maps = maps
        .with_adapt(&eye, 100.0, FloatDType::F32, &fused.device)
        .unwrap();
    let rows = spans_rows(40, 0.1, 4);
    let (a, spans) = Prefill::run(
        &fused,
        &ids[..PROMPT],
        &mut fused.new_cache(PROMPT),
        FillOptions::fill(&maps, rows),
    )
    .map(|f| (f.logits, f.spans))
    .unwrap();
    assert!(
        spans.len() > 1,
        "several spans were to be chosen: {spans:?}"
    );
    // The tail's ranking of the bulk (fused: `cpu::attention_received`) picks the same spans.
    let plain_spans = Prefill::run(
        &plain,
        &ids[..PROMPT],
        &mut plain.new_cache(PROMPT),
        FillOptions::fill(&maps, rows),
    )
    .unwrap()
    .spans;
    assert_eq!(
        spans, plain_spans,
        "fused and plain tails chose other spans"
    );
    check(
        "spans-adapt prefill",
        to_host_f32(a),
        fill_logits(&plain, &ids[..PROMPT], &maps, rows),
    );
}

/// The self-check: random maps err on every exact row, so a threshold of zero sends the prompt
/// through every layer exactly — full prefill's logits and cache, chunk for chunk — while no
/// threshold keeps the fill; the report says which happened.
#[test]
fn a_failed_self_check_runs_the_prompt_exactly() {
    let (model, ids, maps) = self_check_fixture();
    let mut full_cache = model.new_cache(N + 1);
    let full = to_host_f32(model.prefill(&ids[..N], &mut full_cache).unwrap());
    let full_next = to_host_f32(model.decode_step(ids[N], &mut full_cache).unwrap());
    let strict = FillRows {
        max_error: 0.0,
        ..spans_rows(4, 0.1, 4)
    };
    let mut cache = model.new_cache(N + 1);
    let f = fill_into(&model, &maps, &ids[..N], strict, &mut cache);
    assert!(f.report.fell_back, "{:?}", f.report);
    assert_eq!((f.report.filled, f.report.prompt), (0, N));
    assert!(f.report.error.is_some_and(|e| e > 0.0), "{:?}", f.report);
    assert!(f.spans.is_empty());
    assert_eq!(to_host_f32(f.logits), full, "fallback vs full prefill");
    let next = to_host_f32(model.decode_step(ids[N], &mut cache).unwrap());
    assert_eq!(next, full_next, "decode after the fallback");

    let lax = spans_rows(4, 0.1, 4);
    let f = fill_into(&model, &maps, &ids[..N], lax, &mut model.new_cache(N));
    let spanned: usize = f.spans.iter().map(|s| s.len()).sum();
    assert!(!f.report.fell_back);
    assert_eq!(f.report.filled, N - 1 - 4 - spanned);
    assert!(common::max_abs_diff(&full, &to_host_f32(f.logits)) > 1e-3);
}

/// With `retry_exact`, a failed self-check fills the prompt again with that share of its rows
/// in spans: the same prefill as one run with that share from the start (the failed pass leaves
/// nothing behind), reported as widened, not fallen back.
#[test]
fn a_failed_self_check_fills_again_with_more_rows_exact() {
    let (model, ids, maps) = self_check_fixture();
    let retry = FillRows {
        max_error: 0.0,
        retry_exact: 0.3,
        ..spans_rows(4, 0.1, 4)
    };
    let mut cache = model.new_cache(N + 1);
    let f = fill_into(&model, &maps, &ids[..N], retry, &mut cache);
    assert!(f.report.widened && !f.report.fell_back, "{:?}", f.report);
    assert!(f.report.error.is_some_and(|e| e > 0.0), "{:?}", f.report);

    let mut direct_cache = model.new_cache(N + 1);
    let d = fill_into(
        &model,
        &maps,
        &ids[..N],
        spans_rows(4, 0.3, 4),
        &mut direct_cache,
    );
    assert!(!d.report.widened && !d.report.fell_back);
    assert_eq!(f.spans, d.spans);
    assert_eq!(f.report.filled, d.report.filled);
    let lax = spans_rows(4, 0.1, 4);
    let lax = fill_into(&model, &maps, &ids[..N], lax, &mut model.new_cache(N));
    assert!(f.report.filled < lax.report.filled, "{:?}", f.report);
    assert_eq!(
        to_host_f32(f.logits),
        to_host_f32(d.logits),
        "retry vs direct"
    );
    let next = to_host_f32(model.decode_step(ids[N], &mut cache).unwrap());
    let direct_next = to_host_f32(model.decode_step(ids[N], &mut direct_cache).unwrap());
    assert_eq!(next, direct_next, "decode after the retry");
}

/// The self-check tests' model, an `N + 1`-token prompt (its last token decoded after the
/// prefill) and random maps, whose error any threshold near 0 fails.
fn self_check_fixture() -> (Decoder, Vec<u32>, FillMaps) {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(N + 1, model.config.vocab_size);
    let maps = random_maps(&model, 2, 21);
    (model, ids, maps)
}

/// A skip-and-fill prefill of `ids` into `cache` with `maps` and `rows`.
fn fill_into(
    model: &Decoder,
    maps: &FillMaps,
    ids: &[u32],
    rows: FillRows,
    cache: &mut KvCache,
) -> Filled {
    Prefill::run(model, ids, cache, FillOptions::fill(maps, rows)).unwrap()
}

/// Prompt rows of the ladder tests: more than one prefill chunk.
const N: usize = ridgefill::model::decoder::PREFILL_CHUNK + 70;
/// Layers of their model: the last one's own K/V projection is the exact deeper split.
const LAYERS: usize = 4;

/// The ladder tests' model, an `N`-token prompt and full prefill's last logits for it.
fn ladder_fixture() -> (Decoder, Vec<u32>, Vec<f32>) {
    common::init();
    let model = gqa_model(LAYERS, true);
    let ids = prompt(N, model.config.vocab_size);
    let full = to_host_f32(model.prefill(&ids, &mut model.new_cache(N)).unwrap());
    (model, ids, full)
}

/// A failed self-check tries the deeper split's maps first: here the last layer's own K/V
/// projection, which is exact, so the prompt fills that layer, passes, and matches full
/// prefill, having run exactly only up to the deeper split.
#[test]
fn a_failed_self_check_tries_the_deeper_split_first() {
    let (model, ids, full) = ladder_fixture();
    let exact_last = FillMaps::own_proj(&model, LAYERS - 1).unwrap();
    let maps = random_maps(&model, 1, 21).with_deeper(exact_last).unwrap();
    let rows = FillRows {
        max_error: 1e-3,
        ..spans_rows(4, 0.1, 4)
    };
    let f = Prefill::run(
        &model,
        &ids,
        &mut model.new_cache(N),
        FillOptions::fill(&maps, rows),
    )
    .unwrap();
    assert_eq!(f.report.split, Some(LAYERS - 1), "{:?}", f.report);
    assert!(f.report.error.is_some_and(|e| e < 1e-3), "{:?}", f.report);
    assert!(f.report.filled > 0 && !f.report.fell_back);
    let d = common::max_abs_diff(&full, &to_host_f32(f.logits));
    assert!(d < 1e-4, "deeper exact fill vs full max |Δ| {d}");
    assert!(
        random_maps(&model, 2, 1)
            .with_deeper(random_maps(&model, 2, 1))
            .is_err()
    );
}

/// The coverage check: spans that take less of the tail's attention to the filled bulk than
/// `min_coverage` send a fresh prompt to the deeper split's maps before any upper layer runs
/// at this one (here the last layer's own projection: exact, so full prefill's logits); with
/// no deeper maps the check changes nothing, and the report gives the coverage either way.
#[test]
fn spans_that_cover_too_little_send_the_prompt_deeper() {
    let (model, ids, full) = ladder_fixture();
    let run = |maps: &FillMaps, min_coverage: f64| {
        let rows = FillRows {
            min_coverage,
            ..spans_rows(4, 0.1, 4)
        };
        Prefill::run(
            &model,
            &ids,
            &mut model.new_cache(N),
            FillOptions::fill(maps, rows),
        )
        .unwrap()
    };
    let ladder = || {
        random_maps(&model, 2, 21)
            .with_deeper(FillMaps::own_proj(&model, LAYERS - 1).unwrap())
            .unwrap()
    };
    let kept = run(&ladder(), 0.0);
    let coverage = kept.report.coverage.expect("spans were chosen");
    assert!(coverage > 0.0 && coverage < 1.0, "{:?}", kept.report);
    assert_eq!(kept.report.split, Some(2), "{:?}", kept.report);
    assert!(common::max_abs_diff(&full, &to_host_f32(kept.logits)) > 1e-3);

    // Just above what the spans take: the deeper split fills.
    let deep = run(&ladder(), coverage + 1e-6);
    assert_eq!(deep.report.split, Some(LAYERS - 1), "{:?}", deep.report);
    assert!(deep.report.filled > 0 && !deep.report.fell_back);
    let d = common::max_abs_diff(&full, &to_host_f32(deep.logits));
    assert!(d < 1e-4, "deeper exact fill vs full max |Δ| {d}");

    // Without deeper maps the check has nowhere to send the prompt.
    let alone = run(&random_maps(&model, 2, 21), 1.0);
    assert_eq!(alone.report.split, Some(2), "{:?}", alone.report);
    assert_eq!(alone.report.coverage, Some(coverage));
    assert!(!alone.report.fell_back && alone.report.filled > 0);
}

/// A prompt sent to the deeper split is filled exactly as a fill at that split alone fills it:
/// same report, same logits (the ladder's lower layers are the standalone run's; the deeper
/// maps keep their per-prompt update), on a Llama and on a Gemma-like model whose layers slide
/// over a short window between global ones.
#[test]
fn a_prompt_sent_deeper_equals_a_fill_at_the_deeper_split() {
    common::init();
    const N: usize = ridgefill::model::decoder::PREFILL_CHUNK + 70;
    let sliding: ridgefill::io::config::ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
        "head_dim": 16, "num_hidden_layers": 9, "num_attention_heads": 4,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": 256,
        "max_position_embeddings": 1024, "sliding_window": 24, "sliding_window_pattern": 3
    }))
    .unwrap();
    let sliding = Decoder::random(sliding, &Device::flex(), FloatDType::F32, 512, 3).unwrap();
    assert_eq!(sliding.layers[5].window, None);
    assert!(sliding.layers[4].window.is_some());
    // (model, split, deeper split): the deeper split's scoring layer lies above the split.
    for (model, split, deep) in [(gqa_model(6, true), 2, 4), (sliding, 3, 6)] {
        let ids = prompt(N, model.config.vocab_size);
        let rows = spans_rows(4, 0.1, 4);
        // Both splits update their maps per prompt, configured as a run configures them.
        let eye = stand_in_precision(&model);
        let adapting = |split, seed| {
            let maps = random_maps(&model, split, seed)
                .with_adapt(&eye, 100.0, FloatDType::F32, &model.device)
                .unwrap();
            move |deeper: Option<FillMaps>| {
                let maps = match deeper {
                    Some(d) => maps.with_deeper(d).unwrap(),
                    None => maps,
                };
                fill::FillMethod::SpansAdapt
                    .configure(&maps, rows)
                    .unwrap()
                    .0
            }
        };
        let alone_maps = adapting(deep, 8)(None);
        let mut alone_cache = model.new_cache(N + FOLLOW_UP);
        let alone = Prefill::run(
            &model,
            &ids,
            &mut alone_cache,
            FillOptions::fill(&alone_maps, rows),
        )
        .unwrap();
        let deeper = random_maps(&model, deep, 8)
            .with_adapt(&eye, 100.0, FloatDType::F32, &model.device)
            .unwrap();
        let ladder = adapting(split, 21)(Some(deeper));
        let ladder_rows = FillRows {
            min_coverage: 1.0,
            ..rows
        };
        let mut sent_cache = model.new_cache(N + FOLLOW_UP);
        let sent = Prefill::run(
            &model,
            &ids,
            &mut sent_cache,
            FillOptions::fill(&ladder, ladder_rows),
        )
        .unwrap();
        assert_eq!(sent.report.split, Some(deep), "{:?}", sent.report);
        assert_eq!(sent.spans, alone.spans);
        assert_eq!(sent.report, alone.report);
        assert_eq!(to_host_f32(sent.logits), to_host_f32(alone.logits));

        // The history is the deeper split's, so a follow-up (or a decode's restore) over the
        // ladder's cache resumes with the deeper maps, as over the deeper split's own cache.
        let (sent_h, alone_h) = (sent.history.unwrap(), alone.history.unwrap());
        assert_eq!((sent_h.split, alone_h.split), (deep, deep));
        assert!(sent_h.filled(N) > 0);
        let mut more = ids.clone();
        more.extend(prompt(FOLLOW_UP, model.config.vocab_size));
        let resume = |cache: &mut KvCache, h, maps, rows| {
            Prefill::resume(&model, &more, cache, h, FillOptions::fill(maps, rows))
                .unwrap()
                .finish(cache)
                .unwrap()
        };
        let a = resume(&mut alone_cache, alone_h, &alone_maps, rows);
        let b = resume(&mut sent_cache, sent_h, &ladder, ladder_rows);
        assert!(a.report.restored > 0, "{:?}", a.report);
        assert_eq!(a.report, b.report);
        assert_eq!(to_host_f32(a.logits), to_host_f32(b.logits));
    }
}

/// New tokens of the ladder test's follow-up prefill.
const FOLLOW_UP: usize = 24;

/// With the maps' line-break ids, the exact tail reaches back to the last line break before
/// the final question (here 30 rows from the end), not the fixed `tail`.
#[test]
fn the_exact_tail_grows_to_the_final_question() {
    common::init();
    const N: usize = 200;
    const BREAK: u32 = 7;
    let model = gqa_model(4, true);
    let mut ids: Vec<u32> = prompt(N, model.config.vocab_size)
        .into_iter()
        .map(|t| if t == BREAK { BREAK + 1 } else { t })
        .collect();
    ids[N - 31] = BREAK;
    let rows = FillRows {
        question: 64,
        ..spans_rows(4, 0.0, 0)
    };
    let run = |maps: &FillMaps| {
        Prefill::run(
            &model,
            &ids,
            &mut model.new_cache(N),
            FillOptions::fill(maps, rows),
        )
        .unwrap()
        .report
    };
    let maps = random_maps(&model, 2, 21);
    assert_eq!(run(&maps).tail, 4, "no line-break ids: the fixed tail");
    let report = run(&maps.with_breaks(vec![BREAK]));
    assert_eq!((report.tail, report.filled), (30, N - 1 - 30));
}

/// A random GQA model of `layers` layers for the span tests.
/// When the chosen span covers every bulk row, the exact pass is full prefill, with or without
/// the per-prompt update (every filled slot is overwritten), on both CPU code paths; decoding
/// after it continues identically.
#[test]
fn exact_pass_over_every_row_equals_full_prefill() {
    common::init();
    // Longer than a prefill chunk, so both sides run their prompt-length passes in chunks.
    const N: usize = ridgefill::model::decoder::PREFILL_CHUNK + 70;
    for cpu_kernels in [true, false] {
        let model = gqa_model(4, cpu_kernels);
        let ids = prompt(N + 1, model.config.vocab_size);
        let mut full_cache = model.new_cache(N + 1);
        let full = to_host_f32(model.prefill(&ids[..N], &mut full_cache).unwrap());
        let full_next = to_host_f32(model.decode_step(ids[N], &mut full_cache).unwrap());
        let plain = random_maps(&model, 2, 21);
        let eye = stand_in_precision(&model);
        let adapted = random_maps(&model, 2, 21)
            .with_adapt(&eye, 100.0, FloatDType::F32, &model.device)
            .unwrap();
        for maps in [&plain, &adapted] {
            let rows = spans_rows(4, 1.0, N);
            let mut cache = model.new_cache(N + 1);
            let (got, spans) =
                Prefill::run(&model, &ids[..N], &mut cache, FillOptions::fill(maps, rows))
                    .map(|f| (f.logits, f.spans))
                    .unwrap();
            assert_eq!(spans, vec![1..N - 4]);
            let d = common::max_abs_diff(&full, &to_host_f32(got));
            assert!(
                d < 1e-4,
                "kernels {cpu_kernels}: exact pass vs full max |Δ| {d}"
            );
            let next = to_host_f32(model.decode_step(ids[N], &mut cache).unwrap());
            let d = common::max_abs_diff(&full_next, &next);
            assert!(
                d < 1e-4,
                "kernels {cpu_kernels}: decode after it max |Δ| {d}"
            );
        }
    }
}

/// The diagnosis oracle: restoring every filled K and V from full prefill's cache makes plain
/// fill equal full prefill; restoring the keys alone does not (the values stay the random maps').
#[test]
fn oracle_restoring_every_filled_slot_equals_full_prefill() {
    common::init();
    const N: usize = 40;
    const SPLIT: usize = 2;
    let model = gqa_model(4, true);
    let ids = prompt(N, model.config.vocab_size);
    let mut truth = model.new_cache(N);
    let full = to_host_f32(model.prefill(&ids, &mut truth).unwrap());
    let maps = random_maps(&model, SPLIT, 5);
    let rows = spans_rows(4, 0.0, 0);
    let bulk = rows.bulk(N).unwrap();
    let run = |keys: bool, values: bool| {
        let oracle = Oracle {
            truth: &truth,
            layers: SPLIT..model.num_layers(),
            keys,
            values,
            rows: vec![bulk.clone()],
        };
        let (logits, spans) = Prefill::run(
            &model,
            &ids,
            &mut model.new_cache(N),
            FillOptions::fill(&maps, rows).with_oracle(&oracle),
        )
        .map(|f| (f.logits, f.spans))
        .unwrap();
        assert!(spans.is_empty());
        common::max_abs_diff(&full, &to_host_f32(logits))
    };
    let all = run(true, true);
    assert!(all < 1e-4, "every slot restored: max |Δ| {all}");
    let keys = run(true, false);
    assert!(
        keys > 1e-2,
        "keys alone restored: max |Δ| {keys}, expected a visible difference"
    );
}

/// A token whose key the tail's queries match in the last lower layer (built into the weights)
/// is found wherever it is planted: the one span the budget allows starts at it and runs on.
#[test]
fn chosen_spans_contain_a_planted_needle() {
    common::init();
    const N: usize = 300;
    const NEEDLE: u32 = 7;
    const SPLIT: usize = 2;
    // Large against the random weights' scale, so the needle dominates the scored layer.
    const GAIN: f32 = 8.0;
    let mut model = gqa_model(4, true);
    let c = model.config.clone();
    let (d, hd) = (c.hidden_size, c.head_dim());
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    // Embedding dims 0 and 1: only the needle has dim 0; every token carries dim 1.
    let mut emb = to_host_f32(
        model
            .embed_tokens
            .embedding_dense(&model.device, model.dtype),
    );
    for t in 0..c.vocab_size {
        emb[t * d] = if t as u32 == NEEDLE { GAIN } else { 0.0 };
        emb[t * d + 1] = GAIN;
    }
    model.embed_tokens = Weight::Dense(ridgefill::model::Tensor::from_data(
        ridgefill::model::TensorData::new(emb, [c.vocab_size, d]),
        &model.device,
    ));
    // Scored layer: q and k live in the slowest-rotating RoPE pair only (q from dim 1, k from
    // dim 0), so every query's score is large for the needle and zero elsewhere.
    let scored = SPLIT - 1;
    let width = q_dim + 2 * kv_dim;
    let mut w = to_host_f32(
        model.layers[scored]
            .qkv_proj
            .dense(&model.device, model.dtype),
    );
    let slow = hd / 2 - 1;
    for r in 0..d {
        for col in 0..q_dim + kv_dim {
            let head_col = col % hd;
            let want = match (col < q_dim, r, head_col == slow) {
                (true, 1, true) | (false, 0, true) => GAIN,
                _ => 0.0,
            };
            w[r * width + col] = want;
        }
    }
    model.layers[scored].qkv_proj = Weight::Dense(ridgefill::model::Tensor::from_data(
        ridgefill::model::TensorData::new(w, [d, width]),
        &model.device,
    ));
    let maps = random_maps(&model, SPLIT, 5);
    for at in [40, 150, 260] {
        let mut ids: Vec<u32> = prompt(N, c.vocab_size)
            .into_iter()
            .map(|t| if t == NEEDLE { NEEDLE + 1 } else { t })
            .collect();
        ids[at] = NEEDLE;
        let rows = spans_rows(8, 0.02, 4);
        let (_, spans) = Prefill::run(
            &model,
            &ids,
            &mut model.new_cache(N),
            FillOptions::fill(&maps, rows),
        )
        .map(|f| (f.logits, f.spans))
        .unwrap();
        // Radius 4: a span starts a row before its chosen row and reaches seven past it.
        assert!(
            spans.iter().any(|s| s.start < at && at + 8 <= s.end),
            "needle at {at}: no span covers it and the seven rows after it in {spans:?}"
        );
        let covered: usize = spans.iter().map(|s| s.len()).sum();
        assert!(covered <= rows.exact_rows(N), "{spans:?}");
    }
}

/// Synthetic block weights hold the dense model's values quantised (generated in their transposed
/// order): f16 blocks agree with the f32 model to f16 rounding, Q4_0 (what `native` gives a
/// synthetic model) to 4-bit rounding, and both hold a fraction of the dense bytes.
#[test]
fn synthetic_block_weights_quantise_the_dense_model() {
    common::init();
    let config: ridgefill::io::config::ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256,
        "max_position_embeddings": 1024, "tie_word_embeddings": true
    }))
    .unwrap();
    let build = |w: WeightFormat| {
        Decoder::random_with(config.clone(), &Device::flex(), FloatDType::F32, w, 64, 5).unwrap()
    };
    let ids = prompt(20, config.vocab_size);
    let logits = |m: &Decoder| to_host_f32(m.prefill(&ids, &mut m.new_cache(ids.len())).unwrap());
    let dense = build(WeightFormat::F32);
    let want = logits(&dense);
    let spread = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    // (format, held, largest logit error as a share of the largest logit, bytes per weight)
    for (w, held, tol, bytes) in [
        (WeightFormat::F16, "blocks (F16)", 2e-3, 2.0),
        (WeightFormat::Native, "blocks (Q4_0)", 0.15, 18.0 / 32.0),
    ] {
        let m = build(w);
        assert_eq!(m.weights_held(), held);
        let got = logits(&m);
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err <= tol * spread, "{held}: logit error {err} of {spread}");
        let ratio = m.weight_bytes() as f64 / dense.weight_bytes() as f64;
        assert!(
            ratio <= bytes / 4.0 * 1.1,
            "{held}: {ratio} of the dense bytes"
        );
    }
    // Off the CPU kernels (another dtype) block formats fall back to dense.
    let bf = Decoder::random_with(
        config.clone(),
        &Device::flex(),
        FloatDType::F16,
        WeightFormat::Native,
        64,
        5,
    );
    assert_eq!(bf.unwrap().weights_held(), "dense f16");
    // On a GPU the same Q4_0 blocks are packed for its kernel: 4-bit rounding off the dense
    // model, as on the CPU, for prefill (decoded into the GEMM) and decode (the packed kernel).
    // Exactness against the blocks' own values is `tests/native_weights.rs`'s check.
    #[cfg(feature = "wgpu")]
    {
        let gpu = common::wgpu().device;
        let packed = Decoder::random_with(
            config.clone(),
            &gpu,
            FloatDType::F32,
            WeightFormat::Native,
            64,
            5,
        )
        .unwrap();
        assert_eq!(packed.weights_held(), "packed (Q4_0)");
        let err = common::max_abs_diff(&logits(&packed), &want);
        assert!(
            err <= 0.15 * spread,
            "packed prefill vs dense: {err} of {spread}"
        );
        let (mut ca, mut cb) = (
            packed.new_cache(ids.len() + 1),
            dense.new_cache(ids.len() + 1),
        );
        packed.prefill(&ids, &mut ca).unwrap();
        dense.prefill(&ids, &mut cb).unwrap();
        let a = to_host_f32(packed.decode_step(ids[0], &mut ca).unwrap());
        let b = to_host_f32(dense.decode_step(ids[0], &mut cb).unwrap());
        let err = common::max_abs_diff(&a, &b);
        assert!(
            err <= 0.15 * spread,
            "packed decode vs dense: {err} of {spread}"
        );
    }
}

/// Prefill in chunks of [`PREFILL_CHUNK`] rows gives the logits of one pass over every row, on
/// both CPU code paths.
#[test]
fn chunked_prefill_equals_one_pass() {
    common::init();
    let n = ridgefill::model::decoder::PREFILL_CHUNK + 137;
    for cpu_kernels in [true, false] {
        let model = gqa_model(3, cpu_kernels);
        let ids = prompt(n, model.config.vocab_size);
        let chunked = to_host_f32(model.prefill(&ids, &mut model.new_cache(n)).unwrap());
        let all = model
            .forward_all_logits(&ids, &mut model.new_cache(n))
            .unwrap();
        let one_pass = to_host_f32(all.narrow(0, n - 1, 1).reshape([-1]));
        let d = common::max_abs_diff(&chunked, &one_pass);
        assert!(
            d < 1e-4,
            "kernels {cpu_kernels}: chunked vs one pass max |Δ| {d}"
        );
    }
}

/// One batched decode step over sequences of different lengths gives each the logits of its own
/// decode step, and leaves each cache as that step would; with dense weights on both CPU paths
/// and with Q4_0 blocks (the batch runs the quantised kernels with m = 3).
#[test]
fn batched_decode_equals_each_sequence_alone() {
    common::init();
    let lens = [5usize, 33, 12];
    for (name, model) in &batch_models(512, 3) {
        let vocab = model.config.vocab_size;
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(n + 2 + i, vocab)[i..i + n + 2].to_vec())
            .collect();
        // Each sequence alone: prefill, then two decode steps.
        let mut alone = Vec::new();
        for p in &prompts {
            let n = p.len() - 2;
            let mut c = model.new_cache(n + 2);
            model.prefill(&p[..n], &mut c).unwrap();
            let a = to_host_f32(model.decode_step(p[n], &mut c).unwrap());
            let b = to_host_f32(model.decode_step(p[n + 1], &mut c).unwrap());
            alone.push((a, b));
        }
        // All together: the same prefills, then two batched steps.
        let mut caches: Vec<_> = prompts
            .iter()
            .map(|p| {
                let n = p.len() - 2;
                let mut c = model.new_cache(n + 2);
                model.prefill(&p[..n], &mut c).unwrap();
                c
            })
            .collect();
        for step in 0..2 {
            let toks: Vec<u32> = prompts.iter().map(|p| p[p.len() - 2 + step]).collect();
            let mut refs: Vec<_> = caches.iter_mut().collect();
            let got = to_host_f32(model.decode_batch(&toks, &mut refs).unwrap());
            for (i, want) in alone.iter().enumerate() {
                let want = if step == 0 { &want.0 } else { &want.1 };
                let d = common::max_abs_diff(want, &got[i * vocab..(i + 1) * vocab]);
                assert!(d < 1e-3, "{name}: sequence {i} step {step}: max |Δ| {d}");
            }
        }
        for (c, p) in caches.iter().zip(&prompts) {
            assert_eq!(c.len(), p.len());
        }
        // A full cache is an error, not a panic or a silent overwrite.
        let mut refs: Vec<_> = caches.iter_mut().collect();
        assert!(model.decode_batch(&[1, 2, 3], &mut refs).is_err());
        assert!(model.decode_batch(&[1], &mut refs).is_err());
    }
}

/// The models the batching tests run: dense with and without the fused kernels, and Q4_0
/// blocks (named "Q4_0") holding `max_positions` positions, drawn from `seed`.
fn batch_models(max_positions: usize, seed: u64) -> Vec<(String, Decoder)> {
    let mut models: Vec<(String, Decoder)> = [true, false]
        .into_iter()
        .map(|k| (format!("dense, kernels {k}"), gqa_model(3, k)))
        .collect();
    let q4 = Decoder::random_with(
        gqa_model(3, true).config.clone(),
        &Device::flex(),
        FloatDType::F32,
        WeightFormat::Native,
        max_positions,
        seed,
    )
    .unwrap();
    models.push(("Q4_0".into(), q4));
    models
}

/// Prefill of several prompts at once (rows of different sequences stacked in every matmul,
/// prompts longer than one chunk taking several rounds) gives each prompt's logits and cache
/// as its own prefill does: dense with and without the fused kernels, and Q4_0 blocks. Prompts
/// of 8 rows or more take a long prompt's matmul path alone and together; the shorter ones (7
/// and 1 here) run as a group of their own on the decode rows' kernels, which stays under the
/// row count from which Q4_0 leaves its integer kernels, so both sides round alike.
#[test]
fn batched_prefill_equals_each_prompt_alone() {
    common::init();
    let chunk = ridgefill::model::decoder::PREFILL_CHUNK;
    for (name, model) in &batch_models(1024, 5) {
        let lens = if name == "Q4_0" {
            // The short group (7 + 1 rows) stays below Q4_0's integer-kernel limit of 48.
            vec![7, 1, 12, 20]
        } else {
            vec![7, chunk + 40, 1, 64]
        };
        let vocab = model.config.vocab_size;
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(n + 1 + i, vocab)[i..i + n + 1].to_vec())
            .collect();
        let mut alone = Vec::new();
        for p in &prompts {
            let n = p.len() - 1;
            let mut c = model.new_cache(n + 1);
            let a = to_host_f32(model.prefill(&p[..n], &mut c).unwrap());
            let b = to_host_f32(model.decode_step(p[n], &mut c).unwrap());
            alone.push((a, b));
        }
        let mut caches: Vec<_> = prompts.iter().map(|p| model.new_cache(p.len())).collect();
        let heads: Vec<&[u32]> = prompts.iter().map(|p| &p[..p.len() - 1]).collect();
        let mut refs: Vec<_> = caches.iter_mut().collect();
        let got = to_host_f32(model.prefill_batch(&heads, &mut refs).unwrap());
        // The caches continue as the single prefills' do.
        let next: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1]).collect();
        let after = to_host_f32(model.decode_batch(&next, &mut refs).unwrap());
        for (i, (want_a, want_b)) in alone.iter().enumerate() {
            let d = common::max_abs_diff(want_a, &got[i * vocab..(i + 1) * vocab]);
            assert!(
                d < 1e-3,
                "{name}: prompt {i} (n = {}): max |Δ| {d}",
                lens[i]
            );
            let d = common::max_abs_diff(want_b, &after[i * vocab..(i + 1) * vocab]);
            assert!(
                d < 1e-3,
                "{name}: prompt {i} then a decode step: max |Δ| {d}"
            );
        }
        for (c, p) in caches.iter().zip(&prompts) {
            assert_eq!(c.len(), p.len());
        }
        let mut refs: Vec<_> = caches.iter_mut().collect();
        assert!(
            model.prefill_batch(&[&[1]], &mut refs).is_err(),
            "count mismatch"
        );
        let empty: [&[u32]; 4] = [&[], &[1], &[1], &[1]];
        assert!(
            model.prefill_batch(&empty, &mut refs).is_err(),
            "empty prompt"
        );
        assert!(
            model
                .prefill_batch(&[&[1], &[1], &[1], &[1]], &mut refs)
                .is_err(),
            "full caches"
        );
    }
}

/// The stepwise fill prefill a server interleaves with decode steps gives the logits and the
/// cache of the one-call fill prefill, with spans and without, over a prompt of several chunks.
#[test]
fn stepwise_fill_prefill_equals_one_call() {
    common::init();
    let n = ridgefill::model::decoder::PREFILL_CHUNK + 150;
    let model = gqa_model(4, true);
    let ids = prompt(n + 1, model.config.vocab_size);
    let maps = random_maps(&model, 2, 21);
    for rows in [spans_rows(16, 0.1, 8), spans_rows(16, 0.0, 0)] {
        let mut want_cache = model.new_cache(n + 1);
        let want = to_host_f32(
            Prefill::run(
                &model,
                &ids[..n],
                &mut want_cache,
                FillOptions::fill(&maps, rows),
            )
            .map(|f| f.logits)
            .unwrap(),
        );
        let mut cache = model.new_cache(n + 1);
        let mut st =
            Prefill::start(&model, &ids[..n], &cache, FillOptions::fill(&maps, rows)).unwrap();
        assert!(st.skips(), "the prompt has a bulk");
        let mut steps = 0;
        let got = loop {
            steps += 1;
            if let Some(l) = st.step(&mut cache).unwrap() {
                break to_host_f32(l);
            }
        };
        assert_eq!(
            steps, 3,
            "two chunks below the split, then the upper layers"
        );
        let d = common::max_abs_diff(&want, &got);
        assert!(
            d < 1e-4,
            "exact {}: stepwise vs one call max |Δ| {d}",
            rows.exact
        );
        let a = to_host_f32(model.decode_step(ids[n], &mut want_cache).unwrap());
        let b = to_host_f32(model.decode_step(ids[n], &mut cache).unwrap());
        assert!(common::max_abs_diff(&a, &b) < 1e-4, "decode after it");
    }
    // A prompt without a bulk has nothing to step through.
    let cache = model.new_cache(8);
    let rows = spans_rows(16, 0.0, 0);
    let st = Prefill::start(&model, &ids[..8], &cache, FillOptions::fill(&maps, rows)).unwrap();
    assert!(!st.skips());
}

/// SmolLM2's sentence stops, where a chosen span runs on to: a UUID needle's hex digits and
/// dashes are none, its closing period and the line break after it are, and every line-break
/// token is one too.
#[test]
fn sentence_stops_mark_a_needles_end_not_its_uuid() {
    let tok = &common::smollm2_ckpt().tokenizer;
    let breaks = ridgefill::fillfile::line_breaks(tok);
    let stops = ridgefill::fillfile::sentence_stops(tok);
    assert!(!breaks.is_empty() && stops.len() > breaks.len());
    assert!(breaks.iter().all(|b| stops.binary_search(b).is_ok()));
    let needle = "The special magic uuid for jolly-ferry is: 389109d6-5c98-4c96-8a05-6a54ce280d91";
    let ids = tok.encode(&format!("{needle}.\nThe"), false).unwrap();
    let marked: Vec<bool> = ids.iter().map(|t| stops.binary_search(t).is_ok()).collect();
    let first = marked.iter().position(|&m| m).unwrap();
    let before = tok.decode(&ids[..first], false).unwrap();
    assert_eq!(before, needle, "the first stop is the closing period");
    // The period and the line break (one token or two) are stops; the next word is none.
    let last = ids.len() - 1;
    assert!(
        marked[first..last].iter().all(|&m| m) && !marked[last],
        "{marked:?}"
    );
}
