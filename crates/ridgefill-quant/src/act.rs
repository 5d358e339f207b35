//! Activation quantisation: each f32 row of `x` becomes signed 8-bit values with one f32 scale
//! per block, so the weight-block dot products run on integers.
//!
//! Two kinds, each computed at most once per matmul call and shared by every part and row:
//! - [`Q8Buf`] (32-element blocks, scale `d` and `s = d·Σq`) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!   It plays the role of both ggml's Q8_0 and Q8_1: the block sum lets the kernels use
//!   *unsigned* weight values (`Σ(q−8)·x = Σq·x − 8·Σx`) for the offset formats and add
//!   `m·s` for the min formats, so one kind serves all five.
//! - [`Q8KBuf`] (256-element super-blocks, scale `d`, i16 sums of every 16 values) for the
//!   k-quants, whose sub-block mins (Q4_K, Q5_K) and −32 offset (Q6_K) use those sums.
//!
//! Scales stay f32 (ggml rounds the Q8_0 scale to f16). Values are `round_ties_even(x·127/amax)`,
//! computed identically by the scalar and SIMD paths, so every level sees the same integers.

use std::ops::Range;

use crate::pool::Pool;
use crate::simd::SimdLevel;

/// Elements per block of the legacy formats.
pub(crate) const QK: usize = 32;
/// Elements per k-quant super-block.
pub(crate) const QK_K: usize = 256;
/// Elements per Q8_K partial sum.
pub(crate) const KSUM: usize = 16;
/// Largest quantised magnitude (symmetric, so −128 never occurs).
const QMAX: f32 = 127.0;

/// One activation row quantised in 32-element blocks.
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    pub qs: &'a [i8],
    /// `qs` rearranged for the nibble kernels, see [`pair_layout`].
    pub pairs: &'a [i8],
    pub d: &'a [f32],
    /// `d · Σ qs` over the block.
    pub s: &'a [f32],
}

/// One activation row quantised in 256-element super-blocks.
#[derive(Clone, Copy)]
pub(crate) struct Q8KRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    /// Σ qs over each 16 values.
    pub bsums: &'a [i16],
}

/// `m` rows quantised in 32-element blocks.
#[derive(Default, Debug)]
pub(crate) struct Q8Buf {
    cols: usize,
    qs: Vec<i8>,
    pairs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

/// `m` rows quantised in 256-element super-blocks.
#[derive(Default, Debug)]
pub(crate) struct Q8KBuf {
    cols: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    bsums: Vec<i16>,
}

impl Q8Buf {
    /// Resizes for `m` rows of `cols` (a multiple of 32) without shrinking capacity.
    pub fn reset(&mut self, m: usize, cols: usize) {
        self.cols = cols;
        self.qs.resize(m * cols, 0);
        self.pairs.resize(m * cols, 0);
        self.d.resize(m * cols / QK, 0.0);
        self.s.resize(m * cols / QK, 0.0);
    }

    /// Quantises `x` (`[m, cols]`, after [`Self::reset`]), on several threads if `pool` is
    /// given and `m` is large.
    pub fn quantize(&mut self, level: SimdLevel, x: &[f32], pool: Option<&Pool>) {
        let c = self.cols;
        let nb = c / QK;
        let m = self.qs.len() / c.max(1);
        assert!(
            x.len() == self.qs.len(),
            "Q8Buf::quantize: x does not match reset()"
        );
        let (qs, pairs, d, s) = (
            Raw(self.qs.as_mut_ptr()),
            Raw(self.pairs.as_mut_ptr()),
            Raw(self.d.as_mut_ptr()),
            Raw(self.s.as_mut_ptr()),
        );
        by_rows(pool, m, &|r| {
            // SAFETY: rows r of the four buffers (sized by reset for m rows) are written only by
            // this call; `&mut self` keeps everyone else out until by_rows returns.
            let (qs, pairs, d, s) = unsafe {
                (
                    qs.rows(r.clone(), c),
                    pairs.rows(r.clone(), c),
                    d.rows(r.clone(), nb),
                    s.rows(r.clone(), nb),
                )
            };
            quantize_q8(level, &x[r.start * c..r.end * c], qs, d, s);
            for (q, p) in qs.chunks_exact(c).zip(pairs.chunks_exact_mut(c)) {
                pair_layout(q, p);
            }
        });
    }

    pub fn row(&self, i: usize) -> Q8Row<'_> {
        let nb = self.cols / QK;
        Q8Row {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            pairs: &self.pairs[i * self.cols..(i + 1) * self.cols],
            d: &self.d[i * nb..(i + 1) * nb],
            s: &self.s[i * nb..(i + 1) * nb],
        }
    }
}

