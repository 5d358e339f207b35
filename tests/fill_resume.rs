//! Skip-and-fill over a cache that holds an earlier prefill ([`Prefill::resume`]): the new rows
//! land at their own positions, and the spans a later question chooses in rows an earlier
//! prefill filled run exactly and replace the predictions in the cache; settling ([`settle`])
//! runs every filled row so, in idle time.

mod common;

use ridgefill::model::fill::{FillMaps, FillOptions, FillRows, Prefill, settle};
use ridgefill::model::{Decoder, KvCache, to_host_f32};
use ridgefill_testkit::fill::{gqa_model, gqa_model_on, random_maps, spans_rows};
use ridgefill_testkit::{prompt, tiny};

/// First prompt, decoded tokens after it, and the rows a later turn adds (past a prefill chunk,
/// so both sides run their new rows in more than one chunk).
const FIRST: usize = 150;
const DECODED: usize = 3;
const LATER: usize = ridgefill::model::decoder::PREFILL_CHUNK + 30;
const N: usize = FIRST + DECODED + LATER;

fn maps_at(model: &Decoder, split: usize, seed: u64) -> FillMaps {
    let mut rng = tiny::Rng::new(seed);
    random_maps(model, split, || rng.next_f32())
}

/// The first turn filled with `first_rows`, three decoded tokens, then the later turn resumed
/// with `later_rows`; returns the later turn's logits, its report and the cache.
fn two_turns(
    model: &Decoder,
    ids: &[u32],
    maps: &FillMaps,
    first_rows: FillRows,
    later_rows: FillRows,
) -> (Vec<f32>, ridgefill::model::fill::FillReport, KvCache) {
    let mut cache = model.new_cache(N + 1);
    let first = Prefill::run(
        model,
        &ids[..FIRST],
        &mut cache,
        FillOptions::fill(maps, first_rows),
    )
    .unwrap();
    assert!(first.report.filled > 0, "{:?}", first.report);
    for &t in &ids[FIRST..FIRST + DECODED] {
        model.decode_step(t, &mut cache).unwrap();
    }
    let history = first.history.expect("a filled prompt leaves its history");
    let later = Prefill::resume(
        model,
        &ids[..N],
        &cache,
        history,
        FillOptions::fill(maps, later_rows),
    )
    .unwrap()
    .finish(&mut cache)
    .unwrap();
    (to_host_f32(later.logits), later.report, cache)
}

/// With maps that predict the one upper layer exactly (its own K/V projection), a resumed fill
/// is full prefill: the new rows' filled keys are rotated at their own positions, after the
/// cached prompt and the decoded tokens; decoding after it continues identically.
#[test]
fn a_resumed_fill_with_exact_maps_equals_full_prefill() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(N + 1, model.config.vocab_size);
    let mut full_cache = model.new_cache(N + 1);
    let full = to_host_f32(model.prefill(&ids[..N], &mut full_cache).unwrap());
    let full_next = to_host_f32(model.decode_step(ids[N], &mut full_cache).unwrap());
    let maps = FillMaps::own_proj(&model, 3).unwrap();
    let rows = spans_rows(4, 0.1, 4);
    let (got, report, mut cache) = two_turns(&model, &ids, &maps, rows, rows);
    assert_eq!(report.reused, FIRST + DECODED);
    assert!(report.filled > 0 && !report.fell_back, "{report:?}");
    let d = common::max_abs_diff(&full, &got);
    assert!(d < 1e-4, "resumed fill vs full prefill max |Δ| {d}");
    let next = to_host_f32(model.decode_step(ids[N], &mut cache).unwrap());
    let d = common::max_abs_diff(&full_next, &next);
    assert!(d < 1e-4, "decode after it max |Δ| {d}");
}

/// K/V of `layer` at positions `rows`, on the host.
fn kv_rows(cache: &KvCache, layer: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
    let (k, v) = cache.read(layer);
    let (k, v) = (
        k.narrow(2, rows.start, rows.len()),
        v.narrow(2, rows.start, rows.len()),
    );
    [
        to_host_f32(k.flatten::<1>(0, 3)),
        to_host_f32(v.flatten::<1>(0, 3)),
    ]
    .concat()
}

