//! The fill's diagnosis: filled K/V replaced by the full model's before the exact rows read them.

use std::ops::Range;

use burn::tensor::Tensor;

use crate::cache::KvCache;
use crate::error::{ModelError, Result};

/// Filled K/V that a diagnosis run replaces with the full model's (exact ones stay computed).
pub struct Oracle<'a> {
    /// The cache of a full prefill of the same prompt.
    pub truth: &'a KvCache,
    /// Upper layers restored.
    pub layers: Range<usize>,
    pub keys: bool,
    pub values: bool,
    /// Positions restored.
    pub rows: Vec<Range<usize>>,
}

impl Oracle<'_> {
    /// Overwrites layer `l`'s filled slots at `rows` with the truth, when `l` is restored.
    pub(crate) fn restore(&self, l: usize, cache: &mut KvCache) -> Result<()> {
        if !self.layers.contains(&l) {
            return Ok(());
        }
        let (tk, tv) = self.truth.read(l);
        let (fk, fv) = cache.read(l);
        for r in &self.rows {
            if r.end > tk.dims()[2] || r.end > fk.dims()[2] {
                return Err(ModelError::Invalid(format!(
                    "oracle rows {r:?} beyond the cache in layer {l}"
                )));
            }
            let pick = |t: &Tensor<4>, f: &Tensor<4>, truth: bool| {
                let src = if truth { t } else { f };
                src.clone().narrow(2, r.start, r.len())
            };
            cache.overwrite(
                l,
                r.start,
                pick(&tk, &fk, self.keys),
                pick(&tv, &fv, self.values),
            );
        }
        Ok(())
    }
}
