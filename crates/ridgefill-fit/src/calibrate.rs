//! The calibration pass: stream text through the full model and accumulate moments in f64.

use faer::{Accum, Mat, Par};
use ridgefill_io::fill::{FEATURE_KIND, ModelFingerprint};
use ridgefill_io::stats::{Moments, STATS_FORMAT_VERSION, StatsFile, StatsMeta};
use ridgefill_io::text::Document;
use ridgefill_io::tokenizer::Tokenizer;
use ridgefill_model::{Llama, Tensor, to_host_f32};

use crate::{FitError, Result};

#[derive(Clone, Debug)]
pub struct CalibConfig {
    /// First skipped layer.
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
    model: &Llama,
    window: &[u32],
    split: usize,
    sink: usize,
    m: &mut Moments,
) -> Result<()> {
    accumulate_window_at(model, window, split, sink, m, 0)
}

/// [`accumulate_window`] for the `index`-th window of a pass (named in errors).
fn accumulate_window_at(
    model: &Llama,
    window: &[u32],
    split: usize,
    sink: usize,
    m: &mut Moments,
    index: usize,
) -> Result<()> {
    let n = window.len();
    let layers = model.num_layers();
    let mut cache = model.new_cache(n);
    let h = model.embed(window)?;
    let h_split = model.forward_layers(h, 0..split, &mut cache, 0)?;
    let (_, kv) = model.forward_layers_capturing(h_split.clone(), split..layers, &mut cache, 0)?;
    let rows = n - sink;
    let x = model.fill_features(h_split).narrow(0, sink, rows);
    let y = Tensor::cat(kv, 1).narrow(0, sink, rows);
    let (f, cols) = (m.features(), m.cols());
    let x = to_host_f32(x);
    let y = to_host_f32(y);
    for (what, data, width) in [
        ("hidden state entering the split layer", &x, f),
        ("upper-layer K/V", &y, cols),
    ] {
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            return Err(FitError::NonFiniteActivation {
                what,
                window: index,
                position: sink + i / width,
                value: data[i],
            });
        }
    }
    let xm = Mat::<f64>::from_fn(rows, f, |i, j| x[i * f + j] as f64);
    let ym = Mat::<f64>::from_fn(rows, cols, |i, j| y[i * cols + j] as f64);
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
    Ok(())
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
    /// Fail before the pass when no held-out window is left (`--alpha auto` measures KL on
    /// them).
    pub require_heldout: bool,
}

/// One pass over `docs`: the first windows (up to `max_tokens`) feed the fit, the following
/// documents' windows the held-out moments.
pub fn calibrate(
    model: &Llama,
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
    model: &Llama,
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
        return Err(FitError::Invalid(format!(
            "--alpha auto needs held-out text to measure KL, and none is left: held-out windows \
             come from documents after the fit's, and the {} document(s) given are all used by \
             the fit; give more documents, a smaller --max-tokens, or a fixed --alpha",
            docs.len()
        )));
    }
    let cols = (layers - cfg.split) * 2 * model.config.kv_dim();
    let mut fit = Moments::zeros(features, cols);
    let mut heldout = Moments::zeros(features, cols);
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
            accumulate_window_at(model, w, cfg.split, cfg.sink, m, index)?;
            index += 1;
            done += w.len();
            (ctl.progress)(Progress {
                tokens_done: done,
                tokens_total: work,
            });
        }
    }
    let meta = StatsMeta {
        format_version: STATS_FORMAT_VERSION,
        model: fingerprint,
        split: cfg.split,
        sink: cfg.sink,
        feature: FEATURE_KIND.to_string(),
        ctx: cfg.ctx,
        sources: used_docs.iter().map(|&i| docs[i].source.clone()).collect(),
    };
    Ok(Calibration {
        stats: StatsFile { meta, fit, heldout },
        heldout_windows,
    })
}
