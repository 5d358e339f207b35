//! AVX-VNNI kernels (256-bit `vpdpbusd`, VEX-encoded: Intel's desktop cores from Alder Lake on,
//! which have no AVX-512) for Q4_0, Q4_1 and Q8_0 weights in the row-lane layout
//! ([`crate::lanes`]).
//!
//! The layout keeps sixteen rows per tile, one per 32-bit lane of a 512-bit vector; here each
//! tile runs as two halves of eight rows, one 256-bit vector per four quant bytes of those rows,
//! so the weights need no second layout and load the same whichever of the two levels reads
//! them. Per half and block: the rows' scales convert in one `vcvtph2ps`, and four (Q4) or eight
//! (Q8_0) `vpdpbusd` against broadcast activation bytes advance all eight rows. Everything else
//! (the other formats, the row layout) stays on the AVX2 kernels.

// `a` indexes the accumulators and the activation rows together: a range loop says that best.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use ridgefill_io::GgmlType;

use super::avx2::prefetch;
use crate::act::{Q8Row, QK};
use crate::lanes;

/// Rows per tile of the layout.
const TILE: usize = lanes::TILE;
/// Rows per half tile: one per 32-bit lane of a 256-bit vector.
const HALF: usize = TILE / 2;
/// Bytes of one f16 field of a half tile's rows.
const HALF_F16: usize = HALF * 2;
/// Bytes of one quant vector of a whole tile (four bytes per row), and of a half tile's share.
const QUANT_VECTOR: usize = 4 * TILE;
const HALF_VECTOR: usize = QUANT_VECTOR / 2;
/// Tile-blocks ahead of the one being read whose lines are prefetched.
const AHEAD: usize = 8;
/// Bytes per cache line.
const LINE: usize = 64;

/// `outs[a][r] = W[r]·xs[a]` for Q4_0, Q4_1 or Q8_0 rows in the row-lane layout, sixteen rows
/// per tile.
///
/// # Safety
/// AVX2, FMA, F16C and AVX-VNNI present; `w` holds `outs[a].len()` rows (a multiple of 16) of
/// `row_bytes` in the row-lane layout of `ty`, matching every activation row; every `outs[a]` has
/// the same length.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn gemv_lanes<const A: usize>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &mut [&mut [f32]; A],
) {
    let n = outs[0].len();
    // SAFETY: tile r/16 (16 rows) is inside w and every outs[a] (caller's contract).
    unsafe {
        for r in (0..n).step_by(TILE) {
            let o: [*mut f32; A] = std::array::from_fn(|a| outs[a].as_mut_ptr().add(r));
            let wr = w.as_ptr().add(r * row_bytes);
            for half in 0..2 {
                match ty {
                    GgmlType::Q4_1 => q4_half::<A, true>(wr, row_bytes, half, xs, &o),
                    GgmlType::Q4_0 => q4_half::<A, false>(wr, row_bytes, half, xs, &o),
                    _ => q8_half::<A>(wr, row_bytes, half, xs, &o),
                }
            }
        }
    }
}

/// Prefetches the tile-block [`AHEAD`] blocks after the one at `base` (`len` bytes each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn prefetch_ahead(base: *const u8, len: usize) {
    for at in (0..len).step_by(LINE) {
        prefetch(base, AHEAD * len + at);
    }
}

