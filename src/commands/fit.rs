use std::path::PathBuf;

use anyhow::{Result, bail};
use ridgefill::interrupt::{self, Interrupted};
use ridgefill::io::IoError;
use ridgefill::io::fill::{FillDtype, ModelFingerprint};
use ridgefill::io::stats::StatsFile;
use ridgefill::io::text::collect_documents;
use ridgefill::model::{DeviceChoice, FloatDType};
use ridgefill::session::{LoadArgs, load};
use ridgefill_fit::FitError;
use ridgefill_fit::calibrate::{CalibConfig, Control, calibrate_with};
use ridgefill_fit::solve::{AlphaChoice, DEFAULT_ALPHA_GRID, FitOptions, fit_fill_until};

use super::generate::RowArgs;

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file, a Hugging Face directory, or a manifest name (fetched when missing).
    #[arg(short = 'm', long = "model", default_value = ridgefill::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// auto | cpu | wgpu | vulkan | metal | cuda.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Calibration text: files or directories (the Brown corpus is detected and detagged).
    /// Default: the Brown corpus (`ridgefill fetch brown`).
    #[arg(long, num_args = 1..)]
    pub calib: Vec<PathBuf>,
    /// First skipped layer.
    #[arg(long)]
    pub split: Option<usize>,
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

/// Share of calibration windows held out to choose α.
const HELDOUT_FRACTION: f64 = 0.1;

/// A progress bar that is cleared however the command ends: success, error or Ctrl-C.
pub struct Bar(pub indicatif::ProgressBar);

impl Bar {
    pub fn new(len: u64, template: &'static str) -> Self {
        let bar = indicatif::ProgressBar::new(len);
        bar.set_style(indicatif::ProgressStyle::with_template(template).expect("static template"));
        Bar(bar)
    }
}

impl std::ops::Deref for Bar {
    type Target = indicatif::ProgressBar;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

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
        },
        a.ctx,
    )?;
    let model = &loaded.model;
    let fingerprint = ModelFingerprint::of(&loaded.ckpt);
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
        let split = a.split.unwrap_or_default();
        let cfg = CalibConfig {
            split,
            sink: a.rows.sink,
            ctx: a.ctx,
            max_tokens: a.max_tokens,
            heldout_fraction: HELDOUT_FRACTION,
        };
        let bar = Bar::new(
            0,
            "calibrating [{bar:30}] {pos}/{len} tokens {per_sec} ETA {eta}",
        );
        let cal = calibrate_with(
            model,
            fingerprint.clone(),
            &loaded.ckpt.tokenizer,
            &docs,
            &cfg,
            Control {
                progress: &mut |p| {
                    if p.tokens_done == 0 {
                        // Always printed (the bar is hidden when stderr is not a terminal).
                        bar.suspend(|| {
                            eprintln!("calibrating: {} tokens (Ctrl-C stops)", p.tokens_total)
                        });
                    }
                    bar.set_length(p.tokens_total as u64);
                    bar.set_position(p.tokens_done as u64);
                },
                stop: &interrupt::requested,
                // Shards are summed before solving: only a run that solves needs enough rows.
                require_solvable: a.output.is_some(),
                require_heldout: a.output.is_some() && matches!(alpha, AlphaChoice::Auto(_)),
            },
        )
        .map_err(fit_error)?;
        bar.finish_and_clear();
        eprintln!(
            "calibration: {} fit rows, {} held-out rows, {} documents, {:.0} s",
            cal.stats.fit.rows,
            cal.stats.heldout.rows,
            cal.stats.meta.sources.len(),
            bar.elapsed().as_secs_f64()
        );
        if let Some(p) = &a.stats_out {
            cal.stats.write(p)?;
            eprintln!("statistics written to {}", p.display());
        }
        (cal.stats, cal.heldout_windows)
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
        if let Some(s) = a.split.filter(|&s| s != stats.meta.split) {
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
        (stats, windows)
    };
    let Some(output) = &a.output else {
        return Ok(());
    };
    let opts = FitOptions {
        alpha,
        rows: a.rows.rows(),
        created_by: format!("ridgefill {}", env!("CARGO_PKG_VERSION")),
    };
    let t = std::time::Instant::now();
    let file = fit_fill_until(
        model,
        &stats,
        &heldout_windows,
        &opts,
        &interrupt::requested,
    )
    .map_err(fit_error)?;
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
