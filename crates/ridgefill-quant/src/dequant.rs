//! Dequantisation for the f32 GEMM path: AVX2 versions of `ridgefill_io::quant`'s dequantisers
//! with the same operations in the same order (so the results are bit-identical; tested), about
//! ten times faster; other levels use ridgefill-io's directly.

use ridgefill_io::GgmlType;

use crate::simd::SimdLevel;

/// Dequantises whole blocks of `ty` from `raw` into `out` (`out.len()` values; sizes checked
/// by the caller's constructor, re-checked by ridgefill-io on the portable path).
pub(crate) fn dequantize_into(level: SimdLevel, ty: GgmlType, raw: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        let (block, ts) = (ty.block_size(), ty.type_size());
        assert!(
            out.len().is_multiple_of(block) && raw.len() == out.len() / block * ts,
            "dequantize_into: {} values of {ty} need {} bytes, found {}",
            out.len(),
            out.len() / block * ts,
            raw.len()
        );
        // SAFETY: Avx2 is only chosen when the CPU has AVX2, FMA and F16C; sizes checked above.
        if unsafe { avx2::dequantize_into(ty, raw, out) } {
            return;
        }
    }
    let _ = level;
    // Sizes were validated when the matrix was built; a type without a dequantiser cannot get
    // here (QMatrix::new accepts only types ridgefill-io dequantises).
    let _ = ridgefill_io::quant::dequantize_into(ty, raw, out);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use ridgefill_io::GgmlType;

    use crate::kernels::k4_scales;
    use crate::kernels::layout::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees two readable bytes at `p`.
        let h = unsafe { (p as *const u16).read_unaligned() };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// 16 packed bytes → 32 nibble values: low nibbles (values 0..16) then high nibbles.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
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
    unsafe fn bits32(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees four readable bytes at `p`.
        let v = unsafe { (p as *const u32).read_unaligned() };
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

    /// Byte lanes `8k..8k+8` of `v` (unsigned, or signed with `SIGNED`) as eight f32, minus `sub`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lanes8<const SIGNED: bool>(v: __m256i, k: usize, sub: i32) -> __m256 {
        let half = if k < 2 {
            _mm256_castsi256_si128(v)
        } else {
            _mm256_extracti128_si256(v, 1)
        };
        let eight = if k.is_multiple_of(2) {
            half
        } else {
            _mm_unpackhi_epi64(half, half)
        };
        let i = if SIGNED {
            _mm256_cvtepi8_epi32(eight)
        } else {
            _mm256_cvtepu8_epi32(eight)
        };
        _mm256_cvtepi32_ps(_mm256_sub_epi32(i, _mm256_set1_epi32(sub)))
    }

    /// Writes `32` values `f(q_k)` for the byte lanes of `q` to `out`.
    ///
    /// # Safety
    /// 32 writable floats at `out`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store32<const SIGNED: bool>(
        q: __m256i,
        sub: i32,
        out: *mut f32,
        f: impl Fn(__m256) -> __m256,
    ) {
        for k in 0..4 {
            // SAFETY: guaranteed by the caller.
            unsafe { _mm256_storeu_ps(out.add(8 * k), f(lanes8::<SIGNED>(q, k, sub))) };
        }
    }

    /// Dequantises `raw` into `out` (sizes checked by the caller). Returns `false` for types it
    /// does not handle (the caller then uses ridgefill-io).
    ///
    /// Every formula is ridgefill-io's, operation for operation (multiply then add, no fused
    /// multiply-add), so the output is bit-identical.
    ///
    /// # Safety
    /// AVX2, FMA and F16C present; `raw` holds exactly the blocks of `out.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize_into(ty: GgmlType, raw: &[u8], out: &mut [f32]) -> bool {
        let ts = ty.type_size();
        let n_blocks = raw.len() / ts;
        let mul = |d: f32| move |v: __m256| _mm256_mul_ps(_mm256_set1_ps(d), v);
        let mul_add = |d: f32, m: f32| {
            move |v: __m256| _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), v), _mm256_set1_ps(m))
        };
        let mul_sub = |d: f32, m: f32| {
            move |v: __m256| _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(d), v), _mm256_set1_ps(m))
        };
        // SAFETY (whole match): block b occupies raw[b·ts..(b+1)·ts] and out[b·block..], both in
        // bounds by the caller's size check; every pointer below stays inside its block.
        unsafe {
            let src = raw.as_ptr();
            let dst = out.as_mut_ptr();
            match ty {
                GgmlType::Q4_0 => {
                    for b in 0..n_blocks {
                        let p = src.add(b * ts);
                        store32::<false>(nibbles(p.add(2)), 8, dst.add(b * 32), mul(f16_at(p)));
                    }
                }
                GgmlType::Q4_1 => {
                    for b in 0..n_blocks {
                        let p = src.add(b * ts);
                        let f = mul_add(f16_at(p), f16_at(p.add(2)));
                        store32::<false>(nibbles(p.add(4)), 0, dst.add(b * 32), f);
                    }
                }
                GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    let q5_1 = ty == GgmlType::Q5_1;
                    let (qh, qs) = if q5_1 { (4, 8) } else { (2, 6) };
                    for b in 0..n_blocks {
                        let p = src.add(b * ts);
                        let hi = _mm256_and_si256(bits32(p.add(qh)), _mm256_set1_epi8(0x10));
                        let q = _mm256_or_si256(nibbles(p.add(qs)), hi);
                        let o = dst.add(b * 32);
                        if q5_1 {
                            store32::<false>(q, 0, o, mul_add(f16_at(p), f16_at(p.add(2))));
                        } else {
                            store32::<false>(q, 16, o, mul(f16_at(p)));
                        }
                    }
                }
                GgmlType::Q8_0 => {
                    for b in 0..n_blocks {
                        let p = src.add(b * ts);
                        let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
                        store32::<true>(q, 0, dst.add(b * 32), mul(f16_at(p)));
                    }
                }
                GgmlType::Q4_K | GgmlType::Q5_K => {
                    let five = ty == GgmlType::Q5_K;
                    let qs_at = if five { Q5K_QS } else { Q4K_QS };
                    let one = _mm256_set1_epi8(1);
                    for b in 0..n_blocks {
                        let p = src.add(b * ts);
                        let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
                        let (sc, mn) = k4_scales(&*(p.add(K_SCALES) as *const [u8; 12]));
                        let mut hbits = if five {
                            _mm256_loadu_si256(p.add(K_QH) as *const __m256i)
                        } else {
                            _mm256_setzero_si256()
                        };
                        for c in 0..4 {
                            let qb = _mm256_loadu_si256(p.add(qs_at + 32 * c) as *const __m256i);
                            let mut lo = _mm256_and_si256(qb, _mm256_set1_epi8(0x0F));
                            let mut hi =
                                _mm256_and_si256(_mm256_srli_epi16(qb, 4), _mm256_set1_epi8(0x0F));
                            if five {
                                let h0 = _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4);
                                let h1 = _mm256_slli_epi16(
                                    _mm256_and_si256(_mm256_srli_epi16(hbits, 1), one),
                                    4,
                                );
                                lo = _mm256_or_si256(lo, h0);
                                hi = _mm256_or_si256(hi, h1);
                                hbits = _mm256_srli_epi16(hbits, 2);
                            }
                            let s = |j: usize| ((sc >> (8 * j)) & 0xFF) as f32;
                            let m = |j: usize| ((mn >> (8 * j)) & 0xFF) as f32;
                            let o = dst.add(b * 256 + 64 * c);
                            let (j0, j1) = (2 * c, 2 * c + 1);
                            store32::<false>(lo, 0, o, mul_sub(d * s(j0), dmin * m(j0)));
                            store32::<false>(hi, 0, o.add(32), mul_sub(d * s(j1), dmin * m(j1)));
                        }
                    }
                }
                GgmlType::Q6_K => {
                    let m4 = _mm256_set1_epi8(0x0F);
                    for b in 0..n_blocks {
                        let p = src.add(b * ts);
                        let d = f16_at(p.add(Q6K_D));
                        let sc = |i: usize| d * (*p.add(Q6K_SCALES + i) as i8) as f32;
                        for h in 0..2 {
                            let ql0 = _mm256_loadu_si256(p.add(h * 64) as *const __m256i);
                            let ql1 = _mm256_loadu_si256(p.add(h * 64 + 32) as *const __m256i);
                            let qh = _mm256_loadu_si256(p.add(Q6K_QH + h * 32) as *const __m256i);
                            let q = [
                                _mm256_or_si256(
                                    _mm256_and_si256(ql0, m4),
                                    _mm256_slli_epi16(
                                        _mm256_and_si256(qh, _mm256_set1_epi8(0x03)),
                                        4,
                                    ),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(ql1, m4),
                                    _mm256_slli_epi16(
                                        _mm256_and_si256(qh, _mm256_set1_epi8(0x0C)),
                                        2,
                                    ),
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
                                // Values 0..16 of group g use scale 8h+2g, values 16..32 the next.
                                let o = dst.add(b * 256 + h * 128 + g * 32);
                                let (s0, s1) = (sc(8 * h + 2 * g), sc(8 * h + 2 * g + 1));
                                for k in 0..4 {
                                    let s = if k < 2 { s0 } else { s1 };
                                    let v = lanes8::<false>(q, k, 32);
                                    _mm256_storeu_ps(
                                        o.add(8 * k),
                                        _mm256_mul_ps(_mm256_set1_ps(s), v),
                                    );
                                }
                            }
                        }
                    }
                }
                GgmlType::F16 => {
                    let n = out.len();
                    let mut k = 0;
                    while k + 8 <= n {
                        let h = _mm_loadu_si128(src.add(2 * k) as *const __m128i);
                        _mm256_storeu_ps(dst.add(k), _mm256_cvtph_ps(h));
                        k += 8;
                    }
                    for t in k..n {
                        *dst.add(t) = f16_at(src.add(2 * t));
                    }
                }
                GgmlType::BF16 => {
                    let n = out.len();
                    let mut k = 0;
                    while k + 8 <= n {
                        let h = _mm_loadu_si128(src.add(2 * k) as *const __m128i);
                        let v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
                        _mm256_storeu_ps(dst.add(k), _mm256_castsi256_ps(v));
                        k += 8;
                    }
                    for t in k..n {
                        let h = (src.add(2 * t) as *const u16).read_unaligned();
                        *dst.add(t) = f32::from_bits((h as u32) << 16);
                    }
                }
                GgmlType::F32 => {
                    std::ptr::copy_nonoverlapping(src, dst as *mut u8, raw.len());
                }
                _ => return false,
            }
        }
        true
    }
}
