//! ggml tensor types and their dequantisation to f32, bit-exact with ggml's reference order of operations.

use std::fmt;

use half::{bf16, f16};

/// Elements per block of the "legacy" quant types (Q4_0 ... Q8_1, IQ4_NL, MXFP4).
const QK: usize = 32;
/// Elements per super-block of the k-quants and i-quants.
const QK_K: usize = 256;
/// Bytes of a little-endian f16 scale.
const F16_BYTES: usize = 2;
/// Bytes of the packed 6-bit scales/mins of Q4_K and Q5_K.
const K_SCALE_BYTES: usize = 12;
/// Q4_0 stores unsigned nibbles centred on this offset.
const Q4_0_OFFSET: i32 = 8;
/// Q5_0 stores unsigned 5-bit values centred on this offset.
const Q5_0_OFFSET: i32 = 16;
/// Q6_K stores unsigned 6-bit values centred on this offset.
const Q6_K_OFFSET: i32 = 32;
/// Bytes of a little-endian f32 scale (Q8_K).
const F32_BYTES: usize = 4;
/// Bytes of the u32 holding the fifth bits of Q5_0 / Q5_1 blocks.
const QH_BYTES: usize = 4;
/// Bytes of the shared E8M0 exponent of an MXFP4 block.
const E8M0_BYTES: usize = 1;
/// Mask of the low nibble.
const NIBBLE: u8 = 0x0F;
/// Width of a nibble; the fifth/sixth quant bits sit above it.
const NIBBLE_BITS: u32 = 4;
/// Mask of a 2-bit field (Q6_K high bits).
const TWO_BITS: u8 = 0x03;
/// Shift that leaves the top two bits of a byte (high bits of Q4_K/Q5_K 6-bit scales).
const TOP_TWO_SHIFT: u32 = 6;
/// Mask of a 6-bit scale.
const SIX_BITS: u8 = 0x3F;
/// How many f16 values are converted per stack buffer, so the bulk converter can use SIMD.
const F16_CHUNK: usize = 1024;

/// Quantises `xs` to Q8_0 blocks (f16 scale `max|x| / 127`, 32 rounded `i8`), as ggml's
/// reference quantiser does; `None` unless `xs` fills whole blocks.
pub fn quantize_q8_0(xs: &[f32]) -> Option<Vec<u8>> {
    if !xs.len().is_multiple_of(QK) {
        return None;
    }
    let mut out = Vec::with_capacity(xs.len() / QK * (F16_BYTES + QK));
    for block in xs.chunks_exact(QK) {
        let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let d = amax / f32::from(i8::MAX);
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&x| ((x * id).round() as i8) as u8));
    }
    Some(out)
}

/// Quantises `xs` to Q4_0 blocks as ggml's reference quantiser does: the f16 scale is the
/// largest-magnitude value over -8, the 32 codes are nibbles offset by 8 (low nibbles hold the
/// first 16 values); `None` unless `xs` fills whole blocks.
pub fn quantize_q4_0(xs: &[f32]) -> Option<Vec<u8>> {
    if !xs.len().is_multiple_of(QK) {
        return None;
    }
    /// Largest nibble code.
    const MAX_CODE: f32 = 15.0;
    let half = QK / 2;
    let mut out = Vec::with_capacity(xs.len() / QK * GgmlType::Q4_0.type_size());
    for block in xs.chunks_exact(QK) {
        let max = block
            .iter()
            .fold(0.0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        let d = max / -(Q4_0_OFFSET as f32);
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        // `+ 8.5` then truncation is ggml's round-half-up onto the offset codes.
        let code = |x: f32| (x * id + Q4_0_OFFSET as f32 + 0.5).min(MAX_CODE) as u8;
        out.extend((0..half).map(|j| code(block[j]) | (code(block[half + j]) << NIBBLE_BITS)));
    }
    Some(out)
}

/// `xs` in `ty`'s blocks, for weights quantised at load and synthetic models: F16, Q8_0 or Q4_0;
/// `None` for another type or a length that does not fill whole blocks.
pub fn quantize(ty: GgmlType, xs: &[f32]) -> Option<Vec<u8>> {
    match ty {
        GgmlType::F16 => Some(
            xs.iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        GgmlType::Q8_0 => quantize_q8_0(xs),
        GgmlType::Q4_0 => quantize_q4_0(xs),
        _ => None,
    }
}

/// Errors of the pure dequantisation layer (no file context; callers add it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The id is not a ggml type at all.
    #[error("unknown ggml type id {0}")]
    UnknownType(u32),
    /// A real ggml type that this crate does not dequantise.
    #[error(
        "ggml type {0} cannot be dequantised: expected one of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"
    )]
    Unsupported(GgmlType),
    /// The element count does not fill whole blocks.
    #[error("{ty}: element count must be a multiple of the block size {block}, found {n_elements}")]
    NotBlockMultiple {
        ty: GgmlType,
        block: usize,
        n_elements: usize,
    },
    /// The raw byte length does not match the element count.
    #[error("{ty}: {n_elements} elements need {expected} bytes, found {found}")]
    ByteLength {
        ty: GgmlType,
        n_elements: usize,
        expected: usize,
        found: usize,
    },
}

