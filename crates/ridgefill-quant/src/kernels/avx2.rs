//! AVX2 + FMA + F16C kernels. Unsigned weight values times signed activation bytes go through
//! `vpmaddubsw` (pairs into i16; no saturation since |q·x| ≤ 63·127·2 < 2¹⁵) then `vpmaddwd`
//! (pairs into i32, by 1 or by the k-quant sub-block scale). Each kernel walks `R` weight rows
//! against one activation row, so the activation block is loaded once for all of them.

// `r` indexes the accumulators and addresses row r's bytes: a range loop says that best.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use ridgefill_io::GgmlType;

use super::layout::*;
use super::{XRow, k4_scales};
use crate::act::{KSUM, Q8KRow, Q8Row, QK, QK_K};

/// Rows per kernel pass.
const ROWS: usize = 4;

/// Software prefetch distance for `R` rows of `row_bytes`: a whole number of `R`-row groups
/// (so it lands on the same row and block of a later group) of at least this many bytes.
///
/// The hardware prefetchers alone stream these interleaved row reads at a fraction of the memory
/// bandwidth (measured 3-4 GB/s against 7 GB/s with the prefetch, single thread, bench `formats`).
const PREFETCH_MIN: usize = 4096;

#[inline]
pub(super) fn prefetch_distance(rows: usize, row_bytes: usize) -> usize {
    let group = rows * row_bytes;
    PREFETCH_MIN.div_ceil(group.max(1)) * group
}

/// Prefetches the cache line at `p + dist` into L1. Any address is allowed (a prefetch never
/// faults), hence the wrapping arithmetic past the end of the weights.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(p: *const u8, dist: usize) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(dist) as *const i8);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes at `p`.
    let h = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    hsum_ps128(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_ps128(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `p`.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// 16 bytes of nibbles → 32 bytes: low nibbles (values 0..15) then high nibbles (16..31).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `p`.
    let t = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16(t, 4), t),
        _mm256_set1_epi8(0x0F),
    )
}

/// The 32 bits at `p` → 32 bytes, 0xFF where the bit is set (byte i ↔ bit i).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bits32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees four readable bytes at `p`.
    spread_bits(unsafe { (p as *const u32).read_unaligned() })
}

/// `v` → 32 bytes, 0xFF where the bit is set (byte i ↔ bit i).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn spread_bits(v: u32) -> __m256i {
    // Byte i takes byte i/8 of v, then every bit but bit i%8 is set: all ones iff bit i was set.
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(v as i32), spread);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Σ of u8 × i8 products in eight i32 lanes (four pairs per lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8i8(q: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
}

/// Where a legacy block's offset term comes from: row r gets `Σ_b [d·dx·Σlanes + c·s_b]` with
/// s_b = dx·Σxq, and c is the block's f16 min, or a fixed multiple of its scale d.
pub(super) enum Offset {
    /// c = the f16 at this byte offset (Q4_1, Q5_1).
    Min(usize),
    /// c = k·d (Q4_0: −8, Q5_0: −16, Q8_0: 0).
    Scaled(f32),
}

/// The eight f16 values at byte `at` of blocks `b` and `b + 1` (lanes 0..4 and 4..8) of rows
/// `0..R` (lanes of missing rows are 0), as f32. With `b1 = None` only lanes 0..4 are filled.
///
/// # Safety
/// The blocks exist in every row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn halves8<const R: usize>(
    blocks: &[*const u8; 4],
    b1: Option<usize>,
    at: usize,
) -> __m256 {
    // SAFETY: guaranteed by the caller.
    let h = |r: usize, off: usize| unsafe {
        if r < R {
            (blocks[r].add(off + at) as *const i16).read_unaligned()
        } else {
            0
        }
    };
    let o = b1.unwrap_or(0);
    let hi = |r: usize| if b1.is_some() { h(r, o) } else { 0 };
    _mm256_cvtph_ps(_mm_set_epi16(
        hi(3),
        hi(2),
        hi(1),
        hi(0),
        h(3, 0),
        h(2, 0),
        h(1, 0),
        h(0, 0),
    ))
}

