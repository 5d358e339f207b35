//! Row-dot kernels: several weight rows (in their GGUF block format) against one quantised
//! activation row. Block layouts are ggml's (see `ridgefill_io::quant` for the dequantisers they
//! must agree with).

use ridgefill_io::GgmlType;

use crate::act::{Q8KRow, Q8Row};
use crate::simd::SimdLevel;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avxvnni;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;

/// Which activation kind a weight type's kernel consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// 32-element Q8 blocks with sums ([`Q8Row`]).
    Q8,
    /// 256-element Q8 super-blocks with 16-element sums ([`Q8KRow`]).
    Q8K,
    /// The f32 activations themselves.
    F32,
}

/// The activation kind `ty` needs, or `None` if there is no kernel for it.
pub(crate) fn act_kind(ty: GgmlType) -> Option<ActKind> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => Some(ActKind::Q8),
        Q4_K | Q5_K | Q6_K => Some(ActKind::Q8K),
        F32 | F16 | BF16 => Some(ActKind::F32),
        _ => None,
    }
}

/// One activation row in the kind its weight needs.
#[derive(Clone, Copy)]
pub(crate) enum XRow<'a> {
    Q8(Q8Row<'a>),
    Q8K(Q8KRow<'a>),
    F32(&'a [f32]),
}

impl XRow<'_> {
    fn cols(&self) -> usize {
        match self {
            XRow::Q8(x) => x.qs.len(),
            XRow::Q8K(x) => x.qs.len(),
            XRow::F32(x) => x.len(),
        }
    }
}

/// `out[r] = Σ_k W[r, k]·x[k]` for the `out.len()` rows of type `ty` stored at `w`, each
/// `row_bytes` long.
///
/// Panics (an internal error) if the sizes disagree: the unsafe kernels rely on them.
pub(crate) fn gemv_rows(
    level: SimdLevel,
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: XRow<'_>,
    out: &mut [f32],
) {
    let cols = x.cols();
    let kind_ok = matches!(
        (act_kind(ty), &x),
        (Some(ActKind::Q8), XRow::Q8(_))
            | (Some(ActKind::Q8K), XRow::Q8K(_))
            | (Some(ActKind::F32), XRow::F32(_))
    );
    assert!(
        kind_ok
            && cols.is_multiple_of(ty.block_size())
            && cols / ty.block_size() * ty.type_size() == row_bytes
            && w.len() >= out.len() * row_bytes
            && consistent(&x),
        "gemv_rows: {ty} rows of {row_bytes} bytes do not match the activation row"
    );
    #[cfg(target_arch = "aarch64")]
    if matches!(level, SimdLevel::Neon | SimdLevel::NeonDot) {
        let dot = level == SimdLevel::NeonDot;
        // SAFETY: the NEON levels are only used when the CPU has them (SimdLevel::is_available
        // is checked by every caller); the sizes were checked above; XRow::Q8 goes with the
        // legacy formats and XRow::Q8K with the k-quants only (the kind check above).
        unsafe {
            match &x {
                XRow::Q8(x) if dot => neon::gemv_rows_dot(ty, w, row_bytes, x, out),
                XRow::Q8(x) => neon::gemv_rows(ty, w, row_bytes, x, out),
                XRow::Q8K(x) if dot => neon::gemv_rows_k_dot(ty, w, row_bytes, x, out),
                XRow::Q8K(x) => neon::gemv_rows_k(ty, w, row_bytes, x, out),
                XRow::F32(_) => scalar::gemv_rows(ty, w, row_bytes, x, out),
            }
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        if let (SimdLevel::Avx512Vnni, XRow::Q8(x)) = (level, x) {
            // SAFETY: Avx512Vnni is only used when the CPU has it (SimdLevel::is_available is
            // checked by every caller); the sizes were checked just above.
            unsafe { avx512::gemv_rows_multi(ty, w, row_bytes, &[x], &mut [out]) };
            return;
        }
        // SAFETY: levels from Avx2 up are only used when the CPU has AVX2, FMA and F16C
        // (SimdLevel::is_available is checked by every caller); the sizes were checked above.
        unsafe { avx2::gemv_rows(ty, w, row_bytes, x, out) };
        return;
    }
    let _ = level;
    scalar::gemv_rows(ty, w, row_bytes, x, out);
}

/// [`gemv_rows`] for `A` activation rows: `outs[a][r] = Σ_k W[r, k]·xs[a][k]`. The legacy
/// formats on AVX2 and up unpack each weight block once for all `A` rows; other types and levels
/// run one GEMV per row.
// Only the x86-64 kernels write through `outs` in place.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
pub(crate) fn gemv_rows_multi<const A: usize>(
    level: SimdLevel,
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: [XRow<'_>; A],
    mut outs: [&mut [f32]; A],
) {
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 && act_kind(ty) == Some(ActKind::Q8) {
        let q8: Option<[Q8Row<'_>; A]> = xs
            .iter()
            .map(|x| match x {
                XRow::Q8(x) => Some(*x),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .and_then(|v| v.try_into().ok());
        let n = outs[0].len();
        let cols = xs[0].cols();
        if let Some(q8) = q8 {
            assert!(
                xs.iter().all(|x| x.cols() == cols && consistent(x))
                    && outs.iter().all(|o| o.len() == n)
                    && cols.is_multiple_of(ty.block_size())
                    && cols / ty.block_size() * ty.type_size() == row_bytes
                    && w.len() >= n * row_bytes,
                "gemv_rows_multi: {ty} rows of {row_bytes} bytes do not match the activation rows"
            );
            // SAFETY: a level is only used when the CPU has it (checked by every caller); sizes
            // were checked just above.
            unsafe {
                if level == SimdLevel::Avx512Vnni {
                    avx512::gemv_rows_multi(ty, w, row_bytes, &q8, &mut outs)
                } else {
                    avx2::gemv_rows_multi(ty, w, row_bytes, &q8, &mut outs)
                }
            };
            return;
        }
    }
    for (x, out) in xs.into_iter().zip(outs) {
        gemv_rows(level, ty, w, row_bytes, x, out);
    }
}

/// The level whose kernels read row-lane weights for a call at `level`: the AVX-VNNI kernels
/// when asked for and present, else AVX-512 VNNI when present, else AVX-VNNI (weights are only
/// rearranged on a CPU with one of the two).
pub(crate) fn lanes_level(level: SimdLevel) -> SimdLevel {
    if level == SimdLevel::AvxVnni && level.is_available() {
        SimdLevel::AvxVnni
    } else if SimdLevel::Avx512Vnni.is_available() {
        SimdLevel::Avx512Vnni
    } else {
        SimdLevel::AvxVnni
    }
}

/// [`gemv_rows_multi`] for Q4_0, Q4_1 or Q8_0 rows stored in the row-lane layout
/// ([`crate::lanes`]), which the AVX-512 VNNI and AVX-VNNI kernels read (see [`lanes_level`]).
///
/// Panics (an internal error) if the sizes disagree or the CPU has neither: weights are only
/// rearranged when it has one.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
pub(crate) fn gemv_lanes<const A: usize>(
    level: SimdLevel,
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; A],
    mut outs: [&mut [f32]; A],
) {
    let n = outs[0].len();
    let cols = xs[0].qs.len();
    let level = lanes_level(level);
    assert!(
        level.is_available()
            && matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
            && n.is_multiple_of(crate::lanes::TILE)
            && xs
                .iter()
                .all(|x| x.qs.len() == cols && consistent(&XRow::Q8(*x)))
            && outs.iter().all(|o| o.len() == n)
            && cols.is_multiple_of(ty.block_size())
            && cols / ty.block_size() * ty.type_size() == row_bytes
            && w.len() >= n * row_bytes,
        "gemv_lanes: {ty} row-lane tiles of {row_bytes}-byte rows do not match the activation rows"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the level and the sizes match (both checked just above).
    unsafe {
        if level == SimdLevel::Avx512Vnni {
            avx512::gemv_lanes(ty, w, row_bytes, &xs, &mut outs)
        } else {
            avxvnni::gemv_lanes(ty, w, row_bytes, &xs, &mut outs)
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("row-lane weights exist only on x86-64");
}

/// Whether an activation row's scale and sum arrays match its length.
fn consistent(x: &XRow<'_>) -> bool {
    use crate::act::{KSUM, QK, QK_K};
    match x {
        XRow::Q8(x) => {
            x.d.len() * QK == x.qs.len() && x.s.len() == x.d.len() && x.pairs.len() == x.qs.len()
        }
        XRow::Q8K(x) => x.d.len() * QK_K == x.qs.len() && x.bsums.len() * KSUM == x.qs.len(),
        XRow::F32(_) => true,
    }
}

/// Unpacks the eight 6-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes) into two
/// little-endian u64s holding one byte each.
#[inline(always)]
pub(crate) fn k4_scales(s: &[u8; 12]) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    // Scales 0..3 / mins 0..3: low 6 bits of bytes 0..3 / 4..7. Scales 4..7: low nibble of bytes
    // 8..11 with the top 2 bits of bytes 0..3 above it; mins 4..7 likewise from the high nibbles
    // and bytes 4..7.
    let sc_lo = u0 & LOW6;
    let sc_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
    let mn_lo = u1 & LOW6;
    let mn_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        mn_lo as u64 | (mn_hi as u64) << 32,
    )
}

/// Byte offsets inside the blocks (ggml's `block_*` structs).
pub(crate) mod layout {
    /// Q4_K / Q5_K: d, dmin (f16), 12 bytes of scales, then (Q5_K) 32 bytes of high bits, quants.
    pub const K_SCALES: usize = 4;
    pub const K_QH: usize = 16;
    pub const Q4K_QS: usize = 16;
    pub const Q5K_QS: usize = 48;
    /// Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 i8 scales, f16 d.
    pub const Q6K_QH: usize = 128;
    pub const Q6K_SCALES: usize = 192;
    pub const Q6K_D: usize = 208;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k4_scales_match_the_bytewise_unpacking() {
        let s: [u8; 12] = [
            0xC1, 0x42, 0x83, 0xFF, 0x05, 0xC6, 0x47, 0x88, 0x9A, 0xBC, 0xDE, 0xF0,
        ];
        let (sc, mn) = k4_scales(&s);
        for j in 0..4 {
            assert_eq!((sc >> (8 * j)) as u8, s[j] & 63);
            assert_eq!((mn >> (8 * j)) as u8, s[j + 4] & 63);
            assert_eq!(
                (sc >> (8 * (j + 4))) as u8,
                (s[j + 8] & 15) | ((s[j] >> 6) << 4)
            );
            assert_eq!(
                (mn >> (8 * (j + 4))) as u8,
                (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4)
            );
        }
    }
}
