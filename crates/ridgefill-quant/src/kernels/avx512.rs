//! AVX-512 VNNI kernels for the 32-element legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
//!
//! `vpdpbusd` multiplies unsigned weight bytes by signed activation bytes and adds groups of four
//! straight into i32 lanes, replacing AVX2's `vpmaddubsw` + `vpmaddwd` + add; a 512-bit vector
//! holds the unpacked blocks of *two* weight rows (one per 256-bit half) against the activation
//! bytes broadcast into both halves. Unpacking, the block scales and the offset terms reuse the
//! AVX2 helpers (this level implies AVX2), and the k-quant and float kernels stay AVX2.
//!
//! Lane layout of one row pair's i32 dot vector: on the paired path (blocks b and b+1 packed into
//! one 256-bit half, as in [`crate::act::pair_layout`]) lanes 0..4 / 4..8 are row 0's blocks b /
//! b+1 and lanes 8..12 / 12..16 row 1's; on the single-block path lanes 0..8 are row 0's block
//! and 8..16 row 1's.

// `r` indexes the accumulators and addresses row r's bytes: a range loop says that best.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use ridgefill_io::GgmlType;

use super::avx2::{
    self, Offset, halves8, hsum_ps, load, nibble_pair, nibble5_pair, nibbles, prefetch,
    prefetch_distance,
};
use crate::act::{Q8Row, QK};
use crate::lanes;

/// Rows per kernel pass (two row pairs).
const ROWS: usize = 4;

/// The per-block factor of the offset term of blocks `b` (lanes 0..4) and `b + 1` (lanes 4..8,
/// paired path only) of the rows (lane r / r + 4 = row r), see [`Offset`]: the f16 min, or
/// `k·d`; `None` for no offset. Shared by every activation row, which adds `factor · s`.
///
/// # Safety
/// The blocks exist in every row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn offset_factor<const R: usize>(
    offset: &Offset,
    blocks: &[*const u8; 4],
    b1: Option<usize>,
    d8: __m256,
) -> Option<__m256> {
    // SAFETY: forwarded from the caller.
    unsafe {
        match *offset {
            Offset::Min(at) => Some(halves8::<R>(blocks, b1, at)),
            Offset::Scaled(0.0) => None,
            Offset::Scaled(k) => Some(_mm256_mul_ps(d8, _mm256_set1_ps(k))),
        }
    }
}