/// A 32-element-block kernel over `R ≤ 4` rows.
///
/// Blocks go two at a time where the format allows (`$pair`): the 16 packed bytes of blocks b and
/// b+1 fill one vector, whose low nibbles (values 0..16 of both blocks) and high nibbles (16..32)
/// meet the activations in [`crate::act::pair_layout`] order, and lanes 0..4 / 4..8 of the i32
/// sums belong to b / b+1. `$pair` maps the two block pointers to (low, high) unsigned values.
/// Single blocks (Q8_0, or an odd last block) go through `$one`, which maps a block pointer and
/// the activation bytes to i32 lane dots. The f16 scales (at byte 0) and mins of the rows are
/// converted together, one lane per row and block.
macro_rules! legacy_kernel {
    ($name:ident, $ty:expr, $offset:expr, $pair:expr, |$p:ident, $x:ident| $one:block) => {
        /// `R` weight rows against `A` activation rows: each block's weights are unpacked once
        /// and meet every activation row (a batch costs far less than `A` separate GEMVs).
        ///
        /// # Safety
        /// AVX2/FMA/F16C present; `R` rows of `row_bytes` readable at `w`, matching every row of
        /// `xs`; each `outs[a]` has room for `R` values; `R ≤ 4`.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name<const R: usize, const A: usize>(
            w: *const u8,
            row_bytes: usize,
            xs: &[Q8Row<'_>; A],
            outs: &[*mut f32; A],
        ) {
            const { assert!(R >= 1 && R <= 4 && A >= 1) };
            let ts = $ty.type_size();
            let offset: Offset = $offset;
            let pair: Option<unsafe fn(*const u8, *const u8) -> (__m256i, __m256i)> = $pair;
            let dist = prefetch_distance(R, row_bytes);
            let nb = xs[0].d.len();
            let mut acc = [[_mm256_setzero_ps(); R]; A];
            // Lane r (and r + 4 on the paired path) holds row r's offset term, per activation row.
            let mut corr = [_mm256_setzero_ps(); A];
            let rows: [*const u8; 4] = std::array::from_fn(|r| w.wrapping_add(r * row_bytes));
            let corr_step = |corr: __m256,
                             blocks: &[*const u8; 4],
                             b1: Option<usize>,
                             d8: __m256,
                             s: __m256| {
                // SAFETY: the blocks exist (caller of the kernel).
                unsafe {
                    match offset {
                        Offset::Min(at) => _mm256_fmadd_ps(halves8::<R>(blocks, b1, at), s, corr),
                        Offset::Scaled(0.0) => corr,
                        Offset::Scaled(k) => {
                            _mm256_fmadd_ps(d8, _mm256_mul_ps(s, _mm256_set1_ps(k)), corr)
                        }
                    }
                }
            };
            let mut b = 0;
            if let Some(pair) = pair {
                let ones = _mm256_set1_epi16(1);
                while b + 2 <= nb {
                    // SAFETY: blocks b, b+1 of every x and of every row are in bounds.
                    unsafe {
                        let blocks: [*const u8; 4] =
                            std::array::from_fn(|r| rows[r].wrapping_add(b * ts));
                        let d8 = halves8::<R>(&blocks, Some(ts), 0);
                        let mut dd = [_mm256_setzero_ps(); A];
                        for a in 0..A {
                            let d = xs[a].d.as_ptr().add(b);
                            let s = xs[a].s.as_ptr().add(b);
                            let dx = _mm256_set_m128(_mm_set1_ps(*d.add(1)), _mm_set1_ps(*d));
                            let sx = _mm256_set_m128(_mm_set1_ps(*s.add(1)), _mm_set1_ps(*s));
                            corr[a] = corr_step(corr[a], &blocks, Some(ts), d8, sx);
                            dd[a] = _mm256_mul_ps(d8, dx);
                        }
                        for r in 0..R {
                            let p = blocks[r];
                            // A pair is at most 48 bytes, so one line per pair covers the row.
                            prefetch(p, dist);
                            let (lo, hi) = pair(p, p.add(ts));
                            let ri = r as i32;
                            let lanes =
                                _mm256_setr_epi32(ri, ri, ri, ri, ri + 4, ri + 4, ri + 4, ri + 4);
                            for a in 0..A {
                                let xp = xs[a].pairs.as_ptr().add(b * QK) as *const u8;
                                let p16 = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo, load(xp)),
                                    _mm256_maddubs_epi16(hi, load(xp.add(32))),
                                );
                                let dot = _mm256_madd_epi16(p16, ones);
                                let scale = _mm256_permutevar8x32_ps(dd[a], lanes);
                                acc[a][r] =
                                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[a][r]);
                            }
                        }
                    }
                    b += 2;
                }
            }
            while b < nb {
                // SAFETY: block b of every x and of every row is in bounds (caller's contract).
                unsafe {
                    let blocks: [*const u8; 4] =
                        std::array::from_fn(|r| rows[r].wrapping_add(b * ts));
                    let d8 = halves8::<R>(&blocks, None, 0);
                    for a in 0..A {
                        let $x = load(xs[a].qs.as_ptr().add(b * QK) as *const u8);
                        let dx = _mm256_set1_ps(*xs[a].d.get_unchecked(b));
                        let sx = _mm256_set1_ps(*xs[a].s.get_unchecked(b));
                        corr[a] = corr_step(corr[a], &blocks, None, d8, sx);
                        let dd = _mm256_mul_ps(d8, dx);
                        for r in 0..R {
                            let $p = blocks[r];
                            if a == 0 {
                                prefetch($p, dist);
                            }
                            let dot: __m256i = $one;
                            let scale = _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(r as i32));
                            acc[a][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[a][r]);
                        }
                    }
                }
                b += 1;
            }
            for a in 0..A {
                let mut c = [0f32; 8];
                // SAFETY: c has eight floats.
                unsafe { _mm256_storeu_ps(c.as_mut_ptr(), corr[a]) };
                for r in 0..R {
                    // SAFETY: outs[a] has room for R values.
                    unsafe { *outs[a].add(r) = hsum_ps(acc[a][r]) + (c[r] + c[r + 4]) };
                }
            }
        }
    };
}

