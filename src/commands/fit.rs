use std::path::PathBuf;

use anyhow::{Result, bail};
use ridgefill::interrupt::{self, Interrupted};
use ridgefill::io::IoError;
use ridgefill::io::fill::{FillDtype, FillFile, ModelFingerprint, SplitTrial};
use ridgefill::io::stats::StatsFile;
use ridgefill::io::text::collect_documents;
use ridgefill::model::{DeviceChoice, FloatDType, WeightFormat};
use ridgefill::session::{LoadArgs, load};
use ridgefill_fit::FitError;
use ridgefill_fit::calibrate::{CalibConfig, Control, calibrate_splits_with, calibrate_with};
use ridgefill_fit::solve::DEFAULT_ALPHA_GRID;
use ridgefill_fit::{
    AlphaChoice, FitOptions, SplitBudget, SplitEvent, default_split_candidates,
    fit_fill_split_search, fit_fill_until,
};

use super::common::{Bar, RowArgs, WEIGHTS_HELP, parse_share, parse_weights};

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file, a Hugging Face directory, or a manifest name (fetched when missing).
    #[arg(short = 'm', long = "model", default_value = ridgefill::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// auto | cpu | wgpu | vulkan | metal | cuda.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    #[arg(long, default_value = "native", value_parser = parse_weights, help = WEIGHTS_HELP)]
    pub weights: WeightFormat,
    /// Calibration text: files or directories (the Brown corpus is detected and detagged).
    /// Default: the Brown corpus (`ridgefill fetch brown`).
    #[arg(long, num_args = 1..)]
    pub calib: Vec<PathBuf>,
    /// First skipped layer, or `auto`: the smallest of --candidates whose held-out fidelity is
    /// within --max-kl (and --min-top1), from one calibration pass.
    #[arg(long, value_parser = parse_split)]
    pub split: Option<SplitArg>,
    /// With --split auto: the largest acceptable held-out KL(full ‖ fill), nats per token.
    #[arg(long, value_parser = parse_max_kl)]
    pub max_kl: Option<f64>,
    /// With --split auto: the smallest acceptable held-out top-1 agreement with full prefill
    /// (0 to 1; default 0).
    #[arg(long, value_parser = parse_share)]
    pub min_top1: Option<f64>,
    /// With --split auto: the splits to try, e.g. 5,10,15 (default: every ⌈L/6⌉-th layer up
    /// to L−2, e.g. 5,10,15,20,25 for 30 layers).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub candidates: Vec<usize>,
    /// Calibration window length in tokens.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Fit on at most this many tokens (the following documents are held out).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Ridge strength: `auto` picks from a grid by held-out KL; or a number (λ = α·tr(XᵀX)/d).
    #[arg(long, default_value = "auto")]
    pub alpha: String,
    /// Dtype of the maps in the output file: f32 | f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    #[command(flatten)]
    pub rows: RowArgs,
    /// Also (or only) write the sufficient statistics, to merge shards with --from-stats.
    #[arg(long)]
    pub stats_out: Option<PathBuf>,
    /// Sum these statistics files and solve, instead of a calibration pass.
    #[arg(long, num_args = 1.., conflicts_with = "stats_out")]
    pub from_stats: Vec<PathBuf>,
    /// Output fill file.
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Replace undecodable bytes in calibration text instead of failing.
    #[arg(long)]
    pub lossy: bool,
}

/// `--split`: one layer, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SplitArg {
    Auto,
    Layer(usize),
}

fn parse_split(s: &str) -> std::result::Result<SplitArg, String> {
    if s == "auto" {
        return Ok(SplitArg::Auto);
    }
    s.parse::<usize>()
        .map(SplitArg::Layer)
        .map_err(|_| format!("expected a layer number or `auto`, found {s:?}"))
}

fn parse_max_kl(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "expected a non-negative KL in nats per token, found {s:?}"
        )),
    }
}

/// Share of calibration windows held out to choose α.
const HELDOUT_FRACTION: f64 = 0.1;

/// A fit error for `main`: a stop requested by Ctrl-C becomes [`Interrupted`] (exit 130).
fn fit_error(e: FitError) -> anyhow::Error {
    match e {
        FitError::Stopped => Interrupted.into(),
        e => e.into(),
    }
}

