//! `y = x·Wᵀ` in f32 for a few activation rows against a dequantised weight chunk: the prompt
//! path's GEMM below [`SMALL_M_MAX`] rows, where a follow-up turn's or a short prompt's rows
//! land. The model's fill also scores a prompt's tail against cached keys with it.
//!
//! Why hand-written: the `gemm` crate packs both operands on every call and tiles the output
//! 16 × 6; a chat turn's 8–31 rows against a 64-row weight chunk spend most of their time in
//! that packing and in part-empty tiles (SmolLM2 Q4_1, pp19 on 2 AVX2 threads: 40% of samples
//! in its micro-kernels, 29% in its driver and packing, 13% dequantising). Here each output is
//! one dot product over the row-major operands as they lie, 3 weight rows × 4 activation rows
//! a pass (12 accumulators: every weight and activation vector loaded once serves 4 and 3
//! multiply-adds), with no copy. The rounding is an f32 dot product's (8 lanes, then summed),
//! not the GEMM's; prompt rows on either side agree to f32 GEMM noise (`tests/kernels.rs`).
//!
//! Measured side by side with the gemm crate (AMD EPYC Zen 4, AVX2, 2 threads, `ridgefill bench
//! -p 8,19,31 -n 0 -r 5`, two rounds): pp8 45.7 / 47.3 → 24.3 / 26.0 ms, pp19 62.8 / 63.3 →
//! 44.4 / 44.3 ms, pp31 80.4 / 79.7 → 65.7 / 64.9 ms; with the tiles up to 256 rows, pp48–pp128
//! were within noise of the GEMM and pp256 slower (437 against 530–604 t/s): [`SMALL_M_MAX`].

use crate::simd::SimdLevel;

/// Below this many activation rows the prompt path uses [`dot_tiles`] where the CPU has it.
pub(crate) const SMALL_M_MAX: usize = 64;

/// `y[i·ys + j] = Σ_c x[i·k + c] · w[j·k + c]` for the `m = x.len() / k` activation rows and
/// `n = w.len() / k` weight rows; returns false (nothing written) where `level` has no kernel,
/// so the caller runs its GEMM.
///
/// # Shapes
/// - x: `[m, k]`, w: `[n, k]` → y: `[m, n]` with row stride `ys`
///
/// # Safety
/// `y` is valid for writes at `i·ys + j` for every `i < m`, `j < n`, and nothing else reads or
/// writes those elements during the call.
pub unsafe fn dot_tiles(
    level: SimdLevel,
    x: &[f32],
    w: &[f32],
    k: usize,
    y: *mut f32,
    ys: usize,
) -> bool {
    assert!(
        k > 0 && x.len().is_multiple_of(k) && w.len().is_multiple_of(k),
        "operands are not whole rows of {k}"
    );
    let (m, n) = (x.len() / k, w.len() / k);
    #[cfg(target_arch = "x86_64")]
    if has_dot_tiles(level) {
        // SAFETY: both levels with tiles include AVX2 and FMA, and this one is available; x
        // and w hold m and n whole rows, and the caller guarantees `y`.
        unsafe { avx2::dot_tiles(x, m, w, n, k, y, ys) };
        return true;
    }
    let _ = (level, x, m, w, n, k, y, ys);
    false
}