/// Low and high nibbles of blocks `p0` and `p1`, packed bytes at offset `QS`.
///
/// # Safety
/// 16 readable bytes at `p0 + QS` and `p1 + QS`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibble_pair<const QS: usize>(
    p0: *const u8,
    p1: *const u8,
) -> (__m256i, __m256i) {
    // SAFETY: guaranteed by the caller.
    let v = unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(p0.add(QS) as *const __m128i)),
            _mm_loadu_si128(p1.add(QS) as *const __m128i),
        )
    };
    let m4 = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(v, m4),
        _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
    )
}

/// [`nibble_pair`] plus the fifth bits (u32 at `QH`) of Q5_0 / Q5_1 as 16.
///
/// # Safety
/// As for [`nibble_pair`], and four readable bytes at `p0 + QH` and `p1 + QH`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibble5_pair<const QH: usize, const QS: usize>(
    p0: *const u8,
    p1: *const u8,
) -> (__m256i, __m256i) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let (lo, hi) = nibble_pair::<QS>(p0, p1);
        let h0 = (p0.add(QH) as *const u32).read_unaligned();
        let h1 = (p1.add(QH) as *const u32).read_unaligned();
        // Bits 0..16 of each block go with the low nibbles, bits 16..32 with the high ones.
        let hl = (h0 & 0xFFFF) | (h1 << 16);
        let hh = (h0 >> 16) | (h1 & 0xFFFF_0000);
        let m = _mm256_set1_epi8(0x10);
        (
            _mm256_or_si256(
                lo,
                _mm256_and_si256(bits32(&hl as *const u32 as *const u8), m),
            ),
            _mm256_or_si256(
                hi,
                _mm256_and_si256(bits32(&hh as *const u32 as *const u8), m),
            ),
        )
    }
}

legacy_kernel!(
    q4_0,
    GgmlType::Q4_0,
    Offset::Scaled(-8.0),
    Some(nibble_pair::<2>),
    |p, x| { dot_u8i8(nibbles(p.add(2)), x) }
);

