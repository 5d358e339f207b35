//! Criterion benches of the prefill paths on a random-weight model of SmolLM2-135M's shape (same
//! work as the real checkpoint, which is dequantised to f32 on load): full vs skip-and-fill
//! prefill at 512 and 2048 tokens, the fused fill GEMM alone, and one decode step.
//!
//! `cargo bench --bench prefill`; `RIDGEFILL_BENCH_DEVICE=wgpu` picks another device.
//! Every measured call ends with a host read-back or `Device::sync`, so the clock stops only
//! after the device has finished.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ridgefill::model::fill::{self, FillMaps, FillOptions, FillRows, Prefill};
use ridgefill::model::synthetic::shape;
use ridgefill::model::{Decoder, DeviceChoice, FloatDType, Tensor, select_device, to_host_f32};

/// The split the speed targets are stated at.
const SPLIT: usize = 15;
const LENGTHS: [usize; 2] = [512, 2048];
/// Context cached before the measured decode step.
const DECODE_DEPTH: usize = 512;
const SEED: u64 = 42;
/// Prefill at 2048 takes seconds on a CPU: few samples, or a run takes an hour.
const SAMPLES: usize = 10;

fn setup() -> (Decoder, FillMaps) {
    let choice: DeviceChoice = std::env::var("RIDGEFILL_BENCH_DEVICE")
        .unwrap_or_else(|_| "cpu".into())
        .parse()
        .expect("RIDGEFILL_BENCH_DEVICE: auto, cpu, wgpu, vulkan, metal or cuda");
    let dev = select_device(choice).expect("bench device");
    eprintln!("device: {} ({})", dev.backend, dev.adapter);
    let cfg = shape("smollm2-135m").expect("known shape");
    let max = LENGTHS.iter().copied().max().unwrap_or(1) + DECODE_DEPTH + 1;
    let model = Decoder::random(cfg, &dev.device, FloatDType::F32, max, SEED).expect("model");
    let maps = FillMaps::own_proj(&model, SPLIT).expect("maps");
    (model, maps)
}

fn ids(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729) % 49_000 + 100) as u32)
        .collect()
}

fn benches(c: &mut Criterion) {
    let (model, maps) = setup();
    let mut cache = model.new_cache(LENGTHS.iter().copied().max().unwrap_or(1) + DECODE_DEPTH + 1);
    let rows = FillRows::default();
    let mut g = c.benchmark_group("prefill");
    g.sample_size(SAMPLES);
    for n in LENGTHS {
        let mut salt = 0;
        g.bench_with_input(BenchmarkId::new("full", n), &n, |b, &n| {
            b.iter(|| {
                salt += 1;
                cache.reset();
                to_host_f32(model.prefill(&ids(n, salt), &mut cache).unwrap())
            })
        });
        g.bench_with_input(
            BenchmarkId::new(format!("fill_s{SPLIT}"), n),
            &n,
            |b, &n| {
                b.iter(|| {
                    salt += 1;
                    cache.reset();
                    to_host_f32(
                        Prefill::run(
                            &model,
                            &ids(n, salt),
                            &mut cache,
                            FillOptions::fill(&maps, rows),
                        )
                        .map(|f| f.logits)
                        .unwrap(),
                    )
                })
            },
        );
    }
    g.finish();

    let mut g = c.benchmark_group("fill_gemm");
    g.sample_size(SAMPLES);
    for n in LENGTHS {
        let h = Tensor::<2>::random(
            [n, model.config.hidden_size],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &model.device,
        );
        g.bench_with_input(BenchmarkId::new("fill_cache", n), &n, |b, _| {
            b.iter(|| {
                cache.reset();
                fill::exact::fill_cache(&model, &maps, h.clone(), &mut cache, 1);
                model.device.sync().unwrap();
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("decode");
    cache.reset();
    to_host_f32(model.prefill(&ids(DECODE_DEPTH, 1), &mut cache).unwrap());
    g.bench_function(BenchmarkId::new("step", DECODE_DEPTH), |b| {
        b.iter(|| {
            // Drop the previous step's position so every step sees the same context.
            cache.truncate(DECODE_DEPTH);
            to_host_f32(model.decode_step(1000, &mut cache).unwrap())
        })
    });
    g.finish();
}

criterion_group!(prefill, benches);
criterion_main!(prefill);
