//! AVX-512 attention of a block of stacked query rows (a GQA group's heads × up to 64 / group
//! prompt rows) over one chunk of keys. Scores are kept keys × rows: each K element is broadcast
//! to every row at once (no horizontal sums), the softmax runs down the keys lane by lane, and
//! each V element is broadcast to every row's weights, a block of keys at a time while it is in
//! L1. A row's result is the same sums in the same order whatever rows share its block, which
//! lets a follow-up's rows equal their cold prefill's bit for bit.
//!
//! Written by hand because the `gemm` crate, which the prompt rows used before, packs a head's
//! whole K and V afresh for each block of rows, so a follow-up's 19 rows had to be cut into two
//! blocks (each reading the head's K/V again) to keep two threads busy; here a head's keys are
//! split among the tasks instead. 19 rows over 3019 keys, SmolLM2's 9/3 heads, 30 layers of K/V
//! from memory, Xeon model 167: 1.24 → 0.81 ms a layer on 2 threads (1.85 → 1.69 on one); a
//! fresh 512-token prompt's attention 61.8 → 52.6 ms over the 30 layers.

use std::arch::x86_64::*;

use super::prefetch_bytes;
use crate::cpu::simd::{EXP_LN2_HI, EXP_LN2_LO, EXP_MAX, EXP_MIN, EXP_POLY, EXP_ROUND};

/// f32 lanes per vector.
const W: usize = 16;
/// Stacked query rows the kernel takes: four vectors of lanes.
pub const BLOCK_ROWS_MAX: usize = 4 * W;
/// Keys whose V rows are weighted together per pass over the head dimension (32 KB of f32 V at
/// `hd` 64: the block stays in L1 while every column block reads it).
const VALUE_KEYS: usize = 64;

/// Keys ahead whose K rows are prefetched while a block of keys is scored: the cache streams
/// from memory (every other layer's K/V went through the caches since).
const PREFETCH_KEYS: usize = 32;

/// The kernel's buffers, kept per thread across calls.
#[derive(Default)]
pub struct F32Scratch {
    /// Queries transposed and scaled: `[hd, lanes]`.
    qt: Vec<f32>,
    /// Scores, then softmax weights: `[keys, lanes]`.
    s: Vec<f32>,
    /// Outputs transposed, before the division by the softmax sums: `[hd, lanes]`.
    ot: Vec<f32>,
}

/// One call's inputs: stacked query rows over one chunk of keys.
#[derive(Clone, Copy)]
pub struct BlockIn<'a> {
    /// Stacked query rows, `[m, hd]` row-major.
    pub q: &'a [f32],
    pub hd: usize,
    /// Keys each row sees, `[m]`.
    pub live: &'a [usize],
    /// Key `j` at `ks + j·k_row`, value `j` at `vs + j·v_row`, `hd` f32s each.
    pub ks: *const f32,
    pub k_row: usize,
    pub vs: *const f32,
    pub v_row: usize,
    /// Multiplies every score.
    pub scale: f32,
}

/// Whether the CPU runs [`f32_block`] for head size `hd`.
pub fn available(hd: usize) -> bool {
    hd > 0
        && hd.is_multiple_of(W)
        && crate::cpu::simd::Width::current() == crate::cpu::simd::Width::Avx512
}

/// [`super::group_block`] on the AVX-512 FMA units.
///
/// # Safety
/// As [`super::group_block`], with [`available`]`(hd)`.
pub unsafe fn f32_block(x: BlockIn, buf: &mut F32Scratch, o: &mut [f32], stats: &mut [(f32, f32)]) {
    let m = x.live.len();
    let args = (x, buf, o, stats);
    // SAFETY: forwarded from the caller, who checked the row counts.
    unsafe {
        match m.div_ceil(W) {
            1 => run::<1, 24, 16>(args),
            2 => run::<2, 12, 8>(args),
            3 => run::<3, 8, 8>(args),
            _ => run::<4, 6, 4>(args),
        }
    }
}

/// [`f32_block`]'s arguments, in order.
type Args<'a> = (
    BlockIn<'a>,
    &'a mut F32Scratch,
    &'a mut [f32],
    &'a mut [(f32, f32)],
);

