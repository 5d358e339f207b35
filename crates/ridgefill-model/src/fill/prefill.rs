//! The one skip-and-fill driver. [`Prefill::step`] advances a prefill one chunk of rows at a
//! time through the layers below the split (so a server can interleave other sequences' decode
//! steps); the step after the last chunk chooses the spans, runs the exact rows through the
//! upper layers and fills the rest. [`Prefill::run`] loops over the steps.

use std::ops::Range;

use burn::tensor::Tensor;

use super::upper::{RowPlan, fill_upper, scoring_layer};
use super::{FillHistory, FillMaps, FillRows, Oracle, check_split};
use crate::cache::KvCache;
use crate::decoder::{Decoder, PREFILL_CHUNK};
use crate::error::{ModelError, Result};

/// What a skip-and-fill prefill fills with, and which rows run every layer exactly.
#[derive(Clone, Copy)]
pub struct FillOptions<'a> {
    /// First skipped layer.
    pub split: usize,
    /// Maps that predict the bulk rows' upper-layer K/V; `None` leaves the bulk out of the upper
    /// layers altogether (the `drop` baseline: their cache holds sink and tail only).
    pub maps: Option<&'a FillMaps>,
    pub rows: FillRows,
    /// Diagnosis: some filled K/V replaced by the full model's before the exact rows read them.
    pub oracle: Option<&'a Oracle<'a>>,
}

impl<'a> FillOptions<'a> {
    /// Fill the bulk with `maps` (at their split), `rows` exact.
    pub fn fill(maps: &'a FillMaps, rows: FillRows) -> Self {
        Self {
            split: maps.split,
            maps: Some(maps),
            rows,
            oracle: None,
        }
    }

    /// The `drop` baseline: the bulk skips layers `split..L` and nothing takes its place.
    pub fn drop(split: usize, rows: FillRows) -> Self {
        Self {
            split,
            maps: None,
            rows,
            oracle: None,
        }
    }

    /// The same, with `oracle`'s K/V restored.
    pub fn with_oracle(self, oracle: &'a Oracle<'a>) -> Self {
        Self {
            oracle: Some(oracle),
            ..self
        }
    }
}

/// A finished prefill.
pub struct Filled {
    /// Last-position logits, `[vocab]`.
    pub logits: Tensor<1>,
    /// The bulk spans that ran exactly (chosen by the tail's attention).
    pub spans: Vec<Range<usize>>,
    pub report: FillReport,
    /// What a later [`Prefill::resume`] over this cache starts from ([`Prefill::history`]).
    pub history: Option<FillHistory>,
}

/// What a prefill did with one prompt: how much it filled, and its self-check. Servers and
/// `generate` report it per request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FillReport {
    /// Prompt rows.
    pub prompt: usize,
    /// Rows of the exact tail (grown to the final question where the maps know line breaks).
    pub tail: usize,
    /// Rows whose upper-layer K/V were predicted (0: every row ran every layer).
    pub filled: usize,
    /// The maps' relative error on this prompt's exact rows, averaged over the upper layers.
    pub error: Option<f64>,
    /// The same over the exact spans alone (`None` when they are fewer than
    /// [`super::SELF_CHECK_MIN_ROWS`] rows).
    pub error_spans: Option<f64>,
    /// The share of the tail's attention to the filled bulk that the exact spans take (see
    /// `span_coverage`): how much of what the question reads is exact.
    pub coverage: Option<f64>,
    /// The share of the tail's attention in the scoring layer that falls on rows still filled
    /// before this prefill (`None` when not scored): how much the question reads predicted K/V;
    /// a follow-up restores spans only above [`FillRows::resume_min_attention`].
    pub filled_attention: Option<f64>,
    /// The self-check found the error above `max_error` and the bulk ran exactly after all.
    pub fell_back: bool,
    /// The self-check failed and the prompt was filled again with more of its rows exact
    /// ([`FillRows::retry_exact`](super::FillRows::retry_exact)); `error` is the failed reading.
    pub widened: bool,
    /// The split whose maps filled (a deeper one when a shallower self-check failed); `None`
    /// when nothing was filled.
    pub split: Option<usize>,
    /// Prompt rows taken from the cache ([`Prefill::resume`]; 0 for a fresh prefill).
    pub reused: usize,
    /// Of those, rows an earlier prefill had filled that this one's spans ran exactly.
    pub restored: usize,
}