legacy_kernel!(
    q4_1,
    GgmlType::Q4_1,
    Offset::Min(2),
    Some(nibble_pair::<4>),
    |p, x| { dot_u8i8(nibbles(p.add(4)), x) }
);

legacy_kernel!(
    q5_0,
    GgmlType::Q5_0,
    Offset::Scaled(-16.0),
    Some(nibble5_pair::<2, 6>),
    |p, x| {
        let hi = _mm256_and_si256(bits32(p.add(2)), _mm256_set1_epi8(0x10));
        dot_u8i8(_mm256_or_si256(nibbles(p.add(6)), hi), x)
    }
);

legacy_kernel!(
    q5_1,
    GgmlType::Q5_1,
    Offset::Min(2),
    Some(nibble5_pair::<4, 8>),
    |p, x| {
        let hi = _mm256_and_si256(bits32(p.add(4)), _mm256_set1_epi8(0x10));
        dot_u8i8(_mm256_or_si256(nibbles(p.add(8)), hi), x)
    }
);

legacy_kernel!(q8_0, GgmlType::Q8_0, Offset::Scaled(0.0), None, |p, x| {
    // Signed × signed: |w| as the unsigned operand, x carrying w's sign (x is never −128).
    let w = load(p.add(2));
    dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
});

/// Broadcasts i16 lane `k` (0..8) of a 128-bit vector duplicated into both halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lane16(v: __m256i, k: usize) -> __m256i {
    let lo = (2 * k) as i16;
    _mm256_shuffle_epi8(v, _mm256_set1_epi16(lo | ((lo + 1) << 8)))
}

/// Q4_K and Q5_K (`FIVE`): Σ_j sc_j·Σ(q·x) over 8 sub-blocks of 32, minus dmin·Σ_j mn_j·bsum_j.
///
/// # Safety
/// As for the legacy kernels, with a [`Q8KRow`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k<const R: usize, const FIVE: bool>(
    w: *const u8,
    row_bytes: usize,
    x: Q8KRow<'_>,
    out: *mut f32,
) {
    let ts = if FIVE {
        GgmlType::Q5_K.type_size()
    } else {
        GgmlType::Q4_K.type_size()
    };
    let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
    let dist = prefetch_distance(R, row_bytes);
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut accm = [_mm_setzero_ps(); R];
    for b in 0..x.d.len() {
        // SAFETY: super-block b of x and of every row is in bounds (caller's contract).
        unsafe {
            let dx = *x.d.get_unchecked(b);
            let xq = x.qs.as_ptr().add(b * QK_K) as *const u8;
            let bs = load(x.bsums.as_ptr().add(b * (QK_K / KSUM)) as *const u8);
            // Sums of the eight 32-value sub-blocks (|Σ| ≤ 32·127 fits i16).
            let sub_sums =
                _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            for r in 0..R {
                let p = w.add(r * row_bytes + b * ts);
                for line in (0..ts).step_by(64) {
                    prefetch(p, dist + line);
                }
                let d = f16_at(p) * dx;
                let dmin = f16_at(p.add(2)) * dx;
                let (sc, mn) = k4_scales(&*(p.add(K_SCALES) as *const [u8; 12]));
                let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
                accm[r] = _mm_fmadd_ps(
                    _mm_set1_ps(dmin),
                    _mm_cvtepi32_ps(_mm_madd_epi16(mins, sub_sums)),
                    accm[r],
                );
                let sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64));
                let scales = _mm256_set_m128i(sc16, sc16);
                let mut hbits = if FIVE {
                    load(p.add(K_QH))
                } else {
                    _mm256_setzero_si256()
                };
                let mut sumi = _mm256_setzero_si256();
                for j in 0..QK_K / 64 {
                    let qb = load(p.add(qs_at + j * 32));
                    let mut lo = _mm256_and_si256(qb, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
                    if FIVE {
                        // Bit 2j / 2j+1 of each qh byte is the fifth bit of sub-block 2j / 2j+1.
                        let h0 = _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4);
                        let h1 = _mm256_slli_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(hbits, 1), one),
                            4,
                        );
                        lo = _mm256_or_si256(lo, h0);
                        hi = _mm256_or_si256(hi, h1);
                        hbits = _mm256_srli_epi16(hbits, 2);
                    }
                    let pl = _mm256_maddubs_epi16(lo, load(xq.add(j * 64)));
                    let ph = _mm256_maddubs_epi16(hi, load(xq.add(j * 64 + 32)));
                    let pl = _mm256_madd_epi16(pl, lane16(scales, 2 * j));
                    let ph = _mm256_madd_epi16(ph, lane16(scales, 2 * j + 1));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: out has room for R values.
        unsafe { *out.add(r) = hsum_ps(acc[r]) - hsum_ps128(accm[r]) };
    }
}

