//! GGUF block weights for GPU backends: every block format rewritten once, at load, as unsigned
//! integer codes packed into 32-bit words with one f32 `scale`, `min` pair per group of values
//! (`w = scale · q + min`, see `ridgefill_io::quant::unpack_scaled_into`). One layout lets one
//! hand-written kernel (`gpu.rs`) read Q4_0 … Q6_K without a dequantised copy; burn's own
//! quantised tensors have no scheme with a min (Q4_1, the k-quants) and its Q4 matmul on wgpu
//! needs more shared memory than many devices have (burn issue #4492).

use burn::tensor::{Device, Int, Tensor, TensorData};
use ridgefill_io::quant::{scaled_int_shape, unpack_scaled_into};
use ridgefill_quant::QWeight;

/// Bits of one stored word.
const WORD_BITS: u32 = 32;
/// Code widths the kernel reads: nibbles where every part fits them, else bytes.
const NIBBLE: u32 = 4;
const BYTE: u32 = 8;
/// Activation rows up to which the packed kernel runs (decode, batched decode): it reads the
/// weight once per 8 rows, where a longer prefill decodes it once into burn's GEMM instead.
pub const KERNEL_MAX_ROWS: usize = 32;

/// A projection `[out, in]` as packed codes and per-group scales on the device.
#[derive(Clone)]
pub struct PackedWeight {
    /// Codes row after row, `32 / bits` to a word, lowest bits first (`i32` bit patterns).
    pub words: Tensor<1, Int>,
    /// One scale per `group` values, row after row.
    pub scales: Tensor<1>,
    /// One offset per `group` values.
    pub mins: Tensor<1>,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Bits per code: 4 or 8.
    pub bits: u32,
    /// Values sharing one scale: 32, or 16 where a part is Q6_K.
    pub group: usize,
    /// The block formats packed, for reports.
    pub formats: Vec<&'static str>,
}