/// A skip-and-fill prefill in progress, into a cache that was empty when it started
/// ([`Prefill::start`]) or holds a prefix of the prompt ([`Prefill::resume`]).
pub struct Prefill<'a> {
    model: &'a Decoder,
    opts: FillOptions<'a>,
    /// The embedded rows of the prompt's positions `from..`.
    h: Tensor<2>,
    /// Positions the cache held when the prefill started.
    from: usize,
    /// The cache's rows `0..from`: which are exact, and what re-running the filled ones needs.
    before: Option<FillHistory>,
    /// The cache's rows once done (`None` for the `drop` baseline).
    history: Option<FillHistory>,
    /// Rows neither sink nor tail; `None` when every row runs every layer.
    bulk: Option<Range<usize>>,
    /// Rows that have run the layers below the split.
    done: usize,
    /// The tail rows entering the scoring layer, per chunk.
    tail_in: Vec<Tensor<2>>,
    /// Every row entering the split, per chunk.
    h_split: Vec<Tensor<2>>,
    spans: Vec<Range<usize>>,
    /// Per row, whether it ends a sentence (empty: unknown).
    ends: Vec<bool>,
    report: FillReport,
}

impl<'a> Prefill<'a> {
    /// Starts a prefill of `tokens` into `cache`, which must be empty.
    pub fn start(
        model: &'a Decoder,
        tokens: &[u32],
        cache: &KvCache,
        opts: FillOptions<'a>,
    ) -> Result<Self> {
        if !cache.is_empty() {
            return Err(ModelError::Invalid(
                "skip-and-fill prefill needs an empty cache".into(),
            ));
        }
        check_split(model, opts.split)?;
        let rows = match opts.maps {
            Some(maps) => opts.rows.for_prompt(tokens, &maps.breaks),
            None => opts.rows,
        };
        let opts = FillOptions { rows, ..opts };
        let bulk = rows.bulk(tokens.len());
        Ok(Self {
            model,
            opts,
            h: model.embed(tokens)?,
            report: FillReport {
                prompt: tokens.len(),
                tail: if bulk.is_some() {
                    rows.tail
                } else {
                    tokens.len()
                },
                ..FillReport::default()
            },
            bulk,
            from: 0,
            before: None,
            history: None,
            done: 0,
            tail_in: Vec::new(),
            h_split: Vec::new(),
            spans: Vec::new(),
            ends: opts.maps.map_or_else(Vec::new, |m| m.sentence_ends(tokens)),
        })
    }

    /// Starts a prefill of `tokens` into `cache`: afresh when the cache is empty
    /// ([`Prefill::start`]), else over the prefix it holds ([`Prefill::resume`]), whose rows
    /// `history` records (`None`: every cached row is exact).
    pub fn over(
        model: &'a Decoder,
        tokens: &[u32],
        cache: &KvCache,
        history: Option<FillHistory>,
        opts: FillOptions<'a>,
    ) -> Result<Self> {
        if cache.is_empty() {
            return Self::start(model, tokens, cache, opts);
        }
        let history = history.unwrap_or_else(|| FillHistory::exact(opts.split, cache.len()));
        Self::resume(model, tokens, cache, history, opts)
    }

