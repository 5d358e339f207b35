//! Ridge solve `(XᵀX + λ·I′) W = XᵀY` (Cholesky, intercept unpenalised), α selection by held-out
//! KL, held-out R², and the fill file.

use faer::linalg::solvers::Solve;
use faer::{Mat, MatRef, Side};
use ridgefill_io::fill::{
    AlphaTrial, FILL_FORMAT_VERSION, FillFile, FillMeta, FillMethodMeta, LayerQuality, SplitTrial,
};
use ridgefill_io::stats::{Moments, StatsFile};
use ridgefill_model::eval::{self, Method, Skip, WindowStats, prefill_flops};
use ridgefill_model::fill::{FillMaps, FillMethod, FillRows};
use ridgefill_model::{Decoder, Tensor};

use crate::{FitError, Result};

/// α grid for `--alpha auto`: λ = α·tr(XᵀX)/d spans weak to strong shrinkage.
pub const DEFAULT_ALPHA_GRID: &[f64] = &[1e-5, 1e-4, 1e-3, 1e-2, 1e-1];

/// Rows (calibration tokens after each window's sink) needed per feature before a solve is
/// attempted.
///
/// `features` rows are the bare minimum for XᵀX to have full rank at all; below that the fit
/// is determined by the ridge penalty alone. Twice that is the floor we accept: ordinary least
/// squares with n rows and p features inflates the expected held-out squared error by about
/// n / (n − p − 1), which is ≈ 2 at n = 2p and falls quickly beyond (1.1 at n = 11p), and the
/// ridge penalty only lowers it further. For SmolLM2-135M (577 features) that is 1,154 tokens;
/// the README recommends 50,000 (≈ 90 per feature) for good maps.
pub const MIN_ROWS_PER_FEATURE: u64 = 2;

/// Fit rows a solve with `features` features (hidden size + 1) needs at least.
pub fn min_rows(features: usize) -> u64 {
    MIN_ROWS_PER_FEATURE.saturating_mul(features as u64)
}

/// Continuation tokens scored per held-out window when choosing α.
pub const HELDOUT_CONT: usize = 64;

#[derive(Clone, Debug)]
pub enum AlphaChoice {
    /// Pick the α of the grid with the lowest held-out KL.
    Auto(Vec<f64>),
    Fixed(f64),
}

#[derive(Clone, Debug)]
pub struct FitOptions {
    pub alpha: AlphaChoice,
    /// Exact rows used when measuring held-out KL (as at run time), with the method's span
    /// budget.
    pub rows: FillRows,
    /// The method recorded in the file and used for the held-out measurements.
    pub method: FillMethod,
    /// Weight of an exact row in the per-prompt update (method `spans-adapt`).
    pub adapt_weight: f64,
    pub created_by: String,
}

impl FitOptions {
    /// What the fill file records about the method.
    pub fn method_meta(&self) -> FillMethodMeta {
        let spans = self.method != FillMethod::Ridge;
        FillMethodMeta {
            name: self.method.name().into(),
            exact: if spans { self.rows.exact } else { 0.0 },
            span_radius: if spans { self.rows.span } else { 0 },
            adapt_weight: if self.method == FillMethod::SpansAdapt {
                self.adapt_weight
            } else {
                0.0
            },
        }
    }

    /// The rows the method runs with.
    pub fn method_rows(&self) -> FillRows {
        match self.method {
            FillMethod::Ridge => FillRows {
                exact: 0.0,
                ..self.rows
            },
            _ => self.rows,
        }
    }
}

/// `(XᵀX + λ·D)⁻¹` (bias unpenalised), `[features, features]`: what the per-prompt update of the
/// maps needs from the calibration.
pub fn precision(fit: &Moments, lambda: f64) -> Result<Mat<f64>> {
    let f = fit.features();
    let (xtx, _) = moments_view(fit);
    let mut a = xtx.to_owned();
    for i in 0..f - 1 {
        a[(i, i)] += lambda;
    }
    let llt = a
        .llt(Side::Lower)
        .map_err(|_| FitError::NotPositiveDefinite { alpha: lambda })?;
    Ok(llt.solve(Mat::<f64>::identity(f, f)))
}

