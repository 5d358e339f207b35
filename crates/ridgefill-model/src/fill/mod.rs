//! Skip-and-fill prefill: the bulk of the prompt runs layers `0..split` only, and the upper
//! layers' K/V for those rows are predicted by linear maps from the hidden state entering `split`.
//!
//! [`Prefill`] is the one driver (stepwise for the server, [`Prefill::run`] for the rest);
//! [`FillOptions`] says what it fills with and which rows run exactly. The maps and the
//! per-prompt update live here, span choice in [`spans`], the upper layers' plan in [`upper`],
//! their exact pass and the cache writes in [`exact`], what a later prefill over the same cache
//! needs in [`history`], making that cache exact in idle time in [`settle`], the diagnosis in
//! [`oracle`].

pub mod decode;
pub mod exact;
pub mod history;
pub mod oracle;
pub mod prefill;
pub mod settle;
pub mod spans;
pub mod upper;

use std::ops::Range;

use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};

use crate::decoder::Decoder;
use crate::error::{ModelError, Result};

pub use decode::RestoringDecode;
pub use history::FillHistory;
pub use oracle::Oracle;
pub use prefill::{FillOptions, FillReport, Filled, Prefill};
pub use settle::settle;
pub use spans::{choose_new_spans, choose_spans, window_reads};

/// All upper layers' fill maps as one matrix, so the bulk fill is a single GEMM. Clones share
/// the tensors.
#[derive(Clone)]
pub struct FillMaps {
    /// First skipped layer.
    pub split: usize,
    /// `[hidden + 1, (layers - split) · 2 · kv_dim]`: per layer, K columns then V columns.
    pub w: Tensor<2>,
    /// The per-prompt update of the maps from the exactly computed rows, when the fill file
    /// carries what it needs.
    pub adapt: Option<Adapt>,
    /// Also fill sliding-window layers' rows that no exact row or decode step can reach (they
    /// are never read): only for measuring what leaving them out saves.
    pub fill_unread: bool,
    /// The tokenizer's ids whose text holds a line break: where a final question starts
    /// ([`FillRows::for_prompt`]). Empty: the tail stays fixed.
    pub breaks: Vec<u32>,
    /// The ids (sorted) whose text ends a sentence or holds a line break: a chosen span runs on
    /// to one ([`choose_spans`]). Empty: spans keep their width.
    pub stops: Vec<u32>,
    /// Maps at a deeper split, tried when this split's self-check fails (before running the
    /// upper layers exactly): the bulk runs exactly up to their split instead.
    pub deeper: Option<Box<FillMaps>>,
}

/// What the per-prompt ridge update needs: the calibration precision and the exact rows' weight.
///
/// With calibration Gram `G = XᵀX + λD` and this prompt's exact rows `(Xe, Ye)` weighted `weight`
/// each, the maps that minimise both losses are `W' = W + P·(I/weight + Xe·P)⁻¹·(Ye − Xe·W)`
/// with `P = G⁻¹·Xeᵀ` (Woodbury): a rank-`k` correction computed layer by layer as the exact
/// rows' true K/V become known.
#[derive(Clone)]
pub struct Adapt {
    /// `G⁻¹`, `[hidden + 1, hidden + 1]`.
    pub precision: Tensor<2>,
    /// Weight of one exact row against one calibration row.
    pub weight: f64,
}

/// Default share of the prompt's rows run exactly in chosen spans (the shipped method's budget).
pub const DEFAULT_EXACT: f64 = 0.08;

/// Default share of rows exact when a prompt that failed the self-check is filled again
/// ([`FillRows::retry_exact`]). Chosen on RULER at 4096 tokens (docs/fidelity.md, runs E1, E2):
/// the coded-word haystack that fails the check keeps full's words with a quarter of its rows
/// exact (25.0 vs full's 20.8) at 1.15× where running every layer took 0.91×.
pub const DEFAULT_RETRY_EXACT: f64 = 0.25;
/// Default weight of one exact row against one calibration row in the per-prompt update.
pub const DEFAULT_ADAPT_WEIGHT: f64 = 100.0;

