use std::time::Instant;

use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ridgefill::model::to_host_f32;

use super::common::{ModelArgs, load};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
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
    /// Repetitions after one warm-up run.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Print JSON lines instead of a markdown table.
    #[arg(long)]
    pub json: bool,
}

/// Seed for the random prompt ids; each repetition draws new ids so nothing is cached by accident.
const PROMPT_SEED: u64 = 1234;

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

pub fn run(a: Args) -> Result<()> {
    if a.reps == 0 {
        bail!("-r must be at least 1");
    }
    let max_p = a.n_prompt.iter().copied().max().unwrap_or(0);
    let loaded = load(&a.model.load_args(), max_p.max(1) + a.n_gen + 1)?;
    let model = &loaded.model;
    let vocab = model.config.vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(PROMPT_SEED);
    let mut prompt =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let mut rows = Vec::new();
    for &n in &a.n_prompt {
        let mut samples = Vec::new();
        for rep in 0..=a.reps {
            let ids = prompt(n);
            let mut cache = model.new_cache(n);
            let t = Instant::now();
            to_host_f32(model.prefill(&ids, &mut cache)?);
            let s = t.elapsed().as_secs_f64();
            if rep > 0 {
                samples.push(n as f64 / s);
            }
        }
        rows.push((format!("pp{n}"), n, 0usize, samples));
    }
    if a.n_gen > 0 {
        let mut samples = Vec::new();
        for rep in 0..=a.reps {
            let ids = prompt(1);
            let mut cache = model.new_cache(a.n_gen + 1);
            let mut logits = to_host_f32(model.prefill(&ids, &mut cache)?);
            let t = Instant::now();
            for _ in 0..a.n_gen {
                let next = ridgefill::model::sample::argmax(&logits);
                logits = to_host_f32(model.decode_step(next, &mut cache)?);
            }
            let s = t.elapsed().as_secs_f64();
            if rep > 0 {
                samples.push(a.n_gen as f64 / s);
            }
        }
        rows.push((format!("tg{}", a.n_gen), 0, a.n_gen, samples));
    }
    let dev = &loaded.device;
    if !a.json {
        println!("| model | backend | adapter | test | t/s |");
        println!("|---|---|---|---|---:|");
    }
    for (test, n_prompt, n_gen, samples) in rows {
        let (m, s) = mean_std(&samples);
        if a.json {
            let row = serde_json::json!({
                "model": a.model.model, "backend": dev.backend, "device": dev.adapter,
                "test": test, "n_prompt": n_prompt, "n_gen": n_gen,
                "avg_ts": m, "stddev_ts": s, "samples_ts": samples,
            });
            println!("{row}");
        } else {
            println!(
                "| {} | {} | {} | {test} | {m:.2} ± {s:.2} |",
                a.model.model, dev.backend, dev.adapter
            );
        }
    }
    Ok(())
}