impl PackedWeight {
    /// `q`'s parts packed for the GPU, or `None` if a part has no scaled-integer form (F16,
    /// BF16: those stay dense) or its rows are not whole groups.
    pub fn pack(q: &QWeight, device: &Device) -> Option<PackedWeight> {
        let shapes: Vec<(usize, u32)> = q
            .parts()
            .iter()
            .map(|p| scaled_int_shape(p.ty()))
            .collect::<Option<_>>()?;
        let group = shapes.iter().map(|s| s.0).min()?;
        let bits = if shapes.iter().all(|s| s.1 <= NIBBLE) {
            NIBBLE
        } else {
            BYTE
        };
        let (rows, cols) = (q.rows(), q.cols());
        if !cols.is_multiple_of(group) || q.parts().iter().any(|p| p.is_row_lanes()) {
            return None;
        }
        let per_word = (WORD_BITS / bits) as usize;
        let mut words = Vec::with_capacity(rows * cols / per_word);
        let mut scales = Vec::with_capacity(rows * cols / group);
        let mut mins = Vec::with_capacity(rows * cols / group);
        let mut formats = Vec::new();
        for (part, &(part_group, _)) in q.parts().iter().zip(&shapes) {
            let n = part.rows() * part.cols();
            let (mut codes, mut s, mut m) = (
                vec![0u8; n],
                vec![0f32; n / part_group],
                vec![0f32; n / part_group],
            );
            // Sizes were checked when the matrix was built.
            unpack_scaled_into(part.ty(), part.raw(), &mut codes, &mut s, &mut m).ok()?;
            // A wider group splits into narrower ones sharing its scale.
            let repeat = part_group / group;
            scales.extend(s.iter().flat_map(|&v| std::iter::repeat_n(v, repeat)));
            mins.extend(m.iter().flat_map(|&v| std::iter::repeat_n(v, repeat)));
            words.extend(codes.chunks_exact(per_word).map(|c| {
                let w = c
                    .iter()
                    .enumerate()
                    .fold(0u32, |w, (j, &v)| w | (u32::from(v) << (j as u32 * bits)));
                w as i32
            }));
            let name = part.ty().name();
            if !formats.contains(&name) {
                formats.push(name);
            }
        }
        let upload = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<1>::from_data(TensorData::new(v, [n]), device)
        };
        let n_words = words.len();
        Some(PackedWeight {
            words: Tensor::<1, Int>::from_data(TensorData::new(words, [n_words]), device),
            scales: upload(scales),
            mins: upload(mins),
            rows,
            cols,
            bits,
            group,
            formats,
        })
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        let groups = self.rows * self.cols / self.group;
        self.rows * self.cols * self.bits as usize / 8 + 2 * groups * size_of::<f32>()
    }

    /// `x · Wᵀ` with the codes decoded inside the kernel (never a dense copy of the weight).
    ///
    /// # Shapes
    /// - x: `[m, in]` → `[m, out]`, in x's dtype
    pub fn matmul(&self, x: Tensor<2>) -> Tensor<2> {
        // Past a few rows the weight is better decoded once into burn's tuned GEMM: one
        // projection's transient f32 copy, never all of them.
        if x.dims()[0] > KERNEL_MAX_ROWS {
            let dtype: burn::tensor::FloatDType = x.dtype().into();
            return x.matmul(self.dense().cast(dtype));
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        return crate::gpu::packed_matmul(
            x,
            crate::gpu::PackedCodes {
                words: &self.words,
                scales: &self.scales,
                mins: &self.mins,
                rows: self.rows,
                bits: self.bits,
                group: self.group,
            },
        );
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = x;
            unreachable!("packed weights are built only for GPU devices")
        }
    }

    /// The weight dequantised to a dense `[in, out]` f32 tensor with burn ops (fill maps, tests).
    pub fn dense(&self) -> Tensor<2> {
        let per_word = (WORD_BITS / self.bits) as i64;
        let mask = (1i64 << self.bits) - 1;
        let n_words = self.rows * self.cols / per_word as usize;
        let device = self.words.device();
        let shifts: Vec<i32> = (0..per_word as i32).map(|j| j * self.bits as i32).collect();
        let shifts =
            Tensor::<1, Int>::from_data(TensorData::new(shifts, [per_word as usize]), &device);
        let codes = self
            .words
            .clone()
            .reshape([n_words, 1])
            .bitwise_right_shift(shifts.reshape([1, per_word as usize]))
            .bitwise_and_scalar(mask)
            .float()
            .reshape([self.rows * self.cols / self.group, self.group]);
        let groups = self.rows * self.cols / self.group;
        let w = codes * self.scales.clone().reshape([groups, 1])
            + self.mins.clone().reshape([groups, 1]);
        w.reshape([self.rows, self.cols]).transpose()
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use std::sync::Arc;

    use burn::tensor::{Device, DeviceKind, Tensor, TensorData};
    use ridgefill_io::quant::GgmlType;
    use ridgefill_quant::{QMatrix, QWeight, WeightBytes};

    use super::PackedWeight;

    /// Random blocks of `ty` with f16 scale fields in ±1 (`halves`: their byte offsets).
    fn blocks(ty: GgmlType, rows: usize, cols: usize, halves: &[usize], seed: &mut u64) -> QMatrix {
        let n = rows * cols / ty.block_size() * ty.type_size();
        let mut raw: Vec<u8> = (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (*seed >> 33) as u8
            })
            .collect();
        for blk in raw.chunks_exact_mut(ty.type_size()) {
            for &at in halves {
                let v = (blk[at] as f32 - 128.0) / 1024.0;
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw)).unwrap()
    }

    /// The packed kernel against the host dequantisation and an f32 matmul, for every format
    /// and a fused weight of mixed formats, at decode and prefill row counts.
    #[test]
    fn packed_matmul_matches_dequantised() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let mut seed = 7u64;
        let (k, n) = (512, 48);
        let cases: Vec<Vec<QMatrix>> = vec![
            vec![blocks(GgmlType::Q4_0, n, k, &[0], &mut seed)],
            vec![blocks(GgmlType::Q4_1, n, k, &[0, 2], &mut seed)],
            vec![blocks(GgmlType::Q5_0, n, k, &[0], &mut seed)],
            vec![blocks(GgmlType::Q5_1, n, k, &[0, 2], &mut seed)],
            vec![blocks(GgmlType::Q8_0, n, k, &[0], &mut seed)],
            vec![blocks(GgmlType::Q4_K, n, k, &[0, 2], &mut seed)],
            vec![blocks(GgmlType::Q5_K, n, k, &[0, 2], &mut seed)],
            vec![blocks(GgmlType::Q6_K, n, k, &[208], &mut seed)],
            vec![
                blocks(GgmlType::Q4_K, n, k, &[0, 2], &mut seed),
                blocks(GgmlType::Q6_K, 16, k, &[208], &mut seed),
                blocks(GgmlType::Q4_1, 8, k, &[0, 2], &mut seed),
            ],
        ];
        for parts in cases {
            let q = Arc::new(QWeight::new(parts).unwrap());
            let p = PackedWeight::pack(&q, &device).unwrap();
            let want_w = q.dequantize();
            // One pass, one pass of a partial tile, three passes, the GEMM route.
            for m in [1, 3, 8, 21, 40] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919 % 997) as f32 / 498.5) - 1.0)
                    .collect();
                let xt = Tensor::<2>::from_data(TensorData::new(x.clone(), [m, k]), &device);
                let got = crate::to_host_f32(p.matmul(xt.clone()));
                let dense = crate::to_host_f32(xt.matmul(p.dense()));
                for r in 0..m {
                    for c in 0..q.rows() {
                        let want: f64 = (0..k)
                            .map(|i| f64::from(x[r * k + i]) * f64::from(want_w[c * k + i]))
                            .sum();
                        let scale: f64 = (0..k)
                            .map(|i| (f64::from(x[r * k + i]) * f64::from(want_w[c * k + i])).abs())
                            .sum();
                        let tol = 1e-5 * scale + 1e-6;
                        let (g, d) = (
                            f64::from(got[r * q.rows() + c]),
                            f64::from(dense[r * q.rows() + c]),
                        );
                        assert!(
                            (g - want).abs() <= tol,
                            "{:?} m={m} [{r},{c}]: {g} vs {want}",
                            p.formats
                        );
                        assert!(
                            (d - want).abs() <= tol,
                            "{:?} dense m={m} [{r},{c}]: {d} vs {want}",
                            p.formats
                        );
                    }
                }
            }
        }
    }
}
