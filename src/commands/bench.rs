//! `ridgefill bench`: prefill and decode speed in the manner of llama-bench, full and skip-and-fill
//! side by side on every requested device.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ridgefill::model::eval::{Skip, decode_flops, prefill_flops};
use ridgefill::model::fill::{DEFAULT_ADAPT_WEIGHT, DEFAULT_EXACT, FillMaps, FillMethod, FillRows};
use ridgefill::model::{
    DeviceChoice, FloatDType, KvCache, Llama, WeightFormat, sample, to_host_f32,
};
use ridgefill::session::{LoadArgs, Loaded, dtype_name, load};

use serde::Serialize;

use super::common::parse_dtype;

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file, a Hugging Face directory, a manifest name (fetched when missing), or
    /// `synthetic:smollm2-135m` / `synthetic:llama-1b` (random weights of that shape).
    #[arg(short = 'm', long = "model", default_value = ridgefill::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Devices to run on, comma-separated: auto, cpu, wgpu, vulkan, metal, cuda.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    pub device: Vec<DeviceChoice>,
    /// Weight and activation dtype: f32 | f16 | bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: FloatDType,
    /// How GGUF weights are held: native (their block formats, read by the quantised CPU
    /// kernels or packed for the GPU kernel) | f16 | q8 | f32 (dequantised at load).
    #[arg(long, default_value = "native", value_parser = super::common::parse_weights)]
    pub weights: WeightFormat,
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
    #[arg(long, value_parser = super::generate::parse_method)]
    pub method: Option<FillMethod>,
    /// Share of the prompt's rows run exactly in query-chosen spans (default: the fill file's).
    #[arg(long, value_parser = super::generate::parse_share)]
    pub exact: Option<f64>,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Md,
    Json,
    Jsonl,
    Csv,
}

/// Seed for the random prompt ids; every run draws new ids so nothing is cached by accident.
const PROMPT_SEED: u64 = 1234;
/// Token ids below this are control and special tokens in Llama-family vocabularies.
const FIRST_PLAIN_ID: u32 = 100;
const NS_PER_S: f64 = 1e9;
const MS_PER_S: f64 = 1e3;

/// What every row shares: where and how it ran.
#[derive(Clone, Debug, Serialize)]
struct Header {
    model: String,
    model_type: String,
    n_layers: usize,
    backend: &'static str,
    device: String,
    dtype: &'static str,
    /// Tensor types stored in the checkpoint.
    weights_source: String,
    /// How the projections are held while running: GGUF blocks or dense tensors.
    weights_held: String,
    /// Bytes the weights keep resident.
    weight_bytes: usize,
    /// Instruction-set level of the quantised CPU kernels, when weights are held in blocks.
    kernels: Option<&'static str>,
    burn_version: &'static str,
    ridgefill_version: &'static str,
    n_threads: usize,
    /// Whether cubecl's on-disk autotune cache held entries before this run (GPU backends).
    autotune_cache_warm: bool,
    /// Measured with `ridgefill probe` on the same device (on CPU: lavapipe on the same cores).
    ceiling_bandwidth_gbs: Option<f64>,
    ceiling_fma_gflops: Option<f64>,
    ceiling_adapter: Option<String>,
    test_time: String,
}

#[derive(Clone, Debug, Serialize)]
struct Row {
    #[serde(flatten)]
    header: Header,
    test: String,
    /// `full`, `fill`, or `fill-all-rows` (sliding-window layers filled in unread rows too).
    mode: &'static str,
    split: Option<usize>,
    fill_maps: Option<&'static str>,
    n_sink: Option<usize>,
    n_tail: Option<usize>,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    n_reps: usize,
    /// K/V cache bytes the row's positions fill.
    kv_bytes: usize,
    avg_ns: f64,
    stddev_ns: f64,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ns: Vec<u64>,
    samples_ts: Vec<f64>,
    /// pp rows: time to first token (prefill through the sampled id on the host).
    ttft_ms: Option<f64>,
    /// fill rows: mean of per-repetition t/s ratios, fill over full, runs alternating.
    speedup_vs_full: Option<f64>,
    speedup_stddev: Option<f64>,
    /// Achieved model FLOP/s and the share of the FMA ceiling.
    gflops: f64,
    pct_fma_ceiling: Option<f64>,
    /// tg rows: bytes a decode step must read per second, and the share of the bandwidth ceiling.
    gbs: Option<f64>,
    pct_bandwidth_ceiling: Option<f64>,
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// One measured mode of one test: seconds per run.
struct Series {
    secs: Vec<f64>,
}

/// The modes compared on a device.
struct Modes<'a> {
    fill: Option<(&'a FillMaps, &'static str)>,
    /// The same maps filling sliding-window layers' unread rows too, when the model has such
    /// layers above the split: prefill rows show what leaving them out saves.
    fill_unread: Option<FillMaps>,
    rows: FillRows,
}

