//! The calibration pass: stream text through the full model and accumulate moments in f64.

use faer::{Accum, Mat, Par};
use ridgefill_io::fill::{FEATURE_KIND, ModelFingerprint};
use ridgefill_io::stats::{Moments, STATS_FORMAT_VERSION, StatsFile, StatsMeta};
use ridgefill_io::text::Document;
use ridgefill_io::tokenizer::Tokenizer;
use ridgefill_model::fill::{self};
use ridgefill_model::{Decoder, Tensor, to_host_f32};

use crate::{FitError, Result};

#[derive(Clone, Debug)]
pub struct CalibConfig {
    /// First skipped layer ([`calibrate_splits_with`] takes its splits separately and ignores
    /// this).
    pub split: usize,
    /// Leading rows of each window left out of the statistics: they are computed exactly at run
    /// time and are outliers (the attention sink).
    pub sink: usize,
    /// Window length in tokens.
    pub ctx: usize,
    /// Fit on at most this many tokens (window rows); `None` = all the text.
    pub max_tokens: Option<usize>,
    /// Share of the windows kept out of the fit to choose α and report R² and KL.
    pub heldout_fraction: f64,
}

/// Where the pass is, for a progress bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub tokens_done: usize,
    pub tokens_total: usize,
}

pub struct Calibration {
    pub stats: StatsFile,
    /// Held-out windows (token ids), kept to choose α by KL.
    pub heldout_windows: Vec<Vec<u32>>,
}

/// Shortest window worth a forward pass: the sink plus a couple of rows.
const MIN_WINDOW_ROWS: usize = 2;
/// Held-out windows kept at least, so α is never chosen on a handful of tokens.
const MIN_HELDOUT_WINDOWS: usize = 4;

/// Cuts each document into non-overlapping windows of `ctx` tokens (short tails dropped).
/// Each window comes with the index of its document.
fn windows(
    tok: &Tokenizer,
    docs: &[Document],
    ctx: usize,
    sink: usize,
    stop: &dyn Fn() -> bool,
) -> Result<Vec<(usize, Vec<u32>)>> {
    let mut out = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if stop() {
            return Err(FitError::Stopped);
        }
        let ids = tok.encode(&d.text, true)?;
        for w in ids.chunks(ctx) {
            if w.len() >= sink + MIN_WINDOW_ROWS {
                out.push((i, w.to_vec()));
            }
        }
    }
    Ok(out)
}

/// Runs one window through the full model and adds its moments (sink rows excluded).
pub fn accumulate_window(
    model: &Decoder,
    window: &[u32],
    split: usize,
    sink: usize,
    m: &mut Moments,
) -> Result<()> {
    check_splits(model.num_layers(), &[split])?;
    accumulate_window_at(model, window, &[split], sink, std::slice::from_mut(m), 0)
}

/// Runs one window through the full model once and adds, for every split of `splits`
/// (ascending, distinct, each in `1..L`), that split's moments to the matching entry of
/// `moments`: features from the hidden state entering the split, targets the K/V of layers
/// `split..L`. Each entry ends up exactly as [`accumulate_window`] at its split leaves it.
pub fn accumulate_window_splits(
    model: &Decoder,
    window: &[u32],
    splits: &[usize],
    sink: usize,
    moments: &mut [Moments],
) -> Result<()> {
    check_splits(model.num_layers(), splits)?;
    if moments.len() != splits.len() {
        return Err(FitError::Invalid(format!(
            "{} moments for {} splits",
            moments.len(),
            splits.len()
        )));
    }
    accumulate_window_at(model, window, splits, sink, moments, 0)
}

/// Checks that `splits` is non-empty, ascending, distinct and inside `1..layers`.
fn check_splits(layers: usize, splits: &[usize]) -> Result<()> {
    if splits.is_empty() {
        return Err(FitError::Invalid("no split to calibrate for".into()));
    }
    if let Some(&s) = splits.iter().find(|&&s| s == 0 || s >= layers) {
        return Err(FitError::Invalid(format!(
            "split candidate {s} is out of range for a {layers}-layer model (need 0 < split < \
             {layers})"
        )));
    }
    if splits.windows(2).any(|p| p[0] >= p[1]) {
        return Err(FitError::Invalid(format!(
            "split candidates {splits:?} are not ascending and distinct"
        )));
    }
    Ok(())
}

