//! The upper layers of a skip-and-fill prefill, once every row has run the layers below the
//! split: the tail's attention chooses the spans ([`tail_scores`]), the exact rows run and the
//! rest are filled ([`super::exact`]), and a failed self-check runs them exactly after all.

use std::ops::Range;

use burn::tensor::{Bool, FloatDType, Tensor, TensorData, activation};

use super::exact::{ExactRows, SelfCheck, exact_pass};
use super::{FillMaps, FillRows, Oracle, choose_new_spans};
use crate::cache::KvCache;
use crate::decoder::{Decoder, PREFILL_CHUNK};
use crate::error::{ModelError, Result};
use crate::weight::Rows;

/// The layer whose attention chooses the spans runs apart, so its input is kept: the last
/// full-attention layer below the split (a sliding one sees only the last `window` rows, so
/// it could never point further back).
pub(crate) fn scoring_layer(model: &Decoder, split: usize) -> usize {
    (0..split)
        .rev()
        .find(|&l| model.layers[l].window.is_none())
        .unwrap_or(split - 1)
}

/// Which rows of this prompt run exactly, and where its sentences end (spans run on to them).
#[derive(Clone)]
pub(crate) struct RowPlan<'a> {
    pub rows: FillRows,
    /// Per prompt row, whether it ends a sentence (empty: unknown).
    pub ends: &'a [bool],
    /// Rows neither sink nor tail: where spans are chosen and (from `from` on) rows filled.
    pub bulk: Range<usize>,
    /// Positions the cache held before this prefill (0: a fresh prompt).
    pub from: usize,
    /// Per position `0..from`, whether its upper-layer K/V are exact already.
    pub done: &'a [bool],
}

/// What [`fill_upper`] did.
pub(crate) struct Upper {
    /// The last row entering the head, `[1, hidden]`.
    pub h_last: Tensor<2>,
    pub spans: Vec<Range<usize>>,
    /// The self-check of the last split tried.
    pub check: SelfCheck,
    /// The share of the tail's attention to the bulk's filled rows that exact rows now take
    /// ([`span_coverage`]) at the last split tried.
    pub coverage: Option<f64>,
    /// [`filled_share`] of the tail's attention at the last split tried.
    pub filled_attention: Option<f64>,
    /// Whether the spans' rows before this prefill ran every upper layer (false: only
    /// [`FillRows::resume_layers`] of them, so they stay filled above).
    pub restored_whole: bool,
    /// The split whose maps filled; `None`: every row ran every layer.
    pub split: Option<usize>,
    /// Every row's input to `split` when a deeper split's maps filled (`None`: the split
    /// input given): what a later restore of this prompt's filled rows starts from.
    pub deeper_input: Option<Tensor<2>>,
    /// The self-check failed and the prompt was filled again with
    /// [`FillRows::retry_exact`] of its rows exact.
    pub widened: bool,
}

