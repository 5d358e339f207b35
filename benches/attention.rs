//! Criterion bench of the CPU attention alone at SmolLM2-135M's shape (9 query heads over 3 K/V
//! heads of 64): a follow-up turn's rows over a long cache, and a fresh prompt's causal rows.
//! Each iteration runs 30 layers' distinct K/V, so the cache streams from memory as in a model.
//!
//! `cargo bench --bench attention`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ridgefill::model::cpu::{AttnItem, attention_many};
use ridgefill::model::{Device, Tensor, TensorData};

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const LAYERS: usize = 30;
/// (new rows, cached keys before them): follow-up questions over a 3000-token document, and a
/// fresh 512-token prompt.
const CASES: [(usize, usize); 4] = [(10, 3000), (19, 3000), (37, 3000), (512, 0)];

/// Uniform values in [-0.5, 0.5) from a fixed LCG (no RNG crate for one bench).
fn values(n: usize, seed: &mut u32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (*seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn attention(c: &mut Criterion) {
    let device = Device::flex();
    let mut g = c.benchmark_group("attention");
    g.sample_size(20);
    let mut seed = 1;
    for (n, past) in CASES {
        let t = past + n;
        let kv = |seed: &mut u32| {
            Tensor::<4>::from_data(
                TensorData::new(
                    values(KV_HEADS * t * HEAD_DIM, seed),
                    [1, KV_HEADS, t, HEAD_DIM],
                ),
                &device,
            )
        };
        let layers: Vec<_> = (0..LAYERS)
            .map(|_| (kv(&mut seed), kv(&mut seed)))
            .collect();
        let q = Tensor::<4>::from_data(
            TensorData::new(
                values(HEADS * n * HEAD_DIM, &mut seed),
                [1, HEADS, n, HEAD_DIM],
            ),
            &device,
        );
        let name = format!("{LAYERS} layers, {n} rows @ d{past}");
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                for (k, v) in &layers {
                    let item = AttnItem {
                        q: q.clone(),
                        k: k.clone(),
                        v: v.clone(),
                        seen: Vec::new(),
                    };
                    std::hint::black_box(attention_many(vec![item]));
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, attention);
criterion_main!(benches);
