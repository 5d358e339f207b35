use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ridgefill::io::fill::{FillDtype, ModelFingerprint};
use ridgefill::io::stats::StatsFile;
use ridgefill::io::text::collect_documents;
use ridgefill::model::{DeviceChoice, FloatDType};
use ridgefill::session::{LoadArgs, load};
use ridgefill_fit::calibrate::{CalibConfig, calibrate};
use ridgefill_fit::solve::{AlphaChoice, DEFAULT_ALPHA_GRID, FitOptions, fit_fill};

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
    let (stats, heldout_windows) = if a.from_stats.is_empty() {
        let split = a
            .split
            .context("--split is required for a calibration pass")?;
        let cfg = CalibConfig {
            split,
            sink: a.rows.sink,
            ctx: a.ctx,
            max_tokens: a.max_tokens,
            heldout_fraction: HELDOUT_FRACTION,
        };
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "calibrating [{bar:30}] {pos}/{len} tokens {per_sec} ETA {eta}",
            )
            .expect("static template"),
        );
        let cal = calibrate(
            model,
            fingerprint.clone(),
            &loaded.ckpt.tokenizer,
            &docs,
            &cfg,
            &mut |p| {
                bar.set_length(p.tokens_total as u64);
                bar.set_position(p.tokens_done as u64);
            },
        )?;
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
        let diff = stats.meta.model.mismatches(&fingerprint);
        if !diff.is_empty() {
            bail!(
                "{}: statistics were made for another model: {}",
                a.from_stats[0].display(),
                ridgefill::io::fill::FieldMismatch::describe_all(&diff)
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
    let file = fit_fill(model, &stats, &heldout_windows, &opts)?;
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