/// Fails before any work when an output's directory does not exist.
fn check_output_dir(path: &std::path::Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        return Err(IoError::MissingFile {
            path: dir.to_path_buf(),
            what: format!("directory to write {} into", path.display()),
        }
        .into());
    }
    if path.is_dir() {
        bail!(
            "{}: is a directory, expected a file name to write",
            path.display()
        );
    }
    Ok(())
}

fn parse_alpha(s: &str) -> Result<AlphaChoice> {
    if s == "auto" {
        return Ok(AlphaChoice::Auto(DEFAULT_ALPHA_GRID.to_vec()));
    }
    match s.parse::<f64>() {
        Ok(a) if a.is_finite() && a >= 0.0 => Ok(AlphaChoice::Fixed(a)),
        _ => bail!("--alpha {s:?}: expected `auto` or a non-negative number"),
    }
}

/// The `--split auto` request: the budget and the candidates (checked against the model later).
struct AutoSplit {
    budget: SplitBudget,
    candidates: Vec<usize>,
}

/// Checks the split flags together: `--split auto` needs `--max-kl` and a calibration pass;
/// the search flags need `--split auto`.
fn auto_split(a: &Args) -> Result<Option<AutoSplit>> {
    if a.split != Some(SplitArg::Auto) {
        if a.max_kl.is_some() || a.min_top1.is_some() || !a.candidates.is_empty() {
            bail!("--max-kl, --min-top1 and --candidates only apply to --split auto");
        }
        return Ok(None);
    }
    let Some(max_kl) = a.max_kl else {
        bail!(
            "--split auto needs --max-kl K: the largest acceptable held-out KL(full ‖ fill) in \
             nats per token"
        );
    };
    if a.stats_out.is_some() || !a.from_stats.is_empty() {
        bail!(
            "--split auto does not support --stats-out or --from-stats (a statistics file holds \
             one split): shard with --split N, or search in one calibration pass"
        );
    }
    // Without --stats-out, -o is there (checked before).
    Ok(Some(AutoSplit {
        budget: SplitBudget {
            max_kl,
            min_top1: a.min_top1.unwrap_or(0.0),
        },
        candidates: a.candidates.clone(),
    }))
}