/// Everything of a fill prefill after the layers below the split: the spans the tail rows'
/// attention chooses (from `tail_in`, the tail entering the scoring layer), then the upper
/// layers' exact pass and fill. When the exact rows show the maps' error above
/// `rows.max_error` (or the spans alone above `rows.max_span_error`), the bulk runs exactly up
/// to `maps.deeper`'s split and that fill is tried the same way; with no deeper maps left, a
/// fresh prompt is filled again with `rows.retry_exact` of its rows in spans (when that is
/// more than `rows.exact`), else the upper layers run with every row exact. A fresh prompt whose spans take less than
/// `rows.min_coverage` of the tail's attention to the filled bulk goes to the deeper split,
/// when there is one, before its exact pass here.
///
/// # Shapes
/// - tail_in: `[n - bulk.end, hidden]`, h_split: `[n, hidden]` → h_last `[1, hidden]`
pub(crate) fn fill_upper(
    model: &Decoder,
    maps: &FillMaps,
    plan: RowPlan<'_>,
    tail_in: Tensor<2>,
    h_split: Tensor<2>,
    cache: &mut KvCache,
    oracle: Option<&Oracle>,
) -> Result<Upper> {
    let RowPlan {
        rows,
        ends,
        ref bulk,
        from,
        done,
    } = plan;
    let n = h_split.dims()[0];
    let scored = scoring_layer(model, maps.split);
    // A later prefill spends the budget of its new rows wherever its question points, earlier
    // turns' filled rows included (`FillRows::resume_budget`).
    let new = n - from;
    let (spans, coverage, filled_attention, scores) = if rows.span_count(new) > 0 {
        let scores = tail_scores(model, scored, tail_in.clone(), cache, bulk.end)?;
        let share = filled_share(&scores, bulk.clone(), done);
        // A follow-up question that reads the earlier turns' filled rows little restores none.
        let glance = rows.resume_exact(new) && share.is_none_or(|s| s < rows.resume_min_attention);
        let budget = match from {
            0 => rows.exact_rows(n),
            _ if glance => 0,
            _ => rows.resume_budget(new),
        };
        let spans = choose_new_spans(
            &scores,
            bulk.clone(),
            done,
            budget,
            rows.span,
            ends,
            rows.sentence_reach,
        );
        let coverage = span_coverage(&scores, bulk.clone(), done, &spans);
        (spans, coverage, share, Some(scores))
    } else {
        (Vec::new(), None, None, None)
    };
    let exact = exact_positions(from, bulk, &spans, n);
    let upper = model.num_layers() - maps.split;
    let at = ExactRows {
        at: &exact,
        sink: bulk.start,
        from,
        done,
        bulk_end: bulk.end,
        old_layers: rows.resume_layers.unwrap_or(upper),
    };
    // A fresh prompt whose question reads the filled text broadly goes to the deeper split
    // before its exact pass here costs anything.
    let broad =
        from == 0 && maps.deeper.is_some() && coverage.is_some_and(|c| c < rows.min_coverage);
    let check = if broad {
        SelfCheck::default()
    } else {
        let (h_last, check, whole) = exact_pass(model, maps, h_split.clone(), at, cache, oracle)?;
        let fails = check.all.is_some_and(|e| e > rows.max_error)
            || check.spans.is_some_and(|e| e > rows.max_span_error);
        if !fails {
            return Ok(Upper {
                h_last,
                spans,
                check,
                coverage,
                filled_attention,
                restored_whole: whole,
                split: Some(maps.split),
                deeper_input: None,
                widened: false,
            });
        }
        check
    };
    // The exact rows' pass (if any) is all this prompt wasted; the layers below the split
    // stand, and so do the earlier rows (those its spans ran exactly are the better for it).
    let layers = model.num_layers();
    (maps.split..layers).for_each(|l| cache.truncate_layer(l, from));
    let deeper = maps.deeper.as_deref().filter(|_| from == 0);
    let Some(deeper) = deeper else {
        // A fresh prompt fills again with more of its rows exact, where its question points. A
        // resumed one runs its new rows exactly: retried, lm-eval's all-UUID haystacks through
        // `serve` lost both needles full prefill found (docs/fidelity.md, run L8).
        if let Some(scores) = scores.filter(|_| from == 0 && rows.retries(n)) {
            let wide = rows.widened();
            let spans = choose_new_spans(
                &scores,
                bulk.clone(),
                done,
                wide.exact_rows(n),
                rows.span,
                ends,
                rows.sentence_reach,
            );
            let wide_rows = exact_positions(from, bulk, &spans, n);
            let at = ExactRows {
                at: &wide_rows,
                ..at
            };
            let (h_last, _, whole) = exact_pass(model, maps, h_split, at, cache, oracle)?;
            return Ok(Upper {
                h_last,
                coverage: span_coverage(&scores, bulk.clone(), done, &spans),
                spans,
                check,
                filled_attention,
                restored_whole: whole,
                split: Some(maps.split),
                deeper_input: None,
                widened: true,
            });
        }
        let new_rows = h_split.narrow(0, from, n - from);
        let h = run_exact(model, new_rows, maps.split..layers, cache, from)?;
        return Ok(Upper {
            h_last: h.narrow(0, n - from - 1, 1),
            spans: spans.into_iter().filter(|s| s.end <= from).collect(),
            check,
            coverage,
            filled_attention,
            restored_whole: true,
            split: None,
            deeper_input: None,
            widened: false,
        });
    };
    // Every row runs exactly up to the deeper split; its scoring layer's tail input is kept
    // on the way (or is the one already at hand when that layer lies below this split).
    let deep_scored = scoring_layer(model, deeper.split);
    let (tail_in, h) = if deep_scored >= maps.split {
        let h = run_exact(model, h_split, maps.split..deep_scored, cache, 0)?;
        (h.clone().narrow(0, bulk.end, n - bulk.end), h)
    } else {
        (tail_in, h_split)
    };
    let lowest = deep_scored.max(maps.split);
    let h_deeper = run_exact(model, h, lowest..deeper.split, cache, 0)?;
    let mut up = fill_upper(
        model,
        deeper,
        plan,
        tail_in,
        h_deeper.clone(),
        cache,
        oracle,
    )?;
    if up.split == Some(deeper.split) {
        up.deeper_input = Some(h_deeper);
    }
    Ok(up)
}