/// Row-major f32 copy of a square matrix.
fn host_square(m: &Mat<f64>) -> Vec<f32> {
    let f = m.nrows();
    (0..f * f).map(|i| m[(i / f, i % f)] as f32).collect()
}

fn moments_view(m: &Moments) -> (MatRef<'_, f64>, MatRef<'_, f64>) {
    let (f, c) = (m.features(), m.cols());
    (
        MatRef::from_row_major_slice(&m.xtx, f, f),
        MatRef::from_row_major_slice(&m.xty, f, c),
    )
}

/// Solves for W (`[features, cols]`) at `alpha`; returns W and λ.
pub fn ridge_solve(fit: &Moments, alpha: f64) -> Result<(Mat<f64>, f64)> {
    let f = fit.features();
    let needed = min_rows(f);
    if fit.rows < needed {
        return Err(FitError::TooFewTokens {
            rows: fit.rows,
            features: f,
            needed,
        });
    }
    let (xtx, xty) = moments_view(fit);
    // The last feature is the constant 1: its intercept is not penalised.
    let d = f - 1;
    let trace: f64 = (0..d).map(|i| xtx[(i, i)]).sum();
    let lambda = alpha * trace / d as f64;
    let mut a = xtx.to_owned();
    for i in 0..d {
        a[(i, i)] += lambda;
    }
    let llt = a
        .llt(Side::Lower)
        .map_err(|_| FitError::NotPositiveDefinite { alpha })?;
    let w = llt.solve(xty);
    for column in 0..w.ncols() {
        if let Some(row) = (0..w.nrows()).find(|&i| !w[(i, column)].is_finite()) {
            return Err(FitError::NonFinite {
                alpha,
                row,
                column,
                value: w[(row, column)],
            });
        }
    }
    Ok((w, lambda))
}

/// Held-out R² of K and V per upper layer, from the held-out moments alone.
pub fn quality(heldout: &Moments, w: &Mat<f64>, split: usize, kv_dim: usize) -> Vec<LayerQuality> {
    let (g, b) = moments_view(heldout);
    let n = heldout.rows as f64;
    let gw = g * w;
    let upper = w.ncols() / (2 * kv_dim);
    let mut out = Vec::with_capacity(upper);
    let r2 = |c0: usize| -> f64 {
        let (mut sse, mut sst) = (0.0, 0.0);
        for c in c0..c0 + kv_dim {
            // ‖y − Xw‖² = yᵀy − 2 wᵀXᵀy + wᵀXᵀXw
            let mut wb = 0.0;
            let mut wgw = 0.0;
            for r in 0..w.nrows() {
                wb += w[(r, c)] * b[(r, c)];
                wgw += w[(r, c)] * gw[(r, c)];
            }
            sse += heldout.y_sq[c] - 2.0 * wb + wgw;
            sst += heldout.y_sq[c] - heldout.y_sum[c] * heldout.y_sum[c] / n;
        }
        // Constant targets have no variance to explain: report 0 rather than NaN.
        if sst > 0.0 { 1.0 - sse / sst } else { 0.0 }
    };
    for i in 0..upper {
        out.push(LayerQuality {
            layer: split + i,
            r2_k: r2(2 * i * kv_dim),
            r2_v: r2((2 * i + 1) * kv_dim),
        });
    }
    out
}

/// Per-layer K and V maps (`[features, kv_dim]` row-major) cut out of W.
pub fn split_maps(w: &Mat<f64>, kv_dim: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let upper = w.ncols() / (2 * kv_dim);
    let cut = |c0: usize| -> Vec<f32> {
        let mut out = Vec::with_capacity(w.nrows() * kv_dim);
        for r in 0..w.nrows() {
            for c in c0..c0 + kv_dim {
                out.push(w[(r, c)] as f32);
            }
        }
        out
    };
    (
        (0..upper).map(|i| cut(2 * i * kv_dim)).collect(),
        (0..upper).map(|i| cut((2 * i + 1) * kv_dim)).collect(),
    )
}

/// Device maps from W.
pub fn device_maps(model: &Decoder, w: &Mat<f64>, split: usize) -> Result<FillMaps> {
    let (k, v) = split_maps(w, model.config.kv_dim());
    Ok(FillMaps::from_host(
        split,
        model.config.hidden_size,
        model.config.kv_dim(),
        &k,
        &v,
        model.dtype,
        &model.device,
    )?)
}