/// Two 256-bit halves as one 512-bit vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The upper 256 bits of a float vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn upper_ps(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// A 32-element-block kernel over `R ∈ {2, 4}` rows (`R / 2` row pairs) and `A` activation rows.
///
/// `$pair` maps two consecutive block pointers of a row to their (low, high) unsigned values;
/// `$one` maps a block pointer to its 32 values as unsigned bytes, `$bias` is the constant those
/// bytes carry (Q8_0 stores signed bytes, flipped to unsigned by adding 128, which the kernel
/// takes back as 128·Σx in integers).
macro_rules! vnni_kernel {
    ($name:ident, $ty:expr, $offset:expr, $pair:expr, $bias:expr, |$p:ident| $one:block) => {
        /// # Safety
        /// AVX-512 F/BW/VL/VNNI (and AVX2/FMA/F16C) present; `R` rows of `row_bytes` readable at
        /// `w`, matching every row of `xs`; each `outs[a]` has room for `R` values; `R ∈ {2, 4}`.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn $name<const R: usize, const A: usize>(
            w: *const u8,
            row_bytes: usize,
            xs: &[Q8Row<'_>; A],
            outs: &[*mut f32; A],
        ) {
            const { assert!((R == 2 || R == 4) && A >= 1) };
            let ts = $ty.type_size();
            let offset: Offset = $offset;
            let pair: Option<unsafe fn(*const u8, *const u8) -> (__m256i, __m256i)> = $pair;
            let bias: i8 = $bias;
            let dist = prefetch_distance(R, row_bytes);
            let nb = xs[0].d.len();
            let zero = _mm512_setzero_si512();
            let mut acc = [[_mm512_setzero_ps(); 2]; A];
            // Lane r (and r + 4 on the paired path) holds row r's offset term, per activation row.
            let mut corr = [_mm256_setzero_ps(); A];
            let rows: [*const u8; 4] = std::array::from_fn(|r| w.wrapping_add(r * row_bytes));
            let mut b = 0;
            if let Some(pair) = pair {
                // Scale lanes of halves8's [rows 0..4 of block b, rows 0..4 of block b+1].
                let w_idx = [
                    _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 5, 5, 5, 5),
                    _mm512_setr_epi32(2, 2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 7, 7, 7, 7),
                ];
                let x_idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
                while b + 2 <= nb {
                    // SAFETY: blocks b, b+1 of every x and of every row are in bounds.
                    unsafe {
                        let blocks: [*const u8; 4] =
                            std::array::from_fn(|r| rows[r].wrapping_add(b * ts));
                        let d8 = halves8::<R>(&blocks, Some(ts), 0);
                        let c8 = offset_factor::<R>(&offset, &blocks, Some(ts), d8);
                        let d8z = _mm512_castps256_ps512(d8);
                        let mut dw = [_mm512_setzero_ps(); 2];
                        let mut lo = [zero; 2];
                        let mut hi = [zero; 2];
                        for rp in 0..R / 2 {
                            let (p0, p1) = (blocks[2 * rp], blocks[2 * rp + 1]);
                            // A pair is at most 48 bytes, so one line per pair covers the row.
                            prefetch(p0, dist);
                            prefetch(p1, dist);
                            let (l0, h0) = pair(p0, p0.add(ts));
                            let (l1, h1) = pair(p1, p1.add(ts));
                            lo[rp] = join(l0, l1);
                            hi[rp] = join(h0, h1);
                            dw[rp] = _mm512_permutexvar_ps(w_idx[rp], d8z);
                        }
                        for a in 0..A {
                            let d = xs[a].d.as_ptr().add(b);
                            let s = xs[a].s.as_ptr().add(b);
                            let dx2 = _mm_castpd_ps(_mm_load_sd(d as *const f64));
                            let dx = _mm512_permutexvar_ps(x_idx, _mm512_castps128_ps512(dx2));
                            if let Some(c8) = c8 {
                                let sx = _mm256_set_m128(_mm_set1_ps(*s.add(1)), _mm_set1_ps(*s));
                                corr[a] = _mm256_fmadd_ps(c8, sx, corr[a]);
                            }
                            let xp = xs[a].pairs.as_ptr().add(b * QK) as *const u8;
                            let xl = _mm512_broadcast_i64x4(load(xp));
                            let xh = _mm512_broadcast_i64x4(load(xp.add(32)));
                            for rp in 0..R / 2 {
                                let dot = _mm512_dpbusd_epi32(
                                    _mm512_dpbusd_epi32(zero, lo[rp], xl),
                                    hi[rp],
                                    xh,
                                );
                                acc[a][rp] = _mm512_fmadd_ps(
                                    _mm512_cvtepi32_ps(dot),
                                    _mm512_mul_ps(dw[rp], dx),
                                    acc[a][rp],
                                );
                            }
                        }
                    }
                    b += 2;
                }
            }
            let w_idx = [
                _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
            ];
            while b < nb {
                // SAFETY: block b of every x and of every row is in bounds (caller's contract).
                unsafe {
                    let blocks: [*const u8; 4] =
                        std::array::from_fn(|r| rows[r].wrapping_add(b * ts));
                    let d8 = halves8::<R>(&blocks, None, 0);
                    let c8 = offset_factor::<R>(&offset, &blocks, None, d8);
                    let d8z = _mm512_castps256_ps512(d8);
                    let mut dw = [_mm512_setzero_ps(); 2];
                    let mut wv = [zero; 2];
                    for rp in 0..R / 2 {
                        let one = |$p: *const u8| -> __m256i {
                            prefetch($p, dist);
                            $one
                        };
                        wv[rp] = join(one(blocks[2 * rp]), one(blocks[2 * rp + 1]));
                        dw[rp] = _mm512_permutexvar_ps(w_idx[rp], d8z);
                    }
                    for a in 0..A {
                        let xq = load(xs[a].qs.as_ptr().add(b * QK) as *const u8);
                        let x = _mm512_broadcast_i64x4(xq);
                        let dx = _mm512_set1_ps(*xs[a].d.get_unchecked(b));
                        if let Some(c8) = c8 {
                            let sx = _mm256_set1_ps(*xs[a].s.get_unchecked(b));
                            corr[a] = _mm256_fmadd_ps(c8, sx, corr[a]);
                        }
                        // Start from −bias·Σx so the biased bytes give Σ q·x exactly.
                        let init = if bias == 0 {
                            zero
                        } else {
                            _mm512_sub_epi32(
                                zero,
                                _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(bias), x),
                            )
                        };
                        for rp in 0..R / 2 {
                            let dot = _mm512_dpbusd_epi32(init, wv[rp], x);
                            acc[a][rp] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(dot),
                                _mm512_mul_ps(dw[rp], dx),
                                acc[a][rp],
                            );
                        }
                    }
                }
                b += 1;
            }
            for a in 0..A {
                let mut c = [0f32; 8];
                // SAFETY: c has eight floats.
                unsafe { _mm256_storeu_ps(c.as_mut_ptr(), corr[a]) };
                for rp in 0..R / 2 {
                    let v = acc[a][rp];
                    let (r0, r1) = (2 * rp, 2 * rp + 1);
                    // SAFETY: outs[a] has room for R values.
                    unsafe {
                        *outs[a].add(r0) = hsum_ps(_mm512_castps512_ps256(v)) + (c[r0] + c[r0 + 4]);
                        *outs[a].add(r1) = hsum_ps(upper_ps(v)) + (c[r1] + c[r1 + 4]);
                    }
                }
            }
        }
    };
}