/// The positions that run the upper layers exactly, increasing: the sink (the cache holds an
/// earlier prefill's already), the chosen spans and the tail.
fn exact_positions(
    from: usize,
    bulk: &Range<usize>,
    spans: &[Range<usize>],
    n: usize,
) -> Vec<usize> {
    (from.min(bulk.start)..bulk.start)
        .chain(spans.iter().cloned().flatten())
        .chain(bulk.end..n)
        .collect()
}

/// Of the tail's attention (`scores`) on the bulk rows still filled before this prefill (`done`
/// marks earlier exact rows), the share that falls on rows the chosen `spans` run exactly:
/// near 1 when the question reads a few places the spans cover, low when it reads the filled
/// text broadly. `None` when the bulk has no filled row or no attention.
pub(crate) fn span_coverage(
    scores: &[f32],
    bulk: Range<usize>,
    done: &[bool],
    spans: &[Range<usize>],
) -> Option<f64> {
    let total = filled_sum(scores, bulk, done);
    // Spans lie in the bulk, sorted and disjoint: their rows are summed once each.
    let covered = spans
        .iter()
        .map(|s| filled_sum(scores, s.clone(), done))
        .sum::<f64>();
    (total > 0.0).then(|| covered / total)
}

/// The tail's attention (`scores`) on the rows of `range` that `done` does not mark exact.
fn filled_sum(scores: &[f32], range: Range<usize>, done: &[bool]) -> f64 {
    range
        .filter(|&i| !done.get(i).copied().unwrap_or(false))
        .map(|i| f64::from(scores[i]))
        .sum()
}

/// Of the tail's attention (`scores`, every position's), the share on the bulk rows still
/// filled before this prefill (`done` marks earlier exact rows): how much the question reads
/// predicted K/V. `None` when nothing was scored.
pub(crate) fn filled_share(scores: &[f32], bulk: Range<usize>, done: &[bool]) -> Option<f64> {
    let all: f64 = scores.iter().map(|&s| f64::from(s)).sum();
    (all > 0.0).then(|| filled_sum(scores, bulk, done) / all)
}

/// Every row of `h` (entering `layers.start`, positions `pos..`) through `layers` exactly,
/// chunk by chunk as full prefill runs them, so the result is full prefill's to the last bit.
///
/// # Shapes
/// - h: `[n, hidden]` → `[n, hidden]`
fn run_exact(
    model: &Decoder,
    h: Tensor<2>,
    layers: Range<usize>,
    cache: &mut KvCache,
    pos: usize,
) -> Result<Tensor<2>> {
    if layers.is_empty() {
        return Ok(h);
    }
    let n = h.dims()[0];
    let mut out = Vec::with_capacity(n.div_ceil(PREFILL_CHUNK));
    for r0 in (0..n).step_by(PREFILL_CHUNK) {
        let m = PREFILL_CHUNK.min(n - r0);
        let rows = h.clone().narrow(0, r0, m);
        out.push(model.forward_layers(rows, layers.clone(), cache, pos + r0)?);
    }
    Ok(Tensor::cat(out, 0))
}

