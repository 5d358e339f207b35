//! aarch64 NEON kernels for the 32-element legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the
//! k-quants (Q4_K, Q5_K, Q6_K): the unpacked weight values (small unsigned values as signed
//! bytes, or Q8_0's signed quants) meet the signed activation bytes sixteen at a time; the legacy
//! kernels take four weight rows per activation load.
//!
//! Two levels: plain NEON widens (`smull` / `smull2` into i16, `sadalp` into i32), and with the
//! dot-product extension (Apple M1 on, Cortex-A76 on) one `sdot` adds groups of four products
//! straight into i32 lanes. Rust's `vdotq_s32` is still unstable, so `sdot` is one instruction of
//! inline assembly. Float weights stay on the scalar kernels.
//!
//! Checked under qemu-aarch64 (`-cpu max`, both levels) against the scalar kernels and the f64
//! reference; not measured on ARM hardware.

// `r` indexes the accumulators and addresses row r's bytes: a range loop says that best.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;
use ridgefill_io::GgmlType;

use super::k4_scales;
use super::layout::*;
use crate::act::{KSUM, Q8KRow, Q8Row, QK, QK_K};

/// Rows per kernel pass.
const ROWS: usize = 4;
/// Half a block: the values one 128-bit vector holds.
const HALF: usize = QK / 2;

/// `acc + Σ` of the four products `a[4i..4i+4]·b[4i..4i+4]` per i32 lane.
trait Dot {
    /// # Safety
    /// The CPU has the instructions the implementation uses.
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
}

/// Baseline NEON: widening multiplies, pairwise add-accumulate.
struct Widen;
/// The dot-product extension's `sdot`.
struct Sdot;

impl Dot for Widen {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe {
            let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
            let hi = vmull_high_s8(a, b);
            vpadalq_s16(vpadalq_s16(acc, lo), hi)
        }
    }
}

impl Dot for Sdot {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: the caller guarantees the dot-product extension (see `Dot::dot`).
        unsafe {
            asm!(
                "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                acc = inout(vreg) acc,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }
}

/// The f16 at byte `at` of `p`, as f32.
///
/// # Safety
/// Two readable bytes at `p + at`.
#[inline(always)]
unsafe fn f16_at(p: *const u8, at: usize) -> f32 {
    // SAFETY: guaranteed by the caller.
    f16::from_bits(unsafe { (p.add(at) as *const u16).read_unaligned() }).to_f32()
}

/// Bit `i` of `bits` as the byte 16, for i = 0..16 (a Q5 block's fifth bits, one half).
///
/// # Safety
/// NEON present (always on aarch64).
#[inline(always)]
unsafe fn fifth_bits(bits: u16) -> int8x16_t {
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    const FIFTH: u8 = 0x10;
    // SAFETY: NEON is part of the aarch64 baseline; BIT has 16 bytes.
    unsafe {
        let [lo, hi] = bits.to_le_bytes();
        let v = vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
        let set = vtstq_u8(v, vld1q_u8(BIT.as_ptr()));
        vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(FIFTH)))
    }
}

/// Block `p` of `ty` as two vectors of its 32 stored values (0..16 or 0..32 as unsigned bytes,
/// Q8_0's signed quants): values 0..16, then 16..32.
///
/// # Safety
/// A whole block of `ty` readable at `p`.
#[inline(always)]
unsafe fn unpack(ty: GgmlType, p: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let nibbles = |at: usize| {
            let q = vld1q_u8(p.add(at));
            let m4 = vdupq_n_u8(0x0F);
            (
                vreinterpretq_s8_u8(vandq_u8(q, m4)),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)),
            )
        };
        let with_fifth = |qh_at: usize, qs_at: usize| {
            let (lo, hi) = nibbles(qs_at);
            let qh = (p.add(qh_at) as *const u32).read_unaligned();
            (
                vorrq_s8(lo, fifth_bits(qh as u16)),
                vorrq_s8(hi, fifth_bits((qh >> 16) as u16)),
            )
        };
        match ty {
            GgmlType::Q4_0 => nibbles(2),
            GgmlType::Q4_1 => nibbles(4),
            GgmlType::Q5_0 => with_fifth(2, 6),
            GgmlType::Q5_1 => with_fifth(4, 8),
            _ => (
                vld1q_s8(p.add(2) as *const i8),
                vld1q_s8(p.add(2 + HALF) as *const i8),
            ),
        }
    }
}