/// [`f32_block`] with `NV` vectors of rows, `KEYS` keys scored per pass and `DIMS` value
/// columns weighted per pass (`KEYS·NV` and `DIMS·NV` accumulators, of 32 registers).
#[target_feature(enable = "avx512f")]
unsafe fn run<const NV: usize, const KEYS: usize, const DIMS: usize>((x, buf, o, stats): Args) {
    let BlockIn {
        q,
        hd,
        live,
        ks,
        k_row,
        vs,
        v_row,
        scale,
    } = x;
    let lanes = NV * W;
    let m = live.len();
    let n = live.iter().copied().max().unwrap_or(0);
    transposed_queries(q, hd, m, lanes, scale, &mut buf.qt);
    buf.s.resize(n * lanes, 0.0);
    buf.ot.clear();
    buf.ot.resize(hd * lanes, 0.0);
    let (qt, s, ot) = (buf.qt.as_ptr(), buf.s.as_mut_ptr(), buf.ot.as_mut_ptr());
    let row_bytes = hd * size_of::<f32>();
    // SAFETY: qt holds hd·lanes, s n·lanes, ot hd·lanes floats; keys and values j < n are
    // readable (caller).
    unsafe {
        // Scores, KEYS keys at a time: s[j] = Σ_d K[j, d] · qt[d].
        let mut j0 = 0;
        while j0 < n {
            let count = KEYS.min(n - j0);
            for u in 0..KEYS {
                let j = j0 + PREFETCH_KEYS + u;
                prefetch_bytes(ks.wrapping_add(j * k_row) as *const i8, row_bytes);
                prefetch_bytes(vs.wrapping_add(j * v_row) as *const i8, row_bytes);
            }
            let mut acc = [[_mm512_setzero_ps(); NV]; KEYS];
            if count == KEYS {
                for d in 0..hd {
                    let qv: [__m512; NV] =
                        std::array::from_fn(|v| _mm512_loadu_ps(qt.add(d * lanes + v * W)));
                    for (u, a) in acc.iter_mut().enumerate() {
                        let kb = _mm512_set1_ps(*ks.add((j0 + u) * k_row + d));
                        for v in 0..NV {
                            a[v] = _mm512_fmadd_ps(kb, qv[v], a[v]);
                        }
                    }
                }
            } else {
                for d in 0..hd {
                    let qv: [__m512; NV] =
                        std::array::from_fn(|v| _mm512_loadu_ps(qt.add(d * lanes + v * W)));
                    for (u, a) in acc.iter_mut().enumerate().take(count) {
                        let kb = _mm512_set1_ps(*ks.add((j0 + u) * k_row + d));
                        for v in 0..NV {
                            a[v] = _mm512_fmadd_ps(kb, qv[v], a[v]);
                        }
                    }
                }
            }
            for (u, a) in acc.iter().enumerate().take(count) {
                for (v, x) in a.iter().enumerate() {
                    _mm512_storeu_ps(s.add((j0 + u) * lanes + v * W), *x);
                }
            }
            j0 += count;
        }
        let (top, sum) = softmax_keys::<NV>(s, n, lanes, live);
        // Weighted values, a block of keys at a time, DIMS columns per pass over the block:
        // ot[d] += Σ_j V[j, d] · s[j].
        let mut j0 = 0;
        while j0 < n {
            let end = (j0 + VALUE_KEYS).min(n);
            let mut d0 = 0;
            while d0 < hd {
                let mut acc: [[__m512; NV]; DIMS] = std::array::from_fn(|u| {
                    std::array::from_fn(|v| _mm512_loadu_ps(ot.add((d0 + u) * lanes + v * W)))
                });
                for j in j0..end {
                    let p: [__m512; NV] =
                        std::array::from_fn(|v| _mm512_loadu_ps(s.add(j * lanes + v * W)));
                    let row = vs.add(j * v_row + d0);
                    for (u, a) in acc.iter_mut().enumerate() {
                        let vb = _mm512_set1_ps(*row.add(u));
                        for v in 0..NV {
                            a[v] = _mm512_fmadd_ps(vb, p[v], a[v]);
                        }
                    }
                }
                for (u, a) in acc.iter().enumerate() {
                    for (v, x) in a.iter().enumerate() {
                        _mm512_storeu_ps(ot.add((d0 + u) * lanes + v * W), *x);
                    }
                }
                d0 += DIMS;
            }
            j0 = end;
        }
        let mut tops = [0f32; BLOCK_ROWS_MAX];
        let mut sums = [0f32; BLOCK_ROWS_MAX];
        for v in 0..NV {
            _mm512_storeu_ps(tops.as_mut_ptr().add(v * W), top[v]);
            _mm512_storeu_ps(sums.as_mut_ptr().add(v * W), sum[v]);
        }
        for r in 0..m {
            stats[r] = (tops[r], sums[r]);
            for d in 0..hd {
                o[r * hd + d] = *ot.add(d * lanes + r);
            }
        }
    }
}