vnni_kernel!(
    q4_0,
    GgmlType::Q4_0,
    Offset::Scaled(-8.0),
    Some(nibble_pair::<2>),
    0,
    |p| { nibbles(p.add(2)) }
);

vnni_kernel!(
    q4_1,
    GgmlType::Q4_1,
    Offset::Min(2),
    Some(nibble_pair::<4>),
    0,
    |p| { nibbles(p.add(4)) }
);

vnni_kernel!(
    q5_0,
    GgmlType::Q5_0,
    Offset::Scaled(-16.0),
    Some(nibble5_pair::<2, 6>),
    0,
    |p| {
        let hi = _mm256_maskz_set1_epi8((p.add(2) as *const u32).read_unaligned(), 0x10);
        _mm256_or_si256(nibbles(p.add(6)), hi)
    }
);

vnni_kernel!(
    q5_1,
    GgmlType::Q5_1,
    Offset::Min(2),
    Some(nibble5_pair::<4, 8>),
    0,
    |p| {
        let hi = _mm256_maskz_set1_epi8((p.add(4) as *const u32).read_unaligned(), 0x10);
        _mm256_or_si256(nibbles(p.add(8)), hi)
    }
);

// Q8_0's signed bytes plus 128 (a sign-bit flip) are the unsigned operand.
vnni_kernel!(
    q8_0,
    GgmlType::Q8_0,
    Offset::Scaled(0.0),
    None,
    i8::MIN,
    |p| { _mm256_xor_si256(load(p.add(2)), _mm256_set1_epi8(i8::MIN)) }
);

/// Rows per pass of the row-lane kernel ([`q4_tile`]): one per 32-bit lane.
const TILE: usize = lanes::TILE;
/// Activation rows from which the row-lane kernel is used: its per-block transpose of 16 rows
/// pays off when several activation rows share it.
const TILE_MIN_A: usize = 4;

/// Tile-blocks ahead of the one being read whose lines are prefetched (row-lane layout: one
/// contiguous stream).
const LANES_AHEAD: usize = 8;

/// Prefetches the tile-block [`LANES_AHEAD`] blocks after the one at `base` (`len` bytes each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn prefetch_tile_block(base: *const u8, len: usize) {
    const LINE: usize = 64;
    let mut at = 0;
    while at < len {
        prefetch(base, LANES_AHEAD * len + at);
        at += LINE;
    }
}

/// `outs[a][r] = W[r]·xs[a]` for Q4_0, Q4_1 or Q8_0 rows in the row-lane layout
/// ([`crate::lanes`]), sixteen rows per pass.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C present; `w` holds `outs[a].len()` rows (a multiple
/// of 16) of `row_bytes` in the row-lane layout of `ty`, matching every activation row; every
/// `outs[a]` has the same length.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv_lanes<const A: usize>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &mut [&mut [f32]; A],
) {
    // SAFETY: the caller's contract (whole tiles of the row-lane layout).
    unsafe { tiles::<A, true>(ty, w, row_bytes, xs, outs) };
}