/// Default self-check threshold, as a multiple of the maps' held-out error (`1 − R²` on the
/// calibration text): prompts the maps fit this much worse than their calibration text run
/// exactly. Chosen on the fidelity suite (docs/fidelity.md): at split 15 (0.656) it sends code
/// (self-check 0.62–0.68) and RULER's all-UUID haystack (0.68–0.87) to full prefill, and keeps
/// prose, READMEs, licences and the other RULER tasks (0.40–0.65) filled.
pub const DEFAULT_ERROR_RATIO: f64 = 2.35;

/// Default threshold of the self-check's second reading, over the spans alone, as a multiple
/// of the maps' held-out error. A haystack the maps miss can pass the first reading when the
/// question, fitted well, pulls the mean down: RULER's fwe at 4096 tokens (coded words) reads
/// 0.64–0.72 over every exact row and 0.72–0.81 over the spans, where niah_single_1's repeated
/// noise sentences, answered right filled, read 0.67–0.68 over the spans (docs/fidelity.md, run
/// D1): at split 15 the threshold is 0.698, between them.
pub const DEFAULT_SPAN_ERROR_RATIO: f64 = 2.5;

/// Span rows the spans' reading of the self-check needs: one span of the default width.
pub const SELF_CHECK_MIN_ROWS: usize = 2 * DEFAULT_SPAN_RADIUS + 1;

/// Default coverage check where a deeper split's maps are at hand: a fresh prompt whose spans
/// take less than half of the question's attention to the filled rows goes deeper. Gemma 3 270M
/// at split 9 (docs/fidelity.md, runs G8, G11): RULER's prompts at 2048 tokens read 0.51–0.98
/// (bar an all-UUID haystack the self-check sends deeper anyway), questions about real documents
/// 0.34–0.54; with split 12 behind it, answers' ROUGE-L against full's rose from 0.375 to 0.667.
pub const DEFAULT_MIN_COVERAGE: f64 = 0.5;

/// How a fill file's maps are applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillMethod {
    /// Every bulk row filled by the fitted maps.
    Ridge,
    /// Plus spans chosen by the tail's attention run exactly through the upper layers.
    Spans,
    /// Plus each upper layer's maps updated per prompt from the exact rows' true K/V.
    SpansAdapt,
}

impl FillMethod {
    /// The method `fit` records by default.
    pub const DEFAULT: FillMethod = FillMethod::SpansAdapt;
    pub const ALL: [FillMethod; 3] = [Self::Ridge, Self::Spans, Self::SpansAdapt];

