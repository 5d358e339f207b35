//! What more than one command shares: the model, device, row and sampling flags, their parsers,
//! checks on text and logits, progress bars, and loading (synthetic models included). No command
//! imports another command; they all import this.

use anyhow::Result;
use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::fill::{FillMethod, FillRows};
use ridgefill::model::{
    Decoder, DeviceChoice, DeviceInfo, FloatDType, SamplerConfig, WeightFormat,
};
use ridgefill::session::{LoadArgs, Loaded};

pub use ridgefill::session::load;

/// `--weights` help, the same in every command that takes it (no final period, as clap shows
/// doc comments).
pub const WEIGHTS_HELP: &str = "How GGUF weights are held: native (their block formats, read by \
the quantised CPU kernels or packed for the GPU kernel) | f16 | q8 (Q8_0 at load, e.g. for Hugging \
Face checkpoints) | f32 (dequantised at load)";

/// The flags that choose a model and how it runs. `D` is the `--device` flag: one device
/// ([`OneDevice`], every command but `bench`) or a comma-separated list ([`DeviceList`]).
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs<D: clap::Args = OneDevice> {
    /// A .gguf file, a Hugging Face directory, or a manifest name (fetched when missing).
    #[arg(short = 'm', long = "model", default_value = ridgefill::fetch::DEFAULT_MODEL)]
    pub model: String,
    #[command(flatten)]
    pub device: D,
    /// Weight and activation dtype: f32 | f16 | bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: FloatDType,
    #[arg(long, default_value = "native", value_parser = parse_weights, help = WEIGHTS_HELP)]
    pub weights: WeightFormat,
}

/// `--device`: one device.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct OneDevice {
    /// auto | cpu | wgpu | vulkan | metal | cuda. `auto` takes a real GPU, else the CPU.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
}

/// `--device`: several devices, run one after another.
#[derive(clap::Args, Clone, Debug)]
pub struct DeviceList {
    /// Devices to run on, comma-separated: auto, cpu, wgpu, vulkan, metal, cuda.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    pub device: Vec<DeviceChoice>,
}

impl<D: clap::Args> ModelArgs<D> {
    /// What to load, onto `device`.
    pub fn on(&self, device: DeviceChoice) -> LoadArgs {
        LoadArgs {
            model: self.model.clone(),
            device,
            dtype: self.dtype,
            weights: self.weights,
        }
    }
}

impl ModelArgs {
    /// What to load, onto the one `--device`.
    pub fn load_args(&self) -> LoadArgs {
        self.on(self.device.device)
    }
}

pub fn parse_weights(s: &str) -> std::result::Result<WeightFormat, String> {
    WeightFormat::parse(s)
        .ok_or_else(|| format!("unknown weight format {s:?} (expected native, f16, q8 or f32)"))
}

pub fn parse_dtype(s: &str) -> std::result::Result<FloatDType, String> {
    match s {
        "f32" => Ok(FloatDType::F32),
        "f16" => Ok(FloatDType::F16),
        "bf16" => Ok(FloatDType::BF16),
        other => Err(format!(
            "unknown dtype {other:?} (expected f32, f16 or bf16)"
        )),
    }
}

/// How tokens are sampled (llama.cpp's flags and defaults).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// RNG seed.
    #[arg(short = 's', long = "seed", default_value_t = 42)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        }
    }
}

