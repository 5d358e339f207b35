//! The rows `bench` reports and how they are written: markdown, JSON, JSON lines or CSV.

use anyhow::{Context, Result};
use ridgefill::model::fill::FillMaps;
use serde::Serialize;

use super::runner::{Modes, Series};

/// `-o`: how the rows are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Md,
    Json,
    Jsonl,
    Csv,
}

const NS_PER_S: f64 = 1e9;
const MS_PER_S: f64 = 1e3;

/// What every row shares: where and how it ran.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Header {
    pub(super) model: String,
    pub(super) model_type: String,
    pub(super) n_layers: usize,
    pub(super) backend: &'static str,
    pub(super) device: String,
    pub(super) dtype: &'static str,
    /// Tensor types stored in the checkpoint.
    pub(super) weights_source: String,
    /// How the projections are held while running: GGUF blocks or dense tensors.
    pub(super) weights_held: String,
    /// Bytes the weights keep resident.
    pub(super) weight_bytes: usize,
    /// Instruction-set level of the quantised CPU kernels, when weights are held in blocks.
    pub(super) kernels: Option<&'static str>,
    pub(super) burn_version: &'static str,
    pub(super) ridgefill_version: &'static str,
    pub(super) n_threads: usize,
    /// Whether cubecl's on-disk autotune cache held entries before this run (GPU backends).
    pub(super) autotune_cache_warm: bool,
    /// Measured with `ridgefill probe` on the same device (on CPU: lavapipe on the same cores).
    pub(super) ceiling_bandwidth_gbs: Option<f64>,
    pub(super) ceiling_fma_gflops: Option<f64>,
    pub(super) ceiling_adapter: Option<String>,
    pub(super) test_time: String,
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct Row {
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

#[derive(Clone, Copy)]
pub(super) enum RowKind {
    Pp {
        n: usize,
        /// Positions already cached before the prompt's `n` (llama-bench's `pp512 @ d4096`).
        depth: usize,
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
    pub(super) fn label(&self) -> String {
        match *self {
            RowKind::Pp {
                n,
                depth: 0,
                batch: 1,
            } => format!("pp{n}"),
            RowKind::Pp { n, depth: 0, batch } => format!("pp{n} x b{batch}"),
            RowKind::Pp { n, depth, batch: 1 } => format!("pp{n} @ d{depth}"),
            RowKind::Pp { n, depth, batch } => format!("pp{n} @ d{depth} x b{batch}"),
            RowKind::Tg { n, depth, batch: 1 } => format!("tg{n} @ d{depth}"),
            RowKind::Tg { n, depth, batch } => format!("tg{n} @ d{depth} x b{batch}"),
        }
    }
}

/// Turns the per-mode series into rows; `work(mode)` = (FLOPs, bytes) of one run.
pub(super) fn make_rows(
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
        RowKind::Pp { n, depth, batch } => (n, 0, depth, n * batch),
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
                kv_bytes: header_kv(n_prompt + n_depth + n_gen),
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

/// One line per row under a header of every field (JSON's names and order); `null` is an empty
/// cell, a list its items separated by spaces. Quoted as RFC 4180 asks.
fn render_csv(rows: &[Row]) -> Result<String> {
    let mut out = csv::Writer::from_writer(Vec::new());
    let mut keys: Vec<String> = Vec::new();
    for r in rows {
        let v = serde_json::to_value(r)?;
        let obj = v.as_object().context("row serialises to an object")?;
        if keys.is_empty() {
            keys = obj.keys().cloned().collect();
            out.write_record(&keys)?;
        }
        let cells = keys.iter().map(|k| match &obj[k] {
            serde_json::Value::Null => String::new(),
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(xs) => xs
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(" "),
            other => other.to_string(),
        });
        out.write_record(cells)?;
    }
    let bytes = out.into_inner().context("CSV output")?;
    String::from_utf8(bytes).context("CSV output is UTF-8")
}

pub(super) fn render(rows: &[Row], format: Format) -> Result<String> {
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