pub fn run(a: Args) -> Result<()> {
    let alpha = parse_alpha(&a.alpha)?;
    let out_dtype = match a.dtype.as_str() {
        "f32" => FillDtype::F32,
        "f16" => FillDtype::F16,
        other => bail!("--dtype {other:?}: expected f32 or f16"),
    };
    if a.output.is_none() && a.stats_out.is_none() {
        bail!("nothing to write: give -o FILE (and/or --stats-out FILE)");
    }
    let auto = auto_split(&a)?;
    for p in a.output.iter().chain(&a.stats_out) {
        check_output_dir(p)?;
    }
    if a.from_stats.is_empty() && a.split.is_none() {
        bail!("--split is required for a calibration pass");
    }
    let loaded = load(
        &LoadArgs {
            model: a.model.clone(),
            device: a.device,
            dtype: FloatDType::F32,
            weights: a.weights,
        },
        a.ctx,
    )?;
    let model = &loaded.model;
    let fingerprint = ModelFingerprint::of(&loaded.ckpt);
    let candidates = match &auto {
        Some(auto) => Some(candidate_splits(auto, model.num_layers())?),
        None => None,
    };
    let calib = if a.calib.is_empty() && a.from_stats.is_empty() {
        vec![ridgefill::fetch::ensure("brown")?]
    } else {
        a.calib.clone()
    };
    let docs = if calib.is_empty() {
        Vec::new()
    } else {
        collect_documents(&calib, a.lossy)?
    };
    interrupt::check()?;
    let (stats, heldout_windows) = if a.from_stats.is_empty() {
        let cfg = CalibConfig {
            split: match a.split {
                Some(SplitArg::Layer(s)) => s,
                _ => 0,
            },
            sink: a.rows.sink,
            ctx: a.ctx,
            max_tokens: a.max_tokens,
            heldout_fraction: HELDOUT_FRACTION,
        };
        let bar = Bar::new(
            0,
            "calibrating [{bar:30}] {pos}/{len} tokens {per_sec} ETA {eta}",
        );
        let mut progress = |p: ridgefill_fit::Progress| {
            if p.tokens_done == 0 {
                // Always printed (the bar is hidden when stderr is not a terminal).
                bar.suspend(|| eprintln!("calibrating: {} tokens (Ctrl-C stops)", p.tokens_total));
            }
            bar.set_length(p.tokens_total as u64);
            bar.set_position(p.tokens_done as u64);
        };
        let ctl = Control {
            progress: &mut progress,
            stop: &interrupt::requested,
            // Shards are summed before solving: only a run that solves needs enough rows.
            require_solvable: a.output.is_some(),
            require_heldout: a.output.is_some()
                && (matches!(alpha, AlphaChoice::Auto(_)) || candidates.is_some()),
        };
        let tok = &loaded.ckpt.tokenizer;
        let (stats, heldout_windows) = match &candidates {
            Some(splits) => {
                let cal = calibrate_splits_with(
                    model,
                    fingerprint.clone(),
                    tok,
                    &docs,
                    &cfg,
                    splits,
                    ctl,
                )
                .map_err(fit_error)?;
                (cal.stats, cal.heldout_windows)
            }
            None => {
                let cal = calibrate_with(model, fingerprint.clone(), tok, &docs, &cfg, ctl)
                    .map_err(fit_error)?;
                (vec![cal.stats], cal.heldout_windows)
            }
        };
        bar.finish_and_clear();
        eprintln!(
            "calibration: {} fit rows, {} held-out rows, {} documents{}, {:.0} s",
            stats[0].fit.rows,
            stats[0].heldout.rows,
            stats[0].meta.sources.len(),
            match &candidates {
                Some(c) => format!(", {} candidate splits", c.len()),
                None => String::new(),
            },
            bar.elapsed().as_secs_f64()
        );
        if let Some(p) = &a.stats_out {
            stats[0].write(p)?;
            eprintln!("statistics written to {}", p.display());
        }
        (stats, heldout_windows)
    } else {
        let stats = StatsFile::merge(&a.from_stats)?;
        let fields = stats.meta.model.mismatches(&fingerprint);
        if !fields.is_empty() {
            return Err(IoError::ModelMismatch {
                path: a.from_stats[0].clone(),
                what: "statistics file",
                fields,
            }
            .into());
        }
        if stats.meta.ctx == 0 {
            bail!(
                "{}: statistics record a window length (ctx) of 0",
                a.from_stats[0].display()
            );
        }
        if let Some(SplitArg::Layer(s)) =
            a.split.filter(|&s| s != SplitArg::Layer(stats.meta.split))
        {
            bail!(
                "--split {s} disagrees with the statistics' split {}",
                stats.meta.split
            );
        }
        // Held-out KL for α needs text: windows of the given calibration documents.
        let mut windows = Vec::new();
        for d in &docs {
            interrupt::check()?;
            let ids = loaded.ckpt.tokenizer.encode(&d.text, true)?;
            windows.extend(
                ids.chunks(stats.meta.ctx)
                    .filter(|w| w.len() == stats.meta.ctx)
                    .map(<[u32]>::to_vec),
            );
        }
        (vec![stats], windows)
    };
    let Some(output) = &a.output else {
        return Ok(());
    };
    let opts = fit_options(&a.rows, alpha);
    let t = std::time::Instant::now();
    let file = match &auto {
        Some(auto) => search(model, &stats, &heldout_windows, &opts, auto.budget)?,
        None => fit_fill_until(
            model,
            &stats[0],
            &heldout_windows,
            &opts,
            &interrupt::requested,
        )
        .map_err(fit_error)?,
    };
    // The last chance to stop: after this the file is written (atomically) as a whole.
    interrupt::check()?;
    file.write(output, out_dtype)?;
    let m = &file.meta;
    let mean = |f: fn(&ridgefill::io::fill::LayerQuality) -> f64| {
        m.quality.iter().map(f).sum::<f64>() / m.quality.len().max(1) as f64
    };
    for t in &m.alpha_grid {
        eprintln!("  alpha {:>8.0e}: held-out KL {:.4}", t.alpha, t.kl);
    }
    eprintln!(
        "fit: split {} | alpha {:e} (lambda {:.4}) | held-out KL {} | mean R² K {:.3} V {:.3} | solve {:.1} s",
        m.split,
        m.alpha,
        m.lambda,
        m.heldout_kl
            .map_or("n/a".to_string(), |k| format!("{k:.4}")),
        mean(|q| q.r2_k),
        mean(|q| q.r2_v),
        t.elapsed().as_secs_f64()
    );
    println!("{}", output.display());
    Ok(())
}