/// Random maps at split 2 fill the first prompt's bulk wrongly. A later turn whose spans may
/// cover every filled row runs them from their stored split input: the first upper layer (whose
/// K/V depend on that input alone) then holds full prefill's K/V for the whole first prompt,
/// and the report counts the restored rows. With no span budget they keep the predictions.
#[test]
fn a_later_prefill_restores_the_earlier_rows_its_spans_choose() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(N, model.config.vocab_size);
    let mut full_cache = model.new_cache(N);
    model.prefill(&ids, &mut full_cache).unwrap();
    let maps = maps_at(&model, 2, 31);
    let first = spans_rows(4, 0.0, 4);
    let bulk = first.bulk(FIRST).unwrap();

    let everything = spans_rows(4, 1.0, N);
    let (_, report, cache) = two_turns(&model, &ids, &maps, first, everything);
    assert_eq!(report.restored, bulk.len(), "{report:?}");
    let d = common::max_abs_diff(&kv_rows(&full_cache, 2, 0..N), &kv_rows(&cache, 2, 0..N));
    assert!(d < 1e-4, "restored layer-2 K/V vs full prefill max |Δ| {d}");

    let nothing = spans_rows(4, 0.0, 4);
    let (_, report, cache) = two_turns(&model, &ids, &maps, first, nothing);
    assert_eq!(report.restored, 0, "{report:?}");
    let d = common::max_abs_diff(
        &kv_rows(&full_cache, 2, bulk.clone()),
        &kv_rows(&cache, 2, bulk),
    );
    assert!(
        d > 1e-2,
        "unrestored rows kept full prefill's K/V (max |Δ| {d})"
    );
}

/// A later turn long enough to fill whose self-check fails (random maps, threshold 0) runs its
/// new rows exactly, with a retry share or without: a fresh prompt's retry with more rows
/// exact lost needles that full prefill found when tried on later turns (docs/fidelity.md, L8).
#[test]
fn a_later_turn_that_fails_its_self_check_runs_its_new_rows_exactly() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(N, model.config.vocab_size);
    let maps = maps_at(&model, 2, 31);
    let first = spans_rows(4, 0.1, 4);
    let failing = FillRows {
        max_error: 0.0,
        ..first
    };
    let retry = FillRows {
        retry_exact: 0.3,
        ..failing
    };
    assert!(retry.retries(LATER), "a fresh prompt this long would retry");
    let (got, report, _) = two_turns(&model, &ids, &maps, first, retry);
    assert!(report.fell_back && !report.widened, "{report:?}");
    assert_eq!(report.filled, 0, "{report:?}");
    let (want, exact, _) = two_turns(&model, &ids, &maps, first, failing);
    assert!(exact.fell_back, "{exact:?}");
    assert_eq!(got, want, "with a retry share vs without");
    let (_, lax, _) = two_turns(&model, &ids, &maps, first, first);
    assert!(!lax.fell_back && lax.filled > 0, "{lax:?}");
}

