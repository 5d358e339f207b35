//! The upper layers of a skip-and-fill prefill: the fill GEMM's K/V written into the cache
//! (keys rotated at their own positions), the exact rows' pass over the filled cache, and the
//! per-prompt update of the maps from those rows' true K/V.

use std::ops::Range;

use burn::tensor::{FloatDType, Tensor, TensorData};

use super::{Adapt, FillMaps, SELF_CHECK_MIN_ROWS, features, select_rows, window_reads};
use crate::cache::KvCache;
use crate::decoder::{At, Decoder};
use crate::error::{ModelError, Result};
use crate::fill::Oracle;
use crate::rope::Rope;
use crate::weight::Rows;

/// Appends predicted K (rotated at each row's own position) and V to layers `split..L`.
///
/// # Shapes
/// - h_split: `[b, hidden]` rows at positions `pos..pos+b`
pub fn fill_cache(
    model: &Decoder,
    maps: &FillMaps,
    h_split: Tensor<2>,
    cache: &mut KvCache,
    pos: usize,
) {
    let upper = model.num_layers() - maps.split;
    // One GEMM for every upper layer's K and V.
    let y = model.linear_dense(features(model, h_split), &maps.w);
    append_fill(model, y, maps.split, upper, cache, pos);
}

/// Appends the fill GEMM's output for layers `first..first + upper` to the cache at
/// positions `pos..`: K rotated, V as is.
///
/// # Shapes
/// - y: `[b, upper·2·kv_heads·hd]`
pub(crate) fn append_fill(
    model: &Decoder,
    y: Tensor<2>,
    first: usize,
    upper: usize,
    cache: &mut KvCache,
    pos: usize,
) {
    let b = y.dims()[0];
    #[cfg(feature = "flex")]
    if model.cpu_kernels() && cache.stored_dtype() == FloatDType::F32 {
        for i in 0..upper {
            let rope = model.rope_of(first + i).host(pos);
            cache.append_with(first + i, b, |k, v, at| {
                crate::cpu::fill_kv_into(&y, i, rope, (k, v), at)
            });
        }
        return;
    }
    let (k, v) = split_fill(model, y, first, upper, b, pos);
    for i in 0..upper {
        let kl = k.clone().narrow(0, i, 1);
        let vl = v.clone().narrow(0, i, 1);
        cache.append(first + i, kl, vl);
    }
}

/// Every upper layer's K, rotated at its row's position, and V out of the fill GEMM's output
/// for layers `first..first + upper`; layers with different RoPE tables are split apart.
///
/// # Shapes
/// - y: `[b, upper·2·kv_heads·hd]` → k and v `[upper, kv_heads, b, hd]`
pub(crate) fn split_fill(
    model: &Decoder,
    y: Tensor<2>,
    first: usize,
    upper: usize,
    b: usize,
    pos: usize,
) -> (Tensor<4>, Tensor<4>) {
    let same_rope =
        (first..first + upper).all(|l| std::ptr::eq(model.rope_of(l), model.rope_of(first)));
    if same_rope {
        return split_fill_rope(model, y, model.rope_of(first), upper, b, pos);
    }
    let kv2 = 2 * model.config.kv_dim();
    let (ks, vs): (Vec<_>, Vec<_>) = (0..upper)
        .map(|i| {
            let yi = y.clone().narrow(1, i * kv2, kv2);
            split_fill_rope(model, yi, model.rope_of(first + i), 1, b, pos)
        })
        .unzip();
    (Tensor::cat(ks, 0), Tensor::cat(vs, 0))
}

/// [`split_fill`] for layers that all rotate with `rope`.
pub(crate) fn split_fill_rope(
    model: &Decoder,
    y: Tensor<2>,
    rope: &Rope,
    upper: usize,
    b: usize,
    pos: usize,
) -> (Tensor<4>, Tensor<4>) {
    let (kvh, hd) = (model.config.num_key_value_heads, model.config.head_dim());
    #[cfg(feature = "flex")]
    if model.cpu_kernels() {
        return crate::cpu::fill_kv(y, upper, kvh, hd, rope.host(pos));
    }
    // [b, upper·2·kvh, hd] → [upper, 2, kvh, b, hd]
    let y = y
        .reshape([b, upper * 2 * kvh, hd])
        .swap_dims(0, 1)
        .reshape([upper, 2, kvh, b, hd]);
    let k = y.clone().narrow(1, 0, 1).reshape([1, upper * kvh, b, hd]);
    let v = y.narrow(1, 1, 1).reshape([upper, kvh, b, hd]);
    // One RoPE op over every upper layer's keys.
    let k = rope.apply(k, pos).reshape([upper, kvh, b, hd]);
    (k, v)
}