/// The `--split auto` candidates for an `layers`-layer model: `--candidates` (sorted, without
/// repeats), else the default spread; each must be a valid split.
fn candidate_splits(auto: &AutoSplit, layers: usize) -> Result<Vec<usize>> {
    let mut c = if auto.candidates.is_empty() {
        default_split_candidates(layers)
    } else {
        auto.candidates.clone()
    };
    c.sort_unstable();
    c.dedup();
    if let Some(s) = c.iter().find(|&&s| s == 0 || s >= layers) {
        bail!(
            "--candidates: split {s} is out of range for a {layers}-layer model (need 0 < split < \
             {layers})"
        );
    }
    if c.is_empty() {
        bail!("--split auto: a {layers}-layer model has no split to try");
    }
    Ok(c)
}

/// Fits and measures every candidate, printing each as it is measured and the table at the end
/// (also when none is within the budget).
fn search(
    model: &ridgefill::model::Decoder,
    stats: &[StatsFile],
    heldout_windows: &[Vec<u32>],
    opts: &FitOptions,
    budget: SplitBudget,
) -> Result<FillFile> {
    let res = fit_fill_split_search(
        model,
        stats,
        heldout_windows,
        opts,
        budget,
        &interrupt::requested,
        &mut |e| match e {
            SplitEvent::Start {
                split,
                index,
                count,
            } => eprintln!(
                "split search {}/{count}: split {split} (fit and held-out measurement)",
                index + 1
            ),
            SplitEvent::Trial(t) => eprintln!(
                "  split {}: held-out KL {:.5} | top-1 {:.3} | FLOPs {:.3}x full",
                t.split, t.kl, t.top1, t.flops_ratio
            ),
            SplitEvent::Failed { split, error } => {
                eprintln!("  split {split}: no usable fit ({error})")
            }
        },
    );
    match res {
        Ok(file) => {
            print_search(&file.meta.split_search, budget, Some(file.meta.split));
            Ok(file)
        }
        Err(FitError::NoSplitWithinBudget { budget, trials }) => {
            print_search(&trials, budget, None);
            Err(FitError::NoSplitWithinBudget { budget, trials }.into())
        }
        Err(e) => Err(fit_error(e)),
    }
}

/// The candidates as a table on stderr, the chosen one marked.
fn print_search(trials: &[SplitTrial], budget: SplitBudget, chosen: Option<usize>) {
    eprintln!(
        "split search (budget: held-out KL <= {}, top-1 >= {}):",
        budget.max_kl, budget.min_top1
    );
    eprintln!("  split  held-out KL  top-1  FLOPs/full");
    for t in trials {
        let mark = if Some(t.split) == chosen {
            "  <- chosen"
        } else if budget.admits(t) {
            "  (within budget)"
        } else {
            ""
        };
        eprintln!(
            "  {:>5}  {:>11.5}  {:>5.3}  {:>10.3}{mark}",
            t.split, t.kl, t.top1, t.flops_ratio
        );
    }
}

/// The fit's method and its budget: each flag, else the shipped default.
pub fn fit_options(rows: &RowArgs, alpha: AlphaChoice) -> FitOptions {
    use ridgefill::model::fill::{
        DEFAULT_ADAPT_WEIGHT, DEFAULT_EXACT, DEFAULT_SPAN_RADIUS, FillMethod, FillRows,
    };
    FitOptions {
        alpha,
        rows: FillRows {
            sink: rows.sink,
            tail: rows.tail,
            exact: rows.exact.unwrap_or(DEFAULT_EXACT),
            span: rows.span.unwrap_or(DEFAULT_SPAN_RADIUS),
            question: rows.question_tail,
            sentence_reach: rows.sentence_reach,
            max_error: rows.max_fill_error.unwrap_or(f64::INFINITY),
            max_span_error: rows.max_span_error.unwrap_or(f64::INFINITY),
            retry_exact: rows.retry_exact,
            min_coverage: rows.min_coverage.unwrap_or(0.0),
            resume_spans: rows.resume_spans,
            resume_min_attention: rows.resume_min_attention,
            resume_layers: rows.resume_layers,
            decode_every: rows.restore_every,
            decode_spans: rows.restore_spans,
        },
        method: rows.method.unwrap_or(FillMethod::DEFAULT),
        adapt_weight: rows.adapt_weight.unwrap_or(DEFAULT_ADAPT_WEIGHT),
        created_by: format!("ridgefill {}", env!("CARGO_PKG_VERSION")),
    }
}
