//! `ridgefill bench`: prefill and decode speed in the manner of llama-bench, full and skip-and-fill
//! side by side on every requested device. [`runner`] times the runs, [`report`] turns them into
//! rows and writes them.

mod report;
mod runner;

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use ridgefill::model::DeviceChoice;
use ridgefill::model::eval::{Skip, decode_flops, prefill_flops, prefill_flops_at};
use ridgefill::model::fill::{DEFAULT_ADAPT_WEIGHT, DEFAULT_EXACT, FillMaps, FillMethod, FillRows};
use ridgefill::session::dtype_name;

use super::common::{
    AnyModel, DeviceList, ModelArgs, flex_threads, load_any, parse_method, parse_share,
};
use report::{Format, Header, Row, RowKind, make_rows, render};
use runner::{Modes, Runner, alternate};

/// The `-m` help: `bench` takes synthetic models too.
const MODEL_HELP: &str = "A .gguf file, a Hugging Face directory, a manifest name (fetched when \
missing), or `synthetic:smollm2-135m` / `synthetic:llama-1b` (random weights of that shape)";

#[derive(clap::Args)]
#[command(mut_arg("model", |a| a.help(MODEL_HELP)))]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs<DeviceList>,
    /// Fill file from `ridgefill fit`: adds `fill` rows next to the `full` ones.
    #[arg(long, conflicts_with = "split")]
    pub fill: Option<PathBuf>,
    /// Speed only, no fill file: `fill` rows at this split with maps of the right shape taken
    /// from the model's own K/V projections (same work as fitted maps, worse quality).
    #[arg(long)]
    pub split: Option<usize>,
    /// Leading tokens (attention sinks) that run every layer in fill mode.
    #[arg(long, default_value_t = FillRows::default().sink)]
    pub sink: usize,
    /// Trailing tokens that run every layer in fill mode.
    #[arg(long, default_value_t = FillRows::default().tail)]
    pub tail: usize,
    /// How the fill runs (ridge, spans, spans-adapt); default: the fill file's method, or the
    /// shipped default with --split.
    #[arg(long, value_parser = parse_method)]
    pub method: Option<FillMethod>,
    /// Share of the prompt's rows run exactly in query-chosen spans (default: the fill file's).
    #[arg(long, value_parser = parse_share)]
    pub exact: Option<f64>,
    /// Spans a `ppN @ dD` fill row restores among the filled prefix's rows when its new rows
    /// all run exactly, whatever share of attention those rows draw (0: none).
    #[arg(long, default_value_t = ridgefill::model::fill::RESUME_MIN_SPANS)]
    pub resume_spans: usize,
    /// Prompt lengths (prefill tests `ppN`), comma-separated.
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generated tokens (decode test `tgN`); 0 skips it.
    #[arg(short = 'n', long = "n-gen", default_value_t = 32)]
    pub n_gen: usize,
    /// Batch sizes, comma-separated, like llama-batched-bench: `tgN @ dD x bB` rows give the
    /// aggregate t/s of B sequences decoded together (one batched step each), each over its own
    /// D-token context; `ppN x bB` rows (B > 1) the aggregate t/s of prefilling B prompts of N
    /// tokens to their first tokens (full: one batched prefill; fill: prompt after prompt).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1",
        value_parser = parse_batch
    )]
    pub batch: Vec<usize>,
    /// Context prefilled (by the row's mode) before the decode test, as llama-bench's `-d`:
    /// fill mode decodes over a cache whose upper layers hold predicted K/V.
    #[arg(short = 'd', long = "n-depth", default_value_t = 512)]
    pub n_depth: usize,
    /// Prefill over a cached context, comma-separated depths (llama-bench's `-d` on pp tests):
    /// `ppN @ dD` rows time N new tokens after D positions prefilled untimed by the row's mode,
    /// as a follow-up turn over a reused prefix; fill rows resume over the filled prefix and
    /// re-run the spans the new rows choose among its filled rows (counted in the FLOPs).
    #[arg(long = "pp-depth", value_delimiter = ',', value_parser = parse_depth)]
    pub pp_depth: Vec<usize>,
    /// Timed repetitions after one warm-up run.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Output format: md | json | jsonl | csv.
    #[arg(short = 'o', long = "output", default_value = "md")]
    pub format: Format,
    /// Write the results to this file (atomically) instead of stdout.
    #[arg(long = "out")]
    pub out: Option<PathBuf>,
    /// Skip measuring the device ceilings (bandwidth, FMA rate) with `probe`.
    #[arg(long)]
    pub no_probe: bool,
}

