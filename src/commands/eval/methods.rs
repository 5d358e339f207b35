//! The prefill methods `eval` compares and what every report states about them: shared by the
//! text fidelity run ([`super`]) and the retrieval tasks ([`super::retrieval`]).

use anyhow::Result;
use ridgefill::fillfile::{MethodChoice, configure};
use ridgefill::io::config::ModelConfig;
use ridgefill::io::fill::FillFile;
use ridgefill::model::Decoder;
use ridgefill::model::eval::{Method, Skip, prefill_flops};
use ridgefill::model::fill::{
    FillMaps, FillMethod, FillOptions, FillReport, FillRows, RestoringDecode,
};

use crate::commands::common::RowArgs;

/// A prefill method `eval` compares against full prefill.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalMethod {
    /// Every row through every layer: the reference.
    Full,
    /// The fill file's shipped method, as the row flags configure it.
    Fill,
    /// The same maps, every bulk row filled: no spans, no per-prompt update.
    Ridge,
    /// The same maps plus query-chosen exact spans, without the per-prompt update.
    Spans,
    /// The bulk rows never enter the upper layers: the floor any fill must beat.
    Drop,
    /// Training-free maps from each upper layer's own K/V projection.
    OwnProj,
}

impl EvalMethod {
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Fill => "fill",
            Self::Ridge => "ridge",
            Self::Spans => "spans",
            Self::Drop => "drop",
            Self::OwnProj => "own-proj",
        }
    }
}

/// A method ready to run: its maps (when it fills) and the rows it runs exactly.
pub struct Runner {
    pub method: EvalMethod,
    /// The method's name in reports: `fill@S` for a further fill file at split S.
    label: &'static str,
    maps: Option<FillMaps>,
    pub rows: FillRows,
    split: usize,
}

impl Runner {
    pub fn name(&self) -> &'static str {
        self.label
    }

    /// The fill maps, for a method that fills.
    pub fn maps(&self) -> Option<&FillMaps> {
        self.maps.as_ref()
    }

    /// The engine's view of this method.
    pub fn prefill(&self) -> Method<'_> {
        match (self.method, &self.maps) {
            (EvalMethod::Full, _) => Method::Full,
            (_, Some(maps)) => Method::Fill(maps, self.rows),
            (_, None) => Method::Drop(self.split, self.rows),
        }
    }

    /// Prefill FLOPs of an `n`-token prompt against full prefill's.
    pub fn flops_ratio(&self, cfg: &ModelConfig, n: usize) -> f64 {
        self.flops_ratio_with(cfg, n, false)
    }

    /// [`Runner::flops_ratio`] of what a prefill ran: one whose self-check failed ran the upper
    /// layers again after its planned pass, every row exactly or, widened, with
    /// [`FillRows::retry_exact`] of its rows exact.
    pub fn flops_ratio_run(&self, cfg: &ModelConfig, n: usize, report: &FillReport) -> f64 {
        let planned = self.flops_ratio(cfg, n);
        let upper = ridgefill::model::eval::upper_share(cfg, n, self.split);
        if report.fell_back {
            planned + upper
        } else if report.widened {
            // The second pass's upper layers: its whole ratio less the lower layers' share.
            let wide = self.flops_of(self.rows.widened(), cfg, n, false);
            planned + wide - (1.0 - upper)
        } else {
            planned
        }
    }

    /// [`Runner::flops_ratio`], with sliding-window layers' unread rows filled too when
    /// `fill_unread` (what leaving them out saves).
    pub fn flops_ratio_with(&self, cfg: &ModelConfig, n: usize, fill_unread: bool) -> f64 {
        self.flops_of(self.rows, cfg, n, fill_unread)
    }

    /// [`Runner::flops_ratio_with`] as if `rows` ran exactly.
    fn flops_of(&self, rows: FillRows, cfg: &ModelConfig, n: usize, fill_unread: bool) -> f64 {
        let skip = match self.method {
            EvalMethod::Full => None,
            _ => Some(Skip {
                split: self.split,
                rows,
                filled: self.maps.is_some(),
                adapt: self.maps.as_ref().is_some_and(|m| m.adapt.is_some()),
                fill_unread,
            }),
        };
        prefill_flops(cfg, n, skip) / prefill_flops(cfg, n, None)
    }
}

