//! Device ceilings: memory bandwidth (a large copy) and f32 FMA rate. GPUs are measured with the
//! WGSL kernels in `shaders/` driven through raw wgpu; the CPU (flex's device) with the same two
//! kernels written natively (AVX-512 or AVX2 FMA where the CPU has them) on flex's thread count.
//! Benchmarks report their achieved throughput against these.

#[cfg(feature = "wgpu")]
mod gpu;

use std::time::Instant;

#[cfg(feature = "wgpu")]
pub use gpu::{BANDWIDTH_WGSL, FMA_WGSL, probe_wgpu};

use crate::device::DeviceChoice;
use crate::error::Result;

/// Measured ceilings of one device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Ceilings {
    pub adapter: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    /// Memory bandwidth, GB/s (10⁹ bytes), best of the timed runs.
    pub bandwidth_gbs: f64,
    /// f32 FMA rate, GFLOP/s (an FMA counts as 2 FLOPs), best of the timed runs.
    pub fma_gflops: f64,
}

/// Ceilings of the device a `--device` choice runs on: the CPU natively for `cpu`, else the GPU
/// through wgpu (`cuda` through the Vulkan adapter of the same GPU).
pub fn probe(choice: DeviceChoice, threads: usize) -> Result<Ceilings> {
    match choice {
        DeviceChoice::Cpu => Ok(probe_cpu(threads)),
        #[cfg(feature = "wgpu")]
        other => probe_wgpu(other),
        #[cfg(not(feature = "wgpu"))]
        other => Err(crate::error::ModelError::DeviceUnavailable(
            other.to_string(),
            "GPU ceilings are measured through wgpu: rebuild with `--features wgpu`".into(),
        )),
    }
}

/// Copy size per run: far beyond any last-level cache.
const CPU_COPY_BYTES: usize = 256 << 20;
/// Timed runs; the best is the ceiling.
const CPU_REPS: usize = 5;
/// FMA rounds per thread per run.
const CPU_FMA_ITERS: usize = 10_000_000;
/// Independent vector accumulators: enough chains to cover FMA latency × ports.
const CPU_ACCS: usize = 12;

/// Native CPU ceilings on `threads` threads.
pub fn probe_cpu(threads: usize) -> Ceilings {
    let threads = threads.max(1);
    let (isa, lanes) = fma_isa();
    let floats = CPU_COPY_BYTES / size_of::<f32>();
    let src = vec![1.0f32; floats];
    let mut dst = vec![0.0f32; floats];
    let chunk = floats.div_ceil(threads);
    let mut best_copy = f64::INFINITY;
    for _ in 0..CPU_REPS {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, sr) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(sr));
            }
        });
        best_copy = best_copy.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    let bandwidth_gbs = 2.0 * CPU_COPY_BYTES as f64 / best_copy / 1e9;

    let mut best_fma = f64::INFINITY;
    for _ in 0..CPU_REPS {
        let t = Instant::now();
        std::thread::scope(|s| {
            for i in 0..threads {
                s.spawn(move || std::hint::black_box(fma_loop(i as f32, CPU_FMA_ITERS)));
            }
        });
        best_fma = best_fma.min(t.elapsed().as_secs_f64());
    }
    let flops = 2.0 * (threads * CPU_FMA_ITERS * CPU_ACCS * lanes) as f64;
    Ceilings {
        adapter: format!("CPU ({threads} threads)"),
        backend: "native".into(),
        device_type: "Cpu".into(),
        driver: isa.into(),
        bandwidth_gbs,
        fma_gflops: flops / best_fma / 1e9,
    }
}

/// The widest FMA the CPU has, and its f32 lanes.
fn fma_isa() -> (&'static str, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return ("avx512f", 16);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return ("avx2+fma", 8);
        }
    }
    ("scalar", 1)
}

fn fma_loop(seed: f32, iters: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { x86::fma_avx512(seed, iters) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { x86::fma_avx2(seed, iters) };
        }
    }
    let mut acc = [seed; CPU_ACCS];
    for _ in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(0.999, 0.001);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CPU_ACCS;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(seed: f32, iters: usize) -> f32 {
        let m = _mm512_set1_ps(0.999);
        let c = _mm512_set1_ps(0.001);
        let mut acc = [_mm512_set1_ps(seed); CPU_ACCS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, m, c);
            }
        }
        let mut sum = _mm512_setzero_ps();
        for a in acc {
            sum = _mm512_add_ps(sum, a);
        }
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(seed: f32, iters: usize) -> f32 {
        let m = _mm256_set1_ps(0.999);
        let c = _mm256_set1_ps(0.001);
        let mut acc = [_mm256_set1_ps(seed); CPU_ACCS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, m, c);
            }
        }
        let mut out = [0.0f32; 8];
        let mut sum = _mm256_setzero_ps();
        for a in acc {
            sum = _mm256_add_ps(sum, a);
        }
        // SAFETY: `out` holds exactly the 8 floats an unaligned 256-bit store writes.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }
}
