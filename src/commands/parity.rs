//! `ridgefill parity`: the same model on several devices must give the same logits. The first
//! device is the reference; full prefill, skip-and-fill prefill and decode steps are compared.

use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ridgefill::model::fill::{FillMaps, FillOptions, FillRows, Prefill};
use ridgefill::model::{DeviceChoice, FloatDType, WeightFormat, sample, to_host_f32};
use ridgefill::session::LoadArgs;

use super::common::{load_any, parse_dtype};

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint, a manifest name, or `synthetic:smollm2-135m` / `synthetic:llama-1b`.
    #[arg(short = 'm', long = "model", default_value = "synthetic:smollm2-135m")]
    pub model: String,
    /// Devices, comma-separated; the first is the reference.
    #[arg(long, value_delimiter = ',', default_value = "cpu,wgpu")]
    pub device: Vec<DeviceChoice>,
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: FloatDType,
    /// Prompt tokens.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub n_prompt: usize,
    /// Greedy decode steps after the prompt (tokens chosen on the reference device).
    #[arg(short = 'n', long = "n-gen", default_value_t = 4)]
    pub n_gen: usize,
    /// Also compare skip-and-fill prefill at this split (maps from the model's own projections).
    #[arg(long, default_value_t = 15)]
    pub split: usize,
    /// Largest allowed max|Δlogit| relative to the reference's max|logit|.
    #[arg(long, default_value_t = 1e-3)]
    pub tol: f32,
}

/// Seed of the prompt ids.
const PROMPT_SEED: u64 = 7;
/// Tail rows of the fill comparison (sink 1): leaves a bulk at every useful prompt length.
const FILL_TAIL: usize = 8;

/// Logits of every compared step on one device, concatenated per check.
struct Outputs {
    full: Vec<Vec<f32>>,
    fill: Option<Vec<f32>>,
}

fn run_device(
    a: &Args,
    choice: DeviceChoice,
    ids: &[u32],
    forced: Option<&[u32]>,
) -> Result<(Outputs, Vec<u32>, String)> {
    let capacity = a.n_prompt + a.n_gen + 1;
    let args = LoadArgs {
        model: a.model.clone(),
        device: choice,
        dtype: a.dtype,
        weights: WeightFormat::F32,
    };
    let b = load_any(&args, capacity)?;
    let m = &b.model;
    let mut cache = m.new_cache(capacity);
    let mut full = vec![to_host_f32(m.prefill(ids, &mut cache)?)];
    let mut chosen = Vec::new();
    for step in 0..a.n_gen {
        ridgefill::interrupt::check()?;
        let next = match forced {
            Some(f) => f[step],
            None => sample::argmax(full.last().expect("prefill logits")),
        };
        chosen.push(next);
        full.push(to_host_f32(m.decode_step(next, &mut cache)?));
    }
    let fill = if a.split > 0 && a.split < m.num_layers() {
        let maps = FillMaps::own_proj(m, a.split)?;
        let mut cache = m.new_cache(capacity);
        let rows = FillRows {
            sink: 1,
            tail: FILL_TAIL,
            ..FillRows::default()
        };
        Some(to_host_f32(
            Prefill::run(m, ids, &mut cache, FillOptions::fill(&maps, rows)).map(|f| f.logits)?,
        ))
    } else {
        None
    };
    let name = format!("{} ({})", b.device.backend, b.device.adapter);
    Ok((Outputs { full, fill }, chosen, name))
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

pub fn run(a: Args) -> Result<()> {
    if a.device.len() < 2 {
        bail!("parity needs at least two devices, e.g. --device cpu,wgpu");
    }
    if a.n_prompt == 0 {
        bail!("-p must be at least 1");
    }
    let mut rng = StdRng::seed_from_u64(PROMPT_SEED);
    // The vocabulary is only known after loading; ids below the smallest supported vocab are safe.
    const SAFE_VOCAB: u32 = 32_000;
    let ids: Vec<u32> = (0..a.n_prompt)
        .map(|_| rng.random_range(100..SAFE_VOCAB))
        .collect();
    let (reference, forced, ref_name) = run_device(&a, a.device[0], &ids, None)?;
    println!(
        "model: {}, reference: {ref_name}, prompt {} tokens, {} decode steps\n",
        a.model, a.n_prompt, a.n_gen
    );
    println!("| device | check | max|Δ| | max|ref| | relative | top-1 agree |");
    println!("|---|---|---:|---:|---:|---:|");
    let mut worst = 0.0f32;
    for &choice in &a.device[1..] {
        let (out, _, name) = run_device(&a, choice, &ids, Some(&forced))?;
        let mut checks: Vec<(String, &[f32], &[f32])> = reference
            .full
            .iter()
            .zip(&out.full)
            .enumerate()
            .map(|(i, (r, o))| {
                let label = if i == 0 {
                    "prefill".to_string()
                } else {
                    format!("decode {i}")
                };
                (label, r.as_slice(), o.as_slice())
            })
            .collect();
        if let (Some(r), Some(o)) = (&reference.fill, &out.fill) {
            checks.push((format!("fill s={}", a.split), r.as_slice(), o.as_slice()));
        }
        for (label, r, o) in checks {
            let d = max_diff(r, o);
            let scale = max_abs(r).max(f32::MIN_POSITIVE);
            let rel = d / scale;
            if !rel.is_finite() {
                bail!("{name}: {label}: non-finite logits");
            }
            worst = worst.max(rel);
            let agree = sample::argmax(r) == sample::argmax(o);
            println!(
                "| {name} | {label} | {d:.3e} | {scale:.3} | {rel:.2e} | {} |",
                if agree { "yes" } else { "no" }
            );
        }
    }
    println!();
    if worst > a.tol {
        bail!(
            "devices disagree: worst relative max|Δlogit| {worst:.2e} exceeds --tol {:.0e}",
            a.tol
        );
    }
    println!(
        "parity ok: worst relative max|Δlogit| {worst:.2e} ≤ {:.0e}",
        a.tol
    );
    Ok(())
}
