//! Portable kernels: integer dot products per block, one row at a time. They define the
//! arithmetic the SIMD kernels reproduce (same integers, f32 sums in a different order).

use half::{bf16, f16};
use ridgefill_io::GgmlType;

use super::layout::*;
use super::{XRow, k4_scales};
use crate::act::{KSUM, Q8KRow, Q8Row, QK, QK_K};

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Σ lo·x[0..16] + hi·x[16..32] over the nibbles of 16 bytes, with `high[i]` added to value i.
#[inline(always)]
fn nibble_dot(qs: &[u8], high: impl Fn(usize) -> i32, x: &[i8]) -> i32 {
    let mut sum = 0i32;
    for j in 0..QK / 2 {
        let lo = (qs[j] & 0x0F) as i32 | high(j);
        let hi = (qs[j] >> 4) as i32 | high(j + QK / 2);
        sum += lo * x[j] as i32 + hi * x[j + QK / 2] as i32;
    }
    sum
}

/// Fifth bit (as 16) of value `i` of a Q5_0 / Q5_1 block.
#[inline(always)]
fn bit5(qh: u32, i: usize) -> i32 {
    (((qh >> i) & 1) << 4) as i32
}

fn row_legacy(ty: GgmlType, w: &[u8], x: &Q8Row<'_>) -> f32 {
    let ts = ty.type_size();
    let mut acc = 0.0f32;
    for (b, blk) in w.chunks_exact(ts).enumerate() {
        let xq = &x.qs[b * QK..(b + 1) * QK];
        let (dx, sx) = (x.d[b], x.s[b]);
        let d = f16_at(blk, 0);
        // (integer dot of the stored values, weight scale, coefficient of s = dx·Σxq)
        let (dot, c) = match ty {
            GgmlType::Q4_0 => (nibble_dot(&blk[2..], |_| 0, xq), -8.0 * d),
            GgmlType::Q4_1 => (nibble_dot(&blk[4..], |_| 0, xq), f16_at(blk, 2)),
            GgmlType::Q5_0 => {
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                (nibble_dot(&blk[6..], |i| bit5(qh, i), xq), -16.0 * d)
            }
            GgmlType::Q5_1 => {
                let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
                (nibble_dot(&blk[8..], |i| bit5(qh, i), xq), f16_at(blk, 2))
            }
            GgmlType::Q8_0 => {
                let dot = blk[2..2 + QK]
                    .iter()
                    .zip(xq)
                    .map(|(&q, &v)| (q as i8) as i32 * v as i32)
                    .sum();
                (dot, 0.0)
            }
            _ => unreachable!("row_legacy: {ty}"),
        };
        acc += dot as f32 * (d * dx) + c * sx;
    }
    acc
}

fn row_q4k_q5k(ty: GgmlType, w: &[u8], x: &Q8KRow<'_>) -> f32 {
    let ts = ty.type_size();
    let q5 = ty == GgmlType::Q5_K;
    let mut acc = 0.0f32;
    for (b, blk) in w.chunks_exact(ts).enumerate() {
        let xq = &x.qs[b * QK_K..(b + 1) * QK_K];
        let bs = &x.bsums[b * (QK_K / KSUM)..(b + 1) * (QK_K / KSUM)];
        let scales: &[u8; 12] = blk[K_SCALES..K_SCALES + 12].try_into().unwrap_or(&[0; 12]);
        let (sc, mn) = k4_scales(scales);
        let qs = &blk[if q5 { Q5K_QS } else { Q4K_QS }..];
        let qh = &blk[K_QH..K_QH + QK];
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..QK_K / QK {
            // Sub-block j: nibble (j % 2) of bytes 32·(j / 2).., fifth bit (Q5_K) bit j of qh.
            let mut s = 0i32;
            for l in 0..QK {
                let byte = qs[(j / 2) * QK + l];
                let mut q = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 } as i32;
                if q5 {
                    q |= (((qh[l] >> j) & 1) << 4) as i32;
                }
                s += q * xq[j * QK + l] as i32;
            }
            sumi += s * ((sc >> (8 * j)) & 0xFF) as i32;
            summ += ((mn >> (8 * j)) & 0xFF) as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        let dx = x.d[b];
        acc += (f16_at(blk, 0) * dx) * sumi as f32 - (f16_at(blk, 2) * dx) * summ as f32;
    }
    acc
}

fn row_q6k(w: &[u8], x: &Q8KRow<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in w.chunks_exact(GgmlType::Q6_K.type_size()).enumerate() {
        let xq = &x.qs[b * QK_K..(b + 1) * QK_K];
        let bs = &x.bsums[b * (QK_K / KSUM)..(b + 1) * (QK_K / KSUM)];
        let sc = |i: usize| blk[Q6K_SCALES + i] as i8 as i32;
        let mut sumi = 0i32;
        for h in 0..2 {
            let ql = &blk[h * 64..h * 64 + 64];
            let qh = &blk[Q6K_QH + h * 32..Q6K_QH + h * 32 + 32];
            for l in 0..QK {
                // Stored unsigned (0..63); the −32 offset is applied through the block sums.
                let q = [
                    (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (g, &q) in q.iter().enumerate() {
                    let e = h * 128 + g * 32 + l;
                    sumi += sc(e / KSUM) * q as i32 * xq[e] as i32;
                }
            }
        }
        let corr: i32 = (0..QK_K / KSUM).map(|i| sc(i) * bs[i] as i32).sum();
        acc += (f16_at(blk, Q6K_D) * x.d[b]) * (sumi - 32 * corr) as f32;
    }
    acc
}

fn row_float(ty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    match ty {
        GgmlType::F32 => {
            for (b, &v) in w.chunks_exact(4).zip(x) {
                acc += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * v;
            }
        }
        GgmlType::F16 => {
            for (b, &v) in w.chunks_exact(2).zip(x) {
                acc += f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() * v;
            }
        }
        GgmlType::BF16 => {
            for (b, &v) in w.chunks_exact(2).zip(x) {
                acc += bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() * v;
            }
        }
        _ => unreachable!("row_float: {ty}"),
    }
    acc
}

/// See [`super::gemv_rows`]; sizes are already checked.
pub(super) fn gemv_rows(ty: GgmlType, w: &[u8], row_bytes: usize, x: XRow<'_>, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
        *o = match (ty, &x) {
            (GgmlType::Q4_K | GgmlType::Q5_K, XRow::Q8K(x)) => row_q4k_q5k(ty, row, x),
            (GgmlType::Q6_K, XRow::Q8K(x)) => row_q6k(row, x),
            (_, XRow::Q8(x)) => row_legacy(ty, row, x),
            (_, XRow::F32(x)) => row_float(ty, row, x),
            _ => unreachable!("gemv_rows: {ty} with the wrong activation kind"),
        };
    }
}
