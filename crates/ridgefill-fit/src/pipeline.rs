//! One fill file from one split's statistics: the solve (α chosen on held-out KL when asked), the
//! held-out quality, and the file's metadata.

use faer::Mat;
use ridgefill_io::fill::{AlphaTrial, FILL_FORMAT_VERSION, FillFile, FillMeta};
use ridgefill_io::stats::StatsFile;
use ridgefill_model::Decoder;
use ridgefill_model::fill::FillMethod;

use crate::heldout::{HeldoutFidelity, HeldoutReference};
use crate::solve::{
    AlphaChoice, FitOptions, host_square, method_maps, min_rows, precision, quality, ridge_solve,
    split_maps,
};
use crate::{FitError, Result};

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
pub(crate) fn fit_with_reference(
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