/// The rows an [`exact_pass`] runs, and where the cache stands.
#[derive(Clone, Copy)]
pub(crate) struct ExactRows<'a> {
    /// Positions, increasing: sink, chosen spans, tail.
    pub at: &'a [usize],
    /// Rows before this are the attention sink, which the fit never saw.
    pub sink: usize,
    /// Positions the cache's upper layers held before this prefill (0: a fresh prompt).
    pub from: usize,
    /// Per position `0..from`, whether its upper-layer K/V are exact already.
    pub done: &'a [bool],
    /// The first tail row: exact rows from the sink up to here are spans in the bulk.
    pub bulk_end: usize,
    /// Upper layers the rows before `from` (restored spans) run when nothing new is filled;
    /// above them only the new rows go on.
    pub old_layers: usize,
}

/// Runs the rows at positions `rows.at` through the upper layers in one batch, over a cache
/// whose upper layers hold a slot for every position: those before `rows.from` from earlier
/// prefills, the rest filled here; each exact row overwrites its slot and attends to every
/// slot up to its own. With `maps.adapt`, each layer's maps are first updated from the exact
/// rows at or after `rows.sink` (their true K/V at that layer). Returns the last exact row's
/// hidden state and the self-check: the maps' error on those rows (before any update),
/// relative to their spread, averaged over the upper layers — over all of them and over the
/// spans among them ([`SelfCheck`]; `None` when no exact row is past
/// the sink, or when every new row is exact and nothing new is filled), and whether the rows
/// before `from` ran every upper layer (false when `rows.old_layers` stopped them).
///
/// # Shapes
/// - h_split: `[n, hidden]` entering layer `split` → (`[1, hidden]`, self-check, whole)
pub(crate) fn exact_pass(
    model: &Decoder,
    maps: &FillMaps,
    h_split: Tensor<2>,
    rows: ExactRows<'_>,
    cache: &mut KvCache,
    oracle: Option<&Oracle>,
) -> Result<(Tensor<2>, SelfCheck, bool)> {
    let ExactRows {
        at: mut exact,
        sink,
        from,
        done,
        bulk_end,
        old_layers,
    } = rows;
    let n = h_split.dims()[0];
    let layers = model.num_layers();
    let (kvh, hd) = (model.config.num_key_value_heads, model.config.head_dim());
    let kv2 = 2 * kvh * hd;
    // With every new row exact (a short follow-up over a cached prefix) nothing new is filled:
    // the maps only reach old rows a sliding window now reads, so neither the per-prompt update
    // nor the self-check is worth its passes.
    let fills_new = exact.len() - exact.partition_point(|&p| p < from) < n - from;
    let x_all = fills_new.then(|| features(model, h_split.clone()));
    let x_rows = |r: Range<usize>| match &x_all {
        Some(x) => x.clone().narrow(0, r.start, r.len()),
        None => features(model, h_split.clone().narrow(0, r.start, r.len())),
    };
    let mut h = select_rows(h_split.clone(), exact);
    // Exact rows past the sink (the fit never saw sink rows), as indices into `exact`.
    let first = exact.partition_point(|&p| p < sink);
    let checked = if fills_new { exact.len() - first } else { 0 };
    let spans = span_check_rows(exact[first..].partition_point(|&p| p < bulk_end), checked);
    let xe = match &x_all {
        Some(x) if checked > 0 => Some(select_rows(x.clone(), &exact[first..])),
        _ => None,
    };
    let gain = match (&maps.adapt, &xe) {
        (Some(a), Some(xe)) if a.weight > 0.0 => Some(adapt_gain(model, a, xe.clone())?),
        _ => None,
    };
    // Restored rows stop early only when no update or self-check counts them in every layer.
    let restored = exact.partition_point(|&p| p < from);
    let stop = match fills_new || restored == 0 {
        true => layers,
        false => (maps.split + old_layers).min(layers),
    };
    // Per upper layer: the maps' squared error on the checked rows, and their squared spread.
    let mut errors: Vec<Tensor<1>> = Vec::with_capacity(2 * (layers - maps.split));
    let mut span_errors: Vec<Tensor<1>> = Vec::with_capacity(2 * (layers - maps.split));
    for l in maps.split..layers {
        if l == stop {
            // The restored rows' K/V are written up to here; the new rows go on alone.
            h = h.clone().narrow(0, restored, exact.len() - restored);
            exact = &exact[restored..];
        }
        let i = l - maps.split;
        let qkv = model.qkv(l, h.clone(), Rows::Prompt);
        let mut w = maps.w.clone().narrow(1, i * kv2, kv2);
        if let Some(xe) = &xe {
            let truth = qkv
                .clone()
                .narrow(1, model.config.q_dim(), kv2)
                .narrow(0, first, checked);
            let resid = truth.clone() - model.linear_dense(xe.clone(), &w);
            push_error(&mut errors, truth.clone(), resid.clone());
            if spans > 0 {
                let (t, r) = (truth.narrow(0, 0, spans), resid.clone().narrow(0, 0, spans));
                push_error(&mut span_errors, t, r);
            }
            if let Some(gain) = &gain {
                w = model.linear_dense_add(gain.clone(), &resid, w);
            }
        }
        match model.layers[l].window.filter(|_| !maps.fill_unread) {
            Some(window) => {
                // Only rows some exact row (or, past the tail, a decode step) can reach are
                // ever read; the rest keep whatever the storage holds, masked out. An earlier
                // prefill left its own unread rows unwritten: those an old span now reaches are
                // filled here (rows already exact keep their K/V).
                cache.reserve(l, n - from);
                let reads = window_reads(exact, window).into_iter().flat_map(|r| {
                    let old = r.start..r.end.min(from);
                    let mut parts = unfinished_runs(old, done);
                    parts.push(r.start.max(from)..r.end);
                    parts
                });
                for r in reads.filter(|r| !r.is_empty()) {
                    let y = model.linear_dense(x_rows(r.clone()), &w);
                    let (k, v) = split_fill(model, y, l, 1, r.len(), r.start);
                    cache.overwrite(l, r.start, k, v);
                }
            }
            // Every new row runs exactly (a short follow-up): the block writes their K/V.
            None if !fills_new => cache.reserve(l, n - from),
            None => {
                let y = model.linear_dense(x_rows(from..n), &w);
                append_fill(model, y, l, 1, cache, from);
            }
        }
        if let Some(o) = oracle {
            o.restore(l, cache)?;
        }
        let (next, _) = model.block_qkv(l, h, qkv, cache, At::Rows(exact));
        h = next;
    }
    let m = exact.len();
    Ok((
        h.narrow(0, m - 1, 1),
        SelfCheck {
            all: relative_error(errors),
            spans: relative_error(span_errors),
        },
        stop == layers,
    ))
}