    /// Continues a prefill of `tokens` into `cache`, which holds their first `cache.len()`
    /// positions as `before` records them (an earlier prefill's [`Prefill::history`], truncated
    /// to the shared prefix, with decoded rows exact). The new rows run the layers below the
    /// split; the tail's attention then ranks every filled row of the whole cache, earlier
    /// prompts' included, and the chosen spans among those run the upper layers exactly from
    /// their stored split input, overwriting their predicted K/V for good; the new bulk rows are
    /// filled. A failed self-check runs the new rows exactly (earlier rows stay as they are).
    /// Over a cache with no filled row left, new rows that the span budget would cover anyway
    /// run as full prefill runs them (a follow-up turn after [`settle`](super::settle)).
    pub fn resume(
        model: &'a Decoder,
        tokens: &[u32],
        cache: &KvCache,
        before: FillHistory,
        opts: FillOptions<'a>,
    ) -> Result<Self> {
        let (from, n) = (cache.len(), tokens.len());
        let Some(first) = opts.maps else {
            return Err(ModelError::Invalid(
                "resuming a prefill needs fill maps".into(),
            ));
        };
        // A prompt that went to a deeper split resumes with that split's maps.
        let Some(maps) = first.at_split(before.split) else {
            return Err(ModelError::Invalid(format!(
                "the cache was filled at split {}, these maps fill at split {}",
                before.split, first.split
            )));
        };
        let opts = FillOptions {
            split: maps.split,
            maps: Some(maps),
            ..opts
        };
        if from == 0 || from >= n || before.recorded() > from {
            return Err(ModelError::Invalid(format!(
                "resuming a prefill of {n} tokens over a cache of {from} positions \
                 ({} recorded): need 0 < cached < prompt",
                before.recorded()
            )));
        }
        check_split(model, opts.split)?;
        let rows = opts.rows.for_prompt(tokens, &maps.breaks);
        let opts = FillOptions { rows, ..opts };
        // The tail is new rows only: earlier rows have run their layers already. A short
        // follow-up runs whole, so its spans all go to the earlier rows it asks about.
        let tail0 = if rows.resume_exact(n - from) {
            from
        } else {
            n.saturating_sub(rows.tail).max(from)
        };
        let sink = rows.sink.min(from);
        // Over an exact cache (settled, or never filled), new rows the spans would all run
        // exactly anyway fill nothing: they take full prefill's path, without the fill's passes;
        // so does a short follow-up with no spans to restore (`resume_spans` 0).
        let budget = rows.resume_budget(n - from);
        let spans_cover = tail0 - from <= budget;
        let restores = before.filled(from) > 0 && budget > 0;
        let fillable = restores || (tail0 > from && !spans_cover);
        let bulk = (fillable && sink < tail0).then_some(sink..tail0);
        Ok(Self {
            model,
            opts,
            h: model.embed(&tokens[from..])?,
            report: FillReport {
                prompt: n,
                // Every new row runs every layer when nothing is filled.
                tail: if bulk.is_some() { n - tail0 } else { n - from },
                reused: from,
                ..FillReport::default()
            },
            bulk,
            from,
            before: Some(before),
            history: None,
            done: from,
            tail_in: Vec::new(),
            h_split: Vec::new(),
            spans: Vec::new(),
            ends: maps.sentence_ends(tokens),
        })
    }

    /// A whole prefill: [`Prefill::start`], then [`Prefill::step`] until it is done. With
    /// `sink + tail ≥ n` every row runs every layer and this equals [`Decoder::prefill`].
    ///
    /// # Shapes
    /// - tokens: `[n]` → logits `[vocab]`
    pub fn run(
        model: &'a Decoder,
        tokens: &[u32],
        cache: &mut KvCache,
        opts: FillOptions<'a>,
    ) -> Result<Filled> {
        Self::start(model, tokens, cache, opts)?.finish(cache)
    }

    /// [`Prefill::step`] until the prompt is done.
    ///
    /// # Shapes
    /// - → logits `[vocab]`
    pub fn finish(mut self, cache: &mut KvCache) -> Result<Filled> {
        loop {
            if let Some(logits) = self.step(cache)? {
                return Ok(Filled {
                    logits,
                    spans: self.spans,
                    report: self.report,
                    history: self.history,
                });
            }
        }
    }

    /// Whether any row skips the upper layers (false: the prompt is all sink and tail).
    pub fn skips(&self) -> bool {
        self.bulk.is_some()
    }

    /// The bulk spans that ran exactly (known once the prefill is done).
    pub fn spans(&self) -> &[Range<usize>] {
        &self.spans
    }

    /// What this prefill filled and its self-check (complete once it is done).
    pub fn report(&self) -> FillReport {
        self.report
    }

    /// Which of the cache's rows are exact and what re-running the filled ones needs, once the
    /// prefill is done: what a later [`Prefill::resume`] over this cache starts from (at the
    /// deeper split's input when a deeper split's maps filled). `None` for the `drop` baseline.
    pub fn history(&self) -> Option<&FillHistory> {
        self.history.as_ref()
    }

    /// [`Prefill::history`], taken.
    pub fn take_history(&mut self) -> Option<FillHistory> {
        self.history.take()
    }

