//! How far a method's score sits from full prefill's, with the sampling noise beside it: the
//! paired difference of per-sample scores (the same prompts answered by both) and a 95%
//! Student-t interval. At 8 samples one RULER answer moves a task by 12.5 points, so a gap
//! means little without its interval.
//!
//! Hand-written: the t quantile is the only statistic needed, and `statrs` (the crate that has
//! it) pulls in `nalgebra`.

/// Two-sided 95% quantiles of Student's t for 1..=30 degrees of freedom.
const T975: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

/// The normal quantile that the t quantiles approach.
const Z975: f64 = 1.959_964;

/// The 97.5% quantile of Student's t with `df` degrees of freedom (`df` ≥ 1): the table, then
/// the Cornish–Fisher expansion in `1/df` (within 0.001 from 30 on).
fn t975(df: usize) -> f64 {
    match df {
        0 => f64::INFINITY,
        d if d <= T975.len() => T975[d - 1],
        d => {
            let (z, n) = (Z975, d as f64);
            z + (z.powi(3) + z) / (4.0 * n)
                + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * n * n)
        }
    }
}

/// A mean difference and the half-width of its 95% interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gap {
    pub mean: f64,
    /// `None` with fewer than two samples.
    pub half: Option<f64>,
}

impl Gap {
    /// The paired gap of `method` over `full`, sample by sample (equal lengths).
    pub fn paired(method: &[f64], full: &[f64]) -> Gap {
        let d: Vec<f64> = method.iter().zip(full).map(|(m, f)| m - f).collect();
        let n = d.len();
        let mean = if n == 0 {
            0.0
        } else {
            d.iter().sum::<f64>() / n as f64
        };
        let half = (n >= 2).then(|| {
            let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            t975(n - 1) * (var / n as f64).sqrt()
        });
        Gap { mean, half }
    }

    /// The mean of `xs` itself, with its interval (a gap over zero).
    pub fn mean_of(xs: &[f64]) -> Gap {
        Gap::paired(xs, &vec![0.0; xs.len()])
    }

    /// The gap of an average of independent gaps (tasks of a suite), each measured on `n`
    /// samples: means averaged, variances added (Welch–Satterthwaite's degrees of freedom).
    pub fn average(parts: &[(Gap, usize)]) -> Gap {
        let k = parts.len().max(1) as f64;
        let mean = parts.iter().map(|(g, _)| g.mean).sum::<f64>() / k;
        // Each part's standard error, squared, from its half-width.
        let se2: Option<Vec<(f64, usize)>> = parts
            .iter()
            .map(|&(g, n)| g.half.map(|h| ((h / t975(n - 1)).powi(2), n)))
            .collect();
        let half = se2.filter(|v| !v.is_empty()).map(|v| {
            let sum: f64 = v.iter().map(|(s, _)| s).sum();
            let denom: f64 = v.iter().map(|&(s, n)| s * s / (n - 1) as f64).sum::<f64>();
            let df = if denom > 0.0 {
                (sum * sum / denom).floor().max(1.0) as usize
            } else {
                v.iter().map(|&(_, n)| n - 1).sum()
            };
            t975(df) * sum.sqrt() / k
        });
        Gap { mean, half }
    }

    /// `+1.2 ± 3.4`, or `+1.2` without an interval.
    pub fn show(&self) -> String {
        match self.half {
            Some(h) => format!("{:+.1} ± {h:.1}", self.mean),
            None => format!("{:+.1}", self.mean),
        }
    }

    /// `0.582 ± 0.091`: a mean (a share, not a gap) and its interval.
    pub fn show_mean(&self) -> String {
        match self.half {
            Some(h) => format!("{:.3} ± {h:.3}", self.mean),
            None => format!("{:.3}", self.mean),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "mean": self.mean, "ci95_half_width": self.half })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn the_t_quantile_joins_its_table() {
        assert_eq!(t975(1), 12.706);
        assert_eq!(t975(30), 2.042);
        // Tabulated: 2.021 at 40, 2.000 at 60, 1.980 at 120.
        assert!(close(t975(40), 2.021, 1e-3), "{}", t975(40));
        assert!(close(t975(60), 2.000, 1e-3), "{}", t975(60));
        assert!(close(t975(120), 1.980, 1e-3), "{}", t975(120));
    }

    #[test]
    fn a_paired_gap_is_the_mean_difference_with_its_t_interval() {
        // Differences 0, 0, -100, 0: mean -25, sd 50, se 25, t(3) 3.182.
        let g = Gap::paired(&[100.0, 0.0, 0.0, 100.0], &[100.0, 0.0, 100.0, 100.0]);
        assert!(close(g.mean, -25.0, 1e-12));
        assert!(close(g.half.unwrap(), 3.182 * 25.0, 1e-9));
        // Identical answers: no gap and no width.
        let same = Gap::paired(&[50.0, 25.0], &[50.0, 25.0]);
        assert_eq!(
            same,
            Gap {
                mean: 0.0,
                half: Some(0.0)
            }
        );
        assert_eq!(Gap::paired(&[1.0], &[0.0]).half, None);
        assert_eq!(Gap::paired(&[1.0], &[0.0]).show(), "+1.0");
        // A mean is a gap over zero: [0.5, 0.75] as 1.0 − 0.5 and 1.25 − 0.5 (exact in binary).
        assert_eq!(
            Gap::mean_of(&[0.5, 0.75]),
            Gap::paired(&[1.0, 1.25], &[0.5, 0.5])
        );
    }

    #[test]
    fn an_average_of_gaps_adds_their_variances() {
        let a = Gap::paired(&[100.0, 0.0, 0.0, 100.0], &[100.0, 0.0, 100.0, 100.0]);
        let b = Gap::paired(&[0.0; 4], &[0.0; 4]);
        let g = Gap::average(&[(a, 4), (b, 4)]);
        assert!(close(g.mean, -12.5, 1e-12));
        // One part carries all the variance: se 25 / 2, with that part's 3 degrees of freedom.
        assert!(close(g.half.unwrap(), 3.182 * 12.5, 1e-9));
        assert_eq!(
            Gap::average(&[(a, 4), (Gap::paired(&[1.0], &[0.0]), 1)]).half,
            None
        );
    }
}
