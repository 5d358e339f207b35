//! The one SIMD rule of the fused kernels, the macro that compiles a kernel body for it, and
//! the vectorising reductions the kernels share.
//!
//! Hand-written: the row kernels' loops (norms, softmax, RoPE, attention's dot products) are
//! short and fused; written over [`LANES`] independent accumulators the compiler vectorises
//! them at the width [`Width::current`] allows, which a scalar running sum never does.

use std::sync::OnceLock;

use ridgefill_quant::SimdLevel;

/// How wide the fused kernels' loops are compiled to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Width {
    /// Whatever the build's target allows (SSE2 on x86-64, NEON on aarch64).
    Scalar,
    /// AVX2 + FMA.
    Avx2,
    /// AVX-512 F/BW/VL/DQ.
    Avx512,
}

impl Width {
    /// The width a quantised-kernel level allows: the same `RIDGEFILL_SIMD` rule
    /// ([`SimdLevel::detect`]) governs every kernel, quantised or fused.
    pub fn of(level: SimdLevel) -> Width {
        match level {
            SimdLevel::Avx512Vnni => Width::Avx512,
            SimdLevel::Avx2 | SimdLevel::AvxVnni => Width::Avx2,
            SimdLevel::Scalar | SimdLevel::Neon | SimdLevel::NeonDot => Width::Scalar,
        }
    }

    /// The width this process runs at: [`Width::of`] the detected level, narrowed to what the
    /// CPU has (every feature the wide bodies are compiled with).
    pub fn current() -> Width {
        static WIDTH: OnceLock<Width> = OnceLock::new();
        *WIDTH.get_or_init(|| Width::of(SimdLevel::detect()).min(Width::cpu()))
    }

    /// The widest width the CPU itself runs.
    fn cpu() -> Width {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512vl") && has!("avx512dq") && has!("avx512bw") {
                return Width::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Width::Avx2;
            }
        }
        Width::Scalar
    }
}

/// Defines `fn $name` that runs its body compiled for AVX-512 or AVX2+FMA as [`Width::current`]
/// says, so the body's loops vectorise wide whatever the build's target CPU.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($a: $t),*) {
            #[inline(always)]
            fn inner($($a: $t),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
                unsafe fn v4($($a: $t),*) {
                    inner($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($a: $t),*) {
                    inner($($a),*)
                }
                match $crate::cpu::simd::Width::current() {
                    // SAFETY: `Width::current` is Avx512 only where the CPU has every feature
                    // `v4` enables.
                    $crate::cpu::simd::Width::Avx512 => return unsafe { v4($($a),*) },
                    // SAFETY: as above, for `v3`.
                    $crate::cpu::simd::Width::Avx2 => return unsafe { v3($($a),*) },
                    $crate::cpu::simd::Width::Scalar => {}
                }
            }
            inner($($a),*)
        }
    };
}

pub(crate) use simd_fn;

/// Accumulator lanes: independent partial results let the reductions below vectorise (f32
/// addition is not associative, so the compiler never reorders a single running sum).
pub(crate) const LANES: usize = 16;

#[inline(always)]
pub(crate) fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let tail = chunks.remainder().iter();
    acc.iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Keys ahead of the one being scored whose rows are prefetched: a decode step's K/V rows come
/// from memory (every other layer's cache and weights went through the caches since), and one
/// head's few hundred rows are too short a stream for the hardware prefetcher to ramp up.
pub(crate) const PREFETCH_KEYS: usize = 8;

/// Prefetches the cache lines of `xs[at..at + len]` (nothing past the end of `xs`).
#[inline(always)]
pub(crate) fn prefetch_row(xs: &[f32], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        const LINE_FLOATS: usize = 16;
        let end = (at + len).min(xs.len());
        let mut i = at;
        while i < end {
            // SAFETY: `i` is inside `xs`; a prefetch has no other effect.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    xs.as_ptr().add(i) as *const i8,
                )
            };
            i += LINE_FLOATS;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xs, at, len);
}

/// Columns of [`weighted_values`] summed in registers at once (four 16-float vectors).
pub(crate) const VALUE_GROUP: usize = 4 * LANES;