    /// Runs the next [`PREFILL_CHUNK`] rows through the layers below the split (every layer
    /// when nothing skips); the step after the last chunk runs the upper layers. Returns the
    /// last-position logits once the prompt is done.
    ///
    /// # Shapes
    /// - → `None` until the last step, then `[vocab]`
    pub fn step(&mut self, cache: &mut KvCache) -> Result<Option<Tensor<1>>> {
        let model = self.model;
        let n = self.from + self.h.dims()[0];
        let (split, layers) = (self.opts.split, model.num_layers());
        if self.done < n {
            let (r0, r1) = (self.done, (self.done + PREFILL_CHUNK).min(n));
            let h = self.h.clone().narrow(0, r0 - self.from, r1 - r0);
            self.done = r1;
            match (&self.bulk, self.opts.maps) {
                (None, _) => {
                    let h = model.forward_layers(h, 0..layers, cache, r0)?;
                    if r1 < n {
                        return Ok(None);
                    }
                    self.history = match (self.before.take(), self.opts.maps) {
                        (Some(before), _) => Some(before),
                        (None, Some(maps)) => Some(FillHistory::exact(maps.split, n)),
                        (None, None) => None,
                    };
                    cache.set_len(n);
                    return Ok(Some(self.logits(h.narrow(0, r1 - r0 - 1, 1))));
                }
                (Some(bulk), Some(_)) => {
                    let scored = scoring_layer(model, split);
                    let h_in = model.forward_layers(h, 0..scored, cache, r0)?;
                    if r1 > bulk.end {
                        let from = bulk.end.max(r0);
                        self.tail_in
                            .push(h_in.clone().narrow(0, from - r0, r1 - from));
                    }
                    let h_split = model.forward_layers(h_in, scored..split, cache, r0)?;
                    self.h_split.push(h_split);
                }
                (Some(_), None) => {
                    let h_split = model.forward_layers(h, 0..split, cache, r0)?;
                    self.h_split.push(h_split);
                }
            }
            return Ok(None);
        }
        let Some(bulk) = self.bulk.clone() else {
            return Err(ModelError::Invalid(
                "prefill step after the prompt was done".into(),
            ));
        };
        let before = self.before.take();
        let done = before
            .as_ref()
            .map_or_else(Vec::new, |b| b.exact_mask(self.from));
        // Earlier rows' stored inputs and the new rows' chunks, joined in one copy.
        let new_rows = std::mem::take(&mut self.h_split);
        let h_split = match &before {
            Some(b) => b.h_split_then(self.from, new_rows),
            None => Tensor::cat(new_rows, 0),
        };
        let h_last = match self.opts.maps {
            Some(maps) => {
                let tail_in = Tensor::cat(std::mem::take(&mut self.tail_in), 0);
                let upper = fill_upper(
                    model,
                    maps,
                    RowPlan {
                        rows: self.opts.rows,
                        ends: &self.ends,
                        bulk: bulk.clone(),
                        from: self.from,
                        done: &done,
                    },
                    tail_in,
                    h_split.clone(),
                    cache,
                    self.opts.oracle,
                )?;
                self.report.error = upper.check.all;
                self.report.error_spans = upper.check.spans;
                self.report.coverage = upper.coverage;
                self.report.filled_attention = upper.filled_attention;
                self.report.fell_back = upper.split.is_none();
                self.report.widened = upper.widened;
                self.report.split = upper.split;
                // Per position, whether its upper-layer K/V are now exact.
                let mut exact: Vec<bool> = (0..n)
                    .map(|i| done.get(i).copied().unwrap_or(!bulk.contains(&i)))
                    .collect();
                self.report.restored = upper
                    .spans
                    .iter()
                    .flat_map(|s| s.clone())
                    .filter(|&i| i < self.from)
                    .count();
                // Earlier rows that ran only some upper layers stay filled above them.
                upper
                    .spans
                    .iter()
                    .flat_map(|s| s.clone())
                    .filter(|&i| upper.restored_whole || i >= self.from)
                    .for_each(|i| exact[i] = true);
                match upper.split {
                    None => exact[self.from..].iter_mut().for_each(|e| *e = true),
                    Some(_) => {
                        self.report.filled = exact[self.from..].iter().filter(|e| !**e).count()
                    }
                }
                // A prompt a deeper split filled keeps that split's input, so its filled rows
                // can be restored (decode, follow-up, settling) like any other's.
                let (split, input) = match (upper.split, upper.deeper_input) {
                    (Some(s), Some(input)) => (s, input),
                    _ => (maps.split, h_split),
                };
                let h = FillHistory::new(split, input, exact);
                self.history = Some(h.continuing(before.as_ref()));
                self.spans = upper.spans;
                upper.h_last
            }
            None => {
                let (sink, tail0) = (bulk.start, bulk.end);
                if sink > 0 {
                    let rows = h_split.clone().narrow(0, 0, sink);
                    model.forward_layers(rows, split..layers, cache, 0)?;
                }
                let rows = h_split.narrow(0, tail0, n - tail0);
                let t = model.forward_layers(rows, split..layers, cache, tail0)?;
                self.report.filled = bulk.len();
                self.report.split = Some(split);
                t.narrow(0, n - tail0 - 1, 1)
            }
        };
        cache.set_len(n);
        Ok(Some(self.logits(h_last)))
    }

    /// The head over the last row.
    fn logits(&self, h_last: Tensor<2>) -> Tensor<1> {
        let vocab = self.model.config.vocab_size;
        self.model.head(h_last).reshape([vocab])
    }
}
