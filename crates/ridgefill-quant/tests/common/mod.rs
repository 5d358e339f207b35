//! Shared test helpers: a seeded generator, random GGUF blocks, and the f64 reference with its
//! error bound.

#![allow(dead_code)]

use half::{bf16, f16};
use ridgefill_quant::{GgmlType, QMatrix, QWeight, WeightBytes};

/// SplitMix64: small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn f32(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-1, 1).
    pub fn sym(&mut self) -> f32 {
        2.0 * self.f32() - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
    pub fn bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.u64() as u8;
        }
    }
}

/// The storage types with kernels.
pub const TYPES: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

/// Offsets of the f16 scale fields inside a block of `ty` (the rest is quant bits).
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// Block scale magnitudes: mostly ordinary, some extreme (the largest normal f16 scale divided
/// down so sums stay finite, and f16 subnormals), some zero.
fn scale(rng: &mut Rng, extreme: bool) -> f32 {
    let s = if rng.below(2) == 0 { 1.0 } else { -1.0 };
    if !extreme {
        return s * (0.002 + 0.05 * rng.f32());
    }
    match rng.below(4) {
        0 => s * 2048.0 * (1.0 + rng.f32()),
        1 => s * 1e-7 * (1.0 + rng.f32()),
        2 => 0.0,
        _ => s * 0.01,
    }
}

/// Random bytes for `rows × cols` values of `ty`: random quant bits, controlled scales, and (if
/// `extreme`) some all-zero blocks and extreme scales.
pub fn random_weight(
    rng: &mut Rng,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    extreme: bool,
) -> Vec<u8> {
    let (block, ts) = (ty.block_size(), ty.type_size());
    let n_blocks = rows * cols / block;
    let mut raw = vec![0u8; n_blocks * ts];
    match ty {
        GgmlType::F32 => {
            for c in raw.chunks_exact_mut(4) {
                let v = rng.sym()
                    * if extreme && rng.below(50) == 0 {
                        1e4
                    } else {
                        0.1
                    };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in raw.chunks_exact_mut(2) {
                let v = rng.sym()
                    * if extreme && rng.below(50) == 0 {
                        1e4
                    } else {
                        0.1
                    };
                c.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in raw.chunks_exact_mut(2) {
                let v = rng.sym()
                    * if extreme && rng.below(50) == 0 {
                        1e4
                    } else {
                        0.1
                    };
                c.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        _ => {
            for blk in raw.chunks_exact_mut(ts) {
                if extreme && rng.below(8) == 0 {
                    continue; // an all-zero block
                }
                rng.bytes(blk);
                for &at in scale_fields(ty) {
                    let v = scale(rng, extreme);
                    // Q4_1/Q5_1 mins and k-quant dmins are offsets: any sign is legal.
                    blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
                }
            }
        }
    }
    raw
}

pub fn matrix(ty: GgmlType, rows: usize, cols: usize, raw: Vec<u8>) -> QMatrix {
    QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw)).expect("valid test matrix")
}

/// Random activations `[m, cols]`: ordinary values, with (if `extreme`) outliers and zero runs.
pub fn random_x(rng: &mut Rng, m: usize, cols: usize, extreme: bool) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * cols).map(|_| rng.sym()).collect();
    if extreme {
        for row in x.chunks_exact_mut(cols) {
            match rng.below(4) {
                0 => {
                    let i = rng.below(cols);
                    row[i] = 3e3; // one huge outlier flattens its block's resolution
                }
                1 => {
                    let (a, n) = (rng.below(cols), 40.min(cols));
                    for v in row.iter_mut().skip(a).take(n) {
                        *v = 0.0;
                    }
                }
                2 => row.iter_mut().for_each(|v| *v *= 1e-6),
                _ => {}
            }
        }
    }
    x
}

/// Elements sharing one activation scale for the kernels of `ty` (1 = no activation rounding).
pub fn act_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 256,
        GgmlType::F16 | GgmlType::BF16 | GgmlType::F32 => 1,
        _ => 32,
    }
}

