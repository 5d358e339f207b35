//! AVX2 decode attention for one GQA group: each key row is read once for every query head of
//! the group, and each value row once per four heads.
//!
//! Written by hand for the reason its AVX-512 sibling was (the parent module): the portable
//! loops score one head at a time, a horizontal sum per key and head, and read the group's
//! K/V once per head — from L3 or memory at long contexts, where the head's 1.5 MB of K/V
//! (SmolLM2, 3000 keys) no longer fits L2. Here eight keys' sums are reduced together by a
//! `hadd` tree, and every query head meets a key while its row is in L1.

use std::arch::x86_64::*;

use super::{KvElem, prefetch_bytes};
use crate::cpu::simd::{exp_shifted_sum, max_of};

/// f32 lanes per vector.
const W: usize = 8;
/// Keys scored per pass: one vector of partial sums each per head, reduced together.
const KEY_BLOCK: usize = 8;
/// Query heads scored against a key row at once (one accumulator each).
const SCORE_HEADS: usize = 4;
/// Query heads weighted per pass over the value rows.
const VALUE_HEADS: usize = 4;
/// Value vectors per pass: one 64-byte line of f32 (`VALUE_HEADS × VALUE_COLS` accumulators).
const VALUE_COLS: usize = 2;
/// Keys ahead whose rows are prefetched.
const PREFETCH_KEYS: usize = 8;

/// Whether the CPU runs this kernel and `hd` is one it takes.
pub fn available(hd: usize) -> bool {
    hd > 0
        && hd.is_multiple_of(W)
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Eight elements at `p` as f32.
///
/// # Safety
/// Eight readable elements at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<E: KvElem>(p: *const E) -> __m256 {
    // SAFETY: the caller's contract (16 bytes for f16, 32 for f32).
    unsafe {
        if E::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }
}

/// [`super::group_part`] on AVX2: the group's softmax parts over its first `n` keys.
///
/// # Safety
/// As [`super::group_part`], and [`available`]`(hd)` holds.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
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
    let g = qs.len();
    scores.clear();
    scores.resize(g * n, 0.0);
    let mut h0 = 0;
    while h0 < g {
        let hc = SCORE_HEADS.min(g - h0);
        // SAFETY: forwarded from the caller.
        unsafe {
            match hc {
                4 => scores_of::<E, 4>(&qs[h0..], ks, k_row, vs, v_row, n, scale, scores, h0),
                3 => scores_of::<E, 3>(&qs[h0..], ks, k_row, vs, v_row, n, scale, scores, h0),
                2 => scores_of::<E, 2>(&qs[h0..], ks, k_row, vs, v_row, n, scale, scores, h0),
                _ => scores_of::<E, 1>(&qs[h0..], ks, k_row, vs, v_row, n, scale, scores, h0),
            }
        }
        h0 += hc;
    }
    for (row, st) in scores.chunks_exact_mut(n).zip(stats.iter_mut()) {
        let top = max_of(row);
        *st = (top, exp_shifted_sum(row, top));
    }
    // SAFETY: forwarded from the caller.
    unsafe { weigh(scores, n, vs, v_row, outs) };
}

/// `scores[(h0 + h)·n + j] = scale · qs[h]·k_j` for the `H` heads from `h0`, each key row read
/// once for all of them.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_of<E: KvElem, const H: usize>(
    qs: &[&[f32]],
    ks: *const E,
    k_row: usize,
    vs: *const E,
    v_row: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    h0: usize,
) {
    let hd = qs[0].len();
    let q: [*const f32; H] = std::array::from_fn(|h| qs[h].as_ptr());
    let row_bytes = hd * size_of::<E>();
    let sc = _mm256_set1_ps(scale);
    let mut j0 = 0;
    while j0 < n {
        let count = KEY_BLOCK.min(n - j0);
        // Key kk's partial sums for each head, reduced eight keys at a time below.
        let mut part = [[_mm256_setzero_ps(); H]; KEY_BLOCK];
        for (kk, slot) in part.iter_mut().enumerate().take(count) {
            let j = j0 + kk;
            // SAFETY: key j < n is readable (caller); q rows hold hd floats.
            unsafe {
                let k = ks.add(j * k_row);
                prefetch_bytes(
                    ks.wrapping_add((j + PREFETCH_KEYS) * k_row) as *const i8,
                    row_bytes,
                );
                if h0 == 0 {
                    prefetch_bytes(vs.wrapping_add(j * v_row) as *const i8, row_bytes);
                }
                let mut c = 0;
                while c < hd {
                    let kv = load8(k.add(c));
                    for (a, qh) in slot.iter_mut().zip(&q) {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(c)), kv, *a);
                    }
                    c += W;
                }
            }
        }
        for h in 0..H {
            let of_head: [__m256; KEY_BLOCK] = std::array::from_fn(|kk| part[kk][h]);
            let sums = _mm256_mul_ps(reduce8(&of_head), sc);
            let mut lanes = [0f32; KEY_BLOCK];
            // SAFETY: `lanes` holds eight floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sums) };
            scores[(h0 + h) * n + j0..][..count].copy_from_slice(&lanes[..count]);
        }
        j0 += count;
    }
}

