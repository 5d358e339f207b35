//! Runtime choice of the kernel instruction set.

use std::sync::OnceLock;

/// Environment variable that forces a lower level (`scalar`; `neon`, `neondot`; `avx2`,
/// `avxvnni`, `avx512vnni`); unknown values are ignored.
pub const SIMD_ENV: &str = "RIDGEFILL_SIMD";

/// An instruction-set level the kernels are written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, no intrinsics (always available, always tested).
    Scalar,
    /// aarch64 NEON (baseline): widening multiplies for the 32-element legacy formats and the
    /// k-quants (float weights use the scalar kernels).
    Neon,
    /// Neon plus the dot-product extension (`sdot`).
    NeonDot,
    /// x86-64 AVX2 + FMA + F16C: `vpmaddubsw` / `vpmaddwd` integer dot products.
    Avx2,
    /// Avx2 plus AVX-VNNI (Intel's desktop cores from Alder Lake on, which lack AVX-512):
    /// `vpdpbusd` on 256-bit vectors, for Q4_0, Q4_1 and Q8_0 in the row-lane layout (other
    /// formats use the Avx2 kernels).
    AvxVnni,
    /// Avx2 plus AVX-512 F/BW/VL/VNNI: `vpdpbusd` on 512-bit vectors, two weight rows per vector,
    /// for the 32-element legacy formats (other formats use the Avx2 kernels). Does not imply
    /// AvxVnni (Ice Lake has AVX-512 VNNI only); the order ranks speed.
    Avx512Vnni,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 6] = [
        SimdLevel::Scalar,
        SimdLevel::Neon,
        SimdLevel::NeonDot,
        SimdLevel::Avx2,
        SimdLevel::AvxVnni,
        SimdLevel::Avx512Vnni,
    ];

    /// Whether this CPU can run the level.
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            SimdLevel::Neon => neon_available(),
            SimdLevel::NeonDot => neon_available() && dotprod_available(),
            SimdLevel::Avx2 => avx2_available(),
            SimdLevel::AvxVnni => avx2_available() && avxvnni_available(),
            SimdLevel::Avx512Vnni => avx2_available() && avx512vnni_available(),
        }
    }

    /// The levels this CPU can run, lowest first.
    pub fn available() -> Vec<SimdLevel> {
        Self::ALL.into_iter().filter(|l| l.is_available()).collect()
    }

    /// The best available level, lowered by [`SIMD_ENV`] if set (read once per process).
    pub fn detect() -> SimdLevel {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let best = Self::available()
                .into_iter()
                .max()
                .unwrap_or(SimdLevel::Scalar);
            match std::env::var(SIMD_ENV).ok().as_deref().map(str::trim) {
                Some("scalar") => SimdLevel::Scalar,
                Some("neon") if SimdLevel::Neon.is_available() => SimdLevel::Neon,
                Some("neondot") if SimdLevel::NeonDot.is_available() => SimdLevel::NeonDot,
                Some("avx2") if best >= SimdLevel::Avx2 => SimdLevel::Avx2,
                Some("avxvnni") if SimdLevel::AvxVnni.is_available() => SimdLevel::AvxVnni,
                Some("avx512vnni") if best >= SimdLevel::Avx512Vnni => SimdLevel::Avx512Vnni,
                _ => best,
            }
        })
    }

    /// Lower-case name, as [`SIMD_ENV`] spells it.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Neon => "neon",
            SimdLevel::NeonDot => "neondot",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::AvxVnni => "avxvnni",
            SimdLevel::Avx512Vnni => "avx512vnni",
        }
    }
}

fn neon_available() -> bool {
    cfg!(target_arch = "aarch64")
}

#[cfg(target_arch = "aarch64")]
fn dotprod_available() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

#[cfg(not(target_arch = "aarch64"))]
fn dotprod_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avxvnni_available() -> bool {
    is_x86_feature_detected!("avxvnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avxvnni_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512vnni_available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512vnni_available() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_level_of_each_architecture_is_available() {
        let levels = SimdLevel::available();
        eprintln!("SIMD levels on this CPU: {levels:?}");
        assert_eq!(levels.first(), Some(&SimdLevel::Scalar));
        // NEON is part of every aarch64 CPU, so its kernels always run in the kernel tests there.
        assert_eq!(
            SimdLevel::Neon.is_available(),
            cfg!(target_arch = "aarch64")
        );
        assert!(levels.windows(2).all(|w| w[0] < w[1]), "lowest first");
    }
}