    pub fn name(self) -> &'static str {
        match self {
            Self::Ridge => "ridge",
            Self::Spans => "spans",
            Self::SpansAdapt => "spans-adapt",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Maps and rows for this method: `maps` as loaded (with its update when the file has one),
    /// `rows` with the span budget to use; ridge drops both.
    pub fn configure(self, maps: &FillMaps, rows: FillRows) -> Result<(FillMaps, FillRows)> {
        match self {
            Self::Ridge => Ok((maps.plain(), FillRows { exact: 0.0, ..rows })),
            Self::Spans => Ok((maps.plain(), rows)),
            Self::SpansAdapt => {
                if maps.adapt.is_none() {
                    return Err(ModelError::Invalid(
                        "method spans-adapt needs a fill file with a precision matrix \
                         (fill.precision, written by `ridgefill fit` since format 2): fit again \
                         or choose --method spans"
                            .into(),
                    ));
                }
                // Deeper splits keep their own update too: a prompt sent there is filled as a
                // fill at that split alone fills it.
                Ok((maps.clone(), rows))
            }
        }
    }
}

impl std::fmt::Display for FillMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Fewest spans chosen: the tail's attention also points at the prompt's own question (asked
/// before a document) and at several facts, and on a short prompt a few spans cost little.
pub const MIN_SPANS: usize = 5;

/// Default of [`FillRows::resume_spans`]: spans a prefill over a cached prefix
/// ([`Prefill::resume`]) restores when its new rows all run exactly (a chat follow-up,
/// [`FillRows::resume_exact`]). The question's attention ranks the earlier turns' filled rows and
/// the sentence it asks about tops them: with one span `eval --task passkey-turns` found every
/// code at 1024–4096 tokens (25 of 25 conversations, key NLL within 0.03 nats of full prefill
/// with reuse), with none it found 1 of 15. Each restored row costs about what a new row's upper
/// layers cost: three spans (the default until 2026-12-06) took a no-pause follow-up in `serve`
/// 272–331 ms against one span's 203–220 ms, and found no more codes.
pub const RESUME_MIN_SPANS: usize = 1;

/// Default of [`FillRows::resume_min_attention`]. A needle question (`eval --task
/// passkey-turns`) gives the earlier turns' filled rows 8.6–12.5% of its attention at 1024–4096
/// tokens (Gemma 3 270M: 14.9–18.2%) and needs its span (1 code of 15 found without); questions
/// about a real document (the answers suite's 8 documents, 64 follow-ups with full prefill's
/// replies as history) give them 0.4–17%, and restoring one span did not move their agreement
/// with full prefill (ROUGE-L 0.749 restoring vs 0.746 not; 0.84 vs 0.81 below 5%, within the
/// ±0.07 two identical paths read). Below 5% a follow-up skips the restore's ~17 rows × upper
/// layers (~40 ms on 2 cores).
pub const RESUME_MIN_ATTENTION: f64 = 0.05;

/// Default of [`FillRows::decode_every`]. On the answers suite (paired ROUGE-L gain over no
/// restores, 24 questions, ± 0.04–0.05 each): every 8 tokens +0.035 to +0.063 with 1, 3 or 5
/// spans, every 4 or 6 +0.022 to +0.029, every 16 −0.003 — see [`decode`].
pub const DEFAULT_DECODE_EVERY: usize = 8;

/// Default of [`FillRows::decode_spans`]: three spans a restore, ~50 rows over the upper
/// layers; with its 8 re-run tokens a restore adds ~5 ms a generated token on 2 cores.
pub const DEFAULT_DECODE_SPANS: usize = 3;

/// Default half-width of an exact span: a needle sentence is ~16 tokens, centred on the top row.
pub const DEFAULT_SPAN_RADIUS: usize = 8;

/// Default reach of a span past its window to its sentence's end, in span radii: a 36-character
/// UUID is ~30 tokens after digit isolation, beyond a radius-8 window's 14 rows ahead.
pub const DEFAULT_SENTENCE_REACH: usize = 4;

/// Default longest question tail: a chat turn's question plus the template's closing tokens,
/// or RULER's question and answer prefix, fit in it.
pub const DEFAULT_QUESTION_TAIL: usize = 128;
/// The question tail is at most `1 / QUESTION_SHARE_DIVISOR` of the prompt.
const QUESTION_SHARE_DIVISOR: usize = 4;

/// Which rows of the prompt run every layer exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FillRows {
    /// First tokens (attention sinks) computed exactly.
    pub sink: usize,
    /// Last tokens computed exactly; the first generated token comes from the last of them.
    pub tail: usize,
    /// Share of the prompt's rows, beyond sink and tail, run exactly in spans chosen by the
    /// tail's attention in the last lower layer (0 = plain fill).
    pub exact: f64,
    /// Half-width of each exact span around a chosen row.
    pub span: usize,
    /// Longest tail grown back to the prompt's last line break, so the final question runs
    /// exactly whole (0: the tail is `tail` rows). Needs the maps' line-break ids.
    pub question: usize,
    /// How far, in span radii, a chosen span may run past its window to the end of its
    /// sentence (0: spans keep their width). Needs the maps' sentence stops.
    pub sentence_reach: usize,
    /// Self-check: when the maps' relative error on this prompt's exact rows exceeds this, the
    /// bulk runs the upper layers exactly after all (infinite: never).
    pub max_error: f64,
    /// The self-check's second reading: the same error over the exact spans alone (when they
    /// hold at least [`SELF_CHECK_MIN_ROWS`] rows) above this also runs the bulk exactly.
    pub max_span_error: f64,
    /// After a failed self-check (and no deeper maps left), a fresh prompt is filled again with
    /// this share of its rows in exact spans instead of running every layer exactly; 0 (or no
    /// more than `exact`): every layer exactly. Its first exact pass is spent either way.
    pub retry_exact: f64,
    /// Coverage check: when the chosen spans take less than this share of the tail's attention
    /// to the filled bulk (the question reads the filled text broadly), a fresh prompt goes to
    /// the deeper split's maps, if any, before any upper layer runs (0: never).
    pub min_coverage: f64,
    /// Spans a prefill over a cached prefix restores among the earlier filled rows when its new
    /// rows all run exactly, and the fewest it restores otherwise ([`FillRows::resume_budget`];
    /// 0: a chat follow-up restores nothing and costs what full prefill's does).
    pub resume_spans: usize,
    /// A follow-up whose new rows all run exactly restores its spans only when the earlier
    /// turns' filled rows take at least this share of its question's attention in the scoring
    /// layer (0: always): a question that reads the history broadly gains little from one span.
    pub resume_min_attention: f64,
    /// Upper layers, from the split, that a short follow-up's restored rows run exactly (their
    /// K/V above stay predicted and the rows stay filled, for settling); `None`: every one.
    pub resume_layers: Option<usize>,
    /// Generated tokens between two restores while decoding over a filled cache
    /// ([`RestoringDecode`]); 0: the answer reads the cache as the prefill left it.
    pub decode_every: usize,
    /// Spans each of those restores runs exactly among the rows still filled, where the tokens
    /// generated since the last one point.
    pub decode_spans: usize,
}

impl Default for FillRows {
    /// Plain fill: sink 1, tail 16, no chosen spans, no question tail, spans of fixed width, no
    /// self-check.
    fn default() -> Self {
        Self {
            sink: 1,
            tail: 16,
            exact: 0.0,
            span: DEFAULT_SPAN_RADIUS,
            question: 0,
            sentence_reach: 0,
            max_error: f64::INFINITY,
            max_span_error: f64::INFINITY,
            retry_exact: 0.0,
            min_coverage: 0.0,
            resume_spans: RESUME_MIN_SPANS,
            resume_min_attention: RESUME_MIN_ATTENTION,
            resume_layers: None,
            decode_every: DEFAULT_DECODE_EVERY,
            decode_spans: DEFAULT_DECODE_SPANS,
        }
    }
}

impl FillRows {
    /// These rows with the tail grown to cover `tokens`' final question: back to the last
    /// line break (a token in `breaks`) at least `tail` rows from the end, at most `question`
    /// rows and a quarter of the prompt (so a short prompt still skips most rows).
    pub fn for_prompt(self, tokens: &[u32], breaks: &[u32]) -> Self {
        let n = tokens.len();
        let cap = self.question.min(n / QUESTION_SHARE_DIVISOR);
        if cap <= self.tail || breaks.is_empty() {
            return self;
        }
        // Break positions p with tail ≤ n - p - 1 ≤ cap.
        let lo = n - cap - 1;
        let hi = n.saturating_sub(self.tail + 1);
        // No break near the end: nothing marks where the question starts.
        match (lo..=hi).rev().find(|&p| breaks.contains(&tokens[p])) {
            Some(p) => Self {
                tail: n - p - 1,
                ..self
            },
            None => self,
        }
    }

