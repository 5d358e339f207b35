//! Ridge solve `(XᵀX + λ·I′) W = XᵀY` (Cholesky, intercept unpenalised), α selection by held-out
//! KL, held-out R², and the fill file.
use faer::linalg::solvers::Solve;
use faer::{Mat, MatRef, Side};
use ridgefill_io::fill::{FillMethodMeta, LayerQuality};
use ridgefill_io::stats::Moments;
use ridgefill_model::Decoder;
use ridgefill_model::fill::{FillMaps, FillMethod, FillRows};

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
pub(crate) fn host_square(m: &Mat<f64>) -> Vec<f32> {
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
