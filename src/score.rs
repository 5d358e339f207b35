//! Teacher-forced scoring (`ridgefill score`).

use anyhow::{Result, bail};
use ridgefill_model::llama::Llama;

/// Teacher-forced NLL summary.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ScoreResult {
    pub tokens_scored: usize,
    pub mean_nll: f64,
    pub ppl: f64,
}

/// Scores `ids` in non-overlapping windows of `ctx` (a last partial window of ≥ 2 tokens counts).
pub fn score_ids(model: &Llama, ids: &[u32], ctx: usize) -> Result<ScoreResult> {
    if ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let mut cache = model.new_cache(ctx);
    let mut total = 0.0f64;
    let mut count = 0usize;
    for (w, window) in ids.chunks(ctx).enumerate() {
        if window.len() < 2 {
            continue;
        }
        cache.reset();
        let nll = model.token_nll(window, &mut cache)?;
        if let Some(i) = nll.iter().position(|x| !x.is_finite()) {
            bail!(
                "non-finite log-likelihood in window {w} at token {}: the model's activations overflowed (try --dtype f32)",
                i + 1
            );
        }
        total += nll.iter().map(|&x| x as f64).sum::<f64>();
        count += nll.len();
    }
    if count == 0 {
        bail!("the text has fewer than 2 tokens: nothing to score");
    }
    let mean = total / count as f64;
    Ok(ScoreResult {
        tokens_scored: count,
        mean_nll: mean,
        ppl: mean.exp(),
    })
}