    /// The bulk rows of an `n`-row prompt (neither sink nor tail), or `None` when every row runs
    /// exactly.
    pub fn bulk(&self, n: usize) -> Option<Range<usize>> {
        let sink = self.sink.min(n);
        (sink + self.tail < n).then(|| sink..n - self.tail)
    }

    /// Spans chosen in an `n`-row prompt: `exact · n` rows in spans of `2·span + 1`, and at least
    /// [`MIN_SPANS`] whenever the budget is positive.
    pub fn span_count(&self, n: usize) -> usize {
        if self.exact <= 0.0 {
            return 0;
        }
        let width = 2 * self.span + 1;
        ((self.exact * n as f64) / width as f64)
            .round()
            .max(MIN_SPANS as f64) as usize
    }

    /// Whether a prefill of `new` rows over a cached prefix runs them all exactly: a follow-up
    /// no longer than the question tail (a chat turn's question and template), where filling
    /// would save next to nothing and the question starts wherever the turn does.
    pub fn resume_exact(&self, new: usize) -> bool {
        new <= self.question.max(self.tail)
    }

    /// The rows a prefill of `new` rows over a cached prefix spends on spans:
    /// [`FillRows::resume_spans`] when its new rows all run exactly, else its own budget and at
    /// least that many (none without a span budget).
    pub fn resume_budget(&self, new: usize) -> usize {
        let spans = match self.span_count(new) {
            0 => return 0,
            _ if self.resume_exact(new) => self.resume_spans,
            k => k.max(self.resume_spans),
        };
        spans * (2 * self.span + 1)
    }