/// A short follow-up (no longer than its tail, so every new row runs exactly) over a cache whose
/// first prompt random maps filled: with `resume_spans` 0 it restores nothing and skips the
/// scoring, so its logits are full prefill's of the new rows over that same filled cache; with
/// the default it restores the spans its question chooses among the filled rows, unless they
/// draw less than `resume_min_attention` of its attention; with `resume_layers` the restored
/// rows run only that many upper layers.
#[test]
fn a_follow_up_restoring_no_spans_is_full_prefill_over_the_filled_cache() {
    common::init();
    let model = gqa_model(4, true);
    let later = 12;
    let n = FIRST + DECODED + later;
    let ids = prompt(n, model.config.vocab_size);
    let maps = maps_at(&model, 2, 31);
    let first = spans_rows(4, 0.0, 4);
    let mut cache = model.new_cache(n);
    let filled = Prefill::run(
        &model,
        &ids[..FIRST],
        &mut cache,
        FillOptions::fill(&maps, first),
    )
    .unwrap();
    for &t in &ids[FIRST..FIRST + DECODED] {
        model.decode_step(t, &mut cache).unwrap();
    }
    let history = filled.history.expect("a filled prompt leaves its history");
    let mut full_cache = cache.clone();
    let want = to_host_f32(
        model
            .prefill(&ids[FIRST + DECODED..], &mut full_cache)
            .unwrap(),
    );
    let base = FillRows {
        tail: later,
        resume_min_attention: 0.0,
        ..spans_rows(later, 0.05, 4)
    };
    let resume = |rows: FillRows| {
        let mut c = cache.clone();
        let f = Prefill::resume(
            &model,
            &ids,
            &c,
            history.clone(),
            FillOptions::fill(&maps, rows),
        )
        .unwrap()
        .finish(&mut c)
        .unwrap();
        (to_host_f32(f.logits), f.report, c, f.history.unwrap())
    };
    let follow_up = |resume_spans: usize, resume_min_attention: f64| {
        let (logits, report, _, _) = resume(FillRows {
            resume_spans,
            resume_min_attention,
            ..base
        });
        (logits, report)
    };
    let (got, report) = follow_up(0, 0.0);
    assert_eq!((report.restored, report.filled), (0, 0), "{report:?}");
    let d = common::max_abs_diff(&want, &got);
    assert!(
        d < 1e-4,
        "no spans restored vs full prefill over the filled cache: max |Δ| {d}"
    );
    let (got, report) = follow_up(ridgefill::model::fill::RESUME_MIN_SPANS, 0.0);
    assert!(report.restored > 0, "{report:?}");
    // A question that reads the filled rows less than the threshold restores none: full
    // prefill's logits over the filled cache again, and the share it read is reported.
    let share = report
        .filled_attention
        .expect("a follow-up scores the filled rows");
    assert!(share > 0.0 && share < 1.0, "{report:?}");
    let (glanced, low) = follow_up(ridgefill::model::fill::RESUME_MIN_SPANS, share + 1e-3);
    assert_eq!((low.restored, low.filled), (0, 0), "{low:?}");
    assert_eq!(low.filled_attention, Some(share));
    let d = common::max_abs_diff(&want, &glanced);
    assert!(
        d < 1e-4,
        "a follow-up under the threshold vs full prefill: max |Δ| {d}"
    );
    let (_, high) = follow_up(ridgefill::model::fill::RESUME_MIN_SPANS, share - 1e-3);
    assert_eq!(high.restored, report.restored, "{high:?}");
    let d = common::max_abs_diff(&want, &got);
    assert!(
        d > 1e-4,
        "restored rows left the logits as they were (max |Δ| {d})"
    );

    // Restored through the first upper layer only: the span's layer-2 K/V are the whole
    // restore's, its layer-3 K/V still the fill's, and its rows stay filled for settling.
    let (_, whole, whole_cache, whole_history) = resume(base);
    let (_, part, part_cache, part_history) = resume(FillRows {
        resume_layers: Some(1),
        ..base
    });
    assert_eq!(part.restored, whole.restored, "{part:?}");
    let old = 0..FIRST;
    let d = common::max_abs_diff(
        &kv_rows(&whole_cache, 2, old.clone()),
        &kv_rows(&part_cache, 2, old.clone()),
    );
    assert!(d < 1e-6, "layer 2, partial vs whole restore: max |Δ| {d}");
    let d = common::max_abs_diff(
        &kv_rows(&cache, 3, old.clone()),
        &kv_rows(&part_cache, 3, old.clone()),
    );
    assert!(
        d < 1e-6,
        "layer 3, partial restore vs the fill: max |Δ| {d}"
    );
    let d = common::max_abs_diff(
        &kv_rows(&cache, 3, old.clone()),
        &kv_rows(&whole_cache, 3, old.clone()),
    );
    assert!(
        d > 1e-3,
        "the whole restore left layer 3 as filled (max |Δ| {d})"
    );
    assert_eq!(
        part_history.filled(FIRST),
        history.filled(FIRST),
        "partly restored rows stay filled"
    );
    assert_eq!(
        whole_history.filled(FIRST) + whole.restored,
        history.filled(FIRST)
    );
}