/// The runs of positions in `range` that `done` does not mark exact.
fn unfinished_runs(range: Range<usize>, done: &[bool]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for p in range.filter(|&p| !done.get(p).copied().unwrap_or(false)) {
        match out.last_mut() {
            Some(r) if r.end == p => r.end = p + 1,
            _ => out.push(p..p + 1),
        }
    }
    out
}

/// The self-check's two readings of the maps' error (see [`exact_pass`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SelfCheck {
    /// Over every exact row past the sink: spans and tail (the final question).
    pub all: Option<f64>,
    /// Over the spans alone, when they are enough ([`span_check_rows`]).
    pub spans: Option<f64>,
}

/// How many leading rows of the `checked` exact rows (`spans` of them spans, then the tail's)
/// the spans' reading measures: all the spans when they are enough to measure a spread, else
/// none. The spans are bulk rows like those the fill predicts; the tail is the final question,
/// which the maps fit better than a haystack of coded words around it (RULER's fwe at 4096
/// tokens reads 0.64–0.72 over every row, 0.72–0.81 over the spans).
fn span_check_rows(spans: usize, checked: usize) -> usize {
    match spans.min(checked) {
        s if s >= SELF_CHECK_MIN_ROWS => s,
        _ => 0,
    }
}

/// Pushes one layer's squared error `resid` and squared spread of `truth` about its mean.
///
/// # Shapes
/// - truth, resid: `[rows, 2·kv_dim]`
fn push_error(errors: &mut Vec<Tensor<1>>, truth: Tensor<2>, resid: Tensor<2>) {
    let spread = truth.clone() - truth.mean_dim(0);
    errors.push(resid.cast(FloatDType::F32).powi_scalar(2).sum());
    errors.push(spread.cast(FloatDType::F32).powi_scalar(2).sum());
}