/// `qt[d, r] = scale · q[r, d]` for `lanes` columns, the padding lanes `m..` zero queries
/// (finite scores, never read back).
///
/// # Shapes
/// - q: `[m, hd]`; qt: `[hd, lanes]`
fn transposed_queries(q: &[f32], hd: usize, m: usize, lanes: usize, scale: f32, qt: &mut Vec<f32>) {
    qt.clear();
    qt.resize(hd * lanes, 0.0);
    for r in 0..m {
        for d in 0..hd {
            qt[d * lanes + r] = scale * q[r * hd + d];
        }
    }
}

/// The softmax down keys `0..n` of scores kept keys × `lanes` at `s`, lane by lane, in place:
/// `s[j, r] = e^(s[j, r] − top[r])`, 0 for keys row `r` does not see (`j ≥ live[r]`; padding
/// lanes see every key). Returns each lane's largest score and sum.
///
/// # Safety
/// `s` holds `n · lanes` floats; `lanes = NV · 16 ≥ live.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn softmax_keys<const NV: usize>(
    s: *mut f32,
    n: usize,
    lanes: usize,
    live: &[usize],
) -> ([__m512; NV], [__m512; NV]) {
    let seen_by_all = live.iter().copied().min().unwrap_or(0);
    let mut seen = [0i32; BLOCK_ROWS_MAX];
    for (r, x) in seen.iter_mut().enumerate().take(lanes) {
        *x = live.get(r).copied().unwrap_or(n) as i32;
    }
    // SAFETY: the caller's contract; `seen` holds BLOCK_ROWS_MAX ≥ lanes counts.
    unsafe {
        let seen: [__m512i; NV] =
            std::array::from_fn(|v| _mm512_loadu_si512(seen.as_ptr().add(v * W) as *const _));
        // Softmax down the keys, lane by lane; keys a row does not see weigh 0.
        let hidden = |j: usize, v: usize| -> __mmask16 {
            if j < seen_by_all {
                0
            } else {
                !_mm512_cmpgt_epi32_mask(seen[v], _mm512_set1_epi32(j as i32))
            }
        };
        let mut top = [_mm512_set1_ps(f32::NEG_INFINITY); NV];
        for j in 0..n {
            for (v, t) in top.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(s.add(j * lanes + v * W));
                let x = _mm512_mask_mov_ps(x, hidden(j, v), _mm512_set1_ps(f32::NEG_INFINITY));
                *t = _mm512_max_ps(*t, x);
            }
        }
        let mut sum = [_mm512_setzero_ps(); NV];
        for j in 0..n {
            for v in 0..NV {
                let at = s.add(j * lanes + v * W);
                let p = exp512(_mm512_sub_ps(_mm512_loadu_ps(at), top[v]));
                let p = _mm512_maskz_mov_ps(!hidden(j, v), p);
                sum[v] = _mm512_add_ps(sum[v], p);
                _mm512_storeu_ps(at, p);
            }
        }
        (top, sum)
    }
}

/// `e^x` lane by lane, the same Cephes polynomial as [`crate::cpu::simd::exp`].
#[inline]
#[target_feature(enable = "avx512f")]
fn exp512(x: __m512) -> __m512 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
        _mm512_set1_ps(EXP_MAX),
    );
    let round = _mm512_set1_ps(EXP_ROUND);
    let n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), round), round);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let biased = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(n, _mm512_set1_ps(EXP_ROUND + 127.0))),
        _mm512_castps_si512(round),
    );
    _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
}