/// Which prompt rows run every layer under skip-and-fill, and how the fill file is applied.
#[derive(clap::Args, Clone, Debug)]
pub struct RowArgs {
    /// Last prompt tokens computed exactly (skip-and-fill).
    #[arg(long, default_value_t = 16)]
    pub tail: usize,
    /// First prompt tokens computed exactly: the attention sink (skip-and-fill).
    #[arg(long, default_value_t = 1)]
    pub sink: usize,
    /// How the fill runs: `ridge` (maps only), `spans` (plus query-chosen exact spans),
    /// `spans-adapt` (plus the per-prompt map update); default: what the fill file records.
    #[arg(long, value_parser = parse_method)]
    pub method: Option<FillMethod>,
    /// Share of the prompt's rows run exactly in query-chosen spans (default: the fill file's).
    #[arg(long, value_parser = parse_share)]
    pub exact: Option<f64>,
    /// Half-width in tokens of each exact span (default: the fill file's).
    #[arg(long)]
    pub span: Option<usize>,
    /// Weight of one exact row against one calibration row in the per-prompt update.
    #[arg(long, value_parser = parse_weight)]
    pub adapt_weight: Option<f64>,
    /// Longest exact tail grown back to the prompt's last line break, so the final question
    /// runs every layer whole (0: the tail stays --tail tokens).
    #[arg(long, default_value_t = ridgefill::model::fill::DEFAULT_QUESTION_TAIL)]
    pub question_tail: usize,
    /// How far, in span radii, an exact span may run past its window to its sentence's end, so
    /// a long answer (a UUID) is copied from exact rows whole (0: spans keep their width).
    #[arg(long, default_value_t = ridgefill::model::fill::DEFAULT_SENTENCE_REACH)]
    pub sentence_reach: usize,
    /// Self-check: when the fill maps' relative error on the prompt's exact rows exceeds this,
    /// the prompt runs every layer exactly after all (full prefill's answer, at full cost);
    /// `off` never falls back (either reading). Default: 2.35 × the maps' held-out error (0.656
    /// at split 15).
    #[arg(long, value_parser = parse_max_error)]
    pub max_fill_error: Option<f64>,
    /// The self-check's second reading: the same error over the exact spans alone (a haystack
    /// the maps miss, around a question they fit); above this the prompt runs exactly too.
    /// `off`: only the first reading. Default: 2.5 × the maps' held-out error (0.698 at split 15).
    #[arg(long, value_parser = parse_max_error)]
    pub max_span_error: Option<f64>,
    /// After a failed self-check (no deeper file left), fill the prompt again with this share
    /// of its rows in exact spans instead of running every layer exactly; `off`: every layer.
    #[arg(long, value_parser = parse_retry, default_value_t = ridgefill::model::fill::DEFAULT_RETRY_EXACT)]
    pub retry_exact: f64,
    /// Fill files at deeper splits of the same model, comma-separated, tried in turn when the
    /// self-check fails: the prompt runs exactly up to their split instead of every layer.
    #[arg(long, value_delimiter = ',')]
    pub fill_deeper: Vec<std::path::PathBuf>,
    /// Coverage check: a prompt whose exact spans take less than this share (0 to 1) of the
    /// question's attention to the filled rows goes to --fill-deeper's split before its upper
    /// layers run; 0 never. Default 0.5 (it applies only with --fill-deeper).
    #[arg(long, value_parser = parse_share, requires = "fill_deeper")]
    pub min_coverage: Option<f64>,
    /// Spans a follow-up turn over a cached prefix re-runs exactly among the rows earlier turns
    /// filled, where its question points (0: none; the turn then costs what full prefill's
    /// does, and earlier facts are read from filled K/V).
    #[arg(long, default_value_t = ridgefill::model::fill::RESUME_MIN_SPANS)]
    pub resume_spans: usize,
    /// A follow-up restores its spans only when the earlier turns' filled rows take at least
    /// this share (0 to 1) of its question's attention (0: always restore).
    #[arg(long, value_parser = parse_share, default_value_t = ridgefill::model::fill::RESUME_MIN_ATTENTION)]
    pub resume_min_attention: f64,
    /// Upper layers, from the split, that a follow-up's restored rows run exactly (their K/V
    /// above stay predicted until settling); default: every upper layer.
    #[arg(long, value_parser = parse_layers)]
    pub resume_layers: Option<usize>,
    /// While an answer is decoded over a filled cache, every this many generated tokens run
    /// again as a prefill over the cache whose attention restores the filled rows they read
    /// (0: never; the answer reads the cache as the prefill left it).
    #[arg(long, default_value_t = ridgefill::model::fill::DEFAULT_DECODE_EVERY)]
    pub restore_every: usize,
    /// Spans each of those restores runs exactly.
    #[arg(long, default_value_t = ridgefill::model::fill::DEFAULT_DECODE_SPANS)]
    pub restore_spans: usize,
}

impl RowArgs {
    /// The rows of plain ridge fill (no fill file's method involved).
    pub fn rows(&self) -> FillRows {
        FillRows {
            sink: self.sink,
            tail: self.tail,
            ..Default::default()
        }
    }

    /// The run-time choices, for [`ridgefill::fillfile::configure`].
    pub fn choice(&self) -> ridgefill::fillfile::MethodChoice {
        ridgefill::fillfile::MethodChoice {
            method: self.method,
            exact: self.exact,
            span: self.span,
            adapt_weight: self.adapt_weight,
            sink: self.sink,
            tail: self.tail,
            question: self.question_tail,
            sentence_reach: self.sentence_reach,
            max_error: self.max_fill_error,
            max_span_error: self.max_span_error,
            retry_exact: self.retry_exact,
            min_coverage: self
                .min_coverage
                .unwrap_or(ridgefill::model::fill::DEFAULT_MIN_COVERAGE),
            resume_spans: self.resume_spans,
            resume_min_attention: self.resume_min_attention,
            resume_layers: self.resume_layers,
            decode_every: self.restore_every,
            decode_spans: self.restore_spans,
            deeper: self.fill_deeper.clone(),
        }
    }
}