/// Lane `k` = the sum of `v[k]`'s lanes: `hadd` pairs, then pairs of pairs, then the two
/// 128-bit halves added.
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8(v: &[__m256; KEY_BLOCK]) -> __m256 {
    // [v0 (0+1, 2+3), v1 (0+1, 2+3) | v0 (4+5, 6+7), v1 (4+5, 6+7)], and so on.
    let a: [__m256; 4] = std::array::from_fn(|i| _mm256_hadd_ps(v[2 * i], v[2 * i + 1]));
    // [v0..v3 low-half sums | v0..v3 high-half sums], then v4..v7 alike.
    let b0 = _mm256_hadd_ps(a[0], a[1]);
    let b1 = _mm256_hadd_ps(a[2], a[3]);
    let low = _mm256_permute2f128_ps::<0x20>(b0, b1);
    let high = _mm256_permute2f128_ps::<0x31>(b0, b1);
    _mm256_add_ps(low, high)
}

/// `outs[h] = Σ_j p[h][j] v_j`: [`VALUE_HEADS`] heads and one line of columns a pass, so each
/// value element is read once per four heads.
///
/// # Safety
/// Values `j < n` are readable at `vs + j·v_row` (`outs[h].len()` elements each); `p` holds
/// `outs.len()` rows of `n`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weigh<E: KvElem>(
    p: &[f32],
    n: usize,
    vs: *const E,
    v_row: usize,
    outs: &mut [&mut [f32]],
) {
    let (g, hd) = (outs.len(), outs[0].len());
    let cols = hd / W;
    let mut h0 = 0;
    while h0 < g {
        let hc = VALUE_HEADS.min(g - h0);
        let mut c0 = 0;
        while c0 < cols {
            let cc = VALUE_COLS.min(cols - c0);
            let mut acc = [[_mm256_setzero_ps(); VALUE_COLS]; VALUE_HEADS];
            for j in 0..n {
                // SAFETY: value j < n is readable (caller), columns c0·W.. inside its row; p
                // holds g rows of n.
                unsafe {
                    let v = vs.add(j * v_row + c0 * W);
                    prefetch_bytes(
                        vs.wrapping_add((j + PREFETCH_KEYS) * v_row + c0 * W) as *const i8,
                        cc * W * size_of::<E>(),
                    );
                    let vv: [__m256; VALUE_COLS] = std::array::from_fn(|c| {
                        if c < cc {
                            load8(v.add(c * W))
                        } else {
                            _mm256_setzero_ps()
                        }
                    });
                    for (h, a) in acc.iter_mut().enumerate().take(hc) {
                        let w = _mm256_set1_ps(*p.get_unchecked((h0 + h) * n + j));
                        for c in 0..cc {
                            a[c] = _mm256_fmadd_ps(w, vv[c], a[c]);
                        }
                    }
                }
            }
            for (h, a) in acc.iter().enumerate().take(hc) {
                let o = &mut outs[h0 + h][c0 * W..];
                for (c, v) in a.iter().enumerate().take(cc) {
                    // SAFETY: column c0 + c < cols lies inside the head's hd outputs.
                    unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(c * W), *v) };
                }
            }
            c0 += cc;
        }
        h0 += hc;
    }
}