/// The row-lane kernels over the whole 16-row tiles from row 0, weights in the row-lane layout
/// (`LANES`) or row after row (transposed per block); returns the rows done.
///
/// # Safety
/// As for [`gemv_lanes`] (`LANES`) or [`gemv_rows_multi`]; `ty` is Q4_0, Q4_1 or Q8_0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tiles<const A: usize, const LANES: bool>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &mut [&mut [f32]; A],
) -> usize {
    let n = outs[0].len();
    let mut r = 0;
    // SAFETY: tile r/16 (16 rows) is inside w and every outs[a] (caller's contract).
    unsafe {
        while r + TILE <= n {
            let o: [*mut f32; A] = std::array::from_fn(|a| outs[a].as_mut_ptr().add(r));
            let wr = w.as_ptr().add(r * row_bytes);
            match ty {
                GgmlType::Q4_1 => q4_tile::<A, true, LANES>(wr, row_bytes, xs, &o),
                GgmlType::Q4_0 => q4_tile::<A, false, LANES>(wr, row_bytes, xs, &o),
                _ => q8_tile::<A, LANES>(wr, row_bytes, xs, &o),
            }
            r += TILE;
        }
    }
    r
}

/// Byte offsets of rows 0..16, `row_bytes` apart, for a gather.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn row_offsets(row_bytes: usize) -> __m512i {
    _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(row_bytes as i32),
    )
}

/// The 16 bytes at `base + r·row_bytes + at` of rows r = 0..16, transposed: lane r of
/// element j holds bytes 4j..4j+4 of row r.
///
/// # Safety
/// 16 readable bytes at each of those addresses.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn transpose16(base: *const u8, row_bytes: usize, at: usize) -> [__m512i; 4] {
    // SAFETY: guaranteed by the caller.
    let row = |r: usize| unsafe { _mm_loadu_si128(base.add(r * row_bytes + at) as *const __m128i) };
    // z[k]'s 128-bit lane L holds row 4L + k, so the unpacks below land row r in lane r.
    let z: [__m512i; 4] = std::array::from_fn(|k| {
        let v = _mm512_castsi128_si512(row(k));
        let v = _mm512_inserti32x4::<1>(v, row(4 + k));
        let v = _mm512_inserti32x4::<2>(v, row(8 + k));
        _mm512_inserti32x4::<3>(v, row(12 + k))
    });
    let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// Q4_0 / Q4_1 (`MIN`) over 16 weight rows with one row per 32-bit lane: each block's nibbles of
