//! Fused f32 kernels for the flex (CPU) backend.
//!
//! burn-flex runs elementwise ops on one thread and its attention scores and exponentiates every
//! causally masked entry; profiling pp512 put over a third of prefill there
//! (docs/history/BENCHMARKS-history.md).
//! These kernels do the same maths row-parallel, skip the masked half, and leave every matmul to
//! `gemm`, the GEMM flex itself uses. The model calls them only when [`enabled`] says the device is
//! flex and the activations f32; everywhere else it runs the backend-free burn ops.
//!
//! By concern: [`switches`] (the environment switches), [`flex`] (burn-flex tensors in and out),
//! [`simd`] (the one SIMD rule, the vectorising macro and the reductions), [`par`] (row-parallel
//! work on the shared pool), [`gemm`], [`rows`] (norms, SwiGLU, RoPE, the fill's K/V writes) and
//! [`attention`] (with its x86 group kernel). Dependencies run one way: nothing imports this file.

pub mod attention;
mod flex;
pub mod gemm;
mod par;
pub mod rows;
pub mod simd;
pub mod switches;

pub use attention::{AttnItem, attention_many, attention_received};
pub use flex::narrow_kv;
pub use gemm::{matmul, matmul_add, qmatmul};
pub use rows::{Rotation, fill_kv, fill_kv_into, qkv_rope, rms_norm, swiglu};
pub use simd::exp_shifted;
pub use switches::{KV_SWITCH, SWITCH, enabled, kv_storage};
