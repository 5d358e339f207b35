//! `--split auto`: every candidate split fitted from one calibration pass, measured on held-out
//! text, and the smallest within the quality budget chosen.

use ridgefill_io::fill::{FillFile, SplitTrial};
use ridgefill_io::stats::StatsFile;
use ridgefill_model::Decoder;
use ridgefill_model::eval::{Skip, prefill_flops};
use ridgefill_model::fill::FillMethod;

use crate::heldout::HeldoutReference;
use crate::pipeline::fit_with_reference;
use crate::solve::{FitOptions, min_rows};
use crate::{FitError, Result};

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
}