/// Which method `fill` stands for, for the report.
#[derive(Clone, Copy, Debug)]
pub struct FillSummary {
    pub method: FillMethod,
    pub exact: f64,
    pub span: usize,
}

impl FillSummary {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"name": self.method.name(), "exact": self.exact, "span": self.span})
    }

    pub fn describe(&self) -> String {
        format!(
            "fill = {} (exact share {}, span ±{})",
            self.method, self.exact, self.span
        )
    }
}

/// The runners of `list` (full first) and what `fill` is.
pub fn prepare(
    model: &Decoder,
    file: &FillFile,
    maps: &FillMaps,
    rows: &RowArgs,
    list: &[EvalMethod],
) -> Result<(Vec<Runner>, FillSummary)> {
    let split = file.meta.split;
    let choice = rows.choice();
    // The shipped method is configured even when not run: the report names it.
    let (fill_method, _, fill_rows) = configure(file, maps, &choice)?;
    let summary = FillSummary {
        method: fill_method,
        exact: fill_rows.exact,
        span: fill_rows.span,
    };
    // Ridge and spans: the same flags, with the method fixed.
    let variant = |method| MethodChoice {
        method: Some(method),
        ..choice.clone()
    };
    let mut runners = Vec::with_capacity(list.len());
    for &method in list {
        let (maps, rows) = match method {
            EvalMethod::Full | EvalMethod::Drop => (None, rows.rows()),
            EvalMethod::OwnProj => (Some(FillMaps::own_proj(model, split)?), rows.rows()),
            EvalMethod::Fill => fitted(configure(file, maps, &choice)?),
            EvalMethod::Ridge => fitted(configure(file, maps, &variant(FillMethod::Ridge))?),
            EvalMethod::Spans => fitted(configure(file, maps, &variant(FillMethod::Spans))?),
        };
        runners.push(Runner {
            method,
            label: method.name(),
            maps,
            rows,
            split,
        });
    }
    Ok((runners, summary))
}

/// What `eval` compares, from `--fill FILE[,MORE...]`: the runners of `list` for the first
/// file (its deeper splits from `--fill-deeper` chained behind it), then one `fill@S` runner
/// per further file, each its shipped method at the same row flags with no self-check (so one
/// run measures several splits against the same full prefill). Returns the runners, what
/// `fill` is, and the first file's split.
pub fn load_runners(
    loaded: &ridgefill::session::Loaded,
    fills: &[std::path::PathBuf],
    rows: &RowArgs,
    list: &[EvalMethod],
) -> Result<(Vec<Runner>, FillSummary, usize)> {
    let model = &loaded.model;
    let Some((first, more)) = fills.split_first() else {
        anyhow::bail!("--fill needs at least one fill file");
    };
    let (file, maps) =
        ridgefill::fillfile::load_ladder(first, &rows.fill_deeper, &loaded.ckpt, model)?;
    let (mut runners, summary) = prepare(model, &file, &maps, rows, list)?;
    let plain = MethodChoice {
        max_error: Some(f64::INFINITY),
        max_span_error: Some(f64::INFINITY),
        min_coverage: 0.0,
        deeper: Vec::new(),
        ..rows.choice()
    };
    for path in more {
        let (file, maps) = ridgefill::fillfile::load_maps(path, &loaded.ckpt, model)?;
        let (_, maps, fill_rows) = configure(&file, &maps, &plain)?;
        let split = file.meta.split;
        // One short name per extra file for the whole run: reports key methods by `&'static str`.
        let label: &'static str = Box::leak(format!("fill@{split}").into_boxed_str());
        if runners.iter().any(|r| r.label == label) {
            anyhow::bail!("--fill lists two fill files at split {split}");
        }
        runners.push(Runner {
            method: EvalMethod::Fill,
            label,
            maps: Some(maps),
            rows: fill_rows,
            split,
        });
    }
    Ok((runners, summary, file.meta.split))
}