    /// Whether a failed self-check on an `n`-row prompt fills it again with more exact rows
    /// ([`FillRows::retry_exact`]): only where the wider budget covers more rows (a short
    /// prompt's [`MIN_SPANS`] may cover as many) and leaves some filled.
    pub fn retries(&self, n: usize) -> bool {
        let wide = self.widened().exact_rows(n);
        self.retry_exact < 1.0
            && wide > self.exact_rows(n)
            && self.bulk(n).is_some_and(|b| wide < b.len())
    }

    /// These rows with the retry's share of exact rows, and no retry after it.
    pub fn widened(self) -> Self {
        Self {
            exact: self.retry_exact,
            retry_exact: 0.0,
            ..self
        }
    }

    /// The most bulk rows the chosen spans can cover in an `n`-row prompt (fewer when they
    /// overlap).
    pub fn exact_rows(&self, n: usize) -> usize {
        let bulk = self.bulk(n).map_or(0, |b| b.len());
        (self.span_count(n) * (2 * self.span + 1)).min(bulk)
    }
}

impl FillMaps {
    /// Builds the fused matrix from per-layer host maps `k[l]`, `v[l]`, each `[hidden + 1, kv_dim]`
    /// row-major, for layers `split..layers`.
    pub fn from_host(
        split: usize,
        hidden: usize,
        kv_dim: usize,
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        dtype: FloatDType,
        device: &Device,
    ) -> Result<Self> {
        if k.len() != v.len() || k.is_empty() {
            return Err(ModelError::Invalid(format!(
                "fill maps: {} K maps and {} V maps (need the same, non-zero number)",
                k.len(),
                v.len()
            )));
        }
        let rows = hidden + 1;
        let upper = k.len();
        let cols = upper * 2 * kv_dim;
        let mut w = vec![0.0f32; rows * cols];
        for (li, (kl, vl)) in k.iter().zip(v).enumerate() {
            for (which, m) in [kl, vl].into_iter().enumerate() {
                if m.len() != rows * kv_dim {
                    return Err(ModelError::Invalid(format!(
                        "fill map for layer {}: {} values, expected {rows}×{kv_dim}",
                        split + li,
                        m.len()
                    )));
                }
                let col0 = (li * 2 + which) * kv_dim;
                for r in 0..rows {
                    w[r * cols + col0..r * cols + col0 + kv_dim]
                        .copy_from_slice(&m[r * kv_dim..(r + 1) * kv_dim]);
                }
            }
        }
        Ok(Self {
            split,
            w: Tensor::<2>::from_data(TensorData::new(w, [rows, cols]), device).cast(dtype),
            adapt: None,
            fill_unread: false,
            breaks: Vec::new(),
            stops: Vec::new(),
            deeper: None,
        })
    }

    /// Adds the per-prompt update from a host `[hidden + 1, hidden + 1]` precision matrix.
    pub fn with_adapt(
        mut self,
        precision: &[f32],
        weight: f64,
        dtype: FloatDType,
        device: &Device,
    ) -> Result<Self> {
        let f = self.w.dims()[0];
        if precision.len() != f * f {
            return Err(ModelError::Invalid(format!(
                "fill precision matrix: {} values, expected {f}×{f}",
                precision.len()
            )));
        }
        let p = TensorData::new(precision.to_vec(), [f, f]);
        self.adapt = Some(Adapt {
            precision: Tensor::<2>::from_data(p, device).cast(dtype),
            weight,
        });
        Ok(self)
    }

    /// The same maps, growing the tail to a final question that starts after one of `breaks`.
    pub fn with_breaks(mut self, breaks: Vec<u32>) -> Self {
        self.breaks = breaks;
        self
    }

    /// The same maps, running each chosen span on to the end of its sentence (a token in
    /// `stops`, sorted).
    pub fn with_stops(mut self, stops: Vec<u32>) -> Self {
        self.stops = stops;
        self
    }

    /// Per row of `tokens`, whether it ends a sentence or line (empty when no stops are known).
    pub fn sentence_ends(&self, tokens: &[u32]) -> Vec<bool> {
        if self.stops.is_empty() {
            return Vec::new();
        }
        tokens
            .iter()
            .map(|t| self.stops.binary_search(t).is_ok())
            .collect()
    }

