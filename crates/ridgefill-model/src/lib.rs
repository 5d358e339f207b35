//! Backend-free decoder-only models on burn 0.22: the `Device` picks the backend at run time.
//!
//! The model owns only weights; the KV cache and positions live outside it ([`KvCache`]), so one
//! loaded model serves full prefill, skip-and-fill prefill, decode and scoring alike.

pub mod cache;
#[cfg(feature = "flex")]
pub mod cpu;
pub mod decoder;
pub mod device;
pub mod error;
pub mod eval;
pub mod fill;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
pub mod packed;
pub mod probe;
pub mod rope;
pub mod sample;
pub mod synthetic;
pub mod weight;

pub use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
pub use cache::KvCache;
pub use decoder::{Decoder, LoadOptions};
pub use device::{DeviceChoice, DeviceInfo, select_device};
pub use error::{ModelError, Result};
pub use sample::{Sampler, SamplerConfig};
pub use weight::{Weight, WeightFormat};

/// A dtype's short name: f32, f16, bf16.
pub fn dtype_name(d: FloatDType) -> &'static str {
    match d {
        FloatDType::F16 => "f16",
        FloatDType::BF16 => "bf16",
        FloatDType::F64 => "f64",
        _ => "f32",
    }
}

/// Copies a tensor back to the host as `f32` (whatever its dtype on the device).
pub fn to_host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("converted tensor data is f32")
}