macro_rules! ggml_types {
    ($($name:ident = $id:expr, $block:expr, $bytes:expr;)*) => {
        /// A ggml tensor element type, with the id used in GGUF files.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        pub enum GgmlType {
            $($name,)*
        }

        impl GgmlType {
            /// Every type this crate knows the layout of.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$name,)*];

            /// The id stored in GGUF tensor infos.
            pub fn id(self) -> u32 {
                match self { $(GgmlType::$name => $id,)* }
            }

            /// Looks a type up by its GGUF id.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id { $($id => Some(GgmlType::$name),)* _ => None }
            }

            /// ggml's name for the type, e.g. "Q4_K".
            pub fn name(self) -> &'static str {
                match self { $(GgmlType::$name => stringify!($name),)* }
            }

            /// Elements per block.
            pub fn block_size(self) -> usize {
                match self { $(GgmlType::$name => $block,)* }
            }

            /// Bytes per block.
            pub fn type_size(self) -> usize {
                match self { $(GgmlType::$name => $bytes,)* }
            }
        }
    };
}

// Sizes are ggml's `type_traits` table (ggml.c); ids are `enum ggml_type` (ggml.h).
ggml_types! {
    F32 = 0, 1, 4;
    F16 = 1, 1, 2;
    Q4_0 = 2, QK, F16_BYTES + QK / 2;
    Q4_1 = 3, QK, 2 * F16_BYTES + QK / 2;
    Q5_0 = 6, QK, F16_BYTES + QH_BYTES + QK / 2;
    Q5_1 = 7, QK, 2 * F16_BYTES + QH_BYTES + QK / 2;
    Q8_0 = 8, QK, F16_BYTES + QK;
    Q8_1 = 9, QK, 2 * F16_BYTES + QK;
    Q2_K = 10, QK_K, 2 * F16_BYTES + QK_K / 16 + QK_K / 4;
    Q3_K = 11, QK_K, F16_BYTES + QK_K / 4 + QK_K / 8 + K_SCALE_BYTES;
    Q4_K = 12, QK_K, 2 * F16_BYTES + K_SCALE_BYTES + QK_K / 2;
    Q5_K = 13, QK_K, 2 * F16_BYTES + K_SCALE_BYTES + QK_K / 8 + QK_K / 2;
    Q6_K = 14, QK_K, F16_BYTES + QK_K / 2 + QK_K / 4 + QK_K / 16;
    Q8_K = 15, QK_K, F32_BYTES + QK_K + QK_K / 8;
    IQ2_XXS = 16, QK_K, F16_BYTES + QK_K / 4;
    IQ2_XS = 17, QK_K, F16_BYTES + QK_K / 4 + QK_K / 32;
    IQ3_XXS = 18, QK_K, F16_BYTES + QK_K / 4 + QK_K / 8;
    IQ1_S = 19, QK_K, F16_BYTES + QK_K / 8 + QK_K / 16;
    IQ4_NL = 20, QK, F16_BYTES + QK / 2;
    IQ3_S = 21, QK_K, F16_BYTES + QK_K / 4 + QK_K / 8 + QK_K / 32 + QK_K / 64;
    IQ2_S = 22, QK_K, F16_BYTES + QK_K / 4 + QK_K / 16;
    IQ4_XS = 23, QK_K, 2 * F16_BYTES + QK_K / 2 + QK_K / 64;
    I8 = 24, 1, 1;
    I16 = 25, 1, 2;
    I32 = 26, 1, 4;
    I64 = 27, 1, 8;
    F64 = 28, 1, 8;
    IQ1_M = 29, QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32;
    BF16 = 30, 1, 2;
    TQ1_0 = 34, QK_K, F16_BYTES + (QK_K - 4 * QK_K / 64) / 5 + QK_K / 64;
    TQ2_0 = 35, QK_K, F16_BYTES + QK_K / 4;
    MXFP4 = 39, QK, E8M0_BYTES + QK / 2;
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TryFrom<u32> for GgmlType {
    type Error = QuantError;
    fn try_from(id: u32) -> Result<Self, QuantError> {
        GgmlType::from_id(id).ok_or(QuantError::UnknownType(id))
    }
}

impl GgmlType {
    /// Whether [`dequantize`] supports this type.
    pub fn can_dequantize(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q5_K
                | GgmlType::Q6_K
        )
    }

    /// Bytes needed for `n_elements`, or `None` if they do not fill whole blocks or overflow.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size() as u64)
    }
}