    /// These maps or the deeper ones behind them that fill at `split`.
    pub fn at_split(&self, split: usize) -> Option<&FillMaps> {
        let mut maps = Some(self);
        while let Some(m) = maps {
            if m.split == split {
                return Some(m);
            }
            maps = m.deeper.as_deref();
        }
        None
    }

    /// The same maps, falling back to `deeper` (a later split) when the self-check fails.
    pub fn with_deeper(mut self, deeper: FillMaps) -> Result<Self> {
        if deeper.split <= self.split {
            return Err(ModelError::Invalid(format!(
                "deeper fill maps split at layer {}, not below this split ({})",
                deeper.split, self.split
            )));
        }
        self.deeper = Some(Box::new(deeper));
        Ok(self)
    }

    /// The same maps without the per-prompt update (plain ridge); tensors are shared.
    pub fn plain(&self) -> Self {
        Self {
            split: self.split,
            w: self.w.clone(),
            adapt: None,
            fill_unread: self.fill_unread,
            breaks: self.breaks.clone(),
            stops: self.stops.clone(),
            deeper: self.deeper.as_ref().map(|d| Box::new(d.plain())),
        }
    }

    /// The same maps filling every row of every layer, read or not (tensors are shared).
    pub fn filling_unread(&self) -> Self {
        Self {
            split: self.split,
            w: self.w.clone(),
            adapt: self.adapt.clone(),
            fill_unread: true,
            breaks: self.breaks.clone(),
            stops: self.stops.clone(),
            deeper: self.deeper.as_ref().map(|d| Box::new(d.filling_unread())),
        }
    }

    /// Training-free maps from each upper layer's own K/V projection applied to its input-normed
    /// `h_split` (the starting point of SwiftKV): `W_l = diag(g_l) · [Wk_l | Wv_l]`, intercept the
    /// K/V biases (zero without). A q/k-norm model's K is not linear in its input; these maps
    /// leave that norm out.
    pub fn own_proj(model: &Decoder, split: usize) -> Result<FillMaps> {
        check_split(model, split)?;
        let (q_dim, kv_dim) = (model.config.q_dim(), model.config.kv_dim());
        let (device, dtype) = (&model.device, model.dtype);
        let zero_row = Tensor::<2>::zeros([1, 2 * kv_dim], device).cast(dtype);
        let cols: Vec<Tensor<2>> = model.layers[split..]
            .iter()
            .map(|layer| {
                let g = layer.pre_attn_norm.clone().unsqueeze_dim::<2>(1);
                let w = layer
                    .qkv_proj
                    .dense(device, dtype)
                    .narrow(1, q_dim, 2 * kv_dim)
                    * g;
                let intercept = match &layer.qkv_bias {
                    Some(b) => b.clone().narrow(0, q_dim, 2 * kv_dim).unsqueeze_dim::<2>(0),
                    None => zero_row.clone(),
                };
                Tensor::cat(vec![w, intercept], 0)
            })
            .collect();
        Ok(FillMaps {
            split,
            w: Tensor::cat(cols, 1),
            adapt: None,
            fill_unread: false,
            breaks: Vec::new(),
            stops: Vec::new(),
            deeper: None,
        })
    }
}

/// Features the fill maps read: `[rmsnorm(h) without its weight, 1]`.
///
/// # Shapes
/// - h: `[m, hidden]` → `[m, hidden + 1]`
pub fn features(model: &Decoder, h: Tensor<2>) -> Tensor<2> {
    let m = h.dims()[0];
    let ones = Tensor::<2>::ones([m, 1], &model.device).cast(model.dtype);
    Tensor::cat(vec![model.rms_norm(h, None), ones], 1)
}

/// An error unless `0 < split < layers`.
/// The rows of `t` at `positions`, in that order.
///
/// # Shapes
/// - t: `[n, c]`, positions: `[m]` → `[m, c]`
pub(crate) fn select_rows(t: Tensor<2>, positions: &[usize]) -> Tensor<2> {
    let ids: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [positions.len()]), &t.device());
    t.select(0, ids)
}