/// Settling a cache that random maps filled: every filled row runs from its stored split input,
/// earliest first. At split 2 the first upper layer then holds full prefill's K/V (they depend
/// on that input alone), chunks of 7 rows give what one batch gives, and nothing is left to
/// settle; with one upper layer (split 3) the cache is full prefill's, so the next decode step
/// is too — where before settling it was not.
#[test]
fn settling_a_filled_cache_runs_every_filled_row_exactly() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(FIRST + 20, model.config.vocab_size);
    let mut full_cache = model.new_cache(FIRST + 1);
    model.prefill(&ids[..FIRST], &mut full_cache).unwrap();
    let full_next = to_host_f32(model.decode_step(ids[FIRST], &mut full_cache).unwrap());
    let rows = spans_rows(4, 0.05, 4);
    let filled = |split: usize| {
        let maps = maps_at(&model, split, 31);
        let mut cache = model.new_cache(FIRST + 20);
        let opts = FillOptions::fill(&maps, rows);
        let f = Prefill::run(&model, &ids[..FIRST], &mut cache, opts).unwrap();
        assert!(f.report.filled > 0, "{:?}", f.report);
        (cache, f.history.unwrap(), f.report.filled)
    };

    let (mut whole, mut history, n_filled) = filled(2);
    let ran = settle(&model, &mut whole, &mut history, usize::MAX).unwrap();
    assert_eq!(ran, n_filled);
    assert_eq!(history.filled(FIRST), 0);
    assert_eq!(
        settle(&model, &mut whole, &mut history, usize::MAX).unwrap(),
        0
    );
    // A few new rows over the settled cache fill nothing: they run as full prefill runs them.
    let maps = maps_at(&model, 2, 31);
    let more = FIRST + 20;
    let resumed = Prefill::resume(
        &model,
        &ids[..more],
        &whole,
        history.clone(),
        FillOptions::fill(&maps, rows),
    )
    .unwrap()
    .finish(&mut whole.clone())
    .unwrap();
    assert_eq!((resumed.report.filled, resumed.report.restored), (0, 0));
    let plain = to_host_f32(
        model
            .prefill(&ids[FIRST..more], &mut whole.clone())
            .unwrap(),
    );
    let d = common::max_abs_diff(&plain, &to_host_f32(resumed.logits));
    assert!(
        d < 1e-5,
        "resumed over a settled cache vs plain prefill max |Δ| {d}"
    );
    // Settled rows ran over predictions once: only the sink stays full prefill's own.
    assert!(history.ever_filled() && !history.pristine_upto(FIRST));
    assert!(history.pristine_upto(rows.sink));
    history.truncate(rows.sink);
    assert!(!history.ever_filled());
    let (mut chunked, mut history, _) = filled(2);
    let mut total = 0;
    loop {
        let ran = settle(&model, &mut chunked, &mut history, 7).unwrap();
        assert!(ran <= 7);
        if ran == 0 {
            break;
        }
        total += ran;
    }
    assert_eq!(total, n_filled);
    for l in 2..4 {
        let d = common::max_abs_diff(
            &kv_rows(&whole, l, 0..FIRST),
            &kv_rows(&chunked, l, 0..FIRST),
        );
        assert!(
            d < 1e-4,
            "layer {l}: settled in chunks vs at once max |Δ| {d}"
        );
    }
    let d = common::max_abs_diff(
        &kv_rows(&full_cache, 2, 0..FIRST),
        &kv_rows(&whole, 2, 0..FIRST),
    );
    assert!(d < 1e-4, "settled layer-2 K/V vs full prefill max |Δ| {d}");

    let (mut cache, mut history, _) = filled(3);
    let unsettled = to_host_f32(model.decode_step(ids[FIRST], &mut cache.clone()).unwrap());
    let d = common::max_abs_diff(&full_next, &unsettled);
    assert!(
        d > 1e-2,
        "random maps already gave full prefill's logits (max |Δ| {d})"
    );
    settle(&model, &mut cache, &mut history, usize::MAX).unwrap();
    let next = to_host_f32(model.decode_step(ids[FIRST], &mut cache).unwrap());
    let d = common::max_abs_diff(&full_next, &next);
    assert!(
        d < 1e-4,
        "decode after settling vs full prefill max |Δ| {d}"
    );
}

/// A history from maps at another split, or an empty cache, is refused with what is wrong.
#[test]
fn resuming_refuses_another_split_and_an_empty_cache() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(N, model.config.vocab_size);
    let (at2, at3) = (maps_at(&model, 2, 41), maps_at(&model, 3, 43));
    let rows = spans_rows(4, 0.1, 4);
    let mut cache = model.new_cache(N);
    let first = Prefill::run(
        &model,
        &ids[..FIRST],
        &mut cache,
        FillOptions::fill(&at2, rows),
    )
    .unwrap();
    let history = first.history.unwrap();
    let err = Prefill::resume(
        &model,
        &ids,
        &cache,
        history.clone(),
        FillOptions::fill(&at3, rows),
    )
    .err()
    .expect("another split is refused")
    .to_string();
    assert!(err.contains("split 2") && err.contains("split 3"), "{err}");
    let empty = model.new_cache(N);
    let err = Prefill::resume(&model, &ids, &empty, history, FillOptions::fill(&at2, rows))
        .err()
        .expect("an empty cache is refused")
        .to_string();
    assert!(err.contains("cache of 0 positions"), "{err}");
}