/// Q6_K: Σ_g sc_g·Σ(q·x) over 16 groups of 16 with q stored as 0..63, minus 32·Σ_g sc_g·bsum_g.
///
/// # Safety
/// As for the legacy kernels, with a [`Q8KRow`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const R: usize>(w: *const u8, row_bytes: usize, x: Q8KRow<'_>, out: *mut f32) {
    let ts = GgmlType::Q6_K.type_size();
    let dist = prefetch_distance(R, row_bytes);
    let m4 = _mm256_set1_epi8(0x0F);
    // In-lane byte shuffle: the low half repeats i16 0 of each dword, the high half i16 1.
    let halves = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, //
        2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
    );
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..x.d.len() {
        // SAFETY: super-block b of x and of every row is in bounds (caller's contract).
        unsafe {
            let dx = *x.d.get_unchecked(b);
            let xq = x.qs.as_ptr().add(b * QK_K) as *const u8;
            let bs = load(x.bsums.as_ptr().add(b * (QK_K / KSUM)) as *const u8);
            for r in 0..R {
                let p = w.add(r * row_bytes + b * ts);
                for line in (0..ts).step_by(64) {
                    prefetch(p, dist + line);
                }
                let d = f16_at(p.add(Q6K_D)) * dx;
                let sc16 =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(Q6K_SCALES) as *const __m128i));
                let corr = _mm256_madd_epi16(sc16, bs);
                let mut sumi = _mm256_setzero_si256();
                for h in 0..2 {
                    let ql0 = load(p.add(h * 64));
                    let ql1 = load(p.add(h * 64 + 32));
                    let qh = load(p.add(Q6K_QH + h * 32));
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(ql0, m4),
                            _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_srli_epi16(
                                _mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8)),
                                2,
                            ),
                        ),
                    ];
                    for (g, &q) in q.iter().enumerate() {
                        let k = (4 * h + g) as i32;
                        let sc = _mm256_shuffle_epi8(
                            _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(k)),
                            halves,
                        );
                        let pq = _mm256_maddubs_epi16(q, load(xq.add(h * 128 + g * 32)));
                        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pq, sc));
                    }
                }
                let sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(corr, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: out has room for R values.
        unsafe { *out.add(r) = hsum_ps(acc[r]) };
    }
}

/// Eight weights at element `k` of a float row, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_w8(ty: GgmlType, row: *const u8, k: usize) -> __m256 {
    // SAFETY: the caller guarantees eight elements at k.
    unsafe {
        match ty {
            GgmlType::F32 => _mm256_loadu_ps(row.add(4 * k) as *const f32),
            GgmlType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * k) as *const __m128i)),
            _ => {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(2 * k) as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
            }
        }
    }
}

/// One float weight (F32, F16 or BF16) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_w1(ty: GgmlType, row: *const u8, k: usize) -> f32 {
    // SAFETY: the caller guarantees element k is in the row.
    unsafe {
        match ty {
            GgmlType::F32 => (row.add(4 * k) as *const f32).read_unaligned(),
            GgmlType::F16 => f16_at(row.add(2 * k)),
            _ => f32::from_bits(((row.add(2 * k) as *const u16).read_unaligned() as u32) << 16),
        }
    }
}