/// the 16 rows are transposed (four bytes of every row per vector), so `vpdpbusd` against four
/// broadcast activation bytes advances all 16 rows at once and a block needs one scale FMA for
/// all of them, rather than one per two rows.
///
/// # Safety
/// As for the kernels, with 16 rows of `row_bytes` at `w` and room for 16 values in each
/// `outs[a]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_tile<const A: usize, const MIN: bool, const LANES: bool>(
    w: *const u8,
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &[*mut f32; A],
) {
    let ty = if MIN { GgmlType::Q4_1 } else { GgmlType::Q4_0 };
    let ts = ty.type_size();
    // Packed nibbles follow the f16 scale (and, for Q4_1, the f16 min).
    let qs_at = if MIN { 4 } else { 2 };
    // Q4_0 values are stored plus 8.
    const Q4_0_OFFSET: f32 = -8.0;
    let nb = xs[0].d.len();
    let m4 = _mm512_set1_epi8(0x0F);
    let offsets = row_offsets(row_bytes);
    // One prefetch per row per cache line's worth of blocks.
    let line_blocks = (64 / ts).max(1);
    let dist = 4 * 64;
    let mut acc = [_mm512_setzero_ps(); A];
    let mut corr = [_mm512_setzero_ps(); A];
    for b in 0..nb {
        // SAFETY: block b of the 16 rows and of every x is in bounds (caller's contract).
        unsafe {
            // v[j], lane r: bytes 4j..4j+4 of row r's nibbles (values 4j.. low, 16+4j.. high);
            // d16 / m16: the f16 scale / min of each row's block.
            let (v, d16, m16) = if LANES {
                let base = w.add(b * TILE * ts);
                prefetch_tile_block(base, TILE * ts);
                let at = |k: usize| _mm256_loadu_si256(base.add(k * TILE * 2) as *const __m256i);
                let qs = base.add(lanes::halves(ty) * TILE * 2);
                let v: [__m512i; 4] =
                    std::array::from_fn(|j| _mm512_loadu_si512(qs.add(j * 64) as *const __m512i));
                (
                    v,
                    _mm512_cvtph_ps(at(0)),
                    if MIN {
                        _mm512_cvtph_ps(at(1))
                    } else {
                        _mm512_setzero_ps()
                    },
                )
            } else {
                let base = w.add(b * ts);
                if b % line_blocks == 0 {
                    for r in 0..TILE {
                        prefetch(base.add(r * row_bytes), dist);
                    }
                }
                // The scale in the low half of each gathered dword, the min in the high half.
                let g = _mm512_i32gather_epi32::<1>(offsets, base as *const i32);
                (
                    transpose16(base, row_bytes, qs_at),
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)),
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g))),
                )
            };
            let lo: [__m512i; 4] = std::array::from_fn(|j| _mm512_and_si512(v[j], m4));
            let hi: [__m512i; 4] =
                std::array::from_fn(|j| _mm512_and_si512(_mm512_srli_epi16::<4>(v[j]), m4));
            let c16 = if MIN {
                m16
            } else {
                _mm512_mul_ps(d16, _mm512_set1_ps(Q4_0_OFFSET))
            };
            for a in 0..A {
                let xq = xs[a].qs.as_ptr().add(b * QK) as *const i32;
                let mut dl = _mm512_setzero_si512();
                let mut dh = _mm512_setzero_si512();
                for j in 0..4 {
                    let xl = _mm512_set1_epi32(xq.add(j).read_unaligned());
                    let xh = _mm512_set1_epi32(xq.add(4 + j).read_unaligned());
                    dl = _mm512_dpbusd_epi32(dl, lo[j], xl);
                    dh = _mm512_dpbusd_epi32(dh, hi[j], xh);
                }
                let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dl, dh));
                let dx = _mm512_set1_ps(*xs[a].d.get_unchecked(b));
                acc[a] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d16, dx), acc[a]);
                let sx = _mm512_set1_ps(*xs[a].s.get_unchecked(b));
                corr[a] = _mm512_fmadd_ps(c16, sx, corr[a]);
            }
        }
    }
    for a in 0..A {
        // SAFETY: outs[a] has room for 16 values.
        unsafe { _mm512_storeu_ps(outs[a], _mm512_add_ps(acc[a], corr[a])) };
    }
}

