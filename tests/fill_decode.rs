//! Decoding over a filled cache with restores ([`RestoringDecode`]): every `decode_every`
//! tokens the tokens since the last restore run again as a prefill over the cache, which
//! restores the filled rows they read and gives the logits a decode step would.

mod common;

use ridgefill::model::fill::{FillMaps, FillOptions, FillRows, Prefill, RestoringDecode};
use ridgefill::model::{Decoder, KvCache, to_host_f32};
use ridgefill_testkit::fill::{gqa_model, random_maps, spans_rows};
use ridgefill_testkit::{prompt, tiny};

/// Prompt rows, and tokens decoded after them (three restores at every 4).
const PROMPT: usize = 150;
const DECODED: usize = 12;
const EVERY: usize = 4;

/// The prompt filled by `maps` with `rows`, then `DECODED` tokens of `ids` fed one at a time:
/// by decode steps (`restoring` false) or through a [`RestoringDecode`]. Returns each step's
/// logits, the cache, the restores that ran and the filled rows left.
fn decode(
    model: &Decoder,
    ids: &[u32],
    maps: &FillMaps,
    rows: FillRows,
    restoring: bool,
) -> (Vec<Vec<f32>>, KvCache, usize, usize) {
    let mut cache = model.new_cache(PROMPT + DECODED);
    let opts = FillOptions::fill(maps, rows);
    let f = Prefill::run(model, &ids[..PROMPT], &mut cache, opts).unwrap();
    assert!(f.report.filled > 0, "{:?}", f.report);
    let mut d = RestoringDecode::new(model, opts, &ids[..PROMPT], f.history);
    let mut steps = Vec::new();
    for &t in &ids[PROMPT..PROMPT + DECODED] {
        let logits = match restoring {
            true => d.step(t, &mut cache).unwrap(),
            false => model.decode_step(t, &mut cache).unwrap(),
        };
        steps.push(to_host_f32(logits));
    }
    let restores = d.restored().1;
    let filled_left = d.into_history().map_or(0, |h| h.filled(h.recorded()));
    (steps, cache, restores, filled_left)
}

fn maps(model: &Decoder) -> FillMaps {
    let mut rng = tiny::Rng::new(7);
    random_maps(model, 2, || rng.next_f32())
}

/// Rows that restore every `EVERY` tokens, `spans` spans each, restoring only when the new
/// tokens give the filled rows at least `min_attention` of their attention.
fn restoring_rows(spans: usize, min_attention: f64) -> FillRows {
    FillRows {
        decode_every: EVERY,
        decode_spans: spans,
        resume_min_attention: min_attention,
        ..spans_rows(4, 0.05, 3)
    }
}

/// A restore that restores nothing (the new tokens never draw enough attention to the filled
/// rows) re-runs its tokens' rows as a prefill: each step's logits are the decode step's, and
/// the cache ends the same length with the same filled rows.
#[test]
fn a_restore_that_restores_nothing_gives_the_decode_steps_logits() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(PROMPT + DECODED, model.config.vocab_size);
    let maps = maps(&model);
    let rows = restoring_rows(1, f64::INFINITY);
    let (plain, plain_cache, _, plain_left) = decode(&model, &ids, &maps, rows, false);
    let (got, cache, restores, left) = decode(&model, &ids, &maps, rows, true);
    assert_eq!(restores, DECODED / EVERY);
    assert_eq!(cache.len(), plain_cache.len());
    assert_eq!(left, plain_left, "no filled row was restored");
    for (i, (a, b)) in plain.iter().zip(&got).enumerate() {
        let d = common::max_abs_diff(a, b);
        assert!(d < 1e-4, "step {i}: restore vs decode step max |Δ| {d}");
    }
}

/// With restores on, the decode runs the filled rows its tokens read exactly: fewer filled rows
/// are left, and the logits move away from the unrestored decode's once the first restore has
/// run (step `EVERY - 1`), not before.
#[test]
fn restores_run_the_rows_the_decoded_tokens_read() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(PROMPT + DECODED, model.config.vocab_size);
    let maps = maps(&model);
    let rows = restoring_rows(2, 0.0);
    let (plain, _, _, plain_left) = decode(&model, &ids, &maps, rows, false);
    let (got, cache, restores, left) = decode(&model, &ids, &maps, rows, true);
    assert_eq!(restores, DECODED / EVERY);
    assert_eq!(cache.len(), PROMPT + DECODED);
    assert!(
        left < plain_left,
        "filled rows left: {left} vs {plain_left}"
    );
    for (i, (a, b)) in plain.iter().zip(&got).enumerate().take(EVERY - 1) {
        let d = common::max_abs_diff(a, b);
        assert!(d < 1e-4, "step {i}, before any restore: max |Δ| {d}");
    }
    let d = common::max_abs_diff(&plain[EVERY - 1], &got[EVERY - 1]);
    assert!(d > 1e-4, "the first restore left the logits as they were");
}

/// With maps that predict the upper layer exactly (its own K/V projection) a restore changes
/// nothing a full prefill would not have: restoring decode equals full prefill then decode.
#[test]
fn restoring_over_exact_maps_decodes_as_full_prefill() {
    common::init();
    let model = gqa_model(4, true);
    let ids = prompt(PROMPT + DECODED, model.config.vocab_size);
    let maps = FillMaps::own_proj(&model, 3).unwrap();
    let rows = restoring_rows(2, 0.0);
    let mut full_cache = model.new_cache(PROMPT + DECODED);
    model.prefill(&ids[..PROMPT], &mut full_cache).unwrap();
    let full: Vec<Vec<f32>> = ids[PROMPT..]
        .iter()
        .map(|&t| to_host_f32(model.decode_step(t, &mut full_cache).unwrap()))
        .collect();
    let (got, _, _, _) = decode(&model, &ids, &maps, rows, true);
    for (i, (a, b)) in full.iter().zip(&got).enumerate() {
        let d = common::max_abs_diff(a, b);
        assert!(d < 1e-4, "step {i}: restoring decode vs full max |Δ| {d}");
    }
}