/// Q4_0 / Q4_1 (`MIN`) over rows `8·half..8·half + 8` of one tile.
///
/// # Safety
/// As for [`gemv_lanes`], for one tile at `w`; each `outs[a]` has room for 16 values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q4_half<const A: usize, const MIN: bool>(
    w: *const u8,
    row_bytes: usize,
    half: usize,
    xs: &[Q8Row<'_>; A],
    outs: &[*mut f32; A],
) {
    let ty = if MIN { GgmlType::Q4_1 } else { GgmlType::Q4_0 };
    let ts = ty.type_size();
    debug_assert_eq!(row_bytes, xs[0].d.len() * ts);
    // Q4_0 values are stored plus 8.
    const Q4_0_OFFSET: f32 = -8.0;
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); A];
    for b in 0..xs[0].d.len() {
        // SAFETY: block b of the tile and of every x is in bounds (caller's contract).
        unsafe {
            let base = w.add(b * TILE * ts);
            if half == 0 {
                prefetch_ahead(base, TILE * ts);
            }
            let f16s = |field: usize| {
                _mm256_cvtph_ps(_mm_loadu_si128(
                    base.add(field * TILE * 2 + half * HALF_F16) as *const __m128i,
                ))
            };
            let d8 = f16s(0);
            let c8 = if MIN {
                f16s(1)
            } else {
                _mm256_mul_ps(d8, _mm256_set1_ps(Q4_0_OFFSET))
            };
            let qs = base.add(lanes::halves(ty) * TILE * 2 + half * HALF_VECTOR);
            // One quant vector at a time, every activation row against it: 16 ymm registers
            // hold the row sums and accumulators without spilling.
            let mut dot = [_mm256_setzero_si256(); A];
            for j in 0..4 {
                // Lane r: bytes 4j..4j+4 of row r's nibbles (values 4j.. low, 16+4j.. high).
                let v = _mm256_loadu_si256(qs.add(j * QUANT_VECTOR) as *const __m256i);
                let lo = _mm256_and_si256(v, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                for a in 0..A {
                    let xq = xs[a].qs.as_ptr().add(b * QK) as *const i32;
                    let xl = _mm256_set1_epi32(xq.add(j).read_unaligned());
                    let xh = _mm256_set1_epi32(xq.add(4 + j).read_unaligned());
                    dot[a] = _mm256_dpbusd_avx_epi32(dot[a], lo, xl);
                    dot[a] = _mm256_dpbusd_avx_epi32(dot[a], hi, xh);
                }
            }
            for a in 0..A {
                let dx = _mm256_set1_ps(*xs[a].d.get_unchecked(b));
                let sx = _mm256_set1_ps(*xs[a].s.get_unchecked(b));
                let dot = _mm256_cvtepi32_ps(dot[a]);
                acc[a] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d8, dx), acc[a]);
                acc[a] = _mm256_fmadd_ps(c8, sx, acc[a]);
            }
        }
    }
    for a in 0..A {
        // SAFETY: outs[a] has room for 16 values.
        unsafe { _mm256_storeu_ps(outs[a].add(half * HALF), acc[a]) };
    }
}

/// Q8_0 over rows `8·half..8·half + 8` of one tile. `vpdpbusd` wants one unsigned operand: the
/// activation bytes plus 128 (a sign-bit flip before the broadcast) against the signed weights,
/// and 128·Σw, the same for every activation row, is taken back once per block in integers.
///
/// # Safety
/// As for [`q4_half`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q8_half<const A: usize>(
    w: *const u8,
    row_bytes: usize,
    half: usize,
    xs: &[Q8Row<'_>; A],
    outs: &[*mut f32; A],
) {
    let ts = GgmlType::Q8_0.type_size();
    debug_assert_eq!(row_bytes, xs[0].d.len() * ts);
    const FLIP: u32 = 0x8080_8080;
    let ones = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); A];
    for b in 0..xs[0].d.len() {
        // SAFETY: block b of the tile and of every x is in bounds (caller's contract).
        unsafe {
            let base = w.add(b * TILE * ts);
            if half == 0 {
                prefetch_ahead(base, TILE * ts);
            }
            let d8 = _mm256_cvtph_ps(_mm_loadu_si128(base.add(half * HALF_F16) as *const __m128i));
            let qs = base.add(TILE * 2 + half * HALF_VECTOR);
            let mut wsum = _mm256_setzero_si256();
            let mut dot = [_mm256_setzero_si256(); A];
            for j in 0..8 {
                // Lane r: bytes 4j..4j+4 of row r's quants.
                let v = _mm256_loadu_si256(qs.add(j * QUANT_VECTOR) as *const __m256i);
                wsum = _mm256_dpbusd_avx_epi32(wsum, ones, v);
                for a in 0..A {
                    let xq = xs[a].qs.as_ptr().add(b * QK) as *const u32;
                    let x = _mm256_set1_epi32((xq.add(j).read_unaligned() ^ FLIP) as i32);
                    dot[a] = _mm256_dpbusd_avx_epi32(dot[a], x, v);
                }
            }
            let bias = _mm256_slli_epi32::<7>(wsum);
            for a in 0..A {
                let dot = _mm256_sub_epi32(dot[a], bias);
                let dx = _mm256_set1_ps(*xs[a].d.get_unchecked(b));
                acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d8, dx), acc[a]);
            }
        }
    }
    for a in 0..A {
        // SAFETY: outs[a] has room for 16 values.
        unsafe { _mm256_storeu_ps(outs[a].add(half * HALF), acc[a]) };
    }
}
