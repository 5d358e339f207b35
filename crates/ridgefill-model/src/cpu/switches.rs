//! Environment switches of the fused kernels: on/off against the plain burn ops, and the KV
//! cache's storage dtype.

use std::env::VarError;

use burn::backend::DispatchDevice;
use burn::tensor::{Device, FloatDType};

use crate::error::{ModelError, Result};

/// Environment variable that switches the fused kernels `off` (or `0`), to measure them against
/// the plain burn ops side by side; `on` (or `1`, or unset) leaves them where they apply.
pub const SWITCH: &str = "RIDGEFILL_CPU_KERNELS";

/// Whether the fused kernels apply: flex device, f32 activations and not switched off. A switch
/// value other than on/off is an error, not a silent default.
pub fn enabled(device: &Device, dtype: FloatDType) -> Result<bool> {
    let on = match std::env::var(SWITCH) {
        Err(VarError::NotPresent) => true,
        Ok(v) if matches!(v.as_str(), "on" | "1") => true,
        Ok(v) if matches!(v.as_str(), "off" | "0") => false,
        Ok(v) => return Err(bad_switch(&v)),
        Err(VarError::NotUnicode(v)) => return Err(bad_switch(&v.to_string_lossy())),
    };
    Ok(on && matches!(device.as_dispatch(), DispatchDevice::Flex(_)) && dtype == FloatDType::F32)
}

/// Environment variable choosing the fused path's KV cache storage: `f32` (or unset) or `f16`.
pub const KV_SWITCH: &str = "RIDGEFILL_KV_CACHE";

/// The KV storage [`KV_SWITCH`] asks for. f16 halves the bytes every decode step reads (at a few
/// hundred positions and several sequences as many as the weights) but moves logits past the
/// golden tests' tolerances against transformers, so f32 stays the default. A value other than
/// f16/f32 is an error.
pub fn kv_storage() -> Result<FloatDType> {
    match std::env::var(KV_SWITCH) {
        Err(VarError::NotPresent) => Ok(FloatDType::F32),
        Ok(v) if v == "f16" => Ok(FloatDType::F16),
        Ok(v) if v == "f32" => Ok(FloatDType::F32),
        Ok(v) => Err(bad_kv(&v)),
        Err(VarError::NotUnicode(v)) => Err(bad_kv(&v.to_string_lossy())),
    }
}

fn bad_kv(value: &str) -> ModelError {
    ModelError::Invalid(format!(
        "environment variable {KV_SWITCH}={value:?}: expected f16 or f32"
    ))
}

fn bad_switch(value: &str) -> ModelError {
    ModelError::Invalid(format!(
        "environment variable {SWITCH}={value:?}: expected on or off (1 or 0)"
    ))
}