impl Q8KBuf {
    /// Resizes for `m` rows of `cols` (a multiple of 256) without shrinking capacity.
    pub fn reset(&mut self, m: usize, cols: usize) {
        self.cols = cols;
        self.qs.resize(m * cols, 0);
        self.d.resize(m * cols / QK_K, 0.0);
        self.bsums.resize(m * cols / KSUM, 0);
    }

    /// Quantises `x` (`[m, cols]`, after [`Self::reset`]), on several threads if `pool` is
    /// given and `m` is large.
    pub fn quantize(&mut self, level: SimdLevel, x: &[f32], pool: Option<&Pool>) {
        let c = self.cols;
        let (nb, ns) = (c / QK_K, c / KSUM);
        let m = self.qs.len() / c.max(1);
        assert!(
            x.len() == self.qs.len(),
            "Q8KBuf::quantize: x does not match reset()"
        );
        let (qs, d, bs) = (
            Raw(self.qs.as_mut_ptr()),
            Raw(self.d.as_mut_ptr()),
            Raw(self.bsums.as_mut_ptr()),
        );
        by_rows(pool, m, &|r| {
            // SAFETY: as in Q8Buf::quantize.
            let (qs, d, bs) = unsafe {
                (
                    qs.rows(r.clone(), c),
                    d.rows(r.clone(), nb),
                    bs.rows(r.clone(), ns),
                )
            };
            quantize_q8k(level, &x[r.start * c..r.end * c], qs, d, bs);
        });
    }

    pub fn row(&self, i: usize) -> Q8KRow<'_> {
        let (c, nb, ns) = (self.cols, self.cols / QK_K, self.cols / KSUM);
        Q8KRow {
            qs: &self.qs[i * c..(i + 1) * c],
            d: &self.d[i * nb..(i + 1) * nb],
            bsums: &self.bsums[i * ns..(i + 1) * ns],
        }
    }
}

/// Rearranges one row of 32-blocks for kernels that read two weight blocks' nibbles in one
/// vector: for each pair of blocks (2p, 2p+1), the 64 bytes become
/// `[x₂ₚ[0..16], x₂ₚ₊₁[0..16], x₂ₚ[16..32], x₂ₚ₊₁[16..32]]` — the order of the low nibbles then
/// the high nibbles of the two blocks' packed bytes. An unpaired last block is copied as is.
pub(crate) fn pair_layout(qs: &[i8], out: &mut [i8]) {
    const H: usize = QK / 2;
    let mut pairs = qs.chunks_exact(2 * QK);
    let mut outs = out.chunks_exact_mut(2 * QK);
    for (q, o) in (&mut pairs).zip(&mut outs) {
        o[..H].copy_from_slice(&q[..H]);
        o[H..2 * H].copy_from_slice(&q[QK..QK + H]);
        o[2 * H..3 * H].copy_from_slice(&q[H..QK]);
        o[3 * H..].copy_from_slice(&q[QK + H..]);
    }
    outs.into_remainder().copy_from_slice(pairs.remainder());
}

/// A buffer's base pointer, shared by the threads that fill disjoint rows of it.
#[derive(Clone, Copy)]
struct Raw<T>(*mut T);
// SAFETY: only used through `rows`, whose callers write disjoint ranges.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Raw<T> {}

impl<T> Raw<T> {
    /// Rows `r` of a buffer of rows `per_row` long.
    ///
    /// # Safety
    /// The rows exist, and nothing else accesses them while the slice lives.
    unsafe fn rows<'a>(self, r: Range<usize>, per_row: usize) -> &'a mut [T] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r.start * per_row), r.len() * per_row) }
    }
}

/// Rows per quantisation chunk when several threads share the work.
const QUANT_ROWS: usize = 16;

/// Runs `f` over ranges covering `0..m`, on the pool when there is enough work.
fn by_rows(pool: Option<&Pool>, m: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    match pool {
        Some(pool) if m >= 2 * QUANT_ROWS => pool.run(m.div_ceil(QUANT_ROWS), &|c| {
            f(c * QUANT_ROWS..((c + 1) * QUANT_ROWS).min(m))
        }),
        _ => f(0..m),
    }
}

/// Scale and inverse scale of a block whose largest magnitude is `amax`.
#[inline(always)]
fn scales(amax: f32) -> (f32, f32) {
    let id = if amax != 0.0 { QMAX / amax } else { 0.0 };
    (amax / QMAX, id)
}

/// Quantises `x` (a multiple of 32 long) in 32-element blocks.
pub(crate) fn quantize_q8(
    level: SimdLevel,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    assert!(x.len() == qs.len() && x.len() == d.len() * QK && d.len() == s.len());
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: the level is only chosen when the CPU has AVX2, FMA and F16C; lengths checked above.
        unsafe { avx2::quantize_q8(x, qs, d, s) };
        return;
    }
    let _ = level;
    for (((xb, qb), db), sb) in x
        .chunks_exact(QK)
        .zip(qs.chunks_exact_mut(QK))
        .zip(d.iter_mut())
        .zip(s.iter_mut())
    {
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let (dd, id) = scales(amax);
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        *db = dd;
        *sb = dd * sum as f32;
    }
}