/// The `index`-th window of a pass (named in errors) for every split of `splits` (ascending,
/// distinct, in range; `moments[i]` belongs to `splits[i]`).
///
/// The model runs once: layers `0..splits[0]`, then each segment between consecutive splits
/// capturing K/V, so the hidden state entering every split and every upper layer's K/V come
/// out of the same forward pass.
fn accumulate_window_at(
    model: &Decoder,
    window: &[u32],
    splits: &[usize],
    sink: usize,
    moments: &mut [Moments],
    index: usize,
) -> Result<()> {
    let n = window.len();
    let layers = model.num_layers();
    let first = splits[0];
    let rows = n - sink;
    let mut cache = model.new_cache(n);
    let mut h = model.forward_layers(model.embed(window)?, 0..first, &mut cache, 0)?;
    let mut xs = Vec::with_capacity(splits.len());
    let mut kv = Vec::with_capacity(layers - first);
    for (i, &s) in splits.iter().enumerate() {
        let end = splits.get(i + 1).copied().unwrap_or(layers);
        xs.push(to_host_f32(
            fill::features(model, h.clone()).narrow(0, sink, rows),
        ));
        let (next, seg) = model.forward_layers_capturing(h, s..end, &mut cache, 0)?;
        h = next;
        kv.extend(seg);
    }
    drop(h);
    // Every upper layer of the first split, in the statistics' column order; a deeper split's
    // targets are a suffix of these columns.
    let y = to_host_f32(Tensor::cat(kv, 1).narrow(0, sink, rows));
    let f = model.config.hidden_size + 1;
    let all_cols = (layers - first) * 2 * model.config.kv_dim();
    let checks = xs
        .iter()
        .map(|x| ("hidden state entering the split layer", x, f))
        .chain([("upper-layer K/V", &y, all_cols)]);
    for (what, data, width) in checks {
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            return Err(FitError::NonFiniteActivation {
                what,
                window: index,
                position: sink + i / width,
                value: data[i],
            });
        }
    }
    for ((x, &s), m) in xs.iter().zip(splits).zip(moments.iter_mut()) {
        let offset = (s - first) * 2 * model.config.kv_dim();
        add_moments(m, x, &y, all_cols, offset, rows);
    }
    Ok(())
}

/// Adds `rows` samples to `m`: features `x` (`[rows, features]` row-major) and targets the
/// `m.cols()` columns of `y` (`[rows, stride]` row-major) starting at column `offset`.
fn add_moments(m: &mut Moments, x: &[f32], y: &[f32], stride: usize, offset: usize, rows: usize) {
    let (f, cols) = (m.features(), m.cols());
    debug_assert!(x.len() == rows * f && offset + cols <= stride && y.len() == rows * stride);
    let xm = Mat::<f64>::from_fn(rows, f, |i, j| x[i * f + j] as f64);
    let ym = Mat::<f64>::from_fn(rows, cols, |i, j| y[i * stride + offset + j] as f64);
    let mut xtx = faer::MatMut::from_row_major_slice_mut(&mut m.xtx, f, f);
    faer::linalg::matmul::matmul(
        &mut xtx,
        Accum::Add,
        xm.transpose(),
        &xm,
        1.0,
        Par::rayon(0),
    );
    let mut xty = faer::MatMut::from_row_major_slice_mut(&mut m.xty, f, cols);
    faer::linalg::matmul::matmul(
        &mut xty,
        Accum::Add,
        xm.transpose(),
        &ym,
        1.0,
        Par::rayon(0),
    );
    for i in 0..rows {
        for j in 0..cols {
            let v = ym[(i, j)];
            m.y_sum[j] += v;
            m.y_sq[j] += v * v;
        }
    }
    m.rows += rows as u64;
}