/// Dequantises `n_elements` values of type `ty` stored in `raw` into a new f32 vector.
pub fn dequantize(ty: GgmlType, raw: &[u8], n_elements: usize) -> Result<Vec<f32>, QuantError> {
    check_len(ty, raw, n_elements)?;
    let mut out = vec![0.0f32; n_elements];
    dequantize_into(ty, raw, &mut out)?;
    Ok(out)
}

/// Dequantises into a caller-provided buffer; `out.len()` is the element count.
pub fn dequantize_into(ty: GgmlType, raw: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_len(ty, raw, out.len())?;
    match ty {
        GgmlType::F32 => deq_f32(raw, out),
        GgmlType::F16 => deq_f16(raw, out),
        GgmlType::BF16 => deq_bf16(raw, out),
        GgmlType::Q4_0 => deq_q4_0(raw, out),
        GgmlType::Q4_1 => deq_q4_1(raw, out),
        GgmlType::Q5_0 => deq_q5_0(raw, out),
        GgmlType::Q5_1 => deq_q5_1(raw, out),
        GgmlType::Q8_0 => deq_q8_0(raw, out),
        GgmlType::Q4_K => deq_q4_k(raw, out),
        GgmlType::Q5_K => deq_q5_k(raw, out),
        GgmlType::Q6_K => deq_q6_k(raw, out),
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(())
}

fn check_len(ty: GgmlType, raw: &[u8], n_elements: usize) -> Result<(), QuantError> {
    let block = ty.block_size();
    if !n_elements.is_multiple_of(block) {
        return Err(QuantError::NotBlockMultiple {
            ty,
            block,
            n_elements,
        });
    }
    let expected = (n_elements / block).saturating_mul(ty.type_size());
    if raw.len() != expected {
        return Err(QuantError::ByteLength {
            ty,
            n_elements,
            expected,
            found: raw.len(),
        });
    }
    Ok(())
}

#[inline(always)]
fn half_at(raw: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([raw[at], raw[at + 1]])).to_f32()
}

fn deq_f32(raw: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(raw.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn deq_f16(raw: &[u8], out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut buf = [f16::ZERO; F16_CHUNK];
    for (o, r) in out.chunks_mut(F16_CHUNK).zip(raw.chunks(F16_CHUNK * 2)) {
        let n = o.len();
        for (h, b) in buf[..n].iter_mut().zip(r.chunks_exact(2)) {
            *h = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
        // Bulk conversion uses the F16C instructions when the CPU has them.
        buf[..n].convert_to_f32_slice(o);
    }
}

fn deq_bf16(raw: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
        *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

fn deq_q4_0(raw: &[u8], out: &mut [f32]) {
    const HALF: usize = QK / 2;
    let ts = GgmlType::Q4_0.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK)) {
        let d = half_at(blk, 0);
        let qs: &[u8; HALF] = blk[F16_BYTES..].try_into().unwrap_or(&[0; HALF]);
        let (lo, hi) = o.split_at_mut(HALF);
        for j in 0..HALF {
            lo[j] = d * ((qs[j] & NIBBLE) as i32 - Q4_0_OFFSET) as f32;
            hi[j] = d * ((qs[j] >> NIBBLE_BITS) as i32 - Q4_0_OFFSET) as f32;
        }
    }
}

fn deq_q4_1(raw: &[u8], out: &mut [f32]) {
    const HALF: usize = QK / 2;
    let ts = GgmlType::Q4_1.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK)) {
        let d = half_at(blk, 0);
        let m = half_at(blk, F16_BYTES);
        let qs: &[u8; HALF] = blk[2 * F16_BYTES..].try_into().unwrap_or(&[0; HALF]);
        let (lo, hi) = o.split_at_mut(HALF);
        for j in 0..HALF {
            // Multiply then add as two roundings, matching ggml (no fused multiply-add).
            lo[j] = d * (qs[j] & NIBBLE) as f32 + m;
            hi[j] = d * (qs[j] >> NIBBLE_BITS) as f32 + m;
        }
    }
}

