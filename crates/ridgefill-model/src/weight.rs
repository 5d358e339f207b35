//! Projection and embedding weights: a dense tensor on the device, or GGUF blocks as stored in
//! the file (memory-mapped, never dequantised as a whole) for the quantised CPU kernels of
//! `ridgefill-quant`.

use std::sync::Arc;

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use ridgefill_quant::{MatmulPath, QWeight};

use crate::packed::PackedWeight;

/// Fewest rows a reused prefill runs on the CPU kernels: up to four rows attend as decode rows
/// (dot products over the stored cache) and the row-lane matmul kernels start at four rows; from
/// here prompt rows also take a long prompt's matmul path ([`Rows::Prompt`]). From 8 rows
/// SmolLM2's reused prefill gave the cold prefill's logits exactly on AVX-512 VNNI, where 1–4
/// rows moved them by 0.39–0.47 (`tests/native_weights.rs`).
pub const REUSE_FLOOR_ROWS: usize = 8;

/// What a matmul's rows are, for the quantised CPU kernels' choice of path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Prompt rows: from [`REUSE_FLOOR_ROWS`] rows on they
    /// take the path a long prompt's chunks take (no 8-bit activations where those take the f32
    /// GEMM), so a follow-up turn's few new rows round as a cold prefill's would.
    Prompt,
    /// Decode steps and the head's last row: the fastest path for their number.
    Fastest,
}