/// Hooks into a calibration pass.
pub struct Control<'a> {
    /// Called once before the first window (`tokens_done` 0) and after every window.
    pub progress: &'a mut dyn FnMut(Progress),
    /// Polled between documents and windows; `true` ends the pass with [`FitError::Stopped`].
    pub stop: &'a dyn Fn() -> bool,
    /// Fail with [`FitError::TooFewTokens`] before the pass when the fit windows cannot reach
    /// [`crate::min_rows`]. Off for statistics shards, which are summed before any solve.
    pub require_solvable: bool,
    /// Fail before the pass when no held-out window is left (`--alpha auto` and `--split auto`
    /// measure KL on them).
    pub require_heldout: bool,
}

/// One pass over `docs`: the first windows (up to `max_tokens`) feed the fit, the following
/// documents' windows the held-out moments.
pub fn calibrate(
    model: &Decoder,
    fingerprint: ModelFingerprint,
    tok: &Tokenizer,
    docs: &[Document],
    cfg: &CalibConfig,
    progress: &mut dyn FnMut(Progress),
) -> Result<Calibration> {
    calibrate_with(
        model,
        fingerprint,
        tok,
        docs,
        cfg,
        Control {
            progress,
            stop: &|| false,
            require_solvable: false,
            require_heldout: false,
        },
    )
}

/// [`calibrate`] with a stop hook and an early check that the text is enough for a solve.
pub fn calibrate_with(
    model: &Decoder,
    fingerprint: ModelFingerprint,
    tok: &Tokenizer,
    docs: &[Document],
    cfg: &CalibConfig,
    ctl: Control<'_>,
) -> Result<Calibration> {
    let layers = model.num_layers();
    if cfg.split == 0 || cfg.split >= layers {
        return Err(FitError::Invalid(format!(
            "--split {} is out of range for a {layers}-layer model (need 0 < split < {layers})",
            cfg.split
        )));
    }
    let mut cal = pass(
        model,
        fingerprint,
        tok,
        docs,
        cfg,
        &[cfg.split],
        ctl,
        ("--alpha auto", ", or a fixed --alpha"),
    )?;
    Ok(Calibration {
        stats: cal.stats.pop().expect("one statistics file per split"),
        heldout_windows: cal.heldout_windows,
    })
}

/// Statistics for several candidate splits from one calibration pass.
pub struct SplitCalibration {
    /// One statistics file per split, in the (ascending) order of the splits; each is exactly
    /// what [`calibrate_with`] at that split gives.
    pub stats: Vec<StatsFile>,
    /// Held-out windows (token ids), shared by every split.
    pub heldout_windows: Vec<Vec<u32>>,
}

/// [`calibrate_with`] for every split of `splits` (ascending, distinct, each in `1..L`) in one
/// pass: each window runs through the model once and feeds every split's moments. `cfg.split`
/// is ignored. Memory grows with the candidates: split `s` keeps
/// `(d + 1) · (L − s) · 2 · kv_dim` f64 for each of the fit and held-out sets.
pub fn calibrate_splits_with(
    model: &Decoder,
    fingerprint: ModelFingerprint,
    tok: &Tokenizer,
    docs: &[Document],
    cfg: &CalibConfig,
    splits: &[usize],
    ctl: Control<'_>,
) -> Result<SplitCalibration> {
    pass(
        model,
        fingerprint,
        tok,
        docs,
        cfg,
        splits,
        ctl,
        ("--split auto", ""),
    )
}