/// The f64 reference `y = x·Wᵀ` from the dequantised weight, with the two parts of the error an
/// implementation may make per output:
///
/// - `act`, activation rounding: the kernels use x̂ = d·q with q = round(x/d), d = amax_b/127 per
///   activation block b (32 values for the legacy formats, 256 for k-quants), so
///   |x̂ − x| ≤ d/2 per element and |Σ w·x̂ − Σ w·x| ≤ Σ_b (amax_b/254)·Σ_{k∈b}|w_k|.
///   (The product d·(x·127/amax) adds a relative 2⁻²³ per element, covered by `float`.)
/// - `float`, f32 arithmetic: every partial sum, scale product and int→float conversion rounds
///   with relative error ε = 2⁻²⁴, and a kernel chains at most about cols/8 + 64 of them into one
///   output, so we allow (cols/8 + 64)·2ε·Σ|w|·|x|.
pub struct Reference {
    pub y: Vec<f64>,
    pub act: Vec<f64>,
    pub float: Vec<f64>,
}

impl Reference {
    /// The bound against the exact product: activation rounding plus float error.
    pub fn tol(&self) -> Vec<f64> {
        self.act
            .iter()
            .zip(&self.float)
            .map(|(a, f)| a * 1.0001 + f + 1e-30)
            .collect()
    }

    /// The bound between two kernels that see the same quantised activations (only the f32
    /// summation order differs): twice the float bound, with Σ|w|·|x̂| ≤ Σ|w|·|x| + act.
    pub fn tol_same_ints(&self) -> Vec<f64> {
        self.act
            .iter()
            .zip(&self.float)
            .map(|(a, f)| 2.0 * f + 1e-4 * a + 1e-30)
            .collect()
    }
}

pub fn reference(w: &[f32], x: &[f32], m: usize, cols: usize, block: usize) -> Reference {
    let rows = w.len() / cols;
    let mut out = Reference {
        y: vec![0f64; m * rows],
        act: vec![0f64; m * rows],
        float: vec![0f64; m * rows],
    };
    let eps = (cols as f64 / 8.0 + 64.0) * 2.0 * f64::from(f32::EPSILON) / 2.0;
    for i in 0..m {
        let xr = &x[i * cols..(i + 1) * cols];
        let half_steps: Vec<f64> = if block > 1 {
            xr.chunks(block)
                .map(|b| b.iter().fold(0f64, |a, v| a.max(v.abs() as f64)) / 254.0)
                .collect()
        } else {
            vec![0.0; cols]
        };
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let (mut s, mut abs, mut q) = (0f64, 0f64, 0f64);
            for k in 0..cols {
                let (a, b) = (wr[k] as f64, xr[k] as f64);
                s += a * b;
                abs += (a * b).abs();
                q += a.abs() * half_steps[k / block.max(1)];
            }
            out.y[i * rows + r] = s;
            out.act[i * rows + r] = q;
            out.float[i * rows + r] = eps * abs;
        }
    }
    out
}

/// The reference for a stacked weight: each part with its own activation block size.
pub fn reference_stacked(w: &QWeight, x: &[f32], m: usize) -> Reference {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = Reference {
        y: vec![0f64; m * rows],
        act: vec![0f64; m * rows],
        float: vec![0f64; m * rows],
    };
    let mut start = 0;
    for p in w.parts() {
        let dense = QWeight::from(p.clone()).dequantize();
        let r = reference(&dense, x, m, cols, act_block(p.ty()));
        for i in 0..m {
            for j in 0..p.rows() {
                let (src, dst) = (i * p.rows() + j, i * rows + start + j);
                out.y[dst] = r.y[src];
                out.act[dst] = r.act[src];
                out.float[dst] = r.float[src];
            }
        }
        start += p.rows();
    }
    out
}

/// Panics with context if any output is outside its bound.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tol).enumerate() {
        let e = (g as f64 - w).abs();
        assert!(
            g.is_finite() && e <= t,
            "{what}: y[{i}] = {g}, reference {w}, error {e:e} > bound {t:e}"
        );
    }
}

/// Stacks random parts of the given types (each `rows` rows) into one weight.
pub fn stacked(
    rng: &mut Rng,
    types: &[GgmlType],
    rows: &[usize],
    cols: usize,
    extreme: bool,
) -> QWeight {
    let parts = types
        .iter()
        .zip(rows)
        .map(|(&ty, &r)| matrix(ty, r, cols, random_weight(rng, ty, r, cols, extreme)))
        .collect();
    QWeight::new(parts).expect("same cols")
}