fn deq_q5_0(raw: &[u8], out: &mut [f32]) {
    const HALF: usize = QK / 2;
    const QH_AT: usize = F16_BYTES;
    const QS_AT: usize = QH_AT + QH_BYTES;
    let ts = GgmlType::Q5_0.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK)) {
        let d = half_at(blk, 0);
        let qh = u32::from_le_bytes([blk[QH_AT], blk[QH_AT + 1], blk[QH_AT + 2], blk[QH_AT + 3]]);
        let qs: &[u8; HALF] = blk[QS_AT..].try_into().unwrap_or(&[0; HALF]);
        let (lo, hi) = o.split_at_mut(HALF);
        for j in 0..HALF {
            let h0 = (((qh >> j) & 1) << NIBBLE_BITS) as i32;
            let h1 = (((qh >> (j + HALF)) & 1) << NIBBLE_BITS) as i32;
            lo[j] = d * (((qs[j] & NIBBLE) as i32 | h0) - Q5_0_OFFSET) as f32;
            hi[j] = d * (((qs[j] >> NIBBLE_BITS) as i32 | h1) - Q5_0_OFFSET) as f32;
        }
    }
}

fn deq_q5_1(raw: &[u8], out: &mut [f32]) {
    const HALF: usize = QK / 2;
    const QH_AT: usize = 2 * F16_BYTES;
    const QS_AT: usize = QH_AT + QH_BYTES;
    let ts = GgmlType::Q5_1.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK)) {
        let d = half_at(blk, 0);
        let m = half_at(blk, F16_BYTES);
        let qh = u32::from_le_bytes([blk[QH_AT], blk[QH_AT + 1], blk[QH_AT + 2], blk[QH_AT + 3]]);
        let qs: &[u8; HALF] = blk[QS_AT..].try_into().unwrap_or(&[0; HALF]);
        let (lo, hi) = o.split_at_mut(HALF);
        for j in 0..HALF {
            let h0 = (((qh >> j) & 1) << NIBBLE_BITS) as u8;
            let h1 = (((qh >> (j + HALF)) & 1) << NIBBLE_BITS) as u8;
            lo[j] = d * ((qs[j] & NIBBLE) | h0) as f32 + m;
            hi[j] = d * ((qs[j] >> NIBBLE_BITS) | h1) as f32 + m;
        }
    }
}

fn deq_q8_0(raw: &[u8], out: &mut [f32]) {
    let ts = GgmlType::Q8_0.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK)) {
        let d = half_at(blk, 0);
        let qs: &[u8; QK] = blk[F16_BYTES..].try_into().unwrap_or(&[0; QK]);
        for j in 0..QK {
            o[j] = (qs[j] as i8) as f32 * d;
        }
    }
}

/// Unpacks the eight 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block.
#[inline(always)]
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & SIX_BITS;
        mn[j] = s[j + 4] & SIX_BITS;
        sc[j + 4] = (s[j + 8] & NIBBLE) | ((s[j] >> TOP_TWO_SHIFT) << NIBBLE_BITS);
        mn[j + 4] = (s[j + 8] >> NIBBLE_BITS) | ((s[j + 4] >> TOP_TWO_SHIFT) << NIBBLE_BITS);
    }
    (sc, mn)
}

fn deq_q4_k(raw: &[u8], out: &mut [f32]) {
    const SCALES_AT: usize = 2 * F16_BYTES;
    const QS_AT: usize = SCALES_AT + K_SCALE_BYTES;
    const SUB: usize = 32;
    let ts = GgmlType::Q4_K.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK_K)) {
        let d = half_at(blk, 0);
        let dmin = half_at(blk, F16_BYTES);
        let (sc, mn) = k_scale_min(&blk[SCALES_AT..QS_AT]);
        let qs = &blk[QS_AT..];
        // Each 32-byte chunk of qs holds two sub-blocks: low nibbles first, then high nibbles.
        for (c, (q, o)) in qs
            .chunks_exact(SUB)
            .zip(o.chunks_exact_mut(2 * SUB))
            .enumerate()
        {
            let d1 = d * sc[2 * c] as f32;
            let m1 = dmin * mn[2 * c] as f32;
            let d2 = d * sc[2 * c + 1] as f32;
            let m2 = dmin * mn[2 * c + 1] as f32;
            let q: &[u8; SUB] = q.try_into().unwrap_or(&[0; SUB]);
            let (lo, hi) = o.split_at_mut(SUB);
            for l in 0..SUB {
                lo[l] = d1 * (q[l] & NIBBLE) as f32 - m1;
                hi[l] = d2 * (q[l] >> NIBBLE_BITS) as f32 - m2;
            }
        }
    }
}