/// On wgpu too: a prefill after a reused prefix equals a cold prefill, and a resumed fill with
/// exact maps equals full prefill and flex's resumed fill.
#[test]
fn reuse_and_resume_on_wgpu_match_cold_prefill_and_flex() {
    let dev = common::wgpu();
    let gpu = gqa_model_on(4, &dev.device);
    let flex = gqa_model(4, true);
    let ids = prompt(N, gpu.config.vocab_size);
    let cold = to_host_f32(gpu.prefill(&ids, &mut gpu.new_cache(N)).unwrap());
    let mut cache = gpu.new_cache(N);
    gpu.prefill(&ids[..FIRST], &mut cache).unwrap();
    let reused = to_host_f32(gpu.prefill(&ids[FIRST..], &mut cache).unwrap());
    let d = common::max_abs_diff(&cold, &reused);
    assert!(d < 1e-4, "wgpu: reused vs cold prefill max |Δ| {d}");

    let rows = spans_rows(4, 0.1, 4);
    let maps = FillMaps::own_proj(&gpu, 3).unwrap();
    let (got, _, _) = two_turns(&gpu, &ids, &maps, rows, rows);
    let d = common::max_abs_diff(&cold, &got);
    assert!(d < 1e-3, "wgpu: resumed fill vs full prefill max |Δ| {d}");
    let flex_maps = FillMaps::own_proj(&flex, 3).unwrap();
    let (on_flex, _, _) = two_turns(&flex, &ids, &flex_maps, rows, rows);
    let d = common::max_abs_diff(&on_flex, &got);
    assert!(d < 1e-3, "resumed fill flex vs wgpu max |Δ| {d}");

    // Settling random maps' fill, then one decode step: the same on both devices.
    let settled_next = |model: &Decoder| {
        let maps = maps_at(model, 2, 31);
        let mut cache = model.new_cache(FIRST + 1);
        let opts = FillOptions::fill(&maps, rows);
        let f = Prefill::run(model, &ids[..FIRST], &mut cache, opts).unwrap();
        let mut history = f.history.unwrap();
        assert_eq!(
            settle(model, &mut cache, &mut history, usize::MAX).unwrap(),
            f.report.filled
        );
        to_host_f32(model.decode_step(ids[FIRST], &mut cache).unwrap())
    };
    let d = common::max_abs_diff(&settled_next(&flex), &settled_next(&gpu));
    assert!(d < 1e-3, "settled fill flex vs wgpu max |Δ| {d}");
}

/// On a sliding-window layer above the split a prefill writes only the rows some exact row can
/// reach. A later prefill's spans in the earlier prompt reach rows that prompt left unwritten:
/// they are filled then, so no exact row attends to an empty slot (Gemma 3's local layers).
#[test]
fn old_spans_on_a_sliding_layer_read_no_empty_slot() {
    common::init();
    const WINDOW: usize = 5;
    // Layers 0 and 2 slide over WINDOW keys; the split puts layer 2 above it.
    let config: ridgefill::io::config::ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
        "head_dim": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": 256,
        "max_position_embeddings": 1024, "sliding_window": WINDOW, "sliding_window_pattern": 2
    }))
    .unwrap();
    let model = Decoder::random(
        config,
        &ridgefill::model::Device::flex(),
        ridgefill::model::FloatDType::F32,
        512,
        3,
    )
    .unwrap();
    assert_eq!(model.layers[2].window, Some(WINDOW));
    let ids = prompt(N, model.config.vocab_size);
    let maps = maps_at(&model, 2, 31);
    let mut cache = model.new_cache(N + 1);
    let opts = FillOptions::fill(&maps, spans_rows(4, 0.0, 4));
    let first = Prefill::run(&model, &ids[..FIRST], &mut cache, opts).unwrap();
    let later = Prefill::resume(
        &model,
        &ids,
        &cache,
        first.history.unwrap(),
        FillOptions::fill(&maps, spans_rows(4, 0.2, 2)),
    )
    .unwrap()
    .finish(&mut cache)
    .unwrap();
    let old: Vec<_> = later.spans.iter().filter(|s| s.end <= FIRST).collect();
    assert!(
        later.report.restored > 0 && !old.is_empty(),
        "{:?}",
        later.report
    );
    for s in old {
        for q in (s.start + 1).saturating_sub(WINDOW)..s.end {
            let kv = kv_rows(&cache, 2, q..q + 1);
            assert!(
                kv.iter().any(|&x| x != 0.0),
                "slot {q} of layer 2, read by the restored span {s:?}, was never written"
            );
        }
    }
}
