//! Quantised matmul kernels for CPU over GGUF block formats, so a model can keep its weights in
//! the file's formats (memory-mapped, not copied, not dequantised) and decode at llama.cpp speed.
//!
//! Why hand-written: no Rust crate offers fused dot products *on GGUF blocks as stored* (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with runtime SIMD dispatch and a low-overhead
//! thread pool. candle's kernels are tied to its own tensor and block types and compile SIMD in
//! at build time; the `gemm` crate is f32/f16 only. This crate is pure Rust (no C, no burn).
//!
//! - [`QMatrix`]: one weight `[rows = out, cols = in]` in its storage type, bytes shared through
//!   [`WeightBytes`] (e.g. a slice of an `Arc<GgufFile>`'s mapping).
//! - [`QWeight`]: several `QMatrix` stacked along the output rows (fused QKV, gate/up; parts may
//!   differ in type), with `matmul` (`y[m, rows] = x[m, cols]·Wᵀ`), `dequantize`,
//!   `dequantize_rows_into`.
//! - Activations are quantised once per call per kind needed (32-blocks with sums for the legacy
//!   formats, 256-blocks with 16-sums for the k-quants; see `act`), then integer dot products run
//!   per block, four weight rows per pass ([`SimdLevel::Avx512Vnni`] for the legacy formats,
//!   [`SimdLevel::AvxVnni`] for Q4_0/Q4_1/Q8_0 in the row-lane layout, [`SimdLevel::Avx2`];
//!   [`SimdLevel::NeonDot`] / [`SimdLevel::Neon`] for the legacy formats and k-quants on aarch64;
//!   or portable
//!   [`SimdLevel::Scalar`]); on x86-64 a batch shares each unpacked weight block between four
//!   activation rows.
//! - For large batches (`m ≥` [`QWeight::f32_path_min_m`], per type and level) row chunks are
//!   dequantised into a per-thread scratch and multiplied with the `gemm` crate's f32 GEMM instead;
//!   so are a prompt's rows at any count ([`MatmulPath::Prompt`]), and below 64 of them on x86-64
//!   without AVX-512 the scratch meets the activations in hand-written f32 dot-product tiles
//!   (`small_gemm`: the GEMM's packing and 16-row tiles cost a short prompt half its time).
//! - With AVX-512 VNNI or AVX-VNNI, Q4_0, Q4_1 and Q8_0 weights are rearranged once at load
//!   ([`QMatrix::prepared_for`]) so sixteen rows' blocks sit side by side, one row per 32-bit
//!   lane, as the kernels read them (see `lanes`; AVX-VNNI's 256-bit kernels take a tile as two
//!   halves of eight rows); other levels and types keep the file's layout.
//! - Work is split by output rows over one persistent [`pool`] (`RIDGEFILL_THREADS`).
//!
//! Not implemented: VNNI variants of the k-quant kernels and of Q5_0/Q5_1 (those run the AVX2
//! kernels at both VNNI levels), and NEON kernels for float weights (scalar on aarch64). The NEON
//! kernels are checked under qemu (`scripts/check-aarch64.sh`, run by CI), not
//! measured on ARM hardware.

mod act;
mod bytes;
mod dequant;
mod kernels;
mod lanes;
pub mod pool;
mod simd;
mod small_gemm;
mod weight;

pub use bytes::WeightBytes;
pub use ridgefill_io::GgmlType;
pub use simd::{SIMD_ENV, SimdLevel};
pub use small_gemm::{dot_tiles, has_dot_tiles};
pub use weight::{MatmulConfig, MatmulPath, QError, QMatrix, QWeight};

// A model shares its weights across threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<QWeight>();
    send_sync::<QMatrix>();
    send_sync::<WeightBytes>();
};