/// Device maps from W as `opts`' method applies them (with the per-prompt update from the
/// statistics' precision at `lambda` for `spans-adapt`).
pub fn method_maps(
    model: &Decoder,
    fit: &Moments,
    w: &Mat<f64>,
    lambda: f64,
    split: usize,
    opts: &FitOptions,
) -> Result<FillMaps> {
    let maps = device_maps(model, w, split)?;
    if opts.method != FillMethod::SpansAdapt {
        return Ok(maps);
    }
    let p = host_square(&precision(fit, lambda)?);
    Ok(maps.with_adapt(&p, opts.adapt_weight, model.dtype, &model.device)?)
}

/// Full-prefill reference log-probabilities of each held-out window's continuation.
pub struct HeldoutReference {
    windows: Vec<(Vec<u32>, Vec<u32>, Tensor<2>)>,
}

impl HeldoutReference {
    pub fn new(model: &Decoder, windows: &[Vec<u32>], rows: FillRows) -> Result<Self> {
        Self::new_until(model, windows, rows, &|| false)
    }

    /// [`HeldoutReference::new`], polling `stop` between windows ([`FitError::Stopped`]).
    pub fn new_until(
        model: &Decoder,
        windows: &[Vec<u32>],
        rows: FillRows,
        stop: &dyn Fn() -> bool,
    ) -> Result<Self> {
        let mut out = Vec::new();
        for w in windows {
            if stop() {
                return Err(FitError::Stopped);
            }
            let cont = HELDOUT_CONT.min(w.len() / 4);
            // The prefix must keep some bulk rows, or there is nothing to fill.
            if cont == 0 || w.len() - cont <= rows.sink + rows.tail {
                continue;
            }
            let (prefix, cont) = w.split_at(w.len() - cont);
            let reference = eval::continuation_logp(model, prefix, cont, Method::Full)?;
            out.push((prefix.to_vec(), cont.to_vec(), reference));
        }
        Ok(Self { windows: out })
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Lengths of the held-out prefixes (what each method prefills).
    pub fn prefix_lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.windows.iter().map(|(prefix, _, _)| prefix.len())
    }

    /// Mean per-token KL(full ‖ fill) over the held-out continuations.
    pub fn kl(&self, model: &Decoder, maps: &FillMaps, rows: FillRows) -> Result<f64> {
        self.kl_until(model, maps, rows, &|| false)
    }

    /// [`HeldoutReference::kl`], polling `stop` between windows ([`FitError::Stopped`]).
    pub fn kl_until(
        &self,
        model: &Decoder,
        maps: &FillMaps,
        rows: FillRows,
        stop: &dyn Fn() -> bool,
    ) -> Result<f64> {
        Ok(self.measure_until(model, maps, rows, stop)?.mean_kl())
    }

    /// KL(full ‖ fill) and top-1 agreement summed over the held-out continuations, polling
    /// `stop` between windows ([`FitError::Stopped`]).
    pub fn measure_until(
        &self,
        model: &Decoder,
        maps: &FillMaps,
        rows: FillRows,
        stop: &dyn Fn() -> bool,
    ) -> Result<HeldoutFidelity> {
        let mut total = WindowStats::default();
        for (prefix, cont, reference) in &self.windows {
            if stop() {
                return Err(FitError::Stopped);
            }
            let logp = eval::continuation_logp(model, prefix, cont, Method::Fill(maps, rows))?;
            total.add(&eval::compare_logp(model, logp, reference.clone(), cont));
        }
        Ok(HeldoutFidelity(total))
    }
}

/// Held-out fidelity of a fill against full prefill, summed over the continuation tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HeldoutFidelity(pub WindowStats);

impl HeldoutFidelity {
    /// Mean per-token KL(full ‖ fill), nats.
    pub fn mean_kl(&self) -> f64 {
        self.0.kl / self.0.tokens.max(1) as f64
    }

    /// Share of continuation tokens whose most likely next token agrees with full prefill.
    pub fn top1(&self) -> f64 {
        self.0.top1 as f64 / self.0.tokens.max(1) as f64
    }
}

