//! Teacher-forced scoring (`ridgefill score`).

use ridgefill_model::Decoder;
use ridgefill_model::ModelError;

/// Teacher-forced NLL summary.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ScoreResult {
    pub tokens_scored: usize,
    pub mean_nll: f64,
    pub ppl: f64,
}

/// Why a text could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    #[error("--ctx {0}: expected at least 2 (a window scores every token after its first)")]
    CtxTooSmall(usize),
    #[error("the text has {tokens} token(s): at least 2 are needed to score anything")]
    TooShort { tokens: usize },
    /// The model's log-likelihood of a token is NaN or infinite.
    #[error(
        "non-finite log-likelihood ({value}) at token position {position} (window {window}, \
         offset {offset}): the model's activations overflowed{hint}"
    )]
    NonFinite {
        /// Index of the scored token in the text's token sequence.
        position: usize,
        window: usize,
        /// Index inside the window.
        offset: usize,
        value: f32,
        hint: &'static str,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Scores `ids` in non-overlapping windows of `ctx` (a last partial window of ≥ 2 tokens counts).
/// Stops with [`crate::interrupt::Interrupted`] between windows once Ctrl-C was pressed.
pub fn score_ids(model: &Decoder, ids: &[u32], ctx: usize) -> anyhow::Result<ScoreResult> {
    if ctx < 2 {
        return Err(ScoreError::CtxTooSmall(ctx).into());
    }
    let mut cache = model.new_cache(ctx);
    let mut total = 0.0f64;
    let mut count = 0usize;
    for (w, window) in ids.chunks(ctx).enumerate() {
        crate::interrupt::check()?;
        if window.len() < 2 {
            continue;
        }
        cache.reset();
        let nll = model
            .token_nll(window, &mut cache)
            .map_err(ScoreError::from)?;
        if let Some(i) = nll.iter().position(|x| !x.is_finite()) {
            let half = model.dtype != ridgefill_model::FloatDType::F32;
            return Err(ScoreError::NonFinite {
                position: w * ctx + i + 1,
                window: w,
                offset: i + 1,
                value: nll[i],
                hint: if half { " (try --dtype f32)" } else { "" },
            }
            .into());
        }
        total += nll.iter().map(|&x| x as f64).sum::<f64>();
        count += nll.len();
    }
    if count == 0 {
        return Err(ScoreError::TooShort { tokens: ids.len() }.into());
    }
    let mean = total / count as f64;
    Ok(ScoreResult {
        tokens_scored: count,
        mean_nll: mean,
        ppl: mean.exp(),
    })
}