/// The offset term's factor `c` of block `p` (row r gets `Σ_b [d·dx·dot + c·s_b]`): the f16 min
/// (Q4_1, Q5_1) or `k·d` (Q4_0: −8, Q5_0: −16, Q8_0: 0).
///
/// # Safety
/// A whole block of `ty` readable at `p`.
#[inline(always)]
unsafe fn offset(ty: GgmlType, p: *const u8, d: f32) -> f32 {
    const Q4_0_OFFSET: f32 = -8.0;
    const Q5_0_OFFSET: f32 = -16.0;
    // SAFETY: guaranteed by the caller.
    unsafe {
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => f16_at(p, 2),
            GgmlType::Q4_0 => Q4_0_OFFSET * d,
            GgmlType::Q5_0 => Q5_0_OFFSET * d,
            _ => 0.0,
        }
    }
}

/// `R ≤ 4` weight rows of `ty` at `w` against one activation row.
///
/// # Safety
/// `D`'s instructions present; `R` rows of `row_bytes` readable at `w`, matching `x`; room for
/// `R` values at `out`.
#[inline(always)]
unsafe fn rows<D: Dot, const R: usize>(
    ty: GgmlType,
    w: *const u8,
    row_bytes: usize,
    x: &Q8Row<'_>,
    out: *mut f32,
) {
    let ts = ty.type_size();
    let mut acc = [0f32; R];
    // SAFETY: block b of x and of every row is in bounds (caller's contract).
    unsafe {
        for b in 0..x.d.len() {
            let xq = x.qs.as_ptr().add(b * QK);
            let (x0, x1) = (vld1q_s8(xq), vld1q_s8(xq.add(HALF)));
            let (dx, sx) = (*x.d.get_unchecked(b), *x.s.get_unchecked(b));
            for r in 0..R {
                let p = w.add(r * row_bytes + b * ts);
                let (lo, hi) = unpack(ty, p);
                let dot = D::dot(D::dot(vdupq_n_s32(0), lo, x0), hi, x1);
                let d = f16_at(p, 0);
                let sum = vaddvq_s32(dot) as f32;
                acc[r] = sum.mul_add(d * dx, offset(ty, p, d).mul_add(sx, acc[r]));
            }
        }
        for r in 0..R {
            *out.add(r) = acc[r];
        }
    }
}

/// `out[r] = W[r]·x` for `out.len()` rows, four at a time.
///
/// # Safety
/// `D`'s instructions present; sizes checked by the caller.
#[inline(always)]
unsafe fn gemv<D: Dot>(ty: GgmlType, w: &[u8], row_bytes: usize, x: &Q8Row<'_>, out: &mut [f32]) {
    let n = out.len();
    let mut r = 0;
    // SAFETY: rows r..r+ROWS (or r) are inside w and out.
    unsafe {
        while r + ROWS <= n {
            let o = out.as_mut_ptr().add(r);
            rows::<D, ROWS>(ty, w.as_ptr().add(r * row_bytes), row_bytes, x, o);
            r += ROWS;
        }
        while r < n {
            let o = out.as_mut_ptr().add(r);
            rows::<D, 1>(ty, w.as_ptr().add(r * row_bytes), row_bytes, x, o);
            r += 1;
        }
    }
}

/// Sum of the products of sixteen weight values with sixteen activation bytes at `x`.
///
/// # Safety
/// `D`'s instructions present; sixteen readable bytes at `x`.
#[inline(always)]
unsafe fn dot16<D: Dot>(q: int8x16_t, x: *const i8) -> i32 {
    // SAFETY: guaranteed by the caller.
    unsafe { vaddvq_s32(D::dot(vdupq_n_s32(0), q, vld1q_s8(x))) }
}