pub fn parse_method(s: &str) -> std::result::Result<FillMethod, String> {
    FillMethod::parse(s).ok_or_else(|| format!("expected ridge, spans or spans-adapt, found {s:?}"))
}

pub fn parse_share(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("expected a share between 0 and 1, found {s:?}")),
    }
}

/// A retry's share of exact rows, or `off` (0: every layer exactly).
fn parse_retry(s: &str) -> std::result::Result<f64, String> {
    match s {
        "off" => Ok(0.0),
        _ => parse_share(s)
            .map_err(|_| format!("expected a share between 0 and 1 or off, found {s:?}")),
    }
}

/// A count of layers: at least one.
fn parse_layers(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("expected a positive number of layers, found {s:?}")),
    }
}

/// A self-check threshold: a positive number, or `off` (never fall back).
fn parse_max_error(s: &str) -> std::result::Result<f64, String> {
    match s {
        "off" => Ok(f64::INFINITY),
        _ => parse_weight(s).map_err(|_| format!("expected a positive number or off, found {s:?}")),
    }
}

fn parse_weight(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("expected a positive number, found {s:?}")),
    }
}

/// Reads a UTF-8 text file: non-UTF-8 is an error naming the byte offset, unless `lossy`.
pub fn read_text(path: &std::path::Path, lossy: bool) -> Result<String> {
    Ok(ridgefill::io::text::read_text_file(path, lossy)?)
}

/// A model output that cannot be sampled from.
#[derive(Debug, thiserror::Error)]
#[error(
    "non-finite logit ({value}) for token id {token} at position {position}: the model's \
     activations overflowed"
)]
pub struct NonFiniteLogits {
    pub position: usize,
    pub token: usize,
    pub value: f32,
}

/// Errors unless every logit is finite; `position` is the sequence position they predict from.
pub fn check_logits(logits: &[f32], position: usize) -> Result<(), NonFiniteLogits> {
    match logits.iter().position(|x| !x.is_finite()) {
        Some(token) => Err(NonFiniteLogits {
            position,
            token,
            value: logits[token],
        }),
        None => Ok(()),
    }
}

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

/// Threads of the CPU backend: `RAYON_NUM_THREADS`, else every core.
pub fn flex_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A model on a device: a real checkpoint, or `synthetic:SHAPE` (seeded random weights).
pub struct AnyModel {
    pub model: Decoder,
    pub device: DeviceInfo,
    pub ckpt: Option<Checkpoint>,
}

/// Seed of the synthetic models' weights: every device and run gets the same model.
pub const SYNTHETIC_SEED: u64 = 42;

/// Loads `args.model` (a checkpoint or `synthetic:SHAPE`) with `capacity` positions.
pub fn load_any(args: &LoadArgs, capacity: usize) -> Result<AnyModel> {
    if let Some(shape) = args.model.strip_prefix("synthetic:") {
        let config = ridgefill::model::synthetic::shape(shape)?;
        let device = ridgefill::model::select_device(args.device)?;
        eprintln!("bench: building synthetic {shape} on {}", device.backend);
        let model = Decoder::random_with(
            config,
            &device.device,
            args.dtype,
            args.weights,
            capacity,
            SYNTHETIC_SEED,
        )?;
        return Ok(AnyModel {
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
    } = load(args, capacity)?;
    Ok(AnyModel {
        model,
        device,
        ckpt: Some(ckpt),
    })
}

/// How long `serve` and `chat` stay idle (no request, no input) before they settle filled rows:
/// a client that sends the next turn as soon as a reply ends (a script, an agent loop) then
/// finds the engine free instead of one settle batch in (~30-40 ms a batch on 2 cores), while a
/// person's pause of seconds loses nothing to it.
pub const SETTLE_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// Prompt tokens a prefill may take from a cache holding `cached` (tokens in order): their
/// longest common prefix, less the prompt's last `min_rows` rows
/// ([`Decoder::reuse_min_rows`](ridgefill::model::Decoder::reuse_min_rows)), which run as a
/// cold prefill runs them. Shared by `chat`, `serve` and `eval --task passkey-turns`.
pub fn reusable_prefix(cached: &[u32], prompt: &[u32], min_rows: usize) -> usize {
    let common = cached
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    common.min(prompt.len().saturating_sub(min_rows))
}