/// cubecl keeps its autotune results under `<outermost Cargo workspace>/target/environment`
/// when run inside one, else in the user cache directory.
fn autotune_cache_warm() -> bool {
    let cwd = std::env::current_dir().unwrap_or_default();
    let root = cwd
        .ancestors()
        .filter(|d| d.join("Cargo.toml").exists())
        .last();
    let dir = match root {
        Some(r) => r.join("target").join("environment"),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
            .unwrap_or_default()
            .join("cubecl"),
    };
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

/// Stored tensor dtypes with counts, e.g. `Q4_1 ×211, F32 ×61` (dequantised on load).
fn stored_dtypes(ckpt: &ridgefill::io::checkpoint::Checkpoint) -> String {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for name in ckpt.tensor_names() {
        if let Ok(info) = ckpt.tensor_info(&name) {
            *counts.entry(info.dtype).or_default() += 1;
        }
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    v.iter()
        .map(|(d, n)| format!("{d} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The probe's device choice for a loaded backend.
fn probe_choice(backend: &str) -> DeviceChoice {
    match backend {
        "flex" => DeviceChoice::Cpu,
        "vulkan" => DeviceChoice::Vulkan,
        "metal" => DeviceChoice::Metal,
        "cuda" => DeviceChoice::Cuda,
        _ => DeviceChoice::Wgpu,
    }
}

fn ceilings(backend: &str, skip: bool) -> Option<(f64, f64, String)> {
    if skip {
        return None;
    }
    eprintln!("bench: probing {backend} ceilings");
    match ridgefill::model::probe::probe(probe_choice(backend), flex_threads()) {
        Ok(c) => Some((
            c.bandwidth_gbs,
            c.fma_gflops,
            format!("{} ({})", c.adapter, c.driver),
        )),
        Err(e) => {
            eprintln!("bench: no ceilings for {backend}: {e}");
            None
        }
    }
}

/// Row label of the fill mode: where the maps came from and how they are applied.
fn fill_label(fitted: bool, method: FillMethod) -> &'static str {
    match (fitted, method) {
        (true, FillMethod::Ridge) => "fitted ridge",
        (true, FillMethod::Spans) => "fitted spans",
        (true, FillMethod::SpansAdapt) => "fitted spans-adapt",
        (false, FillMethod::Ridge) => "own-proj ridge",
        (false, FillMethod::Spans) => "own-proj spans",
        (false, FillMethod::SpansAdapt) => "own-proj spans-adapt",
    }
}

/// Scale of the stand-in precision matrix `--split` uses: the same work as a fitted one.
const STAND_IN_PRECISION: f32 = 1e-4;

fn load_modes<'a>(
    a: &Args,
    loaded: &AnyModel,
    own: &'a mut Option<FillMaps>,
) -> Result<(Option<(&'a FillMaps, &'static str)>, FillRows)> {
    let choice = ridgefill::fillfile::MethodChoice {
        method: a.method,
        exact: a.exact,
        span: None,
        adapt_weight: None,
        sink: a.sink,
        tail: a.tail,
        // Bench prompts are random tokens: no question to find, and no self-check, which
        // random tokens would fail (the fill file's default would run them exactly).
        question: 0,
        sentence_reach: ridgefill::model::fill::DEFAULT_SENTENCE_REACH,
        max_error: Some(f64::INFINITY),
        max_span_error: Some(f64::INFINITY),
        retry_exact: 0.0,
        min_coverage: 0.0,
        resume_spans: a.resume_spans,
        // Random tokens ask nothing: a `ppN @ dD` fill row measures what a restore costs.
        resume_min_attention: 0.0,
        resume_layers: None,
        // Decode rows measure plain decode steps.
        decode_every: 0,
        decode_spans: 0,
        deeper: Vec::new(),
    };
    if let Some(path) = &a.fill {
        let Some(ckpt) = &loaded.ckpt else {
            bail!(
                "--fill needs a real checkpoint (a fill file is made for one); use --split with synthetic models"
            );
        };
        let (method, maps, rows) =
            ridgefill::fillfile::load_configured(path, ckpt, &loaded.model, &choice)?;
        *own = Some(maps);
        Ok((own.as_ref().map(|m| (m, fill_label(true, method))), rows))
    } else if let Some(split) = a.split {
        let model = &loaded.model;
        let f = model.config.hidden_size + 1;
        let eye: Vec<f32> = (0..f * f)
            .map(|i| {
                if i % (f + 1) == 0 {
                    STAND_IN_PRECISION
                } else {
                    0.0
                }
            })
            .collect();
        let maps = FillMaps::own_proj(model, split)?.with_adapt(
            &eye,
            DEFAULT_ADAPT_WEIGHT,
            model.dtype,
            &model.device,
        )?;
        let method = a.method.unwrap_or(FillMethod::DEFAULT);
        let rows = FillRows {
            sink: a.sink,
            tail: a.tail,
            exact: a.exact.unwrap_or(DEFAULT_EXACT),
            resume_spans: a.resume_spans,
            resume_min_attention: 0.0,
            ..FillRows::default()
        };
        let (maps, rows) = method.configure(&maps, rows)?;
        *own = Some(maps);
        Ok((own.as_ref().map(|m| (m, fill_label(false, method))), rows))
    } else {
        Ok((None, FillRows::default()))
    }
}

fn bench_device(a: &Args, choice: DeviceChoice, warm: bool) -> Result<Vec<Row>> {
    let max_p = a.n_prompt.iter().copied().max().unwrap_or(0);
    let max_pp_depth = a.pp_depth.iter().copied().max().unwrap_or(0);
    let capacity = (max_p + max_pp_depth).max(a.n_depth + a.n_gen).max(1) + 1;
    let loaded = load_any(&a.model.on(choice), capacity)?;
    let model = &loaded.model;
    let mut own = None;
    let (fill, rows) = load_modes(a, &loaded, &mut own)?;
    // Only worth a row where some layer above the split slides.
    let sliding_above =
        |m: &FillMaps| (m.split..model.num_layers()).any(|l| model.layers[l].window.is_some());
    let fill_unread = fill
        .filter(|(m, _)| sliding_above(m))
        .map(|(m, _)| m.filling_unread());
    let modes = Modes {
        fill,
        fill_unread,
        rows,
    };
    let backend = loaded.device.backend;
    let ceil = ceilings(backend, a.no_probe);
    let header = Header {
        model: a.model.model.clone(),
        model_type: model.config.model_type.clone(),
        n_layers: model.num_layers(),
        backend,
        device: loaded.device.adapter.clone(),
        dtype: dtype_name(a.model.dtype),
        weights_source: loaded.ckpt.as_ref().map_or_else(
            || format!("random, {} (synthetic)", model.weights_held()),
            stored_dtypes,
        ),
        weights_held: model.weights_held(),
        weight_bytes: model.weight_bytes(),
        kernels: model.kernel_level(),
        burn_version: env!("RIDGEFILL_BURN_VERSION"),
        ridgefill_version: env!("CARGO_PKG_VERSION"),
        n_threads: flex_threads(),
        autotune_cache_warm: warm,
        ceiling_bandwidth_gbs: ceil.as_ref().map(|c| c.0),
        ceiling_fma_gflops: ceil.as_ref().map(|c| c.1),
        ceiling_adapter: ceil.as_ref().map(|c| c.2.clone()),
        test_time: ridgefill::io::date::strftime_now("%Y-%m-%dT%H:%M:%SZ"),
    };
    let mut runner = Runner::new(model, capacity);
    let mut rows = Vec::new();
    // Single prompts first, then batches of them.
    let pp_batches = std::iter::once(1).chain(a.batch.iter().copied().filter(|&b| b > 1));
    for batch in pp_batches {
        for &n in a.n_prompt.iter().filter(|&&n| n > 0) {
            let kind = RowKind::Pp { n, depth: 0, batch };
            eprintln!("bench: {backend} {}", kind.label());
            let series = alternate(&modes, true, a.reps, |m| {
                runner.time_pp_batch(n, batch, m, modes.rows)
            })?;
            let flops = |m: Option<&FillMaps>| {
                let skip = m.map(|m| Skip {
                    split: m.split,
                    rows: modes.rows,
                    filled: true,
                    adapt: m.adapt.is_some(),
                    fill_unread: m.fill_unread,
                });
                prefill_flops(&model.config, n, skip) * batch as f64
            };
            rows.extend(make_rows(
                &header,
                &modes,
                &series,
                kind,
                |m| (flops(m), None),
                |n| model.kv_bytes(n) * batch,
            ));
        }
    }
    for &depth in &a.pp_depth {
        for &n in a.n_prompt.iter().filter(|&&n| n > 0) {
            let kind = RowKind::Pp { n, depth, batch: 1 };
            eprintln!("bench: {backend} {}", kind.label());
            // Earlier rows each fill repetition re-ran, by mode (fill or every row).
            let mut restored: Vec<(Option<bool>, usize)> = Vec::new();
            let series = alternate(&modes, true, a.reps, |m| {
                let (secs, r) = runner.time_pp_depth(depth, n, m, modes.rows)?;
                restored.push((m.map(|m| m.fill_unread), r));
                Ok(secs)
            })?;
            let flops = |m: Option<&FillMaps>| {
                let key = m.map(|m| m.fill_unread);
                let rs: Vec<usize> = restored
                    .iter()
                    .filter(|(k, _)| *k == key)
                    .map(|(_, r)| *r)
                    .collect();
                let mean = rs.iter().sum::<usize>() / rs.len().max(1);
                let split = m.map_or(0, |m| m.split);
                (
                    prefill_flops_at(&model.config, depth, n, (split, mean)),
                    None,
                )
            };
            rows.extend(make_rows(&header, &modes, &series, kind, flops, |n| {
                model.kv_bytes(n)
            }));
        }
    }
    for &batch in a.batch.iter().filter(|_| a.n_gen > 0) {
        eprintln!("bench: {backend} tg{} @ d{} x b{batch}", a.n_gen, a.n_depth);
        let series = alternate(&modes, false, a.reps, |m| {
            runner.time_tg_batch(a.n_depth, a.n_gen, batch, m, modes.rows)
        })?;
        // Mean context over the generated tokens.
        let ctx = a.n_depth.max(1) + a.n_gen / 2;
        // A batched step reads the weights once for every sequence: no single bytes figure.
        let per_token = (
            decode_flops(&model.config, ctx) * (a.n_gen * batch) as f64,
            (batch == 1).then(|| model.decode_read_bytes(ctx) as f64 * a.n_gen as f64),
        );
        rows.extend(make_rows(
            &header,
            &modes,
            &series,
            RowKind::Tg {
                n: a.n_gen,
                depth: a.n_depth.max(1),
                batch,
            },
            |_| per_token,
            |n| model.kv_bytes(n) * batch,
        ));
    }
    Ok(rows)
}

pub fn run(a: Args) -> Result<()> {
    if a.reps == 0 {
        bail!("-r must be at least 1");
    }
    if a.n_prompt.iter().all(|&n| n == 0) && a.n_gen == 0 {
        bail!("nothing to measure: give a prompt length (-p) or a generation length (-n)");
    }
    if a.fill.is_some() || a.split.is_some() {
        let shortest = a.n_prompt.iter().copied().filter(|&n| n > 0).min();
        if let Some(n) = shortest
            && a.sink + a.tail >= n
        {
            eprintln!(
                "bench: warning: pp{n} has no bulk rows with sink {} + tail {}: fill equals full there",
                a.sink, a.tail
            );
        }
    }
    if a.fill.is_some() && a.model.model.starts_with("synthetic:") {
        bail!(
            "--fill needs a real checkpoint (a fill file is made for one); use --split with synthetic models"
        );
    }
    let warm = autotune_cache_warm();
    let mut rows = Vec::new();
    for &choice in &a.model.device.device {
        rows.extend(bench_device(&a, choice, warm)?);
    }
    let text = render(&rows, a.format)?;
    match &a.out {
        Some(p) => ridgefill::io::atomic::write_bytes(p, text.as_bytes())?,
        None => print!("{text}"),
    }
    Ok(())
}

fn parse_batch(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(b) if b >= 1 => Ok(b),
        _ => Err(format!("expected a batch size of at least 1, found {s:?}")),
    }
}

fn parse_depth(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(d) if d >= 1 => Ok(d),
        Ok(_) => Err("a depth of 0 is the plain ppN row: leave it out of --pp-depth".into()),
        _ => Err(format!("expected a cached depth in tokens, found {s:?}")),
    }
}