/// Whether [`dot_tiles`] runs at `level` on this CPU. With AVX-512 the gemm crate runs 512-bit
/// tiles; these were measured against it only on CPUs without (AVX2), so AVX-512 machines keep
/// it.
pub fn has_dot_tiles(level: SimdLevel) -> bool {
    cfg!(target_arch = "x86_64")
        && matches!(level, SimdLevel::Avx2 | SimdLevel::AvxVnni)
        && level.is_available()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Weight rows a pass holds in registers.
    const J: usize = 3;
    /// Activation rows a pass streams against them (J·I accumulators + J weight vectors + one
    /// activation vector: the 16 ymm registers).
    const I: usize = 4;
    /// f32 lanes per vector.
    const LANES: usize = 8;

    /// [`super::dot_tiles`] on AVX2 + FMA.
    ///
    /// # Safety
    /// As [`super::dot_tiles`], and the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_tiles(
        x: &[f32],
        m: usize,
        w: &[f32],
        n: usize,
        k: usize,
        y: *mut f32,
        ys: usize,
    ) {
        let mut j0 = 0;
        while j0 < n {
            let jn = J.min(n - j0);
            let mut i0 = 0;
            while i0 < m {
                let i_n = I.min(m - i0);
                // SAFETY: rows j0..j0+jn of w and i0..i0+i_n of x lie inside the slices (m and n
                // are their whole rows); y as the caller guarantees.
                unsafe {
                    match (jn, i_n) {
                        (3, 4) => tile::<3, 4>(x, i0, w, j0, k, y, ys),
                        (3, 3) => tile::<3, 3>(x, i0, w, j0, k, y, ys),
                        (3, 2) => tile::<3, 2>(x, i0, w, j0, k, y, ys),
                        (3, _) => tile::<3, 1>(x, i0, w, j0, k, y, ys),
                        (2, 4) => tile::<2, 4>(x, i0, w, j0, k, y, ys),
                        (2, 3) => tile::<2, 3>(x, i0, w, j0, k, y, ys),
                        (2, 2) => tile::<2, 2>(x, i0, w, j0, k, y, ys),
                        (2, _) => tile::<2, 1>(x, i0, w, j0, k, y, ys),
                        (_, 4) => tile::<1, 4>(x, i0, w, j0, k, y, ys),
                        (_, 3) => tile::<1, 3>(x, i0, w, j0, k, y, ys),
                        (_, 2) => tile::<1, 2>(x, i0, w, j0, k, y, ys),
                        (_, _) => tile::<1, 1>(x, i0, w, j0, k, y, ys),
                    }
                }
                i0 += i_n;
            }
            j0 += jn;
        }
    }

    /// Outputs `[i0..i0+IN] × [j0..j0+JN]`: each an 8-lane FMA chain over `k`, summed across
    /// lanes, then the columns past the last full vector added one by one.
    ///
    /// # Safety
    /// Rows `j0..j0+JN` of `w` and `i0..i0+IN` of `x` exist (`k` floats each), `y` is valid for
    /// those outputs, and the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const JN: usize, const IN: usize>(
        x: &[f32],
        i0: usize,
        w: &[f32],
        j0: usize,
        k: usize,
        y: *mut f32,
        ys: usize,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); IN]; JN];
        let full = k / LANES * LANES;
        let mut c = 0;
        while c < full {
            // SAFETY: c + 8 ≤ k, so every load stays inside its row.
            unsafe {
                let wv: [__m256; JN] =
                    std::array::from_fn(|j| _mm256_loadu_ps(wp.add((j0 + j) * k + c)));
                for i in 0..IN {
                    let xv = _mm256_loadu_ps(xp.add((i0 + i) * k + c));
                    for (a, &wj) in acc.iter_mut().zip(&wv) {
                        a[i] = _mm256_fmadd_ps(wj, xv, a[i]);
                    }
                }
            }
            c += LANES;
        }
        for (j, row) in acc.iter().enumerate() {
            for (i, &a) in row.iter().enumerate() {
                let mut s = hsum(a);
                for t in full..k {
                    s += x[(i0 + i) * k + t] * w[(j0 + j) * k + t];
                }
                // SAFETY: (i0 + i, j0 + j) is an output the caller vouched for.
                unsafe { *y.add((i0 + i) * ys + j0 + j) = s };
            }
        }
    }

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic value in [-1, 1) per index.
    fn value(i: usize, salt: usize) -> f32 {
        let h = (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 2001;
        h as f32 / 1000.0 - 1.0
    }

    #[test]
    fn dot_tiles_match_f64_dot_products_on_every_tile_shape() {
        let avx2 = SimdLevel::Avx2.is_available();
        let level = if avx2 {
            SimdLevel::Avx2
        } else {
            SimdLevel::Scalar
        };
        // Row counts cover every remainder of the 3 × 4 tile; widths a whole vector, a ragged
        // tail, and a model's.
        for (m, n, k) in [(1, 1, 8), (5, 7, 13), (4, 3, 3), (19, 64, 576), (9, 11, 40)] {
            let x: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
            let w: Vec<f32> = (0..n * k).map(|i| value(i, 2)).collect();
            // A row stride past n: the kernel must leave the gap alone.
            let ys = n + 2;
            let mut y = vec![f32::NAN; m * ys];
            // SAFETY: y holds m rows of ys ≥ n elements, all ours.
            let ran = unsafe { dot_tiles(level, &x, &w, k, y.as_mut_ptr(), ys) };
            assert_eq!(ran, avx2, "the kernel runs wherever AVX2 does");
            if !ran {
                continue;
            }
            for i in 0..m {
                for j in 0..ys {
                    let got = y[i * ys + j];
                    if j >= n {
                        assert!(got.is_nan(), "({i}, {j}) past n was written");
                        continue;
                    }
                    let want: f64 = (0..k)
                        .map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c]))
                        .sum();
                    let tol = 1e-5 * (k as f64).sqrt();
                    assert!(
                        (f64::from(got) - want).abs() <= tol,
                        "m={m} n={n} k={k} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn levels_without_the_kernel_leave_the_gemm_to_run() {
        let mut y = [0.0f32; 1];
        // SAFETY: one output, ours.
        let ran = unsafe {
            dot_tiles(
                SimdLevel::Scalar,
                &[1.0; 8],
                &[1.0; 8],
                8,
                y.as_mut_ptr(),
                1,
            )
        };
        assert!(!ran);
        assert_eq!(y[0], 0.0);
    }
}
