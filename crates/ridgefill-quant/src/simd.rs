//! Runtime choice of the kernel instruction set.

use std::sync::OnceLock;

/// Environment variable that forces a lower level (`scalar`; `neon`, `neondot`; `avx2`,
/// `avxvnni`, `avx512vnni`); a value that names no level, or one this CPU lacks, is reported on
/// stderr and the best level runs.
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
            let available = Self::available();
            let value = std::env::var(SIMD_ENV).ok();
            Self::choose(value.as_deref(), &available).unwrap_or_else(|msg| {
                eprintln!("warning: {msg}");
                available.last().copied().unwrap_or(SimdLevel::Scalar)
            })
        })
    }

    /// The level [`SIMD_ENV`]'s `value` asks for among `available` (lowest first): the best one
    /// when unset or blank; `Err` names the problem when the value is no level or one this CPU
    /// lacks.
    pub fn choose(value: Option<&str>, available: &[SimdLevel]) -> Result<SimdLevel, String> {
        let best = available.last().copied().unwrap_or(SimdLevel::Scalar);
        let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(best);
        };
        let names = |ls: &[SimdLevel]| ls.iter().map(|l| l.name()).collect::<Vec<_>>().join(", ");
        match Self::ALL.into_iter().find(|l| l.name() == v) {
            Some(l) if available.contains(&l) => Ok(l),
            Some(_) => Err(format!(
                "{SIMD_ENV}={v}: this CPU cannot run that level (it has: {}); running {}",
                names(available),
                best.name()
            )),
            None => Err(format!(
                "{SIMD_ENV}={v}: no such level (one of: {}); running {}",
                names(&Self::ALL),
                best.name()
            )),
        }
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

    #[test]
    fn the_env_value_picks_an_available_level_or_says_what_is_wrong() {
        use SimdLevel::*;
        let x86 = [Scalar, Avx2, AvxVnni];
        assert_eq!(SimdLevel::choose(None, &x86), Ok(AvxVnni));
        assert_eq!(SimdLevel::choose(Some("  "), &x86), Ok(AvxVnni));
        assert_eq!(SimdLevel::choose(Some(" avx2 "), &x86), Ok(Avx2));
        assert_eq!(SimdLevel::choose(Some("scalar"), &x86), Ok(Scalar));
        let lacking = SimdLevel::choose(Some("avx512vnni"), &x86).unwrap_err();
        assert!(lacking.contains("RIDGEFILL_SIMD=avx512vnni"), "{lacking}");
        assert!(lacking.contains("cannot run"), "{lacking}");
        assert!(lacking.contains("scalar, avx2, avxvnni"), "{lacking}");
        assert!(lacking.ends_with("running avxvnni"), "{lacking}");
        let typo = SimdLevel::choose(Some("avx512"), &x86).unwrap_err();
        assert!(
            typo.contains("RIDGEFILL_SIMD=avx512: no such level"),
            "{typo}"
        );
        assert!(typo.contains("neondot"), "{typo}");
        let arm = [Scalar, Neon];
        assert!(SimdLevel::choose(Some("neondot"), &arm).is_err());
        assert_eq!(SimdLevel::choose(Some("neon"), &arm), Ok(Neon));
        assert_eq!(SimdLevel::choose(None, &[]), Ok(Scalar));
    }
}