fn deq_q5_k(raw: &[u8], out: &mut [f32]) {
    const SCALES_AT: usize = 2 * F16_BYTES;
    const QH_AT: usize = SCALES_AT + K_SCALE_BYTES;
    const QS_AT: usize = QH_AT + QK_K / 8;
    const SUB: usize = 32;
    let ts = GgmlType::Q5_K.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK_K)) {
        let d = half_at(blk, 0);
        let dmin = half_at(blk, F16_BYTES);
        let (sc, mn) = k_scale_min(&blk[SCALES_AT..QH_AT]);
        let qh: &[u8; SUB] = blk[QH_AT..QS_AT].try_into().unwrap_or(&[0; SUB]);
        let qs = &blk[QS_AT..];
        for (c, (q, o)) in qs
            .chunks_exact(SUB)
            .zip(o.chunks_exact_mut(2 * SUB))
            .enumerate()
        {
            // Sub-block j takes its fifth bit from bit j of every qh byte.
            let (s1, s2) = (2 * c, 2 * c + 1);
            let d1 = d * sc[s1] as f32;
            let m1 = dmin * mn[s1] as f32;
            let d2 = d * sc[s2] as f32;
            let m2 = dmin * mn[s2] as f32;
            let q: &[u8; SUB] = q.try_into().unwrap_or(&[0; SUB]);
            let (lo, hi) = o.split_at_mut(SUB);
            for l in 0..SUB {
                let h1 = ((qh[l] >> s1) & 1) << NIBBLE_BITS;
                let h2 = ((qh[l] >> s2) & 1) << NIBBLE_BITS;
                lo[l] = d1 * ((q[l] & NIBBLE) | h1) as f32 - m1;
                hi[l] = d2 * ((q[l] >> NIBBLE_BITS) | h2) as f32 - m2;
            }
        }
    }
}

fn deq_q6_k(raw: &[u8], out: &mut [f32]) {
    const QL_BYTES: usize = QK_K / 2;
    const QH6_BYTES: usize = QK_K / 4;
    const SCALES_AT: usize = QL_BYTES + QH6_BYTES;
    const D_AT: usize = SCALES_AT + QK_K / 16;
    const HALF: usize = QK_K / 2;
    const SUB: usize = 32;
    const SCALE_SPAN: usize = 16;
    /// Scales per 128-element half, and the scale index step between its 32-element groups.
    const SCALES_PER_HALF: usize = HALF / SCALE_SPAN;
    const SC_STEP: usize = SUB / SCALE_SPAN;
    let ts = GgmlType::Q6_K.type_size();
    for (blk, o) in raw.chunks_exact(ts).zip(out.chunks_exact_mut(QK_K)) {
        let d = half_at(blk, D_AT);
        let scales = &blk[SCALES_AT..D_AT];
        // Each 128-element half uses 64 bytes of ql, 32 bytes of qh and 8 scales.
        for h in 0..2 {
            let ql: &[u8; 2 * SUB] = blk[h * 2 * SUB..(h + 1) * 2 * SUB]
                .try_into()
                .unwrap_or(&[0; 2 * SUB]);
            let qh: &[u8; SUB] = blk[QL_BYTES + h * SUB..QL_BYTES + (h + 1) * SUB]
                .try_into()
                .unwrap_or(&[0; SUB]);
            let sc = &scales[h * SCALES_PER_HALF..(h + 1) * SCALES_PER_HALF];
            let o = &mut o[h * HALF..(h + 1) * HALF];
            for l in 0..SUB {
                let is = l / SCALE_SPAN;
                // Each qh byte carries the 2 high bits of four values, lowest field first.
                let hi =
                    |k: u32| ((qh[l] >> (TWO_BITS.count_ones() * k)) & TWO_BITS) << NIBBLE_BITS;
                let q1 = ((ql[l] & NIBBLE) | hi(0)) as i32 - Q6_K_OFFSET;
                let q2 = ((ql[l + SUB] & NIBBLE) | hi(1)) as i32 - Q6_K_OFFSET;
                let q3 = ((ql[l] >> NIBBLE_BITS) | hi(2)) as i32 - Q6_K_OFFSET;
                let q4 = ((ql[l + SUB] >> NIBBLE_BITS) | hi(3)) as i32 - Q6_K_OFFSET;
                o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                o[l + SUB] = d * (sc[is + SC_STEP] as i8) as f32 * q2 as f32;
                o[l + 2 * SUB] = d * (sc[is + 2 * SC_STEP] as i8) as f32 * q3 as f32;
                o[l + 3 * SUB] = d * (sc[is + 3 * SC_STEP] as i8) as f32 * q4 as f32;
            }
        }
    }
}

