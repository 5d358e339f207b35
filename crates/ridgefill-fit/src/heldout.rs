//! Held-out text the fit measures itself on: full prefill's reference log-probabilities, and the
//! fill's KL and top-1 agreement against them.

use ridgefill_model::eval::{self, Method, WindowStats};
use ridgefill_model::fill::{FillMaps, FillRows};
use ridgefill_model::{Decoder, Tensor};

use crate::solve::HELDOUT_CONT;
use crate::{FitError, Result};

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