/// Quantises `x` (a multiple of 256 long) in 256-element super-blocks with 16-element sums.
pub(crate) fn quantize_q8k(
    level: SimdLevel,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    bsums: &mut [i16],
) {
    assert!(x.len() == qs.len() && x.len() == d.len() * QK_K && x.len() == bsums.len() * KSUM);
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: the level is only chosen when the CPU has AVX2, FMA and F16C; lengths checked above.
        unsafe { avx2::quantize_q8k(x, qs, d, bsums) };
        return;
    }
    let _ = level;
    for (((xb, qb), db), bb) in x
        .chunks_exact(QK_K)
        .zip(qs.chunks_exact_mut(QK_K))
        .zip(d.iter_mut())
        .zip(bsums.chunks_exact_mut(QK_K / KSUM))
    {
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let (dd, id) = scales(amax);
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
        }
        for (b, q) in bb.iter_mut().zip(qb.chunks_exact(KSUM)) {
            *b = q.iter().map(|&v| v as i16).sum();
        }
        *db = dd;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{KSUM, QK, QK_K, scales};
    use std::arch::x86_64::*;

    /// Largest |x| of 32 floats at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn amax32(p: *const f32) -> __m256 {
        let sign = _mm256_set1_ps(-0.0);
        // SAFETY: the caller guarantees 32 readable floats at `p`.
        let v = unsafe {
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
        let a = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
        let b = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
        _mm256_max_ps(a, b)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        _mm_cvtss_f32(m)
    }

    /// Rounds 32 floats at `p` times `id` to i8, stores them at `q`, returns the i32 lane sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn round32(p: *const f32, id: f32, q: *mut i8) -> __m256i {
        let mul = _mm256_set1_ps(id);
        // SAFETY: the caller guarantees 32 readable floats at `p` and 32 writable bytes at `q`.
        unsafe {
            // Default MXCSR rounding is to nearest, ties to even: the scalar path's round_ties_even.
            let i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), mul));
            let i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8)), mul));
            let i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(16)), mul));
            let i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(24)), mul));
            let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            // The packs work per 128-bit lane; the permute restores element order.
            let a = _mm256_packs_epi32(i0, i1);
            let b = _mm256_packs_epi32(i2, i3);
            let v = _mm256_packs_epi16(a, b);
            let v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q as *mut __m256i, v);
            sum
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// # Safety
    /// AVX2, FMA and F16C present; `x.len() == qs.len() == 32·d.len() == 32·s.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
        for b in 0..d.len() {
            // SAFETY: block b lies inside x and qs (lengths checked by the caller).
            unsafe {
                let p = x.as_ptr().add(b * QK);
                let (dd, id) = scales(hmax(amax32(p)));
                let sum = hsum_i32(round32(p, id, qs.as_mut_ptr().add(b * QK)));
                *d.get_unchecked_mut(b) = dd;
                *s.get_unchecked_mut(b) = dd * sum as f32;
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C present; `x.len() == qs.len() == 256·d.len() == 16·bsums.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8k(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
        for b in 0..d.len() {
            // SAFETY: super-block b lies inside x, qs and bsums (lengths checked by the caller).
            unsafe {
                let p = x.as_ptr().add(b * QK_K);
                let mut m = _mm256_setzero_ps();
                for j in 0..QK_K / QK {
                    m = _mm256_max_ps(m, amax32(p.add(j * QK)));
                }
                let (dd, id) = scales(hmax(m));
                let q = qs.as_mut_ptr().add(b * QK_K);
                for j in 0..QK_K / QK {
                    round32(p.add(j * QK), id, q.add(j * QK));
                }
                // 16-element sums: widen to i16 and add pairs of 8-byte halves.
                for (k, o) in bsums[b * (QK_K / KSUM)..(b + 1) * (QK_K / KSUM)]
                    .iter_mut()
                    .enumerate()
                {
                    let v =
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(k * KSUM) as *const __m128i));
                    let s =
                        _mm_add_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                    let s = _mm_add_epi16(s, _mm_unpackhi_epi64(s, s));
                    let s = _mm_add_epi16(s, _mm_shufflelo_epi16(s, 0b10_11_00_01));
                    let s = _mm_add_epi16(s, _mm_shufflelo_epi16(s, 0b01_00_11_10));
                    *o = _mm_extract_epi16(s, 0) as i16;
                }
                *d.get_unchecked_mut(b) = dd;
            }
        }
    }
}
