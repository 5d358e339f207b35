//! AVX-512 decode attention for one GQA group: the query heads that share a K/V head are scored
//! against each key while its row is in L1, and weighted with each value row read once; AVX2
//! machines run [`avx2`]'s kernel of the same shape.
//!
//! Written by hand because the portable loops in `cpu/attention/mod.rs` leave a horizontal sum per key and
//! head: the compiler vectorised `dot_scores` two floats wide without FMA, and it was 16% of an
//! eight-sequence decode step (docs/history/BENCHMARKS-history.md). Here sixteen keys' partial sums are reduced
//! together by a shuffle tree (about three instructions per key). K and V are read as f32 or
//! as f16 (the fused path's cache), widened in registers. A few prefill rows over a long cache
//! (a follow-up turn) go to [`block`]'s kernel.

mod amx;
mod avx2;
mod block;

pub use block::{BLOCK_ROWS_MAX, BlockIn, available as block_available};

use std::arch::x86_64::*;

use half::f16;

use crate::cpu::simd::{Width, exp_shifted_sum, max_of};

/// A cached K/V element type: f32, or f16 widened on load.
pub trait KvElem: Copy {
    const HALF: bool;
}

impl KvElem for f32 {
    const HALF: bool = false;
}

impl KvElem for f16 {
    const HALF: bool = true;
}

/// Sixteen elements at `p` as f32.
///
/// # Safety
/// Sixteen readable elements at `p`.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
    // SAFETY: the caller's contract (32 bytes for f16, 64 for f32).
    unsafe {
        if E::HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        } else {
            _mm512_loadu_ps(p as *const f32)
        }
    }
}

/// f32 lanes per vector.
const W: usize = 16;
/// Keys scored per pass: one vector of partial sums each, reduced together.
const KEY_BLOCK: usize = 16;
/// Vector accumulators the value pass keeps in registers (of 32), split among the heads.
const VALUE_REGS: usize = 16;
/// Keys ahead whose K (and V) lines are prefetched while the first head is scored.
const PREFETCH_KEYS: usize = 16;
/// Bytes per cache line (one prefetch each).
const LINE: usize = 64;

/// Prefetches the `bytes` bytes at `p` into L1, a line at a time (a prefetch never faults).
#[inline]
#[target_feature(enable = "sse")]
fn prefetch_bytes(p: *const i8, bytes: usize) {
    let mut at = 0;
    while at < bytes {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at));
        at += LINE;
    }
}

/// Whether the CPU runs these kernels (or the AVX2 ones) and `hd` is one they take.
pub fn available(hd: usize) -> bool {
    match Width::current() {
        Width::Avx512 => {
            matches!(hd / W, 4 | 8 | 16)
                && hd.is_multiple_of(W)
                && std::arch::is_x86_feature_detected!("f16c")
        }
        Width::Avx2 => avx2::available(hd),
        Width::Scalar => false,
    }
}

/// The block kernels' buffers (the f32 one's and the AMX one's), kept per thread across calls.
#[derive(Default)]
pub struct BlockScratch {
    f32: block::F32Scratch,
    amx: amx::AmxScratch,
}

/// One key range's softmax part for stacked query rows `r` (as [`group_part`]):
/// `stats[r] = (m, l)` with `m` the largest of the scores `s_j = scale · q_r·k_j` over the keys
/// `j < live[r]` the row sees and `l = Σ_j e^(s_j − m)`, and `o[r] = Σ_j e^(s_j − m) v_j`. A
/// row that sees no key gets `(−∞, 0)` and zeros. On the AVX-512 FMA units ([`block`]), or on
/// AMX tiles ([`amx`]) with `RIDGEFILL_AMX=on` where the CPU has them; either way a row's result
/// does not depend on the rows sharing its block.
///
/// # Shapes
/// - q, o: `[m, hd]` row-major; live, stats: `[m]`, m ≤ [`BLOCK_ROWS_MAX`]
///
/// # Safety
/// [`block_available`]`(hd)`; keys `j < max(live)` are at `ks + j·k_row` and values at
/// `vs + j·v_row`, `hd` readable f32s each.
pub unsafe fn group_block(
    x: BlockIn,
    buf: &mut BlockScratch,
    o: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let (q, hd, m) = (x.q, x.hd, x.live.len());
    assert!(
        (1..=BLOCK_ROWS_MAX).contains(&m)
            && q.len() == m * hd
            && o.len() == m * hd
            && stats.len() == m,
        "group_block: {m} rows of {hd} (q {}, o {}, stats {})",
        q.len(),
        o.len(),
        stats.len()
    );
    // SAFETY: forwarded from the caller; `usable` checked the switch, the CPU (AMX) and `hd`.
    unsafe {
        if amx::usable(hd) {
            amx::group_block(x, &mut buf.amx, o, stats)
        } else {
            block::f32_block(x, &mut buf.f32, o, stats)
        }
    }
}