pub(crate) fn check_split(model: &Decoder, split: usize) -> Result<()> {
    let layers = model.num_layers();
    if split == 0 || split >= layers {
        return Err(ModelError::Invalid(format!(
            "split {split} is out of range for a {layers}-layer model (need 0 < split < {layers})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_needs_a_wider_budget_that_still_fills() {
        let rows = FillRows {
            exact: DEFAULT_EXACT,
            retry_exact: DEFAULT_RETRY_EXACT,
            ..FillRows::default()
        };
        // 4096 rows: 19 spans of 17 rows, then 60.
        assert!(rows.retries(4096));
        assert_eq!(rows.widened().exact_rows(4096), 60 * 17);
        assert_eq!(rows.widened().retry_exact, 0.0);
        // 367 rows: both budgets are the minimum of five spans.
        assert!(!rows.retries(367));
        // Off, or every bulk row exact: no retry.
        assert!(
            !FillRows {
                retry_exact: 0.0,
                ..rows
            }
            .retries(4096)
        );
        assert!(
            !FillRows {
                retry_exact: 1.0,
                ..rows
            }
            .retries(4096)
        );
        assert!(
            !FillRows {
                retry_exact: 0.999,
                ..rows
            }
            .retries(4096)
        );
    }

    #[test]
    fn span_budget_counts_rows() {
        let rows = FillRows {
            exact: 0.05,
            ..FillRows::default()
        };
        assert_eq!(rows.span_count(2048), 6);
        assert_eq!(rows.exact_rows(2048), 6 * 17);
        assert_eq!(rows.span_count(4096), 12);
        assert_eq!(rows.span_count(512), MIN_SPANS);
        assert_eq!(rows.exact_rows(40), 40 - 17);
        assert_eq!(FillRows::default().span_count(2048), 0);
        assert_eq!(rows.bulk(17), None);
        assert_eq!(rows.bulk(18), Some(1..2));
    }

    #[test]
    fn a_short_follow_up_runs_whole_and_restores_a_few_spans() {
        let rows = FillRows {
            exact: 0.05,
            question: 128,
            ..FillRows::default()
        };
        let width = 2 * rows.span + 1;
        // A chat turn's question: every new row exact, the spans all for earlier rows.
        assert!(rows.resume_exact(40) && rows.resume_exact(128));
        assert_eq!(rows.resume_budget(40), RESUME_MIN_SPANS * width);
        // A pasted document: its own budget, which is never below the minimum.
        assert!(!rows.resume_exact(129));
        assert_eq!(rows.resume_budget(4096), 12 * width);
        assert_eq!(
            rows.resume_budget(200),
            MIN_SPANS.max(RESUME_MIN_SPANS) * width
        );
        // Restoring nothing: a follow-up costs what full prefill's does; a document keeps its own.
        let none = FillRows {
            resume_spans: 0,
            ..rows
        };
        assert_eq!(none.resume_budget(40), 0);
        assert_eq!(none.resume_budget(4096), 12 * width);
        // Without a question tail only the fixed tail runs whole; no span budget, no spans.
        let plain = FillRows {
            question: 0,
            ..rows
        };
        assert!(plain.resume_exact(16) && !plain.resume_exact(17));
        assert_eq!(FillRows::default().resume_budget(40), 0);
    }

    #[test]
    fn the_question_tail_reaches_back_to_the_last_line_break() {
        const NL: u32 = 10;
        let rows = FillRows {
            tail: 4,
            question: 20,
            ..FillRows::default()
        };
        let mut tokens = vec![1u32; 100];
        tokens[80] = NL; // the question starts at 81
        tokens[97] = NL; // inside the minimum tail: passed over
        assert_eq!(rows.for_prompt(&tokens, &[NL]).tail, 19);
        // Beyond the cap, or no break at all: the fixed tail.
        tokens[80] = 1;
        tokens[70] = NL;
        assert_eq!(rows.for_prompt(&tokens, &[NL]).tail, 4);
        assert_eq!(rows.for_prompt(&tokens, &[]).tail, 4);
        // A short prompt caps the question tail at a quarter of it.
        let short = [1, 1, NL, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
        assert_eq!(rows.for_prompt(&short, &[NL]).tail, 4);
        let ok = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, NL, 1, 1, 1, 1, 1];
        assert_eq!(rows.for_prompt(&ok, &[NL]).tail, 5);
    }
}