/// The calibration pass for `splits`; `heldout_need` names what needs held-out windows and
/// the remedy beyond more text, for the error when none is left.
#[allow(clippy::too_many_arguments)]
fn pass(
    model: &Decoder,
    fingerprint: ModelFingerprint,
    tok: &Tokenizer,
    docs: &[Document],
    cfg: &CalibConfig,
    splits: &[usize],
    ctl: Control<'_>,
    heldout_need: (&str, &str),
) -> Result<SplitCalibration> {
    let layers = model.num_layers();
    check_splits(layers, splits)?;
    if cfg.ctx < cfg.sink + MIN_WINDOW_ROWS {
        return Err(FitError::Invalid(format!(
            "--ctx {} is too short: each window needs the {} sink token(s) plus at least \
             {MIN_WINDOW_ROWS} rows",
            cfg.ctx, cfg.sink
        )));
    }
    if !(0.0..1.0).contains(&cfg.heldout_fraction) {
        return Err(FitError::Invalid(format!(
            "held-out fraction {} is outside [0, 1)",
            cfg.heldout_fraction
        )));
    }
    let all = windows(tok, docs, cfg.ctx, cfg.sink, ctl.stop)?;
    let total: usize = all.iter().map(|(_, w)| w.len()).sum();
    let fit_budget = cfg
        .max_tokens
        .unwrap_or(((1.0 - cfg.heldout_fraction) * total as f64) as usize);
    let heldout_budget = ((fit_budget as f64 * cfg.heldout_fraction / (1.0 - cfg.heldout_fraction))
        as usize)
        .max(MIN_HELDOUT_WINDOWS * cfg.ctx);
    let mut fit_windows = Vec::new();
    let mut heldout_windows = Vec::new();
    let (mut fit_tokens, mut held_tokens) = (0, 0);
    let mut used_docs = std::collections::BTreeSet::new();
    let mut last_fit_doc = None;
    for (doc, w) in all {
        if fit_tokens < fit_budget {
            fit_tokens += w.len();
            fit_windows.push(w);
            last_fit_doc = Some(doc);
        } else if Some(doc) == last_fit_doc {
            // Held-out text comes from documents the fit never saw.
            continue;
        } else if held_tokens < heldout_budget {
            held_tokens += w.len();
            heldout_windows.push(w);
        } else {
            break;
        }
        used_docs.insert(doc);
    }
    let features = model.config.hidden_size + 1;
    if ctl.require_solvable {
        let rows: u64 = fit_windows
            .iter()
            .map(|w| (w.len() - cfg.sink) as u64)
            .sum();
        let needed = crate::min_rows(features);
        if rows < needed {
            return Err(FitError::TooFewTokens {
                rows,
                features,
                needed,
            });
        }
    }
    if ctl.require_heldout && heldout_windows.is_empty() {
        let (what, remedy) = heldout_need;
        return Err(FitError::Invalid(format!(
            "{what} needs held-out text to measure KL, and none is left: held-out windows come \
             from documents after the fit's, and the {} document(s) given are all used by the \
             fit; give more documents, a smaller --max-tokens{remedy}",
            docs.len()
        )));
    }
    let zeros = || -> Vec<Moments> {
        splits
            .iter()
            .map(|&s| Moments::zeros(features, (layers - s) * 2 * model.config.kv_dim()))
            .collect()
    };
    let (mut fit, mut heldout) = (zeros(), zeros());
    let work = fit_tokens + held_tokens;
    let mut done = 0;
    (ctl.progress)(Progress {
        tokens_done: 0,
        tokens_total: work,
    });
    let mut index = 0;
    for (set, m) in [(&fit_windows, &mut fit), (&heldout_windows, &mut heldout)] {
        for w in set {
            if (ctl.stop)() {
                return Err(FitError::Stopped);
            }
            accumulate_window_at(model, w, splits, cfg.sink, m, index)?;
            index += 1;
            done += w.len();
            (ctl.progress)(Progress {
                tokens_done: done,
                tokens_total: work,
            });
        }
    }
    let sources: Vec<String> = used_docs.iter().map(|&i| docs[i].source.clone()).collect();
    let stats = splits
        .iter()
        .zip(fit.into_iter().zip(heldout))
        .map(|(&split, (fit, heldout))| StatsFile {
            meta: StatsMeta {
                format_version: STATS_FORMAT_VERSION,
                model: fingerprint.clone(),
                split,
                sink: cfg.sink,
                feature: FEATURE_KIND.to_string(),
                ctx: cfg.ctx,
                sources: sources.clone(),
            },
            fit,
            heldout,
        })
        .collect();
    Ok(SplitCalibration {
        stats,
        heldout_windows,
    })
}
