//! Decoding over a filled cache, restoring rows as the answer reads them. A prefill's spans are
//! chosen by the question's attention, but an answer goes on to read rows the question did not
//! point at (the sentence holding the name it is about to copy, the clause it paraphrases).
//! Every [`FillRows::decode_every`] generated tokens, those tokens run again as a prefill resumed
//! over the cache ([`Prefill::resume`]): their attention in the scoring layer ranks the rows
//! still filled, and the top [`FillRows::decode_spans`] spans run the upper layers exactly from
//! their stored split input, for good. The time to first token does not change; each restore
//! costs its tokens' rows once more plus the spans' rows over the upper layers.
//!
//! Measured on the answers suite (24 questions over 2.2–3.0k-token documents, SmolLM2 split 15,
//! 40 greedy tokens, 2 threads): 3 spans every 8 tokens took ROUGE-L against full prefill's
//! answers from 0.582 to 0.640 (paired +0.058 ± 0.050; 9 answers closer, 1 further), restoring
//! ~140 rows an answer, at 18.5 ms a generated token against full prefill's decode's 13.5
//! (docs/fidelity.md, run A17; the settings scanned beside it, D3).

use burn::tensor::Tensor;

use super::{FillHistory, FillOptions, FillRows, Filled, Prefill};
use crate::cache::KvCache;
use crate::decoder::Decoder;
use crate::error::Result;

/// A greedy or sampled decode after a skip-and-fill prefill, restoring spans as it goes.
pub struct RestoringDecode<'a> {
    model: &'a Decoder,
    opts: FillOptions<'a>,
    /// The filled rows and their split input (`None`: nothing left to restore).
    history: Option<FillHistory>,
    /// Prompt and generated tokens so far.
    tokens: Vec<u32>,
    /// Tokens generated since the prefill or the last restore.
    since: usize,
    restored: usize,
    restores: usize,
}

impl<'a> RestoringDecode<'a> {
    /// A decode continuing the prefill of `prompt` by `opts`, whose cache `history` records.
    pub fn new(
        model: &'a Decoder,
        opts: FillOptions<'a>,
        prompt: &[u32],
        history: Option<FillHistory>,
    ) -> Self {
        Self {
            model,
            opts,
            history,
            tokens: prompt.to_vec(),
            since: 0,
            restored: 0,
            restores: 0,
        }
    }

    /// Feeds the generated `token` into the cache and returns the next position's logits: a
    /// decode step, or every [`FillRows::decode_every`] tokens a resumed prefill of the tokens
    /// generated since the last one, which restores spans (the same logits a decode step gives
    /// over the restored cache).
    ///
    /// # Shapes
    /// - → logits `[vocab]`
    pub fn step(&mut self, token: u32, cache: &mut KvCache) -> Result<Tensor<1>> {
        self.tokens.push(token);
        self.since += 1;
        let due = self.opts.maps.is_some()
            && restore_due(&self.opts.rows, self.history.as_ref(), self.since);
        let Some(before) = self.history.take_if(|_| due) else {
            return self.model.decode_step(token, cache);
        };
        let f = restore(
            self.model,
            self.opts,
            &self.tokens,
            self.since,
            cache,
            before,
        )?;
        self.since = 0;
        self.restores += 1;
        self.restored += f.report.restored;
        self.history = f.history;
        Ok(f.logits)
    }

    /// Rows restored so far, and in how many resumed prefills.
    pub fn restored(&self) -> (usize, usize) {
        (self.restored, self.restores)
    }

    /// The cache's history once done: what a later prefill over it resumes from.
    pub fn into_history(self) -> Option<FillHistory> {
        self.history
    }
}

/// Whether a decode over a cache that `history` records restores now, `since` generated tokens
/// after its prefill or last restore: every [`FillRows::decode_every`] tokens while filled rows
/// are left.
pub fn restore_due(rows: &FillRows, history: Option<&FillHistory>, since: usize) -> bool {
    rows.decode_every > 0
        && rows.decode_spans > 0
        && since >= rows.decode_every
        && history.is_some_and(|h| h.filled(h.recorded()) > 0)
}

/// A restore: `cache` holds every token of `tokens` but the last, as `before` records them; its
/// last `since - 1` rows run again with the last token as a prefill resumed over the rows before
/// them, whose scoring-layer attention restores [`FillRows::decode_spans`] spans. Returns that
/// prefill (the next position's logits, the rows restored, the cache's history after it).
///
/// # Shapes
/// - tokens: `[n]`, the cache `n - 1` positions → logits `[vocab]`, the cache `n`
pub fn restore(
    model: &Decoder,
    opts: FillOptions<'_>,
    tokens: &[u32],
    since: usize,
    cache: &mut KvCache,
    before: FillHistory,
) -> Result<Filled> {
    cache.truncate(tokens.len() - since.clamp(1, tokens.len()));
    let rows = FillRows {
        resume_spans: opts.rows.decode_spans,
        ..opts.rows
    };
    let opts = FillOptions { rows, ..opts };
    Prefill::resume(model, tokens, cache, before, opts)?.finish(cache)
}