/// Σ of the lanes, pairwise (a running sum would be a chain of dependent scalar adds).
#[inline(always)]
pub(crate) fn tree_sum(mut a: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            a[l] += a[l + w];
        }
        w /= 2;
    }
    a[0]
}

/// Σ x².
#[inline(always)]
pub(crate) fn sum_squares(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] += c[j] * c[j];
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().map(|x| x * x).sum::<f32>()
}

/// Replaces each x by e^(x - shift) and returns their sum.
#[inline(always)]
pub(crate) fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            c[j] = exp(c[j] - shift);
            acc[j] += c[j];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for x in chunks.into_remainder() {
        *x = exp(*x - shift);
        sum += *x;
    }
    sum
}

simd_fn! {
    /// Replaces each x by e^(x - shift), vectorised (the sampler's weights over a vocabulary,
    /// which it sums in f64 itself).
    pub fn exp_shifted(xs: &mut [f32], shift: f32) {
        xs.iter_mut().for_each(|x| *x = exp(*x - shift));
    }
}

simd_fn! {
    /// Masked softmax over score rows of width `kv_end`; row `i` sees its first `live[i]` keys
    /// and the rest are zeroed.
    pub(crate) fn softmax_rows(scores: &mut [f32], kv_end: usize, live: &[usize]) {
        for (row, &seen) in scores.chunks_exact_mut(kv_end).zip(live) {
            let (live, masked) = row.split_at_mut(seen);
            let max = max_of(live);
            let inv = 1.0 / exp_shifted_sum(live, max);
            live.iter_mut().for_each(|s| *s *= inv);
            masked.fill(0.0);
        }
    }
}

/// ln 2 split in two so `n·ln2` subtracts exactly ([`exp`] and its x86 vector twin).
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// Adding 1.5·2^23 rounds to the nearest integer in the low mantissa bits.
pub(crate) const EXP_ROUND: f32 = 12_582_912.0;
/// The Cephes polynomial of e^r on [-ln2/2, ln2/2], highest degree first.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// The inputs [`exp`] clamps to (e^x stays a finite, normal f32).
pub(crate) const EXP_MIN: f32 = -87.0;
pub(crate) const EXP_MAX: f32 = 88.0;

/// `e^x` to about 2 ulp (Cephes polynomial, branch-free so loops over it vectorise).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * LOG2E + EXP_ROUND) - EXP_ROUND;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let y = p * r * r + r + 1.0;
    // 2^n built from its exponent bits: EXP_ROUND + 127 + n holds n + 127 in its low mantissa bits
    // (a bit cast, where `n as i32` would saturate lane by lane and stop vectorisation).
    let biased = (n + (EXP_ROUND + 127.0))
        .to_bits()
        .wrapping_sub(EXP_ROUND.to_bits());
    y * f32::from_bits(biased << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_of_std() {
        const STEPS: usize = 100_000;
        let (lo, hi) = (-87.0f32, 88.0f32);
        for i in 0..=STEPS {
            let x = lo + (hi - lo) * i as f32 / STEPS as f32;
            let (got, want) = (exp(x), x.exp());
            let rel = ((got - want) / want).abs();
            assert!(rel < 4.0 * f32::EPSILON, "exp({x}) = {got}, std {want}");
        }
        // Far below the range: clamped to a tiny positive value, never NaN or a negative.
        let tiny = exp(-1.0e4);
        assert!((0.0..1e-37).contains(&tiny), "exp(-1e4) = {tiny}");
    }

    #[test]
    fn ridgefill_simd_governs_the_fused_kernels() {
        assert_eq!(Width::of(SimdLevel::Scalar), Width::Scalar);
        assert_eq!(Width::of(SimdLevel::Neon), Width::Scalar);
        assert_eq!(Width::of(SimdLevel::Avx2), Width::Avx2);
        assert_eq!(Width::of(SimdLevel::AvxVnni), Width::Avx2);
        assert_eq!(Width::of(SimdLevel::Avx512Vnni), Width::Avx512);
        // Never wider than the level the process detected.
        assert!(Width::current() <= Width::of(SimdLevel::detect()));
    }
}