/// One query row per head of a GQA group against the group's first `n` keys:
/// `outs[h] = softmax(scale · K qs[h]) V`.
///
/// # Safety
/// As [`group_part`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn group_row<E: KvElem>(
    qs: &[&[f32]],
    ks: *const E,
    k_row: usize,
    vs: *const E,
    v_row: usize,
    n: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    outs: &mut [&mut [f32]],
) {
    let mut stats = vec![(0f32, 0f32); qs.len()];
    // SAFETY: forwarded from the caller.
    unsafe { group_part(qs, ks, k_row, vs, v_row, n, scale, scores, outs, &mut stats) };
    for (o, &(_, sum)) in outs.iter_mut().zip(&stats) {
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// [`group_row`] before the division by the softmax's sum, so that parts of one row over
/// separate key ranges can be merged: `stats[h] = (m, l)` with `m` the largest score and
/// `l = Σ_j e^(s_j − m)`, and `outs[h] = Σ_j e^(s_j − m) v_j`.
///
/// # Safety
/// [`available`]`(hd)` holds for `hd = qs[h].len()` (the same for every head and `outs[h]`);
/// keys `j < n` are at `ks + j·k_row` and values at `vs + j·v_row`, `hd` readable elements each;
/// `n ≥ 1`; `stats` holds one pair per head.
#[allow(clippy::too_many_arguments)]
pub unsafe fn group_part<E: KvElem>(
    qs: &[&[f32]],
    ks: *const E,
    k_row: usize,
    vs: *const E,
    v_row: usize,
    n: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    outs: &mut [&mut [f32]],
    stats: &mut [(f32, f32)],
) {
    if Width::current() != Width::Avx512 {
        // SAFETY: forwarded from the caller; `available` checked the CPU and `hd`.
        unsafe { avx2::group_part(qs, ks, k_row, vs, v_row, n, scale, scores, outs, stats) };
        return;
    }
    let g = qs.len();
    scores.clear();
    scores.resize(g * n, 0.0);
    // SAFETY: forwarded from the caller; `available` checked the CPU and `hd`.
    unsafe {
        match qs[0].len() / W {
            4 => run::<E, 4>(qs, ks, k_row, vs, v_row, n, scale, scores, outs, stats),
            8 => run::<E, 8>(qs, ks, k_row, vs, v_row, n, scale, scores, outs, stats),
            _ => run::<E, 16>(qs, ks, k_row, vs, v_row, n, scale, scores, outs, stats),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn run<E: KvElem, const D: usize>(
    qs: &[&[f32]],
    ks: *const E,
    k_row: usize,
    vs: *const E,
    v_row: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    outs: &mut [&mut [f32]],
    stats: &mut [(f32, f32)],
) {
    // SAFETY: the caller's contract covers every key and value row read below.
    unsafe {
        for (h, q) in qs.iter().enumerate() {
            let row = &mut scores[h * n..][..n];
            scores_of::<E, D>(q.as_ptr(), ks, k_row, vs, v_row, scale, row, h == 0);
            let top = max_of(row);
            stats[h] = (top, exp_shifted_sum(row, top));
        }
        match VALUE_REGS / D {
            4 => weigh::<E, D, 4>(scores, n, vs, v_row, outs),
            2 => weigh::<E, D, 2>(scores, n, vs, v_row, outs),
            _ => weigh::<E, D, 1>(scores, n, vs, v_row, outs),
        }
    }
}

/// `row[j] = scale · q·k_j`; the first head of a group prefetches the K and V rows ahead.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn scores_of<E: KvElem, const D: usize>(
    q: *const f32,
    ks: *const E,
    k_row: usize,
    vs: *const E,
    v_row: usize,
    scale: f32,
    row: &mut [f32],
    prefetch: bool,
) {
    let n = row.len();
    // SAFETY: q has D vectors; keys j < n are readable (caller); prefetches never fault.
    unsafe {
        let qv: [__m512; D] = std::array::from_fn(|c| _mm512_loadu_ps(q.add(c * W)));
        let sc = _mm512_set1_ps(scale);
        let mut j0 = 0;
        while j0 < n {
            let count = KEY_BLOCK.min(n - j0);
            let mut acc = [_mm512_setzero_ps(); KEY_BLOCK];
            for (kk, a) in acc.iter_mut().enumerate().take(count) {
                let j = j0 + kk;
                let k = ks.add(j * k_row);
                if prefetch {
                    let row = D * W * size_of::<E>();
                    prefetch_bytes(
                        ks.wrapping_add((j + PREFETCH_KEYS) * k_row) as *const i8,
                        row,
                    );
                    prefetch_bytes(vs.wrapping_add(j * v_row) as *const i8, row);
                }
                let mut s = _mm512_mul_ps(qv[0], load16(k));
                for (c, qc) in qv.iter().enumerate().skip(1) {
                    s = _mm512_fmadd_ps(*qc, load16(k.add(c * W)), s);
                }
                *a = s;
            }
            let sums = _mm512_mul_ps(reduce16(&acc), sc);
            let mask: __mmask16 = if count == KEY_BLOCK {
                !0
            } else {
                (1 << count) - 1
            };
            _mm512_mask_storeu_ps(row.as_mut_ptr().add(j0), mask, sums);
            j0 += count;
        }
    }
}

/// Lane `k` = the sum of `v[k]`'s lanes: pairs of vectors are folded in halves, then quarters,
/// then within 128-bit blocks, which leaves the keys in the order undone by the last permute.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16(v: &[__m512; KEY_BLOCK]) -> __m512 {
    // Halves: key 2i in the low 256 bits, 2i+1 in the high.
    let w: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // Quarters: 128-bit block b holds key 4i + b.
    let x: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (w[2 * i], w[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // Within blocks: lanes 0, 2 of block b hold key 8i + b, lanes 1, 3 key 8i + 4 + b.
    let y: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    });
    // Lane 4b + {0, 1, 2, 3} holds key b, 8 + b, 4 + b, 12 + b.
    let z = _mm512_add_ps(
        _mm512_unpacklo_ps(y[0], y[1]),
        _mm512_unpackhi_ps(y[0], y[1]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, z)
}

/// `outs[h] = Σ_j p[h][j] v_j`, `H` heads at a time so each value row is read once per `H`.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn weigh<E: KvElem, const D: usize, const H: usize>(
    p: &[f32],
    n: usize,
    vs: *const E,
    v_row: usize,
    outs: &mut [&mut [f32]],
) {
    let g = outs.len();
    let mut h0 = 0;
    while h0 < g {
        let hc = H.min(g - h0);
        let mut acc = [[_mm512_setzero_ps(); D]; H];
        // SAFETY: values j < n are readable (caller); p holds g rows of n.
        unsafe {
            for j in 0..n {
                let v = vs.add(j * v_row);
                let vv: [__m512; D] = std::array::from_fn(|c| load16(v.add(c * W)));
                for (h, a) in acc.iter_mut().enumerate().take(hc) {
                    let w = _mm512_set1_ps(*p.get_unchecked((h0 + h) * n + j));
                    for c in 0..D {
                        a[c] = _mm512_fmadd_ps(w, vv[c], a[c]);
                    }
                }
            }
            for (h, a) in acc.iter().enumerate().take(hc) {
                let o = outs[h0 + h].as_mut_ptr();
                for (c, v) in a.iter().enumerate() {
                    _mm512_storeu_ps(o.add(c * W), *v);
                }
            }
        }
        h0 += hc;
    }
}