/// One Q4_K / Q5_K (`FIVE`) row: Σ_j sc_j·Σ(q·x) over 8 sub-blocks of 32, minus
/// dmin·Σ_j mn_j·bsum_j (the scalar `row_q4k_q5k`'s arithmetic).
///
/// # Safety
/// `D`'s instructions present; the row at `p` matches `x`.
#[inline(always)]
unsafe fn row_q45k<D: Dot, const FIVE: bool>(p: *const u8, x: &Q8KRow<'_>) -> f32 {
    let ty = if FIVE { GgmlType::Q5_K } else { GgmlType::Q4_K };
    let ts = ty.type_size();
    let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
    let mut acc = 0f32;
    // SAFETY: super-block b of x and of the row is in bounds (caller's contract).
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let one = vdupq_n_u8(1);
        for b in 0..x.d.len() {
            let blk = p.add(b * ts);
            let xq = x.qs.as_ptr().add(b * QK_K);
            let bs = x.bsums.as_ptr().add(b * (QK_K / KSUM));
            let (sc, mn) = k4_scales(&*(blk.add(K_SCALES) as *const [u8; 12]));
            let (mut sumi, mut summ) = (0i32, 0i32);
            for pair in 0..QK_K / QK / 2 {
                // Bytes 32·pair..: low nibbles are sub-block 2·pair, high ones 2·pair + 1.
                for half in 0..2 {
                    let at = pair * QK + half * HALF;
                    let q = vld1q_u8(blk.add(qs_at + at));
                    let (mut lo, mut hi) = (vandq_u8(q, m4), vshrq_n_u8::<4>(q));
                    if FIVE {
                        // Bit j of qh[l] is the fifth bit of value l of sub-block j.
                        let qh = vld1q_u8(blk.add(K_QH + half * HALF));
                        let bit = |j: i8| {
                            let b = vandq_u8(vshlq_u8(qh, vdupq_n_s8(-j)), one);
                            vshlq_n_u8::<4>(b)
                        };
                        lo = vorrq_u8(lo, bit(2 * pair as i8));
                        hi = vorrq_u8(hi, bit(2 * pair as i8 + 1));
                    }
                    let j = 2 * pair;
                    let s_lo = dot16::<D>(vreinterpretq_s8_u8(lo), xq.add(j * QK + half * HALF));
                    let s_hi =
                        dot16::<D>(vreinterpretq_s8_u8(hi), xq.add((j + 1) * QK + half * HALF));
                    sumi += s_lo * ((sc >> (8 * j)) & 0xFF) as i32
                        + s_hi * ((sc >> (8 * (j + 1))) & 0xFF) as i32;
                }
            }
            for j in 0..QK_K / QK {
                let bsum = *bs.add(2 * j) as i32 + *bs.add(2 * j + 1) as i32;
                summ += ((mn >> (8 * j)) & 0xFF) as i32 * bsum;
            }
            let dx = *x.d.get_unchecked(b);
            acc += (f16_at(blk, 0) * dx) * sumi as f32 - (f16_at(blk, 2) * dx) * summ as f32;
        }
    }
    acc
}

