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
) -> Result<Vec<(usize, Vec<u32>)>> {
    let mut out = Vec::new();
    for (i, d) in docs.iter().enumerate() {
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
    if let Some(i) = x.iter().chain(&y).position(|v| !v.is_finite()) {
        return Err(FitError::Invalid(format!(
            "non-finite activation (index {i}) in a calibration window: the model overflowed"
        )));
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
    let layers = model.num_layers();
    if cfg.split == 0 || cfg.split >= layers {
        return Err(FitError::Invalid(format!(
            "--split {} is out of range for a {layers}-layer model (need 0 < split < {layers})",
            cfg.split
        )));
    }
    let all = windows(tok, docs, cfg.ctx, cfg.sink)?;
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
    let cols = (layers - cfg.split) * 2 * model.config.kv_dim();
    let mut fit = Moments::zeros(features, cols);
    let mut heldout = Moments::zeros(features, cols);
    let work = fit_tokens + held_tokens;
    let mut done = 0;
    for (set, m) in [(&fit_windows, &mut fit), (&heldout_windows, &mut heldout)] {
        for w in set {
            accumulate_window(model, w, cfg.split, cfg.sink, m)?;
            done += w.len();
            progress(Progress {
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
