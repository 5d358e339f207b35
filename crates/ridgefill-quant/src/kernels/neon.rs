//! aarch64 NEON kernels for the 32-element legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the
//! unpacked weight values (0..32 as signed bytes, or Q8_0's signed quants) meet the signed
//! activation bytes sixteen at a time, four weight rows per activation load.
//!
//! Two levels: plain NEON widens (`smull` / `smull2` into i16, `sadalp` into i32), and with the
//! dot-product extension (Apple M1 on, Cortex-A76 on) one `sdot` adds groups of four products
//! straight into i32 lanes. Rust's `vdotq_s32` is still unstable, so `sdot` is one instruction of
//! inline assembly. The k-quants and float weights stay on the scalar kernels.
//!
//! Checked under qemu-aarch64 (`-cpu max`, both levels) against the scalar kernels and the f64
//! reference; not measured on ARM hardware.

// `r` indexes the accumulators and addresses row r's bytes: a range loop says that best.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;
use ridgefill_io::GgmlType;

use crate::act::{Q8Row, QK};

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
