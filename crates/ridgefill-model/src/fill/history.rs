//! What a cache's filled rows need to become exact later: per position, whether its upper-layer
//! K/V are exact, and for the prompt rows the hidden state entering the split. A later prefill
//! over the same cache ([`Prefill::resume`](super::Prefill::resume)) runs the rows its question
//! points at through the upper layers from that state, overwriting their predicted K/V, so a
//! fact filled in one chat turn is read exactly when a later turn asks for it.
//!
//! Stored per prompt row: `hidden` activations (576 floats for SmolLM2-135M, against its
//! `2 · 30 · 192` floats of K/V: 5%). Rows past the stored ones (decoded tokens) ran every layer.

use burn::tensor::Tensor;

use crate::error::{ModelError, Result};

/// Which rows of a cache hold filled upper-layer K/V, and what re-running them needs.
#[derive(Clone)]
pub struct FillHistory {
    /// First layer whose K/V were filled.
    pub split: usize,
    /// Rows entering `split`, `[stored, hidden]`, for positions `0..stored`; `None`: none kept.
    h_split: Option<Tensor<2>>,
    /// Per position `0..exact.len()`, whether its upper-layer K/V are exact; positions past it
    /// (decoded tokens) are exact.
    exact: Vec<bool>,
    /// The first position ever filled. Rows before it hold full prefill's K/V; rows from it on
    /// ran their upper layers over predictions, even those run exactly since (restored or
    /// settled): close to full prefill's, not equal. `None`: nothing was ever filled.
    first_filled: Option<usize>,
}

impl FillHistory {
    /// A history of `n` positions, `exact` per position, with `h_split` the rows entering the
    /// split (`[n, hidden]`).
    pub fn new(split: usize, h_split: Tensor<2>, exact: Vec<bool>) -> Self {
        debug_assert_eq!(h_split.dims()[0], exact.len());
        Self {
            split,
            h_split: Some(h_split),
            first_filled: exact.iter().position(|e| !e),
            exact,
        }
    }

    /// A history of `n` positions all exact (a prompt too short to fill).
    pub fn exact(split: usize, n: usize) -> Self {
        Self {
            split,
            h_split: None,
            exact: vec![true; n],
            first_filled: None,
        }
    }

    /// This history as the continuation of `before`, the history of the cache it was resumed
    /// over: a row filled then stays the first ever filled, though it may be exact now.
    pub(crate) fn continuing(mut self, before: Option<&FillHistory>) -> Self {
        if let Some(f) = before.and_then(|b| b.first_filled) {
            self.first_filled = Some(self.first_filled.map_or(f, |g| g.min(f)));
        }
        self
    }

    /// Whether the first `len` positions hold exactly full prefill's K/V: none of them was ever
    /// filled, nor ran over a filled row. Only such a prefix may serve a request that asked for
    /// full prefill.
    pub fn pristine_upto(&self, len: usize) -> bool {
        self.first_filled.is_none_or(|f| len <= f)
    }

    /// Whether any row of this cache was ever filled.
    pub fn ever_filled(&self) -> bool {
        self.first_filled.is_some()
    }

    /// Positions whose exactness is recorded (later ones are exact).
    pub fn recorded(&self) -> usize {
        self.exact.len()
    }

    /// Rows among the first `len` whose upper-layer K/V are predictions.
    pub fn filled(&self, len: usize) -> usize {
        self.exact.iter().take(len).filter(|e| !**e).count()
    }

    /// Per position `0..len`, whether its upper-layer K/V are exact.
    pub fn exact_mask(&self, len: usize) -> Vec<bool> {
        (0..len)
            .map(|i| self.exact.get(i).copied().unwrap_or(true))
            .collect()
    }

    /// The first `max` positions among `0..len` whose upper-layer K/V are predictions.
    pub fn filled_positions(&self, len: usize, max: usize) -> Vec<usize> {
        let filled = self
            .exact
            .iter()
            .take(len)
            .enumerate()
            .filter(|(_, e)| !**e);
        filled.map(|(i, _)| i).take(max).collect()
    }

    /// Records the rows at `positions` as exact (their upper layers ran).
    pub(crate) fn mark_exact(&mut self, positions: &[usize]) {
        for &p in positions {
            if let Some(e) = self.exact.get_mut(p) {
                *e = true;
            }
        }
        // With nothing left to re-run, the stored inputs are dead weight.
        if self.filled(self.exact.len()) == 0 {
            self.h_split = None;
        }
    }

    /// The stored rows entering the split at `positions` (each one with a stored row).
    ///
    /// # Shapes
    /// - positions: `[m]` → `[m, hidden]`
    pub(crate) fn h_split_rows(&self, positions: &[usize]) -> Result<Tensor<2>> {
        let stored = self.h_split.as_ref().map_or(0, |h| h.dims()[0]);
        match (&self.h_split, positions.iter().find(|&&p| p >= stored)) {
            (Some(h), None) => Ok(super::select_rows(h.clone(), positions)),
            (_, p) => Err(ModelError::Invalid(format!(
                "the fill history keeps the split input of {stored} rows, not of row {}",
                p.copied().unwrap_or(0)
            ))),
        }
    }

    /// Forgets positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.exact.truncate(len);
        self.first_filled = self.first_filled.filter(|&f| f < len);
        if let Some(h) = self.h_split.take() {
            let rows = h.dims()[0].min(len);
            self.h_split = (rows > 0).then(|| h.narrow(0, 0, rows));
        }
    }

    /// The rows entering the split for positions `0..len`, followed by the chunks `next` (the
    /// rows of positions `len..`), joined in one copy; positions with no stored row (exact ones,
    /// never re-run) are zeros of `next`'s width and dtype.
    ///
    /// # Shapes
    /// - next: `[m_i, hidden]` each → `[len + Σ m_i, hidden]`
    pub(crate) fn h_split_then(&self, len: usize, next: Vec<Tensor<2>>) -> Tensor<2> {
        let stored = self.h_split.as_ref().map_or(0, |h| h.dims()[0].min(len));
        let mut parts = Vec::with_capacity(2 + next.len());
        if let Some(h) = &self.h_split
            && stored > 0
        {
            parts.push(h.clone().narrow(0, 0, stored));
        }
        if len > stored {
            let zero = next[0].clone().narrow(0, 0, 1).zeros_like();
            parts.push(zero.repeat_dim(0, len - stored));
        }
        parts.extend(next);
        Tensor::cat(parts, 0)
    }

    /// Bytes this history holds (its stored rows as f32 and one flag per position).
    pub fn bytes(&self) -> usize {
        let rows = self
            .h_split
            .as_ref()
            .map_or(0, |h| h.dims()[0] * h.dims()[1]);
        rows * std::mem::size_of::<f32>() + self.exact.len()
    }
}