/// F32 / F16 / BF16 rows times f32 activations.
///
/// # Safety
/// As for the legacy kernels, with an f32 row of the rows' length.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_rows<const R: usize>(
    ty: GgmlType,
    w: *const u8,
    row_bytes: usize,
    x: &[f32],
    out: *mut f32,
) {
    let n = x.len();
    let dist = prefetch_distance(R, row_bytes);
    let elem = row_bytes / n.max(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut k = 0;
    // SAFETY: elements k..k+8 (vector loop) and k (tail) lie inside x and every row.
    unsafe {
        while k + 8 <= n {
            let xv = _mm256_loadu_ps(x.as_ptr().add(k));
            for r in 0..R {
                let row = w.add(r * row_bytes);
                prefetch(row, dist + elem * k);
                acc[r] = _mm256_fmadd_ps(load_w8(ty, row, k), xv, acc[r]);
            }
            k += 8;
        }
        for r in 0..R {
            let mut s = hsum_ps(acc[r]);
            for t in k..n {
                s = load_w1(ty, w.add(r * row_bytes), t).mul_add(*x.get_unchecked(t), s);
            }
            *out.add(r) = s;
        }
    }
}

/// Runs the `R`-row kernel for `ty` on rows starting at `w`.
///
/// # Safety
/// See [`gemv_rows`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<const R: usize>(
    ty: GgmlType,
    w: *const u8,
    row_bytes: usize,
    x: &XRow<'_>,
    out: *mut f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (ty, x) {
            (
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0,
                XRow::Q8(x),
            ) => legacy::<R, 1>(ty, w, row_bytes, &[*x], &[out]),
            (GgmlType::Q4_K, XRow::Q8K(x)) => q45_k::<R, false>(w, row_bytes, *x, out),
            (GgmlType::Q5_K, XRow::Q8K(x)) => q45_k::<R, true>(w, row_bytes, *x, out),
            (GgmlType::Q6_K, XRow::Q8K(x)) => q6_k::<R>(w, row_bytes, *x, out),
            (_, XRow::F32(x)) => float_rows::<R>(ty, w, row_bytes, x, out),
            _ => unreachable!("avx2::rows: {ty} with the wrong activation kind"),
        }
    }
}

/// The legacy-format kernel of `ty` over `R` weight rows and `A` activation rows.
///
/// # Safety
/// As for the kernels; `ty` is one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy<const R: usize, const A: usize>(
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
            _ => unreachable!("avx2::legacy: {ty} is not a 32-element legacy type"),
        }
    }
}

/// [`gemv_rows`] for `A` activation rows at once (legacy formats): `outs[a][r] = W[r]·xs[a]`.
///
/// # Safety
/// As for [`gemv_rows`], for every activation row; every `outs[a]` has the same length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv_rows_multi<const A: usize>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>; A],
    outs: &mut [&mut [f32]; A],
) {
    let n = outs[0].len();
    let mut r = 0;
    // SAFETY: rows r..r+ROWS (or r) are inside w and every outs[a].
    unsafe {
        while r + ROWS <= n {
            let o: [*mut f32; A] = std::array::from_fn(|a| outs[a].as_mut_ptr().add(r));
            legacy::<ROWS, A>(ty, w.as_ptr().add(r * row_bytes), row_bytes, xs, &o);
            r += ROWS;
        }
        while r < n {
            let o: [*mut f32; A] = std::array::from_fn(|a| outs[a].as_mut_ptr().add(r));
            legacy::<1, A>(ty, w.as_ptr().add(r * row_bytes), row_bytes, xs, &o);
            r += 1;
        }
    }
}

/// See [`super::gemv_rows`].
///
/// # Safety
/// AVX2, FMA and F16C present; sizes checked by the caller (`w` holds `out.len()` rows of
/// `row_bytes` that match `x`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv_rows(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: XRow<'_>,
    out: &mut [f32],
) {
    let n = out.len();
    let mut r = 0;
    // SAFETY: rows r..r+ROWS (or r) are inside w and out.
    unsafe {
        while r + ROWS <= n {
            rows::<ROWS>(
                ty,
                w.as_ptr().add(r * row_bytes),
                row_bytes,
                &x,
                out.as_mut_ptr().add(r),
            );
            r += ROWS;
        }
        while r < n {
            rows::<1>(
                ty,
                w.as_ptr().add(r * row_bytes),
                row_bytes,
                &x,
                out.as_mut_ptr().add(r),
            );
            r += 1;
        }
    }
}