/// One Q6_K row: Σ_g sc_g·Σ(q·x) over 16 groups of 16 with q stored as 0..63, minus
/// 32·Σ_g sc_g·bsum_g (the scalar `row_q6k`'s arithmetic).
///
/// # Safety
/// As for [`row_q45k`].
#[inline(always)]
unsafe fn row_q6k<D: Dot>(p: *const u8, x: &Q8KRow<'_>) -> f32 {
    let ts = GgmlType::Q6_K.type_size();
    const OFFSET: i32 = 32;
    let mut acc = 0f32;
    // SAFETY: super-block b of x and of the row is in bounds (caller's contract).
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let m2 = vdupq_n_u8(0x03);
        for b in 0..x.d.len() {
            let blk = p.add(b * ts);
            let xq = x.qs.as_ptr().add(b * QK_K);
            let bs = x.bsums.as_ptr().add(b * (QK_K / KSUM));
            let sc = |i: usize| *(blk.add(Q6K_SCALES + i) as *const i8) as i32;
            let mut sumi = 0i32;
            for h in 0..2 {
                for l0 in [0, HALF] {
                    let ql_a = vld1q_u8(blk.add(h * 64 + l0));
                    let ql_b = vld1q_u8(blk.add(h * 64 + 32 + l0));
                    let qh = vld1q_u8(blk.add(Q6K_QH + h * 32 + l0));
                    let high =
                        |shift: i8| vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh, vdupq_n_s8(-shift)), m2));
                    let q = [
                        vorrq_u8(vandq_u8(ql_a, m4), high(0)),
                        vorrq_u8(vandq_u8(ql_b, m4), high(2)),
                        vorrq_u8(vshrq_n_u8::<4>(ql_a), high(4)),
                        vorrq_u8(vshrq_n_u8::<4>(ql_b), high(6)),
                    ];
                    for (g, &q) in q.iter().enumerate() {
                        let e = h * 128 + g * 32 + l0;
                        sumi += sc(e / KSUM) * dot16::<D>(vreinterpretq_s8_u8(q), xq.add(e));
                    }
                }
            }
            let corr: i32 = (0..QK_K / KSUM).map(|i| sc(i) * *bs.add(i) as i32).sum();
            acc += (f16_at(blk, Q6K_D) * *x.d.get_unchecked(b)) * (sumi - OFFSET * corr) as f32;
        }
    }
    acc
}

/// `out[r] = W[r]·x` for k-quant rows, one row at a time.
///
/// # Safety
/// `D`'s instructions present; sizes checked by the caller; `ty` is Q4_K, Q5_K or Q6_K.
#[inline(always)]
unsafe fn gemv_k<D: Dot>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8KRow<'_>,
    out: &mut [f32],
) {
    for (r, o) in out.iter_mut().enumerate() {
        // SAFETY: row r is inside w (caller's contract).
        let p = unsafe { w.as_ptr().add(r * row_bytes) };
        // SAFETY: forwarded from the caller.
        *o = unsafe {
            match ty {
                GgmlType::Q4_K => row_q45k::<D, false>(p, x),
                GgmlType::Q5_K => row_q45k::<D, true>(p, x),
                _ => row_q6k::<D>(p, x),
            }
        };
    }
}

/// [`gemv_rows`] for the k-quants (Q4_K, Q5_K, Q6_K), baseline NEON.
///
/// # Safety
/// Sizes checked by the caller; `ty` is Q4_K, Q5_K or Q6_K.
#[target_feature(enable = "neon")]
pub(super) unsafe fn gemv_rows_k(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8KRow<'_>,
    out: &mut [f32],
) {
    // SAFETY: forwarded from the caller; NEON is the aarch64 baseline.
    unsafe { gemv_k::<Widen>(ty, w, row_bytes, x, out) }
}

/// [`gemv_rows_k`] with the dot-product extension.
///
/// # Safety
/// As for [`gemv_rows_k`], and the CPU has the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn gemv_rows_k_dot(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8KRow<'_>,
    out: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe { gemv_k::<Sdot>(ty, w, row_bytes, x, out) }
}

/// See [`super::gemv_rows`], for the legacy formats, baseline NEON.
///
/// # Safety
/// Sizes checked by the caller (`w` holds `out.len()` rows of `row_bytes` that match `x`); `ty`
/// is Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0.
#[target_feature(enable = "neon")]
pub(super) unsafe fn gemv_rows(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8Row<'_>,
    out: &mut [f32],
) {
    // SAFETY: forwarded from the caller; NEON is the aarch64 baseline.
    unsafe { gemv::<Widen>(ty, w, row_bytes, x, out) }
}

/// [`gemv_rows`] with the dot-product extension.
///
/// # Safety
/// As for [`gemv_rows`], and the CPU has the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn gemv_rows_dot(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    x: &Q8Row<'_>,
    out: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe { gemv::<Sdot>(ty, w, row_bytes, x, out) }
}