/// Group size and bit width of `ty`'s values written as `scale · q + min` (see
/// [`unpack_scaled_into`]), `None` for a type without that form (floats, other quants).
pub fn scaled_int_shape(ty: GgmlType) -> Option<(usize, u32)> {
    /// Values sharing one Q6_K scale.
    const Q6_K_GROUP: usize = 16;
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K => Some((QK, 4)),
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => Some((QK, 5)),
        GgmlType::Q8_0 => Some((QK, 8)),
        GgmlType::Q6_K => Some((Q6_K_GROUP, 6)),
        _ => None,
    }
}

/// Unpacks `ty`'s blocks into unsigned codes `q` (one per value, below `2^bits`) and one
/// `scale`, `min` pair per group (see [`scaled_int_shape`]), so that value `i` is
/// `scale[g] · q[i] + min[g]`, `g = i / group`: the one layout the GPU kernels read for every
/// format. Signed formats fold their offset into `min` (`d·(q − 8) = d·q − 8d`); every product
/// involved is exact in f32, so the values equal [`dequantize`]'s up to the final rounding.
pub fn unpack_scaled_into(
    ty: GgmlType,
    raw: &[u8],
    q: &mut [u8],
    scale: &mut [f32],
    min: &mut [f32],
) -> Result<(), QuantError> {
    check_len(ty, raw, q.len())?;
    let Some((group, _)) = scaled_int_shape(ty) else {
        return Err(QuantError::Unsupported(ty));
    };
    let groups = q.len() / group;
    if scale.len() != groups || min.len() != groups {
        return Err(QuantError::ByteLength {
            ty,
            n_elements: q.len(),
            expected: groups,
            found: scale.len().min(min.len()),
        });
    }
    const HALF: usize = QK / 2;
    let ts = ty.type_size();
    let blocks = raw.chunks_exact(ts);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let has_min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            let five = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
            let offset = if five { Q5_0_OFFSET } else { Q4_0_OFFSET } as f32;
            let qh_at = if has_min { 2 * F16_BYTES } else { F16_BYTES };
            let qs_at = qh_at + if five { QH_BYTES } else { 0 };
            for (((blk, q), s), m) in blocks
                .zip(q.chunks_exact_mut(QK))
                .zip(scale.iter_mut())
                .zip(min.iter_mut())
            {
                let d = half_at(blk, 0);
                *s = d;
                *m = if has_min {
                    half_at(blk, F16_BYTES)
                } else {
                    -offset * d
                };
                let qh = if five {
                    u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]])
                } else {
                    0
                };
                let qs = &blk[qs_at..qs_at + HALF];
                for j in 0..HALF {
                    let h0 = (((qh >> j) & 1) << NIBBLE_BITS) as u8;
                    let h1 = (((qh >> (j + HALF)) & 1) << NIBBLE_BITS) as u8;
                    q[j] = (qs[j] & NIBBLE) | h0;
                    q[j + HALF] = (qs[j] >> NIBBLE_BITS) | h1;
                }
            }
        }
        GgmlType::Q8_0 => {
            /// Added to the signed codes to make them unsigned.
            const I8_OFFSET: i32 = 128;
            for (((blk, q), s), m) in blocks
                .zip(q.chunks_exact_mut(QK))
                .zip(scale.iter_mut())
                .zip(min.iter_mut())
            {
                let d = half_at(blk, 0);
                *s = d;
                *m = -(I8_OFFSET as f32) * d;
                for (o, &b) in q.iter_mut().zip(&blk[F16_BYTES..]) {
                    *o = ((b as i8) as i32 + I8_OFFSET) as u8;
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            const SCALES_AT: usize = 2 * F16_BYTES;
            const SUB: usize = 32;
            let five = ty == GgmlType::Q5_K;
            let qh_at = SCALES_AT + K_SCALE_BYTES;
            let qs_at = qh_at + if five { QK_K / 8 } else { 0 };
            let per = QK_K / SUB;
            for (((blk, q), s), m) in blocks
                .zip(q.chunks_exact_mut(QK_K))
                .zip(scale.chunks_exact_mut(per))
                .zip(min.chunks_exact_mut(per))
            {
                let d = half_at(blk, 0);
                let dmin = half_at(blk, F16_BYTES);
                let (sc, mn) = k_scale_min(&blk[SCALES_AT..qh_at]);
                for j in 0..per {
                    s[j] = d * sc[j] as f32;
                    m[j] = -(dmin * mn[j] as f32);
                }
                let qh = &blk[qh_at..qs_at];
                for (c, (qs, o)) in blk[qs_at..]
                    .chunks_exact(SUB)
                    .zip(q.chunks_exact_mut(2 * SUB))
                    .enumerate()
                {
                    let (s1, s2) = (2 * c, 2 * c + 1);
                    let (lo, hi) = o.split_at_mut(SUB);
                    for l in 0..SUB {
                        let (h1, h2) = if five {
                            (
                                ((qh[l] >> s1) & 1) << NIBBLE_BITS,
                                ((qh[l] >> s2) & 1) << NIBBLE_BITS,
                            )
                        } else {
                            (0, 0)
                        };
                        lo[l] = (qs[l] & NIBBLE) | h1;
                        hi[l] = (qs[l] >> NIBBLE_BITS) | h2;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            const QL_BYTES: usize = QK_K / 2;
            const SCALES_AT: usize = QL_BYTES + QK_K / 4;
            const D_AT: usize = SCALES_AT + QK_K / 16;
            const SUB: usize = 32;
            let per = QK_K / group;
            for (((blk, q), s), m) in blocks
                .zip(q.chunks_exact_mut(QK_K))
                .zip(scale.chunks_exact_mut(per))
                .zip(min.chunks_exact_mut(per))
            {
                let d = half_at(blk, D_AT);
                // Scales run in value order: 16 values each.
                for (j, &sc) in blk[SCALES_AT..D_AT].iter().enumerate() {
                    s[j] = d * (sc as i8) as f32;
                    m[j] = -(Q6_K_OFFSET as f32) * s[j];
                }
                for h in 0..2 {
                    let ql = &blk[h * 2 * SUB..(h + 1) * 2 * SUB];
                    let qh = &blk[QL_BYTES + h * SUB..QL_BYTES + (h + 1) * SUB];
                    let o = &mut q[h * QK_K / 2..(h + 1) * QK_K / 2];
                    for l in 0..SUB {
                        let hi = |k: u32| {
                            ((qh[l] >> (TWO_BITS.count_ones() * k)) & TWO_BITS) << NIBBLE_BITS
                        };
                        o[l] = (ql[l] & NIBBLE) | hi(0);
                        o[l + SUB] = (ql[l + SUB] & NIBBLE) | hi(1);
                        o[l + 2 * SUB] = (ql[l] >> NIBBLE_BITS) | hi(2);
                        o[l + 3 * SUB] = (ql[l + SUB] >> NIBBLE_BITS) | hi(3);
                    }
                }
            }
        }
        _ => unreachable!("types without a scaled form returned above"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        let xs: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let raw = quantize_q8_0(&xs).unwrap();
        assert_eq!(raw.len(), 3 * GgmlType::Q8_0.type_size());
        let back = dequantize(GgmlType::Q8_0, &raw, xs.len()).unwrap();
        for (block, got) in xs.chunks(QK).zip(back.chunks(QK)) {
            let step = block.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
            for (a, b) in block.iter().zip(got) {
                // Half a step of rounding, plus the f16 scale's relative error.
                assert!((a - b).abs() <= 0.5 * step + a.abs() * 1e-3, "{a} vs {b}");
            }
        }
        assert!(quantize_q8_0(&xs[..40]).is_none());
        assert!(
            quantize_q8_0(&[0.0; 32]).unwrap()[2..]
                .iter()
                .all(|&q| q == 0)
        );
    }

    use super::*;

    #[test]
    fn q4_0_matches_ggml_and_round_trips() {
        // One block worked by hand: max-magnitude value -4 gives d = 0.5, codes x / 0.5 + 8.
        let mut block = [0.0f32; QK];
        block[0] = -4.0;
        block[1] = 1.0;
        block[16] = 3.5;
        block[17] = 0.26;
        let raw = quantize_q4_0(&block).unwrap();
        assert_eq!(f16::from_le_bytes([raw[0], raw[1]]).to_f32(), 0.5);
        // codes: 0 -> 0, 1.0 -> 10, 3.5 -> 15, 0.26 -> round(8.52) = 9 (ggml's +8.5 truncation).
        assert_eq!(raw[2], 15 << 4); // low nibble 0, high nibble 15
        assert_eq!(raw[3], 10 | (9 << 4));
        assert_eq!(raw[4], 8 | (8 << 4));

        let xs: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let raw = quantize(GgmlType::Q4_0, &xs).unwrap();
        assert_eq!(raw.len(), 3 * GgmlType::Q4_0.type_size());
        let back = dequantize(GgmlType::Q4_0, &raw, xs.len()).unwrap();
        for (block, got) in xs.chunks(QK).zip(back.chunks(QK)) {
            let step = block.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 8.0;
            for (a, b) in block.iter().zip(got) {
                // Half a step, except opposite the extreme where code 15 stops at 7/8 of it.
                let bound = if a.abs() > 6.5 * step {
                    step
                } else {
                    0.5 * step
                };
                assert!((a - b).abs() <= bound + a.abs() * 1e-3, "{a} vs {b}");
            }
        }
        assert!(quantize_q4_0(&xs[..40]).is_none());
        assert!(quantize(GgmlType::Q4_1, &xs).is_none());
        let f16s = quantize(GgmlType::F16, &xs[..2]).unwrap();
        assert_eq!(
            f16s,
            [
                f16::from_f32(xs[0]).to_le_bytes(),
                f16::from_f32(xs[1]).to_le_bytes()
            ]
            .concat()
        );
    }

    #[test]
    fn sizes_match_ggml() {
        assert_eq!(GgmlType::Q4_K.type_size(), 144);
        assert_eq!(GgmlType::Q5_K.type_size(), 176);
        assert_eq!(GgmlType::Q6_K.type_size(), 210);
        assert_eq!(GgmlType::Q4_1.type_size(), 20);
        assert_eq!(GgmlType::Q5_1.type_size(), 24);
        assert_eq!(GgmlType::Q8_0.type_size(), 34);
        assert_eq!(GgmlType::IQ4_XS.type_size(), 136);
        assert_eq!(GgmlType::TQ1_0.type_size(), 54);
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(*t));
        }
    }

    #[test]
    fn q8_0_simple() {
        let mut raw = vec![0u8; 34];
        raw[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        raw[2] = 2;
        raw[3] = (-4i8) as u8;
        let v = dequantize(GgmlType::Q8_0, &raw, 32).unwrap();
        assert_eq!(&v[..3], &[1.0, -2.0, 0.0]);
    }

    #[test]
    fn bad_lengths_are_errors() {
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], 31),
            Err(QuantError::NotBlockMultiple { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], 32),
            Err(QuantError::ByteLength { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q2_K, &[0; 84], 256),
            Err(QuantError::Unsupported(GgmlType::Q2_K))
        ));
    }

    #[test]
    fn scaled_ints_reproduce_dequantize() {
        // Random bytes with sane f16 scales: every scale field is overwritten with a small value.
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let types: Vec<GgmlType> = GgmlType::ALL
            .iter()
            .copied()
            .filter(|&t| scaled_int_shape(t).is_some())
            .collect();
        assert_eq!(types.len(), 8, "{types:?}");
        for ty in types {
            let (group, bits) = scaled_int_shape(ty).unwrap();
            let n = 2 * QK_K;
            let mut raw: Vec<u8> = (0..n / ty.block_size() * ty.type_size())
                .map(|_| next() as u8)
                .collect();
            let half_fields: &[usize] = match ty {
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                _ => &[208],
            };
            for blk in raw.chunks_exact_mut(ty.type_size()) {
                for &at in half_fields {
                    let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                    blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            let want = dequantize(ty, &raw, n).unwrap();
            let (mut q, mut s, mut m) =
                (vec![0u8; n], vec![0f32; n / group], vec![0f32; n / group]);
            unpack_scaled_into(ty, &raw, &mut q, &mut s, &mut m).unwrap();
            for (i, &w) in want.iter().enumerate() {
                assert!(u32::from(q[i]) < 1 << bits, "{ty}: code {} at {i}", q[i]);
                let got = s[i / group] * q[i] as f32 + m[i / group];
                assert!(
                    (got - w).abs() <= w.abs() * 1e-6,
                    "{ty} at {i}: {got} vs {w}"
                );
            }
        }
        let mut q = [0u8; 32];
        assert_eq!(
            unpack_scaled_into(GgmlType::F16, &[0; 64], &mut q, &mut [0.0], &mut [0.0]),
            Err(QuantError::Unsupported(GgmlType::F16))
        );
    }
}