/// Q8_0 over 16 weight rows with one row per 32-bit lane (see [`q4_tile`]). `vpdpbusd` wants
/// one unsigned operand: here the activation bytes plus 128 (a sign-bit flip before the
/// broadcast) against the signed weights, and 128·Σw, the same for every activation row, is
/// taken back once per block in integers.
///
/// # Safety
/// As for [`q4_tile`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_tile<const A: usize, const LANES: bool>(
    w: *const u8,
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &[*mut f32; A],
) {
    let ts = GgmlType::Q8_0.type_size();
    // The 32 signed bytes follow the f16 scale.
    const QS_AT: usize = 2;
    const FLIP: u32 = 0x8080_8080;
    let nb = xs[0].d.len();
    let ones = _mm512_set1_epi8(1);
    let offsets = row_offsets(row_bytes);
    // One prefetch per row per cache line's worth of blocks.
    let line_blocks = 64usize.div_ceil(ts);
    let dist = 4 * 64;
    let mut acc = [_mm512_setzero_ps(); A];
    for b in 0..nb {
        // SAFETY: block b of the 16 rows and of every x is in bounds (caller's contract).
        unsafe {
            // v[j], lane r: bytes 4j..4j+4 of row r's quants; d16: each row's block scale.
            let (v, d16) = if LANES {
                let base = w.add(b * TILE * ts);
                prefetch_tile_block(base, TILE * ts);
                let qs = base.add(TILE * 2);
                let v: [__m512i; 8] =
                    std::array::from_fn(|j| _mm512_loadu_si512(qs.add(j * 64) as *const __m512i));
                (
                    v,
                    _mm512_cvtph_ps(_mm256_loadu_si256(base as *const __m256i)),
                )
            } else {
                let base = w.add(b * ts);
                if b % line_blocks == 0 {
                    for r in 0..TILE {
                        prefetch(base.add(r * row_bytes), dist);
                    }
                }
                let (v0, v1) = (
                    transpose16(base, row_bytes, QS_AT),
                    transpose16(base, row_bytes, QS_AT + 16),
                );
                let g = _mm512_i32gather_epi32::<1>(offsets, base as *const i32);
                (
                    [v0[0], v0[1], v0[2], v0[3], v1[0], v1[1], v1[2], v1[3]],
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)),
                )
            };
            let mut wsum = _mm512_setzero_si512();
            for vj in &v {
                wsum = _mm512_dpbusd_epi32(wsum, ones, *vj);
            }
            let bias = _mm512_slli_epi32::<7>(wsum);
            for a in 0..A {
                let xq = xs[a].qs.as_ptr().add(b * QK) as *const u32;
                let mut d0 = _mm512_setzero_si512();
                let mut d1 = _mm512_setzero_si512();
                for j in 0..4 {
                    let x0 = _mm512_set1_epi32((xq.add(j).read_unaligned() ^ FLIP) as i32);
                    let x1 = _mm512_set1_epi32((xq.add(4 + j).read_unaligned() ^ FLIP) as i32);
                    d0 = _mm512_dpbusd_epi32(d0, x0, v[j]);
                    d1 = _mm512_dpbusd_epi32(d1, x1, v[4 + j]);
                }
                let dot = _mm512_sub_epi32(_mm512_add_epi32(d0, d1), bias);
                let dx = _mm512_set1_ps(*xs[a].d.get_unchecked(b));
                acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d16, dx), acc[a]);
            }
        }
    }
    for a in 0..A {
        // SAFETY: outs[a] has room for 16 values.
        unsafe { _mm512_storeu_ps(outs[a], acc[a]) };
    }
}

/// The kernel of `ty` over `R ∈ {2, 4}` weight rows and `A` activation rows.
///
/// # Safety
/// As for the kernels; `ty` is one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn legacy<const R: usize, const A: usize>(
    ty: GgmlType,
    w: *const u8,
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &[*mut f32; A],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            GgmlType::Q4_0 => q4_0::<R, A>(w, row_bytes, xs, outs),
            GgmlType::Q4_1 => q4_1::<R, A>(w, row_bytes, xs, outs),
            GgmlType::Q5_0 => q5_0::<R, A>(w, row_bytes, xs, outs),
            GgmlType::Q5_1 => q5_1::<R, A>(w, row_bytes, xs, outs),
            GgmlType::Q8_0 => q8_0::<R, A>(w, row_bytes, xs, outs),
            _ => unreachable!("avx512::legacy: {ty} is not a 32-element legacy type"),
        }
    }
}

/// `outs[a][r] = W[r]·xs[a]` for the legacy formats: four rows per pass, then two, and a last
/// odd row through the AVX2 kernel.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C present; `w` holds `outs[a].len()` rows of
/// `row_bytes` that match every activation row; every `outs[a]` has the same length.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv_rows_multi<const A: usize>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &mut [&mut [f32]; A],
) {
    let n = outs[0].len();
    let mut r = 0;
    // SAFETY: rows r..r+ROWS (or r..r+2, or r) are inside w and every outs[a].
    unsafe {
        let at = |outs: &mut [&mut [f32]; A], r: usize| -> [*mut f32; A] {
            std::array::from_fn(|a| outs[a].as_mut_ptr().add(r))
        };
        if A >= TILE_MIN_A && matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
            r = tiles::<A, false>(ty, w, row_bytes, xs, outs);
        }
        while r + ROWS <= n {
            let o = at(outs, r);
            legacy::<ROWS, A>(ty, w.as_ptr().add(r * row_bytes), row_bytes, xs, &o);
            r += ROWS;
        }
        if r + 2 <= n {
            let o = at(outs, r);
            legacy::<2, A>(ty, w.as_ptr().add(r * row_bytes), row_bytes, xs, &o);
            r += 2;
        }
        if r < n {
            let o = at(outs, r);
            avx2::legacy::<1, A>(ty, w.as_ptr().add(r * row_bytes), row_bytes, xs, &o);
        }
    }
}