/// How a checkpoint's weights are held (`--weights`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// GGUF weights in their block formats, read by the quantised CPU kernels (flex with f32
    /// activations) or packed for the GPU kernel (`packed.rs`); Hugging Face checkpoints, and
    /// flex at f16/bf16, dense at the model's dtype.
    #[default]
    Native,
    /// Dequantised at load to f16 blocks for the CPU kernels (dense elsewhere).
    F16,
    /// Quantised at load to Q8_0 blocks for the CPU or GPU kernels (Hugging Face checkpoints).
    Q8,
    /// Dequantised at load to dense tensors at the model's dtype.
    F32,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 4] = [Self::Native, Self::F16, Self::Q8, Self::F32];

    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::F16 => "f16",
            Self::Q8 => "q8",
            Self::F32 => "f32",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.name() == s)
    }

    /// The block type weights are converted to at load (f16, q8), `None` where they are kept
    /// as stored (native) or dense (f32).
    pub fn load_type(self) -> Option<ridgefill_io::quant::GgmlType> {
        use ridgefill_io::quant::GgmlType;
        match self {
            Self::F16 => Some(GgmlType::F16),
            Self::Q8 => Some(GgmlType::Q8_0),
            Self::Native | Self::F32 => None,
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One weight matrix.
// A few per layer: boxing the tensor would only add an indirection to every matmul.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum Weight {
    /// A projection stored `[in, out]` (`x · w`); the embedding `[vocab, hidden]`.
    Dense(Tensor<2>),
    /// Blocks `[out, in]` row by row (the embedding: `[vocab, hidden]`), on the host: projections
    /// only for the flex device; on GPU devices, the embedding, whose rows are gathered on the host.
    Blocks(Arc<QWeight>),
    /// Codes and scales on a GPU device, read by the packed-weight kernel.
    Packed(Arc<PackedWeight>),
}

impl Weight {
    /// `[in, out]` of a projection.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Weight::Dense(t) => t.dims(),
            Weight::Blocks(q) => [q.cols(), q.rows()],
            Weight::Packed(p) => [p.cols, p.rows],
        }
    }

    /// A projection from blocks as `device` runs it: the blocks themselves for the CPU kernels,
    /// packed onto a GPU; `None` where a GPU cannot pack them (F16 or BF16 parts stay dense).
    pub fn from_blocks(q: Arc<QWeight>, device: &Device) -> Option<Weight> {
        if crate::device::is_flex(device) {
            return Some(Weight::Blocks(q));
        }
        PackedWeight::pack(&q, device).map(|p| Weight::Packed(Arc::new(p)))
    }

    /// The projection as a dense `[in, out]` tensor (block weights dequantised): for the fill's
    /// own-projection maps and for tests, never on a hot path.
    pub fn dense(&self, device: &Device, dtype: FloatDType) -> Tensor<2> {
        match self {
            Weight::Dense(t) => t.clone(),
            Weight::Blocks(q) => {
                let data = TensorData::new(q.dequantize(), [q.rows(), q.cols()]);
                Tensor::<2>::from_data(data, device).transpose().cast(dtype)
            }
            Weight::Packed(p) => p.dense().cast(dtype),
        }
    }

    /// The embedding as a dense `[vocab, hidden]` tensor (block weights dequantised): tests only.
    pub fn embedding_dense(&self, device: &Device, dtype: FloatDType) -> Tensor<2> {
        match self {
            Weight::Dense(t) => t.clone(),
            Weight::Blocks(q) => {
                let data = TensorData::new(q.dequantize(), [q.rows(), q.cols()]);
                Tensor::<2>::from_data(data, device).cast(dtype)
            }
            Weight::Packed(p) => p.dense().transpose().cast(dtype),
        }
    }

    /// `x · w` by the kernel that holds this weight: the quantised CPU kernels for blocks, the
    /// packed-weight kernel on a GPU, and for dense weights the flex GEMM without burn-flex's
    /// extra output passes when `cpu_kernels` (else burn's matmul).
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]` → `[m, n]`
    pub fn matmul(&self, x: Tensor<2>, rows: Rows, cpu_kernels: bool) -> Tensor<2> {
        match self {
            Weight::Dense(w) => dense_matmul(x, w, None, cpu_kernels),
            Weight::Blocks(q) => block_matmul(x, q, None, rows),
            Weight::Packed(p) => p.matmul(x),
        }
    }

    /// [`Weight::matmul`] added to a residual stream (fused into the kernel's output pass on
    /// the CPU).
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
    pub fn matmul_add(
        &self,
        x: Tensor<2>,
        residual: Tensor<2>,
        rows: Rows,
        cpu_kernels: bool,
    ) -> Tensor<2> {
        match self {
            Weight::Dense(w) => dense_matmul(x, w, Some(residual), cpu_kernels),
            Weight::Blocks(q) => block_matmul(x, q, Some(residual), rows),
            Weight::Packed(p) => residual + p.matmul(x),
        }
    }

    /// Bytes the weight keeps resident (mapped file pages for block weights).
    pub fn resident_bytes(&self) -> usize {
        match self {
            Weight::Dense(t) => t.shape().num_elements() * t.dtype().size(),
            Weight::Blocks(q) => q.bytes(),
            Weight::Packed(p) => p.bytes(),
        }
    }

    /// Whether the weight is held quantised: blocks for the CPU kernels or packed on a GPU.
    pub fn is_blocks(&self) -> bool {
        matches!(self, Weight::Blocks(_) | Weight::Packed(_))
    }

    /// Rows `ids` of an embedding, `[ids.len(), hidden]`.
    pub(crate) fn gather_rows(&self, ids: &[u32], device: &Device, dtype: FloatDType) -> Tensor<2> {
        let table = match self {
            Weight::Dense(t) => t.clone(),
            // Embeddings stay blocks on every device; a packed table is only ever a head.
            Weight::Packed(p) => p.dense().transpose().cast(dtype),
            Weight::Blocks(q) => {
                let d = q.cols();
                let mut out = vec![0.0f32; ids.len() * d];
                for (row, &id) in out.chunks_exact_mut(d).zip(ids) {
                    // Ids were checked against the vocabulary by the caller.
                    q.dequantize_rows_into(id as usize, row)
                        .expect("embedding row within the vocabulary");
                }
                return Tensor::<2>::from_data(TensorData::new(out, [ids.len(), d]), device)
                    .cast(dtype);
            }
        };
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let n = ids.len();
        let ids = Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(ids, [n]), device);
        table.select(0, ids)
    }
}

/// `x · w` (plus `residual`) for a dense `[k, n]` tensor: the flex GEMM when `cpu_kernels` and
/// the dtypes agree, else burn's matmul.
///
/// # Shapes
/// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
pub fn dense_matmul(
    x: Tensor<2>,
    w: &Tensor<2>,
    residual: Option<Tensor<2>>,
    cpu_kernels: bool,
) -> Tensor<2> {
    #[cfg(feature = "flex")]
    if cpu_kernels && w.dtype() == x.dtype() {
        return match residual {
            Some(r) => crate::cpu::matmul_add(x, w, r),
            None => crate::cpu::matmul(x, w),
        };
    }
    let _ = cpu_kernels;
    let y = x.matmul(w.clone());
    match residual {
        Some(r) => r + y,
        None => y,
    }
}

/// `x · Wᵀ` (plus `residual`) through the quantised CPU kernels; block weights are only loaded
/// for flex.
///
/// # Shapes
/// - x: `[m, k]`, w: `[n, k]` blocks, residual: `[m, n]` → `[m, n]`
fn block_matmul(x: Tensor<2>, w: &QWeight, residual: Option<Tensor<2>>, rows: Rows) -> Tensor<2> {
    #[cfg(feature = "flex")]
    {
        let path = match rows {
            Rows::Prompt if x.dims()[0] >= REUSE_FLOOR_ROWS => MatmulPath::Prompt,
            _ => MatmulPath::Auto,
        };
        crate::cpu::qmatmul(x, w, residual, path)
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (x, w, residual, rows);
        unreachable!("block weights are loaded only for the flex device")
    }
}
