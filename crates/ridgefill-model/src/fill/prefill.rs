//! The one skip-and-fill driver. [`Prefill::step`] advances a prefill one chunk of rows at a
//! time through the layers below the split (so a server can interleave other sequences' decode
//! steps); the step after the last chunk chooses the spans, runs the exact rows through the
//! upper layers and fills the rest. [`Prefill::run`] loops over the steps.

use std::ops::Range;

use burn::tensor::{Bool, FloatDType, Tensor, TensorData, activation};

use super::exact::exact_pass;
use super::{FillMaps, FillRows, Oracle, check_split, choose_spans};
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
    /// The self-check found the error above `max_error` and the bulk ran exactly after all.
    pub fell_back: bool,
    /// The split whose maps filled (a deeper one when a shallower self-check failed); `None`
    /// when nothing was filled.
    pub split: Option<usize>,
}

/// A skip-and-fill prefill in progress, into a cache that was empty when it started.
pub struct Prefill<'a> {
    model: &'a Decoder,
    opts: FillOptions<'a>,
    /// The prompt's embedded rows.
    h: Tensor<2>,
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
            done: 0,
            tail_in: Vec::new(),
            h_split: Vec::new(),
            spans: Vec::new(),
            ends: opts.maps.map_or_else(Vec::new, |m| m.sentence_ends(tokens)),
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
        let mut p = Self::start(model, tokens, cache, opts)?;
        loop {
            if let Some(logits) = p.step(cache)? {
                return Ok(Filled {
                    logits,
                    spans: p.spans,
                    report: p.report,
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

    /// Runs the next [`PREFILL_CHUNK`] rows through the layers below the split (every layer
    /// when nothing skips); the step after the last chunk runs the upper layers. Returns the
    /// last-position logits once the prompt is done.
    ///
    /// # Shapes
    /// - → `None` until the last step, then `[vocab]`
    pub fn step(&mut self, cache: &mut KvCache) -> Result<Option<Tensor<1>>> {
        let model = self.model;
        let n = self.h.dims()[0];
        let (split, layers) = (self.opts.split, model.num_layers());
        if self.done < n {
            let (r0, r1) = (self.done, (self.done + PREFILL_CHUNK).min(n));
            let h = self.h.clone().narrow(0, r0, r1 - r0);
            self.done = r1;
            match (&self.bulk, self.opts.maps) {
                (None, _) => {
                    let h = model.forward_layers(h, 0..layers, cache, r0)?;
                    if r1 < n {
                        return Ok(None);
                    }
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
        let h_split = Tensor::cat(std::mem::take(&mut self.h_split), 0);
        let h_last = match self.opts.maps {
            Some(maps) => {
                let tail_in = Tensor::cat(std::mem::take(&mut self.tail_in), 0);
                let upper = fill_upper(
                    model,
                    maps,
                    RowPlan {
                        rows: self.opts.rows,
                        ends: &self.ends,
                    },
                    tail_in,
                    h_split,
                    cache,
                    self.opts.oracle,
                )?;
                self.report.error = upper.error;
                self.report.fell_back = upper.split.is_none();
                self.report.split = upper.split;
                if upper.split.is_some() {
                    let spanned: usize = upper.spans.iter().map(|s| s.len()).sum();
                    self.report.filled = bulk.len() - spanned;
                }
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

/// The layer whose attention chooses the spans runs apart, so its input is kept: the last
/// full-attention layer below the split (a sliding one sees only the last `window` rows, so
/// it could never point further back).
pub(crate) fn scoring_layer(model: &Decoder, split: usize) -> usize {
    (0..split)
        .rev()
        .find(|&l| model.layers[l].window.is_none())
        .unwrap_or(split - 1)
}

/// Which rows of this prompt run exactly, and where its sentences end (spans run on to them).
#[derive(Clone, Copy)]
pub(crate) struct RowPlan<'a> {
    pub rows: FillRows,
    /// Per prompt row, whether it ends a sentence (empty: unknown).
    pub ends: &'a [bool],
}

/// What [`fill_upper`] did.
pub(crate) struct Upper {
    /// The last row entering the head, `[1, hidden]`.
    pub h_last: Tensor<2>,
    pub spans: Vec<Range<usize>>,
    /// The self-check of the last split tried.
    pub error: Option<f64>,
    /// The split whose maps filled; `None`: every row ran every layer.
    pub split: Option<usize>,
}

/// Everything of a fill prefill after the layers below the split: the spans the tail rows'
/// attention chooses (from `tail_in`, the tail entering the scoring layer), then the upper
/// layers' exact pass and fill. When the exact rows show the maps' error above
/// `rows.max_error`, the bulk runs exactly up to `maps.deeper`'s split and that fill is tried
/// the same way; with no deeper maps left, the upper layers run with every row exact.
///
/// # Shapes
/// - tail_in: `[n - bulk.end, hidden]`, h_split: `[n, hidden]` → h_last `[1, hidden]`
pub(crate) fn fill_upper(
    model: &Decoder,
    maps: &FillMaps,
    plan: RowPlan<'_>,
    tail_in: Tensor<2>,
    h_split: Tensor<2>,
    cache: &mut KvCache,
    oracle: Option<&Oracle>,
) -> Result<Upper> {
    let RowPlan { rows, ends } = plan;
    let n = h_split.dims()[0];
    let bulk = rows
        .bulk(n)
        .ok_or_else(|| ModelError::Invalid("fill_upper: the prompt has no bulk".into()))?;
    let scored = scoring_layer(model, maps.split);
    let spans = if rows.span_count(n) > 0 {
        let scores = tail_scores(model, scored, tail_in.clone(), cache, bulk.end)?;
        let budget = rows.exact_rows(n);
        choose_spans(
            &scores,
            bulk.clone(),
            budget,
            rows.span,
            ends,
            rows.sentence_reach,
        )
    } else {
        Vec::new()
    };
    let exact: Vec<usize> = (0..bulk.start)
        .chain(spans.iter().cloned().flatten())
        .chain(bulk.end..n)
        .collect();
    let (h_last, error) = exact_pass(
        model,
        maps,
        h_split.clone(),
        &exact,
        bulk.start,
        cache,
        oracle,
    )?;
    if !error.is_some_and(|e| e > rows.max_error) {
        return Ok(Upper {
            h_last,
            spans,
            error,
            split: Some(maps.split),
        });
    }
    // The exact rows' pass is all this prompt wasted; the layers below the split stand.
    let layers = model.num_layers();
    (maps.split..layers).for_each(|l| cache.clear_layer(l));
    let Some(deeper) = maps.deeper.as_deref() else {
        let h = run_exact(model, h_split, maps.split..layers, cache)?;
        return Ok(Upper {
            h_last: h.narrow(0, n - 1, 1),
            spans: Vec::new(),
            error,
            split: None,
        });
    };
    // Every row runs exactly up to the deeper split; its scoring layer's tail input is kept
    // on the way (or is the one already at hand when that layer lies below this split).
    let deep_scored = scoring_layer(model, deeper.split);
    let (tail_in, h) = if deep_scored >= maps.split {
        let h = run_exact(model, h_split, maps.split..deep_scored, cache)?;
        (h.clone().narrow(0, bulk.end, n - bulk.end), h)
    } else {
        (tail_in, h_split)
    };
    let from = deep_scored.max(maps.split);
    let h_deeper = run_exact(model, h, from..deeper.split, cache)?;
    fill_upper(model, deeper, plan, tail_in, h_deeper, cache, oracle)
}

/// Every row of `h` (entering `layers.start`, positions `0..`) through `layers` exactly, chunk
/// by chunk as full prefill runs them, so the result is full prefill's to the last bit.
///
/// # Shapes
/// - h: `[n, hidden]` → `[n, hidden]`
fn run_exact(
    model: &Decoder,
    h: Tensor<2>,
    layers: Range<usize>,
    cache: &mut KvCache,
) -> Result<Tensor<2>> {
    if layers.is_empty() {
        return Ok(h);
    }
    let n = h.dims()[0];
    let mut out = Vec::with_capacity(n.div_ceil(PREFILL_CHUNK));
    for r0 in (0..n).step_by(PREFILL_CHUNK) {
        let m = PREFILL_CHUNK.min(n - r0);
        let rows = h.clone().narrow(0, r0, m);
        out.push(model.forward_layers(rows, layers.clone(), cache, r0)?);
    }
    Ok(Tensor::cat(out, 0))
}

/// Attention the `tail` rows (at positions `tail0..`) give every cached position of layer
/// `l`, summed over heads and tail rows: the query's own choice of the rows that matter.
///
/// # Shapes
/// - tail: `[t, hidden]` entering layer `l` → `[tail0 + t]` on the host
pub fn tail_scores(
    model: &Decoder,
    l: usize,
    tail: Tensor<2>,
    cache: &KvCache,
    tail0: usize,
) -> Result<Vec<f32>> {
    let cfg = &model.config;
    let (heads, kvh, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim(),
    );
    let t = tail.dims()[0];
    let q = model.qkv(l, tail).narrow(1, 0, heads * hd);
    let q = model.rope_of(l).apply(model.split_heads(q, heads), tail0);
    let (k, _) = cache.read(l);
    let keys = k.dims()[2];
    let group = heads / kvh;
    let k = k
        .unsqueeze_dim::<5>(2)
        .expand([1, kvh, group, keys, hd])
        .reshape([1, heads, keys, hd]);
    let logits = q
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(cfg.attention_scale())
        .cast(FloatDType::F32);
    let logits = match cfg.attn_logit_softcapping {
        Some(cap) => crate::decoder::attention::softcap(logits, cap),
        None => logits,
    };
    // Tail row i sits at tail0 + i and sees keys 0..=tail0 + i (the last `window` of them
    // on a sliding-window layer).
    let window = model.layers[l].window.unwrap_or(usize::MAX);
    let bits: Vec<bool> = (0..t)
        .flat_map(|i| {
            let lo = (tail0 + i + 1).saturating_sub(window);
            (0..keys).map(move |j| j > tail0 + i || j < lo)
        })
        .collect();
    let mask = Tensor::<4, Bool>::from_data(TensorData::new(bits, [1, 1, t, keys]), &model.device)
        .expand([1, heads, t, keys]);
    let p = activation::softmax(logits.mask_fill(mask, f32::NEG_INFINITY), 3);
    let s = crate::to_host_f32(p.sum_dim(1).sum_dim(2).reshape([keys]));
    if let Some(i) = s.iter().position(|x| !x.is_finite()) {
        return Err(ModelError::Invalid(format!(
            "non-finite attention score at position {i} in layer {l}"
        )));
    }
    Ok(s)
}