/// Attention the `tail` rows (at positions `tail0..`) give every cached position of layer
/// `l`, summed over heads and tail rows: the query's own choice of the rows that matter.
///
/// # Shapes
/// - tail: `[t, hidden]` entering layer `l` → `[tail0 + t]` on the host
pub fn tail_scores(
    model: &Decoder,
    l: usize,
    tail: Tensor<2>,
    cache: &KvCache,
    tail0: usize,
) -> Result<Vec<f32>> {
    let cfg = &model.config;
    let (heads, kvh, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim(),
    );
    let t = tail.dims()[0];
    let q = model.qkv(l, tail, Rows::Prompt).narrow(1, 0, heads * hd);
    let q = model.rope_of(l).apply(model.split_heads(q, heads), tail0);
    let (k, _) = cache.read(l);
    let keys = k.dims()[2];
    // Tail row i sits at tail0 + i and sees keys 0..=tail0 + i (the last `window` of them
    // on a sliding-window layer).
    let window = model.layers[l].window.unwrap_or(usize::MAX);
    #[cfg(feature = "flex")]
    if model.cpu_kernels() && window == usize::MAX && cfg.attn_logit_softcapping.is_none() {
        let seen: Vec<usize> = (0..t).map(|i| (tail0 + i + 1).min(keys)).collect();
        let scale = cfg.attention_scale() as f32;
        if let Some(s) = crate::cpu::attention_received(q.clone(), k.clone(), &seen, scale) {
            return finite_scores(s, l);
        }
    }
    let group = heads / kvh;
    let k = k
        .unsqueeze_dim::<5>(2)
        .expand([1, kvh, group, keys, hd])
        .reshape([1, heads, keys, hd]);
    let logits = q
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(cfg.attention_scale())
        .cast(FloatDType::F32);
    let logits = match cfg.attn_logit_softcapping {
        Some(cap) => crate::decoder::attention::softcap(logits, cap),
        None => logits,
    };
    let bits: Vec<bool> = (0..t)
        .flat_map(|i| {
            let lo = (tail0 + i + 1).saturating_sub(window);
            (0..keys).map(move |j| j > tail0 + i || j < lo)
        })
        .collect();
    let mask = Tensor::<4, Bool>::from_data(TensorData::new(bits, [1, 1, t, keys]), &model.device)
        .expand([1, heads, t, keys]);
    let p = activation::softmax(logits.mask_fill(mask, f32::NEG_INFINITY), 3);
    finite_scores(
        crate::to_host_f32(p.sum_dim(1).sum_dim(2).reshape([keys])),
        l,
    )
}

/// `s`, or an error naming the first position whose score is not finite.
fn finite_scores(s: Vec<f32>, l: usize) -> Result<Vec<f32>> {
    match s.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(ModelError::Invalid(format!(
            "non-finite attention score at position {i} in layer {l}"
        ))),
        None => Ok(s),
    }
}

#[cfg(test)]
mod tests {
    use super::{filled_share, span_coverage};

    // One span is a list of one range, not a range to collect.
    #[allow(clippy::single_range_in_vec_init)]
    #[test]
    fn coverage_counts_only_rows_still_filled() {
        // Bulk 1..9; rows 2 and 3 exact already; a span over 5..7.
        let scores = [9.0, 1.0, 5.0, 5.0, 1.0, 2.0, 2.0, 1.0, 1.0, 9.0];
        let done = [true, false, true, true];
        // Filled rows 1, 4..9 hold 8; the span's rows 5 and 6 hold 4.
        assert_eq!(span_coverage(&scores, 1..9, &done, &[5..7]), Some(0.5));
        assert_eq!(span_coverage(&scores, 1..9, &[], &[]), Some(0.0));
        assert_eq!(span_coverage(&[0.0; 4], 1..3, &[], &[1..2]), None);
    }

    #[test]
    fn filled_share_is_the_attention_on_rows_still_filled() {
        // 40 in all; bulk 1..9 holds 22, of which rows 2 and 3 (10) are exact already.
        let scores = [9.0, 1.0, 5.0, 5.0, 1.0, 2.0, 2.0, 1.0, 5.0, 9.0];
        let done = [true, false, true, true];
        assert_eq!(filled_share(&scores, 1..9, &done), Some(12.0 / 40.0));
        assert_eq!(filled_share(&scores, 1..9, &[]), Some(22.0 / 40.0));
        assert_eq!(filled_share(&[0.0; 4], 1..3, &[]), None);
    }
}