/// A prefill's fill report for `--json`: rows filled, the exact tail, the split that filled,
/// the self-check error and whether it fell back.
pub fn report_json(r: &ridgefill::model::fill::FillReport) -> serde_json::Value {
    serde_json::json!({
        "filled": r.filled,
        "tail": r.tail,
        "split": r.split,
        "error": r.error,
        "error_spans": r.error_spans,
        "coverage": r.coverage,
        "filled_attention": r.filled_attention,
        "fell_back": r.fell_back,
        "widened": r.widened,
    })
}

/// The maps and rows of a configured fill method.
fn fitted((_, maps, rows): (FillMethod, FillMaps, FillRows)) -> (Option<FillMaps>, FillRows) {
    (Some(maps), rows)
}

/// What every report states: the split, the exact rows, and which method `fill` is.
pub struct Header {
    pub split: usize,
    pub rows: FillRows,
    pub fill: FillSummary,
}

impl Header {
    pub fn describe(&self) -> String {
        format!(
            "split {} | sink {} tail {} | {}",
            self.split,
            self.rows.sink,
            self.rows.tail,
            self.fill.describe()
        )
    }
}

/// A greedy answer and what its prefill cost.
pub struct Generation {
    /// Generated token ids, the stop token excluded.
    pub tokens: Vec<u32>,
    /// Wall seconds of the prefill alone (logits on the host), for side-by-side speed-ups.
    pub prefill_secs: f64,
    /// Wall seconds of the decode after it, restores included.
    pub decode_secs: f64,
    /// Filled rows the decode restored ([`RestoringDecode`]).
    pub restored: usize,
    /// The bulk spans that ran exactly (none unless the method chooses spans).
    pub spans: Vec<std::ops::Range<usize>>,
    /// What the prefill filled, and its self-check.
    pub report: ridgefill::model::fill::FillReport,
}

/// Prefills `prompt` by `method`, then decodes greedily up to `max_new` tokens, stopping at (and
/// leaving out) any of `stop`. Every task that compares answers across methods shares this.
pub fn generate(
    model: &Decoder,
    method: Method,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
) -> Result<Generation> {
    let mut cache = model.new_cache(prompt.len() + max_new);
    let t0 = std::time::Instant::now();
    let filled = ridgefill::model::eval::prefill_with_spans(model, prompt, &mut cache, method)?;
    let mut logits = ridgefill::model::to_host_f32(filled.logits);
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let opts = match method {
        Method::Fill(maps, rows) => Some(FillOptions::fill(maps, rows)),
        _ => None,
    };
    let mut decode = opts.map(|o| RestoringDecode::new(model, o, prompt, filled.history));
    let mut tokens = Vec::with_capacity(max_new);
    for step in 0..max_new {
        let t = ridgefill::model::sample::argmax(&logits);
        if stop.contains(&t) {
            break;
        }
        tokens.push(t);
        if step + 1 < max_new {
            let next = match decode.as_mut() {
                Some(d) => d.step(t, &mut cache)?,
                None => model.decode_step(t, &mut cache)?,
            };
            logits = ridgefill::model::to_host_f32(next);
        }
    }
    let decode_secs = t1.elapsed().as_secs_f64();
    let restored = decode.as_ref().map_or(0, |d| d.restored().0);
    Ok(Generation {
        tokens,
        prefill_secs,
        decode_secs,
        restored,
        spans: filled.spans,
        report: filled.report,
    })
}
