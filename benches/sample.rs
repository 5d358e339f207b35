//! Criterion benches of one token draw over SmolLM2's 49,152-logit vocabulary: greedy, the
//! `generate` defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), temperature 1 with
//! nothing cut (the OpenAI default a server sees) and with a 0.9 nucleus, and a batched step's
//! eight rows through `sample_rows`.
//!
//! `cargo bench --bench sample`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ridgefill::model::sample::sample_rows;
use ridgefill::model::{Sampler, SamplerConfig};

const VOCAB: usize = 49_152;
/// Rows of a batched decode step.
const ROWS: usize = 8;

/// Logits with a model-like spread: a few large values over a long tail (deterministic).
fn logits(rows: usize) -> Vec<f32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    (0..rows * VOCAB)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            // Squared uniform: most logits low, a few near the top.
            (u * 8.0).powi(2) / 6.0 - 4.0
        })
        .collect()
}

fn configs() -> [(&'static str, SamplerConfig); 4] {
    let cfg = |temperature, top_k, top_p, min_p| SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: 1,
    };
    [
        ("greedy", SamplerConfig::greedy()),
        ("generate-defaults", SamplerConfig::default()),
        ("t1-uncut", cfg(1.0, 0, 1.0, 0.0)),
        ("t1-top-p-0.9", cfg(1.0, 0, 0.9, 0.0)),
    ]
}

fn bench(c: &mut Criterion) {
    let one = logits(1);
    let mut g = c.benchmark_group("sample");
    for (name, cfg) in configs() {
        let mut s = Sampler::new(cfg);
        g.bench_function(BenchmarkId::new("one", name), |b| {
            b.iter(|| s.sample(std::hint::black_box(&one)))
        });
    }
    let batch = logits(ROWS);
    for (name, cfg) in configs() {
        let mut samplers: Vec<Sampler> = (0..ROWS).map(|_| Sampler::new(cfg.clone())).collect();
        g.bench_function(BenchmarkId::new("rows8", name), |b| {
            b.iter(|| {
                let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
                sample_rows(&mut refs, std::hint::black_box(&batch), VOCAB)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