impl Modes<'_> {
    /// Full, then fill, then (for prefill tests) fill of every row.
    fn list(&self, prefill: bool) -> Vec<Option<&FillMaps>> {
        let mut v = vec![None];
        if let Some((m, _)) = self.fill {
            v.push(Some(m));
        }
        if let (true, Some(m)) = (prefill, &self.fill_unread) {
            v.push(Some(m));
        }
        v
    }
}

struct Runner<'a> {
    model: &'a Llama,
    rng: StdRng,
    cache: KvCache,
}

impl Runner<'_> {
    fn ids(&mut self, n: usize) -> Vec<u32> {
        let vocab = self.model.config.vocab_size as u32;
        (0..n)
            .map(|_| self.rng.random_range(FIRST_PLAIN_ID.min(vocab - 1)..vocab))
            .collect()
    }

    /// Prefills `ids` into the (reset) cache by `maps`' mode; returns the first token, on the host.
    fn prefill(&mut self, ids: &[u32], maps: Option<&FillMaps>, rows: FillRows) -> Result<u32> {
        self.cache.reset();
        let logits = match maps {
            None => self.model.prefill(ids, &mut self.cache)?,
            Some(m) => self.model.prefill_fill(ids, &mut self.cache, m, rows)?,
        };
        Ok(sample::argmax(&to_host_f32(logits)))
    }

    /// Seconds from prompt ids to the first sampled token.
    fn time_pp(&mut self, n: usize, maps: Option<&FillMaps>, rows: FillRows) -> Result<f64> {
        let ids = self.ids(n);
        let t = Instant::now();
        self.prefill(&ids, maps, rows)?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds from `batch` prompts of `n` ids to all their first tokens: full prefill as one
    /// batch (every weight pass shared), skip-and-fill prompt after prompt; one prompt as
    /// [`Runner::time_pp`].
    fn time_pp_batch(
        &mut self,
        n: usize,
        batch: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<f64> {
        if batch == 1 {
            return self.time_pp(n, maps, rows);
        }
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| self.ids(n)).collect();
        let mut caches: Vec<KvCache> = (0..batch).map(|_| self.model.new_cache(n)).collect();
        let t = Instant::now();
        let first: Vec<u32> = match maps {
            None => {
                let ps: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
                let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                let logits = to_host_f32(self.model.prefill_batch(&ps, &mut refs)?);
                logits
                    .chunks_exact(self.model.config.vocab_size)
                    .map(sample::argmax)
                    .collect()
            }
            Some(m) => prompts
                .iter()
                .zip(&mut caches)
                .map(|(p, c)| {
                    let l = self.model.prefill_fill(p, c, m, rows)?;
                    Ok(sample::argmax(&to_host_f32(l)))
                })
                .collect::<Result<_>>()?,
        };
        let secs = t.elapsed().as_secs_f64();
        debug_assert_eq!(first.len(), batch);
        Ok(secs)
    }

    /// Seconds for `n_gen` batched greedy decode steps of `batch` sequences, each after an
    /// untimed prefill of its own `depth` tokens.
    fn time_tg_batch(
        &mut self,
        depth: usize,
        n_gen: usize,
        batch: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<f64> {
        if batch == 1 {
            return self.time_tg(depth, n_gen, maps, rows);
        }
        let mut caches = Vec::with_capacity(batch);
        let mut next = Vec::with_capacity(batch);
        for _ in 0..batch {
            let ids = self.ids(depth.max(1));
            next.push(self.prefill(&ids, maps, rows)?);
            caches.push(std::mem::replace(
                &mut self.cache,
                self.model.new_cache(depth.max(1) + n_gen),
            ));
        }
        let vocab = self.model.config.vocab_size;
        let t = Instant::now();
        for _ in 0..n_gen {
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let logits = to_host_f32(self.model.decode_batch(&next, &mut refs)?);
            for (i, n) in next.iter_mut().enumerate() {
                *n = sample::argmax(&logits[i * vocab..(i + 1) * vocab]);
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds for `n_gen` greedy decode steps after an untimed prefill of `depth` tokens.
    fn time_tg(
        &mut self,
        depth: usize,
        n_gen: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<f64> {
        let ids = self.ids(depth.max(1));
        let mut next = self.prefill(&ids, maps, rows)?;
        let t = Instant::now();
        for _ in 0..n_gen {
            next = sample::argmax(&to_host_f32(self.model.decode_step(next, &mut self.cache)?));
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Runs `run` for every mode, alternating the order each repetition so drift hits both alike.
fn alternate(
    modes: &Modes,
    prefill: bool,
    reps: usize,
    mut run: impl FnMut(Option<&FillMaps>) -> Result<f64>,
) -> Result<Vec<Series>> {
    let list = modes.list(prefill);
    for m in &list {
        run(*m)?; // warm-up: kernels compiled and autotuned, buffers allocated
    }
    let mut out: Vec<Series> = list.iter().map(|_| Series { secs: Vec::new() }).collect();
    for rep in 0..reps {
        ridgefill::interrupt::check()?;
        let order: Vec<usize> = if rep % 2 == 0 {
            (0..list.len()).collect()
        } else {
            (0..list.len()).rev().collect()
        };
        for i in order {
            out[i].secs.push(run(list[i])?);
        }
    }
    Ok(out)
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

pub fn flex_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
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

/// A model on a device: a real checkpoint, or `synthetic:SHAPE` (seeded random weights).
pub struct Bench {
    pub model: Llama,
    pub device: ridgefill::model::DeviceInfo,
    pub ckpt: Option<ridgefill::io::checkpoint::Checkpoint>,
}

/// Seed of the synthetic models' weights: every device and run gets the same model.
pub const SYNTHETIC_SEED: u64 = 42;

/// Loads `model` (a checkpoint or `synthetic:SHAPE`) onto `choice` with `capacity` positions.
pub fn load_any(
    model: &str,
    choice: DeviceChoice,
    dtype: FloatDType,
    weights: WeightFormat,
    capacity: usize,
) -> Result<Bench> {
    if let Some(shape) = model.strip_prefix("synthetic:") {
        let config = ridgefill::model::synthetic::shape(shape)?;
        let device = ridgefill::model::select_device(choice)?;
        eprintln!("bench: building synthetic {shape} on {}", device.backend);
        let model = Llama::random_with(
            config,
            &device.device,
            dtype,
            weights,
            capacity,
            SYNTHETIC_SEED,
        )?;
        return Ok(Bench {
            model,
            device,
            ckpt: None,
        });
    }
    let Loaded {
        ckpt,
        model,
        device,
        ..
    } = load(
        &LoadArgs {
            model: model.to_string(),
            device: choice,
            dtype,
            weights,
        },
        capacity,
    )?;
    Ok(Bench {
        model,
        device,
        ckpt: Some(ckpt),
    })
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
    loaded: &Bench,
    own: &'a mut Option<FillMaps>,
) -> Result<(Option<(&'a FillMaps, &'static str)>, FillRows)> {
    let choice = ridgefill::fillfile::MethodChoice {
        method: a.method,
        exact: a.exact,
        span: None,
        adapt_weight: None,
        sink: a.sink,
        tail: a.tail,
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
        let maps = model.own_proj_maps(split)?.with_adapt(
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
    let capacity = max_p.max(a.n_depth + a.n_gen).max(1) + 1;
    let loaded = load_any(&a.model, choice, a.dtype, a.weights, capacity)?;
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
        model: a.model.clone(),
        model_type: model.config.model_type.clone(),
        n_layers: model.num_layers(),
        backend,
        device: loaded.device.adapter.clone(),
        dtype: dtype_name(a.dtype),
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
        test_time: utc_now(),
    };
    let mut runner = Runner {
        model,
        rng: StdRng::seed_from_u64(PROMPT_SEED),
        cache: model.new_cache(capacity),
    };
    let mut rows = Vec::new();
    // Single prompts first, then batches of them.
    let pp_batches = std::iter::once(1).chain(a.batch.iter().copied().filter(|&b| b > 1));
    for batch in pp_batches {
        for &n in a.n_prompt.iter().filter(|&&n| n > 0) {
            let kind = RowKind::Pp { n, batch };
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

#[derive(Clone, Copy)]
enum RowKind {
    Pp {
        n: usize,
        batch: usize,
    },
    Tg {
        n: usize,
        depth: usize,
        batch: usize,
    },
}

impl RowKind {
    /// The row's `test` column, llama-bench style.
    fn label(&self) -> String {
        match *self {
            RowKind::Pp { n, batch: 1 } => format!("pp{n}"),
            RowKind::Pp { n, batch } => format!("pp{n} x b{batch}"),
            RowKind::Tg { n, depth, batch: 1 } => format!("tg{n} @ d{depth}"),
            RowKind::Tg { n, depth, batch } => format!("tg{n} @ d{depth} x b{batch}"),
        }
    }
}

/// Turns the per-mode series into rows; `work(mode)` = (FLOPs, bytes) of one run.
fn make_rows(
    header: &Header,
    modes: &Modes,
    series: &[Series],
    kind: RowKind,
    work: impl Fn(Option<&FillMaps>) -> (f64, Option<f64>),
    header_kv: impl Fn(usize) -> usize,
) -> Vec<Row> {
    let test = kind.label();
    let (n_prompt, n_gen, n_depth, tokens) = match kind {
        // Aggregate tokens of every sequence in the batch.
        RowKind::Pp { n, batch } => (n, 0, 0, n * batch),
        RowKind::Tg { n, depth, batch } => (0, n, depth, n * batch),
    };
    let full_ts: Vec<f64> = series[0].secs.iter().map(|s| tokens as f64 / s).collect();
    modes
        .list(matches!(kind, RowKind::Pp { .. }))
        .into_iter()
        .zip(series)
        .map(|(m, s)| {
            let samples_ts: Vec<f64> = s.secs.iter().map(|x| tokens as f64 / x).collect();
            let ns: Vec<f64> = s.secs.iter().map(|x| x * NS_PER_S).collect();
            let (avg_ns, stddev_ns) = mean_std(&ns);
            let (avg_ts, stddev_ts) = mean_std(&samples_ts);
            let (speedup_vs_full, speedup_stddev) = match m {
                Some(_) => {
                    let r: Vec<f64> = samples_ts
                        .iter()
                        .zip(&full_ts)
                        .map(|(f, b)| f / b)
                        .collect();
                    let (mu, sd) = mean_std(&r);
                    (Some(mu), Some(sd))
                }
                None => (None, None),
            };
            let (flops, bytes) = work(m);
            let secs = avg_ns / NS_PER_S;
            let gflops = flops / secs / 1e9;
            let gbs = bytes.map(|b| b / secs / 1e9);
            let fill_maps = m.and(modes.fill.map(|(_, kind)| kind));
            Row {
                header: header.clone(),
                test: test.clone(),
                mode: match m {
                    None => "full",
                    Some(m) if m.fill_unread => "fill-all-rows",
                    Some(_) => "fill",
                },
                split: m.map(|m| m.split),
                fill_maps,
                n_sink: m.map(|_| modes.rows.sink),
                n_tail: m.map(|_| modes.rows.tail),
                n_prompt,
                n_gen,
                n_depth,
                n_reps: s.secs.len(),
                kv_bytes: header_kv(n_prompt.max(n_depth + n_gen)),
                avg_ns,
                stddev_ns,
                avg_ts,
                stddev_ts,
                samples_ns: ns.iter().map(|&x| x.round() as u64).collect(),
                samples_ts,
                ttft_ms: matches!(kind, RowKind::Pp { .. }).then_some(avg_ns / NS_PER_S * MS_PER_S),
                speedup_vs_full,
                speedup_stddev,
                gflops,
                pct_fma_ceiling: header.ceiling_fma_gflops.map(|c| 100.0 * gflops / c),
                gbs,
                pct_bandwidth_ceiling: gbs
                    .zip(header.ceiling_bandwidth_gbs)
                    .map(|(g, c)| 100.0 * g / c),
            }
        })
        .collect()
}

fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn render_md(rows: &[Row]) -> String {
    let mut s = String::new();
    let mut last_device = None;
    for r in rows {
        let h = &r.header;
        let key = (h.backend, h.device.clone());
        if last_device.as_ref() != Some(&key) {
            if last_device.is_some() {
                s.push('\n');
            }
            s.push_str(&format!(
                "model: {} ({}, {} layers, {}), weights held as {} ({:.1} MB{}), backend: {}, \
                 device: {}, dtype: {}, threads: {}, burn {}, autotune cache warm: {}\n",
                h.model,
                h.model_type,
                h.n_layers,
                h.weights_source,
                h.weights_held,
                h.weight_bytes as f64 / 1e6,
                h.kernels
                    .map_or(String::new(), |k| format!(", {k} kernels")),
                h.backend,
                h.device,
                h.dtype,
                h.n_threads,
                h.burn_version,
                h.autotune_cache_warm
            ));
            match (
                h.ceiling_bandwidth_gbs,
                h.ceiling_fma_gflops,
                &h.ceiling_adapter,
            ) {
                (Some(bw), Some(f), Some(ad)) => s.push_str(&format!(
                    "ceilings (probe on {ad}): {bw:.1} GB/s, {f:.1} GFLOP/s f32 FMA\n"
                )),
                _ => s.push_str("ceilings: not measured\n"),
            }
            s.push_str(
                "\n| backend | mode | test | t/s | TTFT ms | vs full | GFLOP/s | GB/s | % ceiling | KV MB |\n\
                 |---|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
            );
            last_device = Some(key);
        }
        let mode = match (r.mode, r.split) {
            ("fill", Some(sp)) => format!("fill s={sp}"),
            ("fill-all-rows", Some(sp)) => format!("fill s={sp}, every row"),
            (m, _) => m.to_string(),
        };
        let ttft = r.ttft_ms.map_or("".into(), |t| format!("{t:.1}"));
        let speed = match (r.speedup_vs_full, r.speedup_stddev) {
            (Some(m), Some(sd)) => format!("{m:.2}× ± {sd:.2}"),
            _ => String::new(),
        };
        let gbs = r.gbs.map_or(String::new(), |g| format!("{g:.1}"));
        let pct = r
            .pct_bandwidth_ceiling
            .or(r.pct_fma_ceiling)
            .map_or(String::new(), |p| format!("{p:.0}%"));
        s.push_str(&format!(
            "| {} | {mode} | {} | {:.2} ± {:.2} | {ttft} | {speed} | {:.1} | {gbs} | {pct} | {:.1} |\n",
            r.header.backend,
            r.test,
            r.avg_ts,
            r.stddev_ts,
            r.gflops,
            r.kv_bytes as f64 / 1e6
        ));
    }
    s
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn render_csv(rows: &[Row]) -> Result<String> {
    let mut lines = Vec::new();
    let mut keys: Vec<String> = Vec::new();
    for r in rows {
        let v = serde_json::to_value(r)?;
        let obj = v.as_object().context("row serialises to an object")?;
        if keys.is_empty() {
            keys = obj.keys().cloned().collect();
            lines.push(keys.join(","));
        }
        let cells: Vec<String> = keys
            .iter()
            .map(|k| match &obj[k] {
                serde_json::Value::Null => String::new(),
                serde_json::Value::String(s) => csv_field(s),
                serde_json::Value::Array(xs) => csv_field(
                    &xs.iter()
                        .map(|x| x.to_string())
                        .collect::<Vec<_>>()
                        .join(" "),
                ),
                other => other.to_string(),
            })
            .collect();
        lines.push(cells.join(","));
    }
    Ok(lines.join("\n") + "\n")
}

fn render(rows: &[Row], format: Format) -> Result<String> {
    Ok(match format {
        Format::Md => render_md(rows),
        Format::Json => serde_json::to_string_pretty(rows)? + "\n",
        Format::Jsonl => {
            rows.iter()
                .map(serde_json::to_string)
                .collect::<std::result::Result<Vec<_>, _>>()?
                .join("\n")
                + "\n"
        }
        Format::Csv => render_csv(rows)?,
    })
}

/// Writes next to `path` and renames, so a reader never sees half a file.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("{}: cannot create a temporary file", dir.display()))?;
    tmp.write_all(text.as_bytes())
        .and_then(|()| tmp.as_file().sync_all())
        .with_context(|| format!("{}: cannot write", path.display()))?;
    tmp.persist(path)
        .with_context(|| format!("{}: cannot rename into place", path.display()))?;
    Ok(())
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
    if a.fill.is_some() && a.model.starts_with("synthetic:") {
        bail!(
            "--fill needs a real checkpoint (a fill file is made for one); use --split with synthetic models"
        );
    }
    let warm = autotune_cache_warm();
    let mut rows = Vec::new();
    for &choice in &a.device {
        rows.extend(bench_device(&a, choice, warm)?);
    }
    let text = render(&rows, a.format)?;
    match &a.out {
        Some(p) => write_atomic(p, &text)?,
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