/// Solves (choosing α when asked), measures held-out quality, and assembles the fill file.
pub fn fit_fill(
    model: &Decoder,
    stats: &StatsFile,
    heldout_windows: &[Vec<u32>],
    opts: &FitOptions,
) -> Result<FillFile> {
    fit_fill_until(model, stats, heldout_windows, opts, &|| false)
}

/// [`fit_fill`], polling `stop` between held-out windows and α trials: when it returns true the
/// fit ends with [`FitError::Stopped`].
pub fn fit_fill_until(
    model: &Decoder,
    stats: &StatsFile,
    heldout_windows: &[Vec<u32>],
    opts: &FitOptions,
    stop: &dyn Fn() -> bool,
) -> Result<FillFile> {
    // Fail on too few rows before the (slow) held-out reference pass.
    let needed = min_rows(stats.fit.features());
    if stats.fit.rows < needed {
        return Err(FitError::TooFewTokens {
            rows: stats.fit.rows,
            features: stats.fit.features(),
            needed,
        });
    }
    let reference = HeldoutReference::new_until(model, heldout_windows, opts.rows, stop)?;
    Ok(fit_with_reference(model, stats, &reference, opts, stop)?.0)
}

/// [`fit_fill_until`] against a held-out reference already computed; also returns the held-out
/// fidelity at the chosen α (`None` when the reference is empty).
fn fit_with_reference(
    model: &Decoder,
    stats: &StatsFile,
    reference: &HeldoutReference,
    opts: &FitOptions,
    stop: &dyn Fn() -> bool,
) -> Result<(FillFile, Option<HeldoutFidelity>)> {
    let split = stats.meta.split;
    let kv_dim = model.config.kv_dim();
    let mut grid = Vec::new();
    let (alpha, w, lambda, held) = match &opts.alpha {
        AlphaChoice::Fixed(a) => {
            let (w, lambda) = ridge_solve(&stats.fit, *a)?;
            let held = if reference.is_empty() {
                None
            } else {
                let maps = method_maps(model, &stats.fit, &w, lambda, split, opts)?;
                let held = reference.measure_until(model, &maps, opts.method_rows(), stop)?;
                if !held.mean_kl().is_finite() {
                    return Err(FitError::NonFiniteKl { alpha: *a });
                }
                Some(held)
            };
            (*a, w, lambda, held)
        }
        AlphaChoice::Auto(alphas) => {
            if reference.is_empty() {
                return Err(FitError::Invalid(
                    "--alpha auto needs held-out text to measure KL; give more calibration \
                     text or a fixed --alpha"
                        .into(),
                ));
            }
            let mut best: Option<(f64, Mat<f64>, f64, HeldoutFidelity)> = None;
            let mut last_failure = String::new();
            for &a in alphas {
                let (w, lambda) = match ridge_solve(&stats.fit, a) {
                    Ok(r) => r,
                    // Too weak a penalty for these statistics: a larger α of the grid may do.
                    Err(
                        e @ (FitError::NotPositiveDefinite { .. } | FitError::NonFinite { .. }),
                    ) => {
                        last_failure = e.to_string();
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let maps = method_maps(model, &stats.fit, &w, lambda, split, opts)?;
                let held = reference.measure_until(model, &maps, opts.method_rows(), stop)?;
                let kl = held.mean_kl();
                if !kl.is_finite() {
                    // These maps make the model overflow: never the best choice.
                    last_failure = FitError::NonFiniteKl { alpha: a }.to_string();
                    continue;
                }
                grid.push(AlphaTrial {
                    alpha: a,
                    lambda,
                    kl,
                });
                if best.as_ref().is_none_or(|b| kl < b.3.mean_kl()) {
                    best = Some((a, w, lambda, held));
                }
            }
            let (a, w, lambda, held) = best.ok_or_else(|| FitError::NoUsableAlpha {
                tried: alphas.clone(),
                last: last_failure,
            })?;
            (a, w, lambda, Some(held))
        }
    };
    let quality = if stats.heldout.rows > 0 {
        quality(&stats.heldout, &w, split, kv_dim)
    } else {
        Vec::new()
    };
    let (k, v) = split_maps(&w, kv_dim);
    let precision = match opts.method {
        FillMethod::SpansAdapt => Some(host_square(&precision(&stats.fit, lambda)?)),
        _ => None,
    };
    let meta = FillMeta {
        format_version: FILL_FORMAT_VERSION,
        model: stats.meta.model.clone(),
        split,
        sink: stats.meta.sink,
        feature: stats.meta.feature.clone(),
        alpha,
        lambda,
        calib_tokens: stats.fit.rows,
        calib_sources: stats.meta.sources.clone(),
        heldout_tokens: stats.heldout.rows,
        quality,
        heldout_kl: held.map(|h| h.mean_kl()),
        alpha_grid: grid,
        created_by: opts.created_by.clone(),
        method: opts.method_meta(),
        split_search: Vec::new(),
    };
    Ok((
        FillFile {
            meta,
            k,
            v,
            precision,
        },
        held,
    ))
}

/// The quality a split must keep to be chosen by [`fit_fill_split_search`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitBudget {
    /// Largest acceptable mean held-out KL(full ‖ method), nats per token.
    pub max_kl: f64,
    /// Smallest acceptable held-out top-1 agreement with full prefill, in `0..=1`.
    pub min_top1: f64,
}

impl SplitBudget {
    /// Whether `trial` is within the budget.
    pub fn admits(&self, trial: &SplitTrial) -> bool {
        trial.kl <= self.max_kl && trial.top1 >= self.min_top1
    }
}

/// Candidate splits tried by default for an `layers`-layer model: every `⌈L / 6⌉`-th layer up
/// to `L − 2` (5, 10, 15, 20, 25 for 30 layers), a spread of at most six that keeps the held-out
/// evaluation of every candidate affordable; tiny models get every layer from 1.
pub fn default_split_candidates(layers: usize) -> Vec<usize> {
    let step = layers.div_ceil(6).max(1);
    let last = if layers >= 4 {
        layers - 2
    } else {
        layers.saturating_sub(1)
    };
    (1..).map(|i| i * step).take_while(|&s| s <= last).collect()
}

/// What [`fit_fill_split_search`] reports as it goes.
#[derive(Debug)]
pub enum SplitEvent<'a> {
    /// The `index`-th of `count` candidates (by ascending split) is being solved and measured.
    Start {
        split: usize,
        index: usize,
        count: usize,
    },
    /// A candidate measured.
    Trial(&'a SplitTrial),
    /// A candidate whose maps could not be fitted (at any α tried): left out of the search.
    Failed { split: usize, error: &'a FitError },
}

/// `fit --split auto`: fits every candidate's statistics (one [`StatsFile`] per split, as
/// [`crate::calibrate::calibrate_splits_with`] gives them) with `opts`, measures each on the
/// held-out windows with the file's method (mean KL, top-1 agreement, and the prefill FLOPs
/// against full prefill summed over the held-out prefixes), and returns the fill file of the
/// smallest split within `budget` (the fewest layers run for the bulk), its `split_search`
/// listing every candidate measured.
///
/// Fails with [`FitError::NoSplitWithinBudget`] (carrying every trial) when no candidate is
/// within the budget. `stop` is polled between held-out windows, α trials and candidates.
pub fn fit_fill_split_search(
    model: &Decoder,
    stats: &[StatsFile],
    heldout_windows: &[Vec<u32>],
    opts: &FitOptions,
    budget: SplitBudget,
    stop: &dyn Fn() -> bool,
    report: &mut dyn FnMut(SplitEvent<'_>),
) -> Result<FillFile> {
    if !(budget.max_kl.is_finite() && budget.max_kl >= 0.0) {
        return Err(FitError::Invalid(format!(
            "--max-kl {}: expected a non-negative number",
            budget.max_kl
        )));
    }
    if !(0.0..=1.0).contains(&budget.min_top1) {
        return Err(FitError::Invalid(format!(
            "--min-top1 {}: expected a share between 0 and 1",
            budget.min_top1
        )));
    }
    let mut stats: Vec<&StatsFile> = stats.iter().collect();
    stats.sort_by_key(|s| s.meta.split);
    if stats.is_empty() {
        return Err(FitError::Invalid("--split auto: no candidate split".into()));
    }
    if let Some(p) = stats
        .windows(2)
        .find(|p| p[0].meta.split == p[1].meta.split)
    {
        return Err(FitError::Invalid(format!(
            "--split auto: split {} is given twice",
            p[0].meta.split
        )));
    }
    // Every candidate comes from the same windows: check the rows once, before the (slow)
    // held-out reference pass.
    for s in &stats {
        let needed = min_rows(s.fit.features());
        if s.fit.rows < needed {
            return Err(FitError::TooFewTokens {
                rows: s.fit.rows,
                features: s.fit.features(),
                needed,
            });
        }
    }
    let reference = HeldoutReference::new_until(model, heldout_windows, opts.rows, stop)?;
    if reference.is_empty() {
        return Err(FitError::Invalid(
            "--split auto needs held-out text to measure each candidate; give more calibration \
             text (more documents, or a smaller --max-tokens)"
                .into(),
        ));
    }
    let lens: Vec<usize> = reference.prefix_lens().collect();
    let flops = |skip: Option<Skip>| -> f64 {
        lens.iter()
            .map(|&n| prefill_flops(&model.config, n, skip))
            .sum()
    };
    let full_flops = flops(None);
    let count = stats.len();
    let mut trials = Vec::with_capacity(count);
    let mut chosen = None;
    let mut last_failure = None;
    for (index, s) in stats.into_iter().enumerate() {
        if stop() {
            return Err(FitError::Stopped);
        }
        let split = s.meta.split;
        report(SplitEvent::Start {
            split,
            index,
            count,
        });
        let (file, held) = match fit_with_reference(model, s, &reference, opts, stop) {
            Ok((file, Some(held))) => (file, held),
            Ok((_, None)) => unreachable!("a non-empty reference always measures"),
            // Too weak a penalty or overflowing maps at this split: others may still do.
            Err(
                error @ (FitError::NotPositiveDefinite { .. }
                | FitError::NonFinite { .. }
                | FitError::NonFiniteKl { .. }
                | FitError::NoUsableAlpha { .. }),
            ) => {
                report(SplitEvent::Failed {
                    split,
                    error: &error,
                });
                last_failure = Some(error);
                continue;
            }
            Err(e) => return Err(e),
        };
        let skip = Skip {
            split,
            rows: opts.method_rows(),
            filled: true,
            adapt: opts.method == FillMethod::SpansAdapt,
            fill_unread: false,
        };
        let trial = SplitTrial {
            split,
            kl: held.mean_kl(),
            top1: held.top1(),
            flops_ratio: flops(Some(skip)) / full_flops,
        };
        report(SplitEvent::Trial(&trial));
        if chosen.is_none() && budget.admits(&trial) {
            chosen = Some(file);
        }
        trials.push(trial);
    }
    match chosen {
        Some(mut file) => {
            file.meta.split_search = trials;
            Ok(file)
        }
        None => match last_failure {
            Some(e) if trials.is_empty() => Err(e),
            _ => Err(FitError::NoSplitWithinBudget { budget, trials }),
        },
    }
}

/// The message of [`FitError::NoSplitWithinBudget`]: the budget, the best candidate (lowest
/// KL) and what to change.
pub(crate) fn no_split_message(budget: &SplitBudget, trials: &[SplitTrial]) -> String {
    let mut msg = format!(
        "no candidate split is within the budget (held-out KL <= {} nats/token, top-1 >= {})",
        budget.max_kl, budget.min_top1
    );
    let best = trials
        .iter()
        .min_by(|a, b| a.kl.total_cmp(&b.kl).then(b.top1.total_cmp(&a.top1)));
    let Some(b) = best else {
        return msg;
    };
    msg += &format!(
        ": the best, split {}, has held-out KL {:.5} and top-1 {:.3} at {:.3}x the FLOPs of full \
         prefill",
        b.split, b.kl, b.top1, b.flops_ratio
    );
    let mut asks = Vec::new();
    if b.kl > budget.max_kl {
        asks.push(format!("--max-kl {}", two_digits(b.kl, true)));
    }
    if b.top1 < budget.min_top1 {
        asks.push(format!("--min-top1 {}", two_digits(b.top1, false)));
    }
    if !asks.is_empty() {
        msg += &format!(
            "; give a larger --max-kl{} ({} accepts split {})",
            if b.top1 < budget.min_top1 {
                " or a smaller --min-top1"
            } else {
                ""
            },
            asks.join(" with "),
            b.split
        );
    }
    msg
}

/// `x` (positive) rounded to two significant digits, up or down, as a short decimal.
fn two_digits(x: f64, up: bool) -> String {
    if !(x.is_finite() && x > 0.0) {
        return format!("{x}");
    }
    let e = x.log10().floor() as i32;
    let scale = 10f64.powi(e - 1);
    let r = if up {
        (x / scale).ceil()
    } else {
        (x / scale).floor()
    } * scale;
    format!("{:.*}", (1 - e).max(0) as usize, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `features` × `cols` moments with XᵀX = `scale`·I and XᵀY = `xty`, over `rows` rows.
    fn moments(features: usize, cols: usize, rows: u64, scale: f64, xty: f64) -> Moments {
        let mut m = Moments::zeros(features, cols);
        for i in 0..features {
            m.xtx[i * features + i] = scale;
        }
        m.xty.iter_mut().for_each(|v| *v = xty);
        m.rows = rows;
        m
    }

    #[test]
    fn budget_suggestions_admit_the_best_candidate() {
        assert_eq!(two_digits(0.000213, true), "0.00022");
        assert_eq!(two_digits(1.5, true), "1.5");
        assert_eq!(two_digits(123.0, true), "130");
        assert_eq!(two_digits(0.8971, false), "0.89");
        let trials = [
            SplitTrial {
                split: 5,
                kl: 0.31234,
                top1: 0.7,
                flops_ratio: 0.3,
            },
            SplitTrial {
                split: 10,
                kl: 0.0213,
                top1: 0.87,
                flops_ratio: 0.5,
            },
        ];
        let budget = SplitBudget {
            max_kl: 0.01,
            min_top1: 0.9,
        };
        let msg = no_split_message(&budget, &trials);
        assert!(
            msg.contains("the best, split 10, has held-out KL 0.02130 and top-1 0.870")
                && msg.contains(
                    "give a larger --max-kl or a smaller --min-top1 (--max-kl 0.022 with \
                     --min-top1 0.87 accepts split 10)"
                ),
            "{msg}"
        );
        let msg = no_split_message(
            &SplitBudget {
                max_kl: 0.01,
                min_top1: 0.0,
            },
            &trials,
        );
        assert!(
            msg.ends_with("give a larger --max-kl (--max-kl 0.022 accepts split 10)"),
            "{msg}"
        );
    }

    #[test]
    fn identity_system_solves_to_xty() {
        let m = moments(4, 3, 8, 1.0, 0.5);
        let (w, lambda) = ridge_solve(&m, 0.0).unwrap();
        assert_eq!(lambda, 0.0);
        assert!((0..4).all(|i| (0..3).all(|j| (w[(i, j)] - 0.5).abs() < 1e-12)));
    }

    #[test]
    fn too_few_rows_says_how_many_are_needed() {
        let m = moments(65, 8, 129, 1.0, 0.0);
        let err = ridge_solve(&m, 1e-3).unwrap_err();
        assert!(
            matches!(
                err,
                FitError::TooFewTokens {
                    rows: 129,
                    features: 65,
                    needed: 130
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("need at least 130") && msg.contains("129 rows"),
            "{msg}"
        );
        assert!(ridge_solve(&moments(65, 8, 130, 1.0, 0.0), 1e-3).is_ok());
        assert_eq!(min_rows(577), 1154);
    }

    #[test]
    fn overflowing_solution_is_a_typed_error() {
        // W = XᵀY / 1e-200 = 1e400: beyond f64.
        let m = moments(4, 3, 8, 1e-200, 1e200);
        let err = ridge_solve(&m, 0.0).unwrap_err();
        assert!(
            matches!(
                err,
                FitError::NonFinite {
                    row: 0,
                    column: 0,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("non-finite"), "{err}");
    }

    #[test]
    fn nan_statistics_name_the_column() {
        let mut m = moments(4, 3, 8, 1.0, 0.5);
        m.xty[2 * 3 + 1] = f64::NAN;
        let err = ridge_solve(&m, 1e-3).unwrap_err();
        // The triangular solves may spread the NaN down its column: the first one is named.
        assert!(
            matches!(err, FitError::NonFinite { column: 1, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("column 1 of the solution") && msg.contains("NaN"),
            "{msg}"
        );
    }
}