/// Mean over layers of squared error over squared spread, from [`exact_pass`]'s per-layer
/// pairs; one host read for all of them.
fn relative_error(pairs: Vec<Tensor<1>>) -> Option<f64> {
    if pairs.is_empty() {
        return None;
    }
    let host = crate::to_host_f32(Tensor::cat(pairs, 0));
    let layers = host.len() / 2;
    let sum: f64 = host
        .chunks_exact(2)
        .map(|p| f64::from(p[0]) / f64::from(p[1]).max(f64::MIN_POSITIVE))
        .sum();
    Some(sum / layers as f64)
}

/// The gain `P·(I/weight + Xe·P)⁻¹` with `P = G⁻¹·Xeᵀ`, for the exact rows' features `xe`:
/// each layer's maps move by `gain · (truth − Xe·W)`.
///
/// # Shapes
/// - xe: `[k, hidden + 1]` → `[hidden + 1, k]`
pub(crate) fn adapt_gain(model: &Decoder, a: &Adapt, xe: Tensor<2>) -> Result<Tensor<2>> {
    let k = xe.dims()[0];
    let p = a.precision.clone().matmul(xe.clone().transpose());
    let xp = crate::to_host_f32(xe.clone().matmul(p.clone()).cast(FloatDType::F32));
    let mut sys: Vec<f64> = xp.iter().map(|&v| f64::from(v)).collect();
    // Symmetrise: the device product is symmetric only up to rounding.
    for r in 0..k {
        for c in 0..r {
            let avg = 0.5 * (sys[r * k + c] + sys[c * k + r]);
            sys[r * k + c] = avg;
            sys[c * k + r] = avg;
        }
        sys[r * k + r] += 1.0 / a.weight;
    }
    let inv: Vec<f32> = spd_inverse(&sys, k)?
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let m = Tensor::<2>::from_data(TensorData::new(inv, [k, k]), &model.device).cast(model.dtype);
    Ok(model.linear_dense(p, &m))
}

/// Inverse of a symmetric positive definite `k × k` matrix (row-major) by Cholesky, in f64:
/// `A = L·Lᵀ`, `Y = L⁻¹`, `A⁻¹ = Yᵀ·Y`.
///
/// Hand-written: the engine reads fill files without `faer`, and `k` (the prompt's exact rows)
/// is hundreds to a couple of thousand. Every inner loop is a dot product with independent
/// partial sums or an axpy over a contiguous row, so it vectorises: as column-by-column
/// triangular solves (sums that wait on each other, `L` read down its columns) 460 rows took
/// 78 ms and 1100 (a quarter of a 4096-token prompt exact) 2.9 s; this way 14 and 290 ms.
fn spd_inverse(a: &[f64], k: usize) -> Result<Vec<f64>> {
    // Lower factor L with A = L·Lᵀ; row i from the rows above it.
    let mut l = vec![0.0f64; k * k];
    for i in 0..k {
        let (above, rest) = l.split_at_mut(i * k);
        let row = &mut rest[..k];
        for j in 0..=i {
            let lj = if j == i {
                &row[..j]
            } else {
                &above[j * k..j * k + j]
            };
            let v = a[i * k + j] - dot(&row[..j], lj);
            if i == j {
                if v.is_nan() || v <= 0.0 {
                    return Err(ModelError::Invalid(format!(
                        "per-prompt fill update: the exact rows' system is not positive definite \
                         (pivot {i} is {v})"
                    )));
                }
                row[i] = v.sqrt();
            } else {
                row[j] = v / above[j * k + j];
            }
        }
    }
    // Y = L⁻¹, lower triangular: row i is (e_i − Σ_{j<i} L[i,j]·Y[j,:]) / L[i,i].
    let mut y = vec![0.0f64; k * k];
    for i in 0..k {
        let (above, rest) = y.split_at_mut(i * k);
        let row = &mut rest[..=i];
        row[i] = 1.0;
        for (j, &lij) in l[i * k..i * k + i].iter().enumerate() {
            axpy(&mut row[..=j], -lij, &above[j * k..=j * k + j]);
        }
        let d = 1.0 / l[i * k + i];
        row.iter_mut().for_each(|x| *x *= d);
    }
    // A⁻¹ = Yᵀ·Y, its upper triangle: row i of Y adds Y[i,a]·Y[i,a..=i] to row a, for every
    // a ≤ i; a block of Y's rows at a time, so each row of the inverse is read once a block.
    let mut inv = vec![0.0f64; k * k];
    for i0 in (0..k).step_by(INVERSE_BLOCK) {
        let i1 = (i0 + INVERSE_BLOCK).min(k);
        for a in 0..i1 {
            let row = &mut inv[a * k..(a + 1) * k];
            for i in i0.max(a)..i1 {
                axpy(&mut row[a..=i], y[i * k + a], &y[i * k + a..=i * k + i]);
            }
        }
    }
    // The lower triangle mirrors it.
    for a in 0..k {
        for b in 0..a {
            inv[a * k + b] = inv[b * k + a];
        }
    }
    Ok(inv)
}

/// Rows of `L⁻¹` per pass over the inverse in [`spd_inverse`] (32 rows of 1100 are 280 KB).
const INVERSE_BLOCK: usize = 32;

/// Partial sums in this many independent lanes, so a dot product vectorises.
const DOT_LANES: usize = 8;

/// `Σ x_i·y_i` over equal-length slices.
fn dot(x: &[f64], y: &[f64]) -> f64 {
    let mut acc = [0.0f64; DOT_LANES];
    let (xc, yc) = (x.chunks_exact(DOT_LANES), y.chunks_exact(DOT_LANES));
    let tail: f64 = xc
        .remainder()
        .iter()
        .zip(yc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in xc.zip(yc) {
        for lane in 0..DOT_LANES {
            acc[lane] += a[lane] * b[lane];
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// `out += s · x` over equal-length slices.
fn axpy(out: &mut [f64], s: f64, x: &[f64]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += s * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spans_are_read_apart_when_they_are_enough() {
        let enough = SELF_CHECK_MIN_ROWS;
        assert_eq!(span_check_rows(enough, enough + 40), enough);
        assert_eq!(span_check_rows(enough - 1, enough + 40), 0);
        // Nothing checked (a follow-up that fills nothing): nothing measured.
        assert_eq!(span_check_rows(enough, 0), 0);
    }

    #[test]
    fn spd_inverse_inverts() {
        let a = [4.0, 2.0, 0.6, 2.0, 5.0, 1.0, 0.6, 1.0, 3.0];
        let inv = spd_inverse(&a, 3).unwrap();
        for r in 0..3 {
            for c in 0..3 {
                let v: f64 = (0..3).map(|j| a[r * 3 + j] * inv[j * 3 + c]).sum();
                let want = if r == c { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-12, "({r},{c}) = {v}");
            }
        }
        assert!(spd_inverse(&[1.0, 2.0, 2.0, 1.0], 2).is_err());
    }

    #[test]
    fn spd_inverse_inverts_past_its_dot_lanes() {
        // B·Bᵀ + k·I for a fixed pseudo-random B: wide enough for every loop's remainder.
        let k = 3 * DOT_LANES + 5;
        let b: Vec<f64> = (0..k * k)
            .map(|i| ((i * 7919 % 101) as f64 / 101.0) - 0.5)
            .collect();
        let a: Vec<f64> = (0..k * k)
            .map(|rc| {
                let (r, c) = (rc / k, rc % k);
                let d: f64 = (0..k).map(|j| b[r * k + j] * b[c * k + j]).sum();
                d + if r == c { k as f64 } else { 0.0 }
            })
            .collect();
        let inv = spd_inverse(&a, k).unwrap();
        for r in 0..k {
            for c in 0..k {
                let v: f64 = (0..k).map(|j| a[r * k + j] * inv[j * k + c]).sum();
                let want = if r == c { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-12, "({r},{c}) = {v}");
                assert_eq!(inv[r * k + c].to_bits(), inv[c * k + r].to_bits());
            }
        }
    }
}
